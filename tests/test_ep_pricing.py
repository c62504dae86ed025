"""Expert parallelism in the cost model, the search, the CLI and the exports: the token exchange's bytes
and collectives (`costmodels.expert_parallel`), the busiest rank's expert GEMMs under an imbalance or
capacity factor, memory per rank over ep, the experts a decode step reaches, pinned --ep refused in
one line, dense models untouched, Mixtral-8x7B on 64 H100s choosing EP, and the export flags."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from pathlib import Path

import pytest

from costmodels.cluster import cluster_for_ranks, load_cluster
from costmodels.comm import (
    Group,
    all_gather_time_s,
    all_reduce_time_s,
    all_to_all_time_s,
    reduce_scatter_time_s,
)
from costmodels.expert_parallel import (
    COUNT_BYTES,
    DEFAULT_MOE_IMBALANCE,
    all_to_all_exchange_s,
    busiest_load_factor,
    dispatch_bytes,
    local_touched_experts,
    touched_experts,
)
from planner.cli.main import main
from planner.cli.render import options_text
from planner.cli.workflow import prepare
from planner.errors import InfeasibleError, InputError
from planner.export import export_plan
from planner.frontend.analysis import Role
from planner.plan import DataParallel, MeshShape, Plan, Workload
from planner.solver.costing import (
    CostContext,
    build_layer_graph,
    expert_activation_bytes,
    expert_comm_time_s,
    expert_gemm_time_s,
    expert_shard_comm_s,
    expert_share,
    expert_split,
    expert_tp_reduce_s,
    layer_node_times_s,
    moe_rows_sharded,
    moe_sequence_gather_bytes,
    moe_tokens,
    transient_bytes,
)
from planner.solver.problem import Constraints, MeshConfig, WorkloadSpec
from planner.solver.search import _ep_options, plan_model
from tests.planner_fixtures import EXAMPLES, analysed_llama

MODELS = Path(__file__).parent / "models"


@functools.cache
def _structure(path: str, workload: str, batch: int, seq: int):
    return prepare(path, workload, batch, seq).structure


def _tiny():
    """tests/models/tiny_moe_gptfast.py: 4 stacked experts, top-2, hidden 32, expert width 48."""
    return _structure(str(MODELS / "tiny_moe_gptfast.py"), "train", 8, 16)


def _mixtral():
    """examples/mixtral_8x7b.py at 256 x 4096 tokens (the layers traced on meta, two of them)."""
    return _structure(str(EXAMPLES / "mixtral_8x7b.py"), "train", 256, 4096)


def _ctx(structure, mesh: MeshShape, ep: int = 1, fold: str = "dp", cluster: str = "dgx-h100", **workload):
    spec = cluster_for_ranks(load_cluster(cluster), mesh.num_devices)
    work = WorkloadSpec(workload.pop("kind", "train"), workload.pop("batch", 256), workload.pop("seq", 4096),
                        dtype="bf16", **workload)  # fmt: skip
    config = MeshConfig(mesh, 1, ep=ep, ep_fold=fold)
    return CostContext(structure, spec, work, config, "bf16")


def _moe_layer(structure):
    return next(layer for layer in structure.layers if layer.moe is not None)


def test_dispatch_bytes_and_the_exchange_are_top_k_tokens_hidden_each_way() -> None:
    """Per rank: top_k x tokens x H x b bytes dispatched and combined; forward the E counts and the two,
    training two more; over tp one all-reduce of tokens x H each way instead."""
    assert dispatch_bytes(2, 4096, 4096, 2) == 2 * 4096 * 4096 * 2
    assert dispatch_bytes(2, 4096, 4096, 2, load=1.5) == pytest.approx(1.5 * 2 * 4096 * 4096 * 2)
    spec, group = load_cluster("dgx-h100"), Group(8, 8)
    data = all_to_all_time_s(64e6, group, spec)
    counts = all_to_all_time_s(8 * COUNT_BYTES, group, spec)
    assert all_to_all_exchange_s(64e6, 8, group, spec, train=False) == pytest.approx(counts + 2 * data)
    assert all_to_all_exchange_s(64e6, 8, group, spec, train=True) == pytest.approx(counts + 4 * data)
    assert all_to_all_exchange_s(64e6, 8, Group(1, 1), spec, train=True) == 0.0
    s = _mixtral()
    layer = _moe_layer(s)
    ctx = _ctx(s, MeshShape(1, 1, 64), ep=8, cluster="h100-ib-128node", batch=64, seq=4096)
    assert ctx.ep_group() == Group(8, 8)  # eight consecutive data-parallel ranks: one node
    expected = all_to_all_exchange_s(dispatch_bytes(2, 4096, 4096, 2), 8, Group(8, 8), ctx.cluster, True)
    assert expert_comm_time_s(layer, ctx) == pytest.approx(expected)
    tp = _ctx(s, MeshShape(8, 1, 1), ep=8, fold="tp", batch=1, seq=4096)
    reduce = all_reduce_time_s(4096 * 4096 * 2, tp.tp_group(), tp.cluster)
    assert expert_comm_time_s(layer, tp) == pytest.approx(2 * reduce)
    assert expert_comm_time_s(layer, _ctx(s, MeshShape(1, 1, 8), ep=1, batch=8)) == 0.0


def test_imbalance_moves_the_busiest_ranks_expert_gemms_and_capacity_caps_it() -> None:
    s = _mixtral()
    layer = _moe_layer(s)
    mesh = MeshShape(1, 1, 8)
    balanced = expert_gemm_time_s(layer, _ctx(s, mesh, ep=8, batch=8))
    skewed = expert_gemm_time_s(layer, _ctx(s, mesh, ep=8, batch=8, moe_imbalance=1.5))
    assert DEFAULT_MOE_IMBALANCE == 1.0
    assert 1.3 < skewed / balanced <= 1.5 + 1e-9  # compute-bound GEMMs: ~1.5x the rows
    capped = expert_gemm_time_s(
        layer, _ctx(s, mesh, ep=8, batch=8, moe_imbalance=1.5, moe_capacity_factor=1.25)
    )
    assert balanced < capped < skewed
    assert busiest_load_factor(1.5, 1.25, 8) == 1.25 and busiest_load_factor(1.5, None, 1) == 1.0
    assert busiest_load_factor(50.0, None, 2) == 2.0  # no routing puts more than every row on one rank
    # one EP rank computes every row whatever the routing: the factor means nothing there
    whole = _ctx(s, mesh, ep=1, batch=8)
    assert expert_gemm_time_s(layer, whole) == expert_gemm_time_s(
        layer, _ctx(s, mesh, ep=1, batch=8, moe_imbalance=2)
    )
    # over tp, each rank computes its E / ep experts' share of the rows
    tp = _ctx(s, MeshShape(8, 1, 1), ep=8, fold="tp", batch=1)
    assert expert_share(layer.moe, tp).rows == pytest.approx(2 * 4096 / 8)


def test_memory_per_rank_falls_with_ep_and_the_experts_state_shards_over_edp() -> None:
    s = _mixtral()
    layer = _moe_layer(s)
    mesh = MeshShape(1, 1, 64)
    static = {
        ep: build_layer_graph(layer, _ctx(s, mesh, ep=ep, batch=64)).fixed_static_bytes for ep in (1, 2, 4, 8)
    }
    assert static[1] > static[2] > static[4] > static[8]
    expert_state = layer.moe.expert_params * 16  # bf16 weights and grads, fp32 Adam and master: 16 B
    assert static[1] - static[8] == pytest.approx(expert_state * (1 - 1 / 8), rel=1e-3)
    # zero1 shards the experts' Adam state over the 64 / 8 ranks holding the same experts, not 64
    ctx = _ctx(s, mesh, ep=8, batch=64)
    zero1 = dataclasses.replace(ctx, config=dataclasses.replace(ctx.config, dp_style=DataParallel.ZERO1))
    experts = zero1.experts_context()
    assert experts.dp_cp == 8 and experts.state_shards == 8 and zero1.state_shards == 64
    assert experts.dp_group().size == 8
    graph = build_layer_graph(layer, zero1)
    assert graph.expert_grad_bytes == pytest.approx(layer.moe.expert_params / 8 * 2)
    assert graph.expert_static_bytes == pytest.approx(layer.moe.expert_params / 8 * (4 + 12 / 8))


def test_a_decode_step_reads_the_experts_its_tokens_reach() -> None:
    """E (1 - (1 - k/E)^n) experts reached by n tokens; the busiest rank reads its share, rounded up."""
    assert touched_experts(128, 8, 1) == pytest.approx(8)
    assert touched_experts(128, 8, 32) == pytest.approx(128 * (1 - (120 / 128) ** 32))
    assert touched_experts(8, 2, 100000) == pytest.approx(8)
    assert local_touched_experts(128, 8, 1, 8) == 1.0  # 8 experts over 8 ranks
    assert local_touched_experts(128, 8, 1000, 8) == 16.0  # all of its 16
    s = _mixtral()
    layer = _moe_layer(s)
    # EP 2 over 2 ranks (the expert pass runs grouped GEMMs): a token per rank reaches 2 of the rank's 4
    # experts, 64 per rank all 4; memory-bound, so twice the time, not 64x
    one = _ctx(s, MeshShape(1, 1, 2), ep=2, kind="decode", batch=2, seq=1, context=1024)
    many = _ctx(s, MeshShape(1, 1, 2), ep=2, kind="decode", batch=128, seq=1, context=1024)
    assert expert_share(layer.moe, one).touched == 2.0 and expert_share(layer.moe, many).touched == 4.0
    ratio = expert_gemm_time_s(layer, many) / expert_gemm_time_s(layer, one)
    assert 1.8 < ratio < 2.2


def test_experts_no_pass_rewrites_are_priced_as_the_model_computes_them() -> None:
    """EP 1, experts whole: the model's own expert code runs, and is priced node by node. gpt-fast's
    `w1[expert_indices]` gathers a copy of an expert's weights per token and choice, so a decode step of
    64 sequences reads 64x the weights one reads (the grouped GEMMs of the expert pass would read each
    expert once), and a training step keeps those copies for backward."""
    s = _mixtral()
    layer = _moe_layer(s)
    one = _ctx(s, MeshShape(1, 1, 1), kind="decode", batch=1, seq=1, context=1024)
    many = _ctx(s, MeshShape(1, 1, 1), kind="decode", batch=64, seq=1, context=1024)
    assert not one.experts_rewritten and expert_gemm_time_s(layer, one) == 0.0
    experts_one, experts_many = (layer_node_times_s(layer, c)["experts"] for c in (one, many))
    assert 55 < experts_many / experts_one < 66
    # training: each token's 2 gathered copies of w1, w3 (I x H) and w2 (H x I) are kept for backward
    train = _ctx(s, MeshShape(1, 1, 1), batch=1, seq=64)
    gathered = 64 * 2 * 3 * 14336 * 4096 * 2
    assert gathered < expert_activation_bytes(layer, train) < 1.05 * gathered
    # the expert pass's grouped GEMMs keep their rows only
    split = _ctx(s, MeshShape(1, 1, 2), ep=2, batch=2, seq=64)
    assert split.experts_rewritten and expert_activation_bytes(layer, split) < gathered / 1000
    # per row: its input and output (C), the gate and up outputs, the SiLU and the product (I) (SwiGLU)
    per_row = 2 * 4096 + 4 * 14336
    rows = expert_share(layer.moe, split).rows
    assert expert_activation_bytes(layer, split) == pytest.approx(rows * per_row * split.bytes_per_element)


def test_a_forward_of_experts_the_model_runs_itself_holds_the_gathered_weights_of_one_gemm() -> None:
    """Inference with EP 1 and whole experts: gpt-fast's `w1[expert_indices]` copies an expert matrix per
    token and choice for one GEMM at a time, nothing kept after it: the working memory of a forward of
    64 tokens is one GEMM's 128 copies (the largest, plus its operand and output), far above the stream's
    live activations; with the expert pass (EP 2) none (it ran out of an H100's memory unpriced: HF
    OLMoE's prefill of 2,048 tokens gathers 128 GiB)."""
    s = _mixtral()
    forward = _ctx(s, MeshShape(1, 1, 1), kind="forward", batch=1, seq=64)
    copies = 64 * 2 * 14336 * 4096 * 2  # one of w1, w3, w2: 128 copies of 14,336 x 4,096 in bf16
    assert not forward.experts_rewritten
    assert copies < transient_bytes(forward) < 1.05 * copies
    split = _ctx(s, MeshShape(1, 1, 2), ep=2, kind="forward", batch=2, seq=64)
    assert split.experts_rewritten and transient_bytes(split) < copies / 1000


def test_whole_experts_that_do_not_fit_name_the_expert_pass_in_the_refusal() -> None:
    """Training with --ep 1 --expert-tp 1: gpt-fast Mixtral's own experts gather an expert matrix per token
    and choice, hundreds of GiB per MoE layer and micro-batch, which no mesh holds; the refusal names the
    expert pass first, with that size (it suggested only more devices and micro-batches)."""
    with pytest.raises(InfeasibleError) as e:
        plan_model(
            _mixtral(), load_cluster("h100-ib-128node"), WorkloadSpec("train", 256, 4096, dtype="bf16"),
            Constraints(max_devices=64, ep=1, expert_tp=1),
        )  # fmt: skip
    assert "would fit: the expert pass (--ep, or --expert-tp with --tp)" in str(e.value)
    assert re.search(r"hold \d+\.\d GiB per micro-batch \(an expert matrix gathered", str(e.value))


def test_a_pinned_ep_that_cannot_run_is_refused_in_one_line_naming_both_numbers() -> None:
    s, cluster = _tiny(), load_cluster("dgx-h100")
    work = WorkloadSpec("train", 8, 16, dtype="bf16")

    def refused(**pins) -> str:
        with pytest.raises(InputError) as e:
            plan_model(s, cluster, work, Constraints(**pins))
        assert "\n" not in str(e.value)
        return str(e.value)

    why = refused(ep=3)
    assert "--ep 3" in why and "4 experts" in why and "2, 4" in why
    why = refused(ep=4, dp=2, ep_fold="dp")
    assert "--ep 4" in why and "2 dp x cp ranks" in why
    why = refused(ep=2, ep_fold="tp", tp=4)
    assert "--tp 2" in why and "--tp 4" in why
    with pytest.raises(InputError) as e:
        plan_model(
            analysed_llama("8b"), cluster, WorkloadSpec("train", 8, 4096, dtype="bf16"), Constraints(ep=2)
        )
    assert "no mixture-of-experts layer" in str(e.value)
    with pytest.raises(InputError, match="--ep 1 turns it off"):
        Constraints(ep=1, ep_fold="tp")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--ep", "3"], ["--ep 3", "4 experts"]),
        (["--ep", "1", "--ep-fold", "tp"], ["--ep-fold tp", "--ep 1"]),
        (["--moe-imbalance", "0.5"], ["--moe-imbalance", "0.5"]),
    ],
)
def test_cli_refuses_bad_ep_options_with_exit_code_2(args, words, capsys) -> None:
    rc = main(
        [
            "optimize",
            str(MODELS / "tiny_moe_gptfast.py"),
            "--cluster",
            "dgx-h100",
            "--workload",
            "train",
            *args,
        ]
    )
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and all(w in err for w in words), err


def test_dense_models_have_no_ep_candidates_and_the_same_layer_prices() -> None:
    s = analysed_llama("8b")
    cluster = load_cluster("dgx-h100")
    search_stub = type("S", (), {"constraints": Constraints(), "structure": s})()
    assert _ep_options(search_stub, MeshShape(1, 1, 8), False) == [(1, "dp")]
    plain = build_layer_graph(s.layers[0], _ctx(s, MeshShape(1, 1, 8), batch=8))
    with_ep = build_layer_graph(s.layers[0], _ctx(s, MeshShape(1, 1, 8), ep=8, batch=8))
    assert (plain.fixed_compute_s, plain.fixed_static_bytes, plain.fixed_comm_s) == (
        with_ep.fixed_compute_s,
        with_ep.fixed_static_bytes,
        with_ep.fixed_comm_s,
    )
    plan = plan_model(s, cluster, WorkloadSpec("train", 8, 4096, dtype="bf16"), Constraints(tp=8, pp=1))
    assert plan.ep == 1 and plan.num_experts == 0
    assert "expert parallelism" not in {d.subject for d in plan.decisions}


@functools.cache
def _mixtral_plan() -> Plan:
    return plan_model(
        _mixtral(), load_cluster("h100-ib-128node"), WorkloadSpec("train", 256, 4096, dtype="bf16"),
        Constraints(max_devices=64),
    )  # fmt: skip


def test_mixtral_8x7b_on_64_h100s_splits_its_experts_and_why_lists_the_degrees() -> None:
    plan = _mixtral_plan()
    assert plan.ep > 1 and plan.ep_fold == "dp" and plan.num_experts == 8
    assert plan.num_devices == 64 and plan.predicted.peak_memory_bytes < 0.9 * 79.6 * 2**30
    why = {d.subject: d for d in plan.decisions}["expert parallelism"]
    assert why.chosen == f"{plan.ep} over dp"
    assert why.options[why.chosen] == pytest.approx(plan.predicted.latency_s)
    assert why.options["off"] > plan.predicted.latency_s
    assert math.isinf(why.options["16 over dp"]) and "ep=16 does not divide 8 experts" in why.reason
    assert "token exchange" in why.reason and "--moe-imbalance" in why.reason
    # the TP meshes' options were priced and not solved (pruned), which `--why` says; "16 over dp" is not
    # possible with 8 experts ("not allowed")
    assert "8 over dp, experts split over tp 2" in why.unsolved and "16 over dp" not in why.unsolved
    text = options_text(why)
    assert "8 over dp, experts split over tp 2: not solved" in text and "16 over dp: not allowed" in text
    again = Plan.from_dict(plan.to_dict())
    assert (again.ep, again.ep_fold, again.num_experts) == (plan.ep, plan.ep_fold, 8)


def test_the_exports_of_an_ep_plan_name_the_experts_mesh() -> None:
    plan = dataclasses.replace(_mixtral_plan(), dp_style=DataParallel.DDP, dp_shard=1)
    megatron = export_plan(plan, "megatron").text
    for flag in (
        "--num-experts 8",
        f"--expert-model-parallel-size {plan.ep}",
        "--expert-tensor-parallel-size 1",
        "--moe-token-dispatcher-type alltoall",
    ):
        assert flag in megatron
    titan = export_plan(plan, "torchtitan", torchtitan_version="0.3")
    assert f"--parallelism.expert_parallel_degree {plan.ep}" in titan.text
    assert any("EP ranks from the FSDP shard ranks" in w for w in titan.warnings)  # ddp: no shard ranks
    old = export_plan(plan, "torchtitan", torchtitan_version="0.2").text
    assert f"expert_parallel_degree = {plan.ep}" in old and "expert_tensor_parallel_degree = 1" in old
    serving = dataclasses.replace(
        plan, workload="decode", mesh=MeshShape(8, 1, 1), ep=8, ep_fold="tp", splits={}
    )
    vllm = export_plan(serving, "vllm", model="mistralai/Mixtral-8x7B-v0.1")
    assert "'enable_expert_parallel': True" in vllm.text and "--enable-expert-parallel --dtype" in vllm.text
    assert not any("expert" in w for w in vllm.warnings)  # EP over the TP ranks at dp 1: vLLM's own layout
    dtensor = export_plan(plan, "dtensor")  # parallelize_module has no EP style: said, not dropped silently
    assert any(f"expert parallelism (ep={plan.ep} over dp) is not part" in w for w in dtensor.warnings)


def _split(ctx: CostContext, expert_tp: int) -> CostContext:
    return dataclasses.replace(ctx, config=dataclasses.replace(ctx.config, expert_tp=expert_tp))


def test_expert_tp_divides_the_expert_gemms_and_memory_by_tp_and_adds_the_tp_all_reduce() -> None:
    """expert_tp = tp: each TP rank computes 1/tp of every expert GEMM (at the narrower width: a little
    less than tp x faster), holds 1/tp of the experts' weights and state, and all-reduces the tokens x H
    output over TP once each way; expert_tp 1 is today's price (whole experts, replicated over TP)."""
    s = _mixtral()
    layer = _moe_layer(s)
    whole = _ctx(s, MeshShape(4, 1, 16), ep=8, cluster="h100-ib-128node", batch=16)
    split = _split(whole, 4)
    assert (whole.expert_tp, split.expert_tp) == (1, 4)
    ratio = expert_gemm_time_s(layer, whole) / expert_gemm_time_s(layer, split)
    assert 3.0 < ratio <= 4.0 + 1e-9
    assert expert_split(layer.moe.experts[-1], 4) == (14336 / 4, 4096)  # down: row-parallel along I
    reduce = 2 * all_reduce_time_s(4096 * 4096 * 2, whole.tp_group(), whole.cluster)  # forward + backward
    added = expert_comm_time_s(layer, split) - expert_comm_time_s(layer, whole)
    assert added == pytest.approx(reduce + split.node_overhead_time(1))
    assert expert_tp_reduce_s(layer, whole) == 0.0
    g_whole, g_split = build_layer_graph(layer, whole), build_layer_graph(layer, split)
    expert_state = (
        layer.moe.expert_params / 8 * 16
    )  # E / ep experts: bf16 weights and grads, fp32 Adam and master
    assert g_whole.fixed_static_bytes - g_split.fixed_static_bytes == pytest.approx(
        expert_state * 3 / 4, rel=1e-3
    )
    assert g_split.expert_grad_bytes == pytest.approx(g_whole.expert_grad_bytes / 4)
    # the I-wide rows kept (gate and up outputs, the SiLU, the product) / 4; the C-wide ones whole
    rows = expert_share(layer.moe, whole).rows
    width = next(w.in_features for w in layer.moe.experts if w.role is Role.EXPERT_DOWN)
    i_wide = rows * 4 * width * 2
    assert g_whole.fixed_activation_bytes - g_split.fixed_activation_bytes == pytest.approx(i_wide * 3 / 4)
    # EP over the TP ranks: expert_tp means nothing there (the plan refuses it); priced as 1
    assert _split(_ctx(s, MeshShape(8, 1, 1), ep=8, fold="tp", batch=1), 8).expert_tp == 1


def _mixtral_tp2(**pins) -> Plan:
    return plan_model(
        _mixtral(), load_cluster("h100-ib-128node"), WorkloadSpec("train", 256, 4096, dtype="bf16"),
        Constraints(max_devices=64, tp=2, ep_fold="dp", **pins),
    )  # fmt: skip


def test_mixtral_at_tp_2_prices_the_experts_split_and_whole_and_picks_the_faster() -> None:
    """At TP 2 the search prices each expert split over the TP ranks and whole on each, and picks the faster:
    whole experts at one sequence per micro-batch under sequence parallelism (Megatron-Core's layout with
    --expert-tensor-parallel-size 1: each TP rank routes its own shard, the experts' gradients reduced over
    the TP ranks too)."""
    free, plan, whole = _mixtral_tp2(), _mixtral_tp2(expert_tp=2), _mixtral_tp2(expert_tp=1)
    assert plan.expert_tp == 2 and whole.expert_tp == 1 and whole.ep > 1
    assert free.predicted.latency_s == pytest.approx(min(plan.predicted.latency_s, whole.predicted.latency_s))
    assert free.expert_tp == 1 and whole.experts_on_sequence_shard and not plan.experts_on_sequence_shard
    why = {d.subject: d for d in plan.decisions}["expert parallelism"]
    assert why.chosen == f"{plan.ep} over dp, experts split over tp 2" == plan.ep_text()
    assert why.options[why.chosen] == pytest.approx(plan.predicted.latency_s)
    assert f"{plan.ep} over dp" in why.options and "experts split over tp" in why.reason
    again = Plan.from_dict(plan.to_dict())
    assert again.expert_tp == 2
    megatron = export_plan(plan, "megatron")
    assert "--expert-tensor-parallel-size 2" in megatron.text
    assert not any("replicated over the" in w for w in megatron.warnings)
    old = export_plan(plan, "torchtitan", torchtitan_version="0.2")
    assert "expert_tensor_parallel_degree = 2" in old.text
    assert not any("replicates the experts" in w for w in old.warnings)
    assert any(
        "no expert TP" in w for w in export_plan(plan, "torchtitan", torchtitan_version="0.3").warnings
    )
    # whole experts on each TP rank's sequence shard: Megatron-Core's folding holds the same experts and rows
    warnings = export_plan(whole, "megatron").warnings
    assert any("the same experts per rank, rows" in w for w in warnings), warnings
    assert not any("replicated over the" in w for w in warnings)
    several = dataclasses.replace(whole, micro_batches=whole.micro_batches // 2)  # two sequences each
    assert any("replicated over the" in w for w in export_plan(several, "megatron").warnings)


def test_a_pinned_expert_tp_other_than_1_or_tp_is_refused_in_one_line() -> None:
    for pins, words in (
        (dict(tp=4, expert_tp=2), ["--expert-tp 2", "--tp 4"]),
        (dict(expert_tp=2, ep_fold="tp"), ["--expert-tp 2", "--ep-fold tp"]),
        (dict(tp=1, expert_tp=2), ["--expert-tp 2", "--tp 1", "use --expert-tp 1, or --tp 2"]),
    ):
        with pytest.raises(InputError) as e:
            Constraints(**pins)
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(InputError, match="--expert-tp 2: no mesh of at most 1 devices has tp=2"):
        plan_model(_tiny(), load_cluster("dgx-h100"), WorkloadSpec("train", 8, 16, dtype="bf16"),
                   Constraints(expert_tp=2, max_devices=1))  # fmt: skip


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--tp", "2", "--expert-tp", "4"], ["--expert-tp 4", "--tp 2"]),
        (["--expert-tp", "2", "--ep-fold", "tp"], ["--expert-tp 2", "--ep-fold tp"]),
    ],
)
def test_cli_refuses_a_bad_expert_tp_with_exit_code_2(args, words, capsys) -> None:
    rc = main(
        [
            "optimize",
            str(MODELS / "tiny_moe_gptfast.py"),
            "--cluster",
            "dgx-h100",
            "--workload",
            "train",
            *args,
        ]
    )
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and all(w in err for w in words), err


def test_experts_that_are_not_swiglu_keep_ep_off_and_a_pin_is_refused(monkeypatch, capsys) -> None:
    """The expert-parallel rewrite runs SwiGLU experts: GeGLU ones (TINY_MOE_EXPERT_ACT=gelu) are not
    split by the search (--why lists why; it priced EP as an option, which would then not lower) and a
    pinned --ep is refused naming the block; the SwiGLU model still plans EP."""
    model = str(MODELS / "tiny_moe_modulelist.py")
    monkeypatch.setenv("TINY_MOE_EXPERT_ACT", "gelu")
    assert main(["optimize", model, "--cluster", "local-cpu", "--nproc", "2", "--ep", "2"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--ep 2: the experts of layers.0.mlp are not SwiGLU MLPs" in err, err
    assert (
        main(["optimize", model, "--cluster", "local-cpu", "--nproc", "2", "--workload", "train", "--why"])
        == 0
    )
    out = " ".join(capsys.readouterr().out.split())
    assert "excluded: ep>1: the experts of layers.0.mlp are not SwiGLU MLPs" in out, out
    monkeypatch.delenv("TINY_MOE_EXPERT_ACT")
    assert main(["optimize", model, "--cluster", "local-cpu", "--nproc", "2", "--ep", "2"]) == 0


def test_the_refusal_of_non_swiglu_experts_names_the_op_and_the_model_line(monkeypatch, capsys) -> None:
    """A pinned --ep on GeGLU experts was refused naming only the block ("no SiLU between ..."); the
    message names the op that stands where SiLU would and its model line (file.py:LINE `code`)."""
    monkeypatch.setenv("TINY_MOE_EXPERT_ACT", "gelu")
    model = str(MODELS / "tiny_moe_modulelist.py")
    assert main(["optimize", model, "--cluster", "local-cpu", "--nproc", "2", "--ep", "2"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--ep 2: the experts of layers.0.mlp are not SwiGLU MLPs (they compute aten.gelu (" in err, err
    assert re.search(r"\(tiny_moe_modulelist\.py:\d+ `out = self\.down_proj\(self\.act\(", err), err
    assert "runs SwiGLU experts only; use --ep 1" in err and "Traceback" not in err, err


def test_experts_split_over_tp_run_under_sequence_parallelism_and_fold_tp_does_not() -> None:
    """Sequence parallelism gathers a MoE block's tokens before its router (`passes.ep_lower`), so experts
    split over the TP ranks (Megatron-Core's default, --expert-tensor-parallel-size = TP) run with it: a
    plan with both passes the lowering's check (it was refused, and the search never offered the pair).
    EP over the TP ranks under sequence parallelism is still refused, naming ep_fold."""
    from passes.lower import check_runnable  # noqa: PLC0415

    prepared = prepare(str(EXAMPLES / "mixtral_8x7b.py"), "train", batch_size=16, seq_len=4096, dtype="bf16")
    cluster = load_cluster("h100-ib-2node")
    plan = plan_model(
        prepared.structure, cluster, prepared.workload, Constraints(tp=2, ep=1, sequence_parallel=True)
    )
    assert plan.expert_tp == 2 and plan.sequence_parallel and plan.ep == 1, plan.layout_summary()
    check_runnable(plan, prepared.structure, True)
    edited = dataclasses.replace(plan, ep=2, ep_fold="tp", expert_tp=1)
    with pytest.raises(InputError, match=r"'ep_fold' \(tp\) and 'sequence_parallel'.*ep_fold: dp"):
        check_runnable(edited, prepared.structure, True)


def test_the_hand_written_baselines_split_the_experts_over_tp() -> None:
    """The Megatron and torchtitan baselines of a MoE model run its experts split over their TP ranks
    (Megatron-Core's --expert-tensor-parallel-size defaults to TP; torchtitan and vLLM shard experts over
    TP where EP is 1), Megatron's training also over the data-parallel ranks by EP (its Mixtral example:
    TP2 PP4 EP8). They kept every expert whole on each TP rank: Mixtral training on two nodes priced
    339 GiB per rank (does not fit), and decoding at TP 8 each rank held every expert's weights."""
    cluster = load_cluster("h100-ib-2node")
    prepared = prepare(str(EXAMPLES / "mixtral_8x7b.py"), "train", batch_size=16, seq_len=4096, dtype="bf16")
    plan = plan_model(prepared.structure, cluster, prepared.workload, Constraints())
    for name, layout, priced, tp, experts in (
        ("megatron", plan.baseline_layout, plan.baseline, "2", "8 over dp, experts split over tp 2"),
        ("torchtitan", plan.torchtitan_layout, plan.torchtitan_baseline, "8", "off, experts split over tp 8"),
    ):
        assert priced is not None and layout["tp"] == tp, (name, layout)
        assert layout["expert_parallel"] == experts, (name, layout)
        assert priced.peak_memory_bytes <= 71.6 * 2**30, (name, priced.peak_memory_bytes / 2**30)
    serving = prepare(str(EXAMPLES / "mixtral_8x7b.py"), "decode", batch_size=8, context=512, dtype="bf16")
    plan = plan_model(serving.structure, load_cluster("dgx-h100"), serving.workload, Constraints())
    weights = serving.structure.num_params * 2
    assert plan.baseline_layout["expert_parallel"] == "off, experts split over tp 8"
    assert plan.baseline.peak_memory_bytes < 1.5 * weights / 8, plan.baseline.peak_memory_bytes / 2**30


def test_exports_of_experts_split_over_tp_without_ep() -> None:
    """Experts split over TP without EP is each tool's default MoE layout: Megatron-Core exports it as
    --expert-tensor-parallel-size tp, vLLM without --enable-expert-parallel and without the warning that the
    plan keeps the experts whole (which it gave for every MoE plan without EP); the same plan with the
    experts whole warns for vLLM and torchtitan, whose layouts split them. (Planned whole, this model's
    own experts, which gather an expert matrix per token and choice, do not fit at 4,096 tokens: the
    whole plan is the split one with its experts' degree set to 1, what the exports read.)"""
    split = plan_model(
        _mixtral(), load_cluster("h100-ib-128node"), WorkloadSpec("train", 256, 4096, dtype="bf16"),
        Constraints(max_devices=64, tp=2, ep=1),
    )  # fmt: skip
    whole = dataclasses.replace(split, expert_tp=1)
    assert split.ep == 1 and split.expert_tp == 2, split.layout_summary()
    megatron = export_plan(split, "megatron")
    assert (
        "--expert-tensor-parallel-size 2" in megatron.text
        and "--expert-model-parallel-size 1" in megatron.text
    )
    served = dataclasses.replace(split, workload=Workload.DECODE)
    assert not any("experts whole" in w for w in export_plan(served, "vllm").warnings)
    served_whole = dataclasses.replace(whole, workload=Workload.DECODE)
    assert any("experts whole" in w for w in export_plan(served_whole, "vllm").warnings)
    assert any("experts whole" in w for w in export_plan(whole, "torchtitan").warnings)
    assert not any("experts whole" in w for w in export_plan(split, "torchtitan").warnings)


def test_sequence_parallel_moe_prices_what_the_passes_run_by_sequences_per_micro_batch() -> None:
    """Under sequence parallelism a MoE block's tokens are gathered over TP before its router where the
    micro-batch holds several sequences (the TP pass: a reshape merging batch and sequence), and stay
    each rank's shard with one sequence (`passes.ep_lower` gathers them around split experts and
    reduce-scatters the output): whole experts there route 1/tp of the rows with no gather; split
    experts reduce-scatter where they all-reduce with several sequences."""
    s = _mixtral()
    layer = _moe_layer(s)

    def ctx(batch: int, expert_tp: int) -> CostContext:
        c = _ctx(s, MeshShape(2, 1, 1), batch=batch)
        config = dataclasses.replace(c.config, sequence_parallel=True, expert_tp=expert_tp)
        return dataclasses.replace(c, config=config)

    many, one = ctx(4, 1), ctx(1, 1)
    assert not moe_rows_sharded(many) and moe_rows_sharded(one)
    assert moe_sequence_gather_bytes(layer, many) == many.tokens * layer.moe.hidden_size * 2
    assert moe_sequence_gather_bytes(layer, one) == 0.0
    assert expert_share(layer.moe, one).rows == pytest.approx(expert_share(layer.moe, ctx(1, 2)).rows / 2)
    split_many, split_one = ctx(4, 2), ctx(1, 2)
    group = split_one.tp_group()
    nbytes = split_one.tokens * layer.moe.hidden_size * 2
    assert expert_tp_reduce_s(layer, split_one) == pytest.approx(
        2 * reduce_scatter_time_s(nbytes, group, split_one.cluster) + split_one.node_overhead_time(1)
    )
    nbytes_many = split_many.tokens * layer.moe.hidden_size * 2
    assert expert_tp_reduce_s(layer, split_many) == pytest.approx(
        2 * all_reduce_time_s(nbytes_many, group, split_many.cluster) + split_many.node_overhead_time(1)
    )
    assert moe_sequence_gather_bytes(layer, split_one) > nbytes  # the rows, their ids and weights


def test_a_plan_file_with_split_experts_and_ep_over_tp_names_ep_fold() -> None:
    """A plan edited to ep_fold tp with experts split over TP is refused naming ep_fold (the field that
    contradicts); an expert_tp other than 1 or tp names both values that would do."""
    plan = plan_model(_tiny(), load_cluster("dgx-h100"), WorkloadSpec("train", 8, 16, dtype="bf16"),
                      Constraints(tp=2, dp=1, expert_tp=2))  # fmt: skip
    with pytest.raises(InputError, match=r"field 'ep_fold': is tp with expert_tp 2.*ep_fold: dp"):
        Plan.from_dict({**plan.to_dict(), "ep": 1, "ep_fold": "tp", "expert_tp": 2})
    with pytest.raises(InputError, match=r"field 'expert_tp': is 3.*set expert_tp: 1 or 2"):
        Plan.from_dict({**plan.to_dict(), "expert_tp": 3})


@pytest.mark.parametrize(
    "model", ["tiny_moe_modulelist.py", "tiny_moe_top1.py", "tiny_moe_gptfast.py", "tiny_mixtral.py"]
)
def test_split_experts_at_one_sequence_price_the_reduction_the_pass_inserts(model: str) -> None:
    """Under sequence parallelism with one sequence per micro-batch, split experts' partial outputs go back
    to the rank's rows by a reduce-scatter, or by an all-reduce where the model's combine adds them into
    a tensor created at its own size (`x.new_zeros(N + 1, H)`: the ModuleList forms), which the TP pass
    keeps whole. Every such plan was priced with the reduce-scatter. `MoE.combine_into_new` must say what
    the lowered graph does, and the price follow it."""
    from passes.collectives import tp_all_reduce, tp_reduce_scatter  # noqa: PLC0415
    from passes.lower import lower_for_rank  # noqa: PLC0415
    from planner.frontend.analysis import analyse  # noqa: PLC0415
    from planner.frontend.capture import capture  # noqa: PLC0415
    from planner.frontend.modelfile import load_model_file  # noqa: PLC0415
    from tests.plans import fixed_plan  # noqa: PLC0415

    path = str(MODELS / model)
    model_file = load_model_file(path)
    gm = capture(model_file.build("meta"), *model_file.inputs(1, 8))
    structure = analyse(gm)
    moe = _moe_layer(structure).moe
    plan = dataclasses.replace(
        fixed_plan(structure, path, 2, workload="train"),
        mesh=MeshShape(2, 1, 1), ep=1, expert_tp=2, sequence_parallel=True,
    )  # fmt: skip
    lower_for_rank(gm, structure, plan, 0, training=True)
    moe_layers = sum(layer.moe is not None for layer in structure.layers)
    targets = [n.target for n in gm.graph.nodes]
    # the attention's row-parallel output reduce-scatters in every layer; the experts' reduction is one more
    # reduce-scatter per MoE layer, or an all-reduce
    reduce_scatters = sum(t is tp_reduce_scatter for t in targets) - len(structure.layers)
    assert reduce_scatters == (0 if moe.combine_into_new else moe_layers), (model, targets)
    assert (sum(t is tp_all_reduce for t in targets) >= moe_layers) == moe.combine_into_new
    c = _ctx(structure, MeshShape(2, 1, 1), batch=1, seq=8)
    ctx = dataclasses.replace(c, config=dataclasses.replace(c.config, sequence_parallel=True, expert_tp=2))
    layer = _moe_layer(structure)
    reduce = all_reduce_time_s if moe.combine_into_new else reduce_scatter_time_s
    nbytes = ctx.tokens * moe.hidden_size * 2
    assert expert_tp_reduce_s(layer, ctx) == pytest.approx(
        2 * reduce(nbytes, ctx.tp_group(), ctx.cluster) + ctx.node_overhead_time(1)
    )


@pytest.mark.parametrize("model", ["tiny_moe_modulelist.py", "tiny_moe_gptfast.py"])
def test_whole_experts_on_a_sequence_shard_price_their_gradients_reduction_over_tp(model: str) -> None:
    """Whole experts under sequence parallelism at one sequence per micro-batch run this TP rank's tokens,
    so each expert weight's gradient sums only them and is reduced over the TP ranks too, which was not
    priced (and under EP not run: the gradients were one TP rank's). With EP the runtime reduces them
    once a step over the expert data-parallel ranks and their TP ranks (Megatron-Core's expert data
    parallelism), and the pass gathers the output where the model's combine was whole; without EP the
    TP pass all-reduces them at every micro-batch (`tp_copy`), unless the combine adds into a tensor of
    its own size: the TP pass then gathers the routing's rows and the experts run every token."""
    from planner.frontend.analysis import analyse  # noqa: PLC0415
    from planner.frontend.capture import capture  # noqa: PLC0415
    from planner.frontend.modelfile import load_model_file  # noqa: PLC0415

    model_file = load_model_file(str(MODELS / model))
    structure = analyse(capture(model_file.build("meta"), *model_file.inputs(1, 8)))
    layer = _moe_layer(structure)
    moe = layer.moe

    def ctx(ep: int, dp: int, batch: int) -> CostContext:
        c = _ctx(structure, MeshShape(2, 1, dp), ep=ep, batch=batch, seq=8)
        return dataclasses.replace(c, config=dataclasses.replace(c.config, sequence_parallel=True))

    with_ep, without = ctx(2, 4, 4), ctx(1, 1, 1)
    group, b = with_ep.tp_group(), 2
    assert with_ep.experts_on_sequence_shard and not ctx(2, 4, 8).experts_on_sequence_shard
    gather = 0.0
    if moe.combine_into_new:
        gather = all_gather_time_s(
            8 * moe.hidden_size * b, group, with_ep.cluster
        ) + with_ep.node_overhead_time(1)
    assert expert_shard_comm_s(layer, with_ep) == pytest.approx(gather)
    assert moe_tokens(moe, with_ep) == with_ep.tokens / 2
    # the experts' gradients: over the 4 / 2 ranks holding the same experts and the 2 TP ranks of each
    experts = with_ep.experts_context()
    assert experts.dp_cp == 2 and experts.dp_group().size == 4
    assert ctx(2, 4, 8).experts_context().dp_group().size == 2
    grads = all_reduce_time_s(moe.expert_params * b, group, without.cluster)  # every expert, whole
    if moe.combine_into_new:
        assert moe_tokens(moe, without) == without.tokens and expert_shard_comm_s(layer, without) == 0.0
    else:
        assert moe_tokens(moe, without) == without.tokens / 2
        assert expert_shard_comm_s(layer, without) == pytest.approx(
            grads + without.node_overhead_time(len(moe.experts))
        )


def test_why_says_when_a_faster_ep_option_saved_too_little_to_be_chosen() -> None:
    """The search keeps the simpler layout unless a level saves 0.5% of the step: gpt-fast's tiny MoE on 4
    fast-linked ranks keeps EP off while 2 over dp is 0.07% faster, and `--why` listed both without saying
    why the slower one was chosen (the data-parallel row says it for its styles)."""
    structure = _structure(str(MODELS / "tiny_moe_gptfast.py"), "train", 4, 16)
    plan = plan_model(structure, load_cluster(str(MODELS / "fastlink.yaml"), nproc=4),
                      WorkloadSpec("train", 4, 16), Constraints(max_devices=4))  # fmt: skip
    why = {d.subject: d for d in plan.decisions}["expert parallelism"]
    faster = [n for n, t in why.options.items() if t < why.options[why.chosen]]
    assert faster, why.options
    assert f"kept {why.chosen}, the simpler layout" in why.reason and "saves" in why.reason


def test_candidates_on_time_shared_cpu_ranks_are_priced_with_their_own_rank_count() -> None:
    """4 gloo ranks on this machine's 2 cores time-share them (`cluster_for_ranks`): a DP4 candidate could
    take the op times the search cached for a 2-rank candidate of the same micro-batch shape (DP2 at two
    micro-batches), priced 2x fast (or the other way round, by the order they were priced): tiny MoE at
    --nproc 4 read 35.8 ms at EP 1 and 2 and 71.5 ms at EP 4, on the same mesh."""
    import os  # noqa: PLC0415

    from costmodels.cluster import cluster_for_ranks  # noqa: PLC0415
    from planner.solver.search import _tables_key  # noqa: PLC0415

    if (os.cpu_count() or 1) >= 4:
        pytest.skip("needs fewer cores than 4 ranks (time-shared CPU processes)")
    structure = _structure(str(MODELS / "tiny_moe_gptfast.py"), "train", 4, 16)
    cluster = load_cluster(str(MODELS / "fastlink.yaml"), nproc=4)
    work = WorkloadSpec("train", 4, 16)

    def key(mesh: MeshShape, micro_batches: int) -> tuple:
        spec = cluster_for_ranks(cluster, mesh.num_devices)
        return _tables_key(CostContext(structure, spec, work, MeshConfig(mesh, micro_batches), "fp32"))

    four, two = key(MeshShape(1, 1, 4), 1), key(MeshShape(1, 1, 2), 2)  # one sequence per micro-batch each
    assert four != two
    assert key(MeshShape(1, 1, 4), 1) == four


def test_the_expert_pass_is_priced_for_the_ops_it_runs_not_the_graphs_expert_code() -> None:
    """Where the expert pass rewrites a MoE block, the graph's routed computation after the top-k
    (`MoE.expert_nodes`: the model's gathers, batched GEMMs, activation, weighing and combine) does not
    run; the block's memory-bound time is the pass's own (`expert_pass_bytes`: the token gather,
    permutations, SiLU and product, weighing and scatter-add combine), and its GEMMs one per expert
    projection, a fused gate-and-up weight as the gate and up GEMMs the pass slices it into."""
    from planner.solver.costing import expert_gemm_shapes, expert_pass_bytes  # noqa: PLC0415

    s = _structure(str(MODELS / "tiny_mixtral.py"), "train", 32, 256)
    layer = _moe_layer(s)
    whole = _ctx(s, MeshShape(1, 1, 2), cluster="local-cpu", batch=32, seq=256)
    split = _ctx(s, MeshShape(1, 1, 2), ep=2, cluster="local-cpu", batch=32, seq=256)
    assert not whole.experts_rewritten and split.experts_rewritten
    # per layer: N = 4,096 tokens a rank, k = 2, C = 64, I = 128, the busiest rank's R rows, bf16
    tokens, rows = 4096, expert_share(layer.moe, split).rows
    elements = 5 * 2 * tokens * 64 + 6 * rows * 64 + 5 * rows * 128 + 3 * tokens * 64
    assert expert_pass_bytes(layer, split) == pytest.approx(elements * 2 + 24 * (2 * tokens + rows))
    graph_nodes = layer_node_times_s(layer, whole)["experts"]  # the model's own expert code, ep 1
    pass_ops = split.op_time(0.0, expert_pass_bytes(layer, split), "memory")
    assert layer_node_times_s(layer, split)["experts"] == pytest.approx(pass_ops)
    assert pass_ops != pytest.approx(graph_nodes)
    # HF's fused gate_up_proj (2 x 128 out): two 64 -> 128 GEMMs, as the pass runs them; at expert TP 2
    fused = next(w for w in layer.moe.experts if w.role is Role.EXPERT_GATE_UP)
    assert expert_gemm_shapes(fused, 1) == [(64.0, 128.0), (64.0, 128.0)]
    assert expert_gemm_shapes(fused, 2) == [(64.0, 64.0), (64.0, 64.0)]
    down = next(w for w in layer.moe.experts if w.role is Role.EXPERT_DOWN)
    assert expert_gemm_shapes(down, 2) == [(64.0, 64.0)]


def test_the_expert_gemm_shapes_are_timed_with_the_models_own_on_a_cpu() -> None:
    """`planner calibrate`'s timing of a model's own matmul shapes on this machine includes the expert
    pass's GEMMs (on a balanced expert's rows, at every expert TP degree), so their price carries the
    measured rate of those thin products, not the large-square peak."""
    from planner.solver.costing import model_matmul_shapes  # noqa: PLC0415

    s = _structure(str(MODELS / "tiny_mixtral.py"), "train", 32, 256)
    shapes = model_matmul_shapes(s, 8192, [1, 2])
    rows = 8192 * 2 // 4  # top-2 of 4 experts
    for k, n in ((64, 128), (128, 64), (64, 64)):  # gate / up, down, and each at expert TP 2
        assert (rows, k, n) in shapes, shapes


@pytest.mark.parametrize(
    "pins, words",
    [
        (["--ep", "2"], "experts ep 2 over dp (2 of 4 per rank)"),
        (["--tp", "2", "--ep", "1", "--expert-tp", "2"], "experts ep 1 (4 per rank, split over tp 2)"),
    ],
)
def test_the_per_layer_table_names_where_a_moe_layers_experts_are(pins, words, tmp_path) -> None:
    """The per-layer table's split choices named a MoE layer's attention only ("replicate: q k v core
    o"): where its routed experts went was on the Mesh line alone. Each MoE layer's row now says it."""
    from planner.cli.render import _strategy_text

    out = tmp_path / "plan.yaml"
    model = str(MODELS / "tiny_mixtral.py")
    rc = main(["optimize", model, "--cluster", str(MODELS / "fastlink.yaml"), "--workload", "train", *pins,
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    rows = [_strategy_text(c) for c in Plan.from_yaml(out).predicted.per_layer if c.layer >= 0]
    assert len(rows) == 2 and all(words in row for row in rows), rows


def test_expert_parallelism_folded_over_dp_and_cp_says_so() -> None:
    """EP over the "dp" fold takes the dp x cp ranks: at DP 1 and CP 2 the Mesh line said "2 over dp",
    as if the experts sat on data-parallel ranks the plan does not have."""
    from planner.plan import ep_text  # noqa: PLC0415

    assert ep_text(2, "dp", 1) == "2 over dp" and ep_text(2, "dp", 1, cp=2) == "2 over dp x cp"
    assert (
        ep_text(2, "tp", 1, cp=2) == "2 over tp"
        and ep_text(1, "dp", 2, cp=2) == "off, experts split over tp 2"
    )


def test_sharded_dp_units_hold_a_ranks_own_experts_only() -> None:
    """FSDP gathers, and ZeRO-2 reduces, one layer unit at a time: under EP a rank's unit holds its E / ep
    experts, not all E. The unit was the whole layer over tp, every expert counted on every rank:
    Mixtral at EP 8 priced ZeRO-2 above ZeRO-1 and FSDP above FSDP without resharding (an expert's
    review of `--why`), and the sharded styles were refused for memory they do not need."""
    from planner.plan import DataParallel  # noqa: PLC0415
    from planner.solver.costing import fsdp_transient_bytes, rank_layer_unit_params, zero2_transient_bytes  # noqa: PLC0415

    s = _mixtral()
    layer = _moe_layer(s)
    experts = layer.moe.expert_params
    dense = layer.num_params - experts
    for ep in (1, 8):
        ctx = _ctx(s, MeshShape(1, 1, 64), ep=ep, cluster="h100-ib-128node", batch=64)
        assert rank_layer_unit_params(ctx) == pytest.approx(dense + experts / ep)
    assert experts > 30 * dense  # so the experts decide the unit's size

    def with_style(ctx: CostContext, style: DataParallel) -> CostContext:
        return dataclasses.replace(ctx, config=dataclasses.replace(ctx.config, dp_style=style))

    ctx = _ctx(s, MeshShape(1, 1, 64), ep=8, cluster="h100-ib-128node", batch=64)
    per_expert_unit = (dense + experts / 8) * 2  # bf16 bytes of the rank's unit
    assert zero2_transient_bytes(with_style(ctx, DataParallel.ZERO2)) < 4 * per_expert_unit + 2e9
    assert fsdp_transient_bytes(with_style(ctx, DataParallel.FSDP)) < 4 * per_expert_unit + 2e9

"""Expert parallelism run as the plan says it: the lowering (`passes.ep_lower`) on gloo ranks against the
unsharded model.

Two launches (2 gloo ranks, 4 gloo ranks) run the plan's own checked run (`runtime.execute.run_rank`:
outputs, MSE loss, every gradient after the reduction - dense parameters averaged over dp, experts
summed over their expert data-parallel ranks and divided by dp - and the first Adam step) for each
layout in turn. Models: tests/models/tiny_moe_modulelist.py (8 SwiGLU experts in a ModuleList, top-2,
a shared expert), tiny_moe_gptfast.py (4 stacked experts, gpt-fast's form) and tiny_mixtral.py (Hugging
Face Mixtral, 4 stacked experts with a fused gate-and-up weight). One job runs with the experts'
gradients averaged over the EP ranks like the dense ones (wrong): its check must fail. The two-rank
launch also trains the planner's own tp=2 plan of tests/models/hf_deepseek_v3.py (Hugging Face
DeepSeek-V3: latent attention split by heads, experts split over TP, the vocabulary split with a pad
token in the second rank's half), and Hugging Face Llama 4 (tests/models/hf_llama4.py: the routing
scores scale the experts' inputs) at EP 2 over dp, EP 2 over TP and experts split over TP.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from unittest import mock

import pytest
import torch

from passes import expert_parallel
from passes.ep_lower import apply_expert_parallel
from planner.cli import workflow
from planner.errors import InputError
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture
from planner.frontend.modelfile import load_model_file
from planner.plan import DataParallel, MeshShape
from runtime import data_parallel
from runtime.execute import run_rank
from runtime.job import RunJob, summarise
from runtime.launch import RankContext, launch
from runtime.numerics import check_failures
from tests.plans import assert_run_matches, fixed_plan, meta_structure

MODELS = Path(__file__).resolve().parent / "models"
MODULELIST, GPTFAST, MIXTRAL = "tiny_moe_modulelist.py", "tiny_moe_gptfast.py", "tiny_mixtral.py"
TOP1 = "tiny_moe_top1.py"  # top-1: the routing weights and a per-expert slice of them are both (N, 1)
SEQ = 8


def _plan(
    model: str,
    tp: int,
    dp: int,
    ep: int,
    workload: str = "train",
    batch: int = 4,
    pp: int = 1,
    m: int = 1,
    cp: int = 1,
    seq: int = SEQ,
    **kw,
):
    structure = meta_structure(str(MODELS / model), batch, seq)
    plan = fixed_plan(structure, str(MODELS / model), tp, pp=pp, workload=workload, micro_batches=m)
    return dataclasses.replace(plan, mesh=MeshShape(tp, pp, dp, cp=cp), ep=ep, **kw)


def _job(plan, model: str) -> RunJob:
    return RunJob(
        str(MODELS / model), plan.to_dict(), batch_size=plan.batch_size, seq_len=plan.seq_len,
        workload=str(plan.workload), warmup=0, iters=1,
    )  # fmt: skip


def _averaged(params, group, divisor):
    """Wrong: the experts' gradients averaged over every data-parallel rank like the dense ones (the
    2-rank world), though the EP ranks hold different experts."""
    import torch.distributed as dist  # noqa: PLC0415

    return data_parallel.average_parameter_gradients(params, dist.group.WORLD, divisor)


def run_labelled(ctx: RankContext, jobs: list[tuple[str, RunJob, bool]]) -> dict:
    out = {}
    for label, job, wrong in jobs:
        if wrong:
            with mock.patch.object(data_parallel, "reduce_expert_gradients", _averaged):
                out[label] = run_rank(ctx, job)
        else:
            out[label] = run_rank(ctx, job)
    return out


TWO_RANK = {  # label: (model, plan kwargs)
    "ep2_modulelist": (MODULELIST, dict(tp=1, dp=2, ep=2)),
    "ep2_gptfast": (GPTFAST, dict(tp=1, dp=2, ep=2)),
    # overlap_grad_reduce over 2 micro-batches: the buckets wait for the last micro-batch's gradients
    "ep2_mixtral_overlap_m2": (MIXTRAL, dict(tp=1, dp=2, ep=2, m=2, overlap_grad_reduce=True)),
    "ep2_modulelist_forward": (MODULELIST, dict(tp=1, dp=2, ep=2, workload="forward")),
    "ep2_top1_modulelist": (TOP1, dict(tp=1, dp=2, ep=2)),
    "ep2_over_tp2_mixtral": (MIXTRAL, dict(tp=2, dp=1, ep=2, ep_fold="tp")),
    "ep2_over_tp2_gptfast_forward": (GPTFAST, dict(tp=2, dp=1, ep=2, ep_fold="tp", workload="forward")),
    "expert_tp2_gptfast": (GPTFAST, dict(tp=2, dp=1, ep=1, expert_tp=2)),
    # Megatron-Core's default MoE layout at TP 2: sequence parallelism, experts split over TP, no EP
    "sp_expert_tp2_mixtral": (MIXTRAL, dict(tp=2, dp=1, ep=1, expert_tp=2, sequence_parallel=True)),
    # one sequence per micro-batch: the reshape keeps each rank's rows, the pass gathers them around the
    # experts, then reduce-scatters (gpt-fast) or all-reduces (top-1: its combine was gathered) the output
    "sp_expert_tp2_one_sequence_gptfast": (
        GPTFAST,
        dict(tp=2, dp=1, ep=1, expert_tp=2, sequence_parallel=True, batch=1),
    ),
    # EP over the CP ranks: the router reads this rank's tokens, the model's combine was gathered whole by
    # the CP pass (gpt-fast's `.view(B, T, C)`, the ModuleList's index_add into zeros): the experts take
    # every CP rank's rows (the run failed on a (8, C) output where (16, C) was expected)
    "cp2_ep2_gptfast": (GPTFAST, dict(tp=1, dp=1, cp=2, ep=2, batch=1)),
    "cp2_ep2_modulelist": (MODULELIST, dict(tp=1, dp=1, cp=2, ep=2, batch=1)),
    "sp_expert_tp2_one_sequence_top1": (
        TOP1,
        dict(tp=2, dp=1, ep=1, expert_tp=2, sequence_parallel=True, batch=2, m=2),
    ),
}
FOUR_RANK = {
    "tp2_ep2_modulelist": (MODULELIST, dict(tp=2, dp=2, ep=2)),
    "ep4_modulelist": (MODULELIST, dict(tp=1, dp=4, ep=4, batch=8)),
    "ep2_dp4_mixtral": (MIXTRAL, dict(tp=1, dp=4, ep=2, batch=8)),
    "tp2_ep2_expert_tp2_mixtral": (MIXTRAL, dict(tp=2, dp=2, ep=2, expert_tp=2)),
    "sp_ep2_expert_tp2_one_sequence_mixtral": (
        MIXTRAL,
        dict(tp=2, dp=2, ep=2, expert_tp=2, sequence_parallel=True, batch=2),
    ),
    # whole experts on each TP rank's sequence shard (one sequence per micro-batch): their gradients are
    # summed over the TP ranks, and this model's combine (into `x.new_zeros(N + 1, C)`) gathered (the run
    # failed on a (4, C) + (8, C) add, and the gpt-fast form's expert gradients were one TP rank's)
    "sp_ep2_whole_one_sequence_modulelist": (
        MODULELIST,
        dict(tp=2, dp=2, ep=2, expert_tp=1, sequence_parallel=True, batch=2),
    ),
    # FSDP reads each rank's slice of the fused gate-and-up experts (it took a plain half: wrong numerics)
    "expert_tp2_dp2_fsdp_mixtral": (
        MIXTRAL,
        dict(tp=2, dp=2, ep=1, expert_tp=2, batch=8, dp_style=DataParallel.FSDP, dp_shard=2),
    ),
    "pp2_ep2_modulelist": (MODULELIST, dict(tp=1, dp=2, ep=2, pp=2, m=2)),
    "pp2_ep2_mixtral": (MIXTRAL, dict(tp=1, dp=2, ep=2, pp=2, m=2)),
}
# Llama 4 (Hugging Face): each token scaled by its routing score before the experts, which run on every
# token; the pass scales the chosen experts' input rows instead of weighing their outputs
# (`MoE.input_scale`): EP over dp, EP over the TP ranks, experts split over TP
LLAMA4 = "hf_llama4.py"
TWO_RANK |= {
    "ep2_llama4": (LLAMA4, dict(tp=1, dp=2, ep=2, seq=16)),
    "ep2_over_tp2_llama4": (LLAMA4, dict(tp=2, dp=1, ep=2, ep_fold="tp", seq=16)),
    "expert_tp2_llama4": (LLAMA4, dict(tp=2, dp=1, ep=1, expert_tp=2, seq=16)),
}
WRONG = {"ep2_averaged": (MODULELIST, dict(tp=1, dp=2, ep=2))}
DEEPSEEK = "hf_deepseek_v3.py"
# bf16: at 2 x 16 tokens a router's top-2 is a near-tie the EP run's other summation order flips (the
# outputs were 0.31 apart, tolerance 0.044): the check replays the reference's choices by token
TWO_RANK["ep2_deepseek_bf16"] = (DEEPSEEK, dict(tp=1, dp=2, ep=2, batch=2, seq=16, dtype="bf16"))
PLANNED = {"deepseek_v3_planned_tp2": DEEPSEEK}  # label: model, planned by the planner (`_planned`)


@functools.cache
def _planned(model: str):
    """The planner's training plan of `model` at tp=2 on tests/models/fastlink.yaml (links so fast that
    it splits every block it can), batch 2 x SEQ."""
    path = str(MODELS / model)
    prepared = workflow.prepare(path, "train", batch_size=2, seq_len=SEQ)
    cluster = workflow.resolve_cluster(str(MODELS / "fastlink.yaml"), 2)
    return workflow.make_plan(prepared, cluster, workflow.constraints_from(2, 1, 1, "none"), path)


def _launch(layouts: dict, wrong: dict, nproc: int, planned: dict | None = None) -> dict:
    plans = {label: (model, _plan(model, **kw)) for label, (model, kw) in {**layouts, **wrong}.items()}
    plans |= {label: (model, _planned(model)) for label, model in (planned or {}).items()}
    jobs = [(label, _job(plan, model), label in wrong) for label, (model, plan) in plans.items()]
    reports = launch(run_labelled, jobs, nproc=nproc, timeout_s=600)
    return {label: (plans[label][1], summarise([r[label] for r in reports])) for label, *_ in jobs}


@pytest.fixture(scope="module")
def two_rank() -> dict:
    return _launch(TWO_RANK, WRONG, 2, PLANNED)


@pytest.fixture(scope="module")
def four_rank() -> dict:
    return _launch(FOUR_RANK, {}, 4)


@pytest.mark.slow
def test_ep2_matches_the_unsharded_model(two_rank: dict) -> None:
    for label in TWO_RANK:
        assert_run_matches(label, *two_rank[label])


@pytest.mark.slow
def test_ep_with_tp_and_over_more_ranks_matches_the_unsharded_model(four_rank: dict) -> None:
    for label in FOUR_RANK:
        assert_run_matches(label, *four_rank[label])


@pytest.mark.slow
def test_a_bf16_ep_run_replays_the_references_expert_choices(two_rank: dict) -> None:
    """The checked step's routers take the unsharded model's expert choices token by token
    (`runtime.routing`), each DP rank matching its own tokens; the outputs then agree within bf16's
    tolerance, and so do the routers' logits (the check of the router the replay would otherwise hide)."""
    plan, run = two_rank["ep2_deepseek_bf16"]
    n = run["numerics"]
    assert plan.dtype == "bf16" and n["dtype"] == "bfloat16"
    assert n["routing_calls"] == 2 * 2 and n["routing_unmatched"] == 0  # 2 routers on each of 2 ranks
    assert n["routing_logit_diff"] <= n["routing_tolerance"]


def test_deepseek_v3_latent_attention_is_planned_head_parallel() -> None:
    """Hugging Face DeepSeek-V3 (multi-head latent attention): its per-head projections split by heads
    (q_b_proj and kv_b_proj column-parallel, o_proj row-parallel, the core by heads); the key's copies into a new tensor (`expand_kv`) had kept the whole attention replicated."""
    plan = _planned(DEEPSEEK)
    styles = {name.split(".")[-2]: str(s.style) for name, s in plan.splits.items() if ".self_attn." in name}
    assert {k: styles.get(k) for k in ("q_b_proj", "kv_b_proj", "o_proj")} == {
        "q_b_proj": "colwise", "kv_b_proj": "colwise", "o_proj": "rowwise"
    }, styles  # fmt: skip
    assert {c.strategy.get("core") for c in plan.predicted.per_layer if c.layer >= 0} == {"head"}
    # on these links the ILP also splits the low-rank q_a_proj / kv_a_proj_with_mqa and gathers at their
    # RMSNorm and the RoPE part's slice (priced fallbacks); the key's assembly and the core gather nothing
    heads_path = {
        "aten.copy_",
        "aten.cat",
        "aten.new_empty",
        "aten.expand",
        "aten.scaled_dot_product_attention",
    }
    assert not [f"{f.op} at {f.line}" for f in plan.fallbacks if f.op in heads_path]


@pytest.mark.slow
def test_deepseek_v3_planned_tp2_trains_as_the_unsharded_model(two_rank: dict) -> None:
    assert_run_matches("deepseek_v3_planned_tp2", *two_rank["deepseek_v3_planned_tp2"])


@pytest.mark.slow
def test_expert_gradients_averaged_like_dense_ones_fail_the_check(two_rank: dict) -> None:
    plan, summary = two_rank["ep2_averaged"]
    failures = check_failures(summary["numerics"])
    assert any(line.startswith("gradients") for line in failures), failures


def test_the_pass_keeps_this_ranks_experts_and_the_models_routing() -> None:
    model_file = load_model_file(MODELS / MODULELIST)
    gm = capture(model_file.build("meta"), *model_file.inputs(2, SEQ))
    structure = analyse(gm)
    done = apply_expert_parallel(gm, structure, 2, 1)
    assert done.experts == [4, 5, 6, 7] and len(done.blocks) == len(structure.layers)
    names = dict(gm.named_parameters())
    assert (
        "layers.0.mlp.experts.4.gate_proj.weight" in names
        and "layers.0.mlp.experts.0.gate_proj.weight" not in names
    )
    assert "layers.0.mlp.gate.weight" in names  # the router stays, replicated
    assert any(
        n.target is __import__("passes.expert_parallel").expert_parallel.ep_moe for n in gm.graph.nodes
    )


def test_an_in_place_combine_is_lowered_like_the_out_of_place_one() -> None:
    """`out.index_add_(0, idx, y)` per expert into `x.new_zeros(N + 1, C)`: the capture makes it the value
    it is (`planner.frontend.fresh_writes`), so EP lowers it (it was refused naming aten.index_add_)."""
    model_file = load_model_file(MODELS / MODULELIST)
    model = model_file.module.build_model(dispatch="capacity_inplace")
    gm = capture(model.to("meta"), *model_file.inputs(2, SEQ))
    structure = analyse(gm)
    assert all(layer.moe is not None and not layer.moe.not_lowerable for layer in structure.layers)
    done = apply_expert_parallel(gm, structure, 2, 0)
    assert done.experts == [0, 1, 2, 3] and len(done.blocks) == len(structure.layers)


def test_experts_split_over_tp_are_refused_where_the_router_reads_another_shard() -> None:
    """Split experts need every TP rank's tokens: sequence parallelism gathers them before the router, or
    with one sequence keeps each rank's rows, which the pass gathers around the experts; a router reading
    another shard (its hidden dim) is refused naming the block and --expert-tp 1 (rather than combining
    other ranks' tokens)."""
    model_file = load_model_file(MODELS / MIXTRAL)
    gm = capture(model_file.build("meta"), *model_file.inputs(2, SEQ))
    structure = analyse(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    moe = next(layer.moe for layer in structure.layers if layer.moe is not None)
    nodes[moe.router.node].args[0].meta["tp_placement"] = "Shard(1)"
    with pytest.raises(InputError, match=rf"{moe.module_path}'s router reads .* Shard\(1\).*--expert-tp 1"):
        apply_expert_parallel(gm, structure, 1, 0, expert_tp=2, tp_rank=0)


def test_expert_parallelism_with_a_sharded_data_parallel_state_is_refused_before_the_ranks_start() -> None:
    """EP over several data-parallel ranks runs with ddp only: fsdp and zero2 were let through to the
    ranks (only zero1 was refused there), and fsdp computed other outputs than the model."""
    from runtime.run_mode import check_plan_runs  # noqa: PLC0415

    for style in (DataParallel.FSDP, DataParallel.ZERO2, DataParallel.ZERO1):
        plan = _plan(MIXTRAL, tp=1, dp=2, ep=2, batch=8, dp_style=style, dp_shard=2)
        with pytest.raises(InputError, match=rf"'dp_style' is {style}.*ep=2.*ddp only"):
            check_plan_runs(plan, "train")
    split = _plan(MIXTRAL, tp=2, dp=2, ep=1, expert_tp=2, batch=8, dp_style=DataParallel.FSDP, dp_shard=2)
    check_plan_runs(split, "train")  # experts split over TP without EP: any style


def test_an_ep_that_does_not_divide_the_experts_is_refused() -> None:
    model_file = load_model_file(MODELS / GPTFAST)
    gm = capture(model_file.build("meta"), *model_file.inputs(2, SEQ))
    with pytest.raises(InputError, match=r"ep=8 cannot split the 4 experts"):
        apply_expert_parallel(gm, analyse(gm), 8, 0)


@pytest.mark.slow
def test_tokens_per_expert_are_reported_per_rank(two_rank: dict) -> None:
    plan, summary = two_rank["ep2_modulelist"]
    lines = [n for n in summary["measured"]["notes"] if n.startswith("tokens per expert on rank")]
    assert len(lines) == 2 and all("layers.0.mlp: [" in line for line in lines), lines
    assert any("expert parallelism applied" in n for n in summary["measured"]["notes"])


@pytest.mark.slow
def test_a_served_moe_decodes_the_same_tokens_with_experts_split_over_tp() -> None:
    """tests/models/tiny_mixtral_kv.py served at TP2 with each of its 4 experts split over the 2 TP ranks
    (expert_tp 2: vLLM's default) and with the experts split between them (ep 2, ep_fold tp:
    vLLM's --enable-expert-parallel): the greedy tokens are the unsharded model's."""
    from planner.cli import workflow  # noqa: PLC0415

    model = str(MODELS / "tiny_mixtral_kv.py")
    prepared = workflow.prepare(model, "decode", context=8, new_tokens=4)
    cluster = workflow.resolve_cluster(str(MODELS / "midlink-cpu.yaml"), 2)
    # each expert split over the TP ranks, no EP (vLLM's fused MoE without EP), then EP over TP: pinned, as
    # the two price within a microsecond of each other on this cluster (the search may take either)
    pinned = workflow.constraints_from(2, 1, 1, "none", expert_tp=2)
    plan = workflow.make_plan(prepared, cluster, pinned, model)
    assert plan.ep == 1 and plan.expert_tp == 2, plan.layout_summary()
    for layout in (plan, dataclasses.replace(plan, ep=2, ep_fold="tp", expert_tp=1)):
        run = workflow.run_serving(layout, model, 2, iters=1, warmup=0, timeout_s=240)
        assert run["numerics"]["tokens_identical"] and run["numerics"]["ok"], run["numerics"]
        said = (
            "expert parallelism applied" if layout.ep > 1 else "experts split over TP (no expert parallelism)"
        )
        assert any(said in n for n in run["measured"]["notes"]), run["measured"]["notes"]


@pytest.mark.slow
def test_a_run_with_experts_split_over_tp_and_no_ep_says_so(two_rank: dict) -> None:
    """It said "expert parallelism applied ... split over 1 ranks ... dispatched by all-to-all"."""
    notes = two_rank["expert_tp2_gptfast"][1]["measured"]["notes"]
    assert any(n.startswith("experts split over TP: ") and "no token exchange" in n for n in notes), notes
    assert not any("expert parallelism applied" in n for n in notes), notes


@pytest.mark.slow
def test_an_ep_rank_holds_only_its_experts(two_rank: dict) -> None:
    """The training state an EP rank holds is what the cost model predicts for its E / ep experts (and a
    rank with every expert split over TP, without EP or under sequence parallelism, for its 1/tp): the
    stacked experts' slice is a copy, not a view keeping every expert's storage alive (it read 1.13 at
    ep 2, (ep - 1) x 4 bytes per local expert parameter over)."""
    for label in ("ep2_gptfast", "ep2_modulelist", "expert_tp2_gptfast", "sp_expert_tp2_mixtral"):
        measured = two_rank[label][1]["measured"]
        assert measured["state_bytes"] == pytest.approx(measured["predicted_state_bytes"], rel=0.02), label


def test_the_expert_data_parallel_ranks_span_the_tp_ranks_where_whole_experts_run_a_sequence_shard() -> None:
    """EP 2 over dp 4 at tp 2 (ranks tp-fastest): rank 0's EP group is the DP ranks 0 and 2 of TP rank 0,
    its expert data-parallel ranks 0 and 4, and with whole experts on each TP rank's sequence shard
    (`Plan.experts_on_sequence_shard`) those ranks' TP ranks too: their gradients sum other tokens."""
    from runtime.mesh import ep_ranks  # noqa: PLC0415

    shape = MeshShape(2, 1, 4)
    assert ep_ranks(shape, 2, 0) == ([0, 2], [0, 4])
    assert ep_ranks(shape, 2, 0, over_tp=True) == ([0, 2], [0, 1, 4, 5])
    assert ep_ranks(shape, 2, 3, over_tp=True) == ([1, 3], [2, 3, 6, 7])
    plan = _plan(MIXTRAL, tp=2, dp=4, ep=2, batch=4, sequence_parallel=True)
    assert plan.experts_on_sequence_shard
    assert not dataclasses.replace(plan, batch_size=8).experts_on_sequence_shard  # two sequences each
    assert not dataclasses.replace(plan, expert_tp=2).experts_on_sequence_shard


def test_the_experts_read_the_tokens_not_a_routers_fp32_copy() -> None:
    """DeepSeek-V3's router casts its input to fp32 (`x.type(torch.float32)`): in a bf16 model the
    experts read the bf16 tokens (the EP run had multiplied fp32 rows by bf16 weights: a dtype error)."""
    from tests.models import hf_deepseek_v3  # noqa: PLC0415

    model = hf_deepseek_v3.build_model().to("meta").to(torch.bfloat16)
    gm = capture(model, hf_deepseek_v3.example_inputs(), hf_deepseek_v3.example_kwargs())
    apply_expert_parallel(gm, analyse(gm), 2, 0)
    calls = [n for n in gm.graph.nodes if n.target is expert_parallel.ep_moe]
    assert len(calls) == 2 and all(n.args[0].meta["val"].dtype == torch.bfloat16 for n in calls)


@pytest.mark.slow
def test_a_pipeline_ranks_ep_note_counts_the_moe_blocks_on_its_stage(four_rank: dict) -> None:
    """At PP 2 each stage holds one of the two MoE layers, but every rank's note said "2 MoE block(s)":
    the EP pass rewrites the whole graph before the pipeline split. Each rank now counts its own."""
    _, run = four_rank["pp2_ep2_mixtral"]
    said = [n for n in run["measured"]["notes"] if n.startswith("expert parallelism applied")]
    assert said and all(n.startswith("expert parallelism applied: 1 MoE block(s)") for n in said), said

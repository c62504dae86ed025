"""Plans are checked by lowering them on meta tensors before any rank starts (passes/verify.py).

Kind 1 of issue 13 (planner and pass disagree) and kind 8 (hand-edited plans): what the planner
prices the TP pass must do, what it cannot do is refused with the op and the model line (exit 3),
and an op the pass runs replicated without the ILP having priced it is priced and named.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from costmodels.cluster import load_cluster
from passes.lower import lower_for_rank
from passes.tp_rules_context import FALLBACK_META
from planner.cli import workflow
from planner.errors import InfeasibleError
from planner.plan import Plan
from tests.cli_in_process import planner_in_process

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "models"
SWIGLU = str(MODELS / "swiglu_fused_w13.py")
CUMSUM = str(MODELS / "mlp_cumsum_fallback.py")
FASTLINK = str(MODELS / "fastlink.yaml")


def _plan(model: str, tp: int = 2, cluster: str = FASTLINK, **options) -> tuple[workflow.Prepared, Plan]:
    prepared = workflow.prepare(model)
    spec = workflow.resolve_cluster(cluster, tp)
    constraints = workflow.constraints_from(tp, None, None, options.get("ladder", "none"))
    return prepared, workflow.make_plan(prepared, spec, constraints, model, cluster)


planner = planner_in_process


def test_fused_gate_up_chunk_lowers_per_part() -> None:
    """w13(x).chunk(2, -1) of a fused projection split per part: each rank cuts its local halves."""
    prepared, plan = _plan(SWIGLU)
    w13 = plan.splits["blocks.0.mlp.w13.weight"]
    assert str(w13.style) == "colwise" and w13.parts == [256, 256]
    for rank in range(2):
        gm = lower_for_rank(copy.deepcopy(prepared.graph), prepared.structure, plan, rank).module
        chunks = [n for n in gm.graph.nodes if "chunk" in str(n.target)]
        gate_up = [u for n in chunks for u in n.users]
        assert gate_up and all(tuple(u.meta["val"].shape)[-1] == 128 for u in gate_up)  # 256 / tp per part
    assert plan.fallbacks == []


@pytest.mark.slow
def test_plan_the_pass_cannot_lower_is_refused_with_op_and_line(tmp_path: Path) -> None:
    """A hand-edited plan that drops the fused parts: the chunk cuts across ranks' shards. `planner run`
    refuses it before any rank starts: exit 3, naming aten.chunk and the model line."""
    prepared, plan = _plan(SWIGLU)
    splits = {k: dataclasses.replace(v, parts=None) if v.parts else v for k, v in plan.splits.items()}
    edited = dataclasses.replace(plan, splits=splits)
    with pytest.raises(
        InfeasibleError, match=r"aten\.chunk at swiglu_fused_w13\.py:41 `gate, up = self\.w13"
    ):
        workflow.check_lowering(prepared, edited, load_cluster(FASTLINK, nproc=2))
    path = tmp_path / "edited.yaml"
    edited.to_yaml(path)
    r = planner("run", str(path), "--model", SWIGLU, "--nproc", "2", "--timeout", "20")
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr and "aten.chunk" in r.stderr and "swiglu_fused_w13.py:41" in r.stderr
    assert "running on" not in r.stdout


def test_unplanned_fallback_is_priced_and_named() -> None:
    """cumsum between a colwise and a rowwise projection has no rule: the pass gathers the activation.
    The plan lists it (op, line, bytes) and its all-gather time is in the prediction."""
    prepared, plan = _plan(CUMSUM)
    assert [f.op for f in plan.fallbacks] == ["aten.cumsum", "aten.cumsum"]  # one per layer
    assert all("mlp_cumsum_fallback.py:24 `h = torch.cumsum(h, dim=-1)" in f.line for f in plan.fallbacks)
    # global activation (2 x 16 x 256 fp32) per layer, gathered once per forward
    assert all(f.bytes_gathered == 2 * 16 * 256 * 4 and f.comm_s > 0 for f in plan.fallbacks)
    # and in the memory: the gathered activation is whole where half was priced, one at a time in a forward
    assert all(f.memory_bytes == 2 * 16 * 256 * 4 / 2 for f in plan.fallbacks)
    # and the cumsum itself, run on the whole activation where the plan priced half of it
    assert all(f.compute_s > 0 for f in plan.fallbacks)
    bare = dataclasses.replace(plan, fallbacks=[])
    bare = dataclasses.replace(
        bare,
        predicted=dataclasses.replace(
            plan.predicted,
            latency_s=plan.predicted.latency_s - sum(f.comm_s + f.compute_s for f in plan.fallbacks),
            compute_s=plan.predicted.compute_s - sum(f.compute_s for f in plan.fallbacks),
            exposed_comm_s=plan.predicted.exposed_comm_s - sum(f.comm_s for f in plan.fallbacks),
            peak_memory_bytes=plan.predicted.peak_memory_bytes - 2 * 16 * 256 * 2,  # the largest one
        ),
    )
    again = workflow.check_lowering(prepared, bare, load_cluster(FASTLINK, nproc=2))
    assert again.predicted.latency_s == pytest.approx(plan.predicted.latency_s)
    assert again.predicted.peak_memory_bytes == pytest.approx(plan.predicted.peak_memory_bytes)
    assert workflow.check_lowering(prepared, plan, load_cluster(FASTLINK, nproc=2)) is plan  # priced once
    round_trip = Plan.from_dict(plan.to_dict())
    assert round_trip.fallbacks == plan.fallbacks
    # planned again with the layers' MLP activation replicated (the gather a priced S->R conversion):
    # not faster here, so the plan stays; the baseline is priced that way (it cannot shard the cumsum)
    from planner.solver.costing import layer_key  # noqa: PLC0415
    from planner.solver.search import plan_model  # noqa: PLC0415

    classes = frozenset(layer_key(layer) for layer in prepared.structure.layers)
    replicated = dataclasses.replace(prepared.structure, replicated_mlp_classes=classes)
    spec = workflow.resolve_cluster(FASTLINK, 2)
    again = plan_model(replicated, spec, prepared.workload, workflow.constraints_from(2, None, None, "none"))
    acts = [v for c in again.predicted.per_layer for k, v in c.strategy.items() if k.startswith("act")]
    assert len(acts) == 2 and set(acts) == {"replicate"}  # one per layer
    assert plan.baseline.latency_s == pytest.approx(again.baseline.latency_s)
    assert plan.predicted.latency_s <= again.predicted.latency_s


@pytest.mark.parametrize(
    "name, gap, op",
    [
        ("depthwise_conv_chain.py", {"gelu", "transpose", "conv1d", "transpose_1"}, "aten.conv1d"),
        ("softmax_chain.py", {"softmax"}, "aten.softmax"),  # gathers the projection's output itself
    ],
)
def test_a_chain_gap_the_pass_cannot_shard_is_planned_again_replicated(name, gap, op) -> None:
    """A depthwise Conv1d after a GELU, or a softmax reading the projection's output, between two
    linears: solved alone, the ILP carries the first linear's shard through the gap and the pass
    gathers it there (an unplanned fallback, priced and named). make_plan finds the gap by lowering,
    plans again with it replicated (the gather a planned S->R conversion) and keeps the faster plan;
    the Megatron baseline is priced with the gap replicated too."""
    from planner.solver.search import plan_model  # noqa: PLC0415

    model = str(MODELS / name)
    prepared = workflow.prepare(model)
    assert prepared.structure.chain_gaps == {1: frozenset(gap)}
    spec = workflow.resolve_cluster(FASTLINK, 2)
    constraints = workflow.constraints_from(2, None, None, "none")
    alone = plan_model(prepared.structure, spec, prepared.workload, constraints, model_name=model)
    alone = workflow.check_lowering(prepared, alone, spec)
    assert alone.predicted.per_layer[0].strategy["act1"] == "shard"
    assert [f.op for f in alone.fallbacks] == [op] and alone.fallbacks[0].comm_s > 0
    assert alone.fallbacks[0].line.startswith(f"{name}:")  # the model's line, not torch/nn/modules/conv.py
    plan = workflow.make_plan(prepared, spec, constraints, model, FASTLINK)
    assert plan.predicted.per_layer[0].strategy["act1"] == "replicate" and plan.fallbacks == []
    assert plan.predicted.latency_s <= alone.predicted.latency_s
    replicated = dataclasses.replace(prepared.structure, replicated_chain_gaps=frozenset({1}))
    again = plan_model(replicated, spec, prepared.workload, constraints, model_name=model)
    assert plan.baseline.latency_s == pytest.approx(again.baseline.latency_s)
    assert workflow.check_lowering(prepared, plan, spec).fallbacks == []  # the conv's gather is planned


def test_fallback_recorded_in_node_meta() -> None:
    prepared, plan = _plan(CUMSUM)
    gm = copy.deepcopy(prepared.graph)
    lower_for_rank(gm, prepared.structure, plan, 0)
    found = [n.meta[FALLBACK_META] for n in gm.graph.nodes if FALLBACK_META in n.meta]
    assert [f.op for f in found] == ["aten.cumsum", "aten.cumsum"]
    assert all(f.bytes == 2 * 16 * 256 * 4 and f.gathered for f in found)


@pytest.mark.parametrize(
    "name, options",
    [
        ("llama3", ["--tp", "2"]),
        ("gpt2", ["--tp", "2", "--workload", "train"]),
        ("llama3", ["--tp", "2", "--pp", "2"]),
    ],
)
@pytest.mark.slow
def test_examples_lower_without_unplanned_fallbacks(tmp_path: Path, name: str, options: list[str]) -> None:
    """The planned gathers (logits, replicated consumers) are not reported as fallbacks."""
    report = tmp_path / "r.json"
    r = planner(
        "optimize", str(ROOT / "examples" / f"{name}.py"), "--cluster", "local-cpu", "--nproc", "4", *options,
        "--json", str(report),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(report.read_text())["fallbacks"] == []


@pytest.mark.slow
def test_cli_names_the_fallback(tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    r = planner("optimize", CUMSUM, "--cluster", FASTLINK, "--tp", "2", "--nproc", "2", "--json", str(report))
    assert r.returncode == 0, r.stderr
    assert (
        "unplanned all-gather: the TP pass runs aten.cumsum replicated at mlp_cumsum_fallback.py:24"
        in r.stdout
    )
    assert "(2 places)" in r.stdout
    fallbacks = json.loads(report.read_text())["fallbacks"]
    assert [f["op"] for f in fallbacks] == ["aten.cumsum"] * 2
    assert all(
        f["places"] == 1 and f["memory_bytes"] == 2 * 16 * 256 * 4 / 2 for f in fallbacks
    )  # as the plan


@pytest.mark.slow
def test_fused_swiglu_runs_and_matches_unsharded(tmp_path: Path) -> None:
    """The case of issue 13: planned per part, saved, then `planner run` on 2 gloo ranks: outputs equal to
    the unsharded model; the plan records the cluster file it was planned for, `planner show` names it
    and `planner run` reports it (kind 10)."""
    plan_path, report_path = tmp_path / "plan.yaml", tmp_path / "report.json"
    r = planner(
        "optimize", SWIGLU, "--cluster", FASTLINK, "--tp", "2", "--nproc", "2", "--out", str(plan_path)
    )
    assert r.returncode == 0, r.stderr
    plan = Plan.from_yaml(plan_path)
    assert plan.cluster == "fastlink-cpu" and plan.cluster_source == str(Path(FASTLINK).resolve())
    shown = planner("show", str(plan_path))
    assert f"on fastlink-cpu (spec {Path(FASTLINK).resolve()})" in shown.stdout + shown.stderr
    r = planner(
        "run",
        str(plan_path),
        "--model",
        SWIGLU,
        "--iters",
        "2",
        "--min-time",
        "0",
        "--json",
        str(report_path),
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(report_path.read_text())
    assert report["cluster"] == "fastlink-cpu" and report["cluster_source"] == plan.cluster_source
    assert "local-cpu" not in r.stdout + r.stderr
    assert report["numerics"]["max_abs_diff"] <= 1e-5 * report["numerics"]["output_scale"]


def test_a_hand_written_attention_core_splits_by_heads() -> None:
    """q @ k^T, a masked softmax and p @ v written out (no SDPA) keep the head shard by the general
    sharding rules (batched matmuls over a head-sharded dim): no gather, the core head-parallel."""
    prepared, plan = _plan(str(MODELS / "manual_attention.py"), cluster=str(MODELS / "midlink-cpu.yaml"))
    assert plan.fallbacks == []
    assert all(c.strategy["core"] == "head" for c in plan.predicted.per_layer if "core" in c.strategy)
    assert plan.op_placement["general"] > 0


def test_a_hand_written_attention_core_is_planned_again_replicated(monkeypatch) -> None:
    """A hand-written core that mixes the heads' logits (talking heads) cannot be split by heads: planned
    with head-parallel attention the TP pass gathers the logits at the mix (unplanned fallbacks, priced,
    naming the model's line). make_plan plans again with the core replicated and keeps the faster. The
    baseline at the node's TP 2 (the model table, which forwards this narrow model at TP 1, set aside)."""
    from planner.solver import baseline  # noqa: PLC0415
    from planner.solver.costing import layer_key  # noqa: PLC0415
    from planner.solver.search import plan_model  # noqa: PLC0415

    monkeypatch.setattr(baseline, "MEGATRON_TP_BY_HIDDEN", ())

    model = str(MODELS / "talking_heads.py")
    prepared = workflow.prepare(model)
    spec = load_cluster(str(MODELS / "midlink-cpu.yaml"), 2)
    constraints = workflow.constraints_from(2, None, None, "none")
    alone = plan_model(prepared.structure, spec, prepared.workload, constraints, model_name=model)
    alone = workflow.check_lowering(prepared, alone, spec)
    assert alone.predicted.per_layer[0].strategy["core"] == "head"
    assert {f.op for f in alone.fallbacks} == {"aten.einsum"}
    assert all(f.line.startswith("talking_heads.py:26") for f in alone.fallbacks)
    classes = frozenset(layer_key(layer) for layer in prepared.structure.layers)
    replicated = dataclasses.replace(prepared.structure, replicated_attention_classes=classes)
    again = plan_model(replicated, spec, prepared.workload, constraints, model_name=model)
    assert all(c.strategy.get("core") in (None, "replicate") for c in again.predicted.per_layer)
    plan = workflow.make_plan(prepared, spec, constraints, model)
    again = workflow.check_lowering(dataclasses.replace(prepared, structure=replicated), again, spec)
    assert plan.predicted.latency_s == pytest.approx(
        min(alone.predicted.latency_s, again.predicted.latency_s)
    )
    # the Megatron baseline splits the core's projections by heads: lowered like a plan, the pass gathers
    # the logits at the mix for it too, and it is priced with those gathers (it once was priced as if
    # the core split, and the report called the plan slower than the expert's)
    assert plan.baseline.latency_s > alone.baseline.latency_s
    assert plan.predicted.latency_s <= plan.baseline.latency_s * (1 + 1e-9)
    expert = next(d for d in plan.decisions if d.subject == "megatron-baseline")
    assert (
        "all-gather(s) the TP pass adds to it" in expert.reason
        and "talking_heads.py:26 `s = torch.einsum(" in expert.reason
    )
    assert expert.options["latency"] == plan.baseline.latency_s


@pytest.mark.slow
def test_the_replicated_core_exclusion_names_the_ops_and_lines_that_gathered(tmp_path: Path) -> None:
    """When the plan with the talking-heads core replicated wins (a spec where the logits' gathers
    cost more than splitting the attention saves: fastlink's with 100x its matmul rate and 300 us per
    collective), its "excluded: core head" line names the ops the TP pass gathered at and the model's
    lines; it said only "an op inside this attention has no head-parallel rule"."""
    import yaml  # noqa: PLC0415

    spec = yaml.safe_load(Path(FASTLINK).read_text())
    spec["device"]["peak_TFLOPS"] = dict.fromkeys(spec["device"]["peak_TFLOPS"], 0.01)
    spec["links"]["intra_node"]["latency_us"] = 300
    path = tmp_path / "slow-collectives.yaml"
    path.write_text(yaml.safe_dump(spec))
    r = planner("optimize", str(MODELS / "talking_heads.py"), "--cluster", str(path), "--tp", "2")
    assert r.returncode == 0, r.stderr
    said = " ".join((r.stdout + r.stderr).split())  # rich wraps long lines
    assert (
        'excluded: core head: aten.einsum at talking_heads.py:26 `s = torch.einsum("bhts,hg->bgts", '
        "(q @ k.transpose(-1, -2)) / math.sqrt(HD), self.mix)` has no head-parallel rule: the TP pass gathers there"
    ) in said
    assert "an op inside this attention" not in said


INOUT = str(MODELS / "inout_weights.py")


def _without_matmul_rule():
    """The TP pass as it was before it had a rule for `x @ W` of an (in, out) weight: the analysis
    reads those projections and the plan splits them, and the pass leaves the weights unread."""
    from unittest import mock  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from passes.tp_rules import RULES, RuleEntry  # noqa: PLC0415
    from passes.tp_rules_context import RuleContext  # noqa: PLC0415

    replicated = RuleEntry(RuleContext.run_replicated, general=True)
    return mock.patch.dict(RULES._entries, {torch.ops.aten.matmul: replicated})


def test_weights_no_rule_splits_are_kept_whole_and_the_model_planned_again() -> None:
    """A plan the TP pass refuses (split weights no rule reads) is made again with those weights kept
    whole in every layer of their class, and says which and where, instead of exit 3; the weights the
    pass can split stay split. A layout given by hand (--layout megatron) is still refused."""
    with _without_matmul_rule():
        prepared, plan = _plan(INOUT)
        styles = {w: str(s.style) for w, s in plan.splits.items()}
        block = [w for w in styles if w.startswith("blocks.")]
        assert len(block) == 8 and all(styles[w] == "replicate" for w in block), styles
        assert styles["emb.weight"] == styles["head.weight"] == "vocab", styles
        first = plan.excluded[0]
        assert first.startswith("tp>1: blocks.0.w_down, blocks.0.w_up, blocks.0.wo and 5 more: kept whole"), (
            first
        )
        assert "aten.matmul at inout_weights.py:34 `q, k, v = self.proj(self.n1(x), self.wqkv)" in first, (
            first
        )
        assert any(e.startswith("core head: its projections are kept whole") for e in plan.excluded), (
            plan.excluded
        )
        assert plan.fallbacks == []
        workflow.check_lowering(prepared, plan, load_cluster(FASTLINK, nproc=2))  # it lowers as priced
        megatron = workflow.constraints_from(2, None, None, "none", layout="megatron")
        with pytest.raises(InfeasibleError, match="not read by a matmul or embedding"):
            workflow.make_plan(
                workflow.prepare(INOUT), workflow.resolve_cluster(FASTLINK, 2), megatron, INOUT, FASTLINK
            )


def test_a_block_the_pass_refuses_is_kept_whole_and_the_rest_stays_split(monkeypatch) -> None:
    """A plan whose MLP split the pass cannot carry through an op (here: the search's plan with the
    fused gate/up's parts dropped, so `chunk` would cut across the ranks' shards) is made again with
    that block's projections whole in every layer of the class, naming the op and line; the attention
    block, which lowers, stays split."""
    planned = workflow.plan_model
    calls = []

    def parts_dropped_once(*args, **kwargs):
        plan = planned(*args, **kwargs)
        calls.append(plan)
        if len(calls) == 1:
            splits = {k: dataclasses.replace(v, parts=None) if v.parts else v for k, v in plan.splits.items()}
            plan = dataclasses.replace(plan, splits=splits)
        return plan

    monkeypatch.setattr(workflow, "plan_model", parts_dropped_once)
    prepared, plan = _plan(SWIGLU)
    assert len(calls) == 2
    styles = {w: str(s.style) for w, s in plan.splits.items()}
    mlp = [w for w in styles if ".mlp." in w]
    assert mlp and all(styles[w] == "replicate" for w in mlp), styles
    split = [w for w in styles if ".attn." in w and styles[w] != "replicate"]
    assert split, styles
    why = "kept whole: the tensor-parallel pass cannot carry the split through aten.chunk at swiglu_fused_w13.py:41"
    assert any(why in e for e in plan.excluded), plan.excluded
    workflow.check_lowering(prepared, plan, load_cluster(FASTLINK, nproc=2))


def test_an_attention_core_no_split_query_projection_feeds_is_not_split_by_heads() -> None:
    """tests/models/flax_heads.py has no q projection the pass can split (3-D per-head einsum weights):
    the core is not offered head-parallel (the ILP once chose "head: core" behind replicated q / k / v,
    priced at 1/tp of the core while the pass ran it whole), and the MLP splits column- then row-wise."""
    _, plan = _plan(str(MODELS / "flax_heads.py"))
    assert any(
        e.startswith("core head: no query projection split column-wise feeds it") for e in plan.excluded
    ), plan.excluded
    styles = {w: str(s.style) for w, s in plan.splits.items()}
    assert styles["blocks.0.w_in"] == "colwise" and styles["blocks.0.w_out"] == "rowwise", styles


def test_a_fallback_in_every_layer_adds_one_stage_s_share_under_a_pipeline() -> None:
    """A fallback found in each of 32 layers was added as 32 places x micro-batches at every pp, as if
    the stages ran one after another: Mixtral's context-parallel fallback cost 8 s at pp 1, 16 s at
    pp 2 and 32 s at pp 4 (dp halving each time). A stage holds 32 / pp of the layers and the step
    repeats a stage's time micro-batches + pp - 1 times."""
    from passes.verify import _step_times  # noqa: PLC0415
    from planner.plan import MeshShape  # noqa: PLC0415

    prepared, plan = _plan(CUMSUM)

    def at(pp: int, m: int) -> Plan:
        return dataclasses.replace(plan, mesh=MeshShape(plan.tp, pp, plan.dp), micro_batches=m)

    assert _step_times(at(1, 1), 32) == (32.0, 32)
    assert _step_times(at(2, 8), 32) == (16 * 9, 16)  # 16 layers per stage, 8 + 1 stage times
    assert _step_times(at(4, 16), 32) == (8 * 19, 8)
    assert _step_times(at(4, 16), 1) == (19 / 4, 1)  # one place, its stage's share of the step


def test_a_refusal_in_a_long_chain_keeps_whole_only_the_projection_that_reaches_it() -> None:
    """tests/models/hf_lfm2.py: its conv layer reads as one chain of five projections (in_proj, out_proj,
    w1, w3, w2); the chunk of in_proj's output cannot carry a split. Only in_proj is kept whole (it kept
    the whole chain whole, the SwiGLU feed-forward too), and the plan lowers."""
    prepared, plan = _plan(str(MODELS / "hf_lfm2.py"))
    styles = {w: str(s.style) for w, s in plan.splits.items()}
    assert styles.get("model.layers.0.conv.in_proj.weight", "replicate") == "replicate", styles
    assert styles["model.layers.0.feed_forward.w1.weight"] == "colwise", styles
    (why,) = [e for e in plan.excluded if "aten.chunk at modeling_lfm2.py" in e and e.startswith("tp>1")]
    assert "model.layers.0.conv.in_proj.weight" in why and "feed_forward" not in why, why
    workflow.check_lowering(prepared, plan, load_cluster(FASTLINK, nproc=2))

"""Training at scale, run side (issue 14, items 1 and 2): sequence parallelism in the TP pass and
activation recomputation at run time.

Fast checks lower on one process (collective counts per layer, errors that name the plan field,
recompute keys, recompute on an unsharded graph); one 2-rank gloo launch checks sequence
parallelism against the unsharded model (outputs and gradients, through the runtime) and recompute
with dropout on (the masks replayed: gradients bitwise equal to no recompute, fewer saved tensors).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from costmodels.cluster import load_cluster
from passes import collectives, rng, tp_overlap
from passes.layers import layer_of_nodes
from passes.lower import lower_for_rank
from passes.recompute import recompute_of_layers
from passes.tensor_parallel import OUTPUT_SHARD, OutputShard
from planner.cli.workflow import constraints_from, make_plan, prepare
from planner.errors import InfeasibleError, InputError
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture, flat_inputs
from planner.frontend.modelfile import load_model_file
from planner.plan import Recompute
from planner.solver.costing import layer_key
from planner.solver.problem import MeshConfig, WorkloadSpec
from planner.solver.search import price
from runtime.execute import run_rank
from runtime.job import RunJob, set_up_rank, summarise
from runtime.launch import RankContext, launch
from runtime.numerics import check_failures
from runtime.run_mode import seed_dropout_rng, set_run_mode
from tests.plans import fixed_plan

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "examples" / "llama3.py"
FLAX = ROOT / "tests" / "models" / "flax_heads.py"  # per-head 3-D einsum weights (a JAX port)
DROPOUT = ROOT / "tests" / "models" / "dropout_tp.py"
VIT = ROOT / "tests" / "models" / "tiny_vit.py"
FASTLINK = ROOT / "tests" / "models" / "fastlink.yaml"


def _captured(path: Path, training: bool = False, device: str = "meta"):
    """(graph, structure, args, kwargs) of the model file at its example inputs; meta graphs are
    captured once per file and copied (capture costs seconds on a busy 2-core machine)."""
    if device == "meta" and path in _META:
        gm, structure, args, kwargs = _META[path]
        return copy.deepcopy(gm), structure, args, kwargs
    model_file = load_model_file(path)
    args, kwargs = model_file.inputs()
    model = set_run_mode(model_file.build(device), "fp32", training)
    gm = capture(model, args, kwargs)
    found = gm, analyse(gm), args, kwargs
    if device == "meta":
        _META[path] = found
        return _captured(path)
    return found


_META: dict[Path, tuple] = {}


def _plan(path: Path, structure, tp: int, workload: str = "train", **fields):
    plan = fixed_plan(structure, str(path), tp, workload=workload)
    return dataclasses.replace(plan, **fields)


def _calls(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_sequence_parallel_layers_reduce_scatter_and_gather_twice_and_never_all_reduce():
    gm, structure, _, _ = _captured(LLAMA)
    plan = _plan(LLAMA, structure, 2, sequence_parallel=True)
    lowered = lower_for_rank(gm, structure, plan, 1, training=True)
    assert lowered.sequence_parallel
    owner = layer_of_nodes(gm, [layer.module_path for layer in structure.layers])
    for i in range(len(structure.layers)):
        calls = [n.target for n in gm.graph.nodes if owner[n] == f"layer {i}" and n.op == "call_function"]
        assert calls.count(collectives.tp_reduce_scatter) == 2, i
        assert collectives.tp_all_reduce not in calls and collectives.tp_all_gather not in calls, i
    calls = _calls(gm)
    # training: each block's gather and its matmuls are one function that keeps the sequence shard
    # for backward and gathers it again there (`passes.tp_overlap.apply_sequence_regather`)
    fused = [n for n in gm.graph.nodes if n.target is tp_overlap.tp_column_matmuls]
    assert len(fused) == 2 * len(structure.layers) == gm.meta["sp_regather"]
    assert all(n.args[5] == 1 and n.args[6] == 1 and n.args[7] is False for n in fused)  # seq 1, 1 chunk
    (embedding,) = [n for n in gm.graph.nodes if n.target is collectives.vocab_parallel_embedding]
    assert embedding.args[3:] == (1,)  # the lookup's sum is reduce-scattered along the tokens
    assert tuple(embedding.meta["val"].shape) == (2, 16, 128)  # (B, T / tp, C)
    # the LM head gathers the sequence once; its vocab-sharded logits stay sharded for the loss
    assert calls.count(collectives.tp_sequence_gather) == 1
    assert calls.count(collectives.tp_all_gather) == 0
    assert gm.meta[OUTPUT_SHARD] == OutputShard(
        2, structure.lm_head.out_features, structure.lm_head.out_features // 2
    )
    # plain TP of the same plan: two all-reduces per layer, no sequence collectives
    gm, structure, _, _ = _captured(LLAMA)
    lower_for_rank(gm, structure, _plan(LLAMA, structure, 2), 1, training=True)
    calls = _calls(gm)
    assert calls.count(collectives.tp_all_reduce) == 2 * len(structure.layers)
    assert collectives.tp_reduce_scatter not in calls and collectives.tp_sequence_gather not in calls


def test_a_whole_weight_read_by_a_sequence_shard_sums_its_gradient_over_the_ranks():
    """A JAX port's per-head q / k / v einsums (`"btd,dhk->bthk"`, 3-D weights kept whole) read the
    rank's sequence shard under sequence parallelism: each weight reaches its einsum through `tp_copy`,
    whose backward sums the ranks' gradients (each covers only its tokens; without it the weights'
    gradients were wrong by half, caught by the run's check)."""
    gm, structure, _, _ = _captured(FLAX)
    plan = _plan(FLAX, structure, 2, sequence_parallel=True)
    lowered = lower_for_rank(gm, structure, plan, 0, training=True).module
    einsums = [n for n in lowered.graph.nodes if n.target is torch.ops.aten.einsum.default]
    per_head = [n for n in einsums if str(n.args[0]).startswith("btd,dhk")]
    assert len(per_head) == 6, [str(n.args[0]) for n in einsums]
    for node in per_head:
        x, w = node.args[1]
        assert w.target is collectives.tp_copy and w.args[0].op == "get_attr", (node.name, w)


def test_sequence_parallel_refuses_what_it_cannot_run_naming_the_field():
    model_file = load_model_file(LLAMA)
    args, kwargs = model_file.inputs(seq_len=31)
    gm = capture(model_file.build("meta"), args, kwargs)
    structure = analyse(gm)
    with pytest.raises(InputError, match=r"'sequence_parallel'.*31 token\(s\) does not divide by tp=2"):
        lower_for_rank(gm, structure, _plan(LLAMA, structure, 2, sequence_parallel=True), 0)
    gm, structure, _, _ = _captured(LLAMA)
    plan = _plan(LLAMA, structure, 2, workload="forward", sequence_parallel=True, ladder_layers=[3])
    with pytest.raises(InputError, match="'sequence_parallel' and 'ladder_layers'"):
        lower_for_rank(gm, structure, plan, 0)


def test_a_vit_gets_sequence_parallelism_only_where_its_patch_tokens_divide_by_tp():
    """A ViT's layers see 17 tokens (16 patches and the class token) of (B, 3, 32, 32) images, whose
    input has no sequence (`seq_len` 1). `--sequence-parallel off` failed with exit 2: "the plan's
    field 'sequence_parallel' is true but the sequence of 1 token(s) does not divide by tp=2", from
    the Megatron baseline (sequence parallel at any TP > 1) lowered beside the plan. Now off and auto
    plan without it, the baseline too, and on is refused naming the 17 tokens."""
    prepared = prepare(str(VIT), "train")
    assert prepared.structure.seq_len == 1 and prepared.structure.stream_tokens() == [17]
    cluster = load_cluster(str(FASTLINK))
    for pinned in (False, None):
        constraints = constraints_from(2, None, None, "none", sequence_parallel=pinned)
        plan = make_plan(prepared, cluster, constraints, str(VIT))
        assert plan.tp == 2 and not plan.sequence_parallel, pinned
        assert plan.baseline is not None and plan.baseline_layout["sequence_parallel"] == "false"
    with pytest.raises(InfeasibleError, match=r"sequence of 17 token\(s\) does not divide by 2"):
        make_plan(
            prepared, cluster, constraints_from(2, None, None, "none", sequence_parallel=True), str(VIT)
        )


def test_a_pinned_sequence_parallel_on_leaves_tp1_out_of_the_search():
    """`--sequence-parallel on` with the TP degree left to the search on 2 devices chose TP=1 (DP=2),
    where there is no sequence to split, then refused its own plan ("splits no projection
    row-wise ... use --sequence-parallel auto or off"). TP=1 is no candidate when it is pinned on:
    the plan is TP=2 with sequence parallelism; one device or --tp 1 is refused naming the pin."""
    model = str(ROOT / "tests" / "models" / "tiny_mixtral.py")
    prepared = prepare(model, "train")
    cluster = load_cluster(str(FASTLINK))
    on = constraints_from(None, None, None, "none", max_devices=2, sequence_parallel=True)
    plan = make_plan(prepared, cluster, on, model)
    assert plan.tp == 2 and plan.sequence_parallel
    # a pin that leaves TP=1 only is a contradiction of flags (exit 2), not an infeasible plan
    for pins, why in ((dict(max_devices=1), "one device"), (dict(tp=1), "--tp 1")):
        tp = pins.pop("tp", None)
        with pytest.raises(InputError, match=rf"--sequence-parallel on .*{why} leaves one"):
            make_plan(
                prepared,
                cluster,
                constraints_from(tp, None, None, "none", sequence_parallel=True, **pins),
                model,
            )


def test_recompute_keys_are_the_cost_model_layer_classes_or_plan_wide():
    _, structure, _, _ = _captured(LLAMA)
    key = layer_key(structure.layers[0])
    n = len(structure.layers)
    assert recompute_of_layers(structure, {key: Recompute.FULL}) == [Recompute.FULL] * n
    assert recompute_of_layers(structure, {"*": "selective"}) == [Recompute.SELECTIVE] * n
    assert recompute_of_layers(structure, {"layer": Recompute.FULL, key: "none"}) == [Recompute.NONE] * n
    assert recompute_of_layers(structure, {}) == [Recompute.NONE] * n
    # a saved plan run on a model whose layers changed since (the same parameter count) names that first
    with pytest.raises(
        InputError, match=r"'recompute' names layer classes \['attn'\].*changed since planning.*'\*'"
    ):
        recompute_of_layers(structure, {"attn": Recompute.FULL})


def _saved_and_grads(gm: torch.fx.GraphModule, inputs: tuple) -> tuple[int, dict[str, torch.Tensor]]:
    """Tensors autograd saved in forward (outside recomputed regions), and every parameter gradient
    after backward of sum(output ** 2)."""
    count = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return t

    gm.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = gm(*inputs)
    out.pow(2).sum().backward()
    return count, {k: p.grad.clone() for k, p in gm.named_parameters()}


def test_recompute_keeps_gradients_and_saves_fewer_tensors_unsharded():
    # dropout on (the default generator: checkpoint restores it for the re-run)
    runs = {}
    captured, structure, args, kwargs = _captured(DROPOUT, training=True, device="cpu")
    for kind in Recompute:
        plan = _plan(DROPOUT, structure, 1, recompute={"*": kind})
        lowered = lower_for_rank(copy.deepcopy(captured), structure, plan, 0, training=True)
        assert len(lowered.recomputed) == (0 if kind is Recompute.NONE else len(structure.layers))
        torch.manual_seed(1)
        runs[kind] = _saved_and_grads(lowered.module, flat_inputs(args, kwargs))
    saved = {kind: count for kind, (count, _) in runs.items()}
    assert saved[Recompute.FULL] < saved[Recompute.SELECTIVE] < saved[Recompute.NONE], saved
    for kind in (Recompute.SELECTIVE, Recompute.FULL):
        for name, grad in runs[Recompute.NONE][1].items():
            assert torch.equal(runs[kind][1][name], grad), (kind, name)


def _recompute_with_dropout(ctx: RankContext, _: object) -> dict:
    """Per rank, TP=2 with sequence parallelism, dropout on: gradients and saved tensors of the same
    step lowered with no, selective and full recompute, every dropout stream seeded alike."""
    gm, structure, _, _ = _captured(DROPOUT)
    plan = _plan(DROPOUT, structure, 2, sequence_parallel=True, batch_size=2)
    setup = set_up_rank(ctx, RunJob(str(DROPOUT), plan.to_dict(), workload="train"))
    inputs = flat_inputs(setup.args, setup.kwargs)
    out: dict[str, object] = {}
    for kind in Recompute:
        torch.manual_seed(0)  # the same weights for every lowering
        model = set_run_mode(setup.model_file.build("cpu"), "fp32", training=True)
        gm = capture(model, setup.args, setup.kwargs)
        planned = dataclasses.replace(plan, recompute={"*": kind})
        lowered = lower_for_rank(gm, analyse(gm), planned, ctx.rank, training=True)
        out[f"{kind.value}_dropouts"] = len(rng.dropout_nodes(lowered.module))
        seed_dropout_rng(7, 0, setup.groups.tp_rank, ctx.device)
        out[kind.value] = _saved_and_grads(lowered.module, inputs)
    seed_dropout_rng(8, 0, setup.groups.tp_rank, ctx.device)  # other masks: other gradients
    out["other_seed"] = _saved_and_grads(lowered.module, inputs)[1]
    return out


TOKENS_LM = ROOT / "tests" / "models" / "tiny_lm_tokens.py"


def _megatron_sp_plan(batch_size: int, seq_len: int):
    """tiny_lm_tokens.py's Megatron plan at TP 2 with sequence parallelism, no recompute."""
    model_file = load_model_file(TOKENS_LM)
    args, kwargs = model_file.inputs(batch_size, seq_len)
    structure = analyse(capture(model_file.build("meta"), args, kwargs))
    plan = fixed_plan(structure, str(TOKENS_LM), 2, workload="train")
    fields = dict(
        batch_size=batch_size, seq_len=seq_len, sequence_parallel=True, recompute={"*": Recompute.NONE}
    )
    return dataclasses.replace(plan, **fields), structure


def _saved_activation_bytes(ctx: RankContext, tp_comm_overlap: bool = False) -> int:
    """Bytes of the distinct storages autograd keeps (parameters aside) through one forward of this
    rank's module of `_megatron_sp_plan(4, 64)` (with TP overlap if asked): what the planner's
    activation bytes price."""
    plan, _ = _megatron_sp_plan(4, 64)
    plan = dataclasses.replace(plan, tp_comm_overlap=tp_comm_overlap)
    model_file = load_model_file(TOKENS_LM)
    args, kwargs = model_file.inputs(4, 64)
    torch.manual_seed(0)
    gm = capture(set_run_mode(model_file.build("cpu"), "fp32", training=True), args, kwargs)
    module = lower_for_rank(gm, analyse(gm), plan, ctx.rank, training=True).module
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*flat_inputs(args, kwargs))
    return sum(kept.values())


def _sequence_parallel_runs(ctx: RankContext, jobs: list[RunJob]) -> dict:
    return {
        "reports": [run_rank(ctx, job) for job in jobs],
        "recompute": _recompute_with_dropout(ctx, None),
        "saved_bytes": _saved_activation_bytes(ctx),
        "saved_bytes_overlap": _saved_activation_bytes(ctx, tp_comm_overlap=True),
    }


def _priced_activation_bytes(plan, structure) -> float:
    """The activation bytes one rank of `plan` stores per micro-batch as the cost model prices them:
    every layer's ops in the plan's options (projections as split, the attention core by heads, the
    MLP activation sharded) plus the norms', and the LM head's."""
    work = WorkloadSpec("train", plan.batch_size, plan.seq_len, dtype="fp32")
    tables = price(
        structure, load_cluster("local-cpu"), work, MeshConfig(plan.mesh, 1, sequence_parallel=True)
    )

    def chosen(op) -> str:
        names = {o.name for o in op.options}
        if op.weight in plan.splits:
            return "vocab" if "vocab" in names else plan.splits[op.weight].style.value
        return next(n for n in ("head", "shard", "replicate") if n in names)

    total = tables.ends.fixed_activation_bytes + sum(
        op.option(chosen(op)).activation_bytes for op in tables.ends.ops
    )
    # the logits' gradient, priced with the LM head's activations, is alive when the backward starts but
    # is not saved for it: this rank's vocabulary shard of fp32 logits
    head = structure.lm_head
    total -= plan.batch_size * plan.seq_len * head.out_features / plan.tp * 4
    for key in tables.layer_keys:
        graph = tables.graphs[key]
        total += graph.fixed_activation_bytes + sum(
            op.option(chosen(op)).activation_bytes for op in graph.ops
        )
    return total


@pytest.mark.slow
def test_sequence_parallel_matches_unsharded_and_recompute_replays_dropout_on_two_ranks():
    _, structure, _, _ = _captured(LLAMA)
    plan = _plan(LLAMA, structure, 2, sequence_parallel=True, recompute={"*": Recompute.SELECTIVE})
    _, flax_structure, _, _ = _captured(FLAX)
    flax = _plan(FLAX, flax_structure, 2, sequence_parallel=True)
    jobs = [
        RunJob(str(LLAMA), plan.to_dict(), workload="train", warmup=0, iters=1),
        RunJob(str(FLAX), flax.to_dict(), workload="train", warmup=0, iters=1),
    ]
    results = launch(_sequence_parallel_runs, jobs, nproc=2, timeout_s=180)
    # whole per-head weights read by the sequence shard: their gradients summed over the ranks
    flax_numerics = summarise([r["reports"][1] for r in results])["numerics"]
    assert not check_failures(flax_numerics), flax_numerics
    assert flax_numerics["grad_max_abs_diff"] is not None, flax_numerics
    # sequence parallelism (with selective recompute) through the runtime: outputs, loss and every
    # gradient against the unsharded model on the whole batch
    summary = summarise([r["reports"][0] for r in results])
    n = summary["numerics"]
    assert n["max_abs_diff"] <= 1e-5 * n["output_scale"], n
    assert n["grad_max_abs_diff"] is not None and n["grad_max_abs_diff"] <= 1e-6, n
    notes = summary["measured"]["notes"]
    assert any("sequence parallelism applied" in t and "8 reduce-scatter(s)" in t for t in notes), notes
    # the layers' 8 entries fused with their matmuls (shard kept, gathered again), the LM head's plain
    assert any("9 sequence all-gather(s), 8 of them fused" in t for t in notes), notes
    assert any(t.startswith("activation recompute: selective (attention core) on layers 0-3") for t in notes)
    for r in results:
        got = r["recompute"]
        assert got["none_dropouts"] == got["full_dropouts"] > 0  # dropout drew in every lowering
        none_saved, none_grads = got["none"]
        for kind in ("selective", "full"):
            saved, grads = got[kind]
            assert saved < none_saved, (kind, saved, none_saved)
            for name, grad in none_grads.items():  # the recomputed masks are the forward's
                assert torch.equal(grads[name], grad), (kind, name)
        assert any(not torch.equal(got["other_seed"][k], g) for k, g in none_grads.items())
    # what the ranks keep for backward is what the planner prices: each column-parallel block keeps
    # its input's sequence shard once (gathered again in backward), not the gathered input per
    # projection (the gathered input kept whole read 14% above this price; counting the shard once per
    # q / k / v and gate / up priced 13% above the bytes kept)
    priced = _priced_activation_bytes(*_megatron_sp_plan(4, 64))
    for r in results:
        assert r["saved_bytes"] <= priced * 1.06 and priced <= r["saved_bytes"] * 1.06, (
            r["saved_bytes"],
            priced,
        )
        assert r["saved_bytes_overlap"] == r["saved_bytes"], r  # TP overlap keeps the same tensors


def test_sequence_parallelism_is_not_chosen_without_a_row_parallel_block() -> None:
    """On nearly free links the ILP splits every projection column-wise (taken as it is here, not
    re-solved for Megatron's pairing): with no row-parallel block, sequence parallelism has nothing to
    split and the pass would not apply it, so the search keeps it off (it chose it, priced 0.5%
    faster) and --why says why."""
    import dataclasses  # noqa: PLC0415

    from planner.cli import workflow  # noqa: PLC0415

    model, spec_file = "tests/models/pre_ln_blocks.py", "tests/models/fastlink.yaml"
    prepared = workflow.prepare(model, "train")
    spec = workflow.resolve_cluster(spec_file, 2)
    constraints = dataclasses.replace(
        workflow.constraints_from(2, None, None, "none"), pairing_min_saving_fraction=None
    )
    plan = workflow.make_plan(prepared, spec, constraints, model, spec_file)
    assert "rowwise" not in {str(s.style) for s in plan.splits.values()}
    assert not plan.sequence_parallel
    (decision,) = [d for d in plan.decisions if d.subject == "sequence-parallel"]
    assert decision.chosen == "off" and "no row-parallel block" in decision.reason


def test_training_with_ladder_keeps_sequence_parallelism_off_or_refuses_the_pinned_pair() -> None:
    """Ladder residual and sequence parallelism exclude each other (`check_runnable`). With
    `--ladder upper:N` the search used to choose sequence parallelism on its own and then refuse its
    own plan (every training plan with a ladder failed under the defaults); now it leaves it off, and
    a pinned `--sequence-parallel on` with `--ladder upper:N` is refused naming both flags."""
    from planner.cli import workflow  # noqa: PLC0415

    model = "examples/llama3.py"
    prepared = workflow.prepare(model, "train")
    spec = workflow.resolve_cluster("dgx-h100", 2)
    plan = workflow.make_plan(
        prepared, spec, workflow.constraints_from(2, 1, 1, "upper:2"), model, "dgx-h100"
    )
    assert plan.ladder_layers == [2, 3] and not plan.sequence_parallel
    pinned = workflow.constraints_from(2, 1, 1, "upper:2", sequence_parallel=True)
    with pytest.raises(InputError, match="--sequence-parallel on and --ladder upper:N"):
        workflow.make_plan(prepared, spec, pinned, model, "dgx-h100")


def test_a_pinned_micro_batch_count_survives_the_megatron_fallback() -> None:
    """The search falls back to the Megatron plan when that is faster, but only if it honours the
    user's pins: a pinned --micro-batches 4 came back as 1 micro-batch (the baseline picks its own)."""
    from planner.cli import workflow  # noqa: PLC0415

    model = "examples/llama3_8b.py"
    prepared = workflow.prepare(model, "train", batch_size=8, seq_len=4096, micro_batches=4, dtype="bf16")
    spec = workflow.resolve_cluster("dgx-h100", None)
    plan = workflow.make_plan(
        prepared, spec, workflow.constraints_from(8, None, None, "none"), model, "dgx-h100"
    )
    assert plan.micro_batches == 4

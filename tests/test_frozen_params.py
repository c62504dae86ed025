"""Frozen parameters (requires_grad=False: a fine-tune's base weights, a linear probe, frozen bottom
layers) are priced as a training step runs them: held as weights only (no gradient, no Adam state,
not sharded by ZeRO / FSDP, not reduced over DP), with no weight-gradient GEMM, and with no backward
at all through the layers no gradient reaches. Model: tests/models/frozen_gpt.py (its `FREEZES`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from costmodels import compute
from costmodels.cluster import load_cluster
from costmodels.memory import dp_state_bytes
from planner.errors import InputError
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture
from planner.frontend.depth import capture_for_planning
from planner.plan import DataParallel, MeshShape, Recompute
from planner.solver.costing import CostContext, build_cost_tables
from planner.solver.prediction import layer_breakdown
from planner.solver.problem import Assignment, Constraints, MeshConfig, WorkloadSpec
from planner.solver.search import _with_state_factor, plan_model
from tests.cli_in_process import planner_in_process
from tests.models import frozen_gpt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import llama3_8b  # noqa: E402

WORK = WorkloadSpec("train", 8, 16)
_STRUCTURES: dict = {}


def structure(freeze: str):
    if freeze not in _STRUCTURES:
        model = frozen_gpt.build_model(freeze)
        _STRUCTURES[freeze] = analyse(capture(model, frozen_gpt.example_inputs(), {}))
    return _STRUCTURES[freeze]


def tables(freeze: str, style: DataParallel, cluster: str = "local-cpu", tp: int = 1, dp: int = 2):
    s = structure(freeze)
    config = MeshConfig(MeshShape(tp=tp, pp=1, dp=dp), 1, dp_style=style)
    spec = load_cluster(cluster, nproc=tp * dp) if cluster == "local-cpu" else load_cluster(cluster)
    return build_cost_tables(CostContext(s, spec, WORK, config, "fp32"))


def replicated_static_bytes(t) -> float:
    """Static bytes per rank of `t` (tp 1: every op's one option), layers and ends."""
    total = sum(t.graphs[k].fixed_static_bytes + sum(op.options[0].static_bytes for op in t.graphs[k].ops)
                for k in t.layer_keys)  # fmt: skip
    return total + t.ends.fixed_static_bytes + sum(op.options[0].static_bytes for op in t.ends.ops)


def grad_bytes(t) -> float:
    total = sum(t.graphs[k].fixed_grad_bytes + sum(op.options[0].grad_bytes for op in t.graphs[k].ops)
                for k in t.layer_keys)  # fmt: skip
    return total + t.ends.fixed_grad_bytes + sum(op.options[0].grad_bytes for op in t.ends.ops)


@pytest.mark.parametrize(
    "freeze, frozen_layers, input_grads",
    [
        ("none", [0, 0, 0, 0], [True] * 4),
        ("layer0", [1, 0, 0, 0], [True] * 4),  # the embeddings train: a gradient reaches layer 0
        ("emb", [0, 0, 0, 0], [False, True, True, True]),
        ("probe", [1, 1, 1, 1], [False] * 4),
        ("bottom", [1, 1, 0, 0], [False, False, False, True]),
    ],
)
def test_analysis_records_frozen_parameters(freeze, frozen_layers, input_grads):
    s = structure(freeze)
    model = frozen_gpt.build_model(freeze)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert s.frozen_params == frozenset(frozen)
    assert s.num_frozen_params == sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert [layer.frozen_params == layer.num_params for layer in s.layers] == [bool(f) for f in frozen_layers]
    assert [layer.input_requires_grad for layer in s.layers] == input_grads
    assert [layer.trainable for layer in s.layers] == [g or not f for g, f in zip(input_grads, frozen_layers)]


@pytest.mark.parametrize("freeze", ["none", "layer0", "emb", "probe", "bottom", "lora"])
@pytest.mark.parametrize("style", [DataParallel.DDP, DataParallel.ZERO1, DataParallel.FSDP])
def test_priced_state_is_trainable_state_plus_frozen_weights(freeze, style):
    """What the tables price per rank is `dp_state_bytes` of the trainable parameters (what the run
    measures as its training state, `runtime.execute._record_state`) plus the frozen weights and the
    graph's buffers, once each, and only the trainable parameters' gradients are reduced."""
    s = structure(freeze)
    t = tables(freeze, style)
    trainable = s.num_params - s.num_frozen_params
    want = dp_state_bytes(trainable, "fp32", style, 2) + 4 * s.num_frozen_params + s.buffer_bytes
    assert replicated_static_bytes(t) == pytest.approx(want, rel=1e-9)
    assert grad_bytes(t) == pytest.approx(4 * trainable, rel=1e-9)


@pytest.mark.parametrize("freeze", ["none", "layer0", "probe", "lora"])
@pytest.mark.parametrize("style", [DataParallel.ZERO1, DataParallel.FSDP])
def test_state_factor_rescaling_keeps_frozen_weights(freeze, style):
    """The search prices a data-parallel style by rescaling another style's tables
    (`search._with_state_factor`): that gives what building the tables for the style gives, frozen
    weights and buffers unscaled."""
    ddp, direct = tables(freeze, DataParallel.DDP), tables(freeze, style)
    ratio = direct.ctx.state_factor() / ddp.ctx.state_factor()
    graphs, ends = _with_state_factor(ddp.graphs, ddp.ends, ratio, ratio)
    for key in ddp.layer_keys:
        assert graphs[key].fixed_static_bytes == pytest.approx(direct.graphs[key].fixed_static_bytes)
        for op, want in zip(graphs[key].ops, direct.graphs[key].ops):
            assert op.options[0].static_bytes == pytest.approx(want.options[0].static_bytes)
    assert ends.fixed_static_bytes == pytest.approx(direct.ends.fixed_static_bytes)
    for op, want in zip(ends.ops, direct.ends.ops):
        assert op.options[0].static_bytes == pytest.approx(want.options[0].static_bytes)


@pytest.mark.parametrize("cluster", ["local-cpu", "dgx-h100"])
def test_frozen_weight_runs_no_weight_gradient(cluster):
    """A frozen projection's backward is its input gradient only: on a roofline device 2 forwards
    where a trained one is 3; on a GPU priced by GEMM shape, the trained projection less its
    weight-gradient GEMM ((K, M) @ (M, N), `compute.training_gemm_shapes`)."""
    trained = tables("none", DataParallel.DDP, cluster).graphs
    frozen = tables("layer0", DataParallel.DDP, cluster)
    ctx = frozen.ctx
    layer0 = frozen.graphs[frozen.layer_keys[0]]
    base = next(iter(trained.values()))
    checked = 0
    for op in layer0.ops:
        p = op.projection
        if p is None:
            continue
        want, got = base.op(op.name).options[0], op.options[0]
        assert got.grad_bytes == 0 and got.frozen_bytes == got.static_bytes > 0
        # autograd keeps no input for a frozen weight (its input gradient needs the weight only)
        assert got.activation_bytes == 0 < want.activation_bytes
        if cluster == "local-cpu":
            assert got.compute_s == pytest.approx(want.compute_s * 2 / 3)
        else:
            bias = p.bias is not None
            flops = compute.linear_flops(ctx.tokens, p.in_features, p.out_features, bias)
            moved = compute.linear_bytes(ctx.tokens, p.in_features, p.out_features, ctx.dtype, bias)
            wgrad = compute.op_time_s(flops, moved, ctx.cluster.device, ctx.dtype, "matmul",
                                      rows=p.in_features, shape=(ctx.tokens, p.out_features))  # fmt: skip
            assert got.compute_s == pytest.approx(want.compute_s - wgrad)
        checked += 1
    assert checked == 4  # qkv, o, fc, out


def test_layers_no_gradient_reaches_run_forward_only():
    """A linear probe (every block frozen, nothing upstream trains) runs the blocks forward only: a
    third of a trained block's compute or less, no activations kept, nothing reduced or stepped."""
    trained = tables("none", DataParallel.DDP, "dgx-h100")
    probe = tables("probe", DataParallel.DDP, "dgx-h100")
    base = trained.graphs[trained.layer_keys[0]]
    for key in probe.layer_keys:
        graph = probe.graphs[key]
        assert "no-backward" in key
        compute = graph.fixed_compute_s + sum(op.options[0].compute_s for op in graph.ops)
        full = base.fixed_compute_s + sum(op.options[0].compute_s for op in base.ops)
        assert compute < full / 2.5
        assert graph.fixed_activation_bytes == 0 and all(
            op.options[0].activation_bytes == 0 for op in graph.ops
        )
        assert graph.fixed_grad_bytes == 0 and all(op.options[0].grad_bytes == 0 for op in graph.ops)
    bottom = tables("bottom", DataParallel.DDP, "dgx-h100")
    assert ["no-backward" in k for k in bottom.layer_keys] == [True, True, False, False]
    # the LM head: no input gradient for the probe (nothing before it trains), one for the others
    head = {name: t.ends.op("lm_head").options[0].compute_s for name, t in (("none", trained), ("probe", probe),
                                                                           ("bottom", bottom))}  # fmt: skip
    assert head["probe"] < head["none"] == head["bottom"]


@pytest.mark.parametrize("pinned", [Recompute.FULL, Recompute.SELECTIVE])
def test_pinned_recompute_leaves_forward_only_layers_alone(pinned):
    """--recompute pinned for every layer class: the layers no gradient reaches have no backward to
    recompute in, so the plan records none for them and prices none there (it priced a third of
    their forward again and their layer inputs kept); the trained layers take the pin."""
    cluster = load_cluster("dgx-h100")
    work = WorkloadSpec("train", 8, 16, dtype="bf16")
    s = structure("bottom")
    plan = plan_model(s, cluster, work, Constraints(tp=1, pp=1, dp=1, recompute=pinned))
    recompute = {key: str(r) for key, r in plan.recompute.items()}
    assert {r for k, r in recompute.items() if "no-backward" in k} == {"none"}
    assert {r for k, r in recompute.items() if "no-backward" not in k} == {str(pinned)}
    t = build_cost_tables(CostContext(s, cluster, work, MeshConfig(MeshShape(1, 1, 1), 1), "bf16"))
    frozen = next(k for k in t.layer_keys if "no-backward" in k)
    graph = t.graphs[frozen]
    assert not graph.backward
    choices = {(frozen, op.name): op.options[0].name for op in graph.ops}
    times = [
        layer_breakdown(graph, frozen, Assignment(choices, [[0]], recompute={frozen: r}), False, t.ctx)
        for r in Recompute
    ]
    assert len({(b.compute_s, b.activation_bytes) for b in times}) == 1


def test_plan_of_a_probe_counts_the_flops_it_runs():
    """The plan's model FLOP count is what the step computes: the blocks' forward, the head's forward
    and weight gradient; not 3x every weight (which read as more than the device's peak)."""
    cluster = load_cluster("dgx-h100")
    work = WorkloadSpec("train", 8, 16, dtype="bf16")
    full = plan_model(structure("none"), cluster, work, Constraints(tp=1, pp=1, dp=1)).predicted.model_flops
    probe = plan_model(structure("probe"), cluster, work, Constraints(tp=1, pp=1, dp=1)).predicted.model_flops
    assert probe < full / 2
    s = structure("probe")
    tokens = 8 * 16
    blocks = sum(2 * tokens * p.in_features * p.out_features for layer in s.layers
                 for p in [*layer.attention.projections, *layer.mlp.projections])  # fmt: skip
    # the head: forward and weight gradient; no input gradient, as nothing before it trains
    head = 2 * tokens * s.lm_head.in_features * s.lm_head.out_features * 2
    a = s.layers[0].attention
    cores = len(s.layers) * compute.attention_flops(8, a.num_heads, 16, 16, a.head_dim, True)
    assert probe == pytest.approx(blocks + head + cores)


def test_training_a_model_with_nothing_trainable_is_refused():
    with pytest.raises(InputError, match="requires_grad=False.*--workload forward"):
        plan_model(structure("all"), load_cluster("local-cpu", nproc=1), WORK, Constraints())


def test_llama3_8b_linear_probe_plans_on_one_h100():
    """Llama-3-8B with only its LM head trained (captured as a few layers and extended: the copied
    layers are frozen too, `depth._mark_frozen`) fits one H100: its frozen weights are 16 GB of bf16,
    where training every weight (16 bytes each with Adam) needs ~120 GiB and was refused."""
    model = llama3_8b.build_model()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("lm_head") or name.startswith("output"))
    s = capture_for_planning(model, llama3_8b.example_inputs(1, 128), {})[1]
    assert len(s.layers) == 32 and all(not layer.trainable for layer in s.layers)
    assert s.num_params - s.num_frozen_params == s.lm_head.in_features * s.lm_head.out_features
    work = WorkloadSpec("train", 8, 4096, dtype="bf16")
    plan = plan_model(s, load_cluster("dgx-h100"), work, Constraints(max_devices=1))
    assert plan.mesh.num_devices == 1
    assert plan.predicted.peak_memory_bytes < load_cluster("dgx-h100").device.memory_bytes
    flops_per_s = plan.predicted.model_flops_per_s_per_device
    assert 0 < flops_per_s < load_cluster("dgx-h100").device.peak_flops_per_s["bf16"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", [["--dp", "2", "--dp-style", "zero1"], ["--pp", "2"]], ids=["zero1", "pp2"]
)
def test_run_of_frozen_bottom_layers_matches_the_plan(tmp_path, layout):
    """2 gloo ranks, the embeddings and first two blocks frozen, ZeRO-1 over dp 2 or two pipeline stages
    (the first with nothing to train: its optimizer steps nothing): the rewritten model's outputs, the
    trainable gradients and the first update match the unsharded model's (exit 0), and the training
    state the ranks hold is what the plan priced for the trainable parameters."""
    model = frozen_gpt.write_model_file(tmp_path / "bottom.py", "bottom")
    report = tmp_path / "report.json"
    root = Path(__file__).resolve().parent.parent
    r = planner_in_process(
        "optimize", str(model), "--cluster", "local-cpu", "--nproc", "2", "--workload", "train", "--batch-size",
        "8", "--seq-len", "16", *layout, "--run", "--iters", "2", "--min-time", "0", "--warmup", "1",
        "--json", str(report), cwd=root,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    measured = json.loads(report.read_text())["measured"]
    s = structure("bottom")
    trainable = s.num_params - s.num_frozen_params
    if "zero1" in layout:
        want = dp_state_bytes(trainable, "fp32", DataParallel.ZERO1, 2)
        assert measured["predicted_state_bytes"] == pytest.approx(want)
    assert measured["state_bytes"] == pytest.approx(measured["predicted_state_bytes"], rel=0.01)


def test_run_refuses_a_model_whose_frozen_parameters_changed():
    """A training plan made for a linear probe, run with the model unfrozen: the plan names what changed
    (it had blamed the plan's recompute keys, or run the stale plan silently when they matched)."""
    from planner.cli.workflow import validate_plan_for_model

    plan = plan_model(
        structure("probe"), load_cluster("local-cpu", nproc=1), WORK, Constraints(tp=1, pp=1, dp=1)
    )
    model = frozen_gpt.build_model("none")
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    validate_plan_for_model(plan, structure("probe"), "m.py", params)  # the model it was made for
    for changed in ("none", "emb"):
        with pytest.raises(InputError, match="frozen_params: .* 57,024 frozen .* freezes"):
            validate_plan_for_model(plan, structure(changed), "m.py", params)

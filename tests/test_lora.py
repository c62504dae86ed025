"""LoRA adapters (Hu et al. 2021; PEFT's LoraLayer: base(x) + up(down(dropout(x))) * scaling) are
planned with the projection they adapt (`planner.frontend.roles.Adapter`): the layers analyse as the
model without them, each adapter follows its projection's split (beside a column-parallel one down
whole and up split with the projection's parts; beside a row-parallel one down split, its (tokens,
rank) partial sums all-reduced, up whole), and its GEMMs, weights and all-reduce are priced in the
projection's options. Models: tests/models/frozen_gpt.py ("lora": rank-4 adapters on all four
projections, fused QKV included) and a Hugging Face Llama with PEFT's adapters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from costmodels import compute
from costmodels.cluster import load_cluster
from costmodels.comm import all_reduce_time_s
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture
from planner.frontend.depth import capture_for_planning
from planner.plan import MeshShape, SplitStyle
from planner.solver.costing import CostContext, build_cost_tables, layer_key
from planner.solver.problem import Constraints, MeshConfig, WorkloadSpec
from planner.solver.search import plan_model
from tests.cli_in_process import planner_in_process
from tests.models import frozen_gpt

ROOT = Path(__file__).resolve().parent.parent
WORK = WorkloadSpec("train", 8, 16)


def structure_of(model):
    return analyse(capture(model, frozen_gpt.example_inputs(), {}))


def structure(freeze: str):
    return structure_of(frozen_gpt.build_model(freeze))


def test_adapters_attach_to_their_projections():
    lora, plain = structure("lora"), structure("none")
    for layer, base in zip(lora.layers, plain.layers):
        projections = [*layer.attention.projections, *layer.mlp.projections]
        assert [p.role for p in projections] == [
            p.role for p in [*base.attention.projections, *base.mlp.projections]
        ]
        assert all(p.adapter is not None and p.adapter.rank == frozen_gpt.RANK for p in projections)
        assert all(p.weight.endswith(".base.weight") for p in projections)
        assert {p.adapter.down.weight.rsplit(".", 2)[-2] for p in projections} == {"down"}
        qkv = layer.attention.projections[0]
        assert qkv.parts == (frozen_gpt.D,) * 3  # found after the adapter's add
        key = layer_key(layer)
        assert key.count("+lora4") == 4
        plain_key = key.replace("+lora4", "").replace(f";frozen{layer.frozen_params}", "")
        assert plain_key.replace(f"n{layer.num_params}", f"n{base.num_params}") == layer_key(base)


def test_deep_model_keeps_each_layers_adapters():
    """A deep model is captured as a few layers and extended (`depth.capture_for_planning`): each
    copied layer's adapters are renamed with it, so the plan splits every layer's adapters (they had
    all named the last captured layer's: the others ran replicated behind all-gathers)."""
    model = frozen_gpt.build_model("lora", layers=12)
    s = capture_for_planning(model, frozen_gpt.example_inputs(), {})[1]
    assert len(s.layers) == 12
    for i, layer in enumerate(s.layers):
        for p in [*layer.attention.projections, *layer.mlp.projections]:
            assert p.weight.startswith(f"h.{i}.") and p.adapter.down.weight.startswith(f"h.{i}.")
            assert p.adapter.up.weight.startswith(f"h.{i}.")
    plan = plan_model(s, load_cluster("local-cpu", nproc=2), WORK, Constraints(tp=2, layout="megatron"))
    names = {n for n, _ in model.named_parameters()}
    assert len(plan.adapters) == 2 * 4 * 12 and set(plan.adapters) <= names
    assert all(a.split(".")[1] == base.split(".")[1] for a, base in plan.adapters.items())
    assert set(plan.adapters) <= set(plan.splits)


def test_adapter_follows_its_projection_in_the_price():
    """Per option: the base weight frozen (no state, no gradient), the adapter's weights as split
    beside it with Adam state, and the all-reduce of the adapter's (tokens, rank) middle: forward
    beside a row-parallel projection, backward beside a column-parallel one."""
    s = structure("lora")
    cluster = load_cluster("local-cpu", nproc=2)
    ctx = CostContext(s, cluster, WORK, MeshConfig(MeshShape(tp=2, pp=1, dp=1), 1), "fp32")
    graph = build_cost_tables(ctx).graphs[layer_key(s.layers[0])]
    state, r, tokens, b = ctx.state_factor(), frozen_gpt.RANK, ctx.tokens, 4
    for op in graph.ops:
        p = op.projection
        if p is None:
            continue
        d, n = p.in_features, p.out_features
        base = (d * n + n) * b
        for option, shard_down, shard_up in (("replicate", 1, 1), ("colwise", 1, 2), ("rowwise", 2, 1)):
            o = op.option(option)
            shard = 1 if option == "replicate" else 2
            adapter = d * r / shard_down + r * n / shard_up
            assert o.frozen_bytes == pytest.approx(base / shard)
            assert o.static_bytes == pytest.approx(base / shard + adapter * b * state)
            assert o.grad_bytes == pytest.approx(adapter * b)
            reduce = all_reduce_time_s(tokens * r * b, ctx.tp_group(), cluster) + ctx.node_overhead_time(1)
            # row-parallel: the partial sums' all-reduce; column-parallel (training): up's input gradient's
            assert o.comm_s == pytest.approx(0.0 if option == "replicate" else reduce)


def test_adapter_gemms_are_priced_beside_a_frozen_projection():
    """A LoRA'd frozen projection costs its forward and input gradient, plus the adapter's two small
    GEMMs with their weight gradients and the add: more than the frozen projection alone."""
    lora = structure("lora")
    cluster = load_cluster("dgx-h100")
    config = MeshConfig(MeshShape(tp=1, pp=1, dp=1), 1)
    work = WorkloadSpec("train", 8, 4096, dtype="bf16")
    with_adapter = build_cost_tables(CostContext(lora, cluster, work, config, "bf16")).graphs[
        layer_key(lora.layers[1])
    ]
    ctx = CostContext(lora, cluster, work, config, "bf16")
    for op in with_adapter.ops:
        p = op.projection
        if p is None:
            continue
        alone = ctx.op_time(
            compute.linear_flops(ctx.tokens, p.in_features, p.out_features, True),
            compute.linear_bytes(ctx.tokens, p.in_features, p.out_features, "bf16", True),
            "matmul", rows=ctx.tokens, shape=(p.in_features, p.out_features), weight_grad=False,
        )  # fmt: skip
        assert op.options[0].compute_s > alone


def test_plan_splits_adapters_with_their_projection():
    s = structure("lora")
    plan = plan_model(s, load_cluster("local-cpu", nproc=2), WORK, Constraints(tp=2, layout="megatron"))
    layer = s.layers[0]
    for p in [*layer.attention.projections, *layer.mlp.projections]:
        split = plan.splits[p.weight]
        down, up = plan.splits[p.adapter.down.weight], plan.splits[p.adapter.up.weight]
        if split.style is SplitStyle.COLWISE:
            assert (down.style, up.style) == (SplitStyle.REPLICATE, SplitStyle.COLWISE)
            assert up.parts == split.parts and up.dim == 0
        else:
            assert split.style is SplitStyle.ROWWISE
            assert (down.style, up.style) == (SplitStyle.ROWWISE, SplitStyle.REPLICATE)
            assert down.dim == 1


def test_peft_lora_adapters_are_found():
    """PEFT's own LoraLayer on a Hugging Face Llama (q, k, v, o, gate, up, down; rank 8): every
    projection carries its adapter, the base weights are frozen, and the layer plans as Llama does."""
    pytest.importorskip("peft")
    sys.path.insert(0, str(ROOT / "examples"))
    import hf_llama_lora

    model = hf_llama_lora.build_model()
    s = analyse(capture(model, hf_llama_lora.example_inputs(), hf_llama_lora.example_kwargs()))
    for layer in s.layers:
        projections = [*layer.attention.projections, *layer.mlp.projections]
        assert len(projections) == 7
        assert all(p.adapter is not None and p.adapter.rank == hf_llama_lora.RANK for p in projections)
        assert all(p.weight in s.frozen_params for p in projections)
        assert not any(p.adapter.down.weight in s.frozen_params for p in projections)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert s.num_params - s.num_frozen_params == trainable


def test_sequence_parallel_adapters_run_on_the_token_shard_without_gathers(tmp_path):
    """Under sequence parallelism the adapters' whole projections run on the rank's tokens (down beside
    a column-parallel projection reads the block's input shard, up beside a row-parallel one the
    reduce-scattered shard): lowering the plan leaves no replicated fallback (16 all-gathers before)."""
    from planner.cli.main import main

    report = tmp_path / "plan.json"
    args = ["optimize", str(frozen_gpt.write_model_file(tmp_path / "lora.py", "lora")), "--cluster", "local-cpu", "--nproc", "2", "--workload",
            "train", "--batch-size", "8", "--seq-len", "16", "--tp", "2", "--layout", "megatron",
            "--sequence-parallel", "on", "--json", str(report)]  # fmt: skip
    assert main(args) == 0
    got = json.loads(report.read_text())
    assert got["fallbacks"] == [] and got["op_placement"]["replicated"] <= 2  # position ids: nothing gathered


@pytest.mark.slow
def test_run_of_lora_under_tensor_and_sequence_parallelism(tmp_path):
    """2 gloo ranks, TP 2 with sequence parallelism, Megatron's layout: the adapters beside the
    column- and row-parallel projections (fused QKV included) compute what the unsharded model does,
    outputs, the adapters' gradients and the first update (exit 0)."""
    model = frozen_gpt.write_model_file(tmp_path / "lora.py", "lora")
    report = tmp_path / "report.json"
    r = planner_in_process(
        "optimize", str(model), "--cluster", "local-cpu", "--nproc", "2", "--workload", "train", "--batch-size",
        "8", "--seq-len", "16", "--tp", "2", "--layout", "megatron", "--sequence-parallel", "on", "--run",
        "--iters", "2", "--min-time", "0", "--warmup", "1", "--json", str(report), cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    measured = json.loads(report.read_text())["measured"]
    assert measured["state_bytes"] == pytest.approx(measured["predicted_state_bytes"], rel=0.01)


def test_exports_say_what_they_leave_out():
    """Megatron-LM's and torchtitan's arguments describe the base model: the exports say that the
    adapters and the frozen weights are not in them (and do not list the adapters as weights the plan
    keeps replicated); the DTensor file styles each adapter as its projection needs and refuses,
    under sequence parallelism, the adapters it would run as plain linears on a DTensor."""
    from planner.export import export_plan

    s = structure("lora")
    plan = plan_model(s, load_cluster("local-cpu", nproc=2), WORK, Constraints(tp=2, layout="megatron"))
    assert plan.frozen_params == s.num_frozen_params and len(plan.adapters) == 2 * 4 * len(s.layers)
    for tool in ("megatron", "torchtitan"):
        warnings = " ".join(export_plan(plan, tool).warnings)
        assert "LoRA adapters beside 16 projection(s)" in warnings, tool
        assert f"freezes {s.num_frozen_params:,} of its {s.num_params:,} parameters" in warnings, tool
        assert "keeps" not in warnings or ".down.weight" not in warnings.split("keeps")[1], tool
    dtensor = export_plan(plan, "dtensor").text
    assert "'h.0.qkv.up': ColwiseParallel()" in dtensor and "'h.0.proj.down': RowwiseParallel()" in dtensor
    assert "UNSUPPORTED = {}" in dtensor
    sp = plan_model(
        s,
        load_cluster("local-cpu", nproc=2),
        WORK,
        Constraints(tp=2, layout="megatron", sequence_parallel=True),
    )
    text = export_plan(sp, "dtensor").text
    assert "'h.0.qkv.down': 'a LoRA adapter" in text.replace('"', "'")


def test_full_rank_pair_is_not_an_adapter_and_still_plans():
    """A down / up pair of full rank (r = the width) is not taken for LoRA: the layer's extra
    projections are priced as a chain of MLP projections, each op named by role and position, and the
    search plans it (a gated-looking MLP with duplicate roles had crashed it with a KeyError)."""
    s = structure_of(frozen_gpt.build_model("lora", rank=frozen_gpt.D))
    assert all(p.adapter is None for layer in s.layers for p in layer.mlp.projections)
    plan = plan_model(s, load_cluster("local-cpu", nproc=2), WORK, Constraints(tp=2))
    assert plan.mesh.tp == 2


def test_peft_lora_on_gpt2_conv1d():
    """PEFT's adapters on Hugging Face GPT-2's Conv1D projections (fused c_attn, c_proj, c_fc, c_proj:
    addmm on the input viewed as (B*T, in)) are found beside them, the fused QKV's parts included."""
    peft = pytest.importorskip("peft")
    sys.path.insert(0, str(ROOT / "examples"))
    import hf_gpt2

    config = peft.LoraConfig(r=4, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True,
                             init_lora_weights=False)  # fmt: skip
    model = peft.get_peft_model(hf_gpt2.build_model(), config)
    s = analyse(capture(model, hf_gpt2.example_inputs(), getattr(hf_gpt2, "example_kwargs", dict)()))
    for layer in s.layers:
        projections = [*layer.attention.projections, *layer.mlp.projections]
        assert len(projections) == 4 and all(p.adapter is not None for p in projections)
        assert layer.attention.projections[0].parts == (s.hidden_size,) * 3
    plan = plan_model(s, load_cluster("local-cpu", nproc=2), WORK, Constraints(tp=2, layout="megatron"))
    assert len(plan.adapters) == 2 * 4 * len(s.layers)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_adapter_path_is_priced_once(sequence_parallel):
    """The adapter's scaling and the add that joins it are priced with the adapter (in its projection's
    options, split as its output is), not again as the layer's unsplit stream ops: the layer's other
    ops cost what the model without adapters costs (an 8B's gate / up adapters had added ~6 ms a layer
    at TP 8 without sequence parallelism)."""
    config = MeshConfig(MeshShape(tp=2, pp=1, dp=1), 1, sequence_parallel=sequence_parallel)
    work = WorkloadSpec("train", 8, 16, dtype="bf16")
    fixed = {}
    for freeze in ("lora", "none"):
        s = structure(freeze)
        graph = build_cost_tables(CostContext(s, load_cluster("dgx-h100"), work, config, "bf16")).graphs
        fixed[freeze] = graph[layer_key(s.layers[1])]
    assert fixed["lora"].fixed_compute_s == pytest.approx(fixed["none"].fixed_compute_s)
    for op in fixed["lora"].ops:
        if op.name in ("core", "act"):
            assert op.options[-1].compute_s == pytest.approx(fixed["none"].op(op.name).options[-1].compute_s)

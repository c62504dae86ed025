"""passes.pipeline: stage split (in one process), pipelined forward / training step on gloo, TP x PP.

Entry functions are module-level: the spawned ranks import this module to find them. Graphs are
captured at the micro-batch size (captured graphs have literal shapes); the whole batch is
micro_batches times that.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx

from passes.pipeline import (
    PipelineSplitError,
    all_reduce_tied_gradients,
    run_pipeline_forward,
    run_pipeline_train_step,
    run_stages_sequentially,
    split_stages,
    stage_of_layers,
    tied_parameters,
)
from passes.tensor_parallel import apply_tensor_parallel
from planner.capture import capture
from planner.modelfile import load_model_file
from planner.plan import WeightSplit
from runtime.collectives import register_group
from runtime.launch import RankContext, launch
from runtime.mesh import build_mesh
from tests.conftest import EXAMPLES

LAYER_PREFIX = {"llama3": "layers", "gpt2_tiny": "transformer.h"}
NUM_LAYERS = {"llama3": 4, "gpt2_tiny": 2}
SEQ_LEN = 16


def layer_output_nodes(gm: fx.GraphModule, prefix: str, num_layers: int) -> list[str]:
    """The last compute node of each layer (the residual add leaving it), found by module path."""
    names = []
    for i in range(num_layers):
        path = f"{prefix}.{i}"
        inside = [
            n
            for n in gm.graph.nodes
            if n.op == "call_function"
            and (n.meta.get("module_path") == path or n.meta.get("module_path", "").startswith(path + "."))
        ]
        names.append(inside[-1].name)
    return names


def build(name: str, micro_batch: int) -> tuple[torch.nn.Module, torch.nn.Module, fx.GraphModule]:
    """(model, an independent copy for reference runs, graph captured at batch `micro_batch`)."""
    torch.manual_seed(0)
    mf = load_model_file(EXAMPLES / f"{name}.py")
    model = mf.build("cpu")
    reference = copy.deepcopy(model)  # the captured graph shares the model's parameters
    args, kwargs = mf.inputs(batch_size=micro_batch, seq_len=SEQ_LEN)
    return model, reference, capture(model, args, kwargs)


def tokens(batch: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def even_stages(name: str, gm: fx.GraphModule, num_stages: int) -> list[fx.GraphModule]:
    n = NUM_LAYERS[name]
    per = n // num_stages
    stages = [list(range(s * per, (s + 1) * per)) for s in range(num_stages)]
    return split_stages(gm, stage_of_layers(n, stages, layer_output_nodes(gm, LAYER_PREFIX[name], n)))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy: logits (B, T, V), target (B, T) int64."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


# ---------------------------------------------------------------------------------------------------
# Split, in one process


@pytest.mark.parametrize("num_stages", [2, 4])
def test_llama_stages_in_sequence_equal_the_graph(num_stages: int) -> None:
    model, reference, gm = build("llama3", 2)
    x = tokens(2)
    stages = even_stages("llama3", gm, num_stages)
    assert len(stages) == num_stages
    out = run_stages_sequentially(stages, x)
    assert torch.equal(out, gm(x))
    torch.testing.assert_close(out, reference(x), rtol=0, atol=1e-5)
    for k, stage in enumerate(stages):
        stage.graph.lint()
        placeholders = [n for n in stage.graph.nodes if n.op == "placeholder"]
        if k == 0:
            assert [n.name for n in placeholders] == ["tokens"]
        else:  # inputs of stage k == outputs of stage k - 1, by name and in order
            sent = stages[k - 1].graph.output_node().args[0]
            assert [n.name for n in placeholders] == [n.name for n in sent]
            # RoPE cos/sin (computed before layer 0) pass through to every stage
            assert len(placeholders) == 3
        for node in stage.graph.nodes:
            if node.op not in ("output",):
                assert node.meta["pp_stage"] == k
                assert "val" in node.meta and "module_path" in node.meta


def test_each_stage_holds_only_its_parameters() -> None:
    model, _, gm = build("llama3", 2)
    stages = even_stages("llama3", gm, 2)
    names = [{name for name, _ in stage.named_parameters()} for stage in stages]
    assert names[0].isdisjoint(names[1])
    assert names[0] | names[1] == {name for name, _ in model.named_parameters()}
    assert "tok_embeddings.weight" in names[0] and "layers.1.attention.wq.weight" in names[0]
    assert "output.weight" in names[1] and "layers.2.attention.wq.weight" in names[1]
    assert tied_parameters(stages) == []


def test_gpt2_tied_weight_is_copied_per_stage() -> None:
    model, reference, gm = build("gpt2_tiny", 2)
    x = tokens(2)
    stages = even_stages("gpt2_tiny", gm, 2)
    out = run_stages_sequentially(stages, x)
    assert torch.equal(out, gm(x))
    torch.testing.assert_close(out, reference(x), rtol=0, atol=1e-5)
    assert tied_parameters(stages) == [(0, "lm_head.weight", 1, "lm_head.weight")]
    first, last = (stage.get_parameter("lm_head.weight") for stage in stages)
    assert first is not last and first.data_ptr() != last.data_ptr()
    assert torch.equal(first, last)


def test_stage_of_layers_and_bad_cuts() -> None:
    outs = ["a0", "a1", "a2", "a3"]
    assert stage_of_layers(4, [[0, 1], [2, 3]], outs) == ["a1"]
    assert stage_of_layers(4, [[0], [1, 2], [3]], outs) == ["a0", "a2"]
    assert stage_of_layers(4, [[0, 1, 2, 3]], outs) == []
    with pytest.raises(PipelineSplitError, match="consecutively"):
        stage_of_layers(4, [[0, 2], [1, 3]], outs)
    with pytest.raises(PipelineSplitError, match="at least one layer"):
        stage_of_layers(4, [[0, 1, 2, 3], []], outs)
    _, _, gm = build("llama3", 1)
    cuts = layer_output_nodes(gm, "layers", 4)
    with pytest.raises(PipelineSplitError, match="not in the graph"):
        split_stages(gm, ["no_such_node"])
    with pytest.raises(PipelineSplitError, match="graph order"):
        split_stages(gm, [cuts[2], cuts[0]])
    with pytest.raises(PipelineSplitError, match="not a compute node"):
        split_stages(gm, ["tokens"])
    assert len(split_stages(gm, [])) == 1


# ---------------------------------------------------------------------------------------------------
# Entries (run in the spawned ranks)


def _pp_forward(ctx: RankContext, payload: None) -> dict:
    """pp=2, 2 micro-batches of 1 sequence, both schedules; the last stage compares with the model."""
    _, reference, gm = build("llama3", 1)
    stage = even_stages("llama3", gm, 2)[ctx.rank]
    x = tokens(2)
    result = {}
    for schedule in ("gpipe", "1f1b"):
        out = run_pipeline_forward(
            stage, ctx.rank, 2, (x,) if ctx.rank == 0 else None, 2, None, "cpu", schedule
        )
        if ctx.rank == 1:
            result[schedule] = (out - reference(x)).abs().max().item()
        else:
            assert out is None
    return result


def _tp_pp_forward(ctx: RankContext, payload: None) -> dict:
    """tp=2 x pp=2 on 4 ranks: Megatron splits, then the stage of this rank's pp coordinate."""
    mesh = build_mesh(2, 2, 1, "cpu")
    register_group("tp", mesh.group("tp"))
    model, reference, gm = build("llama3", 1)
    splits = {}
    for name, _ in model.named_parameters():
        if name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight")):
            splits[name] = WeightSplit(name, "colwise", 0)
        elif name.endswith(("wo.weight", "w2.weight")):
            splits[name] = WeightSplit(name, "rowwise", 1)
    gm = apply_tensor_parallel(gm, splits, mesh.tp_rank, 2)
    stage = even_stages("llama3", gm, 2)[mesh.pp_rank]
    sharded = stage.get_parameter(f"layers.{2 * mesh.pp_rank}.attention.wq.weight").shape
    x = tokens(2)
    pp = mesh.group("pp")
    out = run_pipeline_forward(stage, mesh.pp_rank, 2, (x,) if mesh.pp_rank == 0 else None, 2, pp, "cpu")
    diff = None if out is None else (out - reference(x)).abs().max().item()
    return {"pp_rank": mesh.pp_rank, "tp_rank": mesh.tp_rank, "diff": diff, "wq_shape": tuple(sharded)}


def _pp_train(ctx: RankContext, name: str) -> dict:
    """pp=2 training step, 4 micro-batches; gradients compared with the unsharded model's."""
    _, reference, gm = build(name, 1)
    stages = even_stages(name, gm, 2)
    stage, tied = stages[ctx.rank], tied_parameters(stages)
    x, target = tokens(4), tokens(4, seed=2)
    loss = run_pipeline_train_step(
        stage,
        ctx.rank,
        2,
        (x,) if ctx.rank == 0 else None,
        4,
        None,
        "cpu",
        loss_fn=lm_loss,
        target=target if ctx.rank == 1 else None,
        schedule="1f1b",
    )
    all_reduce_tied_gradients(stage, ctx.rank, tied, None)
    ref_loss = lm_loss(reference(x), target)
    ref_loss.backward()
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    diffs = {}
    for fqn, param in stage.named_parameters():
        assert param.grad is not None and param.grad.abs().max() > 0, fqn
        diffs[fqn] = (param.grad - ref_params[fqn].grad).abs().max().item()
    return {
        "diffs": diffs,
        "loss_diff": None if loss is None else abs(loss.item() - ref_loss.item()),
        "tied": tied,
    }


# ---------------------------------------------------------------------------------------------------
# Distributed


@pytest.mark.slow
def test_pipelined_forward_equals_model_pp2() -> None:
    first, last = launch(_pp_forward, None, 2, timeout_s=60)
    assert first == {}
    assert last["gpipe"] <= 1e-5 and last["1f1b"] <= 1e-5


@pytest.mark.slow
def test_tp2_pp2_forward_equals_model() -> None:
    results = launch(_tp_pp_forward, None, 4, timeout_s=60)
    assert [(r["pp_rank"], r["tp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["wq_shape"] == (64, 128) for r in results)  # 128 query features split in 2
    for r in results:
        if r["pp_rank"] == 1:
            assert r["diff"] <= 1e-5
        else:
            assert r["diff"] is None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3", "gpt2_tiny"])
def test_pipelined_training_step_gradients_pp2(name: str) -> None:
    results = launch(_pp_train, name, 2, timeout_s=60)
    for r in results:
        assert r["diffs"] and max(r["diffs"].values()) <= 1e-6, r["diffs"]
    assert results[0]["loss_diff"] is None and results[1]["loss_diff"] <= 1e-6
    if name == "gpt2_tiny":
        assert results[0]["tied"] == [(0, "lm_head.weight", 1, "lm_head.weight")]

"""passes.pipeline (stage split, in one process), runtime.pipeline (pipelined forward / training step
on gloo), TP x PP lowering, and a PP plan run with each schedule (runtime.execute.run_rank).

Entry functions are module-level: the spawned ranks import this module to find them. Graphs are
captured at the micro-batch size (captured graphs have literal shapes); the whole batch is
micro_batches times that.
"""

from __future__ import annotations

import copy
import dataclasses
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx

from passes.collectives import register_group
from passes.lower import lower_for_rank
from passes.pipeline import PipelineSplitError, split_stages, stage_of_layers, tied_parameters
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture
from planner.frontend.modelfile import load_model_file
from planner.plan import MeshShape, Schedule
from runtime.execute import run_rank
from runtime.job import RunJob
from runtime.launch import RankContext, launch
from runtime.mesh import build_rank_groups
from runtime.pipeline import PipelineRunner, all_reduce_tied_gradients, sum_tied_gradients
from tests.conftest import EXAMPLES, run_in_sequence
from tests.plans import fixed_plan

LAYER_PREFIX = {"llama3": "layers", "gpt2_tiny": "transformer.h", "hf_llama": "model.layers"}
NUM_LAYERS = {"llama3": 4, "gpt2_tiny": 2, "hf_llama": 2}
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
    out = run_in_sequence(stages, x)
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
    out = run_in_sequence(stages, x)
    assert torch.equal(out, gm(x))
    torch.testing.assert_close(out, reference(x), rtol=0, atol=1e-5)
    assert tied_parameters(stages) == [(0, "lm_head.weight", 1, "lm_head.weight")]
    first, last = (stage.get_parameter("lm_head.weight") for stage in stages)
    assert first is not last and first.data_ptr() != last.data_ptr()
    assert torch.equal(first, last)


class _RecordValues(fx.Interpreter):
    def run_node(self, n: fx.Node):
        value = super().run_node(n)
        n.meta["val"] = value
        return value


def test_multi_output_op_and_early_value_returned_by_the_graph() -> None:
    """A getitem after the cut stays with its chunk; a stage-0 value the graph returns is passed through."""
    aten = torch.ops.aten
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(aten.relu.default, (x,))
    parts = graph.call_function(aten.chunk.default, (a, 2))
    first = graph.call_function(operator.getitem, (parts, 0))
    second = graph.call_function(operator.getitem, (parts, 1))
    b = graph.call_function(aten.add.Tensor, (first, 1.0))
    c = graph.call_function(aten.mul.Tensor, (second, b))
    graph.output((a, c))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    x_in = torch.randn(4, 6)
    _RecordValues(gm).run(x_in)
    stages = split_stages(gm, [parts.name])
    sent = [n.name for n in stages[0].graph.output_node().args[0]]
    assert sent == [a.name, first.name, second.name]
    out = run_in_sequence(stages, x_in)
    expected = gm(x_in)
    assert all(torch.equal(o, e) for o, e in zip(out, expected, strict=True))


def test_tensor_with_several_names_in_several_stages() -> None:
    """One parameter under names a, b (stage 0) and c (stage 1): one copy per stage, one tied pair."""
    aten = torch.ops.aten
    root = torch.nn.Module()
    shared = torch.nn.Parameter(torch.randn(3, 3))
    for name in ("a", "b", "c"):
        setattr(root, name, torch.nn.Module())
        getattr(root, name).weight = shared
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(aten.mm.default, (x, graph.get_attr("a.weight")))
    y = graph.call_function(aten.mm.default, (y, graph.get_attr("b.weight")))
    z = graph.call_function(aten.mm.default, (y, graph.get_attr("c.weight")))
    graph.output(z)
    gm = fx.GraphModule(root, graph)
    x_in = torch.randn(2, 3)
    _RecordValues(gm).run(x_in)
    stages = split_stages(gm, [y.name])
    assert tied_parameters(stages) == [(0, "a.weight", 1, "c.weight")]
    assert stages[0].get_parameter("a.weight") is stages[0].get_parameter("b.weight")
    assert stages[0].get_parameter("a.weight") is not stages[1].get_parameter("c.weight")
    assert stages[0].get_parameter("a.weight") is not shared
    torch.testing.assert_close(run_in_sequence(stages, x_in), gm(x_in), rtol=0, atol=0)


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


def _pp_forward(rank: int) -> dict:
    """pp=2, 2 micro-batches of 1 sequence, both schedules, and a reused runner."""
    _, reference, gm = build("llama3", 1)
    stage = even_stages("llama3", gm, 2)[rank]
    x = tokens(2)
    inputs = (x,) if rank == 0 else None
    result: dict = {}
    for schedule in Schedule:
        out = PipelineRunner(stage, rank, 2, 2, None, "cpu", schedule).forward(inputs)
        result[str(schedule)] = None if out is None else (out - reference(x)).abs().max().item()
    runner = PipelineRunner(stage, rank, 2, 2, None, "cpu", "gpipe")  # built once, stepped many times
    outs = [runner.forward(inputs) for _ in range(3)]
    if rank == 1:
        result["runner"] = (outs[0] - reference(x)).abs().max().item()
        result["runner_repeats_equal"] = all(torch.equal(o, outs[0]) for o in outs)
    # a forward whose outputs a consumer takes: nothing kept on any stage once the step is done
    dropped = runner.forward(inputs, keep_outputs=False)
    stage_state = runner._schedules[False]._stage
    result["dropped"] = (dropped, len(stage_state.output_chunks), len(stage_state.fwd_cache))
    return result


def _held_receive_elements(runner: PipelineRunner) -> int:
    """Elements the runner's stages hold in receive buffers (activations and output gradients) after a
    step: 0 when each buffer lives only while its micro-batch needs it (`_JustInTimeStage`)."""
    schedule = runner._schedules[True]
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    infos = [
        info
        for stage in stages
        for table in (stage.args_recv_info, stage.grad_recv_info)
        for per_micro_batch in table.values()
        for info in per_micro_batch
    ]
    return sum(info.buffer.numel() for info in infos if info.buffer is not None)


def _pp_train(rank: int, name: str) -> dict:
    """pp=2 training step, 4 micro-batches (a 1F1B runner once, then a reused GPipe runner twice);
    gradients compared with the unsharded model's."""
    _, reference, gm = build(name, 1)
    stages = even_stages(name, gm, 2)
    stage, tied = stages[rank], tied_parameters(stages)
    x, target = tokens(4), tokens(4, seed=2)
    inputs, stage_target = ((x,) if rank == 0 else None), (target if rank == 1 else None)
    one_f_one_b = PipelineRunner(stage, rank, 2, 4, None, "cpu", Schedule.ONE_F_ONE_B, loss_fn=lm_loss)
    loss = one_f_one_b.train_step(inputs, stage_target)
    held = _held_receive_elements(one_f_one_b)
    all_reduce_tied_gradients(stage, rank, tied, None)
    first_grads = {fqn: p.grad.clone() for fqn, p in stage.named_parameters()}
    runner = PipelineRunner(stage, rank, 2, 4, None, "cpu", Schedule.GPIPE, loss_fn=lm_loss)
    for _ in range(2):  # a reused runner gives the same gradients every step
        stage.zero_grad(set_to_none=True)
        runner.train_step(inputs, stage_target)
        all_reduce_tied_gradients(stage, rank, tied, None)
    ref_loss = lm_loss(reference(x), target)
    ref_loss.backward()
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    diffs, runner_diff = {}, 0.0
    for fqn, param in stage.named_parameters():
        assert first_grads[fqn].abs().max() > 0, fqn
        diffs[fqn] = (first_grads[fqn] - ref_params[fqn].grad).abs().max().item()
        runner_diff = max(runner_diff, (param.grad - first_grads[fqn]).abs().max().item())
    return {
        "diffs": diffs,
        "runner_diff": runner_diff,
        "loss_diff": None if loss is None else abs(loss.item() - ref_loss.item()),
        "tied": tied,
        "held_receive_elements": held + _held_receive_elements(runner),
    }


def _pp_interleaved(rank: int) -> dict:
    """Interleaved 1F1B, pp=2 x v=2 on the 4-layer Llama: 4 virtual stages of one layer, rank r holding
    virtual stages r and r + 2 (chunk c = virtual stage c * pp + r). Forward with 2 and 4 micro-batches,
    a training step with 4; gradients of both chunks against the unsharded model's."""
    _, reference, gm = build("llama3", 1)
    chunks = even_stages("llama3", gm, 4)[rank::2]
    result: dict = {
        "chunk_layers": [
            sorted({int(t.split(".")[1]) for t in c.meta["pp_param_keys"] if t.startswith("layers.")})
            for c in chunks
        ]
    }
    for m in (2, 4):
        x = tokens(m)
        runner = PipelineRunner(chunks, rank, 2, m, None, "cpu", Schedule.INTERLEAVED_1F1B)
        out = runner.forward((x,) if rank == 0 else None)
        result[f"forward_m{m}"] = None if out is None else (out - reference(x)).abs().max().item()
    x, target = tokens(4), tokens(4, seed=2)
    runner = PipelineRunner(chunks, rank, 2, 4, None, "cpu", "interleaved_1f1b", loss_fn=lm_loss)
    loss = runner.train_step((x,) if rank == 0 else None, target if rank == 1 else None)
    result["held_receive_elements"] = _held_receive_elements(runner)
    ref_loss = lm_loss(reference(x), target)
    ref_loss.backward()
    ref_params = dict(reference.named_parameters())
    diffs = {}
    for chunk in chunks:
        for fqn, param in chunk.named_parameters():
            assert param.grad.abs().max() > 0, fqn
            diffs[fqn] = (param.grad - ref_params[fqn].grad).abs().max().item()
    result["grad_diffs"] = diffs
    result["loss_diff"] = None if loss is None else abs(loss.item() - ref_loss.item())
    result["class"] = runner.schedule_class.__name__
    # tie a weight of virtual stage 0 (rank 0) to one of virtual stage 3 (rank 1): summed across ranks
    tied = [(0, "layers.0.attention_norm.weight", 3, "layers.3.attention_norm.weight")]
    sum_tied_gradients({c * 2 + rank: chunk for c, chunk in enumerate(chunks)}, tied, None, 2)
    fqn = tied[0][1] if rank == 0 else tied[0][3]
    both = ref_params[tied[0][1]].grad + ref_params[tied[0][3]].grad
    result["tied_diff"] = (chunks[rank].get_parameter(fqn).grad - both).abs().max().item()
    # one tensor held by three virtual stages, two on rank 0 and one on rank 1 (a T5's shared embedding:
    # the encoder's input, the decoder's input, the LM head), listed pair by pair as tied_parameters
    # lists it: every copy ends with the sum of the three gradients, not of pairs of partial sums
    copies = [
        (0, "layers.0.ffn_norm.weight"),
        (2, "layers.2.ffn_norm.weight"),
        (3, "layers.3.ffn_norm.weight"),
    ]
    triple = [(a, fa, b, fb) for i, (a, fa) in enumerate(copies) for b, fb in copies[i + 1 :]]
    sum_tied_gradients({c * 2 + rank: chunk for c, chunk in enumerate(chunks)}, triple, None, 2)
    all_three = sum(ref_params[fqn].grad for _, fqn in copies)
    held = [(stage, fqn) for stage, fqn in copies if stage % 2 == rank]
    result["three_copies_diff"] = max(
        (chunks[stage // 2].get_parameter(fqn).grad - all_three).abs().max().item() for stage, fqn in held
    )
    return result


def _pp_int_crossing(rank: int) -> dict:
    """Cut right after the RoPE slices: the int64 token ids cross the boundary (forward and backward)."""
    _, reference, gm = build("llama3", 1)
    stages = split_stages(gm, ["slice_2"])
    crossing = [
        (n.name, n.meta["val"].dtype, n.meta["pp_requires_grad"])
        for n in stages[1].graph.nodes
        if n.op == "placeholder"
    ]
    x, target = tokens(4), tokens(4, seed=2)
    runner = PipelineRunner(stages[rank], rank, 2, 4, None, "cpu", "1f1b", loss_fn=lm_loss)
    out = runner.forward((x,) if rank == 0 else None)
    runner.train_step((x,) if rank == 0 else None, target if rank == 1 else None)
    lm_loss(reference(x), target).backward()
    ref_params = dict(reference.named_parameters())
    grads = [(p.grad - ref_params[n].grad).abs().max().item() for n, p in stages[rank].named_parameters()]
    return {
        "crossing": crossing,
        "diff": None if out is None else (out - reference(x)).abs().max().item(),
        "grad_diff": max(grads, default=None),
    }


def _pp_hf_llama(rank: int) -> dict:
    """HF LlamaForCausalLM given a padding mask (all ones: transformers builds a bool attention mask from
    it; without one SDPA runs is_causal): the bool mask and RoPE cos/sin cross the boundary with the
    stream."""
    torch.manual_seed(0)
    mf = load_model_file(EXAMPLES / "hf_llama.py")
    model = mf.build("cpu")
    reference = copy.deepcopy(model)
    args, kwargs = mf.inputs(batch_size=1, seq_len=SEQ_LEN)
    mask = torch.ones(1, SEQ_LEN, dtype=torch.long)
    gm = capture(model, (*args, mask), kwargs)
    stage = even_stages("hf_llama", gm, 2)[rank]
    crossing = [str(n.meta["val"].dtype) for n in stage.graph.nodes if n.op == "placeholder"]
    x = tokens(2)
    ones = torch.ones(2, SEQ_LEN, dtype=torch.long)
    out = PipelineRunner(stage, rank, 2, 2, None, "cpu", "gpipe").forward((x, ones) if rank == 0 else None)
    want = reference(x, attention_mask=ones, use_cache=False).logits
    return {"crossing": crossing, "diff": None if out is None else (out - want).abs().max().item()}


def _pp_plan_jobs() -> list[tuple[str, str, RunJob]]:
    """A pp=2 plan (2 micro-batches) of the tiny Llama run by the runtime, with each schedule and workload."""
    path = str(EXAMPLES / "llama3.py")
    _, _, gm = build("llama3", 2)
    jobs = []
    for schedule in Schedule:
        for workload in ("forward", "train"):
            if schedule is Schedule.INTERLEAVED_1F1B and workload == "forward":
                continue  # its forward is checked by _pp_interleaved; the training run checks more
            plan = fixed_plan(analyse(gm), path, 1, pp=2, workload=workload, micro_batches=2)
            plan = dataclasses.replace(plan, schedule=schedule)
            if schedule is Schedule.INTERLEAVED_1F1B:  # v=2: chunk c of rank r is virtual stage 2c + r
                plan = dataclasses.replace(plan, virtual_stages=2, stages=[[0, 2], [1, 3]])
            jobs.append(
                (str(schedule), workload, RunJob(path, plan.to_dict(), workload=workload, warmup=0, iters=1))
            )
    return jobs


def _pp_plan_runs(ctx: RankContext) -> list[dict]:
    results = []
    for schedule, workload, job in _pp_plan_jobs():
        report = run_rank(ctx, job)
        results.append(
            {
                "schedule": schedule,
                "workload": workload,
                "ran": report.pipeline_schedule,
                "diff": report.max_abs_diff,
                "scale": report.output_scale,
                "grad_diff": report.grad_max_abs_diff,
                "notes": report.notes,
            }
        )
    return results


def _pp2_checks(ctx: RankContext, payload: None) -> dict:
    """Every pp=2 check in one launch (spawning ranks costs more than the checks)."""
    return {
        "forward": _pp_forward(ctx.rank),
        "train_llama3": _pp_train(ctx.rank, "llama3"),
        "train_gpt2_tiny": _pp_train(ctx.rank, "gpt2_tiny"),
        "interleaved": _pp_interleaved(ctx.rank),
        "int_crossing": _pp_int_crossing(ctx.rank),
        "hf_llama": _pp_hf_llama(ctx.rank),
        "plan_runs": _pp_plan_runs(ctx),
    }


def _tp_pp_forward(ctx: RankContext, payload: None) -> dict:
    """tp=2 x pp=2 on 4 ranks: the plan lowered for this rank (Megatron splits, then its stage), with
    one stage per rank and interleaved with two chunks per rank."""
    groups = build_rank_groups(MeshShape(tp=2, pp=2, dp=1), "cpu")
    register_group("tp", groups.group("tp"))
    _, reference, gm = build("llama3", 1)
    structure = analyse(gm)
    plan = fixed_plan(structure, "llama3.py", 2, pp=2, micro_batches=2, vocab=False)
    lowered = lower_for_rank(gm, structure, plan, ctx.rank)
    stage = lowered.module
    sharded = stage.get_parameter(f"layers.{2 * lowered.pp_rank}.attention.wq.weight").shape
    x = tokens(2)
    runner = PipelineRunner(stage, lowered.pp_rank, 2, 2, groups.group("pp"), "cpu", plan.schedule)
    out = runner.forward((x,) if lowered.pp_rank == 0 else None)
    diff = None if out is None else (out - reference(x)).abs().max().item()
    # interleaved, v=2: each TP rank runs its shards of two one-layer chunks
    _, _, gm = build("llama3", 1)
    plan = dataclasses.replace(
        plan, schedule=Schedule.INTERLEAVED_1F1B, virtual_stages=2, stages=[[0, 2], [1, 3]]
    )
    chunks = lower_for_rank(gm, structure, plan, ctx.rank).chunks
    runner = PipelineRunner(chunks, lowered.pp_rank, 2, 2, groups.group("pp"), "cpu", plan.schedule)
    out = runner.forward((x,) if lowered.pp_rank == 0 else None)
    interleaved = None if out is None else (out - reference(x)).abs().max().item()
    return {
        "pp_rank": lowered.pp_rank,
        "tp_rank": lowered.tp_rank,
        "diff": diff,
        "interleaved_diff": interleaved,
        "wq_shape": tuple(sharded),
    }


# ---------------------------------------------------------------------------------------------------
# Distributed


@pytest.fixture(scope="module")
def pp2_results() -> list[dict]:
    return launch(_pp2_checks, None, 2, timeout_s=180)


@pytest.mark.slow
def test_pipelined_forward_equals_model_pp2(pp2_results: list[dict]) -> None:
    first, last = (r["forward"] for r in pp2_results)
    dropped = first.pop("dropped")
    assert first == {"gpipe": None, "1f1b": None, "interleaved_1f1b": None}  # one chunk per rank: v=1
    assert last["gpipe"] <= 1e-5 and last["1f1b"] <= 1e-5 and last["runner"] <= 1e-5
    assert last["interleaved_1f1b"] <= 1e-5
    assert last["runner_repeats_equal"]
    assert dropped == last["dropped"] == (None, 0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3", "gpt2_tiny"])
def test_pipelined_training_step_gradients_pp2(pp2_results: list[dict], name: str) -> None:
    results = [r[f"train_{name}"] for r in pp2_results]
    for r in results:
        assert r["diffs"] and max(r["diffs"].values()) <= 1e-6, r["diffs"]
        assert r["runner_diff"] <= 1e-6  # reused GPipe runner == the 1F1B runner's step
        # torch 2.13 keeps a receive buffer per micro-batch (and direction) for the whole step;
        # the runtime's stages drop each after its micro-batch's backward
        assert r["held_receive_elements"] == 0
    assert results[0]["loss_diff"] is None and results[1]["loss_diff"] <= 1e-6
    if name == "gpt2_tiny":
        assert results[0]["tied"] == [(0, "lm_head.weight", 1, "lm_head.weight")]


@pytest.mark.slow
def test_interleaved_pp2_v2_matches_the_model(pp2_results: list[dict]) -> None:
    """ScheduleInterleaved1F1B with two chunks per rank: forward and gradients equal the unsharded model's."""
    first, last = (r["interleaved"] for r in pp2_results)
    assert first["chunk_layers"] == [[0], [2]] and last["chunk_layers"] == [[1], [3]]
    assert first["forward_m2"] is None and first["loss_diff"] is None
    assert last["forward_m2"] <= 1e-5 and last["forward_m4"] <= 1e-5 and last["loss_diff"] <= 1e-6
    for r in (first, last):
        assert r["class"] == "ScheduleInterleaved1F1B"
        assert len(r["grad_diffs"]) >= 9 and max(r["grad_diffs"].values()) <= 1e-6, r["grad_diffs"]
        assert r["tied_diff"] <= 1e-6  # a tied pair of virtual stages 0 and 3 is exchanged between ranks
        assert r["three_copies_diff"] <= 1e-6  # three copies: all three gradients summed, once
        assert r["held_receive_elements"] == 0


@pytest.mark.slow
def test_integer_tokens_crossing_a_stage_boundary(pp2_results: list[dict]) -> None:
    first, last = (r["int_crossing"] for r in pp2_results)
    assert first["crossing"][0] == ("tokens", torch.int64, False)
    assert all(not needs_grad for _, _, needs_grad in first["crossing"])  # RoPE tables: no parameter
    assert first["grad_diff"] is None  # stage 0 holds no parameter
    assert last["diff"] <= 1e-5 and last["grad_diff"] <= 1e-6


@pytest.mark.slow
def test_hf_llama_pipelined_forward_with_bool_mask(pp2_results: list[dict]) -> None:
    first, last = (r["hf_llama"] for r in pp2_results)
    assert "torch.bool" in last["crossing"]
    assert last["diff"] <= 1e-5


@pytest.mark.slow
def test_pp2_plan_runs_its_schedule(pp2_results: list[dict]) -> None:
    """run_rank on a pp=2 plan: the schedule run is the plan's; forward output, training loss and
    every stage's gradients match the unsharded model, with GPipe, 1F1B and interleaved 1F1B (v=2);
    the report's notes say which schedule and how many chunks ran."""
    first, last = (r["plan_runs"] for r in pp2_results)
    ran = {(r["schedule"], r["workload"]): r["ran"] for r in first + last}
    want = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}
    runs = {
        (s, w): want[s]
        for s in want
        for w in ("forward", "train")
        if (s, w) != ("interleaved_1f1b", "forward")
    }
    assert ran == runs
    for r in first + last:
        note = next(n for n in r["notes"] if n.startswith("pipeline schedule:"))
        assert f"{r['schedule']} (torch.distributed.pipelining {want[r['schedule']]})" in note
        assert ("v=2 model chunks per pipeline rank" in note) == (r["schedule"] == "interleaved_1f1b")
    for r in first:
        assert r["diff"] is None  # the output (and the loss) is on the last stage
    for r in last:
        assert r["diff"] is not None and r["diff"] <= 1e-5 * r["scale"], r
    for r in first + last:
        if r["workload"] == "train":
            assert r["grad_diff"] is not None and r["grad_diff"] <= 1e-6, r
        else:
            assert r["grad_diff"] is None


def test_one_f_one_b_needs_as_many_micro_batches_as_stages() -> None:
    _, _, gm = build("llama3", 1)
    stage = even_stages("llama3", gm, 2)[0]
    with pytest.raises(ValueError, match=r"1f1b needs micro_batches\(1\) >= num_stages\(2\)"):
        PipelineRunner(stage, 0, 2, 1, None, "cpu", Schedule.ONE_F_ONE_B)
    with pytest.raises(ValueError, match="schedule must be one of"):
        PipelineRunner(stage, 0, 2, 2, None, "cpu", "interleaved")


@pytest.mark.slow
def test_tp2_pp2_forward_equals_model() -> None:
    results = launch(_tp_pp_forward, None, 4, timeout_s=180)
    assert [(r["pp_rank"], r["tp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["wq_shape"] == (64, 128) for r in results)  # 128 query features split in 2
    for r in results:
        if r["pp_rank"] == 1:
            assert r["diff"] <= 1e-5 and r["interleaved_diff"] <= 1e-5
        else:
            assert r["diff"] is None and r["interleaved_diff"] is None


def test_model_chunks_need_the_interleaved_schedule_and_its_micro_batch_rounds() -> None:
    chunks = [fx.GraphModule(torch.nn.Module(), fx.Graph()) for _ in range(2)]  # refused before use
    with pytest.raises(ValueError, match="2 model chunks .* needs the interleaved_1f1b schedule"):
        PipelineRunner(chunks, 0, 2, 4, None, "cpu", Schedule.ONE_F_ONE_B)
    with pytest.raises(ValueError, match=r"micro_batches\(5\) divisible by its rounds.* = 2"):
        PipelineRunner(chunks, 0, 2, 5, None, "cpu", Schedule.INTERLEAVED_1F1B)


def test_tied_copies_in_two_chunks_of_one_rank_are_summed_locally() -> None:
    chunks = {0: torch.nn.Linear(2, 2), 2: torch.nn.Linear(2, 2)}
    for i, chunk in chunks.items():
        chunk.weight.grad = torch.full((2, 2), float(i + 1))
    sum_tied_gradients(chunks, [(0, "weight", 2, "weight"), (1, "weight", 3, "weight")], None, 2)
    assert torch.equal(chunks[0].weight.grad, torch.full((2, 2), 4.0))
    assert torch.equal(chunks[2].weight.grad, chunks[0].weight.grad)
    assert chunks[0].bias.grad is None  # untied parameters are left alone

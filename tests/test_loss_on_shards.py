"""Training's loss runs where the passes leave the logits (`runtime.loss`): the lowering records how
the first output is split (TP vocabulary shards, on the pipeline stage that computes it), and the
loss on a rank's shard, with its scalar all-reduce, equals its part of the whole MSE: value and
gradient, a padded vocabulary's padding left out. The runs on gloo ranks (TP, TP x PP, TP x CP) are
checked against the unsharded model by tests/test_run_modes.py, tests/test_cp_run.py and the CLI's
--run; these checks need no process group, except the last ones, which run models returning several
outputs (tests/models/lm_outputs.py) on gloo ranks: each output checked by its own dtype, a
pipeline's outputs as well as its loss, an integer first output refused for training."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from passes import collectives
from passes.collectives import register_group
from passes.lower import lower_for_rank
from passes.tensor_parallel import OUTPUT_SHARD, OutputShard
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture
from planner.frontend.modelfile import load_model_file
from runtime.loss import LossLayout, full_shape, gathered_output, output_loss
from tests.cli_in_process import planner_in_process
from tests.plans import fixed_plan

LLAMA = Path(__file__).resolve().parent.parent / "examples" / "llama3.py"


@pytest.fixture(scope="module")
def captured():
    model_file = load_model_file(LLAMA)
    gm = capture(model_file.build("meta"), *model_file.inputs())
    return gm, analyse(gm)


def test_the_stage_computing_the_logits_records_their_vocabulary_shard(captured) -> None:
    gm, structure = captured
    vocab = structure.lm_head.out_features
    plan = fixed_plan(structure, str(LLAMA), 2, pp=2, workload="train")
    first = lower_for_rank(copy.deepcopy(gm), structure, plan, 0, training=True)  # pp rank 0
    last = lower_for_rank(copy.deepcopy(gm), structure, plan, 3, training=True)  # pp rank 1, tp rank 1
    assert OUTPUT_SHARD not in first.module.meta
    assert last.module.meta[OUTPUT_SHARD] == OutputShard(2, vocab, vocab // 2)
    forward = lower_for_rank(copy.deepcopy(gm), structure, fixed_plan(structure, str(LLAMA), 2), 1)
    assert OUTPUT_SHARD not in forward.module.meta  # forward-only: the logits are gathered whole


@pytest.fixture
def one_rank_tp():
    """The "tp" axis on one process (the all-reduce and all-gather return their input), restored after."""
    before = dict(collectives._GROUPS)
    register_group("tp", None)
    yield
    collectives._GROUPS.clear()
    collectives._GROUPS.update(before)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_ranks_loss_is_its_part_of_the_whole_mse_padding_left_out(one_rank_tp, tp_rank: int) -> None:
    """Vocabulary 5 over 2 ranks, padded to 6: rank 0 holds columns 0-2, rank 1 columns 3-4 and one
    padding column, which neither counts in the loss nor gets a gradient."""
    torch.manual_seed(0)
    shard = OutputShard(dim=2, length=5, local=3)
    target = torch.randn(2, 4, 5)
    whole = torch.randn(2, 4, 6)  # the ranks' shards side by side, padding last
    out = whole[..., 3 * tp_rank : 3 * tp_rank + 3].clone().requires_grad_(True)
    layout = LossLayout(tp=shard, tp_rank=tp_rank)
    loss = output_loss(out, target, layout)
    loss.backward()
    columns = slice(3 * tp_rank, min(5, 3 * tp_rank + 3))
    mine = ((whole[..., columns] - target[..., columns]) ** 2).sum() / target.numel()
    assert float(loss.detach()) == pytest.approx(
        float(mine), rel=1e-6
    )  # the all-reduce adds the other rank's part
    reference = whole[..., :5].clone().requires_grad_(True)
    F.mse_loss(reference, target).backward()
    real = columns.stop - columns.start
    assert torch.allclose(out.grad[..., :real], reference.grad[..., columns], atol=1e-7)
    assert torch.count_nonzero(out.grad[..., real:]) == 0  # the padding column
    assert full_shape(tuple(out.shape), layout) == (2, 4, 5)


def test_a_whole_output_keeps_the_plain_mse(one_rank_tp) -> None:
    out, target = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(output_loss(out, target, LossLayout()), F.mse_loss(out, target))
    assert torch.equal(gathered_output(out, LossLayout()), out)


def test_a_rank_holding_only_padding_adds_nothing(one_rank_tp) -> None:
    """Vocabulary 5 over 4 ranks, padded to 8 (2 columns each): rank 3 holds two padding columns and
    starts past the vocabulary; its part of the loss is 0 and its shard gets no gradient."""
    shard = OutputShard(dim=1, length=5, local=2)
    out = torch.randn(3, 2, requires_grad=True)
    loss = output_loss(out, torch.randn(3, 5), LossLayout(tp=shard, tp_rank=3))
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert torch.count_nonzero(out.grad) == 0


LM_OUTPUTS = Path(__file__).resolve().parent / "models" / "lm_outputs.py"


def _lowered_outputs(monkeypatch, outputs: str, tp: int = 2):
    monkeypatch.setenv("LM_OUTPUTS", outputs)
    model_file = load_model_file(LM_OUTPUTS)
    gm = capture(model_file.build("meta"), *model_file.inputs())
    structure = analyse(gm)
    plan = fixed_plan(structure, str(LM_OUTPUTS), tp, workload="train")
    lowered = lower_for_rank(gm, structure, plan, 0, training=True)
    return lowered.module, structure.lm_head.out_features


def test_the_same_logits_returned_twice_stay_a_shard_only_first(monkeypatch) -> None:
    """(logits, logits): the loss reads the first as the vocabulary shard; the second is the
    whole output, gathered (it was left a shard too, and the run's check of it failed)."""
    gm, vocab = _lowered_outputs(monkeypatch, "dup")
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    first, second = out.args[0]
    assert gm.meta[OUTPUT_SHARD].length == vocab
    assert first is not second  # the second occurrence goes through a gather
    assert first.meta["val"].shape[-1] == -(-vocab // 2) and second.meta["val"].shape[-1] == vocab


@pytest.mark.slow
@pytest.mark.parametrize(
    "outputs, mesh",
    [
        ("tuple", ["--nproc", "2", "--pp", "2", "--tp", "1"]),  # the pipeline's loss reads output 0
        ("dup", ["--nproc", "2", "--tp", "2", "--layout", "megatron"]),
        # a 0-dim output (over the whole batch: one micro-batch) crashed the pipeline's merge of the
        # micro-batches' outputs (torch.cat of 0-dim tensors)
        ("scalar", ["--nproc", "2", "--pp", "2", "--tp", "1"]),
    ],
)
def test_training_runs_with_several_outputs_check_each(tmp_path, outputs: str, mesh: list[str]) -> None:
    """Training runs of models returning several outputs, on gloo ranks: every output is compared with
    the unsharded model's (a pipeline's too, not only its loss), each within its dtype's tolerance."""
    report = _run(tmp_path, outputs, [*mesh, "--workload", "train"])
    n = report["numerics"]
    assert len(n["outputs"]) == 2 and all(o["max_abs_diff"] <= o["tolerance"] for o in n["outputs"]), n
    assert n["loss_diff"] <= n["tolerance_rel"] * n["loss_scale"] and n["grads_compared"] > 0, n


@pytest.mark.slow
def test_an_integer_output_is_compared_exactly_and_a_float_one_within_tolerance(tmp_path) -> None:
    """(argmax, logits) forward at TP 2: output 0 (int64) exactly, output 1 (float32) at float32's
    relative tolerance (output 0's dtype was applied to every output: 0 for the logits)."""
    report = _run(tmp_path, "argmax_first", ["--nproc", "2", "--tp", "2", "--layout", "megatron"])
    first, second = report["numerics"]["outputs"]
    assert first["dtype"] == "int64" and first["tolerance"] == 0.0 and first["max_abs_diff"] == 0.0
    assert (
        second["dtype"] == "float32"
        and 0 < second["tolerance"]
        and second["max_abs_diff"] <= second["tolerance"]
    )


@pytest.mark.slow
def test_training_on_an_integer_first_output_is_refused_with_what_to_return(tmp_path) -> None:
    r = _planner(tmp_path, "argmax_first", ["--nproc", "2", "--tp", "2", "--workload", "train"])
    assert r.returncode == 2, r.stderr
    assert "first output" in r.stderr and "int64" in r.stderr and "--workload forward" in r.stderr
    assert "Traceback" not in r.stderr


def _planner(tmp_path, outputs: str, args: list[str]):
    """`planner optimize ... --run` of lm_outputs.py returning `outputs`, in this process: the ranks are
    forked from a fork server started once, whose environment a later LM_OUTPUTS would not reach, so
    the model file is copied with its outputs written in."""
    source = LM_OUTPUTS.read_text()
    read = 'os.environ.get("LM_OUTPUTS", "tuple")'
    assert read in source
    model = tmp_path / f"lm_outputs_{outputs}.py"
    model.write_text(source.replace(read, repr(outputs)))
    return planner_in_process(
        "optimize", str(model), "--cluster", "local-cpu", *args, "--run", "--iters", "2", "--min-time", "0",
        "--warmup", "1", "--json", str(tmp_path / "report.json"),
    )  # fmt: skip


def _run(tmp_path, outputs: str, args: list[str]) -> dict:
    r = _planner(tmp_path, outputs, args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads((tmp_path / "report.json").read_text())


def _report(dtype: str, out_dtypes: list[str], diffs: list[float], scales: list[float], **training):
    from runtime.job import RankReport  # noqa: PLC0415

    return RankReport(
        rank=0, tp_rank=0, pp_rank=0, latency_samples_s=[1.0], median_s=1.0, peak_memory_bytes=0,
        max_abs_diff=diffs[0], output_scale=scales[0], output_diffs=diffs, output_scales=scales,
        output_dtype=out_dtypes[0], output_dtypes=out_dtypes, dtype=dtype, **training,
    )  # fmt: skip


def test_a_bf16_run_with_an_fp32_side_output_is_held_to_bf16_tolerances() -> None:
    """A bf16 training run returning (bf16 logits, an fp32 statistic of bf16 activations): the statistic,
    the loss and the gradients carry bf16's error (the fp32 side output's 1e-4 was applied to all
    three, failing a correct run); an fp32 run keeps 1e-4 and an integer output stays exact."""
    from runtime.job import summarise  # noqa: PLC0415
    from runtime.numerics import check_failures  # noqa: PLC0415

    training = dict(
        grad_max_abs_diff=2.4e-4, grad_scale=0.03, loss_diff=1e-3, loss_scale=0.67, grads_compared=4
    )
    bf16 = summarise([_report("bf16", ["bfloat16", "float32"], [0.01, 3.8e-6], [2.0, 0.018], **training)])
    n = bf16["numerics"]
    assert check_failures(n) == [] and n["train_tolerance_rel"] == 5e-2
    assert [o["tolerance_rel"] for o in n["outputs"]] == [5e-2, 5e-2]
    fp32 = summarise([_report("fp32", ["float32", "int64"], [1e-3, 0.0], [2.0, 5.0], **training)])
    failed = check_failures(fp32["numerics"])
    assert [o["tolerance_rel"] for o in fp32["numerics"]["outputs"]] == [1e-4, 0.0]
    assert any(line.startswith("output 0") for line in failed) and any("gradients" in line for line in failed)


def test_hand_written_layouts_keep_the_batch_of_a_model_whose_outputs_mix_it(monkeypatch) -> None:
    """A scalar statistic over the whole batch keeps the plan at one replica; the torchtitan recipe it
    is compared with was priced at DP 2, which the model cannot run ("this plan is 1.42x its speed")."""
    from planner.cli import workflow  # noqa: PLC0415

    monkeypatch.setenv("LM_OUTPUTS", "scalar")
    prepared = workflow.prepare(str(LM_OUTPUTS), "train", batch_size=4, seq_len=16)
    cluster = workflow.resolve_cluster("local-cpu", 2)
    plan = workflow.make_plan(
        prepared, cluster, workflow.constraints_from(None, None, None, None), str(LM_OUTPUTS)
    )
    assert plan.mesh.dp == 1 and plan.baseline_layout["dp"] == "1"
    assert plan.torchtitan_layout["dp"] == "1", plan.torchtitan_layout


def test_the_timed_steps_target_holds_no_memory_and_reads_as_zeros() -> None:
    """The checked step's MSE target is random and as large as the logits of every micro-batch (dp x m of
    them while the whole batch's was kept), memory an LM's labels do not take and the plan does not
    price; the timed steps read zeros of the same shape from one element."""
    from runtime.loss import unheld_like  # noqa: PLC0415

    target = torch.randn(4, 64, 320)
    zeros = unheld_like(target)
    assert zeros.shape == target.shape and zeros.dtype == target.dtype
    assert zeros.untyped_storage().nbytes() == target.element_size()
    out = torch.randn(4, 64, 320, requires_grad=True)
    torch.nn.functional.mse_loss(out, zeros).backward()
    assert torch.allclose(out.grad, 2 * out.detach() / out.numel())


def test_a_whole_outputs_loss_holds_no_memory_of_the_output_size() -> None:
    """A pipeline schedule keeps every micro-batch's loss until the step ends; on CPU F.mse_loss returns
    a 0-dim tensor on its output-sized elementwise buffer (8 x 1 MiB of logits found alive at a 2-stage
    run's heap peak), so the loss the runtime hands back has storage of its own."""
    out = torch.randn(2, 512, 256, requires_grad=True)
    target = torch.zeros(()).expand(out.shape)
    loss = output_loss(out, target, LossLayout())
    assert loss.untyped_storage().nbytes() == loss.element_size()
    assert torch.equal(loss, F.mse_loss(out, target))
    loss.backward()
    assert torch.allclose(out.grad, 2 * out.detach() / out.numel())

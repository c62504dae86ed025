"""Training's loss runs where the passes leave the logits (`runtime.loss`): the lowering records how
the first output is split (TP vocabulary shards, on the pipeline stage that computes it), and the
loss on a rank's shard, with its scalar all-reduce, equals its part of the whole MSE: value and
gradient, a padded vocabulary's padding left out. The runs on gloo ranks (TP, TP x PP, TP x CP) are
checked against the unsharded model by tests/test_run_modes.py, tests/test_cp_run.py and the CLI's
--run; these checks need no process group."""

from __future__ import annotations

import copy
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

"""Comparing a rank's results with the unsharded reference model (the report's `numerics`)."""

from __future__ import annotations

from typing import Any

import torch

from passes.tensor_parallel import shard_weight
from planner.plan import Plan


def first_output(out: Any) -> torch.Tensor:
    """The tensor a model call's output is compared on: the output itself, or its first element."""
    return out[0] if isinstance(out, (tuple, list)) else out


def training_target(reference_out: torch.Tensor) -> torch.Tensor:
    """A fixed regression target shaped like the reference output (values -1 .. 1), for the MSE loss
    that the run's training step minimises; the same on every rank."""
    values = torch.linspace(-1.0, 1.0, reference_out.numel(), device=reference_out.device)
    return values.reshape(reference_out.shape)


def grad_max_abs_diff(
    module: torch.nn.Module, full_grads: dict[str, torch.Tensor], plan: Plan, tp_rank: int
) -> float:
    """Worst |gradient of a rank's parameter - the unsharded model's gradient, sharded like the parameter|.

    full_grads: parameter FQN -> gradient of the unsharded model. A colwise weight's bias is sharded
    like the weight's output; a vocab split is padded as the TP pass pads it.
    """
    worst = 0.0
    for name, p in module.named_parameters():
        want = full_grads.get(name)
        if p.grad is None or want is None:
            continue
        if tuple(want.shape) != tuple(p.shape):
            split = plan.splits.get(name) or plan.splits.get(name.rsplit(".", 1)[0] + ".weight")
            dim = split.dim if name in plan.splits else 0
            want = shard_weight(want, dim, split.parts, tp_rank, plan.tp, pad=split.style == "vocab")
        worst = max(worst, float((p.grad - want).abs().max()))
    return worst

"""Data parallelism at run time: each replica's share of the batch, and averaging the replicas' gradients.

DP replicas hold the same (TP-sharded, pipeline-staged) module and each runs `1 / dp` of the batch
along dim 0; after the backward, the mean of their gradients over the `dp` group is every replica's
gradient (one all-reduce per parameter).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree


def batch_share(inputs: tuple[torch.Tensor, ...], parts: int, index: int) -> tuple[torch.Tensor, ...]:
    """Share `index` of `parts` of every tensor, split along dim 0 (the batch).

    Raises ValueError naming the shape when a batch does not divide by `parts`.
    """
    if parts == 1:
        return inputs
    for x in inputs:
        if x.shape[0] % parts:
            raise ValueError(
                f"batch {x.shape[0]} of an input of shape {tuple(x.shape)} does not divide into {parts} parts"
            )
    return tuple(x.chunk(parts, dim=0)[index] for x in inputs)


def args_share(args: tuple, kwargs: dict, parts: int, index: int) -> tuple[tuple, dict]:
    """(args, kwargs) of a model call with every tensor leaf cut to share `index` of `parts` (dim 0):
    a DP replica's batch, or one micro-batch. Raises ValueError like `batch_share`."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    shares = iter(batch_share(tuple(tensors), parts, index))
    leaves = [next(shares) if isinstance(x, torch.Tensor) else x for x in leaves]
    return pytree.tree_unflatten(leaves, spec)


def average_gradients(module: torch.nn.Module, group: dist.ProcessGroup, dp: int) -> None:
    """Replace every parameter gradient by the mean over the `dp` replicas of `group`, in place
    (collective over `group`; a no-op when dp == 1)."""
    if dp == 1:
        return
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad /= dp

"""Data parallelism at run time: each replica's share of the batch, and averaging the replicas' gradients.

DP replicas hold the same (TP-sharded, pipeline-staged) module and each runs `1 / dp` of the batch
along every input's batch dim (`planner.frontend.capture.input_batch_dims`: dim 0 for token ids, none
for a (T, T) attention bias, which every replica gets whole); after the backward, the mean of their
gradients over the `dp` group is every replica's gradient (one all-reduce per parameter). Pipeline
micro-batches are cut the same way (`args_share`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

BatchDims = Sequence[int | None]  # per tensor input (flat_inputs order): its batch dim, or None


def batch_share(
    inputs: tuple[torch.Tensor, ...], parts: int, index: int, batch_dims: BatchDims | None = None
) -> tuple[torch.Tensor, ...]:
    """Share `index` of `parts` of every tensor, split along its batch dim.

    batch_dims: one entry per tensor, its batch dim or None (the tensor is shared whole, not split);
    None means dim 0 for every tensor. Raises ValueError naming the shape when a batch does not divide
    by `parts`, and when `parts` > 1 but no tensor has a batch dim.
    """
    dims = [0] * len(inputs) if batch_dims is None else list(batch_dims)
    if len(dims) != len(inputs):
        raise ValueError(f"{len(inputs)} inputs but {len(dims)} batch dims ({dims})")
    if parts == 1:
        return inputs
    if inputs and all(d is None for d in dims):
        raise ValueError(
            f"no input has a batch dim (shapes {[tuple(x.shape) for x in inputs]}), so the batch cannot be "
            f"split into {parts} parts"
        )
    for x, dim in zip(inputs, dims):
        if dim is not None and x.shape[dim] % parts:
            raise ValueError(
                f"batch {x.shape[dim]} (dim {dim}) of an input of shape {tuple(x.shape)} does not divide into "
                f"{parts} parts"
            )
    return tuple(x if dim is None else x.chunk(parts, dim=dim)[index] for x, dim in zip(inputs, dims))


def args_share(
    args: tuple, kwargs: dict, parts: int, index: int, batch_dims: BatchDims | None = None
) -> tuple[tuple, dict]:
    """(args, kwargs) of a model call with every batched tensor leaf cut to share `index` of `parts`
    along its batch dim (`batch_dims`, in tensor-leaf order; None: dim 0 for all): a DP replica's
    batch, or one micro-batch. Inputs without a batch dim stay whole. Raises ValueError like
    `batch_share`."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    shares = iter(batch_share(tuple(tensors), parts, index, batch_dims))
    leaves = [next(shares) if isinstance(x, torch.Tensor) else x for x in leaves]
    return pytree.tree_unflatten(leaves, spec)


def unbatched_note(inputs: tuple[torch.Tensor, ...], batch_dims: BatchDims) -> list[str]:
    """The report's note on inputs without a batch dim (given whole to every replica and micro-batch);
    empty when every input has one."""
    whole = [f"input {i} {tuple(x.shape)}" for i, (x, d) in enumerate(zip(inputs, batch_dims)) if d is None]
    if not whole:
        return []
    return [f"{', '.join(whole)}: no batch dim, given whole to every data-parallel replica and micro-batch"]


def average_gradients(module: torch.nn.Module, group: dist.ProcessGroup, dp: int) -> None:
    """Replace every parameter gradient by the mean over the `dp` replicas of `group`, in place
    (collective over `group`; a no-op when dp == 1).

    The gradients are flattened into one buffer per dtype and all-reduced once, as DDP's gradient
    buckets do and as the cost model prices it (`planner.solver.costing.gradient_sync_cost`: one
    all-reduce of the gradient bytes): one collective call per step, not one per parameter (on gloo
    each call costs about a millisecond of latency)."""
    if dp == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in module.parameters():
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

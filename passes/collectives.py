"""Collectives that the rewrite passes insert into fx graphs, on a named mesh axis.

The passes insert `call_function` nodes whose targets are the plain functions of this module, with the
mesh axis as a string argument (`tp_all_reduce(x, "tp")`), so a generated module's Python source stays
readable and importable without the planner. The process group behind an axis is registered once per
process by the runtime (`register_group("tp", group)`) before the module runs; an unregistered axis
raises a `RuntimeError` that says so. A single-rank axis (`tp=1`, or no process group at all) makes
every collective the identity, so the same generated module runs unsharded.

Autograd follows Megatron-LM (Shoeybi et al., 2019, section 3, operators `f` and `g`):

| function              | forward                     | backward                      |
|-----------------------|-----------------------------|-------------------------------|
| `tp_copy`             | identity                    | all-reduce (sum)              |
| `tp_all_reduce`       | all-reduce (sum)            | identity                      |
| `tp_all_gather`       | all-gather along `dim`      | keep this rank's chunk        |
| `tp_shard`            | keep this rank's chunk      | all-gather along `dim`        |
| `tp_reduce_scatter`   | reduce-scatter along `dim`  | all-gather along `dim`        |
| `tp_sequence_gather`  | all-gather along `dim`      | reduce-scatter along `dim`    |

The last two are sequence parallelism's pair (Korthikanti et al. 2022, section 4.2.2, operators `g`
and `g-bar`): a row-parallel block's partial sums are reduce-scattered along the sequence instead of
all-reduced, and a column-parallel block's sequence-sharded input is all-gathered; each one's backward
is the other collective. `tp_sequence_gather`'s output may only feed ops whose gradients are partial
sums over the ranks (column-parallel matmuls), whose sum its backward takes; `tp_all_gather` (with
`tp_copy` after it) is the gather for anything else.

`tp_all_reduce_start` / `tp_wait` split an all-reduce in two so that the ladder-residual pass can place
compute between issuing it and waiting for it (the communication overlaps that compute). They are for
inference: under autograd, `tp_all_reduce_start` falls back to the synchronous `tp_all_reduce`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_GROUPS: dict[str, dist.ProcessGroup | None] = {}


def register_group(axis: str, group: dist.ProcessGroup | None) -> None:
    """Bind mesh axis `axis` ("tp", ...) to a process group for this process; None means a single rank."""
    _GROUPS[axis] = group


def _group(axis: str) -> dist.ProcessGroup | None:
    if axis not in _GROUPS:
        if not dist.is_initialized():
            return None
        raise RuntimeError(
            f"mesh axis {axis!r} has no process group; call passes.collectives.register_group({axis!r}, group) "
            "before running a generated module"
        )
    return _GROUPS[axis]


def axis_rank(axis: str) -> int:
    """This process's rank on `axis` (0 when the axis has a single rank)."""
    group = _group(axis)
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    group = _group(axis)
    if group is None or dist.get_world_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def all_gather_single(out: torch.Tensor, x: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """All-gather `x` from every rank of `group` into `out` (rank order along dim 0): torch >= 2.13's
    `all_gather_single`, else `all_gather_into_tensor` (deprecated there, with a warning per call
    site). Returns the work handle with `async_op`, else None."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, x, group=group, async_op=async_op)


def reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """Sum `x` over the ranks of `group`, keeping this rank's chunk along dim 0 in `out`: torch >=
    2.13's `reduce_scatter_single`, else `reduce_scatter_tensor`. Returns the work with `async_op`."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, x, group=group, async_op=async_op)


def _all_gather(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    group = _group(axis)
    if group is None or dist.get_world_size(group) == 1:
        return x
    size = dist.get_world_size(group)
    x = x.contiguous()
    flat = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    # one contiguous buffer: gloo's list all_gather is 2.3x slower for 12.9 MB (measured: 27 vs 12 ms)
    all_gather_single(flat, x, group=group)
    if dim % x.dim() == 0:
        return flat
    return torch.cat(flat.view(size, *x.shape).unbind(0), dim=dim)


def _splitting_group(x: torch.Tensor, dim: int, axis: str, verb: str) -> dist.ProcessGroup | None:
    """The group of `axis` that `x` is split over along `dim`; None with one rank (nothing to split).
    Raises RuntimeError naming `verb` when shape[dim] does not divide by the group size."""
    group = _group(axis)
    if group is None or dist.get_world_size(group) == 1:
        return None
    size = dist.get_world_size(group)
    if x.shape[dim] % size:
        raise RuntimeError(
            f"cannot {verb} dim {dim} of size {x.shape[dim]} over {size} ranks of axis {axis!r}"
        )
    return group


def _reduce_scatter(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """Sum over the ranks of `axis`, keeping this rank's contiguous chunk along `dim`."""
    group = _splitting_group(x, dim, axis, "reduce-scatter")
    if group is None:
        return x
    size = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()  # the scattered dim first: each rank's chunk is contiguous
    out = torch.empty((front.shape[0] // size, *front.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim).contiguous()


def _chunk(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    group = _splitting_group(x, dim, axis, "shard")
    if group is None:
        return x
    size = dist.get_world_size(group)
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


def _conjugate(name: str, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An autograd Function computing ``forward(x, dim, axis)`` whose gradient is
    ``backward(grad, dim, axis)`` (Megatron-LM's conjugate pairs: all-reduce / identity, all-gather /
    chunk, reduce-scatter / all-gather); `dim` is None for the two that work on whole tensors."""

    def fwd(ctx, x: torch.Tensor, dim: int | None, axis: str) -> torch.Tensor:
        ctx.dim, ctx.axis = dim, axis
        return forward(x, dim, axis)

    def bwd(ctx, grad: torch.Tensor):
        return backward(grad, ctx.dim, ctx.axis), None, None

    return type(
        name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)}
    )


def _identity(x: torch.Tensor, dim: int | None, axis: str) -> torch.Tensor:
    return x


def _sum(x: torch.Tensor, dim: int | None, axis: str) -> torch.Tensor:
    return _all_reduce(x, axis)


_CopyToParallel = _conjugate("_CopyToParallel", _identity, _sum)
_ReduceFromParallel = _conjugate("_ReduceFromParallel", _sum, _identity)
_GatherFromParallel = _conjugate("_GatherFromParallel", _all_gather, _chunk)
_ScatterToParallel = _conjugate("_ScatterToParallel", _chunk, _all_gather)
_ReduceScatterToSequence = _conjugate("_ReduceScatterToSequence", _reduce_scatter, _all_gather)
_GatherFromSequence = _conjugate("_GatherFromSequence", _all_gather, _reduce_scatter)


def tp_copy(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Identity forward, all-reduce backward: marks a replicated tensor entering a sharded region.

    x: any shape. Returns x itself in forward.
    """
    return _CopyToParallel.apply(x, None, axis)


class _CopyPairToParallel(torch.autograd.Function):
    """`tp_copy` of two tensors of the same leading dims whose gradients are summed in one all-reduce."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, axis: str):
        ctx.axis, ctx.widths, ctx.b_dtype = axis, (a.shape[-1], b.shape[-1]), b.dtype
        return a, b

    @staticmethod
    def backward(ctx, grad_a: torch.Tensor, grad_b: torch.Tensor):
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_a and need_b):  # one input takes a gradient: its own all-reduce
            return (
                _all_reduce(grad_a, ctx.axis) if need_a else None,
                _all_reduce(grad_b, ctx.axis) if need_b else None,
                None,
            )
        summed = _all_reduce(torch.cat([grad_a, grad_b.to(grad_a.dtype)], dim=-1), ctx.axis)
        a, b = summed.split(ctx.widths, dim=-1)
        return a, b.to(ctx.b_dtype), None


def tp_copy_pair(a: torch.Tensor, b: torch.Tensor, axis: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`tp_copy` of `a` (..., A) and `b` (..., B) of the same leading dims (a MoE block's tokens and
    their routing weights entering experts split over the TP ranks): identity forward; in backward
    their gradients are summed over `axis` in one all-reduce of (..., A + B) in `a`'s dtype (one
    collective's latency, not two), `b`'s cast back to its own."""
    return _CopyPairToParallel.apply(a, b, axis)


def tp_all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Sum `x` over the ranks of `axis` (forward); identity backward. Same shape as `x`."""
    return _ReduceFromParallel.apply(x, None, axis)


def tp_all_gather(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """Concatenate the ranks' `x` along `dim`: shape[dim] grows by the axis size. Backward keeps the local chunk."""
    return _GatherFromParallel.apply(x, dim, axis)


def tp_gather_strided(x: torch.Tensor, dim: int, outer: int, axis: str) -> torch.Tensor:
    """The whole tensor from a shard strided through a merged `dim` (`Placement.outer`): each rank's
    (outer * inner / size) rows hold, for every outer index, its chunk of the inner dim. All-gather
    along `dim`, then put each outer index's chunks together in rank order. Backward keeps the local
    part (the all-gather's, through the reorder)."""
    whole = tp_all_gather(x, dim, axis)
    size = whole.shape[dim] // x.shape[dim]
    if size == 1:
        return whole
    shape = list(whole.shape)
    blocks = whole.reshape(*shape[:dim], size, outer, x.shape[dim] // outer, *shape[dim + 1 :])
    return blocks.transpose(dim, dim + 1).reshape(shape)


def tp_shard_strided(x: torch.Tensor, dim: int, outer: int, axis: str) -> torch.Tensor:
    """This rank's part of a replicated `x` as a shard strided through a merged `dim`
    (`Placement.outer`): `dim` of size outer * inner (Bloom's alibi bias, (B * H, 1, T), b-major) is
    seen as (outer, inner), each outer index keeps this rank's contiguous 1/size chunk of the inner
    dim, and the pieces stay merged: (outer * inner / size) rows. Backward all-gathers (`tp_shard`'s,
    through the reshapes). Raises RuntimeError if inner does not divide by the axis size."""
    shape = list(x.shape)
    blocks = x.reshape(*shape[:dim], outer, shape[dim] // outer, *shape[dim + 1 :])
    return tp_shard(blocks, dim + 1, axis).reshape(*shape[:dim], -1, *shape[dim + 1 :])


def tp_shard(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """This rank's contiguous chunk of a replicated `x` along `dim` (shape[dim] / axis size).

    Raises RuntimeError if shape[dim] does not divide by the axis size. Backward all-gathers.
    """
    return _ScatterToParallel.apply(x, dim, axis)


def tp_reduce_scatter(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """Sum the ranks' partial `x` and keep this rank's chunk along `dim` (shape[dim] / axis size):
    a row-parallel output entering a sequence-parallel region. Backward all-gathers along `dim`.
    Raises RuntimeError if shape[dim] does not divide by the axis size."""
    return _ReduceScatterToSequence.apply(x, dim, axis)


def tp_sequence_gather(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """Concatenate the ranks' sequence shards along `dim` (shape[dim] grows by the axis size): the
    input of a column-parallel block under sequence parallelism. Backward reduce-scatters along `dim`
    (the column-parallel blocks' partial input gradients are summed and each rank keeps its chunk)."""
    return _GatherFromSequence.apply(x, dim, axis)


def tp_shard_pieces(x: torch.Tensor, dim: int, pieces: int, axis: str) -> torch.Tensor:
    """This rank's piece of a replicated `x` cut into `pieces` (< axis size) along `dim`: rank r holds
    piece r * pieces // size, shared with the other size / pieces ranks of its group (vLLM's KV-head
    replication when a model has fewer KV heads than ranks). Inference only (no backward).

    Raises RuntimeError if shape[dim] does not divide by `pieces` or `pieces` does not divide the axis size.
    """
    group = _group(axis)
    size = 1 if group is None else dist.get_world_size(group)
    if size % pieces or x.shape[dim] % pieces:
        raise RuntimeError(
            f"cannot cut dim {dim} of size {x.shape[dim]} into {pieces} pieces over {size} ranks"
        )
    rank = 0 if group is None else dist.get_rank(group)
    return x.chunk(pieces, dim=dim)[rank * pieces // size].contiguous()


def tp_gather_pieces(x: torch.Tensor, dim: int, pieces: int, axis: str) -> torch.Tensor:
    """The whole tensor from pieces held as by `tp_shard_pieces`: all-gather along `dim`, then keep one
    copy of each piece (every (size / pieces)-th rank's). Inference only (no backward)."""
    group = _group(axis)
    if group is None or dist.get_world_size(group) == 1:
        return x
    every = _all_gather(x, dim, axis).chunk(dist.get_world_size(group), dim=dim)
    return torch.cat(every[:: dist.get_world_size(group) // pieces], dim=dim)


def tp_gather_parts(x: torch.Tensor, dim: int, parts: list[int], axis: str) -> torch.Tensor:
    """The whole output of a fused projection split by its parts: each rank holds [part_0 / tp |
    part_1 / tp | ...] along `dim` (a column-parallel fused q/k/v); all-gather along `dim`, then put
    each part's pieces back together in rank order. `parts`: the parts' global sizes. Backward keeps
    this rank's piece of each part (through the gather's backward)."""
    group = _group(axis)
    if group is None or dist.get_world_size(group) == 1:
        return x
    tp = dist.get_world_size(group)
    local = [size // tp for size in parts]
    ranks = [chunk.split(local, dim=dim) for chunk in tp_all_gather(x, dim, axis).chunk(tp, dim=dim)]
    return torch.cat([ranks[r][i] for i in range(len(parts)) for r in range(tp)], dim=dim)


@dataclass
class PendingAllReduce:
    """An all-reduce issued by `tp_all_reduce_start` and not yet waited for."""

    tensor: torch.Tensor
    work: object | None


def tp_all_reduce_start(x: torch.Tensor, axis: str) -> PendingAllReduce:
    """Issue a sum all-reduce of `x` over `axis` without waiting; `tp_wait` returns the result.

    Under autograd (grad mode on and `x` requires grad) the all-reduce is done synchronously through
    `tp_all_reduce`, so gradients stay right; the overlap is an inference optimisation.
    """
    group = _group(axis)
    if group is None or dist.get_world_size(group) == 1:
        return PendingAllReduce(x, None)
    if torch.is_grad_enabled() and x.requires_grad:
        return PendingAllReduce(tp_all_reduce(x, axis), None)
    out = x.contiguous().clone()
    work = dist.all_reduce(out, group=group, async_op=True)
    return PendingAllReduce(out, work)


def tp_wait(pending: PendingAllReduce) -> torch.Tensor:
    """Wait for an all-reduce issued by `tp_all_reduce_start` and return its (reduced) tensor."""
    if pending.work is not None:
        pending.work.wait()
        pending.work = None
    return pending.tensor


def vocab_parallel_embedding(
    weight_shard: torch.Tensor,
    ids: torch.Tensor,
    axis: str,
    sequence_dim: int | None = None,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """Embedding lookup with the vocabulary split over `axis` (Megatron VocabParallelEmbedding).

    weight_shard: (vocab / tp, dim), rows [rank * vocab/tp, (rank + 1) * vocab/tp) of the full table.
    ids: integer tensor of any shape (global token ids). Returns (*ids.shape, dim), summed over ranks:
    each rank looks up the ids it owns, zeros the rest, and an all-reduce combines them. With
    `sequence_dim` (sequence parallelism) the sum is reduce-scattered along that output dim instead:
    this rank's chunk of the sequence, shape[sequence_dim] / axis size. `padding_idx`: the global
    row whose gradient stays zero (`nn.Embedding(padding_idx=...)`: Hugging Face models take it from
    the config's pad_token_id), on the rank that holds it.
    """
    rows = weight_shard.shape[0]
    start = axis_rank(axis) * rows
    local = ids - start
    outside = (local < 0) | (local >= rows)
    local = local.masked_fill(outside, 0)
    pad = padding_idx - start if padding_idx is not None and start <= padding_idx < start + rows else None
    out = torch.nn.functional.embedding(local, weight_shard, padding_idx=pad)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    if sequence_dim is not None:
        return tp_reduce_scatter(out, sequence_dim, axis)
    return tp_all_reduce(out, axis)

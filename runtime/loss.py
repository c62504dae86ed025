"""The training loss of a run, on the outputs as the rank holds them.

A run trains its model with the mean squared error between the first output and a target of the same
shape (the reference computed the same on the unsharded model: `runtime.reference`). With tensor
parallelism the LM head's logits stay split over the vocabulary (`passes.tensor_parallel.OutputShard`,
``gm.meta["tp_output_shard"]``), so the loss is computed vocab-parallel, as Megatron-LM's
vocab-parallel cross-entropy and torchtitan's loss_parallel do: each rank sums the squared errors of
its columns (the padding of a vocabulary that does not divide by tp left out) and one all-reduce of a
scalar adds the ranks' sums. The all-reduce's backward is the identity (`passes.collectives.
tp_all_reduce`), so each rank's gradient reaches its own shard only, as the whole loss's would. No
rank gathers the logits; the numerics check gathers them (`gathered_output`) outside the timed steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from passes import collectives
from passes.tensor_parallel import OUTPUT_SHARD, OutputShard


def output_shard(module: torch.nn.Module) -> OutputShard | None:
    """How `module`'s (a rank's lowered graph or last pipeline stage) first output is split over the
    TP ranks, None when it is whole."""
    return getattr(module, "meta", {}).get(OUTPUT_SHARD)


def full_shape(local_shape: tuple[int, ...], shard: OutputShard | None) -> tuple[int, ...]:
    """The whole output's shape for a rank's `local_shape` (the shard's dim at its whole length)."""
    if shard is None:
        return tuple(local_shape)
    shape = list(local_shape)
    shape[shard.dim] = shard.length
    return tuple(shape)


def _valid(shard: OutputShard, tp_rank: int) -> tuple[int, int]:
    """(start, length) of this rank's real columns along the shard's dim (0 length: all padding)."""
    start = tp_rank * shard.local
    return start, max(0, min(shard.length - start, shard.local))


def output_loss(
    out: torch.Tensor, target: torch.Tensor, shard: OutputShard | None, tp_rank: int, axis: str = "tp"
) -> torch.Tensor:
    """The mean squared error of the whole output against `target` (the whole output's shape), from
    this rank's `out`: F.mse_loss when whole; with a `shard`, the rank's squared errors summed in fp32,
    all-reduced over `axis` and divided by the element count (0-dim, `out`'s dtype, equal on every
    TP rank). Backward reaches this rank's columns only."""
    if shard is None:
        return F.mse_loss(out, target)
    start, length = _valid(shard, tp_rank)
    mine = out.narrow(shard.dim, 0, length)
    wanted = target.narrow(shard.dim, start, length)
    local = (mine - wanted).pow(2).sum(dtype=torch.float32)
    return (collectives.tp_all_reduce(local, axis) / target.numel()).to(out.dtype)


@torch.no_grad()
def gathered_output(out: torch.Tensor, shard: OutputShard | None, axis: str = "tp") -> torch.Tensor:
    """The whole output from the ranks' shards (detached, padding dropped): for the numerics check."""
    if shard is None:
        return out.detach()
    whole = collectives.tp_all_gather(out.detach().contiguous(), shard.dim, axis)
    return whole.narrow(shard.dim, 0, shard.length)

"""The training loss of a run, on the outputs as the rank holds them.

A run trains its model with the mean squared error between the first output and a target of the same
shape (the reference computed the same on the unsharded model: `runtime.reference`). The first output
stays where the passes leave it: with tensor parallelism the LM head's logits on their vocabulary
shards (`passes.tensor_parallel.OutputShard`), with context parallelism on this rank's tokens
(`passes.cp_lower.CpOutputShard`). The loss is computed on those shards, as Megatron-LM's
vocab-parallel cross-entropy and torchtitan's loss_parallel do: each rank sums the squared errors of
its elements (the padding of a vocabulary that does not divide by tp left out) and all-reduces of one
scalar over the TP and CP ranks add the sums. An all-reduce's backward is the identity
(`passes.collectives.tp_all_reduce`), so each rank's gradient reaches its own elements only, as the
whole loss's would; under CP that gradient is scaled by cp (the weights' gradients are partial sums
over the ranks' tokens and the data-parallel reduction averages over dp x cp: Megatron-LM scales its
loss by the CP size for the same reason). No rank gathers the outputs for the loss; the numerics check
gathers them (`gathered_output`) outside the timed steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from passes import collectives
from passes.context_parallel import cp_gather, cp_slice
from passes.cp_lower import AXIS as CP_AXIS
from passes.cp_lower import CP_OUTPUT_SHARD, CpOutputShard
from passes.tensor_parallel import OUTPUT_SHARD, OutputShard


@dataclass(frozen=True)
class LossLayout:
    """How a rank holds the first output: its vocabulary shard (`tp`, None: whole) of TP rank
    `tp_rank`, and its tokens (`cp`, None: every token) of `cp_size` context-parallel ranks."""

    tp: OutputShard | None = None
    tp_rank: int = 0
    cp: CpOutputShard | None = None
    cp_size: int = 1

    @property
    def sharded(self) -> bool:
        return self.tp is not None or self.cp is not None


def loss_layout(modules: list[torch.nn.Module], tp_rank: int, cp_size: int) -> LossLayout:
    """The layout of the first output of `modules` (a rank's lowered graph, or its pipeline chunks: the
    one computing the model's outputs records it)."""
    metas = [getattr(m, "meta", {}) for m in modules]
    tp = next((meta[OUTPUT_SHARD] for meta in metas if OUTPUT_SHARD in meta), None)
    cp = next((meta[CP_OUTPUT_SHARD] for meta in metas if CP_OUTPUT_SHARD in meta), None)
    return LossLayout(tp, tp_rank, cp, cp_size)


def full_shape(local_shape: tuple[int, ...], layout: LossLayout) -> tuple[int, ...]:
    """The whole output's shape for a rank's `local_shape`."""
    shape = list(local_shape)
    if layout.tp is not None:
        shape[layout.tp.dim] = layout.tp.length
    if layout.cp is not None:
        shape[layout.cp.dim] *= layout.cp_size
    return tuple(shape)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def cp_grad_scaled(x: torch.Tensor, cp: int) -> torch.Tensor:
    """`x` whose gradient is multiplied by `cp` (the loss on a CP rank's tokens: module docstring)."""
    return _ScaleGrad.apply(x, float(cp))


def output_loss(out: torch.Tensor, target: torch.Tensor, layout: LossLayout) -> torch.Tensor:
    """The mean squared error of the whole output against `target` (the whole output's shape, this DP
    replica's share) from this rank's `out`, 0-dim fp32 (as Megatron-LM computes its loss, and so that
    fp16's loss scaling can multiply it by 2**16: `runtime.loss_scaling`): F.mse_loss when the output is
    whole and not 16-bit; otherwise the rank's squared errors summed in fp32, all-reduced over the TP and CP ranks
    when sharded, and divided by the element count (equal on every rank). Backward reaches this rank's
    elements only (times cp under CP: module docstring)."""
    if not layout.sharded and out.dtype not in (torch.float16, torch.bfloat16):
        # its own 4 bytes: CPU mse_loss returns a 0-dim view of its elementwise buffer (output-sized),
        # which a caller that keeps the loss (a pipeline schedule keeps every micro-batch's) would hold
        return F.mse_loss(out, target).clone()
    count = target.numel()
    if layout.cp is not None:  # this rank's tokens, in the lowering's order (head-tail chunks)
        target = cp_slice(target, layout.cp.dim, CP_AXIS, layout.cp.load_balance)
    if layout.tp is not None:  # this rank's real vocabulary columns
        shard = layout.tp
        start = min(layout.tp_rank * shard.local, shard.length)  # a rank holding padding only: 0 columns
        length = max(0, min(shard.length - start, shard.local))
        out = out.narrow(shard.dim, 0, length)
        target = target.narrow(shard.dim, start, length)
    total = (out - target).pow(2).sum(dtype=torch.float32)
    if layout.tp is not None:
        total = collectives.tp_all_reduce(total, "tp")
    if layout.cp is not None:
        total = collectives.tp_all_reduce(cp_grad_scaled(total, layout.cp_size), CP_AXIS)
    return total / count


@torch.no_grad()
def gathered_output(out: torch.Tensor, layout: LossLayout) -> torch.Tensor:
    """The whole output from the ranks' shards (detached, padding dropped): for the numerics check."""
    whole = out.detach()
    if layout.tp is not None:
        whole = collectives.tp_all_gather(whole.contiguous(), layout.tp.dim, "tp")
        whole = whole.narrow(layout.tp.dim, 0, layout.tp.length)
    if layout.cp is not None:
        whole = cp_gather(whole.contiguous(), layout.cp.dim, CP_AXIS, layout.cp.load_balance)
    return whole


def unheld_like(target: torch.Tensor) -> torch.Tensor:
    """Zeros of ``target``'s shape, dtype and device that hold no memory (one element, expanded): the
    timed steps' MSE target. The checked step's target is random and as large as the outputs (logits
    for every micro-batch), memory an LM's loss does not hold (its labels are one integer per token),
    which the plan does not price; the kernels read the same shapes."""
    return torch.zeros((), dtype=target.dtype, device=target.device).expand(target.shape)

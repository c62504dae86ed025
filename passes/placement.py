"""Tensor placements on a tensor-parallel axis, the shape algebra the TP pass needs, weight shards.

A value in a TP-rewritten graph is, on each rank of the axis, one of the plan's layouts
(`planner.plan.Layout`, the same R/S/P the solver costs):

- `Placement.replicate()` (`Layout.REPLICATE`) - the full tensor, identical on every rank;
- `Placement.shard(dim, parts)` (`Layout.SHARD`) - a contiguous 1/tp chunk along `dim` (global
  shape / tp). With `parts` (a fused projection such as GPT-2's `c_attn`, global part sizes along
  `dim`) the chunk is taken from every part and the chunks are concatenated: [q_r | k_r | v_r];
- `Placement.partial()` (`Layout.PARTIAL`) - a per-rank partial sum; the full value is the sum over
  ranks.

A shard may be padded (`size`: the padded global length along `dim`, a multiple of tp): a vocabulary
of 50257 rows split over 2 ranks is held as 2 x 25129 rows, the last one zero (Megatron-LM pads the
vocabulary the same way); gathering it drops the padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from planner.plan import Layout


@dataclass(frozen=True)
class Placement:
    """Where a value lives on the TP axis; `dim` is non-negative for shards.

    kind: a `planner.plan.Layout` (its string value "R" / "S" / "P" is accepted and converted).
    """

    kind: Layout
    dim: int = -1
    parts: tuple[int, ...] | None = None
    size: int | None = None  # padded global length along `dim` (None: not padded)
    # pieces: `dim` is cut into this many pieces (fewer than tp; None: tp pieces) and rank r holds
    # piece r * pieces // tp, shared by tp / pieces ranks (KV heads replicated as vLLM does when a
    # GQA model has fewer KV heads than ranks). inner: the value was expanded along dim + 1 (GQA
    # repeat) and that dim carries the rest of the split: it is cut into tp / pieces parts.
    pieces: int | None = None
    inner: bool = False
    # outer: `dim` merges an outer dim of this size in front of the sharded one ((B, H / tp) -> B * H:
    # nn.MultiheadAttention's and Bloom's (B * H, T, hd)); each rank holds, for every outer index, its
    # contiguous 1/tp chunk of the inner dim, so its part is strided through `dim` (DTensor's
    # _StridedShard). Reshapes, transposes and copies carry it, and ops that compute each row of the
    # merged dim from the same rows of their inputs (bmm, baddbmm, pointwise, a softmax over another
    # dim: `passes.general_rules.strided_general_rule`); others gather it (`passes.tensor_parallel`)
    outer: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Layout(self.kind))  # "R" -> Layout.REPLICATE

    @staticmethod
    def replicate() -> Placement:
        return Placement(Layout.REPLICATE)

    @staticmethod
    def shard(
        dim: int, parts: tuple[int, ...] | None = None, size: int | None = None, pieces: int | None = None
    ) -> Placement:
        return Placement(Layout.SHARD, dim, parts, size, pieces)

    def divisor(self, tp: int) -> int:
        """How many pieces `dim` is cut into: `pieces` for a replicated-piece shard, else tp."""
        return self.pieces or tp

    @staticmethod
    def partial() -> Placement:
        return Placement(Layout.PARTIAL)

    @property
    def is_shard(self) -> bool:
        return self.kind is Layout.SHARD

    @property
    def is_partial(self) -> bool:
        return self.kind is Layout.PARTIAL

    @property
    def is_replicate(self) -> bool:
        return self.kind is Layout.REPLICATE

    @property
    def is_plain_shard(self) -> bool:
        """An even, contiguous shard of one dim, as DTensor's `Shard(dim)` is: no fused parts, padding,
        pieces, GQA repeat or stride through a merged dim."""
        return (
            self.is_shard
            and not self.parts
            and self.size is None
            and self.pieces is None
            and not self.inner
            and not self.outer
        )

    def __str__(self) -> str:
        if self.is_shard:
            padded = f"[padded to {self.size}]" if self.size else ""
            pieces = f"[{self.pieces} pieces{', inner' if self.inner else ''}]" if self.pieces else ""
            outer = f"[strided, outer {self.outer}]" if self.outer else ""
            return (
                f"Shard({self.dim})"
                + (f"[parts={list(self.parts)}]" if self.parts else "")
                + padded
                + pieces
                + outer
            )
        return "Partial()" if self.is_partial else "Replicate()"


def loss_output(out: object) -> object:
    """The graph output a training run's loss reads (`runtime.loss`): the first of a tuple or list of
    outputs, else the single output ``out`` itself (an output node's argument)."""
    return out[0] if isinstance(out, (tuple, list)) and out else out


def local_shape(global_shape: tuple[int, ...], placement: Placement, tp: int) -> tuple[int, ...]:
    """The per-rank shape of a value of `global_shape` with `placement` over `tp` ranks."""
    if not placement.is_shard:
        return tuple(global_shape)
    shape = list(global_shape)
    shape[placement.dim] = (placement.size or shape[placement.dim]) // placement.divisor(tp)
    if placement.inner:
        shape[placement.dim + 1] //= tp // placement.divisor(tp)
    return tuple(shape)


def padded_size(size: int, tp: int) -> int:
    """`size` rounded up to a multiple of tp (a padded vocabulary)."""
    return -(-size // tp) * tp


def shard_weight(
    full: torch.Tensor,
    dim: int,
    parts: list[int] | tuple[int, ...] | None,
    rank: int,
    tp: int,
    pad: bool = False,
    pieces: int | None = None,
) -> torch.Tensor:
    """This rank's shard of `full` along `dim`: a contiguous 1/tp chunk, taken per part for fused weights.

    pieces: cut into that many chunks instead (fewer than tp, dividing it); rank r takes chunk
    r * pieces // tp (KV heads replicated over tp / pieces ranks, as vLLM does).

    full: the global parameter, e.g. (out_features, in_features). pad: a vocabulary that does not
    divide by tp is first padded with zero rows to `padded_size` (only for vocab splits: the padded
    rows' outputs are dropped when gathered). Raises ValueError when a size does not divide by tp.
    Meta tensors give meta shards.
    """
    if pad and not parts and full.shape[dim] % tp:
        extra = list(full.shape)
        extra[dim] = padded_size(full.shape[dim], tp) - full.shape[dim]
        full = torch.cat([full, full.new_zeros(extra)], dim=dim)
    if pieces is not None:
        if parts or tp % pieces or full.shape[dim] % pieces:
            raise ValueError(
                f"size {full.shape[dim]} of dim {dim} cannot be cut into {pieces} pieces over tp={tp}"
            )
        return full.chunk(pieces, dim=dim)[rank * pieces // tp].contiguous()
    blocks = [full] if not parts else list(full.split(list(parts), dim=dim))
    out = []
    for piece in blocks:
        if piece.shape[dim] % tp:
            raise ValueError(f"size {piece.shape[dim]} of dim {dim} does not divide by tp={tp}")
        out.append(piece.chunk(tp, dim=dim)[rank])
    return torch.cat(out, dim=dim).contiguous() if len(out) > 1 else out[0].contiguous()


def view_groups(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[tuple[range, range]]:
    """Split a reshape into groups of input dims and output dims with equal products.

    Example: (2, 8, 64) -> (2, 8, 4, 16) gives [(0)->(0), (1)->(1), (2)->(2, 3)]. Raises ValueError
    when the element counts differ.
    """
    if math.prod(in_shape) != math.prod(out_shape):
        raise ValueError(f"reshape {tuple(in_shape)} -> {tuple(out_shape)} changes the element count")
    groups: list[tuple[range, range]] = []
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        start_i, start_j = i, j
        p_in = p_out = 1
        if i < len(in_shape):
            p_in *= in_shape[i]
            i += 1
        if j < len(out_shape):
            p_out *= out_shape[j]
            j += 1
        while p_in != p_out:
            if p_in < p_out:
                p_in *= in_shape[i]
                i += 1
            else:
                p_out *= out_shape[j]
                j += 1
        groups.append((range(start_i, i), range(start_j, j)))
    return groups


class ShardInterleavedError(ValueError):
    """A reshape merges the shard's dim into an outer one ((B, H/tp) -> B*H): each rank's part is
    strided through the merged dim, which no contiguous shard expresses."""


def view_shard_dim(in_shape: tuple[int, ...], out_shape: tuple[int, ...], dim: int, tp: int) -> int:
    """Output dim that carries the shard of input dim `dim` through a reshape, or raise ValueError.

    A contiguous 1/tp chunk of a group of dims stays contiguous only when the shard is on the
    outermost non-unit dim of its input group, and the outermost non-unit output dim of the group
    divides by tp. (B, T, H*hd) sharded on dim 2 -> (B, T, H, hd) is sharded on H: whole heads.
    """
    for in_dims, out_dims in view_groups(in_shape, out_shape):
        if dim not in in_dims:
            continue
        leading = [d for d in in_dims if in_shape[d] != 1]
        if not leading or leading[0] != dim:
            raise ShardInterleavedError(
                f"input dim {dim} is not the outermost dim of the reshaped group {list(in_dims)} of {tuple(in_shape)}"
            )
        outs = [d for d in out_dims if out_shape[d] != 1]
        if not outs or out_shape[outs[0]] % tp:
            raise ValueError(
                f"no output dim of {tuple(out_shape)} in group {list(out_dims)} divides by tp={tp}"
            )
        return outs[0]
    raise ValueError(f"dim {dim} out of range for shape {tuple(in_shape)}")

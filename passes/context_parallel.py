"""Context parallelism (CP): attention over a sequence whose tokens are split over the ranks of a mesh axis.

Under CP every activation of a layer holds only this rank's tokens of each sequence: shape (B, H,
T / C, D) for attention's q, k, v on C ranks. Everything but attention is token-wise; attention needs
every token's K and V. This module is the building block a lowering pass and the runtime will use:

| function                 | what it does                                                          |
|--------------------------|-----------------------------------------------------------------------|
| `cp_positions`           | the global token positions a rank holds (pure; for RoPE positions)    |
| `cp_shard`               | keep this rank's tokens of a replicated tensor; backward all-gathers  |
| `cp_unshard`             | all-gather the ranks' tokens back in sequence order; backward keeps   |
|                          | this rank's tokens (the conjugate pair, as `passes.collectives`)      |
| `cp_attention_ring`      | ring attention (Liu et al. 2023; Megatron-Core / TE "p2p")            |
| `cp_attention_allgather` | all-gather K/V, local queries over the whole K/V (Llama 3; TE         |
|                          | "all_gather")                                                         |
| `cp_attention_alltoall`  | Ulysses (Jacobs et al. 2023; TE "a2a"): all-to-all sequence <-> heads |

Each attention function takes q (B, H, T/C, D) and k, v (B, H_kv, T/C, D) holding this rank's tokens
(H_kv may divide H: grouped-query attention, query head h uses KV head h // (H / H_kv), as
`scaled_dot_product_attention(enable_gqa=True)`), and returns this rank's (B, H, T/C, D) rows of
`scaled_dot_product_attention` on the whole sequence, forward and backward. The CP process group
comes from the axis name (`passes.collectives.register_group("cp", group)`); with one rank (or no
process group) every function is plain SDPA / the identity.

**Load balancing.** Under a causal mask the token at position p attends to p + 1 keys, so with
contiguous shards rank C-1 does about 2C-1 times rank 0's work. With `load_balance=True` the sequence is
cut into 2C chunks of T / 2C tokens and rank r holds chunks r and 2C-1-r (head-tail, Megatron-Core's
and torch's round-robin layout): every rank holds one early and one late chunk and does the same
causal work: T (T + 1) / (2C) visible (query, key) pairs, 1/C of the whole (the tests count them).
The rank's two chunks are concatenated, early chunk first, so its positions are sorted ascending.
Without load balancing rank r holds the r-th contiguous C-th of the sequence.

**Ring.** Step i = 0 .. C-1: rank r holds the K/V block of rank s = (r - i) mod C; it posts the
send of that block to rank r+1 and the receive of the next from r-1 (`dist.isend` / `irecv`), then
computes its queries' attention over the block while the transfer is in flight, then waits. The
causal mask of a block is taken from the global positions of the queries and keys: its visible pairs
are cut into rectangles each wholly visible or a causal square on the diagonal (`_rectangles`; blocks
wholly in the future have none; with head-tail chunks a step other than the first is one full
chunk-by-block or block-by-chunk product), and each rectangle is one call of a fused attention kernel
that returns its log-sum-exp (on CPU ranks torch's flash attention for CPU, whose backward takes the
merged output and log-sum-exp, as torch's own ring attention calls the fused kernels; elsewhere
PyTorch ops over fp32 score tiles of `SCORE_TILE`, `FUSED_CPU_KERNEL`). Partial results are merged by
the online-softmax rule (Milakov & Gimelshein 2018; FlashAttention): with a block's output o_b and
log-sum-exp l_b = log sum_j exp(s_j) over its keys, and the running (o, l),

    m = max(l, l_b);   l' = m + log(exp(l - m) + exp(l_b - m))
    o' = o * exp(l - l') + o_b * exp(l_b - l')

in fp32 (a row that has seen no key yet has l = -inf and o = 0). Backward recomputes each block's
probabilities from the saved log-sum-exp, P = exp(S - l), with delta = rowsum(dO * O):
dV = P^T dO, dS = P * (dO V^T - delta), dQ = dS K scale, dK = dS^T Q scale. K/V travel round the ring
again (prefetched as in forward) and each block's dK/dV accumulator travels with it, one step behind,
so after C transfers it arrives home summed over every rank's queries.

**All-gather.** K and V are all-gathered (one collective), put in sequence order, and the local
queries attend over the whole sequence with the causal mask by global positions (only keys up to the
rank's last query are computed). Backward all-gathers K/V again (nothing whole-sequence is kept
between forward and backward) and reduce-scatters dK/dV.

**All-to-all (Ulysses).** One all-to-all each for q, k, v turns (this rank's tokens, all heads) into
(all tokens in sequence order, heads / C); plain SDPA (causal as usual, the sequence is whole); one
all-to-all back. Backward is the same all-to-alls reversed, through SDPA's own backward. Needs H and
H_kv to divide by C (else ValueError naming the counts and the variants that work).

**Costs** (per rank, for the planner; b = bytes per element of q/k/v, T_l = T / C tokens per rank,
KV = 2 B H_kv T_l D b the bytes of one rank's K and V block, Q = B H T_l D b one rank's q or out):

| variant    | forward                                  | backward                                        |
|------------|------------------------------------------|-------------------------------------------------|
| ring       | C-1 steps, each sends and receives KV    | C-1 steps sending KV, plus C steps each sending |
|            | to/from its ring neighbours, hidden      | and receiving the dK/dV accumulator, fp32:      |
|            | behind the step's block attention        | KV * 4 / b; exposed: the last one               |
|            | (exposed: the part a step's compute      |                                                 |
|            | does not cover)                          |                                                 |
| allgather  | all-gather: receives (C-1) KV, exposed   | all-gather again: (C-1) KV; reduce-scatter of   |
|            |                                          | dK/dV in fp32: (C-1) KV * 4 / b                 |
| alltoall   | all-to-alls of q, k, v and out: sends    | the same four (dout in; dq, dk, dv out)         |
|            | (C-1)/C of (2 Q + KV), exposed           |                                                 |

Ring and all-gather move the same K/V bytes; the ring hides them behind compute but pays C-1
latencies and needs enough work per step (long sequences); all-gather is one collective (Llama 3
chose it for its simplicity with GQA's small K/V and document masks). Per rank the ring's and the all-gather's
bytes stay at about one sequence's K/V whatever C; Ulysses moves q and out too, but only (C-1)/C of
the rank's own tensors, so its bytes per rank fall as 1/C for a fixed sequence; it cannot overlap
with the attention and is limited by the head counts. Memory:
ring and all-gather keep two K/V blocks (all-gather: the whole sequence's K/V during the layer) and
save only local tensors for backward, plus the fp32 log-sum-exp (B, H, T_l).

References: Liu, Zaharia, Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context"; Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of
Extreme Long Sequence Transformer Models"; Dubey et al. 2024, "The Llama 3 Herd of Models", section
3.3.2 (context parallelism with an all-gather of K/V); Megatron-Core's context parallelism
(`--context-parallel-size`, `--cp-comm-type p2p | a2a | all_gather | a2a+p2p`, Transformer Engine's
`DotProductAttention` with `cp_group`); PyTorch's `torch.distributed.tensor.experimental.context_parallel`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import record_function

from costmodels.context_parallel import SCORE_TILE
from passes.collectives import _all_gather, _group, _reduce_scatter
from planner.plan import CP_COMM_TYPES

__all__ = [
    "CP_VARIANTS",
    "cp_attention",
    "cp_attention_allgather",
    "cp_attention_alltoall",
    "cp_attention_ring",
    "cp_gather",
    "cp_gather_output",
    "cp_positions",
    "cp_sdpa",
    "cp_shard",
    "cp_slice",
    "cp_unshard",
]

CP_VARIANTS = CP_COMM_TYPES  # ring, allgather, alltoall (`planner.plan.Plan.cp_comm_type`)
_KV_TAG, _DKV_TAG = 71, 72  # p2p tags of the ring's K/V and dK/dV transfers (distinct: both in flight)


# ---------------------------------------------------------------------------------------------
# Layout: which tokens a rank holds


def _chunks(seq_len: int, size: int, load_balance: bool) -> int:
    """How many equal chunks the sequence is cut into (2C with load balancing, else C); ValueError
    naming both numbers when `seq_len` does not divide."""
    chunks = 2 * size if load_balance else size
    if seq_len % chunks:
        how = f"2 x {size} = {chunks} chunks (load balancing)" if load_balance else f"{chunks} chunks"
        raise ValueError(
            f"context parallelism over {size} ranks cannot cut a sequence of {seq_len} tokens into {how}: "
            f"{seq_len} is not a multiple of {chunks}"
        )
    return chunks


def cp_positions(seq_len: int, rank: int, size: int, load_balance: bool) -> torch.Tensor:
    """The global positions (int64, shape (seq_len / size,), ascending) of the tokens rank `rank` of
    `size` holds: with `load_balance` chunks `rank` and 2*size-1-rank of the sequence cut into 2*size
    chunks, else the rank-th contiguous size-th. Pure; cut RoPE positions with it.

    Raises ValueError naming both numbers when seq_len does not divide by size (2 * size)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in 0 .. {size - 1}")
    chunks = _chunks(seq_len, size, load_balance)
    n = seq_len // chunks
    if not load_balance:
        return torch.arange(rank * n, (rank + 1) * n)
    tail = chunks - 1 - rank
    return torch.cat([torch.arange(rank * n, (rank + 1) * n), torch.arange(tail * n, (tail + 1) * n)])


def _gathered_positions(seq_len: int, size: int, load_balance: bool) -> torch.Tensor:
    """Positions of the ranks' tokens concatenated in rank order (what an all-gather returns), (seq_len,)."""
    return torch.cat([cp_positions(seq_len, r, size, load_balance) for r in range(size)])


def _size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _to_sequence_order(x: torch.Tensor, dim: int, size: int, load_balance: bool) -> torch.Tensor:
    """Rank-ordered tokens (as gathered) along `dim` -> sequence order."""
    if not load_balance:
        return x
    order = torch.argsort(_gathered_positions(x.shape[dim], size, True)).to(x.device)
    return x.index_select(dim, order)


def _to_rank_order(x: torch.Tensor, dim: int, size: int, load_balance: bool) -> torch.Tensor:
    """Sequence-ordered tokens along `dim` -> rank order (rank 0's tokens, rank 1's, ...)."""
    if not load_balance:
        return x
    return x.index_select(dim, _gathered_positions(x.shape[dim], size, True).to(x.device))


def _keep_local(x: torch.Tensor, dim: int, axis: str, load_balance: bool) -> torch.Tensor:
    group = _group(axis)
    size, rank = _size_rank(group)
    if size == 1:
        return x
    dim = dim % x.dim()
    pos = cp_positions(x.shape[dim], rank, size, load_balance).to(x.device)
    return x.index_select(dim, pos)


def _gather_sequence(x: torch.Tensor, dim: int, axis: str, load_balance: bool) -> torch.Tensor:
    group = _group(axis)
    size, _ = _size_rank(group)
    if size == 1:
        return x
    dim = dim % x.dim()
    return _to_sequence_order(_all_gather(x, dim, axis), dim, size, load_balance)


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, axis: str, load_balance: bool) -> torch.Tensor:
        ctx.dim, ctx.axis, ctx.load_balance = dim, axis, load_balance
        return _keep_local(x, dim, axis, load_balance)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_sequence(grad, ctx.dim, ctx.axis, ctx.load_balance), None, None, None


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, axis: str, load_balance: bool) -> torch.Tensor:
        ctx.dim, ctx.axis, ctx.load_balance = dim, axis, load_balance
        return _gather_sequence(x, dim, axis, load_balance)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _keep_local(grad, ctx.dim, ctx.axis, ctx.load_balance), None, None, None


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, axis: str, load_balance: bool) -> torch.Tensor:
        ctx.dim, ctx.axis, ctx.load_balance, ctx.full = (
            dim % x.dim(),
            axis,
            load_balance,
            x.shape[dim % x.dim()],
        )
        return _keep_local(x, dim, axis, load_balance)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size, rank = _size_rank(_group(ctx.axis))
        shape = list(grad.shape)
        shape[ctx.dim] = ctx.full
        out = grad.new_zeros(shape)
        pos = cp_positions(ctx.full, rank, size, ctx.load_balance).to(grad.device)
        return out.index_copy(ctx.dim, pos, grad), None, None, None


class _GatherOutput(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, dim: int, axis: str, load_balance: bool, grad_scale: float
    ) -> torch.Tensor:
        ctx.dim, ctx.axis, ctx.load_balance, ctx.grad_scale = dim, axis, load_balance, grad_scale
        return _gather_sequence(x, dim, axis, load_balance)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        local = _keep_local(grad, ctx.dim, ctx.axis, ctx.load_balance)
        return local * ctx.grad_scale if ctx.grad_scale != 1 else local, None, None, None, None


class _GatherPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, axis: str, load_balance: bool) -> torch.Tensor:
        ctx.dim, ctx.axis, ctx.load_balance = dim % x.dim(), axis, load_balance
        return _gather_sequence(x, dim, axis, load_balance)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size, _ = _size_rank(_group(ctx.axis))
        rank_order = _to_rank_order(grad, ctx.dim, size, ctx.load_balance)
        return _reduce_scatter(rank_order, ctx.dim, ctx.axis), None, None, None


def cp_slice(x: torch.Tensor, dim: int, axis: str, load_balance: bool) -> torch.Tensor:
    """The lowering's cut of a replicated value to this rank's tokens along `dim` (token inputs, RoPE
    tables, position embeddings), as `cp_shard` but with the gradient convention of a lowered graph:
    backward puts this rank's gradient at its positions and zeros elsewhere (a partial sum over the CP
    ranks; the data-parallel reduction over dp x cp sums it, `passes.cp_lower`). With one rank: `x`."""
    if _size_rank(_group(axis))[0] == 1:
        return x
    if not (x.requires_grad and torch.is_grad_enabled()):
        return _keep_local(x, dim, axis, load_balance)
    return _Slice.apply(x, dim, axis, load_balance)


def cp_gather_output(
    x: torch.Tensor, dim: int, axis: str, load_balance: bool, grad_scale: float
) -> torch.Tensor:
    """A graph output's whole sequence from every rank's tokens (all-gather, sequence order). Every CP
    rank then computes the same loss from the same whole output, so backward keeps this rank's tokens of
    the gradient, times `grad_scale` (cp under training: the weights' gradients are partial sums over
    the ranks' tokens and the data-parallel reduction averages over dp x cp; Megatron-LM scales its loss
    by the CP size for the same reason). With one rank: `x`."""
    if _size_rank(_group(axis))[0] == 1:
        return x
    return _GatherOutput.apply(x, dim, axis, load_balance, float(grad_scale))


def cp_gather(x: torch.Tensor, dim: int, axis: str, load_balance: bool) -> torch.Tensor:
    """The whole sequence of a sharded value inside the graph, for an op that needs every token (a
    recorded, priced fallback of `passes.cp_lower`): all-gather in sequence order; backward sums the
    ranks' partial gradients and keeps this rank's tokens (reduce-scatter). With one rank: `x`."""
    if _size_rank(_group(axis))[0] == 1:
        return x
    return _GatherPartial.apply(x, dim, axis, load_balance)


def cp_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    axis: str,
    variant: str,
    causal: bool,
    load_balance: bool,
    scale: float | None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)` of a lowered graph on this
    rank's tokens: `cp_attention` with positional arguments (fx nodes); q (B, H, T_l, D), k, v
    (B, H_kv, T_l, D) -> (B, H, T_l, D), strided as SDPA's output (its transpose(1, 2) contiguous). `enable_gqa` is implied by the head counts (the kernels group heads).
    Values of another head dim than the keys' (DeepSeek's latent attention: q, k 192, v 128) are
    padded with zeros to it and the output cut back (zero columns of v add zero columns to the output;
    q and k padded the other way add nothing to the scores, the scale kept at the keys' own)."""
    del enable_gqa
    d_k, d_v = k.shape[-1], v.shape[-1]
    if d_k != d_v:
        scale = 1.0 / math.sqrt(d_k) if scale is None else scale
        if d_v < d_k:
            v = F.pad(v, (0, d_k - d_v))
        else:
            q, k = F.pad(q, (0, d_v - d_k)), F.pad(k, (0, d_v - d_k))
    out = cp_attention(q, k, v, axis, variant=variant, causal=causal, load_balance=load_balance, scale=scale)
    out = out[..., :d_v]
    # SDPA's own output is laid out (B, T, H, D) in memory, so a captured graph may `view` its
    # transpose(1, 2) without a copy; give that layout back
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def cp_shard(x: torch.Tensor, dim: int, axis: str, load_balance: bool) -> torch.Tensor:
    """This rank's tokens of a replicated `x` along `dim` (shape[dim] / C, positions `cp_positions`).

    Backward all-gathers the ranks' gradients back in sequence order (Megatron's conjugate of keeping
    a chunk). Raises ValueError naming both numbers when shape[dim] does not divide by C (2C with
    `load_balance`). With one rank: `x` itself."""
    if _size_rank(_group(axis))[0] == 1:
        return x
    return _Shard.apply(x, dim, axis, load_balance)


def cp_unshard(x: torch.Tensor, dim: int, axis: str, load_balance: bool) -> torch.Tensor:
    """The whole sequence along `dim` (shape[dim] * C, sequence order) from every rank's tokens as
    `cp_shard` cut them (all-gather). Backward keeps this rank's tokens of the gradient. With one
    rank: `x` itself."""
    if _size_rank(_group(axis))[0] == 1:
        return x
    return _Unshard.apply(x, dim, axis, load_balance)


# ---------------------------------------------------------------------------------------------
# Block attention in fp32 with its log-sum-exp, and the online-softmax merge


def _runs(pos: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive positions in ascending 1-D `pos`: (first index, end index, first
    position) each (a rank's head-tail chunks are two runs; the all-gathered sequence one)."""
    breaks = (torch.nonzero(pos[1:] - pos[:-1] != 1).flatten() + 1).tolist()
    edges = [0, *breaks, pos.numel()]
    return [(s, e, int(pos[s])) for s, e in zip(edges[:-1], edges[1:]) if e > s]


def _rectangles(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool) -> list[tuple[slice, slice, bool]]:
    """The visible (query, key) pairs of a block of queries at `qpos` over keys at `kpos` (both
    ascending 1-D global positions) as rectangles of (query rows, key columns, diagonal): each either
    wholly visible (False) or a square on the diagonal, queries and keys at the same positions, whose
    visible pairs are its lower triangle (True: a causal kernel call). They cover each visible pair
    once and no hidden one; a block wholly in the future has none. For a run of queries at positions
    a..b and one of keys at c..d: the keys before a are seen by every row, the keys in [max(a, c),
    min(b, d)] form the diagonal square, and the rows after it see all of its keys."""
    if not causal:
        return [(slice(0, qpos.numel()), slice(0, kpos.numel()), False)]
    found = []
    for qs, qe, a in _runs(qpos):
        b = a + (qe - qs) - 1
        for ks, ke, c in _runs(kpos):
            d = c + (ke - ks) - 1
            if c < a:  # keys before the run's first query: every row sees them
                found.append((slice(qs, qe), slice(ks, ks + min(d, a - 1) - c + 1), False))
            lo, hi = max(a, c), min(b, d)
            if lo <= hi:
                keys = slice(ks + lo - c, ks + hi - c + 1)
                found.append((slice(qs + lo - a, qs + hi - a + 1), keys, True))
                if hi < b:  # rows past the square's last key see all of its keys
                    found.append((slice(qs + hi - a + 1, qe), keys, False))
    return found


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H_kv, T, D) -> (B, H_kv * groups, T, D): KV head j serves query heads j*groups .. (j+1)*groups-1."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _kv_groups(q: torch.Tensor, k: torch.Tensor) -> int:
    """How many query heads each K/V head is expanded to before a block's kernel: 1 where the fused CPU
    kernel runs (it takes grouped K/V as they are, forward and backward: no copy of K/V at the query
    heads), H / H_kv for the PyTorch-op tiles."""
    return 1 if _fused(q) else q.shape[1] // k.shape[1]


def _reduce_heads(g: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_expand`: (B, H, T, D) -> (B, H / groups, T, D), summed over each group."""
    if groups == 1:
        return g
    b, h, t, d = g.shape
    return g.view(b, h // groups, groups, t, d).sum(2)


# The fused kernel a rectangle runs in on a CPU: torch's flash attention for CPU, which returns the
# log-sum-exp the merge needs and whose backward takes the merged output and log-sum-exp (as torch's
# own ring attention calls the fused kernels, torch/distributed/tensor/experimental/_attention.py).
# Elsewhere (no such kernel here), the PyTorch-op tiles of `_block_forward` / `_block_backward`.
FUSED_CPU_KERNEL = True


def _fused(q: torch.Tensor) -> bool:
    """Whether a rectangle on `q`'s device runs in the fused CPU kernel (`FUSED_CPU_KERNEL`)."""
    return FUSED_CPU_KERNEL and q.device.type == "cpu"


def _rect_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, diagonal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one `_rectangles` rectangle, q (B, H, Tq, D) over k, v (B, H, Tk, D), fp32
    (a diagonal one causal, Tq = Tk): (out (B, H, Tq, D), log-sum-exp of the scaled scores (B, H, Tq))."""
    if _fused(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, diagonal, scale=scale)
    return _block_forward(q, k, v, diagonal, scale)


def _rect_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    diagonal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of one rectangle's attention given the rows' *merged* output and
    log-sum-exp (B, H, Tq) over every key they see: the rectangle's probabilities are exp(S - lse) and
    delta = rowsum(dout * out), so each rectangle's share is exact on its own. fp32; shapes as
    `_rect_forward`'s."""
    if _fused(q):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, diagonal, scale=scale
        )
        return grads[0], grads[1], grads[2]
    return _block_backward(q, k, v, dout, lse, (dout * out).sum(-1), diagonal, scale)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qpos: torch.Tensor,
    kpos: torch.Tensor,
    causal: bool,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Merge into the running (out (B, H, Tq, D), lse (B, H, Tq)), in place, the attention of the
    queries q at `qpos` over the keys k, v at `kpos` (fp32; K/V at the query heads, or grouped where
    the fused CPU kernel runs: `_kv_groups`), one `_rectangles` rectangle at a time."""
    for rows, keys, diagonal in _rectangles(qpos, kpos, causal):
        block = _rect_forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], diagonal, scale)
        out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], *block)


def _attend_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    qpos: torch.Tensor,
    kpos: torch.Tensor,
    causal: bool,
    scale: float,
    dq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of `_attend` given the merged (out, lse): adds the queries' gradient into `dq` in
    place and returns (dk, dv) of these keys (fp32, shaped as k and v)."""
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    _sum_grads(
        _rectangles(qpos, kpos, causal),
        lambda rows, keys, diagonal: _rect_backward(
            q[:, :, rows], k[:, :, keys], v[:, :, keys], dout[:, :, rows], out[:, :, rows], lse[:, :, rows],
            diagonal, scale,
        ),
        dq, dk, dv,
    )  # fmt: skip
    return dk, dv


def _sum_grads(pieces: list[tuple[slice, slice, object]], grads_of, dq, dk, dv) -> None:
    """Add, in place, each (query rows, key columns, what else it needs) piece's gradients
    `grads_of(rows, keys, extra)` -> (dq, dk, dv) into dq[:, :, rows], dk and dv[:, :, keys]."""
    for rows, keys, extra in pieces:
        dq_p, dk_p, dv_p = grads_of(rows, keys, extra)
        dq[:, :, rows] += dq_p
        dk[:, :, keys] += dk_p
        dv[:, :, keys] += dv_p


def _tiles(n: int, size: int = SCORE_TILE) -> list[tuple[int, int]]:
    """[start, end) ranges of at most `size` covering 0 .. n."""
    return [(start, min(n, start + size)) for start in range(0, n, size)]


def _visible_tiles(tq: int, tk: int, diagonal: bool) -> list[tuple[slice, slice, torch.Tensor | None]]:
    """The (query slice, key slice, mask tile: True where visible, None when all are) of a (tq, tk)
    rectangle's tiles that some pair sees; `diagonal`: a causal square (row i sees keys 0 .. i)."""
    found = []
    for qs, qe in _tiles(tq):
        for ks, ke in _tiles(tk):
            if diagonal and ks > qe - 1:
                continue  # wholly in the future
            mask = None
            if diagonal and ke - 1 > qs:  # straddles the diagonal
                mask = torch.arange(ks, ke)[None, :] <= torch.arange(qs, qe)[:, None]
            found.append((slice(qs, qe), slice(ks, ke), mask))
    return found


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, diagonal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A rectangle's attention in PyTorch ops (`_rect_forward` where no fused kernel runs):
    `_tile_forward` over its (`SCORE_TILE` x `SCORE_TILE`) tiles, merged online (`_merge`), so one tile of
    scores is alive at a time (a long block's (Tq, Tk) scores would not fit: 4 heads x 64k x 64k in fp32
    are 64 GiB); tiles in the future skipped. Shapes and results as `_rect_forward`'s."""
    tiles = _visible_tiles(q.shape[2], k.shape[2], diagonal)
    if len(tiles) == 1:
        return _tile_forward(q, k, v, tiles[0][2], scale)
    # rows no visible tile reaches see no key of the block: output 0, log-sum-exp -inf
    out = q.new_zeros((*q.shape[:3], v.shape[3]))
    lse = q.new_full(q.shape[:3], float("-inf"))
    for rows, keys, m in tiles:
        tile = _tile_forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], m, scale)
        out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], *tile)
    return out, lse


def _tile_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q (B, H, Tq, D) over k, v (B, H, Tk, D), all fp32, `mask` (Tq, Tk) True
    where visible: (out (B, H, Tq, D), log-sum-exp of the scaled scores (B, H, Tq); -inf for a row
    that sees no key, whose out is 0)."""
    # one (B, H, Tq, Tk) block alive at a time: the scores become the probabilities in place (this runs
    # inside an autograd.Function, which records nothing)
    s = q @ k.transpose(-1, -2)
    s.mul_(scale)
    if mask is not None:
        s.masked_fill_(~mask.to(s.device), float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), 0.0, m)  # a row that sees no key: exp(-inf) = 0, lse -inf
    s.sub_(m).exp_()
    total = s.sum(dim=-1, keepdim=True)
    lse = (m + torch.log(total)).squeeze(-1)
    s.mul_(torch.where(total > 0, 1.0 / total, 0.0))
    return s @ v, lse


def _block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    diagonal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_tile_backward` over the rectangle's (`SCORE_TILE` x `SCORE_TILE`) tiles, the gradients summed
    (the final log-sum-exp makes each tile's probabilities exact on their own); delta = rowsum(dout *
    out) (B, H, Tq). Shapes as `_rect_backward`'s."""
    tiles = _visible_tiles(q.shape[2], k.shape[2], diagonal)
    if len(tiles) == 1:
        return _tile_backward(q, k, v, dout, lse, delta, tiles[0][2], scale)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    _sum_grads(
        tiles,
        lambda rows, keys, mask: _tile_backward(
            q[:, :, rows], k[:, :, keys], v[:, :, keys], dout[:, :, rows], lse[:, :, rows], delta[:, :, rows],
            mask, scale,
        ),
        dq, dk, dv,
    )  # fmt: skip
    return dq, dk, dv


def _tile_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of a block of attention whose merged output is known: the block's
    probabilities recomputed as exp(S - lse) with the *final* log-sum-exp (B, H, Tq), and
    delta = rowsum(dout * out) (B, H, Tq). All fp32; shapes as `_tile_forward`."""
    # two (B, H, Tq, Tk) blocks alive at a time (the probabilities, then their gradient), in place
    p = q @ k.transpose(-1, -2)
    p.mul_(scale)
    if mask is not None:
        p.masked_fill_(~mask.to(p.device), float("-inf"))
    p.sub_(lse.unsqueeze(-1)).exp_()
    dv = p.transpose(-1, -2) @ dout
    ds = dout @ v.transpose(-1, -2)
    ds.sub_(delta.unsqueeze(-1)).mul_(p)
    del p
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, dv


def _merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of a running result (out (..., T, D), lse (..., T)) with a block's over
    other keys of the same queries; fp32. Rows with lse = -inf (no key yet) take the block's."""
    m = torch.maximum(lse, block_lse)
    m = torch.where(torch.isinf(m), 0.0, m)  # both -inf: keep the row empty, not NaN
    w, w_b = torch.exp(lse - m), torch.exp(block_lse - m)
    total = w + w_b
    new_lse = m + torch.log(total)
    inv = torch.where(total > 0, 1.0 / total, 0.0)
    new_out = (out * w.unsqueeze(-1) + block_out * w_b.unsqueeze(-1)) * inv.unsqueeze(-1)
    return new_out, new_lse


# ---------------------------------------------------------------------------------------------
# Checks shared by the variants


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, load_balance: bool, variant: str) -> int:
    """Validate shapes; return the GQA group size H / H_kv."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"cp_attention_{variant} needs q (B, H, T, D) and k, v (B, H_kv, T, D) of one shape; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    b, h, t, d = q.shape
    if k.shape[0] != b or k.shape[2] != t or k.shape[3] != d or h % k.shape[1]:
        raise ValueError(
            f"cp_attention_{variant}: k, v {tuple(k.shape)} do not fit q {tuple(q.shape)} "
            "(same batch, local tokens and head dim; query heads a multiple of KV heads)"
        )
    if load_balance and t % 2:
        raise ValueError(
            f"cp_attention_{variant}: with load balancing a rank holds two equal chunks, "
            f"but it holds {t} tokens (odd)"
        )
    return h // k.shape[1]


def _sdpa(q, k, v, causal: bool, scale: float | None) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


# ---------------------------------------------------------------------------------------------
# Ring


def _pack(*ts: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    n = math.prod(shape)
    return buf[:n].view(shape), buf[n:].view(shape)


def _ring_exchange(send: torch.Tensor, group: dist.ProcessGroup, tag: int) -> tuple[torch.Tensor, list]:
    """Post the send of `send` to the next rank of the ring and the receive of an equal buffer from
    the previous one; (receive buffer, [works]) — wait on the works before reading the buffer."""
    size, rank = _size_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    recv = torch.empty_like(send)
    works = [dist.isend(send, nxt, group=group, tag=tag), dist.irecv(recv, prv, group=group, tag=tag)]
    return recv, works


def _keys_seen(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool) -> int:
    """How many leading keys of a block at (ascending) `kpos` some query at `qpos` sees: under a causal
    mask those up to the last query's position (0: the block is wholly in the future), else all."""
    return int(torch.searchsorted(kpos, qpos[-1], right=True)) if causal else kpos.numel()


def _kv_keys(
    k: torch.Tensor, v: torch.Tensor, start: int, stop: int, groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [start:stop] of k, v (B, H_kv, T, D) in fp32, each head repeated `groups` times
    (`_kv_groups`): 2 x (B, H_kv * groups, stop - start, D)."""
    return _expand(k[:, :, start:stop].float(), groups), _expand(v[:, :, start:stop].float(), groups)


def _block_kv(
    kv: torch.Tensor, shape: torch.Size, stop: int, groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_kv_keys` [:stop] of a packed K/V block (`_pack(k, v)`, each of `shape` (B, H_kv, T_l, D))."""
    return _kv_keys(*_unpack(kv, shape), 0, stop, groups)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


class _RingAttention(torch.autograd.Function):
    """Ring attention (module docstring): q (B, H, T_l, D), k, v (B, H_kv, T_l, D) -> (B, H, T_l, D)."""

    @staticmethod
    def forward(ctx, q, k, v, axis: str, causal: bool, load_balance: bool, scale: float):
        group = _group(axis)
        size, rank = _size_rank(group)
        groups = _kv_groups(q, k)
        seq_len = q.shape[2] * size
        qpos = cp_positions(seq_len, rank, size, load_balance)
        qf = q.float()
        out = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(qf.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = _pack(k, v)
        for i in range(size):
            src = (rank - i) % size
            if i < size - 1:
                with record_function(f"cp.ring.forward.issue.{i}"):
                    nxt, works = _ring_exchange(kv, group, _KV_TAG)
            kpos = cp_positions(seq_len, src, size, load_balance)
            stop = _keys_seen(qpos, kpos, causal)
            if stop:
                with record_function(f"cp.ring.forward.compute.{i}"):
                    kb, vb = _block_kv(kv, k.shape, stop, groups)
                    _attend(qf, kb, vb, qpos, kpos[:stop], causal, scale, out, lse)
            if i < size - 1:
                with record_function(f"cp.ring.forward.wait.{i}"):
                    _wait(works)
                kv = nxt
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.axis, ctx.causal, ctx.load_balance, ctx.scale = axis, causal, load_balance, scale
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group = _group(ctx.axis)
        size, rank = _size_rank(group)
        groups = _kv_groups(q, k)
        seq_len = q.shape[2] * size
        qpos = cp_positions(seq_len, rank, size, ctx.load_balance)
        qf, doutf, outf = q.float(), dout.float(), out.float()
        dq = torch.zeros_like(qf)
        kv = _pack(k, v)
        dkv_in, dkv_works, sent = None, [], []
        for i in range(size):
            src = (rank - i) % size
            if i < size - 1:
                with record_function(f"cp.ring.backward.issue.{i}"):
                    nxt, works = _ring_exchange(kv, group, _KV_TAG)
            dk_b = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv_b = torch.zeros_like(dk_b)
            kpos = cp_positions(seq_len, src, size, ctx.load_balance)
            stop = _keys_seen(qpos, kpos, ctx.causal)
            if stop:
                with record_function(f"cp.ring.backward.compute.{i}"):
                    kb, vb = _block_kv(kv, k.shape, stop, groups)
                    dk_r, dv_r = _attend_backward(
                        qf, kb, vb, doutf, outf, lse, qpos, kpos[:stop], ctx.causal, ctx.scale, dq
                    )
                    dk_b[:, :, :stop] = _reduce_heads(dk_r, groups)
                    dv_b[:, :, :stop] = _reduce_heads(dv_r, groups)
            with record_function(f"cp.ring.backward.wait_grad.{i}"):
                _wait(dkv_works)  # the accumulator of this block from the previous rank (and our last send)
            acc = _pack(dk_b, dv_b)
            if dkv_in is not None:
                acc += dkv_in
            with record_function(f"cp.ring.backward.issue_grad.{i}"):
                dkv_in, dkv_works = _ring_exchange(acc, group, _DKV_TAG)
                sent = [acc]  # keep the sent buffer alive until its send completes
            if i < size - 1:
                with record_function(f"cp.ring.backward.wait.{i}"):
                    _wait(works)
                kv = nxt
        with record_function("cp.ring.backward.wait_grad.home"):
            _wait(dkv_works)  # this rank's own block's dK/dV, summed over every rank's queries
        del sent
        dk, dv = _unpack(dkv_in, k.shape)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


# ---------------------------------------------------------------------------------------------
# All-gather


def _gather_kv(k: torch.Tensor, v: torch.Tensor, axis: str, size: int, load_balance: bool) -> torch.Tensor:
    """(T, 2, B, H_kv, D) fp-as-given: every rank's K and V in sequence order (one all-gather)."""
    local = torch.stack([k, v]).permute(3, 0, 1, 2, 4).contiguous()  # (T_l, 2, B, H_kv, D)
    return _to_sequence_order(_all_gather(local, 0, axis), 0, size, load_balance)


def _whole_kv(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, 2, B, H_kv, D) -> k, v (B, H_kv, T, D)."""
    full = kv.permute(1, 2, 3, 0, 4)
    return full[0], full[1]


class _AllGatherAttention(torch.autograd.Function):
    """All-gather attention (module docstring): q (B, H, T_l, D), k, v (B, H_kv, T_l, D) -> (B, H, T_l, D)."""

    @staticmethod
    def forward(ctx, q, k, v, axis: str, causal: bool, load_balance: bool, scale: float):
        size, rank = _size_rank(_group(axis))
        groups = _kv_groups(q, k)
        seq_len = q.shape[2] * size
        with record_function("cp.allgather.forward.gather"):
            kf, vf = _whole_kv(_gather_kv(k, v, axis, size, load_balance))
        qpos = cp_positions(seq_len, rank, size, load_balance)
        stop = _keys_seen(qpos, torch.arange(seq_len), causal)  # > 0: a query sees itself
        with record_function("cp.allgather.forward.compute"):
            # one rank's share of the keys at a time (merged online): their fp32 copy (expanded to the
            # query heads where the PyTorch-op tiles run) is a share's, not the whole sequence's
            qf = q.float()
            out = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
            lse = torch.full(qf.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
            for start, end in _tiles(stop, q.shape[2]):
                kb, vb = _kv_keys(kf, vf, start, end, groups)
                _attend(qf, kb, vb, qpos, torch.arange(start, end), causal, scale, out, lse)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.axis, ctx.causal, ctx.load_balance, ctx.scale = axis, causal, load_balance, scale
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        size, rank = _size_rank(_group(ctx.axis))
        groups = _kv_groups(q, k)
        seq_len = q.shape[2] * size
        with record_function("cp.allgather.backward.gather"):
            kf, vf = _whole_kv(_gather_kv(k, v, ctx.axis, size, ctx.load_balance))
        qpos = cp_positions(seq_len, rank, size, ctx.load_balance)
        stop = _keys_seen(qpos, torch.arange(seq_len), ctx.causal)
        doutf, outf = dout.float(), out.float()
        dkv = torch.zeros((seq_len, 2, *k.shape[:2], k.shape[3]), dtype=torch.float32, device=k.device)
        with record_function("cp.allgather.backward.compute"):
            qf = q.float()
            dq = torch.zeros_like(qf)
            for start, end in _tiles(stop, q.shape[2]):  # as in forward
                kb, vb = _kv_keys(kf, vf, start, end, groups)
                dk_c, dv_c = _attend_backward(
                    qf, kb, vb, doutf, outf, lse, qpos, torch.arange(start, end), ctx.causal, ctx.scale, dq
                )
                dkv[start:end, 0] = _reduce_heads(dk_c, groups).permute(2, 0, 1, 3)
                dkv[start:end, 1] = _reduce_heads(dv_c, groups).permute(2, 0, 1, 3)
        with record_function("cp.allgather.backward.reduce_scatter"):
            local = _reduce_scatter(_to_rank_order(dkv, 0, size, ctx.load_balance), 0, ctx.axis)
        dk, dv = local.permute(1, 2, 3, 0, 4)  # (T_l, 2, B, H_kv, D) -> 2 x (B, H_kv, T_l, D)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


# ---------------------------------------------------------------------------------------------
# All-to-all (Ulysses)


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(C, ...) -> (C, ...): slot j is sent to rank j; slot j of the result came from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, axis: str, load_balance: bool) -> torch.Tensor:
    """(B, H, T_l, D) this rank's tokens, all heads -> (B, H / C, T, D) every token (sequence order),
    this rank's C-th of the heads."""
    group = _group(axis)
    size, _ = _size_rank(group)
    b, h, t, d = x.shape
    slots = x.reshape(b, size, h // size, t, d).transpose(0, 1)  # (C, B, H/C, T_l, D): slot j for rank j
    got = _all_to_all(slots, group)  # slot j: rank j's tokens of our heads
    whole = got.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * t, d)  # rank order
    return _to_sequence_order(whole, 2, size, load_balance)


def _heads_to_seq(x: torch.Tensor, axis: str, load_balance: bool) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: (B, H / C, T, D) -> (B, H, T / C, D)."""
    group = _group(axis)
    size, _ = _size_rank(group)
    b, hl, t, d = x.shape
    ranked = _to_rank_order(x, 2, size, load_balance)
    slots = ranked.reshape(b, hl, size, t // size, d).permute(2, 0, 1, 3, 4)  # slot j: rank j's tokens
    got = _all_to_all(slots, group)  # slot j: rank j's heads of our tokens
    return got.transpose(0, 1).reshape(b, size * hl, t // size, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: str, load_balance: bool) -> torch.Tensor:
        ctx.axis, ctx.load_balance = axis, load_balance
        with record_function("cp.alltoall.seq_to_heads"):
            return _seq_to_heads(x, axis, load_balance)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with record_function("cp.alltoall.heads_to_seq"):
            return _heads_to_seq(grad, ctx.axis, ctx.load_balance), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: str, load_balance: bool) -> torch.Tensor:
        ctx.axis, ctx.load_balance = axis, load_balance
        with record_function("cp.alltoall.heads_to_seq"):
            return _heads_to_seq(x, axis, load_balance)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with record_function("cp.alltoall.seq_to_heads"):
            return _seq_to_heads(grad, ctx.axis, ctx.load_balance), None, None


# ---------------------------------------------------------------------------------------------
# Public attention functions


def cp_attention_ring(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    axis: str,
    *,
    causal: bool,
    load_balance: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """Ring attention over the CP ranks of `axis`: q (B, H, T_l, D), k, v (B, H_kv, T_l, D), this
    rank's tokens as `cp_shard` cut them (H a multiple of H_kv) -> this rank's (B, H, T_l, D) rows of
    SDPA over the whole sequence (T = T_l * C), differentiable in q, k, v. K/V blocks travel round the
    ring peer to peer while each block's attention is computed; merged by the online-softmax rule;
    fp32 inside. `scale` defaults to 1/sqrt(D). With one rank: plain SDPA.

    Raises ValueError for mismatched shapes, or an odd T_l with `load_balance`."""
    _check(q, k, v, load_balance, "ring")
    size, _ = _size_rank(_group(axis))
    if size == 1:
        return _sdpa(q, k, v, causal, scale)
    return _RingAttention.apply(q, k, v, axis, causal, load_balance, _scale(q, scale))


def cp_attention_allgather(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    axis: str,
    *,
    causal: bool,
    load_balance: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """All-gather attention (Llama 3's): K/V all-gathered over the CP ranks of `axis`, this rank's
    queries over the whole sequence with the causal mask by global positions. Shapes, result and
    errors as `cp_attention_ring`; backward all-gathers K/V again and reduce-scatters dK/dV."""
    _check(q, k, v, load_balance, "allgather")
    size, _ = _size_rank(_group(axis))
    if size == 1:
        return _sdpa(q, k, v, causal, scale)
    return _AllGatherAttention.apply(q, k, v, axis, causal, load_balance, _scale(q, scale))


def cp_attention_alltoall(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    axis: str,
    *,
    causal: bool,
    load_balance: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """Ulysses attention (DeepSpeed-Ulysses): all-to-all q, k, v from (this rank's tokens, all heads)
    to (whole sequence, H / C and H_kv / C heads), plain SDPA, all-to-all back. Shapes and result as
    `cp_attention_ring`; backward through the reversed all-to-alls and SDPA's backward.

    Raises ValueError when H or H_kv does not divide by C (naming both head counts, C and the
    variants that would work), and as `cp_attention_ring`."""
    _check(q, k, v, load_balance, "alltoall")
    size, _ = _size_rank(_group(axis))
    if size == 1:
        return _sdpa(q, k, v, causal, scale)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % size or kv_heads % size:
        raise ValueError(
            f"cp_attention_alltoall (Ulysses) splits the heads over the {size} CP ranks, but the "
            f"{heads} query heads and {kv_heads} KV heads do not both divide by {size}; "
            "use cp_attention_ring or cp_attention_allgather, which work for any head count"
        )
    qh, kh, vh = (_SeqToHeads.apply(t, axis, load_balance) for t in (q, k, v))
    return _HeadsToSeq.apply(_sdpa(qh, kh, vh, causal, scale), axis, load_balance)


_VARIANTS = {
    "ring": cp_attention_ring,
    "allgather": cp_attention_allgather,
    "alltoall": cp_attention_alltoall,
}


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    axis: str,
    *,
    variant: str,
    causal: bool,
    load_balance: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """`cp_attention_<variant>` for `variant` in `CP_VARIANTS`; ValueError naming them otherwise."""
    if variant not in _VARIANTS:
        raise ValueError(
            f"unknown context-parallel attention variant {variant!r}; one of {', '.join(CP_VARIANTS)}"
        )
    return _VARIANTS[variant](q, k, v, axis, causal=causal, load_balance=load_balance, scale=scale)

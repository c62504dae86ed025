"""Context-parallel attention: compute, communication and buffers of one attention core on one rank.

Under context parallelism (CP) over C ranks every sequence's T tokens are split over the ranks
(T_l = T / C each) for the whole layer; attention needs every rank's keys and values. The three
variants `passes.context_parallel` runs, priced per micro-batch on one rank as its module docstring's
cost table says (b = bytes per element, KV = 2 B H_kv T_l D b one rank's K and V, Q = B H T_l D b one
rank's q or out, F = the whole sequence's attention FLOP):

| variant   | attention compute (busiest rank)        | communication                                    |
|-----------|-----------------------------------------|--------------------------------------------------|
| ring      | C kernel calls, one per K/V block:      | forward: C-1 sends of KV to the next rank, each  |
|           | F / C^2 each load-balanced (the own     | under its step's block attention (exposed: the   |
|           | block causal, the others one chunk x    | part the block does not cover); backward: KV     |
|           | block, unmasked); contiguous: full      | again and the fp32 dK/dV accumulators (KV 4 / b) |
|           | blocks of 2F / C^2                      | one step behind, the last one exposed            |
| allgather | local queries over the whole K/V:       | forward: all-gather of (C-1) KV, exposed;        |
|           | F / C load-balanced, (2C-1) F / C^2     | backward: all-gather again and reduce-scatter of |
|           | contiguous                              | dK/dV in fp32, exposed                           |
| alltoall  | the whole sequence over H / C heads:    | forward: all-to-alls of q, k, v, out ((C-1)/C of |
|           | F / C (whatever the layout)             | 2Q + KV sent), exposed; backward the same four   |

Load balancing (each rank holds one early and one late chunk of 2C) gives every rank F / C of the
causal work; without it rank C-1 does (2C-1) / C^2 of F, which bounds the step. Ulysses (alltoall)
needs the query and KV heads a rank holds to divide by C (`ulysses_refusal`).

Memory in flight for the layer being computed (`CpAttentionCost.buffer_bytes`): ring two K/V blocks
(the one computed, the one arriving), training also two fp32 dK/dV accumulators; all-gather the whole
sequence's K/V, training also its fp32 dK/dV before the reduce-scatter; on GPUs both also the fp32
score tiles the runtime computes their attention in (`score_block_bytes`: on CPU ranks each block runs
in torch's fused flash kernel for CPU, which holds none); all-to-all q, k, v and out in the (whole
sequence, H / C heads) layout, training also their gradients.

The ring's overlap follows Liu, Zaharia, Abbeel 2023 ("Ring Attention with Blockwise Transformers",
section 3: a block's transfer is hidden when its attention takes at least as long) and Megatron-Core /
Transformer Engine's p2p CP; the all-gather's exposure follows Dubey et al. 2024 ("The Llama 3 Herd of
Models", section 3.3.2: "the all-gather communication latency is exposed in the critical path");
Ulysses: Jacobs et al. 2023 ("DeepSpeed Ulysses", section 3: four all-to-alls per attention forward).
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodels import compute
from costmodels.cluster import ClusterSpec
from costmodels.comm import (
    Group,
    all_gather_time_s,
    all_to_all_time_s,
    burst_cluster,
    p2p_time_s,
    reduce_scatter_time_s,
)
from costmodels.dtypes import DTYPE_BYTES

CP_GRAD_BYTES = (
    4  # dK/dV accumulate in fp32 across ranks (Transformer Engine's p2p CP, passes.context_parallel)
)


@dataclass(frozen=True)
class CpAttentionShape:
    """One attention core on one rank of a tensor-parallel group, before the CP split."""

    sequences: float  # sequences per micro-batch the CP group shares (B)
    heads: float  # query heads on this rank (H / tp when head-parallel)
    kv_heads: float  # key/value heads on this rank
    head_dim: int  # D
    seq_len: int  # tokens per sequence, whole (T)
    causal: bool  # a causal mask (load balancing matters only then)


@dataclass(frozen=True)
class CpAttentionCost:
    """An attention core under context parallelism on its busiest rank, per micro-batch (seconds,
    bytes); training times are forward + backward."""

    compute_s: float  # the core's kernels
    forward_s: float  # the forward kernels alone (what recomputation reruns)
    exposed_s: float  # CP communication the rank waits for
    hidden_s: float  # CP communication hidden behind the blocks' attention (ring)
    buffer_bytes: float  # K/V (and gradient) buffers in flight while the layer computes
    kv_block_bytes: float  # one rank's K and V (KV of the table)


def ulysses_refusal(heads: float, kv_heads: float, cp: int) -> str | None:
    """Why all-to-all (Ulysses) cannot split these heads over `cp` ranks (each rank takes whole query
    and KV heads), naming both numbers and the variants that work; None when it can."""
    bad = [(what, n) for what, n in (("query heads", heads), ("KV heads", kv_heads)) if n % cp]
    if not bad:
        return None
    what, n = bad[0]
    return (
        f"alltoall (Ulysses) splits heads over the cp ranks: {heads:g} query / {kv_heads:g} KV heads per rank, "
        f"and {n:g} {what} do not divide by cp={cp}; ring or allgather split the sequence instead"
    )


def load_balanced_work_fraction(cp: int, causal: bool, load_balance: bool) -> float:
    """Share of the whole sequence's attention FLOP the busiest of `cp` ranks computes: 1 / cp with
    load balancing or without a causal mask; (2 cp - 1) / cp^2 for contiguous shards under a causal
    mask (rank cp-1's queries see (2 cp - 1) / 2 cp of the keys on average)."""
    if not causal or load_balance:
        return 1.0 / cp
    return (2 * cp - 1) / cp**2


def cp_attention_cost(
    shape: CpAttentionShape,
    cp: int,
    comm_type: str,
    load_balance: bool,
    cluster: ClusterSpec,
    group: Group,
    dtype: str,
    backward_factor: float,
    call: tuple | None = None,
) -> CpAttentionCost:
    """Compute, communication and buffers of one attention core split over `cp` ranks (`group`: their
    place on the nodes) with variant `comm_type` ("ring" | "allgather" | "alltoall"), as the module
    docstring prices them. `backward_factor`: backward time / forward time of the kernel (0: inference,
    no backward). `call`: the key of `DeviceSpec.attention_time_ratios` whose measured ratio scales
    every kernel of the core (a CPU's timing of the rank's own block, `costmodels.compute.op_time_s`).
    Raises ValueError for another variant or an all-to-all the heads cannot take."""
    if comm_type not in ("ring", "allgather", "alltoall"):
        raise ValueError(f"unknown context-parallel variant {comm_type!r}")
    b = DTYPE_BYTES[dtype]
    train = backward_factor > 0
    seqs, h, kv, d, t = shape.sequences, shape.heads, shape.kv_heads, shape.head_dim, shape.seq_len
    t_l = t / cp
    kv_bytes = 2.0 * seqs * kv * t_l * d * b  # one rank's K and V
    q_bytes = seqs * h * t_l * d * b
    grad = CP_GRAD_BYTES / b

    def kernel_s(
        flops: float, q_len: float, k_len: float, masked: bool, split: int = 1
    ) -> tuple[float, float]:
        """(forward, backward) seconds of one fused kernel: `q_len` queries over `k_len` keys, on
        1 / `split` of the rank's heads."""
        moved = compute.attention_bytes(seqs, h / split, kv / split, q_len, k_len, d, dtype)
        launch = cluster.device.node_overhead_s is None
        blocks = compute.attention_blocks(seqs, h / split, q_len, d)  # the rank's query blocks' waves
        fwd = compute.op_time_s(
            flops,
            moved,
            cluster.device,
            dtype,
            "attention",
            launch=launch,
            seq=(q_len, k_len, masked, blocks),
            call=call,
        )
        return fwd, fwd * backward_factor

    if comm_type == "ring":
        return _ring(shape, cp, load_balance, cluster, group, kv_bytes, grad, train, kernel_s)
    if comm_type == "allgather":
        whole = compute.attention_flops(seqs, h, t_l, t, d, causal=False)  # every key, unmasked
        flops = whole * cp * load_balanced_work_fraction(cp, shape.causal, load_balance)
        if shape.causal:
            flops /= 2.0  # the causal half of the (T_l, T) rectangle: F / C balanced
        fwd, bwd = kernel_s(flops, t_l, t, shape.causal)
        comm = all_gather_time_s(cp * kv_bytes, group, cluster)
        if train:
            comm += all_gather_time_s(cp * kv_bytes, group, cluster)
            comm += reduce_scatter_time_s(cp * kv_bytes * grad, group, cluster)
        buffers = cp * kv_bytes * (1.0 + (grad if train else 0.0))
        buffers += score_block_bytes(seqs, h, t_l, t_l, train, cluster)  # one rank's share of keys at a time
        return CpAttentionCost(fwd + bwd, fwd, comm, 0.0, buffers, kv_bytes)
    refusal = ulysses_refusal(h, kv, cp)
    if refusal is not None:
        raise ValueError(refusal)
    flops = compute.attention_flops(seqs, h / cp, t, t, d, shape.causal)
    fwd, bwd = kernel_s(flops, t, t, shape.causal, split=cp)
    # q, k, v (backward: dq, dk, dv) go back to back: the first at the link's latency, the other two at
    # its burst latency (`comm.burst_cluster`); the output's (backward: dout's) all-to-all comes alone
    burst = burst_cluster(cluster)
    one_pass = 2 * all_to_all_time_s(q_bytes, group, cluster) + 2 * all_to_all_time_s(
        kv_bytes / 2, group, burst
    )
    comm = one_pass * (2 if train else 1)
    buffers = (2 * q_bytes + kv_bytes) * (2 if train else 1)
    return CpAttentionCost(fwd + bwd, fwd, comm, 0.0, buffers, kv_bytes)


def _ring(shape, cp, load_balance, cluster, group, kv_bytes, grad, train, kernel_s) -> CpAttentionCost:
    """Ring attention: C steps, step i's K/V transfer (and, backward, the dK/dV accumulator one step
    behind) under step i's block attention (`ClusterSpec.overlap_efficiency` of it hides traffic); the
    last accumulator's transfer exposed."""
    seqs, h, d, t_l = shape.sequences, shape.heads, shape.head_dim, shape.seq_len / cp
    diagonal = compute.attention_flops(seqs, h, t_l, t_l, d, shape.causal)
    diag_fwd, diag_bwd = kernel_s(diagonal, t_l, t_l, shape.causal)  # step 0: the rank's own block
    if shape.causal and load_balance:  # steps 1 .. C-1: one chunk of T / 2C by a block of T / C, unmasked
        rest_fwd, rest_bwd = kernel_s(compute.attention_flops(seqs, h, t_l / 2, t_l, d), t_l / 2, t_l, False)
    else:  # a whole block (contiguous: the busiest rank's past blocks; no mask: every block)
        rest_fwd, rest_bwd = kernel_s(compute.attention_flops(seqs, h, t_l, t_l, d), t_l, t_l, False)
    inter = group.num_nodes > 1
    eta = cluster.overlap_efficiency

    def send_s(nbytes: float) -> float:
        return p2p_time_s(nbytes, cluster, inter)

    # (transfer, the compute it runs under, how many such steps): forward, K/V of steps 0 .. C-2;
    # backward, K/V of steps 0 .. C-2 and the accumulator of steps 1 .. C-1 (one step behind)
    kv_s = send_s(kv_bytes)
    transfers = [(kv_s, diag_fwd, 1), (kv_s, rest_fwd, cp - 2)]
    if train:
        transfers += [(kv_s, diag_bwd, 1), (send_s(kv_bytes * (1 + grad)), rest_bwd, cp - 2)]
        transfers += [(send_s(kv_bytes * grad), rest_bwd, 1)]
    exposed = hidden = 0.0
    for total, cover, count in transfers:
        shown = max(0.0, total - eta * cover)
        exposed += count * shown
        hidden += count * (total - shown)
    if train:
        exposed += send_s(kv_bytes * grad)  # the last accumulator home, after the last block
    forward = diag_fwd + (cp - 1) * rest_fwd
    compute_s = forward + diag_bwd + (cp - 1) * rest_bwd
    buffers = 2 * kv_bytes * (1.0 + (grad if train else 0.0)) + score_block_bytes(
        seqs, h, t_l, t_l, train, cluster
    )
    return CpAttentionCost(compute_s, forward, exposed, hidden, buffers, kv_bytes)


# queries and keys per fp32 score tile the runtime's ring and all-gather attention computes at once
# where no fused kernel runs (`passes.context_parallel._block_forward`)
SCORE_TILE = 1024


def score_block_bytes(
    sequences: float, heads: float, q_len: float, k_len: float, train: bool, cluster: ClusterSpec
) -> float:
    """Bytes of the fp32 (sequences, heads, q_len, k_len) score blocks the runtime's ring and all-gather
    attention holds at once (the all-gather's over one rank's share of the keys at a time).

    On CPU ranks (backend gloo) each block runs in torch's fused flash attention kernel for CPU
    (`passes.context_parallel.FUSED_CPU_KERNEL`), which works on per-thread tiles of at most 256 x 512
    scores: none priced (measured: 0.14 and 0.16 of a (1, 8, 512, 512) fp32 block forward and
    backward, against 1.07 and 2.13 for the PyTorch-op tiles; tests/test_context_parallel.py). Elsewhere
    the blocks run in PyTorch ops (`passes.context_parallel._block_forward` / `_block_backward`: the
    scores become the probabilities in place, and the backward also holds their gradient): one block in
    a forward, two in a backward, a block longer than `SCORE_TILE` queries or keys a tile at a time.
    Measured: a tiny Llama at CP 2, 8 x 1,024 tokens, 8 heads, held 4 such 64 MiB blocks at once before
    they were made in place (2026-12)."""
    if cluster.backend == "gloo":
        return 0.0
    tile = min(q_len, SCORE_TILE) * min(k_len, SCORE_TILE)
    return 4.0 * sequences * heads * tile * (2 if train else 1)

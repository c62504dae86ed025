"""``planner calibrate`` on CUDA: time what the plans price, and fit the spec's fields to it.

Three measurements, each timed with CUDA events (``torch.cuda.Event(enable_timing=True)``) after a
warm-up, the median of several repetitions (`event_median_s`), all ranks at once:

1. GEMMs in bf16 at a standard sweep of (M, N, K) (`GEMM_SWEEP_SHAPES`: K from 256 to 16384 at
   M = N = 8192, squares, few rows, the projections of an 8B-class transformer) and a model's own
   shapes when given (`planner.solver.costing.model_matmul_shapes`); fitted by `fit_gemm` to the
   parameters of the existing model, `costmodels.compute.gemm_efficiency` (``device.gemm``):
   ``efficiency`` and ``half_k``, with ``sms`` from the device's properties and the tiles of the
   Hopper presets. Fitted rather than recorded point by point because a plan prices every shape of
   every model at every TP degree and micro-batch, nearly all of them unmeasured: a four-parameter
   quantization model fitted to ~20 points carries over to them, a table would not (the measured
   points and the fit's largest error are written into ``sources``).
2. Fused attention, ``scaled_dot_product_attention`` in bf16 at key lengths `ATTENTION_LENGTHS`,
   causal and unmasked forwards and the causal backward, without and with dropout on the
   probabilities; fitted by `fit_attention` to ``device.attention`` (``efficiency``, ``half_seq``,
   ``causal_half_seq``, ``backward_time_factor``, ``dropout_time_factor``).
3. Decode attention, as a static-cache model calls it (`time_decode_attention`: one query token, a
   boolean mask over the cache, grouped K / V) at batch 1 with `DECODE_HEADS` query heads over
   `DECODE_KV_LEN` tokens: fitted by `fit_decode_attention` to ``device.decode_attention`` when the
   kernel runs far slower than reading the cache (one block per sequence and query head, the cache
   not split), and left out when it runs near the bandwidth (a kernel that splits the cache).
4. NCCL all-reduce, all-gather and reduce-scatter from 8 B to 1 GiB (`COLLECTIVE_SIZES_BYTES`: 8 B x
   4^k and 1 GiB) per group: the ranks of one node (``links.intra_node``) and, under torchrun across
   nodes, the whole world (``links.inter_node``). Each point is a loop of back-to-back collectives
   between two events (nccl-tests' convention: time per operation in steady state), reported as
   nccl-tests reports it (`nccl_tests_bandwidths`: algbw = bytes / time; busbw = algbw x 2(n-1)/n
   for all-reduce, (n-1)/n for all-gather / reduce-scatter; bytes = the full tensor), and fitted by
   `fit_link` to the link's ``latency_us`` / ``bandwidth_GBps`` through the very functions that
   price collectives (`costmodels.comm`), so the spec reproduces what was measured under the model
   the planner uses. The fit holds the busbw at sizes >= `LARGE_BYTES` within `BUSBW_TOLERANCE` and
   the time at sizes <= `SMALL_BYTES` within `SMALL_TIME_TOLERANCE`; a fit outside either says so
   in the spec's ``sources`` (`LinkFit.source`).

The timers sit behind `EventTimer` (``mark()``, ``seconds(start, end)``): `CudaEventTimer` on a GPU,
`WallTimer` for CPU tensors (synchronous ops), so the measurement code runs on CPU in the tests; the
fits are pure functions of the measured points.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from costmodels.cluster import AttentionSpec, ClusterSpec, DecodeAttentionSpec, GemmSpec
from costmodels.comm import Group, all_gather_time_s, all_reduce_time_s, reduce_scatter_time_s
from costmodels.compute import attention_flops, decode_attention_sm_bytes, gemm_efficiency
from costmodels.dtypes import torch_dtype

# (M, N, K) of the standard sweep, bf16: K at M = N = 8192 (the tile loop's fill), squares (waves),
# few rows (tile fill, split-K) and an 8B-class transformer's projections at 4096 tokens (hidden
# 4096, 8 KV heads of 128, MLP 14336, vocabulary 128256)
GEMM_SWEEP_SHAPES: tuple[tuple[int, int, int], ...] = (
    *((8192, 8192, k) for k in (256, 512, 1024, 2048, 4096, 8192, 16384)),
    *((s, s, s) for s in (512, 1024, 2048, 4096)),
    *((m, 8192, 8192) for m in (64, 256, 1024)),
    (4096, 4096, 4096),  # attention q / o projection
    (4096, 1024, 4096),  # k / v projection (8 KV heads x 128)
    (4096, 14336, 4096),  # MLP up / gate
    (4096, 4096, 14336),  # MLP down
    (4096, 128256, 4096),  # LM head
)
# the output tiles of the Hopper presets (dgx-h100.yaml: cuBLAS / CUTLASS wgmma tiles) and their
# smallest split-K slice: what `fit_gemm` keeps fixed while fitting efficiency and half_k
HOPPER_TILES: tuple[tuple[int, int], ...] = ((128, 256), (256, 128), (128, 128), (64, 256))
MIN_SPLIT_K = 256.0
ATTENTION_LENGTHS = (512, 1024, 2048, 4096, 8192)  # key lengths (= query lengths) timed
ATTENTION_HEADS, ATTENTION_HEAD_DIM = 32, 128  # as the presets' published tables (head dim 128)
ATTENTION_TOKENS = 32768  # batch x length at each length (batch = tokens // length, at least 1)
# attention dropout timed for `AttentionSpec.dropout_time_factor`: Megatron-LM's --attention-dropout default
ATTENTION_DROPOUT_P = 0.1
# the presets' ratio of the causal and unmasked half lengths (dgx-h100.yaml, FlashAttention-4's
# table): used for half_seq when only causal points were measured
CAUSAL_HALF_RATIO = 5.6
# decode attention timed at batch 1: a TP rank's share of an 8B-class model's heads (32 query / 8 KV
# heads at TP4) over a long cache, so that one block per (sequence, query head) leaves most SMs idle
DECODE_HEADS, DECODE_KV_HEADS, DECODE_KV_LEN = 8, 2, 16384
# a decode kernel within this factor of the bandwidth's time splits the cache: no decode_attention
SPLIT_KERNEL_FACTOR = 2.0
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter")
COLLECTIVE_SIZES_BYTES: tuple[int, ...] = (*(8 * 4**i for i in range(14)), 2**30)  # 8 B ... 512 MiB, 1 GiB
LARGE_BYTES = 64 * 2**20  # the busbw is held at sizes from here up
SMALL_BYTES = 64 * 2**10  # the time is held at sizes up to here
BUSBW_TOLERANCE = 0.10  # |fitted busbw / measured - 1| at large sizes
SMALL_TIME_TOLERANCE = 0.25  # |fitted time / measured - 1| at small sizes
# a square GEMM timed in each dtype: the fp16 and fp32 peaks are the bf16 peak (from the sweep's
# fastest, `apply_cuda_measurements`) times their square rate over bf16's (fp32 runs on other units: its own rate, as torch runs it)
SQUARE_SHAPE = (4096, 4096, 4096)
SQUARE_DTYPES = ("bf16", "fp16", "fp32")
WARMUP, REPS = 3, 7  # warm-up calls, then timed repetitions (median taken)
_MIN_WINDOW_S = 1e-3  # a timed window holds enough calls to last about this long (event resolution)
_MAX_INNER = 200


# --------------------------------------------------------------------------------------------
# timers


class EventTimer(Protocol):
    """Marks on the device's timeline and the seconds between two of them."""

    def mark(self) -> object: ...

    def seconds(self, start: object, end: object) -> float:
        """Seconds from ``start`` to ``end``, waiting for ``end`` to complete."""
        ...


class CudaEventTimer:
    """CUDA events on the current stream (``torch.cuda.Event(enable_timing=True)``)."""

    def mark(self) -> object:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: object, end: object) -> float:
        end.synchronize()  # type: ignore[attr-defined]
        return start.elapsed_time(end) / 1e3  # type: ignore[attr-defined]  # ms -> s


class WallTimer:
    """Wall time: for CPU tensors, whose ops complete before they return."""

    def mark(self) -> object:
        return time.perf_counter()

    def seconds(self, start: object, end: object) -> float:
        return float(end) - float(start)  # type: ignore[arg-type]


def event_median_s(
    fn: Callable[[], object],
    timer: EventTimer,
    warmup: int = WARMUP,
    reps: int = REPS,
    inner: int | None = None,
) -> float:
    """Seconds per call of ``fn``: ``warmup`` untimed calls, then ``reps`` windows of ``inner`` calls
    each between two marks; the median window over ``inner``. ``inner`` None: as many calls as make a
    window last about `_MIN_WINDOW_S` (from the first window of one call), at most `_MAX_INNER`."""
    for _ in range(warmup):
        fn()
    if inner is None:
        start = timer.mark()
        fn()
        one = timer.seconds(start, timer.mark())
        inner = int(min(_MAX_INNER, max(1, math.ceil(_MIN_WINDOW_S / max(one, 1e-9)))))
    windows = []
    for _ in range(reps):
        start = timer.mark()
        for _ in range(inner):
            fn()
        windows.append(timer.seconds(start, timer.mark()) / inner)
    return statistics.median(windows)


def agreed_inner(fn: Callable[[], object], timer: EventTimer, group: object | None = None) -> int:
    """`event_median_s`'s calls per window, the same on every rank of ``group`` (the largest): a
    collective must be called equally often everywhere."""
    fn()
    start = timer.mark()
    fn()
    one = timer.seconds(start, timer.mark())
    inner = float(min(_MAX_INNER, max(1, math.ceil(_MIN_WINDOW_S / max(one, 1e-9)))))
    if dist.is_available() and dist.is_initialized():
        t = torch.tensor([inner], dtype=torch.float64, device=_group_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        inner = t.item()
    return int(inner)


def _group_device(group: object | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------
# measurements (device-agnostic given a timer)


@dataclass(frozen=True)
class GemmPoint:
    """An (m, k) @ (k, n) GEMM that took ``time_s``."""

    m: int
    n: int
    k: int
    time_s: float

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


def time_gemms(
    shapes: Sequence[tuple[int, int, int]],
    device: torch.device,
    timer: EventTimer,
    dtype: torch.dtype = torch.bfloat16,
    warmup: int = WARMUP,
    reps: int = REPS,
) -> list[GemmPoint]:
    """Time ``(m, n, k)`` GEMMs ``torch.mm(a (m, k), b (k, n), out=c)`` in ``dtype`` on ``device``."""
    points = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        c = torch.empty(m, n, device=device, dtype=dtype)
        seconds = event_median_s(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), timer, warmup, reps)
        points.append(GemmPoint(m, n, k, seconds))
        del a, b, c
    return points


@dataclass(frozen=True)
class AttentionPoint:
    """A fused attention forward (or, ``backward``, its backward alone) over keys of ``kv_len``;
    ``dropout``: a causal backward timed with `ATTENTION_DROPOUT_P` on the probabilities (its forward
    + backward less the forward without)."""

    kv_len: int
    causal: bool
    backward: bool
    flops: float  # forward FLOP as `costmodels.compute.attention_flops` counts them
    time_s: float
    dropout: bool = False


def time_attention(
    lengths: Sequence[int],
    device: torch.device,
    timer: EventTimer,
    dtype: torch.dtype = torch.bfloat16,
    heads: int = ATTENTION_HEADS,
    head_dim: int = ATTENTION_HEAD_DIM,
    tokens: int = ATTENTION_TOKENS,
    warmup: int = WARMUP,
    reps: int = REPS,
) -> list[AttentionPoint]:
    """Time ``scaled_dot_product_attention`` forwards (causal and unmasked) and the causal backward
    (forward + backward less the forward) at each key length, batch ``tokens // length``, and the
    causal backward again with dropout on the probabilities (`AttentionPoint.dropout`)."""
    points = []
    for length in lengths:
        batch = max(1, tokens // length)
        causal_s, unmasked_s, backward_s, dropout_s = _attention_times_s(
            (batch, heads, length, head_dim), device, timer, dtype, warmup, reps
        )
        for causal, seconds in ((True, causal_s), (False, unmasked_s)):
            flops = attention_flops(batch, heads, length, length, head_dim, causal=causal)
            points.append(AttentionPoint(length, causal, False, flops, seconds))
        flops = attention_flops(batch, heads, length, length, head_dim, causal=True)
        points.append(AttentionPoint(length, True, True, flops, backward_s))
        points.append(AttentionPoint(length, True, True, flops, dropout_s, dropout=True))
    return points


def _attention_times_s(
    shape: tuple[int, int, int, int],
    device: torch.device,
    timer: EventTimer,
    dtype: torch.dtype,
    warmup: int,
    reps: int,
) -> tuple[float, float, float, float]:
    """(causal forward, unmasked forward, causal backward, causal backward with dropout) seconds of SDPA
    over (B, H, L, D) ``shape``; each backward is its forward + backward less the causal forward."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q, k, v = (torch.randn(*shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(*shape, device=device, dtype=dtype)
    with torch.no_grad():
        causal_s = event_median_s(lambda: sdpa(q, k, v, is_causal=True), timer, warmup, reps)
        unmasked_s = event_median_s(lambda: sdpa(q, k, v, is_causal=False), timer, warmup, reps)

    def forward_backward(dropout_p: float = 0.0) -> None:
        sdpa(q, k, v, is_causal=True, dropout_p=dropout_p).backward(grad)
        q.grad = k.grad = v.grad = None

    both = event_median_s(forward_backward, timer, warmup, reps)
    dropped = event_median_s(lambda: forward_backward(ATTENTION_DROPOUT_P), timer, warmup, reps)
    return causal_s, unmasked_s, max(both - causal_s, 0.0), max(dropped - causal_s, 0.0)


@dataclass(frozen=True)
class DecodePoint:
    """One decode step's attention: ``sequences`` x ``heads`` query heads of one token over a cache of
    ``kv_len`` tokens x ``kv_heads`` K / V heads of ``head_dim`` elements of ``element_bytes``."""

    sequences: int
    heads: int
    kv_heads: int
    kv_len: int
    head_dim: int
    element_bytes: int
    time_s: float


def time_decode_attention(
    device: torch.device,
    timer: EventTimer,
    dtype: torch.dtype = torch.bfloat16,
    heads: int = DECODE_HEADS,
    kv_heads: int = DECODE_KV_HEADS,
    kv_len: int = DECODE_KV_LEN,
    head_dim: int = ATTENTION_HEAD_DIM,
    warmup: int = WARMUP,
    reps: int = REPS,
) -> DecodePoint:
    """Time ``scaled_dot_product_attention`` of one query token per head over a cache of ``kv_len``
    tokens at batch 1, with a boolean mask over the cache and grouped K / V (``enable_gqa``), as the
    static-cache example models call it (examples/models_kv.py): whichever kernel torch picks for it."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q = torch.randn(1, heads, 1, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, kv_len, head_dim, device=device, dtype=dtype) for _ in range(2))
    mask = torch.ones(1, 1, 1, kv_len, device=device, dtype=torch.bool)
    gqa = {"enable_gqa": True} if kv_heads < heads else {}
    with torch.no_grad():
        seconds = event_median_s(lambda: sdpa(q, k, v, attn_mask=mask, **gqa), timer, warmup, reps)
    return DecodePoint(1, heads, kv_heads, kv_len, head_dim, q.element_size(), seconds)


def fit_decode_attention(
    point: DecodePoint, sms: int, memory_bytes_per_s: float
) -> tuple[DecodeAttentionSpec | None, float]:
    """(``device.decode_attention`` for `point`, its time over the bandwidth's): the block_share at
    which `costmodels.compute.decode_attention_time_s` reproduces the point (its sequences x heads
    blocks in ceil(blocks / sms) waves, each reading one head's K and V), or None when the point ran
    within `SPLIT_KERNEL_FACTOR` of reading its cache once at ``memory_bytes_per_s`` (the achieved
    bandwidth): a kernel that splits the cache, priced by bandwidth."""
    cache = 2.0 * point.sequences * point.kv_heads * point.kv_len * point.head_dim * point.element_bytes
    over_bandwidth = point.time_s * memory_bytes_per_s / cache
    if over_bandwidth <= SPLIT_KERNEL_FACTOR:
        return None, over_bandwidth
    streamed = decode_attention_sm_bytes(
        point.sequences, point.heads, point.kv_len, point.head_dim, point.element_bytes, sms
    )
    share = streamed * sms / (point.time_s * memory_bytes_per_s)
    return DecodeAttentionSpec(sms, share), over_bandwidth


@dataclass(frozen=True)
class CollectivePoint:
    """A collective of ``kind`` over ``nbytes`` (the full tensor: all-reduce's buffer, all-gather's
    output, reduce-scatter's input, as nccl-tests' size) on ``ranks`` ranks that took ``time_s``."""

    kind: str
    nbytes: int
    ranks: int
    time_s: float

    @property
    def algbw(self) -> float:
        return nccl_tests_bandwidths(self.kind, self.nbytes, self.time_s, self.ranks)[0]

    @property
    def busbw(self) -> float:
        return nccl_tests_bandwidths(self.kind, self.nbytes, self.time_s, self.ranks)[1]


def collective_elements(nbytes: int, ranks: int, element_bytes: int = 4) -> int:
    """Elements of the full tensor of a collective of about ``nbytes``: a multiple of ``ranks`` (the
    all-gather / reduce-scatter chunk), at least one per rank."""
    per_rank = max(1, -(-nbytes // (element_bytes * ranks)))
    return per_rank * ranks


def time_collectives(
    sizes: Sequence[int],
    device: torch.device,
    timer: EventTimer,
    group: object | None = None,
    kinds: Sequence[str] = COLLECTIVE_KINDS,
    warmup: int = WARMUP,
    reps: int = REPS,
) -> list[CollectivePoint]:
    """Time each collective of ``kinds`` at each of ``sizes`` (bytes of the full fp32 tensor, rounded to
    whole elements per rank) over ``group`` (None: the world), as nccl-tests does: back-to-back calls
    between two marks, the same number on every rank, the median window; then the slowest rank's
    time (collectives end together; a rank that entered late waited less). Every rank calls this."""
    ranks = dist.get_world_size(group)
    points = []
    for kind in kinds:
        for nbytes in sizes:
            elements = collective_elements(nbytes, ranks)
            full = torch.ones(elements, device=device)
            part = torch.ones(elements // ranks, device=device)
            if kind == "all_reduce":
                fn = lambda full=full: dist.all_reduce(full, group=group)  # noqa: E731
            elif kind == "all_gather":
                fn = lambda full=full, part=part: _all_gather(full, part, group)  # noqa: E731
            elif kind == "reduce_scatter":
                fn = lambda full=full, part=part: _reduce_scatter(part, full, group)  # noqa: E731
            else:
                raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVE_KINDS}")
            dist.barrier(group=group)
            inner = agreed_inner(fn, timer, group)
            seconds = event_median_s(fn, timer, warmup, reps, inner=inner)
            t = torch.tensor([seconds], dtype=torch.float64, device=_group_device(group))
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            points.append(CollectivePoint(kind, elements * 4, ranks, t.item()))
            del full, part
    return points


def _all_gather(out: torch.Tensor, part: torch.Tensor, group: object | None) -> None:
    if hasattr(dist, "all_gather_single"):  # torch >= 2.13 (all_gather_into_tensor deprecated)
        dist.all_gather_single(out, part, group=group)
    else:
        dist.all_gather_into_tensor(out, part, group=group)


def _reduce_scatter(out: torch.Tensor, full: torch.Tensor, group: object | None) -> None:
    if hasattr(dist, "reduce_scatter_single"):
        dist.reduce_scatter_single(out, full, group=group)
    else:
        dist.reduce_scatter_tensor(out, full, group=group)


# --------------------------------------------------------------------------------------------
# fits (pure)


def nccl_tests_bandwidths(kind: str, nbytes: float, time_s: float, ranks: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes / s as nccl-tests reports them (its doc/PERFORMANCE.md): algbw =
    ``nbytes`` / ``time_s``; busbw = algbw x 2(n-1)/n for all-reduce, (n-1)/n for all-gather and
    reduce-scatter (``nbytes`` the full tensor), algbw for broadcast."""
    if time_s <= 0 or ranks < 1:
        raise ValueError(f"time_s must be > 0 and ranks >= 1, got {time_s}, {ranks}")
    algbw = nbytes / time_s
    factors = {
        "all_reduce": 2.0 * (ranks - 1) / ranks,
        "all_gather": (ranks - 1) / ranks,
        "reduce_scatter": (ranks - 1) / ranks,
        "broadcast": 1.0,
    }
    if kind not in factors:
        raise ValueError(f"unknown collective {kind!r}; expected one of {sorted(factors)}")
    return algbw, algbw * factors[kind]


HOST_BOUND_LAUNCHES = 3.0  # a GEMM measured under this many launch overheads is the host's time (`fit_gemm`)


@dataclass(frozen=True)
class GemmFit:
    """`fit_gemm`'s result: the spec's ``device.gemm``, and how well it reproduces the points."""

    spec: GemmSpec
    max_error: float  # largest |priced time / measured - 1| over the points fitted
    rms_error: float
    used: int  # points fitted (compute-bound)
    excluded: int  # points left out: memory-bound, or host-bound (under `HOST_BOUND_LAUNCHES` launches)


def fit_gemm(
    points: Sequence[GemmPoint],
    peak_flops_per_s: float,
    sms: int,
    tiles: Sequence[tuple[int, int]] = HOPPER_TILES,
    min_split_k: float = MIN_SPLIT_K,
    memory_bytes_per_s: float | None = None,
    element_bytes: int = 2,
    launch_s: float = 0.0,
    max_efficiency: float | None = 1.0,
) -> GemmFit:
    """Fit ``efficiency`` and ``half_k`` of `costmodels.compute.gemm_efficiency` (``sms``, ``tiles``,
    ``min_split_k`` fixed) to measured GEMM times against ``peak_flops_per_s``, minimising the squared
    relative error of the priced time: for each ``half_k`` on a grid (0 and 0.5 ... 8192 elements,
    geometric) the best efficiency is closed-form (E = sum c^2 / sum c, c_i = the point's priced
    time at E = 1 over its measured time); the best pair is kept, the efficiency at most 1 (then
    ``half_k`` refitted). Points whose operands and result at ``memory_bytes_per_s`` take more than
    half their measured time are memory-bound (the roofline prices them) and left out.

    ``launch_s``: the fixed time `costmodels.compute.op_time_s` adds to each GEMM on a GPU (the
    device's ``launch_overhead_s``): the priced time is the compute time plus it. Points faster than
    `HOST_BOUND_LAUNCHES` launches are left out: back-to-back calls issue no faster than the host
    dispatches them, so their time is the host's, not the kernel's (512^3 and 1024^3 bf16 took 15-19 us
    on an H200 whose one-element add took 7-11 us, 2026-12-04), and fitting them bent ``half_k`` to
    slow every small-K GEMM down (8192 x 8192 x 256 priced 9-16% slow; left out: 4-6% fast, rms over
    the rest 4-5% instead of 13-14%, on the two runs' points). In a plan such ops sit under the host's
    issue time per node (`DeviceSpec.host_dispatch_s`).
    ``max_efficiency``: the cap on ``efficiency`` (None: none; the caller then raises the peak when
    the fit exceeds 1 - a GEMM with full tiles and waves runs faster than the fastest one measured).

    Raises:
        ValueError: no compute-bound point, or a non-positive peak / time.
    """
    if peak_flops_per_s <= 0:
        raise ValueError(f"peak_flops_per_s must be > 0, got {peak_flops_per_s}")
    compute_bound = []
    for p in points:
        if p.time_s <= 0:
            raise ValueError(f"GEMM {p.m} x {p.n} x {p.k}: time must be > 0, got {p.time_s}")
        nbytes = (p.m * p.k + p.k * p.n + p.m * p.n) * element_bytes
        if memory_bytes_per_s is None or nbytes / memory_bytes_per_s <= 0.5 * p.time_s:
            compute_bound.append(p)
    # where every point is host-bound (a sweep of tiny shapes), those slower than one launch are fitted
    used = [p for p in compute_bound if p.time_s > HOST_BOUND_LAUNCHES * launch_s] or [
        p for p in compute_bound if p.time_s > launch_s
    ]
    if not used:
        raise ValueError("no compute-bound GEMM point to fit")
    tiles = tuple((int(a), int(b)) for a, b in tiles)
    grid = [0.0] + [0.5 * 2 ** (i / 16) for i in range(16 * 14 + 1)]  # 0.5 ... 8192
    cap = math.inf if max_efficiency is None else max_efficiency

    def fills(half_k: float) -> list[float]:
        unit = GemmSpec(1.0, half_k, sms, tiles, min_split_k)
        return [gemm_efficiency(p.m, p.n, p.k, unit) for p in used]

    def error(efficiency: float, f: list[float]) -> tuple[float, float]:
        rel = [
            (p.flops / (peak_flops_per_s * efficiency * fi) + launch_s) / p.time_s - 1.0
            for p, fi in zip(used, f)
        ]
        return math.sqrt(sum(r * r for r in rel) / len(rel)), max(abs(r) for r in rel)

    best: tuple[float, float, float] | None = None  # (rms, efficiency, half_k)
    for half_k in grid:
        f = fills(half_k)
        # relative error c_i / E - d_i: c_i the compute time at E = 1, d_i the share of the measured
        # time that is not the launch; least squares in 1 / E
        c = [p.flops / (peak_flops_per_s * fi) / p.time_s for p, fi in zip(used, f)]
        d = [1.0 - launch_s / p.time_s for p in used]
        efficiency = min(cap, sum(ci * ci for ci in c) / sum(ci * di for ci, di in zip(c, d)))
        rms, _ = error(efficiency, f)
        if best is None or rms < best[0]:
            best = (rms, efficiency, half_k)
    assert best is not None
    _, efficiency, half_k = best
    f = fills(half_k)
    rms, worst = error(efficiency, f)
    spec = GemmSpec(efficiency, half_k, sms, tiles, min_split_k)
    return GemmFit(spec, worst, rms, len(used), len(points) - len(used))


@dataclass(frozen=True)
class AttentionFit:
    spec: AttentionSpec
    max_error: float  # largest |priced forward time / measured - 1|
    measured_unmasked: bool  # False: half_seq = causal_half_seq / CAUSAL_HALF_RATIO


def fit_attention(points: Sequence[AttentionPoint], peak_flops_per_s: float) -> AttentionFit:
    """Fit ``device.attention`` (`costmodels.compute.attention_kernel_efficiency`: rate = efficiency x
    peak x L / (L + half)) to measured forwards: with y = peak x time / FLOP = (1 + half / L) /
    efficiency, linear in 1 / L, one least-squares fit (relative errors) of a shared 1 / efficiency and
    a slope per mask (half = slope x efficiency); efficiency at most 1, halves at least 0. Without
    unmasked points, ``half_seq`` is ``causal_half_seq`` / `CAUSAL_HALF_RATIO` (the presets' ratio).
    The points fill the SMs many times over (`ATTENTION_TOKENS` x `ATTENTION_HEADS`: 8,192 thread blocks),
    so the blocks' waves (`costmodels.compute.attention_kernel_efficiency`) are left out of the fit.
    ``backward_time_factor``: the median backward / forward time over the lengths timed both ways
    (absent: 2.5, FlashAttention's backward FLOP ratio). ``dropout_time_factor``: the median causal
    forward + backward time with dropout over without (`AttentionPoint.dropout`), at least 1 (absent: 1).

    Raises:
        ValueError: no causal forward point, or a non-positive peak / time / FLOP count."""
    import numpy as np  # noqa: PLC0415

    if peak_flops_per_s <= 0:
        raise ValueError(f"peak_flops_per_s must be > 0, got {peak_flops_per_s}")
    forwards = [p for p in points if not p.backward]
    if not any(p.causal for p in forwards):
        raise ValueError("no causal attention forward to fit")
    if any(p.time_s <= 0 or p.flops <= 0 for p in forwards):
        raise ValueError("attention points need time_s > 0 and flops > 0")
    unmasked = any(not p.causal for p in forwards)
    rows, target = [], []
    for p in forwards:
        y = peak_flops_per_s * p.time_s / p.flops
        x = 1.0 / p.kv_len
        row = [1.0 / y, x / y if p.causal else 0.0]
        if unmasked:
            row.append(0.0 if p.causal else x / y)
        rows.append(row)
        target.append(1.0)
    (coef, *_) = np.linalg.lstsq(np.array(rows), np.array(target), rcond=None)
    inv_eff = max(float(coef[0]), 1.0)  # efficiency at most 1
    efficiency = 1.0 / inv_eff
    causal_half = max(0.0, float(coef[1]) * efficiency)
    half = max(0.0, float(coef[2]) * efficiency) if unmasked else causal_half / CAUSAL_HALF_RATIO
    by_len = {(p.kv_len, p.backward): p.time_s for p in points if p.causal and not p.dropout}
    ratios = [
        by_len[(length, True)] / t
        for (length, bwd), t in by_len.items()
        if not bwd and (length, True) in by_len
    ]
    factor = statistics.median(ratios) if ratios and statistics.median(ratios) > 0 else 2.5
    dropout = []
    for p in points:
        forward, backward = by_len.get((p.kv_len, False)), by_len.get((p.kv_len, True))
        if p.dropout and forward and backward is not None and forward + backward > 0:
            dropout.append((forward + p.time_s) / (forward + backward))
    dropout_factor = max(1.0, statistics.median(dropout)) if dropout else 1.0
    spec = AttentionSpec(efficiency, half, causal_half, factor, dropout_factor)
    errors = []
    for p in forwards:
        h = causal_half if p.causal else half
        priced = p.flops / (peak_flops_per_s * efficiency * p.kv_len / (p.kv_len + h))
        errors.append(abs(priced / p.time_s - 1.0))
    return AttentionFit(spec, max(errors), unmasked)


_PRICES = {
    "all_reduce": all_reduce_time_s,
    "all_gather": all_gather_time_s,
    "reduce_scatter": reduce_scatter_time_s,
}


def priced_collective_s(point: CollectivePoint, group: Group, cluster: ClusterSpec) -> float:
    """What `costmodels.comm` prices ``point``'s collective at on ``cluster`` over ``group``."""
    return _PRICES[point.kind](point.nbytes, group, cluster)


@dataclass(frozen=True)
class LinkFit:
    """`fit_link`'s result: the link's alpha and bandwidth, and how well they reproduce the points."""

    link: str  # "intra_node" | "inter_node"
    latency_s: float
    bandwidth_bytes_per_s: float
    nvls: bool
    busbw_error: float  # largest |priced busbw / measured - 1| at sizes >= LARGE_BYTES
    small_time_error: float  # largest |priced time / measured - 1| at sizes <= SMALL_BYTES
    max_error: float  # largest |priced time / measured - 1| over every point

    @property
    def within_tolerance(self) -> bool:
        return self.busbw_error <= BUSBW_TOLERANCE and self.small_time_error <= SMALL_TIME_TOLERANCE

    def source(self, group: Group) -> str:
        """The spec's ``sources`` line for this fit."""
        verdict = (
            "within tolerance"
            if self.within_tolerance
            else "OUTSIDE tolerance: the spec's prices of this link do not reproduce the measurement"
        )
        return (
            f"{self.link}: latency_us {self.latency_s * 1e6:.3g}, bandwidth_GBps "
            f"{self.bandwidth_bytes_per_s / 1e9:.4g}{', nvls' if self.nvls else ''} fitted through "
            f"costmodels.comm to the {group.size}-rank ({group.ranks_per_node} per node) curve: busbw at "
            f">= {LARGE_BYTES // 2**20} MiB within {self.busbw_error:.1%} (tolerance {BUSBW_TOLERANCE:.0%}), "
            f"time at <= {SMALL_BYTES // 2**10} KiB within {self.small_time_error:.1%} (tolerance "
            f"{SMALL_TIME_TOLERANCE:.0%}), every point within {self.max_error:.1%}: {verdict}"
        )


def _with_link(
    cluster: ClusterSpec, link: str, latency_s: float, bandwidth: float, nvls: bool
) -> ClusterSpec:
    current = getattr(cluster, link)
    assert current is not None, f"the cluster has no {link} link"
    changes = {"latency_s": latency_s, "bandwidth_bytes_per_s": bandwidth}
    if link == "intra_node":
        changes["nvls"] = nvls
    return dataclasses.replace(cluster, **{link: dataclasses.replace(current, **changes)})


def _golden_min(f: Callable[[float], float], lo: float, hi: float, steps: int = 60) -> float:
    """The x in [lo, hi] minimising a unimodal ``f`` (golden-section search)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def fit_link(
    points: Sequence[CollectivePoint],
    cluster: ClusterSpec,
    group: Group,
    link: str = "intra_node",
    nvls_choices: Sequence[bool] = (False,),
) -> LinkFit:
    """Fit ``link``'s ``latency_s`` and ``bandwidth_bytes_per_s`` of ``cluster`` (backend nccl) so that
    `costmodels.comm` prices ``points`` (collectives over ``group``) as measured: alternately, the
    bandwidth scaled by the geometric mean of priced / measured time at sizes >= `LARGE_BYTES` (the
    bus bandwidth there; the largest three sizes when none is that large) and the latency by a
    golden-section search over log(alpha) in [1 ns, 1 ms] minimising the squared log errors of the
    time at sizes <= `SMALL_BYTES` (the smallest three when none is that small), 12 rounds. For each of
    ``nvls_choices`` (intra-node: whether the all-reduce curve is NVLink SHARP's) a fit is made and
    the one with the smaller squared log error over every point kept.

    Raises:
        ValueError: fewer than two sizes, or a non-positive time."""
    if len({p.nbytes for p in points}) < 2:
        raise ValueError("fit_link needs points at two sizes at least")
    if any(p.time_s <= 0 for p in points):
        raise ValueError("collective times must be > 0")
    sizes = sorted({p.nbytes for p in points})
    large_sizes = [s for s in sizes if s >= LARGE_BYTES] or sizes[-3:]
    small_sizes = [s for s in sizes if s <= SMALL_BYTES] or sizes[:3]
    large = [p for p in points if p.nbytes in large_sizes]
    small = [p for p in points if p.nbytes in small_sizes]

    def log_errors(spec: ClusterSpec, pts: Sequence[CollectivePoint]) -> list[float]:
        return [math.log(priced_collective_s(p, group, spec) / p.time_s) for p in pts]

    fits = []
    for nvls in nvls_choices:
        current = getattr(cluster, link)
        bandwidth, latency = current.bandwidth_bytes_per_s, max(current.latency_s, 1e-7)
        for _ in range(12):
            spec = _with_link(cluster, link, latency, bandwidth, nvls)
            step = math.exp(statistics.fmean(log_errors(spec, large)))
            bandwidth *= min(4.0, max(0.25, step))  # damped: a bandwidth the curve cannot see stays put

            def small_error(log_alpha: float, bandwidth: float = bandwidth, nvls: bool = nvls) -> float:
                s = _with_link(cluster, link, math.exp(log_alpha), bandwidth, nvls)
                return sum(e * e for e in log_errors(s, small))

            latency = math.exp(_golden_min(small_error, math.log(1e-9), math.log(1e-3)))
        spec = _with_link(cluster, link, latency, bandwidth, nvls)
        total = sum(e * e for e in log_errors(spec, points))
        fits.append((total, nvls, latency, bandwidth, spec))
    _, nvls, latency, bandwidth, spec = min(fits, key=lambda f: f[0])

    def rel(pts: Sequence[CollectivePoint]) -> float:
        return max(abs(math.exp(e) - 1.0) for e in log_errors(spec, pts))

    # busbw error: priced busbw / measured = measured time / priced time
    busbw_error = max(abs(math.exp(-e) - 1.0) for e in log_errors(spec, large))
    return LinkFit(link, latency, bandwidth, nvls, busbw_error, rel(small), rel(points))


# --------------------------------------------------------------------------------------------
# `planner calibrate` on CUDA: measure on every rank, then write the spec's fields


def _max_over_ranks(values: list[float]) -> list[float]:
    """Each value's largest over the world's ranks (the slowest rank's time)."""
    if not values or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_group_device(None))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def cuda_measurements(
    device: torch.device,
    timer: EventTimer,
    gemm_shapes: Sequence[tuple[int, int, int]] = (),
    node_group: object | None = None,
    nodes: int = 1,
    gemm_sweep: Sequence[tuple[int, int, int]] = GEMM_SWEEP_SHAPES,
    attention_lengths: Sequence[int] = ATTENTION_LENGTHS,
    sizes: Sequence[int] = COLLECTIVE_SIZES_BYTES,
    dtype: torch.dtype = torch.bfloat16,
    attention_kwargs: dict | None = None,
    decode_kwargs: dict | None = None,
) -> dict:
    """What `calibrate` measures on CUDA beside its CPU-style figures, on every rank of the initialised
    world at once: ``gemm_sweep`` and the model's ``gemm_shapes`` (M, N, K), fused attention at
    ``attention_lengths``, and the collectives at ``sizes`` over this rank's node (``node_group``;
    None: the world, one node) and, with ``nodes`` > 1, over the world (spanning the nodes). With one
    rank, only an 8 B all-reduce (NCCL's per-call floor). Times are the slowest rank's. Returns plain
    data (picklable): {"gemm": [(m, n, k, s)], "attention": [(L, causal, backward, FLOP, s)],
    "decode_attention": `DecodePoint` as a tuple,
    "collectives": {"intra_node": [(kind, bytes, ranks, s)], "inter_node": [...]}, "sms", "cc"}."""
    shapes = list(dict.fromkeys([*map(tuple, gemm_sweep), *map(tuple, gemm_shapes)]))
    gemm = time_gemms(shapes, device, timer, dtype)
    square = (max(s[0] for s in shapes),) * 3 if device.type != "cuda" else SQUARE_SHAPE
    squares = [time_gemms([square], device, timer, torch_dtype(dt))[0].time_s for dt in SQUARE_DTYPES]
    attention = time_attention(attention_lengths, device, timer, dtype, **(attention_kwargs or {}))
    decode = time_decode_attention(device, timer, dtype, **(decode_kwargs or {}))
    slowest = _max_over_ranks(
        [p.time_s for p in gemm] + [p.time_s for p in attention] + squares + [decode.time_s]
    )
    gemm = [dataclasses.replace(p, time_s=t) for p, t in zip(gemm, slowest)]
    attention = [dataclasses.replace(p, time_s=t) for p, t in zip(attention, slowest[len(gemm) :])]
    squares = slowest[len(gemm) + len(attention) : -1]
    decode = dataclasses.replace(decode, time_s=slowest[-1])
    world = dist.get_world_size()
    collectives: dict[str, list[CollectivePoint]] = {}
    if world == 1:
        collectives["intra_node"] = time_collectives((8,), device, timer, kinds=("all_reduce",))
    else:
        collectives["intra_node"] = time_collectives(sizes, device, timer, node_group if nodes > 1 else None)
        if nodes > 1:
            collectives["inter_node"] = time_collectives(sizes, device, timer, None)
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    return {
        "gemm": [dataclasses.astuple(p) for p in gemm],
        "attention": [dataclasses.astuple(p) for p in attention],
        "decode_attention": dataclasses.astuple(decode),
        "collectives": {k: [dataclasses.astuple(p) for p in v] for k, v in collectives.items()},
        "squares": {dt: 2.0 * math.prod(square) / t for dt, t in zip(SQUARE_DTYPES, squares)},
        "sms": props.multi_processor_count if props is not None else 132,
        "cc": [props.major, props.minor] if props is not None else [0, 0],
    }


def _infiniband_nics() -> int:
    """NICs of this node (entries of /sys/class/infiniband), at least 1."""
    try:
        from pathlib import Path  # noqa: PLC0415

        return max(1, len(list(Path("/sys/class/infiniband").iterdir())))
    except OSError:
        return 1


def _sig(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def apply_cuda_measurements(data: dict, cuda: dict, nodes: int = 1, nics_per_node: int | None = None) -> dict:
    """``data`` (the cluster YAML mapping `calibrate` builds, backend nccl) with the CUDA measurements
    written in: ``device.gemm`` (`fit_gemm` with the device's launch overhead, against the fastest
    GEMM measured; the bf16 peak is that rate, raised by the fitted efficiency where it exceeds 1 (the
    gemm efficiency is then 1); fp16 and fp32 peaks that times their `SQUARE_SHAPE` rate over bf16's;
    ``matmul_half_rows`` dropped: the GEMM model carries the row count), ``device.attention``
    (`fit_attention`), ``device.decode_attention`` (`fit_decode_attention`, left out for a kernel that
    splits the cache), ``links.intra_node`` and with ``nodes`` > 1 ``links.inter_node`` (`fit_link`
    through `costmodels.comm`; ``nics_per_node`` default: /sys/class/infiniband's entries), each
    with its ``sources`` line saying what was measured, how, and how well the fit holds. Pure but for
    the NIC count's default. Returns a new mapping."""
    from costmodels.cluster import parse_cluster  # noqa: PLC0415

    data = {
        **data,
        "device": dict(data["device"]),
        "links": dict(data["links"]),
        "sources": list(data["sources"]),
    }
    dev, sources = data["device"], data["sources"]
    gemm = [GemmPoint(*p) for p in cuda["gemm"]]
    fastest = max(p.flops / p.time_s for p in gemm)
    squares = cuda["squares"]
    dev.pop("matmul_half_rows", None)
    launch_s = float(dev.get("launch_overhead_us") or 0.0) * 1e-6
    fit = fit_gemm(
        gemm,
        fastest,
        int(cuda["sms"]),
        memory_bytes_per_s=dev["memory_bandwidth_GBps"] * 1e9,
        launch_s=launch_s,
        max_efficiency=None,
    )
    # the fastest GEMM measured still has part-filled waves and a finite K: where the fit's efficiency
    # exceeds 1, the peak is the rate of full tiles and waves at unbounded K (fastest x efficiency)
    scale = max(1.0, fit.spec.efficiency)
    peak = fastest * scale
    g = dataclasses.replace(fit.spec, efficiency=fit.spec.efficiency / scale)
    dev["peak_TFLOPS"] = {dt: _sig(peak * squares[dt] / squares["bf16"] / 1e12) for dt in SQUARE_DTYPES}
    dev["gemm"] = {
        "efficiency": _sig(g.efficiency),
        "half_k": _sig(g.half_k),
        "sms": g.sms,
        "tiles": [list(t) for t in g.tiles],
        "min_split_k": _sig(g.min_split_k),
    }
    shown = ", ".join(f"{p.m}x{p.n}x{p.k} {p.flops / p.time_s / 1e12:.0f}" for p in gemm)
    sources.append(
        f"GEMM (bf16 torch.mm, CUDA events, {WARMUP} warm-up calls, median of {REPS} windows, slowest rank), "
        f"TFLOP/s by MxNxK: {shown}; device.gemm fitted (costmodels.gpu_calibrate.fit_gemm: "
        f"efficiency and half_k of gemm_efficiency, {g.sms} SMs from the device, the Hopper presets' tiles, "
        f"each GEMM priced with the {launch_s * 1e6:.1f} us launch overhead) over {fit.used} points "
        f"({fit.excluded} memory- or launch-bound left out): rms {fit.rms_error:.1%}, worst {fit.max_error:.1%}; "
        f"peak_TFLOPS bf16 = the fastest measured ({fastest / 1e12:.0f}) x {scale:.3f} (the fit's rate of full "
        f"tiles and waves at unbounded K over it), fp16 and fp32 that times their "
        f"{'x'.join(map(str, SQUARE_SHAPE))} square's rate over bf16's: "
        f"{', '.join(f'{dt} {r / 1e12:.1f}' for dt, r in squares.items())} TFLOP/s"
    )
    attention = [AttentionPoint(*p) for p in cuda["attention"]]
    if attention:
        afit = fit_attention(attention, peak)
        a = afit.spec
        dev["attention"] = {
            "efficiency": _sig(a.efficiency),
            "half_seq": _sig(a.half_seq),
            "causal_half_seq": _sig(a.causal_half_seq),
            "backward_time_factor": _sig(a.backward_time_factor),
            "dropout_time_factor": _sig(a.dropout_time_factor),
        }
        forwards = ", ".join(
            f"{p.kv_len} {p.flops / p.time_s / 1e12:.0f}" for p in attention if p.causal and not p.backward
        )
        sources.append(
            f"attention (scaled_dot_product_attention bf16, {ATTENTION_HEADS} heads of {ATTENTION_HEAD_DIM}, "
            f"CUDA events): causal forward TFLOP/s by key length {forwards}; unmasked and causal backward "
            f"timed too, and the causal forward + backward with dropout {ATTENTION_DROPOUT_P} "
            f"(x{a.dropout_time_factor:.3f}); device.attention fitted (fit_attention), worst forward "
            f"{afit.max_error:.1%}"
        )
    if cuda.get("decode_attention") is not None:
        point = DecodePoint(*cuda["decode_attention"])
        achieved = dev["memory_bandwidth_GBps"] * 1e9 * dev["memory_efficiency"]
        spec, over = fit_decode_attention(point, int(cuda["sms"]), achieved)
        dev.pop("decode_attention", None)
        what = (
            f"decode attention (scaled_dot_product_attention, batch 1, {point.heads} query / {point.kv_heads} "
            f"KV heads of {point.head_dim}, a {point.kv_len}-token cache under a boolean mask, CUDA events): "
            f"{point.time_s * 1e6:.1f} us, {over:.1f}x reading the cache once at the achieved bandwidth"
        )
        if spec is None:
            sources.append(f"{what}: a kernel that splits the cache (no device.decode_attention)")
        else:
            dev["decode_attention"] = {"sms": spec.sms, "block_share": _sig(spec.block_share)}
            sources.append(
                f"{what}: one block per sequence and query head; device.decode_attention fitted "
                f"(fit_decode_attention): block_share {spec.block_share:.3g}"
            )
    intra_points = [CollectivePoint(*p) for p in cuda["collectives"].get("intra_node", [])]
    ranks_per_node = int(data["devices_per_node"])
    if len({p.nbytes for p in intra_points}) < 2:
        for p in intra_points:
            sources.append(
                f"NCCL {p.kind} of {p.nbytes} B at world size {p.ranks}: {p.time_s * 1e6:.1f} us per call "
                "(one GPU: no link measured; links.intra_node is a placeholder)"
            )
        return data
    nodes_data = {**data, "nodes": nodes}
    if nodes > 1:
        nics = nics_per_node or _infiniband_nics()
        nodes_data["links"] = {
            **data["links"],
            "inter_node": {
                "kind": "infiniband",
                "bandwidth_GBps": 25.0,
                "latency_us": 5.0,
                "nics_per_node": nics,
            },
        }
    intra = {"kind": "nvlink", "bandwidth_GBps": 100.0, "latency_us": 5.0}
    nodes_data["links"] = {**nodes_data["links"], "intra_node": intra}
    base = parse_cluster(nodes_data, "planner calibrate")
    hopper = list(cuda.get("cc", [0, 0]))[0] >= 9
    group = Group(ranks_per_node, ranks_per_node)
    fit_in = fit_link(intra_points, base, group, "intra_node", (False, True) if hopper else (False,))
    intra = {
        "kind": "nvlink",
        "bandwidth_GBps": _sig(fit_in.bandwidth_bytes_per_s / 1e9),
        "latency_us": _sig(fit_in.latency_s * 1e6),
        **({"nvls": True} if fit_in.nvls else {}),
    }
    sources.append(_curve_source(intra_points, "intra-node"))
    sources.append(fit_in.source(group) + " (kind nvlink assumed: NVLink or PCIe is not detected)")
    links = {**nodes_data["links"], "intra_node": intra}
    if nodes > 1:
        base = _with_link(base, "intra_node", fit_in.latency_s, fit_in.bandwidth_bytes_per_s, fit_in.nvls)
        inter_points = [CollectivePoint(*p) for p in cuda["collectives"]["inter_node"]]
        world = Group(ranks_per_node * nodes, ranks_per_node)
        fit_x = fit_link(inter_points, base, world, "inter_node")
        links["inter_node"] = {
            **links["inter_node"],
            "bandwidth_GBps": _sig(fit_x.bandwidth_bytes_per_s / 1e9),
            "latency_us": _sig(fit_x.latency_s * 1e6),
        }
        sources.append(_curve_source(inter_points, f"across {nodes} nodes"))
        sources.append(fit_x.source(world) + f" ({links['inter_node']['nics_per_node']} NICs per node)")
    data["nodes"] = nodes
    data["links"] = links
    return data


def _curve_source(points: Sequence[CollectivePoint], where: str) -> str:
    """The measured curve in nccl-tests' terms, a few sizes per collective."""
    parts = []
    for kind in COLLECTIVE_KINDS:
        pts = sorted((p for p in points if p.kind == kind), key=lambda p: p.nbytes)
        if not pts:
            continue
        shown = [pts[0], pts[len(pts) // 2], pts[-1]]
        parts.append(
            f"{kind} "
            + ", ".join(
                f"{p.nbytes} B {p.time_s * 1e6:.1f} us busbw {p.busbw / 1e9:.1f} GB/s"
                for p in dict.fromkeys(shown)
            )
        )
    ranks = points[0].ranks if points else 0
    return (
        f"NCCL collectives {where} ({ranks} ranks; back-to-back calls between CUDA events, median window, "
        f"slowest rank; nccl-tests' algbw / busbw, 8 B to 1 GiB in powers of 4): " + "; ".join(parts)
    )

"""``planner calibrate``: measure this machine and write a cluster spec the cost model can use.

Spawns ``nproc`` local processes (gloo on CPU; NCCL with one GPU each when CUDA has enough
devices), all measuring at the same time, because that is how the ranks of a plan will run:

1. matmul throughput per dtype (each process with ``max(1, cores // nproc)`` threads on CPU): the
   median rate over a square matmul and the transformer shapes ``TRANSFORMER_MATMUL_SHAPES``, timed in
   interleaved rounds for about ``_MATMUL_BUDGET_S`` each;
2. memory bandwidth (large tensor copy: bytes read + written);
3. per-op launch overhead (a one-element add), and the per-node overhead of an eager GraphModule:
   a captured graph of tiny transformer-like blocks (linear, views, transposes, SDPA, norms,
   elementwise ops, cat / slice; ~34 nodes per block) at 2 and 8 blocks, forward and forward +
   backward; the slope over the node count is what each extra node costs (Python + ATen dispatch,
   views included), without the graph's fixed call cost;
   Convolutions and pooling: a 3x3 conv2d over (8, 64, 16, 16) (FLOP/s over the matmul peak:
   ``conv_efficiency``) and a 2x2 max pool over (8, 32, 32, 32) (bytes read + written / s:
   ``pooling_bandwidth_GBps``); CPU kernels of both run far below the roofs;
4. all-reduce of a 4-byte tensor (the per-call cost of a collective) and at 4 KiB ... 16 MiB, each issued right after a compute segment of a few ms on every
   rank and without a barrier (as a tensor-parallel graph issues it, so the time includes waiting
   for the peer rank and for the backend's threads), fitted by least squares (relative errors) to the
   same alpha-beta formula ``costmodels.comm.all_reduce_time_s`` predicts with;
5. overlap efficiency: an async all-reduce beside a matmul of the same duration, against the two
   run one after the other: ``(t_matmul + t_allreduce - t_both) / min(t_matmul, t_allreduce)``.

Measured throughputs become the peaks with efficiency 1.0 (they already are what is achievable).

The machine's load (``os.getloadavg``) is recorded before and after; a load above the core count
means the ranks did not get their cores while measuring, and `calibrate` warns
(`CalibrationWarning`). `cache_status` tells whether a cached spec is still valid (age, CPU, torch
version, process count), from the metadata `write_cache_metadata` stores beside it.

Clock: on CPU with one intra-op thread per process, 1-3 are timed in CPU time of the calling thread
(``time.thread_time``; the op runs on that thread), so a machine shared with other load is measured
as it is when a rank has its core, not by the share of a core it got during calibration; the wall /
CPU ratio seen while measuring and the load average are recorded in ``sources``. Otherwise (CUDA,
several threads) wall time. Collectives are always wall time (their cost is waiting).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import re
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from torch import nn

from costmodels.cluster import (
    CALIBRATED_SOURCE,
    CALIBRATED_SPEC_NAME,
    ClusterSpec,
    DeviceSpec,
    SpecError,
    cluster_to_dict,
    load_cluster,
    parse_cluster,
)
from costmodels.compute import (
    SIZED_PROBE,
    TOY_PROBE,
    attention_bytes,
    attention_flops,
    linear_bytes,
    linear_flops,
    op_time_s,
)
from costmodels.dtypes import DTYPE_BYTES, torch_dtype
from costmodels.gpu_calibrate import CudaEventTimer, apply_cuda_measurements, cuda_measurements
from planner.errors import InputError, RunError
from planner.files import with_digest, write_text_atomic
from planner.progress import Progress

ALL_REDUCE_SIZES_BYTES = tuple(4096 * 4**i for i in range(7))  # 4 KiB, 16 KiB, ..., 16 MiB
CALL_SIZE_BYTES = 4  # one fp32: an all-reduce this small costs its per-call overhead only
PROBE_BLOCKS = (2, 8)  # blocks of the node-overhead probe graph: the slope between them is per node
# (T, C, N) of the speed probe's matmul, (T x C) @ (C x N) in fp32: an attention projection of a small
# transformer, one of TRANSFORMER_MATMUL_SHAPES (timed with them, so its calibrated rate belongs to the
# same moment as the spec's matmul fit); its 2.4 MB weight stays in cache
PROBE_MATMUL_SHAPE = (64, 768, 768)
# the source line of a one-process calibration, which measures no link (`unmeasured_links` reads it)
ROUGH_LINKS_SOURCE = "nproc=1: links and overlap_efficiency are the local-cpu preset's rough defaults"
CACHE_MAX_AGE_DAYS = 7.0  # a cached calibration older than this is measured again
OVERLAP_SIZE_BYTES = 4 * 2**20  # all-reduce beside a matmul in the overlap measurement
_MIN_OP_S = 0.01  # matmul sizes grow until one product takes this long (timer resolution >> 1 µs)
_TIME_PER_POINT_S = 0.3  # repeat each measurement for about this long (median taken)
_STARTUP_TIMEOUT_S = 60.0  # init_process_group timeout
_MIN_ROUNDS, _MAX_ROUNDS = 5, 60  # interleaved rounds of collective timings (median taken)
# (T x C) @ (C x 4C) for T in {64, 512}, C in {768, 1024}: the MLP / attention projection shapes of
# small transformers, timed beside the square matmul (their rate differs from the square one).
# (T, C, N) products of a transformer layer at T tokens and width C: the attention projections
# (C -> C), the MLP's up (C -> 4C) and down (4C -> C); CPU GEMM libraries pick different kernels
# for each, so the row penalty is fitted over all three (one shape alone misled it by 2x)
TRANSFORMER_MATMUL_SHAPES = tuple(
    (t, k, n) for t in (64, 512) for c in (768, 1024) for k, n in ((c, c), (c, 4 * c), (4 * c, c))
)
_MATMUL_BUDGET_S = 2.0  # interleaved matmul rounds per dtype, wall seconds
_MAX_SHAPE_S = 0.1  # a shape whose one product would take longer (slow dtype) is left out
SDPA_SHAPE = (1, 16, 128, 64)  # (batch, heads, seq, head dim) of the timed attention core
STREAM_MATMUL_SHAPE = (64, 1024, 32768)  # (T, C, N): a weight far larger than a CPU cache
_SEGMENT_S = 0.005  # compute before each timed all-reduce: a TP block's compute per rank is 2-10 ms here


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> Callable[[], float]:
    """The clock compute is timed with: the calling thread's CPU time on CPU with one intra-op thread
    (the op runs on this thread, so time spent descheduled by other load is not counted), else wall."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _timed(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(clock seconds, wall seconds) of one call of ``fn``."""
    now = clock(device)
    c0, w0 = now(), time.perf_counter()
    fn()
    _sync(device)
    return now() - c0, time.perf_counter() - w0


def _median_time_s(
    fn: Callable[[], object], device: torch.device, budget_s: float = _TIME_PER_POINT_S
) -> float:
    """Median time of ``fn`` by ``clock`` (after one warm-up), repeated for about ``budget_s`` wall
    seconds, 3..50 times."""
    fn()
    _sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 50):
        times.append(_timed(fn, device)[0])
    return statistics.median(times)


def interleaved_rates(
    fns: list[Callable[[], object]], amounts: list[float], device: torch.device, budget_s: float
) -> tuple[list[float], float]:
    """Median rate (``amount / clock time``) of each of ``fns``, timed in rounds (fn0, fn1, ...; order
    rotated each round) for about ``budget_s`` wall seconds, at least 3 rounds; and the ratio of wall
    time to clock time over all of them (1.0 on a quiet machine, larger when descheduled)."""
    for fn in fns:
        fn()
    _sync(device)
    times: list[list[float]] = [[] for _ in fns]
    walls = clocks = 0.0
    start, r = time.perf_counter(), 0
    while r < 3 or time.perf_counter() - start < budget_s:
        for i in range(len(fns)):
            k = (r + i) % len(fns)
            c, w = _timed(fns[k], device)
            times[k].append(c)
            clocks, walls = clocks + c, walls + w
        r += 1
    rates = [a / max(statistics.median(t), 1e-12) for a, t in zip(amounts, times)]
    return rates, walls / max(clocks, 1e-12)


def fit_half_rows(shapes: list[tuple[int, int, int]], rates: list[float]) -> float:
    """Rows h such that an (M x C) @ (C x N) product runs at M / (M + h) of the large-M rate, from the
    rates of the same (C, N) at two row counts (the (64 x C) and (512 x C) transformer shapes): with
    q = rate(M1) / rate(M2), h = M1 M2 (1 - q) / (q M2 - M1); the median over the (C, N) pairs, 0 when
    small products are not slower."""
    by_cn: dict[tuple[int, int], dict[int, float]] = {}
    for (m, c, n), rate in zip(shapes, rates):
        by_cn.setdefault((c, n), {})[m] = rate
    fits = []
    for rows in by_cn.values():
        if len(rows) < 2:
            continue
        m1, m2 = min(rows), max(rows)
        q = rows[m1] / rows[m2]
        fits.append(max(0.0, m1 * m2 * (1 - q) / (q * m2 - m1)) if q * m2 > m1 else 0.0)
    return statistics.median(fits) if fits else 0.0


def _matmul_flops_per_s(
    dtype: str, device: torch.device, max_n: int
) -> tuple[float, float, float, float | None]:
    """(FLOP/s at large M, wall / clock ratio, half rows h, FLOP/s of `PROBE_MATMUL_SHAPE` or None when
    it was not timed): rates of a square matmul (grown until one
    product takes ``_MIN_OP_S``) and of the ``TRANSFORMER_MATMUL_SHAPES`` a product of which is
    expected to take at most ``_MAX_SHAPE_S`` at the square rate, timed interleaved for
    ``_MATMUL_BUDGET_S``; h = `fit_half_rows` of the transformer shapes, and the FLOP/s the median
    of rate x (M + h) / M over all shapes."""
    dt = torch_dtype(dtype)
    n = 128
    while True:
        a = torch.randn(n, n, device=device).to(dt)
        b = torch.randn(n, n, device=device).to(dt)
        t = _median_time_s(lambda a=a, b=b: a @ b, device, budget_s=0.0)
        if t >= _MIN_OP_S or n >= max_n:
            break
        n *= 2
    square_rate = 2.0 * n**3 / max(t, 1e-12)
    shapes = [(n, n, n)] + [
        s for s in TRANSFORMER_MATMUL_SHAPES if 2.0 * math.prod(s) / square_rate <= _MAX_SHAPE_S
    ]
    pairs = [
        (torch.randn(m, k, device=device).to(dt), torch.randn(k, p, device=device).to(dt))
        for m, k, p in shapes
    ]
    rates, wall_ratio = interleaved_rates(
        [lambda x=x, w=w: x @ w for x, w in pairs],
        [2.0 * math.prod(s) for s in shapes],
        device,
        _MATMUL_BUDGET_S,
    )
    half_rows = fit_half_rows(shapes[1:], rates[1:])
    # the large-M rate: each shape's rate with its row penalty M / (M + h) taken out, so that
    # op_time_s (which applies the penalty) reproduces every measured shape
    large_m = [r * (m + half_rows) / m for r, (m, _, _) in zip(rates, shapes)]
    probe = rates[shapes.index(PROBE_MATMUL_SHAPE)] if PROBE_MATMUL_SHAPE in shapes else None
    return statistics.median(large_m), wall_ratio, half_rows, probe


MODEL_SHAPES_BUDGET_S = 1.0  # wall seconds of interleaved rounds timing a model's matmul shapes
# shapes priced outside these seconds per product are left out (ratio 1): below, the product is within
# a few dispatch costs (`DeviceSpec.node_overhead_s`, ~10-20 us here) and its time depends on the call
# more than on the shape (an MLP's (64 x 256) @ (256 x 128) read 1-3x its price from one timing to the
# next on the dev VM); above, it is timed with fewer rows
_MODEL_SHAPE_MIN_S, _MODEL_SHAPE_MAX_S = 200e-6, 0.05
# timed beside a model's shapes: its time is the call's own cost (Python and ATen dispatch), which the
# per-node overhead prices already, so it is taken off each shape's time
_FLOOR_MATMUL_SHAPE = (1, 8, 8)
_CONV_MIN_S = 1e-6  # convolutions priced under this keep the spec's efficiency (`conv_time_ratios`)
_MODEL_SHAPES_MAX_BYTES = 1 << 30  # operands allocated at once at most; the largest shapes left out first


def spec_threads(spec: ClusterSpec) -> int:
    """Intra-op threads a rank of ``spec`` computes with: the count `calibrate` wrote into the device
    name ("..., N thread(s) per process"), else the cores shared among the node's ranks (as
    `runtime.launch` sets them)."""
    match = re.search(r"(\d+) thread\(s\) per process", spec.device.name)
    if match:
        return max(1, int(match.group(1)))
    return max(1, (os.cpu_count() or 1) // max(1, spec.devices_per_node))


@contextlib.contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """Compute with ``threads`` intra-op threads (what a rank computes with) inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def matmul_shape_time_ratios(
    shapes: list[tuple[int, int, int]],
    device_spec: DeviceSpec,
    dtype: str,
    threads: int = 1,
    budget_s: float = MODEL_SHAPES_BUDGET_S,
    train: bool = False,
) -> dict[tuple[int, int], float]:
    """Measured / priced time of each (M, K, N) product of ``shapes`` on this CPU process, keyed by
    (K, N), for `DeviceSpec.matmul_shape_time_ratios`: how much slower (> 1) or faster a shape runs
    than the spec's matmul fit says, relative to the shapes the fit was made on.

    Each product is timed in thread CPU time with ``threads`` intra-op threads (what a rank computes
    with), interleaved for about ``budget_s`` wall seconds with the fit's own shapes
    (`TRANSFORMER_MATMUL_SHAPES`, in fp32 as the fit timed them) and a (1 x 8) @ (8 x 8) product. The latter's time, the call's
    dispatch, which the per-node overhead prices already, is taken off each. A shape's measured /
    priced time is divided by the median of the same over the fit's shapes timed beside it, so the
    machine's speed at the moment (this VM changes speed in spells) cancels and the ratio carries the
    shape's own rate; the priced time is `costmodels.compute.op_time_s` of the product on
    ``device_spec`` without a launch term. With ``train``, a linear's backward products are timed too,
    the input gradient (M x N) @ (N x K) and the weight gradient (N x M) @ (M x K), and the ratio is
    their sum with the forward over three forward prices (the training step's `compute_factor`).

    A shape priced over ``_MODEL_SHAPE_MAX_S`` is timed with fewer rows (the ratio is taken as the same
    at any M; the fit's row term carries M); one priced under ``_MODEL_SHAPE_MIN_S`` (a fraction of its
    node's dispatch) is left out, and so are the largest past ``_MODEL_SHAPES_MAX_BYTES`` of operands.
    """
    dt, size = torch_dtype(dtype), DTYPE_BYTES[dtype]

    def price(m: int, k: int, n: int, in_dtype: str = dtype) -> float:
        return op_time_s(linear_flops(m, k, n), linear_bytes(m, k, n, in_dtype), device_spec, in_dtype, "matmul", rows=m, launch=False)  # fmt: skip

    kept: dict[tuple[int, int, int], list[tuple[str, int, int, int]]] = {}  # shape timed -> its products
    products: dict[tuple[str, int, int, int], None] = {}
    weights: set[tuple[int, int]] = set()  # (K, N) kept: one M per weight shape
    total = 0.0
    for m, k, n in sorted(dict.fromkeys(shapes), key=math.prod):
        priced = price(m, k, n)
        if priced > _MODEL_SHAPE_MAX_S:
            m = max(1, int(m * _MODEL_SHAPE_MAX_S / priced))
            priced = price(m, k, n)
        if priced < _MODEL_SHAPE_MIN_S or (k, n) in weights:
            continue
        # (form, M, K, N): "linear" F.linear(x (M, K), W (N, K)), as nn.Linear runs its forward; "mm" a plain
        # (M, K) @ (K, N), the input gradient dY @ W; "tmm" a (K, M) tensor transposed @ (K, N), the weight
        # gradient dY^T @ X (the layouts change a CPU kernel's rate by up to 1.5x at equal shapes)
        own = [("linear", m, k, n)] + ([("mm", m, n, k), ("tmm", n, m, k)] if train else [])
        nbytes = sum((a * b + b * c) * size for _, a, b, c in own if (_, a, b, c) not in products)
        if total + nbytes > _MODEL_SHAPES_MAX_BYTES:
            continue
        total += nbytes
        weights.add((k, n))
        kept[(m, k, n)] = own
        products.update(dict.fromkeys(own))
    if not kept:
        return {}
    # the fit's shapes, timed as the fit timed them (a plain (T x C) @ (C x N)) in fp32, the dtype a CPU
    # spec's fit is made on: in the plan's dtype they would cancel what that dtype's own fit gets wrong
    # (fp16 on the dev VM: its peak fitted on the few shapes fast enough to time, the tiny Llama's
    # products ran 2x faster than their ratios said)
    references = [("ref", *s) for s in TRANSFORMER_MATMUL_SHAPES if price(*s, "fp32") <= _MODEL_SHAPE_MAX_S]
    timed = [("mm", *_FLOOR_MATMUL_SHAPE), *references, *products]
    with intra_op_threads(threads):
        rates, _ = interleaved_rates(
            [
                _product("mm", m, k, n, torch.float32) if form == "ref" else _product(form, m, k, n, dt)
                for form, m, k, n in timed
            ],
            [2.0 * m * k * n for _, m, k, n in timed],
            torch.device("cpu"),
            budget_s,
        )
    floor_s = 2.0 * math.prod(_FLOOR_MATMUL_SHAPE) / rates[0]  # the call itself, which a node pays already
    seconds = {p: max(2.0 * math.prod(p[1:]) / rate - floor_s, 0.0) for p, rate in zip(timed[1:], rates[1:])}
    # > 1: the machine runs slower now than the fit says, on the fit's own shapes
    now = statistics.median(seconds[r] / price(*r[1:], "fp32") for r in references) if references else 1.0
    return {
        (k, n): sum(seconds[p] for p in own) / (len(own) * price(m, k, n)) / now
        for (m, k, n), own in kept.items()
    }


def conv_time_ratios(
    calls: list[tuple[tuple, float, float]],
    device_spec: DeviceSpec,
    dtype: str,
    threads: int = 1,
    budget_s: float = MODEL_SHAPES_BUDGET_S,
    train: bool = False,
) -> dict[tuple, float]:
    """Measured / priced time of each convolution of ``calls`` on this CPU process, keyed by its call,
    for `DeviceSpec.conv_time_ratios`: how much slower (> 1) or faster it runs than the spec's
    ``conv_efficiency`` (measured on `CONV_SHAPE`) says.

    ``calls``: (call, FLOP, bytes moved) per convolution, the call as `planner.frontend.analysis.conv_call`
    writes it. Each is run on random tensors of its shapes, in thread CPU time with ``threads`` intra-op
    threads, interleaved for about ``budget_s`` wall seconds with the spec's own `CONV_SHAPE` convolution
    (in fp32, as `calibrate` times it), whose measured / priced time divides every ratio (the
    machine's speed of the moment cancels). With
    ``train`` a call is timed forward and backward (input and weight gradients) against three forward
    prices (the training step's `compute_factor`). The dispatch of a call (a one-element add timed
    beside them), which the per-node overhead prices already, is taken off once for a forward and
    twice for a forward and backward. Calls priced under ``_CONV_MIN_S`` or over ``_MODEL_SHAPE_MAX_S``
    are left out (they keep the efficiency). Small convolutions are timed too, unlike small matmuls: a
    convolution's rate varies far more with its shape and its fixed cost is far above a node's
    dispatch (on the dev VM a 3x3 conv2d from 3 input channels at 32 x 32, priced 181 us, ran 1.44 ms:
    9.8 GFLOP/s against ~63 from 32 or 64; a Conv1d(8, 16, 4) over (4, 8, 64) ran 88 us).
    """
    dt = torch_dtype(dtype)

    def price(flops: float, moved: float, in_dtype: str = dtype) -> float:
        return op_time_s(flops, moved, device_spec, in_dtype, "conv", launch=False)

    kept = {c: (f, b) for c, f, b in calls if _CONV_MIN_S <= price(f, b) <= _MODEL_SHAPE_MAX_S}
    if not kept:
        return {}
    b_, c_, h_, w_ = CONV_SHAPE
    # the spec's own convolution in fp32, as `calibrate` times ``conv_efficiency``: in the plan's dtype it
    # would cancel what that dtype itself costs
    ref_call = (
        "aten.conv2d",
        (("tensor", CONV_SHAPE, "fp32"), ("tensor", (c_, c_, 3, 3), "fp32"), None, (1, 1), (1, 1)),
        True,
    )
    ref_bytes = 4.0 * (2 * b_ * c_ * h_ * w_ + c_ * c_ * 9)
    one = torch.zeros(1)
    with intra_op_threads(threads):
        fns = [lambda: torch.add(one, one), _conv_runner(ref_call, torch.float32, backward=False)]
        fns += [_conv_runner(c, dt, backward=train) for c in kept]
        seconds = [
            1.0 / r for r in interleaved_rates(fns, [1.0] * len(fns), torch.device("cpu"), budget_s)[0]
        ]
    floor_s, ref_s, *own_s = seconds
    now = (ref_s - floor_s) / price(CONV_FLOPS, ref_bytes, "fp32")
    factor, dispatches = (3.0, 2) if train else (1.0, 1)
    return {
        c: max(t - dispatches * floor_s, 0.0) / (factor * price(*kept[c])) / now for c, t in zip(kept, own_s)
    }


# elements an activation is timed over (`activation_time_ratios`): at least enough that its own work
# stands out of its dispatch, at most what keeps a call short
_ACTIVATION_MIN_ELEMENTS, _ACTIVATION_MAX_ELEMENTS = 1 << 14, 1 << 21
_COPY_REFERENCE_BYTES = 64 * 2**20  # the copy `calibrate` measures the memory bandwidth with


def activation_time_ratios(
    calls: list[tuple[tuple, int]],
    device_spec: DeviceSpec,
    dtype: str,
    threads: int = 1,
    budget_s: float = MODEL_SHAPES_BUDGET_S / 2,
    train: bool = False,
) -> dict[tuple, float]:
    """Measured / priced time of each activation of ``calls`` on this CPU process, keyed by its call,
    for `DeviceSpec.activation_time_ratios`: how much slower (> 1) or faster it runs than the
    memory-bound price `costmodels.compute.op_time_s` gives it (an element read and written).

    ``calls``: (call, elements) per activation, the call as `planner.frontend.analysis.activation_call`
    writes it, the elements those of its largest node (clamped to ``_ACTIVATION_MIN_ELEMENTS`` ..
    ``_ACTIVATION_MAX_ELEMENTS``). Each is run over that many random elements and over one, in
    thread CPU time with ``threads`` intra-op threads, interleaved for about ``budget_s`` wall seconds; then
    the copy the spec's memory bandwidth was measured on (64 MiB, `_copy_bytes_per_s`) is timed, and its
    measured / priced time divides every ratio (the machine's speed of the moment cancels). The
    one-element time (the call's dispatch, which the per-node overhead prices already) is taken off.
    With ``train`` a call is timed forward and backward (the input's gradient) against three forward
    prices (the training step's `compute_factor`).

    A ratio is at least 1: an activation is priced no cheaper than any other memory-bound op of its
    size. Small ones run from cache, faster than the memory-bound price (a plain negation of 64 x 256
    fp32, 1.9 us against 10 us priced, on the dev VM), as every small op does; the per-node overhead
    is measured net of that price (`calibrate`'s ``probe_roofline``), so an activation is only priced
    up, for the erf, tanh or exp it computes (an exact GELU over the same elements: 14 us).
    """
    dt = torch_dtype(dtype)
    size = DTYPE_BYTES[dtype]

    def price(elements: int) -> float:
        return op_time_s(float(elements), 2.0 * elements * size, device_spec, dtype, "memory", launch=False)

    kept = {c: min(max(n, _ACTIVATION_MIN_ELEMENTS), _ACTIVATION_MAX_ELEMENTS) for c, n in calls}
    if not kept:
        return {}
    src = torch.ones(_COPY_REFERENCE_BYTES // 4)
    dst = torch.empty_like(src)
    fns: list[Callable[[], object]] = []
    for call, elements in list(kept.items()):
        pair = [_activation_runner(call, n, dt, train) for n in (elements, 1)]
        try:
            for fn in pair:
                fn()
        except (RuntimeError, TypeError, ValueError):  # an op that cannot run on its own keeps its price
            del kept[call]
            continue
        fns += pair
    if not kept:
        return {}
    cpu = torch.device("cpu")
    with intra_op_threads(threads):
        # the copy in a rotation of its own: an op timed right after it ran up to 5x slower (a 64 KiB
        # GELU 18 -> 101 us on the dev VM), while in a step ops follow the model's own
        own_s = [1.0 / r for r in interleaved_rates(fns, [1.0] * len(fns), cpu, budget_s * 0.8)[0]]
        copy_s = 1.0 / interleaved_rates([lambda: dst.copy_(src)], [1.0], cpu, budget_s * 0.2)[0][0]
    now = copy_s / op_time_s(0.0, 2.0 * _COPY_REFERENCE_BYTES, device_spec, "fp32", "memory", launch=False)
    factor = 3.0 if train else 1.0
    return {
        call: max(1.0, (own_s[2 * i] - own_s[2 * i + 1]) / (factor * price(elements)) / now)
        for i, (call, elements) in enumerate(kept.items())
    }


def graph_node_time_ratio(
    run: Callable[[], object],
    nodes: int,
    roofline_s: float,
    priced_node_s: float,
    reference_node_s: float,
    threads: int = 1,
    budget_s: float = MODEL_SHAPES_BUDGET_S,
) -> float | None:
    """Measured / priced per-node time of a model's own captured graph on this CPU process, for
    `DeviceSpec.decode_node_time_ratio`: how much slower (> 1) or faster its nodes dispatch than the
    per-node overhead the cost model gives them.

    ``run``: one call of the graph (real tensors, no grad); ``nodes``: the op nodes it executes
    (`planner.solver.costing.graph_node_count`); ``roofline_s``: the roofline the cost model prices
    for its ops at the spec's speed (`graph_roofline_s`); ``priced_node_s``: the per-node overhead
    priced for it (`costmodels.compute.per_node_overhead_s`); ``reference_node_s``: the spec's reading
    of the toy probe graph's per-node slope (``probe_node_overhead_s``). The graph is timed in thread
    CPU time interleaved with the toy probe graph at `PROBE_BLOCKS`, for about ``budget_s`` wall
    seconds with ``threads`` intra-op threads; the probe's slope now over its reading at calibration
    is the machine's speed of the moment, which cancels (as the speed probe does for a run), and so
    does the per-process contention the spec's figures carry (measured with all its processes busy:
    on the 2-vCPU dev VM the decode graphs' ratio read 1.31-1.42 in one process and in each of two
    running at once, 2026-12-01).

    Why: the probe graph's op mix (linears, views, SDPA, norms) is a transformer block's; a decode
    step also writes its cache in place (``index_copy_`` / ``index_put_``), builds its mask and
    gathers positions, ops that dispatch slower. On the dev VM the HF Llama decode graph took 6.7 us
    per node in one process against the probe's 4.9 us (2026-12-01).

    Returns None when the graph has no nodes or its time net of the roofline is not positive (the
    priced figures are kept)."""
    if nodes <= 0:
        return None
    cpu = torch.device("cpu")
    (small, _, n_small), (big, _, n_big) = (_probe_graph(b, cpu) for b in PROBE_BLOCKS)
    with intra_op_threads(threads), torch.no_grad():
        graph_rate, small_rate, big_rate = interleaved_rates([run, small, big], [1.0] * 3, cpu, budget_s)[0]
    slope_now = (1.0 / big_rate - 1.0 / small_rate) / (n_big - n_small)
    net_s = 1.0 / graph_rate - roofline_s
    if slope_now <= 0 or net_s <= 0 or reference_node_s <= 0 or priced_node_s <= 0:
        return None
    return (net_s / nodes) / (priced_node_s * slope_now / reference_node_s)


# A model's memory-bound ops by their ATen name, each as `memory_dtype_time_ratio` runs it on a
# (rows, width) activation x (and y of its shape): what a transformer's norms, rotary embeddings,
# residuals and gates are made of. An op not named here is timed as an add (a binary elementwise op,
# the commonest kind).
_MEMORY_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {
    "aten.add": lambda x, y: x + y,
    "aten.mul": lambda x, y: x * y,
    "aten.sub": lambda x, y: x - y,
    "aten.div": lambda x, y: x / y,
    "aten.pow": lambda x, y: x.pow(2),
    "aten.mean": lambda x, y: x.mean(-1, keepdim=True),
    "aten.sum": lambda x, y: x.sum(-1, keepdim=True),
    "aten.rsqrt": lambda x, y: torch.rsqrt(x),
    "aten.neg": lambda x, y: -x,
    "aten.cat": lambda x, y: torch.cat([x[:, : x.shape[1] // 2], y[:, x.shape[1] // 2 :]], -1),
    "aten.repeat_interleave": lambda x, y: x.repeat_interleave(2, dim=0),
    "aten.clone": lambda x, y: x.clone(),
}
_MEMORY_WIDTH = 128  # the activation's last dimension (a head's or a small model's width)
_MEMORY_CALL_ELEMENTS = 1 << 18  # each timed call repeats its op over at least this many elements


def memory_dtype_time_ratio(
    ops: dict[str, float],
    elements: int,
    dtype: str,
    threads: int = 1,
    budget_s: float = MODEL_SHAPES_BUDGET_S / 2,
) -> float | None:
    """Measured / priced time of a model's plain memory-bound ops in ``dtype`` relative to the same
    ops in fp32 on this CPU process, for `DeviceSpec.memory_dtype_time_ratios`: priced by bytes, a
    16-bit op takes half an fp32 op's time; this is how much longer it takes than that (2.0: as long as
    fp32's).

    ``ops``: bytes read + written by the model's memory-bound nodes, by ATen op name ("aten.add"), its
    activations left out (timed on their own, `activation_time_ratios`); each op of `_MEMORY_OPS` (an
    unknown one as an add) is run over ``elements`` elements (the model's median memory node on a
    rank, at least ``_ACTIVATION_MIN_ELEMENTS``) in ``dtype`` and in fp32, and over one row of
    `_MEMORY_WIDTH`, in thread CPU time with ``threads`` intra-op threads, interleaved for about
    ``budget_s`` wall seconds. Each op's ratio is its time in ``dtype`` over fp32's, both net of the
    one-row call (about the dispatch, priced per node already);
    the ops' ratios are weighed by their bytes (an op whose fp32 time is mostly that call is left out),
    and scaled by fp32's bytes over ``dtype``'s. At least 1: an op is priced no cheaper than its bytes.
    None for fp32, a model without such ops, or none timed."""
    size = DTYPE_BYTES[dtype]
    total = sum(ops.values())
    if size >= DTYPE_BYTES["fp32"] or total <= 0:
        return None
    weights: dict[str, float] = {}
    for name, nbytes in ops.items():
        key = name if name in _MEMORY_OPS else "aten.add"
        weights[key] = weights.get(key, 0.0) + nbytes / total
    rows = max(1, max(elements, _ACTIVATION_MIN_ELEMENTS) // _MEMORY_WIDTH)
    reps = max(1, _MEMORY_CALL_ELEMENTS // (rows * _MEMORY_WIDTH))

    def runner(op: Callable, dt: torch.dtype, r: int) -> Callable[[], object]:
        gen = torch.Generator().manual_seed(0)
        x, y = (torch.rand(r, _MEMORY_WIDTH, generator=gen).add_(0.5).to(dt) for _ in range(2))

        def run() -> None:
            for _ in range(reps):
                op(x, y)

        return run

    names = list(weights)
    fns = [
        runner(_MEMORY_OPS[n], dt, r)
        for n in names
        for dt in (torch_dtype(dtype), torch.float32)
        for r in (rows, 1)
    ]
    with intra_op_threads(threads):
        rates, _ = interleaved_rates(fns, [1.0] * len(fns), torch.device("cpu"), budget_s)
    seconds = [1.0 / r for r in rates]
    ratio = weight = 0.0
    for i, name in enumerate(names):
        own, own_one, fp32, fp32_one = seconds[4 * i : 4 * i + 4]
        if fp32 - fp32_one < 0.5 * fp32:  # the call's dispatch, not its elements, is what was timed
            continue
        ratio += weights[name] * max(own - own_one, 0.0) / (fp32 - fp32_one)
        weight += weights[name]
    if weight <= 0:
        return None
    return max(1.0, ratio / weight * DTYPE_BYTES["fp32"] / size)


# the longest priced call an attention core is timed with (`attention_time_ratios`): at least 3 rounds
# of it run in a planning step; one 128-wide head of 2,048 tokens, forward and backward, is ~0.16 s on
# the 2-vCPU dev VM
_ATTENTION_MAX_S = 0.2


def attention_time_ratios(
    calls: list[tuple[int, int, int, int, bool]],
    sequences: int,
    device_spec: DeviceSpec,
    dtype: str,
    threads: int = 1,
    budget_s: float = MODEL_SHAPES_BUDGET_S / 2,
    train: bool = False,
) -> dict[tuple, float]:
    """Measured / priced time of each attention core of ``calls`` on this CPU process, keyed by its
    call (query heads on a rank, query length, key length, head dim, causal), for
    `DeviceSpec.attention_time_ratios`: how much slower (> 1) or faster the model's own cores run than
    the spec's one ``attention_efficiency`` prices them (measured on `SDPA_SHAPE`'s forward).

    Each is ``scaled_dot_product_attention`` on ``sequences`` sequences, K and V at the query heads
    (fewer sequences, then fewer heads, where its price passes ``_ATTENTION_MAX_S``: the ratio is taken
    as the same at any batch and head count; a core too long even at one head of one sequence is left
    out), in
    thread CPU time with ``threads`` intra-op threads, interleaved for about ``budget_s`` wall seconds
    with the calibration's own core (`SDPA_SHAPE`, causal, forward, fp32 as `calibrate` times it), whose measured / priced time
    divides every ratio (the machine's speed of the moment cancels). With ``train`` a core is timed
    forward and backward against three forward prices (the training step's `compute_factor`). A causal
    call whose query and key lengths differ is left out (its mask's alignment is the model's)."""
    dt = torch_dtype(dtype)

    def price(b: int, h: int, q: int, k: int, hd: int, causal: bool, in_dtype: str = dtype) -> float:
        flops = attention_flops(b, h, q, k, hd, causal)
        moved = attention_bytes(b, h, h, q, k, hd, in_dtype)
        return op_time_s(flops, moved, device_spec, in_dtype, "attention", launch=False, seq=(q, k, causal))

    factor = 3.0 if train else 1.0
    reference = (*SDPA_SHAPE[:3], SDPA_SHAPE[2], SDPA_SHAPE[3], True)  # (b, h, q, k, hd, causal)
    timed: dict[tuple, tuple] = {}
    for h, q, k, hd, causal in dict.fromkeys(calls):
        if causal and q != k:
            continue

        def too_long(b: int, heads: int) -> bool:
            return factor * price(b, heads, q, k, hd, causal) > _ATTENTION_MAX_S  # noqa: B023 - called in this iteration only

        b, heads = max(1, sequences), h
        while b > 1 and too_long(b, heads):
            b //= 2
        while heads > 1 and too_long(b, heads):
            heads //= 2
        if too_long(b, heads):
            continue  # one head of one sequence too long to time in a planning step: priced as before
        timed[(h, q, k, hd, causal)] = (b, heads, q, k, hd, causal)
    if not timed:
        return {}
    # the reference in the dtype `calibrate` measured ``attention_efficiency`` in (fp32 on a CPU): timed
    # in the plan's dtype its ratio would cancel what that dtype itself costs (bf16 attention on this
    # CPU: forward 1.3x, backward 5.8x fp32's time at the tiny Llama's cores, where it is priced 2x faster)
    fns = [_attention_runner(*reference, torch.float32, False)] + [
        _attention_runner(*c, dt, train) for c in timed.values()
    ]
    with intra_op_threads(threads):
        rates, _ = interleaved_rates(fns, [1.0] * len(fns), torch.device("cpu"), budget_s)
    seconds = [1.0 / r for r in rates]
    now = seconds[0] / price(*reference, in_dtype="fp32")  # > 1: the machine runs slower now than calibrated
    return {key: s / (factor * price(*c)) / now for (key, c), s in zip(timed.items(), seconds[1:])}


def _attention_runner(
    b: int, h: int, q: int, k: int, hd: int, causal: bool, dt: torch.dtype, train: bool
) -> Callable[[], object]:
    """One call of SDPA over (b, h, q, hd) queries and (b, h, k, hd) keys and values; with ``train``
    also its backward (the three inputs' gradients)."""
    gen = torch.Generator().manual_seed(0)
    qt, kt, vt = (torch.randn(b, h, n, hd, generator=gen).to(dt).requires_grad_(train) for n in (q, k, k))
    grad = torch.randn(b, h, q, hd, generator=gen).to(dt)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if not train:
        return lambda: sdpa(qt, kt, vt, is_causal=causal)

    def step() -> None:
        qt.grad = kt.grad = vt.grad = None
        sdpa(qt, kt, vt, is_causal=causal).backward(grad)

    return step


def _activation_runner(
    call: tuple, elements: int, dtype: torch.dtype, backward: bool
) -> Callable[[], object]:
    """The activation ``call`` (`planner.frontend.analysis.activation_call`) over ``elements`` random
    values; with ``backward``, forward then the gradient into its input."""
    name, args, kwargs = call
    op = getattr(torch.ops.aten, name.removeprefix("aten."))
    x = torch.randn(elements).to(dtype).requires_grad_(backward)
    if not backward:
        return lambda: op(x, *args, **dict(kwargs))
    grad = torch.randn(elements).to(dtype)
    return lambda: torch.autograd.grad(op(x, *args, **dict(kwargs)), x, grad)


def _conv_runner(call: tuple, dtype: torch.dtype, backward: bool) -> Callable[[], object]:
    """The convolution ``call`` (`planner.frontend.analysis.conv_call`) on random tensors; with
    ``backward``, forward then backward of the output's sum into the weight and bias, and into the
    input when the call says it needs a gradient."""
    name, template, input_grad = call
    op = getattr(torch.ops.aten, name.removeprefix("aten."))

    def real(a: object) -> object:
        if isinstance(a, tuple) and len(a) == 3 and a[0] == "tensor":
            t = torch.randn(a[1]).to(dtype if a[2] in DTYPE_BYTES else torch.float32)
            return t.requires_grad_(backward)
        if isinstance(a, tuple):
            return [real(x) for x in a]
        return a

    args = [real(a) for a in template]
    if not backward:
        return lambda: op(*args)
    if not input_grad:
        args[0].requires_grad_(False)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return lambda: torch.autograd.grad(op(*args).sum(), leaves)


def _product(form: str, m: int, k: int, n: int, dtype: torch.dtype) -> Callable[[], object]:
    """A (M x K) @ (K x N) product in the memory layout ``form`` names (`matmul_shape_time_ratios`)."""
    if form == "linear":
        x, weight = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
        return lambda: torch.nn.functional.linear(x, weight)
    if form == "tmm":
        a, b = torch.randn(k, m).to(dtype), torch.randn(k, n).to(dtype)
        return lambda: a.t() @ b
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    return lambda: a @ b


def _cache_bytes() -> float | None:
    """Size of the CPU's last-level cache (Linux sysfs), None when unknown."""
    best: tuple[int, float] | None = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        size = float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)
        if best is None or level > best[0]:
            best = (level, size)
    return None if best is None else best[1]


def stream_bandwidth(device: torch.device, flops_per_s: float, half_rows: float = 0.0) -> float | None:
    """Bytes / s of weight streaming in a matmul far larger than the cache, (64 x 1024) @ (1024 x
    32768) fp32 (134 MB weight): ``bytes_moved / (t - compute)``, compute = flops at ``flops_per_s``
    times the row penalty T / (T + ``half_rows``) that `op_time_s` also applies (without it the
    small-T slowness was counted twice, as rows and as streaming), so that
    ``costmodels.compute.op_time_s`` reproduces the measured time; None when it runs at the compute
    rate (no streaming penalty)."""
    t_, c, n = STREAM_MATMUL_SHAPE
    x, w = torch.randn(t_, c, device=device), torch.randn(c, n, device=device)
    t = _median_time_s(lambda: x @ w, device, budget_s=1.0)
    flops, moved = 2.0 * t_ * c * n, 4.0 * (t_ * c + c * n + t_ * n)
    extra = t - flops / (flops_per_s * t_ / (t_ + half_rows))
    return moved / extra if extra > 0.05 * t else None


def _attention_flops_per_s(device: torch.device, dtype: str) -> float:
    """FLOP/s of causal SDPA at ``SDPA_SHAPE`` (batch, heads, seq, head dim), counted as
    ``costmodels.compute.attention_flops(causal=True)`` counts it."""
    b, h, t, hd = SDPA_SHAPE
    q, k, v = (torch.randn(b, h, t, hd, device=device).to(torch_dtype(dtype)) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    (rate,), _ = interleaved_rates(
        [lambda: sdpa(q, k, v, is_causal=True)], [4.0 * b * h * t * t * hd / 2.0], device, 0.5
    )
    return rate


def _copy_bytes_per_s(device: torch.device, nbytes: int) -> float:
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2.0 * nbytes / _median_time_s(lambda: dst.copy_(src), device, budget_s=1.0)


# an fp32 product of about 0.27 GFLOP (a few ms on one core): long enough that thread start-up does not
# decide the ratio, short enough for rounds of both thread counts in a fraction of a second
_SPEEDUP_MATMUL_SIZE = 512
# intra-op threads that compute a product slower than one thread: the cores they were given are
# taken (OpenMP threads wait at each barrier for a descheduled peer: 4x slower on the dev VM with
# another process computing, 2 threads on 2 cores); above 1 on a quiet machine (1.6-1.9x at 2 threads)
OVERSUBSCRIBED_SPEEDUP = 0.9


def _thread_speedup(rounds: int = 9) -> float:
    """Wall time of an fp32 (512 x 512) @ (512 x 512) product on one intra-op thread over its time on
    this process's threads (`torch.get_num_threads`), alternated in ``rounds`` rounds, medians. Below
    `OVERSUBSCRIBED_SPEEDUP` the threads did not get their cores: every threaded figure measured then
    is too slow, by more than the load average shows (`busy_message`)."""
    n = _SPEEDUP_MATMUL_SIZE
    a, b = torch.randn(n, n), torch.randn(n, n)
    threads = torch.get_num_threads()
    times: dict[int, list[float]] = {1: [], threads: []}
    for r in range(rounds + 1):
        for k in (1, threads) if r % 2 else (threads, 1):
            with intra_op_threads(k):
                start = time.perf_counter()
                torch.mm(a, b)
                if r:  # the first round warms both up
                    times[k].append(time.perf_counter() - start)
    return statistics.median(times[1]) / max(statistics.median(times[threads]), 1e-12)


def _launch_overhead_s(device: torch.device, ops: int = 200) -> float:
    x = torch.zeros(1, device=device)

    def burst() -> None:
        for _ in range(ops):
            torch.add(x, 1.0, out=x)

    return _median_time_s(burst, device, budget_s=0.5) / ops


class _ProbeBlock(nn.Module):
    """A transformer block at toy sizes (dim 8, 2 heads, 4 tokens): its compute is ~0, so the time of
    its captured graph is the per-node overhead. Its op mix is a Llama / GPT block's: linears, views
    and transposes, a RoPE-like cat / slice / neg, SDPA, norms, SwiGLU, residual adds."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.norm(x)
        q, k, v = self.qkv(h).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        q = torch.cat([-q[..., 1:], q[..., :1]], dim=-1) * 0.5 + q
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, c))
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        g, u = self.up(h).chunk(2, dim=-1)
        return x + self.down(torch.cat([torch.nn.functional.silu(g) * u, g.relu()], -1)[..., : 2 * c])


def probe_model(blocks: int, dim: int = TOY_PROBE[0], heads: int = TOY_PROBE[1]) -> nn.Module:
    """The probe graph's model: ``blocks`` tiny transformer blocks (`_ProbeBlock`) in sequence; its
    input is (1, tokens, dim)."""
    return nn.Sequential(*[_ProbeBlock(dim, heads) for _ in range(blocks)])


def _probe_graph(
    blocks: int,
    device: torch.device,
    dim: int = TOY_PROBE[0],
    heads: int = TOY_PROBE[1],
    tokens: int = TOY_PROBE[2],
) -> tuple[Callable[[], object], Callable[[], object], int]:
    """(forward, forward + backward, node count) of the captured probe graph with ``blocks`` blocks.

    Captured with ``torch.export`` (non-strict, ATen ops) as `planner.frontend.capture` does; nodes
    counted: every ``call_function`` except tuple indexing (``getitem`` is a plain Python index)."""
    model = probe_model(blocks, dim, heads).to(device)
    x = torch.randn(1, tokens, dim, device=device)
    gm = torch.export.export(model, (x,), strict=False).module()
    nodes = sum(1 for n in gm.graph.nodes if n.op == "call_function" and "getitem" not in str(n.target))

    def forward() -> None:
        with torch.no_grad():
            gm(x)

    def train() -> None:
        gm(x).sum().backward()

    return forward, train, nodes


def _per_node_s(
    small: tuple[float, float], big: tuple[float, float], nodes: int, roofline_s: float = 0.0
) -> tuple[float, float]:
    """(forward, backward) seconds per node from the (forward, forward + backward) times of a probe
    graph with ``nodes`` fewer nodes (``small``) and more (``big``): the slopes, the forward net of
    ``roofline_s`` (the priced time of the extra nodes' ops) and the backward net of twice it."""
    (f_small, t_small), (f_big, t_big) = small, big
    forward = (f_big - f_small - roofline_s) / nodes
    backward = ((t_big - f_big) - (t_small - f_small) - 2 * roofline_s) / nodes
    return forward, backward


NODE_PROBE_WINDOWS = 3  # node-overhead windows spread over the calibration; the spec takes their median


def _node_overhead_s(device: torch.device, budget_s: float = 1.5) -> tuple[float, float, int, list[float]]:
    """(forward seconds per node, backward seconds per forward node, nodes of the larger probe, the
    `SIZED_PROBE` graph's median seconds [forward, forward + backward] at each of ``PROBE_BLOCKS``):
    the slope of the probe graph's time over its node count between ``PROBE_BLOCKS`` (fixed costs of
    a call cancel); timed by `clock`, interleaved for ``budget_s``, so all processes measure at once.

    One window can fall into a slow spell of a shared VM (this 2-vCPU machine measured 7.5 us per
    node in some 1.5 s windows and 13-14 us in others minutes apart, 2026-11-30): `calibrate` measures
    ``NODE_PROBE_WINDOWS`` windows at different points of its run and keeps the median."""
    probes = [_probe_graph(b, device) for b in PROBE_BLOCKS]
    sized = [_probe_graph(b, device, *SIZED_PROBE) for b in PROBE_BLOCKS]
    fns = [fn for forward, train, _ in (*probes, *sized) for fn in (forward, train)]
    counts = [n for *_, n in probes]
    rates, _ = interleaved_rates(fns, [1.0] * len(fns), device, budget_s=budget_s)
    forward_s, backward_s = _per_node_s(
        (1 / rates[0], 1 / rates[1]), (1 / rates[2], 1 / rates[3]), counts[1] - counts[0]
    )
    return max(0.0, forward_s), max(0.0, backward_s), counts[1], [1 / r for r in rates[4:]]


class SpeedProbe:
    """The calibration's per-node overhead measurement (`_node_overhead_s`: the probe graph at
    ``PROBE_BLOCKS``) and one matmul (`PROBE_MATMUL_SHAPE`, fp32), re-timed beside a run's steps so
    that the run can say how fast the machine dispatched ops and multiplied while it was timed.

    A shared VM changes speed in spells of 10-20 s: on this 2-vCPU machine the probe's per-node
    overhead read 7.0-7.6 us in some 3-s windows and 14-17 us in others of the same minute, with the
    same model's forward at 3.1-3.9 ms and 5.8-7.4 ms beside it (60-s trace of two processes,
    2026-11-30); a 256^3 matmul moved by ~10% meanwhile. A spec calibrated in one spell and a run
    timed in another then differ by up to 2x whatever the cost model does; the probe measures the
    spell the run was in.

    `sample` times each probe graph once (forward; with ``backward`` also forward + backward) and the
    matmul once, by `clock`, as the calibration does. Building it captures two small graphs (~2 s).
    """

    def __init__(self, device: torch.device, backward: bool = False) -> None:
        self.device = device
        probes = [_probe_graph(b, device) for b in PROBE_BLOCKS]
        self._nodes = probes[1][2] - probes[0][2]
        graphs = [fn for forward, train, _ in probes for fn in ((forward, train) if backward else (forward,))]
        t, c, n = PROBE_MATMUL_SHAPE
        a, w = torch.randn(t, c, device=device), torch.randn(c, n, device=device)
        self._fns = [*graphs, lambda: torch.mm(a, w)]
        self._times: list[list[float]] = [[] for _ in self._fns]
        for fn in self._fns:  # warm-up: the first call of a captured graph is slower
            fn()
        _sync(device)

    def sample(self) -> float:
        """Time each probe once; returns the wall seconds this took."""
        start = time.perf_counter()
        for fn, times in zip(self._fns, self._times):
            times.append(_timed(fn, self.device)[0])
        return time.perf_counter() - start

    @property
    def samples(self) -> int:
        return len(self._times[0])

    def overhead_s(self) -> tuple[float, float | None] | None:
        """(forward seconds per node, backward seconds per forward node or None without ``backward``)
        from the medians of the samples, as `_node_overhead_s`; None before any sample."""
        if not self.samples:
            return None
        med = [statistics.median(t) for t in self._times[:-1]]
        if len(med) == 2:
            return max(0.0, (med[1] - med[0]) / self._nodes), None
        forward, backward = _per_node_s((med[0], med[1]), (med[2], med[3]), self._nodes)
        return max(0.0, forward), max(0.0, backward)

    def matmul_flops_per_s(self) -> float | None:
        """FLOP/s of the probe matmul (median time of the samples); None before any sample."""
        if not self.samples:
            return None
        t, c, n = PROBE_MATMUL_SHAPE
        return 2 * t * c * n / max(statistics.median(self._times[-1]), 1e-9)


CONV_SHAPE = (8, 64, 16, 16)  # (batch, channels in = out, height, width) of the timed 3x3 convolution
CONV_FLOPS = 2.0 * math.prod(CONV_SHAPE) * CONV_SHAPE[1] * 9  # its FLOP, as the analysis counts a conv
POOL_SHAPE = (8, 32, 32, 32)  # (batch, channels, height, width) of the timed 2x2 max pool


def _conv_and_pool_rates(device: torch.device) -> tuple[float, float]:
    """(FLOP/s of a 3x3 conv2d at ``CONV_SHAPE``, bytes / s of a 2x2 max pool at ``POOL_SHAPE``),
    counted as `planner.frontend.analysis` counts them (conv: 2 * out * C_in * 9; pool: bytes read +
    written), timed interleaved by `clock`."""
    b, c, h, w = CONV_SHAPE
    x = torch.randn(b, c, h, w, device=device)
    weight = torch.randn(c, c, 3, 3, device=device)
    p = torch.randn(*POOL_SHAPE, device=device)
    conv = torch.nn.functional.conv2d
    pool = torch.nn.functional.max_pool2d
    flops = CONV_FLOPS
    pool_bytes = 4.0 * p.numel() * (1 + 1 / 4)
    rates, _ = interleaved_rates(
        [lambda: conv(x, weight, padding=1), lambda: pool(p, 2)], [flops, pool_bytes], device, 1.0
    )
    return rates[0], rates[1]


ADAM_SMALL_TENSORS = (8, 2**20)  # (tensors, fp32 elements each): 4 MiB, under LARGE_TENSOR_BYTES
ADAM_LARGE_ELEMENTS = 12 * 2**20  # one fp32 tensor of 48 MiB, over it
# (tensors, fp32 elements each) of two more Adam steps that small models' parameters look like: 256
# elements (the per-tensor loop's fixed cost dominates) and 256 KiB (in cache, under
# `costmodels.compute.CACHED_TENSOR_BYTES`); the two give the fixed cost per tensor and the in-cache
# rate per parameter
ADAM_TINY_TENSORS = (64, 256)
ADAM_CACHED_TENSORS = (16, 2**16)


def _optimizer_rates(device: torch.device) -> tuple[float, float, float, float, float]:
    """(seconds per parameter of torch.optim.Adam's step over `ADAM_SMALL_TENSORS`, the same over one
    tensor of `ADAM_LARGE_ELEMENTS`, bytes / s written by a zero fill into a freshly allocated tensor of
    that size, seconds per tensor of the step's loop, seconds per parameter of in-cache tensors), timed
    interleaved by `clock` (page faults are the thread's own system time). The last two are solved
    from `ADAM_TINY_TENSORS` and `ADAM_CACHED_TENSORS` (time per tensor = fixed + elements x rate). The
    runtime's optimizer (`runtime.data_parallel`) runs the same torch.optim.Adam with its defaults."""

    def stepper(sizes: list[int]) -> Callable[[], object]:
        params = [nn.Parameter(torch.randn(n, device=device)) for n in sizes]
        for p in params:
            p.grad = torch.randn_like(p)
        return torch.optim.Adam(params, lr=1e-3).step

    count, each = ADAM_SMALL_TENSORS
    (tiny_n, tiny_each), (cached_n, cached_each) = ADAM_TINY_TENSORS, ADAM_CACHED_TENSORS
    fresh_bytes = 4.0 * ADAM_LARGE_ELEMENTS
    rates, _ = interleaved_rates(
        [
            stepper([each] * count),
            stepper([ADAM_LARGE_ELEMENTS]),
            lambda: torch.zeros(ADAM_LARGE_ELEMENTS, device=device),
            stepper([tiny_each] * tiny_n),
            stepper([cached_each] * cached_n),
        ],
        [float(count * each), float(ADAM_LARGE_ELEMENTS), fresh_bytes, float(tiny_n), float(cached_n)],
        device,
        1.5,
    )
    tiny_s, cached_s = 1.0 / rates[3], 1.0 / rates[4]  # seconds per tensor
    per_param = max(0.0, (cached_s - tiny_s) / (cached_each - tiny_each))
    per_tensor = max(0.0, tiny_s - tiny_each * per_param)
    return 1.0 / rates[0], 1.0 / rates[1], rates[2], per_tensor, per_param


def _rounds_agreed(round_fn: Callable[[], object], device: torch.device, budget_s: float) -> int:
    """Rounds that fit ``budget_s`` after one timed warm-up round, the same number on every rank
    (collectives must be called equally often everywhere, or ranks pair up wrongly)."""
    t0 = time.perf_counter()
    round_fn()
    _sync(device)
    (t_round,) = _reduce([time.perf_counter() - t0], dist.ReduceOp.MAX, device)
    return int(min(_MAX_ROUNDS, max(_MIN_ROUNDS, budget_s // max(t_round, 1e-9))))


def _interleaved_medians_s(
    fns: list[Callable[[], object]], device: torch.device, budget_s: float
) -> list[float]:
    """Median time of each of ``fns``, timed in interleaved rounds (fn0, fn1, ..., fn0, ...), so a burst
    of load from elsewhere on the machine spreads over all of them instead of skewing one."""
    times: list[list[float]] = [[] for _ in fns]

    def one_round(start: int = 0, record: bool = False) -> None:
        for i in range(len(fns)):  # rotate the order each round, the same way on every rank
            k = (start + i) % len(fns)
            dist.barrier()  # start together: a rank still busy with the last fn would inflate this one
            t0 = time.perf_counter()
            fns[k]()
            _sync(device)
            if record:
                times[k].append(time.perf_counter() - t0)

    for r in range(_rounds_agreed(one_round, device, budget_s)):
        one_round(start=r, record=True)
    return [statistics.median(t) for t in times]


def _all_reduce_times_s(
    device: torch.device, flops_per_s: float, sizes: tuple[int, ...] = ALL_REDUCE_SIZES_BYTES
) -> list[float]:
    """Wall time of an all-reduce of each of ``sizes`` (bytes) as a tensor-parallel graph
    issues it: right after a compute segment of about ``_SEGMENT_S`` (a square matmul) on every rank,
    with no barrier, so it includes waiting for the peer rank and for the backend's threads to be
    scheduled. The mean over interleaved rounds (the same number on every rank), less the 10% fastest
    and slowest: on a busy CPU a call's time is bimodal (the backend's thread runs at once, or waits
    for a scheduler slice), and a step that issues many all-reduces takes about the sum of their
    means, not of their medians (2-vCPU dev VM, 2026-12-01: the 10%-trimmed mean 10-60% above the
    median below 1 MiB, and steadier from one calibration to the next: 4 B 520-750 us against
    350-820 us in four windows)."""
    n = int(min(4096, max(32, round((_SEGMENT_S * flops_per_s / 2.0) ** (1 / 3)))))
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    bufs = [torch.ones(max(1, nbytes // 4), device=device) for nbytes in sizes]
    times: list[list[float]] = [[] for _ in bufs]

    def one_round(start: int = 0, record: bool = False) -> None:
        for i in range(len(bufs)):
            k = (start + i) % len(bufs)
            a @ b
            _sync(device)
            t0 = time.perf_counter()
            dist.all_reduce(bufs[k])
            _sync(device)
            if record:
                times[k].append(time.perf_counter() - t0)

    for r in range(_rounds_agreed(one_round, device, budget_s=3.0)):
        one_round(start=r, record=True)
    return [trimmed_mean(t) for t in times]


BURST_COLLECTIVES = 8  # back-to-back asynchronous all-reduces timed as one burst (`_burst_time_s`)


def _burst_time_s(device: torch.device, flops_per_s: float) -> float:
    """Wall time of `BURST_COLLECTIVES` asynchronous all-reduces of `CALL_SIZE_BYTES` issued back to
    back (then waited), right after a compute segment as `_all_reduce_times_s` times one: the stream
    the ZeRO-2 / FSDP runtime issues, one collective per layer, where every call after the first
    finds the backend's thread running (2-vCPU dev VM, gloo, 2 ranks, 2026-12-02: 8 in 6.1 ms where
    one took 1.1 ms). The 10%-trimmed mean over interleaved rounds."""
    n = int(min(4096, max(32, round((_SEGMENT_S * flops_per_s / 2.0) ** (1 / 3)))))
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    bufs = [torch.ones(max(1, CALL_SIZE_BYTES // 4), device=device) for _ in range(BURST_COLLECTIVES)]
    times: list[float] = []

    def one_round(start: int = 0, record: bool = False) -> None:
        a @ b
        _sync(device)
        t0 = time.perf_counter()
        works = [dist.all_reduce(buf, async_op=True) for buf in bufs]
        for work in works:
            work.wait()
        _sync(device)
        if record:
            times.append(time.perf_counter() - t0)

    for r in range(_rounds_agreed(one_round, device, budget_s=1.0)):
        one_round(start=r, record=True)
    return trimmed_mean(times)


def burst_latency_s(burst_s: float, call_s: float, alpha_s: float, n: int) -> float:
    """The alpha (per step of a ring, `costmodels.comm`) of each collective after the first of a
    back-to-back stream: a burst of `BURST_COLLECTIVES` all-reduces took ``burst_s`` where one took
    ``call_s`` (both of `CALL_SIZE_BYTES`, so all latency), and one all-reduce's alpha is ``alpha_s``
    over its 2 (n - 1) steps; scaled from it by the extra calls' share of the single one, at most
    ``alpha_s`` (a further call never costs more than the first), at least 0."""
    if call_s <= 0 or n < 2:
        return alpha_s
    extra = max(0.0, burst_s - call_s) / (BURST_COLLECTIVES - 1)
    return max(0.0, min(alpha_s, alpha_s * extra / call_s))


def trimmed_mean(values: list[float], cut: float = 0.1) -> float:
    """The mean of ``values`` less the ``cut`` fraction of the smallest and of the largest (at least
    one value kept). Raises ValueError for an empty list."""
    if not values:
        raise ValueError("trimmed_mean of no values")
    ordered = sorted(values)
    k = min(int(len(ordered) * cut), (len(ordered) - 1) // 2)
    kept = ordered[k : len(ordered) - k]
    return sum(kept) / len(kept)


def _overlap_times_s(device: torch.device, t_ar: float) -> list[float]:
    """Times [matmul alone, all-reduce alone, both overlapped] in seconds on this rank; the matmul
    is sized to take about as long as the all-reduce (``t_ar`` seconds), where overlap matters most."""
    n = 256
    for _ in range(3):  # refine n ~ cube root of time; min of 3 runs resists bursts of outside load
        a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        a @ b
        t = min(_median_time_s(lambda a=a, b=b: a @ b, device, budget_s=0.0) for _ in range(3))
        n = int(min(8192, max(64, round(n * (t_ar / t) ** (1 / 3) / 64) * 64)))
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    buf = torch.ones(OVERLAP_SIZE_BYTES // 4, device=device)

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        a @ b
        work.wait()

    return _interleaved_medians_s([lambda: a @ b, lambda: dist.all_reduce(buf), both], device, budget_s=2.0)


def _reduce(values: list[float], op: dist.ReduceOp, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def _worker(
    rank: int,
    nproc: int,
    port: int,
    use_cuda: bool,
    queue: object,
    threads: int | None = None,
    gemm_shapes: tuple[tuple[int, int, int], ...] = (),
) -> None:
    """One calibration rank. Rank 0 sends ("progress", step, fraction) and ("result", dict)."""
    cores = os.cpu_count() or 1
    torch.set_num_threads(threads or max(1, cores // nproc))
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=nproc,
        timeout=datetime.timedelta(seconds=_STARTUP_TIMEOUT_S),
    )
    try:
        _measure_rank(rank, nproc, use_cuda, device, queue, gemm_shapes)
    except BaseException:
        dist.destroy_process_group()
        raise  # mp.spawn reports it to the parent
    # Every rank is past `_measure_rank`'s final barrier and rank 0's result is on the queue: flush the
    # queue's feeder thread, then leave without interpreter shutdown. Tearing gloo down through its
    # destructors aborted a rank after the measurement was complete, twice in CI (SIGABRT, "terminate
    # called without an active exception", 2026-11-30 and 2026-12-02); pytorch/pytorch#179291
    # describes gloo's worker threads crashing at interpreter finalization.
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _measure_rank(
    rank: int,
    nproc: int,
    use_cuda: bool,
    device: torch.device,
    queue: object,
    gemm_shapes: tuple[tuple[int, int, int], ...] = (),
    node_group: object | None = None,
    nodes: int = 1,
) -> None:
    """Everything `calibrate` measures, on one rank of an initialised process group of ``nproc`` ranks
    (``nodes`` nodes; ``node_group``: this rank's node, None when one node). Rank 0 sends
    ("progress", step, fraction) and ("result", dict) to ``queue``."""

    def progress(step: str, fraction: float) -> None:
        if rank == 0:
            queue.put(("progress", step, fraction))

    result: dict = {
        "threads_per_process": torch.get_num_threads(),
        "clock": "thread CPU time" if clock(device) is time.thread_time else "wall time",
        "load_before": os.getloadavg()[0] if hasattr(os, "getloadavg") else -1.0,
    }
    if device.type == "cpu" and torch.get_num_threads() > 1:
        dist.barrier()
        (result["thread_speedup"],) = _reduce([_thread_speedup()], dist.ReduceOp.MIN, device)
    peaks, wall_ratios, half_rows = [], [], {}
    for i, dtype in enumerate(DTYPE_BYTES):
        progress(f"matmul {dtype}", 0.05 + 0.1 * i)
        dist.barrier()
        rate, ratio, half_rows[dtype], probe_rate = _matmul_flops_per_s(
            dtype, device, max_n=8192 if use_cuda else 2048
        )
        if dtype == "fp32":  # the speed probe's matmul, timed with the shapes the spec's fit used
            result["probe_matmul_flops_per_s"] = probe_rate or 0.0
        peaks.append(rate)
        wall_ratios.append(ratio)
    # the dtype the ranks will compute in: bf16 on GPUs, fp32 on CPUs
    (result["matmul_half_rows"],) = _reduce(
        [half_rows["bf16" if use_cuda else "fp32"]], dist.ReduceOp.MAX, device
    )
    (result["matmul_wall_ratio"],) = _reduce([max(wall_ratios)], dist.ReduceOp.MAX, device)
    attn_dtype = "bf16" if use_cuda else "fp32"
    attention = _attention_flops_per_s(device, attn_dtype)
    progress("memory bandwidth", 0.35)
    dist.barrier()
    mem_bw = _copy_bytes_per_s(device, 2**30 if use_cuda else 64 * 2**20)
    progress("launch overhead", 0.38)
    dist.barrier()
    launch = _launch_overhead_s(device)
    progress("per-node overhead of a captured graph (forward, backward)", 0.4)
    dist.barrier()
    node_windows = [_node_overhead_s(device, budget_s=1.0)]  # more windows below, spread out
    result["probe_nodes"] = node_windows[0][2]
    progress("convolution and pooling", 0.41)
    dist.barrier()
    result["conv_flops_per_s"], result["pool_bytes_per_s"] = _reduce(
        list(_conv_and_pool_rates(device)), dist.ReduceOp.MIN, device
    )
    if not use_cuda:  # eager CPU: torch.optim.Adam's step and the page faults of fresh tensors
        progress("optimizer step and fresh memory", 0.415)
        dist.barrier()
        small_s, large_s, fresh, per_tensor, cached = _optimizer_rates(device)
        result["adam_rates"] = _reduce([small_s, large_s, per_tensor, cached], dist.ReduceOp.MAX, device)
        (result["fresh_write_bytes_per_s"],) = _reduce([fresh], dist.ReduceOp.MIN, device)
    *peaks, mem_bw, attention = _reduce([*peaks, mem_bw, attention], dist.ReduceOp.MIN, device)  # slowest
    result["attention_efficiency"] = min(1.0, attention / peaks[list(DTYPE_BYTES).index(attn_dtype)])
    if not use_cuda:
        progress("matmul streaming a large weight", 0.42)
        dist.barrier()
        stream = stream_bandwidth(device, peaks[list(DTYPE_BYTES).index("fp32")], result["matmul_half_rows"])
        (stream,) = _reduce([stream or math.inf], dist.ReduceOp.MIN, device)
        if math.isfinite(stream) and (cache := _cache_bytes()) is not None:
            result.update(stream_bandwidth=stream, cache_bytes=cache)
    (launch,) = _reduce([launch], dist.ReduceOp.MAX, device)
    result.update(peaks=dict(zip(DTYPE_BYTES, peaks)), memory_bandwidth=mem_bw, launch_s=launch)
    progress("per-node overhead, second window", 0.44)
    node_windows.append(_node_overhead_s(device, budget_s=1.0))
    if nproc > 1:
        progress("all-reduce 4 B (per-call cost) and 4 KiB to 16 MiB", 0.45)
        fp32_rate = result["peaks"]["fp32"]
        call_s, *times = _reduce(
            _all_reduce_times_s(device, fp32_rate, (CALL_SIZE_BYTES, *ALL_REDUCE_SIZES_BYTES)),
            dist.ReduceOp.MAX,
            device,
        )
        result["all_reduce_call_s"], result["all_reduce_s"] = call_s, times
        progress("a burst of back-to-back all-reduces", 0.8)
        (result["burst_s"],) = _reduce([_burst_time_s(device, fp32_rate)], dist.ReduceOp.MAX, device)
        progress("overlap", 0.85)
        t_ar = result["all_reduce_s"][ALL_REDUCE_SIZES_BYTES.index(OVERLAP_SIZE_BYTES)]
        result["overlap_s"] = _reduce(_overlap_times_s(device, t_ar), dist.ReduceOp.MAX, device)
    if use_cuda:
        progress("GEMM sweep, fused attention and NCCL collectives (CUDA events)", 0.88)
        dist.barrier()
        result["cuda"] = cuda_measurements(device, CudaEventTimer(), gemm_shapes, node_group, nodes)
    progress("per-node overhead, third window", 0.95)
    dist.barrier()
    node_windows.append(_node_overhead_s(device, budget_s=1.0))
    result["node_overhead_windows_s"] = [w[0] for w in node_windows]
    result["node_overhead_s"] = _reduce(
        [statistics.median(w[0] for w in node_windows), statistics.median(w[1] for w in node_windows)],
        dist.ReduceOp.MAX,
        device,
    )
    (result["probe_matmul_flops_per_s"],) = _reduce(
        [result.get("probe_matmul_flops_per_s") or math.inf], dist.ReduceOp.MIN, device
    )
    result["sized_probe_s"] = _reduce(
        [statistics.median(w[3][i] for w in node_windows) for i in range(4)], dist.ReduceOp.MAX, device
    )
    if use_cuda:
        result["memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        result["device_name"] = torch.cuda.get_device_name(device)
    result["load_after"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else -1.0
    if rank == 0:
        queue.put(("result", result))
    # every rank done with its collectives before any tears gloo down: a rank destroying its group
    # while its peer is still inside one aborted that peer once (SIGABRT, "terminate called without an
    # active exception", CI 2026-11-30)
    dist.barrier()


def fit_all_reduce(
    sizes_bytes: list[float], times_s: list[float], n: int, launch_overhead_s: float
) -> tuple[float, float]:
    """Least-squares fit of (alpha latency_s, bandwidth_bytes_per_s) to measured all-reduce times.

    Fits the model of ``costmodels.comm.all_reduce_time_s`` for one node:
    ``t = launch + min(ring: 2(n-1) alpha + 2(n-1)/n S beta, doubling: ceil(log2 n)(alpha + S beta))``,
    minimising relative errors; each point takes the variant the model would pick, refitted until
    stable. ``alpha >= 0``. Raises RunError if the times do not grow with size (beta <= 0).
    """
    assert n > 1 and len(sizes_bytes) == len(times_s) >= 2
    steps = math.ceil(math.log2(n))
    ring = [(2.0 * (n - 1), 2.0 * (n - 1) / n * s) for s in sizes_bytes]
    doubling = [(float(steps), steps * float(s)) for s in sizes_bytes]
    coeffs = ring
    alpha, beta = 0.0, 0.0
    for _ in range(10):
        w = [1.0 / t**2 for t in times_s]  # relative errors: residual / t
        y = [t - launch_overhead_s for t in times_s]
        saa = sum(wi * a * a for wi, (a, _) in zip(w, coeffs))
        sab = sum(wi * a * b for wi, (a, b) in zip(w, coeffs))
        sbb = sum(wi * b * b for wi, (_, b) in zip(w, coeffs))
        say = sum(wi * a * yi for wi, (a, _), yi in zip(w, coeffs, y))
        sby = sum(wi * b * yi for wi, (_, b), yi in zip(w, coeffs, y))
        det = saa * sbb - sab * sab
        alpha, beta = (sbb * say - sab * sby) / det, (saa * sby - sab * say) / det
        if alpha < 0:
            alpha, beta = 0.0, sby / sbb
        if beta <= 0:
            raise RunError(
                f"all-reduce times {times_s} do not grow with message size; cannot fit a bandwidth"
            )
        chosen = [
            r if r[0] * alpha + r[1] * beta <= d[0] * alpha + d[1] * beta else d
            for r, d in zip(ring, doubling)
        ]
        if chosen == coeffs:
            break
        coeffs = chosen
    return alpha, 1.0 / beta


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8.0 * 2**30  # unknown platform: rough default, 8 GiB


def _run_workers(
    nproc: int,
    use_cuda: bool,
    progress: Progress | None,
    timeout_s: float,
    threads: int | None = None,
    gemm_shapes: tuple[tuple[int, int, int], ...] = (),
) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    context = mp.spawn(
        _worker, args=(nproc, port, use_cuda, queue, threads, gemm_shapes), nprocs=nproc, join=False
    )
    result = None
    deadline = time.monotonic() + timeout_s
    try:
        done = False
        while not done or not queue.empty():
            while not queue.empty():
                message = queue.get()
                if message[0] == "progress" and progress is not None:
                    progress(message[1], message[2])
                elif message[0] == "result":
                    result = message[1]
            if not done:
                done = context.join(timeout=0.1)
            if time.monotonic() > deadline:
                raise RunError(f"calibration did not finish in {timeout_s:.0f} s")
    except mp.ProcessRaisedException as e:
        raise RunError(f"calibration failed in a worker process:\n{e}") from e
    except mp.ProcessExitedException as e:
        raise RunError(f"a calibration process died: {e}") from e
    finally:
        for p in context.processes:
            if p.is_alive():
                p.terminate()
    if result is None:
        raise RunError("calibration processes ended without a result")
    return result


def calibrate(
    nproc: int,
    progress: Progress | None = None,
    timeout_s: float = 180.0,
    threads_per_process: int | None = None,
    probe_roofline: Callable[[int, ClusterSpec], tuple[float, int]] | None = None,
    gemm_shapes: tuple[tuple[int, int, int], ...] = (),
) -> ClusterSpec:
    """Measure this machine with ``nproc`` concurrent processes; return a spec named "local-calibrated".
    Each CPU process computes with ``threads_per_process`` threads (default: cores // nproc, what
    `runtime.launch` gives a rank), so a spec describes ranks that run as it measured them.

    ``probe_roofline(blocks, spec)``: the forward seconds the cost model prices for the `SIZED_PROBE`
    graph of ``blocks`` blocks on ``spec`` without any per-node term, and the nodes it charges that
    term for (the planner's pricing, `planner.cli.workflow.probe_roofline`). Given, the CPU per-node
    overheads are the sized probe's time per node net of that roofline (forward; backward net of
    twice it), and the toy probe's slopes stay in the spec as the speed probe's references
    (`probe_node_overhead_us`, `probe_backward_node_overhead_us`); without it, the toy probe's slopes.

    On CUDA (`costmodels.gpu_calibrate`) it also times a GEMM sweep in bf16 and the model's own
    ``gemm_shapes`` (M, N, K) (fitted to ``device.gemm``), fused attention (``device.attention``) and
    NCCL all-reduce / all-gather / reduce-scatter from 8 B to 1 GiB (``links``), with CUDA events.
    Under torchrun across nodes (`torchrun_world`: WORLD_SIZE above LOCAL_WORLD_SIZE) every rank
    calls this, ``nproc`` is ignored, and the inter-node link is measured too; every rank gets the spec.

    Uses CUDA + NCCL when ``torch.cuda.device_count() >= nproc``, else CPU processes + gloo. With
    ``nproc == 1`` nothing is communicated: links and overlap come from the ``local-cpu`` preset.
    ``progress(step, fraction)`` is called from this process as the workers advance (fraction in
    [0, 1]). Takes about 15-40 s on CPU.

    Raises:
        InputError: ``nproc`` < 1.
        RunError: a worker process failed, died or ran past ``timeout_s`` seconds.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise InputError(f"nproc must be an integer >= 1, got {nproc!r}")
    nodes = 1
    if (launched := torchrun_world()) is not None:
        nproc, nodes = launched
        use_cuda = True
        m = _measure_under_torchrun(nproc, nodes, progress, gemm_shapes)
    else:
        use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= nproc
        if progress is not None:
            progress("starting processes", 0.0)
        m = _run_workers(nproc, use_cuda, progress, timeout_s, threads_per_process, tuple(gemm_shapes))
    fallback = load_cluster("local-cpu", nproc=nproc)
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    sources = [
        f"{CALIBRATED_SOURCE} on {today}, {socket.gethostname()}, nproc={nproc}",
        f"compute timed in {m['clock']}: matmul median over square and transformer (T x C) @ (C x 4C), "
        f"(C x C), (4C x C) shapes; "
        f"wall / clock while measuring {m['matmul_wall_ratio']:.2f} (slowest rank); "
        f"1-min load average {m['load_before']:.2f} before, {m['load_after']:.2f} after"
        + (
            f"; {m['threads_per_process']} threads computed a product {m['thread_speedup']:.2f}x as fast "
            "as one"
            if "thread_speedup" in m
            else ""
        ),
    ]
    intra = cluster_to_dict(fallback)["links"]["intra_node"]
    overlap = fallback.overlap_efficiency
    if nproc > 1:
        alpha_s, bandwidth = fit_all_reduce(
            [CALL_SIZE_BYTES, *ALL_REDUCE_SIZES_BYTES],
            [m["all_reduce_call_s"], *m["all_reduce_s"]],
            nproc,
            m["launch_s"],
        )
        intra = {
            "kind": "nvlink" if use_cuda else "loopback",
            "bandwidth_GBps": _sig(bandwidth / 1e9),
            "latency_us": _sig(alpha_s * 1e6),
        }
        if "burst_s" in m:
            burst = burst_latency_s(m["burst_s"], m["all_reduce_call_s"], alpha_s, nproc)
            intra["burst_latency_us"] = _sig(burst * 1e6)
            sources.append(
                f"burst: {BURST_COLLECTIVES} back-to-back async all-reduces of {CALL_SIZE_BYTES} B "
                f"{m['burst_s'] * 1e6:.0f} us (one: {m['all_reduce_call_s'] * 1e6:.0f} us)"
            )
        t_mm, t_ar, t_both = m["overlap_s"]
        overlap = min(1.0, max(0.0, (t_mm + t_ar - t_both) / min(t_mm, t_ar)))
        points = ", ".join(
            f"{s // 1024} KiB {t * 1e6:.0f} us" for s, t in zip(ALL_REDUCE_SIZES_BYTES, m["all_reduce_s"])
        )
        sources.append(
            f"all-reduce ({'nccl' if use_cuda else 'gloo'}, {nproc} ranks, right after a "
            f"{_SEGMENT_S * 1e3:.0f} ms compute segment, no barrier; 10%-trimmed mean): {CALL_SIZE_BYTES} B "
            f"{m['all_reduce_call_s'] * 1e6:.0f} us (per-call cost), {points}"
        )
        sources.append(
            f"overlap: matmul {t_mm * 1e3:.2f} ms, all-reduce 4 MiB {t_ar * 1e3:.2f} ms, both {t_both * 1e3:.2f} ms"
        )
    else:
        sources.append(ROUGH_LINKS_SOURCE)
    node_f, node_b = m["node_overhead_s"]
    sources.append(
        f"per-node overhead: captured probe graph of tiny transformer blocks ({m['probe_nodes']} nodes at "
        f"{PROBE_BLOCKS[-1]} blocks), slope over the node count between {PROBE_BLOCKS[0]} and "
        f"{PROBE_BLOCKS[-1]} blocks: forward {node_f * 1e6:.2f} us, backward {node_b * 1e6:.2f} us per node"
        + (
            f" (median of windows at the start, middle and end: forward "
            f"{', '.join(f'{w * 1e6:.1f}' for w in m['node_overhead_windows_s'])} us)"
            if m.get("node_overhead_windows_s")
            else ""
        )
        + (
            "; on CUDA written as device.host_dispatch_us (the host's issue time per node: a floor under each "
            "layer's time, the kernels running meanwhile)"
            if use_cuda
            else ""
        )
    )
    memory = m.get("memory_bytes", _host_memory_bytes() / nproc)
    name = m.get("device_name", f"{_cpu_name()}, {m['threads_per_process']} thread(s) per process")
    data = {
        "name": CALIBRATED_SPEC_NAME,
        "nodes": 1,
        "devices_per_node": nproc,
        "backend": "nccl" if use_cuda else "gloo",
        "overlap_efficiency": _sig(overlap),
        "sources": sources,
        "device": {
            "name": name,
            "memory_GiB": _sig(memory / 2**30),
            "peak_TFLOPS": {dt: _sig(v / 1e12) for dt, v in m["peaks"].items()},
            "memory_bandwidth_GBps": _sig(m["memory_bandwidth"] / 1e9),
            "matmul_efficiency": 1.0,
            "memory_efficiency": 1.0,
            "launch_overhead_us": _sig(m["launch_s"] * 1e6),
            "attention_efficiency": _sig(m["attention_efficiency"]),
            "matmul_half_rows": _sig(m["matmul_half_rows"]),
        },
        "links": {"intra_node": intra},
    }
    if use_cuda:  # GPU kernels are asynchronous: the launch term stays the per-op cost, and the host's
        # issue time per node is a floor under each layer's time (`DeviceSpec.host_dispatch_s`)
        data["device"]["host_dispatch_us"] = _sig(node_f * 1e6)
        data["device"]["host_dispatch_backward_us"] = _sig(node_b * 1e6)
    else:
        data["device"]["node_overhead_us"] = _sig(node_f * 1e6)
        data["device"]["backward_node_overhead_us"] = _sig(node_b * 1e6)
        if math.isfinite(probe_mm := m["probe_matmul_flops_per_s"]) and probe_mm > 0:
            data["device"]["probe_matmul_GFLOPS"] = _sig(probe_mm / 1e9)
            t, c, n = PROBE_MATMUL_SHAPE
            sources.append(
                f"speed probe reference: fp32 ({t} x {c}) @ ({c} x {n}) at {probe_mm / 1e9:.1f} GFLOP/s, "
                "timed with the matmul shapes above (a run times the same product beside its steps)"
            )
    data["device"]["conv_efficiency"] = _sig(
        min(1.0, m["conv_flops_per_s"] / m["peaks"]["bf16" if use_cuda else "fp32"])
    )
    data["device"]["pooling_bandwidth_GBps"] = _sig(m["pool_bytes_per_s"] / 1e9)
    if "adam_rates" in m:
        small_s, large_s, per_tensor, cached = m["adam_rates"]
        data["device"]["adam_ns_per_param"] = _sig(small_s * 1e9)
        data["device"]["adam_large_tensor_ns_per_param"] = _sig(large_s * 1e9)
        if per_tensor > 0 and cached > 0:
            data["device"]["adam_tensor_overhead_us"] = _sig(per_tensor * 1e6)
            data["device"]["adam_cached_ns_per_param"] = _sig(cached * 1e9)
            (tiny_n, tiny_each), (cached_n, cached_each) = ADAM_TINY_TENSORS, ADAM_CACHED_TENSORS
            sources.append(
                f"optimizer, small tensors: Adam steps over {tiny_n} tensors of {tiny_each} and {cached_n} of "
                f"{cached_each} fp32 elements, solved as fixed + elements x rate per tensor: "
                f"{per_tensor * 1e6:.1f} us per tensor, {cached * 1e9:.2f} ns per parameter in cache"
            )
        data["device"]["fresh_write_bandwidth_GBps"] = _sig(m["fresh_write_bytes_per_s"] / 1e9)
        count, each = ADAM_SMALL_TENSORS
        sources.append(
            f"optimizer: torch.optim.Adam step over {count} fp32 tensors of {each * 4 / 2**20:.0f} MiB "
            f"{small_s * 1e9:.2f} ns per parameter, over one of {ADAM_LARGE_ELEMENTS * 4 / 2**20:.0f} MiB "
            f"{large_s * 1e9:.2f} ns; a zero fill of a fresh {ADAM_LARGE_ELEMENTS * 4 / 2**20:.0f} MiB "
            f"tensor {m['fresh_write_bytes_per_s'] / 1e9:.2f} GB/s"
        )
    sources.append(
        f"convolution: 3x3 conv2d over {CONV_SHAPE} {m['conv_flops_per_s'] / 1e9:.1f} GFLOP/s; pooling: "
        f"2x2 max pool over {POOL_SHAPE} {m['pool_bytes_per_s'] / 1e9:.2f} GB/s (bytes read + written)"
    )
    if "stream_bandwidth" in m:
        data["device"]["cache_MiB"] = _sig(m["cache_bytes"] / 2**20)
        data["device"]["stream_bandwidth_GBps"] = _sig(m["stream_bandwidth"] / 1e9)
        t_, c, n = STREAM_MATMUL_SHAPE
        sources.append(
            f"stream bandwidth: ({t_} x {c}) @ ({c} x {n}) fp32 timed, bytes / (time - FLOP / fp32 peak); "
            "cache: last-level cache size from sysfs"
        )
    b, h, t, hd = SDPA_SHAPE
    sources.append(
        f"attention efficiency: causal SDPA (B={b}, H={h}, T={t}, hd={hd}) FLOP/s over the matmul peak"
    )
    if use_cuda:
        data["devices_per_node"] = nproc // nodes
        data = apply_cuda_measurements(data, m["cuda"], nodes)
        intra = data["links"]["intra_node"]
        if "burst_s" in m and nproc // nodes > 1:  # rescaled to the NCCL fit's alpha
            burst = burst_latency_s(m["burst_s"], m["all_reduce_call_s"], intra["latency_us"] * 1e-6, nproc)
            intra["burst_latency_us"] = _sig(burst * 1e6)
    spec = parse_cluster(data, "planner calibrate")
    if probe_roofline is not None and not use_cuda:
        spec = _net_of_roofline(spec, data, m["sized_probe_s"], probe_roofline)
    busy = busy_message(
        m["load_before"], m["load_after"], own_processes=nproc, thread_speedup=m.get("thread_speedup"),
        threads=m["threads_per_process"],
    )  # fmt: skip
    if busy:
        warnings.warn(CalibrationWarning(busy), stacklevel=2)
    if progress is not None:
        progress("done", 1.0)
    return spec


def torchrun_world() -> tuple[int, int] | None:
    """(world size, nodes) when this process is one rank of a torchrun job over CUDA (WORLD_SIZE,
    RANK, LOCAL_WORLD_SIZE set; WORLD_SIZE > 1 and a multiple of LOCAL_WORLD_SIZE), else None."""
    env = os.environ
    if not all(k in env for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        return None
    world, local = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
    if world <= 1 or local < 1 or world % local:
        return None
    return world, world // local


class _ListQueue:
    """The queue `_measure_rank` reports to, kept in this process (torchrun: no parent to send to)."""

    def __init__(self, progress: Progress | None) -> None:
        self.items: list = []
        self.progress = progress

    def put(self, item: tuple) -> None:
        if item[0] == "progress" and self.progress is not None:
            self.progress(item[1], item[2])
        self.items.append(item)


def _measure_under_torchrun(
    world: int, nodes: int, progress: Progress | None, gemm_shapes: tuple[tuple[int, int, int], ...]
) -> dict:
    """This rank's part of a calibration run by torchrun over ``nodes`` nodes (NCCL, env://): every
    measurement with all ranks at once, the collectives per node and across the world; rank 0's
    result, sent to every rank."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=_STARTUP_TIMEOUT_S))
    try:
        node_group, _ = dist.new_subgroups(group_size=world // nodes)
        queue = _ListQueue(progress if rank == 0 else None)
        _measure_rank(rank, world, True, device, queue, gemm_shapes, node_group, nodes)
        result = [next((i[1] for i in queue.items if i[0] == "result"), None)]
        dist.broadcast_object_list(result, src=0)
    finally:
        dist.destroy_process_group()
    if result[0] is None:
        raise RunError("calibration under torchrun ended without a result on rank 0")
    return result[0]


def _net_of_roofline(
    spec: ClusterSpec,
    data: dict,
    sized_s: list[float],
    probe_roofline: Callable[[int, ClusterSpec], tuple[float, int]],
) -> ClusterSpec:
    """`spec` with its per-node overheads measured on the `SIZED_PROBE` graph net of the roofline the
    cost model prices for it (`calibrate`'s ``probe_roofline``); the toy probe's figures move to the
    speed-probe references. A net figure that is not positive leaves the toy one."""
    f_small, t_small, f_big, t_big = sized_s
    (r_small, n_small), (r_big, n_big) = (probe_roofline(b, spec) for b in PROBE_BLOCKS)
    nodes, roofline = n_big - n_small, r_big - r_small
    if nodes <= 0:
        return spec
    forward, backward = _per_node_s((f_small, t_small), (f_big, t_big), nodes, roofline)
    dev = data["device"]
    toy_f, toy_b = dev["node_overhead_us"], dev["backward_node_overhead_us"]
    if forward > 0:
        dev["node_overhead_us"], dev["probe_node_overhead_us"] = _sig(forward * 1e6), toy_f
    if backward > 0:
        dev["backward_node_overhead_us"], dev["probe_backward_node_overhead_us"] = _sig(backward * 1e6), toy_b
    dim, heads, tokens = SIZED_PROBE
    data["sources"].append(
        f"per-node overhead priced: the probe graph at dim {dim}, {heads} heads, {tokens} tokens, slope between "
        f"{PROBE_BLOCKS[0]} and {PROBE_BLOCKS[-1]} blocks net of the roofline the cost model prices for its ops "
        f"({roofline * 1e6 / nodes:.2f} us per node): forward {forward * 1e6:.2f} us, backward {backward * 1e6:.2f} us "
        f"per node; the tiny probe's slopes ({toy_f} us, {toy_b} us) are the speed probe's references"
    )
    return parse_cluster(data, "planner calibrate")


def unmeasured_links(spec: ClusterSpec, ranks: int) -> str | None:
    """A warning when a plan on ``ranks`` > 1 ranks is priced with a spec `calibrate` measured with one
    process (its links and overlap are the local-cpu preset's rough defaults), else None."""
    if ranks <= 1 or ROUGH_LINKS_SOURCE not in spec.sources:
        return None
    return (
        f"the cluster spec was calibrated with one process, so its link and overlap figures are rough "
        f"defaults, not this machine's: the plan's {ranks} ranks communicate at prices nobody measured; "
        f"measure {ranks} processes (`planner calibrate --nproc {ranks} --out SPEC.yaml`, or omit --cluster)"
    )


class CalibrationWarning(UserWarning):
    """The machine was busy while `planner calibrate` measured it: the figures may be too slow."""


def busy_message(
    load_before: float,
    load_after: float,
    own_processes: int = 0,
    cores: int | None = None,
    thread_speedup: float | None = None,
    threads: int = 1,
) -> str | None:
    """A warning text when the calibration processes did not get their cores, else None: the 1-minute
    load average exceeded the number of cores before measuring, or after it less the ``own_processes``
    calibration processes (they count in it); or a process's ``threads`` intra-op threads computed a
    product slower than one thread (``thread_speedup`` below `OVERSUBSCRIBED_SPEEDUP`, `_thread_speedup`),
    which a load average over a minute can miss. Negative loads (unknown) pass."""
    cores = cores or os.cpu_count() or 1
    again = (
        "the measured speeds are likely too low; run `planner calibrate` (or optimize with "
        "--recalibrate) again on a quieter machine"
    )
    if thread_speedup is not None and thread_speedup < OVERSUBSCRIBED_SPEEDUP:
        return (
            f"the machine was busy while calibrating: {threads} intra-op threads per process computed a "
            f"matmul {1 / max(thread_speedup, 1e-9):.1f}x slower than one thread (other processes hold "
            f"the cores; 1-minute load average {load_before:.1f} before, {load_after:.1f} after, "
            f"{cores} cores): {again}"
        )
    if max(load_before, load_after - own_processes) <= cores:
        return None
    return (
        f"the machine was busy while calibrating (1-minute load average {load_before:.1f} before, "
        f"{load_after:.1f} after, {cores} cores): {again}"
    )


# What a calibration measures; raised when a version measures more (a cached spec of an older format
# lacks fields the cost model would price with): 2 = the optimizer step and fresh-memory writes; 3 = the
# optimizer's fixed cost per tensor and its in-cache rate; 4 = all-reduce times as trimmed means.
CALIBRATION_FORMAT = 4


def _machine_identity(nproc: int) -> dict:
    return {"cpu": _cpu_name(), "torch": torch.__version__, "nproc": nproc, "cores": os.cpu_count() or 1}


def write_cache_metadata(
    spec_path: str | os.PathLike, nproc: int, now: float | None = None, busy: bool = False
) -> Path:
    """Store beside a cached spec when and on what it was measured (``SPEC.meta.json``: UNIX time,
    CPU model, torch version, process count, cores, load average now, and whether `calibrate` found
    the machine busy: `busy_message`); returns its path."""
    meta = Path(f"{spec_path}.meta.json")
    data = {
        "measured_at": time.time() if now is None else now,
        "format": CALIBRATION_FORMAT,
        **_machine_identity(nproc),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "busy": busy,
    }
    write_text_atomic(meta, json.dumps(data, indent=2))
    return meta


def cache_status(
    spec_path: str | os.PathLike,
    nproc: int,
    max_age_days: float = CACHE_MAX_AGE_DAYS,
    now: float | None = None,
) -> str | None:
    """Why the cached spec at ``spec_path`` must be measured again (missing, no metadata, older than
    ``max_age_days``, measured on another CPU, torch version or process count, or a spec that no longer
    loads), or None if it is valid."""
    path = Path(spec_path)
    if not path.exists():
        return "no cached measurement"
    meta = Path(f"{spec_path}.meta.json")
    try:
        data = json.loads(meta.read_text(encoding="utf-8"))
    except OSError:
        return "the cached measurement has no metadata (written by an older version)"
    except ValueError:
        return "the cached measurement's metadata cannot be read (not JSON)"
    if data.get("format", 1) != CALIBRATION_FORMAT:
        return "the cached measurement was made by an older version, which measured less"
    age_days = ((time.time() if now is None else now) - float(data.get("measured_at", 0))) / 86400
    if age_days > max_age_days:
        return f"the cached measurement is {age_days:.0f} days old (more than {max_age_days:g})"
    for key, value in _machine_identity(nproc).items():
        if data.get(key) != value:
            return f"the cached measurement was made with {key} = {data.get(key)!r}, now {value!r}"
    if data.get("busy") and age_days * 86400 > BUSY_REMEASURE_AFTER_S and quiet_now(nproc):
        return "the cached measurement was made on a busy machine, and it is quieter now"
    try:
        load_cluster(str(path))
    except SpecError as e:  # edited or truncated since it was written
        return f"the cached measurement cannot be read ({e})"
    return None


# a spec measured on a busy machine is measured again by a run this long after it that finds the machine
# quiet (`quiet_now`): not at once, so that a machine busy on and off (a test suite's workers) is not
# measured over and over
BUSY_REMEASURE_AFTER_S = 15 * 60


def quiet_now(nproc: int) -> bool:
    """Whether this machine could be calibrated now without `busy_message`'s warning, as far as a glance
    tells: the 1-minute load average at most the cores, and (with several cores per process) the
    threads a calibration process computes with (cores // nproc) faster together than one
    (`_thread_speedup`, about 0.1 s)."""
    cores = os.cpu_count() or 1
    if hasattr(os, "getloadavg") and os.getloadavg()[0] > cores:
        return False
    threads = max(1, cores // max(1, nproc))
    if threads == 1:
        return True
    with intra_op_threads(threads):
        return _thread_speedup() >= OVERSUBSCRIBED_SPEEDUP


def _sig(value: float, digits: int = 4) -> float:
    """``value`` rounded to ``digits`` significant digits (measurements are not more precise)."""
    return float(f"{value:.{digits}g}")


_HEADER = """\
# Cluster spec written by `planner calibrate`: measured on this machine (see sources).
# Peaks and bandwidths are measured achievable figures, so the efficiencies are 1.0.
# Load with: load_cluster("{path}")
"""


def write_cluster_yaml(spec: ClusterSpec, path: str | os.PathLike) -> None:
    """Write ``spec`` as YAML (human units) to ``path`` atomically (`planner.files.write_text_atomic`:
    a temporary file in the same folder, fsynced, then a rename), so a failure never leaves a
    partial file.

    Raises:
        InputError: the folder does not exist, is not writable, or the write fails.
    """
    target = Path(path)
    text = _HEADER.format(path=target) + yaml.safe_dump(
        cluster_to_dict(spec), sort_keys=False, allow_unicode=True
    )
    write_text_atomic(target, with_digest(text), fsync=True)

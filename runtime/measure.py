"""Timing and memory measurement on each rank.

Timing: `time_iterations` runs `warmup` untimed calls, then `iters` timed calls, each started right
after a barrier on `group` (when a process group is initialised) so that every rank times the same
step. On CUDA each call is bracketed by CUDA events (device time, in seconds); on CPU by
`time.perf_counter`. The latency of a synchronous step is the slowest rank's (`runtime.job.summarise`).

Memory of a rank (what the report shows beside the prediction): `process_peak_memory_bytes`, the
process's real peak since it started - on CUDA `torch.cuda.max_memory_allocated` (every tensor,
weights and activations), on CPU the resident-set high-water mark (VmHWM in /proc/self/status, else
`resource.getrusage(...).ru_maxrss`), which also holds torch's libraries and the process group
(`current_memory_bytes` at the rank's start gives that part, reported beside it).

On CPU the resident set also holds what glibc's allocator keeps after it was freed (its arenas: 100-180
MiB above the live heap in 150-730 MiB training runs on this VM), so the run also measures the heap in
use at its highest over one more step (`heap_peak_bytes`: glibc's `mallinfo2`, sampled after every
aten op by a `TorchDispatchMode`), the tensors and whatever else is malloc'd, like CUDA's
`max_memory_allocated`.

A window: `reset_peak_memory` + `peak_memory_bytes` measure the peak of one section of code (on CUDA
since the reset; on CPU the growth of VmHWM above its value at the reset, which resets VmHWM to the
current RSS by writing "5" to /proc/self/clear_refs - after that the process's earlier peak is lost,
so a rank that reports its real peak does not reset). Without /proc the fallback ru_maxrss cannot
be reset, so only growth above the previous peak is seen.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from planner.errors import InputError
from planner.progress import Progress, silent

_STATUS_PATH = "/proc/self/status"
_CLEAR_REFS_PATH = "/proc/self/clear_refs"
_RESET_HWM = "5"  # clear_refs command that resets the peak RSS (Linux >= 4.0, proc(5))

# RSS high-water mark (bytes) at the last reset_peak_memory on CPU; per process, like VmHWM itself.
_cpu_baseline_bytes = 0


@dataclass(frozen=True)
class Timing:
    """Wall or device time of each timed iteration on one rank, in seconds, and its order statistics."""

    samples_s: list[float]
    median_s: float
    p10_s: float  # 10th percentile (linear interpolation between order statistics)
    p90_s: float
    min_s: float
    steps_per_sample: int = 1  # > 1: each sample is the mean step time of a window of back-to-back steps

    @classmethod
    def from_samples(cls, samples_s: list[float], steps_per_sample: int = 1) -> Timing:
        """Timing of `samples_s` (seconds, at least one). Raises InputError when empty."""
        if not samples_s:
            raise InputError("Timing needs at least one sample")
        ordered = sorted(samples_s)
        return cls(
            samples_s=list(samples_s),
            median_s=statistics.median(ordered),
            p10_s=_percentile(ordered, 0.10),
            p90_s=_percentile(ordered, 0.90),
            min_s=ordered[0],
            steps_per_sample=steps_per_sample,
        )


def _percentile(ordered: list[float], fraction: float) -> float:
    position = fraction * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def time_iterations(
    fn: Callable[[], Any],
    *,
    warmup: int,
    iters: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    progress: Progress = silent,
    min_time_s: float = 0.0,
    probe: Callable[[], float] | None = None,
) -> Timing:
    """Call `fn()` `warmup` times untimed, then time `iters` calls; return their Timing in seconds.
    `progress` (`planner.progress`) is told of each warm-up and timed call.

    With `min_time_s` > 0 at least that many seconds of calls are timed: the warm-up calls (one more
    untimed call without warm-up) estimate a call's time, the ranks agree on the slowest estimate
    (all-reduce MAX on `group` when a process group is initialised) and time
    max(iters, min_time_s / estimate) calls, at most `MAX_TIMED_ITERS`; on CPU, calls shorter than
    `WINDOW_S` are timed in windows of back-to-back calls (one sample per window:
    `Timing.steps_per_sample`). A shared machine has slow
    spells (a noisy neighbour halves the speed of this 2-vCPU VM for 1-5 s, about a quarter of the
    time, and for 10-20 s at other times, measured 2026-11-30): ten calls of a 3 ms step all fall in one
    spell, a median over two seconds of calls in fewer; what the spells leave, the `probe` measures.

    `probe` (CPU only): called between samples, outside the timed windows, while its calls have taken
    less than `PROBE_SHARE` of the timed time; it returns the wall seconds it took. The run uses it to
    measure the machine's speed beside the steps (`costmodels.calibrate.SpeedProbe`).

    Every timed call starts right after a barrier on `group` (the default group when None) if a process
    group is initialised, so all ranks of the group must call this with the same `iters`. On a CUDA
    `device` the time is measured with CUDA events (device time of the work `fn` enqueues); otherwise
    with `time.perf_counter` around the call. Raises InputError for `warmup < 0` or `iters < 1`.
    """
    if warmup < 0 or iters < 1:
        raise InputError(
            f"time_iterations needs warmup >= 0 and iters >= 1, got warmup={warmup}, iters={iters}"
        )
    warm_s = []
    for i in range(max(warmup, 1 if min_time_s > 0 else 0)):
        progress(f"warm-up {i + 1}/{warmup}", i / max(warmup, 1))
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        warm_s.append(time.perf_counter() - start)
    window = 1
    if min_time_s > 0:
        estimate_s = _slowest(statistics.median(warm_s), device, group)
        iters = max(iters, min(MAX_TIMED_ITERS, math.ceil(min_time_s / max(estimate_s, 1e-7))))
        if device.type != "cuda":  # steps shorter than WINDOW_S run back to back between barriers
            window = max(1, min(iters, math.floor(WINDOW_S / max(estimate_s, 1e-7))))
    if device.type == "cuda":
        return Timing.from_samples(_time_cuda(fn, iters, device, group, progress))
    return Timing.from_samples(
        _time_cpu(fn, math.ceil(iters / window), group, progress, window, probe, min_time_s, device), window
    )


MAX_TIMED_ITERS = 10_000  # a cap on the iterations `min_time_s` may ask for
# With `min_time_s`, CPU steps shorter than this are timed in windows of back-to-back steps after one
# barrier (sample = the window's mean step): a barrier before every sub-millisecond step adds the
# wake-up of the backend's threads to it (a 0.3 ms MLP step measured 0.47 ms with a barrier before
# each, 0.30 ms back to back, on 2 gloo ranks of this 2-vCPU VM, 2026-11-30)
WINDOW_S = 0.02
PROBE_SHARE = 0.5  # `probe` calls take at most about this fraction of the timed time


def _slowest(estimate_s: float, device: torch.device, group: dist.ProcessGroup | None) -> float:
    """The largest `estimate_s` over the ranks of `group` (all-reduce MAX when a process group is
    initialised), so that every rank times the same number of steps."""
    if dist.is_available() and dist.is_initialized():
        slowest = torch.tensor([estimate_s], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        return float(slowest.item())
    return estimate_s


def _time_cpu(
    fn: Callable[[], Any],
    samples: int,
    group: dist.ProcessGroup | None,
    progress: Progress,
    window: int = 1,
    probe: Callable[[], float] | None = None,
    min_time_s: float = 0.0,
    device: torch.device | None = None,
) -> list[float]:
    """`samples` samples, each the mean time of `window` back-to-back calls after a barrier, and more
    until they add up to `min_time_s` on every rank (the warm-up's estimate of a step can be too
    long: first calls are slow), at most `MAX_TIMED_ITERS` calls; `probe` called after a sample while
    its calls have taken under `PROBE_SHARE` of the timed time."""
    samples_s: list[float] = []
    probe_s = timed_s = 0.0
    i = 0
    while i < samples or (
        min_time_s > 0
        and (i + 1) * window <= MAX_TIMED_ITERS
        and _slowest(float(timed_s < min_time_s), device or torch.device("cpu"), group) > 0
    ):
        if i == samples:
            samples += 1
        i += 1
        progress(
            f"timed sample {i}/{samples}" if window > 1 else f"timed iteration {i}/{samples}",
            (i - 1) / samples,
        )
        _barrier(group)
        start = time.perf_counter()
        for _ in range(window):
            fn()
        elapsed_s = time.perf_counter() - start
        samples_s.append(elapsed_s / window)
        timed_s += elapsed_s
        if probe is not None and probe_s < PROBE_SHARE * timed_s:
            probe_s += probe()
    progress(f"timed {samples * window} iterations", 1.0)
    return samples_s


def _time_cuda(
    fn: Callable[[], Any],
    iters: int,
    device: torch.device,
    group: dist.ProcessGroup | None,
    progress: Progress,
) -> list[float]:
    events = []
    for i in range(iters):
        progress(f"timed iteration {i + 1}/{iters}", i / iters)
        torch.cuda.synchronize(device)  # the barrier then aligns the ranks, not their queued work
        _barrier(group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize(device)
    progress(f"timed {iters} iterations", 1.0)
    return [start.elapsed_time(end) / 1e3 for start, end in events]  # elapsed_time is in ms


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window on `device` for `peak_memory_bytes` (see the module docstring)."""
    global _cpu_baseline_bytes
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open(_CLEAR_REFS_PATH, "w") as clear_refs:
            clear_refs.write(_RESET_HWM)
    except OSError:
        pass  # not Linux, or not allowed: the baseline below is then the earlier peak
    _cpu_baseline_bytes = _cpu_high_water_bytes()


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory in bytes since the last `reset_peak_memory(device)`.

    CUDA: `torch.cuda.max_memory_allocated(device)`. CPU: growth of the RSS high-water mark above its
    value at the reset (the absolute high-water mark when never reset).
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return max(0, _cpu_high_water_bytes() - _cpu_baseline_bytes)


def _cpu_high_water_bytes() -> int:
    """Peak resident set size of this process in bytes: VmHWM, else ru_maxrss."""
    try:
        with open(_STATUS_PATH) as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    import resource  # Unix only; imported here so that the module still imports elsewhere

    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(max_rss if sys.platform == "darwin" else max_rss * 1024)  # bytes on macOS, kB on Linux


def process_peak_memory_bytes(device: torch.device) -> int:
    """The real peak memory of this process on `device`, bytes: CUDA `max_memory_allocated` (since the
    start, unless `reset_peak_memory` was called), CPU the resident-set high-water mark."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _cpu_high_water_bytes()


def current_memory_bytes(device: torch.device) -> int:
    """Memory held now, bytes: CUDA `memory_allocated`, CPU the resident set size (VmRSS; the
    high-water mark when /proc is missing)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        with open(_STATUS_PATH) as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return _cpu_high_water_bytes()


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (malloc.h, glibc >= 2.33): every field a size_t."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")
    ]  # fmt: skip


@functools.cache
def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    """glibc's mallinfo2, or None where the C library has none (macOS, musl, glibc < 2.33)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


def heap_in_use_bytes() -> int | None:
    """Bytes this process has malloc'd and not freed (glibc `mallinfo2`: uordblks, the arenas' chunks in
    use, plus hblkhd, the mmap'd ones: large tensors), None where unavailable. Unlike the resident set it
    drops when memory is freed."""
    fn = _mallinfo2()
    if fn is None:
        return None
    info = fn()
    return int(info.uordblks + info.hblkhd)


class _HeapPeak(TorchDispatchMode):
    """Samples `heap_in_use_bytes` after every aten op run under it (forward, backward, optimizer and
    collective ops alike); `peak` is the largest."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = heap_in_use_bytes() or 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's API
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, heap_in_use_bytes() or 0)
        return out


def heap_peak_bytes(fn: Callable[[], Any], device: torch.device) -> int | None:
    """The most heap in use (`heap_in_use_bytes`) while ``fn()`` runs, sampled after every aten op: on a
    CPU device with glibc; None otherwise (CUDA: `torch.cuda.max_memory_allocated` measures tensors
    there). Every rank that shares collectives with this one must call it with the same ``fn``."""
    if device.type != "cpu" or _mallinfo2() is None:
        return None
    with _HeapPeak() as mode:
        fn()
    return mode.peak

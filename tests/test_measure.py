"""runtime.measure: order statistics, CPU timing and peak memory, and a 2-rank gloo measurement."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from planner.errors import InputError
from runtime.launch import RankContext, launch
from runtime.measure import (
    Timing,
    current_memory_bytes,
    heap_in_use_bytes,
    heap_peak_bytes,
    peak_memory_bytes,
    process_peak_memory_bytes,
    reset_peak_memory,
    time_iterations,
)

_CPU = torch.device("cpu")
_MiB = 2**20


def _measure_all_reduce(ctx: RankContext, payload: None) -> dict:
    """Each rank times a small all-reduce (rank 1 sleeps 5 ms more per call)."""
    tensor = torch.ones(1024)

    def step() -> None:
        dist.all_reduce(tensor)
        if ctx.rank == 1:
            time.sleep(0.005)

    reset_peak_memory(ctx.device)
    timing = time_iterations(step, warmup=2, iters=5, device=ctx.device)
    return {"timing": timing, "peak_bytes": peak_memory_bytes(ctx.device)}


def test_timing_order_statistics() -> None:
    timing = Timing.from_samples([5.0, 1.0, 3.0, 2.0, 4.0])
    assert timing.samples_s == [5.0, 1.0, 3.0, 2.0, 4.0]  # kept in iteration order
    assert (timing.median_s, timing.min_s) == (3.0, 1.0)
    assert timing.p10_s == pytest.approx(1.4) and timing.p90_s == pytest.approx(4.6)
    with pytest.raises(InputError):
        Timing.from_samples([])


def test_time_iterations_on_cpu_without_process_group() -> None:
    calls = []

    def step() -> None:
        calls.append(None)
        time.sleep(0.002)

    timing = time_iterations(step, warmup=2, iters=5, device=_CPU)
    assert len(calls) == 7 and len(timing.samples_s) == 5
    assert 0.002 <= timing.min_s <= timing.p10_s <= timing.median_s <= timing.p90_s  # each step sleeps 2 ms
    with pytest.raises(InputError, match="iters >= 1"):
        time_iterations(step, warmup=0, iters=0, device=_CPU)


def test_min_time_fills_the_time_in_windows_of_back_to_back_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import runtime.measure as measure

    clock = [0.0]  # a fake clock: each step takes exactly `cost` seconds, whatever the machine's load
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    calls = []

    def step(cost: float) -> None:
        calls.append(None)
        clock[0] += cost

    timing = time_iterations(lambda: step(0.001), warmup=2, iters=5, device=_CPU, min_time_s=0.1)
    # 0.1 s / 1 ms = 100 steps, in windows of WINDOW_S / 1 ms = 20 back to back: 5 samples
    assert timing.steps_per_sample == 20 and len(timing.samples_s) == 5 and len(calls) == 2 + 100
    assert timing.median_s == pytest.approx(0.001)  # a sample is a window's mean step, not its total
    calls.clear()
    slow = time_iterations(lambda: step(0.03), warmup=1, iters=3, device=_CPU, min_time_s=0.1)
    assert slow.steps_per_sample == 1 and len(slow.samples_s) == 4  # ceil(0.1 / 0.03); one step per sample
    assert time_iterations(lambda: step(0.001), warmup=1, iters=3, device=_CPU).steps_per_sample == 1


def test_peak_memory_on_cpu_counts_growth_since_reset() -> None:
    """64 MiB of fresh anonymous pages, every one touched, raise the peak by 64 MiB. (A torch tensor of
    that size need not: after an earlier test freed as much, the allocator can hand back pages still
    resident, and the resident set does not grow: it failed so after tests/test_loss_scaling.py.)"""
    import mmap  # noqa: PLC0415

    reset_peak_memory(_CPU)
    block = mmap.mmap(-1, 64 * _MiB)
    for offset in range(0, 64 * _MiB, mmap.PAGESIZE):
        block[offset] = 1
    grown = peak_memory_bytes(_CPU)
    block.close()
    assert 60 * _MiB <= grown < 1024 * _MiB
    reset_peak_memory(_CPU)
    assert peak_memory_bytes(_CPU) < 32 * _MiB  # the 64 MiB peak is behind the new window


def test_process_peak_memory_on_cpu_is_the_real_peak() -> None:
    before = process_peak_memory_bytes(_CPU)
    assert 0 < current_memory_bytes(_CPU) <= before
    block = torch.ones((before + 64 * _MiB) // 4)  # more than the whole process held so far
    assert process_peak_memory_bytes(_CPU) >= before + 60 * _MiB  # counts everything, not growth
    del block


@pytest.mark.slow
def test_heap_peak_is_the_live_heap_at_its_highest_not_what_the_allocator_keeps() -> None:
    """The heap in use (glibc mallinfo2) sampled after every op of a call: a 64 MiB temporary freed
    inside it counts once at its peak, and is gone from the heap after, where the resident set's
    high-water mark keeps it. None on a CUDA device (max_memory_allocated measures there)."""
    if heap_in_use_bytes() is None:
        pytest.skip("no glibc mallinfo2 here")
    before = heap_in_use_bytes()

    def step() -> None:
        a = torch.ones(16 * _MiB // 4)  # 16 MiB, then 64 MiB beside it
        b = torch.full((64 * _MiB // 4,), 2.0)
        (a.sum() + b.sum()).item()

    peak = heap_peak_bytes(step, _CPU)
    assert peak is not None and 80 * _MiB <= peak - before < 120 * _MiB
    assert heap_in_use_bytes() - before < 16 * _MiB  # freed: the heap drops, unlike the resident set
    assert heap_peak_bytes(step, torch.device("cuda")) is None


def test_measure_on_two_ranks() -> None:
    fast, slow = launch(_measure_all_reduce, None, 2, timeout_s=30)
    assert len(fast["timing"].samples_s) == len(slow["timing"].samples_s) == 5
    assert slow["timing"].median_s >= 0.005 and fast["timing"].median_s > 0  # the slow rank sleeps 5 ms
    assert all(0 <= r["peak_bytes"] < 256 * _MiB for r in (fast, slow))


def test_speed_probe_runs_between_samples_within_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe runs outside the timed windows, and its calls take at most about PROBE_SHARE of the
    timed time (fake clock: a step costs 1 ms, a probe call 4 ms)."""
    import types

    import runtime.measure as measure

    clock = [0.0]
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    probes = []

    def probe() -> float:
        probes.append(clock[0])
        clock[0] += 0.004
        return 0.004

    def step() -> None:
        clock[0] += 0.001

    timing = time_iterations(step, warmup=1, iters=5, device=_CPU, min_time_s=0.2, probe=probe)
    assert timing.median_s == pytest.approx(0.001)  # probe time is never inside a sample
    timed_s = sum(timing.samples_s) * timing.steps_per_sample
    assert 0 < len(probes) * 0.004 <= measure.PROBE_SHARE * timed_s + 0.004


def test_speed_probe_measures_a_per_node_cost_and_a_matmul_rate() -> None:
    """The calibration's probe graphs and matmul, re-timed on this machine: a forward per-node cost, a
    backward one only when asked, and the matmul's FLOP/s. No bound on the times themselves (a loaded
    machine read 1.06 ms per node): the arithmetic is checked on scripted times below."""
    import math

    from costmodels.calibrate import SpeedProbe

    forward_only = SpeedProbe(_CPU)
    assert forward_only.overhead_s() is None and forward_only.matmul_flops_per_s() is None  # no sample yet
    for _ in range(5):
        wall_s = forward_only.sample()
        assert wall_s > 0 and math.isfinite(wall_s)  # a sample was timed; no bound on how long
    per_node, backward = forward_only.overhead_s()
    assert 0 <= per_node < math.inf and backward is None and forward_only.samples == 5
    assert 0 < forward_only.matmul_flops_per_s() < math.inf
    with_backward = SpeedProbe(_CPU, backward=True)
    with_backward.sample()
    per_node, backward = with_backward.overhead_s()
    assert 0 <= per_node < math.inf and backward is not None and 0 <= backward < math.inf


@pytest.mark.parametrize("backward", [False, True])
def test_speed_probe_takes_the_slope_of_median_times_and_the_matmul_rate(
    monkeypatch: pytest.MonkeyPatch, backward: bool
) -> None:
    """Scripted times (no clock): the per-node cost is the slope between the small and the big probe
    graph's median times over the node difference (the backward slope from forward + backward minus
    forward), the matmul rate its FLOP over the median time; a slope below zero (noise) reads 0."""
    import costmodels.calibrate as calibrate

    graphs = {2: (lambda: None, lambda: None, 10), 8: (lambda: None, lambda: None, 40)}  # 30 nodes more
    monkeypatch.setattr(calibrate, "_probe_graph", lambda blocks, device: graphs[blocks])
    # per sample, in the probe's order: small fwd [, small fwd+bwd], big fwd [, big fwd+bwd], matmul;
    # the second sample is an outlier (a busy spell) that the medians leave out
    rows = [
        [1.0e-3, 3.0e-3, 1.3e-3, 3.9e-3, 2.0e-4],
        [9.0e-3, 9.0e-3, 9.0e-3, 9.0e-3, 9.0e-3],
        [1.0e-3, 3.0e-3, 1.3e-3, 3.9e-3, 2.0e-4],
    ]
    columns = [0, 1, 2, 3, 4] if backward else [0, 2, 4]
    script = iter(row[c] for row in rows for c in columns)
    monkeypatch.setattr(calibrate, "_timed", lambda fn, device: (next(script), 0.0))

    probe = calibrate.SpeedProbe(_CPU, backward=backward)
    for _ in rows:
        probe.sample()
    assert probe.samples == 3
    per_node, per_node_backward = probe.overhead_s()
    assert per_node == pytest.approx((1.3e-3 - 1.0e-3) / 30)
    if backward:
        assert per_node_backward == pytest.approx(((3.9e-3 - 1.3e-3) - (3.0e-3 - 1.0e-3)) / 30)
    else:
        assert per_node_backward is None
    t, c, n = calibrate.PROBE_MATMUL_SHAPE
    assert probe.matmul_flops_per_s() == pytest.approx(2 * t * c * n / 2.0e-4)

    # the big graph's median below the small one's: no negative cost
    script = iter([2.0e-3, 1.0e-3, 1.0e-3])
    monkeypatch.setattr(calibrate, "_timed", lambda fn, device: (next(script), 0.0))
    noisy = calibrate.SpeedProbe(_CPU)
    noisy.sample()
    assert noisy.overhead_s() == (0.0, None)


def test_min_time_is_honoured_when_the_warm_up_overestimates_a_step() -> None:
    """The warm-up's (slow first) call says 0.2 s a step, so 1 call would cover --min-time 0.1 s; the
    steps then take 5 ms: more are timed until 0.1 s of them were (was: 1 sample)."""
    calls = []

    def step() -> None:
        time.sleep(0.2 if not calls else 0.005)
        calls.append(1)

    timing = time_iterations(step, warmup=1, iters=1, device=torch.device("cpu"), min_time_s=0.1)
    assert sum(timing.samples_s) * timing.steps_per_sample >= 0.1  # the timed calls add up to --min-time
    assert len(timing.samples_s) * timing.steps_per_sample > 1

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
    gather_to_rank0,
    peak_memory_bytes,
    reset_peak_memory,
    summarise_ranks,
    time_iterations,
)

_CPU = torch.device("cpu")
_MiB = 2**20


def _measure_all_reduce(ctx: RankContext, payload: None) -> dict | None:
    """Each rank times a small all-reduce (rank 1 sleeps 5 ms more per call); rank 0 summarises."""
    tensor = torch.ones(1024)

    def step() -> None:
        dist.all_reduce(tensor)
        if ctx.rank == 1:
            time.sleep(0.005)

    reset_peak_memory(ctx.device)
    timing = time_iterations(step, warmup=2, iters=5, device=ctx.device)
    gathered = gather_to_rank0({"timing": timing, "peak_bytes": peak_memory_bytes(ctx.device)})
    if gathered is None:
        return None
    return {
        "summary": summarise_ranks([g["timing"] for g in gathered]),
        "peaks": [g["peak_bytes"] for g in gathered],
    }


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
    assert 0.002 <= timing.min_s <= timing.p10_s <= timing.median_s <= timing.p90_s < 0.5
    with pytest.raises(InputError, match="iters >= 1"):
        time_iterations(step, warmup=0, iters=0, device=_CPU)


def test_summarise_ranks_takes_the_slowest_rank_per_iteration() -> None:
    summary = summarise_ranks([Timing.from_samples([1.0, 3.0, 2.0]), Timing.from_samples([2.0, 1.0, 4.0])])
    assert summary["median_s_per_rank"] == [2.0, 2.0]
    assert summary["spread_s"] == 0.0 and summary["median_s_max"] == 2.0
    assert summary["step_median_s"] == 3.0  # per-iteration maxima 2, 3, 4
    uneven = summarise_ranks([Timing.from_samples([1.0]), Timing.from_samples([2.0, 4.0])])
    assert uneven["step_median_s"] == 3.0 and uneven["spread_s"] == 2.0
    assert uneven["spread_fraction"] == pytest.approx(2.0 / 3.0)
    with pytest.raises(InputError):
        summarise_ranks([])


def test_peak_memory_on_cpu_counts_growth_since_reset() -> None:
    reset_peak_memory(_CPU)
    block = torch.ones(64 * _MiB // 4)  # 64 MiB of float32, every page touched
    grown = peak_memory_bytes(_CPU)
    del block
    assert 60 * _MiB <= grown < 1024 * _MiB
    reset_peak_memory(_CPU)
    assert peak_memory_bytes(_CPU) < 32 * _MiB  # the 64 MiB peak is behind the new window


def test_gather_to_rank0_without_process_group() -> None:
    assert gather_to_rank0({"a": 1}) == [{"a": 1}]


@pytest.mark.slow
def test_measure_on_two_ranks() -> None:
    summary_rank0, nothing = launch(_measure_all_reduce, None, 2, timeout_s=30)
    assert nothing is None  # gather_to_rank0 returns None off rank 0
    summary = summary_rank0["summary"]
    assert summary["num_ranks"] == 2
    slow, fast = summary["median_s_per_rank"][1], summary["median_s_per_rank"][0]
    assert 0.005 <= slow < 1.0 and 0 < fast < 1.0
    assert summary["step_median_s"] >= 0.005  # the slowest rank sets the step time
    assert all(0 <= peak < 256 * _MiB for peak in summary_rank0["peaks"])

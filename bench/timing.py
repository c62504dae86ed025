"""Side-by-side timing for the benchmarks: interleaved rounds on every rank, step time = slowest rank.

    interleaved({"ours": f, "dtensor": g}, iters=20, warmup=3) -> {"ours": [s, ...], "dtensor": [s, ...]}

Each round times every function once, in an order rotated by one each round (A B, B A, A B, ...), so
load from other processes on the machine and slow drift (turbo, caches, page faults) fall on all of
them alike. Every timed call starts right after a barrier on the default process group, so all ranks
time the same call; a synchronous step ends when its slowest rank ends, so `step_times` takes, per
call, the maximum over ranks. Times are `time.perf_counter` wall seconds (the benchmarks are CPU/gloo).
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parent.parent


def add_repo_to_path() -> None:
    """Make `examples`, `tests` and `bench` importable when a script runs as `python bench/NAME.py`."""
    for path in (str(REPO_ROOT), str(REPO_ROOT / "examples")):
        if path not in sys.path:
            sys.path.insert(0, path)


def interleaved(fns: dict[str, Callable[[], object]], *, iters: int, warmup: int) -> dict[str, list[float]]:
    """Wall seconds of `iters` calls of each function, timed in rotated interleaved rounds.

    Collective: every rank must call it with the same names, `iters` and `warmup`.
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(iters):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            fns[name]()
            samples[name].append(time.perf_counter() - start)
    return samples


def step_times(per_rank: list[list[float]]) -> list[float]:
    """Per call, the slowest rank's time (the ranks' lists are aligned by the barriers)."""
    return [max(column) for column in zip(*per_rank)]


@dataclass(frozen=True)
class Spread:
    """Median and 10th / 90th percentiles of a list of seconds."""

    median_s: float
    p10_s: float
    p90_s: float

    @classmethod
    def of(cls, samples_s: list[float]) -> Spread:
        ordered = sorted(samples_s)
        return cls(statistics.median(ordered), _percentile(ordered, 0.1), _percentile(ordered, 0.9))

    def text(self) -> str:
        """'12.3 ms (11.9-13.0)': median and p10-p90, in ms."""
        return f"{self.median_s * 1e3:.1f} ms ({self.p10_s * 1e3:.1f}-{self.p90_s * 1e3:.1f})"


def _percentile(ordered: list[float], fraction: float) -> float:
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def paired_ratio(num_s: list[float], den_s: list[float]) -> Spread:
    """Spread of the per-round ratios num/den (each pair measured back to back in one round)."""
    return Spread.of([a / b for a, b in zip(num_s, den_s)])


def sign_test(num_s: list[float], den_s: list[float]) -> tuple[int, int, float]:
    """(rounds where num < den, rounds, two-sided binomial p-value of that count under "no difference").

    A distribution-free check that fits a noisy shared machine: it counts which of the pair won each
    round and ignores by how much, so a burst of load in one round cannot decide the result.
    """
    n = len(num_s)
    wins = sum(1 for a, b in zip(num_s, den_s) if a < b)
    tail = min(wins, n - wins)
    p = sum(math.comb(n, k) for k in range(tail + 1)) / 2**n
    return wins, n, min(1.0, 2 * p)


def machine_line() -> str:
    """'2 CPUs, load 7.9 (1 min)': what the figures were measured on, for the printed header."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{os.cpu_count()} CPUs, load average {load:.1f} (1 min) at start"

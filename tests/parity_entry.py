"""Rank entry for the multi-rank parity tests: run several jobs in one launch (one spawn, many checks)."""

from __future__ import annotations

from runtime.execute import run_rank
from runtime.job import RankReport, RunJob
from runtime.launch import RankContext


def run_jobs(ctx: RankContext, jobs: list[RunJob]) -> list[RankReport]:
    """`run_rank` for each job in turn, on the same process group."""
    return [run_rank(ctx, job) for job in jobs]

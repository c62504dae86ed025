"""The launching process's part of a run: the reference once, the ranks, the verdict.

    run_job(job, nproc, timeout_s) -> summary (runtime.job.summarise)

1. the unsharded model is built and run ONCE here, on the whole batch, and its outputs, loss,
   gradients and weights are written to a temporary folder (`runtime.reference.write_reference`);
   the model is freed before any rank starts, so no rank holds the whole model;
2. `nproc` ranks run `runtime.execute.run_rank`, each materialising only its own weight shards;
3. the ranks' reports are summarised, and a difference beyond the dtype's tolerance
   (`runtime.numerics`) is a RunError (exit 4) saying which output and by how much.

Under torchrun this process is one of the ranks: there is no launching process, so the reference is
made on local rank 0 of each node (`runtime.reference.shared_reference`) and only rank 0 returns a
summary.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from planner.errors import RunError
from planner.plan import Plan
from planner.progress import Progress, silent
from runtime.execute import run_rank
from runtime.job import RunJob, summarise
from runtime.launch import launch, under_torchrun
from runtime.numerics import check_failures
from runtime.reference import write_reference
from runtime.run_mode import check_plan_runs


def run_job(job: RunJob, nproc: int, timeout_s: float, progress: Progress = silent) -> dict[str, Any] | None:
    """Run `job` on `nproc` ranks and return `summarise` of their reports (None on a torchrun rank
    other than 0). `progress` (`planner.progress`): the reference, the ranks' start-up, rank 0's
    warm-up and timed iterations. Raises InputError for a model without weights or bad --weights
    (exit 2), RunError when a rank fails or the numerics are beyond tolerance (exit 4); InputError
    naming the plan field when the runtime cannot run the plan as planned
    (`runtime.run_mode.check_plan_runs`)."""
    plan = Plan.from_dict(job.plan)
    check_plan_runs(plan, job.workload)
    if under_torchrun():
        reports = launch(run_rank, job, nproc=nproc, timeout_s=timeout_s)
    else:
        directory = tempfile.mkdtemp(prefix="planner-reference-")
        try:
            progress("running the unsharded model once (the reference)", None)
            reference = write_reference(job, directory)
            gc.collect()  # the whole model is garbage now: the ranks start without it here
            reports = launch(
                run_rank,
                replace(job, reference=reference),
                nproc=nproc,
                timeout_s=timeout_s,
                progress=progress,
            )
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    if any(r is None for r in reports):
        return None  # under torchrun, ranks other than 0 do not receive the others' reports
    summary = summarise(reports)
    failures = check_failures(summary["numerics"])
    if failures:
        raise RunError(
            "the sharded run does not compute what the unsharded model computes on the same batch "
            "(reference: the unsharded model on the whole batch, tolerances by dtype in runtime.numerics):\n  "
            + "\n  ".join(
                failures + numerics_hints(plan.dtype, job.workload, plan.loss_scale, _rank_notes(summary))
            ),
            run=summary,
        )
    return summary


def _rank_notes(summary: dict[str, Any]) -> list[str]:
    """Every rank's notes in a run's summary (`runtime.job.summarise`)."""
    return [n for rank in summary.get("ranks", []) for n in rank.get("notes", [])]


def numerics_hints(
    dtype: str, workload: str, loss_scale: float | str | None = None, notes: Sequence[str] = ()
) -> list[str]:
    """Lines added to a failed numerics check that name a likely cause beyond the sharding itself:
    fp16 training without loss scaling (`Plan.loss_scale` null: --loss-scale off, or a plan written
    before the field). A loss averaged over many outputs has per-element gradients of 1e-6 and less,
    deep in fp16's subnormals, which round differently when the batch is split over ranks, in the
    reference too (a tiny Mixtral trained at DP 2: gradients 8.3e-5 apart at a scale of 2.3e-3, where
    bf16's agree to 2.5e-5); loss scaling (`runtime.loss_scaling`) lifts them into fp16's normal range.
    Or, with loss scaling, a checked step skipped for gradients that overflowed (the ranks' `notes`)."""
    skipped = next((n for n in notes if n.startswith("loss scaling") and "skipped" in n), None)
    if skipped is not None:  # `runtime.loss_scaling.LossScaler.note`
        return [
            f"note: the checked step's fp16 gradients overflowed on a rank and the step was skipped ({skipped}): "
            "its update is none; plan a smaller static --loss-scale, or dynamic"
        ]
    if dtype == "fp16" and workload == "train" and loss_scale is None:
        return [
            f"note: this fp16 training ran without loss scaling: gradients under fp16's smallest normal value "
            f"({torch.finfo(torch.float16).tiny:.1e}) keep few bits and round differently when the batch is split, in the "
            "reference too; plan with --loss-scale dynamic (the default for fp16 training; in a plan file: "
            "loss_scale: dynamic), or train in bf16"
        ]
    return []

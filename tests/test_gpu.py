"""NCCL / CUDA paths at world size 1 (one GPU cannot host two NCCL ranks). Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from planner.frontend.analysis import analyse
from planner.frontend.capture import capture
from planner.frontend.modelfile import load_model_file
from runtime.execute import run_rank
from runtime.job import RunJob, summarise
from runtime.launch import launch
from tests.plans import fixed_plan

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL path)")


@needs_gpu
def test_nccl_world_size_one_runs_forward_and_training_on_the_gpu():
    path = str(EXAMPLES / "llama3.py")
    model_file = load_model_file(path)
    args, kwargs = model_file.inputs()
    structure = analyse(capture(model_file.build("meta"), args, kwargs))
    jobs = [
        RunJob(path, fixed_plan(structure, path, 1, ladder_layers=[2, 3]).to_dict(), warmup=1, iters=3),
        RunJob(
            path,
            fixed_plan(structure, path, 1, workload="train").to_dict(),
            workload="train",
            warmup=1,
            iters=3,
        ),
    ]
    for job in jobs:
        reports = launch(run_rank, job, nproc=1, backend="nccl", timeout_s=120)
        s = summarise(reports)
        assert s["numerics"]["max_abs_diff"] <= 1e-4 * s["numerics"]["output_scale"]
        assert s["measured"]["latency_s"] > 0 and s["measured"]["peak_memory_bytes"] > 0


@needs_gpu
def test_calibrate_measures_the_gpu():
    from costmodels.calibrate import calibrate

    spec = calibrate(1)
    assert spec.backend == "nccl"
    assert spec.device.peak_flops_per_s["bf16"] > 1e12  # any current GPU beats 1 TFLOP/s in bf16

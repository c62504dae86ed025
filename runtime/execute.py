"""Run a plan on real process groups: lower the captured graph for this rank, check it, time it.

`run_rank(ctx, job)` is the per-rank entry that `runtime.launch.launch` starts on every rank (spawned
locally, or one process per rank under `torchrun`). Plans with pp > 1 go to
`runtime.pipeline_run.run_pipeline_rank`; for pp == 1 each rank:

1. builds its process groups and the model from the model file with the same seed (identical
   weights everywhere) and captures it on its DP replica's share of the batch
   (`runtime.job.set_up_rank`, `planner.frontend.capture.capture`);
2. computes the reference: the unsharded graph, with the plan's ladder layers applied when there are
   any (so `max_abs_diff` measures the rewrite alone), and `ladder_deviation`, how far ladder residual
   moved the original model's outputs;
3. lowers a copy for its mesh coordinates (`passes.lower.lower_for_rank`: TP pass, ladder pass);
4. runs forward (or a training step: forward, backward, Adam step) and compares outputs (and
   gradients) with the reference;
5. times warm-up + timed iterations with a barrier around each (`runtime.measure`) and reports the
   peak memory.

The result of each rank is a `runtime.job.RankReport`; `runtime.job.summarise` turns the list into
the report's `measured` and `numerics` sections.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F

from passes.ladder import apply_ladder, ladder_deviation, ladder_residual_adds
from passes.lower import lower_for_rank
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture, flat_inputs
from runtime.data_parallel import average_gradients, batch_share
from runtime.job import RankReport, RankSetup, RunJob, set_up_rank
from runtime.launch import RankContext
from runtime.measure import rank_peak_memory_bytes, reset_peak_memory, time_iterations
from runtime.numerics import first_output, grad_max_abs_diff, training_target
from runtime.pipeline_run import run_pipeline_rank
from runtime.profile import profile_layers


def run_rank(ctx: RankContext, job: RunJob) -> RankReport:
    """Per-rank entry: lower, check, time. See the module docstring. Raises on any failure (the
    launcher turns it into a RunError naming this rank)."""
    setup = set_up_rank(ctx, job)
    if setup.plan.pp > 1:
        return run_pipeline_rank(ctx, job, setup)
    plan, groups, training = setup.plan, setup.groups, setup.training
    model = setup.build_model()
    inputs = flat_inputs(setup.args, setup.kwargs)
    full = capture(model, setup.args, setup.kwargs)
    structure = analyse(full)
    adds = ladder_residual_adds(structure, plan.ladder_layers)
    whole_batch = training and plan.dp > 1  # the reference gradients are those of the whole batch
    reference = copy.deepcopy(full)
    full_inputs = inputs
    if whole_batch:
        full_inputs = flat_inputs(setup.full_args, setup.full_kwargs)
        reference = capture(model, setup.full_args, setup.full_kwargs)
        apply_ladder(reference, ladder_residual_adds(analyse(reference), plan.ladder_layers))
    deviation = None
    if adds:
        with torch.no_grad():
            original_out = first_output(full(*inputs))
        if not whole_batch:
            apply_ladder(reference, adds)
    gm = lower_for_rank(copy.deepcopy(full), structure, plan, ctx.rank, training=training).module
    del full, model

    with torch.no_grad():
        ref_out = first_output(reference(*full_inputs))
        if adds:
            deviation = ladder_deviation(original_out, ref_out)
    report = RankReport(
        rank=ctx.rank,
        tp_rank=groups.tp_rank,
        pp_rank=groups.pp_rank,
        latency_samples_s=[],
        median_s=0.0,
        peak_memory_bytes=0,
        max_abs_diff=None,
        output_scale=float(ref_out.abs().max()),
        ladder_deviation=deviation,
    )
    if training:
        step = _training_step(gm, reference, full_inputs, inputs, setup, report)
    else:
        with torch.no_grad():
            out = first_output(gm(*inputs))
        report.max_abs_diff = float((out - ref_out).abs().max())
        if job.return_output:
            report.output = out.cpu()

        def step() -> None:
            with torch.no_grad():
                gm(*inputs)

    reset_peak_memory(ctx.device)
    timing = time_iterations(step, warmup=job.warmup, iters=job.iters, device=ctx.device)
    report.latency_samples_s = list(timing.samples_s)
    report.median_s = timing.median_s
    report.peak_memory_bytes = rank_peak_memory_bytes(gm, ctx.device)
    if job.profile_layers and not training:
        report.per_layer_s = profile_layers(gm, inputs, [layer.module_path for layer in structure.layers])
    return report


def _training_step(
    gm: torch.nn.Module,
    reference: torch.nn.Module,
    full_inputs: tuple,
    inputs: tuple,
    setup: RankSetup,
    report: RankReport,
) -> Callable[[], None]:
    """Check one forward+backward against the unsharded reference on the whole batch (DP replicas
    average their gradients over the DP group); return a timed training step (forward, backward,
    DP gradient all-reduce, Adam update - the optimizer the cost model assumes for memory)."""
    plan, groups = setup.plan, setup.groups
    dp_group = groups.group("dp")
    ref_out = first_output(reference(*full_inputs))
    target_full = training_target(ref_out)
    F.mse_loss(ref_out, target_full).backward()
    full_grads = {name: p.grad for name, p in reference.named_parameters()}
    ref_local = batch_share((ref_out.detach(),), plan.dp, groups.dp_rank)[0]
    target = batch_share((target_full,), plan.dp, groups.dp_rank)[0]
    out = first_output(gm(*inputs))
    report.max_abs_diff = float((out.detach() - ref_local).abs().max())
    F.mse_loss(out, target).backward()
    average_gradients(gm, dp_group, plan.dp)
    report.grad_max_abs_diff = grad_max_abs_diff(gm, full_grads, plan, groups.tp_rank)
    optimizer = torch.optim.Adam(gm.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(first_output(gm(*inputs)), target).backward()
        average_gradients(gm, dp_group, plan.dp)
        optimizer.step()

    return step

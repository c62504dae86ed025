"""Run a plan with pipeline stages (PP > 1, optionally with TP inside each stage) on one rank.

Like `runtime.execute.run_rank`, but the graph is captured at the micro-batch size (captured shapes
are literals), lowered to this rank's stage (`passes.lower.lower_for_rank`: TP pass, then the split
at the layers' output nodes), and run through `torch.distributed.pipelining` with the plan's schedule
(`plan.schedule`: GPipe or 1F1B) and micro-batch count (`runtime.pipeline.PipelineRunner`). The
reference is the unsharded model on this DP replica's batch (its gradients: on the whole batch).
Training: forward + backward through the schedule, tied weights (GPT-2 embedding / LM head in
different stages) get their gradients summed between the two stages, DP replicas average gradients,
then an Adam step (the optimizer the cost model assumes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from passes.lower import lower_for_rank
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture, flat_inputs
from runtime.data_parallel import args_share, average_gradients, batch_share
from runtime.job import RankReport, RankSetup, RunJob
from runtime.launch import RankContext
from runtime.measure import time_iterations
from runtime.numerics import first_output, grad_max_abs_diff, training_target
from runtime.pipeline import PipelineRunner, all_reduce_tied_gradients


def run_pipeline_rank(ctx: RankContext, job: RunJob, setup: RankSetup) -> RankReport:
    """Per-rank entry for PP > 1 plans (see the module docstring); `setup` from `runtime.job.set_up_rank`.

    Raises InputError for a plan that ladders layers (not supported with pipeline stages) and
    ValueError when the batch does not divide into the plan's micro-batches.
    """
    plan, groups, training = setup.plan, setup.groups, setup.training
    model = setup.build_model()
    inputs = flat_inputs(setup.args, setup.kwargs)
    m = plan.micro_batches
    micro_args, micro_kwargs = args_share(setup.args, setup.kwargs, m, 0)
    gm = capture(model, micro_args, micro_kwargs)
    lowered = lower_for_rank(gm, analyse(gm), plan, ctx.rank, training=training)
    stage, pp_group = lowered.module, groups.group("pp")
    del gm
    first, last = lowered.pp_rank == 0, lowered.pp_rank == plan.pp - 1
    whole_batch = training and plan.dp > 1  # the reference gradients are those of the whole batch
    ref_args, ref_kwargs = (setup.full_args, setup.full_kwargs) if whole_batch else (setup.args, setup.kwargs)
    reference = capture(model, ref_args, ref_kwargs)
    with torch.set_grad_enabled(training):
        ref_full = first_output(reference(*flat_inputs(ref_args, ref_kwargs)))
    ref_out = batch_share((ref_full.detach(),), plan.dp, groups.dp_rank)[0] if whole_batch else ref_full
    runner = PipelineRunner(
        stage,
        lowered.pp_rank,
        plan.pp,
        m,
        pp_group,
        ctx.device,
        plan.schedule,
        loss_fn=F.mse_loss if training else None,
    )  # the schedule is built once, on the first step
    report = RankReport(
        rank=ctx.rank, tp_rank=lowered.tp_rank, pp_rank=lowered.pp_rank, latency_samples_s=[], median_s=0.0,
        peak_memory_bytes=0, max_abs_diff=None, output_scale=float(ref_out.detach().abs().max()),
        pipeline_schedule=runner.schedule_class.__name__,
    )  # fmt: skip
    stage_inputs = inputs if first else None

    if training:
        target_full = training_target(ref_full)
        F.mse_loss(ref_full, target_full).backward()
        full_grads = {name: p.grad for name, p in reference.named_parameters()}
        target = batch_share((target_full,), plan.dp, groups.dp_rank)[0]
        optimizer = torch.optim.Adam(stage.parameters(), lr=1e-3)
        dp_group = groups.group("dp")

        def step() -> torch.Tensor | None:
            optimizer.zero_grad(set_to_none=True)
            loss = runner.train_step(stage_inputs, target=target if last else None)
            all_reduce_tied_gradients(stage, lowered.pp_rank, lowered.tied, pp_group)
            average_gradients(stage, dp_group, plan.dp)
            return loss

        loss = step()
        if last:  # the pipeline's loss against the unsharded model's loss on the same batch
            report.max_abs_diff = float((loss - F.mse_loss(ref_out, target)).abs())
        report.grad_max_abs_diff = grad_max_abs_diff(stage, full_grads, plan, lowered.tp_rank)

        def timed() -> None:
            step()
            optimizer.step()

    else:
        out = runner.forward(stage_inputs)
        if last:
            report.max_abs_diff = float((first_output(out) - ref_out).abs().max())

        def timed() -> None:
            runner.forward(stage_inputs)

    timing = time_iterations(timed, warmup=job.warmup, iters=job.iters, device=ctx.device)
    report.latency_samples_s = list(timing.samples_s)
    report.median_s = timing.median_s
    # peak_memory_bytes: the process's real peak, filled in by runtime.execute.run_rank
    return report

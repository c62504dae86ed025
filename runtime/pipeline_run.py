"""Run a plan with pipeline stages (PP > 1, optionally with TP inside each stage) on one rank.

Like `runtime.execute.run_rank`, but the TP-rewritten graph is split into the plan's stages
(`passes.pipeline.split_stages` at the layers' output nodes) and this rank runs its stage through
`torch.distributed.pipelining` (GPipe schedule) with the plan's micro-batch count. The graph is
captured at the micro-batch size (captured shapes are literals); the reference is the unsharded
model on this DP replica's whole batch. Training: forward + backward through the schedule, tied
weights (GPT-2 embedding / LM head in different stages) get their gradients summed between the two
stages, DP replicas average gradients, then an Adam step (the optimizer the cost model assumes).
"""

from __future__ import annotations

import torch

from passes import collectives
from passes.pipeline import (
    PipelineRunner,
    all_reduce_tied_gradients,
    split_stages,
    stage_of_layers,
    tied_parameters,
)
from passes.tensor_parallel import apply_tensor_parallel
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture, flat_inputs
from planner.frontend.modelfile import load_model_file
from planner.plan import Plan
from runtime.execute import (
    RankReport,
    RunJob,
    _as_tensor,
    _average_gradients,
    _slice_args,
    grad_max_abs_diff,
    rank_peak_memory_bytes,
)
from runtime.launch import RankContext
from runtime.measure import reset_peak_memory, time_iterations
from runtime.mesh import build_mesh


def run_pipeline_rank(ctx: RankContext, job: RunJob, plan: Plan) -> RankReport:
    """Per-rank entry for PP > 1 plans (see the module docstring). Raises ValueError for a plan the
    pipeline runtime cannot execute (ladder residual across stages, batch not divisible)."""
    if plan.ladder_layers:
        raise ValueError(
            "ladder residual with pipeline stages is not supported by the runtime: pending all-reduces would cross "
            "a stage boundary; plan with --pp 1 or --ladder none"
        )
    mesh = build_mesh(plan.tp, plan.pp, plan.dp, ctx.device.type)
    collectives.register_group("tp", mesh.group("tp"))
    training = job.workload == "train"
    model_file = load_model_file(job.model_path)
    torch.manual_seed(job.seed)
    model = model_file.build(str(ctx.device))
    args, kwargs = model_file.inputs(job.batch_size, job.seq_len, device=str(ctx.device))
    if plan.dp > 1:
        args, kwargs = _slice_args(args, kwargs, plan.dp, mesh.dp_rank)
    inputs = flat_inputs(args, kwargs)
    m = plan.micro_batches
    batch = inputs[0].shape[0]
    if batch % m:
        raise ValueError(f"batch {batch} per DP replica does not divide into {m} micro-batches")
    reference = capture(model, args, kwargs)
    micro_args, micro_kwargs = _slice_args(args, kwargs, m, 0)
    gm = capture(model, micro_args, micro_kwargs)
    structure = analyse(gm)
    del model
    apply_tensor_parallel(gm, plan.splits, mesh.tp_rank, plan.tp, training=training)
    cuts = stage_of_layers(
        len(structure.layers), plan.stages, [layer.output_node for layer in structure.layers]
    )
    stages = split_stages(gm, cuts)
    tied = tied_parameters(stages)
    stage = stages[mesh.pp_rank]
    del stages, gm
    pp_group = mesh.group("pp")
    first, last = mesh.pp_rank == 0, mesh.pp_rank == plan.pp - 1
    with torch.set_grad_enabled(training):
        ref_out = _as_tensor(reference(*inputs))
    report = RankReport(
        rank=ctx.rank, tp_rank=mesh.tp_rank, pp_rank=mesh.pp_rank, latency_samples_s=[], median_s=0.0,
        peak_memory_bytes=0, max_abs_diff=None, output_scale=float(ref_out.detach().abs().max()),
    )  # fmt: skip
    stage_inputs = inputs if first else None
    loss_fn = torch.nn.functional.mse_loss if training else None
    runner = PipelineRunner(
        stage, mesh.pp_rank, plan.pp, m, pp_group, ctx.device, loss_fn=loss_fn
    )  # schedule built once

    if training:
        target = torch.linspace(-1.0, 1.0, ref_out.numel(), device=ref_out.device).reshape(ref_out.shape)
        torch.nn.functional.mse_loss(ref_out, target).backward()
        full_grads = {name: p.grad for name, p in reference.named_parameters()}
        optimizer = torch.optim.Adam(stage.parameters(), lr=1e-3)

        def step() -> torch.Tensor | None:
            optimizer.zero_grad(set_to_none=True)
            loss = runner.train_step(stage_inputs, target=target if last else None)
            all_reduce_tied_gradients(stage, mesh.pp_rank, tied, pp_group)
            _average_gradients(stage, plan.dp, mesh)
            return loss

        loss = step()
        if last:  # the pipeline's loss against the unsharded model's loss on the same batch
            report.max_abs_diff = float((loss - torch.nn.functional.mse_loss(ref_out, target)).abs())
        report.grad_max_abs_diff = grad_max_abs_diff(stage, full_grads, plan, mesh.tp_rank)
    else:

        def step() -> None:
            return runner.forward(stage_inputs)

        out = step()
        if last:
            report.max_abs_diff = float((_as_tensor(out) - ref_out).abs().max())
    timed = step
    if training:

        def timed() -> None:
            step()
            optimizer.step()

    reset_peak_memory(ctx.device)
    timing = time_iterations(timed, warmup=job.warmup, iters=job.iters, device=ctx.device)
    report.latency_samples_s = list(timing.samples_s)
    report.median_s = timing.median_s
    report.peak_memory_bytes = rank_peak_memory_bytes(stage, ctx.device)
    return report

"""Run a plan with pipeline stages (PP > 1, optionally with TP inside each stage) on one rank.

Like `runtime.execute.run_rank`, but the graph is captured at the micro-batch size (captured shapes
are literals; inputs are cut on their batch dims, `RankSetup.batch_dims`, inputs without one stay whole), lowered to this rank's stage (`passes.lower.lower_for_rank`: TP pass, then the split
at the layers' output nodes), and run through `torch.distributed.pipelining` with the plan's schedule
(`plan.schedule`: GPipe, 1F1B, or interleaved 1F1B with `plan.virtual_stages` model chunks per rank)
and micro-batch count (`runtime.pipeline.PipelineRunner`). The
graph is captured on the meta device and only the stage's own weight shards are loaded
(`passes.tensor_parallel.load_sharded_weights`). The reference is the unsharded model on the whole
batch, made once before the ranks started (`runtime.reference`): the last stage compares every
output with its DP replica's part of it, and in training the loss; every stage its gradients.
Training: forward + backward through the schedule, tied weights (GPT-2 embedding / LM head in
different stages) get their gradients summed between the two stages, DP replicas average gradients,
then an Adam step (the optimizer the cost model assumes; with `plan.distributed_optimizer` the
gradients are reduce-scattered, each replica updates its slice and the parameters are all-gathered:
`runtime.data_parallel.DistributedAdam`; zero2 / fsdp: one `Zero2Adam` / `FsdpAdam` per model
chunk, each chunk's layers and the parameters outside the layers it holds its units, fsdp chunks
rewritten by `passes.fsdp.apply_fsdp` and loaded shard by shard, the gradient sums divided by
dp x micro-batches: `runtime.data_parallel.ChunkedShardedAdam`; refused with parameters tied across
stages). The report's notes say which schedule, how many chunks
per rank and which optimizer ran. The model runs in the plan's dtype and,
for training, in train mode; the checked step runs with dropout off, the timed ones with dropout on
(`runtime.run_mode`).
"""

from __future__ import annotations

import contextlib

import torch

from costmodels.memory import DataParallel, dp_state_bytes
from passes.checkpoint import SafetensorsCheckpoint
from passes.fsdp import apply_fsdp, load_fsdp_weights
from passes.lower import lower_for_rank
from passes.placement import loss_output
from passes.rng import dropout_disabled
from passes.tensor_parallel import load_sharded_weights
from planner.errors import InputError
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture, flat_inputs, retarget_device
from runtime import loss_scaling
from runtime.data_parallel import (
    ChunkedShardedAdam,
    args_share,
    batch_share,
    build_optimizer,
    build_plan_optimizer,
    check_replicas_alike,
    expert_reduce_group,
    prepare_param_waits,
    state_bytes,
    state_grad_dtype,
    unbatched_note,
)
from runtime.job import RankReport, RankSetup, RunJob, time_steps
from runtime.launch import RankContext
from runtime.loss import LossLayout, gathered_output, loss_layout, output_loss, unheld_like
from runtime.numerics import all_outputs
from runtime.pipeline import PipelineRunner, sum_tied_gradients
from runtime.reference import (
    compare_gradients,
    compare_loss,
    compare_outputs,
    compare_update,
    dp_mean,
    record_routing,
    routing_replay,
    update_snapshot,
)
from runtime.routing import routers_of, routing_by_token
from runtime.run_mode import dropout_note, lowering_notes, random_draws_note, seed_dropout_rng, set_run_mode


def _loss_fn(layout: LossLayout, scaler: loss_scaling.LossScaler | None = None):
    """The last stage's loss per micro-batch: MSE of the model's first output (of a tuple of outputs)
    against its target, on the output's TP and CP shards where the passes leave it sharded
    (`runtime.loss.output_loss`; `layout`: what the stage holding it records); times the loss scale
    under fp16 loss scaling (`scaler`: the schedule runs the backward of what this returns)."""

    def loss_fn(out: torch.Tensor | tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        loss = output_loss(loss_output(out), target, layout)
        return scaler.scale_loss(loss) if scaler is not None else loss

    return loss_fn


def run_pipeline_rank(ctx: RankContext, job: RunJob, setup: RankSetup) -> RankReport:
    """Per-rank entry for PP > 1 plans (see the module docstring); `setup` from `runtime.job.set_up_rank`.

    Raises InputError for a plan that ladders layers (not supported with pipeline stages) and
    ValueError when the batch does not divide into the plan's micro-batches.
    """
    plan, groups, training = setup.plan, setup.groups, setup.training
    reference = setup.reference
    assert reference is not None, "runtime.execute.run_rank sets the reference before the plan runs"
    inputs = flat_inputs(setup.args, setup.kwargs)
    m = plan.micro_batches
    micro_args, micro_kwargs = args_share(setup.args, setup.kwargs, m, 0, setup.batch_dims)
    model = set_run_mode(setup.model_file.build("meta"), plan.dtype, training)  # no weight memory yet
    gm = capture(model, micro_args, micro_kwargs)
    structure = analyse(gm)
    lowered = lower_for_rank(gm, structure, plan, ctx.rank, training=training)
    pp_group = groups.group("pp")
    del gm
    sharded = training and plan.dp_style in (DataParallel.ZERO2, DataParallel.FSDP)
    if sharded and lowered.tied:  # on every rank as it starts: `runtime.launch` makes it exit 2
        tied = lowered.tied
        pairs = ", ".join(f"{a}:{fa} ~ {b}:{fb}" for a, fa, b, fb in tied[:4]) + (
            " ..." if len(tied) > 4 else ""
        )
        raise InputError(
            f"plan field 'dp_style' is {plan.dp_style} with pp={plan.pp} and parameters tied across stages "
            f"({pairs}): their sharded gradients cannot be summed between the stages; re-plan with --dp-style "
            "zero1 (or ddp), or --pp 1"
        )
    units = [layer.module_path for layer in structure.layers]  # ZeRO-2's and FSDP's wrapping units
    chunks = []  # this rank's stage, or its model chunks (virtual stages pp_rank, pp_rank + pp, ...)
    for chunk in lowered.chunks:
        # only this stage's parameters, and of those only this rank's TP shards, are materialised
        if sharded and plan.dp_style is DataParallel.FSDP:
            # each chunk's units its own: its layers, and the parameters outside them it holds
            layout = apply_fsdp(chunk, units, plan.dp_shard * plan.cp, groups.shard_rank)
            load_fsdp_weights(chunk, layout, reference.weights, plan.splits, lowered.tp_rank, plan.tp)
        else:
            load_sharded_weights(chunk, reference.weights, plan.splits, lowered.tp_rank, plan.tp)
        chunks.append(retarget_device(chunk, ctx.device).to(ctx.device))
    virtual = {c * plan.pp + lowered.pp_rank: chunk for c, chunk in enumerate(chunks)}
    params = [p for chunk in chunks for p in chunk.parameters()]
    first, last = lowered.pp_rank == 0, lowered.pp_rank == plan.pp - 1
    want = SafetensorsCheckpoint([reference.outputs])  # the unsharded model on the whole batch
    replay = routing_replay(want)  # its routers' expert choices by token
    # the first output as the stage computing it holds it (TP vocabulary shards, CP tokens): `runtime.loss`
    out_layout = loss_layout(chunks, lowered.tp_rank, plan.cp)
    # fp16: the losses times the scale, Adam's gradients divided by it (`runtime.loss_scaling`)
    scaler = (
        loss_scaling.for_run(plan.loss_scale, reference.loss_scale_factor, ctx.device) if training else None
    )
    runner = PipelineRunner(
        chunks,
        lowered.pp_rank,
        plan.pp,
        m,
        pp_group,
        ctx.device,
        plan.schedule,
        loss_fn=_loss_fn(out_layout, scaler) if training else None,
        input_batch_dims=setup.batch_dims,
    )  # the schedule is built once, on the first step
    report = RankReport(
        rank=ctx.rank, tp_rank=lowered.tp_rank, pp_rank=lowered.pp_rank, latency_samples_s=[], median_s=0.0,
        peak_memory_bytes=0, max_abs_diff=None, output_scale=float(want.read("output.0").abs().max()),
        pipeline_schedule=runner.schedule_class.__name__, output_dtype=reference.dtype, dtype=plan.dtype,
        notes=unbatched_note(flat_inputs(setup.full_args, setup.full_kwargs), setup.batch_dims)
        + lowering_notes(plan, lowered, training),
    )  # fmt: skip
    report.notes.append(runner.note())
    stage_inputs = inputs if first else None

    if training:
        # this replica's share of the whole batch's target (no name keeps the whole one past the check)
        target = batch_share((want.read("target").to(ctx.device),), plan.dp, groups.dp_rank)[0]
        dp_group = groups.group("dp")
        if sharded:  # one ZeRO-2 / FSDP optimizer per chunk, its gradient sums divided by dp x m
            parts = [build_plan_optimizer(plan, chunk, groups, units) for chunk in chunks]
            optimizer = ChunkedShardedAdam(parts, chunks, m)
        else:
            # overlap_grad_reduce: a hook issues a bucket before the schedule scales the gradients by
            # 1 / m (so divides by dp x m); tied copies wait for their sum across stages
            tied = {
                id(chunk.get_parameter(fqn))
                for a, fqn_a, b, fqn_b in lowered.tied
                for index, fqn in ((a, fqn_a), (b, fqn_b))
                if (chunk := virtual.get(index)) is not None
            }
            named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters()]
            # expert parallelism (`passes.ep_lower`): each chunk's expert parameters, reduced over their group
            expert_names = {n for chunk in chunks for n in getattr(chunk, "meta", {}).get("ep_params", ())}
            expert = [p for n, p in named if n in expert_names] if plan.ep > 1 else []
            expert_group = expert_reduce_group(plan, groups)
            check_replicas_alike(plan, named, groups, expert_names if plan.ep > 1 else set())
            optimizer = build_optimizer(
                plan.distributed_optimizer, params, groups.group("dp_cp"), plan.mesh.dp_cp, groups.dp_cp_rank,
                plan, named, units, hook_divisor=plan.mesh.dp_cp * m, deferred=tied, expert=expert,
                expert_group=expert_group,
            )  # fmt: skip
        prepare_param_waits(plan, chunks, units, optimizer)
        loss_scaling.attach(optimizer, scaler)

        def step(outputs: list | None = None) -> torch.Tensor | None:
            optimizer.zero_grad()
            loss = runner.train_step(stage_inputs, target=target if last else None, outputs=outputs)
            if not sharded:  # (refused above for sharded gradients)
                sum_tied_gradients(virtual, lowered.tied, pp_group, plan.pp)
            optimizer.reduce_gradients()
            return loss

        with contextlib.ExitStack() as off:  # like with like: the reference ran without dropout too
            for chunk in chunks:
                off.enter_context(dropout_disabled(chunk))
            # and its routers chose these experts (`runtime.routing`: replayed by token)
            off.enter_context(routing_by_token(chunks, routers_of(structure), replay))
            outputs: list = []
            loss = step(outputs)
            if loss is not None and scaler is not None:  # the schedule's losses are the scaled ones
                loss = loss / scaler.scale
        record_routing(report, replay)
        if last:  # every output of the checked step, then the loss (mean over the DP replicas), against the
            # unsharded model's; the loss's output gathered from its shards (a collective over this stage's ranks)
            outs = all_outputs(outputs[0])
            if out_layout.sharded:
                outs = (gathered_output(outs[0], out_layout), *outs[1:])
            compare_outputs(outs, want, reference, setup, report)
            compare_loss(dp_mean(loss, plan.dp, dp_group), want, report)
            del outs
        del outputs
        if sharded:  # each element's mean gradient on the rank that holds it
            compare_gradients(
                chunks, reference, setup, report, owned={}, segments=optimizer.gradient_segments(),
                local=optimizer.local_module,
            )  # fmt: skip
        else:
            compare_gradients(
                chunks, reference, setup, report, owned=optimizer.owned_ranges(), grad_of=optimizer.grad_of
            )
        # the first optimizer step, against Adam's from the reference's gradients
        before = update_snapshot(chunks, optimizer)
        optimizer.step()
        compare_update(chunks, before, optimizer, reference, setup, report)
        del before
        if scaler is not None:
            scaler.update()
        if sharded:  # the held state beside the memory model's, and the checked step's collectives
            report.state_bytes = state_bytes(optimizer.held_tensors())
            report.predicted_state_bytes = dp_state_bytes(
                optimizer.state_params(), plan.dtype, plan.dp_style, plan.dp_shard * plan.cp,
                grad_dtype=state_grad_dtype(plan),
            )  # fmt: skip
            report.dp_collectives = dict(optimizer.counts)
            report.gathered_peak_bytes = optimizer.peak_gathered_bytes
        else:  # ddp / zero1: the same record (the trainable parameters of this rank's chunks)
            report.state_bytes = state_bytes(optimizer.held_tensors())
            trainable = {id(p): p.numel() for chunk in chunks for p in chunk.parameters() if p.requires_grad}
            report.predicted_state_bytes = dp_state_bytes(
                sum(trainable.values()), plan.dtype, plan.dp_style, plan.dp_shard * plan.cp,
                grad_dtype=state_grad_dtype(plan),
            )  # fmt: skip
        for index, chunk in virtual.items():
            label = (
                f"stage {index}" if len(chunks) == 1 else f"virtual stage {index} (pp rank {lowered.pp_rank})"
            )
            report.notes.append(f"{label}: {dropout_note(chunk)}")
        report.notes.append(optimizer.note())
        if scaler is not None:
            report.notes.append(scaler.note())
        seed_dropout_rng(setup.seed, lowered.pp_rank, lowered.tp_rank, ctx.device)

        # the timed steps' target holds no memory (zeros expanded to its shape): the checked step's random
        # one was logits-sized floats for every micro-batch, which an LM's token labels are not
        target = unheld_like(target) if target is not None else None

        def timed() -> None:
            step()
            optimizer.step()
            if scaler is not None:
                scaler.update()

    else:
        with contextlib.ExitStack() as off:  # the model's own random draws at their expectation, as
            for chunk in chunks:  # the reference computed them
                off.enter_context(dropout_disabled(chunk))
            off.enter_context(routing_by_token(chunks, routers_of(structure), replay))
            out = runner.forward(stage_inputs)
        record_routing(report, replay)
        report.notes += [note for chunk in chunks if (note := random_draws_note(chunk))]
        if last:  # every output against this replica's part of the whole-batch reference
            compare_outputs(all_outputs(out), want, reference, setup, report)
            if job.return_output:
                report.output = all_outputs(out)[0].cpu()

        del out  # the checked step's outputs: the timed steps hold none of them

        def timed() -> None:  # each micro-batch's output dropped once computed, as a consumer takes it
            runner.forward(stage_inputs, keep_outputs=False)

    want.close()
    time_steps(timed, job, ctx.device, report)
    # peak_memory_bytes: the process's real peak, filled in by runtime.execute.run_rank
    return report

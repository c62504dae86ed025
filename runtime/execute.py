"""Run a plan on real process groups: lower the captured graph for this rank, check it, time it.

`run_rank(ctx, job)` is the per-rank entry that `runtime.launch.launch` starts on every rank (spawned
locally, or one process per rank under `torchrun`). The unsharded reference is made once, before
the ranks start (`runtime.reference`: the whole model on the whole batch, its outputs, loss and
gradients, and the weights as safetensors); a rank never builds the whole model for it. Plans with
pp > 1 go to `runtime.pipeline_run.run_pipeline_rank`; for pp == 1 each rank:

1. builds its process groups, loads the model file and cuts the inputs to its DP replica's share
   (`runtime.job.set_up_rank`);
2. builds the model on the meta device, captures it at its share's shapes and lowers it for its
   mesh coordinates (`passes.lower.lower_for_rank`: TP pass with sequence parallelism when the plan
   says so, ladder pass, and for training the plan's activation recompute) - no weight memory yet;
3. materialises only its own weight shards from the safetensors files
   (`passes.tensor_parallel.load_sharded_weights`, read slice by slice);
4. runs forward (or a training step: forward, backward, DP gradient average) and compares EVERY
   output with its part of the reference's whole-batch output (an output without a batch dim is
   averaged over the DP replicas first); training also compares the loss and every gradient
   (`runtime.numerics`);
5. times warm-up + timed iterations with a barrier around each (`runtime.measure`) and reports the
   process's real peak memory beside what it held at the start.

The report's notes say what the lowering applied (`runtime.run_mode.lowering_notes`: sequence
parallelism with its collectives, recomputed layers). The result of each rank is a `runtime.job.RankReport`; `runtime.job.summarise` turns the list into
the report's `measured` and `numerics` sections, and `runtime.numerics.check_failures` says which
differences are beyond tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.fx as fx

from costmodels.memory import DataParallel, dp_state_bytes
from passes.checkpoint import SafetensorsCheckpoint
from passes.fsdp import apply_fsdp, fsdp_layout, load_fsdp_weights
from passes.lower import RankLowering, lower_for_rank
from passes.rng import dropout_disabled
from passes.tensor_parallel import load_sharded_weights
from planner.errors import RunError
from planner.frontend.analysis import ModelStructure, analyse
from planner.frontend.capture import capture, flat_inputs, retarget_device
from planner.plan import Plan
from runtime import loss_scaling
from runtime.data_parallel import (
    args_share,
    build_plan_optimizer,
    state_bytes,
    state_grad_dtype,
    unbatched_note,
)
from runtime.job import RankReport, RankSetup, ReferenceFiles, RunJob, set_up_rank, time_steps
from runtime.launch import RankContext, report_progress
from runtime.loss import full_shape, gathered_output, loss_layout, output_loss, unheld_like
from runtime.measure import current_memory_bytes, heap_in_use_bytes, process_peak_memory_bytes
from runtime.numerics import all_outputs, replica_share
from runtime.pipeline_run import run_pipeline_rank
from runtime.profile import profile_layers
from runtime.reference import (
    compare_gradients,
    compare_loss,
    compare_outputs,
    compare_update,
    dp_mean,
    record_routing,
    routing_replay,
    shared_reference,
    update_snapshot,
)
from runtime.routing import TokenRoutingTape, routers_of, routing_by_token
from runtime.run_mode import (
    dropout_note,
    expert_load_notes_of,
    lowering_notes,
    random_draws_note,
    seed_dropout_rng,
    set_run_mode,
)


def run_rank(ctx: RankContext, job: RunJob) -> RankReport:
    """Per-rank entry: lower, load shards, check, time. See the module docstring. Raises on any
    failure (the launcher turns it into a RunError naming this rank)."""
    startup_bytes = current_memory_bytes(ctx.device)
    startup_heap = heap_in_use_bytes() if ctx.device.type == "cpu" else None
    report_progress("lowering the plan, loading this rank's shards, checking numerics", None)
    setup = set_up_rank(ctx, job)
    with shared_reference(ctx, job) as reference:
        setup.reference = reference
        if setup.plan.pp > 1:
            report = run_pipeline_rank(ctx, job, setup)
        else:
            report = _run_sharded_rank(ctx, job, setup, reference)
    report.startup_memory_bytes = startup_bytes
    report.startup_heap_bytes = startup_heap
    report.peak_memory_bytes = process_peak_memory_bytes(ctx.device)
    if job.weights:
        report.notes.append(
            f"weights read from {', '.join(job.weights)} (cast to the plan's {setup.plan.dtype} where stored otherwise)"
        )
    if reference.made_on == f"rank {ctx.rank}":
        report.notes.append(
            "the unsharded reference was built on this rank (no launching process made it), so its peak "
            "memory includes the whole model"
        )
    return report


def build_rank_module(
    ctx: RankContext, setup: RankSetup, reference: ReferenceFiles, call: tuple[tuple, dict] | None = None
) -> tuple[fx.GraphModule, ModelStructure, RankLowering]:
    """This rank's lowered module with its weight shards, built without the whole model: meta build,
    capture at this DP replica's shapes (or `call`'s (args, kwargs): one micro-batch of them),
    `lower_for_rank` (TP with sequence parallelism, ladder,
    training: activation recompute, as the plan says), then `load_sharded_weights` from the
    reference's safetensors files; factory ops retargeted to the rank's device. Also returns the
    captured structure and the lowering (what was applied, for the report's notes). A training fsdp
    plan's module is then sharded by wrapping unit (`passes.fsdp.apply_fsdp`: each layer's parameters,
    and those outside the layers, one flat shard per rank of the shard group, gathered in the graph)
    and only this rank's shards are loaded (`passes.fsdp.load_fsdp_weights`)."""
    plan = setup.plan
    # the plan's dtype, and train mode for training (dropout in the graph): runtime.run_mode
    model = set_run_mode(setup.model_file.build("meta"), plan.dtype, setup.training)
    gm = capture(model, *(call or (setup.args, setup.kwargs)))
    structure = analyse(gm)
    lowered = lower_for_rank(gm, structure, plan, ctx.rank, training=setup.training)
    gm = lowered.module
    if setup.training and plan.dp_style is DataParallel.FSDP:
        # FSDP after the lowering (which DP replicas share): this DP rank's flat shard of every unit
        units = [layer.module_path for layer in structure.layers]
        layout = apply_fsdp(gm, units, plan.dp_shard * plan.cp, setup.groups.shard_rank)
        load_fsdp_weights(gm, layout, reference.weights, plan.splits, setup.groups.tp_rank, plan.tp)
    else:
        load_sharded_weights(gm, reference.weights, plan.splits, setup.groups.tp_rank, plan.tp)
    retarget_device(gm, ctx.device)
    return gm.to(ctx.device), structure, lowered


def _run_sharded_rank(
    ctx: RankContext, job: RunJob, setup: RankSetup, reference: ReferenceFiles
) -> RankReport:
    """pp == 1: steps 2-5 of the module docstring. With m > 1 micro-batches the module is captured at
    one micro-batch's shapes; training accumulates over them (`_training_step`), a forward runs them
    one after another and joins their outputs, as the plan priced it (a forward ran the whole batch at
    once where m micro-batches were priced: measured 0.45 of a prediction twice the step it ran)."""
    m = setup.plan.micro_batches
    micro = (
        [args_share(setup.args, setup.kwargs, m, i, setup.batch_dims) for i in range(m)] if m > 1 else None
    )
    gm, structure, lowered = build_rank_module(ctx, setup, reference, micro[0] if micro else None)
    inputs = flat_inputs(setup.args, setup.kwargs)
    report = RankReport(
        rank=ctx.rank,
        tp_rank=setup.groups.tp_rank,
        pp_rank=setup.groups.pp_rank,
        latency_samples_s=[],
        median_s=0.0,
        peak_memory_bytes=0,
        max_abs_diff=None,
        output_scale=None,
        ladder_deviation=reference.ladder_deviation,
        dtype=setup.plan.dtype,
        notes=unbatched_note(flat_inputs(setup.full_args, setup.full_kwargs), setup.batch_dims)
        + lowering_notes(setup.plan, lowered, setup.training),
    )
    with SafetensorsCheckpoint([reference.outputs]) as want:
        # the checked step's routers take the reference's expert choices by token (`runtime.routing`)
        replay = routing_replay(want)
        routers = routers_of(structure)
        if setup.training:
            parts = [flat_inputs(*call) for call in micro] if micro else [inputs]
            units = [layer.module_path for layer in structure.layers]
            step = _training_step(gm, parts, setup, reference, want, report, units, (routers, replay))
        else:
            parts = [flat_inputs(*call) for call in micro] if micro else [inputs]
            # the model's own random draws at their expectation, as the reference computed them
            with torch.no_grad(), routing_by_token([gm], routers, replay), dropout_disabled(gm):
                kept = [all_outputs(gm(*part)) for part in parts]
            report.notes += [note for note in [random_draws_note(gm)] if note]
            outs = _joined(kept, want, setup.plan.dp * m) if micro else kept[0]
            if outs is None:
                raise RunError(
                    f"plan field 'micro_batches' ({m}): the forward's outputs do not join along a batch dim "
                    "into the batch's, so the micro-batches' outputs cannot be checked; plan with "
                    "--micro-batches 1"
                )
            del kept
            if micro:
                report.notes.append(
                    f"{m} micro-batches per forward, run one after another, their outputs joined"
                )
            inputs = parts[0]  # the per-layer profile runs one micro-batch, as the per-layer table prices
            record_routing(report, replay)
            compare_outputs(outs, want, reference, setup, report)
            report.notes += expert_load_notes_of(gm, ctx.rank)
            if job.return_output:
                report.output = outs[0].cpu()
            del outs  # the checked step's outputs: the timed steps hold none of them

            def step() -> None:
                with torch.no_grad():
                    for part in parts:
                        gm(*part)

    time_steps(step, job, ctx.device, report)
    if job.profile_layers and not setup.training:
        report_progress("profiling the layers", None)
        report.per_layer_s = profile_layers(gm, inputs, [layer.module_path for layer in structure.layers])
    return report


def _training_step(
    gm: torch.nn.Module,
    parts: list[tuple],
    setup: RankSetup,
    reference: ReferenceFiles,
    want: SafetensorsCheckpoint,
    report: RankReport,
    units: Sequence[str] = (),
    routing: tuple[dict[str, str], TokenRoutingTape] | None = None,
) -> Callable[[], None]:
    """Check one forward+backward against the unsharded model on the whole batch: every output, the
    MSE loss (averaged over the DP replicas: equal shares, so the whole batch's mean) and every
    gradient (after the DP reduction), then the first optimizer step. Return a timed training step
    (forward, backward, DP gradient all-reduce and Adam update, or with `plan.distributed_optimizer`
    reduce-scatter, sharded Adam and all-gather; ZeRO-2 and FSDP as `plan.dp_style` says:
    `runtime.data_parallel.build_plan_optimizer`; units: the layers' module paths, ZeRO-2's units).
    With sharded gradients the check compares each element's mean gradient on the rank that holds it
    (`gradient_segments`), and the first step through the values each rank steps.

    parts: the replica's inputs (flat), whole, or as the plan's m micro-batches: then each runs its
    forward and backward with its loss / m, the gradients accumulating (equal shares, so the same
    mean) before one reduction and optimizer step, as the plan priced it; the checked step does the
    same, and the replica's outputs are the micro-batches' joined along their batch dim. The check
    runs with dropout off (as the reference did); the timed steps with dropout on, its RNG seeded
    per TP rank for shards (`runtime.run_mode`, `passes.rng`). ``routing``: the routers (`routers_of`)
    and the reference's expert choices, replayed by token in the checked step (`runtime.routing`)."""
    plan, groups = setup.plan, setup.groups
    dp_group = groups.group("dp")
    optimizer = build_plan_optimizer(plan, gm, groups, units)
    # fp16: the losses times the scale, Adam's gradients divided by it (`runtime.loss_scaling`)
    scaler = loss_scaling.for_run(plan.loss_scale, reference.loss_scale_factor, setup.device)
    loss_scaling.attach(optimizer, scaler)
    m = len(parts)
    # the first output as the passes leave it (TP vocabulary shards, CP tokens): the loss runs on it (`runtime.loss`)
    layout = loss_layout([gm], groups.tp_rank, plan.cp)
    routers, replay = routing if routing is not None else ({}, TokenRoutingTape())
    # like with like: the reference ran with dropout off too, and its routers chose these experts
    with dropout_disabled(gm), routing_by_token([gm], routers, replay):
        # each micro-batch's forward, then its backward, as the timed steps run them (so the checked
        # step holds one micro-batch's activations and, FSDP without reshard, its gathered units)
        kept, targets, loss = [], [], None
        target_full = None
        for i, part in enumerate(parts):
            out = all_outputs(gm(*part))
            first = gathered_output(out[0], layout) if layout.sharded else out[0]
            kept.append(tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in (first, *out[1:])))
            if target_full is None:  # its own memory: a view of the mapped file would keep it mapped
                target_full = want.read("target").to(out[0].device, copy=True)
            # micro-batch i of replica r is share r * m + i of the batch
            shape = full_shape(tuple(out[0].shape), layout)
            part_target = replica_share(target_full, shape, plan.dp * m, groups.dp_rank * m + i)
            assert part_target is not None, "output 0 is a share of the unsharded output (checked below)"
            targets.append(part_target)
            part_loss = output_loss(out[0], part_target, layout) / m
            loss_scaling.backward(part_loss, scaler)
            loss = part_loss.detach() if loss is None else loss + part_loss.detach()
            del out, first, part_loss
        replica_outs = _joined(kept, want, plan.dp * m)
        if replica_outs is not None:
            compare_outputs(replica_outs, want, reference, setup, report)
        del kept
        report.notes += expert_load_notes_of(gm, report.rank)
        optimizer.reduce_gradients()
    record_routing(report, replay)
    mean_loss = dp_mean(loss, plan.dp, dp_group)
    compare_loss(mean_loss, want, report)
    # no output joins into the replica's: the loss stands for them (as in a pipeline)
    if replica_outs is None:
        report.output_dtype = str(mean_loss.dtype).removeprefix("torch.")
        report.max_abs_diff, report.output_scale = report.loss_diff, report.loss_scale
    segments = optimizer.gradient_segments() if hasattr(optimizer, "gradient_segments") else None
    local = getattr(optimizer, "local_module", None)
    compare_gradients(
        gm, reference, setup, report, owned=optimizer.owned_ranges(), segments=segments, local=local,
        grad_of=getattr(optimizer, "grad_of", None),
    )  # fmt: skip
    del segments
    # the first optimizer step (the gradients are reduced already) against Adam's from the reference's
    before = update_snapshot(gm, optimizer)
    optimizer.step()
    compare_update(gm, before, optimizer, reference, setup, report)
    del before
    _record_state(report, optimizer, gm, plan)
    report.notes.append(dropout_note(gm))
    report.notes.append(optimizer.note())
    if scaler is not None:
        scaler.update()
        report.notes.append(scaler.note())
    if m > 1:
        report.notes.append(
            f"{m} micro-batches per step: gradients accumulated over them, then one optimizer step"
        )
    seed_dropout_rng(setup.seed, groups.pp_rank, groups.tp_rank, setup.device)  # timed steps: dropout on
    # the timed steps' targets hold no memory (zeros expanded to the outputs' shape): the checked step's
    # random ones were logits-sized floats for every micro-batch (views of the whole batch's, freed
    # here), which an LM's token labels are not
    targets = [unheld_like(t) for t in targets]

    def step() -> None:
        optimizer.zero_grad()
        for part, part_target in zip(parts, targets):
            loss_scaling.backward(output_loss(all_outputs(gm(*part))[0], part_target, layout) / m, scaler)
        optimizer.step()  # reduces the gradients over the DP group first
        if scaler is not None:
            scaler.update()

    return step


def _record_state(report: RankReport, optimizer: object, gm: torch.nn.Module, plan: Plan) -> None:
    """The training state the rank holds after its first step (parameters, gradients, Adam state,
    masters: distinct storages) beside the cost model's `dp_state_bytes` of the rank's parameter
    count (at rest: sharded parameters counted as shards); zero2 / fsdp also the collectives of the
    checked step."""
    report.state_bytes = state_bytes(optimizer.held_tensors())
    layout = fsdp_layout(gm)
    if layout is not None:
        params = sum(b.numel for b in layout.buckets)
    else:
        params = sum(p.numel() for p in gm.parameters() if p.requires_grad)
    report.predicted_state_bytes = dp_state_bytes(
        params, plan.dtype, plan.dp_style, plan.dp_shard * plan.cp, grad_dtype=state_grad_dtype(plan)
    )
    counts = getattr(optimizer, "counts", None)
    if counts is not None:
        report.dp_collectives = dict(counts)
    runtime = getattr(optimizer, "runtime", None)
    if runtime is not None:
        report.gathered_peak_bytes = runtime.peak_gathered_bytes
    report.grad_peak_bytes = getattr(optimizer, "peak_grad_bytes", None)


def _joined(
    outs: list[tuple[torch.Tensor, ...]], want: SafetensorsCheckpoint, shares: int
) -> tuple[torch.Tensor, ...] | None:
    """The replica's outputs from its micro-batches' (`outs`, one tuple per micro-batch; one entry:
    returned as it is): each output joined along the one dim where the unsharded output is `shares`
    times the micro-batch's, or, with the unsharded output's shape (no batch dim), their mean. None
    when an output is neither (the caller compares the loss instead)."""
    if len(outs) == 1:
        return outs[0]
    joined = []
    for i, pieces in enumerate(zip(*outs)):
        full = tuple(want.shape(f"output.{i}"))
        shape = tuple(pieces[0].shape)
        if full == shape:
            joined.append(torch.stack([p.detach() for p in pieces]).mean(0))
            continue
        dims = [d for d in range(len(shape)) if len(full) == len(shape) and full[d] == shape[d] * shares]
        if len(dims) != 1:
            return None
        joined.append(torch.cat([p.detach() for p in pieces], dim=dims[0]))
    return tuple(joined)

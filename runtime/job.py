"""A run of a plan: what every rank is asked to do (`RunJob`), what it sets up from it
(`set_up_rank`), what it reports (`RankReport`), and the summary over ranks (`summarise`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from costmodels.calibrate import PROBE_MATMUL_SHAPE, SpeedProbe
from costmodels.dtypes import DTYPE_BYTES, torch_dtype
from passes import collectives
from planner.errors import InputError
from planner.frontend.capture import flat_inputs, input_batch_dims
from planner.frontend.modelfile import ModelFile, load_model_file
from planner.frontend.phases import cast_inputs
from planner.plan import DataParallel, Plan
from runtime.data_parallel import args_share
from runtime.launch import RankContext, report_progress
from runtime.measure import heap_peak_bytes, time_iterations
from runtime.mesh import DP_AXES, RankGroups, build_rank_groups
from runtime.numerics import output_tolerance_scale, tolerance_for
from runtime.run_mode import check_dtype_runs, check_plan_runs


@dataclass
class ReferenceFiles:
    """The unsharded model's run on the whole batch, written once (`runtime.reference.write_reference`)
    for every rank to compare with and to load its weight shards from."""

    directory: str  # folder holding the files below (removed by whoever made it)
    weights: list[str]  # safetensors files the ranks load their shards from (--weights, plus extra tensors)
    outputs: str  # safetensors: output.{i} (whole batch); training: target, loss
    grads: str | None  # training: safetensors of every parameter's whole-batch gradient, by FQN
    num_outputs: int
    dtype: str  # dtype of output 0, e.g. "float32": picks the numerics tolerance (runtime.numerics)
    ladder_deviation: float | None  # relative L2 of laddered vs original outputs; None without ladder
    made_on: str  # "launching process" | "rank N": where the unsharded model was built and run
    # fp16 loss scaling: the scale the saved gradients carry (`runtime.loss_scaling.reference_scale`); 1 without
    loss_scale_factor: float = 1.0


@dataclass
class RunJob:
    """What every rank needs to execute a plan (pickled to the ranks)."""

    model_path: str
    plan: dict[str, Any]  # Plan.to_dict()
    batch_size: int | None = None
    seq_len: int | None = None
    workload: str = "forward"  # "forward" | "train"
    warmup: int = 2
    iters: int = 5
    min_time_s: float = (
        0.0  # time at least this long (more than `iters` calls: runtime.measure.time_iterations)
    )
    seed: int = 0
    return_output: bool = False  # put the rank's output tensor in the report (tests)
    profile_layers: bool = False  # forward: time every node once more, summed per layer (runtime.profile)
    # per graph input: its batch dim, None for an input without one (not split by DP / micro-batches);
    # None: found on the ranks from the model file (planner.frontend.capture.input_batch_dims)
    input_batch_dims: list[int | None] | None = None
    weights: list[str] | None = (
        None  # safetensors files of the unsharded model (--weights); None: seeded init
    )
    reference: ReferenceFiles | None = None  # made by the launching process; None: made on each node's rank 0
    # CPU: time the calibration's per-node overhead probe between the timed samples (the machine's
    # speed during the run: costmodels.calibrate.SpeedProbe); ~2 s to build on each rank
    speed_probe: bool = False


@dataclass
class RankReport:
    """One rank's measurements (seconds, bytes) and numerics against the unsharded reference."""

    rank: int
    tp_rank: int
    pp_rank: int
    latency_samples_s: list[float]
    median_s: float
    peak_memory_bytes: int
    max_abs_diff: float | None  # vs the unsharded reference (ladder applied to both); None off the last stage
    output_scale: float | None  # max |reference output|
    grad_max_abs_diff: float | None = None  # training: worst gradient difference over this rank's parameters
    grad_worst: str | None = None  # training: the parameter (FQN on this rank) of that worst difference
    output_diffs: list[float] = field(default_factory=list)  # max |diff| of every output, in output order
    output_scales: list[float] = field(default_factory=list)  # max |reference| of every output
    # of every output: the largest |value| its last op read in the reference (`numerics.operand_scales`)
    operand_scales: list[float] = field(default_factory=list)
    output_dtype: str | None = None  # dtype of the first output compared, e.g. "float32"
    output_dtypes: list[str] = field(default_factory=list)  # dtype of every output, in output order
    loss_diff: float | None = None  # training: |loss (DP-averaged) - unsharded loss on the whole batch|
    loss_scale: float | None = None  # training: |unsharded loss|
    grad_scale: float | None = None  # training: max |unsharded gradient| over this rank's parameters
    grad_loss_scale: float | None = None  # fp16 loss scaling: the gradients compared are the loss's times it
    grads_compared: int = 0  # training: gradients (or, sharded, pieces of them) compared on this rank
    update_max_abs_diff: float | None = None  # training: first optimizer step (`compare_update`)
    update_tolerance: float | None = None  # its tolerance (a share of the learning rate)
    startup_memory_bytes: int = (
        0  # memory held when the rank started, before any model tensor (runtime, libraries)
    )
    # CPU with glibc: the heap in use at its highest over one untimed step after the timed ones, and at
    # the rank's start (`runtime.measure.heap_peak_bytes`, `heap_in_use_bytes`); None elsewhere
    heap_peak_bytes: int | None = None
    startup_heap_bytes: int | None = None
    ladder_deviation: float | None = None  # relative L2 of laddered vs original outputs
    pipeline_schedule: str | None = None  # pp > 1: the torch.distributed.pipelining schedule class run
    steps_per_sample: int = 1  # > 1: each latency sample is the mean of that many back-to-back steps
    dtype: str | None = None  # the plan dtype the rank ran its model and inputs in ("bf16")
    notes: list[str] = field(default_factory=list)
    # RunJob.speed_probe: the per-node overhead measured beside the timed steps, seconds per node
    # (backward: per forward node, training only), and how many probe samples it is the median of
    probe_node_overhead_s: float | None = None
    probe_backward_node_overhead_s: float | None = None
    probe_matmul_flops_per_s: float | None = None  # the probe's fp32 matmul (PROBE_MATMUL_SHAPE)
    probe_samples: int = 0
    # training: the state this rank holds after the first step (parameters, gradients, Adam state and
    # fp32 masters; distinct storages), and the cost model's `dp_state_bytes` of its parameter count
    state_bytes: int | None = None
    predicted_state_bytes: float | None = None
    # training: collectives the data-parallel optimizer issued in the checked step, by kind
    # ("all_gather", "reduce_scatter", "all_reduce"); zero2 and fsdp only
    dp_collectives: dict[str, int] = field(default_factory=dict)
    gathered_peak_bytes: int | None = None  # fsdp: most bytes of gathered parameters alive at once
    # zero2: most bytes of unsharded gradients and reduce-scatter buffers alive at once
    grad_peak_bytes: int | None = None
    output: torch.Tensor | None = None  # only with RunJob.return_output
    per_layer_s: dict[str, float] = field(
        default_factory=dict
    )  # forward: measured seconds per layer / "ends"
    # the checked step's routers replayed the reference's expert choices by token (`runtime.routing`):
    # calls, rows whose own choice differed and the largest finite score gap of those, the routers'
    # logits against the reference's and the reference logits' largest magnitude, rows with no
    # reference token within rounding (kept their own choice)
    routing_calls: int = 0
    routing_flipped: int = 0
    routing_max_gap: float = 0.0
    routing_logit_diff: float = 0.0
    routing_logit_scale: float = 0.0
    routing_unmatched: int = 0


@dataclass
class RankSetup:
    """What a rank sets up from its job before lowering: process groups, model file, inputs."""

    plan: Plan
    groups: RankGroups  # this rank's process groups; the "tp" axis is registered for the collectives
    model_file: ModelFile
    device: torch.device
    seed: int
    training: bool
    full_args: tuple  # the whole batch, (args, kwargs) of the model call
    full_kwargs: dict
    args: tuple  # this DP replica's share of the batch (along each input's batch dim)
    kwargs: dict
    batch_dims: tuple[int | None, ...]  # per graph input: its batch dim, or None (never split)
    reference: ReferenceFiles | None = None  # set by runtime.execute.run_rank before the plan runs


def job_inputs(model_file: ModelFile, job: RunJob, device: str) -> tuple[tuple, dict]:
    """The whole batch of the job, (args, kwargs) on `device`: `example_inputs` called right after
    `torch.manual_seed(job.seed)`, so a file that draws random inputs gives the same batch to the
    launching process and to every rank. Raises InputError like `ModelFile.inputs`."""
    torch.manual_seed(job.seed)
    return model_file.inputs(job.batch_size, job.seq_len, device=device)


def set_up_rank(ctx: RankContext, job: RunJob) -> RankSetup:
    """Build this rank's process groups (collective; fsdp's HSDP shard and replicate groups too),
    register the TP group (and fsdp's "dp_shard" / "dp_replicate") with `passes.collectives`, load the model file, cast its floating inputs to the plan's dtype and cut
    them to this DP replica's share. Raises ValueError when the batch does not divide by dp,
    InputError when this device cannot run the plan's dtype or the runtime cannot run the plan as
    planned (`runtime.run_mode.check_plan_runs`)."""
    plan = Plan.from_dict(job.plan)
    check_plan_runs(plan, job.workload)
    dp_shard = plan.dp_shard if plan.dp_style is DataParallel.FSDP else 1
    groups = build_rank_groups(
        plan.mesh,
        ctx.device.type,
        dp_shard,
        plan.ep if plan.ep_fold == "dp" else 1,
        plan.experts_on_sequence_shard,
    )
    collectives.register_group("tp", groups.group("tp"))
    collectives.register_group("cp", groups.group("cp"))  # context-parallel attention (passes.cp_lower)
    collectives.register_group(
        "ep", groups.group("ep")
    )  # expert parallelism's all-to-alls (passes.expert_parallel)
    for axis in DP_AXES:  # fsdp's gathers (passes.fsdp) run on these
        collectives.register_group(axis, groups.group(axis))
    model_file = load_model_file(job.model_path)
    check_dtype_runs(plan.dtype, ctx.device)
    full_args, full_kwargs = job_inputs(model_file, job, str(ctx.device))
    full_args, full_kwargs = cast_inputs(full_args, full_kwargs, plan.dtype)
    batch_dims = job_batch_dims(
        job, model_file, len(flat_inputs(full_args, full_kwargs)), splits=plan.dp * plan.micro_batches > 1
    )
    args, kwargs = args_share(full_args, full_kwargs, plan.dp, groups.dp_rank, batch_dims)
    training = job.workload == "train"
    return RankSetup(
        plan, groups, model_file, ctx.device, job.seed, training, full_args, full_kwargs, args, kwargs,
        batch_dims,
    )  # fmt: skip


def job_batch_dims(
    job: RunJob, model_file: ModelFile, num_inputs: int, splits: bool = True
) -> tuple[int | None, ...]:
    """Every graph input's batch dim: the job's, else found from the model file's example inputs at
    the job's batch size and twice it (`input_batch_dims`). `splits` False (one replica, one
    micro-batch: nothing splits the batch): inputs whose batch dim cannot be found are given whole (a
    file whose `example_inputs` takes no batch size; the planner kept such a batch whole). Raises
    InputError for inputs whose batch dim cannot be found when the batch is split, ValueError when the
    job's list does not match the inputs."""
    if job.input_batch_dims is not None:
        dims = tuple(job.input_batch_dims)
    else:
        batch = job.batch_size or 1  # any size shows which dim grows with the batch
        try:
            dims = input_batch_dims(lambda b: model_file.inputs(b, job.seq_len, device="meta"), batch)
        except InputError:
            if splits:
                raise
            dims = (None,) * num_inputs
    if len(dims) != num_inputs:
        raise ValueError(f"the job gives {len(dims)} input batch dims for {num_inputs} inputs: {list(dims)}")
    return dims


def _margin(out: dict) -> tuple[float, bool]:
    """How near an output's check is to failing: its difference over its tolerance (inf for an exact
    output that differs), float outputs first among equals."""
    diff, tolerance = out["max_abs_diff"] or 0.0, out["tolerance"]
    ratio = diff / tolerance if tolerance else (math.inf if diff else 0.0)
    return ratio, bool(out["tolerance_rel"])


def _worst_grad(reports: list[RankReport]) -> str | None:
    """Where the largest gradient difference over the ranks is: "'<parameter FQN>' on rank N" (the
    rank's own name for it: its pipeline chunk's or FSDP unit's FQN), None when no rank compared one."""
    ranked = [r for r in reports if r.grad_max_abs_diff is not None and r.grad_worst]
    if not ranked:
        return None
    worst = max(ranked, key=lambda r: r.grad_max_abs_diff or 0.0)
    return f"'{worst.grad_worst}' on rank {worst.rank}"


def summarise(reports: list[RankReport]) -> dict[str, Any]:
    """The report's `measured` and `numerics` sections from all ranks' reports.

    latency_s: median over iterations of the slowest rank (a synchronous step ends when the last
    rank ends); spread: p10/p90 of that rank's samples. peak_memory_bytes: the largest real peak of a
    rank process (`runtime.measure.process_peak_memory_bytes`). numerics: every output's worst
    difference over the ranks beside its tolerance (`runtime.numerics`; `check_failures` reads it).
    """
    slowest = max(reports, key=lambda r: r.median_s)
    diffs = [r.max_abs_diff for r in reports if r.max_abs_diff is not None]
    grads = [r.grad_max_abs_diff for r in reports if r.grad_max_abs_diff is not None]
    scale = max((r.output_scale or 0.0) for r in reports)
    samples = sorted(slowest.latency_samples_s)
    # the float outputs' dtype sets the tolerance of the loss and gradients (an int first output, an
    # argmax, would have made them exact)
    dtypes = [d for r in reports for d in (r.output_dtypes or [r.output_dtype]) if d]
    dtype = next((d for d in dtypes if tolerance_for(d)), dtypes[0] if dtypes else None)
    rel = tolerance_for(dtype) if dtype else None
    # a float output is computed in the run's dtype whatever it is cast to (an fp32 statistic of bf16
    # activations carries bf16's error): held to the looser of the two; an integer one stays exact
    run_rel = tolerance_for(torch_dtype(reports[0].dtype)) if reports[0].dtype in DTYPE_BYTES else 0.0
    outputs = []
    for i in range(max((len(r.output_diffs) for r in reports), default=0)):
        got = [r.output_diffs[i] for r in reports if i < len(r.output_diffs)]
        out_scale = max(r.output_scales[i] for r in reports if i < len(r.output_scales))
        operand = max((r.operand_scales[i] for r in reports if i < len(r.operand_scales)), default=None)
        # each output by its own dtype (an integer output exactly, a float one beside it relatively)
        out_dtype = next((r.output_dtypes[i] for r in reports if i < len(r.output_dtypes)), dtype)
        out_rel = tolerance_for(out_dtype) if out_dtype else rel
        if out_rel:
            out_rel = max(out_rel, run_rel)
        # an output below its operands' rounding is held to that rounding (`numerics.output_tolerance_scale`)
        held_scale = output_tolerance_scale(out_scale, operand, out_rel)
        outputs.append(
            {
                "index": i,
                "max_abs_diff": max(got),
                "scale": held_scale,
                "output_scale": out_scale,
                "operand_scale": operand,
                "dtype": out_dtype,
                "tolerance_rel": out_rel,
                "tolerance": (out_rel or 0.0) * held_scale,
            }
        )
    # the loss (of the first float output) and the gradients keep their own tolerance: the looser of that
    # output's dtype and the dtype the run computes in (a bf16 run's gradients were held to fp32's 1e-4
    # when a side output in fp32 was the headline)
    train_rel = max(rel or 0.0, run_rel) if rel is not None else None
    if len(outputs) > 1:  # the headline is the output nearest its tolerance, with its own scale
        worst = max(outputs, key=_margin)
        diffs, scale = [worst["max_abs_diff"]], worst["scale"]
        dtype, rel = worst["dtype"] or dtype, worst["tolerance_rel"] or rel
    loss_diffs = [r.loss_diff for r in reports if r.loss_diff is not None]
    grad_scales = [r.grad_scale for r in reports if r.grad_scale is not None]
    per_layer: dict[str, float] = {}
    for r in reports:  # a layer takes as long as its slowest rank
        for key, value in r.per_layer_s.items():
            per_layer[key] = max(per_layer.get(key, 0.0), value)
    return {
        "measured": {
            "latency_s": slowest.median_s,
            "latency_p10_s": samples[len(samples) // 10] if samples else None,
            "latency_p90_s": samples[min(len(samples) - 1, (9 * len(samples)) // 10)] if samples else None,
            "per_rank_median_s": [r.median_s for r in reports],
            "peak_memory_bytes": max(r.peak_memory_bytes for r in reports),  # the process's real peak
            "startup_memory_bytes": max(r.startup_memory_bytes for r in reports),  # of it: before the model
            "per_rank_peak_memory_bytes": [r.peak_memory_bytes for r in reports],
            "per_rank_startup_memory_bytes": [r.startup_memory_bytes for r in reports],
            # CPU: the heap in use at its highest in one step, above the rank's start (`RankReport`)
            "heap_peak_bytes": _heap_above_startup(reports),
            # training: the state each rank holds (parameters, gradients, Adam) beside the cost model's
            "state_bytes": max((r.state_bytes for r in reports if r.state_bytes is not None), default=None),
            "predicted_state_bytes": max(
                (r.predicted_state_bytes for r in reports if r.predicted_state_bytes is not None),
                default=None,
            ),
            "per_rank_state_bytes": [r.state_bytes for r in reports],
            "iterations": len(samples),
            "steps_per_sample": slowest.steps_per_sample,
            "speed_probe": speed_probe_summary(reports),
            "dtype": reports[0].dtype,
            "notes": list(dict.fromkeys(note for r in reports for note in r.notes)),
            "per_layer_s": per_layer,
        },
        "numerics": {
            "max_abs_diff": max(diffs) if diffs else None,
            "relative_max_abs_diff": (max(diffs) / scale) if diffs and scale else None,
            "output_scale": scale,
            "grad_max_abs_diff": max(grads) if grads else None,
            "grad_worst": _worst_grad(reports),
            "grad_scale": max(grad_scales) if grad_scales else None,
            "grad_loss_scale": next((r.grad_loss_scale for r in reports if r.grad_loss_scale), None),
            # training: gradients (or sharded pieces of them) compared over all ranks; 0 fails the check
            "grads_compared": sum(r.grads_compared for r in reports) if grads else None,
            "update_max_abs_diff": max(
                (r.update_max_abs_diff for r in reports if r.update_max_abs_diff is not None), default=None
            ),
            "update_tolerance": next((r.update_tolerance for r in reports if r.update_tolerance), None),
            "loss_diff": max(loss_diffs) if loss_diffs else None,
            "loss_scale": next((r.loss_scale for r in reports if r.loss_scale is not None), None),
            "outputs": outputs,  # every output: worst diff over ranks, scale, tolerance
            "dtype": dtype,
            "tolerance_rel": rel,  # runtime.numerics.REL_TOLERANCE of the dtype
            "train_tolerance_rel": train_rel,  # of the training loss and the gradients
            "ladder_deviation": next(
                (r.ladder_deviation for r in reports if r.ladder_deviation is not None), None
            ),
            "median_rank_latency_s": statistics.median(r.median_s for r in reports),
            # expert routing replayed from the reference by token (`runtime.routing`)
            "routing_calls": sum(r.routing_calls for r in reports),
            "routing_flipped": sum(r.routing_flipped for r in reports),
            "routing_unmatched": sum(r.routing_unmatched for r in reports),
            "routing_max_gap": max((r.routing_max_gap for r in reports), default=0.0),
            "routing_logit_diff": max((r.routing_logit_diff for r in reports), default=0.0),
            "routing_tolerance": (rel or 0.0) * max((r.routing_logit_scale for r in reports), default=0.0),
        },
        "ranks": [{k: v for k, v in asdict(r).items() if k != "output"} for r in reports],
    }


def speed_probe_summary(reports: list[Any]) -> dict[str, Any] | None:
    """The per-node overhead and matmul rate measured beside the timed steps (`RunJob.speed_probe`),
    the slowest rank's (the calibration keeps the slowest over ranks too); None when no rank probed.
    `reports`: `RankReport`s or `runtime.decode.DecodeRankReport`s (the same probe fields)."""
    probed = [r for r in reports if r.probe_node_overhead_s is not None]
    if not probed:
        return None
    backward = [
        r.probe_backward_node_overhead_s for r in probed if r.probe_backward_node_overhead_s is not None
    ]
    return {
        "node_overhead_s": max(r.probe_node_overhead_s for r in probed),
        "backward_node_overhead_s": max(backward) if backward else None,
        "samples": min(r.probe_samples for r in probed),
        "per_rank_node_overhead_s": [r.probe_node_overhead_s for r in reports],
        "matmul_flops_per_s": min(rates)
        if (rates := [r.probe_matmul_flops_per_s for r in probed if r.probe_matmul_flops_per_s])
        else None,
        "matmul_shape": list(PROBE_MATMUL_SHAPE),
    }


def record_probe(report: Any, probe: SpeedProbe) -> None:
    """Put `probe`'s readings (per-node overheads, matmul rate, sample count) in `report`, a
    `RankReport` or `runtime.decode.DecodeRankReport`; nothing before its first sample."""
    if (overhead := probe.overhead_s()) is None:
        return
    report.probe_node_overhead_s, report.probe_backward_node_overhead_s = overhead
    report.probe_matmul_flops_per_s = probe.matmul_flops_per_s()
    report.probe_samples = probe.samples


def _heap_above_startup(reports: list[RankReport]) -> int | None:
    """The largest heap in use over a step above the rank's start, over the ranks that measured it;
    None when none did (CUDA, no glibc, a decode run)."""
    above = [
        r.heap_peak_bytes - r.startup_heap_bytes
        for r in reports
        if r.heap_peak_bytes is not None and r.startup_heap_bytes is not None
    ]
    return max(above) if above else None


def time_steps(step: Callable[[], object], job: RunJob, device: torch.device, report: RankReport) -> None:
    """Time `step` as `job` asks (`runtime.measure.time_iterations`: warm-up, at least `job.iters`
    steps and `job.min_time_s` seconds) and record the samples, their median and the steps per sample
    in `report`; with `job.speed_probe` on CPU also the per-node overhead measured between the
    samples (`costmodels.calibrate.SpeedProbe`)."""
    probe = None
    if job.speed_probe and device.type == "cpu":
        report_progress("building the speed probe (the calibration's per-node overhead graphs)", 0.0)
        probe = SpeedProbe(device, backward=job.workload == "train")
    timing = time_iterations(
        step,
        warmup=job.warmup,
        iters=job.iters,
        device=device,
        progress=report_progress,
        min_time_s=job.min_time_s,
        probe=probe.sample if probe is not None else None,
    )
    if probe is not None:
        record_probe(report, probe)
    # one more step, untimed, whose heap in use is sampled after every op (CPU: the resident set keeps
    # what the allocator freed, `runtime.measure`)
    report.heap_peak_bytes = heap_peak_bytes(step, device)
    report.latency_samples_s = list(timing.samples_s)
    report.median_s = timing.median_s
    report.steps_per_sample = timing.steps_per_sample

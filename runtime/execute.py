"""Run a plan on real process groups: rewrite the captured graph for this rank, check it, time it.

`run_rank(ctx, job)` is the per-rank entry that `runtime.launch.launch` starts on every rank (spawned
locally, or one process per rank under `torchrun`). Each rank:

1. builds the model from the model file with the same seed (identical weights everywhere) and
   captures it (`planner.frontend.capture.capture`);
2. computes the reference: the unsharded graph, with the plan's ladder layers applied when there are
   any (so `max_abs_diff` measures the rewrite alone), and `ladder_deviation`, how far ladder residual
   moved the original model's outputs;
3. rewrites a copy for its mesh coordinates: TP pass (`passes.tensor_parallel`), ladder pass
   (`passes.ladder`), pipeline split (`passes.pipeline`) for PP > 1;
4. runs forward (or a training step: forward, backward, Adam step) and compares outputs (and
   gradients) with the reference;
5. times warm-up + timed iterations with a barrier around each (`runtime.measure`) and reports the
   peak memory.

The result of each rank is a `RankReport`; `summarise` turns the list into the report's `measured`
and `numerics` sections.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from passes import collectives
from passes.ladder import apply_ladder, ladder_deviation
from passes.tensor_parallel import apply_tensor_parallel, shard_weight
from planner.frontend.analysis import ModelStructure, analyse
from planner.frontend.capture import capture, flat_inputs
from planner.frontend.modelfile import load_model_file
from planner.plan import Plan
from runtime.launch import RankContext
from runtime.measure import peak_memory_bytes, reset_peak_memory, time_iterations
from runtime.mesh import build_mesh
from runtime.profile import profile_layers


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
    seed: int = 0
    return_output: bool = False  # put the rank's output tensor in the report (tests)
    profile_layers: bool = False  # forward: time every node once more, summed per layer (runtime.profile)


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
    ladder_deviation: float | None = None  # relative L2 of laddered vs original outputs
    notes: list[str] = field(default_factory=list)
    output: torch.Tensor | None = None  # only with RunJob.return_output
    per_layer_s: dict[str, float] = field(
        default_factory=dict
    )  # forward: measured seconds per layer / "ends"


def ladder_residual_adds(structure: ModelStructure, layers: list[int]) -> list[str]:
    """Residual-add node names of the laddered layers, attention then MLP, lowest layer first.

    Raises ValueError naming a layer without a recognised attention/MLP residual add.
    """
    adds: list[str] = []
    for index in sorted(layers):
        layer = structure.layers[index]
        for block, name in ((layer.attention, "attention"), (layer.mlp, "MLP")):
            if block is None or block.residual_add is None:
                raise ValueError(f"layer {index} ({layer.module_path}) has no {name} residual add to ladder")
            adds.append(block.residual_add)
    return adds


def _as_tensor(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def run_rank(ctx: RankContext, job: RunJob) -> RankReport:
    """Per-rank entry: rewrite, check, time. See the module docstring. Raises on any failure (the
    launcher turns it into a RunError naming this rank)."""
    plan = Plan.from_dict(job.plan)
    if plan.pp > 1:
        from runtime.pipeline_run import run_pipeline_rank  # noqa: PLC0415 - only PP plans need it

        return run_pipeline_rank(ctx, job, plan)
    mesh = build_mesh(plan.tp, plan.pp, plan.dp, ctx.device.type)
    collectives.register_group("tp", mesh.group("tp"))
    model_file = load_model_file(job.model_path)
    torch.manual_seed(job.seed)
    model = model_file.build(str(ctx.device))
    args, kwargs = model_file.inputs(job.batch_size, job.seq_len, device=str(ctx.device))
    full_inputs = flat_inputs(args, kwargs)
    training = job.workload == "train"
    if plan.dp > 1:  # capture on this replica's share of the batch: the graph's shapes are literals
        args, kwargs = _slice_args(args, kwargs, plan.dp, mesh.dp_rank)
    inputs = flat_inputs(args, kwargs)
    full = capture(model, args, kwargs)
    structure = analyse(full)
    adds = ladder_residual_adds(structure, plan.ladder_layers)

    reference = copy.deepcopy(full)
    if training and plan.dp > 1:  # the reference gradients are those of the whole batch
        reference = capture(model, *model_file.inputs(job.batch_size, job.seq_len, device=str(ctx.device)))
        if adds:
            apply_ladder(reference, ladder_residual_adds(analyse(reference), plan.ladder_layers))
    deviation = None
    if adds:
        with torch.no_grad():
            original_out = _as_tensor(full(*inputs))
        if not (training and plan.dp > 1):
            apply_ladder(reference, adds)
    gm = copy.deepcopy(full)
    del full, model
    apply_tensor_parallel(gm, plan.splits, mesh.tp_rank, plan.tp, training=training)
    apply_ladder(gm, adds)

    with torch.no_grad():
        ref_out = _as_tensor(reference(*(full_inputs if training and plan.dp > 1 else inputs)))
        if adds:
            deviation = ladder_deviation(original_out, ref_out)
    report = RankReport(
        rank=ctx.rank,
        tp_rank=mesh.tp_rank,
        pp_rank=mesh.pp_rank,
        latency_samples_s=[],
        median_s=0.0,
        peak_memory_bytes=0,
        max_abs_diff=None,
        output_scale=float(ref_out.abs().max()),
        ladder_deviation=deviation,
    )
    if training:
        step = _training_step(gm, reference, full_inputs, inputs, plan, mesh, report)
    else:
        with torch.no_grad():
            out = _as_tensor(gm(*inputs))
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


def _slice_args(args: tuple, kwargs: dict, dp: int, dp_rank: int) -> tuple[tuple, dict]:
    """(args, kwargs) with every tensor leaf cut to this DP replica's share of the batch (dim 0)."""
    import torch.utils._pytree as pytree  # noqa: PLC0415

    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    sliced = iter(_data_parallel_slice(tuple(tensors), dp, dp_rank))
    leaves = [next(sliced) if isinstance(x, torch.Tensor) else x for x in leaves]
    return pytree.tree_unflatten(leaves, spec)


def _data_parallel_slice(inputs: tuple, dp: int, dp_rank: int) -> tuple:
    """This DP replica's share of the batch: every input split along dim 0 (the batch)."""
    if dp == 1:
        return inputs
    for x in inputs:
        if x.shape[0] % dp:
            raise ValueError(
                f"batch {x.shape[0]} of an input of shape {tuple(x.shape)} does not divide by dp={dp}"
            )
    return tuple(x.chunk(dp, dim=0)[dp_rank] for x in inputs)


def grad_max_abs_diff(module: torch.nn.Module, full_grads: dict, plan: Plan, tp_rank: int) -> float:
    """Worst |gradient of a rank's parameter - the unsharded model's gradient, sharded like the parameter|.

    full_grads: parameter FQN -> gradient of the unsharded model. A colwise weight's bias is sharded
    like the weight's output; a vocab split is padded as the TP pass pads it.
    """
    worst = 0.0
    for name, p in module.named_parameters():
        want = full_grads.get(name)
        if p.grad is None or want is None:
            continue
        if tuple(want.shape) != tuple(p.shape):
            split = plan.splits.get(name) or plan.splits.get(name.rsplit(".", 1)[0] + ".weight")
            dim = split.dim if name in plan.splits else 0
            want = shard_weight(want, dim, split.parts, tp_rank, plan.tp, pad=split.style == "vocab")
        worst = max(worst, float((p.grad - want).abs().max()))
    return worst


def rank_peak_memory_bytes(module: torch.nn.Module, device: torch.device) -> int:
    """Peak memory of this rank's step, bytes: on GPU `max_memory_allocated` (weights included); on CPU
    the rank module's weight shards and buffers plus the resident-set growth during the timed steps
    (the process's own RSS also holds torch's libraries, which a GPU's memory does not)."""
    if device.type == "cuda":
        return peak_memory_bytes(device)
    seen: set[int] = set()
    resident = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            resident += t.numel() * t.element_size()
    return resident + peak_memory_bytes(device)


def _training_step(gm, reference, full_inputs, inputs, plan: Plan, mesh, report: RankReport):
    """Check one forward+backward against the unsharded reference on the whole batch (DP replicas
    average their gradients over the DP group); return a timed training step (forward, backward,
    DP gradient all-reduce, Adam update - the optimizer the cost model assumes for memory)."""
    ref_out = _as_tensor(reference(*full_inputs))
    target_full = torch.linspace(-1.0, 1.0, ref_out.numel(), device=ref_out.device).reshape(ref_out.shape)
    torch.nn.functional.mse_loss(ref_out, target_full).backward()
    full_grads = {name: p.grad for name, p in reference.named_parameters()}
    ref_local = _data_parallel_slice((ref_out.detach(),), plan.dp, mesh.dp_rank)[0]
    target = _data_parallel_slice((target_full,), plan.dp, mesh.dp_rank)[0]
    out = _as_tensor(gm(*inputs))
    report.max_abs_diff = float((out.detach() - ref_local).abs().max())
    torch.nn.functional.mse_loss(out, target).backward()
    _average_gradients(gm, plan.dp, mesh)
    report.grad_max_abs_diff = grad_max_abs_diff(gm, full_grads, plan, mesh.tp_rank)
    optimizer = torch.optim.Adam(gm.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(_as_tensor(gm(*inputs)), target).backward()
        _average_gradients(gm, plan.dp, mesh)
        optimizer.step()

    return step


def _average_gradients(module: torch.nn.Module, dp: int, mesh) -> None:
    """Data parallelism: mean of the replicas' gradients (one all-reduce per parameter, DP group)."""
    if dp == 1:
        return
    group = mesh.group("dp")
    for p in module.parameters():
        if p.grad is not None:
            torch.distributed.all_reduce(p.grad, group=group)
            p.grad /= dp


def summarise(reports: list[RankReport]) -> dict[str, Any]:
    """The report's `measured` and `numerics` sections from all ranks' reports.

    latency_s: median over iterations of the slowest rank (a synchronous step ends when the last
    rank ends); spread: p10/p90 of that rank's samples.
    """
    slowest = max(reports, key=lambda r: r.median_s)
    diffs = [r.max_abs_diff for r in reports if r.max_abs_diff is not None]
    grads = [r.grad_max_abs_diff for r in reports if r.grad_max_abs_diff is not None]
    scale = max((r.output_scale or 0.0) for r in reports)
    samples = sorted(slowest.latency_samples_s)
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
            "peak_memory_bytes": max(r.peak_memory_bytes for r in reports),
            "per_rank_peak_memory_bytes": [r.peak_memory_bytes for r in reports],
            "iterations": len(samples),
            "per_layer_s": per_layer,
        },
        "numerics": {
            "max_abs_diff": max(diffs) if diffs else None,
            "relative_max_abs_diff": (max(diffs) / scale) if diffs and scale else None,
            "output_scale": scale,
            "grad_max_abs_diff": max(grads) if grads else None,
            "ladder_deviation": next(
                (r.ladder_deviation for r in reports if r.ladder_deviation is not None), None
            ),
            "median_rank_latency_s": statistics.median(r.median_s for r in reports),
        },
        "ranks": [{k: v for k, v in asdict(r).items() if k != "output"} for r in reports],
    }

"""The unsharded reference of a run, computed once, and the weights every rank loads its shards from.

    write_reference(job, directory) -> ReferenceFiles
    compare_outputs(outs, ...)  -> a rank's outputs against its part of the reference (RankReport fields)

1. builds the model once: from the model file with the job's seed, or - with `--weights` - on the
   meta device (when the file builds there) and filled from the user's safetensors files;
2. captures it on the WHOLE batch, applies the plan's ladder layers (so a run's difference measures
   the rewrite alone; `ladder_deviation` says how far ladder residual moved the original outputs)
   and runs it: every output, and for training the MSE loss (in fp32, `runtime.loss.output_loss`)
   against `training_target` and every parameter's gradient;
3. writes to `directory`: `outputs.safetensors` (output.{i}, target, loss), `grads.safetensors`
   (training; under fp16 loss scaling the loss's gradients times the scale `ReferenceFiles.
   loss_scale_factor` says: `runtime.loss_scaling.reference_scale`) and, unless the user gave weights, `weights.safetensors` (every parameter and
   buffer, non-persistent ones included); with user weights, only the tensors their files lack
   (non-persistent buffers) go to `extra.safetensors`.

The launching process calls it before the ranks start (`runtime.session.run_job`), then frees the
model: no rank builds the whole model. When a rank finds no reference in its job (a test launching
`run_rank` itself, or torchrun, where no launching process exists), `shared_reference` makes it on
local rank 0 of each node and hands the folder to the node's other ranks.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from passes.checkpoint import SafetensorsCheckpoint, checkpoint_files, load_whole, save_checkpoint
from passes.ladder import apply_ladder, ladder_deviation, ladder_residual_adds
from passes.rng import dropout_disabled, dropout_nodes
from passes.tensor_parallel import read_local_shards
from planner.errors import InputError, RunError
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture, flat_inputs, flatten_output, library_frame
from planner.frontend.modelfile import ModelFile, load_model_file
from planner.frontend.phases import cast_inputs
from planner.plan import Plan
from runtime.job import RankReport, RankSetup, ReferenceFiles, RunJob, job_inputs
from runtime.launch import RankContext
from runtime.loss import LossLayout, output_loss
from runtime.loss_scaling import reference_scale
from runtime.numerics import (
    all_outputs,
    max_abs,
    max_abs_diff,
    operand_scales,
    replica_share,
    tolerance_for,
    training_target,
)
from runtime.routing import TokenRoutingTape, routers_of, routing_by_token
from runtime.run_mode import set_run_mode

WEIGHTS_HELP = (
    "give the weights as safetensors: --weights FILE.safetensors or a directory of them, with the "
    "names of model.state_dict() (e.g. safetensors.torch.save_model(model, 'model.safetensors'), which also "
    "saves a tied weight once)"
)


def build_unsharded(model_file: ModelFile, seed: int, weights: list[str] | None) -> torch.nn.Module:
    """The whole model with real weights on the CPU: seeded init (`torch.manual_seed(seed)`), or the
    tensors of the safetensors files `weights` (loaded into a model built on meta when the file
    builds there). Raises InputError when the model has meta tensors and no weights are given, or
    the weights lack a tensor of the model or have another shape."""
    torch.manual_seed(seed)
    model = model_file.build("cpu")
    if weights:
        load_whole(model, weights, WEIGHTS_HELP)
    meta = [name for name, t in _named_tensors(model) if t.is_meta]
    if meta:
        how = (
            "the weights do not hold them (non-persistent buffers made in __init__ on the meta device)"
            if weights
            else "the model file builds its model on the meta device, so there are no weights to run"
        )
        raise InputError(f"{model_file.path}: {how}: {meta[:3]}; {WEIGHTS_HELP}")
    return model.eval()


def check_capture(
    model: torch.nn.Module,
    gm: torch.fx.GraphModule,
    args: tuple,
    kwargs: dict,
    dtype: str,
    training: bool = False,
) -> None:
    """The captured graph computes what the model computes: its outputs beside the eager model's on the
    same inputs, weights and random state, without autograd, within the dtype's tolerance of each
    output's scale (`tolerance_for`); with `training`, also every parameter's gradient of the run's loss
    (`runtime.loss.output_loss` of the first output), within the tolerance of the largest gradient. The
    sharded run is checked against the captured graph, so a defect of the capture's rewrites
    (`planner.frontend.capture`: in-place writes made values, `x @ W.T` made a linear) would pass that
    check; this one catches it, and a backward the capture cannot hold (a `torch.autograd.Function`'s
    own: torch.export traces its forward and differentiates that). Skipped for a graph with dropout
    (the reference runs it with dropout off, which the eager model cannot be told). The buffers and the
    random state are restored. Raises RunError naming the output and the difference, InputError naming
    the parameter whose gradient differs."""
    if dropout_nodes(gm):
        return
    state = torch.get_rng_state()
    buffers = [(b, b.detach().clone()) for b in model.buffers()]

    def restore() -> None:
        torch.set_rng_state(state)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)

    try:
        with torch.no_grad():
            eager = all_outputs(flatten_output(_eager_forward(model, args, kwargs)))
        restore()  # a buffer the forward updates (a counter, running statistics) starts where it started
        with torch.no_grad():
            captured = all_outputs(gm(*flat_inputs(args, kwargs)))
    finally:
        restore()
    for i, (got, want) in enumerate(zip(captured, eager, strict=False)):
        if not want.is_floating_point() or got.shape != want.shape or not bool(torch.isfinite(want).all()):
            continue  # a NaN or inf of the model itself is refused below, naming the weights
        diff, scale = max_abs_diff(got, want), max_abs(want)
        if diff > tolerance_for(dtype) * scale:
            raise RunError(
                f"the planner's capture of {type(model).__name__} computes other values than the model: output "
                f"{i} differs by {diff:.3g} (scale {scale:.3g}, {dtype}) on the same inputs and weights. This is "
                "a defect of the planner's graph capture, not of the model or the plan: please report it with the "
                "model file; PLANNER_CAPTURE_CACHE=off rules out the capture cache"
            )
    if training and eager and eager[0].is_floating_point():
        try:
            _check_capture_gradients(model, gm, args, kwargs, dtype, training_target(eager[0]))
        finally:
            restore()


def _eager_forward(model: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """The model's own forward on the run's inputs. Planning runs the model on meta tensors, where a
    lookup past an embedding's rows does not fail; on real tensors it may. Raises InputError naming the
    model's line and the inputs' shapes when the model itself raises (OPT's position table, offset by
    2 past the positions it counts, gave an IndexError traceback at --seq-len 200)."""
    try:
        return model(*args, **kwargs)
    except (InputError, RunError):
        raise
    except Exception as e:  # noqa: BLE001 - the model's own code: any error it raises is reported
        frame = library_frame(e)
        where = (
            f" at {frame.filename}:{frame.lineno}" + (f" `{frame.line.strip()}`" if frame.line else "")
            if frame
            else ""
        )
        shapes = ", ".join(
            f"{tuple(t.shape)}" for t in flat_inputs(args, kwargs) if isinstance(t, torch.Tensor)
        )
        hint = ""
        if isinstance(e, IndexError):
            hint = (
                " An index past a table's rows: a sequence longer than the model's positions (use a smaller "
                "--seq-len, or give the model a larger table) or token ids past its vocabulary (make "
                "example_inputs draw them below it)."
            )
        raise InputError(
            f"the model raised {type(e).__name__}: {e}{where}, run on the example inputs of the plan (shapes "
            f"{shapes}) with real weights; planning runs the model on meta tensors, which do not check "
            f"indices or values.{hint}"
        ) from None


def _gradients(
    module: torch.nn.Module, outputs: list[torch.Tensor], target: torch.Tensor
) -> dict[int, torch.Tensor]:
    """Each trainable parameter's gradient of `output_loss` of the first output against `target`, by
    the parameter's id (the captured graph holds the model's own parameter objects, under one of a
    tied tensor's names); a parameter the loss does not reach gets none."""
    unique = list({id(p): p for p in module.parameters() if p.requires_grad}.values())
    loss = output_loss(outputs[0], target, LossLayout())
    if not loss.requires_grad or not unique:
        return {}
    grads = torch.autograd.grad(loss, unique, allow_unused=True)
    return {id(p): g for p, g in zip(unique, grads) if g is not None}


def _check_capture_gradients(
    model: torch.nn.Module,
    gm: torch.fx.GraphModule,
    args: tuple,
    kwargs: dict,
    dtype: str,
    target: torch.Tensor,
) -> None:
    """`check_capture`'s gradients: the eager model's and the captured graph's, parameter by parameter
    (one the captured graph lost, or does not reach, has a zero gradient there)."""
    state = torch.get_rng_state()
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.enable_grad():
            eager = _gradients(model, all_outputs(flatten_output(model(*args, **kwargs))), target)
            torch.set_rng_state(state)
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            captured = _gradients(gm, all_outputs(gm(*flat_inputs(args, kwargs))), target)
    except RuntimeError:  # torch.autograd.grad refused (reentrant checkpointing): the check is skipped
        return
    if not eager:
        return
    names = {id(p): name for name, p in reversed(list(model.named_parameters()))}
    unfinite = [names.get(key, "?") for key, g in eager.items() if not bool(torch.isfinite(g).all())]
    if unfinite:  # the model's own gradients: nothing a capture could match (max_abs skips NaN)
        raise InputError(
            f"the unsharded {type(model).__name__}'s own gradients are not finite (NaN or inf) with the weights it "
            f"is run with: {', '.join(repr(n) for n in unfinite[:4])}"
            + (f" and {len(unfinite) - 4} more" if len(unfinite) > 4 else "")
            + ". "
            "A parameter left uninitialised (made with torch.empty and not filled by build_model) holds "
            "arbitrary values; initialise every parameter in build_model, pass trained weights (--weights), "
            "or plan with --workload forward"
        )
    scale = max(max_abs(g) for g in eager.values())

    def diff(key: int) -> float:
        got = captured.get(key)
        return max_abs(eager[key]) if got is None else max_abs_diff(got, eager[key])

    worst = max(eager, key=diff)
    if diff(worst) > tolerance_for(dtype) * scale:
        raise InputError(
            f"the captured graph of {type(model).__name__} gives other gradients than the model: the gradient of "
            f"{names.get(worst, '?')!r} differs by {diff(worst):.3g} (the largest gradient {scale:.3g}, {dtype}) "
            "on the same inputs and weights, though the outputs agree. A backward the model defines itself (a "
            "torch.autograd.Function: an auxiliary loss added in backward, a straight-through estimator, a "
            "gradient scale) is not captured: torch.export traces the Function's forward and differentiates "
            "that, so a sharded run would train on other gradients. Write the trick with differentiable ops (an "
            "auxiliary loss: `out + (aux - aux.detach())` passes out unchanged and gives aux a gradient of 1; a "
            "straight-through estimator: `x + (f(x) - x).detach()`), or plan with --workload forward"
        )


def write_reference(job: RunJob, directory: str, made_on: str = "launching process") -> ReferenceFiles:
    """Run the unsharded model once on the whole batch and write its results and weights into
    `directory` (module docstring). Raises InputError for a model without weights or bad weights."""
    plan = Plan.from_dict(job.plan)
    model_file = load_model_file(job.model_path)
    training = job.workload == "train"
    # the plan's dtype and mode, as the ranks run it (runtime.run_mode); dropout is switched off below
    model = set_run_mode(build_unsharded(model_file, job.seed, job.weights), plan.dtype, training)
    args, kwargs = cast_inputs(*job_inputs(model_file, job, "cpu"), plan.dtype)
    inputs = flat_inputs(args, kwargs)
    gm = capture(model, args, kwargs)
    check_capture(model, gm, args, kwargs, plan.dtype, training)
    # the buffers as the ranks start from: the reference's runs below update any the forward writes
    initial = {id(b): b.detach().clone() for m in (model, gm) for _, b in m.named_buffers()}
    structure = analyse(gm)
    adds = ladder_residual_adds(structure, plan.ladder_layers)
    deviation = None
    if adds:
        with torch.no_grad(), dropout_disabled(gm):
            original = all_outputs(gm(*inputs))[0]
        apply_ladder(gm, adds)
    # each router's choice of experts by token, for the ranks to replay (`runtime.routing`)
    tape = TokenRoutingTape()
    with (
        routing_by_token([gm], routers_of(structure), tape),
        torch.set_grad_enabled(training),
        dropout_disabled(gm),
    ):
        outs = all_outputs(gm(*inputs))
    results = {f"output.{i}": out.detach() for i, out in enumerate(outs)}
    for name, (keys, ids, logits) in tape.choices.items():
        results.update({f"routing.{name}.key": keys, f"routing.{name}.ids": ids})
        if logits is not None:
            results[f"routing.{name}.logits"] = logits
    for name, out in results.items():
        if out.is_floating_point() and not bool(torch.isfinite(out).all()):
            where = f"the weights in {', '.join(job.weights)}" if job.weights else "its seeded random weights"
            raise InputError(
                f"the unsharded model's {name.replace('.', ' ')} is not finite (NaN or inf) with {where} and the "
                f"example inputs in {plan.dtype}: there is nothing for the sharded run to match; check the "
                "weights (or the dtype: fp16 overflows past 65504)"
            )
    if adds:
        deviation = ladder_deviation(original, results["output.0"])
    grads_path, loss_scale_factor = None, 1.0
    if training:
        first = outs[0] if outs else None
        if first is None or not first.is_floating_point() or first.grad_fn is None:
            what = (
                "no tensor"
                if first is None
                else f"a tensor of {str(first.dtype).removeprefix('torch.')}"
                + ("" if not first.is_floating_point() else " that does not depend on the weights")
            )
            raise InputError(
                f"--workload train trains the model on the mean squared error of its first output, and "
                f"{model_file.path} returns {what} first: "
                "return a floating-point output computed from the weights first (e.g. the logits, before any "
                "argmax), or run the plan with --workload forward"
            )
        target = training_target(first.detach())
        loss = output_loss(first, target, LossLayout())
        params = [p for p in gm.parameters() if p.requires_grad]

        def backward(scale: float) -> None:  # the gradients anew at each try of the loss scale
            for p in params:
                p.grad = None
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=True)

        try:
            scale = reference_scale(
                plan.loss_scale,
                backward,
                lambda: [p.grad for p in params if p.grad is not None],
                headroom=plan.dp * plan.cp,
            )
        except ValueError as e:
            raise InputError(
                f"plan field 'loss_scale' ({plan.loss_scale}, --loss-scale): the unsharded model's training step "
                f"in {plan.dtype}: {e}"
            ) from None
        results.update(target=target, loss=loss.detach())
        # the graph the tries kept: freed before the next forward (`operand_scales`)
        outs = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs)
        del loss, first
        loss_scale_factor = scale if scale is not None else 1.0  # the saved gradients are the scaled ones
        grads = {n: p.grad for n, p in gm.named_parameters(remove_duplicate=False) if p.grad is not None}
        grads_path = os.path.join(directory, "grads.safetensors")
        save_checkpoint(grads, grads_path)
    # the largest operand of each output's last op (`numerics.operand_scales`), after the backward: its
    # run restores the buffers it changes, which the backward may have saved
    with dropout_disabled(gm):
        scales = operand_scales(gm, inputs)
    if len(scales) == len(outs):
        results.update(
            {f"operand_scale.{i}": torch.tensor(x, dtype=torch.float64) for i, x in enumerate(scales)}
        )
    outputs_path = os.path.join(directory, "outputs.safetensors")
    save_checkpoint(results, outputs_path)
    tensors = dict(_named_tensors(model))
    tensors.update(_named_tensors(gm))  # constants the capture lifted into the graph
    tensors = {name: initial.get(id(t), t) for name, t in tensors.items()}
    if job.weights:
        files = checkpoint_files(job.weights)
        with SafetensorsCheckpoint(files) as source:
            extra = {n: t for n, t in tensors.items() if n not in source}
        if extra:
            files.append(os.path.join(directory, "extra.safetensors"))
            save_checkpoint(extra, files[-1])
    else:
        files = [os.path.join(directory, "weights.safetensors")]
        save_checkpoint(tensors, files[0])
    return ReferenceFiles(
        directory=directory,
        weights=files,
        outputs=outputs_path,
        grads=grads_path,
        num_outputs=len(outs),
        dtype=str(outs[0].dtype).removeprefix("torch."),
        ladder_deviation=deviation,
        made_on=made_on,
        loss_scale_factor=loss_scale_factor,
    )


@contextmanager
def shared_reference(ctx: RankContext, job: Any, make: Callable[..., Any] | None = None) -> Iterator[Any]:
    """The job's reference (`job.reference`); without one, local rank 0 of each node makes it with
    `make(job, directory, made_on=...)` (default `write_reference`; serving runs pass
    `runtime.decode.write_decode_reference`) in a temporary folder (collective over the default
    group: every rank must enter) and removes it when every rank of the job is done. A `made_on`
    naming a rank says that rank's peak memory holds the whole model."""
    if job.reference is not None:
        yield job.reference
        return
    files = None
    directory = None
    if ctx.local_rank == 0:
        directory = tempfile.mkdtemp(prefix="planner-reference-")
        try:
            files = (make or write_reference)(job, directory, made_on=f"rank {ctx.rank}")
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, files)
    mine = gathered[ctx.rank - ctx.local_rank]
    assert mine is not None, "local rank 0 of this node made no reference"
    try:
        yield mine
        dist.barrier()  # nobody still reads the files
    finally:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def compare_outputs(
    outs: tuple[torch.Tensor, ...],
    want: SafetensorsCheckpoint,
    reference: ReferenceFiles,
    setup: RankSetup,
    report: RankReport,
) -> None:
    """Fill the report's per-output differences: each output of this rank against its DP replica's
    part of the whole-batch reference output (`runtime.numerics.replica_share`); an output without
    a batch dim (a loss, a batch statistic) is averaged over the DP group first (collective over it).
    Raises ValueError when the rank's outputs do not match the reference's in number or shape."""
    plan, groups = setup.plan, setup.groups
    if len(outs) != reference.num_outputs:
        raise ValueError(
            f"the rank module returns {len(outs)} outputs, the unsharded model {reference.num_outputs}"
        )
    report.output_dtypes = [str(out.dtype).removeprefix("torch.") for out in outs]
    report.output_dtype = report.output_dtypes[0] if outs else None
    for i, out in enumerate(outs):
        full = want.read(f"output.{i}").to(out.device)
        got = out.detach()
        if plan.dp > 1 and tuple(full.shape) == tuple(got.shape) and got.is_floating_point():
            got = got.clone()
            dist.all_reduce(got, group=groups.group("dp"))
            got /= plan.dp
        share = replica_share(full, tuple(got.shape), plan.dp, groups.dp_rank)
        if share is None:
            raise ValueError(
                f"output {i} of the rank has shape {tuple(got.shape)}, which is no DP share of the unsharded "
                f"output {tuple(full.shape)} (dp={plan.dp})"
            )
        report.output_diffs.append(max_abs_diff(got, share))
        report.output_scales.append(max_abs(full))
        if f"operand_scale.{i}" in want:
            report.operand_scales.append(float(want.read(f"operand_scale.{i}")))
    report.max_abs_diff = max(report.output_diffs)
    report.output_scale = max(report.output_scales)


def dp_mean(value: torch.Tensor, dp: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The mean of `value` over the `dp` replicas of `group` (collective over it; a copy)."""
    value = value.detach().clone()
    if dp > 1:
        dist.all_reduce(value, group=group)
        value /= dp
    return value


def compare_loss(mean_loss: torch.Tensor, want: SafetensorsCheckpoint, report: RankReport) -> None:
    """Training: the run's MSE loss (averaged over the DP replicas, `dp_mean`: equal shares, so the
    whole batch's mean) against the unsharded model's loss on the whole batch."""
    ref_loss = want.read("loss")
    report.loss_diff = max_abs_diff(mean_loss.cpu(), ref_loss)
    report.loss_scale = float(ref_loss.abs())


def compare_gradients(
    module: torch.nn.Module | Sequence[torch.nn.Module],
    reference: ReferenceFiles,
    setup: RankSetup,
    report: RankReport,
    owned: Mapping[int, tuple[int, int]] | None = None,
    segments: Mapping[str, Sequence[tuple[int, int, torch.Tensor]]] | None = None,
    local: torch.nn.Module | None = None,
    grad_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
) -> None:
    """Training, after the backward and the DP gradient reduction: every gradient of this rank's
    parameters (of `module`, or of each module of a sequence: a rank's pipeline chunks) against its
    shard of the unsharded model's whole-batch gradient (read shard by shard). owned: with the
    distributed optimizer (`runtime.data_parallel.DistributedAdam.owned_ranges`), id(param) -> the flat
    elements (lo, hi) that hold the replicas' mean gradient; only those are compared (parameters not
    listed: none). None compares every element. segments: with sharded gradients (ZeRO-2, FSDP:
    `gradient_segments`, the full `.grad` is not kept), FQN -> [(lo, hi, mean gradient of the local
    parameter's flat elements lo:hi)], compared instead of `.grad`; `local` (FSDP, whose module
    holds flat shards) is the module holding the local parameters at their FQNs (shapes and dtypes).
    grad_of: a parameter's gradient as the optimizer holds it (its fp32 main gradient:
    `runtime.data_parallel._MainGrads.grad_of`); default `.grad`."""
    plan, groups = setup.plan, setup.groups
    diffs, scales, compared = [], [], []
    modules = [module] if isinstance(module, torch.nn.Module) else list(module)
    with SafetensorsCheckpoint([reference.grads]) as grads_file:
        if segments is not None:
            source = local if local is not None else modules[0]
            for n, pieces in segments.items():
                if n not in grads_file:
                    continue
                want = read_local_shards(source, grads_file, plan.splits, groups.tp_rank, plan.tp, [n])[n]
                for lo, hi, got in pieces:
                    diffs.append(max_abs_diff(got.cpu(), want.reshape(-1)[lo:hi]))
                    scales.append(max_abs(want))
                    compared.append(n)
            modules = []
        get = grad_of or (lambda p: p.grad)
        for mod in modules:
            params = dict(mod.named_parameters())
            names = [n for n, p in params.items() if get(p) is not None and n in grads_file]
            for n in names:  # one shard in memory at a time: the check adds little to the rank's peak
                want = read_local_shards(mod, grads_file, plan.splits, groups.tp_rank, plan.tp, [n])[n]
                got = get(params[n])
                if owned is not None:
                    if id(params[n]) not in owned:
                        continue
                    lo, hi = owned[id(params[n])]
                    got, want = got.reshape(-1)[lo:hi], want.reshape(-1)[lo:hi]
                diffs.append(max_abs_diff(got.cpu(), want))
                scales.append(max_abs(want))
                compared.append(n)
    if reference.loss_scale_factor != 1.0:  # both sides' gradients are the scaled loss's
        report.grad_loss_scale = reference.loss_scale_factor
    report.grad_max_abs_diff = max(diffs, default=0.0)
    report.grad_worst = compared[diffs.index(report.grad_max_abs_diff)] if diffs else None
    report.grad_scale = max(scales, default=0.0)
    report.grads_compared = len(diffs)


ADAM_EPS = 1e-8  # torch.optim.Adam's default eps, which the runs' optimizers use
UPDATE_GRAD_FLOOR = 1e-2  # elements compared: |reference gradient| >= this x the largest one (fp32)
UPDATE_TOLERANCE = 0.1  # of the learning rate: the first Adam step moves each element by about lr


def update_snapshot(
    modules: torch.nn.Module | Sequence[torch.nn.Module], optimizer: Any
) -> list[dict[str, tuple[int, int, torch.Tensor]]]:
    """The values the optimizer steps, per module (a rank's graph, or its pipeline chunks) and
    parameter name: (lo, hi, a copy of the flat fp32 values of elements lo:hi): an fp32 parameter
    whole, a 16-bit one's fp32 master copy (`optimizer.fp32_values`). `compare_update`'s `before`."""
    mods = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
    if hasattr(optimizer, "fp32_values_by_name"):  # ZeRO-2 / FSDP: by FQN (FSDP's module holds flat shards)
        named = optimizer.fp32_values_by_name()
        return [{n: (lo, hi, flat.cpu().clone()) for n, (lo, hi, flat) in named.items()}]
    values = optimizer.fp32_values()
    snapshot = []
    for m in mods:
        stepped = {}
        for n, p in m.named_parameters():
            if id(p) in values:
                lo, hi, flat = values[id(p)]
                stepped[n] = (lo, hi, flat.cpu().clone())
        snapshot.append(stepped)
    return snapshot


def compare_update(
    module: torch.nn.Module | Sequence[torch.nn.Module],
    before: Sequence[Mapping[str, tuple[int, int, torch.Tensor]]],
    optimizer: Any,
    reference: ReferenceFiles,
    setup: RankSetup,
    report: RankReport,
) -> None:
    """Training, after the first optimizer step (the DP reduction, Adam and, with the distributed
    optimizer, the parameters' all-gather): every stepped value's update against the update Adam's
    first step makes from the unsharded model's gradient, -lr g / (|g| + eps) (its bias-corrected
    moments are g and g^2), on this rank's shard: an fp32 parameter whole (so after the all-gather),
    a 16-bit one through its fp32 master copy (this rank's slice of it with the distributed
    optimizer; the 16-bit weight would round a 1e-3 step away). Compared where |g| is at least
    `UPDATE_GRAD_FLOOR` (fp32), or twice the dtype's numerics tolerance, times the largest |g|: there
    the gradients' allowed difference cannot flip a step's sign, so the updates match to a small share
    of lr, while a wrong slice updated, an update lost or a gather misplaced moves elements by about
    lr. `module`: the rank's graph, or its pipeline chunks; `before`: `update_snapshot` of them just
    before the step. Under fp16 loss scaling the reference's gradients are divided by its scale first
    (`ReferenceFiles.loss_scale_factor`), as the run's optimizer divides its own."""
    plan, groups = setup.plan, setup.groups
    modules = [module] if isinstance(module, torch.nn.Module) else list(module)
    lr, now = optimizer.lr, update_snapshot(modules, optimizer)
    if getattr(optimizer, "local_module", None) is not None:  # FSDP: the local parameters' stand-in
        modules = [optimizer.local_module]
    diffs = []
    with SafetensorsCheckpoint([reference.grads]) as grads_file:

        def grad(mod: torch.nn.Module, name: str) -> torch.Tensor:
            shard = read_local_shards(mod, grads_file, plan.splits, groups.tp_rank, plan.tp, [name])[name]
            return shard.float().reshape(-1) / reference.loss_scale_factor

        stepped = [  # each gradient shard read once: the largest |g| scales the floor of every one
            (mod, n, grad(mod, n), lo, hi, was, now_m[n][2])
            for mod, old, now_m in zip(modules, before, now)
            for n, (lo, hi, was) in old.items()
            if n in grads_file and n in now_m
        ]
        scale = max((max_abs(g) for _, _, g, *_ in stepped), default=0.0)
        for mod, n, full, lo, hi, was, after in stepped:
            g = full[lo:hi]
            floor = max(UPDATE_GRAD_FLOOR, 2 * tolerance_for(str(mod.get_parameter(n).dtype)))
            want = -lr * g / (g.abs() + ADAM_EPS)
            mask = g.abs() >= floor * scale
            if mask.any():
                diffs.append(float((after - was - want)[mask].abs().max()))
    if diffs:
        report.update_max_abs_diff = max(diffs)
        report.update_tolerance = UPDATE_TOLERANCE * lr


def _named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under each of its names (tied weights and aliases included)."""
    return list(module.named_parameters(remove_duplicate=False)) + list(
        module.named_buffers(remove_duplicate=False)
    )


def routing_replay(want: SafetensorsCheckpoint) -> TokenRoutingTape:
    """The reference's expert choices by token (`write_reference`'s "routing.<top-k node>.key / .ids"),
    as a tape to replay in a rank's checked step (`runtime.routing.routing_by_token`)."""
    tape = TokenRoutingTape(replay=True)
    for name in want.keys():
        if name.startswith("routing.") and name.endswith(".key"):
            node = name[len("routing.") : -len(".key")]
            logits = want.read(f"routing.{node}.logits") if f"routing.{node}.logits" in want else None
            tape.choices[node] = (want.read(name), want.read(f"routing.{node}.ids"), logits)
    return tape


def record_routing(report: RankReport, tape: TokenRoutingTape) -> None:
    """The replayed routing's counts into a rank's report (`RankReport.routing_*`); then the tape lets go
    of the reference's choices (every router's (N, H) inputs of the whole batch: memory the timed steps,
    which route by themselves, must not hold; 4 MiB of a tiny Mixtral's 99 MiB heap peak)."""
    report.routing_calls += tape.calls
    report.routing_flipped += tape.flipped
    report.routing_unmatched += tape.unmatched
    report.routing_max_gap = max(report.routing_max_gap, tape.max_gap)
    report.routing_logit_diff = max(report.routing_logit_diff, tape.logit_diff)
    report.routing_logit_scale = max(report.routing_logit_scale, tape.logit_scale)
    tape.choices.clear()

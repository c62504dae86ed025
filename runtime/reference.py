"""The unsharded reference of a run, computed once, and the weights every rank loads its shards from.

    write_reference(job, directory) -> ReferenceFiles

1. builds the model once: from the model file with the job's seed, or - with `--weights` - on the
   meta device (when the file builds there) and filled from the user's safetensors files;
2. captures it on the WHOLE batch, applies the plan's ladder layers (so a run's difference measures
   the rewrite alone; `ladder_deviation` says how far ladder residual moved the original outputs)
   and runs it: every output, and for training the MSE loss against `training_target` and every
   parameter's gradient;
3. writes to `directory`: `outputs.safetensors` (output.{i}, target, loss), `grads.safetensors`
   (training) and, unless the user gave weights, `weights.safetensors` (every parameter and
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
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from passes.checkpoint import SafetensorsCheckpoint, checkpoint_files, load_whole, save_checkpoint
from passes.ladder import apply_ladder, ladder_deviation, ladder_residual_adds
from planner.errors import InputError
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture, flat_inputs
from planner.frontend.modelfile import ModelFile, load_model_file
from planner.plan import Plan
from runtime.job import ReferenceFiles, RunJob, job_inputs
from runtime.launch import RankContext
from runtime.numerics import all_outputs, training_target

WEIGHTS_HELP = (
    "give the weights as safetensors: --weights FILE.safetensors or a directory of them, with the "
    "names of model.state_dict() (e.g. safetensors.torch.save_file(model.state_dict(), 'model.safetensors'))"
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


def write_reference(job: RunJob, directory: str, made_on: str = "launching process") -> ReferenceFiles:
    """Run the unsharded model once on the whole batch and write its results and weights into
    `directory` (module docstring). Raises InputError for a model without weights or bad weights."""
    plan = Plan.from_dict(job.plan)
    model_file = load_model_file(job.model_path)
    model = build_unsharded(model_file, job.seed, job.weights)
    args, kwargs = job_inputs(model_file, job, "cpu")
    inputs = flat_inputs(args, kwargs)
    gm = capture(model, args, kwargs)
    adds = ladder_residual_adds(analyse(gm), plan.ladder_layers)
    training = job.workload == "train"
    deviation = None
    if adds:
        with torch.no_grad():
            original = all_outputs(gm(*inputs))[0]
        apply_ladder(gm, adds)
    with torch.set_grad_enabled(training):
        outs = all_outputs(gm(*inputs))
    results = {f"output.{i}": out.detach() for i, out in enumerate(outs)}
    if adds:
        deviation = ladder_deviation(original, results["output.0"])
    grads_path = None
    if training:
        target = training_target(outs[0].detach())
        loss = F.mse_loss(outs[0], target)
        loss.backward()
        results.update(target=target, loss=loss.detach())
        grads = {n: p.grad for n, p in gm.named_parameters(remove_duplicate=False) if p.grad is not None}
        grads_path = os.path.join(directory, "grads.safetensors")
        save_checkpoint(grads, grads_path)
    outputs_path = os.path.join(directory, "outputs.safetensors")
    save_checkpoint(results, outputs_path)
    tensors = dict(_named_tensors(model))
    tensors.update(_named_tensors(gm))  # constants the capture lifted into the graph
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
    )


@contextmanager
def shared_reference(ctx: RankContext, job: RunJob) -> Iterator[ReferenceFiles]:
    """The job's reference; without one, local rank 0 of each node writes it to a temporary folder
    (collective over the default group: every rank must enter) and removes it when every rank of
    the job is done. A `made_on` naming a rank says that rank's peak memory holds the whole model."""
    if job.reference is not None:
        yield job.reference
        return
    files = None
    directory = None
    if ctx.local_rank == 0:
        directory = tempfile.mkdtemp(prefix="planner-reference-")
        try:
            files = write_reference(job, directory, made_on=f"rank {ctx.rank}")
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
    gathered: list[ReferenceFiles | None] = [None] * ctx.world_size
    dist.all_gather_object(gathered, files)
    mine = gathered[ctx.rank - ctx.local_rank]
    assert mine is not None, "local rank 0 of this node made no reference"
    try:
        yield mine
        dist.barrier()  # nobody still reads the files
    finally:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def _named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under each of its names (tied weights and aliases included)."""
    return list(module.named_parameters(remove_duplicate=False)) + list(
        module.named_buffers(remove_duplicate=False)
    )

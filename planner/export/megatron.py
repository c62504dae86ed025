"""`planner export --to megatron`: the plan as Megatron-LM command-line arguments.

The output is a bash file defining one array, `PLANNER_MEGATRON_ARGS`, to add to a `pretrain_gpt.py`
command line (`"${PLANNER_MEGATRON_ARGS[@]}"`); the model's size, tokenizer, data and optimizer
arguments stay the user's. Argument names are Megatron-LM's (`megatron/training/arguments.py`, and
the dataclass fields it turns into options: `ModelParallelConfig`, `TransformerConfig`,
`TrainingConfig`):

| plan                                   | Megatron-LM                                                        |
|----------------------------------------|--------------------------------------------------------------------|
| mesh.tp, mesh.pp                       | --tensor-model-parallel-size, --pipeline-model-parallel-size       |
| mesh.dp                                | (derived by Megatron: world size / (tp * pp))                      |
| stages, even, virtual_stages v         | --num-layers-per-virtual-pipeline-stage (layers per model chunk)   |
| stages, uneven                         | --pipeline-model-parallel-layout "Et*17|t*15L" (exact, any v)      |
| sequence_parallel (tp > 1)             | --sequence-parallel                                                |
| recompute full / selective             | --recompute-granularity full --recompute-method uniform            |
|                                        | --recompute-num-layers 1 / --recompute-granularity selective       |
| distributed_optimizer                  | --use-distributed-optimizer                                        |
| batch / dp / micro_batches, batch      | --micro-batch-size, --global-batch-size                            |
| dtype bf16 / fp16                      | --bf16 / --fp16 (fp32: none)                                       |
| seq_len, layers                        | --seq-length, --num-layers                                         |
| mesh.tp > 1                            | export CUDA_DEVICE_MAX_CONNECTIONS=1 (environment)                 |

Megatron-LM's `validate_args` (Megatron-Core 0.19.2, PyPI `megatron-core==0.19.2`,
`megatron/training/arguments.py`) asserts `CUDA_DEVICE_MAX_CONNECTIONS=1` when the tensor- (or
context-) parallel size is above 1 on GPUs before Blackwell (compute capability < 10) and FSDP is
off: its TP communication overlap relies on one hardware queue. The file exports it with TP > 1.
"""

from __future__ import annotations

import shlex

from planner.export.common import (
    Export,
    layout_warnings,
    micro_batch_size,
    num_layers,
    stage_sizes_text,
    strongest_recompute,
    uneven_stages,
    virtual_stage_layers,
)
from planner.plan import Plan, Recompute, Schedule, Workload

TOOL = "Megatron-LM"


def megatron_environment(plan: Plan) -> dict[str, str]:
    """Environment variables Megatron-LM's validation needs for the plan (module docstring)."""
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if plan.tp > 1 else {}


def megatron_args(plan: Plan) -> tuple[list[str], list[str]]:
    """(Megatron-LM arguments as argv items, warnings). Raises InputError when the batch does not
    split into whole micro-batches or the stages do not match `virtual_stages`."""
    warnings = layout_warnings(plan, TOOL)
    if plan.workload is not Workload.TRAIN:
        warnings.append(
            f"this is a {plan.workload} plan; Megatron-LM's pretraining arguments describe a training step "
            "(plan with --workload train for its memory and schedule)"
        )
    args = [
        "--tensor-model-parallel-size", str(plan.tp),
        "--pipeline-model-parallel-size", str(plan.pp),
        "--num-layers", str(num_layers(plan)),
        "--seq-length", str(plan.seq_len),
        "--micro-batch-size", str(micro_batch_size(plan)),
        "--global-batch-size", str(plan.batch_size),
    ]  # fmt: skip
    args += _pipeline_args(plan, warnings)
    if plan.sequence_parallel and plan.tp > 1:
        args.append("--sequence-parallel")
    args += _recompute_args(plan, warnings)
    if plan.distributed_optimizer:
        args.append("--use-distributed-optimizer")
    if plan.workload is Workload.TRAIN and plan.dp > 1:
        # what a Megatron-LM user turns on with data parallelism; the plan prices the sync exposed
        args.append("--overlap-grad-reduce")
        if plan.distributed_optimizer:
            args.append("--overlap-param-gather")
        warnings.append(
            f"--overlap-grad-reduce{' and --overlap-param-gather' if plan.distributed_optimizer else ''}: Megatron-LM "
            f"hides the data-parallel gradient traffic behind the backward pass, which the plan prices as exposed "
            f"({plan.predicted.grad_sync_s * 1e3:.4g} ms of its step): expect a faster step than predicted"
        )
    if plan.dtype == "bf16":
        args.append("--bf16")
    elif plan.dtype == "fp16":
        args.append("--fp16")
    if plan.workload is Workload.TRAIN and plan.dtype == "bf16":
        warnings.append(_main_grads_warning(plan))
    return args, warnings


def _main_grads_warning(plan: Plan) -> str:
    """Megatron-LM's --bf16 keeps fp32 main gradients (its --accumulate-allreduce-grads-in-fp32 is on
    for bf16), 2 bytes per parameter more than the plan's 16-bit gradients (the planner's runtime
    keeps them in the parameters' dtype, as ZeRO's 16-byte mixed-precision count does)."""
    extra = 2.0 * plan.model_params / (plan.tp * plan.pp)  # a rank's share of the parameters, bytes
    peak = plan.predicted.peak_memory_bytes + extra
    cluster = plan.saved_cluster()
    fits = ""
    if cluster is not None:
        fits = f" of the device's {cluster.device.memory_bytes / 2**30:.1f} GiB" + (
            (
                ": it does not fit; plan with more pipeline stages"
                + ("" if plan.distributed_optimizer else " or the distributed optimizer")
            )
            if peak > cluster.device.memory_bytes
            else ""
        )
    return (
        f"Megatron-LM with --bf16 accumulates and reduces gradients in fp32 (main_grad): about "
        f"{extra / 2**30:.1f} GiB more per rank than the plan's 16-bit gradients, a peak near {peak / 2**30:.1f} GiB{fits}"
    )


def _pipeline_args(plan: Plan, warnings: list[str]) -> list[str]:
    """Stage layout: Megatron's even split by default, chunk size for even interleaving, the layout
    string otherwise (it places the embedding on the first stage and the loss on the last)."""
    if plan.pp == 1:
        return []
    if plan.schedule is Schedule.GPIPE:
        warnings.append(
            "Megatron-LM has no GPipe schedule; it runs 1F1B, with the same bubble and fewer activations "
            "held than the plan priced"
        )
    chunks = virtual_stage_layers(plan)
    if not uneven_stages(plan):
        if plan.virtual_stages > 1:
            return ["--num-layers-per-virtual-pipeline-stage", str(len(chunks[0]))]
        return []
    segments = []
    for index, layers in enumerate(chunks):
        text = f"t*{len(layers)}" if len(layers) > 1 else "t" * len(layers)
        if index == 0:
            text = "E" + text
        if index == len(chunks) - 1:
            text += "L"
        segments.append(text)
    warnings.append(
        f"uneven pipeline stages ({stage_sizes_text(plan)}): written as --pipeline-model-parallel-layout, "
        "which needs a Megatron-LM with that option (2025 or later)"
    )
    return ["--pipeline-model-parallel-layout", "|".join(segments)]


def _recompute_args(plan: Plan, warnings: list[str]) -> list[str]:
    """One granularity for every layer: Megatron-LM recomputes all transformer layers alike."""
    strongest = strongest_recompute(
        plan, warnings, "Megatron-LM", " for all (more recomputation than priced, never less memory headroom)"
    )
    if strongest is None:
        return []
    if strongest is Recompute.FULL:
        return [
            "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
        ]  # fmt: skip
    if strongest is Recompute.SELECTIVE:
        return ["--recompute-granularity", "selective"]
    return []


def export_megatron(plan: Plan) -> Export:
    """The bash file defining PLANNER_MEGATRON_ARGS (module docstring), with its warnings."""
    args, warnings = megatron_args(plan)
    lines = [
        f"# Megatron-LM parallelism arguments for {plan.model} on {plan.cluster} ({plan.workload}, "
        f"tp={plan.tp} pp={plan.pp} dp={plan.dp}), written by planner export --to megatron.",
        f"# Launch {plan.num_devices} processes (tp * pp * dp): Megatron-LM derives the data-parallel "
        f"size {plan.dp} from the world size.",
        '# Use: source this file, then add "${PLANNER_MEGATRON_ARGS[@]}" to the pretrain_gpt.py command line;',
        "# keep your model-size, tokenizer, data and optimizer arguments (and drop your own copies of these).",
    ]
    env = megatron_environment(plan)
    if env:
        lines += [
            "# Megatron-LM's validate_args requires this with TP > 1 on GPUs before Blackwell (TP comm overlap",
            "# relies on one hardware queue; harmless on Blackwell, where it is no longer checked):",
        ]
        lines += [f"export {key}={shlex.quote(value)}" for key, value in env.items()]
    lines.append("PLANNER_MEGATRON_ARGS=(")
    pairs: list[list[str]] = []
    for item in args:
        if item.startswith("--") or not pairs:
            pairs.append([item])
        else:
            pairs[-1].append(item)
    lines += ["    " + " ".join(shlex.quote(x) for x in pair) for pair in pairs]
    lines.append(")")
    return Export("\n".join(lines) + "\n", warnings)

"""`planner export --to torchtitan`: the plan as sections of a torchtitan job TOML.

Written for torchtitan's TOML job files (`--job.config_file`, releases up to v0.2.2; the names are
those of `torchtitan/config/job_config.py`: classes `Parallelism`, `ActivationCheckpoint`,
`Training`). Later torchtitan configures runs in Python (`ParallelismConfig`) with the same
parallelism field names except the micro-batch, which became `num_pp_microbatches`.

| plan                                   | torchtitan                                                          |
|----------------------------------------|---------------------------------------------------------------------|
| mesh.tp, mesh.pp                       | tensor_parallel_degree, pipeline_parallel_degree                   |
| mesh.dp, distributed_optimizer false   | data_parallel_replicate_degree = dp (DDP) with tp = pp = 1; else as below |
| mesh.dp, distributed_optimizer true    | data_parallel_shard_degree = dp (FSDP; torchtitan has no ZeRO-1)    |
| schedule (v virtual stages)            | pipeline_parallel_schedule "GPipe" / "1F1B" / "Interleaved1F1B"    |
| stages (pp > 1)                        | module_fqns_per_model_part (torchtitan's module names, exact)       |
| batch / dp / micro_batches             | pipeline_parallel_microbatch_size                                   |
| LM head vocabulary-split               | disable_loss_parallel = false                                       |
| recompute                              | [activation_checkpoint] mode = "none" / "selective" / "full"       |
| batch, seq_len, dtype                  | [training] global_batch_size, local_batch_size, seq_len,           |
|                                        | mixed_precision_param                                               |
| micro_batches without pipeline stages  | local_batch_size = the micro-batch (torchtitan accumulates          |
|                                        | gradients over global / (local x dp) steps)                         |

torchtitan's decoder models name their modules `tok_embeddings`, `layers.N`, `norm` and `output`,
whatever the planned model file called them; the pipeline parts use those names.
"""

from __future__ import annotations

from planner.export.common import Export, layout_warnings, micro_batch_size, virtual_stage_layers
from planner.plan import Plan, Recompute, Schedule, SplitStyle, Workload

TOOL = "torchtitan"
SCHEDULE_NAMES = {
    Schedule.GPIPE: "GPipe",
    Schedule.ONE_F_ONE_B: "1F1B",
    Schedule.INTERLEAVED_1F1B: "Interleaved1F1B",
}  # torch.distributed.pipelining's schedule class names, which torchtitan looks up
_PRECISION = {"bf16": "bfloat16", "fp32": "float32"}
_STRENGTH = {Recompute.NONE: 0, Recompute.SELECTIVE: 1, Recompute.FULL: 2}


def torchtitan_sections(plan: Plan) -> tuple[dict[str, dict[str, object]], list[str]]:
    """({section: {field: value}}, warnings): the `[parallelism]`, `[activation_checkpoint]` and
    `[training]` fields the plan decides. Raises InputError when the batch does not split into whole
    micro-batches or the stages do not match `virtual_stages`."""
    warnings = layout_warnings(plan, TOOL)
    if plan.workload is not Workload.TRAIN:
        warnings.append(
            f"this is a {plan.workload} plan; torchtitan trains (plan with --workload train for its memory "
            "and schedule)"
        )
    # torchtitan's DDP runs alone: its llama3 `parallelize` raises "DDP has not supported > 1D
    # parallelism" when data-parallel replicas combine with TP or PP (pytorch/torchtitan,
    # torchtitan/models/llama3/infra/parallelize.py), so such a plan's replicas become FSDP shards
    ddp_alone = plan.tp == 1 and plan.pp == 1
    shard = plan.distributed_optimizer or (plan.dp > 1 and not ddp_alone)
    par: dict[str, object] = {
        "tensor_parallel_degree": plan.tp,
        "pipeline_parallel_degree": plan.pp,
        "data_parallel_replicate_degree": 1 if shard else plan.dp,
        "data_parallel_shard_degree": plan.dp if shard else 1,
        "context_parallel_degree": 1,
        "enable_async_tensor_parallel": False,
    }
    if shard and not plan.distributed_optimizer:
        warnings.append(
            f'torchtitan runs DDP only without TP or PP (its parallelize raises "DDP has not supported > 1D '
            f"parallelism\"): the plan's {plan.dp} data-parallel replicas are exported as FSDP "
            "(data_parallel_shard_degree), which also shards parameters, gradients and optimizer state: less "
            "memory, more all-gathers than the plan priced"
        )
    if plan.distributed_optimizer and plan.dp > 1:
        warnings.append(
            "torchtitan has no ZeRO-1 distributed optimizer: exported as FSDP (data_parallel_shard_degree), which "
            "also shards parameters and gradients: less memory, more all-gathers than the plan priced"
        )
    if plan.tp > 1:
        heads = [s for s in plan.splits.values() if s.style is SplitStyle.VOCAB]
        par["disable_loss_parallel"] = not heads
        if not plan.sequence_parallel:
            warnings.append(
                "torchtitan's tensor parallelism always runs sequence parallel (norms split along the sequence); "
                "the plan priced plain all-reduces"
            )
    if plan.pp > 1:
        par["pipeline_parallel_schedule"] = SCHEDULE_NAMES[plan.schedule]
        par["pipeline_parallel_microbatch_size"] = micro_batch_size(plan)
        par["module_fqns_per_model_part"] = _model_parts(plan)
    ac: dict[str, object] = {"mode": _ac_mode(plan, warnings)}
    if ac["mode"] == "selective":
        ac["selective_ac_option"] = "op"
        warnings.append(
            "torchtitan's selective checkpointing ('op' policy) keeps matmul and attention outputs and recomputes "
            "the rest, not Megatron-LM's attention-core recomputation the plan priced: activation memory differs"
        )
    training: dict[str, object] = {
        "global_batch_size": plan.batch_size,
        # torchtitan runs global / (local x dp) gradient-accumulation steps of local_batch_size each; a
        # pipeline splits its local batch into micro-batches itself, without one each micro-batch is a step
        "local_batch_size": plan.batch_size // plan.dp if plan.pp > 1 else micro_batch_size(plan),
        "seq_len": plan.seq_len,
    }
    if plan.dtype in _PRECISION:
        training["mixed_precision_param"] = _PRECISION[plan.dtype]
    else:
        warnings.append(
            f"torchtitan trains in bfloat16 or float32, not {plan.dtype}: choose mixed_precision_param"
        )
    return {"parallelism": par, "activation_checkpoint": ac, "training": training}, warnings


def _model_parts(plan: Plan) -> list[list[str]]:
    """Module FQNs per (virtual) stage: the embedding with the first, the final norm and LM head with
    the last, in torchtitan's module names."""
    chunks = virtual_stage_layers(plan)
    parts = [[f"layers.{i}" for i in layers] for layers in chunks]
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "output"]
    return parts


def _ac_mode(plan: Plan, warnings: list[str]) -> str:
    """torchtitan checkpoints every layer alike: the strongest recomputation the plan asks for."""
    if not plan.recompute:
        return "none"
    choices = set(plan.recompute.values())
    strongest = max(choices, key=_STRENGTH.__getitem__)
    if len(choices) > 1:
        warnings.append(
            f"the plan recomputes layers differently ({plan.recompute_text()}); torchtitan checkpoints every layer alike: "
            f"exported as {strongest}"
        )
    return str(strongest)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return "[\n" + "".join(f"    {_toml_value(v)},\n" for v in value) + "]"  # one part per line
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")  # internal: sections hold only the above


def export_torchtitan(plan: Plan) -> Export:
    """The TOML text (module docstring) with its warnings."""
    sections, warnings = torchtitan_sections(plan)
    lines = [
        f"# torchtitan job config sections for {plan.model} on {plan.cluster} ({plan.workload}, "
        f"tp={plan.tp} pp={plan.pp} dp={plan.dp}), written by planner export --to torchtitan.",
        "# Replace the [parallelism] and [activation_checkpoint] sections of your job TOML with these and set",
        f"# the [training] keys below; run on {plan.num_devices} GPUs (NGPU={plan.num_devices}).",
    ]
    for name, fields in sections.items():
        lines += ["", f"[{name}]"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in fields.items()]
    return Export("\n".join(lines) + "\n", warnings)

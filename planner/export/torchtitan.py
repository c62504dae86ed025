"""`planner export --to torchtitan`: the plan as torchtitan's configuration, for the release chosen.

torchtitan 0.3 (the default, `--torchtitan-version 0.3`) reads no TOML job file: a run is a
`config_registry` function (`--module llama3 --config llama3_8b`) with command-line overrides
`--section.field value` parsed by tyro against its config dataclasses. The export is a bash file
defining `PLANNER_TORCHTITAN_ARGS`, those overrides, to put last on the `torchtitan.train` command
line (its last item, `activation-checkpoint:...`, is a tyro subcommand, after which only that
subcommand's options are read). Names are those of torchtitan 0.3.0 (PyPI `torchtitan==0.3.0`):
`torchtitan/config/configs.py` (`TrainingConfig`, `ParallelismConfig`, `CompileConfig`),
`torchtitan/trainer.py` (`Trainer.Config`: `activation_checkpoint` is the union
`ActivationCheckpointingConfig` of `torchtitan/distributed/activation_checkpoint.py`, subcommands
`activation-checkpoint:selective|full|memory-budget|none`). Booleans are tyro flags
(`--training.disable_cuda_graphs`, `--parallelism.no_enable_sequence_parallel`).

`--torchtitan-version 0.2` writes the `[parallelism]`, `[activation_checkpoint]` and `[training]`
sections of a job TOML (`--job.config_file`, torchtitan 0.2.x; names of 0.2.2's
`torchtitan/config/job_config.py`: classes `Parallelism`, `ActivationCheckpoint`, `Training`).

| plan                                   | torchtitan 0.3 override / 0.2 TOML key                              |
|----------------------------------------|---------------------------------------------------------------------|
| mesh.tp, mesh.pp                       | parallelism.tensor_parallel_degree, pipeline_parallel_degree        |
| mesh.cp                                | context_parallel_degree (1 without context parallelism)             |
| cp_load_balance off (cp > 1)           | 0.3: context_parallel_load_balancer None; 0.2: none in TOML (a      |
|                                        | warning gives the command-line override)                            |
| cp_comm_type (cp > 1)                  | 0.2: context_parallel_rotate_method "alltoall" (ring) / "allgather" |
|                                        | 0.3: none (all-gather); ring and alltoall: warnings                 |
| dp_style ddp with cp > 1               | replicate degree dp, shard degree 1, reshard "never" (torchtitan    |
|                                        | shards over the CP ranks; a warning)                                |
| dp_style ddp (mesh.dp)                 | data_parallel_replicate_degree = dp, data_parallel_shard_degree = 1 |
|                                        | 0.2 with TP or PP (its DDP refuses them): FSDP over dp, a warning   |
| dp_style fsdp: dp_shard S, replicas R  | data_parallel_shard_degree = S, data_parallel_replicate_degree = R  |
|                                        | (HSDP when both > 1)                                                |
| reshard_after_forward (fsdp)           | fsdp_reshard_after_forward = "always" / "never"                     |
| dp_style zero1 / zero2                 | no torchtitan form: FSDP over dp (shard degree dp), reshard         |
|                                        | "never" or "always", the one the plan priced nearer; a warning      |
|                                        | gives both prices                                                   |
| sequence_parallel (tp > 1)             | 0.3: parallelism.[no_]enable_sequence_parallel; 0.2: always on       |
| tp_comm_overlap (tp > 1)               | 0.3: --compile.enable --compile.enable_async_tensor_parallel;       |
|                                        | 0.2: parallelism.enable_async_tensor_parallel, [compile] enable     |
| schedule (v virtual stages)            | pipeline_parallel_schedule "GPipe" / "1F1B" / "Interleaved1F1B"    |
| stages (pp > 1)                        | module_fqns_per_model_part, in the version's module names           |
| batch / dp / micro_batches             | pipeline_parallel_microbatch_size                                   |
| pp > 1 (0.3)                           | --training.disable_cuda_graphs (0.3 refuses CUDA graphs with PP)    |
| LM head vocabulary-split (0.2)         | disable_loss_parallel = false (0.3: always loss parallel)           |
| recompute                              | 0.3: activation-checkpoint:none / selective / full                  |
|                                        | 0.2: [activation_checkpoint] mode (+ selective_ac_option "op")      |
| batch, seq_len                         | training.global_batch_size, local_batch_size, seq_len               |
| dtype                                  | training.mixed_precision_param; 0.2 with TP or PP and no FSDP:      |
|                                        | training.dtype = "bfloat16" (see below)                             |
| grad_reduce_dtype (bf16 training)      | training.mixed_precision_reduce "float32" (fp32) / "bfloat16"       |
| micro_batches without pipeline stages  | local_batch_size = the micro-batch (torchtitan accumulates          |
|                                        | gradients over global / (local x dp) steps)                         |
| ep (a MoE model)                       | expert_parallel_degree; 0.2 also expert_tensor_parallel_degree:     |
|                                        | expert_tp; tp for EP over dp at tp > 1 (its EP groups the plan's)   |

Data parallelism: torchtitan runs DDP, FSDP and HSDP through `fully_shard` on its
`["dp_replicate", "fsdp"]` mesh (0.3 always, shard degree 1 included; 0.2 FSDP / HSDP, and
`replicate` for DDP alone). It has no ZeRO-1 or ZeRO-2: a plan with either is exported as FSDP over
every data-parallel rank (which shards the parameters too), with or without reshard after forward as
the plan's own "data-parallel" decision priced nearer the planned style (without one: "never", the
parameters whole from forward to backward as in ZeRO-2, the same traffic per micro-batch); the
warning names what was exported, says it is not what the plan priced, and gives the plan's step time
and memory of both (`common.dp_substitute_warning`). torchtitan 0.2's DDP with TP or PP goes out the
same way. The policy is written only with a shard degree above 1 ("default" would reshard unless
pipeline parallel).

Context parallelism (`mesh.cp` > 1): `context_parallel_degree`. torchtitan's world size is
dp_replicate * dp_shard * cp * tp * pp (`torchtitan/distributed/parallel_dims.py`), its batch spans
dp_replicate x dp_shard (the CP ranks share their sequences: the batch fields are as without CP) and
its FSDP dim is dp_shard x cp: it always shards the parameters over the CP ranks (that file's
`build_mesh`: "we always assume that when cp is used, FSDP is also applied"), as the plan's FSDP does
over dp_shard x cp. A plan's DDP (gradients all-reduced over dp x cp, parameters whole) therefore
runs as HSDP there, replicated over dp and sharded over cp, with the parameters kept whole from
forward to backward ("never"), and a warning. Its batches are cut by the head-tail load balancer by
default (`context_parallel_load_balancer` "headtail", both releases: rank r holds chunks r and
2cp-1-r, as the plan's `cp_load_balance`); 0.3 turns it off with None, which a 0.2 TOML cannot write
(TOML has no null: the warning gives the command-line override). The attention's K/V exchange: 0.3.0
has no setting (its Llama config's FlexAttention all-gathers K/V, `flex_cp_allgather` in
`torchtitan/distributed/context_parallel/api.py`; SDPA runs PyTorch's default rotate method,
all-gather); 0.2.2 has `context_parallel_rotate_method` ("allgather" | "alltoall", PyTorch's
`set_rotate_method`: "alltoall" passes each K/V shard to the next rank, a ring) but applies it only
in its validation loop (`torchtitan/components/validate.py`; its training steps run PyTorch's
default, all-gather): a ring plan is exported with "alltoall" and a warning. Neither has all-to-all
(Ulysses) context parallelism. Both assert the sequence length a multiple of 2 x cp (times tp: 0.2
always, 0.3 with sequence parallel).

Expert parallelism (`Plan.ep`): torchtitan lays its experts on a "sparse" mesh over the same ranks as
the dense one, (pp, dp_replicate, efsdp, ep) in 0.3 and (pp, dp_replicate, efsdp, ep, etp) in 0.2,
efsdp = dp_shard x cp x tp / (ep x etp) (`torchtitan/distributed/parallel_dims.py` of both releases):
EP takes the innermost ranks of dp_shard x cp x tp, after the expert-TP ones, and never the replicate
ones. So ep must divide dp_shard x cp x tp / etp: a plan whose exported data-parallel style keeps too
few shard ranks (ddp: shard degree 1) is exported as HSDP with the least shard degree that holds EP,
and a warning. 0.3 has no expert TP (its EP borrows the TP ranks: EP over tp is exact, EP over dp at tp
> 1 takes TP ranks into the EP groups, a warning); 0.2's `expert_tensor_parallel_degree` is 1 or tp
("etp = tp: partial dp -> ep; etp = 1: partial dp + all tp -> ep", its job_config.py): tp for EP over
dp (the EP groups the plan's; exact for a plan with `Plan.expert_tp` = tp, the experts split over TP
as there; a plan with expert_tp 1 replicates them: a warning, as its etp 1 would put TP ranks in the
EP groups), 1 for EP over tp. torchtitan dispatches tokens by all-to-all in both folds.

Module names of the pipeline parts: torchtitan's Llama names its modules `tok_embeddings`,
`layers.N`, `norm` and, in 0.3, `lm_head` (0.3.0 `torchtitan/models/common/decoder.py`; its
`split_module` sets every top-level module not listed to None, so a stage list naming `output`
would drop the head) or, in 0.2, `output` (0.2.2 `torchtitan/models/llama3/model/model.py`).

Mixed precision: torchtitan 0.2 applies `mixed_precision_param` only through FSDP (data-parallel
shards) or, without TP and PP, torch.autocast; with TP or PP and no FSDP it trains in float32 (0.2.2
`torchtitan/distributed/utils.py` `maybe_enable_amp`: "Mixed precision training with TP or PP is
only supported when FSDP/HSDP/CP is enabled"). Such a 16-bit plan exports `training.dtype =
"bfloat16"` for 0.2, with a warning. torchtitan 0.3 always wraps the model in fully_shard (shard
degree 1 included), which installs the mixed-precision policy: no such case.
"""

from __future__ import annotations

import shlex

from planner.errors import InputError
from planner.export.common import (
    ULYSSES,
    ZERO_NAMES,
    Export,
    cp_sequence_warning,
    dp_label,
    dp_substitute_warning,
    language_model_warnings,
    layout_warnings,
    micro_batch_size,
    nearest_dp_form,
    strongest_recompute,
    virtual_stage_layers,
)
from planner.plan import DataParallel, Plan, Schedule, SplitStyle, Workload, loss_scale_text

TOOL = "torchtitan"
VERSIONS: tuple[str, ...] = (
    "0.3",
    "0.2",
)  # torchtitan releases the export writes for; the first is the default
DEFAULT_VERSION = VERSIONS[0]
SCHEDULE_NAMES = {
    Schedule.GPIPE: "GPipe",
    Schedule.ONE_F_ONE_B: "1F1B",
    Schedule.INTERLEAVED_1F1B: "Interleaved1F1B",
}  # torch.distributed.pipelining's schedule class names, which torchtitan looks up
# parallelism.fsdp_reshard_after_forward (0.3.0 configs.py, 0.2.2 job_config.py: "default" | "always" |
# "never"; "default" reshards unless pipeline parallel): the plan's choice, written out
RESHARD_POLICY = {True: "always", False: "never"}
HEAD_NAMES = {"0.3": "lm_head", "0.2": "output"}  # torchtitan's Llama LM head module, per release
_PRECISION = {"bf16": "bfloat16", "fp32": "float32"}
FP32_TRAP = "Mixed precision training with TP or PP is only supported when FSDP/HSDP/CP is enabled"
# Plan.cp_comm_type -> torchtitan 0.2.2's context_parallel_rotate_method (PyTorch's set_rotate_method:
# "alltoall" passes each K/V shard to the next rank, a ring; "allgather" gathers them all); no Ulysses
ROTATE_METHODS = {"ring": "alltoall", "allgather": "allgather", "alltoall": "allgather"}


def check_version(version: str) -> str:
    """`version` as one of VERSIONS ("0.3.0" reads as "0.3"); InputError naming the choices otherwise."""
    short = ".".join(str(version).split(".")[:2])
    if short not in VERSIONS:
        raise InputError(
            f"torchtitan version {version!r}: the export writes for torchtitan {' or '.join(VERSIONS)} "
            "(0.3: command-line overrides of a config_registry function; 0.2: job TOML sections)"
        )
    return short


def _data_parallel(plan: Plan, version: str, warnings: list[str]) -> tuple[int, int, str | None]:
    """(data_parallel_replicate_degree, data_parallel_shard_degree, fsdp_reshard_after_forward policy
    or None to leave it out) for the plan's data-parallel style (module docstring's table)."""
    label = dp_label(plan)
    if label == "ddp" and plan.cp > 1:
        warnings.append(
            f"torchtitan shards the parameters over the cp={plan.cp} context-parallel ranks whenever cp > 1 (its "
            "FSDP mesh dim is data_parallel_shard_degree x context_parallel_degree, parallel_dims.py); the plan's ddp "
            f"all-reduces the gradients over dp x cp = {plan.dp * plan.cp} ranks with the parameters whole: exported "
            f'as HSDP replicated over dp={plan.dp} and sharded over cp, fsdp_reshard_after_forward "never" (the '
            "parameters gathered once per micro-batch and kept to its backward): its traffic and memory differ from "
            "the plan's"
        )
        return plan.dp, 1, RESHARD_POLICY[False]
    if label == "ddp":
        # torchtitan 0.2's DDP runs alone: its llama3 `parallelize` raises "DDP has not supported > 1D
        # parallelism" when data-parallel replicas combine with TP or PP (0.2.2
        # torchtitan/models/llama3/infra/parallelize.py). 0.3 replicates through fully_shard's replicate
        # mesh dimension with any other axis.
        if version == "0.2" and plan.dp > 1 and (plan.tp > 1 or plan.pp > 1):
            missing = 'DDP with TP or PP (its parallelize raises "DDP has not supported > 1D parallelism")'
            policy = _as_fsdp(plan, "torchtitan 0.2", missing, "", warnings)
            warnings[-1] += "; torchtitan 0.3 replicates them as planned"
            return 1, plan.dp, policy
        return plan.dp, 1, None
    if plan.dp_style is DataParallel.FSDP:
        return plan.dp_replicate, plan.dp_shard, RESHARD_POLICY[plan.reshard_after_forward]
    # ZeRO-1 / ZeRO-2: FSDP over every data-parallel rank, the parameters kept whole from forward to
    # backward or resharded, whichever the plan priced nearer its own style
    policy = _as_fsdp(
        plan, "torchtitan", ZERO_NAMES[plan.dp_style], ", which shards the parameters too", warnings
    )
    return 1, plan.dp, policy


def _expert_parallel(
    plan: Plan, version: str, replicate: int, shard: int, reshard: str | None, warnings: list[str]
) -> tuple[dict[str, object], int, int, str | None]:
    """(the expert-parallel fields, and the data-parallel replicate and shard degrees and reshard policy
    to write) of a plan with ep > 1 (module docstring): the shard degree raised to the least divisor of
    dp holding EP where the exported one does not, with warnings. No fields for ep 1."""
    if plan.ep == 1:
        if plan.num_experts and plan.tp > 1 and plan.expert_tp == 1:
            warnings.append(
                f"the plan keeps the experts whole on every rank (no expert parallelism); torchtitan shards each "
                f"expert over the tp={plan.tp} TP ranks where EP is 1: its expert time and memory differ from the "
                f"plan's (a plan with --expert-tp {plan.tp} is torchtitan's layout)"
            )
        return {}, replicate, shard, reshard
    etp = plan.tp if version == "0.2" and plan.ep_fold == "dp" else 1
    fields: dict[str, object] = {"expert_parallel_degree": plan.ep}
    if version == "0.2":
        fields["expert_tensor_parallel_degree"] = etp
    dense = shard * plan.cp * plan.tp // etp
    if dense % plan.ep:
        dp = replicate * shard
        fits = next(
            d
            for d in range(shard, dp + 1)
            if dp % d == 0 and d % shard == 0 and (d * plan.cp * plan.tp // etp) % plan.ep == 0
        )
        warnings.append(
            f"torchtitan takes its EP ranks from the FSDP shard ranks (and the CP and TP ones): "
            f"data_parallel_shard_degree {shard} x cp {plan.cp} x tp {plan.tp}"
            + (f" / etp {etp}" if etp > 1 else "")
            + f" does not hold ep={plan.ep}; exported as HSDP sharded over {fits} and replicated over {dp // fits} "
            '(fsdp_reshard_after_forward "never": the parameters whole from forward to backward), where the plan '
            f"keeps them as {dp_label(plan)}: its memory and traffic differ from the plan's"
        )
        replicate, shard, reshard = dp // fits, fits, reshard or RESHARD_POLICY[False]
    if plan.ep_fold == "dp" and plan.tp > 1 and plan.expert_tp > 1 and version != "0.2":
        warnings.append(
            f"the plan splits every expert over the tp={plan.tp} TP ranks (expert TP {plan.expert_tp}) with EP over the "
            "data-parallel ranks; torchtitan 0.3 has no expert TP setting and borrows the TP ranks into the EP groups: "
            "each rank holds other experts whole and its all-to-all spans the TP ranks (torchtitan 0.2's "
            f"expert_tensor_parallel_degree {plan.tp} is the plan's layout)"
        )
    if plan.ep_fold == "dp" and plan.tp > 1 and plan.expert_tp == 1:
        how = (
            f"expert_tensor_parallel_degree {plan.tp}: the same EP groups, each expert split over the TP ranks"
            if version == "0.2"
            else "torchtitan 0.3 borrows the TP ranks into the EP groups (no expert TP setting)"
        )
        warnings.append(
            f"the plan replicates the experts over the tp={plan.tp} TP ranks (each runs the same experts on the same "
            f"rows) with EP over the data-parallel ranks; {how}: each rank computes fewer expert rows than the plan priced"
        )
    if plan.ep_fold == "tp":
        warnings.append(
            f"the plan's TP ranks hold the same tokens and all-reduce the experts' outputs; torchtitan's EP over the "
            f"tp={plan.tp} TP ranks dispatches the tokens by all-to-all: its communication differs from the plan's"
        )
    return fields, replicate, shard, reshard


def _as_fsdp(plan: Plan, tool: str, missing: str, extra: str, warnings: list[str]) -> str:
    """The plan's style exported as FSDP over every data-parallel rank, resharded after forward or not,
    whichever the plan priced nearer its own (`nearest_dp_form`): the policy, with its warning appended
    to `warnings` (`dp_substitute_warning`: what `tool` lacks, `missing`; `extra` ends the form's text)."""
    form = nearest_dp_form(plan, ["fsdp-noreshard", "fsdp"], "fsdp-noreshard")
    policy = RESHARD_POLICY[not form.endswith("-noreshard")]
    ranks = (
        f"{plan.dp} data-parallel"
        if plan.cp == 1
        else f"{plan.dp} data-parallel x {plan.cp} context-parallel"
    )
    text = (
        f"FSDP over the {ranks} ranks (data_parallel_shard_degree "
        f'{plan.dp}, fsdp_reshard_after_forward "{policy}"){extra}'
    )
    warnings.append(dp_substitute_warning(plan, tool, missing, form, text))
    return policy


# torchtitan's async TP is an Inductor pass (micro-pipelined all-gather -> matmul and matmul ->
# reduce-scatter on symmetric memory): it runs only with the model compiled, which the export turns on
_ASYNC_TP_NOTE = (
    "the plan overlaps TP communication with its GEMMs: exported as torchtitan's async TP, which runs only "
    "under torch.compile (turned on here); its chunking is Inductor's, not the plan's"
)


def _model_parts(plan: Plan, version: str) -> list[list[str]]:
    """Module FQNs per (virtual) stage: the embedding with the first, the final norm and LM head with
    the last, in the module names of torchtitan `version`'s Llama."""
    chunks = virtual_stage_layers(plan)
    parts = [[f"layers.{i}" for i in layers] for layers in chunks]
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", HEAD_NAMES[version]]
    return parts


def _ac_mode(plan: Plan, warnings: list[str]) -> str:
    """torchtitan checkpoints every layer alike: the strongest recomputation the plan asks for."""
    strongest = strongest_recompute(plan, warnings, "torchtitan")
    return "none" if strongest is None else str(strongest)


def _context_parallel(plan: Plan, version: str, warnings: list[str]) -> dict[str, object]:
    """The parallelism fields of a plan with cp > 1 besides the degree (module docstring), for
    torchtitan `version`, with the warnings for what that release runs otherwise."""
    if plan.cp == 1:
        return {}
    fields: dict[str, object] = {}
    if not plan.cp_load_balance:
        if version == "0.3":
            fields["context_parallel_load_balancer"] = None
        else:
            warnings.append(
                f"the plan cuts each sequence into cp={plan.cp} contiguous chunks (cp_load_balance false); torchtitan "
                '0.2 balances by default (context_parallel_load_balancer "headtail"), and a TOML file cannot turn it '
                "off (None has no TOML form): add --parallelism.context_parallel_load_balancer None to the command line"
            )
    if version == "0.2":
        fields["context_parallel_rotate_method"] = ROTATE_METHODS[plan.cp_comm_type]
    if plan.cp_comm_type == "alltoall":
        warnings.append(
            f"torchtitan has no {ULYSSES}, the plan's cp_comm_type alltoall: exported as all-gather context "
            "parallelism (every rank gathers the K/V of the whole sequence), not what the plan priced"
        )
    elif plan.cp_comm_type == "ring":
        runs = (
            "torchtitan 0.3 has no setting for it: its Llama's FlexAttention all-gathers K/V (flex_cp_allgather; "
            "SDPA runs PyTorch's default rotate method, all-gather)"
            if version == "0.3"
            else 'exported as context_parallel_rotate_method "alltoall" (PyTorch\'s ring rotation), which torchtitan '
            "0.2.2 applies only in its validation loop (components/validate.py): its training steps run PyTorch's "
            "default rotate method, all-gather"
        )
        warnings.append(
            "the plan passes K/V around a ring of the CP ranks under the attention (cp_comm_type ring); "
            f"{runs}, not what the plan priced"
        )
    divisor = 2 * plan.cp * (plan.tp if version == "0.2" or plan.sequence_parallel else 1)
    where = (
        "its llama3 parallelize asserts seq_len % (tp * 2 * cp) == 0"
        if version == "0.2"
        else "its Trainer checks seq_len against 2 * cp, times tp with sequence parallel"
    )
    warnings += cp_sequence_warning(plan, f"torchtitan {version}", divisor, where)
    return fields


def _not_llama_warnings(plan: Plan) -> list[str]:
    """A warning when the plan's dense model is not built as torchtitan's llama3 module builds a layer
    (separate q / k / v projections, a SwiGLU feed-forward of w1, w2, w3), read from the projections'
    roles (`Plan.roles`): GPT-2's fused c_attn and GELU MLP went out as `--module llama3` without a word. The degrees still apply. Nothing for a
    mixture of experts (its own warning) or a plan without roles (written before them)."""
    roles = set(plan.roles.values())
    if not roles or _moe(plan):
        return []
    differs = []
    if "qkv" in roles:
        differs.append("a fused q/k/v projection (llama3 has wq, wk, wv)")
    if {"up", "down"} & roles and "gate" not in roles:
        differs.append("an MLP without a gate (llama3's feed-forward is SwiGLU: w1, w3 and w2)")
    if not differs:
        return []
    return [
        f"the model is not torchtitan's llama3: it has {'; '.join(differs)}. --module llama3 and YOUR_CONFIG do not "
        "describe it: port it as a torchtitan model (a TrainSpec of its own) to train it there; the parallelism "
        "degrees below apply to it"
    ]


def _common(plan: Plan, version: str) -> tuple[dict[str, object], str, dict[str, object], list[str]]:
    """(parallelism fields, activation-checkpoint mode, training fields, warnings) shared by both
    versions' forms."""
    warnings = layout_warnings(plan, TOOL) + language_model_warnings(
        plan, TOOL, f"torchtitan {version}'s model modules (llama3, llama4, qwen3, deepseek_v3)"
    )
    warnings += _not_llama_warnings(plan)
    if _moe(plan):
        warnings.append(
            "a mixture-of-experts model: torchtitan's llama3 module has no experts, so run it with the MoE module of "
            "its family (deepseek_v3, llama4, or qwen3 with its MoE configs) and that module's config in place of "
            "YOUR_MOE_MODULE and YOUR_CONFIG; the expert-parallel degrees below apply to those modules"
        )
    if plan.workload is not Workload.TRAIN:
        warnings.append(
            f"this is a {plan.workload} plan; torchtitan trains (plan with --workload train for its memory "
            "and schedule)"
        )
    replicate, shard, reshard = _data_parallel(plan, version, warnings)
    experts, replicate, shard, reshard = _expert_parallel(plan, version, replicate, shard, reshard, warnings)
    par: dict[str, object] = {
        "tensor_parallel_degree": plan.tp,
        "pipeline_parallel_degree": plan.pp,
        "data_parallel_replicate_degree": replicate,
        "data_parallel_shard_degree": shard,
    }
    if reshard is not None:
        par["fsdp_reshard_after_forward"] = reshard
    par["context_parallel_degree"] = plan.cp
    par.update(_context_parallel(plan, version, warnings))
    par.update(experts)
    if plan.pp > 1:
        par["pipeline_parallel_schedule"] = SCHEDULE_NAMES[plan.schedule]
        par["pipeline_parallel_microbatch_size"] = micro_batch_size(plan)
        par["module_fqns_per_model_part"] = _model_parts(plan, version)
        if plan.workload is Workload.TRAIN and plan.micro_batches > 1:
            warnings.append(
                f"torchtitan's pipeline stages (torch.distributed.pipelining's PipelineStage) keep a receive "
                f"buffer for each of the {plan.micro_batches} micro-batches' activations and output gradients "
                "through the step (pytorch/pytorch#136380): up to 3 x micro-batches x (tokens x hidden) per "
                "stage beyond the plan's memory, which the planner's runtime frees after each micro-batch"
            )
    mode = _ac_mode(plan, warnings)
    if mode == "selective":
        policy = (
            "saves the attention and every other matmul output and recomputes the rest"
            if version == "0.3"
            else "'op' policy: keeps matmul and attention outputs and recomputes the rest"
        )
        warnings.append(
            f"torchtitan's selective checkpointing ({policy}), not Megatron-LM's attention-core recomputation the "
            "plan priced: activation memory differs"
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
        if plan.workload is Workload.TRAIN and plan.dtype == "bf16":
            # FSDP's reduce-scatter dtype (torchtitan's default float32): the one the plan priced
            training["mixed_precision_reduce"] = "float32" if plan.grad_reduce_dtype == "fp32" else "bfloat16"
    else:
        scaled = (
            f", and has no loss scaling (the plan's {loss_scale_text(plan.loss_scale)} is not exported)"
            if plan.workload is Workload.TRAIN and plan.loss_scale is not None
            else ""
        )
        warnings.append(
            f"torchtitan trains in bfloat16 or float32, not {plan.dtype}{scaled}: the file leaves "
            'training.mixed_precision_param unset; set it to "bfloat16" (and plan with --dtype bf16 to price that)'
        )
    if plan.tp > 1 and not any(s.style is SplitStyle.VOCAB for s in plan.splits.values()):
        if version == "0.3":
            warnings.append(
                "torchtitan 0.3 always splits the LM head along the vocabulary under TP (loss parallel); the plan "
                "keeps it whole: its time and memory differ from the prediction"
            )
    return par, mode, training, warnings


def torchtitan_sections(plan: Plan) -> tuple[dict[str, dict[str, object]], list[str]]:
    """torchtitan 0.2: ({section: {field: value}}, warnings), the `[parallelism]`,
    `[activation_checkpoint]` and `[training]` fields the plan decides. Raises InputError when the
    batch does not split into whole micro-batches or the stages do not match `virtual_stages`."""
    par, mode, training, warnings = _common(plan, "0.2")
    par["enable_async_tensor_parallel"] = plan.tp_comm_overlap and plan.tp > 1
    if plan.tp > 1:
        par["disable_loss_parallel"] = not any(s.style is SplitStyle.VOCAB for s in plan.splits.values())
        if not plan.sequence_parallel:
            warnings.append(
                "torchtitan 0.2's tensor parallelism always runs sequence parallel (norms split along the "
                "sequence); the plan priced plain all-reduces (torchtitan 0.3: --parallelism.no_enable_sequence_parallel)"
            )
    ac: dict[str, object] = {"mode": mode}
    if mode == "selective":
        ac["selective_ac_option"] = "op"
    # torchtitan 0.2's fully_shard (and with it mixed precision) runs with data-parallel shards or with CP
    fsdp = par["data_parallel_shard_degree"] != 1 or plan.cp > 1  # type: ignore[comparison-overlap]
    if plan.dtype in ("bf16", "fp16") and (plan.tp > 1 or plan.pp > 1) and not fsdp:
        training["dtype"] = "bfloat16"
        warnings.append(
            f"torchtitan 0.2 applies mixed_precision_param only through FSDP or, without TP and PP, autocast: at "
            f"tp={plan.tp} pp={plan.pp} without data-parallel shards it would train in float32 (its log: "
            f'"{FP32_TRAP}"). Exported with training.dtype = "bfloat16": parameters, gradients and optimizer '
            "state in bf16 without an fp32 master copy (less memory than the plan's mixed precision, other "
            "numerics); to train in float32 instead remove that key; torchtitan 0.3 applies mixed precision here"
        )
    sections: dict[str, dict[str, object]] = {
        "parallelism": par,
        "activation_checkpoint": ac,
        "training": training,
    }
    if par["enable_async_tensor_parallel"]:
        sections["compile"] = {
            "enable": True,
            "components": ["model", "loss"],
        }  # async TP needs the model compiled
        warnings.append(_ASYNC_TP_NOTE)
    return sections, warnings


def torchtitan_overrides(plan: Plan) -> tuple[list[str], list[str]]:
    """torchtitan 0.3: (command-line overrides as argv items, warnings), the `activation-checkpoint:`
    subcommand last. Raises InputError as `torchtitan_sections`."""
    par, mode, training, warnings = _common(plan, "0.3")
    argv: list[str] = []
    for key, value in par.items():
        if key == "module_fqns_per_model_part":
            # tyro reads list[list[str]] as one argument per part, each part's names comma-separated
            argv += [f"--parallelism.{key}", *(",".join(part) for part in value)]  # type: ignore[attr-defined]
        else:
            argv += [f"--parallelism.{key}", str(value)]
    if plan.tp > 1:
        argv.append(
            "--parallelism.enable_sequence_parallel"
            if plan.sequence_parallel
            else "--parallelism.no_enable_sequence_parallel"
        )
    if plan.tp_comm_overlap and plan.tp > 1:  # 0.3: a CompileConfig field; async TP needs the model compiled
        argv += ["--compile.enable", "--compile.enable_async_tensor_parallel"]
        warnings.append(_ASYNC_TP_NOTE)
    for key, value in training.items():
        argv += [f"--training.{key}", str(value)]
    if plan.pp > 1:
        argv.append("--training.disable_cuda_graphs")  # 0.3's Trainer.Config refuses CUDA graphs with PP
    argv.append(f"activation-checkpoint:{mode}")
    return argv, warnings


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


def _moe(plan: Plan) -> bool:
    return bool(plan.num_experts) or plan.ep > 1 or plan.expert_params > 0


def _module(plan: Plan) -> str:
    """The torchtitan model module of the command line: llama3 for a dense model; for a mixture of
    experts a placeholder (torchtitan's llama3 has no experts; its MoE modules are per family:
    deepseek_v3, llama4, qwen3), with a warning (`_common`)."""
    return "YOUR_MOE_MODULE" if _moe(plan) else "llama3"


def _registry_config(plan: Plan) -> str:
    """The torchtitan llama3 config_registry function nearest the planned model, as a suggestion."""
    if _moe(plan):
        return "YOUR_CONFIG"
    name = plan.model.lower().replace("-", "_")
    for size in ("405b", "70b", "8b"):
        if size in name:
            return f"llama3_{size}"
    return "YOUR_CONFIG"


def _export_toml(plan: Plan) -> Export:
    sections, warnings = torchtitan_sections(plan)
    lines = [
        f"# torchtitan 0.2 job config sections for {plan.model} on {plan.cluster} ({plan.workload}, "
        f"{plan.mesh.label()}), written by planner export --to torchtitan --torchtitan-version 0.2.",
        "# Replace the [parallelism] and [activation_checkpoint] sections of your job TOML with these and set",
        f"# the [training] keys below; run on {plan.num_devices} GPUs (NGPU={plan.num_devices}).",
    ]
    for name, fields in sections.items():
        lines += ["", f"[{name}]"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in fields.items()]
    return Export("\n".join(lines) + "\n", warnings)


def _export_overrides(plan: Plan) -> Export:
    argv, warnings = torchtitan_overrides(plan)
    lines = [
        f"# torchtitan 0.3 command-line overrides for {plan.model} on {plan.cluster} ({plan.workload}, "
        f"{plan.mesh.label()}), written by planner export --to torchtitan.",
        f"# Use: source this file, then on each of the {plan.num_devices} GPUs' nodes run, with these last",
        "# (the final activation-checkpoint:... is a subcommand: torchtitan reads only its options after it):",
        f"#   torchrun --nproc_per_node=GPUS_PER_NODE ... -m torchtitan.train --module {_module(plan)} "
        f'--config {_registry_config(plan)} YOUR_OTHER_OVERRIDES "${{PLANNER_TORCHTITAN_ARGS[@]}}"',
        "# keep your model, tokenizer, data and optimizer settings (and drop your own copies of these).",
        "PLANNER_TORCHTITAN_ARGS=(",
    ]
    pairs: list[list[str]] = []
    for item in argv:
        if item.startswith("--") or item.startswith("activation-checkpoint:") or not pairs:
            pairs.append([item])
        else:
            pairs[-1].append(item)
    lines += ["    " + " ".join(shlex.quote(x) for x in pair) for pair in pairs]
    lines.append(")")
    return Export("\n".join(lines) + "\n", warnings)


def export_torchtitan(plan: Plan, version: str = DEFAULT_VERSION) -> Export:
    """The export for torchtitan `version` (module docstring): 0.3's overrides as a bash array, or
    0.2's TOML sections, with the warnings. InputError for a version not in VERSIONS."""
    if check_version(version) == "0.2":
        return _export_toml(plan)
    return _export_overrides(plan)

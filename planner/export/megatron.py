"""`planner export --to megatron`: the plan as Megatron-LM command-line arguments.

The output is a bash file defining one array, `PLANNER_MEGATRON_ARGS`, to add to a `pretrain_gpt.py`
command line (`"${PLANNER_MEGATRON_ARGS[@]}"`); the model's size, tokenizer, data and optimizer
arguments stay the user's. Argument names are Megatron-LM's (`megatron/training/arguments.py`, and
the dataclass fields it turns into options: `ModelParallelConfig`, `TransformerConfig`,
`TrainingConfig`):

| plan                                   | Megatron-LM                                                        |
|----------------------------------------|--------------------------------------------------------------------|
| mesh.tp, mesh.pp                       | --tensor-model-parallel-size, --pipeline-model-parallel-size       |
| mesh.cp (> 1)                          | --context-parallel-size                                            |
| cp_comm_type ring / allgather /        | --cp-comm-type p2p / all_gather / a2a                              |
|   alltoall                             |                                                                    |
| cp_load_balance off                    | none: Megatron always balances (a warning)                         |
| mesh.dp                                | (derived by Megatron: world size / (tp * cp * pp))                 |
| stages, even, virtual_stages v         | --num-layers-per-virtual-pipeline-stage (layers per model chunk)   |
| stages, uneven                         | --pipeline-model-parallel-layout "Et*17|t*15L" (exact, any v)      |
| sequence_parallel (tp > 1)             | --sequence-parallel                                                |
| tp_comm_overlap (tp > 1, with SP)      | --tp-comm-overlap (without SP: not exported, a warning)            |
| recompute full / selective             | --recompute-granularity full --recompute-method uniform            |
|                                        | --recompute-num-layers 1 / --recompute-granularity selective       |
| dp_style ddp                           | (none: Megatron's DDP)                                             |
| dp_style zero1                         | --use-distributed-optimizer                                        |
| dp_style zero2                         | --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads  |
| dp_style fsdp (dp_shard = dp)          | --use-megatron-fsdp --data-parallel-sharding-strategy              |
|                                        | optim_grads_params                                                 |
|   with zero2 / fsdp                    | --use-distributed-optimizer --ckpt-format fsdp_dtensor (asserted   |
|                                        | by validate_args), CUDA_DEVICE_MAX_CONNECTIONS unset               |
| HSDP (dp_shard S < dp, R = dp / S)     | the fsdp arguments + --num-distributed-optimizer-instances R       |
| reshard_after_forward off (fsdp)       | no Megatron-FSDP form (optim_grads_params always reshards): fsdp   |
|                                        | resharded or zero2 (optim_grads), whichever the plan priced nearer |
| overlap_grad_reduce; fsdp / hsdp       | --overlap-grad-reduce                                              |
| grad_reduce_dtype fp32 (bf16 training) | Megatron-LM's default (fp32 main_grad); param: a warning (below)   |
| overlap_param_gather; fsdp / hsdp      | --overlap-param-gather                                             |
| batch / dp / micro_batches, batch      | --micro-batch-size, --global-batch-size                            |
| dtype bf16 / fp16                      | --bf16 / --fp16 (fp32: none)                                       |
| loss_scale (fp16 training)             | dynamic: --initial-loss-scale 65536 --loss-scale-window 2000       |
|                                        | --hysteresis 1 (torch.amp.GradScaler's policy, which the run       |
|                                        | uses); N: --loss-scale N; null: --loss-scale 1 (none)              |
| num_experts (a MoE model)              | --num-experts, --expert-model-parallel-size ep,                    |
|                                        | --expert-tensor-parallel-size expert_tp (1, or tp: split experts)  |
| moe_top_k                              | --moe-router-topk                                                  |
| moe_score_function softmax / sigmoid   | --moe-router-score-function softmax / sigmoid                      |
| moe_topk_renormalised false (softmax)  | --moe-router-pre-softmax (always at top-1: Megatron requires it)   |
| moe_expert_intermediate_size           | --moe-ffn-hidden-size                                              |
| moe_shared_intermediate_size (> 0)     | --moe-shared-expert-intermediate-size (0, no shared expert: none)  |
| moe_shared_expert_gate                 | a warning: set Megatron-Core's moe_shared_expert_gate              |
| moe_probs_on_input (Llama 4)           | --moe-apply-probs-on-input (top-1 only in Megatron: else a warning)|
| moe_layers (dense and MoE layers mixed)| --moe-layer-freq '([0]*3+[1]*58)' (DeepSeek-V3's first 3 dense)    |
|   each unknown (0, "", None)           | none, a warning naming the option to set                           |
| ep > 1                                 | --moe-token-dispatcher-type alltoall (dropless, as the runtime's)  |
| moe_capacity_factor                    | --moe-expert-capacity-factor                                       |
| seq_len, layers                        | --seq-length, --num-layers                                         |
| mesh.tp or mesh.cp > 1, no             | export CUDA_DEVICE_MAX_CONNECTIONS=1 (environment)                 |
|   Megatron-FSDP                        |                                                                    |

Megatron-LM's `validate_args` (Megatron-Core 0.19.2, PyPI `megatron-core==0.19.2`,
`megatron/training/arguments.py`) asserts `CUDA_DEVICE_MAX_CONNECTIONS=1` when the tensor- (or
context-) parallel size is above 1 on GPUs before Blackwell (compute capability < 10) and FSDP is
off: its TP communication overlap relies on one hardware queue. The file exports it with TP > 1.
With Megatron-FSDP (`--use-megatron-fsdp`; 0.19 has no `--use-custom-fsdp` option any more, it sets
`use_custom_fsdp` itself) the same function asserts the opposite (not 1) and
`--ckpt-format fsdp_dtensor`, so the file unsets the variable instead.

Context parallelism (`mesh.cp` > 1): `--context-parallel-size` and `--cp-comm-type`, whose values are
Transformer Engine's names as `TransformerConfig.cp_comm_type` documents them
(`megatron/core/transformer/transformer_config.py`: "p2p" passes K/V chunks around a ring under the
attention, the plan's ring; "all_gather" gathers every rank's K/V before it, the plan's allgather;
"a2a" swaps tokens for heads as DeepSpeed Ulysses does, the plan's alltoall). Megatron's world size is
tp * cp * pp * dp (`validate_args` divides it by tp * pp * cp for the data-parallel size) and its
gradient reduction and distributed optimizer span the dp x cp ranks, as the plan's do. Its batches
are always cut for causal load balancing (`megatron/core/utils.py` `get_batch_on_this_cp_rank`: 2 x cp
chunks, rank r holding r and 2cp-1-r, as the plan's `cp_load_balance`), with no option to cut them
contiguously, and `validate_args` asserts the sequence length a multiple of 2 x cp: a plan without
load balancing is exported with a warning.

Expert parallelism (`Plan.ep`, a mixture-of-experts model): Megatron-Core builds a second mesh for
the experts over the same tp x cp x dp ranks ("parallel folding": `megatron/core/parallel_state.py`,
the expert rank generator's tp-ep-dp-pp order, expert tensor parallelism innermost), of expert-TP x
EP x expert-DP, its expert TP `Plan.expert_tp`. Over dp (`ep_fold` "dp") at tp 1 that is the plan's
layout (EP groups of ep consecutive data-parallel ranks, the tokens exchanged by the all-to-all
dispatcher); at tp > 1 with the experts split over the TP ranks (expert_tp = tp) it is too (Megatron's
expert TP groups are the TP groups, innermost, and its EP groups ep data-parallel ranks of one TP rank,
tp apart, as the plan's); at tp > 1 with expert_tp 1 the plan's EP groups take one rank of each TP
group and every TP rank runs the same experts on the same rows, where Megatron's (expert TP 1, its EP
groups of consecutive ranks, across the TP ranks) hold different experts on each TP rank: no exact
equivalent, exported as that with a warning. Over tp (`ep_fold` "tp", ep = tp) Megatron's EP groups
are the TP groups, as the plan's, but it dispatches the tokens by all-to-all where the plan's TP ranks
hold the same tokens and all-reduce the experts' outputs; in training its MoE layer wants sequence
parallelism with TP (`megatron/core/transformer/moe/moe_layer.py` raises without it). `validate_args`
asserts --num-experts divisible by --expert-model-parallel-size.

Routing (`Plan.moe_top_k`, `moe_score_function`, `moe_expert_intermediate_size`,
`moe_shared_intermediate_size`; `megatron/training/arguments.py` `_add_moe_args`): Megatron-Core
routes each token to --moe-router-topk experts (default 2) by --moe-router-score-function scores
(default softmax), its experts --moe-ffn-hidden-size wide (default --ffn-hidden-size), with a shared
expert only when --moe-shared-expert-intermediate-size is set: the file sets each as the model has it,
so that Megatron runs the experts and exchanges the top_k x tokens rows the plan priced. Its softmax
router takes the top-k of the logits and the softmax over the k chosen ones: it chooses the experts a
softmax-then-top-k router chooses and weighs them as one that renormalises the k weights does
(Mixtral's, `Plan.moe_topk_renormalised`). A model that weighs each chosen expert by its softmax over
all experts as it is (Switch's top-1, Qwen-MoE with norm_topk_prob false) gets --moe-router-pre-softmax
(`megatron/core/transformer/moe/moe_utils.py`, `topk_routing_with_score_function`: the top-k of the
softmax, not renormalised). Megatron's sigmoid router always renormalises k > 1 chosen scores: a
sigmoid model that does not is exported with a warning.

Data parallelism (`Plan.dp_style`, the ZeRO stages as Megatron-Core's
`--data-parallel-sharding-strategy` names them): ZeRO-1 is Megatron's distributed optimizer; ZeRO-2
and FSDP are Megatron-FSDP with `optim_grads` / `optim_grads_params`; HSDP is Megatron-FSDP with
`--num-distributed-optimizer-instances R`: the DP ranks split into R instances of dp / R consecutive
ranks (`parallel_state`'s intra-partial data-parallel groups, the plan's shard groups), sharded inside
each and replicated across them (`--outer-dp-sharding-strategy no_shard`, the default; its
`mcore_fsdp_adapter` turns HSDP on when the instances are above 1). Megatron-FSDP frees each unit's
gathered parameters after its forward, with no option to keep them: a plan without reshard after
forward is exported as its resharded style or as ZeRO-2 (the parameters whole through the step), the
one the plan's "data-parallel" decision priced nearer, with a warning giving both prices. Megatron-FSDP
keeps gradients in the parameters' dtype (`--megatron-fsdp-main-grads-dtype auto`), as the plan does;
the fp32 main-gradient warning is for Megatron's DDP and distributed optimizer.
"""

from __future__ import annotations

import shlex

from planner.export.common import (
    Export,
    cp_sequence_warning,
    device_factors,
    dp_label,
    dp_substitute_warning,
    language_model_warnings,
    layout_warnings,
    micro_batch_size,
    nearest_dp_form,
    num_layers,
    stage_sizes_text,
    strongest_recompute,
    uneven_stages,
    virtual_stage_layers,
)
from planner.plan import (
    DYNAMIC_INIT_SCALE,
    DYNAMIC_LOSS_SCALE,
    GROWTH_INTERVAL,
    Plan,
    Recompute,
    Schedule,
    Workload,
)

TOOL = "Megatron-LM"
# Plan.cp_comm_type -> --cp-comm-type (TransformerConfig.cp_comm_type: Transformer Engine's names)
CP_COMM_TYPES = {"ring": "p2p", "allgather": "all_gather", "alltoall": "a2a"}


def megatron_environment(plan: Plan) -> dict[str, str]:
    """Environment variables Megatron-LM's validation needs for the plan (module docstring): none with
    Megatron-FSDP, whose validation asserts CUDA_DEVICE_MAX_CONNECTIONS is not 1 (the file unsets it)."""
    if uses_megatron_fsdp(megatron_dp_form(plan, [])):
        return {}
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if plan.tp > 1 or plan.cp > 1 else {}


def megatron_args(plan: Plan) -> tuple[list[str], list[str]]:
    """(Megatron-LM arguments as argv items, warnings). Raises InputError when the batch does not
    split into whole micro-batches or the stages do not match `virtual_stages`."""
    warnings = layout_warnings(plan, TOOL) + language_model_warnings(
        plan, TOOL, "Megatron-LM's pretrain_gpt.py"
    )
    if plan.workload is not Workload.TRAIN:
        warnings.append(
            f"this is a {plan.workload} plan; Megatron-LM's pretraining arguments describe a training step "
            "(plan with --workload train for its memory and schedule)"
        )
    args = [
        "--tensor-model-parallel-size", str(plan.tp),
        "--pipeline-model-parallel-size", str(plan.pp),
        *_context_parallel_args(plan, warnings),
        "--num-layers", str(num_layers(plan)),
        "--seq-length", str(plan.seq_len),
        "--micro-batch-size", str(micro_batch_size(plan)),
        "--global-batch-size", str(plan.batch_size),
    ]  # fmt: skip
    args += _pipeline_args(plan, warnings)
    args += _expert_args(plan, warnings)
    if plan.sequence_parallel and plan.tp > 1:
        args.append("--sequence-parallel")
    args += _tp_overlap_args(plan, warnings)
    args += _recompute_args(plan, warnings)
    form = megatron_dp_form(plan, warnings)
    args += _dp_args(plan, form)
    if plan.workload is Workload.TRAIN and plan.dp * plan.cp > 1:
        # Megatron-FSDP prefetches and reduces unit by unit as the plan prices FSDP; the rest as planned
        fsdp = form.startswith(("fsdp", "hsdp"))
        if plan.overlap_grad_reduce or fsdp:
            args.append("--overlap-grad-reduce")
        if (plan.overlap_param_gather and form != "ddp") or fsdp:
            args.append("--overlap-param-gather")
    if plan.dtype == "bf16":
        args.append("--bf16")
    elif plan.dtype == "fp16":
        args.append("--fp16")
        if plan.workload is Workload.TRAIN:
            args += _loss_scale_args(plan.loss_scale)
    if (
        plan.workload is Workload.TRAIN
        and plan.dtype == "bf16"
        and plan.grad_reduce_dtype != "fp32"
        and not uses_megatron_fsdp(form)
    ):
        warnings.append(_main_grads_warning(plan))
    if plan.workload is Workload.TRAIN and plan.grad_reduce_dtype == "fp32" and uses_megatron_fsdp(form):
        warnings.append(
            "Megatron-FSDP keeps the gradients in the parameters' dtype, and the plan priced fp32 gradients "
            "(--grad-reduce-dtype fp32): this run reduces half the gradient bytes and holds 2 bytes less per "
            "parameter than predicted; plan without --grad-reduce-dtype fp32 to price it"
        )
    if uses_megatron_fsdp(form) and (plan.tp > 1 or plan.cp > 1):
        comm, axes = ("TP", "TP > 1") if plan.cp == 1 else ("TP and CP", "TP or CP > 1")
        warnings.append(
            "Megatron-FSDP needs CUDA_DEVICE_MAX_CONNECTIONS unset or above 1 (validate_args asserts it; the file "
            f"unsets it), where Megatron-LM's {comm} communication overlap wants 1: with {axes} its validate_args "
            "warns that the two overlap less well together"
        )
    return args, warnings


def _context_parallel_args(plan: Plan, warnings: list[str]) -> list[str]:
    """--context-parallel-size and --cp-comm-type for a plan with cp > 1 (module docstring), with the
    warnings for what Megatron-LM runs otherwise: its batches always cut for causal load balancing,
    its sequence length a multiple of 2 x cp."""
    if plan.cp == 1:
        return []
    if not plan.cp_load_balance:
        warnings.append(
            f"the plan cuts each sequence into cp={plan.cp} contiguous chunks (cp_load_balance false); Megatron-LM "
            "always balances causal context parallelism, with no option to turn it off (get_batch_on_this_cp_rank "
            "cuts 2 x cp chunks, rank r holding r and 2cp-1-r): every rank does the same attention work there, its "
            "step time differs from the plan's"
        )
    warnings += cp_sequence_warning(
        plan, TOOL, 2 * plan.cp, "validate_args: seq-length a multiple of 2 * context-parallel-size"
    )
    return ["--context-parallel-size", str(plan.cp), "--cp-comm-type", CP_COMM_TYPES[plan.cp_comm_type]]


def _expert_args(plan: Plan, warnings: list[str]) -> list[str]:
    """--num-experts and the expert mesh of a mixture-of-experts plan (module docstring), with the
    warnings for what Megatron-Core runs otherwise; [] for a dense model's plan."""
    if plan.num_experts == 0 and plan.ep == 1:
        return []
    args = ["--num-experts", str(plan.num_experts)] if plan.num_experts else []
    if not plan.num_experts:
        warnings.append(
            "the plan does not record one expert count for the model (planned before it did, or layers with different "
            "counts): add --num-experts yourself"
        )
    args += _routing_args(plan, warnings)
    if plan.moe_layers:  # dense layers among the MoE ones (Megatron-LM's default: every layer a MoE)
        args += ["--moe-layer-freq", moe_layer_freq(plan.moe_layers)]
    args += [
        "--expert-model-parallel-size",
        str(plan.ep),
        "--expert-tensor-parallel-size",
        str(plan.expert_tp),
    ]
    if plan.ep > 1:
        args += ["--moe-token-dispatcher-type", "alltoall"]
    if plan.moe_capacity_factor is not None:
        args += ["--moe-expert-capacity-factor", f"{plan.moe_capacity_factor:g}"]
    if plan.experts_on_sequence_shard:  # each TP rank's sequence shard through whole experts: Megatron's too
        warnings.append(
            f"the plan's EP groups are {plan.ep} data-parallel ranks of one TP rank, and its expert gradients are "
            f"reduced over the other {plan.cp * plan.dp // plan.ep} ranks holding the same experts and their "
            f"tp={plan.tp} TP ranks; Megatron-Core's parallel folding with --expert-tensor-parallel-size 1 makes its "
            f"EP groups of {plan.ep} consecutive ranks across the TP ranks instead: the same experts per rank, rows "
            f"(each TP rank's sequence shard) and expert data-parallel size ({plan.tp * plan.cp * plan.dp // plan.ep}), "
            "its all-to-all over other ranks than the plan priced"
        )
    elif plan.ep > 1 and plan.ep_fold == "dp" and plan.tp > 1 and plan.expert_tp == 1:
        warnings.append(
            f"the plan's EP groups are {plan.ep} data-parallel ranks of one TP rank, its experts replicated over the "
            f"tp={plan.tp} TP ranks (each runs the same experts on the same rows); Megatron-Core has no such layout: "
            f"exported as its parallel folding with --expert-tensor-parallel-size 1, whose EP groups are {plan.ep} "
            f"consecutive ranks across the TP ranks and whose expert data-parallel size is "
            f"{plan.tp * plan.cp * plan.dp // plan.ep} (the plan's: {plan.cp * plan.dp // plan.ep}): each rank holds "
            "other experts and computes fewer rows than the plan priced, and its all-to-all spans the TP ranks; "
            f"a plan with --expert-tp {plan.tp} (each expert split over the TP ranks) exports exactly"
        )
    if plan.ep > 1 and plan.ep_fold == "tp":
        warnings.append(
            f"the plan splits the experts over the tp={plan.tp} TP ranks, which hold the same tokens, and all-reduces "
            "the experts' outputs; Megatron-Core's EP groups are the same ranks (--expert-tensor-parallel-size 1, "
            "--expert-model-parallel-size = tp) but its dispatcher sends the tokens by all-to-all: its "
            "communication differs from the plan's"
        )
    if plan.tp > 1 and not plan.sequence_parallel and plan.workload is Workload.TRAIN:
        warnings.append(
            "Megatron-Core's MoE layer refuses training with tensor parallelism and no sequence parallelism "
            "(moe_layer.py: 'performance may degrade if MoE and tensor parallelism are enabled without also "
            "enabling sequence parallelism'): add --sequence-parallel, which the plan did not price"
        )
    return args


def moe_layer_freq(pattern: list[int]) -> str:
    """Megatron-LM's --moe-layer-freq list expression of a per-layer pattern (1: MoE, 0: dense), runs
    written out: [0, 0, 0, 1, ..., 1] (3 + 58) -> "([0]*3+[1]*58)" (`megatron/training/arguments.py`
    moe_freq_type evaluates it; its length must be --num-layers)."""
    runs: list[list[int]] = []
    for x in pattern:
        if runs and runs[-1][0] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, 1])
    return "(" + "+".join(f"[{x}]*{n}" for x, n in runs) + ")"


def _routing_args(plan: Plan, warnings: list[str]) -> list[str]:
    """The routing the plan was priced with, as Megatron-Core's router options (module docstring):
    --moe-router-topk, --moe-router-score-function, --moe-ffn-hidden-size and, with shared experts,
    --moe-shared-expert-intermediate-size. A value the plan does not record (planned before it did, MoE
    layers that differ, a router whose scores the analysis could not read) is left out, with one warning
    naming each option to set, since Megatron's default would route otherwise."""
    args: list[str] = []
    missing: list[str] = []
    if plan.moe_top_k:
        args += ["--moe-router-topk", str(plan.moe_top_k)]
    else:
        missing.append("--moe-router-topk (Megatron's default: 2)")
    if plan.moe_score_function:
        args += ["--moe-router-score-function", plan.moe_score_function]
    else:
        missing.append("--moe-router-score-function (softmax, Megatron's default, or sigmoid)")
    if plan.moe_score_function == "softmax" and plan.moe_top_k == 1:
        # Megatron-Core refuses top-1 softmax routing without it (TransformerConfig.__post_init__: a softmax
        # over one chosen logit would give the router no gradient)
        args.append("--moe-router-pre-softmax")
        if plan.moe_topk_renormalised:
            warnings.append(
                "the model weighs its one chosen expert by 1 (its top-1 weight renormalised), while Megatron-Core "
                "requires --moe-router-pre-softmax at top-1 and weighs it by its softmax probability over all the "
                "experts: Megatron's expert outputs are scaled otherwise than the model's"
            )
    elif plan.moe_topk_renormalised is False and plan.moe_score_function == "softmax" and plan.moe_top_k:
        args.append("--moe-router-pre-softmax")  # each expert weighed by its softmax over all E, as the model
    elif plan.moe_topk_renormalised is False and plan.moe_score_function == "sigmoid" and plan.moe_top_k > 1:
        warnings.append(
            f"the model weighs each of its {plan.moe_top_k} chosen experts by its sigmoid score as it is, while "
            "Megatron-Core's sigmoid router renormalises the chosen scores to sum to 1 (no option turns that "
            "off): Megatron's experts are weighed otherwise than the model's"
        )
    elif plan.moe_topk_renormalised is None and plan.moe_score_function == "softmax":
        missing.append(
            "--moe-router-pre-softmax if the model weighs each chosen expert by its softmax over all the experts "
            "without renormalising the chosen weights (Megatron's default renormalises them)"
        )
    if plan.moe_expert_intermediate_size:
        args += ["--moe-ffn-hidden-size", str(plan.moe_expert_intermediate_size)]
    else:
        missing.append("--moe-ffn-hidden-size (Megatron's default: --ffn-hidden-size)")
    if plan.moe_shared_intermediate_size is None:
        missing.append(
            "--moe-shared-expert-intermediate-size if the model has shared experts (default: none)"
        )
    elif plan.moe_shared_intermediate_size:
        args += ["--moe-shared-expert-intermediate-size", str(plan.moe_shared_intermediate_size)]
    if plan.moe_probs_on_input:
        args.append("--moe-apply-probs-on-input")  # Llama 4: the routing weights scale the experts' inputs
        if plan.moe_top_k != 1:
            warnings.append(
                f"the model scales the experts' inputs by its routing weights at top-{plan.moe_top_k}; "
                "Megatron-Core's --moe-apply-probs-on-input requires --moe-router-topk 1 and refuses the run"
            )
    if plan.moe_shared_intermediate_size and plan.moe_shared_expert_gate:
        warnings.append(
            "the model scales its shared expert's output by a sigmoid gate of one output per token (Qwen2-MoE's "
            "shared_expert_gate); Megatron-Core builds that gate only with its TransformerConfig field "
            "moe_shared_expert_gate set (--moe-shared-expert-gate where your release's parser has it): without it "
            "Megatron-LM trains an ungated shared expert, another model"
        )
    warnings.append(
        "routing the plan does not read from the model is left at Megatron-LM's defaults: a scale on the routing "
        "weights (--moe-router-topk-scaling-factor), group-limited routing (--moe-router-num-groups, "
        "--moe-router-group-topk), a learned expert bias (--moe-router-enable-expert-bias) and the load-balancing "
        "loss (--moe-router-load-balancing-type, --moe-aux-loss-coeff): add those your model uses"
    )
    if missing:
        warnings.append(
            "the plan does not record how the model's experts route (planned before it did, MoE layers that "
            "differ, or a router the analysis could not read): Megatron-LM routes with its defaults unless you add "
            + "; ".join(missing)
        )
    return args


def _tp_overlap_args(plan: Plan, warnings: list[str]) -> list[str]:
    """--tp-comm-overlap for a plan that overlaps its TP communication (`Plan.tp_comm_overlap`).
    Megatron-LM's validate_args asserts --sequence-parallel with it (Transformer Engine's userbuffers
    overlap the all-gather and reduce-scatter of sequence parallelism); a plan overlapping the
    all-reduce form is exported without it, with a warning giving the hidden time."""
    if not plan.tp_comm_overlap or plan.tp == 1:
        return []
    if plan.sequence_parallel:
        return ["--tp-comm-overlap"]
    warnings.append(
        "the plan overlaps its TP all-reduces with the GEMMs beside them without sequence parallelism, which "
        "Megatron-LM's --tp-comm-overlap does not do (it needs --sequence-parallel): exported without it, "
        f"{plan.predicted.overlapped_comm_s * 1e3:.4g} ms per step the plan hides is exposed there; plan with "
        "--sequence-parallel on to export it"
    )
    return []


def megatron_dp_form(plan: Plan, warnings: list[str]) -> str:
    """The data-parallel style Megatron-LM runs for the plan, as `dp_label` names it: the plan's, but
    for FSDP without reshard after forward, which Megatron-FSDP does not have (it frees each unit's
    parameters after its forward under optim_grads_params): FSDP with it or ZeRO-2 (optim_grads, the
    parameters whole), the one the plan priced nearer, with a warning."""
    label = dp_label(plan)
    if not label.endswith("-noreshard"):
        return label
    resharded = label.removesuffix("-noreshard")
    candidates = [resharded] + (["zero2"] if plan.dp_shard == plan.dp else [])
    form = nearest_dp_form(plan, candidates, resharded)
    settings = " ".join(_dp_args(plan, form))
    warnings.append(
        dp_substitute_warning(
            plan,
            TOOL,
            "FSDP without reshard after forward (Megatron-FSDP's optim_grads_params frees each unit's "
            "parameters after its forward and gathers them again for its backward)",
            form,
            settings,
        )
    )
    return form


def uses_megatron_fsdp(form: str) -> bool:
    """Whether Megatron-LM runs data-parallel style `form` (a `dp_label`) with Megatron-FSDP."""
    return form == "zero2" or form.startswith(("fsdp", "hsdp"))


def _dp_args(plan: Plan, form: str) -> list[str]:
    """Megatron-LM's arguments for data-parallel style `form` (a `dp_label`; module docstring)."""
    if form == "ddp":
        return []
    if form == "zero1":
        return ["--use-distributed-optimizer"]
    strategy = "optim_grads" if form == "zero2" else "optim_grads_params"
    args = [
        "--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy, "--use-distributed-optimizer",
        "--ckpt-format", "fsdp_dtensor",
    ]  # fmt: skip
    if form.startswith("hsdp"):
        # HSDP: the distributed optimizer (and Megatron-FSDP's shards) over dp / instances consecutive DP
        # ranks, replicated over the instances (--outer-dp-sharding-strategy no_shard, the default)
        args += ["--num-distributed-optimizer-instances", str(plan.dp_replicate)]
    return args


def _loss_scale_args(loss_scale: float | str | None) -> list[str]:
    """Megatron-LM's loss-scaling arguments for a plan's fp16 training (`Plan.loss_scale`). Megatron's
    own dynamic defaults differ (--initial-loss-scale 2**32, --loss-scale-window 1000, --hysteresis 2):
    the plan's policy, torch.amp.GradScaler's, is written out. Without loss scaling, a static scale of 1
    (Megatron has no "off": no --loss-scale means dynamic)."""
    if loss_scale is None:
        return ["--loss-scale", "1"]
    if loss_scale == DYNAMIC_LOSS_SCALE:
        return [
            "--initial-loss-scale", str(int(DYNAMIC_INIT_SCALE)), "--loss-scale-window", str(GROWTH_INTERVAL),
            "--hysteresis", "1",
        ]  # fmt: skip
    return ["--loss-scale", f"{float(loss_scale):g}"]


def _main_grads_warning(plan: Plan) -> str:
    """Megatron-LM's --bf16 keeps fp32 main gradients (its --accumulate-allreduce-grads-in-fp32 is on
    for bf16), 2 bytes per parameter more than the plan's 16-bit gradients (a plan made with
    --grad-reduce-dtype param: priced, and run here, in the parameters' dtype, as ZeRO's 16-byte
    mixed-precision count does)."""
    # a rank's share of the parameters, bytes: the dense ones split over tp x pp, the routed experts over
    # ep x expert_tp x pp (whole at expert TP 1)
    dense = plan.model_params - plan.expert_params
    extra = 2.0 * (dense / (plan.tp * plan.pp) + plan.expert_params / (plan.ep * plan.expert_tp * plan.pp))
    peak = plan.predicted.peak_memory_bytes + extra
    cluster = plan.saved_cluster()
    of_device = ""
    if cluster is not None:
        over = peak > cluster.device.memory_bytes
        of_device = f" of the device's {cluster.device.memory_bytes / 2**30:.1f} GiB" + (
            ", over it" if over else ""
        )
    return (
        f"Megatron-LM with --bf16 accumulates and reduces gradients in fp32 (main_grad): about "
        f"{extra / 2**30:.1f} GiB more per rank than the plan's 16-bit gradients (a peak near {peak / 2**30:.1f} "
        f"GiB{of_device}) and twice the gradient bytes to reduce. Plan again with --grad-reduce-dtype fp32 to "
        "price both: the search then picks a layout that fits them (more pipeline stages"
        + ("" if plan.distributed_optimizer else ", the distributed optimizer")
        + ", ...)"
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
        f"{plan.mesh.label()}), written by planner export --to megatron.",
        f"# Launch {plan.num_devices} processes ({device_factors(plan)}): Megatron-LM derives the data-parallel "
        f"size {plan.dp} from the world size.",
        '# Use: source this file, then add "${PLANNER_MEGATRON_ARGS[@]}" to the pretrain_gpt.py command line;',
        "# keep your model-size, tokenizer, data and optimizer arguments (and drop your own copies of these).",
    ]
    env = megatron_environment(plan)
    if env:
        axes = "TP" if plan.cp == 1 else "TP or CP"
        lines += [
            f"# Megatron-LM's validate_args requires this with {axes} > 1 on GPUs before Blackwell ({axes} comm overlap",
            "# relies on one hardware queue; harmless on Blackwell, where it is no longer checked):",
        ]
        lines += [f"export {key}={shlex.quote(value)}" for key, value in env.items()]
    elif uses_megatron_fsdp(megatron_dp_form(plan, [])):
        lines += [
            "# Megatron-FSDP: validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS is unset or above 1:",
            "unset CUDA_DEVICE_MAX_CONNECTIONS",
        ]
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

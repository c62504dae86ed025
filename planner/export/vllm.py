"""`planner export --to vllm`: the plan as vLLM engine arguments.

The output is a Python file holding `ENGINE_ARGS`, a dict of `vllm.EngineArgs` fields
(`vllm/engine/arg_utils.py`) for `vllm.LLM(**ENGINE_ARGS)`, and `SERVE_COMMAND`, the same as a
`vllm serve` command line (also in its docstring, to copy into a shell):

| plan                                  | vLLM                                                               |
|---------------------------------------|--------------------------------------------------------------------|
| mesh.tp, mesh.pp, mesh.dp             | tensor_parallel_size, pipeline_parallel_size, data_parallel_size  |
| dtype bf16 / fp16 / fp32              | dtype "bfloat16" / "float16" / "float32"                           |
| serving.cache_len (else context+seq)  | max_model_len                                                      |
| batch / dp                            | max_num_seqs                                                       |
| uneven stages                         | environment VLLM_PP_LAYER_PARTITION="17,15"                        |
| ep > 1 (a MoE model)                  | enable_expert_parallel (serve: --enable-expert-parallel)           |

Expert parallelism: with `enable_expert_parallel` vLLM splits every MoE layer's experts over all
tensor_parallel_size x data_parallel_size ranks of the model, expert TP 1 (vLLM's
`FusedMoEParallelConfig.make`, `vllm/model_executor/layers/fused_moe/config.py`: "ep_size = dp_size *
tp_size"). A plan with EP over tp at dp 1, or over dp at tp 1 with ep = dp, is that layout; another ep
(a part of the ranks, or over dp with the experts replicated over TP) has no vLLM form: exported as
EP over all of them, with a warning. A plan without EP (the experts whole on every rank) exports no
flag: vLLM then splits each expert tensor-parallel over the TP ranks instead, also with a warning.

vLLM loads a Hugging Face checkpoint, not a model file: `model` is the `--model` given to the export,
else a placeholder to replace. A training plan is refused (vLLM serves), and so is a plan with
context parallelism (`mesh.cp` > 1: a prefill plan; decode plans never have it). vLLM 0.34.0's
prefill context parallelism (`--prefill-context-parallel-size`, `ParallelConfig` in
`vllm/config/parallel.py`) runs only where the attention implementation supports it, which among
its attention classes only MLA's does (`vllm/v1/attention/backend.py`: `AttentionImpl.supports_pcp`
False, `MLAAttentionImpl.supports_pcp` True; the backend selector reports "PCP not supported"
otherwise), and it keeps the KV cache whole on every PCP rank: the multi-head and grouped-query
attention of the models this planner captures have no form of the plan's sequence split there.
"""

from __future__ import annotations

import shlex

from planner.errors import InputError
from planner.export.common import Export, layout_warnings, stage_sizes_text, uneven_stages
from planner.plan import Plan, Workload

TOOL = "vLLM"
# why a plan with cp > 1 is refused (module docstring)
CP_REFUSAL = (
    "vLLM has no context parallelism for this model's prefill: its --prefill-context-parallel-size runs only "
    "with MLA attention (DeepSeek-style; its other attention backends report 'PCP not supported') and keeps the KV "
    "cache whole on every rank"
)
MODEL_PLACEHOLDER = "HF_MODEL_ID_OR_CHECKPOINT_DIR"
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def max_model_len(plan: Plan) -> int:
    """Tokens per sequence the engine must hold: the request's cache, else context + new tokens."""
    if plan.serving is not None:
        return plan.serving.cache_len
    return plan.context + plan.seq_len


def vllm_engine_args(
    plan: Plan, model: str | None = None
) -> tuple[dict[str, object], dict[str, str], list[str]]:
    """(engine args as `vllm.EngineArgs` names, environment variables, warnings).

    model: the Hugging Face id or checkpoint folder vLLM serves (None: a placeholder, with a warning).
    Raises InputError for a training plan, a model that does not read token ids or a plan with context
    parallelism (`CP_REFUSAL`).
    """
    if plan.workload is Workload.TRAIN:
        raise InputError(
            f"{plan.model}: this is a training plan; vLLM serves models. Plan the serving workload "
            "(planner optimize MODEL.py --workload decode|generate ...) and export that"
        )
    if not plan.token_model:
        raise InputError(f"{plan.model} does not read token ids; vLLM serves language models")
    if plan.cp > 1:
        raise InputError(
            f"{plan.model}: the plan splits each sequence over cp={plan.cp} context-parallel ranks ({plan.cp_text()}); "
            f"{CP_REFUSAL}. Plan it with cp 1 to export it for vLLM"
        )
    warnings = layout_warnings(plan, TOOL, replicates_kv_heads=True)  # vLLM replicates KV heads as planned
    if plan.workload is Workload.FORWARD:
        warnings.append(
            f"this is a forward plan ({plan.batch_size} x {plan.seq_len} tokens): it priced no decode step and "
            f"no KV cache, and max_model_len {max_model_len(plan)} leaves no room to generate. Plan the request "
            "vLLM serves (planner optimize MODEL.py --workload generate --seq-len PROMPT --new-tokens N, or "
            "--workload decode --context C) and export that"
        )
    trained = plan.serving.trained_positions if plan.serving is not None else None
    if trained and max_model_len(plan) > trained:
        warnings.append(
            f"max_model_len {max_model_len(plan)} is above the {trained} positions the planned model file's config "
            "gives: if the checkpoint you serve has no more (its max_position_embeddings), vLLM refuses it unless "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 is set, and the positions beyond were never trained"
        )
    cluster = plan.saved_cluster()
    if cluster is not None and cluster.device.decode_attention is not None:
        warnings.append(
            f"the plan's decode steps were priced with {cluster.name}'s decode attention of one thread block per "
            "(sequence, query head) over the whole cache (device.decode_attention); vLLM's attention backends "
            "split the cache (PagedAttention V2, FlashAttention's split-KV), so at a few sequences x heads per rank "
            "and a long cache vLLM's steps are shorter than the plan's time per output token (a spec without "
            "decode_attention prices that kernel)"
        )
    if model is None:
        warnings.append(
            f"vLLM loads a Hugging Face checkpoint, not {plan.model}: replace {MODEL_PLACEHOLDER} "
            "(or export with --model ID)"
        )
    args: dict[str, object] = {
        "model": model or MODEL_PLACEHOLDER,
        "tensor_parallel_size": plan.tp,
        "pipeline_parallel_size": plan.pp,
    }
    if plan.dp > 1:
        args["data_parallel_size"] = plan.dp
    if plan.ep > 1:
        args["enable_expert_parallel"] = True
        warnings += _expert_warnings(plan)
    elif plan.num_experts and plan.tp > 1 and plan.expert_tp == 1:
        warnings.append(
            f"the plan keeps the experts whole on every rank (no expert parallelism); vLLM splits each expert over "
            f"the tp={plan.tp} TP ranks instead (its fused MoE's tensor parallelism): its expert time and memory "
            "differ from the plan's"
        )
    args["dtype"] = DTYPE_NAMES[plan.dtype]
    args["max_model_len"] = max_model_len(plan)
    args["max_num_seqs"] = max(1, plan.batch_size // plan.dp)
    env: dict[str, str] = {}
    if plan.pp > 1 and uneven_stages(plan):
        env["VLLM_PP_LAYER_PARTITION"] = ",".join(str(len(s)) for s in plan.stages)
        warnings.append(
            f"uneven pipeline stages ({stage_sizes_text(plan)}): set VLLM_PP_LAYER_PARTITION as written, "
            "or vLLM splits the layers evenly"
        )
    if plan.virtual_stages > 1:
        warnings.append(
            "vLLM pipelines without virtual stages: each rank serves one contiguous block of layers"
        )
    return args, env, warnings


def _expert_warnings(plan: Plan) -> list[str]:
    """What vLLM's expert parallelism (over all tp x dp ranks, expert TP 1) runs otherwise than the plan."""
    ranks = plan.tp * plan.dp
    exact = (plan.ep_fold == "tp" and plan.dp == 1) or (
        plan.ep_fold == "dp" and plan.tp == 1 and plan.ep == plan.dp
    )
    if exact:
        return []
    how = (
        f"over the tp={plan.tp} TP ranks of each of dp={plan.dp} replicas"
        if plan.ep_fold == "tp"
        else f"over {plan.ep} data-parallel ranks, each expert split over the tp={plan.tp} TP ranks"
        if plan.expert_tp > 1
        else f"over {plan.ep} data-parallel ranks, replicated over the tp={plan.tp} TP ranks"
    )
    return [
        f"the plan splits the experts {how}; vLLM's --enable-expert-parallel splits them over all {ranks} tensor x "
        f"data-parallel ranks (EP {ranks}): each rank holds and computes other experts than the plan priced"
    ]


def serve_argv(args: dict[str, object]) -> list[str]:
    """`vllm serve MODEL --tensor-parallel-size N ...` as argv items (a boolean field True as its bare flag,
    `--enable-expert-parallel`: vLLM's boolean options take no value)."""
    argv = ["vllm", "serve", str(args["model"])]
    for key, value in args.items():
        if key == "model":
            continue
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def _offline_note(plan: Plan) -> str:
    """The docstring's offline (Python) use: `LLM(**ENGINE_ARGS)` runs one engine in its process, which
    holds one data-parallel replica: with dp > 1 each replica is a process of its own (vLLM's
    examples/offline_inference/data_parallel.py sets VLLM_DP_RANK, VLLM_DP_SIZE and the master address
    in each), `vllm serve` runs them all."""
    if plan.dp == 1:
        return (
            "or in Python (each environment variable set before vLLM starts):\n\n"
            "    from vllm import LLM\n    llm = LLM(**ENGINE_ARGS)\n"
        )
    return (
        f"or in Python: offline, one LLM(...) holds one data-parallel replica, so start {plan.dp} processes (one per\n"
        "replica, each with VLLM_DP_RANK, VLLM_DP_RANK_LOCAL, VLLM_DP_SIZE, VLLM_DP_MASTER_IP and\n"
        "VLLM_DP_MASTER_PORT set, as vLLM's examples/offline_inference/data_parallel.py does) and feed each its\n"
        "share of the prompts; the command above runs them all.\n"
    )


def export_vllm(plan: Plan, model: str | None = None) -> Export:
    """The Python file (module docstring) with its warnings. Raises InputError for a training plan or
    one with context parallelism."""
    args, env, warnings = vllm_engine_args(plan, model)
    command = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    command = (command + " " if command else "") + shlex.join(serve_argv(args))
    body = ",\n".join(f"    {k!r}: {v!r}" for k, v in args.items())
    text = (
        f'"""vLLM engine arguments for {plan.model} on {plan.cluster} ({plan.workload}, tp={plan.tp} pp={plan.pp} '
        f"dp={plan.dp}),\nwritten by planner export --to vllm.\n\nServe from a shell:\n\n    {command}\n\n"
        + _offline_note(plan)
        + '"""\n\n'
        f"ENGINE_ARGS = {{\n{body},\n}}\n"
        f"ENVIRONMENT = {env!r}\n"
        f"SERVE_COMMAND = {command!r}\n"
    )
    return Export(text, warnings)

"""What every export shares: the result type, the plan's layers and batches in the targets' terms, and
the warnings about choices a target tool lays out its own way.

Megatron-LM, torchtitan and vLLM shard every transformer layer the same fixed way (column-parallel
Q/K/V and up/gate projections, row-parallel output and down projections, vocabulary-parallel
embedding and LM head). A plan may choose otherwise per weight (keep a weight replicated where the
collectives cost more than the split saves), run ladder residual, or price replicated fallbacks;
`layout_warnings` names each of those so that the user knows where the tool's run will differ from
the prediction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.errors import InputError
from planner.plan import DataParallel, Plan, Recompute, SplitStyle, Workload
from planner.plan import dp_label as plan_dp_label

# what the plan's cp_comm_type "alltoall" is, for the warnings of tools without it
ULYSSES = "all-to-all context parallelism (DeepSpeed Ulysses: tokens swapped for heads around attention)"


@dataclass
class Export:
    """One exported artefact: its text (a file the target tool reads as it is) and the warnings about
    plan choices the target cannot express (printed on stderr by the command line)."""

    text: str
    warnings: list[str] = field(default_factory=list)


def num_layers(plan: Plan) -> int:
    """Transformer layers of the planned model (all pipeline stages together)."""
    return sum(len(layers) for layers in plan.stages)


def virtual_stage_layers(plan: Plan) -> list[list[int]]:
    """Layer indices per virtual pipeline stage, `pp * virtual_stages` of them in pipeline order.

    With `virtual_stages` v = 1 these are `plan.stages`. With v > 1, `stages[r]` lists rank r's layers
    as v runs of consecutive indices; run c of rank r is virtual stage c * pp + r (the interleaved
    placement of Megatron-LM, torchtitan and torch.distributed.pipelining). Raises InputError naming
    `stages` when a rank's layers do not form exactly v runs.
    """
    v = plan.virtual_stages
    if v == 1:
        return [list(layers) for layers in plan.stages]
    chunks: list[list[int]] = [[] for _ in range(plan.pp * v)]
    for rank, layers in enumerate(plan.stages):
        runs: list[list[int]] = []
        for layer in sorted(layers):
            if runs and layer == runs[-1][-1] + 1:
                runs[-1].append(layer)
            else:
                runs.append([layer])
        if len(runs) != v:
            raise InputError(
                f"field 'stages': pipeline rank {rank} holds layers {list(layers)}, {len(runs)} runs of "
                f"consecutive layers, but virtual_stages is {v} (one run per model chunk)"
            )
        for c, run in enumerate(runs):
            chunks[c * plan.pp + rank] = run
    return chunks


def uneven_stages(plan: Plan) -> bool:
    """Whether the (virtual) pipeline stages hold different numbers of layers."""
    return len({len(layers) for layers in virtual_stage_layers(plan)}) > 1


def stage_sizes_text(plan: Plan) -> str:
    """'17 + 15 layers' for the (virtual) stages, in pipeline order; past 12 stages, runs of equal
    sizes counted: '1 (x49) + 2 (x14) + 1 (x49) layers'."""
    sizes = [len(layers) for layers in virtual_stage_layers(plan)]
    if len(sizes) <= 12:
        return " + ".join(str(n) for n in sizes) + " layers"
    runs: list[list[int]] = []
    for n in sizes:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return " + ".join(f"{n} (x{count})" if count > 1 else str(n) for n, count in runs) + " layers"


def device_factors(plan: Plan) -> str:
    """The factors of the plan's device count as the export headers write them: "tp * pp * dp", with
    context parallelism "tp * cp * pp * dp" (`MeshShape.num_devices`)."""
    return "tp * cp * pp * dp" if plan.cp > 1 else "tp * pp * dp"


def micro_batch_size(plan: Plan) -> int:
    """Sequences per micro-batch per data-parallel rank: batch / dp / micro_batches (the CP ranks of a
    replica share its sequences, each holding part of every one's tokens: cp does not divide it).

    Raises InputError when the plan's batch does not divide that way (the targets need whole
    micro-batches).
    """
    per_replica, rest = divmod(plan.batch_size, plan.dp)
    size, rest2 = divmod(per_replica, plan.micro_batches)
    if rest or rest2 or size < 1:
        raise InputError(
            f"the plan's batch {plan.batch_size} does not split into dp={plan.dp} replicas of "
            f"{plan.micro_batches} whole micro-batches each"
        )
    return size


def replicated_weights(plan: Plan) -> list[str]:
    """Weights the plan keeps whole on every tensor-parallel rank (tp > 1 only), by FQN."""
    if plan.tp == 1:
        return []
    return [w for w, s in plan.splits.items() if s.style is SplitStyle.REPLICATE]


def _position_embedding(fqn: str) -> bool:
    """Whether a weight's name says it is a learned position embedding (GPT-2's `wpe`, `position_embeddings`,
    `pos_emb`...)."""
    name = fqn.lower()
    return any(key in name for key in ("wpe", "position", "pos_emb"))


def _short_list(items: list[str], limit: int = 4) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def kv_piece_splits(plan: Plan) -> list[str]:
    """Weights split into fewer pieces than tp (K/V projections of a model with fewer KV heads than
    ranks, each head replicated on tp / pieces ranks), by FQN."""
    return [w for w, s in plan.splits.items() if s.pieces is not None and s.pieces < plan.tp]


# `Plan.roles` of the projections that read a block's input, and of those that write back to the stream
STREAM_INPUT_ROLES = {"q", "k", "v", "qkv", "up", "gate"}
BLOCK_OUTPUT_ROLES = {"o", "down"}


def against_megatron_pairing(plan: Plan) -> dict[str, str]:
    """Weight FQN -> role of each split opposite to Megatron-LM's pairing: a row-parallel projection
    that reads the block's input, or a column-parallel one that writes the stream (`Plan.roles`;
    a plan written before them: none found)."""
    out = {}
    for weight, split in plan.splits.items():
        role = plan.roles.get(weight)
        if (split.style is SplitStyle.ROWWISE and role in STREAM_INPUT_ROLES) or (
            split.style is SplitStyle.COLWISE and role in BLOCK_OUTPUT_ROLES
        ):
            out[weight] = role
    return out


def layout_warnings(plan: Plan, tool: str, replicates_kv_heads: bool = False) -> list[str]:
    """Warnings for a tool with Megatron-LM's fixed tensor-parallel layout (Megatron-LM, torchtitan,
    vLLM): ladder residual, weights the plan keeps replicated, K/V heads replicated over ranks (unless
    the tool does that too: `replicates_kv_heads`), replicated fallbacks it priced."""
    warnings = []
    pieces = kv_piece_splits(plan)
    if pieces and not replicates_kv_heads:
        warnings.append(
            f"the plan splits {_short_list(pieces)} into fewer pieces than TP={plan.tp} (fewer KV heads than ranks, "
            f"each head replicated); {tool} needs the KV heads divisible by the tensor-parallel size: plan with "
            "--tp at most the KV-head count for it"
        )
    if plan.ladder_layers:
        warnings.append(
            f"{tool} has no ladder residual: the plan ladders layers {_short_list([str(i) for i in plan.ladder_layers])}; "
            f"{tool} runs the standard residual (outputs as the original model, every TP all-reduce exposed), "
            f"slower than predicted"
        )
    # (learned position embeddings stay replicated in these tools too: Megatron-LM's LanguageModelEmbedding
    # shards only the word embedding over the vocabulary)
    if plan.adapters:
        bases = len(set(plan.adapters.values()))
        warnings.append(
            f"the model has LoRA adapters beside {bases} projection(s) ({_short_list(sorted(plan.adapters))}): {tool}'s "
            "arguments describe the base model, without them; add them with its own LoRA / PEFT support (the plan "
            "splits each with its projection: down whole and up column-parallel beside a column-parallel one, down "
            "row-parallel and up whole beside a row-parallel one), else it runs the base model only"
        )
    if plan.frozen_params and plan.workload is Workload.TRAIN:
        warnings.append(
            f"the model freezes {plan.frozen_params:,} of its {plan.model_params:,} parameters (requires_grad=False), "
            f"which the plan holds as weights only; {tool} trains every weight it is given unless told to freeze "
            "them: with gradients and Adam state for them its memory and time exceed the prediction"
        )
    # learned position embeddings stay replicated in these tools too; LoRA adapters follow their projection
    kept = [w for w in replicated_weights(plan) if not _position_embedding(w) and w not in plan.adapters]
    if kept:
        warnings.append(
            f"{tool} shards every layer's projections at TP={plan.tp}; the plan keeps {len(kept)} weight(s) "
            f"replicated ({_short_list(kept)}), which {tool} will shard: its time and memory differ from the prediction"
        )
    flipped = [w.removesuffix(".weight") for w in against_megatron_pairing(plan)]
    if flipped:
        warnings.append(
            f"the plan splits {len(flipped)} projection(s) against Megatron's pairing ({_short_list(flipped)}: "
            f"row-wise where {tool} is column-parallel, or the reverse); {tool} lays them out its own way: its time "
            "differs from the prediction"
        )
    for f in plan.fallbacks:
        warnings.append(
            f"the plan runs {f.op} replicated at {f.line} (an all-gather it priced); {tool} lays that op out its own way"
        )
    if plan.serving is not None:
        for note in plan.serving.fallbacks:
            warnings.append(f"serving fallback the plan priced, which {tool} may lay out differently: {note}")
    return warnings


def cross_attention_layers(plan: Plan) -> list[int]:
    """The layers whose attention reads another stream's keys and values (a decoder's cross-attention
    over an encoder's output: the "cross" block of `planner.solver.costing`), from the plan's per-layer
    choices."""
    return sorted(
        c.layer
        for c in plan.predicted.per_layer
        if c.layer >= 0 and any(k.startswith("cross.") for k in c.strategy)
    )


def language_model_warnings(plan: Plan, tool: str, trains_with: str) -> list[str]:
    """Warnings for a tool whose arguments describe a decoder-only language model (`trains_with`: what
    it runs, e.g. Megatron-LM's pretrain_gpt.py): a model with cross-attention (an encoder-decoder) or
    one that reads no token ids (images, features) is not what those arguments build; the parallelism
    degrees still apply."""
    warnings = []
    cross = cross_attention_layers(plan)
    if cross:
        warnings.append(
            f"the model has cross-attention: {len(cross)} of its {num_layers(plan)} layers attend to another "
            f"stream (layers {_short_list([str(i) for i in cross])}), as an encoder-decoder's decoder does; these "
            f"arguments are for {trains_with} (decoder-only language models): the parallelism degrees apply, the "
            "layer count and sequence length do not describe the model"
        )
    if not plan.token_model:
        warnings.append(
            f"the model reads no token ids (images or features: seq_len {plan.seq_len} is its rows per sample); "
            f"these arguments are for {trains_with} (decoder-only language models): the parallelism degrees "
            "apply, the sequence length and batch in tokens do not"
        )
    return warnings


_STRENGTH = {Recompute.NONE: 0, Recompute.SELECTIVE: 1, Recompute.FULL: 2}


def strongest_recompute(
    plan: Plan, warnings: list[str], tool: str, consequence: str = ""
) -> Recompute | None:
    """The strongest recomputation `plan` asks for of any layer class (None: none asked), for a tool
    that recomputes every layer alike; a plan that recomputes its layers differently gets a warning
    naming `tool` and, after it, `consequence`."""
    if not plan.recompute:
        return None
    choices = set(plan.recompute.values())
    strongest = max(choices, key=_STRENGTH.__getitem__)
    if len(choices) > 1:
        warnings.append(
            f"the plan recomputes layers differently ({plan.recompute_text()}); {tool} recomputes every layer "
            f"alike: exported as {strongest}{consequence}"
        )
    return strongest


# ---------------------------------------------------------------------------------------------
# The data-parallel style in the planner's labels, and the tools' nearest forms

DP_DECISION = "data-parallel"  # the subject of the plan's decision pricing every data-parallel style
NOT_PRICED = "not what the plan priced"
DP_TIE = 0.01  # nearest_dp_form: candidates this near (fraction of the planned step) are alike
# what ZeRO-1 / ZeRO-2 shard, for the warnings of tools that have neither
ZERO_NAMES = {
    DataParallel.ZERO1: "ZeRO-1 (optimizer state sharded alone)",
    DataParallel.ZERO2: "ZeRO-2 (optimizer state and gradients sharded, parameters whole)",
}  # in every warning of an exported style other than the plan's


def dp_label(plan: Plan) -> str:
    """The plan's data-parallel style as the search labels it (`planner.plan.dp_label`): over the dp x cp
    ranks that hold the same weights (the CP ranks of a replica share them and its sharded state, as
    `planner.solver.problem.MeshConfig.dp_label` counts them), so a zero1 / fsdp plan at dp=1 with cp > 1
    is sharded, not "ddp"."""
    cp = plan.cp
    return plan_dp_label(plan.dp_style, plan.dp * cp, plan.dp_shard * cp, plan.reshard_after_forward)


def dp_prices(plan: Plan) -> dict[str, tuple[float, float | None]]:
    """label -> (step time the plan priced, s; inf where it does not fit), peak memory per rank, GiB
    (None where the decision does not record it)) of each data-parallel style of the plan's
    "data-parallel" decision (`Decision.memory_bytes`); empty when the plan has none (dp=1, a plan
    written before it)."""
    decision = next((d for d in plan.decisions if d.subject == DP_DECISION), None)
    if decision is None:
        return {}
    memory = {name: b / 2**30 for name, b in decision.memory_bytes.items()}
    return {name: (float(t), memory.get(name)) for name, t in decision.options.items()}


def nearest_dp_form(plan: Plan, candidates: list[str], default: str) -> str:
    """Of the data-parallel styles a tool can run instead of the plan's (`candidates`, labels as
    `dp_label`), the one whose step time the plan priced nearest its own among those that fit;
    `default` when the plan priced none of them or it is as near within `DP_TIE` of the step."""
    prices = dp_prices(plan)
    planned = prices.get(dp_label(plan), (plan.predicted.latency_s, None))[0]
    fits = [c for c in candidates if c in prices and math.isfinite(prices[c][0])]
    if not fits or not math.isfinite(planned):
        return default
    best = min(fits, key=lambda c: (abs(prices[c][0] - planned), c != default))
    if default in fits and abs(prices[default][0] - planned) - abs(prices[best][0] - planned) <= (
        DP_TIE * planned
    ):
        return default  # as near within DP_TIE: the structural default
    return best


def _priced(label: str, price: tuple[float, float | None]) -> str:
    time_s, gib = price
    memory = f" ({gib:.1f} GiB per rank)" if gib is not None else ""
    if not math.isfinite(time_s):
        return f"{label} as not fitting{memory}"
    step = f"{time_s:.4g} s" if time_s >= 10 else f"{time_s * 1e3:.4g} ms"
    return f"{label} at {step} a step" + (f" and {gib:.1f} GiB per rank" if gib is not None else "")


def dp_price_text(plan: Plan, exported: str) -> str:
    """What the plan priced for its own data-parallel style and for `exported` (labels as `dp_label`):
    "the plan priced zero1 at 476.4 ms a step and 60.5 GiB per rank, fsdp at 352.7 ms a step and 38.3
    GiB per rank (-26.0% step time)", or that it did not price `exported`."""
    prices = dp_prices(plan)
    own = dp_label(plan)
    mine = prices.get(own, (plan.predicted.latency_s, None))
    if exported not in prices:
        return (
            f"the plan priced {_priced(own, mine)} and did not price {exported} (its data-parallel style "
            "was pinned: plan again with --dp-style auto to price every style)"
        )
    theirs = prices[exported]
    text = f"the plan priced {_priced(own, mine)}, {_priced(exported, theirs)}"
    if math.isfinite(theirs[0]) and math.isfinite(mine[0]) and mine[0] > 0:
        text += f" ({(theirs[0] / mine[0] - 1) * 100:+.1f}% step time)"
    return text


def _dp_ranks(plan: Plan) -> str:
    """The ranks a plan's data-parallel state spans: "dp=4", or "dp x cp = 2" with context parallelism."""
    return f"dp={plan.dp}" if plan.cp == 1 else f"dp x cp = {plan.dp * plan.cp}"


def dp_substitute_warning(plan: Plan, tool: str, missing: str, exported: str, form: str) -> str:
    """The warning for a data-parallel style `tool` cannot run: it has no `missing` (what the plan's
    style is), so it gets `form` (the tool's settings), the planner's `exported` style, which is
    `NOT_PRICED`, with both prices (`dp_price_text`)."""
    return (
        f"{tool} has no {missing}, the plan's {dp_label(plan)} over {_dp_ranks(plan)}: exported as {form}; that is "
        f"{exported}, the nearest form {tool} has, and {NOT_PRICED}: {dp_price_text(plan, exported)}"
    )


# ---------------------------------------------------------------------------------------------
# Context parallelism: the sequence length every tool checks


def cp_sequence_warning(plan: Plan, tool: str, divisor: int, check: str) -> list[str]:
    """A warning, in a list (empty when none), for a context-parallel plan whose sequence length is
    not a multiple of `divisor`, what `tool` asserts (`check` names where): the tools cut every
    sequence into 2 x cp head-tail chunks (times what else they split it by), where a plan without
    load balancing cuts cp contiguous ones (`planner.plan.check_cp_sequence`)."""
    if plan.cp == 1 or plan.seq_len % divisor == 0:
        return []
    return [
        f"{tool} needs the sequence length a multiple of {divisor} with context parallelism cp={plan.cp} "
        f"({check}); the plan's {plan.seq_len} tokens are not: it refuses the run (plan a sequence length that "
        f"is a multiple of {divisor})"
    ]

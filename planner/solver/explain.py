"""Why the plan is what it is: decisions with the predicted cost of each alternative.

A user asks "why row-parallel here?" and gets, for every op of every class of layers, the time of its
block (attention or MLP) summed over those layers and the micro-batches with each option of that op
forced and the rest of its block re-optimised (`block_table` enumerates the block's option
combinations; not a step time: every pipeline stage's share is added); for the mesh, the predicted step time
of every candidate solved; for ladder residual, the plan with and without it; for training, the plan
with each alternative of sequence parallelism, activation recomputation (per layer class), pipeline
schedule and v, and the distributed optimizer, the rest of the plan unchanged (`training_decisions`);
for each communication-overlap choice, the plan with it on and off and the exposed share of the
traffic it concerns (`overlap_decisions`); for context parallelism, the fastest plan at each degree
and the plan with each attention variant, or why it is refused (`cp_decisions`); for expert
parallelism, the plan with each EP degree and fold, or why it cannot run (`ep_decisions`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

from costmodels.expert_parallel import DEFAULT_MOE_IMBALANCE, touched_experts
from planner.plan import (
    DataParallel,
    Decision,
    MeshCandidate,
    Recompute,
    Schedule,
    Workload,
    cp_unbalanced_note,
)
from planner.solver.baseline import even_stages
from planner.solver.costing import (
    CostContext,
    CostTables,
    LayerGraph,
    conversion_time_s,
    expert_comm_time_s,
    expert_counts,
    expert_gemm_time_s,
    gradient_sync_time_s,
    head_split_queries,
    interleaved_chunks,
    layer_node_times_s,
    stream_conversion_time_s,
)
from planner.solver.prediction import PricedAssignment, predict
from planner.solver.problem import (
    FEATURE_MIN_SAVING,
    Assignment,
    Constraints,
    LadderMode,
    LadderPolicy,
    MeshConfig,
    dp_style_variants,
    ep_refusal,
    overlap_variants,
)

MAX_BLOCK_COMBINATIONS = 20000  # decision tables enumerate a block's option combinations up to this
NOT_SOLVED_NOTES = ("pruned", "not solved")  # how the search's notes of unsolved candidates start


def _percent(fraction: float) -> str:
    """A small relative difference as text: "0.43%", or "under 0.01%"."""
    return f"{fraction:.2%}" if fraction >= 1e-4 else "under 0.01%"


def _kept_simpler(options: dict[str, float], chosen: str, what: str) -> str:
    """ "; X saves p% (< threshold ...: kept `chosen`, the simpler `what`)" where an option of `options`
    is faster than the `chosen` one (the search keeps the simpler layout unless a level saves
    `FEATURE_MIN_SAVING`); "" where none is."""
    faster = [n for n, t in options.items() if t < options.get(chosen, math.inf)]
    if not faster:
        return ""
    best = min(faster, key=options.get)
    return (
        f"; {best} saves {_percent(options[chosen] / options[best] - 1)} (< {FEATURE_MIN_SAVING:.1%} per level "
        f"the runtime is asked more of: kept {chosen}, the simpler {what})"
    )


MAX_MESH_OPTIONS = 30  # the mesh decision lists at most this many solved candidates, fastest first


def mesh_decision(candidates: list[MeshCandidate], chosen: MeshConfig) -> list[Decision]:
    """Predicted step time of the fastest solved meshes (at most `MAX_MESH_OPTIONS`, the chosen one
    always); those that do not fit memory and those pruned are only counted."""
    solved = sorted((c for c in candidates if c.latency_s is not None), key=lambda c: c.latency_s)
    options: dict[str, float] = {}
    for c in solved[:MAX_MESH_OPTIONS]:  # two candidates may end with one label (styles priced on each):
        options.setdefault(c.label(), c.latency_s)  # the faster one's time
    for c in solved[MAX_MESH_OPTIONS:]:
        if c.label() == chosen.label():
            options.setdefault(c.label(), c.latency_s)
    pruned = sum(1 for c in candidates if c.note.startswith(NOT_SOLVED_NOTES))
    unfit = len(candidates) - len(solved) - pruned
    reason = (
        f"lowest predicted step time of {len(candidates)} mesh candidates ({len(options)} fastest shown); "
        f"{unfit} do not fit memory, {pruned} not solved (their lower bound is within the solver gap of "
        "the chosen time or above it, or the search time limit)"
    )
    return [Decision("mesh", chosen.label(), options, reason)]


def block_table(
    graph: LayerGraph, key: str, block: str, ctx: CostContext
) -> dict[tuple[str, str], float] | None:
    """Best block time (compute + conversions) with each (op, option) forced; None if too many combinations."""
    ops = [op for op in graph.ops if op.block == block]
    if not ops or math.prod(len(op.options) for op in ops) > MAX_BLOCK_COMBINATIONS:
        return None
    names = {op.name for op in ops}
    out = graph.block_outputs.get(block)
    pairs = [(core, query) for core, query in head_split_queries(graph) if {core, query} <= names]
    best: dict[tuple[str, str], float] = {}
    for combo in itertools.product(*[op.options for op in ops]):
        chosen = {op.name: o for op, o in zip(ops, combo)}
        if any(chosen[core].name == "head" and chosen[query].name != "colwise" for core, query in pairs):
            continue  # the pass would not run this core head-parallel
        t = sum(o.compute_s + o.comm_s for o in combo)
        for op in ops:
            for src in op.inputs:
                if src in names:
                    t += conversion_time_s(
                        chosen[src].out_layout, chosen[op.name].in_layout, graph.op(src).out_bytes, ctx
                    )
        if out is not None:
            t += stream_conversion_time_s(chosen[out].out_layout, graph.op(out).out_bytes, ctx)
        for op in ops:
            k = (op.name, chosen[op.name].name)
            if t < best.get(k, math.inf):
                best[k] = t
    return best


def strategy_decisions(priced: PricedAssignment) -> list[Decision]:
    """Per class of layers and op: with each option of that op forced and the rest of its block
    re-optimised (`block_table`), the block's time summed over the class's layers and the micro-batches
    (every pipeline stage's share added: not a step time, which the reason says)."""
    tables, choices = priced.tables, priced.assignment.choices
    ctx, graphs, ends = tables.ctx, tables.graphs, tables.ends
    has_layers = bool(ctx.structure.layers)
    decisions = []
    counts: dict[str, list[int]] = {}
    for i, key in enumerate(tables.layer_keys):
        counts.setdefault(key, []).append(i)
    m = ctx.micro_batches
    work = "compute + TP comm, forward + backward" if ctx.train else "compute + TP comm"
    for key, graph in graphs.items():
        layers = counts[key]
        span = f"layers[{layers[0]}..{layers[-1]}]" if has_layers else "mlp"
        count = f"{len(layers)} layers" if len(layers) > 1 else "1 layer"
        for block in ("attention", "cross", "mlp"):
            table = block_table(graph, key, block, ctx)
            if table is None:
                continue
            times = (
                f"times: {block} block ({work}) with this option, rest of the block re-optimised, summed over "
                f"{count} × {m} micro-batch(es) on all pipeline stages (not a step time)"
            )
            for op in graph.ops:
                if op.block != block:
                    continue
                options = {
                    o.name: table.get((op.name, o.name), math.inf) * len(layers) * m for o in op.options
                }
                for name, _why in op.excluded.items():
                    options[name] = math.inf
                chosen = choices[(key, op.name)]
                cheapest = min(options, key=options.get)
                reason = "cheapest" if len(op.options) > 1 else "the only option offered"
                if cheapest != chosen and options[cheapest] < options[chosen] * (1 - 1e-9):
                    reason = (
                        f"{cheapest} is {_percent(options[chosen] / options[cheapest] - 1)} faster in this table, which "
                        "prices the block alone (not the weights' gradient sync or optimizer step, recomputation, memory, "
                        "stages or ladder); the whole plan's "
                        f"solve chose {chosen}"
                    )
                reason += f"; {times}"
                if op.excluded:
                    reason += "; not offered: " + "; ".join(f"{n}: {why}" for n, why in op.excluded.items())
                subject = (
                    f"{span}.{op.name}" if op.name.startswith(f"{block}.") else f"{span}.{block}.{op.name}"
                )
                decisions.append(Decision(subject, chosen, options, reason))
    for op in ends.ops:
        options = {o.name: (o.compute_s + o.comm_s) * m for o in op.options}
        for name in op.excluded:
            options[name] = math.inf
        favour = "memory, the weights' gradient sync and optimizer step" if ctx.train else "memory"
        reason = f"times: this op over the step's {m} micro-batch(es), on its stage; {favour} may favour the sharded option"
        head = ctx.structure.lm_head
        if (
            op.block == "embedding"
            and ctx.structure.tied_lm_head
            and head is not None
            and op.weight == head.weight
        ):
            reason += "; its weight is the LM head's (tied): one split for both"
        if op.excluded:
            reason += "; not offered: " + "; ".join(f"{n}: {why}" for n, why in op.excluded.items())
        decisions.append(Decision(op.name, choices[("ends", op.name)], options, reason))
    return decisions


def ladder_decision(
    priced: PricedAssignment, policy: LadderPolicy, min_saving_fraction: float
) -> list[Decision]:
    """The plan with and without its ladder layers (same strategies and stages)."""
    if policy.mode is LadderMode.NONE:
        return []
    plain = predict(priced.tables, dataclasses.replace(priced.assignment, ladder_layers=[])).prediction
    ladder = priced.assignment.ladder_layers
    label = f"layers {ladder[0]}..{ladder[-1]}" if ladder else "none"
    options = {"none": plain.latency_s, label: priced.prediction.latency_s}
    if policy.mode is LadderMode.AUTO:
        reason = (
            f"solver's choice among the upper {policy.count} layers; a layer is laddered only if it saves "
            f">= {min_saving_fraction:.0%} of its time (ladder changes the model's function)"
        )
    else:
        reason = f"the user asked for exactly the upper {policy.count} layers"
    return [Decision("ladder", label, options, reason)]


def bytes_text(nbytes: float) -> str:
    """Bytes in the largest binary unit they fill (GiB, MiB, else KiB), 3 significant digits."""
    for unit, size in (("GiB", 2.0**30), ("MiB", 2.0**20)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes / 2.0**10:.3g} KiB"


def memory_fit_text(peak_bytes: float, cap_bytes: float, device_bytes: float) -> str:
    """The memory part of the "megatron-baseline" decision's reason: "fits memory", or "does not
    fit: needs X per rank, over the Y usable of the device's Z" (the report's baseline line quotes
    it, `planner.cli.render.render_plan`)."""
    if peak_bytes <= cap_bytes:
        return "fits memory"
    return (
        f"does not fit: needs {bytes_text(peak_bytes)} per rank, over the {bytes_text(cap_bytes)} usable "
        f"of the device's {bytes_text(device_bytes)}"
    )


def with_memory_fit(reason: str, fit: str) -> str:
    """`reason` with its memory part ("fits memory" / "does not fit: ...", `memory_fit_text`) replaced
    by `fit`, or `fit` appended when it has none."""
    parts = reason.split("; ")
    at = [i for i, part in enumerate(parts) if part == "fits memory" or part.startswith("does not fit")]
    if not at:
        return f"{reason}; {fit}" if reason else fit
    parts[at[0]] = fit
    return "; ".join(parts)


def op_exclusions(graphs: dict[str, LayerGraph], ends: LayerGraph) -> list[str]:
    """ "op option: why" for every option an op does not offer (divisibility), graph by graph; one
    reason given to several ops or options is said once ("qkv, o colwise/rowwise: why")."""
    by_why: dict[str, tuple[dict[str, None], dict[str, None]]] = {}
    for graph in [*graphs.values(), ends]:
        for op in graph.ops:
            for name, why in op.excluded.items():
                ops, options = by_why.setdefault(why, ({}, {}))
                ops[op.name] = options[name] = None
    return [f"{', '.join(ops)} {'/'.join(options)}: {why}" for why, (ops, options) in by_why.items()]


MAX_SCHEDULE_ALTERNATIVES = 8  # interleaved alternatives shown: v = 2 .. this


_GIB = 2.0**30


def _feature_reason(what: str, options: dict[str, float], chosen: str, pinned: bool | None, flag: str) -> str:
    """Why an on/off feature (sequence parallelism, distributed optimizer) is `chosen`, by the search's
    rule: pinned by the user, else needed to fit memory, else on only when it saves at least
    `FEATURE_MIN_SAVING` of the step (the plan with it off over the plan with it on, minus 1)."""
    if pinned is not None:
        return f"{what}; pinned by {flag} {'on' if pinned else 'off'}"
    on, off = options["on"], options["off"]
    rule = f"a feature must save at least {FEATURE_MIN_SAVING:.1%} of the step"
    if chosen == "on":
        if off == math.inf:
            return f"{what}; on: needed to fit memory"
        saving = off / on - 1
        if saving >= FEATURE_MIN_SAVING:
            return f"{what}; on saves {saving:.1%} of the step ({rule})"
        return (
            f"{what}; on saves {_percent(saving)} of the step with the rest of the plan unchanged; the search compared "
            f"the plans solved with and without it, where it saved at least {FEATURE_MIN_SAVING:.1%}"
        )
    if on == math.inf:
        return f"{what}; off: on does not fit or is not possible here"
    if on >= off:
        return f"{what}; off: on is not faster"
    return f"{what}; on saves {_percent(off / on - 1)} (< {FEATURE_MIN_SAVING:.1%} threshold: kept off, the simpler layout)"


def training_decisions(
    priced: PricedAssignment,
    cap_bytes: float,
    price_config: Callable[[MeshConfig], CostTables],
    constraints: Constraints | None = None,
    runs: Callable[[MeshConfig], bool] | None = None,
) -> list[Decision]:
    """Training: the step time of the plan with each alternative of sequence parallelism, activation
        recomputation (per layer class), pipeline schedule and v, and the distributed optimizer, the rest
        unchanged (strategies, and stages unless the schedule changes them); inf: does not fit `cap_bytes`
        per device, or not possible on this mesh, which the reason says. `price_config` prices the model on
        another `MeshConfig`; `constraints`: what the user pinned (the reason names the option); `runs`:
    whether the runtime runs a data-parallel style on the mesh (those it does not are shown as not
    allowed)."""
    tables, assignment = priced.tables, priced.assignment
    ctx = tables.ctx
    if not ctx.train:
        return []
    c = constraints or Constraints()
    config, mesh = ctx.config, ctx.mesh
    unfit: dict[str, str] = {}  # alternative -> "needs X GiB" (of the decision being built)

    def cost(alt_config: MeshConfig, alt: Assignment, name: str) -> float:
        alt_tables = tables if alt_config == config else price_config(alt_config)
        p = predict(alt_tables, alt).prediction
        if p.peak_memory_bytes <= cap_bytes:
            return p.latency_s
        unfit[name] = f"{p.peak_memory_bytes / _GIB:.1f} GiB"
        return math.inf

    def fit_note() -> str:
        """Which alternatives do not fit memory, then clears the record for the next decision."""
        note = ""
        if unfit:
            needs = ", ".join(f"{k} needs {v}" for k, v in unfit.items())
            note = f"; not allowed = does not fit memory ({needs} per device > {cap_bytes / _GIB:.1f} GiB usable)"
        unfit.clear()
        return note + "; times: the step with only this changed"

    out = []
    # sequence parallelism
    sp = {"off": math.inf, "on": math.inf}
    for on in (False, True):
        if on and mesh.tp == 1:
            continue
        sp["on" if on else "off"] = cost(
            dataclasses.replace(config, sequence_parallel=on), assignment, "on" if on else "off"
        )
    chosen_sp = "on" if ctx.sequence_parallel else "off"
    what = f"norm/residual regions split along the sequence over tp={mesh.tp} (Korthikanti et al. 2022)"
    if mesh.tp == 1:
        reason = "needs tp > 1 (nothing to split the sequence over)" + fit_note()
    elif "rowwise" not in assignment.choices.values():
        sp["on"] = math.inf
        reason = (
            f"{what}; off: the plan has no row-parallel block whose all-reduce it would split" + fit_note()
        )
    else:
        reason = _feature_reason(what, sp, chosen_sp, c.sequence_parallel, "--sequence-parallel") + fit_note()
    out.append(Decision("sequence-parallel", chosen_sp, sp, reason))
    # recomputation per layer class
    spans: dict[str, list[int]] = {}
    for i, key in enumerate(tables.layer_keys):
        spans.setdefault(key, []).append(i)
    for key, layers in spans.items():
        label = f"layers[{layers[0]}..{layers[-1]}]" if ctx.structure.layers else "mlp"
        if not tables.graphs[key].backward:  # forward only: the recompute options all price the same
            reason = "no gradient reaches these layers (frozen): they run forward only, nothing to recompute"
            options = {str(Recompute.NONE): cost(config, assignment, str(Recompute.NONE))}
            out.append(Decision(f"{label}.recompute", str(Recompute.NONE), options, reason))
            continue
        options = {}
        for r in Recompute:
            alt = dataclasses.replace(assignment, recompute={**assignment.recompute, key: r})
            options[str(r)] = cost(config, alt, str(r))
        reason = "selective: attention core only (scores not kept); full: keep only the layer input"
        if c.recompute is not None:
            reason += f"; pinned by --recompute {c.recompute}"
        out.append(
            Decision(f"{label}.recompute", str(assignment.recompute_of(key)), options, reason + fit_note())
        )
    # pipeline schedule and v
    if mesh.pp > 1:
        L, m = tables.num_layers, ctx.micro_batches
        plain_stages = assignment.stages if ctx.virtual_stages == 1 else even_stages(L, mesh.pp)
        options = {}
        for schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
            if schedule is Schedule.ONE_F_ONE_B and m < mesh.pp:
                continue
            alt_config = dataclasses.replace(config, schedule=schedule, virtual_stages=1)
            options[str(schedule)] = cost(
                alt_config, dataclasses.replace(assignment, stages=plain_stages), str(schedule)
            )
        for v in range(2, MAX_SCHEDULE_ALTERNATIVES + 1):
            if mesh.pp * v > L or m % mesh.pp:
                continue
            alt_config = dataclasses.replace(config, schedule=Schedule.INTERLEAVED_1F1B, virtual_stages=v)
            chunks = interleaved_chunks(L, mesh.pp, v)
            name = f"interleaved_1f1b v={v}"
            options[name] = cost(alt_config, dataclasses.replace(assignment, stages=chunks), name)
        chosen = str(config.schedule) + (f" v={config.virtual_stages}" if config.virtual_stages > 1 else "")
        reason = f"bubble (p-1)/(v m) of the ideal step with p={mesh.pp}, m={m}; v times the point-to-point messages"
        if c.schedule is not None or c.virtual_stages is not None:
            reason += "; pinned by --schedule / --virtual-stages"
        out.append(Decision("schedule", chosen, options, reason + fit_note()))
    # data-parallel style (over the dp x cp ranks holding the same weights)
    if mesh.dp_cp > 1:
        out.append(_dp_style_decision(tables, assignment, c, price_config, cap_bytes, runs))
    return out


# each overlap choice: (flag, config field, what it overlaps, the Constraints pin)
_OVERLAPS = (
    ("tp-comm-overlap", "tp_comm_overlap",
     "each TP block's collectives cut into chunks, each chunk's transfer under the next chunk's GEMM"),
    ("overlap-grad-reduce", "overlap_grad_reduce",
     "the DP gradient reduction issued per layer bucket during the backward"),
    ("overlap-param-gather", "overlap_param_gather",
     "the parameter all-gather after the step waited for per layer at its first use in the next forward"),
)  # fmt: skip


def overlap_decisions(
    priced: PricedAssignment,
    cap_bytes: float,
    price_config: Callable[[MeshConfig], CostTables],
    constraints: Constraints | None = None,
) -> list[Decision]:
    """Each communication-overlap choice that means something on the plan's mesh (`overlap_variants`):
    the step time with it on and off, the rest of the plan unchanged, and in the reason the traffic
    it concerns per step and the share of it left exposed with it on (TP: the layers' TP collectives,
    `Prediction.exposed_comm_s` beside `overlapped_comm_s`; DP: `Prediction.grad_sync_s` beside the
    whole DP traffic, `costing.gradient_sync_time_s` summed over the stages)."""
    tables, assignment = priced.tables, priced.assignment
    ctx, config = tables.ctx, tables.ctx.config
    c = constraints or Constraints()
    meaningful = {
        field: len({getattr(v, field) for v in overlap_variants(config, Constraints(), ctx.train)}) > 1
        for _, field, _ in _OVERLAPS
    }
    out = []
    for flag, field, what in _OVERLAPS:
        if not meaningful[field] or (field == "tp_comm_overlap" and assignment.ladder_layers):
            continue
        options: dict[str, float] = {}
        shares: dict[str, str] = {}
        for on in (False, True):
            alt_config = dataclasses.replace(config, **{field: on})
            alt = tables if alt_config == config else price_config(alt_config)
            p = predict(alt, assignment)
            name = "on" if on else "off"
            options[name] = (
                p.prediction.latency_s if p.prediction.peak_memory_bytes <= cap_bytes else math.inf
            )
            shares[name] = _exposed_share(p, field)
        chosen = "on" if getattr(config, field) else "off"
        reason = _feature_reason(what, options, chosen, getattr(c, field), f"--{flag}")
        reason += f"; exposed with it on: {shares['on']}; off: {shares['off']}"
        out.append(Decision(flag, chosen, options, reason))
    return out


def _exposed_share(priced: PricedAssignment, field: str) -> str:
    """'X of Y per step (Z%)': the exposed part of the traffic an overlap choice concerns."""
    p = priced.prediction
    if field == "tp_comm_overlap":
        total = p.exposed_comm_s - p.grad_sync_s + p.overlapped_comm_s
        exposed = p.exposed_comm_s - p.grad_sync_s
    else:
        ctx = priced.tables.ctx
        # the routed experts' gradients too, reduced over their own group (`prediction._tail_s`): the
        # exposed time counts them, and a MoE's share read 420-1150% of the dense traffic alone
        total = max(
            (
                gradient_sync_time_s(s.grad_bytes, ctx)
                + (
                    gradient_sync_time_s(s.expert_grad_bytes, ctx.experts_context())
                    if s.expert_grad_bytes
                    else 0.0
                )
                for s in priced.stages
            ),
            default=0.0,
        )
        exposed = p.grad_sync_s
    if total <= 0:
        return "no such traffic"
    return f"{exposed * 1e3:.3g} ms of {total * 1e3:.3g} ms ({_percent(exposed / total)})"


def _dp_style_decision(
    tables: CostTables,
    assignment: Assignment,
    c: Constraints,
    price_config: Callable[[MeshConfig], CostTables],
    cap_bytes: float,
    runs: Callable[[MeshConfig], bool] | None = None,
) -> Decision:
    """The step time of every data-parallel style the constraints allow (`dp_style_variants`), the rest
    of the plan unchanged (inf: does not fit); the reason gives each one's peak memory per rank."""
    config = tables.ctx.config
    options: dict[str, float] = {}
    memory: list[str] = []
    peaks: dict[str, float] = {}
    refused: list[str] = []
    for variant in dp_style_variants(config, c):
        name = variant.dp_label()
        if runs is not None and not runs(variant):
            options[name] = math.inf
            refused.append(name)
            continue
        alt = tables if variant == config else price_config(variant)
        p = predict(alt, assignment).prediction
        options[name] = p.latency_s if p.peak_memory_bytes <= cap_bytes else math.inf
        peaks[name] = p.peak_memory_bytes
        memory.append(f"{name} {p.peak_memory_bytes / _GIB:.1f}")
    what = (
        f"over dp={config.mesh.dp}"
        + (f" x cp={config.mesh.cp} ranks" if config.mesh.cp > 1 else "")
        + ": ddp all-reduces gradients; zero1 shards Adam's state (Megatron's "
        "distributed optimizer); zero2 gradients too; fsdp parameters too, gathered per layer (prefetched one "
        "layer ahead, reduce-scatters issued as each layer's backward ends); hsdp SxR shards over S ranks and "
        "replicates over R; -noreshard keeps the gathered layers from forward to backward"
    )
    pinned = [
        flag for flag, value in (
            ("--dp-style", c.dp_style), ("--dp-shard", c.dp_shard),
            ("--reshard-after-forward", c.reshard_after_forward), ("--distributed-optimizer", c.distributed_optimizer),
        ) if value is not None
    ]  # fmt: skip
    reason = what + (f"; pinned by {' '.join(pinned)}" if pinned else "")
    reason += f"; peak memory per rank, GiB: {', '.join(memory)} (usable {cap_bytes / _GIB:.1f})"
    if refused:
        reason += (
            f"; not allowed: {', '.join(refused)} (the embedding tied to the LM head across pipeline stages "
            "keeps its gradients whole)"
        )
    chosen = config.dp_label()
    if not pinned:
        reason += _kept_simpler(options, chosen, "style")
    return Decision("data-parallel", chosen, options, reason, peaks)


CP_VARIANT_TEXT = {
    "ring": "K/V blocks passed round the ring under each block's attention",
    "allgather": "K/V all-gathered once per layer (Llama 3's choice)",
    "alltoall": "all-to-all from tokens to heads around attention (Ulysses)",
}


def cp_decisions(
    priced: PricedAssignment,
    cap_bytes: float,
    price_config: Callable[[MeshConfig], CostTables],
    candidates: list[MeshCandidate],
    variants: list[tuple[str, bool]],
    refusals: dict[str, str],
    constraints: Constraints | None = None,
) -> list[Decision]:
    """Context parallelism: the degree (the fastest solved candidate at each cp the search priced, from
    `candidates`) and, when the plan uses it, the attention variant: the step with each of ring,
    allgather and alltoall, load-balanced and contiguous, the rest of the plan unchanged (inf: refused,
    with why: `refusals` by variant, a sequence that does not cut into the chunks, a pin, or memory),
    and in the reason each one's exposed and hidden K/V traffic per layer and micro-batch. `variants`:
    the (comm type, load balance) pairs the search allowed on the plan's mesh. Nothing for decode."""
    ctx = priced.tables.ctx
    if ctx.workload.kind is Workload.DECODE:
        return []
    c = constraints or Constraints()
    cps = sorted({cand.mesh.cp for cand in candidates})
    out = []
    if len(cps) > 1 or ctx.mesh.cp > 1:
        options: dict[str, float] = {}
        pruned: list[str] = []
        for cp in cps:
            at = [cand for cand in candidates if cand.mesh.cp == cp]
            solved = [cand.latency_s for cand in at if cand.latency_s is not None]
            options[f"cp={cp}"] = min(solved) if solved else math.inf
            if any(cand.note.startswith(NOT_SOLVED_NOTES) for cand in at):
                pruned.append(f"cp={cp}")
        unsolved = [name for name, t in options.items() if t == math.inf]
        reason = (
            f"each sequence's {ctx.workload.seq_len} tokens split over the cp ranks for every layer (activations "
            "and token-wise work / cp, the CP ranks reduce gradients with the DP ranks); times: the fastest "
            "solved mesh at each degree"
        )
        if unsolved:
            reason += (
                f"; {', '.join(unsolved)}: no mesh solved (does not fit memory, or pruned by its lower bound)"
            )
        if pruned:
            reason += (
                f"; {', '.join(pruned)}: some meshes not solved, their lower bound no faster than the chosen plan "
                "(the time shown is the fastest of those solved"
                + (
                    "; pin the other degrees too (--tp, --pp, --dp) to solve them)"
                    if c.cp is not None
                    else "; pin --cp to solve them all)"
                )
            )
        if c.cp is not None:
            reason += f"; pinned by --cp {c.cp}"
        out.append(Decision("context-parallel", f"cp={ctx.mesh.cp}", options, reason, unsolved=unsolved))
    if ctx.mesh.cp == 1:
        return out
    config, assignment = ctx.config, priced.assignment
    seq, cp = ctx.workload.seq_len, ctx.mesh.cp
    options, notes = {}, []
    for kind in ("allgather", "ring", "alltoall"):
        for balance in (True, False):
            name = kind + ("" if balance else " unbalanced")
            if kind in refusals:
                options[name] = math.inf
                continue
            if (kind, balance) not in variants:
                options[name] = math.inf
                chunks = 2 * cp if balance else cp
                notes.append(
                    f"{name}: {seq} tokens do not cut into {chunks} chunks"
                    if seq % chunks
                    else f"{name}: not allowed by --cp-comm-type / --cp-load-balance"
                )
                continue
            alt_config = dataclasses.replace(config, cp_comm_type=kind, cp_load_balance=balance)
            alt = priced.tables if alt_config == config else price_config(alt_config)
            p = predict(alt, assignment)
            fits = p.prediction.peak_memory_bytes <= cap_bytes
            options[name] = p.prediction.latency_s if fits else math.inf
            exposed, hidden = _cp_traffic_s(alt, assignment)
            notes.append(
                f"{name}: K/V traffic exposed {exposed * 1e3:.3g} ms, hidden {hidden * 1e3:.3g} ms per layer and "
                f"micro-batch, peak {p.prediction.peak_memory_bytes / _GIB:.1f} GiB"
                + ("" if fits else f" (over the {cap_bytes / _GIB:.1f} GiB usable)")
            )
    chosen = config.cp_comm_type + ("" if config.cp_load_balance else " unbalanced")
    unbalanced = not config.cp_load_balance and c.cp_load_balance is None and seq % (2 * cp) != 0
    reason = (f"{cp_unbalanced_note(seq, cp)}; " if unbalanced else "") + (
        f"attention over cp={cp} ranks: {'; '.join(f'{k} = {v}' for k, v in CP_VARIANT_TEXT.items())}; load "
        "balancing gives each rank one early and one late chunk of the causal sequence (unbalanced: the last "
        "rank does (2cp-1)/cp of the average work); " + "; ".join(notes)
    )
    for kind, why in refusals.items():
        reason += f"; {kind} not allowed: {why}"
    pins = [
        flag
        for flag, v in (("--cp-comm-type", c.cp_comm_type), ("--cp-load-balance", c.cp_load_balance))
        if v is not None
    ]
    if pins:
        reason += f"; pinned by {' '.join(pins)}"
    out.append(Decision("context-parallel attention", chosen, options, reason))
    return out


def _cp_traffic_s(tables: CostTables, assignment: Assignment) -> tuple[float, float]:
    """(exposed, hidden) context-parallel traffic of the plan's attention cores, per layer and
    micro-batch (the largest over the layer classes): the chosen options' `comm_s` and `hidden_comm_s`."""
    exposed = hidden = 0.0
    for key, graph in tables.graphs.items():
        for op in graph.ops:
            if op.name.endswith("core"):
                o = op.option(assignment.option(key, op.name))
                exposed, hidden = max(exposed, o.comm_s), max(hidden, o.hidden_comm_s)
    return exposed, hidden


def ep_decisions(
    priced: PricedAssignment,
    cap_bytes: float,
    price_config: Callable[[MeshConfig], CostTables],
    constraints: Constraints | None = None,
    solved: dict[str, float] | None = None,
) -> list[Decision]:
    """Expert parallelism (mixture-of-experts models only): for EP off and every EP degree folded over
    the dp x cp ranks (at tp > 1 each with the experts whole on every TP rank and split over them,
    `MeshConfig.expert_tp`) and EP over the TP ranks, the faster of the fastest solved mesh candidate
    with it (`solved`, by `MeshConfig.ep_label`) and this plan with only EP changed (mesh, splits,
    stages, recomputation and data-parallel style kept) where that fits memory; inf with why where a
    degree cannot run on the plan's mesh (`problem.ep_refusal`: it does not divide the experts or the
    ranks, or exceeds them) and no candidate solved it. The reason gives each one's token exchange and
    expert GEMMs per MoE layer and micro-batch and its peak memory on this plan, the routing priced,
    and what a run needs."""
    ctx, assignment = priced.tables.ctx, priced.assignment
    experts = expert_counts(ctx.structure)
    if not experts:
        return []
    c = constraints or Constraints()
    config, mesh = ctx.config, ctx.mesh
    layer = next(layer for layer in ctx.structure.layers if layer.moe is not None)
    degrees = sorted({d for e in experts for d in range(2, e + 1) if e % d == 0} | {
        d for d in range(2, mesh.dp_cp + 1) if mesh.dp_cp % d == 0
    })  # fmt: skip
    pairs = [(1, "dp", 1)] + [(d, "dp", 1) for d in degrees]
    if (
        mesh.tp > 1
    ):  # expert TP: no EP and each EP-over-dp degree with the experts split over the TP ranks too
        pairs += [(1, "dp", mesh.tp)] + [(d, "dp", mesh.tp) for d in degrees] + [(mesh.tp, "tp", 1)]
    options: dict[str, float] = {}
    memory: dict[str, float] = {}
    notes, refused = [], []
    solved = solved or {}
    here = {MeshConfig(mesh, 1, ep=ep, ep_fold=fold, expert_tp=etp).ep_label() for ep, fold, etp in pairs}
    unsolved = []
    for name, latency in solved.items():  # degrees of other meshes only (not this one's dp x cp or tp)
        if name not in here:
            options[name] = latency
            unsolved += [name] if math.isinf(latency) else []
    for ep, fold, etp in pairs:
        name = MeshConfig(mesh, 1, ep=ep, ep_fold=fold, expert_tp=etp).ep_label()
        why = ep_refusal(experts, ep, fold, mesh, ctx.sequence_parallel) if ep > 1 else ""
        pinned = (c.ep is not None and c.ep != ep) or (ep > 1 and c.ep_fold not in (None, fold))
        if why or pinned or c.expert_tp not in (None, etp):
            options[name] = solved.get(name, math.inf)
            if why or pinned:  # a degree that cannot run is named once, without its expert TP
                refused += [why or f"{name}: not allowed by --ep / --ep-fold"] if etp == 1 else []
            else:
                refused.append(f"{name}: not allowed by --expert-tp {c.expert_tp}")
            continue
        alt_config = dataclasses.replace(config, ep=ep, ep_fold=fold, expert_tp=etp)
        alt = priced.tables if alt_config == config else price_config(alt_config)
        p = predict(alt, assignment).prediction
        fits = p.peak_memory_bytes <= cap_bytes
        options[name] = min(p.latency_s if fits else math.inf, solved.get(name, math.inf))
        memory[name] = p.peak_memory_bytes
        alt_ctx = alt.ctx
        if alt_ctx.experts_rewritten:
            gemms = f"expert GEMMs {expert_gemm_time_s(layer, alt_ctx) * 1e3:.3g} ms"
        else:  # nothing rewrites them: the model's own expert computation, priced node by node
            times = layer_node_times_s(layer, alt_ctx)
            gemms = (
                f"the experts as the model computes them {times['experts'] * 1e3:.3g} ms"
                if times is not None
                else "the experts as the model computes them"
            )
        notes.append(
            f"{name}: token exchange {expert_comm_time_s(layer, alt_ctx) * 1e3:.3g} ms, {gemms} "
            f"per MoE layer and micro-batch, peak "
            f"{p.peak_memory_bytes / _GIB:.1f} GiB on this plan"
            + ("" if fits else f" (over the {cap_bytes / _GIB:.1f} GiB usable)")
        )
    w = ctx.workload
    load = (
        f"the busiest EP rank computes {w.moe_imbalance:g}x the mean rows (--moe-imbalance; default "
        f"{DEFAULT_MOE_IMBALANCE:g}: balanced routing, no published per-rank measurement adopted)"
    )
    if w.moe_capacity_factor is not None:
        load += f", capped at the capacity factor {w.moe_capacity_factor:g} (--moe-capacity-factor)"
    load += " and at ep (every row on one rank)" if w.moe_imbalance > 2 else ""
    reason = (
        f"{experts[-1]} experts per MoE layer, top-{layer.moe.top_k}: over dp the experts split over ep of the dp x cp "
        "ranks and tokens go to them and back by all-to-all; off or over dp, each TP rank runs its experts whole, or "
        'with "experts split over tp" each expert is a Megatron MLP over the TP ranks (1/tp of its GEMMs and memory, '
        "an all-reduce of the outputs over TP: Megatron-Core's, torchtitan's and vLLM's default); over tp the TP "
        f"ranks split them and all-reduce the parts; {load}; times: the fastest solved mesh with each, or this "
        "plan with only expert parallelism changed where faster; " + "; ".join(notes)
    )
    if refused:
        reason += "; not possible here: " + "; ".join(refused)
    if unsolved:
        reason += (
            f"; {', '.join(unsolved)}: meshes with it priced but none solved (over memory, or their lower bound no "
            "faster than the chosen plan: pin --ep / --ep-fold to solve them)"
        )
    if w.kind is Workload.DECODE:
        moe = layer.moe
        reach = touched_experts(
            moe.num_experts, moe.top_k, ctx.tokens * max(1, ctx.ep if ctx.ep_fold == "dp" else 1)
        )
        reason += (
            f"; a decode step's {ctx.tokens:g} tokens per rank reach about {reach:.1f} of the {moe.num_experts} experts "
            "(their weights are what the step reads)"
        )
    if config.ep > 1 and ctx.train and mesh.dp_cp > 1 and ctx.dp_style is not DataParallel.DDP:
        reason += (
            f"; --run runs expert parallelism with dp_style ddp only, not {ctx.dp_style}: pin --dp-style ddp (or "
            "plan with --run) to run this plan"
        )
    if config.ep > 1 and config.ep_fold == "dp" and w.kind is Workload.DECODE:
        reason += "; --run decodes with expert parallelism over the TP ranks only (--ep-fold tp)"
    chosen = config.ep_label()
    pinned = c.ep is not None or c.ep_fold is not None or c.expert_tp is not None
    if not pinned:
        reason += _kept_simpler(options, chosen, "layout")
    else:
        reason += "; pinned by " + " ".join(
            f
            for f in (
                f"--ep {c.ep}" if c.ep else "",
                f"--ep-fold {c.ep_fold}" if c.ep_fold else "",
                f"--expert-tp {c.expert_tp}" if c.expert_tp else "",
            )
            if f
        )
    unsolved = [name for name in unsolved if math.isinf(options[name])]
    return [Decision("expert parallelism", chosen, options, reason, memory, unsolved)]

"""Why the plan is what it is: decisions with the predicted cost of each alternative.

A user asks "why row-parallel here?" and gets, for every op of every class of layers, the step time
of those layers with each option of that op forced and the rest of its block re-optimised
(`block_table` enumerates the block's option combinations); for the mesh, the predicted step time
of every candidate solved; for ladder residual, the plan with and without it; for training, the plan
with each alternative of sequence parallelism, activation recomputation (per layer class), pipeline
schedule and v, and the distributed optimizer, the rest of the plan unchanged (`training_decisions`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

from planner.plan import Decision, MeshCandidate, Recompute, Schedule
from planner.solver.baseline import even_stages
from planner.solver.costing import (
    CostContext,
    CostTables,
    LayerGraph,
    conversion_time_s,
    interleaved_chunks,
    stream_conversion_time_s,
)
from planner.solver.prediction import PricedAssignment, predict
from planner.solver.problem import Assignment, LadderMode, LadderPolicy, MeshConfig

MAX_BLOCK_COMBINATIONS = 20000  # decision tables enumerate a block's option combinations up to this
NOT_SOLVED_NOTES = ("pruned", "not solved")  # how the search's notes of unsolved candidates start


MAX_MESH_OPTIONS = 30  # the mesh decision lists at most this many solved candidates, fastest first


def mesh_decision(candidates: list[MeshCandidate], chosen: MeshConfig) -> list[Decision]:
    """Predicted step time of the fastest solved meshes (at most `MAX_MESH_OPTIONS`, the chosen one
    always); those that do not fit memory and those pruned are only counted."""
    solved = sorted((c for c in candidates if c.latency_s is not None), key=lambda c: c.latency_s)
    options: dict[str, float] = {c.label(): c.latency_s for c in solved[:MAX_MESH_OPTIONS]}
    for c in solved[MAX_MESH_OPTIONS:]:
        if c.label() == chosen.label():
            options[c.label()] = c.latency_s
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
    best: dict[tuple[str, str], float] = {}
    for combo in itertools.product(*[op.options for op in ops]):
        chosen = {op.name: o for op, o in zip(ops, combo)}
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
    """Per class of layers and op: the step time of the class with each option of that op forced."""
    tables, choices = priced.tables, priced.assignment.choices
    ctx, graphs, ends = tables.ctx, tables.graphs, tables.ends
    has_layers = bool(ctx.structure.layers)
    decisions = []
    counts: dict[str, list[int]] = {}
    for i, key in enumerate(tables.layer_keys):
        counts.setdefault(key, []).append(i)
    m = ctx.micro_batches
    for key, graph in graphs.items():
        layers = counts[key]
        span = f"layers[{layers[0]}..{layers[-1]}]" if has_layers else "mlp"
        for block in ("attention", "mlp"):
            table = block_table(graph, key, block, ctx)
            if table is None:
                continue
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
                reason = "cheapest: predicted time of these layers with this option, the rest of the block re-optimised"
                if cheapest != chosen and options[cheapest] < options[chosen] * (1 - 1e-9):
                    reason = f"{cheapest} is faster alone but breaks a memory, pipeline or ladder constraint"
                if op.excluded:
                    reason += "; not offered: " + "; ".join(f"{n}: {why}" for n, why in op.excluded.items())
                decisions.append(Decision(f"{span}.{block}.{op.name}", chosen, options, reason))
    for op in ends.ops:
        options = {o.name: (o.compute_s + o.comm_s) * m for o in op.options}
        for name in op.excluded:
            options[name] = math.inf
        reason = "time of this op per step; memory may favour the sharded option"
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


def op_exclusions(graphs: dict[str, LayerGraph], ends: LayerGraph) -> list[str]:
    """ "op option: why" for every option an op does not offer (divisibility), graph by graph."""
    out = []
    for graph in [*graphs.values(), ends]:
        for op in graph.ops:
            for name, why in op.excluded.items():
                out.append(f"{op.name} {name}: {why}")
    return out


MAX_SCHEDULE_ALTERNATIVES = 8  # interleaved alternatives shown: v = 2 .. this


def training_decisions(
    priced: PricedAssignment, cap_bytes: float, price_config: Callable[[MeshConfig], CostTables]
) -> list[Decision]:
    """Training: the step time of the plan with each alternative of sequence parallelism, activation
    recomputation (per layer class), pipeline schedule and v, and the distributed optimizer, the rest
    unchanged (strategies, and stages unless the schedule changes them); inf: does not fit `cap_bytes`
    per device, or not possible on this mesh. `price_config` prices the model on another `MeshConfig`."""
    tables, assignment = priced.tables, priced.assignment
    ctx = tables.ctx
    if not ctx.train:
        return []
    config, mesh = ctx.config, ctx.mesh

    def cost(alt_config: MeshConfig, alt: Assignment) -> float:
        alt_tables = tables if alt_config == config else price_config(alt_config)
        p = predict(alt_tables, alt).prediction
        return p.latency_s if p.peak_memory_bytes <= cap_bytes else math.inf

    fit_note = "inf = does not fit memory or not possible here; the rest of the plan unchanged"
    out = []
    # sequence parallelism
    sp = {"off": math.inf, "on": math.inf}
    for on in (False, True):
        if on and mesh.tp == 1:
            continue
        sp["on" if on else "off"] = cost(dataclasses.replace(config, sequence_parallel=on), assignment)
    chosen_sp = "on" if ctx.sequence_parallel else "off"
    out.append(
        Decision(
            "sequence-parallel",
            chosen_sp,
            sp,
            f"norm/residual regions split along the sequence over tp={mesh.tp} (Korthikanti et al. 2022); "
            + fit_note,
        )
    )
    # recomputation per layer class
    spans: dict[str, list[int]] = {}
    for i, key in enumerate(tables.layer_keys):
        spans.setdefault(key, []).append(i)
    for key, layers in spans.items():
        options = {}
        for r in Recompute:
            alt = dataclasses.replace(assignment, recompute={**assignment.recompute, key: r})
            options[str(r)] = cost(config, alt)
        label = f"layers[{layers[0]}..{layers[-1]}]" if ctx.structure.layers else "mlp"
        out.append(Decision(f"{label}.recompute", str(assignment.recompute_of(key)), options,
                            "selective: attention core only (scores not kept); full: keep only the layer input; " + fit_note))  # fmt: skip
    # pipeline schedule and v
    if mesh.pp > 1:
        L, m = tables.num_layers, ctx.micro_batches
        plain_stages = assignment.stages if ctx.virtual_stages == 1 else even_stages(L, mesh.pp)
        options = {}
        for schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
            if schedule is Schedule.ONE_F_ONE_B and m < mesh.pp:
                continue
            alt_config = dataclasses.replace(config, schedule=schedule, virtual_stages=1)
            options[str(schedule)] = cost(alt_config, dataclasses.replace(assignment, stages=plain_stages))
        for v in range(2, MAX_SCHEDULE_ALTERNATIVES + 1):
            if mesh.pp * v > L or m % mesh.pp:
                continue
            alt_config = dataclasses.replace(config, schedule=Schedule.INTERLEAVED_1F1B, virtual_stages=v)
            chunks = interleaved_chunks(L, mesh.pp, v)
            options[f"interleaved_1f1b v={v}"] = cost(
                alt_config, dataclasses.replace(assignment, stages=chunks)
            )
        chosen = str(config.schedule) + (f" v={config.virtual_stages}" if config.virtual_stages > 1 else "")
        out.append(
            Decision(
                "schedule",
                chosen,
                options,
                f"bubble (p-1)/(v m) of the ideal step with p={mesh.pp}, m={m}; v times the point-to-point messages; "
                + fit_note,
            )
        )
    # distributed optimizer
    if mesh.dp > 1:
        options = {
            "off": cost(dataclasses.replace(config, distributed_optimizer=False), assignment),
            "on": cost(dataclasses.replace(config, distributed_optimizer=True), assignment),
        }
        chosen = "on" if ctx.distributed_optimizer else "off"
        out.append(
            Decision(
                "distributed-optimizer",
                chosen,
                options,
                f"ZeRO-1: Adam state / dp={mesh.dp}, gradients reduce-scattered and parameters all-gathered; "
                + fit_note,
            )
        )
    return out

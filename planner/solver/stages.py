"""Contiguous pipeline stages for deep pipelines: the split that minimises the slowest stage.

`planner.solver.ilp` decides stage boundaries inside the ILP for shallow pipelines. For deep ones (pp=32
over 126 layers) the big-M stage products close slowly in CBC, so the ILP alternates: `balanced_split`
on per-layer costs (`reference_costs` first, then `solution_costs` of the last ILP solution), the ILP
with that split fixed, and again, until the split repeats. This module works on the cost tables and
assignments of `planner.solver.costing` / `planner.solver.problem`, not on the ILP, which imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.solver.costing import (
    CostTables,
    OpOption,
    in_flight_micro_batches,
    recompute_input_bytes,
    stage_p2p_time_s,
    transient_bytes,
)
from planner.solver.prediction import ends_dispatch_excess_s, layer_breakdown
from planner.solver.problem import Assignment


@dataclass
class SplitCosts:
    """The figures a contiguous stage split is balanced on, per layer and for the two ends."""

    time_s: list[float]  # per layer, per micro-batch: compute + exposed communication
    static_bytes: list[float]  # per layer, per rank: parameters (+ gradients and optimizer state)
    activation_bytes: list[float]  # per layer, per rank and in-flight micro-batch
    first_time_s: float = 0.0  # embedding and the nodes before the first layer, on the first stage
    last_time_s: float = 0.0  # final norm and LM head, on the last stage
    first_static_bytes: float = 0.0
    last_static_bytes: float = 0.0


def reference_costs(tables: CostTables) -> SplitCosts:
    """Optimistic costs: every op at its cheapest option (time and memory each at their least)."""
    ctx = tables.ctx
    per_class = {}
    for key, g in tables.graphs.items():
        act = g.least_activation_bytes()
        if ctx.train:
            act = min(act, recompute_input_bytes(ctx))
        per_class[key] = (max(g.cheapest_compute_s(), g.dispatch_s), g.least_static_bytes(), act)
    ends = tables.ends

    def least(block: str, cost) -> float:
        return sum(min(cost(o) for o in op.options) for op in ends.ops_of(block))

    floors = ends_dispatch_excess_s(ends, lambda op: min(op.options, key=_op_time_s))

    return SplitCosts(
        time_s=[per_class[k][0] for k in tables.layer_keys],
        static_bytes=[per_class[k][1] for k in tables.layer_keys],
        activation_bytes=[per_class[k][2] for k in tables.layer_keys],
        first_time_s=ends.first_stage_compute_s + least("embedding", _op_time_s) + floors[0],
        last_time_s=ends.last_stage_compute_s + least("head", _op_time_s) + floors[1],
        first_static_bytes=least("embedding", _static_bytes),
        last_static_bytes=least("head", _static_bytes),
    )


def solution_costs(tables: CostTables, solution: Assignment) -> SplitCosts:
    """The costs of a solved assignment (its strategies, ladder and recomputation)."""
    ladder = set(solution.ladder_layers)
    layers = [
        layer_breakdown(tables.graphs[key], key, solution, i in ladder, tables.ctx)
        for i, key in enumerate(tables.layer_keys)
    ]
    ends = tables.ends

    def chosen(block: str, cost) -> float:
        return sum(cost(op.option(solution.option("ends", op.name))) for op in ends.ops_of(block))

    floors = ends_dispatch_excess_s(ends, lambda op: op.option(solution.option("ends", op.name)))

    return SplitCosts(
        time_s=[b.compute_s + b.comm_s for b in layers],
        static_bytes=[b.static_bytes for b in layers],
        activation_bytes=[b.activation_bytes for b in layers],
        # the ends at least the host's issue time of their nodes, as `prediction.predict` prices them
        first_time_s=ends.first_stage_compute_s + chosen("embedding", _op_time_s) + floors[0],
        last_time_s=ends.last_stage_compute_s + chosen("head", _op_time_s) + floors[1],
        first_static_bytes=chosen("embedding", _static_bytes),
        last_static_bytes=chosen("head", _static_bytes),
    )


def _op_time_s(o: OpOption) -> float:
    return o.compute_s + o.comm_s


def _static_bytes(o: OpOption) -> float:
    return o.static_bytes


def balanced_split(tables: CostTables, costs: SplitCosts, memory_cap_bytes: float | None) -> list[int] | None:
    """First layer of each stage minimising the slowest stage under the memory cap (None: nothing fits).

    Bisection on the slowest-stage time T; for a given T, filling each stage greedily with as many
    layers as fit (time <= T, memory <= cap, enough layers left for the later stages) is optimal for
    contiguous splits, because leaving fewer layers to later stages never makes them harder.
    """
    ctx, cap = tables.ctx, memory_cap_bytes
    times, static, act = costs.time_s, costs.static_bytes, costs.activation_bytes
    pp, L = ctx.mesh.pp, len(times)
    p2p = [stage_p2p_time_s(ctx, s) for s in range(pp)]
    flight = [in_flight_micro_batches(ctx, s) for s in range(pp)]
    base_mem = transient_bytes(ctx)

    def greedy(limit: float) -> list[int] | None:
        starts, i = [], 0
        for s in range(pp):
            starts.append(i)
            t = (costs.first_time_s if s == 0 else 0.0) + (costs.last_time_s if s == pp - 1 else 0.0) + p2p[s]
            mem = (
                base_mem
                + (costs.first_static_bytes if s == 0 else 0.0)
                + (costs.last_static_bytes if s == pp - 1 else 0.0)
            )
            must_leave = pp - 1 - s
            taken = 0
            while i < L - must_leave:
                t_next = t + times[i]
                mem_next = mem + static[i] + flight[s] * act[i]
                last_stage = s == pp - 1
                if taken and not last_stage and (t_next > limit or (cap is not None and mem_next > cap)):
                    break
                t, mem, i, taken = t_next, mem_next, i + 1, taken + 1
            if taken == 0 or t > limit * (1 + 1e-9) or (cap is not None and mem > cap):
                return None
        return starts if i == L else None

    hi = sum(times) + (costs.first_time_s + costs.last_time_s) + sum(p2p)
    if greedy(hi) is None:
        return None
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if greedy(mid) is None:
            lo = mid
        else:
            hi = mid
    starts = greedy(hi)
    assert starts is not None
    return starts


def stage_times_s(tables: CostTables, costs: SplitCosts, starts: list[int]) -> list[float]:
    """Time per micro-batch of each stage whose first layers are ``starts``: its layers, the embedding
    on the first stage, the final norm + LM head on the last, the send to the next stage (seconds)."""
    pp, times = tables.ctx.mesh.pp, costs.time_s
    p2p = [stage_p2p_time_s(tables.ctx, s) for s in range(pp)]
    bounds = list(starts) + [len(times)]
    out = []
    for s in range(pp):
        t = sum(times[bounds[s] : bounds[s + 1]])
        t += (costs.first_time_s if s == 0 else 0.0) + (costs.last_time_s if s == pp - 1 else 0.0)
        out.append(t + p2p[s])
    return out


def rebalance(tables: CostTables, assignment: Assignment, memory_cap_bytes: float | None) -> bool:
    """Replace ``assignment.stages`` by `balanced_split` of the assignment's own per-layer costs when
    that split's slowest stage is faster (the ILP's balance term is a tie-break that CBC's gap
    tolerance may leave unexploited, e.g. [[0], [1, 2, 3]] for 4 identical layers). Returns whether
    the stages changed. Memory stays within the cap (`balanced_split` checks it)."""
    if tables.ctx.mesh.pp == 1 or tables.ctx.virtual_stages > 1 or not assignment.stages:
        return False
    costs = solution_costs(tables, assignment)
    current = [stage[0] for stage in assignment.stages]
    starts = balanced_split(tables, costs, memory_cap_bytes)
    if starts is None or starts == current:
        return False
    if max(stage_times_s(tables, costs, starts)) >= max(stage_times_s(tables, costs, current)) * (1 - 1e-9):
        return False
    bounds = starts + [len(costs.time_s)]
    assignment.stages = [list(range(bounds[s], bounds[s + 1])) for s in range(len(starts))]
    return True

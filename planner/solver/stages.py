"""Contiguous pipeline stages for deep pipelines: the split that minimises the slowest stage.

`planner.solver.ilp` decides stage boundaries inside the ILP for shallow pipelines. For deep ones (pp=32 over
126 layers) the big-M stage products close slowly in CBC, so `planner.solver.ilp._solve_with_split_search`
alternates: `balanced_split` on per-layer costs (`reference_costs` first, then `solution_costs` of the
last ILP solution), the ILP with that split fixed, and again, until the split repeats.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.solver.costing import (
    in_flight_micro_batches,
    p2p_stage_time_s,
    recompute_input_bytes,
    transient_bytes,
)
from planner.solver.prediction import layer_breakdown

if TYPE_CHECKING:
    from planner.solver.ilp import IlpProblem, IlpSolution

Costs = tuple[list[float], list[float], list[float], tuple[float, float], tuple[float, float]]


def reference_costs(prob: IlpProblem) -> Costs:
    """Optimistic per-layer (time, static bytes, activation bytes) and ends: cheapest option per op."""
    per_class = {}
    for key, g in prob.graphs.items():
        t = g.fixed_compute_s + sum(min(o.compute_s for o in op.options) for op in g.ops)
        st = g.fixed_static_bytes + sum(min(o.static_bytes for o in op.options) for op in g.ops)
        act = g.fixed_activation_bytes + sum(min(o.activation_bytes for o in op.options) for op in g.ops)
        if prob.ctx.train:
            act = min(act, recompute_input_bytes(prob.ctx))
        per_class[key] = (t, st, act)
    keys = prob.layer_keys
    ends = prob.ends
    first = [op for op in ends.ops if op.block == "embedding"]
    last = [op for op in ends.ops if op.block == "head"]
    ends_time = (
        sum(min(o.compute_s + o.comm_s for o in op.options) for op in first),
        ends.fixed_compute_s + sum(min(o.compute_s + o.comm_s for o in op.options) for op in last),
    )
    ends_mem = (
        sum(min(o.static_bytes for o in op.options) for op in first),
        sum(min(o.static_bytes for o in op.options) for op in last),
    )
    return (
        [per_class[k][0] for k in keys],
        [per_class[k][1] for k in keys],
        [per_class[k][2] for k in keys],
        ends_time,
        ends_mem,
    )


def solution_costs(prob: IlpProblem, sol: IlpSolution):
    """Per-layer (time, static bytes, activation bytes) and ends of a solved plan."""
    times, static, act = [], [], []
    ladder = set(sol.ladder_layers)
    for i, key in enumerate(prob.layer_keys):
        comp, exposed, _, st, a, _ = layer_breakdown(
            prob.graphs[key], key, sol.choices, i in ladder, prob.ctx
        )
        times.append(comp + exposed)
        static.append(st)
        act.append(a)
    ends = prob.ends
    chosen = {op.name: op.option(sol.choices[("ends", op.name)]) for op in ends.ops}
    first = [chosen[op.name] for op in ends.ops if op.block == "embedding"]
    last = [chosen[op.name] for op in ends.ops if op.block == "head"]
    ends_time = (
        sum(o.compute_s + o.comm_s for o in first),
        ends.fixed_compute_s + sum(o.compute_s + o.comm_s for o in last),
    )
    ends_mem = (sum(o.static_bytes for o in first), sum(o.static_bytes for o in last))
    return times, static, act, ends_time, ends_mem


def balanced_split(
    prob: IlpProblem,
    times: list[float],
    static: list[float],
    act: list[float],
    ends_time: tuple[float, float],
    ends_mem: tuple[float, float],
) -> list[int] | None:
    """First layer of each stage minimising the slowest stage under the memory cap (None: nothing fits).

    Bisection on the slowest-stage time T; for a given T, filling each stage greedily with as many
    layers as fit (time <= T, memory <= cap, enough layers left for the later stages) is optimal for
    contiguous splits, because leaving fewer layers to later stages never makes them harder.
    """
    ctx, cap = prob.ctx, prob.memory_cap_bytes
    pp, L = ctx.mesh.pp, len(times)
    p2p = p2p_stage_time_s(ctx)
    flight = [in_flight_micro_batches(ctx, s) for s in range(pp)]
    base_mem = transient_bytes(ctx)

    def greedy(limit: float) -> list[int] | None:
        starts, i = [], 0
        for s in range(pp):
            starts.append(i)
            t = (
                (ends_time[0] if s == 0 else 0.0)
                + (ends_time[1] if s == pp - 1 else 0.0)
                + (p2p if s < pp - 1 else 0.0)
            )
            mem = base_mem + (ends_mem[0] if s == 0 else 0.0) + (ends_mem[1] if s == pp - 1 else 0.0)
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

    hi = sum(times) + sum(ends_time) + pp * p2p
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


def stage_times_s(
    prob: IlpProblem, times: list[float], ends_time: tuple[float, float], starts: list[int]
) -> list[float]:
    """Time per micro-batch of each stage whose first layers are ``starts``: its layers, the embedding
    on the first stage, the final norm + LM head on the last, the send to the next stage (seconds)."""
    pp, L = prob.ctx.mesh.pp, len(times)
    p2p = p2p_stage_time_s(prob.ctx)
    bounds = list(starts) + [L]
    out = []
    for s in range(pp):
        t = sum(times[bounds[s] : bounds[s + 1]])
        t += (ends_time[0] if s == 0 else 0.0) + (ends_time[1] if s == pp - 1 else 0.0)
        out.append(t + (p2p if s < pp - 1 else 0.0))
    return out


def rebalance(prob: IlpProblem, sol: IlpSolution) -> bool:
    """Replace ``sol.stages`` by `balanced_split` of the solution's own per-layer costs when that split's
    slowest stage is faster (the ILP's balance term is a tie-break that CBC's gap tolerance may leave
    unexploited, e.g. [[0], [1, 2, 3]] for 4 identical layers). Returns whether the stages changed.
    Memory stays within the cap (`balanced_split` checks it)."""
    if prob.ctx.mesh.pp == 1 or not sol.feasible or not sol.stages:
        return False
    times, static, act, ends_time, ends_mem = solution_costs(prob, sol)
    current = [stage[0] for stage in sol.stages]
    starts = balanced_split(prob, times, static, act, ends_time, ends_mem)
    if starts is None or starts == current:
        return False
    if max(stage_times_s(prob, times, ends_time, starts)) >= max(
        stage_times_s(prob, times, ends_time, current)
    ) * (1 - 1e-9):
        return False
    bounds = starts + [len(times)]
    sol.stages = [list(range(bounds[s], bounds[s + 1])) for s in range(len(starts))]
    return True

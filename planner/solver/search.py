"""The planner's entry point: enumerate mesh shapes around the inner ILP and return the best `Plan`.

    plan_model(structure, cluster, workload, constraints) -> Plan

For every candidate mesh (tp, pp, dp, micro-batches, with the constraints' pipeline schedule: a
`MeshConfig`) allowed by the constraints, `planner.solver.costing` prices every op option and
`planner.solver.ilp` solves one ILP (strategies, stages, ladder, memory). Candidates are visited in
order of a cheap lower bound (perfectly sharded compute) and skipped once the bound exceeds the best
plan found, so the search stays fast on 1,000-device clusters. The hand-written Megatron plan
(`planner.solver.baseline`) is costed with the same model and stored in the plan; if it were ever
better than the search result (time limit hit), it is returned instead. The plan records the schedule
it was priced with (`Plan.schedule`), which the runtime runs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from costmodels.cluster import ClusterSpec
from planner.errors import InfeasibleError, InputError
from planner.frontend.analysis import Layer, ModelStructure, Role
from planner.plan import (
    Decision,
    MeshCandidate,
    MeshShape,
    Plan,
    Schedule,
    SolverInfo,
    SplitStyle,
    WeightSplit,
    Workload,
)
from planner.solver.baseline import baseline_plan, megatron_assignment, megatron_configs
from planner.solver.costing import (
    CostContext,
    CostTables,
    build_cost_tables,
    gqa_kv_replicated,
    in_flight_micro_batches,
    layer_keys,
    layer_projection_ops,
    mlp_op_names,
    recompute_input_bytes,
    step_time_s,
)
from planner.solver.explain import ladder_decision, mesh_decision, op_exclusions, strategy_decisions
from planner.solver.ilp import IlpProblem, IlpSolution, solve
from planner.solver.prediction import PricedAssignment, predict
from planner.solver.problem import Assignment, Constraints, LadderMode, LadderPolicy, MeshConfig, WorkloadSpec

__all__ = ["Constraints", "WorkloadSpec", "plan_model"]

_GIB = 2.0**30
TIE_TOLERANCE = 1e-6  # relative: plans this close in latency are ties, broken by fewer devices


@dataclass
class _Candidate:
    """One mesh candidate, priced, with lower bounds; solved or not."""

    tables: CostTables
    lower_bound_s: float
    memory_lower_bound_bytes: float
    solution: IlpSolution | None = None
    note: str = ""
    latency_s: float | None = None

    @property
    def config(self) -> MeshConfig:
        return self.tables.ctx.config

    @property
    def mesh(self) -> MeshShape:
        return self.tables.ctx.mesh


@dataclass
class _Search:
    structure: ModelStructure
    cluster: ClusterSpec
    workload: WorkloadSpec
    constraints: Constraints
    dtype: str
    layer_keys: list[str]
    ladder: LadderPolicy  # resolved for the model's layers
    cap_bytes: float
    excluded: list[str] = field(default_factory=list)
    candidates: list[_Candidate] = field(default_factory=list)
    solver_time_s: float = 0.0


def plan_model(
    structure: ModelStructure,
    cluster: ClusterSpec,
    workload: WorkloadSpec,
    constraints: Constraints,
    *,
    model_name: str = "model",
) -> Plan:
    """Find the fastest plan (latency of one step) for `structure` on `cluster`.

    Raises:
        InputError: constraints that contradict the model or cluster (pinned degrees, ladder spec).
        InfeasibleError: no mesh fits memory; the message names the binding constraint and what would fit.
    """
    search = _setup(structure, cluster, workload, constraints)
    _enumerate(search)
    best = _solve_candidates(search)
    return _make_plan(search, best, model_name)


def price(
    structure: ModelStructure,
    cluster: ClusterSpec,
    workload: WorkloadSpec,
    config: MeshConfig,
) -> CostTables:
    """Every op option of `structure` priced on one mesh candidate, in the workload's (or the model's)
    dtype: what `plan_model` hands the ILP for that candidate. Raises InputError for a model with
    nothing to plan."""
    ctx = CostContext(structure, cluster, workload, config, workload.dtype or structure.dtype)
    return build_cost_tables(ctx)


# ---------------------------------------------------------------------------------------------
# Set-up and enumeration


def _setup(
    structure: ModelStructure, cluster: ClusterSpec, workload: WorkloadSpec, constraints: Constraints
) -> _Search:
    dtype = workload.dtype or structure.dtype
    keys = layer_keys(structure)
    num_layers = len(structure.layers)
    ladder = constraints.ladder.for_layers(num_layers)
    if ladder.mode is not LadderMode.NONE:
        missing = [i for i in ladder.eligible(num_layers) if not _has_both_blocks(structure.layers[i])]
        if missing:
            raise InputError(
                f"ladder {str(constraints.ladder)!r}: layers {missing} lack an attention or MLP block"
            )
    cap = cluster.device.memory_bytes * constraints.memory_fraction
    return _Search(structure, cluster, workload, constraints, dtype, keys, ladder, cap)


def _has_both_blocks(layer: Layer) -> bool:
    return layer.attention is not None and layer.mlp is not None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_options(search: _Search, num_devices: int) -> list[int]:
    c, cluster = search.constraints, search.cluster
    heads, kv = search.structure.query_head_counts(), search.structure.kv_head_counts()
    out = []
    for tp in _divisors(num_devices) if c.tp is None else [c.tp]:
        if c.tp is None and tp > cluster.devices_per_node and not c.tp_across_nodes:
            search.excluded.append(
                f"tp={tp}: spans {math.ceil(tp / cluster.devices_per_node)} nodes "
                f"(TP stays inside a node of {cluster.devices_per_node} unless tp_across_nodes)"
            )
            continue
        bad = [h for h in heads if h % tp]
        if bad and c.tp is None:
            search.excluded.append(f"tp={tp}: {bad[0]} heads not divisible by {tp}")
            continue
        if bad:
            search.excluded.append(
                f"tp={tp} (pinned): {bad[0]} heads not divisible by {tp}; attention stays replicated"
            )
        bad_kv = [h for h in kv if h % tp and tp % h]
        if bad_kv and not bad and tp > 1:
            search.excluded.append(
                f"tp={tp}: head-parallel attention excluded: {bad_kv[0]} KV heads (GQA) not divisible by {tp}"
            )
        out.append(tp)
    return out


def _micro_batch_options(search: _Search, pp: int, dp: int) -> list[int]:
    w = search.workload
    per_replica = w.batch_size // dp
    if w.micro_batches is not None:
        return [w.micro_batches] if per_replica % w.micro_batches == 0 else []
    divisors = _divisors(per_replica)
    if pp == 1 and not w.train:
        return [1]
    limits = (pp, 4 * pp, per_replica) if pp > 1 else (1, per_replica)
    return sorted({max(d for d in divisors if d <= lim) for lim in limits})


def _enumerate(search: _Search) -> None:
    """Every allowed (tp, pp, dp, m), priced, with lower bounds of time and memory."""
    c, w, cluster = search.constraints, search.workload, search.cluster
    num_devices = min(c.max_devices or cluster.num_devices, cluster.num_devices)
    if c.max_devices is not None and c.max_devices > cluster.num_devices:
        raise InputError(f"max_devices {c.max_devices} exceeds the cluster's {cluster.num_devices} devices")
    num_layers = len(search.structure.layers) or 1
    tps = _tp_options(search, num_devices)
    pps = [c.pp] if c.pp is not None else [p for p in _divisors(num_devices) if p <= num_layers]
    if c.pp is not None and c.pp > num_layers:
        raise InputError(f"pp={c.pp} exceeds the model's {num_layers} layers")
    if not search.structure.layers and c.pp not in (None, 1):
        raise InputError("pp > 1 needs transformer layers; this model is a plain chain of linears")
    if not search.structure.layers:
        pps = [1]
    dps = [c.dp] if c.dp is not None else [d for d in _divisors(num_devices) if w.batch_size % d == 0]
    if c.dp is not None and w.batch_size % c.dp:
        raise InputError(f"dp={c.dp} does not divide the batch size {w.batch_size}")
    for tp in tps:
        for pp in pps:
            for dp in dps:
                if tp * pp * dp > num_devices:
                    continue
                for m in _micro_batch_options(search, pp, dp):
                    config = MeshConfig(MeshShape(tp, pp, dp), m, _schedule_for(c.schedule, pp, m))
                    search.candidates.append(_price(search, config))
    if not search.candidates:
        raise InfeasibleError(
            f"no mesh shape fits {num_devices} devices with {c.pinned or 'no pinned degrees'} and batch "
            f"{w.batch_size}; excluded: {'; '.join(search.excluded) or 'none'}"
        )


def _schedule_for(schedule: Schedule, pp: int, micro_batches: int) -> Schedule:
    """The schedule a (pp, micro_batches) candidate runs: 1F1B with fewer micro-batches than stages
    never reaches its steady state and is GPipe (the same order and memory), which is what runs then
    (torch.distributed.pipelining's Schedule1F1B requires micro_batches >= stages)."""
    if schedule == Schedule.ONE_F_ONE_B and micro_batches < pp:
        return Schedule.GPIPE
    return schedule


def _price(search: _Search, config: MeshConfig) -> _Candidate:
    ctx = CostContext(search.structure, search.cluster, search.workload, config, search.dtype)
    tables = build_cost_tables(ctx, search.layer_keys)
    work = (
        sum(tables.graphs[k].cheapest_compute_s() for k in tables.layer_keys)
        + tables.ends.cheapest_compute_s()
    )
    bound = step_time_s(work, work / config.mesh.pp, config.micro_batches)
    return _Candidate(tables, bound, _memory_lower_bound(tables))


def _memory_lower_bound(tables: CostTables) -> float:
    """A lower bound of the largest stage's memory per rank, without solving.

    Every layer needs at least c[s] = min over classes and options of (static + f(s) * activations)
    on stage s, where f(s) is the stage's in-flight micro-batches; spreading L layers fractionally so
    that all stages are equal gives max_s n[s] c[s] >= L / sum_s (1 / c[s]).
    """
    ctx, graphs = tables.ctx, tables.graphs.values()
    keep = recompute_input_bytes(ctx) if ctx.train else math.inf  # recomputation keeps only the input
    static = min(g.least_static_bytes() for g in graphs)
    act = min(min(keep, g.least_activation_bytes()) for g in graphs)
    per_stage = [static + in_flight_micro_batches(ctx, s) * act for s in range(ctx.mesh.pp)]
    if min(per_stage) <= 0:
        return 0.0
    ends_static = sum(min(o.static_bytes for o in op.options) for op in tables.ends.ops) / ctx.mesh.pp
    return tables.num_layers / sum(1.0 / c for c in per_stage) + ends_static


# ---------------------------------------------------------------------------------------------
# Solving


def _solve_candidates(search: _Search) -> _Candidate | None:
    best: _Candidate | None = None
    order = sorted(search.candidates, key=lambda c: (c.lower_bound_s, c.mesh.num_devices))
    start = time.perf_counter()
    for cand in order:
        left = search.constraints.search_time_limit_s - (time.perf_counter() - start)
        if cand.memory_lower_bound_bytes > search.cap_bytes:
            cand.note = f"needs at least {cand.memory_lower_bound_bytes / _GIB:.1f} GiB per device"
            continue
        if best is not None and cand.lower_bound_s > best.latency_s * (1 + TIE_TOLERANCE):
            cand.note = f"pruned: lower bound {cand.lower_bound_s * 1e3:.3g} ms >= best"
            continue
        if left <= 0 and best is not None:
            cand.note = f"not solved: search time limit {search.constraints.search_time_limit_s} s reached"
            continue
        prob = IlpProblem(
            tables=cand.tables,
            ladder=search.ladder,
            memory_cap_bytes=search.cap_bytes,
            time_limit_s=max(1.0, min(search.constraints.time_limit_s, left)),
            mip_gap=search.constraints.mip_gap,
            ladder_min_saving_fraction=search.constraints.ladder_min_saving_fraction,
        )
        sol = solve(prob)
        search.solver_time_s += sol.time_s
        cand.solution = sol
        cand.note = sol.status
        if sol.assignment is None:
            cand.note = f"{sol.status}: does not fit {search.cap_bytes / _GIB:.1f} GiB per device"
            continue
        cand.latency_s = predict(cand.tables, sol.assignment).prediction.latency_s
        if best is None or _better(cand, best):
            best = cand
    return best


def _better(cand: _Candidate, best: _Candidate) -> bool:
    """Faster, or as fast (within TIE_TOLERANCE) on fewer devices: idle TP ranks are waste."""
    assert cand.latency_s is not None and best.latency_s is not None
    if cand.latency_s < best.latency_s * (1 - TIE_TOLERANCE):
        return True
    tie = cand.latency_s <= best.latency_s * (1 + TIE_TOLERANCE)
    return tie and cand.mesh.num_devices < best.mesh.num_devices


# ---------------------------------------------------------------------------------------------
# Infeasibility


def _infeasible(search: _Search) -> InfeasibleError:
    """Name the binding constraint for the candidate closest to fitting, and what would fit."""
    closest = min(search.candidates, key=lambda c: (c.memory_lower_bound_bytes, -c.mesh.tp))
    mesh = closest.mesh
    breakdown = predict(closest.tables, megatron_assignment(closest.tables, recompute=True)).stages
    worst = max(range(mesh.pp), key=lambda s: breakdown[s].memory_bytes)
    need = breakdown[worst].memory_bytes
    total = sum(bd.memory_bytes for bd in breakdown) * mesh.tp * mesh.dp  # all ranks' bytes
    devices_needed = math.ceil(total / search.cap_bytes)
    cap_gib = search.cluster.device.memory_bytes / _GIB
    per_node = search.cluster.devices_per_node
    hints = [
        f"about {devices_needed} devices ({math.ceil(devices_needed / per_node)} nodes of {per_node}, e.g. pp across them)"
    ]
    if search.workload.kind is Workload.TRAIN:
        hints.append("more micro-batches or a smaller batch (less activation memory)")
    elif search.workload.kind is Workload.DECODE:
        hints.append("a smaller batch or context (less KV cache)")
    else:
        hints.append("a smaller batch")
    return InfeasibleError(
        f"no plan fits memory: with {mesh.label()} (the mesh closest to fitting) "
        f"stage {worst} needs {need / _GIB:.1f} GiB, devices have {cap_gib:.1f} GiB "
        f"({search.cap_bytes / _GIB:.1f} GiB usable at memory_fraction {search.constraints.memory_fraction}); "
        f"would fit: {', or '.join(hints)}"
    )


# ---------------------------------------------------------------------------------------------
# The Plan


def _make_plan(search: _Search, best: _Candidate | None, model_name: str) -> Plan:
    s, w = search.structure, search.workload
    baseline = _baseline(search)
    if best is None:
        raise _infeasible(search)
    sol = best.solution
    assert sol is not None and sol.assignment is not None and best.latency_s is not None
    chosen = predict(best.tables, sol.assignment)
    decisions: list[Decision] = []
    if (
        baseline is not None
        and baseline.prediction.peak_memory_bytes <= search.cap_bytes
        and baseline.prediction.latency_s < best.latency_s * (1 - 1e-9)
        and _allowed(search, baseline.tables.ctx.mesh)
    ):
        chosen = baseline
        decisions.append(Decision("fallback", "megatron", {"search": best.latency_s, "megatron": baseline.prediction.latency_s},
                                  f"the ILP stopped at {sol.status} (gap {sol.gap:.3g}); Megatron's plan is faster"))  # fmt: skip
    config, tables, assignment = chosen.tables.ctx.config, chosen.tables, chosen.assignment
    candidates = [
        MeshCandidate(c.config.mesh, c.config.micro_batches, c.latency_s, c.note)
        for c in sorted(search.candidates, key=lambda c: (c.latency_s is None, c.latency_s or 0.0))
    ]
    decisions = mesh_decision(candidates, config) + _baseline_decision(search, baseline) + decisions
    decisions += strategy_decisions(chosen)
    decisions += ladder_decision(chosen, search.ladder, search.constraints.ladder_min_saving_fraction)
    excluded = list(dict.fromkeys(search.excluded + op_exclusions(tables.graphs, tables.ends)))
    return Plan(
        model=model_name,
        cluster=search.cluster.name,
        workload=w.kind,
        batch_size=w.batch_size,
        seq_len=w.seq_len,
        context=w.context,
        micro_batches=config.micro_batches,
        dtype=search.dtype,
        mesh=config.mesh,
        splits=_splits(tables, assignment),
        stages=assignment.stages if s.layers else [[]],
        ladder_layers=assignment.ladder_layers,
        predicted=chosen.prediction,
        solver=SolverInfo(sol.status, sol.objective, sol.gap, search.solver_time_s, sol.num_variables),
        schedule=config.schedule,
        decisions=decisions,
        excluded=excluded,
        baseline=baseline.prediction if baseline is not None else None,
        mesh_candidates=candidates,
        token_model=s.token_model,
        unpriced_ops=s.unknown_ops,
    )


def _allowed(search: _Search, mesh: MeshShape) -> bool:
    """Whether the user's constraints admit `mesh` (pinned degrees, device limit) and a plan without ladder."""
    c = search.constraints
    pinned_ok = all(getattr(mesh, k) == v for k, v in c.pinned.items())
    devices_ok = mesh.num_devices <= (c.max_devices or search.cluster.num_devices)
    return pinned_ok and devices_ok and search.ladder.mode is not LadderMode.UPPER


def _baseline(search: _Search) -> PricedAssignment | None:
    """The plan a Megatron-LM user writes by hand (`megatron_configs`), priced: the first of its meshes
    that fits memory (with full activation recomputation if needed), else the last one tried."""
    configs = megatron_configs(
        search.cluster, search.workload, search.structure, search.constraints.schedule,
        search.constraints.max_devices,
    )  # fmt: skip
    chosen = None
    for config in configs:
        tables = _price(search, config).tables
        for recompute in (False, True) if search.workload.train else (False,):
            chosen = baseline_plan(tables, recompute=recompute)
            if chosen.prediction.peak_memory_bytes <= search.cap_bytes:
                return chosen
    return chosen


def _baseline_decision(search: _Search, baseline: PricedAssignment | None) -> list[Decision]:
    if baseline is None:
        return []
    b, config = baseline.prediction, baseline.tables.ctx.config
    fits = b.peak_memory_bytes <= search.cap_bytes
    reason = f"hand-written Megatron layout ({config.micro_batches} micro-batches); " + (
        "fits memory"
        if fits
        else f"does not fit: {b.peak_memory_bytes / _GIB:.1f} GiB/rank > {search.cap_bytes / _GIB:.1f} GiB usable"
    )
    return [Decision("megatron-baseline", config.mesh.label(), {"latency": b.latency_s}, reason)]


def _splits(tables: CostTables, assignment: Assignment) -> dict[str, WeightSplit]:
    """WeightSplit per weight FQN: colwise splits the output dim, rowwise the input dim."""
    structure = tables.ctx.structure
    splits: dict[str, WeightSplit] = {}

    def add(proj, option: str, pieces: int | None = None) -> None:
        style = SplitStyle(option)
        out_dim = proj.weight_out_dim
        if style in (SplitStyle.COLWISE, SplitStyle.VOCAB):
            dim = out_dim
        elif style is SplitStyle.ROWWISE:
            dim = 1 - out_dim
        else:
            dim = 0
        parts = list(proj.parts) if proj.parts and style is SplitStyle.COLWISE else None
        pieces = pieces if style is SplitStyle.COLWISE else None
        splits[proj.weight] = WeightSplit(proj.weight, style, dim, parts, pieces)

    if structure.layers:
        for layer, key in zip(structure.layers, tables.layer_keys):
            attn = layer.attention
            grouped = (
                attn is not None and not tables.ctx.train and gqa_kv_replicated(attn, tables.ctx.mesh.tp)
            )
            for name, proj in layer_projection_ops(layer).items():
                kv = grouped and proj.role in (Role.K, Role.V)
                add(proj, assignment.option(key, name), attn.num_kv_heads if kv else None)
    else:
        for name, proj in mlp_op_names(structure.mlp_chain).items():
            add(proj, assignment.option("chain", name))
    for i, emb in enumerate(structure.embeddings):
        vocab = assignment.option("ends", f"embedding{i}") == SplitStyle.VOCAB
        splits[emb.weight] = WeightSplit(
            emb.weight, SplitStyle.VOCAB if vocab else SplitStyle.REPLICATE, 0, None
        )
    if structure.lm_head is not None and structure.lm_head.weight not in splits:
        add(structure.lm_head, assignment.option("ends", "lm_head"))
    return splits

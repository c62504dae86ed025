"""The planner's entry point: enumerate mesh shapes around the inner ILP and return the best `Plan`.

    plan_model(structure, cluster, workload, constraints) -> Plan

For every candidate mesh (tp, pp, dp, micro-batches) allowed by the constraints, `planner.solver.costing`
prices every op option and `planner.solver.ilp` solves one ILP (strategies, stages, ladder, memory).
Candidates are visited in order of a cheap lower bound (perfectly sharded compute) and skipped
once the bound exceeds the best plan found, so the search stays fast on 1,000-device clusters.
The hand-written Megatron plan (`planner.solver.baseline`) is costed with the same model and stored in the
plan; if it were ever better than the search result (time limit hit), it is returned instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass, field

from costmodels.cluster import ClusterSpec
from planner.errors import InfeasibleError, InputError
from planner.plan import Decision, MeshCandidate, Plan, SolverInfo, WeightSplit
from planner.solver.baseline import BaselinePlan, baseline_plan, megatron_choices, megatron_mesh
from planner.solver.costing import (
    CostContext,
    LayerGraph,
    MeshShape,
    Workload,
    build_chain_graph,
    build_ends_graph,
    build_layer_graph,
    in_flight_micro_batches,
    layer_key,
    layer_projection_ops,
    mlp_op_names,
    recompute_input_bytes,
)
from planner.solver.explain import ladder_decision, mesh_decision, op_exclusions, strategy_decisions
from planner.solver.ilp import LADDER_MIN_SAVING_FRACTION, IlpProblem, IlpSolution, LadderPolicy, solve
from planner.solver.prediction import predict

__all__ = ["Constraints", "Workload", "plan_model"]

_GIB = 2.0**30
TIE_TOLERANCE = 1e-6  # relative: plans this close in latency are ties, broken by fewer devices


@dataclass(frozen=True)
class Constraints:
    """What the user pins or allows. None = the search chooses."""

    tp: int | None = None  # pinned tensor-parallel degree
    pp: int | None = None  # pinned pipeline-parallel degree
    dp: int | None = None  # pinned data-parallel degree
    max_devices: int | None = None  # use at most this many devices (default: the whole cluster)
    ladder: str = "none"  # "none" | "upper:N" | "auto" | "auto:max=N"
    tp_across_nodes: bool = False  # consider TP groups larger than a node (off: TP stays in a node)
    memory_fraction: float = 0.9  # share of device memory plans may use (rest: runtime, fragmentation)
    time_limit_s: float = 10.0  # CBC time limit per ILP
    search_time_limit_s: float = 60.0  # all ILPs together; candidates left unsolved are reported
    mip_gap: float = 0.01  # relative optimality gap at which CBC stops (1%; reported in SolverInfo.gap)
    ladder_min_saving_fraction: float = LADDER_MIN_SAVING_FRACTION

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "max_devices"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InputError(f"constraint {name} must be >= 1, got {value}")
        if not 0 < self.memory_fraction <= 1:
            raise InputError(f"constraint memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.time_limit_s <= 0:
            raise InputError(f"constraint time_limit_s must be > 0, got {self.time_limit_s}")


@dataclass
class _Candidate:
    mesh: MeshShape
    ctx: CostContext
    graphs: dict[str, LayerGraph]
    ends: LayerGraph
    lower_bound_s: float
    memory_lower_bound_bytes: float
    solution: IlpSolution | None = None
    note: str = ""
    latency_s: float | None = None


@dataclass
class _Search:
    structure: object
    cluster: ClusterSpec
    workload: Workload
    constraints: Constraints
    dtype: str
    layer_keys: list[str]
    ladder: LadderPolicy
    cap_bytes: float
    excluded: list[str] = field(default_factory=list)
    candidates: list[_Candidate] = field(default_factory=list)
    solver_time_s: float = 0.0


def plan_model(
    structure: object,
    cluster: ClusterSpec,
    workload: Workload,
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


# ---------------------------------------------------------------------------------------------
# Set-up and enumeration


def _setup(structure, cluster, workload, constraints) -> _Search:
    dtype = workload.dtype or structure.dtype
    if structure.layers:
        keys = [layer_key(layer) for layer in structure.layers]
    elif structure.mlp_chain:
        keys = ["chain"]
    else:
        raise InputError("the model has neither transformer layers nor linear layers to plan")
    num_layers = len(structure.layers)
    ladder = LadderPolicy.parse(constraints.ladder, num_layers)
    if ladder.mode != "none":
        missing = [i for i in ladder.eligible(num_layers) if not _has_both_blocks(structure.layers[i])]
        if missing:
            raise InputError(
                f"ladder {constraints.ladder!r}: layers {missing} lack an attention or MLP block"
            )
    cap = cluster.device.memory_bytes * constraints.memory_fraction
    return _Search(structure, cluster, workload, constraints, dtype, keys, ladder, cap)


def _has_both_blocks(layer) -> bool:
    return layer.attention is not None and layer.mlp is not None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _head_counts(structure) -> tuple[set[int], set[int]]:
    heads = {layer.attention.num_heads for layer in structure.layers if layer.attention is not None}
    kv = {layer.attention.num_kv_heads for layer in structure.layers if layer.attention is not None}
    return heads, kv


def _tp_options(search: _Search, num_devices: int) -> list[int]:
    c, cluster = search.constraints, search.cluster
    heads, kv = _head_counts(search.structure)
    out = []
    for tp in _divisors(num_devices) if c.tp is None else [c.tp]:
        if c.tp is None and tp > cluster.devices_per_node and not c.tp_across_nodes:
            search.excluded.append(
                f"tp={tp}: spans {math.ceil(tp / cluster.devices_per_node)} nodes "
                f"(TP stays inside a node of {cluster.devices_per_node} unless tp_across_nodes)"
            )
            continue
        bad = sorted(h for h in heads if h % tp)
        if bad and c.tp is None:
            search.excluded.append(f"tp={tp}: {bad[0]} heads not divisible by {tp}")
            continue
        if bad:
            search.excluded.append(
                f"tp={tp} (pinned): {bad[0]} heads not divisible by {tp}; attention stays replicated"
            )
        bad_kv = sorted(h for h in kv if h % tp)
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
    if pp == 1 and w.kind != "train":
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
    for tp, pp, dp in itertools.product(tps, pps, dps):
        if tp * pp * dp > num_devices:
            continue
        for m in _micro_batch_options(search, pp, dp):
            search.candidates.append(_price(search, MeshShape(tp, pp, dp, m)))
    if not search.candidates:
        pinned = {k: getattr(c, k) for k in ("tp", "pp", "dp") if getattr(c, k) is not None}
        raise InfeasibleError(
            f"no mesh shape fits {num_devices} devices with {pinned or 'no pinned degrees'} and batch "
            f"{w.batch_size}; excluded: {'; '.join(search.excluded) or 'none'}"
        )


def _price(search: _Search, mesh: MeshShape) -> _Candidate:
    ctx = CostContext(search.structure, search.cluster, search.workload, mesh, search.dtype)
    s = search.structure
    if s.layers:
        graphs: dict[str, LayerGraph] = {}
        for layer, key in zip(s.layers, search.layer_keys):
            if key not in graphs:
                graphs[key] = build_layer_graph(layer, ctx)
    else:
        graphs = {"chain": build_chain_graph(s.mlp_chain, ctx)}
    ends = build_ends_graph(ctx)
    per_layer_min = {
        k: g.fixed_compute_s + sum(min(o.compute_s for o in op.options) for op in g.ops)
        for k, g in graphs.items()
    }
    ends_min = ends.fixed_compute_s + sum(min(o.compute_s for o in op.options) for op in ends.ops)
    work = sum(per_layer_min[k] for k in search.layer_keys) + ends_min
    bound = work * (1 + (mesh.micro_batches - 1) / mesh.pp)
    memory = _memory_lower_bound(ctx, graphs, ends, len(search.layer_keys))
    return _Candidate(mesh, ctx, graphs, ends, bound, memory)


def _memory_lower_bound(
    ctx: CostContext, graphs: dict[str, LayerGraph], ends: LayerGraph, num_layers: int
) -> float:
    """A lower bound of the largest stage's memory per rank, without solving.

    Every layer needs at least c[s] = min over classes and options of (static + f(s) * activations)
    on stage s, where f(s) is the stage's in-flight micro-batches; spreading L layers fractionally so
    that all stages are equal gives max_s n[s] c[s] >= L / sum_s (1 / c[s]).
    """
    keep = recompute_input_bytes(ctx) if ctx.train else math.inf  # recomputation keeps only the input
    static = min(
        g.fixed_static_bytes + sum(min(o.static_bytes for o in op.options) for op in g.ops)
        for g in graphs.values()
    )
    act = min(
        min(keep, g.fixed_activation_bytes + sum(min(o.activation_bytes for o in op.options) for op in g.ops))
        for g in graphs.values()
    )
    per_stage = [static + in_flight_micro_batches(ctx, s) * act for s in range(ctx.mesh.pp)]
    if min(per_stage) <= 0:
        return 0.0
    ends_static = sum(min(o.static_bytes for o in op.options) for op in ends.ops) / ctx.mesh.pp
    return num_layers / sum(1.0 / c for c in per_stage) + ends_static


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
            ctx=cand.ctx,
            graphs=cand.graphs,
            layer_keys=search.layer_keys,
            ends=cand.ends,
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
        if not sol.feasible:
            cand.note = f"{sol.status}: does not fit {search.cap_bytes / _GIB:.1f} GiB per device"
            continue
        prediction, _ = predict(
            cand.ctx, cand.graphs, search.layer_keys, cand.ends, sol.choices, sol.stages, sol.ladder_layers
        )
        cand.latency_s = prediction.latency_s
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
    choices = _min_memory_choices(closest)
    from planner.solver.baseline import even_stages

    stages = even_stages(len(search.layer_keys), mesh.pp)
    prediction, breakdown = predict(
        closest.ctx, closest.graphs, search.layer_keys, closest.ends, choices, stages, []
    )
    worst = max(range(mesh.pp), key=lambda s: breakdown[s].memory_bytes)
    need = breakdown[worst].memory_bytes
    total = sum(bd.memory_bytes for bd in breakdown) * mesh.tp * mesh.dp  # all ranks' bytes
    devices_needed = math.ceil(total / search.cap_bytes)
    cap_gib = search.cluster.device.memory_bytes / _GIB
    per_node = search.cluster.devices_per_node
    hints = [
        f"about {devices_needed} devices ({math.ceil(devices_needed / per_node)} nodes of {per_node}, e.g. pp across them)"
    ]
    if search.workload.kind == "train":
        hints.append("more micro-batches or a smaller batch (less activation memory)")
    elif search.workload.kind == "decode":
        hints.append("a smaller batch or context (less KV cache)")
    else:
        hints.append("a smaller batch")
    return InfeasibleError(
        f"no plan fits memory: with tp={mesh.tp} pp={mesh.pp} dp={mesh.dp} (the mesh closest to fitting) "
        f"stage {worst} needs {need / _GIB:.1f} GiB, devices have {cap_gib:.1f} GiB "
        f"({search.cap_bytes / _GIB:.1f} GiB usable at memory_fraction {search.constraints.memory_fraction}); "
        f"would fit: {', or '.join(hints)}"
    )


def _min_memory_choices(cand: _Candidate) -> dict[tuple[str, str], str]:
    """Most-sharded strategy (Megatron's, with recomputation when training): the least memory per rank."""
    choices = megatron_choices(cand.graphs, cand.ends)
    if cand.ctx.train:
        choices.update({(key, "recompute"): "full" for key in cand.graphs})
    return choices


# ---------------------------------------------------------------------------------------------
# The Plan


def _make_plan(search: _Search, best: _Candidate | None, model_name: str) -> Plan:
    s, w = search.structure, search.workload
    baseline = _baseline(search)
    if best is None:
        raise _infeasible(search)
    sol = best.solution
    assert sol is not None
    choices, stages, ladder = sol.choices, sol.stages, sol.ladder_layers
    cand_ctx, graphs, ends = best.ctx, best.graphs, best.ends
    decisions: list[Decision] = []
    if (
        baseline is not None
        and baseline.prediction.peak_memory_bytes <= search.cap_bytes
        and baseline.prediction.latency_s < best.latency_s * (1 - 1e-9)
        and _allowed(search, baseline.mesh)
    ):
        bcand = _price(search, baseline.mesh)
        choices, stages, ladder = baseline.choices, baseline.stages, []
        cand_ctx, graphs, ends = bcand.ctx, bcand.graphs, bcand.ends
        decisions.append(Decision("fallback", "megatron", {"search": best.latency_s, "megatron": baseline.prediction.latency_s},
                                  f"the ILP stopped at {sol.status} (gap {sol.gap:.3g}); Megatron's plan is faster"))  # fmt: skip
    prediction, _ = predict(cand_ctx, graphs, search.layer_keys, ends, choices, stages, ladder)
    mesh = cand_ctx.mesh
    decisions = mesh_decision(search.candidates, mesh) + _baseline_decision(search, baseline) + decisions
    decisions += strategy_decisions(search.layer_keys, bool(s.layers), cand_ctx, graphs, ends, choices)
    decisions += ladder_decision(
        search.ladder,
        search.constraints.ladder_min_saving_fraction,
        search.layer_keys,
        cand_ctx,
        graphs,
        ends,
        choices,
        stages,
        ladder,
        prediction.latency_s,
    )
    excluded = list(dict.fromkeys(search.excluded + op_exclusions(graphs, ends)))
    return Plan(
        model=model_name,
        cluster=search.cluster.name,
        workload=w.kind,
        batch_size=w.batch_size,
        seq_len=w.seq_len,
        context=w.context,
        micro_batches=mesh.micro_batches,
        dtype=search.dtype,
        tp=mesh.tp,
        pp=mesh.pp,
        dp=mesh.dp,
        splits=_splits(s, graphs, search.layer_keys, choices, mesh.tp),
        stages=stages if s.layers else [[]],
        ladder_layers=ladder,
        predicted=prediction,
        solver=SolverInfo(sol.status, sol.objective, sol.gap, search.solver_time_s, sol.num_variables),
        decisions=decisions,
        excluded=excluded,
        baseline=baseline.prediction if baseline is not None else None,
        mesh_candidates=[
            MeshCandidate(c.mesh.tp, c.mesh.pp, c.mesh.dp, c.latency_s, f"m={c.mesh.micro_batches}: {c.note}")
            for c in sorted(search.candidates, key=lambda c: (c.latency_s is None, c.latency_s or 0.0))
        ],
        token_model=s.token_model,
        unpriced_ops=s.unknown_ops,
    )


def _allowed(search: _Search, mesh: MeshShape) -> bool:
    """Whether the user's constraints admit `mesh` (pinned degrees, device limit) and a plan without ladder."""
    c = search.constraints
    pinned_ok = all(getattr(c, k) in (None, getattr(mesh, k)) for k in ("tp", "pp", "dp"))
    devices_ok = mesh.num_devices <= (c.max_devices or search.cluster.num_devices)
    return pinned_ok and devices_ok and search.ladder.mode != "upper"


def _baseline(search: _Search) -> BaselinePlan | None:
    """The plan a Megatron-LM user writes by hand: TP = a node's devices (dividing the heads); for
    inference PP = the nodes; for training the fewest pipeline stages (a divisor of the nodes) whose
    memory fits (with full activation recomputation if needed), and DP over the remaining nodes (GPT-3 175B on 128 nodes: TP 8, PP 16, DP 8)."""
    s, cluster, w = search.structure, search.cluster, search.workload
    cap = search.constraints.max_devices
    if cap is not None and cap < cluster.num_devices:  # the hand-written plan gets the same devices
        dpn = min(cluster.devices_per_node, cap)
        cluster = dataclasses.replace(cluster, num_nodes=max(1, cap // dpn), devices_per_node=dpn)
    heads, _ = _head_counts(s)
    num_heads = math.gcd(*heads) if heads else None
    mesh = megatron_mesh(cluster, w, num_heads, len(s.layers) or 1)
    if not s.layers:
        mesh = MeshShape(mesh.tp, 1, 1, 1)
    candidates = [mesh]
    if w.kind == "train" and s.layers and cluster.num_nodes > 1:
        nodes = cluster.num_nodes
        candidates = []
        for pp in (d for d in range(1, nodes + 1) if nodes % d == 0 and d <= len(s.layers)):
            dp = nodes // pp
            if w.batch_size % dp:
                continue
            per_replica = w.batch_size // dp
            m = w.micro_batches or max(
                d for d in range(1, min(per_replica, 4 * pp if pp > 1 else 1) + 1) if per_replica % d == 0
            )
            candidates.append(MeshShape(mesh.tp, pp, dp, m))
    chosen = None
    for cand_mesh in candidates:
        if w.batch_size % (cand_mesh.dp * cand_mesh.micro_batches):
            continue
        cand = _price(search, cand_mesh)
        for recompute in (False, True) if w.kind == "train" else (False,):
            chosen = baseline_plan(cand.ctx, cand.graphs, search.layer_keys, cand.ends, recompute=recompute)
            if chosen.prediction.peak_memory_bytes <= search.cap_bytes:
                return chosen
    return chosen


def _baseline_decision(search: _Search, baseline: BaselinePlan | None) -> list[Decision]:
    if baseline is None:
        return []
    b, m = baseline.prediction, baseline.mesh
    fits = b.peak_memory_bytes <= search.cap_bytes
    reason = f"hand-written Megatron layout ({m.micro_batches} micro-batches); " + (
        "fits memory"
        if fits
        else f"does not fit: {b.peak_memory_bytes / _GIB:.1f} GiB/rank > {search.cap_bytes / _GIB:.1f} GiB usable"
    )
    return [Decision("megatron-baseline", f"tp={m.tp} pp={m.pp} dp={m.dp}", {"latency": b.latency_s}, reason)]


def _splits(structure, graphs, layer_keys, choices, tp: int) -> dict[str, WeightSplit]:
    """WeightSplit per weight FQN: colwise splits the output dim, rowwise the input dim."""
    splits: dict[str, WeightSplit] = {}

    def add(proj, style: str) -> None:
        out_dim = proj.weight_out_dim
        if style == "colwise" or style == "vocab":
            dim = out_dim
        elif style == "rowwise":
            dim = 1 - out_dim
        else:
            dim = 0
        parts = list(proj.parts) if proj.parts and style == "colwise" else None
        splits[proj.weight] = WeightSplit(proj.weight, style, dim, parts)

    if structure.layers:
        for layer, key in zip(structure.layers, layer_keys):
            for name, proj in layer_projection_ops(layer).items():
                add(proj, choices[(key, name)])
    else:
        for name, proj in mlp_op_names(structure.mlp_chain).items():
            add(proj, choices[("chain", name)])
    for i, emb in enumerate(structure.embeddings):
        style = choices[("ends", f"embedding{i}")]
        splits[emb.weight] = WeightSplit(emb.weight, "vocab" if style == "vocab" else "replicate", 0, None)
    if structure.lm_head is not None and structure.lm_head.weight not in splits:
        add(structure.lm_head, choices[("ends", "lm_head")])
    return splits

"""The inner ILP: strategies, pipeline stages, ladder residual and memory for one mesh, in one PuLP model.

The outer search (`planner.solver.search`) fixes the mesh candidate (tp, pp, dp, micro-batches m,
pipeline schedule: a `MeshConfig`) and prices it (`CostTables`); this module builds and solves one
mixed-integer program for it with CBC and returns an `IlpSolution` holding an `Assignment`. Notation: graphs g (one per class of
identical layers, plus the "ends": embedding and LM head), ops o of g, options k of o (costs from
`planner.solver.costing`), layers l = 0..L-1 of class g(l), stages s = 0..p-1.

Units inside the model: seconds and GiB (`GIB`): with bytes the coefficients would span 17 orders of
magnitude and CBC returned non-optimal "optimal" plans.

Variables
    x[g,o,k] in {0,1}     op o of class g uses option k (shared by every layer of class g, so the
                          model does not grow with depth)                    `_strategy_variables`
    e[g,u,v,k,j] in [0,1] edge u->v carries u's option k into v's option j  `_edge_variables`
    lad[l] in {0,1}       layer l uses ladder residual (only allowed layers) `_ladder_variables`
    qa[g], qm[g] >= 0     exposed block-output comm of a laddered layer of g `_ladder_variables`
    za[l], zm[l] >= 0     exposed block-output comm of layer l (auto ladder) `_ladder_variables`
    beta[b,j] in {0,1}    stage b (1..p-1) starts at layer j (j in a window) `_stage_variables`
    y[l,s], v[l,s], w[l,s] >= 0   time / memory / gradient bytes of a window layer l if in stage s
    T >= 0                slowest stage time per micro-batch; Tail >= 0: DP gradient sync + optimizer
    rf[g], rs[g] in {0,1} training: class g recomputes its whole forward in backward (full: keeps only
                          its input) or only its attention core (selective: keeps no scores)

Constraints (each family is named by the prefix of its constraint names)
    onehot_*        sum_k x[g,o,k] = 1                                          `_strategy_variables`
    edge_src_*, edge_dst_*   sum_j e[..k,j] = x[g,u,k];  sum_k e[..k,j] = x[g,v,j]   `_edge_variables`
                    (pairs whose conversion is impossible, e.g. P into a nonlinearity, have no e)
    tied_*          tied embedding / LM head choose the same split            `_strategy_variables`
    tied_emb_*      embeddings of one weight (encoder, decoder) the same split `_strategy_variables`
    kv_*            a layer's K and V projections the same split (exact ties at  `_strategy_variables`
                    MQA were broken apart: K replicated, V cut into pieces)
    ladder_att_*, ladder_mlp_*   qa[g] >= comm_att[g] - eta * compute_mlp[g]  (eta = overlap_efficiency)
    ladder_auto_*   za[l] >= comm_att[g] - M lad[l],  za[l] >= qa[g]  (zm alike)   `_ladder_variables`
    ladder_upper_*  lad[l] <= lad[l+1]: laddered layers are contiguous with the top   `_ladder_variables`
                    (auto without a loss budget: equal layers gain equally, the paper ladders the top;
                    with one, the measured sensitivities choose, so any subset is allowed)
    ladder_loss     sum_l s[l] lad[l] <= X: measured per-layer loss increases s within the budget X
    ladder_nogood_* sum_{l in S} lad[l] - sum_{l not in S} lad[l] <= |S| - 1: the set S, measured over
                    X as a whole, is not chosen again (`LadderBudget`; auto ladder only)   `_ladder_budget`
    start_*         sum_j beta[b,j] = 1;  order_*: start(b) + 1 <= start(b+1)     `_stage_variables`
    stime_*, smem_*, sgrad_*   y[l,s] >= t[l] - M (1 - a[l,s])  (a[l,s] = [l in stage s], linear in beta;
                    only for layers inside a window, the others' a is a constant)   `_product`
    slowest_*       T >= S[s] = sum_l a[l,s] t[l] + ends(s) + p2p;  T >= sum_s S[s] / p   `_stage_time`
    memory_*        sum_l a[l,s] (static[l] + f(s) act[l]) + ends(s) + transient <= cap   `_memory_constraints`
                    (f(s): micro-batches stage s holds under the schedule, `in_flight_micro_batches`)
    recompute_*     rf[g] + rs[g] <= 1; act[g] -> act[g] - ra[g] + rf[g] input_bytes - sa[g]
                    (ra <= act, ra <= M rf; sa <= scores[g], sa <= M rs); time += rt[g] + st[g],
                    rt >= fwd[g] - M (1 - rf), st >= core_fwd[g] - M (1 - rs)       `_recompute`
    tail_*          Tail >= alpha + beta * grad_bytes[s]   (training: DP all-reduce + optimizer)  `_tail`

Objective (`_objective`): one step's time (`costing.step_time_s` of the total and T)
    sum_l t[l] + ends + p2p + (m-1) T + Tail + penalty * sum_l lad[l] + BALANCE_TIE_BREAK * T
(interleaved 1F1B with v chunks per rank: (sum_l t[l] + ends + p2p) / v + (m - 1/v) T, the layers split
evenly into p v chunks, chunk c on rank c mod p, `_interleaved_stages`)
where t[l] = compute[g] + internal_comm[g] + exposed_comm[l]; exposed is comm_att + comm_mlp for a
standard layer and qa + qm (or za + zm) for a laddered one. With one stage, T = sum_l t[l] + ends.
The ladder penalty (`LADDER_MIN_SAVING_FRACTION` of a layer's time) makes the solver ladder a layer
only if it saves more than that: ladder residual changes the function the model computes.
Stage boundaries are searched in a window around the split that balances a reference layer time
(`stage_windows`); with identical layers the optimum lies within a layer or two of the even split.
Deep pipelines (more than `MAX_BOUNDARY_BINARIES` boundary binaries, e.g. pp=32 over 126 layers) would
make the big-M stage products slow to close in CBC: there the split comes from `balanced_split` (exact
for contiguous splits: bisection on the slowest stage + greedy fill under the memory cap) on the
per-layer costs, the ILP is solved with that split fixed, and the two alternate until the split
repeats (`_solve_with_split_search`). The split ignores how the stages' DP gradient sync differs, so
it may be a few percent from the joint optimum there; the window ILP is exact but slow to close.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass

import pulp

from planner.plan import DataParallel, Layout, Recompute
from planner.solver.costing import (
    TRAIN_COMM_FACTOR,
    TRAIN_COMPUTE_FACTOR,
    CostContext,
    CostTables,
    LayerGraph,
    conversion_time_s,
    dp_phase_costs,
    expert_grad_weight,
    grad_accumulation_cost,
    gradient_sync_cost,
    head_split_queries,
    in_flight_micro_batches,
    interleaved_chunks,
    optimizer_step_cost,
    output_held_bytes,
    pipeline_buffer_bytes,
    recompute_input_bytes,
    stage_p2p_time_s,
    step_time_s,
    stream_conversion_time_s,
    transient_bytes,
    unhidden_sync_cost,
)
from planner.solver.problem import (
    LADDER_MIN_SAVING_FRACTION,
    Assignment,
    LadderBudget,
    LadderMode,
    LadderPolicy,
)
from planner.solver.stages import balanced_split, rebalance, reference_costs, solution_costs

BALANCE_TIE_BREAK = 1e-3  # weight of the slowest stage when (m-1) = 0: balance stages among equal plans
WINDOW_FRACTION = 0.25  # stage-boundary window: +-25% of the layers per stage around the balanced split
MIN_WINDOW = 2  # ... and at least +-2 layers
MAX_BOUNDARY_BINARIES = 20  # deeper pipelines: stage split by `balanced_split`, alternating with the ILP
MAX_SPLIT_ROUNDS = 3
GIB = 2.0**30  # the ILP counts memory in GiB: with bytes, coefficients would span 1e-6 s .. 1e11 B


R = Layout.REPLICATE


@dataclass
class IlpProblem:
    """Inputs of one ILP: a mesh candidate's cost tables and the user's constraints."""

    tables: CostTables  # the candidate's context (mesh, micro-batches, schedule), layer graphs and ends
    ladder: LadderPolicy  # resolved for the model (`LadderPolicy.for_layers`)
    memory_cap_bytes: float | None  # per device; None: no memory constraint
    time_limit_s: float = 10.0
    mip_gap: float = 0.01  # relative gap at which CBC stops
    windows: list[list[int]] | None = None  # candidate first layers of stages 1..p-1 (None: `stage_windows`)
    ladder_min_saving_fraction: float = LADDER_MIN_SAVING_FRACTION
    ladder_budget: LadderBudget | None = None  # auto ladder: measured quality budget
    recompute: Recompute | None = None  # training: pinned for every class (None: the ILP chooses)

    @property
    def ctx(self) -> CostContext:
        return self.tables.ctx

    @property
    def graphs(self) -> dict[str, LayerGraph]:
        return self.tables.graphs

    @property
    def layer_keys(self) -> list[str]:
        return self.tables.layer_keys

    @property
    def ends(self) -> LayerGraph:
        return self.tables.ends


@dataclass
class IlpSolution:
    """The solver's answer for one mesh."""

    status: str  # pulp.LpSolution[sol_status]
    feasible: bool
    objective: float  # seconds (inf when infeasible)
    gap: float  # relative optimality gap (0: proven optimal; inf: unknown)
    time_s: float  # CBC wall time
    num_variables: int
    num_constraints: int
    assignment: Assignment | None = None  # None when not feasible


@dataclass
class _GraphTerms:
    """Linear expressions of one class of layers: seconds per micro-batch, GiB per rank."""

    compute_attention: pulp.LpAffineExpression
    compute_mlp: pulp.LpAffineExpression
    comm_attention: pulp.LpAffineExpression  # the attention block's output converted to R
    comm_mlp: pulp.LpAffineExpression  # the MLP block's output converted to R
    base: pulp.LpAffineExpression  # everything else: compute, conversions inside, op collectives, recompute
    static: pulp.LpAffineExpression  # GiB: parameters (+ gradients and optimizer state)
    act: pulp.LpAffineExpression  # GiB per in-flight micro-batch
    grad: pulp.LpAffineExpression  # GiB of gradients (DP all-reduce and optimizer step)

    def standard_time(self) -> pulp.LpAffineExpression:
        """Time of a layer without ladder residual: every block output exposed."""
        return self.base + self.comm_attention + self.comm_mlp


@dataclass
class _EndTerms:
    """Linear expressions of one end of the pipeline (embedding, or final norm + LM head)."""

    time: pulp.LpAffineExpression  # seconds per micro-batch
    static: pulp.LpAffineExpression  # GiB
    activation: pulp.LpAffineExpression  # GiB per in-flight micro-batch
    grad: pulp.LpAffineExpression  # GiB


def _name(*parts: object) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", "_".join(str(p) for p in parts))


class _Builder:
    """Builds the model family by family; each `_...` method documents its constraint family."""

    def __init__(self, prob: IlpProblem) -> None:
        self.p = prob
        self.ctx = prob.ctx
        self.m = pulp.LpProblem("plan", pulp.LpMinimize)
        self.gid = {key: f"g{i}" for i, key in enumerate(prob.graphs)}
        self.gid["ends"] = "ends"
        self.x: dict[tuple[str, str], dict[str, pulp.LpVariable]] = {}
        self.num_layers = len(prob.layer_keys)
        self.recompute: dict[str, tuple[pulp.LpVariable, pulp.LpVariable]] = {}  # key -> (rf, rs)
        self.working: pulp.LpVariable | None = None  # `_working`
        self.lad: dict[int, pulp.LpVariable] = {}
        # a byte of expert gradients (reduced over the edp group) against a dense one in the tail's fit
        self._expert_grad_weight = expert_grad_weight(self.ctx)

    # -- strategies ------------------------------------------------------------------------
    def _strategy_variables(self) -> None:
        """x[g,o,k] one-hot per op (onehot_*); a head-parallel attention core only under a column-parallel
        query projection (headq_*: `costing.head_split_queries`); tied embedding / LM head (tied_*)."""
        for key, graph in [*self.p.graphs.items(), ("ends", self.p.ends)]:
            for op in graph.ops:
                xs = {
                    o.name: self.m.add_variable(_name("x", self.gid[key], op.name, o.name), cat="Binary")
                    for o in op.options
                }
                self.x[(key, op.name)] = xs
                self.m += pulp.lpSum(xs.values()) == 1, _name("onehot", self.gid[key], op.name)
            for core, query in head_split_queries(graph):  # head-parallel core: its query column-parallel
                colwise = self.x[(key, query)].get("colwise", 0)
                self.m += self.x[(key, core)]["head"] <= colwise, _name("headq", self.gid[key], core, query)
            names = {op.name for op in graph.ops}
            for k, v in (("k", "v"), ("cross.k", "cross.v")):
                if k in names and v in names:  # one split for K and V, as every target writes them
                    xk, xv = self.x[(key, k)], self.x[(key, v)]
                    for name in set(xk) | set(xv):
                        self.m += xk.get(name, 0) == xv.get(name, 0), _name("kv", self.gid[key], k, name)
        s = self.ctx.structure
        if s.tied_lm_head and s.embeddings and s.lm_head is not None:
            emb, head = self.x[("ends", "embedding0")], self.x[("ends", "lm_head")]
            for name in set(emb) | set(head):
                if name in emb and name in head:
                    self.m += emb[name] == head[name], _name("tied", name)
                else:
                    self.m += (emb.get(name) or head.get(name)) == 0, _name("tied_only", name)
        first_of: dict[str, str] = {}  # embeddings of one weight (T5's encoder and decoder lookups)
        for op in self.p.ends.ops:
            if op.block != "embedding" or op.weight is None:
                continue
            first = first_of.setdefault(op.weight, op.name)
            if first == op.name:
                continue
            a, b = self.x[("ends", first)], self.x[("ends", op.name)]
            for name in set(a) | set(b):
                if name in a and name in b:
                    self.m += a[name] == b[name], _name("tied_emb", op.name, name)
                else:
                    self.m += (a.get(name) or b.get(name)) == 0, _name("tied_emb_only", op.name, name)

    def _edge_variables(self, key: str, graph: LayerGraph) -> pulp.LpAffineExpression:
        """e[..] linearising x[u,k] * x[v,j] (edge_src_*, edge_dst_*); returns the conversion time."""
        cost = []
        for u, v in graph.edges():
            src, dst = graph.op(u), graph.op(v)
            e: dict[tuple[str, str], pulp.LpVariable] = {}
            for k in src.options:
                for j in dst.options:
                    t = conversion_time_s(k.out_layout, j.in_layout, src.out_bytes, self.ctx)
                    if math.isinf(t):
                        continue
                    var = self.m.add_variable(_name("e", self.gid[key], u, v, k.name, j.name), 0, 1)
                    e[(k.name, j.name)] = var
                    cost.append(t * var)
            for k in src.options:
                self.m += (
                    pulp.lpSum(var for (a, _), var in e.items() if a == k.name) == self.x[(key, u)][k.name],
                    _name("edge_src", self.gid[key], u, v, k.name),
                )
            for j in dst.options:
                self.m += (
                    pulp.lpSum(var for (_, b), var in e.items() if b == j.name) == self.x[(key, v)][j.name],
                    _name("edge_dst", self.gid[key], u, v, j.name),
                )
        return pulp.lpSum(cost)

    def _graph_terms(self, key: str, graph: LayerGraph) -> _GraphTerms:
        """Linear expressions of one graph: compute per block, output comm per block, totals, memory."""
        x = self.x
        compute: dict[str, pulp.LpAffineExpression] = {}
        comm: dict[str, pulp.LpAffineExpression] = {}
        for block in ("attention", "mlp"):
            compute[block] = pulp.lpSum(
                o.compute_s * x[(key, op.name)][o.name] for op in graph.timed_ops(block) for o in op.options
            )
            out = graph.block_outputs.get(block)
            if out is None:
                comm[block] = pulp.LpAffineExpression()
                continue
            op = graph.op(out)
            comm[block] = pulp.lpSum(
                stream_conversion_time_s(o.out_layout, op.out_bytes, self.ctx) * x[(key, out)][o.name]
                for o in op.options
            )
        internal = self._edge_variables(key, graph)
        op_comm = pulp.lpSum(o.comm_s * x[(key, op.name)][o.name] for op in graph.ops for o in op.options)

        def per_rank_gib(fixed_bytes: float, attr: str) -> pulp.LpAffineExpression:
            return fixed_bytes / GIB + pulp.lpSum(
                getattr(o, attr) / GIB * x[(key, op.name)][o.name] for op in graph.ops for o in op.options
            )

        terms = _GraphTerms(
            compute_attention=compute["attention"],
            compute_mlp=compute["mlp"],
            comm_attention=comm["attention"],
            comm_mlp=comm["mlp"],
            base=compute["attention"]
            + compute["mlp"]
            + internal
            + op_comm
            + graph.fixed_compute_s
            + graph.fixed_comm_s,
            static=per_rank_gib(graph.fixed_static_bytes, "static_bytes"),
            act=per_rank_gib(graph.fixed_activation_bytes, "activation_bytes"),
            grad=pulp.LpAffineExpression(),
        )
        if graph.dispatch_s > 0:  # the host issues the layer's nodes no faster than this: max(kernels, it)
            floor = self.m.add_variable(_name("dispatch", self.gid[key]), 0)
            kernels = compute["attention"] + compute["mlp"] + graph.fixed_compute_s
            self.m += floor >= graph.dispatch_s - kernels, _name("dispatch_floor", self.gid[key])
            terms.base = terms.base + floor
        if self.ctx.train:
            self._recompute(key, graph, terms, internal + op_comm + graph.fixed_comm_s)
        terms.grad = per_rank_gib(
            graph.fixed_grad_bytes + self._expert_grad_weight * graph.expert_grad_bytes, "grad_bytes"
        )
        return terms

    def _recompute(
        self, key: str, graph: LayerGraph, terms: _GraphTerms, internal_comm: pulp.LpAffineExpression
    ) -> None:
        """recompute_*: training chooses per class none, selective or full activation recomputation.

        rf[g], rs[g] in {0,1}, rf + rs <= 1 (recompute_one). Full keeps only each layer's input:
        activations become act - ra + rf * input_bytes (ra <= act, ra <= M rf) and the time gains
        rt >= forward compute + forward comm - M (1 - rf) (forward: a third of the training compute
        plus `OpOption.full_extra_s`). Selective (attention core only) drops the
        stored scores: act - sa (sa <= scores, sa <= M rs) and the time gains st >= core forward -
        M (1 - rs). A pinned `IlpProblem.recompute` fixes rf and rs.
        """
        gid = self.gid[key]
        rf = self.m.add_variable(_name("r", gid), cat="Binary")
        rs = self.m.add_variable(_name("rs", gid), cat="Binary")
        self.recompute[key] = (rf, rs)
        self.m += rf + rs <= 1, _name("recompute_one", gid)
        x = self.x
        scores = [
            (o.selective_bytes, o.selective_s, x[(key, op.name)][o.name])
            for op in graph.ops
            for o in op.options
        ]
        has_core = any(nbytes > 0 for nbytes, _, _ in scores)  # stores scores selective would drop
        core_op = any(seconds > 0 for _, seconds, _ in scores)  # an attention core to recompute at all
        pinned = self.p.recompute
        if (
            not graph.backward
        ):  # run forward only (no gradient reaches it): nothing to recompute, pinned or not
            self.m += rf == 0, _name("recompute_no_backward", gid)
            self.m += rs == 0, _name("recompute_no_backward_sel", gid)
        elif pinned is not None:  # the user's choice, even where it saves no memory (a fused kernel)
            self.m += rf == int(pinned is Recompute.FULL), _name("recompute_pin_full", gid)
            self.m += rs == int(pinned is Recompute.SELECTIVE and core_op), _name("recompute_pin_sel", gid)
        elif not has_core:
            self.m += rs == 0, _name("recompute_no_core", gid)
        ra = self.m.add_variable(_name("ra", gid), 0)
        self.m += ra <= terms.act, _name("recompute_act", gid)
        self.m += ra <= self._memory_bound(key, 1) * rf, _name("recompute_act_on", gid)
        sa = self.m.add_variable(_name("sa", gid), 0)
        self.m += sa <= pulp.lpSum(b / GIB * var for b, _, var in scores), _name("recompute_sel_act", gid)
        self.m += sa <= max([b for b, _, _ in scores], default=0.0) / GIB * rs, _name("recompute_sel_on", gid)
        # the layer's backward holds its forward's activations again for a moment: the largest such
        # working set of any fully recomputed class is in every stage's peak (`recompute_working_bytes`)
        kept = recompute_input_bytes(self.ctx) / GIB
        self.m += (
            self._working() >= terms.act - kept - self._memory_bound(key, 1) * (1 - rf),
            _name("recompute_working", gid),
        )
        terms.act = terms.act - ra - sa + kept * rf
        forward = (terms.compute_attention + terms.compute_mlp + graph.fixed_compute_s) / TRAIN_COMPUTE_FACTOR
        forward += pulp.lpSum(
            o.full_extra_s * x[(key, op.name)][o.name] for op in graph.ops for o in op.options
        )
        forward_comm = (internal_comm + terms.comm_attention + terms.comm_mlp) / TRAIN_COMM_FACTOR
        rt = self.m.add_variable(_name("rt", gid), 0)
        self.m += (
            rt >= forward + forward_comm - self._time_bound(key) * (1 - rf),
            _name("recompute_time", gid),
        )
        if graph.forward_dispatch_s > 0:  # the host issues the forward's nodes again: max(kernels, it)
            self.m += (
                rt >= graph.forward_dispatch_s + forward_comm - self._time_bound(key) * (1 - rf),
                _name("recompute_dispatch", gid),
            )
        st = self.m.add_variable(_name("st", gid), 0)
        core_forward = pulp.lpSum(t * var for _, t, var in scores)
        self.m += st >= core_forward - self._time_bound(key) * (1 - rs), _name("recompute_sel_time", gid)
        terms.base = terms.base + rt + st

    def _working(self) -> pulp.LpVariable:
        """recompute_working (GiB): at least the working set of every fully recomputed class (its
        activations beyond the kept input, `costing.recompute_working_bytes`), added to each stage's
        memory; for pipelines this counts it on stages that hold no layer of that class too (the
        prediction, per stage, is exact)."""
        if self.working is None:
            self.working = self.m.add_variable("recompute_working", 0)
        return self.working

    def _ends_terms(self) -> tuple[_EndTerms, _EndTerms]:
        """(first, last): the embedding (first stage) and the final norm + LM head (last stage)."""
        x, ends = self.x, self.p.ends

        def end(block: str) -> _EndTerms:
            ops = ends.ops_of(block)

            def gib(attr: str) -> pulp.LpAffineExpression:
                return pulp.lpSum(
                    getattr(o, attr) / GIB * x[("ends", op.name)][o.name] for op in ops for o in op.options
                )

            time_s = pulp.lpSum(
                (o.compute_s + o.comm_s) * x[("ends", op.name)][o.name] for op in ops for o in op.options
            )
            return _EndTerms(time_s, gib("static_bytes"), gib("activation_bytes"), gib("grad_bytes"))

        first, last = end("embedding"), end("head")
        last.time += ends.last_stage_compute_s
        first.time += ends.first_stage_compute_s  # nodes before the first layer (RoPE tables, masks)
        for name, part, dispatch_s in (
            ("first", first, ends.first_stage_dispatch_s),
            ("last", last, ends.last_stage_dispatch_s),
        ):  # the host's issue time of the nodes (`LayerGraph.dispatch_s`): max(their time, it)
            if dispatch_s > 0:
                floor = self.m.add_variable(_name("dispatch_ends", name), 0)
                self.m += floor >= dispatch_s - part.time, _name("dispatch_ends_floor", name)
                part.time += floor
        first.static += ends.fixed_static_bytes / GIB  # parameters outside the layers, on the first stage
        first.grad += ends.fixed_grad_bytes / GIB
        s = self.ctx.structure
        if s.tied_lm_head and self.ctx.mesh.pp > 1:  # the last stage holds its own copy of the tied weight
            last.static += first.static
            last.grad += first.grad
        return first, last

    # -- ladder ----------------------------------------------------------------------------
    def _ladder_variables(self, terms: dict[str, _GraphTerms]) -> dict[int, pulp.LpAffineExpression]:
        """Exposed block-output comm per layer (ladder_att_*, ladder_mlp_*, ladder_auto_*, ladder_upper_*).

        Returns the exposed-comm expression of every laddered or ladder-eligible layer; the others
        expose comm_attention + comm_mlp of their class.
        """
        policy, eta = self.p.ladder, self.ctx.cluster.overlap_efficiency
        # hidden comm h costs sigma h of the compute it hides under (`costing.contention_s`): exposed
        # comm - (1 - sigma) min(comm, eta compute) = max(sigma comm, comm - (1 - sigma) eta compute)
        sigma = self.ctx.cluster.overlap_slowdown
        eligible = policy.eligible(self.num_layers)
        exposed: dict[int, pulp.LpAffineExpression] = {}
        if not eligible:
            return exposed
        q: dict[str, tuple[pulp.LpVariable, pulp.LpVariable]] = {}
        for key in {self.p.layer_keys[i] for i in eligible}:
            t = terms[key]
            qa = self.m.add_variable(_name("qa", self.gid[key]), 0)
            qm = self.m.add_variable(_name("qm", self.gid[key]), 0)
            hide = (1.0 - sigma) * eta
            self.m += qa >= t.comm_attention - hide * t.compute_mlp, _name("ladder_att", self.gid[key])
            self.m += qm >= t.comm_mlp - hide * t.compute_attention, _name("ladder_mlp", self.gid[key])
            if sigma:
                self.m += qa >= sigma * t.comm_attention, _name("ladder_att_contention", self.gid[key])
                self.m += qm >= sigma * t.comm_mlp, _name("ladder_mlp_contention", self.gid[key])
            q[key] = (qa, qm)
        for i in eligible:
            key = self.p.layer_keys[i]
            qa, qm = q[key]
            if policy.mode is LadderMode.UPPER:
                exposed[i] = qa + qm
                continue
            t = terms[key]
            lad = self.m.add_variable(_name("lad", i), cat="Binary")
            self.lad[i] = lad
            za = self.m.add_variable(_name("za", i), 0)
            zm = self.m.add_variable(_name("zm", i), 0)
            big_a, big_m = self._comm_bound(key, "attention"), self._comm_bound(key, "mlp")
            self.m += za >= t.comm_attention - big_a * lad, _name("ladder_auto_att", i)
            self.m += zm >= t.comm_mlp - big_m * lad, _name("ladder_auto_mlp", i)
            self.m += za >= qa, _name("ladder_auto_att_min", i)
            self.m += zm >= qm, _name("ladder_auto_mlp_min", i)
            exposed[i] = za + zm
        if self.p.ladder_budget is None:
            for i in sorted(self.lad)[:-1]:
                self.m += self.lad[i] <= self.lad[i + 1], _name("ladder_upper", i)
        self._ladder_budget()
        return exposed

    def _ladder_budget(self) -> None:
        """ladder_loss and ladder_nogood_*: the measured quality budget of an auto ladder."""
        budget = self.p.ladder_budget
        if budget is None or not self.lad:
            return
        self.m += (
            pulp.lpSum(budget.cost(i) * var for i, var in self.lad.items()) <= budget.limit,
            "ladder_loss",
        )
        for k, excluded in enumerate(budget.excluded):
            inside = [var for i, var in self.lad.items() if i in excluded]
            outside = [var for i, var in self.lad.items() if i not in excluded]
            if len(inside) != len(excluded):  # a set with a layer not eligible here cannot be chosen
                continue
            self.m += (
                pulp.lpSum(inside) - pulp.lpSum(outside) <= len(excluded) - 1,
                _name("ladder_nogood", k),
            )

    def _comm_bound(self, key: str, block: str) -> float:
        graph = self.p.graphs[key]
        out = graph.block_outputs.get(block)
        if out is None:
            return 0.0
        op = graph.op(out)
        return max(stream_conversion_time_s(o.out_layout, op.out_bytes, self.ctx) for o in op.options)

    def _time_bound(self, key: str) -> float:
        """Upper bound of one layer's time (big-M of the stage linearisation)."""
        graph = self.p.graphs[key]
        t = graph.fixed_compute_s + graph.fixed_comm_s + graph.dispatch_s
        t += sum(max(o.compute_s + o.comm_s for o in op.options) for op in graph.ops)
        for u, _v in graph.edges():
            src = graph.op(u)
            t += max(
                (
                    c
                    for k in src.options
                    for lay in (Layout.REPLICATE, Layout.SHARD)
                    if not math.isinf(c := conversion_time_s(k.out_layout, lay, src.out_bytes, self.ctx))
                ),
                default=0.0,
            )
        t += self._comm_bound(key, "attention") + self._comm_bound(key, "mlp")
        # training: a recomputation (full or selective, one at most) runs at most the layer once more
        return 2.0 * t if self.ctx.train else t

    # -- stages ----------------------------------------------------------------------------
    def _stage_variables(
        self, windows: list[list[int]]
    ) -> dict[tuple[int, int], pulp.LpAffineExpression | int]:
        """beta[b,j]: stage b starts at layer j (start_*, order_*). Returns a[l,s] (0/1 constants or expressions)."""
        pp, L = self.ctx.mesh.pp, self.num_layers
        self.beta: dict[int, dict[int, pulp.LpVariable]] = {}
        starts: dict[int, pulp.LpAffineExpression] = {}
        for b in range(1, pp):
            self.beta[b] = {j: self.m.add_variable(_name("beta", b, j), cat="Binary") for j in windows[b - 1]}
            self.m += pulp.lpSum(self.beta[b].values()) == 1, _name("start", b)
            starts[b] = pulp.lpSum(j * var for j, var in self.beta[b].items())
        for b in range(1, pp - 1):
            self.m += starts[b] + 1 <= starts[b + 1], _name("order", b)

        def g(b: int, layer: int) -> pulp.LpAffineExpression | int:
            """[stage b starts at or before layer]."""
            if b == 0:
                return 1
            if b == pp:
                return 0
            win = windows[b - 1]
            if layer < win[0]:
                return 0
            if layer >= win[-1]:
                return 1
            return pulp.lpSum(var for j, var in self.beta[b].items() if j <= layer)

        a: dict[tuple[int, int], pulp.LpAffineExpression | int] = {}
        for s in range(pp):
            for layer in range(L):
                lo, hi = g(s, layer), g(s + 1, layer)
                if isinstance(lo, int) and isinstance(hi, int):
                    if lo - hi:
                        a[(layer, s)] = 1
                    continue
                a[(layer, s)] = lo - hi
        return a

    def _interleaved_stages(self) -> dict[tuple[int, int], int]:
        """Interleaved 1F1B: the layers in p v chunks (`interleaved_chunks`), chunk c on pipeline rank
        c mod p. Returns a[l, s] = 1 for rank s of layer l."""
        pp, v = self.ctx.mesh.pp, self.ctx.virtual_stages
        chunks = interleaved_chunks(self.num_layers, pp, v)
        return {(layer, c % pp): 1 for c, chunk in enumerate(chunks) for layer in chunk}

    def _product(self, prefix: str, layer: int, stage: int, expr, a, bound: float) -> pulp.LpVariable:
        """y >= expr - bound * (1 - a), y >= 0: equals expr * a at the optimum (stime_/smem_/sgrad_*)."""
        y = self.m.add_variable(_name({"stime": "y", "smem": "v", "sgrad": "w"}[prefix], layer, stage), 0)
        self.m += y >= expr - bound * (1 - a), _name(prefix, layer, stage)
        return y

    # -- assembly --------------------------------------------------------------------------
    def build(self) -> None:
        p, ctx = self.p, self.ctx
        mesh = ctx.mesh
        self._strategy_variables()
        terms = {key: self._graph_terms(key, g) for key, g in p.graphs.items()}
        ends = self.ends = self._ends_terms()
        exposed = self._ladder_variables(terms)
        keys = p.layer_keys

        def layer_time(i: int) -> pulp.LpAffineExpression:
            t = terms[keys[i]]
            return t.base + exposed.get(i, t.comm_attention + t.comm_mlp)

        p2p = [stage_p2p_time_s(ctx, s) for s in range(mesh.pp)]
        counts: dict[str, int] = {}
        for i, key in enumerate(keys):
            if i not in exposed:
                counts[key] = counts.get(key, 0) + 1
        first, last = ends
        total = (
            pulp.lpSum(n * terms[k].standard_time() for k, n in counts.items())
            + pulp.lpSum(layer_time(i) for i in exposed)
            + first.time
            + last.time
            + sum(p2p)
        )
        self.total = total
        stage_time: list[pulp.LpAffineExpression] = []
        stage_static: list = []
        stage_act: list = []
        stage_grad: list = []
        if mesh.pp == 1:
            stage_time.append(total)
            stage_static.append(pulp.lpSum(n * terms[k].static for k, n in self._class_counts().items()))
            stage_act.append(pulp.lpSum(n * terms[k].act for k, n in self._class_counts().items()))
            stage_grad.append(pulp.lpSum(n * terms[k].grad for k, n in self._class_counts().items()))
        else:
            if ctx.virtual_stages > 1:
                a = self._interleaved_stages()
            else:
                a = self._stage_variables(stage_windows(self.p))
            for s in range(mesh.pp):
                f = in_flight_micro_batches(ctx, s)
                st, sm, sg = [], [], []
                certain: dict[str, int] = {}
                for i in range(self.num_layers):
                    if (i, s) not in a:
                        continue
                    key = keys[i]
                    mem_i = terms[key].static + f * terms[key].act
                    if isinstance(a[(i, s)], int):
                        if i in exposed:
                            st.append(layer_time(i))
                        else:
                            certain[key] = certain.get(key, 0) + 1
                        continue
                    st.append(self._product("stime", i, s, layer_time(i), a[(i, s)], self._time_bound(key)))
                    sm.append(self._product("smem", i, s, mem_i, a[(i, s)], self._memory_bound(key, f)))
                    if ctx.train:
                        sg.append(
                            self._product("sgrad", i, s, terms[key].grad, a[(i, s)], self._grad_bound(key))
                        )
                for key, n in certain.items():
                    st.append(n * terms[key].standard_time())
                for i in range(self.num_layers):
                    if isinstance(a.get((i, s)), int):
                        key = keys[i]
                        sm.append(terms[key].static + f * terms[key].act)
                        sg.append(terms[key].grad)
                stage_time.append(pulp.lpSum(st) + p2p[s])
                stage_static.append(pulp.lpSum(sm))
                stage_act.append(pulp.LpAffineExpression())  # folded into stage_static (f depends on s)
                stage_grad.append(pulp.lpSum(sg))
        stage_time[0] += first.time if mesh.pp > 1 else 0.0
        stage_time[-1] += last.time if mesh.pp > 1 else 0.0
        if ctx.train:  # each micro-batch's gradient work on the compute stream, in its stage's time as
            # the prediction has it (`costing.grad_accumulation_s`: fp32 main-gradient adds, ZeRO-2's
            # and FSDP's copies): nothing hides it
            acc = grad_accumulation_cost(ctx)
            if acc.alpha_s or acc.beta_s_per_byte:
                extra = [acc.alpha_s + acc.beta_s_per_byte * GIB * g for g in self._rank_grads(stage_grad)]
                stage_time = [t + e for t, e in zip(stage_time, extra)]
                total = total + pulp.lpSum(extra)
                self.total = total
        self.stage_time = stage_time
        self._memory_constraints(stage_static, stage_act, stage_grad, ends)
        slowest = self._stage_time(stage_time, total)
        tail = self._tail(self._rank_grads(stage_grad))
        self._objective(total, slowest, tail)

    def _class_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for key in self.p.layer_keys:
            counts[key] = counts.get(key, 0) + 1
        return counts

    def _memory_bound(self, key: str, f: int) -> float:
        """Upper bound of one layer's memory per rank, GiB."""
        graph = self.p.graphs[key]
        return (
            graph.fixed_static_bytes
            + f * graph.fixed_activation_bytes
            + sum(max(o.static_bytes + f * o.activation_bytes for o in op.options) for op in graph.ops)
        ) / GIB

    def _grad_bound(self, key: str) -> float:
        graph = self.p.graphs[key]
        fixed = graph.fixed_grad_bytes + self._expert_grad_weight * graph.expert_grad_bytes
        return (fixed + sum(max(o.grad_bytes for o in op.options) for op in graph.ops)) / GIB

    def _memory_constraints(self, static, act, grad, ends: tuple[_EndTerms, _EndTerms]) -> None:
        """memory_*: per stage, params (+ grads + Adam) + in-flight activations + ends + the stage-boundary
        gradients in flight (`pipeline_buffer_bytes`) <= cap."""
        ctx, cap = self.ctx, self.p.memory_cap_bytes
        pp = ctx.mesh.pp
        self.stage_memory = []
        for s in range(pp):
            f = in_flight_micro_batches(ctx, s)
            mem = static[s] + (f * act[s] if pp == 1 else 0) + transient_bytes(ctx) / GIB
            mem += pipeline_buffer_bytes(ctx, s) / GIB  # stage-boundary gradients in flight
            if self.working is not None:
                mem += self.working
            for end, here in zip(ends, (s == 0, s == pp - 1)):
                if here:
                    mem += end.static + f * end.activation
            if s == pp - 1:
                mem += output_held_bytes(ctx) / GIB  # inference: the outputs the step returns
            self.stage_memory.append(mem)
            if cap is not None:
                self.m += mem <= cap / GIB, _name("memory", s)

    def _stage_time(self, stage_time, total) -> pulp.LpAffineExpression | pulp.LpVariable:
        """slowest_*: T >= stage time per micro-batch, for every stage; slowest_average: T >= total / p.

        The average cut is implied by the others at integral points (the stage times sum to the
        total) but not in the LP relaxation, where the big-M products are weak: it closes most of the gap.
        """
        if self.ctx.mesh.pp == 1:
            return stage_time[0]
        slowest = self.m.add_variable("T", 0)
        for s, t in enumerate(stage_time):
            self.m += slowest >= t, _name("slowest", s)
        self.m += slowest >= total * (1.0 / self.ctx.mesh.pp), "slowest_average"
        return slowest

    def _rank_grads(self, stage_grad: list) -> list:
        """Gradient GiB on a rank of each stage: its layers' (`stage_grad`) and the ends' it holds (the
        embedding on the first stage, the final norm and LM head on the last)."""
        first, last, pp = self.ends[0], self.ends[1], self.ctx.mesh.pp
        return [
            g + (first.grad if s == 0 else 0.0) + (last.grad if s == pp - 1 else 0.0)
            for s, g in enumerate(stage_grad)
        ]

    def _tail(self, rank_grads: list):
        """tail_*: training: Tail >= DP gradient all-reduce + optimizer step of every stage
        (`rank_grads`: `_rank_grads`)."""
        if not self.ctx.train:
            return 0.0
        if self.ctx.overlap_grad_reduce or self.ctx.overlap_param_gather:
            return self._overlapped_tail(rank_grads)
        fit = gradient_sync_cost(self.ctx)
        tail = self.m.add_variable("Tail", 0)
        # FSDP: the traffic hides behind eta x the stage's step (`costing.dp_sync_exposed_s`), down to
        # the part nothing hides
        fsdp = self.ctx.dp_style is DataParallel.FSDP
        hide = self.ctx.cluster.overlap_efficiency * self.ctx.micro_batches if fsdp else 0.0
        floor = unhidden_sync_cost(self.ctx) if fsdp else None
        for s, g in enumerate(rank_grads):
            # the hidden part slows the compute beside it (`costing.contention_s`): exposed traffic
            # max(floor, fit - eta m T) + sigma x the rest = max((1 - sigma) floor + sigma fit, fit - (1 - sigma) eta m T)
            sigma = self.ctx.cluster.overlap_slowdown if fsdp else 0.0
            hidden = (1.0 - sigma) * hide * self.stage_time[s] if fsdp else 0.0
            whole = fit.alpha_s + fit.beta_s_per_byte * GIB * g
            self.m += tail >= whole - hidden, _name("tail", s)
            if floor is not None:
                least = floor.alpha_s + floor.beta_s_per_byte * GIB * g
                self.m += tail >= (1.0 - sigma) * least + sigma * whole, _name("tail_floor", s)
        return tail

    def _overlapped_tail(self, rank_grads: list):
        """tail_*: with overlap_grad_reduce / overlap_param_gather, Tail >= the optimizer step + each
        phase of the DP traffic (`costing.dp_sync_phases`) as exposed: a phase with a window w hides
        behind eta x w x the stage's step (m x its time per micro-batch) down to its unhidden share
        (phase_*: E >= total - eta w m T_s, E >= unhidden; `SyncPhase.exposed_s`), costing
        (1 - sigma) E + sigma total (the hidden part's `costing.contention_s`), one without it whole."""
        ctx = self.ctx
        tail = self.m.add_variable("Tail", 0)
        opt, phases = optimizer_step_cost(ctx), dp_phase_costs(ctx)
        eta, m = ctx.cluster.overlap_efficiency, ctx.micro_batches
        sigma = ctx.cluster.overlap_slowdown  # the hidden part's `costing.contention_s`
        for s, g in enumerate(rank_grads):
            g = GIB * g
            terms = opt.alpha_s + opt.beta_s_per_byte * g
            for i, (total, unhidden, window) in enumerate(phases):
                whole = total.alpha_s + total.beta_s_per_byte * g
                if window <= 0:
                    terms += whole
                    continue
                exposed = self.m.add_variable(f"Exposed_{s}_{i}", 0)
                self.m += exposed >= whole - eta * window * m * self.stage_time[s], _name("phase", s, i)
                self.m += (
                    exposed >= unhidden.alpha_s + unhidden.beta_s_per_byte * g,
                    _name("phase_floor", s, i),
                )
                terms += (1.0 - sigma) * exposed + sigma * whole
            self.m += tail >= terms, _name("tail", s)
        return tail

    def _objective(self, total, slowest, tail) -> None:
        """One step: all stage work once, plus (m-1) x the slowest stage, plus the training tail."""
        penalty = 0.0
        if self.lad:  # scale: the top layer's time with its cheapest option per op
            penalty = (
                self.p.ladder_min_saving_fraction * self.p.graphs[self.p.layer_keys[-1]].cheapest_compute_s()
            )
        balance = BALANCE_TIE_BREAK * slowest if self.ctx.mesh.pp > 1 else 0.0
        step = step_time_s(total, slowest, self.ctx.micro_batches, self.ctx.virtual_stages)
        objective = step + tail + penalty * pulp.lpSum(self.lad.values()) + balance
        self.m += objective


def stage_windows(prob: IlpProblem) -> list[list[int]]:
    """Candidate start layers of stages 1..p-1: a window around the balanced split of reference times."""
    pp, keys = prob.ctx.mesh.pp, prob.layer_keys
    L = len(keys)
    if prob.windows is not None:
        return prob.windows
    ref = {k: g.cheapest_compute_s() for k, g in prob.graphs.items()}
    weights = [ref[k] for k in keys]
    total = sum(weights) or 1.0
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    half = max(MIN_WINDOW, math.ceil(WINDOW_FRACTION * L / pp))
    if len(set(keys)) == 1 and prob.ladder.mode is not LadderMode.AUTO:
        half = MIN_WINDOW  # identical layers: the balanced split is within a layer or two of the even one
    windows = []
    for b in range(1, pp):
        target = total * b / pp
        ideal = min(range(1, L), key=lambda j: abs(prefix[j] - target))
        lo, hi = max(b, ideal - half), min(L - (pp - b), ideal + half)
        windows.append(list(range(lo, hi + 1)))
    return windows


def solve(prob: IlpProblem) -> IlpSolution:
    """Solve the ILP of one mesh with CBC. Never raises for infeasibility: see `feasible`.

    Deep pipelines (more than `MAX_BOUNDARY_BINARIES` stage-boundary binaries) are split by
    `balanced_split` instead, alternating with the ILP (`_solve_with_split_search`).
    """
    if prob.ctx.virtual_stages > 1:  # even chunks: no boundaries to search
        return _solve_once(prob)
    if prob.ctx.mesh.pp > 1 and prob.windows is None:
        if sum(len(w) for w in stage_windows(prob)) > MAX_BOUNDARY_BINARIES:
            return _solve_with_split_search(prob)
    sol = _solve_once(prob)
    if prob.windows is None and sol.assignment is not None:  # never leave a split slower than the
        rebalance(prob.tables, sol.assignment, prob.memory_cap_bytes)  # balanced one, by its own costs
    return sol


def _solve_with_split_search(prob: IlpProblem) -> IlpSolution:
    """Split by `balanced_split` on per-layer costs, solve the ILP with that split, re-split on the
    solution's costs, ... until the split repeats (at most `MAX_SPLIT_ROUNDS`); keep the best."""
    costs = reference_costs(prob.tables)
    best: IlpSolution | None = None
    last: IlpSolution | None = None
    seen: set[tuple[int, ...]] = set()
    elapsed = 0.0
    for _ in range(MAX_SPLIT_ROUNDS):
        starts = balanced_split(prob.tables, costs, prob.memory_cap_bytes)
        if starts is None or tuple(starts) in seen:
            break
        seen.add(tuple(starts))
        last = _solve_once(dataclasses.replace(prob, windows=[[j] for j in starts[1:]]))
        elapsed += last.time_s
        if last.assignment is None:
            break
        if best is None or last.objective < best.objective:
            best = last
        costs = solution_costs(prob.tables, last.assignment)
    result = best or last
    if result is None:  # no split fits memory even with the most sharded options
        return IlpSolution("No Solution Exists", False, math.inf, math.inf, 0.0, 0, 0)
    result.time_s = elapsed
    return result


def lp_model(prob: IlpProblem) -> pulp.LpProblem:
    """The PuLP model of `prob`, unsolved, with every constraint family named (see the module docstring).
    The stage boundaries are those of `stage_windows`; `solve` may fix them instead for deep pipelines."""
    builder = _Builder(prob)
    builder.build()
    return builder.m


def _solve_once(prob: IlpProblem) -> IlpSolution:
    """Build and solve one ILP with CBC."""
    builder = _Builder(prob)
    builder.build()
    model = builder.m
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "cbc.log")
        with warnings.catch_warnings():  # the bundled CBC, as the issue asks; PuLP 4 renames it
            warnings.simplefilter("ignore", DeprecationWarning)
            solver = pulp.PULP_CBC_CMD(
                msg=False, timeLimit=prob.time_limit_s, gapRel=prob.mip_gap, logPath=log
            )
        start = time.perf_counter()
        model.solve(solver)
        elapsed = time.perf_counter() - start
        log_text = open(log).read() if os.path.exists(log) else ""
    status = pulp.LpSolution[model.sol_status]
    feasible = model.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    sol = IlpSolution(
        status=status,
        feasible=feasible,
        objective=pulp.value(model.objective) if feasible else math.inf,
        gap=_gap(log_text, model.sol_status),
        time_s=elapsed,
        num_variables=model.numVariables(),
        num_constraints=model.numConstraints(),
    )
    if feasible:
        sol.assignment = _assignment(prob, builder)
    return sol


def _assignment(prob: IlpProblem, builder: _Builder) -> Assignment:
    """The solved model's choices, stages, ladder and recomputed layers."""
    choices = {}
    for (key, op), xs in builder.x.items():
        choices[(key, op)] = max(xs, key=lambda name: xs[name].varValue or 0.0)
    recompute = {}
    for key, (rf, rs) in builder.recompute.items():
        if (rf.varValue or 0.0) > 0.5:
            recompute[key] = Recompute.FULL
        elif (rs.varValue or 0.0) > 0.5:
            recompute[key] = Recompute.SELECTIVE
        else:
            recompute[key] = Recompute.NONE
    L = len(prob.layer_keys)
    if prob.ladder.mode is LadderMode.UPPER:
        ladder = prob.ladder.eligible(L)
    else:
        ladder = [i for i, var in builder.lad.items() if (var.varValue or 0.0) > 0.5]
    if prob.ctx.virtual_stages > 1:  # `_interleaved_stages`
        stages = interleaved_chunks(L, prob.ctx.mesh.pp, prob.ctx.virtual_stages)
    else:
        starts = [0]
        for b in range(1, prob.ctx.mesh.pp):
            starts.append(max(builder.beta[b], key=lambda j: builder.beta[b][j].varValue or 0.0))
        starts.append(L)
        stages = [list(range(starts[s], starts[s + 1])) for s in range(prob.ctx.mesh.pp)]
    return Assignment(choices, stages, ladder, recompute)


def _gap(log_text: str, sol_status: int) -> float:
    """Relative gap from CBC's log ("Gap: 0.05"); 0 when proven optimal, inf when unknown."""
    if sol_status == pulp.LpSolutionOptimal:
        return 0.0
    m = re.search(r"Gap:\s*([0-9.eE+-]+)", log_text)
    if m:
        return float(m.group(1))
    return math.inf

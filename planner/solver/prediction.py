"""Predicted time, memory and breakdown of a chosen plan: plain arithmetic over the costing tables.

The ILP (`planner.solver.ilp`) optimises linear expressions of the same per-op options; this module
evaluates one `Assignment` (an option per op, stages, ladder and recomputed layers) exactly, with the real collective
cost functions where the ILP uses an affine fit (DP gradient all-reduce). It produces the `Prediction`
stored in a plan, the Megatron baseline's prediction, and the per-layer costs `planner.solver.stages` splits on.

Decomposition: latency = compute_s + exposed_comm_s + bubble_s, where compute and exposed comm are
those of the slowest stage times the micro-batches (plus the optimizer step and the DP gradient
all-reduce) and the bubble is the rest (the other stages' share of the pipeline fill and drain,
`costing.step_time_s`). Memory counts the activations each stage holds under the candidate's schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from costmodels import compute
from planner.plan import LayerCost, Prediction, Recompute, StageCost, Workload
from planner.solver.costing import (
    TRAIN_COMM_FACTOR,
    TRAIN_COMPUTE_FACTOR,
    CostContext,
    CostTables,
    LayerGraph,
    Op,
    OpOption,
    contention_s,
    conversion_time_s,
    dp_sync_exposed_s,
    grad_accumulation_s,
    grad_reaches_head,
    in_flight_micro_batches,
    optimizer_step_time_s,
    output_held_bytes,
    pipeline_buffer_bytes,
    recompute_input_bytes,
    recompute_working_bytes,
    sequence_regather_s,
    serving_host_time_s,
    stage_p2p_time_s,
    step_time_s,
    stream_conversion_time_s,
    tied_gradient_exchange_s,
    tp_block_comm_s,
    tp_overlap_chunk_compute_s,
    transient_bytes,
)
from planner.solver.problem import Assignment


@dataclass
class LayerBreakdown:
    """Per-micro-batch time split of one layer under an assignment, and its memory per rank."""

    compute_s: float
    comm_s: float  # exposed: conversions inside the layer, op collectives, un-hidden block outputs
    # communication hidden behind compute (ladder, TP overlap, CP rings) net of its `contention_s`,
    # which comm_s counts
    overlapped_comm_s: float
    static_bytes: float  # parameters (+ gradients and optimizer state when training)
    activation_bytes: float  # per in-flight micro-batch
    grad_bytes: float
    expert_grad_bytes: float = 0.0  # the routed experts', reduced over their edp group (`LayerGraph`)
    # under full recomputation, what the layer's backward holds for a moment beyond its kept input: the
    # activations its forward, run again, stores (`recompute_working_bytes`); 0 otherwise
    working_bytes: float = 0.0


@dataclass
class StageBreakdown:
    """Per-micro-batch time split of one stage and its memory per rank."""

    compute_s: float = 0.0
    exposed_comm_s: float = 0.0
    overlapped_comm_s: float = 0.0
    memory_bytes: float = 0.0
    grad_bytes: float = 0.0
    expert_grad_bytes: float = 0.0  # the routed experts', reduced over their edp group

    @property
    def time_s(self) -> float:
        return self.compute_s + self.exposed_comm_s


@dataclass
class PricedAssignment:
    """An assignment priced on one mesh candidate: what a plan is made from."""

    tables: CostTables  # the candidate: context (mesh, micro-batches, schedule), graphs, ends
    assignment: Assignment
    prediction: Prediction  # stored in the plan
    stages: list[StageBreakdown]  # per pipeline stage, per micro-batch


def layer_breakdown(
    graph: LayerGraph, key: str, assignment: Assignment, laddered: bool, ctx: CostContext
) -> LayerBreakdown:
    """Time and memory of one layer of class `key` (graph `graph`) under `assignment`."""
    opt = {op.name: op.option(assignment.option(key, op.name)) for op in graph.ops}
    compute_block = {
        b: sum(opt[op.name].compute_s for op in graph.timed_ops(b)) for b in ("attention", "mlp")
    }
    internal = sum(
        conversion_time_s(opt[u].out_layout, opt[v].in_layout, graph.op(u).out_bytes, ctx)
        for u, v in graph.edges()
    ) + sum(o.comm_s for o in opt.values())
    internal += graph.fixed_comm_s  # a MoE layer's token exchange (expert parallelism)
    exposed = overlapped = regather = 0.0
    eta = ctx.cluster.overlap_efficiency
    for block, other in (("attention", "mlp"), ("mlp", "attention")):
        out = graph.block_outputs.get(block)
        if out is None:
            continue
        if not laddered:  # TP overlap (`tp_block_comm_s`; without it all exposed)
            split = {
                name: sum(opt[op.name].compute_s for op in graph.timed_ops(block) if opt[op.name].name == name)
                for name in ("colwise", "rowwise")
            }  # fmt: skip
            comm, hidden = tp_block_comm_s(
                opt[out].out_layout, graph.op(out).out_bytes, split["colwise"], split["rowwise"], ctx
            )
            if split["colwise"] > 0:  # the backward's gather of the shard (in comm + hidden), not forward
                regather += sequence_regather_s(graph.op(out).out_bytes, ctx)
            exposed += comm
            overlapped += hidden - contention_s(hidden, ctx.cluster)
            continue
        comm = stream_conversion_time_s(opt[out].out_layout, graph.op(out).out_bytes, ctx)
        hidden = min(comm, eta * compute_block[other])
        exposed += comm - hidden + contention_s(hidden, ctx.cluster)
        overlapped += hidden - contention_s(hidden, ctx.cluster)
    compute_s = graph.fixed_compute_s + compute_block["attention"] + compute_block["mlp"]
    if not laddered:  # TP overlap runs each split projection as C GEMMs of 1/C of the rows
        compute_s += sum(tp_overlap_chunk_compute_s(op, opt[op.name], ctx) for op in graph.ops)
    kernels_s = compute_s
    compute_s = max(kernels_s, graph.dispatch_s)  # the host issues the nodes no faster (async device)
    static = graph.fixed_static_bytes + sum(o.static_bytes for o in opt.values())
    act = graph.fixed_activation_bytes + sum(o.activation_bytes for o in opt.values())
    grad = graph.fixed_grad_bytes + sum(o.grad_bytes for o in opt.values())
    # a forward-only layer (no gradient reaches it) has no backward to recompute in
    recompute = assignment.recompute_of(key) if ctx.train and graph.backward else Recompute.NONE
    working = 0.0
    if recompute is Recompute.FULL:  # forward again in backward (its collectives); keep only the input
        internal += max(0.0, internal + exposed + overlapped - regather) / TRAIN_COMM_FACTOR
        forward_s = kernels_s / TRAIN_COMPUTE_FACTOR + sum(o.full_extra_s for o in opt.values())
        compute_s += max(forward_s, graph.forward_dispatch_s)  # the host issues the forward again
        working = recompute_working_bytes(act, ctx)
        act = recompute_input_bytes(ctx)
    elif recompute is Recompute.SELECTIVE:  # the attention core again; its scores are not kept
        compute_s += sum(o.selective_s for o in opt.values())
        act -= sum(o.selective_bytes for o in opt.values())
    hidden = sum(o.hidden_comm_s for o in opt.values())  # context-parallel ring transfers
    overlapped += hidden - contention_s(hidden, ctx.cluster)
    return LayerBreakdown(
        compute_s, internal + exposed, overlapped, static, act, grad, graph.expert_grad_bytes, working
    )


def ends_dispatch_excess_s(ends: LayerGraph, option: Callable[[Op], OpOption]) -> tuple[float, float]:
    """(first stage, last stage): by how much the host's issue time of the ends' nodes
    (`LayerGraph.first_stage_dispatch_s`, `last_stage_dispatch_s`) exceeds their time per micro-batch,
    the fixed compute there plus each op's chosen option (``option``), compute and communication; 0
    where it does not. The ILP's floor on the ends (`ilp._Builder._ends_terms`) is the same."""

    def excess(block: str, fixed_s: float, dispatch_s: float) -> float:
        timed = fixed_s + sum((o := option(op)).compute_s + o.comm_s for op in ends.ops_of(block))
        return max(0.0, dispatch_s - timed)

    return (
        excess("embedding", ends.first_stage_compute_s, ends.first_stage_dispatch_s),
        excess("head", ends.last_stage_compute_s, ends.last_stage_dispatch_s),
    )


def _experts_text(num_experts: int, ctx: CostContext) -> str:
    """How a MoE layer's routed experts are placed, as the per-layer table names a choice: "ep 2 over dp
    (2 of 4 per rank)", "ep 1 (4 per rank, split over tp 2)", "ep 1 (4 per rank)"."""
    split = f", split over tp {ctx.expert_tp}" if ctx.expert_tp > 1 else ""
    if ctx.ep == 1:
        return f"ep 1 ({num_experts} per rank{split})"
    over = "dp x cp" if ctx.ep_fold == "dp" and ctx.mesh.cp > 1 else ctx.ep_fold
    return f"ep {ctx.ep} over {over} ({num_experts // ctx.ep} of {num_experts} per rank{split})"


def predict(tables: CostTables, assignment: Assignment) -> PricedAssignment:
    """Predicted step time, memory and per-layer / per-stage breakdown of `assignment` on `tables`' mesh."""
    ctx, graphs, ends = tables.ctx, tables.graphs, tables.ends
    mesh, m = ctx.mesh, ctx.micro_batches
    choices = assignment.choices
    ladder = set(assignment.ladder_layers)
    stage_of = {i: s % mesh.pp for s, layers in enumerate(assignment.stages) for i in layers}  # rank
    per_layer: list[LayerCost] = []
    stages_bd = [StageBreakdown() for _ in range(mesh.pp)]
    breakdowns: dict[tuple[str, bool], LayerBreakdown] = {}  # identical layers cost the same
    # one fully recomputed layer's backward at a time holds its forward's activations again
    stage_working = [0.0] * mesh.pp
    for i, key in enumerate(tables.layer_keys):
        graph = graphs[key]
        if (key, i in ladder) not in breakdowns:
            breakdowns[(key, i in ladder)] = layer_breakdown(graph, key, assignment, i in ladder, ctx)
        layer = breakdowns[(key, i in ladder)]
        s = stage_of[i]
        mem = layer.static_bytes + in_flight_micro_batches(ctx, s) * layer.activation_bytes
        bd = stages_bd[s]
        bd.compute_s += layer.compute_s
        bd.exposed_comm_s += layer.comm_s
        bd.overlapped_comm_s += layer.overlapped_comm_s
        bd.memory_bytes += mem
        stage_working[s] = max(stage_working[s], layer.working_bytes)
        bd.grad_bytes += layer.grad_bytes
        bd.expert_grad_bytes += layer.expert_grad_bytes
        strategy = {op.name: choices[(key, op.name)] for op in graph.ops}
        if ctx.structure.layers and ctx.structure.layers[i].moe is not None:  # not one of the graph's ops
            moe = ctx.structure.layers[i].moe
            strategy["experts"] = _experts_text(moe.num_experts, ctx)
        if ctx.train:
            strategy["recompute"] = str(assignment.recompute_of(key))
        per_layer.append(
            LayerCost(
                i if key != "chain" else 0,
                s,
                m * layer.compute_s,
                m * layer.comm_s,
                m * layer.overlapped_comm_s,
                mem,
                strategy,
            )  # fmt: skip
        )
    # Embedding on the first stage, final norm + LM head on the last.
    ends_strategy = {}
    tied_s = 0.0  # the tied embedding's gradient summed between the first and the last stage
    for op in ends.ops:
        o = op.option(choices[("ends", op.name)])
        ends_strategy[op.name] = o.name
        s = 0 if op.block == "embedding" else mesh.pp - 1
        bd = stages_bd[s]
        bd.compute_s += o.compute_s
        bd.exposed_comm_s += o.comm_s
        bd.memory_bytes += o.static_bytes + in_flight_micro_batches(ctx, s) * o.activation_bytes
        bd.grad_bytes += o.grad_bytes
        if op.block == "head" and ctx.structure.tied_lm_head and mesh.pp > 1:
            emb = ends.ops[0].option(choices[("ends", ends.ops[0].name)])
            bd.memory_bytes += emb.static_bytes
            bd.grad_bytes += emb.grad_bytes
            tied_s = tied_gradient_exchange_s(emb.grad_bytes, ctx)
    stages_bd[-1].compute_s += ends.last_stage_compute_s
    stages_bd[0].compute_s += ends.first_stage_compute_s  # nodes before the first layer
    first_floor_s, last_floor_s = ends_dispatch_excess_s(
        ends, lambda op: op.option(choices[("ends", op.name)])
    )
    stages_bd[0].compute_s += first_floor_s
    stages_bd[-1].compute_s += last_floor_s
    ends_floor_s = first_floor_s + last_floor_s
    stages_bd[0].memory_bytes += ends.fixed_static_bytes  # parameters outside the layers (`outside_params`)
    stages_bd[0].grad_bytes += ends.fixed_grad_bytes
    for s in range(mesh.pp):
        stages_bd[s].exposed_comm_s += stage_p2p_time_s(ctx, s)
        # fp32 main gradients, or ZeRO-2's / FSDP's gradient copies: per micro-batch in its backward
        stages_bd[s].compute_s += grad_accumulation_s(
            stages_bd[s].grad_bytes + stages_bd[s].expert_grad_bytes, ctx
        )
    transient = transient_bytes(ctx)
    for s, (bd, working) in enumerate(zip(stages_bd, stage_working)):
        bd.memory_bytes += transient + working + pipeline_buffer_bytes(ctx, s)
    stages_bd[-1].memory_bytes += output_held_bytes(ctx)  # inference: the outputs it returns
    times = [bd.time_s for bd in stages_bd]
    slowest = max(range(mesh.pp), key=lambda s: times[s])
    tails = dict.fromkeys(
        (bd.grad_bytes, m * bd.time_s, bd.expert_grad_bytes) for bd in stages_bd
    )  # interior stages alike
    tail_comm, tail_compute = max((_tail_s(ctx, *tail) for tail in tails), key=lambda t: t[0] + t[1])
    # a block called at several depths: each pipeline rank holding one of its layers keeps a copy
    for group in ctx.structure.shared_layers if ctx.train and mesh.pp > 1 else ():
        ranks = {stage_of[i] for i in group}
        copies = {s for s, layers in enumerate(assignment.stages) for i in layers if i in group}
        layer = breakdowns[(tables.layer_keys[group[0]], group[0] in ladder)]
        tied_s += tied_gradient_exchange_s(layer.grad_bytes, ctx, len(ranks), len(copies))
    tail_comm += tied_s  # after the backward, before the DP reduction and the optimizer step
    latency = step_time_s(sum(times), times[slowest], m, ctx.virtual_stages) + tail_comm + tail_compute
    bottleneck = stages_bd[slowest]
    compute_s = m * bottleneck.compute_s + tail_compute
    exposed_s = m * bottleneck.exposed_comm_s + tail_comm
    ends_opts = [ends.op(o).option(c) for o, c in ends_strategy.items()]
    per_layer.append(
        LayerCost(
            -1,
            0,
            m * (ends.fixed_compute_s + sum(o.compute_s for o in ends_opts) + ends_floor_s),
            m * sum(o.comm_s for o in ends_opts),
            0.0,
            sum(o.static_bytes for o in ends_opts) + ends.fixed_static_bytes,
            ends_strategy,
        )  # fmt: skip
    )
    w = ctx.workload
    tokens = w.batch_size * w.tokens_per_sequence
    prediction = Prediction(
        latency_s=latency,
        throughput_tokens_per_s=tokens / latency,
        peak_memory_bytes=max(bd.memory_bytes for bd in stages_bd),
        compute_s=compute_s,
        exposed_comm_s=exposed_s,
        overlapped_comm_s=m * bottleneck.overlapped_comm_s,
        bubble_s=max(0.0, latency - compute_s - exposed_s),
        per_layer=per_layer,
        per_stage=[
            StageCost(s, bd.compute_s, bd.exposed_comm_s, bd.overlapped_comm_s, bd.memory_bytes)
            for s, bd in enumerate(stages_bd)
        ],
        grad_sync_s=tail_comm,
        optimizer_s=tail_compute,
        serving_host_s=m * serving_host_time_s(ctx),
    )
    prediction.model_flops = model_flops(tables)
    prediction.num_devices = mesh.num_devices
    return PricedAssignment(tables, assignment, prediction, stages_bd)


# `model_flops` depends on the model and the workload only, not on the mesh or the styles: a search
# predicts one structure under thousands of configurations, so the last few structures' counts are kept
# (by identity: id -> (the structure, {workload: FLOP}); an id reused by a new object misses)
_FLOPS_CACHE: dict[int, tuple[object, dict[object, float]]] = {}
_FLOPS_CACHE_STRUCTURES = 4


def model_flops(tables: CostTables) -> float:
    """`_model_flops` of ``tables``' structure and workload, kept per structure (`_FLOPS_CACHE`)."""
    s, w = tables.ctx.structure, tables.ctx.workload
    entry = _FLOPS_CACHE.get(id(s))
    if entry is None or entry[0] is not s:
        if len(_FLOPS_CACHE) >= _FLOPS_CACHE_STRUCTURES:
            _FLOPS_CACHE.clear()
        entry = _FLOPS_CACHE[id(s)] = (s, {})
    if w not in entry[1]:
        entry[1][w] = _model_flops(tables)
    return entry[1][w]


def _model_flops(tables: CostTables) -> float:
    """FLOP of one step's math on the whole model (all replicas): every projection (2 tokens in out;
    a mixture of experts' router, and its routed experts as each token runs top_k of them: the active
    parameters), attention core (`compute.attention_flops`, causal for causal workloads) and
    convolution over the global batch. Training adds the backward: the input gradients (a forward's
    FLOP again) where a gradient flows (`Layer.trainable`) and the weight gradients (the same) of the
    weights that are not frozen (`CostContext.frozen`), so 3x the forward when everything trains;
    recomputation is not counted. 0 for models without layers or a chain to price."""
    ctx = tables.ctx
    s, w = ctx.structure, ctx.workload
    tokens = w.batch_size * w.tokens_per_sequence
    train = ctx.train

    def factor(backward: bool, weight: str | None = None, input_grad: bool = True) -> float:
        """Forward + backward multiple of one op's forward FLOP: input gradient, weight gradient."""
        if not train or not backward:
            return 1.0
        frozen = weight is not None and ctx.frozen(weight)
        return TRAIN_COMPUTE_FACTOR - float(frozen) - float(not input_grad)

    flops = sum(
        compute.linear_flops(tokens, p.in_features, p.out_features) * factor(True, p.weight)
        for p in s.mlp_chain
    )
    if s.lm_head is not None:  # no input gradient when nothing before it trains (a linear probe)
        p = s.lm_head
        head_factor = factor(True, p.weight, grad_reaches_head(ctx))
        flops += compute.linear_flops(tokens, p.in_features, p.out_features) * head_factor
    for layer in s.layers:
        backward = layer.trainable
        projections = [
            p for block in (layer.attention, layer.mlp) if block is not None for p in block.projections
        ]
        projections += layer.kept_whole
        flops += sum(
            compute.linear_flops(tokens, p.in_features, p.out_features) * factor(backward, p.weight)
            for p in projections
        )
        if layer.moe is not None:  # the routed experts' active compute: top_k experts per token
            flops += layer.moe.expert_flops(tokens) * factor(backward)
        a = layer.attention
        if a is not None:
            causal = w.kind is not Workload.DECODE
            flops += factor(backward) * compute.attention_flops(
                w.batch_size, a.num_heads, w.tokens_per_sequence, w.kv_len, a.head_dim, causal
            )
    # convolutions, from the captured graph's shapes, over the global batch
    conv = sum(c.flops for c in s.node_costs.values() if c.kind == "conv")
    return flops + conv * w.batch_size / max(1, s.batch_size) * factor(True)


def _tail_s(
    ctx: CostContext, grad_bytes: float, stage_step_s: float, expert_grad_bytes: float = 0.0
) -> tuple[float, float]:
    """(exposed DP traffic, optimizer step) of a stage with `grad_bytes` of gradients whose micro-batches
    take `stage_step_s` (`costing.dp_sync_exposed_s`: FSDP's gathers and reduce-scatters partly hide
    behind them); the step waits for the slowest stage's. With expert parallelism over dp x cp, the
    routed experts' `expert_grad_bytes` are reduced over their own edp group after the dense ones
    (`CostContext.experts_context`) and stepped with them."""
    comm, step = dp_sync_exposed_s(grad_bytes, stage_step_s, ctx), optimizer_step_time_s(grad_bytes, ctx)
    if expert_grad_bytes > 0:
        experts = ctx.experts_context()
        comm += dp_sync_exposed_s(expert_grad_bytes, stage_step_s, experts)
        step += optimizer_step_time_s(expert_grad_bytes, experts)
    return comm, step

"""Check a plan before any rank starts: lower it on meta tensors for every distinct rank.

    verify_plan(gm, structure, plan, cluster) -> Plan

The planner prices one program and the passes run another unless something compares them. Here the
plan is lowered with `passes.lower.lower_for_rank` (the one lowering function every rank uses) on
the meta-device graph the planner captured, for every distinct (pipeline stage, TP rank) of DP
replica 0:

- a rewrite the passes cannot do (`TensorParallelError`, `LadderError`, `PipelineSplitError`) is
  refused with `InfeasibleError` (exit 3) naming the op and the user's source line;
- an op the TP pass runs replicated by all-gathering a sharded input (`RuleContext.run_replicated`,
  recorded in `node.meta["tp_fallback"]`) where the ILP priced no such gather is an *unplanned
  fallback*: its all-gather time (`costmodels.comm.all_gather_time_s`) is added to the prediction
  and it is listed in `Plan.fallbacks`, which the report prints line by line.

A gather is *planned* (already priced by the ILP as an S->R conversion) when it feeds a projection,
when it gathers a projection's output (the LM head's logits, a colwise output into a replicated
consumer), when it happens inside an attention core or MLP activation the plan keeps replicated
(a layer's, or a projection chain's gap: `ModelStructure.chain_gaps`), or, under sequence parallelism,
when it gathers a mixture-of-experts block's input for its router (`costing.moe_sequence_gather_s`).

Deep models are captured for planning through a representative slice of their repeated layers
(`planner.frontend.depth`): the slice is lowered once per distinct per-layer configuration (split
styles and ladder, renamed onto the slice's last layer), its fallbacks counted once per layer with
that configuration, and pipeline stages are not cut (the slice holds too few layers).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator

import torch.fx as fx

from costmodels.cluster import ClusterSpec
from costmodels.comm import Group, all_gather_time_s
from costmodels.compute import OP_KINDS, op_time_s
from costmodels.dtypes import DTYPE_BYTES
from costmodels.expert_parallel import all_to_all_exchange_s, dispatch_bytes
from passes.cp_lower import FALLBACK_META as CP_FALLBACK_META
from passes.ladder import LadderError
from passes.lower import RankLowering, lower_for_rank
from passes.pipeline import PipelineSplitError
from passes.recompute import recompute_of_layers
from passes.tensor_parallel import rule_coverage
from passes.tp_rules_context import FALLBACK_META, TensorParallelError
from passes.tp_rules_context import Fallback as PassFallback
from planner.errors import InfeasibleError
from planner.frontend.analysis import ModelStructure, NodeCost, analyse
from planner.plan import Fallback, MeshShape, Plan, Prediction, Workload, fallback_memory_bytes


@dataclasses.dataclass
class _Lowering:
    """One graph to lower: the plan (possibly rewritten onto a slice), the ranks, and how many model
    layers each fallback in the slice's template layer stands for."""

    plan: Plan
    structure: ModelStructure
    ranks: list[int]
    template_nodes: set[str]
    template_count: int
    index: int  # fallbacks outside the template layer are counted from lowering 0 only


def verify_plan(gm: fx.GraphModule, structure: ModelStructure, plan: Plan, cluster: ClusterSpec) -> Plan:
    """Lower `plan` for every distinct rank on `gm` (meta tensors; not modified) and return the plan
    with the unplanned fallbacks priced (`Plan.fallbacks`, added to `predicted`).

    gm / structure: the planning capture (`planner.frontend.depth.capture_for_planning`) at the
    plan's global batch. cluster: prices the fallbacks' all-gathers over the TP group.
    Raises InfeasibleError (exit 3) naming the op and the model source line the passes cannot lower.
    """
    recompute_of_layers(structure, plan.recompute)  # InputError for a key that names no layer class
    # recompute moves a layer's nodes into checkpointed submodules and adds no fallback: the TP
    # fallbacks are looked for in the graph lowered without it
    found: dict[str, tuple[PassFallback, int, NodeCost | None]] = {}
    cp_found: dict[str, tuple[PassFallback, int, ModelStructure]] = {}
    coverage: dict[str, int] = {}
    for job in _lowerings(gm, structure, dataclasses.replace(plan, recompute={})):
        for rank in job.ranks:
            lowered = copy.deepcopy(gm)
            _lower(lowered, job.structure, job.plan, rank)
            if rank == 0 and job.index == 0 and plan.tp > 1:
                coverage = rule_coverage(lowered)
            for node in lowered.graph.nodes:
                cp_fb = node.meta.get(CP_FALLBACK_META)
                if cp_fb is not None and (job.index == 0 or node.name in job.template_nodes):
                    count = job.template_count if node.name in job.template_nodes else 1
                    cp_found.setdefault(f"{cp_fb.node}@{job.index}", (cp_fb, count, job.structure))
                fb = node.meta.get(FALLBACK_META)
                if fb is None or _planned(fb, node, structure, plan):
                    continue
                in_template = node.name in job.template_nodes
                if not in_template and job.index > 0:
                    continue
                key = f"{fb.node}@{job.index}" if in_template else fb.node
                cost = job.structure.node_costs.get(fb.node) or structure.node_costs.get(fb.node)
                found.setdefault(key, (fb, job.template_count if in_template else 1, cost))
    dtype = structure.dtype
    fallbacks = [_price(fb, count, plan, cluster, cost, dtype) for fb, count, cost in found.values()]
    fallbacks += [
        _price_cp(fb, count, plan, cluster, (job_structure, structure), dtype)
        for fb, count, job_structure in cp_found.values()
    ]
    out = _with_fallbacks(plan, fallbacks)
    return out if out.op_placement == coverage else dataclasses.replace(out, op_placement=coverage)


def _lower(gm: fx.GraphModule, structure: ModelStructure, plan: Plan, rank: int) -> RankLowering:
    try:
        return lower_for_rank(gm, structure, plan, rank, training=plan.workload is Workload.TRAIN)
    except TensorParallelError as e:
        where = f" at {e.line}" if e.line else f" (graph node {e.node})"
        raise InfeasibleError(
            f"the plan cannot be run as priced: {e.op or 'an op'}{where}: {e.why} "
            f"(tensor-parallel rewrite, tp={plan.tp}, rank {rank}). Re-plan with a different --tp, or "
            "write the op so that its sharded dim is not cut"
        ) from e
    except (LadderError, PipelineSplitError) as e:
        raise InfeasibleError(f"the plan cannot be run as priced (rank {rank}): {e}") from e


def _lowerings(gm: fx.GraphModule, structure: ModelStructure, plan: Plan) -> Iterator[_Lowering]:
    """The graphs to lower: the whole model for every rank of DP replica 0, or (a representative
    slice) one TP-only lowering per distinct configuration of the slice's template layer."""
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    present = [any(t.startswith(layer.module_path + ".") for t in targets) for layer in structure.layers]
    if all(present):
        ranks = [plan.mesh.rank_of(0, p, t) for p in range(plan.pp) for t in range(plan.tp)]
        yield _Lowering(plan, structure, ranks, set(), 1, 0)
        return
    kept = sum(present)
    sliced = analyse(gm)
    template = structure.layers[kept - 1]
    groups: dict[tuple, list[int]] = {}
    for layer in structure.layers[kept - 1 :]:
        groups.setdefault(_signature(plan, layer.module_path, template.module_path, layer.index), []).append(
            layer.index
        )
    base = {
        k: v
        for k, v in plan.splits.items()
        if not any(k.startswith(layer.module_path + ".") for layer in structure.layers[kept - 1 :])
    }
    for n, ((splits, ladder), layers) in enumerate(groups.items()):
        split_map = dict(base)
        source = structure.layers[layers[0]].module_path
        for fqn, *_ in splits:
            split_map[fqn] = dataclasses.replace(
                plan.splits[_rename(fqn, template.module_path, source)], weight=fqn
            )
        ladder_layers = [i for i in plan.ladder_layers if i < kept - 1] + ([kept - 1] if ladder else [])
        sub = dataclasses.replace(
            plan,
            mesh=MeshShape(plan.tp, 1, 1, plan.cp),
            splits=split_map,
            stages=[list(range(kept))],
            ladder_layers=ladder_layers,
        )
        yield _Lowering(sub, sliced, list(range(plan.tp)), set(template.nodes), len(layers), n)


def _rename(fqn: str, old: str, new: str) -> str:
    return new + fqn[len(old) :] if fqn.startswith(old + ".") else fqn


def _signature(plan: Plan, path: str, template: str, index: int) -> tuple:
    """A layer's splits renamed onto the template layer, and whether it uses ladder residual."""
    splits = tuple(
        sorted(
            (_rename(k, path, template), str(v.style), v.dim, tuple(v.parts) if v.parts else None)
            for k, v in plan.splits.items()
            if k.startswith(path + ".")
        )
    )
    return splits, index in plan.ladder_layers


def _planned(fb: PassFallback, node: fx.Node, structure: ModelStructure, plan: Plan) -> bool:
    """Whether the ILP priced this gather (an S->R conversion into a replicated consumer)."""
    projections = {
        p.node for layer in structure.layers for b in (layer.attention, layer.mlp) if b for p in b.projections
    }
    projections |= {p.node for p in structure.mlp_chain}
    if structure.lm_head is not None:
        projections.add(structure.lm_head.node)
    if node.name in projections:  # a projection's replicated input: the ILP priced the S->R
        return True
    routers = {layer.moe.router.node for layer in structure.layers if layer.moe is not None}
    if plan.sequence_parallel and routers and _feeds(node, routers):
        return True  # a MoE block's input gathered for its router (`costing.moe_sequence_gather_s`)
    # inside a block the plan carries sharded (an activation or an attention core), a gather is
    # planned only where the plan keeps that block replicated, whatever it gathers: a projection's
    # output gathered for a softmax or a norm that reads it directly is no less a fallback
    for i, gap in structure.chain_gaps.items():  # a chain's activation
        if node.name in gap:
            strategy = next((c.strategy for c in plan.predicted.per_layer if f"act{i}" in c.strategy), {})
            return strategy.get(f"act{i}") == "replicate"
    for layer in structure.layers:
        block = layer.node_blocks.get(node.name)
        if block is None:
            continue
        strategy = (
            plan.predicted.per_layer[layer.index].strategy
            if layer.index < len(plan.predicted.per_layer)
            else {}
        )
        if block in ("core", "attention"):
            return strategy.get("core") == "replicate"
        if block in ("cross_core", "cross"):  # a decoder's cross-attention (`Layer.cross_attention`)
            return strategy.get("cross.core") == "replicate"
        if block == "mlp":
            acts = [v for k, v in strategy.items() if k.startswith("act")]
            return bool(acts) and all(v == "replicate" for v in acts)
        break
    # elsewhere, a projection's output gathered into a replicated consumer (the LM head's logits)
    return all(g in projections for g in fb.gathered)


_SHAPE_OPS = frozenset({"aten.view", "aten.reshape", "aten._unsafe_view", "aten.flatten", "aten.contiguous"})


def _feeds(node: fx.Node, targets: set[str], depth: int = 4) -> bool:
    """Whether `node`'s output reaches a node named in `targets` through at most `depth` reshapes."""
    frontier = [node]
    for _ in range(depth):
        users = [u for n in frontier for u in n.users]
        if any(u.name in targets for u in users):
            return True
        frontier = [u for u in users if str(getattr(u.target, "overloadpacket", u.target)) in _SHAPE_OPS]
    return False


def _step_times(plan: Plan, count: int) -> tuple[float, int]:
    """(how many times a fallback's per-micro-batch time adds to the step, the most places one stage
    holds) for a fallback found in `count` places (the layers of one configuration, or one node). The
    stages run side by side and the layers are spread over them, so a stage holds count / pp of the
    places (one stage's time is what a pipeline's step repeats), and the step takes about
    micro-batches + pp - 1 of a stage's per-micro-batch times (1F1B: the fill and the drain). Without
    a pipeline the graph runs once on the rank's whole batch. Each place was once added over every
    layer and micro-batch, as if the stages ran one after another: a context-parallel fallback in each
    of Mixtral's 32 MoE blocks cost 8 s at pp 1, 16 s at pp 2 and 32 s at pp 4 for the same work."""
    if plan.pp <= 1:
        return float(count), count
    return count * (plan.micro_batches + plan.pp - 1) / plan.pp, -(-count // plan.pp)


def _price(
    fb: PassFallback,
    count: int,
    plan: Plan,
    cluster: ClusterSpec,
    cost: NodeCost | None = None,
    captured_dtype: str | None = None,
) -> Fallback:
    """The plan's line for a fallback: bytes per micro-batch in the plan's dtype, time per step: the
    all-gather, and the op itself run on the whole tensor where the plan priced a 1/tp shard of it
    (`cost`: its `NodeCost` at the captured batch and dtype, `captured_dtype`; None: not priced)."""
    per_step = plan.micro_batches if plan.pp > 1 else 1  # the graph runs once per micro-batch
    nbytes = fb.elements * DTYPE_BYTES[plan.dtype] / plan.dp / per_step
    one = all_gather_time_s(nbytes, Group.packed(plan.tp, cluster), cluster)
    train = 2.0 if plan.workload is Workload.TRAIN else 1.0  # the backward reduce-scatters as much
    times, on_stage = _step_times(plan, count)
    compute_s = 0.0
    if cost is not None and cost.kind != "none" and plan.tp > 1:
        compute_s = _whole_op_s(cost, plan, cluster, captured_dtype) * (1 - 1 / plan.tp) * times
    # memory: the gathered tensor is whole on every rank where the plan priced a 1/tp shard. Training
    # keeps it for the backward of the op that reads it, per layer and per micro-batch in flight (1F1B:
    # up to pp on the first stage): at most (tp - 1) / tp of it more per place; without autograd it
    # lives while the op runs (`_with_fallbacks` adds the largest one).
    extra = nbytes * (plan.tp - 1) / plan.tp
    in_flight = min(plan.pp, per_step) if plan.pp > 1 else 1
    memory = extra * on_stage * in_flight if plan.workload is Workload.TRAIN else extra
    return Fallback(
        op=fb.op,
        line=fb.line or f"graph node {fb.node}",
        node=fb.node,
        bytes_gathered=nbytes * count,
        comm_s=one * train * times,
        places=count,
        memory_bytes=memory,
        compute_s=compute_s,
    )


def _whole_op_s(cost: NodeCost, plan: Plan, cluster: ClusterSpec, captured_dtype: str | None) -> float:
    """Seconds one rank takes for the op of `cost` (its `NodeCost` at the captured global batch and
    dtype) on its micro-batch with nothing sharded, forward and, training, backward (a matmul's
    backward is two matmuls of its size, a memory-bound op's about one pass more)."""
    per_step = plan.micro_batches if plan.pp > 1 else 1
    kind = cost.kind if cost.kind in OP_KINDS else "memory"
    share = 1.0 / (plan.dp * per_step)  # one rank's micro-batch of the captured batch
    byte_scale = DTYPE_BYTES[plan.dtype] / DTYPE_BYTES[captured_dtype or plan.dtype]
    whole = op_time_s(
        cost.flops * share,
        (cost.bytes_read + cost.bytes_written) * share * byte_scale,
        cluster.device,
        plan.dtype,
        kind,
        launch=False,
    )
    passes = (3.0 if kind in ("matmul", "conv") else 2.0) if plan.workload is Workload.TRAIN else 1.0
    return whole * passes


def _price_cp(
    fb: PassFallback,
    count: int,
    plan: Plan,
    cluster: ClusterSpec,
    structures: tuple[ModelStructure, ...] = (),
    captured_dtype: str | None = None,
) -> Fallback:
    """The plan's line for a context-parallel fallback (`passes.cp_lower`: an op given the whole
    sequence of its sharded inputs): the all-gather over the CP ranks (the cp ranks of a TP rank, tp
    apart: on one node while tp x cp fits it), a reduce-scatter as large in backward, and the
    gathered tensor whole where the plan priced 1/cp of it. fb.elements: the inputs' elements on one
    TP rank at the captured global batch.

    The ops after it that read the whole sequence (`Fallback.region`: a MoE block behind a flatten of
    batch and sequence, say) run on every token on every CP rank where the plan priced 1/cp of them:
    (cp - 1) / cp of each one's time on the whole sequence more (its `NodeCost` in `structures`, the
    slice's and the model's; a MoE's routed experts as the plan prices them, `MoE.expert_flops` at the
    matmul rate over ep ranks, in place of its expert nodes), and a MoE's dispatch and combine
    all-to-alls over the EP ranks carry cp times the tokens (`costmodels.expert_parallel`, the EP
    group packed on nodes, an even load)."""
    per_step = plan.micro_batches if plan.pp > 1 else 1
    nbytes = fb.elements * DTYPE_BYTES[plan.dtype] / plan.dp / per_step
    per_node = max(1, min(plan.cp, cluster.devices_per_node // max(1, plan.tp)))
    one = all_gather_time_s(nbytes, Group(plan.cp, per_node), cluster)
    train = plan.workload is Workload.TRAIN
    extra = nbytes * (plan.cp - 1) / plan.cp
    in_flight = min(plan.pp, per_step) if plan.pp > 1 else 1
    times, on_stage = _step_times(plan, count)
    memory = extra * on_stage * in_flight if train else extra
    region = set(fb.region)
    compute_s, exchange_s = 0.0, 0.0
    if region and plan.cp > 1:
        share = 1.0 / (plan.dp * per_step)  # one rank's micro-batch of the captured batch
        moes = {
            id(layer.moe): layer.moe
            for s in structures
            for layer in s.layers
            if layer.moe is not None and region & set(layer.moe.expert_nodes)
        }
        experts = {n for moe in moes.values() for n in moe.expert_nodes}
        tokens = plan.batch_size * plan.seq_len * share  # one rank's micro-batch, the whole sequence
        for moe in moes.values():
            # the routed experts as the plan prices them (their GEMMs at the matmul rate, each EP rank
            # its 1/ep of the rows), not the graph's gathers of expert weights per token
            flops = moe.expert_flops(tokens) / plan.ep
            expert_s = op_time_s(flops, 0.0, cluster.device, plan.dtype, "matmul", launch=False)
            compute_s += expert_s * (1 - 1 / plan.cp) * (3.0 if train else 1.0)
        for name in region - experts:
            cost = next((s.node_costs[name] for s in structures if name in s.node_costs), None)
            if cost is not None and cost.kind not in ("none", "view"):
                compute_s += _whole_op_s(cost, plan, cluster, captured_dtype) * (1 - 1 / plan.cp)
        if plan.ep > 1:
            group = Group.packed(plan.ep, cluster)
            for moe in moes.values():
                data = dispatch_bytes(moe.top_k, tokens, moe.hidden_size, DTYPE_BYTES[plan.dtype])
                exchange_s += all_to_all_exchange_s(data, moe.num_experts, group, cluster, train) - (
                    all_to_all_exchange_s(data / plan.cp, moe.num_experts, group, cluster, train)
                )
    runs = (
        f"; {len(region)} op(s) after it run on the whole sequence on every CP rank"
        + (" (a mixture of experts: its token exchange carries cp x the tokens)" if exchange_s else "")
        if region
        else ""
    )
    return Fallback(
        op=f"{fb.op} (context parallelism: whole sequence gathered{runs})",
        line=fb.line or f"graph node {fb.node}",
        node=fb.node,
        bytes_gathered=nbytes * count,
        comm_s=(one * (2.0 if train else 1.0) + exchange_s) * times,
        places=count,
        memory_bytes=memory,
        compute_s=compute_s * times,
    )


def _with_fallbacks(plan: Plan, fallbacks: list[Fallback]) -> Plan:
    """`plan` with `fallbacks` listed, their time added to `predicted` (exposed communication) and their
    memory to its peak (`Fallback.memory_bytes`: training keeps every gathered tensor for the backward,
    so they add up; a forward holds one at a time, so the largest adds)."""
    old = {(f.node, f.op) for f in plan.fallbacks}
    new = [f for f in fallbacks if (f.node, f.op) not in old]
    if not new:
        return plan
    extra = sum(f.comm_s for f in new)
    compute = sum(f.compute_s for f in new)
    every = [*plan.fallbacks, *new]
    before = fallback_memory_bytes(plan.fallbacks, plan.workload)
    memory = fallback_memory_bytes(every, plan.workload) - before
    p = plan.predicted
    latency = p.latency_s + extra + compute
    predicted: Prediction = dataclasses.replace(
        p,
        latency_s=latency,
        compute_s=p.compute_s + compute,
        exposed_comm_s=p.exposed_comm_s + extra,
        throughput_tokens_per_s=p.throughput_tokens_per_s * p.latency_s / latency if latency else 0.0,
        peak_memory_bytes=p.peak_memory_bytes + memory,
    )
    return dataclasses.replace(plan, predicted=predicted, fallbacks=every)

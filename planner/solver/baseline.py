"""The hand-written Megatron-LM plan, costed with the same model as the planner's plans.

Megatron's recipe (Shoeybi et al. 2019; Narayanan et al. 2021): TP = the devices of one node (the
largest degree that divides the heads and the node), PP = the number of nodes, DP = 1; attention
head-parallel (Q/K/V column-wise, output row-wise), MLP column-then-row, embedding and LM head
vocab-parallel, layers split evenly over stages, no ladder residual. Where a split is not
possible (e.g. KV heads not divisible), that op stays replicated, as a careful hand-written plan would.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodels.cluster import ClusterSpec
from planner.plan import Prediction
from planner.solver.costing import CostContext, LayerGraph, MeshShape, Workload
from planner.solver.prediction import StageBreakdown, predict

_PREFERENCE: dict[str, tuple[str, ...]] = {
    # op name -> Megatron's strategy, then fall-backs
    "q": ("colwise", "replicate"),
    "k": ("colwise", "replicate"),
    "v": ("colwise", "replicate"),
    "qkv": ("colwise", "replicate"),
    "core": ("head", "replicate"),
    "o": ("rowwise", "replicate"),
    "gate": ("colwise", "replicate"),
    "up": ("colwise", "replicate"),
    "act": ("shard", "replicate"),
    "down": ("rowwise", "replicate"),
    "embedding0": ("vocab", "replicate"),
    "lm_head": ("vocab", "replicate"),
}


@dataclass
class BaselinePlan:
    """Megatron's plan for one model and cluster, with its prediction."""

    mesh: MeshShape
    choices: dict[tuple[str, str], str]
    stages: list[list[int]]
    prediction: Prediction
    stage_breakdown: list[StageBreakdown]


def megatron_tp(cluster: ClusterSpec, num_heads: int | None) -> int:
    """Largest TP degree that divides the devices per node and the number of attention heads."""
    for tp in range(cluster.devices_per_node, 0, -1):
        if cluster.devices_per_node % tp == 0 and (num_heads is None or num_heads % tp == 0):
            return tp
    return 1


def megatron_choices(graphs: dict[str, LayerGraph], ends: LayerGraph) -> dict[tuple[str, str], str]:
    """Megatron's strategy per op: attention by heads, MLP column-then-row, chain MLP alternating."""
    choices: dict[tuple[str, str], str] = {}
    for key, graph in [*graphs.items(), ("ends", ends)]:
        head_ok = any(o.name == "head" for op in graph.ops if op.name == "core" for o in op.options)
        linear_index = 0
        for op in graph.ops:
            names = {o.name for o in op.options}
            if op.name in ("q", "k", "v", "qkv") and not head_ok:
                prefs: tuple[str, ...] = ("replicate",)
            elif op.name == "o" and not head_ok:
                prefs = ("replicate",)
            elif op.name in _PREFERENCE:
                prefs = _PREFERENCE[op.name]
            elif op.name.startswith("act"):
                prefs = ("shard", "replicate")
            else:  # a chain of linears: column, row, column, row, ...
                prefs = ("colwise", "replicate") if linear_index % 2 == 0 else ("rowwise", "replicate")
                linear_index += 1
            choices[(key, op.name)] = next(p for p in prefs if p in names)
        _fix_layouts(key, graph, choices)
    return choices


def _fix_layouts(key: str, graph: LayerGraph, choices: dict[tuple[str, str], str]) -> None:
    """Make the elementwise ops follow their producers' layout (S after colwise, else R)."""
    for op in graph.ops:
        if not op.name.startswith("act"):
            continue
        producers = [graph.op(src).option(choices[(key, src)]) for src in op.inputs]
        want = "shard" if all(p.out_layout == "S" for p in producers) else "replicate"
        if want in {o.name for o in op.options}:
            choices[(key, op.name)] = want
        consumer = next((c for c in graph.ops if op.name in c.inputs), None)
        if consumer is not None and want == "replicate" and choices[(key, consumer.name)] == "rowwise":
            choices[(key, consumer.name)] = "replicate"


def even_stages(num_layers: int, pp: int) -> list[list[int]]:
    """Layers split as evenly as possible, earlier stages taking the remainder."""
    base, extra = divmod(num_layers, pp)
    stages, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        stages.append(list(range(start, start + n)))
        start += n
    return stages


def baseline_plan(
    ctx: CostContext,
    graphs: dict[str, LayerGraph],
    layer_keys: list[str],
    ends: LayerGraph,
    recompute: bool = False,
) -> BaselinePlan:
    """Cost Megatron's strategy on the mesh of `ctx` (built by the caller with `megatron_mesh`);
    `recompute`: full activation recomputation (Megatron's --recompute-granularity full), training only."""
    choices = megatron_choices(graphs, ends)
    if recompute and ctx.train:
        choices.update({(key, "recompute"): "full" for key in graphs})
    stages = even_stages(len(layer_keys), ctx.mesh.pp)
    prediction, breakdown = predict(ctx, graphs, layer_keys, ends, choices, stages, [])
    return BaselinePlan(ctx.mesh, choices, stages, prediction, breakdown)


def megatron_mesh(
    cluster: ClusterSpec, workload: Workload, num_heads: int | None, num_layers: int
) -> MeshShape:
    """TP = devices per node (dividing the heads), PP = nodes (at most the layers), DP = 1."""
    tp = megatron_tp(cluster, num_heads)
    pp = max(1, min(cluster.num_nodes, num_layers))
    if workload.micro_batches is not None:
        m = workload.micro_batches
    else:
        m = _largest_divisor_at_most(workload.batch_size, 4 * pp if pp > 1 else 1)
    return MeshShape(tp, pp, 1, m)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, max(1, limit)) + 1) if n % d == 0)

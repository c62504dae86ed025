"""Activation recomputation at run time: regions of a lowered graph re-run in backward.

    apply_recompute(gm, structure, plan.recompute) -> [RecomputedRegion, ...]

The plan says, per layer class, how much of a layer's forward is recomputed in backward instead of
kept (`planner.plan.Plan.recompute`, `costmodels.memory.Recompute`):

- NONE: nothing; every activation autograd saves is kept.
- SELECTIVE (Korthikanti et al. 2022, section 5): the attention core - the nodes from the first to
  the last of the layer's "core" nodes (`Layer.node_blocks`: the SDPA call, or the QK^T and PV
  matmuls of a hand-written attention with its scale, mask, softmax and dropout between them). Its
  large activations (attention probabilities, SDPA's saved outputs) are dropped after forward.
- FULL (Megatron-LM `--recompute-granularity full`): every node of the layer (its module path,
  `passes.layers.layer_of_nodes`; collectives the passes inserted belong to the layer before them):
  only the layer's inputs are kept.

Each region becomes one submodule (`torch.fx.passes.utils.fuser_utils.fuse_by_partitions`) named
`recompute_<k>` (k-th region in layer order; `RecomputedRegion` names its layer and kind), wrapped in `Recomputed`, which calls it through
`torch.utils.checkpoint.checkpoint` (non-reentrant) while grad is enabled and directly otherwise.
Parameters stay where they were: `get_attr` nodes are never moved into a region (their values are
the region's inputs), so parameter FQNs, `load_sharded_weights`, gradient checks and the optimizer
see the same module. Dropout inside a region draws the same mask when recomputed: checkpoint
restores the default generator (replicated activations) and `passes.rng.recompute_rng_context`
the tensor-parallel sharded stream (shards).

Recompute keys (`recompute_of_layers`): a key of `Plan.recompute` names a layer class as the cost
model does - `planner.solver.costing.layer_key(layer)`, the `CostTables.graphs` key the ILP's
`_recompute` variables and `prediction.predict`'s `strategy["recompute"]` use; identical layers share
it. The keys "*" and "layer" are plan-wide: they set every layer whose class is not named. "chain"
(a plain MLP, no layers) may only be NONE. Any other key is an InputError naming it and the model's
class keys: a plan never recomputes less (or more) than it says without saying so.

Training only: forward-only runs keep nothing for backward, so `passes.lower.lower_for_rank`
applies this pass only with `training=True`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions
from torch.utils.checkpoint import checkpoint

from passes.layers import layer_of_nodes
from passes.rng import recompute_rng_context
from planner.errors import InputError
from planner.frontend.analysis import ModelStructure
from planner.plan import RECOMPUTE_PLAN_WIDE_KEYS, Recompute
from planner.solver.costing import layer_key

PLAN_WIDE_KEYS = RECOMPUTE_PLAN_WIDE_KEYS  # Plan.recompute keys that set every layer whose class is not named
CORE_META = "attention_core"
SUBMODULE_PREFIX = "recompute_"  # the regions' submodules: recompute_0, recompute_1, ... in layer order  # node.meta key: the node is an attention-core node of its layer (bool)


class Recomputed(nn.Module):
    """A fused region of a lowered graph, run under `torch.utils.checkpoint` (non-reentrant) when grad
    is enabled: autograd keeps only its inputs and re-runs it in backward."""

    def __init__(self, inner: fx.GraphModule, kind: Recompute, layer: int) -> None:
        super().__init__()
        self.inner, self.kind, self.layer = inner, kind, layer

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args)
        return checkpoint(self.inner, *args, use_reentrant=False, context_fn=recompute_rng_context)


def region_graph(gm: fx.GraphModule, node: fx.Node) -> fx.GraphModule | None:
    """The graph a call_module node of `gm` runs when it is a region fused from `gm`'s own nodes (a
    `Recomputed` wraps it as `inner`); None for other modules. Its placeholders are the node's args,
    in order."""
    module = gm.get_submodule(str(node.target))
    inner = getattr(module, "inner", module)
    return inner if isinstance(inner, fx.GraphModule) else None


@dataclass(frozen=True)
class RecomputedRegion:
    """One region `apply_recompute` wrapped: its submodule's name, layer, kind and node count. A
    SELECTIVE layer without an attention core is listed with no submodule ("") and no nodes."""

    submodule: str
    layer: int
    kind: Recompute
    num_nodes: int


def recompute_of_layers(structure: ModelStructure, recompute: Mapping[str, Recompute]) -> list[Recompute]:
    """The recomputation of each layer of `structure` under the plan's `recompute` (module docstring:
    class keys, then the plan-wide "*" / "layer", else NONE). Raises InputError for a key that names
    no layer class of the model, and for recomputation asked of a plain MLP ("chain")."""
    recompute = {str(k): Recompute(v) for k, v in recompute.items()}
    keys = [layer_key(layer) for layer in structure.layers]
    if not structure.layers:
        asked = {k: v for k, v in recompute.items() if v is not Recompute.NONE}
        if asked:
            raise InputError(
                f"the plan's field 'recompute' asks for {', '.join(f'{k}: {v}' for k, v in asked.items())}, "
                "but the model has no transformer layers to recompute (a plain MLP chain); set it to none"
            )
        return []
    unknown = sorted(set(recompute) - set(keys) - set(PLAN_WIDE_KEYS))
    if unknown:
        raise InputError(
            f"the plan's field 'recompute' names layer classes {unknown} that are not in this model: most "
            "likely the model's layers changed since planning (heads, KV heads or widths; a layer class "
            "names them), so plan it again with planner optimize. If you edited the field instead: the "
            f"model's classes are {sorted(set(keys))} (planner.solver.costing.layer_key), or use "
            f"{' / '.join(repr(k) for k in PLAN_WIDE_KEYS)} for every layer"
        )
    default = next((recompute[k] for k in PLAN_WIDE_KEYS if k in recompute), Recompute.NONE)
    return [recompute.get(key, default) for key in keys]


def mark_attention_cores(gm: fx.GraphModule, structure: ModelStructure) -> None:
    """Set `node.meta[CORE_META]` on the attention-core nodes of every layer (`Layer.node_blocks`), by
    name, on the captured graph before any pass renames or splits it (meta travels with the nodes)."""
    core = {
        name for layer in structure.layers for name, block in layer.node_blocks.items() if block == "core"
    }
    for node in gm.graph.nodes:
        if node.name in core:
            node.meta[CORE_META] = True


def _core_region(nodes: list[fx.Node]) -> list[fx.Node]:
    """The nodes of `nodes` (one layer, graph order) between its attention-core nodes: descendants of
    a core node that are also ancestors of one (both inclusive), in graph order."""
    cores = [n for n in nodes if n.meta.get(CORE_META)]
    if not cores:
        return []
    members = set(nodes)
    below = _reachable(cores, lambda n: [u for u in n.users if u in members])  # descendants, in the layer
    above = _reachable(cores, lambda n: [a for a in n.all_input_nodes if a in members])  # ancestors
    return [n for n in nodes if n in below and n in above]


def _reachable(starts: list[fx.Node], step) -> set[fx.Node]:
    """`starts` and every node reached from them by repeatedly following `step(node)`."""
    seen: set[fx.Node] = set()
    stack = list(starts)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack += step(n)
    return seen


def apply_recompute(
    gm: fx.GraphModule, structure: ModelStructure, recompute: Mapping[str, Recompute]
) -> list[RecomputedRegion]:
    """Wrap each layer's recomputed region of `gm` (a lowered graph or pipeline stage, nodes marked by
    `mark_attention_cores` before lowering) in a `Recomputed` submodule, in place; return the regions,
    in layer order. Layers not in `gm` (other pipeline stages) are skipped; a SELECTIVE layer of `gm`
    without an attention core is listed with an empty region (`recompute_note` says so). Raises
    InputError like `recompute_of_layers`."""
    per_layer = recompute_of_layers(structure, recompute)
    if all(kind is Recompute.NONE for kind in per_layer):
        return []
    owner = layer_of_nodes(gm, [layer.module_path for layer in structure.layers])
    by_layer: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        label = owner[node]
        if node.op in ("call_function", "call_method", "call_module") and label.startswith("layer "):
            by_layer.setdefault(int(label.split()[1]), []).append(node)
    regions: list[RecomputedRegion] = []
    partitions: list[dict[fx.Node, None]] = []
    for i, kind in enumerate(per_layer):
        nodes = by_layer.get(i, [])
        if kind is Recompute.NONE or not nodes:
            continue
        region = nodes if kind is Recompute.FULL else _core_region(nodes)
        name = f"{SUBMODULE_PREFIX}{len(partitions)}" if region else ""
        regions.append(RecomputedRegion(name, i, kind, len(region)))
        if region:
            partitions.append(dict.fromkeys(region))
    # one call: fusing, then sorting the graph, between partitions leaves torch 2.13's node lookup
    # table without the nodes it moved, and the next partition's nodes are "not found in graph"
    fuse_by_partitions(gm, partitions, prefix=SUBMODULE_PREFIX)
    for r in regions:
        if r.submodule:
            setattr(gm, r.submodule, Recomputed(getattr(gm, r.submodule), r.kind, r.layer))
    gm.graph.lint()
    gm.recompile()
    return regions


def recompute_note(regions: list[RecomputedRegion]) -> str:
    """The run report's line on recomputation: which layers were recomputed, how, and any layer the
    plan asked to recompute selectively that has no attention core (nothing recomputed there)."""
    parts = []
    for kind in (Recompute.FULL, Recompute.SELECTIVE):
        layers = [r.layer for r in regions if r.kind is kind and r.num_nodes]
        if layers:
            what = "whole layer" if kind is Recompute.FULL else "attention core"
            parts.append(f"{kind.value} ({what}) on layer{'s' * (len(layers) > 1)} {_ranges(layers)}")
    missing = [r.layer for r in regions if not r.num_nodes]
    text = "activation recompute: " + ("; ".join(parts) if parts else "none on this rank's layers")
    if missing:
        text += f"; layers {_ranges(missing)} have no attention core, nothing recomputed there"
    return text + " (torch.utils.checkpoint, re-run in backward)"


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            out.append(f"{start}" if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(out)

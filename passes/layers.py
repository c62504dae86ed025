"""Which layer each node of a (rewritten) graph belongs to, by the module path capture recorded.

A node belongs to the layer whose module path prefixes its own (`layers.3.attention.wq` -> layer 3).
Nodes the passes inserted (collectives, `tp_copy`) carry no module path and belong with the node
before them in graph order, so a row-parallel all-reduce counts in its layer. Everything outside the
layers (embeddings, final norm, LM head, tables computed before the layers) is `ENDS`. Used by the
per-layer profile (`runtime.profile`) and by activation recomputation (`passes.recompute`).
"""

from __future__ import annotations

import torch.fx as fx

ENDS = "ends"


def layer_of_nodes(gm: fx.GraphModule, layer_paths: list[str]) -> dict[fx.Node, str]:
    """Node -> "layer i" or `ENDS`, by module path (see the module docstring). layer_paths[i]: the
    module path of layer i (`planner.frontend.analysis.Layer.module_path`)."""
    owner: dict[fx.Node, str] = {}
    current = ENDS
    for node in gm.graph.nodes:
        path = node.meta.get("module_path")
        if path is None:
            owner[node] = current  # inserted by a pass: belongs with what precedes it
            continue
        current = ENDS
        for i, prefix in enumerate(layer_paths):
            if path == prefix or path.startswith(prefix + "."):
                current = f"layer {i}"
                break
        owner[node] = current
    return owner

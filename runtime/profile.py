"""Per-layer timings of a rewritten graph, so a prediction error can be located.

`profile_layers` runs the graph a few times through a `torch.fx.Interpreter` that times every node
(wall clock, `perf_counter`; CUDA synchronised per node on GPU, which serialises the device and makes
the totals larger than a real step: use the shares, not the sums) and adds the times up per layer.
A node belongs to the layer whose module path prefixes its own (`layers.3.attention.wq` -> layer 3);
nodes the passes inserted (collectives) carry no module path and are charged to the node before them,
so a row-parallel all-reduce counts in its layer. Everything outside the layers is "ends".
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.fx as fx

ENDS = "ends"


def layer_of_nodes(gm: fx.GraphModule, layer_paths: list[str]) -> dict[fx.Node, str]:
    """Node -> "layer i" or "ends", by module path (see the module docstring)."""
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


class _TimingInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, owner: dict[fx.Node, str], cuda: bool) -> None:
        super().__init__(gm)
        self.owner, self.cuda = owner, cuda
        self.totals_s: dict[str, float] = {}

    def run_node(self, n: fx.Node) -> Any:
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = super().run_node(n)
        if self.cuda:
            torch.cuda.synchronize()
        key = self.owner.get(n, ENDS)
        self.totals_s[key] = self.totals_s.get(key, 0.0) + time.perf_counter() - start
        return out


def profile_layers(
    gm: fx.GraphModule, inputs: tuple, layer_paths: list[str], repeats: int = 3
) -> dict[str, float]:
    """Median seconds per layer ("layer 0", ..., "ends") over `repeats` forward runs (no grad).

    Collective ops inside `gm` make every rank of its group run this together: call it on all ranks.
    """
    owner = layer_of_nodes(gm, layer_paths)
    cuda = any(t.is_cuda for t in inputs if isinstance(t, torch.Tensor))
    runs: list[dict[str, float]] = []
    with torch.no_grad():
        for _ in range(max(1, repeats)):
            interp = _TimingInterpreter(gm, owner, cuda)
            interp.run(*inputs)
            runs.append(interp.totals_s)
    keys = sorted({k for r in runs for k in r}, key=_order)
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}


def _order(key: str) -> tuple[int, int]:
    return (1, 0) if key == ENDS else (0, int(key.split()[1]))

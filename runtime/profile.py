"""Per-layer timings of a rewritten graph, so a prediction error can be located.

`profile_layers` cuts the graph into contiguous segments of nodes owned by one layer (or by the
"ends": embeddings, final norm, LM head, tables computed outside the layers) with
`torch.fx.passes.split_module`, wraps each segment's sub-GraphModule in a timer (`perf_counter`; CUDA
synchronised at segment edges on GPU) and runs the split module a few times. Each segment runs as
generated code, as in the whole forward, so a row includes its nodes' dispatch overhead and its
collectives, and the rows add up to the whole forward (plus one Python call per segment, a few µs).
Layer membership is `passes.layers.layer_of_nodes`: by module path; nodes the passes inserted
(collectives) are charged to the node before them, so a row-parallel all-reduce counts in its layer.
Everything outside the layers is "ends".
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from passes.layers import ENDS, layer_of_nodes


class _Timed(torch.nn.Module):
    """A segment's sub-GraphModule whose calls add their wall time to ``totals[label]``."""

    def __init__(self, inner: torch.nn.Module, label: str, totals: dict[str, float], cuda: bool) -> None:
        super().__init__()
        self.inner, self.label, self.totals, self.cuda = inner, label, totals, cuda

    def forward(self, *args: Any) -> Any:
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = self.inner(*args)
        if self.cuda:
            torch.cuda.synchronize()
        self.totals[self.label] = self.totals.get(self.label, 0.0) + time.perf_counter() - start
        return out


def split_by_layer(
    gm: fx.GraphModule, layer_paths: list[str], totals: dict[str, float], cuda: bool = False
) -> fx.GraphModule:
    """`gm` cut into contiguous segments of one owner each (graph order), every segment a timed
    submodule adding its seconds to ``totals`` under its owner's label. Computes what `gm` computes."""
    owner = layer_of_nodes(gm, layer_paths)
    segment, labels, last = {}, [], None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if owner[node] != last:
            labels.append(owner[node])
            last = owner[node]
        segment[node] = len(labels) - 1
    split = split_module(gm, gm, lambda node: segment[node], keep_original_order=True)
    for name, sub in list(split.named_children()):
        if name.startswith("submod_"):
            setattr(split, name, _Timed(sub, labels[int(name.removeprefix("submod_"))], totals, cuda))
    return split


def profile_layers(
    gm: fx.GraphModule, inputs: tuple, layer_paths: list[str], repeats: int = 3
) -> dict[str, float]:
    """Median seconds per layer ("layer 0", ..., "ends") over `repeats` forward runs (no grad), each
    layer timed as its nodes run in the whole forward (see the module docstring): the values add up
    to the forward's time.

    Collective ops inside `gm` make every rank of its group run this together: call it on all ranks.
    """
    cuda = any(t.is_cuda for t in inputs if isinstance(t, torch.Tensor))
    totals: dict[str, float] = {}
    split = split_by_layer(gm, layer_paths, totals, cuda)
    runs: list[dict[str, float]] = []
    with torch.no_grad():
        split(*inputs)  # warm-up
        for _ in range(max(1, repeats)):
            totals.clear()
            split(*inputs)
            runs.append(dict(totals))
    keys = sorted({k for r in runs for k in r}, key=_order)
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}


def _order(key: str) -> tuple[int, int]:
    return (1, 0) if key == ENDS else (0, int(key.split()[1]))

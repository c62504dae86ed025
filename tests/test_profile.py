"""Per-layer profiling of a captured graph: every layer and the ends get a time; outputs unchanged."""

from __future__ import annotations

from pathlib import Path

import torch

from planner.frontend.analysis import analyse
from planner.frontend.capture import capture
from planner.frontend.modelfile import load_model_file
from runtime.profile import ENDS, layer_of_nodes, profile_layers

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_profile_assigns_every_node_and_times_every_layer():
    model_file = load_model_file(EXAMPLES / "llama3.py")
    model = model_file.build()
    args, kwargs = model_file.inputs()
    gm = capture(model, args, kwargs)
    structure = analyse(gm)
    paths = [layer.module_path for layer in structure.layers]
    owner = layer_of_nodes(gm, paths)
    for i, layer in enumerate(structure.layers):
        wq = next(p for p in layer.attention.projections if p.role == "q")
        assert owner[next(n for n in gm.graph.nodes if n.name == wq.node)] == f"layer {i}"
    times = profile_layers(gm, args, paths, repeats=2)
    assert list(times) == [f"layer {i}" for i in range(len(paths))] + [ENDS]
    assert all(t > 0 for t in times.values())
    with torch.no_grad():
        assert torch.equal(gm(*args), model(*args))


def test_layer_times_are_segments_of_the_whole_forward():
    """The split module computes what the graph computes, and its segments' times are parts of one
    forward (nested inside it), labelled layer by layer in graph order."""
    import time

    from runtime.profile import split_by_layer

    model_file = load_model_file(EXAMPLES / "llama3.py")
    model = model_file.build()
    args, kwargs = model_file.inputs()
    gm = capture(model, args, kwargs)
    paths = [layer.module_path for layer in analyse(gm).layers]
    totals: dict[str, float] = {}
    split = split_by_layer(gm, paths, totals)
    with torch.no_grad():
        start = time.perf_counter()
        out = split(*args)
        whole = time.perf_counter() - start
        assert torch.equal(out, gm(*args))
    assert set(totals) == {f"layer {i}" for i in range(len(paths))} | {ENDS}
    assert sum(totals.values()) <= whole

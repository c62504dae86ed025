"""Planning through a representative slice of a deep model gives the same structure and plan."""

from __future__ import annotations

import pytest

from costmodels.cluster import load_cluster
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture
from planner.frontend.depth import KEEP_LAYERS, capture_for_planning, repeated_blocks
from planner.frontend.modelfile import load_model_file
from planner.solver.problem import Constraints, WorkloadSpec
from planner.solver.search import plan_model


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama3_8b"])
def test_representative_slice_matches_full_capture(example_path, name):
    model_file = load_model_file(example_path(name))
    args, kwargs = model_file.inputs()
    model = model_file.build("meta")
    path, blocks = repeated_blocks(model)
    gm, short = capture_for_planning(model, args, kwargs)
    full = analyse(capture(model, args, kwargs))
    assert len(blocks) == len(full.layers) == len(short.layers)  # the model was restored after tracing
    assert sum(1 for n in gm.graph.nodes if n.op == "call_function") < 0.5 * len(full.node_costs)
    assert (short.num_params, short.param_bytes) == (full.num_params, full.param_bytes)
    for a, b in zip(short.layers, full.layers):
        assert (a.index, a.module_path, a.param_bytes, a.flops) == (
            b.index,
            b.module_path,
            b.param_bytes,
            b.flops,
        )
        for block_a, block_b in ((a.attention, b.attention), (a.mlp, b.mlp)):
            assert [(p.weight, p.bias, p.role, p.flops) for p in block_a.projections] == [
                (p.weight, p.bias, p.role, p.flops) for p in block_b.projections
            ]
    workload = WorkloadSpec("forward", full.batch_size, full.seq_len, dtype="bf16")
    p_short = plan_model(short, load_cluster("dgx-h100"), workload, Constraints())
    p_full = plan_model(full, load_cluster("dgx-h100"), workload, Constraints())
    assert p_short.splits == p_full.splits and p_short.predicted.latency_s == p_full.predicted.latency_s
    assert KEEP_LAYERS < len(blocks)

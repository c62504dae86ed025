"""The host's issue time on an asynchronous device (`DeviceSpec.host_dispatch_s`, written by `planner
calibrate` on CUDA): a floor under each layer's and each end's time, the same in the ILP and in the
prediction. On an H200 (2026-12-04) the tiny Llama's forward ran at 5.04 ms against 2.05 ms priced per
kernel launch: the GPU waited for the host, whose probe graph issued a node per 18 us."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from costmodels.cluster import cluster_to_dict, load_cluster, parse_cluster
from planner.errors import InputError
from planner.frontend.depth import capture_for_planning
from planner.frontend.modelfile import load_model_file
from planner.plan import MeshShape, Recompute
from planner.solver import ilp
from planner.solver.costing import graph_node_count
from planner.solver.ilp import IlpProblem
from planner.solver.prediction import predict
from planner.solver.problem import LadderPolicy, MeshConfig, WorkloadSpec
from planner.solver.search import price

MESH = MeshConfig(MeshShape(1, 1, 1), 1)


@pytest.fixture(scope="module")
def tiny_llama():
    model_file = load_model_file("examples/llama3.py")
    args, kwargs = model_file.inputs(batch_size=2, seq_len=32)
    return capture_for_planning(model_file.build("cpu"), args, kwargs)[1]


def _cluster(forward_s: float | None, backward_s: float | None = None):
    h100 = load_cluster("dgx-h100")
    device = dataclasses.replace(h100.device, host_dispatch_s=forward_s, host_dispatch_backward_s=backward_s)
    return dataclasses.replace(h100, device=device)


def _solve(structure, cluster, work):
    tables = price(structure, cluster, work, MESH)
    prob = IlpProblem(
        tables,
        LadderPolicy.parse("none").for_layers(len(structure.layers)),
        0.9 * cluster.device.memory_bytes,
    )
    sol = ilp.solve(prob)
    assert sol.assignment is not None
    return tables, sol


def test_a_host_bound_layer_costs_its_nodes_times_the_dispatch(tiny_llama) -> None:
    work = WorkloadSpec("forward", 2, 32, dtype="bf16")
    per_node_s = 1e-3  # far above any kernel of the tiny model
    tables, sol = _solve(tiny_llama, _cluster(per_node_s), work)
    layer = tiny_llama.layers[0]
    nodes = graph_node_count(layer.nodes, tiny_llama)
    assert nodes > 20
    graph = tables.graphs[tables.layer_keys[0]]
    assert graph.dispatch_s == pytest.approx(nodes * per_node_s)
    ends = tables.ends
    assert ends.first_stage_dispatch_s > 0 and ends.last_stage_dispatch_s > 0
    priced = predict(tables, sol.assignment).prediction
    expected = len(tiny_llama.layers) * graph.dispatch_s + ends.dispatch_s
    assert priced.latency_s == pytest.approx(expected, rel=1e-9)
    assert all(row.compute_s == pytest.approx(graph.dispatch_s) for row in priced.per_layer if row.layer >= 0)
    assert sol.objective == pytest.approx(priced.latency_s, rel=1e-6)  # the ILP prices the same floor
    # without the figure (the presets): no floor, and the kernels alone are far faster
    bare_tables, bare = _solve(tiny_llama, _cluster(None), work)
    assert bare_tables.graphs[bare_tables.layer_keys[0]].dispatch_s == 0.0
    assert predict(bare_tables, bare.assignment).prediction.latency_s < expected / 10


def test_kernel_bound_layers_are_left_alone(tiny_llama) -> None:
    work = WorkloadSpec("forward", 64, 4096, dtype="bf16")  # kernels of ~ms against ~50 nodes x 1 us
    tables, sol = _solve(tiny_llama, _cluster(1e-6), work)
    bare_tables, bare = _solve(tiny_llama, _cluster(None), work)
    floored = predict(tables, sol.assignment).prediction.latency_s
    assert tables.graphs[tables.layer_keys[0]].dispatch_s > 0
    assert floored == pytest.approx(predict(bare_tables, bare.assignment).prediction.latency_s, rel=1e-12)


def test_training_counts_the_backward_nodes_too(tiny_llama) -> None:
    work = WorkloadSpec("train", 2, 32, dtype="bf16")
    tables = price(tiny_llama, _cluster(18e-6, 49e-6), work, MESH)
    nodes = graph_node_count(tiny_llama.layers[0].nodes, tiny_llama)
    assert tables.graphs[tables.layer_keys[0]].dispatch_s == pytest.approx(nodes * (18e-6 + 49e-6))
    forward = price(tiny_llama, _cluster(18e-6, 49e-6), WorkloadSpec("forward", 2, 32, dtype="bf16"), MESH)
    assert forward.graphs[forward.layer_keys[0]].dispatch_s == pytest.approx(nodes * 18e-6)


def test_the_spec_reads_and_writes_host_dispatch() -> None:
    data = cluster_to_dict(load_cluster("dgx-h100"))
    assert "host_dispatch_us" not in data["device"]  # the presets price published, compiled runs
    data["device"]["host_dispatch_us"] = 18
    data["device"]["host_dispatch_backward_us"] = 49
    spec = parse_cluster(data, "test")
    assert spec.device.host_dispatch_s == pytest.approx(18e-6)
    assert spec.device.host_dispatch_backward_s == pytest.approx(49e-6)
    again = cluster_to_dict(spec)["device"]
    assert (again["host_dispatch_us"], again["host_dispatch_backward_us"]) == (18, 49)
    data["device"]["host_dispatch_us"] = -1
    with pytest.raises(InputError, match="host_dispatch_us"):
        parse_cluster(data, "test")
    del data["device"]["host_dispatch_us"]  # the backward figure alone would be ignored: refused
    with pytest.raises(InputError, match="host_dispatch_backward_us.*host_dispatch_us"):
        parse_cluster(data, "test")


def test_full_recompute_issues_the_forward_again(tiny_llama) -> None:
    work = WorkloadSpec("train", 2, 32, dtype="bf16")
    cluster = _cluster(18e-6, 49e-6)
    tables = price(tiny_llama, cluster, work, MESH)
    policy = LadderPolicy.parse("none").for_layers(len(tiny_llama.layers))
    latency = {}
    for recompute in (Recompute.NONE, Recompute.FULL):
        prob = IlpProblem(tables, policy, 0.9 * cluster.device.memory_bytes, recompute=recompute)
        sol = ilp.solve(prob)
        latency[recompute] = predict(tables, sol.assignment).prediction.latency_s
        assert sol.objective == pytest.approx(latency[recompute], rel=1e-6)
    graph = tables.graphs[tables.layer_keys[0]]
    nodes = graph_node_count(tiny_llama.layers[0].nodes, tiny_llama)
    assert graph.forward_dispatch_s == pytest.approx(nodes * 18e-6)
    rerun = latency[Recompute.FULL] - latency[Recompute.NONE]  # host-bound: the forward's nodes again
    assert rerun == pytest.approx(len(tiny_llama.layers) * graph.forward_dispatch_s, rel=1e-6)


def test_pipeline_stages_keep_the_ilp_split_with_host_bound_ends(tmp_path) -> None:
    # an HF Llama given a padding mask holds 43 nodes before the first layer on its first stage (position
    # ids, the mask, RoPE tables): host-bound, they weigh more than a layer's kernels; the re-balancing
    # after the ILP must see that
    source = Path("examples/hf_llama.py").read_text()
    mask = '"attention_mask": torch.ones(2, 512, dtype=torch.long), "use_cache": False'
    for old, new in (("num_hidden_layers=2", "num_hidden_layers=3"), ("vocab_size=256", "vocab_size=262144"),
                     ("max_position_embeddings=256", "max_position_embeddings=4096"),
                     ('"use_cache": False', mask)):  # fmt: skip
        assert old in source
        source = source.replace(old, new)
    path = tmp_path / "hf_llama3.py"
    path.write_text(source)
    model_file = load_model_file(path)
    args, kwargs = model_file.inputs(batch_size=2, seq_len=512)
    structure = capture_for_planning(model_file.build("cpu"), args, kwargs)[1]
    cluster = _cluster(18e-6, 49e-6)
    tables = price(
        structure, cluster, WorkloadSpec("forward", 8, 512, dtype="bf16"), MeshConfig(MeshShape(1, 2, 1), 4)
    )
    assert tables.ends.first_stage_dispatch_s > tables.graphs[tables.layer_keys[0]].cheapest_compute_s()
    prob = IlpProblem(tables, LadderPolicy.parse("none").for_layers(3), 0.9 * cluster.device.memory_bytes)
    sol = ilp.solve(prob)
    priced = predict(tables, sol.assignment)
    slowest = max(stage.time_s for stage in priced.stages)
    # the objective carries a tie-break on the slowest stage besides the latency
    assert sol.objective - ilp.BALANCE_TIE_BREAK * slowest == pytest.approx(
        priced.prediction.latency_s, rel=1e-6
    )
    assert [len(stage) for stage in sol.assignment.stages] == [
        1,
        2,
    ]  # the host-bound first stage takes one layer

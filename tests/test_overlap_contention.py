"""Hidden communication slows the compute it hides under (`ClusterSpec.overlap_slowdown`,
`planner.solver.costing.contention_s`): the spec field, and each place overlap is priced (the
overlapped DP phases, TP overlap, ladder residual) charging it where the ILP and the prediction agree."""

from __future__ import annotations

import dataclasses

import pytest

from costmodels.cluster import SpecError, cluster_to_dict, load_cluster, parse_cluster
from planner.plan import MeshShape
from planner.solver.costing import (
    CostContext,
    P,
    contention_s,
    dp_sync_exposed_s,
    dp_sync_phases,
    tp_block_comm_s,
)
from planner.solver.problem import DataParallel, MeshConfig, WorkloadSpec
from tests.planner_fixtures import analysed_llama


def test_gpu_presets_cite_a_slowdown_the_cpu_preset_has_none_and_it_round_trips() -> None:
    h100, cpu = load_cluster("dgx-h100"), load_cluster("local-cpu")
    assert h100.overlap_slowdown == pytest.approx(0.19)
    assert cpu.overlap_slowdown == 0.0 and "overlap_slowdown" not in cluster_to_dict(cpu)
    assert parse_cluster(cluster_to_dict(h100), "again") == h100
    assert contention_s(2.0, h100) == pytest.approx(0.38) and contention_s(2.0, cpu) == 0.0


@pytest.mark.parametrize("value", [1.5, -0.1, "19%", True])
def test_a_bad_slowdown_names_the_field(value) -> None:
    data = cluster_to_dict(load_cluster("dgx-h100"))
    data["overlap_slowdown"] = value
    with pytest.raises(SpecError, match="overlap_slowdown"):
        parse_cluster(data, "spec.yaml")


def _ctx(sigma: float, tp: int = 1, dp: int = 8, **config) -> CostContext:
    cluster = dataclasses.replace(load_cluster("dgx-h100"), overlap_slowdown=sigma)
    mesh = MeshConfig(MeshShape(tp, 1, dp), 1, **config)
    return CostContext(analysed_llama("8b"), cluster, WorkloadSpec("train", 8, 4096), mesh, "bf16")


def test_each_overlapped_dp_phase_pays_the_slowdown_of_what_it_hides() -> None:
    """exposed = max(unhidden, total - eta w C) + sigma (total - that): with compute enough to hide
    all but a bucket, sigma of the hidden rest is added; without overlap nothing changes."""
    nbytes, compute_s = 16e9, 1e3
    flags = {"dp_style": DataParallel.ZERO1, "overlap_grad_reduce": True, "overlap_param_gather": True}
    free, slowed = _ctx(0.0, **flags), _ctx(0.25, **flags)
    phases = dp_sync_phases(nbytes, slowed)
    hidden = sum(p.total_s - p.unhidden_s for p in phases)
    assert hidden > 0
    added = dp_sync_exposed_s(nbytes, compute_s, slowed) - dp_sync_exposed_s(nbytes, compute_s, free)
    assert added == pytest.approx(0.25 * hidden)
    plain = {"dp_style": DataParallel.ZERO1}
    assert dp_sync_exposed_s(nbytes, compute_s, _ctx(0.25, **plain)) == dp_sync_exposed_s(
        nbytes, compute_s, _ctx(0.0, **plain)
    )


def test_tp_overlap_adds_the_slowdown_of_the_traffic_it_hides() -> None:
    out_bytes, column_s, row_s = 64e6, 3e-3, 3e-3
    flags = {"sequence_parallel": True, "tp_comm_overlap": True}
    free = tp_block_comm_s(P, out_bytes, column_s, row_s, _ctx(0.0, tp=8, dp=1, **flags))
    slowed = tp_block_comm_s(P, out_bytes, column_s, row_s, _ctx(0.25, tp=8, dp=1, **flags))
    assert free[1] == slowed[1] > 0  # the same traffic hides
    assert slowed[0] == pytest.approx(free[0] + 0.25 * free[1])


def test_a_laddered_plan_prices_the_slowdown_and_its_report_still_adds_up() -> None:
    """Ladder residual on a DGX H100: each laddered layer's exposed time is its comm - hidden + sigma
    hidden, overlapped the hidden net of sigma, so exposed + overlapped is the comm without ladder."""
    from planner.solver.costing import build_cost_tables  # noqa: PLC0415
    from planner.solver.prediction import layer_breakdown  # noqa: PLC0415
    from planner.solver.problem import Constraints, LadderPolicy  # noqa: PLC0415
    from planner.solver.search import plan_model  # noqa: PLC0415
    from planner.solver.serving import plan_assignment  # noqa: PLC0415

    structure = analysed_llama("8b")
    cluster = load_cluster("dgx-h100")
    work = WorkloadSpec("forward", 1, 2048, dtype="bf16")
    plan = plan_model(structure, cluster, work, Constraints(tp=8, ladder=LadderPolicy.parse("upper:32")))
    assert plan.ladder_layers
    config = MeshConfig(plan.mesh, plan.micro_batches)
    ctx = CostContext(structure, cluster, work, config, "bf16")
    tables = build_cost_tables(ctx)
    assignment = plan_assignment(plan, tables)
    key = next(iter(tables.graphs))
    graph = tables.graphs[key]
    laddered = layer_breakdown(graph, key, assignment, True, ctx)
    standard = layer_breakdown(graph, key, assignment, False, ctx)
    assert laddered.overlapped_comm_s > 0
    assert laddered.comm_s + laddered.overlapped_comm_s == pytest.approx(standard.comm_s)
    hidden = laddered.overlapped_comm_s / (1 - cluster.overlap_slowdown)
    assert laddered.comm_s == pytest.approx(standard.comm_s - hidden + contention_s(hidden, cluster))

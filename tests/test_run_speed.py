"""A run re-priced at the machine's speed measured beside its steps (`workflow.at_run_speed`): the
per-node overhead the speed probe read replaces the calibrated one, the rest of the spec stays."""

from __future__ import annotations

import dataclasses

import pytest

from costmodels.cluster import CALIBRATED_SPEC_NAME, load_cluster
from planner.cli import workflow
from planner.cli.render import speed_line
from planner.solver.problem import Constraints, WorkloadSpec
from planner.solver.search import plan_model
from tests.planner_fixtures import analysed_llama


@pytest.fixture(scope="module")
def calibrated():
    return dataclasses.replace(load_cluster("local-cpu", 2), name=CALIBRATED_SPEC_NAME)


def _plan(structure, cluster, workload: str):
    return plan_model(structure, cluster, WorkloadSpec(workload, 2, 32), Constraints(tp=2, pp=1, dp=1))


def _run(measured_s: float, node_overhead_s: float, backward_s: float | None = None) -> dict:
    probe = {"node_overhead_s": node_overhead_s, "backward_node_overhead_s": backward_s, "samples": 40}
    return {"measured": {"latency_s": measured_s, "speed_probe": probe}}


@pytest.mark.parametrize("workload", ["forward", "train"])
def test_at_run_speed_reprices_the_plan_at_the_probed_per_node_overhead(calibrated, workload) -> None:
    structure = analysed_llama("tiny")
    plan = _plan(structure, calibrated, workload)
    base_s = calibrated.device.node_overhead_s
    assert workflow.probes_speed(calibrated) and not workflow.probes_speed(load_cluster("local-cpu", 2))
    same = workflow.at_run_speed(plan, structure, calibrated, _run(1.0, base_s))
    assert same["speed_ratio"] == pytest.approx(1.0)
    assert same["latency_s"] == pytest.approx(plan.predicted.latency_s)  # unchanged at the calibrated speed
    slow = workflow.at_run_speed(plan, structure, calibrated, _run(1.0, 2 * base_s))
    fast = workflow.at_run_speed(plan, structure, calibrated, _run(1.0, 0.5 * base_s))
    # only the dispatch share of the step moves: slower, but less than 2x (compute and comm stay)
    assert plan.predicted.latency_s < slow["latency_s"] < 2 * plan.predicted.latency_s
    assert 0.5 * plan.predicted.latency_s < fast["latency_s"] < plan.predicted.latency_s
    assert workflow.at_run_speed(plan, None, calibrated, _run(1.0, base_s)) is None
    assert workflow.at_run_speed(plan, structure, calibrated, {"measured": {"latency_s": 1.0}}) is None


def test_speed_line_only_when_the_machine_drifted() -> None:
    at_run = {
        "node_overhead_s": 20e-6,
        "calibrated_node_overhead_s": 10e-6,
        "speed_ratio": 2.0,
        "latency_s": 0.005,
    }
    line = speed_line(at_run, 0.0052)
    assert (
        "2.00x slower" in line
        and "20.0 µs per node" in line
        and "measured / predicted = 1.04 (within 10%)" in line
    )
    assert speed_line({**at_run, "speed_ratio": 1.05}, 0.0052) is None
    assert "0.50x" not in speed_line({**at_run, "speed_ratio": 0.5}, 0.0052)  # said as "2.00x faster"
    assert speed_line(None, 0.0052) is None


def test_a_plan_repriced_on_its_own_cluster_is_its_prediction(calibrated) -> None:
    """`predict_with_plan` re-prices the plan's whole layout: a training plan with recompute and a
    chain of linears (no transformer layers, stages [[]] in the plan) come back at their own figure."""
    from planner.solver.serving import predict_with_plan
    from tests.planner_fixtures import analysed_mlp

    llama = analysed_llama("tiny")
    train = plan_model(
        llama, calibrated, WorkloadSpec("train", 4, 32), Constraints(tp=1, pp=2, dp=1, recompute="full")
    )
    chain = analysed_mlp(64, 256, 64, 3)
    mlp = plan_model(chain, calibrated, WorkloadSpec("forward", 4, 1), Constraints(tp=2, pp=1, dp=1))
    for plan, structure in ((train, llama), (mlp, chain)):
        wl = WorkloadSpec(plan.workload, plan.batch_size, plan.seq_len, micro_batches=plan.micro_batches)
        repriced = predict_with_plan(plan, structure, calibrated, wl, plan.ladder_layers)
        assert repriced == pytest.approx(plan.predicted.latency_s)

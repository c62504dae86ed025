"""A run re-priced at the machine's speed measured beside its steps (`planner.solver.machine.at_run_speed`): the
per-node overhead the speed probe read replaces the calibrated one, the rest of the spec stays."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from costmodels.cluster import CALIBRATED_SPEC_NAME, load_cluster
from planner.cli import workflow
from planner.cli.render import speed_line
from planner.solver import machine
from planner.solver.problem import Constraints, WorkloadSpec
from planner.solver.search import plan_model
from tests.planner_fixtures import analysed_llama


@pytest.fixture(scope="module")
def calibrated():
    return dataclasses.replace(load_cluster("local-cpu", 2), name=CALIBRATED_SPEC_NAME)


def _plan(structure, cluster, workload: str):
    return plan_model(structure, cluster, WorkloadSpec(workload, 2, 32), Constraints(tp=2, pp=1, dp=1))


def _run(
    measured_s: float, node_overhead_s: float, backward_s: float | None = None, matmul: float | None = None
) -> dict:
    probe = {
        "node_overhead_s": node_overhead_s,
        "backward_node_overhead_s": backward_s,
        "samples": 40,
        "matmul_flops_per_s": matmul,
    }
    return {"measured": {"latency_s": measured_s, "speed_probe": probe}}


@pytest.mark.parametrize("workload", ["forward", "train"])
def test_at_run_speed_reprices_the_plan_at_the_probed_per_node_overhead(calibrated, workload) -> None:
    structure = analysed_llama("tiny")
    plan = _plan(structure, calibrated, workload)
    base_s = calibrated.device.node_overhead_s
    assert workflow.probes_speed(calibrated) and not workflow.probes_speed(load_cluster("local-cpu", 2))
    same = machine.at_run_speed(plan, structure, calibrated, _run(1.0, base_s))
    assert same["speed_ratio"] == pytest.approx(1.0)
    assert same["latency_s"] == pytest.approx(plan.predicted.latency_s)  # unchanged at the calibrated speed
    slow = machine.at_run_speed(plan, structure, calibrated, _run(1.0, 2 * base_s))
    fast = machine.at_run_speed(plan, structure, calibrated, _run(1.0, 0.5 * base_s))
    # only the dispatch share of the step moves: slower, but less than 2x (compute and comm stay)
    assert plan.predicted.latency_s < slow["latency_s"] < 2 * plan.predicted.latency_s
    assert 0.5 * plan.predicted.latency_s < fast["latency_s"] < plan.predicted.latency_s
    assert same["matmul_ratio"] is None  # local-cpu's figures record no probe matmul reference
    referenced = dataclasses.replace(
        calibrated, device=dataclasses.replace(calibrated.device, probe_matmul_flops_per_s=50e9)
    )
    half = machine.at_run_speed(plan, structure, referenced, _run(1.0, base_s, matmul=25e9))
    # matmuls at half their calibrated rate: slower, by less than 2x (dispatch and comm stay)
    assert half["matmul_ratio"] == pytest.approx(2.0)
    assert plan.predicted.latency_s < half["latency_s"] < 2 * plan.predicted.latency_s
    # a spec measured at a small model's scale keeps the toy probe's slope as the probe's reference
    sized = dataclasses.replace(
        calibrated, device=dataclasses.replace(calibrated.device, probe_node_overhead_s=base_s / 2)
    )
    at_ref = machine.at_run_speed(plan, structure, sized, _run(1.0, base_s / 2))
    assert at_ref["speed_ratio"] == pytest.approx(1.0) and at_ref["latency_s"] == pytest.approx(
        plan.predicted.latency_s
    )
    assert machine.at_run_speed(plan, None, calibrated, _run(1.0, base_s)) is None
    # a probe that read no per-node slope (0 on a loaded machine) is no reading: nothing re-priced,
    # and the verdict's speed line (which divides by the ratio) is not printed
    assert machine.at_run_speed(plan, structure, calibrated, _run(1.0, 0.0)) is None
    assert machine.at_run_speed(plan, structure, calibrated, {"measured": {"latency_s": 1.0}}) is None


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
    matmul = {**at_run, "speed_ratio": 1.0, "matmul_ratio": 1.25, "matmul_flops_per_s": 40e9}
    line = speed_line({**matmul, "calibrated_matmul_flops_per_s": 50e9}, 0.0052)
    assert "multiplied 1.25x slower" in line and "matmul 40.0 GFLOP/s (calibrated 50.0)" in line


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


def test_probe_references_are_read_written_and_checked(tmp_path) -> None:
    from costmodels.calibrate import write_cluster_yaml
    from costmodels.cluster import SpecError

    preset = Path(__file__).resolve().parent.parent / "costmodels" / "clusters" / "local-cpu.yaml"
    text = preset.read_text().replace(
        "  node_overhead_us: 9\n",
        "  node_overhead_us: 9\n  probe_node_overhead_us: 6.5\n  probe_matmul_GFLOPS: 61.5\n",
    )
    (tmp_path / "a.yaml").write_text(text)
    spec = load_cluster(str(tmp_path / "a.yaml"), 2)
    assert spec.device.probe_node_overhead_s == pytest.approx(6.5e-6)
    write_cluster_yaml(spec, tmp_path / "b.yaml")
    assert load_cluster(str(tmp_path / "b.yaml"), 2).device.probe_node_overhead_s == pytest.approx(6.5e-6)
    assert load_cluster(str(tmp_path / "b.yaml"), 2).device.probe_matmul_flops_per_s == pytest.approx(61.5e9)
    (tmp_path / "c.yaml").write_text(text.replace("6.5", "-3"))
    with pytest.raises(SpecError, match="device.probe_node_overhead_us"):
        load_cluster(str(tmp_path / "c.yaml"), 2)


def test_per_node_overhead_priced_net_of_the_probe_roofline() -> None:
    """calibrate's sized probe: its time per node net of the roofline the cost model prices for it;
    the toy probe's slopes become the speed probe's references."""
    from costmodels.calibrate import _net_of_roofline
    from costmodels.cluster import cluster_to_dict, parse_cluster

    data = cluster_to_dict(load_cluster("local-cpu", 2))
    data["sources"] = list(data["sources"])
    spec = parse_cluster(data, "test")
    roofline = {2: (100e-6, 70), 8: (400e-6, 270)}  # 1.5 us of roofline per node between them
    # forward: 2 ms more for 200 more nodes, 300 us of it roofline -> 8.5 us per node; backward: the
    # train graph adds 5 ms more than the forward, 600 us of it roofline (2x) -> 22 us per node
    sized = [1e-3, 3e-3, 3e-3, 10e-3]
    net = _net_of_roofline(spec, data, sized, lambda blocks, _spec: roofline[blocks])
    assert net.device.node_overhead_s == pytest.approx(8.5e-6)
    assert net.device.backward_node_overhead_s == pytest.approx(22e-6)
    assert net.device.probe_node_overhead_s == pytest.approx(9e-6)  # local-cpu's toy figures
    assert net.device.probe_backward_node_overhead_s == pytest.approx(20e-6)
    roof_s, nodes = workflow.probe_roofline(8, spec)
    assert nodes > workflow.probe_roofline(2, spec)[1] and roof_s > 0


def test_per_node_overhead_interpolates_down_to_the_toy_probe_for_small_activations() -> None:
    """Sized figure at and above the sized probe's activations, the toy probe's at its own, log-linear
    between (a decode step of one token per sequence dispatches like the toy probe)."""
    from costmodels.compute import SIZED_PROBE_ELEMENTS, TOY_PROBE_ELEMENTS, per_node_overhead_s

    dev = dataclasses.replace(
        load_cluster("local-cpu", 2).device, node_overhead_s=10e-6, probe_node_overhead_s=7e-6
    )
    assert per_node_overhead_s(dev, 4 * SIZED_PROBE_ELEMENTS) == pytest.approx(10e-6)
    assert per_node_overhead_s(dev, TOY_PROBE_ELEMENTS) == pytest.approx(7e-6)
    middle = (TOY_PROBE_ELEMENTS * SIZED_PROBE_ELEMENTS) ** 0.5
    assert per_node_overhead_s(dev, middle) == pytest.approx(8.5e-6)
    assert per_node_overhead_s(dataclasses.replace(dev, probe_node_overhead_s=None), 1) == pytest.approx(
        10e-6
    )


def test_verdict_points_at_the_speed_line_only_when_the_speed_explains_the_gap(monkeypatch) -> None:
    """First verdict line: "see the next line" when the plan re-priced at the run's speed agrees with
    the stopwatch; when it is off there too, that it is (the next line blames the cost model), never
    "recalibrate", which the speed line contradicts."""
    import importlib
    import io
    import types

    from rich.console import Console

    from planner.cli.render import RECALIBRATE

    main = importlib.import_module("planner.cli.main")

    at_run = {"node_overhead_s": 20e-6, "calibrated_node_overhead_s": 10e-6, "speed_ratio": 2.0}
    plan = types.SimpleNamespace(predicted=types.SimpleNamespace(latency_s=0.001), num_devices=2)
    busy_during_run = main.busy_during_run
    monkeypatch.setattr(main, "busy_during_run", lambda ranks: None)  # whatever this machine's load now
    for latency_s, expect, refuse in (
        (0.0045, "see the next line", "so the cost model is off"),
        (0.001, "off at the run's own speed too", "see the next line"),
    ):
        out = io.StringIO()
        monkeypatch.setattr(main, "console", Console(file=out, width=300))
        report = {"measured": {"latency_s": 0.0046, "at_run_speed": {**at_run, "latency_s": latency_s,
                  "measured_over_predicted": 0.0046 / latency_s}}}  # fmt: skip
        main._print_verdict(plan, report, False, RECALIBRATE)
        first = out.getvalue().splitlines()[0]
        assert expect in first and refuse not in first
        assert "recalibrate" not in first  # both cases: the run's speed, not the calibration, decides
    # the probe read the calibrated speed: no second line, and recalibrating is not the advice
    out = io.StringIO()
    monkeypatch.setattr(main, "console", Console(file=out, width=300))
    calm = {"node_overhead_s": 10e-6, "calibrated_node_overhead_s": 10e-6, "speed_ratio": 1.0}
    report = {"measured": {"latency_s": 0.0046, "at_run_speed": {**calm, "latency_s": 0.001}}}
    main._print_verdict(plan, report, False, RECALIBRATE)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "so the cost model is off" in lines[0] and "recalibrate" not in lines[0]
    assert "unless other processes took the cores" in lines[0]  # which the probe can miss
    # other processes shared the cores: the verdict says so, on both lines, instead of blaming the model
    busy = busy_during_run(2, load=3.5, cores=2)
    assert busy and "busy" in busy and "3.5 on 2 cores" in busy
    assert busy_during_run(2, load=2.4, cores=2) is None  # the run's own two ranks
    assert busy_during_run(2, load=3.0, cores=2) is not None  # and one busy process beside them
    monkeypatch.setattr(main, "busy_during_run", lambda ranks: busy)
    for at in (calm, at_run):
        out = io.StringIO()
        monkeypatch.setattr(main, "console", Console(file=out, width=300))
        report = {"measured": {"latency_s": 0.0046, "at_run_speed": {**at, "latency_s": 0.001}}}
        main._print_verdict(plan, report, False, RECALIBRATE)
        text = out.getvalue()
        assert "machine was busy" in text and "cost model" not in text
    # steps that spread wide (slow and fast spells the load average missed): said, the model not blamed
    monkeypatch.setattr(main, "busy_during_run", lambda ranks: None)
    out = io.StringIO()
    monkeypatch.setattr(main, "console", Console(file=out, width=300))
    report = {"measured": {"latency_s": 0.0046, "latency_p10_s": 0.0015, "latency_p90_s": 0.0064,
              "at_run_speed": {**calm, "latency_s": 0.001}}}  # fmt: skip
    main._print_verdict(plan, report, False, RECALIBRATE)
    text = out.getvalue()
    assert "spread 4.3x" in text and "cost model" not in text
    out = io.StringIO()  # faster than predicted: spells do not explain that
    monkeypatch.setattr(main, "console", Console(file=out, width=300))
    main._print_verdict(
        plan, {**report, "measured": {**report["measured"], "latency_s": 0.0004}}, False, RECALIBRATE
    )
    assert "spread" not in out.getvalue()
    # faster than predicted on a busy machine: other processes do not explain that
    monkeypatch.setattr(main, "busy_during_run", lambda ranks: busy)
    out = io.StringIO()
    monkeypatch.setattr(main, "console", Console(file=out, width=300))
    fast = {"measured": {"latency_s": 0.0001, "at_run_speed": {**calm, "latency_s": 0.001}}}
    main._print_verdict(plan, fast, False, RECALIBRATE)
    assert "busy" not in out.getvalue(), out.getvalue()
    # a GPU plan run on this CPU: the advice is to re-plan for this machine, whatever its load or spread
    # (it said "the machine was busy ... run again on a quiet machine" of a 44x ratio across hardware)
    monkeypatch.setattr(main, "busy_during_run", lambda ranks: busy)
    out = io.StringIO()
    monkeypatch.setattr(main, "console", Console(file=out, width=300))
    other = "the plan was priced for dgx-h100, not this machine: re-plan without --cluster to compare"
    main._print_verdict(plan, report, False, other, other_hardware=True)
    text = out.getvalue()
    assert "re-plan without --cluster" in text and "busy" not in text and "spread" not in text, text


def test_advice_for_a_calibrated_spec_given_with_cluster_names_its_file(tmp_path) -> None:
    """--recalibrate re-measures the cached spec only: a calibrate-written file given with --cluster
    is re-measured with `planner calibrate --out FILE`, and the advice says so."""
    import importlib

    from costmodels.cluster import CALIBRATED_SPEC_NAME, load_cluster
    from planner.cli import workflow
    from planner.cli.render import RECALIBRATE

    main = importlib.import_module("planner.cli.main")
    local = load_cluster("local-cpu", nproc=2)
    mine = str(tmp_path / "spec.yaml")
    advice = main._advice(mine, CALIBRATED_SPEC_NAME, local)
    assert f"planner calibrate --out {mine}" in advice and "--recalibrate" not in advice
    cached = str(workflow.CACHE_DIR / "local-nproc2.yaml")
    assert main._advice(cached, CALIBRATED_SPEC_NAME, local) == RECALIBRATE
    assert main._advice(None, CALIBRATED_SPEC_NAME, local) == RECALIBRATE


def test_the_verdict_band_is_the_printed_ratios() -> None:
    """1.1033 prints as 1.10, which the README puts in "within 10%" (0.91-1.10); it said 25%."""
    from planner.cli.render import agreement_line  # noqa: PLC0415

    assert agreement_line(1.0, 1.1033).endswith("= 1.10 (within 10%)")
    assert agreement_line(1.0, 1.106).endswith("= 1.11 (within 25%)")
    assert agreement_line(1.0, 0.905).endswith("= 0.91 (within 10%)")


def test_advice_after_planner_run_does_not_name_an_option_run_lacks() -> None:
    """`planner run` has no --cluster: a plan priced with a preset is advised to be re-planned with
    `planner optimize` (without --cluster), while `planner optimize --run` is told to omit --cluster."""
    import importlib

    from costmodels.cluster import load_cluster

    main = importlib.import_module("planner.cli.main")
    local = load_cluster("local-cpu", nproc=2)
    assert "omit --cluster" in main._advice("local-cpu", "local-cpu", local)
    saved = main._advice("local-cpu", "local-cpu", local, saved=True)
    assert "re-plan it with planner optimize without --cluster" in saved and "omit --cluster" not in saved


def test_a_backward_probe_that_read_nothing_is_no_reading(calibrated) -> None:
    """On a loaded machine the speed probe's backward slope read 0: the backward ratio was 0 and the
    speed line divided by it after a run that had passed (ZeroDivisionError, exit 1)."""
    structure = analysed_llama("tiny")
    plan = _plan(structure, calibrated, "train")
    base_s = calibrated.device.node_overhead_s
    at_run = machine.at_run_speed(plan, structure, calibrated, _run(1.0, 2 * base_s, backward_s=0.0))
    assert at_run["backward_ratio"] is None
    line = speed_line({**at_run, "backward_ratio": 0.0}, 1.0)
    assert line is not None and "backward" not in line

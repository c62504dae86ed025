"""A serving engine's host work per step (`device.serving_host`, `costmodels.cluster.ServingHostSpec`):
read from YAML with errors that name the field, and priced into every prefill and decode step of a
serving plan, never into training."""

from __future__ import annotations

import dataclasses

import pytest

from costmodels.cluster import (
    ServingHostSpec,
    SpecError,
    cluster_to_dict,
    load_cluster,
    parse_cluster,
)
from planner.solver.problem import Constraints, WorkloadSpec
from planner.solver.search import plan_model
from tests.planner_fixtures import analysed_llama

HOST = ServingHostSpec(step_s=1.2e-3, per_sequence_s=40e-6, per_worker_s=300e-6)


def _with_host(host: ServingHostSpec | None):
    h100 = load_cluster("dgx-h100")
    return dataclasses.replace(h100, device=dataclasses.replace(h100.device, serving_host=host))


def _latency_s(host: ServingHostSpec | None, kind: str, tp: int, batch: int) -> float:
    structure = analysed_llama("8b")
    if kind == "decode":
        work = WorkloadSpec("decode", batch, 1, context=1024, dtype="bf16")
    else:
        work = WorkloadSpec(kind, batch, 512, dtype="bf16")
    constraints = Constraints(tp=tp, pp=1, dp=1, max_devices=tp)
    return plan_model(structure, _with_host(host), work, constraints).predicted.latency_s


@pytest.mark.parametrize("tp, batch", [(1, 1), (1, 64), (4, 16)])
def test_decode_step_pays_the_engine_host_work(tp: int, batch: int) -> None:
    """A decode step (the same plan: the host work is the same for every layout of a TP degree) costs
    step + batch x per sequence + (TP - 1) x per worker more, exactly."""
    added = _latency_s(HOST, "decode", tp, batch) - _latency_s(None, "decode", tp, batch)
    expected = HOST.step_s + batch * HOST.per_sequence_s + (tp - 1) * HOST.per_worker_s
    assert added == pytest.approx(expected, rel=1e-6)


def test_prefill_pays_it_and_training_does_not() -> None:
    added = _latency_s(HOST, "forward", 2, 4) - _latency_s(None, "forward", 2, 4)
    assert added == pytest.approx(HOST.step_s + 4 * HOST.per_sequence_s + HOST.per_worker_s, rel=1e-6)
    assert _latency_s(HOST, "train", 2, 4) == _latency_s(None, "train", 2, 4)


def test_yaml_round_trip_and_errors_name_the_field() -> None:
    data = cluster_to_dict(_with_host(HOST))
    assert data["device"]["serving_host"] == {"step_us": 1200, "per_sequence_us": 40, "per_worker_us": 300}
    parsed = parse_cluster(data, "spec.yaml").device.serving_host
    assert parsed == ServingHostSpec(pytest.approx(1.2e-3), pytest.approx(40e-6), pytest.approx(300e-6))
    only_step = {**data, "device": {**data["device"], "serving_host": {"step_us": 500}}}
    assert parse_cluster(only_step, "spec.yaml").device.serving_host == ServingHostSpec(pytest.approx(5e-4))
    assert "serving_host" not in cluster_to_dict(load_cluster("dgx-h100"))["device"]
    for raw, message in (
        ({"per_sequence_us": 40}, r"device\.serving_host\.step_us: missing"),
        ({"step_us": -1}, r"device\.serving_host\.step_us: must be >= 0"),
        (
            {"step_us": 1000, "per_seq_us": 40},
            r"device\.serving_host\.per_seq_us: unknown key.*per_sequence_us",
        ),
        ({"step_us": "1 ms"}, r"device\.serving_host\.step_us: got the string"),
        (1000, r"device\.serving_host: expected a mapping"),
    ):
        bad = {**data, "device": {**data["device"], "serving_host": raw}}
        with pytest.raises(SpecError, match=message):
            parse_cluster(bad, "spec.yaml")


def test_the_plan_names_the_host_work_it_priced(tmp_path) -> None:
    """The prediction records the host work it holds (`Prediction.serving_host_s`, in compute), a saved
    plan keeps it, and `planner optimize` says it beside the compute it is part of."""
    import json  # noqa: PLC0415

    import yaml  # noqa: PLC0415

    from planner.cli.render import fmt_s  # noqa: PLC0415
    from planner.plan import Plan  # noqa: PLC0415
    from tests.cli_in_process import planner_in_process  # noqa: PLC0415

    structure = analysed_llama("8b")
    work = WorkloadSpec("decode", 16, 1, context=1024, dtype="bf16")
    plan = plan_model(structure, _with_host(HOST), work, Constraints(tp=2, pp=1, dp=1, max_devices=2))
    expected = HOST.step_s + 16 * HOST.per_sequence_s + HOST.per_worker_s
    assert plan.predicted.serving_host_s == pytest.approx(expected)
    assert plan.predicted.compute_s > plan.predicted.serving_host_s
    assert Plan.from_dict(plan.to_dict()).predicted.serving_host_s == pytest.approx(expected)
    assert (
        plan_model(
            structure, _with_host(None), work, Constraints(tp=2, pp=1, dp=1, max_devices=2)
        ).predicted.serving_host_s
        == 0
    )
    spec = tmp_path / "h100-engine.yaml"
    spec.write_text(yaml.safe_dump(cluster_to_dict(_with_host(HOST))))
    r = planner_in_process(
        "optimize", "examples/llama3_kv.py", "--cluster", str(spec), "--workload", "decode", "--context", "64",
        "--batch-size", "4", "--tp", "2", "--devices", "2", "--json", str(tmp_path / "r.json"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    said = " ".join(r.stdout.split())
    host_s = HOST.step_s + 4 * HOST.per_sequence_s + HOST.per_worker_s
    assert f"incl. the serving engine's host work {fmt_s(host_s)}" in said, said
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["predicted"]["serving_host_s"] == pytest.approx(host_s)

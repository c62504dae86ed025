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

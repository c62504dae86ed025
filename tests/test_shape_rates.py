"""A model's own matmul shapes timed on this CPU (`costmodels.calibrate.matmul_shape_time_ratios`):
the ratio of measured to priced time per (K, N), brought to the calibration's speed by the speed
probe's matmul, and applied by `costmodels.compute.op_time_s` to matmuls of that (K, N) only."""

from __future__ import annotations

import dataclasses
import math

import pytest

from costmodels import calibrate as cal
from costmodels.cluster import CALIBRATED_SPEC_NAME, load_cluster
from costmodels.compute import linear_bytes, linear_flops, op_time_s
from planner.cli import workflow
from planner.solver import machine
from planner.solver.costing import model_matmul_shapes
from tests.planner_fixtures import analysed_llama


@pytest.fixture
def calibrated():
    """local-cpu named as a calibrated spec, with a probe matmul reference of 100 GFLOP/s."""
    base = load_cluster("local-cpu", 2)
    device = dataclasses.replace(base.device, probe_matmul_flops_per_s=100e9)
    return dataclasses.replace(base, name=CALIBRATED_SPEC_NAME, device=device)


def _priced(shape, device) -> float:
    return op_time_s(linear_flops(*shape), linear_bytes(*shape, "fp32"), device, "fp32", "matmul", rows=shape[0], launch=False)  # fmt: skip


def _fake_rates(seconds_of):
    """interleaved_rates stand-in: each product takes ``seconds_of(shape)`` (the floor product 0 s)."""

    def fake(fns, amounts, device, budget_s):
        return [1e30] + [a / seconds_of(a) for a in amounts[1:]], 1.0

    return fake


def test_ratio_is_relative_to_the_fits_own_shapes_timed_beside_it(calibrated, monkeypatch) -> None:
    """The machine runs 2x slower than the fit on the fit's shapes, and a model shape 3x: its ratio is
    1.5 (the machine's speed at the moment cancels)."""
    shape = (64, 768, 3072)
    priced_s = _priced(shape, calibrated.device)
    references = {2.0 * math.prod(s): _priced(s, calibrated.device) for s in cal.TRANSFORMER_MATMUL_SHAPES}
    flops = 2.0 * math.prod(shape)

    def seconds_of(amount):
        return 3 * priced_s if amount == flops else 2 * references[amount]

    monkeypatch.setattr(cal, "interleaved_rates", _fake_rates(seconds_of))
    ratios = cal.matmul_shape_time_ratios([shape], calibrated.device, "fp32")
    assert ratios == {(768, 3072): pytest.approx(1.5)}


def test_training_ratio_sums_the_backward_products(calibrated, monkeypatch) -> None:
    """train: the input-gradient (M x N) @ (N x K) and weight-gradient (N x M) @ (M x K) products are
    timed too; the ratio is the three products' time over three forward prices (reference shapes at
    the fit's speed)."""
    shape = (64, 768, 3072)
    priced_s = _priced(shape, calibrated.device)
    references = {2.0 * math.prod(s): _priced(s, calibrated.device) for s in cal.TRANSFORMER_MATMUL_SHAPES}
    count = sum(
        1 for s in cal.TRANSFORMER_MATMUL_SHAPES if _priced(s, calibrated.device) <= cal._MODEL_SHAPE_MAX_S
    )

    def fake(fns, amounts, device, budget_s):
        model = amounts[1 + count :]  # the floor, the references, then the three products
        assert len(model) == 3
        calls = iter([priced_s, 2 * priced_s, 3 * priced_s])
        return [1e30] + [a / references[a] for a in amounts[1 : 1 + count]] + [
            a / next(calls) for a in model
        ], 1.0

    monkeypatch.setattr(cal, "interleaved_rates", fake)
    ratios = cal.matmul_shape_time_ratios([shape], calibrated.device, "fp32", train=True)
    assert ratios == {(768, 3072): pytest.approx((1 + 2 + 3) / 3)}


def test_a_shape_priced_too_long_is_timed_with_fewer_rows(calibrated, monkeypatch) -> None:
    big = (4096, 768, 50257)
    assert _priced(big, calibrated.device) > cal._MODEL_SHAPE_MAX_S
    seen = []

    def fake(fns, amounts, device, budget_s):
        seen.extend(amounts)
        return [1e30] + [1e11] * (len(fns) - 1), 1.0

    monkeypatch.setattr(cal, "interleaved_rates", fake)
    ratios = cal.matmul_shape_time_ratios([big], calibrated.device, "fp32")
    assert set(ratios) == {(768, 50257)}
    assert max(seen) < 2.0 * math.prod(big)


def test_shapes_outside_the_timed_range_keep_the_fit(calibrated) -> None:
    """A product priced under the dispatch-sized minimum is not timed."""
    tiny = (1, 8, 16)
    assert _priced(tiny, calibrated.device) < cal._MODEL_SHAPE_MIN_S
    assert cal.matmul_shape_time_ratios([tiny], calibrated.device, "fp32") == {}


def test_real_timing_returns_a_positive_ratio_per_shape(calibrated) -> None:
    """Timed for real (0.2 s): every kept shape gets a finite positive ratio, keyed by (K, N)."""
    shapes = [(64, 256, 1024), (64, 1024, 256)]
    ratios = cal.matmul_shape_time_ratios(shapes, calibrated.device, "fp32", budget_s=0.2)
    assert set(ratios) == {(256, 1024), (1024, 256)}
    assert all(0 < r < 100 for r in ratios.values())


def test_op_time_scales_only_matmuls_of_a_measured_shape(calibrated) -> None:
    device = dataclasses.replace(calibrated.device, matmul_shape_time_ratios={(768, 3072): 0.5})
    flops, moved = linear_flops(64, 768, 3072), linear_bytes(64, 768, 3072, "fp32")
    plain = op_time_s(flops, moved, calibrated.device, "fp32", "matmul", rows=64, launch=False)
    assert op_time_s(flops, moved, device, "fp32", "matmul", rows=64, launch=False, shape=(768, 3072)) == pytest.approx(plain / 2)  # fmt: skip
    assert (
        op_time_s(flops, moved, device, "fp32", "matmul", rows=64, launch=False, shape=(3072, 768)) == plain
    )
    assert op_time_s(flops, moved, device, "fp32", "matmul", rows=64, launch=False) == plain
    launch = calibrated.device.launch_overhead_s
    with_launch = op_time_s(flops, moved, device, "fp32", "matmul", rows=64, shape=(768.0, 3072.0))
    assert with_launch == pytest.approx(plain / 2 + launch)  # the launch term is not scaled
    memory = op_time_s(1e6, 1e6, device, "fp32", "memory", launch=False, shape=(768, 3072))
    assert memory == op_time_s(1e6, 1e6, calibrated.device, "fp32", "memory", launch=False)


def test_model_shapes_cover_every_split_the_planner_prices() -> None:
    structure = analysed_llama("tiny")
    shapes = model_matmul_shapes(structure, 32, [1, 2])
    head = structure.lm_head
    assert (32, head.in_features, head.out_features) in shapes
    assert (32, head.in_features, -(-head.out_features // 2)) in shapes
    for layer in structure.layers:
        for p in layer.attention.projections + layer.mlp.projections:
            assert (32, p.in_features, p.out_features) in shapes
            if p.out_features % 2 == 0:
                assert (32, p.in_features, p.out_features // 2) in shapes
            if p.in_features % 2 == 0:
                assert (32, p.in_features // 2, p.out_features) in shapes
    assert len(shapes) == len(set(shapes))


def test_planning_times_shapes_on_a_calibrated_spec_only(calibrated, monkeypatch) -> None:
    """A calibrated local spec gets the model's ratios (timed once per process); a preset does not."""
    calls = []

    def fake(shapes, device, dtype, threads=1, budget_s=1.0, train=False):
        calls.append(shapes)
        return {(k, n): 0.5 for _, k, n in shapes}

    monkeypatch.setattr(cal, "matmul_shape_time_ratios", fake)
    monkeypatch.setattr(machine, "_SHAPE_RATIOS", {})
    prepared = workflow.prepare("examples/mlp.py", "forward", batch_size=64)
    timed = workflow.priced_cluster(prepared, calibrated)
    assert timed.device.matmul_shape_time_ratios == {(k, n): 0.5 for _, k, n in calls[0]}
    assert (64, 64, 256) in calls[0]  # the first Linear(64, 256) at 64 rows
    workflow.priced_cluster(prepared, calibrated)
    assert len(calls) == 1  # cached for the process
    preset = load_cluster("local-cpu", 2)
    assert workflow.priced_cluster(prepared, preset) is preset
    plain = workflow.make_plan(
        prepared, preset, workflow.constraints_from(1, 1, 1, "none"), "examples/mlp.py"
    )
    halved = workflow.make_plan(
        prepared, calibrated, workflow.constraints_from(1, 1, 1, "none"), "examples/mlp.py"
    )
    assert halved.predicted.latency_s < plain.predicted.latency_s


def test_a_16_bit_plans_shapes_are_timed_against_the_fp32_fit(calibrated, monkeypatch) -> None:
    """The fit's own shapes, whose time over their price is the machine's speed of the moment, run in
    fp32 (the dtype a CPU spec's fit is made on) whatever the plan's dtype; the model's products run in
    the plan's. fp16 on the dev VM: its peak fitted on the few shapes fast enough to time; timed in
    fp16 the references cancelled that fit's error and the tiny Llama's products were priced 2x slow
    (measured / predicted 0.54 for an fp16 forward, 1.07 after)."""
    import torch  # noqa: PLC0415

    shape = (64, 256, 1024)  # priced within the timed range in fp16 too
    fp16_priced = op_time_s(linear_flops(*shape), linear_bytes(*shape, "fp16"), calibrated.device, "fp16", "matmul", rows=64, launch=False)  # fmt: skip
    references = {2.0 * math.prod(s): _priced(s, calibrated.device) for s in cal.TRANSFORMER_MATMUL_SHAPES}
    flops = 2.0 * math.prod(shape)
    dtypes = []

    def product(form, m, k, n, dt):
        dtypes.append(((m, k, n), dt))
        return lambda: None

    def seconds_of(amount):  # the fp32 references at the fit's speed; the product at half its fp16 price
        return 0.5 * fp16_priced if amount == flops else references[amount]

    monkeypatch.setattr(cal, "_product", product)
    monkeypatch.setattr(cal, "interleaved_rates", _fake_rates(seconds_of))
    assert cal.matmul_shape_time_ratios([shape], calibrated.device, "fp16") == {
        (256, 1024): pytest.approx(0.5)
    }
    kept = [
        s for s in cal.TRANSFORMER_MATMUL_SHAPES if _priced(s, calibrated.device) <= cal._MODEL_SHAPE_MAX_S
    ]
    assert [dt for s, dt in dtypes if s in kept] == [torch.float32] * len(kept)
    assert dict(dtypes)[shape] is torch.float16

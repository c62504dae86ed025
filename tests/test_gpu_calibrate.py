"""planner calibrate on CUDA (costmodels.gpu_calibrate): the fits recover known parameters from
synthetic measurements, the nccl-tests conversion, and the measurement code driven on CPU tensors
with a wall / scripted timer. The CUDA-event path itself needs a GPU (skipped without one)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.distributed as dist

from costmodels.cluster import DecodeAttentionSpec, GemmSpec, LinkSpec, load_cluster, parse_cluster
from costmodels.comm import Group
from costmodels.compute import attention_flops, decode_attention_time_s, gemm_efficiency
from costmodels.gpu_calibrate import (
    COLLECTIVE_SIZES_BYTES,
    GEMM_SWEEP_SHAPES,
    HOPPER_TILES,
    AttentionPoint,
    CollectivePoint,
    CudaEventTimer,
    DecodePoint,
    GemmPoint,
    WallTimer,
    apply_cuda_measurements,
    collective_elements,
    cuda_measurements,
    event_median_s,
    fit_attention,
    fit_decode_attention,
    fit_gemm,
    fit_link,
    nccl_tests_bandwidths,
    priced_collective_s,
    time_attention,
    time_collectives,
    time_decode_attention,
    time_gemms,
)

PEAK = 989e12
LAUNCH_S = 4e-6  # the synthetic calibration's launch overhead (each measured GEMM's time includes it)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA events)")


def _noise(rng: random.Random, level: float) -> float:
    return 1.0 + rng.uniform(-level, level)


@pytest.mark.parametrize(("efficiency", "half_k"), [(0.84, 260.0), (0.7, 600.0), (0.95, 64.0)])
def test_fit_gemm_recovers_efficiency_and_half_k_from_noisy_times(efficiency: float, half_k: float) -> None:
    rng = random.Random(0)
    truth = GemmSpec(efficiency, half_k, 132, HOPPER_TILES, 256.0)
    points = [
        GemmPoint(m, n, k, 2.0 * m * n * k / (PEAK * gemm_efficiency(m, n, k, truth)) * _noise(rng, 0.03))
        for m, n, k in GEMM_SWEEP_SHAPES
    ]
    fit = fit_gemm(points, PEAK, sms=132)
    assert fit.spec.efficiency == pytest.approx(efficiency, rel=0.03)
    assert fit.spec.half_k == pytest.approx(half_k, rel=0.2, abs=20)
    assert fit.max_error < 0.06 and fit.used == len(points) and fit.excluded == 0
    assert (fit.spec.sms, fit.spec.tiles) == (132, HOPPER_TILES)


def test_fit_gemm_prices_each_gemm_with_the_launch_so_small_ones_do_not_pull_the_efficiency_down() -> None:
    # back-to-back small GEMMs run at the host's dispatch rate: on an H200 (2026-12-04) 512^3 and
    # 1024^3 bf16 both took ~19 us with a 10.7 us launch, and the fit without the launch read an
    # efficiency capped at 1 and half_k 197 (rms 31%, large shapes priced 5-20% slow)
    launch_s = 12e-6
    truth = GemmSpec(0.84, 260.0, 132, HOPPER_TILES, 256.0)
    shapes = [*GEMM_SWEEP_SHAPES, (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048)]
    points = [
        GemmPoint(m, n, k, 2.0 * m * n * k / (PEAK * gemm_efficiency(m, n, k, truth)) + launch_s)
        for m, n, k in shapes
    ]
    fit = fit_gemm(points, PEAK, sms=132, launch_s=launch_s)
    assert fit.spec.efficiency == pytest.approx(0.84, rel=0.01)
    assert fit.spec.half_k == pytest.approx(260.0, rel=0.05)
    assert fit.max_error < 0.01
    blind = fit_gemm(points, PEAK, sms=132)  # the launch folded into the kernel's rate
    assert blind.max_error > 0.2 and abs(blind.spec.half_k / 260.0 - 1) > 0.2
    # a point under three launches is the host's time, not the kernel's: left out
    tiny = GemmPoint(64, 64, 64, 2.9 * launch_s)
    assert fit_gemm([*points, tiny], PEAK, sms=132, launch_s=launch_s).excluded == fit.excluded + 1


def test_fit_gemm_uncapped_lets_the_peak_rise_above_the_fastest_point() -> None:
    truth = GemmSpec(1.0, 100.0, 132, HOPPER_TILES, 256.0)
    points = [
        GemmPoint(m, n, k, 2.0 * m * n * k / (PEAK * gemm_efficiency(m, n, k, truth)))
        for m, n, k in GEMM_SWEEP_SHAPES
    ]
    fastest = max(p.flops / p.time_s for p in points)
    assert fastest < PEAK  # no measured GEMM fills every wave at unbounded K
    fit = fit_gemm(points, fastest, sms=132, max_efficiency=None)
    assert fit.spec.efficiency * fastest == pytest.approx(PEAK, rel=0.01) and fit.max_error < 0.01
    assert fit_gemm(points, fastest, sms=132).spec.efficiency == 1.0


def test_fit_gemm_caps_efficiency_at_one_and_leaves_memory_bound_points_out() -> None:
    truth = GemmSpec(1.0, 100.0, 132, HOPPER_TILES, 256.0)
    points = [
        GemmPoint(m, n, k, 2.0 * m * n * k / (PEAK * gemm_efficiency(m, n, k, truth)) / 1.1)
        for m, n, k in GEMM_SWEEP_SHAPES
    ]  # 10% faster than the peak given: the efficiency stays at 1
    gemv = GemmPoint(1, 8192, 8192, 8192 * 8192 * 2 / 4.8e12)  # a decode GEMV, memory-bound
    fit = fit_gemm([*points, gemv], PEAK, sms=132, memory_bytes_per_s=4.8e12)
    without = fit_gemm(points, PEAK, sms=132, memory_bytes_per_s=4.8e12)
    assert fit.spec.efficiency == 1.0 and fit.excluded == without.excluded + 1
    assert fit_gemm(points, PEAK, sms=132).excluded == 0  # no bandwidth given: every point fitted
    with pytest.raises(ValueError, match="compute-bound"):
        fit_gemm([gemv], PEAK, sms=132, memory_bytes_per_s=4.8e12)


def _attention_points(
    eff: float, half: float, causal_half: float, factor: float, noise: float, dropout: float | None = None
) -> list:
    """Measured points of a kernel with these `AttentionSpec` parameters, each time x a random factor
    within ``noise``; ``dropout``: also the causal backward with dropout (forward + backward that many
    times the same without)."""
    rng = random.Random(1)
    points = []
    for length in (512, 1024, 2048, 4096, 8192):
        batch = max(1, 32768 // length)
        for causal in (True, False):
            flops = attention_flops(batch, 32, length, length, 128, causal=causal)
            h = causal_half if causal else half
            t = flops / (PEAK * eff * length / (length + h)) * _noise(rng, noise)
            points.append(AttentionPoint(length, causal, False, flops, t))
            if causal:
                backward = t * factor * _noise(rng, noise)
                points.append(AttentionPoint(length, True, True, flops, backward))
                if dropout is not None:
                    dropped = (t + backward) * dropout * _noise(rng, noise) - t
                    points.append(AttentionPoint(length, True, True, flops, dropped, dropout=True))
    return points


def test_fit_attention_recovers_the_preset_parameters() -> None:
    fit = fit_attention(_attention_points(0.676, 215.0, 600.0, 2.97, 0.02, dropout=1.03), PEAK)
    assert fit.spec.efficiency == pytest.approx(0.676, rel=0.04)
    assert fit.spec.half_seq == pytest.approx(215.0, rel=0.25, abs=20)
    assert fit.spec.causal_half_seq == pytest.approx(600.0, rel=0.1)
    assert fit.spec.backward_time_factor == pytest.approx(2.97, rel=0.03)
    assert fit.spec.dropout_time_factor == pytest.approx(1.03, rel=0.02)
    assert fit.measured_unmasked and fit.max_error < 0.05
    # no dropout timed: not priced; dropout measured faster than without (noise): no discount either
    assert (
        fit_attention(_attention_points(0.6, 300.0, 1500.0, 2.8, 0.0), PEAK).spec.dropout_time_factor == 1.0
    )
    faster = fit_attention(_attention_points(0.6, 300.0, 1500.0, 2.8, 0.0, dropout=0.97), PEAK)
    assert faster.spec.dropout_time_factor == 1.0
    exact = fit_attention(_attention_points(0.6, 300.0, 1500.0, 2.8, 0.0), PEAK)
    assert (exact.spec.efficiency, exact.spec.half_seq, exact.spec.causal_half_seq) == pytest.approx(
        (0.6, 300.0, 1500.0), rel=1e-6
    )


def test_fit_attention_with_causal_points_only_takes_the_presets_ratio() -> None:
    points = [p for p in _attention_points(0.6, 300.0, 1500.0, 2.8, 0.0) if p.causal]
    fit = fit_attention(points, PEAK)
    assert fit.spec.causal_half_seq == pytest.approx(1500.0, rel=1e-6)
    assert fit.spec.half_seq == pytest.approx(1500.0 / 5.6) and not fit.measured_unmasked
    with pytest.raises(ValueError, match="causal"):
        fit_attention([p for p in points if p.backward], PEAK)


def test_nccl_tests_bandwidth_convention() -> None:
    # nccl-tests doc/PERFORMANCE.md: 8 ranks, all-reduce busbw = algbw x 2 x 7 / 8
    assert nccl_tests_bandwidths("all_reduce", 1e9, 0.01, 8) == pytest.approx((1e11, 1.75e11))
    assert nccl_tests_bandwidths("all_gather", 1e9, 0.01, 8) == pytest.approx((1e11, 0.875e11))
    assert nccl_tests_bandwidths("reduce_scatter", 1e9, 0.01, 4) == pytest.approx((1e11, 0.75e11))
    assert nccl_tests_bandwidths("all_reduce", 8, 1e-5, 1)[1] == 0.0
    with pytest.raises(ValueError):
        nccl_tests_bandwidths("gather", 8, 1e-5, 2)
    assert CollectivePoint("all_reduce", 10**9, 8, 0.01).busbw == pytest.approx(1.75e11)
    assert collective_elements(8, 8) == 8 and collective_elements(2**30, 8) * 4 == 2**30


def _curve(cluster, group: Group, noise: float, seed: int = 2) -> list[CollectivePoint]:
    rng = random.Random(seed)
    pts = []
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        for nbytes in COLLECTIVE_SIZES_BYTES:
            nbytes = collective_elements(nbytes, group.size) * 4
            p = CollectivePoint(kind, nbytes, group.size, 1.0)
            pts.append(
                dataclasses.replace(p, time_s=priced_collective_s(p, group, cluster) * _noise(rng, noise))
            )
    return pts


@pytest.mark.parametrize(("n", "nvls"), [(2, False), (4, False), (8, True), (8, False)])
def test_fit_link_recovers_latency_and_bandwidth_from_a_noisy_nccl_curve(n: int, nvls: bool) -> None:
    base = load_cluster("dgx-h100")
    base = dataclasses.replace(base, devices_per_node=n)
    truth = dataclasses.replace(
        base,
        intra_node=dataclasses.replace(
            base.intra_node, latency_s=4.0e-6, bandwidth_bytes_per_s=350e9, nvls=nvls
        ),
    )
    group = Group(n, n)
    points = _curve(truth, group, 0.03)
    start = dataclasses.replace(
        base, intra_node=dataclasses.replace(base.intra_node, latency_s=1e-5, bandwidth_bytes_per_s=1e11)
    )
    fit = fit_link(points, start, group, nvls_choices=(False, True))
    assert fit.bandwidth_bytes_per_s == pytest.approx(350e9, rel=0.05)
    assert fit.latency_s == pytest.approx(4.0e-6, rel=0.15)
    assert fit.within_tolerance and fit.busbw_error < 0.06 and fit.small_time_error < 0.08
    if n == 8:  # NVLS changes the all-reduce curve with 8 ranks: the fit tells which it was
        assert fit.nvls is nvls
    assert "within tolerance" in fit.source(group)


def test_fit_link_says_when_the_model_cannot_reproduce_the_curve() -> None:
    base = dataclasses.replace(load_cluster("dgx-h100"), devices_per_node=4)
    group = Group(4, 4)
    points = _curve(base, group, 0.0)
    # a curve whose small messages are 3x slower for all-gather only: no one latency fits every kind
    bent = [
        dataclasses.replace(p, time_s=p.time_s * 3.0) if p.kind == "all_gather" and p.nbytes <= 4096 else p
        for p in points
    ]
    fit = fit_link(bent, base, group)
    assert not fit.within_tolerance and "OUTSIDE tolerance" in fit.source(group)
    with pytest.raises(ValueError, match="two sizes"):
        fit_link(points[:1], base, group)


def test_fit_link_across_nodes_fits_the_inter_node_link() -> None:
    truth = load_cluster("h100-ib-2node")
    truth = dataclasses.replace(
        truth, inter_node=LinkSpec("infiniband", 25e9, 7e-6, nics_per_node=truth.inter_node.nics_per_node)
    )
    group = Group(16, 8)
    points = _curve(truth, group, 0.02)
    start = dataclasses.replace(
        truth, inter_node=dataclasses.replace(truth.inter_node, latency_s=2e-5, bandwidth_bytes_per_s=1e10)
    )
    fit = fit_link(points, start, group, link="inter_node")
    assert fit.bandwidth_bytes_per_s == pytest.approx(25e9, rel=0.06)
    assert fit.latency_s == pytest.approx(7e-6, rel=0.25)
    assert fit.within_tolerance


class ScriptedTimer:
    """A fake device timeline: ``fn`` advances it by the seconds the test scripts."""

    def __init__(self) -> None:
        self.now = 0.0

    def mark(self) -> float:
        return self.now

    def seconds(self, start: object, end: object) -> float:
        return float(end) - float(start)


def test_event_median_skips_warm_up_and_takes_the_median_window() -> None:
    timer = ScriptedTimer()
    durations = iter([1.0, 1.0, 1.0, 3e-3, 3e-3, 9e-3, 2e-3, 3e-3])  # 3 warm-up calls, then 5 windows

    def fn() -> None:
        timer.now += next(durations)

    assert event_median_s(fn, timer, warmup=3, reps=5, inner=1) == pytest.approx(3e-3)
    calls = []
    timer2 = ScriptedTimer()

    def fast() -> None:
        calls.append(1)
        timer2.now += 1e-5

    # inner None: one sizing call, then windows of ~1 ms of calls (100 each)
    assert event_median_s(fast, timer2, warmup=0, reps=2) == pytest.approx(1e-5)
    assert len(calls) == 1 + 2 * 100


def test_the_cuda_measurements_run_on_cpu_tensors_with_a_wall_timer() -> None:
    cpu = torch.device("cpu")
    gemms = time_gemms([(16, 32, 64), (8, 8, 8)], cpu, WallTimer(), torch.float32, warmup=1, reps=3)
    assert [(p.m, p.n, p.k) for p in gemms] == [(16, 32, 64), (8, 8, 8)] and all(p.time_s > 0 for p in gemms)
    attention = time_attention(
        [16, 32], cpu, WallTimer(), torch.float32, heads=2, head_dim=8, tokens=64, warmup=1, reps=2
    )
    assert len(attention) == 8 and {(p.causal, p.backward, p.dropout) for p in attention} == {
        (True, False, False),
        (False, False, False),
        (True, True, False),
        (True, True, True),
    }
    assert attention[0].flops == attention_flops(4, 2, 16, 16, 8, causal=True)
    fit = fit_attention(attention, peak_flops_per_s=1e12)
    assert 0 < fit.spec.efficiency <= 1


def test_the_collective_timing_runs_on_a_one_rank_gloo_group() -> None:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        points = time_collectives(
            [8, 4096], torch.device("cpu"), WallTimer(), kinds=("all_reduce", "all_gather"), warmup=1, reps=3
        )
    finally:
        dist.destroy_process_group()
    assert [(p.kind, p.nbytes, p.ranks) for p in points] == [
        ("all_reduce", 8, 1),
        ("all_reduce", 4096, 1),
        ("all_gather", 8, 1),
        ("all_gather", 4096, 1),
    ]
    assert all(p.time_s > 0 for p in points)


@needs_gpu
def test_cuda_events_time_a_gemm_near_its_flop_count() -> None:
    timer = CudaEventTimer()
    (point,) = time_gemms([(4096, 4096, 4096)], torch.device("cuda"), timer)
    rate = point.flops / point.time_s
    assert 1e12 < rate < 5e15  # between a slow GPU and any datasheet


def _calibrated_mapping(devices: int) -> dict:
    """The mapping `calibrate` builds before the CUDA fields: measured peaks, a half-rows term and
    the one-process placeholder link (gloo-style figures)."""
    return {
        "name": "local-calibrated",
        "nodes": 1,
        "devices_per_node": devices,
        "backend": "nccl",
        "overlap_efficiency": 0.8,
        "sources": ["measured by planner calibrate on a test"],
        "device": {
            "name": "NVIDIA H100 80GB HBM3",
            "memory_GiB": 79.2,
            "peak_TFLOPS": {"bf16": 400.0, "fp16": 400.0, "fp32": 40.0},
            "memory_bandwidth_GBps": 3000.0,
            "matmul_efficiency": 1.0,
            "memory_efficiency": 1.0,
            "launch_overhead_us": LAUNCH_S * 1e6,
            "matmul_half_rows": 30.0,
        },
        "links": {"intra_node": {"kind": "loopback", "bandwidth_GBps": 2.0, "latency_us": 80.0}},
    }


def _synthetic_cuda(truth, group: Group) -> dict:
    gemm_truth = GemmSpec(0.84, 260.0, 132, HOPPER_TILES, 256.0)
    gemm = [
        (m, n, k, 2.0 * m * n * k / (PEAK * gemm_efficiency(m, n, k, gemm_truth)) + LAUNCH_S)
        for m, n, k in GEMM_SWEEP_SHAPES
    ]
    attention = [dataclasses.astuple(p) for p in _attention_points(0.676, 215.0, 1200.0, 3.1, 0.0, 1.05)]
    curve = _curve(truth, group, 0.02)
    squares = {"bf16": 700e12, "fp16": 700e12, "fp32": 50e12}
    return {
        "gemm": gemm,
        "attention": attention,
        "sms": 132,
        "cc": [9, 0],
        "collectives": curve,
        "squares": squares,
    }


def test_apply_cuda_measurements_writes_gemm_attention_and_the_nccl_link() -> None:
    base = dataclasses.replace(load_cluster("dgx-h100"), devices_per_node=8)
    truth = dataclasses.replace(
        base,
        intra_node=dataclasses.replace(
            base.intra_node, latency_s=5e-6, bandwidth_bytes_per_s=360e9, nvls=True
        ),
    )
    cuda = _synthetic_cuda(truth, Group(8, 8))
    cuda["collectives"] = {"intra_node": [dataclasses.astuple(p) for p in cuda["collectives"]]}
    data = apply_cuda_measurements(_calibrated_mapping(8), cuda)
    spec = parse_cluster(data, "test")
    dev = spec.device
    assert dev.matmul_half_rows is None and dev.gemm is not None and dev.attention is not None
    for m, n, k, seconds in cuda["gemm"]:  # the spec prices every measured GEMM within 2%, launch included
        rate = gemm_efficiency(m, n, k, dev.gemm) * dev.peak_flops_per_s["bf16"]
        assert (2.0 * m * n * k / rate + dev.launch_overhead_s) / seconds == pytest.approx(1.0, abs=0.02)
    # the truth's rate of full tiles and waves at unbounded K, above every measured GEMM's
    assert dev.gemm.efficiency * dev.peak_flops_per_s["bf16"] == pytest.approx(0.84 * PEAK, rel=0.02)
    assert dev.peak_flops_per_s["fp32"] == pytest.approx(dev.peak_flops_per_s["bf16"] / 14, rel=1e-3)
    assert dev.attention.causal_half_seq == pytest.approx(1200.0, rel=0.1)
    assert dev.attention.dropout_time_factor == pytest.approx(1.05, rel=1e-3)
    assert spec.intra_node.kind == "nvlink" and spec.intra_node.nvls
    assert spec.intra_node.bandwidth_bytes_per_s == pytest.approx(360e9, rel=0.05)
    assert spec.intra_node.latency_s == pytest.approx(5e-6, rel=0.2)
    text = "\n".join(spec.sources)
    assert "within tolerance" in text and "busbw" in text and "device.gemm fitted" in text
    assert _calibrated_mapping(8)["device"]["matmul_half_rows"] == 30.0  # the input is left as it was


def test_apply_cuda_measurements_across_nodes_fits_the_inter_node_link() -> None:
    truth = load_cluster("h100-ib-2node")
    truth = dataclasses.replace(
        truth,
        intra_node=dataclasses.replace(truth.intra_node, latency_s=5e-6, bandwidth_bytes_per_s=360e9),
        inter_node=dataclasses.replace(truth.inter_node, latency_s=8e-6, bandwidth_bytes_per_s=22e9),
    )
    intra = _curve(dataclasses.replace(truth, num_nodes=1), Group(8, 8), 0.02)
    world = _curve(truth, Group(16, 8), 0.02, seed=3)
    cuda = _synthetic_cuda(truth, Group(8, 8))
    cuda["collectives"] = {
        "intra_node": [dataclasses.astuple(p) for p in intra],
        "inter_node": [dataclasses.astuple(p) for p in world],
    }
    data = apply_cuda_measurements(
        _calibrated_mapping(8), cuda, nodes=2, nics_per_node=truth.inter_node.nics_per_node
    )
    spec = parse_cluster(data, "test")
    assert spec.num_nodes == 2 and spec.inter_node is not None
    assert spec.inter_node.bandwidth_bytes_per_s == pytest.approx(22e9, rel=0.08)
    assert spec.inter_node.nics_per_node == truth.inter_node.nics_per_node
    assert sum("within tolerance" in s for s in spec.sources) == 2


def test_cuda_measurements_run_on_cpu_on_one_rank_and_write_a_spec() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cuda = cuda_measurements(
            torch.device("cpu"),
            WallTimer(),
            gemm_shapes=[(32, 32, 32)],
            gemm_sweep=[(64, 64, 64), (32, 32, 32)],
            attention_lengths=(16, 32),
            dtype=torch.float32,
            attention_kwargs={"heads": 2, "head_dim": 8, "tokens": 64, "warmup": 1, "reps": 2},
            decode_kwargs={"heads": 4, "kv_heads": 2, "kv_len": 64, "head_dim": 8, "warmup": 1, "reps": 2},
        )
    finally:
        dist.destroy_process_group()
    assert [tuple(p[:3]) for p in cuda["gemm"]] == [(64, 64, 64), (32, 32, 32)]  # the model's shape once
    assert [p[:3] for p in cuda["collectives"]["intra_node"]] == [("all_reduce", 8, 1)]
    mapping = _calibrated_mapping(1)
    assert set(cuda["squares"]) == {"bf16", "fp16", "fp32"}
    spec = parse_cluster(apply_cuda_measurements(mapping, cuda), "test")
    assert spec.device.gemm is not None and spec.device.attention is not None
    assert any("world size 1" in s and "no link measured" in s for s in spec.sources)
    assert cuda["decode_attention"][:6] == (1, 4, 2, 64, 8, 4) and cuda["decode_attention"][6] > 0
    assert any(s.startswith("decode attention (scaled_dot_product_attention, batch 1") for s in spec.sources)


def test_calibrate_model_option_times_the_models_own_gemm_shapes() -> None:
    from planner.cli import workflow  # noqa: PLC0415
    from planner.solver.costing import model_matmul_shapes  # noqa: PLC0415
    from planner.solver.machine import calibration_gemm_shapes  # noqa: PLC0415

    forward = workflow.prepare("examples/llama3.py")
    tokens = forward.workload.batch_size * forward.workload.tokens_per_sequence
    assert calibration_gemm_shapes(forward, 2) == tuple(
        (m, n, k) for m, k, n in model_matmul_shapes(forward.structure, tokens, [1, 2])
    )
    train = calibration_gemm_shapes(workflow.prepare("examples/llama3.py", workload="train"), 1)
    assert (tokens, 128, 128) in train and (128, 128, tokens) in train  # forward and weight gradient


def _decode_point(share: float, sms: int = 132, bandwidth: float = 3000e9) -> DecodePoint:
    """A batch-1 decode point timed as a kernel of one block per query head at `share` would run."""
    spec = dataclasses.replace(
        load_cluster("dgx-h100").device,
        memory_bandwidth_bytes_per_s=bandwidth,
        memory_efficiency=1.0,
        decode_attention=DecodeAttentionSpec(sms, share),
    )
    seconds = decode_attention_time_s(1, 8, 16384, 128, "bf16", spec)
    return DecodePoint(1, 8, 2, 16384, 128, 2, seconds)


def test_fit_decode_attention_recovers_the_block_share() -> None:
    """A per-head kernel's point gives back its share; a kernel near the bandwidth (one that splits the
    cache) gives no decode_attention."""
    spec, over = fit_decode_attention(_decode_point(1.3), 132, 3000e9)
    assert spec == DecodeAttentionSpec(132, pytest.approx(1.3))
    assert over > 10  # 8 blocks of 132 SMs, each reading a whole head: far from the bandwidth
    cache = 2 * 2 * 16384 * 128 * 2
    split = DecodePoint(1, 8, 2, 16384, 128, 2, 1.2 * cache / 3000e9)
    assert fit_decode_attention(split, 132, 3000e9) == (None, pytest.approx(1.2))


def test_apply_cuda_measurements_writes_decode_attention_only_for_a_per_head_kernel() -> None:
    base = dataclasses.replace(load_cluster("dgx-h100"), devices_per_node=8)
    cuda = _synthetic_cuda(base, Group(8, 8))
    cuda["collectives"] = {"intra_node": [dataclasses.astuple(p) for p in cuda["collectives"]]}
    cuda["decode_attention"] = dataclasses.astuple(_decode_point(0.9))
    spec = parse_cluster(apply_cuda_measurements(_calibrated_mapping(8), cuda), "test")
    assert spec.device.decode_attention == DecodeAttentionSpec(132, pytest.approx(0.9, rel=1e-3))
    cache = 2 * 2 * 16384 * 128 * 2
    cuda["decode_attention"] = dataclasses.astuple(DecodePoint(1, 8, 2, 16384, 128, 2, cache / 3000e9))
    spec = parse_cluster(apply_cuda_measurements(_calibrated_mapping(8), cuda), "test")
    assert spec.device.decode_attention is None
    assert any("a kernel that splits the cache" in s for s in spec.sources)
    del cuda["decode_attention"]  # measurements of an earlier version: nothing written
    assert (
        parse_cluster(apply_cuda_measurements(_calibrated_mapping(8), cuda), "test").device.decode_attention
        is None
    )


def test_time_decode_attention_on_cpu() -> None:
    point = time_decode_attention(
        torch.device("cpu"),
        WallTimer(),
        torch.float32,
        heads=4,
        kv_heads=2,
        kv_len=32,
        head_dim=8,
        warmup=1,
        reps=2,
    )
    assert (point.sequences, point.heads, point.kv_heads, point.kv_len, point.element_bytes) == (
        1,
        4,
        2,
        32,
        4,
    )
    assert point.time_s > 0

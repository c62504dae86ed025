"""Roofline op time and FLOP / byte formulas against hand-derived values."""

from __future__ import annotations

import dataclasses

import pytest

from costmodels import compute
from costmodels.cluster import DeviceSpec

# A round-number device: 100 TFLOP/s bf16 at 50%, 10 TFLOP/s fp32, 1 TB/s at 50%, 5 us launch.
DEVICE = DeviceSpec(
    name="toy",
    memory_bytes=80e9,
    peak_flops_per_s={"bf16": 100e12, "fp16": 100e12, "fp32": 10e12},
    memory_bandwidth_bytes_per_s=1e12,
    matmul_efficiency=0.5,
    memory_efficiency=0.5,
    launch_overhead_s=5e-6,
)


def test_op_time_compute_bound_matmul() -> None:
    # 1e12 FLOP / (100e12 * 0.5) = 20 ms; 1e6 B / 0.5e12 = 2 us; + 5 us launch
    assert compute.op_time_s(1e12, 1e6, DEVICE, "bf16", "matmul") == pytest.approx(0.02 + 5e-6)


def test_op_time_memory_bound_matmul() -> None:
    # decode GEMV: 1e9 FLOP -> 20 us; 1e9 B / 0.5e12 = 2 ms
    assert compute.op_time_s(1e9, 1e9, DEVICE, "bf16", "matmul") == pytest.approx(2e-3 + 5e-6)


def test_op_time_dtype_selects_peak() -> None:
    # fp32: 1e12 / (10e12 * 0.5) = 0.2 s
    assert compute.op_time_s(1e12, 0, DEVICE, "fp32", "matmul") == pytest.approx(0.2 + 5e-6)


def test_op_time_memory_kind_uses_vector_fp32_roof() -> None:
    # elementwise in bf16: compute roof is fp32 peak, 1e10 / 5e12 = 2 ms > 1e6 B / 0.5e12
    assert compute.op_time_s(1e10, 1e6, DEVICE, "bf16", "memory") == pytest.approx(2e-3 + 5e-6)
    assert compute.op_time_s(0, 1e9, DEVICE, "bf16", "memory") == pytest.approx(2e-3 + 5e-6)


def test_op_time_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="dtype"):
        compute.op_time_s(1, 1, DEVICE, "int8", "matmul")
    with pytest.raises(ValueError, match="op kind"):
        compute.op_time_s(1, 1, DEVICE, "bf16", "gather")
    with pytest.raises(ValueError, match=">= 0"):
        compute.op_time_s(-1, 1, DEVICE, "bf16", "matmul")


def test_matmul_and_linear() -> None:
    assert compute.matmul_flops(2, 3, 4) == 48  # 2*m*k*n
    assert compute.matmul_bytes(2, 3, 4, "bf16") == (6 + 12 + 8) * 2
    # Llama-3-8B q_proj on 2048 tokens: 2 * 2048 * 4096 * 4096
    assert compute.linear_flops(2048, 4096, 4096) == pytest.approx(6.8719476736e10)
    assert compute.linear_flops(10, 4, 3, bias=True) == 2 * 10 * 4 * 3 + 10 * 3
    assert compute.linear_bytes(10, 4, 3, "fp32", bias=True) == (40 + 12 + 30 + 3) * 4


def test_attention() -> None:
    # 4 * B * H * Tq * Tk * hd
    assert compute.attention_flops(2, 32, 1024, 1024, 128) == 4 * 2 * 32 * 1024 * 1024 * 128
    assert compute.attention_flops(2, 32, 1024, 1024, 128, causal=True) == 2 * 2 * 32 * 1024 * 1024 * 128
    # decode with GQA: Q and O (B, H, 1, hd), K and V (B, Hkv, Tk, hd), bf16
    assert compute.attention_bytes(1, 32, 8, 1, 4096, 128, "bf16") == (2 * 32 * 128 + 2 * 8 * 4096 * 128) * 2


def test_elementwise_norm_embedding() -> None:
    assert compute.elementwise_flops(1000) == 1000
    assert compute.elementwise_flops(1000, 4.0) == 4000
    assert compute.elementwise_bytes(1000, "bf16", num_inputs=2) == 1000 * 3 * 2
    assert compute.norm_flops(10, 100, "rmsnorm") == 10 * 100 * 4
    assert compute.norm_flops(10, 100) == 10 * 100 * 8
    assert compute.norm_bytes(10, 100, "fp32", "layernorm") == (2 * 1000 + 200) * 4
    assert compute.norm_bytes(10, 100, "bf16", "rmsnorm") == (2 * 1000 + 100) * 2
    assert compute.embedding_bytes(16, 4096, "bf16") == 16 * 8 + 2 * 16 * 4096 * 2
    with pytest.raises(ValueError, match="norm kind"):
        compute.norm_flops(1, 1, "batchnorm")


def test_helpers_reject_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        compute.linear_bytes(1, 1, 1, "fp8")


def test_op_time_matmul_above_cache_streams_additively() -> None:
    # cache 1 MB, stream 1 GB/s: 1e10 FLOP / 5e12 = 2 ms compute + 2e6 B / 1e9 = 2 ms -> 4 ms (not the max)
    cpu = dataclasses.replace(DEVICE, cache_bytes=1e6, stream_bandwidth_bytes_per_s=1e9)
    assert compute.op_time_s(1e10, 2e6, cpu, "fp32", "matmul") == pytest.approx(4e-3 + 5e-6)
    # within the cache: roofline max(2 ms, 1e6 B / 0.5e12 = 2 us)
    assert compute.op_time_s(1e10, 1e6, cpu, "fp32", "matmul") == pytest.approx(2e-3 + 5e-6)
    # memory-kind ops keep the roofline; without stream bandwidth: bytes / (1e12 x 0.5) = 4 us
    assert compute.op_time_s(0, 2e6, cpu, "fp32", "memory") == pytest.approx(4e-6 + 5e-6)
    no_stream = dataclasses.replace(DEVICE, cache_bytes=1e6)
    assert compute.op_time_s(1e10, 2e6, no_stream, "fp32", "matmul") == pytest.approx(2e-3 + 4e-6 + 5e-6)


def test_op_time_attention_kind_uses_attention_efficiency() -> None:
    # 1e12 FLOP bf16 at 100e12 x 0.25 = 40 ms; without the field: matmul efficiency 0.5 -> 20 ms
    sdpa = dataclasses.replace(DEVICE, attention_efficiency=0.25)
    assert compute.op_time_s(1e12, 1e6, sdpa, "bf16", "attention") == pytest.approx(0.04 + 5e-6)
    assert compute.op_time_s(1e12, 1e6, DEVICE, "bf16", "attention") == pytest.approx(0.02 + 5e-6)
    assert compute.op_time_s(1e12, 1e6, sdpa, "bf16", "matmul") == pytest.approx(0.02 + 5e-6)


def test_matmul_rate_depends_on_rows_when_half_rows_is_set():
    import dataclasses

    from costmodels.cluster import load_cluster
    from costmodels.compute import op_time_s

    device = dataclasses.replace(load_cluster("local-cpu").device, matmul_half_rows=16.0, cache_bytes=None)
    flops = 2.0 * 64 * 768 * 3072
    plain = op_time_s(flops, 0.0, device, "fp32", "matmul") - device.launch_overhead_s
    rows64 = op_time_s(flops, 0.0, device, "fp32", "matmul", rows=64) - device.launch_overhead_s
    assert rows64 == pytest.approx(plain * (64 + 16) / 64)  # runs at 64 / (64 + 16) of the rate
    assert op_time_s(flops, 0.0, device, "fp32", "memory", rows=64) == op_time_s(
        flops, 0.0, device, "fp32", "memory"
    )


def test_fit_half_rows_inverts_the_rate_model():
    from costmodels.calibrate import fit_half_rows

    peak, h = 90e9, 20.0
    shapes = [(64, 768, 3072), (512, 768, 3072), (64, 1024, 4096), (512, 1024, 4096)]
    rates = [peak * m / (m + h) for m, _, _ in shapes]
    assert fit_half_rows(shapes, rates) == pytest.approx(h)
    assert fit_half_rows(shapes, [peak] * 4) == 0.0

"""GPU compute priced by shape: GEMM tile / wave quantization and split-K, fused attention by
sequence length, each fit against the published figures its preset cites (costmodels/clusters/dgx-h100.yaml)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from costmodels.cluster import GemmSpec, cluster_to_dict, load_cluster, parse_cluster
from costmodels.compute import (
    attention_blocks,
    attention_kernel_efficiency,
    gemm_efficiency,
    matmul_bytes,
    matmul_flops,
    op_time_s,
    training_gemm_shapes,
)

H100_PEAK_TFLOPS = 989.0


@pytest.fixture(scope="module")
def h100():
    return load_cluster("dgx-h100").device


# tilelang's benchmark/matmul/README.md (xwhzz/tilelang, H800 SXM, fp16, M = N = 8192) and the
# maximum achievable matmul FLOPS of an H100 SXM (mag-/gpu_benchmark README): (M, N, K, TFLOP/s)
PUBLISHED_GEMMS = [
    (8192, 8192, 256, 386),
    (8192, 8192, 512, 520),
    (8192, 8192, 1024, 628),
    (8192, 8192, 2048, 705),
    (8192, 8192, 4096, 736),
    (8192, 8192, 8192, 758),
    (8192, 8192, 16384, 766),
    (6144, 17920, 2816, 792.1),
]


@pytest.mark.parametrize("m,n,k,published", PUBLISHED_GEMMS)
def test_gemm_fit_reproduces_published_rates(h100, m, n, k, published) -> None:
    predicted = gemm_efficiency(m, n, k, h100.gemm) * H100_PEAK_TFLOPS
    assert predicted == pytest.approx(published, rel=0.04)


# Held out of the fit: the forward GEMM kernels of one GPT-3 175B layer under Transformer Engine on 8
# H100 SXM, TP 8, 2,048 tokens, bf16, timed by nsys (NVIDIA/Fuser#4844; bench/training_published.py
# part (d) holds the figures and prices them with `te_layer_gemm_s`)
def test_gemm_prices_hold_against_a_published_layers_kernel_times() -> None:
    path = Path(__file__).resolve().parents[1] / "bench" / "training_published.py"
    spec = importlib.util.spec_from_file_location("training_published_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    layer = bench.TE_LAYER
    priced = bench.te_layer_gemm_s(layer["hidden"], layer["tp"], layer["seq"], load_cluster(layer["cluster"]))
    assert set(priced) == set(bench.TE_GEMM_KERNELS_S)
    for name, published_s in bench.TE_GEMM_KERNELS_S.items():
        assert priced[name] == pytest.approx(published_s, rel=0.05), name


# vllm-project/vllm#49363 (H100, torch bf16, N = 12288, K = 5376): weight-streaming shapes, where the
# memory roof decides (TFLOP/s at M = 16, 64, 128)
@pytest.mark.parametrize("m,published", [(16, 46.5), (64, 182.6), (128, 352.6)])
def test_small_m_gemm_is_memory_bound_as_published(h100, m, published) -> None:
    flops = matmul_flops(m, 5376, 12288)
    t = op_time_s(
        flops, matmul_bytes(m, 5376, 12288, "bf16"), h100, "bf16", "matmul", rows=m, shape=(5376, 12288)
    )
    assert flops / t / 1e12 == pytest.approx(published, rel=0.12)


def test_wave_quantization() -> None:
    gemm = GemmSpec(efficiency=1.0, half_k=0.0, sms=132, tiles=((128, 256),), min_split_k=1e9)
    full = gemm_efficiency(128 * 12, 256 * 11, 4096, gemm)  # 132 tiles: one full wave
    assert full == pytest.approx(1.0)
    one_more = gemm_efficiency(128 * 12, 256 * 11 + 256, 4096, gemm)  # 144 tiles: a second, 12/132 full
    assert one_more == pytest.approx(144 / 264)


def test_tile_quantization_and_best_tile() -> None:
    gemm = GemmSpec(efficiency=1.0, half_k=0.0, sms=1, tiles=((128, 256),), min_split_k=1e9)
    assert gemm_efficiency(129, 256, 64, gemm) == pytest.approx(129 / 256)  # two row tiles, one barely used
    both = dataclasses.replace(gemm, tiles=((128, 256), (64, 256)))
    assert gemm_efficiency(64, 256, 64, both) == pytest.approx(1.0)  # the 64-row tile fits exactly


def test_small_k_and_split_k() -> None:
    gemm = GemmSpec(efficiency=1.0, half_k=256.0, sms=132, tiles=((128, 256),), min_split_k=256.0)
    # one 128 x 256 tile over K = 4096: split 16 ways (K slices of 256), 16 of 132 SMs busy
    assert gemm_efficiency(128, 256, 4096, gemm) == pytest.approx(16 / 132 * 0.5)
    # full waves, K = 256: the tile's K loop at half rate
    assert gemm_efficiency(128 * 12, 256 * 11, 256, gemm) == pytest.approx(0.5)


def test_training_gemm_shapes() -> None:
    assert training_gemm_shapes(4096, 2048, 8192) == (
        (4096, 2048, 8192),
        (4096, 8192, 2048),
        (2048, 4096, 8192),
    )


# meta-pytorch/tritonbench#1254: Hopper flash_v3 forward, bf16, head dim 128, no mask, (4, 48, S, S, 128)
@pytest.mark.parametrize("seq,published", [(1024, 541.3), (2048, 617.8), (4096, 628.4), (8192, 638.6)])
def test_attention_fit_reproduces_published_rates(h100, seq, published) -> None:
    predicted = attention_kernel_efficiency(seq, False, h100.attention) * H100_PEAK_TFLOPS
    assert predicted == pytest.approx(published, rel=0.03)


# Dao-AILab/flash-attention#1791 (Hopper, FlashAttention-3, head dim 128, seq 8192): forward 630.0 TFLOP/s
# causal, 659.1 unmasked; backward 531.6 and 553.9 (2.5x the forward's FLOPs)
FA3_8K = {"causal": (630.0, 531.6), "unmasked": (659.1, 553.9)}


def test_causal_attention_rate_as_published_on_hopper(h100) -> None:
    causal = attention_kernel_efficiency(8192, True, h100.attention) * H100_PEAK_TFLOPS
    unmasked = attention_kernel_efficiency(8192, False, h100.attention) * H100_PEAK_TFLOPS
    assert causal == pytest.approx(FA3_8K["causal"][0], rel=0.02)
    assert unmasked == pytest.approx(FA3_8K["unmasked"][0], rel=0.02)
    assert causal / unmasked == pytest.approx(FA3_8K["causal"][0] / FA3_8K["unmasked"][0], rel=0.005)


def test_attention_backward_factor_between_the_hopper_kernels(h100) -> None:
    # FlashAttention-3 at seq 8192 (2.96-2.97) and torch's SDPA on an H200 as calibrated (3.24, median
    # over 512-8192 tokens; bench/README.md, gpu_check.sh)
    fa3 = [2.5 * forward / backward for forward, backward in FA3_8K.values()]
    assert min(fa3) == pytest.approx(2.96, abs=0.01) and max(fa3) == pytest.approx(2.97, abs=0.01)
    assert max(fa3) <= h100.attention.backward_time_factor <= 3.24


def test_attention_dropout_factor_as_published(h100) -> None:
    # NVIDIA/TransformerEngine#3312: cuDNN fused attention, fwd + bwd on an H200, dropout 0.1 / none
    assert h100.attention.dropout_time_factor == pytest.approx(0.614 / 0.594, rel=0.005)


def test_attention_blocks_run_in_waves_over_the_sms(h100) -> None:
    """One thread block per 128 queries of each head (FlashAttention-3's Hopper tile at head dim 128):
    7 heads of one 4,096-token sequence (a TP-8 rank of a 56-head model) make 224 blocks, two waves
    over 132 SMs of which the second is 70% full; four sequences make 896, seven waves nearly full.
    The published tables the preset is fitted to fill the SMs many times over (no factor)."""
    attention = h100.attention
    assert attention_blocks(1, 7, 4096) == 224 and attention_blocks(4, 7, 4096) == 896
    assert attention_blocks(1, 32, 100) == 32 and attention_blocks(0.5, 7, 1) == 7  # at least one row
    assert attention_blocks(1, 7, 4096, head_dim=64) == 7 * 22  # 192-row tiles at head dim 64
    plain = attention_kernel_efficiency(4096, True, attention)
    assert attention_kernel_efficiency(4096, True, attention, 224, 132) == pytest.approx(plain * 224 / 264)
    assert attention_kernel_efficiency(4096, True, attention, 896, 132) == pytest.approx(plain * 896 / 924)
    assert attention_kernel_efficiency(4096, True, attention, 264, 132) == pytest.approx(plain)
    assert attention_kernel_efficiency(4096, True, attention, 224, None) == plain
    # op_time_s takes the blocks as the fourth element of `seq` and the SMs from the device's GEMM spec
    flops = 4.0 * 4096 * 4096 * 128 * 7 / 2
    one, four = (
        op_time_s(n * flops, 0.0, h100, "bf16", "attention", launch=False, seq=(4096, 4096, True, 224 * n))
        for n in (1, 4)
    )
    assert four / (4 * one) == pytest.approx((224 / 264) / (896 / 924))


def test_cpu_specs_are_not_priced_by_gemm_shape() -> None:
    cpu = load_cluster("local-cpu").device
    assert cpu.gemm is None and cpu.attention is None


def test_gpu_shape_pricing_round_trips_yaml() -> None:
    spec = load_cluster("dgx-h100")
    assert parse_cluster(cluster_to_dict(spec), "round trip") == spec


def test_gemm_tiles_malformed_names_the_field() -> None:
    raw = cluster_to_dict(load_cluster("dgx-h100"))
    raw["device"]["gemm"]["tiles"] = [[128]]
    with pytest.raises(ValueError, match=r"device\.gemm\.tiles\[0\]"):
        parse_cluster(raw, "bad")
    raw["device"]["gemm"]["tiles"] = [[0, 256]]  # the value is shown ("got a list" said nothing)
    with pytest.raises(ValueError, match=r"device\.gemm\.tiles\[0\]: .*two integers > 0, got \[0, 256\]"):
        parse_cluster(raw, "bad")


# Held out of the fit: OpenXLA's measured sm_90 bf16 matmul table (375 products, b x (m, k) @ (k, n),
# m, n, k from 256 to 4096; bench/gemm_shapes.py holds the copy and prints the table). Priced as the
# planner prices an op of a graph (with the launch overhead), the median is within 10% overall and in
# the bands of the layer-sized products.
def test_gemm_prices_hold_against_xla_s_measured_hopper_table() -> None:
    path = Path(__file__).resolve().parents[1] / "bench" / "gemm_shapes.py"
    spec = importlib.util.spec_from_file_location("gemm_shapes_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.errors(load_cluster("dgx-h100").device, launch=True)
    assert len(rows) == 375
    large = [r for r in rows if r[1] >= 1e10]  # >= 10 GFLOP: the products of training and prefill
    for selected in (rows, large):
        count, median, worst = bench.summary(selected)
        assert median <= 0.10, (count, median, worst)


def test_fp32_products_run_on_simt_tiles_with_the_fixed_cost_of_their_slower_k_steps(h100) -> None:
    """fp32 (torch's default, TF32 off) runs on the CUDA cores: a model built from a Hugging Face config
    and planned without --dtype prices its GEMMs so. The tensor-core tile model priced a 32 x 64 x 128
    fp32 product at 29 us (one 64 x 256 tile with the 16-bit per-tile cost, at 1/15 the rate): GPT-J at
    hidden 64 on dgx-h100 chose TP 4 to split such products. Now the launch dominates it, and a large
    fp32 product runs near the fit's efficiency of the fp32 peak; 16-bit prices are unchanged."""

    def tflops(m: int, k: int, n: int, dtype: str, launch: bool = True) -> float:
        t = op_time_s(matmul_flops(m, k, n), matmul_bytes(m, k, n, dtype), h100, dtype, "matmul", rows=m,
                      shape=(k, n), launch=launch)  # fmt: skip
        return matmul_flops(m, k, n) / t / 1e12

    small_s = matmul_flops(32, 64, 128) / (tflops(32, 64, 128, "fp32") * 1e12)
    assert small_s < 2 * h100.launch_overhead_s, small_s
    fp32_peak = h100.peak_flops_per_s["fp32"] / 1e12
    assert 0.75 * fp32_peak < tflops(8192, 8192, 8192, "fp32") <= h100.gemm.efficiency * fp32_peak
    assert 0.7 * fp32_peak < tflops(2048, 4096, 4096, "fp32")
    # the 16-bit fit as before (tilelang's 8192 x 8192 x 2048 at 705 TFLOP/s, within its 4%)
    assert tflops(8192, 2048, 8192, "bf16", launch=False) == pytest.approx(705, rel=0.04)


def test_fp32_is_never_priced_below_the_16_bit_product_and_only_fp32_leaves_the_tensor_core_fit(h100) -> None:
    """Two holes in the first fp32 model: split-K over 17-element K slices (its floor scaled with the
    per-tile cost) priced a router-like 128 x 1024 x 64 fp32 product up to 1.4x faster than in bf16;
    and a spec whose fp16 peak sat a hair above bf16's (a calibration measures each) sent bf16 to the
    CUDA-core tiles. fp32 is now at least the 16-bit time of its shape, and only fp32 changes model."""
    shapes = [(m, k, n) for m in (1, 16, 128, 2048) for k in (64, 1024, 2048, 8192) for n in (16, 64, 4096)]
    for m, k, n in shapes:
        flops = matmul_flops(m, k, n)
        fp32 = op_time_s(flops, matmul_bytes(m, k, n, "fp32"), h100, "fp32", "matmul", rows=m, shape=(k, n))
        bf16 = op_time_s(flops, matmul_bytes(m, k, n, "bf16"), h100, "bf16", "matmul", rows=m, shape=(k, n))
        assert fp32 >= bf16, (m, k, n, fp32, bf16)
    hair = dataclasses.replace(h100, peak_flops_per_s={**h100.peak_flops_per_s, "fp16": 992e12})
    for m, k, n in [(2048, 256, 16), (8192, 2048, 8192)]:
        flops = matmul_flops(m, k, n)
        before = op_time_s(flops, matmul_bytes(m, k, n, "bf16"), h100, "bf16", "matmul", rows=m, shape=(k, n))
        after = op_time_s(flops, matmul_bytes(m, k, n, "bf16"), hair, "bf16", "matmul", rows=m, shape=(k, n))
        assert after == pytest.approx(before)

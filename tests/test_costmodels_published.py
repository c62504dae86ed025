"""The presets against published measurements: NVIDIA H100 / A100 datasheets, nccl-tests results in
NVIDIA/nccl-tests and NVIDIA/nccl issue threads, and the pytorch-labs/gpt-fast README.

Bus bandwidth as nccl-tests reports it: busbw = algbw * 2(n-1)/n, algbw = bytes / time.
"""

from __future__ import annotations

from importlib import resources

import pytest
import yaml

from costmodels.cluster import load_cluster, parse_cluster, preset_names
from costmodels.comm import Group, all_reduce_time_s
from costmodels.compute import op_time_s
from costmodels.memory import kv_cache_bytes

GB = 1e9
MiB = 2**20
GiB = 2**30


def _bus_bandwidth_GBps(nbytes: float, time_s: float, n: int) -> float:
    return nbytes / time_s * 2 * (n - 1) / n / GB


def test_h100_all_reduce_bus_bandwidth_1GiB() -> None:
    """8xH100: NCCL's all-reduce runs NVLink SHARP by default, peak busbw ~480 GB/s (sjeaugey,
    NVIDIA/nccl-tests#212; 480 at 2-4 GB in NVIDIA/nccl#1455), within 10%. (Before the NCCL model
    this held the ring's 365-370 GB/s, which NCCL runs only with NVLS off: tests/test_nccl_prices.py.)"""
    busbw = _bus_bandwidth_GBps(GiB, all_reduce_time_s(GiB, Group(8, 8), load_cluster("dgx-h100")), 8)
    assert busbw == pytest.approx(480, rel=0.10)


@pytest.mark.parametrize(
    ("nbytes", "published_us"), [(128, 19), (1 * MiB, 32), (4 * MiB, 59), (16 * MiB, 136)]
)
def test_h100_torch_nccl_all_reduce_latency(nbytes: int, published_us: float) -> None:
    """8xH100 torch.distributed NCCL all-reduce latency points, within 25% (model: within 14%)."""
    predicted_us = all_reduce_time_s(nbytes, Group(8, 8), load_cluster("dgx-h100")) * 1e6
    assert predicted_us == pytest.approx(published_us, rel=0.25)


def test_a100_all_reduce_bus_bandwidth() -> None:
    """8xA100 80GB: busbw 200-232 GB/s."""
    busbw = _bus_bandwidth_GBps(GiB, all_reduce_time_s(GiB, Group(8, 8), load_cluster("dgx-a100")), 8)
    assert 200 <= busbw <= 232


def _a100_ib_2node() -> dict:
    """2 nodes x 8 A100 over 4x 200 Gb/s InfiniBand (test-only spec): dgx-a100 plus an inter-node link
    at the same 0.9 NIC efficiency the h100-ib presets use (25 GB/s line rate per NIC)."""
    data = _preset_yaml("dgx-a100")
    data.update(name="a100-ib-2node", nodes=2)
    data["links"]["inter_node"] = {
        "kind": "infiniband",
        "bandwidth_GBps": 25 * 0.9,
        "latency_us": 6,
        "nics_per_node": 4,
    }
    return data


def _preset_yaml(name: str) -> dict:
    return yaml.safe_load(resources.files("costmodels.clusters").joinpath(f"{name}.yaml").read_text())


def test_a100_two_nodes_infiniband_bus_bandwidth() -> None:
    """2 nodes x 8 A100, 4x 200 Gb/s IB: busbw 86-91 GB/s, within 15%."""
    cluster = parse_cluster(_a100_ib_2node(), "a100-ib-2node")
    busbw = _bus_bandwidth_GBps(GiB, all_reduce_time_s(GiB, Group(16, 8), cluster), 16)
    assert busbw == pytest.approx(88.5, rel=0.15)
    assert 86 <= busbw <= 91  # tighter: NCCL's ring across nodes, bounded by the NICs at 0.9 of line rate


def test_h100_ib_presets_use_the_same_nic_efficiency() -> None:
    for name in ("h100-ib-2node", "h100-ib-128node"):
        inter = load_cluster(name).inter_node
        assert inter is not None and inter.bandwidth_bytes_per_s == pytest.approx(50 * GB * 0.9)


def test_gpt_fast_llama2_7b_tp1_decode_on_a100() -> None:
    """gpt-fast: Llama-2-7B TP1 bf16 104.9 tok/s (9.53 ms/token) on A100-80GB at 330 W, within 10%.

    Weight streaming dominates: per layer 7 matmuls (q, k, v, o, gate, up, down) reading their
    weights, ~10 small ops; plus the LM head. The attention KV read for a 5-token prompt is tiny.
    """
    a100 = load_cluster("dgx-a100").device
    hidden, ffn, layers, vocab = 4096, 11008, 32, 32000
    layer_weights = [(hidden, hidden)] * 4 + [(hidden, ffn)] * 2 + [(ffn, hidden)]
    per_layer = sum(op_time_s(2 * i * o, 2 * i * o, a100, "bf16", "matmul") for i, o in layer_weights)
    per_layer += 10 * op_time_s(0, 2 * 2 * hidden, a100, "bf16", "memory")
    per_layer += op_time_s(0, kv_cache_bytes(1, 1, 8, 32, 128, "bf16"), a100, "bf16", "memory")
    head = op_time_s(2 * hidden * vocab, 2 * hidden * vocab, a100, "bf16", "matmul")
    token_s = layers * per_layer + head
    assert token_s * 1e3 == pytest.approx(1000 / 104.9, rel=0.10)


def test_presets_quote_dense_not_sparse_peaks() -> None:
    """published.md: 1,979 TFLOP/s is the 2:4-sparsity figure; dense H100 bf16 is 989."""
    for name in preset_names():
        assert load_cluster(name).device.peak_flops_per_s["bf16"] < 1.5e15


def _serving_bench():
    """bench/serving.py as a module (bench/ is not a package)."""
    import importlib.util  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    path = Path(__file__).resolve().parents[1] / "bench" / "serving.py"
    spec = importlib.util.spec_from_file_location("serving_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_published_serving_rows_are_held_against_the_hbm_bandwidth_floor() -> None:
    """A published request cannot beat reading every weight once per token at the datasheet HBM
    bandwidth. NeMo's Llama-2-13B A100 rows (128 in / 20 out, TP1 batch 1: 142.5 ms) do, so that
    table's stated request is not what it measured; every compared row of the other sources is above
    its floor. Llama-2-13B at TP1: 12.85e9 non-embedding parameters x 2 B x 20 tokens / 2.039 TB/s."""
    bench = _serving_bench()
    nemo_13b_tp1_b1 = next(r for r in bench.NEMO_13B_CHECKS if r.tp == 1 and r.batch == 1)
    assert bench.floor_s(nemo_13b_tp1_b1) == pytest.approx(12.85e9 * 2 * 20 / 2039e9, rel=0.01)
    assert bench.published_request_s(nemo_13b_tp1_b1) < bench.floor_s(nemo_13b_tp1_b1)
    for row in bench.PUBLISHED:
        if not row.source.startswith("NeMo"):
            assert bench.published_request_s(row) > bench.floor_s(row), row


def test_llm_inference_bench_rows_read_as_published() -> None:
    """bench/data/llm_inference_bench_h100.csv: LLM-Inference-Bench's H100 vLLM and TensorRT-LLM rows of
    the four Llama models at batch 1/16/32/64 (312 of Plots/All_results.csv at 4211f5d). Every row's
    Throughput is Batch Size x 2 x L / Latency (the scripts' batch x (input_len + output_len) / latency,
    input = output = 'Input Output Length'), which is how the bench compares them, and every row is
    above the HBM bandwidth floor of its L generated tokens."""
    bench = _serving_bench()
    rows = bench.engine_rows()
    assert len(rows) == 312
    assert {r.gpu for r in rows} == {"H100"} and {r.framework for r in rows} == {"vLLM", "TensorRT-LLM"}
    assert {r.batch for r in rows} == {1, 16, 32, 64} and {r.tp for r in rows} == {1, 2, 4}
    for r in rows:
        assert r.throughput == pytest.approx(r.batch * 2 * r.length / r.latency_s, rel=1e-6), r
        assert r.latency_s > bench.engine_floor_s(r), r


@pytest.mark.slow
def test_vllm_host_work_closes_the_rows_it_was_fitted_to() -> None:
    """bench/serving.py's vLLM 0.5 host work per step (`vllm_serving_host`) is solved from three rows in
    closed form; priced through the cluster spec (`device.serving_host`) each of those rows then
    matches its published time, and `host_s` is what the spec adds to a request: the bench's algebra
    and the planner's costing agree."""
    bench = _serving_bench()
    host = bench.vllm_serving_host()
    assert host.step_s > 0 and host.per_sequence_s > 0 and host.per_worker_s > 0
    for model, tp, batch, length in bench.VLLM_FIT:
        row = bench._fit_rows("vLLM", model, tp, batch, length)
        args = (row.model, row.config, row.cluster, row.tp, row.batch, row.length)
        without, with_host = bench.engine_request(*args, None), bench.engine_request(*args, None, host)
        assert with_host - without == pytest.approx(bench.host_s(row, host), rel=1e-6)
        assert with_host == pytest.approx(row.latency_s, rel=1e-3)

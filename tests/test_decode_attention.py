"""Decode attention of one thread block per (sequence, query head): `costmodels.compute.
decode_attention_time_s` against Flash-Decoding's published micro-benchmark, and what it does to
decode plans (a few heads per TP rank leave most SMs idle)."""

from __future__ import annotations

import dataclasses

import pytest

from costmodels.cluster import SpecError, cluster_to_dict, load_cluster, parse_cluster, preset_names
from costmodels.compute import decode_attention_time_s
from planner.solver.problem import Constraints, WorkloadSpec
from planner.solver.search import plan_model
from tests.planner_fixtures import analysed_llama

# Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference" (PyTorch blog, 2023-10),
# micro-benchmark table: FlashAttention v2.0.9 on A100, f16, 16 query heads / 2 KV heads of 128, one
# new token: (batch, seqlen, us)
FLASH_DECODING_FA2_A100 = (
    (256, 256, 390.5), (128, 512, 366.3), (64, 1024, 364.8), (32, 2048, 352.0), (16, 4096, 401.7),
    (8, 8192, 529.2), (4, 16384, 582.7), (2, 32768, 1156.1), (1, 65536, 2300.6), (1, 131072, 4592.2),
)  # fmt: skip


@pytest.mark.parametrize("batch, seqlen, published_us", FLASH_DECODING_FA2_A100)
def test_a100_preset_reproduces_flash_decoding_table(batch: int, seqlen: int, published_us: float) -> None:
    """The dgx-a100 preset's decode kernel (one block per sequence and query head, 108 SMs,
    block_share 0.95) against every row of the table within 12%: batch 1 and 2 run one wave of 16 and 32
    blocks each reading a whole 65k-token head (the kernel is 50x slower than a split one there)."""
    a100 = load_cluster("dgx-a100").device
    predicted_us = decode_attention_time_s(batch, 16, seqlen, 128, "fp16", a100) * 1e6
    assert predicted_us == pytest.approx(published_us, rel=0.12)


def test_without_the_kernel_nothing_is_added() -> None:
    """A device without `decode_attention` (a kernel that splits the cache) is priced by bandwidth."""
    h100 = load_cluster("dgx-h100").device
    assert h100.decode_attention is None
    assert decode_attention_time_s(1, 8, 32768, 128, "bf16", h100) is None


def _decode_latency_s(cluster, tp: int, batch: int, context: int) -> float:
    structure = analysed_llama("8b")
    work = WorkloadSpec("decode", batch, 1, context=context, dtype="bf16")
    plan = plan_model(structure, cluster, work, Constraints(tp=tp, pp=1, dp=1, max_devices=tp))
    return plan.predicted.latency_s


def test_decode_plan_pays_the_idle_sms_at_batch_one() -> None:
    """Llama-3-8B decode at batch 1 over a 32k cache on A100s at TP4 (8 query heads per rank): each
    layer's attention runs 8 blocks of a whole head's cache, ~1.2 ms, where bandwidth alone reads the
    rank's 2 KV heads in ~20 us; the step is longer by the layers' difference. TP8 (4 heads per rank)
    runs one wave of the same blocks: the attention does not get faster with TP."""
    a100 = load_cluster("dgx-a100")
    split = dataclasses.replace(a100, device=dataclasses.replace(a100.device, decode_attention=None))
    context, layers = 32768, 32
    per_layer = decode_attention_time_s(1, 8, context, 128, "bf16", a100.device)
    added = _decode_latency_s(a100, 4, 1, context) - _decode_latency_s(split, 4, 1, context)
    assert added == pytest.approx(layers * per_layer, rel=0.05)
    assert decode_attention_time_s(1, 4, context, 128, "bf16", a100.device) == pytest.approx(per_layer)


def test_spec_errors_name_the_field() -> None:
    raw = load_cluster("dgx-a100")
    data = cluster_to_dict(raw)
    assert data["device"]["decode_attention"] == {"sms": 108, "block_share": 0.95}
    assert parse_cluster(data, "spec.yaml").device.decode_attention == raw.device.decode_attention
    bad = {**data, "device": {**data["device"], "decode_attention": {"sms": 0, "block_share": 1}}}
    with pytest.raises(SpecError, match=r"device\.decode_attention\.sms: expected an integer >= 1"):
        parse_cluster(bad, "spec.yaml")
    bad = {**data, "device": {**data["device"], "decode_attention": {"sms": 108}}}
    with pytest.raises(SpecError, match=r"device\.decode_attention.*block_share"):
        parse_cluster(bad, "spec.yaml")


def test_presets_with_the_kernel_cite_its_source() -> None:
    """Every preset that prices a per-head decode kernel names the measurement its share is fitted to."""
    for name in preset_names():
        cluster = load_cluster(name)
        if cluster.device.decode_attention is not None:
            assert any("Flash-Decoding" in s for s in cluster.sources), name

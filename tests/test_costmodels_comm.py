"""Alpha-beta collectives against hand-derived values; topology (ranks per node, NIC sharing).

The failure this guards against: a cost model blind to ranks-per-node mispredicted all-reduce
against reduce-scatter by 8x and flipped the plan. Here all-reduce = reduce-scatter + all-gather
(ratio ~2 for large messages) inside a node and across nodes, and the inter-node bandwidth a rank
gets is its node's NICs divided by the ranks on that node.

The hand-derived values are the alpha-beta formulas, which price backend gloo; TOY is a gloo cluster
with gloo's all-gather-as-all-reduce quirk switched off here so that each formula shows alone.
Backend nccl (NCCL's algorithms and protocols) is held to published figures in tests/test_nccl_prices.py.
"""

from __future__ import annotations

import dataclasses

import pytest

import costmodels.comm
from costmodels.cluster import ClusterSpec, DeviceSpec, LinkSpec, load_cluster
from costmodels.comm import (
    Group,
    all_gather_time_s,
    all_reduce_time_s,
    broadcast_time_s,
    inter_node_bandwidth_per_rank,
    p2p_time_s,
    reduce_scatter_time_s,
)

GB = 1e9
US = 1e-6

# 2 nodes x 8 devices; NVLink 100 GB/s, 1 us per step; 4 NICs of 25 GB/s per node, 10 us per step;
# no launch overhead, so each formula is its alpha-beta terms alone.
TOY = ClusterSpec(
    name="toy",
    num_nodes=2,
    devices_per_node=8,
    device=DeviceSpec("gpu", 80e9, {"bf16": 1e15, "fp16": 1e15, "fp32": 1e14}, 3e12, 1.0, 1.0, 0.0),
    intra_node=LinkSpec("nvlink", 100 * GB, 1 * US),
    inter_node=LinkSpec("infiniband", 25 * GB, 10 * US, nics_per_node=4),
    backend="gloo",
    overlap_efficiency=0.8,
    sources=(),
)
S = 1e9  # bytes


@pytest.fixture(autouse=True)
def _ring_scatter_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    """TOY's reduce-scatter / all-gather as the ring formula, not gloo's all-reduce-priced quirk."""
    monkeypatch.setattr(costmodels.comm, "GLOO_SCATTER_GATHER_AS_ALL_REDUCE", False)


def test_group_validation_and_packing() -> None:
    assert Group(16, 8).num_nodes == 2
    assert Group(12, 8).num_nodes == 2  # 8 + 4: nodes filled in order
    with pytest.raises(ValueError, match="more ranks per node"):
        Group(4, 8)
    with pytest.raises(ValueError, match=">= 1"):
        Group(0, 1)
    assert Group.packed(4, TOY) == Group(4, 4)
    assert Group.packed(16, TOY) == Group(16, 8)


def test_single_rank_or_empty_message_is_free() -> None:
    assert all_reduce_time_s(S, Group(1, 1), TOY) == 0.0
    assert all_reduce_time_s(0, Group(8, 8), TOY) == 0.0
    assert reduce_scatter_time_s(S, Group(1, 1), TOY) == 0.0


def test_intra_node_all_reduce_ring_for_large_messages() -> None:
    # ring: 2(n-1) alpha + 2(n-1)/n S/B = 14 us + 1.75 * 10 ms; doubling would be 3 (1 us + 10 ms)
    assert all_reduce_time_s(S, Group(8, 8), TOY) == pytest.approx(14 * US + 0.0175)


def test_intra_node_all_reduce_latency_variant_for_small_messages() -> None:
    # 1 kB: doubling 3 (1 us + 10 ns) beats ring 14 us + 17.5 ns
    assert all_reduce_time_s(1000, Group(8, 8), TOY) == pytest.approx(3 * (US + 1e-8))


def test_intra_node_reduce_scatter_all_gather_broadcast_p2p() -> None:
    ring_half = 7 * US + 0.875 * 0.01  # (n-1) alpha + (n-1)/n S/B
    assert reduce_scatter_time_s(S, Group(8, 8), TOY) == pytest.approx(ring_half)
    assert all_gather_time_s(S, Group(8, 8), TOY) == pytest.approx(ring_half)
    assert broadcast_time_s(S, Group(8, 8), TOY) == pytest.approx(7 * US + 0.01)  # pipelined chain
    assert p2p_time_s(S, TOY, inter_node=False) == pytest.approx(US + 0.01)
    # 8 ranks of a node send at once over 4 NICs: 12.5 GB/s per flow
    assert p2p_time_s(S, TOY, inter_node=True) == pytest.approx(10 * US + S / (12.5 * GB))


def test_launch_overhead_paid_once_per_collective() -> None:
    slow = dataclasses.replace(TOY, device=dataclasses.replace(TOY.device, launch_overhead_s=5 * US))
    for fn in (all_reduce_time_s, reduce_scatter_time_s, all_gather_time_s, broadcast_time_s):
        assert fn(S, Group(16, 8), slow) == pytest.approx(fn(S, Group(16, 8), TOY) + 5 * US)


def test_two_node_all_reduce_shares_the_nodes_nics_among_its_ranks() -> None:
    # 16 ranks, 8 per node: each rank gets 4 NICs x 25 GB/s / 8 ranks = 12.5 GB/s across nodes.
    per_rank_bw = 4 * 25 * GB / 8
    intra_rs = 7 * US + 0.875 * S / (100 * GB)
    # inter-node all-reduce of the S/8 shard over 2 nodes: doubling (1 step) = 10 us + (S/8) / 12.5 GB/s
    inter = 10 * US + (S / 8) / per_rank_bw
    expected = intra_rs + inter + intra_rs
    assert all_reduce_time_s(S, Group(16, 8), TOY) == pytest.approx(expected)
    # A model that gave every rank the whole node's NICs (100 GB/s) would price the inter-node part
    # 8x too cheap; one giving each rank a whole NIC, 2x. Ours is neither.
    blind_node = intra_rs + 10 * US + (S / 8) / (100 * GB) + intra_rs
    assert all_reduce_time_s(S, Group(16, 8), TOY) > 1.3 * blind_node


def test_two_node_reduce_scatter_and_all_gather() -> None:
    per_rank_bw = 4 * 25 * GB / 8
    expected = 7 * US + 0.875 * S / (100 * GB) + 10 * US + 0.5 * (S / 8) / per_rank_bw
    assert reduce_scatter_time_s(S, Group(16, 8), TOY) == pytest.approx(expected)
    assert all_gather_time_s(S, Group(16, 8), TOY) == pytest.approx(expected)


def test_one_rank_per_node_groups_still_share_the_nics() -> None:
    # Group(2, 1), e.g. data parallel across 2 nodes with TP=8 inside: the 8 DP groups of a node
    # all-reduce at the same time over its 4 NICs, 12.5 GB/s each (not the node's 100 GB/s).
    assert inter_node_bandwidth_per_rank(TOY) == 12.5 * GB
    assert all_reduce_time_s(S, Group(2, 1), TOY) == pytest.approx(10 * US + S / (12.5 * GB))
    with pytest.raises(ValueError, match="one node"):
        inter_node_bandwidth_per_rank(load_cluster("dgx-h100"))


@pytest.mark.parametrize("cluster_name", ["toy", "dgx-h100", "dgx-a100", "h100-pcie", "h100-ib-2node"])
@pytest.mark.parametrize("nbytes", [256 * 2**20, 2**30])
def test_all_reduce_is_reduce_scatter_plus_all_gather(cluster_name: str, nbytes: int) -> None:
    """Without NVLink SHARP. With it (the H100 presets' default), NCCL's NVLS all-reduce beats
    reduce-scatter + all-gather by the published 480 / 370 (tests/test_nccl_prices.py)."""
    cluster = TOY if cluster_name == "toy" else load_cluster(cluster_name)
    cluster = dataclasses.replace(cluster, intra_node=dataclasses.replace(cluster.intra_node, nvls=False))
    groups = [Group(8, 8)] + ([Group(16, 8)] if cluster.num_nodes > 1 else [])
    for group in groups:
        ar = all_reduce_time_s(nbytes, group, cluster)
        rs = reduce_scatter_time_s(nbytes, group, cluster)
        ag = all_gather_time_s(nbytes, group, cluster)
        assert ar == pytest.approx(rs + ag, rel=0.02)
        assert 1.8 < ar / rs < 2.2, (cluster_name, group, ar / rs)


def test_groups_that_do_not_fit_are_rejected() -> None:
    one_node = load_cluster("dgx-h100")
    with pytest.raises(ValueError, match="does not fit"):
        all_reduce_time_s(S, Group(16, 8), one_node)
    with pytest.raises(ValueError, match="does not fit"):
        all_reduce_time_s(S, Group(16, 16), TOY)
    with pytest.raises(ValueError, match="no inter-node link"):
        p2p_time_s(S, one_node, inter_node=True)
    with pytest.raises(ValueError, match=">= 0"):
        all_gather_time_s(-1, Group(8, 8), TOY)


def test_gloo_all_gather_is_priced_as_its_all_reduce(monkeypatch: pytest.MonkeyPatch):
    """Measured on this machine: gloo's all-gather of 12.9 MB takes as long as its all-reduce."""
    monkeypatch.setattr(costmodels.comm, "GLOO_SCATTER_GATHER_AS_ALL_REDUCE", True)
    from costmodels.cluster import load_cluster
    from costmodels.comm import Group, all_gather_time_s, all_reduce_time_s, reduce_scatter_time_s

    local = load_cluster("local-cpu", nproc=2)
    group = Group(2, 2)
    nbytes = 12.9e6
    assert all_gather_time_s(nbytes, group, local) == pytest.approx(all_reduce_time_s(nbytes, group, local))
    assert reduce_scatter_time_s(nbytes, group, local) == pytest.approx(
        all_reduce_time_s(nbytes, group, local)
    )
    nccl = load_cluster("dgx-h100")
    assert all_gather_time_s(nbytes, Group(8, 8), nccl) < all_reduce_time_s(nbytes, Group(8, 8), nccl)

"""Communication cost: alpha-beta models of collectives, aware of how ranks sit on nodes.

For a group of ``n`` ranks on one link class (alpha = ``latency_s``, B = ``bandwidth_bytes_per_s``,
S = bytes of the full tensor), following Thakur, Rabenseifner, Gropp, "Optimization of collective
communication operations in MPICH" (IJHPCA 2005) and Patarasuk & Yuan (JPDC 2009) for the ring:

    all-reduce, ring                 2(n-1) alpha + 2(n-1)/n * S / B
    all-reduce, recursive doubling   ceil(log2 n) * (alpha + S / B)      (latency-optimal; used when cheaper)
    reduce-scatter, all-gather       (n-1) alpha + (n-1)/n * S / B
    broadcast                        min(pipelined chain (n-1) alpha + S / B,  binomial tree ceil(log2 n)(alpha + S / B))
    send / recv                      alpha + S / B

Every collective also pays the device's ``launch_overhead_s`` once (it is one kernel).

A group spanning ``k`` nodes with ``r`` ranks on each is priced hierarchically: reduce-scatter
inside each node (NVLink), an all-reduce of the ``S / r`` shard across the ``k`` nodes, all-gather
inside each node. Across nodes, the ranks of a node share its NICs. Every rank of a node runs its own
group's collective at the same time (SPMD: the 8 data-parallel groups of a TP=8 node all-reduce
together; the 8 ranks of a stage send together), so each rank gets
``nics_per_node * nic_bandwidth / devices_per_node`` -- for a group holding all of a node's ranks
that is ``nics_per_node * nic_bandwidth / ranks_per_node``. (A model blind to ranks-per-node gives
every rank the whole node's NICs: it mispriced all-reduce against reduce-scatter 8x and flipped a
plan; see tests/test_costmodels_comm.py.)

Those alpha-beta formulas price the gloo backend (local-cpu, `planner calibrate` specs: fitted to
measurements there). A cluster whose backend is nccl is priced as NCCL runs it (`_nccl_*` below;
tests/test_nccl_prices.py holds it against published nccl-tests figures): per collective, NCCL's
tuner (NVIDIA/nccl src/graph/tuning.cc) times every algorithm x protocol it has and runs the
fastest; so does this model. A protocol p (LL, LL128, Simple) costs a base latency, a per-step
latency and reaches a fraction of the link's bus bandwidth; an algorithm sets the steps and the
bytes (nccl-tests' bus-bandwidth convention, busbw = algbw x 2(n-1)/n for all-reduce, (n-1)/n for
all-gather / reduce-scatter, 1 for broadcast):

    ring            2(n-1) steps (all-reduce), n-1 (reduce-scatter, all-gather, broadcast)
    tree            across nodes only: 2 ((r-1) intra + ceil(log2 k) inter) steps, NCCL's tree
                    bandwidth (0.9 x 0.5 x the ring's bus bandwidth as algorithm bandwidth)
    NVLS            all-reduce on an NVSwitch node with NVLink SHARP (``links.intra_node.nvls``):
                    a constant few steps, bus bandwidth above the link's (NVLS_BUSBW_GAIN);
                    across nodes NVLS_TREE: NVLS in the node pipelined with a tree across nodes

Across nodes the ring runs flat over all n ranks (its bus bandwidth is the smaller of NVLink and the
group's share of its node's NICs: a flat ring sends 2(n-1)/n S through each node's NICs); the tree
and NVLS_TREE are hierarchical and pipelined: the slower of the intra-node phase and the inter-node
all-reduce of S over the node's NICs (2(k-1)/k S per node), not their sum. This replaces the gloo
path's summed hierarchy for nccl because NCCL's tree and NVLS_TREE stream chunks through both
levels at once; published 2-node figures (tests/test_nccl_prices.py) match the pipelined form.
Reduce-scatter and all-gather use the ring alone (NCCL prefers it over NVLS there: it sends fewer
bytes; NVIDIA/nccl#1670). All-to-all is n-1 concurrent sends.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from costmodels.cluster import ClusterSpec, LinkSpec


@dataclass(frozen=True)
class Group:
    """A process group: ``size`` ranks, ``ranks_per_node`` of them on each node it spans (on the last
    node fewer when ``size`` is not a multiple: 12 ranks filling nodes of 8 are Group(12, 8), on 8 + 4;
    the prices treat every node as holding ``ranks_per_node``)."""

    size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.ranks_per_node < 1:
            raise ValueError(
                f"Group(size={self.size}, ranks_per_node={self.ranks_per_node}): both must be >= 1"
            )
        if self.ranks_per_node > self.size:
            raise ValueError(
                f"Group(size={self.size}, ranks_per_node={self.ranks_per_node}): more ranks per node than in the group"
            )

    @property
    def num_nodes(self) -> int:
        """Number of nodes the group spans (the last one partly filled when uneven)."""
        return -(-self.size // self.ranks_per_node)

    @classmethod
    def packed(cls, size: int, cluster: ClusterSpec) -> Group:
        """``size`` consecutive ranks placed node by node (fill a node before using the next)."""
        per_node = min(size, cluster.devices_per_node)
        return cls(size, per_node)


def _log2_steps(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def _all_reduce_flat_s(n: int, nbytes: float, alpha_s: float, bandwidth: float) -> float:
    """Cheaper of ring and recursive doubling, without launch overhead."""
    if n == 1:
        return 0.0
    ring = 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * nbytes / bandwidth
    doubling = _log2_steps(n) * (alpha_s + nbytes / bandwidth)
    return min(ring, doubling)


def _scatter_gather_flat_s(n: int, nbytes: float, alpha_s: float, bandwidth: float) -> float:
    """Ring reduce-scatter or all-gather of an ``nbytes`` tensor, without launch overhead."""
    if n == 1:
        return 0.0
    return (n - 1) * alpha_s + (n - 1) / n * nbytes / bandwidth


def _broadcast_flat_s(n: int, nbytes: float, alpha_s: float, bandwidth: float) -> float:
    if n == 1:
        return 0.0
    chain = (n - 1) * alpha_s + nbytes / bandwidth
    tree = _log2_steps(n) * (alpha_s + nbytes / bandwidth)
    return min(chain, tree)


def _check(nbytes: float, group: Group, cluster: ClusterSpec) -> tuple[LinkSpec, LinkSpec | None, float]:
    """The links the group uses, and the inter-node bandwidth each of its ranks gets (bytes/s)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if group.ranks_per_node > cluster.devices_per_node or group.num_nodes > cluster.num_nodes:
        raise ValueError(
            f"Group(size={group.size}, ranks_per_node={group.ranks_per_node}) does not fit cluster "
            f"{cluster.name!r} ({cluster.num_nodes} nodes x {cluster.devices_per_node} devices)"
        )
    inter = cluster.inter_node if group.num_nodes > 1 else None
    if group.num_nodes > 1 and inter is None:
        raise ValueError(
            f"group spans {group.num_nodes} nodes but cluster {cluster.name!r} has no inter_node link"
        )
    return cluster.intra_node, inter, inter_node_bandwidth_per_rank(cluster) if inter else 0.0


def inter_node_bandwidth_per_rank(cluster: ClusterSpec) -> float:
    """Bytes/s across nodes that one rank gets while every rank of its node communicates across
    nodes at once: ``nics_per_node * nic_bandwidth / devices_per_node``. Raises ValueError on a
    one-node cluster."""
    inter = cluster.inter_node
    if inter is None:
        raise ValueError(f"cluster {cluster.name!r} has one node: no inter-node link")
    return inter.nics_per_node * inter.bandwidth_bytes_per_s / cluster.devices_per_node


def _hierarchical_time_s(
    flat_s: Callable[[int, float, float, float], float], nbytes: float, group: Group, cluster: ClusterSpec
) -> float:
    """A collective of ``nbytes`` whose flat form is ``flat_s(ranks, nbytes, latency_s, bytes_per_s)``:
    on one node that flat form over the intra-node link; over several, intra-node reduce-scatter (or
    scatter), the flat form across nodes on each rank's ``nbytes / ranks_per_node`` share with the
    NICs shared by the node's ranks, then intra-node all-gather. Plus one launch overhead."""
    intra, inter, per_rank_bw = _check(nbytes, group, cluster)
    if group.size == 1 or nbytes == 0:
        return 0.0
    r, a, b = group.ranks_per_node, intra.latency_s, intra.bandwidth_bytes_per_s
    if inter is None:
        wire = flat_s(r, nbytes, a, b)
    else:
        wire = (
            _scatter_gather_flat_s(r, nbytes, a, b)
            + flat_s(group.num_nodes, nbytes / r, inter.latency_s, per_rank_bw)
            + _scatter_gather_flat_s(r, nbytes, a, b)
        )
    return cluster.device.launch_overhead_s + wire


# --------------------------------------------------------------------------------------------
# NCCL (backend nccl)


@dataclass(frozen=True)
class NcclProtocol:
    """One NCCL protocol. Latencies after NCCL's tuning model (NVIDIA/nccl src/graph/tuning.cc:
    baseLat, hwLat for the ring; LL carries 4 data bytes in 8, LL128 120 in 128)."""

    name: str
    base_latency_s: float  # once per collective, on top of the device's launch overhead
    # per-step latency as a fraction of the link's ``latency_s`` (the Simple protocol's step):
    # NCCL's hwLat ring ratios, NVLink / PCIe (LL .47, LL128 1.9, Simple 3.4 us) and network
    # (LL 2.7, LL128 4.0, Simple 9.6 us)
    step_fraction_local: float
    step_fraction_net: float
    all_reduce_bandwidth_fraction: float  # of the link's (Simple) bus bandwidth
    bandwidth_fraction: float  # the same for every other collective


NCCL_PROTOCOLS = (
    NcclProtocol("LL", 3.6e-6, 0.47 / 3.4, 2.7 / 9.6, 1 / 4, 1 / 3),
    NcclProtocol("LL128", 10.0e-6, 1.9 / 3.4, 4.0 / 9.6, 0.92, 0.92),
    NcclProtocol("Simple", 8.4e-6, 1.0, 1.0, 1.0, 1.0),
)
_SIMPLE = NCCL_PROTOCOLS[-1]

# NVLS all-reduce: bus bandwidth / the link's (ring) bus bandwidth, by ranks in the node. 8 x H100
# (NVIDIA/nccl#1455, nccl-tests 2-4 GB, NCCL_ALGO=NVLS vs RING): 365-370 GB/s with 2-4 GPUs (no
# gain), 420, 440, 460, 480 with 5, 6, 7, 8; sjeaugey (NVIDIA/nccl#1442): "a 30% improvement".
NVLS_BUSBW_GAIN = {5: 420 / 370, 6: 440 / 370, 7: 460 / 370, 8: 480 / 370}
# NVLS latency in link steps (``latency_s`` each): a multimem reduce and a broadcast through the
# switch whatever the rank count. Fitted with launch overhead and Simple's base latency so that
# 8 x H100 picks ring / LL up to ~1 MB and NVLS above (NCCL 2.26 on 8 x H100: "8B~1MB: Ring LL,
# 2MB~16GB: NVLS Simple", NVIDIA/nccl-tests#309), and to the published mid-size times
# (tests/test_nccl_prices.py).
NVLS_STEPS = 8


def _step_s(link: LinkSpec, proto: NcclProtocol) -> float:
    local = link.kind in ("nvlink", "pcie", "loopback")
    return link.latency_s * (proto.step_fraction_local if local else proto.step_fraction_net)


def _protocols(cluster: ClusterSpec) -> tuple[NcclProtocol, ...]:
    """LL128 needs NVLink inside the node (NCCL enables it by default only there)."""
    if cluster.intra_node.kind == "nvlink":
        return NCCL_PROTOCOLS
    return tuple(p for p in NCCL_PROTOCOLS if p.name != "LL128")


def _ring_bus_bandwidth(group: Group, cluster: ClusterSpec, per_rank_bw: float) -> float:
    """A flat ring's bus bandwidth: NVLink inside a node; across nodes, the smaller of NVLink and
    the group's share of its node's NICs (``ranks_per_node`` x each rank's share)."""
    bw = cluster.intra_node.bandwidth_bytes_per_s
    if group.num_nodes > 1:
        bw = min(bw, group.ranks_per_node * per_rank_bw)
    return bw


def _nccl_all_reduce_s(nbytes: float, group: Group, cluster: ClusterSpec, per_rank_bw: float) -> float:
    n, r, k = group.size, group.ranks_per_node, group.num_nodes
    intra, inter = cluster.intra_node, cluster.inter_node
    ring_bw = _ring_bus_bandwidth(group, cluster, per_rank_bw)
    node_bw = r * per_rank_bw  # the group's share of its node's NICs
    times = []
    for p in _protocols(cluster):
        f = p.all_reduce_bandwidth_fraction
        a_in = _step_s(intra, p)
        a_net = _step_s(inter, p) if inter is not None and k > 1 else 0.0
        inter_steps = 2 * (k - 1)
        ring_lat = p.base_latency_s + (2 * (n - 1) - inter_steps) * a_in + inter_steps * a_net
        times.append(ring_lat + 2 * (n - 1) / n * nbytes / (ring_bw * f))
        if k > 1:  # NCCL's tree: a chain in the node, a double binary tree across nodes
            tree_lat = p.base_latency_s + 2 * ((r - 1) * a_in + _log2_steps(k) * a_net)
            times.append(tree_lat + nbytes / (0.9 * 0.5 * ring_bw * f))
    gain = NVLS_BUSBW_GAIN.get(r, 1.0)
    if intra.nvls and r > 1:
        lat = _SIMPLE.base_latency_s + NVLS_STEPS * intra.latency_s
        in_node = 2 * (r - 1) / r * nbytes / (intra.bandwidth_bytes_per_s * gain)
        if k == 1:
            times.append(lat + in_node)
        else:  # NVLS_TREE: pipelined with the all-reduce across nodes over the NICs
            assert inter is not None
            across = 2 * (k - 1) / k * nbytes / node_bw
            times.append(lat + 2 * _log2_steps(k) * inter.latency_s + max(in_node, across))
    return min(times)


def _nccl_ring_s(
    nbytes: float, group: Group, cluster: ClusterSpec, per_rank_bw: float, bus_factor: float
) -> float:
    """Ring reduce-scatter / all-gather (``bus_factor`` (n-1)/n) or broadcast (1): n-1 steps."""
    n, k = group.size, group.num_nodes
    ring_bw = _ring_bus_bandwidth(group, cluster, per_rank_bw)
    times = []
    for p in _protocols(cluster):
        a_in = _step_s(cluster.intra_node, p)
        a_net = _step_s(cluster.inter_node, p) if cluster.inter_node is not None and k > 1 else 0.0
        lat = p.base_latency_s + (n - k) * a_in + (k - 1) * a_net
        times.append(lat + bus_factor * nbytes / (ring_bw * p.bandwidth_fraction))
    return min(times)


def _nccl_all_to_all_s(nbytes: float, group: Group, cluster: ClusterSpec, per_rank_bw: float) -> float:
    """n-1 concurrent sends of nbytes / n each (NCCL's all-to-all is grouped send / recv): the share
    to ranks on the same node over NVLink, the rest over the rank's share of the NICs, at once."""
    n, r, k = group.size, group.ranks_per_node, group.num_nodes
    times = []
    for p in (NCCL_PROTOCOLS[0], _SIMPLE):  # NCCL's send / recv use LL or Simple
        f = p.bandwidth_fraction
        local = (r - 1) / n * nbytes / (cluster.intra_node.bandwidth_bytes_per_s * f)
        lat = p.base_latency_s + _step_s(cluster.intra_node, p)
        wire = local
        if k > 1:
            assert cluster.inter_node is not None
            lat = p.base_latency_s + _step_s(cluster.inter_node, p)
            wire = max(local, (n - r) / n * nbytes / (per_rank_bw * f))
        times.append(lat + wire)
    return min(times)


def _nccl_time_s(kind: str, nbytes: float, group: Group, cluster: ClusterSpec) -> float:
    _intra, _inter, per_rank_bw = _check(nbytes, group, cluster)
    if group.size == 1 or nbytes == 0:
        return 0.0
    if kind == "all_reduce":
        wire = _nccl_all_reduce_s(nbytes, group, cluster, per_rank_bw)
    elif kind == "scatter_gather":
        wire = _nccl_ring_s(nbytes, group, cluster, per_rank_bw, (group.size - 1) / group.size)
    elif kind == "broadcast":
        wire = _nccl_ring_s(nbytes, group, cluster, per_rank_bw, 1.0)
    else:
        wire = _nccl_all_to_all_s(nbytes, group, cluster, per_rank_bw)
    return cluster.device.launch_overhead_s + wire


def all_reduce_time_s(nbytes: float, group: Group, cluster: ClusterSpec) -> float:
    """Seconds to all-reduce a tensor of ``nbytes`` bytes (the full tensor, on every rank).

    One node: cheaper of ring and recursive doubling over the intra-node link. Several nodes:
    intra-node reduce-scatter + inter-node all-reduce of ``nbytes / ranks_per_node`` with NIC
    sharing + intra-node all-gather. Raises ValueError if the group does not fit the cluster.
    Backend nccl: the fastest of NCCL's algorithms and protocols (module docstring).
    """
    if cluster.backend == "nccl":
        return _nccl_time_s("all_reduce", nbytes, group, cluster)
    return _hierarchical_time_s(_all_reduce_flat_s, nbytes, group, cluster)


# gloo's all-gather and reduce-scatter move as many bytes as its all-reduce of the full tensor
# (measured here, 2 ranks, 12.9 MB: all_gather_into_tensor 11.8-14.2 ms, all-reduce 11.8-13.4 ms;
# a ring all-gather would take half), so on gloo they are priced as that all-reduce.
GLOO_SCATTER_GATHER_AS_ALL_REDUCE = True


def _scatter_gather_time_s(nbytes_total: float, group: Group, cluster: ClusterSpec) -> float:
    if cluster.backend == "nccl":
        return _nccl_time_s("scatter_gather", nbytes_total, group, cluster)
    intra, inter, per_rank_bw = _check(nbytes_total, group, cluster)
    if group.size == 1 or nbytes_total == 0:
        return 0.0
    if cluster.backend == "gloo" and GLOO_SCATTER_GATHER_AS_ALL_REDUCE:
        return all_reduce_time_s(nbytes_total, group, cluster)
    r = group.ranks_per_node
    wire = _scatter_gather_flat_s(r, nbytes_total, intra.latency_s, intra.bandwidth_bytes_per_s)
    if inter is not None:
        wire += _scatter_gather_flat_s(group.num_nodes, nbytes_total / r, inter.latency_s, per_rank_bw)
    return cluster.device.launch_overhead_s + wire


def reduce_scatter_time_s(nbytes_total: float, group: Group, cluster: ClusterSpec) -> float:
    """Seconds to reduce-scatter an ``nbytes_total``-byte tensor (each rank ends with 1/size of it).

    Several nodes: intra-node reduce-scatter, then inter-node reduce-scatter of the
    ``nbytes_total / ranks_per_node`` shard with NIC sharing. Raises ValueError as all_reduce_time_s.
    """
    return _scatter_gather_time_s(nbytes_total, group, cluster)


def all_gather_time_s(nbytes_total: float, group: Group, cluster: ClusterSpec) -> float:
    """Seconds to all-gather into an ``nbytes_total``-byte tensor (each rank contributes 1/size).

    The mirror of reduce-scatter (inter-node all-gather of shards, then intra-node), same cost.
    """
    return _scatter_gather_time_s(nbytes_total, group, cluster)


def broadcast_time_s(nbytes: float, group: Group, cluster: ClusterSpec) -> float:
    """Seconds to broadcast ``nbytes`` from one rank to the group.

    Several nodes: scatter inside the root's node, broadcast each ``nbytes / ranks_per_node`` shard
    across nodes (NIC sharing), all-gather inside every node. Backend nccl: NCCL's pipelined ring.
    """
    if cluster.backend == "nccl":
        return _nccl_time_s("broadcast", nbytes, group, cluster)
    return _hierarchical_time_s(_broadcast_flat_s, nbytes, group, cluster)


def all_to_all_time_s(nbytes: float, group: Group, cluster: ClusterSpec) -> float:
    """Seconds for an all-to-all of ``nbytes`` per rank (each rank sends ``nbytes / size`` to every
    rank: expert parallelism's token exchange). nccl-tests' busbw = algbw x (n-1)/n.

    Backend nccl: n-1 concurrent sends (`_nccl_all_to_all_s`). Gloo: n-1 point-to-point steps of
    ``nbytes / size`` each over the intra-node link (alpha-beta). Raises ValueError as
    all_reduce_time_s.
    """
    if cluster.backend == "nccl":
        return _nccl_time_s("all_to_all", nbytes, group, cluster)
    intra, _inter, per_rank_bw = _check(nbytes, group, cluster)
    if group.size == 1 or nbytes == 0:
        return 0.0
    n = group.size
    bandwidth = per_rank_bw if group.num_nodes > 1 else intra.bandwidth_bytes_per_s
    return cluster.device.launch_overhead_s + (n - 1) * (intra.latency_s + nbytes / n / bandwidth)


def p2p_time_s(nbytes: float, cluster: ClusterSpec, inter_node: bool) -> float:
    """Seconds to send ``nbytes`` from one rank to another (pipeline stage boundary).

    ``inter_node=True``: every rank of the node sends at once (one flow per rank), so each flow gets
    ``min(one NIC, inter_node_bandwidth_per_rank)``. Raises ValueError if the cluster has no
    inter-node link.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if inter_node:
        link = cluster.inter_node
        if link is None:
            raise ValueError(f"cluster {cluster.name!r} has one node: no inter-node link for a send")
        bandwidth = min(link.bandwidth_bytes_per_s, inter_node_bandwidth_per_rank(cluster))
    else:
        link = cluster.intra_node
        bandwidth = link.bandwidth_bytes_per_s
    if nbytes == 0:
        return 0.0
    if cluster.backend == "nccl":  # LL for small messages, Simple for large (NCCL's send / recv)
        return cluster.device.launch_overhead_s + min(
            p.base_latency_s + _step_s(link, p) + nbytes / (bandwidth * p.bandwidth_fraction)
            for p in (NCCL_PROTOCOLS[0], _SIMPLE)
        )
    return cluster.device.launch_overhead_s + link.latency_s + nbytes / bandwidth


def burst_cluster(cluster: ClusterSpec) -> ClusterSpec:
    """`cluster` with each link's alpha replaced by its `LinkSpec.burst_latency_s` (where measured):
    the price of each collective after the first of a back-to-back asynchronous stream, as ZeRO-2
    and FSDP issue one per layer (`planner.solver.costing.dp_sync_parts`)."""
    intra, inter = cluster.intra_node, cluster.inter_node

    def bursting(link: LinkSpec | None) -> LinkSpec | None:
        if link is None or link.burst_latency_s is None:
            return link
        return dataclasses.replace(link, latency_s=link.burst_latency_s)

    return dataclasses.replace(cluster, intra_node=bursting(intra), inter_node=bursting(inter))

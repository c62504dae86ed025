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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from costmodels.cluster import ClusterSpec, LinkSpec


@dataclass(frozen=True)
class Group:
    """A process group: ``size`` ranks, ``ranks_per_node`` of them on each node it spans."""

    size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.ranks_per_node < 1:
            raise ValueError(
                f"Group(size={self.size}, ranks_per_node={self.ranks_per_node}): both must be >= 1"
            )
        if self.size % self.ranks_per_node:
            raise ValueError(
                f"Group(size={self.size}, ranks_per_node={self.ranks_per_node}): size must be a multiple of ranks_per_node"
            )

    @property
    def num_nodes(self) -> int:
        """Number of nodes the group spans."""
        return self.size // self.ranks_per_node

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


def all_reduce_time_s(nbytes: float, group: Group, cluster: ClusterSpec) -> float:
    """Seconds to all-reduce a tensor of ``nbytes`` bytes (the full tensor, on every rank).

    One node: cheaper of ring and recursive doubling over the intra-node link. Several nodes:
    intra-node reduce-scatter + inter-node all-reduce of ``nbytes / ranks_per_node`` with NIC
    sharing + intra-node all-gather. Raises ValueError if the group does not fit the cluster.
    """
    return _hierarchical_time_s(_all_reduce_flat_s, nbytes, group, cluster)


# gloo's all-gather and reduce-scatter move as many bytes as its all-reduce of the full tensor
# (measured here, 2 ranks, 12.9 MB: all_gather_into_tensor 11.8-14.2 ms, all-reduce 11.8-13.4 ms;
# a ring all-gather would take half), so on gloo they are priced as that all-reduce.
GLOO_SCATTER_GATHER_AS_ALL_REDUCE = True


def _scatter_gather_time_s(nbytes_total: float, group: Group, cluster: ClusterSpec) -> float:
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
    across nodes (NIC sharing), all-gather inside every node.
    """
    return _hierarchical_time_s(_broadcast_flat_s, nbytes, group, cluster)


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

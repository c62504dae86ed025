"""This rank's process groups on the TP x CP x PP x DP mesh of a plan.

The layout is the plan's (`planner.plan.MeshShape`:
`rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank`, tp fastest, then cp), so a TP group is `tp` consecutive ranks (on a node with `tp` or more GPUs it stays
inside the node, on NVLink), the data-parallel (and expert-parallel) ranks of a stage sit next to
them, and pipeline stages are the outermost blocks (Megatron-Core's and torchtitan's order). Example, tp=2, pp=2, dp=1: TP groups {0,1} {2,3}; PP groups {0,2} {1,3};
stage 0 = ranks 0,1.

`build_rank_groups(shape, device_type)` creates the groups with
`torch.distributed.device_mesh.init_device_mesh` inside an initialised default process group (e.g.
inside `runtime.launch.launch`); the coordinates come from `MeshShape.coords`.

Sharded data parallelism over fewer ranks than dp (HSDP, `Plan.dp_shard` < dp, fsdp only) adds two
axes inside the dp one, as torchtitan's ("dp_replicate", "dp_shard") mesh with dp_shard the inner
dim: a shard group is `dp_shard` consecutive DP ranks (dp_rank // dp_shard the same), a replicate
group the DP ranks with the same dp_rank % dp_shard. Every rank creates every such group, in the
same order (`torch.distributed.new_group` is collective). With dp_shard == dp the shard group is the
dp group and there is no replicate group (None: a single rank); with dp_shard == 1 the reverse.

Context parallelism (cp > 1): the CP ranks of a replica hold the same weights, so everything the
data-parallel runtime does spans dp x cp ranks: the gradient reduction and ZeRO's shards run over the
"dp_cp" group (every (dp_rank, cp_rank) of this (pp_rank, tp_rank), Megatron-Core's dp-cp group) and
FSDP's shard group is dp_shard x cp ranks (torchtitan shards over dp_shard x cp). A group's ranks are
numbered in ascending global rank order (`torch.distributed.new_group`), so this rank's place is
dp_rank * cp + cp_rank in "dp_cp" and (dp_rank % dp_shard) * cp + cp_rank in its shard group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from planner.errors import InputError, RunError
from planner.plan import MeshShape

AXES = ("pp", "dp", "cp", "tp")  # mesh dims, outermost first (`MeshShape`: the pipeline outermost)
DP_AXES = ("dp_shard", "dp_replicate")  # HSDP's split of the dp axis (sharded data parallelism)
_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class RankGroups:
    """This rank's coordinates on a mesh and its process group on each axis."""

    shape: MeshShape
    rank: int  # global rank of this process
    device_mesh: DeviceMesh  # dims ("dp", "pp", "cp", "tp")
    dp_shard: int = 1  # DP ranks a sharded state is split over (`Plan.dp_shard` for fsdp; x cp ranks)
    shard_group: dist.ProcessGroup | None = None  # None: a single rank
    replicate_group: dist.ProcessGroup | None = None  # None: a single rank
    dp_cp_group: dist.ProcessGroup | None = None  # the dp x cp ranks of this (pp_rank, tp_rank); None: one
    ep: int = 1  # expert parallelism: "ep" = ep consecutive ranks of "dp_cp", "edp" = the rest (`Plan.ep`)
    ep_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None

    @property
    def dp_rank(self) -> int:
        """Data-parallel replica of this rank."""
        return self.shape.coords(self.rank)[0]

    @property
    def pp_rank(self) -> int:
        """Pipeline stage index of this rank, 0 = first stage."""
        return self.shape.coords(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        """Rank within the tensor-parallel group."""
        return self.shape.coords(self.rank)[2]

    @property
    def cp_rank(self) -> int:
        """Rank within the context-parallel group."""
        return self.shape.cp_rank(self.rank)

    @property
    def dp_cp_rank(self) -> int:
        """This rank's place in the "dp_cp" group: dp_rank * cp + cp_rank."""
        return self.dp_rank * self.shape.cp + self.cp_rank

    @property
    def ep_rank(self) -> int:
        """This rank's place in its EP group (dp_cp_rank % ep): it holds experts ep_rank * E/ep onwards."""
        return self.dp_cp_rank % self.ep

    @property
    def shard_rank(self) -> int:
        """This rank's place in its shard group ((dp_rank % dp_shard) * cp + cp_rank)."""
        return (self.dp_rank % self.dp_shard) * self.shape.cp + self.cp_rank

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """Process group of this rank on `axis` ("dp" | "pp" | "cp" | "tp", "dp_cp", or HSDP's
        "dp_shard" | "dp_replicate": None for a single rank). Raises InputError for another name."""
        if axis == "dp_cp":
            return self.dp_cp_group
        if axis == "ep":
            return self.ep_group
        if axis == "edp":
            return self.edp_group
        if axis == "dp_shard":
            return self.shard_group
        if axis == "dp_replicate":
            return self.replicate_group
        if axis not in AXES:
            raise InputError(f"unknown mesh axis {axis!r}; expected one of {AXES + DP_AXES + ('dp_cp',)}")
        return self.device_mesh.get_group(axis)


def _axis_ranks(shape: MeshShape, rank: int, axis: str) -> list[int]:
    """Global ranks of `rank`'s group on `axis`, in axis order, by `MeshShape` arithmetic."""
    dp_rank, pp_rank, tp_rank = shape.coords(rank)
    cp_rank = shape.cp_rank(rank)
    if axis == "tp":
        return [shape.rank_of(dp_rank, pp_rank, t, cp_rank) for t in range(shape.tp)]
    if axis == "cp":
        return [shape.rank_of(dp_rank, pp_rank, tp_rank, c) for c in range(shape.cp)]
    if axis == "pp":
        return [shape.rank_of(dp_rank, p, tp_rank, cp_rank) for p in range(shape.pp)]
    if axis == "dp_cp":
        return [shape.rank_of(d, pp_rank, tp_rank, c) for d in range(shape.dp) for c in range(shape.cp)]
    return [shape.rank_of(d, pp_rank, tp_rank, cp_rank) for d in range(shape.dp)]


def ep_ranks(shape: MeshShape, ep: int, rank: int, over_tp: bool = False) -> tuple[list[int], list[int]]:
    """Global ranks of `rank`'s EP group (ep consecutive ranks of its "dp_cp" group) and of its expert
    data-parallel group (the ranks of "dp_cp" with the same place in their EP groups; `over_tp`: with
    each one's TP ranks too, in rank order, where whole experts run each TP rank's sequence shard:
    `Plan.experts_on_sequence_shard`)."""
    dp_cp = _axis_ranks(shape, rank, "dp_cp")
    i = dp_cp.index(rank)
    block, inner = divmod(i, ep)
    edp = dp_cp[inner::ep]
    if over_tp:
        edp = sorted(r for e in edp for r in _axis_ranks(shape, e, "tp"))
    return dp_cp[block * ep : (block + 1) * ep], edp


def _ep_groups(
    shape: MeshShape, ep: int, rank: int, over_tp: bool = False
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Every EP group, then every expert data-parallel group (`ep_ranks`), made on every rank in the same
    order; this rank's (None for a single rank)."""
    mine: list[dist.ProcessGroup | None] = [None, None]
    for kind in (0, 1):
        seen: set[tuple[int, ...]] = set()
        for other in range(shape.num_devices):
            ranks = tuple(ep_ranks(shape, ep, other, over_tp)[kind])
            if ranks in seen:
                continue
            seen.add(ranks)
            group = dist.new_group(list(ranks))
            if rank in ranks and len(ranks) > 1:
                mine[kind] = group
    return mine[0], mine[1]


def build_rank_groups(
    shape: MeshShape, device_type: str, dp_shard: int = 1, ep: int = 1, experts_over_tp: bool = False
) -> RankGroups:
    """Create the (pp, dp, cp, tp) device mesh and its process groups; collective, every rank must call it.

    `device_type` is "cpu" (gloo) or "cuda" (nccl). dp_shard: the ranks a sharded data-parallel state
    is split over (fsdp's `Plan.dp_shard`; 1 for the other styles): the shard and replicate groups
    (module docstring). Raises InputError when the degrees are not positive integers, `dp * pp * tp`
    differs from the world size or dp_shard does not divide dp, RunError when no default process
    group is initialised. ep: the expert-parallel degree over dp x cp ("ep" and "edp" groups);
    experts_over_tp: "edp" spans the TP ranks too (`ep_ranks`).
    """
    for name in AXES:
        value = getattr(shape, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"mesh degree {name} must be a positive integer, got {value!r}")
    if device_type not in _DEVICE_TYPES:
        raise InputError(f"device_type must be one of {_DEVICE_TYPES}, got {device_type!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RunError(
            "build_rank_groups needs an initialised default process group; call it inside runtime.launch.launch"
        )
    world_size = dist.get_world_size()
    if shape.num_devices != world_size:
        raise InputError(
            f"dp({shape.dp}) * pp({shape.pp}) * cp({shape.cp}) * tp({shape.tp}) != world_size({world_size})"
        )
    if dp_shard < 1 or shape.dp % dp_shard:
        raise InputError(f"dp_shard={dp_shard} does not divide dp={shape.dp}")
    device_mesh = init_device_mesh(device_type, (shape.pp, shape.dp, shape.cp, shape.tp), mesh_dim_names=AXES)
    rank = dist.get_rank()
    groups = RankGroups(shape, rank, device_mesh)
    for axis in AXES:  # the plan's layout and DeviceMesh's must agree
        assert dist.get_process_group_ranks(groups.group(axis)) == _axis_ranks(shape, groups.rank, axis), axis
    shard = replicate = None
    dp_group = device_mesh.get_group("dp")
    dp_cp_group = _dp_cp_group(shape, rank) if shape.cp > 1 else (dp_group if shape.dp > 1 else None)
    if shape.cp > 1:  # every group with the CP ranks in it (module docstring)
        shard, replicate = _hsdp_groups(shape, dp_shard, rank)
    elif dp_shard == shape.dp:
        shard = dp_group if shape.dp > 1 else None
    elif dp_shard == 1:
        replicate = dp_group
    else:
        shard, replicate = _hsdp_groups(shape, dp_shard, rank)
    if ep < 1 or shape.dp_cp % ep:
        raise InputError(f"ep={ep} does not divide dp x cp = {shape.dp_cp}")
    ep_group = edp_group = None
    if ep > 1:
        ep_group, edp_group = _ep_groups(shape, ep, rank, experts_over_tp)
    elif shape.dp_cp > 1:
        edp_group = dp_cp_group
    return RankGroups(
        shape, rank, device_mesh, dp_shard, shard, replicate, dp_cp_group, ep, ep_group, edp_group
    )


def _dp_cp_group(shape: MeshShape, rank: int) -> dist.ProcessGroup:
    """Every "dp_cp" group, created on every rank in the same order; this rank's."""
    mine, seen = None, set()
    for other in range(shape.num_devices):
        ranks = tuple(_axis_ranks(shape, other, "dp_cp"))
        if ranks in seen:
            continue
        seen.add(ranks)
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = group
    assert mine is not None
    return mine


def hsdp_ranks(shape: MeshShape, dp_shard: int, rank: int) -> tuple[list[int], list[int]]:
    """Global ranks of `rank`'s HSDP shard group (dp_shard DP ranks x every CP rank) and replicate group
    (in DP order, this rank's CP rank)."""
    dp_rank, pp_rank, tp_rank = shape.coords(rank)
    cp_rank = shape.cp_rank(rank)
    block, inner = divmod(dp_rank, dp_shard)
    shard = [
        shape.rank_of(block * dp_shard + s, pp_rank, tp_rank, c)
        for s in range(dp_shard)
        for c in range(shape.cp)
    ]
    replicate = [
        shape.rank_of(r * dp_shard + inner, pp_rank, tp_rank, cp_rank) for r in range(shape.dp // dp_shard)
    ]
    return shard, replicate


def _hsdp_groups(
    shape: MeshShape, dp_shard: int, rank: int
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Every shard group, then every replicate group, created on every rank in the same order (rank
    0's view of the mesh first); this rank's two."""
    mine: dict[str, dist.ProcessGroup] = {}
    for kind in (0, 1):
        seen: set[tuple[int, ...]] = set()
        for other in range(shape.num_devices):
            ranks = tuple(hsdp_ranks(shape, dp_shard, other)[kind])
            if ranks in seen:
                continue
            seen.add(ranks)
            group = dist.new_group(list(ranks))
            if rank in ranks:
                mine[DP_AXES[kind]] = group if len(ranks) > 1 else None
    return mine["dp_shard"], mine["dp_replicate"]

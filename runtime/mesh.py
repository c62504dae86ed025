"""This rank's process groups on the TP x PP x DP mesh of a plan.

The layout is the plan's (`planner.plan.MeshShape`: `rank = (dp_rank * pp + pp_rank) * tp + tp_rank`,
tp fastest), so a TP group is `tp` consecutive ranks (on a node with `tp` or more GPUs it stays
inside the node, on NVLink), the ranks of one pipeline stage sit next to each other, and DP replicas
are the outermost blocks. Example, tp=2, pp=2, dp=1: TP groups {0,1} {2,3}; PP groups {0,2} {1,3};
stage 0 = ranks 0,1.

`build_rank_groups(shape, device_type)` creates the groups with
`torch.distributed.device_mesh.init_device_mesh` inside an initialised default process group (e.g.
inside `runtime.launch.launch`); the coordinates come from `MeshShape.coords`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from planner.errors import InputError, RunError
from planner.plan import MeshShape

AXES = ("dp", "pp", "tp")  # mesh dims, outermost first
_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class RankGroups:
    """This rank's coordinates on a mesh and its process group on each axis."""

    shape: MeshShape
    rank: int  # global rank of this process
    device_mesh: DeviceMesh  # dims ("dp", "pp", "tp")

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

    def group(self, axis: str) -> dist.ProcessGroup:
        """Process group of this rank on `axis` ("dp" | "pp" | "tp"). Raises InputError for another name."""
        if axis not in AXES:
            raise InputError(f"unknown mesh axis {axis!r}; expected one of {AXES}")
        return self.device_mesh.get_group(axis)


def _axis_ranks(shape: MeshShape, rank: int, axis: str) -> list[int]:
    """Global ranks of `rank`'s group on `axis`, in axis order, by `MeshShape` arithmetic."""
    dp_rank, pp_rank, tp_rank = shape.coords(rank)
    if axis == "tp":
        return [shape.rank_of(dp_rank, pp_rank, t) for t in range(shape.tp)]
    if axis == "pp":
        return [shape.rank_of(dp_rank, p, tp_rank) for p in range(shape.pp)]
    return [shape.rank_of(d, pp_rank, tp_rank) for d in range(shape.dp)]


def build_rank_groups(shape: MeshShape, device_type: str) -> RankGroups:
    """Create the (dp, pp, tp) device mesh and its process groups; collective, every rank must call it.

    `device_type` is "cpu" (gloo) or "cuda" (nccl). Raises InputError when the degrees are not positive
    integers or `dp * pp * tp` differs from the world size, RunError when no default process group is
    initialised.
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
        raise InputError(f"dp({shape.dp}) * pp({shape.pp}) * tp({shape.tp}) != world_size({world_size})")
    device_mesh = init_device_mesh(device_type, (shape.dp, shape.pp, shape.tp), mesh_dim_names=AXES)
    groups = RankGroups(shape, dist.get_rank(), device_mesh)
    for axis in AXES:  # the plan's layout and DeviceMesh's must agree
        assert dist.get_process_group_ranks(groups.group(axis)) == _axis_ranks(shape, groups.rank, axis), axis
    return groups

"""The TP x PP x DP device mesh: which ranks share a tensor-parallel, pipeline or data-parallel group.

`world_size = dp * pp * tp` ranks are laid out in the order (dp, pp, tp), tp fastest:

    rank = (dp_rank * pp + pp_rank) * tp + tp_rank

so a TP group is `tp` consecutive ranks (on a node with `tp` or more GPUs it stays inside the node, on
NVLink), the ranks of one pipeline stage sit next to each other, and DP replicas are the outermost
blocks. Example, tp=2, pp=2, dp=1: TP groups {0,1} {2,3}; PP groups {0,2} {1,3}; stage 0 = ranks 0,1.

`mesh_coords` and `axis_ranks` are the pure arithmetic (usable without processes); `build_mesh` creates
the process groups with `torch.distributed.device_mesh.init_device_mesh` inside an initialised default
process group (e.g. inside `runtime.launch.launch`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from planner.errors import InputError, RunError

AXES = ("dp", "pp", "tp")  # mesh dims, outermost first
_DEVICE_TYPES = ("cpu", "cuda")


def _check_degrees(tp: int, pp: int, dp: int) -> None:
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"mesh degree {name} must be a positive integer, got {value!r}")


def _check_axis(axis: str) -> None:
    if axis not in AXES:
        raise InputError(f"unknown mesh axis {axis!r}; expected one of {AXES}")


def mesh_coords(rank: int, tp: int, pp: int, dp: int) -> tuple[int, int, int]:
    """(dp_rank, pp_rank, tp_rank) of global `rank` in a (dp, pp, tp) mesh, tp fastest."""
    _check_degrees(tp, pp, dp)
    if not 0 <= rank < dp * pp * tp:
        raise InputError(
            f"rank({rank}) is outside a mesh of dp({dp}) * pp({pp}) * tp({tp}) = {dp * pp * tp} ranks"
        )
    return rank // (pp * tp), (rank // tp) % pp, rank % tp


def axis_ranks(rank: int, axis: str, tp: int, pp: int, dp: int) -> list[int]:
    """Global ranks of the group on `axis` ("dp" | "pp" | "tp") that holds `rank`, in axis order."""
    _check_axis(axis)
    dp_rank, pp_rank, tp_rank = mesh_coords(rank, tp, pp, dp)
    if axis == "tp":
        return [(dp_rank * pp + pp_rank) * tp + t for t in range(tp)]
    if axis == "pp":
        return [(dp_rank * pp + p) * tp + tp_rank for p in range(pp)]
    return [(d * pp + pp_rank) * tp + tp_rank for d in range(dp)]


@dataclass(frozen=True)
class Mesh:
    """This rank's place in a TP x PP x DP mesh and the process group of each axis."""

    tp: int  # tensor-parallel degree
    pp: int  # number of pipeline stages
    dp: int  # number of data-parallel replicas
    rank: int  # global rank of this process
    device_mesh: DeviceMesh  # dims ("dp", "pp", "tp")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def dp_rank(self) -> int:
        return mesh_coords(self.rank, self.tp, self.pp, self.dp)[0]

    @property
    def pp_rank(self) -> int:
        """Pipeline stage index of this rank, 0 = first stage."""
        return mesh_coords(self.rank, self.tp, self.pp, self.dp)[1]

    @property
    def tp_rank(self) -> int:
        return mesh_coords(self.rank, self.tp, self.pp, self.dp)[2]

    def group(self, axis: str) -> dist.ProcessGroup:
        """Process group of this rank on `axis` ("dp" | "pp" | "tp"). Raises InputError for another name."""
        _check_axis(axis)
        return self.device_mesh.get_group(axis)

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group on `axis`, in axis order."""
        return axis_ranks(self.rank, axis, self.tp, self.pp, self.dp)

    @property
    def prev_stage_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (same dp and tp coordinates); None on the first stage."""
        stage = self.pp_rank
        return None if stage == 0 else self.ranks("pp")[stage - 1]

    @property
    def next_stage_rank(self) -> int | None:
        """Global rank of the next pipeline stage (same dp and tp coordinates); None on the last stage."""
        stage = self.pp_rank
        return None if stage == self.pp - 1 else self.ranks("pp")[stage + 1]


def build_mesh(tp: int, pp: int, dp: int, device_type: str) -> Mesh:
    """Create the (dp, pp, tp) device mesh and its process groups; collective, every rank must call it.

    `device_type` is "cpu" (gloo) or "cuda" (nccl). Raises InputError when the degrees are not positive
    integers or `dp * pp * tp` differs from the world size, RunError when no default process group is
    initialised.
    """
    _check_degrees(tp, pp, dp)
    if device_type not in _DEVICE_TYPES:
        raise InputError(f"device_type must be one of {_DEVICE_TYPES}, got {device_type!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RunError(
            "build_mesh needs an initialised default process group; call it inside runtime.launch.launch"
        )
    world_size = dist.get_world_size()
    if dp * pp * tp != world_size:
        raise InputError(f"dp({dp}) * pp({pp}) * tp({tp}) != world_size({world_size})")
    device_mesh = init_device_mesh(device_type, (dp, pp, tp), mesh_dim_names=AXES)
    mesh = Mesh(tp=tp, pp=pp, dp=dp, rank=dist.get_rank(), device_mesh=device_mesh)
    for axis in AXES:  # our arithmetic and DeviceMesh's layout must agree
        assert dist.get_process_group_ranks(mesh.group(axis)) == mesh.ranks(axis), axis
    return mesh

"""Context parallelism in the DTensor export (`dtensor.py`): what its file adds for a plan with cp > 1.

PyTorch's context parallelism is `torch.distributed.tensor.experimental.context_parallel` (PyTorch
`torch/distributed/tensor/experimental/_context_parallel/_attention.py`, re-exported by
`_attention.py` beside it): a context manager, opened around a training step's forward and
backward, that cuts the given buffers along their sequence dims in place (each rank keeping its
part) and swaps `torch.nn.functional.scaled_dot_product_attention` for a ring attention over the CP
ranks while it is open. The file gets, only with cp > 1 (a cp=1 file is as before):

| plan                          | the file                                                            |
|-------------------------------|---------------------------------------------------------------------|
| mesh.cp                       | a "cp" dim in MESH_DIMS between dp_shard and tp (the rank order:    |
|                               | rank = (((stage * dp_replicate + replica) * dp_shard + shard) * cp  |
|                               | + c) * tp + t), CP_DEGREE, context_parallel_step(mesh, buffers, ...)|
| cp_comm_type ring             | CP_ROTATE_METHOD "alltoall": set_rotate_method's ring rotation      |
|                               | (each step passes the K/V shard to the next rank)                   |
| cp_comm_type allgather        | CP_ROTATE_METHOD "allgather" (PyTorch's default)                    |
| cp_comm_type alltoall         | no PyTorch form (Ulysses): "allgather", a warning                   |
| cp_load_balance               | CP_LOAD_BALANCE: PyTorch's head-tail load balancer (rank r keeps    |
|                               | chunks r and 2cp-1-r of 2 x cp, as the plan) or contiguous chunks   |
| data parallelism              | fully_shard over the dp x cp ranks (data_parallel_mesh), at dp=1 too |

`context_parallel` has no argument for the load balancer: it reads `_cp_options.enable_load_balance`
when the context opens (and restores it when it closes), which context_parallel_step sets first.
Its ring attention handles the CUDA SDPA kernels (the flash, memory-efficient and cuDNN aten ops its
dispatcher lists); CPU attention under it raises NotImplementedError (torch 2.13: no sharding
strategy for `aten._scaled_dot_product_flash_attention_for_cpu`): a plan for a gloo (CPU) cluster
gets a warning.

The data-parallel reduction spans dp x cp ranks (`planner.plan.MeshShape`): the CP ranks of a
replica hold the same weights and each computes the gradient of its own tokens. fully_shard's mesh
is init_mesh()'s dp_replicate, dp_shard and cp dims flattened (`DeviceMesh._flatten`, as torchtitan's
`torchtitan/distributed/parallel_dims.py` builds its dp_shard x cp FSDP dim) and, with replicas,
unflattened into (replicas, shards) (`DeviceMesh._unflatten`): HSDP replicated over dp_replicate
and sharded over dp_shard x cp, DDP replicated over every dp x cp rank with a shard dim of 1, FSDP
sharded over dp_shard x cp.
"""

from __future__ import annotations

from planner.export.common import ULYSSES
from planner.plan import Plan, Workload

# Plan.cp_comm_type -> set_rotate_method's name ("alltoall": the ring rotation; no Ulysses in PyTorch)
ROTATE_METHODS = {"ring": "alltoall", "allgather": "allgather", "alltoall": "allgather"}

IMPORTS = """from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
"""

NOTE = """

Context parallelism (CP_DEGREE ranks split every sequence): run each training step's forward and
backward inside context_parallel_step(), given every tensor indexed by token position:

    with context_parallel_step(mesh, [tokens, labels]):  # (batch, seq): sequence dim 1
        loss = loss_fn(model(tokens), labels)
        loss.backward()

It cuts those tensors in place to this rank's chunks (CP_LOAD_BALANCE: 2 x CP_DEGREE chunks, rank r
keeping r and 2*CP_DEGREE-1-r, so every rank does the same causal attention work) and, while open,
runs torch.nn.functional.scaled_dot_product_attention as a ring attention over mesh["cp"] (K/V by
CP_ROTATE_METHOD). The model's attention must call it through torch.nn.functional (called with
is_causal=True and no mask tensor), and everything it derives from token positions must come from
the buffers given: position ids when it takes them, a rotary table it keeps as a buffer sliced to
the sequence length (its sequence dim in seq_dims: 0 for (seq, dim)); positions it builds itself
with arange would be the rank's local ones."""

SOURCE = '''

def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """fully_shard's mesh with the context-parallel ranks in it: the plan reduces its gradients (and
    shards its states) over dp x cp ranks, the CP ranks of a replica holding the same weights. The
    dims dp_replicate, dp_shard and cp of init_mesh()'s `mesh` flattened into one (ranks in
    (replica, shard, cp rank) order) and, with replicas, unflattened into (replicas, shards): HSDP
    replicated over dp_replicate and sharded over dp_shard x cp, DDP replicated over every dp x cp
    rank with a shard dim of 1; FSDP (no replicas) the flat dim, sharded over dp_shard x cp."""
    flat = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    replicas = MESH_DIMS["dp_replicate"] * (MESH_DIMS["cp"] if DP_STYLE == "ddp" else 1)
    if replicas == 1:
        return flat
    return flat._unflatten(0, (replicas, flat.size() // replicas), ("dp_cp_replicate", "dp_cp_shard"))


def context_parallel_step(mesh: DeviceMesh, buffers: list[torch.Tensor], seq_dims: list[int] | None = None):
    """The context to run one training step's forward and backward in (the file's docstring):
    context_parallel on mesh["cp"] (init_mesh()'s mesh), with set_rotate_method(CP_ROTATE_METHOD) and
    PyTorch's head-tail load balancer on or off as CP_LOAD_BALANCE says. `buffers`: the tensors
    indexed by token position, cut in place along `seq_dims` (default: dim 1 of each, the (batch,
    seq) tokens and labels) and restored when the context closes."""
    set_rotate_method(CP_ROTATE_METHOD)
    _cp_options.enable_load_balance = CP_LOAD_BALANCE  # read when the context opens: no argument for it
    dims = [1] * len(buffers) if seq_dims is None else list(seq_dims)
    return context_parallel(mesh["cp"], buffers=list(buffers), buffer_seq_dims=dims)
'''

# the lines of dtensor.py's apply source that differ with context parallelism: (old, new), each once
APPLY_EDITS: tuple[tuple[str, str], ...] = (
    (
        """    \"\"\"The plan's whole mesh, dims MESH_DIMS in order (pp, dp_replicate, dp_shard, tp: TP innermost,
    rank = ((stage * dp_replicate + replica) * dp_shard + shard) * tp + tp_rank, the plan's rank layout), for""",
        """    \"\"\"The plan's whole mesh, dims MESH_DIMS in order (pp, dp_replicate, dp_shard, cp, tp: TP
    innermost, then CP, rank = (((stage * dp_replicate + replica) * dp_shard + shard) * cp + cp_rank) * tp +
    tp_rank, the plan's rank layout), for""",
    ),
    (
        """    dp_mesh = mesh["dp_replicate", "dp_shard"] with replicas (HSDP; DDP with a shard dim of 1), else
    mesh["dp_shard"]. After apply()'s tensor parallelism (fully_shard composes with its DTensors);
    with pipeline stages, on each stage's module after the split. Nothing at dp=1.\"\"\"
    if MESH_DIMS["dp_replicate"] * MESH_DIMS["dp_shard"] == 1:
        return module
""",
        """    dp_mesh = data_parallel_mesh(mesh), the dp x cp ranks (at dp=1 too: the CP ranks' gradients are
    averaged). After apply()'s tensor parallelism (fully_shard composes with its DTensors); with
    pipeline stages, on each stage's module after the split.\"\"\"
""",
    ),
    (
        """    dp_mesh = mesh["dp_replicate", "dp_shard"] if MESH_DIMS["dp_replicate"] > 1 else mesh["dp_shard"]
""",
        """    dp_mesh = data_parallel_mesh(mesh)
""",
    ),
)


def apply_source(source: str, cp: int) -> str:
    """dtensor.py's apply source `source` for a plan of `cp` context-parallel ranks: as it is at cp=1,
    else with APPLY_EDITS made and SOURCE appended."""
    if cp == 1:
        return source
    for old, new in APPLY_EDITS:
        assert source.count(old) == 1, old  # internal: the edits follow dtensor.py's source
        source = source.replace(old, new)
    return source + SOURCE


def constants(plan: Plan) -> str:
    """The file's context-parallel constants ("" at cp=1)."""
    if plan.cp == 1:
        return ""
    rotate = ROTATE_METHODS[plan.cp_comm_type]
    return (
        f'CP_DEGREE = {plan.cp}  # context-parallel ranks each sequence is split over (mesh dim "cp")\n'
        f"CP_ROTATE_METHOD = {rotate!r}  # set_rotate_method: the plan's cp_comm_type {plan.cp_comm_type}\n"
        f"CP_LOAD_BALANCE = {plan.cp_load_balance}  # head-tail chunks r and 2cp-1-r (False: contiguous)\n"
    )


def warnings(plan: Plan, device: str) -> list[str]:
    """What the file's context parallelism runs otherwise than the plan (module docstring)."""
    if plan.cp == 1:
        return []
    out = []
    if plan.workload is not Workload.TRAIN:
        out.append(
            f"this is a {plan.workload} plan: call the model inside context_parallel_step() without the backward, "
            "and leave out apply_data_parallel's fully_shard (it prepares a training step's gradient reduction)"
        )
    if plan.cp_comm_type == "alltoall":
        out.append(
            f"PyTorch's context_parallel has no {ULYSSES}, the plan's cp_comm_type alltoall: exported with "
            'CP_ROTATE_METHOD "allgather" (every rank gathers the K/V of the whole sequence), not what the plan priced'
        )
    if device == "cpu":
        out.append(
            "PyTorch's context_parallel shards the CUDA SDPA kernels (flash, memory-efficient, cuDNN) only: on this "
            "gloo (CPU) cluster the attention inside context_parallel_step() raises NotImplementedError (torch 2.13: "
            "aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy); run the file on CUDA devices"
        )
    return out

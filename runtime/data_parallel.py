"""Data parallelism at run time: each replica's share of the batch, and averaging the replicas' gradients.

DP replicas hold the same (TP-sharded, pipeline-staged) module and each runs `1 / dp` of the batch
along every input's batch dim (`planner.frontend.capture.input_batch_dims`: dim 0 for token ids, none
for a (T, T) attention bias, which every replica gets whole); after the backward, the mean of their
gradients over the `dp` group is every replica's gradient (one all-reduce per parameter). Pipeline
micro-batches are cut the same way (`args_share`).

The optimizer is Adam (what the memory model assumes), in one of two forms, chosen by
`Plan.distributed_optimizer` (`build_optimizer`):

- `ReplicatedAdam`: every replica all-reduces the gradients (`average_gradients`) and keeps Adam's
  whole state for every parameter;
- `DistributedAdam` (ZeRO-1, Megatron-LM's distributed optimizer): the gradients of one dtype are
  one flat buffer, padded to a multiple of dp, reduce-scattered over the dp group so replica i holds
  the mean gradient of slice i; Adam updates only that slice (its state is 1 / dp of the whole), and
  the updated slices are all-gathered back into every replica's parameters. Per step and dtype: one
  reduce-scatter of the gradient bytes and one all-gather of the parameter bytes, together the
  volume of the all-reduce they replace. (torch's `ZeroRedundancyOptimizer` would all-reduce the
  whole gradient and broadcast each parameter from its owner, more traffic than what is priced.)
  Like `ReplicatedAdam`, the state is kept in the parameters' dtype (no fp32 master copy).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

BatchDims = Sequence[int | None]  # per tensor input (flat_inputs order): its batch dim, or None


def batch_share(
    inputs: tuple[torch.Tensor, ...], parts: int, index: int, batch_dims: BatchDims | None = None
) -> tuple[torch.Tensor, ...]:
    """Share `index` of `parts` of every tensor, split along its batch dim.

    batch_dims: one entry per tensor, its batch dim or None (the tensor is shared whole, not split);
    None means dim 0 for every tensor. Raises ValueError naming the shape when a batch does not divide
    by `parts`, and when `parts` > 1 but no tensor has a batch dim.
    """
    dims = [0] * len(inputs) if batch_dims is None else list(batch_dims)
    if len(dims) != len(inputs):
        raise ValueError(f"{len(inputs)} inputs but {len(dims)} batch dims ({dims})")
    if parts == 1:
        return inputs
    if inputs and all(d is None for d in dims):
        raise ValueError(
            f"no input has a batch dim (shapes {[tuple(x.shape) for x in inputs]}), so the batch cannot be "
            f"split into {parts} parts"
        )
    for x, dim in zip(inputs, dims):
        if dim is not None and x.shape[dim] % parts:
            raise ValueError(
                f"batch {x.shape[dim]} (dim {dim}) of an input of shape {tuple(x.shape)} does not divide into "
                f"{parts} parts"
            )
    return tuple(x if dim is None else x.chunk(parts, dim=dim)[index] for x, dim in zip(inputs, dims))


def args_share(
    args: tuple, kwargs: dict, parts: int, index: int, batch_dims: BatchDims | None = None
) -> tuple[tuple, dict]:
    """(args, kwargs) of a model call with every batched tensor leaf cut to share `index` of `parts`
    along its batch dim (`batch_dims`, in tensor-leaf order; None: dim 0 for all): a DP replica's
    batch, or one micro-batch. Inputs without a batch dim stay whole. Raises ValueError like
    `batch_share`."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    shares = iter(batch_share(tuple(tensors), parts, index, batch_dims))
    leaves = [next(shares) if isinstance(x, torch.Tensor) else x for x in leaves]
    return pytree.tree_unflatten(leaves, spec)


def unbatched_note(inputs: tuple[torch.Tensor, ...], batch_dims: BatchDims) -> list[str]:
    """The report's note on inputs without a batch dim (given whole to every replica and micro-batch);
    empty when every input has one."""
    whole = [f"input {i} {tuple(x.shape)}" for i, (x, d) in enumerate(zip(inputs, batch_dims)) if d is None]
    if not whole:
        return []
    return [f"{', '.join(whole)}: no batch dim, given whole to every data-parallel replica and micro-batch"]


def average_gradients(module: torch.nn.Module, group: dist.ProcessGroup, dp: int) -> None:
    """Replace every parameter gradient by the mean over the `dp` replicas of `group`, in place
    (collective over `group`; a no-op when dp == 1).

    The gradients are flattened into one buffer per dtype and all-reduced once, as DDP's gradient
    buckets do and as the cost model prices it (`planner.solver.costing.gradient_sync_cost`: one
    all-reduce of the gradient bytes): one collective call per step, not one per parameter (on gloo
    each call costs about a millisecond of latency)."""
    average_parameter_gradients(list(module.parameters()), group, dp)


def average_parameter_gradients(params: Sequence[torch.Tensor], group: dist.ProcessGroup, dp: int) -> None:
    """`average_gradients` over a list of parameters (of several modules: a rank's pipeline chunks)."""
    if dp == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in _unique(params):
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _unique(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    return [p for p in params if not (id(p) in seen or seen.add(id(p)))]


class _AdamOnRanks:
    """What both data-parallel optimizers share: `params` (this rank's trainable parameters), the
    torch Adam `adam` stepping them (or their master copies / slices), and whether the gradients
    were reduced since the last step."""

    params: list[torch.Tensor]
    adam: torch.optim.Adam
    _reduced: bool

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.adam.zero_grad(set_to_none=True)
        self._reduced = False

    def state_numel(self) -> int:
        """Elements of Adam state this rank holds: two per element it steps (all of its parameters, or
        with ZeRO-1 its slices), once stepped."""
        return _state_numel(self.adam)


class ReplicatedAdam(_AdamOnRanks):
    """Adam on every parameter, after an all-reduce of the gradients over the dp group (plain DP).
    16-bit parameters are stepped through fp32 master copies with fp32 moments (mixed precision: the
    16 bytes per parameter the memory model prices), then copied back.

    params: the trainable parameters this rank holds (duplicates are dropped). group / dp: the
    data-parallel group and its size. Call `reduce_gradients` after the backward (the checks read the
    mean gradients then), then `step`; `step` reduces first when that was not done.
    """

    def __init__(self, params: Sequence[torch.Tensor], group: dist.ProcessGroup, dp: int, lr: float = 1e-3):
        self.params = [p for p in _unique(params) if p.requires_grad]
        self.group, self.dp = group, dp
        # mixed precision, as the memory model prices it: 16-bit parameters are stepped through fp32
        # master copies (Adam's moments follow their dtype), then copied back
        self._masters = {id(p): p.detach().float().clone() for p in self.params if p.dtype in HALF_DTYPES}
        self.lr = lr
        self.adam = torch.optim.Adam([self._masters.get(id(p), p) for p in self.params], lr=lr)
        self._reduced = False

    def reduce_gradients(self) -> None:
        """Every parameter's gradient becomes the mean over the replicas (one all-reduce per dtype)."""
        average_parameter_gradients(self.params, self.group, self.dp)
        self._reduced = True

    def step(self) -> None:
        if not self._reduced:
            self.reduce_gradients()
        for p in self.params:
            if (master := self._masters.get(id(p))) is not None:
                master.grad = None if p.grad is None else p.grad.float()
        self.adam.step()
        with torch.no_grad():
            for p in self.params:
                if (master := self._masters.get(id(p))) is not None:
                    p.copy_(master)
        self._reduced = False

    def owned_ranges(self) -> dict[int, tuple[int, int]] | None:
        """Which flat elements of each parameter hold the replicas' mean gradient after
        `reduce_gradients`: None, meaning all of every parameter."""
        return None

    def fp32_values(self) -> dict[int, tuple[int, int, torch.Tensor]]:
        """id(param) -> (lo, hi, flat fp32 values of its elements lo:hi) as Adam steps them: an fp32
        parameter itself, a 16-bit one's master copy (views: read them before and after a step)."""
        return {
            id(p): (0, p.numel(), self._masters.get(id(p), p).detach().view(-1))
            for p in self.params
            if p.dtype == torch.float32 or id(p) in self._masters
        }

    def note(self) -> str:
        """What the run report says about the optimizer that ran."""
        sync = f"gradients all-reduced over the {self.dp} data-parallel ranks" if self.dp > 1 else "dp=1"
        return (
            f"optimizer: Adam, state replicated on every data-parallel rank{_mixed_note(self.params)}; {sync}"
        )


class DistributedAdam(_AdamOnRanks):
    """ZeRO-1: Adam with its state sharded over the data-parallel ranks (module docstring).

    params: the trainable parameters this rank holds, the same list in the same order on every replica
    (duplicates are dropped). group / dp / dp_rank: the data-parallel group, its size and this rank's
    rank in it. Parameters are grouped by dtype; each dtype's flat buffer of N elements is cut into dp
    slices of ceil(N / dp) (zero padding at the end), slice dp_rank being this rank's. Collective over
    `group`: every replica calls `reduce_gradients` and `step` together. A parameter without a
    gradient counts as a zero gradient (its Adam moments still move it, as in Megatron-LM's zero-filled
    gradient buffer, where torch's Adam would skip the parameter). The slices are copied from the
    parameters when it is built: build it after the weights are loaded.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        dp: int,
        dp_rank: int,
        lr: float = 1e-3,
    ):
        self.params = [p for p in _unique(params) if p.requires_grad]
        self.group, self.dp, self.dp_rank = group, dp, dp_rank
        self._groups: list[tuple[list[torch.Tensor], int, torch.Tensor]] = []  # (params, slice, my slice)
        for dtype in dict.fromkeys(p.dtype for p in self.params):
            members = [p for p in self.params if p.dtype == dtype]
            total = sum(p.numel() for p in members)
            size = -(-total // dp)
            flat = self._flat([p.detach() for p in members], size * dp)
            shard = flat[dp_rank * size : (dp_rank + 1) * size].clone()
            # mixed precision: a 16-bit slice is stepped as an fp32 master copy (as priced)
            self._groups.append((members, size, shard.float() if dtype in HALF_DTYPES else shard))
        self.lr = lr
        self.adam = torch.optim.Adam([shard for _, _, shard in self._groups], lr=lr)
        self._reduced = False

    @staticmethod
    def _flat(tensors: Sequence[torch.Tensor], padded: int) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.nn.functional.pad(flat, (0, padded - flat.numel()))

    def reduce_gradients(self) -> None:
        """Reduce-scatter the gradients (one collective per dtype): this rank's slice gets the mean
        over the replicas, for Adam and written back into the owned elements of the parameters'
        `.grad` (the other elements keep this replica's own gradient, as in Megatron-LM's buffer)."""
        for members, size, shard in self._groups:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in members]
            flat = self._flat(grads, size * self.dp)
            mine = torch.empty(size, dtype=flat.dtype, device=flat.device)
            dist.reduce_scatter_single(mine, flat, group=self.group)
            mine /= self.dp
            shard.grad = mine.to(shard.dtype)
            for p, lo, hi, offset in self._owned(members, size):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.view(-1)[lo:hi] = mine[offset : offset + hi - lo]
        self._reduced = True

    def step(self) -> None:
        """Reduce the gradients (unless done since the last step), Adam on this rank's slices, then
        all-gather the slices into every replica's parameters (one collective per dtype)."""
        if not self._reduced:
            self.reduce_gradients()
        self.adam.step()
        for members, size, shard in self._groups:
            flat = torch.empty(size * self.dp, dtype=members[0].dtype, device=shard.device)
            dist.all_gather_single(flat, shard.detach().to(flat.dtype), group=self.group)
            offset = 0
            with torch.no_grad():
                for p in members:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        self._reduced = False

    def _owned(self, members: list[torch.Tensor], size: int) -> Iterator[tuple[torch.Tensor, int, int, int]]:
        """(param, lo, hi, offset): flat elements lo:hi of param are this rank's slice from `offset` on."""
        start, end, offset = self.dp_rank * size, (self.dp_rank + 1) * size, 0
        for p in members:
            lo, hi = max(start, offset), min(end, offset + p.numel())
            if lo < hi:
                yield p, lo - offset, hi - offset, lo - start
            offset += p.numel()

    def fp32_values(self) -> dict[int, tuple[int, int, torch.Tensor]]:
        """id(param) -> (lo, hi, flat fp32 values of its elements lo:hi) as this rank's step leaves them:
        an fp32 parameter whole (after the all-gather: every slice), a 16-bit one's master copy of the
        elements in this rank's slice (views: read them before and after a step)."""
        out = {id(p): (0, p.numel(), p.detach().view(-1)) for p in self.params if p.dtype == torch.float32}
        for members, size, shard in self._groups:
            if members[0].dtype in HALF_DTYPES:
                for p, lo, hi, offset in self._owned(members, size):
                    out[id(p)] = (lo, hi, shard.detach()[offset : offset + hi - lo])
        return out

    def owned_ranges(self) -> dict[int, tuple[int, int]]:
        """id(param) -> (lo, hi): the flat elements of each parameter in this rank's slice (those whose
        `.grad` holds the replicas' mean after `reduce_gradients`); parameters not listed have none."""
        return {
            id(p): (lo, hi)
            for members, size, _ in self._groups
            for p, lo, hi, _ in self._owned(members, size)
        }

    def note(self) -> str:
        """What the run report says about the optimizer that ran."""
        return (
            f"optimizer: distributed optimizer (ZeRO-1), Adam state sharded over the {self.dp} data-parallel "
            f"ranks (each updates 1/{self.dp} of the parameters){_mixed_note(self.params)}; gradients "
            "reduce-scattered, parameters all-gathered"
        )


HALF_DTYPES = (torch.bfloat16, torch.float16)  # stepped through fp32 master weights


def _mixed_note(params: Sequence[torch.Tensor]) -> str:
    """', fp32 master weights and moments for the 16-bit parameters' when there are any."""
    return (
        ", fp32 master weights and moments for the 16-bit parameters"
        if any(p.dtype in HALF_DTYPES for p in params)
        else ""
    )


def _state_numel(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        t.numel()
        for state in optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim()
    )


def build_optimizer(
    distributed: bool, params: Sequence[torch.Tensor], group: dist.ProcessGroup, dp: int, dp_rank: int
) -> ReplicatedAdam | DistributedAdam:
    """The optimizer a plan runs: `DistributedAdam` when `Plan.distributed_optimizer`, else
    `ReplicatedAdam`; lr 1e-3."""
    if distributed:
        return DistributedAdam(params, group, dp, dp_rank)
    return ReplicatedAdam(params, group, dp)

"""Data parallelism at run time: each replica's share of the batch, and averaging the replicas' gradients.

DP replicas hold the same (TP-sharded, pipeline-staged) module and each runs `1 / dp` of the batch
along every input's batch dim (`planner.frontend.capture.input_batch_dims`: dim 0 for token ids, none
for a (T, T) attention bias, which every replica gets whole); after the backward, the mean of their
gradients over the `dp` group is every replica's gradient (one all-reduce per parameter). Pipeline
micro-batches are cut the same way (`args_share`).

The optimizer is Adam (what the memory model assumes), in the form `Plan.dp_style` says
(`build_plan_optimizer`; `build_optimizer` for the first two, which the pipeline runtime runs):

- `ReplicatedAdam`: every replica all-reduces the gradients (`average_gradients`) and keeps Adam's
  whole state for every parameter;
- `DistributedAdam` (ZeRO-1, Megatron-LM's distributed optimizer): the parameters of one dtype are
  views of one flat buffer, padded to a multiple of dp, and their gradients views of another; the
  gradient buffer is reduce-scattered over the dp group so replica i holds the mean gradient of slice
  i; Adam updates only that slice of the parameter buffer, in place (its state is 1 / dp of the
  whole), and the updated slices are all-gathered back into every replica's buffer. Per step and
  dtype: one reduce-scatter of the gradient bytes and one all-gather of the parameter bytes, together
  the volume of the all-reduce they replace. (torch's `ZeroRedundancyOptimizer` would all-reduce the
  whole gradient and broadcast each parameter from its owner, more traffic than what is priced.)
  Like `ReplicatedAdam`, 16-bit parameters are stepped through fp32 master copies (of the slice).
- `Zero2Adam` (ZeRO-2): gradients sharded too, reduce-scattered unit by unit as the backward
  finishes them, only the rank's slice kept;
- `FsdpAdam` (ZeRO-3 / HSDP): the parameters sharded too, on a module rewritten by
  `passes.fsdp.apply_fsdp`, gathered and reduced by its `passes.fsdp.FsdpRuntime`.

fp32 main gradients (`Plan.grad_reduce_dtype` fp32, Megatron-LM's default under --bf16): with
`ReplicatedAdam` and `DistributedAdam`, `main_grads=True` accumulates each 16-bit parameter's
gradient into an fp32 main gradient as the backward produces it (a post-accumulate hook adds `.grad`
in and drops it: Megatron-LM's `main_grad`), so the accumulation over micro-batches, the all-reduce
or reduce-scatter and Adam's gradient are fp32; `grad_of` gives the main gradient for the checks.
"""

from __future__ import annotations

import hashlib
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from costmodels.memory import DataParallel
from passes import dp_overlap
from passes.fsdp import Bucket, FsdpRuntime, fsdp_layout, make_buckets, unit_of
from planner.errors import InputError, RunError

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
    if dp > 1:
        _sum_and_divide(params, group, dp)


def reduce_expert_gradients(
    params: Sequence[torch.Tensor], group: dist.ProcessGroup | None, divisor: int
) -> None:
    """Expert parameters under expert parallelism (`passes.ep_lower`): each gradient already sums the
    contributions of every EP rank's tokens, so it is summed over the expert data-parallel group (the
    ranks holding the same experts; None: none) and divided by all dp x cp ranks (`divisor`), the mean
    the dense parameters get (Megatron-Core scales its expert gradients the same way)."""
    _sum_and_divide(params, group, divisor)


def _sum_and_divide(
    params: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    divisor: int,
    grad_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
) -> None:
    """Every gradient of `params` (`grad_of(p)`, default `.grad`: an fp32 main gradient, updated in
    place) summed over `group` (None: not reduced) and divided by `divisor`: one all-reduce of a flat
    buffer per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in _unique(params):
        g = p.grad if grad_of is None else grad_of(p)
        if g is not None:
            by_dtype.setdefault(g.dtype, []).append(g)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        if group is not None:
            dist.all_reduce(flat, group=group)
        flat /= divisor
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
    loss_scaler: Any = None  # fp16 loss scaling (`runtime.loss_scaling.attach`): Adam steps through it

    def _adam_step(self) -> None:
        """Adam's step; with loss scaling, its gradients (the fp32 ones it steps) divided by the scale
        first, and the step skipped when a gradient overflowed on any rank (`runtime.loss_scaling`)."""
        if self.loss_scaler is None:
            self.adam.step()
        else:
            self.loss_scaler.step(self.adam)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.adam.zero_grad(set_to_none=True)
        self._reduced = False

    def state_numel(self) -> int:
        """Elements of Adam state this rank holds: two per element it steps (all of its parameters, or
        with ZeRO-1 its slices), once stepped."""
        return _state_numel(self.adam)


class _OverlappedReduce:
    """overlap_grad_reduce for `ReplicatedAdam` and `DistributedAdam`: each bucket (`passes.fsdp.Bucket`,
    a wrapping unit's parameters of one dtype) is reduced (`_issue`, asynchronous) from the backward as
    soon as its gradients are all accumulated for the last time in the step, i.e. in the last of the
    `rounds` micro-batches' backwards (`register_post_accumulate_grad_hook` counts them: DDP's no_sync
    over the earlier micro-batches), and waited for in `reduce_gradients`, after the backward. A bucket
    whose hooks did not all fire (a parameter without a gradient) or holding a `deferred` parameter
    (a pipeline's tied copy, whose gradient is summed across stages after the backward) is issued in
    `reduce_gradients`. The gradients a hook issues are divided by `hook_divisor` (dp; dp x micro-
    batches in a pipeline, whose schedule scales the `.grad` by 1 / micro-batches only after the
    backward), those issued later by `dp`. `events` records (event, unit) in order for the checks:
    grad_hook (the first gradient of the bucket in the last round), reduce_issued, reduce_wait,
    gather_issued, param_wait (`passes.dp_overlap.dp_param_wait`)."""

    buckets: list[Bucket]
    _members: list[list[torch.Tensor]]
    dp: int
    counts: Counter[str]
    events: list[tuple[str, str]]

    def _init_hooks(self, overlap: bool, rounds: int, hook_divisor: int, deferred: set[int]) -> None:
        self.overlap_grad_reduce = overlap
        self.rounds, self.hook_divisor = max(1, rounds), hook_divisor
        self._seen = [0] * len(self.buckets)
        self._issued = [False] * len(self.buckets)
        self._inflight: deque[tuple[int, Callable[[], None]]] = deque()
        if not overlap:
            return
        for k, members in enumerate(self._members):
            if any(id(p) in deferred for p in members):
                continue
            for p in members:
                p.register_post_accumulate_grad_hook(self._hook(k))

    def _hook(self, k: int) -> Callable[[torch.Tensor], None]:
        def ready(p: torch.Tensor) -> None:
            self._seen[k] += 1
            need = len(self._members[k])
            if self._seen[k] == need * (self.rounds - 1) + 1:
                self.events.append(("grad_hook", self.buckets[k].unit))
            if self._seen[k] == need * self.rounds and not self._issued[k]:
                self._start(k, self.hook_divisor)

        return ready

    def _start(self, k: int, divisor: int) -> None:
        self._issued[k] = True
        self.events.append(("reduce_issued", self.buckets[k].unit))
        self._inflight.append((k, self._issue(k, divisor)))

    def _issue(self, k: int, divisor: int) -> Callable[[], None]:
        raise NotImplementedError

    def _finish_overlapped(self) -> None:
        """Issue the buckets no hook issued, then wait for every reduction in flight, in issue order."""
        for k in range(len(self.buckets)):
            if not self._issued[k]:
                self._start(k, self.dp)
        while self._inflight:
            k, finish = self._inflight.popleft()
            finish()
            self.events.append(("reduce_wait", self.buckets[k].unit))

    def _reset_hooks(self) -> None:
        self._seen = [0] * len(self.buckets)
        self._issued = [False] * len(self.buckets)
        self.events.clear()


class _MainGrads:
    """fp32 main gradients (`Plan.grad_reduce_dtype` fp32) for `ReplicatedAdam` and `DistributedAdam`:
    a post-accumulate hook on each 16-bit parameter adds its `.grad` into an fp32 main gradient as the
    backward produces it and drops `.grad` (Megatron-LM's `main_grad` under
    --accumulate-allreduce-grads-in-fp32, its default with --bf16), so the accumulation over
    micro-batches and the reduction are fp32. The hooks are registered before the overlap's, which then
    find the main gradient. A pipeline's schedule scales only `.grad` by 1 / micro-batches, so main
    gradients are divided by `_main_divisor` (dp, or dp x micro-batches in a pipeline: the
    `hook_divisor`); a parameter tied across pipeline stages (`deferred`: its `.grad` is summed between
    the stages after the schedule) keeps its `.grad` until the reduction, which adds it in (times
    `_main_divisor` / dp, undoing the schedule's scaling). Storage: `_main`, id(param) -> main
    gradient (`DistributedAdam`: views of its fp32 gradient buffer)."""

    params: list[torch.Tensor]
    dp: int

    def _init_main_grads(
        self, enabled: bool, divisor: int, deferred: set[int], storage: dict[int, torch.Tensor] | None = None
    ) -> None:
        """storage: id(param) -> its main gradient, made beforehand (`DistributedAdam`: views of its
        fp32 gradient buffer); else made on the first add and dropped by `zero_grad`."""
        self._main: dict[int, torch.Tensor] = {} if storage is None else storage
        self._main_ids = {id(p) for p in self.params if p.dtype in HALF_DTYPES} if enabled else set()
        self._main_divisor = divisor
        for p in self.params:
            if id(p) in self._main_ids and id(p) not in deferred:
                p.register_post_accumulate_grad_hook(self._accumulate_main)

    def _accumulate_main(self, p: torch.Tensor) -> None:
        self._add_main(p, p.grad)
        p.grad = None

    def _add_main(self, p: torch.Tensor, grad: torch.Tensor, scale: float = 1.0) -> None:
        """Add `grad` x `scale` into p's main gradient (made on the first add)."""
        main = self._main.get(id(p))
        if main is None:
            self._main[id(p)] = grad.float() * scale if scale != 1.0 else grad.float()
        else:
            main.add_(grad, alpha=scale)

    def _adopt_main(self, params: Sequence[torch.Tensor]) -> None:
        """A main-gradient parameter still holding a `.grad` (tied across pipeline stages: summed
        between them after the schedule scaled it by dp / `_main_divisor`) adds it to its main
        gradient, unscaled, and drops it."""
        with torch.no_grad():
            for p in params:
                if id(p) in self._main_ids and p.grad is not None:
                    self._add_main(p, p.grad, scale=self._main_divisor / self.dp)
                    p.grad = None

    def grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """p's gradient as the optimizer reduces and steps it: its fp32 main gradient, or `.grad`."""
        return self._main.get(id(p)) if id(p) in self._main_ids else p.grad

    def _main_note(self) -> str:
        """What the run report adds about main gradients ('' without them)."""
        if not self._main_ids:
            return ""
        return (
            "; the 16-bit parameters' gradients accumulated and reduced in fp32 (main gradients, as "
            "Megatron-LM's --accumulate-allreduce-grads-in-fp32)"
        )


def _adam(params: list[torch.Tensor], lr: float) -> torch.optim.Adam:
    """torch.optim.Adam over `params`, also when there are none: a pipeline stage or a rank whose
    weights are all frozen (requires_grad=False) steps nothing (torch refuses an empty list, not an
    empty group)."""
    return torch.optim.Adam([{"params": params}], lr=lr)


class ReplicatedAdam(_MainGrads, _OverlappedReduce, _AdamOnRanks):
    """Adam on every parameter, after an all-reduce of the gradients over the dp group (plain DP).
    16-bit parameters are stepped through fp32 master copies with fp32 moments (mixed precision: the
    16 bytes per parameter the memory model prices), then copied back.

    params: the trainable parameters this rank holds (duplicates are dropped). group / dp: the
    data-parallel group and its size. Call `reduce_gradients` after the backward (the checks read the
    mean gradients then), then `step`; `step` reduces first when that was not done.
    overlap_grad_reduce (with `named`, the (fqn, parameter) pairs, and `units`, the layers' module
    paths): one asynchronous all-reduce per bucket (a layer's parameters of one dtype, one more for the
    parameters outside the layers) issued from the last micro-batch's backward (`_OverlappedReduce`);
    otherwise one all-reduce per dtype after the backward.
    main_grads: each 16-bit parameter's gradient is accumulated into an fp32 main gradient as the
    backward produces it (`_MainGrads`), which is all-reduced in fp32 and is Adam's gradient.
    """

    def __init__(
        self, params: Sequence[torch.Tensor], group: dist.ProcessGroup, dp: int, lr: float = 1e-3, *,
        named: Sequence[tuple[str, torch.Tensor]] | None = None, units: Sequence[str] = (),
        overlap_grad_reduce: bool = False, micro_batches: int = 1, hook_divisor: int | None = None,
        deferred: set[int] = frozenset(), expert: Sequence[torch.Tensor] = (),
        expert_group: dist.ProcessGroup | None = None, main_grads: bool = False,
    ):  # fmt: skip
        self.params = [p for p in _unique(params) if p.requires_grad]
        self.group, self.dp = group, dp
        # fp32 main gradients of the 16-bit parameters (hooks first: the overlap's hooks read them)
        self._init_main_grads(main_grads, hook_divisor or dp, deferred)
        # expert parallelism: the experts' gradients are reduced over the expert data-parallel group
        self.expert, self.expert_group = [p for p in _unique(expert) if p.requires_grad], expert_group
        expert_ids = {id(p) for p in self.expert}
        # mixed precision, as the memory model prices it: 16-bit parameters are stepped through fp32
        # master copies (Adam's moments follow their dtype), then copied back
        self._masters = {id(p): p.detach().float().clone() for p in self.params if p.dtype in HALF_DTYPES}
        self.lr = lr
        self.adam = _adam([self._masters.get(id(p), p) for p in self.params], lr)
        self._reduced = False
        self.counts: Counter[str] = Counter()
        self.events: list[tuple[str, str]] = []
        overlap = overlap_grad_reduce and dp > 1
        pairs = _named_trainable(named, self.params) if overlap else []
        pairs = [(fqn, p) for fqn, p in pairs if id(p) not in expert_ids]
        self.buckets = make_buckets(pairs, units, 1)
        by_fqn = dict(pairs)
        self._members = [[by_fqn[p.fqn] for p in b.params] for b in self.buckets]
        self._init_hooks(overlap, micro_batches, hook_divisor or dp, deferred)

    def _issue(self, k: int, divisor: int) -> Callable[[], None]:
        members = self._members[k]
        self._adopt_main(members)
        grads = [self.grad_of(p) for p in members]
        flat = torch.cat(
            [(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, members)]
        )
        if any(id(p) in self._main_ids for p in members):
            divisor = self._main_divisor  # main gradients are not scaled by a pipeline's schedule
        self.counts["all_reduce"] += 1
        work = dist.all_reduce(flat, group=self.group, async_op=True)

        def finish() -> None:
            work.wait()
            flat.div_(divisor)
            offset = 0
            for p in members:
                mean = flat[offset : offset + p.numel()].view_as(p).clone()
                if id(p) in self._main_ids:
                    self._main[id(p)] = mean
                else:
                    p.grad = mean
                offset += p.numel()

        return finish

    def reduce_gradients(self) -> None:
        """Every parameter's gradient becomes the mean over the replicas: one all-reduce per dtype, or
        with overlap_grad_reduce wait for the buckets' (issuing any the backward did not)."""
        expert_ids = {id(p) for p in self.expert}
        self._adopt_main(self.params)
        dense = [p for p in self.params if id(p) not in expert_ids]
        main = [p for p in dense if id(p) in self._main_ids]
        dense = [p for p in dense if id(p) not in self._main_ids]
        if self.overlap_grad_reduce:
            self._finish_overlapped()
        else:
            if self.dp > 1:
                self.counts["all_reduce"] += len({p.grad.dtype for p in dense if p.grad is not None})
                average_parameter_gradients(dense, self.group, self.dp)
            if main and (self.dp > 1 or self._main_divisor > 1):  # fp32, one all-reduce
                self.counts["all_reduce"] += int(self.dp > 1)
                _sum_and_divide(main, self.group if self.dp > 1 else None, self._main_divisor, self.grad_of)
        if self.expert:
            if self.expert_group is not None:
                self.counts["all_reduce"] += len(
                    {g.dtype for p in self.expert if (g := self.grad_of(p)) is not None}
                )
            main = [p for p in self.expert if id(p) in self._main_ids]
            rest = [p for p in self.expert if id(p) not in self._main_ids]
            reduce_expert_gradients(rest, self.expert_group, self.dp)
            if main:
                _sum_and_divide(main, self.expert_group, self._main_divisor, self.grad_of)
        self._reduced = True

    def zero_grad(self) -> None:
        super().zero_grad()
        self._main.clear()
        self._reset_hooks()

    def step(self) -> None:
        if not self._reduced:
            self.reduce_gradients()
        for p in self.params:
            if (master := self._masters.get(id(p))) is not None:
                grad = self.grad_of(p)  # an fp32 main gradient as it is (float() copies only 16-bit ones)
                master.grad = None if grad is None else grad.float()
        self._adam_step()
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

    def held_tensors(self) -> list[torch.Tensor]:
        """The training state this rank holds (parameters, gradients, Adam state and masters)."""
        return _held(self.params, self.adam, [*self._masters.values(), *self._main.values()])

    def note(self) -> str:
        """What the run report says about the optimizer that ran."""
        if self.dp == 1:
            sync = "dp=1"
        elif self.overlap_grad_reduce:
            sync = (
                f"gradients all-reduced over the {self.dp} data-parallel ranks (dp x cp) with overlap-grad-reduce: one "
                f"all-reduce per bucket ({len(self.buckets)} buckets: a layer each, one for the parameters "
                "outside the layers) issued from the backward as the bucket's gradients are ready (async, "
                "last micro-batch only), waited for after the backward"
            )
        else:
            sync = f"gradients all-reduced over the {self.dp} data-parallel ranks (dp x cp) after the backward (no overlap)"
        return (
            f"optimizer: Adam, state replicated on every data-parallel rank{_mixed_note(self.params)}; {sync}"
            f"{self._main_note()}; "
            f"collectives in the checked step: {_counts_text(self.counts)}"
        )


class DistributedAdam(_MainGrads, _OverlappedReduce, _AdamOnRanks):
    """ZeRO-1: Adam with its state sharded over the data-parallel ranks (module docstring), laid out as
    Megatron-LM's distributed optimizer keeps it.

    params: the trainable parameters this rank holds, the same list in the same order on every replica
    (duplicates are dropped). group / dp / dp_rank: the data-parallel group, its size and this rank's
    rank in it. Parameters are grouped into buckets (`passes.fsdp.Bucket`): one per dtype, or with
    either overlap one per wrapping unit and dtype (`named` / `units`: a layer's parameters, one more
    for the parameters outside the layers); each bucket of N elements is cut into dp slices of
    ceil(N / dp) (zero padding at the end), slice dp_rank being this rank's.

    Buffers: per dtype one flat parameter buffer and one flat gradient buffer of the same layout (the
    dtype's buckets in order, each `padded_numel` elements); every parameter's storage is re-pointed
    into the parameter buffer and its `.grad` is a view of the gradient buffer (autograd accumulates
    into it in place; `zero_grad` zeroes it), so a bucket's gradient and this rank's slice of it are
    views, and so is the slice of its parameters. Adam steps those parameter slices in place (their
    gradient: the gradient buffer's slice, which holds the replicas' mean after the reduce-scatter);
    16-bit slices through one fp32 master copy per dtype of this rank's slices (mixed precision, as
    the cost model prices it: parameters, gradients and 1 / dp of Adam's state and masters, beside
    transients). A parameter without a gradient counts as a zero gradient (its Adam moments still
    move it, as in Megatron-LM's zero-filled gradient buffer, where torch's Adam would skip the
    parameter). The parameters' values are copied into the buffer when it is built: build it after
    the weights are loaded. Collective over `group`: every replica calls `reduce_gradients` and `step`
    together.

    Without overlap: one reduce-scatter per dtype after the backward and one all-gather per dtype
    after the step. overlap_grad_reduce: one asynchronous reduce-scatter per bucket from the last
    micro-batch's backward (`_OverlappedReduce`). overlap_param_gather: one asynchronous all-gather
    per bucket after the step, straight into the parameter buffer, each waited for by
    `passes.dp_overlap.dp_param_wait` before the bucket's first use in the next forward, or before
    anything reads the parameters (`wait_gathers`).
    """

    def __init__(
        self, params: Sequence[torch.Tensor], group: dist.ProcessGroup, dp: int, dp_rank: int,
        lr: float = 1e-3, *, named: Sequence[tuple[str, torch.Tensor]] | None = None, units: Sequence[str] = (),
        overlap_grad_reduce: bool = False, overlap_param_gather: bool = False, micro_batches: int = 1,
        hook_divisor: int | None = None, deferred: set[int] = frozenset(), main_grads: bool = False,
    ):  # fmt: skip
        self.params = [p for p in _unique(params) if p.requires_grad]
        self.group, self.dp, self.dp_rank = group, dp, dp_rank
        # main_grads: the 16-bit dtypes' gradient buffers are fp32 (`_MainGrads`)
        self._main_dtypes = set(HALF_DTYPES) if main_grads else set()
        main_views: dict[int, torch.Tensor] = {}  # id(param) -> its fp32 main gradient (a buffer view)
        overlap_grad_reduce = overlap_grad_reduce and dp > 1
        self.overlap_param_gather = overlap_param_gather and dp > 1
        per_unit = overlap_grad_reduce or self.overlap_param_gather
        pairs = (
            _named_trainable(named, self.params)
            if per_unit
            else [(str(i), p) for i, p in enumerate(self.params)]
        )
        self.buckets = make_buckets(pairs, units if per_unit else (), dp)
        by_fqn = dict(pairs)
        self._members = [[by_fqn[p.fqn] for p in b.params] for b in self.buckets]
        # bucket -> offset of its padded elements in its dtype's buffers, and of its slice among this
        # rank's slices of its dtype (the masters', the reduce-scatter's output)
        self._bucket_at: dict[int, int] = {}
        self._where: dict[int, int] = {}
        self._param_buffers: dict[torch.dtype, torch.Tensor] = {}  # dtype -> the parameters, flat (padded)
        self._grad_buffers: dict[torch.dtype, torch.Tensor] = {}  # dtype -> their gradients, same layout
        self._masters: dict[torch.dtype, torch.Tensor] = {}  # 16-bit dtype -> fp32 copy of this rank's slices
        self._grad_views: list[list[torch.Tensor]] = []  # bucket -> each member's `.grad` (a buffer view)
        stepped: list[torch.Tensor] = []  # what Adam steps: fp32 (any non-16-bit) slices, 16-bit masters
        # (fp32 slice of the parameter buffer, the gradient buffer's slice: its gradient), stepped in place
        self._slices: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dtype in self._dtypes():
            members = [b for b in self.buckets if b.dtype == dtype]
            start = where = 0
            for b in members:
                self._bucket_at[b.index], self._where[b.index] = start, where
                start, where = start + b.padded_numel, where + b.shard_numel
            device = self._members[members[0].index][0].device
            values = self._param_buffers[dtype] = torch.zeros(start, dtype=dtype, device=device)
            grad_dtype = torch.float32 if dtype in self._main_dtypes else dtype
            grads = self._grad_buffers[dtype] = torch.zeros(start, dtype=grad_dtype, device=device)
            with torch.no_grad():
                for b in members:
                    for p, fp in zip(self._members[b.index], b.params):
                        at = self._bucket_at[b.index] + fp.offset
                        values[at : at + fp.numel].copy_(p.detach().reshape(-1))
                        if p.grad is not None:
                            grads[at : at + fp.numel].copy_(p.grad.detach().reshape(-1))
                        p.data = values[at : at + fp.numel].view_as(p)
            if dtype in HALF_DTYPES:  # mixed precision: the 16-bit slices stepped as an fp32 master copy
                master = torch.cat([self._param_slice(b.index) for b in members]).float()
                self._masters[dtype] = master
                stepped.append(master)
            else:  # the slices themselves (views of the parameter buffer), stepped in place
                self._slices += [(self._param_slice(b.index), self._grad_slice(b.index)) for b in members]
                stepped += [view for view, _ in self._slices[-len(members) :]]
        for b, members in zip(self.buckets, self._members):
            buffer, start = self._grad_buffers[b.dtype], self._bucket_at[b.index]
            views = [
                buffer[start + fp.offset : start + fp.offset + fp.numel].view_as(p)
                for p, fp in zip(members, b.params)
            ]
            self._grad_views.append(views)
            for p, view in zip(members, views):
                if b.dtype in self._main_dtypes:  # the backward adds into it (`_MainGrads` hooks)
                    main_views[id(p)] = view
                    p.grad = None
                else:
                    p.grad = view
        self.lr = lr
        self.adam = _adam(stepped, lr)
        self._reduced = False
        self.counts: Counter[str] = Counter()
        self.events: list[tuple[str, str]] = []
        self._init_main_grads(
            main_grads, hook_divisor or dp, deferred, main_views
        )  # before the overlap's hooks
        self._init_hooks(overlap_grad_reduce, micro_batches, hook_divisor or dp, deferred)

    def _dtypes(self) -> list[torch.dtype]:
        """The buckets' dtypes, in the order their first bucket comes."""
        return list(dict.fromkeys(b.dtype for b in self.buckets))

    @staticmethod
    def _flat(tensors: Sequence[torch.Tensor], padded: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`tensors` flattened into one new tensor of `dtype` (default theirs), zero-padded to `padded`
        elements: one buffer, written once (a 16-bit gradient cast to fp32 on the way, no 16-bit copy)."""
        numel = sum(t.numel() for t in tensors)
        out = tensors[0].new_empty(padded, dtype=dtype or tensors[0].dtype)
        torch.cat([t.reshape(-1) for t in tensors], out=out[:numel])
        out[numel:].zero_()
        return out

    def _bucket(self, table: dict[torch.dtype, torch.Tensor], k: int) -> torch.Tensor:
        """Bucket k's `padded_numel` elements of a buffer of `table` (a view)."""
        b = self.buckets[k]
        return table[b.dtype][self._bucket_at[k] : self._bucket_at[k] + b.padded_numel]

    def _param_slice(self, k: int) -> torch.Tensor:
        """This rank's slice of bucket k's parameters: `shard_numel` elements, a view of the buffer."""
        size = self.buckets[k].shard_numel
        return self._bucket(self._param_buffers, k)[self.dp_rank * size : (self.dp_rank + 1) * size]

    def _grad_slice(self, k: int) -> torch.Tensor:
        """This rank's slice of bucket k's gradients (the replicas' mean after the reduce-scatter), a view."""
        size = self.buckets[k].shard_numel
        return self._bucket(self._grad_buffers, k)[self.dp_rank * size : (self.dp_rank + 1) * size]

    def _master_slice(self, k: int) -> torch.Tensor:
        """Bucket k's part of its 16-bit dtype's fp32 master (`shard_numel` elements, a view)."""
        b = self.buckets[k]
        return self._masters[b.dtype][self._where[k] : self._where[k] + b.shard_numel]

    def _bucket_grad(self, k: int) -> torch.Tensor:
        """Bucket k's gradients, flat and padded: a view of the gradient buffer, which every member's
        `.grad` views (`_adopt_grads` first where one may have been replaced or dropped)."""
        return self._bucket(self._grad_buffers, k)

    def _adopt_grads(self, k: int) -> None:
        """Make every member of bucket k hold its `.grad` in the gradient buffer again: a gradient set
        to None counts as zeros, one replaced by another tensor (the pipeline's sum of tied copies) is
        copied in."""
        if self.buckets[k].dtype in self._main_dtypes:  # main gradients: the buffer is theirs
            self._adopt_main(self._members[k])
            return
        with torch.no_grad():
            for p, view in zip(self._members[k], self._grad_views[k]):
                grad = p.grad
                if grad is None:
                    view.zero_()
                elif grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)
                else:
                    continue
                p.grad = view

    def _keep_mean(self, k: int, mine: torch.Tensor) -> None:
        """This rank's mean gradient slice of bucket k, written into the gradient buffer's slice: the
        owned elements of the parameters' `.grad` (views of the buffer) hold the replicas' mean, the
        other elements keep this replica's own gradient, as in Megatron-LM's buffer; Adam reads the
        slice as its gradient."""
        with torch.no_grad():
            self._grad_slice(k).copy_(mine)

    def _issue(self, k: int, divisor: int) -> Callable[[], None]:
        self._adopt_grads(k)
        flat = self._bucket_grad(k)
        if self.buckets[k].dtype in self._main_dtypes:
            divisor = self._main_divisor  # main gradients are not scaled by a pipeline's schedule
        elif divisor != self.dp:
            # a pipeline's hook (divided by dp x micro-batches): the schedule scales `.grad` in place
            # after the backward, maybe while this reads it (a transient copy, as NCCL reads later)
            flat = flat.clone()
        mine = torch.empty(self.buckets[k].shard_numel, dtype=flat.dtype, device=flat.device)
        self.counts["reduce_scatter"] += 1
        work = dist.reduce_scatter_single(mine, flat, group=self.group, async_op=True)

        def finish() -> None:
            work.wait()
            self._keep_mean(k, mine.div_(divisor))

        return finish

    def reduce_gradients(self) -> None:
        """Reduce-scatter the gradients: this rank's slices get the mean over the replicas. Without
        overlap one collective per dtype (each bucket's rank-r slice goes to rank r); with
        overlap_grad_reduce wait for the buckets' (issuing any the backward did not)."""
        if self.overlap_grad_reduce:
            self._finish_overlapped()
        else:
            for dtype in self._dtypes():
                members = [b for b in self.buckets if b.dtype == dtype]
                for b in members:
                    self._adopt_grads(b.index)
                # rank r's part of the input: every bucket's slice r, in bucket order (one bucket: the
                # buffer as it is; several: a transient copy in that order)
                parts = [self._bucket_grad(b.index).view(self.dp, b.shard_numel) for b in members]
                flat = parts[0].reshape(-1) if len(parts) == 1 else torch.cat(parts, dim=1).reshape(-1)
                mine = torch.empty(flat.numel() // self.dp, dtype=flat.dtype, device=flat.device)
                self.counts["reduce_scatter"] += 1
                dist.reduce_scatter_single(mine, flat, group=self.group)
                mine /= self._main_divisor if dtype in self._main_dtypes else self.dp
                for b in members:
                    offset = self._where[b.index]
                    self._keep_mean(b.index, mine[offset : offset + b.shard_numel])
        self._reduced = True

    def zero_grad(self) -> None:
        """Zero the gradient buffers (every parameter's `.grad` stays their view: the next backward
        accumulates into it)."""
        for grads in self._grad_buffers.values():
            grads.zero_()
        for k in range(len(self.buckets)):
            main = self.buckets[k].dtype in self._main_dtypes
            for p, view in zip(self._members[k], self._grad_views[k]):
                if main:
                    p.grad = None
                elif p.grad is not view:
                    p.grad = view
        for master in self._masters.values():
            master.grad = None
        self._reduced = False
        self._reset_hooks()

    def step(self) -> None:
        """Reduce the gradients (unless done since the last step), Adam on this rank's slices, then
        all-gather the slices into every replica's parameter buffer: one collective per dtype, or with
        overlap_param_gather one per bucket, asynchronous, waited for at the bucket's first use."""
        if not self._reduced:
            self.reduce_gradients()
        for dtype, master in self._masters.items():  # the gradient of a master: an fp32 copy, for the step
            master.grad = torch.cat(
                [self._grad_slice(b.index) for b in self.buckets if b.dtype == dtype]
            ).float()
        for view, grad in self._slices:  # the fp32 slices' gradients: views of the gradient buffer
            view.grad = grad
        self._adam_step()
        with torch.no_grad():
            for dtype, master in self._masters.items():
                master.grad = None
                for b in self.buckets:
                    if b.dtype == dtype:
                        self._param_slice(b.index).copy_(self._master_slice(b.index))
        for dtype in self._dtypes():
            members = [b for b in self.buckets if b.dtype == dtype]
            if self.overlap_param_gather:
                for b in members:
                    self._gather_async(b.index)
                continue
            mine = torch.cat([self._param_slice(b.index) for b in members])  # a copy: never the output
            self.counts["all_gather"] += 1
            if len(members) == 1:  # the gathered slices are the bucket's buffer
                dist.all_gather_single(
                    self._bucket(self._param_buffers, members[0].index), mine, group=self.group
                )
                continue
            gathered = torch.empty(mine.numel() * self.dp, dtype=dtype, device=mine.device)
            dist.all_gather_single(gathered, mine, group=self.group)
            per_rank = gathered.view(self.dp, mine.numel())
            with torch.no_grad():
                for b in members:
                    offset = self._where[b.index]
                    into = self._bucket(self._param_buffers, b.index).view(self.dp, b.shard_numel)
                    into.copy_(per_rank[:, offset : offset + b.shard_numel])
        self._reduced = False

    def _gather_async(self, k: int) -> None:
        """All-gather bucket k's updated slices straight into its part of the parameter buffer (the
        parameters' storage), asynchronously; `passes.dp_overlap.dp_param_wait` waits for it at the
        bucket's first use."""
        b = self.buckets[k]
        mine = self._param_slice(k).clone()  # the input may not alias the output
        self.counts["all_gather"] += 1
        self.events.append(("gather_issued", b.unit))
        work = dist.all_gather_single(
            self._bucket(self._param_buffers, k), mine, group=self.group, async_op=True
        )
        dp_overlap.gather_pending(b.unit, lambda: (work.wait(), mine))

    def wait_gathers(self) -> None:
        """Wait for the parameters' gathers still in flight (overlap_param_gather)."""
        dp_overlap.wait_all_gathers()

    def _owned(self, k: int) -> Iterator[tuple[torch.Tensor, int, int, int]]:
        """(param, lo, hi, offset): flat elements lo:hi of param are bucket k's slice on this rank from
        `offset` on."""
        size = self.buckets[k].shard_numel
        start, end, offset = self.dp_rank * size, (self.dp_rank + 1) * size, 0
        for p in self._members[k]:
            lo, hi = max(start, offset), min(end, offset + p.numel())
            if lo < hi:
                yield p, lo - offset, hi - offset, lo - start
            offset += p.numel()

    def fp32_values(self) -> dict[int, tuple[int, int, torch.Tensor]]:
        """id(param) -> (lo, hi, flat fp32 values of its elements lo:hi) as this rank's step leaves them:
        an fp32 parameter whole (after the all-gather: every slice), a 16-bit one's master copy of the
        elements in this rank's slice (views: read them before and after a step)."""
        self.wait_gathers()
        out = {id(p): (0, p.numel(), p.detach().view(-1)) for p in self.params if p.dtype == torch.float32}
        for b in self.buckets:
            if b.dtype in HALF_DTYPES:
                master = self._master_slice(b.index)
                for p, lo, hi, offset in self._owned(b.index):
                    out[id(p)] = (lo, hi, master.detach()[offset : offset + hi - lo])
        return out

    def owned_ranges(self) -> dict[int, tuple[int, int]]:
        """id(param) -> (lo, hi): the flat elements of each parameter in this rank's slices (those whose
        `.grad` holds the replicas' mean after `reduce_gradients`); parameters not listed have none."""
        return {id(p): (lo, hi) for b in self.buckets for p, lo, hi, _ in self._owned(b.index)}

    def held_tensors(self) -> list[torch.Tensor]:
        """The training state this rank holds: the parameter and gradient buffers (every parameter
        and `.grad` a view of them), Adam's state of this rank's slices, the 16-bit slices' fp32
        masters."""
        buffers = [*self._param_buffers.values(), *self._grad_buffers.values(), *self._masters.values()]
        return _held(self.params, self.adam, buffers)

    def note(self) -> str:
        """What the run report says about the optimizer that ran."""
        units = f"{len(self.buckets)} buckets: a layer each, one for the parameters outside the layers"
        if self.overlap_grad_reduce:
            grads = (
                f"gradients reduce-scattered with overlap-grad-reduce (one per bucket, {units}, issued from the "
                "backward as the bucket's gradients are ready, async, last micro-batch only, waited for after "
                "the backward)"
            )
        else:
            grads = "gradients reduce-scattered after the backward (no overlap-grad-reduce)"
        if self.overlap_param_gather:
            gather = (
                "parameters all-gathered with overlap-param-gather (one per bucket after the step, async, each "
                "waited for before its first use in the next forward)"
            )
        else:
            gather = "parameters all-gathered after the step (no overlap-param-gather)"
        return (
            f"optimizer: distributed optimizer (ZeRO-1), Adam state sharded over the {self.dp} data-parallel "
            f"ranks (each updates 1/{self.dp} of the parameters){_mixed_note(self.params)}; parameters "
            "and gradients views of one flat buffer each per dtype, this rank's slice of the parameters "
            f"updated in place; {grads}; {gather}{self._main_note()}; collectives in the checked step: "
            f"{_counts_text(self.counts)}"
        )


def _named_trainable(
    named: Sequence[tuple[str, torch.Tensor]] | None, params: Sequence[torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """(fqn, parameter) of `params`, in their order, named by `named` (a parameter named twice: its
    first name); the wrapping units need the names."""
    assert named is not None, "overlap needs the parameters' names (named=) to find their units"
    names: dict[int, str] = {}
    for fqn, p in named:
        names.setdefault(id(p), fqn)
    return [(names[id(p)], p) for p in params]


HALF_DTYPES = (torch.bfloat16, torch.float16)  # stepped through fp32 master weights


def _held(params: Sequence[torch.Tensor], adam: torch.optim.Optimizer, extra: list[torch.Tensor]) -> list:
    state = [t for st in adam.state.values() for t in st.values() if torch.is_tensor(t)]
    return list(params) + [p.grad for p in params if p.grad is not None] + extra + state


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


def check_same_parameters(named: Sequence[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None) -> None:
    """Check that every rank of `group` (the ranks whose gradients are reduced together) registers the
    same parameters, by name, shape and dtype, in the same order: the optimizers flatten gradients into
    buckets in that order (`DistributedAdam`, `make_buckets`), so a rank that registered them in
    another order would sum other parameters' gradients into each slot without an error. One
    all-gather of an 8-byte digest per rank; on a mismatch the ranks gather their lists (every rank
    sees it, so none waits alone) and all raise.

    named: the rank's (fqn, parameter) pairs, in registration order. group None or of one rank: no
    check.

    Raises:
        RunError: naming the first parameter where a rank's list differs from rank 0's (a defect of
            the rewrite, which must register each rank's parameters alike).
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    entries = [(name, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in named]
    digest = int.from_bytes(hashlib.sha256(repr(entries).encode()).digest()[:7], "little")  # < 2**56
    device = named[0][1].device if named else torch.device("cpu")
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    digests = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(digests, mine, group=group)
    if all(int(d.item()) == digest for d in digests):
        return
    lists: list[Any] = [None] * len(digests)
    dist.all_gather_object(lists, entries, group=group)
    first = lists[0]
    for index, other in enumerate(lists[1:], start=1):
        if other == first:
            continue
        at = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b), min(len(first), len(other)))

        def entry(entries: list, i: int) -> str:
            return f"{entries[i][0]} {list(entries[i][1])} {entries[i][2]}" if i < len(entries) else "nothing"

        ranks = (dist.get_global_rank(group, 0), dist.get_global_rank(group, index))
        raise RunError(
            f"the ranks that reduce their gradients together registered their parameters differently: "
            f"parameter #{at} is {entry(first, at)} on rank {ranks[0]} and {entry(other, at)} on rank "
            f"{ranks[1]} ({len(first)} and {len(other)} parameters); their flat gradient buffers would sum "
            "different parameters' gradients. This is a defect of the rewrite (each rank's graph must register "
            "its parameters alike): please report it with the model file"
        )


def expert_reduce_group(plan: Any, groups: Any) -> dist.ProcessGroup | None:
    """The group expert parallelism's parameters reduce their gradients in: the ranks holding the same
    experts ("edp") when EP is folded over dp x cp, else the dp x cp ranks. groups: `runtime.mesh.RankGroups`."""
    return groups.group("edp") if getattr(plan, "ep_fold", "dp") == "dp" else groups.group("dp_cp")


def check_replicas_alike(
    plan: Any,
    named: Sequence[tuple[str, torch.Tensor]],
    groups: Any,
    expert_names: AbstractSet[str] = frozenset(),
) -> None:
    """`check_same_parameters` over the groups `plan` reduces gradients in: the dp x cp ranks for every
    parameter but expert parallelism's (`expert_names`, whose ranks hold other experts under other
    names), those over `expert_reduce_group`. named: the rank's (fqn, parameter) pairs (a pipeline
    rank's chunks' together); groups: `runtime.mesh.RankGroups`."""
    check_same_parameters([(n, p) for n, p in named if n not in expert_names], groups.group("dp_cp"))
    if expert_names:
        check_same_parameters(
            [(n, p) for n, p in named if n in expert_names], expert_reduce_group(plan, groups)
        )


def build_optimizer(
    distributed: bool,
    params: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    dp: int,
    dp_rank: int,
    plan: Any = None,
    named: Sequence[tuple[str, torch.Tensor]] | None = None,
    units: Sequence[str] = (),
    hook_divisor: int | None = None,
    deferred: set[int] = frozenset(),
    expert: Sequence[torch.Tensor] = (),
    expert_group: dist.ProcessGroup | None = None,
) -> ReplicatedAdam | DistributedAdam:
    """The optimizer a plan runs: `DistributedAdam` when `Plan.distributed_optimizer`, else
    `ReplicatedAdam`; lr 1e-3. plan (optional): its overlap_grad_reduce / overlap_param_gather and
    micro-batches, with `named` (the (fqn, parameter) pairs) and `units` (the layers' module paths) to
    make the buckets; hook_divisor / deferred as `_OverlappedReduce` says (and `_MainGrads`, with
    the plan's fp32 main gradients: `main_grads`). expert / expert_group:
    expert parallelism's parameters and their reduction group (`ReplicatedAdam`; InputError with the
    distributed optimizer, which shards every parameter over the dp x cp ranks)."""
    if expert and distributed:
        raise InputError(
            "expert parallelism runs with dp_style ddp; zero1 shards each parameter over the dp x cp ranks, "
            "which the experts' own groups do not; set dp_style: ddp"
        )
    kwargs: dict[str, Any] = dict(hook_divisor=hook_divisor, deferred=deferred, main_grads=main_grads(plan))
    if plan is not None and (plan.overlap_grad_reduce or plan.overlap_param_gather):
        kwargs.update(
            named=named,
            units=units,
            overlap_grad_reduce=plan.overlap_grad_reduce,
            micro_batches=plan.micro_batches,
        )
        if distributed:
            kwargs["overlap_param_gather"] = plan.overlap_param_gather
    if distributed:
        return DistributedAdam(params, group, dp, dp_rank, **kwargs)
    return ReplicatedAdam(params, group, dp, expert=expert, expert_group=expert_group, **kwargs)


def state_grad_dtype(plan: Any) -> str | None:
    """The gradients' dtype `costmodels.memory.dp_state_bytes` counts for `plan`'s run: "fp32" with
    fp32 main gradients (`main_grads`), else None (the parameters')."""
    return "fp32" if main_grads(plan) and plan.dtype in ("bf16", "fp16") else None


def main_grads(plan: Any) -> bool:
    """Whether `plan` accumulates and reduces its 16-bit parameters' gradients in fp32
    (`Plan.grad_reduce_dtype` fp32: `_MainGrads`)."""
    return plan is not None and getattr(plan, "grad_reduce_dtype", "param") == "fp32"


def prepare_param_waits(
    plan: Any, modules: Sequence[nn.Module], units: Sequence[str], optimizer: Any
) -> None:
    """overlap_param_gather: insert `passes.dp_overlap.dp_param_wait` before each unit's first use in
    every fx module of `modules` (a rank's graph or its pipeline chunks), and record the waits in the
    optimizer's `events`. Nothing otherwise, but for waiting for any gather an earlier optimizer of
    this process left in flight."""
    dp_overlap.wait_all_gathers()
    dp_overlap.record_events(None)
    if not plan.overlap_param_gather or plan.dp == 1:
        return
    for module in modules:
        if isinstance(module, torch.fx.GraphModule):
            names = [n for n, p in module.named_parameters() if p.requires_grad]
            dp_overlap.insert_param_waits(module, {n: unit_of(n, units) for n in names})
    events = getattr(optimizer, "events", None)
    if events is None and hasattr(optimizer, "parts"):
        events = getattr(optimizer.parts[0], "events", None)
    dp_overlap.record_events(events)


# ------------------------------------------------------------------ ZeRO-2 and FSDP (sharded gradients)


class _BucketAdam(_AdamOnRanks):
    """What ZeRO-2 and FSDP share: per wrapping unit and dtype a bucket (`passes.fsdp.Bucket`) of
    which this rank holds one slice (`_values[k]`); the accumulated mean gradient slices of one dtype
    are one flat buffer, and so are the fp32 masters of 16-bit slices, which Adam steps (one tensor
    per dtype, as the cost model prices a distributed optimizer's step); fp32 slices are stepped in
    place (no copy: the 8 bytes of moments per element are all the state the memory model adds)."""

    buckets: list[Bucket]
    shard_rank: int
    lr: float

    def _build_stores(
        self, slices: Sequence[torch.Tensor], lr: float, shared_values: bool, reduce_fp32: bool = False
    ) -> None:
        """slices[k]: this rank's slice of bucket k (its dtype, `shard_numel` elements). shared_values
        (FSDP): the slices of one dtype are copied into one flat store, which `_values` views (the
        caller re-points its shard parameters there) and Adam steps as one tensor; otherwise (ZeRO-2:
        views of the parameters' flat buckets) they are stepped as they are. reduce_fp32 (the plan's
        fp32 gradients): the 16-bit dtypes' gradient slices are fp32, and the reduce-scatters that fill
        them run in fp32 (`grad_dtype`; torchtitan's FSDP `mixed_precision_reduce` float32)."""
        self._where: dict[int, int] = {}  # bucket -> its offset in its dtype's flat buffers
        self._grads: dict[torch.dtype, torch.Tensor] = {}
        self._masters: dict[torch.dtype, torch.Tensor] = {}
        self._values: list[torch.Tensor] = [torch.empty(0)] * len(self.buckets)
        self._store: list[torch.Tensor] = []
        stepped: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor Adam steps, its gradient)
        for dtype in dict.fromkeys(b.dtype for b in self.buckets):
            members = [(b, s.detach().reshape(-1)) for b, s in zip(self.buckets, slices) if b.dtype == dtype]
            offset = 0
            for b, _ in members:
                self._where[b.index] = offset
                offset += b.shard_numel
            grad_dtype = torch.float32 if reduce_fp32 and dtype in HALF_DTYPES else dtype
            grads = self._grads[dtype] = torch.zeros(offset, dtype=grad_dtype, device=members[0][1].device)
            if shared_values:
                store = torch.cat([v for _, v in members])
                self._store.append(store)
                for b, _ in members:
                    self._values[b.index] = store[self._where[b.index] : self._where[b.index] + b.shard_numel]
            else:
                for b, v in members:
                    self._values[b.index] = v
            if dtype in HALF_DTYPES:  # mixed precision: one fp32 master of the dtype's slices
                master = self._masters[dtype] = torch.cat([self._values[b.index] for b, _ in members]).float()
                stepped.append((master, grads))
            elif shared_values:
                stepped.append((store, grads))
            else:
                stepped += [(self._values[b.index], self.slice_grad(b.index)) for b, _ in members]
        self._stepped = stepped
        self.lr = lr
        self.adam = _adam([t for t, _ in stepped], lr)
        self._reduced = False

    def grad_dtype(self, k: int) -> torch.dtype:
        """The dtype bucket k's gradients are reduced and accumulated in: its gradient slice's."""
        return self._grads[self.buckets[k].dtype].dtype

    def _fp32_note(self) -> str:
        """', gradients reduce-scattered and accumulated in fp32' when the 16-bit ones are ('' else)."""
        fp32 = any(b.dtype in HALF_DTYPES and self.grad_dtype(b.index) == torch.float32 for b in self.buckets)
        return "; the 16-bit parameters' gradients reduce-scattered and accumulated in fp32" if fp32 else ""

    def slice_values(self, k: int) -> torch.Tensor:
        return self._values[k]

    def slice_grad(self, k: int) -> torch.Tensor:
        b = self.buckets[k]
        return self._grads[b.dtype][self._where[k] : self._where[k] + b.shard_numel]

    def _slice_master(self, k: int) -> torch.Tensor:
        b = self.buckets[k]
        master = self._masters.get(b.dtype)
        return self._values[k] if master is None else master[self._where[k] : self._where[k] + b.shard_numel]

    def _step_slices(self) -> None:
        """Adam on the slices (gradients: the accumulated mean slices), 16-bit values from their masters."""
        for tensor, grad in self._stepped:
            tensor.grad = grad.float() if grad.dtype != tensor.dtype else grad
        self._adam_step()
        with torch.no_grad():
            for b in self.buckets:
                if b.dtype in self._masters:
                    self._values[b.index].copy_(self._slice_master(b.index))

    def zero_grad(self) -> None:
        for grads in self._grads.values():
            grads.zero_()
        for tensor, _ in self._stepped:
            tensor.grad = None
        for p in self.params:
            p.grad = None
        self._reduced = False

    def owned_ranges(self) -> dict[int, tuple[int, int]]:
        """Nothing is compared through the parameters' `.grad` (the full gradients are not kept):
        `gradient_segments` holds the mean gradients."""
        return {}

    def gradient_segments(self) -> dict[str, list[tuple[int, int, torch.Tensor]]]:
        """FQN -> [(lo, hi, the mean gradient of flat elements lo:hi of the local parameter)] for the
        elements in this rank's slices (after `reduce_gradients`)."""
        out: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
        for b in self.buckets:
            grad = self.slice_grad(b.index)
            for p, lo, hi, at in b.owned(self.shard_rank):
                out.setdefault(p.fqn, []).append((lo, hi, grad[at : at + hi - lo]))
        return out

    def _master_segments(self) -> dict[str, tuple[int, int, torch.Tensor]]:
        out = {}
        for b in self.buckets:
            master = self._slice_master(b.index)
            for p, lo, hi, at in b.owned(self.shard_rank):
                out[p.fqn] = (lo, hi, master[at : at + hi - lo])
        return out

    def held_tensors(self) -> list[torch.Tensor]:
        """The training state this rank holds (parameters, gradients, Adam state and masters)."""
        return _held(self.params, self.adam, [*self._grads.values(), *self._masters.values(), *self._store])


class Zero2Adam(_BucketAdam):
    """ZeRO-2: the gradients sharded too. Every rank holds the (TP-shard) parameters whole; each wrapping
    unit's gradients (`passes.fsdp.make_buckets`: a layer, or the parameters outside the layers, per
    dtype) are reduce-scattered over the dp group as soon as the unit's last gradient is accumulated in
    each micro-batch's backward (`register_post_accumulate_grad_hook`), the rank keeping only its mean
    slice (accumulated over micro-batches) and the full-size `.grad` freed; at the end of each backward
    a unit some of whose parameters got no gradient is reduced with zeros for them. With
    overlap_grad_reduce each reduce-scatter is asynchronous (one in flight, waited for when the next is
    issued and at the end of the backward); without, each is waited for right after it is issued. The
    step: Adam on the slices (fp32 masters for 16-bit), then one all-gather per dtype of the updated
    slices into every rank's parameters, or with overlap_param_gather one asynchronous all-gather per
    unit, waited for before the unit's first use in the next forward (`passes.dp_overlap`). Priced as
    m x units reduce-scatters and the all-gather(s) of the gradient bytes
    (`planner.solver.costing.dp_sync_parts`).

    module: the rank module; units: the layers' module paths; group / dp / dp_rank: the dp group."""

    def __init__(
        self, module: nn.Module, units: Sequence[str], group: dist.ProcessGroup, dp: int, dp_rank: int,
        lr: float = 1e-3, *, overlap_grad_reduce: bool = True, overlap_param_gather: bool = False,
        main_grads: bool = False,
    ):  # fmt: skip
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.group, self.dp, self.shard_rank = group, dp, dp_rank
        self.divisor = dp  # the mean's divisor (`mean`)
        self.buckets = make_buckets(named, units, dp)
        self._members = [[dict(named)[p.fqn] for p in b.params] for b in self.buckets]
        # each unit's parameters become views of one flat (padded) buffer, so that this rank's slice
        # is a view too: Adam steps it in place and the all-gather writes the buffer
        self._flats = []
        for b, members in zip(self.buckets, self._members):
            flat = DistributedAdam._flat([p.detach() for p in members], b.padded_numel)
            for p, fp in zip(members, b.params):
                p.data = flat[fp.offset : fp.offset + fp.numel].view(fp.shape)
            self._flats.append(flat)
        slices = [
            flat[dp_rank * b.shard_numel : (dp_rank + 1) * b.shard_numel]
            for b, flat in zip(self.buckets, self._flats)
        ]
        self._build_stores(slices, lr, shared_values=False, reduce_fp32=main_grads)
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._scatters: deque[tuple[int, torch.Tensor, torch.Tensor, Any]] = deque()
        self._end_queued = False
        self.counts: Counter[str] = Counter()
        # most bytes of unsharded gradients and reduce buffers alive at once, measured in the first
        # (checked) step only: the count walks every parameter, which the timed steps need not pay
        self.peak_grad_bytes = 0
        self._measure_peak = True
        self.events: list[tuple[str, str]] = []  # (event, unit) in order, as `_OverlappedReduce.events`
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather and dp > 1
        for b, members in zip(self.buckets, self._members):
            for p in members:
                p.register_post_accumulate_grad_hook(self._hook(b.index))

    def _hook(self, k: int) -> Callable[[torch.Tensor], None]:
        def ready(p: torch.Tensor) -> None:
            if not self._end_queued:  # the backward's end reduces any unit left incomplete
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
                self._end_queued = True
            if not self._ready[k]:
                self.events.append(("grad_hook", self.buckets[k].unit))
            self._ready[k].add(id(p))
            if len(self._ready[k]) == len(self._members[k]):
                self._reduce(k)

        return ready

    def _end_of_backward(self) -> None:
        self._end_queued = False
        for k, ready in enumerate(self._ready):
            if ready:
                self._reduce(k)

    def _reduce(self, k: int) -> None:
        b, members = self.buckets[k], self._members[k]
        flat = DistributedAdam._flat(  # fp32 gradients: the unit's reduce-scatter in fp32
            [p.grad if p.grad is not None else torch.zeros_like(p) for p in members],
            b.padded_numel,
            self.grad_dtype(k),
        )
        if self._measure_peak:
            # the unsharded gradients held now (every parameter's `.grad` not yet reduced), this unit's
            # flat buffer and those still in flight: `costmodels.memory.zero2_unit_bytes` prices the peak
            in_flight = [t for _, out, buf, _ in self._scatters for t in (out, buf)]
            held = state_bytes([p.grad for p in self.params if p.grad is not None] + [flat] + in_flight)
            self.peak_grad_bytes = max(self.peak_grad_bytes, held)
        for p in members:
            p.grad = None  # only this rank's slice is kept
        self._ready[k].clear()
        out = torch.empty(b.shard_numel, dtype=flat.dtype, device=flat.device)
        self.counts["reduce_scatter"] += 1
        self.events.append(("reduce_issued", b.unit))
        work = dist.reduce_scatter_single(out, flat, group=self.group, async_op=True) if self.dp > 1 else None
        if work is None:
            out.copy_(flat)
        self._scatters.append((k, out, flat, work))
        self._wait(keep=1 if self.overlap_grad_reduce else 0)

    def _wait(self, keep: int) -> None:
        while len(self._scatters) > keep:
            k, out, _, work = self._scatters.popleft()
            if work is not None:
                work.wait()
            self.events.append(("reduce_wait", self.buckets[k].unit))
            self.slice_grad(k).add_(self.mean(out))

    def mean(self, total: torch.Tensor) -> torch.Tensor:
        """The mean over the dp ranks of `total`, their sum (in place); divided by `divisor` (dp, or
        dp x micro-batches in a pipeline, whose schedule cannot scale a gradient it never holds)."""
        return total.div_(self.divisor)

    def reduce_gradients(self) -> None:
        """Wait for the reduce-scatters in flight: every slice holds the mean gradient of the step."""
        self._wait(keep=0)
        self._reduced = True

    def step(self) -> None:
        """Adam on the slices, then one all-gather per dtype of the updated slices into the parameters."""
        if not self._reduced:
            self.reduce_gradients()
        self._measure_peak = False  # `peak_grad_bytes` is the first step's
        self._step_slices()
        for dtype in dict.fromkeys(b.dtype for b in self.buckets):
            members = [b for b in self.buckets if b.dtype == dtype]
            if self.overlap_param_gather:
                for b in members:
                    self._gather_async(b.index)
                continue
            mine = torch.cat([self._values[b.index] for b in members])  # the updated slices, one buffer
            gathered = torch.empty(mine.numel() * self.dp, dtype=dtype, device=mine.device)
            self.counts["all_gather"] += 1
            if self.dp > 1:
                dist.all_gather_single(gathered, mine, group=self.group)
            else:
                gathered.copy_(mine)
            per_rank = gathered.view(self.dp, mine.numel())
            with torch.no_grad():
                for b in members:
                    offset = self._where[b.index]
                    self._flats[b.index].copy_(per_rank[:, offset : offset + b.shard_numel].reshape(-1))
        self._reduced = False

    def _gather_async(self, k: int) -> None:
        """All-gather unit k's updated slices straight into its flat buffer (the parameters' storage),
        asynchronously; `passes.dp_overlap.dp_param_wait` waits for it at the unit's first use."""
        b = self.buckets[k]
        mine = self._values[k].detach().clone()  # the input may not alias the output
        self.counts["all_gather"] += 1
        self.events.append(("gather_issued", b.unit))
        work = dist.all_gather_single(self._flats[k], mine, group=self.group, async_op=True)
        dp_overlap.gather_pending(b.unit, lambda: (work.wait(), mine))

    def wait_gathers(self) -> None:
        """Wait for the parameters' gathers still in flight (overlap_param_gather)."""
        dp_overlap.wait_all_gathers()

    def zero_grad(self) -> None:
        super().zero_grad()
        self.events.clear()

    def fp32_values_by_name(self) -> dict[str, tuple[int, int, torch.Tensor]]:
        """FQN -> (lo, hi, flat fp32 values of elements lo:hi) as the step leaves them: an fp32
        parameter whole (after the all-gather), a 16-bit one's master copy of this rank's slice."""
        self.wait_gathers()
        out = self._master_segments()
        named = {p.fqn: m for b, ms in zip(self.buckets, self._members) for p, m in zip(b.params, ms)}
        for fqn, p in named.items():
            if p.dtype == torch.float32:
                out[fqn] = (0, p.numel(), p.detach().view(-1))
            elif p.dtype not in HALF_DTYPES:
                out.pop(fqn, None)
        return out

    @property
    def local_module(self) -> None:
        return None  # the rank module itself holds the parameters at their FQNs

    def note(self) -> str:
        scatter = (
            "(async, overlap-grad-reduce)"
            if self.overlap_grad_reduce
            else "(each waited for at once: no overlap-grad-reduce)"
        )
        gather = (
            "updated slices all-gathered per unit after the step (async, overlap-param-gather: each waited for "
            "before the unit's first use in the next forward)"
            if self.overlap_param_gather
            else "updated slices all-gathered into the parameters after the step (no overlap-param-gather)"
        )
        return (
            f"optimizer: ZeRO-2, gradients and Adam state sharded over the {self.dp} data-parallel ranks"
            f"{_mixed_note(self.params)}; each unit's gradients ({len(self.buckets)} units: a layer each, one "
            f"for the parameters outside the layers) reduce-scattered as the backward finishes them {scatter}, "
            f"the full gradients freed; {gather}{self._fp32_note()}; collectives in the checked step: "
            f"{_counts_text(self.counts)}"
        )


class FsdpAdam(_BucketAdam):
    """FSDP (ZeRO-3) and HSDP: Adam on the flat parameter shards of an `passes.fsdp.apply_fsdp`
    module, with the `passes.fsdp.FsdpRuntime` that gathers them (prefetched, resharded after forward
    when the plan says so) and reduce-scatters their gradients (async, waited in `reduce_gradients`).
    The shards of one dtype are made views of one flat store (`_BucketAdam`), which Adam steps
    (through an fp32 master for 16-bit parameters); there is no gather after the step: the next
    forward gathers the updated shards.

    module: the rewritten rank module (its `gm.meta["fsdp"]` layout); shard_group / replicate_group:
    HSDP's groups (`runtime.mesh.RankGroups`), dp: all data-parallel ranks (the mean's divisor)."""

    def __init__(
        self,
        module: nn.Module,
        shard_group: dist.ProcessGroup | None,
        replicate_group: dist.ProcessGroup | None,
        dp: int,
        reshard_after_forward: bool = True,
        lr: float = 1e-3,
        main_grads: bool = False,
    ):
        layout = fsdp_layout(module)
        assert layout is not None, "FsdpAdam needs a module rewritten by passes.fsdp.apply_fsdp"
        self.layout, self.dp, self.shard_rank = layout, dp, layout.shard_rank
        self.buckets = layout.buckets
        shards = [module.get_parameter(layout.shard_name(b.index)) for b in self.buckets]
        self.params = shards
        self._build_stores(shards, lr, shared_values=True, reduce_fp32=main_grads)
        for b, shard in zip(self.buckets, shards):  # the shards live in the flat stores from now on
            shard.data = self.slice_values(b.index)
        self.runtime = FsdpRuntime(
            layout, shards, [self.slice_grad(b.index) for b in self.buckets], shard_group, replicate_group,
            dp, reshard_after_forward,
        )  # fmt: skip
        self.runtime.attach(module)
        self.counts = self.runtime.counts
        self.replicas = dp // layout.shard_size

    def reduce_gradients(self) -> None:
        """Wait for the gradients' reduce-scatters (and HSDP's all-reduces): every shard's gradient is
        the mean over the dp ranks."""
        self.runtime.finish()
        self._reduced = True

    def step(self) -> None:
        if not self._reduced:
            self.reduce_gradients()
        self._step_slices()
        self._reduced = False

    def fp32_values_by_name(self) -> dict[str, tuple[int, int, torch.Tensor]]:
        """FQN -> (lo, hi, flat fp32 values of elements lo:hi of the local parameter) in this rank's
        shard: the shard itself (fp32) or its master copy (16-bit)."""
        return self._master_segments()

    @property
    def local_module(self) -> nn.Module:
        """Meta stand-in with the replaced parameters at their FQNs and local shapes (the checks read
        the reference's shards through it)."""
        return self.layout.local_module()

    def note(self) -> str:
        shard = self.layout.shard_size
        gathered = (
            "each unit gathered before its forward and again before its backward (resharded after forward)"
            if self.runtime.reshard_after_forward
            else "each unit gathered once before its forward and kept to its backward (no reshard after forward)"
        )
        hsdp = (
            f" (HSDP: {self.replicas} replicas of each shard, gradient shards all-reduced across them)"
            if self.replicas > 1
            else ""
        )
        largest = max(b.padded_numel * b.dtype.itemsize for b in self.buckets)
        return (
            f"optimizer: fsdp, parameters, gradients and Adam state sharded over {shard} ranks{hsdp}"
            f"{_mixed_note(self.params)}; {len(self.buckets)} units (a layer each, one for the parameters "
            f"outside the layers), {gathered}, the next unit's gather prefetched (async), gradients "
            f"reduce-scattered as each unit's backward ends (async, waited before the step){self._fp32_note()}; collectives "
            f"in the checked step: {_counts_text(self.counts)}; at most "
            f"{self.runtime.peak_gathered_bytes / 2**10:.1f} KiB of gathered parameters alive at once "
            f"(largest unit {largest / 2**10:.1f} KiB)"
        )


class ChunkedShardedAdam:
    """ZeRO-2 or FSDP on a pipeline rank: one `Zero2Adam` / `FsdpAdam` per model chunk the rank holds
    (`parts`, of `modules`; with the interleaved schedule several, each chunk's wrapping units its
    own: its layers, and the parameters outside the layers it holds as one more unit), run together.
    The pipeline schedule scales the parameters' `.grad` by 1 / micro-batches, but sharded gradients
    are never a `.grad`: each part divides its reduced sums by dp x `micro_batches` instead.
    Exposes what the checks and the report read (`gradient_segments`, `fp32_values_by_name`,
    `local_module`: one meta stand-in with every chunk's parameters at their FQNs)."""

    def __init__(
        self, parts: Sequence[Zero2Adam | FsdpAdam], modules: Sequence[nn.Module], micro_batches: int
    ):
        from passes.fsdp import FsdpLayout, _bias_owners  # noqa: PLC0415

        self.parts = list(parts)
        for part in self.parts:
            target = part.runtime if isinstance(part, FsdpAdam) else part
            target.divisor = part.dp * micro_batches
        self.lr = self.parts[0].lr
        buckets = [b for part in self.parts for b in part.buckets]
        owners: dict[str, str] = {}
        for module in modules:
            layout = fsdp_layout(module)
            owners.update(layout.bias_owners if layout is not None else _bias_owners(module))
        self._local = FsdpLayout(buckets, 1, 0, [], owners).local_module()
        self.style = "fsdp" if isinstance(self.parts[0], FsdpAdam) else "zero2"

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def reduce_gradients(self) -> None:
        for part in self.parts:
            part.reduce_gradients()

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def owned_ranges(self) -> dict[int, tuple[int, int]]:
        return {}  # no full `.grad` is kept: `gradient_segments` holds the mean gradients

    def gradient_segments(self) -> dict[str, list[tuple[int, int, torch.Tensor]]]:
        return {n: v for part in self.parts for n, v in part.gradient_segments().items()}

    def fp32_values_by_name(self) -> dict[str, tuple[int, int, torch.Tensor]]:
        return {n: v for part in self.parts for n, v in part.fp32_values_by_name().items()}

    @property
    def local_module(self) -> nn.Module:
        return self._local

    @property
    def counts(self) -> Counter[str]:
        return sum((Counter(part.counts) for part in self.parts), Counter())

    @property
    def peak_gathered_bytes(self) -> int | None:
        peaks = [part.runtime.peak_gathered_bytes for part in self.parts if isinstance(part, FsdpAdam)]
        return sum(peaks) if peaks else None

    def state_params(self) -> int:
        """Parameters this rank holds, at their local (TP-shard) sizes: `dp_state_bytes`' count."""
        return sum(b.numel for part in self.parts for b in part.buckets)

    def held_tensors(self) -> list[torch.Tensor]:
        return [t for part in self.parts for t in part.held_tensors()]

    def note(self) -> str:
        if len(self.parts) == 1:
            return self.parts[0].note()
        return (
            f"optimizer: {len(self.parts)} model chunks on this rank, each with its own units: "
            + " | ".join(
                f"chunk {i}: {part.note().removeprefix('optimizer: ')}" for i, part in enumerate(self.parts)
            )
        )


def _counts_text(counts: Mapping[str, int]) -> str:
    names = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce"}
    text = ", ".join(f"{counts[k]} {v}(s)" for k, v in names.items() if counts.get(k)) or "none"
    if counts.get("prefetched"):
        text += f" ({counts['prefetched']} of the all-gathers prefetched one unit ahead)"
    return text


def state_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages under `tensors` (a view counted once, with its whole storage)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def build_plan_optimizer(
    plan: Any, module: nn.Module, groups: Any, units: Sequence[str]
) -> ReplicatedAdam | DistributedAdam | Zero2Adam | FsdpAdam:
    """The optimizer `plan.dp_style` runs on a pp == 1 rank module: ddp `ReplicatedAdam`, zero1
    `DistributedAdam`, zero2 `Zero2Adam` (units: the layers' module paths), fsdp `FsdpAdam` (the module
    rewritten by `passes.fsdp.apply_fsdp`), with the plan's overlap_grad_reduce / overlap_param_gather
    (the latter inserts the waits into `module`: `prepare_param_waits`). groups: the rank's
    `runtime.mesh.RankGroups`. With context parallelism every style spans the dp x cp ranks ("dp_cp",
    `runtime.mesh`): the CP ranks' gradients are partial sums over their tokens, scaled by cp in the
    graph (`passes.cp_lower`), so the mean over dp x cp is the whole batch's gradient."""
    named = list(module.named_parameters())
    experts = set(getattr(module, "meta", {}).get("ep_params", ())) if getattr(plan, "ep", 1) > 1 else set()
    check_replicas_alike(plan, named, groups, experts)
    style = DataParallel(plan.dp_style)
    if style is DataParallel.FSDP:
        return FsdpAdam(
            module,
            groups.group("dp_shard"),
            groups.group("dp_replicate"),
            plan.mesh.dp_cp,
            plan.reshard_after_forward,
            main_grads=main_grads(plan),
        )
    if style is DataParallel.ZERO2:
        optimizer = Zero2Adam(
            module, units, groups.group("dp_cp"), plan.mesh.dp_cp, groups.dp_cp_rank,
            overlap_grad_reduce=plan.overlap_grad_reduce, overlap_param_gather=plan.overlap_param_gather,
            main_grads=main_grads(plan),
        )  # fmt: skip
    elif getattr(plan, "ep", 1) > 1:
        if style is not DataParallel.DDP:
            raise InputError(
                f"expert parallelism (ep={plan.ep}) runs with dp_style ddp; {style} keeps one shard of each "
                "parameter per data-parallel rank, which the experts' own groups do not; set dp_style: ddp"
            )
        optimizer = ReplicatedAdam(
            [p for _, p in named], groups.group("dp_cp"), plan.mesh.dp_cp, named=named, units=units,
            overlap_grad_reduce=plan.overlap_grad_reduce, micro_batches=plan.micro_batches,
            expert=[p for n, p in named if n in experts], expert_group=expert_reduce_group(plan, groups),
            main_grads=main_grads(plan),
        )  # fmt: skip
    else:
        optimizer = build_optimizer(
            plan.distributed_optimizer, list(module.parameters()), groups.group("dp_cp"), plan.mesh.dp_cp,
            groups.dp_cp_rank, plan, named, units,
        )  # fmt: skip
    prepare_param_waits(plan, [module], units, optimizer)
    return optimizer

"""Fully sharded data parallelism (ZeRO-3, FSDP2's semantics) on a lowered rank graph.

    apply_fsdp(gm, units, shard_size, shard_rank) -> FsdpLayout    (graph rewrite, no process group)
    load_fsdp_weights(gm, layout, checkpoint, splits, tp_rank, tp)  (this rank's flat shards only)
    FsdpRuntime(layout, shards, ...).attach(gm)                     (prefetch, reshard, reduce-scatter)

Why a graph rewrite and not torch's `fully_shard`: a rank module is a flat fx GraphModule whose
generated `forward` reads every parameter with `get_attr` and never calls the layers as modules (the
submodules only hold the tensors), so `fully_shard`'s forward pre/post hooks on a layer never fire:
its parameters stay sharded DTensors and the first op fails ("mixed torch.Tensor and DTensor";
checked on torch 2.13). So, as torchtitan's SimpleFSDP does, the gathers are in the graph: each
wrapping unit's parameters (a layer: the parameters under its module path, `Layer.module_path`; the
parameters outside the layers - embedding, final norm, LM head - are one more unit; one bucket per
unit and dtype) become one flat 1-D shard parameter `fsdp_shard_<k>` (the unit's flat parameters,
zero-padded to a multiple of `shard_size`, rank r holding elements r * n : (r + 1) * n), and the
`get_attr` nodes of its parameters are replaced by `fsdp_gather(shard, k, shapes, "dp_shard")`,
inserted right before the unit's first use, whose outputs are the full parameters (views of one
gathered buffer). Buckets are numbered in forward order (first use in the graph); the backward
order is their last use, latest first.

`fsdp_gather`'s autograd Function all-gathers the bucket over the shard group in forward and, in
backward, reduce-scatters the bucket's gradient (when autograd has summed every use of the unit's
parameters, i.e. as the unit's backward ends). Bound to a `FsdpRuntime` (the training runtime,
`runtime.data_parallel.FsdpAdam`), it runs as FSDP2 does by default:

- prefetch: gathering bucket k issues bucket k + 1's gather at once (`async_op=True`), waited when
  its first use comes; in backward the same one bucket ahead in backward order;
- reshard after forward: a `torch.autograd.graph.saved_tensors_hooks` pair (entered around the
  module's forward) packs a saved tensor that is a view of a gathered buffer as a handle (bucket,
  size, stride, offset) instead of the tensor, so autograd does not keep the gathered weights: the
  buffer is freed after the unit's last use in forward, and the first unpack in backward gathers
  the bucket again (kept until the bucket's reduce-scatter is issued). Without it, autograd keeps
  every unit's gathered parameters until the backward;
- the reduce-scatters are issued asynchronously, one waited when the next is issued (one unit's
  unsharded gradients in flight) and the rest in `finish()`, before the optimizer step; HSDP then
  all-reduces each gradient shard over the replicate group; the sum over all dp ranks divided by dp
  is accumulated into the runtime's gradient shard of the bucket (so micro-batches accumulate).

Unbound (a generated module run in a user's program, `passes.emit`), `fsdp_gather` gathers
synchronously over the registered "dp_shard" axis and its backward reduce-scatters into the shard
parameter's `.grad` (the mean over the shard axis, all-reduced over a registered "dp_replicate" axis).
"""

from __future__ import annotations

import math
import operator
import weakref
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from passes import collectives

SHARD_AXIS = "dp_shard"  # the mesh axis a shard is split over (passes.collectives.register_group)
REPLICATE_AXIS = "dp_replicate"  # HSDP: the ranks holding the same shard
SHARD_ATTR = "fsdp_shard_"  # the flat shard parameters: fsdp_shard_0, fsdp_shard_1, ... (forward order)
META_KEY = "fsdp"  # GraphModule.meta key of the FsdpLayout


@dataclass(frozen=True)
class FlatParam:
    """One parameter of a bucket: its FQN, local (TP-shard) shape and first element in the bucket."""

    fqn: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    """A wrapping unit's parameters of one dtype, flattened in order and zero-padded to a multiple of
    `shard_size`; rank r of the shard group holds elements r * shard_numel : (r + 1) * shard_numel."""

    index: int
    unit: str  # module path of the layer; "" for the parameters outside the layers
    dtype: torch.dtype
    params: tuple[FlatParam, ...]
    shard_size: int

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.shard_size)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.shard_size

    @property
    def name(self) -> str:
        return self.unit or "outside the layers"

    def owned(self, shard_rank: int) -> list[tuple[FlatParam, int, int, int]]:
        """(param, lo, hi, at): flat elements lo:hi of param are elements at : at + hi - lo of shard
        `shard_rank`; parameters without an element in the shard are left out."""
        start, end = shard_rank * self.shard_numel, (shard_rank + 1) * self.shard_numel
        out = []
        for p in self.params:
            lo, hi = max(start, p.offset), min(end, p.offset + p.numel)
            if lo < hi:
                out.append((p, lo - p.offset, hi - p.offset, lo - start))
        return out


def unit_of(fqn: str, units: Sequence[str]) -> str:
    """The unit of parameter `fqn`: the longest module path of `units` it lies under, else ""."""
    found = [u for u in units if u and fqn.startswith(u + ".")]
    return max(found, key=len) if found else ""


def make_buckets(
    named: Iterable[tuple[str, torch.Tensor]], units: Sequence[str], shard_size: int
) -> list[Bucket]:
    """One bucket per (unit, dtype) of the parameters `named` ((fqn, tensor), in the order given),
    buckets in the order their first parameter comes."""
    groups: dict[tuple[str, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for fqn, t in named:
        groups.setdefault((unit_of(fqn, units), t.dtype), []).append((fqn, t))
    buckets = []
    for index, ((unit, dtype), members) in enumerate(groups.items()):
        params, offset = [], 0
        for fqn, t in members:
            params.append(FlatParam(fqn, tuple(t.shape), offset))
            offset += t.numel()
        buckets.append(Bucket(index, unit, dtype, tuple(params), shard_size))
    return buckets


@dataclass
class FsdpLayout:
    """What `apply_fsdp` did to a rank graph: its buckets (index = forward order), the shard group's
    size and this rank's place in it, the backward order, and the local (TP-shard) parameters it
    replaced (to read their shards of a checkpoint or of the reference's gradients)."""

    buckets: list[Bucket]
    shard_size: int
    shard_rank: int
    backward_order: list[int]
    # linear(weight, bias) pairs of the graph before the rewrite: a colwise weight's bias is sliced like it
    bias_owners: dict[str, str] = field(default_factory=dict)
    # the expert weights' slices (`passes.ep_lower`'s gm.meta["ep_shards"]: this rank's experts, each
    # split over TP as its fused gate-and-up parts say), which reading a replaced parameter needs
    ep_shards: dict[str, tuple] = field(default_factory=dict)

    def shard_name(self, index: int) -> str:
        return f"{SHARD_ATTR}{index}"

    def local_module(self) -> fx.GraphModule:
        """A meta-device stand-in holding the replaced parameters under their FQNs at their local
        shapes and dtypes (with the linear nodes that pair biases with weights), for
        `passes.tensor_parallel.read_local_shards`."""
        root = nn.Module()
        graph = fx.Graph()
        nodes = {}
        for b in self.buckets:
            for p in b.params:
                _set_param(root, p.fqn, nn.Parameter(torch.empty(p.shape, dtype=b.dtype, device="meta")))
                nodes[p.fqn] = graph.get_attr(p.fqn)
        x = graph.placeholder("x")
        for bias, weight in self.bias_owners.items():
            if bias in nodes and weight in nodes:
                graph.call_function(torch.ops.aten.linear.default, (x, nodes[weight], nodes[bias]))
        graph.output(None)
        local = fx.GraphModule(root, graph)
        local.meta["ep_shards"] = dict(self.ep_shards)
        return local

    def summary(self) -> dict[str, Any]:
        """Plain data for an emitted module's meta.json."""
        return {
            "shard_size": self.shard_size,
            "shard_rank": self.shard_rank,
            "buckets": [
                {"shard": self.shard_name(b.index), "unit": b.unit, "dtype": str(b.dtype).removeprefix("torch."),
                 "numel": b.numel, "shard_numel": b.shard_numel,
                 "params": [[p.fqn, list(p.shape), p.offset] for p in b.params]}
                for b in self.buckets
            ],
        }  # fmt: skip


def _set_param(root: nn.Module, fqn: str, value: nn.Parameter) -> None:
    owner = root
    *path, leaf = fqn.split(".")
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    owner.register_parameter(leaf, value)


def _bias_owners(gm: fx.GraphModule) -> dict[str, str]:
    aten = torch.ops.aten
    owners = {}
    for node in gm.graph.nodes:
        op = getattr(node.target, "overloadpacket", node.target)
        if node.op != "call_function" or op not in (aten.linear, aten.addmm):
            continue
        w, b = node.args[1], node.args[2] if len(node.args) > 2 else None
        if op is aten.addmm:
            b, w = node.args[0], node.args[2]
        if isinstance(w, fx.Node) and isinstance(b, fx.Node) and w.op == b.op == "get_attr":
            owners[str(b.target)] = str(w.target)
    return owners


def apply_fsdp(gm: fx.GraphModule, units: Sequence[str], shard_size: int, shard_rank: int) -> FsdpLayout:
    """Shard `gm`'s trainable parameters by wrapping unit (module docstring), in place: each bucket's
    parameters become one flat shard parameter of `ceil(n / shard_size)` elements (this rank's,
    `shard_rank`), gathered by `fsdp_gather` right before the bucket's first use. units: the layers'
    module paths (`ModelStructure.layers[i].module_path`). On the meta device the shards are meta
    too (fill them with `load_fsdp_weights`); real parameters are cut into this rank's shard. The
    layout is also put in `gm.meta["fsdp"]`. Frozen parameters and buffers stay as they are."""
    if shard_size < 1 or not 0 <= shard_rank < shard_size:
        raise ValueError(f"shard rank {shard_rank} of {shard_size} is not a rank of the shard group")
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    params = dict(gm.named_parameters())
    getters = {str(n.target): n for n in nodes if n.op == "get_attr" and str(n.target) in params}
    used = [(fqn, params[fqn]) for fqn, node in getters.items() if params[fqn].requires_grad and node.users]
    first = {fqn: min(position[u] for u in getters[fqn].users) for fqn, _ in used}
    last = {fqn: max(position[u] for u in getters[fqn].users) for fqn, _ in used}
    owners = _bias_owners(gm)
    raw = make_buckets(sorted(used, key=lambda item: first[item[0]]), units, shard_size)
    order = sorted(raw, key=lambda b: min(first[p.fqn] for p in b.params))
    buckets = [Bucket(i, b.unit, b.dtype, b.params, shard_size) for i, b in enumerate(order)]
    backward = sorted(buckets, key=lambda b: -max(last[p.fqn] for p in b.params))
    layout = FsdpLayout(
        buckets,
        shard_size,
        shard_rank,
        [b.index for b in backward],
        owners,
        dict(gm.meta.get("ep_shards", {})),
    )
    for b in buckets:
        tensors = [params[p.fqn] for p in b.params]
        device = tensors[0].device
        if device.type == "meta":
            shard = torch.empty(b.shard_numel, dtype=b.dtype, device="meta")
        else:
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            flat = nn.functional.pad(flat, (0, b.padded_numel - b.numel))
            shard = flat[shard_rank * b.shard_numel : (shard_rank + 1) * b.shard_numel].clone()
        gm.register_parameter(layout.shard_name(b.index), nn.Parameter(shard))
        user = min((u for p in b.params for u in getters[p.fqn].users), key=position.__getitem__)
        with gm.graph.inserting_before(user):
            shard_node = gm.graph.get_attr(layout.shard_name(b.index))
            gather = gm.graph.call_function(
                fsdp_gather, (shard_node, b.index, [list(p.shape) for p in b.params], SHARD_AXIS)
            )
            gather.meta["module_path"] = getters[b.params[0].fqn].meta.get("module_path", "")
            vals = [getters[p.fqn].meta.get("val") for p in b.params]
            if all(isinstance(v, torch.Tensor) for v in vals):  # a multi-output node: the parameters'
                gather.meta["val"] = tuple(vals)  # (what `passes.pipeline.requires_grad_nodes` follows)
            for j, p in enumerate(b.params):
                old = getters[p.fqn]
                item = gm.graph.call_function(operator.getitem, (gather, j))
                item.meta.update(old.meta)
                old.replace_all_uses_with(item)
    # the replaced get_attrs and their parameters go (a parameter no node reads any more is dropped)
    for fqn, _ in used:
        gm.graph.erase_node(getters[fqn])
        owner_path, _, leaf = fqn.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        del owner._parameters[leaf]
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    gm.meta[META_KEY] = layout
    return layout


def fsdp_layout(gm: nn.Module) -> FsdpLayout | None:
    """The layout `apply_fsdp` left on `gm`, or None for a module it did not shard."""
    meta = getattr(gm, "meta", None)
    return meta.get(META_KEY) if isinstance(meta, dict) else None


def load_fsdp_weights(
    gm: fx.GraphModule,
    layout: FsdpLayout,
    checkpoint: str | Sequence[str] | Mapping[str, torch.Tensor],
    splits: Mapping[str, Any],
    tp_rank: int,
    tp_size: int,
) -> fx.GraphModule:
    """Fill an `apply_fsdp`-rewritten `gm` (on meta) with this rank's flat shards and its buffers.
    Each replaced parameter's TP shard is read by itself (`read_local_shards`, slice by slice from
    safetensors), the elements of this rank's DP shard copied out and the rest freed before the next
    one: the rank holds its shards and at most one TP-shard parameter at a time."""
    from passes.checkpoint import SafetensorsCheckpoint, checkpoint_files  # noqa: PLC0415
    from passes.tensor_parallel import read_local_shards  # noqa: PLC0415

    source: Any = checkpoint
    opened = None
    if isinstance(checkpoint, (str, list, tuple)):
        files = checkpoint_files(checkpoint) if isinstance(checkpoint, str) else list(checkpoint)
        source = opened = SafetensorsCheckpoint(files)
    try:
        names = [n for n, _ in gm.named_buffers()]
        names += [n for n, p in gm.named_parameters() if not n.startswith(SHARD_ATTR)]
        for name, value in read_local_shards(gm, source, splits, tp_rank, tp_size, names).items():
            owner_path, _, leaf = name.rpartition(".")
            owner = gm.get_submodule(owner_path) if owner_path else gm
            if leaf in owner._parameters:
                old = owner._parameters[leaf]
                owner._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)
            else:
                owner._buffers[leaf] = value
        local = layout.local_module()
        for b in layout.buckets:
            shard = torch.zeros(b.shard_numel, dtype=b.dtype)
            for p, lo, hi, at in b.owned(layout.shard_rank):
                value = read_local_shards(local, source, splits, tp_rank, tp_size, [p.fqn])[p.fqn]
                shard[at : at + hi - lo] = value.reshape(-1)[lo:hi]
                del value
            gm.register_parameter(layout.shard_name(b.index), nn.Parameter(shard))
    finally:
        if opened is not None:
            opened.close()
    return gm


# --------------------------------------------------------------------------------------------------
# the graph's gather and its runtime


def _views(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> tuple[torch.Tensor, ...]:
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset : offset + n].view(tuple(shape)))  # view(()) for a 0-dim parameter
        offset += n
    return tuple(out)


class _Split(torch.autograd.Function):
    """A gathered flat buffer as its parameters' views; backward: their gradients concatenated into
    one flat gradient (zeros for the padding and for a parameter no gradient reached), one pass over
    the buffer. Autograd's own backward of P slice-views allocates a zero-filled buffer-sized gradient
    per view and sums them: P passes over the buffer, measured 461 ms against 76 ms for a 47 MB layer
    of 9 parameters on the 2-core dev VM, which made an FSDP training step ~3x slower than priced."""

    @staticmethod
    def forward(
        ctx: Any, flat: torch.Tensor, shapes: tuple[tuple[int, ...], ...]
    ) -> tuple[torch.Tensor, ...]:
        ctx.shapes, ctx.numel = shapes, flat.numel()
        return _views(flat, shapes)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        like = next(g for g in grads if g is not None)
        parts = [
            g.reshape(-1) if g is not None else like.new_zeros(math.prod(shape))
            for g, shape in zip(grads, ctx.shapes)
        ]
        pad = ctx.numel - sum(p.numel() for p in parts)
        if pad:
            parts.append(like.new_zeros(pad))
        return torch.cat(parts), None


def _split(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> tuple[torch.Tensor, ...]:
    """`flat`'s parameter views of `shapes` (in order), with `_Split`'s one-pass backward."""
    if not flat.requires_grad:
        return _views(flat, shapes)
    return _Split.apply(flat, tuple(tuple(s) for s in shapes))


# id(shard parameter) -> (the shard, its runtime, its bucket), weakly: a finished run's module and
# runtime are freed with it
_BOUND: dict[int, tuple[weakref.ref, weakref.ref, int]] = {}


def fsdp_gather(
    shard: torch.Tensor, bucket: int, shapes: Sequence[Sequence[int]], axis: str = SHARD_AXIS
) -> tuple[torch.Tensor, ...]:
    """The full parameters of bucket `bucket` (shapes `shapes`, in order) from this rank's flat
    `shard`: all-gathered over the shard group; in backward the gradient is reduce-scattered
    (module docstring). Bound to a `FsdpRuntime`, its prefetch, reshard and asynchronous reduce."""
    entry = _BOUND.get(id(shard))
    runtime = entry[1]() if entry is not None and entry[0]() is shard else None
    if runtime is not None:
        flat = _GatherUnit.apply(shard, runtime, entry[2])
    else:
        flat = _SyncGather.apply(shard, axis)
    return _split(flat, shapes)


def _axis_group(axis: str) -> dist.ProcessGroup | None:
    if axis not in collectives._GROUPS:
        return None
    group = collectives._GROUPS[axis]
    return None if group is None or dist.get_world_size(group) == 1 else group


class _SyncGather(torch.autograd.Function):
    """Unbound `fsdp_gather`: gather now; backward: the mean gradient's shard (reduce-scatter over the
    shard axis / its size, all-reduced over the replicate axis / its size) as the shard's gradient."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, axis: str) -> torch.Tensor:
        group = _axis_group(axis)
        ctx.axis = axis
        if group is None:
            return shard.detach().clone()
        full = torch.empty(shard.numel() * dist.get_world_size(group), dtype=shard.dtype, device=shard.device)
        collectives.all_gather_single(full, shard.detach().contiguous(), group)
        return full

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group, replicate = _axis_group(ctx.axis), _axis_group(REPLICATE_AXIS)
        grad = grad.contiguous()
        if group is not None:
            size = dist.get_world_size(group)
            out = torch.empty(grad.numel() // size, dtype=grad.dtype, device=grad.device)
            collectives.reduce_scatter_single(out, grad, group)
            grad = out / size
        if replicate is not None:
            grad = grad.clone()
            dist.all_reduce(grad, group=replicate)
            grad /= dist.get_world_size(replicate)
        return grad, None


class _GatherUnit(torch.autograd.Function):
    """Bound `fsdp_gather`: the runtime's gathered buffer of bucket k; backward hands the bucket's
    gradient to the runtime's reduce-scatter (the shard gets no autograd gradient: the runtime
    accumulates the mean into its own gradient shard)."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, runtime: FsdpRuntime, k: int) -> torch.Tensor:
        ctx.runtime, ctx.k = runtime, k
        return runtime.forward_gather(k)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.runtime.reduce(ctx.k, grad)
        return None, None, None


@dataclass(frozen=True)
class _Saved:
    """A saved view of a gathered buffer, packed: re-made from the buffer gathered again in backward."""

    bucket: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Pending:
    work: Any  # the async collective's work (None: done already)
    out: torch.Tensor
    keep: torch.Tensor | None = None  # the collective's input, alive until it is waited


class FsdpRuntime:
    """The FSDP2-style runtime of an `apply_fsdp`-rewritten module (module docstring).

    layout: its `FsdpLayout`. shards: the module's shard parameters, by bucket index. grads: this
    rank's gradient shard of each bucket (its shard's size; its dtype, or fp32 for a 16-bit shard with
    the plan's fp32 gradients: the reduce-scatter and the HSDP all-reduce then run in that dtype),
    into which the mean over all `dp` ranks is accumulated. shard_group / replicate_group: the process groups (None: a
    single rank). Call `attach(gm)` once, `finish()` after the backward(s) and before reading the
    gradients or stepping (collective: every rank calls it). `counts`: the collectives issued
    ("all_gather", "reduce_scatter", "all_reduce"), and of the gathers those issued ahead of their
    use ("prefetched") and those found prefetched when needed ("prefetch_used");
    `peak_gathered_bytes`: the most bytes of gathered buckets alive at once.
    """

    def __init__(
        self,
        layout: FsdpLayout,
        shards: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        shard_group: dist.ProcessGroup | None,
        replicate_group: dist.ProcessGroup | None,
        dp: int,
        reshard_after_forward: bool = True,
        prefetch: bool = True,
    ):
        self.layout, self.shards, self.grads = layout, list(shards), list(grads)
        self.shard_group = (
            shard_group if shard_group is not None and dist.get_world_size(shard_group) > 1 else None
        )
        self.replicate_group = (
            replicate_group
            if replicate_group is not None and dist.get_world_size(replicate_group) > 1
            else None
        )
        self.dp, self.reshard_after_forward, self.prefetch = dp, reshard_after_forward, prefetch
        self.divisor = dp  # the mean's divisor (`mean`): dp, or dp x micro-batches in a pipeline
        n = len(layout.buckets)
        self._forward_next = {k: k + 1 for k in range(n - 1)}
        order = layout.backward_order
        self._backward_next = {a: b for a, b in zip(order, order[1:])}
        self._pending: dict[int, _Pending] = {}  # prefetched gathers
        self._backward: dict[int, torch.Tensor] = {}  # buckets gathered again for their backward
        self._live: dict[int, tuple[weakref.ref, int]] = {}  # id(gathered buffer) -> (ref, bucket)
        self._scatters: deque[tuple[int, _Pending]] = deque()
        self._reduces: deque[tuple[int, _Pending]] = deque()
        self.counts: Counter[str] = Counter()
        self.alive_bytes = 0
        self.peak_gathered_bytes = 0
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    # binding ----------------------------------------------------------------------------------
    def attach(self, gm: nn.Module) -> None:
        """Bind the shards to this runtime and, with reshard after forward, pack gathered parameters
        saved for backward during every forward of `gm` (forward pre-hook and forward hook)."""
        for key in [key for key, (ref, runtime, _) in _BOUND.items() if ref() is None or runtime() is None]:
            del _BOUND[key]
        for k, shard in enumerate(self.shards):
            _BOUND[id(shard)] = (weakref.ref(shard), weakref.ref(self), k)
        if self.reshard_after_forward:
            gm.register_forward_pre_hook(lambda *_: self._enter())
            gm.register_forward_hook(lambda *_: self._exit(), always_call=True)

    def detach(self) -> None:
        for shard in self.shards:
            _BOUND.pop(id(shard), None)

    def _enter(self) -> None:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()

    def _exit(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    # gathers ----------------------------------------------------------------------------------
    def _start_gather(self, k: int) -> _Pending:
        b, shard = self.layout.buckets[k], self.shards[k].detach()
        self.counts["all_gather"] += 1
        if self.shard_group is None:
            buf, work = shard.clone(), None
        else:
            buf = torch.empty(b.padded_numel, dtype=shard.dtype, device=shard.device)
            work = collectives.all_gather_single(buf, shard, self.shard_group, async_op=True)
        nbytes = buf.numel() * buf.element_size()
        self.alive_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.alive_bytes)
        weakref.finalize(buf, self._freed, nbytes)
        return _Pending(work, buf, shard)

    def _freed(self, nbytes: int) -> None:
        self.alive_bytes -= nbytes

    def _take(self, k: int) -> torch.Tensor:
        pending = self._pending.pop(k, None)
        if pending is not None:
            self.counts["prefetch_used"] += 1
        else:
            pending = self._start_gather(k)
        if pending.work is not None:
            pending.work.wait()
        return pending.out

    def _prefetch(self, k: int | None) -> None:
        if self.prefetch and k is not None and k not in self._pending and k not in self._backward:
            self._pending[k] = self._start_gather(k)
            self.counts["prefetched"] += 1

    def forward_gather(self, k: int) -> torch.Tensor:
        """Bucket k's gathered flat parameters for its forward; prefetches bucket k + 1."""
        buf = self._take(k)
        self._prefetch(self._forward_next.get(k))
        if self.reshard_after_forward:
            self._live = {i: v for i, v in self._live.items() if v[0]() is not None}
            self._live[id(buf)] = (weakref.ref(buf), k)
        return buf

    def _pack(self, t: torch.Tensor) -> Any:
        for candidate in (t._base, t):
            entry = self._live.get(id(candidate)) if candidate is not None else None
            if entry is not None and entry[0]() is candidate:
                return _Saved(entry[1], tuple(t.size()), tuple(t.stride()), t.storage_offset())
        return t

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        buf = self._backward.get(saved.bucket)
        if buf is None:  # the bucket's first use in backward: gather it again, prefetch the next
            buf = self._backward[saved.bucket] = self._take(saved.bucket)
            self._prefetch(self._backward_next.get(saved.bucket))
        return buf.as_strided(saved.size, saved.stride, saved.offset)

    # reduce-scatters --------------------------------------------------------------------------
    def reduce(self, k: int, grad: torch.Tensor) -> None:
        """Bucket k's backward has ended (its full gradient `grad`): free its gathered buffer and
        issue the reduce-scatter of `grad` (async); the previous one is waited (one in flight)."""
        self._backward.pop(k, None)
        stale = self._pending.pop(k, None)  # prefetched but not used in this backward
        if stale is not None and stale.work is not None:
            stale.work.wait()
        # in the gradient shard's dtype: fp32 with the plan's fp32 gradients (torchtitan's reduce_dtype)
        grad = grad.detach().contiguous().to(self.grads[k].dtype)
        b = self.layout.buckets[k]
        self.counts["reduce_scatter"] += 1
        if self.shard_group is None:
            pending = _Pending(None, grad.clone())
        else:
            out = torch.empty(b.shard_numel, dtype=grad.dtype, device=grad.device)
            pending = _Pending(
                collectives.reduce_scatter_single(out, grad, self.shard_group, async_op=True), out, grad
            )
        self._scatters.append((k, pending))
        self._drain(keep=1)

    def _drain(self, keep: int) -> None:
        while len(self._scatters) > keep:
            k, pending = self._scatters.popleft()
            if pending.work is not None:
                pending.work.wait()
            if self.replicate_group is None:
                self._accumulate(k, pending.out)
                continue
            self.counts["all_reduce"] += 1
            work = dist.all_reduce(pending.out, group=self.replicate_group, async_op=True)
            self._reduces.append((k, _Pending(work, pending.out)))
        while len(self._reduces) > keep:
            k, pending = self._reduces.popleft()
            pending.work.wait()
            self._accumulate(k, pending.out)

    def _accumulate(self, k: int, total: torch.Tensor) -> None:
        self.grads[k].add_(self.mean(total).to(self.grads[k].dtype))

    def mean(self, total: torch.Tensor) -> torch.Tensor:
        """The mean over the dp ranks of `total`, their sum (in place): divided by `divisor`."""
        return total.div_(self.divisor)

    def finish(self) -> None:
        """Wait for every collective in flight and accumulate the gradient shards (collective: after
        the backward, before the gradients are read or the shards stepped); drops prefetched and
        gathered buffers, which the step would make stale."""
        self._drain(keep=0)
        for pending in self._pending.values():
            if pending.work is not None:
                pending.work.wait()
        self._pending.clear()
        self._backward.clear()

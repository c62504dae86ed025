"""Tensor-parallel placement from general sharding semantics: PyTorch DTensor's op strategies.

Most ATen ops need no rule of ours: how a shard passes through a pointwise op with broadcasting and
type promotion, a view / reshape / flatten / stack / cat / permute / transpose / expand / unsqueeze /
select / index on other dims, or a reduction over unsharded dims is the same question DTensor answers
for every eager `DTensor` op. Its sharding propagator (`torch.distributed.tensor`'s op strategies,
with strategies derived through an op's decomposition where it has none of its own) takes the
inputs' placements on a mesh and returns the output placements, the inputs' placements the op needs
(a replicated operand cut to a shard, or a shard it cannot keep gathered) and, for ops whose
arguments name global sizes (`view`, `expand`, `new_zeros`, ...), those arguments rewritten to the
local sizes. `general_rule` asks it on a one-dimensional mesh of `tp` ranks that is never connected
(`DeviceMesh(..., _init_backend=False)`: no process group, no collective is ever issued through it)
and rewrites the node as the answer says, with this project's collectives (`passes.collectives`).

What it does not take from DTensor, and why:
- placements DTensor has no word for stay with our own rules (`passes.tp_rules`): a fused projection's
  output (`Placement.parts`), K/V heads cut into fewer pieces than ranks (`pieces` / `inner`), a
  padded vocabulary shard (`size`), and partial sums (which leave a row-parallel matmul all-reduced);
- a shard of uneven size (DTensor allows `torch.chunk`-style remainders, our shards divide evenly)
  is refused: the op runs replicated (`RuleContext.run_replicated`). A shard strided through a
  merged dim (our `Placement.outer`, DTensor's `_StridedShard`) is asked as a plain shard of that dim
  and kept only where the op computes each row from the same rows of its inputs
  (`strided_general_rule`);
- an answer with a partial output (a sum over the sharded dim) or one that gathers some inputs but
  keeps the output sharded also runs replicated: the gather is then the recorded, priced fallback
  (`tp_fallback`), and no partial sum or half-gathered gradient is left for the backward pass.

Every answer is checked before the graph changes: the op is run on meta tensors of the local input
shapes and must give the local output shape its placement says; a disagreement runs it replicated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.fx as fx
from torch._ops import OpOverload
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.utils import _pytree as pytree

from passes.placement import Placement, local_shape
from passes.tp_rules_context import R, RuleContext

__all__ = ["general_rule", "is_plain", "propagate_placements", "strided_general_rule"]


@functools.cache
def _mesh(tp: int) -> DeviceMesh:
    """A 1-D mesh of `tp` ranks for sharding propagation only: no process group behind it."""
    return DeviceMesh("cpu", torch.arange(tp), _init_backend=False, _rank=0)


def is_plain(p: Any) -> bool:
    """Whether a placement is one DTensor can express: replicated or an even shard on one dim."""
    return isinstance(p, Placement) and (p.is_replicate or p.is_plain_shard)


def _spec(mesh: DeviceMesh, p: Placement, val: torch.Tensor) -> DTensorSpec:
    """The DTensor spec of a value of `val`'s shape and dtype placed `p`, with contiguous strides:
    placements do not depend on strides, and DTensor's decomposition path views its inputs (the
    captured strides of a transposed K made `matmul`'s decomposition fail, so a hand-written
    q @ k^T gathered)."""
    placement = Replicate() if p.is_replicate else Shard(p.dim)
    stride = torch.empty(val.shape, device="meta").stride()
    return DTensorSpec(mesh, (placement,), TensorMeta(val.shape, stride, val.dtype))


def _ours(spec: Any, val: Any, tp: int) -> Placement | None:
    """Our placement of a DTensor spec on the 1-D mesh, or None when we have no such layout (partial,
    strided, or a shard of a dim that does not divide by tp)."""
    if not isinstance(spec, DTensorSpec) or not isinstance(val, torch.Tensor):
        return None
    (p,) = spec.placements
    if type(p) is Replicate:
        return R
    if type(p) is Shard:
        dim = p.dim % max(val.dim(), 1)
        if val.dim() and val.shape[dim] % tp == 0 and val.shape[dim] > 0:
            return Placement.shard(dim)
    return None


_DIM_ARGS = frozenset({"dim", "dims", "dim0", "dim1", "start_dim", "end_dim", "source", "destination"})


def _nonnegative_dims(ctx: RuleContext, node: fx.Node) -> tuple[tuple, dict]:
    """`node`'s args and kwargs with negative dim arguments (schema arguments named `dim`, `dims`,
    `dim0`, ... of type int or int[]) made non-negative. Some DTensor strategies read a negative dim
    as a dim no shard is on: torch 2.13's cumsum keeps Shard(2) of a 3-D tensor through
    `cumsum(x, -1)`, which is a cumsum across the shards. Dims index the output for `stack` and
    `unsqueeze`, the first tensor input otherwise."""
    schema = node.target._schema
    val = ctx.global_val.get(node)
    first = next((ctx.global_val[a] for a in node.all_input_nodes if _is_tensor_node(ctx, a)), None)
    name = node.target.overloadpacket.__name__
    ref = val if name in ("stack", "unsqueeze") else first
    if not isinstance(ref, torch.Tensor) or ref.dim() == 0:
        return tuple(node.args), dict(node.kwargs)
    nd = ref.dim()

    def fix(v: Any) -> Any:
        if isinstance(v, bool) or v is None:
            return v
        if isinstance(v, int):
            return v % nd if v < 0 else v
        if isinstance(v, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in v):
            return type(v)(i % nd if i < 0 else i for i in v)
        return v

    args, kwargs = list(node.args), dict(node.kwargs)
    for i, arg in enumerate(schema.arguments):
        if arg.name not in _DIM_ARGS:
            continue
        if not arg.kwarg_only and i < len(args):
            args[i] = fix(args[i])
        elif arg.name in kwargs:
            kwargs[arg.name] = fix(kwargs[arg.name])
    return tuple(args), kwargs


def _is_tensor_node(ctx: RuleContext, a: Any) -> bool:
    return isinstance(a, fx.Node) and isinstance(ctx.global_val.get(a), torch.Tensor)


def _ask(op: OpOverload, args_schema: tuple, kwargs_schema: dict) -> Any:
    """DTensor's OutputSharding for `op` on these specs, or None when it has no answer."""
    prop = DTensor._op_dispatcher.sharding_propagator
    info = prop.op_to_schema_info.get(op) or prop.op_to_schema_info_for_single_dim_strategy.get(op)
    try:
        return prop.propagate_op_sharding(OpSchema(op, args_schema, kwargs_schema, schema_info=info))
    except Exception:  # no strategy (NotImplementedError) or the propagator gave up on this op
        return None


def _ask_tensor_overload(mesh: DeviceMesh, op: OpOverload, args_schema: tuple, kwargs_schema: dict) -> Any:
    """DTensor's answer for `op` through a sibling overload that takes a tensor where `op` takes a
    Python scalar, the scalars as replicated 0-dim tensors: `where.ScalarOther(c, x, -inf)` (HF T5's
    masked attention under training) is placed as `where.self(c, x, tensor(-inf))` would be. The
    scalars stay scalars in the rewritten node. None when no sibling answers."""
    for name in op.overloadpacket.overloads():
        sibling = getattr(op.overloadpacket, name)
        params = [a for a in sibling._schema.arguments if not a.kwarg_only]
        if sibling is op or len(params) < len(args_schema):
            continue
        wrapped = []
        for arg, param in zip(args_schema, params):
            if (
                isinstance(arg, (int, float))
                and not isinstance(arg, bool)
                and param.type.kind() == "TensorType"
            ):
                dtype = torch.float32 if isinstance(arg, float) else torch.int64
                wrapped.append(DTensorSpec(mesh, (Replicate(),), TensorMeta(torch.Size(()), (), dtype)))
            else:
                wrapped.append(arg)
        if wrapped == list(args_schema):
            continue
        out = _ask(sibling, tuple(wrapped), kwargs_schema)
        if out is not None:
            return out
    return None


def propagate_placements(
    ctx: RuleContext, node: fx.Node, place: dict[fx.Node, Any] | None = None
) -> tuple[list[Placement], list[Any], dict[str, Any], Any] | None:
    """DTensor's answer for `node` on its inputs' current placements, in our terms: (the placement each
    tensor input must have, in the order of the flattened (args, kwargs); the node's args and kwargs
    with local sizes where DTensor rewrote them; the output's Placement, or a list for a node that
    returns a tuple). None when DTensor has no strategy for the op or answers with a layout we do not
    have (module docstring). `place`: the inputs' placements to ask with (default `ctx.place`)."""
    op = node.target
    if not isinstance(op, OpOverload):
        return None
    mesh = _mesh(ctx.tp)
    place = ctx.place if place is None else place

    def to_schema(a: Any) -> Any:
        if isinstance(a, fx.Node):
            val = ctx.global_val.get(a)
            if isinstance(val, torch.Tensor):
                return _spec(mesh, place.get(a, R), val)
            return val
        return a

    args, kwargs = _nonnegative_dims(ctx, node)
    args_schema = fx.node.map_aggregate(args, to_schema)
    kwargs_schema = {k: fx.node.map_aggregate(v, to_schema) for k, v in kwargs.items()}
    out = _ask(op, tuple(args_schema), kwargs_schema)
    if out is None:
        out = _ask_tensor_overload(mesh, op, tuple(args_schema), kwargs_schema)
    if out is None:
        return None
    val = ctx.global_val.get(node)
    if isinstance(val, (list, tuple)):
        specs = (
            out.output_spec if isinstance(out.output_spec, (list, tuple)) else [out.output_spec] * len(val)
        )
        if len(specs) != len(val):
            return None
        outputs: Any = [_ours(s, v, ctx.tp) if isinstance(v, torch.Tensor) else R for s, v in zip(specs, val)]
        if any(o is None for o in outputs):
            return None
    elif isinstance(val, torch.Tensor):
        outputs = _ours(out.output_spec, val, ctx.tp)
        if outputs is None:
            return None
    else:
        outputs = R
    leaves, tree = pytree.tree_flatten((list(node.args), dict(node.kwargs)))
    wanted_schema = out.redistribute_schema if out.needs_redistribute else None
    if wanted_schema is not None:
        new_leaves, new_tree = pytree.tree_flatten(
            (list(wanted_schema.args_schema), dict(wanted_schema.kwargs_schema))
        )
        if len(new_leaves) != len(leaves):
            return None
    else:
        new_leaves = None
    wanted: list[Placement] = []
    values: list[Any] = []
    for i, a in enumerate(leaves):
        if _is_tensor_node(ctx, a):
            spec = new_leaves[i] if new_leaves is not None else None
            p = place.get(a, R) if spec is None else _ours(spec, ctx.global_val[a], ctx.tp)
            if p is None:
                return None
            wanted.append(p)
            values.append(a)
        elif (
            new_leaves is not None
            and out.use_val_from_redistribute_schema
            and not isinstance(new_leaves[i], DTensorSpec)
        ):
            values.append(new_leaves[i])
        else:
            values.append(a)
    new_args, new_kwargs = pytree.tree_unflatten(values, tree)
    return wanted, new_args, new_kwargs, outputs


def general_rule(ctx: RuleContext, node: fx.Node) -> bool:
    """Place and rewrite `node` by DTensor's sharding semantics; False (nothing changed) when the op
    has no strategy, an input's placement is not plain (`is_plain`), or the answer is one we do not
    take (module docstring): the caller then runs it replicated or applies a rule of its own."""
    if not all(is_plain(ctx.place.get(a, R)) for a in node.all_input_nodes if _is_tensor_node(ctx, a)):
        return False
    found = propagate_placements(ctx, node)
    if found is None:
        return False
    wanted, new_args, new_kwargs, outputs = found
    out_list = outputs if isinstance(outputs, list) else [outputs]
    if all(o.is_replicate for o in out_list) and not any(
        ctx.place.get(a, R).is_shard for a in node.all_input_nodes if _is_tensor_node(ctx, a)
    ):
        return False  # replicated in, replicated out: nothing to decide (factories, masks)
    leaves, tree = pytree.tree_flatten((new_args, new_kwargs))
    tensor_leaves = [a for a in leaves if _is_tensor_node(ctx, a)]
    gathers = [
        a for a, w in zip(tensor_leaves, wanted) if ctx.place.get(a, R).is_shard and ctx.place.get(a, R) != w
    ]
    if gathers:
        return False  # a shard it cannot keep: the caller's replicated run gathers it, recorded and priced
    if not _local_shapes_agree(ctx, node, leaves, tree, tensor_leaves, wanted, out_list, outputs):
        return False
    sharded_out = any(o.is_shard for o in out_list)
    swap: dict[int, fx.Node] = {}
    for a, w in zip(tensor_leaves, wanted):
        have = ctx.place.get(a, R)
        if w.is_shard and have.is_replicate:
            swap[id(a)] = ctx.sharded(a, w.dim)  # a local slice; its backward gathers the gradient
        elif w.is_replicate and sharded_out:
            swap[id(a)] = ctx.copy_in(a)  # broadcast into a shard: its gradient is summed over ranks
    _rewrite(ctx, node, leaves, tree, swap, outputs)
    return True


def _rewrite(
    ctx: RuleContext, node: fx.Node, leaves: list[Any], tree: Any, swap: dict[int, fx.Node], outputs: Any
) -> None:
    """`node`'s arguments with the inputs in `swap` (by id) replaced, and its output placement(s)."""
    leaves = [swap.get(id(a), a) if isinstance(a, fx.Node) else a for a in leaves]
    node.args, node.kwargs = pytree.tree_unflatten(leaves, tree)
    node.args = tuple(node.args)
    if isinstance(outputs, list):
        ctx.set_tuple(node, outputs, "[" + ", ".join(map(str, outputs)) + "]")
    else:
        ctx.set_meta(node, outputs)


def _local_shapes_agree(
    ctx: RuleContext,
    node: fx.Node,
    leaves: list[Any],
    tree: Any,
    tensor_leaves: list[fx.Node],
    wanted: list[Placement],
    out_list: list[Placement],
    outputs: Any,
) -> bool:
    """Run the op on meta tensors of the local input shapes; True when each output has the local shape
    its placement says."""
    local = {}
    for a, w in zip(tensor_leaves, wanted):
        val = ctx.global_val[a]
        local[id(a)] = torch.empty(local_shape(tuple(val.shape), w, ctx.tp), dtype=val.dtype, device="meta")
    meta_leaves = [local[id(a)] if id(a) in local else a for a in leaves]
    meta_args, meta_kwargs = pytree.tree_unflatten(meta_leaves, tree)
    try:
        got = node.target(*meta_args, **meta_kwargs)
    except Exception:
        return False
    val = ctx.global_val.get(node)
    vals = list(val) if isinstance(val, (list, tuple)) else [val]
    gots = list(got) if isinstance(got, (list, tuple)) else [got]
    if len(gots) != len(vals):
        return False
    for g, v, p in zip(gots, vals, out_list if isinstance(outputs, list) else [outputs] * len(vals)):
        if isinstance(v, torch.Tensor):
            if not isinstance(g, torch.Tensor) or tuple(g.shape) != local_shape(tuple(v.shape), p, ctx.tp):
                return False
    return True


def strided_general_rule(ctx: RuleContext, node: fx.Node) -> bool:
    """Place and rewrite `node` whose inputs include shards strided through a merged dim
    (`Placement.outer`: Bloom's and nn.MultiheadAttention's (B * H, T, hd) heads, b-major) by
    DTensor's semantics for a plain shard of that dim: an op that keeps such a shard computes each row
    of the merged dim from the same row of its inputs (a batched matmul, a pointwise op, a softmax over
    another dim), so it may run on any set of rows, the strided one included, as long as every input
    holds the same rows. All strided inputs must have one (dim, outer), counted from the right (as
    broadcasting aligns dims), and every other input be replicated: one DTensor wants sharded is cut
    to the same rows (`RuleContext.sharded_strided`: Bloom's alibi bias, (B * H, 1, T)); one it keeps
    replicated is broadcast along the dim. Each sharded output must be the merged dim at the same
    place and size, and is strided alike. False (nothing changed) otherwise: the caller runs the op
    replicated, which gathers and reorders the strided inputs (recorded and priced as a fallback)."""
    tensors = [a for a in node.all_input_nodes if _is_tensor_node(ctx, a)]
    placed = {a: ctx.place.get(a, R) for a in tensors}
    if not all(isinstance(p, Placement) for p in placed.values()):
        return False
    strided = {
        (ctx.global_val[a].dim() - p.dim, p.outer, ctx.global_val[a].shape[p.dim])
        for a, p in placed.items()
        if p.outer
    }
    if len(strided) != 1:
        return False
    (from_right, outer, merged) = strided.pop()
    plain: dict[fx.Node, Any] = {}
    for a, p in placed.items():
        if p.outer and p == dataclasses.replace(Placement.shard(p.dim), outer=p.outer):
            plain[a] = Placement.shard(p.dim)
        elif p.is_replicate:
            plain[a] = R
        else:
            return False  # parts, pieces, padding beside a strided shard: not one set of rows
    found = propagate_placements(ctx, node, plain)
    if found is None:
        return False
    wanted, new_args, new_kwargs, outputs = found
    vals = ctx.global_val.get(node)
    out_vals = list(vals) if isinstance(vals, (list, tuple)) else [vals]
    out_list = outputs if isinstance(outputs, list) else [outputs]

    def aligned(val: Any, p: Placement) -> bool:  # the merged dim, at the same place from the right
        return (
            isinstance(val, torch.Tensor) and val.dim() - p.dim == from_right and val.shape[p.dim] == merged
        )

    if not any(o.is_shard for o in out_list) or not all(
        o.is_replicate or aligned(v, o) for o, v in zip(out_list, out_vals)
    ):
        return False
    leaves, tree = pytree.tree_flatten((new_args, new_kwargs))
    tensor_leaves = [a for a in leaves if _is_tensor_node(ctx, a)]
    for a, w in zip(tensor_leaves, wanted):
        if plain[a].is_shard and w != plain[a]:
            return False  # a strided shard DTensor would move or gather
        if plain[a].is_replicate and w.is_shard and not aligned(ctx.global_val[a], w):
            return False
    if any(o.is_replicate for o in out_list):
        return False  # a replicated output beside a strided one: not a per-row op
    local = [dataclasses.replace(w, outer=outer) if w.is_shard else w for w in wanted]
    strided_out = [dataclasses.replace(o, outer=outer) for o in out_list]
    if not _local_shapes_agree(
        ctx, node, leaves, tree, tensor_leaves, local, strided_out,
        strided_out if isinstance(outputs, list) else strided_out[0],
    ):  # fmt: skip
        return False
    swap: dict[int, fx.Node] = {}
    for a, w in zip(tensor_leaves, wanted):
        if plain[a].is_replicate:
            swap[id(a)] = ctx.sharded_strided(a, w.dim, outer) if w.is_shard else ctx.copy_in(a)
    _rewrite(ctx, node, leaves, tree, swap, strided_out if isinstance(outputs, list) else strided_out[0])
    return True

"""In-place writes into a tensor the forward creates, rewritten as the out-of-place ops they stand for.

    functionalize_fresh_writes(graph) -> int   # tensors rewritten

torch.export's graph keeps a model's in-place ops (its training IR is not functionalised). Where a
forward fills a tensor it has just made, the values reach their readers through a side effect that
the sharding rules, the analysis and the cost model do not follow (they read data flow):

- DeepSeek-V3's multi-head latent attention in Hugging Face transformers (`expand_kv`) builds each
  key from two parts: ``k = kv.new_empty(B, H, S, d_nope + d_rope)``, then ``k[..., :d_nope].copy_(k_nope)``
  and ``k[..., d_nope:].copy_(k_rot)``: a concatenation written as two copies into slices;
- a mixture-of-experts combine written ``out = torch.zeros(N, C); out.index_add_(0, idx, y)`` per
  expert (Hugging Face's Mixtral before transformers 5 and many MoE layers like it).

For a tensor made in the graph (`_FRESH`: ``new_empty``, ``zeros``, ``full``, ...) whose every write is
an in-place op (`_IN_PLACE`, or ``copy_``) on the whole tensor or on a chain of ``slice`` /
``select`` views of it, the writes become values: copies that tile one dim of the tensor exactly become
one ``aten.cat`` of the sources (each broadcast to its slice and cast to the tensor's dtype, as
``copy_`` does); other copies become ``slice_scatter`` / ``select_scatter`` of the tensor's current
value; ``x.index_add_(...)`` becomes ``x' = index_add(x, ...)``, and so on. Every reader then reads the
value current at its place in the graph. The result computes the same values (the rewrite is what
PyTorch's own functionalization does for these ops).

A tensor is left as it is when anything could see its storage otherwise: a view of it read across a
later write, a write's return value used, a write through any other view (``view``, ``transpose``, ...),
the tensor as the destination of an op we do not map, or a graph input or buffer (a KV cache written
in place is the cache rules' business: `passes.tp_rules.rule_cache_update`).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

__all__ = ["add_call", "functionalize_fresh_writes"]

aten = torch.ops.aten

# ops that make a new tensor from sizes or another tensor's metadata (never its values)
_FRESH = frozenset({
    "aten.new_empty", "aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.empty", "aten.zeros",
    "aten.ones", "aten.full", "aten.empty_like", "aten.zeros_like", "aten.ones_like", "aten.full_like",
})  # fmt: skip

# in-place ops whose out-of-place twin (the name without its "_", the same overload) takes the same
# arguments; `zero_` is `zeros_like`
_IN_PLACE = frozenset({
    "aten.index_add_", "aten.index_put_", "aten.index_copy_", "aten.index_fill_", "aten.scatter_add_",
    "aten.scatter_", "aten.scatter_reduce_", "aten.masked_fill_", "aten.fill_", "aten.add_", "aten.sub_",
    "aten.mul_", "aten.div_", "aten.zero_",
})  # fmt: skip

# views a write may go through (copy_ into t[a:b] or t[i]) and the scatter op that writes back through each
_SCATTER = {"aten.slice": aten.slice_scatter.default, "aten.select": aten.select_scatter.default}


# ops that return a view of their input whose schemas do not say so
_UNANNOTATED_VIEWS = frozenset({
    "aten.atleast_1d", "aten.atleast_2d", "aten.atleast_3d", "aten.unsafe_split", "aten.unsafe_chunk",
    "aten.unsafe_split_with_sizes",
})  # fmt: skip


def _operands(node: fx.Node) -> list[fx.Node]:
    """The nodes among `node`'s arguments after the first and its keyword arguments, with repeats
    (`add_(v, v)` reads v as well as writing it)."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args[1:], node.kwargs), lambda n: found.append(n) or n)
    return found


def _may_alias(node: fx.Node) -> bool:
    """Whether `node`'s result may share storage with an input: an ATen op whose schema gives a return
    an alias of an argument (`Tensor(a) self -> Tensor(a)`: every view, `reshape`, `contiguous`, `to`,
    the splits), or a call of anything but an ATen op or `getitem` (a higher-order op's subgraph)."""
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    if not isinstance(node.target, torch._ops.OpOverload):
        return True
    schema = node.target._schema
    return op_name(node.target) in _UNANNOTATED_VIEWS or any(r.alias_info is not None for r in schema.returns)


def op_name(target: object) -> str:
    """'aten.copy_' for torch.ops.aten.copy_.default, else '' (`planner.frontend.capture.op_name`, which
    imports this module)."""
    return f"{target.namespace}.{target._opname}" if isinstance(target, torch._ops.OpOverload) else ""


def _functional_target(node: fx.Node) -> Callable | None:
    """The out-of-place overload of an in-place node's op (``add_.Tensor`` -> ``add.Tensor``), or None."""
    name = op_name(node.target)
    if name not in _IN_PLACE:
        return None
    if name == "aten.zero_":
        return aten.zeros_like.default
    packet = getattr(aten, name.removeprefix("aten.").removesuffix("_"), None)
    return getattr(packet, node.target._overloadname, None) if packet is not None else None


class _Write:
    """One write into the fresh tensor: `node` (the in-place op), `chain` (the slice / select views it
    writes through, outermost first; empty for a whole-tensor op)."""

    def __init__(self, node: fx.Node, chain: list[fx.Node]) -> None:
        self.node, self.chain = node, chain


def _writes(fresh: fx.Node, order: dict[fx.Node, int]) -> tuple[list[_Write], list[fx.Node]] | None:
    """Every write into `fresh` in graph order and every read of it (a user of `fresh` or of the value a
    whole-tensor write returns, which is `fresh` again), or None when its storage could be seen otherwise."""
    writes: list[_Write] = []
    reads: list[fx.Node] = []
    aliases, seen = [fresh], {fresh}
    while aliases:
        alias = aliases.pop()
        for user in alias.users:
            name = op_name(user.target) if user.op == "call_function" else ""
            into = bool(user.args) and user.args[0] is alias
            if into and alias in _operands(user):  # t.add_(t): reads what it writes
                return None
            whole_copy = name == "aten.copy_" and len(user.args) == 2 and not user.kwargs
            if into and (_functional_target(user) is not None or whole_copy):
                writes.append(_Write(user, []))
                if user not in seen:  # its return value is the tensor written
                    seen.add(user)
                    aliases.append(user)
                continue
            if into and name in _SCATTER:
                chain = [user]
                while len(chain[-1].users) == 1:
                    (nxt,) = chain[-1].users
                    if op_name(nxt.target) not in _SCATTER or nxt.args[0] is not chain[-1]:
                        break
                    chain.append(nxt)
                (last,) = chain[-1].users if len(chain[-1].users) == 1 else (None,)
                copies = last is not None and op_name(last.target) == "aten.copy_"
                if last is not None and last.args[0] is chain[-1] and (copies or _functional_target(last)):
                    if last.users or (copies and (len(last.args) > 2 or last.kwargs)):  # used, non_blocking
                        return None
                    if any(v in _operands(last) for v in (*chain, alias)):
                        return None  # `v += v`: reads what it writes
                    writes.append(_Write(last, chain))
                    continue
            elsewhere = alias in _operands(user)
            if (into or elsewhere) and _writes_in_place(user):  # an in-place op we do not map
                return None
            if elsewhere and _may_alias(user):
                return None
            reads.append(user)
    if not writes:
        return None
    last_write = max(order[w.node] for w in writes)
    # a view read before the last write sees the later writes too
    if any(_may_alias(r) and order[r] < last_write for r in reads):
        return None
    return sorted(writes, key=lambda w: order[w.node]), reads


def _as_cat(fresh: fx.Node, writes: list[_Write]) -> tuple[int, list[_Write]] | None:
    """(dim, writes by start) when every write is a copy_ into one step-1 slice of `fresh` on the same
    dim and the slices tile that dim exactly (a concatenation); else None."""
    shape = fresh.meta["val"].shape
    spans = []
    for w in writes:
        if (
            len(w.chain) != 1
            or op_name(w.chain[0].target) != "aten.slice"
            or op_name(w.node.target) != "aten.copy_"
        ):
            return None
        view = w.chain[0]
        dim, start, end, step = (list(view.args[1:]) + [0, None, None, 1][len(view.args) - 1 :])[:4]
        if not all(isinstance(v, (int, type(None))) for v in (dim, start, end, step)) or step != 1:
            return None
        dim %= len(shape)
        size = shape[dim]
        lo, hi = slice(start, end).indices(size)[:2]
        spans.append((dim, lo, max(lo, hi), w))
    dims = {s[0] for s in spans}
    if len(dims) != 1:
        return None
    spans.sort(key=lambda s: s[1])
    edge = 0
    for _, lo, hi, _ in spans:
        if lo != edge or hi == lo:
            return None
        edge = hi
    if edge != shape[spans[0][0]]:
        return None
    return spans[0][0], [s[3] for s in spans]


def add_call(
    graph: fx.Graph, target: Callable, args: tuple, like: fx.Node, kwargs: dict | None = None
) -> fx.Node:
    """A call of `target` with `like`'s metadata (source line, module) and its fake value computed."""
    node = graph.call_function(target, args, kwargs or {})
    node.meta.update({k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta")})
    mode = detect_fake_mode([a.meta.get("val") for a in node.all_input_nodes])
    fake_args = fx.node.map_arg(args, lambda a: a.meta["val"])
    with mode if mode is not None else contextlib.nullcontext():
        node.meta["val"] = target(*fake_args, **(kwargs or {}))
    return node


def _source_as(
    graph: fx.Graph, src: fx.Node, shape: torch.Size, dtype: torch.dtype, like: fx.Node
) -> fx.Node:
    """`src` as copy_ writes it into a view of `shape` and `dtype`: broadcast, then cast."""
    if not isinstance(src, fx.Node):
        return src
    val = src.meta["val"]
    if tuple(val.shape) != tuple(shape):
        src = add_call(graph, aten.expand.default, (src, list(shape)), like)
    if val.dtype != dtype:
        src = add_call(graph, aten._to_copy.default, (src,), like, {"dtype": dtype})
    return src


def _writes_in_place(node: fx.Node) -> bool:
    """An ATen op whose schema says it writes an argument (`add_`, `copy_`, `index_put_`, `out=`)."""
    return isinstance(node.target, torch._ops.OpOverload) and any(
        a.alias_info is not None and a.alias_info.is_write for a in node.target._schema.arguments
    )


def _out_of_place(graph: fx.Graph, write: fx.Node, current: fx.Node) -> fx.Node:
    """`write`'s out-of-place twin on `current` with all its arguments (keywords too: `alpha=`,
    `rounding_mode=`), cast back to `current`'s dtype as the in-place op keeps its destination's (an
    fp32 operand added into a bf16 tensor, an int64 into an int8 counter)."""
    dtype = current.meta["val"].dtype
    out = add_call(graph, _functional_target(write), (current, *write.args[1:]), write, dict(write.kwargs))
    if out.meta["val"].dtype != dtype:
        out = add_call(graph, aten._to_copy.default, (out,), write, {"dtype": dtype})
    return out


def _rewrite(
    graph: fx.Graph, fresh: fx.Node, writes: list[_Write], reads: list[fx.Node], order: dict[fx.Node, int]
) -> None:
    """Replace the writes into `fresh` by values and every read by the value current at its place."""
    written = {w.node for w in writes} | {v for w in writes for v in w.chain}
    val = fresh.meta["val"]
    last = writes[-1].node
    between = list(graph.nodes)[order[writes[0].node] : order[last]]
    quiet = not any(n.op == "call_function" and _writes_in_place(n) for n in between if n not in written)
    cat = _as_cat(fresh, writes) if quiet and all(order[r] > order[last] for r in reads) else None
    if cat is not None:  # the sources are read at the last write: nothing between writes in place
        dim, ordered = cat
        with graph.inserting_before(last.next):
            parts = [
                _source_as(graph, w.node.args[1], w.chain[0].meta["val"].shape, val.dtype, w.node)
                for w in ordered
            ]
            versions = [(order[last], add_call(graph, aten.cat.default, (parts, dim), last))]
    else:
        versions = []
        current = fresh
        for w in writes:  # nodes made before the next node keep the order they are made in
            with graph.inserting_before(w.node.next):
                if not w.chain and op_name(w.node.target) == "aten.copy_":
                    # t.copy_(src): a new contiguous tensor holding src as t holds it (not src itself,
                    # which may be written later or be a transposed or broadcast view)
                    held = _source_as(graph, w.node.args[1], val.shape, val.dtype, w.node)
                    current = add_call(
                        graph, aten.clone.default, (held,), w.node, {"memory_format": torch.contiguous_format}
                    )
                elif not w.chain:
                    current = _out_of_place(graph, w.node, current)
                else:  # a write into current[view_1][view_2]...: scattered back out, innermost first
                    bases = [current]
                    for view in w.chain:
                        bases.append(add_call(graph, view.target, (bases[-1], *view.args[1:]), w.node))
                    if op_name(w.node.target) == "aten.copy_":
                        inner = _source_as(
                            graph, w.node.args[1], bases[-1].meta["val"].shape, val.dtype, w.node
                        )
                    else:  # fill_, add_, ... of the view: the out-of-place op on its current value
                        inner = _out_of_place(graph, w.node, bases[-1])
                    for view, base in zip(reversed(w.chain), reversed(bases[:-1]), strict=True):
                        inner = add_call(
                            graph, _SCATTER[op_name(view.target)], (base, inner, *view.args[1:]), w.node
                        )
                    current = inner
            versions.append((order[w.node], current))
    aliases = {fresh} | {w.node for w in writes if not w.chain}
    for read in reads:
        value = fresh
        for position, version in versions:
            if position < order[read]:
                value = version
        for alias in aliases:
            read.replace_input_with(alias, value)
    for w in reversed(writes):
        graph.erase_node(w.node)
        for view in reversed(w.chain):
            graph.erase_node(view)
    if not fresh.users:
        graph.erase_node(fresh)


def functionalize_fresh_writes(graph: fx.Graph) -> int:
    """Rewrite in-place writes into tensors the graph creates as out-of-place values (module docstring);
    returns how many tensors were rewritten. The graph computes the same outputs."""
    count = 0
    for fresh in [n for n in graph.nodes if n.op == "call_function" and op_name(n.target) in _FRESH]:
        if not isinstance(fresh.meta.get("val"), torch.Tensor):
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        found = _writes(fresh, order)
        if found is None:
            continue
        _rewrite(graph, fresh, *found, order)
        count += 1
    return count

"""Tensor-parallel rewrite: GraphModule -> this rank's GraphModule with weight shards and collectives.

Input: an ATen-level graph from `planner.frontend.capture.capture` (global shapes in `node.meta["val"]`,
parameters as `get_attr` nodes named by FQN) and the plan's weight splits. Output: the same graph,
rewritten in place for one rank of the TP axis:

1. every split parameter is replaced by this rank's shard (`shard_weight`); a column-parallel
   weight's bias is sharded like its output;
2. a placement (`passes.placement.Placement`: replicate / shard(dim) / partial) is propagated
   through every node in graph order. Each op has a rule: a matmul with a column-split weight makes
   a sharded output from a replicated input; a row-split weight consumes a sharded input and its
   partial output is all-reduced at once (bias added after the reduction); attention (SDPA) keeps a
   head-sharded layout; reshapes move the shard through `view_shard_dim`; pointwise ops keep it
   (a replicated full-size operand is sliced locally); any other op gets replicated inputs
   (all-gather) - correct, only slower;
3. literal shapes the split changes (`view(B, T, 12, 64)` -> `view(B, T, 12/tp, 64)`, `expand`,
   `split` sizes of fused projections) are rewritten from the propagated local shapes;
4. every rewritten node is re-run on `meta` tensors and its local shape compared with the global
   shape divided as its placement says; any disagreement is a `TensorParallelError` naming the node.
   Nothing passes with a shape the pass could not check.

For training (`training=True`) the Megatron conjugate operators are inserted: `tp_copy` (identity
forward, all-reduce backward) on every replicated float input of an op that produces a shard, and
the all-reduce after a row-split matmul has an identity backward (`passes.collectives`).

Node metadata written: `node.meta["tp_placement"]` (str), `node.meta["val"]` (a meta tensor of the
local shape).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.fx as fx

from passes import collectives
from passes.placement import Placement, local_shape, view_shard_dim

aten = torch.ops.aten
R = Placement.replicate()


class SplitLike(Protocol):
    """What the pass reads from a `planner.plan.WeightSplit`."""

    weight: str
    style: str
    dim: int
    parts: list[int] | None


class TensorParallelError(ValueError):
    """A node the TP rewrite cannot make correct; the message names the node and the reason."""


def padded_size(size: int, tp: int) -> int:
    """`size` rounded up to a multiple of tp (a padded vocabulary)."""
    return -(-size // tp) * tp


def shard_weight(
    full: torch.Tensor,
    dim: int,
    parts: list[int] | tuple[int, ...] | None,
    rank: int,
    tp: int,
    pad: bool = False,
):
    """This rank's shard of `full` along `dim`: a contiguous 1/tp chunk, taken per part for fused weights.

    full: the global parameter, e.g. (out_features, in_features). pad: a vocabulary that does not
    divide by tp is first padded with zero rows to `padded_size` (only for vocab splits: the padded
    rows' outputs are dropped when gathered). Raises ValueError when a size does not divide by tp.
    Meta tensors give meta shards.
    """
    if pad and not parts and full.shape[dim] % tp:
        extra = list(full.shape)
        extra[dim] = padded_size(full.shape[dim], tp) - full.shape[dim]
        full = torch.cat([full, full.new_zeros(extra)], dim=dim)
    pieces = [full] if not parts else list(full.split(list(parts), dim=dim))
    out = []
    for piece in pieces:
        if piece.shape[dim] % tp:
            raise ValueError(f"size {piece.shape[dim]} of dim {dim} does not divide by tp={tp}")
        out.append(piece.chunk(tp, dim=dim)[rank])
    return torch.cat(out, dim=dim).contiguous() if len(out) > 1 else out[0].contiguous()


def _op(node: fx.Node):
    target = node.target
    return getattr(target, "overloadpacket", target)


_SAME = {
    aten.contiguous,
    aten.clone,
    aten.alias,
    aten.detach,
    aten._to_copy,
    aten.to,
    aten.dropout,
    aten.lift_fresh_copy,
    aten.type_as,
}
_REDUCE_DIMS = {aten.mean, aten.sum, aten.amax, aten.amin, aten.var, aten.std}
_SOFTMAX = {aten._softmax, aten.softmax, aten._log_softmax, aten.log_softmax}


class _Rewriter:
    def __init__(
        self,
        gm: fx.GraphModule,
        splits: Mapping[str, SplitLike],
        rank: int,
        tp: int,
        axis: str,
        training: bool,
    ):
        self.gm, self.graph = gm, gm.graph
        self.splits, self.rank, self.tp, self.axis, self.training = splits, rank, tp, axis, training
        self.place: dict[fx.Node, Any] = {}
        self.global_val: dict[fx.Node, Any] = {n: n.meta.get("val") for n in gm.graph.nodes}
        self._replicated: dict[fx.Node, fx.Node] = {}
        self._copied: dict[fx.Node, fx.Node] = {}
        self._sharded: dict[tuple[fx.Node, int], fx.Node] = {}
        self.param_split: dict[str, Placement] = {}
        self._sharded_ids: set[int] = set()  # id() of the shard Parameters this pass created

    # ---------------------------------------------------------------- helpers
    def fail(self, node: fx.Node, why: str) -> TensorParallelError:
        return TensorParallelError(
            f"tensor-parallel rewrite of node `{node.format_node()}` (tp={self.tp}): {why}"
        )

    def gshape(self, node: fx.Node) -> tuple[int, ...]:
        return tuple(self.global_val[node].shape)

    def insert(self, after: fx.Node, fn, args: tuple, placement: Placement, global_like: fx.Node) -> fx.Node:
        with self.graph.inserting_after(after):
            new = self.graph.call_function(fn, args)
        self.global_val[new] = self.global_val[global_like]
        self.set_meta(new, placement)
        return new

    def set_meta(self, node: fx.Node, placement) -> None:
        self.place[node] = placement
        node.meta["tp_placement"] = str(placement)
        val = self.global_val.get(node)
        if isinstance(placement, Placement) and isinstance(val, torch.Tensor):
            node.meta["val"] = torch.empty(
                local_shape(tuple(val.shape), placement, self.tp), dtype=val.dtype, device="meta"
            )

    def replicated(self, node: fx.Node) -> fx.Node:
        """`node` as a replicated value: all-gather a shard; partial sums never leave a matmul rule."""
        p = self.place.get(node, R)
        if not isinstance(p, Placement) or p.kind == "R":
            return node
        if p.kind == "P":
            raise self.fail(node, "a partial sum reached an op that needs the full value")
        if p.parts:
            raise self.fail(node, "a fused projection's output must be split into its parts before other ops")
        if node not in self._replicated:
            gathered = self.insert(node, collectives.tp_all_gather, (node, p.dim, self.axis), R, node)
            if p.size:  # a padded vocabulary: drop the padding rows after the gather
                length = self.gshape(node)[p.dim]
                val = self.global_val[node]
                shape = list(val.shape)
                shape[p.dim] = p.size
                gathered.meta["val"] = torch.empty(shape, dtype=val.dtype, device="meta")
                gathered = self.insert(gathered, aten.slice.Tensor, (gathered, p.dim, 0, length), R, node)
            self._replicated[node] = gathered
        return self._replicated[node]

    def sharded(self, node: fx.Node, dim: int) -> fx.Node:
        """`node` sharded along `dim` (slicing a replicated value locally)."""
        p = self.place.get(node, R)
        if isinstance(p, Placement) and p.is_shard and p.dim == dim and not p.parts and not p.size:
            return node
        full = self.replicated(node)
        if self.gshape(node)[dim] % self.tp:
            raise self.fail(node, f"dim {dim} of size {self.gshape(node)[dim]} does not divide by tp")
        key = (full, dim)
        if key not in self._sharded:
            self._sharded[key] = self.insert(
                full, collectives.tp_shard, (full, dim, self.axis), Placement.shard(dim), node
            )
        return self._sharded[key]

    def copy_in(self, node: fx.Node) -> fx.Node:
        """Replicated float input of a shard-producing op: under training, wrap in `tp_copy`."""
        val = self.global_val.get(node)
        if not self.training or not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
            return node
        if node not in self._copied:
            self._copied[node] = self.insert(node, collectives.tp_copy, (node, self.axis), R, node)
        return self._copied[node]

    # ---------------------------------------------------------------- parameters
    def shard_parameters(self) -> None:
        for node in self.graph.nodes:
            if node.op != "get_attr" or node.target not in self.splits or not node.users:
                continue
            split = self.splits[node.target]
            if split.style == "replicate":
                continue
            length = tuple(self.global_val[node].shape)[split.dim]
            size = padded_size(length, self.tp) if split.style == "vocab" and length % self.tp else None
            self.param_split[node.target] = Placement.shard(
                split.dim, tuple(split.parts) if split.parts else None, size
            )

    def replace_param(self, fqn: str, dim: int, parts, pad: bool = False) -> None:
        owner_path, _, name = fqn.rpartition(".")
        owner = self.gm.get_submodule(owner_path) if owner_path else self.gm
        full = getattr(owner, name)
        if id(full) in self._sharded_ids:
            return
        try:
            shard = shard_weight(full.detach(), dim, parts, self.rank, self.tp, pad=pad)
        except ValueError as e:
            raise TensorParallelError(f"weight `{fqn}` of shape {tuple(full.shape)}: {e}") from e
        new = torch.nn.Parameter(shard, requires_grad=full.requires_grad)
        self._sharded_ids.add(id(new))
        for module in self.gm.modules():  # every alias of a tied weight gets the shard
            for pname, value in list(module._parameters.items()):
                if value is full:
                    module._parameters[pname] = new

    # ---------------------------------------------------------------- rules
    def rule_matmul(self, node: fx.Node) -> None:
        if _op(node) is aten.linear:
            x, w = node.args[0], node.args[1]
            b = node.args[2] if len(node.args) > 2 else None
            out_dim_of_w = 0
        elif _op(node) is aten.addmm:
            b, x, w = node.args[0], node.args[1], node.args[2]
            out_dim_of_w = 1
        else:  # aten.mm
            x, w = node.args
            b, out_dim_of_w = None, 1
        sp = self.param_split.get(w.target) if isinstance(w, fx.Node) and w.op == "get_attr" else None
        xdim = len(self.gshape(x)) - 1
        if sp is None:
            self.generic(node)
            return
        self.replace_param(w.target, sp.dim, sp.parts, pad=sp.size is not None)
        if sp.dim == out_dim_of_w:  # column-parallel: replicated in, sharded out
            if isinstance(b, fx.Node):
                self.replace_param(b.target, 0, sp.parts, pad=sp.size is not None)
                self.set_meta(b, Placement.shard(0, sp.parts, sp.size))
            x_new = self.copy_in(self.replicated(x))
            node.replace_input_with(x, x_new)
            self.set_meta(node, Placement.shard(len(self.gshape(node)) - 1, sp.parts, sp.size))
            self.check(node)
            return
        # row-parallel: sharded in, partial out -> all-reduce now, bias after the reduction
        x_new = self.sharded(x, xdim)
        if _op(node) is aten.linear:
            node.args = (x_new, w, None)
        elif _op(node) is aten.addmm:
            node.target, node.args = aten.mm.default, (x_new, w)
        else:
            node.args = (x_new, w)
        self.set_meta(node, Placement.partial())
        self.check(node)
        reduced = self.insert(node, collectives.tp_all_reduce, (node, self.axis), R, node)
        result = reduced
        if isinstance(b, fx.Node):
            result = self.insert(reduced, aten.add.Tensor, (reduced, b), R, node)
        node.replace_all_uses_with(result, delete_user_cb=lambda user: user is not reduced)

    def rule_embedding(self, node: fx.Node) -> None:
        w, ids = node.args[0], node.args[1]
        sp = self.param_split.get(w.target) if isinstance(w, fx.Node) and w.op == "get_attr" else None
        if sp is None:
            self.generic(node)
            return
        self.replace_param(w.target, sp.dim, sp.parts, pad=sp.size is not None)
        if sp.dim == 0:
            node.target, node.args, node.kwargs = (
                collectives.vocab_parallel_embedding,
                (w, self.replicated(ids), self.axis),
                {},
            )
            self.set_meta(node, R)
        else:
            self.set_meta(node, Placement.shard(len(self.gshape(node)) - 1))
            self.check(node)

    def rule_sdpa(self, node: fx.Node) -> None:
        q, k, v = node.args[:3]
        places = [self.place.get(t, R) for t in (q, k, v)]
        if not all(p.is_shard and p.dim == 1 and not p.parts for p in places):
            # replicated, or not head-parallel (column-parallel Q with a replicated attention core):
            # gather the inputs and run attention replicated - correct, only slower
            self.generic(node)
            return
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node):
            mshape = self.gshape(mask)
            if len(mshape) == 4 and mshape[1] == self.gshape(q)[1] and mshape[1] > 1:
                node.replace_input_with(mask, self.sharded(mask, 1))
            else:
                node.replace_input_with(mask, self.replicated(mask))
        self.set_meta(node, Placement.shard(1))
        self.check(node)

    def rule_view(self, node: fx.Node) -> None:
        x = node.args[0]
        p = self.place.get(x, R)
        if not (isinstance(p, Placement) and p.is_shard):
            self.generic(node)
            return
        try:
            out_dim = view_shard_dim(self.gshape(x), self.gshape(node), p.dim, self.tp)
        except ValueError as e:
            raise self.fail(node, str(e)) from e
        if p.parts and self.gshape(x)[p.dim] != self.gshape(node)[out_dim]:
            raise self.fail(
                node, "reshape merges a fused projection's output with other dims before its parts are split"
            )
        placement = Placement.shard(out_dim, p.parts)
        node.args = (x, list(local_shape(self.gshape(node), placement, self.tp)), *node.args[2:])
        self.set_meta(node, placement)
        self.check(node)

    def rule_shape_op(self, node: fx.Node) -> None:
        """transpose, permute, unsqueeze, expand, slice, select, split, getitem, cat."""
        op = _op(node)
        if op is aten.cat:
            return self.rule_cat(node)
        x = node.args[0]
        p = self.place.get(x, R)
        if not (isinstance(p, Placement) and p.is_shard):
            return self.generic(node)
        nd = len(self.gshape(x))
        d = p.dim
        if op is aten.transpose:
            a, b = (int(v) % nd for v in node.args[1:3])
            new = b if d == a else a if d == b else d
        elif op is aten.t:
            new = 1 - d
        elif op is aten.permute:
            new = [int(v) % nd for v in node.args[1]].index(d)
        elif op is aten.unsqueeze:
            k = int(node.args[1]) % (nd + 1)
            new = d + 1 if k <= d else d
        elif op is aten.expand:
            sizes = list(node.args[1])
            new = d + len(sizes) - nd
            if sizes[new] != -1:
                sizes[new] = self.gshape(x)[d] // self.tp
            node.args = (x, sizes, *node.args[2:])
        elif op in (aten.slice, aten.select, aten.narrow):
            dim = int(node.args[1]) % nd
            if dim == d:
                raise self.fail(node, f"slicing along the sharded dim {d}")
            new = d - 1 if (op is aten.select and dim < d) else d
        elif op in (aten.split, aten.split_with_sizes):
            return self.rule_split(node, p)
        elif op is aten.chunk:
            dim = int(node.args[2] if len(node.args) > 2 else 0) % nd
            if dim == d:
                raise self.fail(node, f"chunk along the sharded dim {d}")
            self.place[node] = [Placement.shard(d, p.parts)] * len(self.global_val[node])
            node.meta["tp_placement"] = str(p)
            return
        elif op is aten.repeat_interleave:
            if not isinstance(node.args[1], int):
                return self.generic(node)
            new = d  # GQA: each rank repeats its own whole K/V heads to its own query heads
        else:
            raise AssertionError(op)
        self.set_meta(node, Placement.shard(new, p.parts))
        self.check(node)

    def rule_split(self, node: fx.Node, p: Placement) -> None:
        x, size = node.args[0], node.args[1]
        dim = int(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % len(self.gshape(x))
        if dim != p.dim:
            self.place[node] = [Placement.shard(p.dim, p.parts)] * len(self.global_val[node])
            node.meta["tp_placement"] = str(p)
            return
        full = self.gshape(x)[dim]
        sizes = (
            list(size)
            if isinstance(size, (list, tuple))
            else [size] * (full // size) + ([full % size] if full % size else [])
        )
        if not p.parts or list(p.parts) != sizes or any(s % self.tp for s in sizes):
            raise self.fail(
                node, f"split sizes {sizes} along the sharded dim do not match the fused parts {p.parts}"
            )
        local = [s // self.tp for s in sizes]
        node.args = (x, local if isinstance(size, (list, tuple)) else local[0], *node.args[2:])
        self.place[node] = [Placement.shard(dim)] * len(sizes)
        node.meta["tp_placement"] = f"[{Placement.shard(dim)}] * {len(sizes)}"

    def rule_getitem(self, node: fx.Node) -> None:
        src, idx = node.args
        p = self.place.get(src, R)
        if isinstance(p, list):
            self.set_meta(node, p[idx])
        else:
            self.set_meta(node, R)

    def rule_cat(self, node: fx.Node) -> None:
        tensors, dim = node.args[0], (node.args[1] if len(node.args) > 1 else 0)
        places = [self.place.get(t, R) for t in tensors]
        nd = len(self.gshape(node))
        dim = int(dim) % nd
        first = places[0]
        if all(p == first for p in places) and first.is_shard and first.dim != dim and not first.parts:
            self.set_meta(node, first)
            self.check(node)
        else:
            self.generic(node)

    def rule_pointwise(self, node: fx.Node) -> None:
        out_shape = self.gshape(node) if isinstance(self.global_val.get(node), torch.Tensor) else None
        inputs = [a for a in node.all_input_nodes if isinstance(self.global_val.get(a), torch.Tensor)]
        shards = {
            (self.place[a].dim + len(out_shape) - len(self.gshape(a)))
            for a in inputs
            if isinstance(self.place.get(a), Placement) and self.place[a].is_shard and not self.place[a].parts
        }
        if out_shape is None or len(shards) != 1 or any(self.place.get(a, R).kind == "P" for a in inputs):
            return self.generic(node)
        od = shards.pop()
        for a in inputs:
            pa = self.place.get(a, R)
            if pa.is_shard:
                continue
            shape = self.gshape(a)
            ad = od - (len(out_shape) - len(shape))
            if ad >= 0 and shape[ad] != 1:
                node.replace_input_with(a, self.sharded(a, ad))
            else:
                node.replace_input_with(a, self.copy_in(a))
        self.set_meta(node, Placement.shard(od))
        self.check(node)

    def rule_reduction(self, node: fx.Node) -> None:
        x = node.args[0]
        p = self.place.get(x, R)
        if not (isinstance(p, Placement) and p.is_shard) or p.parts:
            return self.generic(node)
        nd = len(self.gshape(x))
        op = _op(node)
        if op in _SOFTMAX:
            dims, keep = [int(node.args[1]) % nd], True
        elif op is aten.layer_norm or op is getattr(aten, "rms_norm", None):
            dims, keep = list(range(nd - len(node.args[1]), nd)), True
        else:
            raw = node.args[1] if len(node.args) > 1 else None
            dims = (
                list(range(nd))
                if raw is None
                else [int(v) % nd for v in (raw if isinstance(raw, (list, tuple)) else [raw])]
            )
            keep = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
        if p.dim in dims:
            return self.generic(node)
        new = p.dim if keep else p.dim - sum(1 for d in dims if d < p.dim)
        self.set_meta(node, Placement.shard(new))
        self.check(node)

    def generic(self, node: fx.Node) -> None:
        """Any op without a sharding rule: run it on replicated inputs (all-gather shards)."""
        for a in list(node.all_input_nodes):
            p = self.place.get(a, R)
            if isinstance(p, Placement) and p.kind != "R":
                node.replace_input_with(a, self.replicated(a))
        val = self.global_val.get(node)
        if isinstance(val, (list, tuple)):
            self.place[node] = [R] * len(val)
        else:
            self.set_meta(node, R)

    # ---------------------------------------------------------------- checking
    def check(self, node: fx.Node) -> None:
        """Re-run `node` on meta tensors of the local input shapes; compare with the placement's shape."""

        def meta(a):
            if isinstance(a, fx.Node):
                v = a.meta.get("val")
                if isinstance(v, torch.Tensor):
                    return torch.empty(v.shape, dtype=v.dtype, device="meta")
                return v
            return a

        if node.target in (collectives.vocab_parallel_embedding,):
            return
        try:
            out = node.target(
                *fx.node.map_aggregate(node.args, meta), **fx.node.map_aggregate(node.kwargs, meta)
            )
        except Exception as e:
            raise self.fail(node, f"could not evaluate the rewritten op on local shapes: {e}") from e
        want = node.meta["val"].shape
        if tuple(out.shape) != tuple(want):
            raise self.fail(
                node,
                f"local shape {tuple(out.shape)} != expected {tuple(want)} for {node.meta['tp_placement']}",
            )

    # ---------------------------------------------------------------- driver
    def run(self) -> fx.GraphModule:
        self.shard_parameters()
        matmuls = {aten.linear, aten.addmm, aten.mm}
        shape_ops = {
            aten.transpose,
            aten.t,
            aten.permute,
            aten.unsqueeze,
            aten.expand,
            aten.slice,
            aten.select,
        }
        shape_ops |= {
            aten.narrow,
            aten.split,
            aten.split_with_sizes,
            aten.cat,
            aten.chunk,
            aten.repeat_interleave,
        }
        views = {aten.view, aten.reshape, aten._unsafe_view}
        reductions = _REDUCE_DIMS | _SOFTMAX | {aten.layer_norm}
        if hasattr(aten, "rms_norm"):
            reductions.add(aten.rms_norm)
        for node in list(self.graph.nodes):
            if node in self.place:
                continue  # inserted by a rule
            if node.op == "get_attr":
                sp = self.param_split.get(node.target)
                if sp is None:
                    self.place[node] = R
                else:
                    self.set_meta(node, sp)
            elif node.op == "placeholder":
                self.place[node] = R
            elif node.op == "output":
                node.args = (fx.node.map_arg(node.args[0], self.replicated),)
            elif node.op == "call_function":
                op = _op(node)
                if any(
                    isinstance(self.place.get(a), Placement) and self.place[a].size
                    for a in node.all_input_nodes
                ) and op not in (aten.linear, aten.addmm, aten.mm, aten.embedding):
                    self.generic(node)  # a padded vocabulary shard is gathered (and unpadded) first
                elif node.target is operator.getitem:
                    self.rule_getitem(node)
                elif op in matmuls:
                    self.rule_matmul(node)
                elif op is aten.embedding:
                    self.rule_embedding(node)
                elif op is aten.scaled_dot_product_attention:
                    self.rule_sdpa(node)
                elif op in views:
                    self.rule_view(node)
                elif op in shape_ops:
                    self.rule_shape_op(node)
                elif op in _SAME:
                    self.rule_same(node)
                elif op in reductions:
                    self.rule_reduction(node)
                elif hasattr(node.target, "tags") and torch.Tag.pointwise in node.target.tags:
                    self.rule_pointwise(node)
                else:
                    self.generic(node)
            else:
                self.generic(node)
        # tied weights (GPT-2 wte / lm_head) reach the graph under one FQN; only those present are checked
        unsharded = [
            f for f in self.param_split if id(operator.attrgetter(f)(self.gm)) not in self._sharded_ids
        ]
        if unsharded:
            raise TensorParallelError(
                f"split weights not used by a matmul or embedding the pass understands: {unsharded}"
            )
        self.graph.lint()
        self.gm.recompile()
        return self.gm

    def rule_same(self, node: fx.Node) -> None:
        x = node.args[0] if node.args else None
        p = self.place.get(x, R) if isinstance(x, fx.Node) else R
        if isinstance(p, Placement) and p.is_shard:
            self.set_meta(node, p)
            self.check(node)
        else:
            self.generic(node)


def apply_tensor_parallel(
    gm: fx.GraphModule,
    splits: Mapping[str, SplitLike],
    tp_rank: int,
    tp_size: int,
    *,
    axis: str = "tp",
    training: bool = False,
) -> fx.GraphModule:
    """Rewrite `gm` in place into rank `tp_rank`'s shard of a `tp_size`-way tensor-parallel model.

    gm: from `planner.frontend.capture.capture` (global shapes in meta). splits: weight FQN -> split (a
    `planner.plan.WeightSplit`); weights not listed are replicated. Returns `gm`. The rewritten
    module calls `passes.collectives` on mesh axis `axis`, which must be registered before it runs.
    Raises TensorParallelError naming the node whose local shape cannot be made right.
    """
    if tp_size == 1:
        return gm
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    return _Rewriter(gm, splits, tp_rank, tp_size, axis, training).run()


def load_sharded_weights(
    gm: fx.GraphModule,
    checkpoint: str | Mapping[str, torch.Tensor],
    splits: Mapping[str, SplitLike],
    tp_rank: int,
    tp_size: int,
) -> fx.GraphModule:
    """Fill a rewritten `gm` (built on `meta`, shards of local shape) with this rank's weight shards.

    checkpoint: the unsharded state dict, or the path of one saved with `torch.save`; a path is
    opened with `mmap=True`, so a rank reads only the slices it keeps and never holds the whole
    model. A colwise weight's bias is sliced like its output. Raises KeyError naming a tensor the
    checkpoint lacks and ValueError for a shape that does not match the plan.
    """
    full = torch.load(checkpoint, mmap=True, weights_only=True) if isinstance(checkpoint, str) else checkpoint
    owners: dict[str, str] = {}
    for node in gm.graph.nodes:  # bias FQN -> weight FQN of colwise matmuls, to slice biases the same way
        if node.op == "call_function" and _op(node) in (aten.linear, aten.addmm):
            w, b = (node.args[1], node.args[2] if len(node.args) > 2 else None)
            if _op(node) is aten.addmm:
                b, w = node.args[0], node.args[2]
            if isinstance(w, fx.Node) and isinstance(b, fx.Node):
                owners[str(b.target)] = str(w.target)
    for name, tensor in list(gm.named_parameters()) + list(gm.named_buffers()):
        if name not in full:
            raise KeyError(
                f"checkpoint has no tensor `{name}`; save non-persistent buffers too: "
                "torch.save({**model.state_dict(), **dict(model.named_buffers())}, path)"
            )
        source = full[name]
        split = splits.get(name)
        if split is None and name in owners and owners[name] in splits:
            split = splits[owners[name]]
            split_dim = 0
        else:
            split_dim = split.dim if split is not None else None
        if split is not None and split.style != "replicate" and tuple(source.shape) != tuple(tensor.shape):
            source = shard_weight(
                source, split_dim, split.parts, tp_rank, tp_size, pad=split.style == "vocab"
            )
        if tuple(source.shape) != tuple(tensor.shape):
            raise ValueError(
                f"`{name}`: checkpoint shape {tuple(source.shape)} != rank shape {tuple(tensor.shape)}"
            )
        owner_path, _, leaf = name.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        value = source.detach().clone().to(dtype=tensor.dtype)
        if leaf in owner._parameters:
            owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=tensor.requires_grad)
        else:
            owner._buffers[leaf] = value
    return gm

"""What a tensor-parallel op rule works with: one rank's rewrite state and the helpers rules share.

A rule (`passes.tp_rules`) gets a `RuleContext` and one node. It reads the placements of the node's
inputs (`ctx.place`), rewires inputs through `replicated` (all-gather), `sharded` (local slice) or
`copy_in` (Megatron's `f` under training) or, under sequence parallelism, `sequence_gathered`
(all-gather of a sequence shard whose backward reduce-scatters), replaces split parameters with
this rank's shard (`replace_param`), records the node's placement and local meta value (`set_meta`), and checks the
rewritten node's local shape (`check`). `run_replicated` is what an op without a sharding rule gets;
when it has to all-gather a sharded input it records the fallback in `node.meta["tp_fallback"]`
(a `Fallback`: op, the user's source line, the gathered inputs and bytes), so that the planner can
price or refuse it (`passes.verify`). `user_line(node)` is the model source line a node came from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx as fx

from passes import collectives
from passes.placement import Placement, local_shape, padded_size, shard_weight
from planner.frontend.capture import user_line

R = Placement.replicate()


class SplitLike(Protocol):
    """What the pass reads from a `planner.plan.WeightSplit`."""

    weight: str
    style: str
    dim: int
    parts: list[int] | None
    pieces: int | None  # colwise over fewer pieces than tp (KV heads replicated, vLLM-style)


FALLBACK_META = "tp_fallback"  # node.meta key of a `Fallback`


def op_label(node: fx.Node) -> str:
    """'aten.chunk' for an ATen overload target; the function's name otherwise."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return f"aten.{packet.__name__}"
    return getattr(target, "__name__", str(target))


@dataclass(frozen=True)
class Fallback:
    """An op the TP pass ran replicated because it has no sharding rule for its inputs' placements.

    node: fx node name; op: 'aten.index_put'; line: `user_line`; gathered: the fx names of the sharded
    inputs it all-gathered; elements: their total global element count; bytes: the same in the
    captured dtype.
    """

    node: str
    op: str
    line: str
    gathered: tuple[str, ...]
    elements: int
    bytes: int
    # context parallelism (`passes.cp_lower`): the nodes after the op that run on the whole sequence on
    # every CP rank (they read the gathered result and stay replicated until a shard meets them)
    region: tuple[str, ...] = ()


class TensorParallelError(ValueError):
    """A node the TP rewrite cannot make correct; the message names the node and the reason.

    node / op / line / why: the fx node name, its op (`op_label`), the user's source line
    (`user_line`) and the reason alone, for messages that name the model's code rather than the graph.
    weights: the FQNs of split weights no rule read (`passes.tensor_parallel`), when that is the fault.
    """

    def __init__(
        self,
        message: str,
        node: str = "",
        op: str = "",
        line: str = "",
        why: str = "",
        weights: tuple[str, ...] = (),
    ):
        super().__init__(message)
        self.node, self.op, self.line, self.why = node, op, line, why or message
        self.weights = weights


class RuleContext:
    """One rank's tensor-parallel rewrite of `gm`: placements so far, inserted collectives, shards.

    place: node -> its Placement, or a list of Placements for a node producing a tuple (split, chunk).
    global_val: node -> its global meta value from capture (inserted nodes reuse their source's).
    param_split: weight FQN -> the Placement of its shard (from the plan's splits; padded for vocab).
    sequence_parallel: the plan's `sequence_parallel` (Korthikanti et al. 2022): row-parallel partial
    sums are reduce-scattered along the token dim (`token_dim`) and the stream between TP blocks is
    a sequence shard.
    stream_outputs: weight FQNs of the projections whose output joins the residual stream (a block's o /
    down): split column-wise, their output is all-gathered at once, as the plan prices it.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        splits: Mapping[str, SplitLike],
        rank: int,
        tp: int,
        axis: str,
        training: bool,
        sequence_parallel: bool = False,
        stream_outputs: frozenset[str] = frozenset(),
    ):
        self.gm, self.graph = gm, gm.graph
        self.stream_outputs = stream_outputs
        self.sequence_parallel = sequence_parallel
        self.splits, self.rank, self.tp, self.axis, self.training = splits, rank, tp, axis, training
        self.place: dict[fx.Node, Any] = {}
        self.global_val: dict[fx.Node, Any] = {n: n.meta.get("val") for n in gm.graph.nodes}
        self._replicated: dict[fx.Node, fx.Node] = {}
        self._copied: dict[fx.Node, fx.Node] = {}
        self._sharded: dict[tuple[fx.Node, int], fx.Node] = {}
        self._sequence_gathered: dict[fx.Node, fx.Node] = {}
        self.param_split: dict[str, Placement] = {}
        self.sharded_ids: set[int] = set()  # id() of the shard Parameters this pass created
        self._plan_parameter_shards()

    def _plan_parameter_shards(self) -> None:
        for node in self.graph.nodes:
            if node.op != "get_attr" or node.target not in self.splits or not node.users:
                continue
            split = self.splits[node.target]
            if split.style == "replicate" or getattr(split, "pieces", None) == 1:
                # one piece (a single KV head, MQA, "each rank holds one KV head"): the whole weight on
                # every rank, so its output is replicated; the attention core takes the heads its query
                # heads use from it (`tp_rules.rule_sdpa`), as it does for replicated K/V in training.
                # (Held as a one-piece shard, the unit heads dim of (B, T, 1, hd) could not be told from
                # the others through reshapes.)
                continue
            length = tuple(self.global_val[node].shape)[split.dim]
            size = padded_size(length, self.tp) if split.style == "vocab" and length % self.tp else None
            self.param_split[node.target] = Placement.shard(
                split.dim, tuple(split.parts) if split.parts else None, size, getattr(split, "pieces", None)
            )

    # ---------------------------------------------------------------- reading
    def fail(self, node: fx.Node, why: str) -> TensorParallelError:
        """The error for `node`: names the node, tp and `why` (the caller raises it)."""
        line = user_line(node)
        return TensorParallelError(
            f"tensor-parallel rewrite of node `{node.format_node()}` (tp={self.tp})"
            + (f" at {line}" if line else "")
            + f": {why}",
            node=node.name,
            op=op_label(node),
            line=line,
            why=why,
        )

    def gshape(self, node: fx.Node) -> tuple[int, ...]:
        """Global shape of `node` (from capture)."""
        return tuple(self.global_val[node].shape)

    def shard_of(self, node: Any) -> Placement | None:
        """`node`'s placement when it is a shard, else None (replicated, partial, not a node)."""
        p = self.place.get(node, R) if isinstance(node, fx.Node) else R
        return p if isinstance(p, Placement) and p.is_shard else None

    def split_param(self, node: Any) -> Placement | None:
        """The shard placement of a split parameter (`get_attr`) node, else None."""
        if isinstance(node, fx.Node) and node.op == "get_attr":
            return self.param_split.get(node.target)
        return None

    # ---------------------------------------------------------------- writing
    def insert(
        self, after: fx.Node, fn: Callable, args: tuple, placement: Placement, global_like: fx.Node
    ) -> fx.Node:
        """Insert `fn(*args)` after `after`, with `global_like`'s global value and `placement`."""
        with self.graph.inserting_after(after):
            new = self.graph.call_function(fn, args)
        self.global_val[new] = self.global_val[global_like]
        self.set_meta(new, placement)
        return new

    def set_meta(self, node: fx.Node, placement: Any) -> None:
        """Record `placement`; a tensor's `meta["val"]` becomes a meta tensor of its local shape."""
        self.place[node] = placement
        node.meta["tp_placement"] = str(placement)
        val = self.global_val.get(node)
        if isinstance(placement, Placement) and isinstance(val, torch.Tensor):
            node.meta["val"] = torch.empty(
                local_shape(tuple(val.shape), placement, self.tp), dtype=val.dtype, device="meta"
            )

    def set_tuple(self, node: fx.Node, placements: list[Placement], label: str) -> None:
        """Record one placement per output of a tuple-producing node; `label` goes to meta, and its
        `meta["val"]` becomes the outputs at their local shapes (later passes read them: context
        parallelism places the node again on these shapes)."""
        self.place[node] = placements
        node.meta["tp_placement"] = label
        val = self.global_val.get(node)
        if isinstance(val, (list, tuple)) and len(val) == len(placements):
            node.meta["val"] = type(val)(
                torch.empty(local_shape(tuple(v.shape), p, self.tp), dtype=v.dtype, device="meta")
                if isinstance(v, torch.Tensor) and isinstance(p, Placement)
                else v
                for v, p in zip(val, placements)
            )

    def replicated(self, node: fx.Node) -> fx.Node:
        """`node` as a replicated value: all-gather a shard (a fused projection's parts each put back
        together); partial sums never leave a matmul rule."""
        p = self.place.get(node, R)
        if not isinstance(p, Placement) or p.is_replicate:
            return node
        if p.is_partial:
            raise self.fail(node, "a partial sum reached an op that needs the full value")
        if p.parts and node not in self._replicated:  # a fused projection's output, gathered part by part
            self._replicated[node] = self.insert(
                node, collectives.tp_gather_parts, (node, p.dim, list(p.parts), self.axis), R, node
            )
        if p.inner:
            raise self.fail(
                node, "a GQA-repeated K/V piece must be reshaped to the query heads before other ops"
            )
        if node not in self._replicated and p.outer:  # strided through a merged dim: reordered after
            self._replicated[node] = self.insert(
                node, collectives.tp_gather_strided, (node, p.dim, p.outer, self.axis), R, node
            )
        if node not in self._replicated and p.pieces:
            self._replicated[node] = self.insert(
                node, collectives.tp_gather_pieces, (node, p.dim, p.pieces, self.axis), R, node
            )
        if node not in self._replicated:
            gathered = self.insert(node, collectives.tp_all_gather, (node, p.dim, self.axis), R, node)
            if p.size:  # a padded vocabulary: drop the padding rows after the gather
                length = self.gshape(node)[p.dim]
                val = self.global_val[node]
                shape = list(val.shape)
                shape[p.dim] = p.size
                gathered.meta["val"] = torch.empty(shape, dtype=val.dtype, device="meta")
                gathered = self.insert(
                    gathered, torch.ops.aten.slice.Tensor, (gathered, p.dim, 0, length), R, node
                )
            self._replicated[node] = gathered
        return self._replicated[node]

    def sharded(self, node: fx.Node, dim: int, pieces: int | None = None) -> fx.Node:
        """`node` sharded along `dim` (slicing a replicated value locally); `pieces`: cut into that many
        pieces shared by tp / pieces ranks each (`Placement.pieces`)."""
        p = self.place.get(node, R)
        want = Placement.shard(dim, pieces=pieces)
        if isinstance(p, Placement) and p == want:
            return node
        full = self.replicated(node)
        if self.gshape(node)[dim] % want.divisor(self.tp):
            raise self.fail(
                node, f"dim {dim} of size {self.gshape(node)[dim]} does not divide by {want.divisor(self.tp)}"
            )
        key = (full, dim, pieces)
        if key not in self._sharded:
            fn, args = (
                (collectives.tp_shard, (full, dim, self.axis))
                if pieces is None
                else (collectives.tp_shard_pieces, (full, dim, pieces, self.axis))
            )
            self._sharded[key] = self.insert(full, fn, args, want, node)
        return self._sharded[key]

    def sharded_strided(self, node: fx.Node, dim: int, outer: int) -> fx.Node:
        """`node` as a shard strided through its merged `dim` with `outer` outer indices
        (`Placement.outer`), slicing a replicated value locally (`collectives.tp_shard_strided`)."""
        want = dataclasses.replace(Placement.shard(dim), outer=outer)
        if self.place.get(node, R) == want:
            return node
        full = self.replicated(node)
        if self.gshape(node)[dim] % outer or (self.gshape(node)[dim] // outer) % self.tp:
            raise self.fail(
                node, f"dim {dim} of size {self.gshape(node)[dim]} is not {outer} x a multiple of {self.tp}"
            )
        key = (full, dim, ("outer", outer))
        if key not in self._sharded:
            self._sharded[key] = self.insert(
                full, collectives.tp_shard_strided, (full, dim, outer, self.axis), want, node
            )
        return self._sharded[key]

    def token_dim(self, node: fx.Node, min_ndim: int = 3) -> int | None:
        """Under sequence parallelism, the dim of `node` that a sequence shard splits: the one before
        the features, (B, T, C) -> 1, when `node` has at least `min_ndim` dims and that dim divides by
        tp; else None (the value stays off the sequence-parallel path). A flattened (B*T, C) is not
        a sequence: a contiguous chunk of it is a batch chunk."""
        val = self.global_val.get(node)
        if not self.sequence_parallel or not isinstance(val, torch.Tensor) or val.dim() < min_ndim:
            return None
        dim = val.dim() - 2
        return dim if val.shape[dim] % self.tp == 0 else None

    def sequence_shard_dim(self, node: fx.Node) -> int | None:
        """The dim of `node`'s plain shard when it is not the last (features) dim - a sequence shard
        under sequence parallelism - else None."""
        p = self.shard_of(node)
        if not self.sequence_parallel or p is None or not p.is_plain_shard:
            return None
        return p.dim if p.dim != len(self.gshape(node)) - 1 else None

    def sequence_gathered(self, node: fx.Node) -> fx.Node:
        """A sequence shard all-gathered for a column-parallel matmul (`tp_sequence_gather`: backward
        reduce-scatters the matmuls' partial input gradients); one gather per value, shared by every
        column-parallel consumer (Q, K, V). Its output must feed only ops with partial input gradients."""
        dim = self.sequence_shard_dim(node)
        assert dim is not None, f"{node.name} is not a sequence shard"
        if node not in self._sequence_gathered:
            self._sequence_gathered[node] = self.insert(
                node, collectives.tp_sequence_gather, (node, dim, self.axis), R, node
            )
        return self._sequence_gathered[node]

    def copy_in(self, node: fx.Node) -> fx.Node:
        """Replicated float input of a shard-producing op: under training, wrap in `tp_copy`."""
        val = self.global_val.get(node)
        if not self.training or not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
            return node
        if node not in self._copied:
            self._copied[node] = self.insert(node, collectives.tp_copy, (node, self.axis), R, node)
        return self._copied[node]

    def replace_param(
        self, fqn: str, dim: int, parts: tuple[int, ...] | None, pad: bool = False, pieces: int | None = None
    ) -> None:
        """Swap parameter `fqn` (and every tied alias of it) for this rank's shard, once."""
        owner_path, _, name = fqn.rpartition(".")
        owner = self.gm.get_submodule(owner_path) if owner_path else self.gm
        full = getattr(owner, name)
        if id(full) in self.sharded_ids:
            return
        try:
            shard = shard_weight(full.detach(), dim, parts, self.rank, self.tp, pad=pad, pieces=pieces)
        except ValueError as e:
            raise TensorParallelError(f"weight `{fqn}` of shape {tuple(full.shape)}: {e}") from e
        new = torch.nn.Parameter(shard, requires_grad=full.requires_grad)
        self.sharded_ids.add(id(new))
        for module in self.gm.modules():  # every alias of a tied weight gets the shard
            for pname, value in list(module._parameters.items()):
                if value is full:
                    module._parameters[pname] = new

    def replace_buffer(self, fqn: str, dim: int, pieces: int | None = None) -> None:
        """Swap buffer (or lifted tensor constant) `fqn`, a KV cache, for this rank's contiguous slice
        along `dim` (one of `pieces` when given), once."""
        owner_path, _, name = fqn.rpartition(".")
        owner = self.gm.get_submodule(owner_path) if owner_path else self.gm
        full = getattr(owner, name)
        if id(full) in self.sharded_ids:
            return
        shard = shard_weight(full.detach(), dim, None, self.rank, self.tp, pieces=pieces).clone()
        self.sharded_ids.add(id(shard))
        if name in owner._buffers:
            owner._buffers[name] = shard
        else:  # a tensor constant lifted by export
            setattr(owner, name, shard)

    def run_replicated(self, node: fx.Node) -> None:
        """Any op without a sharding rule: run it on replicated inputs (all-gather shards). When a
        shard is gathered, the node's meta records it (`FALLBACK_META`: a `Fallback`)."""
        gathered: list[fx.Node] = []
        for a in list(node.all_input_nodes):
            p = self.place.get(a, R)
            if isinstance(p, Placement) and not p.is_replicate:
                node.replace_input_with(a, self.replicated(a))
                gathered.append(a)
        if gathered:
            vals = [self.global_val.get(a) for a in gathered]
            tensors = [v for v in vals if isinstance(v, torch.Tensor)]
            node.meta[FALLBACK_META] = Fallback(
                node=node.name,
                op=op_label(node),
                line=user_line(node),
                gathered=tuple(a.name for a in gathered),
                elements=sum(t.numel() for t in tensors),
                bytes=sum(t.numel() * t.element_size() for t in tensors),
            )
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

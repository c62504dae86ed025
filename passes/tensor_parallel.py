"""Tensor-parallel rewrite: GraphModule -> this rank's GraphModule with weight shards and collectives.

Input: an ATen-level graph from `planner.frontend.capture.capture` (global shapes in `node.meta["val"]`,
parameters as `get_attr` nodes named by FQN) and the plan's weight splits. Output: the same graph,
rewritten in place for one rank of the TP axis:

1. every split parameter is replaced by this rank's shard (`shard_weight`); a column-parallel
   weight's bias is sharded like its output;
2. a placement (`passes.placement.Placement`: replicate / shard(dim) / partial, the plan's
   `Layout`) is propagated through every node in graph order by the op's rule, looked up in the
   table of `passes.tp_rules` (`rule_for`). A matmul with a column-split weight makes a sharded
   output from a replicated input; a row-split weight consumes a sharded input and its partial
   output is all-reduced at once (bias added after the reduction); attention (SDPA) keeps a
   head-sharded layout; reshapes move the shard through `view_shard_dim`; pointwise ops keep it
   (a replicated full-size operand is sliced locally); an op with no entry is treated as pointwise
   when ATen tags it so, and otherwise gets replicated inputs (all-gather) - correct, only slower.
   The rules share one rank's rewrite state, `passes.tp_rules_context.RuleContext`;
3. literal shapes the split changes (`view(B, T, 12, 64)` -> `view(B, T, 12/tp, 64)`, `expand`,
   `split` sizes of fused projections) are rewritten from the propagated local shapes;
4. every rewritten node is re-run on `meta` tensors and its local shape compared with the global
   shape divided as its placement says; any disagreement is a `TensorParallelError` naming the node.
   Nothing passes with a shape the pass could not check.

For training (`training=True`) the Megatron conjugate operators are inserted: `tp_copy` (identity
forward, all-reduce backward) on every replicated float input of an op that produces a shard, and
the all-reduce after a row-split matmul has an identity backward (`passes.collectives`).

Sequence parallelism (`sequence_parallel=True`, Korthikanti et al. 2022): the partial output of a
row-split matmul of shape (B, T, C) is reduce-scattered along T (`tp_reduce_scatter`) instead of
all-reduced, so the norms, dropouts and residual adds between the TP blocks run on this rank's
T / tp tokens (the pointwise, norm and dropout rules keep a shard on a non-reduced dim as it is;
dropout on a shard draws from the per-rank stream); a column-split matmul all-gathers such a
sequence shard (`tp_sequence_gather`, one gather shared by Q, K and V) and, in backward, the two
swap (reduce-scatter <-> all-gather). The token embedding's lookup is reduce-scattered along the
tokens (vocab-split) or cut to this rank's tokens (replicated) so that the stream enters the layers
sharded; the LM head's column-parallel matmul gathers it back. A replicated weight used on a
sequence shard (a norm's scale, a row-parallel bias) gets `tp_copy`, so its gradient is summed over
the ranks' tokens. Ops that need the whole sequence (a reshape merging B and T, a slice along T)
gather it first (a recorded fallback). Shapes that are not (B, T, C) with T divisible by tp keep the
plain all-reduce.

Node metadata written: `node.meta["tp_placement"]` (str), `node.meta["val"]` (a meta tensor of the
local shape).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from passes import collectives
from passes.checkpoint import SUFFIX, SafetensorsCheckpoint, checkpoint_files
from passes.expert_parallel import expert_shard
from passes.general_rules import general_rule, strided_general_rule
from passes.placement import Placement, loss_output, padded_size, shard_weight
from passes.recompute import region_graph
from passes.tp_rules import CARRY_STRIDED, RuleEntry, rule_for
from passes.tp_rules_context import FALLBACK_META, R, RuleContext, SplitLike, TensorParallelError, op_label
from planner.frontend.capture import user_line

__all__ = [
    "SplitLike",
    "TensorParallelError",
    "apply_tensor_parallel",
    "load_sharded_weights",
    "padded_size",
    "read_local_shards",
    "rule_coverage",
    "shard_weight",
]

aten = torch.ops.aten
RULE_META = "tp_rule"  # node.meta key: "general" | "own" | "replicated" (`rule_coverage`)


@dataclass(frozen=True)
class OutputShard:
    """The graph's first output left sharded for a loss computed on the shards (`shard_output`):
    along `dim`, `length` elements whole (a padded vocabulary: without its padding), `local` per rank;
    rank r holds [r * local, (r + 1) * local), of which the part before `length` is real
    (`runtime.loss.output_loss`). Recorded as ``gm.meta[OUTPUT_SHARD]``."""

    dim: int
    length: int
    local: int


OUTPUT_SHARD = "tp_output_shard"


def _outputs(ctx: RuleContext, out, shard_output: bool):
    """The output node's argument: every output replicated (gathered), but with `shard_output` the
    first left as it is when it is a plain shard (an LM head's vocabulary split: the loss runs
    vocab-parallel, as Megatron-LM's and torchtitan's loss_parallel do), recorded as an `OutputShard`."""
    first = loss_output(out)
    keep = None
    if shard_output and isinstance(first, fx.Node):
        p = ctx.shard_of(first)
        if p is not None and not p.parts and not p.pieces and not p.inner:
            length = ctx.gshape(first)[p.dim]
            keep = first
            ctx.gm.meta[OUTPUT_SHARD] = OutputShard(p.dim, length, (p.size or length) // ctx.tp)

    def place(n: fx.Node) -> fx.Node:
        nonlocal keep
        if n is keep:  # the first output only (visited first): the same node returned again is gathered
            keep = None
            return n
        return ctx.replicated(n)

    return fx.node.map_arg(out, place)


def _propagate(ctx: RuleContext, shard_output: bool = False) -> None:
    """Give every node of the graph, in order, a placement: parameters and inputs directly, calls by
    their op's rule; the graph's outputs are replicated (`_outputs`: with `shard_output` the first may
    stay a shard)."""
    for node in list(ctx.graph.nodes):
        if node in ctx.place:
            continue  # inserted by a rule
        if node.op == "get_attr":
            sp = ctx.param_split.get(node.target)
            if sp is None:
                ctx.place[node] = R
            else:
                ctx.set_meta(node, sp)
        elif node.op == "placeholder":
            ctx.place[node] = R
        elif node.op == "output":
            node.args = (_outputs(ctx, node.args[0], shard_output),)
        elif node.op == "call_function":
            entry = rule_for(node.target)
            padded = any(
                isinstance(ctx.place.get(a), Placement) and ctx.place[a].size for a in node.all_input_nodes
            )
            strided = any(
                isinstance(ctx.place.get(a), Placement) and ctx.place[a].outer for a in node.all_input_nodes
            )
            if (
                strided
                and entry.rule not in CARRY_STRIDED
                and entry.general
                and not (entry.claims and entry.claims(node))
                and not padded
                and strided_general_rule(ctx, node)
            ):  # a per-row op (batched matmul, pointwise) on a shard strided through a merged dim
                node.meta[RULE_META] = "general"
            elif (padded and not entry.padded_inputs) or (strided and entry.rule not in CARRY_STRIDED):
                # a padded vocabulary shard is gathered (and unpadded) first; a shard strided through a
                # merged dim (`Placement.outer`) is gathered (and reordered) for any other op than a
                # reshape, transpose, copy or one `strided_general_rule` places: the other rules read
                # a plain, contiguous shard
                ctx.run_replicated(node)
                node.meta[RULE_META] = "replicated"
            elif entry.general and not (entry.claims and entry.claims(node)) and general_rule(ctx, node):
                node.meta[RULE_META] = "general"
            else:
                entry.rule(ctx, node)
                node.meta[RULE_META] = _kind_of(ctx, node, entry)
        else:
            ctx.run_replicated(node)


def _kind_of(ctx: RuleContext, node: fx.Node, entry: RuleEntry) -> str:
    """'own' when our rule placed a shard in or out of `node`, else 'replicated' (`RULE_META`)."""
    if entry.rule is RuleContext.run_replicated or FALLBACK_META in node.meta:
        return "replicated"
    outs = ctx.place.get(node, R)
    outs = outs if isinstance(outs, list) else [outs]
    ins = [ctx.place.get(a, R) for a in node.all_input_nodes]
    return "own" if any(isinstance(p, Placement) and not p.is_replicate for p in outs + ins) else "replicated"


def rule_coverage(gm: fx.GraphModule) -> dict[str, int]:
    """How the TP pass placed the calls of the captured graph: {'general': placed by DTensor's sharding
    semantics (`passes.general_rules`), 'own': by a rule of ours (`passes.tp_rules`), 'replicated': run
    whole on replicated inputs (a gathered one has a `tp_fallback`)}. Nodes the pass inserted
    (collectives, slices) are not counted."""
    counts = {"general": 0, "own": 0, "replicated": 0}
    for node in gm.graph.nodes:
        kind = node.meta.get(RULE_META)
        if kind in counts:
            counts[kind] += 1
    return counts


def apply_tensor_parallel(
    gm: fx.GraphModule,
    splits: Mapping[str, SplitLike],
    tp_rank: int,
    tp_size: int,
    *,
    axis: str = "tp",
    training: bool = False,
    sequence_parallel: bool = False,
    stream_outputs: frozenset[str] = frozenset(),
    shard_output: bool = False,
) -> fx.GraphModule:
    """Rewrite `gm` in place into rank `tp_rank`'s shard of a `tp_size`-way tensor-parallel model.

    gm: from `planner.frontend.capture.capture` (global shapes in meta). splits: weight FQN -> split (a
    `planner.plan.WeightSplit`); weights not listed are replicated. Returns `gm`. The rewritten
    module calls `passes.collectives` on mesh axis `axis`, which must be registered before it runs.
    sequence_parallel: keep the stream between TP blocks sharded along the sequence (module docstring).
    stream_outputs: weight FQNs of the projections whose output joins the residual stream
    (`passes.lower.stream_output_weights`): a column-parallel one is all-gathered right after it.
    shard_output: training with the loss on the shards: the first output stays sharded when it is
    (the LM head's logits on the vocabulary), ``gm.meta[OUTPUT_SHARD]`` saying how (`OutputShard`).
    Raises TensorParallelError naming the node whose local shape cannot be made right.
    """
    if tp_size == 1:
        return gm
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    ctx = RuleContext(gm, splits, tp_rank, tp_size, axis, training, sequence_parallel, stream_outputs)
    _propagate(ctx, shard_output)
    # tied weights (GPT-2 wte / lm_head) reach the graph under one FQN; only those present are checked
    unsharded = [f for f in ctx.param_split if id(operator.attrgetter(f)(gm)) not in ctx.sharded_ids]
    if unsharded:
        raise _unsharded_weights_error(gm, unsharded)
    gm.graph.lint()
    gm.recompile()
    return gm


def _unsharded_weights_error(gm: fx.GraphModule, unsharded: list[str]) -> TensorParallelError:
    """The error for weights the plan splits that no rule consumed: it names the first one's first
    user (the op that reads it, and its model line) so that the user sees which code the pass does not
    understand."""
    reader = next(
        (u for n in gm.graph.nodes if n.op == "get_attr" and n.target == unsharded[0] for u in n.users), None
    )
    while reader is not None and _inserted(reader) and reader.users:  # a gather the pass put before the op
        reader = next(iter(reader.users))
    names = ", ".join(unsharded[:3]) + (f" and {len(unsharded) - 3} more" if len(unsharded) > 3 else "")
    why = f"the split weights {names} are not read by a matmul or embedding the tensor-parallel pass understands"
    if reader is None:
        return TensorParallelError(why, why=why, weights=tuple(unsharded))
    return TensorParallelError(
        f"{why} ({op_label(reader)} at {reader.name})",
        node=reader.name,
        op=op_label(reader),
        line=user_line(reader),
        why=why,
        weights=tuple(unsharded),
    )


def _inserted(node: fx.Node) -> bool:
    """A node of this project's collectives (`passes.collectives`), which the TP pass inserts."""
    return getattr(node.target, "__module__", "") == collectives.__name__


def load_sharded_weights(
    gm: fx.GraphModule,
    checkpoint: str | Sequence[str] | Mapping[str, torch.Tensor] | SafetensorsCheckpoint,
    splits: Mapping[str, SplitLike],
    tp_rank: int,
    tp_size: int,
) -> fx.GraphModule:
    """Fill a rewritten `gm` (built on `meta`, shards of local shape) with this rank's weight shards.

    checkpoint: the unsharded state dict (parameters and buffers, non-persistent ones included);
    a `.safetensors` file, a directory of them or a list of files (read slice by slice through
    `passes.checkpoint.SafetensorsCheckpoint`: a rank reads only the rows it keeps); any other path
    is opened with `torch.load(mmap=True)`. A colwise weight's bias is sliced like its output.
    Raises KeyError naming a tensor the checkpoint lacks and ValueError for a shape that does not
    match the plan.
    """
    names = [name for name, _ in list(gm.named_parameters()) + list(gm.named_buffers())]
    for name, value in read_local_shards(gm, checkpoint, splits, tp_rank, tp_size, names).items():
        owner_path, _, leaf = name.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        if leaf in owner._parameters:
            old = owner._parameters[leaf]
            owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=old.requires_grad)
        else:
            owner._buffers[leaf] = value
    return gm


def read_local_shards(
    gm: fx.GraphModule,
    checkpoint: str | Sequence[str] | Mapping[str, torch.Tensor] | SafetensorsCheckpoint,
    splits: Mapping[str, SplitLike],
    tp_rank: int,
    tp_size: int,
    names: Sequence[str],
) -> dict[str, torch.Tensor]:
    """This rank's shard of each tensor `names` of `gm` (parameters or buffers), read from the
    unsharded `checkpoint` (see `load_sharded_weights`), in the dtype of `gm`'s tensor. Also reads
    tensors shaped like the parameters, e.g. the unsharded model's gradients saved under the same
    names. Raises KeyError naming a missing tensor, ValueError for a shape that does not match."""
    source = _open_checkpoint(checkpoint)
    try:
        owners = _bias_owners(gm)
        local = dict(gm.named_parameters())
        local.update(dict(gm.named_buffers()))
        out: dict[str, torch.Tensor] = {}
        for name in names:
            tensor = local[name]
            if name not in source:
                raise KeyError(
                    f"checkpoint has no tensor `{name}`; save non-persistent buffers too: "
                    "{**model.state_dict(), **dict(model.named_buffers())}"
                )
            split = splits.get(name)
            split_dim = split.dim if split is not None else None
            if split is None and name in owners and owners[name] in splits:
                split, split_dim = splits[owners[name]], 0
            full_shape = tuple(source.shape(name)) if isinstance(source, SafetensorsCheckpoint) else None
            sharded = (
                split is not None
                and split.style != "replicate"
                and (full_shape if full_shape is not None else tuple(source[name].shape))
                != tuple(tensor.shape)
            )
            pad = split is not None and split.style == "vocab"
            pieces = getattr(split, "pieces", None)
            if isinstance(source, SafetensorsCheckpoint):
                value = (
                    source.read_shard(name, split_dim, split.parts, tp_rank, tp_size, pad=pad, pieces=pieces)
                    if sharded
                    else source.read(name)
                )
            else:
                value = source[name]
                if sharded:
                    value = shard_weight(
                        value, split_dim, split.parts, tp_rank, tp_size, pad=pad, pieces=pieces
                    )
                value = value.detach().clone()
            ep_shard = gm.meta.get("ep_shards", {}).get(name)  # this rank's experts (`passes.ep_lower`)
            if ep_shard is not None and tuple(value.shape) != tuple(tensor.shape):
                # a copy: the slice would keep every expert's storage alive (and counted) on this rank
                value = expert_shard(value, ep_shard).clone()
            if split is None and tuple(value.shape) != tuple(tensor.shape):
                value = self_sharded_piece(value, tuple(tensor.shape), tp_rank, tp_size, name)
            if tuple(value.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"`{name}`: checkpoint shape {tuple(value.shape)} != rank shape {tuple(tensor.shape)}"
                )
            out[name] = value.to(dtype=tensor.dtype)
        return out
    finally:
        if isinstance(source, SafetensorsCheckpoint) and source is not checkpoint:
            source.close()


def self_sharded_piece(
    whole: torch.Tensor, local_shape: tuple[int, ...], tp_rank: int, tp_size: int, name: str
) -> torch.Tensor:
    """This rank's piece of a tensor the TP pass sharded on its own, with no split in the plan (a KV
    cache along its heads, with the K/V projections that fill it): its one dim that differs from
    ``local_shape`` is cut into whole / local pieces and the rank takes piece tp_rank * pieces //
    tp_size (an even 1/tp shard, or a KV head replicated on tp / pieces ranks). Raises ValueError for
    a shape that is no such shard."""
    differ = [d for d, (a, b) in enumerate(zip(whole.shape, local_shape)) if a != b]
    if len(differ) != 1 or whole.dim() != len(local_shape) or whole.shape[differ[0]] % local_shape[differ[0]]:
        raise ValueError(f"`{name}`: rank shape {local_shape} is no shard of {tuple(whole.shape)}")
    pieces = whole.shape[differ[0]] // local_shape[differ[0]]
    return whole.chunk(pieces, dim=differ[0])[tp_rank * pieces // tp_size]


def _open_checkpoint(
    checkpoint: str | Sequence[str] | Mapping[str, torch.Tensor] | SafetensorsCheckpoint,
) -> Mapping[str, torch.Tensor] | SafetensorsCheckpoint:
    if isinstance(checkpoint, (SafetensorsCheckpoint, Mapping)):
        return checkpoint
    if isinstance(checkpoint, str) and os.path.isfile(checkpoint) and not checkpoint.endswith(SUFFIX):
        return torch.load(checkpoint, mmap=True, weights_only=True)
    return SafetensorsCheckpoint(checkpoint_files(checkpoint))


def _bias_owners(gm: fx.GraphModule) -> dict[str, str]:
    """Bias FQN -> weight FQN of the graph's linear/addmm nodes (and of the column-parallel matmuls the
    TP-overlap pass fused them into): a colwise weight's bias is sliced the same way. Looks into the
    submodules fused from the graph's nodes (`passes.recompute`'s regions, whose parameters stay
    get_attr nodes outside them and come in as their placeholders), following each placeholder to the
    node the region is called with."""
    from passes.tp_overlap import tp_column_matmuls  # noqa: PLC0415 (it imports this module's users)

    owners: dict[str, str] = {}

    def visit(module: fx.GraphModule, outer: dict[fx.Node, fx.Node]) -> None:
        def attr(n: object) -> str | None:  # the parameter a value is, through region placeholders
            n = outer.get(n, n) if isinstance(n, fx.Node) else n
            return str(n.target) if isinstance(n, fx.Node) and n.op == "get_attr" else None

        for node in module.graph.nodes:
            if node.op == "call_module":
                inner = region_graph(module, node)
                if inner is not None:
                    params = [n for n in inner.graph.nodes if n.op == "placeholder"]
                    mapping = {
                        p: outer.get(a, a) for p, a in zip(params, node.args) if isinstance(a, fx.Node)
                    }
                    visit(inner, mapping)
                continue
            if node.op == "call_function" and node.target is tp_column_matmuls:  # (x, weights, biases, ...)
                for w, b in zip(node.args[1], node.args[2]):
                    if attr(w) and attr(b):
                        owners[attr(b)] = attr(w)
                continue
            op = getattr(node.target, "overloadpacket", node.target)
            if node.op == "call_function" and op in (aten.linear, aten.addmm):
                w, b = (node.args[1], node.args[2] if len(node.args) > 2 else None)
                if op is aten.addmm:
                    b, w = node.args[0], node.args[2]
                if attr(w) and attr(b):
                    owners[attr(b)] = attr(w)

    visit(gm, {})
    return owners

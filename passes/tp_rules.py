"""Tensor-parallel op rules: a table from ATen op to the function that places and rewrites its node.

`RULES` maps an ATen `OpOverload` or `OpOverloadPacket` (or `operator.getitem`) to a rule, filled by
`@register_rule(op, ...)`. A rule is `rule(ctx, node) -> None` (`ctx`: a
`passes.tp_rules_context.RuleContext`): it reads its inputs' placements, rewrites the node for this
rank (input collectives, shard-sized literals, shard parameters) and records the node's placement.
`rule_for(target)` is the dispatch: the overload's entry, else its packet's, else - for an op with no
entry - the pointwise rule when ATen tags the op pointwise and `RuleContext.run_replicated` (inputs
all-gathered, output replicated: correct, only slower) otherwise.

A rule that says "replicated" falls back to `ctx.run_replicated`, which gathers any sharded input. An
input holding a padded vocabulary shard is gathered (and unpadded) before any rule runs, except for
entries registered with `padded_inputs=True` (matmul, embedding).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._ops import OpOverload, OpOverloadPacket

from passes import collectives, rng
from passes.placement import Placement, local_shape, view_groups, view_shard_dim
from passes.tp_rules_context import R, RuleContext
from planner.frontend.capture import einsum_terms

aten = torch.ops.aten
Rule = Callable[[RuleContext, fx.Node], None]


@dataclass(frozen=True)
class RuleEntry:
    """A registered rule; `padded_inputs`: it takes a padded vocabulary shard as it is. `general`: on
    plain placements (`passes.general_rules.is_plain`) DTensor's sharding semantics decide first
    (`passes.general_rules.general_rule`) and this rule is only for the layouts they have no word
    for (a fused projection's parts, K/V pieces) or what they leave replicated. `claims`: the nodes
    of the op this rule takes before DTensor's semantics are asked (None: none)."""

    rule: Rule
    padded_inputs: bool = False
    general: bool = False
    claims: Callable[[fx.Node], bool] | None = None


class RuleTable:
    """ATen op (overload, packet, or `operator.getitem`) -> RuleEntry; one entry per op."""

    def __init__(self) -> None:
        self._entries: dict[object, RuleEntry] = {}

    def register(
        self,
        *ops: object,
        padded_inputs: bool = False,
        general: bool = False,
        claims: Callable[[fx.Node], bool] | None = None,
    ) -> Callable[[Rule], Rule]:
        """Decorator: `rule` handles every op in `ops`. Raises ValueError when an op already has a rule
        (also an overload whose packet has one, or a packet one of whose overloads has one)."""
        if not ops:
            raise ValueError("register a rule for at least one op")

        def add(rule: Rule) -> Rule:
            for op in ops:
                clash = self._clash(op)
                if clash is not None:
                    raise ValueError(
                        f"{op} already has a tensor-parallel rule ({clash}: "
                        f"{self._entries[clash].rule.__name__}); not registering {rule.__name__}"
                    )
            for op in ops:
                self._entries[op] = RuleEntry(rule, padded_inputs, general, claims)
            return rule

        return add

    def _clash(self, op: object) -> object | None:
        if op in self._entries:
            return op
        if isinstance(op, OpOverload) and op.overloadpacket in self._entries:
            return op.overloadpacket
        if isinstance(op, OpOverloadPacket):
            return next((k for k in self._entries if getattr(k, "overloadpacket", None) is op), None)
        return None

    def lookup(self, target: object) -> RuleEntry | None:
        """The entry of `target` (an fx node's target): its overload's, else its packet's, else None."""
        entry = self._entries.get(target)
        if entry is None and isinstance(target, OpOverload):
            entry = self._entries.get(target.overloadpacket)
        return entry

    def __contains__(self, target: object) -> bool:
        return self.lookup(target) is not None

    def ops(self) -> list[object]:
        """Every registered key."""
        return list(self._entries)


RULES = RuleTable()
register_rule = RULES.register


def pointwise_overloads(*packets: OpOverloadPacket) -> list[OpOverload]:
    """The overloads of `packets` that ATen tags pointwise (`torch.Tag.pointwise`)."""
    found = []
    for packet in packets:
        tagged = [
            getattr(packet, name)
            for name in packet.overloads()
            if torch.Tag.pointwise in getattr(packet, name).tags
        ]
        assert tagged, f"{packet} has no pointwise overload"
        found += tagged
    return found


# ---------------------------------------------------------------- matmul and embedding
def _matmul_operands(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None, int]:
    """(x, weight, bias, weight's output dim) of linear(x, w, b), addmm(b, x, w), mm(x, w) or
    matmul(x, w)."""
    op = getattr(node.target, "overloadpacket", node.target)
    if op is aten.linear:
        return node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else None, 0
    if op is aten.addmm:
        return node.args[1], node.args[2], node.args[0], 1
    return node.args[0], node.args[1], None, 1


@register_rule(aten.linear, aten.addmm, aten.mm, padded_inputs=True)
def rule_matmul(ctx: RuleContext, node: fx.Node) -> None:
    """Split weight: Megatron column-parallel (R in, S(-1) out) or row-parallel (S in, P all-reduced to R)."""
    x, w, b, out_dim_of_w = _matmul_operands(node)
    sp = ctx.split_param(w)
    if sp is None and _token_wise(ctx, node, x, w, b):
        return
    if sp is None:
        ctx.run_replicated(node)
        return
    ctx.replace_param(w.target, sp.dim, sp.parts, pad=sp.size is not None, pieces=sp.pieces)
    if sp.dim == out_dim_of_w:
        _column_parallel(ctx, node, x, b, sp)
        if w.target in ctx.stream_outputs:
            # a block's output projection split column-wise: the plan prices its S -> R all-gather
            # here, where the output joins the residual stream (not at the next norm, which cannot
            # run on a feature shard)
            gathered = ctx.replicated(node)
            node.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not gathered)
    else:
        _row_parallel(ctx, node, x, w, b)


def is_weight_product(node: fx.Node) -> bool:
    """`aten.matmul(x, W)` of an activation of 2 dims or more and a 2-D parameter W in (in, out)
    layout: the projection `x @ W` makes (a JAX port's, or an einsum `"btd,df->btf"` that capture
    writes so), split as `aten.mm(x, W)` is."""
    if len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
        return False
    x, w = node.args
    xv, wv = x.meta.get("val"), w.meta.get("val")
    return (
        w.op == "get_attr"
        and isinstance(wv, torch.Tensor)
        and wv.dim() == 2
        and (isinstance(xv, torch.Tensor) and xv.dim() >= 2)
    )


@register_rule(aten.matmul, padded_inputs=True, general=True, claims=is_weight_product)
def rule_matmul_call(ctx: RuleContext, node: fx.Node) -> None:
    """Projection `x @ W` (`is_weight_product`): `rule_matmul`; other products DTensor left: replicated."""
    if is_weight_product(node):
        rule_matmul(ctx, node)
    else:
        ctx.run_replicated(node)


def _token_wise(ctx: RuleContext, node: fx.Node, x: fx.Node, w: fx.Node, b: fx.Node | None) -> bool:
    """A replicated weight applied to a sequence shard (sequence parallelism: a LoRA adapter's down
    projection beside a column-parallel one reads the block's input shard, its up projection beside a
    row-parallel one the reduce-scattered shard): a linear acts on each token alone, so it runs on this
    rank's tokens and its output stays a sequence shard, no gather. Under training the weight (and
    bias) get `tp_copy`: their gradients, summed over this rank's tokens, are summed over the ranks.
    Sets the placement and returns True; False when `x` is not a sequence shard of an nn.Linear call."""
    dim = ctx.sequence_shard_dim(x)
    op = getattr(node.target, "overloadpacket", node.target)
    if dim is None or op is not aten.linear or ctx.split_param(b) is not None:
        return False
    node.replace_input_with(w, ctx.copy_in(w))
    if isinstance(b, fx.Node):
        node.replace_input_with(b, ctx.copy_in(b))
    ctx.set_meta(node, Placement.shard(dim))
    ctx.check(node)
    return True


def _column_parallel(ctx: RuleContext, node: fx.Node, x: fx.Node, b: fx.Node | None, sp: Placement) -> None:
    """Replicated input (tp_copy under training), output sharded like the weight; bias sharded too.
    A sequence shard (sequence parallelism) is all-gathered by `tp_sequence_gather` (backward:
    reduce-scatter) instead."""
    if isinstance(b, fx.Node):
        ctx.replace_param(b.target, 0, sp.parts, pad=sp.size is not None, pieces=sp.pieces)
        ctx.set_meta(b, dataclasses.replace(sp, dim=0))
    if sp.pieces and ctx.training:
        raise ctx.fail(
            node, "K/V heads replicated over ranks (fewer KV heads than tp) are for inference plans only"
        )
    if ctx.sequence_shard_dim(x) is not None:
        node.replace_input_with(x, ctx.sequence_gathered(x))
    else:
        node.replace_input_with(x, ctx.copy_in(ctx.replicated(x)))
    ctx.set_meta(node, dataclasses.replace(sp, dim=len(ctx.gshape(node)) - 1))
    ctx.check(node)


def _row_parallel(ctx: RuleContext, node: fx.Node, x: fx.Node, w: fx.Node, b: fx.Node | None) -> None:
    """Input sharded on its last dim, partial output all-reduced at once, the bias added after. Under
    sequence parallelism a (B, T, C) partial output is reduce-scattered along T instead (a sequence
    shard; the bias, replicated, is added to each shard and its gradient summed by `tp_copy`)."""
    x_new = ctx.sharded(x, len(ctx.gshape(x)) - 1)
    op = getattr(node.target, "overloadpacket", node.target)
    if op is aten.linear:
        node.args = (x_new, w, None)
    elif op is aten.addmm:
        node.target, node.args = aten.mm.default, (x_new, w)
    else:
        node.args = (x_new, w)
    ctx.set_meta(node, Placement.partial())
    ctx.check(node)
    seq = ctx.token_dim(node)
    if seq is None:
        reduced = ctx.insert(node, collectives.tp_all_reduce, (node, ctx.axis), R, node)
    else:
        reduced = ctx.insert(
            node, collectives.tp_reduce_scatter, (node, seq, ctx.axis), Placement.shard(seq), node
        )
    result = reduced
    if isinstance(b, fx.Node):
        bias = b if seq is None else ctx.copy_in(b)
        result = ctx.insert(reduced, aten.add.Tensor, (reduced, bias), ctx.place[reduced], node)
    node.replace_all_uses_with(result, delete_user_cb=lambda user: user is not reduced)


@register_rule(aten.embedding, padded_inputs=True)
def rule_embedding(ctx: RuleContext, node: fx.Node) -> None:
    """Vocab-split table: vocab-parallel lookup (masked, all-reduced, R); hidden-split table: S(-1)."""
    # Sequence parallelism: the lookup's sum is reduce-scattered along the tokens (a vocab-split table)
    # or a replicated lookup is cut to this rank's tokens (`tp_shard`): the stream enters the layers
    # as a sequence shard.
    w, ids = node.args[0], node.args[1]
    sp = ctx.split_param(w)
    seq = ctx.token_dim(node, min_ndim=2)
    if sp is None:
        ctx.run_replicated(node)
        if seq is not None:
            users = [u for u in node.users if u not in ctx.place]
            shard = ctx.sharded(node, seq)
            for user in users:
                user.replace_input_with(node, shard)
        return
    ctx.replace_param(w.target, sp.dim, sp.parts, pad=sp.size is not None)
    if sp.dim == 0:
        # aten.embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False)
        given = dict(zip(("padding_idx", "scale_grad_by_freq"), node.args[2:4])) | dict(node.kwargs)
        padding_idx = given.get("padding_idx", -1)
        padding_idx = padding_idx if isinstance(padding_idx, int) and padding_idx >= 0 else None
        if given.get("scale_grad_by_freq"):
            raise ctx.fail(node, "scale_grad_by_freq counts token frequencies over the whole vocabulary")
        node.target, node.args, node.kwargs = (
            collectives.vocab_parallel_embedding,
            (w, ctx.replicated(ids), ctx.axis, *(() if seq is None else (seq,))),
            {} if padding_idx is None else {"padding_idx": padding_idx},
        )
        ctx.set_meta(node, R if seq is None else Placement.shard(seq))
    else:
        ctx.set_meta(node, Placement.shard(len(ctx.gshape(node)) - 1))
        ctx.check(node)


# ---------------------------------------------------------------- attention
@register_rule(aten.scaled_dot_product_attention)
def rule_sdpa(ctx: RuleContext, node: fx.Node) -> None:
    """Q, K, V sharded on heads (dim 1; replicated K/V repeated to the query heads sliced locally): S(1) out."""
    q, k, v = node.args[:3]
    for t in (k, v):
        p = ctx.place.get(t, R)
        if ctx.sequence_parallel and p.is_plain_shard and p.dim == len(ctx.gshape(t)) - 2:
            # K / V of a row-parallel projection reduce-scattered along the sequence (sequence
            # parallelism: MQA's key/value projection, whose one head is not cut): gathered back, the
            # pair costing what the all-reduce the plan priced (P -> R) does
            node.replace_input_with(t, ctx.replicated(t))
    q, k, v = node.args[:3]
    places = [ctx.place.get(t, R) for t in (q, k, v)]
    pq = places[0]
    heads = ctx.gshape(q)[1] if len(ctx.gshape(q)) > 1 else 0

    def takes(t: fx.Node, p: Placement) -> bool:  # K / V as it is, or cut to the rank's heads below
        if not p.is_replicate:
            return p.is_shard and p.dim == 1 and not p.parts
        kv = ctx.gshape(t)[1]
        gqa = node.kwargs.get("enable_gqa") and heads % kv == 0 and (kv % ctx.tp == 0 or ctx.tp % kv == 0)
        return kv == heads or bool(gqa)

    # K / V are cut to the rank's heads only when all three go head-parallel: a piece cut for an
    # attention that then runs replicated would be gathered again (and `tp_gather_pieces` has no backward)
    if pq.is_shard and pq.dim == 1 and not pq.parts and all(takes(t, p) for t, p in zip((k, v), places[1:])):
        for t, p in zip((k, v), places[1:]):
            if not p.is_replicate:
                continue
            kv = ctx.gshape(t)[1]
            if kv == heads:
                # replicated K/V (GQA with fewer KV heads than ranks, repeated to the query heads): each
                # rank takes the heads its query heads use, a local slice
                node.replace_input_with(t, ctx.sharded(t, 1))
            elif node.kwargs.get("enable_gqa") and heads % kv == 0 and (kv % ctx.tp == 0 or ctx.tp % kv == 0):
                # replicated K/V with fewer heads, grouped by SDPA itself (enable_gqa; MQA's one KV head
                # held whole by every rank): the KV heads this rank's query heads use, an even shard
                # (backward: all-gathered) or, fewer KV heads than ranks, the one head of its group,
                # whose gradient the ranks sharing it sum (tp_copy's all-reduce of the zero-padded
                # slices' gradients under training)
                if kv % ctx.tp == 0:
                    node.replace_input_with(t, ctx.sharded(t, 1))
                else:
                    src = ctx.copy_in(t)
                    piece = ctx.insert(
                        src,
                        collectives.tp_shard_pieces,
                        (src, 1, kv, ctx.axis),
                        Placement.shard(1, pieces=kv),
                        t,
                    )
                    node.replace_input_with(t, piece)
        places = [ctx.place.get(t, R) for t in node.args[:3]]
    if not all(p.is_shard and p.dim == 1 and not p.parts for p in places):
        # replicated, or not head-parallel (column-parallel Q with a replicated attention core):
        # gather the inputs and run attention replicated - correct, only slower
        ctx.run_replicated(node)
        return
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, fx.Node):
        mshape = ctx.gshape(mask)
        if len(mshape) == 4 and mshape[1] == ctx.gshape(q)[1] and mshape[1] > 1:
            node.replace_input_with(mask, ctx.sharded(mask, 1))
        else:
            node.replace_input_with(mask, ctx.replicated(mask))
    _sdpa_dropout_per_rank(ctx, node)
    ctx.set_meta(node, Placement.shard(1))
    ctx.check(node)


def _sdpa_dropout_per_rank(ctx: RuleContext, node: fx.Node) -> None:
    """Head-parallel attention with dropout: the dropout draws from this rank's sharded RNG stream."""
    names = ("attn_mask", "dropout_p", "is_causal")
    defaults = (None, 0.0, False)
    full = list(node.args[:3]) + [
        node.args[3 + i] if len(node.args) > 3 + i else node.kwargs.get(name, default)
        for i, (name, default) in enumerate(zip(names, defaults))
    ]
    if not full[4]:
        return
    node.target = rng.tp_scaled_dot_product_attention
    node.args = (*full, ctx.axis)
    node.kwargs = {k: v for k, v in node.kwargs.items() if k not in names}


# ---------------------------------------------------------------- KV-cache updates
_VIEW_CHAIN = (aten.slice, aten.select, aten.narrow)


def _cache_target(ctx: RuleContext, dest: object) -> tuple[fx.Node, list[fx.Node]] | None:
    """(buffer get_attr, chain of slice/select/narrow views from it to `dest`) when `dest` is a view
    of a buffer (not a parameter), else None."""
    chain: list[fx.Node] = []
    while isinstance(dest, fx.Node) and getattr(dest.target, "overloadpacket", None) in _VIEW_CHAIN:
        chain.append(dest)
        dest = dest.args[0]
    if not isinstance(dest, fx.Node) or dest.op != "get_attr":
        return None
    owner_path, _, leaf = str(dest.target).rpartition(".")
    owner = ctx.gm.get_submodule(owner_path) if owner_path else ctx.gm
    if leaf in owner._parameters or not isinstance(getattr(owner, leaf, None), torch.Tensor):
        return None  # a buffer, or a tensor constant export lifted (Hugging Face's StaticCache)
    return dest, chain[::-1]


def _shard_cache(ctx: RuleContext, node: fx.Node, dest: fx.Node, values: Placement, values_dim: int) -> int:
    """Shard the cache buffer under `dest` (a buffer or a slice/select view of one) so that `dest`
    is sharded on `values_dim`, like the `values` written into it (the same pieces); return that dim. The buffer's rank
    shard replaces it in the module; the views between keep their (unsharded-dim) literals.

    Raises TensorParallelError, never gathers: a cache that cannot follow its head-sharded values
    would make every rank hold and attend over the whole cache (the silent fallback this rule exists
    to prevent)."""
    if ctx.shard_of(dest) is not None:
        if ctx.shard_of(dest).dim != values_dim:
            raise ctx.fail(
                node, f"the cache is sharded on dim {ctx.shard_of(dest).dim}, its values on {values_dim}"
            )
        return values_dim
    found = _cache_target(ctx, dest)
    if found is None:
        raise ctx.fail(
            node,
            "values sharded over heads are written into a tensor that is not a cache buffer of the model",
        )
    buffer, chain = found
    # the buffer dim that becomes `dest`'s dim `values_dim`, walking the views back
    dims = list(range(len(ctx.gshape(buffer))))
    for view in chain:
        if getattr(view.target, "overloadpacket", None) is aten.select:
            dims.pop(int(view.args[1]) % len(dims))
    bdim = dims[values_dim]
    size = ctx.gshape(buffer)[bdim]
    pieces = values.pieces
    if size != ctx.gshape(dest)[values_dim] or size % values.divisor(ctx.tp):
        raise ctx.fail(
            node,
            f"cache buffer `{buffer.target}` {tuple(ctx.gshape(buffer))}: dim {bdim} of size {size} cannot be "
            f"sharded like its values (dim {values_dim} of {tuple(ctx.gshape(dest))}) over tp={ctx.tp}",
        )
    done = [u for u in buffer.users if u in ctx.place and u not in chain]
    if done:
        raise ctx.fail(node, f"cache buffer `{buffer.target}` is read by {done[0].name} before it is written")
    ctx.replace_buffer(str(buffer.target), bdim, pieces)
    ctx.set_meta(buffer, Placement.shard(bdim, pieces=pieces))
    for view in chain:  # slices / selects along other dims: the shard follows its dim
        src = ctx.shard_of(view.args[0])
        nd = len(ctx.gshape(view.args[0]))
        vdim = int(view.args[1]) % nd
        if vdim == src.dim:
            raise ctx.fail(view, "the cache is written through a slice along its head dim")
        selecting = getattr(view.target, "overloadpacket", None) is aten.select
        ctx.set_meta(
            view, dataclasses.replace(src, dim=src.dim - 1 if selecting and vdim < src.dim else src.dim)
        )
        ctx.check(view)
    return values_dim


@register_rule(aten.index_put_, aten.index_put, aten.index_copy_, aten.index_copy, aten.copy_)
def rule_cache_update(ctx: RuleContext, node: fx.Node) -> None:
    """K/V written into a cache (index_put_ / index_copy_ / copy_ into a slice): head-sharded values shard it."""
    # `cache[:, :, pos] = k` is index_put_, HF's StaticCache index_copy_, `cache[:, :, a:b] = k` a copy_
    # into a slice: values sharded over heads shard the cache buffer along the same dim (each rank keeps
    # the cache of its own heads); replicated values keep it replicated.
    op = getattr(node.target, "overloadpacket", node.target)
    dest = node.args[0]
    if op in (aten.index_put_, aten.index_put):
        values, indexed = node.args[2], [i for i, ix in enumerate(node.args[1]) if ix is not None]
    elif op in (aten.index_copy_, aten.index_copy):
        values, indexed = node.args[3], [int(node.args[1]) % len(ctx.gshape(dest))]
    else:
        values, indexed = node.args[1], []
    pv = ctx.shard_of(values)
    if pv is None and ctx.shard_of(dest) is None:
        ctx.run_replicated(node)
        return
    offset = len(ctx.gshape(dest)) - len(ctx.gshape(values))  # values broadcast right-aligned
    if pv is None or pv.parts or pv.inner or offset < 0 or pv.dim + offset in indexed:
        raise ctx.fail(
            node,
            f"cache update with values {ctx.place.get(values, R)} into {ctx.place.get(dest, R)}: only values "
            "sharded on a dim that is not indexed (heads) can be written into a sharded cache",
        )
    dim = _shard_cache(ctx, node, dest, pv, pv.dim + offset)
    ctx.set_meta(node, Placement.shard(dim, pieces=pv.pieces))
    ctx.check(node)


# ---------------------------------------------------------------- reshapes and layout ops
@register_rule(aten.view, aten.reshape, aten._unsafe_view, general=True)
def rule_view(ctx: RuleContext, node: fx.Node) -> None:
    """Reshape of a shard: to the output dim `view_shard_dim` finds, literal sizes /tp; else replicated."""
    x = node.args[0]
    p = ctx.shard_of(x)
    if p is None:
        ctx.run_replicated(node)
        return
    if p.inner:  # a GQA-repeated K/V piece (B, kv, n_rep, ...) merged into the query heads
        placement = _merge_repeated_heads(ctx, node, p)
    elif (unfused := _parts_as_dim(ctx, node, p)) is not None:
        placement = unfused
    elif p.outer or (strided := _merged_into_outer(ctx, node, p)) is not None:
        placement = _strided_view(ctx, node, p) if p.outer else strided
        if placement is None:
            ctx.run_replicated(node)  # a strided shard reshaped otherwise: gathered and reordered
            return
    else:
        try:
            out_dim = view_shard_dim(ctx.gshape(x), ctx.gshape(node), p.dim, p.divisor(ctx.tp))
        except ValueError:
            # the shard does not survive the reshape as one contiguous chunk: (B, T, C) -> (B*T, C) of a
            # sequence shard; Bloom's (B, H, T, hd) -> (B*H, T, hd) of a head shard; a cut inside a head
            # (no output dim divides by tp); a fused projection's parts unfolded otherwise than
            # `_parts_as_dim` reads. The input is gathered and the reshape runs whole: a fallback
            # `passes.verify` prices and names, and the planner plans again with that block's core or
            # activation replicated (`planner.cli.workflow._replan_around_unshardable_gaps`)
            ctx.run_replicated(node)
            return
        if p.parts and ctx.gshape(x)[p.dim] != ctx.gshape(node)[out_dim]:
            ctx.run_replicated(node)  # the parts merged with other dims before they are taken apart
            return
        placement = dataclasses.replace(p, dim=out_dim)
    node.args = (x, list(local_shape(ctx.gshape(node), placement, ctx.tp)), *node.args[2:])
    ctx.set_meta(node, placement)
    ctx.check(node)


@register_rule(aten.unflatten, general=True)
def rule_unflatten(ctx: RuleContext, node: fx.Node) -> None:
    """Unflatten of a shard: `rule_view` of the reshape to its shape (MHA's `unflatten(-1, (3, E))`)."""
    node.target, node.args = aten.reshape.default, (node.args[0], list(ctx.gshape(node)))
    node.kwargs = {}
    rule_view(ctx, node)


def _merged_into_outer(ctx: RuleContext, node: fx.Node, p: Placement) -> Placement | None:
    """The placement of a reshape that splits a head shard's dim and merges its heads into the dim
    before it, (T, B, H * hd) -> (T, B * H, hd) (nn.MultiheadAttention; Bloom's and xformers'
    (B, H, T, hd) -> (B * H, T, hd) likewise): S(the merged dim) strided with `outer` = the outer
    dim's size (`Placement.outer`), each rank's H / tp heads beside each outer index. None for any
    other reshape."""
    x = node.args[0]
    if not p.is_plain_shard or ctx.sequence_shard_dim(x) is not None:
        return None  # a sequence shard flattened with the batch stays a gather (its consumers read tokens)
    shape_in, shape_out = ctx.gshape(x), ctx.gshape(node)
    for in_dims, out_dims in view_groups(shape_in, shape_out):
        if p.dim not in in_dims:
            continue
        leading = [d for d in in_dims if shape_in[d] != 1]
        outs = [d for d in out_dims if shape_out[d] != 1]
        if len(leading) != 2 or leading[1] != p.dim or not outs:
            return None
        outer, merged = shape_in[leading[0]], shape_out[outs[0]]
        heads = merged // outer
        if merged % outer or heads % ctx.tp or shape_in[p.dim] % heads:
            return None
        return dataclasses.replace(p, dim=outs[0], outer=outer)
    return None


def _strided_view(ctx: RuleContext, node: fx.Node, p: Placement) -> Placement | None:
    """The placement of a reshape of a strided shard (`Placement.outer`): the merged dim split back
    into (outer, heads, ...) is a plain shard of the heads; the merged dim kept whole (its size
    unchanged) stays strided. None for any other reshape."""
    x = node.args[0]
    shape_in, shape_out = ctx.gshape(x), ctx.gshape(node)
    for in_dims, out_dims in view_groups(shape_in, shape_out):
        if p.dim not in in_dims:
            continue
        if [d for d in in_dims if shape_in[d] != 1] != [p.dim]:
            return None
        outs = [d for d in out_dims if shape_out[d] != 1]
        if len(outs) == 1 and shape_out[outs[0]] == shape_in[p.dim]:
            return dataclasses.replace(p, dim=outs[0])
        if len(outs) >= 2 and shape_out[outs[0]] == p.outer and shape_out[outs[1]] % ctx.tp == 0:
            return dataclasses.replace(p, dim=outs[1], outer=None)
        return None
    return None


def _parts_as_dim(ctx: RuleContext, node: fx.Node, p: Placement) -> Placement | None:
    """The placement of a reshape that unfolds a fused projection's sharded output of equal parts into
    (..., parts, H, hd) (timm's ViT and many encoders: qkv(x).reshape(B, T, 3, H, hd)), or None for any
    other reshape. Each rank holds [part_0 / tp | part_1 / tp | ...], so its local (..., parts, H / tp,
    hd) is exactly a shard of the head dim: S(the dim after the parts' dim), no parts any more."""
    if not p.parts or p.size or p.pieces or len(set(p.parts)) != 1:
        return None
    x = node.args[0]
    for in_dims, out_dims in view_groups(ctx.gshape(x), ctx.gshape(node)):
        if p.dim not in in_dims:
            continue
        outs = [d for d in out_dims if ctx.gshape(node)[d] != 1]
        if (
            [d for d in in_dims if ctx.gshape(x)[d] != 1] == [p.dim]
            and len(outs) >= 2
            and ctx.gshape(node)[outs[0]] == len(p.parts)
            and ctx.gshape(node)[outs[1]] % ctx.tp == 0
        ):
            return Placement.shard(outs[1])
        return None
    return None


def _merge_repeated_heads(ctx: RuleContext, node: fx.Node, p: Placement) -> Placement:
    """The placement of a reshape that merges a GQA-repeated K/V piece's dims (dim, dim + 1) = (KV
    heads cut into `pieces`, repeats cut into tp / pieces) into one dim: the query heads, an even 1/tp
    shard. Raises TensorParallelError for any other reshape of such a value."""
    for in_dims, out_dims in view_groups(ctx.gshape(x := node.args[0]), ctx.gshape(node)):
        if p.dim in in_dims:
            outs = [d for d in out_dims if ctx.gshape(node)[d] != 1]
            leading = [d for d in in_dims if ctx.gshape(x)[d] != 1 or d in (p.dim, p.dim + 1)]
            if (
                leading[:2] == [p.dim, p.dim + 1]
                and len(outs) == 1
                and ctx.gshape(node)[outs[0]] % ctx.tp == 0
            ):
                return Placement.shard(outs[0])
    raise ctx.fail(node, "a GQA-repeated K/V piece must be reshaped by merging KV heads with their repeats")


def _move_shard(ctx: RuleContext, node: fx.Node, new_dim: Callable[[Placement, int], int]) -> None:
    """A layout op on a shard: the output is S(new_dim(p, ndim)); a replicated input stays replicated."""
    x = node.args[0]
    p = ctx.shard_of(x)
    if p is None:
        ctx.run_replicated(node)
        return
    if p.inner:
        raise ctx.fail(node, "a GQA-repeated K/V piece must be reshaped to the query heads before other ops")
    ctx.set_meta(node, dataclasses.replace(p, dim=new_dim(p, len(ctx.gshape(x)))))
    ctx.check(node)


@register_rule(aten.transpose, general=True)
def rule_transpose(ctx: RuleContext, node: fx.Node) -> None:
    """Transpose of a shard: the shard follows its dim through the swap."""

    def new(p: Placement, nd: int) -> int:
        a, b = (int(v) % nd for v in node.args[1:3])
        return b if p.dim == a else a if p.dim == b else p.dim

    _move_shard(ctx, node, new)


@register_rule(aten.t, general=True)
def rule_t(ctx: RuleContext, node: fx.Node) -> None:
    """2-D transpose of a shard: S(d) -> S(1 - d)."""
    _move_shard(ctx, node, lambda p, nd: 1 - p.dim)


@register_rule(aten.permute, general=True)
def rule_permute(ctx: RuleContext, node: fx.Node) -> None:
    """Permute of a shard: the shard goes where the permutation puts its dim."""
    _move_shard(ctx, node, lambda p, nd: [int(v) % nd for v in node.args[1]].index(p.dim))


@register_rule(aten.unsqueeze, general=True)
def rule_unsqueeze(ctx: RuleContext, node: fx.Node) -> None:
    """Unsqueeze of a shard: the shard dim moves up by one when the new dim is at or before it."""

    def new(p: Placement, nd: int) -> int:
        k = int(node.args[1]) % (nd + 1)
        return p.dim + 1 if k <= p.dim else p.dim

    _move_shard(ctx, node, new)


@register_rule(aten.expand, general=True)
def rule_expand(ctx: RuleContext, node: fx.Node) -> None:
    """Expand of a shard: keeps the shard (offset by new leading dims); its literal size becomes /tp."""
    x = node.args[0]
    p = ctx.shard_of(x)
    if p is None:
        ctx.run_replicated(node)
        return
    if p.inner:
        raise ctx.fail(node, "a GQA-repeated K/V piece must be reshaped to the query heads before other ops")
    sizes = list(node.args[1])
    new = p.dim + len(sizes) - len(ctx.gshape(x))
    if sizes[new] != -1:
        sizes[new] = ctx.gshape(x)[p.dim] // p.divisor(ctx.tp)
    placement = dataclasses.replace(p, dim=new)
    if p.pieces and new + 1 < len(sizes) and ctx.gshape(x)[p.dim + 1] == 1 and sizes[new + 1] not in (-1, 1):
        # GQA repeat of KV heads held as pieces, (B, kv, 1, ...) -> (B, kv, n_rep, ...): this rank's
        # query heads use n_rep * pieces / tp copies of its KV head
        rest = ctx.tp // p.pieces
        if sizes[new + 1] % rest:
            raise ctx.fail(node, f"GQA repeat of {sizes[new + 1]} does not divide by tp / KV heads = {rest}")
        sizes[new + 1] //= rest
        placement = dataclasses.replace(placement, inner=True)
    node.args = (x, sizes, *node.args[2:])
    ctx.set_meta(node, placement)
    ctx.check(node)


@register_rule(aten.slice, aten.select, aten.narrow, general=True)
def rule_slice(ctx: RuleContext, node: fx.Node) -> None:
    """Slice / select / narrow of a shard: along another dim it keeps it; along it see `_slice_parts`."""
    # Along the sharded dim: a slice of a fused projection's output that takes whole parts (Phi-3's
    # `qkv[..., :query_pos]`) is cut per part on each rank; any other cut gathers (a recorded fallback).
    x = node.args[0]
    p = ctx.shard_of(x)
    nd = len(ctx.gshape(x))
    dim = int(node.args[1]) % nd
    if p is None or (p.dim == dim and not p.parts) or p.size:
        ctx.run_replicated(node)  # replicated, or a cut across the ranks' shards: gathered first
        return
    if p.dim == dim:
        _slice_parts(ctx, node, p)
        return

    def new(p: Placement, nd: int) -> int:
        selecting = getattr(node.target, "overloadpacket", None) is aten.select
        return p.dim - 1 if (selecting and dim < p.dim) else p.dim

    _move_shard(ctx, node, new)


def _slice_parts(ctx: RuleContext, node: fx.Node, p: Placement) -> None:
    """A step-1 slice / narrow of a fused projection's output along its parts' dim that starts and
    ends on part boundaries: each rank takes the same parts of its local [part_0 / tp | part_1 / tp |
    ...]. Raises TensorParallelError for any other cut (it would mix the parts of different ranks)."""
    op = getattr(node.target, "overloadpacket", None)
    size = ctx.gshape(node.args[0])[p.dim]
    if op is aten.slice:
        start, end, step = (list(node.args[2:]) + [None, None, 1][len(node.args) - 2 :])[:3]
        start, end = start or 0, size if end is None else end
    elif op is aten.narrow:
        start, end, step = node.args[2], node.args[2] + node.args[3], 1
    else:
        start, end, step = None, None, None
    start = start + size if isinstance(start, int) and start < 0 else start
    end = min(end + size if isinstance(end, int) and end < 0 else end, size) if isinstance(end, int) else end
    bounds = [0]
    for part in p.parts:
        bounds.append(bounds[-1] + part)
    if step != 1 or start not in bounds or end not in bounds or start >= end:
        raise ctx.fail(
            node,
            f"cuts along the sharded dim {p.dim} of a fused projection with parts {list(p.parts)} "
            "elsewhere than at the parts' boundaries",
        )
    first, last = bounds.index(start), bounds.index(end)
    taken = p.parts[first:last]
    lo, hi = bounds[first] // ctx.tp, bounds[last] // ctx.tp
    node.target = aten.slice.Tensor
    node.args, node.kwargs = (node.args[0], p.dim, lo, hi, 1), {}
    ctx.set_meta(node, Placement.shard(p.dim, tuple(taken) if len(taken) > 1 else None))
    ctx.check(node)


def _pieces_along_shard(ctx: RuleContext, node: fx.Node, p: Placement, sizes: list[int]) -> list[int]:
    """Local sizes of the pieces a split / chunk cuts along the sharded dim of a fused projection.

    Rank r holds piece r of every part, concatenated in part order (`passes.placement.shard_weight`),
    so the cut is correct exactly when its global pieces are the projection's parts: each rank then
    cuts its local tensor into part / tp pieces. Raises TensorParallelError otherwise.
    """
    if not p.parts:
        held = ctx.gshape(node.args[0])[p.dim] // p.divisor(ctx.tp)
        raise ctx.fail(
            node,
            f"cuts along the sharded dim {p.dim} into {sizes}, but that dim is not a fused projection's "
            f"parts (each rank holds {held} of its {sum(sizes)}, not whole pieces of the cut): write the ops "
            "on the pieces as one op over the whole dim (e.g. a per-head norm over a (..., heads, head_dim) view), "
            "or keep the weights whole (--layout auto does so, priced)",
        )
    if list(p.parts) != sizes or any(s % ctx.tp for s in sizes):
        raise ctx.fail(
            node, f"pieces {sizes} along the sharded dim do not match the fused parts {list(p.parts)}"
        )
    return [s // ctx.tp for s in sizes]


def _split_dim(ctx: RuleContext, node: fx.Node, default: int = 0) -> int:
    """The dim argument (positional 3rd or `dim=`) of split / chunk / unbind, normalised."""
    x = node.args[0]
    raw = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", default)
    if getattr(node.target, "overloadpacket", None) is aten.unbind:
        raw = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", default)
    return int(raw) % len(ctx.gshape(x))


@register_rule(aten.split, aten.split_with_sizes, general=True)
def rule_split(ctx: RuleContext, node: fx.Node) -> None:
    """Split of a shard: along another dim every piece keeps it; along it only a fused projection's parts."""
    x, size = node.args[0], node.args[1]
    p = ctx.shard_of(x)
    if p is None:
        ctx.run_replicated(node)
        return
    dim = _split_dim(ctx, node)
    if dim != p.dim:
        ctx.set_tuple(node, [p] * len(ctx.global_val[node]), str(p))
        return
    full = ctx.gshape(x)[dim]
    sizes = (
        list(size)
        if isinstance(size, (list, tuple))
        else [size] * (full // size) + ([full % size] if full % size else [])
    )
    local = _pieces_along_shard(ctx, node, p, sizes)
    node.args = (x, local if isinstance(size, (list, tuple)) else local[0], *node.args[2:])
    ctx.set_tuple(node, [Placement.shard(dim)] * len(sizes), f"[{Placement.shard(dim)}] * {len(sizes)}")


@register_rule(aten.chunk, general=True)
def rule_chunk(ctx: RuleContext, node: fx.Node) -> None:
    """Chunk of a shard: along another dim every chunk keeps it; along it only a fused projection's parts."""
    x, chunks = node.args[0], int(node.args[1])
    p = ctx.shard_of(x)
    if p is None:
        ctx.run_replicated(node)
        return
    dim = _split_dim(ctx, node)
    if dim != p.dim:
        ctx.set_tuple(node, [p] * len(ctx.global_val[node]), str(p))
        return
    full = ctx.gshape(x)[dim]
    step = -(-full // chunks)  # torch.chunk: pieces of ceil(full / chunks), the last one shorter
    sizes = [min(step, full - start) for start in range(0, full, step)]
    local = _pieces_along_shard(ctx, node, p, sizes)
    if len(set(local)) != 1:  # the local chunk(n) must cut the same pieces: n equal ones
        raise ctx.fail(node, f"chunk of unequal parts {list(p.parts)}; use split with the part sizes")
    ctx.set_tuple(node, [Placement.shard(dim)] * len(sizes), f"[{Placement.shard(dim)}] * {len(sizes)}")


@register_rule(aten.unbind, general=True)
def rule_unbind(ctx: RuleContext, node: fx.Node) -> None:
    """Unbind of a shard along another dim: every slice keeps the shard (dim renumbered); along it: error."""
    x = node.args[0]
    p = ctx.shard_of(x)
    if p is None:
        ctx.run_replicated(node)
        return
    dim = _split_dim(ctx, node)
    if dim == p.dim:
        _pieces_along_shard(ctx, node, p, [1] * ctx.gshape(x)[dim])  # raises: a part of 1 does not split
    new = dataclasses.replace(p, dim=p.dim - 1 if dim < p.dim else p.dim)
    ctx.set_tuple(node, [new] * len(ctx.global_val[node]), str(new))


@register_rule(operator.getitem)
def rule_getitem(ctx: RuleContext, node: fx.Node) -> None:
    """Item of a tuple-producing node: that output's placement (R when the producer was replicated)."""
    src, idx = node.args
    p = ctx.place.get(src, R)
    ctx.set_meta(node, p[idx] if isinstance(p, list) else R)


@register_rule(aten.repeat_interleave, general=True)
def rule_repeat_interleave(ctx: RuleContext, node: fx.Node) -> None:
    """GQA K/V repeat with an int count on a head shard: each rank repeats its own heads, shard kept."""
    # KV heads held as pieces (fewer KV heads than tp): the rank's one piece is repeated for the query
    # heads it holds, count * pieces / tp times, and the result is an even 1/tp shard of the heads.
    p = ctx.shard_of(node.args[0])
    if p is None or not isinstance(node.args[1], int):
        ctx.run_replicated(node)
        return
    nd = len(ctx.gshape(node.args[0]))
    raw_dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if p.pieces and raw_dim is not None and int(raw_dim) % nd == p.dim and not p.inner:
        count, rest = node.args[1], ctx.tp // p.pieces
        if count % rest:
            raise ctx.fail(node, f"GQA repeat of {count} does not divide by tp / KV heads = {rest}")
        node.args = (node.args[0], count // rest, *node.args[2:])
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "output_size"}
        ctx.set_meta(node, Placement.shard(p.dim))
        ctx.check(node)
        return
    _move_shard(ctx, node, lambda p, nd: p.dim)


@register_rule(aten.cat, general=True)
def rule_cat(ctx: RuleContext, node: fx.Node) -> None:
    """Concatenation of equal shards (or broadcasts to their dim) along another dim keeps the shard."""
    # a replicated operand expanded from size 1 to the shard's dim (`_broadcast_source`) is expanded
    # to the rank's share instead; anything else runs replicated
    tensors, dim = node.args[0], (node.args[1] if len(node.args) > 1 else 0)
    places = [ctx.place.get(t, R) for t in tensors]
    dim = int(dim) % len(ctx.gshape(node))
    first = places[0]
    if all(p == first for p in places) and first.is_shard and first.dim != dim and not first.parts:
        ctx.set_meta(node, first)
        ctx.check(node)
        return
    heads = [p for t, p in zip(tensors, places) if p.is_plain_shard and p.dim != dim]
    shard = heads[0] if heads else None
    broadcast = {t: _broadcast_source(ctx, t, shard) for t, p in zip(tensors, places) if p != shard}
    if shard is None or any(b is None for b in broadcast.values()):
        ctx.run_replicated(node)
        return
    local = {}
    for t, src in broadcast.items():  # each expanded to the rank's share of the dim
        sizes = list(ctx.gshape(t))  # its own sizes may already be a sequence shard's (`rule_expand`)
        sizes[shard.dim] = ctx.gshape(t)[shard.dim] // shard.divisor(ctx.tp)
        # each rank's gradient covers its share of the dim: summed over the ranks (a sequence shard's
        # gather reduce-scatters it back; a replicated value's `tp_copy` all-reduces it)
        entered = ctx.sequence_gathered(src) if ctx.sequence_shard_dim(src) is not None else ctx.copy_in(src)
        local[t] = ctx.insert(entered, aten.expand.default, (entered, sizes), shard, t)
        ctx.check(local[t])
    node.args = ([local.get(t, t) for t in tensors], *node.args[1:])
    ctx.set_meta(node, shard)
    ctx.check(node)


def _broadcast_source(ctx: RuleContext, t: fx.Node, shard: Placement | None) -> fx.Node | None:
    """The input of `t` when `t` is an `aten.expand` of a size-1 dim to `shard`'s dim whose input is
    replicated or a sequence shard (DeepSeek's MLA key: its shared RoPE part, one head, expanded to
    every head before the concatenation with the heads' own part): expanding that input (gathered, for
    a sequence shard) to the rank's share of the dim gives `t`'s shard. None for any other operand."""
    if shard is None or t.op != "call_function" or t.target is not aten.expand.default:
        return None
    src = t.args[0]
    if not isinstance(src, fx.Node) or not (
        ctx.place.get(src, R) == R or ctx.sequence_shard_dim(src) is not None
    ):
        return None
    lead = len(t.args[1]) - len(ctx.gshape(src))
    if shard.dim < lead or ctx.gshape(src)[shard.dim - lead] != 1:
        return None
    return src


@register_rule(
    aten.contiguous,
    aten.clone,
    aten.alias,
    aten.detach,
    aten._to_copy,
    aten.to,
    aten.lift_fresh_copy,
    aten.type_as,
    general=True,
)
def rule_same(ctx: RuleContext, node: fx.Node) -> None:
    """Copy, cast or alias of a shard: the output keeps the input's shard."""
    p = ctx.shard_of(node.args[0] if node.args else None)
    if p is None:
        ctx.run_replicated(node)
        return
    ctx.set_meta(node, p)
    ctx.check(node)


# the rules that carry a shard strided through a merged dim (`Placement.outer`); any other op reading
# one runs replicated on its gathered, reordered input (`passes.tensor_parallel`)
CARRY_STRIDED = frozenset({rule_view, rule_unflatten, rule_transpose, rule_permute, rule_same})


@register_rule(aten.dropout, aten.native_dropout, aten.bernoulli)
def rule_dropout(ctx: RuleContext, node: fx.Node) -> None:
    """Dropout keeps its input's placement; on a shard it draws from the per-rank stream (passes.rng)."""
    # On a replicated input the op stays as it is: it draws from the default generator, seeded alike
    # on every TP rank, so all ranks drop the same elements (Megatron's rule for replicated
    # activations). On a shard it becomes `passes.rng.tp_*`, which draws from the stream seeded per
    # rank, so the shards' masks are independent like the parts of one unsharded mask.
    x = node.args[0]
    p = ctx.shard_of(x)
    if p is None:
        ctx.run_replicated(node)
        return
    if node.target in (aten.dropout.default, aten.native_dropout.default):
        prob = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        native = node.target is aten.native_dropout.default
        node.target = rng.tp_native_dropout if native else rng.tp_dropout
        node.args, node.kwargs = (x, prob, train, ctx.axis), {}
        if native:  # (output, mask), both sharded like the input
            ctx.set_tuple(node, [p, p], str(p))
            return
    elif node.target in (aten.bernoulli.default, aten.bernoulli.p) and not node.kwargs.get("generator"):
        prob = node.args[1] if node.target is aten.bernoulli.p else None
        node.target, node.args, node.kwargs = rng.tp_bernoulli, (x, prob, ctx.axis), {}
    else:  # another overload (a tensor of probabilities, an explicit generator): one full draw
        ctx.run_replicated(node)
        return
    ctx.set_meta(node, p)
    ctx.check(node)


# ---------------------------------------------------------------- reductions and normalisations
def _reduce(ctx: RuleContext, node: fx.Node, dims_keep: Callable[[int], tuple[list[int], bool]]) -> None:
    """A reduction over dims_keep(ndim) = (dims, keepdim) of an unfused shard on another dim keeps it;
    its replicated float operands (a norm's weight and bias) get `tp_copy` under training."""
    x = node.args[0]
    p = ctx.shard_of(x)
    if p is None or p.parts:
        ctx.run_replicated(node)
        return
    dims, keep = dims_keep(len(ctx.gshape(x)))
    if p.dim in dims or p.inner:
        ctx.run_replicated(node)
        return
    for a in node.all_input_nodes:  # a norm's scale and shift: its gradient is summed over the shards
        if a is not x and ctx.place.get(a, R) == R:
            node.replace_input_with(a, ctx.copy_in(a))
    ctx.set_meta(
        node, dataclasses.replace(p, dim=p.dim if keep else p.dim - sum(1 for d in dims if d < p.dim))
    )
    ctx.check(node)


@register_rule(aten.einsum)
def rule_einsum(ctx: RuleContext, node: fx.Node) -> None:
    """Einsum sharded on one letter every operand holding it carries and the output keeps (heads)."""
    # attention written `torch.einsum("bhqd,bhkd->bhqk", q, k)` / `"bhqk,bhkd->bhqd"`: each rank computes
    # its heads' slice; an operand holding the letter replicated is sliced locally; one without it (a
    # weight applied to a sequence shard) is read whole by every rank, so under training its gradient is
    # summed over the ranks (`copy_in`). Any other einsum (a contracted or repeated letter, two sharded
    # letters, an ellipsis, a shard of another kind) runs replicated: a fallback `passes.verify` prices
    operands, terms = list(node.args[1]), einsum_terms(node)
    if terms is None:
        ctx.run_replicated(node)
        return
    letters_of, out = terms
    sharded: set[str] = set()
    for letters, operand in zip(letters_of, operands):
        p = ctx.place.get(operand, R) if isinstance(operand, fx.Node) else R
        if not isinstance(p, Placement) or p.is_partial or (p.is_shard and not p.is_plain_shard):
            ctx.run_replicated(node)
            return
        if p.is_shard:
            sharded.add(letters[p.dim])
    letter = next(iter(sharded)) if len(sharded) == 1 else ""
    if not letter or out.count(letter) != 1 or any(letters.count(letter) > 1 for letters in letters_of):
        ctx.run_replicated(node)
        return
    node.args = (
        node.args[0],
        [
            ctx.sharded(o, letters.index(letter)) if letter in letters else ctx.copy_in(o)
            for letters, o in zip(letters_of, operands)
        ],
    )
    ctx.set_meta(node, Placement.shard(out.index(letter)))
    ctx.check(node)


@register_rule(aten.mean, aten.sum, aten.amax, aten.amin, aten.var, aten.std, general=True)
def rule_reduce_dims(ctx: RuleContext, node: fx.Node) -> None:
    """Reduction over non-sharded dims keeps the shard (dim renumbered without keepdim); else replicated."""

    def dims_keep(nd: int) -> tuple[list[int], bool]:
        raw = node.args[1] if len(node.args) > 1 else None
        dims = (
            list(range(nd))
            if raw is None
            else [int(v) % nd for v in (raw if isinstance(raw, (list, tuple)) else [raw])]
        )
        keep = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
        return dims, keep

    _reduce(ctx, node, dims_keep)


@register_rule(aten._softmax, aten.softmax, aten._log_softmax, aten.log_softmax, general=True)
def rule_softmax(ctx: RuleContext, node: fx.Node) -> None:
    """Softmax on a non-sharded dim keeps the shard; on the sharded dim the input is gathered."""
    _reduce(ctx, node, lambda nd: ([int(node.args[1]) % nd], True))


@register_rule(aten.layer_norm, *([aten.rms_norm] if hasattr(aten, "rms_norm") else []), general=True)
def rule_norm(ctx: RuleContext, node: fx.Node) -> None:
    """Layer / RMS norm over trailing non-sharded dims keeps the shard; over the shard: gathered."""
    _reduce(ctx, node, lambda nd: (list(range(nd - len(node.args[1]), nd)), True))


# ---------------------------------------------------------------- pointwise
@register_rule(
    *pointwise_overloads(
        aten.add, aten.sub, aten.mul, aten.div, aten.neg, aten.pow, aten.rsqrt, aten.sqrt, aten.exp,
        aten.tanh, aten.sigmoid, aten.relu, aten.gelu, aten.silu, aten.cos, aten.sin, aten.where,
        aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.bitwise_and, aten.bitwise_or,
        aten.logical_not,
    ),
    general=True,
)  # fmt: skip
def rule_pointwise(ctx: RuleContext, node: fx.Node) -> None:
    """Elementwise op with one shard dim among its inputs: S out; replicated operands sliced (broadcast)."""
    out_shape = ctx.gshape(node) if isinstance(ctx.global_val.get(node), torch.Tensor) else None
    inputs = [a for a in node.all_input_nodes if isinstance(ctx.global_val.get(a), torch.Tensor)]
    shards = {
        (ctx.place[a].dim + len(out_shape) - len(ctx.gshape(a)), ctx.place[a].pieces)
        for a in inputs
        if isinstance(ctx.place.get(a), Placement)
        and ctx.place[a].is_shard
        and not ctx.place[a].parts
        and not ctx.place[a].inner
    } if out_shape is not None else set()  # fmt: skip
    if out_shape is not None and _keeps_parts(ctx, node, inputs, out_shape):
        return
    if out_shape is None or len(shards) != 1 or any(ctx.place.get(a, R).is_partial for a in inputs):
        ctx.run_replicated(node)
        return
    od, pieces = shards.pop()
    for a in inputs:
        if ctx.place.get(a, R).is_shard:
            continue
        shape = ctx.gshape(a)
        ad = od - (len(out_shape) - len(shape))
        if ad >= 0 and shape[ad] != 1:
            node.replace_input_with(a, ctx.sharded(a, ad, pieces))
        else:
            node.replace_input_with(a, ctx.copy_in(a))
    ctx.set_meta(node, Placement.shard(od, pieces=pieces))
    ctx.check(node)


def _keeps_parts(ctx: RuleContext, node: fx.Node, inputs: list[fx.Node], out_shape: tuple[int, ...]) -> bool:
    """A fused projection's sharded parts (`Placement.parts`) through an elementwise op whose sharded
    inputs all hold the same parts of an output-sized tensor, the others broadcast along that dim (a
    scalar, a size-1 dim): a LoRA adapter's update (scaled) added to its fused QKV projection's output,
    each rank's parts beside its parts. Sets the placement and returns True; False when not so."""
    placed = [ctx.place.get(a, R) for a in inputs]
    with_parts = {p for p in placed if isinstance(p, Placement) and p.is_shard and p.parts}
    if len(with_parts) != 1:
        return False
    (want,) = with_parts
    for a, p in zip(inputs, placed):
        shape = ctx.gshape(a)
        if p == want:
            if len(shape) != len(out_shape):
                return False
            continue
        if not isinstance(p, Placement) or not p.is_replicate:
            return False
        ad = want.dim - (len(out_shape) - len(shape))
        if ad >= 0 and shape[ad] != 1:
            return False
        node.replace_input_with(a, ctx.copy_in(a))
    ctx.set_meta(node, want)
    ctx.check(node)
    return True


_POINTWISE = RuleEntry(rule_pointwise, general=True)
_REPLICATED = RuleEntry(RuleContext.run_replicated, general=True)


def rule_for(target: object) -> RuleEntry:
    """The rule for an fx node's `target`: its registered entry; with none, the pointwise rule for an op
    ATen tags pointwise, else `RuleContext.run_replicated`."""
    entry = RULES.lookup(target)
    if entry is not None:
        return entry
    if hasattr(target, "tags") and torch.Tag.pointwise in target.tags:
        return _POINTWISE
    return _REPLICATED

"""Context-parallel rewrite: one rank's graph -> the graph that runs on its tokens of every sequence.

    apply_context_parallel(gm, cp, seq_len, variant, load_balance, training=...) -> CpLowering

Input: a captured graph (`planner.frontend.capture.capture`), after the tensor-parallel pass when the
plan has one (its `node.meta["val"]` then holds TP-local shapes, which this pass reads as its global
ones). Each sequence's tokens are split over the `cp` ranks of the "cp" mesh axis (`planner.plan.
MeshShape`): rank r holds chunks r and 2cp-1-r of 2cp chunks with `load_balance`, the r-th cp-th
otherwise (`passes.context_parallel.cp_positions`). Output: the same graph rewritten in place:

1. every token input (a placeholder whose dim 1 has `seq_len` entries: token ids (B, T), embeddings
   (B, T, C)) is cut to this rank's tokens (`cp_slice`);
2. a sequence placement (shard of one dim, or replicated) is propagated through every node in order
   by PyTorch DTensor's sharding semantics on a one-dimensional mesh of cp ranks
   (`passes.general_rules.propagate_placements`, as the TP pass uses them): a token-wise op keeps the
   shard (linear, norms, activations, residual adds, views with their literal sizes rewritten to the
   local ones); a replicated operand that meets a shard along the sequence (RoPE's cos / sin tables,
   a position embedding) is cut to this rank's positions (`cp_slice`: with load balancing, the same
   two chunks); the collectives and RNG helpers earlier passes inserted are token-wise and keep it;
3. attention (`aten.scaled_dot_product_attention` with q, k, v sharded along the sequence) becomes the
   plan's context-parallel attention (`cp_sdpa`: ring, all-gather of K/V, or Ulysses all-to-all;
   forward and backward merge partial results by the online-softmax rule); an explicit attention
   mask, attention dropout under training, or Ulysses with heads that do not divide by cp is refused
   (InputError naming the node and what would work);
4. an op that needs every token of a shard (a reduction over the sequence, a reshape merging batch
   and sequence, a DTensor answer we cannot take) gets the whole sequence (`cp_gather`): a fallback,
   recorded in `node.meta["cp_fallback"]` (a `passes.tp_rules_context.Fallback`: the gathered inputs
   and their elements, before the cut, and the nodes after it that read its whole-sequence result and
   so run on every token on every CP rank: `Fallback.region`, until a shard meets them, e.g. a MoE
   block behind `x.view(-1, C)`) and listed in `CpLowering.fallbacks`; `passes.verify` prices it (an
   all-gather over the CP ranks, a reduce-scatter in backward, the region's compute and a MoE's token
   exchange on cp times the tokens) and `planner run` names it;
5. every graph output still sharded is gathered whole (`cp_gather_output`), so that the loss sees
   whole sequences; with `shard_output` (training) the first stays on this rank's tokens
   (`CpOutputShard` in ``gm.meta[CP_OUTPUT_SHARD]``) and the runtime's loss runs on them
   (`runtime.loss`), as Megatron-LM's does.

Gradients (training): a lowered graph's parameters are the same on the cp ranks and each rank's
weight gradients sum over its own tokens only: partial sums, which the data-parallel reduction over
dp x cp ranks averages (`runtime.mesh`'s "dp_cp" group). The output gather's backward keeps this
rank's tokens of the (identical) loss gradient times cp (a loss on the rank's tokens scales its
gradient by cp the same way: `runtime.loss`), so that the average is the whole-batch sum;
`cp_slice`'s backward puts a gradient at this rank's positions and zeros elsewhere, `cp_gather`'s
reduce-scatters (both partial sums too). Megatron-LM multiplies its loss by the CP size for the
same reason.

Node metadata written: `node.meta["cp_placement"]` (str), `node.meta["val"]` (local shape).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._ops import OpOverload
from torch.utils import _pytree as pytree

from passes import collectives
from passes.context_parallel import CP_VARIANTS, cp_gather, cp_gather_output, cp_sdpa, cp_slice
from passes.general_rules import _local_shapes_agree, propagate_placements
from passes.placement import Placement, local_shape, loss_output, view_groups
from passes.tp_rules_context import Fallback, op_label
from planner.errors import InputError
from planner.frontend.capture import bound_arguments, retarget_device, user_line

__all__ = ["AXIS", "CpLowering", "apply_context_parallel"]

AXIS = "cp"  # the mesh axis name the runtime registers (`passes.collectives.register_group`)
FALLBACK_META = "cp_fallback"
_R = Placement.replicate()
_SDPA = torch.ops.aten.scaled_dot_product_attention.default


@dataclass
class CpLowering:
    """What the context-parallel pass did to one rank's graph."""

    cp: int
    variant: str
    load_balance: bool
    inputs: list[str] = field(default_factory=list)  # placeholders cut to this rank's tokens
    attention: list[str] = field(default_factory=list)  # SDPA nodes replaced by `cp_sdpa`
    sliced: list[str] = field(default_factory=list)  # replicated values cut to this rank's positions
    fallbacks: list[str] = field(default_factory=list)  # "op (line)": inputs gathered whole
    gathered_outputs: int = 0


@dataclass(frozen=True)
class CpOutputShard:
    """The graph's first output left on this rank's tokens for a loss on them (`apply_context_parallel`'s
    `shard_output`): along `dim`, in the lowering's order (`load_balance`: head-tail chunks)."""

    dim: int
    load_balance: bool


CP_OUTPUT_SHARD = "cp_output_shard"


@dataclass
class _Ctx:
    """The state `passes.general_rules.propagate_placements` reads (a `RuleContext`'s fields): the
    mesh size under the name it expects, each node's shape before this pass and its placement."""

    tp: int
    global_val: dict[fx.Node, Any]
    place: dict[fx.Node, Any]


def apply_context_parallel(
    gm: fx.GraphModule,
    cp: int,
    seq_len: int,
    variant: str,
    load_balance: bool,
    *,
    training: bool = False,
    shard_output: bool = False,
) -> CpLowering:
    """Rewrite `gm` in place for one rank of `cp` context-parallel ranks (module docstring).

    seq_len: tokens per sequence in the captured graph (the plan's `seq_len`); variant: one of
    `passes.context_parallel.CP_VARIANTS`; training: the output gather scales its gradient by cp;
    shard_output: the first output stays on this rank's tokens (`CpOutputShard`, module docstring).
    Raises InputError for a sequence that does not divide into the chunks (naming both numbers), an
    unknown variant, a model without a token input of `seq_len` entries, or attention the variants
    cannot run (explicit mask, attention dropout under training, Ulysses heads); ValueError when a
    rewritten node's local shape disagrees with its placement."""
    result = CpLowering(cp, variant, load_balance)
    if cp == 1:
        return result
    if variant not in CP_VARIANTS:
        raise InputError(f"unknown context-parallel attention {variant!r}; one of {', '.join(CP_VARIANTS)}")
    graph = gm.graph
    ctx = _Ctx(cp, {n: n.meta.get("val") for n in graph.nodes}, {})
    slices: dict[tuple[fx.Node, int], fx.Node] = {}

    def insert_after(anchor: fx.Node, fn: Any, args: tuple, val: Any, placement: Placement) -> fx.Node:
        with graph.inserting_after(anchor):
            new = graph.call_function(fn, args)
        new.meta["val"] = val
        new.meta["cp_placement"] = str(placement)
        ctx.place[new] = placement
        return new

    def sliced(node: fx.Node, dim: int) -> fx.Node:
        key = (node, dim)
        if key not in slices:
            val = ctx.global_val[node]
            if val.shape[dim] % (2 * cp if load_balance else cp):
                raise InputError(_uneven(node, dim, val.shape[dim], cp, load_balance))
            local = torch.empty(
                local_shape(tuple(val.shape), Placement.shard(dim), cp), dtype=val.dtype, device="meta"
            )
            slices[key] = insert_after(
                node, cp_slice, (node, dim, AXIS, load_balance), local, Placement.shard(dim)
            )
            # the slice's global value is the whole tensor, sharded along `dim` (as every other shard's):
            # read as the local one, a view of it by its global sizes (OPT's `ids.view(-1, ids.shape[-1])`)
            # had no answer and gathered the whole sequence
            ctx.global_val[slices[key]] = val
            result.sliced.append(node.name)
        return slices[key]

    def gathered(node: fx.Node) -> fx.Node:
        p = ctx.place.get(node, _R)
        if not isinstance(p, Placement) or not p.is_shard:
            return node
        val = ctx.global_val[node]
        new = insert_after(node, cp_gather, (node, p.dim, AXIS, load_balance), val, _R)
        ctx.global_val[new] = val
        return new

    found_input = False
    # node -> the fallback whose whole-sequence result it reads and carries (it runs replicated on every
    # CP rank over every token), with the size of the root's dim that holds the sequence
    whole: dict[fx.Node, fx.Node] = {}
    carried: dict[fx.Node, int] = {}
    for node in list(graph.nodes):
        val = ctx.global_val.get(node)
        roots = [
            whole[a]
            for a in node.all_input_nodes
            if a in whole and _carries(ctx.global_val.get(node), carried[whole[a]])
        ]
        if node.op == "placeholder":
            if isinstance(val, torch.Tensor) and val.dim() >= 2 and val.shape[1] == seq_len:
                if seq_len % (2 * cp if load_balance else cp):
                    raise InputError(_uneven(node, 1, seq_len, cp, load_balance))
                users = list(node.users)
                cut = sliced(node, 1)
                for user in users:
                    user.replace_input_with(node, cut)
                result.inputs.append(node.name)
                found_input = True
            ctx.place[node] = _R
            continue
        if node.op == "get_attr":
            ctx.place[node] = _R
            continue
        if node.op == "output":
            result.gathered_outputs = _gather_outputs(node, ctx, load_balance, training, shard_output)
            continue
        if node.op != "call_function":
            ctx.place[node] = _R
            continue
        inputs = [a for a in node.all_input_nodes if isinstance(ctx.global_val.get(a), torch.Tensor)]
        placements = [ctx.place.get(a, _R) for a in node.all_input_nodes]
        if (
            node.target in _SEQUENCE_SPLITS
            and node.args[0] in whole
            and isinstance(ctx.global_val.get(node.args[0]), torch.Tensor)
            and ctx.global_val[node.args[0]].shape[node.args[1]] == seq_len
        ):
            # sequence parallelism entering from a whole-sequence region (the TP pass's tp_shard /
            # tp_reduce_scatter of `x.view(B, T, C)` after `x.view(-1, C)`): its shards are pieces of
            # this rank's tokens, so the whole sequence is cut to them first, then split
            source = node.args[0]
            node.replace_input_with(source, sliced(source, node.args[1]))
            _set(node, ctx, Placement.shard(node.args[1]))
            continue
        if not any(isinstance(p, Placement) and p.is_shard for p in placements) and not any(
            isinstance(p, list) for p in placements
        ):
            ctx.place[node] = _R
            if roots:
                whole[node] = roots[0]
            continue
        if node.target is operator.getitem:
            source, index = node.args[0], node.args[1]
            p = ctx.place.get(source, _R)
            _set(node, ctx, p[index] if isinstance(p, list) else p)
            if roots and not ctx.place[node].is_shard:
                whole[node] = roots[0]
            continue
        if node.target is _SDPA:
            _attention(node, ctx, result, training)
            continue
        if not isinstance(node.target, OpOverload):
            # collectives / RNG helpers of earlier passes (`passes.collectives`, `passes.rng`): token-wise
            shards = [p for p in placements if isinstance(p, Placement) and p.is_shard]
            _set(node, ctx, shards[0])
            continue
        if node.target in _TOKENWISE and _tokenwise(node, ctx):
            continue
        if _general(node, ctx, sliced):
            continue
        # no rule: the whole sequence of every sharded input, the op run as it was (a recorded fallback)
        sharded_inputs = [a for a in inputs if ctx.place.get(a, _R).is_shard]
        for a in sharded_inputs:
            node.replace_input_with(a, gathered(a))
        elements = sum(ctx.global_val[a].numel() for a in sharded_inputs)
        node.meta[FALLBACK_META] = Fallback(
            node.name, op_label(node), user_line(node) or "", tuple(a.name for a in sharded_inputs), elements,
            sum(ctx.global_val[a].numel() * ctx.global_val[a].element_size() for a in sharded_inputs),
        )  # fmt: skip
        result.fallbacks.append(f"{op_label(node)} ({user_line(node) or node.name})")
        _set(node, ctx, _R)
        if roots:
            whole[node] = roots[0]
        elif (size := _sequence_size(node, ctx, sharded_inputs)) is not None:
            whole[node], carried[node] = node, size
    regions: dict[fx.Node, list[str]] = {}
    for node, root in whole.items():
        if node is not root:
            regions.setdefault(root, []).append(node.name)
    for root, names in regions.items():
        root.meta[FALLBACK_META] = dataclasses.replace(root.meta[FALLBACK_META], region=tuple(names))
    if not found_input:
        raise InputError(
            f"context parallelism needs the model's token input: no input has {seq_len} entries in dim 1 "
            "(batch, sequence, ...); pass the tokens batch-first, or plan with --cp 1"
        )
    graph.eliminate_dead_code()  # a causal mask the kernels now compute themselves
    graph.lint()
    gm.recompile()
    return result


# the TP pass's collectives that split the tokens for sequence parallelism ((B, T, C) -> T / tp along
# dim args[1]): under CP, each rank's sequence-parallel shard is a piece of its CP tokens
_SEQUENCE_SPLITS = frozenset({collectives.tp_shard, collectives.tp_reduce_scatter})


def _sequence_size(node: fx.Node, ctx: _Ctx, sharded: list[fx.Node]) -> int | None:
    """The size of the dim of a fallback's output that still holds the gathered sequence: the sharded
    dim itself where the output keeps it (a cumsum), or the merged dim a reshape folds it into
    ((B, T, C) -> (B * T, C): B * T); None when the op reduced it away (a mean over the tokens)."""
    out = ctx.global_val.get(node)
    if not isinstance(out, torch.Tensor):
        return None
    for a in sharded:
        src, p = ctx.global_val[a], ctx.place[a]
        if out.dim() == src.dim() and out.shape[p.dim] == src.shape[p.dim]:
            return int(src.shape[p.dim])
        if out.numel() == src.numel():
            for in_dims, out_dims in view_groups(tuple(src.shape), tuple(out.shape)):
                if p.dim in in_dims:
                    return math.prod(out.shape[d] for d in out_dims)
    return None


def _carries(val: Any, size: int) -> bool:
    """Whether a value has a dim of a whole multiple of `size` entries (the sequence a fallback
    gathered, `_sequence_size`: a MoE's rows, or their top_k copies)."""
    if isinstance(val, (list, tuple)):  # a multi-output op (topk's values and indices)
        return any(_carries(v, size) for v in val)
    return isinstance(val, torch.Tensor) and any(d >= size and d % size == 0 for d in val.shape)


# ops whose output keeps their token input's leading dims (the index of that input): a shard of it on
# any of those dims is a shard of the output on the same dim. An embedding's output is its indices' shape
# plus the features (DTensor's embedding strategy answers only for a sharded weight); a linear maps the
# last dim only (DTensor's, through matmul's folding of the leading dims, gives up where a unit dim
# precedes the shard: DeepSeek's latent (B, 1, T, r) into kv_b_proj)
_TOKENWISE = {torch.ops.aten.embedding.default: 1, torch.ops.aten.linear.default: 0}


def _tokenwise(node: fx.Node, ctx: _Ctx) -> bool:
    """`aten.embedding(weight, indices)` or `aten.linear(x, weight[, bias])` with the weights replicated
    and the token input sharded on dim d (for a linear, not its last): the output is sharded on dim d.
    False when the inputs are placed otherwise."""
    index = _TOKENWISE[node.target]
    tokens = node.args[index]
    p = ctx.place.get(tokens, _R)
    others = [a for i, a in enumerate(node.args) if i != index and isinstance(a, fx.Node)]
    if not p.is_shard or any(not ctx.place.get(a, _R).is_replicate for a in others):
        return False
    if node.target is torch.ops.aten.linear.default and p.dim == ctx.global_val[tokens].dim() - 1:
        return False
    _set(node, ctx, p)
    return True


def _uneven(node: fx.Node, dim: int, size: int, cp: int, load_balance: bool) -> str:
    chunks = 2 * cp if load_balance else cp
    how = f"2 x cp = {chunks} chunks (load balancing)" if load_balance else f"{chunks} chunks"
    return (
        f"context parallelism cp={cp} cannot cut {node.name!r} (dim {dim} of {size}) into {how}: {size} is "
        f"not a multiple of {chunks}; use a sequence length that is a multiple of {chunks}"
    )


def _set(node: fx.Node, ctx: _Ctx, placement: Any) -> None:
    """Record `placement`; a tensor's meta value becomes its local shape."""
    ctx.place[node] = placement
    node.meta["cp_placement"] = str(placement)
    val = ctx.global_val.get(node)
    if isinstance(placement, Placement) and isinstance(val, torch.Tensor):
        node.meta["val"] = torch.empty(
            local_shape(tuple(val.shape), placement, ctx.tp), dtype=val.dtype, device="meta"
        )


def _general(node: fx.Node, ctx: _Ctx, sliced: Any) -> bool:
    """Place `node` by DTensor's semantics; False when it has no answer we can take (the caller
    gathers). A replicated input it wants sharded is cut (`sliced`); a shard it wants otherwise is a
    gather: False."""
    found = propagate_placements(ctx, node)
    if found is None:
        return False
    wanted, new_args, new_kwargs, outputs = found
    out_list = outputs if isinstance(outputs, list) else [outputs]
    leaves, tree = pytree.tree_flatten((new_args, new_kwargs))
    tensor_leaves = [
        a for a in leaves if isinstance(a, fx.Node) and isinstance(ctx.global_val.get(a), torch.Tensor)
    ]
    for a, w in zip(tensor_leaves, wanted):
        have = ctx.place.get(a, _R)
        if have.is_shard and have != w:
            return False
    if not any(o.is_shard for o in out_list):
        return False  # a shard in, nothing sharded out: a reduction over the tokens (gathered)
    if not _local_shapes_agree(ctx, node, leaves, tree, tensor_leaves, wanted, out_list, outputs):
        return False
    swap = {}
    for a, w in zip(tensor_leaves, wanted):
        if w.is_shard and ctx.place.get(a, _R).is_replicate:
            swap[id(a)] = sliced(a, w.dim)
    leaves = [swap.get(id(a), a) if isinstance(a, fx.Node) else a for a in leaves]
    args, kwargs = pytree.tree_unflatten(leaves, tree)
    node.args, node.kwargs = tuple(args), kwargs
    if isinstance(outputs, list):
        ctx.place[node] = outputs
        node.meta["cp_placement"] = "[" + ", ".join(map(str, outputs)) + "]"
        val = ctx.global_val.get(node)
        if isinstance(val, (list, tuple)):
            node.meta["val"] = type(val)(
                torch.empty(local_shape(tuple(v.shape), p, ctx.tp), dtype=v.dtype, device="meta")
                if isinstance(v, torch.Tensor)
                else v
                for v, p in zip(val, outputs)
            )
    else:
        _set(node, ctx, outputs)
    return True


def _attention(node: fx.Node, ctx: _Ctx, result: CpLowering, training: bool) -> None:
    """SDPA on sequence shards -> `cp_sdpa` (module docstring, step 3)."""
    bound = bound_arguments(node)
    q, k, v = bound["query"], bound["key"], bound["value"]
    where = f"attention {node.name!r} ({user_line(node) or 'no source line'})"
    want = Placement.shard(2)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if ctx.place.get(t, _R) != want:
            raise InputError(
                f"context parallelism: {where} is cross-attention: its queries are split along the sequence "
                f"but its keys / values ({name}: {ctx.place.get(t, _R)}) are computed from another input than "
                "the sharded sequence (an encoder output or a memory), which context parallelism does not "
                "split; plan with --cp 1"
                if name != "q" and ctx.place.get(q, _R) == want and ctx.place.get(t, _R) == _R
                else f"context parallelism: {where}: {name} is not split along its sequence dim (B, H, T, D) "
                f"but {ctx.place.get(t, _R)}; attention must take q, k, v in (batch, heads, tokens, "
                "head_dim); plan with --cp 1"
            )
    causal = bool(bound.get("is_causal"))
    mask = bound.get("attn_mask")
    if mask is not None:
        why = _not_causal(
            node.graph.owning_module, mask, ctx.global_val[q].shape[2], ctx.global_val[k].shape[2]
        )
        if why and why != ALLOWS_ALL:
            raise InputError(
                f"context parallelism: {where} takes an explicit attention mask that {why}; the "
                "context-parallel kernels compute the causal mask from token positions, or attend to every "
                "token: call scaled_dot_product_attention(..., is_causal=True) without attn_mask (a decoder), "
                "or without either (an encoder), or plan with --cp 1"
            )
        # the mask is the causal one (Hugging Face builds it explicitly when traced), or lets every query see
        # every key (an encoder's, e.g. BERT's without padding): no mask
        causal = why != ALLOWS_ALL
    if training and bound.get("dropout_p"):
        raise InputError(
            f"context parallelism: {where} uses attention dropout ({bound['dropout_p']}), which the "
            "context-parallel kernels do not run; set the attention dropout to 0 or plan with --cp 1"
        )
    heads, kv_heads = ctx.global_val[q].shape[1], ctx.global_val[k].shape[1]
    if result.variant == "alltoall" and (heads % ctx.tp or kv_heads % ctx.tp):
        raise InputError(
            f"context parallelism: {where}: Ulysses (cp_comm_type alltoall) splits the heads over cp={ctx.tp} "
            f"ranks, but this rank's {heads} query heads and {kv_heads} KV heads do not both divide by "
            f"{ctx.tp}; use cp_comm_type ring or allgather"
        )
    node.target = cp_sdpa
    node.args = (q, k, v, AXIS, result.variant, causal, result.load_balance, bound.get("scale"))
    node.kwargs = {}
    result.attention.append(node.name)
    _set(node, ctx, want)


MAX_MASK_ELEMENTS = 1 << 26  # largest (queries x keys) mask evaluated to check it is causal (64 Mi elements)


def _attr(gm: fx.GraphModule, target: str) -> Any:
    """The object `gm` holds at the dotted `target` (a get_attr node's), None when there is none."""
    held: Any = gm
    for part in target.split("."):
        held = getattr(held, part, None)
    return held


ALLOWS_ALL = "allows every key for every query"  # `_not_causal`: a mask that masks nothing


def _not_causal(gm: fx.GraphModule, mask: fx.Node, q_len: int, k_len: int) -> str:
    """Why an explicit attention mask cannot run as `is_causal` ("" when it can; `ALLOWS_ALL` when it
    masks nothing, which runs as no mask): the mask must be computed from constants alone (positions,
    `arange`, comparisons: no model input or parameter) and, evaluated, allow exactly the causal pattern
    (key j for query i when j <= i + k_len - q_len) for every batch and head, or every key. Hugging Face
    models build this mask explicitly when traced."""
    if q_len * k_len > MAX_MASK_ELEMENTS:
        return f"is {q_len} x {k_len} elements, too large to check here"
    params = dict(gm.named_parameters())
    ancestors: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return (
                f"depends on the model input {n.name!r}, so its pattern is known only when the model runs (a "
                "padding mask, or a causal mask passed in: build the causal mask inside the model from positions, "
                "or call scaled_dot_product_attention with is_causal=True)"
            )
        if n.op == "get_attr" and str(n.target) in params:
            return f"depends on the parameter {n.target!r}"
        if n.op == "get_attr":
            held = _attr(gm, str(n.target))
            if isinstance(held, torch.Tensor) and held.is_meta:  # a buffer built in __init__, planned on meta
                return (
                    f"depends on the tensor {n.target!r} (a buffer, or a torch.tensor(...) made in forward: "
                    "ALiBi's slopes, a mask table), whose values the planner does not have: the model is planned "
                    "on the meta device"
                )
        ancestors.append(n)
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in sorted(ancestors, key=order.__getitem__):
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(env[mask])
    try:
        value = retarget_device(fx.GraphModule(gm, sub), "cpu")()
    except Exception as e:  # any failure means it cannot be checked: refused with the reason
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        return f"could not be evaluated here to check its pattern ({type(e).__name__}{': ' + first if first else ''})"
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or tuple(value.shape[-2:]) != (q_len, k_len):
        return "is not a (queries, keys) mask"
    if value.dtype == torch.bool:
        allowed = value
    else:
        blocked = value <= torch.finfo(value.dtype).min / 2
        if not bool(((value == 0) | blocked).all()):
            return "adds values other than 0 and -inf (a bias, not a mask)"
        allowed = value == 0
    if bool(allowed.all()):
        return ALLOWS_ALL
    causal = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    if bool((allowed == causal).all()):
        return ""
    window = int(allowed.reshape(-1, q_len, k_len).sum(-1).max())
    if 0 < window < k_len and bool((allowed == (causal & ~causal.tril(k_len - q_len - window))).all()):
        return (
            f"is a sliding-window causal mask (each query sees its last {window} keys: Mistral's, or the local "
            "layers of Gemma 2 and 3), not the whole causal mask the context-parallel kernels compute"
        )
    return "is not the causal mask"


def _gather_outputs(node: fx.Node, ctx: _Ctx, load_balance: bool, training: bool, shard_output: bool) -> int:
    """Gather every sharded graph output whole (`cp_gather_output`), but with `shard_output` the first
    (recorded as a `CpOutputShard`); how many were gathered."""
    count = 0
    scale = float(ctx.tp) if training else 1.0
    out = node.args[0]
    first = loss_output(out)
    keep = None
    if shard_output and isinstance(first, fx.Node):
        p = ctx.place.get(first, _R)
        if isinstance(p, Placement) and p.is_shard:
            keep = first
            node.graph.owning_module.meta[CP_OUTPUT_SHARD] = CpOutputShard(p.dim, load_balance)

    def whole(a: Any) -> Any:
        nonlocal count, keep
        if a is keep:  # the first output only (visited first): the same node returned again is gathered
            keep = None
            return a
        if not isinstance(a, fx.Node):
            return a
        p = ctx.place.get(a, _R)
        if not isinstance(p, Placement) or not p.is_shard:
            return a
        count += 1
        val = ctx.global_val[a]
        with node.graph.inserting_before(node):
            new = node.graph.call_function(cp_gather_output, (a, p.dim, AXIS, load_balance, scale))
        new.meta["val"] = val
        new.meta["cp_placement"] = str(_R)
        return new

    node.args = fx.node.map_aggregate(node.args, whole)
    return count

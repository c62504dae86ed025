"""Per-head norms written head by head, rewritten as one norm over every head.

    merge_per_head_norms(graph) -> int   # norms merged

StableLM-2 (Hugging Face `StableLmLayerNormPerHead`, `qk_layernorm=True`) gives each attention head's
queries and keys a LayerNorm of its own: ``torch.split(x, 1, dim=1)`` takes the heads of
(B, H, T, hd) apart, ``norms[i]`` normalises head i, and ``torch.cat(..., dim=1)`` puts them back. Under
tensor parallelism the heads are split over the ranks, and a cut into one-head pieces is not a shard
any rank holds: the pass refused the head split there, and the attention stayed whole on every rank.

The same function as one op: the norm (LayerNorm, or RMSNorm written as `nn.RMSNorm`) over the head
dim without affine (the statistics are per
position and head either way), then the heads' weights stacked to (H, hd) and viewed to broadcast
over the other dims, multiplied in, and the biases added. Every head is normalised with its own
weight and bias as before; the sharding rules then carry the head split through (a norm over the last
dim keeps a head shard; the stacked weights are sliced to the rank's heads, their gradients gathered).
The rewrite is made only when the pattern is exactly that: a split of one dim into size-1 pieces,
every piece read by one `aten.layer_norm` (or every one by `aten.rms_norm`) over the last dim alone (same eps, a weight of its own, a
bias or none alike), and those norms read by one `aten.cat` along the split dim in head order.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from planner.frontend.fresh_writes import add_call

__all__ = ["merge_per_head_norms"]

aten = torch.ops.aten


def _pieces(split: fx.Node) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """(input, dim, the getitem of each piece in order) of a split of one dim into size-1 pieces."""
    if split.op != "call_function" or split.target not in (aten.split.Tensor, aten.split_with_sizes.default):
        return None
    x, size = split.args[0], split.args[1]
    if not isinstance(x, fx.Node) or not isinstance(x.meta.get("val"), torch.Tensor):
        return None
    nd = x.meta["val"].dim()
    dim = int(split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) % nd
    heads = x.meta["val"].shape[dim]
    # a size the trace does not know (a data-dependent split: JetMoE's tokens per expert) is no heads' view
    if not isinstance(heads, int) or dim == nd - 1 or heads < 2:
        return None
    if isinstance(size, int) and size != 1:
        return None
    if not isinstance(size, int) and (not all(isinstance(s, int) for s in size) or list(size) != [1] * heads):
        return None
    items: dict[int, fx.Node] = {}
    for user in split.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], int):
            return None
        items[user.args[1]] = user
    if sorted(items) != list(range(heads)):
        return None
    return x, dim, [items[i] for i in range(heads)]


# norm -> (index of its bias argument, or None: it has none; index of its eps argument)
_NORMS = {
    aten.layer_norm.default: (3, 4),
    **({aten.rms_norm.default: (None, 3)} if hasattr(aten, "rms_norm") else {}),
}


def _norm_of(piece: fx.Node, width: int) -> fx.Node | None:
    """The one user of `piece` when it is a LayerNorm or RMSNorm (`_NORMS`) over the last dim alone
    with a weight."""
    if len(piece.users) != 1:
        return None
    (norm,) = piece.users
    if norm.target not in _NORMS or norm.args[0] is not piece:
        return None
    shape = list(norm.args[1])
    weight = norm.args[2] if len(norm.args) > 2 else None
    if shape != [width] or not isinstance(weight, fx.Node) or weight.op != "get_attr":
        return None
    return norm


def merge_per_head_norms(graph: fx.Graph) -> int:
    """Rewrite, in place, each split-norm-cat of per-head LayerNorms in `graph` as one LayerNorm with
    the heads' stacked weights (module docstring). Returns how many were rewritten."""
    merged = 0
    for split in list(graph.nodes):
        found = _pieces(split)
        if found is None:
            continue
        x, dim, items = found
        width = x.meta["val"].shape[-1]
        norms = [_norm_of(item, width) for item in items]
        if any(n is None for n in norms):
            continue
        target = norms[0].target
        b_at, eps_at = _NORMS[target]
        eps = {n.args[eps_at] if len(n.args) > eps_at else None for n in norms}
        biases = [n.args[b_at] if b_at is not None and len(n.args) > b_at else None for n in norms]
        has_bias = {b is not None for b in biases}
        if (
            any(n.target is not target or len(n.users) != 1 for n in norms)
            or len(eps) != 1
            or len(has_bias) != 1
        ):
            continue
        (cat,) = norms[0].users
        if (
            cat.target is not aten.cat.default
            or list(cat.args[0]) != norms
            or int(cat.args[1] if len(cat.args) > 1 else 0) % x.meta["val"].dim() != dim
        ):
            continue
        # (H, hd) stacked, viewed to broadcast over x's other dims: (1, H, 1, hd) for (B, H, T, hd)
        view = [1] * x.meta["val"].dim()
        view[dim], view[-1] = len(norms), width
        with graph.inserting_before(cat):
            (eps_value,) = eps
            args = (x, [width], None, None) if b_at is not None else (x, [width], None)
            out = add_call(graph, target, args if eps_value is None else (*args, eps_value), norms[0])
            weight = add_call(graph, aten.stack.default, ([n.args[2] for n in norms],), norms[0])
            out = add_call(
                graph,
                aten.mul.Tensor,
                (out, add_call(graph, aten.view.default, (weight, view), norms[0])),
                cat,
            )
            if has_bias.pop():
                bias = add_call(graph, aten.stack.default, (biases,), norms[0])
                out = add_call(
                    graph,
                    aten.add.Tensor,
                    (out, add_call(graph, aten.view.default, (bias, view), norms[0])),
                    cat,
                )
        cat.replace_all_uses_with(out)
        for node in [cat, *norms, *items, split]:
            graph.erase_node(node)
        merged += 1
    return merged

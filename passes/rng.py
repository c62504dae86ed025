"""Random numbers for dropout under tensor parallelism, as Megatron-LM's RNG tracker does.

Two streams per process:

- the default generator (`torch.manual_seed`), seeded alike on every rank of a TP group: dropout on a
  replicated activation (the residual stream after a row-parallel all-reduce, the embeddings) draws
  from it, so every TP rank drops the same elements and the replicas stay identical;
- the sharded-region stream of a mesh axis (`seed_sharded_rng("tp", seed + rank ...)`), different on
  every TP rank: dropout on a shard (attention probabilities of this rank's heads, a column-parallel
  activation) draws from it, so the shards' masks are independent, as the unsharded model's mask is
  over the whole tensor.

The TP pass (`passes.tp_rules`) rewrites dropout on a shard into the `tp_*` functions below (plain
functions with the axis as a string argument, like `passes.collectives`, so a generated module can
import them); they run the op with the default generator's state swapped for the sharded stream's
(Megatron's `get_cuda_rng_tracker().fork()`), which then advances only the sharded stream. A stream
that was never seeded is seeded on first use from `torch.initial_seed() + SHARDED_SEED_OFFSET + rank`.

Activation recomputation (`passes.recompute`) re-runs regions in backward under
`torch.utils.checkpoint`, which restores the default generator for the re-run;
`recompute_rng_context` (its `context_fn`) does the same for the sharded streams, so a recomputed
dropout draws the mask the forward drew.

`dropout_disabled(*modules)` turns every dropout of captured graphs off for a while (the numerics
check of a training run compares the sharded and unsharded models with dropout off: like with like).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.fx as fx

from passes.collectives import axis_rank

aten = torch.ops.aten
SHARDED_SEED_OFFSET = 2718  # Megatron-LM's model-parallel seed offset (tensor_parallel/random.py)

_STATES: dict[tuple[str, torch.device], torch.Tensor] = {}  # (axis, device) -> sharded stream state


def _device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, getattr(torch, device.type).current_device())
    return device


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return getattr(torch, device.type).get_rng_state(device)


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        getattr(torch, device.type).set_rng_state(state, device)


def seed_sharded_rng(axis: str, seed: int, device: torch.device | str) -> None:
    """(Re)seed the sharded-region stream of `axis` on `device` with `seed` (give every rank of the
    axis a different seed; Megatron uses seed + 2718 + tp_rank)."""
    device = _device(device)
    _STATES[(axis, device)] = torch.Generator(device).manual_seed(seed).get_state()


@contextlib.contextmanager
def sharded_rng(axis: str, device: torch.device | str) -> Iterator[None]:
    """Run the body with `device`'s default generator drawing from the sharded stream of `axis`;
    afterwards the default generator is as before and the sharded stream has advanced."""
    device = _device(device)
    key = (axis, device)
    if key not in _STATES:
        seed_sharded_rng(axis, torch.initial_seed() + SHARDED_SEED_OFFSET + axis_rank(axis), device)
    saved = _get_state(device)
    _set_state(device, _STATES[key])
    try:
        yield
    finally:
        _STATES[key] = _get_state(device)
        _set_state(device, saved)


def recompute_rng_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """`context_fn` of `torch.utils.checkpoint.checkpoint` (non-reentrant): called when the region's
    forward starts, it snapshots every sharded stream; the second context, entered around the re-run
    in backward, sets the streams to that snapshot and afterwards back to where they are then (so the
    re-run draws the forward's masks and the streams' later draws are unchanged)."""
    snapshot = {key: state.clone() for key, state in _STATES.items()}
    return contextlib.nullcontext(), _replaying(snapshot)


@contextlib.contextmanager
def _replaying(snapshot: dict[tuple[str, torch.device], torch.Tensor]) -> Iterator[None]:
    current = dict(_STATES)
    _STATES.clear()  # a stream first seeded inside the region is seeded again the same way
    _STATES.update({key: state.clone() for key, state in snapshot.items()})
    try:
        yield
    finally:
        _STATES.clear()
        _STATES.update(current)


def _on_shard(x: torch.Tensor, axis: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if x.device.type == "meta" else sharded_rng(axis, x.device)


def tp_dropout(x: torch.Tensor, p: float, train: bool, axis: str) -> torch.Tensor:
    """`aten.dropout(x, p, train)` of a shard on `axis`: the mask from this rank's sharded stream."""
    with _on_shard(x, axis):
        return aten.dropout(x, p, train)


def tp_native_dropout(
    x: torch.Tensor, p: float, train: bool | None, axis: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """`aten.native_dropout(x, p, train)` of a shard: (output, mask), the mask from the sharded stream."""
    with _on_shard(x, axis):
        return aten.native_dropout(x, p, train)


def tp_bernoulli(x: torch.Tensor, p: float | None, axis: str) -> torch.Tensor:
    """`aten.bernoulli(x)` (x: probabilities; p None) or `aten.bernoulli.p(x, p)` of a shard, drawn
    from the sharded stream."""
    with _on_shard(x, axis):
        return aten.bernoulli(x) if p is None else aten.bernoulli(x, p)


def tp_scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    axis: str,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`aten.scaled_dot_product_attention` on this rank's heads with attention dropout drawn from the
    sharded stream. q: (B, heads / tp, T, hd); returns the same shape."""
    with _on_shard(q, axis):
        return aten.scaled_dot_product_attention(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )


# which argument turns an op's dropout off, and to what: (index, keyword, off value)
_DROPOUT_SWITCH = {
    aten.dropout.default: (2, "train", False),
    aten.native_dropout.default: (2, "train", False),
    tp_dropout: (2, "train", False),
    tp_native_dropout: (2, "train", False),
    aten.scaled_dot_product_attention.default: (4, "dropout_p", 0.0),
    tp_scaled_dot_product_attention: (4, "dropout_p", 0.0),
}


def _graphs(gm: torch.nn.Module) -> list[fx.GraphModule]:
    """`gm` and every graph module inside it (regions fused into submodules, `passes.recompute`)."""
    return [m for m in gm.modules() if isinstance(m, fx.GraphModule)]


def dropout_nodes(gm: torch.nn.Module) -> list[fx.Node]:
    """The nodes of `gm` and of the graph modules inside it that draw a dropout mask when they run
    (train=True, p > 0)."""
    return [node for g in _graphs(gm) for node in _own_dropout_nodes(g)]


def _own_dropout_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    found = []
    for node in gm.graph.nodes:
        switch = _DROPOUT_SWITCH.get(node.target)
        if node.op != "call_function" or switch is None:
            continue
        index, keyword, _ = switch
        if node.target in (aten.scaled_dot_product_attention.default, tp_scaled_dot_product_attention):
            p = _arg(node, index, keyword, 0.0)
            on = bool(p)
        else:
            p = _arg(node, 1, "p", 0.5)
            on = bool(p) and _arg(node, index, keyword, True) is not False
        if on:
            found.append(node)
    return found


def _arg(node: fx.Node, index: int, keyword: str, default: object) -> object:
    return node.args[index] if len(node.args) > index else node.kwargs.get(keyword, default)


def _set_arg(node: fx.Node, index: int, keyword: str, value: object) -> None:
    if len(node.args) > index:
        node.args = (*node.args[:index], value, *node.args[index + 1 :])
    else:
        node.kwargs = {**node.kwargs, keyword: value}


def _arg_or(args: tuple, kwargs: dict, index: int, names: tuple[str, ...], default: float) -> float:
    if len(args) > index:
        return args[index]
    return next((kwargs[n] for n in names if n in kwargs), default)


def _expectation(target: object, args: tuple, kwargs: dict) -> torch.Tensor:
    name = getattr(getattr(target, "overloadpacket", None), "__name__", "")
    x = args[0]
    if name in ("uniform", "uniform_"):
        value = (_arg_or(args, kwargs, 1, ("from",), 0.0) + _arg_or(args, kwargs, 2, ("to",), 1.0)) / 2
    elif name in ("normal_functional", "normal_"):
        value = _arg_or(args, kwargs, 1, ("mean",), 0.0)
    elif name == "rand_like":
        value = 0.5
    elif name == "randn_like":
        value = 0.0
    elif name in ("bernoulli", "bernoulli_") and (len(args) > 1 or "p" in kwargs):
        p = _arg_or(args, kwargs, 1, ("p",), 0.5)
        return p.expand_as(x).to(x.dtype).clone() if isinstance(p, torch.Tensor) else torch.full_like(x, p)
    elif name == "bernoulli":
        return x.clone()
    else:
        raise ValueError(f"no expectation for {target}")
    return torch.full_like(x, float(value))


# random draws other than dropout masks (router jitter: `x * torch.empty_like(x).uniform_(1 - eps, 1 + eps)`,
# Gaussian noise): `dropout_disabled` runs each at its expectation for the numerics check, as dropout
# off is dropout's expectation, so the reference and the ranks, which draw from other streams, agree
_RANDOM_EXPECTATION = frozenset({
    aten.uniform.default, aten.uniform_.default, aten.normal_functional.default, aten.normal_.default,
    aten.rand_like.default, aten.randn_like.default, aten.bernoulli.default, aten.bernoulli.p,
    aten.bernoulli_.float, tp_bernoulli,
})  # fmt: skip


def random_nodes(gm: torch.nn.Module) -> list[fx.Node]:
    """The nodes of `gm` (and of the graph modules inside it) that draw random numbers other than a
    dropout mask (`_RANDOM_EXPECTATION`)."""
    return [
        n
        for g in _graphs(gm)
        for n in g.graph.nodes
        if n.op == "call_function" and n.target in _RANDOM_EXPECTATION
    ]


def _tp_bernoulli_expectation(x: torch.Tensor, p: float | None, axis: str) -> torch.Tensor:
    return x.clone() if p is None else torch.full_like(x, p)


def _random_expectation(
    x: torch.Tensor, *args: object, _target: object = None, **kwargs: object
) -> torch.Tensor:
    return _expectation(_target, (x, *args), kwargs)


@contextlib.contextmanager
def dropout_disabled(*modules: torch.nn.Module) -> Iterator[None]:
    """Run the body with every dropout of the graphs (and of graph modules inside them) off (train=False; attention dropout_p=0): the
    modules compute their eval-mode function with their train-mode graphs; every other random draw
    (`random_nodes`: uniform, normal, bernoulli, rand_like, randn_like) gives its expectation. Restored
    afterwards."""
    saved: list[tuple[fx.GraphModule, fx.Node, tuple, dict]] = []
    for gm in (g for module in modules for g in _graphs(module)):
        for node in _own_dropout_nodes(gm):
            saved.append((gm, node, node.args, dict(node.kwargs)))
            index, keyword, off = _DROPOUT_SWITCH[node.target]
            _set_arg(node, index, keyword, off)
    drawn: list[tuple[fx.GraphModule, fx.Node, object, dict]] = []  # other random draws: their expectation
    for gm in (g for module in modules for g in _graphs(module)):
        for node in random_nodes(gm):
            drawn.append((gm, node, node.target, dict(node.kwargs)))
            if node.target is tp_bernoulli:
                node.target = _tp_bernoulli_expectation
            else:
                node.kwargs = {**node.kwargs, "_target": node.target}
                node.target = _random_expectation
    changed = {id(gm): gm for gm, *_ in saved + drawn}
    for gm in changed.values():
        gm.recompile()
    try:
        yield
    finally:
        for _, node, args, kwargs in saved:
            node.args, node.kwargs = args, kwargs
        for _, node, target, kwargs in drawn:
            node.target, node.kwargs = target, kwargs
        for gm in changed.values():
            gm.recompile()

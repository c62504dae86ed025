"""Expert routing recorded in the unsharded reference and replayed in a sharded run's numerics check.

A mixture-of-experts router picks each token's experts by a top-k over its scores. Two runs that
compute those scores in another summation order (a row-parallel all-reduce, the expert pass's grouped
GEMMs) round them differently, and in bf16 a token whose k-th and (k+1)-th scores are within a rounding
step of each other may pick another expert: its output, and through attention every later token's,
then differs by far more than rounding, although both runs computed the model correctly (OLMoE served
at TP 2: 0.056 against a tolerance of 0.03; DeepSeek-V3's tiny model trained at EP 2: 0.31 against
0.044).

So the check replays the reference's choices: every router's top-k node (`MoE.topk_node`) is swapped,
for the check only, for a function that records each call's expert ids and the router's logits (the
router linear's output, `MoE.router`) in the reference and, in the sharded run, returns the recorded
ids with this run's own scores at them. The replay would hide a router the rewrite got wrong (every
token handed the reference's experts), so the router is checked on its own: its logits must agree with
the reference's within the run's tolerance of their scale (`logit_diff`, `logit_scale`), as any output
must. The choices this run would have made otherwise are counted, with the largest score gap between
its own choice and the replayed one over finite scores (`flipped`, `max_gap`: reported; a group-limited
router masks the groups it drops to -inf).

Serving replays in call order (`routing_tape`: every rank routes the whole batch, step after step);
training and forward runs by token (`routing_by_token`: ranks route other rows than the reference, a
data-parallel share, a micro-batch, a sequence or context shard, recomputation calling a router twice),
each rank's row given the reference row whose router input is nearest, where that one is within
rounding (`MATCH_RELATIVE` of its norm); a row with no such match keeps its own choice (`unmatched`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

__all__ = [
    "MATCH_RELATIVE",
    "RoutingTape",
    "TokenRoutingTape",
    "keyed_topk",
    "routers_of",
    "routing_by_token",
    "routing_tape",
    "taped_topk",
]

MATCH_RELATIVE = 0.05  # bf16 rounding of another summation order moves a hidden state ~1e-2 of its norm


@dataclass
class _Counts:
    """What a replay saw: top-k calls replayed, rows whose own choice (as a set) differed, the largest
    finite score gap of those, the largest |router logits - the reference's| over matched rows and the
    reference logits' largest magnitude, rows with no reference token within rounding."""

    calls: int = 0
    flipped: int = 0
    max_gap: float = 0.0
    logit_diff: float = 0.0
    logit_scale: float = 0.0
    unmatched: int = 0


@dataclass
class RoutingTape(_Counts):
    """Every top-k call of a request in call order (`choices`: the expert ids (..., k) and the router's
    logits (..., E) of each): recorded (replay False), or replayed in order."""

    choices: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    replay: bool = False


@dataclass
class TokenRoutingTape(_Counts):
    """Per router top-k node name: the reference's router inputs (N, H), expert ids (N, k) and router
    logits (N, E) (`choices`), recorded (replay False) or replayed by token."""

    choices: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    replay: bool = False


_ACTIVE: RoutingTape | TokenRoutingTape | None = None


def _rows(t: torch.Tensor | None, width: int | None = None) -> torch.Tensor | None:
    """``t`` as fp32 CPU rows (-1, its last dim), a copy; None for None or another last dim than ``width``."""
    if t is None or (width is not None and t.shape[-1] != width):
        return None
    return t.detach().float().cpu().reshape(-1, t.shape[-1]).clone()


def _replayed(
    tape: _Counts,
    scores: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    want: torch.Tensor,
    largest: bool,
) -> torch.Tensor:
    """This run's scores at the replayed ids ``want`` (last dim); the rows whose own choice ``indices``
    (as a set) differed counted into ``tape``, with how much better this run scored its own worst
    choice than the replayed one it dropped, over finite scores."""
    tape.calls += 1
    chosen = scores.gather(-1, want)
    own, ref = indices.sort(-1).values, want.sort(-1).values
    rows = (own != ref).any(-1)
    if bool(rows.any()):
        gap = values.amin(-1) - chosen.amin(-1) if largest else chosen.amax(-1) - values.amax(-1)
        gap = gap[rows].detach().float()
        tape.flipped += int(rows.sum())
        finite = gap[torch.isfinite(gap)]
        if finite.numel():
            tape.max_gap = max(tape.max_gap, float(finite.max()))
    return chosen


def _compare_logits(tape: _Counts, own: torch.Tensor | None, ref: torch.Tensor | None) -> None:
    """The router's logits (rows, E) against the reference's for the same tokens, into ``tape``."""
    if own is None or ref is None or own.shape != ref.shape or not own.numel():
        return
    tape.logit_diff = max(tape.logit_diff, float((own - ref).abs().max()))
    tape.logit_scale = max(tape.logit_scale, float(ref.abs().max()))


def taped_topk(
    scores: torch.Tensor,
    k: int,
    dim: int = -1,
    largest: bool = True,
    sorted: bool = True,
    *,
    logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`aten.topk` of a router whose logits are ``logits`` with the active `RoutingTape` (`routing_tape`):
    recorded, or replayed as (this run's scores at the recorded ids, the recorded ids); plain with none
    or over another dim than the last. Raises RuntimeError when a replayed call finds no recorded choice
    or one of another shape (the two runs called other routers)."""
    values, indices = torch.ops.aten.topk.default(scores, k, dim, largest, sorted)
    tape = _ACTIVE
    if not isinstance(tape, RoutingTape) or dim % scores.dim() != scores.dim() - 1:
        return values, indices
    width = scores.shape[-1]
    if not tape.replay:
        tape.choices.append((indices.detach().cpu().clone(), _rows(logits, width)))
        return values, indices
    if tape.calls >= len(tape.choices):
        raise RuntimeError(
            f"expert routing replay: top-k call {tape.calls + 1} of this run has no recorded choice "
            f"(the reference made {len(tape.choices)})"
        )
    want, ref_logits = tape.choices[tape.calls]
    if want.shape != indices.shape:
        raise RuntimeError(
            f"expert routing replay: top-k call {tape.calls + 1} chose {tuple(indices.shape)} ids, the "
            f"reference {tuple(want.shape)}"
        )
    _compare_logits(tape, _rows(logits, width), ref_logits)
    return _replayed(tape, scores, values, indices, want.to(indices.device), largest), want.to(indices.device)


def _nearest(
    keys: torch.Tensor, reference: torch.Tensor, chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the nearest reference row, its distance) for each row of ``keys``, L2, in chunks."""
    index, dist = [], []
    for start in range(0, keys.shape[0], chunk):
        best = torch.cdist(keys[start : start + chunk], reference).min(dim=1)
        index.append(best.indices)
        dist.append(best.values)
    return torch.cat(index), torch.cat(dist)


def keyed_topk(
    scores: torch.Tensor,
    k: int,
    dim: int = -1,
    largest: bool = True,
    sorted: bool = True,
    *,
    key: torch.Tensor,
    name: str,
    logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`aten.topk` over the last dim of a router named ``name``'s scores (..., E) whose tokens' router
    inputs are ``key`` (..., H), the same leading dims (a (tokens, E) router, or a (B, T, E) one), and
    logits ``logits`` (..., E), with the active `TokenRoutingTape` (`routing_by_token`): recorded, or
    replayed by token; plain with none or with other shapes (a top-k over another dim is not a router's
    choice per token)."""
    values, indices = torch.ops.aten.topk.default(scores, k, dim, largest, sorted)
    tape = _ACTIVE
    lead = tuple(scores.shape[:-1])
    if (
        not isinstance(tape, TokenRoutingTape)
        or dim % scores.dim() != scores.dim() - 1
        or tuple(key.shape[:-1]) != lead
    ):
        return values, indices
    rows, own = _rows(key), indices.reshape(-1, k)
    own_logits = _rows(logits, scores.shape[-1])
    if not tape.replay:
        tape.choices[name] = (rows, own.detach().cpu().clone(), own_logits)
        return values, indices
    if name not in tape.choices:
        return values, indices
    ref_rows, ref_ids, ref_logits = tape.choices[name]
    if ref_rows.shape[-1] != rows.shape[-1] or ref_ids.shape[-1] != k:
        return values, indices
    nearest, distance = _nearest(rows, ref_rows)
    matched = distance <= MATCH_RELATIVE * ref_rows[nearest].norm(dim=1).clamp_min(1e-12)
    tape.unmatched += int((~matched).sum())
    if own_logits is not None and ref_logits is not None:
        _compare_logits(tape, own_logits[matched], ref_logits[nearest[matched]])
    want = (
        torch.where(matched[:, None], ref_ids[nearest], own.cpu()).to(indices.device).reshape(indices.shape)
    )
    return _replayed(tape, scores, values, indices, want, largest), want


def routers_of(structure: object) -> dict[str, str]:
    """{top-k node: router node} of each MoE layer of a `ModelStructure` (`MoE.topk_node`,
    `MoE.router`)."""
    return {layer.moe.topk_node: layer.moe.router.node for layer in structure.layers if layer.moe is not None}


@contextlib.contextmanager
def _swapped(
    modules: Sequence[torch.nn.Module],
    routers: Sequence[dict[str, str]],
    tape: RoutingTape | TokenRoutingTape,
    by_token: bool,
) -> Iterator[None]:
    """Every top-k node named in ``routers[i]`` of the GraphModules in ``modules[i]`` (and their
    submodules: pipeline stages) calls the taped top-k with its router's output (and, by token, its
    input) and ``tape`` active inside the block; restored after. A graph without a named node or its
    router is left as it is."""
    global _ACTIVE
    swapped: list[tuple[fx.GraphModule, fx.Node, object, tuple, dict]] = []
    try:
        for module, names in zip(modules, routers):
            for gm in {id(g): g for g in module.modules() if isinstance(g, fx.GraphModule)}.values():
                by_name = {n.name: n for n in gm.graph.nodes}
                changed = False
                for topk_name, router_name in names.items():
                    node, router = by_name.get(topk_name), by_name.get(router_name)
                    if node is None or router is None or node.op != "call_function" or not router.args:
                        continue
                    swapped.append((gm, node, node.target, node.args, dict(node.kwargs)))
                    scores, k, *rest = node.args
                    dim = rest[0] if rest else node.kwargs.get("dim", -1)
                    largest = rest[1] if len(rest) > 1 else node.kwargs.get("largest", True)
                    ordered = rest[2] if len(rest) > 2 else node.kwargs.get("sorted", True)
                    node.args = (scores, k, dim, largest, ordered)
                    if by_token:
                        node.target = keyed_topk
                        node.kwargs = {"key": router.args[0], "name": topk_name, "logits": router}
                    else:
                        node.target = taped_topk
                        node.kwargs = {"logits": router}
                    changed = True
                if changed:
                    gm.recompile()
        _ACTIVE = tape
        yield
    finally:
        _ACTIVE = None
        for _gm, node, target, args, kwargs in swapped:
            node.target, node.args, node.kwargs = target, args, kwargs
        for gm in {id(g): g for g, *_ in swapped}.values():
            gm.recompile()


@contextlib.contextmanager
def routing_tape(
    graphs: Sequence[tuple[torch.nn.Module, dict[str, str]]], tape: RoutingTape
) -> Iterator[RoutingTape]:
    """Inside the block, the routers of each (graph, {top-k node: router node}) record into or replay
    ``tape`` in call order (`taped_topk`)."""
    with _swapped([g for g, _ in graphs], [r for _, r in graphs], tape, by_token=False):
        yield tape


@contextlib.contextmanager
def routing_by_token(
    modules: Sequence[torch.nn.Module], routers: dict[str, str], tape: TokenRoutingTape
) -> Iterator[TokenRoutingTape]:
    """Inside the block, the routers ({top-k node: router node}, `routers_of`) of every GraphModule in
    ``modules`` record into or replay ``tape`` by token (`keyed_topk`)."""
    with _swapped(modules, [routers] * len(modules), tape, by_token=True):
        yield tape

"""Expert routing recorded in the unsharded reference and replayed in a sharded run's numerics check.

A mixture-of-experts router picks each token's experts by a top-k over its scores. Two runs that
compute those scores in another summation order (a row-parallel all-reduce, the expert pass's grouped
GEMMs) round them differently, and in bf16 a token whose k-th and (k+1)-th scores are within a rounding
step of each other may pick another expert: its output, and through attention every later token's,
then differs by far more than rounding, although both runs computed the model correctly. A serving
check compares logits, so it would fail correct rewrites (OLMoE at TP 2 in bf16: 0.056 against a
tolerance of 0.03).

So the check replays the reference's choices: every router's top-k node (`MoE.topk_node`) is swapped,
for the check only, for `taped_topk`, which records each call's expert ids in the reference and, in the
sharded run, returns the recorded ids with this run's own scores at them (the routing weights stay this
run's computation, so a router the rewrite got wrong still shows in the logits). Each replayed choice
this run would have made otherwise is counted, with the score gap between its own choice and the
replayed one (`RoutingTape.flipped`, `max_gap`): a near-tie is a legitimate flip, a wide gap is not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

__all__ = [
    "RoutingTape",
    "TokenRoutingTape",
    "keyed_topk",
    "routers_of",
    "routing_by_token",
    "routing_tape",
    "taped_topk",
    "topk_nodes",
]


@dataclass
class RoutingTape:
    """The expert ids of every top-k call of a request, in call order (`choices`: (tokens, k) int64 each).

    replay False: calls append their ids; True: calls read them back in order, and count the rows whose
    own top-k (as a set) differed (`flipped`) and the largest score gap between the own choice's lowest
    score and the replayed one's (`max_gap`, in the scores' units), next to the scores' scale (`scale`,
    their largest magnitude)."""

    choices: list[torch.Tensor] = field(default_factory=list)
    replay: bool = False
    position: int = 0
    flipped: int = 0
    max_gap: float = 0.0
    scale: float = 0.0


_ACTIVE: RoutingTape | None = None


def taped_topk(
    scores: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """`aten.topk` with the active `RoutingTape` (`routing_tape`): recorded, or replayed as (this run's
    scores at the recorded ids, the recorded ids); plain top-k with none. Raises RuntimeError when a
    replayed call finds no recorded choice or one of another shape (the two runs called other routers)."""
    values, indices = torch.ops.aten.topk.default(scores, k, dim, largest, sorted)
    tape = _ACTIVE
    if tape is None:
        return values, indices
    if not tape.replay:
        tape.choices.append(indices.detach().cpu().clone())
        return values, indices
    if tape.position >= len(tape.choices):
        raise RuntimeError(
            f"expert routing replay: top-k call {tape.position + 1} of this run has no recorded choice "
            f"(the reference made {len(tape.choices)})"
        )
    want = tape.choices[tape.position].to(indices.device)
    tape.position += 1
    if want.shape != indices.shape:
        raise RuntimeError(
            f"expert routing replay: top-k call {tape.position} chose {tuple(indices.shape)} ids, the "
            f"reference {tuple(want.shape)}"
        )
    return _replayed(tape, scores, values, indices, want, dim, largest), want


def _replayed(
    tape: RoutingTape | TokenRoutingTape,
    scores: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    want: torch.Tensor,
    dim: int,
    largest: bool,
) -> torch.Tensor:
    """This run's scores at the replayed ids ``want``; the rows whose own choice ``indices`` (as a set)
    differed counted into ``tape``, with how much better this run scored its own worst choice than the
    replayed one it dropped, and the scores' largest magnitude."""
    chosen = scores.gather(dim, want)
    own, ref = indices.sort(dim).values, want.sort(dim).values
    rows = (own != ref).any(dim)
    if bool(rows.any()):
        gap = values.amin(dim) - chosen.amin(dim) if largest else chosen.amax(dim) - values.amax(dim)
        tape.flipped += int(rows.sum())
        tape.max_gap = max(tape.max_gap, float(gap[rows].detach().float().max()))
    tape.scale = max(tape.scale, float(scores.detach().abs().max()))
    return chosen


def topk_nodes(structure: object) -> list[str]:
    """The names of the top-k nodes that choose experts in a graph's analysis (`MoE.topk_node` of each
    MoE layer of a `ModelStructure`)."""
    return [layer.moe.topk_node for layer in structure.layers if layer.moe is not None]


@contextlib.contextmanager
def routing_tape(
    graphs: Sequence[tuple[fx.GraphModule, list[str]]], tape: RoutingTape
) -> Iterator[RoutingTape]:
    """Inside the block, the top-k nodes named for each graph call `taped_topk` with ``tape`` active;
    restored after. Names no node of a graph holds (a lowering that removed the router) are skipped."""
    global _ACTIVE
    swapped: list[tuple[fx.GraphModule, fx.Node, object]] = []
    try:
        for gm, names in graphs:
            wanted = set(names)
            for node in gm.graph.nodes:
                if node.op == "call_function" and node.name in wanted:
                    swapped.append((gm, node, node.target))
                    node.target = taped_topk
            gm.recompile()
        _ACTIVE = tape
        yield tape
    finally:
        _ACTIVE = None
        for _gm, node, target in swapped:
            node.target = target
        for gm in {id(g): g for g, _ in graphs}.values():
            gm.recompile()


# --------------------------------------------------------------------------- by token (training runs)
#
# A training run's ranks route other rows than the reference (a data-parallel share of the batch, a
# micro-batch, a sequence or context shard, recomputation calling a router twice), so the choices are
# not replayed in call order but by token: the reference records, per router, each row's input to the
# router (the token's hidden state, distinct per token) with its expert ids, and a rank gives each of
# its rows the ids of the reference row whose router input is nearest, where that one is within
# rounding (`MATCH_RELATIVE` of its norm); a row with no such match keeps its own choice.

MATCH_RELATIVE = 0.05  # bf16 rounding of another summation order moves a hidden state ~1e-2 of its norm


@dataclass
class TokenRoutingTape:
    """Per router top-k node name: the reference's router inputs (N, H) and expert ids (N, k)
    (`choices`), recorded (replay False) or replayed by token; with the counts of `RoutingTape`, and
    the rows that found no reference token within `MATCH_RELATIVE` (`unmatched`)."""

    choices: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    replay: bool = False
    calls: int = 0
    flipped: int = 0
    max_gap: float = 0.0
    scale: float = 0.0
    unmatched: int = 0


_TOKEN_TAPE: TokenRoutingTape | None = None


def _nearest(
    keys: torch.Tensor, reference: torch.Tensor, chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the nearest reference row, its distance) for each row of ``keys``, L2, in chunks."""
    index, dist = [], []
    for start in range(0, keys.shape[0], chunk):
        d = torch.cdist(keys[start : start + chunk], reference)
        best = d.min(dim=1)
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """`aten.topk` over the last dim of a router named ``name``'s scores (..., E) whose tokens' router
    inputs are ``key`` (..., H), the same leading dims (a (tokens, E) router, or a (B, T, E) one), with
    the active `TokenRoutingTape` (`routing_by_token`): recorded, or replayed by token; plain with none
    or with other shapes (a top-k over another dim is not a router's choice per token)."""
    values, indices = torch.ops.aten.topk.default(scores, k, dim, largest, sorted)
    tape = _TOKEN_TAPE
    lead = tuple(scores.shape[:-1])
    if tape is None or dim % scores.dim() != scores.dim() - 1 or tuple(key.shape[:-1]) != lead:
        return values, indices
    rows = key.detach().float().cpu().reshape(-1, key.shape[-1])
    own = indices.reshape(-1, k)
    if not tape.replay:
        tape.choices[name] = (rows.clone(), own.detach().cpu().clone())
        return values, indices
    if name not in tape.choices:
        return values, indices
    ref_rows, ref_ids = tape.choices[name]
    if ref_rows.shape[-1] != rows.shape[-1] or ref_ids.shape[-1] != k:
        return values, indices
    tape.calls += 1
    nearest, distance = _nearest(rows, ref_rows)
    matched = distance <= MATCH_RELATIVE * ref_rows[nearest].norm(dim=1).clamp_min(1e-12)
    tape.unmatched += int((~matched).sum())
    want = (
        torch.where(matched[:, None], ref_ids[nearest], own.cpu()).to(indices.device).reshape(indices.shape)
    )
    return _replayed(tape, scores, values, indices, want, -1, largest), want


def routers_of(structure: object) -> dict[str, str]:
    """{top-k node: router node} of each MoE layer of a `ModelStructure` (`MoE.topk_node`,
    `MoE.router`)."""
    return {layer.moe.topk_node: layer.moe.router.node for layer in structure.layers if layer.moe is not None}


@contextlib.contextmanager
def routing_by_token(
    modules: Sequence[torch.nn.Module], routers: dict[str, str], tape: TokenRoutingTape
) -> Iterator[TokenRoutingTape]:
    """Inside the block, every top-k node named in ``routers`` of every GraphModule in ``modules`` (and
    their submodules: pipeline stages) calls `keyed_topk` with its router's input as the key and
    ``tape`` active; restored after. A graph without a named node's router is left as it is."""
    global _TOKEN_TAPE
    swapped: list[tuple[fx.GraphModule, fx.Node, object, tuple, dict]] = []
    graphs = {id(g): g for m in modules for g in m.modules() if isinstance(g, fx.GraphModule)}
    try:
        for gm in graphs.values():
            by_name = {n.name: n for n in gm.graph.nodes}
            changed = False
            for topk_name, router_name in routers.items():
                node, router = by_name.get(topk_name), by_name.get(router_name)
                if node is None or router is None or node.op != "call_function" or not router.args:
                    continue
                swapped.append((gm, node, node.target, node.args, dict(node.kwargs)))
                scores, k, *rest = node.args
                dim = rest[0] if rest else node.kwargs.get("dim", -1)
                largest = rest[1] if len(rest) > 1 else node.kwargs.get("largest", True)
                ordered = rest[2] if len(rest) > 2 else node.kwargs.get("sorted", True)
                node.target = keyed_topk
                node.args = (scores, k, dim, largest, ordered)
                node.kwargs = {"key": router.args[0], "name": topk_name}
                changed = True
            if changed:
                gm.recompile()
        _TOKEN_TAPE = tape
        yield tape
    finally:
        _TOKEN_TAPE = None
        for _gm, node, target, args, kwargs in swapped:
            node.target, node.args, node.kwargs = target, args, kwargs
        for gm in {id(g): g for g, *_ in swapped}.values():
            gm.recompile()

"""Ladder-residual rewrite (Zhang et al., 2025): GraphModule -> GraphModule with overlapped all-reduces.

Number the attention and MLP modules h_1, h_2, ... and let r_i be the residual stream after module i.
Standard: r_i = r_{i-1} + h_i(r_{i-1}). Ladder: r_i = r_{i-1} + h_i(r_{i-2}) - each module reads the
stream from one step earlier, so the all-reduce of h_{i-1}'s output need not finish before h_i runs.

For each laddered module, given its residual add `radd = add(res_in, out)` (out = the module's output,
produced through `tp_all_reduce` in a TP graph), the pass:

1. replaces the module's `tp_all_reduce(partial)` by `pending = tp_all_reduce_start(partial)`
   (issued as soon as the module's output exists, not waited for);
2. before the first use of `res_in`, adds the output of module i-2 (if it was laddered):
   `res_in' = res_in + out_{i-2}`, where `out_{i-2}` is re-derived from `tp_wait(pending_{i-2})`
   (bias add, reshape, dropout that followed the all-reduce are replayed after the wait), so module
   i-1's compute was issued between the start and the wait of module i-2's all-reduce;
3. makes `res_in'` the module's result: uses of `radd` read `res_in'` (module i is not yet added);
4. after the last laddered module, the two outputs still pending are waited for and added before
   whatever followed (final norm and LM head, or the next standard layer).

Module i's compute therefore reads r_{i-2}, as the definition says; without TP (no all-reduce in the
graph) the same rewrite gives the unsharded ladder model, which changes the function the model
computes - the planner only applies it to layers the user allowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from passes import collectives
from planner.frontend.analysis import ModelStructure

aten = torch.ops.aten


class LadderError(ValueError):
    """A laddered module whose residual structure the pass does not recognise; names the node."""


@dataclass
class _Module:
    radd: fx.Node  # add(res_in, out)
    res_in: fx.Node
    out: fx.Node
    all_reduce: fx.Node | None  # tp_all_reduce feeding `out`, None without TP
    chain: list[fx.Node]  # nodes from all_reduce (exclusive) to out (inclusive), in graph order


def _find_module(gm: fx.GraphModule, radd: fx.Node) -> _Module:
    if radd.op != "call_function" or getattr(radd.target, "overloadpacket", None) is not aten.add:
        raise LadderError(f"`{radd.format_node()}` is not a residual add")
    a, b = radd.args[:2]
    # the module output is the operand that descends from an all-reduce / matmul; the stream is the other
    for out, res_in in ((b, a), (a, b)):
        chain, node, found = [], out, None
        for _ in range(8):
            if not isinstance(node, fx.Node):
                break
            if node.target is collectives.tp_all_reduce:
                found = node
                break
            chain.append(node)
            tensor_inputs = [n for n in node.all_input_nodes if n.op != "get_attr"]
            if len(tensor_inputs) != 1:
                break
            node = tensor_inputs[0]
        if found is not None:
            return _Module(radd, res_in, out, found, list(reversed(chain)))
    # no TP: the output is the operand produced inside the module (the other is the stream)
    out, res_in = (b, a) if _depth(b) >= _depth(a) else (a, b)
    return _Module(radd, res_in, out, None, [])


def _depth(node) -> int:
    return len(node.meta.get("module_path", "")) if isinstance(node, fx.Node) else -1


def ladder_residual_adds(structure: ModelStructure, layers: Sequence[int]) -> list[str]:
    """Residual-add node names of the laddered `layers`, attention then MLP, lowest layer first: the
    `residual_adds` argument of `apply_ladder` for a plan's `ladder_layers`.

    structure: `planner.frontend.analysis.analyse` of the graph the pass will rewrite. Raises
    LadderError naming a layer without a recognised attention/MLP residual add.
    """
    adds: list[str] = []
    for index in sorted(layers):
        layer = structure.layers[index]
        for block, name in ((layer.attention, "attention"), (layer.mlp, "MLP")):
            if block is None or block.residual_add is None:
                raise LadderError(f"layer {index} ({layer.module_path}) has no {name} residual add to ladder")
            adds.append(block.residual_add)
    return adds


def apply_ladder(gm: fx.GraphModule, residual_adds: Sequence[str]) -> fx.GraphModule:
    """Rewrite the modules whose residual adds are `residual_adds` (node names, in module order:
    attention then MLP of each laddered layer, lowest layer first) into ladder residual form.

    Returns `gm`, rewritten in place. Raises LadderError naming a node it cannot interpret.
    """
    if not residual_adds:
        return gm
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    missing = [r for r in residual_adds if r not in by_name]
    if missing:
        raise LadderError(f"residual add nodes not in the graph: {missing}")
    modules = [_find_module(gm, by_name[r]) for r in residual_adds]
    pending: list[fx.Node | None] = []  # per module: the start node (TP) or the output itself
    for m in modules:
        if m.all_reduce is not None:
            m.all_reduce.target = collectives.tp_all_reduce_start
            pending.append(m.all_reduce)
        else:
            pending.append(m.out)

    def settled(i: int, before: fx.Node) -> fx.Node:
        """Module i's output, waited for and re-derived right before `before`."""
        m = modules[i]
        if m.all_reduce is None:
            return m.out
        with graph.inserting_before(before):
            env = {m.all_reduce: graph.call_function(collectives.tp_wait, (pending[i],))}
            for node in m.chain:
                env[node] = graph.node_copy(node, lambda n: env.get(n, n))
        return env[m.out]

    order = {n: k for k, n in enumerate(graph.nodes)}
    in_users = [sorted(m.res_in.users, key=order.__getitem__) for m in modules]
    alias: dict[fx.Node, fx.Node] = {}
    for i, m in enumerate(modules):
        stream = alias.get(m.res_in, m.res_in)
        if i >= 2:  # module i reads r_{i-2}: add module i-2's output, waited for only now
            first = in_users[i][0]
            out_prev = settled(i - 2, first)
            with graph.inserting_before(first):
                new = graph.call_function(aten.add.Tensor, (stream, out_prev))
            for user in in_users[i]:
                user.replace_input_with(stream, new)
            stream = new
        if i < len(modules) - 1:
            m.radd.replace_all_uses_with(stream)
            alias[m.radd] = stream
            continue
        tail_users = list(m.radd.users)  # after the last laddered module: settle both pending outputs
        first = min(tail_users, key=lambda u: list(graph.nodes).index(u))
        for j in (i - 1, i):
            if j >= 0:
                out_j = settled(j, first)
                with graph.inserting_before(first):
                    stream = graph.call_function(aten.add.Tensor, (stream, out_j))
        for user in tail_users:
            user.replace_input_with(m.radd, stream)
    for m in modules:  # the chains replayed after each wait: the originals read the pending handle
        if m.all_reduce is None:
            continue
        for node in [m.radd, *reversed(m.chain)]:  # a dropout is impure: dead-code elimination keeps it
            if not node.users:
                graph.erase_node(node)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return gm


def ladder_deviation(reference: torch.Tensor, laddered: torch.Tensor) -> float:
    """Relative L2 distance ||laddered - reference|| / ||reference|| of two outputs (e.g. logits).

    Ladder residual changes the function a standard-trained model computes; this is the figure the
    planner reports so the user sees how far the outputs moved.
    """
    ref = reference.detach().double()
    return float((laddered.detach().double() - ref).norm() / ref.norm().clamp_min(1e-30))

"""Expert-parallel rewrite: each MoE block of one rank's graph runs its experts split over the EP ranks.

    apply_expert_parallel(gm, structure, ep, ep_rank) -> EpLowering

Input: a captured graph and its analysis (`planner.frontend.analysis.analyse`: `Layer.moe`, found by
`planner.frontend.moe`), after the tensor-parallel pass (which keeps the router and the experts
replicated; under sequence parallelism it gathers the block's tokens where the block merges batch and
sequence, before its router, so the TP ranks route the same tokens; with one sequence per micro-batch
the reshape keeps each rank's rows, and experts split over TP gather those rows, their ids and weights
and reduce-scatter the output back, Megatron-Core's order; any other shard is refused). For every MoE block the model's own routing is kept (router, score function, bias,
group limit, top-k, the weights' normalisation: whatever the model computes) and what follows it is
replaced: the routed experts' computation from the top-k to the combine (`MoE.combine_node`, where
the routed outputs are one (N, H) row per token again) becomes one call of
`passes.expert_parallel.ep_moe` on the block's tokens (the router's input, (N, H)), the chosen expert
ids (N, k) and the weights the model combines with (N, k): tokens go to the ranks holding their
experts and back by all-to-all, dropless.

This rank keeps experts ep_rank * E/ep .. (ep_rank + 1) * E/ep - 1: a stacked expert weight (E, a, b)
becomes its (E/ep, a, b) slice under the same name (recorded in `gm.meta["ep_shards"]`, which
`passes.tensor_parallel.read_local_shards` reads to load the slice), a ModuleList's experts other
than this rank's are removed from the module. The experts must be SwiGLU MLPs (gate through SiLU,
times up, then down: Mixtral, Qwen-MoE, DeepSeek, gpt-fast's and torchtitan's MoE); another expert
form is refused with an InputError naming the block.

Gradients (training): an expert's weights live on one rank of each EP group and their gradients sum
the contributions of every EP rank's tokens (the dispatch all-to-all's backward); the runtime reduces
them over the expert data-parallel ranks ("edp") and divides by all dp x cp ranks
(`runtime.data_parallel`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from passes.collectives import tp_all_gather, tp_all_reduce, tp_reduce_scatter, tp_sequence_gather
from passes.context_parallel import cp_gather
from passes.expert_parallel import (
    ep_moe,
    ep_moe_replicated,
    expert_shard,
    input_scale_weights,
    local_experts,
    reset_loads,
)
from planner.errors import InputError
from planner.frontend.analysis import ModelStructure
from planner.frontend.capture import uncast
from planner.frontend.moe import ExpertWeight, MoE
from planner.frontend.roles import Role

__all__ = ["AXIS", "EP_PARAMS_META", "EP_SHARDS_META", "EpLowering", "apply_expert_parallel"]

AXIS = "ep"  # the mesh axis the runtime registers (`passes.collectives.register_group`)
EP_SHARDS_META = "ep_shards"  # gm.meta key: {parameter FQN: `expert_shard` spec}: the slice loaded
EP_PARAMS_META = (
    "ep_params"  # gm.meta key: FQNs of the expert parameters this rank holds (reduced over "edp")
)


@dataclass
class EpLowering:
    """What the expert-parallel pass did to one rank's graph."""

    ep: int
    ep_rank: int
    blocks: list[str] = field(default_factory=list)  # MoE module paths rewritten
    experts: list[int] = field(default_factory=list)  # the experts this rank holds (in every block)
    fold: str = "dp"  # `planner.plan.Plan.ep_fold`


def apply_expert_parallel(
    gm: fx.GraphModule,
    structure: ModelStructure,
    ep: int,
    ep_rank: int,
    fold: str = "dp",
    expert_tp: int = 1,
    tp_rank: int = 0,
    cp_load_balance: bool = False,
) -> EpLowering:
    """Rewrite every MoE block of `gm` in place for EP rank `ep_rank` of `ep` (module docstring).
    fold: "dp" (the EP ranks hold different tokens: `ep_moe`, all-to-all on the "ep" axis) or "tp" (the
    TP ranks, holding the same tokens: `ep_moe_replicated`, an all-reduce on the "tp" axis).
    expert_tp > 1 (fold dp): every expert's width is also split over the TP ranks (this is TP rank
    `tp_rank`), the outputs all-reduced over "tp" (`ep_moe`'s tp_axis). cp_load_balance: the context-
    parallel pass's token order (`Plan.cp_load_balance`), for a block whose router reads this CP rank's
    tokens while its combine was gathered whole (`_rewrite_block`).

    Raises InputError when ep does not divide a block's experts or a block's experts are not SwiGLU
    MLPs, naming the block and what would work."""
    result = EpLowering(ep, ep_rank, fold=fold)
    if ep == 1 and expert_tp == 1:
        return result
    tp_spec = (expert_tp, tp_rank)
    shards: dict[str, tuple[int, int]] = gm.meta.setdefault(EP_SHARDS_META, {})
    reset_loads()
    for layer in structure.layers:
        moe = layer.moe
        if moe is None:
            continue
        if moe.num_experts % ep:
            raise InputError(
                f"expert parallelism ep={ep} cannot split the {moe.num_experts} experts of {moe.module_path} "
                f"evenly; use an ep that divides {moe.num_experts}"
            )
        mine = local_experts(moe.num_experts, ep, ep_rank)
        result.experts = list(mine)
        _rewrite_block(gm, moe, mine, ep, ep_rank, shards, fold, tp_spec, cp_load_balance)
        result.blocks.append(moe.module_path)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    _drop_unused_experts(gm, structure)
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    gm.meta[EP_PARAMS_META] = sorted(
        fqn
        for layer in structure.layers
        if layer.moe is not None
        for w in layer.moe.experts
        for fqn in [*w.weights, *w.biases]
        if fqn in used
    )
    return result


def _rewrite_block(
    gm: fx.GraphModule,
    moe: MoE,
    mine: range,
    ep: int,
    ep_rank: int,
    shards: dict[str, tuple],
    fold: str,
    tp_spec: tuple[int, int] = (1, 0),
    cp_load_balance: bool = False,
) -> None:
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    where = f"the MoE block {moe.module_path}"
    if moe.combine_node is None or moe.combine_node not in nodes:
        raise InputError(f"expert parallelism: {where} has no combine the planner found; plan it with --ep 1")
    combine = nodes[moe.combine_node]
    router = nodes[moe.router.node]
    x = uncast(router.args[0])  # the tokens the experts read, not a router's fp32 copy of them
    tokens, hidden = tuple(x.meta["val"].shape)
    placement = x.meta.get("tp_placement", "Replicate()")
    # sequence parallelism gathers a block's tokens where it merges batch and sequence before its router;
    # with one sequence the reshape keeps this rank's rows (Shard(0)): split experts gather them, their
    # expert ids and weights around the experts and reduce-scatter the output back to the shard
    rows_sharded = tp_spec[0] > 1 and fold == "dp" and placement == "Shard(0)"
    if (fold == "tp" or tp_spec[0] > 1) and placement != "Replicate()" and not rows_sharded:
        raise InputError(
            f"expert parallelism: {where}'s router reads {x.name} as {placement} over the TP ranks, but experts "
            "split over the TP ranks need the same tokens on every one of them; plan it with --expert-tp 1 "
            "(or --sequence-parallel off)"
        )
    if not any(nodes[n].target is torch.ops.aten.silu.default for n in moe.expert_nodes if n in nodes):
        raise InputError(
            f"expert parallelism: {where}'s experts are not SwiGLU MLPs (no SiLU between their gate and "
            "down projections); expert parallelism runs SwiGLU experts; plan it with --ep 1"
        )
    if moe.not_lowerable:
        raise InputError(
            f"expert parallelism: {moe.not_lowerable} in {where}; expert parallelism runs bias-free SwiGLU experts "
            "weighed by the routing weights and would compute other outputs; plan it with --ep 1"
        )
    ids, weights = _routing(combine, tokens, moe.top_k, moe)
    if ids is None or weights is None:
        raise InputError(
            f"expert parallelism: the expert ids and combine weights ({tokens}, {moe.top_k}) of {where} were "
            "not found before its combine; plan it with --ep 1"
        )
    if moe.input_scale is not None:  # Llama 4: the routing weights scale the chosen experts' input rows
        if moe.input_scale not in nodes:
            raise InputError(
                f"expert parallelism: {where}'s input scale {moe.input_scale} is not in the graph"
            )
        with graph.inserting_before(combine):
            weights = graph.call_function(
                input_scale_weights, (nodes[moe.input_scale], ids, moe.num_experts, where)
            )
        weights.meta["val"] = ids.meta["val"].to(nodes[moe.input_scale].meta["val"].dtype)
        for key in ("tp_placement", "cp_placement"):
            if key in ids.meta:
                weights.meta[key] = ids.meta[key]
    scaled = moe.input_scale is not None
    combined = combine.meta.get("tp_placement", "Replicate()")
    if rows_sharded and (
        any(n.meta.get("tp_placement") != "Shard(0)" for n in (ids, weights))
        or combined not in ("Shard(0)", "Replicate()")
    ):
        raise InputError(
            f"expert parallelism: {where}'s tokens are this TP rank's sequence shard but its expert ids, weights or "
            "combined output are not; plan it with --expert-tp 1 (or --sequence-parallel off)"
        )
    by_role = {w.role: w for w in moe.experts}
    if x.meta.get("cp_placement") == "Shard(0)" and combine.meta.get("cp_placement") != "Shard(0)":
        # context parallelism kept the router's rows this CP rank's tokens, but gathered the model's combine
        # whole (a fallback of `passes.cp_lower`, priced by `passes.verify`: the block runs every token on
        # every CP rank): the experts take every CP rank's rows, ids and weights, in sequence order
        with graph.inserting_before(combine):
            x, ids, weights = (
                graph.call_function(cp_gather, (n, 0, "cp", cp_load_balance)) for n in (x, ids, weights)
            )
    with graph.inserting_before(combine):
        if Role.EXPERT_GATE_UP in by_role:
            fused = _local_weight(gm, by_role[Role.EXPERT_GATE_UP], mine, ep, ep_rank, shards, tp_spec)
            size = by_role[Role.EXPERT_GATE_UP].parts[0] if by_role[Role.EXPERT_GATE_UP].parts else None
            if size is None:
                raise InputError(f"expert parallelism: {where}'s fused gate-and-up weight has no parts")
            size //= tp_spec[0]  # each part cut over the TP ranks
            gate = graph.call_function(torch.ops.aten.slice.Tensor, (fused, 1, 0, size))
            up = graph.call_function(torch.ops.aten.slice.Tensor, (fused, 1, size, 2 * size))
        else:
            gate = _local_weight(gm, by_role[Role.EXPERT_GATE], mine, ep, ep_rank, shards, tp_spec)
            up = _local_weight(gm, by_role[Role.EXPERT_UP], mine, ep, ep_rank, shards, tp_spec)
        down = _local_weight(gm, by_role[Role.EXPERT_DOWN], mine, ep, ep_rank, shards, tp_spec)
        if fold == "tp":
            args = (x, ids, weights, gate, up, down, moe.num_experts, "tp", moe.module_path, scaled)
            out = graph.call_function(ep_moe_replicated, args)
        elif rows_sharded:  # the experts' f and g are the gathers and the reduce-scatter
            rows = graph.call_function(tp_sequence_gather, (x, 0, "tp"))
            all_ids = graph.call_function(tp_all_gather, (ids, 0, "tp"))
            all_weights = graph.call_function(tp_sequence_gather, (weights, 0, "tp"))
            args = (
                rows,
                all_ids,
                all_weights,
                gate,
                up,
                down,
                moe.num_experts,
                AXIS,
                moe.module_path,
                None,
                scaled,
            )
            partial = graph.call_function(operator.getitem, (graph.call_function(ep_moe, args), 0))
            # back to the rows of this rank where the model's combine kept them (the TP pass may have
            # gathered them, as for an `index_add` into zeros of the whole batch's literal shape)
            if combine.meta.get("tp_placement") == "Shard(0)":
                out = graph.call_function(tp_reduce_scatter, (partial, 0, "tp"))
            else:
                out = graph.call_function(tp_all_reduce, (partial, "tp"))
        else:
            tp_axis = "tp" if tp_spec[0] > 1 else None
            # whole experts on this rank's sequence shard: the TP ranks hold the same experts for other
            # tokens, and the runtime sums their gradients over them with the expert data-parallel ones,
            # once a step (`Plan.experts_on_sequence_shard`, `runtime.mesh.ep_ranks`)
            shard_rows = fold == "dp" and placement == "Shard(0)"
            args = (x, ids, weights, gate, up, down, moe.num_experts, AXIS, moe.module_path, tp_axis, scaled)
            out = graph.call_function(operator.getitem, (graph.call_function(ep_moe, args), 0))
            if shard_rows and combined == "Replicate()":
                # the model's combine was whole (the TP pass gathered into it, `MoE.combine_into_new`):
                # every rank's rows, in rank order
                out = graph.call_function(tp_all_gather, (out, 0, "tp"))
    out.meta["val"] = combine.meta["val"]
    combine.replace_all_uses_with(out)


def _routing(combine: fx.Node, tokens: int, top_k: int, moe: MoE) -> tuple[fx.Node | None, fx.Node | None]:
    """The last integer and the last floating (tokens, top_k) values the combine depends on computed
    before the first expert GEMM: the chosen expert ids and the weights the model combines with. (A
    per-expert slice of the weights taken while the experts run, (tokens, 1) at top-1, is not them.)"""
    seen: set[fx.Node] = set()
    stack = [combine]
    found: list[fx.Node] = []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and tuple(val.shape) == (tokens, top_k):
            found.append(node)
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(combine.graph.nodes)}
    gemms = {n for w in moe.experts for n in w.nodes}
    first_gemm = min((i for n, i in order.items() if n.name in gemms), default=len(order))
    found = sorted((n for n in found if order[n] < first_gemm), key=order.__getitem__)
    ints = [n for n in found if not n.meta["val"].is_floating_point()]
    floats = [n for n in found if n.meta["val"].is_floating_point()]
    return (ints[-1] if ints else None), (floats[-1] if floats else None)


def _local_weight(
    gm: fx.GraphModule,
    w: ExpertWeight,
    mine: range,
    ep: int,
    ep_rank: int,
    shards: dict[str, tuple],
    tp_spec: tuple[int, int] = (1, 0),
) -> fx.Node:
    """A node holding this rank's experts of `w` as (E/ep, out, in): a stacked weight's slice (the
    parameter replaced by it), or a ModuleList's local experts stacked; with expert tensor parallelism
    (tp_spec = (tp, tp_rank), tp > 1) each expert's width cut to this TP rank's 1/tp (gate / up's rows,
    down's columns; a fused gate-and-up weight part by part). Each replaced parameter's slice spec
    goes to `shards` (`passes.expert_parallel.expert_shard` reads it to load the slice)."""
    graph = gm.graph
    tp, tp_rank = tp_spec
    width_dim = w.weight_out_dim if w.role is not Role.EXPERT_DOWN else 1 - w.weight_out_dim
    parts = tuple(w.parts) if w.parts else None
    fqns = w.weights if not w.stacked else w.weights[:1]
    for fqn in fqns if w.stacked else [w.weights[e] for e in mine]:
        owner_path, _, leaf = fqn.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        full = owner._parameters[leaf]
        spec = (
            ep_rank if w.stacked else 0,
            ep if w.stacked else 1,
            width_dim + (1 if w.stacked else 0) if tp > 1 else -1,
            tp_rank,
            tp,
            parts,
        )
        if spec[1] == 1 and spec[4] == 1:
            continue
        if full.device.type == "meta":
            local = expert_shard(torch.empty(full.shape, device="meta"), spec)
            local = torch.empty(local.shape, dtype=full.dtype, device="meta")
        else:
            local = expert_shard(full.detach(), spec).clone()
        owner._parameters[leaf] = torch.nn.Parameter(local, requires_grad=full.requires_grad)
        shards[fqn] = spec
    if w.stacked:
        node = graph.get_attr(w.weights[0])
    else:
        node = graph.call_function(
            torch.ops.aten.stack.default, ([graph.get_attr(w.weights[e]) for e in mine],)
        )
    if w.weight_out_dim == 1:  # stored (in, out), as torchtitan's (E, H, I)
        node = graph.call_function(torch.ops.aten.transpose.int, (node, 1, 2))
    return node


def _drop_unused_experts(gm: fx.GraphModule, structure: ModelStructure) -> None:
    """Remove parameters no node reads any more (a ModuleList's other experts) from the module."""
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for layer in structure.layers:
        if layer.moe is None:
            continue
        for w in layer.moe.experts:
            if w.stacked:
                continue
            for fqn in w.weights:
                if fqn in used:
                    continue
                owner_path, _, leaf = fqn.rpartition(".")
                try:
                    owner = gm.get_submodule(owner_path) if owner_path else gm
                except AttributeError:
                    continue
                owner._parameters.pop(leaf, None)

"""Recognise a mixture-of-experts block in a layer of a captured graph: router, experts, shared experts, combine.

Input: one layer's fx nodes (`planner.frontend.analysis._layer`), its projections and its routers (the
linears whose logits reach an `aten.topk`, `analysis._routes`). Output: `MoE`, or None with a warning
when a router picks among experts that cannot be found (the layer is then planned as a dense one).

How the block is found (by dataflow from the top-k; module paths only number a ModuleList's experts):

1. Router: E = its out_features, H = its in_features (the stream's width). The top-k: the last
   `aten.topk` downstream of the router over E scores (a group-limited router's top-k over groups
   comes before it); top_k its k. Between the router and the top-k: the score function (softmax or
   sigmoid; a softmax after the top-k on the chosen values only is `ScoreFunction.SOFTMAX_AFTER_TOPK`),
   a bias of E elements added for the choice (DeepSeek-V3's aux-loss-free balancing bias), and a
   top-k over a (N, G) tensor (group-limited routing: G groups, its k the groups a token may use).
2. Expert GEMMs: matmuls (bmm, matmul, mm, einsum, linear, torch._grouped_mm, transformers'
   grouped_mm fallback) that are *routed* - downstream of the top-k (their input gathered by the
   chosen ids, or their weights indexed by them), or with their output multiplied by a value derived
   from the router (dense masked compute) - and whose weight is either
   a) a stacked parameter (E, a, b), reached through indexing and views only: gpt-fast's
      `self.w1[expert_indices]` (pytorch-labs/gpt-fast `mixtral-moe/model.py`), Hugging Face's
      batched_mm `gate_up_proj[expert_ids]` and grouped_mm (transformers `integrations/moe.py`),
      torchtitan's `GroupedExperts` (`torchtitan/models/moe/moe.py`, w1 (E, H, I)); or
   b) a 2-D projection under a numbered module, `<prefix>.<i>.<name>` for i = 0..E-1, every number
      with the same names (a ModuleList of expert MLPs: HF Qwen2-MoE, DeepSeek-V2).
3. Roles, as a dense MLP's on one expert's GEMMs: the one fed by another expert GEMM is down; of the
   others, the one through an activation before the product is gate, the other up; a single first
   GEMM whose output is split in two on its last dim is gate and up fused (`parts`). A stacked
   matrix (E, a, b) is (out, in) when b == H for gate / up (a == H for down), else (in, out).
4. Shared experts: the layer's remaining MLP projections, which every token runs (Qwen2-MoE's
   `shared_expert`, DeepSeek's `shared_experts`): planned as the layer's dense MLP (`Layer.mlp`,
   tensor-parallel like any MLP) and listed in `MoE.shared`.
5. Combine: the first node downstream of every routed down GEMM that holds N x H elements again
   (N the router's tokens): the sum over the k choices, or the slice of an index_add buffer.

Data-dependent shapes (`torch.nonzero` per expert, boolean masks) are refused at capture
(`planner.frontend.capture`), so every shape here is static.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from math import prod
from typing import Any, TypeVar

import torch
from torch import fx

from planner.frontend.capture import op_name, uncast, user_line
from planner.frontend.roles import ACTIVATION_OPS, Projection, Role

_V = TypeVar("_V")

# matmuls an expert's weight may go through (the grouped ones: torch._grouped_mm, and the custom op
# transformers registers for its fallback, `transformers.grouped_mm_fallback`)
GEMM_OPS = frozenset({
    "aten.bmm", "aten.matmul", "aten.mm", "aten.einsum", "aten.linear", "aten.addmm", "aten.baddbmm",
    "aten._grouped_mm", "transformers.grouped_mm_fallback",
})  # fmt: skip
# ops between a stacked expert weight and its GEMM: the gather by expert ids, views, copies
_WEIGHT_PATH_OPS = frozenset({
    "aten.index", "aten.index_select", "aten.select", "aten.slice", "aten.view", "aten.reshape",
    "aten._unsafe_view", "aten.transpose", "aten.permute", "aten.t", "aten.unsqueeze", "aten.squeeze",
    "aten.expand", "aten.contiguous", "aten.clone", "aten.to", "aten._to_copy", "aten.alias",
})  # fmt: skip
# ops that keep a GEMM's output rows as they are (on the way to a split of fused gate and up)
_ROW_VIEWS = frozenset({"aten.view", "aten.reshape", "aten._unsafe_view", "aten.squeeze", "aten.unsqueeze"})
_SPLITS = frozenset({"aten.chunk", "aten.split", "aten.split_with_sizes"})
# ops that weigh an expert's output by a routing score: the product, or a weighted scatter / sum
_WEIGHING_OPS = frozenset(
    {"aten.mul", "aten.einsum", "aten.bmm", "aten.matmul", "aten.index_add", "aten.scatter_add"}
)


class ScoreFunction(str, enum.Enum):
    """How the router turns its logits into the scores the top-k ranks."""

    SOFTMAX = "softmax"  # over all E logits, then top-k (Mixtral, Qwen-MoE)
    SIGMOID = "sigmoid"  # each logit on its own (DeepSeek-V3)
    SOFTMAX_AFTER_TOPK = "softmax_after_topk"  # top-k of the logits, softmax over the k chosen
    NONE = "none"  # top-k of the raw logits, no normalisation found

    def __str__(self) -> str:
        return self.value

    @property
    def function(self) -> str:
        """The function the router's logits go through, before or after the top-k: "softmax" or
        "sigmoid" (Megatron-Core's --moe-router-score-function), "" when none was found."""
        if self is ScoreFunction.NONE:
            return ""
        return "sigmoid" if self is ScoreFunction.SIGMOID else "softmax"


@dataclass
class ExpertWeight:
    """One projection of the routed experts (gate, up, gate-and-up or down), for all E experts."""

    role: Role  # Role.EXPERT_GATE | EXPERT_UP | EXPERT_GATE_UP | EXPERT_DOWN
    weights: list[
        str
    ]  # parameter FQNs: one stacked (E, a, b) tensor, or E per-expert tensors in expert order
    stacked: bool
    in_features: int  # of one expert
    out_features: int  # of one expert
    # which dim of one expert's matrix is its output: 0 for (out, in) (nn.Linear; HF `gate_up_proj`
    # (E, 2I, H); gpt-fast w1 (E, I, H)), 1 for (in, out) (torchtitan w1 (E, H, I)); in a stacked
    # tensor that dim is this + 1 (dim 0 numbers the experts)
    weight_out_dim: int
    parts: tuple[int, ...] | None  # gate and up fused in one matrix: their out sizes (I, I)
    nodes: list[str]  # the GEMM nodes: one for a stacked tensor, one per expert for a ModuleList
    biases: list[str] = field(default_factory=list)  # bias FQNs (per-expert linears with a bias)

    @property
    def params_per_expert(self) -> int:
        """Elements of one expert's matrix (and bias)."""
        return self.in_features * self.out_features + (self.out_features if self.biases else 0)


@dataclass
class MoE:
    """A mixture-of-experts block of a layer: what a cost model needs to price expert parallelism
    (all-to-all dispatch and combine of top_k x tokens x hidden elements each way, the expert GEMMs,
    the router) and what a pass needs to place experts on ranks (weights, node names)."""

    module_path: str  # the block: the common module of its router and experts ("model.layers.0.mlp")
    router: Projection  # Role.ROUTER, (E, H): a linear to the E expert logits
    num_experts: int  # E
    top_k: int  # experts each token runs
    score_function: ScoreFunction
    experts: list[ExpertWeight]  # graph order: gate / up (or fused gate_up) first, down last
    shared: list[Projection]  # shared experts' projections: the layer's dense MLP (`Layer.mlp`), [] if none
    topk_node: str  # the top-k that chooses the experts
    # nodes from the top-k to the experts' inputs (expert ids, sorts, capacity slots, token gathers):
    # what an expert-parallel pass replaces with its dispatch all-to-all
    dispatch_nodes: list[str]
    weight_gather_nodes: list[
        str
    ]  # nodes that index stacked expert weights by expert ids (priced with the GEMMs)
    combine_node: str | None  # where the routed outputs are one (N, H) row per token again
    # every node of the routed computation, top-k excluded: dispatch, weight gathers, the experts'
    # GEMMs and activations, the weighing and the combine, in graph order (`Layer.node_blocks` "experts")
    expert_nodes: list[str]
    selection_bias: str | None = None  # FQN of a bias of E elements added to the scores for the choice only
    # why the expert-parallel rewrite (`passes.ep_lower`), which runs bias-free SwiGLU experts
    # down(silu(gate x) * up x) weighed by the routing weights, would compute something else for this
    # block ("": it computes the same; `not_lowerable`)
    not_lowerable: str = ""
    # a routed tensor of E x N elements, expert-major, that scales the tokens every expert reads before its
    # first projection, where the experts run on every token and their outputs are summed unweighted
    # (Llama 4: `hidden.repeat(E, 1) * sigmoid(scores scattered at the top-k).T.reshape(-1, 1)`, zero for
    # the experts a token does not choose): the expert pass scales each chosen expert's input rows by it
    # instead of weighing its outputs (`input_scale`); None: the routing weights weigh the outputs
    input_scale: str | None = None
    num_groups: int = 1  # group-limited routing: expert groups (1: none)
    topk_groups: int = 1  # ... and the groups each token may choose from
    # whether each token's k routing weights are renormalised to sum to 1 before they weigh the experts
    # (w / w.sum(-1), or a softmax over the k chosen logits: Mixtral, gpt-fast, DeepSeek-V3) or left
    # as the scores over all E experts (Switch's top-1, Qwen-MoE's norm_topk_prob=False): Megatron-Core's
    # softmax router renormalises unless --moe-router-pre-softmax, its sigmoid router always (`_renormalised`)
    renormalised: bool = True
    # whether the combine adds the experts' rows into a tensor created at a size of its own (`x.new_zeros(N
    # + 1, H)`, `torch.zeros(N, H)`) rather than like the tokens (`zeros_like(x)`, an einsum, a sum):
    # sharding propagation (DTensor's) makes such a tensor replicated, so where the block's rows are a
    # sequence shard the TP pass gathers what is added into it, and the combined output is whole on every
    # TP rank (`combine_into_new`; `passes.ep_lower` all-reduces split experts' outputs there, not
    # reduce-scatters)
    combine_into_new: bool = False

    @property
    def hidden_size(self) -> int:
        """H, the width of the tokens the router reads and the experts return."""
        return self.router.in_features

    @property
    def expert_intermediate_size(self) -> int:
        """One routed expert's MLP width (I)."""
        for w in self.experts:
            if w.role is Role.EXPERT_DOWN:
                return w.in_features
        first = self.experts[0]
        return first.parts[0] if first.parts else first.out_features

    @property
    def shared_intermediate_size(self) -> int:
        """The shared experts' MLP width (all of them as one MLP), 0 without shared experts."""
        down = [p for p in self.shared if p.role is Role.DOWN]
        return sum(p.in_features for p in down)

    @property
    def shared_expert_gate(self) -> bool:
        """Whether a projection of the shared experts' MLP is a gate of one output per token (Qwen2-MoE's
        `shared_expert_gate`, a sigmoid of it scaling the shared expert's output: Megatron-Core's
        `moe_shared_expert_gate`)."""
        return any(p.out_features == 1 for p in self.shared)

    @property
    def gemm_nodes(self) -> list[str]:
        """Every expert GEMM node."""
        return [n for w in self.experts for n in w.nodes]

    @property
    def params_per_expert(self) -> int:
        """Elements of one routed expert's weights."""
        return sum(w.params_per_expert for w in self.experts)

    @property
    def expert_params(self) -> int:
        """Elements of all E routed experts' weights (what memory holds)."""
        return self.num_experts * self.params_per_expert

    @property
    def active_expert_params(self) -> int:
        """Elements of the routed experts' weights one token runs: top_k experts."""
        return self.top_k * self.params_per_expert

    def expert_flops(self, tokens: float) -> float:
        """FLOP of the routed experts' GEMMs for ``tokens`` tokens, each running top_k experts
        (2 x tokens x top_k x the elements of one expert's matrices)."""
        return 2.0 * tokens * self.top_k * sum(w.in_features * w.out_features for w in self.experts)

    def dispatch_elements(self, tokens: float) -> float:
        """Elements sent each way (dispatch, and again combine) by an all-to-all: top_k x tokens x H."""
        return self.top_k * tokens * self.hidden_size


def agreed(values: Iterable[_V], unknown: _V) -> _V:
    """The one value of `values` when there are some and all are equal (a fact every MoE layer of a
    model shares: `Plan.moe_top_k` ...), else `unknown`."""
    distinct = set(values)
    return distinct.pop() if len(distinct) == 1 else unknown


@dataclass
class MoEFinding:
    """What `find_moe` found in one layer."""

    moe: MoE | None
    expert_projections: list[Projection]  # 2-D projections of a ModuleList's experts (not the dense MLP's)
    warning: str | None  # a router among experts that could not be recognised: the layer is planned dense


def find_moe(
    layer_path: str,
    members: list[fx.Node],
    projections: dict[str, Projection],
    routers: list[Projection],
    params: dict[str, torch.nn.Parameter],
) -> MoEFinding:
    """The layer's mixture-of-experts block (module docstring), roles set on the experts' per-expert
    projections; `MoE.shared` is left empty (the caller fills it from the dense MLP)."""
    if not routers:
        return MoEFinding(None, [], None)
    node_of = {n.name: n for n in members}
    names = set(node_of)
    router = routers[0]
    router_node = node_of[router.node]
    num_experts = router.out_features
    block = router_node.meta.get("module_path", layer_path).rpartition(".")[0] or layer_path
    after_router = _reach(router_node, names, lambda n: n.users, stop=lambda n: n.name in projections)
    topks = [
        n for n in members
        if n.name in after_router and op_name(n.target) == "aten.topk" and _last_dim(n.args[0]) == num_experts
    ]  # fmt: skip
    if not topks:
        return MoEFinding(None, [], None)
    topk = topks[-1]
    top_k = int(topk.args[1])
    routed = _reach(topk, names, lambda n: n.users)
    scored = _reach(router_node, names, lambda n: n.users)
    gemms = [
        n for n in members
        if op_name(n.target) in GEMM_OPS and n is not router_node
        and (n.name in routed or _weighed(n, node_of, names, scored))
    ]  # fmt: skip
    stacked, gathers = _stacked_weights(gemms, params, num_experts)
    listed, grouping_problem = _modulelist_experts(gemms, projections, layer_path, num_experts, router)
    if not stacked and not listed:
        if not _feeds_an_index(topk, node_of, names):
            return MoEFinding(None, [], None)
        why = grouping_problem or (
            f"neither stacked ({num_experts}, ...) expert weights indexed or grouped by the chosen ids, nor a "
            f"ModuleList of {num_experts} expert MLPs downstream of them"
        )
        return MoEFinding(None, [], _unrecognised(block, router, top_k, why))
    hidden = router.in_features
    experts: list[ExpertWeight] = []
    if stacked:
        roles = _expert_roles([node_of[g] for g in stacked], names)
        experts += [_stacked_expert(g, fqn, roles[g], hidden, params) for g, fqn in stacked.items()]
    if listed:
        roles = _expert_roles([node_of[p.node] for p in listed[0]], names)
        experts += [_listed_expert(i, listed, roles[p.node]) for i, p in enumerate(listed[0])]
        for expert in listed:  # each per-expert projection carries its role into `Plan.roles`
            for p, weight in zip(expert, experts[-len(expert) :]):
                p.role = weight.role
    downs = [n for w in experts if w.role is Role.EXPERT_DOWN for n in w.nodes]
    tokens = router_node.meta["val"].numel() // num_experts
    combine = _combine(members, downs or [n for w in experts for n in w.nodes], names, tokens * hidden)
    if combine is None:
        why = (
            "their outputs never come back to one row per token (no (N, H) value downstream of every expert)"
        )
        return MoEFinding(None, [], _unrecognised(block, router, top_k, why))
    gemm_names = {n for w in experts for n in w.nodes}
    region = _expert_region(members, names, router_node, topk, gemm_names, set(gathers), combine)
    firsts = [n for w in experts if w.role is not Role.EXPERT_DOWN for n in w.nodes]
    before_firsts = set().union(*(_reach(node_of[g], names, lambda n: n.all_input_nodes) for g in firsts))
    after_gemms = set().union(*(_reach(node_of[g], names, lambda n: n.users) for g in gemm_names))
    dispatch = [n for n in region if n in before_firsts and n not in after_gemms | set(gathers) | gemm_names]
    score, bias, groups = _routing(router_node, topk, node_of, names, num_experts, router.bias)
    scale = input_scale(experts, node_of, names, topk, num_experts * tokens)
    unlowerable = not_lowerable(experts, node_of, names, topk, combine, scale)
    rows = uncast(router_node.args[0]).meta.get("val") if isinstance(router_node.args[0], fx.Node) else None
    if not unlowerable and isinstance(rows, torch.Tensor) and rows.dim() != 2:
        # the expert pass exchanges (tokens, H) rows and their (tokens, k) choices
        unlowerable = (
            f"the router reads its tokens as {tuple(rows.shape)} ({user_line(router_node)}), not as (tokens, "
            "hidden) rows"
        )
    moe = MoE(
        module_path=_common_module([block, *(w for e in experts for w in e.weights)]),
        router=router,
        num_experts=num_experts,
        top_k=top_k,
        score_function=score,
        experts=experts,
        shared=[],
        topk_node=topk.name,
        dispatch_nodes=dispatch,
        weight_gather_nodes=[n.name for n in members if n.name in gathers],
        combine_node=combine.name,
        expert_nodes=region,
        selection_bias=bias,
        num_groups=groups[0],
        topk_groups=groups[1],
        renormalised=score is ScoreFunction.SOFTMAX_AFTER_TOPK or _renormalised(topk, node_of, names),
        not_lowerable=unlowerable,
        input_scale=scale,
        combine_into_new=combine_into_new(combine),
    )
    return MoEFinding(moe, [p for group in listed for p in group], None)


# ops that create a tensor of the size given in their arguments (the `*_like` ops take another tensor's)
_NEW_TENSOR = frozenset({
    "aten.new_zeros", "aten.new_empty", "aten.new_full", "aten.new_ones", "aten.zeros", "aten.empty",
    "aten.full", "aten.ones",
})  # fmt: skip
# ops that accumulate rows into their first argument, or view it, on the way to a combine
_INTO_FIRST = frozenset({
    "aten.index_add", "aten.index_put", "aten.index_copy", "aten.scatter_add", "aten.scatter",
    "aten.scatter_reduce", "aten.slice", "aten.narrow", "aten.view", "aten.reshape", "aten._unsafe_view",
    "aten.copy",
})  # fmt: skip


def combine_into_new(combine: fx.Node) -> bool:
    """Whether `combine` (`MoE.combine_node`) is rows accumulated into a tensor created at a size of its own:
    from the combine back along the first argument of accumulations and views (`index_add`, `index_put`,
    `scatter_add`, `slice`, `view`, ...) to a `new_zeros` / `zeros` / `full` / `empty` (`MoE.combine_into_new`)."""
    node: Any = combine
    for _ in range(4096):  # a loop over the experts adds into the same tensor once per expert
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return False
        op = op_name(node.target)
        if op in _NEW_TENSOR:
            return True
        if op not in _INTO_FIRST or not node.args:
            return False
        node = node.args[0]
    return False


# ops the experts' values pass through unchanged (views, copies, slices, splits, concatenation, the
# accumulation of the experts' rows back to one per token)
_PASS_THROUGH = frozenset({
    "aten.view", "aten.reshape", "aten._unsafe_view", "aten.squeeze", "aten.unsqueeze", "aten.transpose",
    "aten.permute", "aten.t", "aten.expand", "aten.clone", "aten.contiguous", "aten._to_copy", "aten.to",
    "aten.alias", "aten.slice", "aten.select", "aten.flatten", "aten.unflatten", "aten.chunk", "aten.split",
    "aten.split_with_sizes", "operator.getitem", "getitem", "aten.cat", "aten.stack", "aten.index", "aten.index_select",
    "aten.index_add", "aten.index_put", "aten.index_copy", "aten.scatter", "aten.scatter_add",
    "aten.scatter_reduce", "aten.slice_scatter", "aten.select_scatter", "aten.copy", "aten.sum", "aten.add",
    "aten.new_zeros", "aten.zeros_like", "aten.zeros", "aten.full", "aten.empty", "aten.sort", "aten.argsort",
    "aten.gather", "aten.masked_fill", "aten.where",
})  # fmt: skip
_PRODUCTS = frozenset({"aten.mul", "aten.einsum", "aten.bmm", "aten.matmul", "aten.mm"})
_ZEROS = frozenset({"aten.zeros", "aten.new_zeros", "aten.zeros_like", "aten.empty", "aten.new_empty"})


def input_scale(
    experts: list[ExpertWeight], node_of: dict[str, fx.Node], names: set[str], topk: fx.Node, numel: int
) -> str | None:
    """`MoE.input_scale`: the routed floating operand, of ``numel`` = E x N elements, of a product that
    scales the tokens before the experts' first projections, where the tokens are every expert's (their
    rows repeated E times, expert-major: `aten.repeat`) and the experts are stacked weights read whole
    (Llama 4's bmm over all experts); None otherwise (a scale read per choice is not recognised)."""
    if any(not w.stacked for w in experts):
        return None
    gemms = {n for w in experts for n in w.nodes}
    firsts = [n for w in experts if w.role is not Role.EXPERT_DOWN for n in w.nodes]
    after_gemms = set().union(*(_reach(node_of[g], names, lambda n: n.users) for g in gemms)) | gemms
    routed = _reach(topk, names, lambda n: n.users) - after_gemms
    before_firsts = set().union(*(_reach(node_of[g], names, lambda n: n.all_input_nodes) for g in firsts))
    found = None
    for name in sorted(before_firsts - gemms, key=list(node_of).index):
        node = node_of[name]
        if op_name(node.target) not in _PRODUCTS | {"aten.div"}:
            continue
        args = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        scales = [a for a in args if a.name in routed and a.meta["val"].is_floating_point()]
        if not scales:
            continue
        tokens = [a for a in args if a not in scales]
        if (
            found is not None
            or op_name(node.target) != "aten.mul"
            or len(scales) != 1
            or scales[0].meta["val"].numel() != numel
            or len(tokens) != 1
            or op_name(tokens[0].target) != "aten.repeat"
        ):
            return None
        found = scales[0].name
    return found


def not_lowerable(
    experts: list[ExpertWeight],
    node_of: dict[str, fx.Node],
    names: set[str],
    topk: fx.Node,
    combine: fx.Node,
    scale: str | None = None,
) -> str:
    """`MoE.not_lowerable`: why the experts are not plain SwiGLU MLPs weighed by the routing weights
    ("" when they are), what the expert-parallel rewrite replaces them with: projections with biases,
    anything between the gate / up projections and the down projection but SiLU, the gate-times-up
    product and views (GPT-OSS's clamps, a scaled activation), and anything between the down projection
    and the combine but the routing weights' product and the accumulation of rows (a constant scale, a
    learned per-expert scale, another activation). A scale of the tokens before the experts is one only
    where it is `input_scale`'s (``scale``), which the rewrite applies to the chosen experts' rows."""
    if any(w.biases for w in experts):
        return "the experts' projections have biases"
    downs = {n for w in experts if w.role is Role.EXPERT_DOWN for n in w.nodes}
    firsts = {n for w in experts if w.role is not Role.EXPERT_DOWN for n in w.nodes}
    gemms = downs | firsts
    after_firsts = set().union(*(_reach(node_of[g], names, lambda n: n.users) for g in firsts))
    before_downs = set().union(*(_reach(node_of[g], names, lambda n: n.all_input_nodes) for g in downs))
    after_downs = set().union(*(_reach(node_of[g], names, lambda n: n.users) for g in downs))
    before_combine = _reach(combine, names, lambda n: n.all_input_nodes) | {combine.name}
    after_gemms = after_firsts | after_downs | gemms
    routed = _reach(topk, names, lambda n: n.users) - after_gemms  # routing weights, ids, dispatch

    def scalar_product(node: fx.Node, neutral: float = 1) -> bool:
        """A product, quotient or sum with a number other than `neutral` (1; 0 for a sum) or with a
        tensor the routing did not make (a sum: any tensor but the experts' own rows)."""
        operands = node.args[1] if op_name(node.target) == "aten.einsum" else node.args[:2]
        others = [a for a in operands if not (isinstance(a, fx.Node) and a.name in after_gemms)]
        return any(
            (not isinstance(a, fx.Node) and a != neutral)
            or (
                isinstance(a, fx.Node)
                and (a.name not in routed if neutral else op_name(a.target) not in _ZEROS)
            )
            for a in others
        )

    # the tokens the experts read, scaled by the routing weights before the first projection (Llama 4's
    # `hidden_states.repeat(E, 1) * router_scores`): the experts' SwiGLU is not linear in that weight, so
    # it is not the weights' product with their outputs that the rewrite computes
    before_firsts = set().union(*(_reach(node_of[g], names, lambda n: n.all_input_nodes) for g in firsts))
    for name in sorted(before_firsts - gemms, key=list(node_of).index):
        node = node_of[name]
        if op_name(node.target) in _PRODUCTS | {"aten.div"} and any(
            isinstance(a, fx.Node)
            and a.name in routed
            and a.meta["val"].is_floating_point()
            and a.name != scale
            for a in node.args[:2]
        ):
            return f"the experts read their tokens scaled by the routing weights ({user_line(node) or name})"
    for name in sorted((after_firsts & before_downs) - gemms, key=list(node_of).index):
        node = node_of[name]
        op = op_name(node.target)
        if op == "aten.silu" or op in _PASS_THROUGH - {"aten.add", "aten.sum"}:
            continue
        if op == "aten.mul" and all(isinstance(a, fx.Node) for a in node.args[:2]):
            continue
        return f"the experts compute {op} ({user_line(node) or name}) between their gate / up and down projections"
    for name in sorted((after_downs & before_combine) - gemms, key=list(node_of).index):
        node = node_of[name]
        op = op_name(node.target)
        if op in _PASS_THROUGH and not (op == "aten.add" and scalar_product(node, 0)):
            continue
        if op in _PRODUCTS | {"aten.div"} and not scalar_product(node):
            continue
        return f"the experts' outputs go through {op} ({user_line(node) or name}) on their way to the combine"
    return ""


def unrecognised_router(
    layer_path: str,
    members: list[fx.Node],
    projections: dict[str, Projection],
    candidates: list[Projection],
    params: dict[str, torch.nn.Parameter],
) -> tuple[Projection, str] | None:
    """A router the top-k search (`find_moe`'s) cannot see, with the warning that says so: one of
    ``candidates`` (the layer's projections outside attention) whose E logits reach, through no other
    projection, the index of a stacked expert parameter (E, a, b) read by ids (HF batched_mm's
    `gate_up_proj[expert_ids]`, gpt-fast's `w1[expert_indices]`) with no `aten.topk` on the way (PhiMoE's
    sparsemixer picks its two experts by max and masking). None when no candidate does. The caller keeps
    it replicated as a router and plans the block dense: expert parallelism and expert TP need the
    top-k's ids and weights, which the expert pass finds through the top-k."""
    node_of = {n.name: n for n in members}
    names = set(node_of)
    for router in candidates:
        start = node_of.get(router.node)
        if start is None:
            continue
        reached = _reach(start, names, lambda n: n.users, stop=lambda n: n.name in projections)
        if any(op_name(node_of[n].target) == "aten.topk" for n in reached):
            continue
        for name in sorted(reached, key=list(node_of).index):
            node = node_of[name]
            if op_name(node.target) not in ("aten.index", "aten.index_select") or not node.args:
                continue
            weight = node.args[0]
            source = (
                _stacked_source(weight, params, router.out_features) if isinstance(weight, fx.Node) else None
            )
            if source is None:
                continue
            block = start.meta.get("module_path", layer_path).rpartition(".")[0] or layer_path
            return router, (
                f"{block}: the {router.out_features} experts stacked in {source[0]} are chosen by ids computed "
                f"from {router.weight}'s logits without a top-k ({user_line(node)} indexes them); the planner "
                "finds a router by its aten.topk, so the block is planned as a dense model: its router "
                "replicated, its expert compute priced as the graph has it, no expert parallelism or expert "
                "TP (write the choice with torch.topk to plan them)"
            )
    return None


def _unrecognised(block: str, router: Projection, top_k: int, why: str) -> str:
    return (
        f"{block}: a top-{top_k} router ({router.weight}) picks among {router.out_features} experts, but "
        f"the experts were not recognised ({why}); the block is planned as a dense model (its router "
        "replicated, its other projections as an MLP), its expert compute priced as the graph has it"
    )


# ------------------------------------------------------------------------------------------ helpers


def _reach(
    start: fx.Node,
    names: set[str],
    step: Callable[[fx.Node], Iterable[fx.Node]],
    stop: Callable[[fx.Node], bool] = lambda n: False,
) -> set[str]:
    """Names of the layer's nodes reached from `start` (exclusive) by `step`; a node for which `stop`
    holds is not entered (nor reported)."""
    seen: set[str] = set()
    queue = deque([start])
    while queue:
        for n in step(queue.popleft()):
            if n.name in seen or n.name not in names or stop(n):
                continue
            seen.add(n.name)
            queue.append(n)
    return seen


def _last_dim(node: object) -> int | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return int(val.shape[-1]) if isinstance(val, torch.Tensor) and val.dim() else None


def _weighed(gemm: fx.Node, node_of: dict[str, fx.Node], names: set[str], scored: set[str]) -> bool:
    """Whether a product downstream of `gemm` weighs it by a value derived from the router (dense
    masked compute: every expert runs every token, its output times the token's routing weight)."""
    after = _reach(gemm, names, lambda n: n.users) | {gemm.name}
    for name in after:
        node = node_of[name]
        if op_name(node.target) not in _WEIGHING_OPS:
            continue
        if any(a.name in scored and a.name not in after for a in node.all_input_nodes):
            return True
    return False


def _stacked_source(
    arg: fx.Node, params: dict[str, torch.nn.Parameter], num_experts: int
) -> tuple[str, list[str]] | None:
    """(FQN, the ops on the way) when `arg` is a stacked expert parameter (E, a, b) reached through
    indexing and views only, else None."""
    chain: list[str] = []
    node = arg
    while node.op == "call_function":
        if (
            op_name(node.target) not in _WEIGHT_PATH_OPS
            or not node.args
            or not isinstance(node.args[0], fx.Node)
        ):
            return None
        chain.append(node.name)
        node = node.args[0]
    if node.op != "get_attr" or node.target not in params:
        return None
    shape = params[node.target].shape
    if len(shape) != 3 or shape[0] != num_experts:
        return None
    return node.target, chain


def _stacked_weights(
    gemms: list[fx.Node], params: dict[str, torch.nn.Parameter], num_experts: int
) -> tuple[dict[str, str], list[str]]:
    """({GEMM node: stacked parameter FQN}, the weight-gather nodes), GEMMs in graph order."""
    found: dict[str, str] = {}
    gathers: list[str] = []
    used: set[str] = set()
    for gemm in gemms:
        for arg in gemm.all_input_nodes:
            source = _stacked_source(arg, params, num_experts)
            if source is not None and source[0] not in used:
                found[gemm.name] = source[0]
                used.add(source[0])
                gathers += source[1]
                break
    return found, gathers


def _expert_number(fqn: str, layer_path: str) -> tuple[str, int, str] | None:
    """("mlp.experts", 3, "gate_proj.weight") for "<layer>.mlp.experts.3.gate_proj.weight" (the part
    after the layer's own number), None without a numbered module."""
    rest = fqn[len(layer_path) + 1 :] if layer_path and fqn.startswith(f"{layer_path}.") else fqn
    parts = rest.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i]), int(part), ".".join(parts[i + 1 :])
    return None


def _modulelist_experts(
    gemms: list[fx.Node],
    projections: dict[str, Projection],
    layer_path: str,
    num_experts: int,
    router: Projection,
) -> tuple[list[list[Projection]], str | None]:
    """The routed 2-D projections grouped by expert number, [expert 0's, expert 1's, ...] each in graph
    order, or ([], why not) when they do not form E numbered experts of the same names."""
    routed = [
        projections[g.name] for g in gemms if g.name in projections and projections[g.name] is not router
    ]
    if not routed:
        return [], None
    groups: dict[str, dict[int, list[Projection]]] = {}
    for p in routed:
        found = _expert_number(p.weight, layer_path)
        if found is None:
            return [], f"the routed projection {p.weight} is under no numbered module"
        groups.setdefault(found[0], {}).setdefault(found[1], []).append(p)
    if len(groups) != 1:
        return (
            [],
            f"the routed projections lie under {len(groups)} module lists ({', '.join(sorted(groups))})",
        )
    ((prefix, experts),) = groups.items()
    if sorted(experts) != list(range(num_experts)):
        return [], f"{prefix} holds experts {sorted(experts)}, not 0..{num_experts - 1}"

    def names(group: list[Projection]) -> list[tuple[str, int, int]]:
        return [(_expert_number(p.weight, layer_path)[2], p.in_features, p.out_features) for p in group]

    ordered = [experts[i] for i in range(num_experts)]
    if any(names(group) != names(ordered[0]) for group in ordered):
        return [], f"the experts of {prefix} do not all hold the same projections"
    return ordered, None


def _expert_roles(units: list[fx.Node], names: set[str]) -> dict[str, tuple[Role, tuple[int, ...] | None]]:
    """Role (and fused parts) of one expert's GEMM nodes, as a dense MLP's (module docstring, step 3)."""
    unit_names = {u.name for u in units}
    out: dict[str, tuple[Role, tuple[int, ...] | None]] = {}
    firsts = []
    for u in units:
        if _reach(u, names, lambda n: n.all_input_nodes) & unit_names:
            out[u.name] = (Role.EXPERT_DOWN, None)
        else:
            firsts.append(u)
    if len(firsts) == 1:
        parts = _split_parts(firsts[0])
        out[firsts[0].name] = (
            (Role.EXPERT_GATE_UP, parts) if parts and len(parts) == 2 else (Role.EXPERT_UP, None)
        )
        return out
    for u in firsts:
        out[u.name] = (Role.EXPERT_GATE if _activated(u, names, unit_names) else Role.EXPERT_UP, None)
    return out


def _split_parts(gemm: fx.Node) -> tuple[int, ...] | None:
    """Sizes of the last-dim split of `gemm`'s output (through row-keeping views), None without one."""
    node = gemm
    while len(node.users) == 1:
        (node,) = node.users
        name = op_name(node.target)
        if name in _SPLITS:
            val = node.meta.get("val")
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
            if isinstance(val, (list, tuple)) and val and dim % val[0].dim() == val[0].dim() - 1:
                return tuple(int(v.shape[-1]) for v in val)
            return None
        if name not in _ROW_VIEWS:
            return None
    return None


def _activated(node: fx.Node, names: set[str], units: set[str]) -> bool:
    """Whether an activation lies between `node` and the next product of two tensors or GEMM."""
    queue, seen = deque([node]), {node.name}
    while queue:
        for user in queue.popleft().users:
            if user.name in seen or user.name not in names or user.name in units:
                continue
            name = op_name(user.target)
            if name in ACTIVATION_OPS:
                return True
            if name == "aten.mul" and all(isinstance(a, fx.Node) for a in user.args[:2]):
                continue
            seen.add(user.name)
            queue.append(user)
    return False


def _stacked_expert(
    gemm: str,
    fqn: str,
    role: tuple[Role, tuple[int, ...] | None],
    hidden: int,
    params: dict[str, torch.nn.Parameter],
) -> ExpertWeight:
    """A stacked expert weight (E, a, b): (out, in) when b == H for gate / up (a == H for down)."""
    _, a, b = (int(d) for d in params[fqn].shape)
    kind, parts = role
    if kind is Role.EXPERT_DOWN:
        out_dim = 1 if b == hidden and a != hidden else 0
    else:
        out_dim = 1 if a == hidden and b != hidden else 0
    out_features, in_features = (a, b) if out_dim == 0 else (b, a)
    return ExpertWeight(kind, [fqn], True, in_features, out_features, out_dim, parts, [gemm])


def _listed_expert(
    position: int, listed: list[list[Projection]], role: tuple[Role, tuple[int, ...] | None]
) -> ExpertWeight:
    """The `position`-th projection of every expert of a ModuleList, as one `ExpertWeight`."""
    group = [expert[position] for expert in listed]
    first = group[0]
    kind, parts = role
    return ExpertWeight(
        kind,
        [p.weight for p in group],
        False,
        first.in_features,
        first.out_features,
        first.weight_out_dim,
        parts or first.parts,
        [p.node for p in group],
        [p.bias for p in group if p.bias],
    )


def _combine(members: list[fx.Node], downs: list[str], names: set[str], elements: int) -> fx.Node | None:
    """The first node downstream of every node of `downs` holding `elements` (N x H) elements."""
    node_of = {n.name: n for n in members}
    after = [_reach(node_of[d], names, lambda n: n.users) for d in downs]
    common = set.intersection(*after) if after else set()
    for n in members:
        val = n.meta.get("val")
        if n.name in common and isinstance(val, torch.Tensor) and val.numel() == elements:
            return n
    return None


def _expert_region(
    members: list[fx.Node],
    names: set[str],
    router: fx.Node,
    topk: fx.Node,
    gemms: set[str],
    gathers: set[str],
    combine: fx.Node,
) -> list[str]:
    """`MoE.expert_nodes`: the nodes the combine depends on (and the combine) that lie downstream of the
    top-k or of an expert GEMM, or upstream of an expert GEMM but not of the router (the tokens
    repeated or padded for the experts), weight gathers and GEMMs included, the router's own path to
    the top-k excluded; in graph order."""
    node_of = {n.name: n for n in members}
    downstream = _reach(topk, names, lambda n: n.users) | set(gemms) | gathers
    before_gemms: set[str] = set()
    for g in gemms:
        downstream |= _reach(node_of[g], names, lambda n: n.users)
        before_gemms |= _reach(node_of[g], names, lambda n: n.all_input_nodes)
    # the tokens made ready for the experts (repeated k times, padded), not on the router's own way in
    downstream |= before_gemms - _reach(router, names, lambda n: n.all_input_nodes) - {router.name}
    routing = _reach(topk, names, lambda n: n.all_input_nodes) | {topk.name}
    before_combine = _reach(combine, names, lambda n: n.all_input_nodes) | {combine.name}
    region = (downstream & before_combine) - routing
    return [n.name for n in members if n.name in region and n.op == "call_function"]


def _routing(
    router: fx.Node,
    topk: fx.Node,
    node_of: dict[str, fx.Node],
    names: set[str],
    num_experts: int,
    router_bias: str | None,
) -> tuple[ScoreFunction, str | None, tuple[int, int]]:
    """(score function, selection bias FQN, (groups, groups per token)) from the nodes between the
    router and its top-k (module docstring, step 1)."""
    between = _reach(topk, names, lambda n: n.all_input_nodes) & _reach(router, names, lambda n: n.users)
    nodes = [n for name, n in node_of.items() if name in between]  # graph order
    ops = {op_name(n.target) for n in nodes}
    if ops & {"aten.softmax", "aten._softmax"}:
        score = ScoreFunction.SOFTMAX
    elif "aten.sigmoid" in ops:
        score = ScoreFunction.SIGMOID
    else:
        after: set[str] = set()
        for value in (u for u in topk.users if u.args[1] == 0):
            after |= _reach(value, names, lambda n: n.users)
        softmax_after = any(op_name(node_of[n].target) in ("aten.softmax", "aten._softmax") for n in after)
        score = ScoreFunction.SOFTMAX_AFTER_TOPK if softmax_after else ScoreFunction.NONE
    bias = None
    for n in nodes:
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a.target != router_bias and _numel(a) == num_experts:
                bias = str(a.target)
    groups = (1, 1)
    for n in nodes:
        width = _last_dim(n.args[0]) if op_name(n.target) == "aten.topk" else None
        if width and 1 < width < num_experts and num_experts % width == 0:
            groups = (width, int(n.args[1]))
    return score, bias, groups


# ops through which the chosen scores stay the routing weights (casts, reshapes, a scale, the sum and
# division of a renormalisation): `_renormalised` follows them from the top-k
_WEIGHT_OPS = frozenset({
    "aten.div", "aten.div_", "aten.sum", "aten.add", "aten.add_", "aten.mul", "aten.mul_", "aten._to_copy",
    "aten.to", "aten.type_as", "aten.view", "aten.reshape", "aten.unsqueeze", "aten.clone", "aten.gather",
    "aten.clamp", "aten.clamp_min",
})  # fmt: skip
_EPSILON_OPS = ("aten.add", "aten.add_", "aten.clamp", "aten.clamp_min")  # around a renormalisation's sum


def _renormalised(topk: fx.Node, node_of: dict[str, fx.Node], names: set[str]) -> bool:
    """Whether the weights a router's top-k chose are divided by their own sum before they weigh the
    experts (`MoE.renormalised`): from the top-k's values, or the scores gathered at its ids (DeepSeek-V3
    picks with a selection bias, then gathers the unbiased scores), through `_WEIGHT_OPS`, a division
    whose divisor is (an epsilon added to) the sum of such a weight."""
    ids = {u.name for u in topk.users if u.args[1] == 1}
    start = [u for u in topk.users if u.args[1] == 0]
    start += [n for n in node_of.values() if op_name(n.target) == "aten.gather" and n.name in names
              and any(a.name in ids for a in n.all_input_nodes)]  # fmt: skip
    chain: set[str] = set()
    while start:
        node = start.pop()
        if node.name in chain:
            continue
        chain.add(node.name)
        start += [u for u in node.users if u.name in names and op_name(u.target) in _WEIGHT_OPS]
    for name in chain:
        node = node_of[name]
        if op_name(node.target) not in ("aten.div", "aten.div_") or not isinstance(node.args[1], fx.Node):
            continue
        divisor = node.args[1]
        if op_name(divisor.target) in _EPSILON_OPS:  # w.sum() + eps, or clamped away from 0
            divisor = next((a for a in divisor.all_input_nodes if op_name(a.target) == "aten.sum"), divisor)
        if op_name(divisor.target) == "aten.sum" and divisor.args[0].name in chain:
            return True
    return False


def _numel(node: fx.Node) -> int:
    val = node.meta.get("val")
    return int(prod(val.shape)) if isinstance(val, torch.Tensor) else -1


# ops through which a router's chosen ids select experts (the mark of a router, not of a top-k used
# for anything else)
_INDEX_OPS = frozenset({
    "aten.index", "aten.gather", "aten.index_select", "aten.scatter", "aten.one_hot", "aten.index_add",
    "aten.index_put", "aten.sort", "aten.argsort", "aten.eq", "aten.bincount", "aten.histc", "aten.scatter_add",
})  # fmt: skip


def _feeds_an_index(topk: fx.Node, node_of: dict[str, fx.Node], names: set[str]) -> bool:
    """Whether the top-k's chosen ids reach an indexing op (`_INDEX_OPS`)."""
    for ids in (u for u in topk.users if u.args[1] == 1):
        if any(op_name(node_of[n].target) in _INDEX_OPS for n in _reach(ids, names, lambda n: n.users)):
            return True
    return False


def _common_module(fqns: list[str]) -> str:
    """The longest common dotted prefix of `fqns` (module FQNs or parameter FQNs' modules)."""
    split = [f.split(".") for f in fqns]
    common: list[str] = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)

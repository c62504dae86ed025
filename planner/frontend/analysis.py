"""Analyse a captured graph: per-node costs and the model's structure (layers, roles, embeddings).

Input: a GraphModule from `planner.frontend.capture.capture` (ATen ops, `meta["val"]`, `meta["module_path"]`).
Output: `ModelStructure` (docs/ARCHITECTURE.md), independent of how the model was written.

How the structure is found (by dataflow; module names are used only to group nodes into layers):

1. Projections: matmuls with a parameter weight - `aten.linear(x, W)` (W is (out, in),
   `weight_out_dim=0`), `aten.addmm(b, x, W)` / `aten.mm(x, W)` / `aten.matmul(x, W)` with W in
   (in, out) layout (HF Conv1D, `weight_out_dim=1`) or transposed, `aten.t(W)` / `W.T`
   (`weight_out_dim=0`).
2. Layers: the numbered children of one module prefix (`model.layers.3`, `transformer.h.3`,
   `layers.3`), numbered 0..n-1, each holding at least two projections; the prefix with the most
   projections wins (so a `nn.Sequential` of single Linears is a plain MLP, not a layer stack). An
   encoder-decoder has two such stacks (T5's `encoder.block.i` and `decoder.block.i`): every stack
   neither inside another nor interleaved with it in graph order is taken, in graph order, and the
   layers are numbered through them (the encoder's 0..n-1, the decoder's n..).
3. Attention core: `aten.scaled_dot_product_attention`, or a manual softmax(Q K^T) V (matmul, bmm or
   einsum -> softmax -> matmul, bmm or einsum). q / k / v: the projections reached walking back from the core's q / k / v
   inputs (through RoPE, reshapes, GQA repeats); one fused projection reaching all three is "qkv" with
   `parts` from the split of its output. "o": the projection reached walking forward from the core.
   A second core in the layer is its cross-attention (`Layer.cross_attention`: a decoder's, whose q
   reads the stream and k / v the encoder's output), with its own q / k / v / o.
4. MLP: the layer's other projections. "down": its input derives from other MLP projections; of the
   rest, the one passed through an activation before the product is "gate", the other "up"
   (a 2-matmul GPT MLP is up / down).
5. Residual adds: the `aten.add` with one operand derived from o (resp. down) and the other the stream.
6. Cut points: `input_node` is the stream operand of the layer's first residual add (walked back to
   the last node outside the layer); `output_node` the layer's last node used outside it. Every other
   value the layer reads from outside is a side input (RoPE cos / sin, attention mask): the layer is
   a pipeline cut if none of them depends on the stream (checked with networkx; the exceptions are
   listed in `Layer.cross_inputs`).

Costs (`NodeCost`, per forward pass, global shapes): matmul FLOPs = 2 * M * N * K (+ M * N for a
bias); attention core = 4 * B * H * T * S * hd, the full T x S score matrix - causal masking is NOT
halved (kernels such as FlashAttention skip the masked half, so this is an upper bound of 2x on the
core); convolutions 2 * out elements * (in channels / groups) * kernel elements (+ out for a bias);
pooling one FLOP per window element read; normalisations `NORM_FLOPS_PER_ELEMENT`; other ops 1 FLOP per
output element (per input element for reductions). Bytes: every tensor input read once and every
output written once (embedding and indexing: only the gathered rows); views (view, transpose,
expand, split, getitem, ...) move nothing. `NodeCost.kind` says how the cost model prices a node
(roofline "matmul" / "attention" / "conv" / "pool" / "memory", "view": only its per-node overhead, "none": not an op);
an op in none of the known sets is priced "memory" from its tensor sizes with `known=False`, and
`unknown_ops` lists those so that the report can name them.
"""

from __future__ import annotations

import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from math import prod

import networkx as nx
import torch
from torch import fx

from costmodels.compute import conv_flops
from costmodels.dtypes import dtype_name
from planner.frontend.capture import (
    bound_arguments,
    einsum_terms,
    is_transpose_2d,
    op_name,
    uncast,
    user_line,
)
from planner.frontend.modelfile import batch_and_seq
from planner.frontend.moe import MoE, find_moe, unrecognised_router
from planner.frontend.roles import ACTIVATION_OPS as _ACTIVATIONS
from planner.frontend.roles import Adapter, Projection, Role

aten = torch.ops.aten

_VIEW_OPS = {
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten.transpose", "aten.permute", "aten.t",
    "aten.expand", "aten.unsqueeze", "aten.squeeze", "aten.slice", "aten.select", "aten.split",
    "aten.split_with_sizes", "aten.chunk", "aten.unbind", "aten.alias", "aten.detach", "aten.as_strided",
    "aten.unflatten", "aten.flatten", "aten.contiguous", "aten.lift_fresh_copy",
}  # fmt: skip
_REDUCTIONS = {"aten.mean", "aten.sum", "aten.amax", "aten.max", "aten.var", "aten.var_mean", "aten.std"}
_SPLITS = {"aten.split", "aten.split_with_sizes", "aten.chunk"}
_MATMULS = {"aten.linear", "aten.addmm", "aten.mm", "aten.matmul"}
_CONVS = {"aten.conv1d", "aten.conv2d", "aten.conv3d", "aten.convolution", "aten._convolution",
          "aten.conv_transpose1d", "aten.conv_transpose2d", "aten.conv_transpose3d"}  # fmt: skip
_POOLS = {
    "aten.max_pool1d", "aten.max_pool2d", "aten.max_pool3d", "aten.max_pool2d_with_indices",
    "aten.avg_pool1d", "aten.avg_pool2d", "aten.avg_pool3d", "aten.adaptive_avg_pool1d",
    "aten.adaptive_avg_pool2d", "aten.adaptive_avg_pool3d", "aten._adaptive_avg_pool2d",
    "aten.adaptive_max_pool1d", "aten.adaptive_max_pool2d",
}  # fmt: skip
NORM_FLOPS_PER_ELEMENT = 8  # mean, subtract, square, mean, rsqrt-scale, affine (a counting convention)
_NORMS = {
    "aten.layer_norm", "aten.native_layer_norm", "aten.batch_norm", "aten.native_batch_norm",
    "aten._native_batch_norm_legit", "aten._native_batch_norm_legit_no_training", "aten.group_norm",
    "aten.native_group_norm", "aten.instance_norm", "aten.rms_norm", "aten._fused_rms_norm",
}  # fmt: skip
_GATHERS = {"aten.embedding", "aten.index", "aten.index_select", "aten.gather", "aten.take"}
# Ops priced as memory-bound by their tensor sizes, known to be so (no FLOP worth counting beyond one
# per output element): elementwise math, comparisons, copies and creation, softmax, indexing writes.
# Not here, so listed as priced from their sizes only: sorts and scans (aten.sort, aten.topk,
# aten.cumsum), whose CPU kernels run far below memory bandwidth (a sort over a (4, 16, 256) fp32
# tensor took ~0.3 ms on the 2-vCPU dev VM, ~100x its memory time).
_ELEMENTWISE = _ACTIVATIONS | {
    "aten.add", "aten.sub", "aten.rsub", "aten.mul", "aten.div", "aten.neg", "aten.exp", "aten.log",
    "aten.sqrt", "aten.rsqrt", "aten.pow", "aten.abs", "aten.clamp", "aten.clamp_min", "aten.clamp_max",
    "aten.where", "aten.masked_fill", "aten.maximum", "aten.minimum", "aten.sin", "aten.cos",
    "aten.reciprocal", "aten.eq", "aten.ne", "aten.lt", "aten.gt", "aten.le", "aten.ge",
    "aten.logical_and", "aten.logical_or", "aten.logical_not", "aten.bitwise_and", "aten.bitwise_or",
    "aten.bitwise_not", "aten.tril", "aten.triu", "aten.to", "aten._to_copy", "aten.clone", "aten.copy",
    "aten.copy_", "aten.fill", "aten.zeros", "aten.ones", "aten.full", "aten.empty", "aten.arange",
    "aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.empty_like", "aten.scalar_tensor",
    "aten.softmax", "aten._softmax", "aten.log_softmax", "aten._log_softmax", "aten.cat", "aten.stack",
    "aten.repeat", "aten.repeat_interleave", "aten.type_as", "aten.dropout", "aten.scatter",
    "aten.scatter_add", "aten.index_put", "aten.index_copy", "aten.masked_scatter",
    "aten.outer", "aten.floor", "aten.ceil", "aten.round", "aten.sign", "aten.square", "aten.addcmul",
    "aten.lerp", "aten.gelu_", "aten.relu_", "aten.add_", "aten.mul_", "aten.baddbmm", "aten.pad",
    "aten.constant_pad_nd", "aten.roll", "aten.flip", "aten.new_zeros", "aten.new_ones", "aten.new_empty",
    "aten.hardtanh", "aten.hardsigmoid", "aten.glu", "aten.log1p", "aten.expm1", "aten.atan2",
    "aten.linspace", "aten.bucketize", "aten.one_hot", "aten.argmax",
    "aten.argmin", "aten.all", "aten.any", "aten.prod", "aten.logsumexp", "aten.norm", "aten.min",
    "aten.upsample_nearest2d", "aten.upsample_bilinear2d", "aten.pixel_shuffle", "aten.im2col",
}  # fmt: skip


@dataclass
class Attention:
    """The attention block of a layer: its projections, head geometry and core."""

    projections: list[Projection]  # q, k, v (or qkv), o - in that order
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sdpa_node: str  # the SDPA node, or the final matmul of a manual softmax(QK^T)V
    residual_add: str | None  # the aten.add adding o's output to the stream (None: no residual found)
    flops: float  # FLOP per forward, attention core only (QK^T and PV), full T x S (causal not halved)
    # a model with a static KV cache (written in forward by an op of CACHE_UPDATE_OPS on a buffer):
    kv_len: int | None = None  # keys each query attends to in the captured graph (the cache length)
    cache_bytes: float = 0.0  # bytes of the layer's K/V cache buffers (global, captured dtype); 0: none
    # heads of the keys the core reads: num_kv_heads when it attends grouped K/V as they are (SDPA
    # enable_gqa), num_heads when the model repeats them to the query heads first (None: not recorded)
    core_kv_heads: int | None = None
    # attention dropout of an SDPA core in the captured mode (0.0: none, or a manual core, whose
    # dropout is an op of its own): the context-parallel kernels do not run it (`passes.cp_lower`)
    dropout_p: float = 0.0
    core_line: str = ""  # where the core is in the model file (`planner.frontend.capture.user_line`)


CACHE_UPDATE_OPS = ("aten.index_put_", "aten.index_put", "aten.index_copy_", "aten.index_copy", "aten.copy_")


def cache_buffers(members: list[fx.Node]) -> list[fx.Node]:
    """The `get_attr` buffers that `members` update in place with a CACHE_UPDATE_OPS op (a KV cache;
    `copy_` into a slice of a buffer counts), each once, in graph order."""
    found: dict[fx.Node, None] = {}
    for node in members:
        if node.op != "call_function" or op_name(node.target) not in CACHE_UPDATE_OPS:
            continue
        dest = node.args[0]
        while isinstance(dest, fx.Node) and op_name(dest.target) in (
            "aten.slice",
            "aten.select",
            "aten.narrow",
        ):
            dest = dest.args[0]
        if isinstance(dest, fx.Node) and dest.op == "get_attr":
            found[dest] = None
    return list(found)


@dataclass
class Mlp:
    """The feed-forward block of a layer."""

    projections: list[Projection]  # graph order
    residual_add: str | None  # the aten.add adding down's output to the stream


@dataclass
class Layer:
    """One repeated transformer layer (a pipeline-stage unit)."""

    index: int
    module_path: str  # "model.layers.3"
    attention: Attention | None
    mlp: Mlp | None
    nodes: list[str]  # fx node names of this layer (its get_attr weights included), in graph order
    input_node: str  # the stream value entering the layer (pipeline cut point)
    output_node: str  # the stream value leaving the layer
    param_bytes: int  # bytes of the layer's parameters, in their dtype
    flops: float  # FLOP per forward, all ops of the layer
    bytes_moved: float  # bytes read + written per forward, all ops of the layer (see NodeCost)
    side_inputs: list[str] = field(default_factory=list)  # other values read from outside (RoPE, mask)
    cross_inputs: list[str] = field(default_factory=list)  # side inputs that depend on the stream
    # node name -> "projection" | "core" (SDPA, or a matmul of a manual attention) | "attention"
    # (derives from q/k/v, not from o: split with the heads under TP) | "cross_core", "cross" (the
    # same of `cross_attention`) | "mlp" (derives from the MLP's first projections, not from down:
    # split with the MLP width) | "experts" (a mixture of experts' routed computation, `MoE.expert_nodes`:
    # dispatch, expert GEMMs, combine; replicated) | "stream" (the rest: norms, residual adds, RoPE
    # tables, the router; not split). Empty when not analysed from a graph.
    node_blocks: dict[str, str] = field(default_factory=dict)
    num_params: int = 0  # elements of the layer's parameters (dtype-free; 0: unknown, handmade)
    # a second attention block after `attention`: an encoder-decoder's cross-attention, q from the
    # stream, k / v from the encoder's output (a side input); its nodes are "cross" in `node_blocks`
    # ("cross_core": its SDPA / matmuls), like "attention" and "core" of the first
    cross_attention: Attention | None = None
    # mixture-of-experts routers (`Role.ROUTER`): linears whose logits choose experts by top-k; not an
    # MLP projection, kept replicated (each rank routes its tokens); nodes "stream" in `node_blocks`
    routers: list[Projection] = field(default_factory=list)
    # per-token scalar gates (`Role.TOKEN_GATE`, `_token_gates`): linears to one output per token that
    # scale a branch (Qwen2-MoE's `shared_expert_gate`); not an MLP projection, kept replicated (Megatron-
    # Core's shared-expert gate weight is), nodes "stream" in `node_blocks`
    token_gates: list[Projection] = field(default_factory=list)
    # multi-head latent attention's down projections (`Role.LATENT`, `_latents`): linears whose output
    # reaches only the attention's q / k / v projections and core; kept whole under TP, nodes "stream"
    latents: list[Projection] = field(default_factory=list)
    # the layer's mixture-of-experts block (`planner.frontend.moe`): router, routed experts (not in
    # `mlp`; their nodes "experts" in `node_blocks`, replicated under TP), shared experts (`mlp`)
    moe: MoE | None = None
    # why a router's experts were not recognised, the layer then planned dense ("": none such)
    experts_unrecognised: str = ""
    # frozen parameters (requires_grad=False: a fine-tune's base weights): elements of the layer's
    # that are frozen (held as weights only: no gradient, no optimizer state), and whether a gradient
    # reaches the layer's inputs (a trainable parameter upstream); a layer with neither runs no
    # backward at all (autograd records nothing there)
    frozen_params: int = 0
    input_requires_grad: bool = True
    # norms that compute in fp32 on a 16-bit stream (`_norm_upcasts`: HF's and Meta's RMSNorm,
    # `x.float()` / `.to(torch.float32)` before the statistics): autograd keeps that fp32 copy of the
    # stream, not the 16-bit input. Seen only in a graph captured in a 16-bit dtype.
    norm_upcasts: int = 0

    @property
    def kept_whole(self) -> list[Projection]:
        """The layer's projections that no split choice covers, replicated under TP: routers, per-token
        gates and latent down projections."""
        return self.routers + self.token_gates + self.latents

    @property
    def trainable(self) -> bool:
        """Whether training runs a backward through this layer: a gradient reaches its inputs or it
        has a trainable parameter."""
        return self.input_requires_grad or self.frozen_params < self.num_params or not self.num_params

    @property
    def active_params(self) -> int:
        """Parameter elements one token runs through: all of `num_params` but the routed experts it
        does not choose (E - top_k of them); `num_params` for a dense layer."""
        if self.moe is None:
            return self.num_params
        return self.num_params - (self.moe.expert_params - self.moe.active_expert_params)


@dataclass
class Embedding:
    """An aten.embedding with a parameter table (vocab_size, dim): token or position embedding."""

    node: str
    weight: str  # parameter FQN (a tied weight may carry the LM head's name)
    vocab_size: int
    dim: int


@dataclass
class NodeCost:
    """Cost of one node per forward pass (global shapes); rules in the module docstring."""

    flops: float  # FLOP
    bytes_read: float  # bytes
    bytes_written: float  # bytes
    shape: tuple[int, ...]  # output shape; () for multi-output nodes
    dtype: str  # "bf16" | "fp16" | "fp32" for floats, else the torch name ("int64", "bool")
    module_path: str
    kind: str = "memory"  # "matmul" | "attention" | "conv" | "pool" | "memory" (roofline), "view", "none"
    known: bool = True  # False: an op the cost model does not know, priced as memory-bound
    op: str = ""  # the ATen op name ("aten.conv2d"), "" when not a call_function
    # a convolution's call as a hashable template (`conv_call`): what `planner calibrate`'s shape
    # timing re-runs on this machine (`costmodels.calibrate.conv_time_ratios`); an activation's
    # (`activation_call`: op and non-tensor arguments, timed by `costmodels.calibrate.
    # activation_time_ratios`); None for other ops
    call: tuple | None = None


@dataclass
class ModelStructure:
    """What the planner needs to know about a model, from its captured graph."""

    layers: list[Layer]
    embeddings: list[Embedding]
    lm_head: Projection | None  # the last projection outside the layers with vocab_size outputs
    tied_lm_head: bool  # the LM head and an embedding share one parameter
    hidden_size: int  # width of the residual stream
    vocab_size: int | None  # rows of the token embedding; None without embeddings
    num_params: int  # unique parameters (a tied weight counts once)
    param_bytes: int  # bytes of the unique parameters, in their dtype
    batch_size: int  # of the example inputs the graph was captured with
    seq_len: int  # tokens per sequence of the example inputs (1 for 2-D float inputs)
    dtype: str  # most common floating parameter dtype: "bf16" | "fp16" | "fp32"
    node_costs: dict[str, NodeCost]  # by fx node name, every node but the output
    mlp_chain: list[Projection]  # models without transformer layers: the projections in order
    num_param_tensors: int = 0  # unique trainable parameter tensors (an optimizer steps each one)
    # (elements, a matrix or larger: what tensor parallelism may split) of each unique trainable
    # parameter tensor, largest first (`param_tensors`): the optimizer's step rate depends on its size
    param_tensor_sizes: tuple[tuple[int, bool], ...] = ()
    # why the batch may not be split (data parallelism, micro-batches): reductions over the batch
    # dimension ("op (model line) reduces over ...", `_batch_mixing`), a sequence-first input, ...
    batch_mixing: list[str] = field(default_factory=list)
    # tokens kept under a capacity counted over the batch or along the sequence (`_token_capacity`):
    # splitting the tokens (dp, micro-batches, cp) or dispatching them dropless (ep) changes which are
    # dropped; "op (model line) numbers ... keeps those under a capacity of C ..." each
    token_capacity: list[str] = field(default_factory=list)
    # a chain's gaps: gap i (1 <= i < len(mlp_chain)) is the fx nodes between chain projections i - 1
    # and i (its activation, and whatever else the model computes there: `chain_gap_nodes`)
    chain_gaps: dict[int, frozenset[str]] = field(default_factory=dict)
    # bytes of the tensors the graph reads that are neither parameters nor KV caches (causal masks,
    # RoPE tables, other buffers and lifted constants), each once: held whole on every rank
    buffer_bytes: int = 0
    # gaps the tensor-parallel pass cannot carry a shard through (an op with no sharding rule, such as
    # a depthwise convolution, runs replicated there), found by lowering a plan
    # (`planner.cli.workflow.make_plan`): their activation op is priced replicated only
    replicated_chain_gaps: frozenset[int] = frozenset()
    # the same for the MLP activations of layer classes (`planner.solver.costing.layer_key`)
    replicated_mlp_classes: frozenset[str] = frozenset()
    # ... and of the attention cores of layer classes (a hand-written core the pass cannot split by heads)
    replicated_attention_classes: frozenset[str] = frozenset()
    # why, per class of `replicated_attention_classes`: the ops the pass gathered at and the model's
    # lines, e.g. "aten.matmul at model.py:26 `s = q @ k.transpose(-1, -2)`" (the exclusion names them)
    replicated_attention_reasons: dict[str, str] = field(default_factory=dict)
    # weight FQN -> why the tensor-parallel pass cannot split it (the op and model line it refused, found
    # by lowering a plan: `planner.cli.workflow.make_plan`): its projection or embedding is priced
    # replicated only
    whole_weights: dict[str, str] = field(default_factory=dict)
    # FQNs (every alias of a tied tensor) of the parameters with requires_grad=False: training holds
    # them as weights only (no gradient, no Adam state, no data-parallel reduction) and runs no
    # weight-gradient GEMM for them (`planner.solver.costing.CostContext.frozen`)
    frozen_params: frozenset[str] = frozenset()
    num_frozen_params: int = 0  # their unique elements (a tied weight counts once)
    # groups of layer indices whose projections read the same weight tensors: one block object the
    # model calls at several depths (`[b0, b1, b2, b0]`: ((0, 3),); ALBERT's one block at every depth).
    # Pipeline stages holding such layers keep a copy each and sum their gradients
    # (`runtime.pipeline.sum_tied_gradients`, priced by `planner.solver.costing.tied_gradient_exchange_s`)
    shared_layers: tuple[tuple[int, ...], ...] = ()

    @property
    def active_params(self) -> int:
        """Parameter elements one token runs through (`Layer.active_params`): `num_params` less the
        routed experts a token does not choose; what a mixture of experts' model FLOPs count."""
        return self.num_params - sum(layer.num_params - layer.active_params for layer in self.layers)

    @property
    def unknown_ops(self) -> list[str]:
        """ATen ops of the graph the cost model does not know (priced as memory-bound), sorted."""
        return sorted({c.op for c in self.node_costs.values() if not c.known})

    @property
    def token_model(self) -> bool:
        """Whether the model reads token ids (has a token embedding): sequence length and tokens/s
        mean something for it; for others (images, feature vectors) samples/s does."""
        return self.vocab_size is not None

    @property
    def has_kv_cache(self) -> bool:
        """Whether an attention layer writes a KV cache of the model's own (a serving phase's graph)."""
        return any(layer.attention is not None and layer.attention.cache_bytes for layer in self.layers)

    def query_head_counts(self) -> list[int]:
        """Distinct numbers of query heads of the attention layers, ascending ([] without attention)."""
        return sorted({layer.attention.num_heads for layer in self.layers if layer.attention is not None})

    def kv_head_counts(self) -> list[int]:
        """Distinct numbers of key/value heads (fewer than query heads under GQA), ascending."""
        return sorted({layer.attention.num_kv_heads for layer in self.layers if layer.attention is not None})

    def stream_tokens(self, seq_len: int | None = None) -> list[int]:
        """Distinct tokens per sequence of the layers' residual streams, ascending: the dim before the
        features of each layer's input, (B, T, C) -> T; what sequence parallelism splits. It differs
        from `seq_len` where the layers see another sequence than the inputs carry: a ViT's patches
        and class token (17 tokens from (B, 3, 32, 32) images, `seq_len` 1). `seq_len`: the sequence
        length of a workload priced at another length than captured; a stream as long as the captured
        sequence is taken to be that long. [`seq_len`] without layers (or a stream of under 3 dims)."""
        want = self.seq_len if seq_len is None else seq_len
        found: set[int] = set()
        for layer in self.layers:
            cost = self.node_costs.get(layer.input_node)
            if cost is None or len(cost.shape) < 3:
                continue
            tokens = cost.shape[-2]
            found.add(want if tokens == self.seq_len else tokens)
        return sorted(found) or [want]

    def kv_heads_unsplit_by(self, tp: int) -> list[int]:
        """The KV head counts (`kv_head_counts`) that ``tp`` ranks can neither split into whole heads
        nor replicate evenly (tp not a multiple of them, as vLLM replicates fewer KV heads than
        ranks): no tensor-parallel degree Megatron-LM or vLLM accepts."""
        return [kv for kv in self.kv_head_counts() if kv % tp and tp % kv]


def analyse(gm: fx.GraphModule) -> ModelStructure:
    """The structure and per-node costs of a captured graph. Pure: does not modify `gm`."""
    nodes = list(gm.graph.nodes)
    params = dict(gm.named_parameters(remove_duplicate=False))
    costs = {n.name: _node_cost(n) for n in nodes if n.op != "output"}
    projections = _attach_adapters([p for n in nodes if (p := _projection(n, params)) is not None], nodes)
    by_node = {p.node: p for p in projections}
    graph = _dataflow(gm.graph)
    layer_groups = _find_layers(nodes, by_node)
    layers = [
        _layer(i, path, members, by_node, costs, params) for i, (path, members) in enumerate(layer_groups)
    ]
    _mark_cross_inputs(layers, graph)
    _mark_input_grads(layers, nodes, params)
    in_layers = {name for layer in layers for name in layer.nodes}

    embeddings = [
        Embedding(n.name, n.args[0].target, *n.args[0].meta["val"].shape)
        for n in nodes
        if n.target == aten.embedding.default and n.args[0].op == "get_attr" and n.args[0].target in params
    ]
    vocab_size = _token_vocab_size(embeddings, {n.name: n for n in nodes})
    outside = [p for p in projections if p.node not in in_layers]
    lm_head = next((p for p in reversed(outside) if vocab_size and p.out_features == vocab_size), None)
    tied = False
    if lm_head is not None:
        lm_head.role = Role.LM_HEAD
        tied = any(params[e.weight] is params[lm_head.weight] for e in embeddings)
    mlp_chain: list[Projection] = []
    if not layers:
        mlp_chain = [p for p in outside if p is not lm_head]
        for p in mlp_chain:
            p.role = Role.FC

    unique = dict(gm.named_parameters())  # deduplicated: a tied weight counts once
    placeholders = [
        n.meta["val"] for n in nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
    ]
    batch_size, seq_len = batch_and_seq(placeholders)
    capacities = _token_capacity(nodes, batch_size, seq_len)
    float_params = [p.dtype for p in unique.values() if p.is_floating_point()]
    dtype = dtype_name(Counter(float_params).most_common(1)[0][0]) if float_params else "fp32"
    return ModelStructure(
        layers=layers,
        embeddings=embeddings,
        lm_head=lm_head,
        tied_lm_head=tied,
        hidden_size=_hidden_size(layers, embeddings, projections, {n.name: n for n in nodes}),
        vocab_size=vocab_size,
        num_params=sum(p.numel() for p in unique.values()),
        param_bytes=sum(p.numel() * p.element_size() for p in unique.values()),
        batch_size=batch_size,
        seq_len=seq_len,
        dtype=dtype,
        node_costs=costs,
        mlp_chain=mlp_chain,
        num_param_tensors=sum(1 for p in unique.values() if p.requires_grad),
        param_tensor_sizes=param_tensors(unique.values()),
        batch_mixing=_batch_mixing(nodes, batch_size, seq_len)
        + [c.reason for c in capacities if c.across_samples],
        token_capacity=[c.reason for c in capacities],
        chain_gaps=chain_gap_nodes(gm.graph, [p.node for p in mlp_chain]),
        buffer_bytes=_buffer_bytes(gm, nodes, unique.values()),
        frozen_params=frozenset(name for name, p in params.items() if not p.requires_grad),
        num_frozen_params=sum(p.numel() for p in unique.values() if not p.requires_grad),
        shared_layers=_shared_layers(layers, params),
    )


def _shared_layers(layers: list[Layer], params: dict[str, torch.nn.Parameter]) -> tuple[tuple[int, ...], ...]:
    """`ModelStructure.shared_layers`: the layers joined where a projection of one reads a weight
    tensor (by identity, whatever its name) a projection of another reads; groups of two or more,
    each sorted, in order of their first layer."""
    owner: dict[int, int] = {}  # id(weight tensor) -> the first layer reading it
    group_of = list(range(len(layers)))

    def root(i: int) -> int:
        while group_of[i] != i:
            i = group_of[i]
        return i

    for layer in layers:
        blocks = [layer.attention, layer.mlp, layer.cross_attention]
        for proj in (p for block in blocks if block is not None for p in block.projections):
            first = owner.setdefault(id(params[proj.weight]), layer.index)
            a, b = root(first), root(layer.index)
            group_of[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for layer in layers:
        groups.setdefault(root(layer.index), []).append(layer.index)
    return tuple(tuple(g) for g in groups.values() if len(g) > 1)


def _buffer_bytes(gm: fx.GraphModule, nodes: list[fx.Node], params: Iterable[torch.Tensor]) -> int:
    """`ModelStructure.buffer_bytes`: the tensors `get_attr` nodes read that are neither ``params`` nor
    a KV cache (`cache_buffers`), each tensor once."""

    def value(node: fx.Node) -> object:
        obj: object = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part, None)
        return obj

    skip = {id(p) for p in params}
    skip |= {id(value(n)) for n in cache_buffers(nodes)}
    total, seen = 0, set()
    for node in nodes:
        if node.op != "get_attr":
            continue
        t = value(node)
        if isinstance(t, torch.Tensor) and id(t) not in skip and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def chain_gap_nodes(graph: fx.Graph, projections: list[str]) -> dict[int, frozenset[str]]:
    """For consecutive projections ``projections[i - 1]`` and ``projections[i]`` (fx node names, in
    graph order), the call nodes between them: downstream of the first and upstream of the second."""
    by_name = {n.name: n for n in graph.nodes}

    def reach(start: fx.Node, step: Callable[[fx.Node], Iterable[fx.Node]]) -> set[str]:
        seen: set[str] = set()
        todo = list(step(start))
        while todo:
            n = todo.pop()
            if n.name not in seen:
                seen.add(n.name)
                todo.extend(step(n))
        return seen

    gaps: dict[int, frozenset[str]] = {}
    for i in range(1, len(projections)):
        after = reach(by_name[projections[i - 1]], lambda n: n.users)
        before = reach(by_name[projections[i]], lambda n: n.all_input_nodes)
        gaps[i] = frozenset(n for n in after & before if by_name[n].op == "call_function")
    return gaps


def param_tensors(params: Iterable[torch.Tensor]) -> tuple[tuple[int, bool], ...]:
    """(elements, at least 2-D) of each trainable tensor of ``params``, largest first
    (`ModelStructure.param_tensor_sizes`)."""
    return tuple(sorted(((p.numel(), p.dim() >= 2) for p in params if p.requires_grad), reverse=True))


# Reductions (and scans) that, over a tensor's leading (batch) dimension or over all of it, combine
# the samples of a batch: a data-parallel replica or a micro-batch would see only some of them
_BATCH_REDUCTIONS = frozenset({
    "aten.mean", "aten.sum", "aten.amax", "aten.amin", "aten.max", "aten.min", "aten.var", "aten.std",
    "aten.var_mean", "aten.std_mean", "aten.logsumexp", "aten.softmax", "aten._softmax", "aten.log_softmax",
    "aten._log_softmax", "aten.cumsum", "aten.cumprod", "aten.sort", "aten.topk", "aten.norm", "aten.prod",
})  # fmt: skip


def _batch_mixing(nodes: list[fx.Node], batch_size: int, seq_len: int = 1) -> list[str]:
    """ "op (model line)" of every floating-point reduction over the batch dimension (dim 0 of a tensor
    whose leading size is the batch, or over all dimensions), or over the tokens of the whole batch
    flattened into one dim (`_flat_token_dims`: a MoE's load-balancing loss `probs.mean(0)` over
    (B * T, E), expert-choice routing's top-k over each expert's (B * T) scores): outputs then depend on
    the other samples of the batch, so splitting the batch (data parallelism, micro-batches) changes
    them. Empty for a batch of 1 (nothing to tell apart). BatchNorm is handled apart
    (`search.BATCH_STATISTICS_OPS`)."""
    if batch_size <= 1:
        return []
    found: dict[str, None] = {}
    # values computed from the model's inputs: a parameter's own softmax (a (C, C) mixing matrix whose
    # C happens to equal B x T) mixes no samples
    from_inputs: set[fx.Node] = set()
    for node in nodes:
        if node.op == "placeholder" or any(a in from_inputs for a in node.all_input_nodes):
            from_inputs.add(node)
    for node, name, source in _calls_on_tensors(nodes, _BATCH_REDUCTIONS):
        if not source.is_floating_point() or source.dim() < 2 or node.args[0] not in from_inputs:
            continue
        batch = {0} if source.shape[0] == batch_size else set()
        flat = _flat_token_dims(node.args[0], batch_size * seq_len) if seq_len > 1 else set()
        if not batch | flat:
            continue
        if name == "aten.topk":  # topk(input, k, dim=-1): its second argument is k, not a dim
            dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
        else:
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if isinstance(dims, int):
            dims = [dims]
        if isinstance(
            dims, fx.Node
        ):  # min / max of two tensors (`aten.min.other`): elementwise, no reduction
            continue
        if dims is None or (isinstance(dims, (list, tuple)) and not dims):  # a reduction over everything
            if name not in ("aten.softmax", "aten._softmax", "aten.log_softmax", "aten._log_softmax"):
                found[f"{name} ({user_line(node) or node.name}) reduces over the batch dimension"] = None
            continue
        reduced = {d % source.dim() for d in dims if isinstance(d, int)}
        if reduced & flat:
            found[f"{name} ({user_line(node) or node.name}) reduces over the batch's tokens (B x T)"] = None
        elif reduced & batch:
            found[f"{name} ({user_line(node) or node.name}) reduces over the batch dimension"] = None
    return list(found)


def _flat_token_dims(node: fx.Node, tokens: int) -> set[int]:
    """The dims of `node`'s value that hold every token of the batch flattened into one (`tokens` = B x
    T entries): dim 0 of a 2-D or larger value with that many rows (`x.view(-1, C)` and what is computed
    row by row from it), or that dim moved by a transpose of such a value (`probs.t()`: (E, B * T)).
    None where two dims have B x T entries: which one holds the tokens is not told by sizes."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or list(val.shape).count(tokens) > 1:
        return set()  # two dims of B x T entries ((E, N) logits with E = B x T): no telling which is whose
    if val.shape[0] == tokens:
        return {0}
    if op_name(node.target) in ("aten.t", "aten.transpose", "aten.permute", "aten.numpy_T") and node.args:
        source = node.args[0]
        inner = _flat_token_dims(source, tokens) if isinstance(source, fx.Node) else set()
        if 0 in inner:
            if op_name(node.target) == "aten.permute":
                order = list(node.args[1])
                return {order.index(0)} if 0 in order else set()
            if op_name(node.target) == "aten.transpose":
                d0, d1 = (d % val.dim() for d in node.args[1:3])
                return {d1 if d0 == 0 else d0 if d1 == 0 else 0}
            return {val.dim() - 1}  # t / numpy_T of a 2-D value
    return set()


def _calls_on_tensors(
    nodes: list[fx.Node], names: frozenset[str]
) -> Iterable[tuple[fx.Node, str, torch.Tensor]]:
    """(node, op name, its first argument's value) of each call of an op in `names` whose first
    argument is a tensor."""
    for node in nodes:
        name = op_name(node.target)
        if node.op != "call_function" or name not in names or not node.args:
            continue
        source = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if isinstance(source, torch.Tensor):
            yield node, name, source


_SCANS = frozenset({"aten.cumsum", "aten.cumprod"})
_THRESHOLDS = frozenset({"aten.lt", "aten.le", "aten.gt", "aten.ge"})
_CAPACITY_DEPTH = 3  # ops between a running count and its comparison (`slot = cumsum(...) - 1`)


@dataclass
class TokenCapacity:
    """A running count over tokens compared with a fixed capacity (GShard-style expert capacity,
    Lepikhin et al. 2020 section 2.2): which tokens are kept depends on the tokens counted before them.
    `across_samples`: the count runs over the batch (dim 0 of a batch or a flattened batch x sequence
    axis), so splitting the batch changes it; otherwise it runs along each sample's sequence (dim 1),
    so only splitting the sequence does. `reason`: the ops and model lines, for refusals."""

    reason: str
    across_samples: bool


def _token_capacity(nodes: list[fx.Node], batch_size: int, seq_len: int) -> list[TokenCapacity]:
    """Every scan (`_SCANS`, any dtype) over a token axis whose result reaches, within
    `_CAPACITY_DEPTH` ops, a comparison (`_THRESHOLDS`) with a number smaller than the tokens scanned:
    a capacity that can drop tokens. A token axis: dim 0 of a tensor whose leading size is the batch or
    batch x seq_len (tokens flattened), or dim 1 of a (batch, seq_len, ...) tensor. A dropless
    dispatch (positions counted but never capped, or a capacity of at least the tokens) is not one."""
    found: dict[str, TokenCapacity] = {}
    for node, name, source in _calls_on_tensors(nodes, _SCANS):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if source.dim() < 1 or not isinstance(dim, int):
            continue
        dim %= source.dim()
        size = source.shape[dim]
        if dim == 0 and batch_size > 1 and size in (batch_size, batch_size * seq_len):
            across = True
        elif seq_len > 1 and (
            (dim == 1 and source.dim() >= 2 and source.shape[0] == batch_size and size == seq_len)
            or (dim == 0 and batch_size == 1 and size == seq_len)
        ):
            across = False
        else:
            continue
        cap = _capped(node, size)
        if cap is None:
            continue
        compare, capacity = cap
        tokens = "the batch's" if across else "each sequence's"
        where, compare_where = user_line(node) or node.name, user_line(compare) or compare.name
        if where == compare_where:  # export records the frames of forward methods only
            ops = f"{name} and {op_name(compare.target)} ({where}) number {tokens} {size} tokens in turn and keep"
        else:
            ops = (
                f"{name} ({where}) numbers {tokens} {size} tokens in turn and {op_name(compare.target)} "
                f"({compare_where}) keeps"
            )
        reason = (
            f"{ops} those under a capacity of {capacity:g}, so which tokens are dropped depends on the others"
        )
        found.setdefault(reason, TokenCapacity(reason, across))
    return list(found.values())


def _capped(scan: fx.Node, size: int) -> tuple[fx.Node, float] | None:
    """(the comparison, its bound) of the first `_THRESHOLDS` node within `_CAPACITY_DEPTH` ops after
    `scan` that compares a value derived from it with a number below `size`, else None."""
    frontier, seen = [scan], {scan}
    for _ in range(_CAPACITY_DEPTH):
        following = []
        for node in frontier:
            for user in node.users:
                if user in seen:
                    continue
                seen.add(user)
                following.append(user)
                if user.op != "call_function" or op_name(user.target) not in _THRESHOLDS:
                    continue
                bound = next(
                    (a for a in user.args if isinstance(a, (int, float)) and not isinstance(a, bool)), None
                )
                if bound is not None and bound < size:
                    return user, float(bound)
        frontier = following
    return None


# ------------------------------------------------------------------------------------------- costs


def _nbytes(val: object) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_nbytes(v) for v in val)
    return 0


def _dtype_str(dtype: torch.dtype) -> str:
    return dtype_name(dtype) if dtype.is_floating_point else str(dtype).removeprefix("torch.")


def _node_cost(node: fx.Node) -> NodeCost:
    val = node.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
    dtype = _dtype_str(val.dtype) if isinstance(val, torch.Tensor) else ""
    path = node.meta.get("module_path", "")
    name = op_name(node.target)
    if node.op != "call_function" or name == "getitem":
        return NodeCost(0.0, 0.0, 0.0, shape, dtype, path, kind="none")
    if name in _VIEW_OPS:
        return NodeCost(0.0, 0.0, 0.0, shape, dtype, path, kind="view", op=name)
    inputs = [a.meta.get("val") for a in node.all_input_nodes]
    written = float(_nbytes(val))
    read = float(sum(_nbytes(v) for v in inputs))
    out_numel = val.numel() if isinstance(val, torch.Tensor) else 0
    kind, known = "memory", True
    if name in _MATMULS:
        x = node.args[1] if name == "aten.addmm" else node.args[0]
        k = x.meta["val"].shape[-1]
        has_bias = name == "aten.addmm" or (
            name == "aten.linear" and len(node.args) > 2 and node.args[2] is not None
        )
        flops, kind = 2.0 * out_numel * k + (out_numel if has_bias else 0), "matmul"
    elif name == "aten.bmm":
        flops, kind = 2.0 * out_numel * node.args[0].meta["val"].shape[-1], "matmul"
    elif name == "aten.einsum" and len(node.args[1]) == 2:  # a product of two: 2 x every letter's size
        flops, kind = 2.0 * prod(_einsum_sizes(node).values()), "matmul"
    elif name in _CONVS:
        flops, kind = _conv_flops(node, out_numel), "conv"
        return NodeCost(flops, read, written, shape, dtype, path, kind=kind, op=name, call=conv_call(node))
    elif name == "aten.scaled_dot_product_attention":
        flops, kind = _sdpa_flops(*(a.meta["val"] for a in node.args[:3])), "attention"
    elif name in _GATHERS:  # gathers rows: reads the index and the rows it picks, not the whole table
        index_bytes = sum(
            _nbytes(v) for v in inputs[1:] if isinstance(v, torch.Tensor) and not v.is_floating_point()
        )
        flops, read = 0.0, written + index_bytes
    elif name in CACHE_UPDATE_OPS:  # a write into a slice of a buffer (a KV cache): only the values move
        values = node.args[{"aten.index_put_": 2, "aten.index_put": 2, "aten.copy_": 1}.get(name, 3)]
        moved = float(_nbytes(values.meta.get("val"))) if isinstance(values, fx.Node) else 0.0
        index_bytes = sum(
            _nbytes(v) for v in inputs if isinstance(v, torch.Tensor) and not v.is_floating_point()
        )
        flops, read, written = (
            moved / max(val.element_size(), 1) if isinstance(val, torch.Tensor) else 0.0,
            moved + index_bytes,
            moved,
        )
    elif name in _POOLS:  # every input element of every window read once
        flops = float(max((v.numel() for v in inputs if isinstance(v, torch.Tensor)), default=0))
        kind = "pool"
    elif name in _NORMS:
        flops = float(NORM_FLOPS_PER_ELEMENT * out_numel)
    elif name in _ACTIVATIONS and isinstance(val, torch.Tensor):
        return NodeCost(
            float(out_numel), read, written, shape, dtype, path, op=name, call=activation_call(node)
        )
    elif name in _REDUCTIONS:
        flops = float(max((v.numel() for v in inputs if isinstance(v, torch.Tensor)), default=0))
    else:
        flops = float(out_numel)
        # a Python-level function or an op returning no tensor (sym_size) is not an unknown tensor op
        tensor_out = isinstance(val, torch.Tensor) or (
            isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)
        )  # sort, topk, max.dim, ... return (values, indices)
        known = name in _ELEMENTWISE or not tensor_out or not isinstance(node.target, torch._ops.OpOverload)
    return NodeCost(flops, read, written, shape, dtype, path, kind=kind, known=known, op=name)


def conv_call(node: fx.Node) -> tuple:
    """``(op name, args, input needs a gradient)`` of a convolution node, each tensor argument as
    ("tensor", shape, dtype), lists as tuples, other arguments as they are: hashable, and enough to run
    the same call on real tensors (`costmodels.calibrate.conv_time_ratios`). The input needs no
    gradient when it is a graph input (an image batch): its backward then computes the weight's only."""

    def template(a: object) -> object:
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            return (
                ("tensor", tuple(int(d) for d in v.shape), _dtype_str(v.dtype))
                if isinstance(v, torch.Tensor)
                else None
            )
        if isinstance(a, (list, tuple)):
            return tuple(template(x) for x in a)
        return a

    x = node.args[0]
    input_grad = not (isinstance(x, fx.Node) and x.op == "placeholder")
    return (op_name(node.target), tuple(template(a) for a in node.args), input_grad)


def activation_call(node: fx.Node) -> tuple:
    """``(op name, non-tensor arguments, keyword arguments)`` of an activation node (GELU, SiLU, ...),
    e.g. ``("aten.gelu", (), (("approximate", "tanh"),))``: hashable, the key of its measured rate
    (`costmodels.calibrate.activation_time_ratios`; its time grows with its elements, whatever their
    shape) and enough to run the same op on real tensors."""

    def frozen(a: object) -> object:
        return tuple(frozen(x) for x in a) if isinstance(a, (list, tuple)) else a

    args = tuple(frozen(a) for a in node.args[1:] if not isinstance(a, fx.Node))
    return (op_name(node.target), args, tuple(sorted((k, frozen(v)) for k, v in node.kwargs.items())))


def conv_call_at_batch(call: tuple, batch: int) -> tuple:
    """`conv_call`'s ``call`` with its input's leading (batch) dimension set to ``batch`` (a rank's
    share of the captured batch)."""
    name, args, input_grad = call
    kind, shape, dtype = args[0]
    return (name, ((kind, (batch, *shape[1:]), dtype), *args[1:]), input_grad)


def _conv_flops(node: fx.Node, out_numel: int) -> float:
    """2 * output elements * (input channels / groups) * kernel elements, + output elements for a bias.

    ``aten.convN(x, w, bias, stride, padding, dilation, groups)`` and ``aten.convolution(x, w, bias,
    stride, padding, dilation, transposed, output_padding, groups)``: the weight is (C_out, C_in /
    groups, *kernel) (transposed: (C_in, C_out / groups, *kernel)), so each output element takes
    w.numel() / C_out multiply-adds either way, with the transposed case counted per input element.
    """
    w = node.args[1].meta["val"]
    bias = len(node.args) > 2 and node.args[2] is not None
    transposed = "transpose" in op_name(node.target) or (
        op_name(node.target) in ("aten.convolution", "aten._convolution")
        and len(node.args) > 6
        and node.args[6]
    )
    if transposed:  # each input element scatters into C_out / groups * kernel outputs
        x = node.args[0].meta["val"]
        return conv_flops(x.numel(), w.numel() / w.shape[0], 1, False) + (out_numel if bias else 0)
    return conv_flops(out_numel, w.shape[1], prod(w.shape[2:]), bias)


def _sdpa_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """QK^T and PV over the full T x S matrix: 2*B*H*T*S*(hd_qk + hd_v) = 4*B*H*T*S*hd."""
    batch_heads = prod(q.shape[:-2])
    t, s = q.shape[-2], v.shape[-2]  # k may be given transposed (manual Q @ K^T): take S from v
    return 2.0 * batch_heads * t * s * (q.shape[-1] + v.shape[-1])


# ------------------------------------------------------------------------------------- projections


def _projection(node: fx.Node, params: dict[str, torch.nn.Parameter]) -> Projection | None:
    name = op_name(node.target)
    if node.op != "call_function" or name not in _MATMULS:
        return None
    if name == "aten.linear":
        x, w, b = node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else None
        out_dim = 0
    else:
        b = node.args[0] if name == "aten.addmm" else None
        x, w = node.args[-2], node.args[-1]
        out_dim = 1
        if isinstance(w, fx.Node) and is_transpose_2d(w):  # x @ W.T with W (out, in): nn.Linear layout
            w, out_dim = w.args[0], 0
    w = uncast(w)  # `F.linear(x.float(), self.weight.float())`: DeepSeek-V3's router in bf16
    if not (
        isinstance(w, fx.Node) and w.op == "get_attr" and w.target in params and w.meta["val"].dim() == 2
    ):
        return None
    shape = w.meta["val"].shape
    out_features, in_features = shape[out_dim], shape[1 - out_dim]
    bias = b.target if isinstance(b, fx.Node) and b.op == "get_attr" else None
    tokens = x.meta["val"].numel() // in_features
    flops = 2.0 * tokens * in_features * out_features + (tokens * out_features if bias else 0)
    source = x
    while isinstance(source, fx.Node) and source.op == "call_function" and op_name(source.target) in _VIEWS:
        source = source.args[0]
    return Projection(
        node.name, w.target, bias, None, in_features, out_features, out_dim, _parts(node), flops,
        input=source.name if isinstance(source, fx.Node) else None,
    )  # fmt: skip


# ops whose output is a view of their first argument's storage (a projection reading one reads it)
_VIEWS = {"aten.view", "aten.reshape", "aten._unsafe_view", "aten.alias", "aten.expand", "aten.unsqueeze"}


# Ops a LoRA adapter's path may pass through without changing what it computes beyond a scale: its
# input dropout, its scaling, dtype casts (PEFT's LoraLayer: result + lora_B(lora_A(dropout(x))) * scaling)
# and reshapes (Hugging Face's Conv1D runs addmm on the input viewed as (B*T, in), then views it back)
_ADAPTER_PASS = {"aten.dropout", "aten.clone", "aten._to_copy", "aten.to", "aten.type_as", "aten.alias",
                 "aten.mul", "aten.div", "aten.view", "aten.reshape", "aten._unsafe_view"}  # fmt: skip


def _through(node: fx.Node) -> fx.Node:
    """``node`` followed back through `_ADAPTER_PASS` ops to the value they pass on (their first
    argument)."""
    while (
        node.op == "call_function"
        and op_name(node.target) in _ADAPTER_PASS
        and isinstance(node.args[0], fx.Node)
    ):
        node = node.args[0]
    return node


def _matmul_input(node: fx.Node) -> fx.Node:
    """The activation operand of a projection's matmul node (`_projection`'s x)."""
    x = node.args[0] if op_name(node.target) == "aten.linear" else node.args[-2]
    return x if isinstance(x, fx.Node) else node


def _attach_adapters(projections: list[Projection], nodes: list[fx.Node]) -> list[Projection]:
    """Find LoRA adapters (`planner.frontend.roles.Adapter`) and attach each to its projection:
    bias-free down (in -> r) and up (r -> out) projections, r at most half of in and out, down reading
    the projection's input and up reading down's output (through dropout, scaling and casts), and up's
    output added to the projection's output. Returns the projections less the adapters' own, so that
    the layers are analysed as the model without them."""
    by_node = {p.node: p for p in projections}
    node_of = {n.name: n for n in nodes}
    base_of_input: dict[str, list[Projection]] = {}
    for p in projections:
        base_of_input.setdefault(_through(_matmul_input(node_of[p.node])).name, []).append(p)
    adapters: set[str] = set()
    for up in projections:
        up_node = node_of[up.node]
        down = by_node.get(_through(_matmul_input(up_node)).name)
        if (
            down is None
            or up.bias is not None
            or down.bias is not None
            or down.out_features != up.in_features
        ):
            continue
        rank = down.out_features
        if 2 * rank > min(down.in_features, up.out_features) or down.node in adapters or up.node in adapters:
            continue
        # up's output through its scaling to the add that joins it to the projection's
        add, path = up_node, []
        while len(add.users) == 1 and op_name(next(iter(add.users)).target) in _ADAPTER_PASS:
            add = next(iter(add.users))
            path.append(add.name)
        if len(add.users) != 1 or op_name(next(iter(add.users)).target) not in ("aten.add", "aten.add_"):
            continue
        joined = next(iter(add.users))
        others = [a for a in joined.args[:2] if isinstance(a, fx.Node) and a is not add]
        bases = [by_node.get(_through(o).name) for o in others]
        base = bases[0] if len(bases) == 1 else None
        siblings = base_of_input.get(_through(_matmul_input(node_of[down.node])).name, [])
        if base is None or base not in siblings or base.adapter is not None or base in (down, up):
            continue
        if base.in_features != down.in_features or base.out_features != up.out_features:
            continue
        before = node_of[down.node].args[0]  # the input's dropout, when only the adapter reads it
        while isinstance(before, fx.Node) and before is not _through(before) and len(before.users) == 1:
            path.append(before.name)
            before = before.args[0]
        mid = _matmul_input(up_node)  # down's output to up's input (a scaling, a cast)
        while isinstance(mid, fx.Node) and mid.name != down.node and mid.op == "call_function":
            path.append(mid.name)
            mid = mid.args[0]
        base.adapter = Adapter(down, up, (*path, joined.name))
        base.parts = base.parts or _parts(joined)  # a fused projection's split, after the adapter joins
        adapters.update((down.node, up.node))
    return [p for p in projections if p.node not in adapters]


def _parts(node: fx.Node) -> tuple[int, ...] | None:
    """Sizes of the parts of a fused projection's output, None when it is not split into parts.

    Found through views (and unsqueezes) that keep the last dim: a split / chunk on the last dim (GPT-2
    `c_attn`, GPT-BigCode's after an unsqueeze),
    slices that tile the last dim (Phi-3 `qkv_proj`), a view to (..., 3, H, hd) (q, k, v blocks), or a
    view to (..., 3, C) then taken apart along the 3.
    A per-head interleaved (..., H, 3 * hd) layout (GPT-NeoX) is not a part split: a contiguous
    split keeps whole heads, so it gives None.
    """
    out_features = node.meta["val"].shape[-1]
    while True:
        users = list(node.users)
        slices = _tiling_slices(users, out_features)
        if slices is not None:
            return slices
        if len(users) != 1:
            return None
        (user,) = users
        name = op_name(user.target)
        val = user.meta.get("val")
        if name in _SPLITS:
            dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
            if dim % val[0].dim() != val[0].dim() - 1:
                return None
            return tuple(v.shape[-1] for v in val)
        if name not in ("aten.view", "aten.reshape", "aten._unsafe_view", "aten.unflatten", "aten.unsqueeze"):
            return None
        if name == "aten.unsqueeze":  # GPT-BigCode: c_attn(x).unsqueeze(1).split((embed, kv, kv), dim=3)
            if val.shape[-1] != out_features:
                return None
            node = user
            continue
        if (
            val.dim() >= 3
            and val.shape[-3] == 3
            and val.shape[-3] * val.shape[-2] * val.shape[-1] == out_features
        ):
            return (out_features // 3,) * 3
        if val.dim() >= 2 and val.shape[-2] == 3 and 3 * val.shape[-1] == out_features and _picks_parts(user):
            return (out_features // 3,) * 3  # (..., 3, C) taken apart into q, k, v
        heads = _head_split(user, out_features)
        if heads is not None:
            return heads
        if val.shape[-1] != out_features:
            return None
        node = user


def _head_split(view: fx.Node, out_features: int) -> tuple[int, ...] | None:
    """The parts of a fused projection viewed as (..., G, hd) and split along its G heads into q, k and v
    heads, (H, 1, 1) for Falcon-7B's multi-query `query_key_value` (`fused_qkv.split([num_heads, 1, 1],
    dim=-2)`): each part's width, heads x hd; None for any other view."""
    val = view.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 3 or val.shape[-2] * val.shape[-1] != out_features:
        return None
    if len(view.users) != 1:
        return None
    (user,) = view.users
    if op_name(user.target) not in _SPLITS:
        return None
    dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
    outs = user.meta.get("val")
    if not isinstance(dim, int) or dim % val.dim() != val.dim() - 2 or not isinstance(outs, (list, tuple)):
        return None
    return tuple(int(o.shape[-2]) * int(val.shape[-1]) for o in outs)


# layout ops `_picks_parts` follows a dim through
_MOVES_DIMS = frozenset(
    {"aten.contiguous", "aten.clone", "aten.unsqueeze", "aten.squeeze", "aten.transpose", "aten.permute"}
)


def _picks_parts(view: fx.Node) -> bool:
    """The (..., 3, C) `view` is taken apart along that dim of 3: an unbind, or a select of each index
    (and not, say, a model of 3 heads whose (B, T, H, hd) goes to attention whole), perhaps after
    layout ops that move that dim (nn.MultiheadAttention: unsqueeze(0), transpose(0, -2), squeeze(-2),
    contiguous, then select(0, i))."""
    dim = view.meta["val"].dim() - 2
    while len(view.users) == 1:  # follow the dim of 3 through single-user layout ops
        (user,) = view.users
        name = op_name(user.target)
        if name not in _MOVES_DIMS:
            break
        ndim = user.meta["val"].dim()
        if name in ("aten.contiguous", "aten.clone"):
            pass
        elif name == "aten.unsqueeze":
            dim += user.args[1] % ndim <= dim
        elif name == "aten.squeeze" and len(user.args) > 1 and isinstance(user.args[1], int):
            gone = user.args[1] % view.meta["val"].dim()
            if gone == dim:
                return False
            dim -= gone < dim
        elif name == "aten.transpose":
            a, b = (d % ndim for d in user.args[1:3])
            dim = b if dim == a else a if dim == b else dim
        elif name == "aten.permute":
            dim = [d % ndim for d in user.args[1]].index(dim)
        else:  # a squeeze of all its size-1 dims
            break
        view = user
    users = list(view.users)

    def on_dim(u: fx.Node) -> bool:
        return len(u.args) > 1 and u.args[1] % view.meta["val"].dim() == dim

    if len(users) == 1 and op_name(users[0].target) == "aten.unbind":
        return on_dim(users[0])
    selects = [u for u in users if op_name(u.target) == "aten.select" and on_dim(u)]
    return len(selects) == len(users) == 3 and sorted(u.args[2] % 3 for u in selects) == [0, 1, 2]


def _tiling_slices(users: list[fx.Node], size: int) -> tuple[int, ...] | None:
    """Part sizes if `users` are >= 2 step-1 slices on the last dim that tile [0, size) exactly."""
    if len(users) < 2 or any(op_name(u.target) != "aten.slice" for u in users):
        return None
    spans = []
    for u in users:
        ndim = u.args[0].meta["val"].dim()
        dim, start, end, step = (list(u.args[1:]) + [0, None, None, 1][len(u.args) - 1 :])[:4]
        if dim % ndim != ndim - 1 or step != 1:
            return None
        spans.append((start or 0, size if end is None else min(end, size)))
    spans.sort()
    if spans[0][0] != 0 or spans[-1][1] != size or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        return None
    return tuple(end - start for start, end in spans)


# ------------------------------------------------------------------------------------------ layers


def _dataflow(graph: fx.Graph) -> nx.DiGraph:
    """Node names, with an edge from each input to its user."""
    g = nx.DiGraph()
    for node in graph.nodes:
        g.add_node(node.name)
        g.add_edges_from((a.name, node.name) for a in node.all_input_nodes)
    return g


def _find_layers(nodes: list[fx.Node], projections: dict[str, Projection]) -> list[tuple[str, list[fx.Node]]]:
    """[(module_path, nodes)] of the repeated layers, in index order; [] when there are none.

    A stack is a module prefix whose children are numbered 0..n-1, each holding at least two
    projections. The stack with the most projections is taken, then every other one that is neither
    inside nor around a taken one (an MoE layer's experts are inside its layer) and does not
    interleave with the taken ones in graph order: an encoder-decoder's two stacks, in graph order."""
    position = {n.name: i for i, n in enumerate(nodes)}
    groups: dict[str, dict[int, list[fx.Node]]] = {}
    for node in nodes:
        parts = node.meta.get("module_path", "").split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                groups.setdefault(".".join(parts[:i]), {}).setdefault(int(part), []).append(node)
    stacks: list[tuple[int, int, str]] = []  # (-projections, depth, prefix): the most projections first
    for prefix, children in groups.items():
        counts = [sum(n.name in projections for n in children[i]) for i in sorted(children)]
        if sorted(children) != list(range(len(children))) or min(counts) < 2:
            continue
        stacks.append((-sum(counts), prefix.count(".") + bool(prefix), prefix))

    def inside(inner: str, outer: str) -> bool:
        return outer == "" or inner.startswith(f"{outer}.")

    def span(prefix: str) -> tuple[int, int]:  # of its ops (weights' get_attr nodes head the graph)
        found = [
            position[n.name] for child in groups[prefix].values() for n in child if n.op == "call_function"
        ]
        return (min(found), max(found)) if found else (0, len(nodes))

    taken: list[str] = []
    for _, _, prefix in sorted(stacks):
        if any(inside(prefix, t) or inside(t, prefix) for t in taken):
            continue
        start, end = span(prefix)
        if any(start <= span(t)[1] and span(t)[0] <= end for t in taken):
            continue  # interleaved with a taken stack: not one after the other
        taken.append(prefix)
    taken.sort(key=lambda prefix: span(prefix)[0])
    return [
        (f"{prefix}.{i}" if prefix else str(i), groups[prefix][i])
        for prefix in taken
        for i in sorted(groups[prefix])
    ]


def _layer(
    index: int,
    path: str,
    members: list[fx.Node],
    projections: dict[str, Projection],
    costs: dict[str, NodeCost],
    params: dict[str, torch.nn.Parameter],
) -> Layer:
    """One layer: its attention and MLP blocks, cut points, side inputs and totals."""
    member_names = {n.name for n in members}
    projs = [projections[n.name] for n in members if n.name in projections]
    attention, cross, attention_projs = _attention(members, member_names, projections)
    node_of = {n.name: n for n in members}
    routers = [
        p for p in projs if p not in attention_projs and _routes(node_of[p.node], member_names, projections)
    ]
    unrecognised = ""
    if not routers:  # a router that picks experts without a top-k (PhiMoE's sparsemixer)
        hidden = unrecognised_router(
            path, members, projections, [p for p in projs if p not in attention_projs], params
        )
        if hidden is not None:
            routers, unrecognised = [hidden[0]], hidden[1]
            warnings.warn(unrecognised, stacklevel=2)
    for p in routers:
        p.role = Role.ROUTER
    found = find_moe(path, members, projections, routers, params)
    if found.warning:
        warnings.warn(found.warning, stacklevel=2)
        unrecognised = found.warning
    experts = {p.node for p in found.expert_projections}
    mlp_projs = [p for p in projs if p not in attention_projs and p not in routers and p.node not in experts]
    gates = _token_gates(mlp_projs, node_of, member_names, projections)
    latents = _latents(mlp_projs, attention_projs, node_of, member_names, projections)
    mlp_projs = [p for p in mlp_projs if p not in gates and p not in latents]
    mlp = _mlp(mlp_projs, members, member_names, projections) if mlp_projs else None
    moe = found.moe
    if moe is not None:
        moe.shared = (list(mlp.projections) if mlp is not None else []) + gates
        _price_expert_gemms(moe, costs)
    used_outside = [
        n for n in members if n.op != "get_attr" and any(u.name not in member_names for u in n.users)
    ]
    assert used_outside, f"layer {path} has no output"
    output = used_outside[-1]
    external = []
    for n in members:
        for a in n.all_input_nodes:
            if a.name not in member_names and a not in external:
                external.append(a)
    stream = _stream_input(attention, mlp, members, member_names, external, output, projections)
    weights = {n.target for n in members if n.op == "get_attr" and n.target in params}
    blocks = _node_blocks(members, member_names, projections, attention, mlp, cross)
    blocks.update(
        {p.node: "stream" for p in routers + gates + latents}
    )  # replicated, priced with the stream's ops
    # LoRA adapters' GEMMs: priced with their projection's options (`Projection.adapter`)
    blocks.update({n: "adapter" for p in projs if p.adapter is not None for n in p.adapter.nodes})
    if moe is not None:  # replicated under TP; priced apart (`planner.solver.costing.expert_gemm_time_s`)
        blocks.update({n: "experts" for n in moe.expert_nodes})
    return Layer(
        index=index,
        module_path=path,
        attention=attention,
        mlp=mlp,
        routers=routers,
        token_gates=gates,
        latents=latents,
        experts_unrecognised=unrecognised,
        moe=moe,
        nodes=[n.name for n in members],
        input_node=stream.name,
        output_node=output.name,
        param_bytes=sum(params[w].numel() * params[w].element_size() for w in weights),
        num_params=sum(params[w].numel() for w in weights),
        frozen_params=sum(params[w].numel() for w in weights if not params[w].requires_grad),
        flops=sum(costs[n.name].flops for n in members),
        bytes_moved=sum(costs[n.name].bytes_read + costs[n.name].bytes_written for n in members),
        side_inputs=[a.name for a in external if a is not stream],
        node_blocks=blocks,
        cross_attention=cross,
        norm_upcasts=_norm_upcasts(members, stream),
    )


def _price_expert_gemms(moe: MoE, costs: dict[str, NodeCost]) -> None:
    """Each expert GEMM's `NodeCost` as a matmul of the rows it runs: 2 x its output elements x one
    expert's in_features (an einsum or transformers' grouped_mm fallback is otherwise an unknown op)."""
    for weight in moe.experts:
        for name in weight.nodes:
            cost = costs[name]
            elements = prod(cost.shape) if cost.shape else 0
            costs[name] = replace(cost, flops=2.0 * elements * weight.in_features, kind="matmul", known=True)


def _node_blocks(
    members: list[fx.Node],
    member_names: set[str],
    projections: dict[str, Projection],
    attention: Attention | None,
    mlp: Mlp | None,
    cross: Attention | None = None,
) -> dict[str, str]:
    """``Layer.node_blocks``: each member's block, from the layer projections it derives from."""
    attn_in = {p.node for p in attention.projections if p.role is not Role.O} if attention else set()
    attn_out = {p.node for p in attention.projections if p.role is Role.O} if attention else set()
    cross_in = {p.node for p in cross.projections if p.role is not Role.O} if cross else set()
    cross_out = {p.node for p in cross.projections if p.role is Role.O} if cross else set()
    mlp_out = {p.node for p in mlp.projections if p.role is Role.DOWN} if mlp else set()
    mlp_in = {p.node for p in mlp.projections} - mlp_out if mlp else set()
    ancestors: dict[str, set[str]] = {}  # projections of this layer each member derives from
    blocks: dict[str, str] = {}
    for n in members:
        anc: set[str] = set()
        for a in n.all_input_nodes:
            if a.name in member_names:
                anc |= ancestors.get(a.name, set()) | ({a.name} if a.name in projections else set())
        ancestors[n.name] = anc
        in_cross = bool(anc & cross_in) and not anc & cross_out
        if n.name in projections:
            blocks[n.name] = "projection"
        elif op_name(n.target) in _MATMULS | {"aten.bmm", "aten.scaled_dot_product_attention"}:
            blocks[n.name] = "cross_core" if in_cross else "core"
        elif anc & attn_in and not anc & attn_out:
            blocks[n.name] = "attention"
        elif in_cross:
            blocks[n.name] = "cross"
        elif anc & mlp_in and not anc & mlp_out:
            blocks[n.name] = "mlp"
        else:
            blocks[n.name] = "stream"
    return blocks


_UPCASTS = frozenset({"aten.to", "aten._to_copy", "aten.type_as"})
# (not a multiply: RoPE's fp32 rotation of q / k multiplies a copy as large as the stream)
_NORM_STATISTICS = frozenset({"aten.pow", "aten.mean", "aten.var", "aten.var_mean", "aten.square"})


def _norm_upcasts(members: list[fx.Node], stream: fx.Node) -> int:
    """Nodes of a layer that copy a 16-bit floating value of the stream's size to fp32 for a norm's
    statistics (a user squares it or takes its mean or variance): RMSNorm written as HF's Llama and
    Meta's reference code write it. Autograd keeps that copy for the norm's backward (4 bytes an
    element) where a norm on its input keeps the 16-bit input."""
    size = stream.meta.get("val")
    if not isinstance(size, torch.Tensor):
        return 0
    found = 0
    for n in members:
        if n.op != "call_function" or op_name(n.target) not in _UPCASTS or not n.args:
            continue
        out, src = n.meta.get("val"), getattr(n.args[0], "meta", {}).get("val")
        if not isinstance(out, torch.Tensor) or not isinstance(src, torch.Tensor):
            continue
        if out.dtype != torch.float32 or not src.is_floating_point() or src.element_size() != 2:
            continue
        if out.numel() == size.numel() and any(op_name(u.target) in _NORM_STATISTICS for u in n.users):
            found += 1
    return found


def _stream_input(
    attention: Attention | None,
    mlp: Mlp | None,
    members: list[fx.Node],
    member_names: set[str],
    external: list[fx.Node],
    output: fx.Node,
    projections: dict[str, Projection],
) -> fx.Node:
    """The stream operand of the first residual add, walked back to the last node outside the layer."""
    node = None
    block = attention if attention and attention.residual_add else mlp if mlp and mlp.residual_add else None
    if block is not None:
        proj = next(p for p in reversed(block.projections) if p.role in (Role.O, Role.DOWN))
        source = next(n for n in members if n.name == proj.node)
        node = _residual_add(source, member_names, projections)[1]
        while node.name in member_names and len(node.all_input_nodes) >= 1:
            node = node.all_input_nodes[0]
        if node.name in member_names:
            node = None
    if node is None:  # no residual found: the external input shaped like the output
        shape = output.meta["val"].shape
        candidates = [
            a for a in external if a.op != "get_attr" and getattr(a.meta.get("val"), "shape", None) == shape
        ]
        node = (candidates or [a for a in external if a.op != "get_attr"] or external)[0]
    return node


def _mark_cross_inputs(layers: list[Layer], graph: nx.DiGraph) -> None:
    """Side inputs that depend on the stream (a cross-layer value): the cut is not clean there."""
    if not layers:
        return
    downstream = nx.descendants(graph, layers[0].input_node) | {layers[0].input_node}
    for layer in layers:
        layer.cross_inputs = [s for s in layer.side_inputs if s in downstream]


def _mark_input_grads(
    layers: list[Layer], nodes: list[fx.Node], params: dict[str, torch.nn.Parameter]
) -> None:
    """`Layer.input_requires_grad`: whether any value entering the layer (stream or side input) depends
    on a trainable parameter, following requires_grad forward through the graph as autograd does (a
    model's inputs do not require a gradient). Non-differentiable ops (comparisons, argmax) are not
    told apart: a gradient counted where none flows only over-prices the backward."""
    grads: set[str] = set()
    for n in nodes:
        if n.op == "get_attr":
            p = params.get(str(n.target))
            if p is not None and p.requires_grad:
                grads.add(n.name)
        elif n.op != "placeholder" and any(a.name in grads for a in n.all_input_nodes):
            grads.add(n.name)
    for layer in layers:
        layer.input_requires_grad = any(name in grads for name in (layer.input_node, *layer.side_inputs))


# --------------------------------------------------------------------------------------- attention


def _walk(
    start: fx.Node,
    member_names: set[str],
    projections: dict,
    forward: bool,
    stop: Callable[[fx.Node], bool] | None = None,
) -> list[fx.Node]:
    """Projections reached from `start` (exclusive) without crossing a projection, leaving the layer
    or passing a node `stop` is true of."""
    found, seen, queue = [], {start.name}, deque([start])
    while queue:
        node = queue.popleft()
        nexts = list(node.users) if forward else node.all_input_nodes
        for n in nexts:
            if n.name in seen or n.name not in member_names:
                continue
            seen.add(n.name)
            if n.name in projections:
                found.append(n)
            elif stop is None or not stop(n):
                queue.append(n)
    return found


def _walk_to_output(core: fx.Node, member_names: set[str], projections: dict) -> list[fx.Node]:
    """Projections reached forward from an attention core (its output projection first) without
    crossing a projection, leaving the layer or passing the residual add: an add whose other operand
    has the add's own shape and does not derive from the core (the stream). A core whose output
    projection is not a matmul of a 2-D weight (a JAX port's `einsum("bthk,hkd->btd", o, W)`) has none,
    and the MLP's first projection after the residual add is not taken for it."""
    after, queue = {core.name}, deque([core])
    while queue:  # everything the core's output reaches in the layer
        for user in queue.popleft().users:
            if user.name in member_names and user.name not in after:
                after.add(user.name)
                queue.append(user)

    def joins_stream(node: fx.Node) -> bool:
        if node.target not in (aten.add.Tensor, aten.add_.Tensor) or len(node.all_input_nodes) != 2:
            return False
        val = node.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        return any(
            a.name not in after
            and a.op != "get_attr"
            and isinstance(a.meta.get("val"), torch.Tensor)
            and tuple(a.meta["val"].shape) == shape
            for a in node.all_input_nodes
        )

    return _walk(core, member_names, projections, forward=True, stop=joins_stream)


def _cores(members: list[fx.Node]) -> list[tuple[fx.Node, fx.Node, fx.Node, fx.Node]]:
    """(core output, q, k, v) for SDPA nodes and manual softmax(Q K^T) V patterns."""
    cores = []
    for n in members:
        name = op_name(n.target)
        if name == "aten.scaled_dot_product_attention":
            cores.append((n, n.args[0], n.args[1], n.args[2]))
        elif name in ("aten.softmax", "aten._softmax"):
            scores = _back_to(n.args[0], _PRODUCTS | {"aten.baddbmm"})
            pv = _forward_to(n, _PRODUCTS)
            if scores is not None and pv is not None:
                q, k = _operands(scores)
                cores.append((pv, q, k, _operands(pv)[1]))
    return cores


def _einsum_sizes(node: fx.Node) -> dict[str, int]:
    """Each letter of an einsum's equation and its size, read from the operands' shapes."""
    inputs = str(node.args[0]).replace(" ", "").split("->")[0].split(",")  # (an ellipsis: expanded below)
    sizes: dict[str, int] = {}
    for letters, operand in zip(inputs, node.args[1]):
        shape = operand.meta["val"].shape
        if "..." in letters:  # leading dims under an ellipsis: one letter per dim
            head, tail = letters.split("...")
            letters = (
                head + "".join(chr(0x2460 + i) for i in range(len(shape) - len(head) - len(tail))) + tail
            )
        sizes.update(zip(letters, shape))
    return sizes


def _operands(product: fx.Node) -> tuple[fx.Node, fx.Node]:
    """The two tensor operands of a product node: matmul / bmm (a, b), baddbmm(bias, a, b) (Bloom's
    ALiBi scores), einsum(equation, [a, b]) (`torch.einsum("bhqd,bhkd->bhqk", q, k)`)."""
    name = op_name(product.target)
    if name == "aten.einsum":
        a, b = product.args[1]
        return a, b
    a, b = product.args[-2:] if name == "aten.baddbmm" else product.args[:2]
    return a, b


# the products an attention core's scores (Q K^T) and output (P V) are written with
_PRODUCTS = frozenset({"aten.matmul", "aten.bmm", "aten.einsum"})


def _is_product(node: fx.Node, targets: set[str] | frozenset[str]) -> bool:
    """`node` is one of `targets`; an einsum only as a product of two tensors of 3 dims or more (not
    talking heads' mix of the logits by an (H, H) matrix, `einsum("bhts,hg->bgts", s, mix)`)."""
    name = op_name(node.target)
    if name != "aten.einsum":
        return name in targets
    operands = node.args[1] if len(node.args) > 1 else ()
    return (
        name in targets
        and len(operands) == 2
        and all(isinstance(o, fx.Node) and getattr(o.meta.get("val"), "ndim", 0) >= 3 for o in operands)
    )


def _back_to(node: fx.Node, targets: set[str] | frozenset[str], limit: int = 6) -> fx.Node | None:
    for _ in range(limit):
        if _is_product(node, targets):
            return node
        if not node.all_input_nodes:
            return None
        node = node.all_input_nodes[0]
    return None


def _forward_to(node: fx.Node, targets: set[str] | frozenset[str], limit: int = 4) -> fx.Node | None:
    """The one op of `targets` that `node` reaches within `limit` ops forward (through every user:
    attention probabilities also returned as an output, HF's output_attentions=True, still reach PV),
    None when none or several do."""
    frontier, found = [node], []
    for _ in range(limit):
        frontier = [u for n in frontier for u in n.users]
        found += [u for u in frontier if _is_product(u, targets)]
        frontier = [u for u in frontier if not _is_product(u, targets)]
    return found[0] if len(set(found)) == 1 else None


def _attention(
    members: list[fx.Node], member_names: set[str], projections: dict[str, Projection]
) -> tuple[Attention | None, Attention | None, list[Projection]]:
    """The layer's attention block, its cross-attention block (a second core: a decoder's, whose
    k / v read the encoder's output; None without one), roles set on their projections, and those
    projections. A third core is not modelled (its projections fall to the MLP)."""
    cores = _cores(members)
    if not cores:
        return None, None, []
    attention = _attention_block(*cores[0], members, member_names, projections)
    cross = None
    if len(cores) > 1:
        taken = {p.node for p in attention.projections}
        cross = _attention_block(*cores[1], members, member_names, projections, taken)
        if not cross.projections:
            cross = None
    projs = attention.projections + (cross.projections if cross else [])
    return attention, cross, projs


def _attention_block(
    core: fx.Node,
    q: fx.Node,
    k: fx.Node,
    v: fx.Node,
    members: list[fx.Node],
    member_names: set[str],
    projections: dict[str, Projection],
    taken: set[str] = frozenset(),
) -> Attention:
    """One attention block from its core (SDPA or the manual PV matmul) and the core's q / k / v
    inputs; projections in `taken` (another block's) are not claimed."""
    sources = [_walk_inclusive(x, member_names, projections) for x in (q, k, v)]
    first = [s[0] if s and s[0].name not in taken else None for s in sources]
    projs: list[Projection] = []
    if first[0] is not None and first[0] is first[1] is first[2]:
        fused = projections[first[0].name]
        fused.role = Role.QKV
        projs.append(fused)
    else:
        for node, role in zip(first, (Role.Q, Role.K, Role.V)):
            if node is not None and projections[node.name] not in projs:
                projections[node.name].role = role
                projs.append(projections[node.name])
        # a fused K / V projection (`to_kv` chunked in two, or viewed as (..., 2, KVH, hd)): one projection,
        # listed once (it was twice: its GEMM priced twice), taking the value role
        if first[1] is not None and first[1] is first[2]:
            projections[first[1].name].role = Role.V
    o_nodes = [n for n in _walk_to_output(core, member_names, projections) if n.name not in taken]
    residual = None
    if o_nodes:
        o = projections[o_nodes[0].name]
        o.role = Role.O
        projs.append(o)
        found = _residual_add(o_nodes[0], member_names, projections)
        residual = found[0].name if found else None
    q_shape = _head_shape(q)  # (B, H, T, hd)
    num_heads, head_dim = q_shape[-3], q_shape[-1]
    k_proj = next((p for p in projs if p.role is Role.K), None)
    fused_kv = projections[first[1].name] if first[1] is not None and first[1] is first[2] else None
    if k_proj is not None:
        num_kv_heads = k_proj.out_features // head_dim
    elif fused_kv is not None and fused_kv.role is Role.V and _halves_of_heads(fused_kv, head_dim):
        # K and V halves (the core's k may be repeated to the query heads: GQA written out)
        num_kv_heads = (fused_kv.parts[0] if fused_kv.parts else fused_kv.out_features // 2) // head_dim
    elif projs and projs[0].role is Role.QKV and projs[0].parts and len(projs[0].parts) == 3:
        num_kv_heads = projs[0].parts[1] // head_dim
    else:
        num_kv_heads = _kv_heads_before_repeat(k, num_heads, head_dim)
    flops = _sdpa_flops(q.meta["val"], k.meta["val"], v.meta["val"])
    k_letters = _einsum_head_shape(k)
    if k_letters is not None and _einsum_head_shape(q) is not None:  # letters in any order: q_shape's
        batch, heads, t, hd = q_shape
        flops = 4.0 * batch * heads * t * k_letters[2] * hd
    attention = Attention(projs, num_heads, num_kv_heads, head_dim, core.name, residual, flops)
    attention.core_kv_heads = int(_head_shape(k)[-3]) if k.meta["val"].dim() >= 3 else None
    attention.core_line = user_line(core)
    if op_name(core.target) == "aten.scaled_dot_product_attention":
        attention.dropout_p = float(bound_arguments(core).get("dropout_p") or 0.0)
    buffers = cache_buffers(members)
    if buffers:
        # from V, (..., L, hd) in SDPA and in p @ v alike: a hand-written core's k operand may be
        # K transposed, (..., hd, L) (Bloom's cache keeps its keys that way)
        attention.kv_len = int(v.meta["val"].shape[-2])
        attention.cache_bytes = float(
            sum(b.meta["val"].numel() * b.meta["val"].element_size() for b in buffers)
        )
    return attention


# ops through which a core's k / v keep their (B, heads, T, hd) meaning while their head count may
# grow to the query heads (GQA written out: expand, repeat_interleave, gpt-fast's unsqueeze-expand-reshape)
_HEAD_REPEATS = frozenset({
    "aten.expand", "aten.repeat_interleave", "aten.repeat", "aten.clone", "aten.contiguous", "aten.view",
    "aten.reshape", "aten._unsafe_view", "aten.unsqueeze", "aten.select", "aten.slice",
})  # fmt: skip


def _halves_of_heads(fused_kv: Projection, head_dim: int) -> bool:
    """Whether a fused K / V projection's width is two halves of whole heads of the queries' head dim
    (`to_kv` chunked in two). DeepSeek's `kv_b_proj` is not: each head's no-RoPE key and value side by
    side, widths of their own (d_nope + d_v per head, the queries' d_nope + d_rope): its KV heads are the
    core's K heads."""
    # read from the parts the analysis found (a chunk or split of the output in two): a width that merely
    # divides evenly (DeepSeek-V2's 4 x (8 + 16) = 96 = 2 x 3 heads of 16) is not a K / V pair of halves
    parts = fused_kv.parts
    return bool(parts) and len(parts) == 2 and parts[0] == parts[1] and parts[0] % head_dim == 0


def _kv_heads_before_repeat(k: fx.Node, num_heads: int, head_dim: int, limit: int = 6) -> int:
    """The KV heads of a core's key `k` whose projection was not found (it comes from a KV cache):
    the head count before it was repeated to the query heads (a (B, KVH, S, hd) cache expanded to
    (B, H, S, hd)), else `k`'s own. Reading `k`'s own gave H for a GQA cache of KVH heads, and the
    cache-length check then read the cache as H / KVH times too short."""
    own = int(_head_shape(k)[-3])
    node = k
    for _ in range(limit):
        if (
            op_name(node.target) not in _HEAD_REPEATS
            or not node.args
            or not isinstance(node.args[0], fx.Node)
        ):
            break
        node = node.args[0]
        shape = tuple(node.meta["val"].shape) if isinstance(node.meta.get("val"), torch.Tensor) else ()
        if len(shape) == 4 and shape[-1] == head_dim and 0 < shape[-3] < own and num_heads % shape[-3] == 0:
            return int(shape[-3])
        if len(shape) == 5 and shape[-1] == head_dim and 0 < shape[1] < own and num_heads % shape[1] == 0:
            return int(shape[1])  # (B, KVH, rep, T, hd) before the reshape to (B, H, T, hd)
    return own


def _head_shape(x: fx.Node) -> tuple[int, ...]:
    """The (B, H, T, hd) shape of a core operand; one whose batch and heads are merged, (B*H, T, hd)
    as Bloom's bmm / baddbmm take it (a reshape of (B, H, T, hd), perhaps then transposed), gives the
    shape before the merge."""
    shape = tuple(x.meta["val"].shape)
    by_letters = _einsum_head_shape(x)
    if by_letters is not None:
        return by_letters
    node = x
    if op_name(node.target) == "aten.transpose" and len(shape) == 3:
        node = node.args[0]
    if len(shape) == 3 and op_name(node.target) in ("aten.view", "aten.reshape", "aten._unsafe_view"):
        before = tuple(node.args[0].meta["val"].shape)
        if len(before) == 4 and before[0] * before[1] == shape[0]:
            if _head_major(node.args[0]):  # (H, B, T, hd) merged: the heads are the outer factor
                before = (before[1], before[0], *before[2:])
            return before[:2] + shape[1:] if node is x else before
    return shape


def _head_major(x: fx.Node, limit: int = 4) -> bool:
    """Whether a 4-D core operand about to be merged to (a*b, T, hd) holds its heads first, (H, B, T, hd):
    a permute of the projection's (B, T, H, hd) view that puts its heads (dim 2) before its batch (dim 0),
    through copies (clone, contiguous). Megatron-LM's core attention merges (B*H) (the batch first), as
    Bloom's does; a port that permutes (2, 0, 1, 3) merges (H*B)."""
    node = x
    for _ in range(limit):
        name = op_name(node.target) if node.op == "call_function" else ""
        if name == "aten.permute" and len(node.args) > 1:
            dims = [int(d) % 4 for d in node.args[1]]
            return len(dims) == 4 and dims.index(2) < dims.index(0)
        if name not in ("aten.clone", "aten.contiguous") or not isinstance(node.args[0], fx.Node):
            return False
        node = node.args[0]
    return False


def _einsum_head_shape(x: fx.Node) -> tuple[int, ...] | None:
    """(B, H, T, hd) of `x` when it is q or k of an einsum scores product, read from the equation's
    letters whatever their order (`"bqhk,bshk->bhqs"`: a JAX port's (B, T, H, hd) layout): the one
    letter both operands contract is hd, the one only `x` has is its length, the kept shared ones are
    (batch,) heads; None for any other operand."""
    for user in x.users:
        if op_name(user.target) != "aten.einsum" or len(user.args) < 2 or len(user.args[1]) != 2:
            continue
        terms = einsum_terms(user)
        if terms is None or x not in user.args[1]:
            continue
        (a, b), out = terms
        mine, other = (a, b) if user.args[1][0] is x else (b, a)
        contracted = [c for c in mine if c in other and c not in out]
        kept = [c for c in mine if c in other and c in out]
        own = [c for c in mine if c not in other]
        if len(contracted) != 1 or len(own) != 1 or not 1 <= len(kept) <= 2 or len(mine) != len(kept) + 2:
            continue
        size = dict(zip(mine, x.meta["val"].shape))
        batch = size[kept[0]] if len(kept) == 2 else 1
        return (int(batch), int(size[kept[-1]]), int(size[own[0]]), int(size[contracted[0]]))
    return None


def _walk_inclusive(node: fx.Node, member_names: set[str], projections: dict) -> list[fx.Node]:
    if node.name in projections:
        return [node]
    return _walk(node, member_names, projections, forward=False)


def _residual_add(
    proj: fx.Node, member_names: set[str], projections: dict[str, Projection]
) -> tuple[fx.Node, fx.Node] | None:
    """(add, stream operand) of the block whose last projection is `proj` (o or down).

    The first aten.add downstream of `proj` with one operand derived from `proj` and the other derived
    from no projection of the layer except those upstream of `proj` - the residual stream. In a
    parallel-residual layer (GPT-J, GPT-NeoX: x + attn(x) + mlp(x)) that is the add after both blocks,
    so attention and MLP report the same add.
    """
    upstream = _projection_ancestors(proj, member_names, projections)
    queue, seen = deque([proj]), {proj.name}
    while queue:
        node = queue.popleft()
        for user in node.users:
            if user.name not in member_names or user.name in seen:
                continue
            seen.add(user.name)
            if user.target in (aten.add.Tensor, aten.add_.Tensor) and len(user.all_input_nodes) == 2:
                a, b = user.all_input_nodes
                for mine, other in ((a, b), (b, a)):
                    other_sources = _projection_ancestors(other, member_names, projections, inclusive=True)
                    from_proj = mine is proj or proj.name in _projection_ancestors(
                        mine, member_names, projections
                    )
                    if from_proj and other_sources <= upstream:
                        return user, other
            queue.append(user)
    return None


def _projection_ancestors(
    node: fx.Node, member_names: set[str], projections: dict[str, Projection], inclusive: bool = False
) -> set[str]:
    """Names of the layer's projections that `node` derives from (itself too if `inclusive`)."""
    found = {node.name} if inclusive and node.name in projections else set()
    queue, seen = deque([node]), {node.name}
    while queue:
        for a in queue.popleft().all_input_nodes:
            if a.name in seen or a.name not in member_names:
                continue
            seen.add(a.name)
            if a.name in projections:
                found.add(a.name)
            queue.append(a)
    return found


# --------------------------------------------------------------------------------------------- mlp


def _routes(node: fx.Node, member_names: set[str], projections: dict[str, Projection]) -> bool:
    """Whether `node`'s output reaches an `aten.topk` inside the layer without passing through another
    projection: a mixture-of-experts router (Mixtral's `gate`, Qwen-MoE's, DeepSeek's, softmax or
    sigmoid before the top-k)."""
    queue, seen = deque([node]), {node.name}
    while queue:
        for user in queue.popleft().users:
            if user.name in seen or user.name not in member_names or user.name in projections:
                continue
            if op_name(user.target) == "aten.topk":
                return True
            seen.add(user.name)
            queue.append(user)
    return False


def _token_gates(
    projs: list[Projection],
    node_of: dict[str, fx.Node],
    member_names: set[str],
    projections: dict[str, Projection],
) -> list[Projection]:
    """Per-token scalar gates among a layer's MLP-side projections, their role set to `Role.TOKEN_GATE`:
    a linear to one output per token whose output, through an activation or not, multiplies another
    tensor of the layer (Qwen2-MoE's `shared_expert_gate`: sigmoid(gate(x)) * shared_expert(x)). One
    output cannot be split column-wise, and split row-wise it would add an all-reduce of a (tokens, 1)
    partial per layer: kept whole, as Megatron-Core keeps its shared-expert gate. None when they are
    all such (a chain of scalars is nobody's gate)."""
    gates = []
    for p in projs:
        if p.out_features != 1 or p.parts:
            continue
        queue, seen, scales = deque([node_of[p.node]]), {p.node}, False
        while queue and not scales:
            for user in queue.popleft().users:
                if user.name in seen or user.name not in member_names or user.name in projections:
                    continue
                seen.add(user.name)
                name = op_name(user.target)
                if name == "aten.mul" and all(isinstance(a, fx.Node) for a in user.args[:2]):
                    scales = True
                    break
                if name in _ACTIVATIONS or name in _VIEW_OPS:
                    queue.append(user)
        if scales:
            gates.append(p)
    if len(gates) == len(projs):
        return []
    for p in gates:
        p.role = Role.TOKEN_GATE
    return gates


def _latents(
    projs: list[Projection],
    attention_projs: list[Projection],
    node_of: dict[str, fx.Node],
    member_names: set[str],
    projections: dict[str, Projection],
) -> list[Projection]:
    """Multi-head latent attention's down projections among a layer's non-attention projections, their
    role set to `Role.LATENT`: a linear whose output, followed forward through the layer's other ops
    (a norm, RoPE, slices, the copies that build each head's key), reaches the attention's query, key or
    value projections (DeepSeek-V2 / V3's `q_a_proj` -> `q_a_layernorm` -> `q_b_proj`;
    `kv_a_proj_with_mqa` -> `kv_b_proj`, its shared RoPE key straight into the core) and nothing else:
    no other projection, no value leaving the layer (the residual stream). Left in the MLP, they were
    priced as a chain with the MLP's projections and split column-wise, and the latent's norm then ran
    on gathered tensors. Kept whole, as Megatron-Core and DeepSeek's reference model keep them."""
    qkv = {p.node for p in attention_projs if p.role is not Role.O}
    if not qkv:
        return []
    latents = []
    for p in projs:
        queue, seen, found, leaves = deque([node_of[p.node]]), {p.node}, set(), False
        while queue and not leaves:
            for user in queue.popleft().users:
                if user.name not in member_names:
                    leaves = True
                    break
                if user.name in seen:
                    continue
                seen.add(user.name)
                if user.name in projections:
                    found.add(user.name)
                elif op_name(user.target) not in _MATMULS | {"aten.bmm", "aten.scaled_dot_product_attention"}:
                    queue.append(user)  # a core's matmul or SDPA ends the walk
        if found and found <= qkv and not leaves:
            latents.append(p)
    for p in latents:
        p.role = Role.LATENT
    return latents


def _mlp(
    projs: list[Projection],
    members: list[fx.Node],
    member_names: set[str],
    projections: dict[str, Projection],
) -> Mlp:
    """The layer's MLP block from its non-attention projections (roles set on them)."""
    node_of = {n.name: n for n in members}
    feeds = {
        p.node: {s.name for s in _walk(node_of[p.node], member_names, projections, forward=False)}
        for p in projs
    }
    mine = {p.node for p in projs}
    firsts = [p for p in projs if not (feeds[p.node] & mine)]
    for p in projs:
        if p in firsts:
            continue
        consumers = {n.name for n in _walk(node_of[p.node], member_names, projections, forward=True)}
        p.role = Role.FC if consumers & mine else Role.DOWN
    if len(firsts) == 1:
        firsts[0].role = Role.UP
    else:
        for p in firsts:
            p.role = Role.GATE if _activated(node_of[p.node], member_names, projections) else Role.UP
        if all(p.role is Role.GATE for p in firsts) or all(p.role is Role.UP for p in firsts):
            for p in firsts:
                p.role = Role.FC
    down = next((p for p in reversed(projs) if p.role is Role.DOWN), None)
    found = _residual_add(node_of[down.node], member_names, projections) if down else None
    return Mlp(projs, found[0].name if found else None)


def _activated(node: fx.Node, member_names: set[str], projections: dict) -> bool:
    """Whether an activation lies between `node` and the next product (or projection)."""
    queue, seen = deque([node]), {node.name}
    while queue:
        n = queue.popleft()
        for user in n.users:
            if user.name in seen or user.name not in member_names or user.name in projections:
                continue
            name = op_name(user.target)
            if name in _ACTIVATIONS:
                return True
            if name == "aten.mul" and all(isinstance(a, fx.Node) for a in user.args[:2]):
                continue  # the gating product: stop this path
            seen.add(user.name)
            queue.append(user)
    return False


# ----------------------------------------------------------------------------------------- summary


def _token_vocab_size(embeddings: list[Embedding], node_of: dict[str, fx.Node]) -> int | None:
    """Rows of the token embedding: the one indexed by a model input (through views only; position
    embeddings are indexed by aranges or cumsums), else the largest."""
    for e in embeddings:
        index = node_of[e.node].args[1]
        while op_name(index.target) in _VIEW_OPS and index.all_input_nodes:
            index = index.all_input_nodes[0]
        if index.op == "placeholder":
            return e.vocab_size
    return max((e.vocab_size for e in embeddings), default=None)


def _hidden_size(
    layers: list[Layer],
    embeddings: list[Embedding],
    projections: list[Projection],
    node_of: dict[str, fx.Node],
) -> int:
    """The last dim of the stream entering the first layer, else the embedding / first input width."""
    if layers:
        return int(node_of[layers[0].input_node].meta["val"].shape[-1])
    if embeddings:
        return embeddings[0].dim
    return projections[0].in_features if projections else 0

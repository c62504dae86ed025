"""Cost of every operator of a model under every sharding strategy, for one mesh and workload.

    ModelStructure + ClusterSpec + WorkloadSpec + MeshConfig ─► CostTables (LayerGraphs of ops,
    options, edges) ─► ILP

A layer is a small graph of ops. Each op has *options* (strategies), each option consuming its
inputs in given layouts and producing its output in one layout, with a compute time and a memory
per rank. Layouts over the tensor-parallel axis (`planner.plan.Layout`):

    R  Replicate           every rank holds the whole tensor
    S  Shard(last dim)     rank r holds slice r of the last dim (heads, for attention)
    P  Partial             every rank holds a partial sum; the tensor is their sum

Converting a producer's layout into the layout its consumer needs costs (``conversion_time_s``):
P->R all-reduce, S->R all-gather, P->S reduce-scatter, R->S free (local slice), same layout free.
Nothing consumes P (a partial sum may not pass through a nonlinearity), so it must be converted.

Strategies:
    projection (nn.Linear / HF Conv1D)  replicate (R->R), colwise (R->S), rowwise (S->P)
    attention core (SDPA)               replicate (R->R), head (S->S: whole heads, GQA kv heads too)
    elementwise (activation, SwiGLU)    replicate (R->R), shard (S->S)
    embedding                           replicate, vocab (rows split, masked lookup, output P)
    LM head                             replicate, vocab (output sharded on the vocab)

The residual stream between blocks is always R, so each block's output is converted to R: that
conversion (one all-reduce for Megatron's column-then-row) is what ladder residual overlaps. With
sequence parallelism (Korthikanti et al. 2022, section 4.2.2; `MeshConfig.sequence_parallel`) the
stream between blocks is split along the sequence over the TP ranks instead: a block output in P is
reduce-scattered into it and all-gathered again at the next block's input (the same bytes on the ring
as one all-reduce, `stream_conversion_time_s`), and the norms, residual adds and their stored
activations (Korthikanti's 10 s*b*h) are divided by the TP degree.

Training memory also follows Korthikanti et al.: with an attention kernel that writes its scores to
memory (`ClusterSpec.attention_kernel` "materialized"; their memory traffic is priced too) a layer whose
attention core is not recomputed keeps them (softmax output, dropout mask and output: 5 a s^2 b per
layer, `memory.attention_scores_bytes`); selective recomputation (`Recompute.SELECTIVE`) drops them and
runs the core's forward again in backward. A fused (flash-style) kernel keeps no scores, so selective
recomputation has nothing to save there. Full recomputation keeps only the layer input
(`recompute_input_bytes`). The distributed
optimizer (ZeRO-1) divides Adam's state by the DP degree and replaces the gradient all-reduce by a
reduce-scatter of gradients and an all-gather of parameters (`gradient_sync_cost`).

Context parallelism (`MeshShape.cp`; `CostContext.cp`) splits every sequence's tokens over cp ranks:
`CostContext.tokens` is a rank's share, so every token-wise op, TP collective, stage send and stored
activation is priced on it; the attention core is priced per variant by `cp_core_cost`
(`costmodels.context_parallel`), its K/V buffers in flight added to `transient_bytes`; the CP ranks hold
the same weights, so the gradient reduction and sharded states span dp x cp ranks (`dp_group`,
`state_shards`).

Expert parallelism (`MeshConfig.ep`, `ep_fold`; `costmodels.expert_parallel`): a mixture-of-experts
layer's routed experts are priced on the busiest rank of its EP group (`expert_share`: its rows,
the experts it holds that they reach), their GEMMs in `fixed_compute_s` (`expert_gemm_time_s`), the
token exchange in `LayerGraph.fixed_comm_s` (`expert_comm_time_s`), E / ep experts' weights in the
static bytes (`expert_param_bytes`); over dp x cp their gradients are reduced, and their states
sharded, over the dp x cp / ep ranks holding the same experts (`CostContext.experts_context`,
`LayerGraph.expert_grad_bytes`, `expert_static_bytes`). A dense model prices as before. Expert tensor
parallelism (`MeshConfig.expert_tp` = tp, without EP or with EP over dp x cp; `CostContext.expert_tp`;
Megatron-Core's default at TP > 1): each expert is a Megatron MLP split over the TP ranks along its width I (`expert_split`), so its GEMMs run 1/tp of
the FLOP at the narrower width, its weights, gradients, optimizer state and I-wide activations are
divided by tp, and one all-reduce of the tokens x H output over TP per layer (and one of the input
gradient in training) joins the exchange; expert_tp 1 prices the experts whole on every TP rank.
Without EP and with the experts whole no pass rewrites them (`CostContext.experts_rewritten`): the
model's own expert code runs, and its nodes are priced as they are, time and kept activations.

Times are per micro-batch on one rank; a pipelined step of them takes `step_time_s`. Training
multiplies compute by `TRAIN_COMPUTE_FACTOR` (backward = 2x forward FLOPs) and communication by
`TRAIN_COMM_FACTOR` (each forward collective has a conjugate backward one of the same size:
Megatron's f/g operators).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from costmodels import compute, memory
from costmodels.cluster import ClusterSpec, DeviceSpec
from costmodels.comm import (
    Group,
    all_gather_time_s,
    all_reduce_time_s,
    burst_cluster,
    p2p_time_s,
    reduce_scatter_time_s,
)
from costmodels.context_parallel import CpAttentionCost, CpAttentionShape, cp_attention_cost, ulysses_refusal
from costmodels.dtypes import DTYPE_BYTES
from costmodels.expert_parallel import (
    all_to_all_exchange_s,
    busiest_load_factor,
    dispatch_bytes,
    local_touched_experts,
)
from planner.errors import InputError
from planner.frontend.analysis import (
    Attention,
    Layer,
    ModelStructure,
    MoE,
    NodeCost,
    Projection,
    Role,
    conv_call_at_batch,
)
from planner.frontend.moe import ExpertWeight
from planner.frontend.roles import Adapter
from planner.plan import DataParallel, Layout, MeshShape, Workload, tp_overlap_chunk_count
from planner.solver.problem import MeshConfig, WorkloadSpec

R, S, P = Layout.REPLICATE, Layout.SHARD, Layout.PARTIAL

TRAIN_COMPUTE_FACTOR = 3.0  # forward + backward (2x forward FLOPs: input grads and weight grads)
TRAIN_COMM_FACTOR = 2.0  # forward collectives plus their backward conjugates (Megatron f/g)
# ATen ops per parameter tensor of torch.optim.Adam's per-tensor loop (`_single_tensor_adam`, the
# default on CPU): step += 1, exp_avg.lerp_, exp_avg_sq.mul_ and .addcmul_, the step's .item(), sqrt,
# div, add eps, param.addcdiv_. On an eager CPU each costs a node's dispatch overhead: the Adam step of
# the 39-tensor tiny Llama-3 took 5.6 ms there, 1.6 ms of it memory traffic (2026-11-30).
ADAM_OPS_PER_TENSOR = 9
# A pooling op's backward zero-fills the input's gradient and scatters the output's gradient into it
# by the saved indices (read output gradient and int64 indices, write the input twice): about twice
# the forward's bytes (input + output), at memory bandwidth. Its forward runs far below that
# (`DeviceSpec.pooling_bandwidth_bytes_per_s`): on the dev VM a 2x2 max pool over (8, 32, 32, 32)
# took 1.52 ms forward and 1.96 ms forward + backward (2026-12-01), not 3x the forward.
POOL_BACKWARD_BYTES_FACTOR = 2.0
NORM_KIND = "rmsnorm"  # FLOP convention for the per-layer norms (cheap either way: memory bound)
INF = math.inf


@dataclass
class OpOption:
    """One strategy of one op."""

    name: str  # "replicate" | "colwise" | "rowwise" | "head" | "shard" | "vocab"
    in_layout: Layout  # layout each input must arrive in
    out_layout: Layout
    compute_s: float  # per micro-batch (training: forward + backward)
    static_bytes: float  # per rank, independent of micro-batches: params, grads, optimizer, KV cache
    activation_bytes: float  # per rank, per in-flight micro-batch (training only)
    comm_s: float = 0.0  # communication inside the op itself
    grad_bytes: float = 0.0  # gradient bytes per rank (training: all-reduced across DP)
    # attention core, training: scores kept for backward unless selectively recomputed (included in
    # activation_bytes), and the forward time that recomputing them costs
    selective_bytes: float = 0.0
    selective_s: float = 0.0
    # of activation_bytes, a projection's stored input (`projection_options`): projections that read one
    # tensor (q / k / v, gate / up) store it once (`_shared_inputs_once`)
    input_bytes: float = 0.0
    # full recomputation reruns the forward, priced as compute_s / TRAIN_COMPUTE_FACTOR; this is the
    # op's forward beyond that (a materialized attention core's forward moves 13 of the 32 bytes per
    # score element of forward + backward, not a third: `compute.materialized_scores_bytes`)
    full_extra_s: float = 0.0
    # communication inside the op hidden behind its own compute (context-parallel ring attention's K/V
    # blocks under the blocks' attention); not in comm_s, which is what the rank waits for
    hidden_comm_s: float = 0.0
    # of static_bytes, those of frozen parameters (`CostContext.frozen`): weights only whatever the
    # data-parallel style, so not scaled by its training-state factor (`search._with_state_factor`)
    frozen_bytes: float = 0.0


@dataclass
class Op:
    """One op of a layer graph with its options. `inputs` name producer ops ("" = the stream, R)."""

    name: str  # unique in its graph, e.g. "q", "core", "down", "mlp.0"
    block: str  # "attention" | "cross" (a decoder's cross-attention) | "mlp" | "embedding" | "head"
    options: list[OpOption]
    inputs: list[str]
    out_bytes: float  # bytes of the full (unsharded) output tensor, per micro-batch
    weight: str | None = None  # parameter FQN for projections / embeddings
    projection: Projection | None = None  # the analysed projection, when the op is one
    excluded: dict[str, str] = field(default_factory=dict)  # option name -> why it is not offered

    def option(self, name: str) -> OpOption:
        for opt in self.options:
            if opt.name == name:
                return opt
        raise KeyError(f"op {self.name} has no option {name!r}")


@dataclass
class LayerGraph:
    """Ops of one layer class (identical layers share it) or of the non-layer ops."""

    key: str  # class key (layers with equal keys share strategy variables)
    ops: list[Op]
    block_outputs: dict[str, str]  # block -> op whose output joins the residual stream (needs R)
    fixed_compute_s: float  # norms and residual adds: not sharded
    fixed_static_bytes: float  # norm weights etc. (with optimizer state when training)
    fixed_activation_bytes: float
    fixed_grad_bytes: float = 0.0
    # the ends only: the part of fixed_compute_s computed before the first layer (RoPE tables, masks,
    # position ids), which runs on the first pipeline stage; the rest (final norm, ...) on the last
    first_stage_compute_s: float = 0.0
    # expert parallelism: the exposed token exchange of a MoE layer (`expert_comm_time_s`), and the
    # routed experts' gradient bytes per rank when they are reduced over their own (edp) group, apart
    # from `fixed_grad_bytes` (`dp_sync_phases` of `CostContext.experts_context`)
    fixed_comm_s: float = 0.0
    expert_grad_bytes: float = 0.0
    # of fixed_static_bytes, the routed experts' weights and training state when EP over dp x cp shards
    # their state over the edp group (`CostContext.experts_context`): rescaled apart from the rest when
    # a search candidate differs only in its data-parallel style (`search._with_state_factor`)
    expert_static_bytes: float = 0.0
    # of fixed_static_bytes, what training does not scale by its state factor: frozen parameters'
    # weights (`OpOption.frozen_bytes`) and, in the ends, the buffers (masks, RoPE tables)
    frozen_static_bytes: float = 0.0
    # False for a layer class a training step runs forward only (`Layer.trainable` false: no gradient
    # reaches it, none is taken): no backward, so no activation recomputation can run there
    backward: bool = True
    # an asynchronous device (`DeviceSpec.host_dispatch_s`): the host's time to issue the layer's nodes
    # (`CostContext.host_dispatch_time`); its compute is max(kernels, this), a floor the ILP and the
    # prediction apply (`layer_compute_s`). The ends: all their nodes, of which `first_stage_dispatch_s`
    # on the first pipeline stage (before the first layer)
    dispatch_s: float = 0.0
    first_stage_dispatch_s: float = 0.0
    # of dispatch_s, the forward pass's nodes: what a full recomputation issues again
    forward_dispatch_s: float = 0.0

    @property
    def last_stage_compute_s(self) -> float:
        """The ends only: the part of fixed_compute_s the last pipeline stage runs (after the last layer)."""
        return self.fixed_compute_s - self.first_stage_compute_s

    @property
    def last_stage_dispatch_s(self) -> float:
        """The ends only: the host's issue time of the nodes after the last layer (last stage)."""
        return self.dispatch_s - self.first_stage_dispatch_s

    def op(self, name: str) -> Op:
        for op in self.ops:
            if op.name == name:
                return op
        raise KeyError(name)

    def edges(self) -> list[tuple[str, str]]:
        """(producer, consumer) pairs between ops of this graph."""
        return [(src, op.name) for op in self.ops for src in op.inputs if src]

    def ops_of(self, block: str) -> list[Op]:
        """The ops of one block ("attention", "mlp", "embedding", "head"), in graph order."""
        return [op for op in self.ops if op.block == block]

    def timed_ops(self, block: str) -> list[Op]:
        """The ops whose compute counts as `block`'s ("attention" or "mlp") in a layer's time: a
        decoder's cross-attention ("cross") counts with its attention (ladder residual hides an
        attention block's all-reduce behind the MLP and the MLP's behind the next attention)."""
        return [op for op in self.ops if op.block == block or (block == "attention" and op.block == "cross")]

    def cheapest_compute_s(self) -> float:
        """Compute time with every op at its cheapest option, conversions left out: a lower bound."""
        return self.fixed_compute_s + sum(min(o.compute_s for o in op.options) for op in self.ops)

    def least_static_bytes(self) -> float:
        """Static bytes per rank with every op at its most frugal option: a lower bound."""
        return self.fixed_static_bytes + sum(min(o.static_bytes for o in op.options) for op in self.ops)

    def least_activation_bytes(self) -> float:
        """Activation bytes per micro-batch with every op at its most frugal option: a lower bound."""
        return self.fixed_activation_bytes + sum(
            min(o.activation_bytes for o in op.options) for op in self.ops
        )


def ranks_per_node(size: int, capacity: int) -> int:
    """Ranks per node of a group of `size` ranks that fill nodes in order, at most `capacity` of them on
    a node: min(size, capacity), so the group spans as few nodes as placement fills (6 of a node's 8 hold
    a group of 6 on one node; 12 span two, 8 + 4: `comm.Group` prices uneven nodes as full ones). Not
    the gcd, which read 6 on nodes of 8 as 3 nodes of 2 and failed a 2-node cluster."""
    return max(1, min(size, capacity))


@dataclass
class CostContext:
    """Everything the per-op costs depend on, fixed for one mesh candidate."""

    structure: ModelStructure
    cluster: ClusterSpec
    workload: WorkloadSpec
    config: MeshConfig  # mesh, micro-batches, pipeline schedule
    dtype: str  # planned dtype: "bf16" | "fp16" | "fp32"
    # prices the routed experts' data parallelism (`experts_context`): with expert parallelism folded
    # over dp x cp their gradients are reduced, and their sharded states split, over the dp x cp / ep
    # ranks holding the same experts (the "edp" group, `runtime.mesh.ep_ranks`) instead of dp x cp
    expert_data_parallel: bool = False

    @property
    def mesh(self) -> MeshShape:
        return self.config.mesh

    @property
    def micro_batches(self) -> int:
        return self.config.micro_batches

    @property
    def virtual_stages(self) -> int:
        return self.config.virtual_stages

    @property
    def sequence_parallel(self) -> bool:
        """Sequence parallelism is on and means something (tp > 1)."""
        return self.config.sequence_parallel and self.mesh.tp > 1

    @property
    def cp(self) -> int:
        """Context-parallel degree in effect: the mesh's, 1 for a decode step (one new token per sequence)."""
        return 1 if self.workload.kind is Workload.DECODE else self.mesh.cp

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same weights, whose gradients are reduced together: dp x cp (the CP ranks
        of a replica hold the same weights: Megatron-Core's dp-cp group, `MeshShape.dp_cp`); in an
        `experts_context` with EP over dp x cp, the dp x cp / ep ranks holding the same experts."""
        return self.mesh.dp * self.mesh.cp // (self.ep if self._expert_group else 1)

    @property
    def ep(self) -> int:
        """Expert-parallel degree (`MeshConfig.ep`; 1 without expert parallelism)."""
        return self.config.ep

    @property
    def ep_fold(self) -> str:
        """The ranks expert parallelism folds over, "dp" (dp x cp) or "tp" (`MeshConfig.ep_fold`)."""
        return self.config.ep_fold

    @property
    def _expert_group(self) -> bool:
        """This context prices the experts' own data parallelism over the edp group (EP over dp x cp)."""
        return self.expert_data_parallel and self.ep > 1 and self.ep_fold == "dp"

    @property
    def experts_on_sequence_shard(self) -> bool:
        """Whole experts under EP over dp x cp run each TP rank's sequence shard (`moe_rows_sharded`,
        `Plan.experts_on_sequence_shard`): their gradients are reduced over the edp group's ranks and
        their TP ranks, once a step (`dp_group` in an `experts_context`)."""
        return (
            self.ep > 1 and self.ep_fold == "dp" and self.expert_tp == 1 and self.mesh.tp > 1
            and moe_rows_sharded(self)
        )  # fmt: skip

    def experts_context(self) -> CostContext:
        """This context for the routed experts' parameters (`expert_data_parallel`)."""
        return dataclasses.replace(self, expert_data_parallel=True)

    @property
    def experts_rewritten(self) -> bool:
        """The expert-parallel pass rewrites the MoE blocks (`passes.lower`: ep > 1 or experts split over
        TP), so their experts run as one grouped GEMM per projection on the rows of their share
        (`expert_gemm_time_s`); otherwise they run as the model's graph computes them and are priced
        node by node (`layer_node_times_s`, `graph_expert_activation_bytes`)."""
        return self.ep > 1 or self.expert_tp > 1

    @property
    def expert_tp(self) -> int:
        """TP ranks each routed expert is split over (`MeshConfig.expert_tp`): tp when the config splits
        them without EP or with EP over dp x cp, else 1 (every TP rank holds each of its experts whole)."""
        config = self.config
        return config.expert_tp if config.expert_tp > 1 and config.ep_fold == "dp" and self.mesh.tp > 1 else 1

    def ep_group(self) -> Group:
        """The EP group (fold dp): ep consecutive ranks of the dp x cp ranks of one (pp, tp) coordinate,
        tp apart in rank order (`runtime.mesh.ep_ranks`), as many on a node as the dp x cp group has
        there (up to ep); fold tp: the TP group."""
        if self.ep_fold == "tp":
            return self.tp_group()
        per_node = dataclasses.replace(self, expert_data_parallel=False).dp_group().ranks_per_node
        return self._placed(self.ep, per_node)

    @property
    def dp_style(self) -> DataParallel:
        """The data-parallel style in effect: the config's when training with dp x cp > 1, else DDP
        (nothing to shard)."""
        if not self.train or self.dp_cp == 1:
            return DataParallel.DDP
        return self.config.dp_style

    @property
    def distributed_optimizer(self) -> bool:
        """Adam's state is sharded and that means something (training, dp > 1): ZeRO-1 or more."""
        return self.dp_style.shards_optimizer

    @property
    def shard_degree(self) -> int:
        """DP ranks each sharded state is split over (1 without sharding; `Plan.dp_shard`)."""
        return self.config.shard_degree if self.dp_style is not DataParallel.DDP else 1

    @property
    def state_shards(self) -> int:
        """Ranks each sharded state is split over: `shard_degree` DP ranks x the cp ranks of each (as the
        runtime shards: `runtime.mesh`, torchtitan's FSDP over dp_shard x cp); 1 without sharding. The
        routed experts' under EP over dp x cp (`experts_context`): as many of those as the edp group
        holds (Megatron-Core's distributed optimizer shards expert state over the expert-data-parallel
        group; the runtime runs EP with ddp)."""
        if self.dp_style is DataParallel.DDP:
            return 1
        shards = self.shard_degree * self.mesh.cp
        return math.gcd(shards, self.dp_cp) if self._expert_group else shards

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP gathers each unit again for its backward (False for the other styles)."""
        return self.dp_style is DataParallel.FSDP and self.config.reshard_after_forward

    @property
    def tp_comm_overlap(self) -> bool:
        """TP collectives run in chunks under the GEMMs beside them, and that means something (tp > 1)."""
        return self.config.tp_comm_overlap and self.mesh.tp > 1

    @property
    def overlap_grad_reduce(self) -> bool:
        """Gradient reduction per bucket during the backward (training, dp x cp > 1, ddp / zero1 / zero2)."""
        styles = (DataParallel.DDP, DataParallel.ZERO1, DataParallel.ZERO2)
        return self.config.overlap_grad_reduce and self.train and self.dp_cp > 1 and self.dp_style in styles

    @property
    def overlap_param_gather(self) -> bool:
        """zero1 / zero2: the parameter all-gather waited for per bucket in the next forward."""
        return self.config.overlap_param_gather and self.dp_style in (DataParallel.ZERO1, DataParallel.ZERO2)

    @property
    def bytes_per_element(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def grad_dtype(self) -> str:
        """The dtype training gradients are accumulated and reduced in (`WorkloadSpec.grad_reduce_dtype`):
        the parameters' (`dtype`), or fp32."""
        return "fp32" if self.train and self.workload.grad_reduce_dtype == "fp32" else self.dtype

    @property
    def loss_scale(self) -> float | str | None:
        """fp16 training's loss scaling (`WorkloadSpec.plan_loss_scale`: "dynamic", a static scale, or
        None without it)."""
        return self.workload.plan_loss_scale(self.dtype)

    def world_group(self) -> Group:
        """Every rank of the mesh, packed node by node (loss scaling's found-inf all-reduce)."""
        return self._placed(self.mesh.num_devices, self.cluster.devices_per_node)

    @property
    def grad_reduce_scale(self) -> float:
        """Bytes the data-parallel gradient reduction moves per gradient byte in the parameters' dtype
        (`grad_bytes` counts those): 2 for fp32 gradients of 16-bit parameters, else 1."""
        return DTYPE_BYTES[self.grad_dtype] / self.bytes_per_element

    @property
    def train(self) -> bool:
        return self.workload.train

    @property
    def sequences_per_micro_batch(self) -> float:
        """Sequences per micro-batch per DP replica (its cp ranks share them, `tokens`)."""
        return self.workload.batch_size / self.mesh.dp / self.micro_batches

    @property
    def tokens(self) -> float:
        """Tokens per micro-batch on one rank of a DP replica: the replica's sequences' tokens, split over
        the cp ranks (every token-wise op, TP collective and stored activation runs on these)."""
        return self.sequences_per_micro_batch * self.workload.tokens_per_sequence / self.cp

    @property
    def compute_factor(self) -> float:
        return TRAIN_COMPUTE_FACTOR if self.train else 1.0

    @property
    def comm_factor(self) -> float:
        return TRAIN_COMM_FACTOR if self.train else 1.0

    def state_factor(self) -> float:
        """Bytes per rank per parameter byte: weights, plus grads and Adam state when training."""
        if not self.train:
            return 1.0
        # ZeRO-1/2 and FSDP divide the sharded states over the shard degree (`memory.dp_state_bytes`)
        state = memory.dp_state_bytes(
            1, self.dtype, self.dp_style, self.state_shards, self.reshard_after_forward, self.grad_dtype
        )
        return state / memory.param_bytes(1, self.dtype)

    def dp_shard_group(self) -> Group:
        """The ranks a sharded state is split over: `shard_degree` consecutive DP ranks and their cp
        ranks (`state_shards`; HSDP's shard groups are the inner DP dimension, as torchtitan's
        ("dp_replicate", "dp_shard") mesh)."""
        per_node = self.dp_group().ranks_per_node
        shard = self.state_shards
        return self._placed(shard, per_node)

    def dp_replicate_group(self) -> Group:
        """HSDP: the ranks holding the same shard, one per shard group (across nodes unless the shard
        groups are smaller than a node)."""
        per_node = self.dp_group().ranks_per_node
        replicate = (
            self.dp_cp // self.state_shards if self._expert_group else self.mesh.dp // self.shard_degree
        )
        # one rank per shard group that starts on a node (a node of 3 holds parts of 2 groups of 2)
        return self._placed(replicate, max(1, -(-per_node // self.state_shards)))

    def _placed(self, size: int, per_node: int) -> Group:
        """Group(size, per_node) (`per_node` >= 1 the most a node holds of it; at most size), with at
        least size / nodes ranks on a node: a group of the mesh spans no more nodes than the cluster has (a TP degree that does not divide a node leaves a dimension's
        groups straddling nodes; the even count read more nodes than exist)."""
        least = -(-size // self.cluster.num_nodes)
        return Group(size, min(size, max(per_node, least), self.cluster.devices_per_node))

    def tp_group(self) -> Group:
        """The TP ranks: consecutive, on one node while tp divides a node's devices. A tp that does not
        (2 on nodes of 3) leaves a group straddling two nodes once the mesh spans several: priced with
        per_node % tp ranks on one side and the rest on the other, over the inter-node link (it was
        priced as inside a node)."""
        tp, per_node = self.mesh.tp, self.cluster.devices_per_node
        if 1 < tp < per_node and per_node % tp and self.mesh.num_devices > per_node:
            return self._placed(tp, max(per_node % tp, tp - per_node % tp))  # two nodes: the larger side
        return self._placed(tp, per_node)

    def dp_group(self) -> Group:
        """The dp x cp ranks that reduce gradients together (`dp_cp`). They sit after the TP ranks: the
        cp ranks of a replica first (`MeshShape`: tp, then cp), then the DP replicas, those in one node
        sharing it."""
        per_node = self.cluster.devices_per_node
        tp, cp = self.mesh.tp, self.mesh.cp
        inner = max(1, per_node // tp) if tp < per_node else 1  # (cp, dp) coordinates on a node
        cp_on_node = self._cp_on_node(cp)
        dp_on_node = ranks_per_node(self.mesh.dp, inner // cp) if cp_on_node == cp else 1
        on_node = cp_on_node * dp_on_node
        if self._expert_group:  # every ep-th of the dp x cp ranks: those of one node, ep apart
            if self.experts_on_sequence_shard:  # and the TP ranks of each (`experts_on_sequence_shard`)
                return self._placed(self.dp_cp * tp, max(1, on_node // self.ep) * min(tp, per_node))
            return self._placed(self.dp_cp, max(1, on_node // self.ep))
        return self._placed(self.dp_cp, on_node)

    def cp_group(self) -> Group:
        """The cp ranks that split a sequence: tp apart (`MeshShape`), on one node while tp x cp fits it."""
        return self._placed(self.cp, self._cp_on_node(self.cp))

    def _cp_on_node(self, cp: int) -> int:
        """Ranks of a CP group of `cp` on each node it spans: all while tp x cp fits a node, else the
        cp-th part of the node's TP groups (as `tp_group` counts a TP group's)."""
        tp, per_node = self.mesh.tp, self.cluster.devices_per_node
        if tp * cp <= per_node:
            return cp
        return ranks_per_node(cp, max(1, per_node // tp) if tp < per_node else 1)

    def op_time(
        self,
        flops: float,
        bytes_moved: float,
        kind: str,
        rows: float | None = None,
        shape: tuple[float, float] | None = None,
        call: tuple | None = None,
        seq: tuple | None = None,
        weight_grad: bool = True,
        input_grad: bool = True,
    ) -> float:
        """Roofline time of one op (training: forward + backward, `compute_factor` times the forward;
        a pooling op's backward is instead a memory-bound scatter, `POOL_BACKWARD_BYTES_FACTOR` times
        its forward bytes). With a per-node overhead on the device (`node_overhead_time`), the op's
        launch term is left out: its node pays that instead. ``shape``: a matmul's (K, N) on one rank,
        ``call`` a convolution's, ``seq`` an attention core's (query length, key length, causal and,
        optionally, its thread blocks) (`costmodels.compute.op_time_s`).

        On a device priced by GEMM shape (``DeviceSpec.gemm``), a training matmul is its three GEMMs
        (`costmodels.compute.training_gemm_shapes`: forward, input and weight gradients) each at its
        own shape's efficiency; on one with a fused attention fit (``DeviceSpec.attention``), an
        attention core runs at the fit's rate for its lengths and blocks, and a training one is its
        forward plus ``backward_time_factor`` forwards.

        ``weight_grad`` False: a matmul whose weight is frozen (`frozen`): its backward computes the
        input gradient only, one GEMM of the forward's size fewer; ``input_grad`` False: one whose input
        needs no gradient (nothing upstream trains: a linear probe's head), the weight gradient only."""
        dev = self.cluster.device
        launch = dev.node_overhead_s is None
        if self.train and kind == "matmul" and dev.gemm is not None and rows and shape is not None:
            gemms = compute.training_gemm_shapes(rows, shape[0], shape[1])
            return sum(
                compute.op_time_s(
                    flops, bytes_moved, dev, self.dtype, kind, rows=m, launch=launch, shape=(k, n)
                )
                for i, (m, k, n) in enumerate(gemms)
                if (i != 2 or weight_grad) and (i != 1 or input_grad)
            )
        if self.train and kind == "attention" and dev.attention is not None and seq is not None:
            forward = compute.op_time_s(flops, bytes_moved, dev, self.dtype, kind, launch=launch, seq=seq)
            return forward * (1.0 + dev.attention.backward_time_factor)
        one = compute.op_time_s(
            flops,
            bytes_moved,
            dev,
            self.dtype,
            kind,
            rows=rows,
            launch=dev.node_overhead_s is None,
            shape=shape,
            call=call,
            seq=seq,
        )
        if kind == "pool" and self.train:
            launch = dev.node_overhead_s is None
            scatter = POOL_BACKWARD_BYTES_FACTOR * bytes_moved
            return one + compute.op_time_s(0.0, scatter, dev, self.dtype, "memory", launch=launch)
        if self.train and kind == "matmul":
            return (self.compute_factor - (not weight_grad) - (not input_grad)) * one
        return self.compute_factor * one

    def forward_only(self) -> CostContext:
        """This context for a forward pass of the same tokens (no backward, no training state): how a
        training step runs a layer that no gradient reaches (`Layer.trainable`)."""
        return dataclasses.replace(self, workload=dataclasses.replace(self.workload, kind=Workload.FORWARD))

    def frozen(self, fqn: str | None) -> bool:
        """Whether parameter ``fqn`` is frozen in a training step (requires_grad=False,
        `ModelStructure.frozen_params`): held as a weight only, with no gradient, optimizer state or
        weight-gradient GEMM. False for inference (nothing is trained) and for None."""
        return self.train and fqn is not None and fqn in self.structure.frozen_params

    def node_overhead_time(self, nodes: float) -> float:
        """Per-node overhead of ``nodes`` fx nodes of the rewritten graph on one rank (training: with
        their backward), 0 on devices priced per kernel launch (see `costmodels.compute.node_overhead_s`); a
        decode step's scaled by the model's own decode graph timed on this machine
        (`DeviceSpec.decode_node_time_ratio`)."""
        elements = self.tokens * self.structure.hidden_size if self.structure.hidden_size else None
        dev = self.cluster.device
        ratio = (dev.decode_node_time_ratio or 1.0) if self.serving_step else 1.0
        return ratio * compute.node_overhead_s(dev, nodes, backward=self.train, elements=elements)

    @functools.cached_property
    def serving_step(self) -> bool:
        """Whether the graph priced is a step of the serving loop: a decode step, or a cached model's
        prefill (a forward whose attention writes a KV cache), which builds its step inputs, takes its
        last logits and writes its caches as a decode step does: priced without that host work and
        node time, a tiny model's time to first token read 3.4x its price on this CPU."""
        if self.workload.kind is Workload.DECODE:
            return True
        return self.workload.kind is Workload.FORWARD and self.structure.has_kv_cache

    def host_dispatch_time(self, nodes: float, backward: bool | None = None) -> float:
        """Host seconds to issue ``nodes`` fx nodes (with ``backward``, default: training, and their
        backward) on an asynchronous device (`DeviceSpec.host_dispatch_s`); 0 where the device has no
        such figure. What a layer costs at least however fast its kernels run (`LayerGraph.dispatch_s`)."""
        dev = self.cluster.device
        if dev.host_dispatch_s is None:
            return 0.0
        per_node = dev.host_dispatch_s
        if self.train if backward is None else backward:
            per_node += (
                dev.host_dispatch_s if dev.host_dispatch_backward_s is None else dev.host_dispatch_backward_s
            )
        return nodes * per_node


def conversion_time_s(src: Layout, dst: Layout, nbytes: float, ctx: CostContext) -> float:
    """Time to turn a tensor of `nbytes` (full size) from layout `src` into `dst` over the TP axis.

    P->R all-reduce, S->R all-gather, P->S reduce-scatter, R->S free, same layout free; a target
    layout P is never needed (returns inf). Training doubles it (backward conjugate collective).
    """
    if src == dst or (src == R and dst == S):
        return 0.0
    if dst == P or ctx.mesh.tp == 1:
        return INF if dst == P else 0.0
    group, cluster = ctx.tp_group(), ctx.cluster
    if src == P and dst == R:
        one = all_reduce_time_s(nbytes, group, cluster)
    elif src == S and dst == R:
        one = all_gather_time_s(nbytes, group, cluster)
    elif src == P and dst == S:
        one = reduce_scatter_time_s(nbytes, group, cluster)
    else:  # internal: every (src, dst) pair is covered above
        raise AssertionError(f"no conversion {src}->{dst}")
    return ctx.comm_factor * one + ctx.node_overhead_time(1)  # the collective is one more graph node


def stream_conversion_time_s(src: Layout, nbytes: float, ctx: CostContext) -> float:
    """Time to return a block's output of `nbytes` (full size) in layout `src` to the residual stream.

    Without sequence parallelism the stream is R: `conversion_time_s(src, R)`. With it the stream is
    split along the sequence and the next block all-gathers its input: P is reduce-scattered then
    all-gathered (Korthikanti et al. 2022, section 4.2.2: g = reduce-scatter, g-bar = all-gather, the
    same bytes on the ring as the all-reduce they replace), S is all-gathered to R, sliced (free) and
    all-gathered again, R is sliced and all-gathered. Training doubles each (backward conjugates);
    the backward's gather of the next block's input again for its weight gradients is
    `sequence_regather_s`, priced with the block (`tp_block_comm_s`).
    """
    if not ctx.sequence_parallel:
        return conversion_time_s(src, R, nbytes, ctx)
    gather = conversion_time_s(S, R, nbytes, ctx)
    if src == P:
        return conversion_time_s(P, S, nbytes, ctx) + gather
    if src == S:
        return 2 * gather
    return gather


def sequence_regather_s(nbytes: float, ctx: CostContext) -> float:
    """Training under sequence parallelism: the backward all-gather of a column-parallel block's input
    (`nbytes` full size) from the sequence shard its projections kept for their weight gradients
    (Korthikanti et al. 2022, section 4.2.2; `passes.tp_overlap.apply_sequence_regather`;
    `projection_options` stores the shard); 0 otherwise."""
    if not (ctx.train and ctx.sequence_parallel) or ctx.mesh.tp == 1:
        return 0.0
    return all_gather_time_s(nbytes, ctx.tp_group(), ctx.cluster) + ctx.node_overhead_time(1)


def contention_s(hidden_s: float, cluster: ClusterSpec) -> float:
    """Compute time lost to `hidden_s` seconds of communication hidden behind it:
    ``cluster.overlap_slowdown`` x hidden_s (`ClusterSpec.overlap_slowdown`; the collective's thread
    blocks and memory traffic slow the kernels it runs beside). Added to every hidden collective's
    exposed time (TP overlap, ladder residual, the overlapped DP phases, context-parallel rings)."""
    return cluster.overlap_slowdown * hidden_s


def tp_overlap_chunks(ctx: CostContext) -> int:
    """Chunks each TP block's collectives are cut into under `CostContext.tp_comm_overlap`
    (`planner.plan.tp_overlap_chunk_count`) for the rows the pass cuts: a micro-batch's tokens on a
    rank; with sequence parallelism the rank's shard of one sequence (of its cp-th of the sequence
    under context parallelism)."""
    tp = ctx.mesh.tp
    rows = ctx.workload.tokens_per_sequence / ctx.cp / tp if ctx.sequence_parallel else ctx.tokens
    return tp_overlap_chunk_count(tp, rows)


def tp_overlap_chunk_compute_s(op: Op, option: OpOption, ctx: CostContext) -> float:
    """Extra compute of a split projection under `CostContext.tp_comm_overlap` (`passes.tp_overlap`
    cuts its GEMMs with their collectives into `tp_overlap_chunks` C of 1/C of the rows each): its
    forward and input-gradient GEMMs at 1/C of the rows, C times, less them whole, t the same option
    priced at both row counts (`projection_options`: GEMM efficiency by shape on the GPU presets, the
    small-row penalty on eager CPUs), and one more node per chunk. The weight gradient stays one GEMM
    over every row; for it the row-parallel backward under sequence parallelism copies each gathered
    chunk of the output gradient into place (tokens x N elements, read and written). 0 without
    overlap, for one chunk, or for an unsplit op."""
    chunks = tp_overlap_chunks(ctx) if ctx.tp_comm_overlap else 1
    if chunks == 1 or op.projection is None or option.name not in ("colwise", "rowwise"):
        return 0.0

    def gemms_s(tokens: float) -> float | None:
        options = projection_options(op.projection, tokens, ctx, weight_grad=False)[0]
        return next((o.compute_s for o in options if o.name == option.name), None)

    full, small = gemms_s(ctx.tokens), gemms_s(ctx.tokens / chunks)
    if full is None or small is None or full <= 0:
        return 0.0
    extra = max(0.0, chunks * small - full) + ctx.node_overhead_time(chunks - 1)  # a kernel per chunk
    if (
        option.name == "rowwise"
        and ctx.train
        and ctx.sequence_parallel
        and not ctx.frozen(op.projection.weight)
    ):
        moved = 2.0 * ctx.tokens * op.projection.out_features * ctx.bytes_per_element
        dev = ctx.cluster.device
        extra += compute.op_time_s(0.0, moved, dev, ctx.dtype, "memory", launch=dev.node_overhead_s is None)
    return extra


def _chunked_exposed_s(
    collective, nbytes: float, chunks: int, gemm_s: float, ctx: CostContext, hide_last: bool = False
) -> tuple[float, float]:
    """(exposed, whole) seconds of one TP collective of `nbytes` cut into `chunks` pieces issued back to
    back (the first at the link's latency, the rest at its burst latency: `comm.burst_cluster`), piece
    i's transfer running while piece i + 1's GEMM computes (`gemm_s`: all pieces' GEMMs together):

        exposed = sum_{i < C-1} max(0, t_i - eta * gemm_s / C) + t_{C-1}

    (eta = `ClusterSpec.overlap_efficiency`); the last piece has nothing after it to hide behind.
    hide_last: each piece is issued before its GEMMs and waited for after them (the backward's gather
    of the sequence shard again, one piece under every chunk's input-gradient GEMM:
    `passes.tp_overlap._ColumnMatmuls`), so the last piece hides too: max(0, t_{C-1} - eta * gemm_s / C)."""
    group, cluster = ctx.tp_group(), ctx.cluster
    first = collective(nbytes / chunks, group, cluster)
    hide = cluster.overlap_efficiency * gemm_s / chunks
    if chunks == 1:
        return (max(0.0, first - hide) if hide_last else first), first
    rest = collective(nbytes / chunks, group, burst_cluster(cluster))
    last = max(0.0, rest - hide) if hide_last else rest
    exposed = max(0.0, first - hide) + (chunks - 2) * max(0.0, rest - hide) + last
    return exposed, first + (chunks - 1) * rest


def tp_block_comm_s(
    out_layout: Layout, out_bytes: float, column_s: float, row_s: float, ctx: CostContext
) -> tuple[float, float]:
    """(exposed, hidden) seconds of one block's TP communication per micro-batch, its output (`out_bytes`
    full size) leaving in `out_layout`, exposed including the `contention_s` of the hidden part;
    `column_s` / `row_s` the compute of the block's column- and row-parallel projections (training:
    forward + both gradient GEMMs, each about a forward).

    Without `CostContext.tp_comm_overlap`, or an output not in P: `stream_conversion_time_s`, all
    exposed, and under sequence parallelism in training `sequence_regather_s` under the
    column-parallel input-gradient GEMMs. With it, as `passes.tp_overlap` runs it (each collective `_chunked_exposed_s` with
    `tp_overlap_chunks` pieces):
    - no sequence parallelism: the exit all-reduce in chunks under the row-parallel GEMM; training
      adds the entry's input-gradient all-reduce, whole, under the column-parallel weight-gradient GEMMs;
    - sequence parallelism: the exit reduce-scatter under the row-parallel GEMM, the next entry's
      all-gather under the column-parallel GEMMs (identical layers: this block's); training adds their
      conjugates, the output-gradient all-gather under the row-parallel input-gradient GEMM and the
      input-gradient reduce-scatter under the column-parallel ones, and the entry's input gathered
      again, whole, for the weight gradients, under the column-parallel input-gradient GEMMs
      (`_chunked_exposed_s` of one piece with hide_last).
    Each collective is one graph node per chunk (`CostContext.node_overhead_time`)."""
    whole = stream_conversion_time_s(out_layout, out_bytes, ctx)
    col, row = column_s / ctx.compute_factor, row_s / ctx.compute_factor  # one GEMM each
    if not ctx.tp_comm_overlap or out_layout != P:
        # under sequence parallelism (training) the entry's input gathered again, under its
        # column-parallel input-gradient GEMMs (`passes.tp_overlap.apply_sequence_regather`)
        regather = sequence_regather_s(out_bytes, ctx) if column_s > 0 else 0.0  # no column entry: none
        hidden = min(regather, ctx.cluster.overlap_efficiency * col)
        return whole + regather - hidden + contention_s(hidden, ctx.cluster), hidden
    chunks = tp_overlap_chunks(ctx)
    if ctx.sequence_parallel:
        parts = [(reduce_scatter_time_s, row), (all_gather_time_s, col)]
        parts += [(all_gather_time_s, row), (reduce_scatter_time_s, col)] if ctx.train else []
        pieces = [_chunked_exposed_s(fn, out_bytes, chunks, gemm, ctx) for fn, gemm in parts]
        nodes = len(pieces) * chunks
        if ctx.train and column_s > 0:  # the shard gathered again, whole, under the chunks' dgrad GEMMs
            pieces.append(_chunked_exposed_s(all_gather_time_s, out_bytes, 1, col, ctx, hide_last=True))
            nodes += 1
    else:
        pieces = [_chunked_exposed_s(all_reduce_time_s, out_bytes, chunks, row, ctx)]
        if ctx.train:
            t = all_reduce_time_s(out_bytes, ctx.tp_group(), ctx.cluster)
            pieces.append((max(0.0, t - ctx.cluster.overlap_efficiency * col), t))
        nodes = len(pieces) * chunks
    hidden = sum(t - e for e, t in pieces)
    exposed = sum(e for e, _ in pieces) + ctx.node_overhead_time(nodes)
    return exposed + contention_s(hidden, ctx.cluster), hidden


# ---------------------------------------------------------------------------------------------
# Options of each op kind


def projection_options(
    proj: Projection,
    tokens: float,
    ctx: CostContext,
    pieces: int | None = None,
    input_grad: bool = True,
    weight_grad: bool = True,
) -> tuple[list[OpOption], dict[str, str]]:
    """replicate / colwise / rowwise for one projection; divisibility decides which are offered.

    pieces: K/V projection of a GQA model with fewer KV heads than tp (`gqa_kv_replicated`): colwise
    cuts it into `pieces` KV heads, each replicated on tp / pieces ranks (vLLM), so a rank computes
    1/pieces of it; rowwise is not offered. input_grad False: nothing upstream of its input trains (the
    LM head of a linear probe), so its backward is the weight gradient only. weight_grad False: times
    without the weight-gradient GEMM (`tp_overlap_chunk_compute_s` prices the GEMMs it cuts apart)."""
    b, tp = ctx.bytes_per_element, ctx.mesh.tp
    n_in, n_out = proj.in_features, proj.out_features
    has_bias = proj.bias is not None
    weight_bytes = (n_in * n_out + (n_out if has_bias else 0)) * b
    frozen = ctx.frozen(proj.weight)  # a frozen bias with it is counted frozen too (LoRA freezes both)
    state = 1.0 if frozen else ctx.state_factor()
    adapter = proj.adapter
    # the input is kept for the weight gradient (autograd keeps none for a frozen weight), or for a
    # trainable adapter's down projection, which reads the same input
    keeps_input = not frozen or (adapter is not None and not ctx.frozen(adapter.down.weight))
    act_in = tokens * n_in * b if ctx.train and keeps_input else 0.0

    def option(name: str, in_layout: Layout, out_layout: Layout, k: float, m: float, shard: int) -> OpOption:
        flops = compute.linear_flops(tokens, k, m, has_bias)
        moved = compute.linear_bytes(tokens, k, m, ctx.dtype, has_bias)
        # a sharded input is stored sharded; with sequence parallelism so is the stream input of a
        # split projection (its sequence shard, all-gathered again in backward: Korthikanti section 4.2.2)
        split_stream = ctx.sequence_parallel and in_layout == R and shard > 1
        stored = act_in / (shard if in_layout == S or split_stream else 1)
        grads = weight_bytes / shard if ctx.train and not frozen else 0.0
        time_s = ctx.op_time(
            flops,
            moved,
            "matmul",
            rows=tokens,
            shape=(k, m),
            weight_grad=weight_grad and not frozen,
            input_grad=input_grad,
        )
        opt = OpOption(name, in_layout, out_layout, time_s, weight_bytes * state / shard, stored,
                       grad_bytes=grads, frozen_bytes=weight_bytes / shard if frozen else 0.0,
                       input_bytes=stored)  # fmt: skip
        if adapter is not None:
            _add_adapter(opt, adapter, tokens, ctx, shard)
        return opt

    options = [option("replicate", R, R, n_in, n_out, 1)]
    excluded: dict[str, str] = {}
    if tp == 1:
        return options, excluded
    whole = ctx.structure.whole_weights.get(proj.weight)
    if whole is not None:  # the TP pass refused a plan that split it
        return options, {"colwise": whole, "rowwise": whole}
    parts = tuple(proj.parts) if proj.parts else (n_out,)
    if pieces is not None:
        options.append(option("colwise", R, S, n_in, n_out / pieces, pieces))
        where = "every rank" if pieces == 1 else f"{tp // pieces} ranks"
        excluded["rowwise"] = (
            f"K/V heads ({pieces}) fewer than tp={tp}: a KV head is not cut, so each is computed whole on {where} "
            "(no row-parallel split)"
        )
        return options, excluded
    if all(p % tp == 0 for p in parts):
        options.append(option("colwise", R, S, n_in, n_out / tp, tp))
    else:
        excluded["colwise"] = f"out features {list(parts)} not divisible by tp={tp}"
    if n_in % tp == 0:
        options.append(option("rowwise", S, P, n_in / tp, n_out, tp))
    else:
        excluded["rowwise"] = f"in features {n_in} not divisible by tp={tp}"
    return options, excluded


def _add_adapter(option: OpOption, adapter: Adapter, tokens: float, ctx: CostContext, shard: int) -> None:
    """Add, in place, a LoRA adapter's cost (`planner.frontend.roles.Adapter`) to its projection's
    ``option`` (split ``shard`` ways), as the tensor-parallel pass runs it: its two GEMMs at their
    shapes (`Adapter.splits`: beside a column-parallel projection down whole and up split, beside a
    row-parallel one down split and up whole), their weights with their training state, the (tokens,
    rank) input up keeps for its weight gradient, the add that joins its output, and the collectives of
    its (tokens, rank) middle: beside a row-parallel projection the partial sums' all-reduce; beside a
    column-parallel one, training, the all-reduce of up's partial input gradient. Under sequence
    parallelism the whole projection runs on this rank's tokens (`passes.tp_rules._token_wise`), the
    all-reduces become a reduce-scatter and an all-gather, and a replicated weight's gradient, summed
    over this rank's tokens, is all-reduced."""
    b, r, tp = ctx.bytes_per_element, adapter.rank, ctx.mesh.tp
    down_split, up_split = adapter.splits(option.name)
    seq = ctx.sequence_parallel and shard > 1
    d = adapter.down.in_features / (shard if down_split == "rowwise" else 1)
    n = adapter.up.out_features / (shard if up_split == "colwise" else 1)
    for weight, k, m, split in ((adapter.down.weight, d, r, down_split), (adapter.up.weight, r, n, up_split)):
        frozen = ctx.frozen(weight)
        rows = tokens / tp if seq and split == "replicate" else tokens  # a whole weight on the token shard
        flops, moved = compute.linear_flops(rows, k, m), compute.linear_bytes(rows, k, m, ctx.dtype)
        option.compute_s += ctx.op_time(
            flops, moved, "matmul", rows=rows, shape=(k, m), weight_grad=not frozen
        )
        option.static_bytes += k * m * b * (1.0 if frozen else ctx.state_factor())
        option.frozen_bytes += k * m * b if frozen else 0.0
        option.grad_bytes += k * m * b if ctx.train and not frozen else 0.0
        if seq and split == "replicate" and ctx.train and not frozen:
            option.comm_s += all_reduce_time_s(k * m * b, ctx.tp_group(), ctx.cluster)
    if ctx.train and not ctx.frozen(adapter.up.weight):
        option.activation_bytes += tokens * r * b / (tp if seq and up_split == "replicate" else 1)
    added = tokens / tp if seq and up_split == "replicate" else tokens  # the add runs where up's output is
    option.compute_s += ctx.op_time(added * n, 3.0 * added * n * b, "memory")  # output + scaled update
    if shard == 1:
        return
    middle, group = tokens * r * b, ctx.tp_group()
    if seq:  # forward gather / reduce-scatter, backward the other
        comm = all_gather_time_s(middle, group, ctx.cluster) if down_split == "replicate" else 0.0
        comm += reduce_scatter_time_s(middle, group, ctx.cluster) if down_split == "rowwise" else 0.0
        option.comm_s += comm * (2.0 if ctx.train else 1.0) + ctx.node_overhead_time(1)
    elif down_split == "rowwise":  # the partial sums, forward (identity backward)
        option.comm_s += all_reduce_time_s(middle, group, ctx.cluster) + ctx.node_overhead_time(1)
    elif ctx.train:  # up's replicated input: its partial gradient all-reduced in backward (tp_copy)
        option.comm_s += all_reduce_time_s(middle, group, ctx.cluster) + ctx.node_overhead_time(1)


def head_split_queries(graph: LayerGraph) -> list[tuple[str, str]]:
    """(core, query projection) for each attention core of ``graph`` that offers "head" and each query
    projection (q, or a fused qkv) feeding it: the core is head-parallel only when that projection is
    column-parallel. The tensor-parallel pass shards an attention core by the heads its query's split
    carries (`passes.tp_rules.rule_sdpa`: replicated K / V are sliced to the query's heads, a
    replicated query runs the core replicated), while the ILP's conversion R -> S into the core is a
    free slice: without this rule it could choose a replicated query (cheaper on some CPU shapes)
    with a head-parallel core, which the pass lowers by gathering K and V at the core. The ILP adds
    x[core, head] <= x[query, colwise]; `planner.solver.explain.block_table` skips such combinations."""
    pairs = []
    for op in graph.ops:
        if not any(o.name == "head" for o in op.options):
            continue
        for name in op.inputs:
            src = graph.op(name) if name else None
            if src is not None and src.projection is not None and src.projection.role in (Role.Q, Role.QKV):
                pairs.append((op.name, name))
    return pairs


def attention_core_options(
    attn: Attention, ctx: CostContext, inner_s: float = 0.0, cross: bool = False
) -> tuple[list[OpOption], dict[str, str]]:
    """SDPA: replicate, or head-parallel when query and KV heads both divide by tp. A materialized
    attention kernel (`ClusterSpec.attention_kernel`) adds the scores' memory traffic
    (`compute.materialized_scores_bytes`) and, training, keeps them for backward (`OpOption.selective_bytes`,
    what selective recomputation frees for `OpOption.selective_s`, the core's forward). A fused core
    that trains with dropout on its probabilities (`Attention.dropout_p`) is priced at the device's
    `AttentionSpec.dropout_time_factor` times the same core without.

    ``inner_s``: time of the attention block's other ops (RoPE, GQA repeats, copies between q/k/v and
    o; see ``layer_node_times_s``), added to each option, divided by tp in the head-parallel one.
    ``cross``: a decoder's cross-attention (`Layer.cross_attention`): every query attends to every
    encoder token (no causal mask), and selective recomputation, which re-runs the layer's first
    core only (`passes.recompute`), frees none of its scores.

    Context parallelism (`CostContext.cp` > 1): each option is priced by `cp_core_cost` (the
    variant's kernels on the rank's tokens, its exposed traffic in `OpOption.comm_s`, the ring's hidden
    traffic in `OpOption.hidden_comm_s`), its stored q, k, v and out a cp-th of the sequence's; an
    all-to-all (Ulysses) option whose heads do not divide by cp is not offered (`ulysses_refusal`)."""
    w, b = ctx.workload, ctx.bytes_per_element
    seqs = ctx.sequences_per_micro_batch
    heads, kv_heads, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q_len, kv_len = w.tokens_per_sequence, w.kv_len
    causal = w.kind is not Workload.DECODE and not cross
    replica_seqs = w.batch_size / ctx.mesh.dp
    kv_cache = (
        memory.kv_cache_bytes(1, replica_seqs, kv_len, kv_heads, hd, ctx.dtype)
        if w.kind is Workload.DECODE
        else 0.0
    )
    if attn.cache_bytes:  # the model's own cache: attention over all of it (masked), its real size
        kv_len, causal = attn.kv_len or kv_len, False
        s = ctx.structure
        kv_cache = attn.cache_bytes * (replica_seqs / s.batch_size) * b / DTYPE_BYTES[s.dtype]
    cp = ctx.cp
    stored = (2.0 * heads + 2.0 * kv_heads) * seqs * q_len / cp * hd * b if ctx.train else 0.0
    materialized = ctx.cluster.attention_kernel == "materialized"
    # decode steps only (prefill runs the engines' flash-style context kernel), and only where the core
    # reads grouped K/V as they are (a model that repeats them to the query heads pays that already)
    per_query_head = (
        ctx.cluster.attention_kernel == "per_query_head"
        and w.kind is Workload.DECODE
        and (attn.core_kv_heads or kv_heads) < heads
    )
    dev = ctx.cluster.device
    bandwidth = dev.memory_bandwidth_bytes_per_s * dev.memory_efficiency

    # a materialized kernel multiplies every (s, s) score and masks the causal half afterwards: Megatron-LM
    # of 2021 (NVIDIA/Megatron-LM megatron/model/transformer.py, ParallelAttention: torch.baddbmm over all
    # [sq, sk] scores, the upper triangle masked by FusedScaleMaskSoftmax, then torch.bmm with V); only a
    # fused kernel skips the masked tiles (Dao et al. 2022)
    skips_masked = causal and not materialized

    refused: dict[str, str] = {}  # option -> why all-to-all (Ulysses) cannot split its heads

    def cp_option(name: str, layout: Layout, shard: int, kv_shard: int) -> OpOption:
        """An option under context parallelism: the variant's kernels and traffic (`cp_core_cost`)."""
        if ctx.config.cp_comm_type == "alltoall":
            refusal = ulysses_refusal(heads / shard, ulysses_kv_heads(attn, shard), cp)
            if refusal is not None:
                refused[name] = refusal
                return OpOption(name, layout, layout, INF, 0.0, 0.0)
        cost = cp_core_cost(attn, ctx, shard, cross)
        extra = max(0.0, cost.forward_s - cost.compute_s / ctx.compute_factor) if ctx.train else 0.0
        return OpOption(name, layout, layout, cost.compute_s + inner_s / kv_shard, 0.0, stored / shard,
                        comm_s=cost.exposed_s + contention_s(cost.hidden_s, ctx.cluster),
                        selective_s=0.0 if cross else cost.forward_s,
                        full_extra_s=extra, hidden_comm_s=cost.hidden_s)  # fmt: skip

    def option(name: str, layout: Layout, shard: int, kv_shard: int | None = None) -> OpOption:
        kv_shard = shard if kv_shard is None else kv_shard
        if cp > 1:
            return cp_option(name, layout, shard, kv_shard)
        flops = compute.attention_flops(seqs, heads / shard, q_len, kv_len, hd, skips_masked)
        # a per-query-head kernel reads each KV head once per query head (`ClusterSpec.attention_kernel`)
        kv_reads = heads / shard if per_query_head else kv_heads / kv_shard
        moved = compute.attention_bytes(seqs, heads / shard, kv_reads, q_len, kv_len, hd, ctx.dtype)
        # a fused kernel's rate by sequence length and its thread blocks' waves (`DeviceSpec.attention`);
        # not the materialized kind's GEMMs; a decode step's blocks are `decode_attention_time_s`'s
        blocks = (
            compute.attention_blocks(seqs, heads / shard, q_len, hd)
            if w.kind is not Workload.DECODE
            else None
        )
        seq = None if materialized else (q_len, kv_len, skips_masked, blocks)
        call = attention_call(heads / shard, q_len, kv_len, hd, skips_masked)
        core_s = ctx.op_time(flops, moved, "attention", seq=seq, call=call)
        if w.kind is Workload.DECODE and not materialized:
            # a kernel of one block per (sequence, query head) idles most SMs at a few pairs
            # (`DeviceSpec.decode_attention`): a wave's blocks stream at a per-SM rate
            occupancy_s = compute.decode_attention_time_s(seqs, heads / shard, kv_len, hd, ctx.dtype, dev)
            if occupancy_s is not None:
                core_s = max(
                    core_s, occupancy_s + (dev.launch_overhead_s if dev.node_overhead_s is None else 0.0)
                )
        fit = ctx.cluster.device.attention
        fitted = ctx.train and fit is not None and seq is not None
        forward_s = core_s / (1.0 + fit.backward_time_factor) if fitted else core_s / ctx.compute_factor
        if fitted and attn.dropout_p > 0:  # the probabilities' dropout, drawn inside the fused kernel
            core_s *= fit.dropout_time_factor
            forward_s *= fit.dropout_time_factor
        scores = 0.0
        if materialized:  # the (s, s) scores go through memory (`ClusterSpec.attention_kernel`)
            elements = seqs * heads / shard * q_len * kv_len
            fwd_bytes, bwd_bytes = compute.materialized_scores_bytes(elements, ctx.dtype, ctx.train)
            forward_s += fwd_bytes / bandwidth
            core_s += (fwd_bytes + bwd_bytes) / bandwidth
            if ctx.train:  # Korthikanti et al. eq. (2): softmax output, dropout mask and output, 5 a s^2 b
                scores = memory.attention_scores_bytes(q_len, seqs, heads, shard, ctx.dtype)
        t = core_s + inner_s / kv_shard
        extra = max(0.0, forward_s - core_s / ctx.compute_factor) if ctx.train else 0.0
        return OpOption(name, layout, layout, t, kv_cache / kv_shard, stored / shard + scores,
                        selective_bytes=0.0 if cross else scores, selective_s=0.0 if cross else forward_s,
                        full_extra_s=extra)  # fmt: skip

    options, excluded = _core_options(attn, ctx, option)
    if refused:  # Ulysses takes whole heads per cp rank
        options = [o for o in options if o.name not in refused]
        excluded.update(refused)
        if not options:
            raise InputError(next(iter(refused.values())))
    return options, excluded


def _core_options(attn: Attention, ctx: CostContext, option) -> tuple[list[OpOption], dict[str, str]]:
    """The attention core's options, each priced by ``option(name, layout, shard, kv_shard=None)``:
    replicate, and head-parallel where the query and KV heads allow it at the mesh's tp."""
    heads, kv_heads, tp = attn.num_heads, attn.num_kv_heads, ctx.mesh.tp
    options = [option("replicate", R, 1)]
    excluded: dict[str, str] = {}
    if tp == 1:
        return options, excluded
    if heads % tp:
        excluded["head"] = f"{heads} heads not divisible by tp={tp}"
    elif kv_heads % tp == 0:
        options.append(option("head", S, tp))
    elif tp % kv_heads == 0:
        # fewer KV heads than ranks (GQA, gqa_kv_replicated): query heads split; inference keeps one KV
        # head per rank, each replicated on tp / kv_heads ranks (vLLM); training keeps the K/V
        # projections replicated, each rank slicing the KV heads its query heads use
        options.append(option("head", S, tp, kv_shard=1 if ctx.train else kv_heads))
    else:
        excluded["head"] = f"{kv_heads} KV heads (GQA) not divisible by tp={tp}"
    return options, excluded


def cp_kv_heads(attn: Attention, shard: int) -> float:
    """KV heads one rank's attention reads with its query heads split over `shard` TP ranks: a
    `shard`-th of them, at least one (fewer KV heads than ranks: each rank reads the one of its query
    heads, `gqa_kv_replicated`)."""
    return _kv_heads_per_rank(attn.num_kv_heads, shard)


def _kv_heads_per_rank(kv_heads: int, shard: int) -> float:
    """`kv_heads` split over `shard` TP ranks, at least one per rank (fewer than ranks: each reads one)."""
    return max(1.0, kv_heads / shard) if shard > 1 else float(kv_heads)


def ulysses_kv_heads(attn: Attention, shard: int) -> float:
    """KV heads per TP rank that all-to-all (Ulysses) splits over the cp ranks: those K has at the
    attention op (`Attention.core_kv_heads`), which a model that repeats its KV heads to the query heads
    before the op (GQA written out) has more of than its projections make (`cp_kv_heads`): 2 KV heads
    repeated to 4 split over cp=4; its all-to-all then moves those repeated heads, and is priced so."""
    return _kv_heads_per_rank(max(attn.num_kv_heads, attn.core_kv_heads or 0), shard)


def cp_core_cost(attn: Attention, ctx: CostContext, shard: int = 1, cross: bool = False) -> CpAttentionCost:
    """`attn`'s core under `ctx`'s context parallelism (`costmodels.context_parallel.cp_attention_cost`
    with the config's variant and load balancing), its query heads split over `shard` TP ranks: per
    micro-batch on the busiest rank, training forward + backward (the backward at the device's fitted
    ratio, `DeviceSpec.attention`, else twice the forward as `TRAIN_COMPUTE_FACTOR`). A cross-attention
    has no causal mask. Raises ValueError for an all-to-all the heads cannot take (`ulysses_refusal`)."""
    fit = ctx.cluster.device.attention
    backward = 0.0
    if ctx.train:
        backward = fit.backward_time_factor if fit is not None else TRAIN_COMPUTE_FACTOR - 1.0
    shape = CpAttentionShape(
        ctx.sequences_per_micro_batch, attn.num_heads / shard,
        # all-to-all moves the K / V heads the op reads (repeated ones too); the other variants the model's
        ulysses_kv_heads(attn, shard) if ctx.config.cp_comm_type == "alltoall" else cp_kv_heads(attn, shard),
        attn.head_dim,
        ctx.workload.tokens_per_sequence, causal=not cross,
    )  # fmt: skip
    call = cp_attention_call(attn.num_heads / shard, ctx.workload.tokens_per_sequence, attn.head_dim, ctx.cp,
                             ctx.config.cp_comm_type, not cross)  # fmt: skip
    return cp_attention_cost(
        shape, ctx.cp, ctx.config.cp_comm_type, ctx.config.cp_load_balance, ctx.cluster, ctx.cp_group(),
        ctx.dtype, backward, call,
    )  # fmt: skip


def cp_attention_call(
    heads: float, seq_len: float, head_dim: float, cp: int, comm_type: str, causal: bool
) -> tuple:
    """The `attention_call` a CP rank's kernels are timed by on a CPU (`DeviceSpec.attention_time_ratios`):
    the all-to-all's core on its 1 / cp of the ``heads`` over the whole sequence; the ring's and the
    all-gather's diagonal block, ``seq_len`` / cp queries over as many keys (their other blocks are
    taken to run at its rate)."""
    if comm_type == "alltoall":
        return attention_call(heads / cp, seq_len, seq_len, head_dim, causal)
    return attention_call(heads, seq_len / cp, seq_len / cp, head_dim, causal)


def cp_attentions(structure: ModelStructure) -> list[tuple[Attention, bool, int]]:
    """The model's distinct attention shapes (query and KV heads, head dim, cross or self) as
    (an attention of that shape, cross, how many layers have it): what context parallelism prices."""
    out: dict[tuple, list] = {}
    for layer in structure.layers:
        for attn, cross in ((layer.attention, False), (layer.cross_attention, True)):
            if attn is not None:
                key = (attn.num_heads, attn.num_kv_heads, attn.head_dim, cross)
                out.setdefault(key, [attn, cross, 0])[2] += 1
    return [(a, cross, n) for a, cross, n in out.values()]


def cp_core_shard(attn: Attention, ctx: CostContext) -> int:
    """TP ranks the attention core's heads are split over under context parallelism: tp where the
    heads divide (head-parallel), 1 otherwise or where all-to-all cannot split the heads per TP rank
    (only the replicated core takes it, `attention_core_options`)."""
    shard = ctx.mesh.tp if attn.num_heads % ctx.mesh.tp == 0 else 1
    alltoall = ctx.config.cp_comm_type == "alltoall"
    if alltoall and ulysses_refusal(attn.num_heads / shard, ulysses_kv_heads(attn, shard), ctx.cp):
        return 1
    return shard


def cp_buffer_bytes(ctx: CostContext) -> float:
    """Context parallelism's K/V (and gradient) buffers in flight on a rank while one layer's attention
    runs (`CpAttentionCost.buffer_bytes`), the largest of the model's attention shapes with its heads
    split as `cp_core_shard`; 0 without context parallelism."""
    if ctx.cp == 1:
        return 0.0
    sizes = [
        cp_core_cost(a, ctx, cp_core_shard(a, ctx), cross).buffer_bytes
        for a, cross, _ in cp_attentions(ctx.structure)
    ]
    return max(sizes, default=0.0)


def _fused_kv_heads_uncut(attn: Attention, qkv: Projection, tp: int) -> bool:
    """Whether a fused q/k/v projection (parts: q, k, v widths) holds fewer KV heads than `tp`, so its
    column-wise split would cut a KV head (Phi-3 or GPTBigCode with one KV head, Falcon-7B's
    multi-query): the pass splits each part evenly over the ranks and does not keep K/V whole."""
    parts = qkv.parts or ()
    return (
        tp > 1
        and len(parts) == 3
        and attn.head_dim > 0
        and parts[1] == attn.num_kv_heads * attn.head_dim
        and attn.num_kv_heads % tp != 0
    )


def gqa_kv_replicated(attn: Attention, tp: int) -> bool:
    """Whether head-parallel attention of `attn` at `tp` replicates K/V heads: fewer KV heads than ranks
    (tp a multiple of them). Inference: each rank holds one KV head (its K/V projection rows and cache),
    each head replicated on tp / kv ranks, as vLLM does; training: every rank holds all of them and
    slices the heads its query heads use. Priced so and named in the plan."""
    return tp > 1 and attn.num_heads % tp == 0 and attn.num_kv_heads % tp != 0 and tp % attn.num_kv_heads == 0


def elementwise_options(
    width: int,
    num_inputs: int,
    tokens: float,
    ctx: CostContext,
    total_s: float | None = None,
    shardable: bool = True,
) -> list[OpOption]:
    """An activation (GELU) or SwiGLU's silu(gate) * up over (tokens, width): R->R or S->S.

    ``total_s``: the unsharded time of the MLP's ops between its projections, summed node by node
    (``layer_node_times_s``); None prices one elementwise op of 4 FLOP per element. ``shardable``
    False: R->R only (the tensor-parallel pass cannot carry a shard through these ops)."""
    b, tp = ctx.bytes_per_element, ctx.mesh.tp
    stored = num_inputs * tokens * width * b if ctx.train else 0.0

    def option(name: str, layout: Layout, shard: int) -> OpOption:
        numel = tokens * width / shard
        if total_s is not None:
            t = total_s / shard
        else:
            t = ctx.op_time(
                compute.elementwise_flops(numel, 4.0),
                compute.elementwise_bytes(numel, ctx.dtype, num_inputs),
                "memory",
            )
        return OpOption(name, layout, layout, t, 0.0, stored / shard)

    options = [option("replicate", R, 1)]
    if tp > 1 and width % tp == 0 and shardable:
        options.append(option("shard", S, tp))
    return options


# ---------------------------------------------------------------------------------------------
# Layer graphs


def layer_key(layer: Layer) -> str:
    """Layers with the same key have identical shapes and share strategy variables."""
    parts: list[str] = []
    if layer.attention is not None:
        a = layer.attention
        parts.append(f"attn{a.num_heads}/{a.num_kv_heads}/{a.head_dim}")
        parts += [_proj_key(p) for p in a.projections]
    if layer.cross_attention is not None:
        a = layer.cross_attention
        parts.append(f"cross{a.num_heads}/{a.num_kv_heads}/{a.head_dim}")
        parts += [_proj_key(p) for p in a.projections]
    if layer.mlp is not None:
        parts.append("mlp")
        parts += [_proj_key(p) for p in layer.mlp.projections]
    if layer.moe is not None:
        m = layer.moe
        parts.append(f"moe{m.num_experts}/{m.top_k}")
        parts += [f"{w.role}:{w.in_features}x{w.out_features}" for w in m.experts]
    # parameter elements, not bytes: a plan made in one dtype names the same classes as ranks built in another
    parts.append(f"n{layer.num_params}" if layer.num_params else f"p{layer.param_bytes}")
    if layer.frozen_params:  # a fine-tune's frozen weights (`Layer.frozen_params`): trained otherwise
        parts.append(f"frozen{layer.frozen_params}" + ("" if layer.trainable else ",no-backward"))
    return ";".join(parts)


def _proj_key(p: Projection) -> str:
    lora = f"+lora{p.adapter.rank}" if p.adapter is not None else ""
    return f"{p.role}:{p.in_features}x{p.out_features}:{p.bias is not None}:{p.parts}{lora}"


def layer_node_times_s(layer: Layer, ctx: CostContext) -> dict[str, float] | None:
    """Time of a layer's ops other than projections and the attention core, per block of
    ``Layer.node_blocks`` ("attention", "cross", "mlp": unsharded; "stream"; "experts": a mixture of
    experts' routed part but its GEMMs, `expert_gemm_time_s`), or None when the layer was not
    analysed node by node.

    Each node that moves memory is a memory-bound op (``compute.op_time_s(kind="memory")``) on its
    ``ModelStructure.node_costs``: FLOP and bytes read + written, scaled from the captured tokens
    (batch x seq) to ``ctx.tokens`` and from the captured dtype to the planned one. Views move nothing
    and are not priced. The launch overhead is charged once per block, not once per node: compiled
    GPU runs fuse these ops (the gpt-fast decode references of tests/test_golden.py are off by 25-35%
    with one launch per node), and on an eager CPU the launch (~3 us) is small beside the memory time.
    """
    s = ctx.structure
    if not layer.node_blocks or not s.node_costs:
        return None
    scale = graph_token_scale(ctx)
    byte_scale = ctx.bytes_per_element / DTYPE_BYTES[s.dtype]
    launch = ctx.op_time(0.0, 0.0, "memory")
    out = {"attention": 0.0, "cross": 0.0, "mlp": 0.0, "stream": 0.0, "experts": 0.0}
    priced: set[str] = set()
    moe = layer.moe
    by_formula: set[str] = set()
    experts_scale = scale
    if moe is not None and ctx.experts_rewritten:
        # the expert pass replaces the routed computation after the top-k (`MoE.expert_nodes`) with its
        # own: GEMMs grouped on the rows of the rank's share (`expert_gemm_time_s`) and the permutations,
        # activation, weighing and combine of `expert_pass_memory_time_s`; the graph's do not run
        by_formula = set(moe.expert_nodes)
        out["experts"] += expert_pass_memory_time_s(layer, ctx) - launch
        priced.add("experts")
    elif moe is not None:
        experts_scale = graph_experts_scale(moe, ctx)
    for name in layer.nodes:
        block, cost = layer.node_blocks.get(name), s.node_costs.get(name)
        if block not in out or cost is None or name in by_formula:
            continue
        moved = cost.bytes_read + cost.bytes_written
        if moved > 0:
            kind = cost.kind if cost.kind in compute.OP_KINDS else "memory"
            k = experts_scale if block == "experts" else scale
            call = rank_call(cost, s.batch_size * k)
            out[block] += ctx.op_time(cost.flops * k, moved * k * byte_scale, kind, call=call) - launch
            priced.add(block)
    return {block: t + (launch if block in priced else 0.0) for block, t in out.items()}


@dataclass(frozen=True)
class ExpertShare:
    """What the busiest rank of a mixture-of-experts layer's EP group holds and computes per micro-batch
    (`expert_share`; `costmodels.expert_parallel` has the formulas)."""

    local_experts: float  # experts the rank holds: E / ep
    rows: float  # (token, choice) rows its experts compute: the busiest rank's
    touched: float  # experts it holds that some row reaches (their weights are read)
    load: float  # the busiest rank's rows over the mean (`busiest_load_factor`)


def moe_rows_sharded(ctx: CostContext) -> bool:
    """Under sequence parallelism with one sequence per micro-batch, a MoE block's reshape of its (1, T /
    tp, H) input to (T / tp, H) rows keeps each TP rank's sequence shard (no batch to merge, so the TP
    pass gathers nothing): whole experts route only this rank's tokens; split experts (`expert_tp` > 1)
    gather the tokens, their expert ids and weights over TP around the experts and reduce-scatter the
    output back to the shard (`passes.ep_lower`: Megatron-Core's all-gather and reduce-scatter). With
    more sequences the reshape merges batch and sequence and the TP pass gathers the tokens first
    (`moe_sequence_gather_bytes`)."""
    return ctx.sequence_parallel and ctx.sequences_per_micro_batch == 1


def whole_experts_on_shard(moe: MoE, ctx: CostContext) -> bool:
    """Whether whole experts (`CostContext.expert_tp` 1) compute only this TP rank's sequence shard of the
    tokens (`moe_rows_sharded`): with expert parallelism always (`passes.ep_lower` routes the shard);
    without it unless the block's combine adds into a tensor of its own size (`MoE.combine_into_new`:
    the TP pass then gathers the routing's rows, a fallback `passes.verify` prices, and the experts run
    every token). The TP ranks then hold the same experts for other tokens, and each expert weight's
    gradient is reduced over them (`expert_shard_comm_s`)."""
    return moe_rows_sharded(ctx) and ctx.expert_tp == 1 and (ctx.ep > 1 or not moe.combine_into_new)


def moe_tokens(moe: MoE, ctx: CostContext) -> float:
    """Tokens a MoE block routes on one rank per micro-batch: `CostContext.tokens`, or its 1/tp sequence
    shard where whole experts run on it (`whole_experts_on_shard`)."""
    if whole_experts_on_shard(moe, ctx):
        return ctx.tokens / ctx.mesh.tp
    return ctx.tokens


def expert_share(moe: MoE, ctx: CostContext) -> ExpertShare:
    """The busiest EP rank's share of a MoE layer (module `costmodels.expert_parallel`'s table): fold
    dp, f k N rows of the group's (each rank routes its own N = `CostContext.tokens` tokens and the
    ranks exchange them); fold tp, f k N / ep (the TP ranks hold the same tokens); ep 1, every row. The
    experts reached: of the group's tokens (ep N over dp, N over tp), `local_touched_experts`."""
    ep, w = ctx.ep, ctx.workload
    load = busiest_load_factor(w.moe_imbalance, w.moe_capacity_factor, ep)
    tokens = moe_tokens(moe, ctx)
    if ctx.ep_fold == "tp":
        rows, group_tokens = load * moe.top_k * tokens / ep, tokens
    else:
        rows, group_tokens = load * moe.top_k * tokens, ep * tokens
    touched = local_touched_experts(moe.num_experts, moe.top_k, group_tokens, ep)
    return ExpertShare(moe.num_experts / ep, rows, touched, load)


def expert_split(weight: ExpertWeight, expert_tp: int) -> tuple[float, float]:
    """(in, out) features of one expert projection on one rank when each expert is split over
    `expert_tp` TP ranks as a Megatron MLP along its width I: the down projection row-parallel (its
    input I / expert_tp), gate / up / fused gate_up column-parallel (their output / expert_tp)."""
    if weight.role is Role.EXPERT_DOWN:
        return weight.in_features / expert_tp, float(weight.out_features)
    return float(weight.in_features), weight.out_features / expert_tp


def expert_gemm_shapes(weight: ExpertWeight, expert_tp: int) -> list[tuple[float, float]]:
    """(in, out) features of each GEMM the expert pass runs for one expert projection on one rank: its
    `expert_split`, a fused gate-and-up weight (`ExpertWeight.parts`) as its two parts, which the pass
    slices and runs apart (`passes.ep_lower`: gate and up, each I / expert_tp wide)."""
    if weight.parts and weight.role is not Role.EXPERT_DOWN:
        return [(float(weight.in_features), part / expert_tp) for part in weight.parts]
    return [expert_split(weight, expert_tp)]


def expert_gemm_time_s(layer: Layer, ctx: CostContext) -> float:
    """Time of a mixture-of-experts layer's routed expert GEMMs (`Layer.moe`; 0 for a dense layer) on
    the busiest rank of its EP group (every rank without expert parallelism). With `expert_tp` 1 the
    experts stay whole under tensor parallelism, replicated over the TP ranks with EP folded over dp x
    cp; with expert_tp = tp each rank computes every expert GEMM on its rows at the split width
    (`expert_split`: 1/tp of the FLOP and of the weights read, at that shape's GEMM efficiency).

    Each expert projection is a matmul of the rank's rows (`expert_share`: f k N, or f k N / ep over
    TP) and 2 x rows x in x out FLOP, at the GEMM efficiency of the rows per expert reached (small
    GEMMs run slow), reading the weights of the experts it holds that some row reached (all of them at
    large N; a few at decode, when the step is bound by memory bandwidth) and its rows in and out: what
    the expert pass runs, one grouped GEMM per projection (`passes.expert_parallel`). 0 where the pass
    leaves the experts as the model wrote them (`CostContext.experts_rewritten` false: ep 1, experts
    whole): the graph's own GEMMs then run (HF batched_mm's weight copy per token, Llama 4's every
    expert on every token, a ModuleList's capacity slots) and `layer_node_times_s` prices them."""
    moe = layer.moe
    if moe is None or not ctx.experts_rewritten:  # the graph's own experts: `layer_node_times_s`
        return 0.0
    share = expert_share(moe, ctx)
    b, etp = ctx.bytes_per_element, ctx.expert_tp
    per_expert = share.rows / max(1.0, share.touched)
    total = 0.0
    for w in moe.experts:
        gemms = expert_gemm_shapes(w, etp)
        width = sum(n for _, n in gemms)
        for k, n in gemms:  # a fused weight's part reads its share of the weight, and the rows again
            flops = 2.0 * share.rows * k * n
            moved = (share.touched * w.params_per_expert / etp * n / width + share.rows * (k + n)) * b
            total += ctx.op_time(flops, moved, "matmul", rows=per_expert, shape=(k, n))
    return total


def expert_pass_bytes(layer: Layer, ctx: CostContext) -> float:
    """Bytes the expert pass's memory-bound ops move in one forward of a mixture-of-experts layer on the
    busiest rank (`passes.expert_parallel.ep_moe`; 0 for a dense layer), b bytes an element, C the
    hidden width, I the expert width on the rank, N the tokens routed (`moe_tokens`), S = k N the rows
    it gathers and sends (with EP over the TP ranks, `ep_moe_replicated`, only its experts' rows: S = R)
    and R the rows its experts compute (`expert_share`):

    - S rows: the gather of each choice's token (read and write S C), the weighing of the returned
      rows (read and write S C) and the scatter-add into the tokens (read S C): 5 S C;
    - R rows: sorting the received rows by expert, their concatenation after the experts and the
      return to the received order (read and write R C each): 6 R C; the SiLU of the gate (read and
      write R I) and its product with up (two reads, one write): 5 R I;
    - the combined (N, C) output: zeroed, then read and written by the scatter-add: 3 N C;

    plus the int64 sorts and indices (8 bytes: the sort of the S choices and of the R rows, three
    reads or writes each). Measured: tiny Mixtral (C 64, I 128, 4 experts, top 2) at EP 2 over dp, 4,096
    tokens a rank, fp32: these ops took 4.9 ms of a 16.5 ms forward of one block on this project's
    2-core VM (2026-12), the gathers by index at about half the streaming rate; the graph's own nodes
    these replace priced 1.8 ms."""
    moe = layer.moe
    if moe is None:
        return 0.0
    share = expert_share(moe, ctx)
    down = next((w for w in moe.experts if w.role is Role.EXPERT_DOWN), moe.experts[-1])
    width, hidden = expert_split(down, ctx.expert_tp)  # I (/ expert_tp) in, C out
    tokens = moe_tokens(moe, ctx)
    rows = share.rows
    # EP over the TP ranks (`ep_moe_replicated`): each rank gathers only its own experts' rows
    sent = rows if ctx.ep > 1 and ctx.ep_fold == "tp" else moe.top_k * tokens
    elements = 5 * sent * hidden + 6 * rows * hidden + 5 * rows * width + 3 * tokens * hidden
    return elements * ctx.bytes_per_element + 3 * 8 * (sent + rows)


def expert_pass_memory_time_s(layer: Layer, ctx: CostContext) -> float:
    """Time of the expert pass's memory-bound ops in a mixture-of-experts layer (`expert_pass_bytes`, a
    memory-bound op at the device's bandwidth; training with their backward)."""
    return ctx.op_time(0.0, expert_pass_bytes(layer, ctx), "memory")


def expert_tp_reduce_s(layer: Layer, ctx: CostContext) -> float:
    """Seconds of the all-reduce over the TP ranks that expert tensor parallelism adds to a MoE layer
    per micro-batch (`CostContext.expert_tp` > 1; else 0): the experts' partial outputs, tokens x H x
    bytes, summed once after the combine, and in training once more for the input gradient; one more
    graph node. Where the block's rows are a sequence shard (`moe_rows_sharded`) the outputs are
    reduce-scattered back to it instead (the backward all-gathers), unless the model's combine adds them
    into a tensor created at its own size (`MoE.combine_into_new`), whose sum `passes.ep_lower` all-reduces."""
    moe = layer.moe
    if moe is None or ctx.expert_tp == 1:
        return 0.0
    nbytes = ctx.tokens * moe.hidden_size * ctx.bytes_per_element
    # reduce-scattered back to a sequence shard (backward: all-gathered), else all-reduced: also where
    # the model's combine adds into a tensor of its own size, which the TP pass keeps whole
    shard = moe_rows_sharded(ctx) and not moe.combine_into_new
    reduce = reduce_scatter_time_s if shard else all_reduce_time_s
    return ctx.comm_factor * reduce(nbytes, ctx.tp_group(), ctx.cluster) + ctx.node_overhead_time(1)


def expert_shard_comm_s(layer: Layer, ctx: CostContext) -> float:
    """Seconds per micro-batch of what whole experts on a sequence shard add (`whole_experts_on_shard`;
    else 0). Each TP rank's expert gradients sum only its own tokens: without expert parallelism the
    TP pass enters the expert weights through `tp_copy`, so in training they are all-reduced over the
    TP ranks at every micro-batch (one node per expert weight); with it they are reduced once a step
    with the data-parallel gradients, over the TP ranks too (`CostContext.experts_on_sequence_shard`,
    priced there). Under expert parallelism, where the model's combine was whole
    (`MoE.combine_into_new`), the forward all-gather of the experts' (tokens, H) output over the TP
    ranks (its backward keeps the local rows)."""
    moe = layer.moe
    if moe is None or not whole_experts_on_shard(moe, ctx):
        return 0.0
    total = 0.0
    if ctx.train and ctx.ep == 1:
        total += all_reduce_time_s(expert_param_bytes(layer, ctx), ctx.tp_group(), ctx.cluster)
        total += ctx.node_overhead_time(len(moe.experts))
    if ctx.ep > 1 and moe.combine_into_new:
        nbytes = ctx.tokens * moe.hidden_size * ctx.bytes_per_element
        total += all_gather_time_s(nbytes, ctx.tp_group(), ctx.cluster) + ctx.node_overhead_time(1)
    return total


def expert_comm_time_s(layer: Layer, ctx: CostContext) -> float:
    """Exposed communication of a MoE layer's expert parallelism per micro-batch on one rank (0 for a
    dense layer or ep 1): fold dp, the counts, dispatch and combine all-to-alls over the EP group
    (`costmodels.expert_parallel.all_to_all_exchange_s`, the busiest rank's load of bytes); fold tp,
    one all-reduce of the layer's N x H output over the TP ranks (and one of the input gradient in
    training). Each collective is one more graph node. With expert tensor parallelism the TP
    all-reduce of the experts' partial outputs is added (`expert_tp_reduce_s`); with whole experts on a
    sequence shard, their gradients' all-reduce over TP (`expert_shard_comm_s`)."""
    moe = layer.moe
    if moe is None:
        return 0.0
    if ctx.ep == 1:
        return expert_tp_reduce_s(layer, ctx) + expert_shard_comm_s(layer, ctx)
    if ctx.ep_fold == "tp":
        nbytes = ctx.tokens * moe.hidden_size * ctx.bytes_per_element
        return ctx.comm_factor * all_reduce_time_s(
            nbytes, ctx.tp_group(), ctx.cluster
        ) + ctx.node_overhead_time(1)
    share = expert_share(moe, ctx)
    data = dispatch_bytes(moe.top_k, moe_tokens(moe, ctx), moe.hidden_size, ctx.bytes_per_element, share.load)
    exchange = all_to_all_exchange_s(data, moe.num_experts, ctx.ep_group(), ctx.cluster, ctx.train)
    return (
        exchange
        + ctx.node_overhead_time(3)
        + expert_tp_reduce_s(layer, ctx)
        + expert_shard_comm_s(layer, ctx)
    )


def moe_sequence_gather_bytes(layer: Layer, ctx: CostContext) -> float:
    """Under sequence parallelism, the full size in bytes of a mixture-of-experts block's input per
    micro-batch, tokens x H, which the TP pass all-gathers from the sequence shards where the block merges
    batch and sequence before its router (`passes.tensor_parallel`: a reshape merging B and T needs the
    whole sequence), so every TP rank routes all the tokens (`passes.ep_lower`); the router, the routed
    experts and the combine then run on all of them, and the output goes back to this rank's sequence
    shard by a slice. With one sequence per micro-batch (`moe_rows_sharded`): 0 for whole experts, which
    route the shard's tokens; for split experts the tokens with their top-k expert ids (int64) and
    weights, which `passes.ep_lower` gathers. 0 for a dense layer or without sequence parallelism."""
    moe = layer.moe
    if moe is None or not ctx.sequence_parallel:
        return 0.0
    if moe_rows_sharded(ctx):  # whole experts: nothing gathered; split: the rows, their ids and weights
        if ctx.expert_tp == 1:
            return 0.0
        return ctx.tokens * (
            moe.hidden_size * ctx.bytes_per_element + moe.top_k * (8 + ctx.bytes_per_element)
        )
    return ctx.tokens * moe.hidden_size * ctx.bytes_per_element


def moe_sequence_gather_s(layer: Layer, ctx: CostContext) -> float:
    """Seconds per micro-batch of the all-gather of `moe_sequence_gather_bytes` over the TP ranks, and in
    training of its backward reduce-scatter (one more graph node each way); 0 where there is none."""
    nbytes = moe_sequence_gather_bytes(layer, ctx)
    if not nbytes:
        return 0.0
    return ctx.comm_factor * all_gather_time_s(nbytes, ctx.tp_group(), ctx.cluster) + ctx.node_overhead_time(
        1
    )


def expert_param_bytes(layer: Layer, ctx: CostContext) -> float:
    """Bytes of the routed experts' weights one rank holds, in the planned dtype: E / ep experts' (the
    whole of each with `CostContext.expert_tp` 1; 1 / expert_tp of each when split over TP)."""
    moe = layer.moe
    if moe is None:
        return 0.0
    return moe.expert_params / (ctx.ep * ctx.expert_tp) * ctx.bytes_per_element


def expert_activation_bytes(layer: Layer, ctx: CostContext) -> float:
    """Training: bytes a mixture-of-experts layer's routed experts keep for backward on the busiest
    rank, `expert_share`'s rows of each (0 for a dense layer). The expert pass runs bias-free SwiGLU
    experts (`passes.expert_parallel`), and per row autograd keeps: the row's input (C, read by gate and
    up alike), the gate and up outputs, the SiLU of the gate and their product (the down projection's
    input), 4 x I / `CostContext.expert_tp` (`expert_split`), and the expert's output (C), which the
    weighing by the routing weight keeps (with Llama 4's input scale, the combine gathers by token and
    keeps none, but the scaled input's multiply keeps the unscaled row instead). The dispatch's gathers
    and all-to-alls and the scatter-add combine keep only int64 indices.

    Measured: tiny Mixtral (C 64, I 128) at EP 2 over dp, 8,192 rows a rank: 4 x 4 MiB of I-wide rows
    and 2 x 2 MiB of C-wide rows a layer alive at the heap's peak (2026-12)."""
    moe = layer.moe
    if moe is None or not ctx.train:
        return 0.0
    if not ctx.experts_rewritten:
        return graph_expert_activation_bytes(layer, ctx)
    rows = expert_share(moe, ctx).rows
    down = next((w for w in moe.experts if w.role is Role.EXPERT_DOWN), moe.experts[-1])
    width, out = expert_split(down, ctx.expert_tp)  # I (/ expert_tp) in, C out
    per_row = moe.experts[0].in_features + 4 * width + out
    return rows * per_row * ctx.bytes_per_element


def graph_token_scale(ctx: CostContext) -> float:
    """A captured node's tokens to a rank's micro-batch (`CostContext.tokens` over the capture's batch x
    sequence): what its node-by-node prices are scaled by."""
    s = ctx.structure
    return ctx.tokens / max(1, s.batch_size * s.seq_len)


def graph_experts_scale(moe: MoE, ctx: CostContext) -> float:
    """`graph_token_scale` for the nodes of experts that run as the model's graph computes them: over
    tp more where they route only this TP rank's sequence shard (`whole_experts_on_shard`)."""
    scale = graph_token_scale(ctx)
    return scale / ctx.mesh.tp if whole_experts_on_shard(moe, ctx) else scale


def graph_expert_node_bytes(layer: Layer, ctx: CostContext) -> list[float]:
    """Per expert GEMM node of a MoE layer whose experts run as the model's graph computes them
    (`CostContext.experts_rewritten` false), the bytes of its operands and output (`NodeCost` bytes read
    and written) less the expert parameters it reads directly, which are weights: a gathered weight
    copy (HF batched_mm's `gate_up_proj[expert_ids]`, gpt-fast's `w1[expert_indices]`: one expert
    matrix per token and choice) is counted. Scaled from the captured tokens and dtype to the rank's,
    as `layer_node_times_s` scales the nodes' times; [] for a dense layer."""
    moe, s = layer.moe, ctx.structure
    if moe is None or not s.node_costs:
        return []
    scale = graph_experts_scale(moe, ctx)
    captured = DTYPE_BYTES[s.dtype]
    found = []
    for w in moe.experts:
        # a stacked weight read by its GEMM itself (no gather by expert ids: Llama 4's bmm over all
        # experts) is read whole; a ModuleList's linear reads its own expert's matrix
        direct = (
            0.0 if moe.weight_gather_nodes else w.params_per_expert * (moe.num_experts if w.stacked else 1)
        )
        for name in w.nodes:
            cost = s.node_costs.get(name)
            if cost is not None:
                moved = cost.bytes_read + cost.bytes_written - direct * captured
                found.append(max(0.0, moved) * scale / captured * ctx.bytes_per_element)
    return found


def graph_expert_activation_bytes(layer: Layer, ctx: CostContext) -> float:
    """Training: bytes the routed experts of a MoE layer keep for backward where they run as the
    model's graph computes them: every expert GEMM node's operands and output, gathered weight copies
    included, which autograd keeps (`graph_expert_node_bytes`)."""
    return sum(graph_expert_node_bytes(layer, ctx))


def graph_expert_working_bytes(ctx: CostContext) -> float:
    """Inference (a forward, a prefill, a decode step): the largest expert GEMM's operands and output
    where the experts run as the model's graph computes them (`graph_expert_node_bytes`), alive for a
    moment with nothing kept after it: HF batched_mm's prefill of 2,048 tokens at top-8 gathers 16,384
    copies of an OLMoE expert's gate and up matrices (8 MiB each in bf16), 128 GiB at once. 0 where the
    expert pass rewrites the experts (grouped GEMMs on the weights as they are) or the model has none."""
    if ctx.experts_rewritten:
        return 0.0
    return max(
        (b for layer in ctx.structure.layers for b in graph_expert_node_bytes(layer, ctx)), default=0.0
    )


def expert_grad_weight(ctx: CostContext) -> float:
    """The ILP's weight of a byte of expert gradients against a dense one (`LayerGraph.expert_grad_bytes`):
    the slope of the experts' gradient sync and optimizer step over the edp group
    (`gradient_sync_cost` of `experts_context`) over the dense one's; 1 when they are not separate."""
    if not ctx.train or ctx.ep == 1 or ctx.ep_fold != "dp":
        return 1.0
    dense = gradient_sync_cost(ctx).beta_s_per_byte
    return gradient_sync_cost(ctx.experts_context()).beta_s_per_byte / dense if dense > 0 else 1.0


def experts_not_swiglu(structure: ModelStructure) -> str:
    """Why the expert-parallel rewrite (`passes.ep_lower`), which runs bias-free SwiGLU experts weighed by
    the routing weights, would compute something else for the first MoE block where it would: experts
    with no SiLU, or `MoE.not_lowerable` (biases, other ops); "" when every block's experts are plain
    SwiGLU MLPs."""
    for layer in structure.layers:
        moe = layer.moe
        if moe is None:
            continue
        ops = [structure.node_costs[n].op for n in moe.expert_nodes if n in structure.node_costs]
        if ops and "aten.silu" not in ops:
            # the op and model line that stands where SiLU would (`MoE.not_lowerable` names them), if any
            found = moe.not_lowerable.removeprefix("the experts compute ")
            what = (
                f"they compute {found}"
                if found != moe.not_lowerable
                else "no SiLU between their gate and down projections"
            )
            return (
                f"the experts of {moe.module_path} are not SwiGLU MLPs ({what}), and the expert-parallel "
                "rewrite (`passes.ep_lower`) runs SwiGLU experts only"
            )
        if moe.not_lowerable:
            return (
                f"{moe.not_lowerable} in {moe.module_path}, which the expert-parallel rewrite (`passes.ep_lower`: "
                "bias-free SwiGLU experts weighed by the routing weights) would not compute"
            )
    return ""


def experts_lowerable(s: ModelStructure) -> bool:
    """The model has routed experts the expert pass can split (`passes.ep_lower`): SwiGLU experts
    without a token capacity (its dispatch is dropless; `_check_pinned_ep` says why otherwise)."""
    return bool(expert_counts(s)) and not s.token_capacity and not experts_not_swiglu(s)


def build_layer_graph(layer: Layer, ctx: CostContext) -> LayerGraph:
    """The op graph of one transformer layer: attention block, a decoder's cross-attention block
    (`Layer.cross_attention`: ops "cross.q", ..., "cross.o", block "cross"), then MLP block.

    The ops other than projections and the attention core are priced node by node when the layer
    was analysed from a graph (``layer_node_times_s``): those of the attention block go with the core
    (split by heads), those of the MLP with its activation op (split by width), the rest (norms,
    residual adds) in ``fixed_compute_s``. Otherwise by formula: one norm and one residual add per
    block, one elementwise op per activation.
    """
    if ctx.train and not layer.trainable:  # no gradient reaches it and none is taken: forward only
        return _frozen_graph(build_layer_graph(layer, ctx.forward_only()))
    s = ctx.structure
    tokens, b = ctx.tokens, ctx.bytes_per_element
    ops: list[Op] = []
    outputs: dict[str, str] = {}
    proj_bytes = frozen_proj_bytes = 0.0
    times = layer_node_times_s(layer, ctx)
    if layer.attention is not None:
        inner = times["attention"] if times else 0.0
        head_ok = layer_key(layer) not in s.replicated_attention_classes
        gathers = s.replicated_attention_reasons.get(layer_key(layer), "")
        outputs["attention"] = _attention_ops(
            layer.attention, tokens, ctx, ops, inner, head_ok=head_ok, gathers=gathers
        )
        proj_bytes += sum(_param_bytes(p, b) for p in layer.attention.projections)
        frozen_proj_bytes += sum(_frozen_param_bytes(p, ctx) for p in layer.attention.projections)
    if layer.cross_attention is not None:
        inner = times["cross"] if times else 0.0
        head_ok = layer_key(layer) not in s.replicated_attention_classes
        gathers = s.replicated_attention_reasons.get(layer_key(layer), "")
        _attention_ops(
            layer.cross_attention, tokens, ctx, ops, inner, head_ok=head_ok, block="cross", gathers=gathers
        )
        proj_bytes += sum(_param_bytes(p, b) for p in layer.cross_attention.projections)
        frozen_proj_bytes += sum(_frozen_param_bytes(p, ctx) for p in layer.cross_attention.projections)
    if layer.mlp is not None:
        inner = times["mlp"] if times else None
        # no MLP width shard where the pass gathers inside, or where its projections are kept whole
        shardable = layer_key(layer) not in s.replicated_mlp_classes and not any(
            p.weight in s.whole_weights for p in layer.mlp.projections
        )
        outputs["mlp"] = _mlp_ops(layer.mlp.projections, tokens, ctx, ops, "mlp", inner, shardable=shardable)
        proj_bytes += sum(_param_bytes(p, b) for p in layer.mlp.projections)
        frozen_proj_bytes += sum(_frozen_param_bytes(p, ctx) for p in layer.mlp.projections)
    hidden = s.hidden_size
    num_norms = len(outputs) + (layer.cross_attention is not None)
    experts_s = (times["experts"] if times is not None else 0.0) + expert_gemm_time_s(layer, ctx)
    if times is not None:
        fixed = times["stream"]
    else:
        fixed = num_norms * ctx.op_time(
            compute.norm_flops(tokens, hidden, NORM_KIND) + compute.elementwise_flops(tokens * hidden),
            compute.norm_bytes(tokens, hidden, ctx.dtype, NORM_KIND)
            + compute.elementwise_bytes(tokens * hidden, ctx.dtype, 2),
            "memory",
        )
    split = ctx.mesh.tp if ctx.sequence_parallel else 1  # norms and residual adds on a sequence shard
    # a mixture of experts' routed part runs whole on every TP rank (split over them with expert_tp),
    # on the rows of its EP share (`expert_gemm_time_s`), its token exchange exposed (`expert_comm_time_s`)
    fixed = fixed / split + experts_s + ctx.node_overhead_time(graph_node_count(layer.nodes, s))
    # param_bytes is in the captured model's dtype; re-express it in the planned dtype.
    as_planned = layer.param_bytes / DTYPE_BYTES[s.dtype] * b
    other_params = max(0.0, as_planned - proj_bytes)
    # the frozen ones among them (norms, a router, experts of a frozen layer): weights only
    frozen = min(other_params, max(0.0, layer.frozen_params * b - frozen_proj_bytes)) if ctx.train else 0.0
    other_params -= frozen
    # each norm keeps its input and output; one computing in fp32 on a 16-bit stream keeps its fp32
    # copy of the input instead (`Layer.norm_upcasts`)
    upcast = min(layer.norm_upcasts, num_norms) * max(0.0, DTYPE_BYTES["fp32"] - b)
    fixed_act = (2.0 * num_norms * b + upcast) * tokens * hidden / split if ctx.train else 0.0
    fixed_act += expert_activation_bytes(layer, ctx)
    # the MoE block's gathered input, kept whole for the router's backward where the stream keeps 1/tp
    fixed_act += moe_sequence_gather_bytes(layer, ctx) * (1 - 1 / split) if ctx.train else 0.0
    static, grads, expert_grads, expert_static = other_params * ctx.state_factor(), other_params, 0.0, 0.0
    # the rank holds E / ep experts, each 1 / expert_tp of one (`expert_param_bytes`)
    if (ctx.ep > 1 or ctx.expert_tp > 1) and layer.moe is not None:
        local = expert_param_bytes(layer, ctx)
        dense = max(0.0, other_params - layer.moe.expert_params * b)
        if ctx.ep_fold == "dp":  # reduced and sharded over the edp group (`CostContext.experts_context`)
            expert_static = local * ctx.experts_context().state_factor()
            static = dense * ctx.state_factor() + expert_static
            grads, expert_grads = dense, local
        else:  # replicated over dp x cp as the dense weights are
            static, grads = (dense + local) * ctx.state_factor(), dense + local
    _shared_inputs_once(ops)
    return LayerGraph(
        key=layer_key(layer),
        ops=ops,
        block_outputs=outputs,
        fixed_compute_s=fixed,
        fixed_static_bytes=static + frozen,
        frozen_static_bytes=frozen,
        fixed_activation_bytes=fixed_act,
        fixed_grad_bytes=grads if ctx.train else 0.0,
        fixed_comm_s=expert_comm_time_s(layer, ctx) + moe_sequence_gather_s(layer, ctx),
        expert_grad_bytes=expert_grads if ctx.train else 0.0,
        expert_static_bytes=expert_static,
        dispatch_s=ctx.host_dispatch_time(graph_node_count(layer.nodes, s)),
        forward_dispatch_s=ctx.host_dispatch_time(graph_node_count(layer.nodes, s), backward=False),
    )


def _shared_inputs_once(ops: list[Op]) -> None:
    """Count once, in place, the input that projections of one block read (the same fx node,
    `Projection.input`: a self-attention's q / k / v, a gated MLP's gate / up): autograd keeps one
    tensor for all their weight gradients (under sequence parallelism one sequence shard:
    `passes.tp_overlap.apply_sequence_regather` fuses the block's column-parallel entry), so the
    first of them carries it and the others' options drop their `OpOption.input_bytes`. Exact when the
    siblings take options of one kind (all column-parallel, all replicated: the plans the ILP chooses
    here). Projections without a known input (not analysed from a graph) each keep theirs."""
    seen: set[tuple[str, str]] = set()
    for op in ops:
        source = op.projection.input if op.projection is not None else None
        if source is None:
            continue
        if (op.block, source) not in seen:
            seen.add((op.block, source))
            continue
        for option in op.options:
            option.activation_bytes -= option.input_bytes
            option.input_bytes = 0.0


def _frozen_graph(graph: LayerGraph) -> LayerGraph:
    """``graph``, built for a forward pass, as a training step holds it when no gradient reaches its
    layer and it has no trainable parameter: every static byte is a frozen weight's."""
    for op in graph.ops:
        for option in op.options:
            option.frozen_bytes = option.static_bytes
    graph.frozen_static_bytes = graph.fixed_static_bytes
    graph.backward = False
    return graph


def build_chain_graph(projections: list[Projection], ctx: CostContext) -> LayerGraph:
    """A plain MLP (no transformer layers): linears with an activation between consecutive ones.

    When the model was analysed node by node, its activations are graph nodes outside any layer and
    `outside_nodes_time_s` prices them (in the ends graph): the activation ops here then cost 0."""
    ops: list[Op] = []
    last = _mlp_ops(projections, ctx.tokens, ctx, ops, "mlp", chain=True)
    if ctx.structure.node_costs:
        for op in ops:
            if op.projection is None:
                for option in op.options:
                    option.compute_s = 0.0
    # the chain's nodes lie outside any layer: the host's issue time of all of them is the chain's floor
    dispatch = ctx.host_dispatch_time(len(_outside_nodes(ctx))) if ctx.structure.node_costs else 0.0
    return LayerGraph("chain", ops, {"mlp": last}, 0.0, 0.0, 0.0, dispatch_s=dispatch)


def graph_node_count(names: list[str], structure: ModelStructure) -> int:
    """Nodes among ``names`` that a GraphModule executes as op calls (views included; placeholders,
    weights and tuple indexing not): each costs the device's per-node overhead."""
    costs = structure.node_costs
    return sum(1 for n in names if n in costs and costs[n].kind != "none")


def graph_roofline_s(structure: ModelStructure, cluster: ClusterSpec) -> float:
    """Roofline seconds of every node of `structure`'s graph on one device of `cluster`, in the
    captured dtype, without per-node or launch terms: each node by its `NodeCost` (FLOP, bytes, kind;
    a matmul's rows its output's leading dimensions). What the cost model prices for a graph's ops
    beside `graph_node_count` x the per-node overhead (`planner calibrate` subtracts it from a probe
    graph's time to measure that overhead)."""
    total = 0.0
    for cost in structure.node_costs.values():
        kind = cost.kind if cost.kind in compute.OP_KINDS else "memory"
        moved = cost.bytes_read + cost.bytes_written
        if cost.kind == "none" or (moved <= 0 and cost.flops <= 0):
            continue
        rows = math.prod(cost.shape[:-1]) if kind == "matmul" and len(cost.shape) >= 2 else None
        total += compute.op_time_s(
            cost.flops, moved, cluster.device, structure.dtype, kind, rows=rows, launch=False
        )
    return total


def _in_layer_module(module_path: str, layer_paths: set[str]) -> bool:
    """Whether a node's module lies inside one of the layers' modules (its layer prices it)."""
    parts = module_path.split(".")
    return any(".".join(parts[:k]) in layer_paths for k in range(1, len(parts) + 1))


def outside_nodes_time_s(ctx: CostContext, before_layers: bool | None = None) -> float:
    """Time of every graph node outside the transformer layers, on one rank per micro-batch: the
    per-node overhead of each, plus a roofline time (by its `NodeCost.kind`, scaled to the planned
    tokens and dtype as in `layer_node_times_s`) for those no op of the ends / chain graphs prices
    already (embeddings, the LM head and the chain projections are ops with their own options): final
    norm, RoPE tables, masks, convolutions, pooling, activations between chain projections, ...

    ``before_layers``: True, only the nodes before the first layer's first op (what a pipeline's
    first stage computes: an HF Llama's position ids, causal mask and RoPE tables, 43 nodes); False,
    only the others (after it: the final norm, ..., on the last stage); None, all of them."""
    s = ctx.structure
    outside = [*s.mlp_chain, *([s.lm_head] if s.lm_head is not None else [])]
    as_ops = {e.node for e in s.embeddings} | {p.node for p in outside}
    as_ops |= {n for p in outside if p.adapter is not None for n in p.adapter.nodes}  # priced in its options
    scale = graph_token_scale(ctx)
    byte_scale = ctx.bytes_per_element / DTYPE_BYTES[s.dtype]
    total = 0.0
    nodes = _outside_nodes(ctx, before_layers)
    for name, cost in nodes:
        if name in as_ops or cost.kind not in compute.OP_KINDS:
            continue
        moved = (cost.bytes_read + cost.bytes_written) * scale * byte_scale
        if moved > 0 or cost.flops > 0:
            total += ctx.op_time(
                cost.flops * scale, moved, cost.kind, call=rank_call(cost, s.batch_size * scale)
            )
    return total + ctx.node_overhead_time(len(nodes))


def _outside_nodes(ctx: CostContext, before_layers: bool | None = None) -> list[tuple[str, NodeCost]]:
    """The executed graph nodes outside the transformer layers, in graph order (`outside_nodes_time_s`
    says which: ``before_layers`` True, those before the first layer's first op; False, the others;
    None, all)."""
    s = ctx.structure
    inside = {name for layer in s.layers for name in layer.nodes}
    paths = {layer.module_path for layer in s.layers}
    first_layer = set(s.layers[0].nodes) if s.layers else set()
    out, before = [], True
    for name, cost in s.node_costs.items():  # in graph order
        if name in first_layer and cost.kind != "none":
            before = False
        if name in inside or cost.kind == "none" or _in_layer_module(cost.module_path, paths):
            continue
        if before_layers is not None and before != before_layers:
            continue
        out.append((name, cost))
    return out


def rank_call(cost: NodeCost, batch: float) -> tuple | None:
    """The key of a node's timed ratio (`NodeCost.call`): a convolution's call at the ``batch`` one
    rank runs it with (a DP or micro-batch share of the captured batch), an activation's as it is (its
    ratio holds at any size); None for other ops."""
    if cost.call is None or cost.kind != "conv":
        return cost.call
    return conv_call_at_batch(cost.call, max(1, round(batch)))


def _param_bytes(p: Projection, b: int) -> float:
    """Bytes of a projection's weight and bias, and its LoRA adapter's weights (`Projection.adapter`)."""
    adapter = p.adapter.param_elements() if p.adapter is not None else 0
    return (p.in_features * p.out_features + (p.out_features if p.bias is not None else 0) + adapter) * b


def _frozen_param_bytes(p: Projection, ctx: CostContext) -> float:
    """Of `_param_bytes`, the frozen weights' (`CostContext.frozen`): the projection's with its bias,
    its adapter's each on its own."""
    b = ctx.bytes_per_element
    frozen = _param_bytes(dataclasses.replace(p, adapter=None), b) if ctx.frozen(p.weight) else 0.0
    if p.adapter is not None:
        frozen += sum(
            q.in_features * q.out_features * b for q in (p.adapter.down, p.adapter.up) if ctx.frozen(q.weight)
        )
    return frozen


def _proj_op(
    name: str,
    block: str,
    p: Projection,
    inputs: list[str],
    tokens: float,
    ctx: CostContext,
    pieces: int | None = None,
) -> Op:
    options, excluded = projection_options(p, tokens, ctx, pieces)
    out_bytes = tokens * p.out_features * ctx.bytes_per_element
    return Op(name, block, options, inputs, out_bytes, p.weight, p, excluded)


def _attention_ops(
    attn: Attention,
    tokens: float,
    ctx: CostContext,
    ops: list[Op],
    inner_s: float = 0.0,
    head_ok: bool = True,
    block: str = "attention",
    gathers: str = "",
) -> str:
    """The attention block's ops (q/k/v or qkv, core, o); ``head_ok`` False: the core is replicated
    only (`ModelStructure.replicated_attention_classes`: the TP pass gathers inside it; ``gathers``
    names the ops it gathered at and their lines, `ModelStructure.replicated_attention_reasons`,
    for the exclusion's reason). Returns the
    last op's name. ``block`` "cross": a decoder's cross-attention, its ops named "cross.q", ...,
    "cross.o"; its k / v read the encoder's output (replicated, as the stream), and the return of
    its o to the residual stream is priced in that op (`OpOption.comm_s`, always exposed), the
    block's output in `LayerGraph.block_outputs` being attention's and the MLP's."""
    prefix = "cross." if block == "cross" else ""
    by_role = {p.role: p for p in attn.projections}
    core_inputs = []
    query_splits = False  # a query projection split column-wise: the one way a head shard reaches the core
    fused_reason = ""  # why a fused q/k/v projection is not split column-wise (`_fused_kv_heads_uncut`)
    for role in (Role.QKV, Role.Q, Role.K, Role.V):
        if role in by_role:
            grouped = role in (Role.K, Role.V) and gqa_kv_replicated(attn, ctx.mesh.tp)
            pieces = attn.num_kv_heads if grouped and not ctx.train else None
            op = _proj_op(prefix + role.value, block, by_role[role], [""], tokens, ctx, pieces)
            if grouped and ctx.train:
                op.options = [o for o in op.options if o.name != "colwise"]
                op.excluded["colwise"] = (
                    f"{attn.num_kv_heads} KV heads < tp={ctx.mesh.tp} in training: a KV head is not cut, so K/V "
                    "are whole on every rank (replicated, or row-parallel and all-reduced), each rank slicing "
                    "the KV heads of its query heads"
                )
            if role is Role.QKV and _fused_kv_heads_uncut(attn, by_role[role], ctx.mesh.tp):
                op.options = [o for o in op.options if o.name != "colwise"]
                fused_reason = op.excluded["colwise"] = (
                    f"its K and V parts hold {attn.num_kv_heads} KV head(s) of {attn.head_dim}, fewer than "
                    f"tp={ctx.mesh.tp}: cut column-wise a rank would hold part of a head. A fused q/k/v projection "
                    "is not split with its K/V parts kept whole on every rank (as vLLM's QKVParallelLinear keeps "
                    "them): write the query projection apart from the key/value one to split the queries, or "
                    + (
                        f"plan with --tp {attn.num_kv_heads}"
                        if attn.num_kv_heads > 1
                        else "plan without TP (--tp 1)"
                    )
                )
            ops.append(op)
            core_inputs.append(prefix + role.value)
            if role in (Role.QKV, Role.Q):
                query_splits = any(o.name == "colwise" for o in op.options)
    core_options, core_excluded = attention_core_options(attn, ctx, inner_s, cross=block == "cross")
    whole = [
        ctx.structure.whole_weights[p.weight]
        for p in attn.projections
        if p.weight in ctx.structure.whole_weights
    ]
    if whole and any(o.name == "head" for o in core_options):  # no head shard reaches the core
        core_options = [o for o in core_options if o.name != "head"]
        core_excluded["head"] = f"its projections are {whole[0]}"
    elif fused_reason and any(o.name == "head" for o in core_options):
        core_options = [o for o in core_options if o.name != "head"]
        core_excluded["head"] = (
            f"its fused q/k/v projection is not split ({attn.num_kv_heads} KV head(s) < tp={ctx.mesh.tp}: see qkv)"
        )
    elif not query_splits and any(o.name == "head" for o in core_options):
        core_options = [o for o in core_options if o.name != "head"]
        core_excluded["head"] = (
            "no query projection split column-wise feeds it (none found, or none divides): the tensor-parallel "
            "pass shards an attention core only by the heads its query projection's split carries"
        )
    elif not head_ok and any(o.name == "head" for o in core_options):
        core_options = [o for o in core_options if o.name != "head"]
        what = (
            f"{gathers} {'have' if '; ' in gathers else 'has'}"
            if gathers
            else "an op inside this attention has"
        )
        core_excluded["head"] = f"{what} no head-parallel rule: the TP pass gathers there"
    core_bytes = tokens * attn.num_heads * attn.head_dim * ctx.bytes_per_element
    ops.append(Op(prefix + "core", block, core_options, core_inputs, core_bytes, excluded=core_excluded))
    o = by_role.get(Role.O)
    if o is None:
        return prefix + "core"
    ops.append(_proj_op(prefix + "o", block, o, [prefix + "core"], tokens, ctx))
    if prefix:  # back to the stream inside the op: R, with its all-reduce (or SP's pair) priced
        last = ops[-1]
        for option in last.options:
            option.comm_s += stream_conversion_time_s(option.out_layout, last.out_bytes, ctx)
            option.out_layout = R
    return prefix + "o"


def _mlp_ops(
    projections: list[Projection],
    tokens: float,
    ctx: CostContext,
    ops: list[Op],
    block: str,
    inner_s: float | None = None,
    chain: bool = False,
    shardable: bool = True,
) -> str:
    """Gated (gate, up -> act -> down) or a chain (fc -> act -> fc -> ...). Returns the last op.

    ``inner_s``: the summed time of the ops between the projections (see ``elementwise_options``),
    used when there is one activation op (gated, or a chain of two); None: priced by formula.
    ``chain``: the model's projection chain (`ModelStructure.mlp_chain`), whose activation ``act{i}``
    is replicated only when gap i is in `ModelStructure.replicated_chain_gaps`; ``shardable`` False:
    a layer's activation is replicated only (`ModelStructure.replicated_mlp_classes`)."""
    by_role = {p.role: p for p in projections}
    if _gated(projections):
        gate, up, down = by_role[Role.GATE], by_role[Role.UP], by_role[Role.DOWN]
        ops.append(_proj_op(Role.GATE.value, block, gate, [""], tokens, ctx))
        ops.append(_proj_op(Role.UP.value, block, up, [""], tokens, ctx))
        width = gate.out_features
        act_bytes = tokens * width * ctx.bytes_per_element
        act = elementwise_options(width, 2, tokens, ctx, inner_s, shardable=shardable)
        ops.append(Op("act", block, act, [Role.GATE.value, Role.UP.value], act_bytes))
        ops.append(_proj_op(Role.DOWN.value, block, down, ["act"], tokens, ctx))
        return Role.DOWN.value
    if len(projections) > 2:
        inner_s = None  # a longer chain: its activations may be split differently, keep the formula
    prev = ""
    for i, (name, p) in enumerate(mlp_op_names(projections).items()):
        if i > 0:
            width = projections[i - 1].out_features
            act_bytes = tokens * width * ctx.bytes_per_element
            gap_ok = shardable and (not chain or i not in ctx.structure.replicated_chain_gaps)
            act = elementwise_options(width, 1, tokens, ctx, inner_s, shardable=gap_ok)
            ops.append(Op(f"act{i}", block, act, [prev], act_bytes))
            prev = f"act{i}"
        ops.append(_proj_op(name, block, p, [prev], tokens, ctx))
        prev = name
    return prev


def _gated(projections: list[Projection]) -> bool:
    """A SwiGLU MLP: gate and up into an elementwise product, then down (one of each: more projections
    are priced as a chain, each op named by its role and position, `mlp_op_names`)."""
    return sorted(str(p.role) for p in projections) == sorted(str(r) for r in (Role.GATE, Role.UP, Role.DOWN))


def mlp_op_names(projections: list[Projection]) -> dict[str, Projection]:
    """Op name of each MLP projection: gate/up/down for SwiGLU, else role + position ("fc0", "fc1")."""
    roles = [p.role for p in projections]
    if _gated(projections) or len(set(roles)) == len(roles) and Role.FC not in roles:
        return {str(p.role): p for p in projections}
    return {f"{p.role}{i}": p for i, p in enumerate(projections)}


def layer_projection_ops(layer: Layer) -> dict[str, Projection]:
    """Op name -> projection of one layer, as `build_layer_graph` names them."""
    out: dict[str, Projection] = {}
    if layer.attention is not None:
        out.update({str(p.role): p for p in layer.attention.projections})
    if layer.cross_attention is not None:
        out.update({f"cross.{p.role}": p for p in layer.cross_attention.projections})
    if layer.mlp is not None:
        out.update(mlp_op_names(layer.mlp.projections))
    return out


def serving_host_time_s(ctx: CostContext) -> float:
    """The serving engine's host work in one step (micro-batch) of an inference plan, in seconds
    (`costmodels.cluster.ServingHostSpec`, the cluster YAML's ``device.serving_host``): its fixed part,
    its part per sequence of the micro-batch (per data-parallel replica) and its part per further rank
    (worker) of the model replica (TP x PP). 0 for training and without the field."""
    host = ctx.cluster.device.serving_host
    if host is None or ctx.train or ctx.workload.kind not in (Workload.DECODE, Workload.FORWARD):
        return 0.0
    return host.time_s(ctx.sequences_per_micro_batch, ctx.mesh.tp * ctx.mesh.pp)


def lm_head_row_share(s: ModelStructure) -> float:
    """The share of the captured tokens the LM head computes logits for: 1, or less for a model that
    keeps only some positions (a prefill's last token: Hugging Face's `logits_to_keep`), read from the
    head's FLOPs at capture (`Projection.flops` = 2 x rows x in x out)."""
    head, tokens = s.lm_head, s.batch_size * s.seq_len
    if head is None or tokens <= 0 or head.in_features * head.out_features <= 0:
        return 1.0
    return min(1.0, head.flops / (2.0 * head.in_features * head.out_features) / tokens)


def output_held_bytes(ctx: CostContext) -> float:
    """Inference: the model's output the last stage holds at the end of a step, per rank: the logits of
    every micro-batch of the rank's batch (tokens x vocabulary, of the positions the LM head computes:
    `lm_head_row_share`), and, vocabulary-split, a micro-batch's shard beside the gathered whole while
    it is gathered; a model without an LM head, its last hidden states. A forward of Llama-3-8B at
    32 x 8,192 tokens returns 62.6 GiB of bf16 logits, which the peak left out (42.96 GiB, "fits"
    on one 80 GB GPU). Training: 0 (the loss's logits are activations, priced with the LM head)."""
    if ctx.train:
        return 0.0
    s, b, tp = ctx.structure, ctx.bytes_per_element, ctx.mesh.tp
    micro = ctx.micro_batches if ctx.mesh.pp > 1 else 1
    if s.lm_head is None:
        return micro * ctx.tokens * s.hidden_size * b
    logits = ctx.tokens * lm_head_row_share(s) * s.lm_head.out_features * b
    return micro * logits + (logits / tp if tp > 1 else 0.0)


def build_ends_graph(ctx: CostContext) -> LayerGraph:
    """Embedding (first stage) and final norm + LM head (last stage); tied weights share a choice."""
    s = ctx.structure
    b, tp, tokens = ctx.bytes_per_element, ctx.mesh.tp, ctx.tokens
    state = ctx.state_factor()
    ops: list[Op] = []
    held: set[str] = set()  # weights an earlier embedding op holds (T5's encoder and decoder lookups)
    for i, emb in enumerate(s.embeddings):
        weight_bytes = emb.vocab_size * emb.dim * b
        frozen = ctx.frozen(emb.weight)  # weights only, and no gradient to scatter
        t = ctx.op_time(0.0, compute.embedding_bytes(tokens, emb.dim, ctx.dtype), "memory")
        grads = weight_bytes if ctx.train and not frozen else 0.0
        emb_state = 1.0 if frozen else state
        out_bytes = tokens * emb.dim * b
        into_stream = stream_conversion_time_s(R, out_bytes, ctx)  # sequence parallel: the first gather
        head = s.lm_head  # its weight's gradient is summed with this one's on a one-stage tied model
        tied = (
            s.tied_lm_head and ctx.mesh.pp == 1 and head is not None and emb.vocab_size == head.out_features
        )
        dense = 0.0 if frozen else embedding_gradient_time_s(weight_bytes, out_bytes, tied, ctx)
        options = [
            OpOption("replicate", R, R, t + dense, weight_bytes * emb_state, 0.0, into_stream, grad_bytes=grads,
                     frozen_bytes=weight_bytes if frozen else 0.0)
        ]  # fmt: skip
        excluded = {}
        whole = s.whole_weights.get(emb.weight)
        if tp > 1 and whole is not None:  # the TP pass refused a plan that split it
            excluded["vocab"] = whole
        elif tp > 1:  # a vocabulary that does not divide by tp is padded (passes.tensor_parallel.padded_size)
            rows = -(-emb.vocab_size // tp)
            shard_bytes = rows * emb.dim * b
            comm = stream_conversion_time_s(P, out_bytes, ctx)
            dense = 0.0 if frozen else embedding_gradient_time_s(shard_bytes, out_bytes, tied, ctx)
            options.append(
                OpOption("vocab", R, R, t + dense, shard_bytes * emb_state, 0.0, comm, grads and shard_bytes,
                         frozen_bytes=shard_bytes if frozen else 0.0)
            )  # fmt: skip
        if emb.weight in held:  # one weight, looked up twice: counted (and its gradient) once
            for opt in options:
                opt.static_bytes = opt.grad_bytes = opt.frozen_bytes = 0.0
        held.add(emb.weight)
        ops.append(Op(f"embedding{i}", "embedding", options, [], out_bytes, emb.weight, None, excluded))
    head = s.lm_head
    first_stage, fixed = 0.0, 0.0
    if s.node_costs and s.layers:  # before the first layer (first stage), and after it
        first_stage = outside_nodes_time_s(ctx, before_layers=True)
        fixed = first_stage + outside_nodes_time_s(ctx, before_layers=False)
    elif s.node_costs:
        fixed = outside_nodes_time_s(ctx)
    if head is not None:
        hidden = head.in_features
        if not s.node_costs:  # not analysed node by node: the final norm by formula
            fixed = ctx.op_time(
                compute.norm_flops(tokens, hidden, NORM_KIND),
                compute.norm_bytes(tokens, hidden, ctx.dtype, NORM_KIND),
                "memory",
            )
        padded = dataclasses.replace(head, out_features=-(-head.out_features // tp) * tp, parts=None)
        # vocab padded to a multiple of tp; no input gradient when nothing before the head trains
        options, excluded = projection_options(padded, tokens, ctx, input_grad=grad_reaches_head(ctx))
        options = [o for o in options if o.name != "rowwise"]
        excluded.pop("rowwise", None)
        logits_bytes = tokens * head.out_features * b
        for opt in options:
            shards = 1
            if opt.name == "colwise":
                opt.name = "vocab"
                # Logits leave sharded on the vocab: inference gathers them (the graph's outputs are
                # replicated); training computes the loss on the shards (`runtime.loss`: one all-reduce
                # of a scalar)
                if ctx.train:
                    shards = tp
                    scalar = all_reduce_time_s(4.0, ctx.tp_group(), ctx.cluster)
                    opt.comm_s = scalar + ctx.node_overhead_time(1)
                else:
                    opt.comm_s = conversion_time_s(S, R, logits_bytes, ctx)
            opt.out_layout = R
            if ctx.train:  # the loss over this rank's logits, and its fp32 logits kept for the backward
                logits = tokens * head.out_features / shards
                opt.activation_bytes += logits * 4.0
                # the backward starts with the logits' gradient beside every stored activation, and the
                # final norm keeps its input (a sequence shard under sequence parallelism)
                opt.activation_bytes += logits * b + tokens * hidden * b / (
                    tp if ctx.sequence_parallel else 1
                )
                opt.compute_s += loss_time_s(logits, ctx)
        if "colwise" in excluded:
            excluded["vocab"] = excluded.pop("colwise")
        if s.tied_lm_head:
            for opt in options:  # the weight is counted once, with the embedding
                opt.static_bytes = opt.grad_bytes = opt.frozen_bytes = 0.0
        ops.append(Op("lm_head", "head", options, [], logits_bytes, head.weight, head, excluded))
    host_work = 0.0
    if ctx.serving_step and ctx.cluster.device.decode_host_s:
        host_work += ctx.cluster.device.decode_host_s  # the serving loop's host work around the graph
    host_work += serving_host_time_s(ctx)
    fixed += host_work
    if ctx.cp > 1 and ctx.train:  # the loss on the rank's tokens: one all-reduce of a scalar (`runtime.loss`)
        fixed += all_reduce_time_s(4.0, ctx.cp_group(), ctx.cluster) + ctx.node_overhead_time(1)
    elif ctx.cp > 1:  # the outputs gathered whole (`passes.cp_lower`)
        width = head.out_features if head is not None else s.hidden_size
        fixed += all_gather_time_s(ctx.cp * tokens * width * b, ctx.cp_group(), ctx.cluster)
    # the host's issue time of the nodes outside the layers, on an asynchronous device (a model without
    # layers: its chain graph carries all of it): before the first layer forward only (position ids,
    # masks, RoPE tables take no gradient; the embedding's backward aside), after it with the backward
    # and training's loss as one more node; the host's own work of a serving step adds to the latter
    first_dispatch = last_dispatch = 0.0
    if s.node_costs and s.layers and ctx.cluster.device.host_dispatch_s is not None:
        first_dispatch = ctx.host_dispatch_time(len(_outside_nodes(ctx, before_layers=True)), backward=False)
        last_dispatch = ctx.host_dispatch_time(len(_outside_nodes(ctx, before_layers=False)) + int(ctx.train))
        last_dispatch += host_work
    # parameters no op above holds (convolutions, norms and biases outside the layers, ...): replicated;
    # and the buffers the graph reads (masks, RoPE tables), whole on every rank
    other = outside_params(s) * b
    frozen = min(other, outside_frozen_params(s) * b) if ctx.train else 0.0  # weights only
    return LayerGraph(
        "ends",
        ops,
        {},
        fixed,
        (other - frozen) * state + frozen + s.buffer_bytes,
        0.0,
        other - frozen if ctx.train else 0.0,
        first_stage_compute_s=first_stage,
        frozen_static_bytes=frozen + s.buffer_bytes,
        dispatch_s=first_dispatch + last_dispatch,
        first_stage_dispatch_s=first_dispatch,
    )


def grad_reaches_head(ctx: CostContext) -> bool:
    """Whether training takes a gradient through the LM head's input: some layer runs a backward
    (`Layer.trainable`), an embedding trains, or a parameter outside them does (a model without
    layers: always)."""
    s = ctx.structure
    if not ctx.train or not s.layers or not s.num_frozen_params:
        return True
    if any(layer.trainable for layer in s.layers) or outside_frozen_params(s) < outside_params(s):
        return True
    return any(not ctx.frozen(e.weight) for e in s.embeddings)


def loss_time_s(logits: float, ctx: CostContext) -> float:
    """Forward + backward of a training step's loss over ``logits`` elements on one rank: the
    cross-entropy in fp32 that Megatron-LM and torchtitan train with (`compute.cross_entropy_bytes`,
    memory-bound; one more node on a device priced per node). The runtime's loss (an MSE, about as many
    bytes: fp32 ~40 per logit) runs as those do, on each rank's vocabulary shard (`runtime.loss`)."""
    flops = compute.CROSS_ENTROPY_FLOPS * logits
    bytes_moved = compute.cross_entropy_bytes(logits, ctx.dtype)
    dev = ctx.cluster.device
    launch = dev.node_overhead_s is None
    return compute.op_time_s(
        flops, bytes_moved, dev, ctx.dtype, "memory", launch=launch
    ) + ctx.node_overhead_time(1)


def embedding_gradient_time_s(weight_bytes: float, out_bytes: float, tied: bool, ctx: CostContext) -> float:
    """Training only: the dense gradient of an embedding's ``weight_bytes`` (its rows on this rank),
    per micro-batch. The backward (`aten.embedding_dense_backward`) fills a fresh weight-sized tensor
    with zeros and adds the looked-up rows' gradients (``out_bytes``) into it; with the weight tied to
    the LM head on one stage, autograd then sums the two weight-sized gradients into a fresh tensor
    (reads both). Fresh memory is written at `costmodels.compute.fresh_write_time_s` (on the 2-vCPU dev
    VM, GPT-2's 154 MB: 57 ms for the fill, 70 ms for the tied sum, against ~14 and ~40 ms at the
    rewrite bandwidth, 2026-12-01)."""
    if not ctx.train:
        return 0.0
    dev = ctx.cluster.device
    bandwidth = dev.memory_bandwidth_bytes_per_s * dev.memory_efficiency
    fill_s = compute.fresh_write_time_s(weight_bytes, dev) + 3 * out_bytes / bandwidth
    return fill_s + (
        2 * weight_bytes / bandwidth + compute.fresh_write_time_s(weight_bytes, dev) if tied else 0.0
    )


def outside_params(s: ModelStructure) -> int:
    """Parameter elements outside the transformer layers, the embeddings, the LM head and the chain's
    projections (convolutions, norms, biases, ...): what no op option of the cost tables holds."""
    held = sum(layer.num_params for layer in s.layers)
    held += sum(e.vocab_size * e.dim for e in s.embeddings)
    if s.lm_head is not None and not s.tied_lm_head:
        held += s.lm_head.in_features * s.lm_head.out_features
    held += sum(p.in_features * p.out_features for p in s.mlp_chain)
    return max(0, int(s.num_params) - held)


def outside_frozen_params(s: ModelStructure) -> int:
    """Of `outside_params`, the frozen elements (`ModelStructure.num_frozen_params` less those the
    layers, embeddings, LM head and chain hold)."""
    if not s.num_frozen_params:
        return 0
    held = sum(layer.frozen_params for layer in s.layers)
    held += sum(e.vocab_size * e.dim for e in s.embeddings if e.weight in s.frozen_params)
    weights = [s.lm_head] if s.lm_head is not None and not s.tied_lm_head else []
    held += sum(
        p.in_features * p.out_features for p in [*weights, *s.mlp_chain] if p.weight in s.frozen_params
    )
    return max(0, int(s.num_frozen_params) - held)


# ---------------------------------------------------------------------------------------------
# Mesh-level terms


def p2p_message_bytes(ctx: CostContext) -> float:
    """Bytes one rank sends to the next pipeline stage per micro-batch: the residual stream, tokens x
    hidden in the activations' dtype; with sequence parallelism each TP rank's sequence shard (1/tp of
    it). Its gradient coming back is the same size."""
    nbytes = ctx.tokens * ctx.structure.hidden_size * ctx.bytes_per_element
    return nbytes / ctx.mesh.tp if ctx.sequence_parallel else nbytes


def p2p_stage_time_s(ctx: CostContext) -> float:
    """Send one micro-batch's activations (`p2p_message_bytes`) to the next stage (and grads back)."""
    if ctx.mesh.pp == 1:
        return 0.0
    inter = ctx.cluster.num_nodes > 1 and ctx.mesh.num_devices > ctx.cluster.devices_per_node
    return ctx.comm_factor * p2p_time_s(p2p_message_bytes(ctx), ctx.cluster, inter)


def pipeline_buffer_bytes(ctx: CostContext, stage: int) -> float:
    """Bytes pipeline rank `stage` holds for stage-boundary gradients beyond its activations, in
    training: the output gradient received for the backward it runs next (a rank with a chunk that
    sends activations) and the input gradient it sends back (a rank with a chunk that receives them),
    one `p2p_message_bytes` each. The runtime receives into buffers made when each receive is posted
    and released after that micro-batch's backward (`runtime.pipeline._JustInTimeStage`), so the
    received inputs of the micro-batches in flight are their stages' inputs, which the activations
    count. (torch 2.13's own `PipelineStage`, as torchtitan runs it, keeps a buffer per micro-batch and
    direction for the whole step, m times these: pytorch/pytorch#136380.) Inference: 0 (the input
    being computed on is working memory, `transient_bytes`)."""
    pp, v = ctx.mesh.pp, ctx.virtual_stages
    if pp == 1 or not ctx.train:
        return 0.0
    receives_grads = stage < pp - 1 or v > 1
    sends_grads = stage > 0 or v > 1
    return (int(receives_grads) + int(sends_grads)) * p2p_message_bytes(ctx)


def tied_gradient_exchange_s(grad_bytes: float, ctx: CostContext, ranks: int = 2, copies: int = 0) -> float:
    """Seconds per training step to sum the gradients of a weight held on several pipeline stages (an
    embedding tied to the LM head, GPT-2's; a block the model calls at two depths): after the backward
    each of the ``ranks`` pipeline ranks holding a copy adds its own copies, sends that partial sum to
    every other such rank while receiving theirs (all at once: (ranks - 1) messages through the
    rank's link), and adds the partial sums (`runtime.pipeline.sum_tied_gradients`), before the
    data-parallel reduction and the optimizer step; Megatron-LM all-reduces the word-embedding
    gradients between the first and the last stage at the same point (`finalize_model_grads`).
    ``grad_bytes``: one rank's share of the tied weight in the parameters' dtype
    (`OpOption.grad_bytes`); the gradients move in `CostContext.grad_dtype`. ``copies``: the virtual
    stages holding one (default ``ranks``): copies - 1 adds of the whole gradient in all. 0 without
    training, pipeline stages or a second rank."""
    if not ctx.train or ctx.mesh.pp == 1 or grad_bytes <= 0 or ranks < 2:
        return 0.0
    nbytes = grad_bytes * ctx.grad_reduce_scale
    inter = ctx.cluster.num_nodes > 1 and ctx.mesh.num_devices > ctx.cluster.devices_per_node
    adds = max(copies, ranks) - 1
    add_s = compute.op_time_s(0.0, 3.0 * nbytes * adds, ctx.cluster.device, ctx.grad_dtype, "memory")
    return p2p_time_s((ranks - 1) * nbytes, ctx.cluster, inter) + add_s


def stage_p2p_time_s(ctx: CostContext, stage: int) -> float:
    """Point-to-point time per micro-batch of pipeline rank `stage`: one send (and its gradient back)
    per model chunk boundary it owns: 1 for every rank but the last with one chunk; v for every rank
    but the last, v - 1 for the last, with v chunks (interleaved 1F1B: v times the messages,
    Narayanan et al. 2021, section 2.2.2)."""
    pp, v = ctx.mesh.pp, ctx.virtual_stages
    if pp == 1:
        return 0.0
    return (v if stage < pp - 1 else v - 1) * p2p_stage_time_s(ctx)


def interleaved_chunks(num_layers: int, pp: int, virtual_stages: int) -> list[list[int]]:
    """The layers in ``pp * virtual_stages`` contiguous model chunks, chunk c run by pipeline rank
    c mod pp (interleaved 1F1B). Sizes differ by at most one layer; the smaller chunks go first to the
    two ends (the first chunk holds the embedding, the last the LM head), as Llama 3 trained 126
    layers on 16 stages with one layer fewer on the first and the last (Dubey et al. 2024, section
    3.3.2). Raises ValueError when there are fewer layers than chunks."""
    chunks = pp * virtual_stages
    if num_layers < chunks or min(pp, virtual_stages) < 1:
        raise ValueError(f"{num_layers} layers do not fill {pp} x {virtual_stages} model chunks")
    base, extra = divmod(num_layers, chunks)
    ends_first = [c for pair in zip(range(chunks), reversed(range(chunks))) for c in pair]
    order = list(dict.fromkeys(ends_first))  # 0, n-1, 1, n-2, ...
    smaller = set(order[: chunks - extra])
    sizes = [base if c in smaller else base + 1 for c in range(chunks)]
    out, start = [], 0
    for size in sizes:
        out.append(list(range(start, start + size)))
        start += size
    return out


def in_flight_micro_batches(ctx: CostContext, stage: int) -> float:
    """Training micro-batches whose activations stage `stage` holds at once under the candidate's
    schedule (`memory.inflight_micro_batches`; fractional with interleaving)."""
    if not ctx.train:
        return 0
    return memory.inflight_micro_batches(
        ctx.mesh.pp, stage, ctx.micro_batches, ctx.config.schedule, ctx.virtual_stages
    )


Seconds = TypeVar("Seconds")  # a float, or a linear expression of the ILP (`planner.solver.ilp`)


def step_time_s(
    total_s: Seconds, slowest_stage_s: Seconds, micro_batches: int, virtual_stages: int = 1
) -> Seconds:
    """Time of one pipelined step of `micro_batches`: every stage's work on one micro-batch once (the
    fill and drain), plus (m - 1) times the slowest stage (the steady state). With p equal stages that
    is (m + p - 1) stage times, a bubble of (p - 1) / (m + p - 1): the same for GPipe and 1F1B, which
    differ in memory (`in_flight_micro_batches`). One stage: m times its time.

    Interleaved 1F1B with v chunks per rank fills and drains with chunks of 1/v of a stage:
    total / v + (m - 1/v) slowest, i.e. m stage times plus a bubble of (p - 1) / v of them
    (Narayanan et al. 2021, section 2.2.2: bubble fraction (p - 1) / (v m) of the ideal step)."""
    v = virtual_stages
    return total_s * (1.0 / v) + (micro_batches - 1.0 / v) * slowest_stage_s


def expert_counts(structure: ModelStructure) -> list[int]:
    """The distinct expert counts E of the model's mixture-of-experts layers, ascending ([] for a dense
    model): an EP degree must divide each."""
    return sorted({layer.moe.num_experts for layer in structure.layers if layer.moe is not None})


def layer_keys(structure: ModelStructure) -> list[str]:
    """Class key of each layer (`layer_key`), or ["chain"] for a plain MLP. Raises InputError when
    the model has nothing to plan."""
    if structure.layers:
        return [layer_key(layer) for layer in structure.layers]
    if structure.mlp_chain:
        return ["chain"]
    raise InputError("the model has neither transformer layers nor linear layers to plan")


@dataclass
class CostTables:
    """Every op option of a model priced on one mesh candidate: the ILP's and the predictor's input."""

    ctx: CostContext
    graphs: dict[str, LayerGraph]  # by class key (`layer_key`): identical layers share one graph
    layer_keys: list[str]  # class key of each layer, in order (["chain"]: a plain MLP)
    ends: LayerGraph  # embedding (first stage), final norm and LM head (last stage)

    @property
    def num_layers(self) -> int:
        return len(self.layer_keys)


def build_cost_tables(ctx: CostContext, keys: list[str] | None = None) -> CostTables:
    """Price every op of `ctx.structure` on `ctx`'s mesh. `keys`: `layer_keys(ctx.structure)`, if the
    caller has them. Raises InputError when the model has nothing to plan."""
    s = ctx.structure
    keys = layer_keys(s) if keys is None else keys
    graphs: dict[str, LayerGraph] = {}
    if s.layers:
        for layer, key in zip(s.layers, keys):
            if key not in graphs:
                graphs[key] = build_layer_graph(layer, ctx)
    else:
        graphs["chain"] = build_chain_graph(s.mlp_chain, ctx)
    return CostTables(ctx, graphs, keys, build_ends_graph(ctx))


def transient_bytes(ctx: CostContext) -> float:
    """Working memory per rank on top of what is stored. Inference: a few live activations of one
    micro-batch, the widest a rank computes: the residual stream, or a projection's output split over
    the TP ranks (a 70B MLP's 28672 columns are 7168 per rank at TP=4; priced whole, a 2048-token x 64
    prefill that TensorRT-LLM 0.5 ran at TP4 on A100 80GB read as not fitting), or the largest expert
    GEMM of experts the model's own code runs, with its gathered weight copies, if larger
    (`graph_expert_working_bytes`). Training:
    `training_transient_bytes`. Both: context parallelism's K/V buffers in flight (`cp_buffer_bytes`)."""
    if ctx.train:
        return training_transient_bytes(ctx) + cp_buffer_bytes(ctx)
    s = ctx.structure
    widest = max([s.hidden_size] + [p.out_features / ctx.mesh.tp for p in _all_projections(s)])
    live = 4.0 * ctx.tokens * widest * ctx.bytes_per_element
    return max(live, graph_expert_working_bytes(ctx)) + cp_buffer_bytes(ctx)


def training_transient_bytes(ctx: CostContext) -> float:
    """Training: weight-sized temporaries a rank holds for a moment beside its parameters, gradients
    and Adam state; the larger of the two below (one comes in the backward, the other in the step).

    - Tied LM head on one stage: the embedding's dense gradient and the LM head's gradient are two
      fresh weight-sized tensors that autograd sums into a third, the gradient kept: two of the
      embedding's (vocabulary-sharded when tp > 1) size beyond it.
    - torch's Adam on an eager CPU (the single-tensor loop; not the ZeRO-1 flat shard) computes
      ``exp_avg_sq.sqrt() / bias_correction2_sqrt`` out of place: two fp32 temporaries the size of the
      largest parameter tensor (matrices split over tp, as `large_param_share` assumes).

    On the 2-vCPU dev VM, GPT-2 124M at TP=2: each 2 x 73.6 MiB above the stored state (2026-12).
    Not priced: torch's foreach Adam on CUDA (one temporary per parameter, fp32 state-sized)."""
    s, tp = ctx.structure, ctx.mesh.tp
    tied = 0.0
    if s.tied_lm_head and ctx.mesh.pp == 1 and s.lm_head is not None:
        rows = -(-s.lm_head.out_features // tp)
        tied = 2.0 * rows * s.lm_head.in_features * ctx.bytes_per_element
    adam = 0.0
    if ctx.cluster.device.node_overhead_s is not None and not ctx.distributed_optimizer:
        largest = max((n / tp if matrix else n for n, matrix in s.param_tensor_sizes), default=0.0)
        adam = 2.0 * largest * 4.0  # fp32 moments (and fp32 master weights of 16-bit parameters)
    return max(tied, adam) + fsdp_transient_bytes(ctx) + zero2_transient_bytes(ctx)


def unit_params(s: ModelStructure) -> tuple[float, float, float]:
    """The trainable parameters of the wrapping units that sharded data parallelism reduces (and FSDP
    gathers) one at a time (`passes.fsdp.make_buckets`), before the TP split: (the largest layer's,
    the unit outside the layers': embedding, LM head, the chain, norms, and of that outside unit those
    whose gradients the backward makes before the layers': all but an untied embedding). Frozen
    parameters are not sharded, so not in any unit."""
    layer = max((layer.num_params - layer.frozen_params for layer in s.layers), default=0)
    embeddings = sum(e.vocab_size * e.dim for e in s.embeddings)
    outside = outside_params(s) + embeddings
    if s.lm_head is not None and not s.tied_lm_head:
        outside += s.lm_head.in_features * s.lm_head.out_features
    outside += sum(p.in_features * p.out_features for p in s.mlp_chain)
    outside = max(0, outside - (s.num_frozen_params - sum(layer.frozen_params for layer in s.layers)))
    held = outside if s.tied_lm_head else max(0, outside - embeddings)
    return layer, outside, held


def rank_layer_unit_params(ctx: CostContext) -> float:
    """The trainable parameters of the largest layer unit one rank holds unsharded while it is gathered
    (FSDP) or its gradients are (ZeRO-2): the layer's dense parameters over the TP ranks, and of its
    routed experts the rank's own, E / ep of them (1 / expert_tp of each when split over TP:
    `expert_param_bytes`). `unit_params`' whole layer over tp counted every expert on every rank:
    DeepSeek-V3's 256 experts at EP 8 gave ZeRO-2 more memory than ZeRO-1."""
    best = 0.0
    for layer in ctx.structure.layers:
        experts = layer.moe.expert_params if layer.moe is not None else 0
        dense = max(0, layer.num_params - layer.frozen_params - experts)
        best = max(best, dense / ctx.mesh.tp + experts / (ctx.ep * ctx.expert_tp))
    return best


def fsdp_transient_bytes(ctx: CostContext) -> float:
    """FSDP: the unsharded units in flight (`memory.fsdp_unit_bytes`): the largest layer's trainable
    parameters a rank holds (`rank_layer_unit_params`) and those outside the layers (`unit_params`,
    split over the TP ranks); 0 for the other styles."""
    if ctx.dp_style is not DataParallel.FSDP:
        return 0.0
    _, outside, _ = unit_params(ctx.structure)
    tp = ctx.mesh.tp
    return memory.fsdp_unit_bytes(
        rank_layer_unit_params(ctx),
        outside / tp,
        ctx.dtype,
        ctx.reshard_after_forward,
        grad_dtype=ctx.grad_dtype,
    )


def zero2_transient_bytes(ctx: CostContext) -> float:
    """ZeRO-2: the unsharded gradients and reduce-scatter buffers of the units (`memory.zero2_unit_bytes`
    of `rank_layer_unit_params` and `unit_params`' outside unit, split over the TP ranks; the runtime
    keeps one reduce-scatter in flight under the plan's overlap_grad_reduce, at dp 1 too); 0 for the
    other styles."""
    if ctx.dp_style is not DataParallel.ZERO2 or not ctx.train:
        return 0.0
    _, outside, held = unit_params(ctx.structure)
    tp, overlap = ctx.mesh.tp, ctx.config.overlap_grad_reduce
    return memory.zero2_unit_bytes(
        rank_layer_unit_params(ctx), outside / tp, held / tp, ctx.dtype, ctx.grad_dtype, overlap, ctx.dp_cp
    )


def _all_projections(s: ModelStructure) -> list[Projection]:
    out = list(s.mlp_chain)
    for layer in s.layers:
        if layer.attention is not None:
            out += layer.attention.projections
        if layer.cross_attention is not None:
            out += layer.cross_attention.projections
        if layer.mlp is not None:
            out += layer.mlp.projections
    return out


def model_matmul_shapes(s: ModelStructure, tokens: int, tps: list[int]) -> list[tuple[int, int, int]]:
    """The (M, K, N) products one rank computes for `s`'s projections and LM head at each TP degree of
    ``tps``, M = ``tokens``: replicated (K, N), column-parallel (K, N / tp) and row-parallel (K / tp, N)
    where they divide, the LM head's vocabulary padded to a multiple of tp (as `build_ends_graph`
    prices it). What `costmodels.calibrate.matmul_shape_time_ratios` times on a CPU."""
    shapes: dict[tuple[int, int, int], None] = {}
    for layer in s.layers:  # the expert pass's GEMMs (`expert_gemm_shapes`), on a balanced expert's rows
        moe = layer.moe
        if moe is None:
            continue
        rows = max(1, tokens * moe.top_k // moe.num_experts)
        for w in moe.experts:
            for tp in tps:
                split = w.in_features if w.role is Role.EXPERT_DOWN else min(w.parts or (w.out_features,))
                if split % tp == 0:
                    shapes.update(((rows, round(k), round(n)), None) for k, n in expert_gemm_shapes(w, tp))
    head = [s.lm_head] if s.lm_head is not None else []
    for p in _all_projections(s) + head:
        k, n = p.in_features, p.out_features
        for tp in tps:
            if tp == 1:
                shapes[(tokens, k, n)] = None
                continue
            if p is s.lm_head:
                shapes[(tokens, k, -(-n // tp))] = None
                continue
            if n % tp == 0:
                shapes[(tokens, k, n // tp)] = None
            if k % tp == 0:
                shapes[(tokens, k // tp, n)] = None
    return list(shapes)


def attention_call(heads: float, q_len: float, kv_len: float, head_dim: float, causal: bool) -> tuple:
    """The key of an attention core one rank computes (query heads on the rank, query length, key
    length, head dim, causal) in `DeviceSpec.attention_time_ratios`."""
    return (round(heads), round(q_len), round(kv_len), round(head_dim), bool(causal))


def model_attention_calls(
    s: ModelStructure, workload: WorkloadSpec, tps: list[int], cps: list[int] = ()
) -> list[tuple]:
    """The attention cores (`attention_call`) one rank computes for `s`'s self-attention layers at
    each TP degree of ``tps`` (its query and KV heads split by heads where both divide, else whole),
    at the workload's query and key lengths, causal (as `attention_core_options` prices a
    self-attention core): what `costmodels.calibrate.attention_time_ratios` times on a CPU; with each
    context-parallel degree of ``cps`` (beside a TP degree, on no more ranks than the largest degree
    of ``tps``), the rank's CP kernels too (`cp_attention_call`). None at a decode step (one query a
    sequence: its time is the cache's bytes), nor for a layer attending over the model's own cache."""
    if workload.kind is Workload.DECODE:
        return []
    calls: dict[tuple, None] = {}
    seq = workload.tokens_per_sequence
    for layer in s.layers:
        attn = layer.attention
        if attn is None or attn.cache_bytes:
            continue
        for tp in tps:
            split = attn.num_heads % tp == 0 and attn.num_kv_heads % tp == 0
            heads = attn.num_heads // tp if split else attn.num_heads
            key = attention_call(heads, seq, workload.kv_len, attn.head_dim, True)
            calls[key] = None
            for cp in cps:
                if cp > 1 and tp * cp <= max(tps) and seq % cp == 0:
                    for variant in ("ring", "alltoall"):
                        if variant == "alltoall" and heads % cp:
                            continue
                        calls[cp_attention_call(heads, seq, attn.head_dim, cp, variant, True)] = None
    return list(calls)


@dataclass(frozen=True)
class LinearCost:
    """time ~= alpha_s + beta_s_per_byte * nbytes: an affine fit of a collective, used inside the ILP."""

    alpha_s: float
    beta_s_per_byte: float

    def __call__(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes if nbytes > 0 else 0.0


def gradient_sync_time_s(grad_bytes: float, ctx: CostContext) -> float:
    """Data-parallel traffic of one step for a rank whose gradients are `grad_bytes` (the TP / stage
    shard, unsharded over DP), all of it, exposed or not (`dp_sync_parts`). 0 without training or DP."""
    return dp_sync_parts(grad_bytes, ctx)[0]


# shares of a training step's compute in the forward and in the backward (`TRAIN_COMPUTE_FACTOR`:
# backward = 2x forward): the windows the overlapped parameter gathers and gradient reductions hide in
FORWARD_SHARE = 1.0 / TRAIN_COMPUTE_FACTOR
BACKWARD_SHARE = 1.0 - FORWARD_SHARE


@dataclass(frozen=True)
class SyncPhase:
    """One part of a step's data-parallel traffic (`dp_sync_phases`): `total_s` of it, `unhidden_s`
    the share no compute can hide (= total_s when the runtime waits for all of it), and `window`: the
    fraction of the stage's compute of the step (all micro-batches, forward and backward) it runs
    under (0: none; it is exposed whole)."""

    total_s: float
    unhidden_s: float
    window: float

    def exposed_s(
        self, stage_compute_s: float, overlap_efficiency: float, overlap_slowdown: float = 0.0
    ) -> float:
        """e = max(unhidden_s, total_s - overlap_efficiency x window x stage_compute_s), plus
        overlap_slowdown x (total_s - e), the compute the hidden part slows (`contention_s`);
        total_s without a window."""
        if self.window <= 0:
            return self.total_s
        exposed = max(self.unhidden_s, self.total_s - overlap_efficiency * self.window * stage_compute_s)
        return exposed + overlap_slowdown * (self.total_s - exposed)


def dp_sync_parts(grad_bytes: float, ctx: CostContext) -> tuple[float, float]:
    """(all data-parallel traffic of one step, the part of it no compute can hide), seconds, for a
    rank with `grad_bytes` of gradients: the sums over `dp_sync_phases` of their `total_s` and
    `unhidden_s`."""
    phases = dp_sync_phases(grad_bytes, ctx)
    return sum(p.total_s for p in phases), sum(p.unhidden_s for p in phases)


def dp_sync_phases(grad_bytes: float, ctx: CostContext) -> list[SyncPhase]:
    """The data-parallel traffic of one step for a rank with `grad_bytes` of gradients, by
    `CostContext.dp_style`, as the runtime (`runtime.data_parallel`) runs it; empty without training
    or DP. With U = wrapping units per rank (a layer each, the parameters outside the layers one
    more), b = grad_bytes / U, m micro-batches, eta = `ClusterSpec.overlap_efficiency`, C the stage's
    compute of the step and c(x) a collective of x bytes: collectives issued one per unit back to back
    cost U x c_burst(b) + c(b) - c_burst(b) (the first pays the link's latency, the others its burst
    latency where measured: `comm.burst_cluster`); a phase that overlaps compute is exposed for
    max(one unit's share c(b), total - eta x window x C) (`SyncPhase.exposed_s`). The gradients'
    collectives move them in `CostContext.grad_dtype` (fp32 gradients of 16-bit parameters: twice
    `grad_bytes`, Megatron-LM's fp32 main_grad); the parameters' gathers move the parameters' dtype:

    - ddp: the gradients' all-reduce. Off: one after the backward (exposed). overlap_grad_reduce: one
      per unit, issued from the last micro-batch's backward as the unit's gradients are ready (DDP's
      no_sync before), window `BACKWARD_SHARE` / m, the last unit's all-reduce unhidden;
    - zero1: the gradients' reduce-scatter (as ddp's all-reduce, off or overlap_grad_reduce) and,
      after each rank steps its slice, the parameters' all-gather (same dtype, same bytes). Off: one
      after the step (exposed). overlap_param_gather: one per unit, each waited for at the unit's first
      use in the next forward, window `FORWARD_SHARE` / m (the first micro-batch's forward), the first
      unit's all-gather unhidden;
    - zero2: each unit's gradients reduce-scattered as each micro-batch's backward finishes them (m x U
      collectives; the slice accumulates): off, each waited for at once (exposed); overlap_grad_reduce,
      asynchronous, window `BACKWARD_SHARE` (every micro-batch's backward), the last unit's share
      unhidden; the all-gather after the step as zero1's;
    - fsdp: per micro-batch, each unit's parameters (one collective per unit) all-gathered over the
      shard group before its forward and, resharded after forward, again before its backward, and its
      gradients reduce-scattered after its backward; HSDP adds the all-reduce of each gradient shard
      over the replicate group. The runtime prefetches the next unit's gather while the current unit
      computes and issues the reduce-scatters asynchronously (FSDP2's default, one unit ahead), so all
      but one unit's share per micro-batch (the first gather, the last reduce) can hide: window 1 (the
      whole step's compute). On a device that measured its writes into fresh memory
      (`DeviceSpec.fresh_write_bandwidth_bytes_per_s`, a CPU's page faults: `planner calibrate`), the
      gathered buffers, the flat gradient and the gradient shard each unit allocates per micro-batch
      are written at that rate, exposed (a second phase; measured on the 2-vCPU dev VM: the mid
      Llama's FSDP step 3.87 s against 2.36 s priced without it, bench/README.md).
    """
    group = ctx.dp_group()  # dp x cp ranks; the experts' own (`experts_context`) may span the TP ranks too
    if not ctx.train or group.size == 1 or grad_bytes <= 0:
        return []
    style, cluster, m = ctx.dp_style, ctx.cluster, ctx.micro_batches
    units = max(1, round(len(ctx.structure.layers) / ctx.mesh.pp)) + 1
    unit_bytes = grad_bytes / units
    reduced = ctx.grad_reduce_scale  # the gradients' collectives move them in `CostContext.grad_dtype`
    burst = burst_cluster(cluster)

    def per_unit_phase(collective, count: int, window: float, scale: float = 1.0) -> SyncPhase:
        """count back-to-back collectives of a unit's bytes (x scale), the last one exposed."""
        nbytes = unit_bytes * scale
        one, rest = collective(nbytes, group, cluster), collective(nbytes, group, burst)
        return SyncPhase(count * rest + one - rest, one, window)

    def whole(collective, scale: float = 1.0) -> SyncPhase:
        t = collective(grad_bytes * scale, group, cluster)
        return SyncPhase(t, t, 0.0)

    if style is DataParallel.FSDP:
        shard = ctx.dp_shard_group()
        gathers = 2 if ctx.reshard_after_forward else 1

        def per_unit(c: ClusterSpec) -> float:
            t = gathers * all_gather_time_s(unit_bytes, shard, c) + reduce_scatter_time_s(
                unit_bytes * reduced, shard, c
            )
            if shard.size < ctx.dp_cp:
                t += all_reduce_time_s(unit_bytes * reduced / shard.size, ctx.dp_replicate_group(), c)
            return t

        total = m * units * per_unit(burst) + per_unit(cluster) - per_unit(burst)
        phases = [SyncPhase(total, m * per_unit(cluster), 1.0)]
        if cluster.device.fresh_write_bandwidth_bytes_per_s is not None:
            # a device that measured writes into fresh memory (a CPU: the allocator returns large
            # buffers to the OS, so each new one page-faults): every unit's gathered parameters, its
            # flat gradient (`passes.fsdp._Split`) and its reduce-scattered shard are new buffers
            # each micro-batch, written on the rank's own thread (exposed)
            fresh = gathers * compute.fresh_write_time_s(unit_bytes, cluster.device)
            fresh += compute.fresh_write_time_s(unit_bytes * reduced, cluster.device)
            fresh += compute.fresh_write_time_s(unit_bytes * reduced / shard.size, cluster.device)
            phases.append(SyncPhase(m * units * fresh, m * units * fresh, 0.0))
        return phases
    overlap_grad = ctx.overlap_grad_reduce
    if style is DataParallel.DDP:
        if overlap_grad:
            return [per_unit_phase(all_reduce_time_s, units, BACKWARD_SHARE / m, reduced)]
        return [whole(all_reduce_time_s, reduced)]
    if style is DataParallel.ZERO2:
        window = BACKWARD_SHARE if overlap_grad else 0.0
        grad = per_unit_phase(reduce_scatter_time_s, m * units, window, reduced)
        if not overlap_grad:  # each reduce-scatter waited for at once: all of it exposed
            grad = SyncPhase(grad.total_s, grad.total_s, 0.0)
    elif overlap_grad:
        grad = per_unit_phase(reduce_scatter_time_s, units, BACKWARD_SHARE / m, reduced)
    else:
        grad = whole(reduce_scatter_time_s, reduced)
    if ctx.overlap_param_gather:
        gather = per_unit_phase(all_gather_time_s, units, FORWARD_SHARE / m)
    else:
        gather = whole(all_gather_time_s)
    return [grad, gather]


def dp_sync_exposed_s(grad_bytes: float, stage_compute_s: float, ctx: CostContext) -> float:
    """The data-parallel traffic of `dp_sync_phases` that the step waits for: the sum over its phases
    of max(unhidden_s, total_s - eta x window x `stage_compute_s`) (the stage's compute of the step,
    all micro-batches; eta = `ClusterSpec.overlap_efficiency`) plus the `contention_s` of the rest,
    a phase without a window (nothing
    overlaps it) whole. Without overlap that is all of it but FSDP's, whose traffic hides behind the
    whole step down to the one unit's share per micro-batch."""
    eta, slowdown = ctx.cluster.overlap_efficiency, ctx.cluster.overlap_slowdown
    return sum(p.exposed_s(stage_compute_s, eta, slowdown) for p in dp_sync_phases(grad_bytes, ctx))


# Bytes per parameter of adding a 16-bit gradient into its fp32 main gradient: read the fp32 main
# gradient (4) and the 16-bit gradient (2), write the sum (4) (`runtime.data_parallel._MainGrads`)
MAIN_GRAD_ADD_BYTES_PER_PARAM = 10.0


def main_grad_accumulation_s(grad_bytes: float, ctx: CostContext) -> float:
    """Seconds per micro-batch to add a rank's 16-bit gradients into their fp32 main gradients
    (`WorkloadSpec.grad_reduce_dtype` fp32 on 16-bit parameters): the run's post-accumulate hook adds
    each parameter's `.grad` in as the backward makes it (`runtime.data_parallel._MainGrads`), one
    memory-bound add per parameter tensor and micro-batch on the compute stream
    (`MAIN_GRAD_ADD_BYTES_PER_PARAM`). Megatron-LM fuses this add into the weight-gradient GEMM
    (--gradient-accumulation-fusion); the runtime does not. ``grad_bytes``: the rank's gradients in the
    parameters' dtype (`OpOption.grad_bytes`). 0 without training or main gradients, and for ZeRO-2 and
    FSDP, which reduce-scatter each unit's gradients into fp32 shards instead (`sharded_grad_copy_s`)."""
    if not ctx.train or grad_bytes <= 0 or ctx.grad_reduce_scale <= 1.0:
        return 0.0
    if ctx.dp_style in (DataParallel.ZERO2, DataParallel.FSDP):
        return 0.0
    params = grad_bytes / ctx.bytes_per_element
    tensors = ctx.structure.num_param_tensors / ctx.mesh.pp
    dev = ctx.cluster.device
    add_s = compute.op_time_s(
        0.0, params * MAIN_GRAD_ADD_BYTES_PER_PARAM, dev, "fp32", "memory", launch=False
    )
    return add_s + _kernel_calls_s(dev, tensors)


def _kernel_calls_s(dev: DeviceSpec, kernels: float) -> float:
    """Fixed seconds of ``kernels`` calls the runtime makes outside the graph: the per-node overhead
    on a device priced per node (eager CPU, `costmodels.compute.node_overhead_s`), else a launch each."""
    if dev.node_overhead_s is not None:
        return compute.node_overhead_s(dev, kernels)
    return kernels * dev.launch_overhead_s


# Bytes per gradient byte (in the parameters' dtype) that ZeRO-2's and FSDP's runtimes move on the
# compute stream per micro-batch, beyond the collectives: gathering a unit's gradients into one flat
# reduce-scatter input (`runtime.data_parallel.Zero2Adam._reduce`: read them, write the flat buffer in
# the reduction dtype; `passes.fsdp._Split.backward` then `FsdpRuntime.reduce`: a concatenation in
# the parameters' dtype, then a cast when the reduction dtype differs), and on the reduced shard the
# mean (read + write) and its add into the rank's gradient shard (read both, write): 5 per shard byte
SHARD_MEAN_ADD_BYTES = 5.0


def sharded_grad_copy_s(grad_bytes: float, ctx: CostContext) -> float:
    """Seconds per micro-batch of ZeRO-2's and FSDP's gradient handling around each unit's
    reduce-scatter on the compute stream (`SHARD_MEAN_ADD_BYTES`): for ``grad_bytes`` U of gradients
    in the parameters' dtype, r = the reduction dtype's bytes over the parameters' (`CostContext.
    grad_reduce_scale`, 2 for fp32 gradients of 16-bit parameters) and S ranks per shard, ZeRO-2 moves
    (1 + r) U + 5 r U / S, FSDP 2 U + (1 + r) U (the cast, when r != 1) + 5 r U / S, memory-bound, with
    three kernels per wrapping unit (ZeRO-2: the flat copy, the mean, the add; FSDP: the concatenation
    for the first, one more for the cast). 0 for other styles and without training; for FSDP on a
    device that measured its writes into fresh memory (a CPU), whose page faults dominate there, the
    fresh-memory phase of `dp_sync_phases` prices the flat gradient and the shard instead (not these
    passes)."""
    style = ctx.dp_style
    if not ctx.train or grad_bytes <= 0 or style not in (DataParallel.ZERO2, DataParallel.FSDP):
        return 0.0
    dev = ctx.cluster.device
    if style is DataParallel.FSDP and dev.fresh_write_bandwidth_bytes_per_s is not None:
        return 0.0
    r = ctx.grad_reduce_scale
    per_byte = SHARD_MEAN_ADD_BYTES * r / max(1, ctx.state_shards)
    if style is DataParallel.ZERO2:
        per_byte += 1.0 + r
    else:
        per_byte += 2.0 + (1.0 + r if r != 1.0 else 0.0)
    copy_s = compute.op_time_s(0.0, grad_bytes * per_byte, dev, "fp32", "memory", launch=False)
    per_unit = 3 + (1 if style is DataParallel.FSDP and r != 1.0 else 0)
    kernels = per_unit * (max(1, round(len(ctx.structure.layers) / ctx.mesh.pp)) + 1)
    return copy_s + _kernel_calls_s(dev, kernels)


def grad_accumulation_s(grad_bytes: float, ctx: CostContext) -> float:
    """Seconds per micro-batch of a training rank's gradient work on the compute stream beside its
    layers' kernels: fp32 main gradients (`main_grad_accumulation_s`) or ZeRO-2's / FSDP's flat copies
    and shard updates (`sharded_grad_copy_s`)."""
    return main_grad_accumulation_s(grad_bytes, ctx) + sharded_grad_copy_s(grad_bytes, ctx)


def optimizer_step_time_s(grad_bytes: float, ctx: CostContext) -> float:
    """Adam step over the parameters whose gradients are `grad_bytes` per rank, over 1/dp of them with
    the distributed optimizer (`costmodels.compute.adam_step_time_s`: the device's measured per-parameter
    rates by tensor size, else the bytes a fused kernel moves); on a device priced per fx node (eager
    CPU) plus the fixed cost of each parameter tensor of the stage in torch's per-tensor loop: the
    device's measured `adam_tensor_overhead_s`, else `ADAM_OPS_PER_TENSOR` per-node overheads."""
    if not ctx.train or grad_bytes <= 0:
        return 0.0
    dev = ctx.cluster.device
    share = 1.0 / ctx.state_shards
    params = grad_bytes / ctx.bytes_per_element * share
    dispatch = dev.launch_overhead_s
    # eager CPU: torch's Adam loops over the tensors of the stage; ZeRO-1 and FSDP step one flat shard
    # per dtype, ZeRO-2 one slice per wrapping unit of fp32 parameters (16-bit: one fp32 master)
    zero2_slices = ctx.dp_style is DataParallel.ZERO2 and ctx.bytes_per_element == 4
    if dev.node_overhead_s is not None and (not ctx.distributed_optimizer or zero2_slices):
        tensors = ctx.structure.num_param_tensors / ctx.mesh.pp
        if zero2_slices:
            tensors = max(1, round(len(ctx.structure.layers) / ctx.mesh.pp)) + 1
        if dev.adam_tensor_overhead_s is not None:
            dispatch = tensors * dev.adam_tensor_overhead_s
        else:
            dispatch = compute.node_overhead_s(dev, tensors * ADAM_OPS_PER_TENSOR)
    large, cached = param_size_shares(ctx, params)
    return (
        dispatch
        + compute.adam_step_time_s(params, params * large, dev, ctx.dtype, params * cached)
        + loss_scaling_time_s(params, ctx)
    )


UNSCALE_BYTES_PER_ELEMENT = (
    8  # fp32 gradient read and written once (torch._amp_foreach_non_finite_check_and_unscale_)
)


def loss_scaling_time_s(params: float, ctx: CostContext) -> float:
    """Seconds per step of fp16 training's loss scaling (`ctx.loss_scale`; 0 without it) on a rank
    stepping ``params`` elements: one pass over their fp32 gradients that divides them by the scale and
    looks for inf / NaN (`UNSCALE_BYTES_PER_ELEMENT`, one foreach kernel per tensor list: torch.amp's
    GradScaler.unscale_), then the found-inf flag (4 bytes) all-reduced over every rank, so that all of
    them skip an overflowing step together (torch's ShardedGradScaler, Megatron-LM's found_inf
    all-reduce over its model-parallel group). Multiplying the loss by the scale is one scalar op per
    micro-batch, left out."""
    if ctx.loss_scale is None or not ctx.train:
        return 0.0
    dev = ctx.cluster.device
    unscale_s = compute.op_time_s(
        0.0, params * UNSCALE_BYTES_PER_ELEMENT, dev, "fp32", "memory", launch=False
    )
    flag_s = all_reduce_time_s(4.0, ctx.world_group(), ctx.cluster)
    return unscale_s + _kernel_calls_s(dev, 2) + flag_s


def param_size_shares(ctx: CostContext, params: float) -> tuple[float, float]:
    """Fractions of a rank's ``params`` optimizer elements in tensors over
    `costmodels.compute.LARGE_TENSOR_BYTES` and in tensors of at most `costmodels.compute.
    CACHED_TENSOR_BYTES`, in fp32 (the master / moment precision): the distributed optimizer steps one
    flat shard of ``params``; otherwise the model's tensors, matrices split over the TP degree
    (`ModelStructure.param_tensor_sizes`; the same fractions on every pipeline stage)."""
    if ctx.distributed_optimizer:
        nbytes = params * 4
        return (1.0 if nbytes > compute.LARGE_TENSOR_BYTES else 0.0), (
            1.0 if nbytes <= compute.CACHED_TENSOR_BYTES else 0.0
        )
    sizes = [n / ctx.mesh.tp if matrix else n for n, matrix in ctx.structure.param_tensor_sizes]
    total = sum(sizes)
    if not total:
        return 0.0, 0.0
    large = sum(n for n in sizes if n * 4 > compute.LARGE_TENSOR_BYTES) / total
    cached = sum(n for n in sizes if n * 4 <= compute.CACHED_TENSOR_BYTES) / total
    return large, cached


def _per_byte_fit(ctx: CostContext, seconds: Callable[[float], float]) -> LinearCost:
    """Affine fit of ``seconds(gradient bytes on a rank)`` through 1 MB and 1 GB (0 without training):
    the ILP's linear terms in a stage's gradient bytes."""
    if not ctx.train:
        return LinearCost(0.0, 0.0)
    return _line(seconds(FIT_SMALL_BYTES), seconds(FIT_BIG_BYTES))


FIT_SMALL_BYTES, FIT_BIG_BYTES = 1e6, 1e9  # the two gradient sizes the ILP's linear DP terms go through


def _line(small_s: float, big_s: float) -> LinearCost:
    """The affine cost through (`FIT_SMALL_BYTES`, ``small_s``) and (`FIT_BIG_BYTES`, ``big_s``)."""
    beta = (big_s - small_s) / (FIT_BIG_BYTES - FIT_SMALL_BYTES)
    return LinearCost(small_s - beta * FIT_SMALL_BYTES, beta)


def gradient_sync_cost(ctx: CostContext) -> LinearCost:
    """Affine fit of the DP gradient sync (`gradient_sync_time_s`) plus the optimizer step, per gradient
    byte on a rank."""
    return _per_byte_fit(ctx, lambda n: gradient_sync_time_s(n, ctx) + optimizer_step_time_s(n, ctx))


def grad_accumulation_cost(ctx: CostContext) -> LinearCost:
    """Affine fit of `grad_accumulation_s` (per micro-batch, on the compute stream) per gradient byte on
    a rank: the ILP adds it to each stage's time per micro-batch, as the prediction does."""
    return _per_byte_fit(ctx, lambda n: grad_accumulation_s(n, ctx))


def unhidden_sync_cost(ctx: CostContext) -> LinearCost:
    """Affine fit of the optimizer step plus the part of the DP traffic nothing hides
    (`dp_sync_parts`' second term), per gradient byte on a rank: the ILP's floor under FSDP's tail."""
    return _per_byte_fit(ctx, lambda n: dp_sync_parts(n, ctx)[1] + optimizer_step_time_s(n, ctx))


def dp_phase_costs(ctx: CostContext) -> list[tuple[LinearCost, LinearCost, float]]:
    """Per phase of `dp_sync_phases`, (affine fit of its total_s, of its unhidden_s, its window), per
    gradient byte on a rank: the ILP's terms for overlapped DP traffic (`ilp` prices each phase as
    `SyncPhase.exposed_s` does). Empty without training or DP."""
    if not ctx.train:
        return []
    lo, hi = dp_sync_phases(FIT_SMALL_BYTES, ctx), dp_sync_phases(FIT_BIG_BYTES, ctx)
    return [
        (_line(p.total_s, q.total_s), _line(p.unhidden_s, q.unhidden_s), p.window) for p, q in zip(lo, hi)
    ]


def optimizer_step_cost(ctx: CostContext) -> LinearCost:
    """Affine fit of the optimizer step (`optimizer_step_time_s`) per gradient byte on a rank."""
    return _per_byte_fit(ctx, lambda n: optimizer_step_time_s(n, ctx))


def recompute_input_bytes(ctx: CostContext) -> float:
    """Activation bytes a layer keeps per micro-batch under full recomputation: its input (tokens x
    hidden), a sequence shard of it with sequence parallelism (Korthikanti et al. 2022, section 5)."""
    split = ctx.mesh.tp if ctx.sequence_parallel else 1
    return ctx.tokens * ctx.structure.hidden_size * ctx.bytes_per_element / split


def recompute_working_bytes(activation_bytes: float, ctx: CostContext) -> float:
    """Bytes a fully recomputed layer holds for a moment during its backward beyond the input it keeps:
    its forward runs again there and stores what it stores without recomputation (``activation_bytes``,
    one micro-batch's) until its backward has used them. One such layer at a time on a rank, so a stage's
    peak adds the largest of its layers' (`prediction.predict`, the ILP's ``recompute_working``); HF
    batched_mm experts' gathered weight copies (`graph_expert_activation_bytes`) are among them.
    Korthikanti et al. 2022 (section 5) count the kept inputs only."""
    return max(0.0, activation_bytes - recompute_input_bytes(ctx))

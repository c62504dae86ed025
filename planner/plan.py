"""The plan: a typed, serialisable value produced by the planner and consumed by passes and runtime.

A `Plan` says how one model runs on one cluster for one workload:

- the `mesh` `tp x pp x dp` (tensor-, pipeline- and data-parallel degrees, a `MeshShape`), the
  `micro_batches` per step and the pipeline `schedule` (a `Schedule`, defined with the memory cost
  model that prices it, `costmodels.memory`, and re-exported here);
- `splits`: how each weight is sharded over the `tp` axis, keyed by parameter FQN (a weight missing
  from `splits` is replicated);
- `stages`: which layers each pipeline rank holds (contiguous, in order; with the interleaved
  schedule, v runs of consecutive layers: `Plan.virtual_stage_layers`);
- `ladder_layers`: the layers that use ladder residual connections;
- `predicted`: the predicted latency / throughput / memory with a per-layer breakdown, and
  `baseline`: the prediction of the hand-written Megatron plan under the same cost model;
- `solver`, `decisions`, `excluded`, `mesh_candidates`: why the plan is what it is;
- `fallbacks`: ops the TP pass runs replicated that the ILP did not price (found by lowering the plan,
  priced into `predicted`), and `cluster_source`: the preset or YAML file the cluster came from;
- facts of the model, not decisions, read by exports: `num_experts` and the routing of its
  mixture-of-experts layers (`moe_top_k`, `moe_score_function`, `moe_expert_intermediate_size`,
  `moe_shared_intermediate_size`: unknown, 0 / "" / None, in plans written before them), `roles`,
  `adapters`.

Split conventions (`WeightSplit`):

| style       | meaning                                                        | nn.Linear (out, in) | HF Conv1D (in, out) |
|-------------|----------------------------------------------------------------|---------------------|---------------------|
| "colwise"   | output features split; output stays sharded on its last dim   | dim 0               | dim 1               |
| "rowwise"   | input features split; output is a partial sum (all-reduce)    | dim 1               | dim 0               |
| "vocab"     | embedding: rows (vocab) split, masked lookup + all-reduce;      | dim 0               | dim 1               |
|             | LM head: vocab (output) split, logits all-gathered on last dim |                     |                     |
| "replicate" | not split (listed only when a decision was made about it)      | -                   | -                   |

A colwise weight's bias is split like its output; a rowwise weight's bias is added once, after the
reduction. A fused projection (GPT-2 `c_attn`: Q, K and V in one matrix) carries `parts`, the sizes
of its parts along the split dim; each part is split into `tp` equal pieces separately and rank r
holds piece r of every part, concatenated in part order.

YAML round trip: `Plan.to_yaml(path)` writes atomically; `Plan.from_yaml(path)` reads with
`yaml.safe_load` only (loading a plan never executes code) and raises `InputError` naming the field
for a malformed plan. Plans written before the mesh was one field (top-level `tp`, `pp`, `dp`, and
mesh candidates with the micro-batches in their note) are still read.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import hashlib
import json
import math
import os
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from costmodels.cluster import safe_dump, safe_load_unique
from costmodels.dtypes import DTYPE_BYTES
from costmodels.expert_parallel import DEFAULT_MOE_IMBALANCE
from costmodels.memory import DataParallel, Recompute, Schedule
from planner.errors import InputError
from planner.files import PLAN_HEADER, with_digest, write_text_atomic

if TYPE_CHECKING:
    from costmodels.cluster import ClusterSpec


class Workload(str, enum.Enum):
    """What one step of the plan is."""

    FORWARD = "forward"  # one forward pass over (batch, seq_len) tokens (inference prefill)
    DECODE = "decode"  # one new token per sequence against a KV cache of `context` tokens
    TRAIN = "train"  # forward, backward and optimizer step
    GENERATE = "generate"  # a request: prefill of `seq_len` prompt tokens, then decode steps (cached models)

    def __str__(self) -> str:
        return self.value


class SplitStyle(str, enum.Enum):
    """How a weight is sharded over the tensor-parallel axis (table in the module docstring)."""

    COLWISE = "colwise"
    ROWWISE = "rowwise"
    VOCAB = "vocab"
    REPLICATE = "replicate"

    def __str__(self) -> str:
        return self.value


class Layout(str, enum.Enum):
    """Where an activation lives over the tensor-parallel axis."""

    REPLICATE = "R"  # every rank holds the whole tensor
    SHARD = "S"  # rank r holds slice r of the last dim (heads, for attention)
    PARTIAL = "P"  # every rank holds a partial sum; the tensor is their sum

    def __str__(self) -> str:
        return self.value


RECOMPUTE_PLAN_WIDE_KEYS = ("*", "layer")  # Plan.recompute keys that set every layer whose class is not named
SPLIT_STYLES: tuple[str, ...] = tuple(s.value for s in SplitStyle)
WORKLOADS: tuple[str, ...] = tuple(w.value for w in Workload)
SCHEDULES: tuple[str, ...] = tuple(s.value for s in Schedule)
DP_STYLES: tuple[str, ...] = tuple(s.value for s in DataParallel)
# the dtype training gradients are accumulated and reduced in (`Plan.grad_reduce_dtype`): the
# parameters' own, or fp32 (Megatron-LM's fp32 main gradients with --bf16)
GRAD_REDUCE_DTYPES: tuple[str, ...] = ("param", "fp32")
# fp16 training's loss scaling (`Plan.loss_scale`): "dynamic", or a static scale (a positive number)
DYNAMIC_LOSS_SCALE = "dynamic"
# dynamic loss scaling's policy: torch.amp.GradScaler's defaults (https://pytorch.org/docs/stable/amp.html):
# start at 2**16, multiply by 0.5 at an overflow and by 2 after 2,000 steps in a row without one
DYNAMIC_INIT_SCALE = 2.0**16
GROWTH_INTERVAL = 2000
GROWTH_FACTOR, BACKOFF_FACTOR = 2.0, 0.5
FP32_MAX = 3.4028234663852886e38  # the largest finite fp32 (torch.finfo(torch.float32).max): a scale's bound
# context-parallel attention variants (`Plan.cp_comm_type`; run by `passes.context_parallel`)
CP_COMM_TYPES: tuple[str, ...] = ("ring", "allgather", "alltoall")
# where expert parallelism's ranks come from (`Plan.ep_fold`): the dp x cp ranks (tokens move by
# all-to-all) or the TP ranks (tokens replicated: partial outputs all-reduced)
EP_FOLDS: tuple[str, ...] = ("dp", "tp")
# the function a mixture-of-experts router's logits go through (`Plan.moe_score_function`), by
# Megatron-Core's --moe-router-score-function names
MOE_SCORE_FUNCTIONS: tuple[str, ...] = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MeshShape:
    """The device mesh of a plan: tp x cp x dp x pp devices,
    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank: Megatron-Core's order (tp-cp-dp-pp,
    pipeline outermost) and torchtitan's (pp, dp, cp, tp), so the ranks of a data-parallel (and expert-
    parallel) group share a node where a node holds several, and pipeline stages span nodes.

    tp: tensor-parallel degree (innermost, fastest-varying: TP ranks share a node); cp: context-parallel
    degree (each sequence's tokens split over cp ranks, next to the TP ranks as Megatron-Core's
    tp-cp-... order puts them, so a CP group of tp x cp <= devices per node stays on NVLink); pp:
    pipeline stages; dp: data-parallel replicas. The CP ranks of a replica hold the same weights: the
    data-parallel gradient reduction and sharded states span dp x cp ranks (`dp_cp`), as in
    Megatron-Core (its dp-cp group) and torchtitan (FSDP over dp_shard x cp).
    """

    tp: int
    pp: int
    dp: int
    cp: int = 1

    @property
    def num_devices(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same weights: dp x cp (the gradient reduction's group size)."""
        return self.dp * self.cp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of global `rank` (`cp_rank` gives the fourth). Raises ValueError
        outside the mesh."""
        if not 0 <= rank < self.num_devices:
            raise ValueError(f"rank {rank} is outside a mesh of {self.num_devices} devices")
        inner = self.cp * self.tp
        return (rank // inner) % self.dp, rank // (self.dp * inner), rank % self.tp

    def cp_rank(self, rank: int) -> int:
        """Context-parallel rank of global `rank` (0 .. cp - 1). Raises ValueError outside the mesh."""
        self.coords(rank)
        return (rank // self.tp) % self.cp

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        """Global rank at mesh coordinates (dp_rank, pp_rank, cp_rank, tp_rank)."""
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def label(self) -> str:
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        return f"tp={self.tp}{cp} pp={self.pp} dp={self.dp}"


@dataclass
class WeightSplit:
    """How one weight is sharded over the tensor-parallel axis."""

    weight: str  # parameter FQN, e.g. "model.layers.0.mlp.up_proj.weight"
    style: SplitStyle
    dim: int  # tensor dim that is split (0 or 1); for "replicate" the dim is 0 and unused
    parts: list[int] | None = None  # fused projections: sizes of the parts along `dim`, split separately
    # colwise over fewer pieces than tp (a GQA model with fewer KV heads than ranks: K/V projections cut
    # into `pieces` KV heads, rank r holds piece r * pieces // tp, each head replicated on tp / pieces
    # ranks, as vLLM does); None: tp pieces
    pieces: int | None = None
    # the op beside it in the layer runs replicated (`planner.solver.search._splits`): colwise, its
    # output is all-gathered for the op that reads it (a norm or index over the full width); rowwise,
    # its input is a replicated tensor each rank slices. False: Megatron's pairing (shard to shard)
    gather_output: bool = False
    replicated_input: bool = False

    def __post_init__(self) -> None:
        self.style = _coerce(SplitStyle, self.style, f"splits.{self.weight}.style")


@dataclass
class LayerCost:
    """Predicted cost of one transformer layer (or of the non-layer ops, layer = -1) under the plan."""

    layer: int  # layer index; -1 for embeddings / final norm / LM head
    stage: int  # pipeline stage holding the layer
    compute_s: float  # compute time per step (all micro-batches, forward [+ backward])
    exposed_comm_s: float  # communication time not hidden behind compute
    # communication time hidden behind compute (ladder residual, TP overlap, CP rings), net of the
    # compute it slows (`ClusterSpec.overlap_slowdown`, counted in exposed_comm_s): the time overlap saves
    overlapped_comm_s: float
    memory_bytes: float  # memory per rank attributable to this layer
    strategy: dict[str, str] = field(default_factory=dict)  # op group -> chosen strategy


@dataclass
class StageCost:
    """Predicted cost of one pipeline stage per micro-batch (training: forward and backward), on each
    of its ranks: what the step time is made of (`planner.solver.costing.step_time_s`)."""

    stage: int
    compute_s: float  # per micro-batch
    exposed_comm_s: float  # per micro-batch: TP collectives not hidden, the send to the next stage
    overlapped_comm_s: float  # per micro-batch: hidden behind compute, net of the compute it slows
    memory_bytes: float  # per rank of the stage: weights, training state, in-flight activations, buffers


@dataclass
class Prediction:
    """Predicted performance of a plan (per training step, per forward pass or per decode step)."""

    latency_s: float  # time of one step (forward pass / decode step / training step)
    throughput_tokens_per_s: float  # tokens processed (or generated, for decode) per second
    peak_memory_bytes: float  # largest memory of any rank
    compute_s: float  # compute time on the critical path
    exposed_comm_s: float  # communication time on the critical path
    overlapped_comm_s: float  # communication hidden behind compute, net of the compute it slows (`LayerCost`)
    bubble_s: float  # pipeline bubble time
    per_layer: list[LayerCost] = field(default_factory=list)
    # per stage, per micro-batch (empty in plans written before they were recorded), and the work
    # after the pipeline drains (training): the DP gradient all-reduce, then the optimizer step
    per_stage: list[StageCost] = field(default_factory=list)
    grad_sync_s: float = 0.0
    optimizer_s: float = 0.0
    # of compute_s: the serving engine's host work in the step (the cluster's `device.serving_host`)
    serving_host_s: float = 0.0
    # FLOP of one step's math on the whole model (training: forward + backward; recomputation not
    # counted; attention causal), and the devices it runs on: model FLOP/s per device =
    # model_flops / latency_s / num_devices (0: not priced)
    model_flops: float = 0.0
    num_devices: int = 0

    @property
    def model_flops_per_s_per_device(self) -> float:
        """Model FLOP/s per device (0.0 when not priced)."""
        if not self.model_flops or not self.num_devices or not self.latency_s:
            return 0.0
        return self.model_flops / self.latency_s / self.num_devices


# a served request generates at least two tokens: the prefill yields the first, a decode step the next
# (with one, no decode step runs and there is no time per output token to plan or measure)
MIN_NEW_TOKENS = 2


def check_new_tokens(new_tokens: int, name: str = "--new-tokens") -> None:
    """Raise InputError naming ``name`` unless ``new_tokens`` >= `MIN_NEW_TOKENS`."""
    if new_tokens < MIN_NEW_TOKENS:
        raise InputError(
            f"{name} must be at least {MIN_NEW_TOKENS}, got {new_tokens}: the prefill yields the first token "
            "and each decode step one more, so a request of fewer has no decode step to plan or time"
        )


@dataclass
class Serving:
    """A request served with the plan (models with a KV cache): a prefill of `prompt_len` tokens per
    sequence, then decode steps until `new_tokens` tokens are generated, with the caches allocated for
    `cache_len` tokens. Every decode step attends over the whole allocated cache, so each costs the same.
    """

    prompt_len: int  # tokens per sequence before the first decode step (--workload decode: the context)
    new_tokens: int  # tokens generated per sequence (the first comes from the prefill), >= MIN_NEW_TOKENS
    cache_len: int  # allocated KV-cache length, tokens
    ttft_s: float  # predicted time to first token: the prefill step
    tpot_s: float  # predicted time per output token: one decode step
    tokens_per_s: float  # generated tokens over the whole request: batch * new_tokens / request time
    fallbacks: list[str] = field(default_factory=list)  # what the rewrite replicates instead of sharding
    standard_tpot_s: float | None = None  # ladder plans: the decode step of the same splits without ladder
    # predicted peak memory per rank of the prefill (its P tokens' activations beside the weights and
    # caches); the plan's `Prediction.peak_memory_bytes` is the larger of it and the decode step's
    prefill_peak_memory_bytes: float | None = None
    # positions the model was trained for, from its config (Hugging Face `max_position_embeddings`, the
    # examples' `max_seq_len`); None when the model file's model has no such config
    trained_positions: int | None = None

    @property
    def request_s(self) -> float:
        """Predicted time of the whole request: the prefill, then new_tokens - 1 decode steps."""
        return self.ttft_s + (self.new_tokens - 1) * self.tpot_s


@dataclass
class SolverInfo:
    """How the ILP solve went. `status` is `pulp.LpSolution[prob.sol_status]` (honest about time-outs)."""

    status: str  # e.g. "Optimal Solution Found", "Solution Found" (time limit hit, feasible)
    objective: float  # objective value of the chosen mesh's ILP (seconds)
    gap: float  # relative optimality gap (0.0 when proven optimal)
    time_s: float  # total solver wall time over all mesh candidates
    num_variables: int  # variables of the chosen mesh's ILP


# the "megatron-baseline" decision's note when the hand-written layout splits other weights than the
# plan, or splits them otherwise (`planner.cli.workflow._lower_baseline`; the report names it)
BASELINE_OTHER_SPLITS = "its weight splits differ from this plan's"
# the start of its note when the passes cannot lower the hand-written layout (followed by the refusal)
BASELINE_WOULD_NOT_RUN = "it would not run"


@dataclass
class Decision:
    """One choice the planner made, with the predicted cost of each alternative (in seconds)."""

    subject: str  # e.g. "layers.mlp", "mesh", "ladder"
    chosen: str
    options: dict[str, float]  # alternative -> cost in seconds (inf = not allowed, or `unsolved`)
    reason: str
    # alternative -> its predicted peak memory per rank, bytes, where the decision prices it (the
    # data-parallel styles); empty otherwise
    memory_bytes: dict[str, float] = field(default_factory=dict)
    # alternatives of `options` at inf because no mesh with them was solved (over memory, or pruned by their
    # lower bound), not because a pin or the model rules them out: shown as "not solved"
    unsolved: list[str] = field(default_factory=list)


@dataclass
class MeshCandidate:
    """One mesh considered by the search, with its predicted latency (None: infeasible or not solved)."""

    mesh: MeshShape
    micro_batches: int  # pipeline micro-batches per step priced with this mesh
    latency_s: float | None
    note: str = ""  # why infeasible or not solved, or the solver status
    layout: str = ""  # training features beside the mesh, e.g. "interleaved_1f1b v=2, sp, zero1"

    def label(self) -> str:
        """'tp=8 pp=2 dp=1 m=4', with the layout in brackets when there is one."""
        return f"{self.mesh.label()} m={self.micro_batches}" + (f" [{self.layout}]" if self.layout else "")


@dataclass
class Fallback:
    """An op the TP pass runs replicated, all-gathering sharded inputs, that the ILP did not price.

    Found by lowering the plan on meta tensors (`passes.verify`); its all-gather time is added to
    `Plan.predicted` (exposed communication) and shown as its own line in the report.
    """

    op: str  # e.g. "aten.index_put"
    line: str  # the user's source line, e.g. "model.py:31 `cache[:, :, pos] = k`"
    node: str  # fx node name in the captured graph
    bytes_gathered: float  # bytes all-gathered per micro-batch, in the plan's dtype (all its places)
    comm_s: float  # added to the predicted step time (all micro-batches, backward included)
    places: int = 1  # layers the gather repeats in (a representative layer's lowering stands for them)
    memory_bytes: float = 0.0  # added to the predicted peak memory per rank (`passes.verify`)
    compute_s: float = 0.0  # the op on the whole tensor instead of a 1/tp shard, added to the step time

    @property
    def context_parallel(self) -> bool:
        """Whether the CP pass, not the TP pass, gathered here (the whole sequence: `passes.verify` names
        it "(context parallelism: whole sequence gathered ...)")."""
        return "(context parallelism:" in self.op


def fallback_memory_bytes(fallbacks: list[Fallback], workload: Workload) -> float:
    """Bytes per rank `fallbacks` add to the peak: the sum in training, which keeps every gathered
    tensor for the backward, else the largest (a forward holds one at a time)."""
    sizes = [f.memory_bytes for f in fallbacks]
    if not sizes:
        return 0.0
    return sum(sizes) if workload is Workload.TRAIN else max(sizes)


def model_path_beside(model: str, plan_path: str | os.PathLike[str]) -> str:
    """The ``model`` path (as given to planner optimize: relative to the working directory) written
    relative to the folder of the plan file at ``plan_path``, which `Plan.model_file` resolves it
    against; unchanged when absolute or not a file here."""
    given = Path(model)
    if given.is_absolute() or not given.is_file():
        return model
    return os.path.relpath(os.path.abspath(given), os.path.dirname(os.path.abspath(plan_path)))


@dataclass
class Plan:
    """A parallelisation plan for one model, cluster and workload. See the module docstring."""

    model: str
    cluster: str  # cluster name
    workload: Workload
    batch_size: int  # global batch (sequences)
    seq_len: int  # tokens per sequence (decode: 1 new token per sequence)
    context: int  # decode: KV-cache length in tokens; 0 otherwise
    micro_batches: int  # pipeline micro-batches per step (1 when pp == 1 and not training)
    dtype: str  # "bf16" | "fp16" | "fp32"
    mesh: MeshShape
    splits: dict[str, WeightSplit]  # by weight FQN; missing = replicated
    stages: list[list[int]]  # layer indices per stage
    ladder_layers: list[int]
    predicted: Prediction
    solver: SolverInfo
    schedule: Schedule = Schedule.ONE_F_ONE_B  # pipeline schedule, priced and run (pp > 1)
    decisions: list[Decision] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)  # e.g. "tp=3: 32 heads not divisible by 3"
    baseline: Prediction | None = None  # the hand-written Megatron plan under the same cost model
    baseline_layout: dict[str, str] = field(default_factory=dict)  # its `layout_summary`, as text
    # training: the torchtitan recipe a PyTorch-native user writes (FSDP, TP 8 for large models, PP when
    # needed; `planner.solver.baseline.torchtitan_configs`) under the same cost model, and its layout
    torchtitan_baseline: Prediction | None = None
    torchtitan_layout: dict[str, str] = field(default_factory=dict)
    mesh_candidates: list[MeshCandidate] = field(default_factory=list)
    token_model: bool = True  # reads token ids: sequence length and tokens/s apply (else samples/s)
    unpriced_ops: list[str] = field(
        default_factory=list
    )  # ATen ops the cost model priced as memory-bound by default
    fallbacks: list[Fallback] = field(default_factory=list)  # unplanned all-gathers, priced (Fallback)
    cluster_source: str = ""  # where the cluster spec came from: a preset name or the YAML file's path
    serving: Serving | None = None  # decode / generate plans of models with a KV cache
    # Training at scale (Megatron-LM's layouts). virtual_stages: model chunks per pipeline rank (v of
    # the interleaved 1F1B schedule; 1 otherwise). With v > 1, stages[r] lists rank r's layers in
    # order and they form v runs of consecutive layer indices, its chunks; chunk c of rank r is
    # virtual stage c * pp + r (torch.distributed.pipelining's interleaved placement), and the
    # virtual stages 0 .. pp * v - 1 hold the layers in model order (`virtual_stage_layers`). E.g. pp=2,
    # v=2, 8 layers: stages [[0, 1, 4, 5], [2, 3, 6, 7]]. sequence_parallel: the norm/dropout regions between
    # TP blocks are split along the sequence and each TP all-reduce is a reduce-scatter + all-gather
    # (Korthikanti et al. 2022). recompute: layer class (the CostTables graph key, e.g. "layer") ->
    # activation recomputation; a class not listed recomputes nothing (users read it by layer:
    # `recompute_text`, `recompute_ranges`). dp_style: how the data-parallel ranks hold the training
    # state (`DataParallel`: ddp, zero1 = Megatron-LM's distributed optimizer, zero2, fsdp); dp_shard:
    # the ranks each sharded state is split over (1 for ddp; dp for zero1 / zero2; a divisor of dp
    # for fsdp, HSDP when below dp: replicated over dp / dp_shard groups); reshard_after_forward: fsdp
    # frees each unit's gathered parameters after its forward and gathers them again for its backward.
    # Communication overlap (each priced as the part of its traffic compute cannot hide):
    # tp_comm_overlap: each TP block's collectives are cut into chunks along the tokens so that a chunk's
    # transfer runs while the next chunk's GEMM computes (Megatron-LM --tp-comm-overlap, torchtitan's
    # async TP); overlap_grad_reduce: training, dp > 1, the data-parallel gradient reduction is issued
    # per bucket (a layer) from the backward as each bucket's gradients are ready (PyTorch DDP's
    # reducer, Megatron-LM --overlap-grad-reduce); overlap_param_gather: zero1 / zero2, the parameter
    # all-gather after the optimizer step is issued per bucket without waiting and each bucket is
    # waited for just before its first use in the next forward (Megatron-LM --overlap-param-gather).
    virtual_stages: int = 1
    sequence_parallel: bool = False
    recompute: dict[str, Recompute] = field(default_factory=dict)
    dp_style: DataParallel = DataParallel.DDP
    dp_shard: int = 1
    reshard_after_forward: bool = True
    tp_comm_overlap: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # grad_reduce_dtype (training): the dtype the data-parallel gradients are accumulated over the
    # micro-batches and reduced in: "param" (the parameters' dtype, the 16-byte mixed-precision count
    # of ZeRO section 3.1, what the planner's runtime runs) or "fp32" (4-byte gradients of 16-bit
    # parameters: Megatron-LM's default with --bf16, its fp32 main_grad; torchtitan's
    # mixed_precision_reduce "float32"), priced for exports: the reduction moves twice the bytes of a
    # 16-bit gradient and the gradient buffer is twice as large; `planner run` refuses it
    grad_reduce_dtype: str = "param"
    # loss_scale (fp16 training): the loss is multiplied by a scale before the backward and the gradients
    # divided by it before the optimizer step, so that small gradients stay above fp16's smallest normal
    # (6.1e-5); a step whose gradients overflow is skipped. "dynamic": torch.amp.GradScaler's policy,
    # starting at 2**16, halved at each overflow and doubled after 2,000 steps without one (Megatron-LM's
    # --fp16 default is dynamic too); a number: a static scale (Megatron-LM's --loss-scale); null: none
    # (bf16 and fp32 share fp32's exponent range and need none). `runtime.loss_scaling`.
    loss_scale: float | str | None = None
    # Context parallelism (mesh.cp > 1): every sequence's tokens split over the CP ranks for every layer;
    # cp_comm_type: how attention reaches the other ranks' keys and values (`CP_COMM_TYPES`: "ring" passes
    # K/V blocks peer to peer under the blocks' attention, Megatron-Core's p2p; "allgather" gathers K/V
    # once per layer, Llama 3's choice; "alltoall" swaps tokens for heads around attention, DeepSpeed
    # Ulysses / Megatron-Core's a2a); cp_load_balance: a causal model's sequence is cut into 2 x cp chunks
    # and rank r holds chunks r and 2cp-1-r so that every rank does the same attention work
    # (`passes.context_parallel`). Unused at cp == 1.
    cp_comm_type: str = "allgather"
    cp_load_balance: bool = True
    # Expert parallelism (mixture-of-experts models): ep: the ranks each MoE layer's experts are split over
    # (rank e of an EP group holds experts e * E/ep .. (e+1) * E/ep - 1; tokens go to their experts and
    # back by all-to-all, `passes.expert_parallel`). The EP group folds over the dp x cp ranks of one
    # (pp, tp) coordinate, as Megatron-Core's and torchtitan's experts borrow the data-parallel ranks:
    # ep consecutive ranks of the "dp_cp" group; the expert weights are replicated over dp x cp / ep ranks
    # (the expert data-parallel group, "edp") and over the TP ranks. 1: every rank holds every expert.
    # ep_fold "tp": the EP group is the TP group instead (ep == tp), whose ranks hold the same tokens:
    # each runs its experts on every token routed to them and one all-reduce over TP adds the parts, no
    # token moves (vLLM's --enable-expert-parallel at data-parallel size 1; serving).
    ep: int = 1
    ep_fold: str = "dp"
    # expert tensor parallelism (ep_fold dp, or ep 1): 1 keeps each expert whole on every TP rank (the same
    # tokens, the same experts: replicated work); tp splits every routed expert over the TP ranks as a
    # Megatron MLP (gate / up column-parallel, down row-parallel along the expert width), the experts'
    # partial outputs all-reduced over TP after the combine (Megatron-Core's
    # --expert-tensor-parallel-size, its default at EP 1; torchtitan's expert_tensor_parallel_degree; vLLM's
    # fused MoE without --enable-expert-parallel). Under sequence parallelism the block's tokens are
    # gathered before its router, so every TP rank routes all of them (`passes.ep_lower`)
    expert_tp: int = 1
    # the routing a MoE plan was priced with (`planner.solver.problem.WorkloadSpec`, --moe-imbalance,
    # --moe-capacity-factor): the busiest EP rank's rows over the mean, and the capacity factor of a
    # model that drops the tokens beyond it (None: dropless); re-pricing the plan uses them again
    moe_imbalance: float = DEFAULT_MOE_IMBALANCE
    moe_capacity_factor: float | None = None
    # routed experts per mixture-of-experts layer of the model the plan was made for (0: a dense model,
    # or layers with different counts): a fact of the model, not a decision, read by exports
    # (Megatron-LM's --num-experts, vLLM's and torchtitan's expert parallelism)
    num_experts: int = 0
    expert_params: int = 0  # of `model_params`, the routed experts' (each rank holds 1/ep of them, whole)
    # how those layers route, each one value when every MoE layer agrees (facts of the model, read by
    # exports: Megatron-LM's --moe-router-topk, --moe-router-score-function, --moe-ffn-hidden-size,
    # --moe-shared-expert-intermediate-size): the experts each token runs (0: unknown), the function the
    # router's logits go through (`MOE_SCORE_FUNCTIONS`, before or after its top-k; "": unknown), one
    # routed expert's MLP width (0: unknown) and the shared experts' MLP width every token runs (0: no
    # shared expert; None: unknown). Unknown also for a dense model, layers that differ, and plans
    # written before these fields
    moe_top_k: int = 0
    moe_score_function: str = ""
    # whether each token's k routing weights are renormalised to sum to 1 (`planner.frontend.moe.MoE.renormalised`;
    # Megatron's --moe-router-pre-softmax when not, under softmax); None: unknown, as above
    moe_topk_renormalised: bool | None = None
    moe_expert_intermediate_size: int = 0
    moe_shared_intermediate_size: int | None = None
    # the shared experts' output scaled by a sigmoid gate of one output per token (`MoE.shared_expert_gate`;
    # None: unknown, a plan written before this field)
    moe_shared_expert_gate: bool | None = None
    # the routing weights scale the experts' inputs, not weigh their outputs (`MoE.input_scale`, Llama 4;
    # Megatron-Core's --moe-apply-probs-on-input); None: unknown, a plan written before this field
    moe_probs_on_input: bool | None = None
    # which layers are mixtures of experts, one 1 (MoE) or 0 (dense MLP) per layer, when the model mixes
    # them (DeepSeek-V3's 3 dense layers before 58 MoE ones: Megatron-LM's --moe-layer-freq); [] when every
    # layer is one, for a dense model, and for plans written before this field
    moe_layers: list[int] = field(default_factory=list)
    # parameters of the model the plan was made for (0: a plan written before this field): `planner run`
    # refuses a model file whose parameter count differs (it changed since planning)
    model_params: int = 0
    # `decisions_digest` when the plan was priced (empty: a plan written before this field); `planner
    # run` re-prices a plan whose decisions no longer match it (edited by hand after planning)
    priced_digest: str = ""
    # what each projection computes in the model, by weight FQN (`planner.frontend.analysis.Role`
    # values: "q", "k", "v", "qkv", "o", "up", "gate", "down", "fc", "lm_head"): a fact of the model,
    # not a decision (not in the digest), read by exports to tell a stream-input projection from a
    # block-output one; empty in plans written before this field
    roles: dict[str, str] = field(default_factory=dict)
    # LoRA adapters of the model (`planner.frontend.roles.Adapter`): each adapter weight's FQN -> the
    # weight of the projection it adapts (split with it), and the model's frozen parameter elements
    # (requires_grad=False); facts of the model, read by exports; empty / 0 in plans written before them
    adapters: dict[str, str] = field(default_factory=dict)
    frozen_params: int = 0
    # how the TP pass placed the captured graph's ops on one rank (`passes.tensor_parallel.rule_coverage`):
    # "general" (DTensor's sharding semantics), "own" (a rule of this project's), "replicated" (run
    # whole; the gathered ones are `fallbacks`); empty for TP=1 plans and plans written before this field
    op_placement: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.workload = _coerce(Workload, self.workload, "workload")
        self.schedule = _coerce(Schedule, self.schedule, "schedule")
        self.dp_style = _coerce(DataParallel, self.dp_style, "dp_style")

    @property
    def distributed_optimizer(self) -> bool:
        """Adam's state is sharded over the data-parallel ranks (ZeRO-1 or more: `dp_style`)."""
        return self.dp_style.shards_optimizer

    @property
    def dp_replicate(self) -> int:
        """Replicas of each shard: dp / dp_shard (HSDP's replicate degree; dp for ddp)."""
        return self.mesh.dp // max(1, self.dp_shard)

    def dp_style_text(self) -> str:
        """The data-parallel style as a user reads it: "ddp", "zero1", "fsdp (reshard after forward)",
        "hsdp: fsdp over 4 x replicate 2"."""
        return dp_style_text(self.dp_style, self.mesh.dp, self.dp_shard, self.reshard_after_forward)

    def saved_cluster(self, nproc: int | None = None) -> ClusterSpec | None:
        """The cluster the plan was made for, from its `cluster_source` or else its `cluster` name; None
        when neither loads here (``nproc`` as `costmodels.cluster.load_cluster` takes it)."""
        from costmodels.cluster import load_cluster  # noqa: PLC0415 - specs are read only on demand

        for source in (self.cluster_source, self.cluster):
            if not source:
                continue
            try:
                return load_cluster(source, nproc=nproc)
            except InputError:
                continue
        return None

    @property
    def num_devices(self) -> int:
        """Devices used by the plan."""
        return self.mesh.num_devices

    @property
    def tp(self) -> int:
        """Tensor-parallel degree (`mesh.tp`)."""
        return self.mesh.tp

    @property
    def pp(self) -> int:
        """Pipeline stages (`mesh.pp`)."""
        return self.mesh.pp

    @property
    def dp(self) -> int:
        """Data-parallel replicas (`mesh.dp`)."""
        return self.mesh.dp

    @property
    def cp(self) -> int:
        """Context-parallel degree (`mesh.cp`): ranks each sequence's tokens are split over."""
        return self.mesh.cp

    def cp_text(self) -> str:
        """Context parallelism as a user reads it: "off", "4 (allgather, load-balanced)"."""
        return cp_text(self.mesh.cp, self.cp_comm_type, self.cp_load_balance)

    def ep_text(self) -> str:
        """Expert parallelism as a user reads it: "off", "8 over dp", "8 over tp", "8 over dp, experts split
        over tp 4", "off, experts split over tp 4" (`ep_text`)."""
        return ep_text(self.ep, self.ep_fold, self.expert_tp, self.cp)

    @property
    def micro_batch_size(self) -> float:
        """Sequences per micro-batch on one data-parallel replica."""
        return self.batch_size / (self.dp * self.micro_batches)

    @property
    def experts_on_sequence_shard(self) -> bool:
        """Whether whole routed experts under expert parallelism over dp x cp run each TP rank's sequence
        shard of the tokens (sequence parallelism at one sequence per micro-batch: `passes.ep_lower`), so
        each TP rank's expert gradients sum only its own tokens: they are reduced over the TP ranks as well
        as the expert data-parallel ones, once a step (`runtime.mesh.ep_ranks`; Megatron-Core's
        expert-data-parallel group spans the TP ranks when the experts are not split over them)."""
        return (
            self.ep > 1 and self.ep_fold == "dp" and self.expert_tp == 1 and self.tp > 1
            and self.sequence_parallel and self.micro_batch_size == 1
        )  # fmt: skip

    def layout_summary(self) -> dict[str, Any]:
        """The mesh and schedule as plain data (reports, emitted modules' meta.json)."""
        return {
            "tp": self.tp,
            "cp": self.cp,
            "pp": self.pp,
            "dp": self.dp,
            "micro_batches": self.micro_batches,
            "micro_batch_size": int(self.micro_batch_size)
            if float(self.micro_batch_size).is_integer()
            else self.micro_batch_size,
            "schedule": str(self.schedule),
            "virtual_stages": self.virtual_stages,
            "sequence_parallel": self.sequence_parallel,
            "recompute": self.recompute_ranges(),
            "distributed_optimizer": self.distributed_optimizer,
            "dp_style": str(self.dp_style),
            "dp_shard": self.dp_shard,
            "dp_replicate": self.dp_replicate,
            "reshard_after_forward": self.reshard_after_forward,
            "tp_comm_overlap": self.tp_comm_overlap,
            "overlap_grad_reduce": self.overlap_grad_reduce,
            "overlap_param_gather": self.overlap_param_gather,
            "grad_reduce_dtype": self.grad_reduce_dtype,
            "loss_scale": self.loss_scale,
            "cp_comm_type": self.cp_comm_type if self.cp > 1 else "",
            "cp_load_balance": self.cp_load_balance if self.cp > 1 else False,
            "ep": self.ep,
            "ep_fold": self.ep_fold if self.ep > 1 else "",
            "expert_tp": self.expert_tp,
        }

    def recompute_by_layer(self) -> dict[int, str] | None:
        """The recomputation of each layer (index -> "none" | "selective" | "full"), for what a user
        reads; None when the plan does not record it (`recompute_text` then says so).

        `recompute` is keyed by layer class (`planner.solver.costing.layer_key`, resolved against the
        model by `passes.recompute.recompute_of_layers`), which the plan alone cannot map to layers.
        Plan-wide keys only ("*", "layer"): every layer of `stages`. Otherwise the prediction's
        per-layer record (`LayerCost.strategy["recompute"]`, written from the same assignment), used
        only when its modes are those of `recompute` (a plan edited by hand may disagree)."""
        if not self.recompute:
            return {}
        modes = {str(v) for v in self.recompute.values()}
        layers = sorted(i for stage in self.stages for i in stage)
        if set(self.recompute) <= set(RECOMPUTE_PLAN_WIDE_KEYS) and len(modes) == 1:
            return dict.fromkeys(layers, modes.pop())
        recorded = {
            c.layer: str(c.strategy["recompute"])
            for c in self.predicted.per_layer
            if c.layer >= 0 and "recompute" in c.strategy
        }
        if sorted(recorded) == layers and set(recorded.values()) == modes:
            return recorded
        return {} if modes == {"none"} else None

    def recompute_ranges(self) -> dict[str, str]:
        """Machine-readable recomputation for reports and exports: runs of consecutive layers with the
        same recomputation, "first-last" (inclusive; "i" for one layer) -> mode, in layer order. When
        the plan does not record its layers (`recompute_by_layer` is None): {"per layer class":
        "none/selective"}, the modes only."""
        by_layer = self.recompute_by_layer()
        if by_layer is None:
            return {"per layer class": "/".join(sorted({str(v) for v in self.recompute.values()}))}
        return recompute_runs(by_layer)

    def recompute_text(self) -> str:
        """The recomputation as a user reads it: "none", "all 126 layers: full", or per mode its layer
        ranges ("layers 0-3: selective, layers 4-7: none")."""
        by_layer = self.recompute_by_layer()
        if by_layer is None:
            modes = "/".join(sorted({str(v) for v in self.recompute.values()}))
            return f"{modes} (per layer class; the plan does not record which layers)"
        return recompute_summary(by_layer)

    def virtual_stage_layers(self) -> list[list[int]]:
        """Layer indices per virtual stage (pp * virtual_stages of them, in pipeline order): chunk c of
        rank r, the c-th run of consecutive layer indices in `stages[r]`, is virtual stage c * pp + r.
        With virtual_stages == 1 this is `stages`. Raises InputError naming `stages` when a rank's
        layers do not form exactly `virtual_stages` runs (an empty rank has none)."""
        if self.virtual_stages == 1:
            return [list(layers) for layers in self.stages]
        chunks: list[list[int]] = [[] for _ in range(self.pp * self.virtual_stages)]
        for r, layers in enumerate(self.stages):
            runs: list[list[int]] = []
            for layer in layers:
                if runs and layer == runs[-1][-1] + 1:
                    runs[-1].append(layer)
                else:
                    runs.append([layer])
            if len(runs) != self.virtual_stages:
                raise InputError(
                    f"field 'stages': rank {r} holds layers {list(layers)}, {len(runs)} runs of consecutive "
                    f"layers, but virtual_stages is {self.virtual_stages} (one run per model chunk)"
                )
            for c, run in enumerate(runs):
                chunks[c * self.pp + r] = run
        return chunks

    def stage_of(self, layer: int) -> int:
        """The pipeline stage (rank) that holds `layer`."""
        for stage, layers in enumerate(self.stages):
            if layer in layers:
                return stage
        raise KeyError(f"layer {layer} is in no stage of the plan")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of builtins (YAML/JSON-safe)."""
        return _to_builtin(self)

    DECISION_FIELDS = (
        "workload", "batch_size", "seq_len", "context", "micro_batches", "dtype", "mesh", "splits", "stages",
        "ladder_layers", "schedule", "virtual_stages", "sequence_parallel", "recompute", "dp_style",
        "dp_shard", "reshard_after_forward", "tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather",
    )  # fmt: skip

    def decisions_digest(self) -> str:
        """SHA-256 (hex, 16 digits) of what the plan decides (`DECISION_FIELDS`: mesh, splits, stages,
        ladder, schedule, recompute, ... and the workload they were priced for), not of its prediction."""
        data = self.to_dict()
        chosen = {k: data[k] for k in self.DECISION_FIELDS}
        if self.mesh.cp == 1:  # the digest of a plan without context parallelism, as before it existed
            chosen["mesh"] = {k: v for k, v in chosen["mesh"].items() if k != "cp"}
        else:
            chosen["cp"] = {k: data[k] for k in ("cp_comm_type", "cp_load_balance")}
        if self.ep > 1:
            chosen["ep"] = [self.ep, self.ep_fold]
        if self.expert_tp > 1:
            chosen["expert_tp"] = self.expert_tp
        if self.grad_reduce_dtype != "param":  # the digest of a plan as before the field existed
            chosen["grad_reduce_dtype"] = self.grad_reduce_dtype
        if self.loss_scale is not None:
            chosen["loss_scale"] = self.loss_scale
        if data.get("serving"):  # the request served: its prompt, new tokens and caches
            chosen["request"] = {k: data["serving"][k] for k in ("prompt_len", "new_tokens", "cache_len")}
        return hashlib.sha256(json.dumps(chosen, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def decisions_edited(self) -> bool:
        """Whether the plan's decisions differ from those it was priced with (`priced_digest`): edited
        by hand after planning. False for a plan written before the digest existed."""
        return bool(self.priced_digest) and self.priced_digest != self.decisions_digest()

    @classmethod
    def from_dict(cls, data: object, origin: str = "plan") -> Plan:
        """Build and validate a plan from plain data; `InputError` names the offending field, or says
        that `data` is not a plan at all (a cluster spec, some other YAML)."""
        _check_is_plan(data, origin)
        try:
            plan = _from_builtin(
                cls, _normalise_loss_scale(_upgrade_distributed_optimizer(_upgrade_flat_mesh(data))), ""
            )
        except InputError as e:
            raise InputError(f"{origin}: {e}") from None
        plan.validate(origin)
        return plan

    def to_yaml(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as YAML, atomically (temp file in the same folder, then rename)."""
        header = f"{PLAN_HEADER} for {self.model} on {self.cluster}; read by planner show / run / export.\n"
        data = self.to_dict()
        data["model"] = model_path_beside(self.model, path)
        body = safe_dump(data, sort_keys=False, default_flow_style=None, width=110)
        write_text_atomic(path, with_digest(header + body))

    def model_file(self, plan_path: str | os.PathLike[str]) -> Path:
        """The model file of a plan read from ``plan_path``: `model` as `to_yaml` writes it, relative to the
        plan file's folder (so the plan runs from any working directory), or, for a plan written
        before that (relative to the working directory it was made in), relative to this one.

        Raises InputError when it is in neither place, or when both hold a file and they differ (two
        models of the same name: running the wrong one must not be a guess)."""
        given = Path(self.model)
        if given.is_absolute():
            if not given.is_file():
                raise InputError(
                    f"the plan {plan_path} was made for {self.model} (its field 'model'), which is not a file here: "
                    "name the model file with --model"
                )
            return given
        beside, here = Path(plan_path).parent / given, given
        found = [p for p in (beside, here) if p.is_file()]
        if not found:
            raise InputError(
                f"the plan {plan_path} was made for {self.model} (its field 'model', relative to the plan's folder), "
                f"which is not a file there ({beside}) nor here: name the model file with --model"
            )
        if len(found) == 2 and not os.path.samefile(beside, here):
            raise InputError(
                f"the plan {plan_path} was made for {self.model} (its field 'model'): both {beside} (beside the plan) "
                f"and {here} (in this folder) exist and differ; name the one to run with --model"
            )
        return found[0]

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan written by `to_yaml` (yaml.safe_load only). Raises `InputError` when malformed."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise InputError(
                f"{path}: not a text file (not UTF-8); a plan is the YAML planner optimize --out writes"
            ) from None
        except OSError as e:
            raise InputError(f"cannot read plan file {str(path)!r}: {e.strerror or e}") from None
        try:
            data = safe_load_unique(text)
        except yaml.YAMLError as e:
            raise InputError(f"{path}: not valid YAML: {e}") from e
        return cls.from_dict(data, origin=str(path))

    def validate(self, origin: str = "plan") -> None:
        """Check invariants a consumer relies on; raise `InputError` naming the field."""

        def bad(field_name: str, why: str) -> InputError:
            return InputError(f"{origin}: field {field_name!r}: {why}")

        if self.workload not in WORKLOADS:
            raise bad("workload", f"{self.workload!r} is not one of {list(WORKLOADS)}")
        if self.dtype not in DTYPE_BYTES:
            raise bad("dtype", f"{self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        for name in ("tp", "cp", "pp", "dp"):
            if getattr(self.mesh, name) < 1:
                raise bad(f"mesh.{name}", f"must be >= 1, got {getattr(self.mesh, name)}")
        for name in ("batch_size", "seq_len", "micro_batches", "virtual_stages"):
            if getattr(self, name) < 1:
                raise bad(name, f"must be >= 1, got {getattr(self, name)}")
        if self.context < 0:
            raise bad("context", f"must be >= 0, got {self.context}")
        ranges = [str(k) for k in self.recompute if parse_layer_run(str(k).replace(" ", "")) is not None]
        if ranges:
            raise bad(
                "recompute",
                f"names layer ranges {ranges}: a plan keys its recomputation by layer class "
                f"(planner.solver.costing.layer_key, as written) or {' / '.join(map(repr, RECOMPUTE_PLAN_WIDE_KEYS))} "
                "for every layer; layer ranges are the JSON report's form of it (plan.recompute there), which a "
                "plan does not read. Set '*': full (or selective, none) for every layer",
            )
        if self.ep_fold not in EP_FOLDS:
            raise bad("ep_fold", f"{self.ep_fold!r} is not one of {list(EP_FOLDS)}")
        if self.expert_tp > 1 and self.ep_fold == "tp":
            raise bad(
                "ep_fold",
                f"is tp with expert_tp {self.expert_tp}: EP over the TP ranks already splits the experts between "
                "them (each holds E / tp whole experts); set ep_fold: dp, or expert_tp: 1",
            )
        if self.expert_tp not in (1, self.mesh.tp):
            also = f" or {self.mesh.tp}" if self.mesh.tp > 1 else ""
            raise bad(
                "expert_tp",
                f"is {self.expert_tp}: the routed experts are either whole on every TP rank (1) or split over "
                f"all mesh.tp={self.mesh.tp} ranks; set expert_tp: 1{also}",
            )
        dense = self.model_params > 0 and self.num_experts == 0 and self.expert_params == 0
        if dense and (self.ep > 1 or self.expert_tp > 1):
            field, value = ("ep", self.ep) if self.ep > 1 else ("expert_tp", self.expert_tp)
            raise bad(
                field,
                f"is {value}, but the model has no mixture-of-experts layer (num_experts 0, expert_params 0): "
                f"there are no experts to split; set {field}: 1",
            )
        if self.ep_fold == "tp" and self.ep not in (1, self.mesh.tp):
            raise bad(
                "ep",
                f"is {self.ep} with ep_fold tp: the experts are split over the TP group, so ep must equal "
                f"mesh.tp={self.mesh.tp}; set ep: {self.mesh.tp} or ep_fold: dp",
            )
        if self.ep_fold == "dp" and (self.ep < 1 or self.mesh.dp_cp % self.ep):
            raise bad(
                "ep",
                f"is {self.ep}, which does not divide the dp x cp = {self.mesh.dp_cp} ranks the experts are split "
                f"over (mesh.dp={self.mesh.dp}, mesh.cp={self.mesh.cp}); use a divisor of {self.mesh.dp_cp}",
            )
        if not self.moe_imbalance >= 1.0:
            raise bad(
                "moe_imbalance",
                f"must be >= 1 (the busiest EP rank's rows over the mean), got {self.moe_imbalance}",
            )
        if self.moe_score_function not in ("", *MOE_SCORE_FUNCTIONS):
            raise bad(
                "moe_score_function",
                f"{self.moe_score_function!r} is not one of {list(MOE_SCORE_FUNCTIONS)} (or '' when unknown)",
            )
        if self.moe_top_k < 0 or (self.num_experts and self.moe_top_k > self.num_experts):
            raise bad(
                "moe_top_k",
                f"is {self.moe_top_k}: a router picks 1 to num_experts={self.num_experts} experts (0 when unknown)",
            )
        for name in ("moe_expert_intermediate_size", "moe_shared_intermediate_size"):
            if (getattr(self, name) or 0) < 0:
                raise bad(name, f"must be >= 0, got {getattr(self, name)}")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor >= 1.0:
            raise bad(
                "moe_capacity_factor", f"must be >= 1 or null (dropless), got {self.moe_capacity_factor}"
            )
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise bad("cp_comm_type", f"{self.cp_comm_type!r} is not one of {list(CP_COMM_TYPES)}")
        if self.mesh.cp > 1:
            check_cp_sequence(self.seq_len, self.mesh.cp, self.cp_load_balance, self.cp_comm_type, origin)
            if self.workload == "decode":
                raise bad(
                    "mesh.cp",
                    f"is {self.mesh.cp}, but a decode step has one new token per sequence to split: set cp: 1 "
                    "(context parallelism is for training and prefill)",
                )
        dp = self.mesh.dp
        if self.dp_shard < 1 or dp % self.dp_shard:
            raise bad(
                "dp_shard", f"is {self.dp_shard}, which does not divide mesh.dp={dp}; use a divisor of {dp}"
            )
        if self.dp_style is DataParallel.DDP and self.dp_shard != 1:
            raise bad(
                "dp_shard", f"is {self.dp_shard} but dp_style is ddp (nothing sharded): set dp_shard: 1"
            )
        if self.dp_style in (DataParallel.ZERO1, DataParallel.ZERO2) and self.dp_shard != dp:
            raise bad(
                "dp_shard",
                f"is {self.dp_shard} but dp_style {self.dp_style} shards over every data-parallel rank: set "
                f"dp_shard: {dp} (only fsdp shards over fewer, as HSDP)",
            )
        # the gradient reduction spans the dp x cp ranks holding the same weights (`MeshShape.dp_cp`)
        reducing = self.mesh.dp_cp
        if self.overlap_grad_reduce and (self.workload != "train" or reducing == 1):
            raise bad(
                "overlap_grad_reduce",
                f"is true, but there is no data-parallel gradient reduction to overlap (workload {self.workload}, "
                f"mesh.dp={dp}, mesh.cp={self.mesh.cp}): set it to false",
            )
        if self.overlap_param_gather and (
            self.workload != "train"
            or reducing == 1
            or self.dp_style not in (DataParallel.ZERO1, DataParallel.ZERO2)
        ):
            raise bad(
                "overlap_param_gather",
                f"is true, but only zero1 / zero2 training with dp x cp > 1 all-gathers the parameters after the "
                f"step (dp_style {self.dp_style}, mesh.dp={dp}, mesh.cp={self.mesh.cp}; fsdp prefetches its "
                "gathers anyway): set it to false",
            )
        if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise bad(
                "grad_reduce_dtype",
                f"{self.grad_reduce_dtype!r} is not one of {list(GRAD_REDUCE_DTYPES)} (param: the parameters' dtype)",
            )
        if self.grad_reduce_dtype != "param" and self.workload != "train":
            raise bad(
                "grad_reduce_dtype",
                f"is {self.grad_reduce_dtype}, but a {self.workload} plan has no gradients: set it to param",
            )
        if self.loss_scale is not None:
            if self.loss_scale != DYNAMIC_LOSS_SCALE and not is_static_loss_scale(self.loss_scale):
                raise bad(
                    "loss_scale",
                    f"{self.loss_scale!r} is not {DYNAMIC_LOSS_SCALE!r}, a positive number up to fp32's largest "
                    f"({FP32_MAX:.3g}; a static scale) or null (none)",
                )
            if self.workload != "train" or self.dtype != "fp16":
                raise bad(
                    "loss_scale",
                    f"is {self.loss_scale}, but loss scaling is for fp16 training (this plan: {self.workload} in "
                    f"{self.dtype}; bf16 and fp32 gradients have fp32's exponent range): set it to null",
                )
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise bad(
                "overlap_param_gather",
                "is true but overlap_grad_reduce is false: the parameter all-gather is overlapped per bucket of "
                "the overlapped gradient reduction (as Megatron-LM's); set both, or overlap_param_gather: false",
            )
        if self.workload == "decode" and self.context < 1:
            raise bad(
                "context",
                f"is {self.context}, but a decode plan prices a step over cached tokens: set context to their "
                "number (the --context it was planned with), or plan the model again for this workload",
            )
        if self.serving is not None:
            sv = self.serving
            if self.workload not in ("decode", "generate"):
                raise bad(
                    "workload",
                    f"is {self.workload} but the plan serves a request (field 'serving'): a served request is "
                    "planned as decode or generate; plan the model again for another workload",
                )
            check_new_tokens(sv.new_tokens, f"{origin}: field 'serving.new_tokens'")
            if sv.prompt_len < 1:
                raise bad("serving.prompt_len", f"must be >= 1, got {sv.prompt_len}")
            # decode: the context is the prompt; generate: the sequence length is, and the decode step it
            # prices has that context too
            fields = ("context",) if self.workload == "decode" else ("seq_len", "context")
            for prompt_field in fields:
                if getattr(self, prompt_field) != sv.prompt_len:
                    raise bad(
                        prompt_field,
                        f"is {getattr(self, prompt_field)} but the request served has serving.prompt_len "
                        f"{sv.prompt_len}: edit them together (serving.cache_len must hold prompt_len + new_tokens)",
                    )
            if sv.cache_len < sv.prompt_len + sv.new_tokens:
                raise bad(
                    "serving.cache_len",
                    f"is {sv.cache_len}, under prompt_len + new_tokens = {sv.prompt_len + sv.new_tokens}",
                )
        for key, split in self.splits.items():
            where = f"splits.{key}"
            if split.weight != key:
                raise bad(f"{where}.weight", f"{split.weight!r} differs from its key {key!r}")
            if split.style not in SPLIT_STYLES:
                raise bad(f"{where}.style", f"{split.style!r} is not one of {list(SPLIT_STYLES)}")
            if split.dim not in (0, 1):
                raise bad(f"{where}.dim", f"must be 0 or 1, got {split.dim}")
            if split.parts is not None and (not split.parts or any(p < 1 for p in split.parts)):
                raise bad(f"{where}.parts", f"must be a non-empty list of positive sizes, got {split.parts}")
            if split.pieces is not None and (split.pieces < 1 or self.mesh.tp % split.pieces or split.parts):
                raise bad(
                    f"{where}.pieces",
                    f"must divide tp={self.mesh.tp} (and exclude parts), got {split.pieces}",
                )
        if len(self.stages) != self.pp:
            raise bad("stages", f"has {len(self.stages)} stages but pp is {self.pp}")
        if self.virtual_stages > 1 and self.schedule != Schedule.INTERLEAVED_1F1B:
            raise bad(
                "virtual_stages",
                f"is {self.virtual_stages} but only the interleaved_1f1b schedule has model chunks",
            )
        try:
            chunks = self.virtual_stage_layers()
        except InputError as e:
            raise InputError(f"{origin}: {e}") from None
        flat = [i for stage in chunks for i in stage]
        if flat != sorted(flat) or len(set(flat)) != len(flat):
            raise bad(
                "stages",
                "layers must be contiguous, in order and each in one stage"
                + (
                    " (taking chunk c of rank r as virtual stage c * pp + r)"
                    if self.virtual_stages > 1
                    else ""
                ),
            )
        if any(not stage for stage in self.stages) and flat:
            raise bad("stages", "a stage holds no layers")
        unknown = sorted(set(self.ladder_layers) - set(flat))
        if unknown:
            raise bad("ladder_layers", f"layers {unknown} are in no stage")


def ep_text(ep: int, fold: str, expert_tp: int, cp: int = 1) -> str:
    """Expert parallelism as a user reads it: "off", "8 over dp", "8 over tp", "8 over dp, experts split
    over tp 4", and without EP "off, experts split over tp 4" (each expert split over the TP ranks).
    The "dp" fold is the dp x cp ranks: with context parallelism (``cp`` > 1) it reads "over dp x cp"."""
    split = f", experts split over tp {expert_tp}" if expert_tp > 1 else ""
    over = "dp x cp" if fold == "dp" and cp > 1 else fold
    return f"off{split}" if ep == 1 else f"{ep} over {over}{split}"


def cp_text(cp: int, comm_type: str, load_balance: bool) -> str:
    """`Plan.cp_text` of the given fields: "off" at cp 1, else "4 (allgather, load-balanced)"."""
    if cp == 1:
        return "off"
    return f"{cp} ({comm_type}{', load-balanced' if load_balance else ''})"


def cp_unbalanced_note(seq_len: int, cp: int) -> str:
    """Why context parallelism over `cp` ranks with load balancing on auto runs contiguous chunks on a
    sequence of `seq_len` tokens that is not a multiple of 2 x cp, and what that costs (the last rank's
    chunk sees every earlier token: about 2cp-1 times rank 0's causal work) and what would balance it."""
    lower, upper = seq_len // (2 * cp) * 2 * cp, (seq_len // (2 * cp) + 1) * 2 * cp
    near = f"{lower} or {upper}" if lower else str(upper)
    return (
        f"context parallelism runs without load balancing: a sequence of {seq_len} tokens does not cut into "
        f"2 x cp = {2 * cp} equal chunks ({seq_len} is not a multiple of {2 * cp}), so each of the {cp} ranks "
        f"keeps one contiguous chunk and the causal attention's work is unbalanced (rank {cp - 1}, the last, "
        f"does about 2cp-1 = {2 * cp - 1} times rank 0's work); a sequence length that is a multiple of "
        f"{2 * cp} (e.g. {near}) would balance it"
    )


def check_cp_sequence(
    seq_len: int, cp: int, load_balance: bool | None, comm_type: str, where: str = "--cp"
) -> None:
    """Raise InputError when context parallelism over `cp` ranks cannot cut a sequence of `seq_len`
    tokens into equal chunks (2 x cp with `load_balance`, cp without; None: either, balanced where it
    can), naming both numbers and what would work."""
    if load_balance is None:  # balanced where 2 x cp chunks cut it, else contiguous: cp must
        if seq_len % cp == 0:
            return
        fits = [c for c in (2, 4, 8, 16, 32) if c < cp and seq_len % c == 0]
        raise InputError(
            f"{where}: context parallelism cp={cp} ({comm_type}) cannot cut a sequence of {seq_len} tokens "
            f"into cp = {cp} chunks, nor 2 x cp = {2 * cp} for causal load balancing: {seq_len} is not a "
            f"multiple of {cp}; use cp {fits[-1] if fits else 1}, or a sequence length that is a multiple "
            f"of {2 * cp} ({cp} without load balancing)"
        )
    chunks = 2 * cp if load_balance else cp
    if seq_len % chunks == 0:
        return
    how = f"2 x cp = {chunks} chunks (causal load balancing)" if load_balance else f"cp = {chunks} chunks"
    fits = [c for c in (2, 4, 8, 16, 32) if c < cp and seq_len % (2 * c if load_balance else c) == 0]
    fix = f"use cp {fits[-1]}" if fits else "use cp 1"
    if load_balance and seq_len % cp == 0:
        fix += f", or turn load balancing off (the {seq_len} tokens divide into {cp} contiguous chunks)"
    raise InputError(
        f"{where}: context parallelism cp={cp} ({comm_type}) cannot cut a sequence of {seq_len} tokens into "
        f"{how}: {seq_len} is not a multiple of {chunks}; {fix}, or a sequence length that is a multiple of "
        f"{chunks}"
    )


def layer_ranges(layers: Iterable[int]) -> str:
    """Layer indices as ranges of consecutive ones: [0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in _runs(sorted(set(layers))))


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """(first, last) of each run of consecutive integers in sorted `values`."""
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs


def recompute_runs(by_layer: Mapping[int, str]) -> dict[str, str]:
    """{"first-last": mode} (inclusive; "i" for one layer) for each run of consecutive layers with the
    same recomputation, in layer order."""
    out: dict[str, str] = {}
    layers = sorted(by_layer)
    start = 0
    for k in range(1, len(layers) + 1):
        if (
            k == len(layers)
            or layers[k] != layers[k - 1] + 1
            or by_layer[layers[k]] != by_layer[layers[start]]
        ):
            a, b = layers[start], layers[k - 1]
            out[f"{a}" if a == b else f"{a}-{b}"] = str(by_layer[a])
            start = k
    return out


def parse_layer_run(text: str) -> list[int] | None:
    """The layers of a `recompute_runs` key ("3" or "0-125"), or None for anything else."""
    a, sep, b = text.partition("-")
    if not a.isdigit() or (sep and not b.isdigit()) or (sep and int(b) < int(a)):
        return None
    return list(range(int(a), int(b if sep else a) + 1))


def recompute_summary(by_layer: Mapping[int, str]) -> str:
    """Per-layer recomputation as text: "none" when nothing is recomputed, "all 126 layers: full" when
    every layer is alike, else each mode with its layer ranges in order of their first layer
    ("layers 0-3: selective, layers 4-7: none")."""
    modes: dict[str, list[int]] = {}
    for layer in sorted(by_layer):
        modes.setdefault(str(by_layer[layer]), []).append(layer)
    if not modes or set(modes) == {"none"}:
        return "none"
    if len(modes) == 1:
        ((mode, layers),) = modes.items()
        n = len(layers)
        return f"all {n} layers: {mode}" if n > 1 else f"layer {layers[0]}: {mode}"
    parts = []
    for mode, layers in modes.items():
        word = "layers" if len(layers) > 1 else "layer"
        parts.append(f"{word} {layer_ranges(layers)}: {mode}")
    return ", ".join(parts)


_PLAN_KEYS = {"model", "workload", "mesh", "splits", "stages", "predicted", "solver"}


def _check_is_plan(data: object, origin: str) -> None:
    """InputError when `data` shares no key with a plan: say what it looks like and what a plan is."""
    if (
        isinstance(data, dict)
        and isinstance(data.get("plan"), dict)
        and ("model" not in data or "written_by" in data)
    ):
        raise InputError(
            f"{origin} is a report (what --json writes), not a plan: it holds the plan under 'plan' beside the "
            "measured figures. Give the plan YAML that planner optimize MODEL.py --out PLAN.yaml writes "
            "(planner compare reads reports)"
        )
    if not isinstance(data, dict):
        what = "is empty" if data is None else f"holds {_kind_of(data)}, not a mapping"
        raise InputError(
            f"{origin} is not a plan file: its YAML {what}. A plan is the YAML that planner optimize MODEL.py "
            "--out PLAN.yaml writes (keys model, cluster, workload, mesh, splits, stages, predicted, ...)"
        )
    if _PLAN_KEYS & set(data):
        return  # a plan with errors: the schema check names the field
    looks = ""
    if {"device", "links"} & set(data):
        looks = f"; it looks like a cluster spec: use it as planner optimize MODEL.py --cluster {origin}"
    raise InputError(
        f"{origin} is not a plan file{looks}. A plan is the YAML that planner optimize MODEL.py --out PLAN.yaml "
        "writes (keys model, cluster, workload, mesh, splits, stages, predicted, ...)"
    )


def _kind_of(value: object) -> str:
    """ "a string", "a list", "a number" ... for a message about YAML that is not a mapping."""
    names = {str: "a string", list: "a list", bool: "a boolean", int: "a number", float: "a number"}
    return names.get(type(value), f"a {type(value).__name__}")


def dp_label(style: DataParallel, dp: int, shard: int, reshard_after_forward: bool) -> str:
    """The data-parallel style as the search labels it (the keys of the "data-parallel" decision):
    "ddp", "zero1", "zero2", "fsdp", "fsdp-noreshard", "hsdp 4x2" (shard 4, replicate 2),
    "hsdp 4x2-noreshard"; "ddp" at dp=1 (nothing to shard) and for fsdp over 1 rank."""
    if dp == 1 or style is DataParallel.DDP or (style is DataParallel.FSDP and shard == 1):
        return "ddp"
    if style is not DataParallel.FSDP:
        return str(style)
    name = f"hsdp {shard}x{dp // shard}" if shard < dp else "fsdp"
    return name + ("" if reshard_after_forward else "-noreshard")


def tp_overlap_chunk_count(tp: int, rows: float | None = None) -> int:
    """Chunks each TP block's collectives are cut into under `Plan.tp_comm_overlap`: the TP degree, at
    least 2 (a ring exchange has tp steps, Megatron-LM's TP overlap as many chunks), and at most
    `rows` (the rows the collective's tensor has; None: not known yet, the cap). 1 means no overlap
    (a single row, e.g. decode at batch 1). The one rule of the pass (`passes.tp_overlap`) and its
    price (`planner.solver.costing.tp_overlap_chunks`)."""
    chunks = max(2, tp)
    return chunks if rows is None else max(1, min(chunks, int(rows)))


def is_static_loss_scale(value: object) -> bool:
    """Whether ``value`` is a static loss scale: a number (not a bool) above 0, up to `FP32_MAX`."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= FP32_MAX


def loss_scale_text(loss_scale: float | str | None) -> str:
    """`Plan.loss_scale` in words: "dynamic (from 2^16)", "static 1024", or "none"."""
    if loss_scale is None:
        return "none"
    if loss_scale == DYNAMIC_LOSS_SCALE:
        return f"dynamic (from 2^{int(math.log2(DYNAMIC_INIT_SCALE))})"
    return f"static {float(loss_scale):g}"


def overlap_text(tp_comm: bool, grad_reduce: bool, param_gather: bool) -> str:
    """The communication overlap as a user reads it: "tp, grad-reduce, param-gather" (those on), or "none"."""
    names = [
        n for n, on in (("tp", tp_comm), ("grad-reduce", grad_reduce), ("param-gather", param_gather)) if on
    ]
    return ", ".join(names) or "none"


def dp_style_text(style: DataParallel, dp: int, shard: int, reshard_after_forward: bool) -> str:
    """`Plan.dp_style_text` of the given fields."""
    if style is not DataParallel.FSDP:
        return str(style)
    reshard = "reshard after forward" if reshard_after_forward else "no reshard after forward"
    if 1 < shard < dp:
        return f"hsdp: fsdp over {shard} x replicate {dp // shard} ({reshard})"
    return f"fsdp ({reshard})"


def _normalise_loss_scale(data: object) -> object:
    """A hand-written `loss_scale` in the spellings a user reaches for: YAML's ``off`` / ``false`` and
    the words "off", "none", "null" are null (no scaling, as --loss-scale off); "Dynamic" in any case
    is "dynamic"; a number written as a string ("1e4", which PyYAML reads as one) is that number.
    Raises InputError for ``true`` (which scale?). Anything else is returned unchanged for `validate`."""
    if not isinstance(data, dict) or "loss_scale" not in data:
        return data
    value = data["loss_scale"]
    if value is True:
        raise InputError(
            "field 'loss_scale': true says no scale: write dynamic, a positive number (a static scale) or null (none)"
        )
    if value is False or (isinstance(value, str) and value.strip().lower() in ("off", "none", "null", "")):
        return {**data, "loss_scale": None}
    if isinstance(value, str):
        word = value.strip().lower()
        if word == DYNAMIC_LOSS_SCALE:
            return {**data, "loss_scale": DYNAMIC_LOSS_SCALE}
        try:
            return {**data, "loss_scale": float(word)}
        except ValueError:
            return data
    return data


def _upgrade_distributed_optimizer(data: object) -> object:
    """Plan data written before `dp_style`: ``distributed_optimizer: true`` is ZeRO-1 over every DP
    rank, false plain DDP. Anything else is returned unchanged."""
    if not isinstance(data, dict) or "distributed_optimizer" not in data:
        return data
    data = dict(data)
    flag = data.pop("distributed_optimizer")
    if "dp_style" not in data and flag is True:
        mesh = data.get("mesh")
        data["dp_style"] = "zero1"
        data.setdefault("dp_shard", mesh.get("dp", 1) if isinstance(mesh, dict) else 1)
    return data


def _upgrade_flat_mesh(data: object) -> object:
    """Plan data written before the mesh was one field: top-level `tp`/`pp`/`dp` become `mesh`, and
    each mesh candidate's flat degrees and "m=4: ..." note become `mesh` and `micro_batches`.
    Anything else is returned unchanged (the schema check names what is wrong)."""
    if not isinstance(data, dict) or "mesh" in data or not {"tp", "pp", "dp"} <= set(data):
        return data
    data = dict(data)
    data["mesh"] = {k: data.pop(k) for k in ("tp", "pp", "dp")}
    candidates = data.get("mesh_candidates")
    if isinstance(candidates, list):
        upgraded = []
        for c in candidates:
            if isinstance(c, dict) and {"tp", "pp", "dp"} <= set(c):
                c = dict(c)
                mesh = {k: c.pop(k) for k in ("tp", "pp", "dp")}
                m, sep, note = str(c.get("note", "")).partition(": ")
                found = m.startswith("m=") and m[2:].isdigit() and sep
                c = {
                    "mesh": mesh,
                    "micro_batches": int(m[2:]) if found else data.get("micro_batches", 1),
                    **c,
                    "note": note if found else c.get("note", ""),
                }
            upgraded.append(c)
        data["mesh_candidates"] = upgraded
    return data


def _coerce(kind: type[enum.Enum], value: object, field_name: str) -> Any:
    """`value` as a member of `kind`; InputError naming `field_name` and the allowed values otherwise."""
    try:
        return kind(value)
    except ValueError:
        raise InputError(f"field {field_name!r}: {value!r} is not one of {[m.value for m in kind]}") from None


# ---------------------------------------------------------------------------------------------
# Generic dataclass <-> builtin conversion, driven by the type hints above.


def _to_builtin(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_builtin(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _to_builtin(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_builtin(v) for v in value]
    if isinstance(value, float):
        return float(value)
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    raise TypeError(f"cannot serialise {type(value).__name__} in a plan")


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _unknown_keys(tp: Any, data: dict, extra: list, where: str) -> str:
    """The message for keys of `data` that dataclass `tp` has no field for: where ("plan file top level"
    or the field), each key with a did-you-mean among the fields, and the required fields then missing."""
    fields = [f.name for f in dataclasses.fields(tp)]
    named = []
    for key in extra:
        close = difflib.get_close_matches(str(key), [f for f in fields if f not in data], n=1)
        named.append(f"{str(key)!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    missing = [
        f.name
        for f in dataclasses.fields(tp)
        if f.name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    place = f"field {where!r}" if where else "plan file top level"
    message = f"{place}: unknown key{'s' if len(extra) > 1 else ''} {', '.join(named)}"
    if missing:
        fields_said = ", ".join(repr(m) for m in missing)
        are = "s" if len(missing) > 1 else "", "are" if len(missing) > 1 else "is"
        message += f", and the required field{are[0]} {fields_said} {are[1]} missing"
    return message + "; rename or remove the unknown key" + ("s" if len(extra) > 1 else "")


def _from_builtin(tp: Any, data: object, where: str) -> Any:
    """Convert `data` to type `tp`, raising InputError naming `where` on a mismatch."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if data is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for kind in inner[:-1]:  # the first member the data converts to (float | str: a number, else a word)
            try:
                return _from_builtin(kind, data, where)
            except InputError:
                continue
        return _from_builtin(inner[-1], data, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise InputError(f"field {where or 'plan'!r}: expected a mapping, got {type(data).__name__}")
        if tp is WeightSplit and data.get("style") == "replicate" and "dim" in data and data["dim"] is None:
            data = {**data, "dim": 0}  # a replicated weight's dim is unused (a hand edit may null it)
        hints = _hints(tp)
        known = {f.name for f in dataclasses.fields(tp)}
        extra = sorted(set(data) - known, key=str)
        if extra:
            raise InputError(_unknown_keys(tp, data, extra, where))
        kwargs = {}
        for f in dataclasses.fields(tp):
            sub = f"{where}.{f.name}" if where else f.name
            if f.name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise InputError(f"field {sub!r} is missing")
                continue
            kwargs[f.name] = _from_builtin(hints[f.name], data[f.name], sub)
        return tp(**kwargs)
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(data, list):
            raise InputError(f"field {where!r}: expected a list, got {type(data).__name__}")
        return [_from_builtin(inner, v, f"{where}[{i}]") for i, v in enumerate(data)]
    if origin is dict:
        key_t, val_t = typing.get_args(tp)
        if not isinstance(data, dict):
            raise InputError(f"field {where!r}: expected a mapping, got {type(data).__name__}")
        return {
            _from_builtin(key_t, k, where): _from_builtin(val_t, v, f"{where}.{k}") for k, v in data.items()
        }
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError:
            allowed = [m.value for m in tp]
            raise InputError(f"field {where!r}: {data!r} is not one of {allowed}") from None
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise InputError(f"field {where!r}: expected a number, got {data!r}")
        return float(data)
    if tp is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise InputError(f"field {where!r}: expected an integer, got {data!r}")
        return data
    if tp is str:
        if not isinstance(data, str):
            raise InputError(f"field {where!r}: expected a string, got {data!r}")
        return data
    if tp is bool:
        if not isinstance(data, bool):
            raise InputError(f"field {where!r}: expected true/false, got {data!r}")
        return data
    raise TypeError(f"unsupported type {tp!r} in plan schema")  # internal: schema uses only the above

"""Memory cost per rank: weights, gradients, optimizer state, activations kept for backward, KV cache.

Sources:
- Training state: Rajbhandari et al., "ZeRO: Memory optimizations toward training trillion parameter
  models" (SC 2020), section 3.1: mixed-precision Adam keeps fp16/bf16 parameters and gradients
  (2 + 2 bytes) plus fp32 master parameters, momentum and variance (4 + 4 + 4 bytes): 16 bytes per
  parameter (K = 12 for the optimizer states).
- Activations: Korthikanti et al., "Reducing activation recomputation in large transformer models"
  (MLSys 2023, arXiv:2205.05198), section 4, equations (1)-(4): per GPT layer with 16-bit
  activations, ``s*b*h*(34 + 5*a*s/h)`` bytes without parallelism and ``s*b*h*(10 + 24/t + 5*a*s/(h*t))``
  with tensor parallel degree t; sequence parallelism also divides the remaining 10 by t.
- KV cache: two tensors (K and V) of (batch, context, kv_heads, head_dim) per layer.

All results are bytes on one rank; ``tp`` is the tensor-parallel degree, pipeline parallelism enters
through which layers a stage holds and :func:`inflight_micro_batches`.
"""

from __future__ import annotations

import enum
import math

from costmodels.dtypes import dtype_bytes

ADAM_MOMENT_BYTES = 8  # fp32 momentum + fp32 variance per parameter (ZeRO section 3.1)
FP32_MASTER_BYTES = 4  # fp32 master copy of 16-bit parameters in mixed precision (ZeRO section 3.1)
# Korthikanti et al. eq. (2): per-layer activation bytes / (s*b*h) = 34 + 5*a*s/h; of the 34, 24
# (QKV/MLP inputs and intermediates) are sharded by tensor parallelism and 10 (layer-norm inputs,
# dropout masks, attention/MLP block inputs) are not, unless sequence parallelism is used (eq. 3, 4).
ACT_SHARDED_PER_TOKEN_HIDDEN = 24
ACT_REPLICATED_PER_TOKEN_HIDDEN = 10
ACT_SCORES_PER_HEAD_TOKEN = 5  # softmax out (2) + dropout mask (1) + dropout out (2), times a*s^2*b
_KORTHIKANTI_DTYPE_BYTES = 2  # the paper's counts assume 16-bit activations


class Schedule(str, enum.Enum):
    """Pipeline schedule: how micro-batches flow through the stages (``planner.plan.Plan.schedule``).

    GPipe (Huang et al. 2019): all forwards, then all backwards; a stage holds every micro-batch's
    activations. 1F1B (Narayanan et al. 2021, PipeDream-Flush): one forward, one backward in steady
    state; stage s holds at most pp - s micro-batches. Both idle for the same fill and drain, a bubble
    fraction of (p-1)/(m+p-1) of the step: they differ in memory, not in time. Interleaved 1F1B
    (Narayanan et al. 2021, section 2.2.2): each rank holds v model chunks (virtual stages,
    ``Plan.virtual_stages``); the bubble is divided by v at the cost of v times the pipeline
    point-to-point messages and more in-flight activations.
    """

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"

    def __str__(self) -> str:
        return self.value


class Recompute(str, enum.Enum):
    """Activation recomputation of one layer class in training (``planner.plan.Plan.recompute``).

    NONE keeps every activation; SELECTIVE (Korthikanti et al. 2022, section 5) recomputes only the
    attention core (scores, softmax, dropout, weighted values: large activations, few FLOPs); FULL
    keeps only the layer's input and re-runs its whole forward in backward (Megatron-LM
    ``--recompute-granularity full``).
    """

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"

    def __str__(self) -> str:
        return self.value


class DataParallel(str, enum.Enum):
    """How the data-parallel ranks hold the training state (``planner.plan.Plan.dp_style``); the ZeRO
    stages of Rajbhandari et al. 2020, section 5, as Megatron-Core's
    ``--data-parallel-sharding-strategy`` (no_shard / optim / optim_grads / optim_grads_params) and
    PyTorch FSDP2 (``fully_shard``) name them.

    DDP: every replica holds parameters, gradients and Adam state whole; gradients all-reduced.
    ZERO1: Adam state (and fp32 master weights) sharded (Megatron-LM's distributed optimizer);
    gradients reduce-scattered, updated parameters all-gathered after the step.
    ZERO2: gradients sharded too (each rank keeps only its reduce-scattered slice).
    FSDP: parameters sharded too (ZeRO-3): each wrapping unit (one layer; the parameters outside the
    layers another) is all-gathered before its forward, and again before its backward when resharded
    after forward, and its gradients reduce-scattered after its backward. With a shard degree below
    the data-parallel degree it is HSDP: sharded inside groups of ``dp_shard`` ranks, replicated
    across the ``dp / dp_shard`` groups (gradient shards all-reduced across them).
    """

    DDP = "ddp"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    FSDP = "fsdp"

    def __str__(self) -> str:
        return self.value

    @property
    def shards_optimizer(self) -> bool:
        return self is not DataParallel.DDP

    @property
    def shards_gradients(self) -> bool:
        return self in (DataParallel.ZERO2, DataParallel.FSDP)

    @property
    def shards_parameters(self) -> bool:
        return self is DataParallel.FSDP


def dp_state_bytes(
    num_params: float,
    dtype: str,
    style: DataParallel,
    shard: int,
    reshard_after_forward: bool = True,
    grad_dtype: str | None = None,
) -> float:
    """Parameters + gradients + Adam state per rank of ``num_params`` parameters (per TP / pipeline
    rank) under data-parallel ``style`` over ``shard`` ranks (ZeRO section 5.1: P_os, P_os+g,
    P_os+g+p): each sharded state divided by ``shard``. FSDP without reshard after forward keeps every
    unit's gathered parameters from its forward to its backward, so the parameters count whole (the
    peak of the step). The units in flight of FSDP are working memory (`fsdp_unit_bytes`). Gradients
    are kept in ``grad_dtype`` (default ``dtype``; "fp32" with 16-bit parameters: Megatron-LM's fp32
    main_grad buffer, 18 bytes per parameter unsharded). Raises ValueError for shard < 1."""
    if shard < 1:
        raise ValueError(f"shard must be >= 1, got {shard}")
    params = param_bytes(num_params, dtype)
    grads = grad_bytes(num_params, grad_dtype or dtype)
    adam = adam_state_bytes(num_params, dtype)
    if style.shards_optimizer:
        adam /= shard
    if style.shards_gradients:
        grads /= shard
    if style.shards_parameters and reshard_after_forward:
        params /= shard
    return params + grads + adam


def fsdp_unit_bytes(
    layer_params: float,
    outside_params: float,
    dtype: str,
    reshard_after_forward: bool = True,
    grad_dtype: str | None = None,
) -> float:
    """FSDP working memory per rank beyond `dp_state_bytes`: the wrapping units gathered at once, for
    layers of ``layer_params`` parameters and the unit outside the layers (embedding, final norm, LM
    head) of ``outside_params`` (both per TP rank). That unit is used from the first op to the last,
    so it stays gathered through the step (FSDP2 keeps its root unit so), and its gradients build up
    through the whole backward; the layers: with reshard after forward two of them gathered (the one
    computing and the one prefetched, FSDP2's default of one unit ahead), and one layer's unsharded
    gradients before their reduce-scatter. Without reshard every gathered parameter is already
    counted whole by `dp_state_bytes`, so only the gradients. Measured on gloo ranks
    (tests/test_sharded_dp.py): the outside unit and two layers gathered at the peak. ``grad_dtype``
    "fp32" with 16-bit parameters: those gradients are also cast to fp32 for their reduce-scatter
    (torchtitan's FSDP reduce_dtype float32; `passes.fsdp.FsdpRuntime.reduce`), both held at once."""
    grads = grad_bytes(layer_params + outside_params, dtype)
    if grad_dtype is not None and grad_dtype != dtype:
        grads += grad_bytes(layer_params + outside_params, grad_dtype)
    if not reshard_after_forward:
        return grads
    return param_bytes(2 * layer_params + outside_params, dtype) + grads


def zero2_unit_bytes(
    layer_params: float,
    outside_params: float,
    held_params: float,
    dtype: str,
    grad_dtype: str | None = None,
    overlap_grad_reduce: bool = False,
    shard: int = 1,
) -> float:
    """ZeRO-2 working memory per rank beyond `dp_state_bytes` (which holds only the gradient slices):
    the unsharded gradients autograd makes (``dtype``) before each wrapping unit's reduce-scatter, for
    layers of ``layer_params`` parameters and the unit outside the layers of ``outside_params`` (both
    per TP rank). When a unit's last gradient is ready, its gradients are flattened into one buffer in
    the reduce dtype (``grad_dtype``, default ``dtype``) and reduce-scattered; with
    ``overlap_grad_reduce`` the previous unit's buffer and its result shard (1/``shard`` of it) are
    still in flight (`runtime.data_parallel.Zero2Adam`). The outside unit's gradients that come before
    the layers' (the LM head, the final norm: ``held_params``; a tied embedding is the LM head) are held
    through the whole backward, the rest of it (the embedding) arrives at its end. The peak is the
    larger of a layer's reduce-scatter beside the held ones and the outside unit's at the end.
    Measured on gloo ranks (tests/test_sharded_dp.py): equal to the gradients and buffers alive at the
    peak, to the shards' padding."""
    b, r = dtype_bytes(dtype), dtype_bytes(grad_dtype or dtype)
    in_flight = layer_params * r * (1 + 1 / max(shard, 1)) if overlap_grad_reduce else 0.0
    layer_moment = held_params * b + layer_params * (b + r)
    outside_moment = outside_params * (b + r)
    return max(layer_moment, outside_moment) + in_flight


def param_bytes(num_params: float, dtype: str) -> float:
    """Bytes of ``num_params`` parameters stored in ``dtype``."""
    return num_params * dtype_bytes(dtype)


def grad_bytes(num_params: float, dtype: str) -> float:
    """Bytes of the gradients of ``num_params`` parameters kept in ``dtype`` (the parameters' dtype,
    or the one gradients are accumulated in)."""
    return num_params * dtype_bytes(dtype)


def adam_state_bytes(num_params: float, dtype: str) -> float:
    """Adam optimizer state bytes: fp32 momentum and variance (8 B/param), plus an fp32 master copy
    (4 B/param) when parameters are 16-bit (mixed precision). ZeRO section 3.1."""
    master = FP32_MASTER_BYTES if dtype_bytes(dtype) < 4 else 0
    return num_params * (ADAM_MOMENT_BYTES + master)


def training_state_bytes(num_params: float, dtype: str) -> float:
    """Parameters + gradients + Adam state: 16 bytes per parameter for bf16/fp16 mixed precision
    (2 + 2 + 12, ZeRO section 3.1), and also 16 for fp32 (4 + 4 + 8)."""
    return (
        param_bytes(num_params, dtype) + grad_bytes(num_params, dtype) + adam_state_bytes(num_params, dtype)
    )


def params_per_rank(sharded_params: float, replicated_params: float, tp: int) -> float:
    """Parameters held by one tensor-parallel rank: the sharded ones split ``tp`` ways, plus every
    replicated one (norms, biases of row-parallel layers, anything left unsplit)."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    return sharded_params / tp + replicated_params


def activation_bytes_per_layer(
    seq_len: int,
    batch: int,
    hidden: int,
    num_heads: int,
    tp: int = 1,
    *,
    sequence_parallel: bool = False,
    stores_attention_scores: bool = True,
    dtype: str = "bf16",
) -> float:
    """Activation bytes one transformer layer keeps for backward on one rank (Korthikanti et al. 2022).

    ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` for 16-bit activations; with ``sequence_parallel`` the 10 is
    divided by t too. ``stores_attention_scores=False`` drops the ``5*a*s/h`` term (flash / memory-
    efficient SDPA keeps no (s, s) score matrix, as with selective recomputation in the paper). The
    paper counts a GPT layer with a 4h MLP and dropout; other ``dtype`` sizes scale it proportionally.
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    s, b, h, a = seq_len, batch, hidden, num_heads
    replicated = ACT_REPLICATED_PER_TOKEN_HIDDEN / (tp if sequence_parallel else 1)
    per_token_hidden = replicated + ACT_SHARDED_PER_TOKEN_HIDDEN / tp
    if stores_attention_scores:
        per_token_hidden += ACT_SCORES_PER_HEAD_TOKEN * a * s / (h * tp)
    return s * b * h * per_token_hidden * dtype_bytes(dtype) / _KORTHIKANTI_DTYPE_BYTES


def kv_cache_bytes(
    num_layers: int, batch: int, context: int, num_kv_heads: int, head_dim: int, dtype: str, tp: int = 1
) -> float:
    """KV-cache bytes on one rank: ``2 * layers * batch * context * kv_heads_per_rank * head_dim * dtype_bytes``.

    Tensor parallelism splits KV heads: ``ceil(num_kv_heads / tp)`` per rank (a GQA model with fewer
    KV heads than ranks replicates them, one per rank).
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    kv_heads_per_rank = math.ceil(num_kv_heads / tp)
    return 2.0 * num_layers * batch * context * kv_heads_per_rank * head_dim * dtype_bytes(dtype)


def inflight_micro_batches(
    pp: int, stage: int, micro_batches: int, schedule: Schedule, virtual_stages: int = 1
) -> float:
    """Micro-batches whose activations pipeline rank ``stage`` (0-based) holds at its peak under
    ``schedule``, in units of one micro-batch through all the layers that rank holds.

    GPipe: all ``micro_batches`` (every forward runs before any backward). 1F1B: ``min(pp - stage,
    micro_batches)`` (Narayanan et al., "Efficient large-scale language model training on GPU
    clusters using Megatron-LM", SC 2021, section 2.2.1; the first stage holds ``pp``). Interleaved
    1F1B with v = ``virtual_stages`` model chunks per rank (same paper, section 2.2.2): rank r runs
    ``2 (pp - r - 1) + (v - 1) pp`` warm-up forwards of one chunk before its first backward, and holds
    one more in the steady state, each chunk holding 1/v of the rank's layers:
    ``(2 (pp - r - 1) + (v - 1) pp + 1) / v`` micro-batches; for the first rank that is
    ``pp (1 + (pp - 1) / (pp v))``, the figure of Korthikanti et al. 2022, section 4.2.3. Never more
    than all ``micro_batches``.
    Raises ValueError for a stage outside [0, pp), a schedule that is not a `Schedule`, or
    ``virtual_stages`` < 1 (or > 1 with another schedule).
    """
    if not 0 <= stage < pp:
        raise ValueError(f"stage must be in [0, {pp}), got {stage}")
    try:
        schedule = Schedule(schedule)
    except ValueError:
        raise ValueError(
            f"unknown pipeline schedule {schedule!r}; expected one of {[s.value for s in Schedule]}"
        ) from None
    if virtual_stages < 1 or (virtual_stages > 1 and schedule is not Schedule.INTERLEAVED_1F1B):
        raise ValueError(f"virtual_stages={virtual_stages} needs >= 1, and > 1 only with interleaved_1f1b")
    if schedule is Schedule.GPIPE:
        return micro_batches
    if schedule is Schedule.INTERLEAVED_1F1B and virtual_stages > 1:  # one chunk: plain 1F1B
        v = virtual_stages
        chunks = 2 * (pp - stage - 1) + (v - 1) * pp + 1
        return min(chunks / v, micro_batches)
    return min(pp - stage, micro_batches)


def pipeline_bubble_fraction(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle share of the ideal (bubble-free) step time of a pipeline of ``pp`` equal stages:
    ``(pp - 1) / (v m)`` (Narayanan et al. 2021, section 2.2: (p-1)/m for GPipe and 1F1B, divided by v
    for the interleaved schedule). Raises ValueError for a non-positive argument."""
    if min(pp, micro_batches, virtual_stages) < 1:
        raise ValueError(
            f"pp, micro_batches and virtual_stages must be >= 1, got {pp}, {micro_batches}, {virtual_stages}"
        )
    return (pp - 1) / (virtual_stages * micro_batches)


def attention_scores_bytes(
    seq_len: int, batch: int, num_heads: int, tp: int = 1, dtype: str = "bf16"
) -> float:
    """Bytes of the attention-score activations one layer keeps for backward on one rank when they are
    stored: softmax output, dropout mask and dropout output, ``5 a s^2 b / t`` for 16-bit activations
    (Korthikanti et al. 2022, eq. 2; what selective recomputation frees, section 5)."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    per = ACT_SCORES_PER_HEAD_TOKEN * num_heads * seq_len * seq_len * batch / tp
    return per * dtype_bytes(dtype) / _KORTHIKANTI_DTYPE_BYTES


def sharded_optimizer_state_bytes(num_params: float, dtype: str, dp: int) -> float:
    """Adam state per rank under the distributed optimizer (ZeRO stage 1, Rajbhandari et al. 2020,
    section 5.1): `adam_state_bytes` (fp32 master weights, momentum, variance) divided over ``dp``
    data-parallel ranks. Raises ValueError for dp < 1."""
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    return adam_state_bytes(num_params, dtype) / dp

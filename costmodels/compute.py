"""Compute cost: per-op time by roofline, and the FLOP / byte counts of common ops.

    time_s = max(flops / (peak_flops_per_s[dtype] * matmul_efficiency),
                 bytes_moved / (memory_bandwidth_bytes_per_s * memory_efficiency)) + launch_overhead_s

(Williams, Waterman, Patterson, "Roofline: an insightful visual performance model", CACM 2009.)
On a device with ``cache_bytes`` set (CPUs), a matmul moving more than that streams its weight from
memory without overlapping the FMAs (measured on the 2-core EPYC dev VM: (64 x 768) @ (768 x 50257)
runs at ~48 GFLOP/s of thread CPU time against ~87-90 for the layer shapes), so it costs

    time_s = flops / (peak * matmul_efficiency) + bytes_moved / stream_bandwidth + launch_overhead_s
All functions are pure; FLOP counts are multiply and add counted separately (one FMA = 2 FLOP),
bytes are bytes read plus bytes written, times are seconds.
"""

from __future__ import annotations

import dataclasses
import math

from costmodels.cluster import AttentionSpec, DeviceSpec, GemmSpec
from costmodels.dtypes import DTYPE_BYTES, dtype_bytes

OP_KINDS = ("matmul", "attention", "conv", "pool", "memory")

# FLOP per element of a normalisation: LayerNorm = mean, subtract, square, mean, rsqrt-scale,
# affine (~8); RMSNorm = square, mean, rsqrt-scale, weight (~4). Counting convention, not measured.
NORM_FLOPS_PER_ELEMENT = {"layernorm": 8, "rmsnorm": 4}
_INDEX_BYTES = 8  # int64 token ids read by an embedding lookup


def op_time_s(
    flops: float,
    bytes_moved: float,
    device: DeviceSpec,
    dtype: str,
    kind: str,
    rows: float | None = None,
    launch: bool = True,
    shape: tuple[float, float] | None = None,
    call: tuple | None = None,
    seq: tuple | None = None,
) -> float:
    """Time in seconds of one op on one device, by roofline plus a fixed launch overhead.

    Args:
        flops: floating-point operations of the op (FLOP).
        bytes_moved: bytes read plus written from device memory (bytes).
        device: the device; its efficiencies scale peak FLOP/s and memory bandwidth.
        dtype: "bf16" | "fp16" | "fp32", selects the peak.
        kind: "matmul" (runs on matrix units at ``peak_flops_per_s[dtype]``), "attention" (the
            attention core: the same peak at ``device.attention_efficiency``, default the matmul
            efficiency) or "memory" (elementwise, norm, softmax, copies: vector units, so its compute
            roof is the fp32 peak).
        rows: a matmul's M (tokens); with ``device.matmul_half_rows`` h set, the matmul runs at
            M / (M + h) of its rate (small-M products under-use the matrix units / vector lanes).
        launch: add ``device.launch_overhead_s``; False when the caller charges a per-node overhead
            (`node_overhead_s`) for the op instead.
        shape: a matmul's (K, N): with ``device.matmul_shape_time_ratios`` holding it (a model's own
            shapes timed on this machine), the roofline time is scaled by that measured ratio.
            With ``device.gemm`` set (GPU presets) and ``rows`` given, the matmul's efficiency is
            instead `gemm_efficiency` (M = rows, K, N) = ``shape``.
        call: a convolution's call (`planner.frontend.analysis.conv_call`): the same with
            ``device.conv_time_ratios``; a "memory" op's, an activation's
            (`planner.frontend.analysis.activation_call`), with ``device.activation_time_ratios``;
            an attention core's (heads, query length, key length, head dim, causal) with
            ``device.attention_time_ratios``. A "memory" or "pool" op without a timed activation ratio
            is scaled by ``device.memory_dtype_time_ratios[dtype]`` where the spec holds one.
        seq: an attention core's (query length, key length, causal mask) in tokens, and optionally its
            thread blocks (`attention_blocks`): with ``device.attention`` set, its efficiency is
            `attention_kernel_efficiency` of them (the blocks' waves over ``device.gemm.sms``).

    Raises:
        ValueError: unknown ``dtype`` or ``kind``, or negative counts.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
    if kind not in OP_KINDS:
        raise ValueError(f"unknown op kind {kind!r}; expected one of {OP_KINDS}")
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"flops and bytes_moved must be >= 0, got {flops}, {bytes_moved}")
    peak = device.peak_flops_per_s["fp32" if kind in ("memory", "pool") else dtype]
    efficiency = device.matmul_efficiency
    if kind == "attention" and device.attention_efficiency is not None:
        efficiency = device.attention_efficiency
    if kind == "conv" and device.conv_efficiency is not None:
        efficiency = device.conv_efficiency
    if kind == "attention" and device.attention is not None and seq is not None:
        blocks = seq[3] if len(seq) > 3 else None
        sms = device.gemm.sms if device.gemm is not None else None
        efficiency = attention_kernel_efficiency(seq[1], seq[2], device.attention, blocks, sms)
    if kind == "matmul" and rows and device.matmul_half_rows:
        efficiency *= rows / (rows + device.matmul_half_rows)
    compute_s = flops / (peak * efficiency)
    if kind == "matmul" and rows and device.gemm is not None and shape is not None:
        compute_s = gemm_compute_s(flops, rows, shape[1], shape[0], device, dtype)
    bandwidth = device.memory_bandwidth_bytes_per_s * device.memory_efficiency
    if kind == "pool" and device.pooling_bandwidth_bytes_per_s is not None:
        bandwidth = device.pooling_bandwidth_bytes_per_s
    memory_s = bytes_moved / bandwidth
    overhead = device.launch_overhead_s if launch else 0.0
    if kind == "matmul" and device.cache_bytes is not None and bytes_moved > device.cache_bytes:
        stream = device.stream_bandwidth_bytes_per_s or bandwidth
        roofline_s = compute_s + bytes_moved / stream
    else:
        roofline_s = max(compute_s, memory_s)
    ratio = shape_time_ratio(device, kind, shape, call)
    if kind in ("memory", "pool") and not (
        call is not None and call in (device.activation_time_ratios or {})
    ):
        # a pool too: a CPU pools 16-bit elements at fp32's rate (a 2x2 max pool over a ConvNet's
        # activations on the dev VM: 2.5 ms bf16, 2.2 ms fp32, priced by bytes at half)
        ratio *= (device.memory_dtype_time_ratios or {}).get(dtype, 1.0)
    return roofline_s * ratio + overhead


# Output tiles of CUDA-core (SIMT) fp32 GEMMs: CUTLASS's SGEMM kernels (NVIDIA/cutlass,
# python/cutlass_library/generator.py, GenerateSM50_Simt: 128x128, 128x64, 64x128, 64x64, 128x32 and
# 32x128 threadblocks), smaller than the tensor-core tiles a GPU preset's `GemmSpec` holds
SIMT_GEMM_TILES: tuple[tuple[int, int], ...] = (
    (128, 128),
    (128, 64),
    (64, 128),
    (64, 64),
    (128, 32),
    (32, 128),
)


def gemm_for_dtype(device: DeviceSpec, dtype: str) -> GemmSpec | None:
    """The GEMM shape model of ``device`` for ``dtype``: its ``gemm`` (fitted to tensor-core bf16 / fp16
    GEMMs) for every dtype but fp32; for fp32 (torch's default, TF32 off: the spec's ``fp32`` peak must
    be the CUDA cores' plain FP32 rate, not TF32's), when that peak is below the 16-bit one, the same
    fit on SIMT tiles (`SIMT_GEMM_TILES`) with the per-tile fixed cost (``half_k``) in K steps of that
    slower math: a tile's prologue and epilogue take the same time, which is fewer K steps when each
    step takes (16-bit peak / fp32 peak) times longer. The split-K floor is kept (slicing K finer
    would add partial sums the fit does not price). Without this a 32 x 64 x 128 fp32 product on an
    H100 was priced at 29 us (one 64 x 256 tile, 5x its launch), more than the CPU it was planned on
    takes. None where the device has no GEMM shape model."""
    gemm = device.gemm
    peaks = device.peak_flops_per_s
    fast = max(peaks.get("bf16", 0.0), peaks.get("fp16", 0.0))
    if gemm is None or dtype != "fp32" or "fp32" not in peaks or not fast or peaks["fp32"] >= fast:
        return gemm
    return dataclasses.replace(gemm, tiles=SIMT_GEMM_TILES, half_k=gemm.half_k * peaks["fp32"] / fast)


def gemm_compute_s(flops: float, m: float, n: float, k: float, device: DeviceSpec, dtype: str) -> float:
    """Seconds of an (m, k) @ (k, n) GEMM's math in ``dtype`` on a device with a GEMM shape model
    (``device.gemm``), by `gemm_efficiency` of `gemm_for_dtype`; an fp32 GEMM never below the same
    shape's in the faster 16-bit dtype (it moves twice the bytes on slower units: the SIMT tiles'
    smaller waves must not price it faster)."""
    gemm = gemm_for_dtype(device, dtype)
    seconds = flops / (device.peak_flops_per_s[dtype] * gemm_efficiency(m, n, k, gemm))
    if gemm is not device.gemm:
        half = max(("bf16", "fp16"), key=lambda d: device.peak_flops_per_s.get(d, 0.0))
        seconds = max(
            seconds, flops / (device.peak_flops_per_s[half] * gemm_efficiency(m, n, k, device.gemm))
        )
    return seconds


def gemm_efficiency(m: float, n: float, k: float, gemm: GemmSpec) -> float:
    """Fraction of peak FLOP/s at which an (m, k) @ (k, n) GEMM runs (dimensions in elements), by the
    tile and wave quantization of NVIDIA's "Matrix Multiplication Background User's Guide"
    (docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication): for each output
    tile (tm, tn) of ``gemm.tiles`` the kernel computes ceil(m / tm) x ceil(n / tn) whole tiles
    (tile fill = m n / (tiles x tm tn)) in waves of ``gemm.sms`` (wave fill = tiles / (waves x sms));
    with fewer tiles than SMs it splits K over up to sms / tiles slices of at least
    ``gemm.min_split_k`` (split-K / stream-K: Osama et al. 2023, "Stream-K: work-centric parallel
    decomposition for dense matrix-matrix multiplication on the GPU"); each tile's K loop of length
    K' = k / splits runs at K' / (K' + ``gemm.half_k``) (the prologue and epilogue of a tile, fitted
    in the preset). The result is ``gemm.efficiency`` times these fills, the best over the tiles (the
    library's heuristic picks a tile per shape). Memory-bound shapes are left to the roofline."""
    if m <= 0 or n <= 0 or k <= 0:
        return gemm.efficiency
    best = 0.0
    for tm, tn in gemm.tiles:
        rows, cols = math.ceil(m / tm), math.ceil(n / tn)
        tiles = rows * cols
        tile_fill = (m * n) / (tiles * tm * tn)
        splits = 1
        if tiles < gemm.sms:
            splits = max(1, min(gemm.sms // tiles, int(k // gemm.min_split_k)))
        blocks = tiles * splits
        wave_fill = blocks / (math.ceil(blocks / gemm.sms) * gemm.sms)
        k_slice = k / splits
        k_fill = k_slice / (k_slice + gemm.half_k)
        best = max(best, tile_fill * wave_fill * k_fill)
    return gemm.efficiency * best


# Query rows per thread block of a fused attention kernel: FlashAttention-3's forward tiles on Hopper
# (Dao-AILab/flash-attention hopper/tile_size.h, tile_size_fwd_sm90: kBlockM 192 for head dims up to
# 64, 128 above), FlashAttention-2's 128; the backward splits the keys into blocks of about as many.
ATTENTION_BLOCK_ROWS = 128
ATTENTION_BLOCK_ROWS_SMALL_HEAD = 192  # head dims up to 64


def attention_blocks(sequences: float, heads: float, q_len: float, head_dim: float = 128) -> int:
    """Thread blocks (output tiles) of a fused attention kernel over ``sequences`` x ``heads`` query
    heads of ``q_len`` queries each: one per `ATTENTION_BLOCK_ROWS` queries of each head
    (`ATTENTION_BLOCK_ROWS_SMALL_HEAD` at head dims up to 64)."""
    tile = ATTENTION_BLOCK_ROWS_SMALL_HEAD if head_dim <= 64 else ATTENTION_BLOCK_ROWS
    rows = math.ceil(max(1.0, q_len) / tile)
    return max(1, math.ceil(max(1.0, sequences) * max(1.0, heads))) * rows


def attention_kernel_efficiency(
    kv_len: float, causal: bool, attention: AttentionSpec, blocks: int | None = None, sms: int | None = None
) -> float:
    """Fraction of peak FLOP/s of a fused attention kernel's forward over keys of ``kv_len`` tokens
    (FLOPs counted as `attention_flops` counts them, the causal half only under a mask):
    ``attention.efficiency`` x L / (L + half), half = ``causal_half_seq`` under a causal mask, else
    ``half_seq`` (short sequences leave the kernel's per-block softmax and pipeline fill uncovered;
    a causal mask's diagonal blocks run part-empty). Fitted in the preset to published kernel tables
    (whose launches fill every SM many times over). With ``blocks`` (`attention_blocks`) and the
    device's ``sms`` given, times the wave quantization of those blocks, as `gemm_efficiency` prices a
    GEMM's tiles: blocks / (ceil(blocks / sms) x sms), so few sequences x heads (a TP rank's heads of
    one sequence, a short prompt) leave SMs idle."""
    half = attention.causal_half_seq if causal else attention.half_seq
    length = max(kv_len, 1.0)
    efficiency = attention.efficiency * length / (length + half)
    if blocks and sms:
        efficiency *= blocks / (math.ceil(blocks / sms) * sms)
    return efficiency


def decode_attention_time_s(sequences: float, heads: float, kv_len: float, head_dim: float, dtype: str,
                            device: DeviceSpec) -> float | None:  # fmt: skip
    """Seconds of a decode step's attention kernel on ``device`` when it runs one thread block per
    (sequence, query head) pair (``device.decode_attention``, `costmodels.cluster.DecodeAttentionSpec`),
    each block reading its head's K and V cache of ``kv_len`` tokens x ``head_dim`` elements of
    ``dtype`` (2 x kv_len x head_dim x bytes): ceil(blocks / sms) waves, each as long as one block's
    bytes at its streaming rate, ``block_share`` x memory bandwidth x memory efficiency / sms. The
    launch is not included; None when the device has no such kernel (it splits the cache: priced by
    bandwidth alone).

    With few pairs (batch 1, a few heads per TP rank) this is far above the bandwidth roofline: one
    block cannot stream the whole GPU's bandwidth. Fitted to Flash-Decoding's table (FlashAttention
    v2.0.9, A100, 16 query heads, seqlen x batch = 65,536: 2,300.6 us at batch 1, 529.2 us at batch 8;
    `costmodels/clusters/dgx-a100.yaml`)."""
    spec = device.decode_attention
    if spec is None or sequences <= 0 or heads <= 0 or kv_len <= 0:
        return None
    streamed = decode_attention_sm_bytes(sequences, heads, kv_len, head_dim, dtype_bytes(dtype), spec.sms)
    rate = spec.block_share * device.memory_bandwidth_bytes_per_s * device.memory_efficiency / spec.sms
    return streamed / rate


def decode_attention_sm_bytes(
    sequences: float, heads: float, kv_len: float, head_dim: float, element_bytes: float, sms: int
) -> float:
    """Bytes one SM streams, one after another, when a decode step's attention runs one thread block
    per (sequence, query head), each reading that head's K and V cache: ceil(blocks / sms) waves of
    2 x kv_len x head_dim x element_bytes (`decode_attention_time_s`; `planner calibrate` fits the
    block rate from it, `costmodels.gpu_calibrate.fit_decode_attention`)."""
    return math.ceil(sequences * heads / sms) * 2.0 * kv_len * head_dim * element_bytes


def training_gemm_shapes(m: float, k: float, n: float) -> tuple[tuple[float, float, float], ...]:
    """The (rows, K, N) of a linear layer's three training GEMMs for an (m, k) @ (k, n) forward:
    the forward, the input gradient (m, n) @ (n, k) and the weight gradient (k, m) @ (m, n)
    (each 2 m k n FLOP; the weight gradient reduces over the m tokens)."""
    return ((m, k, n), (m, n, k), (k, m, n))


def shape_time_ratio(
    device: DeviceSpec, kind: str, shape: tuple[float, float] | None, call: tuple | None = None
) -> float:
    """Measured / priced time of a matmul of (K, N) ``shape`` on ``device``
    (``DeviceSpec.matmul_shape_time_ratios``), of a convolution ``call``
    (``DeviceSpec.conv_time_ratios``), of an activation ``call`` of kind "memory"
    (``DeviceSpec.activation_time_ratios``) or of an attention core's ``call`` (heads, query length, key
    length, head dim, causal: ``DeviceSpec.attention_time_ratios``), 1.0 for other ops and for shapes
    not measured."""
    if kind == "conv":
        return _conv_ratio(device.conv_time_ratios or {}, call) if call is not None else 1.0
    if kind == "memory":
        return (device.activation_time_ratios or {}).get(call, 1.0) if call is not None else 1.0
    if kind == "attention":
        return (device.attention_time_ratios or {}).get(call, 1.0) if call is not None else 1.0
    ratios = device.matmul_shape_time_ratios
    if kind != "matmul" or not ratios or shape is None:
        return 1.0
    return ratios.get((round(shape[0]), round(shape[1])), 1.0)


def _conv_ratio(ratios: dict[tuple, float], call: tuple) -> float:
    """The ratio timed for ``call``, else for the same convolution at another batch size (the largest
    timed), else 1.0."""
    if call in ratios:
        return ratios[call]
    name, args, input_grad = call
    same = [
        (k[1][0][1][0], r)
        for k, r in ratios.items()
        if k[0] == name and k[1][1:] == args[1:] and k[2] == input_grad
    ]
    return max(same)[1] if same else 1.0


# (dim, heads, tokens) of the two probe graphs `planner calibrate` times (`costmodels.calibrate`):
# the toy one, whose slope the spec keeps as `probe_node_overhead_s` (and a run's speed probe
# re-times), and SIZED_PROBE at a small model's scale (a tiny Llama's activations at batch 1), whose
# per-node time net of the roofline the cost model prices for its ops
# (`costmodels.calibrate.calibrate(probe_roofline=...)`) is `node_overhead_s`. The toy probe
# leaves out the allocation and cache traffic of real activations: on this 2-vCPU VM (2026-11-30, one
# process) its slope read 7.2 us per node where the dim-64 probe, net of its roofline, read 9.3-9.9;
# priced with the latter the tiny Llama-3 forward (batch 1) came out at 3.15-3.26 ms against 3.15-3.29
# measured beside it, with the former 2.7 ms.
TOY_PROBE = (8, 2, 4)
SIZED_PROBE = (64, 4, 32)
# activation elements per node of each (one sequence: tokens x dim)
TOY_PROBE_ELEMENTS, SIZED_PROBE_ELEMENTS = TOY_PROBE[0] * TOY_PROBE[2], SIZED_PROBE[0] * SIZED_PROBE[2]


def per_node_overhead_s(device: DeviceSpec, elements: float | None = None) -> float | None:
    """Seconds per fx node of an eager GraphModule whose activations hold ``elements`` elements
    (tokens x hidden on one rank): ``device.node_overhead_s``, measured at `SIZED_PROBE_ELEMENTS`;
    with the toy probe's figure in the spec (``probe_node_overhead_s``), interpolated between the two
    in log(elements) below that size (a decode step's one token per sequence dispatches like the toy
    probe), and the sized figure above it. None without a per-node figure."""
    sized, toy = device.node_overhead_s, device.probe_node_overhead_s
    if sized is None or toy is None or elements is None or elements >= SIZED_PROBE_ELEMENTS:
        return sized
    share = max(0.0, math.log(max(elements, 1.0) / TOY_PROBE_ELEMENTS)) / math.log(
        SIZED_PROBE_ELEMENTS / TOY_PROBE_ELEMENTS
    )
    return toy + (sized - toy) * share


def node_overhead_s(
    device: DeviceSpec, nodes: float, backward: bool = False, elements: float | None = None
) -> float:
    """Fixed seconds of executing ``nodes`` fx nodes in an eager GraphModule on ``device``:
    ``nodes * per_node_overhead_s(device, elements)`` (+ ``backward_node_overhead_s`` each with
    ``backward``, the autograd pass of a training step); 0 when the device has no per-node figure (GPU
    presets: each op pays ``launch_overhead_s`` in `op_time_s` instead)."""
    per_forward = per_node_overhead_s(device, elements)
    if per_forward is None:
        return 0.0
    per_node = per_forward
    if backward:
        per_node += (
            per_forward if device.backward_node_overhead_s is None else device.backward_node_overhead_s
        )
    return nodes * per_node


def conv_flops(
    out_elements: float, in_channels_per_group: float, kernel_elements: float, bias: bool = False
) -> float:
    """FLOP of a convolution: each output element is a dot product over (C_in / groups) x kernel
    inputs, 2 * out * C_in/groups * kernel (+ out for the bias)."""
    return 2.0 * out_elements * in_channels_per_group * kernel_elements + (out_elements if bias else 0.0)


def matmul_flops(m: float, k: float, n: float) -> float:
    """FLOP of an (m, k) @ (k, n) matmul: 2*m*k*n."""
    return 2.0 * m * k * n


def matmul_bytes(m: float, k: float, n: float, dtype: str) -> float:
    """Bytes of an (m, k) @ (k, n) matmul: read both operands, write the (m, n) result once."""
    return (m * k + k * n + m * n) * dtype_bytes(dtype)


def linear_flops(tokens: float, in_features: float, out_features: float, bias: bool = False) -> float:
    """FLOP of ``nn.Linear`` on ``tokens`` rows: 2*tokens*in*out, plus tokens*out for the bias add."""
    return matmul_flops(tokens, in_features, out_features) + (tokens * out_features if bias else 0.0)


def linear_bytes(
    tokens: float, in_features: float, out_features: float, dtype: str, bias: bool = False
) -> float:
    """Bytes of ``nn.Linear``: input (tokens, in), weight (out, in), bias (out), output (tokens, out)."""
    return matmul_bytes(tokens, in_features, out_features, dtype) + (
        out_features * dtype_bytes(dtype) if bias else 0.0
    )


def attention_flops(
    batch: float, heads: float, q_len: float, kv_len: float, head_dim: float, causal: bool = False
) -> float:
    """FLOP of the attention core (SDPA): Q K^T and P V, 2 * (2*B*H*Tq*Tk*hd) = 4*B*H*Tq*Tk*hd.

    ``causal=True`` halves it (a causal kernel skips the masked upper triangle when Tq == Tk;
    approximate otherwise). Softmax FLOPs are negligible beside these and not counted.
    """
    flops = 4.0 * batch * heads * q_len * kv_len * head_dim
    return flops / 2.0 if causal else flops


def attention_bytes(
    batch: float, heads: float, kv_heads: float, q_len: float, kv_len: float, head_dim: float, dtype: str
) -> float:
    """Bytes of a fused (flash-style) SDPA: read Q (B,H,Tq,hd), K and V (B,Hkv,Tk,hd), write O (B,H,Tq,hd).

    The (Tq, Tk) score matrix stays on chip, so it moves no memory. With a KV cache (decode) this
    is dominated by reading K and V.
    """
    q_and_out = 2.0 * batch * heads * q_len * head_dim
    k_and_v = 2.0 * batch * kv_heads * kv_len * head_dim
    return (q_and_out + k_and_v) * dtype_bytes(dtype)


# Bytes per (s, s) attention-score element of an attention core that writes its scores to memory
# (``attention_kernel: materialized``: Megatron-LM's core attention before FlashAttention), 16-bit:
# forward: QK^T writes the scores (2), softmax reads and writes them (2 + 2), dropout reads them and
# writes its output and a 1-byte mask (2 + 2 + 1), probabilities @ V reads them (2): 13; inference has
# no dropout: 8. Backward: grad of the probabilities written (2) and the probabilities read for grad V
# (2); dropout backward reads the grad and the mask and writes (2 + 1 + 2); softmax backward reads the
# probabilities and the grad and writes (2 + 2 + 2); grad Q and grad K read the score grads (2 + 2): 19.
MATERIALIZED_SCORES_FORWARD_BYTES = 13.0
MATERIALIZED_SCORES_INFERENCE_BYTES = 8.0
MATERIALIZED_SCORES_BACKWARD_BYTES = 19.0


def materialized_scores_bytes(score_elements: float, dtype: str, train: bool) -> tuple[float, float]:
    """(forward, backward) bytes moved over ``score_elements`` attention scores by an unfused attention
    core (constants above, scaled from 16-bit to ``dtype``)."""
    scale = dtype_bytes(dtype) / 2.0
    if not train:
        return score_elements * MATERIALIZED_SCORES_INFERENCE_BYTES * scale, 0.0
    return (
        score_elements * MATERIALIZED_SCORES_FORWARD_BYTES * scale,
        score_elements * MATERIALIZED_SCORES_BACKWARD_BYTES * scale,
    )


def elementwise_flops(numel: float, flops_per_element: float = 1.0) -> float:
    """FLOP of an elementwise op over ``numel`` output elements (1 per element for add/mul)."""
    return numel * flops_per_element


def elementwise_bytes(numel: float, dtype: str, num_inputs: int = 1, num_outputs: int = 1) -> float:
    """Bytes of an elementwise op: each of its inputs read and outputs written once, ``numel`` each."""
    return numel * (num_inputs + num_outputs) * dtype_bytes(dtype)


def norm_flops(tokens: float, hidden: float, kind: str = "layernorm") -> float:
    """FLOP of LayerNorm / RMSNorm over (tokens, hidden), see ``NORM_FLOPS_PER_ELEMENT``."""
    if kind not in NORM_FLOPS_PER_ELEMENT:
        raise ValueError(f"unknown norm kind {kind!r}; expected one of {sorted(NORM_FLOPS_PER_ELEMENT)}")
    return tokens * hidden * NORM_FLOPS_PER_ELEMENT[kind]


def norm_bytes(tokens: float, hidden: float, dtype: str, kind: str = "layernorm") -> float:
    """Bytes of a norm: read x, write y (tokens, hidden), read the weight (and LayerNorm's bias)."""
    params = 2 if kind == "layernorm" else 1
    return (2.0 * tokens * hidden + params * hidden) * dtype_bytes(dtype)


# Bytes per logit of a training step's cross-entropy loss beyond twice the logits' own dtype (read once,
# its gradient written once), as PyTorch's F.cross_entropy(logits.float()) and Megatron-LM's
# vocab-parallel cross-entropy compute it in fp32: the upcast copy written (4), log-softmax forward
# reading it for the max and the sum (8) and writing its output (4), the loss gradient written dense
# (4), log-softmax backward reading that and the output (8) and writing (4), and the cast back reading
# the fp32 gradient (4): 36, plus a reduction's second pass over the row in each direction (4 + 4).
# Counted from the kernels each step launches, not measured.
CROSS_ENTROPY_FP32_BYTES = 44
# FLOP per logit, forward + backward: max, subtract, exp, sum, log, scale (counting convention)
CROSS_ENTROPY_FLOPS = 10


def cross_entropy_bytes(logits: float, dtype: str) -> float:
    """Bytes a training step's cross-entropy moves over ``logits`` elements of ``dtype`` (forward and
    backward, computed in fp32: `CROSS_ENTROPY_FP32_BYTES` per logit plus the logit read and its
    gradient written in ``dtype``)."""
    return logits * (2 * dtype_bytes(dtype) + CROSS_ENTROPY_FP32_BYTES)


def embedding_bytes(tokens: float, dim: float, dtype: str) -> float:
    """Bytes of an embedding lookup: read int64 ids, read ``tokens`` rows of ``dim``, write them out."""
    return tokens * _INDEX_BYTES + 2.0 * tokens * dim * dtype_bytes(dtype)


# glibc's largest dynamic mmap threshold on 64-bit hosts (mallopt(3), M_MMAP_THRESHOLD: DEFAULT_MMAP_
# THRESHOLD_MAX = 4 * 1024 * 1024 * sizeof(long)): a CPU tensor over this size is mapped fresh from
# the OS on every allocation and returned on free, so writing it first pays its page faults.
LARGE_TENSOR_BYTES = 32 * 2**20
# Bytes one Adam step moves per parameter in the priced layout: read + write the fp32 master weight,
# momentum and variance (2 x 12 B), read the gradient and write the 16-bit parameter (2 x 2 B), as a
# fused kernel does (Megatron-LM's FusedAdam; Rajbhandari et al. 2020, ZeRO, 16 B of state per parameter).
ADAM_BYTES_PER_PARAM = 2 * 12.0 + 2 * 2.0


CACHED_TENSOR_BYTES = 2**20  # fp32 tensors up to this size step at the device's in-cache Adam rate


def adam_step_time_s(
    params: float, large_params: float, device: DeviceSpec, dtype: str, cached_params: float = 0.0
) -> float:
    """Seconds of the Adam update of ``params`` parameter elements on one device, ``large_params`` of
    them in tensors over `LARGE_TENSOR_BYTES` (fp32) and ``cached_params`` in tensors of at most
    `CACHED_TENSOR_BYTES` (at ``adam_cached_s_per_param`` when the device has it), dispatch not included.

    With the device's measured rates (``adam_s_per_param``, ``adam_large_tensor_s_per_param``, from
    `planner calibrate` on CPUs: torch.optim.Adam's per-tensor loop, which writes two temporaries per
    tensor and so moves ~2.5x the fused kernel's bytes), those per fp32 parameter; a 16-bit model adds
    the copies to and from its fp32 master weights (grad.float(), param.copy_(master): 12 B per
    parameter) at memory bandwidth. Without them, `ADAM_BYTES_PER_PARAM` at memory bandwidth.

    Raises ValueError for negative counts or ``large_params + cached_params`` > ``params``."""
    if (
        params < 0
        or large_params < 0
        or cached_params < 0
        or large_params + cached_params > params * (1 + 1e-9)
    ):
        raise ValueError(
            f"need 0 <= large_params + cached_params <= params, got {large_params}, {cached_params}, {params}"
        )
    bandwidth = device.memory_bandwidth_bytes_per_s * device.memory_efficiency
    small_s, large_s = device.adam_s_per_param, device.adam_large_tensor_s_per_param
    if small_s is None:
        return params * ADAM_BYTES_PER_PARAM / bandwidth
    large_s = small_s if large_s is None else large_s
    cached_s = small_s if device.adam_cached_s_per_param is None else device.adam_cached_s_per_param
    copies_s = params * 12.0 / bandwidth if dtype_bytes(dtype) < 4 else 0.0
    middle = max(0.0, params - large_params - cached_params)
    return middle * small_s + large_params * large_s + cached_params * cached_s + copies_s


def fresh_write_time_s(nbytes: float, device: DeviceSpec) -> float:
    """Seconds to write ``nbytes`` into a freshly allocated tensor (a dense embedding gradient): at
    ``device.fresh_write_bandwidth_bytes_per_s`` when the tensor is over `LARGE_TENSOR_BYTES` and the
    device measured it (a CPU's page faults), else at memory bandwidth."""
    fresh = device.fresh_write_bandwidth_bytes_per_s
    if fresh is not None and nbytes > LARGE_TENSOR_BYTES:
        return nbytes / fresh
    return nbytes / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)

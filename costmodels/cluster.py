"""Cluster specs: YAML (human units) -> frozen dataclasses (SI units), validated once at load.

YAML layout (units in the field names; see the presets in ``costmodels/clusters/``)::

    name: dgx-h100
    nodes: 1
    devices_per_node: 8            # or "auto": os.cpu_count(), for CPU-process clusters
    backend: nccl                  # nccl | gloo
    overlap_efficiency: 0.8        # [0, 1]: share of async communication hidden behind compute
    overlap_slowdown: 0.19         # optional, [0, 1] (default 0): compute seconds lost per second of
                                   # communication hidden behind it (SM and memory contention)
    attention_kernel: fused        # optional: fused (flash-style, default) | materialized | per_query_head
                                   # (see ClusterSpec)
    sources: ["...", "..."]        # optional: where each number came from
    device:
      name: H100 SXM5 80GB
      memory_GiB: 79.6
      peak_TFLOPS: {bf16: 989, fp16: 989, fp32: 67}
      memory_bandwidth_GBps: 3350
      matmul_efficiency: 0.7       # (0, 1]
      memory_efficiency: 0.8       # (0, 1]
      launch_overhead_us: 4
      # optional (CPU devices; absent = plain roofline): a matmul moving more than cache_MiB costs
      # compute + bytes / stream_bandwidth_GBps instead of the max of the two
      cache_MiB: 32
      stream_bandwidth_GBps: 4
      attention_efficiency: 0.3    # optional, (0, 1]: SDPA's fraction of peak (default: matmul_efficiency)
      matmul_half_rows: 16         # optional: a matmul with M rows reaches M / (M + this) of its rate
      # optional (eager CPU runs; absent = launch_overhead_us per op, as on GPUs): fixed time per fx
      # node a rewritten GraphModule executes (Python + ATen dispatch, views included), charged for
      # every node of the graph; backward_node_overhead_us: the same per forward node in a backward
      # pass (absent = node_overhead_us). `planner calibrate` measures both on a captured graph of tiny ops.
      node_overhead_us: 12
      backward_node_overhead_us: 10
      probe_node_overhead_us: 7    # optional, written by `planner calibrate`: the speed probe's references
      # optional (eager GPU runs, written by `planner calibrate` on CUDA): host time to issue one fx node
      # (Python, ATen dispatch, the kernel launch) while the GPU runs the queued kernels; a layer takes
      # at least its nodes times this (forward; + host_dispatch_backward_us per forward node in training)
      host_dispatch_us: 18
      host_dispatch_backward_us: 49
      conv_efficiency: 0.3         # optional, (0, 1]: convolutions' fraction of peak (default: matmul_efficiency)
      pooling_bandwidth_GBps: 1    # optional: bytes / s of pooling ops (default: memory bandwidth)
      # optional (eager CPU; absent = Adam priced by bytes moved): torch.optim.Adam's step per fp32
      # parameter in tensors under / over 32 MiB, and bytes / s written into freshly allocated memory
      adam_ns_per_param: 4
      adam_large_tensor_ns_per_param: 6
      fresh_write_bandwidth_GBps: 3
      adam_tensor_overhead_us: 20    # optional: the step's fixed cost per tensor (absent: per-node dispatch)
      adam_cached_ns_per_param: 2    # optional: per parameter in tensors <= 1 MiB (absent: adam_ns_per_param)
    links:
      intra_node: {kind: nvlink, bandwidth_GBps: 370, latency_us: 3.3}   # per direction, per device
      inter_node: {kind: infiniband, bandwidth_GBps: 37.5, latency_us: 6, nics_per_node: 8}  # per NIC

Every error is a :class:`SpecError` whose message starts with the origin (file or preset) and the
YAML path of the field, and says what is expected (type, unit, range).
"""

from __future__ import annotations

import difflib
import math
import os
import re
import warnings
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from planner.errors import InputError

DTYPES = ("bf16", "fp16", "fp32")
LINK_KINDS = ("nvlink", "pcie", "loopback", "infiniband", "ethernet")
BACKENDS = ("nccl", "gloo")
ATTENTION_KERNELS = ("fused", "materialized", "per_query_head")

# Unit conversions, applied once here (ARCHITECTURE.md: SI inside, human units at the YAML edge).
_GIB = 2.0**30  # bytes per GiB
_MIB = 2.0**20  # bytes per MiB (cache sizes)
_GB = 1e9  # bytes per GB (link and memory bandwidths are decimal GB/s, as in datasheets)
_TFLOPS = 1e12  # FLOP/s per TFLOP/s
_US = 1e-6  # seconds per microsecond
_ROUND_DIGITS = 12  # significant digits kept by cluster_to_dict, so that YAML round-trips exactly


class SpecError(InputError):
    """A malformed cluster spec. ``path`` is the YAML path of the offending field ("" for the file)."""

    def __init__(self, origin: str, path: str, message: str) -> None:
        self.origin = origin
        self.path = path
        where = f"{origin}: {path}" if path else origin
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class GemmSpec:
    """How a GPU's GEMM (cuBLAS / CUTLASS) rate depends on its shape (`costmodels.compute.gemm_efficiency`).

    The kernel cuts the (M, N) output into tiles, runs them in waves of ``sms`` thread blocks and
    loops over K in each (NVIDIA, "Matrix Multiplication Background User's Guide": tile and wave
    quantization): efficiency = ``efficiency`` x tile fill x wave fill x K / (K + ``half_k``), the best
    over ``tiles``; with fewer tiles than SMs, K is split (split-K / stream-K) into slices of at least
    ``min_split_k``. All figures are fitted to published measurements named in the preset."""

    efficiency: float  # fraction of peak of a GEMM with full tiles and waves as K grows without bound
    half_k: float  # K (elements) at which one tile's main loop reaches half that rate
    sms: int  # thread blocks running at once (one per SM)
    tiles: tuple[tuple[int, int], ...]  # (rows, columns) of the output tiles the library picks among
    min_split_k: float  # smallest K slice (elements) of a split-K kernel


@dataclass(frozen=True)
class AttentionSpec:
    """A fused (flash-style) attention kernel's rate by sequence length
    (`costmodels.compute.attention_kernel_efficiency`): ``efficiency`` x L / (L + half), with ``half``
    = ``half_seq`` without a causal mask and ``causal_half_seq`` with one (L the key length); its
    backward takes ``backward_time_factor`` times the forward's time (FlashAttention's backward runs
    2.5x the forward's FLOPs at a lower rate). A training core with dropout on its probabilities
    (SDPA's ``dropout_p``, drawn inside the kernel) takes ``dropout_time_factor`` times the forward +
    backward time of the same core without it."""

    efficiency: float  # fraction of peak as the sequence grows without bound
    half_seq: float  # key length (tokens) at half that rate, no mask
    causal_half_seq: float  # the same under a causal mask
    backward_time_factor: float  # backward time / forward time
    # (forward + backward with attention dropout) / (the same without); 1.0: not priced
    dropout_time_factor: float = 1.0


@dataclass(frozen=True)
class DecodeAttentionSpec:
    """A decode step's attention kernel that runs one thread block per (sequence, query head) pair,
    each reading that head's whole K and V cache, without splitting the cache over more blocks
    (FlashAttention v2.0, TensorRT-LLM's masked MHA without multi-block mode, vLLM's PagedAttention
    v1): with fewer pairs than SMs most of the GPU idles (Dao, Haziza, Massa, Sizov 2023,
    "Flash-Decoding for long-context inference"). `costmodels.compute.decode_attention_time_s`: the
    blocks run in waves of ``sms``, each block streaming at ``block_share`` x (memory bandwidth x
    memory efficiency) / ``sms``. Absent from a spec: the kernel splits the cache (Flash-Decoding),
    priced by bandwidth alone."""

    sms: int  # thread blocks running at once (one per SM)
    block_share: float  # one block's streaming rate / the per-SM share of the achieved bandwidth


@dataclass(frozen=True)
class ServingHostSpec:
    """A serving engine's host work in each step (prefill or decode), on the CPU while the GPU waits:
    scheduling the batch, building its block tables and inputs, sampling and detokenising, handing the
    step to its tensor-parallel workers. It belongs to the engine and its version, not to the device:
    vLLM's v0.6.0 performance post (blog.vllm.ai, 2024-09-05) profiled vLLM 0.5.3 serving Llama-3-8B
    on one H100 and found scheduling and input preparation 29% of the time. A step costs
    ``step_s`` + ``per_sequence_s`` x the sequences it runs (per data-parallel replica) +
    ``per_worker_s`` x (TP x PP ranks of the replica - 1)."""

    step_s: float  # seconds per step, whatever its batch
    per_sequence_s: float = 0.0  # seconds per sequence in the step
    per_worker_s: float = 0.0  # seconds per further rank (worker process) of the model replica

    def time_s(self, sequences: float, ranks: int) -> float:
        """Seconds of host work in a step of `sequences` sequences on a replica of `ranks` ranks."""
        return self.step_s + self.per_sequence_s * sequences + self.per_worker_s * (ranks - 1)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one CPU process). All values SI."""

    name: str
    memory_bytes: float  # usable memory per device
    peak_flops_per_s: dict[str, float]  # dense matmul peak, keys "bf16", "fp16", "fp32"
    memory_bandwidth_bytes_per_s: float
    matmul_efficiency: float  # achievable fraction of peak for large matmuls (0, 1]
    memory_efficiency: float  # achievable fraction of memory bandwidth (0, 1]
    launch_overhead_s: float  # fixed cost per kernel / per op (and per collective)
    # Optional, for CPUs (None: plain roofline). A matmul moving more than ``cache_bytes`` streams its
    # weight from memory without overlapping its FMAs (and re-packs it): compute time + bytes moved /
    # ``stream_bandwidth_bytes_per_s`` (default: memory bandwidth x efficiency) instead of the max.
    cache_bytes: float | None = None
    # Optional: achieved fraction of peak of the attention core (SDPA), None: matmul_efficiency.
    attention_efficiency: float | None = None
    stream_bandwidth_bytes_per_s: float | None = None
    # Optional: a matmul of M rows (tokens) runs at M / (M + matmul_half_rows) of the large-M rate
    # (fitted by `planner calibrate` from (64 x C) and (512 x C) products; None: no row dependence).
    matmul_half_rows: float | None = None
    # Optional (None: every op pays ``launch_overhead_s``, the GPU model): fixed seconds per fx node
    # executed by a rewritten GraphModule in eager mode (Python dispatch of the generated code, ATen
    # dispatch, the kernel call of a tiny op; views and reshapes included), charged for EVERY node of
    # the graph instead of ``launch_overhead_s`` per op. ``backward_node_overhead_s``: autograd's cost
    # per forward node in the backward pass (None: ``node_overhead_s``).
    node_overhead_s: float | None = None
    backward_node_overhead_s: float | None = None
    # Optional (an asynchronous device, eager GPU runs; None: not priced): host seconds to issue one fx
    # node of a GraphModule (Python and ATen dispatch, the kernel launch) while the device runs what is
    # queued, and the same per forward node of a backward pass. The device cannot finish a layer before
    # the host has issued it, so a layer costs at least its nodes times these (`LayerGraph.dispatch_s`):
    # small models and small decode batches run at the host's pace. `planner calibrate` measures both
    # on CUDA (its probe graph's per-node slope).
    host_dispatch_s: float | None = None
    host_dispatch_backward_s: float | None = None
    # Optional: achieved fraction of peak of convolutions (None: matmul_efficiency), and bytes / s of
    # pooling ops (None: memory bandwidth x efficiency): CPU kernels of both are far below the roofs.
    conv_efficiency: float | None = None
    pooling_bandwidth_bytes_per_s: float | None = None
    # Optional (written by `planner calibrate`): the toy probe graph's per-node slopes (forward, backward)
    # at calibration, when the per-node overheads above were measured at a small model's scale instead;
    # a run's speed probe (the toy graph) compares with these. None: with node_overhead_s itself.
    probe_node_overhead_s: float | None = None
    probe_backward_node_overhead_s: float | None = None
    # Optional (written by `planner calibrate`): FLOP/s of the speed probe's fp32 matmul
    # (`costmodels.calibrate.PROBE_MATMUL_SHAPE`) at calibration; a run's probe compares with it.
    probe_matmul_flops_per_s: float | None = None
    # Optional (written by `planner calibrate` on CPUs; None: the Adam step is priced by the bytes it
    # moves, `costmodels.compute.adam_step_time_s`): seconds per fp32 parameter of torch.optim.Adam's
    # step (the per-tensor loop the runtime runs) over tensors of at most `LARGE_TENSOR_BYTES`, and over
    # larger ones, whose temporaries glibc maps fresh from the OS every step (page faults); and bytes / s
    # written into freshly allocated memory of that size (a dense embedding gradient, a tied weight's
    # gradient sum). Measured on the 2-vCPU dev VM (2026-12-01, one thread): 3.8-4.5 ns per parameter
    # in 1-16 MiB tensors, 6.2-6.9 ns in 64-160 MiB ones, 2.4-2.8 GB/s fresh against 5-7 GB/s rewritten.
    adam_s_per_param: float | None = None
    adam_large_tensor_s_per_param: float | None = None
    fresh_write_bandwidth_bytes_per_s: float | None = None
    # Optional (written by `planner calibrate` on CPUs): torch.optim.Adam's fixed cost per parameter
    # tensor (its per-tensor loop dispatches about a dozen ops; None: `planner.solver.costing.
    # ADAM_OPS_PER_TENSOR` per-node overheads), and its rate per parameter in tensors of at most
    # `costmodels.compute.CACHED_TENSOR_BYTES`, which stay in cache (None: adam_s_per_param). Measured
    # on the 2-vCPU dev VM (2026-12-01, one thread): 22 us per tensor, 1.6-2.0 ns per parameter in
    # 64K-256K element tensors against 3.2-3.5 ns in 1M element ones; a tiny Llama's 39 tensors of 17K
    # elements on average stepped in 2.2 ms, priced 4.4 ms with the per-node dispatch and 4 MiB rate.
    adam_tensor_overhead_s: float | None = None
    adam_cached_s_per_param: float | None = None
    # Optional, set at planning time, never read from YAML: measured / priced time of a model's own
    # (K, N) matmul shapes on this machine (`costmodels.calibrate.matmul_shape_time_ratios`), which
    # `costmodels.compute.op_time_s` applies to a matmul of that (K, N) at any M. A CPU's rate depends on
    # the weight's shape, not on its size alone: on the 2-vCPU dev VM (64 x 768) @ (768 x 3072) runs at
    # ~73 GFLOP/s and (64 x 3072) @ (3072 x 768) at ~130, so no smooth fit prices both.
    matmul_shape_time_ratios: dict[tuple[int, int], float] | None = None
    # Optional, set at planning time, never read from YAML: the same for a model's own convolutions,
    # keyed by their call (`planner.frontend.analysis.conv_call`; `costmodels.calibrate.conv_time_ratios`):
    # on the dev VM a 3x3 conv2d from 3 input channels ran at a fraction of the rate of one from 64.
    conv_time_ratios: dict[tuple, float] | None = None
    # Optional, set at planning time, never read from YAML: the same for a model's activations (GELU,
    # SiLU, ...), keyed by `planner.frontend.analysis.activation_call` (`costmodels.calibrate.
    # activation_time_ratios`): priced as memory-bound ops, but erf and exp are far from free on a CPU
    # (on the dev VM an exact GELU over 64 x 256 fp32 took ~14 us forward, priced 10 us; its backward
    # ~2x more than a plain op's).
    activation_time_ratios: dict[tuple, float] | None = None
    # Optional, set at planning time, never read from YAML: the same for a model's own attention cores,
    # keyed by (query heads on a rank, query length, key length, head dim, causal) (`costmodels.
    # calibrate.attention_time_ratios`): the spec's one ``attention_efficiency`` is measured on one
    # shape's forward, but on the dev VM a 16-wide head ran SDPA 1.5-1.7x slower per FLOP than a 64-wide
    # one, and its backward took 2.6-2.8 forwards where a training step prices 2 (2026-12-07).
    attention_time_ratios: dict[tuple, float] | None = None
    # Optional, set at planning time, never read from YAML: measured / priced time of a model's plain
    # memory-bound ops (adds, products, norms' reductions, copies: not its timed activations) in a
    # 16-bit dtype, keyed by the dtype, relative to the same ops in fp32 (`costmodels.calibrate.
    # memory_dtype_time_ratio`). Priced by bytes, a bf16 op takes half fp32's time, but a CPU computes
    # bf16 in fp32 lanes with conversions on the way: on the dev VM a bf16 add over 32K elements took
    # 7.6 us against fp32's 4.8, faster only past the caches (4M elements: 0.9 against 1.7 ms).
    memory_dtype_time_ratios: dict[str, float] | None = None
    # Optional, set at planning time, never read from YAML: seconds of host work per decode step outside
    # the graph (building the model file's step inputs, taking the last logits), timed on this machine
    # for a decode plan of a model with a KV cache (`runtime.decode.host_step_time_s`); None: 0.
    decode_host_s: float | None = None
    # Optional, set at planning time, never read from YAML: measured / priced per-node time of the
    # model's own decode graph on this machine (`costmodels.calibrate.graph_node_time_ratio`), which
    # scales the per-node overhead of a decode step: its cache writes, mask building and position
    # gathers dispatch slower than the probe graph's transformer-block ops (on the dev VM the HF Llama
    # decode graph ran 1.2x the priced per-node time net of its roofline, 2026-12-01); None: 1.
    decode_node_time_ratio: float | None = None
    # Optional (GPU presets): GEMMs priced by (M, N, K) (`GemmSpec`) instead of ``matmul_efficiency``
    # alone, and fused attention by sequence length (`AttentionSpec`) instead of
    # ``attention_efficiency``; None: those fixed efficiencies (CPU specs are priced as before).
    gemm: GemmSpec | None = None
    attention: AttentionSpec | None = None
    # Optional (None: a split-cache decode kernel, priced by bandwidth alone): the decode step's
    # attention kernel runs one block per (sequence, query head) (`DecodeAttentionSpec`)
    decode_attention: DecodeAttentionSpec | None = None
    # Optional (None: no host work between steps is priced): the serving engine's host work per
    # prefill or decode step (`ServingHostSpec`)
    serving_host: ServingHostSpec | None = None


CALIBRATED_SPEC_NAME = "local-calibrated"  # the name of a spec written by `planner calibrate`
CALIBRATED_SOURCE = "measured by planner calibrate"  # how its first source line starts


@dataclass(frozen=True)
class LinkSpec:
    """A link class. Bandwidth is the achievable figure that the alpha-beta model uses."""

    kind: str  # "nvlink" | "pcie" | "loopback" | "infiniband" | "ethernet"
    bandwidth_bytes_per_s: float  # per direction, per device (inter-node: per NIC)
    latency_s: float  # alpha: fixed cost of one step of a collective over this link
    nics_per_node: int = 1  # inter-node only
    # alpha of each collective after the first of a back-to-back stream (ZeRO-2 / FSDP: one per layer),
    # where the backend is already running; measured by `planner calibrate`; None: `latency_s`
    burst_latency_s: float | None = None
    # intra-node only: the node's NVSwitches reduce in the switch (NVLink SHARP, "NVLS": third-generation
    # NVSwitch with Hopper or later), so NCCL's all-reduce can use its NVLS algorithm
    # (`costmodels.comm`, backend nccl only)
    nvls: bool = False


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster: ``num_nodes`` nodes of ``devices_per_node`` identical devices."""

    name: str
    num_nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec | None  # None when num_nodes == 1
    backend: str  # "nccl" | "gloo"
    overlap_efficiency: float  # fraction of async comm that really hides behind compute [0, 1]
    sources: tuple[str, ...]
    # Compute time lost per second of communication hidden behind it [0, 1]: a collective running
    # beside a kernel takes SMs (NCCL's channels are thread blocks) and memory bandwidth from it, so
    # hiding c seconds of traffic costs overlap_slowdown x c seconds of the compute it hides under
    # (`planner.solver.costing.contention_s`). 0: overlap is free (the CPU presets: not measured).
    overlap_slowdown: float = 0.0
    # The software stack's attention kernel: "fused" (flash-style: the (s, s) scores stay on chip) or
    # "materialized" (scores written to memory, softmax and dropout over them, kept for backward unless
    # selectively recomputed: Megatron-LM before FlashAttention, Dao et al. 2022), or "per_query_head"
    # (fused, but a decode step reads each KV head once per query head that uses it: the masked
    # multi-head attention kernels of 2023 serving engines run one thread block per query head and
    # load its KV head through a head mapping, vllm-project/vllm#452; TensorRT-LLM added its XQA kernel
    # for grouped-query decode in 0.7, NVIDIA TensorRT-LLM docs "XQA kernel"). Same as "fused" for
    # models without grouped-query attention.
    attention_kernel: str = "fused"
    # the spec said devices_per_node: auto (os.cpu_count() when loaded): --nproc sets it freely; not
    # part of what the cluster is (a spec written back, `cluster_to_dict`, gives the count)
    devices_auto: bool = field(default=False, compare=False)
    # the device count the spec gave before `load_cluster(..., nproc=)` (--nproc) re-sized it; None: as
    # written. For messages only ("dgx-h100 has 2 (--nproc 2 of its 8)"), not part of what the cluster is
    resized_from: int | None = field(default=None, compare=False)

    @property
    def num_devices(self) -> int:
        """Total number of devices (ranks) in the cluster."""
        return self.num_nodes * self.devices_per_node

    def devices_text(self) -> str:
        """ "NAME has N", and where --nproc re-sized the spec, from how many (a message's end)."""
        resized = f" (--nproc {self.num_devices} of its {self.resized_from})" if self.resized_from else ""
        return f"{self.name} has {self.num_devices}{resized}"


# --------------------------------------------------------------------------------------------
# Field readers. Each takes the raw YAML value and its path and returns a checked Python value.


class SpecWarning(UserWarning):
    """A cluster spec value that parses but lies outside physical ranges (most often a unit slip)."""


# Plausible ranges (in the YAML's units) of any device or link built so far, generous by about 10x
# either way (compute lower still: a CPU process without a native fp16 matmul path measured ~0.001
# TFLOP/s fp16): a CPU core (~0.05 TFLOP/s fp32) to a GB200 (~2,500 TFLOP/s dense bf16, NVIDIA datasheet);
# DDR (~10 GB/s) to HBM3e (8 TB/s); 1 Gb/s Ethernet (0.125 GB/s) to NVLink 5 (900 GB/s per direction).
_PLAUSIBLE_TFLOPS = (1e-5, 3e4)
_PLAUSIBLE_MEMORY_GBPS = (1.0, 1e5)
_PLAUSIBLE_LINK_GBPS = (1e-2, 1e4)
# the largest device memory of any accelerator (288 GB HBM3e) and the host memory of a large CPU server
# (a few TiB) stay inside; a MiB figure typed as GiB does not
_PLAUSIBLE_MEMORY_GIB = (0.25, 8192.0)
# writes into freshly allocated memory page-fault per 4 KiB page: ~1 GB/s on a loaded 2-vCPU VM (what
# `planner calibrate` measured there: 0.99 GB/s) down to a tenth of that on a slow host
_PLAUSIBLE_FRESH_WRITE_GBPS = (0.1, 1e5)
_PLAUSIBLE_LATENCY_US = (0.0, 1e5)


class _Reader:
    def __init__(self, origin: str) -> None:
        self.origin = origin

    def fail(self, path: str, message: str) -> SpecError:
        return SpecError(self.origin, path, message)

    def mapping(
        self, value: Any, path: str, required: tuple[str, ...], optional: tuple[str, ...] = ()
    ) -> dict:
        what = f"a mapping with keys {', '.join(required + optional)}"
        if not isinstance(value, dict):
            raise self.fail(path, f"expected {what}, got {_describe(value)}")
        allowed = required + optional
        for key in value:
            if key not in allowed:
                key_path = f"{path}.{key}" if path else str(key)
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise self.fail(
                    key_path, f"unknown key {key!r}; {hint}allowed keys here: {', '.join(allowed)}"
                )
        for key in required:
            if key not in value:
                key_path = f"{path}.{key}" if path else key
                raise self.fail(key_path, f"missing; expected {_EXPECT.get(key, 'a value')}")
        return value

    def number(
        self,
        value: Any,
        path: str,
        unit: str,
        example: str,
        *,
        allow_zero: bool = False,
        plausible: tuple[float, float] | None = None,
    ) -> float:
        """A number in `unit`; `plausible` (low, high) in the same unit: outside it, warn (unit slip?)."""
        bound = ">= 0" if allow_zero else "> 0"
        expected = f"a number in {unit} {bound}, e.g. {example}"
        if isinstance(value, bool):
            raise self.fail(path, f"got a boolean ({str(value).lower()}); expected {expected}")
        value = _scientific(value)
        if isinstance(value, str):
            raise self.fail(path, f"got the string {value!r}; give a number in {unit}, e.g. {example}")
        if not isinstance(value, (int, float)):
            raise self.fail(path, f"expected {expected}, got {_describe(value)}")
        number = float(value)
        if not math.isfinite(number):  # YAML's .inf / .nan
            raise self.fail(path, f"must be a finite number in {unit} {bound}, got {value}; e.g. {example}")
        if number < 0 or (number == 0 and not allow_zero):
            raise self.fail(path, f"must be {bound} {unit}, got {value}")
        if plausible is not None and number > 0 and not plausible[0] <= number <= plausible[1]:
            warnings.warn(
                SpecWarning(
                    f"{self.origin}: {path} = {value} {unit} is outside the physical range "
                    f"{plausible[0]:g} to {plausible[1]:g} {unit} of any real device or link; "
                    f"is the unit right (the field is in {unit}, e.g. {example})?"
                ),
                stacklevel=2,
            )
        return number

    def integer(self, value: Any, path: str, what: str, example: str) -> int:
        expected = f"an integer >= 1 ({what}), e.g. {example}"
        if isinstance(value, bool):
            raise self.fail(path, f"got a boolean ({str(value).lower()}); expected {expected}")
        value = _scientific(value)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise self.fail(path, f"expected {expected}, got {_describe(value)}")
        if value < 1:
            raise self.fail(path, f"must be >= 1, got {value}")
        return value

    def fraction(self, value: Any, path: str, *, allow_zero: bool = False) -> float:
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        expected = f"a fraction in {interval}, e.g. 0.8"
        if isinstance(value, bool):
            raise self.fail(path, f"got a boolean ({str(value).lower()}); expected {expected}")
        value = _scientific(value)
        if isinstance(value, str):
            raise self.fail(
                path, f"got the string {value!r}; expected {expected} (a plain number, not a percentage)"
            )
        if not isinstance(value, (int, float)):
            raise self.fail(path, f"expected {expected}, got {_describe(value)}")
        number = float(value)
        low_ok = number >= 0 if allow_zero else number > 0
        if not (low_ok and number <= 1):
            raise self.fail(path, f"must be in {interval}, got {value}")
        return number

    def string(self, value: Any, path: str, choices: tuple[str, ...] | None = None) -> str:
        expected = f"one of {', '.join(choices)}" if choices else "a string"
        if not isinstance(value, str) or not value:
            raise self.fail(path, f"expected {expected}, got {_describe(value)}")
        if choices and value not in choices:
            raise self.fail(path, f"got {value!r}; expected one of {', '.join(choices)}")
        return value


# What a missing key should hold, for the "missing" message.
_EXPECT = {
    "name": "a string naming the cluster",
    "nodes": "an integer >= 1 (number of nodes)",
    "devices_per_node": "an integer >= 1 (devices per node), or auto",
    "backend": f"one of {', '.join(BACKENDS)}",
    "overlap_efficiency": "a fraction in [0, 1] of async communication hidden behind compute",
    "overlap_slowdown": "a fraction in [0, 1]: compute seconds lost per second of communication hidden behind it",
    "device": "a mapping describing one device",
    "links": "a mapping with intra_node (and inter_node when nodes > 1)",
    "intra_node": "a mapping with kind, bandwidth_GBps, latency_us",
    "memory_GiB": "a number in GiB > 0 (memory per device), e.g. 80",
    "peak_TFLOPS": "a mapping {bf16: ..., fp16: ..., fp32: ...} in TFLOP/s (dense)",
    "memory_bandwidth_GBps": "a number in GB/s > 0, e.g. 3350",
    "matmul_efficiency": "a fraction in (0, 1] of peak reached by large matmuls",
    "memory_efficiency": "a fraction in (0, 1] of memory bandwidth reached",
    "launch_overhead_us": "a number in µs >= 0 (per kernel), e.g. 4",
    "attention_efficiency": "a fraction in (0, 1] of peak reached by the attention core",
    "matmul_half_rows": "a number of rows >= 0 (a matmul of M rows runs at M / (M + this) of its rate), e.g. 16",
    "node_overhead_us": "a number in µs >= 0 (per fx node of an eager GraphModule), e.g. 12",
    "backward_node_overhead_us": "a number in µs >= 0 (per forward node, in backward), e.g. 10",
    "conv_efficiency": "a fraction in (0, 1] of peak reached by convolutions",
    "pooling_bandwidth_GBps": "a number in GB/s > 0 (bytes read + written by pooling ops), e.g. 1",
    "probe_node_overhead_us": "a number in µs > 0 (the speed probe's per-node slope at calibration), e.g. 7",
    "host_dispatch_us": "a number in µs >= 0 (host time to issue one fx node on a GPU), e.g. 18",
    "host_dispatch_backward_us": "a number in µs >= 0 (the same per forward node, in backward), e.g. 49",
    "probe_matmul_GFLOPS": "a number in GFLOP/s > 0 (the speed probe's matmul at calibration), e.g. 60",
    "probe_backward_node_overhead_us": "a number in µs > 0 (the same, backward), e.g. 18",
    "adam_ns_per_param": "a number in ns > 0 (Adam's step per fp32 parameter, tensors <= 32 MiB), e.g. 4",
    "adam_large_tensor_ns_per_param": "a number in ns > 0 (the same, tensors > 32 MiB), e.g. 6",
    "fresh_write_bandwidth_GBps": "a number in GB/s > 0 (writes into freshly allocated memory), e.g. 3",
    "adam_tensor_overhead_us": "a number in µs >= 0 (Adam's fixed cost per parameter tensor), e.g. 20",
    "adam_cached_ns_per_param": "a number in ns > 0 (Adam's step per fp32 parameter, tensors <= 1 MiB), e.g. 2",
    "cache_MiB": "a number in MiB > 0 (last-level cache; larger matmuls stream), e.g. 32",
    "stream_bandwidth_GBps": "a number in GB/s > 0 (weight streaming of matmuls above cache_MiB), e.g. 4",
    "kind": f"one of {', '.join(LINK_KINDS)}",
    "bandwidth_GBps": "a number in GB/s > 0 (per direction; per device, or per NIC for inter_node)",
    "latency_us": "a number in µs >= 0, e.g. 3",
    "burst_latency_us": "a number in µs >= 0, e.g. 1 (optional: each further collective of a back-to-back stream)",
    "nics_per_node": "an integer >= 1 (NICs per node)",
    "nvls": "true or false (intra_node only: NVSwitch with NVLink SHARP)",
    "efficiency": "a fraction in (0, 1] of peak (device.gemm / device.attention)",
    "half_k": "a number of elements >= 0 (K at which a GEMM tile reaches half its rate), e.g. 230",
    "sms": "an integer >= 1 (SMs: thread blocks in one wave), e.g. 132",
    "tiles": "a list of [rows, columns] output tiles, e.g. [[128, 256], [256, 128]]",
    "min_split_k": "a number of elements > 0 (smallest K slice of a split-K GEMM), e.g. 256",
    "half_seq": "a number of tokens >= 0 (key length at half the attention kernel's rate), e.g. 220",
    "causal_half_seq": "a number of tokens >= 0 (the same under a causal mask), e.g. 1100",
    "backward_time_factor": "a number > 0 (attention backward time / forward time), e.g. 3.2",
    "dropout_time_factor": "a number > 0 (attention forward + backward time with dropout / without), e.g. 1.03",
    "decode_attention": "a mapping {sms: ..., block_share: ...} (a decode attention kernel of one block per sequence and head)",
    "serving_host": "a mapping {step_us: ..., per_sequence_us: ..., per_worker_us: ...} (a serving engine's host work per step)",
    "step_us": "a number in µs >= 0 (the serving engine's host work per step), e.g. 1000",
    "per_sequence_us": "a number in µs >= 0 (the same, per sequence in the step), e.g. 40",
    "per_worker_us": "a number in µs >= 0 (the same, per further rank of a model replica), e.g. 300",
    "block_share": "a number > 0 (one decode attention block's rate / the per-SM share of the memory bandwidth), e.g. 1",
    "bf16": "a number in TFLOP/s > 0",
    "fp16": "a number in TFLOP/s > 0",
    "fp32": "a number in TFLOP/s > 0",
}


# Python's fixed cost of one op or one optimizer tensor: ~1 us (a fast core, one op) to ~1 ms (a
# slow core's whole per-tensor Adam loop); a figure outside is most likely a unit slip (ms or s for us)
_PLAUSIBLE_DISPATCH_US = (0.1, 1e4)
# a serving engine's host work per step: ~10 us (a C++ runtime's loop) to ~100 ms (a Python engine on a
# slow host at a large batch); seconds typed as us are far above it
_PLAUSIBLE_HOST_US = (1.0, 1e5)
# Adam's step per parameter: ~0.01 ns on a GPU (fused, 28 B at 3 TB/s) to ~10 ns on a slow CPU core
_PLAUSIBLE_ADAM_NS = (1e-3, 1e3)
_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")  # 1e9, 1.2e1, 1e+9, .5e-3


def _scientific(value: Any) -> Any:
    """`value` as a float when it is a string in scientific notation (YAML 1.1, which PyYAML reads,
    makes 1e9 and 1.2e1 strings: only 1.0e+9 is a float there), else unchanged."""
    if isinstance(value, str) and _SCIENTIFIC.fullmatch(value.strip()):
        return float(value)
    return value


def _describe(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"the string {value!r}"
    return f"{type(value).__name__} {value!r}"


# --------------------------------------------------------------------------------------------
# Parsing


def _parse_device(r: _Reader, raw: Any) -> DeviceSpec:
    keys = (
        "name",
        "memory_GiB",
        "peak_TFLOPS",
        "memory_bandwidth_GBps",
        "matmul_efficiency",
        "memory_efficiency",
        "launch_overhead_us",
    )
    d = r.mapping(
        raw,
        "device",
        keys,
        (
            "cache_MiB",
            "stream_bandwidth_GBps",
            "attention_efficiency",
            "matmul_half_rows",
            "node_overhead_us",
            "backward_node_overhead_us",
            "conv_efficiency",
            "pooling_bandwidth_GBps",
            "probe_node_overhead_us",
            "probe_backward_node_overhead_us",
            "host_dispatch_us",
            "host_dispatch_backward_us",
            "probe_matmul_GFLOPS",
            "adam_ns_per_param",
            "adam_large_tensor_ns_per_param",
            "fresh_write_bandwidth_GBps",
            "adam_tensor_overhead_us",
            "adam_cached_ns_per_param",
            "gemm",
            "attention",
            "decode_attention",
            "serving_host",
        ),
    )
    for rate in ("adam_large_tensor_ns_per_param", "adam_cached_ns_per_param"):
        if rate in d and "adam_ns_per_param" not in d:  # adam_step_time_s reads them beside it only
            raise r.fail(
                f"device.{rate}",
                "is read only with device.adam_ns_per_param (Adam's rate in tensors up to 32 MiB); give that "
                "too, as `planner calibrate` writes them together",
            )
    if "host_dispatch_backward_us" in d and "host_dispatch_us" not in d:  # read beside it only
        raise r.fail(
            "device.host_dispatch_backward_us",
            "is read only with device.host_dispatch_us (the host's issue time per forward node); give that "
            "too, as `planner calibrate` writes them together",
        )
    conv = d.get("conv_efficiency")
    pooling = d.get("pooling_bandwidth_GBps")
    node_us = d.get("node_overhead_us")
    backward_us = d.get("backward_node_overhead_us")
    half_rows = d.get("matmul_half_rows")
    peaks = r.mapping(d["peak_TFLOPS"], "device.peak_TFLOPS", DTYPES)
    cache = d.get("cache_MiB")
    stream = d.get("stream_bandwidth_GBps")
    attention = d.get("attention_efficiency")
    return DeviceSpec(
        name=r.string(d["name"], "device.name"),
        memory_bytes=r.number(
            d["memory_GiB"], "device.memory_GiB", "GiB", "80", plausible=_PLAUSIBLE_MEMORY_GIB
        )
        * _GIB,
        peak_flops_per_s={
            dt: r.number(peaks[dt], f"device.peak_TFLOPS.{dt}", "TFLOP/s", "989", plausible=_PLAUSIBLE_TFLOPS)
            * _TFLOPS
            for dt in DTYPES
        },
        memory_bandwidth_bytes_per_s=r.number(
            d["memory_bandwidth_GBps"],
            "device.memory_bandwidth_GBps",
            "GB/s",
            "3350",
            plausible=_PLAUSIBLE_MEMORY_GBPS,
        )
        * _GB,
        matmul_efficiency=r.fraction(d["matmul_efficiency"], "device.matmul_efficiency"),
        memory_efficiency=r.fraction(d["memory_efficiency"], "device.memory_efficiency"),
        launch_overhead_s=r.number(
            d["launch_overhead_us"], "device.launch_overhead_us", "µs", "4", allow_zero=True
        )
        * _US,
        cache_bytes=None if cache is None else r.number(cache, "device.cache_MiB", "MiB", "32") * _MIB,
        stream_bandwidth_bytes_per_s=None
        if stream is None
        else r.number(stream, "device.stream_bandwidth_GBps", "GB/s", "4") * _GB,
        attention_efficiency=None
        if attention is None
        else r.fraction(attention, "device.attention_efficiency"),
        matmul_half_rows=None
        if half_rows is None
        else r.number(half_rows, "device.matmul_half_rows", "rows", "16", allow_zero=True),
        node_overhead_s=None
        if node_us is None
        else r.number(node_us, "device.node_overhead_us", "µs", "12", allow_zero=True) * _US,
        backward_node_overhead_s=None
        if backward_us is None
        else r.number(backward_us, "device.backward_node_overhead_us", "µs", "10", allow_zero=True) * _US,
        conv_efficiency=None if conv is None else r.fraction(conv, "device.conv_efficiency"),
        pooling_bandwidth_bytes_per_s=None
        if pooling is None
        else r.number(pooling, "device.pooling_bandwidth_GBps", "GB/s", "1") * _GB,
        probe_matmul_flops_per_s=None
        if (probe_mm := d.get("probe_matmul_GFLOPS")) is None
        else r.number(probe_mm, "device.probe_matmul_GFLOPS", "GFLOP/s", "60") * 1e9,
        host_dispatch_s=None
        if (host_f := d.get("host_dispatch_us")) is None
        else r.number(
            host_f, "device.host_dispatch_us", "µs", "18", allow_zero=True, plausible=_PLAUSIBLE_DISPATCH_US
        )
        * _US,
        host_dispatch_backward_s=None
        if (host_b := d.get("host_dispatch_backward_us")) is None
        else r.number(
            host_b,
            "device.host_dispatch_backward_us",
            "µs",
            "49",
            allow_zero=True,
            plausible=_PLAUSIBLE_DISPATCH_US,
        )
        * _US,
        probe_node_overhead_s=None
        if (probe_f := d.get("probe_node_overhead_us")) is None
        else r.number(probe_f, "device.probe_node_overhead_us", "µs", "7") * _US,
        probe_backward_node_overhead_s=None
        if (probe_b := d.get("probe_backward_node_overhead_us")) is None
        else r.number(probe_b, "device.probe_backward_node_overhead_us", "µs", "18") * _US,
        adam_s_per_param=None
        if (adam := d.get("adam_ns_per_param")) is None
        else r.number(adam, "device.adam_ns_per_param", "ns", "4", plausible=_PLAUSIBLE_ADAM_NS) * 1e-9,
        adam_large_tensor_s_per_param=None
        if (adam_l := d.get("adam_large_tensor_ns_per_param")) is None
        else r.number(
            adam_l, "device.adam_large_tensor_ns_per_param", "ns", "6", plausible=_PLAUSIBLE_ADAM_NS
        )
        * 1e-9,
        fresh_write_bandwidth_bytes_per_s=None
        if (fresh := d.get("fresh_write_bandwidth_GBps")) is None
        else r.number(
            fresh, "device.fresh_write_bandwidth_GBps", "GB/s", "3", plausible=_PLAUSIBLE_FRESH_WRITE_GBPS
        )
        * _GB,
        adam_tensor_overhead_s=None
        if (adam_t := d.get("adam_tensor_overhead_us")) is None
        else r.number(
            adam_t,
            "device.adam_tensor_overhead_us",
            "µs",
            "20",
            allow_zero=True,
            plausible=_PLAUSIBLE_DISPATCH_US,
        )
        * _US,
        adam_cached_s_per_param=None
        if (adam_c := d.get("adam_cached_ns_per_param")) is None
        else r.number(adam_c, "device.adam_cached_ns_per_param", "ns", "2", plausible=_PLAUSIBLE_ADAM_NS)
        * 1e-9,
        gemm=None if (gemm := d.get("gemm")) is None else _parse_gemm(r, gemm),
        attention=None if (attn := d.get("attention")) is None else _parse_attention(r, attn),
        decode_attention=None
        if (decode := d.get("decode_attention")) is None
        else _parse_decode_attention(r, decode),
        serving_host=None if (host := d.get("serving_host")) is None else _parse_serving_host(r, host),
    )


def _parse_gemm(r: _Reader, raw: Any) -> GemmSpec:
    path = "device.gemm"
    d = r.mapping(raw, path, ("efficiency", "half_k", "sms", "tiles", "min_split_k"))
    tiles = d["tiles"]
    if not isinstance(tiles, list) or not tiles:
        raise r.fail(
            f"{path}.tiles",
            f"expected a list of [rows, columns] pairs, e.g. [[128, 256]], got {_describe(tiles)}",
        )
    parsed = []
    for i, tile in enumerate(tiles):
        if (
            not isinstance(tile, list)
            or len(tile) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in tile)
        ):
            shown = (
                f"[{', '.join(repr(x) for x in tile)}]"
                if isinstance(tile, list) and len(tile) <= 4
                else _describe(tile)
            )
            raise r.fail(f"{path}.tiles[{i}]", f"expected [rows, columns], two integers > 0, got {shown}")
        parsed.append((tile[0], tile[1]))
    sms = d["sms"]
    if not isinstance(sms, int) or isinstance(sms, bool) or sms < 1:
        raise r.fail(
            f"{path}.sms", f"expected an integer >= 1 (SMs: thread blocks in one wave), got {_describe(sms)}"
        )
    return GemmSpec(
        efficiency=r.fraction(d["efficiency"], f"{path}.efficiency"),
        half_k=r.number(d["half_k"], f"{path}.half_k", "elements", "230", allow_zero=True),
        sms=sms,
        tiles=tuple(parsed),
        min_split_k=r.number(d["min_split_k"], f"{path}.min_split_k", "elements", "256"),
    )


def _parse_decode_attention(r: _Reader, raw: Any) -> DecodeAttentionSpec:
    path = "device.decode_attention"
    d = r.mapping(raw, path, ("sms", "block_share"))
    sms = d["sms"]
    if not isinstance(sms, int) or isinstance(sms, bool) or sms < 1:
        raise r.fail(
            f"{path}.sms", f"expected an integer >= 1 (SMs: thread blocks in one wave), got {_describe(sms)}"
        )
    return DecodeAttentionSpec(
        sms=sms, block_share=r.number(d["block_share"], f"{path}.block_share", "x", "1")
    )


def _parse_serving_host(r: _Reader, raw: Any) -> ServingHostSpec:
    path = "device.serving_host"
    d = r.mapping(raw, path, ("step_us",), ("per_sequence_us", "per_worker_us"))

    def us(key: str, example: str) -> float:
        if key not in d:
            return 0.0
        return (
            r.number(d[key], f"{path}.{key}", "µs", example, allow_zero=True, plausible=_PLAUSIBLE_HOST_US)
            * _US
        )

    return ServingHostSpec(
        step_s=us("step_us", "1000"),
        per_sequence_s=us("per_sequence_us", "40"),
        per_worker_s=us("per_worker_us", "300"),
    )


def _parse_attention(r: _Reader, raw: Any) -> AttentionSpec:
    path = "device.attention"
    keys = ("efficiency", "half_seq", "causal_half_seq", "backward_time_factor")
    d = r.mapping(raw, path, keys, ("dropout_time_factor",))
    return AttentionSpec(
        efficiency=r.fraction(d["efficiency"], f"{path}.efficiency"),
        half_seq=r.number(d["half_seq"], f"{path}.half_seq", "tokens", "220", allow_zero=True),
        causal_half_seq=r.number(
            d["causal_half_seq"], f"{path}.causal_half_seq", "tokens", "1100", allow_zero=True
        ),
        backward_time_factor=r.number(d["backward_time_factor"], f"{path}.backward_time_factor", "x", "3.2"),
        dropout_time_factor=r.number(
            d.get("dropout_time_factor", 1.0), f"{path}.dropout_time_factor", "x", "1.03"
        ),
    )


def _parse_link(r: _Reader, raw: Any, path: str, inter: bool) -> LinkSpec:
    required = ("kind", "bandwidth_GBps", "latency_us") + (("nics_per_node",) if inter else ())
    d = r.mapping(raw, path, required, ("burst_latency_us",) + (() if inter else ("nvls",)))
    burst = d.get("burst_latency_us")
    nvls = d.get("nvls", False)
    if not isinstance(nvls, bool):
        raise r.fail(
            f"{path}.nvls",
            f"expected true or false (NVLink SHARP in the node's NVSwitches), got {_describe(nvls)}",
        )
    if nvls and d["kind"] != "nvlink":
        raise r.fail(f"{path}.nvls", f"NVLink SHARP needs kind: nvlink, got kind: {d['kind']}")
    per = "per NIC, per direction" if inter else "per direction, per device"
    return LinkSpec(
        kind=r.string(d["kind"], f"{path}.kind", LINK_KINDS),
        bandwidth_bytes_per_s=r.number(
            d["bandwidth_GBps"],
            f"{path}.bandwidth_GBps",
            f"GB/s ({per})",
            "450",
            plausible=_PLAUSIBLE_LINK_GBPS,
        )
        * _GB,
        latency_s=r.number(
            d["latency_us"], f"{path}.latency_us", "µs", "3", allow_zero=True, plausible=_PLAUSIBLE_LATENCY_US
        )
        * _US,
        nics_per_node=r.integer(d["nics_per_node"], f"{path}.nics_per_node", "NICs per node", "8")
        if inter
        else 1,
        burst_latency_s=None
        if burst is None
        else r.number(
            burst, f"{path}.burst_latency_us", "µs", "1", allow_zero=True, plausible=_PLAUSIBLE_LATENCY_US
        )
        * _US,
        nvls=nvls,
    )


def _parse_sources(r: _Reader, raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(s, str) for s in raw):
        raise r.fail("sources", f"expected a list of strings (citations), got {_describe(raw)}")
    return tuple(raw)


# Most devices a cluster spec may describe: 2^20, ten times the largest GPU clusters built (about 10^5
# GPUs in 2025). The mesh search enumerates degrees over the devices; a typo of many more (10^11 nodes)
# kept it searching with no end in sight.
MAX_DEVICES = 2**20


def parse_cluster(data: object, origin: str) -> ClusterSpec:
    """Validate a ``yaml.safe_load`` result and convert it to a :class:`ClusterSpec` (SI units).

    ``origin`` (file path or preset name) starts every error message. ``devices_per_node: auto``
    becomes ``os.cpu_count()``. An ``inter_node`` link given for a one-node cluster is dropped
    (``ClusterSpec.inter_node`` is None exactly when there is one node).

    Raises:
        SpecError: naming the YAML path of the first bad field and what it expects.
    """
    r = _Reader(origin)
    if not isinstance(data, dict):
        raise r.fail(
            "", f"the top level must be a mapping of cluster fields (name, nodes, ...), got {_describe(data)}"
        )
    if {"splits", "stages"} <= set(data) or isinstance(data.get("plan"), dict):
        what = (
            "a plan (what planner optimize --out writes)"
            if "splits" in data
            else "a report (what --json writes)"
        )
        raise r.fail(
            "",
            f"is {what}, not a cluster spec: give --cluster a preset name or a cluster YAML (docs/cluster-yaml.md)",
        )
    top_required = ("name", "nodes", "devices_per_node", "backend", "overlap_efficiency", "device", "links")
    d = r.mapping(data, "", top_required, ("sources", "attention_kernel", "overlap_slowdown"))
    nodes = r.integer(d["nodes"], "nodes", "number of nodes", "1")
    if d["devices_per_node"] == "auto":
        if d["backend"] == "nccl":
            raise r.fail(
                "devices_per_node",
                "is auto, which counts this machine's CPU cores (for clusters of CPU processes, backend gloo); "
                "a nccl cluster gives its GPUs per node, e.g. 8",
            )
        devices_per_node = os.cpu_count() or 1
    else:
        devices_per_node = r.integer(
            d["devices_per_node"], "devices_per_node", "devices per node, or auto", "8"
        )
    if nodes * devices_per_node > MAX_DEVICES:
        raise r.fail(
            "nodes",
            f"{nodes} nodes x {devices_per_node} devices = {nodes * devices_per_node:,} devices is beyond any cluster "
            f"the planner searches (at most {MAX_DEVICES:,}; the largest training clusters hold about 10^5 GPUs): "
            "is the number right?",
        )
    links = r.mapping(d["links"], "links", ("intra_node",), ("inter_node",))
    intra = _parse_link(r, links["intra_node"], "links.intra_node", inter=False)
    inter = None
    if links.get("inter_node") is not None:
        inter = _parse_link(r, links["inter_node"], "links.inter_node", inter=True)
    if nodes > 1 and inter is None:
        raise r.fail(
            "links.inter_node",
            f"missing; nodes is {nodes}, so give the inter-node link: "
            "{kind, bandwidth_GBps (per NIC, per direction), latency_us, nics_per_node}",
        )
    return ClusterSpec(
        name=r.string(d["name"], "name"),
        num_nodes=nodes,
        devices_per_node=devices_per_node,
        devices_auto=d["devices_per_node"] == "auto",
        device=_parse_device(r, d["device"]),
        intra_node=intra,
        inter_node=inter if nodes > 1 else None,
        backend=r.string(d["backend"], "backend", BACKENDS),
        overlap_efficiency=r.fraction(d["overlap_efficiency"], "overlap_efficiency", allow_zero=True),
        overlap_slowdown=r.fraction(d.get("overlap_slowdown", 0.0), "overlap_slowdown", allow_zero=True),
        sources=_parse_sources(r, d.get("sources")),
        attention_kernel=r.string(d.get("attention_kernel", "fused"), "attention_kernel", ATTENTION_KERNELS),
    )


# --------------------------------------------------------------------------------------------
# Loading


def preset_names() -> list[str]:
    """Names of the cluster presets shipped in ``costmodels/clusters/*.yaml``, sorted."""
    folder = resources.files("costmodels.clusters")
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


# libyaml's C parser and emitter when PyYAML was built with it (the wheels are): a plan of an 8B model
# (130 kB of YAML) loads in 0.06 s instead of 0.43 s and dumps in 0.06 s instead of 0.23 s on this VM.
_SafeLoaderBase = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
SafeDumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _UniqueKeys:
    """Mixin of a PyYAML loader that refuses a mapping with the same key twice."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            # `<<: *base` merges the anchor's keys; the mapping's own keys win over them, as YAML says
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)  # type: ignore[attr-defined]
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice (lines {seen[key]} and {line}); keep one",
                    key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)  # type: ignore[misc]


class UniqueKeyLoader(_UniqueKeys, _SafeLoaderBase):  # type: ignore[misc,valid-type]
    """`yaml.SafeLoader` (libyaml's `yaml.CSafeLoader` where PyYAML has it: the same documents, parsed
    in C) that refuses a mapping with the same key twice (plain YAML keeps the last one silently: a
    spec with ``launch_overhead_us`` given twice planned with the second)."""


def safe_load_unique(text: str) -> object:
    """``yaml.load`` with `UniqueKeyLoader` (safe: no Python objects). Raises yaml.YAMLError."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def safe_dump(data: object, **options: object) -> str:
    """``yaml.safe_dump(data, **options)`` through libyaml's emitter where PyYAML has it (`SafeDumper`):
    plain data only, the same document."""
    return yaml.dump(data, Dumper=SafeDumper, **options)  # type: ignore[call-overload]


def _read_yaml(text: str, origin: str) -> object:
    try:
        return safe_load_unique(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise SpecError(origin, "", f"YAML syntax error{where}: {problem}") from e


def load_cluster(name_or_path: str, nproc: int | None = None) -> ClusterSpec:
    """Load a cluster from a preset name (see :func:`preset_names`) or a YAML file path.

    ``nproc`` sets how many devices (ranks) are used: on a one-node cluster it becomes
    ``devices_per_node`` (up to the node's size; any number for ``devices_per_node: auto`` or the
    gloo backend, whose devices are CPU processes); on a multi-node cluster it must be a multiple of
    ``devices_per_node`` no larger than the cluster, and sets the number of nodes.

    Raises:
        SpecError: unknown preset (lists the presets), file not found, YAML syntax error (with
            line), malformed spec (names the field), or an ``nproc`` the cluster cannot provide.
    """
    presets = preset_names()
    looks_like_path = name_or_path.endswith((".yaml", ".yml")) or os.sep in name_or_path
    try:  # a name the system cannot take (ENAMETOOLONG) is refused, not raised from pathlib
        is_path = looks_like_path or (name_or_path not in presets and Path(name_or_path).exists())
        is_dir, is_file = (
            (Path(name_or_path).is_dir(), Path(name_or_path).is_file()) if is_path else (False, False)
        )
    except OSError as e:
        raise SpecError(name_or_path, "", f"cannot be read: {e.strerror or e}") from None
    if is_path:
        path = Path(name_or_path)
        if is_dir:
            raise SpecError(str(path), "", "is a folder; give a cluster spec YAML file (or a preset name)")
        if not is_file:
            raise SpecError(str(path), "", f"file not found (presets are: {', '.join(presets)})")
        try:
            origin, text = str(path), path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise SpecError(
                str(path), "", "is not a text file (not UTF-8); a cluster spec is YAML text"
            ) from None
        except OSError as e:
            raise SpecError(str(path), "", f"cannot be read: {e.strerror or e}") from None
    elif name_or_path in presets:
        origin = f"preset {name_or_path}"
        text = (
            resources.files("costmodels.clusters")
            .joinpath(f"{name_or_path}.yaml")
            .read_text(encoding="utf-8")
        )
    else:
        raise SpecError(
            repr(name_or_path),
            "",
            f"unknown cluster preset; presets are: {', '.join(presets)} (or give a YAML path)",
        )
    data = _read_yaml(text, origin)
    spec = parse_cluster(data, origin)
    if nproc is None:
        return spec
    resized = _with_nproc(spec, nproc, origin, flexible=spec.devices_auto or spec.backend == "gloo")
    if resized.num_devices != spec.num_devices and not spec.devices_auto:
        resized = replace(resized, resized_from=spec.num_devices)
    return resized


def resize_cluster(spec: ClusterSpec, nproc: int) -> ClusterSpec:
    """`spec` re-sized to `nproc` ranks as `load_cluster(..., nproc=nproc)` sizes a loaded spec (a gloo
    node's CPU processes time-share its cores beyond one per core). Raises SpecError for an `nproc`
    the cluster cannot provide."""
    return _with_nproc(spec, nproc, spec.name, flexible=spec.backend == "gloo")


def time_shared(spec: ClusterSpec, ranks: int) -> bool:
    """Whether `ranks` CPU processes on `spec` share cores: one gloo node, more ranks than this
    machine's cores (`_cpu_processes` slows each by cores / ranks)."""
    return spec.backend == "gloo" and spec.num_nodes == 1 and ranks > (os.cpu_count() or 1)


def cluster_for_ranks(spec: ClusterSpec, ranks: int) -> ClusterSpec:
    """The spec a plan on `ranks` ranks is priced with: `spec`, unless it is one gloo node of more CPU
    processes than cores (time-shared, `_cpu_processes`) and the plan runs fewer, which share the
    cores less: then `spec` re-sized to max(ranks, cores) processes. `planner optimize --nproc 3` on 2
    cores priced a one-rank plan as one of 3 processes sharing 2 cores (3.2 ms predicted, 2.0 ms
    measured); the ranks that do not run take no share."""
    if not time_shared(spec, spec.devices_per_node) or ranks >= spec.devices_per_node:
        return spec
    return _cpu_processes(spec, max(ranks, os.cpu_count() or 1))


def _with_nproc(spec: ClusterSpec, nproc: int, origin: str, flexible: bool) -> ClusterSpec:
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise SpecError(origin, "nproc", f"expected an integer >= 1 (number of ranks), got {nproc!r}")
    dpn = spec.devices_per_node
    if spec.num_nodes == 1 and spec.backend == "gloo" and nproc != dpn:
        return _cpu_processes(spec, nproc)
    if spec.num_nodes == 1 and (flexible or nproc <= dpn):
        return replace(spec, devices_per_node=nproc)
    if nproc <= dpn:
        return replace(spec, num_nodes=1, devices_per_node=nproc, inter_node=None)
    if nproc % dpn or nproc // dpn > spec.num_nodes:
        raise SpecError(
            origin,
            "nproc",
            f"nproc={nproc} does not fit: the cluster has {spec.num_nodes} node(s) x {dpn} devices; "
            f"give at most {dpn} or a multiple of {dpn} up to {spec.num_devices}",
        )
    return replace(spec, num_nodes=nproc // dpn)


def _cpu_processes(spec: ClusterSpec, nproc: int) -> ClusterSpec:
    """A one-node gloo spec re-sized to `nproc` CPU processes. Each rank runs cores // nproc threads
    (runtime.launch), so a device's compute peaks scale with the threads per process it gets, and its
    share of host memory with 1 / nproc (linear thread scaling of GEMMs: measured 1.9x from 1 to 2
    threads on this 2-core VM). More processes than cores time-share them: each gets cores / nproc of
    one core, which slows its compute and its per-node (Python dispatch) overhead alike, and the
    loopback link too: gloo moves a message with CPU threads (copies, and a scheduler slot for its
    I/O thread), so its latency stretches and its bandwidth shrinks by the same factor. Measured on
    the README's TP=2 x PP=2 example (4 ranks, 2 cores, 2026-12-01): 9.3-11.2 ms per forward against
    4.3 ms priced as one core per rank, 6.9 ms with compute and dispatch time-shared, 8.3 ms with
    the link too."""
    cores = os.cpu_count() or 1

    def share(n: int) -> float:  # cores' worth of compute one of n processes gets
        return cores // n if n <= cores else cores / n

    scale = share(nproc) / share(spec.devices_per_node)
    threads = max(1, cores // nproc) / max(1, cores // spec.devices_per_node)
    device = replace(
        spec.device,
        peak_flops_per_s={k: v * scale for k, v in spec.device.peak_flops_per_s.items()},
        # the speed probe times in thread CPU time with one thread (`costmodels.calibrate.clock`), which
        # time-sharing does not slow: its references follow the threads per process only
        probe_matmul_flops_per_s=None
        if spec.device.probe_matmul_flops_per_s is None
        else spec.device.probe_matmul_flops_per_s * threads,
        memory_bytes=spec.device.memory_bytes * spec.devices_per_node / nproc,
    )
    # < 1 when more oversubscribed than the spec was (> 1: less, from a spec written time-shared)
    slowdown = min(1.0, share(nproc)) / min(1.0, share(spec.devices_per_node))
    if slowdown != 1.0:  # every per-op and per-node time (those the spec has) stretches alike
        stretched = ("launch_overhead_s", "node_overhead_s", "backward_node_overhead_s")
        stretched += ("host_dispatch_s", "host_dispatch_backward_s")
        stretched += ("adam_s_per_param", "adam_large_tensor_s_per_param", "adam_tensor_overhead_s")
        stretched += ("adam_cached_s_per_param",)
        device = replace(
            device,
            **{f: getattr(device, f) / slowdown for f in stretched if getattr(device, f) is not None},
        )
        if spec.intra_node.kind == "loopback":
            link = spec.intra_node
            spec = replace(
                spec,
                intra_node=replace(
                    link,
                    latency_s=link.latency_s / slowdown,
                    bandwidth_bytes_per_s=link.bandwidth_bytes_per_s * slowdown,
                    burst_latency_s=None if link.burst_latency_s is None else link.burst_latency_s / slowdown,
                ),
            )
    return replace(spec, devices_per_node=nproc, device=device)


def _human(value: float) -> float | int:
    rounded = float(f"{value:.{_ROUND_DIGITS}g}")
    return int(rounded) if rounded.is_integer() else rounded


def _link_to_dict(link: LinkSpec, inter: bool) -> dict:
    out: dict[str, Any] = {
        "kind": link.kind,
        "bandwidth_GBps": _human(link.bandwidth_bytes_per_s / _GB),
        "latency_us": _human(link.latency_s / _US),
    }
    if inter:
        out["nics_per_node"] = link.nics_per_node
    if link.burst_latency_s is not None:
        out["burst_latency_us"] = _human(link.burst_latency_s / _US)
    if link.nvls:
        out["nvls"] = True
    return out


def cluster_to_dict(spec: ClusterSpec) -> dict:
    """The YAML form (human units) of a spec; ``parse_cluster(cluster_to_dict(s), o) == s``."""
    dev = spec.device
    links = {"intra_node": _link_to_dict(spec.intra_node, inter=False)}
    if spec.inter_node is not None:
        links["inter_node"] = _link_to_dict(spec.inter_node, inter=True)
    return {
        "name": spec.name,
        "nodes": spec.num_nodes,
        "devices_per_node": spec.devices_per_node,
        "backend": spec.backend,
        "overlap_efficiency": _human(spec.overlap_efficiency),
        **({} if not spec.overlap_slowdown else {"overlap_slowdown": _human(spec.overlap_slowdown)}),
        "sources": list(spec.sources),
        **({} if spec.attention_kernel == "fused" else {"attention_kernel": spec.attention_kernel}),
        "device": {
            "name": dev.name,
            "memory_GiB": _human(dev.memory_bytes / _GIB),
            "peak_TFLOPS": {dt: _human(dev.peak_flops_per_s[dt] / _TFLOPS) for dt in DTYPES},
            "memory_bandwidth_GBps": _human(dev.memory_bandwidth_bytes_per_s / _GB),
            "matmul_efficiency": _human(dev.matmul_efficiency),
            "memory_efficiency": _human(dev.memory_efficiency),
            "launch_overhead_us": _human(dev.launch_overhead_s / _US),
            **({} if dev.cache_bytes is None else {"cache_MiB": _human(dev.cache_bytes / _MIB)}),
            **(
                {}
                if dev.stream_bandwidth_bytes_per_s is None
                else {"stream_bandwidth_GBps": _human(dev.stream_bandwidth_bytes_per_s / _GB)}
            ),
            **(
                {}
                if dev.attention_efficiency is None
                else {"attention_efficiency": _human(dev.attention_efficiency)}
            ),
            **({} if dev.matmul_half_rows is None else {"matmul_half_rows": _human(dev.matmul_half_rows)}),
            **(
                {} if dev.node_overhead_s is None else {"node_overhead_us": _human(dev.node_overhead_s / _US)}
            ),
            **(
                {}
                if dev.backward_node_overhead_s is None
                else {"backward_node_overhead_us": _human(dev.backward_node_overhead_s / _US)}
            ),
            **({} if dev.conv_efficiency is None else {"conv_efficiency": _human(dev.conv_efficiency)}),
            **(
                {}
                if dev.pooling_bandwidth_bytes_per_s is None
                else {"pooling_bandwidth_GBps": _human(dev.pooling_bandwidth_bytes_per_s / _GB)}
            ),
            **(
                {}
                if dev.probe_matmul_flops_per_s is None
                else {"probe_matmul_GFLOPS": _human(dev.probe_matmul_flops_per_s / 1e9)}
            ),
            **(
                {}
                if dev.probe_node_overhead_s is None
                else {"probe_node_overhead_us": _human(dev.probe_node_overhead_s / _US)}
            ),
            **(
                {} if dev.host_dispatch_s is None else {"host_dispatch_us": _human(dev.host_dispatch_s / _US)}
            ),
            **(
                {}
                if dev.host_dispatch_backward_s is None
                else {"host_dispatch_backward_us": _human(dev.host_dispatch_backward_s / _US)}
            ),
            **(
                {}
                if dev.probe_backward_node_overhead_s is None
                else {"probe_backward_node_overhead_us": _human(dev.probe_backward_node_overhead_s / _US)}
            ),
            **(
                {}
                if dev.adam_s_per_param is None
                else {"adam_ns_per_param": _human(dev.adam_s_per_param * 1e9)}
            ),
            **(
                {}
                if dev.adam_large_tensor_s_per_param is None
                else {"adam_large_tensor_ns_per_param": _human(dev.adam_large_tensor_s_per_param * 1e9)}
            ),
            **(
                {}
                if dev.fresh_write_bandwidth_bytes_per_s is None
                else {"fresh_write_bandwidth_GBps": _human(dev.fresh_write_bandwidth_bytes_per_s / _GB)}
            ),
            **(
                {}
                if dev.adam_tensor_overhead_s is None
                else {"adam_tensor_overhead_us": _human(dev.adam_tensor_overhead_s / _US)}
            ),
            **(
                {}
                if dev.adam_cached_s_per_param is None
                else {"adam_cached_ns_per_param": _human(dev.adam_cached_s_per_param * 1e9)}
            ),
            **({} if dev.gemm is None else {"gemm": _gemm_to_dict(dev.gemm)}),
            **({} if dev.attention is None else {"attention": _attention_to_dict(dev.attention)}),
            **(
                {}
                if dev.decode_attention is None
                else {
                    "decode_attention": {
                        "sms": dev.decode_attention.sms,
                        "block_share": _human(dev.decode_attention.block_share),
                    }
                }
            ),
            **({} if dev.serving_host is None else {"serving_host": _serving_host_to_dict(dev.serving_host)}),
        },
        "links": links,
    }


def _serving_host_to_dict(h: ServingHostSpec) -> dict:
    return {
        "step_us": _human(h.step_s / _US),
        "per_sequence_us": _human(h.per_sequence_s / _US),
        "per_worker_us": _human(h.per_worker_s / _US),
    }


def _gemm_to_dict(g: GemmSpec) -> dict:
    return {
        "efficiency": _human(g.efficiency),
        "half_k": _human(g.half_k),
        "sms": g.sms,
        "tiles": [list(t) for t in g.tiles],
        "min_split_k": _human(g.min_split_k),
    }


def _attention_to_dict(a: AttentionSpec) -> dict:
    return {
        "efficiency": _human(a.efficiency),
        "half_seq": _human(a.half_seq),
        "causal_half_seq": _human(a.causal_half_seq),
        "backward_time_factor": _human(a.backward_time_factor),
        **({"dropout_time_factor": _human(a.dropout_time_factor)} if a.dropout_time_factor != 1.0 else {}),
    }

"""The machine a model is priced on: a cluster spec refined by timing the model's own shapes here.

A spec `planner calibrate` measured on this machine (`probes_speed`) prices with a few figures (peaks,
per-node overhead, link alpha-beta); a CPU's rate depends on each matmul's shape, convolution and
activation, so planning times the model's own (`with_model_rates`) and, for a served request, the host
work and per-node time of its decode step (`with_decode_host_time`, `with_decode_graph_time`), once per
shape in a process. `priced_machine` is the one entry the command line calls. After a run,
`at_run_speed` re-prices the plan at the speed the run's probe measured, and `probe_roofline` prices
calibration's probe graph. Specs of other machines (presets, YAML files) are returned unchanged.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Protocol

import torch

from costmodels import calibrate
from costmodels.cluster import CALIBRATED_SOURCE, CALIBRATED_SPEC_NAME, ClusterSpec, cluster_for_ranks
from costmodels.compute import SIZED_PROBE, per_node_overhead_s, training_gemm_shapes
from costmodels.dtypes import dtype_bytes
from planner.errors import InputError
from planner.frontend.analysis import ModelStructure, analyse, conv_call_at_batch
from planner.frontend.capture import capture, flat_inputs
from planner.frontend.modelfile import ModelFile
from planner.frontend.phases import build_for, cast_inputs, decode_phase, phase_inputs
from planner.plan import Plan, Workload
from planner.progress import Progress, silent
from planner.solver.costing import (
    graph_node_count,
    graph_roofline_s,
    model_attention_calls,
    model_matmul_shapes,
)
from planner.solver.problem import WorkloadSpec, plan_workload_options
from planner.solver.serving import predict_with_plan

# (model file, batch, prompt tokens, new tokens, vocabulary) -> seconds of host work per decode step
HostStepTimer = Callable[[ModelFile, int, int, int, int], float]


class RequestShape(Protocol):
    """What pricing reads of a served request (`planner.cli.workflow.ServingRequest`)."""

    prompt_len: int
    new_tokens: int

    @property
    def cache_len(self) -> int: ...


class PricedModel(Protocol):
    """What pricing reads of a captured model (`planner.cli.workflow.Prepared`)."""

    model_file: ModelFile
    structure: ModelStructure
    workload: WorkloadSpec
    param_shapes: Mapping[str, tuple[int, ...]]
    request: RequestShape | None
    prefill: ModelStructure | None


def probe_roofline(blocks: int, cluster: ClusterSpec) -> tuple[float, int]:
    """(roofline seconds, charged nodes) the cost model prices for `planner calibrate`'s probe graph
    at a small model's scale (`costmodels.compute.SIZED_PROBE`) with `blocks` blocks, on `cluster`
    (`planner.solver.costing.graph_roofline_s`, `graph_node_count`); captured on meta. `calibrate`
    subtracts it from the probe's measured time to price the per-node overhead."""

    dim, heads, tokens = SIZED_PROBE
    with torch.device("meta"):
        model = calibrate.probe_model(blocks, dim, heads)
    structure = analyse(capture(model, (torch.empty(1, tokens, dim, device="meta"),), {}))
    return graph_roofline_s(structure, cluster), graph_node_count(list(structure.node_costs), structure)


def priced_workload(plan: Plan) -> WorkloadSpec:
    """The workload `plan.predicted` prices: a serving plan's decode step (one token per sequence after
    its prompt, as `price_request`), else the plan's workload, batch, sequence and micro-batches."""
    if plan.serving is not None:
        return WorkloadSpec(
            Workload.DECODE,
            plan.batch_size,
            1,
            context=plan.serving.prompt_len,
            dtype=plan.dtype,
            **plan_workload_options(plan),
        )
    return WorkloadSpec(
        plan.workload,
        plan.batch_size,
        plan.seq_len,
        micro_batches=plan.micro_batches,
        dtype=plan.dtype,
        **plan_workload_options(plan),
    )


# this process's timings (matmul ratios, convolution ratios), by spec and shapes
_SHAPE_RATIOS: dict[tuple, tuple[dict[tuple[int, int], float], dict[tuple, float]]] = {}


def priced_machine(
    prepared: PricedModel,
    cluster: ClusterSpec,
    progress: Progress = silent,
    host_step_time: HostStepTimer | None = None,
) -> ClusterSpec:
    """The machine a model is priced on: `cluster` as given, or, when it is this machine's calibrated
    gloo spec (`probes_speed`), with the model's own matmul, convolution and activation shapes timed
    here (`with_model_rates`) and, for a serving request, the host work of a decode step
    (`with_decode_host_time`, timed by `host_step_time`: the serving loop's own step, which the
    runtime provides) and the per-node time of its decode graph (`with_decode_graph_time`). The one
    function the command line calls to turn (calibrated spec, captured model) into prices."""
    timed = with_model_rates(prepared, cluster, progress)
    if host_step_time is not None:
        timed = with_decode_host_time(prepared, timed, host_step_time)
    return with_decode_graph_time(prepared, timed, progress)


def calibration_gemm_shapes(prepared: PricedModel, devices: int) -> tuple[tuple[int, int, int], ...]:
    """(M, N, K) of the model's own GEMMs that `planner calibrate --model` times on CUDA
    (`costmodels.gpu_calibrate.cuda_measurements`) beside its standard sweep: its projections and LM
    head at the workload's tokens, replicated and split for each TP degree dividing ``devices``
    (`costing.model_matmul_shapes`), with a linear's input- and weight-gradient GEMMs when training
    (`costmodels.compute.training_gemm_shapes`)."""
    workload = prepared.workload
    tokens = workload.batch_size * workload.tokens_per_sequence
    tps = [tp for tp in range(1, devices + 1) if devices % tp == 0]
    out: dict[tuple[int, int, int], None] = {}
    for m, k, n in model_matmul_shapes(prepared.structure, tokens, tps):
        products = training_gemm_shapes(m, k, n) if workload.kind is Workload.TRAIN else ((m, k, n),)
        for rows, kk, nn in products:
            out[(int(rows), int(nn), int(kk))] = None
    return tuple(out)


def times_here(cluster: ClusterSpec) -> bool:
    """Whether `cluster` is this machine's calibrated gloo spec, whose figures the planner refines by
    timing the model's own shapes and graphs here (`with_model_matmul_rates`)."""
    return probes_speed(cluster) and cluster.backend == "gloo"


_DECODE_HOST_S: dict[tuple, float] = {}  # (model path, batch, prompt, new tokens, vocab, threads) -> s


def with_decode_host_time(
    prepared: PricedModel, cluster: ClusterSpec, host_step_time: HostStepTimer
) -> ClusterSpec:
    """`cluster` with `DeviceSpec.decode_host_s` timed on this machine by `host_step_time`
    (`runtime.decode.host_step_time_s`, given by the caller: the model file's step inputs and the last
    logits, around the graph in each timed decode step),
    when `prepared` is a serving request and `cluster` this machine's calibrated gloo spec; else
    `cluster` unchanged. Timed once per request shape in a process (about 0.2 s)."""
    request, structure = prepared.request, prepared.structure
    if request is None or cluster.device.decode_host_s is not None:
        return cluster
    if not times_here(cluster) or structure.lm_head is None:
        return cluster
    batch, vocab = prepared.workload.batch_size, structure.lm_head.out_features
    threads = calibrate.spec_threads(cluster)
    key = (str(prepared.model_file.path), batch, request.prompt_len, request.new_tokens, vocab, threads)
    if key not in _DECODE_HOST_S:
        with calibrate.intra_op_threads(threads):
            _DECODE_HOST_S[key] = host_step_time(
                prepared.model_file, batch, request.prompt_len, request.new_tokens, vocab
            )
    return replace(cluster, device=replace(cluster.device, decode_host_s=_DECODE_HOST_S[key]))


# (model path, batch, prompt, new tokens, threads, spec name, spec sources, dtype) -> ratio (None: not timed)
_DECODE_NODE_RATIOS: dict[tuple, float | None] = {}


# the most parameter and cache bytes a model may hold for its decode graph to be timed when planning
# (built with real weights on this machine): the examples' tiny models hold a few MB; a model that
# runs here at all is far below this
DECODE_GRAPH_TIMING_MAX_BYTES = 1 << 30


def with_decode_graph_time(
    prepared: PricedModel, cluster: ClusterSpec, progress: Progress = silent
) -> ClusterSpec:
    """`cluster` with `DeviceSpec.decode_node_time_ratio`: the model's own decode graph built with real
    weights in the plan's dtype, captured and timed on this machine against its price
    (`costmodels.calibrate.graph_node_time_ratio`: its time net of the priced roofline per node, over
    the per-node overhead priced for it), when `prepared` is a serving request, `cluster` this
    machine's calibrated gloo spec with the toy probe's reading, and the model's parameters and
    caches fit in `DECODE_GRAPH_TIMING_MAX_BYTES`; else `cluster` unchanged (the probe's per-node
    figure prices the step). About 2 s (capture and 1 s of timing), once per request shape in a
    process. A model whose decode graph fails to build or run here keeps the probe's figure."""

    request, structure, dev = prepared.request, prepared.structure, cluster.device
    if request is None or dev.decode_node_time_ratio is not None or not dev.probe_node_overhead_s:
        return cluster
    if not times_here(cluster):
        return cluster
    held = sum(math.prod(shape) for shape in prepared.param_shapes.values()) * dtype_bytes(structure.dtype)
    held += sum(layer.attention.cache_bytes for layer in structure.layers if layer.attention is not None)
    if held > DECODE_GRAPH_TIMING_MAX_BYTES:
        return cluster
    batch = prepared.workload.batch_size
    dtype = prepared.workload.dtype or structure.dtype
    threads = calibrate.spec_threads(cluster)
    key = (
        str(prepared.model_file.path), batch, request.prompt_len, request.new_tokens, threads,
        cluster.name, cluster.sources, dtype,
    )  # fmt: skip
    if key not in _DECODE_NODE_RATIOS:
        progress("timing the model's decode graph on this machine", None)
        # the graph is timed in one process with its own core: priced against the spec's figures for a
        # process that does not time-share (a spec re-sized to more ranks than cores stretches its
        # per-node overhead and slows its peaks, which the ratio would otherwise undo)
        alone = cluster_for_ranks(cluster, 1)
        phase = decode_phase(batch, request.prompt_len, request.cache_len)
        try:
            # in the plan's dtype, as the run computes it (a bf16 decode step ran 1.5x an fp32 one on
            # the dev VM: its small-row matmuls and cache attention slower, where bytes price it 2x faster)
            model = build_for(prepared.model_file, phase, "cpu", dtype)
            args, kwargs = cast_inputs(*phase_inputs(prepared.model_file, phase, device="cpu"), dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                gm = capture(model, args, kwargs)
            inputs = flat_inputs(args, kwargs)
            timed = analyse(gm)
            elements = batch * structure.hidden_size if structure.hidden_size else None
            _DECODE_NODE_RATIOS[key] = calibrate.graph_node_time_ratio(
                lambda: gm(*inputs),
                graph_node_count(list(timed.node_costs), timed),
                graph_roofline_s(timed, alone),
                per_node_overhead_s(alone.device, elements) or 0.0,
                dev.probe_node_overhead_s,
                threads=threads,
            )
        except (InputError, IndexError, RuntimeError, TypeError, ValueError):  # the probe's figure prices it
            _DECODE_NODE_RATIOS[key] = None
    ratio = _DECODE_NODE_RATIOS[key]
    if ratio is None:
        return cluster
    return replace(cluster, device=replace(dev, decode_node_time_ratio=ratio))


def with_model_rates(prepared: PricedModel, cluster: ClusterSpec, progress: Progress = silent) -> ClusterSpec:
    """`cluster` with the model's own matmul shapes, convolutions, activations and attention cores
    timed on this machine (`DeviceSpec.matmul_shape_time_ratios`, `DeviceSpec.conv_time_ratios`,
    `DeviceSpec.activation_time_ratios`, `DeviceSpec.attention_time_ratios`: the cores at a rank's
    share of the batch, `costing.model_attention_calls`; in a 16-bit dtype, its plain memory-bound ops
    against fp32's, `DeviceSpec.memory_dtype_time_ratios`), when `cluster` is this machine's calibrated spec (a
    `probes_speed` spec, gloo); else `cluster` unchanged. Training times
    each linear's backward products too. Every TP degree
    that divides the spec's device count is timed (`costing.model_matmul_shapes`), at the workload's
    tokens per rank (the fit's row term carries other micro-batch sizes), with the threads a rank
    computes with (`costmodels.calibrate.spec_threads`); about a second, once per model, spec and
    workload in a process. A spec that holds ratios already is returned as it is."""

    dev = cluster.device
    if any(
        r is not None
        for r in (
            dev.matmul_shape_time_ratios,
            dev.conv_time_ratios,
            dev.activation_time_ratios,
            dev.attention_time_ratios,
            dev.memory_dtype_time_ratios,
        )
    ):  # timed already
        return cluster
    if not times_here(cluster):
        return cluster
    structure, workload = prepared.structure, prepared.workload
    tokens = workload.batch_size * workload.tokens_per_sequence
    tps = [tp for tp in range(1, cluster.num_devices + 1) if cluster.num_devices % tp == 0]
    shapes = model_matmul_shapes(structure, tokens, tps)
    prefill = prepared.prefill
    if prefill is not None and prepared.request is not None:
        shapes += model_matmul_shapes(prefill, workload.batch_size * prepared.request.prompt_len, tps)
    convs = model_conv_calls(structure, cluster.num_devices)
    activations = model_activation_calls(structure, prefill)
    attentions = model_attention_calls(structure, workload, tps, tps)
    dtype = workload.dtype or structure.dtype
    memory_ops, memory_elements = model_memory_ops(structure) if dtype_bytes(dtype) < 4 else ({}, 0)
    if not shapes and not convs and not activations and not attentions and not memory_ops:
        return cluster
    threads = calibrate.spec_threads(cluster)
    train = workload.kind is Workload.TRAIN
    key = (
        cluster.name,
        cluster.sources,
        dtype,
        threads,
        train,
        tuple(shapes),
        tuple(c[0] for c in convs),
        tuple(activations),
        tuple(attentions),
        tuple(memory_ops.items()),
        memory_elements,
    )
    sequences = max(1, workload.batch_size // cluster.num_devices)
    # a memory-bound op's elements on a rank holding its share of the batch (a DP rank's; TP ranks
    # hold as many along the stream)
    rank_elements = memory_elements * sequences // max(1, structure.batch_size)
    if key not in _SHAPE_RATIOS:
        progress(
            f"timing the model's {len(shapes) + len(convs) + len(activations) + len(attentions)} matmul, "
            "convolution, activation and attention shapes on this machine"
            + (f" (and its memory-bound ops in {dtype})" if memory_ops else ""),
            None,
        )
        _SHAPE_RATIOS[key] = (
            calibrate.matmul_shape_time_ratios(shapes, dev, dtype, threads=threads, train=train)
            if shapes
            else {},
            calibrate.conv_time_ratios(convs, dev, dtype, threads=threads, train=train) if convs else {},
            calibrate.activation_time_ratios(activations, dev, dtype, threads=threads, train=train)
            if activations
            else {},
            calibrate.attention_time_ratios(attentions, sequences, dev, dtype, threads=threads, train=train)
            if attentions
            else {},
            calibrate.memory_dtype_time_ratio(memory_ops, rank_elements, dtype, threads=threads)
            if memory_ops
            else None,
        )
    matmuls, conv_ratios, activation_ratios, attention_ratios, memory_ratio = _SHAPE_RATIOS[key]
    return replace(
        cluster,
        device=replace(
            dev,
            matmul_shape_time_ratios=matmuls,
            conv_time_ratios=conv_ratios,
            activation_time_ratios=activation_ratios,
            attention_time_ratios=attention_ratios,
            memory_dtype_time_ratios={dtype: memory_ratio} if memory_ratio is not None else {},
        ),
    )


def model_activation_calls(
    structure: ModelStructure, prefill: ModelStructure | None = None
) -> list[tuple[tuple, int]]:
    """(call, elements of its largest node) of each distinct activation of ``structure`` (and of a
    serving plan's ``prefill`` graph): what `costmodels.calibrate.activation_time_ratios` times
    (`planner.frontend.analysis.activation_call`)."""
    largest: dict[tuple, int] = {}
    for s in (structure, prefill):
        for c in s.node_costs.values() if s is not None else ():
            if c.call is not None and c.kind == "memory":
                largest[c.call] = max(largest.get(c.call, 0), math.prod(c.shape))
    return sorted(largest.items(), key=repr)


def model_memory_ops(structure: ModelStructure) -> tuple[dict[str, float], int]:
    """Bytes read + written per forward by ``structure``'s plain memory-bound nodes (not its
    activations, timed on their own), by ATen op name: the mix `costmodels.calibrate.
    memory_dtype_time_ratio` times in a 16-bit dtype; and the median output elements of those nodes
    at the captured batch (0 without any)."""
    ops: dict[str, float] = {}
    sizes: list[int] = []
    for c in structure.node_costs.values():
        moved = c.bytes_read + c.bytes_written
        if c.kind == "memory" and c.call is None and moved > 0 and c.op:
            ops[c.op] = ops.get(c.op, 0.0) + moved
            sizes.append(math.prod(c.shape))
    return dict(sorted(ops.items())), int(statistics.median(sizes)) if sizes else 0


def model_conv_calls(structure: ModelStructure, devices: int) -> list[tuple[tuple, float, float]]:
    """(call, FLOP, bytes moved) of each distinct convolution of ``structure`` at the captured batch and
    at each DP share of it over up to ``devices`` ranks (a share runs other kernels' blockings): what
    `costmodels.calibrate.conv_time_ratios` times (`planner.frontend.analysis.conv_call_at_batch`)."""
    batch = structure.batch_size
    shares = sorted({batch // dp for dp in range(1, devices + 1) if devices % dp == 0 and batch % dp == 0})
    out: dict[tuple, tuple[tuple, float, float]] = {}
    for c in structure.node_costs.values():
        if c.call is None or c.kind != "conv":
            continue
        for b in shares:
            call = conv_call_at_batch(c.call, b)
            out[call] = (call, c.flops * b / batch, (c.bytes_read + c.bytes_written) * b / batch)
    return list(out.values())


def probes_speed(cluster: ClusterSpec) -> bool:
    """Whether a run priced with `cluster` times the speed probe: a spec `planner calibrate` measured
    (named so, or whatever its name, with its first source line; its per-node overhead is the probe's
    reading at calibration)."""
    measured = cluster.name == CALIBRATED_SPEC_NAME or any(
        s.startswith(CALIBRATED_SOURCE) for s in cluster.sources
    )
    return measured and cluster.device.node_overhead_s is not None


def at_run_speed(
    plan: Plan, structure: ModelStructure | None, cluster: ClusterSpec, run: dict[str, Any]
) -> dict[str, Any] | None:
    """The plan re-priced at the machine's speed the speed probe measured beside the timed steps
    (`RunJob.speed_probe`): the per-node overheads scaled by the probe's per-node slope now over its
    reading at calibration (`DeviceSpec.probe_node_overhead_s`, else the per-node overhead itself;
    backward by the backward probe when training, else alike), and, when the spec records the probe
    matmul's rate at calibration (`DeviceSpec.probe_matmul_flops_per_s`, timed with the matmuls the
    spec's peaks were fitted on), every peak scaled by the probe's rate now over then; memory and link
    figures stay as calibrated. What the cost model predicts for the machine as fast as it was during
    the run.

    Returns {"node_overhead_s" (the probe's per-node slope), "calibrated_node_overhead_s" (its reading
    at calibration), "speed_ratio" (the first over the second; > 1: slower than calibrated),
    "backward_node_overhead_s",
    "calibrated_backward_node_overhead_s", "backward_ratio" (training: the same for the backward
    per-node overhead, else None), "matmul_flops_per_s", "calibrated_matmul_flops_per_s",
    "matmul_ratio" (calibrated / probe rate; > 1: slower; None without a reference), "latency_s"
    (re-priced, seconds; a served request's decode step, `structure` being its decode graph),
    "measured_over_predicted" (the measured latency over it), "probe_samples"}, or None without a
    probe reading or without `structure`.
    """
    probe = run["measured"].get("speed_probe")
    dev = cluster.device
    if not probe or structure is None or not dev.node_overhead_s:
        return None
    if not probe.get("node_overhead_s") or probe["node_overhead_s"] <= 0:
        return None  # no usable reading: a loaded machine can read a slope of 0 (a probe graph's clamp)
    reference = dev.probe_node_overhead_s or dev.node_overhead_s  # the probe's reading at calibration
    probe_s = probe["node_overhead_s"]
    ratio = probe_s / reference
    probe_backward_s = probe.get("backward_node_overhead_s")
    backward_reference = dev.probe_backward_node_overhead_s or dev.backward_node_overhead_s
    backward_ratio = None
    if probe_backward_s is not None and probe_backward_s > 0 and backward_reference:
        backward_ratio = probe_backward_s / backward_reference  # a slope of 0 (a loaded machine): no reading
    backward_s = None
    if dev.backward_node_overhead_s is not None:
        backward_s = dev.backward_node_overhead_s * (backward_ratio if backward_ratio is not None else ratio)
    run_dev = replace(
        dev,
        node_overhead_s=dev.node_overhead_s * ratio,
        probe_node_overhead_s=dev.probe_node_overhead_s * ratio if dev.probe_node_overhead_s else None,
        backward_node_overhead_s=backward_s,
    )
    matmul_now, matmul_then = probe.get("matmul_flops_per_s"), dev.probe_matmul_flops_per_s
    matmul_ratio = None
    if matmul_now and matmul_then:
        matmul_ratio = matmul_then / matmul_now
        run_dev = replace(
            run_dev, peak_flops_per_s={k: v / matmul_ratio for k, v in dev.peak_flops_per_s.items()}
        )
    at_run = replace(cluster, device=run_dev)
    workload = priced_workload(plan)  # a served request's decode step (`structure`: the decode graph)
    as_planned = predict_with_plan(plan, structure, cluster, workload, plan.ladder_layers)
    repriced = predict_with_plan(plan, structure, at_run, workload, plan.ladder_layers)
    # the ratio carries the probe's effect onto the plan's own prediction (same op choices and layout)
    latency_s = plan.predicted.latency_s * repriced / as_planned if as_planned else repriced
    return {
        "node_overhead_s": probe_s,
        "calibrated_node_overhead_s": reference,
        "speed_ratio": ratio,
        "backward_node_overhead_s": probe_backward_s,
        "calibrated_backward_node_overhead_s": backward_reference,
        "backward_ratio": backward_ratio,
        "matmul_flops_per_s": matmul_now,
        "calibrated_matmul_flops_per_s": matmul_then,
        "matmul_ratio": matmul_ratio,
        "latency_s": latency_s,
        "measured_over_predicted": run["measured"]["latency_s"] / latency_s if latency_s else None,
        "probe_samples": probe.get("samples"),
    }

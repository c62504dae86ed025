"""The steps behind `planner optimize`: load, capture, plan, emit, run, report.

    model.py ─► capture ─► analyse ─► plan_model (cost model + ILP) ─► Plan ─► emit / run ─► report

Each function is one step with typed inputs and outputs; the CLI (`planner.cli`) only parses options,
shows progress and renders. Errors are `planner.errors` exceptions with the exit code of their kind.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from costmodels.cluster import (
    ClusterSpec,
    load_cluster,
    preset_names,
)
from costmodels.dtypes import dtype_bytes, torch_dtype
from passes.tp_rules_context import TensorParallelError
from passes.verify import verify_plan
from planner.cli.plan_checks import check_plan_fields as check_plan_fields  # re-exported
from planner.cli.plan_checks import plan_warnings as plan_warnings  # re-exported
from planner.errors import InfeasibleError, InputError, RunError
from planner.frontend.analysis import Layer, ModelStructure
from planner.frontend.capture import input_batch_dims, lifted_constants_quiet, op_name, user_line
from planner.frontend.depth import capture_for_planning
from planner.frontend.modelfile import ModelFile, load_model_file
from planner.frontend.phases import build_for, cast_inputs, decode_phase, plan_structure, prefill_phase
from planner.frontend.roles import Projection
from planner.plan import (
    BASELINE_OTHER_SPLITS,
    BASELINE_WOULD_NOT_RUN,
    WORKLOADS,
    DataParallel,
    Decision,
    MeshShape,
    Plan,
    Prediction,
    Recompute,
    Schedule,
    Serving,
    SplitStyle,
    WeightSplit,
    Workload,
    check_new_tokens,
    fallback_memory_bytes,
)
from planner.progress import Progress, silent
from planner.solver.explain import memory_fit_text, with_memory_fit
from planner.solver.machine import at_run_speed, priced_machine, priced_workload
from planner.solver.machine import probe_roofline as probe_roofline  # re-exported for planner calibrate
from planner.solver.machine import probes_speed as probes_speed  # re-exported for planner run
from planner.solver.problem import Constraints, LadderPolicy, WorkloadSpec, plan_workload_options
from planner.solver.search import baseline_layouts, megatron_plan, plan_model
from planner.solver.serving import kv_fallbacks, plan_prediction, price_request

DEFAULT_CONTEXT = 2048  # decode: KV-cache tokens when --context is not given
DEFAULT_NEW_TOKENS = 16  # decode / generate of a model with a KV cache: tokens generated per sequence
DEFAULT_PROMPT = 128  # generate: prompt tokens when --seq-len is not given
# where this machine's calibration is cached: $PARALLEL_PLANNER_CACHE when set (the test suite keeps
# its own there), else parallel-planner under $XDG_CACHE_HOME or ~/.cache
CACHE_DIR = Path(
    os.environ.get("PARALLEL_PLANNER_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "parallel-planner"
)


@dataclass
class Prepared:
    """A model file captured and analysed for planning (on the meta device: no weights allocated)."""

    model_file: ModelFile
    structure: ModelStructure
    workload: WorkloadSpec
    param_shapes: dict[str, tuple[int, ...]]  # every parameter FQN of the model, for validating plans
    graph: fx.GraphModule | None = None  # the planning capture (meta tensors; a slice of a deep model)
    request: ServingRequest | None = None  # models with a KV cache, decode / generate: the request priced
    prefill: ModelStructure | None = None  # ... and its prefill graph, analysed


@dataclass(frozen=True)
class ServingRequest:
    """A request of a model with a KV cache: `prompt_len` tokens, then `new_tokens` generated."""

    workload: Workload  # DECODE (prompt = --context) or GENERATE (prompt = --seq-len)
    prompt_len: int
    new_tokens: int
    trained_positions: int | None = None  # the model config's context (`trained_positions`)

    @property
    def cache_len(self) -> int:
        """The cache the model is built with: room for the prompt and every generated token."""
        return self.prompt_len + self.new_tokens


# a training step through a static KV cache: the forward writes the cache buffers in place, which keeps
# each step's autograd graph alive into the next one (the run failed in autograd, "backward through the
# graph a second time")
_TRAIN_WITH_CACHE = (
    "--workload train: {model} is a model with a static KV cache ({where}), which a training step cannot "
    "run: the forward writes the cache in place, and the next step's backward would reach the previous "
    "step's graph through it. Train a version of the model without the cache (as examples/llama3.py is of "
    "examples/llama3_kv.py), or plan this one for --workload forward, decode or generate"
)


def prepare(
    model_path: str,
    workload: str = "forward",
    batch_size: int | None = None,
    seq_len: int | None = None,
    context: int | None = None,
    micro_batches: int | None = None,
    dtype: str | None = None,
    new_tokens: int | None = None,
) -> Prepared:
    """Load `model_path`, build it on `meta`, capture and analyse it, and describe the workload.

    decode: the example inputs are asked for with seq_len=1 (one new token per sequence) and the KV
    cache holds `context` tokens (default DEFAULT_CONTEXT). A model with a KV cache (`step_inputs`)
    is planned from its own decode graph and its prefill graph is captured too (`_prepare_serving`).
    Raises InputError (bad file, options, untraceable model).
    """
    if workload not in WORKLOADS:
        raise InputError(f"--workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    # a workload that trains nothing has no use for torch.export's note on attributes kept without gradient
    with lifted_constants_quiet(workload != Workload.TRAIN):
        return _prepare(model_path, workload, batch_size, seq_len, context, micro_batches, dtype, new_tokens)


def _prepare(
    model_path: str,
    workload: str,
    batch_size: int | None,
    seq_len: int | None,
    context: int | None,
    micro_batches: int | None,
    dtype: str | None,
    new_tokens: int | None,
) -> Prepared:
    """`prepare` once its workload is known to be one of WORKLOADS."""
    for name, value in (("--batch-size", batch_size), ("--seq-len", seq_len), ("--context", context)):
        if value is not None and value < 1:
            raise InputError(f"{name} must be a positive integer, got {value}")
    model_file = load_model_file(model_path)
    if model_file.has_cache and workload in (Workload.DECODE, Workload.GENERATE):
        return _prepare_serving(
            model_file, Workload(workload), batch_size, seq_len, context, new_tokens, dtype
        )
    if workload == Workload.GENERATE:
        raise InputError(
            f"--workload generate needs a model with a static KV cache; {model_path} defines no "
            "step_inputs(tokens, input_pos) (docs/model-files.md, models with a KV cache)"
        )
    if new_tokens is not None:
        raise InputError("--new-tokens applies to --workload decode / generate of a model with a KV cache")
    if workload == Workload.TRAIN and model_file.has_cache:
        raise InputError(_TRAIN_WITH_CACHE.format(model=model_path, where="it defines step_inputs"))
    if workload == Workload.DECODE:
        if seq_len not in (None, 1):
            raise InputError(
                "--seq-len is the prompt length; decode plans one new token: use --context for the KV cache"
            )
        seq_len = 1
        context = context or DEFAULT_CONTEXT
    elif context:
        raise InputError("--context only applies to --workload decode")
    args, kwargs = model_file.inputs(batch_size, seq_len)
    model = model_file.build("meta")
    graph, structure = capture_for_planning(model, args, kwargs)
    _check_position_tables(graph, model_path)
    if (batch_size, seq_len) == (structure.seq_len, structure.batch_size) and batch_size != seq_len:
        # the inputs are (seq, batch, ...) (nn.Transformer's default): the planner's batch is dim 0
        structure.batch_size, structure.seq_len = batch_size, seq_len
        structure.batch_mixing.append(
            f"its input is sequence-first ({seq_len}, {batch_size}, ...) and the runtime splits the batch along dim 0"
        )
    if workload == Workload.TRAIN:
        cached = next((a for layer in structure.layers if (a := layer.attention) and a.cache_bytes), None)
        if cached is not None:
            where = f"its attention at {cached.core_line} reads a cache buffer it writes in forward"
            raise InputError(_TRAIN_WITH_CACHE.format(model=model_path, where=where))
        _record_attention_dropout(model, args, kwargs, graph, structure)
        _record_norm_upcasts(model, args, kwargs, structure, dtype)
    unsplit = _unsplittable_batch(model_file, structure.batch_size, seq_len)
    if unsplit:  # the search keeps one replica and one micro-batch (as for a batch that mixes samples)
        structure.batch_mixing.append(unsplit)
    if workload == "decode" and not any(layer.attention is not None for layer in structure.layers):
        raise InputError(
            f"{model_path} has no attention layer, so there is no KV cache for --workload decode to read: a decode "
            "step is one new token per sequence attending over its cached ones; plan it with --workload forward"
        )
    asked = [("batch_size", batch_size, structure.batch_size, "--batch-size")]
    if structure.token_model:
        asked.append(("seq_len", seq_len, structure.seq_len, "--seq-len"))
    for name, want, got, flag in asked:
        if want is not None and got != want:  # the file took the keyword and made other sizes
            how = (
                f"ignores {name}, so the plan would be for {got}"
                if got == _default_size(model_file, name)
                else f"makes inputs of {name} {got} from it (not {want}), so the plan would be for {got}"
            )
            raise InputError(
                f"{model_path}: example_inputs({name}={want}) returned inputs with {name} {got}: the model file "
                f"{how}, not the {flag} {want} asked for; make example_inputs build tensors of exactly {name} "
                f"{want} (a model that shifts its tokens, tokens[:, :-1] and tokens[:, 1:], then trains on "
                f"{name} - 1), or leave {flag} out"
            )
    wl = WorkloadSpec(
        kind=Workload(workload),
        batch_size=structure.batch_size,
        seq_len=structure.seq_len,
        context=context or 0,
        micro_batches=micro_batches,
        dtype=dtype,
    )
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    return Prepared(model_file, structure, wl, shapes, graph)


# ops between an `aten.arange` of positions and the embedding lookup it indexes that keep its values
_POSITION_VIEWS = frozenset({
    "aten.view", "aten.reshape", "aten._unsafe_view", "aten.unsqueeze", "aten.expand", "aten.slice",
    "aten.clone", "aten.contiguous", "aten._to_copy", "aten.to", "aten.alias", "aten.squeeze",
})  # fmt: skip


def _check_position_tables(graph: torch.fx.GraphModule, model_path: str) -> None:
    """A position-embedding table looked up by positions the graph counts with `aten.arange` (GPT-2's
    `wpe(torch.arange(0, t))`) with fewer rows than those positions is refused at planning: on meta
    tensors the lookup does not fail, and a run stopped on an IndexError deep in torch. Raises InputError
    naming the table, its rows and the positions."""
    params = dict(graph.named_parameters())
    for node in graph.graph.nodes:
        if node.op != "call_function" or op_name(node.target) != "aten.embedding":
            continue
        table, index, offset = node.args[0], node.args[1], 0
        while isinstance(index, torch.fx.Node):  # through views and constant offsets (HF: past length 0)
            name = op_name(index.target)
            constants = [a for a in index.args[1:2] if isinstance(a, int) and not isinstance(a, bool)]
            if name == "aten.add" and constants and isinstance(index.args[0], torch.fx.Node):
                offset += constants[0]
            elif name not in _POSITION_VIEWS:
                break
            index = index.args[0]
        if not isinstance(index, torch.fx.Node) or op_name(index.target) != "aten.arange":
            continue
        numbers = [a for a in index.args if isinstance(a, int) and not isinstance(a, bool)]
        if not numbers or len(numbers) > 2:  # positions counted otherwise, or with a step: leave them
            continue
        end = numbers[-1] + offset
        rows = _table_rows(table, params)
        if rows is not None and end > rows:
            where = user_line(node) or node.name
            raise InputError(
                f"{model_path}: the position embedding at {where} has {rows} rows (positions 0-{rows - 1}) but "
                f"the model looks up positions up to {end - 1} for these inputs: the sequence is longer than the "
                f"model's positions; use --seq-len {rows} or less (or give the model a larger table)"
            )


def _table_rows(table: object, params: dict[str, torch.nn.Parameter]) -> int | None:
    """Rows of an embedding's weight node (a lifted parameter or a get_attr), None if unknown."""
    if not isinstance(table, torch.fx.Node):
        return None
    val = table.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() == 2:
        return int(val.shape[0])
    weight = params.get(str(table.target)) if table.op == "get_attr" else None
    return int(weight.shape[0]) if weight is not None else None


def _default_size(model_file: ModelFile, name: str) -> int | None:
    """The size ``name`` ("batch_size" / "seq_len") of the model file's example inputs called without
    arguments (dim 0 / dim 1 of the first tensor), None when unknown."""
    try:
        args, _ = model_file.inputs(None, None)
    except Exception:  # noqa: BLE001 - only a hint for a message
        return None
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    dim = 0 if name == "batch_size" else 1
    return int(first.shape[dim]) if first is not None and first.dim() > dim else None


def _record_attention_dropout(
    model: torch.nn.Module, args: tuple, kwargs: dict, graph: fx.GraphModule, structure: ModelStructure
) -> None:
    """Set each layer's `Attention.dropout_p` to the SDPA dropout its training run applies.

    Planning captures the model in eval mode (`ModelFile.build`), where attention written as
    `dropout_p=p if self.training else 0.0` (Hugging Face's, nanoGPT's) reads 0; a training run
    captures it in train mode (`runtime.run_mode`). The model is captured once more in train mode
    (a slice of a deep one, `capture_for_planning`) when the planning graph calls SDPA; a capture that
    fails there is left to the run to report."""
    sdpa = "aten.scaled_dot_product_attention"
    if not any(op_name(n.target) == sdpa for n in graph.graph.nodes if n.op == "call_function"):
        return
    model.train()
    try:
        _, trained = capture_for_planning(model, args, kwargs)
    except InputError:
        return
    finally:
        model.eval()
    applied = {layer.index: layer.attention for layer in trained.layers if layer.attention is not None}
    for layer in structure.layers:
        if layer.attention is not None and layer.index in applied:
            layer.attention.dropout_p = applied[layer.index].dropout_p


def _record_norm_upcasts(
    model: torch.nn.Module, args: tuple, kwargs: dict, structure: ModelStructure, dtype: str | None
) -> None:
    """Set each layer's `Layer.norm_upcasts` as a training run in a 16-bit `dtype` computes it, for a
    model captured in fp32: a norm's `x.float()` is no copy in an fp32 graph, so the planning graph
    cannot show what the run keeps (an fp32 copy of the stream per such norm). The model is captured
    once more with its floating parameters and inputs in `dtype` (a slice of a deep one,
    `capture_for_planning`), then put back; a capture that fails there is left to the run to report."""
    if dtype not in ("bf16", "fp16") or structure.dtype != "fp32":
        return
    want = torch_dtype(dtype)
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    before = [t.dtype for t in tensors]
    with torch.no_grad():
        for t in tensors:
            t.data = t.data.to(want)
    try:
        _, cast_structure = capture_for_planning(model, *cast_inputs(args, kwargs, dtype))
    except InputError:
        return
    finally:
        with torch.no_grad():
            for t, was in zip(tensors, before):
                t.data = t.data.to(was)
    found = {layer.index: layer.norm_upcasts for layer in cast_structure.layers}
    for layer in structure.layers:
        layer.norm_upcasts = found.get(layer.index, layer.norm_upcasts)


def _unsplittable_batch(model_file: ModelFile, batch_size: int, seq_len: int | None) -> str | None:
    """Why the runtime could not split this model's batch over data-parallel replicas or micro-batches
    (`planner.frontend.capture.input_batch_dims`: `example_inputs` at the batch and twice it), or None
    when some input has a batch dim. A file whose `example_inputs` ignores `batch_size` has none: the
    search used to pick DP=2 for it, and the run then failed."""
    if batch_size < 2:
        return None  # nothing to split
    try:
        dims = input_batch_dims(lambda b: model_file.inputs(b, seq_len, device="meta"), batch_size)
    except InputError as e:
        return f"its inputs' batch dim cannot be found ({e})"
    if dims and all(d is None for d in dims):
        return "example_inputs(batch_size) changes no input's shape, so no input has a batch dim to split"
    return _batched_keyword(model_file, batch_size, seq_len)


def _batched_keyword(model_file: ModelFile, batch_size: int, seq_len: int | None) -> str | None:
    """Why a keyword tensor (`example_kwargs`) stops the batch from being split, or None: one whose dim 0
    is the batch (its size, or it grows with `batch_size`). The runtime splits the positional inputs
    along their batch dims and gives keyword tensors whole to every data-parallel replica and
    micro-batch, where a (batch, seq) padding mask then met half the batch (a broadcast error inside
    the rank's capture, after planning DP 2)."""
    _, kwargs = model_file.inputs(batch_size, seq_len, device="meta")
    try:
        _, doubled = model_file.inputs(2 * batch_size, seq_len, device="meta")
    except InputError:
        doubled = kwargs
    for name, value in kwargs.items():
        leaves, other = tree_flatten(value)[0], tree_flatten(doubled.get(name))[0]
        for i, t in enumerate(leaves):
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                continue
            grows = i < len(other) and isinstance(other[i], torch.Tensor) and other[i].shape != t.shape
            if t.shape[0] == batch_size or grows:
                return (
                    f"keyword input {name!r} {tuple(t.shape)} of example_kwargs() has the batch as dim 0, and the "
                    "runtime splits only example_inputs()' tensors along the batch (keyword tensors reach every "
                    "data-parallel replica and micro-batch whole, beside its part of the others); make it a "
                    "positional argument of forward, returned from example_inputs()"
                )
    return None


def _prepare_serving(
    model_file: ModelFile,
    workload: Workload,
    batch_size: int | None,
    seq_len: int | None,
    context: int | None,
    new_tokens: int | None,
    dtype: str | None,
) -> Prepared:
    """decode / generate of a model with a KV cache: the decode step (one token at position
    `prompt_len`, caches of `prompt_len + new_tokens` tokens) captured for planning, and the prefill."""
    if workload is Workload.DECODE:
        if seq_len not in (None, 1):
            raise InputError(
                "--seq-len is the prompt length of --workload generate; decode plans one new token after "
                "--context cached tokens"
            )
        prompt = context or DEFAULT_CONTEXT
    else:
        if context:
            raise InputError("--context is the cache of --workload decode; generate's prompt is --seq-len")
        prompt = seq_len or DEFAULT_PROMPT
    request = ServingRequest(workload, prompt, DEFAULT_NEW_TOKENS if new_tokens is None else new_tokens)
    check_new_tokens(request.new_tokens)
    model_file.check_step_positions()
    batch = batch_size or 1
    graph, structure = plan_structure(model_file, decode_phase(batch, prompt, request.cache_len))
    _check_cache_length(model_file, structure, batch, request)
    _check_logits_first(model_file, graph, structure)
    _, prefill = plan_structure(model_file, prefill_phase(batch, prompt, request.cache_len))
    wl = WorkloadSpec(
        kind=Workload.DECODE, batch_size=batch, seq_len=1, context=prompt, micro_batches=None, dtype=dtype
    )
    model = build_for(model_file, decode_phase(batch, prompt, request.cache_len), "meta")
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    request = replace(request, trained_positions=trained_positions(model))
    return Prepared(model_file, structure, wl, shapes, graph=graph, request=request, prefill=prefill)


def _check_logits_first(
    model_file: ModelFile, graph: torch.fx.GraphModule, structure: ModelStructure
) -> None:
    """Serving reads a cached model's first output as its logits (`runtime.decode.last_position_logits`):
    one whose last dim is not the vocabulary (a model returning (hidden, logits)) was served on its
    hidden states, greedy "tokens" taken over hidden channels, and the check passed. Raises InputError
    naming the output's shape and the vocabulary when the vocabulary is known and differs."""
    vocab = structure.vocab_size
    out = next((n for n in graph.graph.nodes if n.op == "output"), None)
    if not vocab or out is None:
        return
    first = next(
        (
            x.meta.get("val")
            for x in torch.utils._pytree.tree_leaves(out.args[0])
            if isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)
        ),
        None,
    )
    widths = {vocab} | ({structure.lm_head.out_features} if structure.lm_head is not None else set())
    if first is not None and first.dim() >= 2 and first.shape[-1] not in widths:
        raise InputError(
            f"{model_file.path}: serving reads the model's first output as its logits, but it has shape "
            f"{tuple(first.shape)}, whose last dim is not the vocabulary ({vocab}): return the logits first "
            "from forward (e.g. `return logits, hidden`)"
        )


def trained_positions(model: torch.nn.Module) -> int | None:
    """The context a model was trained for, from the first module's `config` holding one: Hugging Face's
    `max_position_embeddings`, or `max_seq_len` (the examples' `LlamaConfig`); None without one."""
    for module in model.modules():
        config = getattr(module, "config", None)
        for attr in ("max_position_embeddings", "max_seq_len"):
            value = getattr(config, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def request_peak_memory(
    plan: Plan, cluster: ClusterSpec, memory_fraction: float = Constraints.memory_fraction
) -> Prediction:
    """`plan.predicted` with its peak memory the larger of the decode step's and the prefill's
    (`Serving.prefill_peak_memory_bytes`: the prompt's activations beside the same weights and caches),
    for a serving plan. Raises InfeasibleError (exit 3) when the prefill does not fit
    ``memory_fraction`` of a device's memory: the decode step alone fitting does not make the request
    run."""
    sv = plan.serving
    if sv is None or sv.prefill_peak_memory_bytes is None:
        return plan.predicted
    cap = cluster.device.memory_bytes * memory_fraction
    if sv.prefill_peak_memory_bytes > cap:
        gib = 2**30
        experts = (
            "; the model's own expert code runs in this plan (no expert parallelism, experts whole), and "
            "its prefill may gather an expert matrix per token and choice (HF batched_mm, gpt-fast): "
            "--ep or --expert-tp (with --tp) run the experts as grouped GEMMs on their weights instead"
            if _own_experts(plan)
            else ""
        )
        raise InfeasibleError(
            f"the prefill of {sv.prompt_len} tokens x batch {plan.batch_size} needs "
            f"{sv.prefill_peak_memory_bytes / gib:.1f} GiB per device on {plan.mesh.label()}, over the "
            f"{cap / gib:.1f} GiB usable ({cluster.name}, memory_fraction {memory_fraction}); the decode step "
            f"alone needs {plan.predicted.peak_memory_bytes / gib:.1f} GiB. Would fit: a shorter --context / "
            "--seq-len, a smaller --batch-size, or more devices per request (tensor parallelism, or pipeline "
            f"stages: --pp, planned but not run here){experts}"
        )
    peak = max(plan.predicted.peak_memory_bytes, sv.prefill_peak_memory_bytes)
    return replace(plan.predicted, peak_memory_bytes=peak)


def _own_experts(plan: Plan) -> bool:
    """Whether `plan` runs a mixture of experts as the model's own code computes it: no expert
    parallelism and the experts whole, so no pass rewrites them."""
    return bool(plan.num_experts) and plan.ep == 1 and plan.expert_tp == 1


def _check_cache_length(
    model_file: ModelFile, structure: ModelStructure, batch: int, request: ServingRequest
) -> None:
    """Raise InputError when the model's KV caches hold fewer positions than the request writes. A
    layer's positions are the keys its attention reads from the cache in the captured step
    (`Attention.kv_len`: whatever the cache holds per position, K and V or a latent they are made
    from); without that record, its cache bytes over 2 (K and V) x batch x KV heads x head dim x dtype
    bytes, when that divides exactly. On the meta device an out-of-range cache write goes unnoticed;
    on real tensors it fails deep inside torch."""
    size = dtype_bytes(structure.dtype)
    for i, layer in enumerate(structure.layers):
        attn = layer.attention
        if attn is None or not attn.cache_bytes:
            continue
        if attn.kv_len:
            positions, rest = attn.kv_len, 0
        else:
            per_position = 2 * batch * attn.num_kv_heads * attn.head_dim * size
            positions, rest = divmod(int(attn.cache_bytes), per_position)
        if rest == 0 and 0 < positions < request.cache_len:
            raise InputError(
                f"{model_file.path}: build_model(max_batch_size={batch}, max_seq_len={request.cache_len}) "
                f"allocated layer {i}'s KV cache for {positions} positions, but the request writes "
                f"{request.cache_len} (prompt {request.prompt_len} + {request.new_tokens} new tokens): "
                "allocate the caches for max_seq_len positions, or ask for a shorter --context / --seq-len "
                "/ --new-tokens (a sliding window kept as a ring buffer of fewer slots is not served here: "
                "allocate every position and mask the window instead)"
            )


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock (`fcntl.flock`) on ``lock_path`` for the block: processes that
    enter it with the same path run it one at a time. Where `fcntl` is missing (Windows) or the lock
    file cannot be written (a read-only cache of a valid spec) it does not lock."""
    try:
        import fcntl  # noqa: PLC0415

        handle = open(lock_path, "a")  # noqa: SIM115 - closed below, after the block
    except (ImportError, OSError):
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def resolve_cluster(
    name_or_path: str | None, nproc: int | None, progress=None, recalibrate: bool = False, notify=None
) -> ClusterSpec:
    """The cluster to plan for: a preset name, a YAML file, or (None) this machine, calibrated on
    first use and cached under CACHE_DIR; measured again when ``recalibrate`` or when the cache is
    stale (`costmodels.calibrate.cache_status`: older than a week, another CPU, torch version or
    process count). ``notify(text)`` is told why it measures. Raises InputError (SpecError) for a
    bad name or file."""
    from costmodels.calibrate import (  # noqa: PLC0415
        CalibrationWarning,
        cache_status,
        calibrate,
        write_cache_metadata,
        write_cluster_yaml,
    )

    if name_or_path:
        spec = load_cluster(name_or_path, nproc=nproc)
        written = load_cluster(name_or_path) if nproc else spec
        if notify is not None and written.num_devices != spec.num_devices and not written.devices_auto:
            notify(
                f"--nproc {nproc}: planning for {spec.num_devices} ranks, not the {written.num_devices} device(s) "
                f"{name_or_path} gives"
                + (
                    " (CPU processes: each rank's compute and memory rescaled to its share of the node)"
                    if spec.backend == "gloo" and spec.num_nodes == 1
                    else ""
                )
            )
        return spec
    nproc = nproc or os.cpu_count() or 1
    measured = calibration_nproc(nproc)
    cached = CACHE_DIR / f"local-nproc{measured}.yaml"
    with contextlib.suppress(
        OSError
    ):  # a read-only cache still serves a valid spec; a measurement says why not
        cached.parent.mkdir(parents=True, exist_ok=True)
    # one measurement at a time: a second planner started meanwhile waits for the first one's spec
    # instead of measuring beside it (two calibrations on the same cores would each measure a machine
    # half as fast, and write those figures)
    with _exclusive(cached.parent / f"{cached.name}.lock"):
        why = "--recalibrate" if recalibrate else cache_status(cached, measured)
        if why is not None:
            if notify is not None:
                notify(
                    f"measuring this machine with {measured} processes (planner calibrate, 30-40 s; {why}); cached in {cached}"
                )
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                spec = calibrate(measured, progress=progress, probe_roofline=probe_roofline)
            for w in caught:  # shown as they would have been
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            # measured on a busy machine: used now, and measured again once the machine is quieter
            busy = any(issubclass(w.category, CalibrationWarning) for w in caught)
            write_cluster_yaml(spec, cached)
            write_cache_metadata(cached, measured, busy=busy)
    # more ranks than cores: the one-process-per-core spec, time-shared (`costmodels.cluster.load_cluster`)
    return load_cluster(str(cached), nproc=nproc if nproc != measured else None)


def calibration_nproc(nproc: int) -> int:
    """How many processes this machine is calibrated with for a run on `nproc` ranks: `nproc`, or one
    per core when there are more ranks than cores. Four processes timed on two cores measure how the
    scheduler happened to share them (compute is timed in thread CPU time, which hides the sharing,
    while the per-node overhead and the all-reduce are timed in wall time, which shows it); the spec
    measured with one process per core, resized by `load_cluster(..., nproc)`, prices the sharing
    (each rank gets cores / nproc of a core)."""
    return min(nproc, os.cpu_count() or 1)


def constraints_from(
    tp: int | None,
    pp: int | None,
    dp: int | None,
    ladder: str,
    max_devices: int | None = None,
    schedule: Schedule | None = None,
    virtual_stages: int | None = None,
    recompute: Recompute | None = None,
    sequence_parallel: bool | None = None,
    distributed_optimizer: bool | None = None,
    layout: str = "auto",
    dp_style: str | None = None,
    dp_shard: int | None = None,
    reshard_after_forward: bool | None = None,
    tp_comm_overlap: bool | None = None,
    overlap_grad_reduce: bool | None = None,
    overlap_param_gather: bool | None = None,
    cp: int | None = None,
    cp_comm_type: str | None = None,
    cp_load_balance: bool | None = None,
    ep: int | None = None,
    ep_fold: str | None = None,
    runs_here: bool = False,
    expert_tp: int | None = None,
) -> Constraints:
    """Constraints from CLI options (`--ladder` read by `LadderPolicy.parse`; None: the search chooses;
    `cp`, `cp_comm_type`, `cp_load_balance`: --cp, --cp-comm-type, --cp-load-balance; `ep`, `ep_fold`:
    --ep, --ep-fold, `runs_here` (--run: `Constraints.runs_here`); `expert_tp`: --expert-tp;
    with `dp_shard` (--dp-shard) a given `dp` is the replicate degree: the mesh has dp x dp_shard DP ranks;
    `layout`: --layout, "auto" or "megatron", `Constraints.layout`). Raises InputError for a malformed
    --ladder, an unknown --schedule, --recompute or --layout, or a --virtual-stages without the
    interleaved schedule."""
    policy = LadderPolicy.parse(ladder or "none", option="--ladder")
    if dp_shard is not None and dp is not None:  # --dp is then the replicate degree (HSDP's)
        dp *= dp_shard
    return Constraints(
        tp=tp, pp=pp, dp=dp, ladder=policy, max_devices=max_devices, schedule=schedule,
        virtual_stages=virtual_stages, recompute=recompute, sequence_parallel=sequence_parallel,
        distributed_optimizer=distributed_optimizer, layout=layout, dp_style=dp_style, dp_shard=dp_shard,
        reshard_after_forward=reshard_after_forward, tp_comm_overlap=tp_comm_overlap,
        overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather, cp=cp,
        cp_comm_type=cp_comm_type, cp_load_balance=cp_load_balance, ep=ep, ep_fold=ep_fold,
        runs_here=runs_here, expert_tp=expert_tp,
    )  # fmt: skip


def check_pinned_tp(structure: ModelStructure, tp: int | None) -> None:
    """A pinned --tp must split every attention layer's heads and KV heads into whole heads per rank.

    Raises InputError naming the head counts and the degrees that would work.
    """
    if tp is None or tp == 1:
        return
    kv = structure.kv_heads_unsplit_by(tp)  # fewer KV heads than tp and dividing it: replicated, fine
    heads = sorted(set(structure.query_head_counts()))
    counts = sorted(set(heads) | set(kv))
    if counts and any(c % tp for c in counts):
        # degrees that split every count of query heads into whole heads and the KV heads too, or
        # replicate the KV heads evenly (fewer KV heads than ranks, dividing them: vLLM's rule)
        ok = [
            d
            for d in range(1, min(heads or counts) + 1)
            if all(h % d == 0 for h in heads) and not structure.kv_heads_unsplit_by(d)
        ]
        said = f"{'/'.join(map(str, heads))} query heads" + (
            f", {'/'.join(map(str, sorted(set(kv))))} KV heads" if kv else ""
        )
        raise InputError(
            f"--tp {tp} does not divide the attention heads: the model has {said}; "
            f"tensor parallelism splits whole heads, so use --tp in {ok} (or leave --tp out to let the planner choose)"
        )


def check_constraints_fit(
    cluster: ClusterSpec,
    constraints: Constraints,
    batch_size: int,
    micro_batches: int | None,
    num_layers: int | None = None,
) -> None:
    """Pinned degrees must fit the cluster and the batch, and a pinned interleaved schedule the layers
    and micro-batches (each of pp x v chunks holds a layer; the micro-batches are a multiple of pp).
    Raises InputError naming the options."""
    pinned = constraints.pinned
    product = 1
    for value in pinned.values():
        product *= value
    devices = constraints.max_devices or cluster.num_devices
    if product > devices:
        shard = constraints.dp_shard

        def pin(k: str, v: int) -> str:  # with --dp-shard, --dp counts the replicas of each shard group
            return f"dp({v // shard} replicas x {shard} shards)" if k == "dp" and shard else f"{k}({v})"

        shown = " x ".join(pin(k, v) for k, v in pinned.items())
        raise InputError(
            f"{shown} = {product} devices, but "
            + (
                f"{cluster.name} has {devices} (--nproc / --devices)"
                if constraints.max_devices or cluster.backend == "gloo" and not cluster.resized_from
                else cluster.devices_text()
            )
        )
    dp = constraints.dp or 1
    if batch_size % dp:
        shard = constraints.dp_shard
        flags = (
            f"--dp {dp // shard} x --dp-shard {shard} = {dp} data-parallel ranks" if shard else f"--dp {dp}"
        )
        raise InputError(
            f"{flags} does not divide the batch of {batch_size} sequences; use a --batch-size that is a multiple of {dp}"
        )
    if micro_batches and (batch_size // dp) % micro_batches:
        raise InputError(
            f"--micro-batches {micro_batches} does not divide the batch of {batch_size // dp} sequences per DP replica"
        )
    v, pp = constraints.virtual_stages, constraints.pp
    interleaved = constraints.schedule is Schedule.INTERLEAVED_1F1B or (v or 1) > 1
    if (v or 1) > 1 and (pp or 1) == 1 and pp is not None:
        raise InputError(
            f"--virtual-stages {v} needs a pipeline: pin --pp 2 or more (or leave --pp to the search)"
        )
    if interleaved and pp and pp > 1:
        if v and num_layers and pp * v > num_layers:
            raise InputError(
                f"--pp {pp} --virtual-stages {v} cuts the model into {pp * v} chunks, but it has {num_layers} layers: "
                f"give --virtual-stages {max(1, num_layers // pp)} or less"
            )
        if micro_batches and micro_batches % pp:
            raise InputError(
                f"the interleaved schedule runs micro-batches in rounds of pp: --micro-batches {micro_batches} must "
                f"be a multiple of --pp {pp}"
            )


def prepare_for_plan(plan: Plan, model_path: str) -> Prepared:
    """`prepare` `model_path` as `plan` was made: a serving plan's request (decode: its context is the
    prompt; generate: its prompt is the sequence length), in the plan's dtype; any other plan's
    graph (training's, or forward's) at the plan's batch, sequence length and dtype, as `planner
    optimize` prepared it. Raises InputError as `prepare`."""
    sv = plan.serving
    if sv is None:
        if plan.workload in (Workload.DECODE, Workload.GENERATE) and load_model_file(model_path).has_cache:
            raise InputError(
                f"the plan has no field 'serving', but {model_path} has a KV cache (it defines step_inputs): "
                "its decode / generate plans serve a request; plan it again (planner optimize ... --workload "
                f"{plan.workload})"
            )
        # as `planner optimize` prepared it: a training plan's graph records its attention dropout and
        # norm upcasts in the plan's dtype, and the model's rates are timed for its backward and dtype
        workload = Workload.TRAIN if plan.workload is Workload.TRAIN else Workload.FORWARD
        return prepare(model_path, str(workload), plan.batch_size, plan.seq_len, dtype=plan.dtype)
    decode = plan.workload is Workload.DECODE
    return prepare(
        model_path,
        str(plan.workload),
        plan.batch_size,
        seq_len=None if decode else sv.prompt_len,
        context=sv.prompt_len if decode else None,
        dtype=plan.dtype,
        new_tokens=sv.new_tokens,
    )


def validate_plan_for_model(
    plan: Plan, structure: ModelStructure, model_path: str, params: dict[str, tuple]
) -> None:
    """A (possibly hand-edited) plan must match the model it is run with. Raises InputError naming the
    plan field: a parameter count that differs from `model_params` (the model file changed since
    planning), unknown weights in `splits`, a style/dim that contradicts the weight's layout,
    `stages` that do not cover every layer once and in order, a batch that does not divide by dp."""
    if plan.model_params and int(structure.num_params) != plan.model_params:
        raise InputError(
            f"plan field model_params: the plan was made for a model of {plan.model_params:,} parameters and "
            f"{model_path} has {int(structure.num_params):,}: the model changed since planning; re-plan with "
            f"planner optimize {model_path} ..."
        )
    frozen = int(structure.num_frozen_params)
    if plan.workload is Workload.TRAIN and plan.model_params and frozen != plan.frozen_params:
        raise InputError(
            f"plan field frozen_params: the plan was made for a model with {plan.frozen_params:,} frozen parameters "
            f"(requires_grad=False) and {model_path} freezes {frozen:,}: what it trains changed since planning, "
            "and with it the plan's memory, time and layer classes; re-plan with "
            f"planner optimize {model_path} ..."
        )
    unknown = [w for w in plan.splits if w not in params]
    if unknown:
        raise InputError(
            f"plan field splits: weights {unknown[:3]} are not parameters of {model_path} "
            f"(the plan was made for {plan.model}); re-plan with planner optimize {model_path}"
        )
    layouts = {
        p.weight: p.weight_out_dim
        for layer in structure.layers
        for b in (layer.attention, layer.mlp)
        if b
        for p in b.projections
    }
    if structure.lm_head is not None:
        layouts[structure.lm_head.weight] = structure.lm_head.weight_out_dim
    for name, split in plan.splits.items():
        out_dim = layouts.get(name)
        if out_dim is None or split.style in (SplitStyle.REPLICATE, SplitStyle.VOCAB):
            continue
        want = out_dim if split.style is SplitStyle.COLWISE else 1 - out_dim
        if split.dim != want:
            raise InputError(
                f"plan field splits.{name}: style {split.style} splits dim {want} of this weight, not dim {split.dim}"
            )
    for name, split in plan.splits.items():
        check_split_sizes(name, split, params[name], plan.tp)
    train_dp = plan.workload is Workload.TRAIN and plan.dp * plan.cp > 1
    if train_dp and plan.pp > 1 and structure.tied_lm_head and DataParallel(plan.dp_style).shards_gradients:
        # the runtime refuses it too (`runtime.pipeline_run`), on the ranks; the search never plans it
        raise InputError(
            f"plan field dp_style: {plan.dp_style} with pp={plan.pp} and the LM head tied to the embedding "
            "on another stage: their sharded gradients cannot be summed between the stages; set dp_style "
            "to zero1 or ddp, or re-plan with --pp 1"
        )
    check_plan_fields(plan, len(structure.layers))


def check_split_sizes(name: str, split: WeightSplit, shape: tuple, tp: int) -> None:
    """A split's sizes must cut weight `name` of `shape` as the pass cuts it (`passes.placement.
    shard_weight`): `parts` (a fused projection's parts) sum to the size of dim `dim` and each divides
    by tp; without parts that size divides by tp (a vocabulary split pads it instead), or by `pieces`.
    Raises InputError naming the plan field and the sizes."""
    if split.style is SplitStyle.REPLICATE or not shape or split.dim >= len(shape):
        return
    size, where = int(shape[split.dim]), f"plan field splits.{name}"
    if split.parts:
        if sum(split.parts) != size:
            raise InputError(
                f"{where}.parts: {split.parts} sum to {sum(split.parts)}, but dim {split.dim} of this weight "
                f"{tuple(shape)} has {size} (the fused projection's parts, e.g. its q, k and v rows, in order)"
            )
        odd = [p for p in split.parts if p % tp]
        if odd:
            raise InputError(f"{where}.parts: each part is split over tp={tp}, and {odd} do not divide by it")
    elif split.pieces is not None:
        if size % split.pieces:
            raise InputError(
                f"{where}.pieces: dim {split.dim} of this weight {tuple(shape)} has {size}, which does not cut "
                f"into {split.pieces} pieces"
            )
    elif split.style is not SplitStyle.VOCAB and size % tp:
        raise InputError(
            f"{where}: style {split.style} splits dim {split.dim} of this weight {tuple(shape)}, whose {size} "
            f"does not divide by tp={tp}; set style replicate, or re-plan"
        )


def check_fits_this_machine(
    plan: Plan, structure: ModelStructure, nproc: int, ranks_on_host: bool | None = None
) -> None:
    """Running needs this machine's memory for the unsharded reference (the model's weights, run once
    before the ranks start, its files kept while they run) and, where the ranks run on the host's CPUs
    (`ranks_on_host`, default: fewer CUDA devices than ranks), each of the `nproc` ranks' predicted peak (the plan's
    `Prediction.peak_memory_bytes`: its shards, gradients, optimizer state and activations; data-parallel
    replicas each hold their copy). The shards alone (about one model over all ranks) were counted before:
    a 4-replica GPT-2 XL training plan of 16.6 GiB per rank started on a 23 GiB machine. Raises
    InputError with what would fit."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return
    if ranks_on_host is None:  # fewer CUDA devices than ranks: they run on gloo, in host memory
        ranks_on_host = (torch.cuda.device_count() if torch.cuda.is_available() else 0) < nproc
    reference = structure.param_bytes
    ranks = nproc * plan.predicted.peak_memory_bytes if ranks_on_host else 0.0
    shards = max(structure.param_bytes, ranks)  # at least the model's weights over the ranks
    need = reference + shards
    if need > 0.8 * total:
        what = (
            f"{nproc} rank(s) x {plan.predicted.peak_memory_bytes / 2**30:.1f} GiB predicted per rank"
            if ranks >= structure.param_bytes
            else f"its shards over {nproc} rank(s)"
        )
        raise InputError(
            f"running this plan here needs about {need / 2**30:.1f} GiB (the {reference / 2**30:.1f} GiB "
            f"model once for the reference, then {what}), this machine has {total / 2**30:.1f} GiB; "
            "run it on its cluster (torchrun, see docs/real-cluster.md) or run a smaller configuration of the "
            "model (a smaller batch, sequence or model size)"
        )


def make_plan(
    prepared: Prepared,
    cluster: ClusterSpec,
    constraints: Constraints,
    model_path: str,
    cluster_source: str = "",
    progress: Progress = silent,
) -> Plan:
    """Solve for the best plan and check it by lowering it (`check_lowering`). cluster_source: where
    the cluster spec came from (`cluster_source`), recorded in the plan. `progress`: told of the mesh
    search and the lowering. A served request whose prefill does not fit with the model's own expert
    code (experts whole, no expert pass: `request_peak_memory`) is planned again with the expert pass
    required (`Constraints.experts_rewritten`: EP, or the experts split over TP, as the pins allow); the
    plan's `excluded` says why, and where nothing else fits the first refusal is the answer. Raises InfeasibleError (exit 3: no plan, or one the passes cannot lower) or
    InputError (exit 2)."""
    try:
        return _make_plan(prepared, cluster, constraints, model_path, cluster_source, progress)
    except _ExpertsPrefillTooLarge as whole:
        progress(
            "planning again with the expert pass: the prefill does not fit the model's own experts", None
        )
        try:
            plan = _make_plan(
                prepared,
                cluster,
                replace(constraints, experts_rewritten=True),
                model_path,
                cluster_source,
                progress,
            )
        except (InfeasibleError, InputError):
            raise whole.error from None
        plan.excluded.append(f"experts whole (the model's own expert code): {whole.error}")
        return plan


def _priced_request(plan: Plan, prepared: Prepared, cluster: ClusterSpec) -> Serving:
    """`price_request` of `prepared`'s served request (its prefill graph and sizes) on `plan`."""
    request = prepared.request
    assert request is not None and prepared.prefill is not None, "a served request's plan"
    return price_request(
        plan,
        prepared.prefill,
        prepared.structure,
        cluster,
        prompt_len=request.prompt_len,
        new_tokens=request.new_tokens,
        cache_len=request.cache_len,
        trained_positions=request.trained_positions,
        fallbacks=kv_fallbacks(plan, prepared.structure),
    )


def _mark_own_experts_prefill(
    plan: Plan, prepared: Prepared, cluster: ClusterSpec, memory_fraction: float
) -> None:
    """A served plan's expert-parallelism decision prices each alternative's decode step; the one
    that leaves the experts to the model's own code ("off": no EP, experts whole) is marked not fitting
    where its request's prefill would not (`request_peak_memory`: HF batched_mm and gpt-fast gather an
    expert matrix per token and choice, a prompt's worth of them), so `--why` does not offer it."""
    request = prepared.request
    decision = next((d for d in plan.decisions if d.subject == "expert parallelism"), None)
    if (
        decision is None
        or request is None
        or _own_experts(plan)
        or not math.isfinite(decision.options.get("off", math.inf))
    ):
        return
    alt = replace(plan, ep=1, ep_fold="dp", expert_tp=1)
    alt.serving = _priced_request(alt, prepared, cluster)
    try:
        request_peak_memory(alt, cluster, memory_fraction)
    except InfeasibleError:
        gib = 2**30
        decode_s = decision.options["off"]
        decision.options["off"] = math.inf
        decision.reason += (
            f"; off: a decode step of {decode_s * 1e3:.3g} ms, but the request's prefill of {request.prompt_len} "
            f"tokens would need {alt.serving.prefill_peak_memory_bytes / gib:.1f} GiB per device on "
            f"{plan.mesh.label()} with the model's own expert code (an expert matrix gathered per token and "
            "choice): it does not fit"
        )


class _ExpertsPrefillTooLarge(Exception):
    """A served plan's prefill does not fit where the model's own experts run (`make_plan` plans again)."""

    def __init__(self, error: InfeasibleError) -> None:
        super().__init__(str(error))
        self.error = error


def _make_plan(
    prepared: Prepared,
    cluster: ClusterSpec,
    constraints: Constraints,
    model_path: str,
    cluster_source: str,
    progress: Progress,
) -> Plan:
    """`make_plan` once, for ``constraints``."""
    check_pinned_tp(prepared.structure, constraints.tp)
    cluster = priced_cluster(prepared, cluster, progress)
    plan = plan_model(
        prepared.structure,
        cluster,
        prepared.workload,
        constraints,
        model_name=str(model_path),
        progress=progress,
    )
    if constraints.sequence_parallel and not any(s.style is SplitStyle.ROWWISE for s in plan.splits.values()):
        raise InputError(
            f"--sequence-parallel on: the best plan on {cluster.name} (TP={plan.tp}) splits no projection row-wise "
            "(its weights are replicated or column-parallel), so there is no row-parallel block whose all-reduce "
            "sequence parallelism would split, and it would not run. Use --sequence-parallel auto or off"
            + (
                f", or --layout megatron to split every layer as Megatron-LM does at TP={plan.tp} (priced)"
                if plan.tp > 1 and constraints.layout != "megatron"
                else ""
            )
        )
    request = prepared.request
    progress("lowering the plan on meta tensors for every rank", None)
    plan, prepared = _lower_keeping_whole(prepared, plan, cluster, constraints, model_path, progress)
    plan, replicated = _replan_around_unshardable_gaps(
        prepared, plan, cluster, constraints, model_path, progress
    )
    plan = _replan_without_cp_gathers(prepared, plan, cluster, constraints, model_path, progress)
    plan = _lower_baseline(prepared, replicated, plan, cluster, constraints, model_path)
    plan = _megatron_layout_note(prepared, replicated, plan, cluster, constraints, model_path)
    _mark_fallback_gathers(plan, prepared.structure)
    _check_fallbacks_fit(plan, cluster, constraints)
    plan.cluster_source = cluster_source
    if request is not None and prepared.prefill is not None:
        plan.serving = _priced_request(plan, prepared, cluster)
        try:
            plan.predicted = request_peak_memory(plan, cluster, constraints.memory_fraction)
        except InfeasibleError as e:
            rewritable = not (constraints.ep == 1 and constraints.expert_tp == 1)  # as pinned
            again = constraints.experts_rewritten  # already planned with the expert pass
            if _own_experts(plan) and rewritable and not again:
                raise _ExpertsPrefillTooLarge(e) from None
            raise
        _mark_own_experts_prefill(plan, prepared, cluster, constraints.memory_fraction)
        plan.workload = request.workload
        if request.workload is Workload.GENERATE:
            plan.seq_len = request.prompt_len
    plan.priced_digest = plan.decisions_digest()
    return plan


MAX_WHOLE_REPLANS = 6  # plans made again around refused weights before the last refusal is the answer


def _lower_keeping_whole(
    prepared: Prepared,
    plan: Plan,
    cluster: ClusterSpec,
    constraints: Constraints,
    model_path: str,
    progress: Progress = silent,
) -> tuple[Plan, Prepared]:
    """(`plan` lowered for every rank by `check_lowering`, `prepared`), or, where the tensor-parallel
    pass refuses the plan (an op of a layer's block it cannot carry the planned split through, or a
    split weight read by an op it has no rule for), a plan made again with the weights at fault kept
    whole (`ModelStructure.whole_weights`, for every layer of the class; `_whole_weights`), until one
    lowers: the search then prices what can run instead of the user getting exit 3, and its
    exclusions name the op and the model line. `prepared` comes back with that structure. A layout
    given by hand (--layout megatron) is refused as before, and so is a refusal outside the layers'
    blocks, one that keeping weights whole does not change, or the one left after `MAX_WHOLE_REPLANS`
    plans. Raises InfeasibleError (exit 3)."""
    for _ in range(MAX_WHOLE_REPLANS):
        try:
            return check_lowering(prepared, plan, cluster), prepared
        except InfeasibleError as e:
            refused = e.__cause__
            if constraints.layout == "megatron" and isinstance(refused, TensorParallelError):
                raise InfeasibleError(
                    f"{e}; --layout megatron splits every layer as Megatron-LM does: without it the planner keeps "
                    "the weights the pass cannot split whole and plans around them"
                ) from refused
            if not isinstance(refused, TensorParallelError):
                raise
            structure = _whole_weights(prepared.structure, refused, plan)
            if structure is None:
                raise
        prepared = replace(prepared, structure=structure)
        progress("planning again with the weights the tensor-parallel pass cannot split kept whole", None)
        plan = plan_model(
            structure, cluster, prepared.workload, constraints, model_name=str(model_path), progress=progress
        )
    return check_lowering(prepared, plan, cluster), prepared


def _layer_projections(layer: Layer) -> list[Projection]:
    """A layer's projections in a fixed order (attention, cross-attention, MLP): the same position in
    two layers of one class (`costing.layer_key`) is the same projection."""
    blocks = (layer.attention, layer.cross_attention, layer.mlp)
    return [p for block in blocks if block is not None for p in block.projections]


def _chain_upstream(layer: Layer, node: str) -> list[Projection]:
    """The MLP projections of `layer` to keep whole for a TP refusal at `node` in its MLP: all of them
    for an MLP of up to three projections (gate, up, down), else, for a longer chain (LFM2's conv block
    read with its feed-forward as one chain: in_proj, the chunk and conv, out_proj, w1, w3, w2), the last
    projection before `node` in graph order, whose split reaches it: the whole chain was kept whole for
    a chunk of in_proj's output, and the feed-forward with it. A next refusal keeps the next one whole."""
    projections = layer.mlp.projections if layer.mlp is not None else []
    if len(projections) <= 3 or node not in layer.nodes:
        return projections
    order = {name: i for i, name in enumerate(layer.nodes)}
    before = [p for p in projections if order.get(p.node, len(order)) < order[node]]
    return [max(before, key=lambda p: order[p.node])] if before else projections


def _whole_weights(
    structure: ModelStructure, refused: TensorParallelError, plan: Plan
) -> ModelStructure | None:
    """`structure` with the weights a TP refusal (`refused`) is about kept whole, or None when there is
    nothing new to keep whole. The weights: those no rule read (`TensorParallelError.weights`), else the
    planned-split projections of the block of the layer holding the refused node (its attention, its
    cross-attention or its MLP; the whole layer's for a node of neither). Each is kept whole in every
    layer of its class (`costing.layer_key`: the layers of a class share one split)."""
    from planner.solver.costing import layer_key  # noqa: PLC0415

    op = f"{refused.op or 'an op'} at {refused.line or refused.node}"
    why = (
        f"kept whole: no tensor-parallel rule splits the weight {op} reads"
        if refused.weights
        else f"kept whole: the tensor-parallel pass cannot carry the split through {op} ({refused.why})"
    )
    split = {w for w, s in plan.splits.items() if s.style is not SplitStyle.REPLICATE}
    weights = set(refused.weights) & split
    if not refused.weights:
        for layer in structure.layers:
            if refused.node not in layer.nodes:
                continue
            block = layer.node_blocks.get(refused.node)
            if block in ("cross", "cross_core") and layer.cross_attention is not None:
                projections = layer.cross_attention.projections
            elif block in ATTENTION_BLOCKS and layer.attention is not None:
                projections = layer.attention.projections
            elif block == "mlp" and layer.mlp is not None:
                projections = _chain_upstream(layer, refused.node)
            else:
                projections = _layer_projections(layer)
            weights = {p.weight for p in projections} & split
            break
    positions = {
        (layer_key(layer), i)
        for layer in structure.layers
        for i, p in enumerate(_layer_projections(layer))
        if p.weight in weights
    }
    weights |= {
        p.weight
        for layer in structure.layers
        for i, p in enumerate(_layer_projections(layer))
        if (layer_key(layer), i) in positions
    }
    new = {w: why for w in sorted(weights) if w not in structure.whole_weights}
    return replace(structure, whole_weights={**structure.whole_weights, **new}) if new else None


def _mark_fallback_gathers(plan: Plan, structure: ModelStructure) -> None:
    """Mark, in `plan.splits`, the MLP projections around an op the TP pass runs replicated
    (`Plan.fallbacks` in a layer's MLP, its class's every layer; or in a projection chain's gap): the
    column-parallel ones `gather_output`, the row-parallel ones `replicated_input`, as the run gathers
    and slices there. The exports that pair Colwise / RowwiseParallel read them (a DTensor file ran a
    softmax over the width on each rank's shard)."""
    from planner.solver.costing import layer_key  # noqa: PLC0415

    if plan.tp == 1 or not plan.fallbacks:
        return
    nodes = {f.node for f in plan.fallbacks}
    classes = {
        layer_key(layer) for layer in structure.layers if "mlp" in {layer.node_blocks.get(n) for n in nodes}
    }
    projections = [p for layer in structure.layers if layer.mlp is not None and layer_key(layer) in classes
                   for p in layer.mlp.projections]  # fmt: skip
    chain = structure.mlp_chain or []
    for i, gap in structure.chain_gaps.items():  # gap i: between chain[i - 1] and chain[i]
        if nodes & gap and 0 < i < len(chain):
            projections += [chain[i - 1], chain[i]]
    for proj in projections:
        split = plan.splits.get(proj.weight)
        if split is not None and split.style is SplitStyle.COLWISE:
            split.gather_output = True
        elif split is not None and split.style is SplitStyle.ROWWISE:
            split.replicated_input = True


def _check_fallbacks_fit(plan: Plan, cluster: ClusterSpec, constraints: Constraints) -> None:
    """Raise InfeasibleError when the unplanned all-gathers the passes add (`Plan.fallbacks`, priced by
    `passes.verify`) push the plan's peak memory per rank over what the search allowed: the plan was
    chosen as fitting and no longer does. The message names the gathers and both sizes."""
    cap = cluster.device.memory_bytes * constraints.memory_fraction
    added = fallback_memory_bytes(plan.fallbacks, plan.workload)
    peak = plan.predicted.peak_memory_bytes
    if not plan.fallbacks or peak <= cap or peak - added > cap:
        return
    ops = ", ".join(dict.fromkeys(f"{f.op} at {f.line}" for f in plan.fallbacks))
    raise InfeasibleError(
        f"the plan ({plan.mesh.label()}) fits memory as priced, but the all-gathers the passes must add to run it "
        f"({ops}) keep {added / 2**30:.1f} GiB more per rank: {peak / 2**30:.1f} GiB, over the "
        f"{cap / 2**30:.1f} GiB usable; pin another layout (--tp / --cp / --pp), or write the op so that its "
        "sharded dim is not cut"
    )


ATTENTION_BLOCKS = frozenset({"core", "attention", "cross_core", "cross"})  # `Layer.node_blocks` of attention


def _replan_around_unshardable_gaps(
    prepared: Prepared,
    plan: Plan,
    cluster: ClusterSpec,
    constraints: Constraints,
    model_path: str,
    progress: Progress = silent,
) -> tuple[Plan, ModelStructure]:
    """(`plan` or a better one, the model's structure with the gaps and MLP activations found replicated)
    when lowering found unplanned all-gathers inside a projection chain's gap (`ModelStructure.chain_gaps`),
    a layer's MLP activation or its attention core: an op there with no sharding rule (a depthwise
    convolution, a cumsum over the sequence, a hand-written q @ k^T) made the TP pass gather the shard
    the plan carried through it. The model is planned again with those parts replicated
    (`ModelStructure.replicated_chain_gaps`, `replicated_mlp_classes`, `replicated_attention_classes`:
    their all-gather becomes a planned S->R conversion the ILP prices and weighs), until no new one
    shows; the faster of the plans, each with its fallbacks priced, is returned. The structure returned
    replicates the chain gaps and MLP activations, not the attention cores: it is what the Megatron
    baseline is priced on (`_lower_baseline`; its column- then row-parallel MLP gathers there too,
    while a baseline with its core replicated would also replicate q/k/v/o and flatter the plan).
    Before, the ILP chose column- then row-parallel around a depthwise Conv1d, the pass gathered at
    the conv, and the report compared the plan with a baseline priced as if the conv could stay
    sharded ("0.74x its speed")."""
    from planner.solver.costing import layer_key  # noqa: PLC0415

    structure = prepared.structure
    best = plan
    for _ in range(len(structure.chain_gaps) + len(structure.layers)):
        # the TP pass's gathers only: the CP pass's whole-sequence ones are not about head or weight splits
        tp_fallbacks = [f for f in plan.fallbacks if not f.context_parallel]
        nodes = {f.node for f in tp_fallbacks}
        gaps = {i for i, gap in structure.chain_gaps.items() if nodes & gap}
        classes: set[str] = set()  # layer classes whose MLP activation the pass gathered in
        cores: set[str] = set()  # ... whose attention core it gathered in
        gathered: dict[str, dict[str, None]] = {}  # ... and there, "op at line" (the exclusion names them)
        for layer in structure.layers:
            blocks = {layer.node_blocks.get(n) for n in nodes}
            if "mlp" in blocks:
                classes.add(layer_key(layer))
            if blocks & ATTENTION_BLOCKS:
                cores.add(layer_key(layer))
                for f in tp_fallbacks:
                    if layer.node_blocks.get(f.node) in ATTENTION_BLOCKS:
                        gathered.setdefault(layer_key(layer), {})[f"{f.op} at {f.line or f.node}"] = None
        if (
            gaps <= structure.replicated_chain_gaps
            and classes <= structure.replicated_mlp_classes
            and cores <= structure.replicated_attention_classes
        ):
            break
        structure = replace(
            structure,
            replicated_chain_gaps=structure.replicated_chain_gaps | gaps,
            replicated_mlp_classes=structure.replicated_mlp_classes | classes,
            replicated_attention_classes=structure.replicated_attention_classes | cores,
            replicated_attention_reasons={
                **{key: "; ".join(found) for key, found in gathered.items()},
                **structure.replicated_attention_reasons,
            },
        )
        progress(
            "planning again with the activations and attention cores the pass cannot shard replicated", None
        )
        again = replace(prepared, structure=structure)
        plan = plan_model(
            structure, cluster, prepared.workload, constraints, model_name=str(model_path), progress=progress
        )
        plan, again = _lower_keeping_whole(again, plan, cluster, constraints, model_path, progress)
        structure = again.structure  # with the weights the pass refused kept whole, if any
        if plan.predicted.latency_s < best.predicted.latency_s:
            best = plan
    return best, replace(
        structure, replicated_attention_classes=prepared.structure.replicated_attention_classes
    )


def _replan_without_cp_gathers(
    prepared: Prepared,
    plan: Plan,
    cluster: ClusterSpec,
    constraints: Constraints,
    model_path: str,
    progress: Progress = silent,
) -> Plan:
    """`plan`, or the plan made again without context parallelism when that one is faster: where the
    CP pass gathers the whole sequence at an op it cannot run on the rank's tokens (a mixture of experts
    flattening (B, T, C) to tokens, `x.view(-1, C)`), the search priced the CP plan without that gather,
    which lowering adds (`Plan.fallbacks`, context_parallel). Mixtral 8x7B at 8 x 32,768 tokens on two
    H100 nodes: CP 2 priced 4.3 s became 12.3 s with the gather, 0.55x the torchtitan recipe's speed,
    where the plan at cp 1 takes 6.7 s. The plan kept lists the other's step in `Plan.excluded`. Not
    with --cp pinned."""
    gathers = [f for f in plan.fallbacks if f.context_parallel]
    if plan.cp == 1 or constraints.cp is not None or not gathers:
        return plan
    progress("planning again without context parallelism (its pass gathers the whole sequence)", None)
    without = replace(constraints, cp=1)
    try:
        again = plan_model(
            prepared.structure,
            cluster,
            prepared.workload,
            without,
            model_name=str(model_path),
            progress=progress,
        )
        again, _ = _lower_keeping_whole(prepared, again, cluster, without, model_path, progress)
    except (InfeasibleError, InputError):
        return plan
    ops = ", ".join(dict.fromkeys(f"{f.op.split(' (')[0]} at {f.line or f.node}" for f in gathers))
    if again.predicted.latency_s < plan.predicted.latency_s:
        again.excluded = list(dict.fromkeys(again.excluded + [
            f"cp={plan.cp}: the CP pass gathers the whole sequence at {ops}; with that gather the best CP plan "
            f"({plan.mesh.label()}) takes {plan.predicted.latency_s:.3f} s a step, this one "
            f"{again.predicted.latency_s:.3f} s"
        ]))  # fmt: skip
        return again
    return plan


def _megatron_layout_note(
    prepared: Prepared,
    structure: ModelStructure,
    plan: Plan,
    cluster: ClusterSpec,
    constraints: Constraints,
    model_path: str,
) -> Plan:
    """`plan` with a "megatron-layout" decision saying whether the hand-written split layout at the
    plan's own TP would run (`BASELINE_WOULD_NOT_RUN` and why, else nothing added), for a plan at TP > 1
    that keeps every weight replicated while its Megatron baseline is at another TP (the model table's
    degree; at the plan's TP `_lower_baseline` lowered that layout): the report's note on `--layout
    megatron` read the baseline's lowering, which said nothing of the plan's TP, and offered a layout
    the passes refuse."""
    if (
        plan.tp == 1
        or plan.baseline_layout.get("tp", str(plan.tp)) == str(plan.tp)
        or any(s.style is not SplitStyle.REPLICATE for s in plan.splits.values())
    ):
        return plan
    pinned = replace(constraints, layout="megatron", tp=plan.tp)
    try:
        layout = plan_model(structure, cluster, prepared.workload, pinned, model_name=str(model_path))
        check_lowering(replace(prepared, structure=structure), replace(layout, recompute={}), cluster)
    except (InfeasibleError, InputError) as e:
        note = Decision("megatron-layout", f"tp={plan.tp}", {}, f"{BASELINE_WOULD_NOT_RUN}: {e}")
        return replace(plan, decisions=[*plan.decisions, note])
    return plan


def _lower_baseline(
    prepared: Prepared,
    structure: ModelStructure,
    plan: Plan,
    cluster: ClusterSpec,
    constraints: Constraints,
    model_path: str,
) -> Plan:
    """`plan` with its Megatron baseline (`Plan.baseline`) priced as it would run: the hand-written
    layout on `structure` (`planner.solver.search.megatron_plan`), lowered for every rank like a plan
    (`check_lowering`), with the all-gathers the TP pass adds to it priced; the "megatron-baseline"
    decision says how many and where. Before, a model with a hand-written q @ k^T attention core was
    compared with a baseline priced as if that core could split by heads ("0.87x its speed"), while
    the pass gathers q and k there. A baseline the passes cannot lower at all keeps its price, and the
    decision says why it would not run. A served request's baseline counts its prefill's memory, as
    the plan's does (`_with_prefill_memory`)."""
    if plan.baseline is None or prepared.graph is None:
        return plan
    expert = megatron_plan(structure, cluster, prepared.workload, constraints, model_name=str(model_path))
    if expert is not None and _split_styles(expert) != _split_styles(plan):
        plan = replace(plan, decisions=_baseline_note(plan.decisions, None, BASELINE_OTHER_SPLITS))
    plan = _baseline_fit(
        replace(
            plan,
            baseline=_with_prefill_memory(plan.baseline, expert, prepared.prefill, cluster, prepared.request),
        ),
        cluster,
        constraints,
    )
    if expert is None or expert.tp == 1:  # no TP pass, nothing to gather
        return plan
    lowered = ("mesh", "splits", "stages", "ladder_layers", "workload", "micro_batches")
    if not plan.fallbacks and all(getattr(expert, f) == getattr(plan, f) for f in lowered):
        return plan  # the layout `plan` lowered without a fallback: its baseline lowers the same way
    try:
        # its recomputation moves no gather (`verify_plan` lowers without it) and may name a layer class
        # a chain model lacks
        expert = check_lowering(
            replace(prepared, structure=structure), replace(expert, recompute={}), cluster
        )
    except InfeasibleError as e:
        return replace(plan, decisions=_baseline_note(plan.decisions, None, f"{BASELINE_WOULD_NOT_RUN}: {e}"))
    note = ""
    if expert.fallbacks:
        ops = ", ".join(dict.fromkeys(f"{f.op} at {f.line or f.node}" for f in expert.fallbacks))
        note = (
            f"priced with the {len(expert.fallbacks)} all-gather(s) the TP pass adds to it "
            f"({sum(f.comm_s + f.compute_s for f in expert.fallbacks) * 1e3:.3g} ms with the ops run whole: {ops})"
        )
    plan = replace(
        plan,
        baseline=_with_prefill_memory(expert.predicted, expert, prepared.prefill, cluster, prepared.request),
        decisions=_baseline_note(plan.decisions, expert.predicted.latency_s, note),
    )
    return _baseline_fit(plan, cluster, constraints)  # its gathers' memory counted


def _split_styles(plan: Plan) -> dict[str, SplitStyle]:
    """The weights `plan` splits, with how (replicated ones left out)."""
    return {w: s.style for w, s in plan.splits.items() if s.style is not SplitStyle.REPLICATE}


def _baseline_fit(plan: Plan, cluster: ClusterSpec, constraints: Constraints) -> Plan:
    """`plan` with its "megatron-baseline" decision saying whether `Plan.baseline`'s peak memory, as
    priced now (a served request's prefill, the gathers the TP pass adds), fits the device
    (`explain.memory_fit_text`: the report's baseline line quotes it)."""
    if plan.baseline is None:
        return plan
    cap = cluster.device.memory_bytes * constraints.memory_fraction
    fit = memory_fit_text(plan.baseline.peak_memory_bytes, cap, cluster.device.memory_bytes)
    decisions = [
        replace(d, reason=with_memory_fit(d.reason, fit)) if d.subject == "megatron-baseline" else d
        for d in plan.decisions
    ]
    return replace(plan, decisions=decisions)


def _baseline_note(decisions: list[Decision], latency_s: float | None, note: str) -> list[Decision]:
    """`decisions` with the "megatron-baseline" one's latency set to `latency_s` (None: kept) and
    `note` appended to its reason."""
    out = []
    for d in decisions:
        if d.subject == "megatron-baseline":
            options = dict(d.options) if latency_s is None else {**d.options, "latency": latency_s}
            d = replace(d, options=options, reason=f"{d.reason}; {note}" if note else d.reason)
        out.append(d)
    return out


def reprice_if_edited(
    plan: Plan, prepared: Prepared, cluster: ClusterSpec, force: bool = False
) -> Plan | None:
    """`plan` priced again on `cluster` when its decisions (splits, mesh, stages, ladder, schedule,
    recompute, ...: `Plan.decisions_digest`) no longer match those it was priced with (`Plan.priced_digest`:
    edited by hand after planning), or when ``force`` (the plan file was edited elsewhere: its
    prediction may have been), else None. The new plan's fallbacks are cleared for `check_lowering`
    to price again; a serving plan's request is priced again too."""
    if not force and not plan.decisions_edited():
        return None
    cluster = priced_cluster(prepared, cluster)
    structure = prepared.structure
    edited = replace(plan, fallbacks=[])
    edited.predicted = plan_prediction(edited, structure, cluster, priced_workload(plan), plan.ladder_layers)
    if plan.serving is not None and prepared.prefill is not None and prepared.request is not None:
        request = prepared.request
        edited.serving = price_request(
            edited,
            prepared.prefill,
            structure,
            cluster,
            prompt_len=request.prompt_len,
            new_tokens=request.new_tokens,
            cache_len=request.cache_len,
            trained_positions=request.trained_positions,
            fallbacks=kv_fallbacks(edited, structure),
        )
        edited.predicted = request_peak_memory(edited, cluster)
    edited = _rebaselined(edited, structure, cluster, priced_workload(plan), prepared)
    edited.priced_digest = edited.decisions_digest()
    return edited


def _with_prefill_memory(
    baseline: Prediction,
    expert: Plan | None,
    prefill: ModelStructure | None,
    cluster: ClusterSpec,
    request: ServingRequest | None,
) -> Prediction:
    """A serving plan's Megatron ``baseline`` with its peak memory the larger of its decode step's and
    its prefill's (``expert``, its plan, priced on the ``prefill`` graph), as `request_peak_memory` does
    for the plan itself, so the two are compared alike."""
    if expert is None or prefill is None or request is None:
        return baseline
    prefill_wl = WorkloadSpec(
        Workload.FORWARD,
        expert.batch_size,
        request.prompt_len,
        dtype=expert.dtype,
        **plan_workload_options(expert),
    )
    peak = plan_prediction(expert, prefill, cluster, prefill_wl, []).peak_memory_bytes
    return replace(baseline, peak_memory_bytes=max(baseline.peak_memory_bytes, peak))


def _rebaselined(
    plan: Plan, structure: ModelStructure, cluster: ClusterSpec, workload: WorkloadSpec, prepared: Prepared
) -> Plan:
    """`plan` with its Megatron baseline and torchtitan recipe priced again for the (edited) job it now
    describes: the hand-written layouts on the plan's devices (`planner.solver.search.baseline_layouts`,
    their layouts in the search's own words); none where no such layout applies. An edit of the
    batch, dtype or request changes the experts' steps too."""
    try:
        megatron, titan = baseline_layouts(
            structure, cluster, workload, Constraints(max_devices=plan.num_devices)
        )
    except (InputError, InfeasibleError):
        megatron, titan = None, None
    kept = [d for d in plan.decisions if d.subject not in ("megatron-baseline", "torchtitan-baseline")]
    cap = cluster.device.memory_bytes * Constraints.memory_fraction
    if titan is not None:
        t, titan_layout = titan
        mesh = MeshShape(*(int(titan_layout[k]) for k in ("tp", "pp", "dp", "cp")))
        fits = memory_fit_text(t.peak_memory_bytes, cap, cluster.device.memory_bytes)
        reason = f"torchtitan's recipe, priced again for the edited plan; {fits}"
        kept = [Decision("torchtitan-baseline", mesh.label(), {"latency": t.latency_s}, reason), *kept]
    plan = replace(
        plan,
        torchtitan_baseline=titan[0] if titan is not None else None,
        torchtitan_layout=titan[1] if titan is not None else {},
    )
    if megatron is None:
        return replace(plan, baseline=None, baseline_layout={}, decisions=kept)
    expert, layout = megatron
    b = expert.predicted
    if plan.serving is not None:
        b = _with_prefill_memory(b, expert, prepared.prefill, cluster, prepared.request)
    fits = memory_fit_text(b.peak_memory_bytes, cap, cluster.device.memory_bytes)
    decision = Decision(
        "megatron-baseline",
        expert.mesh.label(),
        {"latency": b.latency_s},
        f"hand-written Megatron layout, priced again for the edited plan; {fits}",
    )
    return replace(
        plan,
        baseline=b,
        baseline_layout=layout,
        decisions=[decision, *kept],
    )


def priced_cluster(prepared: Prepared, cluster: ClusterSpec, progress: Progress = silent) -> ClusterSpec:
    """`planner.solver.machine.priced_machine` for `prepared`, with the serving loop's own decode step
    (`runtime.decode.host_step_time_s`) as the timer of a served request's host work."""
    from runtime.decode import host_step_time_s  # noqa: PLC0415 - the runtime only when pricing a request here

    return priced_machine(prepared, cluster, progress, host_step_time_s)


def check_lowering(prepared: Prepared, plan: Plan, cluster: ClusterSpec) -> Plan:
    """Lower `plan` for every distinct rank on the meta-device capture (`passes.verify.verify_plan`):
    the plan with the TP pass's unplanned fallbacks priced and listed. Raises InfeasibleError (exit 3)
    naming the op and model line the passes cannot lower as priced."""
    if prepared.graph is None:
        return plan
    return verify_plan(prepared.graph, prepared.structure, plan, cluster)


def cluster_source(name_or_path: str | None, nproc: int | None) -> str:
    """Where `resolve_cluster(name_or_path, nproc)` takes the spec from: a preset name, the YAML
    file's absolute path, or (None) this machine's cached calibration."""
    if not name_or_path:
        return str(CACHE_DIR / f"local-nproc{calibration_nproc(nproc or os.cpu_count() or 1)}.yaml")
    if Path(name_or_path).is_file():
        return str(Path(name_or_path).resolve())
    return name_or_path


def plan_cluster(plan: Plan, nproc: int | None) -> tuple[ClusterSpec, str]:
    """The cluster a saved plan was made for ((spec, "") when its source loads: `Plan.saved_cluster`,
    resized to ``nproc`` ranks, None: as saved) or, when it does not load here, local-cpu with a note
    saying so."""
    spec = plan.saved_cluster(nproc)
    if spec is not None:
        return spec, ""
    where = plan.cluster_source or plan.cluster
    return load_cluster("local-cpu", nproc=nproc), (
        f"the plan's cluster spec ({where}) cannot be loaded here; the plan is checked and its unplanned "
        "all-gathers priced against local-cpu"
    )


def run_plan(
    plan: Plan,
    model_path: str,
    nproc: int,
    iters: int,
    warmup: int,
    timeout_s: float,
    weights: str | None = None,
    progress: Progress = silent,
    min_time_s: float = 0.0,
    speed_probe: bool = False,
) -> dict[str, Any] | None:
    """Execute `plan` on `nproc` local ranks (gloo on CPU, NCCL on GPUs) and summarise the ranks
    (`runtime.session.run_job`: the unsharded reference once, each rank its own shards). `progress`:
    the reference, the ranks' start-up, warm-up and timed iterations.

    weights: a safetensors file or a directory of them (None: seeded random init).
    min_time_s: time at least this many seconds of steps (`runtime.measure.time_iterations`).
    speed_probe: time the calibration's per-node overhead probe beside the steps (`RunJob.speed_probe`;
    `at_run_speed` re-prices the plan with it).
    Under torchrun this process is one rank: rank 0 returns the summary, the other ranks None.

    Raises InputError when nproc != the plan's device count or the weights are missing or bad,
    RunError (exit 4) when a rank fails or the outputs differ from the unsharded model's beyond
    tolerance.
    """
    from passes.checkpoint import checkpoint_files  # noqa: PLC0415 - heavy imports only for --run
    from runtime.job import RunJob  # noqa: PLC0415
    from runtime.session import run_job  # noqa: PLC0415

    if plan.serving is not None:
        return run_serving(
            plan, model_path, nproc, iters, warmup, timeout_s, progress, speed_probe, weights, min_time_s
        )
    if plan.workload is Workload.DECODE:
        raise InputError(
            f"--run of a decode plan needs a model with a static KV cache; {model_path} has none (it was priced "
            "from a formula). Give the model file build_model(max_batch_size, max_seq_len) and "
            "step_inputs(tokens, input_pos) (docs/model-files.md, models with a KV cache)"
        )
    if nproc != plan.num_devices:
        raise InputError(
            f"the plan uses {plan.num_devices} devices (tp={plan.tp} x pp={plan.pp} x dp={plan.dp}) but --nproc is {nproc}; "
            f"re-plan for this machine: planner optimize {model_path} --nproc {nproc} (this machine's measured "
            "spec; or add --run --scale-to-local to an optimize command)"
        )
    workload = str(Workload.TRAIN if plan.workload is Workload.TRAIN else Workload.FORWARD)
    job = RunJob(
        model_path=str(model_path),
        plan=plan.to_dict(),
        batch_size=plan.batch_size,
        seq_len=plan.seq_len,
        workload=workload,
        warmup=warmup,
        iters=iters,
        min_time_s=min_time_s,
        profile_layers=plan.pp == 1 and workload == "forward",
        weights=checkpoint_files(weights) if weights else None,
        speed_probe=speed_probe,
    )
    return run_job(job, nproc, timeout_s, progress)


def run_serving(
    plan: Plan,
    model_path: str,
    nproc: int,
    iters: int,
    warmup: int,
    timeout_s: float,
    progress: Progress = silent,
    speed_probe: bool = False,
    weights: str | None = None,
    min_time_s: float = 0.0,
) -> dict[str, Any] | None:
    """Serve `plan.serving`'s request on `nproc` local ranks: prefill, then greedy decode steps
    (`runtime.decode`); `warmup` untimed then `iters` timed requests, more until `min_time_s` seconds
    of them (`--min-time`) (`speed_probe`: the speed probe
    timed between the decode steps, as `run_plan`'s between its samples; `weights`: a safetensors file
    or folder of the model's parameters, None: seeded random init). Returns the summary (None on
    ranks other than 0 under torchrun). Raises InputError for pp > 1, dp > 1 or a wrong nproc,
    RunError (exit 4) when a rank fails or the tokens / logits differ from the unsharded model's."""
    from passes.checkpoint import checkpoint_files  # noqa: PLC0415 - only for --run
    from runtime.decode import (  # noqa: PLC0415 - only for --run
        DecodeJob,
        run_decode_rank,
        summarise_decode,
        write_decode_reference,
    )
    from runtime.launch import launch, under_torchrun  # noqa: PLC0415

    sv = plan.serving
    assert sv is not None
    if plan.pp > 1 or plan.dp > 1:
        raise InputError(
            f"--run serves decode plans with tensor parallelism only; the plan has {plan.mesh.label()}: "
            "re-plan with --pp 1 --dp 1 (or --devices to the TP degree)"
        )
    if nproc != plan.num_devices:
        raise InputError(f"the plan uses {plan.num_devices} devices (tp={plan.tp}) but --nproc is {nproc}")
    if sv.trained_positions and sv.prompt_len + sv.new_tokens > sv.trained_positions:
        # a learned position table has no row past it (GPT-2's wpe: an IndexError in the reference);
        # served as vLLM serves, within --max-model-len = the config's context
        raise InputError(
            f"--run serves the request within the {sv.trained_positions} positions the model's config gives "
            f"its context (as vLLM's --max-model-len), and prompt {sv.prompt_len} + {sv.new_tokens} new tokens "
            f"reach {sv.prompt_len + sv.new_tokens}: lower --context / --seq-len or --new-tokens (planning "
            "alone prices it, with a warning)"
        )
    job = DecodeJob(
        model_path=str(model_path),
        plan=plan.to_dict(),
        batch_size=plan.batch_size,
        prompt_len=sv.prompt_len,
        new_tokens=sv.new_tokens,
        cache_len=sv.cache_len,
        warmup=max(1, warmup),
        iters=max(1, iters),
        speed_probe=speed_probe,
        weights=checkpoint_files(weights) if weights else None,
        min_time_s=min_time_s,
    )
    if not under_torchrun():  # under torchrun there is no launching process: the ranks make it
        directory = tempfile.mkdtemp(prefix="planner-decode-reference-")
        try:
            progress("generating with the unsharded model once (the reference)", None)
            job.reference = write_decode_reference(job, directory)
            reports = launch(run_decode_rank, job, nproc=nproc, timeout_s=timeout_s, progress=progress)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    else:
        reports = launch(run_decode_rank, job, nproc=nproc, timeout_s=timeout_s)
    if any(r is None for r in reports):
        return None
    run = summarise_decode(reports, plan.dtype, plan.batch_size, sv.new_tokens)
    n = run["numerics"]
    if not n["ok"]:
        raise RunError(
            f"the sharded model does not match the unsharded one (every step on the unsharded model's "
            f"tokens): max |logit diff| {n['max_abs_diff']:.3g} (tolerance {n['logit_tolerance']:.3g}); "
            f"{n['tokens_differ']} greedy tokens differ"
            + (
                f", the largest {n['max_choice_gap']:.3g} apart in the reference's logits"
                if n["tokens_differ"]
                else ""
            )
            + (
                f"; the routers' logits differ by {n['routing_logit_diff']:.3g} (tolerance "
                f"{n['routing_tolerance']:.3g}): the replayed expert choices would hide a wrong router"
                if n.get("routing_calls") and n["routing_logit_diff"] > n["routing_tolerance"]
                else ""
            )
            + ("; the ranks chose different tokens" if not n.get("ranks_agree", True) else "")
            + f"; tokens {n['tokens']} vs reference {n['reference_tokens']}",
            run=run,
        )
    return run


def report_dict(
    plan: Plan,
    run: dict[str, Any] | None,
    model_path: str,
    cluster: ClusterSpec | None,
    structure: ModelStructure | None = None,
    written_by: str = "planner optimize --json",
) -> dict[str, Any]:
    """The JSON report: plan, predicted, baseline, solver, and with a run measured and numerics (and,
    given the model's `structure` and a speed-probed run, the prediction at the run's speed:
    `at_run_speed`). ``written_by``: the command that writes it ("planner run --json" for a saved
    plan's run), the report's first key."""
    p = plan.predicted
    report: dict[str, Any] = {
        "written_by": written_by,  # first: `planner.files.written_kind` reads it
        "model": str(model_path),
        "cluster": plan.cluster or (cluster.name if cluster is not None else ""),
        "cluster_source": plan.cluster_source,
        "workload": str(plan.workload),
        "plan": {
            **plan.layout_summary(),
            "batch_size": plan.batch_size,
            "seq_len": plan.seq_len,
            "dtype": plan.dtype,
            "ladder_layers": list(plan.ladder_layers),
            "stages": [list(s) for s in plan.stages],
            "splits": {k: str(v.style) for k, v in plan.splits.items()},
        },
        "predicted": {
            "latency_s": p.latency_s,
            "throughput_tokens_per_s": p.throughput_tokens_per_s,
            "peak_memory_bytes": p.peak_memory_bytes,
            "compute_s": p.compute_s,
            "exposed_comm_s": p.exposed_comm_s,
            "overlapped_comm_s": p.overlapped_comm_s,
            "bubble_s": p.bubble_s,
            "serving_host_s": p.serving_host_s,
        },
        "baseline": {
            "latency_s": plan.baseline.latency_s if plan.baseline else None,
            "peak_memory_bytes": plan.baseline.peak_memory_bytes if plan.baseline else None,
            "speedup": (plan.baseline.latency_s / p.latency_s) if plan.baseline and p.latency_s else None,
        },
        "torchtitan_baseline": {
            "latency_s": plan.torchtitan_baseline.latency_s if plan.torchtitan_baseline else None,
            "peak_memory_bytes": plan.torchtitan_baseline.peak_memory_bytes
            if plan.torchtitan_baseline
            else None,
            "speedup": (plan.torchtitan_baseline.latency_s / p.latency_s)
            if plan.torchtitan_baseline and p.latency_s
            else None,
            "layout": dict(plan.torchtitan_layout),
        },
        "solver": {
            "status": plan.solver.status,
            "objective": plan.solver.objective,
            "gap": plan.solver.gap,
            "time_s": plan.solver.time_s,
            "num_variables": plan.solver.num_variables,
        },
        "excluded": list(plan.excluded),
        "op_placement": dict(plan.op_placement),
        "fallbacks": [
            {
                "op": f.op,
                "line": f.line,
                "bytes_gathered": f.bytes_gathered,
                "comm_s": f.comm_s,
                "places": f.places,
                "memory_bytes": f.memory_bytes,
                "compute_s": f.compute_s,
            }
            for f in plan.fallbacks
        ],
    }
    if plan.serving is not None:
        report["serving"] = {"predicted": serving_dict(plan.serving, plan.batch_size)}
    if run is not None and plan.serving is not None:
        report["serving"]["measured"] = {
            k: run["measured"].get(k)
            for k in ("ttft_s", "tpot_s", "request_s", "tokens_per_s", "standard_tpot_s")
        }
        if run["measured"].get("standard_tpot_s"):
            report["serving"]["measured"]["ladder_speedup"] = run["measured"]["ladder_speedup"]
    if run is not None:
        report["measured"] = run["measured"]
        report["numerics"] = run["numerics"]
        if "ranks" in run:  # every rank's own report (docs/report.md)
            report["ranks"] = run["ranks"]
        measured = run["measured"]["latency_s"]
        report["measured"]["predicted_over_measured"] = p.latency_s / measured if measured else None
        report["measured"]["measured_over_predicted"] = measured / p.latency_s if p.latency_s else None
        report["measured"]["at_run_speed"] = (
            at_run_speed(plan, structure, cluster, run) if cluster is not None else None
        )
    return report


def serving_dict(serving: Serving, batch_size: int) -> dict[str, Any]:
    """A request's figures as serving benchmarks report them (seconds, tokens/s)."""
    return {
        "prompt_len": serving.prompt_len,
        "new_tokens": serving.new_tokens,
        "cache_len": serving.cache_len,
        "batch_size": batch_size,
        "ttft_s": serving.ttft_s,
        "tpot_s": serving.tpot_s,
        "request_s": serving.request_s,
        "tokens_per_s": serving.tokens_per_s,
        "fallbacks": list(serving.fallbacks),
        "standard_tpot_s": serving.standard_tpot_s,
        "ladder_speedup": serving.standard_tpot_s / serving.tpot_s if serving.standard_tpot_s else None,
    }


def known_clusters() -> str:
    """Preset names, for messages."""
    return ", ".join(preset_names())

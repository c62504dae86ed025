"""Capture a model as one normalised ATen-level `torch.fx.GraphModule`.

Decision: every model, hand-written or Hugging Face, goes through
`torch.export.export(model, args, kwargs, strict=False).module()`, then the normalisation below.
Why: `torch.fx.symbolic_trace` fails on every HF model (control flow on shapes, `ModelOutput`,
cache objects) and records module calls rather than ops; strict export (TorchDynamo) rejects much
ordinary Python; non-strict export runs the real Python with fake tensors, so it handles both kinds
of model, works on the meta device (a Llama-3-70B config traces in seconds) and produces one graph
form (ATen ops, `node.meta["val"]` on every node). The price: shapes in the graph are literals
(`aten.view(x, [2, 16, 4, 32])`), which the tensor-parallel pass rewrites per rank.

Guarantees of the returned graph (docs/ARCHITECTURE.md):

- parameters and buffers are `get_attr` nodes whose `target` is the FQN in the original model
  (`model.layers.0.self_attn.q_proj.weight`); a tied weight appears once, under one of its names
  (GPT-2: `lm_head.weight` feeds both the token embedding and the LM head);
- every node has `node.meta["module_path"]`: the innermost module FQN as in
  `model.named_modules(remove_duplicate=False)` (a block object listed twice in a ModuleList,
  `[b0, b1, b2, b0]`, has a path per call: `layers.0`, `layers.3`), "" for the top level (for `get_attr`: the module owning the tensor); every tensor node has
  `node.meta["val"]` (a FakeTensor with the global shape and dtype);
- removed: the input guard module, `aten._assert_*` nodes, no-op `aten.to` (same dtype and device)
  and `aten.dropout` in eval mode / with p = 0; rewritten: `x @ W.T` of a 2-D parameter (matmul,
  mm or addmm of its transpose) as `aten.linear(x, W)` (the same product) and any other
  `aten.numpy_T` as the `aten.permute` reversing the dims, which the passes have rules for; an einsum
  of an activation and a 2-D parameter that is a plain projection as `aten.linear(x, W)` (an (out x
  in) W, `"bsd,fd->bsf"`) or `aten.matmul(x, W)` (an (in x out) W, `"bsd,df->bsf"`);
- inputs: one placeholder per tensor leaf of `(args, kwargs)` in pytree order (non-tensor inputs such
  as `use_cache=False` are baked in); call it as `gm(*flat_inputs(args, kwargs))`;
- output form: the tensor leaves of the model's output, with a `logits` field first when the output
  is a mapping / HF `ModelOutput` (None fields dropped). If there is exactly one leaf, the graph
  returns that tensor itself (the output node's arg is a Node), otherwise a tuple of tensors.
  `flatten_output(eager_output)` gives the eager model's output in the same form.

`input_batch_dims(make_inputs, batch_size)` says which dim of each input is the batch (or that it has
none), from the example inputs made at two batch sizes: what DP and micro-batching may split.

Errors: a model that cannot be captured raises `InputError` naming the op, the line of the user's
code that was running (first traceback frame outside torch / transformers / the standard library)
and the usual fixes.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import io
import logging
import operator
import os
import re
import sys
import sysconfig
import textwrap
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from planner.errors import InputError
from planner.frontend import capture_cache
from planner.frontend.fresh_writes import functionalize_fresh_writes
from planner.frontend.modelfile import defined_at
from planner.frontend.per_head_norms import merge_per_head_norms

_ASSERT_TARGETS = {
    "aten._assert_tensor_metadata",
    "aten._assert_scalar",
    "aten._assert_async",
    "aten.sym_constrain_range",
    "aten.sym_constrain_range_for_size",
    "aten._functional_assert_async",
    "aten._functional_sym_constrain_range",
}

_FIXES = (
    "Usual fixes: avoid Python control flow on tensor values (`if x.sum() > 0:`, `.item()`, `.tolist()`; "
    "use torch.where instead); return tensors (or tuples / dicts of tensors) from forward; "
    "for Hugging Face models pass use_cache=False (example_kwargs() -> {'use_cache': False})."
)


# an error about shapes: the inputs do not fit the model (or a plan for another model was given)
_SHAPE_ERROR = re.compile(
    r"same reduction dim|size mismatch|cannot be multiplied|mat1 and mat2|size of tensor a|"
    r"to broadcast|is invalid for input of size|expected input\[|channels, but got",
    re.IGNORECASE,
)
_SHAPE_FIXES = (
    "The example inputs do not fit the model: check the shapes example_inputs() returns against the "
    "model's first layers (and, with `planner run`, that the plan was made for this model file)."
)
# a tensor made in forward on the default device (torch.arange(T)) met the model's: the planner builds
# the model on the meta device, so it must be made where its inputs are
_DEVICE_ERROR = re.compile(
    r"DeviceMismatch|devices?, but found|on different devices|Unhandled FakeTensor Device", re.I
)
_DEVICE_FIXES = (
    "A tensor created in forward is on another device than the model: the planner builds the model on "
    "the meta device (and a run on its rank's device), so make it where the inputs are, e.g. "
    "torch.arange(T, device=x.device) or torch.zeros(..., device=x.device), or register it as a buffer."
)

# tensors of two floating dtypes met in one op: the model's own code mixes them (a float32 RoPE table or
# mask beside activations cast to bf16 / fp16), which fails the same way when it runs eagerly
_DTYPE_ERROR = re.compile(
    r"expected scalar type|same dtype|dtype mismatch|expected .* dtype .* but got",
    re.IGNORECASE,
)
_DTYPE_FIXES = (
    "Tensors of two dtypes meet at that line of the model's own code: the model fails so in this dtype "
    "when it runs without the planner too (a float32 buffer or table, e.g. RoPE's cos / sin or a mask, "
    "beside activations cast to bf16 / fp16). Cast it to the activations' dtype there (.to(x.dtype)), "
    "or plan in the dtype the model runs in (--dtype fp32)."
)


def _positions_given(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether position ids may reach a Hugging Face model from outside it: anything but a transformers
    model called with its input ids alone (a wrapper of the model file's own may compute and pass them,
    e.g. packing documents)."""
    own = type(model).__module__.startswith("transformers.")
    return not own or len(args) > 1 or "position_ids" in kwargs


@contextlib.contextmanager
def _hf_mask_skip(positions_given: bool) -> Iterator[None]:
    """While exporting, let Hugging Face models hand SDPA `is_causal` (or no mask, bidirectional) instead
    of an explicit (T, T) mask where transformers does so in eager mode: no padding mask given and the
    queries as long as the keys (`transformers.masking_utils._ignore_causal_mask_sdpa`, which refuses
    under `torch.export` because an exported graph may later run at another query length, pytorch#108108;
    the planner captures at the shapes it runs, and the decode graph on its own). The mask cost
    O(T^2) memory and time in every run (16 GiB of bool at 128k tokens), kept SDPA off its flash
    kernels, and kept context parallelism from models past 8k tokens (its causal check evaluates it).
    Where no position ids reach the model (``positions_given`` false, `_positions_given`: transformers
    counts them with an arange), their check for packed sequences, which a trace cannot read, is
    skipped too: nothing is packed. The run checks the capture against the model (`runtime.reference.check_capture`)."""
    masking = sys.modules.get("transformers.masking_utils")
    exporting = getattr(masking, "is_torchdynamo_exporting", None)
    packed = getattr(masking, "find_packed_sequence_indices", None)
    if exporting is None:
        yield
        return
    masking.is_torchdynamo_exporting = lambda: False
    if packed is not None and not positions_given:
        masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.is_torchdynamo_exporting = exporting
        if packed is not None:
            masking.find_packed_sequence_indices = packed


def capture(model: nn.Module, args: tuple, kwargs: dict | None = None) -> fx.GraphModule:
    """Export `model(*args, **kwargs)` and normalise the graph (see the module docstring).

    Tensor inputs are moved to the device of the model's parameters first (so meta-device models
    take CPU example inputs). A model captured before at the same shapes (in this process, or in one
    sharing PLANNER_CAPTURE_CACHE_DIR) is not exported again: the graph is that capture's, rebuilt and
    bound to `model`'s own parameters and buffers (`capture_cache`). Raises InputError when the model
    cannot be captured.
    """
    kwargs = dict(kwargs or {})
    _check_forward_accepts(model, tuple(args), kwargs)
    key = capture_cache.cache_key(model, tuple(args), kwargs)
    if (hit := capture_cache.lookup(key, model)) is not None:  # this model at these shapes, captured before
        sys.stdout.write(hit.stdout)
        sys.stderr.write(hit.stderr)
        _replay_unlift_warnings(hit.warned)
        return hit.gm
    args, kwargs = _inputs_on_model_device(model, tuple(args), kwargs)
    # On failure export logs a warning and prints the partial graph to stderr; we report one message
    # instead (the partial graph still names the failing op in it). On success stderr is replayed.
    # torch's fake-tensor logger prints the failing op's whole traceback (E-lines) on its own handler:
    # muted while exporting, its text kept for the message
    shapes_logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    fake_logger = logging.getLogger("torch._subclasses.fake_tensor")
    levels = shapes_logger.level, fake_logger.handlers, fake_logger.propagate
    shapes_logger.setLevel(logging.ERROR)
    stderr, stdout = io.StringIO(), io.StringIO()  # stdout: the model's own prints, replayed on a hit
    fake_logger.handlers = [logging.StreamHandler(stderr)]
    fake_logger.propagate = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with (
                contextlib.redirect_stderr(stderr),
                contextlib.redirect_stdout(stdout),
                _hf_mask_skip(positions_given=_positions_given(model, args, kwargs)),
                _tensor_attributes_kept(model),
            ):
                exported = torch.export.export(model, args, kwargs, strict=False)
        except Exception as e:  # export raises many types; all mean "this model does not trace"
            raise InputError(_capture_error_message(model, e, stderr.getvalue())) from e
        except SystemExit as e:  # the model's forward called sys.exit(): an error, not the planner's exit
            frame = _user_frame(model, e)
            where = f" at {frame.filename}:{frame.lineno}" if frame is not None else ""
            raise InputError(
                f"{type(model).__name__}.forward called sys.exit({e.code!r}){where} while the planner traced it; "
                "a model's forward must return its outputs (raise an exception to refuse an input)"
            ) from e
        finally:
            sys.stdout.write(stdout.getvalue())
            shapes_logger.setLevel(levels[0])
            fake_logger.handlers = levels[1]
            fake_logger.propagate = levels[2]
        gm = exported.module()
    sys.stderr.write(stderr.getvalue())
    _replay_unlift_warnings(caught)
    out_spec = gm._out_spec
    module_names = {name for name, _ in model.named_modules(remove_duplicate=False)}
    gm = _normalise(gm, out_spec, module_names)
    _refuse_unplannable(gm, model)
    capture_cache.store(key, gm, model, stdout.getvalue(), stderr.getvalue(), caught)
    return gm


@contextlib.contextmanager
def _tensor_attributes_kept(model: nn.Module) -> Iterator[None]:
    """Within, `model`'s modules keep their plain tensor attributes: one a forward sets while torch.export
    traces it (non-strict export runs the forward on fake tensors) is set back, or deleted if new.
    Hugging Face's LongRoPE (Phi-3 128k) caches `long_inv_freq` on its rotary module in the first forward:
    traced, the cache was a FakeTensor, and every later eager forward picked its frequencies from it, so
    the model computed other values than its graph (0.028 at a logit scale of 1.06)."""
    before = {
        mod: {k: v for k, v in vars(mod).items() if isinstance(v, torch.Tensor)} for mod in model.modules()
    }
    try:
        yield
    finally:
        for mod, kept in before.items():
            for k, v in list(vars(mod).items()):
                if isinstance(v, torch.Tensor) and kept.get(k) is not v:
                    if k in kept:
                        mod.__dict__[k] = kept[k]
                    else:
                        del mod.__dict__[k]


def _check_forward_accepts(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """InputError naming the model's forward (file:line) when it cannot take `args` / `kwargs` (the
    model file's example_inputs() / example_kwargs()): torch.export would fail deep inside with no
    line of the user's."""
    forward = getattr(model, "forward", None)
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        where = f" ({line})" if (line := defined_at(forward)) is not None else ""
        names = ", ".join(signature.parameters) or "none"
        unknown = [k for k in kwargs if k not in signature.parameters]
        source = (
            f"example_kwargs() gives {', '.join(map(repr, unknown))}, "
            if unknown and not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
            else ""
        )
        raise InputError(
            f"{type(model).__name__}.forward{where} cannot take the model file's example inputs ({e}): "
            f"{source}forward's parameters are {names}; make example_inputs() return its positional "
            "arguments and example_kwargs() only keywords forward takes"
        ) from None


# torch.export's unlifting warns once per tensor attribute that requires grad but is not a parameter
# (Hugging Face's static-cache export wrapper has one per attention layer): said once per process, as one line
_LIFTED_CONSTANT = re.compile(r"A model attribute `(.+?)` requires gradient")
# torch.export's note on a tensor attribute the forward set while traced (LongRoPE's cache)
_ASSIGNED_IN_EXPORT = re.compile(r"tensor attributes? .+ (?:was|were) assigned during export")
_lifted_said = False
_lifted_quiet: contextvars.ContextVar[bool] = contextvars.ContextVar("lifted_quiet", default=False)


@contextlib.contextmanager
def lifted_constants_quiet(quiet: bool = True) -> Iterator[None]:
    """Within (when `quiet`), captures do not say that torch.export kept tensor attributes that require
    grad as constants: for a workload that trains nothing (forward, decode, generate) it does not matter,
    and the attributes are often a wrapper's (transformers' static-cache export wrapper), not the user's."""
    token = _lifted_quiet.set(quiet)
    try:
        yield
    finally:
        _lifted_quiet.reset(token)


def _replay_unlift_warnings(caught: list[warnings.WarningMessage]) -> None:
    global _lifted_said  # noqa: PLW0603 - once per process
    lifted = []
    for w in caught:
        found = _LIFTED_CONSTANT.search(str(w.message))
        if found:
            lifted.append(found.group(1))
        elif _ASSIGNED_IN_EXPORT.search(str(w.message)):
            continue  # set back after the capture (`_tensor_attributes_kept`): nothing for the user to do
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    # a rank process (RANK set by the launcher or torchrun) stays quiet: the process that planned or
    # launched the run captured the same model and said it
    if lifted and not _lifted_said and not _lifted_quiet.get() and "RANK" not in os.environ:
        _lifted_said = True
        warnings.warn(
            f"torch.export keeps {len(set(lifted))} tensor attribute(s) that require grad but are not parameters as "
            f"constants without gradient (e.g. {lifted[0]}); register them as parameters if they must train",
            stacklevel=3,
        )


def flat_inputs(args: tuple, kwargs: dict | None = None) -> tuple[torch.Tensor, ...]:
    """The positional inputs of a captured graph: tensor leaves of (args, kwargs) in pytree order."""
    leaves = pytree.tree_leaves((tuple(args), dict(kwargs or {})))
    return tuple(x for x in leaves if isinstance(x, torch.Tensor))


def flatten_output(output: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """An eager model's output in the captured graph's output form (logits first, one tensor bare)."""
    leaves, spec = pytree.tree_flatten(output)
    order = _output_order(spec)
    tensors = [leaves[i] for i in order if isinstance(leaves[i], torch.Tensor)]
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def retarget_device(gm: fx.GraphModule, device: torch.device | str) -> fx.GraphModule:
    """Rewrite literal `device=` arguments (aten.arange, aten.to, ...) to `device`, in place.

    The captured graph records the capture device in factory ops; call this before running a graph
    captured on the CPU or meta device somewhere else. The graphs of its submodules are rewritten too
    (`passes.recompute`'s regions hold a layer's nodes, its masks' and positions' factory ops among
    them). Returns `gm` (recompiled).
    """
    device = torch.device(device)
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            if isinstance(node.kwargs.get("device"), torch.device):
                node.kwargs = {**node.kwargs, "device": device}
            node.args = tuple(device if isinstance(a, torch.device) else a for a in node.args)
        module.recompile()
    return gm


# ------------------------------------------------------------------------------------------ inputs


def input_batch_dims(
    make_inputs: Callable[[int], tuple[tuple, dict]], batch_size: int
) -> tuple[int | None, ...]:
    """The batch dim of every graph input (tensor leaf of `(args, kwargs)`, in `flat_inputs` order),
    or None for an input whose shape does not depend on the batch (a (T, T) attention bias, RoPE
    tables, HF `position_ids` of shape (1, T)).

    make_inputs(b) -> (args, kwargs): the model's example inputs at batch size b (a model file's
    `example_inputs`). They are made at `batch_size` and at twice it: the batch dim of an input is the
    one dim whose size doubles (a flattened (B*T,) input counts); every other dim must stay the same.
    This is what data parallelism and pipeline micro-batching split; an input without one is given
    whole to every replica and micro-batch. Only shapes are read (meta tensors are fine).

    Raises InputError naming the input when the inputs change structure with the batch, when more
    than one dim of an input grows with it, or when a dim changes but not in proportion.
    """
    if batch_size < 1:
        raise InputError(f"batch size must be >= 1 to find the inputs' batch dims, got {batch_size}")
    base = flat_inputs(*make_inputs(batch_size))
    probe = flat_inputs(*make_inputs(2 * batch_size))
    if len(base) != len(probe):
        raise InputError(
            f"the example inputs have {len(base)} tensors at batch size {batch_size} but {len(probe)} at "
            f"{2 * batch_size}; the number of tensor inputs must not depend on the batch size"
        )
    dims: list[int | None] = []
    for i, (x, y) in enumerate(zip(base, probe)):
        shape, grown = tuple(x.shape), tuple(y.shape)
        changed = [d for d in range(len(shape)) if len(shape) == len(grown) and shape[d] != grown[d]]
        batch = [d for d in changed if grown[d] == 2 * shape[d]]
        if len(shape) != len(grown) or len(changed) > 1 or changed != batch:
            raise InputError(
                f"input {i} has shape {shape} at batch size {batch_size} and {grown} at {2 * batch_size}: "
                "an input's batch dim must be the one dim that grows in proportion to the batch size "
                "(or none), so that data parallelism and micro-batching can split it"
            )
        dims.append(batch[0] if batch else None)
    return tuple(dims)


def _inputs_on_model_device(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    tensor = next(iter(model.parameters()), None)
    if tensor is None:
        tensor = next(iter(model.buffers()), None)
    if tensor is None:
        return args, kwargs
    device = tensor.device

    def move(x: Any) -> Any:
        return x.to(device) if isinstance(x, torch.Tensor) and x.device != device else x

    return pytree.tree_map(move, (args, kwargs))


# ----------------------------------------------------------------------------------- normalisation


def _normalise(gm: fx.GraphModule, out_spec: pytree.TreeSpec, module_names: set[str]) -> fx.GraphModule:
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
        elif node.op == "call_function" and op_name(node.target) in _ASSERT_TARGETS and not node.users:
            graph.erase_node(node)
    for node in list(graph.nodes):
        if _is_noop(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    functionalize_fresh_writes(graph)
    merge_per_head_norms(graph)  # StableLM-2's per-head q/k LayerNorms: one norm over the heads
    for node in graph.nodes:
        _as_linear(node)
        if node.op == "call_function" and node.target is torch.ops.aten.numpy_T.default:
            node.target = torch.ops.aten.permute.default  # `W.T`: the permute reversing the dims
            node.args = (node.args[0], list(range(node.args[0].meta["val"].dim() - 1, -1, -1)))
    graph.eliminate_dead_code()
    _flatten_output_node(graph, out_spec)
    for node in list(graph.nodes):
        if node.op == "placeholder" and not node.users and not isinstance(node.meta.get("val"), torch.Tensor):
            graph.erase_node(node)
        elif node.op == "placeholder" and not isinstance(node.meta.get("val"), torch.Tensor):
            raise InputError(
                f"the non-tensor model input {node.target!r} is used as a value in the graph; "
                "make it a constant of the model or pass it as a tensor"
            )
    graph.eliminate_dead_code()
    for node in graph.nodes:
        node.meta["module_path"] = _module_path(node, module_names)
    graph._codegen = fx.graph.CodeGen()  # plain positional inputs, no pytree (un)flattening
    graph.lint()
    return fx.GraphModule(gm, graph, class_name="CapturedModel")  # compiles forward from the graph


def is_transpose_2d(node: fx.Node) -> bool:
    """aten.t / numpy_T / transpose(0, 1) / permute([1, 0]) of a 2-D tensor."""
    name = op_name(node.target)
    if name in ("aten.t", "aten.numpy_T"):
        return True
    if name == "aten.transpose":
        return sorted(d % 2 for d in node.args[1:3]) == [0, 1]
    return name == "aten.permute" and [d % 2 for d in node.args[1]] == [1, 0]


def uncast(x: Any) -> Any:
    """The value behind dtype casts of it (`_to_copy` with only a dtype, `Tensor.to(dtype)`), else `x`:
    DeepSeek-V3's router computes its logits in fp32, `F.linear(x.type(torch.float32),
    self.weight.type(torch.float32))`, casts an fp32 capture drops as no-ops and a bf16 one keeps."""
    while (
        isinstance(x, fx.Node)
        and x.op == "call_function"
        and (
            (x.target is torch.ops.aten._to_copy.default and len(x.args) == 1 and set(x.kwargs) <= {"dtype"})
            or (x.target is torch.ops.aten.to.dtype and len(x.args) == 2 and not x.kwargs)
        )
    ):
        x = x.args[0]
    return x


def _as_linear(node: fx.Node) -> None:
    """Write `x @ W.T` with W a 2-D parameter or buffer (`aten.matmul` / `aten.mm` of a transposed
    `get_attr`; `aten.addmm(b, x, W.T)` at beta = alpha = 1) as `aten.linear(x, W[, b])`, the same
    product: Falcon's `FalconLinear` (`input @ self.weight.T`) and code like it then meet the
    tensor-parallel pass's column- and row-parallel rules as an nn.Linear does."""
    if node.op != "call_function" or node.kwargs:
        return
    name = op_name(node.target)
    if name == "aten.einsum":
        _einsum_as_product(node)
        return
    if name not in ("aten.matmul", "aten.mm", "aten.addmm") or len(node.args) != (
        3 if name == "aten.addmm" else 2
    ):
        return
    wt = node.args[-1]
    if not (isinstance(wt, fx.Node) and wt.op == "call_function" and is_transpose_2d(wt)):
        return
    w = wt.args[0]
    if not (isinstance(w, fx.Node) and w.op == "get_attr" and w.meta["val"].dim() == 2):
        return
    x = node.args[-2]
    node.target = torch.ops.aten.linear.default
    node.args = (x, w, node.args[0]) if name == "aten.addmm" else (x, w)


def einsum_terms(node: fx.Node) -> tuple[list[str], str] | None:
    """An `aten.einsum` node's equation as (each operand's letters, the output's letters), spaces
    dropped; None for an equation with an ellipsis or without an explicit output (`"ij,jk"`)."""
    equation = str(node.args[0]).replace(" ", "")
    if "->" not in equation or "..." in equation:
        return None
    inputs, out = equation.split("->")
    return inputs.split(","), out


def _einsum_as_product(node: fx.Node) -> None:
    """Write an einsum of an activation and a 2-D parameter that is a plain projection as the product
    it is, so that the analysis reads a projection and the tensor-parallel pass splits it: an (out x
    in) weight, `einsum("bsd,fd->bsf", x, W)`, as an nn.Linear's `aten.linear(x, W)`; an (in x out)
    one, `einsum("bsd,df->bsf", x, W)`, as `aten.matmul(x, W)` (`x @ W`). Other einsums stay."""
    if len(node.args) != 2 or len(node.args[1]) != 2:
        return
    x, w = node.args[1]
    if not (isinstance(w, fx.Node) and w.op == "get_attr" and w.meta["val"].dim() == 2):
        return
    terms = einsum_terms(node)
    if terms is None:
        return
    (xs, ws), out = terms
    if len(ws) != 2 or len(set(xs)) != len(xs) or ws[0] == ws[1] or not xs:
        return
    batch, k = xs[:-1], xs[-1]
    if k not in ws:
        return
    n = ws[1 - ws.index(k)]
    if n in xs or out != batch + n:
        return
    if ws[1] == k:
        node.target, node.args = torch.ops.aten.linear.default, (x, w)
    elif batch:
        node.target, node.args = torch.ops.aten.matmul.default, (x, w)


def user_line(node: fx.Node) -> str:
    """Where `node` comes from in the user's model: 'model.py:39 `gate, up = self.w13(x).chunk(2, dim=-1)`'
    (the innermost frame of the capture's stack trace outside torch itself: an nn.Conv1d's op is named
    at the model line that calls the module, not in torch/nn/modules/conv.py), or '' when the capture
    recorded none."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', trace)
    if not frames:
        return ""
    outside = [f for f in frames if not os.path.abspath(f[0]).startswith(_TORCH_DIR)]
    path, line, code = (outside or frames)[-1]
    return f"{os.path.basename(path)}:{line} `{code.strip()}`"


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def op_name(target: Any) -> str:
    """'aten.linear' for torch.ops.aten.linear.default, 'getitem' for operator.getitem, else ''."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    if target is operator.getitem:
        return "getitem"
    return ""


def bound_arguments(node: fx.Node) -> dict[str, Any]:
    """The arguments of an aten op node by schema name, defaults filled in (an argument without a
    default and not given is None): {"query": q, "key": k, ..., "dropout_p": 0.0, "is_causal": False}
    for aten.scaled_dot_product_attention. Raises TypeError for a node whose target is no OpOverload."""
    if not isinstance(node.target, torch._ops.OpOverload):
        raise TypeError(f"bound_arguments: {node.name!r} does not call an aten op")
    schema = node.target._schema
    bound = {a.name: a.default_value if a.has_default_value() else None for a in schema.arguments}
    for arg, value in zip(schema.arguments, node.args):
        bound[arg.name] = value
    bound.update(node.kwargs)
    return bound


def _is_noop(node: fx.Node) -> bool:
    """aten.to / aten.type_as that change nothing, or dropout that is the identity."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    name = op_name(node.target)
    if name == "aten.dropout":
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return p == 0 or not train
    if name == "aten.type_as":
        src, dst = node.args[0].meta.get("val"), node.meta.get("val")
        return isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.dtype == dst.dtype
    if name in ("aten.to", "aten._to_copy"):
        src, dst = node.args[0].meta.get("val"), node.meta.get("val")
        if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
            return False
        memory_format = node.kwargs.get("memory_format")
        return (
            src.dtype == dst.dtype
            and src.device == dst.device
            and memory_format in (None, torch.preserve_format)
            and not node.kwargs.get("copy", False)
            and name == "aten.to"  # _to_copy always copies; keep it (it may break aliasing)
        )
    return False


def _output_order(spec: pytree.TreeSpec) -> list[int]:
    """Leaf indices of an output spec, with the leaf of a top-level `logits` field first."""
    indices = list(range(spec.num_leaves))
    try:
        structure = pytree.tree_unflatten(indices, spec)
    except Exception:  # an exotic container that cannot be rebuilt from ints: keep pytree order
        return indices
    logits = None
    if isinstance(structure, dict) or hasattr(structure, "keys"):
        try:
            logits = structure["logits"]
        except (KeyError, TypeError):
            logits = None
    if isinstance(logits, int):
        return [logits] + [i for i in indices if i != logits]
    return indices


def _flatten_output_node(graph: fx.Graph, out_spec: pytree.TreeSpec) -> None:
    output = graph.output_node()
    leaves = list(pytree.tree_leaves(output.args[0]))
    assert len(leaves) == out_spec.num_leaves, (len(leaves), out_spec)
    kept = [
        i
        for i in _output_order(out_spec)
        if isinstance(leaves[i], fx.Node) and isinstance(leaves[i].meta.get("val"), torch.Tensor)
    ]
    tensors = [leaves[i] for i in kept]
    if not tensors:
        raise InputError(
            "the model returns no tensor; forward must return the logits (or a tuple / dict of tensors)"
        )
    output.args = (tensors[0] if len(tensors) == 1 else tuple(tensors),)
    paths = _leaf_paths(out_spec)
    if paths is not None:  # where each flat output sits in what the model's forward returns
        output.meta[OUTPUT_PATHS_META] = [paths[i] for i in kept]


# graph.output_node().meta key: for each output of a captured graph, in order, where the model's own
# forward returns it, as pytree writes a key path ("['logits']", "[1]", "" for a bare tensor)
OUTPUT_PATHS_META = "model_output_paths"


def _leaf_paths(spec: pytree.TreeSpec) -> list[str] | None:
    """The key path of each leaf of an output spec (pytree.keystr), None for a container pytree
    cannot rebuild."""
    try:
        structure = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
        return [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(structure)[0]]
    except Exception:  # noqa: BLE001 - an exotic container: no paths
        return None


def _module_path(node: fx.Node, module_names: set[str]) -> str:
    if node.op == "get_attr":
        owner = str(node.target).rpartition(".")[0]
        return owner if owner in module_names else ""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = _clean_path(list(stack.values())[-1][0])
    while path and path not in module_names:  # a path export spelled differently: nearest known prefix
        path = path.rpartition(".")[0]
    return path


def _clean_path(path: str) -> str:
    """'L['self'].layers[0].attn' or 'L__self___layers_0' style -> 'layers.0.attn'; FQNs unchanged."""
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.removeprefix("self.").strip(".")


# ------------------------------------------------------------------------------------------ errors

_LIBRARY_DIRS = tuple(
    os.path.realpath(p)
    for p in {
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["purelib"],
        sysconfig.get_paths()["platlib"],
    }
) + (os.path.dirname(os.path.realpath(__file__)),)


def _user_frame(model: nn.Module, exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame in the model's own file, else outside any library directory."""
    frames = traceback.extract_tb(exc.__traceback__)
    try:
        model_file = os.path.realpath(inspect.getsourcefile(type(model)) or "")
    except TypeError:
        model_file = ""
    if model_file.startswith(_LIBRARY_DIRS):  # a library class (nn.Sequential): the user's code is elsewhere
        model_file = ""
    in_model = [f for f in frames if model_file and os.path.realpath(f.filename) == model_file]
    if in_model:
        return in_model[-1]
    outside = [
        f
        for f in frames
        if not os.path.realpath(f.filename).startswith(_LIBRARY_DIRS) and not f.filename.startswith("<")
    ]
    return outside[-1] if outside else None


def library_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame outside torch and the standard library (a Hugging Face modeling
    file's line, where the model's own frame is only the call into it), or None."""
    own = (os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep, os.path.realpath(_TORCH_DIR) + os.sep)
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith("<")
        and not os.path.realpath(f.filename).startswith(own)
        and not os.path.realpath(f.filename).startswith(os.path.dirname(os.path.realpath(__file__)))
    ]
    return frames[-1] if frames else None


def _failing_op(exc: BaseException, partial_graph: str) -> str:
    """What failed: the op (from the message, or the last op of the partial graph) and why."""
    text = str(exc)
    if "data-dependent" in text or type(exc).__name__ == "GuardOnDataDependentSymNode":
        # the op the message names ("... a tracing tensor with aten.item.default"), else the partial
        # graph's last (the op before the failing one, when the message names none)
        ops = re.findall(r"\baten\.(\w+)\.", text) or re.findall(r"torch\.ops\.aten\.(\w+)\.", partial_graph)
        op = f"aten.{ops[-1]}: " if ops else ""
        return f"{op}data-dependent control flow (a Python bool / int of a tensor value: `if x.sum() > 0:`, .item())"
    match = re.search(r"Found (<class '[\w.]+'>) in output, which is not a known type", text)
    if match:
        return f"forward returns a {match.group(1)} object, not tensors"
    match = (
        re.search(r"\b(aten\.\w+(?:\.\w+)?)", text)
        or re.search(r"failed while attempting to run meta for (aten\.\w+(?:\.\w+)?)", partial_graph)
        or re.search(r"torch\.ops\.(aten\.\w+)", partial_graph)
    )
    if match:
        return match.group(1)
    return type(exc).__name__


# --------------------------------------------------------------------------- mixtures of experts

# Hugging Face models with a choice of experts implementation (transformers `integrations/moe.py`,
# `ExpertsInterface`): the one that captures and runs everywhere, and how to ask for it
_HF_EXPERTS_FIX = (
    'build the model with experts_implementation="batched_mm" (in its config, or from_pretrained(..., '
    'experts_implementation="batched_mm")), which computes the same experts with static shapes'
)


def _refuse_unplannable(gm: fx.GraphModule, model: nn.Module) -> None:
    """Raise a one-line InputError for a captured graph the planner cannot plan or run: a value whose
    size is only known at run time (torch.export's unbacked sizes: `torch.nonzero`, boolean masking,
    as a mixture of experts' per-expert token lists), or `aten.histc` on integers (no CPU kernel;
    Hugging Face's grouped_mm experts count tokens per expert so when built on the meta device)."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        if node.op == "call_function" and any(
            isinstance(v, torch.Tensor) and free_unbacked_symbols(v) for v in vals
        ):
            where = user_line(node) or node.meta.get("module_path", "") or node.name
            raise InputError(
                f"{type(model).__name__}: {op_name(node.target) or node.target} at {where} makes a tensor whose "
                "size is known only at run time (a data-dependent shape, e.g. each expert's tokens of a mixture "
                "of experts), which the planner cannot price or shard; write it with static shapes: give each "
                "expert a fixed capacity of token slots (gather them, index_add back), or index stacked "
                "(E, ...) expert weights by the top-k ids (gpt-fast's ConditionalFeedForward); for a Hugging "
                f"Face model, {_HF_EXPERTS_FIX}"
            )
        if node.op == "call_function" and op_name(node.target) == "aten.histc":
            source = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
            if isinstance(source, torch.Tensor) and not source.is_floating_point():
                where = node.meta.get("module_path") or user_line(node) or node.name
                raise InputError(
                    f"{type(model).__name__}: aten.histc on an integer ({str(source.dtype).removeprefix('torch.')}) tensor at "
                    f"{where} has no CPU kernel (\"histogram_cpu\" not implemented for 'Int'): transformers' "
                    "grouped_mm experts count tokens per expert this way when the model is built on the meta "
                    f"device, as the planner builds it; {_HF_EXPERTS_FIX}"
                )


def _hf_eager_experts(model: nn.Module, exc: BaseException) -> str | None:
    """A one-line message when `exc` is a data-dependent failure of Hugging Face's eager experts loop
    (one iteration per expert the batch routes tokens to), else None."""
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) != "eager" or "data-dependent" not in str(exc):
        return None
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "transformers" in f.filename]
    where = next(
        (
            f"{os.path.basename(f.filename)}:{f.lineno} `{(f.line or '').strip()}`"
            for f in reversed(frames)
            if "expert" in (f.line or "")
        ),
        "the experts' forward",
    )
    return (
        f"cannot capture {type(model).__name__}: its experts run transformers' eager loop ({where}), once per "
        "expert the batch routes tokens to, a number known only at run time, which torch.export cannot "
        f"capture; {_HF_EXPERTS_FIX}"
    )


def _capture_error_message(model: nn.Module, exc: BaseException, partial_graph: str) -> str:
    eager_experts = _hf_eager_experts(model, exc)
    if eager_experts is not None:
        return eager_experts
    frame = _user_frame(model, exc)
    where = "unknown line (no frame of the model's code in the traceback)"
    try:  # an output torch.export cannot flatten leaves no frame of the model's: name its forward
        source = inspect.getsourcefile(type(model).forward) or ""
        first_lineno = inspect.getsourcelines(type(model).forward)[1]
        if source and not os.path.realpath(source).startswith(_LIBRARY_DIRS):
            where = f"unknown line (no frame of the model's code in the traceback); forward at {source}:{first_lineno}"
    except (TypeError, OSError):
        pass
    if frame is not None:
        where = f"{frame.filename}:{frame.lineno}"
        if frame.line:
            where += f": {frame.line.strip()}"
    inner = library_frame(exc)
    if inner is not None and (
        frame is None or (inner.filename, inner.lineno) != (frame.filename, frame.lineno)
    ):
        where += (
            f"\n  within: {os.path.basename(inner.filename)}:{inner.lineno}: {(inner.line or '').strip()}"
        )
    first_line = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    fixes = _SHAPE_FIXES if _SHAPE_ERROR.search(first_line) else _FIXES
    if _DEVICE_ERROR.search(f"{type(exc).__name__}: {first_line}"):
        fixes = _DEVICE_FIXES
    elif _DTYPE_ERROR.search(first_line):  # before shapes: "mat1 and mat2 must have the same dtype"
        fixes = _DTYPE_FIXES
    return (
        f"cannot capture {type(model).__name__} with torch.export (non-strict)\n"
        f"  op:    {_failing_op(exc, partial_graph)}\n"
        f"  line:  {where}\n"
        f"  error: {type(exc).__name__}: {textwrap.shorten(first_line, 300, placeholder=' ...')}\n"
        f"{fixes}"
    )

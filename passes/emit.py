"""Emit a rank's rewritten GraphModule as a Python package folder the user loads in their own program.

    emit_rank_module(gm, out_dir, rank, meta) -> out_dir/rank{rank}/
        module.py     readable source: `class ShardedModule(torch.nn.Module)` with the graph's code as
                      `forward`, and `load(device)` that builds it and loads the weights
        weights.pt    this rank's weight shards: {FQN: tensor} (`torch.save`, loaded with weights_only=True);
                      absent when gm's tensors are on the meta device (large models planned without
                      weights): module.py's `build()` then gives the module, to be filled from a checkpoint
        meta.json     `meta` plus what the emitter knows: inputs / outputs (names, local shapes, dtypes),
                      tensor count and bytes, tied aliases, torch version
    load_rank_module(out_dir, rank, device) -> nn.Module   (imports module.py by path, calls its load())
    write_readme(out_dir, info) -> out_dir/README.md       (how to load and run it)

The generated module needs only `torch`, and `passes.collectives` when the graph calls collectives
(`tp_all_reduce(x, "tp")`, ...), `passes.fsdp` for a fully sharded plan's gathers: none of the
planner's passes. Before calling it, the program must
initialise torch.distributed and bind the mesh axis: `passes.collectives.register_group("tp", group)`.

Decision: not `GraphModule.to_folder`. In torch 2.13 its `module.py` (a) does not import the globals
the graph code uses, so a call to a `passes.collectives` function fails at the first forward with
`NameError: name 'runtime_collectives_tp_all_reduce' is not defined` (fx names non-torch functions by a
mangled global and only `gm.graph.python_code().globals` knows what it stands for); (b) bakes the
absolute folder path into the source (the folder cannot be moved, or written to a temp dir and
renamed); (c) pickles every submodule with `torch.save(module)`, loaded with `weights_only=False`.
Here every global of the generated code becomes an explicit import line, checked to resolve to the
same object, weights are plain tensors, and paths are relative to `module.py`.

Atomicity: a rank folder is written to a temporary sibling (`.rank{r}.tmp-*`) and renamed into place
(an existing folder is replaced); an error leaves no half-written `rank{r}`.

The graph's factory ops carry literal devices (`aten.arange(..., device=cpu)`): emit for the device the
module will run on (`planner.frontend.capture.retarget_device(gm, device)` first).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import operator
import os
import re
import shutil
import tempfile
import types
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from planner.files import write_text_atomic
from planner.frontend.capture import OUTPUT_PATHS_META

MODULE_FILE = "module.py"
WEIGHTS_FILE = "weights.pt"
META_FILE = "meta.json"
CLASS_NAME = "ShardedModule"


class EmitError(ValueError):
    """A graph the emitter cannot write as standalone source; the message names the node or global."""


# --------------------------------------------------------------------------------------------------
# Emit


def emit_rank_module(gm: fx.GraphModule, out_dir: str | os.PathLike[str], rank: int, meta: dict) -> Path:
    """Write rank `rank`'s module to `out_dir/rank{rank}/` (module.py, weights.pt, meta.json); return the folder.

    gm: the rank's rewritten graph (after the TP / pipeline passes). meta: JSON-serialisable facts to
    record (plan, mesh coordinates, ...); the keys "rank", "weights_included", "class_name", "inputs",
    "outputs", "tensors", "tensor_bytes", "aliases" and "torch_version" are set by the emitter. Creates out_dir if needed.
    When every tensor of gm is on the meta device, no weights.pt is written (meta.json says
    "weights_included": false). Raises EmitError for a `call_module` / `call_method` node, a global
    the source cannot import, a non-tensor attribute, a mix of meta and real tensors, or a meta that is
    not JSON-serialisable; nothing is left behind then.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors, aliases = _collect_tensors(gm)
    source = _module_source(gm, rank, tensors, aliases)
    record = dict(meta)
    on_meta = [fqn for fqn, t, _ in tensors if t.device.type == "meta"]
    if on_meta and len(on_meta) != len(tensors):
        raise EmitError(
            f"rank {rank}: {len(on_meta)} of {len(tensors)} tensors are on the meta device (e.g. {on_meta[0]!r}); "
            "emit either all weights or none"
        )
    weights_included = not on_meta
    record.update(
        rank=rank,
        weights_included=weights_included,
        class_name=CLASS_NAME,
        inputs=[_describe(n) for n in gm.graph.nodes if n.op == "placeholder"],
        outputs=_describe_outputs(gm),
        tensors=len(tensors),
        tensor_bytes=sum(t.numel() * t.element_size() for _, t, _ in tensors),
        aliases=aliases,
        torch_version=torch.__version__,
    )
    try:
        meta_text = json.dumps(record, indent=2, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise EmitError(f"meta for rank {rank} is not JSON-serialisable: {e}") from e
    final = out_dir / f"rank{rank}"
    tmp = Path(tempfile.mkdtemp(prefix=f".rank{rank}.tmp-", dir=out_dir))
    try:
        (tmp / MODULE_FILE).write_text(source)
        if weights_included:
            torch.save({fqn: _compact(t) for fqn, t, _ in tensors}, tmp / WEIGHTS_FILE)
        (tmp / META_FILE).write_text(meta_text + "\n")
        compile(source, str(final / MODULE_FILE), "exec")  # a syntax error never reaches `final`
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        _replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _compact(t: torch.Tensor) -> torch.Tensor:
    """`t` on the CPU in a storage of its own (torch.save writes a view's whole storage)."""
    t = t.detach().cpu()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _replace_dir(new: Path, final: Path) -> None:
    """Rename `new` to `final`; an existing `final` is moved aside first and removed afterwards."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
    try:
        os.rename(new, final)
    except BaseException:
        if old is not None:
            os.rename(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _collect_tensors(gm: fx.GraphModule) -> tuple[list[tuple[str, torch.Tensor, str]], dict[str, str]]:
    """[(FQN, tensor, "parameter" | "buffer")] for every get_attr target, and {alias: canonical FQN}."""
    tensors: list[tuple[str, torch.Tensor, str]] = []
    aliases: dict[str, str] = {}
    seen: dict[int, str] = {}
    done: set[str] = set()
    for node in gm.graph.nodes:
        if node.op in ("call_module", "call_method"):
            raise EmitError(
                f"cannot emit `{node.format_node()}`: only call_function graphs (ATen level) are supported"
            )
        if node.op != "get_attr":
            continue
        fqn = str(node.target)
        if fqn in done:
            continue
        done.add(fqn)
        value = operator.attrgetter(fqn)(gm)
        if not isinstance(value, torch.Tensor):
            raise EmitError(
                f"cannot emit `{node.format_node()}`: attribute {fqn!r} is a {type(value).__name__}"
            )
        if id(value) in seen:
            aliases[fqn] = seen[id(value)]
            continue
        seen[id(value)] = fqn
        tensors.append((fqn, value, "parameter" if isinstance(value, nn.Parameter) else "buffer"))
    return tensors, aliases


def _output_nodes(gm: fx.GraphModule) -> list[Any]:
    out = gm.graph.output_node().args[0]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _describe_outputs(gm: fx.GraphModule) -> list[dict]:
    """meta.json "outputs": each output's name, local shape and dtype, and for the last stage (the
    model's own outputs) `model_path`, where the model's forward returns it ("['logits']" of a dict,
    "[1]" of a tuple, "" for a bare tensor)."""
    described = [_describe(n) for n in _output_nodes(gm)]
    paths = gm.graph.output_node().meta.get(OUTPUT_PATHS_META)
    if paths is not None and len(paths) == len(described):
        for entry, path in zip(described, paths):
            entry["model_path"] = path
    return described


def _describe(node: Any) -> dict:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor):
        return {"name": node.name, "shape": list(val.shape), "dtype": str(val.dtype).removeprefix("torch.")}
    return {"name": getattr(node, "name", repr(node))}


# --------------------------------------------------------------------------------------------------
# Source


_FIXED_IMPORTS = {
    "inf": "from math import inf",
    "nan": "from math import nan",
    "NoneType": "NoneType = type(None)",
    "torch": "import torch",
}


def _import_line(name: str, obj: Any) -> str:
    """The statement that binds `name` to `obj` in the generated module; EmitError if there is none."""
    if name in _FIXED_IMPORTS:
        return _FIXED_IMPORTS[name]
    if isinstance(obj, types.ModuleType):
        return f"import {obj.__name__}" if name == obj.__name__ else f"import {obj.__name__} as {name}"
    module_name, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if module_name and qualname and "." not in qualname and "<" not in qualname:
        try:
            resolved = getattr(importlib.import_module(module_name), qualname)
        except (ImportError, AttributeError):
            resolved = None
        if resolved is obj:
            suffix = "" if name == qualname else f" as {name}"
            return f"from {module_name} import {qualname}{suffix}"
    if isinstance(obj, float) and math.isfinite(obj):
        return f"{name} = {obj!r}"
    raise EmitError(
        f"the generated code uses global {name!r} = {obj!r}, which cannot be imported by name "
        "(a module-level function or class is needed)"
    )


def _module_source(
    gm: fx.GraphModule, rank: int, tensors: list[tuple[str, torch.Tensor, str]], aliases: dict[str, str]
) -> str:
    code = gm.graph.python_code(root_module="self")
    used = {name: obj for name, obj in code.globals.items() if re.search(rf"\b{re.escape(name)}\b", code.src)}
    imports = sorted({_import_line(name, obj) for name, obj in used.items()} - {"import torch"})
    forward = "\n".join(("    " + line) if line.strip() else "" for line in code.src.strip("\n").splitlines())
    inputs = ", ".join(
        f"{d['name']} {tuple(d['shape'])} {d['dtype']}" if "shape" in d else d["name"]
        for d in (_describe(n) for n in gm.graph.nodes if n.op == "placeholder")
    )
    table = "\n".join(
        f"    ({fqn!r}, {tuple(t.shape)!r}, {t.dtype}, {kind!r}, {bool(t.requires_grad)}),"
        for fqn, t, kind in tensors
    )
    alias_lines = "".join(f"    {a!r}: {c!r},\n" for a, c in aliases.items())
    return f'''"""Rank {rank}'s sharded module, generated by the parallelism planner (passes/emit.py). Do not edit.

Inputs: {inputs or "none"}. Shapes are the local shapes this rank computes with.
Before calling it: initialise torch.distributed and bind the mesh axes its collectives use,
`passes.collectives.register_group("tp", group)`. Then `load(device)(*inputs)`.
"""

import os

import torch
{"".join(line + chr(10) for line in imports)}
_HERE = os.path.dirname(os.path.abspath(__file__))

# (FQN, local shape, dtype, kind, requires_grad) of every weight shard and buffer; values in {WEIGHTS_FILE}
_TENSORS = [
{table}
]
# names the graph uses for a tensor that is stored under another name (tied weights)
_ALIASES = {{
{alias_lines}}}


def _owner(root: torch.nn.Module, fqn: str, create: bool) -> tuple[torch.nn.Module, str]:
    *path, name = fqn.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            if not create:
                raise AttributeError(fqn)
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    return module, name


def _tie(root: torch.nn.Module) -> None:
    for alias, canonical in _ALIASES.items():
        module, name = _owner(root, alias, create=True)
        value = root.get_parameter(canonical) if canonical in dict(root.named_parameters()) else None
        if value is not None:
            module.register_parameter(name, value)
        else:
            module.register_buffer(name, root.get_buffer(canonical))


class {CLASS_NAME}(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for fqn, shape, dtype, kind, requires_grad in _TENSORS:
            module, name = _owner(self, fqn, create=True)
            empty = torch.empty(shape, dtype=dtype, device="meta")
            if kind == "parameter":
                module.register_parameter(name, torch.nn.Parameter(empty, requires_grad=requires_grad))
            else:
                module.register_buffer(name, empty)
        _tie(self)

{forward}


def build() -> {CLASS_NAME}:
    """The module with weights on the meta device; fill it with load_state_dict(state, assign=True)."""
    return {CLASS_NAME}()


def load(device: str | torch.device = "cpu") -> {CLASS_NAME}:
    """Build the module and load this rank's weights ({WEIGHTS_FILE}) onto `device`."""
    path = os.path.join(_HERE, "{WEIGHTS_FILE}")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{{path}} does not exist: this module was emitted without weights (from the meta device). Use "
            "build() and load_state_dict(your_shards, assign=True) with the names and local shapes in _TENSORS"
        )
    module = {CLASS_NAME}()
    state = torch.load(path, map_location=device, weights_only=True)
    result = module.load_state_dict(state, strict=False, assign=True)
    missing = set(result.missing_keys) - set(_ALIASES)
    if missing or result.unexpected_keys:
        raise RuntimeError(f"{WEIGHTS_FILE} does not match the module: missing {{sorted(missing)}}, "
                           f"unexpected {{sorted(result.unexpected_keys)}}")
    _tie(module)
    return module
'''


# --------------------------------------------------------------------------------------------------
# Load


def load_rank_module(
    out_dir: str | os.PathLike[str], rank: int, device: str | torch.device = "cpu"
) -> nn.Module:
    """Import `out_dir/rank{rank}/module.py` by path and return its `load(device)`: the rank's module.

    The module calls `passes.collectives`, so `runtime` must be importable, and the mesh axes must be
    registered (`register_group`) before the first call. Raises FileNotFoundError when the folder or a
    file is missing (weights.pt is absent for modules emitted from the meta device: import module.py
    and use its `build()`), RuntimeError when the weights do not match the module.
    """
    folder = Path(out_dir) / f"rank{rank}"
    path = folder / MODULE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no generated module at {path}; run emit_rank_module first")
    spec = importlib.util.spec_from_file_location(f"_planner_rank{rank}_{uuid.uuid4().hex[:8]}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load(device)


# --------------------------------------------------------------------------------------------------
# README


def write_readme(out_dir: str | os.PathLike[str], info: dict) -> Path:
    """Write `out_dir/README.md`: how to load and run the emitted modules in the user's own program.

    info (all optional): "model" (str), "tp", "pp", "dp" (int degrees), "backend" ("nccl" | "gloo";
    default "gloo": CPU processes), "inputs" (str: what one rank passes, e.g. "idx (2, 16) int64"),
    "world_size" (int), "folder" (str: the folder's final path, when it is written under a temporary
    one; default `out_dir`), "batch_size" (int: the plan's global batch), "fsdp" (str: a fully sharded
    plan's shard layout: adds how the shard groups are bound), "experts" (str: how a mixture of experts'
    routed experts are split and which "ep" group to bind, `planner.cli.emitting`; "experts_one_rank_ep": a
    true value adds the one-rank "ep" binding to the code), "loss_scale" (str: fp16 training's loss
    scaling in words, `planner.plan.loss_scale_text`: adds how to scale), "serving" (str: the served
    request, for a decode plan of a model with a KV cache: adds how the caches are filled). Written atomically
    (`planner.files.write_text_atomic`); raises InputError when it cannot be written.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tp, pp, dp = (int(info.get(k, 1)) for k in ("tp", "pp", "dp"))
    cp = int(info.get("cp", 1) or 1)
    world = int(info.get("world_size", tp * pp * dp))
    backend = info.get("backend", "gloo")
    folder = str(info.get("folder", out_dir.resolve()))
    if backend == "nccl":
        where = "one process per GPU, NCCL backend"
        device = "torch.device('cuda', int(os.environ['LOCAL_RANK']))"
    else:
        where = "one CPU process per rank, gloo backend (no GPU needed)"
        device = "torch.device('cpu')"
    launch = f"torchrun --nproc-per-node {world} your_script.py"
    ranks = (
        ", ".join(f"`rank{r}/`" for r in range(world)) if world <= 8 else f"`rank0/` ... `rank{world - 1}/`"
    )
    # experts split over TP without EP dispatch over a one-rank "ep" axis (`passes.ep_lower`)
    ep_line = (
        '\nregister_group("ep", None)                        # the experts: see "Mixture of experts"'
        if info.get("experts_one_rank_ep")
        else ""
    )
    batch = info.get("batch_size")
    dp_text = (
        f"With dp={dp}, DP replica `d = (rank // {tp * cp}) % {dp}` computes its own slice of the batch: split the "
        f"{batch if batch else 'global'}-sequence batch into {dp} equal parts on its batch dim and pass part `d` "
        "(the shapes in `meta.json` are per rank). "
        if dp > 1
        else ""
    )
    text = f"""# Sharded {info.get("model", "model")}: one generated module per rank

Mesh: tp={tp}, pp={pp}, dp={dp} ({world} ranks: {where}). Rank r is laid out as
`r = (pp_rank * dp + dp_rank) * tp + tp_rank` (tp fastest, the pipeline stage outermost), so a TP group
is `tp` consecutive ranks.
This folder holds one module for every rank that runs: {ranks}.

Each `rank{{r}}/` holds:

- `module.py`: the rank's rewritten model as readable PyTorch source (`class {CLASS_NAME}`,
  `load(device)`); it imports only `torch` and `passes.collectives` (and `passes.fsdp` when the
  plan is fully sharded), so a custom operator the
  model registers with PyTorch's custom-op API must be registered first: import the module that
  defines it (e.g. the model file) before loading `module.py`;
- `weights.pt`: the rank's weight shards (`torch.load(..., weights_only=True)`);
- `meta.json`: the plan facts, the inputs and outputs with their local shapes.

## Run it in your program

Start {world} processes, one per rank (e.g. `{launch}`), with the folder that holds the planner's
`passes/` package on `PYTHONPATH`, and in each:

```python
import importlib.util
import os
import torch
import torch.distributed as dist
from passes.collectives import register_group

dist.init_process_group("{backend}")
rank = dist.get_rank()
tp = {tp}
groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, dist.get_world_size(), tp)]  # all ranks make all
register_group("tp", groups[rank // tp])          # before the first call{ep_line}
device = {device}

folder = {folder!r}
spec = importlib.util.spec_from_file_location(f"rank{{rank}}", f"{{folder}}/rank{{rank}}/module.py")
generated = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generated)
module = generated.load(device)                   # same as passes.emit.load_rank_module(folder, rank, device)
with torch.no_grad():
    out = module(*inputs)                         # inputs: {info.get("inputs", "as in meta.json")}
```

Every rank of a TP group passes the same inputs and gets the same (replicated) output: the model's
output tensors as one flat tuple (one tensor bare), whatever structure the model's forward returns;
`meta.json` "outputs" gives each one's `model_path`, where the model returns it (`['logits']` of a
dict, `[1]` of a tuple). {dp_text}With pp > 1,
rank modules are pipeline stages: stage 0 takes the model inputs, each stage returns the tuple the
next one takes (`meta.json` lists them); run them with `torch.distributed.pipelining` over the
pp group, with the plan's schedule and micro-batches (`meta.json` "plan"; `runtime.pipeline.PipelineRunner`
does it, the mesh groups come from `runtime.mesh.build_rank_groups`). Shapes are fixed: the batch
and sequence length the plan was made for (per micro-batch under pp).
"""
    if info.get("fsdp"):
        text += f"""
## Fully sharded data parallelism

{info["fsdp"]}. Each rank's `weights.pt` holds only its flat shard of every wrapping unit (a
layer, and one unit for the parameters outside the layers): the parameters `fsdp_shard_<k>`, whose
layout (unit, parameters, shapes, offsets) is in `meta.json` "fsdp". The module gathers each unit
(`passes.fsdp.fsdp_gather`) right before it is used, over the process group registered for the
"dp_shard" axis, and its backward reduce-scatters the unit's gradient into the shard's `.grad` (the
mean over the shard group; with replicas, also all-reduced over the "dp_replicate" axis). Before the
first call, with DP rank `d = (rank // {tp * cp}) % {dp}` and S = the shard size in `meta.json`, every rank
makes every group: the shard groups are S consecutive DP ranks of the same (pp, tp) coordinate
(`runtime.mesh.hsdp_ranks`), and `register_group("dp_shard", ...)` / `register_group("dp_replicate",
...)` bind this rank's. Step any optimizer over `module.parameters()` (the shards). Run this way it
gathers synchronously; `planner run` runs it with prefetch and reshard after forward
(`passes.fsdp.FsdpRuntime`).
"""
    if int(info.get("cp", 1)) > 1:
        cp = int(info["cp"])
        text += f"""
## Context parallelism

Context parallelism {info.get("cp_text", cp)}: each rank module takes the whole batch's inputs and
keeps its own tokens of every sequence (`passes.context_parallel.cp_slice`), runs attention with the
other CP ranks (`cp_sdpa`), and returns its outputs gathered whole. The CP ranks of a rank are the
{cp} ranks with the same (dp, pp, tp) coordinate, tp apart (rank = ((pp_rank * dp + dp_rank) * {cp} +
cp_rank) * tp + tp_rank): every rank makes every such group with `dist.new_group` and binds its own
with `register_group("cp", group)` before the first call. Training: each rank's parameter gradients
are partial sums over its tokens (scaled by {cp} at the output gather), so average them over the
dp x cp ranks that hold the same weights, as `planner run` does.
"""
    if info.get("experts"):
        text += f"""
## Mixture of experts

{info["experts"]}
"""
    if info.get("loss_scale"):
        text += f"""
## fp16 training: loss scaling

The plan trains in fp16 with loss scaling {info["loss_scale"]}: multiply each loss by the scale before
its backward, divide the gradients by it (in fp32) before the optimizer step, and skip a step whose
gradients hold an inf or NaN on any rank, e.g. with
`torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler` (torch.amp's GradScaler with the
found-inf flag all-reduced over the ranks) as `planner run` does (`runtime.loss_scaling`): its
`update()` after every step for a dynamic scale, `update(new_scale=S)` for a static one.
"""
    if info.get("serving"):
        text += f"""
## A served request: the decode step

{info["serving"]} Each module is one decode step: one new token per sequence at `input_pos`,
with the rank's part of the KV caches as buffers (its own heads where the plan splits attention),
allocated empty. The prefill is not emitted: a serving loop of your own must fill the caches first
(run the prompt through the model file's prefill and load each rank's head slice of the caches),
then call the module once per token. `planner run PLAN.yaml --model MODEL.py` serves the whole request (prefill, then the decode
steps) on local ranks and checks the tokens against the unsharded model.
"""
    write_text_atomic(out_dir / "README.md", text)
    return out_dir / "README.md"

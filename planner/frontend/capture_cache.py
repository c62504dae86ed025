"""A cache of captures (`planner.frontend.capture.capture`), in this process and, through a folder,
across processes.

Why: torch.export costs about 3 ms per ATen op on this project's CPUs (fake-tensor dispatch and
tracing), about a second for a small model, and the same model is captured at the same shapes again
and again: `planner optimize` captures it to plan and again to check the lowering and price the
baseline; a rank that runs several jobs of one model builds each job's module afresh; the reference
run and every rank of `planner run` capture it once more. Measured over the test suite (2026-12-06,
2 cores): 1,102 exports took 1,138 s of its 1,614 s; 439 of them repeated a capture another process
had made, 173 one the same process had made (models with real weights counted).

What makes two captures the same (`cache_key`): the module tree (names, which names hold one module
object, each module's training flag, every plain attribute by value, config objects and real tensors held as plain attributes included;
parameter and buffer names, shapes, strides, dtypes, devices, requires_grad, and which are tied, but
not their values: export traces them as fake tensors); each module's class by what its class dicts
hold along the MRO (method code, closures, defaults, properties, class attributes: a class
redefined, made in a factory or patched at run time keys otherwise) and, for a class outside an
installed package, the digest of its source file (the module-level helpers it calls); the inputs
(tensor shapes, strides, dtypes and devices, which share memory; other leaves by value); torch's default dtype and
device and grad mode. Anything the key cannot read for certain makes the capture uncached: a forward
hook, a compiled module, a bound method or an object of unknown kind as an attribute, a tensor
subclass as a parameter, a real tensor attribute over `MAX_HASHED_BYTES`, a container over
`MAX_ITEMS` items, any error while reading. What it does not see: a module-level global of the
model's file changed after the file was loaded, or a library function the model calls patched at run
time (the planner does neither; set ``PLANNER_CAPTURE_CACHE=off`` to capture every time).

What is stored (`_Frozen`) holds no data of the model: the nodes (ATen operators by name, fake
values by shape, stride, dtype and device, the rest of the node metadata but torch's provenance),
the names of the parameters and buffers the graph reads, and, for a meta-device model only, the
other tensors of the graph (constants). A model with real weights (or none at all) whose graph holds any other tensor
(a plain tensor attribute export lifted as a constant, a static KV cache held outside the module
tree) is not stored. A hit rebuilds a new graph module (the passes rewrite the graph they get) whose
parameters and buffers are the capturing model's own objects, and replays what the capture printed
(the model's prints and torch.export's) and warned.

Across processes: with ``PLANNER_CAPTURE_CACHE_DIR`` set, each stored capture is also written there
(whole or not at all: a temporary file renamed), named by the key, a digest of the Python and torch
versions and of this package's source, and a digest of the code the model reaches
(`_model_code_digest`: every user file reached from its classes' and functions' modules through
module globals, by content; each installed package reached, by its distribution's version); a
process reads an entry it does not hold. A process in which a reached user file changed after it
started does not use the folder. An entry that cannot be read is captured again. The test command
sets one folder per run.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import importlib.metadata
import io
import operator
import os
import pickle
import sys
import sysconfig
import time
import types
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.modules import module as module_globals

MAX_ENTRIES = 16  # graphs kept (least recently used dropped); a meta graph holds no tensor data
MAX_HASHED_BYTES = 64 * 2**20  # a real tensor attribute larger than this makes the capture uncached
MAX_ITEMS = 4096  # a list, tuple, dict or set attribute longer than this makes the capture uncached
_MAX_DEPTH = 8  # nesting of plain objects read by value (configs hold dicts of lists of ...)

# nn.Module's own bookkeeping: read as the module tree, hooks checked, not hashed as attributes
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
_FORWARD_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)
_INSTALLED = tuple(
    {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


@dataclass
class CachedCapture:
    """A stored capture: the normalised graph, and what the capture printed (``stdout``: the model's own
    prints; ``stderr``: torch.export's) and warned."""

    gm: fx.GraphModule
    stdout: str
    stderr: str
    warned: list[warnings.WarningMessage]


@dataclass
class _Frozen:
    """A capture as stored (picklable, no tensor of the model): the graph's nodes pickled with node
    references and fake values as persistent ids (`_GraphPickler`), whose `get_attr` nodes read the
    capturing model's own parameter or buffer of that name (`_thaw` binds them in graph order) but for
    the other tensors (constants, a meta model's only), kept with their values; what the capture
    printed and warned."""

    nodes: bytes
    constants: dict[str, torch.Tensor]
    training: bool
    stdout: str
    stderr: str
    warned: list[tuple[type[Warning], str, str, int]]


_entries: OrderedDict[str, _Frozen] = OrderedDict()
_DIR_VARIABLE = "PLANNER_CAPTURE_CACHE_DIR"


def enabled() -> bool:
    """False when the environment sets PLANNER_CAPTURE_CACHE to off / 0 / false / no."""
    return os.environ.get("PLANNER_CAPTURE_CACHE", "on").strip().lower() not in ("off", "0", "false", "no")


def lookup(key: str | None, model: nn.Module) -> CachedCapture | None:
    """The capture stored under `key` (in this process, or in the folder PLANNER_CAPTURE_CACHE_DIR
    names), rebuilt as a new graph whose parameters and buffers are `model`'s own; None when there is
    none or it cannot be read."""
    if key is None or not enabled():
        return None
    frozen = _entries.get(key)
    if frozen is None:
        frozen = _read(key, model)
        if frozen is None:
            return None
        _keep(key, frozen)
    else:
        _entries.move_to_end(key)
    try:
        gm = _thaw(frozen, model)
    except Exception:  # noqa: BLE001 - an entry this model cannot take (it should not happen): captured again
        return None
    warned = [
        warnings.WarningMessage(message, category, filename, lineno)
        for category, message, filename, lineno in frozen.warned
    ]
    return CachedCapture(gm, frozen.stdout, frozen.stderr, warned)


def store(
    key: str | None,
    gm: fx.GraphModule,
    model: nn.Module,
    stdout: str,
    stderr: str,
    warned: list[warnings.WarningMessage],
) -> None:
    """Keep `gm`, the capture of `model`, under `key` (None: nothing kept): in this process (the least
    recently used entry dropped past `MAX_ENTRIES`) and, when PLANNER_CAPTURE_CACHE_DIR names a folder,
    there for other processes. A graph that cannot be stored without the model's data is not kept."""
    if key is None or not enabled():
        return
    try:
        frozen = _freeze(gm, model, stdout, stderr, warned)
    except Exception:  # noqa: BLE001 - something the store cannot write for certain: not kept
        return
    _keep(key, frozen)
    _write(key, frozen, model)


def _keep(key: str, frozen: _Frozen) -> None:
    _entries[key] = frozen
    _entries.move_to_end(key)
    while len(_entries) > MAX_ENTRIES:
        _entries.popitem(last=False)


def clear() -> None:
    """Forget every capture stored in this process (the folder of PLANNER_CAPTURE_CACHE_DIR is left)."""
    _entries.clear()


def _folder() -> str | None:
    folder = os.environ.get(_DIR_VARIABLE, "").strip()
    return folder or None


def _path(folder: str, key: str, code: str) -> str:
    return os.path.join(folder, f"{_source_digest()}-{code}-{key}.capture")


def _read(key: str, model: nn.Module) -> _Frozen | None:
    folder = _folder()
    code = _model_code_digest(model) if folder is not None else None
    if folder is None or code is None:
        return None
    try:
        with open(_path(folder, key, code), "rb") as f:
            frozen = pickle.load(f)  # noqa: S301 - a folder of this planner's own captures (docs/model-files.md)
    except Exception:  # noqa: BLE001 - absent, being written, or from another version: captured again
        return None
    return frozen if isinstance(frozen, _Frozen) else None


def _write(key: str, frozen: _Frozen, model: nn.Module) -> None:
    """Write the entry whole or not at all (a temporary file renamed): processes sharing the folder
    read a complete entry or none."""
    folder = _folder()
    code = _model_code_digest(model) if folder is not None else None
    if folder is None or code is None:
        return
    path = _path(folder, key, code)
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(folder, exist_ok=True)
        with open(temporary, "wb") as f:
            pickle.dump(frozen, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(temporary, path)
    except Exception:  # noqa: BLE001 - a folder that cannot be written: this process keeps its own copy
        with contextlib.suppress(OSError):
            os.remove(temporary)


@functools.cache
def _source_digest() -> str:
    """The Python and torch versions and the planner's capture code (this package's files): an entry
    written by another version is not read."""
    h = hashlib.blake2b(f"{sys.version} {torch.__version__}".encode(), digest_size=8)
    here = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()


_STARTED_NS = time.time_ns()  # about when this process imported the planner


def _model_code_digest(model: nn.Module) -> str | None:
    """For the folder: a digest of the code `model` runs that another process may hold otherwise. From
    the modules of the model's classes (their MROs) and of the functions it holds as attributes, every
    user module (a file outside the installed packages) reached through module globals (imported
    modules, functions and classes), by file content, and each installed package reached, by its
    distribution's version. None (the folder not used) when a user file changed after this process
    started: the code it imported is not the file's any more."""
    seeds: set[str] = set()
    for module in model.modules():
        seeds.update(c.__module__ for c in type(module).__mro__)
        for value in vars(module).values():
            fn = value.func if isinstance(value, functools.partial) else value
            if isinstance(fn, (types.FunctionType, type)):
                seeds.add(fn.__module__)
    h = hashlib.blake2b(digest_size=10)
    seen, queue, packages = set(seeds), sorted(seeds), set()
    while queue:
        name = queue.pop()
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if module is None or name in sys.builtin_module_names or not path:
            continue
        if os.path.realpath(path).startswith(_INSTALLED):
            packages.add(name.partition(".")[0])
            continue
        stat = os.stat(path)
        if stat.st_mtime_ns > _STARTED_NS:
            return None
        h.update(f"{name} {_file_digest(path, stat.st_mtime_ns, stat.st_size)}".encode())
        for value in list(vars(module).values()):
            used = (
                value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
            )
            if isinstance(used, str) and used not in seen:
                seen.add(used)
                queue.append(used)
    for package in sorted(packages - {"torch", "builtins"}):
        h.update(f"{package} {_package_version(package)}".encode())
    return h.hexdigest()


_distributions = functools.cache(importlib.metadata.packages_distributions)  # top-level package -> names


@functools.cache
def _package_version(package: str) -> str:
    """The versions of the distributions that provide an installed top-level package ("" if none)."""
    names = _distributions().get(package, [])
    versions = []
    for name in sorted(set(names)):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append(f"{name}=={importlib.metadata.version(name)}")
    return ",".join(versions)


class _NodeRef:
    """A node named in a pickled argument, resolved when the graph is rebuilt."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class _GraphPickler(pickle.Pickler):
    """Pickles node records: nodes by name, fake tensors by their metadata, ATen operators by name."""

    def persistent_id(self, obj: Any) -> Any:  # noqa: PLR0911 - one return per kind of object
        if isinstance(obj, fx.Node):
            return ("node", obj.name)
        if isinstance(obj, FakeTensor):
            sizes = (*obj.shape, *obj.stride(), obj.storage_offset())
            if not all(type(d) is int for d in sizes):
                raise _Uncacheable("a symbolic shape")
            return ("fake", tuple(obj.shape), obj.stride(), obj.dtype, obj.device, obj.requires_grad)
        if isinstance(obj, torch._ops.OpOverload):
            return ("op", obj.namespace, obj._opname, obj._overloadname)
        if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool, torch._ops.HigherOrderOperator)):
            raise _Uncacheable(f"a {type(obj).__name__}")
        if isinstance(obj, (fx.GraphModule, torch.Tensor)):
            raise _Uncacheable(f"a {type(obj).__name__} in the graph")
        return None


class _GraphUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def persistent_load(self, pid: Any) -> Any:
        kind, *rest = pid
        if kind == "node":
            return _NodeRef(rest[0])
        if kind == "fake":
            shape, stride, dtype, device, requires_grad = rest
            with self._fake_mode:
                fake = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            return fake.requires_grad_(requires_grad) if requires_grad else fake
        if kind == "op":
            namespace, name, overload = rest
            return getattr(getattr(getattr(torch.ops, namespace), name), overload)
        raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")


def _freeze(
    gm: fx.GraphModule, model: nn.Module, stdout: str, stderr: str, warned: list[warnings.WarningMessage]
) -> _Frozen:
    """`gm` as stored (`_Frozen`); raises `_Uncacheable` for what cannot be stored without the model's
    data (a real model's tensor that is not one of its parameters or buffers) or rebuilt for certain."""
    params = {id(t): name for name, t in model.named_parameters(remove_duplicate=False)}
    buffers = {id(t): name for name, t in model.named_buffers(remove_duplicate=False)}
    tensors = [*model.parameters(), *model.buffers()]
    meta_model = bool(tensors) and all(
        t.device.type == "meta" for t in tensors
    )  # none: its constants are real
    graph_buffers = {name for name, _ in gm.named_buffers()}
    constants = {}
    records = []
    for node in gm.graph.nodes:
        if node.op in ("call_module", "call_method"):
            raise _Uncacheable(f"a {node.op} node")
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(gm)
            if not isinstance(value, torch.Tensor):
                raise _Uncacheable("a get_attr of something other than a tensor")
            # the model's own parameter or buffer (bound again on a hit), else a meta model's constant
            own = (params.get(id(value)) == node.target and isinstance(value, nn.Parameter)) or (
                buffers.get(id(value)) == node.target and node.target in graph_buffers
            )
            if not own and meta_model and type(value) is torch.Tensor and node.target in graph_buffers:
                constants[node.target] = value.detach().clone()
            elif not own:
                raise _Uncacheable(f"{node.target}: a tensor of the capture that is not the model's")
        meta = {k: v for k, v in node.meta.items() if k != "from_node"}
        records.append((node.name, node.op, node.target, node.args, node.kwargs, meta))
    data = io.BytesIO()
    _GraphPickler(data, protocol=pickle.HIGHEST_PROTOCOL).dump(records)
    kept = [(w.category, str(w.message), w.filename, w.lineno) for w in warned]
    frozen = _Frozen(data.getvalue(), constants, gm.training, stdout, stderr, kept)
    pickle.dumps(frozen.warned)  # what it warned must pickle too (for the folder)
    return frozen


def _thaw(frozen: _Frozen, model: nn.Module) -> fx.GraphModule:
    """A new graph module from `frozen`, its parameters and buffers `model`'s own by name."""
    records = _GraphUnpickler(frozen.nodes).load()
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}

    def resolve(x: Any) -> Any:
        return env[x.name] if isinstance(x, _NodeRef) else x

    for name, op, target, args, kwargs, meta in records:
        node = graph.create_node(
            op,
            target,
            fx.node.map_aggregate(args, resolve),
            fx.node.map_aggregate(kwargs, resolve),
            name=name,
        )
        if node.name != name:
            raise _Uncacheable(f"node {name} renamed {node.name}")
        node.meta = meta
        env[name] = node
    graph._codegen = fx.graph.CodeGen()  # as `capture._normalise`: plain positional inputs
    tensors = {
        **dict(model.named_buffers(remove_duplicate=False)),
        **dict(model.named_parameters(remove_duplicate=False)),
    }
    # registered in the order the graph first reads them, as a fresh capture (`capture._normalise`: a
    # module root, copied node by node) registers them. A dict root would register them by depth
    # (lm_head before model.embed_tokens): ranks flatten their gradients into one all-reduce buffer
    # in named_parameters() order, so a rank whose graph came from the cache summed its gradients
    # into another parameter's place than a rank that exported it (CP 2 DeepSeek-V3: 0.0226 off)
    holder = nn.Module()
    for node in graph.nodes:
        if node.op == "get_attr":
            constant = frozen.constants.get(node.target)
            _hold(holder, node.target, tensors[node.target] if constant is None else constant.clone())
    gm = fx.GraphModule(holder, graph, class_name="CapturedModel")
    gm.train(frozen.training)
    return gm


def _hold(root: nn.Module, target: str, value: torch.Tensor) -> None:
    """Put `value` at the dotted `target` under `root` (plain modules made along the way): a Parameter
    as a parameter, any other tensor as a buffer, as GraphModule copies a get_attr's tensor."""
    *path, field = target.split(".")
    for name in path:
        child = getattr(root, name, None)
        if child is None:
            child = nn.Module()
            root.add_module(name, child)
        root = child
    if isinstance(value, nn.Parameter):
        root.register_parameter(field, value)
    else:
        root.register_buffer(field, value)


class _Uncacheable(Exception):
    """Something about the model or its inputs that the key cannot read for certain."""


def cache_key(model: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """A digest of everything the capture of ``model(*args, **kwargs)`` depends on (module docstring), or
    None when the capture must not be cached (a tensor of the model off the meta device, a hook, ...)."""
    if not enabled():
        return None
    try:
        return _Key().model(model).inputs(args, kwargs).digest()
    except Exception:  # noqa: BLE001 - whatever the key cannot read (`_Uncacheable` and the rest): not cached
        return None


class _Key:
    """A canonical token stream of a model and its inputs, hashed as it is written."""

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=20)
        self._seen: dict[int, tuple[int, Any]] = {}  # id of an object written -> (its index, it)
        self._data = True  # a real tensor's values are part of the key (the graph keeps them as constants)
        self._classes: dict[int, str] = {}  # id of a class already keyed -> its key
        self._write(
            f"torch {torch.__version__} default {torch.get_default_dtype()} {torch.get_default_device()} "
            f"grad {torch.is_grad_enabled()}"
        )

    def digest(self) -> str:
        return self._hash.hexdigest()

    def _write(self, token: str) -> None:
        self._hash.update(token.encode())
        self._hash.update(b"\x00")

    def model(self, model: nn.Module) -> _Key:
        if any(getattr(module_globals, name, None) for name in _GLOBAL_HOOKS):
            raise _Uncacheable("a global module hook")
        named = [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]
        modules: dict[int, str] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            first = modules.setdefault(id(module), name)  # one block object reused in every layer
            self._write(f"module {name} {self._class(type(module))} training={module.training} as={first}")
            if first == name:
                self._module_state(module, 0)
        # parameters and buffers by shape, dtype and device, not by value: export traces them as fake
        # tensors, and a graph taken from the cache is bound to the capturing model's own
        self._data = False
        tensors: dict[int, str] = {}
        for name, t in named:
            tied = tensors.setdefault(id(t), name)
            self._write(f"tensor {name} {type(t).__name__} as={tied}")
            if type(t) not in (torch.Tensor, nn.Parameter):
                raise _Uncacheable("a tensor subclass as a parameter or buffer")
            self._tensor(t)
        self._data = True
        return self

    def inputs(self, args: tuple, kwargs: dict) -> _Key:
        self._write("inputs")
        self._data = False  # an input's values do not shape the graph (export traces fake tensors)
        self._value((tuple(args), dict(kwargs)), 0)
        # inputs that are one tensor, or views of one memory: export traces the aliasing into the graph
        memories: dict[Any, int] = {}
        leaves = [x for x in pytree.tree_leaves((tuple(args), dict(kwargs))) if isinstance(x, torch.Tensor)]
        for i, t in enumerate(leaves):
            memory = ("meta", id(t)) if t.is_meta else (t.device, t.untyped_storage().data_ptr())
            self._write(f"input {i} memory of {memories.setdefault(memory, i)}")
        return self

    def _module_state(self, module: nn.Module, depth: int) -> None:
        """A module's own attributes (not its submodules, parameters or buffers); hooks refused."""
        if any(getattr(module, hook, None) for hook in _FORWARD_HOOKS):
            raise _Uncacheable(f"a hook on a {type(module).__qualname__}")
        if getattr(module, "_compiled_call_impl", None) is not None:
            raise _Uncacheable(f"a compiled {type(module).__qualname__}")
        for attr, value in _sorted_items(vars(module)):
            if attr not in _MODULE_INTERNALS and attr != "_compiled_call_impl":
                self._write(f"attr {attr}")
                self._value(value, depth + 1)
        self._write(f"non-persistent {sorted(module._non_persistent_buffers_set)}")

    def _shared(self, x: Any) -> bool:
        """Write a reference and return True when `x` (a mutable container or an object) was written
        before in this key: a config or a vocabulary shared by every layer is read once."""
        if id(x) in self._seen:
            self._write(f"same {self._seen[id(x)][0]}")
            return True
        self._seen[id(x)] = (len(self._seen), x)  # x kept alive: its id is not reused while the key is made
        return False

    def _value(self, x: Any, depth: int) -> None:  # noqa: C901, PLR0912 - one branch per kind of value
        if depth > _MAX_DEPTH:
            raise _Uncacheable("nested too deep")
        if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
            self._write(f"{type(x).__name__}:{x!r}")
        elif isinstance(x, (torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format)):
            self._write(f"{type(x).__name__}:{x}")
        elif isinstance(x, enum.Enum):
            self._write(f"enum {self._class(type(x))}.{x.name}")
        elif isinstance(x, torch.Tensor):
            self._tensor(x)
        elif isinstance(x, np.ndarray):
            self._array(x)
        elif isinstance(x, (tuple, list, dict, set, frozenset)):
            if len(x) > MAX_ITEMS:
                raise _Uncacheable(f"a {type(x).__name__} of {len(x)} items")
            if not isinstance(x, tuple) and self._shared(x):
                return
            self._write(f"{type(x).__name__}[{len(x)}]")
            if isinstance(x, dict):
                for k, v in x.items():
                    self._value(k, depth + 1)
                    self._value(v, depth + 1)
            elif isinstance(x, (set, frozenset)):
                items = sorted(repr(item) for item in x)
                if any(" at 0x" in item for item in items):
                    raise _Uncacheable("a set of objects")
                self._write(repr(items))
            else:
                for item in x:
                    self._value(item, depth + 1)
        elif isinstance(x, type):
            self._write(f"class {self._class(x)}")
        elif isinstance(x, types.FunctionType):
            self._function(x, depth)
        elif isinstance(x, (types.MethodType, types.MethodWrapperType)) or (
            isinstance(x, types.BuiltinFunctionType)
            and not isinstance(x.__self__, (types.ModuleType, type(None)))
        ):
            raise _Uncacheable("a bound method (its object's state is not read)")
        elif isinstance(x, (types.BuiltinFunctionType, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            self._write(f"builtin {getattr(x, '__module__', '')}.{getattr(x, '__qualname__', x)}")
        elif isinstance(x, functools.partial):
            self._write("partial")
            self._value(x.func, depth + 1)
            self._value(x.args, depth + 1)
            self._value(x.keywords, depth + 1)
        elif isinstance(x, nn.Module):  # a module held in a plain attribute (outside the module tree)
            if self._shared(x):
                return
            self._write(f"module {self._class(type(x))} training={x.training}")
            self._module_state(x, depth)
            for kind in ("_parameters", "_buffers", "_modules"):
                self._write(kind)
                self._value(getattr(x, kind), depth + 1)
        elif hasattr(x, "__dict__") and not isinstance(x, types.ModuleType) and not callable(x):
            if self._shared(x):  # a config shared by every module: written once, then referred to
                return
            self._write(f"object {self._class(type(x))}")
            for attr, value in _sorted_items(vars(x)):
                if attr in _PER_PROCESS_ATTRS:
                    continue
                self._write(f"attr {attr}")
                self._value(value, depth + 1)
        elif type(x).__module__.startswith("torch") and " at 0x" not in (text := repr(x)):
            self._write(f"value {self._class(type(x))} {text}")  # a pybind enum (torch._C._SDPBackend)
        else:
            raise _Uncacheable(f"an attribute of type {type(x).__qualname__}")

    def _tensor(self, t: torch.Tensor) -> None:
        self._write(
            f"tensor {type(t).__name__} {tuple(t.shape)} {t.stride()} {t.dtype} {t.device.type} "
            f"grad={t.requires_grad}"
        )
        if t.device.type == "meta" or not self._data:
            return
        if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
            raise _Uncacheable("a tensor subclass")
        if t.layout is not torch.strided or t.is_conj() or t.is_neg() or t.is_nested:
            raise _Uncacheable("a tensor of another layout or a lazy view")
        if t.numel() * t.element_size() > MAX_HASHED_BYTES:
            raise _Uncacheable("a large tensor attribute")
        data = t.detach().to("cpu").contiguous().reshape(-1)
        self._hash.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")

    def _array(self, a: np.ndarray) -> None:
        self._write(f"ndarray {a.shape} {a.dtype}")
        if a.dtype.hasobject or a.nbytes > MAX_HASHED_BYTES:
            raise _Uncacheable("an object array or a large array attribute")
        self._hash.update(np.ascontiguousarray(a).tobytes())

    def _function(self, fn: types.FunctionType, depth: int) -> None:
        self._write(f"function {fn.__module__}.{fn.__qualname__} {_code_digest(fn.__code__)}")
        self._value(fn.__defaults__, depth + 1)
        self._value(fn.__kwdefaults__, depth + 1)
        for cell in fn.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                contents = None
            self._value(contents, depth + 1)

    def _class(self, cls: type) -> str:
        """A class's key: its name and a digest of what its class dict holds (method code, closures,
        defaults, properties, class attributes) and of its bases' keys; with the digest of its source
        file when that is not an installed package's (the module-level helpers its methods call). A
        class redefined, made in a factory or patched at run time keys otherwise."""
        known = self._classes.get(id(cls))
        if known is not None:
            return known
        name = f"{cls.__module__}.{cls.__qualname__}"
        if cls is object:
            return name
        self._classes[id(cls)] = name  # a method's `__class__` cell refers back to its class
        installed = _installed(cls)
        body = _Key()
        body._classes, body._seen = self._classes, {}
        for base in cls.__bases__:
            body._write(f"base {self._class(base)}")
        for attr, value in _sorted_items(vars(cls)):
            if attr in _CLASS_NOISE:
                continue
            body._write(f"attr {attr}")
            try:
                body._class_attr(value)
            except _Uncacheable:
                if not installed:
                    raise
                body._write(f"a {type(value).__qualname__}")  # a library class's internals: by kind
        key = f"{name} {body.digest()}"
        path = getattr(sys.modules.get(cls.__module__), "__file__", None)
        if not installed and path:
            stat = os.stat(path)
            key += f"@{path}:{_file_digest(path, stat.st_mtime_ns, stat.st_size)}"
        self._classes[id(cls)] = key
        return key

    def _class_attr(self, value: Any) -> None:
        """One entry of a class dict: functions by code and closure, properties by their functions,
        descriptors of the interpreter by kind, anything else by value."""
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            for fn in (value.fget, value.fset, value.fdel):
                self._class_attr(fn)
        elif isinstance(value, functools.cached_property):
            self._class_attr(value.func)
        elif isinstance(value, types.FunctionType):
            self._function(value, 0)
        elif isinstance(value, type):
            self._write(f"class {value.__module__}.{value.__qualname__}")
        elif isinstance(value, _DESCRIPTORS):
            self._write(type(value).__name__)
        elif isinstance(value, types.BuiltinFunctionType):  # a C slot (`__new__` of a pybind11 class)
            self._write(f"builtin {getattr(value, '__qualname__', value.__name__)}")
        else:
            self._value(value, 0)


# attributes of plain objects whose value differs per process and says nothing about the graph:
# transformers' GenerationConfig keeps hash() of its fields (string hashing is seeded per process) to
# tell whether it was edited
_PER_PROCESS_ATTRS = frozenset({"_original_object_hash"})
# class-dict entries that say nothing about what a model computes
_CLASS_NOISE = frozenset(
    {"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "_abc_impl", "__abstractmethods__",
     "__parameters__", "__orig_bases__", "__annotations__", "__static_attributes__", "__firstlineno__",
     "__dataclass_fields__", "__dataclass_params__"}
)  # fmt: skip
_DESCRIPTORS = (
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
    types.WrapperDescriptorType,
    types.MethodDescriptorType,
    types.ClassMethodDescriptorType,
)


def _sorted_items(d: dict) -> list[tuple[Any, Any]]:
    return sorted(d.items(), key=lambda item: str(item[0]))


def _code_digest(code: types.CodeType) -> str:
    h = hashlib.blake2b(code.co_code, digest_size=12)
    for const in code.co_consts:
        h.update(_const_text(const).encode())
    h.update(repr(code.co_names).encode())
    return h.hexdigest()


def _const_text(const: Any) -> str:
    """A code constant as text that is the same in every process: nested code by digest, a frozenset
    (`x in {"a", "b"}`) sorted, since its order follows string hashing, which differs per process."""
    if isinstance(const, types.CodeType):
        return _code_digest(const)
    if isinstance(const, frozenset):
        return "frozenset(" + ", ".join(sorted(_const_text(item) for item in const)) + ")"
    if isinstance(const, tuple):
        return "(" + ", ".join(_const_text(item) for item in const) + ")"
    return repr(const)


def _installed(cls: type) -> bool:
    """The class comes from the standard library, an installed package or a built-in module (not a
    user's file, nor `__main__` of a REPL or notebook, which has no file)."""
    module = sys.modules.get(cls.__module__)
    if module is None:
        return False
    if cls.__module__ in sys.builtin_module_names:
        return True
    path = getattr(module, "__file__", None)
    return bool(path) and os.path.realpath(path).startswith(_INSTALLED)


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    with open(path, "rb") as f:
        return hashlib.blake2b(f.read(), digest_size=12).hexdigest()

"""A process-wide cache of captures of meta-device models (`planner.frontend.capture.capture`).

Why: torch.export costs about 3 ms per ATen op on this project's CPUs (fake-tensor dispatch and
tracing), about a second for a small model, and one process often captures the same model at the
same shapes several times: `planner optimize` captures it to plan and again to check the lowering
and price the baseline; a rank that runs several jobs of one model builds each job's module afresh.
Measured over the test suite (2026-12-05): 1,304 captures, 460 of them of a meta model that process
had already captured at the same input shapes.

What makes two captures the same (`cache_key`): every parameter and buffer on the meta device (a
model holding real tensors is never cached: its graph carries them); the module tree (names, each
module's training flag, every plain attribute by value, config objects included; parameter and
buffer names, shapes, dtypes, requires_grad, and which are tied); each module's class by what its
class dicts hold along the MRO (method code, closures, defaults, properties, class attributes: a
class redefined, made in a factory or patched at run time keys otherwise) and, for a class outside
an installed package, the digest of its source file (the module-level helpers it calls); the inputs
(tensor shapes, strides, dtypes and devices; other leaves by value); torch's default dtype and
device and grad mode. Anything the key cannot read for certain makes the capture uncached: a forward
hook, a compiled module, a bound method or an object of unknown kind as an attribute, a real tensor
attribute over `MAX_HASHED_BYTES`, a container over `MAX_ITEMS` items, any error while reading. What
it does not see: a module-level global of the model's file changed after the file was loaded, or a
library function the model calls patched at run time (the planner does neither; set
``PLANNER_CAPTURE_CACHE=off`` to capture every time).

A hit returns a deep copy of the stored graph (the passes rewrite the graph they get) and replays what
the capture printed and warned.
"""

from __future__ import annotations

import copy
import enum
import functools
import hashlib
import os
import sys
import sysconfig
import types
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch import fx, nn
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
    """A stored capture: the normalised graph, and what torch.export printed (``stderr``) and warned."""

    gm: fx.GraphModule
    stderr: str
    warned: list[warnings.WarningMessage]


_entries: OrderedDict[str, CachedCapture] = OrderedDict()


def enabled() -> bool:
    """False when the environment sets PLANNER_CAPTURE_CACHE to off / 0 / false / no."""
    return os.environ.get("PLANNER_CAPTURE_CACHE", "on").strip().lower() not in ("off", "0", "false", "no")


def lookup(key: str | None) -> CachedCapture | None:
    """The entry stored under `key` with its graph deep-copied (the caller may rewrite it), or None."""
    if key is None or not enabled():
        return None
    entry = _entries.get(key)
    if entry is None:
        return None
    _entries.move_to_end(key)
    return CachedCapture(_copy(entry.gm), entry.stderr, list(entry.warned))


def store(key: str | None, gm: fx.GraphModule, stderr: str, warned: list[warnings.WarningMessage]) -> None:
    """Keep a deep copy of `gm` under `key` (None: nothing kept), dropping the least recently used entry
    past `MAX_ENTRIES`."""
    if key is None or not enabled():
        return
    _entries[key] = CachedCapture(_copy(gm), stderr, list(warned))
    _entries.move_to_end(key)
    while len(_entries) > MAX_ENTRIES:
        _entries.popitem(last=False)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` sharing nothing mutable with it: GraphModule's deepcopy copies each node's meta
    dict shallowly (its fake tensors, module stacks and lists stay shared)."""
    out = copy.deepcopy(gm)
    for node in out.graph.nodes:
        # fake tensors cannot be deep-copied (no data pointer) and are not changed in place: shared
        memo = {id(leaf): leaf for leaf in pytree.tree_leaves(node.meta) if isinstance(leaf, torch.Tensor)}
        try:
            node.meta = copy.deepcopy(node.meta, memo)
        except Exception:  # noqa: BLE001 - something in the meta that does not copy: its top level only
            node.meta = dict(node.meta)
    return out


def clear() -> None:
    """Forget every stored capture."""
    _entries.clear()


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
        # first, before any attribute is read or hashed: a model with real weights (the reference) is never kept
        if any(t.device.type != "meta" for _, t in named):
            raise _Uncacheable("the model holds data")
        for name, module in model.named_modules(remove_duplicate=False):
            self._write(f"module {name} {self._class(type(module))} training={module.training}")
            self._module_state(module, 0)
        tensors: dict[int, str] = {}
        for name, t in named:
            tied = tensors.setdefault(id(t), name)
            self._write(f"tensor {name} {type(t).__name__} as={tied}")
            self._tensor(t)
        return self

    def inputs(self, args: tuple, kwargs: dict) -> _Key:
        self._write("inputs")
        self._data = False  # an input's values do not shape the graph (export traces fake tensors)
        self._value((tuple(args), dict(kwargs)), 0)
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
        h.update(_code_digest(const).encode() if isinstance(const, types.CodeType) else repr(const).encode())
    h.update(repr(code.co_names).encode())
    return h.hexdigest()


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

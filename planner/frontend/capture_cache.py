"""A process-wide cache of captures of meta-device models (`planner.frontend.capture.capture`).

Why: torch.export costs about 3 ms per ATen op on this project's CPUs (fake-tensor dispatch and
tracing), about a second for a small model, and one process often captures the same model at the
same shapes several times: `planner optimize` captures it to plan and again to check the lowering
and price the baseline; a rank that runs several jobs of one model builds each job's module afresh.
Measured over the test suite (2026-12-05): 1,304 captures, 460 of them of a meta model that process
had already captured at the same input shapes.

What makes two captures the same (`cache_key`): every parameter and buffer on the meta device (a
model holding real tensors is never cached: its graph carries them), the module tree (names, each
module's class by qualified name and, for a class outside an installed package, the digest of its
source file; training flag; every plain attribute, config objects included, by value; parameter and
buffer names, shapes, dtypes, requires_grad, and which are tied), the inputs (tensor shapes, dtypes and
devices; other leaves by value) and torch's default dtype and grad mode. Anything the key cannot
read for certain makes the capture uncached: a forward hook, a compiled module, a bound method or an
object of unknown kind as an attribute, a class defined inside a function, a tensor attribute over
`MAX_HASHED_BYTES`. What it does not see: a module-level global of the model's file changed after
the file was loaded (the planner never does; set ``PLANNER_CAPTURE_CACHE=off`` to capture every
time).

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

import torch
from torch import fx, nn
from torch.nn.modules import module as module_globals

MAX_ENTRIES = 16  # graphs kept (least recently used dropped); a meta graph holds no tensor data
MAX_HASHED_BYTES = 64 * 2**20  # a real tensor attribute larger than this makes the capture uncached
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
    return CachedCapture(copy.deepcopy(entry.gm), entry.stderr, list(entry.warned))


def store(key: str | None, gm: fx.GraphModule, stderr: str, warned: list[warnings.WarningMessage]) -> None:
    """Keep a deep copy of `gm` under `key` (None: nothing kept), dropping the least recently used entry
    past `MAX_ENTRIES`."""
    if key is None or not enabled():
        return
    _entries[key] = CachedCapture(copy.deepcopy(gm), stderr, list(warned))
    _entries.move_to_end(key)
    while len(_entries) > MAX_ENTRIES:
        _entries.popitem(last=False)


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
    except _Uncacheable:
        return None


class _Key:
    """A canonical token stream of a model and its inputs, hashed as it is written."""

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=20)
        self._seen: dict[int, int] = {}  # id of an object already written -> its index (shared configs)
        self._data = True  # a real tensor's values are part of the key (the graph keeps them as constants)
        self._write(
            f"torch {torch.__version__} default {torch.get_default_dtype()} grad {torch.is_grad_enabled()}"
        )

    def digest(self) -> str:
        return self._hash.hexdigest()

    def _write(self, token: str) -> None:
        self._hash.update(token.encode())
        self._hash.update(b"\x00")

    def model(self, model: nn.Module) -> _Key:
        if any(getattr(module_globals, name, None) for name in _GLOBAL_HOOKS):
            raise _Uncacheable("a global module hook")
        for name, module in model.named_modules(remove_duplicate=False):
            self._write(f"module {name} {_class_key(type(module))} training={module.training}")
            if any(getattr(module, hook, None) for hook in _FORWARD_HOOKS):
                raise _Uncacheable(f"a hook on {name}")
            if getattr(module, "_compiled_call_impl", None) is not None:
                raise _Uncacheable(f"{name} is compiled")
            for attr, value in sorted(vars(module).items()):
                if attr not in _MODULE_INTERNALS and attr != "_compiled_call_impl":
                    self._write(f"attr {attr}")
                    self._value(value, 0)
            self._write(f"non-persistent {sorted(module._non_persistent_buffers_set)}")
        tensors: dict[int, str] = {}
        named = [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]
        for name, t in named:
            if t.device.type != "meta":
                raise _Uncacheable(f"{name} holds data")
            tied = tensors.setdefault(id(t), name)
            self._write(
                f"tensor {name} {type(t).__name__} {tuple(t.shape)} {t.dtype} {t.stride()} grad={t.requires_grad} as={tied}"
            )
        return self

    def inputs(self, args: tuple, kwargs: dict) -> _Key:
        self._write("inputs")
        self._data = False  # an input's values do not shape the graph (export traces fake tensors)
        self._value((tuple(args), dict(kwargs)), 0)
        return self

    def _value(self, x: Any, depth: int) -> None:  # noqa: C901, PLR0912 - one branch per kind of value
        if depth > _MAX_DEPTH:
            raise _Uncacheable("nested too deep")
        if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
            self._write(f"{type(x).__name__}:{x!r}")
        elif isinstance(x, (torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format)):
            self._write(f"{type(x).__name__}:{x}")
        elif isinstance(x, enum.Enum):
            self._write(f"enum {_class_key(type(x))}.{x.name}")
        elif isinstance(x, torch.Tensor):
            self._tensor(x)
        elif isinstance(x, (tuple, list)):
            self._write(f"{type(x).__name__}[{len(x)}]")
            for item in x:
                self._value(item, depth + 1)
        elif isinstance(x, dict):
            self._write(f"{type(x).__name__}{{{len(x)}}}")
            for k, v in x.items():
                self._value(k, depth + 1)
                self._value(v, depth + 1)
        elif isinstance(x, (set, frozenset)):
            items = sorted(repr(item) for item in x)
            if any(" at 0x" in item for item in items):
                raise _Uncacheable("a set of objects")
            self._write(f"{type(x).__name__}{items}")
        elif isinstance(x, type):
            self._write(f"class {_class_key(x)}")
        elif isinstance(x, types.FunctionType):
            self._function(x, depth)
        elif isinstance(x, (types.BuiltinFunctionType, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            self._write(f"builtin {getattr(x, '__module__', '')}.{getattr(x, '__qualname__', x)}")
        elif isinstance(x, functools.partial):
            self._write("partial")
            self._value(x.func, depth + 1)
            self._value(x.args, depth + 1)
            self._value(x.keywords, depth + 1)
        elif isinstance(x, nn.Module):  # a module held in a plain attribute (outside the module tree)
            if id(x) in self._seen:
                self._write(f"same {self._seen[id(x)]}")
                return
            self._seen[id(x)] = len(self._seen)
            if any(getattr(x, hook, None) for hook in _FORWARD_HOOKS):
                raise _Uncacheable(f"a hook on a {type(x).__qualname__}")
            self._write(f"module {_class_key(type(x))} training={x.training}")
            for attr, value in sorted(vars(x).items()):
                if attr not in _MODULE_INTERNALS or attr in ("_parameters", "_buffers", "_modules"):
                    self._write(f"attr {attr}")
                    self._value(value, depth + 1)
        elif (
            hasattr(x, "__dict__")
            and not isinstance(x, (types.ModuleType, types.MethodType))
            and not callable(x)
        ):
            if id(x) in self._seen:  # a config shared by every module: written once, then referred to
                self._write(f"same {self._seen[id(x)]}")
                return
            self._seen[id(x)] = len(self._seen)
            self._write(f"object {_class_key(type(x))}")
            for attr, value in sorted(vars(x).items()):
                self._write(f"attr {attr}")
                self._value(value, depth + 1)
        elif _installed(type(x)) and " at 0x" not in (text := repr(x)):  # a library's enum (torch._C)
            self._write(f"value {_class_key(type(x))} {text}")
        else:
            raise _Uncacheable(f"an attribute of type {type(x).__qualname__}")

    def _tensor(self, t: torch.Tensor) -> None:
        self._write(
            f"tensor {type(t).__name__} {tuple(t.shape)} {t.dtype} {t.device.type} grad={t.requires_grad}"
        )
        if t.device.type == "meta" or not self._data:
            return
        if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
            raise _Uncacheable("a tensor subclass")
        if t.numel() * t.element_size() > MAX_HASHED_BYTES:
            raise _Uncacheable("a large tensor attribute")
        data = t.detach().to("cpu").contiguous().reshape(-1)
        self._hash.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")

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


def _code_digest(code: types.CodeType) -> str:
    h = hashlib.blake2b(code.co_code, digest_size=12)
    for const in code.co_consts:
        h.update(_code_digest(const).encode() if isinstance(const, types.CodeType) else repr(const).encode())
    h.update(repr(code.co_names).encode())
    return h.hexdigest()


_keying: set[type] = set()  # local classes whose key is being made (their methods' cells refer to them)


def _installed(cls: type) -> bool:
    """The class comes from the standard library, an installed package or a built-in module."""
    path = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return cls.__module__ in sys.modules and (not path or os.path.realpath(path).startswith(_INSTALLED))


def _class_key(cls: type) -> str:
    """`module.qualname` of a class, with the digest of its source file when that file is not part of an
    installed package (the user's model file, which may change between loads). A class made inside a
    function (`<locals>`) adds its functions' closures: its methods may read the maker's variables."""
    module = sys.modules.get(cls.__module__)
    if module is None:  # its source cannot be told apart from another file's under the same name
        raise _Uncacheable(f"the module of {cls.__qualname__} is not imported")
    key = f"{cls.__module__}.{cls.__qualname__}"
    if "<locals>" in cls.__qualname__ and cls not in _keying:  # (a method's `__class__` cell: itself)
        _keying.add(cls)
        try:
            closures = _Key()
            for name, fn in sorted(vars(cls).items()):
                if isinstance(fn, (types.FunctionType, staticmethod, classmethod)):
                    closures._write(name)
                    closures._function(getattr(fn, "__func__", fn), 0)
            key += f" closures {closures.digest()}"
        finally:
            _keying.discard(cls)
    path = getattr(module, "__file__", None)
    if _installed(cls):
        return key
    try:
        stat = os.stat(path)
    except OSError as e:
        raise _Uncacheable(f"{path} cannot be read") from e
    return f"{key}@{path}:{_file_digest(path, stat.st_mtime_ns, stat.st_size)}"


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    with open(path, "rb") as f:
        return hashlib.blake2b(f.read(), digest_size=12).hexdigest()

"""Load a user's model file: a Python file defining the model and its example inputs.

The contract (what `planner optimize model.py` needs):

    def build_model() -> torch.nn.Module: ...
    def example_inputs(batch_size=2, seq_len=16) -> tuple: ...   # the positional args of forward
    def example_kwargs() -> dict: ...                              # optional, e.g. {"use_cache": False}

`example_inputs` may take keyword arguments `batch_size` and `seq_len`; the planner passes them when
the user (or a workload, e.g. decode with `seq_len=1`) overrides the example sizes.

A model with a static KV cache (serving: `--workload decode|generate`) also defines

    def build_model(max_batch_size=2, max_seq_len=64) -> torch.nn.Module: ...  # caches allocated
    def step_inputs(tokens, input_pos) -> tuple: ...  # forward args: tokens (B, T) at positions (T,)

`build_model` allocates the caches for `max_batch_size` sequences of `max_seq_len` tokens, and a
forward call writes the new tokens' K/V into them at `input_pos` (prefill: `arange(P)`; decode: one
position). `example_inputs(batch_size, seq_len)` is then a prefill of `seq_len` tokens.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from planner.errors import InputError, PlannerError

_EXAMPLE = """    import torch
    def build_model(): return MyModel()
    def example_inputs(batch_size=2, seq_len=16): return (torch.randint(0, 1000, (batch_size, seq_len)),)"""

_REQUIRED = ("build_model", "example_inputs")


def batch_and_seq(inputs: list[torch.Tensor]) -> tuple[int, int]:
    """(B, T) of a model's input tensors as the planner reads them (`ModelStructure.batch_size` /
    `seq_len`): of the token ids (the first integer input) if there are any, else of the first input,
    whose (B, T, features) has T rows per sample and whose images (B, C, H, W) or vectors (B, F) have
    no sequence (T = 1). (1, 1) without a tensor of at least one dimension."""
    ints = [v for v in inputs if not v.is_floating_point() and v.dim() >= 1]
    x = ints[0] if ints else (inputs[0] if inputs else None)
    if x is None or x.dim() == 0:
        return 1, 1
    if ints:
        return x.shape[0], (x.shape[1] if x.dim() > 1 else 1)
    return x.shape[0], (x.shape[1] if x.dim() == 3 else 1)


@dataclass
class ModelFile:
    """A loaded model file. `path` is absolute; `module` is the imported Python module."""

    path: str
    module: ModuleType

    @property
    def name(self) -> str:
        """The file's stem, e.g. "llama3_70b" (used to name plans and outputs)."""
        return os.path.splitext(os.path.basename(self.path))[0]

    @property
    def has_cache(self) -> bool:
        """Whether the file describes a model with a static KV cache (it defines `step_inputs`)."""
        return callable(getattr(self.module, "step_inputs", None))

    def build(
        self, device: str = "cpu", max_batch_size: int | None = None, max_seq_len: int | None = None
    ) -> nn.Module:
        """Call `build_model()` under `torch.device(device)` and return the model in eval mode.

        With device="meta" no weight memory is allocated. A model file may build on the meta device
        itself (the published large configs do); that wins over `device`. `max_batch_size` /
        `max_seq_len` (cached models: the KV-cache allocation) are passed when given.
        Raises InputError if build_model raises, does not accept the cache sizes asked for, or does
        not return an nn.Module.
        """
        sizes = {
            k: v
            for k, v in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len))
            if v is not None
        }
        if sizes:
            params = inspect.signature(self.module.build_model).parameters
            missing = [k for k in sizes if k not in params]
            if missing:
                raise InputError(
                    f"{self.path}: build_model() does not accept {', '.join(missing)}; a model with a KV "
                    "cache allocates it in build_model(max_batch_size, max_seq_len) (docs/model-files.md, models with a KV cache)"
                )
        with torch.device(device):
            model = self._call("build_model", **sizes)
        if not isinstance(model, nn.Module):
            raise InputError(
                f"{self.path}: build_model() returned {type(model).__name__}, expected a torch.nn.Module"
            )
        return model.eval()

    def inputs(
        self, batch_size: int | None = None, seq_len: int | None = None, device: str | None = None
    ) -> tuple[tuple, dict]:
        """The example (args, kwargs) for forward, tensors moved to `device` (None: left where
        example_inputs put them).

        `batch_size` / `seq_len` (None: the file's defaults) are passed to `example_inputs` as
        keyword arguments. Inputs on the meta device are fine for planning (only shapes and dtypes
        are read) and left on meta when `device` is None or "meta". Raises InputError if it does
        not accept an override asked for, if it returns something other than a tuple (a single
        tensor is wrapped), or if it returns meta tensors and a real `device` is asked for (running
        needs input values).
        """
        fn = self.module.example_inputs
        overrides = {k: v for k, v in (("batch_size", batch_size), ("seq_len", seq_len)) if v is not None}
        params = inspect.signature(fn).parameters
        takes_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        missing = [k for k in overrides if k not in params and not takes_var_kw]
        args = self._call("example_inputs", **{k: v for k, v in overrides.items() if k not in missing})
        if isinstance(args, torch.Tensor):
            args = (args,)
        if isinstance(args, list):
            args = tuple(args)
        if not isinstance(args, tuple):
            raise InputError(
                f"{self.path}: example_inputs() returned {type(args).__name__}, expected a tuple of forward args"
            )
        kwargs: dict[str, Any] = {}
        if hasattr(self.module, "example_kwargs"):
            # given the same batch_size / seq_len as example_inputs when it takes them (a padding mask)
            kw_params = inspect.signature(self.module.example_kwargs).parameters
            kw_var = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in kw_params.values())
            kwargs = self._call(
                "example_kwargs", **{k: v for k, v in overrides.items() if kw_var or k in kw_params}
            )
            if not isinstance(kwargs, dict):
                raise InputError(
                    f"{self.path}: example_kwargs() returned {type(kwargs).__name__}, expected a dict"
                )

        # a size it does not take is fine when its inputs already have it (a run asks for the plan's
        # batch and sequence, which came from these very inputs when no --batch-size / --seq-len was
        # given), read as the plan read them (`batch_and_seq`: an image batch has no sequence, T = 1)
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        have = dict(zip(("batch_size", "seq_len"), batch_and_seq(tensors), strict=True))
        differ = [k for k in missing if have[k] != overrides[k]]
        if differ:
            raise InputError(
                f"{self.path}: example_inputs() does not accept {', '.join(differ)}, which was asked for "
                f"({', '.join(f'{k}={overrides[k]}' for k in differ)}); give it keyword arguments, e.g.\n"
                "    def example_inputs(batch_size=2, seq_len=16): ..."
            )

        leaves = pytree.tree_leaves((args, kwargs))
        if device is not None and torch.device(device).type != "meta":
            if any(isinstance(x, torch.Tensor) and x.is_meta for x in leaves):
                raise InputError(
                    f"{self.path}: example_inputs() returned tensors on the meta device, which have no values; "
                    "planning works with them, but running needs real inputs: return CPU tensors from "
                    "example_inputs (e.g. torch.randint(0, vocab, (batch_size, seq_len)))"
                )

        def move(x: Any) -> Any:
            return x.to(device) if isinstance(x, torch.Tensor) and device is not None else x

        return pytree.tree_map(move, (args, dict(kwargs)))

    def step_inputs(
        self, tokens: torch.Tensor, input_pos: torch.Tensor, device: str = "cpu"
    ) -> tuple[tuple, dict]:
        """(args, kwargs) of one step of a cached model: tokens (B, T) int64 at positions (T,) int64.

        Raises InputError if the file defines no `step_inputs` or it returns something other than a
        tuple (a single tensor is wrapped)."""
        if not self.has_cache:
            raise InputError(
                f"{self.path}: no step_inputs(tokens, input_pos); serving workloads need a model with a "
                "static KV cache (docs/model-files.md, models with a KV cache)"
            )
        args = self._call("step_inputs", tokens=tokens, input_pos=input_pos)
        if isinstance(args, torch.Tensor):
            args = (args,)
        if isinstance(args, list):
            args = tuple(args)
        if not isinstance(args, tuple):
            raise InputError(f"{self.path}: step_inputs() returned {type(args).__name__}, expected a tuple")
        kwargs: dict[str, Any] = (
            self._call("example_kwargs") if hasattr(self.module, "example_kwargs") else {}
        )

        def move(x: Any) -> Any:
            return x.to(device) if isinstance(x, torch.Tensor) else x

        return pytree.tree_map(move, (args, dict(kwargs)))

    def check_step_positions(self) -> None:
        """Refuse a `step_inputs` whose non-tensor leaves change with the position: torch.export freezes
        a Python number into the captured graph (a slice assignment's `start` given as `int`), so every
        step of the plan, and the reference it is checked against, would write the cache and apply
        RoPE and the mask at the captured position, and agree with each other while both are wrong.
        Raises InputError naming the leaf."""
        tokens = torch.zeros(1, 1, dtype=torch.long)
        leaves = [pytree.tree_flatten(self.step_inputs(tokens, torch.tensor([pos])))[0] for pos in (1, 2)]
        for i, (a, b) in enumerate(zip(*leaves)):
            if not isinstance(a, torch.Tensor) and a != b:
                raise InputError(
                    f"{self.path}: step_inputs returns a Python {type(a).__name__} that changes with the "
                    f"position (input {i}: {a!r} at position 1, {b!r} at position 2); the captured graph "
                    "keeps the value it was traced with, so every step would run at that one position. Pass "
                    "the position as a tensor (input_pos) and write the cache indexed by it: cache[:, :, input_pos] = k "
                    "or cache.index_copy_(2, input_pos, k) (docs/serving.md, the model file)"
                )

    def _call(self, name: str, **kwargs: Any) -> Any:
        fn = getattr(self.module, name)
        try:
            inspect.signature(fn).bind(**kwargs)
        except TypeError as e:  # the call itself would fail in the planner's frame: name the definition
            raise InputError(
                f"{defined_at(fn) or self.path}: {name}() cannot be called as the planner calls it ({e}); "
                f"{_SIGNATURES.get(name, 'give its parameters default values')}"
            ) from None
        except ValueError:  # no signature to read (a builtin): call it and report what it raises
            pass
        try:
            return fn(**kwargs)
        except PlannerError:
            raise
        except (Exception, SystemExit) as e:  # any error in user code -> one message naming the line
            text = str(e)
            if (
                isinstance(e, MemoryError)
                or "can't allocate memory" in text
                or "out of memory" in text.lower()
            ):
                asked = ", ".join(f"{k}={v}" for k, v in kwargs.items())
                need = re.search(r"allocate (\d+) bytes", text)
                size = f" ({int(need.group(1)) / 1e9:.1f} GB)" if need else ""
                raise InputError(
                    f"{self.path}: {name}({asked}) ran out of memory allocating what it returns{size}: the planner "
                    "builds the model on the meta device, but this function's tensors as the file makes them; "
                    "give a smaller --batch-size / --seq-len"
                ) from None
            raise InputError(f"{self.path}: {name}() raised {_describe(e, self.path)}") from e


def load_model_file(path: str | os.PathLike[str]) -> ModelFile:
    """Import the model file at `path` and check it defines build_model and example_inputs.

    The file is imported under a unique module name; its directory is put on sys.path (once) so
    that it can import modules next to it. Raises InputError: file missing or not a .py file,
    an exception while importing it (with the file:line), or missing functions.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        raise InputError(
            f"model file {path} is a folder; give the model's .py file (e.g. examples/llama3.py)"
        )
    if not os.path.isfile(path):
        raise InputError(f"model file not found: {path}")
    if not path.endswith(".py"):
        raise InputError(f"model file must be a Python file (*.py): {path}")
    directory = os.path.dirname(path)
    # the planner's own top-level packages, imported before the model's folder goes first on sys.path:
    # a runtime.py, passes.py or costmodels.py of the user's there would otherwise stand in for them
    # when the planner imports one of their modules later ("'runtime' is not a package")
    for package in _OWN_PACKAGES:
        importlib.import_module(package)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    stem = os.path.splitext(os.path.basename(path))[0]
    module_name = f"planner_model_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise InputError(f"cannot import model file {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # user code: report the line, keep the cause
        del sys.modules[module_name]
        clash = [n for n in _OWN_PACKAGES if os.path.exists(os.path.join(directory, f"{n}.py"))]
        named = [n for n in clash if getattr(e, "name", None) == n or f"'{n}'" in str(e)] or clash
        hint = (
            f"; note: {' and '.join(f'{n}.py' for n in named)} next to the model "
            f"{'has the name' if len(named) == 1 else 'have the names'} of the planner's own "
            f"package{'s' if len(named) > 1 else ''}, which the planner loaded first, so an `import` of "
            f"{'it' if len(named) == 1 else 'them'} gives the planner's: rename your module"
            if clash and isinstance(e, (ImportError, AttributeError))
            else ""
        )
        raise InputError(f"importing model file {path} raised {_describe(e, path)}{hint}") from e
    missing = [name for name in _REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise InputError(
            f"model file {path} does not define {' and '.join(missing)}; a model file defines "
            f"build_model() -> nn.Module and example_inputs() -> tuple, e.g.\n{_EXAMPLE}"
        )
    return ModelFile(path=path, module=module)


# the planner's top-level packages (pyproject.toml's packages), whose names a user's module beside the
# model could shadow
_OWN_PACKAGES = ("planner", "passes", "runtime", "costmodels")

# how the planner calls each function of a model file (docs/model-files.md)
_SIGNATURES = {
    "build_model": "define it as build_model() with no required parameters (a model with a KV cache: "
    "build_model(max_batch_size=..., max_seq_len=...))",
    "example_inputs": "define it as example_inputs() with no required parameters, optionally taking "
    "batch_size=... and seq_len=... (e.g. def example_inputs(batch_size=2, seq_len=16))",
    "example_kwargs": "define it as example_kwargs() with no required parameters, optionally taking "
    "batch_size=... and seq_len=...",
    "step_inputs": "define it as step_inputs(tokens, input_pos)",
}


def defined_at(fn: Any) -> str | None:
    """ "path:line" where the Python function (or bound method) `fn` is defined; None for one without
    Python code (a builtin). Error messages point the user at their own definition with it."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return f"{os.path.abspath(code.co_filename)}:{code.co_firstlineno}"


def _describe(exc: BaseException, path: str) -> str:
    """'ValueError: msg (at /x/model.py:12: line)': the innermost frame in `path`, else the last frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    in_file = [f for f in frames if os.path.abspath(f.filename) == path]
    frame = in_file[-1] if in_file else (frames[-1] if frames else None)
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f"{exc.filename}:{exc.lineno}"
    elif frame is not None:
        where = f"{frame.filename}:{frame.lineno}" + (f": {frame.line.strip()}" if frame.line else "")
    else:
        where = "unknown location"
    if isinstance(exc, SystemExit):  # sys.exit() or argparse in code the planner imports and calls
        return (
            f"SystemExit (sys.exit({exc.code!r}), at {where}): the planner imports a model file and calls its "
            "functions; put script code (argument parsing, a main()) under if __name__ == '__main__':"
        )
    return f"{type(exc).__name__}: {exc} (at {where})"

"""Weight checkpoints in the safetensors format, read one tensor slice at a time.

A rank of a tensor-parallel plan needs only its shard of each weight. `SafetensorsCheckpoint` opens
one or more `.safetensors` files (`safetensors.safe_open`, memory-mapped) and `read_shard` reads the
rows (or columns) of one rank's shard with `get_slice`, so the rank never materialises the whole
tensor: the pages of the mapped file that hold other ranks' rows are not touched.

    checkpoint_files(path)                   -> the .safetensors files of a file or a directory
    save_checkpoint(tensors, path)           -> one .safetensors file (aliased tensors stored once each)
    SafetensorsCheckpoint(files).read_shard(name, dim, parts, rank, tp, pad)
    load_whole(model, files)                 -> every tensor of a model, by name (the unsharded reference)

The shard is the one `passes.placement.shard_weight` cuts from the whole tensor (contiguous 1/tp
chunk per fused part, vocabulary zero-padded to a multiple of tp), byte for byte.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from passes.placement import padded_size
from planner.errors import InputError
from planner.files import fix_file_permissions

SUFFIX = ".safetensors"


def checkpoint_files(path: str | os.PathLike[str] | Sequence[str]) -> list[str]:
    """The safetensors files named by `path`: one `.safetensors` file, a directory (its
    `*.safetensors` files, sorted), or a list of either. Raises InputError naming the path when it
    does not exist, is not a safetensors file, or is a directory without any."""
    if isinstance(path, (list, tuple)):
        return [f for p in path for f in checkpoint_files(p)]
    p = Path(os.fspath(path))
    if p.is_dir():
        files = sorted(str(f) for f in p.glob(f"*{SUFFIX}"))
        if not files:
            raise InputError(f"weights directory {p} holds no {SUFFIX} files")
        return files
    if not p.exists():
        made_by = (
            "; it is made by `python bench/ladder_quality.py` (README: Ladder residual: quality)"
            if p.name == "llama_small_lm.safetensors"
            else ""
        )
        raise InputError(f"weights file {p} does not exist{made_by}")
    if p.suffix != SUFFIX:
        raise InputError(
            f"weights file {p} is not a {SUFFIX} file (save one with safetensors.torch.save_file)"
        )
    return [str(p)]


def save_checkpoint(
    tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str], metadata: dict[str, str] | None = None
) -> None:
    """Write `tensors` (name -> CPU or device tensor) to one safetensors file at `path`, with the
    header's string ``metadata`` (the product's own outputs say they wrote it: `planner.files.written_kind`).

    safetensors refuses tensors that share memory (tied weights); every name after the first of a
    shared storage is stored as its own copy, so each name can be read on its own.
    """
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu")
        key = t.untyped_storage().data_ptr()
        out[name] = t.clone().contiguous() if key in seen else t.contiguous()
        seen.add(key)
    save_file(out, os.fspath(path), metadata=metadata)
    fix_file_permissions(path)  # safetensors creates the file with mode 0600


class SafetensorsCheckpoint:
    """Read-only view of the tensors of one or more safetensors files, by name.

    Use as a context manager (or call `close`) to unmap the files. Raises InputError when a file
    cannot be opened or two files hold the same name.
    """

    def __init__(self, files: Sequence[str]):
        self._handles = []
        self._where: dict[str, object] = {}
        for file in files:
            try:
                handle = safe_open(file, framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types for a bad header
                self.close()
                raise InputError(f"cannot read weights file {file}: {exc}") from exc
            self._handles.append(handle)
            for name in handle.keys():
                if name in self._where:
                    self.close()
                    raise InputError(f"tensor `{name}` is in more than one weights file (second: {file})")
                self._where[name] = handle

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the file handles (and their mappings)."""
        self._handles.clear()
        self._where.clear()

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        """Every tensor name in the files."""
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of `name`. Raises KeyError when absent."""
        return tuple(self._where[name].get_slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor `name` (a copy in memory). Raises KeyError when absent."""
        return self._where[name].get_tensor(name)

    def read_rows(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Indices start:stop of dim `dim` of `name`, the other dims whole; only those are read."""
        index = (slice(None),) * dim + (slice(start, stop),)
        return self._where[name].get_slice(name)[index]

    def read_shard(
        self,
        name: str,
        dim: int,
        parts: Sequence[int] | None,
        rank: int,
        tp: int,
        pad: bool = False,
        pieces: int | None = None,
    ) -> torch.Tensor:
        """Rank `rank`'s shard of `name` along `dim`, as `passes.placement.shard_weight` cuts it from
        the whole tensor (`pieces`: a piece shared by tp / pieces ranks), reading only the shard's
        slices. Raises ValueError when a size does not divide by tp (after padding a vocabulary when
        `pad`) or by `pieces`."""
        size = self.shape(name)[dim]
        if pieces is not None:
            if parts or tp % pieces or size % pieces:
                raise ValueError(
                    f"`{name}`: size {size} of dim {dim} cannot be cut into {pieces} pieces over tp={tp}"
                )
            chunk, index = size // pieces, rank * pieces // tp
            return self.read_rows(name, dim, index * chunk, (index + 1) * chunk).contiguous()
        if pad and not parts and size % tp:
            chunk = padded_size(size, tp) // tp
            start, stop = rank * chunk, (rank + 1) * chunk
            got = self.read_rows(name, dim, min(start, size), min(stop, size))
            missing = chunk - got.shape[dim]
            if missing:
                extra = list(got.shape)
                extra[dim] = missing
                got = torch.cat([got, got.new_zeros(extra)], dim=dim)
            return got.contiguous()
        pieces = []
        offset = 0
        for part in list(parts) if parts else [size]:
            if part % tp:
                raise ValueError(f"`{name}`: size {part} of dim {dim} does not divide by tp={tp}")
            chunk = part // tp
            pieces.append(self.read_rows(name, dim, offset + rank * chunk, offset + (rank + 1) * chunk))
            offset += part
        return torch.cat(pieces, dim=dim).contiguous() if len(pieces) > 1 else pieces[0].contiguous()


def load_whole(model: torch.nn.Module, weights: str | Sequence[str], help_text: str = "") -> None:
    """Replace every parameter and buffer of `model` by the tensor of the same name in the
    safetensors files `weights` (a tied weight may be stored under any one of its names; the tie is
    kept). Non-persistent buffers absent from the files keep the model's value. Raises InputError
    naming missing tensors or shapes that do not fit (followed by `help_text`)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        groups.setdefault(id(tensor), []).append(name)
    persistent = set(model.state_dict())
    with SafetensorsCheckpoint(checkpoint_files(weights)) as source:
        missing = [
            names[0] for names in groups.values() if any(n in persistent for n in names)
            and not any(n in source for n in names)
        ]  # fmt: skip
        if missing:
            raise InputError(
                f"the weights {weights} lack {len(missing)} tensors of the model, e.g. {missing[:3]}; {help_text}"
            )
        for names in groups.values():
            stored = next((n for n in names if n in source), None)
            if stored is None:
                continue  # a non-persistent buffer: the model's own value (meta ones are refused later)
            first = (
                model.get_parameter(names[0]) if is_parameter(model, names[0]) else model.get_buffer(names[0])
            )
            value = source.read(stored)
            if tuple(value.shape) != tuple(first.shape):
                raise InputError(
                    f"the weights {weights} do not fit the model: `{stored}` is {tuple(value.shape)}, "
                    f"the model's is {tuple(first.shape)}"
                )
            value = value.to(first.dtype)
            if isinstance(first, torch.nn.Parameter):
                value = torch.nn.Parameter(value, requires_grad=first.requires_grad)
            for name in names:  # every alias gets the same object: a tied weight stays tied
                owner_path, _, leaf = name.rpartition(".")
                owner = model.get_submodule(owner_path)
                (owner._parameters if leaf in owner._parameters else owner._buffers)[leaf] = value


def is_parameter(model: torch.nn.Module, name: str) -> bool:
    """Whether `name` (an FQN) is a parameter of `model` (else a buffer)."""
    owner_path, _, leaf = name.rpartition(".")
    return leaf in model.get_submodule(owner_path)._parameters

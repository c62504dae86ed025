"""Weight checkpoints in the safetensors format, read one tensor slice at a time.

A rank of a tensor-parallel plan needs only its shard of each weight. `SafetensorsCheckpoint` opens
one or more `.safetensors` files (`safetensors.safe_open`, memory-mapped) and `read_shard` reads the
rows (or columns) of one rank's shard with `get_slice`, so the rank never materialises the whole
tensor: the pages of the mapped file that hold other ranks' rows are not touched. What it returns is
a copy in the process's own memory, never a view of the mapping: safetensors maps the whole file
copy-on-write and a view would keep that mapping alive, with every page read through it (other
ranks' columns of a row-parallel weight, a padded vocabulary shard's source rows) counted in the
rank's resident memory for as long as the tensor lives (~0.3 GiB of GPT-2 124M's 0.46 GiB file on
each of 2 TP ranks, measured 2026-12).

    checkpoint_files(path)                   -> the .safetensors files of a file or a directory
    save_checkpoint(tensors, path)           -> one .safetensors file (aliased tensors stored once each)
    SafetensorsCheckpoint(files).read_shard(name, dim, parts, rank, tp, pad)
    load_whole(model, files)                 -> every tensor of a model, by name (the unsharded reference)

The shard is the one `passes.placement.shard_weight` cuts from the whole tensor (contiguous 1/tp
chunk per fused part, vocabulary zero-padded to a multiple of tp), byte for byte.
"""

from __future__ import annotations

import math
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
            "; it is made by `python bench/ladder_quality.py` (docs/ladder.md)"
            if p.name == "llama_small_lm.safetensors"
            else ""
        )
        raise InputError(f"weights file {p} does not exist{made_by}")
    if p.suffix != SUFFIX:
        raise InputError(
            f"weights file {p} is not a {SUFFIX} file (save one with safetensors.torch.save_model(model, path), which also keeps tied weights)"
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
        self._where: dict[str, str] = {}  # tensor name -> its file
        self._shapes: dict[str, tuple[int, ...]] = {}
        for file in files:
            try:
                handle = safe_open(file, framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types for a bad header
                self.close()
                raise InputError(f"cannot read weights file {file}: {exc}") from exc
            for name in handle.keys():
                if name in self._where:
                    self.close()
                    raise InputError(f"tensor `{name}` is in more than one weights file (second: {file})")
                self._where[name] = file
                self._shapes[name] = tuple(handle.get_slice(name).get_shape())

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Forget the files (no mapping outlives the read that made it)."""
        self._where.clear()
        self._shapes.clear()

    def _open(self, name: str) -> object:
        """A fresh handle on the file holding `name` (KeyError when absent): each read maps the file
        anew and the mapping goes with the handle once no view of it is left, so the pages a read
        touched do not stay in the process's resident memory until the checkpoint is closed (a rank
        would otherwise hold each of its shards twice while loading: the file's pages and the copy)."""
        return safe_open(self._where[name], framework="pt", device="cpu")

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        """Every tensor name in the files."""
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of `name`. Raises KeyError when absent."""
        return self._shapes[name]

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor `name`, in memory of its own (`read_shard`'s chunked read). Raises KeyError
        when absent."""
        shape = self.shape(name)
        if not shape:  # 0-d
            return self._open(name).get_tensor(name).clone()
        return self._read_into(name, 0, [(0, shape[0], 0)], shape)

    def read_rows(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Indices start:stop of dim `dim` of `name`, the other dims whole, in memory of its own."""
        shape = list(self.shape(name))
        shape[dim] = stop - start
        return self._read_into(name, dim, [(start, stop, 0)], shape)

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
        slices, into memory of its own (`_read_into`). Raises ValueError when a size does not divide by
        tp (after padding a vocabulary when `pad`) or by `pieces`."""
        shape = list(self.shape(name))
        size = shape[dim]
        if pieces is not None:
            if parts or tp % pieces or size % pieces:
                raise ValueError(
                    f"`{name}`: size {size} of dim {dim} cannot be cut into {pieces} pieces over tp={tp}"
                )
            chunk, index = size // pieces, rank * pieces // tp
            shape[dim] = chunk
            return self._read_into(name, dim, [(index * chunk, (index + 1) * chunk, 0)], shape)
        if pad and not parts and size % tp:
            chunk = padded_size(size, tp) // tp
            start, stop = rank * chunk, (rank + 1) * chunk
            shape[dim] = chunk  # rows past the vocabulary are zeros
            return self._read_into(name, dim, [(min(start, size), min(stop, size), 0)], shape)
        ranges = []
        offset = at = 0
        for part in list(parts) if parts else [size]:
            if part % tp:
                raise ValueError(f"`{name}`: size {part} of dim {dim} does not divide by tp={tp}")
            chunk = part // tp
            ranges.append((offset + rank * chunk, offset + (rank + 1) * chunk, at))
            offset += part
            at += chunk
        shape[dim] = at
        return self._read_into(name, dim, ranges, shape)

    def _read_into(
        self, name: str, dim: int, ranges: Sequence[tuple[int, int, int]], shape: Sequence[int]
    ) -> torch.Tensor:
        """A new contiguous tensor of `shape` (dim >= 1): for each (start, stop, at) of `ranges`,
        indices start:stop of dim `dim` of `name` go to at:at + stop - start of its dim `dim`; the rest
        is zeros. Read in chunks of whole rows of dim 0 spanning about `READ_CHUNK_BYTES` of the file,
        each through a mapping of its own that is gone before the next (`_open`): the rank's resident
        memory grows by the shard and one chunk, not by the pages of the file it read."""
        full = self.shape(name)
        dtype = self._open(name).get_slice(name)[0:0].dtype
        out = torch.empty(tuple(shape), dtype=dtype)
        covered = sum(stop - start for start, stop, _ in ranges)
        if covered < shape[dim]:
            out.zero_()
        row_bytes = math.prod(full[1:]) * out.element_size()
        step = max(1, READ_CHUNK_BYTES // max(row_bytes, 1))
        for start, stop, at in ranges:
            target = out.narrow(dim, at, stop - start)
            lo, hi = (start, stop) if dim == 0 else (0, full[0])
            for row in range(lo, hi, step):
                end = min(row + step, hi)
                index = (slice(row, end),)
                if dim > 0:
                    index += (slice(None),) * (dim - 1) + (slice(start, stop),)
                piece = self._open(name).get_slice(name)[index]  # a view of a fresh mapping
                target.narrow(0, row - lo, end - row).copy_(piece)
                del piece  # the mapping goes with it
        return out


# `SafetensorsCheckpoint._read_into`: file bytes read per chunk. Each chunk passes through a
# temporary that the C heap may keep once freed (8 MiB chunks left 8 MiB more resident on a rank of
# a 16 MiB-shard test model), so chunks stay small; a chunk costs one more open and map of the file.
READ_CHUNK_BYTES = 1 << 20


def load_whole(
    model: torch.nn.Module, weights: str | Sequence[str], help_text: str = "", parameters_only: bool = False
) -> None:
    """Replace every parameter and buffer of `model` by the tensor of the same name in the
    safetensors files `weights` (a tied weight may be stored under any one of its names; the tie is
    kept). Non-persistent buffers absent from the files keep the model's value. With
    `parameters_only` (a served model, whose KV-cache buffers are sized for the request, not the
    checkpoint), buffers are neither required nor read. Raises InputError naming missing tensors,
    tensors the model does not have (as `load_state_dict(strict=True)`) or shapes that do not fit
    (followed by `help_text`)."""
    groups: dict[int, list[str]] = {}
    buffers = [name for name, _ in model.named_buffers(remove_duplicate=False)]
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *([] if parameters_only else model.named_buffers(remove_duplicate=False)),
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
        known = {n for names in groups.values() for n in names} | set(buffers)
        unexpected = sorted(n for n in source.keys() if n not in known)
        if unexpected:  # another model's checkpoint (a deeper one, a renamed module), as strict loading says
            raise InputError(
                f"the weights {weights} hold {len(unexpected)} tensors the model does not have, e.g. "
                f"{unexpected[:3]}: they are not this model's weights (or its module names changed); save "
                f"the model's own state; {help_text}"
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

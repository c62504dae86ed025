"""Output files the CLI writes: checked before any work starts, written atomically with normal permissions."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from planner.errors import InputError


def _umask_mode(mode: int) -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def check_output_path(option: str, path: str, folder: bool = False) -> None:
    """Fail early (InputError, exit 2) when `path` cannot be written: its parent folder is missing or
    not writable, or it exists as the wrong kind (a folder where a file goes, or the reverse)."""
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{option} {path}: folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise InputError(f"{option} {path}: folder {parent} is not writable")
    if target.exists() and folder and not target.is_dir():
        raise InputError(f"{option} {path}: exists and is not a folder")
    if target.exists() and not folder and target.is_dir():
        raise InputError(f"{option} {path}: is a folder; give a file name")


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` to `path` via a temporary file in the same folder and a rename: readers never see
    a partial file, and an error leaves none behind. The file gets the usual 0666 & ~umask mode."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{target.name}.", suffix=".tmp", dir=target.parent if str(target.parent) else "."
    )
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, _umask_mode(0o666))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fix_tree_permissions(folder: str | os.PathLike[str]) -> None:
    """Give a folder written through `tempfile.mkdtemp` (mode 0700) the usual modes: folders 0777 and
    files 0666, less the umask."""
    root = Path(folder)
    os.chmod(root, _umask_mode(0o777))
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(Path(dirpath) / d, _umask_mode(0o777))
        for f in filenames:
            os.chmod(Path(dirpath) / f, _umask_mode(0o666))

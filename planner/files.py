"""Output files and folders the product writes: checked before any work starts, written atomically,
with normal permissions, and never at the cost of anything the product did not write.

    check_output_path(option, path, folder)   fail early (exit 2) when `path` cannot be written
    write_text_atomic(path, text)             a file: temp sibling + rename; one clear error, no leftovers
    new_output_folder(path, option)           a temp sibling folder to fill, then
    publish_folder(tmp, path, option)         rename it into place (an earlier emit of ours is replaced)

A folder the product writes carries a marker file (`FOLDER_MARKER`, a JSON list of what it wrote,
every file at any depth, with each file's size and modification time). An existing non-empty folder
is replaced only when it carries the marker and holds nothing, in it or in its subfolders, that the
marker does not list, and no listed file changed since; anything else is refused (InputError naming
it), so `--emit .` in a folder of the user's files, or over a rank's module.py the user edited, leaves
them alone.

A file the product writes says so near its start (`SIGNATURES`: a plan's header comment, a report's
first key, an export's or a calibrated spec's header, the adapted weights' safetensors metadata), and
a plan, an export or a calibrated spec also carries the digest note on its first line (`with_digest`);
a report is a JSON object whose first key names the planner command and which holds "plan" and
"predicted" (`_is_report`). A file that merely mentions the planner (a launch script quoting an export
header, notes that copy a report's first key) is the user's. An existing non-empty file is
replaced only when it is the product's output of the same kind:
`--out README.md`, `--json model.py` or `optimize --out` onto a calibrated spec are refused. The
files users edit by hand (plans, exports, calibrated specs) end in a comment line holding the SHA-256
of the rest, and their first line says so (`with_digest`): one whose text no longer matches it, or
that lost the line, is the user's now and is refused too (`edited_since_written`), as is an emitted
folder's file whose content changed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import uuid
from pathlib import Path

from planner.errors import InputError

FOLDER_MARKER = ".planner-output.json"  # in every folder the product writes: what it wrote
# kind of output file -> the text it starts with (within its first SIGNATURE_BYTES)
PLAN_HEADER = "# Plan written by planner optimize --out"
REPORT_SIGNATURE = '"written_by": "planner'  # the first key of every JSON report
SIGNATURES = {
    "plan": PLAN_HEADER,
    "report": REPORT_SIGNATURE,
    "cluster spec": "# Cluster spec written by `planner calibrate`",
    "export": "written by planner export --to",
}
SIGNATURE_BYTES = 1024
# the last line of a plan, an export or a calibrated spec: the SHA-256 (16 hex digits) of the rest
DIGEST_PREFIX = "# planner-digest: "
DIGEST_NOTE = " [last line: the planner's digest of this file]"  # on the first line of a file that has one
DIGEST_KINDS = ("plan", "export", "cluster spec")  # the outputs `with_digest` signs (users edit them)
DIGEST_MAX_BYTES = 1 << 26  # larger files are not read back to check the digest (none is this large)
STAMP_HASH_MAX_BYTES = 1 << 24  # emitted files up to this size are stamped by content, larger by mtime


def _sha256_16(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def with_digest(text: str) -> str:
    """`text` (ending in a newline) with `DIGEST_NOTE` at the end of its first line and a last comment
    line `DIGEST_PREFIX` + the SHA-256 of the rest: `edited_since_written` tells later whether someone
    changed the file (the note says a digest was written, so a deleted digest line counts as an edit).
    For formats with `#` comments (YAML, shell, TOML, Python; a first line that opens a docstring
    takes the note inside it)."""
    if not text.endswith("\n"):
        text += "\n"
    first, rest = text.split("\n", 1)
    text = f"{first}{DIGEST_NOTE}\n{rest}"
    return f"{text}{DIGEST_PREFIX}{_sha256_16(text.encode('utf-8'))}\n"


def edited_since_written(path: str | os.PathLike[str]) -> bool:
    """Whether the file at `path` no longer matches the `with_digest` line it ends in (the user edited
    it: added, removed or changed a line), or lost that line while its first line still says it was
    written with one (`DIGEST_NOTE`). False for a file without either (an older planner's: replaced as
    before), or too large or unreadable to check."""
    try:
        if os.path.getsize(path) > DIGEST_MAX_BYTES:
            return False
        data = Path(path).read_bytes()
    except OSError:
        return False
    at = data.rfind(DIGEST_PREFIX.encode())
    if at < 0 or (at > 0 and data[at - 1 : at] != b"\n"):
        # no digest line: deleted (the first line still says one was written), or an older planner's file
        return DIGEST_NOTE.encode() in data.split(b"\n", 1)[0]
    end = data.find(b"\n", at)
    line_end = len(data) if end < 0 else end + 1
    stored = data[at + len(DIGEST_PREFIX) : line_end].strip().decode("ascii", errors="replace")
    return _sha256_16(data[:at] + data[line_end:]) != stored


WEIGHTS_KIND = "adapted weights"  # safetensors: {"written_by": ...} in the header's __metadata__


def written_kind(path: str | os.PathLike[str]) -> str | None:
    """Which kind of the product's output file `path` is (a key of `SIGNATURES`, or `WEIGHTS_KIND`),
    None when it does not carry the product's signature (or cannot be read)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(SIGNATURE_BYTES)
            if len(head) >= 8 and str(path).endswith(".safetensors"):
                size = int.from_bytes(head[:8], "little")
                handle.seek(8)
                header = json.loads(handle.read(min(size, 1 << 24)))
                meta = header.get("__metadata__") or {}
                return WEIGHTS_KIND if str(meta.get("written_by", "")).startswith("planner") else None
    except (OSError, ValueError, AttributeError):
        return None
    text = head.decode("utf-8", errors="replace")
    first_line = text.split("\n", 1)[0]
    if "\n" not in text and len(head) == SIGNATURE_BYTES:  # a first line longer than that (a long model path)
        try:
            with open(path, "rb") as handle:
                first_line = handle.readline(1 << 20).decode("utf-8", errors="replace")
        except OSError:
            return None
    for kind, signature in SIGNATURES.items():
        if kind in DIGEST_KINDS and signature in text and DIGEST_NOTE in first_line:
            return kind  # the signature and, on the first line, the note `with_digest` writes
    if text.lstrip().startswith("{") and REPORT_SIGNATURE in text and _is_report(path):
        return "report"
    return None


_REPORT_MAX_BYTES = 1 << 26  # larger files are not parsed for `_is_report`


def _is_report(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a JSON report of the product: its first key "written_by" is the command that
    wrote it, exactly ("planner optimize --json", "planner run --json", "planner ladder-eval --json"),
    and it holds the objects that command's report has ("plan" and "predicted"; "standard" and
    "ladder"). A user's JSON that merely mentions the planner is not one."""
    try:
        if os.path.getsize(path) > _REPORT_MAX_BYTES:
            return False
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict) or not data:
        return False
    first_key, first = next(iter(data.items()))
    if first_key != "written_by" or not isinstance(first, str):
        return False
    if first == "planner ladder-eval --json":  # the held-out losses (`planner.cli.quality`)
        return isinstance(data.get("standard"), dict) and isinstance(data.get("ladder"), dict)
    return (
        first in ("planner optimize --json", "planner run --json")
        and isinstance(data.get("plan"), dict)
        and isinstance(data.get("predicted"), dict)
    )


def _check_replaceable_file(target: Path, option: str, kind: str | None) -> None:
    """InputError unless the existing file `target` is empty or the product's own output of `kind`."""
    try:
        if target.stat().st_size == 0:
            return
    except OSError:
        return
    found = written_kind(target)
    if found is None:
        raise InputError(
            f"{option} {target}: the file exists and was not written by the planner; nothing was changed. "
            "Give a new file name (or move the file away yourself)"
        )
    if kind is not None and found != kind:
        raise InputError(
            f"{option} {target}: the file holds the planner's {found}, which {option} would replace with {_article(kind)} {kind}; "
            "nothing was changed. Give another file name"
        )
    if found in DIGEST_KINDS and edited_since_written(target):
        raise InputError(
            f"{option} {target}: the planner wrote this {found}, but it changed since (your edits?); nothing was "
            "changed. Give another file name, or move the edited file away yourself"
        )


def _article(noun: str) -> str:
    """ "an" before a vowel sound ("an export"), else "a"."""
    return "an" if noun[:1].lower() in "aeio" else "a"


def _umask_mode(mode: int) -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def _parent(target: Path) -> Path:
    return target.parent if str(target.parent) else Path(".")


def check_output_path(option: str, path: str, folder: bool = False, kind: str | None = None) -> None:
    """Fail early (InputError, exit 2) when `path` cannot be written: its parent folder is missing or
    not writable (a probe file is created and removed), it exists as the wrong kind (a folder where
    a file goes, or the reverse), (folder) it is a non-empty folder the product did not write, or
    (file) it is a non-empty file that is not the product's own output of `kind` (`written_kind`;
    None: any of the product's outputs); a path the system cannot take (a name too long, a link that
    points to itself) is refused the same way."""
    try:
        _check_output_path(option, path, folder, kind)
    except (OSError, RuntimeError) as e:  # ENAMETOOLONG, ELOOP, "Symlink loop" from Path.resolve
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise InputError(
            f"{option} {path}: cannot be used as an output path: {why}; give another path"
        ) from None


def _check_output_path(option: str, path: str, folder: bool, kind: str | None) -> None:
    target = Path(path)
    parent = _parent(target)
    if not parent.is_dir():
        blocker = next((p for p in (parent, *parent.parents) if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            raise InputError(f"{option} {path}: {blocker} is a file, not a folder; choose a path in a folder")
        raise InputError(f"{option} {path}: folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise InputError(f"{option} {path}: folder {parent} is not writable")
    if target.exists() and folder and not target.is_dir():
        raise InputError(f"{option} {path}: exists and is not a folder")
    if target.exists() and not folder and target.is_dir():
        raise InputError(f"{option} {path}: is a folder; give a file name")
    if not folder:
        _refuse_special_file(target, f"{option} {path}")
    if folder and target.is_dir():
        _check_replaceable(target, option)
    if not folder and target.is_file():
        _check_replaceable_file(target, option, kind)
    try:  # os.access says yes to root everywhere, also on /proc: try it
        fd, probe = tempfile.mkstemp(prefix=f".{target.resolve().name}.", suffix=".probe", dir=parent)
    except OSError as e:
        raise InputError(f"{option} {path}: cannot write into {parent}: {e.strerror}") from None
    os.close(fd)
    os.unlink(probe)


def _refuse_special_file(target: Path, label: str) -> None:
    """InputError when `target` (or what its link points to) exists and is neither a regular file nor a
    folder: a device (/dev/null), a named pipe or a socket. Outputs are written as a temporary sibling
    renamed into place, which would replace such a file with a regular one (as root, /dev/null for the
    whole machine); `--json -` is the way to stdout."""
    try:
        mode = target.stat().st_mode
    except OSError:  # missing, or a dangling link: a regular file will be written there
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        what = "a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise InputError(
            f"{label}: is {what}, not a regular file; the planner writes its outputs as regular files (replacing "
            "it would destroy it), so nothing was written. Give a file name (--json - prints the report on stdout)"
        )


def _check_replaceable(folder: Path, option: str) -> None:
    """InputError unless `folder` is empty or an earlier output of ours holding only what we wrote."""
    entries = sorted(p.name for p in folder.iterdir())
    if not entries:
        return
    marker = folder / FOLDER_MARKER
    if not marker.is_file():
        raise InputError(
            f"{option} {folder}: the folder is not empty and was not written by the planner "
            f"(it holds {', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}); nothing was "
            "changed. Give a new or empty folder"
        )
    try:
        record = json.loads(marker.read_text())
        written = set(record["written"]) | {FOLDER_MARKER}
        files = set(record["files"]) | {FOLDER_MARKER} if "files" in record else None
        kind = record.get("kind")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise InputError(f"{option} {folder}: its {FOLDER_MARKER} is unreadable; give a new folder") from None
    if kind and kind != option:
        raise InputError(
            f"{option} {folder}: the folder holds the planner's {kind} output, which {option} would replace; "
            "nothing was changed. Give another folder"
        )
    subfolders = [e for e in entries if e in written and (folder / e).is_dir()]
    under = _files_under(folder)
    inside = [rel for rel in under if rel.split("/")[0] in subfolders]
    if files is None and kind == "--emit" and subfolders and all(_OLD_EMIT_FILE.fullmatch(r) for r in inside):
        # an --emit folder of a version that listed its top level only, whose rank folders hold the
        # emitter's own files and nothing else (`passes.emit`): ours, replaceable
        files = (set(entries) & written) | set(inside)
    if files is not None:  # every file at any depth must be one we wrote (rank0/notes.py is not)
        foreign = sorted(rel for rel in under if rel not in files)
        # and every folder must hold one: an empty folder of the user's (rank0/mylogs) is theirs too
        holders = {parent for rel in files for parent in Path(rel).parents if str(parent) != "."}
        foreign += sorted(
            f"{p.relative_to(folder).as_posix()}/"
            for p in folder.rglob("*")
            if p.is_dir() and not p.is_symlink() and Path(p.relative_to(folder).as_posix()) not in holders
        )
    elif subfolders:
        raise InputError(
            f"{option} {folder}: an earlier planner output whose record does not list the files in its "
            "subfolders (written by an older version), so the planner cannot tell them from yours; nothing "
            "was changed. Give a new folder, or empty this one"
        )
    else:
        foreign = [e for e in entries if e not in written]
    if foreign:
        raise InputError(
            f"{option} {folder}: an earlier planner output, but it now also holds files the planner did not "
            f"write ({', '.join(foreign[:3])}); nothing was changed. Move them out or give a new folder"
        )
    stamps = record.get("stamps") if isinstance(record.get("stamps"), dict) else {}
    edited = sorted(
        rel for rel in under if rel in stamps and _stamp(folder / rel, stamps[rel]) != stamps[rel]
    )
    if edited:
        more = f" and {len(edited) - 3} more" if len(edited) > 3 else ""
        raise InputError(
            f"{option} {folder}: an earlier planner output, but {', '.join(edited[:3])}{more} changed since the "
            "planner wrote it (your edits?); nothing was changed. Move the edited files out or give a new folder"
        )


def _stamp(path: Path, old: object = None) -> list[int] | list[int | str]:
    """What the folder's marker keeps of a file the product wrote, so that a file whose stamp differs
    later counts as edited (the user's now, not replaced silently): [size, "sha256:" + 16 hex digits
    of its content] for a file up to `STAMP_HASH_MAX_BYTES` (a copy of the folder, with new
    modification times, is still ours), [size, modification time in ns] for a larger one. `old`: the
    stamp recorded, compared in its own form (markers written before content stamps hold the time)."""
    st = path.lstat()
    by_time = [st.st_size, st.st_mtime_ns]
    old_by_time = isinstance(old, list) and len(old) == 2 and isinstance(old[1], int)
    if old_by_time or path.is_symlink() or st.st_size > STAMP_HASH_MAX_BYTES:
        return by_time
    return [st.st_size, "sha256:" + _sha256_16(path.read_bytes())]


# the files `passes.emit` writes in each rank folder (MODULE_FILE, WEIGHTS_FILE, META_FILE there)
_OLD_EMIT_FILE = re.compile(r"rank\d+/(module\.py|weights\.pt|meta\.json)")


def _files_under(folder: Path) -> list[str]:
    """Every file (and link) under `folder`, as sorted POSIX paths relative to it ("rank0/model.py")."""
    return sorted(
        p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir() or p.is_symlink()
    )


_FULL_BYTES = 1 << 20  # a disk with less free space than this is full for the purpose of an error message


def failed_write(option: str, path: str | os.PathLike[str], exc: BaseException) -> BaseException:
    """What to raise when writing an output into `path` failed with `exc` (its temporary folder already
    removed): InputError (exit 2) naming the option when the system refused the write (no space left,
    a quota, a read-only disk) or the disk holding `path` is full, whatever the library said (PIL's
    PNG writer and torch.save fail with their own errors on a full disk); `exc` itself otherwise."""
    refused = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
    try:
        free = shutil.disk_usage(_parent(Path(path))).free
    except OSError:
        free = None
    if refused or (free is not None and free < _FULL_BYTES and not isinstance(exc, KeyboardInterrupt)):
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "no space left on the device"
        left = f" ({free} bytes free)" if free is not None else ""
        return InputError(f"{option} {path}: cannot write it: {why}{left}; nothing was written")
    return exc


def write_text_atomic(path: str | os.PathLike[str], text: str, option: str = "", fsync: bool = False) -> None:
    """Write `text` to `path` via a temporary file in the same folder and a rename: readers never see
    a partial file, and an error leaves none behind. The file gets the usual 0666 & ~umask mode. A
    `path` that is a symbolic link stays one: the file it points to is written (the link itself was
    replaced by a plain file).

    option: the command-line option that named `path` ("--out"), for the message. fsync: flush to
    disk before the rename. Raises InputError (exit 2) with one line when `path` cannot be written.
    """
    target = Path(path)
    label = f"{option} {path}" if option else str(path)
    if target.is_symlink():  # the user's link stays a link: write the file it points to
        target = Path(os.path.realpath(target))
    _refuse_special_file(target, label)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=_parent(target))
    except OSError as e:
        raise InputError(f"{label}: cannot write into {_parent(target)}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        os.chmod(tmp, _umask_mode(0o666))
        os.replace(tmp, target)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise InputError(f"{label}: cannot write it: {e.strerror or e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def new_output_folder(path: str | os.PathLike[str], option: str = "") -> Path:
    """A new empty temporary folder beside `path` (same file system, so `publish_folder` is a
    rename). Raises InputError when `path` may not be written (`check_output_path`)."""
    target = Path(path).resolve()
    check_output_path(option or "output folder", str(target), folder=True)
    return Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))


def publish_folder(tmp: str | os.PathLike[str], path: str | os.PathLike[str], option: str = "") -> Path:
    """Move the filled folder `tmp` (from `new_output_folder`) to `path`, writing the marker first.

    An existing `path` is replaced only when it is empty or an earlier output of ours with nothing
    foreign in it (checked again here); it is moved aside, the new folder renamed in, and only then
    the old one removed. Gives the usual folder and file modes. Raises InputError otherwise (then
    `tmp` is removed and `path` untouched).
    """
    tmp, final = Path(tmp), Path(path).resolve()
    try:
        written = sorted(p.name for p in tmp.iterdir())
        # the option that wrote it, and every file at any depth (what a later run may replace)
        files = _files_under(tmp)
        record = {"written": written, "files": files, "kind": option or "output folder",
                  "stamps": {rel: _stamp(tmp / rel) for rel in files}}  # fmt: skip
        (tmp / FOLDER_MARKER).write_text(json.dumps(record, indent=1) + "\n")
        fix_tree_permissions(tmp)
        old = None
        if final.exists():
            _check_replaceable(final, option or "output folder")
            old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(final, old)
        try:
            os.rename(tmp, final)
        except BaseException:
            if old is not None:
                os.rename(old, final)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def fix_file_permissions(path: str | os.PathLike[str]) -> None:
    """Give a file written by a library that creates it with mode 0600 (safetensors) the usual mode:
    0666 less the umask."""
    os.chmod(path, _umask_mode(0o666))


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

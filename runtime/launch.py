"""Run one function on N ranks with an initialised `torch.distributed` process group.

    launch(entry, payload, nproc) -> [entry(ctx_0, payload), ..., entry(ctx_{nproc-1}, payload)]

Local mode (the default): the parent starts `nproc` fresh Python processes, forked by a
multiprocessing fork server that has imported torch and the runtime once (`_context`; "spawn" where
there is no fork server, and always for CUDA ranks), so no CUDA or thread state of the parent is
inherited and a gloo launch does not pay torch's import per rank (5.4 s to start 2 ranks spawned,
2.5 s for the first launch forked, 0.1 s for each later one, on the 2-vCPU dev VM). Each child sets
MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, calls
`torch.distributed.init_process_group(backend, timeout=timedelta(seconds=timeout_s))` ("nccl" on
`cuda:LOCAL_RANK` when CUDA is available, else "gloo" with `torch.set_num_threads(cpu_count // nproc)`),
runs `entry(RankContext, payload)`, sends the pickled result to the parent over its own pipe, waits in a
barrier for the other ranks (rank 0 hosts the rendezvous store, so it must not leave early) and destroys
the process group. Results travel by value (plain pickle): return CPU tensors or plain data; a CUDA
tensor would be unpickled onto the same device in the parent.

Progress: `launch(..., progress=fn)` calls `fn(description, fraction)` (`planner.progress`) in the
parent as the ranks start ("ranks started: 3/4") and whenever rank 0 calls `report_progress` (warm-up
and timed iterations, `runtime.measure.time_iterations`); the messages travel on the result pipes.

Under torchrun (RANK and WORLD_SIZE set, and PLANNER_UNDER_TORCHRUN or TORCHELASTIC_RUN_ID set) nothing
is spawned: this process runs `entry` as its own rank (initialising the process group from the env://
variables unless one exists already) and the results are gathered with `dist.gather_object`. Rank 0
gets every rank's result; every other rank gets a list of `None` with only its own slot filled.
Exceptions propagate unchanged there: torchrun's agent owns fault handling.

Faults in local mode, each turned into `planner.errors.RunError` (exit code 4) after every child has
been terminated (SIGTERM, then SIGKILL after `_GRACE_S`):

- a rank raises: the message names the rank, its exception type and message and the last
  `_TRACEBACK_FRAMES` frames of its traceback; later failures of other ranks (typically "connection
  closed" in a collective with the failed rank) are listed after it;
- a rank dies without reporting (os._exit, SIGKILL, segfault): named with its exit code or signal;
- the wall-clock limit `timeout_s + _WALL_MARGIN_S` passes: the message names the ranks that had not
  finished;
- MASTER_PORT was taken between choosing it and binding it: retried with a new port up to
  `_PORT_ATTEMPTS` times, then RunError.

Ctrl-C (KeyboardInterrupt) in the parent terminates every child, then re-raises. The children ignore
SIGINT themselves (the parent owns shutdown) and, on Linux, get SIGKILL if the parent dies
(prctl PR_SET_PDEATHSIG; forked by the fork server, a thread watching the launching process's pid),
so no orphan keeps running.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import multiprocessing.connection as mpc
import multiprocessing.forkserver
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from planner.errors import InputError, RunError
from planner.progress import Progress, silent

_WALL_MARGIN_S = 5.0  # added to timeout_s for the wall-clock limit: spawning, importing torch, tear-down
_GRACE_S = 2.0  # how long a terminated (SIGTERM) child gets before SIGKILL
_WAIT_SLICE_S = 0.5  # the longest the parent waits on its ranks before it looks at pending signals
_DRAIN_S = 0.5  # after the first failure, how long to collect other ranks' reports to pick the root cause
_PORT_ATTEMPTS = 3  # fresh MASTER_PORTs tried when the chosen one turns out to be taken
_TRACEBACK_FRAMES = 8  # frames of a failed rank's traceback quoted in the RunError
_MASTER_ADDR = "127.0.0.1"
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_BACKENDS = ("gloo", "nccl")
_PROGRESS_INTERVAL_S = 0.1  # a rank sends at most this often (and every start and end of a task)
_STARTED = "started"  # a rank's progress message once its process group is up


@dataclass(frozen=True)
class RankContext:
    """What `entry` learns about its rank. The default process group is initialised when it runs."""

    rank: int  # global rank, 0 .. world_size - 1
    world_size: int
    local_rank: int  # rank on this node; also the CUDA device index under nccl
    device: torch.device  # cuda:LOCAL_RANK under nccl, cpu under gloo
    backend: str  # "nccl" | "gloo"


@dataclass(frozen=True)
class _Result:
    """A child's successful result; `data` is the plainly pickled return value of `entry`."""

    rank: int
    data: bytes


@dataclass(frozen=True)
class _Failure:
    """Why a rank failed, as text (exceptions themselves may not pickle)."""

    rank: int
    phase: str  # "init" (process group set-up) | "entry" | "result" (pickling the result)
    kind: str  # "raised" | "died"
    type_name: str
    message: str
    traceback_text: str
    time_s: float  # time.time() when it happened (child clock) or was noticed (parent clock)


@dataclass(frozen=True)
class _Progress:
    """A rank's progress message to the parent (`report_progress`)."""

    rank: int
    description: str
    fraction: float | None


_progress_conn: Any = None  # in a spawned rank: its result pipe (progress messages go there too)
_progress_rank = -1
_progress_sent_s = 0.0


def report_progress(description: str, fraction: float | None) -> None:
    """From rank 0 of a local launch: tell the launching process's `progress` callback (see the module
    docstring). Throttled to one message per _PROGRESS_INTERVAL_S unless a task starts or ends; a
    no-op on other ranks, under torchrun and outside a launch."""
    global _progress_sent_s
    if _progress_conn is None or _progress_rank != 0:
        return
    now = time.monotonic()
    if fraction not in (None, 0.0, 1.0) and now - _progress_sent_s < _PROGRESS_INTERVAL_S:
        return
    _progress_sent_s = now
    _progress_conn.send(_Progress(_progress_rank, description, fraction))


class _PortInUse(Exception):
    """Rank 0 could not bind MASTER_PORT; the launch is retried on another port."""


def launch(
    entry: Callable[[RankContext, Any], Any],
    payload: Any,
    nproc: int,
    *,
    timeout_s: float = 60.0,
    backend: str | None = None,
    progress: Progress = silent,
) -> list[Any]:
    """Run `entry(ctx, payload)` on `nproc` ranks; return the per-rank results in rank order.
    `progress`: told of the ranks' start-up and rank 0's `report_progress` (local mode only).

    `entry` must be a module-level function (it is pickled by reference); `payload` and the results
    must pickle. `timeout_s` (seconds) is both the process group's collective timeout and, plus
    `_WALL_MARGIN_S`, the wall-clock limit of the whole launch. `backend` None picks "nccl" when CUDA
    is available, else "gloo".

    Raises InputError for a bad `nproc`, `timeout_s`, `backend`, or an unpicklable entry or payload;
    RunError when a rank raises, dies or does not finish in time (see the module docstring).
    """
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise InputError(f"nproc must be a positive integer, got {nproc!r}")
    if not timeout_s > 0:
        raise InputError(f"timeout_s must be positive (seconds), got {timeout_s!r}")
    if under_torchrun():
        return _run_in_process(entry, payload, nproc, timeout_s, backend)
    backend = _resolve_backend(backend, nproc)
    try:
        job = pickle.dumps((entry, payload))
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise InputError(
            f"launch needs a module-level entry function and a picklable payload: {type(exc).__name__}: {exc}"
        ) from exc
    tried: list[int] = []
    for _ in range(_PORT_ATTEMPTS):
        port = free_port()
        tried.append(port)
        try:
            return _run_local(job, nproc, port, timeout_s, backend, progress)
        except _PortInUse:
            continue
    raise RunError(
        f"MASTER_PORT was already in use on {_MASTER_ADDR} for each of {len(tried)} attempts (ports {tried}); "
        "another program is taking free ports as fast as they are chosen"
    )


# ---------------------------------------------------------------------------------------------------
# Shared by both modes


def under_torchrun() -> bool:
    """Whether this process is one rank started by torchrun (see the module docstring): `launch`
    then runs the entry here instead of spawning ranks."""
    env = os.environ
    return (
        "RANK" in env
        and "WORLD_SIZE" in env
        and ("PLANNER_UNDER_TORCHRUN" in env or "TORCHELASTIC_RUN_ID" in env)
    )


def _resolve_backend(backend: str | None, nproc: int) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in _BACKENDS:
        raise InputError(f"backend must be one of {_BACKENDS} or None, got {backend!r}")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise InputError("backend 'nccl' needs CUDA, and torch.cuda.is_available() is False; use 'gloo'")
        if nproc > torch.cuda.device_count():
            raise InputError(f"nproc({nproc}) > cuda devices({torch.cuda.device_count()}) for backend 'nccl'")
    return backend


def _init_process_group(
    rank: int, world_size: int, local_rank: int, local_world_size: int, backend: str, timeout_s: float
) -> torch.device:
    """Initialise the default process group from the env:// variables; return this rank's device."""
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    dist.init_process_group(
        backend,
        timeout=timedelta(seconds=timeout_s),
        rank=rank,
        world_size=world_size,
        device_id=device if backend == "nccl" else None,
    )
    return device


# ---------------------------------------------------------------------------------------------------
# Under torchrun: this process is one rank


def _run_in_process(
    entry: Callable[[RankContext, Any], Any], payload: Any, nproc: int, timeout_s: float, backend: str | None
) -> list[Any]:
    env = os.environ
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank = int(env.get("LOCAL_RANK", "0"))
    local_world_size = int(env.get("LOCAL_WORLD_SIZE", str(world_size)))
    if nproc != world_size:
        raise InputError(f"nproc({nproc}) != WORLD_SIZE({world_size}) set by torchrun")
    created = not dist.is_initialized()
    if created:
        backend = _resolve_backend(backend, local_world_size)
        device = _init_process_group(rank, world_size, local_rank, local_world_size, backend, timeout_s)
    else:
        backend = dist.get_backend()
        device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    ctx = RankContext(rank, world_size, local_rank, device, backend)
    result = entry(ctx, payload)
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    if created:
        dist.destroy_process_group()
    if gathered is not None:
        return gathered
    own: list[Any] = [None] * world_size
    own[rank] = result
    return own


# ---------------------------------------------------------------------------------------------------
# Local mode: the children


def _rank_main(
    rank: int, nproc: int, port: int, job: bytes, timeout_s: float, backend: str, conn: Any, parent_pid: int
) -> None:
    """Body of one spawned rank. Reports exactly one `_Result` or `_Failure` on `conn`."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    os.environ.update(
        MASTER_ADDR=_MASTER_ADDR,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nproc),
    )
    phase = "init"
    global _progress_conn, _progress_rank
    try:
        entry, payload = pickle.loads(job)
        device = _init_process_group(rank, nproc, rank, nproc, backend, timeout_s)
        ctx = RankContext(rank, nproc, rank, device, backend)
        conn.send(_Progress(rank, _STARTED, None))
        _progress_conn, _progress_rank = conn, rank
        phase = "entry"
        result = entry(ctx, payload)
        phase = "result"
        data = pickle.dumps(result)
    except BaseException as exc:  # report everything, SystemExit included, then leave at once
        _progress_conn = None
        conn.send(_failure_of(rank, phase, exc))
        conn.close()
        _exit_now(1)
    _progress_conn = None
    conn.send(_Result(rank, data))
    conn.close()
    try:
        if dist.is_initialized():  # unless entry destroyed it itself
            dist.barrier()  # rank 0 hosts the rendezvous store: nobody leaves before everybody is done
            dist.destroy_process_group()
    except Exception as exc:  # the result is delivered; a failed tear-down only sets the exit code
        print(f"rank {rank}: process group tear-down failed after returning: {exc!r}", file=sys.stderr)
        _exit_now(1)


def _failure_of(rank: int, phase: str, exc: BaseException) -> _Failure:
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-_TRACEBACK_FRAMES)
    return _Failure(rank, phase, "raised", type(exc).__name__, str(exc), "".join(frames), time.time())


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; exit now if the launching process
    (`parent_pid`) is gone already. Forked by the fork server (`_context`), the parent is the server,
    which exits when the launching process does (multiprocessing closes its alive pipe), so the
    signal follows the launcher one hop later."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass  # no prctl: the parent's finally block is then the only clean-up
    try:
        os.kill(parent_pid, 0)  # signal 0: only whether the process exists
    except ProcessLookupError:
        _exit_now(1)
    except PermissionError:
        pass  # it exists (another user's pid would be a reused one; not ours to judge)
    if os.getppid() != parent_pid:  # forked by the fork server, which outlives a SIGKILLed launcher
        # while its forks live (they hold the launcher's alive pipe): watch the launcher itself
        threading.Thread(target=_exit_when_gone, args=(parent_pid,), daemon=True).start()


def _exit_when_gone(pid: int, poll_s: float = 0.2) -> None:
    """Leave at once when process `pid` exits (a pidfd where Linux has one, else polling)."""
    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone already, or no pidfd support in this kernel
            fd = None
        if fd is not None:
            select.select([fd], [], [])  # readable when the process exits
            _exit_now(1)
    while True:
        time.sleep(poll_s)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            _exit_now(1)
        except PermissionError:
            continue


def _exit_now(code: int) -> None:
    """Leave without interpreter shutdown, which may block on a process group with a dead peer."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------------------------------------------
# Local mode: the parent


def free_port() -> int:
    """A TCP port on MASTER_ADDR that was free a moment ago (bind port 0 and release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_MASTER_ADDR, 0))
        return sock.getsockname()[1]


# imported once by the fork server, so each rank starts without importing torch again (a spawned
# rank imported it for ~2 s; on a 2-core machine the ranks of a launch did so side by side)
# and then warms torch.export once (`runtime.warm`: ~1.5 s of each rank's first capture)
_PRELOAD = ("torch", "torch.distributed", "runtime.execute", "runtime.warm")


def _context(backend: str) -> Any:
    """The multiprocessing context ranks start in. Under "gloo": a fork server (Linux, macOS) that has
    imported `_PRELOAD` and nothing else - no threads of the launching process, as with "spawn" -
    started once per launching process and reused by every launch; "spawn" elsewhere. Under "nccl":
    "spawn" always, since a process forked after CUDA was initialised cannot use CUDA, and importing
    `_PRELOAD` may initialise it in the server (seen with torch 2.11+cu130 on an H200, 2026-12-04:
    every NCCL rank failed with "Cannot re-initialize CUDA in forked subprocess")."""
    if backend == "nccl" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOAD))
    return context


def _run_local(
    job: bytes, nproc: int, port: int, timeout_s: float, backend: str, progress: Progress = silent
) -> list[Any]:
    context = _context(backend)
    procs: list[Any] = []
    conns: list[Any] = []
    progress(f"starting {nproc} rank(s)", 0.0)
    if context.get_start_method() == "forkserver":
        with _sigint_ignored():  # the server inherits it while it imports `_PRELOAD`: Ctrl-C is ours
            multiprocessing.forkserver.ensure_running()
    try:
        for rank in range(nproc):
            recv, send = context.Pipe(duplex=False)
            proc = context.Process(
                target=_rank_main,
                args=(rank, nproc, port, job, timeout_s, backend, send, os.getpid()),
                name=f"planner-rank{rank}",
            )
            proc.start()
            send.close()  # only the child holds the sending end, so its death shows as EOF here
            procs.append(proc)
            conns.append(recv)
        deadline = time.monotonic() + timeout_s + _WALL_MARGIN_S
        results = _collect(procs, conns, deadline, timeout_s, port, backend, progress)
        _join(procs, _GRACE_S)
        return results
    finally:  # every way out, KeyboardInterrupt included: no child outlives the launch
        _terminate(procs)
        for conn in conns:
            conn.close()


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored in this process while the fork server starts. An ignored signal stays ignored
    through fork and exec (the signal mask does not: the server resets it), and Python then installs
    no KeyboardInterrupt handler: the server, importing torch for `_PRELOAD` once started, never gets
    the Ctrl-C a terminal sends the whole process group (it interrupted those imports with a traceback
    from inside torch, printed beside "interrupted"). The window is the server's spawn only (its
    imports run after it, while the ranks' start waits for them, with Ctrl-C this process's again). A
    no-op off the main thread (`signal.signal` works there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _collect(
    procs: list[Any],
    conns: list[Any],
    deadline: float,
    timeout_s: float,
    port: int,
    backend: str,
    progress: Progress = silent,
) -> list[Any]:
    """Wait for one report per rank, passing progress messages on to `progress`; raise RunError (or
    _PortInUse) on the first failure or timeout."""
    nproc = len(procs)
    started = 0
    pending = set(range(nproc))
    results: list[Any] = [None] * nproc
    failures: list[_Failure] = []
    drain_until: float | None = None
    while pending:
        now = time.monotonic()
        limit = deadline if drain_until is None else min(deadline, drain_until)
        if now >= limit:
            break
        waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        # in slices: a Ctrl-C the kernel hands to another thread of this process (torch starts some)
        # does not interrupt this thread's wait, and Python raises KeyboardInterrupt only once the
        # wait returns; waited whole, Ctrl-C then took until the launch's deadline
        ready = set(mpc.wait(waitables, timeout=min(limit - now, _WAIT_SLICE_S)))
        for rank in sorted(pending):
            if conns[rank] not in ready and procs[rank].sentinel not in ready:
                continue
            report = _read_report(conns[rank], procs[rank], rank)
            if report is None:
                continue  # sentinel fired before the pipe drained; read it next round
            if isinstance(report, _Progress):
                if report.description == _STARTED:
                    started += 1
                    progress(f"ranks started: {started}/{nproc}", started / nproc)
                else:
                    progress(report.description, report.fraction)
                continue
            pending.discard(rank)
            if isinstance(report, _Result):
                results[rank] = pickle.loads(report.data)
            else:
                failures.append(report)
                if drain_until is None:
                    drain_until = time.monotonic() + _DRAIN_S
    if failures:
        _terminate(procs)
        if any(f.phase == "init" and _is_port_in_use(f.message) for f in failures):
            raise _PortInUse()
        first = _root_cause(failures)
        if first.kind != "died" and first.phase == "entry" and first.type_name == InputError.__name__:
            # a fault of the input (the plan, the model file, the weights) that only the ranks could see:
            # exit 2 with its message, as when the launching process finds one
            raise InputError(f"{first.message} (found by rank {first.rank} of {nproc} as it started)")
        raise RunError(_failure_message(failures, sorted(pending), nproc, port, backend))
    if pending:
        _terminate(procs)
        done = sorted(set(range(nproc)) - pending)
        raise RunError(
            f"launch timed out after {timeout_s + _WALL_MARGIN_S:.1f} s (timeout_s={timeout_s:g} + "
            f"{_WALL_MARGIN_S:g} s margin): ranks {sorted(pending)} of {nproc} had not finished "
            f"(ranks {done} had); they were terminated. Raise the timeout (--timeout SECONDS) if the work is just slow."
        )
    return results


def _read_report(conn: Any, proc: Any, rank: int) -> _Result | _Failure | _Progress | None:
    """The rank's report, a 'died' failure when it exited without one, or None when not ready yet."""
    if conn.poll():
        try:
            return conn.recv()
        except EOFError:
            pass  # child closed the pipe without sending: it died
    elif proc.is_alive():
        return None
    proc.join(timeout=_GRACE_S)
    code = proc.exitcode
    if code is None:
        how = "closed its result pipe without reporting"
    elif code < 0:
        how = f"was killed by signal {signal.Signals(-code).name} (exit code {code})"
    else:
        how = f"exited with code {code}"
    return _Failure(rank, "entry", "died", "", how, "", time.time())


def _is_port_in_use(message: str) -> bool:
    lowered = message.lower()
    return "eaddrinuse" in lowered or "address already in use" in lowered


def _cause_order(failure: _Failure) -> tuple[bool, float]:
    return (failure.kind != "died", failure.time_s)


def _root_cause(failures: list[_Failure]) -> _Failure:
    """A rank that died without reporting, else the earliest exception."""
    return min(failures, key=_cause_order)


def _failure_message(
    failures: list[_Failure], still_running: list[int], nproc: int, port: int, backend: str
) -> str:
    """Root cause first (`_root_cause`), then the other ranks' failures."""
    ordered = sorted(failures, key=_cause_order)
    first = ordered[0]
    where = {
        "init": f" while initialising the process group (backend {backend}, MASTER_ADDR={_MASTER_ADDR}, MASTER_PORT={port})",
        "entry": "",
        "result": " while pickling its result (return plain data or CPU tensors)",
    }[first.phase]
    if first.kind == "died":
        lines = [f"rank {first.rank} of {nproc} {first.message} before returning a result"]
    else:
        lines = [
            f"rank {first.rank} of {nproc} raised {first.type_name}{where}: {first.message}",
            f"last frames of rank {first.rank}'s traceback:",
            first.traceback_text.rstrip(),
        ]
    for other in ordered[1:]:
        what = (
            other.message
            if other.kind == "died"
            else f"raised {other.type_name}: {_first_line(other.message)}"
        )
        lines.append(f"then rank {other.rank} {what}")
    if still_running:
        lines.append(f"ranks {still_running} were still running and were terminated")
    return "\n".join(lines)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _join(procs: list[Any], timeout_s: float) -> None:
    """Wait up to `timeout_s` in total for every child to exit on its own."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))


def _terminate(procs: list[Any]) -> None:
    """SIGTERM every live child, SIGKILL those still alive after `_GRACE_S`, and reap them all."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    _join(procs, _GRACE_S)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join()

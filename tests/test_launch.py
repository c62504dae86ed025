"""runtime.launch and runtime.mesh on gloo: results, mesh groups, and each fault the launcher handles.

Entry functions are module-level: the spawned ranks import this module to find them.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from planner.errors import InputError, RunError
from planner.plan import MeshShape
from runtime import launch as launch_module
from runtime.launch import RankContext, launch, report_progress
from runtime.measure import time_iterations
from runtime.mesh import build_rank_groups

# ---------------------------------------------------------------------------------------------------
# Entries (run in the spawned ranks)


def _all_reduce_rank(ctx: RankContext, payload: int) -> dict:
    value = torch.tensor([float(ctx.rank)])
    dist.all_reduce(value)
    time_iterations(lambda: None, warmup=2, iters=3, device=ctx.device, progress=report_progress)
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "local_rank": ctx.local_rank,
        "backend": ctx.backend,
        "device": str(ctx.device),
        "sum": value.item(),
        "payload": payload,
        "env": {key: os.environ[key] for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")},
        "threads": torch.get_num_threads(),
        "tensor": torch.arange(3) * ctx.rank,  # results travel by value, tensors included
    }


def _mesh_layout(ctx: RankContext, payload: tuple[int, int, int]) -> dict:
    groups = build_rank_groups(MeshShape(*payload), "cpu")
    value = torch.tensor([float(ctx.rank)])
    dist.all_reduce(value, group=groups.group("tp"))  # the TP group really connects its ranks
    try:
        groups.group("xp")
        bad_axis = "no error"
    except InputError as exc:
        bad_axis = str(exc)
    return {
        "bad_axis": bad_axis,
        "coords": (groups.dp_rank, groups.pp_rank, groups.tp_rank),
        "groups": {axis: dist.get_process_group_ranks(groups.group(axis)) for axis in ("dp", "pp", "tp")},
        "tp_sum": value.item(),
    }


def _wrong_mesh(ctx: RankContext, payload: None) -> str:
    try:
        build_rank_groups(MeshShape(tp=3, pp=1, dp=2), "cpu")
    except InputError as exc:
        return str(exc)
    return "no error"


def _write_pid(directory: str, rank: int) -> None:
    """Write this rank's pid to rank<r>.pid whole: written aside and renamed, so a reader polling the
    folder never sees an empty file (it did once, CI 2026-12-02)."""
    tmp = Path(directory, f".rank{rank}.pid.tmp")
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, Path(directory, f"rank{rank}.pid"))


def _raise_on_rank1(ctx: RankContext, pid_dir: str) -> int:
    _write_pid(pid_dir, ctx.rank)
    if ctx.rank == 1:
        raise ValueError("boom")
    dist.all_reduce(torch.zeros(1))  # rank 0 waits for a rank that never comes
    return ctx.rank


def _input_error_on_every_rank(ctx: RankContext, pid_dir: str) -> int:
    _write_pid(pid_dir, ctx.rank)
    raise InputError("plan field 'dp_style' cannot run here")


def _kill_rank1_mid_run(ctx: RankContext, pid_dir: str) -> int:
    _write_pid(pid_dir, ctx.rank)
    dist.barrier()  # both ranks are up and connected
    if ctx.rank == 1:
        time.sleep(0.5)  # let rank 0 block in the all-reduce first
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.zeros(1))
    return ctx.rank


def _rank1_sleeps(ctx: RankContext, payload: None) -> int:
    if ctx.rank == 1:
        time.sleep(120)
    return ctx.rank


def _sleep_forever(ctx: RankContext, pid_dir: str) -> None:
    _write_pid(pid_dir, ctx.rank)
    time.sleep(120)


def _return_rank(ctx: RankContext, payload: None) -> int:
    return ctx.rank


# ---------------------------------------------------------------------------------------------------
# Helpers


def _alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (dead, not yet reaped by a reparenting init) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state not in ("Z", "X")


def _pids(directory: Path) -> list[int]:
    return [int(path.read_text()) for path in sorted(directory.glob("rank*.pid"))]


def _assert_no_children(pid_dir: Path) -> None:
    assert multiprocessing.active_children() == []
    pids = _pids(pid_dir)
    assert pids, "the entry never ran"
    assert [pid for pid in pids if _alive(pid)] == []


# ---------------------------------------------------------------------------------------------------
# Results and mesh


@pytest.mark.slow
def test_launch_returns_results_in_rank_order() -> None:
    told: list[tuple[str, float | None]] = []
    results = launch(
        _all_reduce_rank, 7, 2, timeout_s=30, progress=lambda text, done: told.append((text, done))
    )
    assert [r["rank"] for r in results] == [0, 1]
    # progress reaches the launching process: the ranks' start-up, then rank 0's (only) timing steps
    said = [text for text, _ in told]
    assert said[:2] == ["starting 2 rank(s)", "ranks started: 1/2"] and "ranks started: 2/2" in said
    assert said.count("warm-up 1/2") == said.count("timed iteration 1/3") == 1
    assert said.index("warm-up 1/2") < said.index("timed iteration 1/3")
    assert told[-1] == ("timed 3 iterations", 1.0)
    for rank, result in enumerate(results):
        assert result["sum"] == 1.0  # 0 + 1
        assert result["world_size"] == 2 and result["local_rank"] == rank
        assert result["backend"] == "gloo" and result["device"] == "cpu"
        assert result["payload"] == 7
        assert result["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
        }
        assert result["threads"] == max(1, (os.cpu_count() or 1) // 2)
        assert torch.equal(result["tensor"], torch.arange(3) * rank)
    assert multiprocessing.active_children() == []


def test_cuda_ranks_are_spawned_and_gloo_ranks_forked_from_the_server() -> None:
    # a process forked after CUDA was initialised cannot use CUDA: NCCL ranks must not come from the
    # fork server, whose preload may initialise it (seen on an H200 with torch 2.11+cu130)
    assert launch_module._context("nccl").get_start_method() == "spawn"
    if "forkserver" in multiprocessing.get_all_start_methods():
        assert launch_module._context("gloo").get_start_method() == "forkserver"


@pytest.mark.slow
def test_spawned_ranks_run_the_same_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    # the path CUDA ranks take, exercised here on gloo: the job and the entry travel to fresh interpreters
    monkeypatch.setattr(launch_module, "_context", lambda backend: multiprocessing.get_context("spawn"))
    results = launch(_all_reduce_rank, 7, nproc=2, backend="gloo", timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["sum"] == 1.0 and r["payload"] == 7 for r in results)


@pytest.mark.slow
def test_mesh_groups_tp2_pp2_on_four_ranks() -> None:
    results = launch(_mesh_layout, (2, 2, 1), 4, timeout_s=60)
    tp_groups = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    pp_groups = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    for rank, result in enumerate(results):
        assert result["coords"] == MeshShape(tp=2, pp=2, dp=1).coords(rank)
        assert result["groups"] == {"dp": [rank], "pp": pp_groups[rank], "tp": tp_groups[rank]}
        assert result["tp_sum"] == float(sum(tp_groups[rank]))
    assert [r["coords"] for r in results] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert all("unknown mesh axis 'xp'" in r["bad_axis"] for r in results)


def test_mesh_arithmetic_without_processes() -> None:
    # tp=2, pp=2, dp=2: rank = (pp_rank * 2 + dp_rank) * 2 + tp_rank, the pipeline outermost as in
    # Megatron-Core and torchtitan: a DP group's ranks share a node (the cost model prices them so);
    # dp outermost put every stage of a replica on a node and the DP and EP groups across nodes
    shape = MeshShape(tp=2, pp=2, dp=2)
    assert shape.coords(6) == (1, 1, 0)
    assert shape.coords(2) == (1, 0, 0) and shape.coords(4) == (0, 1, 0)  # (dp_rank, pp_rank, tp_rank)
    assert all(shape.rank_of(*shape.coords(rank)) == rank for rank in range(8))
    with pytest.raises(ValueError, match="outside a mesh of 8 devices"):
        shape.coords(8)


@pytest.mark.slow
def test_mesh_size_mismatch_quotes_values() -> None:
    results = launch(_wrong_mesh, None, 2, timeout_s=30)
    assert results == ["dp(2) * pp(1) * cp(1) * tp(3) != world_size(2)"] * 2


# ---------------------------------------------------------------------------------------------------
# Faults


@pytest.mark.slow
def test_rank_that_raises_is_reported_and_others_terminated(tmp_path: Path) -> None:
    with pytest.raises(RunError) as info:  # reported as the raise, not as a time-out
        launch(_raise_on_rank1, str(tmp_path), 2, timeout_s=30)
    message = str(info.value)
    assert message.startswith("rank 1 of 2 raised ValueError: boom")
    assert "_raise_on_rank1" in message and 'raise ValueError("boom")' in message  # last frames
    assert info.value.exit_code == 4
    _assert_no_children(tmp_path)


def test_a_fault_of_the_input_found_by_the_ranks_is_an_input_error(tmp_path: Path) -> None:
    """An InputError the ranks raise as they start (a plan field only the lowered model shows to be
    wrong: zero2 over parameters tied across pipeline stages) is the input's fault: exit 2 with its
    message, not a failed run (exit 4) with the rank's traceback."""
    with pytest.raises(InputError) as info:
        launch(_input_error_on_every_rank, str(tmp_path), 2, timeout_s=30)
    message = str(info.value)
    assert message.startswith("plan field 'dp_style' cannot run here (found by rank")
    assert info.value.exit_code == 2 and "Traceback" not in message
    _assert_no_children(tmp_path)


@pytest.mark.slow
def test_rank_killed_mid_run_is_reported(tmp_path: Path) -> None:
    # reported as the kill (not as a time-out of the surviving rank waiting in a collective)
    with pytest.raises(RunError, match=r"rank 1 of 2 was killed by signal SIGKILL"):
        launch(_kill_rank1_mid_run, str(tmp_path), 2, timeout_s=10.0)
    _assert_no_children(tmp_path)


@pytest.mark.slow
def test_wall_timeout_names_unfinished_ranks() -> None:
    with pytest.raises(RunError, match=r"timed out .* ranks \[1\] of 2 had not finished \(ranks \[0\] had\)"):
        launch(_rank1_sleeps, None, 2, timeout_s=4.0)
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_keyboard_interrupt_terminates_children(tmp_path: Path) -> None:
    """Ctrl-C on a launching process (SIGINT, as a terminal sends it): KeyboardInterrupt reaches its
    caller once every rank is stopped. The launch runs in a process of its own, as a user's does (in
    the test process, a signal sent from a helper thread sometimes never woke the main thread's wait
    in a long pytest run, and the launch ran to its deadline)."""
    script = (
        "import sys\n"
        f"sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]\n"
        "from test_launch import _sleep_forever\n"
        "from runtime.launch import launch\n"
        "try:\n"
        f"    launch(_sleep_forever, {str(tmp_path)!r}, 2, timeout_s=60)\n"
        "except KeyboardInterrupt:\n"
        "    import multiprocessing\n"
        "    sys.exit(130 if multiprocessing.active_children() == [] else 1)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 30
        while len(_pids(tmp_path)) < 2 and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.05)
        assert len(_pids(tmp_path)) == 2, "the ranks never started"
        parent.send_signal(signal.SIGINT)
        assert parent.wait(timeout=30) == 130  # KeyboardInterrupt, no child left to the launcher
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert [pid for pid in _pids(tmp_path) if _alive(pid)] == []


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux only")
def test_children_die_with_the_parent(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        f"sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]\n"
        "from test_launch import _sleep_forever\n"
        "from runtime.launch import launch\n"
        f"launch(_sleep_forever, {str(tmp_path)!r}, 2, timeout_s=60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 30
        while len(_pids(tmp_path)) < 2 and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.05)
        assert len(_pids(tmp_path)) == 2, "the ranks never started"
    finally:
        parent.kill()  # SIGKILL: no finally block runs in the parent, only PR_SET_PDEATHSIG helps
        parent.wait()
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in _pids(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in _pids(tmp_path) if _alive(pid)] == []


@pytest.mark.slow
def test_taken_port_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1], launch_module.free_port()])
        monkeypatch.setattr(launch_module, "free_port", lambda: next(ports))
        attempts = []
        run_local = launch_module._run_local

        def counting_run_local(*args: object) -> list:
            attempts.append(args[2])  # the port
            return run_local(*args)

        monkeypatch.setattr(launch_module, "_run_local", counting_run_local)
        assert launch(_return_rank, None, 2, timeout_s=30) == [0, 1]
        assert attempts[0] == taken.getsockname()[1] and len(attempts) == 2  # the taken port failed first


def test_entry_must_be_picklable() -> None:
    with pytest.raises(InputError, match="module-level entry"):
        launch(lambda ctx, payload: None, None, 2)
    with pytest.raises(InputError, match="nproc must be a positive integer"):
        launch(_return_rank, None, 0)
    with pytest.raises(InputError, match="backend must be one of"):
        launch(_return_rank, None, 2, backend="mpi")


# ---------------------------------------------------------------------------------------------------
# Under torchrun


def test_under_torchrun_runs_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "PLANNER_UNDER_TORCHRUN": "1",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(launch_module.free_port()),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    threads = torch.get_num_threads()
    try:
        with pytest.raises(InputError, match=r"nproc\(2\) != WORLD_SIZE\(1\)"):
            launch(_return_rank, None, 2)
        results = launch(_all_reduce_rank, 3, 1, timeout_s=30)
    finally:
        torch.set_num_threads(threads)
    assert [r["rank"] for r in results] == [0] and results[0]["sum"] == 0.0
    assert results[0]["payload"] == 3
    assert not dist.is_initialized()
    assert multiprocessing.active_children() == []


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a fork server and process groups")
def test_ctrl_c_while_the_fork_server_imports_torch_prints_no_traceback(tmp_path: Path) -> None:
    """A terminal's Ctrl-C goes to the whole process group. Sent while the ranks were starting, it
    reached the fork server in the middle of its imports of torch (`_PRELOAD`): a traceback from inside
    torch was printed beside "interrupted". The server now starts with SIGINT ignored: the launching
    process alone takes it (KeyboardInterrupt, exit 130), and nothing else is printed."""
    script = (
        "import sys\n"
        f"sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]\n"
        "from test_launch import _sleep_forever\n"
        "from runtime.launch import launch\n"
        "print('launching', flush=True)\n"
        "try:\n"
        f"    launch(_sleep_forever, {str(tmp_path)!r}, 2, timeout_s=60)\n"
        "except KeyboardInterrupt:\n"
        "    sys.exit(130)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert parent.stdout.readline().strip() == "launching"
        time.sleep(0.3)  # the fork server is importing torch for seconds
        os.killpg(parent.pid, signal.SIGINT)
        _, err = parent.communicate(timeout=60)
        assert parent.returncode == 130 and "Traceback" not in err, err[-3000:]
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()

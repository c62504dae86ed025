"""The `planner` command run in the test's own process: `planner.cli.main.main` with stdout and stderr
captured, returned as `subprocess.run` would return them.

A fresh `python -m planner.cli` costs a test ~3 s of interpreter start and imports, and with `--run`
~5 s more to start the fork server its ranks are forked from (it imports torch once per launching
process); in this process both are paid once per pytest worker. What a subprocess adds beyond that
(the console script's entry, a process's exit code, signals, a closed stdout, torchrun, a model file
read by the ranks' environment) keeps its own subprocess tests (`tests/test_cli.py`,
`tests/test_moe_frontend.py`).
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import traceback
from pathlib import Path

from planner.cli.main import main

ROOT = Path(__file__).resolve().parent.parent


def planner_in_process(*args: str, cwd: Path | str = ROOT) -> subprocess.CompletedProcess:
    """Run `planner ARGS` in this process from `cwd`; returns its exit code, stdout and stderr as a
    `subprocess.CompletedProcess`. An exception that escapes `main` becomes exit code 1 with its
    traceback on stderr, as the interpreter would print it. No timeout is enforced here (a run's own
    --timeout still applies)."""
    out, err = io.StringIO(), io.StringIO()
    before = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:  # noqa: BLE001 - reported as the interpreter reports an uncaught exception
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(
        [sys.executable, "-m", "planner.cli", *args], code, out.getvalue(), err.getvalue()
    )

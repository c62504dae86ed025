"""Progress of long work, reported upward without knowing who shows it.

    progress(description, fraction)

A `Progress` is a plain callable that the command line passes down (`planner.cli.progress` draws it as
a rich bar on a terminal, or drops it); calibration, the mesh search and runs call it as they go.
`description` says what is being done now ("solving mesh 3/12: tp=2 pp=2 dp=1 m=4"); `fraction` is
how much of the current task is done, in [0, 1], or None when unknown (a spinner). A new description
with fraction 0 (or None) starts a new task. Calls are cheap; a caller in a hot loop throttles itself.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str, "float | None"], None]


def silent(description: str, fraction: float | None) -> None:
    """The progress callback that shows nothing (the default of every function taking one)."""

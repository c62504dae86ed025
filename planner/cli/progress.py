"""Progress bars of the command line: rich bars on stderr when it is a terminal, nothing otherwise.

    with Bars(err_console, enabled) as bars:
        bars("tracing the model", None)                          # a spinner
        workflow.make_plan(..., progress=bars)                    # bars("mesh 3/12: ...", 0.25)

`Bars` is a `planner.progress.Progress` callable, so the lower layers take it as they take any
callback. One bar shows at a time: a call whose fraction is lower than the last one's, or that
switches between known (a bar) and unknown progress (a spinner), starts a new task. The bars are
transient: they vanish when the work is done, leaving only the command's output. Disabled (stderr not
a terminal, e.g. CI logs or a pipe, or `--json -`), nothing is drawn or written at all.
"""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)


class Bars:
    """Progress of long work on `console` (stderr): see the module docstring."""

    def __init__(self, console: Console, enabled: bool | None = None) -> None:
        """enabled None: when `console` is a terminal (rich's `Console.is_terminal`)."""
        self.console = console
        self.enabled = console.is_terminal if enabled is None else enabled
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._last: float | None = None

    @property
    def rich(self) -> Progress:
        """The rich `Progress` behind the bars, for code that adds its own tasks (inside `with`); a
        disabled one, showing nothing, when the bars are off."""
        return self._progress if self._progress is not None else Progress(disable=True)

    def __enter__(self) -> Bars:
        if self.enabled:
            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self._progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
        self._progress = self._task = self._last = None

    def __call__(self, description: str, fraction: float | None) -> None:
        """Show `description` with `fraction` done (in [0, 1]; None: unknown)."""
        progress = self._progress
        if progress is None:
            return
        known = fraction is not None
        restart = (
            self._task is None
            or known != (self._last is not None)
            or (known and self._last is not None and fraction < self._last)
        )
        if restart:
            if self._task is not None:
                progress.update(self._task, visible=False)
            self._task = progress.add_task(description, total=1.0 if known else None)
        assert self._task is not None
        progress.update(self._task, description=description, completed=fraction or 0.0)
        self._last = fraction

    def note(self, text: str) -> None:
        """A line of information on the console, above the bar when one shows."""
        console = self._progress.console if self._progress is not None else self.console
        console.print(f"[dim]{text}[/dim]")

"""Errors a user can act on, each with the process exit code the CLI returns for it.

Exit codes (documented in docs/report.md): 0 success, 2 bad input (file, YAML, options),
3 no feasible plan, 4 run failed.
"""

from __future__ import annotations


class PlannerError(Exception):
    """Base class of errors caused by user input or the environment; carries an exit code."""

    exit_code: int = 1


class InputError(PlannerError, ValueError):
    """Bad input: a model file, a YAML spec or a command-line option. Exit code 2."""

    exit_code = 2


class InfeasibleError(PlannerError):
    """No plan satisfies the constraints (memory, divisibility, mesh). Exit code 3."""

    exit_code = 3


class RunError(PlannerError):
    """Executing a plan on real process groups failed (a rank raised, timed out or was killed, or the
    numerics check failed). Exit code 4. ``run``: the run's summary when the ranks finished and only
    the check failed (its `measured` and `numerics`, what a --json report carries), else None."""

    exit_code = 4

    def __init__(self, message: str, run: dict | None = None) -> None:
        super().__init__(message)
        self.run = run

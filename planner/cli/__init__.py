"""Command line: ``planner optimize | show | run | calibrate`` and what they print and write.

- ``main``: argument parsing, exit codes.
- ``workflow``: the steps of each command (load, capture, plan, emit, run), callable from Python.
- ``render``: rich tables of plans and runs.
- ``emitting``: ``--emit DIR``.
"""

from planner.cli.main import main

__all__ = ["main"]

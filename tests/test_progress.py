"""Progress bars: drawn on a terminal, absent from pipes and CI logs and with `--json -`."""

from __future__ import annotations

import importlib
import io
import json

from rich.console import Console

from planner.cli.progress import Bars

cli = importlib.import_module("planner.cli.main")  # the module (planner.cli.main is also its function)


def _fed(bars: Bars) -> None:
    with bars:
        bars("tracing the model", None)
        for i in range(3):
            bars(f"mesh {i + 1}/3: tp=1 pp=1 dp=2 m=1", i / 3)
        bars.note("measuring this machine")


def test_bars_draw_on_a_terminal_and_write_nothing_elsewhere() -> None:
    terminal = io.StringIO()
    _fed(Bars(Console(file=terminal, force_terminal=True, width=100)))
    drawn = terminal.getvalue()
    assert "mesh 3/3: tp=1 pp=1 dp=2 m=1" in drawn and "━" in drawn and "measuring this machine" in drawn
    piped = io.StringIO()
    bars = Bars(Console(file=piped, width=100))
    assert not bars.enabled
    _fed(bars)
    assert piped.getvalue() == "measuring this machine\n"  # notes stay, bars never start


def test_optimize_is_quiet_when_piped_and_json_goes_to_stdout(capsys, monkeypatch) -> None:
    terminal = io.StringIO()
    monkeypatch.setattr(cli, "err_console", Console(file=terminal, force_terminal=True, width=120))
    argv = ["optimize", "examples/mlp.py", "--cluster", "local-cpu", "--nproc", "2"]
    assert cli.main([*argv, "--json", "-"]) == 0  # stderr a terminal, but the report is on stdout
    out, err = capsys.readouterr()
    assert json.loads(out)["cluster"] == "local-cpu"  # stdout: the report alone
    assert "Mesh: " in terminal.getvalue() + err and "mesh 1/" not in terminal.getvalue()
    assert cli.main(argv) == 0  # the same terminal without --json -: the search shows its bar
    assert "mesh 1/" in terminal.getvalue()
    capsys.readouterr()
    monkeypatch.setattr(cli, "err_console", Console(file=io.StringIO(), width=120))  # a pipe / CI log
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "Mesh: " in out and "tracing the model" not in out + err and "\r" not in out + err

"""The commands of README.md and docs/*.md run as written, and their relative links resolve
(scripts/check_docs.py); and the checker itself catches a broken link, a command the planner's
parser refuses and a command that fails."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKER = ROOT / "scripts" / "check_docs.py"


def _checker():
    """scripts/check_docs.py as a module (registered first: its dataclasses look their module up)."""
    if "check_docs" not in sys.modules:
        spec = importlib.util.spec_from_file_location("check_docs", CHECKER)
        module = importlib.util.module_from_spec(spec)
        sys.modules["check_docs"] = module
        spec.loader.exec_module(module)
    return sys.modules["check_docs"]


@pytest.mark.slow
def test_readme_commands_run_and_every_docs_command_parses() -> None:
    """README.md's planning commands run; every page's commands parse and its links resolve."""
    proc = subprocess.run(
        [sys.executable, str(CHECKER), "--quick"], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "ran " in proc.stdout and "skipped " in proc.stdout


def test_checker_reads_commands_of_fenced_and_indented_blocks(tmp_path: Path) -> None:
    check = _checker()
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n```bash\n# a comment\nplanner optimize a.py --cluster dgx-h100 \\\n"
        "    --tp 2  # exits 3\nmkdir -p out && planner show out/p.yaml\n```\n\n"
        "```text\nplanner optimize MODEL.py [--tp N]\n```\n\nText.\n\n    python bench/plan_speed.py\n"
    )
    commands = check.read_page(page).commands
    assert [c.argv[:2] for c in commands] == [
        ["planner", "optimize"],
        ["planner", "show"],
        ["python", "bench/plan_speed.py"],
    ]
    assert commands[0].argv[-2:] == ["--tp", "2"] and commands[0].expect == 3


def test_checker_names_a_broken_link_and_a_missing_anchor(tmp_path: Path) -> None:
    check = _checker()
    (tmp_path / "other.md").write_text("# Other page\n\n## A section (`--emit`)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#a-section---emit) [web](https://example.com)\n"
        "[missing](nowhere.md) [bad anchor](other.md#no-such-heading) `[not a link](x.md)`\n"
    )
    errors = check.link_errors(page)
    assert len(errors) == 2, errors
    assert "nowhere.md" in errors[0] and "#no-such-heading" in errors[1]


def test_checker_refuses_an_option_the_planner_does_not_have() -> None:
    check = _checker()
    assert check.parse_error(["optimize", "examples/llama3.py", "--tp", "2"]) is None
    assert "--no-such-option" in check.parse_error(["optimize", "examples/llama3.py", "--no-such-option"])
    assert check.parse_error(["optimize", "examples/llama3.py", "--tp", "zero"]) is not None


def test_checker_skips_what_needs_a_cluster_or_minutes(tmp_path: Path) -> None:
    check = _checker()
    presets = ["dgx-h100"]

    def why(line: str, unavailable: frozenset = frozenset()) -> str:
        command = check.Command(tmp_path / "p.md", 1, line, line.split())
        return check.classify(command, presets, set(), set(unavailable))

    assert why("planner optimize examples/llama3.py --cluster dgx-h100") == ""
    assert why("planner export plan.yaml --to megatron") == ""
    assert "--run" in why("planner optimize examples/llama3.py --cluster dgx-h100 --run")
    assert "measures this machine" in why("planner optimize examples/llama3.py")
    assert "torchrun" in why("torchrun --nproc-per-node 8 -m planner.cli run plan.yaml --model m.py")
    assert "skipped command" in why("planner show local.yaml", frozenset({"local.yaml"}))


@pytest.mark.slow
def test_checker_reports_a_failing_command_with_its_stderr(tmp_path: Path, capsys) -> None:
    check = _checker()
    page = tmp_path / "page.md"
    page.write_text("```bash\nplanner show missing-plan.yaml\n```\n")
    assert check.main([str(page)]) == 1
    err = capsys.readouterr().err
    assert "planner show missing-plan.yaml" in err and "exited 2" in err and "missing-plan.yaml" in err

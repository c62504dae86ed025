"""Check that the commands of README.md and docs/*.md run as written and that their links resolve.

    python scripts/check_docs.py [--quick] [--list] [--timeout S] [PAGE.md ...]

1. Links: every relative link `[text](path)` or `[text](path#anchor)` of a page must point to an
   existing file or folder; an anchor into a Markdown page must name one of its headings (GitHub's
   heading slugs).
2. Commands: the shell lines of each page's code blocks, fenced (```, ```bash, ```sh, ```shell,
   ```console; not ```text, ```python, ```yaml, ...) or indented by four spaces. A line ending in
   a backslash is joined with the next, `a && b` and `a; b` are split, comments are dropped, and
   leading `VAR=value` words are left out. Lines that start with `planner`, `python`, `bash`,
   `torchrun`, `srun` or `sbatch` are commands; other lines (`cd`, `mkdir`, `export`, `#SBATCH`) are
   not checked.
   - Every `planner` command (also the `python -m planner.cli ...` that a `torchrun` line starts) is
     parsed by the planner's own argument parser (`planner.cli.main.build_parser`), without running.
   - Every `python SCRIPT` / `bash SCRIPT` names a script of the checkout, and each `--flag` it
     passes appears in that script.
   - Runnable commands are run, in page order, in a scratch folder per page where examples/,
     bench/, tests/ and costmodels/ link to the checkout (what a command writes, e.g. plan.yaml, is
     there for the next command of the page; the checkout stays clean): planning-only `planner
     optimize` (no --run, a preset or a spec file as --cluster, no --data or --weights), `planner
     show`, `planner export`, `planner compare` and `--help`. Skipped, and listed with the reason:
     `--run`, `planner run`, `calibrate`, `ladder-eval`, `adapt`, torchrun / srun / sbatch, an
     optimize without --cluster (it measures this machine first), the benchmarks and scripts/*.sh
     (minutes each), and commands that read what a skipped command writes.
   - A command that is meant to fail says so in a trailing comment: `# exits 3`.
   - A fenced yaml block whose first line is `# file: NAME` is written to NAME in the page's scratch
     folder before the page's commands run (a cluster spec the page then plans with).
3. `--quick`: run only README.md's runnable commands; every page is still parsed and its links
   checked (the budget of tests/test_docs_commands.py).

Exits 1 naming each failing command with the tail of its stderr; 0 when everything passed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINKED_FOLDERS = ("examples", "bench", "tests", "costmodels", "scripts")
COMMAND_WORDS = ("planner", "python", "python3", "bash", "torchrun", "srun", "sbatch")
SHELL_LANGUAGES = ("", "bash", "sh", "shell", "console")
# options whose value is a file or folder a command writes
OUTPUT_OPTIONS = ("--out", "--json", "--emit", "--plot")
EXPECT = re.compile(r"#\s*exits?\s+(\d+)")


@dataclass
class Command:
    page: Path
    line: int  # 1-based line of the page where the command starts
    text: str  # as written, continuation lines joined, comment dropped
    argv: list[str]
    expect: int = 0  # the exit code the page says it returns
    skip: str = ""  # why it is not run ("" = run it)


@dataclass
class Page:
    path: Path
    commands: list[Command] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # name -> text, from `# file: NAME` blocks


def pages(args: list[str]) -> list[Path]:
    if args:
        return [Path(a).resolve() for a in args]
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------------------------
# Reading a page


def code_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of every fenced and indented code block; `language` is
    "indented" for the latter."""
    blocks = []
    lines = text.splitlines()
    i = 0
    previous_blank = True
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)", line)
        if fence:
            indent, marker, language = fence.group(1), fence.group(2), fence.group(3).lower()
            body = []
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(marker):
                body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
                j += 1
            blocks.append((language, i + 2, body))
            i = j + 1
            previous_blank = False
            continue
        if previous_blank and re.match(r"^ {4,}\S", line) and not re.match(r"^\s*([-*+]|\d+\.)\s", line):
            body = []
            start = i
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i].strip())
                i += 1
            blocks.append(("indented", start + 1, body))
            previous_blank = True
            continue
        previous_blank = not line.strip()
        i += 1
    return blocks


def split_commands(line: str) -> list[str]:
    """`a && b; c` -> ["a", "b", "c"] (outside quotes)."""
    parts, current, quote = [], "", ""
    k = 0
    while k < len(line):
        ch = line[k]
        if quote:
            current += ch
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
            current += ch
        elif line.startswith("&&", k) or line.startswith("||", k):
            parts.append(current)
            current = ""
            k += 1
        elif ch == ";":
            parts.append(current)
            current = ""
        else:
            current += ch
        k += 1
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def strip_comment(line: str) -> tuple[str, str]:
    """(the line without its trailing `# comment`, the comment), outside quotes."""
    quote = ""
    for k, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k].rstrip(), line[k:]
    return line, ""


def read_page(path: Path) -> Page:
    page = Page(path)
    for language, first, body in code_blocks(path.read_text()):
        if language in ("yaml", "yml") and body and (m := re.match(r"#\s*file:\s*(\S+)", body[0])):
            page.files[m.group(1)] = "\n".join(body) + "\n"
            continue
        if language not in SHELL_LANGUAGES and language != "indented":
            continue
        k = 0
        while k < len(body):
            start = k
            line = body[k]
            while line.rstrip().endswith("\\") and k + 1 < len(body):
                k += 1
                line = line.rstrip()[:-1].rstrip() + " " + body[k].strip()
            k += 1
            line = line.strip()
            if line.startswith("$ "):
                line = line[2:]
            text, comment = strip_comment(line)
            expect = EXPECT.search(comment)
            for part in split_commands(text):
                try:
                    argv = shlex.split(part)
                except ValueError:
                    continue
                while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
                    argv = argv[1:]
                if not argv or argv[0] not in COMMAND_WORDS:
                    continue
                page.commands.append(
                    Command(path, first + start, part, argv, int(expect.group(1)) if expect else 0)
                )
    return page


# ---------------------------------------------------------------------------------------------
# Links


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def outside_fences(text: str) -> str:
    """`text` without its fenced code blocks (a `# comment` in a bash block is no heading)."""
    kept, fence = [], ""
    for line in text.splitlines():
        m = re.match(r"^\s*(`{3,}|~{3,})", line)
        if fence:
            if m and m.group(1).startswith(fence):
                fence = ""
        elif m:
            fence = m.group(1)
        else:
            kept.append(line)
    return "\n".join(kept)


def anchors(path: Path) -> set[str]:
    text = outside_fences(path.read_text())
    found: set[str] = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        base = slug(m.group(1))
        name, n = base, 1
        while name in found:
            name = f"{base}-{n}"
            n += 1
        found.add(name)
    return found


def link_errors(path: Path) -> list[str]:
    text = outside_fences(path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    errors = []
    for m in re.finditer(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            errors.append(f"{rel(path)}: link to {target}: {rel(dest)} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            errors.append(
                f"{rel(path)}: link to {target}: no heading with the anchor #{anchor} in {rel(dest)}"
            )
    return errors


# ---------------------------------------------------------------------------------------------
# Parsing and classifying commands


def planner_argv(argv: list[str]) -> list[str] | None:
    """The planner arguments of a command line: `planner ...`, `python -m planner.cli ...`, or the
    `-m planner.cli ...` that a torchrun line starts; None if it runs no planner command."""
    if argv[0] == "planner":
        return argv[1:]
    if "-m" in argv:
        k = argv.index("-m")
        if k + 1 < len(argv) and argv[k + 1] in ("planner.cli", "planner.cli.main"):
            return argv[k + 2 :]
    return None


def parse_error(argv: list[str]) -> str | None:
    """The planner parser's complaint about `argv` (planner's arguments), or None."""
    from planner.cli.main import build_parser  # noqa: PLC0415
    from planner.errors import InputError  # noqa: PLC0415

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            build_parser().parse_args(argv)
    except InputError as e:
        return str(e)
    except SystemExit as e:  # --help
        return None if e.code in (0, None) else out.getvalue().strip() or f"argparse exited {e.code}"
    return None


def script_errors(cmd: Command) -> list[str]:
    """A `python SCRIPT ...` / `bash SCRIPT ...` line: the script exists, its --flags appear in it."""
    args = cmd.argv[1:]
    if cmd.argv[0] in ("python", "python3") and args and args[0] == "-m":
        return []
    if not args:
        return []
    script = ROOT / args[0]
    where = f"{rel(cmd.page)}:{cmd.line}: `{cmd.text}`"
    if not script.is_file():
        return [f"{where}: {args[0]} is not a file of the checkout"]
    source = script.read_text()
    if script.suffix == ".sh" and '"$@"' in source:  # passes its arguments on: nothing to check here
        return []
    return [
        f"{where}: {args[0]} has no option {flag}"
        for flag in (a.split("=", 1)[0] for a in args[1:] if a.startswith("--"))
        if not re.search(r"[\"']" + re.escape(flag) + r"[\"'\s=]", source)
    ]


def option(argv: list[str], name: str) -> str | None:
    for k, a in enumerate(argv):
        if a == name and k + 1 < len(argv):
            return argv[k + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def outputs(argv: list[str]) -> set[str]:
    return {v for name in OUTPUT_OPTIONS if (v := option(argv, name)) is not None}


def classify(cmd: Command, presets: list[str], page_files: set[str], unavailable: set[str]) -> str:
    """Why `cmd` is not run here ("" to run it). `unavailable`: what skipped commands write."""
    argv = cmd.argv
    if argv[0] in ("torchrun", "srun", "sbatch"):
        return f"{argv[0]}: needs a GPU cluster"
    if argv[0] == "bash":
        return "a script of minutes (set-up, demo or the whole test suite)"
    args = planner_argv(argv)
    if args is None:
        if "--help" in argv[1:]:
            return ""
        return "a benchmark (minutes; bench/README.md has its figures)"
    if "--help" in args or "-h" in args:
        return ""
    if not args:
        return "no subcommand"
    sub = args[0]
    needed = [a for a in args[1:] if a in unavailable]
    if needed:
        return f"reads {needed[0]}, which a skipped command writes"
    if sub == "optimize":
        if "--run" in args:
            return "--run: runs ranks and times them"
        cluster = option(args, "--cluster")
        if cluster is None:
            return "no --cluster: measures this machine first (planner calibrate, 30-40 s)"
        if cluster not in presets and cluster not in page_files and not (ROOT / cluster).is_file():
            return f"--cluster {cluster}: a spec file this page does not write"
        if option(args, "--data") is not None or option(args, "--weights") is not None:
            return "--data / --weights: trains or evaluates on text, or needs trained weights"
        return ""
    if sub in ("show", "export", "compare"):
        return ""
    if sub == "run":
        return "planner run: runs ranks and times them"
    if sub == "calibrate":
        return "planner calibrate: measures this machine (30-40 s)"
    if sub in ("ladder-eval", "adapt"):
        return f"planner {sub}: evaluates or trains a model on text (minutes)"
    return f"planner {sub}: not a planning command"


# ---------------------------------------------------------------------------------------------
# Running


def scratch_folder(base: Path, page: Page) -> Path:
    folder = base / page.path.stem
    folder.mkdir(parents=True)
    for name in LINKED_FOLDERS:
        (folder / name).symlink_to(ROOT / name, target_is_directory=True)
    for name, text in page.files.items():
        (folder / name).write_text(text)
    return folder


def run_command(cmd: Command, cwd: Path, timeout_s: float) -> tuple[int, str, float]:
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["COLUMNS"] = "120"
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd.argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout_s:g} s", time.monotonic() - start
    except FileNotFoundError as e:
        return -1, str(e), time.monotonic() - start
    return proc.returncode, proc.stderr.strip() or proc.stdout.strip(), time.monotonic() - start


def tail(text: str, lines: int = 15) -> str:
    return "\n".join("      " + line for line in text.splitlines()[-lines:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", help="pages to check (default: README.md and docs/*.md)")
    parser.add_argument("--quick", action="store_true", help="run only README.md's runnable commands")
    parser.add_argument("--list", action="store_true", help="list the commands and what would run; run none")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per command (default 300)")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from costmodels.cluster import preset_names  # noqa: PLC0415

    presets = preset_names()
    failures: list[str] = []
    ran: list[tuple[Command, float]] = []
    skipped: list[Command] = []
    not_run: list[Command] = []
    read = [read_page(p) for p in pages(args.pages)]

    for page in read:
        failures += link_errors(page.path)
        unavailable: set[str] = set()
        for cmd in page.commands:
            where = f"{rel(page.path)}:{cmd.line}: `{cmd.text}`"
            planner_args = planner_argv(cmd.argv)
            if planner_args is not None:
                if (error := parse_error(planner_args)) is not None:
                    failures.append(f"{where}: the planner's parser refuses it: {error}")
            elif cmd.argv[0] in ("python", "python3", "bash"):
                failures += script_errors(cmd)
            cmd.skip = classify(cmd, presets, set(page.files), unavailable)
            if cmd.skip:
                unavailable |= outputs(planner_args or [])

    with tempfile.TemporaryDirectory(prefix="check_docs-") as tmp:
        for page in read:
            runnable = [c for c in page.commands if not c.skip]
            skipped += [c for c in page.commands if c.skip]
            if args.list or (args.quick and page.path != ROOT / "README.md"):
                not_run += runnable
                continue
            folder = scratch_folder(Path(tmp), page) if runnable else None
            for cmd in runnable:
                print(f"run  {rel(page.path)}:{cmd.line}: {cmd.text}", flush=True)
                code, err, seconds = run_command(cmd, folder, args.timeout)
                ran.append((cmd, seconds))
                if code != cmd.expect:
                    expected = f" (expected {cmd.expect})" if cmd.expect else ""
                    failures.append(
                        f"{rel(page.path)}:{cmd.line}: `{cmd.text}` exited {code}{expected}:\n{tail(err)}"
                    )
    return report(failures, ran, skipped, not_run)


def report(failures: list[str], ran: list, skipped: list[Command], not_run: list[Command]) -> int:
    print(f"\nran {len(ran)} command(s) ({sum(s for _, s in ran):.0f} s):")
    for cmd, seconds in ran:
        print(f"  ok {seconds:5.1f} s  {rel(cmd.page)}:{cmd.line}: {cmd.text}")
    if not_run:
        print(f"\nrunnable, not run this time ({len(not_run)}; without --quick / --list they run):")
        for cmd in not_run:
            print(f"  {rel(cmd.page)}:{cmd.line}: {cmd.text}")
    print(f"\nskipped {len(skipped)} command(s) (their arguments parsed, not run):")
    for cmd in skipped:
        print(f"  {rel(cmd.page)}:{cmd.line}: {cmd.text}\n      ({cmd.skip})")
    if failures:
        print(f"\n{len(failures)} failure(s):", file=sys.stderr)
        for failure in failures:
            print(f"- {failure}", file=sys.stderr)
        return 1
    print("\nall commands and links of the docs check out")
    return 0


if __name__ == "__main__":
    sys.exit(main())

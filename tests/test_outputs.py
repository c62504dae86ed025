"""Kind 0 of issue 13: the product never deletes what it did not write, and an output it cannot write
is one clear line with exit 2 and nothing left behind (planner/files.py)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from planner.errors import InputError
from planner.files import (
    FOLDER_MARKER,
    check_output_path,
    new_output_folder,
    publish_folder,
    write_text_atomic,
)
from tests.cli_in_process import planner_in_process

ROOT = Path(__file__).resolve().parent.parent
SWIGLU = str(ROOT / "tests" / "models" / "swiglu_fused_w13.py")


def run_planner(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return planner_in_process(*args, cwd=cwd)


def test_one_atomic_writer() -> None:
    for name in ("costmodels.calibrate", "passes.emit", "planner.plan"):
        assert importlib.import_module(name).write_text_atomic is write_text_atomic, name


@pytest.mark.slow
def test_emit_into_a_folder_of_user_files_is_refused(tmp_path: Path) -> None:
    """`--emit .` in a folder holding the user's files: exit 2 naming it, every file left as it was."""
    (tmp_path / "notes.txt").write_text("mine\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "data.bin").write_bytes(b"\x00\x01")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for target in (".", str(tmp_path / "sub")):
        r = run_planner("optimize", SWIGLU, "--cluster", "local-cpu", "--emit", target, cwd=tmp_path)
        said = " ".join(r.stderr.split())  # rich wraps long lines
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in said and f"--emit {target}: the folder is not empty" in said
        assert "not written by the planner" in said
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


def test_output_folder_replaces_only_our_own(tmp_path: Path) -> None:
    out = tmp_path / "emit"
    for text in ("first", "second"):  # an earlier output of ours (marker) is replaced
        tmp = new_output_folder(out, "--emit")
        (tmp / "README.md").write_text(text)
        publish_folder(tmp, out, "--emit")
        assert (out / "README.md").read_text() == text and (out / FOLDER_MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["emit"]  # no temp or old folder left
    (out / "my_results.csv").write_text("user data")  # the user added a file: no longer ours alone
    with pytest.raises(InputError, match="my_results.csv"):
        new_output_folder(out, "--emit")
    assert (out / "my_results.csv").read_text() == "user data"
    empty = tmp_path / "empty"
    empty.mkdir()
    tmp = new_output_folder(empty, "--emit")
    publish_folder(tmp, empty, "--emit")
    assert (empty / FOLDER_MARKER).is_file()


def test_a_user_file_in_a_subfolder_of_our_output_is_never_replaced(tmp_path: Path) -> None:
    """An --emit folder has rank0/ and rank1/ subfolders: a file the user puts in one of them makes
    the folder no longer ours alone (it was deleted with the folder), and a marker of an older version
    that listed only the top level cannot vouch for its subfolders."""
    import json  # noqa: PLC0415

    out = tmp_path / "emit"
    tmp = new_output_folder(out, "--emit")
    (tmp / "rank0").mkdir()
    (tmp / "rank0" / "model.py").write_text("ours")
    publish_folder(tmp, out, "--emit")
    (out / "rank0" / "mine.py").write_text("user code")
    with pytest.raises(InputError, match="rank0/mine.py"):
        publish_folder(new_output_folder(out, "--emit"), out, "--emit")
    assert (out / "rank0" / "mine.py").read_text() == "user code"
    (out / "rank0" / "mine.py").unlink()
    (out / "rank0" / "mylogs").mkdir()  # an empty folder of the user's was deleted with ours too
    with pytest.raises(InputError, match="rank0/mylogs/"):
        publish_folder(new_output_folder(out, "--emit"), out, "--emit")
    (out / "rank0" / "mylogs").rmdir()
    marker = out / FOLDER_MARKER
    record = json.loads(marker.read_text())
    del record["files"]  # as an older version wrote it
    marker.write_text(json.dumps(record))
    with pytest.raises(InputError, match="older version"):
        publish_folder(new_output_folder(out, "--emit"), out, "--emit")
    assert (out / "rank0" / "model.py").read_text() == "ours"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["emit"]  # no temp folder left
    # an older version's --emit folder holding the emitter's own rank files only (module.py, meta.json,
    # weights.pt) is ours: replaced (scripts/demo.sh had failed after an upgrade)
    (out / "rank0" / "model.py").rename(out / "rank0" / "module.py")
    for name in ("meta.json", "weights.pt"):
        (out / "rank0" / name).write_text("ours")
    tmp = new_output_folder(out, "--emit")
    (tmp / "README.md").write_text("new")
    publish_folder(tmp, out, "--emit")
    assert (out / "README.md").read_text() == "new" and not (out / "rank0").exists()


@pytest.mark.parametrize("option", ["--out", "--json"])
def test_unwritable_output_is_one_line(tmp_path: Path, option: str) -> None:
    r = run_planner("optimize", SWIGLU, "--cluster", "local-cpu", option, "/proc/plan.yaml", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    said = " ".join(r.stderr.split())
    assert "Traceback" not in said and f"{option} /proc/plan.yaml: cannot write into /proc" in said
    assert list(tmp_path.iterdir()) == []


def test_write_text_atomic_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text("old\n")

    def failing_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(InputError, match="--out .*No space left"):
        write_text_atomic(path, "new\n", option="--out")
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]


def test_check_output_path_probes_the_folder(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot write into /proc"):
        check_output_path("--out", "/proc/plan.yaml")
    check_output_path("--out", str(tmp_path / "plan.yaml"))
    assert list(tmp_path.iterdir()) == []  # the probe is removed
    (tmp_path / "u.txt").write_text("mine")  # a file where a folder of the path goes: named as a file
    with pytest.raises(InputError, match=r"u.txt is a file, not a folder"):
        check_output_path("--out", str(tmp_path / "u.txt" / "x" / "plan.yaml"))
    with pytest.raises(InputError, match=r"folder .*missing does not exist"):
        check_output_path("--out", str(tmp_path / "missing" / "plan.yaml"))


def test_a_folder_of_one_option_is_not_replaced_by_another(tmp_path: Path) -> None:
    """--emit must not replace a --plot folder (or the reverse), and one command may not give both
    options the same folder: the second writer would delete the first's files."""
    import argparse  # noqa: PLC0415

    from planner.cli.main import _check_outputs  # noqa: PLC0415

    figures = tmp_path / "figures"
    tmp = new_output_folder(figures, "--plot")
    (tmp / "timeline.png").write_bytes(b"png")
    publish_folder(tmp, figures, "--plot")
    check_output_path("--plot", str(figures), folder=True)  # an earlier --plot output: replaceable
    with pytest.raises(InputError, match="holds the planner's --plot output, which --emit would replace"):
        check_output_path("--emit", str(figures), folder=True)
    assert (figures / "timeline.png").read_bytes() == b"png"
    same = str(tmp_path / "both")
    args = argparse.Namespace(out=None, json=None, emit=same, plot=same)
    with pytest.raises(InputError, match="--emit and --plot both name"):
        _check_outputs(args)


@pytest.mark.slow
def test_out_and_json_never_replace_a_file_the_planner_did_not_write(tmp_path: Path) -> None:
    """--json onto the model file, --out onto a README: refused before any work, the file untouched;
    the planner's own plan and report are replaced by the next run; a plan is not written over a
    report (nor over a calibrated spec)."""
    model = tmp_path / "model.py"
    model.write_text(Path(SWIGLU).read_text())
    readme = tmp_path / "README.md"
    readme.write_text("# my notes\n")
    base = ["optimize", str(model), "--cluster", "dgx-h100"]
    for option, target in (("--json", model), ("--out", readme)):
        before = target.read_text()
        result = run_planner(*base, option, str(target), cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert "was not written by the planner; nothing was changed" in " ".join(result.stderr.split())
        assert target.read_text() == before
    plan, report = tmp_path / "plan.yaml", tmp_path / "report.json"
    assert run_planner(*base, "--out", str(plan), "--json", str(report), cwd=tmp_path).returncode == 0
    assert run_planner(*base, "--out", str(plan), "--json", str(report), cwd=tmp_path).returncode == 0
    swapped = run_planner(*base, "--out", str(report), cwd=tmp_path)
    assert swapped.returncode == 2 and "holds the planner's report" in " ".join(swapped.stderr.split())
    shown = run_planner("show", str(plan), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr


def test_written_kind_reads_each_output_signature(tmp_path: Path) -> None:
    """Each output kind by what the planner writes at its start: a plan, an export or a calibrated
    spec by its header and the digest note on its first line (`with_digest`), a report by its first
    key and its objects. Files that merely mention the planner are the user's: a launch script whose
    comment quotes an export header, notes whose first key copies a report's, a README quoting a plan's
    header (each was replaced, exit 0); so is a plan or report written before outputs were signed."""
    from passes.checkpoint import save_checkpoint
    from planner.files import DIGEST_NOTE, PLAN_HEADER, WEIGHTS_KIND, with_digest, written_kind

    report = {"written_by": "planner optimize --json", "model": "m.py", "plan": {}, "predicted": {}}
    cases = {
        "plan.yaml": with_digest(f"{PLAN_HEADER} for m.py on dgx-h100\nmodel: m.py\n"),
        "report.json": json.dumps(report, indent=2),
        "eval.json": json.dumps({"written_by": "planner ladder-eval --json", "standard": {}, "ladder": {}}),
        "spec.yaml": with_digest(
            "# Cluster spec written by `planner calibrate`: measured on this machine\nname: x\n"
        ),
        "args.sh": with_digest(
            "# Megatron-LM parallelism arguments for m.py, written by planner export --to megatron.\n"
        ),
        "mine.yaml": "name: my cluster\n",
        "train_launch.sh": "#!/bin/bash\n# these flags were first written by planner export --to megatron, then tuned\n",
        "notes.json": json.dumps({"written_by": "planner optimize --json -- copied by me", "notes": "mine"}),
        "readme_notes.md": f"# Notes\nA plan starts with:\n    {PLAN_HEADER} for m.py\n",
        "old_plan.yaml": "model: m.py\ncluster: x\nmesh: {tp: 1}\nsplits: {}\nstages: [[0]]\npredicted: {}\n",
        "old_report.json": '{"model": "m.py", "plan": {}, "predicted": {}}',
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    kinds = {name: written_kind(tmp_path / name) for name in cases}
    assert kinds == {"plan.yaml": "plan", "report.json": "report", "eval.json": "report", "spec.yaml": "cluster spec",
                     "args.sh": "export", **dict.fromkeys(list(cases)[5:])}  # fmt: skip
    assert DIGEST_NOTE in (tmp_path / "args.sh").read_text().split("\n")[0]
    for name, kind in (("train_launch.sh", "export"), ("notes.json", "report"), ("readme_notes.md", "plan")):
        with pytest.raises(InputError, match="not written by the planner"):
            check_output_path("--out", str(tmp_path / name), kind=kind)
    import torch

    save_checkpoint(
        {"w": torch.zeros(2)}, tmp_path / "ours.safetensors", metadata={"written_by": "planner adapt --out"}
    )
    save_checkpoint({"w": torch.zeros(2)}, tmp_path / "theirs.safetensors")
    assert written_kind(tmp_path / "ours.safetensors") == WEIGHTS_KIND
    assert written_kind(tmp_path / "theirs.safetensors") is None
    with pytest.raises(InputError, match="not written by the planner"):
        check_output_path("--out", str(tmp_path / "theirs.safetensors"), kind=WEIGHTS_KIND)
    check_output_path("--out", str(tmp_path / "ours.safetensors"), kind=WEIGHTS_KIND)
    with pytest.raises(InputError, match="holds the planner's report"):
        check_output_path("--out", str(tmp_path / "report.json"), kind="plan")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    check_output_path("--out", str(empty), kind="plan")  # nothing to lose


def test_a_run_that_fails_its_check_leaves_no_plan_or_modules(tmp_path: Path, monkeypatch, capsys) -> None:
    """--run comes before --out and --emit are written: a run that fails (its numerics check, here a
    stand-in) leaves neither a plan nor rank modules that compute something else than the model."""
    from planner.errors import RunError  # noqa: PLC0415

    cli = importlib.import_module("planner.cli.main")  # the module (the package exports its main())

    def failing_run(*_args, **_kw):
        raise RunError("the sharded run does not compute what the unsharded model computes")

    monkeypatch.setattr(cli, "_run", failing_run)
    model = str(Path(__file__).resolve().parents[1] / "examples" / "llama3.py")
    out, emit = tmp_path / "plan.yaml", tmp_path / "emitted"
    rc = cli.main(["optimize", model, "--cluster", "local-cpu", "--nproc", "2", "--tp", "2", "--run",
                   "--out", str(out), "--emit", str(emit)])  # fmt: skip
    assert rc == 4 and "does not compute" in capsys.readouterr().err
    assert not out.exists() and not emit.exists() and sorted(tmp_path.iterdir()) == []


def test_an_output_path_that_is_a_link_stays_a_link(tmp_path: Path) -> None:
    """--out through the user's symbolic link writes the file it points to; the link stays (it was
    replaced by a plain file)."""
    target = tmp_path / "plans" / "p.yaml"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "latest.yaml"
    link.symlink_to(target)
    write_text_atomic(link, "new", option="--out")
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.yaml", "plans"]


def test_a_file_of_our_output_the_user_edited_is_not_replaced(tmp_path: Path) -> None:
    """An --emit folder's rank0/module.py with the user's lines appended: emitting again into the folder
    is refused naming the file (it was overwritten silently); untouched, the folder is replaced."""
    out = tmp_path / "emit"
    tmp = new_output_folder(out, "--emit")
    (tmp / "rank0").mkdir()
    (tmp / "rank0" / "module.py").write_text("ours\n")
    publish_folder(tmp, out, "--emit")
    with (out / "rank0" / "module.py").open("a") as handle:
        handle.write("# my notes\n")
    with pytest.raises(InputError, match=r"rank0/module.py changed since the planner wrote it"):
        publish_folder(new_output_folder(out, "--emit"), out, "--emit")
    assert (out / "rank0" / "module.py").read_text() == "ours\n# my notes\n"
    (out / "rank0" / "module.py").unlink()  # the user moves the edits out: ours again
    publish_folder(new_output_folder(out, "--emit"), out, "--emit")
    assert not (out / "rank0").exists()


def test_an_unedited_copy_of_our_folder_is_ours_and_old_time_stamps_still_tell_edits(tmp_path: Path) -> None:
    """Emitted files are stamped by content: `cp -r` of an --emit folder (new modification times, the
    same bytes) is still the planner's and is replaced; a file whose bytes changed is refused, naming
    how many more changed beyond the first three. A marker written with [size, mtime] stamps (before
    content stamps) is still read as such."""
    import json  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    from planner.files import FOLDER_MARKER  # noqa: PLC0415

    out = tmp_path / "emit"
    tmp = new_output_folder(out, "--emit")
    for i in range(5):
        (tmp / f"f{i}.py").write_text(f"ours {i}\n")
    publish_folder(tmp, out, "--emit")
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, copy_function=shutil.copy)  # new times, as `cp -r`
    publish_folder(new_output_folder(copy, "--emit"), copy, "--emit")  # replaced: it was ours
    assert not (copy / "f0.py").exists()
    for i in range(5):
        (out / f"f{i}.py").write_text(f"mine {i}\n")
    with pytest.raises(
        InputError, match=r"f0.py, f1.py, f2.py and 2 more changed since the planner wrote it"
    ):
        publish_folder(new_output_folder(out, "--emit"), out, "--emit")
    record = json.loads((out / FOLDER_MARKER).read_text())  # an older marker: [size, mtime_ns] stamps
    record["stamps"] = {
        rel: [(out / rel).stat().st_size, (out / rel).stat().st_mtime_ns] for rel in record["files"]
    }
    (out / FOLDER_MARKER).write_text(json.dumps(record))
    publish_folder(new_output_folder(out, "--emit"), out, "--emit")  # unchanged since those stamps: ours


def test_a_plan_or_spec_the_user_edited_is_not_replaced(tmp_path: Path) -> None:
    """A saved plan ends in a digest of its text: `optimize --out` onto it replaces it while unedited
    and refuses once the user changed a line (a plan is meant to be edited by hand) or deleted the
    digest line (the first line says there was one), leaving it as the user left it; a file with the
    plan's header but no digest note (a plan written before digests, or a user's copy) is not ours."""
    from planner.files import check_output_path, edited_since_written, with_digest  # noqa: PLC0415

    path = tmp_path / "plan.yaml"
    text = "# Plan written by planner optimize --out for m on c; read by planner show / run / export.\nmesh: {}\n"
    path.write_text(with_digest(text))
    assert not edited_since_written(path)
    check_output_path("--out", str(path), kind="plan")
    path.write_text(with_digest(text).replace("mesh: {}", "mesh: {tp: 2}"))
    assert edited_since_written(path)
    with pytest.raises(InputError, match="the planner wrote this plan, but it changed since"):
        check_output_path("--out", str(path), kind="plan")
    path.write_text(with_digest(text) + "# a line of mine after the digest\n")
    with pytest.raises(InputError, match="changed since"):
        check_output_path("--out", str(path), kind="plan")
    edited = with_digest(text).rsplit("# planner-digest:", 1)[0].replace("mesh: {}", "mesh: {tp: 2}")
    path.write_text(edited)  # the digest line deleted with an edit
    with pytest.raises(InputError, match="changed since"):
        check_output_path("--out", str(path), kind="plan")
    assert path.read_text() == edited
    path.write_text(text)  # no digest, no note on its first line: anyone's file (an older planner's too)
    with pytest.raises(InputError, match="was not written by the planner"):
        check_output_path("--out", str(path), kind="plan")


def test_a_dash_is_stdout_for_json_only_and_refused_as_a_file_name(tmp_path: Path) -> None:
    """`--out -` wrote a file literally named "-" (and `--json -` is stdout): it is refused in one line
    that says where stdout is, before any work, and no file named "-" appears; an empty path, taken
    as not given, is refused too."""
    base = ["optimize", SWIGLU, "--cluster", "dgx-h100"]
    for args, says in (
        (["--out", "-"], "--out takes a file name; --json - prints the report on stdout"),
        (["--emit", "-"], "--emit takes a folder name"),
        (["--out", ""], "--out: empty; give a file name"),  # taken as not given: nothing written or said
        (["--plot", " "], "--plot: empty; give a folder name"),
    ):
        result = run_planner(*base, *args, cwd=tmp_path)
        assert result.returncode == 2 and says in " ".join(result.stderr.split()), result.stderr
    calibrate = run_planner("calibrate", "--out", "-", cwd=tmp_path)  # calibrate has no --json to point at
    said = " ".join(calibrate.stderr.split())
    assert calibrate.returncode == 2 and "--out takes a file name" in said and "--json" not in said, said
    assert not (tmp_path / "-").exists()


def test_a_device_or_a_named_pipe_is_never_replaced_by_an_output(tmp_path: Path) -> None:
    """--out / --json naming a named pipe (or /dev/null) are refused before any work, exit 2, and the pipe
    stays a pipe: the atomic rename would have put a regular file in its place (as root, /dev/null for
    the whole machine). A link to the pipe is refused as well, and so is the writer called directly."""
    fifo = tmp_path / "report.pipe"
    os.mkfifo(fifo)
    link = tmp_path / "link.json"
    link.symlink_to(fifo)
    base = ["optimize", SWIGLU, "--cluster", "dgx-h100"]
    for option, target in (("--json", fifo), ("--out", fifo), ("--json", link)):
        result = run_planner(*base, option, str(target), cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert "is a named pipe, not a regular file" in " ".join(result.stderr.split())
        assert fifo.is_fifo()
    with pytest.raises(InputError, match="is a named pipe"):
        write_text_atomic(fifo, "{}", "--json")
    assert fifo.is_fifo() and link.is_symlink()
    if Path("/dev/null").is_char_device():
        with pytest.raises(InputError, match="is a device, not a regular file"):
            check_output_path("--out", "/dev/null")
        assert Path("/dev/null").is_char_device()


def test_an_output_inside_another_outputs_folder_is_refused_before_any_work(tmp_path: Path) -> None:
    """--out / --json / --plot inside the --emit folder (or inside --plot's) are refused up front, exit 2,
    nothing written: the plan written into an earlier --emit folder made that folder hold a file its
    record does not list, so every later --emit there was refused, and the report was never written."""
    base = ["optimize", SWIGLU, "--cluster", "dgx-h100"]
    assert run_planner(*base, "--emit", "em", cwd=tmp_path).returncode == 0
    before = sorted(p.name for p in (tmp_path / "em").iterdir())
    for args, says in (
        (
            ["--emit", "em", "--out", "em/plan.yaml", "--json", "em/r.json"],
            "--out em/plan.yaml is inside --emit em",
        ),
        (["--emit", "em", "--plot", "em/figs"], "--plot em/figs is inside --emit em"),
        (["--plot", "figs", "--json", "figs/r.json"], "--json figs/r.json is inside --plot figs"),
        (["--emit", "new", "--out", "new/plan.yaml"], "--out new/plan.yaml is inside --emit new"),
    ):
        result = run_planner(*base, *args, cwd=tmp_path)
        assert result.returncode == 2 and says in " ".join(result.stderr.split()), result.stderr
    assert sorted(p.name for p in (tmp_path / "em").iterdir()) == before
    assert not (tmp_path / "figs").exists() and not (tmp_path / "new").exists()
    assert run_planner(*base, "--emit", "em", cwd=tmp_path).returncode == 0  # still ours


def test_json_dash_keeps_stdout_for_the_report_when_the_model_file_prints(tmp_path: Path) -> None:
    """--json - promises the report alone on stdout, for `jq`: a model file that prints at import (or
    while it builds) goes to stderr, and stdout parses as JSON."""
    model = tmp_path / "printy.py"
    model.write_text('print("loading my model")\n' + Path(SWIGLU).read_text())
    result = run_planner("optimize", str(model), "--cluster", "dgx-h100", "--json", "-", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["written_by"].startswith("planner")
    assert "loading my model" in result.stderr


def test_a_path_the_system_cannot_take_is_refused_not_raised(tmp_path: Path, capsys) -> None:
    """A link that points to itself as --out / --json / --emit / --plot, a 300-character file name, or
    a cluster spec of such a name raised from pathlib (RuntimeError "Symlink loop", OSError "File name
    too long", exit 1). Each is refused with exit 2, naming the option."""
    from planner.cli.main import main  # noqa: PLC0415

    loop = tmp_path / "loop.yaml"
    loop.symlink_to(loop)
    long_name = str(tmp_path / ("a" * 300 + ".yaml"))
    mlp = str(Path(__file__).resolve().parent.parent / "examples" / "mlp.py")
    base = ["optimize", mlp, "--cluster", "local-cpu"]
    for option, value in (
        ("--out", loop),
        ("--json", loop),
        ("--emit", loop),
        ("--plot", loop),
        ("--out", long_name),
    ):
        assert main([*base, option, str(value)]) == 2, option
        assert f"{option} " in capsys.readouterr().err
    assert main(["optimize", mlp, "--cluster", long_name]) == 2
    assert "File name too long" in " ".join(capsys.readouterr().err.split())


def test_a_full_disk_under_plot_or_emit_is_one_line_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    """On a full disk PIL's PNG writer raised AttributeError ('_idat' object has no attribute 'fileno')
    and torch.save a RuntimeError from its zip writer: tracebacks (exit 1), and --plot left its
    temporary folder behind. Both are now refused naming the option (exit 2), nothing left."""
    import shutil  # noqa: PLC0415

    from planner.files import failed_write  # noqa: PLC0415

    full = shutil.disk_usage(tmp_path)._replace(free=4096)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: full)
    said = failed_write(
        "--plot", tmp_path / "figs", AttributeError("'_idat' object has no attribute 'fileno'")
    )
    assert isinstance(said, InputError) and "--plot" in str(said) and "4096 bytes free" in str(said)
    assert isinstance(
        failed_write("--emit", tmp_path / "em", OSError(28, "No space left on device")), InputError
    )
    monkeypatch.undo()
    other = ValueError("a bug")
    assert failed_write("--plot", tmp_path / "figs", other) is other  # a disk with room: the error itself

    from planner.report import plots  # noqa: PLC0415
    from tests.plans import fixed_plan, meta_structure  # noqa: PLC0415

    mlp = str(Path(__file__).resolve().parent.parent / "examples" / "mlp.py")
    plan = fixed_plan(meta_structure(mlp, None, None), mlp, 1)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: full)
    monkeypatch.setattr(plots, "_timeline", lambda plan: (_ for _ in ()).throw(AttributeError("'_idat'")))
    with pytest.raises(InputError, match="--plot .* cannot write it"):
        plots.write_figures(plan, tmp_path / "figs")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary folder left


def test_a_plan_whose_first_line_is_longer_than_the_signature_read_is_still_ours(tmp_path: Path) -> None:
    """A model path of ~1000 characters makes the plan's first line longer than the 1 KiB read for its
    signature: the digest note at its end went unseen and the next run refused to replace its own plan."""
    from planner.files import PLAN_HEADER, with_digest, written_kind  # noqa: PLC0415

    plan = tmp_path / "plan.yaml"
    plan.write_text(with_digest(f"{PLAN_HEADER} for {'d/' * 600}m.py on local-cpu\nmodel: m.py\n"))
    assert written_kind(plan) == "plan"
    check_output_path("--out", str(plan), kind="plan")

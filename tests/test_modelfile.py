"""planner.frontend.modelfile: loading model files, building models, example inputs and their errors."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from planner.errors import InputError
from planner.frontend.modelfile import batch_and_seq, load_model_file


def write(tmp_path, text: str, name: str = "model.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_loads_example_and_builds_in_eval_mode(example_path):
    mf = load_model_file(example_path("gpt2_tiny"))
    model = mf.build()
    assert not model.training
    (idx,), kwargs = mf.inputs()
    assert idx.shape == (2, 16) and idx.dtype == torch.long and kwargs == {}
    assert mf.name == "gpt2_tiny"


def test_overrides_pass_through(example_path):
    mf = load_model_file(example_path("llama3"))
    (tokens,), _ = mf.inputs(batch_size=3, seq_len=1)  # decode workload: one token
    assert tokens.shape == (3, 1)


def test_meta_build_allocates_no_weights(example_path):
    model = load_model_file(example_path("gpt2_tiny")).build("meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    big = load_model_file(example_path("llama3_405b")).build("cpu")  # builds on meta by itself
    assert all(p.device.type == "meta" for p in big.parameters())


def test_hf_example_kwargs(example_path):
    _, kwargs = load_model_file(example_path("hf_llama")).inputs()
    assert kwargs == {"use_cache": False}


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_model_file(tmp_path / "nope.py")


def test_missing_functions_named_with_example(tmp_path):
    path = write(tmp_path, "def example_inputs():\n    return ()\n")
    with pytest.raises(InputError) as info:
        load_model_file(path)
    message = str(info.value)
    assert "build_model" in message and "example_inputs" not in message.split(";")[0]
    assert "def build_model(): return MyModel()" in message
    assert "def example_inputs(batch_size=2, seq_len=16): return" in message


def test_import_error_names_file_and_line(tmp_path):
    path = write(
        tmp_path,
        """\
        import torch

        X = 1 / 0
        """,
    )
    with pytest.raises(InputError) as info:
        load_model_file(path)
    assert f"{path}:3" in str(info.value) and "ZeroDivisionError" in str(info.value)


def test_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "import torch\n\ndef build_model(:\n    pass\n")
    with pytest.raises(InputError, match=rf"SyntaxError: .*{path}:3"):
        load_model_file(path)


def test_build_error_names_line(tmp_path):
    path = write(
        tmp_path,
        """\
        import torch

        def build_model():
            raise RuntimeError("boom")

        def example_inputs():
            return (torch.zeros(2),)
        """,
    )
    with pytest.raises(InputError, match=r"build_model\(\) raised RuntimeError: boom .*model.py:4"):
        load_model_file(path).build()


def test_sys_exit_in_a_model_file_is_an_error_naming_the_line(tmp_path):
    """A model file that exits (a script's argparse or main at import, or in build_model) used to end
    the planner silently with the file's exit code (0, or 3: "no feasible plan")."""
    at_import = write(tmp_path, "import sys\nsys.exit(0)\n", "script.py")
    with pytest.raises(
        InputError, match=r"SystemExit \(sys.exit\(0\), at .*script.py:2.*__name__ == '__main__'"
    ):
        load_model_file(at_import)
    in_build = write(
        tmp_path,
        """\
        import sys
        import torch

        def build_model():
            sys.exit(3)

        def example_inputs():
            return (torch.zeros(2),)
        """,
    )
    with pytest.raises(
        InputError, match=r"build_model\(\) raised SystemExit \(sys.exit\(3\), at .*model.py:5"
    ):
        load_model_file(in_build).build()


def test_unsupported_override_says_which_signature(tmp_path):
    path = write(
        tmp_path,
        """\
        import torch

        def build_model():
            return torch.nn.Linear(4, 4)

        def example_inputs():
            return torch.zeros(2, 4)
        """,
    )
    mf = load_model_file(path)
    (x,), _ = mf.inputs()  # a bare tensor is wrapped in a tuple
    assert x.shape == (2, 4)
    assert mf.inputs(seq_len=1)[0][0].shape == (2, 4)  # (B, features): no sequence, as the plan reads it
    with pytest.raises(InputError, match=r"def example_inputs\(batch_size=2, seq_len=16\)"):
        mf.inputs(seq_len=8)


def test_sibling_imports_and_no_repeated_sys_path_entries(tmp_path):
    write(tmp_path, "import torch\n\nclass Net(torch.nn.Linear):\n    pass\n", name="netlib.py")
    path = write(
        tmp_path,
        """\
        import torch
        from netlib import Net

        def build_model():
            return Net(4, 4)

        def example_inputs(batch_size=2):
            return (torch.zeros(batch_size, 4),)
        """,
    )
    load_model_file(path)
    load_model_file(path)
    assert sys.path.count(str(tmp_path)) == 1


@pytest.mark.parametrize(
    "name, num_params",
    [
        ("gpt2", 124_439_808),  # GPT-2 124M, tied LM head counted once
        ("llama3_8b", 8_030_261_248),
        ("llama3_70b", 70_553_706_496),
        ("llama3_405b", 405_853_388_800),
        ("gpt3_175b", 174_635_323_392),
    ],
)
def test_published_configs(example_path, name, num_params):
    model = load_model_file(example_path(name)).build("meta")
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(num_params, rel=1e-3)


def test_example_inputs_that_ignore_the_batch_asked_for_are_refused(tmp_path):
    """`example_inputs(batch_size=32)` returning a batch of 4: the plan was silently for batch 4."""
    from planner.cli import workflow  # noqa: PLC0415

    path = write(
        tmp_path,
        """\
        import torch

        def build_model():
            return torch.nn.Linear(8, 8)

        def example_inputs(batch_size=4, seq_len=16):
            return (torch.randn(4, 8),)
        """,
    )
    assert workflow.prepare(str(path), "forward").structure.batch_size == 4  # its own batch: fine
    with pytest.raises(
        InputError, match=r"example_inputs\(batch_size=32\) returned inputs with batch_size 4"
    ):
        workflow.prepare(str(path), "forward", batch_size=32)
    with pytest.raises(InputError, match="the model file ignores batch_size"):
        workflow.prepare(str(path), "forward", batch_size=32)
    # nanoGPT's batches: seq_len + 1 tokens, shifted inside the model: it does not ignore seq_len
    shifted = write(
        tmp_path,
        """\
        import torch

        class Shifted(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)

            def forward(self, tokens):
                return self.head(self.emb(tokens[:, :-1]))

        def build_model():
            return Shifted()

        def example_inputs(batch_size=2, seq_len=16):
            return (torch.randint(0, 64, (batch_size, seq_len + 1)),)
        """,
    )
    with pytest.raises(InputError, match="makes inputs of seq_len 33 from it \\(not 32\\)") as e:
        workflow.prepare(str(shifted), "train", batch_size=2, seq_len=32)
    assert "ignores" not in str(e.value)


def test_sys_exit_in_forward_is_an_error_naming_the_line(tmp_path):
    """A forward that calls sys.exit() while traced ended the planner silently with exit 0."""
    from planner.cli import workflow  # noqa: PLC0415

    path = write(
        tmp_path,
        """\
        import sys
        import torch

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(8, 8)

            def forward(self, x):
                if x.shape[0] > 100:
                    sys.exit(0)
                return self.lin(x)

        def build_model():
            return M()

        def example_inputs(batch_size=4, seq_len=16):
            return (torch.randn(batch_size, 8),)
        """,
    )
    with pytest.raises(InputError, match=r"M.forward called sys.exit\(0\) at .*model.py:11"):
        workflow.prepare(str(path), "forward", batch_size=128)


def test_a_batch_the_runtime_cannot_split_keeps_one_replica(tmp_path):
    """`example_inputs` that always returns batch 4: no input has a batch dim, so the search keeps
    dp=1 and one micro-batch (it picked DP=2, and the run failed with a traceback)."""
    from planner.cli import workflow  # noqa: PLC0415

    path = write(
        tmp_path,
        """\
        import torch

        def build_model():
            return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))

        def example_inputs(batch_size=4, seq_len=16):
            return (torch.randn(4, 16, 64),)
        """,
    )
    prepared = workflow.prepare(str(path), "forward")
    assert any("no input has a batch dim" in why for why in prepared.structure.batch_mixing)
    with pytest.raises(InputError, match="no input has a batch dim"):
        spec = workflow.resolve_cluster("local-cpu", 2)
        workflow.make_plan(prepared, spec, workflow.constraints_from(None, None, 2, "none"), str(path))


def test_functions_the_planner_cannot_call_name_their_own_line_and_the_signature_to_give(tmp_path):
    """build_model(width) / example_inputs(n) failed with a TypeError located in the planner's own
    modelfile.py; the message now names the user's definition (file:line) and how the planner calls
    it. An example_kwargs() key forward does not take names forward (file:line) and its parameters."""
    from planner.frontend.capture import capture  # noqa: PLC0415

    body = """\
        import torch
        from torch import nn

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.l = nn.Linear(8, 8)

            def forward(self, x, mask=None):
                return self.l(x)

        def build_model({build}):
            return M()

        def example_inputs({inputs}):
            return (torch.zeros(2, 8),)

        def example_kwargs():
            return {kwargs}
        """
    bad_build = load_model_file(write(tmp_path, body.format(build="width", inputs="", kwargs="{}")))
    with pytest.raises(
        InputError, match=r"model.py:12: build_model\(\) cannot be called .*'width'.*no required"
    ):
        bad_build.build()
    bad_inputs = load_model_file(write(tmp_path, body.format(build="", inputs="n", kwargs="{}")))
    with pytest.raises(InputError, match=r"model.py:15: example_inputs\(\) cannot be called .*batch_size="):
        bad_inputs.inputs()
    bogus = load_model_file(write(tmp_path, body.format(build="", inputs="", kwargs="{'bogus': 1}")))
    args, kwargs = bogus.inputs()
    with pytest.raises(
        InputError, match=r"M.forward \(.*model.py:9\).*example_kwargs\(\) gives 'bogus'.*x, mask"
    ):
        capture(bogus.build("meta"), args, kwargs)


@pytest.mark.slow
def test_example_inputs_without_size_arguments_plan_and_run_at_their_own_batch(tmp_path):
    """`example_inputs()` taking no arguments ("may take", docs/model-files.md): planning uses its inputs,
    and `--run` runs them (it asked for batch_size and seq_len, the plan's own, and failed after
    planning); a size that differs from its inputs' is still refused, naming it."""
    from tests.cli_in_process import planner_in_process  # noqa: PLC0415

    path = write(
        tmp_path,
        """\
        import torch

        def build_model():
            return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))

        def example_inputs():
            return (torch.randn(4, 16, 64),)
        """,
    )
    mf = load_model_file(path)
    assert mf.inputs(4, 16)[0][0].shape == (4, 16, 64)  # what the inputs already are: fine
    with pytest.raises(InputError, match=r"does not accept batch_size, which was asked for \(batch_size=8\)"):
        mf.inputs(8, 16)
    run = ("optimize", str(path), "--cluster", "local-cpu", "--nproc", "2", "--run", "--iters", "1",
           "--warmup", "0", "--min-time", "0")  # fmt: skip
    result = planner_in_process(*run, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "max |sharded - unsharded| = 0" in result.stdout


def test_image_inputs_taking_only_the_batch_size_run_at_the_plans_sizes(tmp_path):
    """`example_inputs(batch_size)` of an image model, (B, C, H, W): the plan reads no sequence there
    (seq_len 1, `batch_and_seq`), and a run asks for the plan's sizes; the check of a size the function
    does not take read the channels as the sequence (3 != 1) and refused the run after planning."""
    path = write(
        tmp_path,
        """\
        import torch

        def build_model():
            return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 4, stride=4), torch.nn.Flatten(), torch.nn.Linear(32, 4))

        def example_inputs(batch_size=2):
            return (torch.randn(batch_size, 3, 8, 8),)
        """,
    )
    mf = load_model_file(path)
    args, _ = mf.inputs(2, 1)  # what `planner run` asks for: the plan's batch_size 2, seq_len 1
    assert args[0].shape == (2, 3, 8, 8) and batch_and_seq(list(args)) == (2, 1)
    assert mf.inputs(6, 1)[0][0].shape == (6, 3, 8, 8)
    with pytest.raises(InputError, match=r"does not accept seq_len, which was asked for \(seq_len=16\)"):
        mf.inputs(2, 16)


def test_inputs_too_large_for_memory_say_so_with_the_size_asked(tmp_path):
    """A --batch-size whose example inputs cannot be allocated: one line naming the call, the bytes and what
    to change, not the allocator's enforce-fail text."""
    path = write(
        tmp_path,
        """\
        import torch

        def build_model():
            return torch.nn.Linear(8, 8)

        def example_inputs(batch_size=2, seq_len=16):
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                "tried to allocate 25600000000 bytes. Error code 12 (Cannot allocate memory)"
            )
        """,
    )
    with pytest.raises(InputError) as caught:
        load_model_file(path).inputs(100_000_000, 32)
    said = str(caught.value)
    assert (
        "example_inputs(batch_size=100000000, seq_len=32) ran out of memory" in said and "(25.6 GB)" in said
    )
    assert "smaller --batch-size / --seq-len" in said and "enforce fail" not in said


@pytest.mark.parametrize("model", ["gpt2_tiny.py", "hf_gpt2.py"])
def test_a_sequence_longer_than_the_position_table_is_refused_at_planning(model):
    """GPT-2's learned positions (`wpe`, 128 rows in both examples) looked up by `torch.arange(T)`: a
    --seq-len past them planned without a word on meta tensors and the run stopped on an IndexError deep
    in torch; it is refused naming the table's rows and the positions (HF counts from the cache's
    length, 0 here: the offset is followed)."""
    from pathlib import Path  # noqa: PLC0415

    from planner.cli import workflow  # noqa: PLC0415

    path = str(Path(__file__).resolve().parent.parent / "examples" / model)
    with pytest.raises(
        InputError, match=r"has 128 rows \(positions 0-127\) but the model looks up positions up to 255"
    ):
        workflow.prepare(path, "forward", 1, 256)
    assert workflow.prepare(path, "forward", 1, 128).structure.seq_len == 128


def test_a_module_beside_the_model_named_like_a_planner_package_does_not_stand_in_for_it(tmp_path) -> None:
    """The model's folder goes first on sys.path so that it can import its neighbours; a runtime.py,
    passes.py or costmodels.py there then stood in for the planner's own package when the planner
    imported one of its modules later: planning failed with a traceback ("'runtime' is not a
    package", exit 1) and TP runs failed on every rank (exit 4). The planner's packages are loaded
    first now; a model that imports such a module of its own is told why it gets the planner's."""
    import shutil  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    root = Path(__file__).resolve().parent.parent
    for name in ("mlp.py", "models.py"):
        shutil.copy(root / "examples" / name, tmp_path / name)
    for name in ("runtime.py", "passes.py", "costmodels.py"):
        (tmp_path / name).write_text("def now():\n    return 0\n")

    def planner(model: str) -> subprocess.CompletedProcess:
        args = [
            "optimize",
            str(tmp_path / model),
            "--cluster",
            "local-cpu",
            "--tp",
            "2",
            "--layout",
            "megatron",
        ]
        return subprocess.run(
            [sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True, cwd=root
        )

    r = planner("mlp.py")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    (tmp_path / "uses_own.py").write_text("from runtime import now\n" + (tmp_path / "mlp.py").read_text())
    r = planner("uses_own.py")
    said = " ".join(r.stderr.split())
    assert (
        r.returncode == 2 and "runtime.py next to the model has the name of the planner's own package" in said
    ), said


def test_an_elementwise_min_or_max_of_two_tensors_is_not_read_as_a_reduction():
    """tests/models/elementwise_min.py (Apertus' xIELU: torch.min(h, eps), torch.max(...)): planning
    crashed in the check for reductions over the batch, which took the second tensor for the dims; the
    MLP now plans and splits as any other."""
    from pathlib import Path  # noqa: PLC0415

    from planner.cli import workflow  # noqa: PLC0415

    path = str(Path(__file__).parent / "models" / "elementwise_min.py")
    prepared = workflow.prepare(path, "train")
    assert not prepared.structure.batch_mixing
    spec = workflow.resolve_cluster(str(Path(__file__).parent / "models" / "fastlink.yaml"), 2)
    plan = workflow.make_plan(prepared, spec, workflow.constraints_from(2, None, None, "none"), path)
    assert plan.splits["up.weight"].style.value == "colwise", plan.splits


def test_a_data_dependent_split_is_refused_not_crashed_on():
    """tests/models/hf_jetmoe.py: its experts split their tokens by data-dependent sizes; the per-head-
    norm pass crashed on the unknown count (a traceback, exit 1) before the refusal of such shapes."""
    from pathlib import Path  # noqa: PLC0415

    from planner.cli import workflow  # noqa: PLC0415

    path = str(Path(__file__).parent / "models" / "hf_jetmoe.py")
    with pytest.raises(
        InputError, match=r"split_with_sizes at modeling_jetmoe.py:\d+ .* data-dependent shape"
    ):
        workflow.prepare(path, "forward")

"""passes.emit: generated rank modules load back (same process, a fresh process, TP=2 on gloo ranks)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import fx, nn

from passes.collectives import register_group
from passes.emit import EmitError, emit_rank_module, load_rank_module, write_readme
from passes.pipeline import split_stages
from passes.tensor_parallel import apply_tensor_parallel
from planner.cli.emitting import emit_plan
from planner.errors import InputError
from planner.frontend.capture import capture
from planner.frontend.modelfile import load_model_file
from planner.plan import MeshShape, Plan, Prediction, Schedule, SolverInfo, WeightSplit
from runtime.launch import RankContext, launch
from tests.cli_in_process import planner_in_process
from tests.conftest import EXAMPLES, run_in_sequence

REPO = Path(__file__).resolve().parent.parent

aten = torch.ops.aten


def megatron_splits(model: nn.Module) -> dict[str, WeightSplit]:
    """Llama-3: q/k/v and w1/w3 column-parallel, wo and w2 row-parallel; the rest replicated."""
    splits = {}
    for name, _ in model.named_parameters():
        if name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight")):
            splits[name] = WeightSplit(name, "colwise", 0)
        elif name.endswith(("wo.weight", "w2.weight")):
            splits[name] = WeightSplit(name, "rowwise", 1)
    return splits


def build_llama(batch: int = 2) -> tuple[nn.Module, tuple, fx.GraphModule]:
    torch.manual_seed(0)
    mf = load_model_file(EXAMPLES / "llama3.py")
    model = mf.build("cpu")
    args, kwargs = mf.inputs(batch_size=batch, seq_len=16)
    return model, args, capture(model, args, kwargs)


def test_emit_and_load_unsharded_llama(tmp_path: Path) -> None:
    _, args, gm = build_llama()
    folder = emit_rank_module(gm, tmp_path, 0, {"model": "llama3", "tp": 1})
    assert folder == tmp_path / "rank0"
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "module.py", "weights.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0"]  # no temp folder left
    source = (folder / "module.py").read_text()
    assert str(tmp_path) not in source  # relocatable: no absolute paths baked in
    assert "class ShardedModule(torch.nn.Module)" in source
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["model"] == "llama3" and meta["rank"] == 0
    assert meta["inputs"] == [{"name": "tokens", "shape": [2, 16], "dtype": "int64"}]
    assert meta["outputs"][0]["shape"] == [2, 16, 256] and meta["outputs"][0]["model_path"] == ""
    module = load_rank_module(tmp_path, 0)
    assert torch.equal(module(*args), gm(*args))
    assert {n for n, _ in module.named_parameters()} == {n for n, _ in gm.named_parameters()}


def test_emitted_pipeline_stages_load_and_chain(tmp_path: Path) -> None:
    _, args, gm = build_llama()
    cut = [n.name for n in gm.graph.nodes if n.meta.get("module_path") == "layers.1"][-1]
    for k, stage in enumerate(split_stages(gm, [cut])):
        emit_rank_module(stage, tmp_path, k, {"pp_rank": k})
    modules = [load_rank_module(tmp_path, k) for k in range(2)]
    assert torch.equal(run_in_sequence(modules, *args), gm(*args))
    meta = json.loads((tmp_path / "rank0" / "meta.json").read_text())
    assert [o["name"] for o in meta["outputs"]] == [
        n["name"] for n in json.loads((tmp_path / "rank1" / "meta.json").read_text())["inputs"]
    ]


@pytest.mark.slow
def test_generated_module_runs_in_a_fresh_process_without_the_planner(tmp_path: Path) -> None:
    _, args, gm = build_llama()
    emit_rank_module(gm, tmp_path / "out", 0, {})
    (tmp_path / "out").rename(tmp_path / "moved")  # still loads from anywhere
    torch.save((args[0], gm(*args)), tmp_path / "io.pt")
    script = f"""
import importlib.util, sys, torch
sys.path.insert(0, {str(REPO)!r})
spec = importlib.util.spec_from_file_location("rank0", {str(tmp_path / "moved" / "rank0" / "module.py")!r})
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
x, expected = torch.load({str(tmp_path / "io.pt")!r})
assert torch.equal(mod.load("cpu")(x), expected)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("planner", "passes", "costmodels"))
assert not loaded, loaded
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


DICT_MODEL = """
import torch
from torch import nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.up = nn.Linear(32, 128)
        self.down = nn.Linear(128, 32)
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.down(torch.relu(self.up(h)))
        return {"hidden": h, "logits": self.head(h)}

def build_model():
    torch.manual_seed(0)
    return M()

def example_inputs(batch_size: int = 2, seq_len: int = 8):
    return (torch.randint(0, 64, (batch_size, seq_len)),)
"""


def test_emitted_outputs_say_where_the_model_returns_each(tmp_path: Path) -> None:
    """A model returning a dict: each rank's module returns the flat tuple (logits first), and
    meta.json names each output's place in the model's own return (it gave generated node names
    only, e.g. "tp_all_gather", which a user could not map to out["logits"])."""
    model = tmp_path / "dict_model.py"
    model.write_text(DICT_MODEL)
    emitted = tmp_path / "emitted"
    r = planner_in_process("optimize", str(model), "--cluster", "local-cpu", "--nproc", "2", "--tp", "2",
                           "--layout", "megatron", "--emit", str(emitted))  # fmt: skip
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        meta = json.loads((emitted / f"rank{rank}" / "meta.json").read_text())
        assert [o["model_path"] for o in meta["outputs"]] == ["['logits']", "['hidden']"], meta["outputs"]
    assert "model_path" in (emitted / "README.md").read_text()


def test_failed_emit_leaves_no_folder_and_replaces_an_old_one(tmp_path: Path) -> None:
    _, args, gm = build_llama()
    with pytest.raises(EmitError, match="JSON"):
        emit_rank_module(gm, tmp_path, 3, {"bad": object()})
    assert list(tmp_path.iterdir()) == []
    emit_rank_module(gm, tmp_path, 3, {"version": 1})
    emit_rank_module(gm, tmp_path, 3, {"version": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank3"]
    assert json.loads((tmp_path / "rank3" / "meta.json").read_text())["version"] == 2


def test_emit_refuses_model_chunks_by_the_plan_field(tmp_path: Path) -> None:
    zero = Prediction(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    plan = Plan(
        model="llama3.py", cluster="local-cpu", workload="train", batch_size=4, seq_len=8, context=0,
        micro_batches=2, dtype="fp32", mesh=MeshShape(1, 2, 1), splits={}, stages=[[0, 2], [1, 3]],
        ladder_layers=[], predicted=zero, solver=SolverInfo("fixed", 0.0, 0.0, 0.0, 0),
        schedule=Schedule.INTERLEAVED_1F1B, virtual_stages=2,
    )  # fmt: skip
    with pytest.raises(InputError, match="plan field 'virtual_stages' is 2"):
        emit_plan(plan, str(EXAMPLES / "llama3.py"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_emit_shards_the_weights_given(tmp_path: Path) -> None:
    """`--emit` with `--weights`: the rank modules hold the checkpoint's tensors (they held the seeded
    init while a run with the same flags said it read the file)."""
    from safetensors.torch import save_model  # noqa: PLC0415

    model, args, gm = build_llama()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0)  # unlike any seeded init
    save_model(model, str(tmp_path / "w.safetensors"))
    zero = Prediction(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    plan = Plan(
        model="llama3.py", cluster="local-cpu", workload="forward", batch_size=2, seq_len=16, context=0,
        micro_batches=1, dtype="fp32", mesh=MeshShape(1, 1, 1), splits={}, stages=[[0, 1, 2, 3]],
        ladder_layers=[], predicted=zero, solver=SolverInfo("fixed", 0.0, 0.0, 0.0, 0),
    )  # fmt: skip
    emit_plan(
        plan, str(EXAMPLES / "llama3.py"), str(tmp_path / "out"), weights=str(tmp_path / "w.safetensors")
    )
    module = load_rank_module(tmp_path / "out", 0)
    assert torch.allclose(module(*args), model(*args), atol=1e-5)
    with pytest.raises(InputError, match="does not exist"):
        emit_plan(
            plan,
            str(EXAMPLES / "llama3.py"),
            str(tmp_path / "o2"),
            weights=str(tmp_path / "nope.safetensors"),
        )
    assert not (tmp_path / "o2").exists()


def test_tied_alias_and_call_module_rejected(tmp_path: Path) -> None:
    root = nn.Module()
    root.a = nn.Module()
    root.a.weight = nn.Parameter(torch.randn(4, 3))
    root.b = nn.Module()
    root.b.weight = root.a.weight  # one tensor under two names
    graph = fx.Graph()
    x = graph.placeholder("x")
    wa, wb = graph.get_attr("a.weight"), graph.get_attr("b.weight")
    y = graph.call_function(aten.linear.default, (x, wa))
    z = graph.call_function(aten.mm.default, (y, wb))
    graph.output(z)
    gm = fx.GraphModule(root, graph)
    emit_rank_module(gm, tmp_path, 0, {})
    module = load_rank_module(tmp_path, 0)
    assert module.get_parameter("a.weight") is module.get_parameter("b.weight")
    x_in = torch.randn(2, 3)
    torch.testing.assert_close(module(x_in), gm(x_in), rtol=0, atol=0)
    assert json.loads((tmp_path / "rank0" / "meta.json").read_text())["aliases"] == {"b.weight": "a.weight"}

    traced = fx.symbolic_trace(nn.Sequential(nn.Linear(3, 3)))
    with pytest.raises(EmitError, match="call_module"):
        emit_rank_module(traced, tmp_path, 1, {})
    assert not (tmp_path / "rank1").exists()


def test_meta_device_graph_emits_source_without_weights(tmp_path: Path) -> None:
    mf = load_model_file(EXAMPLES / "llama3.py")
    model = mf.build("meta")
    args, kwargs = mf.inputs(batch_size=2, seq_len=16)
    gm = capture(model, args, kwargs)
    folder = emit_rank_module(gm, tmp_path, 0, {})
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "module.py"]
    assert json.loads((folder / "meta.json").read_text())["weights_included"] is False
    with pytest.raises(FileNotFoundError, match="without weights"):
        load_rank_module(tmp_path, 0)
    spec = importlib.util.spec_from_file_location("rank0_meta", folder / "module.py")
    generated = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generated)
    built = generated.build()
    assert built.get_parameter("layers.0.attention.wk.weight").shape == (64, 128)
    assert built.get_parameter("layers.0.attention.wk.weight").device.type == "meta"


def test_write_readme(tmp_path: Path) -> None:
    path = write_readme(
        tmp_path, {"model": "llama3", "tp": 2, "backend": "gloo", "inputs": "tokens (2, 16) int64"}
    )
    text = path.read_text()
    assert path == tmp_path / "README.md"
    assert (
        'register_group("tp"' in text and "load_rank_module" in text and 'init_process_group("gloo")' in text
    )
    assert "tp=2, pp=1, dp=1 (2 ranks" in text
    assert "loss scaling" not in text
    fp16 = write_readme(
        tmp_path, {"model": "llama3", "tp": 2, "loss_scale": "dynamic (from 2^16)"}
    ).read_text()
    assert "## fp16 training: loss scaling" in fp16 and "dynamic (from 2^16)" in fp16


# ---------------------------------------------------------------------------------------------------
# TP=2 on gloo ranks


def _emit_then_load(ctx: RankContext, out_dir: str) -> dict:
    model, args, gm = build_llama()
    reference = model(*args)
    register_group("tp", dist.group.WORLD)
    gm = apply_tensor_parallel(gm, megatron_splits(model), ctx.rank, 2)
    expected = gm(*args)
    emit_rank_module(gm, out_dir, ctx.rank, {"model": "llama3", "tp": 2, "tp_rank": ctx.rank})
    if ctx.rank == 0:
        write_readme(out_dir, {"model": "llama3", "tp": 2, "backend": "gloo"})
    dist.barrier()
    module = load_rank_module(out_dir, ctx.rank)
    out = module(*args)
    source = (Path(out_dir) / f"rank{ctx.rank}" / "module.py").read_text()
    return {
        "equal": torch.equal(out, expected),
        "diff_vs_model": (out - reference).abs().max().item(),
        "wq": tuple(module.get_parameter("layers.0.attention.wq.weight").shape),
        "imports_collectives": "from passes.collectives import tp_all_reduce as passes_collectives_tp_all_reduce"
        in source,
    }


@pytest.mark.slow
def test_emitted_tp2_modules_load_back_on_gloo_ranks(tmp_path: Path) -> None:
    results = launch(_emit_then_load, str(tmp_path), 2, timeout_s=60)
    for r in results:
        assert r["equal"], r
        assert r["diff_vs_model"] <= 1e-5
        assert r["wq"] == (64, 128)
        assert r["imports_collectives"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "rank0", "rank1"]


# ---------------------------------------------------------------------------------------------------
# planner optimize --emit: the README matches the plan and can be followed (issue 13, kind 9)

FOLLOW_PRELUDE = """
import os
import torch
from planner.frontend.modelfile import load_model_file

_args, _ = load_model_file({model!r}).inputs({batch}, {seq})
_d = int(os.environ["RANK"]) // {tp_pp}
_per = {batch} // {dp}
inputs = tuple(a[_d * _per : (_d + 1) * _per] for a in _args)  # this DP replica's share of the batch
"""
FOLLOW_EPILOGUE = """
torch.save(out, os.path.join({out!r}, f"out{{rank}}.pt"))
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "mesh"),
    [
        (str(EXAMPLES / "llama3.py"), ["--tp", "2"]),
        (str(EXAMPLES / "llama3.py"), ["--dp", "2"]),
        # each expert split over TP without EP: the code binds the one-rank "ep" axis its dispatch runs on
        (
            str(REPO / "tests" / "models" / "tiny_moe_gptfast.py"),
            ["--tp", "2", "--expert-tp", "2", "--ep", "1"],
        ),
    ],
)
def test_emitted_readme_is_followed_in_fresh_processes(tmp_path: Path, model: str, mesh: list[str]) -> None:
    """The README of a gloo plan says gloo / CPU, names the real folder, lists every rank that runs
    (DP=2 emits rank0/ and rank1/), and its code, run by torchrun in fresh processes, gives each rank
    the unsharded model's output on its inputs."""
    batch, seq = 4, 16
    folder = tmp_path / "sharded"
    made = planner_in_process(
        "optimize", model, "--cluster", "local-cpu", "--nproc", "2", *mesh, "--batch-size", str(batch),
        "--seq-len", str(seq), "--emit", str(folder), cwd=REPO,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    readme = (folder / "README.md").read_text()
    tp, dp = (2, 1) if mesh[0] == "--tp" else (1, 2)
    assert 'init_process_group("gloo")' in readme and "torch.device('cpu')" in readme
    assert "nccl" not in readme.lower() and "cuda" not in readme.lower()
    assert repr(str(folder.resolve())) in readme and ".tmp" not in readme
    assert "`rank0/`, `rank1/`" in readme and (folder / "rank0").is_dir() and (folder / "rank1").is_dir()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "follow.py"
    script.write_text(
        FOLLOW_PRELUDE.format(model=model, batch=batch, seq=seq, tp_pp=tp, dp=dp)
        + code
        + FOLLOW_EPILOGUE.format(out=str(out))
    )
    ran = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    model_file = load_model_file(model)
    torch.manual_seed(0)  # planner.cli.emitting.SEED: the emitted weights are this build's
    reference_model = model_file.build("cpu").eval()
    args, _ = model_file.inputs(batch, seq)
    with torch.no_grad():
        reference = reference_model(*args)
    per = batch // dp
    for rank in range(2):
        d = rank // tp
        got = torch.load(out / f"out{rank}.pt")
        want = reference if isinstance(reference, torch.Tensor) else reference[0]  # the logits first
        got = got if isinstance(got, torch.Tensor) else got[0]
        torch.testing.assert_close(got, want[d * per : (d + 1) * per], rtol=1e-4, atol=1e-5)


def test_emit_keeps_the_search_to_one_chunk_per_rank_and_refuses_pinned_interleaving(tmp_path) -> None:
    """--emit writes one module per rank, which an interleaved plan (several model chunks per pipeline
    rank) cannot be. The search picked interleaved 1F1B by itself at PP 2, wrote --out, and only then
    refused the emit (exit 2, a plan left behind). With --emit the search keeps one chunk per rank, and
    a pinned interleaved schedule is refused before any work, nothing written."""
    from planner.cli.main import main  # noqa: PLC0415
    from planner.plan import Plan  # noqa: PLC0415

    llama = str(Path(__file__).resolve().parent.parent / "examples" / "llama3.py")
    base = ["optimize", llama, "--cluster", "local-cpu", "--nproc", "2", "--pp", "2", "--workload", "train",
            "--batch-size", "4"]  # fmt: skip
    plan, emitted = tmp_path / "p.yaml", tmp_path / "em"
    assert main([*base, "--emit", str(emitted), "--out", str(plan)]) == 0
    assert Plan.from_yaml(plan).virtual_stages == 1 and (emitted / "rank1" / "module.py").exists()
    pinned, folder = tmp_path / "pinned.yaml", tmp_path / "em2"
    rc = main([*base, "--schedule", "interleaved_1f1b", "--emit", str(folder), "--out", str(pinned)])
    assert rc == 2 and not pinned.exists() and not folder.exists()

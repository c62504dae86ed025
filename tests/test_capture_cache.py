"""The cache of captures (planner/frontend/capture_cache.py): a model captured again at the same shapes
is not exported again (in one process, or in another through PLANNER_CAPTURE_CACHE_DIR), the graph
it gets is bound to its own weights, and anything that can change the graph misses."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from planner.frontend import capture_cache
from planner.frontend.capture import capture
from planner.frontend.modelfile import load_model_file

MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, dim=8, eps=1e-5):
            super().__init__()
            self.up = nn.Linear(dim, 4 * dim)
            self.down = nn.Linear(4 * dim, dim)
            self.eps = eps

        def forward(self, x):
            x = x / (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
            return x + self.down(torch.relu(self.up(x)))

    def build_model():
        return Block()

    def example_inputs(batch_size=2, seq_len=4):
        return (torch.randn(batch_size, seq_len, 8),)
    """
)


@pytest.fixture
def exports(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts torch.export.export calls; the cache starts empty and is on, in this process only."""
    capture_cache.clear()
    monkeypatch.delenv("PLANNER_CAPTURE_CACHE", raising=False)
    monkeypatch.delenv("PLANNER_CAPTURE_CACHE_DIR", raising=False)
    calls: list[int] = []
    real = torch.export.export

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    yield calls
    capture_cache.clear()


def _capture(path, device: str = "meta", batch: int = 2, **attrs):
    model_file = load_model_file(path)
    model = model_file.build(device)
    for name, value in attrs.items():
        setattr(model, name, value)
    return capture(model, *model_file.inputs(batch, 4))


def test_the_same_model_file_at_the_same_shapes_is_exported_once(tmp_path, exports):
    path = tmp_path / "block.py"
    path.write_text(MODEL)
    first = _capture(path)
    second = _capture(path)  # the file loaded again: new classes, new module objects
    assert len(exports) == 1
    assert second.code == first.code and second is not first
    # a copy: rewriting one graph leaves the next capture as it was
    for node in list(second.graph.nodes):
        if node.op == "output":
            node.args = (next(iter(second.graph.nodes)),)
    second.graph.eliminate_dead_code()
    assert _capture(path).code == first.code and len(exports) == 1


@pytest.mark.parametrize(
    "change",
    ["batch", "eps", "training", "dtype", "file", "device"],
)
def test_what_changes_the_graph_captures_again(tmp_path, exports, change):
    path = tmp_path / "block.py"
    path.write_text(MODEL)
    first = _capture(path)
    if change == "batch":
        again = _capture(path, batch=3)
    elif change == "eps":  # a plain attribute forward reads
        again = _capture(path, eps=1e-3)
    elif change == "training":  # dropout and batch norm trace otherwise in train mode
        model_file = load_model_file(path)
        model = model_file.build("meta")
        again = capture(model.train(not model.training), *model_file.inputs(2, 4))
    elif change == "dtype":
        model_file = load_model_file(path)
        again = capture(model_file.build("meta").to(torch.bfloat16), *model_file.inputs(2, 4))
        weights = [n.meta["val"].dtype for n in again.graph.nodes if n.op == "get_attr"]
        assert set(weights) == {torch.bfloat16}
    elif change == "file":  # the user edits the model file between two runs of one process
        path.write_text(MODEL.replace("torch.relu", "torch.nn.functional.gelu"))
        again = _capture(path)
        assert "gelu" in again.code
    else:  # real weights: another graph (the devices in it); kept too, bound to each model's own weights
        again = _capture(path, device="cpu")
        assert len(exports) == 2
        _capture(path, device="cpu")
        assert len(exports) == 2
        return
    assert len(exports) == 2, change
    assert change in ("training", "batch", "dtype") or again.code != first.code


def test_a_hook_or_a_local_class_with_other_closure_values_is_not_reused(exports):
    def make(scale: float) -> nn.Module:
        class Scaled(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4, device="meta")

            def forward(self, x):
                return self.lin(x) * scale

        return Scaled()

    x = torch.randn(2, 4)
    capture(make(2.0), (x,))
    capture(make(3.0), (x,))
    assert len(exports) == 2  # same class name, another value in its forward's closure
    capture(make(3.0), (x,))
    assert len(exports) == 2
    hooked = make(3.0)
    hooked.register_forward_hook(lambda module, args, out: out + 1)
    capture(hooked, (x,))
    assert len(exports) == 3


def test_the_cache_can_be_switched_off(tmp_path, exports, monkeypatch):
    path = tmp_path / "block.py"
    path.write_text(MODEL)
    monkeypatch.setenv("PLANNER_CAPTURE_CACHE", "off")
    _capture(path)
    _capture(path)
    assert len(exports) == 2


def _key(model: nn.Module, *inputs) -> str | None:
    return capture_cache.cache_key(model, tuple(inputs), {})


def test_the_key_reads_classes_by_their_code_and_values_by_their_contents(monkeypatch):
    """Found by review: a class made in a factory (class attribute or base from the factory), a class
    redefined under the same name (a notebook cell run again), a patched method, a numpy constant,
    a bound method, the input's strides and torch's default device each changed the graph under one key."""
    monkeypatch.delenv("PLANNER_CAPTURE_CACHE", raising=False)
    x = torch.randn(2, 4)

    def factory(scale: float, act) -> nn.Module:
        class Base(nn.Module):
            def act(self, y):
                return act(y)

        class Scaled(Base):
            SCALE = scale

            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4, device="meta")

            def forward(self, y):
                return self.act(self.lin(y)) * self.SCALE

        return Scaled()

    assert _key(factory(2.0, torch.relu), x) == _key(factory(2.0, torch.relu), x) is not None
    assert _key(factory(2.0, torch.relu), x) != _key(factory(3.0, torch.relu), x)
    assert _key(factory(2.0, torch.relu), x) != _key(factory(2.0, torch.tanh), x)
    model = factory(2.0, torch.relu)
    before = _key(model, x)
    monkeypatch.setattr(type(model), "forward", lambda self, y: self.lin(y))
    assert _key(model, x) != before  # patched at run time
    first = _key(model, x)
    monkeypatch.setattr(type(model), "SCALE", 2.5)
    assert _key(model, x) != first

    import numpy as np  # noqa: PLC0415

    constant = factory(2.0, torch.relu)
    constant.table = np.full(2000, 1.0)
    other = factory(2.0, torch.relu)
    other.table = np.full(2000, 1.0)
    other.table[1234] = 1.0000001  # equal in a truncated repr
    assert _key(constant, x) != _key(other, x)
    constant.method = other.forward
    assert _key(constant, x) is None  # a bound method: its object's state is not read
    assert _key(other, x) != _key(other, x.t().contiguous().t())  # same shape, other strides
    outside = _key(other, x)
    with torch.device("meta"):  # a tensor made in forward without a device lands elsewhere
        assert _key(other, x) != outside


def test_a_graph_from_the_cache_is_bound_to_its_own_models_weights(tmp_path, exports):
    """A model with real weights at the same shapes gets the stored graph with ITS parameters and
    buffers (the same objects, so training updates them) and computes what it computes; a tensor of
    the model that export keeps as a constant (a plain attribute) makes it capture again."""
    path = tmp_path / "block.py"
    path.write_text(MODEL)
    model_file = load_model_file(path)
    (x,), _ = model_file.inputs(2, 4)
    torch.manual_seed(0)
    capture(model_file.build("cpu"), (x,))
    torch.manual_seed(1)
    other = model_file.build("cpu")
    gm = capture(other, (x,))
    assert len(exports) == 1
    params = dict(other.named_parameters())
    assert {n: p for n, p in gm.named_parameters()}.keys() == params.keys()
    assert all(p is params[n] for n, p in gm.named_parameters())
    with torch.no_grad():
        assert torch.equal(gm(x), other(x))
    assert all(n.meta["val"].device.type == "cpu" for n in gm.graph.nodes if n.op == "get_attr")


class _DeepThenShallow(nn.Module):
    """Nested blocks read first, a shallow head last: registered by depth, the head came first."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)) for _ in range(2)])
        self.head = nn.Linear(4, 3)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x) * self.scale


def test_a_graph_from_the_cache_registers_its_tensors_in_a_fresh_captures_order(exports):
    """Ranks flatten their gradients into one all-reduce buffer in named_parameters() order; a rank
    whose graph came from the cache registered them by depth (head before layers.0) where a rank that
    exported registered them as the graph reads them, so the two summed different parameters' gradients
    (tests/test_cp_run.py's CP 2 DeepSeek-V3: 0.0226 off)."""
    fresh = capture(_DeepThenShallow(), (torch.randn(2, 4),))
    hit = capture(_DeepThenShallow(), (torch.randn(2, 4),))
    assert len(exports) == 1
    assert [n for n, _ in hit.named_parameters()] == [n for n, _ in fresh.named_parameters()]
    assert [n for n, _ in hit.named_buffers()] == [n for n, _ in fresh.named_buffers()]
    assert next(iter(fresh.named_parameters()))[0] == "layers.0.0.weight"


class _Shifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.shift = torch.ones(4)  # a plain tensor attribute: export keeps it in the graph as a constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.shift


def test_a_model_whose_graph_holds_its_data_as_a_constant_is_not_kept(exports):
    x = torch.randn(2, 4)
    capture(_Shifted(), (x,))
    capture(_Shifted(), (x,))
    assert len(exports) == 2


_SUBPROCESS = """
import sys, torch
from planner.frontend.capture import capture
from planner.frontend.modelfile import load_model_file
calls = []
real = torch.export.export
torch.export.export = lambda *a, **k: calls.append(1) or real(*a, **k)
model_file = load_model_file(sys.argv[1])
torch.manual_seed(int(sys.argv[2]))
model = model_file.build("cpu")
(x,), _ = model_file.inputs(2, 4)
gm = capture(model, (x,))
with torch.no_grad():
    same = torch.equal(gm(x), model(x))
print(len(calls), same)
"""


def test_processes_share_captures_through_a_folder(tmp_path):
    """PLANNER_CAPTURE_CACHE_DIR: a second process captures nothing the first captured; an entry that
    cannot be read (cut short) is captured again, not an error."""
    path = tmp_path / "block.py"
    path.write_text(MODEL)
    folder = tmp_path / "captures"
    env = {
        **os.environ,
        "PLANNER_CAPTURE_CACHE_DIR": str(folder),
        "PYTHONPATH": str(Path(__file__).parents[1]),
    }
    env.pop("PLANNER_CAPTURE_CACHE", None)

    def run(seed: int) -> str:
        done = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS, str(path), str(seed)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout.strip()

    assert run(0) == "1 True"
    (entry,) = folder.iterdir()
    assert run(1) == "0 True"  # other weights, no export
    entry.write_bytes(entry.read_bytes()[:100])
    assert run(2) == "1 True"


_KEY_SUBPROCESS = """
import sys
from planner.frontend import capture_cache
from planner.frontend.modelfile import load_model_file
model_file = load_model_file(sys.argv[1])
args, kwargs = model_file.inputs()
print(capture_cache.cache_key(model_file.build("meta"), tuple(args), kwargs))
"""


def test_the_key_of_a_hugging_face_model_is_the_same_in_every_process():
    """Found by the cross-process cache: string hashing is seeded per process, and transformers' code
    holds frozenset constants (`x in {"a", "b"}`, iterated in hash order) and its GenerationConfig
    keeps hash() of its fields; each made the key of every Hugging Face model differ per process."""
    path = Path(__file__).parent / "corpus" / "hf_llama.py"
    keys = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(Path(__file__).parents[1])}
        env.pop("PLANNER_CAPTURE_CACHE", None)
        done = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", _KEY_SUBPROCESS, str(path)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        keys.add(done.stdout.strip())
    assert len(keys) == 1 and "None" not in keys, keys


class _Up(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.up(x))


class _Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def test_one_block_reused_and_blocks_with_tied_weights_key_apart():
    """Three layers holding one block object, and three blocks whose weights are tied to the first's:
    the same parameters, but the capture names the modules otherwise (module_path: one `layers` block
    against three), so they are two captures."""
    shared = _Up()
    reused = _Stack([shared, shared, shared])
    tied = _Stack([_Up(), _Up(), _Up()])
    for block in tied.layers[1:]:
        block.up.weight, block.up.bias = tied.layers[0].up.weight, tied.layers[0].up.bias
    x = (torch.randn(2, 4),)
    assert capture_cache.cache_key(reused, x, {}) != capture_cache.cache_key(tied, x, {})


class _Aliasing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.mul_(2)
        return self.fc(b)


def test_inputs_that_are_one_tensor_key_apart_from_two(exports):
    """Export traces inputs that share memory as one (a write through one is read through the other)."""
    model = _Aliasing()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    assert capture_cache.cache_key(model, (x, x), {}) != capture_cache.cache_key(model, (x, y), {})
    capture(model, (x, x))
    gm = capture(model, (x.clone(), y))
    with torch.no_grad():
        assert torch.equal(gm(x.clone(), y), model.fc(y))


_PROJECTION = torch.randn(4, 4)


class _Projected(nn.Module):
    """No parameter or buffer: the graph's only tensor is a module global, lifted as a constant."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ _PROJECTION


def test_a_model_without_parameters_keeps_its_constants_out_of_the_cache(exports):
    """Its constants are real data (not a meta model's): another process may hold other values."""
    capture(_Projected(), (torch.randn(2, 4),))
    capture(_Projected(), (torch.randn(2, 4),))
    assert len(exports) == 2


class _Chatty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print(f"forward of {tuple(x.shape)}")
        return self.fc(x)


def test_what_the_forward_prints_is_printed_on_a_hit_too(exports, capsys):
    for _ in range(2):
        capture(_Chatty(), (torch.randn(2, 4),))
    assert len(exports) == 1
    assert capsys.readouterr().out.count("forward of (2, 4)") == 2


def test_the_folder_entry_follows_the_user_files_the_model_reaches(tmp_path, monkeypatch):
    """The folder's entries are named by the content of every user file the model's code reaches
    (a helper in a sibling file the class imports), and not used at all once a file changed after the
    process started (the code it runs is not the file's any more)."""
    (tmp_path / "helpers_cc.py").write_text("import torch\n\ndef act(x):\n    return torch.relu(x)\n")
    (tmp_path / "net_cc.py").write_text(
        "from torch import nn\nfrom helpers_cc import act\n\n"
        "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = nn.Linear(4, 4)\n\n    def forward(self, x):\n        return act(self.fc(x))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import net_cc  # noqa: PLC0415

    model = net_cc.Net()
    assert capture_cache._model_code_digest(model) is None  # written after this process started
    past = capture_cache._STARTED_NS - 10**9
    for name in ("helpers_cc.py", "net_cc.py"):
        os.utime(tmp_path / name, ns=(past, past))
    first = capture_cache._model_code_digest(model)
    assert first is not None
    (tmp_path / "helpers_cc.py").write_text("import torch\n\ndef act(x):\n    return torch.tanh(x)  # v2\n")
    os.utime(tmp_path / "helpers_cc.py", ns=(past, past))
    assert capture_cache._model_code_digest(model) not in (None, first)

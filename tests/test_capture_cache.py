"""The process-wide cache of meta-device captures (planner/frontend/capture_cache.py): a model captured
again at the same shapes is not exported again, and anything that can change the graph misses."""

from __future__ import annotations

import textwrap

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
    """Counts torch.export.export calls; the cache starts empty and is on."""
    capture_cache.clear()
    monkeypatch.delenv("PLANNER_CAPTURE_CACHE", raising=False)
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
    else:  # real weights: the graph holds them, so it is never kept
        _capture(path, device="cpu")
        _capture(path, device="cpu")
        assert len(exports) == 3
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

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

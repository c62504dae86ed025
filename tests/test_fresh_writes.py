"""In-place writes into tensors a forward creates become out-of-place values at capture
(`planner.frontend.fresh_writes`): the graph computes what the model computes, and the values reach
their readers by data flow (what the analysis and the sharding rules follow)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from planner.frontend.analysis import analyse
from planner.frontend.capture import capture, op_name
from planner.frontend.modelfile import load_model_file

MODELS = Path(__file__).resolve().parent / "models"


def _ops(gm) -> list[str]:
    return [op_name(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _same(model: nn.Module, *args: torch.Tensor):
    """The capture of `model` at `args` and its output beside the eager model's (must be equal)."""
    gm = capture(model, args)
    got, want = gm(*args), model(*args)
    assert torch.equal(got, want), (got - want).abs().max()
    return gm


class LatentKeys(nn.Module):
    """transformers' DeepSeek-V3 `expand_kv`: a key from its no-RoPE part and a RoPE part shared by the
    heads, written with two copy_ into slices of new_empty."""

    def forward(self, k_nope: torch.Tensor, k_rot: torch.Tensor) -> torch.Tensor:
        k_rot = k_rot.expand(-1, k_nope.shape[1], -1, -1)
        k = k_nope.new_empty(*k_nope.shape[:-1], k_nope.shape[-1] + k_rot.shape[-1])
        k[..., : k_nope.shape[-1]].copy_(k_nope)
        k[..., k_nope.shape[-1] :].copy_(k_rot)
        return k * 2


def test_copies_that_tile_a_new_tensor_become_a_concatenation():
    gm = _same(LatentKeys(), torch.randn(2, 4, 8, 6), torch.randn(2, 1, 8, 3))
    ops = _ops(gm)
    assert "aten.cat" in ops and "aten.copy_" not in ops and "aten.new_empty" not in ops, ops


class ExpertsInPlace(nn.Module):
    """A mixture-of-experts combine accumulated in place (`out.index_add_` per expert), its dtype cast
    on the way in."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], 8, dtype=torch.float64)
        for e, expert in enumerate(self.experts):
            out.index_add_(0, rows[e], expert(x[rows[e]]).double())
        return out


def test_an_in_place_accumulation_into_zeros_becomes_out_of_place():
    rows = torch.tensor([[0, 1], [2, 3], [1, 4]])
    gm = _same(ExpertsInPlace(), torch.randn(5, 8), rows)
    ops = _ops(gm)
    assert ops.count("aten.index_add") == 3 and "aten.index_add_" not in ops, ops


class PartialWrites(nn.Module):
    """Writes that do not tile the tensor: a middle slice, a selected row, then a masked fill whose
    returned value is read (torch.export reads the in-place op's return)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.zeros(4, 6)
        t[:, 2:4].copy_(x[:, :2])
        t[1] = x[0, 0]
        t.masked_fill_(t > 0.5, 0.5)
        return t + 1


def test_other_writes_become_scatters_of_the_current_value():
    gm = _same(PartialWrites(), torch.randn(4, 6))
    ops = _ops(gm)
    assert "aten.slice_scatter" in ops and "aten.select_scatter" in ops, ops
    assert not [op for op in ops if op.endswith("_")], ops


class ViewReadEarly(nn.Module):
    """A view of the new tensor taken before a later write and read after it: it sees the write (its
    storage is the tensor's), which a value could not; left as it is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.zeros(4, 6)
        head = t[:2]
        t.add_(x)
        return head * 3


def test_a_view_read_across_a_later_write_keeps_the_in_place_graph():
    gm = _same(ViewReadEarly(), torch.randn(4, 6))
    assert "aten.add_" in _ops(gm)


def test_deepseek_v3_latent_attention_is_seen_as_heads():
    """Hugging Face's DeepSeek-V3: the key's copies become a concatenation, so the analysis follows the
    no-RoPE key and value to `kv_b_proj` (one projection of each head's key and value side by side): 8
    KV heads of the 8 query heads, not the width's halves over the queries' head dim."""
    model_file = load_model_file(MODELS / "hf_deepseek_v3.py")
    gm = capture(model_file.build("meta"), *model_file.inputs())
    assert "aten.copy_" not in _ops(gm)
    attention = analyse(gm).layers[0].attention
    roles = {p.weight.split(".")[-2]: p.role.value for p in attention.projections}
    assert roles == {"q_b_proj": "q", "kv_b_proj": "v", "o_proj": "o"}, roles
    assert (attention.num_heads, attention.num_kv_heads) == (8, 8)


class _Case(nn.Module):
    """A linear, then `body(h)` (h (4, 4) requiring grad)."""

    def __init__(self, body) -> None:
        super().__init__()
        self.lin, self.body = nn.Linear(4, 4), body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.lin(x))


def _snapshot(h):
    prev = torch.empty_like(h)
    prev.copy_(h)
    h = h * 1  # a value the next line writes in place
    h.mul_(3)
    return prev + h


def _transposed_copy(h):
    t = torch.empty(4, 4)
    t.copy_(h.t())
    return t.view(16) * 2


def _early_transpose(h):
    t = torch.zeros(4, 4)
    tt = t.T
    t.add_(h)
    return tt * 3


def _early_atleast_3d(h):
    t = torch.zeros(4, 4)
    v = torch.atleast_3d(t)
    t.add_(h)
    return v.sum(-1) * 3


def _early_unsafe_split(h):
    t = torch.zeros(4, 4)
    v = t.unsafe_split(2)[1]
    t.add_(h)
    return v * 3 + h[2:]  # unsafe_split's views carry no autograd link: h's gradient comes through + h


def _view_adds_itself(h):
    t = torch.zeros(2, 4, 4)
    t.fill_(1.0)
    v = t[1]
    v += v
    return t * h


def _bf16_accumulator(h):
    acc = torch.zeros(4, 4, dtype=torch.bfloat16)
    acc.add_(h * 1.001)
    return acc.float()


CASES = {
    "add_ alpha": lambda h: torch.zeros(4, 4).add_(h, alpha=3) * 1,
    "index_add_ alpha": lambda h: (
        torch.zeros(5, 4).index_add_(0, torch.tensor([0, 2, 2, 4]), h, alpha=0.5) * 1
    ),
    "div_ rounding_mode": lambda h: (
        torch.ones(4, 4).mul_(7).div_(h.detach().abs() + 1, rounding_mode="floor") + h
    ),
    "sub_ alpha through a slice": lambda h: _slice_sub(h),
    "copy_ snapshot, source written later": _snapshot,
    "copy_ of a transposed source, then view": _transposed_copy,
    "t.T read across a later write": _early_transpose,
    "atleast_3d read across a later write": _early_atleast_3d,
    "unsafe_split read across a later write": _early_unsafe_split,
    "v += v through a select": _view_adds_itself,
    "fp32 added into bf16 keeps bf16": _bf16_accumulator,
}


def _slice_sub(h):
    t = torch.zeros(5, 4)
    t[1:].sub_(h, alpha=2)
    return t * 1


@pytest.mark.parametrize("name", list(CASES))
def test_the_rewrite_computes_what_the_model_computes(name):
    """Patterns from a break test of the rewrite (keyword arguments, dtype of the destination, copies of
    sources written later or laid out otherwise, views not listed by name, a write reading its own
    view): outputs and gradients equal the eager model's."""
    torch.manual_seed(0)
    model, x = _Case(CASES[name]), torch.randn(4, 4)
    gm = capture(model, (x,))
    got, want = gm(x), model(x)
    assert got.dtype == want.dtype and torch.equal(got, want), (got - want).abs().max()
    got.float().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want.float().sum().backward()
    for n, p in model.named_parameters():
        assert torch.equal(grads[n], p.grad), (n, (grads[n] - p.grad).abs().max())

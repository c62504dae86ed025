"""Placement by general sharding semantics (passes.general_rules: DTensor's op strategies) in the TP pass.

Each case captures a small module on meta, splits its projections Megatron-style by hand and lowers
rank 0 of tp=2: the ops between the projections must keep the head shard (no gather, no fallback),
and an op that cannot run on the shards must gather, recorded as a fallback naming its line.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from passes import collectives
from passes.general_rules import general_rule, is_plain
from passes.placement import Placement
from passes.tensor_parallel import apply_tensor_parallel, rule_coverage
from passes.tp_rules_context import FALLBACK_META
from planner.frontend.capture import capture, user_line
from planner.plan import WeightSplit

H, KV, D, C, T, B = 4, 2, 8, 32, 6, 2


def _rope_stacked_halves(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """gpt-fast's apply_rotary_emb: real / imaginary halves rotated, stacked and flattened back."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    f = freqs.view(1, xs.size(1), 1, xs.size(3), 2)
    out = torch.stack(
        [
            xs[..., 0] * f[..., 0] - xs[..., 1] * f[..., 1],
            xs[..., 1] * f[..., 0] + xs[..., 0] * f[..., 1],
        ],
        -1,
    )
    return out.flatten(3).type_as(x)


class FusedGqaAttention(nn.Module):
    """Fused wqkv split into [q, k, v], GQA by repeat_interleave, RoPE on stacked halves, SDPA with a
    boolean mask indexed at the positions (gpt-fast's Attention without its cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(C, (H + 2 * KV) * D, bias=False)
        self.wo = nn.Linear(H * D, C, bias=False)
        self.register_buffer("freqs", torch.randn(16, D // 2, 2))
        self.register_buffer("causal", torch.tril(torch.ones(16, 16, dtype=torch.bool)))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(x).split([H * D, KV * D, KV * D], dim=-1)
        q, k, v = q.view(B, T, H, D), k.view(B, T, KV, D), v.view(B, T, KV, D)
        freqs = self.freqs[pos]
        q, k = _rope_stacked_halves(q, freqs), _rope_stacked_halves(k, freqs)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        mask = self.causal[None, None, pos]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[..., :T])
        return self.wo(y.transpose(1, 2).contiguous().view(B, T, H * D))


class FeatureCumsum(nn.Module):
    """A cumsum along the features a column-parallel projection shards: it cannot run on the shards."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(C, 4 * C, bias=False), nn.Linear(4 * C, C, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.cumsum(F.silu(self.up(x)), dim=-1))


def _lower(module: nn.Module, splits: dict[str, WeightSplit], *inputs: torch.Tensor):
    gm = capture(module, inputs, {})
    return apply_tensor_parallel(gm, splits, 0, 2)


def _calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_gpt_fast_attention_keeps_its_head_shard_through_rope_stack_and_masked_sdpa() -> None:
    splits = {
        "wqkv.weight": WeightSplit("wqkv.weight", "colwise", 0, [H * D, KV * D, KV * D]),
        "wo.weight": WeightSplit("wo.weight", "rowwise", 1),
    }
    gm = _lower(FusedGqaAttention(), splits, torch.randn(B, T, C), torch.arange(T))
    calls = _calls(gm)
    assert not [n.name for n in calls if FALLBACK_META in n.meta], "no op may gather"
    by_op = {}
    for n in calls:
        by_op.setdefault(str(getattr(n.target, "overloadpacket", n.target)), []).append(n)
    # the stacked RoPE halves and their flatten / cast keep the head shard: dim 2 of (B, T, H, D/2, 2)
    assert all(n.meta["tp_placement"] == "Shard(2)" for n in by_op["aten.stack"])
    assert all(n.meta["tp_rule"] == "general" for n in by_op["aten.stack"])
    (sdpa,) = by_op["aten.scaled_dot_product_attention"]
    assert sdpa.meta["tp_placement"] == "Shard(1)" and tuple(sdpa.meta["val"].shape) == (B, H // 2, T, D)
    coverage = rule_coverage(gm)
    assert coverage["general"] >= 10 and coverage["own"] >= 4, coverage


def test_cumsum_across_the_shard_gathers_and_is_recorded() -> None:
    """torch 2.13's DTensor strategy reads cumsum(x, -1) as a dim without the shard; the dims are made
    non-negative first, so the cumsum gathers (a priced fallback) instead of summing within each shard."""
    splits = {
        "up.weight": WeightSplit("up.weight", "colwise", 0),
        "down.weight": WeightSplit("down.weight", "rowwise", 1),
    }
    gm = _lower(FeatureCumsum(), splits, torch.randn(B, T, C))
    (cumsum,) = [n for n in _calls(gm) if "cumsum" in str(n.target)]
    fallback = cumsum.meta[FALLBACK_META]
    assert fallback.op == "aten.cumsum" and "torch.cumsum(F.silu(self.up(x)), dim=-1)" in fallback.line
    assert cumsum.meta["tp_placement"] == "Replicate()"


def test_general_rule_leaves_layouts_it_cannot_express_to_our_rules() -> None:
    assert is_plain(Placement.replicate()) and is_plain(Placement.shard(1))
    assert not is_plain(Placement.shard(0, parts=(4, 4)))
    assert not is_plain(Placement.shard(0, pieces=1)) and not is_plain(Placement.partial())
    assert general_rule.__doc__ and "False" in general_rule.__doc__


class SlicedFusedQkv(nn.Module):
    """Hugging Face Phi-3's attention input: one qkv_proj whose output is sliced into q, k and v."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(C, (H + 2 * KV) * D, bias=False)
        self.o_proj = nn.Linear(H * D, C, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_pos, kv = H * D, KV * D
        q = qkv[..., :q_pos].view(B, T, H, D).transpose(1, 2)
        k = qkv[..., q_pos : q_pos + kv].view(B, T, KV, D).transpose(1, 2)
        v = qkv[..., q_pos + kv :].view(B, T, KV, D).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D))


def test_slices_of_a_fused_projection_take_each_rank_s_part() -> None:
    """qkv[..., :q_pos] of a per-part split: rank 0 cuts q's local half, not the first q_pos columns."""
    parts = [H * D, KV * D, KV * D]
    splits = {
        "qkv_proj.weight": WeightSplit("qkv_proj.weight", "colwise", 0, parts),
        "o_proj.weight": WeightSplit("o_proj.weight", "rowwise", 1),
    }
    gm = _lower(SlicedFusedQkv(), splits, torch.randn(B, T, C))
    slices = [n for n in _calls(gm) if "slice" in str(n.target) and n.args[0].name == "linear"]
    assert [tuple(n.args[2:4]) for n in slices] == [(0, 16), (16, 24), (24, 32)]
    assert not [n.name for n in _calls(gm) if FALLBACK_META in n.meta]
    (sdpa,) = [n for n in _calls(gm) if "scaled_dot_product" in str(n.target)]
    assert sdpa.meta["tp_placement"] == "Shard(1)"


class MaskedWithScalar(nn.Module):
    """torch.where(mask, h, -1e4): the overload that takes a Python scalar (where.ScalarOther) has no
    DTensor strategy of its own; it is placed as the tensor overload would be."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(C, 4 * C, bias=False), nn.Linear(4 * C, C, bias=False)
        self.register_buffer("keep", torch.rand(1, T, 1) > 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.where(self.keep, self.up(x), -1e4))


def test_an_overload_taking_a_scalar_is_placed_as_its_tensor_overload() -> None:
    splits = {
        "up.weight": WeightSplit("up.weight", "colwise", 0),
        "down.weight": WeightSplit("down.weight", "rowwise", 1),
    }
    gm = _lower(MaskedWithScalar(), splits, torch.randn(B, T, C))
    (where,) = [n for n in _calls(gm) if "where" in str(n.target)]
    assert str(where.target) == "aten.where.ScalarOther" and where.args[2] == -1e4
    assert where.meta["tp_placement"] == "Shard(2)" and where.meta["tp_rule"] == "general"
    assert not [n.name for n in _calls(gm) if FALLBACK_META in n.meta]


class BatchHeadsMerged(nn.Module):
    """Hugging Face Bloom's attention core: (B, H, T, hd) reshaped to (B*H, T, hd) for bmm."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(C, H * D, bias=False) for _ in range(3))
        self.o = nn.Linear(H * D, C, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = [p(x).view(B, T, H, D).transpose(1, 2) for p in (self.q, self.k, self.v)]
        q, k, v = (t.reshape(B * H, T, D) for t in heads)  # batch and heads merged
        y = torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1), v)
        return self.o(y.view(B, H, T, D).transpose(1, 2).reshape(B, T, H * D))


def test_a_reshape_that_interleaves_the_head_shard_with_the_batch_is_a_strided_shard_bmm_keeps() -> None:
    """Merging (B, H/tp) into one dim leaves each rank's heads strided through it: the reshape carries
    that as a strided shard (`Placement.outer`). bmm and the softmax compute each row of the merged
    dim from the same rows of their inputs, so they keep the strided shard
    (`passes.general_rules.strided_general_rule`): nothing is gathered before the row-parallel o.
    Before, bmm ran on the gathered heads, put back in order by `tp_gather_strided` (a fallback)."""
    splits = {n: WeightSplit(n, "colwise", 0) for n in ("q.weight", "k.weight", "v.weight")}
    splits["o.weight"] = WeightSplit("o.weight", "rowwise", 1)
    gm = _lower(BatchHeadsMerged(), splits, torch.randn(B, T, C))
    strided = {
        n.name: n for n in _calls(gm) if n.meta.get("tp_placement", "").endswith(f"[strided, outer {B}]")
    }
    merged = [n for n in strided.values() if "reshape" in str(n.target)]
    assert len(merged) == 3 and all("batch and heads merged" in user_line(n) for n in merged), strided
    kept = [n for n in strided.values() if str(n.target).split(".")[1] in ("bmm", "_softmax", "softmax")]
    assert len(kept) == 3 and all(n.meta["tp_rule"] == "general" for n in kept), strided
    assert not [n.meta[FALLBACK_META] for n in _calls(gm) if FALLBACK_META in n.meta]
    assert not [
        n for n in _calls(gm) if n.target in (collectives.tp_gather_strided, collectives.tp_all_gather)
    ]

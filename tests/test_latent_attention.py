"""Multi-head latent attention (DeepSeek-V2 / V3): the down projections to the latents (`q_a_proj`,
`kv_a_proj_with_mqa`) are the attention's, kept whole under TP as Megatron-Core and DeepSeek's reference
model keep them; the up projections split by heads. They used to be read as MLP projections: priced as
one chain with the shared expert (`up0 act1 up1 act2 gate2 ...`), split column-wise, and the latent's
RMSNorm then gathered its input on every rank; `--layout megatron` alternated the shared expert's
gate / up / down as column, row, column. Under sequence parallelism the key's shared RoPE part (one
head, broadcast to every head and concatenated with each head's own part) gathered the heads' keys.

The runs: tests/test_corpus.py (tests/corpus/hf_deepseek_v3.py at tp=2, forward) and
tests/test_ep_run.py (`deepseek_v3_planned_tp2`: the planner's tp=2 training plan of the MoE model).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from planner.cli import workflow
from planner.frontend.analysis import Role

MODELS = Path(__file__).resolve().parent / "models"
FASTLINK = str(MODELS / "fastlink.yaml")


@functools.cache
def _plan(model: str, layout: str = "auto"):
    """(Prepared, Plan): `model`'s training step at tp=2 with sequence parallelism on fastlink."""
    path = str(MODELS / model)
    prepared = workflow.prepare(path, "train", batch_size=2, seq_len=16)
    cluster = workflow.resolve_cluster(FASTLINK, 2)
    constraints = workflow.constraints_from(2, 1, 1, "none", sequence_parallel=True, layout=layout)
    return prepared, workflow.make_plan(prepared, cluster, constraints, path)


def test_mla_down_projections_are_the_attentions_and_the_shared_expert_an_mlp():
    prepared, _ = _plan("hf_deepseek_v3.py")
    for i, layer in enumerate(prepared.structure.layers):
        attn = f"model.layers.{i}.self_attn."
        assert [p.weight for p in layer.latents] == [
            f"{attn}q_a_proj.weight",
            f"{attn}kv_a_proj_with_mqa.weight",
        ]
        assert all(p.role is Role.LATENT for p in layer.latents)
        roles = {p.weight.removeprefix(f"model.layers.{i}."): p.role for p in layer.mlp.projections}
        assert roles == {
            "mlp.shared_experts.gate_proj.weight": Role.GATE,
            "mlp.shared_experts.up_proj.weight": Role.UP,
            "mlp.shared_experts.down_proj.weight": Role.DOWN,
        }, roles
        assert layer.node_blocks[layer.latents[0].node] == "stream"


def test_a_latent_read_by_k_and_v_alone_is_not_an_mlp_gate():
    """tests/models/latent_kv.py: k and v from one latent `wc`, a plain up / GELU / down MLP: `wc` was
    the third MLP projection, and the MLP was priced as a SwiGLU (gate, up, down)."""
    prepared, _ = _plan("latent_kv.py")
    layer = prepared.structure.layers[0]
    assert [p.weight for p in layer.latents] == ["blocks.0.wc.weight"]
    assert [p.role for p in layer.mlp.projections] == [Role.UP, Role.DOWN]


@pytest.mark.parametrize("layout", ["auto", "megatron"])
def test_mla_splits_by_heads_with_no_gather_under_sequence_parallelism(layout):
    prepared, plan = _plan("hf_deepseek_v3.py", layout)
    assert plan.tp == 2 and plan.sequence_parallel
    splits = {w: str(s.style) for w, s in plan.splits.items() if ".layers.0." in w}
    want = {
        "model.layers.0.self_attn.q_b_proj.weight": "colwise",
        "model.layers.0.self_attn.kv_b_proj.weight": "colwise",
        "model.layers.0.self_attn.o_proj.weight": "rowwise",
        "model.layers.0.mlp.shared_experts.gate_proj.weight": "colwise",
        "model.layers.0.mlp.shared_experts.up_proj.weight": "colwise",
        "model.layers.0.mlp.shared_experts.down_proj.weight": "rowwise",
    }
    assert {w: splits.get(w) for w in want} == want, splits
    assert not any("q_a_proj" in w or "kv_a_proj" in w for w in splits), splits
    assert not plan.fallbacks, [f"{f.op} at {f.line}" for f in plan.fallbacks]


def test_megatron_layout_keeps_the_latents_out_of_the_mlp_chain():
    _, plan = _plan("hf_deepseek_v3.py", "megatron")
    (strategy,) = {tuple(sorted(c.strategy.items())) for c in plan.predicted.per_layer if c.layer >= 0}
    ops = {op: c for op, c in strategy if op not in ("experts", "recompute")}
    assert ops == {
        "q": "colwise",
        "v": "colwise",
        "core": "head",
        "o": "rowwise",
        "gate": "colwise",
        "up": "colwise",
        "act": "shard",
        "down": "rowwise",
    }, strategy

"""The models `bench/training_published.py` prices are the published runs' models: each Megatron-Core
weak-scaling row's GPT has the parameter count its size names (the table's "1.7B" ... "462B")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples"))

from models import GPT, GPTConfig  # noqa: E402
from training_published import MEGATRON_ROWS, MEGATRON_TIED, SEQ, VOCAB  # noqa: E402


@pytest.mark.parametrize("row", MEGATRON_ROWS, ids=[r[0] for r in MEGATRON_ROWS])
def test_each_megatron_row_gpt_has_the_size_its_name_says(row):
    """Within 3.5% of the named size (the names keep 2 digits: 1.75B reads "1.7B"): the LM head has its own weight
    (--untie-embeddings-and-output-weights), which the sizes count; tied, the 1.7B row's GPT has 1.49B
    parameters."""
    size, heads, hidden, layers, *_ = row
    config = GPTConfig(vocab_size=VOCAB, n_positions=SEQ, n_layer=layers, n_head=heads, n_embd=hidden,
                       tie_embeddings=MEGATRON_TIED)  # fmt: skip
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(config).parameters())
    assert params / 1e9 == pytest.approx(float(size.removesuffix("B")), rel=0.035), (
        f"{size}: {params / 1e9:.2f}B"
    )


def test_an_untied_gpt_gives_its_head_its_own_weight():
    """`GPTConfig.tie_embeddings=False`: the head and the token embedding are two parameters."""
    tied, untied = (GPT(GPTConfig(vocab_size=64, n_positions=8, n_layer=1, n_head=2, n_embd=16, tie_embeddings=t))
                    for t in (True, False))  # fmt: skip
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters()) == 64 * 16

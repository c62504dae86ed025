"""Corpus: Hugging Face Gemma-2 (`Gemma2ForCausalLM`), built from a Gemma2Config (random weights, no download).

Imitates: Gemma-2 2B/9B. Constructs: separate q/k/v/o projections, grouped-query attention (4 heads,
2 KV heads) with head_dim 32 and `query_pre_attn_scalar` scaling, attention-logit soft-capping
(tanh, eager attention: SDPA cannot soft-cap, so transformers' eager path computes
softmax(q @ k^T * scale) by hand), alternating sliding-window (8) / global layers, embeddings scaled
by sqrt(hidden), Gemma RMSNorm (1 + weight) with pre- and post-norms around attention and MLP,
GeGLU MLP (gelu tanh, gate/up/down), final-logit soft-capping, tied embeddings / LM head.
2 layers, hidden 128, MLP 512, vocab 256.
"""

import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

CONFIG = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=32,
    max_position_embeddings=256,
    sliding_window=8,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(**CONFIG, attn_implementation="eager"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}  # no cache objects in the graph

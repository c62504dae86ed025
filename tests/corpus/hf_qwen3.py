"""Corpus: Hugging Face Qwen3 (`Qwen3ForCausalLM`), built from a Qwen3Config (random weights, no download).

Imitates: Qwen3 dense checkpoints. Constructs: q/k/v/o projections without bias, a per-head RMSNorm on the
queries and keys (`q_norm`, `k_norm`: one weight of head_dim elements, applied to every head before
RoPE), grouped-query attention (8 heads, 2 KV heads, head_dim 16), RoPE, RMSNorm, SwiGLU MLP, untied
word embeddings / LM head, SDPA attention. 2 layers, hidden 128, MLP 256, vocab 320.
"""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

CONFIG = dict(
    vocab_size=320,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}  # no DynamicCache objects in the graph

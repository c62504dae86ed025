"""Corpus: Hugging Face Mistral (`MistralForCausalLM`), built from a MistralConfig (random weights, no download).

Imitates: Mistral-7B-v0.1 (sliding-window attention). Constructs: separate q/k/v/o projections without
bias, grouped-query attention (8 heads, 2 KV heads), an explicit head_dim, RoPE (rotate_half), a
sliding-window causal mask of 8 tokens (shorter than the 16-token example, so the band mask is real:
transformers' masking utils build it and SDPA receives it as attn_mask), RMSNorm, SwiGLU MLP, untied LM
head. 2 layers, hidden 128, MLP 448, vocab 384.
"""

import torch
from transformers import MistralConfig, MistralForCausalLM

CONFIG = dict(
    vocab_size=384,
    hidden_size=128,
    intermediate_size=448,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    sliding_window=8,
    tie_word_embeddings=False,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}  # no DynamicCache objects in the graph

"""Corpus: Hugging Face Qwen2 (`Qwen2ForCausalLM`), built from a Qwen2Config (random weights, no download).

Imitates: Qwen2 / Qwen2.5 checkpoints. Constructs: q/k/v projections WITH bias (o without), grouped-query
attention (8 heads, 2 KV heads), RoPE (rotate_half, theta 1e6), RMSNorm, SwiGLU MLP (gate/up/down),
tied word embeddings / LM head (as the small Qwen2.5 models have), SDPA attention. 2 layers, hidden 128,
MLP 384, vocab 320.
"""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

CONFIG = dict(
    vocab_size=320,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
    use_sliding_window=False,
    bos_token_id=0,
    eos_token_id=1,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}  # no DynamicCache objects in the graph

"""A small Hugging Face LlamaForCausalLM built from a LlamaConfig (random weights, no download).

2 layers, hidden 128, 8 heads, 4 KV heads (GQA: TP 2 and 4 both split whole KV heads), SwiGLU 256, vocab 256, SDPA attention.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}  # no KV-cache objects in the graph

"""Corpus: Hugging Face Llama (`LlamaForCausalLM`), built from a LlamaConfig (random weights, no download).

Imitates: Llama-2/3 checkpoints loaded through transformers. Constructs: separate q/k/v/o projections
without bias, grouped-query attention (8 heads, 4 KV heads) expanded with transformers' `repeat_kv`
inside the SDPA integration, RoPE as rotate_half on cos/sin tables computed in forward
(`LlamaRotaryEmbedding`), the causal mask made by transformers' masking utils, RMSNorm, SwiGLU MLP
(gate/up/down), untied LM head. 2 layers, hidden 128, MLP 256, vocab 256.
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
    return LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}  # no DynamicCache objects in the graph

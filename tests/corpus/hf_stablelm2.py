"""Corpus: Hugging Face StableLM (`StableLmForCausalLM`), built from a StableLmConfig (random weights, no
download), configured as StableLM-2-12B is.

Imitates: StableLM-2-12B. Constructs: `qk_layernorm=True` (each head's queries and keys through a
LayerNorm of its own, `StableLmLayerNormPerHead`: the heads taken apart by `torch.split(x, 1, dim=1)`,
normed one by one, concatenated again), `use_parallel_residual=True` (attention and MLP read the
same normed input), grouped-query attention (4 heads, 2 KV heads), partial rotary 0.25, LayerNorm,
SwiGLU MLP, untied LM head, SDPA attention. 2 layers, hidden 64, MLP 128, vocab 256.
"""

import torch
from transformers import StableLmConfig, StableLmForCausalLM

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    partial_rotary_factor=0.25,
    qk_layernorm=True,
    use_parallel_residual=True,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return StableLmForCausalLM(StableLmConfig(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}

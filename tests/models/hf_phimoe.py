"""Test model: a tiny Hugging Face PhiMoE (`PhimoeForCausalLM` from a config, random weights): 2 layers,
hidden 128, 8 heads (4 KV heads), 4 stacked experts per layer (`experts_implementation="batched_mm"`).
Its router picks each token's two experts with the sparsemixer (a max, a mask, a second max), not a
top-k: the planner does not recognise the block as a mixture of experts and says so."""

import torch
from transformers import PhimoeConfig, PhimoeForCausalLM

CONFIG = dict(
    vocab_size=320,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    pad_token_id=0,
    num_local_experts=4,
    num_experts_per_tok=2,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return PhimoeForCausalLM(
        PhimoeConfig(**CONFIG, attn_implementation="sdpa", experts_implementation="batched_mm")
    )


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}

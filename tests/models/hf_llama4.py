"""Test model: a tiny Hugging Face Llama 4 text model (`Llama4ForCausalLM` from a config, random weights).

Its mixture of experts scales each token by its routing score *before* the experts
(`routed_in = hidden_states.repeat(E, 1) * router_scores`), runs every expert on every token (top-1:
the other experts' scores are zero), sums, and adds the shared expert: 4 experts, 2 layers, hidden 128.
"""

import torch
from transformers import Llama4ForCausalLM, Llama4TextConfig

CONFIG = dict(
    vocab_size=320,
    hidden_size=128,
    intermediate_size=256,
    intermediate_size_mlp=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=1,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    pad_token_id=0,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Llama4ForCausalLM(Llama4TextConfig(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}

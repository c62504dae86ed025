"""Test model: a tiny Hugging Face Mixtral (`MixtralForCausalLM` from a config, random weights): 2
layers, hidden 64, 4 heads (2 KV heads), a sparse MoE block of 4 experts with top-2 routing per layer:
its router `mlp.gate` is a linear to the 4 expert logits followed by softmax and top-k, and its experts
are stacked 3-D parameters (`experts.gate_up_proj` (4, 256, 64), `experts.down_proj` (4, 64, 128)).
`experts_implementation="batched_mm"`: transformers' default grouped path calls `torch.histc` on
integer tensors, which the meta-device capture sends down its accelerator branch.
"""

import torch
from transformers import MixtralConfig, MixtralForCausalLM

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = MixtralConfig(**CONFIG, attn_implementation="sdpa", experts_implementation="batched_mm")
    return MixtralForCausalLM(config)


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}

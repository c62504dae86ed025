"""Test model: a tiny Hugging Face JetMoE, whose experts split their tokens by data-dependent sizes
(``inputs.split(expert_size, dim=0)``). The per-head-norm pass compared the unknown piece count with 2
and crashed (GuardOnDataDependentSymNode) before the planner's refusal of data-dependent shapes, which
names the line and the static-shape forms to write instead."""

import torch
from transformers import JetMoeConfig, JetMoeForCausalLM

CONFIG = dict(
    bos_token_id=0, eos_token_id=1, pad_token_id=2, vocab_size=256, num_hidden_layers=2,
    max_position_embeddings=256, hidden_size=64, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, kv_channels=16, num_local_experts=4, num_experts_per_tok=2,
)  # fmt: skip


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return JetMoeForCausalLM(JetMoeConfig(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}

"""Test model: Hugging Face GPT-BigCode (StarCoder-1's layout; `GPTBigCodeForCausalLM`, random weights
from a config): multi-query attention, one KV head, behind one fused `c_attn` taken apart after an
unsqueeze (`c_attn(x).unsqueeze(1).split((embed_dim, kv_dim, kv_dim), dim=3)`), which the analysis did
not follow to its parts."""

import torch
from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

CONFIG = dict(
    vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128, multi_query=True, bos_token_id=0,
    eos_token_id=1,
)  # fmt: skip


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPTBigCodeForCausalLM(GPTBigCodeConfig(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}

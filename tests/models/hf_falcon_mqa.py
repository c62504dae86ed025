"""Test model: Hugging Face Falcon-7B's layout (`FalconForCausalLM`, random weights from a config):
multi-query attention, one KV head, behind one fused `query_key_value` viewed as (B, T, H + 2, hd) and
split along its heads into (H, 1, 1) (`fused_qkv.split([num_heads, 1, 1], dim=-2)`). The analysis read
no parts in it, so TP 2 failed in the pass ("not a fused projection's parts ... Re-plan with a different
--tp") where the reason is its one KV head."""

import torch
from transformers import FalconConfig, FalconForCausalLM

CONFIG = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False,
    multi_query=True, parallel_attn=True, bias=False, alibi=False,
)  # fmt: skip


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return FalconForCausalLM(FalconConfig(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}

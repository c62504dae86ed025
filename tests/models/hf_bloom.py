"""Test model: Hugging Face Bloom (`BloomForCausalLM`, random weights from a config). Its attention
merges the heads with the batch, (B * H, T, hd), adds the alibi position bias, built whole as
(B * H, 1, T), with `baddbmm`, and multiplies by V with `bmm`: split by heads, both run on each
rank's strided rows and the alibi bias is cut to them (`passes.general_rules.strided_general_rule`)."""

import torch
from transformers import BloomConfig, BloomForCausalLM

CONFIG = dict(
    vocab_size=256, hidden_size=64, n_head=4, n_layer=2, pad_token_id=0, bos_token_id=1, eos_token_id=2
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return BloomForCausalLM(BloomConfig(**CONFIG, attn_implementation="eager"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}  # no cache objects in the graph

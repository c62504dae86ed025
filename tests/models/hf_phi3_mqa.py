"""Test model: Hugging Face Phi-3 (`Phi3ForCausalLM`, random weights from a config) with one KV head
(multi-query attention) behind its fused qkv_proj. At TP 2 the attention runs replicated (the fused
projection's single K/V head cannot be cut into whole heads per rank), and the SDPA rule must not cut
K to a per-rank piece it then gathers again: `tp_gather_pieces` has no backward, so training crashed."""

import torch
from transformers import Phi3Config, Phi3ForCausalLM

CONFIG = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=1, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    sliding_window=None, tie_word_embeddings=False,
)  # fmt: skip


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Phi3ForCausalLM(Phi3Config(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}  # no cache objects in the graph

"""Test model: a tiny Hugging Face LFM2 (Liquid AI): a short-convolution layer (in_proj to B, C and x
in one fused projection, ``BCx.chunk(3, dim=-2)`` after a transpose, a depthwise conv, out_proj) and a
SwiGLU feed-forward, then an attention layer. The conv layer reads as one chain of five projections
(in_proj, out_proj, w1, w3, w2); the chunk cannot carry a split of in_proj, and keeping the whole chain
whole for it kept the feed-forward whole too."""

import torch
from transformers import Lfm2Config, Lfm2ForCausalLM

CONFIG = dict(
    bos_token_id=0, eos_token_id=1, pad_token_id=2, vocab_size=256, num_hidden_layers=2,
    max_position_embeddings=256, hidden_size=128, intermediate_size=256, num_attention_heads=4,
    num_key_value_heads=2, layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False,
)  # fmt: skip


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Lfm2ForCausalLM(Lfm2Config(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}

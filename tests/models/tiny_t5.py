"""Test model: a tiny Hugging Face T5ForConditionalGeneration (random weights, no download): an
encoder of 2 blocks (self-attention, MLP) and a decoder of 2 blocks (causal self-attention,
cross-attention whose keys and values read the encoder's output, MLP); d_model 64, 4 heads of 16,
d_ff 128, vocabulary 128, the LM head tied to the shared embedding."""

import torch
from transformers import T5Config, T5ForConditionalGeneration

CONFIG = dict(
    vocab_size=128,
    d_model=64,
    d_kv=16,
    d_ff=128,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    decoder_start_token_id=0,
    pad_token_id=0,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, CONFIG["vocab_size"], (batch_size, seq_len), generator=g)
    decoder_ids = torch.randint(1, CONFIG["vocab_size"], (batch_size, seq_len), generator=g)
    return (ids, None, decoder_ids)


def example_kwargs() -> dict:
    return {"use_cache": False}

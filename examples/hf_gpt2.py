"""A small Hugging Face GPT2LMHeadModel built from a GPT2Config (random weights, no download).

2 layers, hidden 128, 4 heads, vocab 256, dropout 0, tied LM head, HF Conv1D projections
(weights stored (in, out)), SDPA attention.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

CONFIG = dict(
    vocab_size=256,
    n_positions=128,
    n_embd=128,
    n_layer=2,
    n_head=4,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    # GPT2Config's default 50256 (GPT-2's <|endoftext|>) lies outside this vocabulary, and transformers
    # warns of it on every build: the last id of this one plays its part
    bos_token_id=255,
    eos_token_id=255,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(**CONFIG, attn_implementation="sdpa")
    return GPT2LMHeadModel(config)


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}  # no KV-cache objects in the graph

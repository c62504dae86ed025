"""Corpus: Hugging Face GPT-2 (`GPT2LMHeadModel`), built from a GPT2Config (random weights, no download).

Imitates: gpt2 / distilgpt2 checkpoints. Constructs: HF `Conv1D` projections (weights stored
(in, out), `addmm` of bias + x @ W), ONE fused `c_attn` split with `.split(embed_dim, dim=2)` into
q/k/v, `c_proj`; learned position embeddings; LayerNorm (pre-LN); GELU-new (tanh) MLP `c_fc` / `c_proj`;
LM head tied to the token embedding; dropout 0; SDPA attention. 2 layers, hidden 128, 4 heads,
MLP 512, vocab 256.
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
    bos_token_id=255,  # GPT2Config's 50256 lies outside this vocabulary
    eos_token_id=255,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}  # no cache objects in the graph

"""Corpus: Hugging Face Phi-3 (`Phi3ForCausalLM`), built from a Phi3Config (random weights, no download).

Imitates: Phi-3-medium (grouped-query). Constructs: ONE fused `qkv_proj` Linear sliced as
`qkv[..., :query_pos]`, `qkv[..., query_pos : query_pos + kv * hd]`, `qkv[..., query_pos + kv * hd :]`
(unequal parts: 8 query heads, 4 KV heads), `o_proj`; RoPE (rotate_half); a fused `gate_up_proj`
whose output is `.chunk(2, dim=-1)` into gate and up, SiLU(gate) * up, `down_proj`; RMSNorm; untied LM
head; SDPA attention. 2 layers, hidden 128, MLP 256, vocab 384.
"""

import torch
from transformers import Phi3Config, Phi3ForCausalLM

CONFIG = dict(
    vocab_size=384,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
    original_max_position_embeddings=256,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Phi3ForCausalLM(Phi3Config(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}  # no DynamicCache objects in the graph

"""Corpus: Hugging Face DeepSeek-V3 (`DeepseekV3ForCausalLM`), built from a DeepseekV3Config (random
weights, no download), its layers dense (`first_k_dense_replace` = the layer count; the mixture of
experts is tests/models/hf_deepseek_v3.py's).

Imitates: DeepSeek-V2 / V3 checkpoints' multi-head latent attention. Constructs: queries through a
low-rank pair (`q_a_proj` to rank 48, `q_a_layernorm`, `q_b_proj` to every head's 16 no-RoPE + 8 RoPE
dims); keys and values from one compressed latent (`kv_a_proj_with_mqa` to rank 32 plus one RoPE key
of 8 dims shared by the heads, `kv_a_layernorm`, `kv_b_proj` up to every head's no-RoPE key and value
of 16), each head's key built in `expand_kv` from its own part and the shared RoPE part broadcast to
the heads; interleaved RoPE; 8 heads; RMSNorm, SwiGLU MLP of 256, untied LM head, SDPA attention. 2
layers, hidden 128, vocab 320.
"""

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

CONFIG = dict(
    vocab_size=320,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    first_k_dense_replace=2,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    head_dim=8,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(DeepseekV3Config(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}  # no DynamicCache objects in the graph

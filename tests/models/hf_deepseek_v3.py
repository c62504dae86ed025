"""Test model: a tiny Hugging Face DeepSeek-V3 (`DeepseekV3ForCausalLM` from a config, random weights).

Multi-head latent attention: queries through a low-rank pair (`q_a_proj`, `q_a_layernorm`, `q_b_proj`),
keys and values from one compressed latent (`kv_a_proj_with_mqa` to kv_lora_rank + a shared RoPE key,
`kv_a_layernorm`, `kv_b_proj` up to every head's no-RoPE key and value); transformers builds each head's
key in `expand_kv` as ``k = kv.new_empty(...)`` filled by two ``copy_`` into slices (its no-RoPE part and
the shared RoPE part broadcast to the heads). A mixture of experts in every layer (4 routed experts,
top-2 of a sigmoid router with a selection bias, group-limited, plus a shared expert). The pad token
(200) lies in the second half of the vocabulary: with the vocabulary split over 2 ranks its embedding
row is the second rank's, and its gradient must stay zero there. 2 layers, hidden 128, 8 heads.
"""

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

PAD = 200
CONFIG = dict(
    vocab_size=320,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=0,
    n_group=2,
    topk_group=1,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    head_dim=8,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    pad_token_id=PAD,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = DeepseekV3Config(**CONFIG, attn_implementation="sdpa", experts_implementation="batched_mm")
    return DeepseekV3ForCausalLM(config)


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g)
    ids[:, 0] = PAD  # a padded position in every sequence
    return (ids,)


def example_kwargs() -> dict:
    return {"use_cache": False}

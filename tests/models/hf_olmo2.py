"""Test model: Hugging Face OLMo-2 (`Olmo2ForCausalLM`, random weights from a config): its q_norm and k_norm
are RMSNorms over the whole query and key width (all heads at once), so an attention split by heads would
need the norm's mean over the other ranks' heads: the planner keeps the attention whole, and
`--layout megatron` (every attention by heads) is refused naming that op."""

import torch
from transformers import Olmo2Config, Olmo2ForCausalLM

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Olmo2ForCausalLM(Olmo2Config(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}  # no DynamicCache objects in the graph

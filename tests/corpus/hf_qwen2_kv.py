"""Corpus: `hf_qwen2.py`'s Qwen2 (Qwen2ForCausalLM) served through transformers' static-cache export wrapper.

The static-cache wrapper is `_static_cache.py`'s; configuration and constructs are `hf_qwen2.py`'s (see
there); random weights, no download.

    planner optimize tests/corpus/hf_qwen2_kv.py --cluster tests/models/fastlink.yaml --tp 2 --workload decode --context 32
"""

import hf_qwen2
import torch
from _static_cache import prompt_inputs, static_cache_lm

CONFIG = hf_qwen2.CONFIG


def build_model(max_batch_size: int = 1, max_seq_len: int = 64) -> torch.nn.Module:
    return static_cache_lm(hf_qwen2.build_model(), max_batch_size, max_seq_len)


def step_inputs(tokens: torch.Tensor, input_pos: torch.Tensor) -> tuple:
    """Forward's arguments for new tokens (B, T) at cache positions input_pos (T,)."""
    return (tokens, input_pos)


def example_inputs(batch_size: int = 1, seq_len: int = 16) -> tuple:
    return prompt_inputs(CONFIG["vocab_size"], batch_size, seq_len)

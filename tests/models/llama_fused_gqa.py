"""Test model file: the tiny cached Llama-3 (8 query heads, 4 KV heads) with fused GQA attention, as the
serving engines compute it: SDPA reads each K/V head once for its query heads (`enable_gqa`), the cache
is never repeated to the query heads (`models_kv.CachedAttention`, ``fused_gqa=True``).
"""

import dataclasses
import sys
from pathlib import Path

import torch

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

from models import LLAMA_CONFIGS, token_ids  # noqa: E402
from models_kv import CachedLlama  # noqa: E402

CONFIG = dataclasses.replace(LLAMA_CONFIGS["tiny"], n_layers=2)


def build_model(max_batch_size: int = 1, max_seq_len: int = 32) -> torch.nn.Module:
    return CachedLlama(CONFIG, max_batch_size, max_seq_len, fused_gqa=True)


def step_inputs(tokens: torch.Tensor, input_pos: torch.Tensor) -> tuple:
    return (tokens, input_pos)


def example_inputs(batch_size: int = 1, seq_len: int = 8) -> tuple:
    (tokens,) = token_ids(CONFIG.vocab_size, batch_size, seq_len)
    return step_inputs(tokens, torch.arange(seq_len))

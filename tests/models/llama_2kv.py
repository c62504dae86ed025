"""Test model file: the tiny cached Llama-3 with 8 query heads and only 2 KV heads (GQA), so that at
tp=4 each KV head serves two ranks (vLLM replicates KV heads when tensor_parallel_size > num KV heads).
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

CONFIG = dataclasses.replace(LLAMA_CONFIGS["tiny"], n_layers=2, n_kv_heads=2)


def build_model(max_batch_size: int = 1, max_seq_len: int = 32) -> torch.nn.Module:
    return CachedLlama(CONFIG, max_batch_size, max_seq_len)


def step_inputs(tokens: torch.Tensor, input_pos: torch.Tensor) -> tuple:
    return (tokens, input_pos)


def example_inputs(batch_size: int = 1, seq_len: int = 8) -> tuple:
    (tokens,) = token_ids(CONFIG.vocab_size, batch_size, seq_len)
    return step_inputs(tokens, torch.arange(seq_len))

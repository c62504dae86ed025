"""Llama-3 8B with a static KV cache (published config), built on the meta device: planned, never run.

Planned at batch 1 as gpt-fast measures it (bf16):

    planner optimize examples/llama3_8b_kv.py --cluster dgx-a100 --workload decode --context 5 \
        --new-tokens 200 --dtype bf16 --tp 2
"""

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # so that `models` imports when this file is loaded by path

from models import LLAMA_CONFIGS, token_ids  # noqa: E402
from models_kv import CachedLlama  # noqa: E402

CONFIG = LLAMA_CONFIGS["8b"]


def build_model(max_batch_size: int = 1, max_seq_len: int = 4096) -> torch.nn.Module:
    with torch.device("meta"):  # no weights allocated
        return CachedLlama(CONFIG, max_batch_size, max_seq_len).to(torch.bfloat16)


def step_inputs(tokens: torch.Tensor, input_pos: torch.Tensor) -> tuple:
    """Forward's arguments for new tokens (B, T) at positions input_pos (T,)."""
    return (tokens, input_pos)


def example_inputs(batch_size: int = 1, seq_len: int = 2048) -> tuple:
    (tokens,) = token_ids(CONFIG.vocab_size, batch_size, seq_len)
    return step_inputs(tokens, torch.arange(seq_len))

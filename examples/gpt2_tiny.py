"""A tiny GPT-2 for tests: 2 layers, hidden 64, 4 heads, vocab 256, same structure as GPT-2 124M."""

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # so that `models` imports when this file is loaded by path

from models import GPT, GPT_CONFIGS, token_ids  # noqa: E402

CONFIG = GPT_CONFIGS["tiny"]


def build_model() -> torch.nn.Module:
    return GPT(CONFIG)


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    return token_ids(CONFIG.vocab_size, batch_size, seq_len)

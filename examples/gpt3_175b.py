"""GPT-3 175B (96 layers, hidden 12288, 96 heads, context 2048), built on the meta device: planned, never run."""

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # so that `models` imports when this file is loaded by path

from models import GPT, GPT_CONFIGS, token_ids  # noqa: E402

CONFIG = GPT_CONFIGS["gpt3-175b"]


def build_model() -> torch.nn.Module:
    with torch.device("meta"):  # no weights allocated
        return GPT(CONFIG).to(torch.bfloat16)  # published checkpoints are bf16


def example_inputs(batch_size: int = 1, seq_len: int = 2048) -> tuple:
    return token_ids(CONFIG.vocab_size, batch_size, seq_len)

"""The 1,008B-parameter GPT of Narayanan et al. 2021 (128 layers, hidden 25600, 160 heads, vocabulary
51,200, sequence 2,048; see examples/models.py), built on the meta device: planned, never run."""

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # so that `models` imports when this file is loaded by path

from models import GPT, GPT_CONFIGS, token_ids  # noqa: E402

CONFIG = GPT_CONFIGS["megatron-1t"]


def build_model() -> torch.nn.Module:
    with torch.device("meta"):  # no weights allocated
        return GPT(CONFIG).to(torch.bfloat16)


def example_inputs(batch_size: int = 1, seq_len: int = 2048) -> tuple:
    return token_ids(CONFIG.vocab_size, batch_size, seq_len)

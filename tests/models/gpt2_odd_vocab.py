"""Test model file: the tiny GPT-2 with GPT-2's odd kind of vocabulary (257 tokens, prime), tied LM head."""

import dataclasses
import sys
from pathlib import Path

import torch

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

from models import GPT, GPT_CONFIGS, token_ids  # noqa: E402

CONFIG = dataclasses.replace(GPT_CONFIGS["tiny"], vocab_size=257)


def build_model() -> torch.nn.Module:
    return GPT(CONFIG)


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    return token_ids(CONFIG.vocab_size, batch_size, seq_len)

"""Test model file: tests/models/tiny_lm.py's tiny Llama (vocabulary 320, hidden 32, 4 layers) fed
seeded random tokens: every position differs, so a run that computes positions in the wrong order
(a sequence shard put back in the wrong place) gives other outputs. tiny_lm.py's all-zero tokens make
every position's output the same whatever the order."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_lm import CONFIG, SEQ_LEN  # noqa: E402
from tiny_lm import build_model as build_model  # noqa: E402


def example_inputs(batch_size: int = 2, seq_len: int = SEQ_LEN) -> tuple:
    generator = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG.vocab_size, (batch_size, seq_len), generator=generator),)

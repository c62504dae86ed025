"""Test model file: a tiny Llama language model (vocabulary 320, hidden 32, 4 layers) for the ladder
quality commands; its tokenizer is trained on the test's corpus (no TOKENIZER here)."""

import sys
from pathlib import Path

import torch

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

from models import Llama, LlamaConfig  # noqa: E402

CONFIG = LlamaConfig(vocab_size=320, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
SEQ_LEN = 16


def build_model() -> torch.nn.Module:
    return Llama(CONFIG)


def example_inputs(batch_size: int = 2, seq_len: int = SEQ_LEN) -> tuple:
    return (torch.zeros(batch_size, seq_len, dtype=torch.long),)

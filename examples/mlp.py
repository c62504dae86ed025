"""A plain MLP: Linear(64, 256)-GELU-Linear(256, 256)-GELU-Linear(256, 256)-GELU-Linear(256, 64)."""

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # so that `models` imports when this file is loaded by path

from models import MLP, MLPConfig  # noqa: E402

CONFIG = MLPConfig(in_features=64, hidden=256, out_features=64, n_hidden_layers=3)


def build_model() -> torch.nn.Module:
    return MLP(CONFIG)


def example_inputs(batch_size: int = 8, seq_len: int | None = None) -> tuple:
    """(batch_size, in_features), or (batch_size, seq_len, in_features) when seq_len is given."""
    shape = (batch_size, CONFIG.in_features) if seq_len is None else (batch_size, seq_len, CONFIG.in_features)
    return (torch.randn(shape, generator=torch.Generator().manual_seed(0)),)

"""Test model: tests/models/tiny_moe_modulelist.py with top-1 routing (Switch Transformer's, Fedus et
al. 2022): each token runs one of the 8 ModuleList experts, so the routing weights are (N, 1), as is
every expert's slice of them taken while the experts run."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import tiny_moe_modulelist  # noqa: E402


def build_model() -> torch.nn.Module:
    return tiny_moe_modulelist.build_model(top_k=1)


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    return tiny_moe_modulelist.example_inputs(batch_size, seq_len)

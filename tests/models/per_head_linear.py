"""Test model: tests/models/per_head_rmsnorm.py's decoder with each head of q and k through an
`nn.Linear(hd, hd)` of its own instead of a norm (split apart with `torch.split(x, 1, dim=1)`,
concatenated back): no rule splits it, so the TP pass keeps the attention whole."""

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # per_head_rmsnorm, loaded by path
import per_head_rmsnorm as base  # noqa: E402


def per_head_linear() -> nn.Module:
    return nn.Linear(base.HD, base.HD)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return base.Model(per_head_linear)


example_inputs = base.example_inputs

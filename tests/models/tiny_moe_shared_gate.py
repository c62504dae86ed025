"""Test model: tests/models/tiny_moe_modulelist.py with Qwen2-MoE's `shared_expert_gate`: the shared
expert's output scaled by a sigmoid of one logit per token (`SparseMoE(shared_gate=True)`)."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # so that the sibling model file imports when this one is loaded by path

import tiny_moe_modulelist  # noqa: E402
from tiny_moe_modulelist import example_inputs  # noqa: E402

__all__ = ["build_model", "example_inputs"]


def build_model():
    return tiny_moe_modulelist.build_model(shared_gate=True)

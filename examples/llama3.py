"""Llama-3, tiny by default (vocab 256, hidden 128, 4 layers, 8 heads, 4 KV heads, SwiGLU 256).

Real weights on the CPU: runnable. `build_model("8b")` allocates a published size's weights on the
current device; to plan one without weights use llama3_8b.py, llama3_70b.py or llama3_405b.py
(built on the meta device, planned but never run).
"""

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # so that `models` imports when this file is loaded by path

from models import LLAMA_CONFIGS, Llama, token_ids  # noqa: E402

SIZE = "tiny"  # a key of LLAMA_CONFIGS: "tiny", "8b", "70b", "405b" (Llama-3), "llama2-7b", "llama2-70b"


def build_model(size: str = SIZE) -> torch.nn.Module:
    return Llama(LLAMA_CONFIGS[size])


def example_inputs(batch_size: int = 2, seq_len: int = 32) -> tuple:
    return token_ids(LLAMA_CONFIGS[SIZE].vocab_size, batch_size, seq_len)

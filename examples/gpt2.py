"""GPT-2 124M (12 layers, hidden 768, 12 heads, vocab 50257, fused c_attn, tied LM head), runnable on a CPU.

Other sizes: `build_model("medium")`, "large", "xl" (see GPT_CONFIGS in examples/models.py); these
allocate their weights on the current device (`ModelFile.build("meta")` plans them without).
"""

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # so that `models` imports when this file is loaded by path

from models import GPT, GPT_CONFIGS, token_ids  # noqa: E402

SIZE = "124m"  # a key of GPT_CONFIGS: "tiny", "124m", "medium", "large", "xl", "gpt3-175b"


def build_model(size: str = SIZE) -> torch.nn.Module:
    return GPT(GPT_CONFIGS[size])


def example_inputs(batch_size: int = 1, seq_len: int = 64) -> tuple:
    return token_ids(GPT_CONFIGS[SIZE].vocab_size, batch_size, seq_len)

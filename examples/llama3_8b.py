"""Llama-3 8B (published config, see examples/models.py), built on the meta device: planned, never run.

Long context on one 8-GPU node (context parallelism: the search chooses the degree and the attention
variant, --cp / --cp-comm-type pin them; bench/long_context.py has 32k to 1M tokens):

    planner optimize examples/llama3_8b.py --cluster dgx-h100 --workload train --batch-size 2 \
        --seq-len 131072 --why
"""

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # so that `models` imports when this file is loaded by path

from models import LLAMA_CONFIGS, Llama, token_ids  # noqa: E402

CONFIG = LLAMA_CONFIGS["8b"]


def build_model() -> torch.nn.Module:
    with torch.device("meta"):  # no weights allocated
        return Llama(CONFIG).to(torch.bfloat16)  # published checkpoints are bf16


def example_inputs(batch_size: int = 1, seq_len: int = 2048) -> tuple:
    return token_ids(CONFIG.vocab_size, batch_size, seq_len)

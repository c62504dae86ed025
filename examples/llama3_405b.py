"""Llama-3 405B (published config, see examples/models.py), built on the meta device: planned, never run.

Long context (Llama 3's 131k-token stage: 16M tokens per step on 16,384 H100s, context parallelism;
the RoPE tables are computed for sequences beyond the config's max_seq_len, bench/long_context.py):

    planner optimize examples/llama3_405b.py --cluster h100-ib-2048node --workload train \
        --batch-size 128 --seq-len 131072 --why
"""

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # so that `models` imports when this file is loaded by path

from models import LLAMA_CONFIGS, Llama, token_ids  # noqa: E402

CONFIG = LLAMA_CONFIGS["405b"]


def build_model() -> torch.nn.Module:
    with torch.device("meta"):  # no weights allocated
        return Llama(CONFIG).to(torch.bfloat16)  # published checkpoints are bf16


def example_inputs(batch_size: int = 1, seq_len: int = 2048) -> tuple:
    return token_ids(CONFIG.vocab_size, batch_size, seq_len)

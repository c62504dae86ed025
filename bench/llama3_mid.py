"""Model file for the benchmarks: a mid-size Llama-3 (dim 1024, 8 layers, 16 heads, 8 KV heads, SwiGLU 2816,
vocab 8192), big enough that a forward at batch 1, seq 128 takes 0.2-0.7 s on one core of the 2-core VM
(~27 GFLOP), so compute dominates and timer noise does not. A model file as `planner optimize` reads it:

    planner optimize bench/llama3_mid.py --cluster local-cpu --nproc 2 --tp 2 --run
"""

import sys
from pathlib import Path

import torch

_EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)  # so that `models` imports when this file is loaded by path

from models import Llama, LlamaConfig, token_ids  # noqa: E402

CONFIG = LlamaConfig(
    vocab_size=8192, dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, ffn_dim=2816, max_seq_len=1024
)


def build_model() -> torch.nn.Module:
    return Llama(CONFIG)


def example_inputs(batch_size: int = 1, seq_len: int = 128) -> tuple:
    return token_ids(CONFIG.vocab_size, batch_size, seq_len)

"""Llama-3 with a static KV cache (gpt-fast style), tiny by default: runnable on this machine.

A serving model file (README, "Models with a KV cache"): `build_model(max_batch_size, max_seq_len)`
allocates the caches, `example_inputs(batch_size, seq_len)` is a prefill of `seq_len` tokens, and
`step_inputs(tokens, input_pos)` gives forward's arguments for any step (prefill or decode).

    planner optimize examples/llama3_kv.py --workload decode --context 64 --tp 2 --nproc 2 --run

Tiny: vocab 256, hidden 128, 4 layers, 8 heads, 4 KV heads, SwiGLU 256. `build_model(size="8b")`
allocates a published size's weights; to plan one without weights use llama3_70b_kv.py.
"""

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # so that `models` imports when this file is loaded by path

from models import LLAMA_CONFIGS, token_ids  # noqa: E402
from models_kv import CachedLlama  # noqa: E402

SIZE = "tiny"  # a key of LLAMA_CONFIGS: "tiny", "8b", "70b", "405b"


def build_model(max_batch_size: int = 2, max_seq_len: int = 64, size: str = SIZE) -> torch.nn.Module:
    return CachedLlama(LLAMA_CONFIGS[size], max_batch_size, max_seq_len)


def step_inputs(tokens: torch.Tensor, input_pos: torch.Tensor) -> tuple:
    """Forward's arguments for new tokens (B, T) at positions input_pos (T,)."""
    return (tokens, input_pos)


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    (tokens,) = token_ids(LLAMA_CONFIGS[SIZE].vocab_size, batch_size, seq_len)
    return step_inputs(tokens, torch.arange(seq_len))

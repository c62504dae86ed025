"""Llama-2 70B: grouped-query attention (64 heads, 8 KV heads) with a static KV cache, built on the meta device: planned, never run.

The published Llama-2 shapes (Touvron et al. 2023, "Llama 2: Open Foundation and Fine-Tuned Chat
Models", Table 1, and the model's Hugging Face config.json: 32,000-token vocabulary, RoPE base 10,000,
4,096-token context) on the same classes as the Llama-3 examples. bench/serving.py prices it against
TensorRT-LLM's and LMDeploy's published fp16 A100 measurements, e.g.

    planner optimize examples/llama2_70b_kv.py --cluster dgx-a100 --workload generate --seq-len 128 \
        --new-tokens 128 --batch-size 64 --dtype fp16 --tp 4
"""

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # so that `models` imports when this file is loaded by path

from models import LlamaConfig, token_ids  # noqa: E402
from models_kv import CachedLlama  # noqa: E402

CONFIG = LlamaConfig(
    vocab_size=32000,
    dim=8192,
    n_layers=80,
    n_heads=64,
    n_kv_heads=8,
    ffn_dim=28672,
    rope_theta=10000.0,
    max_seq_len=4096,
)


def build_model(max_batch_size: int = 1, max_seq_len: int = 4096) -> torch.nn.Module:
    with torch.device("meta"):  # no weights allocated
        return CachedLlama(CONFIG, max_batch_size, max_seq_len, fused_gqa=True).to(torch.float16)


def step_inputs(tokens: torch.Tensor, input_pos: torch.Tensor) -> tuple:
    """Forward's arguments for new tokens (B, T) at positions input_pos (T,)."""
    return (tokens, input_pos)


def example_inputs(batch_size: int = 1, seq_len: int = 2048) -> tuple:
    (tokens,) = token_ids(CONFIG.vocab_size, batch_size, seq_len)
    return step_inputs(tokens, torch.arange(seq_len))

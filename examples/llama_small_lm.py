"""A small Llama-style language model (2.0 M parameters) trained on the Python standard library's text.

Vocabulary 2048 (byte-level BPE, `llama_small_lm.tokenizer.json`), hidden 128, 8 layers, 8 heads of 16,
GQA with 2 KV heads, SwiGLU 384 (CONFIG). Pre-trained weights: `llama_small_lm.safetensors` next to this file,
made by `python bench/ladder_quality.py` (which also trains the tokenizer if it is missing); use them
with `--weights examples/llama_small_lm.safetensors`. Without weights the model is randomly initialised.
"""

import sys
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))  # so that `models` imports when this file is loaded by path

from models import Llama, LlamaConfig  # noqa: E402

CONFIG = LlamaConfig(
    vocab_size=2048,
    dim=128,
    n_layers=8,
    n_heads=8,
    n_kv_heads=2,
    ffn_dim=384,
    rope_theta=10000.0,
    max_seq_len=512,
)
SEQ_LEN = 128  # tokens per training block
TOKENIZER = str(_HERE / "llama_small_lm.tokenizer.json")  # read by `planner ladder-eval` / `adapt`
WEIGHTS = str(_HERE / "llama_small_lm.safetensors")


def build_model() -> torch.nn.Module:
    return Llama(CONFIG)


def example_inputs(batch_size: int = 2, seq_len: int = SEQ_LEN) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG.vocab_size, (batch_size, seq_len), generator=g),)

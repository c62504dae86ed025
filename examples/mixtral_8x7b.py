"""Mixtral-8x7B (Jiang et al. 2024, "Mixtral of Experts", Table 1; the model's Hugging Face config.json),
built on the meta device: planned, never run.

32 layers, hidden 4096, grouped-query attention 32 / 8 heads of 128, 8 SwiGLU experts of width 14336
per layer, each token routed to the top 2 (softmax over the 8 logits, the two weights renormalised),
vocabulary 32000, RoPE base 1e6; 46.7B parameters, 12.9B active per token. The experts are written as
gpt-fast writes Mixtral (`models_moe`: stacked w1 / w2 / w3 indexed by the chosen ids). Trained on 64
H100s (8 nodes) with 1M-token batches, expert parallelism priced against the other layouts:

    planner optimize examples/mixtral_8x7b.py --cluster h100-ib-128node --devices 64 --workload train \
        --batch-size 256 --seq-len 4096 --why
"""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # so that `models_moe` imports when this file is loaded by path

from models_moe import MoEConfig, training_model_file  # noqa: E402

CONFIG = MoEConfig(
    vocab_size=32000,
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    num_experts=8,
    top_k=2,
    expert_dim=14336,
    rope_theta=1e6,
    max_seq_len=32768,
)
build_model, example_inputs = training_model_file(CONFIG)

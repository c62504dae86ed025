"""Qwen3-30B-A3B served with a static KV cache (Qwen3 Technical Report, Yang et al. 2025, Table 2; the
model's Hugging Face config.json), built on the meta device: planned, never run.

48 layers, hidden 2048, grouped-query attention of 32 query / 4 KV heads of head dim 128 (q: 2048 ->
4096), 128 routed SwiGLU experts of width 768 per layer, each token routed to 8 (softmax over the 128
logits, the 8 weights renormalised), no shared expert, vocabulary 151936, untied LM head, RoPE base
1e6; 30.5B parameters, 3.3B active per token. Approximated: Qwen3's per-head RMSNorm of q and k
(`q_norm`, `k_norm`: 256 parameters a layer, a norm over 128 elements per head) is left out.

Served on one 8-GPU H100 node: a batch of 32 requests of 2048-token prompts, 512 tokens generated
each (the serving contract of `models_kv`: `build_model(max_batch_size, max_seq_len)`, `step_inputs`),
expert parallelism over the TP ranks (vLLM's --enable-expert-parallel) priced against the others:

    planner optimize examples/qwen3_30b_a3b.py --cluster dgx-h100 --workload generate --batch-size 32 \
        --seq-len 2048 --new-tokens 512 --why
"""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # so that `models_moe` imports when this file is loaded by path

from models_kv import step_inputs  # noqa: E402, F401 - step_inputs: the serving model file API
from models_moe import MoEConfig, serving_model_file  # noqa: E402

CONFIG = MoEConfig(
    vocab_size=151936,
    dim=2048,
    n_layers=48,
    n_heads=32,
    n_kv_heads=4,
    head_dim=128,
    num_experts=128,
    top_k=8,
    expert_dim=768,
    norm_eps=1e-6,
    rope_theta=1e6,
    max_seq_len=40960,  # config.json's max_position_embeddings
)
# no weights allocated (meta), bf16; caches for 4096 tokens, a 2048-token prompt by default
build_model, example_inputs = serving_model_file(CONFIG, max_seq_len=4096, prompt_len=2048)

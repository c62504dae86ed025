"""Llama-4-Scout-17B-16E's text model as Hugging Face transformers builds it (`Llama4ForCausalLM`, the
model card's config.json: 48 layers, hidden 5120, 40 query / 8 KV heads of 128, every layer a mixture of
16 SwiGLU experts of width 8192 with top-1 routing and one shared expert of width 8192, vocabulary
202048, untied LM head), built on the meta device: planned, never run. 107.8B parameters, 17.2B
active per token.

Llama 4 scales each token by its routing weight before the experts (`routed_in = hidden.repeat(E, 1) *
router_scores`) and, as written, runs all 16 experts on every token (the unchosen ones get zeros):
with expert parallelism or the experts split over TP the expert pass runs each token's chosen expert
only, its input rows scaled by the weight (`planner.frontend.moe.MoE.input_scale`); with the experts
whole the model's own code runs, 16x the expert FLOPs. Training on 64 H100s, 256 x 4,096 tokens a step:

    planner optimize examples/hf_llama4_scout.py --cluster h100-ib-128node --devices 64 --workload train \
        --batch-size 256 --seq-len 4096 --why
"""

import torch
from transformers import Llama4ForCausalLM, Llama4TextConfig

CONFIG = dict(
    vocab_size=202048,
    hidden_size=5120,
    intermediate_size=8192,
    intermediate_size_mlp=16384,
    num_hidden_layers=48,
    num_attention_heads=40,
    num_key_value_heads=8,
    head_dim=128,
    num_local_experts=16,
    num_experts_per_tok=1,
    interleave_moe_layer_step=1,
    max_position_embeddings=10485760,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def build_model() -> torch.nn.Module:
    with torch.device("meta"):  # in bf16, the model card's torch_dtype
        return Llama4ForCausalLM(Llama4TextConfig(**CONFIG, attn_implementation="sdpa")).to(torch.bfloat16)


def example_inputs(batch_size: int = 1, seq_len: int = 4096) -> tuple:
    return (torch.zeros(batch_size, seq_len, dtype=torch.long),)


def example_kwargs() -> dict:
    return {"use_cache": False}

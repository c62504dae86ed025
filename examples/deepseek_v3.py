"""A DeepSeek-V3-sized mixture of experts (Liu et al. 2024, "DeepSeek-V3 Technical Report", section 4.2
and Table 1; the model's Hugging Face config.json), built on the meta device: planned, never run.

Kept as published: 61 layers, the first 3 dense (SwiGLU of width 18432, `first_k_dense_replace`), the
other 58 with 256 routed experts of width 2048 and 1 shared expert (width 2048), each token routed to
8 experts by sigmoid scores with a per-expert selection bias (auxiliary-loss-free balancing), limited
to the experts of its best 4 of 8 groups, the 8 weights renormalised and scaled by 2.5; hidden 7168,
vocabulary 129280, RMSNorm, RoPE.

Multi-head latent attention as published (section 2.1 of the V2 report, Table 1 of V3's): q through a
low-rank pair (7168 -> 1536 -> 128 heads of 128 + 64 RoPE dims), k and v from one latent of 512 plus
one RoPE key of 64 shared by the heads (up to 128 heads of 128 + 128), in its training form (no
absorbed weights). 671B parameters, 37B active per token.

Approximated (what the planner prices instead):
- The multi-token-prediction module (one more layer, section 2.2) is left out.
- Expert weights are bf16 (DeepSeek-V3 trained its GEMMs in FP8).

Trained on 1,024 H100s (128 nodes) with 4k-token sequences and a 15.7M-token batch (3840 sequences,
the report's final batch size, section 4.2):

    planner optimize examples/deepseek_v3.py --cluster h100-ib-128node --workload train \
        --batch-size 3840 --seq-len 4096 --why
"""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # so that `models_moe` imports when this file is loaded by path

from models_moe import MoEConfig, training_model_file  # noqa: E402

CONFIG = MoEConfig(
    vocab_size=129280,
    dim=7168,
    n_layers=61,
    n_heads=128,
    n_kv_heads=128,
    head_dim=128,  # per head, q and k without RoPE (qk_nope_head_dim)
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_experts=256,
    top_k=8,
    expert_dim=2048,
    shared_dim=2048,
    dense_layers=3,
    dense_ffn_dim=18432,
    score_func="sigmoid",
    expert_bias=True,
    groups=8,
    topk_groups=4,
    routed_scale=2.5,
    norm_eps=1e-6,
    rope_theta=10000.0,
    max_seq_len=4096,
)
build_model, example_inputs = training_model_file(CONFIG)

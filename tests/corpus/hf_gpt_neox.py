"""Corpus: Hugging Face GPT-NeoX (`GPTNeoXForCausalLM`), built from a GPTNeoXConfig (random weights, no download).

Imitates: Pythia / GPT-NeoX-20B. Constructs: ONE fused `query_key_value` Linear (with bias) whose output
is viewed per head as (B, T, heads, 3 * head_dim) and `.chunk(3, dim=-1)` (q/k/v interleaved per
head, not [q | k | v]), partial rotary embeddings (rotary_pct 0.25: RoPE on the first quarter of each
head, `torch.cat` with the pass-through rest), `dense` output projection; parallel residual
(x + attn(ln1(x)) + mlp(ln2(x))); LayerNorm; GELU MLP `dense_h_to_4h` / `dense_4h_to_h`; untied
`embed_out` LM head; SDPA attention. 2 layers, hidden 128, 4 heads, MLP 512, vocab 512.
"""

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    rotary_pct=0.25,
    max_position_embeddings=256,
    use_parallel_residual=True,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(GPTNeoXConfig(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)


def example_kwargs() -> dict:
    return {"use_cache": False}  # no cache objects in the graph

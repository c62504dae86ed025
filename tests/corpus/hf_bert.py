"""Corpus: Hugging Face BERT (`BertForMaskedLM`), built from a BertConfig (random weights, no download).

Imitates: bert-base-uncased used as an encoder. Constructs: bidirectional self-attention (no causal
mask) with a padding `attention_mask` input (B, T) expanded by transformers into an additive SDPA
mask, separate query/key/value/output dense layers WITH bias, word + learned position + token-type
embeddings, post-LN residual blocks (LayerNorm after each add), GELU MLP `intermediate` / `output`,
the MLM head's transform (dense + GELU + LayerNorm) and a decoder tied to the word embedding, dropout 0.
2 layers, hidden 128, 4 heads, MLP 512, vocab 512.
"""

import torch
from transformers import BertConfig, BertForMaskedLM

CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    pad_token_id=0,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    """(input_ids (B, T), attention_mask (B, T)): every odd sequence has its last quarter padded."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, CONFIG["vocab_size"], (batch_size, seq_len), generator=g)
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    mask[1::2, seq_len - seq_len // 4 :] = 0
    ids[mask == 0] = CONFIG["pad_token_id"]
    return (ids, mask)

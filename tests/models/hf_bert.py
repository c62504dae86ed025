"""Test model: a tiny Hugging Face BERT (`BertForMaskedLM` from a config, random weights, dropout 0):
bidirectional attention, whose traced graph carries an explicit mask that lets every query see every
key (no padding), 2 layers, hidden 64, 4 heads."""

import torch
from transformers import BertConfig, BertForMaskedLM

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    max_position_embeddings=128,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(**CONFIG, attn_implementation="sdpa"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g),)

"""Test model: a tiny Hugging Face ViTModel (random weights): patch-embedding conv, class token,
2 transformer blocks of hidden 64, 4 heads; 32x32 images in 8x8 patches (16 patches + the class token)."""

import torch
from transformers import ViTConfig, ViTModel

CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    image_size=32,
    patch_size=8,
    num_channels=3,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return ViTModel(ViTConfig(**CONFIG, attn_implementation="sdpa"), add_pooling_layer=False)


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, 32, 32, generator=g),)

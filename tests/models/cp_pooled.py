"""Test model file: the tiny Llama of tiny_lm_tokens.py whose output is also pooled over the sequence (a
mean over the tokens, as a classifier head would take): an op that needs every token of a sequence, which
context parallelism must gather whole (a recorded, priced fallback) and still compute exactly."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_lm import CONFIG  # noqa: E402
from tiny_lm import build_model as build_llama  # noqa: E402
from tiny_lm_tokens import example_inputs as example_inputs  # noqa: E402


class Pooled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.llama = build_llama()
        self.mix = torch.nn.Linear(CONFIG.vocab_size, CONFIG.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.llama(tokens)  # (B, T, V)
        pooled = logits.mean(dim=1, keepdim=True)  # (B, 1, V): every token of the sequence
        return logits + self.mix(pooled)


def build_model() -> torch.nn.Module:
    return Pooled()

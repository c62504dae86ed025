"""Test model: a tiny pre-LN GPT (learned positions, biases, GELU MLP) whose parameters a fine-tune
freezes (requires_grad=False) in one of several ways, `build_model(freeze=...)`:

- "none": everything trained;
- "layer0": the first block frozen (its input still needs a gradient: the embeddings train);
- "emb": the token and position embeddings frozen;
- "probe": everything but the LM head frozen (a linear probe: no gradient reaches any block);
- "bottom": the embeddings and the first two blocks frozen (no backward through them);
- "lora": every base weight frozen, with trainable rank-4 LoRA adapters (Hu et al. 2021, "LoRA:
  Low-Rank Adaptation of Large Language Models") beside each block's four projections (qkv and fc
  column-parallel under Megatron's layout, proj and out row-parallel);
- "all": nothing trainable.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

D, V, H, T, LAYERS, RANK = 32, 128, 4, 64, 4, 4
FREEZES = ("none", "layer0", "emb", "probe", "bottom", "lora", "all")


class LoRALinear(nn.Module):
    """A frozen linear plus a trainable low-rank update: base(x) + up(down(x)) * scale."""

    def __init__(self, d_in: int, d_out: int, rank: int = RANK) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=False)
        nn.init.normal_(self.up.weight, std=0.02)  # not zero: the adapters' gradients are checked
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x)) * 2.0


class Block(nn.Module):
    def __init__(self, lora: bool, rank: int = RANK) -> None:
        super().__init__()
        linear = (lambda d_in, d_out: LoRALinear(d_in, d_out, rank)) if lora else nn.Linear
        self.ln1 = nn.LayerNorm(D)
        self.qkv = linear(D, 3 * D)
        self.proj = linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc = linear(D, 4 * D)
        self.out = linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, -1)
        q, k, v = (t.view(B, L, H, C // H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class FrozenGPT(nn.Module):
    def __init__(self, freeze: str, layers: int = LAYERS, rank: int = RANK) -> None:
        super().__init__()
        if freeze not in FREEZES:
            raise ValueError(f"freeze {freeze!r} is not one of {FREEZES}")
        self.wte = nn.Embedding(V, D)
        self.wpe = nn.Embedding(T, D)
        self.h = nn.ModuleList([Block(lora=freeze == "lora", rank=rank) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        if freeze == "layer0":
            self.h[0].requires_grad_(False)
        elif freeze == "emb":
            self.wte.requires_grad_(False)
            self.wpe.requires_grad_(False)
        elif freeze in ("probe", "all"):
            self.requires_grad_(False)
            self.lm_head.requires_grad_(freeze == "probe")
        elif freeze == "bottom":
            for module in (self.wte, self.wpe, self.h[0], self.h[1]):
                module.requires_grad_(False)
        elif freeze == "lora":
            for name, p in self.named_parameters():
                p.requires_grad_(".down." in name or ".up." in name)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(freeze: str = "layer0", layers: int = LAYERS, rank: int = RANK) -> nn.Module:
    torch.manual_seed(0)
    return FrozenGPT(freeze, layers, rank)


def example_inputs(batch_size: int = 4, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, V, (batch_size, seq_len), generator=g),)


def write_model_file(path: Path, freeze: str) -> Path:
    """A model file at ``path`` whose build_model() (no argument, as the CLI calls it) builds this model
    frozen as ``freeze``; returns ``path``."""
    path.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "import frozen_gpt\n\n\n"
        f"def build_model():\n    return frozen_gpt.build_model({freeze!r})\n\n\n"
        "example_inputs = frozen_gpt.example_inputs\n"
    )
    return path

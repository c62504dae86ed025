"""Test model: a tiny Llama whose feed-forward is a mixture of experts written as gpt-fast writes it
(pytorch-labs/gpt-fast `mixtral-moe/model.py`, `MOEFeedForward` and `ConditionalFeedForward`): the
experts' weights stacked in three parameters (E, I, C), (E, C, I), (E, I, C), indexed by each token's
top-k expert ids and applied with `torch.einsum` (`aten.einsum` in the captured graph), the k outputs
combined by an einsum with the routing weights.

4 experts, top-2, hidden 32, expert width 48, 2 layers, 4 heads (2 KV heads). `MoEOptions` switches the
router to DeepSeek-V3's (Liu et al. 2024, "DeepSeek-V3 Technical Report", section 2.1.2; the model's
`modeling_deepseek.py` `MoEGate`): sigmoid scores, a per-expert bias added for the choice only
(`expert_bias`), and group-limited routing (the experts in `groups` groups, each token choosing among
the experts of its `topk_groups` best groups, ranked by the sum of each group's best two scores).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

from models import LlamaAttention, LlamaConfig, RMSNorm, _init_weights, _rope_tables  # noqa: E402

CONFIG = LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64)


@dataclass
class MoEOptions:
    num_experts: int = 4
    top_k: int = 2
    score_func: str = "softmax"  # "softmax" (Mixtral) | "sigmoid" (DeepSeek-V3)
    expert_bias: bool = False  # DeepSeek-V3's balancing bias, added to the scores for the choice only
    groups: int = 1  # group-limited routing: expert groups (1: none)
    topk_groups: int = 1  # groups each token may choose its experts from
    renormalise: bool = (
        True  # the k chosen weights divided by their sum (False: Qwen-MoE's norm_topk_prob=False)
    )


class ConditionalFeedForward(nn.Module):
    """The E SwiGLU experts as stacked weights: w1 (gate) and w3 (up) (E, I, C), w2 (down) (E, C, I)."""

    def __init__(self, num_experts: int, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, ffn_dim, dim) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, ffn_dim) * ffn_dim**-0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, ffn_dim, dim) * dim**-0.5)

    def forward(self, x: torch.Tensor, expert_indices: torch.Tensor) -> torch.Tensor:
        """x (N, C), expert_indices (N, k) -> each token's k expert outputs (N, k, C)."""
        w1 = self.w1[expert_indices]  # (N, k, I, C)
        w3 = self.w3[expert_indices]  # (N, k, I, C)
        w2 = self.w2[expert_indices]  # (N, k, C, I)
        x1 = F.silu(torch.einsum("ti,taoi->tao", x, w1))  # (N, k, I)
        x3 = torch.einsum("ti,taoi->tao", x, w3)  # (N, k, I)
        return torch.einsum("tao,taio->tai", x1 * x3, w2)  # (N, k, C)


class MOEFeedForward(nn.Module):
    """Router (a linear to E logits, softmax or sigmoid, top-k) and the stacked experts."""

    def __init__(self, config: LlamaConfig, options: MoEOptions) -> None:
        super().__init__()
        self.options = options
        self.gate = nn.Linear(config.dim, options.num_experts, bias=False)
        self.cond_ffn = ConditionalFeedForward(options.num_experts, config.dim, config.ffn_dim)
        if options.expert_bias:
            self.expert_bias = nn.Parameter(torch.zeros(options.num_experts))

    def route(self, scores: torch.Tensor) -> torch.Tensor:
        """scores (N, E) -> the top-k expert ids (N, k), with the bias and the group limit if set."""
        o = self.options
        choice = scores + self.expert_bias if o.expert_bias else scores  # (N, E)
        if o.groups > 1:
            n = choice.shape[0]
            grouped = choice.view(n, o.groups, -1)  # (N, G, E / G)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
            best = group_scores.topk(o.topk_groups, dim=-1).indices  # (N, topk_groups)
            allowed = torch.zeros_like(group_scores).scatter(1, best, 1.0)  # (N, G)
            allowed = allowed.unsqueeze(-1).expand_as(grouped).reshape(n, -1)  # (N, E)
            choice = choice.masked_fill(allowed == 0, float("-inf"))
        return torch.topk(choice, o.top_k, dim=-1).indices  # (N, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        x = x.view(-1, C)  # (N, C), N = B * T tokens
        logits = self.gate(x)  # (N, E)
        scores = logits.softmax(-1) if self.options.score_func == "softmax" else logits.sigmoid()
        expert_indices = self.route(scores)  # (N, k)
        expert_weights = scores.gather(1, expert_indices)  # (N, k)
        if self.options.renormalise:
            expert_weights = expert_weights / expert_weights.sum(dim=-1, keepdim=True)  # (N, k)
        expert_outs = self.cond_ffn(x, expert_indices)  # (N, k, C)
        return torch.einsum("tai,ta->ti", expert_outs, expert_weights).view(B, T, C)


class MoEBlock(nn.Module):
    def __init__(self, config: LlamaConfig, options: MoEOptions) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = LlamaAttention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.block_sparse_moe = MOEFeedForward(config, options)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.block_sparse_moe(self.ffn_norm(x))


class MoETransformer(nn.Module):
    def __init__(self, config: LlamaConfig, options: MoEOptions) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([MoEBlock(config, options) for _ in range(config.n_layers)])
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = _rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hd)
        self.register_buffer("rope_sin", sin, persistent=False)  # (max_seq_len, hd)
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab_size)."""
        T = tokens.shape[1]
        cos = self.rope_cos[None, :T, None, :]  # (1, T, 1, hd)
        sin = self.rope_sin[None, :T, None, :]  # (1, T, 1, hd)
        h = self.tok_embeddings(tokens)  # (B, T, C)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def build_model(options: MoEOptions | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    return MoETransformer(CONFIG, options or MoEOptions())


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG.vocab_size, (batch_size, seq_len), generator=g),)

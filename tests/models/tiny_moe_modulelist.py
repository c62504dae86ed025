"""Test model: a tiny Llama whose feed-forward is a mixture of experts held as a ModuleList of SwiGLU
MLPs (as Hugging Face Qwen2-MoE and DeepSeek-V2 hold them, `mlp.experts.3.gate_proj`), with one shared
expert every token runs, added to the routed output (Qwen2-MoE's `shared_expert`, DeepSeek's
`shared_experts`).

8 experts, top-2 softmax routing by a linear router (`mlp.gate`), hidden 32, expert width 24, shared
expert width 48, 2 layers, 4 heads (2 KV heads).

The dispatch has static shapes, so that torch.export captures it: each expert takes a fixed capacity
of C = ceil(capacity_factor * N * k / E) token slots (GShard, Lepikhin et al. 2020, section 2.2;
fairseq `fairseq/modules/moe/top2gate.py`), a token's slot in an expert being its running count of
the tokens that chose it (a cumsum of the one-hot choices); tokens past the capacity are dropped by
that expert. Each expert gathers its slots' rows (an empty slot reads a zero row), runs, and its
outputs, times their routing weights, are added back at their tokens with `index_add`.

The capacity factor is E / k by default (C = N: no token is ever dropped, so the model is dropless
and its batch can be split); the environment variable TINY_MOE_CAPACITY_FACTOR, read when the model
is built, sets another. Below E / k tokens can be dropped, and which ones depends on the N tokens
counted: splitting the batch changes them, and the planner keeps it whole
(`planner.frontend.analysis._token_capacity`).

`dispatch="nonzero"` writes the same dispatch the way that cannot be captured: each expert's tokens
found with `torch.nonzero` (a number known only at run time), as Hugging Face's eager expert loop
does; the planner refuses it with one line naming the construct.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

from models import LlamaAttention, LlamaConfig, RMSNorm, _init_weights, _rope_tables  # noqa: E402

CONFIG = LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64)
NUM_EXPERTS = 8
TOP_K = 2
EXPERT_DIM = 24  # each routed expert's SwiGLU width (the shared expert has CONFIG.ffn_dim)
DROPLESS_CAPACITY_FACTOR = NUM_EXPERTS / TOP_K  # C = N slots per expert at top-k 2: nothing dropped


def capacity_factor(top_k: int = TOP_K) -> float:
    """Slots per expert over an even share of the N * k choices: TINY_MOE_CAPACITY_FACTOR, else E / k."""
    return float(os.environ.get("TINY_MOE_CAPACITY_FACTOR", NUM_EXPERTS / top_k))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), Hugging Face's names; `act` another gate activation (GeGLU: gelu)."""

    def __init__(self, dim: int, hidden: int, act=F.silu, bias: bool = False, scale: float = 1.0) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act = act
        self.scale = scale  # 1.0: no op; another number scales the output (a model-specific expert)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return out if self.scale == 1.0 else out * self.scale


def expert_activation():
    """The routed experts' gate activation: TINY_MOE_EXPERT_ACT=gelu (GeGLU experts), else SiLU."""
    return F.gelu if os.environ.get("TINY_MOE_EXPERT_ACT") == "gelu" else F.silu


class SparseMoE(nn.Module):
    """Router `gate`, routed `experts` (a ModuleList), `shared_expert`."""

    def __init__(
        self,
        config: LlamaConfig,
        dispatch: str = "capacity",
        top_k: int = TOP_K,
        shared_gate: bool = False,
        **expert: object,
    ) -> None:
        super().__init__()
        self.dispatch, self.top_k = dispatch, top_k
        self.capacity_factor = capacity_factor(top_k)
        self.gate = nn.Linear(config.dim, NUM_EXPERTS, bias=False)
        act = expert_activation()
        self.experts = nn.ModuleList(
            [SwiGLU(config.dim, EXPERT_DIM, act, **expert) for _ in range(NUM_EXPERTS)]
        )
        self.shared_expert = SwiGLU(config.dim, config.ffn_dim)
        # Qwen2-MoE's shared_expert_gate: the shared expert's output scaled by a sigmoid of one logit per token
        self.shared_expert_gate = nn.Linear(config.dim, 1, bias=False) if shared_gate else None

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared_expert(x)
        return out if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        x = x.view(-1, C)  # (N, C), N = B * T tokens
        probs = F.softmax(self.gate(x), dim=-1)  # (N, E)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # (N, k) each
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.dispatch in ("capacity", "capacity_inplace"):
            routed = self._capacity(x, weights, chosen, inplace=self.dispatch == "capacity_inplace")
        else:
            routed = self._nonzero(x, weights, chosen)
        return (routed + self.shared(x)).view(B, T, C)

    def _capacity(
        self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, inplace: bool = False
    ) -> torch.Tensor:
        """x (N, C), weights and chosen (N, k) -> the routed output (N, C), static shapes throughout;
        `inplace`: accumulated with `out.index_add_` (Hugging Face's MoE blocks before transformers 5)."""
        n = x.shape[0]
        capacity = math.ceil(self.capacity_factor * n * self.top_k / NUM_EXPERTS)
        picks = F.one_hot(chosen, NUM_EXPERTS).sum(1)  # (N, E): 1 where the token chose the expert
        slot = torch.cumsum(picks, dim=0) - 1  # (N, E): the token's place in each expert's queue
        kept = (picks > 0) & (slot < capacity)  # (N, E)
        combine = torch.zeros_like(picks, dtype=x.dtype).scatter(1, chosen, weights) * kept  # (N, E)
        dest = torch.where(kept, slot, capacity).t()  # (E, N): slot of each token, `capacity` = dropped
        tokens = torch.arange(n, device=x.device).expand(NUM_EXPERTS, n)  # (E, N)
        slots = torch.full((NUM_EXPERTS, capacity + 1), n, device=x.device).scatter(1, dest, tokens)
        slots = slots[:, :capacity]  # (E, C): the token in each slot, n for an empty one
        x_pad = torch.cat([x, x.new_zeros(1, x.shape[1])])  # (N + 1, C): row n is zero
        combine_pad = torch.cat([combine, combine.new_zeros(1, NUM_EXPERTS)])  # (N + 1, E)
        out = x.new_zeros(n + 1, x.shape[1])  # (N + 1, C)
        for e, expert in enumerate(self.experts):
            idx = slots[e]  # (C,)
            y = expert(x_pad[idx]) * combine_pad[idx, e].unsqueeze(-1)  # (C, C_model)
            if inplace:
                out.index_add_(0, idx, y)
            else:
                out = out.index_add(0, idx, y)
        return out[:n]

    def _nonzero(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The same without a capacity: each expert's tokens by `torch.nonzero` (data-dependent count)."""
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, k = torch.nonzero(chosen == e, as_tuple=True)  # (n_e,) each
            y = expert(x[token]) * weights[token, k].unsqueeze(-1)  # (n_e, C)
            out = out.index_add(0, token, y)
        return out


class MoEBlock(nn.Module):
    def __init__(self, config: LlamaConfig, dispatch: str, **moe: object) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = SparseMoE(config, dispatch, **moe)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class MoETransformer(nn.Module):
    def __init__(self, config: LlamaConfig, dispatch: str, **moe: object) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([MoEBlock(config, dispatch, **moe) for _ in range(config.n_layers)])
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = _rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hd)
        self.register_buffer("rope_sin", sin, persistent=False)  # (max_seq_len, hd)
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab_size)."""
        T = tokens.shape[1]
        cos = self.rope_cos[None, :T, None, :]  # (1, T, 1, hd)
        sin = self.rope_sin[None, :T, None, :]  # (1, T, 1, hd)
        h = self.embed_tokens(tokens)  # (B, T, C)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h))


def build_model(dispatch: str = "capacity", **moe: object) -> torch.nn.Module:
    """The model; `moe`: SparseMoE's top_k (default TOP_K) and its experts' bias and scale."""
    torch.manual_seed(0)
    return MoETransformer(CONFIG, dispatch, **moe)


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG.vocab_size, (batch_size, seq_len), generator=g),)

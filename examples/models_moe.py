"""Mixture-of-experts decoders (Mixtral, DeepSeek-V3, Qwen3-MoE), written as gpt-fast writes its MoE.

The routed experts' weights are stacked in three parameters, w1 (gate) and w3 (up) (E, I, C) and w2
(down) (E, C, I), indexed by each token's top-k expert ids and applied by `torch.einsum`
(pytorch-labs/gpt-fast `mixtral-moe/model.py`, `ConditionalFeedForward` and `MOEFeedForward`), which
the planner's front end recognises (`planner.frontend.moe`). The router is a linear to E logits,
softmax (Mixtral, Qwen3-MoE) or sigmoid scores (DeepSeek-V3, with its per-expert selection bias and
group-limited routing: the experts in `groups` groups, each token choosing among the experts of its
`topk_groups` best groups, ranked by the sum of each group's best two scores; Liu et al. 2024,
"DeepSeek-V3 Technical Report", section 2.1.2). Shared experts are one SwiGLU every token runs,
summed with the routed output. The first `dense_layers` layers may have a dense SwiGLU instead
(DeepSeek-V3's `first_k_dense_replace`).

Attention is grouped-query attention with RoPE and its own head dimension (Qwen3's 128 with a
2048-wide stream), or DeepSeek's multi-head latent attention (`MLAttention`, training form); `CachedMoETransformer` is the served form with a static KV cache per layer, as
`models_kv.CachedLlama` (the serving contract: `build_model(max_batch_size, max_seq_len)`,
`example_inputs`, `step_inputs`).

These models are built on the meta device for planning; their forward is the math of the published
models as far as each file's docstring says (what each approximates is listed there).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from models import LlamaAttention, RMSNorm, _init_weights, apply_rope, token_ids
from models_kv import KVCache
from torch import nn


@dataclass
class MoEConfig:
    vocab_size: int
    dim: int  # hidden size C
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # per head: n_heads x head_dim need not be dim (Qwen3: 32 x 128 over 2048)
    num_experts: int  # routed experts E
    top_k: int  # experts each token runs
    expert_dim: int  # one routed expert's SwiGLU width I
    shared_dim: int = 0  # the shared experts' SwiGLU width, all of them as one (0: none)
    dense_layers: int = 0  # the first layers have a dense SwiGLU of dense_ffn_dim instead
    dense_ffn_dim: int = 0
    score_func: str = "softmax"  # "softmax" (Mixtral, Qwen3-MoE) | "sigmoid" (DeepSeek-V3)
    expert_bias: bool = False  # DeepSeek-V3's balancing bias, added to the scores for the choice only
    groups: int = 1  # group-limited routing: expert groups (1: none)
    topk_groups: int = 1  # groups each token may choose its experts from
    routed_scale: float = 1.0  # the routed output's scale (DeepSeek-V3's routed_scaling_factor)
    norm_eps: float = 1e-5
    rope_theta: float = 1e6
    max_seq_len: int = 4096  # length of the precomputed RoPE tables
    # multi-head latent attention (DeepSeek-V2 / V3; `kv_lora_rank` 0: grouped-query attention instead):
    # q through a low-rank pair (`q_lora_rank`), k and v from one compressed latent of `kv_lora_rank`
    # plus a RoPE key of `qk_rope_head_dim` shared by the heads; per head, q and k hold `head_dim` dims
    # without RoPE and `qk_rope_head_dim` with it, v holds `v_head_dim`
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0


def rope_tables(head_dim: int, theta: float, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (length, head_dim), rotate-half layout."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.float32)
    inv_freq = 1.0 / (theta ** (steps / head_dim))  # (hd/2,)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # (S, hd/2)
    emb = torch.cat((angles, angles), dim=-1)  # (S, hd)
    return emb.cos(), emb.sin()


class SwiGLU(nn.Module):
    """w2(silu(w1(x)) * w3(x)): a dense MLP or the shared experts."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ConditionalFeedForward(nn.Module):
    """The E SwiGLU experts as stacked weights: w1 (gate) and w3 (up) (E, I, C), w2 (down) (E, C, I)."""

    def __init__(self, num_experts: int, dim: int, expert_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, expert_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, expert_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, expert_dim, dim))

    def forward(self, x: torch.Tensor, expert_indices: torch.Tensor) -> torch.Tensor:
        """x (N, C), expert_indices (N, k) -> each token's k expert outputs (N, k, C)."""
        w1 = self.w1[expert_indices]  # (N, k, I, C)
        w3 = self.w3[expert_indices]  # (N, k, I, C)
        w2 = self.w2[expert_indices]  # (N, k, C, I)
        x1 = F.silu(torch.einsum("ti,taoi->tao", x, w1))  # (N, k, I)
        x3 = torch.einsum("ti,taoi->tao", x, w3)  # (N, k, I)
        return torch.einsum("tao,taio->tai", x1 * x3, w2)  # (N, k, C)


class MoEFeedForward(nn.Module):
    """Router (a linear to E logits, softmax or sigmoid scores, top-k), the stacked routed experts and
    the shared experts (`MoEConfig.shared_dim`)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.gate = nn.Linear(config.dim, config.num_experts, bias=False)
        self.cond_ffn = ConditionalFeedForward(config.num_experts, config.dim, config.expert_dim)
        if config.expert_bias:
            self.expert_bias = nn.Parameter(torch.zeros(config.num_experts))
        self.shared = SwiGLU(config.dim, config.shared_dim) if config.shared_dim else None

    def route(self, scores: torch.Tensor) -> torch.Tensor:
        """scores (N, E) -> the top-k expert ids (N, k), with the bias and the group limit if set."""
        c = self.config
        choice = scores + self.expert_bias if c.expert_bias else scores  # (N, E)
        if c.groups > 1:
            n = choice.shape[0]
            grouped = choice.view(n, c.groups, -1)  # (N, G, E / G)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
            best = group_scores.topk(c.topk_groups, dim=-1).indices  # (N, topk_groups)
            allowed = torch.zeros_like(group_scores).scatter(1, best, 1.0)  # (N, G)
            allowed = allowed.unsqueeze(-1).expand_as(grouped).reshape(n, -1)  # (N, E)
            choice = choice.masked_fill(allowed == 0, float("-inf"))
        return torch.topk(choice, c.top_k, dim=-1).indices  # (N, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        x = x.view(-1, C)  # (N, C), N = B * T tokens
        logits = self.gate(x)  # (N, E)
        scores = logits.softmax(-1) if self.config.score_func == "softmax" else logits.sigmoid()
        expert_indices = self.route(scores)  # (N, k)
        expert_weights = scores.gather(1, expert_indices)  # (N, k)
        expert_weights = expert_weights / expert_weights.sum(dim=-1, keepdim=True)  # (N, k)
        expert_outs = self.cond_ffn(x, expert_indices)  # (N, k, C)
        out = torch.einsum("tai,ta->ti", expert_outs, expert_weights) * self.config.routed_scale  # (N, C)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(B, T, C)


class MoEAttention(LlamaAttention):
    """`models.LlamaAttention` (GQA, RoPE) with its own head dimension: q (C -> n_heads x head_dim), k
    and v (C -> n_kv_heads x head_dim), o back to C."""

    def __init__(self, config: MoEConfig) -> None:
        nn.Module.__init__(self)
        assert config.n_heads % config.n_kv_heads == 0
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        inner, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        self.wq = nn.Linear(config.dim, inner, bias=False)
        self.wk = nn.Linear(config.dim, kv, bias=False)
        self.wv = nn.Linear(config.dim, kv, bias=False)
        self.wo = nn.Linear(inner, config.dim, bias=False)


class MLAttention(nn.Module):
    """Multi-head latent attention (Liu et al. 2024, "DeepSeek-V2", section 2.1; DeepSeek-V3 Table 1),
    as DeepSeek's reference `model.py` computes it without the absorbed-weight decode: q =
    wq_b(norm(wq_a(x))) per head (`head_dim` without RoPE + `qk_rope_head_dim` with it); wkv_a(x) gives
    the latent (`kv_lora_rank`) and one RoPE key shared by every head; k (without RoPE) and v per head
    = wkv_b(norm(latent)); each head's key is its own part and the shared RoPE key concatenated."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.n_heads, self.nope, self.rope = config.n_heads, config.head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_rank = config.v_head_dim, config.kv_lora_rank
        self.wq_a = nn.Linear(config.dim, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, config.norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * (self.nope + self.rope), bias=False)
        self.wkv_a = nn.Linear(config.dim, self.kv_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, config.norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, T, C), cos / sin (1, T, 1, qk_rope_head_dim) -> (B, T, C)."""
        B, T, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(B, T, self.n_heads, self.nope + self.rope)
        q_nope, q_rope = torch.split(q, [self.nope, self.rope], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)  # (B, T, n, nope + rope)
        latent, k_rope = torch.split(self.wkv_a(x), [self.kv_rank, self.rope], dim=-1)
        k_rope = apply_rope(k_rope.view(B, T, 1, self.rope), cos, sin)  # one head, shared
        kv = self.wkv_b(self.kv_norm(latent)).view(B, T, self.n_heads, self.nope + self.v_dim)
        k_nope, v = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(B, T, self.n_heads, self.rope)], dim=-1)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_heads * self.v_dim))


class CachedMoEAttention(MoEAttention):
    """`MoEAttention` over a static KV cache (`models_kv.KVCache`), as `models_kv.CachedAttention`."""

    def __init__(self, config: MoEConfig, max_batch_size: int, max_seq_len: int) -> None:
        super().__init__(config)
        self.kv_cache = KVCache(max_batch_size, max_seq_len, config.n_kv_heads, config.head_dim)

    def forward(self, x, cos, sin, mask, input_pos) -> torch.Tensor:  # noqa: ANN001 - as models_kv's
        q, k, v = self.project(x, cos, sin)  # (B, n, T, hd)
        k, v = self.kv_cache.update(input_pos, k, v)  # (B, nkv, L, hd): the whole cache
        return self.attend(q, k, v, attn_mask=mask)


class MoEBlock(nn.Module):
    def __init__(self, config: MoEConfig, dense: bool, attention: nn.Module) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = SwiGLU(config.dim, config.dense_ffn_dim) if dense else MoEFeedForward(config)

    def forward(self, x: torch.Tensor, *attention_args: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), *attention_args)
        return x + self.feed_forward(self.ffn_norm(x))


class MoETransformer(nn.Module):
    """A decoder of `MoEBlock`s (untied LM head `output`)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        attention = MLAttention if config.kv_lora_rank else MoEAttention
        self.layers = nn.ModuleList(
            [MoEBlock(config, i < config.dense_layers, attention(config)) for i in range(config.n_layers)]
        )
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        rotated = config.qk_rope_head_dim if config.kv_lora_rank else config.head_dim
        cos, sin = rope_tables(rotated, config.rope_theta, config.max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hd)
        self.register_buffer("rope_sin", sin, persistent=False)  # (max_seq_len, hd)
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab_size)."""
        T = tokens.shape[1]
        cos = self.rope_cos[None, :T, None, :]  # (1, T, 1, hd)
        sin = self.rope_sin[None, :T, None, :]  # (1, T, 1, hd)
        h = self.tok_embeddings(tokens)  # (B, T, C)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))  # (B, T, vocab_size)


class CachedMoETransformer(nn.Module):
    """`MoETransformer` with static K/V caches of `max_seq_len` tokens (as `models_kv.CachedLlama`)."""

    def __init__(self, config: MoEConfig, max_batch_size: int, max_seq_len: int) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(
            [
                MoEBlock(
                    config, i < config.dense_layers, CachedMoEAttention(config, max_batch_size, max_seq_len)
                )
                for i in range(config.n_layers)
            ]
        )
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rope_tables(config.head_dim, config.rope_theta, max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)  # (L, hd)
        self.register_buffer("rope_sin", sin, persistent=False)  # (L, hd)
        causal = torch.tril(torch.ones(max_seq_len, max_seq_len, dtype=torch.bool))
        self.register_buffer("causal_mask", causal, persistent=False)  # (L, L)
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 at positions input_pos (T,) int64 -> logits (B, T, vocab_size)."""
        cos = self.rope_cos[input_pos][None, :, None, :]  # (1, T, 1, hd)
        sin = self.rope_sin[input_pos][None, :, None, :]  # (1, T, 1, hd)
        mask = self.causal_mask[input_pos][None, None]  # (1, 1, T, L): key j visible from query i
        h = self.tok_embeddings(tokens)  # (B, T, C)
        for layer in self.layers:
            h = layer(h, cos, sin, mask, input_pos)
        return self.output(self.norm(h))  # (B, T, vocab_size)


def training_model_file(config: MoEConfig, dtype: torch.dtype = torch.bfloat16):
    """`build_model` and `example_inputs` of a model file for `MoETransformer(config)` on meta."""

    def build_model() -> nn.Module:
        with torch.device("meta"):  # no weights allocated
            return MoETransformer(config).to(dtype)

    def example_inputs(batch_size: int = 1, seq_len: int = 4096) -> tuple:
        return token_ids(config.vocab_size, batch_size, seq_len)

    return build_model, example_inputs


def serving_model_file(
    config: MoEConfig,
    max_batch_size: int = 1,
    max_seq_len: int = 4096,
    prompt_len: int = 2048,
    dtype: torch.dtype = torch.bfloat16,
    device: str | None = "meta",
):
    """`build_model` and `example_inputs` of a serving model file (README, models with a KV cache) for
    `CachedMoETransformer(config)`, as `models_kv.serving_model_file`; the file also assigns
    `step_inputs` (`models_kv.step_inputs`)."""

    def build_model(max_batch_size: int = max_batch_size, max_seq_len: int = max_seq_len) -> nn.Module:
        with torch.device(device) if device else contextlib.nullcontext():
            model = CachedMoETransformer(config, max_batch_size, max_seq_len)
        return model.to(dtype)

    def example_inputs(batch_size: int = max_batch_size, seq_len: int = prompt_len) -> tuple:
        (tokens,) = token_ids(config.vocab_size, batch_size, seq_len)
        return (tokens, torch.arange(seq_len))

    return build_model, example_inputs

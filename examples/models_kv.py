"""Llama-3 with a static KV cache, gpt-fast style: the serving form of `models.Llama`.

The caches are buffers allocated once for `max_batch_size` sequences of up to `max_seq_len` tokens,
`(B, n_kv_heads, max_seq_len, hd)` per layer for K and for V. One forward is one step of a request:
it takes the new tokens and their positions `input_pos`, writes their K/V into the cache at those
positions (`cache[:, :, input_pos] = k`, an `aten.index_put_` on the buffer) and attends over the
whole allocated cache with a mask (keys at positions <= the query's position are visible). A prefill
is `model(prompt, arange(P))`; a decode step is `model(next_token[:, None], tensor([pos]))`.

Module and parameter names follow `models.Llama` (Meta's `layers.N.attention.wq`, ...), so plans and
checkpoints of the two are interchangeable apart from the cache buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from models import (
    LlamaAttention,
    LlamaConfig,
    LlamaFeedForward,
    RMSNorm,
    _init_weights,
    _rope_tables,
    token_ids,
)
from torch import nn


class KVCache(nn.Module):
    """K and V caches of one layer: two buffers (max_batch_size, n_kv_heads, max_seq_len, hd)."""

    def __init__(self, max_batch_size: int, max_seq_len: int, n_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        shape = (max_batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def update(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, nkv, T, hd) at positions input_pos (T,); return the whole caches."""
        self.k_cache[:, :, input_pos] = k  # aten.index_put_ on the buffer
        self.v_cache[:, :, input_pos] = v
        return self.k_cache, self.v_cache


class CachedAttention(LlamaAttention):
    """Grouped-query attention with RoPE over a static KV cache (`models.LlamaAttention`'s projections
    and attention core, the K/V of each step written into the cache first).

    ``fused_gqa=False`` (gpt-fast's form, `LlamaAttention.attend`) repeats each K/V head of the whole
    cache to its query heads before SDPA; ``True`` lets SDPA read each K/V head for its group of query
    heads (``enable_gqa``), as the serving engines' attention kernels do: the cache is never copied.
    """

    def __init__(
        self, config: LlamaConfig, max_batch_size: int, max_seq_len: int, fused_gqa: bool = False
    ) -> None:
        super().__init__(config)
        self.fused_gqa = fused_gqa
        self.kv_cache = KVCache(max_batch_size, max_seq_len, config.n_kv_heads, self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        input_pos: torch.Tensor,
    ) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)  # (B, n, T, hd)
        k, v = self.kv_cache.update(input_pos, k, v)  # (B, nkv, L, hd): the whole cache
        if not self.fused_gqa:
            return self.attend(q, k, v, attn_mask=mask)
        B, _, T, hd = q.shape
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # (B, nh, T, hd)
        return self.wo(y.transpose(1, 2).contiguous().view(B, T, self.n_heads * hd))


class CachedBlock(nn.Module):
    def __init__(
        self, config: LlamaConfig, max_batch_size: int, max_seq_len: int, fused_gqa: bool = False
    ) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = CachedAttention(config, max_batch_size, max_seq_len, fused_gqa)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = LlamaFeedForward(config)

    def forward(self, x, cos, sin, mask, input_pos) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos)
        return x + self.feed_forward(self.ffn_norm(x))


class CachedLlama(nn.Module):
    """Llama-3 (untied LM head `output`) with static K/V caches of `max_seq_len` tokens
    (``fused_gqa``: see `CachedAttention`)."""

    def __init__(
        self, config: LlamaConfig, max_batch_size: int, max_seq_len: int, fused_gqa: bool = False
    ) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(
            [CachedBlock(config, max_batch_size, max_seq_len, fused_gqa) for _ in range(config.n_layers)]
        )
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = _rope_tables(dataclasses.replace(config, max_seq_len=max_seq_len))
        self.register_buffer("rope_cos", cos, persistent=False)  # (L, hd)
        self.register_buffer("rope_sin", sin, persistent=False)  # (L, hd)
        causal = torch.tril(torch.ones(max_seq_len, max_seq_len, dtype=torch.bool))
        self.register_buffer("causal_mask", causal, persistent=False)  # (L, L)
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """tokens: (B, T) int64 at positions input_pos (T,) int64 -> logits (B, T, vocab_size)."""
        cos = self.rope_cos[input_pos][None, :, None, :]  # (1, T, 1, hd)
        sin = self.rope_sin[input_pos][None, :, None, :]  # (1, T, 1, hd)
        mask = self.causal_mask[input_pos][None, None]  # (1, 1, T, L): key j visible from query i
        h = self.tok_embeddings(tokens)  # (B, T, C)
        for layer in self.layers:
            h = layer(h, cos, sin, mask, input_pos)
        return self.output(self.norm(h))  # (B, T, vocab_size)


def step_inputs(tokens: torch.Tensor, input_pos: torch.Tensor) -> tuple:
    """Forward's arguments for new tokens (B, T) int64 at positions input_pos (T,) int64."""
    return (tokens, input_pos)


def serving_model_file(
    config: LlamaConfig,
    max_batch_size: int = 1,
    max_seq_len: int = 4096,
    prompt_len: int = 2048,
    dtype: torch.dtype | None = None,
    device: str | None = None,
    fused_gqa: bool = False,
):
    """`build_model` and `example_inputs` of a serving model file (README, models with a KV cache) for
    `CachedLlama(config, fused_gqa=fused_gqa)`: built on `device` (e.g. "meta": planned, no weights) in
    `dtype`, with the given default cache and prompt sizes. A model file assigns them at module level
    together with `step_inputs`."""

    def build_model(max_batch_size: int = max_batch_size, max_seq_len: int = max_seq_len) -> nn.Module:
        with torch.device(device) if device else contextlib.nullcontext():
            model = CachedLlama(config, max_batch_size, max_seq_len, fused_gqa)
        return model.to(dtype) if dtype else model

    def example_inputs(batch_size: int = max_batch_size, seq_len: int = prompt_len) -> tuple:
        (tokens,) = token_ids(config.vocab_size, batch_size, seq_len)
        return step_inputs(tokens, torch.arange(seq_len))

    return build_model, example_inputs

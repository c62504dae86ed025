"""Model structures for the planner tests: real analysed examples (traced on meta) and hand-built ones.

Tracing an 80-layer model takes tens of seconds, so `analysed_llama` traces two layers of the
published config and repeats the last one (the layers are identical; weight names are renumbered).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
import sys
from pathlib import Path

import torch

from planner.frontend.analysis import Attention, Embedding, Layer, Mlp, ModelStructure, Projection, analyse
from planner.frontend.capture import capture

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

from models import GPT, GPT_CONFIGS, LLAMA_CONFIGS, MLP, Llama, MLPConfig, token_ids  # noqa: E402


def repeat_layers(structure: ModelStructure, num_layers: int) -> ModelStructure:
    """A copy of `structure` whose layers are `num_layers` copies of its last layer, renumbered."""
    proto = structure.layers[-1]
    old = proto.module_path + "."
    layers = []
    for i in range(num_layers):
        path = re.sub(r"\d+$", str(i), proto.module_path)
        layer = copy.deepcopy(proto)
        layer.index, layer.module_path = i, path
        for block in (layer.attention, layer.mlp):
            for p in block.projections if block is not None else []:
                p.weight = p.weight.replace(old, path + ".", 1)
                p.bias = p.bias.replace(old, path + ".", 1) if p.bias else None
        layers.append(layer)
    out = copy.copy(structure)
    out.layers = layers
    return out


@functools.cache
def analysed_llama(size: str, **overrides: int) -> ModelStructure:
    """Llama-3 of a published size (examples/models.py), traced with 2 layers on meta, then repeated."""
    config = dataclasses.replace(LLAMA_CONFIGS[size], **overrides)
    traced = dataclasses.replace(config, n_layers=2)
    with torch.device("meta"):
        model = Llama(traced)
    structure = analyse(capture(model, token_ids(config.vocab_size, 1, 16), {}))
    return repeat_layers(structure, config.n_layers)


@functools.cache
def analysed_gpt(size: str, **overrides: int) -> ModelStructure:
    """GPT-2 / GPT-3 of a published size (fused c_attn with parts), traced with 2 layers, repeated;
    `overrides` replace fields of its `GPTConfig` (another shape of the same kind)."""
    config = dataclasses.replace(GPT_CONFIGS[size], **overrides)
    traced = dataclasses.replace(config, n_layer=2)
    with torch.device("meta"):
        model = GPT(traced)
    structure = analyse(capture(model, token_ids(config.vocab_size, 1, 16), {}))
    return repeat_layers(structure, config.n_layer)


@functools.cache
def analysed_mlp(in_features: int, hidden: int, out_features: int, n_hidden_layers: int) -> ModelStructure:
    """A plain MLP (examples/models.py MLP) traced on meta: a chain of linears, no transformer layers."""
    with torch.device("meta"):
        model = MLP(MLPConfig(in_features, hidden, out_features, n_hidden_layers))
    return analyse(capture(model, (torch.empty(4, in_features, device="meta"),), {}))


def _proj(weight: str, role: str, n_in: int, n_out: int, out_dim: int = 0, parts=None) -> Projection:
    return Projection(weight, weight, None, role, n_in, n_out, out_dim, parts, 0.0)


def handmade_llama(
    num_layers: int = 4,
    hidden: int = 1024,
    heads: int = 16,
    kv_heads: int = 4,
    ffn: int = 4096,
    vocab: int = 32000,
    ffn_per_layer: list[int] | None = None,
    dtype: str = "bf16",
) -> ModelStructure:
    """A Llama-shaped ModelStructure built by hand (no tracing): for fast unit tests of the ILP."""
    hd = hidden // heads
    b = 2 if dtype != "fp32" else 4
    layers = []
    for i in range(num_layers):
        f = ffn_per_layer[i] if ffn_per_layer else ffn
        pre = f"layers.{i}"
        attn = Attention(
            [
                _proj(f"{pre}.wq.weight", "q", hidden, heads * hd),
                _proj(f"{pre}.wk.weight", "k", hidden, kv_heads * hd),
                _proj(f"{pre}.wv.weight", "v", hidden, kv_heads * hd),
                _proj(f"{pre}.wo.weight", "o", heads * hd, hidden),
            ],
            heads, kv_heads, hd, f"sdpa_{i}", None, 0.0,
        )  # fmt: skip
        mlp = Mlp(
            [
                _proj(f"{pre}.w1.weight", "gate", hidden, f),
                _proj(f"{pre}.w3.weight", "up", hidden, f),
                _proj(f"{pre}.w2.weight", "down", f, hidden),
            ],
            None,
        )
        params = (
            hidden * (heads + 2 * kv_heads) * hd + heads * hd * hidden + 3 * hidden * f + 2 * hidden
        ) * b
        layers.append(Layer(i, pre, attn, mlp, [], f"in{i}", f"out{i}", params, 0.0, 0.0))
    return ModelStructure(
        layers=layers,
        embeddings=[Embedding("embedding", "tok_embeddings.weight", vocab, hidden)],
        lm_head=_proj("output.weight", "lm_head", hidden, vocab),
        tied_lm_head=False,
        hidden_size=hidden,
        vocab_size=vocab,
        num_params=0,
        param_bytes=0,
        batch_size=1,
        seq_len=16,
        dtype=dtype,
        node_costs={},
        mlp_chain=[],
    )

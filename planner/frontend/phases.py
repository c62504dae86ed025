"""The two phases of serving a model with a static KV cache, as inputs and captured graphs.

    prefill: P prompt tokens per sequence at positions 0..P-1, written into an empty cache
    decode:  one new token per sequence at position C, with C tokens already in the cache

Both run the same model (caches allocated for `batch_size` sequences of `cache_len` tokens:
`ModelFile.build(max_batch_size, max_seq_len)`) with the model file's `step_inputs(tokens,
input_pos)`. Captured shapes are literals, so each phase is its own graph; the runtime shares the
weights and cache buffers between the two rewritten graphs (`runtime.decode`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from costmodels.dtypes import torch_dtype
from planner.errors import InputError
from planner.frontend.analysis import ModelStructure
from planner.frontend.depth import capture_for_planning
from planner.frontend.modelfile import ModelFile

PREFILL = "prefill"
DECODE = "decode"


@dataclass(frozen=True)
class Phase:
    """One step of a request: `num_tokens` new tokens per sequence starting at `start_pos`."""

    name: str  # PREFILL | DECODE
    batch_size: int
    start_pos: int  # position of the first new token (decode: tokens already in the cache)
    num_tokens: int  # new tokens per sequence (decode: 1)
    cache_len: int  # allocated cache length in tokens (>= start_pos + num_tokens)

    def __post_init__(self) -> None:
        if self.start_pos + self.num_tokens > self.cache_len:
            raise InputError(
                f"{self.name}: positions {self.start_pos}..{self.start_pos + self.num_tokens - 1} do not fit "
                f"a cache of {self.cache_len} tokens"
            )

    @property
    def input_pos(self) -> torch.Tensor:
        """Positions of the new tokens, (num_tokens,) int64."""
        return torch.arange(self.start_pos, self.start_pos + self.num_tokens)


def prefill_phase(batch_size: int, prompt_len: int, cache_len: int) -> Phase:
    """A prefill of `prompt_len` tokens into a cache of `cache_len` tokens."""
    return Phase(PREFILL, batch_size, 0, prompt_len, cache_len)


def decode_phase(batch_size: int, context: int, cache_len: int) -> Phase:
    """One decode step at position `context` (that many tokens already cached)."""
    return Phase(DECODE, batch_size, context, 1, cache_len)


def phase_inputs(
    model_file: ModelFile, phase: Phase, tokens: torch.Tensor | None = None, device: str = "cpu"
) -> tuple[tuple, dict]:
    """(args, kwargs) of `phase`; `tokens` (batch, num_tokens) int64, zeros when None."""
    if tokens is None:
        tokens = torch.zeros(phase.batch_size, phase.num_tokens, dtype=torch.long)
    return model_file.step_inputs(tokens, phase.input_pos, device=device)


def build_for(
    model_file: ModelFile, phase: Phase, device: str = "cpu", dtype: str | None = None
) -> nn.Module:
    """The model with caches allocated for `phase` (its batch and cache length), its floating
    parameters and buffers cast to ``dtype`` when given (`cast_module`)."""
    model = model_file.build(device, max_batch_size=phase.batch_size, max_seq_len=phase.cache_len)
    return cast_module(model, dtype) if dtype else model


def run_torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a plan's dtype name ("bf16"); InputError naming the plan's dtype otherwise."""
    try:
        return torch_dtype(dtype)
    except ValueError as e:
        raise InputError(f"the plan's dtype: {e}") from None


def cast_module(model: nn.Module, dtype: str) -> nn.Module:
    """`model` with its floating parameters and buffers in `dtype` (in place; InputError for an
    unknown dtype).

    Each tensor is converted in place (its `.data`), not replaced as `nn.Module.to` replaces buffers, so
    whatever else holds it sees the dtype too: transformers' `StaticCache` keeps its own references to
    the K/V buffers its export wrapper registers (replaced, they stayed fp32 beside bf16 queries).
    Complex buffers (torchtitan's and Meta's RoPE `freqs_cis`) keep their dtype: `nn.Module.to` with
    a real dtype casts them too and drops their imaginary part, changing what the model computes."""
    want = run_torch_dtype(dtype)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:  # each once (shared ones too)
            if t.is_floating_point() and t.dtype != want:
                t.data = t.data.to(want)
    return model


def cast_inputs(args: tuple, kwargs: dict, dtype: str) -> tuple[tuple, dict]:
    """(args, kwargs) with every floating tensor in `dtype` (token ids and masks of other dtypes kept)."""
    want = run_torch_dtype(dtype)

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != want:
            return x.to(want)
        return x

    return pytree.tree_map(cast, (tuple(args), dict(kwargs)))


def plan_structure(model_file: ModelFile, phase: Phase) -> tuple[fx.GraphModule, ModelStructure]:
    """`phase` captured on the meta device and analysed for planning (deep models through a slice).

    Raises InputError when the model cannot be captured or its analysis finds no KV cache."""
    model = build_for(model_file, phase, "meta")
    args, kwargs = phase_inputs(model_file, phase)
    gm, structure = capture_for_planning(model, args, kwargs)
    if structure.layers and not structure.has_kv_cache:
        raise InputError(
            f"{model_file.path}: defines step_inputs but no attention writes a KV-cache buffer in forward "
            "(index_put_ / index_copy_ on a buffer that SDPA reads); see docs/model-files.md, models with a KV cache"
        )
    return gm, structure

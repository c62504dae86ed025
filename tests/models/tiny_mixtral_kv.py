"""Test model: tests/models/tiny_mixtral.py's tiny Hugging Face Mixtral (4 experts, top-2) served through
transformers' static-cache export wrapper (`TorchExportableModuleWithStaticCache`), as
examples/hf_llama_kv.py serves a Llama: a served mixture-of-experts model with a KV cache."""

import sys
from pathlib import Path

import torch
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_mixtral import CONFIG  # noqa: E402  (the same tiny Mixtral)


class StaticCacheLM(TorchExportableModuleWithStaticCache):
    """The HF wrapper with positional forward arguments: (input_ids (B, T), cache_position (T,))."""

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids=input_ids, cache_position=cache_position)


def build_model(max_batch_size: int = 1, max_seq_len: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    config = MixtralConfig(**CONFIG, attn_implementation="sdpa", experts_implementation="batched_mm")
    model = MixtralForCausalLM(config).eval()
    model.generation_config.cache_implementation = "static"
    return StaticCacheLM(model, batch_size=max_batch_size, max_cache_len=max_seq_len)


def step_inputs(tokens: torch.Tensor, input_pos: torch.Tensor) -> tuple:
    """Forward's arguments for new tokens (B, T) at cache positions input_pos (T,)."""
    return (tokens, input_pos)


def example_inputs(batch_size: int = 1, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return step_inputs(
        torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g), torch.arange(seq_len)
    )

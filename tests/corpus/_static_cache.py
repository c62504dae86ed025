"""Shared by the corpus's `*_kv.py` files: a Hugging Face causal LM served through transformers'
static-cache export wrapper (`transformers.integrations.executorch.TorchExportableModuleWithStaticCache`,
transformers 5.x), whose `StaticCache` K/V tensors are buffers written in forward with `index_copy_` at
`cache_position` (the form ExecuTorch exports). The subclass gives its forward positional arguments
(input_ids, cache_position), so the serving contract of a model file applies (README, models with a
KV cache; as examples/hf_llama_kv.py). Not a model file itself (its name starts with `_`).
"""

import torch
from transformers.integrations.executorch import TorchExportableModuleWithStaticCache


class StaticCacheLM(TorchExportableModuleWithStaticCache):
    """The HF wrapper with positional forward arguments: (input_ids (B, T), cache_position (T,))."""

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids=input_ids, cache_position=cache_position)


def static_cache_lm(model: torch.nn.Module, max_batch_size: int, max_seq_len: int) -> torch.nn.Module:
    """`model` (a `...ForCausalLM`) in eval mode behind a static cache of `max_batch_size` sequences
    of `max_seq_len` tokens."""
    model = model.eval()
    model.generation_config.cache_implementation = "static"
    return StaticCacheLM(model, batch_size=max_batch_size, max_cache_len=max_seq_len)


def prompt_inputs(vocab_size: int, batch_size: int, seq_len: int) -> tuple:
    """A seeded prompt (B, T) of token ids below `vocab_size` and its cache positions (T,)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    return (tokens, torch.arange(seq_len))

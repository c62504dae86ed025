"""Corpus: `hf_gpt2.py`'s GPT-2 (GPT2LMHeadModel) served through transformers' static-cache export wrapper.

`transformers.integrations.executorch.TorchExportableModuleWithStaticCache` holds a `StaticCache` whose
K/V tensors are buffers written in forward with `index_copy_` at `cache_position` (the form ExecuTorch
exports); the subclass gives its forward positional arguments (input_ids, cache_position), so the
serving contract of a model file applies (README, models with a KV cache; as examples/hf_llama_kv.py):

    planner optimize tests/corpus/hf_gpt2_kv.py --cluster tests/models/fastlink.yaml --tp 2 --workload decode --context 32

Same configuration and constructs as `hf_gpt2.py` (see there); random weights, no download.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

CONFIG = dict(
    vocab_size=256,
    n_positions=128,
    n_embd=128,
    n_layer=2,
    n_head=4,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=255,  # GPT2Config's 50256 lies outside this vocabulary
    eos_token_id=255,
)


class StaticCacheLM(TorchExportableModuleWithStaticCache):
    """The HF wrapper with positional forward arguments: (input_ids (B, T), cache_position (T,))."""

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids=input_ids, cache_position=cache_position)


def build_model(max_batch_size: int = 1, max_seq_len: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**CONFIG, attn_implementation="sdpa")).eval()
    model.generation_config.cache_implementation = "static"
    return StaticCacheLM(model, batch_size=max_batch_size, max_cache_len=max_seq_len)


def step_inputs(tokens: torch.Tensor, input_pos: torch.Tensor) -> tuple:
    """Forward's arguments for new tokens (B, T) at cache positions input_pos (T,)."""
    return (tokens, input_pos)


def example_inputs(batch_size: int = 1, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g)
    return step_inputs(tokens, torch.arange(seq_len))

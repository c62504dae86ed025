"""Corpus: `hf_phi3.py`'s Phi-3 (Phi3ForCausalLM) served through transformers' static-cache export wrapper.

`transformers.integrations.executorch.TorchExportableModuleWithStaticCache` holds a `StaticCache` whose
K/V tensors are buffers written in forward with `index_copy_` at `cache_position` (the form ExecuTorch
exports); the subclass gives its forward positional arguments (input_ids, cache_position), so the
serving contract of a model file applies (README, models with a KV cache; as examples/hf_llama_kv.py):

    planner optimize tests/corpus/hf_phi3_kv.py --cluster tests/models/fastlink.yaml --tp 2 --workload decode --context 32

Same configuration and constructs as `hf_phi3.py` (see there); random weights, no download.
"""

import torch
from transformers import Phi3Config, Phi3ForCausalLM
from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

CONFIG = dict(
    vocab_size=384,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
    original_max_position_embeddings=256,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


class StaticCacheLM(TorchExportableModuleWithStaticCache):
    """The HF wrapper with positional forward arguments: (input_ids (B, T), cache_position (T,))."""

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids=input_ids, cache_position=cache_position)


def build_model(max_batch_size: int = 1, max_seq_len: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(**CONFIG, attn_implementation="sdpa")).eval()
    model.generation_config.cache_implementation = "static"
    return StaticCacheLM(model, batch_size=max_batch_size, max_cache_len=max_seq_len)


def step_inputs(tokens: torch.Tensor, input_pos: torch.Tensor) -> tuple:
    """Forward's arguments for new tokens (B, T) at cache positions input_pos (T,)."""
    return (tokens, input_pos)


def example_inputs(batch_size: int = 1, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len), generator=g)
    return step_inputs(tokens, torch.arange(seq_len))

"""A small Hugging Face LlamaForCausalLM served through transformers' own static-cache export wrapper.

`transformers.integrations.executorch.TorchExportableModuleWithStaticCache` (transformers 5.x) holds
a `StaticCache` whose K/V tensors are registered as buffers and updated in forward with
`index_copy_` at `cache_position`: the form ExecuTorch exports. The subclass below only gives its
forward positional arguments (`input_ids`, `cache_position`), so the serving contract of a model file
(README, models with a KV cache) applies as to the hand-written `llama3_kv.py`:

    planner optimize examples/hf_llama_kv.py --workload decode --context 32 --tp 2 --nproc 2 --run

2 layers, hidden 128, 8 heads, 4 KV heads, SwiGLU 256, vocab 256, SDPA attention; random weights.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

CONFIG = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


class StaticCacheLM(TorchExportableModuleWithStaticCache):
    """The HF wrapper with positional forward arguments: (input_ids (B, T), cache_position (T,))."""

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids=input_ids, cache_position=cache_position)


def build_model(max_batch_size: int = 1, max_seq_len: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
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

"""Test model: a tiny Hugging Face OLMoE (`OlmoeForCausalLM` from a config, random weights) served through
transformers' static-cache export wrapper (as `examples/hf_llama_kv.py`): 2 layers, hidden 128, 8 heads
(4 KV heads), 4 experts of width 256 with top-2 softmax routing per layer, `experts_implementation=
"batched_mm"`. In bf16 at TP 2 one router's top-2 on this machine is a near-tie (scores 3e-4 apart) that
the other summation order flips: the serving numerics check replays the reference's expert choices
(`runtime.routing`)."""

import torch
import transformers
from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

CONFIG = dict(
    vocab_size=320,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    pad_token_id=0,
    num_experts=4,
    num_experts_per_tok=2,
)


class StaticCacheLM(TorchExportableModuleWithStaticCache):
    """The HF wrapper with positional forward arguments: (input_ids (B, T), cache_position (T,))."""

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids=input_ids, cache_position=cache_position)


def build_model(max_batch_size: int = 1, max_seq_len: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.OlmoeConfig(
        **CONFIG, attn_implementation="sdpa", experts_implementation="batched_mm"
    )
    model = transformers.OlmoeForCausalLM(config).eval()
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

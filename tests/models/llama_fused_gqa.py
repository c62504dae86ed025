"""Test model file: the tiny cached Llama-3 (2 layers, 8 query heads, 4 KV heads) with fused GQA
attention, as the serving engines compute it: SDPA reads each K/V head for its query heads
(`enable_gqa`); the cache is never repeated to the query heads (`models_kv.CachedAttention`).
"""

import dataclasses
import sys
from pathlib import Path

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

from models import LLAMA_CONFIGS  # noqa: E402
from models_kv import serving_model_file, step_inputs  # noqa: E402, F401 - step_inputs: the model file API

CONFIG = dataclasses.replace(LLAMA_CONFIGS["tiny"], n_layers=2)
build_model, example_inputs = serving_model_file(
    CONFIG, max_batch_size=1, max_seq_len=32, prompt_len=8, fused_gqa=True
)

"""Test model file: the tiny cached Llama-3 with 8 query heads and one KV head (multi-query attention:
Falcon, StarCoder, Gemma-2B), so that at tp=2 every rank holds that head whole (its K/V projection and
cache) and its own 4 query heads. ``FUSED_GQA`` selects SDPA's own grouping (`enable_gqa`) over the
cache repeated to the query heads.
"""

import dataclasses
import sys
from pathlib import Path

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

from models import LLAMA_CONFIGS  # noqa: E402
from models_kv import serving_model_file, step_inputs  # noqa: E402, F401 - step_inputs: the model file API

FUSED_GQA = False
CONFIG = dataclasses.replace(LLAMA_CONFIGS["tiny"], n_layers=2, n_kv_heads=1)
build_model, example_inputs = serving_model_file(
    CONFIG, max_batch_size=1, max_seq_len=32, prompt_len=8, fused_gqa=FUSED_GQA
)

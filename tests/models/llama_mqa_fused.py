"""Test model file: `llama_mqa.py` (8 query heads, one KV head) with SDPA grouping the query heads
itself (`enable_gqa`), as the serving engines' kernels do: the cache is never repeated."""

import dataclasses
import sys
from pathlib import Path

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

from models import LLAMA_CONFIGS  # noqa: E402
from models_kv import serving_model_file, step_inputs  # noqa: E402, F401 - step_inputs: the model file API

FUSED_GQA = True
CONFIG = dataclasses.replace(LLAMA_CONFIGS["tiny"], n_layers=2, n_kv_heads=1)
build_model, example_inputs = serving_model_file(
    CONFIG, max_batch_size=1, max_seq_len=32, prompt_len=8, fused_gqa=FUSED_GQA
)

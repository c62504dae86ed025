"""Test model file: `llama_mqa.py` (8 query heads, one KV head) with SDPA grouping the query heads
itself (`enable_gqa`), as the serving engines' kernels do: the cache is never repeated."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_mqa import CONFIG, serving_model_file  # noqa: E402
from llama_mqa import step_inputs as step_inputs  # noqa: E402 - the model file API

build_model, example_inputs = serving_model_file(
    CONFIG, max_batch_size=1, max_seq_len=32, prompt_len=8, fused_gqa=True
)

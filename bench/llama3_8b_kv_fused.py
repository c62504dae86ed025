"""Llama-3 8B with a static KV cache and fused GQA attention, on meta: planned, never run.

`examples/llama3_8b_kv.py` (gpt-fast's form: the cache repeated to the query heads before attention) with
`fused_gqa=True` instead (each KV head read for its group of query heads, as the serving engines' attention
kernels do, and as examples/llama3_70b_kv.py already plans): bench/serving.py prices LLM-Inference-Bench's
vLLM and TensorRT-LLM Llama-3-8B rows with it beside the example. fp16, the dtype those rows ran in.
"""

import sys
from pathlib import Path

import torch

_EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)  # so that `models` imports when this file is loaded by path

from models import LLAMA_CONFIGS  # noqa: E402
from models_kv import serving_model_file, step_inputs  # noqa: E402, F401 - step_inputs: the model file API

CONFIG = LLAMA_CONFIGS["8b"]
build_model, example_inputs = serving_model_file(CONFIG, dtype=torch.float16, device="meta", fused_gqa=True)

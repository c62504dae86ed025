"""Llama-3 70B with a static KV cache (published config), built on the meta device: planned, never run.

Serving it as vLLM does with `tensor_parallel_size=4` (8 KV heads: 2 per rank; bf16; attention reads each
KV head once for its query heads, as vLLM's kernels do: `fused_gqa=True`, SDPA with `enable_gqa`):

    planner optimize examples/llama3_70b_kv.py --cluster dgx-h100 --workload decode --context 4096 \
        --batch-size 8 --dtype bf16 --tp 4
"""

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # so that `models` imports when this file is loaded by path

from models import LLAMA_CONFIGS  # noqa: E402
from models_kv import serving_model_file, step_inputs  # noqa: E402, F401 - step_inputs: the model file API

CONFIG = LLAMA_CONFIGS["70b"]
# no weights allocated (meta), bf16; caches for 4096 tokens, a 2048-token prompt by default
build_model, example_inputs = serving_model_file(CONFIG, dtype=torch.bfloat16, device="meta", fused_gqa=True)

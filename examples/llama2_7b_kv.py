"""Llama-2 7B (32 heads, 32 KV heads: MHA) with a static KV cache, on meta: planned, never run.

The published Llama-2 shapes (`models.LLAMA_CONFIGS`, sources there) on the same classes as the Llama-3
examples. bench/serving.py prices it against
TensorRT-LLM's and LMDeploy's published fp16 A100 measurements, e.g.

    planner optimize examples/llama2_7b_kv.py --cluster dgx-a100 --workload generate --seq-len 128 \
        --new-tokens 128 --batch-size 64 --dtype fp16 --tp 1 --devices 1
"""

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # so that `models` imports when this file is loaded by path

from models import LLAMA_CONFIGS  # noqa: E402
from models_kv import serving_model_file, step_inputs  # noqa: E402, F401 - step_inputs: the model file API

CONFIG = LLAMA_CONFIGS["llama2-7b"]
# no weights allocated (meta), fp16; fused GQA attention (each KV head read for its query heads, as the
# serving engines do); caches for 4096 tokens, a 2048-token prompt by default
build_model, example_inputs = serving_model_file(CONFIG, dtype=torch.float16, device="meta", fused_gqa=True)

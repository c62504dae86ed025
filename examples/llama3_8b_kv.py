"""Llama-3 8B with a static KV cache (published config), built on the meta device: planned, never run.

Planned at batch 1 as gpt-fast measures it (bf16):

    planner optimize examples/llama3_8b_kv.py --cluster dgx-a100 --workload decode --context 5 \
        --new-tokens 200 --dtype bf16 --tp 2
"""

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # so that `models` imports when this file is loaded by path

from models import LLAMA_CONFIGS  # noqa: E402
from models_kv import serving_model_file, step_inputs  # noqa: E402, F401 - step_inputs: the model file API

CONFIG = LLAMA_CONFIGS["8b"]
# no weights allocated (meta), bf16; caches for 4096 tokens, a 2048-token prompt by default
build_model, example_inputs = serving_model_file(CONFIG, dtype=torch.bfloat16, device="meta")

"""examples/hf_llama.py fine-tuned with LoRA (Hu et al. 2021) through PEFT: rank-8 adapters beside
q, k, v, o and the MLP's gate, up and down; the base weights frozen. Needs `pip install peft`.

The planner finds each adapter beside the projection it adapts and splits it with that projection
(docs/model-files.md, "Frozen parameters and LoRA"):

    planner optimize examples/hf_llama_lora.py --cluster local-cpu --nproc 2 --workload train \
        --batch-size 4 --seq-len 16 --tp 2 --run
"""

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import hf_llama  # noqa: E402

RANK = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    # init_lora_weights=False: random adapters (PEFT's default starts up at zero, so the numerics
    # check would not see the adapters)
    config = LoraConfig(
        r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False
    )
    return get_peft_model(hf_llama.build_model(), config)


example_inputs = hf_llama.example_inputs
example_kwargs = hf_llama.example_kwargs

"""`planner optimize --emit DIR`: write every rank's generated sharded module for a plan.

For each (pipeline stage, TP rank) of the mesh (DP replicas share the same modules), the captured
graph is lowered in this process (`passes.lower.lower_for_rank`: TP pass, ladder pass, pipeline
split; no process group is needed to lower) and written with `passes.emit.emit_rank_module` as `DIR/rank{r}/` (module source, weight
shards, meta.json), where r = pp_rank * tp + tp_rank is the global rank of DP replica 0. A README in
DIR says how to load them. Models whose weights exceed `MAX_MATERIALISED_BYTES` are emitted from
the `meta` device: source and shard shapes only, weights to be loaded from the user's checkpoint.
The whole folder is written to a temporary sibling and renamed into place: an error leaves nothing.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path

import torch

from passes.emit import emit_rank_module, write_readme
from passes.lower import lower_for_rank
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture
from planner.frontend.modelfile import load_model_file
from planner.frontend.phases import build_for, decode_phase, phase_inputs
from planner.plan import Plan

MAX_MATERIALISED_BYTES = 4 * 2**30  # above this, emit from meta (no weights): a laptop cannot hold 70B
SEED = 0  # the seed `planner run` builds models with, so emitted weights match a run


def emit_plan(plan: Plan, model_path: str, out_dir: str, backend: str = "gloo") -> Path:
    """Write the generated module of every rank of `plan` into `out_dir`; return its path.

    backend: the process-group backend the README's example initialises ("nccl" for GPU clusters).
    Raises InputError when the plan ladders layers across pipeline stages (not supported) or the
    output folder cannot be written.
    """
    model_file = load_model_file(model_path)
    batch = plan.batch_size // plan.dp // max(1, plan.micro_batches if plan.pp > 1 else 1)
    sv = plan.serving  # a model with a KV cache: the decode step the plan was solved on
    phase = (
        decode_phase(batch, sv.prompt_len, sv.cache_len) if sv is not None and model_file.has_cache else None
    )

    def build(device: str) -> torch.nn.Module:
        return model_file.build(device) if phase is None else build_for(model_file, phase, device)

    meta_model = build("meta")
    weight_bytes = sum(p.numel() * p.element_size() for p in meta_model.parameters())
    device = "meta" if weight_bytes > MAX_MATERIALISED_BYTES else "cpu"
    torch.manual_seed(SEED)
    model = meta_model if device == "meta" else build("cpu")
    args, kwargs = (
        model_file.inputs(batch, plan.seq_len) if phase is None else phase_inputs(model_file, phase)
    )
    gm = capture(model, args, kwargs)
    structure = analyse(gm)
    final = Path(out_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
        for rank in range(plan.tp * plan.pp):  # DP replica 0: ranks 0 .. tp * pp - 1
            lowered = lower_for_rank(copy.deepcopy(gm), structure, plan, rank)
            meta = {
                "plan": {
                    "tp": plan.tp,
                    "pp": plan.pp,
                    "dp": plan.dp,
                    "micro_batches": plan.micro_batches,
                    "schedule": str(plan.schedule),
                },
                "tp_rank": lowered.tp_rank,
                "pp_rank": lowered.pp_rank,
                "weights_materialised": device != "meta",
            }
            emit_rank_module(lowered.module, tmp, rank, meta)
        write_readme(
            tmp,
            {
                "model": str(model_path),
                "tp": plan.tp,
                "pp": plan.pp,
                "dp": plan.dp,
                "world_size": plan.num_devices,
            },
        )
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final

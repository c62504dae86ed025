"""Rank entry for the DTensor export test: apply exported plans to example models (one spawn, several
models). Kept apart from the test module so that the spawned ranks import only what they run."""

from __future__ import annotations

import types

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from planner.frontend.modelfile import load_model_file
from runtime.launch import RankContext


def apply_exported(ctx: RankContext, jobs: dict[str, tuple[str, str]]) -> dict[str, dict]:
    """Each job (model file, exported source): load the source as a module, build the model (seeded,
    the same on every rank), run it unsharded, apply the plan on a 1-D mesh of all ranks, run it
    again. Returns per job the largest output difference, the output scale, the local shape of every
    sharded parameter and whether GPT-2's token embedding is still tied to its LM head."""
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    results = {}
    for name, (model_path, source) in jobs.items():
        exported = types.ModuleType(f"exported_{name}")
        exec(compile(source, f"<{name} export>", "exec"), exported.__dict__)
        model_file = load_model_file(model_path)
        torch.manual_seed(0)
        model = model_file.build("cpu")
        args, kwargs = model_file.inputs()
        with torch.no_grad():
            reference = model(*args, **kwargs)
            exported.apply(model, mesh)
            sharded = model(*args, **kwargs)
        params = dict(model.named_parameters(remove_duplicate=False))
        results[name] = {
            "max_abs_diff": (sharded - reference).abs().max().item(),
            "scale": reference.abs().max().item(),
            "local_shapes": {
                k: tuple(p.to_local().shape) for k, p in params.items() if isinstance(p, DTensor)
            },
            "tied": "transformer.wte.weight" in params
            and params["transformer.wte.weight"] is params["lm_head.weight"],
        }
    return results

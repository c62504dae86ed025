"""Rank entry for the DTensor export test: apply exported plans to example models (one spawn, several
models). Kept apart from the test module so that the spawned ranks import only what they run."""

from __future__ import annotations

import copy
import types

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from planner.frontend.modelfile import load_model_file
from runtime.launch import RankContext


def _loss(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, a scalar loss of them) of one forward (Hugging Face outputs: their `.logits`)."""
    out = model(*args, **kwargs)
    logits = getattr(out, "logits", out)
    return logits, logits.float().pow(2).mean()


def _fused_order(grad: torch.Tensor, parts: list[int], tp: int) -> torch.Tensor:
    """A fused projection's rows in the order the exported apply() stores them (rank-major pieces)."""
    pieces = [part.chunk(tp, dim=0) for part in grad.split(parts, dim=0)]
    return torch.cat([pieces[p][r] for r in range(tp) for p in range(len(parts))], dim=0)


def apply_exported(ctx: RankContext, jobs: dict[str, tuple[str, str]]) -> dict[str, dict]:
    """Each job (model file, exported source): load the source as a module, build the model (seeded,
    the same on every rank), keep an unsharded copy, apply the plan on a 1-D mesh of all ranks, run a
    forward and backward of both. Returns per job the largest output and gradient differences, the
    output scale, the local shape of every sharded parameter and whether GPT-2's token embedding is
    still tied to its LM head."""
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    results = {}
    for name, (model_path, source) in jobs.items():
        exported = types.ModuleType(f"exported_{name}")
        exec(compile(source, f"<{name} export>", "exec"), exported.__dict__)
        model_file = load_model_file(model_path)
        torch.manual_seed(0)
        model = model_file.build("cpu")
        args, kwargs = model_file.inputs()
        unsharded = copy.deepcopy(model)
        reference, loss = _loss(unsharded, args, kwargs)
        loss.backward()
        exported.apply(model, mesh)
        sharded, loss = _loss(model, args, kwargs)
        loss.backward()
        expected = dict(unsharded.named_parameters())
        grad_diff = 0.0
        for key, p in model.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            want = expected[key].grad
            module = key.rpartition(".")[0]
            if module in exported.FUSED_PARTS:
                want = _fused_order(want, exported.FUSED_PARTS[module], ctx.world_size)
            grad_diff = max(grad_diff, (grad - want).abs().max().item())
        params = dict(model.named_parameters(remove_duplicate=False))
        results[name] = {
            "max_abs_diff": (sharded - reference).abs().max().item(),
            "scale": reference.abs().max().item(),
            "grad_max_abs_diff": grad_diff,
            "local_shapes": {
                k: tuple(p.to_local().shape) for k, p in params.items() if isinstance(p, DTensor)
            },
            "tied": "transformer.wte.weight" in params
            and params["transformer.wte.weight"] is params["lm_head.weight"],
        }
    return results

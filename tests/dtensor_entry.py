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


def _logits(out) -> torch.Tensor:
    """A forward's logits (Hugging Face outputs: their `.logits`)."""
    return getattr(out, "logits", out)


def _loss(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, a scalar loss of them) of one forward."""
    logits = _logits(model(*args, **kwargs))
    return logits, logits.float().pow(2).mean()


def _fused_order(grad: torch.Tensor, parts: list[int], tp: int) -> torch.Tensor:
    """A fused projection's rows in the order the exported apply() stores them (rank-major pieces)."""
    pieces = [part.chunk(tp, dim=0) for part in grad.split(parts, dim=0)]
    return torch.cat([pieces[p][r] for r in range(tp) for p in range(len(parts))], dim=0)


def _train(exported, model_file, mesh) -> dict:
    """Forward and backward of the unsharded model and of the sharded one; largest differences."""
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
    grad_diff = grad_scale = 0.0
    for key, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = expected[key].grad
        if grad is None or want is None:  # a frozen weight (requires_grad=False) has none on either side
            assert grad is None and want is None and not p.requires_grad, key
            continue
        module = key.rpartition(".")[0]
        if module in exported.FUSED_PARTS:
            want = _fused_order(want, exported.FUSED_PARTS[module], exported.TP_DEGREE)
        grad_diff = max(grad_diff, (grad.float() - want).abs().max().item())
        grad_scale = max(grad_scale, want.abs().max().item())
    params = dict(model.named_parameters(remove_duplicate=False))
    return {
        "max_abs_diff": (sharded.float() - reference).abs().max().item(),
        "scale": reference.abs().max().item(),
        "dtype": str(sharded.dtype),
        "grad_max_abs_diff": grad_diff,
        "grad_scale": grad_scale,
        "local_shapes": {k: tuple(p.to_local().shape) for k, p in params.items() if isinstance(p, DTensor)},
        "placements": {k: str(p.placements) for k, p in params.items() if isinstance(p, DTensor)},
        "tied": "transformer.wte.weight" in params
        and params["transformer.wte.weight"] is params["lm_head.weight"],
    }


@torch.no_grad()
def _decode(exported, model_file, mesh) -> dict:
    """A prefill and one decode step (its greedy token) of a cached model, unsharded and sharded:
    largest logit differences of both steps and the cache buffers' local shapes."""
    torch.manual_seed(0)
    model = model_file.build("cpu")
    args, kwargs = model_file.inputs()
    unsharded = copy.deepcopy(model)
    exported.apply(model, mesh)
    out: dict = {"scale": 0.0, "max_abs_diff": 0.0}
    tokens, position = None, None
    for step in ("prefill", "decode"):
        if step == "decode":
            args, kwargs = model_file.step_inputs(tokens, position)
        reference = _logits(unsharded(*args, **kwargs))
        sharded = _logits(model(*args, **kwargs))
        out[f"{step}_max_abs_diff"] = (sharded - reference).abs().max().item()
        out["max_abs_diff"] = max(out["max_abs_diff"], out[f"{step}_max_abs_diff"])
        out["scale"] = max(out["scale"], reference.abs().max().item())
        tokens = reference[:, -1:].argmax(-1)  # (B, 1): the greedy next token
        position = torch.tensor([reference.shape[1]])
    out["cache_shapes"] = {k: tuple(b.shape) for k, b in model.named_buffers() if b.dim() == 4}
    out["reference_cache_shapes"] = {k: tuple(b.shape) for k, b in unsharded.named_buffers() if b.dim() == 4}
    return out


def apply_exported(ctx: RankContext, jobs: dict[str, tuple]) -> dict[str, dict]:
    """Each job (model file, exported source[, "train" | "decode" | "whole"]): load the source as a
    module, build the model (seeded, the same on every rank), keep an unsharded copy, apply the plan
    on a 1-D mesh of all ranks and run both: "train" (default) a forward and backward (largest output
    and gradient differences, the output scale, the local shape and placements of every sharded
    parameter, whether GPT-2's token embedding is still tied to its LM head), "decode" a prefill and
    a decode step of a cached model (largest logit differences, the KV-cache buffers' shapes);
    "whole": as "train" on the file's own init_mesh("cpu") (its tensor and data parallelism; every
    rank feeds the same batch, so the averaged gradients are the unsharded model's)."""
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    results = {}
    for name, (model_path, source, *mode) in jobs.items():
        exported = types.ModuleType(f"exported_{name}")
        exec(compile(source, f"<{name} export>", "exec"), exported.__dict__)
        model_file = load_model_file(model_path)
        if mode and mode[0] == "decode":
            results[name] = _decode(exported, model_file, mesh)
        elif mode and mode[0] == "whole":
            results[name] = _train(exported, model_file, exported.init_mesh("cpu"))
        else:
            results[name] = _train(exported, model_file, mesh)
    return results

"""Comparing a rank's results with the unsharded reference model (the report's `numerics`).

The reference is the unsharded model run once on the whole batch (`runtime.reference`). Every
output of the model is compared (a returned loss included), and in training the MSE loss of the
run's step and every gradient. A run passes when each worst difference over the ranks is within

    tolerance = REL_TOLERANCE[dtype] x scale

where scale is max |reference| of that output (of the loss; of the gradients, over all parameters).
An output below the rounding error of the values it was computed from (max |reference| under
REL_TOLERANCE x the largest |value| its last op read: the mean of normalised activations, a centred
statistic, an auxiliary term near 0) has no digits to compare relatively: its scale is that of those
operands (`operand_scales`), so it is held to their rounding error.
Why relative to the output's scale: a sharded run computes the same sums in another order (partial
matmuls all-reduced, vocabulary shards gathered), so its error is rounding error, which grows with
the magnitude of the values, not a fixed absolute amount. Why these factors: the unit roundoff
(torch.finfo(dtype).eps: fp32 1.2e-7, fp16 9.8e-4, bf16 7.8e-3) times the depth of reordered
accumulations of a model, with margin: fp32 1e-4 (~800 ulp; the project's parity tests see below
1e-5), fp16 1e-2 (~10 ulp), bf16 5e-2 (~6 ulp; torch.testing.assert_close allows 1.6e-2 for a single
bf16 op, and a network stacks several). A plan that computes something else (a wrong split, an
input sliced that should not be, dropped outputs) differs by a sizeable fraction of the scale, far
above all of these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from costmodels.dtypes import TORCH_NAMES

# max |sharded - unsharded| allowed, as a fraction of max |unsharded| (see the module docstring)
REL_TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def tolerance_for(dtype: str) -> float:
    """The relative tolerance of outputs in `dtype`: a torch name ("float32", "torch.bfloat16", ...) or
    a plan's ("fp32", "bf16", "fp16"); an unknown (e.g. integer) dtype is compared exactly (0.0)."""
    name = str(dtype).removeprefix("torch.")
    return REL_TOLERANCE.get(TORCH_NAMES.get(name, name), 0.0)


def operand_scales(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> list[float]:
    """Per tensor output of `gm` (`all_outputs` order): the largest |value| among the tensors the op
    that computes it reads (0.0 for an output that is a graph input or a constant). Runs `gm` once
    more on `inputs` without autograd, keeping only those maxima, and restores the buffers and the RNG
    it would change (the module docstring: the scale of an output that cancels below its operands'
    rounding)."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = [x for x in pytree.tree_leaves(out_node.args[0]) if isinstance(x, torch.fx.Node)]
    outputs, operands = set(leaves), {m for n in leaves for m in n.all_input_nodes}
    seen: dict[torch.fx.Node, float] = {}
    tensor_leaf: dict[torch.fx.Node, bool] = {}

    class _Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            value = super().run_node(n)
            if n in operands:
                seen[n] = max((max_abs(t) for t in pytree.tree_leaves(value) if _floating(t)), default=0.0)
            if n in outputs:
                tensor_leaf[n] = isinstance(value, torch.Tensor)
            return value

    # the extra run leaves no trace: buffers the graph updates in place (BatchNorm's running
    # statistics in train mode, a KV cache) and the RNG are restored
    buffers = {name: b.detach().clone() for name, b in gm.named_buffers()}
    rng = torch.get_rng_state()
    with torch.no_grad():
        _Recorder(gm).run(*inputs)
        for name, b in gm.named_buffers():
            if not torch.equal(b, buffers[name]):
                b.copy_(buffers[name])
    torch.set_rng_state(rng)
    return [
        max((seen.get(m, 0.0) for m in n.all_input_nodes), default=0.0)
        for n in leaves
        if tensor_leaf.get(n, False)
    ]


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0


def output_tolerance_scale(scale: float, operand_scale: float | None, rel: float | None) -> float:
    """The scale an output's tolerance is relative to: max |reference output| (`scale`), or, when that
    is below `rel` x the largest |value| its last op read (`operand_scale`), that operand scale."""
    if rel and operand_scale and scale < rel * operand_scale:
        return operand_scale
    return scale


def all_outputs(out: Any) -> tuple[torch.Tensor, ...]:
    """Every tensor of a model call's output, in pytree order (the captured graph's output order)."""
    return tuple(x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor))


def replica_share(
    full: torch.Tensor, local_shape: Sequence[int], dp: int, dp_rank: int
) -> torch.Tensor | None:
    """The part of the whole-batch reference `full` that DP replica `dp_rank` of `dp` computes, for a
    local output of shape `local_shape`: `full` itself when the shapes agree, else its `dp_rank`-th
    chunk along the one dim whose size is dp x the local size (the output's batch dim). None when no
    such dim exists (the shapes cannot be matched)."""
    if tuple(full.shape) == tuple(local_shape):
        return full
    if len(full.shape) != len(local_shape):
        return None
    dims = [
        d
        for d, (a, b) in enumerate(zip(full.shape, local_shape))
        if a != b
        and a == b * dp
        and all(x == y for i, (x, y) in enumerate(zip(full.shape, local_shape)) if i != d)
    ]
    if len(dims) != 1:
        return None
    return full.chunk(dp, dim=dims[0])[dp_rank]


DIFF_CHUNK_ELEMENTS = 1 << 18  # max_abs_diff's float64 work per chunk: 2 MiB a temporary (three at once)


def max_abs_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| in float64 (inf when a value is NaN in one and not the other), over chunks of
    `DIFF_CHUNK_ELEMENTS` (whole-tensor float64 temporaries were 4x the tensor's fp32 bytes at once:
    ~0.3 GiB for GPT-2's vocabulary-sharded embedding gradient, the rank's peak memory)."""
    got, want = torch.broadcast_tensors(got.detach(), want.detach())
    got, want = got.reshape(-1), want.reshape(-1)
    worst = 0.0
    for start in range(0, got.numel(), DIFF_CHUNK_ELEMENTS):
        stop = start + DIFF_CHUNK_ELEMENTS
        diff = (got[start:stop].double() - want[start:stop].double()).abs()
        if bool(diff.isnan().any()):
            return float("inf")
        worst = max(worst, float(diff.max()))
    return worst


def max_abs(t: torch.Tensor) -> float:
    """max |t| (0.0 for an empty tensor), over chunks of `DIFF_CHUNK_ELEMENTS`: a check's scale
    without a whole-tensor temporary (a float64 copy of a big-vocabulary output was 2x its bytes)."""
    flat = t.detach().reshape(-1)
    worst = 0.0
    for start in range(0, flat.numel(), DIFF_CHUNK_ELEMENTS):
        worst = max(worst, float(flat[start : start + DIFF_CHUNK_ELEMENTS].abs().max()))
    return worst


def training_target(reference_out: torch.Tensor) -> torch.Tensor:
    """A fixed regression target shaped like the reference output (values -1 .. 1), for the MSE loss
    that the run's training step minimises; the same on every rank."""
    values = torch.linspace(-1.0, 1.0, reference_out.numel(), device=reference_out.device)
    return values.reshape(reference_out.shape)


def check_failures(numerics: dict[str, Any]) -> list[str]:
    """One line per quantity of a run's `numerics` section (`runtime.job.summarise`) whose worst
    difference exceeds its tolerance, saying by how much; empty when the run matches."""
    rel = numerics.get("tolerance_rel")
    if rel is None:
        return []
    lines = []
    for out in numerics.get("outputs", []):
        if out["max_abs_diff"] is not None and out["max_abs_diff"] > out["tolerance"]:
            out_rel, out_dtype = out.get("tolerance_rel", rel), out.get("dtype") or numerics["dtype"]
            held = (
                f"output scale {out['scale']:.3g}"
                if out.get("output_scale") in (None, out["scale"])
                else f"the scale of its last op's operands, {out['scale']:.3g}: the output itself, at most "
                f"{out['output_scale']:.3g}, is below their rounding"
            )
            lines.append(
                f"output {out['index']}: max |sharded - unsharded| = {out['max_abs_diff']:.3g}, "
                f"tolerance {out['tolerance']:.3g} ({out_rel or 0.0:g} x {held}, {out_dtype})"
            )
    train_rel = numerics.get("train_tolerance_rel") or rel  # the loss's output and the run's dtype
    for what, diff, scale in (
        ("training loss", numerics.get("loss_diff"), numerics.get("loss_scale")),
        ("gradients", numerics.get("grad_max_abs_diff"), numerics.get("grad_scale")),
    ):
        if diff is not None and scale is not None and diff > train_rel * scale:
            where = numerics.get("grad_worst") if what == "gradients" else None
            lines.append(
                f"{what}: max |sharded - unsharded| = {diff:.3g}"
                + (f" (worst: {where})" if where else "")
                + f", tolerance {train_rel * scale:.3g} ({train_rel:g} x scale {scale:.3g})"
            )
    diff, diff_tol = numerics.get("routing_logit_diff"), numerics.get("routing_tolerance")
    if numerics.get("routing_calls") and diff is not None and diff_tol is not None and diff > diff_tol:
        lines.append(
            f"expert routing: the routers' logits differ from the unsharded model's by {diff:.3g}, tolerance "
            f"{diff_tol:.3g} ({rel:g} x their scale); the check replays the unsharded model's expert choices, "
            f"which would otherwise hide a wrong router ({numerics.get('routing_flipped')} token choice(s) went "
            "elsewhere here)"
        )
    if numerics.get("grads_compared") == 0:
        lines.append("gradients: none compared (no rank's gradients matched a reference gradient by name)")
    update, tol = numerics.get("update_max_abs_diff"), numerics.get("update_tolerance")
    if update is not None and tol is not None and update > tol:
        lines.append(
            f"optimizer update: max |sharded - unsharded| = {update:.3g} after the first Adam step, tolerance "
            f"{tol:.3g} (a tenth of the learning rate)"
        )
    return lines

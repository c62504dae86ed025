"""fp16 training's loss scaling (`planner.plan.Plan.loss_scale`), on torch's own gradient scaler.

fp16's smallest normal number is 6.1e-5 (torch.finfo(torch.float16).tiny). A training step's gradients
are often far smaller: the mean of a loss over a few million logits hands each one a gradient of about
1e-6, which fp16 keeps as a subnormal with a few bits, or as zero. Loss scaling multiplies the loss by a
scale S before the backward, so every gradient is S times larger while it flows through fp16, and
divides the gradients by S, in fp32, before the optimizer steps them (Micikevicius et al. 2018, "Mixed
Precision Training", section 3.2). A step whose gradients overflow (inf / NaN) is skipped on every rank.

- "dynamic": torch.amp.GradScaler's policy (its documented defaults): S starts at 2**16, is halved at
  each overflow and doubled after 2,000 steps in a row without one.
- a number: a static scale, as Megatron-LM's --loss-scale; an overflowing step is still skipped.

The run uses `torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`: GradScaler whose
found-inf flag is all-reduced over a process group (here every rank: each holds other parameters or
other slices of them, and all must skip a step together). The optimizers of `runtime.data_parallel`
step through `LossScaler.step` (their fp32 gradients of the master weights are the ones unscaled); the
training loops scale each micro-batch's loss (`scale_loss`) and call `update` once per step.

The unsharded reference (`runtime.reference`) looks for its scale the way a dynamic scaler's skipped
steps would: from the plan's starting scale, halved until the whole batch's gradients are finite
(`reference_scale`); the runs start from that scale, so the checked step is the first one a scaler
would take, and its scaled gradients compare with the reference's like with like.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from planner.plan import (
    BACKOFF_FACTOR,
    DYNAMIC_INIT_SCALE,
    DYNAMIC_LOSS_SCALE,
    GROWTH_FACTOR,
    GROWTH_INTERVAL,
)

# the most halvings `reference_scale` tries: 2**16 down to 2**-24, below which a scale shrinks the
# gradients rather than saving them
MAX_HALVINGS = 40


def initial_scale(loss_scale: float | str | None) -> float | None:
    """The scale a plan's loss scaling starts from: 2**16 when dynamic, the static scale, or None."""
    if loss_scale is None:
        return None
    return DYNAMIC_INIT_SCALE if loss_scale == DYNAMIC_LOSS_SCALE else float(loss_scale)


def reference_scale(
    loss_scale: float | str | None,
    backward: Callable[[float], None],
    grads: Callable[[], Sequence[torch.Tensor]],
    headroom: float = 1.0,
) -> float | None:
    """The scale of the unsharded reference's one step: `backward(scale)` runs the backward of the
    loss times ``scale`` (the gradients set anew, not accumulated), `grads()` returns the gradients.
    Dynamic: from `DYNAMIC_INIT_SCALE`, halved until every gradient is finite at the scale times
    ``headroom`` (what a dynamic scaler's skipped steps reach on the ranks: a data-parallel or
    context-parallel rank's loss is a mean over its share of the elements, so the gradients the
    backward carries are dp x cp times the whole batch's at the same scale). Static: the plan's scale,
    checked so. The gradients left are the scale's. None: no scaling (`backward(1.0)` once).
    Raises ValueError when the gradients are not finite at the static scale, or at any dynamic one."""
    scale = initial_scale(loss_scale)
    if scale is None:
        backward(1.0)
        return None
    for _ in range(MAX_HALVINGS if loss_scale == DYNAMIC_LOSS_SCALE else 1):
        backward(scale * headroom)
        if all(bool(torch.isfinite(g).all()) for g in grads()):
            if headroom != 1.0:
                backward(scale)
            return scale
        scale *= BACKOFF_FACTOR
    share = (
        f" times {headroom:g} (a rank's share of the batch: its mean loss has dp x cp times the gradients)"
    )
    if loss_scale == DYNAMIC_LOSS_SCALE:
        raise ValueError(
            f"the fp16 gradients are not finite at any loss scale from 2^16 down to 2^{int(math.log2(scale)) + 1}"
            f"{share if headroom != 1.0 else ''}: the forward itself overflows fp16 (|x| > 65504); train in bf16"
        )
    raise ValueError(
        f"the fp16 gradients overflow at the static loss scale {loss_scale:g}{share if headroom != 1.0 else ''}: "
        "use a smaller one, or dynamic"
    )


class LossScaler:
    """One rank's loss scaler for a plan's loss scaling: `scale_loss` per micro-batch, the optimizers'
    `step` (unscale, check, step unless a gradient overflowed on any rank), `update` once per step.

    mode: "dynamic" or a static scale (a positive number); start: the scale of the first step (the
    reference's, `reference_scale`); device: "cpu" or "cuda". Every rank skips an overflowing step
    together (the flag all-reduced over the default group)."""

    def __init__(
        self,
        mode: float | str,
        start: float,
        device: str,
    ):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # noqa: PLC0415

        self.dynamic = mode == DYNAMIC_LOSS_SCALE
        self.static_scale = None if self.dynamic else float(mode)
        self._scaler = ShardedGradScaler(
            device=torch.device(device).type,
            init_scale=start,
            growth_factor=GROWTH_FACTOR,
            backoff_factor=BACKOFF_FACTOR,
            growth_interval=GROWTH_INTERVAL,
            process_group=dist.group.WORLD,
        )
        # GradScaler makes its scale tensor at its first scale(): a pipeline rank without the loss never calls it
        self._scaler.scale(torch.zeros((), device=device))
        self.steps = 0
        self.skipped = 0
        self._skipped_now = False
        self._first_scale: float | None = None

    @property
    def scale(self) -> float:
        """The scale the next backward runs at."""
        return float(self._scaler.get_scale())

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the scale: 0-dim, fp32 (the scale is an fp32 tensor; an fp16 loss would
        overflow at 2**16 on its own)."""
        return self._scaler.scale(loss.float()).reshape(())

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide the gradients `optimizer` steps by the scale in place and look for inf / NaN (the
        flag all-reduced over the group), then step it unless any rank found one. Returns whether it
        stepped. Call once per optimizer per training step, then `update` once."""
        self._scaler.step(optimizer)
        # the all-reduced flags GradScaler.step read (the one record of its choice it keeps)
        stepped = not any(float(v) > 0 for v in self._scaler._found_inf_per_device(optimizer).values())
        self._skipped_now |= not stepped
        return stepped

    def update(self) -> None:
        """End of a training step: dynamic, the scale halves after an overflow and doubles after
        `GROWTH_INTERVAL` steps without one; static, it stays."""
        if self._first_scale is None:
            self._first_scale = self.scale
        self.steps += 1
        self.skipped += int(self._skipped_now)
        self._skipped_now = False
        if self.dynamic:
            self._scaler.update()
        else:
            self._scaler.update(new_scale=self.static_scale)

    def note(self) -> str:
        """One line for the run's report, after the checked step (`update` called once)."""
        kind = "dynamic (torch.amp.GradScaler's policy)" if self.dynamic else f"static {self.static_scale:g}"
        first = self._first_scale if self._first_scale is not None else self.scale
        skipped = (
            f"; {self.skipped} of {self.steps} step(s) skipped for inf / NaN gradients"
            if self.skipped
            else ""
        )
        return f"loss scaling: {kind}; the checked step ran at scale {first:g}{skipped}"


def attach(optimizer: object, scaler: LossScaler | None) -> None:
    """Make ``optimizer`` (a `runtime.data_parallel` optimizer, or one holding several in ``parts``)
    step its Adam through ``scaler``."""
    for part in getattr(optimizer, "parts", None) or [optimizer]:
        part.loss_scaler = scaler


def for_run(loss_scale: float | str | None, start: float, device: str) -> LossScaler | None:
    """A rank's `LossScaler` for a plan's ``loss_scale`` starting at the reference's scale ``start``
    (`runtime.job.ReferenceFiles.loss_scale_factor`), or None without loss scaling."""
    if loss_scale is None:
        return None
    return LossScaler(loss_scale, start, device)


def backward(loss: torch.Tensor, scaler: LossScaler | None) -> None:
    """``loss``'s backward, times the scale under loss scaling."""
    (scaler.scale_loss(loss) if scaler is not None else loss).backward()

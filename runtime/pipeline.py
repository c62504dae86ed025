"""Running pipeline stages: this rank's stage through a `torch.distributed.pipelining` schedule.

`PipelineRunner` runs one stage (from `passes.pipeline.split_stages`, via `passes.lower.lower_for_rank`)
per rank of the `pp` process group (stage index = rank in that group), micro-batches along dim 0,
`PipelineStage` with the plan's schedule (`planner.plan.Schedule`: GPIPE -> `ScheduleGPipe`,
ONE_F_ONE_B -> `Schedule1F1B`). Captured graphs have literal shapes, so the graph must be captured
(and TP-rewritten) at the micro-batch size, batch / micro_batches; a mismatch is a ValueError.

The stage's P2P metadata is static, taken from `node.meta["val"]` (no shape-inference forward with
empty buffers, so integer tensors crossing a boundary, such as token ids or positions used by a later
stage's embedding, are safe). Only floating-point values that depend on a trainable parameter
(`passes.pipeline.requires_grad_nodes`) are marked as needing a gradient; integer tensors and
parameter-free float values (RoPE tables, masks) cross stages in forward only, and no gradient is sent
back for them.

`all_reduce_tied_gradients` sums the gradients of a parameter that two stages hold a copy of
(`passes.pipeline.tied_parameters`: GPT-2's tied embedding / LM head) after each backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from passes.pipeline import PipelineSplitError, requires_grad_nodes
from planner.plan import Schedule

SCHEDULE_CLASSES = {Schedule.GPIPE: ScheduleGPipe, Schedule.ONE_F_ONE_B: Schedule1F1B}


class _ContiguousOutputs(nn.Module):
    """Wraps a non-last stage so the tensors it sends are contiguous (P2P sends need dense tensors)."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.contiguous() for t in self.stage(*args))


def _example(val: torch.Tensor, requires_grad: bool, device: torch.device) -> torch.Tensor:
    t = torch.empty(tuple(val.shape), dtype=val.dtype, device=device)
    return t.requires_grad_(requires_grad and val.dtype.is_floating_point)


def _stage_io_examples(
    stage: fx.GraphModule, stage_index: int, device: torch.device
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Static P2P metadata of a stage: example inputs and outputs (contiguous, shapes from node.meta)."""
    trainable = requires_grad_nodes(stage)
    placeholders = [n for n in stage.graph.nodes if n.op == "placeholder"]
    outs = stage.graph.output_node().args[0]
    out_nodes = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    for node in placeholders + out_nodes:
        if not isinstance(node, fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
            raise PipelineSplitError(
                f"stage {stage_index}: input or output {node} has no tensor node.meta['val']"
            )
    inputs = tuple(_example(n.meta["val"], stage_index > 0 and n in trainable, device) for n in placeholders)
    outputs = tuple(_example(n.meta["val"], n in trainable, device) for n in out_nodes)
    return inputs, outputs


def _check_batch(
    inputs: Sequence[torch.Tensor], examples: Sequence[torch.Tensor], micro_batches: int
) -> None:
    if len(inputs) != len(examples):
        raise ValueError(
            f"stage 0 takes {len(examples)} inputs (the graph's placeholders), got {len(inputs)}"
        )
    for i, (x, ex) in enumerate(zip(inputs, examples)):
        want = (ex.shape[0] * micro_batches, *ex.shape[1:]) if ex.dim() else ()
        if tuple(x.shape) != tuple(want):
            raise ValueError(
                f"input {i} has shape {tuple(x.shape)}; the graph was captured for micro-batches of shape "
                f"{tuple(ex.shape)}, so {micro_batches} micro-batches need {tuple(want)}. Capture the model at "
                "batch / micro_batches (captured graphs have literal shapes)"
            )


class PipelineRunner:
    """This rank's stage of a pipeline, with its `torch.distributed.pipelining` schedule built once.

    Building a `PipelineStage` and schedule costs P2P handshakes (about 100 ms on gloo for the tiny
    Llama, five times its step), so code that runs many steps (timing, training loops) builds one
    runner and calls `forward` / `train_step` repeatedly. Every rank of the pp group must make the
    same calls in the same order (each builds its schedule lazily, on first use, collectively).

    stage_module: this rank's stage (`passes.lower.lower_for_rank(...).module`, captured at the
    micro-batch size). stage_index must equal this rank's rank in `pp_group` (None: the default group)
    and num_stages its size. schedule: the plan's `Schedule` ("gpipe" / "1f1b" are accepted too); 1F1B
    needs micro_batches >= num_stages. loss_fn(output_micro_batch, target_micro_batch) -> scalar mean
    loss; needed for train_step. Raises ValueError for a bad schedule, micro_batches or group layout.
    """

    def __init__(
        self,
        stage_module: fx.GraphModule,
        stage_index: int,
        num_stages: int,
        micro_batches: int,
        pp_group: dist.ProcessGroup | None,
        device: torch.device | str,
        schedule: Schedule | str,
        *,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        try:
            schedule = Schedule(schedule)
        except ValueError:
            raise ValueError(
                f"schedule must be one of {[str(s) for s in Schedule]}, got {schedule!r}"
            ) from None
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        if schedule is Schedule.ONE_F_ONE_B and micro_batches < num_stages:
            raise ValueError(
                f"schedule 1f1b needs micro_batches({micro_batches}) >= num_stages({num_stages}); "
                "use more micro-batches or the gpipe schedule"
            )
        group_rank = dist.get_rank(pp_group) if pp_group is not None else dist.get_rank()
        group_size = dist.get_world_size(pp_group) if pp_group is not None else dist.get_world_size()
        if group_size != num_stages or group_rank != stage_index:
            raise ValueError(
                f"stage_index({stage_index}) / num_stages({num_stages}) must equal this rank's "
                f"rank({group_rank}) / size({group_size}) in the pp group: one stage per rank"
            )
        self.stage_module = stage_module
        self.stage_index, self.num_stages, self.micro_batches = stage_index, num_stages, micro_batches
        self.pp_group = pp_group
        self.device = torch.device(device)
        self.schedule = schedule
        self.schedule_class = SCHEDULE_CLASSES[schedule]  # the torch.distributed.pipelining class run
        self.loss_fn = loss_fn
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self._examples, self._outputs = _stage_io_examples(stage_module, stage_index, self.device)
        self._schedules: dict[bool, Any] = {}  # training? -> schedule

    def _schedule(self, training: bool) -> Any:
        if training not in self._schedules:
            module = self.stage_module if self.is_last else _ContiguousOutputs(self.stage_module)
            stage = PipelineStage(
                module,
                self.stage_index,
                self.num_stages,
                self.device,
                input_args=self._examples,
                output_args=self._outputs,
                group=self.pp_group,
            )
            loss_fn = self.loss_fn if training else None
            self._schedules[training] = self.schedule_class(
                stage, n_microbatches=self.micro_batches, loss_fn=loss_fn
            )
        return self._schedules[training]

    def _stage_args(self, inputs_or_none: Sequence[torch.Tensor] | None) -> tuple:
        if not self.is_first:
            return ()
        if inputs_or_none is None:
            raise ValueError("stage 0 needs the pipeline's inputs")
        args = tuple(x.to(self.device) for x in inputs_or_none)
        _check_batch(args, self._examples, self.micro_batches)
        return args

    def forward(self, inputs_or_none: Sequence[torch.Tensor] | None) -> Any:
        """One forward pass (under `torch.no_grad()`, no loss). inputs_or_none: on stage 0 the graph's
        inputs for the whole batch, each (micro_batches * b, ...) with b the captured batch; None
        elsewhere. Returns on the last stage the graph's output for the whole batch (micro-batch
        outputs concatenated along dim 0; a tuple for a multi-output graph), None elsewhere.
        Raises ValueError for a missing or mis-shaped input."""
        args = self._stage_args(inputs_or_none)
        with torch.no_grad():
            out = self._schedule(False).step(*args)
        return out if self.is_last else None

    def train_step(
        self, inputs_or_none: Sequence[torch.Tensor] | None, target: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Forward and backward of one training step; accumulates into the stage parameters' `.grad`.

        target: whole batch, split along dim 0 like the inputs; required on the last stage, ignored
        elsewhere. Gradients are scaled by 1 / micro_batches, so with a mean loss_fn they equal the
        gradients of the mean loss over the whole batch (zero them before the step). Tied parameters
        (`passes.pipeline.tied_parameters`) still need `all_reduce_tied_gradients` afterwards. Returns the mean of the
        micro-batch losses (detached) on the last stage, None elsewhere.
        """
        if self.loss_fn is None:
            raise ValueError("train_step needs a runner built with loss_fn")
        args = self._stage_args(inputs_or_none)
        if self.is_last and target is None:
            raise ValueError("the last stage needs `target` for the loss")
        losses: list[torch.Tensor] = []
        with torch.enable_grad():
            self._schedule(True).step(
                *args,
                target=target.to(self.device) if self.is_last else None,
                losses=losses if self.is_last else None,
            )
        return torch.stack([loss.detach() for loss in losses]).mean() if self.is_last else None


def all_reduce_tied_gradients(
    stage_module: nn.Module,
    stage_index: int,
    tied: Sequence[tuple[int, str, int, str]],
    pp_group: dist.ProcessGroup | None,
) -> None:
    """Sum the gradients of tied parameter copies between their two stages, in place.

    tied: `passes.pipeline.tied_parameters(stages)`, `RankLowering.tied` (the same list on every rank). For each pair this rank's stage
    is in, the two ranks exchange the gradient over `pp_group` (stage index = rank in the group) and
    both set grad = grad_a + grad_b. Pairs are handled in list order, so it cannot deadlock. A missing
    gradient counts as zero. Call after the backward, before the optimizer step.
    """
    for a, fqn_a, b, fqn_b in tied:
        if stage_index not in (a, b) or a == b:
            continue
        mine, peer = (fqn_a, b) if stage_index == a else (fqn_b, a)
        param = stage_module.get_parameter(mine)
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        peer_rank = dist.get_global_rank(pp_group, peer) if pp_group is not None else peer
        received = torch.empty_like(param.grad)
        ops = [
            dist.P2POp(dist.isend, param.grad.contiguous(), peer_rank, pp_group),
            dist.P2POp(dist.irecv, received, peer_rank, pp_group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        # a + b in the same order on both ranks: the two copies stay bit-identical
        param.grad = param.grad + received if stage_index == a else received + param.grad

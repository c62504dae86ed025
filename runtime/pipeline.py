"""Running pipeline stages: this rank's stage through a `torch.distributed.pipelining` schedule.

`PipelineRunner` runs one stage (from `passes.pipeline.split_stages`, via `passes.lower.lower_for_rank`)
per rank of the `pp` process group (stage index = rank in that group), micro-batches along each
input's batch dim (`planner.frontend.capture.input_batch_dims`; an input without one, such as a (T, T)
attention bias, goes whole to every micro-batch), `PipelineStage` with the plan's schedule
(`planner.plan.Schedule`: GPIPE -> `ScheduleGPipe`, ONE_F_ONE_B -> `Schedule1F1B`,
INTERLEAVED_1F1B -> `ScheduleInterleaved1F1B`). With the interleaved schedule a rank runs v model
chunks (`Plan.virtual_stages`, `passes.lower.RankLowering.chunks`): chunk c of pp rank r is virtual
stage c * pp + r of pp * v, the placement `ScheduleInterleaved1F1B` computes its actions for. That
schedule needs micro_batches divisible by its rounds, max(1, micro_batches // pp) (torch 2.13; the
original paper's micro_batches % pp == 0 satisfies it). Captured graphs have literal shapes, so the
graph must be captured (and TP-rewritten) at the micro-batch size, batch / micro_batches; a mismatch
is a ValueError.

The stage's P2P metadata is static, taken from `node.meta["val"]` (no shape-inference forward with
empty buffers, so integer tensors crossing a boundary, such as token ids or positions used by a later
stage's embedding, are safe). Only floating-point values that depend on a trainable parameter
(`passes.pipeline.requires_grad_nodes`) are marked as needing a gradient; integer tensors and
parameter-free float values (RoPE tables, masks) cross stages in forward only, and no gradient is sent
back for them.

`all_reduce_tied_gradients` sums the gradients of a parameter that two or more stages hold a copy of
(`passes.pipeline.tied_parameters`: GPT-2's tied embedding / LM head) after each backward;
`sum_tied_gradients` does it for ranks holding several chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate
from torch.distributed.pipelining.stage import _make_tensor_from_meta
from torch.utils._pytree import tree_flatten, tree_unflatten

from passes.pipeline import PipelineSplitError, requires_grad_nodes
from planner.plan import Schedule

SCHEDULE_CLASSES = {
    Schedule.GPIPE: ScheduleGPipe,
    Schedule.ONE_F_ONE_B: Schedule1F1B,
    Schedule.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
}


class _ContiguousOutputs(nn.Module):
    """Wraps a non-last stage so the tensors it sends are contiguous (P2P sends need dense tensors)."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.contiguous() for t in self.stage(*args))


class _JustInTimeStage(PipelineStage):
    """`PipelineStage` whose receive buffers exist only while a micro-batch needs them.

    torch 2.13's stage allocates, when the schedule starts, an activation receive buffer for every
    micro-batch of the step and (training) an output-gradient receive buffer for every micro-batch,
    and keeps them, with the gradient the backward leaves on each received input, until the stage is
    dropped: m messages per direction per stage (pytorch/pytorch#136380; #193872 and #196463 move it
    to allocation just in time, unreleased in 2.13). With many micro-batches that is more than the
    activations the schedule holds (NVIDIA-NeMo/Automodel#3780 measured ~52 GiB on middle stages of a
    64-micro-batch run, and pools them). Here each buffer is made when its receive is posted and
    released when its micro-batch's backward has run (a forward-only schedule: its forward; the loss
    the schedule keeps to the step's end is detached then, or its graph would hold them), so a
    stage holds the received inputs of the micro-batches in flight (part of the activations the
    planner prices) and one output gradient at a time (`planner.solver.costing.pipeline_buffer_bytes`).
    A forward-only schedule also drops each micro-batch's cached output once it is sent, which torch
    keeps for a backward that never comes. Private torch API (`_RecvInfo.buffer`,
    `_make_tensor_from_meta`, `fwd_cache`), pinned with torch."""

    def _fresh(self, infos: tuple) -> None:
        for info in infos:
            if not info.is_root_arg and info.tensor_meta is not None:
                info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)

    def _release(self, infos: tuple) -> None:
        for info in infos:
            if not info.is_root_arg and info.tensor_meta is not None:
                info.buffer = self._released

    @property
    def _released(self) -> torch.Tensor:
        """What a released receive slot holds (nothing is received into it before `_fresh`)."""
        if not hasattr(self, "_empty"):
            self._empty = torch.empty(0, device=self.device)
        return self._empty

    def _prepare_forward_infra(self, num_microbatches: int, *args: Any, **kwargs: Any) -> Any:
        out = super()._prepare_forward_infra(num_microbatches, *args, **kwargs)
        for infos in self.args_recv_info.values():
            self._release(infos)
        return out

    def _prepare_backward_infra(self, num_microbatches: int, *args: Any, **kwargs: Any) -> Any:
        out = super()._prepare_backward_infra(num_microbatches, *args, **kwargs)
        for infos in self.grad_recv_info.values():
            self._release(infos)
        return out

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        self._fresh(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if self.has_backward and not self.is_last:
            self._fresh(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if not self.has_backward:
            self._release(self.args_recv_info[fwd_chunk_id])
        return out

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if not self.has_backward:  # the ops hold the tensors they send (the last stage: its output
            # chunks hold its outputs)
            self.fwd_cache.pop(fwd_chunk_id, None)
        return ops

    def backward_one_chunk(
        self,
        bwd_chunk_id: int,
        loss: torch.Tensor | None = None,
        full_backward: bool = True,
        last_backward: bool = False,
    ) -> None:
        super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        if not self.has_backward:  # (a forward-only schedule calls it too: nothing ran)
            return
        # the schedule keeps every micro-batch's loss to the step's end; its graph (no saved tensors
        # left, but the nodes) would keep this micro-batch's received input and its gradient alive
        if isinstance(loss, torch.Tensor) and loss.grad_fn is not None and not loss._is_view():
            loss.detach_()
        self._release(self.args_recv_info[bwd_chunk_id])
        if not self.is_last:
            self._release(self.grad_recv_info[bwd_chunk_id])


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


def _merge_spec(outputs: Any) -> Any:
    """`output_merge_spec` for the last stage's outputs (their example values, any pytree): None
    (torch's default: every output concatenated along dim 0) unless one is a 0-dim tensor (a loss or
    statistic over the whole batch, which `torch.cat` cannot join: "zero-dimensional tensor cannot be
    concatenated"); that one is taken from the first micro-batch, which is exact because the planner
    runs such a model as one micro-batch (its output reduces over the batch:
    `ModelStructure.batch_mixing`)."""
    leaves, spec = tree_flatten(outputs)
    if all(not isinstance(t, torch.Tensor) or t.dim() > 0 for t in leaves):
        return None
    return tree_unflatten(
        [TensorChunkSpec(0) if isinstance(t, torch.Tensor) and t.dim() > 0 else None for t in leaves], spec
    )


def _chunk_specs(batch_dims: Sequence[int | None]) -> tuple[Any, ...]:
    """The schedule's `args_chunk_spec`: split a batched input on its batch dim, replicate the others.

    (`_Replicate` is how `torch.distributed.pipelining.microbatch` spells "every micro-batch gets the
    whole tensor"; it has no public name in torch 2.13.)
    """
    return tuple(_Replicate if dim is None else TensorChunkSpec(dim) for dim in batch_dims)


def _check_batch(
    inputs: Sequence[torch.Tensor],
    examples: Sequence[torch.Tensor],
    micro_batches: int,
    batch_dims: Sequence[int | None],
) -> None:
    if len(inputs) != len(examples):
        raise ValueError(
            f"stage 0 takes {len(examples)} inputs (the graph's placeholders), got {len(inputs)}"
        )
    for i, (x, ex, dim) in enumerate(zip(inputs, examples, batch_dims)):
        want = list(ex.shape)
        if dim is not None:
            want[dim] *= micro_batches
        if tuple(x.shape) != tuple(want):
            raise ValueError(
                f"input {i} has shape {tuple(x.shape)}; the graph was captured for micro-batches of shape "
                f"{tuple(ex.shape)} (batch dim {dim}), so {micro_batches} micro-batches need {tuple(want)}. "
                "Capture the model at batch / micro_batches (captured graphs have literal shapes)"
            )


class PipelineRunner:
    """This rank's stage (or model chunks) of a pipeline, with its `torch.distributed.pipelining`
    schedule built once.

    Building a `PipelineStage` and schedule costs P2P handshakes (about 100 ms on gloo for the tiny
    Llama, five times its step), so code that runs many steps (timing, training loops) builds one
    runner and calls `forward` / `train_step` repeatedly. Every rank of the pp group must make the
    same calls in the same order (each builds its schedule lazily, on first use, collectively).

    stage_module: this rank's stage (`passes.lower.lower_for_rank(...).module`, captured at the
    micro-batch size), or its model chunks in order (`RankLowering.chunks`: chunk c is virtual stage
    c * num_stages + stage_index); more than one chunk needs the interleaved schedule. stage_index
    must equal this rank's rank in `pp_group` (None: the default group) and num_stages its size (pipeline
    ranks, not virtual stages). schedule: the plan's `Schedule` ("gpipe" / "1f1b" / "interleaved_1f1b"
    are accepted too); 1F1B needs micro_batches >= num_stages, interleaved 1F1B micro_batches divisible
    by max(1, micro_batches // num_stages). loss_fn(output_micro_batch, target_micro_batch) -> scalar
    mean loss; needed for train_step. input_batch_dims: per graph input (stage 0's placeholders), its
    batch dim or None (given whole to every micro-batch); None means dim 0 for all. Raises ValueError
    for a bad schedule, chunk count, micro_batches, group layout or input_batch_dims.
    """

    def __init__(
        self,
        stage_module: fx.GraphModule | Sequence[fx.GraphModule],
        stage_index: int,
        num_stages: int,
        micro_batches: int,
        pp_group: dist.ProcessGroup | None,
        device: torch.device | str,
        schedule: Schedule | str,
        *,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
        input_batch_dims: Sequence[int | None] | None = None,
    ) -> None:
        try:
            schedule = Schedule(schedule)
        except ValueError:
            raise ValueError(
                f"schedule must be one of {[str(s) for s in Schedule]}, got {schedule!r}"
            ) from None
        chunks = [stage_module] if isinstance(stage_module, fx.GraphModule) else list(stage_module)
        if not chunks:
            raise ValueError("a pipeline rank needs at least one stage module")
        if len(chunks) > 1 and schedule is not Schedule.INTERLEAVED_1F1B:
            raise ValueError(
                f"schedule {schedule} runs one stage per rank but this rank has {len(chunks)} model chunks "
                "(virtual stages); more than one chunk needs the interleaved_1f1b schedule"
            )
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        if schedule is Schedule.ONE_F_ONE_B and micro_batches < num_stages:
            raise ValueError(
                f"schedule 1f1b needs micro_batches({micro_batches}) >= num_stages({num_stages}); "
                "use more micro-batches or the gpipe schedule"
            )
        rounds = max(1, micro_batches // num_stages)
        if schedule is Schedule.INTERLEAVED_1F1B and micro_batches % rounds:
            raise ValueError(
                f"schedule interleaved_1f1b needs micro_batches({micro_batches}) divisible by its rounds, "
                f"max(1, micro_batches // num_stages({num_stages})) = {rounds}; use a multiple of {num_stages}"
            )
        group_rank = dist.get_rank(pp_group) if pp_group is not None else dist.get_rank()
        group_size = dist.get_world_size(pp_group) if pp_group is not None else dist.get_world_size()
        if group_size != num_stages or group_rank != stage_index:
            raise ValueError(
                f"stage_index({stage_index}) / num_stages({num_stages}) must equal this rank's "
                f"rank({group_rank}) / size({group_size}) in the pp group: one stage (or chunk set) per rank"
            )
        self.chunks = chunks
        self.stage_index, self.num_stages, self.micro_batches = stage_index, num_stages, micro_batches
        # chunk c is virtual stage c * num_stages + stage_index, of num_stages * len(chunks)
        self.virtual_indices = [c * num_stages + stage_index for c in range(len(chunks))]
        self.num_virtual_stages = num_stages * len(chunks)
        self.pp_group = pp_group
        self.device = torch.device(device)
        self.schedule = schedule
        self.schedule_class = SCHEDULE_CLASSES[schedule]  # the torch.distributed.pipelining class run
        self.loss_fn = loss_fn
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self._io = [_stage_io_examples(m, i, self.device) for m, i in zip(chunks, self.virtual_indices)]
        self._examples = self._io[0][0]  # on rank 0: virtual stage 0's inputs, the graph's inputs
        dims = [0] * len(self._examples) if input_batch_dims is None else list(input_batch_dims)
        if self.is_first and len(dims) != len(self._examples):
            raise ValueError(f"stage 0 takes {len(self._examples)} inputs but got {len(dims)} batch dims")
        if self.is_first and micro_batches > 1 and all(d is None for d in dims):
            raise ValueError("no pipeline input has a batch dim, so it cannot be cut into micro-batches")
        self.input_batch_dims = tuple(dims)
        self._schedules: dict[bool, Any] = {}  # training? -> schedule

    def _schedule(self, training: bool) -> Any:
        if training not in self._schedules:
            stages = []
            for chunk, index, (inputs, outputs) in zip(self.chunks, self.virtual_indices, self._io):
                last = index == self.num_virtual_stages - 1
                stages.append(
                    _JustInTimeStage(
                        chunk if last else _ContiguousOutputs(chunk),
                        index,
                        self.num_virtual_stages,
                        self.device,
                        input_args=inputs,
                        output_args=outputs,
                        group=self.pp_group,
                    )
                )
            loss_fn = self.loss_fn if training else None
            specs = _chunk_specs(self.input_batch_dims) if self.is_first else None
            multi = self.schedule is Schedule.INTERLEAVED_1F1B  # a list of stages, even of one
            self._schedules[training] = self.schedule_class(
                stages if multi else stages[0],
                n_microbatches=self.micro_batches,
                loss_fn=loss_fn,
                args_chunk_spec=specs,
                output_merge_spec=_merge_spec(self._io[-1][1]) if self.is_last else None,
            )
        return self._schedules[training]

    def note(self) -> str:
        """What the run report says about the schedule that ran (the same on every rank)."""
        v = len(self.chunks)
        chunks = (
            f"v={v} model chunks per pipeline rank ({self.num_virtual_stages} virtual stages; chunk c of rank r "
            "is virtual stage c * pp + r)"
            if self.schedule is Schedule.INTERLEAVED_1F1B
            else "one stage per pipeline rank"
        )
        return (
            f"pipeline schedule: {self.schedule} (torch.distributed.pipelining {self.schedule_class.__name__}) "
            f"over pp={self.num_stages}, {chunks}, {self.micro_batches} micro-batches"
        )

    def _stage_args(self, inputs_or_none: Sequence[torch.Tensor] | None) -> tuple:
        if not self.is_first:
            return ()
        if inputs_or_none is None:
            raise ValueError("stage 0 needs the pipeline's inputs")
        args = tuple(x.to(self.device) for x in inputs_or_none)
        _check_batch(args, self._examples, self.micro_batches, self.input_batch_dims)
        return args

    def forward(self, inputs_or_none: Sequence[torch.Tensor] | None, keep_outputs: bool = True) -> Any:
        """One forward pass (under `torch.no_grad()`, no loss). inputs_or_none: on stage 0 the graph's
        inputs for the whole batch, each batched one micro_batches * b long on its batch dim (b the
        captured batch), the others as captured; None elsewhere. Returns on the last stage the graph's output for the whole batch (micro-batch
        outputs concatenated along dim 0; a tuple for a multi-output graph), None elsewhere; with
        `keep_outputs` False, None everywhere: each micro-batch's output is dropped once computed (a
        consumer takes it), not kept for the whole batch's.
        Raises ValueError for a missing or mis-shaped input."""
        args = self._stage_args(inputs_or_none)
        with torch.no_grad():
            out = self._schedule(False).step(*args, return_outputs=keep_outputs)
        return out if self.is_last and keep_outputs else None

    def train_step(
        self,
        inputs_or_none: Sequence[torch.Tensor] | None,
        target: torch.Tensor | None = None,
        outputs: list[Any] | None = None,
    ) -> torch.Tensor | None:
        """Forward and backward of one training step; accumulates into the stage parameters' `.grad`.

        target: whole batch, split along dim 0 like the inputs; required on the last stage, ignored
        elsewhere. Gradients are scaled by 1 / micro_batches, so with a mean loss_fn they equal the
        gradients of the mean loss over the whole batch (zero them before the step). Tied parameters
        (`passes.pipeline.tied_parameters`) still need `all_reduce_tied_gradients` afterwards. Returns the mean of the
        micro-batch losses (detached) on the last stage, None elsewhere. outputs: a list to which the last
        stage appends the graph's output for the whole batch (detached; as `forward` returns it), for a
        numerics check; None: the schedule keeps no outputs.
        """
        if self.loss_fn is None:
            raise ValueError("train_step needs a runner built with loss_fn")
        args = self._stage_args(inputs_or_none)
        if self.is_last and target is None:
            raise ValueError("the last stage needs `target` for the loss")
        losses: list[torch.Tensor] = []
        with torch.enable_grad():
            out = self._schedule(True).step(
                *args,
                target=target.to(self.device) if self.is_last else None,
                losses=losses if self.is_last else None,
                return_outputs=outputs is not None,
            )
        if outputs is not None and self.is_last:
            outputs.append(out)
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
    size = dist.get_world_size(pp_group) if pp_group is not None else dist.get_world_size()
    sum_tied_gradients({stage_index: stage_module}, tied, pp_group, size)


def tied_groups(tied: Sequence[tuple[int, str, int, str]]) -> list[list[tuple[int, str]]]:
    """The copies of each tied tensor: the pairs of `passes.pipeline.tied_parameters` joined where they
    share a copy ((stage, fqn)), each group sorted, the groups in order. A tensor held by three stages
    (a T5's shared embedding: the encoder's input, the decoder's input, the LM head) is one group of
    three, whose gradients are summed once, not pair by pair."""
    parent: dict[tuple[int, str], tuple[int, str]] = {}

    def root(x: tuple[int, str]) -> tuple[int, str]:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for a, fqn_a, b, fqn_b in tied:
        ra, rb = root((a, fqn_a)), root((b, fqn_b))
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    groups: dict[tuple[int, str], list[tuple[int, str]]] = {}
    for copy in list(parent):
        groups.setdefault(root(copy), []).append(copy)
    return sorted(sorted(group) for group in groups.values())


def sum_tied_gradients(
    chunks: Mapping[int, nn.Module],
    tied: Sequence[tuple[int, str, int, str]],
    pp_group: dist.ProcessGroup | None,
    num_ranks: int,
) -> None:
    """`all_reduce_tied_gradients` for a rank holding several stages: chunks maps each virtual stage
    index this rank holds to its module (all of them; virtual stage s is held by pp rank s % num_ranks,
    `runtime.pipeline.PipelineRunner`), tied lists pairs of virtual stage indices. Each tied tensor's
    copies (`tied_groups`) end with the sum of all their gradients: each rank adds the copies it holds
    (in stage order), sends that partial sum to every other rank holding a copy and receives theirs over
    `pp_group`, and adds the partial sums in rank order, the same on every rank (the copies stay
    bit-identical). A missing gradient counts as zero. Groups go in the same order on every rank, so
    it cannot deadlock."""
    for group in tied_groups(tied):
        here = [(stage, fqn) for stage, fqn in group if stage in chunks]
        if not here:
            continue
        params = []
        for stage, fqn in here:
            param = chunks[stage].get_parameter(fqn)
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            params.append(param)
        partial = params[0].grad
        for param in params[1:]:
            partial = partial + param.grad
        me = here[0][0] % num_ranks
        partials = {me: partial.contiguous()}
        ops = []
        for peer in sorted({stage % num_ranks for stage, _ in group} - {me}):
            peer_rank = dist.get_global_rank(pp_group, peer) if pp_group is not None else peer
            partials[peer] = torch.empty_like(partials[me])
            ops += [
                dist.P2POp(dist.isend, partials[me], peer_rank, pp_group),
                dist.P2POp(dist.irecv, partials[peer], peer_rank, pp_group),
            ]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        ranks = sorted(partials)
        total = partials[ranks[0]]
        for rank in ranks[1:]:
            total = total + partials[rank]
        for i, param in enumerate(params):
            param.grad = total if i == 0 else total.clone()

"""Pipeline split: GraphModule -> one GraphModule per pipeline stage, and running them with
`torch.distributed.pipelining`.

    split_stages(gm, cut_nodes) -> [stage_0, ..., stage_{S-1}]

Cut k is the name of the node after which stage k ends (usually the output node of the last layer of
stage k: `ModelStructure.layers[i].output_node`, via `stage_of_layers`). Every compute node belongs to
the stage whose graph-order range holds it; a `getitem` of a multi-output op goes with its op.

Stage interface (the contract between neighbouring stages, and with `PipelineStage`):

- stage 0 takes the graph's placeholders, in the graph's order (call it like the captured graph);
- the values live at boundary k (after stage k) are the values defined in stage k or earlier, or graph
  placeholders, that some node of a later stage (or the graph output) uses. They are ordered by their
  position in the original graph (placeholders first). Stage k returns them as a tuple, and stage
  k + 1 takes them, in that order, as its positional inputs. Values that a stage does not use itself
  but a later stage needs are passed through (RoPE cos/sin or an attention mask computed before
  layer 0 and used by every layer);
- the last stage returns what the graph returns.

Parameters and buffers are never passed between stages: each stage has its own `get_attr` nodes and
holds only the tensors they use (`fx.GraphModule(gm, stage_graph)`), so once `gm` and the other stages
are dropped, a rank holds only its stage's weights. A tensor used by two stages (GPT-2's tied
`lm_head.weight`: token embedding in stage 0, LM head in the last stage) is copied, one copy per stage;
`tied_parameters(stages)` lists the pairs, and for training their gradients must be summed between
the two stages after every backward (`all_reduce_tied_gradients`) so the copies stay equal after the
optimizer step.

Node metadata: every stage node keeps the original `node.meta` (copied), plus `node.meta["pp_stage"]`
(int); a stage's placeholders also get `node.meta["pp_requires_grad"]` (bool: the value depends on a
trainable parameter of an earlier stage, so a gradient is sent back for it). Stage modules carry
`stage.meta["pp_stage"]`, `stage.meta["pp_num_stages"]` and `stage.meta["pp_param_keys"]`
({get_attr target: key}; equal keys in two stages mean one tensor of the original graph).

Running (`PipelineRunner`, or the one-shot `run_pipeline_forward` / `run_pipeline_train_step`): one
stage per rank of the `pp` process group (stage index = rank in that group), micro-batches along
dim 0, `PipelineStage` with `ScheduleGPipe` or `Schedule1F1B`. Captured graphs have literal
shapes, so the graph must be captured (and TP-rewritten) at the micro-batch size, batch / micro_batches;
a mismatch is a ValueError. The stage's P2P metadata is static, taken from `node.meta["val"]` (no
shape-inference forward with empty buffers, so integer tensors crossing a boundary, such as token ids
or positions used by a later stage's embedding, are safe). Only floating-point values that depend on a
trainable parameter are marked as needing a gradient; integer tensors and parameter-free float values
(RoPE tables, masks) cross stages in forward only, and no gradient is sent back for them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

_SCHEDULES = ("gpipe", "1f1b")


class PipelineSplitError(ValueError):
    """Cut nodes that do not define a valid split of the graph; the message names the node."""


# --------------------------------------------------------------------------------------------------
# Cut points


def stage_of_layers(
    num_layers: int, stages: Sequence[Sequence[int]], layer_output_nodes: Sequence[str]
) -> list[str]:
    """Cut nodes for `split_stages` from a plan's layer assignment.

    num_layers: layers in the model. stages: layer indices per stage (`Plan.stages`), consecutive and
    covering 0 .. num_layers - 1 in order, each stage non-empty. layer_output_nodes[i]: fx node name of
    the value leaving layer i (`ModelStructure.layers[i].output_node`). Returns len(stages) - 1 names:
    the output node of the last layer of each stage but the last. Raises PipelineSplitError otherwise.
    """
    if len(layer_output_nodes) != num_layers:
        raise PipelineSplitError(f"{len(layer_output_nodes)} layer output nodes for num_layers={num_layers}")
    if not stages:
        raise PipelineSplitError("a pipeline needs at least one stage")
    flat = [layer for stage in stages for layer in stage]
    if any(not stage for stage in stages):
        raise PipelineSplitError(
            f"every stage must hold at least one layer, got stages={list(map(list, stages))}"
        )
    if flat != list(range(num_layers)):
        raise PipelineSplitError(
            f"stages must hold layers 0..{num_layers - 1} consecutively and in order, got {list(map(list, stages))}"
        )
    return [layer_output_nodes[stage[-1]] for stage in stages[:-1]]


# --------------------------------------------------------------------------------------------------
# Split


def split_stages(gm: fx.GraphModule, cut_nodes: Sequence[str]) -> list[fx.GraphModule]:
    """Split `gm` into len(cut_nodes) + 1 stage modules at the named nodes (see the module docstring).

    gm is not modified. Each returned stage is an `fx.GraphModule` (class name `PipelineStage{k}`) whose
    graph passes `lint()`. Running the stages in sequence, feeding each one's returned tuple to the
    next (`run_stages_sequentially`), computes exactly what `gm` computes.

    Raises PipelineSplitError when a cut node does not exist, is not a compute node, the cuts are not in
    graph order, a stage would be empty, or a value live at a boundary is not a single tensor.
    """
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    by_name = {node.name: node for node in nodes}
    cuts: list[int] = []
    for name in cut_nodes:
        node = by_name.get(name)
        if node is None:
            raise PipelineSplitError(f"cut node {name!r} is not in the graph")
        if node.op != "call_function":
            raise PipelineSplitError(f"cut node `{node.format_node()}` is not a compute node")
        if cuts and position[node] <= cuts[-1]:
            raise PipelineSplitError(
                f"cut node {name!r} comes before or at the previous cut; cuts must be in graph order"
            )
        cuts.append(position[node])
    num_stages = len(cuts) + 1
    stage_of = _assign_stages(nodes, position, cuts)
    for k in range(num_stages):
        if not any(s == k for n, s in stage_of.items() if n.op == "call_function"):
            raise PipelineSplitError(f"stage {k} would hold no compute node (cuts {list(cut_nodes)})")
    live = [_live_values(nodes, stage_of, k) for k in range(num_stages - 1)]
    for k, values in enumerate(live):
        for value in values:
            if not isinstance(value.meta.get("val"), torch.Tensor):
                raise PipelineSplitError(
                    f"value `{value.format_node()}` crosses the boundary after stage {k} but is not a single "
                    "tensor; move the cut so that the whole multi-output op is on one side"
                )
    keys = _param_keys(gm, nodes)
    trainable = _requires_grad_nodes(gm)
    stages = [_build_stage(gm, nodes, stage_of, live, k, keys, trainable) for k in range(num_stages)]
    _untie(stages)
    return stages


def _assign_stages(nodes: list[fx.Node], position: dict[fx.Node, int], cuts: list[int]) -> dict[fx.Node, int]:
    """Stage of every placeholder (-1: defined before stage 0) and compute node; get_attr nodes are not staged."""
    stage_of: dict[fx.Node, int] = {}
    for node in nodes:
        if node.op == "placeholder":
            stage_of[node] = -1
        elif node.op in ("call_function", "call_method", "call_module"):
            stage = sum(position[node] > cut for cut in cuts)
            source = node.args[0] if node.target is operator.getitem and node.args else None
            if isinstance(source, fx.Node) and source in stage_of:
                stage = stage_of[source]  # a getitem goes with its multi-output op
            stage_of[node] = stage
        elif node.op == "output":
            stage_of[node] = len(cuts)
    return stage_of


def _live_values(nodes: list[fx.Node], stage_of: dict[fx.Node, int], boundary: int) -> list[fx.Node]:
    """Values defined at or before stage `boundary` and used after it, in graph order."""
    return [
        node
        for node in nodes
        if node in stage_of
        and node.op != "output"
        and stage_of[node] <= boundary
        and any(stage_of.get(user, -1) > boundary for user in node.users)
    ]


def _requires_grad_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value depends on a trainable parameter (float tensors, or multi-output ops).

    A placeholder counts when its `node.meta["pp_requires_grad"]` is true (set by split_stages on the
    inputs of later stages); the graph's own inputs are data and need no gradient.
    """
    needs: set[fx.Node] = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        differentiable = isinstance(val, (list, tuple)) or (
            isinstance(val, torch.Tensor) and val.dtype.is_floating_point
        )
        if node.op == "get_attr":
            value = operator.attrgetter(str(node.target))(gm)
            if isinstance(value, nn.Parameter) and value.requires_grad:
                needs.add(node)
        elif node.op == "placeholder":
            if node.meta.get("pp_requires_grad", False) and differentiable:
                needs.add(node)
        elif node.op != "output" and differentiable and any(a in needs for a in node.all_input_nodes):
            needs.add(node)
    return needs


def _param_keys(gm: fx.GraphModule, nodes: list[fx.Node]) -> dict[str, str]:
    """get_attr target -> key shared by every target naming the same tensor (the first such target)."""
    keys: dict[str, str] = {}
    by_id: dict[int, str] = {}
    for node in nodes:
        if node.op != "get_attr" or node.target in keys:
            continue
        value = operator.attrgetter(str(node.target))(gm)
        keys[str(node.target)] = by_id.setdefault(id(value), str(node.target))
    return keys


def _build_stage(
    gm: fx.GraphModule,
    nodes: list[fx.Node],
    stage_of: dict[fx.Node, int],
    live: list[list[fx.Node]],
    k: int,
    keys: dict[str, str],
    trainable: set[fx.Node],
) -> fx.GraphModule:
    num_stages = len(live) + 1
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = [n for n in nodes if n.op == "placeholder"] if k == 0 else live[k - 1]
    for value in inputs:
        env[value] = graph.placeholder(value.name, type_expr=value.type)
        env[value].meta = dict(value.meta)
        env[value].meta["pp_stage"] = k
        env[value].meta["pp_requires_grad"] = value in trainable
    members = [n for n in nodes if stage_of.get(n) == k and n.op != "output"]
    used_attrs = {a for n in members for a in n.all_input_nodes if a.op == "get_attr"}
    if k == num_stages - 1:
        used_attrs |= {a for a in nodes[-1].all_input_nodes if a.op == "get_attr"}
    for node in nodes:  # get_attr nodes first, in the original order
        if node in used_attrs:
            env[node] = graph.node_copy(node, lambda n: env[n])
            env[node].meta["pp_stage"] = k
    for node in members:
        env[node] = graph.node_copy(node, lambda n: env[n])
        env[node].meta["pp_stage"] = k
    if k == num_stages - 1:
        output = nodes[-1]
        assert output.op == "output"
        graph.node_copy(output, lambda n: env[n])
    else:
        graph.output(tuple(env[v] for v in live[k]))
    graph.lint()
    stage = fx.GraphModule(gm, graph, class_name=f"PipelineStage{k}")
    stage.meta["pp_param_keys"] = {
        str(n.target): keys[str(n.target)] for n in graph.nodes if n.op == "get_attr"
    }
    stage.meta["pp_stage"] = k
    stage.meta["pp_num_stages"] = num_stages
    return stage


def _untie(stages: list[fx.GraphModule]) -> None:
    """Give every stage its own copy of a tensor that more than one stage uses (one copy per stage,
    shared by all the names the stage uses for it)."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for k, stage in enumerate(stages):
        for target in stage.meta["pp_param_keys"]:
            holders.setdefault(id(operator.attrgetter(target)(stage)), []).append((k, target))
    for found in holders.values():
        if len({k for k, _ in found}) < 2:
            continue
        copies: dict[int, Any] = {}  # stage -> its copy
        for k, target in found:
            owner_path, _, name = target.rpartition(".")
            owner = stages[k].get_submodule(owner_path) if owner_path else stages[k]
            value = getattr(owner, name)
            if k not in copies:
                copies[k] = value.detach().clone()
                if isinstance(value, nn.Parameter):
                    copies[k] = nn.Parameter(copies[k], requires_grad=value.requires_grad)
            if isinstance(value, nn.Parameter):
                owner._parameters[name] = copies[k]
            elif name in owner._buffers:
                owner._buffers[name] = copies[k]
            else:
                setattr(owner, name, copies[k])


def tied_parameters(stages: Sequence[fx.GraphModule]) -> list[tuple[int, str, int, str]]:
    """Parameters that are one tensor of the original graph held by two stages: (a, fqn_a, b, fqn_b), a < b.

    For training, after each backward the runtime must sum the gradients of each pair between stage a
    and stage b (`all_reduce_tied_gradients`) so both copies get the full gradient and stay equal after
    the optimizer step (GPT-2: the token embedding in stage 0 and the LM head in the last stage share
    `lm_head.weight`). Only trainable parameters are listed (buffers need no gradient). Sorted, so every
    rank gets the same list.
    """
    holders: dict[str, list[tuple[int, str]]] = {}  # key -> [(stage, first name in that stage)]
    for k, stage in enumerate(stages):
        for target, key in stage.meta.get("pp_param_keys", {}).items():
            value = operator.attrgetter(target)(stage)
            found = holders.setdefault(key, [])
            if isinstance(value, nn.Parameter) and value.requires_grad and k not in (s for s, _ in found):
                found.append((k, target))
    pairs: list[tuple[int, str, int, str]] = []
    for found in holders.values():
        for i, (a, fqn_a) in enumerate(found):
            for b, fqn_b in found[i + 1 :]:
                if a != b:
                    pairs.append((a, fqn_a, b, fqn_b))
    return sorted(pairs)


def run_stages_sequentially(stages: Sequence[fx.GraphModule], *inputs: torch.Tensor) -> Any:
    """Run the stages one after the other in this process: stage 0 on `inputs`, each next stage on the
    previous stage's returned tuple. Returns the last stage's output (the graph's output form)."""
    values: Any = inputs
    for stage in stages:
        values = stage(*values)
    return values


# --------------------------------------------------------------------------------------------------
# Running with torch.distributed.pipelining


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
    trainable = _requires_grad_nodes(stage)
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
    runner and calls `forward` / `train_step` repeatedly; `run_pipeline_forward` and
    `run_pipeline_train_step` are one-shot wrappers. Every rank of the pp group must make the same
    calls in the same order (each builds its schedule lazily, on first use, collectively).

    stage_module: from `split_stages` (captured at the micro-batch size). stage_index must equal this
    rank's rank in `pp_group` (None: the default group) and num_stages its size. schedule: "gpipe" or
    "1f1b". loss_fn(output_micro_batch, target_micro_batch) -> scalar mean loss; needed for train_step.
    Raises ValueError for a bad schedule, micro_batches or group layout.
    """

    def __init__(
        self,
        stage_module: fx.GraphModule,
        stage_index: int,
        num_stages: int,
        micro_batches: int,
        pp_group: dist.ProcessGroup | None,
        device: torch.device | str,
        *,
        schedule: str = "gpipe",
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if schedule not in _SCHEDULES:
            raise ValueError(f"schedule must be one of {_SCHEDULES}, got {schedule!r}")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
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
        self.loss_fn = loss_fn
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self._examples, self._outputs = _stage_io_examples(stage_module, stage_index, self.device)
        self._schedules: dict[bool, Any] = {}  # training? -> schedule

    def _schedule(self, training: bool) -> Any:
        if training not in self._schedules:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

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
            cls = ScheduleGPipe if self.schedule == "gpipe" else Schedule1F1B
            loss_fn = self.loss_fn if training else None
            self._schedules[training] = cls(stage, n_microbatches=self.micro_batches, loss_fn=loss_fn)
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
        (`tied_parameters`) still need `all_reduce_tied_gradients` afterwards. Returns the mean of the
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


def run_pipeline_forward(
    stage_module: fx.GraphModule,
    stage_index: int,
    num_stages: int,
    inputs_or_none: Sequence[torch.Tensor] | None,
    micro_batches: int,
    pp_group: dist.ProcessGroup | None,
    device: torch.device | str,
    schedule: str = "gpipe",
) -> Any:
    """One-shot forward pass of this rank's stage: `PipelineRunner(...).forward(inputs_or_none)`.

    Collective over `pp_group`. Returns the whole batch's output on the last stage, None elsewhere.
    Builds the schedule on every call (P2P handshakes): for repeated steps use a `PipelineRunner`.
    """
    runner = PipelineRunner(
        stage_module, stage_index, num_stages, micro_batches, pp_group, device, schedule=schedule
    )
    return runner.forward(inputs_or_none)


def run_pipeline_train_step(
    stage_module: fx.GraphModule,
    stage_index: int,
    num_stages: int,
    inputs_or_none: Sequence[torch.Tensor] | None,
    micro_batches: int,
    pp_group: dist.ProcessGroup | None,
    device: torch.device | str,
    *,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    target: torch.Tensor | None = None,
    schedule: str = "gpipe",
) -> torch.Tensor | None:
    """One-shot training step: `PipelineRunner(..., loss_fn=loss_fn).train_step(inputs_or_none, target)`.

    Fills the stage parameters' `.grad` (see `PipelineRunner.train_step`); returns the mean loss on the
    last stage, None elsewhere. For repeated steps use a `PipelineRunner`.
    """
    runner = PipelineRunner(
        stage_module,
        stage_index,
        num_stages,
        micro_batches,
        pp_group,
        device,
        schedule=schedule,
        loss_fn=loss_fn,
    )
    return runner.train_step(inputs_or_none, target)


def all_reduce_tied_gradients(
    stage_module: nn.Module,
    stage_index: int,
    tied: Sequence[tuple[int, str, int, str]],
    pp_group: dist.ProcessGroup | None,
) -> None:
    """Sum the gradients of tied parameter copies between their two stages, in place.

    tied: from `tied_parameters(stages)` (the same list on every rank). For each pair this rank's stage
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

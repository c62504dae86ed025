"""Pipeline split: GraphModule -> one GraphModule per pipeline stage.

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
the two stages after every backward (`runtime.pipeline.all_reduce_tied_gradients`) so the copies stay
equal after the optimizer step.

Node metadata: every stage node keeps the original `node.meta` (copied), plus `node.meta["pp_stage"]`
(int); a stage's placeholders also get `node.meta["pp_requires_grad"]` (bool: the value depends on a
trainable parameter of an earlier stage, so a gradient is sent back for it; `requires_grad_nodes`).
Stage modules carry `stage.meta["pp_stage"]`, `stage.meta["pp_num_stages"]` and
`stage.meta["pp_param_keys"]` ({get_attr target: key}; equal keys in two stages mean one tensor of
the original graph).

Running the stages (one per rank, micro-batches, a `torch.distributed.pipelining` schedule) is the
runtime's job: `runtime.pipeline.PipelineRunner`.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from passes.recompute import region_graph


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
    next, computes exactly what `gm` computes.

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
    trainable = requires_grad_nodes(gm)
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


def requires_grad_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes of `gm` (a stage, or a whole graph) whose value depends on a trainable parameter: float
    tensors, or multi-output ops. The runtime sends gradients back only for these.

    A placeholder counts when its `node.meta["pp_requires_grad"]` is true (set by split_stages on the
    inputs of later stages); the graph's own inputs are data and need no gradient. A submodule fused
    from the graph's nodes (`passes.recompute`'s regions) is looked into, output by output: a value it
    computes from no parameter (a mask made by a factory op inside a layer) needs no gradient, as
    before the fusion, whatever else the region computes.
    """
    return _requires_grad(gm, None)


def _requires_grad(gm: fx.GraphModule, seeds: list[bool] | None) -> set[fx.Node]:
    """`requires_grad_nodes` with the placeholders' flags given (`seeds`, in order: a fused region's
    inputs as its caller computes them) or read from their meta (None)."""
    needs: set[fx.Node] = set()
    regions: dict[fx.Node, list[bool]] = {}  # a fused region's call -> whether each of its outputs needs
    placeholders = 0
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
            seeded = seeds[placeholders] if seeds is not None and placeholders < len(seeds) else None
            placeholders += 1
            wanted = node.meta.get("pp_requires_grad", False) if seeded is None else seeded
            if wanted and (differentiable or seeds is not None):
                needs.add(node)
        elif node.op == "call_module" and (inner := region_graph(gm, node)) is not None:
            inner_needs = _requires_grad(inner, [isinstance(a, fx.Node) and a in needs for a in node.args])
            out = inner.graph.output_node().args[0]
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            regions[node] = [isinstance(o, fx.Node) and o in inner_needs for o in outs]
            if any(regions[node]):
                needs.add(node)
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in regions:
            flags, index = regions[node.args[0]], node.args[1]
            if differentiable and isinstance(index, int) and index < len(flags) and flags[index]:
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

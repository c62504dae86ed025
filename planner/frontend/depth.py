"""Capture a deep model through a short representative slice of its repeated layers.

Planning needs each layer's shapes and costs, not 80 copies of the same graph: exporting a
Llama-3-70B on `meta` takes 7-12 s on a 2-core machine, almost all of it spent tracing 80 identical
blocks. So for planning, the longest `nn.ModuleList` whose children are identical (same class, same
parameter names and shapes) is temporarily cut to its first `KEEP_LAYERS` blocks, the model is
captured and analysed, the list is restored, and the structure is extended to the full depth by
copying the last traced layer with its parameter names renumbered (`layers.1.` -> `layers.37.`).

A list whose first few blocks differ and the rest are identical (DeepSeek-V3's dense first layers) is
cut after those few and `KEEP_LAYERS` of the rest (`_repeated_suffix`).

Anything unexpected falls back to capturing the whole model: a model whose forward fails with the
shorter list, an analysis that does not find exactly the kept layers under that list, or a list
shorter than `MIN_LAYERS_TO_TRUNCATE`. The rewrite passes and the runtime always capture the full
model; only the planner uses the representative slice. The fx node names of the copied layers
(`Layer.nodes`, `residual_add`, ...) name the template layer's nodes in the representative graph.
"""

from __future__ import annotations

import copy
import dataclasses

from torch import fx, nn

from planner.errors import InputError
from planner.frontend.analysis import Layer, ModelStructure, Projection, analyse, param_tensors
from planner.frontend.capture import capture
from planner.frontend.roles import Adapter

KEEP_LAYERS = 2  # blocks traced: two, so the analysis sees a layer-to-layer boundary
MIN_LAYERS_TO_TRUNCATE = 8  # shallower models are traced whole (it is fast and exact)


def repeated_blocks(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The longest ModuleList of identical blocks that lies in no block of another such list: (its
    FQN, the list), or None when there is none. A mixture of experts' ModuleList of 64 experts inside
    each of 24 layers is not the model's depth."""
    found: list[tuple[str, nn.ModuleList]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        signature = _signature(module[0])
        if all(type(b) is type(module[0]) and _signature(b) == signature for b in module):
            found.append((name, module))
    outer = [(n, m) for n, m in found if not any(o and n.startswith(f"{o}.") for o, _ in found if o != n)]
    return max(outer, key=lambda item: len(item[1]), default=None)


def _repeated_suffix(model: nn.Module) -> tuple[tuple[str, nn.ModuleList], int] | None:
    """A ModuleList whose blocks are identical from some index p > 0 on, at least
    `MIN_LAYERS_TO_TRUNCATE` of them, ((its FQN, the list), p), or None: DeepSeek-V3's first 3 dense
    layers before 58 mixture-of-experts ones (`first_k_dense_replace`). The first p + `KEEP_LAYERS`
    blocks are traced, the rest copied from the last (`capture_for_planning`)."""
    best: tuple[tuple[str, nn.ModuleList], int] | None = None
    for name, module in model.named_modules():
        if not name or not isinstance(module, nn.ModuleList) or len(module) < MIN_LAYERS_TO_TRUNCATE:
            continue
        last = module[-1]
        start = len(module) - 1
        while (
            start > 0
            and type(module[start - 1]) is type(last)
            and _signature(module[start - 1]) == _signature(last)
        ):
            start -= 1
        if 0 < start and len(module) - start >= MIN_LAYERS_TO_TRUNCATE:
            if best is None or len(module) - start > len(best[0][1]) - best[1]:
                best = ((name, module), start)
    return best


def _signature(block: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    return [(n, tuple(p.shape), str(p.dtype)) for n, p in block.named_parameters()]


def capture_for_planning(
    model: nn.Module, args: tuple, kwargs: dict
) -> tuple[fx.GraphModule, ModelStructure]:
    """Capture and analyse `model` for planning, through a representative slice when it is deep.

    Returns the captured graph (of the slice, when truncated) and the structure at full depth.
    Raises InputError when the model cannot be captured at all.
    """
    found = repeated_blocks(model)
    start = 0
    if found is None or len(found[1]) < MIN_LAYERS_TO_TRUNCATE or not found[0]:
        found, start = _repeated_suffix(model) or (None, 0)
    if found is None or _shares_parameters(found[1]):
        gm = capture(model, args, kwargs)
        return gm, analyse(gm)
    path, blocks = found
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    kept = start + KEEP_LAYERS
    try:
        setattr(parent, attr, nn.ModuleList(list(blocks)[:kept]))
        gm = capture(model, args, kwargs)
        structure = analyse(gm)
    except InputError:
        structure = None
    finally:
        setattr(parent, attr, blocks)
    expected = [f"{path}.{i}" for i in range(kept)]
    if structure is None or [layer.module_path for layer in structure.layers] != expected:
        gm = capture(model, args, kwargs)
        return gm, analyse(gm)
    return gm, _extend(structure, model, path, len(blocks))


def _shares_parameters(blocks: nn.ModuleList) -> bool:
    """Whether two blocks of the list hold one parameter tensor (one block object at several depths,
    ALBERT's cross-layer sharing): copying the last traced layer's analysis would miss which layers
    share weights (`ModelStructure.shared_layers`), so such a model is traced whole."""
    ids = [id(p) for block in blocks for p in block.parameters()]
    return len(ids) != len(set(ids))


def _extend(structure: ModelStructure, model: nn.Module, path: str, depth: int) -> ModelStructure:
    """`structure` with its last layer copied up to `depth` layers, parameter names renumbered."""
    template = structure.layers[-1]
    old = f"{path}.{template.index}."
    layers = list(structure.layers)
    for i in range(len(layers), depth):
        new = f"{path}.{i}."
        layer = copy.deepcopy(template)
        layer.index = i
        layer.module_path = f"{path}.{i}"
        _renumber(layer, old, new)
        layers.append(layer)
    _mark_frozen(layers, model, len(structure.layers))
    unique = {id(p): p for p in model.parameters()}.values()
    num_params = sum(p.numel() for p in unique)
    param_bytes = sum(p.numel() * p.element_size() for p in unique)
    tensors = sum(1 for p in unique if p.requires_grad)
    return dataclasses.replace(
        structure,
        layers=layers,
        num_params=num_params,
        param_bytes=param_bytes,
        num_param_tensors=tensors,
        param_tensor_sizes=param_tensors(unique),
        frozen_params=frozenset(
            n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad
        ),
        num_frozen_params=sum(p.numel() for p in unique if not p.requires_grad),
    )


def _mark_frozen(layers: list[Layer], model: nn.Module, captured: int) -> None:
    """The copied layers' (`layers[captured:]`) frozen parameters, read from the model's own
    (`Layer.frozen_params`: elements under the layer's module path with requires_grad=False), and
    whether a gradient reaches each (`Layer.input_requires_grad`): one reaches layer i when it reached
    layer i - 1 or that layer has a trainable parameter. A fine-tune that freezes some layers of a
    repeated stack is priced layer by layer, though only a slice of it was captured."""
    params = dict(model.named_parameters())
    for i in range(captured, len(layers)):
        layer, before = layers[i], layers[i - 1]
        prefix = f"{layer.module_path}."
        layer.frozen_params = sum(
            p.numel() for n, p in params.items() if n.startswith(prefix) and not p.requires_grad
        )
        layer.input_requires_grad = before.input_requires_grad or before.frozen_params < before.num_params


def _renumber(layer: Layer, old: str, new: str) -> None:
    """Rename, in place, the parameter FQNs of a copied layer's projections, routers and experts from
    the prefix `old` ("layers.1.") to `new` ("layers.37."); a projection held twice (`MoE.shared` is
    `mlp`'s) stays one object."""
    renamed: dict[int, Projection] = {}

    def rename(p: Projection) -> Projection:
        return renamed.setdefault(id(p), _renamed(p, old, new))

    for block in (layer.attention, layer.cross_attention, layer.mlp):
        if block is not None:
            block.projections = [rename(p) for p in block.projections]
    layer.routers = [rename(p) for p in layer.routers]
    layer.token_gates = [rename(p) for p in layer.token_gates]
    layer.latents = [rename(p) for p in layer.latents]
    moe = layer.moe
    if moe is None:
        return
    moe.router, moe.shared = rename(moe.router), [rename(p) for p in moe.shared]
    moe.module_path = _renamed_fqn(moe.module_path, old.rstrip("."), new.rstrip("."))
    for weight in moe.experts:
        weight.weights = [_renamed_fqn(w, old, new) for w in weight.weights]
        weight.biases = [_renamed_fqn(b, old, new) for b in weight.biases]
    if moe.selection_bias is not None:
        moe.selection_bias = _renamed_fqn(moe.selection_bias, old, new)


def _renamed_fqn(fqn: str, old: str, new: str) -> str:
    """`fqn` with its prefix `old` replaced by `new` ("layers.1.mlp.w1" -> "layers.37.mlp.w1"); a
    prefix without its dot matches the whole name ("layers.1" -> "layers.37")."""
    if fqn == old or fqn.startswith(old if old.endswith(".") else f"{old}."):
        return new + fqn[len(old) :]
    return fqn


def _renamed(p: Projection, old: str, new: str) -> Projection:
    """A copy of `p` with its weight, bias and LoRA adapter's weights (`Projection.adapter`) renamed."""
    bias = _renamed_fqn(p.bias, old, new) if p.bias else p.bias
    adapter = p.adapter
    if adapter is not None:
        adapter = Adapter(_renamed(adapter.down, old, new), _renamed(adapter.up, old, new))
    return dataclasses.replace(p, weight=_renamed_fqn(p.weight, old, new), bias=bias, adapter=adapter)

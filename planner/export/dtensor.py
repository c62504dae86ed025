"""`planner export --to dtensor`: the plan's tensor-parallel splits as a `parallelize_module` plan and
its data parallelism as `fully_shard` calls.

The output is a self-contained Python file for `torch.distributed.tensor.parallel` and
`torch.distributed.fsdp.fully_shard`: `PLAN` (module FQN -> `ColwiseParallel` / `RowwiseParallel`,
`SequenceParallel` styles), `VOCAB` (modules split along the vocabulary), `init_mesh(device)` (the
plan's mesh as torchtitan names and orders its dims: `MESH_DIMS` pp x dp_replicate x dp_shard x tp,
TP innermost, in the plan's rank order) and `apply(model, mesh)`, which shards the user's eager model
on that mesh's "tp" dim, then applies the data parallelism on its dp dims (`apply_data_parallel`;
with pipeline stages the user calls it per stage after the split), and returns it; given a 1-D
`DeviceMesh` instead it shards the tensor-parallel axis alone. Module FQNs are the plan's weight FQNs
without `.weight`.

| plan split                              | style                                                          |
|-----------------------------------------|----------------------------------------------------------------|
| colwise (nn.Linear dim 0)               | ColwiseParallel() (Replicate() output if no rowwise sibling,    |
|                                         | or `gather_output`: an op over the full width reads it)         |
| rowwise (nn.Linear dim 1)               | RowwiseParallel() (Replicate() input if no colwise sibling,     |
|                                         | or `replicated_input`: fed by an op run replicated)             |
| vocab, nn.Embedding                     | RowwiseParallel(input_layouts=Replicate())                      |
| vocab, nn.Linear (LM head)              | ColwiseParallel(output_layouts=Replicate())                     |
| replicate / not listed                  | not in PLAN: the module stays whole on every rank               |
| rowwise q/k/v/up/gate, colwise o/down   | none: UNSUPPORTED names it and apply() raises (`Plan.roles`)    |
| sequence_parallel                       | the stream cut along the sequence (Shard(1)) at the first      |
|                                         | layer's input, norms from there on SequenceParallel(), each     |
|                                         | block's input gathered once at the block (a DTensor, so the     |
|                                         | gradient is reduce-scattered), rowwise outputs Shard(1), the LM |
|                                         | head's input Shard(1); a block holding two rowwise projections  |
|                                         | (attention and MLP in one module): UNSUPPORTED, apply() raises  |

What `apply` does besides `parallelize_module` (the generated file's docstring says it to the user):
a fused projection (`parts`, GPT-2's `c_attn`) has its rows reordered so that the contiguous shard of
each rank holds its piece of every part; each attention module (the parent of colwise and rowwise
projections that has a head-count attribute) gets its head counts and widths divided by tp, so that
a forward sizing its views from them runs on the rank's heads, and its per-head norms (Qwen3's q_norm
and k_norm: a weight of head_dim elements) take SequenceParallel, so that their weights' gradients are
summed over the TP ranks; a weight tied to a vocabulary-split
LM head (GPT-2's token embedding) is split with it and tied again. A served plan's KV caches (4-D
buffers with a dim of the attention's KV-head count, and the objects holding the same tensors, as
transformers' StaticCache layers) are cut to the rank's heads.

Sequence parallel is applied from the first layer's input on, not at the embedding's output: the
model computes what it derives from the embedding's output (Hugging Face's position ids, RoPE tables
and causal mask, GPT-2's added position embedding) on the whole sequence, and every attention or MLP
block receives the whole sequence (a Hugging Face attention sizes its views from its input's shape:
given the rank's half it failed in `apply_rotary_pos_emb`). The pipeline axis, the ladder residual and
activation recomputation are not part of the file: each is a warning.

| plan dp_style (dp > 1)                  | apply_data_parallel: fully_shard(unit, mesh=..., ...)          |
|-----------------------------------------|----------------------------------------------------------------|
| fsdp, dp_shard = dp                     | mesh["dp_shard"], reshard_after_forward as planned             |
| fsdp, dp_shard S < dp (HSDP)            | mesh["dp_replicate", "dp_shard"] (R x S), as planned           |
| ddp                                     | mesh["dp_replicate", "dp_shard"] (dp x 1), no reshard: DDP as  |
|                                         | torchtitan 0.3 runs it (gradients all-reduced, nothing sharded) |
| zero1 / zero2 (no fully_shard form)     | mesh["dp_shard"] over dp, reshard False or True, the one the   |
|                                         | plan priced nearer (default False); a warning gives both prices |

The units are each transformer layer (`DP_UNITS`: the plan's weight names up to the layer index;
without them, the model's ModuleList / ModuleDict of the plan's layer count) and then the model
itself (embeddings, final norm, LM head), as the plan prices FSDP. fully_shard runs on CPU with gloo
in torch 2.13 (its reduce-scatter included) and composes with the tensor-parallel DTensors
(tests/test_export.py runs FSDP x TP, HSDP, DDP x TP with sequence parallel and a ZeRO-1 plan on 4
gloo ranks against the unsharded model).

Context parallelism (cp > 1): a "cp" mesh dim, PyTorch's `context_parallel` in
`context_parallel_step()`, and fully_shard over the dp x cp ranks (`dtensor_cp.py`, where its table
is); a cp=1 file is as without it.
"""

from __future__ import annotations

import pprint
import textwrap
from dataclasses import dataclass

from planner.export import dtensor_cp
from planner.export.common import (
    ZERO_NAMES,
    Export,
    against_megatron_pairing,
    dp_label,
    dp_substitute_warning,
    kv_piece_splits,
    nearest_dp_form,
    num_layers,
)
from planner.plan import DataParallel, Plan, SplitStyle, Workload, loss_scale_text

TOOL = "DTensor (torch.distributed.tensor.parallel)"

_SP_NOTE = """

Sequence parallel: from the input of FIRST_LAYER on, the stream between blocks is split along the
sequence (dim 1, Shard(1); its length must divide by tp), every norm after that point runs on the
rank's part (SequenceParallel), each block of TP_BLOCKS gathers its input once (a Replicate DTensor:
its forward sees the whole sequence) and its row-parallel projection reduce-scatters back to the
rank's part. Everything before the first layer (embeddings, position ids, masks) runs on the whole
sequence."""

_CACHE_NOTE = """

KV caches: after sharding, each 4-D floating buffer with a dim (1 or 2) of an attention module's
KV-head count (before apply(): n_kv_heads, num_key_value_heads, ... or its config's) is replaced by
the rank's contiguous part of that dim, its own heads, and so is the same tensor where another object
holds it (transformers' StaticCache layers). A cache your code passes to forward instead must be
allocated per rank for KV heads / tp."""

_APPLY_SOURCE = '''
HEAD_ATTRS = ("n_heads", "n_head", "num_heads", "n_kv_heads", "num_kv_heads", "num_key_value_heads",
              "n_local_heads", "n_local_kv_heads", "num_attention_heads")  # per-rank after apply()
WIDTH_ATTRS = ("n_embd", "embed_dim", "hidden_size", "split_size", "dim")  # of attention modules only
KV_ATTRS = ("n_kv_heads", "num_kv_heads", "num_key_value_heads", "n_local_kv_heads")  # a cache's head count
STREAM_KWARGS = ("hidden_states", "x")  # the stream, when a layer or block takes it by keyword


def tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """PLAN with the VOCAB modules added, each styled by its type (nn.Embedding or nn.Linear head) and
    a token embedding tied to a vocabulary-split LM head added with it. ValueError names a module
    that is missing or of a type these styles cannot split."""
    modules = dict(model.named_modules())
    plan = dict(PLAN)
    vocab = list(VOCAB)
    for name in vocab:
        if name not in modules:
            raise ValueError(f"the plan splits {name!r}, which this model does not have")
        for other, module in model.named_modules(remove_duplicate=False):
            if other != name and isinstance(module, nn.Embedding) and module.weight is modules[name].weight:
                if other not in vocab:
                    vocab.append(other)  # a tied token embedding is split with its LM head
    for name in vocab:
        module = modules.get(name)
        if isinstance(module, nn.Embedding):  # whole output: sequence parallel starts at FIRST_LAYER
            plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif isinstance(module, nn.Linear):
            plan[name] = ColwiseParallel(
                input_layouts=Shard(1) if SEQUENCE_PARALLEL else Replicate(), output_layouts=Replicate()
            )
        else:
            raise ValueError(f"{name!r} is split along the vocabulary but is a {type(module).__name__}")
    for name in PLAN:
        if not isinstance(modules.get(name), nn.Linear):
            kind = type(modules[name]).__name__ if name in modules else "missing"
            raise ValueError(f"{name!r} ({kind}): ColwiseParallel / RowwiseParallel split nn.Linear modules only")
    if SEQUENCE_PARALLEL:
        if FIRST_LAYER not in modules:
            raise ValueError(f"the plan's first layer {FIRST_LAYER!r} is not a module of this model")
        names = list(modules)
        for name in names[names.index(FIRST_LAYER):]:  # norms from the first layer on, none inside a block
            module = modules[name]
            inside = any(name.startswith(block + ".") for block in TP_BLOCKS)
            norm = isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")
            if norm and not inside:
                plan[name] = SequenceParallel()
    return plan


def _on_stream(args: tuple, kwargs: dict, fn) -> tuple[tuple, dict]:
    """(args, kwargs) with `fn` applied to the stream: the first positional tensor, else the
    STREAM_KWARGS keyword."""
    if args and isinstance(args[0], torch.Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    for key in STREAM_KWARGS:
        if isinstance(kwargs.get(key), torch.Tensor):
            return args, {**kwargs, key: fn(kwargs[key])}
    raise ValueError("sequence parallel: found no stream tensor (first argument or hidden_states / x)")


def _sequence_hooks(model: nn.Module, mesh: DeviceMesh) -> None:
    """Cut the stream along the sequence at FIRST_LAYER's input; gather it at each block's input."""

    def cut(module, args, kwargs):
        return _on_stream(args, kwargs, lambda x: DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                          .redistribute(mesh, (Shard(1),)).to_local())

    def gather(module, args, kwargs):
        def whole(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, (Shard(1),), run_check=False)
            return x.redistribute(mesh, (Replicate(),))  # a DTensor: the gradient is reduce-scattered

        return _on_stream(args, kwargs, whole)

    model.get_submodule(FIRST_LAYER).register_forward_pre_hook(cut, with_kwargs=True)
    for name in TP_BLOCKS:
        model.get_submodule(name).register_forward_pre_hook(gather, with_kwargs=True)


def _kv_heads(model: nn.Module) -> set[int]:
    """KV-head counts of the attention modules of TP_BLOCKS (their own attribute, else their config's,
    else their head count), read before apply() divides them."""
    counts = set()
    for name in TP_BLOCKS:
        module = model.get_submodule(name)
        values = [getattr(module, a, None) for a in KV_ATTRS]
        values.append(getattr(getattr(module, "config", None), "num_key_value_heads", None))
        values += [getattr(module, a, None) for a in HEAD_ATTRS]
        count = next((v for v in values if isinstance(v, int) and not isinstance(v, bool)), None)
        if count is not None:  # an MLP block has none of these
            counts.add(count)
    return counts


def _local_caches(model: nn.Module, mesh: DeviceMesh, kv_heads: set[int]) -> list[str]:
    """Replace each KV-cache buffer (4-D, floating, dim 1 or 2 of a KV-head count) by the rank's part
    of its heads, also where another object holds the same tensor; return the buffers cut."""
    tp, rank = mesh.size(), mesh.get_local_rank()
    swapped: dict[int, torch.Tensor] = {}
    changed = []
    for owner_name, owner in model.named_modules():
        for attr, buf in list(owner._buffers.items()):
            if buf is None or buf.dim() != 4 or not buf.is_floating_point():
                continue
            dim = next((d for d in (1, 2) if buf.shape[d] in kv_heads and buf.shape[d] % tp == 0), None)
            if dim is None:
                continue
            if id(buf) not in swapped:
                swapped[id(buf)] = buf.detach().chunk(tp, dim=dim)[rank].clone()
            owner._buffers[attr] = swapped[id(buf)]
            changed.append(f"{owner_name + '.' if owner_name else ''}{attr}: dim {dim} {buf.shape[dim]} -> "
                           f"{buf.shape[dim] // tp}")
    for module in model.modules():  # other holders of the same tensors (transformers' StaticCache layers)
        for value in list(vars(module).values()):
            layers = getattr(value, "layers", None)
            if not isinstance(layers, (list, tuple)):
                continue
            for layer in layers:
                for key, tensor in list(getattr(layer, "__dict__", {}).items()):
                    if isinstance(tensor, torch.Tensor) and id(tensor) in swapped:
                        setattr(layer, key, swapped[id(tensor)])
    return changed


def _reorder_fused(model: nn.Module, tp: int) -> None:
    """Rows of each fused projection as [part 0 piece 0, part 1 piece 0, ..., part 0 piece 1, ...], so
    that rank r's contiguous shard holds piece r of every part."""
    for name, parts in FUSED_PARTS.items():
        module = model.get_submodule(name)
        for tensor in (module.weight, module.bias):
            if tensor is None:
                continue
            pieces = [part.chunk(tp, dim=0) for part in tensor.detach().split(parts, dim=0)]
            with torch.no_grad():
                tensor.copy_(torch.cat([pieces[p][r] for r in range(tp) for p in range(len(parts))], dim=0))


def _head_norms(model: nn.Module) -> list[str]:
    """The norms of each attention module of TP_BLOCKS that normalise one head's vector (a weight of the
    module's head_dim elements: Qwen3's q_norm and k_norm). They run on the rank's heads, so each takes
    SequenceParallel: its weight a replicated DTensor whose gradient is summed over the TP ranks (a plain
    weight would keep only its own heads' part), its input taken as this rank's shard, its output local."""
    found = []
    for name in TP_BLOCKS:
        module = model.get_submodule(name)
        head_dim = getattr(module, "head_dim", None) or getattr(getattr(module, "config", None), "head_dim", None)
        if not isinstance(head_dim, int) or isinstance(head_dim, bool):
            continue
        for child, sub in module.named_children():
            weight = getattr(sub, "weight", None)
            norm = isinstance(sub, (nn.LayerNorm, nn.RMSNorm)) or type(sub).__name__.endswith("Norm")
            if norm and isinstance(weight, torch.Tensor) and weight.numel() == head_dim:
                found.append(f"{name}.{child}")
    return [name for name in found if name not in PLAN]


def _local_heads(model: nn.Module, tp: int) -> list[str]:
    """Divide the head counts and widths of each attention module by tp; return what changed."""
    changed = []
    for name in TP_BLOCKS:
        module = model.get_submodule(name)
        if not any(isinstance(getattr(module, a, None), int) for a in HEAD_ATTRS):
            continue
        for attr in HEAD_ATTRS + WIDTH_ATTRS:
            value = getattr(module, attr, None)
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            if value % tp:
                raise ValueError(f"{name}.{attr} = {value} is not divisible by tp={tp}: DTensor shards whole heads")
            setattr(module, attr, value // tp)
            changed.append(f"{name}.{attr}: {value} -> {value // tp}")
    return changed


def init_mesh(device: str = DEVICE) -> DeviceMesh:
    """The plan's whole mesh, dims MESH_DIMS in order (pp, dp_replicate, dp_shard, tp: TP innermost,
    rank = ((stage * dp_replicate + replica) * dp_shard + shard) * tp + tp_rank, the plan's rank layout), for
    apply(). Call it on every rank after init_process_group."""
    return init_device_mesh(device, tuple(MESH_DIMS.values()), mesh_dim_names=tuple(MESH_DIMS))


def _layer_names(module: nn.Module) -> list[str]:
    """The transformer layers of `module` that are FSDP units: those of DP_UNITS it has (a pipeline
    stage holds some), else the children of its first ModuleList / ModuleDict of NUM_LAYERS modules."""
    modules = dict(module.named_modules())
    if DP_UNITS is not None:
        return [name for name in DP_UNITS if name in modules]
    for name, child in modules.items():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) and len(child) == NUM_LAYERS:
            return [f"{name}.{key}" if name else key for key, _ in child.named_children()]
    raise ValueError(f"found no ModuleList / ModuleDict of the plan's {NUM_LAYERS} layers: set DP_UNITS")


def apply_data_parallel(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Data parallelism as DP_STYLE says, on the data-parallel dims of `mesh` (init_mesh()'s):
    fully_shard(layer, mesh=dp_mesh, reshard_after_forward=RESHARD_AFTER_FORWARD, mp_policy=...) for
    each layer (parameters gathered in PARAM_DTYPE, gradients reduced in REDUCE_DTYPE),
    then for `module` itself (its parameters outside the layers: embeddings, final norm, LM head),
    dp_mesh = mesh["dp_replicate", "dp_shard"] with replicas (HSDP; DDP with a shard dim of 1), else
    mesh["dp_shard"]. After apply()'s tensor parallelism (fully_shard composes with its DTensors);
    with pipeline stages, on each stage's module after the split. Nothing at dp=1."""
    if MESH_DIMS["dp_replicate"] * MESH_DIMS["dp_shard"] == 1:
        return module
    names = mesh.mesh_dim_names or ()
    if "dp_shard" not in names:
        raise ValueError(f"data parallelism needs init_mesh()'s mesh (dims {tuple(MESH_DIMS)}), got dims {names}")
    dp_mesh = mesh["dp_replicate", "dp_shard"] if MESH_DIMS["dp_replicate"] > 1 else mesh["dp_shard"]
    policy = MixedPrecisionPolicy(param_dtype=PARAM_DTYPE, reduce_dtype=REDUCE_DTYPE)
    for name in _layer_names(module):
        fully_shard(
            module.get_submodule(name), mesh=dp_mesh, reshard_after_forward=RESHARD_AFTER_FORWARD, mp_policy=policy
        )
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=RESHARD_AFTER_FORWARD, mp_policy=policy)
    return module


def apply(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard `model` (unsharded, eager, weights loaded, the same on every rank) as planned; return it.
    `mesh`: init_mesh()'s (tensor parallelism on its "tp" dim, then, without pipeline stages, data
    parallelism on its dp dims: apply_data_parallel), or a 1-D mesh of the tensor-parallel ranks
    (tensor parallelism only). Raises ValueError when UNSUPPORTED names a split this file cannot
    express, when the mesh does not match the plan or the model lacks a planned module."""
    if UNSUPPORTED:
        name, why = next(iter(UNSUPPORTED.items()))
        raise ValueError(f"{name}: {why} ({len(UNSUPPORTED)} such split(s) in UNSUPPORTED)")
    whole = "tp" in (mesh.mesh_dim_names or ())
    if whole and tuple(mesh.shape) != tuple(MESH_DIMS.values()):
        raise ValueError(f"the plan's mesh is {MESH_DIMS}, this one has shape {tuple(mesh.shape)}")
    tp_mesh = mesh["tp"] if whole else mesh
    tp = tp_mesh.size()
    if tp != TP_DEGREE:
        raise ValueError(f"the plan is for tp={TP_DEGREE}, the mesh has {tp} ranks")
    if TP_DEGREE > 1:
        _tensor_parallel(model, tp_mesh)
    if whole and PP_DEGREE == 1:
        apply_data_parallel(model, mesh)
    return model


def _tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """PLAN and VOCAB on the 1-D tensor-parallel `mesh` (the file's docstring)."""
    tp = mesh.size()
    plan = tp_plan(model)
    tied = [
        (name, module, other)
        for name, module in model.named_modules(remove_duplicate=False)
        for other in plan
        if name != other and name in plan and isinstance(module, nn.Embedding)
        and module.weight is model.get_submodule(other).weight
    ]
    _reorder_fused(model, tp)
    kv_heads = _kv_heads(model)
    head_norms = _head_norms(model)
    _local_heads(model, tp)
    parallelize_module(model, mesh, plan)
    for name in head_norms:
        parallelize_module(model.get_submodule(name), mesh, SequenceParallel(use_local_output=True))
    for _, module, other in tied:
        module.weight = model.get_submodule(other).weight  # tie again: both are the same Shard(0) DTensor
    if SEQUENCE_PARALLEL:
        _sequence_hooks(model, mesh)
    if KV_CACHES:
        _local_caches(model, mesh, kv_heads)
'''


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _adapter_owners(plan: Plan) -> dict[str, str]:
    """Module FQN -> the module that holds it with its LoRA partners (`Plan.adapters`): the longest
    common prefix of a projection's and its adapters' modules ("h.0.qkv" for "h.0.qkv.base" and
    "h.0.qkv.down"; PEFT's "...q_proj" for "...q_proj.base_layer" and "...q_proj.lora_A.default").
    A LoRA'd projection pairs with its block's others as that module."""
    owners: dict[str, str] = {}
    for adapter, base in plan.adapters.items():
        a, b = adapter.removesuffix(".weight").split("."), base.removesuffix(".weight").split(".")
        common = []
        for x, y in zip(a, b):
            if x != y:
                break
            common.append(x)
        owner = ".".join(common)
        owners[".".join(a)] = owners[".".join(b)] = owner
    return owners


def _natural(fqn: str) -> list[object]:
    """Sort key: "layers.2" before "layers.10"."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in fqn.split(".")]


def _list(names: list[str]) -> str:
    """A list literal, one name per line when long."""
    if len(repr(names)) <= 80:
        return repr(names)
    return "[\n" + "".join(f"    {n!r},\n" for n in names) + "]"


@dataclass
class DTensorPlan:
    """The data of the exported file: what `apply` shards and how, and the warnings."""

    styles: dict[str, str]  # PLAN: module FQN -> style, as source ("ColwiseParallel()")
    vocab: list[str]  # VOCAB: modules split along the vocabulary (styled by type at apply time)
    fused: dict[str, list[int]]  # FUSED_PARTS: fused projection -> sizes of its parts
    blocks: list[str]  # TP_BLOCKS: parents of colwise + rowwise pairs (attention, MLP)
    warnings: list[str]
    unsupported: dict[str, str]  # UNSUPPORTED: module -> why apply() refuses the plan
    # FIRST_LAYER: under sequence parallel, the layer at whose input the stream is cut along the sequence
    first_layer: str | None = None
    kv_caches: bool = False  # KV_CACHES: a served plan splitting attention heads: apply() cuts the caches
    # data parallelism: DP_STYLE (the style fully_shard runs, a `dp_label`), MESH_DIMS' dp_replicate and
    # dp_shard, RESHARD_AFTER_FORWARD, DP_UNITS (the layers' module FQNs; None: found at apply time)
    dp_style: str = "ddp"
    dp_replicate: int = 1
    dp_shard: int = 1
    reshard_after_forward: bool = True
    dp_units: list[str] | None = None


def dtensor_plan(plan: Plan) -> DTensorPlan:
    """The plan's tensor-parallel splits as `parallelize_module` styles (table in the module docstring)."""
    warnings: list[str] = []
    sp = plan.sequence_parallel and plan.tp > 1
    splits = {w.removesuffix(".weight"): s for w, s in plan.splits.items() if plan.tp > 1}
    owners = _adapter_owners(plan)
    col = {owners.get(m, m) for m, s in splits.items() if s.style is SplitStyle.COLWISE}
    row = {owners.get(m, m) for m, s in splits.items() if s.style is SplitStyle.ROWWISE}
    col_parents, row_parents = {_parent(m) for m in col}, {_parent(m) for m in row}
    blocks = sorted(col_parents & row_parents, key=_natural)
    if sp and not blocks:
        warnings.append("sequence parallel without a split attention or MLP block: exported without it")
        sp = False
    if plan.tp_comm_overlap and plan.tp > 1:
        warnings.append(
            "the plan overlaps TP communication with its GEMMs; eager DTensor runs each collective exposed: "
            "compile the module with torch._inductor.config._micro_pipeline_tp = True (PyTorch's async TP, "
            "symmetric memory on the TP group) to overlap them, else expect "
            f"{plan.predicted.overlapped_comm_s * 1e3:.4g} ms more per step than predicted"
        )
    styles: dict[str, str] = {}
    fused: dict[str, list[int]] = {}
    unsupported = _unsupported_pairings(plan)
    for weight in kv_piece_splits(plan):  # a KV head replicated over ranks: no 1-D DTensor style holds it
        unsupported[weight.removesuffix(".weight")] = (
            f"the plan cuts this K/V projection into {plan.splits[weight].pieces} KV heads over tp={plan.tp} ranks "
            "(each head replicated, as vLLM does); a parallelize_module plan shards whole heads only"
        )
    if sp:  # one module holding the attention's and the MLP's pairs (its norms and residual adds too)
        for block in blocks:
            rows = sorted((m for m in row if _parent(m) == block), key=_natural)
            if len(rows) > 1:
                unsupported[block] = (
                    f"under sequence parallelism each block of TP_BLOCKS gathers its input once and its row-parallel "
                    f"projection reduce-scatters back to the sequence shard, but {block} holds {len(rows)} row-parallel "
                    f"projections ({', '.join(r.rsplit('.', 1)[-1] for r in rows)}): its norms read the gathered input and "
                    "its residual adds meet a reduce-scattered output inside one forward, which no parallelize_module "
                    "plan of whole modules expresses; export the plan without sequence parallelism, or run it with "
                    "planner run"
                )
    if sp:  # a block's gathered input is a DTensor, which a plain (replicated) nn.Linear cannot take
        for weight in sorted(plan.adapters):
            module = weight.removesuffix(".weight")
            if module not in splits or splits[module].style is SplitStyle.REPLICATE:
                unsupported[module] = (
                    "a LoRA adapter's projection kept whole beside its split projection under sequence parallelism "
                    "reads the block's gathered input, a DTensor, as a plain nn.Linear, which DTensor refuses; "
                    "export the plan without sequence parallelism, or run it with planner run"
                )
    for module, why in unsupported.items():
        warnings.append(
            f"{module}: {why}; apply() refuses the plan (edit that split, or run it with planner run)"
        )
    for module, split in splits.items():
        linear_dim = {SplitStyle.COLWISE: 0, SplitStyle.ROWWISE: 1}.get(split.style)
        if linear_dim is not None and split.dim != linear_dim:
            warnings.append(
                f"{module} stores its weight (in, out) (a Hugging Face Conv1D?): DTensor's styles split nn.Linear "
                "only; apply() refuses it"
            )
        owner = owners.get(module, module)  # a LoRA'd projection's parts sit under the module that adds them
        if split.style is SplitStyle.COLWISE:
            # under sequence parallel a block gathers its input itself (apply()'s hook); a projection
            # outside the blocks (an LM head kept apart) gathers its own
            kwargs = ["input_layouts=Shard(1)"] if sp and _parent(owner) not in blocks else []
            if _parent(owner) not in row_parents or split.gather_output:  # read whole (a norm over the width)
                kwargs.append("output_layouts=Replicate()")
            styles[module] = f"ColwiseParallel({', '.join(kwargs)})"
            if split.parts:
                fused[module] = list(split.parts)
        elif split.style is SplitStyle.ROWWISE:
            kwargs = (
                []
                if _parent(owner) in col_parents and not split.replicated_input
                else ["input_layouts=Replicate()"]
            )
            if sp:
                kwargs.append("output_layouts=Shard(1)")
            styles[module] = f"RowwiseParallel({', '.join(kwargs)})"
    vocab = sorted((m for m, s in splits.items() if s.style is SplitStyle.VOCAB), key=_natural)
    pieces = kv_piece_splits(plan)
    if pieces:
        warnings.append(
            f"the plan splits {len(pieces)} K/V projection(s) ({pieces[0]}, ...) into {plan.splits[pieces[0]].pieces} "
            f"pieces, each KV head replicated on several of the tp={plan.tp} ranks; a 1-D DTensor plan shards whole "
            "heads only: apply() refuses the model (plan with --tp at most the KV-head count)"
        )
    if plan.ladder_layers:
        warnings.append(
            f"ladder residual (layers {plan.ladder_layers}) changes the model's forward, which a parallelize_module "
            "plan cannot: the exported plan shards the standard model (every TP all-reduce exposed)"
        )
    if plan.pp > 1:
        warnings.append(
            f"the DTensor file covers the tensor- and data-parallel axes; apply the pipeline split (pp={plan.pp}, "
            "STAGES in the file) with torch.distributed.pipelining yourself"
            + (
                f", then apply_data_parallel(stage_module, mesh) on each stage's module (apply() leaves the "
                f"data parallelism, dp={plan.dp} {plan.dp_style_text()}, to it with pipeline stages)"
                if plan.dp > 1
                else ""
            )
        )
    if plan.ep > 1:
        warnings.append(
            f"expert parallelism (ep={plan.ep} over {plan.ep_fold}) is not part of the plan's DTensor file: "
            "parallelize_module has no style for token dispatch to experts on other ranks, so every rank holds "
            "all the routed experts (torchtitan's expert-parallel styles, --to torchtitan, or --to megatron "
            "carry it)"
        )
    if any(v != "none" for v in plan.recompute.values()):
        warnings.append(
            "activation recomputation is not part of the plan's DTensor file: wrap the layers listed in RECOMPUTE "
            f"({plan.recompute_text()}) with torch.utils.checkpoint yourself"
        )
    for f in plan.fallbacks:
        warnings.append(
            f"the plan runs {f.op} replicated at {f.line} (its input all-gathered, priced); the exported styles "
            "gather there only where the op sits between an MLP's projections: check the model's outputs "
            "against the unsharded one's if it is elsewhere"
        )
    # an attention split over its heads (plans without roles: any column-parallel split)
    heads_split = any(s.style is SplitStyle.COLWISE and plan.roles.get(f"{m}.weight", "k") in ("q", "k", "v", "qkv")
                      for m, s in splits.items())  # fmt: skip
    if plan.serving is not None:
        for note in plan.serving.fallbacks:
            warnings.append(f"serving fallback the plan priced, which DTensor cannot express: {note}")
    if plan.tp == 1:
        warnings.append(
            "the plan has tp=1: no tensor parallelism, PLAN is empty"
            + (" (apply() runs the data parallelism alone)" if plan.dp > 1 else ": there is nothing to shard")
        )
    first_layer = _parent(blocks[0]) if sp else None
    kv_caches = plan.serving is not None and heads_split
    exported = DTensorPlan(styles, vocab, fused, blocks, warnings, unsupported, first_layer, kv_caches)
    _data_parallel(plan, exported)
    return exported


def _data_parallel(plan: Plan, exported: DTensorPlan) -> None:
    """The data-parallel fields of `exported` for the plan's style (module docstring's table), and the
    warning for a ZeRO-1 / ZeRO-2 plan, which fully_shard cannot run."""
    label = dp_label(plan)
    exported.dp_units = _layer_units(plan)
    if plan.dp == 1 and plan.cp == 1:  # with CP the gradients are averaged over the CP ranks at dp=1 too
        return
    if label == "ddp":  # as torchtitan 0.3: fully_shard over a replicate dim and a shard dim of 1
        exported.dp_style, exported.dp_replicate, exported.reshard_after_forward = "ddp", plan.dp, False
        return
    if plan.dp_style is DataParallel.FSDP:
        exported.dp_style = label
        exported.dp_replicate, exported.dp_shard = plan.dp_replicate, plan.dp_shard
        exported.reshard_after_forward = plan.reshard_after_forward
        return
    form = nearest_dp_form(plan, ["fsdp-noreshard", "fsdp"], "fsdp-noreshard")
    exported.dp_style, exported.dp_shard = form, plan.dp
    exported.reshard_after_forward = not form.endswith("-noreshard")
    exported.warnings.append(
        dp_substitute_warning(
            plan,
            "fully_shard (FSDP2)",
            ZERO_NAMES[plan.dp_style],
            form,
            f"fully_shard over the {plan.dp} data-parallel ranks with "
            f"reshard_after_forward={exported.reshard_after_forward}, which shards the parameters too",
        )
    )


def _layer_units(plan: Plan) -> list[str] | None:
    """Module FQNs of the plan's transformer layers (the prefix of each weight of `roles` and `splits`
    up to its first numeric part: "model.layers.3"), in order; None unless they are the plan's
    number of layers (apply() then finds the layers' ModuleList itself)."""
    units = set()
    for weight in [*plan.roles, *plan.splits]:
        parts = weight.split(".")
        index = next((i for i, p in enumerate(parts[:-1]) if p.isdigit()), None)
        if index is not None:
            units.add(".".join(parts[: index + 1]))
    ordered = sorted(units, key=_natural)
    return ordered if len(ordered) == num_layers(plan) else None


def _unsupported_pairings(plan: Plan) -> dict[str, str]:
    """Module -> why, for splits that DTensor's Colwise/RowwiseParallel pairing cannot run as the plan
    priced (`against_megatron_pairing`): a row-parallel projection that reads the block's input (its
    partial sums are reduce-scattered onto the heads in the plan; RowwiseParallel here expects the
    sharded output of a colwise sibling) or a column-parallel projection that writes the stream (the
    plan all-gathers it). None at tp=1, where nothing is split."""
    if plan.tp == 1:
        return {}
    out = {}
    for weight, role in against_megatron_pairing(plan).items():
        if plan.splits[weight].style is SplitStyle.ROWWISE:
            why = (
                f"the plan splits this {role!r} projection row-wise (its input sliced, its partial sums "
                "reduce-scattered onto the heads); a parallelize_module plan pairs a row-wise projection "
                "with the column-wise ones that feed it"
            )
        else:
            why = (
                f"the plan splits this {role!r} projection column-wise (its output all-gathered back "
                "onto the stream); a parallelize_module plan pairs a column-wise projection with the "
                "row-wise one it feeds"
            )
        out[weight.removesuffix(".weight")] = why
    return out


def _mesh_device(plan: Plan) -> str:
    """The device type of the plan's cluster for init_device_mesh: "cpu" for a gloo cluster, else
    "cuda" (also when its spec does not load here)."""
    cluster = plan.saved_cluster()
    return "cpu" if cluster is not None and cluster.backend == "gloo" else "cuda"


def _dp_note(plan: Plan, exported: DTensorPlan) -> str:
    """The data-parallel paragraph of the file's docstring ("" at dp=1 without context parallelism)."""
    if plan.dp == 1 and plan.cp == 1:
        return ""
    r, sh = exported.dp_replicate, exported.dp_shard
    mesh = 'mesh["dp_replicate", "dp_shard"]' if r > 1 else 'mesh["dp_shard"]'
    with_cp = (
        "" if plan.cp == 1 else f" x cp={plan.cp} ranks (the CP ranks of a replica hold the same weights)"
    )
    if plan.cp > 1:
        mesh = "data_parallel_mesh(mesh)"
    what = {
        "ddp": f"DDP as torchtitan runs it: replicated over dp_replicate={r}{with_cp}, a shard dim of 1, the "
        "gradients all-reduced",
    }.get(
        exported.dp_style,
        f"sharded over dp_shard={sh}{with_cp}"
        + (f", replicated over dp_replicate={r} (HSDP)" if r > 1 else ""),
    )
    when = (
        "apply() does it after the tensor parallelism"
        if plan.pp == 1
        else (
            "with pipeline stages apply() leaves it to you: call apply_data_parallel(stage_module, mesh) on each "
            "stage's module after the split"
        )
    )

    def fill(text: str) -> str:
        return textwrap.fill(text, width=100, break_long_words=False, break_on_hyphens=False)

    head = fill(
        f"Data parallelism (DP_STYLE {exported.dp_style!r}, the plan's {plan.dp_style_text()}): apply_data_parallel() "
        "calls, on each transformer layer (DP_UNITS) and then on the model itself (the parameters outside the "
        "layers):"
    )
    call = f"    fully_shard(module, mesh={mesh}, reshard_after_forward={exported.reshard_after_forward})"
    averaged = (
        "The gradients are averaged over the dp ranks, which each feed their own batch."
        if plan.cp == 1
        else "The gradients are averaged over the dp x cp ranks: each dp rank feeds its own batch, whose "
        "sequences its CP ranks split."
    )
    tail = fill(f"{what}; {when}. {averaged}")
    return f"\n\n{head}\n\n{call}\n\n{tail[0].upper()}{tail[1:]}"


def _torch_dtype(name: str | None) -> str:
    return {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}.get(
        name or "", "None"
    )


def _precision(plan: Plan) -> tuple[str | None, str | None, list[str]]:
    """(fully_shard's param_dtype, its reduce_dtype, warnings) for `plan`'s dtype: the parameters gathered
    and computed in a bf16 / fp16 plan's dtype, the gradients reduced as the plan priced it
    (`Plan.grad_reduce_dtype`: fp32, or the parameters' dtype); an fp32 plan casts nothing. Without
    fully_shard (dp = 1) nothing casts the model: the docstring says to build it in the plan's dtype."""
    if plan.dtype == "fp32":
        return None, None, []
    reduce = "fp32" if plan.workload is Workload.TRAIN and plan.grad_reduce_dtype == "fp32" else plan.dtype
    warnings = []
    if plan.workload is Workload.TRAIN and plan.loss_scale is not None:
        warnings.append(
            f"the plan trains in {plan.dtype} with {loss_scale_text(plan.loss_scale)}; the exported file does not "
            "scale the loss: step through torch.amp.GradScaler (it takes DTensor gradients) as the plan priced"
        )
    return plan.dtype, reduce, warnings


def _dtype_note(plan: Plan) -> str:
    """The docstring's paragraph on the plan's dtype: what fully_shard casts, what the user casts."""
    if plan.dtype == "fp32":
        return "The plan computes in fp32: build the model in fp32 (PARAM_DTYPE None: fully_shard casts nothing)."
    dp = (
        "fully_shard's MixedPrecisionPolicy gathers the parameters in PARAM_DTYPE and reduces the gradients in "
        "REDUCE_DTYPE (apply_data_parallel), its sharded parameters staying as built (fp32 for an optimizer "
        "step in fp32)"
        if plan.dp > 1
        else f"nothing here casts the model (no data parallelism, no fully_shard): build it in {plan.dtype} "
        "(model.to(PARAM_DTYPE)) or run it under torch.autocast(dtype=PARAM_DTYPE)"
    )
    return textwrap.fill(f"The plan computes in {plan.dtype}: {dp}.", width=100, break_long_words=False)


def export_dtensor(plan: Plan) -> Export:
    """The Python file (module docstring) with its warnings."""
    exported = dtensor_plan(plan)
    param_dtype, reduce_dtype, precision_warnings = _precision(plan)
    device = _mesh_device(plan)
    sp = exported.first_layer is not None
    plan_lines = "\n".join(f"    {m!r}: {s}," for m, s in exported.styles.items())
    dims = {  # the plan's rank order (`MeshShape`), torchtitan's: the pipeline outermost, CP next to TP
        "pp": plan.pp,
        "dp_replicate": exported.dp_replicate,
        "dp_shard": exported.dp_shard,
        **({"cp": plan.cp} if plan.cp > 1 else {}),
        "tp": plan.tp,
    }
    cp = plan.cp > 1
    axes = "Tensor-, context- and data-parallel" if cp else "Tensor- and data-parallel"
    cp_label = f" cp={plan.cp}" if cp else ""
    header = f'''"""{axes} plan for {plan.model} on {plan.cluster} (tp={plan.tp}{cp_label} dp={plan.dp}, {plan.workload},
{plan.dtype}), written by planner export --to dtensor, for torch.distributed.tensor.parallel and fully_shard.

On every rank, after torch.distributed.init_process_group, with the unsharded model built and its
weights loaded:

    mesh = init_mesh("{device}")  # MESH_DIMS {dims}
    model = apply(model, mesh)

or, for the tensor-parallel axis alone, a 1-D mesh of its ranks:

    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("{device}", ({plan.tp},))
    model = apply(model, mesh)

{_dtype_note(plan)}

apply() shards the modules of PLAN and VOCAB with parallelize_module. Before that it reorders the rows
of each fused projection in FUSED_PARTS so that each rank's shard holds its piece of every part (a
full_tensor() of such a weight is in that order), and divides the head counts and widths
(HEAD_ATTRS, WIDTH_ATTRS) of each module in TP_BLOCKS that has a head count (the attention modules) by
tp: the attention's forward must size its views from those attributes (or with -1), as the rank now
computes only its own heads; its norms of one head's vector (a weight of head_dim elements, Qwen3's
q_norm and k_norm) are replicated DTensors (SequenceParallel), their gradients summed over the ranks. A token embedding tied to a vocabulary-split LM head is split with it
and tied again.{_SP_NOTE if sp else ""}{_CACHE_NOTE if exported.kv_caches else ""}{dtensor_cp.NOTE if cp else ""}\
{_dp_note(plan, exported)}
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
{dtensor_cp.IMPORTS if cp else ""}
TP_DEGREE = {plan.tp}
PP_DEGREE = {plan.pp}
SEQUENCE_PARALLEL = {sp}
MESH = {{"dp": {plan.dp}, "pp": {plan.pp}, {f'"cp": {plan.cp}, ' if cp else ""}"tp": {plan.tp}}}
# init_mesh()'s dims, in rank order (TP innermost); dp_replicate x dp_shard = dp
MESH_DIMS = {dims!r}
DEVICE = {device!r}  # init_mesh()'s default device type: the plan's cluster's
DP_STYLE = {exported.dp_style!r}  # what fully_shard runs: ddp, fsdp, fsdp-noreshard, hsdp SxR[-noreshard]
RESHARD_AFTER_FORWARD = {exported.reshard_after_forward}  # fully_shard's reshard_after_forward, every unit
# fully_shard's MixedPrecisionPolicy: the plan's {plan.dtype} compute and its gradient reduction (None: as stored)
PARAM_DTYPE = {_torch_dtype(param_dtype)}
REDUCE_DTYPE = {_torch_dtype(reduce_dtype)}
NUM_LAYERS = {num_layers(plan)}
DP_UNITS = {pprint.pformat(exported.dp_units, compact=True, width=100)}  # FSDP units, in order (None: found by apply)
STAGES = {pprint.pformat([list(s) for s in plan.stages], compact=True, width=100)}  # layers per pipeline stage
RECOMPUTE = {pprint.pformat(plan.recompute_ranges())}  # layers (first-last, inclusive) -> recomputation

PLAN: dict[str, ParallelStyle] = {{  # module FQN -> style
{plan_lines}
}}
VOCAB = {_list(exported.vocab)}  # split along the vocabulary (styled by type in tp_plan)
FUSED_PARTS = {exported.fused!r}  # fused projection -> sizes of its parts (rows)
TP_BLOCKS = {_list(exported.blocks)}  # parents of colwise + rowwise pairs; head counts become per-rank
UNSUPPORTED = {pprint.pformat(exported.unsupported, width=100)}  # module -> why apply() refuses the plan
FIRST_LAYER = {exported.first_layer!r}  # SEQUENCE_PARALLEL: the stream is cut along the sequence at its input
KV_CACHES = {exported.kv_caches}  # a served plan with attention heads split: apply() cuts the KV caches
'''
    text = header + dtensor_cp.constants(plan) + dtensor_cp.apply_source(_APPLY_SOURCE, plan.cp)
    return Export(text, exported.warnings + precision_warnings + dtensor_cp.warnings(plan, device))

"""`planner optimize --emit DIR`: write every rank's generated sharded module for a plan.

For each (pipeline stage, TP rank) of the mesh, the captured graph is lowered in this process
(`passes.lower.lower_for_rank`: TP pass, ladder pass, pipeline split; no process group is needed to
lower) and written with `passes.emit.emit_rank_module` as `DIR/rank{r}/` (module source, weight
shards, meta.json) for every rank r that runs it: DP replicas run the same module, so each of them
gets its own copy under its own rank. A README in DIR says how to start them (backend and devices of
the plan's cluster, the folder's real path). A training fsdp plan's modules are sharded after the
lowering (`passes.fsdp.apply_fsdp`): each DP rank's folder holds only its flat shard of every unit
(`fsdp_shard_<k>`, the layout in meta.json "fsdp"). Models whose weights exceed `MAX_MATERIALISED_BYTES`
are emitted from the `meta` device: source and shard shapes only, weights to be loaded from the
user's checkpoint.

The folder is written to a new temporary sibling and renamed into place (`planner.files`): an error
leaves nothing, and an existing folder is replaced only when it is empty or an earlier emit (a
marker file lists what it wrote) holding nothing else; any other folder is refused (exit 2).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch

from passes.checkpoint import checkpoint_files, load_whole
from passes.emit import emit_rank_module, write_readme
from passes.fsdp import apply_fsdp
from passes.lower import lower_for_rank
from planner.errors import InputError
from planner.files import failed_write, new_output_folder, publish_folder
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture
from planner.frontend.modelfile import load_model_file
from planner.frontend.phases import build_for, decode_phase, phase_inputs
from planner.plan import DataParallel, Plan, Workload, loss_scale_text
from runtime.reference import WEIGHTS_HELP

MAX_MATERIALISED_BYTES = 4 * 2**30  # above this, emit from meta (no weights): a laptop cannot hold 70B
SEED = 0  # the seed `planner run` builds models with, so emitted weights match a run


def experts_text(plan: Plan) -> str:
    """The emitted README's mixture-of-experts section for `plan` ("" without a split of its experts):
    how the routed experts are split and which "ep" process group each rank binds before the first
    call (`passes.ep_lower` dispatches over the "ep" axis, whatever the degree)."""
    if plan.ep == 1 and plan.expert_tp == 1:
        return ""
    if plan.ep == 1:
        return (
            f"Each routed expert is split over the {plan.tp} TP ranks as a Megatron MLP "
            '(`passes.expert_parallel.ep_moe`, its outputs summed over the "tp" group), with no expert '
            'parallelism: its dispatch runs over a one-rank "ep" axis, bound by `register_group("ep", None)` '
            "in the code above."
        )
    if plan.ep_fold == "tp":
        return (
            f"Expert parallelism over the {plan.tp} TP ranks: each holds 1/{plan.ep} of the experts and the "
            'outputs are summed over the "tp" group (`passes.expert_parallel.ep_moe_replicated`); nothing more '
            "to bind."
        )
    split = f", each expert split over the {plan.tp} TP ranks" if plan.expert_tp > 1 else ""
    over_tp = (
        ", and the TP ranks of each: whole experts run each TP rank's sequence shard of the tokens"
        if plan.experts_on_sequence_shard
        else ""
    )
    return (
        f"Expert parallelism over {plan.ep} data-parallel ranks{split}: a rank's EP group is the {plan.ep} "
        "consecutive ranks of its dp x cp ranks at the same (pp, tp) coordinate (`runtime.mesh.ep_ranks`); every "
        'rank makes every EP group with `dist.new_group` and binds its own with `register_group("ep", group)` '
        "before the first call. Training: an expert's gradient already sums every EP rank's tokens; sum it over "
        "the ranks holding the same experts (the other members of its dp x cp ranks at the same place in their "
        f"EP groups{over_tp}) and divide by dp x cp, as `planner run` does "
        "(`runtime.data_parallel.reduce_expert_gradients`, `runtime.mesh.ep_ranks`)."
    )


def emit_plan(
    plan: Plan, model_path: str, out_dir: str, backend: str = "gloo", weights: str | None = None
) -> Path:
    """Write the generated module of every rank of `plan` into `out_dir`; return its path.

    backend: the process-group backend of the plan's cluster, which the README's example initialises
    ("gloo": CPU processes; "nccl": one GPU per rank). weights: a safetensors file or folder of the
    model's weights (`--weights`), the tensors the rank modules are sharded from (None: the seeded
    init; a served model reads the parameters only, its caches stay as the request sizes them).
    Raises InputError when the weights are missing, do not fit the model, or the model is too large
    to hold here with them (`MAX_MATERIALISED_BYTES`), when the plan ladders layers
    across pipeline stages or has more than one model chunk per pipeline rank (`virtual_stages`: an
    emitted rank folder holds one module), or when `out_dir` cannot be written or is a non-empty
    folder the planner did not write (nothing is changed then).
    """
    if plan.virtual_stages > 1:
        raise InputError(
            f"plan field 'virtual_stages' is {plan.virtual_stages} (interleaved 1F1B): --emit writes one module "
            "per rank and cannot emit model chunks yet; run the plan with --run, or re-plan with "
            "--schedule 1f1b to emit it"
        )
    tmp = new_output_folder(out_dir, "--emit")
    try:
        model_file = load_model_file(model_path)
        batch = plan.batch_size // plan.dp // max(1, plan.micro_batches if plan.pp > 1 else 1)
        sv = plan.serving  # a model with a KV cache: the decode step the plan was solved on
        phase = (
            decode_phase(batch, sv.prompt_len, sv.cache_len)
            if sv is not None and model_file.has_cache
            else None
        )

        def build(device: str) -> torch.nn.Module:
            return model_file.build(device) if phase is None else build_for(model_file, phase, device)

        meta_model = build("meta")
        weight_bytes = sum(p.numel() * p.element_size() for p in meta_model.parameters())
        device = "meta" if weight_bytes > MAX_MATERIALISED_BYTES else "cpu"
        if weights and device == "meta":
            raise InputError(
                f"--emit with --weights: the model's {weight_bytes / 2**30:.1f} GiB of parameters exceed the "
                f"{MAX_MATERIALISED_BYTES / 2**30:.0f} GiB --emit holds in memory to shard; emit without --weights "
                "(the modules are written on meta, to load each rank's shards yourself)"
            )
        torch.manual_seed(SEED)
        model = meta_model if device == "meta" else build("cpu")
        if weights:
            load_whole(model, checkpoint_files(weights), WEIGHTS_HELP, parameters_only=phase is not None)
        args, kwargs = (
            model_file.inputs(batch, plan.seq_len) if phase is None else phase_inputs(model_file, phase)
        )
        gm = capture(model, args, kwargs)
        structure = analyse(gm)
        fsdp = plan.workload is Workload.TRAIN and plan.dp_style is DataParallel.FSDP
        units = [layer.module_path for layer in structure.layers]
        shard_size = plan.dp_shard * plan.cp  # fsdp shards span the CP ranks too (runtime.mesh)
        for rank in range(plan.tp * plan.cp * plan.pp):  # DP replica 0 lowers; every replica gets the module
            lowered = lower_for_rank(copy.deepcopy(gm), structure, plan, rank)
            cp_rank = plan.mesh.cp_rank(rank)
            sharded: dict[int, tuple] = {}  # fsdp: shard rank -> (module, layout), cut once
            for dp_rank in range(plan.dp):
                module = lowered.module
                shard_rank = (dp_rank % plan.dp_shard) * plan.cp + cp_rank
                if fsdp:  # each DP rank's files hold only its flat shard of every unit (passes.fsdp)
                    if shard_rank not in sharded:
                        copied = copy.deepcopy(lowered.module)
                        sharded[shard_rank] = (copied, apply_fsdp(copied, units, shard_size, shard_rank))
                    module = sharded[shard_rank][0]
                meta = {
                    "plan": plan.layout_summary(),
                    "backend": backend,
                    "world_size": plan.num_devices,
                    "dp_rank": dp_rank,
                    "tp_rank": lowered.tp_rank,
                    "cp_rank": cp_rank,
                    "pp_rank": lowered.pp_rank,
                    "weights_materialised": device != "meta",
                }
                if fsdp:
                    meta["fsdp"] = sharded[shard_rank][1].summary()
                global_rank = plan.mesh.rank_of(dp_rank, lowered.pp_rank, lowered.tp_rank, cp_rank)
                emit_rank_module(module, tmp, global_rank, meta)
        inputs = ", ".join(
            f"{tuple(a.shape)} {str(a.dtype).removeprefix('torch.')}"
            for a in args
            if isinstance(a, torch.Tensor)
        )
        write_readme(
            tmp,
            {
                "model": str(model_path),
                "tp": plan.tp,
                "cp": plan.cp,
                "cp_text": plan.cp_text(),
                "pp": plan.pp,
                "dp": plan.dp,
                "world_size": plan.num_devices,
                "backend": backend,
                "folder": str(Path(out_dir).resolve()),
                "inputs": f"{inputs} (one rank's share, like the model file's example_inputs)",
                "batch_size": plan.batch_size,
                "fsdp": (
                    f"{plan.dp_style_text()}: shard groups of {plan.dp_shard} consecutive DP ranks"
                    + (f", {plan.dp_replicate} replicas of each shard" if plan.dp_replicate > 1 else "")
                    if fsdp
                    else ""
                ),
                "experts": experts_text(plan),
                "experts_one_rank_ep": plan.ep == 1 and plan.expert_tp > 1,
                "loss_scale": (
                    loss_scale_text(plan.loss_scale)
                    if plan.workload == "train" and plan.dtype == "fp16"
                    else ""
                ),
                "serving": (
                    f"The plan serves a prompt of {sv.prompt_len} tokens and {sv.new_tokens} new ones per "
                    f"sequence, with caches of {sv.cache_len} tokens."
                    if phase is not None
                    else ""
                ),
            },
        )
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise failed_write("--emit", out_dir, e) from None
    return publish_folder(tmp, out_dir, "--emit")

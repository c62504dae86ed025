"""How a rank runs the plan's model: in the planned dtype, and for training in train mode with
tensor-parallel-aware dropout RNG.

- dtype: the model's floating parameters and buffers and its floating inputs are cast to the plan's
  dtype (`Plan.dtype`: "fp32" | "bf16" | "fp16"), so the measured run is the planned one; a device
  that cannot run a dtype is refused (`check_dtype_runs`).
- mode: a training plan runs the model in train mode (dropout active, captured into the graph), a
  forward plan in eval mode.
- RNG: `seed_dropout_rng` seeds the default generator alike on the ranks of a TP group (seed + 100 x
  pp_rank, as Megatron-LM does, so stages draw different masks) and the sharded-region stream per TP
  rank (seed + 2718 + 100 x pp_rank + tp_rank; `passes.rng`).
- numerics: a training run's check compares the sharded and unsharded models with dropout off
  (`passes.rng.dropout_disabled`); the timed steps run with dropout on. `dropout_note` says so.
- the plan's schedule and optimizer: `check_plan_runs` refuses, naming the plan field, what the
  runtime would otherwise have to run differently from the plan (the pipeline schedule's
  micro-batch constraints, a distributed optimizer without an optimizer step).
- training at scale: sequence parallelism and activation recomputation are applied by the lowering
  (`passes.lower.lower_for_rank`, from `Plan.sequence_parallel` and `Plan.recompute`);
  `lowering_notes` says in the run report what was applied on the rank.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from passes import collectives, expert_parallel, tp_overlap
from passes.lower import RankLowering
from passes.recompute import recompute_note
from passes.rng import SHARDED_SEED_OFFSET, dropout_nodes, random_nodes, seed_sharded_rng
from planner.errors import InputError
from planner.frontend.capture import user_line
from planner.frontend.phases import cast_module, run_torch_dtype
from planner.plan import DataParallel, Plan, Recompute, Schedule

STAGE_SEED_STRIDE = 100  # Megatron-LM: seed + 100 * pipeline rank


def check_dtype_runs(dtype: str, device: torch.device) -> None:
    """Raise InputError when `device` cannot run the model in `dtype` (bf16 on a CUDA device without
    bf16 support); CPUs run fp32, bf16 and fp16."""
    want = run_torch_dtype(dtype)
    if device.type == "cuda" and want is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise InputError(
            f"the plan's dtype is bf16 but {torch.cuda.get_device_name(device)} does not support bf16; "
            "re-plan with --dtype fp16 or --dtype fp32"
        )


def set_run_mode(model: nn.Module, dtype: str, training: bool) -> nn.Module:
    """`model` with its floating parameters and buffers in `dtype` (`cast_module`), in train or eval
    mode (in place)."""
    return cast_module(model, dtype).train(training)


def seed_dropout_rng(seed: int, pp_rank: int, tp_rank: int, device: torch.device) -> None:
    """Seed this rank's dropout streams: the default generator with seed + 100 x pp_rank (the same on
    every TP rank of a stage: replicated activations get the same mask), the TP sharded-region stream
    with seed + 2718 + 100 x pp_rank + tp_rank (a different mask per shard)."""
    stage_seed = seed + STAGE_SEED_STRIDE * pp_rank
    torch.manual_seed(stage_seed)
    seed_sharded_rng("tp", stage_seed + SHARDED_SEED_OFFSET + tp_rank, device)


def dropout_note(gm: fx.GraphModule) -> str:
    """What a training run says about dropout: how many ops draw a mask in the timed steps (how many
    from the per-rank sharded stream) and that the numerics check ran with dropout off."""
    nodes = dropout_nodes(gm)
    drawn = random_nodes(gm)
    others = (
        f"; {len(drawn)} other random draw(s) ({', '.join(dict.fromkeys(_draw_label(n) for n in drawn))}) "
        "run in the timed steps and at their expectation in the numerics check"
        if drawn
        else ""
    )
    if not nodes:
        return f"train mode: no dropout in the graph{others or '; numerics checked as run'}"
    sharded = sum(1 for n in nodes if n.target.__module__ == "passes.rng")
    return (
        f"train mode: {len(nodes)} dropout op(s) active in the timed steps ({sharded} on tensor-parallel "
        f"shards, drawing from a per-rank RNG stream); numerics checked with dropout off{others}"
    )


def random_draws_note(gm: fx.GraphModule) -> str:
    """What a forward (eval-mode) run says about the model's own random draws (`random_nodes`: noise,
    router jitter): they run in the timed steps and at their expectation in the numerics check, as the
    reference computes them ("" when the graph draws none)."""
    drawn = random_nodes(gm)
    if not drawn:
        return ""
    labels = ", ".join(dict.fromkeys(_draw_label(n) for n in drawn))
    return (
        f"the forward draws random numbers ({len(drawn)} op(s): {labels}): they run in the timed steps and "
        "at their expectation in the numerics check, where the unsharded model computes them so too"
    )


def _draw_label(node: fx.Node) -> str:
    """ "aten.uniform_ at model.py:12" for a random draw of the model."""
    name = getattr(
        getattr(node.target, "overloadpacket", None), "__name__", getattr(node.target, "__name__", "?")
    )
    line = user_line(node)
    return f"aten.{name}" + (f" at {line.split(' ')[0]}" if line else "")


def _blocks_held(lowered: RankLowering, blocks: list[str]) -> list[str]:
    """The MoE blocks (module paths) among `blocks` whose nodes are in this rank's model chunks: with
    pipeline stages a rank holds its stages' blocks only (the EP pass rewrote them all before the split)."""
    chunks = lowered.chunks or [lowered.module]
    paths = {n.meta.get("module_path", "") for chunk in chunks for n in chunk.graph.nodes}
    return [b for b in blocks if any(p == b or p.startswith(f"{b}.") for p in paths)]


def check_plan_runs(plan: Plan, workload: str) -> None:
    """Raise InputError naming the plan field when the runtime cannot run `plan` as planned for
    `workload` ("forward" | "train"): 1F1B with fewer micro-batches than pipeline stages, interleaved
    1F1B with micro-batches that do not divide into its rounds (torch's `ScheduleInterleaved1F1B`
    needs micro_batches % max(1, micro_batches // pp) == 0), a sharded `dp_style` on a workload
    without an optimizer step or with expert parallelism over several data-parallel ranks. zero2 / fsdp with pipeline stages run (`runtime.pipeline_run`: each
    model chunk's units its own); only tied parameters across stages are refused there, on the ranks
    (`RankLowering.tied` is known once the graph is split). Called before the ranks start and on
    every rank."""
    m, pp = plan.micro_batches, plan.pp
    if pp > 1 and plan.schedule == Schedule.ONE_F_ONE_B and m < pp:
        raise InputError(
            f"plan field 'micro_batches': the 1f1b schedule needs at least pp={pp} micro-batches, the plan has "
            f"{m}; re-plan with more micro-batches or --schedule gpipe"
        )
    rounds = max(1, m // pp)
    if pp > 1 and plan.schedule == Schedule.INTERLEAVED_1F1B and m % rounds:
        raise InputError(
            f"plan field 'micro_batches': the interleaved_1f1b schedule (torch.distributed.pipelining "
            f"ScheduleInterleaved1F1B) runs micro-batches in rounds of max(1, m // pp) = {rounds}, which must "
            f"divide m = {m}; re-plan with micro_batches a multiple of pp={pp}"
        )
    if workload == "train" and plan.ep > 1 and plan.mesh.dp_cp > 1 and plan.dp_style is not DataParallel.DDP:
        # each rank's experts are reduced over their own (edp) group, which a sharded state's groups are not
        raise InputError(
            f"plan field 'dp_style' is {plan.dp_style}, but the runtime runs expert parallelism (ep={plan.ep}) with "
            "dp_style ddp only: a sharded state keeps one shard of each parameter per data-parallel rank, which the "
            "experts' own groups do not; set dp_style: ddp (and dp_shard: 1), or re-plan with --run"
        )
    if plan.distributed_optimizer and workload != "train":
        raise InputError(
            f"plan field 'dp_style' is {plan.dp_style} but the run's workload is {workload}: there is no "
            "training state to shard; plan the train workload, or set dp_style: ddp and dp_shard: 1"
        )


def expert_load_notes_of(gm: nn.Module, rank: int) -> list[str]:
    """Under expert parallelism (`gm` lowered by `passes.ep_lower`), the rows each of this rank's experts
    computed in the last forward (`passes.expert_parallel.last_loads`), one line per rank; [] otherwise."""
    loads = expert_parallel.last_loads()
    if not loads or "ep_params" not in getattr(gm, "meta", {}):
        return []
    per_block = "; ".join(f"{block}: {rows}" for block, rows in loads.items())
    return [f"tokens per expert on rank {rank} (token x choice rows its experts computed): {per_block}"]


def lowering_notes(plan: Plan, lowered: RankLowering, training: bool) -> list[str]:
    """The run report's notes on the plan's training-at-scale settings as this rank ran them: sequence
    parallelism (with the collectives the rewritten forward calls) and activation recomputation (which
    layers, how), or why a setting had nothing to do."""
    notes: list[str] = []
    if plan.sequence_parallel:
        nodes = [n for g in lowered.module.modules() if isinstance(g, fx.GraphModule)
                 for n in g.graph.nodes if n.op == "call_function"]  # fmt: skip
        calls = [n.target for n in nodes]
        # row-parallel exits fused with their matmuls (TP overlap): reduce-scattered when their `seq` is set
        rows = [n.args[4] is not None for n in nodes if n.target is tp_overlap.tp_row_matmul]
        scatters = calls.count(collectives.tp_reduce_scatter) + sum(rows)
        if lowered.sequence_parallel and not scatters:
            notes.append(
                "sequence_parallel is set but no row-parallel output on this rank is a (batch, sequence, "
                "features) tensor (flattened tokens, e.g. Conv1D / addmm), so its all-reduces stayed"
            )
        elif lowered.sequence_parallel:
            # fused column-parallel entries that all-gather a sequence shard (their `seq` argument set)
            fused = sum(
                1 for n in nodes if n.target is tp_overlap.tp_column_matmuls and n.args[5] is not None
            )
            kept = (
                f", {fused} of them fused with the block's column-parallel matmuls, which keep the sequence "
                "shard for backward and gather it again there"
                if fused and training
                else ""
            )
            fused_rows = f", {sum(rows)} of them fused with the row-parallel matmuls" if any(rows) else ""
            notes.append(
                f"sequence parallelism applied: norms, dropouts and residual adds between the tensor-parallel "
                f"blocks ran on 1/{plan.tp} of the sequence per rank; this rank's forward calls "
                f"{scatters} reduce-scatter(s){fused_rows}, "
                f"{calls.count(collectives.tp_sequence_gather) + fused} sequence all-gather(s){kept} and "
                f"{calls.count(collectives.tp_all_reduce) + rows.count(False)} all-reduce(s) (backward: the "
                "conjugates)"
            )
        else:
            notes.append("sequence_parallel is set but tp=1: there is no tensor-parallel group to split over")
    cp = lowered.context_parallel
    if cp is not None and cp.cp > 1:
        balance = (
            "two chunks per rank, one early and one late (load-balanced)" if cp.load_balance else "contiguous"
        )
        if not cp.attention:  # every attention core was gathered whole: nothing ran context-parallel
            notes.append(
                f"context parallelism had no attention to split: the {plan.seq_len} tokens were cut over "
                f"{cp.cp} ranks, but no attention op ran as context-parallel attention (each ran on the whole "
                f"sequence on every rank after a gather: {', '.join(cp.fallbacks) or 'see the plan'}), so "
                "--cp bought no memory or time here"
            )
        notes.append(
            f"context parallelism applied: each sequence's {plan.seq_len} tokens split over {cp.cp} ranks "
            f"({plan.seq_len // cp.cp} per rank, {balance}); {len(cp.attention)} attention op(s) ran as "
            f"{cp.variant} context-parallel attention; {len(cp.sliced)} input(s) / table(s) cut to the rank's "
            f"positions; {cp.gathered_outputs} output(s) gathered whole"
            + (f"; gathered for ops without a rule: {', '.join(cp.fallbacks)}" if cp.fallbacks else "")
        )
    ep = lowered.expert_parallel
    held = _blocks_held(lowered, ep.blocks) if ep is not None else []  # on this rank's stage(s)
    if ep is not None and ep.ep == 1 and plan.expert_tp > 1:
        notes.append(
            f"experts split over TP: {len(held)} MoE block(s) with every routed expert's width split over the "
            f"{plan.expert_tp} TP ranks, its outputs summed over TP (no expert parallelism: no token exchange)"
        )
    elif ep is not None and ep.ep > 1:
        notes.append(
            f"expert parallelism applied: {len(held)} MoE block(s) with their experts split over {ep.ep} "
            f"ranks (this rank holds experts {ep.experts[0]}-{ep.experts[-1]}); "
            + (
                "each TP rank ran its experts on every token routed to them (the TP ranks hold the same "
                "tokens), the partial outputs all-reduced over TP"
                if ep.fold == "tp"
                else "tokens dispatched to their experts and combined back by all-to-all, dropless"
            )
            + (
                f"; every expert's width split over the {plan.expert_tp} TP ranks, its outputs all-reduced"
                if plan.expert_tp > 1
                else ""
            )
        )
    asked = any(Recompute(v) is not Recompute.NONE for v in plan.recompute.values())
    if lowered.recomputed:
        notes.append(recompute_note(lowered.recomputed))
    elif asked and not training:
        notes.append("the plan's recompute applies to training; a forward run keeps nothing for backward")
    elif asked:
        notes.append("activation recompute: none of the plan's recomputed layers is on this rank's stage")
    return notes

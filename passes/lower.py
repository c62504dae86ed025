"""Lowering a Plan for one rank: captured graph -> the GraphModule that rank runs.

    lower_for_rank(gm, structure, plan, rank) -> RankLowering

The one sequence every caller uses (`planner optimize --emit`, `--run`, the pipeline runtime):

1. tensor parallelism for the rank's TP coordinate (`passes.tensor_parallel.apply_tensor_parallel`,
   the plan's `splits`, degree `plan.tp`), with sequence parallelism when `plan.sequence_parallel`
   (the stream between TP blocks sharded along the sequence; reduce-scatter / all-gather instead of
   all-reduce);
2. context parallelism when `plan.cp` > 1 (`passes.cp_lower.apply_context_parallel`): the token
   inputs cut to this rank's tokens of each sequence, attention replaced by the plan's
   `cp_comm_type` kernel, sharded outputs gathered whole; then expert parallelism when `plan.ep` > 1
   (`passes.ep_lower.apply_expert_parallel`): each MoE block's experts split over the EP ranks, tokens
   dispatched and combined by all-to-all;
3. ladder residual on the plan's `ladder_layers` (`passes.ladder.apply_ladder`), then, with
   `plan.tp_comm_overlap`, each TP block's collectives cut into chunks that overlap its GEMMs
   (`passes.tp_overlap.apply_tp_overlap`); training under sequence parallelism without it, each
   column-parallel entry made one function that keeps the sequence shard for backward and gathers it
   again there (`passes.tp_overlap.apply_sequence_regather`);
4. pipeline split at the last layer of each stage (`passes.pipeline.split_stages`), keeping the
   rank's stage (pp > 1 only). With the interleaved schedule (`plan.virtual_stages` = v > 1) the graph
   is split into pp * v virtual stages (`Plan.virtual_stage_layers`) and the rank keeps its v chunks,
   chunk c being virtual stage c * pp + pp_rank;
5. training only: activation recomputation of the rank's layers (every chunk) as `plan.recompute` says
   (`passes.recompute.apply_recompute`: selective = attention core, full = whole layer, each region
   run under `torch.utils.checkpoint`).

The rank's coordinates are `plan.mesh.coords(rank)`; the DP replicas of a (pp_rank, tp_rank) lower
to the same module. No process group is needed to lower: the collectives the TP pass inserts look
up their group when the module runs (`passes.collectives.register_group`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from passes.cp_lower import CP_OUTPUT_SHARD, CpLowering, apply_context_parallel
from passes.ep_lower import EpLowering, apply_expert_parallel
from passes.ladder import apply_ladder, ladder_residual_adds
from passes.pipeline import split_stages, stage_of_layers, tied_parameters
from passes.recompute import RecomputedRegion, apply_recompute, mark_attention_cores, recompute_of_layers
from passes.tensor_parallel import OUTPUT_SHARD, apply_tensor_parallel
from passes.tp_overlap import apply_sequence_regather, apply_tp_overlap
from planner.errors import InputError
from planner.frontend.analysis import ModelStructure, Role
from planner.plan import Plan, check_cp_sequence


@dataclass
class RankLowering:
    """What one rank runs for a plan."""

    module: fx.GraphModule  # the rewritten graph (pp == 1), or this rank's pipeline stage (its first chunk)
    rank: int  # global rank the module was lowered for
    dp_rank: int
    pp_rank: int  # stage index; the module's inputs and outputs follow passes.pipeline's interface
    tp_rank: int
    num_stages: int  # plan.pp
    # parameters held by two stages, (stage_a, fqn_a, stage_b, fqn_b): their gradients are summed
    # after each backward (runtime.pipeline.all_reduce_tied_gradients); the same list on every rank.
    # With virtual stages the stage numbers are virtual stage indices (held by rank index % pp).
    tied: list[tuple[int, str, int, str]] = field(default_factory=list)
    # this rank's model chunks, chunk c = virtual stage c * num_stages + pp_rank (plan.virtual_stages
    # of them; [module] without the interleaved schedule)
    chunks: list[fx.GraphModule] = field(default_factory=list)
    sequence_parallel: bool = False  # the TP pass kept the stream sharded along the sequence
    recomputed: list[RecomputedRegion] = field(default_factory=list)  # training: regions re-run in backward
    context_parallel: CpLowering | None = None  # what the CP pass did (plan.cp > 1)
    expert_parallel: EpLowering | None = None  # what the EP pass did (plan.ep > 1)


def stream_output_weights(structure: ModelStructure) -> frozenset[str]:
    """Weight FQNs of the projections whose output joins the residual stream: each attention block's
    o and each MLP's last projection (down, or the last of a chain), as the cost tables'
    `block_outputs` (`planner.solver.costing.LayerGraph`) read them."""
    found = set()
    for layer in structure.layers:
        for attn in (layer.attention, layer.cross_attention):
            if attn is not None:
                found.update(p.weight for p in attn.projections if p.role is Role.O)
        if layer.mlp is not None and layer.mlp.projections:
            down = [p for p in layer.mlp.projections if p.role is Role.DOWN]
            found.add((down or layer.mlp.projections)[-1].weight)
    return frozenset(found)


def lower_for_rank(
    gm: fx.GraphModule, structure: ModelStructure, plan: Plan, rank: int, *, training: bool = False
) -> RankLowering:
    """Lower `plan` for global `rank`: TP pass, ladder pass, pipeline split (module docstring).

    gm: captured graph (`planner.frontend.capture.capture`) at the shapes one rank computes: this DP
    replica's batch, divided by `plan.micro_batches` when pp > 1 (captured shapes are literals). It
    is rewritten in place and its parameters are shared with the result: pass a copy to keep it.
    structure: `planner.frontend.analysis.analyse(gm)` before any rewrite. training: the TP pass
    inserts the collectives backward needs.

    Raises InputError when the plan ladders layers with pp > 1 (a pending all-reduce would cross a
    stage boundary), for a plan that cannot run as it says (`check_runnable`) and ValueError when
    `rank` is outside the plan's mesh; the passes' own errors (TensorParallelError, LadderError,
    PipelineSplitError, all ValueError) name the node at fault.
    """
    if plan.ladder_layers and plan.pp > 1:
        raise InputError(
            "ladder residual with pipeline stages is not supported: a pending all-reduce would cross a "
            "stage boundary; plan with --pp 1 or --ladder none"
        )
    check_runnable(plan, structure, training)
    dp_rank, pp_rank, tp_rank = plan.mesh.coords(rank)
    sequence_parallel = plan.sequence_parallel and plan.tp > 1
    if training:
        mark_attention_cores(gm, structure)  # before the passes: meta travels with the nodes
    apply_tensor_parallel(
        gm,
        plan.splits,
        tp_rank,
        plan.tp,
        training=training,
        sequence_parallel=sequence_parallel,
        stream_outputs=stream_output_weights(structure),
        shard_output=training,  # the loss runs on the LM head's vocabulary shards (`runtime.loss`)
    )
    cp_lowering = None
    if plan.cp > 1:
        cp_lowering = apply_context_parallel(
            gm, plan.cp, plan.seq_len, plan.cp_comm_type, plan.cp_load_balance, training=training,
            shard_output=training,
        )  # fmt: skip
    ep_lowering = None
    if plan.ep > 1 and plan.ep_fold == "tp":
        ep_lowering = apply_expert_parallel(gm, structure, plan.ep, tp_rank, fold="tp")
    elif plan.ep > 1 or plan.expert_tp > 1:
        ep_rank = (dp_rank * plan.cp + plan.mesh.cp_rank(rank)) % plan.ep
        ep_lowering = apply_expert_parallel(
            gm, structure, plan.ep, ep_rank, expert_tp=plan.expert_tp, tp_rank=tp_rank,
            cp_load_balance=plan.cp_load_balance,
        )  # fmt: skip
    apply_ladder(gm, ladder_residual_adds(structure, plan.ladder_layers))
    layer_nodes = {name for layer in structure.layers for name in layer.nodes}
    if plan.tp_comm_overlap and plan.tp > 1:
        apply_tp_overlap(gm, plan.tp, layer_nodes)
    elif training and plan.sequence_parallel and plan.tp > 1:
        apply_sequence_regather(gm, layer_nodes)
    chunks, tied = [gm], []
    if plan.pp > 1:
        outputs = [layer.output_node for layer in structure.layers]
        layers = plan.virtual_stage_layers()  # pp * v virtual stages, in model order
        stages = split_stages(gm, stage_of_layers(len(structure.layers), layers, outputs))
        chunks = stages[pp_rank :: plan.pp]  # virtual stages pp_rank, pp_rank + pp, ...
        tied = tied_parameters(stages)
        for chunk in chunks:  # expert parallelism's records, for the parameters each chunk holds
            names = {n for n, _ in chunk.named_parameters()}
            for key in ("ep_shards", "ep_params"):
                if key in gm.meta:
                    kept = [n for n in gm.meta[key] if n in names]
                    chunk.meta[key] = {n: gm.meta[key][n] for n in kept} if key == "ep_shards" else kept
        for key in (OUTPUT_SHARD, CP_OUTPUT_SHARD):  # to the stage computing the model's outputs
            if key in gm.meta and stages[-1] in chunks:
                stages[-1].meta[key] = gm.meta[key]
    recomputed = (
        [r for chunk in chunks for r in apply_recompute(chunk, structure, plan.recompute)] if training else []
    )
    return RankLowering(
        chunks[0], rank, dp_rank, pp_rank, tp_rank, plan.pp, tied, chunks,
        sequence_parallel=sequence_parallel, recomputed=recomputed, context_parallel=cp_lowering,
        expert_parallel=ep_lowering,
    )  # fmt: skip


def check_runnable(plan: Plan, structure: ModelStructure, training: bool) -> None:
    """Raise InputError, naming the plan field, for training-at-scale settings the passes cannot run
    as the plan says: sequence parallelism over a layer sequence that does not divide by tp (a decode
    step has one token; `ModelStructure.stream_tokens`) or together with ladder residual (which
    overlaps the all-reduces that sequence parallelism replaces); recompute keys that name no layer class of the model, or recomputation
    of a plain MLP chain (`passes.recompute.recompute_of_layers`). Recompute in a forward-only run
    is not an error: there is no backward to recompute for (the run's note says so)."""
    if plan.cp > 1 and plan.workload != "decode":
        check_cp_sequence(
            plan.seq_len, plan.cp, plan.cp_load_balance, plan.cp_comm_type, "the plan's mesh.cp"
        )
    if plan.sequence_parallel and plan.tp > 1:
        uneven = [t // plan.cp for t in structure.stream_tokens() if (t // plan.cp) % plan.tp or t % plan.cp]
        if uneven:
            raise InputError(
                f"the plan's field 'sequence_parallel' is true but the layers' sequence of {uneven[0]} "
                f"token(s) does not divide by tp={plan.tp}: each rank would hold an unequal part; use a "
                f"sequence length that makes it a multiple of {plan.tp}, or set sequence_parallel: false"
            )
        if plan.ladder_layers:
            raise InputError(
                "the plan's fields 'sequence_parallel' and 'ladder_layers' cannot both be set: ladder "
                "residual overlaps the all-reduces that sequence parallelism replaces by reduce-scatters; "
                "set sequence_parallel: false or ladder_layers: []"
            )
    if plan.tp_comm_overlap and plan.ladder_layers:
        raise InputError(
            "the plan's fields 'tp_comm_overlap' and 'ladder_layers' cannot both be set: ladder residual "
            "already overlaps its blocks' all-reduces; set tp_comm_overlap: false or ladder_layers: []"
        )
    if (plan.ep > 1 or plan.expert_tp > 1) and not any(layer.moe is not None for layer in structure.layers):
        field, value = ("ep", plan.ep) if plan.ep > 1 else ("expert_tp", plan.expert_tp)
        raise InputError(
            f"the plan's field '{field}' is {value}, but the model has no mixture-of-experts layer: there are no "
            f"experts to split; set {field}: 1"
        )
    if plan.sequence_parallel and plan.tp > 1 and plan.ep > 1 and plan.ep_fold == "tp":
        raise InputError(
            "the plan's fields 'ep_fold' (tp) and 'sequence_parallel' cannot both be set: EP over the TP ranks "
            "splits the experts between ranks that must route the same tokens, which sequence parallelism cuts; "
            "set sequence_parallel: false or ep_fold: dp"
        )
    recompute_of_layers(structure, plan.recompute)  # raises for keys that name no layer class

"""Lowering a Plan for one rank: captured graph -> the GraphModule that rank runs.

    lower_for_rank(gm, structure, plan, rank) -> RankLowering

The one sequence every caller uses (`planner optimize --emit`, `--run`, the pipeline runtime):

1. tensor parallelism for the rank's TP coordinate (`passes.tensor_parallel.apply_tensor_parallel`,
   the plan's `splits`, degree `plan.tp`);
2. ladder residual on the plan's `ladder_layers` (`passes.ladder.apply_ladder`);
3. pipeline split at the last layer of each stage (`passes.pipeline.split_stages`), keeping the
   rank's stage (pp > 1 only). With the interleaved schedule (`plan.virtual_stages` = v > 1) the graph
   is split into pp * v virtual stages (`Plan.virtual_stage_layers`) and the rank keeps its v chunks,
   chunk c being virtual stage c * pp + pp_rank.

The rank's coordinates are `plan.mesh.coords(rank)`; the DP replicas of a (pp_rank, tp_rank) lower
to the same module. No process group is needed to lower: the collectives the TP pass inserts look
up their group when the module runs (`passes.collectives.register_group`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from passes.ladder import apply_ladder, ladder_residual_adds
from passes.pipeline import split_stages, stage_of_layers, tied_parameters
from passes.tensor_parallel import apply_tensor_parallel
from planner.errors import InputError
from planner.frontend.analysis import ModelStructure
from planner.plan import Plan


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
    stage boundary) and ValueError when `rank` is outside the plan's mesh; the passes' own errors
    (TensorParallelError, LadderError, PipelineSplitError, all ValueError) name the node at fault.
    """
    if plan.ladder_layers and plan.pp > 1:
        raise InputError(
            "ladder residual with pipeline stages is not supported: a pending all-reduce would cross a "
            "stage boundary; plan with --pp 1 or --ladder none"
        )
    dp_rank, pp_rank, tp_rank = plan.mesh.coords(rank)
    apply_tensor_parallel(gm, plan.splits, tp_rank, plan.tp, training=training)
    apply_ladder(gm, ladder_residual_adds(structure, plan.ladder_layers))
    chunks, tied = [gm], []
    if plan.pp > 1:
        outputs = [layer.output_node for layer in structure.layers]
        layers = plan.virtual_stage_layers()  # pp * v virtual stages, in model order
        stages = split_stages(gm, stage_of_layers(len(structure.layers), layers, outputs))
        chunks = stages[pp_rank :: plan.pp]  # virtual stages pp_rank, pp_rank + pp, ...
        tied = tied_parameters(stages)
    return RankLowering(chunks[0], rank, dp_rank, pp_rank, tp_rank, plan.pp, tied, chunks)

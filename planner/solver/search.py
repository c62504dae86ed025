"""The planner's entry point: enumerate mesh shapes around the inner ILP and return the best `Plan`.

    plan_model(structure, cluster, workload, constraints) -> Plan

For every candidate mesh (tp, pp, dp, micro-batches, pipeline schedule with its model chunks v,
sequence parallelism on or off, distributed optimizer: a `MeshConfig`) allowed by the constraints, `planner.solver.costing` prices every op option and
`planner.solver.ilp` solves one ILP (strategies, stages, ladder, memory). Candidates are visited in
order of a cheap lower bound (perfectly sharded compute) and skipped once the bound exceeds the best
plan found, so the search stays fast on 1,000-device clusters. The hand-written Megatron plan
(`planner.solver.baseline`) is costed with the same model and stored in the plan; if it were ever
better than the search result (time limit hit), it is returned instead. The plan records the schedule
it was priced with (`Plan.schedule`, `Plan.virtual_stages`), which the runtime runs.

Training at scale: the interleaved schedule (v = 2..`MAX_VIRTUAL_STAGES` chunks per rank, micro-batches a
multiple of pp) and sequence parallelism (tp > 1) are candidates of their own; the ILP chooses the
activation recomputation per layer class; the distributed optimizer (dp > 1) is priced on the solved
plan both ways (`_price_optimizer`). A plan uses one of these only if it is predicted faster by more
than `FEATURE_MIN_SAVING` per feature than without (or needs it to fit): each changes what the runtime
must do.

Context parallelism: the context-parallel degree is a mesh axis of its own (`_cp_options`: pinned by
--cp, else powers of two for sequences of `MIN_CP_SEQ_LEN` tokens or more, 2 from `MIN_CP2_SEQ_LEN`); each candidate is solved
with the attention variant whose cores cost least (`_cp_variant`) and priced with every other variant
and load balancing the constraints allow on its solution (`_price_cp_variants`); cp > 1 counts as a
feature.

Expert parallelism (mixture-of-experts models): every mesh is priced with the experts off, with each
EP degree dividing dp x cp and the experts folded over those ranks, and with EP over its TP ranks
(`_ep_options`; pinned by --ep / --ep-fold, refused in one line where it cannot run:
`_check_pinned_ep`); each is a candidate of its own, ep > 1 a feature. At tp > 1, without EP and with
EP over dp x cp, a candidate is solved with every routed expert split over the TP ranks
(`MeshConfig.expert_tp` = tp, Megatron-Core's default; `_ep_options_with_expert_tp`) and priced with
them whole on that solution (`_price_expert_tp`); the split is a feature of its own. --expert-tp pins
it (N > 1 keeps only candidates at tp = N without EP or with EP over dp). The MoE layers' fixed times
and the experts' memory are what change (`costing`); the blocks' option tables do not, so their
bounds are shared (`_least_layer_time_s`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass, field

from costmodels.cluster import ClusterSpec, cluster_for_ranks
from costmodels.context_parallel import ulysses_refusal
from planner.errors import InfeasibleError, InputError
from planner.frontend.analysis import Layer, ModelStructure, Role
from planner.frontend.moe import agreed
from planner.frontend.roles import Projection
from planner.plan import (
    DataParallel,
    Decision,
    MeshCandidate,
    MeshShape,
    Plan,
    Prediction,
    Recompute,
    Schedule,
    SolverInfo,
    SplitStyle,
    WeightSplit,
    Workload,
    check_cp_sequence,
    cp_text,
    dp_style_text,
    layer_ranges,
    overlap_text,
)
from planner.progress import Progress, silent
from planner.solver.baseline import (
    MEGATRON_CP_DEGREES,
    baseline_plan,
    ep_within,
    megatron_assignment,
    megatron_choices,
    megatron_configs,
    megatron_cp_configs,
    megatron_cp_degree,
    megatron_micro_batch_variants,
    torchtitan_configs,
)
from planner.solver.costing import (
    CostContext,
    CostTables,
    LayerGraph,
    OpOption,
    build_cost_tables,
    cp_attentions,
    cp_core_cost,
    cp_core_shard,
    expert_counts,
    experts_lowerable,
    experts_not_swiglu,
    fsdp_transient_bytes,
    gqa_kv_replicated,
    graph_expert_activation_bytes,
    interleaved_chunks,
    layer_keys,
    layer_projection_ops,
    mlp_op_names,
    p2p_stage_time_s,
    recompute_input_bytes,
    step_time_s,
    ulysses_kv_heads,
)
from planner.solver.explain import (
    block_table,
    cp_decisions,
    ep_decisions,
    ladder_decision,
    memory_fit_text,
    mesh_decision,
    op_exclusions,
    overlap_decisions,
    strategy_decisions,
    training_decisions,
)
from planner.solver.ilp import IlpProblem, IlpSolution, solve
from planner.solver.prediction import PricedAssignment, predict
from planner.solver.problem import (
    FEATURE_MIN_SAVING,
    Assignment,
    Constraints,
    LadderMode,
    LadderPolicy,
    MeshConfig,
    WorkloadSpec,
    dp_style_variants,
    ep_refusal,
    overlap_variants,
)

__all__ = ["Constraints", "WorkloadSpec", "plan_model"]

_GIB = 2.0**30
TIE_TOLERANCE = 1e-6  # relative: plans this close in latency are ties, broken by fewer devices
MAX_VIRTUAL_STAGES = 8  # interleaved 1F1B: model chunks per pipeline rank considered
# context parallelism the search considers (a pinned --cp is taken as it is): for sequences of at least
# MIN_CP_SEQ_LEN tokens (longer than the pre-training contexts of today's models: Llama 3 pre-trained at
# 8k tokens with CP 1 and used CP 16 for its 131k-token stage, Dubey et al. 2024 Table 4; below it every
# CP degree multiplies the mesh candidates, and the plan time, for sequences data parallelism splits as
# well), powers of two up to MAX_CP, each rank keeping at least MIN_CP_TOKENS_PER_RANK tokens of a
# sequence (below that the GEMMs of the rank's rows lose efficiency and the K/V traffic grows against
# the attention it overlaps); from MIN_CP2_SEQ_LEN tokens CP 2 alone (NeMo's Llama-3-8B recipe trains its
# 8,192-token sequences at CP 2; the 405B at 8,192 tokens on 16,384 H100s plans 5.40 s at CP 2 against
# 7.15 s without, where CP 2 was left to the hand-written plan's fallback)
MIN_CP_SEQ_LEN = 16384
MIN_CP2_SEQ_LEN = 8192
MAX_CP = 32
MIN_CP_TOKENS_PER_RANK = 2048


@dataclass
class _Candidate:
    """One mesh candidate, priced, with lower bounds; solved or not."""

    tables: CostTables
    lower_bound_s: float
    memory_lower_bound_bytes: float
    solution: IlpSolution | None = None
    note: str = ""
    latency_s: float | None = None
    # the tables' static bytes still to be multiplied by these, dense and routed experts' (`_materialize`)
    static_ratio: tuple[float, float] = (1.0, 1.0)

    @property
    def config(self) -> MeshConfig:
        return self.tables.ctx.config

    @property
    def mesh(self) -> MeshShape:
        return self.tables.ctx.mesh


@dataclass
class _Search:
    structure: ModelStructure
    cluster: ClusterSpec
    workload: WorkloadSpec
    constraints: Constraints
    dtype: str
    layer_keys: list[str]
    ladder: LadderPolicy  # resolved for the model's layers
    cap_bytes: float
    excluded: list[str] = field(default_factory=list)
    candidates: list[_Candidate] = field(default_factory=list)
    solver_time_s: float = 0.0
    # priced graphs (their summed cheapest compute, the (dense, experts') state factors they were
    # priced at, their least memory) by what they depend on (`_tables_key`): the candidates that
    # differ only in pp, schedule or v share them
    priced: dict[tuple, tuple[dict, LayerGraph, float, tuple[float, float], tuple[float, float, float]]] = (
        field(default_factory=dict)
    )
    rescaled: dict[tuple, tuple[dict, LayerGraph]] = field(default_factory=dict)
    # a layer class's least block time (`_least_layer_time_s`) by the tables' key without EP and the class
    block_bounds: dict[tuple, float] = field(default_factory=dict)


def plan_model(
    structure: ModelStructure,
    cluster: ClusterSpec,
    workload: WorkloadSpec,
    constraints: Constraints,
    *,
    model_name: str = "model",
    progress: Progress = silent,
) -> Plan:
    """Find the fastest plan (latency of one step) for `structure` on `cluster`. `progress` is told
    which mesh candidate is priced, then solved (`planner.progress`).

    Raises:
        InputError: constraints that contradict the model or cluster (pinned degrees, ladder spec).
        InfeasibleError: no mesh fits memory; the message names the binding constraint and what would fit.
    """
    search = _setup(structure, cluster, workload, constraints)
    _enumerate(search, progress)
    best = _solve_candidates(search, progress)
    return _make_plan(search, best, model_name)


def price(
    structure: ModelStructure,
    cluster: ClusterSpec,
    workload: WorkloadSpec,
    config: MeshConfig,
) -> CostTables:
    """Every op option of `structure` priced on one mesh candidate, in the workload's (or the model's)
    dtype: what `plan_model` hands the ILP for that candidate. Raises InputError for a model with
    nothing to plan."""
    cluster = cluster_for_ranks(cluster, config.mesh.num_devices)
    ctx = CostContext(structure, cluster, workload, config, workload.dtype or structure.dtype)
    return build_cost_tables(ctx)


# ---------------------------------------------------------------------------------------------
# Set-up and enumeration


def _setup(
    structure: ModelStructure, cluster: ClusterSpec, workload: WorkloadSpec, constraints: Constraints
) -> _Search:
    dtype = workload.dtype or structure.dtype
    if workload.train and structure.num_params and structure.num_frozen_params >= structure.num_params:
        raise InputError(
            "workload train: every parameter of the model has requires_grad=False, so a training step "
            "has nothing to update; make the weights to train require gradients (p.requires_grad_(True) "
            "in build_model), or plan --workload forward"
        )
    keys = layer_keys(structure)
    num_layers = len(structure.layers)
    ladder = constraints.ladder.for_layers(num_layers)
    excluded: list[str] = []
    if ladder.mode is not LadderMode.NONE:
        missing = [i for i in ladder.eligible(num_layers) if not _has_both_blocks(structure.layers[i])]
        why = _unladderable_text(structure, missing) if missing else ""
        if missing and ladder.mode is LadderMode.AUTO:
            # the solver's choice among the upper layers: only the run of them above the last it cannot
            # rewrite (none in a model whose every layer has experts): planned with that, and said why
            upper = num_layers - 1 - max(missing)
            ladder = (
                LadderPolicy(LadderMode.AUTO, upper, ladder.max_loss_increase) if upper else LadderPolicy()
            )
            excluded.append(f"ladder residual: layers {why}")
        elif missing:
            raise InputError(f"ladder {str(constraints.ladder)!r}: layers {why}; use --ladder auto or none")
    if constraints.sequence_parallel and workload.train and 1 in (constraints.tp, constraints.max_devices):
        why = "--tp 1" if constraints.tp == 1 else "one device"
        raise InputError(
            f"--sequence-parallel on splits each layer's sequence over the TP ranks, and {why} leaves one: "
            "give --tp 2 or more (and the devices for it), or --sequence-parallel auto / off"
        )
    cap = cluster.device.memory_bytes * constraints.memory_fraction
    search = _Search(structure, cluster, workload, constraints, dtype, keys, ladder, cap)
    search.excluded += excluded
    return search


def _unladderable_text(structure: ModelStructure, layers: list[int]) -> str:
    """Why ladder residual cannot rewrite `layers` (`_has_both_blocks`), by kind."""
    moe = [i for i in layers if structure.layers[i].moe is not None]
    other = [i for i in layers if i not in moe]
    parts = [f"{moe} have a mixture-of-experts block"] if moe else []
    if other:
        parts.append(f"{other} lack an attention or dense MLP block, or have a cross-attention")
    return (
        "; ".join(parts)
        + ", which the ladder pass does not rewrite (it moves a layer's attention and dense MLP "
        "outputs one block later)"
    )


def _has_both_blocks(layer: Layer) -> bool:
    """An attention and an MLP block, and no cross-attention between them (the ladder pass rewrites
    a layer's two residual adds)."""
    return layer.attention is not None and layer.mlp is not None and layer.cross_attention is None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _no_experts(structure: ModelStructure) -> str:
    """Why a model has no experts to split: a layer whose router the planner saw but whose experts it
    did not recognise (`Layer.experts_unrecognised`, its warning's text), or none at all."""
    why = next((layer.experts_unrecognised for layer in structure.layers if layer.experts_unrecognised), "")
    return why or "the model has no mixture-of-experts layer to split"


def _tp_options(search: _Search, num_devices: int) -> list[int]:
    c, cluster = search.constraints, search.cluster
    heads = search.structure.query_head_counts()
    out = []
    for tp in _divisors(num_devices) if c.tp is None else [c.tp]:
        if c.tp is None and tp > cluster.devices_per_node and not c.tp_across_nodes:
            search.excluded.append(
                f"tp={tp}: spans {math.ceil(tp / cluster.devices_per_node)} nodes "
                f"(the search keeps TP inside a node of {cluster.devices_per_node}; --tp {tp} pins it across nodes)"
            )
            continue
        if (
            c.tp is None
            and 1 < tp < cluster.devices_per_node
            and cluster.devices_per_node % tp
            and num_devices > (cluster.devices_per_node)
        ):
            search.excluded.append(
                f"tp={tp}: does not divide a node of {cluster.devices_per_node}, so TP groups would straddle two "
                "nodes (pin --tp to price it so)"
            )
            continue
        bad = [h for h in heads if h % tp]
        if bad and c.tp is None:
            search.excluded.append(f"tp={tp}: {bad[0]} heads not divisible by {tp}")
            continue
        if bad:
            search.excluded.append(
                f"tp={tp} (pinned): {bad[0]} heads not divisible by {tp}; attention stays replicated"
            )
        bad_kv = search.structure.kv_heads_unsplit_by(tp)
        if bad_kv and c.tp is None:
            # as a pinned --tp is refused (`planner.cli.workflow.check_pinned_tp`): the K/V projections
            # and the attention reshapes cannot split into whole KV heads, nor replicate them evenly
            search.excluded.append(
                f"tp={tp}: {bad_kv[0]} KV heads (GQA) neither divisible by {tp} nor dividing it"
            )
            continue
        if bad_kv and not bad and tp > 1:
            search.excluded.append(
                f"tp={tp}: head-parallel attention excluded: {bad_kv[0]} KV heads (GQA) not divisible by {tp}"
            )
        out.append(tp)
    return out


# Ops that normalise with the statistics of the batch they see when training (BatchNorm): a data-parallel
# replica or a micro-batch sees part of the batch, so only dp = 1 with one micro-batch computes what the
# unsharded model computes (SyncBatchNorm is not supported)
BATCH_STATISTICS_OPS = frozenset({"aten.batch_norm", "aten._native_batch_norm_legit_functional",
                                  "aten._native_batch_norm_legit", "aten.native_batch_norm"})  # fmt: skip


def _batch_statistics(search: _Search) -> bool:
    """Whether training this model normalises over the batch (`BATCH_STATISTICS_OPS`)."""
    return search.workload.train and any(
        c.op in BATCH_STATISTICS_OPS for c in search.structure.node_costs.values()
    )


def _micro_batch_options(search: _Search, pp: int, dp: int) -> list[int]:
    """Micro-batch counts of a (pp, dp) candidate: the pinned one, else for each of pp, 2 pp, 4 pp and
    the replica's whole batch (without a pipeline, training: 1, 2, 4 and the whole batch) the largest
    divisor of the replica's batch not above it. Fewer micro-batches per stage mean a larger bubble
    and more activations in flight; more, smaller GEMMs and less of the gradient reduction hidden (it
    overlaps the last micro-batch's backward): the middle counts are where a plan that does not fit at
    pp micro-batches without recomputation fits without it (a 70B GPT at TP 8 PP 2 with fp32
    gradients: 4 micro-batches, not 2 with full recomputation or 8)."""
    w = search.workload
    per_replica = w.batch_size // dp
    if w.micro_batches is not None:
        return [w.micro_batches] if per_replica % w.micro_batches == 0 else []
    divisors = _divisors(per_replica)
    if pp == 1 and not w.train:
        return [1]
    limits = (pp, 2 * pp, 4 * pp, per_replica) if pp > 1 else (1, 2, 4, per_replica)
    return sorted({max(d for d in divisors if d <= lim) for lim in limits})


def _enumerate(search: _Search, progress: Progress = silent) -> None:
    """Every allowed (tp, pp, dp, m), priced, with lower bounds of time and memory."""
    c, w, cluster = search.constraints, search.workload, search.cluster
    num_devices = min(c.max_devices or cluster.num_devices, cluster.num_devices)
    if c.max_devices is not None and c.max_devices > cluster.num_devices:
        raise InputError(
            f"--devices {c.max_devices} exceeds {cluster.name}'s {cluster.num_devices} devices "
            f"({cluster.num_nodes} node(s) of {cluster.devices_per_node}); give at most {cluster.num_devices}"
        )
    num_layers = len(search.structure.layers) or 1
    tps = _tp_options(search, num_devices)
    cps = _cp_options(search, num_devices)
    _check_pinned_ep(search)
    pps = [c.pp] if c.pp is not None else [p for p in _divisors(num_devices) if p <= num_layers]
    if c.pp is not None and c.pp > num_layers:
        raise InputError(f"pp={c.pp} exceeds the model's {num_layers} layers")
    if not search.structure.layers and c.pp not in (None, 1):
        raise InputError("pp > 1 needs transformer layers; this model is a plain chain of linears")
    if not search.structure.layers:
        pps = [1]
    dps = [c.dp] if c.dp is not None else [d for d in _divisors(num_devices) if w.batch_size % d == 0]
    # (error if pinned, exclusion) of what keeps the batch whole: one replica and one micro-batch only
    whole_batch: list[tuple[str, str]] = []
    if _batch_statistics(search):
        whole_batch.append((
            "the model trains with BatchNorm, which normalises over the batch it sees: data-parallel "
            "replicas and micro-batches each see part of the batch and would compute other outputs than "
            "the unsharded model (SyncBatchNorm is not supported); use --dp 1 and one micro-batch, or "
            "a normalisation without batch statistics (LayerNorm, GroupNorm)",
            "dp>1, micro-batches>1: BatchNorm normalises over the batch it sees (training)",
        ))  # fmt: skip
    if search.structure.batch_mixing:  # samples mix, or the batch is not dim 0
        why = search.structure.batch_mixing[0]
        whole_batch.append((
            f"the batch of this model cannot be split: {why}; split over data-parallel replicas or "
            "micro-batches, it would compute other outputs than the unsharded model; use --dp 1 and one "
            "micro-batch",
            f"dp>1, micro-batches>1: the batch cannot be split: {why}",
        ))  # fmt: skip
    if whole_batch:
        if (c.dp or 1) > 1 or (w.micro_batches or 1) > 1:
            raise InputError(whole_batch[0][0])
        dps = [1]
        search.excluded += [exclusion for _, exclusion in whole_batch]
    if c.dp is not None and w.batch_size % c.dp:
        raise InputError(f"dp={c.dp} does not divide the batch size {w.batch_size}")
    whole = search.structure.whole_weights
    if whole and any(t > 1 for t in tps):
        names = sorted(whole)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        search.excluded.append(f"tp>1: {shown}: {next(iter(whole.values()))}")
    styles = c.dp_styles()
    if (
        w.train
        and search.structure.tied_lm_head
        and (c.pp or 1) > 1
        and all(s.shards_gradients for s in styles)
    ):
        raise InputError(
            f"--dp-style {styles[0]} with --pp {c.pp}: the model ties its embedding to its LM head, whose "
            "sharded gradients on the first and last stage cannot be summed between the stages; use "
            "--dp-style zero1 or ddp, or --pp 1"
        )
    if c.dp_shard is not None:
        if not w.train:
            raise InputError(
                f"--dp-shard {c.dp_shard} shards the training state, but the workload is {w.kind}: leave it out "
                "or plan --workload train"
            )
        fits = [dp for dp in dps if dp % c.dp_shard == 0]
        if not fits:
            raise InputError(
                f"--dp-shard {c.dp_shard} divides none of the data-parallel degrees this cluster and batch allow "
                f"({', '.join(map(str, dps))}); use one of their divisors, e.g. --dp-shard {max(dps)}"
            )
        search.excluded += [
            f"dp={dp}: --dp-shard {c.dp_shard} does not divide it" for dp in dps if dp not in fits
        ]
        dps = fits
    for tp, cp in ((tp, cp) for tp in tps for cp in cps):
        for pp in pps:
            for dp in dps:
                if tp * cp * pp * dp > num_devices:
                    continue
                mesh = MeshShape(tp, pp, dp, cp)
                for m in [1] if whole_batch else _micro_batch_options(search, pp, dp):
                    variant = _cp_variant(search, mesh, m)
                    if variant is None:
                        continue
                    for schedule, v in _schedules_for(search, pp, m):
                        for sp in _sequence_parallel_options(search, tp, cp):
                            for ep, fold, etp in _ep_options_with_expert_tp(search, mesh, sp):
                                for style in _solved_styles(search, mesh, ep):
                                    config = MeshConfig(
                                        mesh, m, schedule, v, sp, style, c.dp_shard,
                                        c.reshard_after_forward is not False,
                                        c.tp_comm_overlap is True, c.overlap_grad_reduce is True,
                                        c.overlap_param_gather is True, *variant, ep, fold, etp,
                                    )  # fmt: skip
                                    progress(
                                        f"pricing mesh candidate {len(search.candidates) + 1}: {config.label()}",
                                        None,
                                    )
                                    search.candidates.append(_price(search, config, lazy=True))
    if (c.schedule is Schedule.INTERLEAVED_1F1B or (c.virtual_stages or 1) > 1) and w.train:
        _exclude_short_interleaving(search, [pp for pp in pps if pp > 1], dps, [1] if whole_batch else None)
    if not search.candidates and (c.ep or 1) > 1:
        raise InputError(_ep_unplaceable(search, num_devices))
    if not search.candidates and (c.expert_tp or 1) > 1:
        if not experts_lowerable(search.structure):
            why = experts_not_swiglu(search.structure) or (
                search.structure.token_capacity[0]
                if search.structure.token_capacity
                else _no_experts(search.structure)
            )
            raise InputError(
                f"--expert-tp {c.expert_tp}: the expert pass cannot split this model's experts ({why}); use --expert-tp 1"
            )
        fix = (
            f"it needs at least {c.expert_tp} devices; use --expert-tp 1"
            if num_devices < c.expert_tp
            else f"use --expert-tp 1, or pin --tp {c.expert_tp} with pins that leave room for it"
        )
        raise InputError(
            f"--expert-tp {c.expert_tp}: no mesh of at most {num_devices} devices has tp={c.expert_tp} with the "
            f"other pins; {fix}"
        )
    if not search.candidates:
        raise InfeasibleError(
            f"no mesh shape fits {num_devices} devices with "
            f"{' '.join(f'{k}={v}' for k, v in c.pinned.items()) or 'no pinned degrees'} and batch "
            f"{w.batch_size}; excluded: {'; '.join(search.excluded) or 'none'}"
        )


def _schedule_for(schedule: Schedule, pp: int, micro_batches: int) -> Schedule:
    """The schedule a (pp, micro_batches) candidate runs: 1F1B with fewer micro-batches than stages
    never reaches its steady state and is GPipe (the same order and memory), which is what runs then
    (torch.distributed.pipelining's Schedule1F1B requires micro_batches >= stages)."""
    if schedule == Schedule.ONE_F_ONE_B and micro_batches < pp:
        return Schedule.GPIPE
    return schedule


def _schedules_for(search: _Search, pp: int, micro_batches: int) -> list[tuple[Schedule, int]]:
    """(schedule, v) candidates of a (pp, micro_batches) pair. Without a pipeline, or with a pinned
    GPipe / 1F1B, the one schedule (`_schedule_for`). Training with pp > 1 and no pinned schedule: 1F1B
    and interleaved 1F1B with the most chunks per rank allowed (at most `MAX_VIRTUAL_STAGES`, at least
    one layer per chunk, `interleaved_chunks`; once solved, the fewer chunks are priced on its choices,
    `_price_virtual_stages`), when the micro-batches are a multiple of pp (the interleaved schedule runs
    them in rounds of pp); a pinned v or interleaved schedule restricts them to those."""
    c = search.constraints
    plain = _schedule_for(c.schedule or Schedule.ONE_F_ONE_B, pp, micro_batches)
    if pp == 1:
        return [(plain, 1)]
    out = [] if c.schedule is Schedule.INTERLEAVED_1F1B or (c.virtual_stages or 1) > 1 else [(plain, 1)]
    if c.schedule not in (None, Schedule.INTERLEAVED_1F1B) or not search.workload.train:
        return out or [(plain, 1)]
    num_layers = len(search.structure.layers)
    most = min(MAX_VIRTUAL_STAGES, num_layers // pp)
    v = (
        c.virtual_stages or most
    )  # the most chunks: fewest in-flight activations (others: `_price_virtual_stages`)
    if micro_batches % pp == 0 and 2 <= v <= most:
        out.append((Schedule.INTERLEAVED_1F1B, v))
    elif not out and not 2 <= v <= most:  # pinned interleaving this pipeline cannot have: say why
        reason = (
            f"pp={pp}: the interleaved schedule needs at least 2 model chunks of a layer or more per rank, "
            f"and {num_layers} layers over {pp} ranks give {num_layers // pp} per rank"
            if most < 2
            else f"pp={pp}: --virtual-stages {v} needs {v} layers per rank, {num_layers} layers give {most}"
        )
        if reason not in search.excluded:
            search.excluded.append(reason)
    return out


def _exclude_short_interleaving(
    search: _Search, pps: list[int], dps: list[int], counts: list[int] | None = None
) -> None:
    """With the interleaved schedule pinned (--schedule interleaved_1f1b, or --virtual-stages above 1):
    list as excluded, in one line, the pipeline degrees of `pps` for which no micro-batch count is a
    multiple of pp (the schedule runs the micro-batches in rounds of pp, `_schedules_for`), naming the
    counts the batch (or the pinned --micro-batches) allows and the ways out; the error of a search
    left without them otherwise advised the pipeline parallelism the pin had ruled out. `counts`: the
    micro-batch counts where the batch is kept whole (else `_micro_batch_options` per dp)."""
    c, w = search.constraints, search.workload
    have = {cand.mesh.pp for cand in search.candidates}
    short: dict[int, set[int]] = {}  # pp -> the micro-batch counts allowed, none a multiple of pp
    for pp in pps:
        allowed = (
            set(counts)
            if counts is not None
            else {m for dp in dps for m in _micro_batch_options(search, pp, dp)}
        )
        if pp not in have and allowed and not any(m % pp == 0 for m in allowed):
            short[pp] = allowed
    if not short:
        return
    pin = (
        "--schedule interleaved_1f1b"
        if c.schedule is Schedule.INTERLEAVED_1F1B
        else f"--virtual-stages {c.virtual_stages}"
    )
    allowed = sorted(set().union(*short.values()))
    source = (
        f"--micro-batches {w.micro_batches}"
        if w.micro_batches is not None
        else f"batch {w.batch_size} allows {', '.join(map(str, allowed))} micro-batch(es) per replica"
    )
    least = min(short)
    fix = (
        f"--micro-batches a multiple of pp ({least} at pp={least})"
        if w.micro_batches is not None
        else f"a batch whose share per replica is a multiple of pp ({least} at pp={least})"
    )
    reason = (
        f"pp={', '.join(map(str, short))}: {pin} runs the micro-batches in rounds of pp, and {source}, none a "
        f"multiple of it; use {fix}, or --schedule 1f1b"
    )
    if reason not in search.excluded:
        search.excluded.append(reason)


def _sequence_parallel_options(search: _Search, tp: int, cp: int = 1) -> list[bool]:
    """Sequence parallelism off and on (training with tp > 1), or as pinned; pinned on, a tp=1
    mesh is no candidate (nothing to split the sequence over; listed as excluded). Ladder residual and
    sequence parallelism exclude each other (`passes.lower.check_runnable`): with exactly the upper N
    layers laddered (`--ladder upper:N`) only off; with `auto` both, the on candidate solved without
    ladder (`_ladder_of`). Never on where a layer's sequence does not divide by tp
    (`ModelStructure.stream_tokens`: a ViT's 17 patches and class token at tp=2): each rank would hold
    an unequal part, and the passes refuse the plan; pinned on, that tp is excluded and says why. With
    context parallelism over `cp` ranks the sequence tp splits is the rank's cp-th of it.

    Raises:
        InputError: sequence parallelism pinned on together with `--ladder upper:N`.
    """
    pinned = search.constraints.sequence_parallel
    if tp == 1 and pinned and search.workload.train:  # nothing to split the sequence over: not a candidate
        reason = (
            "tp=1: --sequence-parallel on needs tp > 1 (it splits each layer's sequence over the TP ranks)"
        )
        if reason not in search.excluded:
            search.excluded.append(reason)
        return []
    if tp == 1 or not search.workload.train or pinned is False:
        return [False]
    uneven = [t // cp for t in search.structure.stream_tokens(search.workload.seq_len) if (t // cp) % tp]
    if uneven:
        if pinned:
            reason = (
                f"tp={tp}: --sequence-parallel on, and the layers' sequence of {uneven[0]} token(s) does "
                f"not divide by {tp}"
            )
            if reason not in search.excluded:
                search.excluded.append(reason)
            return []
        return [False]
    if search.ladder.mode is LadderMode.UPPER:
        if pinned:
            raise InputError(
                "--sequence-parallel on and --ladder upper:N cannot be used together: ladder residual "
                "overlaps the all-reduces that sequence parallelism replaces by reduce-scatters; pass "
                "--sequence-parallel off (or auto), or --ladder none"
            )
        return [False]
    return [pinned] if pinned is not None else [False, True]


def _cp_options(search: _Search, num_devices: int) -> list[int]:
    """Context-parallel degrees of the search: the pinned --cp (checked: `_check_pinned_cp`), else 1
    and, for training and prefill of sequences of `MIN_CP_SEQ_LEN` tokens or more (`MIN_CP2_SEQ_LEN`:
    CP 2 alone) by a token model with
    attention whose layers all see the whole sequence, every power of two up to `MAX_CP` dividing the
    devices whose ranks keep at least `MIN_CP_TOKENS_PER_RANK` tokens and that cuts the sequence into
    equal chunks (2 x cp with load balancing, cp without: `check_cp_sequence`); the others are listed
    in `_Search.excluded`."""
    c, w = search.constraints, search.workload
    if c.cp is not None:
        _check_pinned_cp(search)
        return [c.cp]
    if w.kind is Workload.DECODE or w.seq_len < MIN_CP2_SEQ_LEN:
        return [1]  # not listed as excluded: every short-sequence plan would say it
    why = _cp_refusal(search)
    if why:
        if search.structure.layers and any(layer.attention for layer in search.structure.layers):
            search.excluded.append(f"cp>1: {why}")
        return [1]
    out, lbs = [1], [c.cp_load_balance] if c.cp_load_balance is not None else [True, False]
    for cp in (2**k for k in range(1, MAX_CP.bit_length())):
        if cp > num_devices or num_devices % cp or (cp > 2 and w.seq_len < MIN_CP_SEQ_LEN):
            break
        if w.seq_len // cp < MIN_CP_TOKENS_PER_RANK:
            search.excluded.append(
                f"cp>={cp}: under {MIN_CP_TOKENS_PER_RANK} tokens of each {w.seq_len}-token sequence per rank "
                "(pin --cp to price it)"
            )
            break
        if all(w.seq_len % (2 * cp if lb else cp) for lb in lbs):
            search.excluded.append(f"cp={cp}: {w.seq_len} tokens do not cut into {2 * cp} equal chunks")
            continue
        out.append(cp)
    return out


def _ep_options(search: _Search, mesh: MeshShape, sequence_parallel: bool) -> list[tuple[int, str]]:
    """The (ep, fold) pairs a mesh candidate is priced with: (1, "dp") for a dense model or --ep 1; the
    pinned --ep (--ep-fold) where it runs (`ep_refusal`); else off, every divisor of dp x cp above 1 that
    divides the experts (fold dp) and ep = tp (fold tp) where they divide, as --ep-fold allows."""
    c = search.constraints
    experts = expert_counts(search.structure)
    if c.ep == 1 or not experts_lowerable(search.structure):  # capped or not SwiGLU: `_check_pinned_ep`
        return [(1, "dp")]
    folds = [c.ep_fold] if c.ep_fold is not None else ["dp", "tp"]
    if c.ep is not None:
        pairs = [(c.ep, fold) for fold in folds]
    else:
        pairs = [(1, "dp")] + [(d, "dp") for d in _divisors(mesh.dp_cp) if d > 1 and "dp" in folds]
        pairs += [(mesh.tp, "tp")] if mesh.tp > 1 and "tp" in folds else []
    return [
        (ep, fold)
        for ep, fold in pairs
        if ep == 1 or not ep_refusal(experts, ep, fold, mesh, sequence_parallel)
    ]


def _ep_options_with_expert_tp(
    search: _Search, mesh: MeshShape, sequence_parallel: bool
) -> list[tuple[int, str, int]]:
    """`_pinned_ep_options_with_expert_tp`, without the experts whole and without EP (the model's own
    expert code) where `Constraints.experts_rewritten` says that does not fit."""
    triples = _pinned_ep_options_with_expert_tp(search, mesh, sequence_parallel)
    if search.constraints.experts_rewritten:
        return [(ep, fold, etp) for ep, fold, etp in triples if ep > 1 or etp > 1]
    return triples


def _pinned_ep_options_with_expert_tp(
    search: _Search, mesh: MeshShape, sequence_parallel: bool
) -> list[tuple[int, str, int]]:
    """`_ep_options` with the expert TP each is solved with: tp at tp > 1 without EP and for EP over dp x
    cp (Megatron-Core's default, --expert-tensor-parallel-size = TP; the experts whole, expert_tp 1, are
    priced on its solution, `_price_expert_tp`: splitting the experts halves their GEMMs at tp 2, which
    lowers the bounds the search prunes by, so the split is what is solved), else 1; a pinned
    --expert-tp 1 keeps 1, N > 1 only meshes of tp = N without EP or with EP over dp. A model whose
    experts the expert pass cannot lower (`experts_lowerable`) keeps them whole. Sequence parallelism
    gathers a MoE block's tokens before its router (`passes.ep_lower`), so it does not rule the split out."""
    pinned = search.constraints.expert_tp
    pairs = _ep_options(search, mesh, sequence_parallel)
    if not experts_lowerable(search.structure):
        return [(ep, fold, 1) for ep, fold in pairs] if pinned in (None, 1) else []
    if pinned is None:
        return [(ep, fold, mesh.tp if fold == "dp" else 1) for ep, fold in pairs]
    if pinned == 1:
        return [(ep, fold, 1) for ep, fold in pairs]
    if mesh.tp != pinned:
        return []
    return [(ep, fold, pinned) for ep, fold in pairs if fold == "dp"]


def _check_pinned_ep(search: _Search) -> None:
    """A pinned --ep (--ep-fold) that cannot run is refused in one line naming both numbers: a dense
    model, an ep that does not divide the experts, fold tp at another pinned --tp, fold dp over pinned
    --dp / --cp ranks it does not divide, a model that keeps tokens under a capacity
    (`ModelStructure.token_capacity`: the EP pass's dispatch is dropless, so it would keep the tokens the
    model drops; unpinned, the search lists that as excluded). Raises InputError."""
    c = search.constraints
    experts = expert_counts(search.structure)
    capped = search.structure.token_capacity
    if experts and capped and c.ep != 1:
        why = (
            f"{capped[0]}; expert parallelism's dispatch keeps every token (dropless) and would compute other "
            "outputs than the model"
        )
        if c.ep is not None:
            raise InputError(
                f"--ep {c.ep}: {why}; use --ep 1, or give the model a dropless dispatch (a capacity of at least "
                "the tokens it counts)"
            )
        search.excluded.append(f"ep>1: {why}")
    unlowerable = experts_not_swiglu(search.structure) if experts and c.ep != 1 else ""
    if unlowerable:
        why = unlowerable
        if c.ep is not None:
            raise InputError(f"--ep {c.ep}: {why}; use --ep 1")
        search.excluded.append(f"ep>1: {why}")
    if c.ep is None or c.ep == 1:
        return
    if not experts:
        raise InputError(f"--ep {c.ep}: {_no_experts(search.structure)}; leave --ep out")
    bad = [e for e in experts if e % c.ep]
    if bad:
        fits = ", ".join(str(d) for d in _divisors(bad[0]) if d > 1 and all(e % d == 0 for e in experts))
        raise InputError(
            f"--ep {c.ep} does not divide the model's {bad[0]} experts (each EP rank holds E / ep of them); use "
            f"one of {fits or 'none'}, or --ep 1"
        )
    if c.ep_fold == "tp" and c.tp is not None and c.tp != c.ep:
        raise InputError(
            f"--ep {c.ep} --ep-fold tp needs --tp {c.ep} (the EP group is the TP group), got --tp {c.tp}; pin "
            f"--tp {c.ep}, or --ep-fold dp"
        )
    if c.ep_fold == "tp" and c.sequence_parallel:
        raise InputError(
            f"--ep {c.ep} --ep-fold tp needs the same tokens on every TP rank, which --sequence-parallel on "
            "splits; use --sequence-parallel off, or --ep-fold dp"
        )
    styles = c.dp_styles()
    one_replica = c.dp is not None and c.dp * (c.cp or 1) == 1  # every style is ddp there
    if c.runs_here and search.workload.train and DataParallel.DDP not in styles and not one_replica:
        raise InputError(
            f"--ep {c.ep} with --run: the runtime runs expert parallelism with --dp-style ddp only, and "
            + (
                f"--dp-style {c.dp_style} is pinned"
                if c.dp_style is not None
                else f"the options allow {', '.join(str(s) for s in styles)}"
            )
            + "; pin --dp-style ddp (or leave it out), or plan without --run (the plan, its price and its "
            "exports are not limited)"
        )
    tp_fold_possible = c.ep_fold != "dp" and c.tp in (None, c.ep)
    cp_fixed = c.cp is not None or search.workload.seq_len < MIN_CP2_SEQ_LEN  # else the search may add cp
    if c.dp is not None and cp_fixed and not tp_fold_possible and (c.dp * (c.cp or 1)) % c.ep:
        ranks = c.dp * (c.cp or 1)
        pins = f"--dp {c.dp}" + (f" --cp {c.cp}" if c.cp else "")
        raise InputError(
            f"--ep {c.ep} does not divide the {ranks} dp x cp ranks it folds over ({pins}); use an --ep that "
            f"divides both {ranks} and the {experts[0]} experts, or more data-parallel ranks"
        )


def _ep_unplaceable(search: _Search, num_devices: int) -> str:
    """The one-line refusal when no mesh candidate holds the pinned --ep: the ranks it would fold over."""
    c = search.constraints
    experts = expert_counts(search.structure)
    over = "the TP ranks (--ep-fold tp: ep = tp)" if c.ep_fold == "tp" else "dp x cp ranks (or the TP ranks)"
    return (
        f"--ep {c.ep}: no mesh of at most {num_devices} devices has {over} divisible by {c.ep} with the other "
        f"pins; the model has {experts[0]} experts; use a smaller --ep or more devices"
    )


def _cp_refusal(search: _Search) -> str:
    """Why the search prices no context parallelism for the model ("" when it does): `_cp_unsupported`,
    else `_cp_gathers_attention`."""
    return _cp_unsupported(search) or _cp_gathers_attention(search)


def _cp_unsupported(search: _Search) -> str:
    """Why context parallelism does not apply to the model ("" when it does): it needs attention layers
    of a token model that all see the whole sequence, no KV cache of the model's own, no token capacity
    and, training, no attention dropout (`passes.cp_lower` refuses it on the ranks)."""
    s, w = search.structure, search.workload
    attentions = [layer.attention for layer in s.layers if layer.attention is not None]
    if not attentions and s.token_model and any(c.kind == "attention" for c in s.node_costs.values()):
        where = sorted({c.module_path for c in s.node_costs.values() if c.kind == "attention"})
        return (
            f"its attention ({', '.join(where[:3])}) is not in a stack of numbered layers, which the planner "
            "prices context parallelism per layer of; hold the blocks in an nn.ModuleList (model.layers.0, "
            "model.layers.1, ...)"
        )
    if not attentions or not s.token_model:
        return "the model has no attention layers over token sequences to split"
    if s.has_kv_cache:
        return "the model writes its own KV cache, which context parallelism does not split"
    if any(t != w.seq_len for t in s.stream_tokens(w.seq_len)):
        first = next((m for m in s.batch_mixing if "sequence-first" in m), "")
        if first:  # the same tokens, laid out (T, B): the runtime splits dim 0, the sequence
            return (
                f"{first}, which context parallelism would cut as the batch; give the model its tokens "
                "batch-first (B, T) (nn.TransformerEncoderLayer(..., batch_first=True))"
            )
        return "its layers see another sequence than the input's tokens"
    if s.token_capacity:
        return f"{s.token_capacity[0]}, and a context-parallel rank would count only its part of the sequence"
    dropping = [a for a in attentions if a.dropout_p] if w.kind is Workload.TRAIN else []
    if dropping:
        return (
            f"its attention applies dropout in training (dropout_p {dropping[0].dropout_p:g} at "
            f"{dropping[0].core_line or dropping[0].sdpa_node}), which the context-parallel attention kernels do not "
            "run; set the attention dropout to 0 to plan context parallelism"
        )
    return ""


def _cp_gathers_attention(search: _Search) -> str:
    """Why the search does not choose context parallelism for a model whose attention core is written
    by hand (softmax(q k^T) v, not scaled_dot_product_attention): the CP pass runs only SDPA as
    context-parallel attention and gathers the whole sequence for a hand-written core (`passes.
    cp_lower`, a priced fallback), so every rank would compute all of attention; a pinned --cp still
    runs so. "" when every core is SDPA."""
    s = search.structure
    for layer in s.layers:
        a = layer.attention
        cost = s.node_costs.get(a.sdpa_node) if a is not None else None
        if cost is not None and cost.op != "aten.scaled_dot_product_attention":
            return (
                f"the attention at {a.core_line or a.sdpa_node} is written by hand (softmax(q k^T) v), which "
                "context parallelism runs on the whole sequence gathered on every rank (pin --cp to price "
                "that; scaled_dot_product_attention is split)"
            )
    return ""


def _check_pinned_cp(search: _Search) -> None:
    """A pinned --cp (with --cp-comm-type / --cp-load-balance) that cannot run is refused in one line
    naming the numbers and what would work: decode, a model without attention over tokens, a sequence
    that does not cut into equal chunks (`check_cp_sequence`), Ulysses with heads that do not divide
    by cp (at the pinned --tp, else with the attention replicated). Raises InputError."""
    c, w = search.constraints, search.workload
    cp = c.cp
    if cp == 1:
        return
    if w.kind is Workload.DECODE:
        raise InputError(
            f"--cp {cp}: a decode step has one new token per sequence to split; context parallelism is for "
            "--workload train and forward (prefill): use --cp 1 or leave it out"
        )
    why = _cp_unsupported(search)
    if why:
        raise InputError(f"--cp {cp}: {why}; use --cp 1 or leave it out")
    kind = c.cp_comm_type or "any variant"
    # load balancing auto (None): off where only contiguous chunks cut the sequence (`_cp_variants`)
    check_cp_sequence(w.seq_len, cp, c.cp_load_balance, kind, "--cp")
    if c.cp_comm_type == "alltoall":
        refusal = _ulysses_refusal(search, c.tp or 1, cp)
        if refusal:
            raise InputError(f"--cp {cp} --cp-comm-type alltoall: {refusal}")


def _ulysses_refusal(search: _Search, tp: int, cp: int) -> str:
    """Why all-to-all (Ulysses) cannot run on (tp, cp) for some attention layer of the model (its heads
    per TP rank, query and KV, must divide by cp: `costmodels.context_parallel.ulysses_refusal`), with
    the variants that work and, when the heads divide a smaller cp, that one; "" when it can."""
    for layer in search.structure.layers:
        attn = layer.attention
        if attn is None:
            continue
        shard = tp if tp > 1 and attn.num_heads % tp == 0 else 1
        heads, kv = attn.num_heads / shard, ulysses_kv_heads(attn, shard)
        refusal = ulysses_refusal(heads, kv, cp)
        if refusal:
            fits = [d for d in (2, 4, 8, 16, 32) if d < cp and heads % d == 0 and kv % d == 0]
            return refusal + (f", or cp={fits[-1]} with alltoall" if fits else "")
    return ""


def _cp_variants(search: _Search, mesh: MeshShape) -> list[tuple[str, bool]]:
    """The (cp_comm_type, cp_load_balance) pairs the constraints allow on `mesh` and the sequence and
    heads take (`_cp_refusals` says why the others not): allgather, ring, alltoall, each balanced then
    contiguous; [("allgather", True)] at cp 1 (unused there)."""
    if mesh.cp == 1:
        return [("allgather", True)]
    c, seq = search.constraints, search.workload.seq_len
    types = [c.cp_comm_type] if c.cp_comm_type is not None else ["allgather", "ring", "alltoall"]
    balances = [c.cp_load_balance] if c.cp_load_balance is not None else [True, False]
    refused = _cp_refusals(search, mesh)
    return [
        (kind, lb)
        for kind in types
        if kind not in refused
        for lb in balances
        if seq % (2 * mesh.cp if lb else mesh.cp) == 0
    ]


def _cp_refusals(search: _Search, mesh: MeshShape) -> dict[str, str]:
    """Context-parallel variants `mesh` cannot run, with why (Ulysses' heads: `_ulysses_refusal`)."""
    if mesh.cp == 1:
        return {}
    refusal = _ulysses_refusal(search, mesh.tp, mesh.cp)
    return {"alltoall": refusal} if refusal else {}


def _cp_variant(search: _Search, mesh: MeshShape, micro_batches: int) -> tuple[str, bool] | None:
    """The context-parallel variant a candidate is solved with: of `_cp_variants`, the one whose
    attention cores cost least (kernels + exposed traffic, `costing.cp_core_cost`, head-parallel where
    the heads divide by tp); the others are priced on the solution (`_price_cp_variants`). Cached by
    what it depends on; None when no variant runs on `mesh` (listed in `_Search.excluded`)."""
    variants = _cp_variants(search, mesh)
    if mesh.cp == 1 or len(variants) <= 1:
        if not variants:
            search.excluded.append(f"{mesh.label()}: no context-parallel variant runs here")
            return None
        return variants[0]
    key = ("cp", mesh.tp, mesh.cp, mesh.dp, micro_batches)
    if key not in search.priced:
        cluster = cluster_for_ranks(search.cluster, mesh.num_devices)
        costs = []
        for kind, lb in variants:
            config = MeshConfig(mesh, micro_batches, cp_comm_type=kind, cp_load_balance=lb)
            ctx = CostContext(search.structure, cluster, search.workload, config, search.dtype)
            costs.append((_cp_attention_s(ctx), (kind, lb)))
        search.priced[key] = min(costs, key=lambda cost: cost[0])[1]  # first of equals: the simpler
    return search.priced[key]


def _cp_attention_s(ctx: CostContext) -> float:
    """The attention cores of every layer under `ctx`'s context parallelism, kernels plus exposed
    traffic per micro-batch, heads split as `costing.cp_core_shard` (`costing.cp_core_cost`)."""
    total = 0.0
    for attn, cross, count in cp_attentions(ctx.structure):
        cost = cp_core_cost(attn, ctx, cp_core_shard(attn, ctx), cross)
        total += count * (cost.compute_s + cost.exposed_s)
    return total


def _price_expert_tp(search: _Search, cand: _Candidate) -> None:
    """A solved candidate whose experts are split over its TP ranks (expert_tp = tp, not pinned) priced
    with them whole on every TP rank (expert_tp 1) on the same strategies, stages and recomputation:
    the split is kept only when it saves `FEATURE_MIN_SAVING` of the step (a feature the runtime must
    run) or the whole experts do not fit memory; not without EP where `Constraints.experts_rewritten`
    rules the model's own expert code out. The expert GEMMs, their memory and the TP all-reduce change,
    not the per-layer trade-offs the ILP makes."""
    config = cand.config
    if search.constraints.expert_tp is not None or config.expert_tp == 1:
        return
    if search.constraints.experts_rewritten and config.ep == 1:  # whole without EP: the model's own code
        return
    assert cand.solution is not None and cand.solution.assignment is not None and cand.latency_s is not None
    tables = _price(search, dataclasses.replace(config, expert_tp=1)).tables
    p = predict(tables, cand.solution.assignment).prediction
    if p.peak_memory_bytes <= search.cap_bytes and p.latency_s <= cand.latency_s * (1 + FEATURE_MIN_SAVING):
        cand.tables, cand.latency_s = tables, p.latency_s


def _price_cp_variants(search: _Search, cand: _Candidate) -> None:
    """A solved candidate with context parallelism priced with every other variant `_cp_variants`
    allows on the same strategies, stages and recomputation: keep the fastest that fits memory (a
    variant changes the attention cores' kernels, their traffic and the K/V buffers in flight, not the
    per-layer trade-offs the ILP makes)."""
    config = cand.config
    if config.mesh.cp == 1:
        return
    assert cand.solution is not None and cand.solution.assignment is not None and cand.latency_s is not None
    for kind, lb in _cp_variants(search, config.mesh):
        variant = dataclasses.replace(config, cp_comm_type=kind, cp_load_balance=lb)
        if variant == config:
            continue
        tables = _price(search, variant).tables
        p = predict(tables, cand.solution.assignment).prediction
        if p.peak_memory_bytes <= search.cap_bytes and p.latency_s < cand.latency_s * (1 - TIE_TOLERANCE):
            cand.tables, cand.latency_s = tables, p.latency_s


def _ladder_of(search: _Search, config: MeshConfig) -> LadderPolicy:
    """The ladder policy a candidate is solved with: none under sequence parallelism (they exclude
    each other), else the search's."""
    return LadderPolicy() if config.sequence_parallel else search.ladder


def _tables_key(ctx: CostContext, with_ep: bool = True) -> tuple:
    """What the op times of a candidate depend on: TP degree, micro-batch size, sequence parallelism,
    the context parallelism (degree, variant, load balancing), expert parallelism (degree, fold and
    where its group sits: the MoE layers' fixed times; `with_ep` False leaves it out, for what it does
    not change: the blocks' option tables, `_block_bounds_s`) and, without training, the sequences per
    DP replica (KV caches). Not pp, the schedule or v (they enter at the stage level), nor the training
    state per parameter (ZeRO-1 divides it by dp), which scales every static byte of a training
    candidate (`_with_state_factor`). And the processes of the priced cluster's node (`cluster_for_ranks`:
    one gloo node's CPU processes time-share its cores, so a 4-rank candidate runs each op slower than a
    2-rank one of the same shapes: it took the 2-rank times, priced 2x fast)."""
    replica = None if ctx.train else ctx.workload.batch_size / ctx.mesh.dp
    cp = (ctx.cp, ctx.config.cp_comm_type, ctx.config.cp_load_balance) if ctx.cp > 1 else (1,)
    ep = (ctx.ep, ctx.ep_fold, ctx.ep_group(), ctx.expert_tp) if ctx.ep > 1 and with_ep else ()
    ep = ep or (("expert_tp", ctx.expert_tp) if ctx.expert_tp > 1 and with_ep else ())
    shared = ctx.cluster.devices_per_node
    return (ctx.mesh.tp, ctx.sequences_per_micro_batch, ctx.sequence_parallel, replica, shared, *cp, *ep)


def _state_factors(ctx: CostContext) -> tuple[float, float]:
    """(dense, routed experts') training state per parameter byte of `ctx` (`CostContext.state_factor`;
    the experts' under EP over dp x cp shard over their own edp group: `experts_context`)."""
    experts = ctx.experts_context().state_factor() if ctx.ep > 1 and ctx.ep_fold == "dp" else None
    dense = ctx.state_factor()
    return dense, dense if experts is None else experts


def _price(search: _Search, config: MeshConfig, lazy: bool = False) -> _Candidate:
    """`config` priced, with its lower bounds. `lazy`: the tables' static bytes may still need the
    candidate's training-state factor (`_materialize` before using them), which only the bounds know."""
    cluster = cluster_for_ranks(search.cluster, config.mesh.num_devices)  # time-shared only by ranks that run
    ctx = CostContext(search.structure, cluster, search.workload, config, search.dtype)
    key = _tables_key(ctx)
    if key not in search.priced:
        tables = build_cost_tables(ctx, search.layer_keys)
        if search.constraints.layout == "megatron":
            _megatron_layout_only(tables)
        counts: dict[str, int] = {}
        for k in tables.layer_keys:
            counts[k] = counts.get(k, 0) + 1
        with_comm = search.ladder.mode is LadderMode.NONE  # ladder hides block-output communication
        base = _tables_key(ctx, with_ep=False)
        work = sum(
            n * _least_layer_time_s(tables.graphs[k], k, ctx, with_comm, search, base)
            for k, n in counts.items()
        )
        ends = sum(min(o.compute_s + o.comm_s for o in op.options) for op in tables.ends.ops)
        work += ends + tables.ends.fixed_compute_s
        search.priced[key] = (tables.graphs, tables.ends, work, _state_factors(ctx), _least_memory(tables))
    graphs, ends, work, state, (static, act, ends_static) = search.priced[key]
    factors = _state_factors(ctx)
    ratio = (factors[0] / state[0], factors[1] / state[1])
    tables = CostTables(ctx, graphs, search.layer_keys, ends)
    # a lower bound whichever part dominates (frozen weights do not scale: no factor above 1 then)
    low = min(ratio) if not search.structure.frozen_params else min(1.0, *ratio)
    least = (static * low, act, ends_static * min(ratio[0], low))
    pp, v = config.mesh.pp, config.virtual_stages
    total = work + (pp * v - 1) * p2p_stage_time_s(ctx) if pp > 1 else work  # `stage_p2p_time_s`, summed
    bound = step_time_s(total, total / config.mesh.pp, config.micro_batches, config.virtual_stages)
    cand = _Candidate(tables, bound, _memory_lower_bound(tables, least), static_ratio=ratio)
    if not lazy:
        _materialize(search, cand)
    return cand


def _megatron_layout_only(tables: CostTables) -> None:
    """`--layout megatron`: every op of `tables` keeps only the option of the hand-written Megatron-LM
    layout (`megatron_choices`, as the baseline splits), in place; the ILP then chooses the rest.
    Raises InfeasibleError where an attention core cannot be split by heads (its exclusion says why)."""
    # Megatron splits every attention by heads: refuse what cannot be
    for key, graph in tables.graphs.items():
        for op in graph.ops:
            why = op.excluded.get("head") if op.name in ("core", "cross.core") else None
            if why:
                layers = [i for i, k in enumerate(layer_keys(tables.ctx.structure)) if k == key]
                raise InfeasibleError(
                    f"--layout megatron splits each attention by heads as Megatron-LM does, but the attention of "
                    f"layers {layer_ranges(layers)} cannot be split so: {why}; plan it with --layout auto (which "
                    "keeps such an attention whole and prices it)"
                )
    choices = megatron_choices(tables.graphs, tables.ends)
    for key, graph in [*tables.graphs.items(), ("ends", tables.ends)]:
        for op in graph.ops:
            op.options = [op.option(choices[(key, op.name)])]


def _materialize(search: _Search, cand: _Candidate) -> None:
    """Apply the candidate's pending training-state factors to its tables' static bytes (cached)."""
    if cand.static_ratio == (1.0, 1.0):
        return
    ctx = cand.tables.ctx
    full_key = (*_tables_key(ctx), _state_factors(ctx))
    if full_key not in search.rescaled:
        search.rescaled[full_key] = _with_state_factor(
            cand.tables.graphs, cand.tables.ends, *cand.static_ratio
        )
    graphs, ends = search.rescaled[full_key]
    cand.tables = CostTables(ctx, graphs, search.layer_keys, ends)
    cand.static_ratio = (1.0, 1.0)


def _with_state_factor(
    graphs: dict[str, LayerGraph], ends: LayerGraph, ratio: float, expert_ratio: float
) -> tuple[dict[str, LayerGraph], LayerGraph]:
    """Copies of training graphs with every static byte (parameters, gradients, optimizer state)
    multiplied by `ratio`, the routed experts' own (`LayerGraph.expert_static_bytes`) by `expert_ratio`;
    frozen weights' (`OpOption.frozen_bytes`, `LayerGraph.frozen_static_bytes`) stay as they are."""

    def option(o: OpOption) -> OpOption:
        o = copy.copy(o)
        o.static_bytes = (o.static_bytes - o.frozen_bytes) * ratio + o.frozen_bytes
        return o

    def scaled(graph: LayerGraph) -> LayerGraph:
        out = copy.copy(graph)
        out.ops = []
        for op in graph.ops:
            op = copy.copy(op)
            op.options = [option(o) for o in op.options]
            out.ops.append(op)
        experts, frozen = graph.expert_static_bytes, graph.frozen_static_bytes
        trained = graph.fixed_static_bytes - experts - frozen
        out.fixed_static_bytes = trained * ratio + experts * expert_ratio + frozen
        out.expert_static_bytes = experts * expert_ratio
        return out

    return {k: scaled(g) for k, g in graphs.items()}, scaled(ends)


def _least_layer_time_s(
    graph: LayerGraph, key: str, ctx: CostContext, with_comm: bool, search: _Search, base: tuple
) -> float:
    """A lower bound of one layer's time per micro-batch: its fixed compute and communication, and per
    block the best combination of options with its conversions and output communication
    (`block_table`; without the communication when `with_comm` is False, or when a block has too many
    combinations to enumerate). The blocks' part does not depend on expert parallelism: cached by the
    tables' key without it (`base`)."""
    cache_key = (base, key, with_comm)
    if cache_key not in search.block_bounds:
        blocks = 0.0
        for block in ("attention", "cross", "mlp"):
            ops = graph.ops_of(block)
            table = block_table(graph, key, block, ctx) if with_comm else None
            if table:
                blocks += min(table.values())
            else:
                blocks += sum(min(o.compute_s for o in op.options) for op in ops)
        search.block_bounds[cache_key] = blocks
    return graph.fixed_compute_s + graph.fixed_comm_s + search.block_bounds[cache_key]


def _least_memory(tables: CostTables) -> tuple[float, float, float]:
    """(static, activation, ends static) bytes: the least of any layer class and option (activations:
    also under full recomputation, which keeps only the input); the ends' least static bytes."""
    ctx, graphs = tables.ctx, tables.graphs.values()
    keep = recompute_input_bytes(ctx) if ctx.train else math.inf  # recomputation keeps only the input
    static = min(g.least_static_bytes() for g in graphs)
    act = min(min(keep, g.least_activation_bytes()) for g in graphs)
    ends_static = sum(min(o.static_bytes for o in op.options) for op in tables.ends.ops)
    return static, act, ends_static


def _memory_lower_bound(tables: CostTables, least: tuple[float, float, float] | None = None) -> float:
    """A lower bound of the largest stage's memory per rank, without solving (`least`: `_least_memory`
    of `tables`, if the caller has it).

    Every layer needs at least c[s] = min over classes and options of (static + f(s) * activations)
    on stage s, where f(s) is the stage's in-flight micro-batches; spreading L layers fractionally so
    that all stages are equal gives max_s n[s] c[s] >= L / sum_s (1 / c[s]).
    """
    ctx = tables.ctx
    static, act, ends_static = least or _least_memory(tables)
    pp, m, v = ctx.mesh.pp, ctx.micro_batches, ctx.virtual_stages
    if not ctx.train:
        flights = [0.0] * pp
    elif ctx.config.schedule is Schedule.GPIPE:
        flights = [float(m)] * pp
    else:  # `memory.inflight_micro_batches`, inlined: this runs for every candidate
        flights = [
            min((2 * (pp - s - 1) + (v - 1) * pp + 1) / v, m) if v > 1 else min(pp - s, m) for s in range(pp)
        ]
    per_stage = [static + f * act for f in flights]
    if min(per_stage) <= 0:
        return 0.0
    return tables.num_layers / sum(1.0 / c for c in per_stage) + ends_static / ctx.mesh.pp


# ---------------------------------------------------------------------------------------------
# Solving


def _solve_candidates(search: _Search, progress: Progress = silent) -> _Candidate | None:
    best: _Candidate | None = None
    order = sorted(search.candidates, key=lambda c: (c.lower_bound_s, c.mesh.num_devices))
    start = time.perf_counter()
    for i, cand in enumerate(order):
        progress(
            f"mesh {i + 1}/{len(order)}: {cand.mesh.label()} m={cand.config.micro_batches}", i / len(order)
        )
        left = search.constraints.search_time_limit_s - (time.perf_counter() - start)
        if cand.memory_lower_bound_bytes > search.cap_bytes:
            cand.note = f"needs at least {cand.memory_lower_bound_bytes / _GIB:.1f} GiB per device"
            continue
        if best is not None and _prunable(cand, best, search.constraints.mip_gap):
            cand.note = (
                f"pruned: lower bound {cand.lower_bound_s * 1e3:.3g} ms within the solver gap of the best"
            )
            continue
        if left <= 0 and best is not None:
            cand.note = f"not solved: search time limit {search.constraints.search_time_limit_s} s reached"
            continue
        _materialize(search, cand)
        prob = IlpProblem(
            tables=cand.tables,
            ladder=_ladder_of(search, cand.config),
            memory_cap_bytes=search.cap_bytes,
            time_limit_s=max(1.0, min(search.constraints.time_limit_s, left)),
            mip_gap=search.constraints.mip_gap,
            ladder_min_saving_fraction=search.constraints.ladder_min_saving_fraction,
            ladder_budget=search.constraints.ladder_budget,
            recompute=search.constraints.recompute,
        )
        sol = solve(prob)
        search.solver_time_s += sol.time_s
        cand.solution = sol
        cand.note = sol.status
        if sol.assignment is None:
            cand.note = f"{sol.status}: does not fit {search.cap_bytes / _GIB:.1f} GiB per device"
            continue
        if (
            cand.config.sequence_parallel
            and search.constraints.sequence_parallel is None
            and "rowwise" not in sol.assignment.choices.values()
        ):  # no row-parallel block: nothing for sequence parallelism to split, and the pass would not apply it
            cand.note = (
                "sequence parallelism on, but the solution has no row-parallel block for it to apply to"
            )
            continue
        cand.latency_s = predict(cand.tables, sol.assignment).prediction.latency_s
        _prefer_megatron_pairing(cand, prob, search.constraints.pairing_min_saving_fraction)
        _price_virtual_stages(search, cand)
        _price_cp_variants(search, cand)
        _price_expert_tp(search, cand)
        _price_dp_styles(search, cand)
        if best is None or _better(cand, best):
            best = cand
    progress(f"searched {len(order)} mesh candidates", 1.0)
    return best


# against Megatron-LM's pairing: a row-parallel projection reading the block's input, a column-parallel
# one returning the block's output to the stream (`planner.export.common.against_megatron_pairing`)
_FLIPPED = {"q": "rowwise", "k": "rowwise", "v": "rowwise", "qkv": "rowwise", "gate": "rowwise",
            "up": "rowwise", "o": "colwise", "down": "colwise"}  # fmt: skip


def _without_flipped_splits(tables: CostTables) -> CostTables | None:
    """Copies of `tables` whose q/k/v/qkv/gate/up ops offer no row-wise and o/down no column-wise
    option (`_FLIPPED`); None when no op offers one."""
    changed = False

    def trimmed(graph: LayerGraph) -> LayerGraph:
        nonlocal changed
        out = copy.copy(graph)
        out.ops = []
        for op in graph.ops:
            flip = _FLIPPED.get(op.name.removeprefix("cross."))
            keep = [o for o in op.options if o.name != flip]
            if flip is not None and len(keep) < len(op.options) and keep:
                op = copy.copy(op)
                op.options = keep
                changed = True
            out.ops.append(op)
        return out

    graphs = {k: trimmed(g) for k, g in tables.graphs.items()}
    ends = trimmed(tables.ends)
    return CostTables(tables.ctx, graphs, tables.layer_keys, ends) if changed else None


def _prefer_megatron_pairing(cand: _Candidate, prob: IlpProblem, min_saving: float | None) -> None:
    """A solved candidate with a split against Megatron-LM's pairing (`_FLIPPED`, e.g. a column-parallel
    o on links so fast that two all-gathers cost what one all-reduce does) is solved again without
    such splits, and that solution kept unless the flipped one saves `min_saving` of its step
    (`Constraints.pairing_min_saving_fraction`, 0.5% as a training feature must; None: not re-solved):
    what an expert writes by hand wins a tie, and exports need no warning for it."""
    if min_saving is None:
        return
    choices = cand.solution.assignment.choices
    if not any(_FLIPPED.get(name.removeprefix("cross.")) == choice for (_, name), choice in choices.items()):
        return
    tables = _without_flipped_splits(cand.tables)
    if tables is None:
        return
    sol = solve(dataclasses.replace(prob, tables=tables))
    if sol.assignment is None:
        return
    latency_s = predict(tables, sol.assignment).prediction.latency_s
    if latency_s <= cand.latency_s * (1 + min_saving):
        cand.tables, cand.solution, cand.latency_s = tables, sol, latency_s


def _price_virtual_stages(search: _Search, cand: _Candidate) -> None:
    """A solved interleaved candidate (solved with the most chunks allowed, which holds the fewest
    in-flight activations) priced with every other v on the same choices: keep the fastest that fits
    memory. v changes the bubble, the point-to-point messages and the in-flight activations, not the
    per-layer trade-offs the ILP makes."""
    config = cand.config
    if config.virtual_stages == 1 or search.constraints.virtual_stages is not None:
        return
    assert cand.solution is not None and cand.solution.assignment is not None and cand.latency_s is not None
    num_layers = cand.tables.num_layers
    for v in range(2, config.virtual_stages):
        tables = _price(search, dataclasses.replace(config, virtual_stages=v)).tables
        stages = interleaved_chunks(num_layers, config.mesh.pp, v)
        assignment = dataclasses.replace(cand.solution.assignment, stages=stages)
        p = predict(tables, assignment).prediction
        if p.peak_memory_bytes <= search.cap_bytes and p.latency_s < cand.latency_s * (1 - TIE_TOLERANCE):
            cand.tables, cand.latency_s = tables, p.latency_s
            cand.solution = dataclasses.replace(cand.solution, assignment=assignment)
            cand.note = (
                f"{cand.solution.status}; v={v} of 2..{config.virtual_stages} priced on the same choices"
            )


def _solved_styles(search: _Search, mesh: MeshShape, ep: int = 1) -> list[DataParallel]:
    """The data-parallel styles a mesh's ILP is solved with: DDP without training or dp > 1; else one
    that keeps the parameters whole (ZeRO-1, else ZeRO-2, else DDP: those allowed) and FSDP, as the
    constraints allow and the runtime runs them (`_style_runs`). The styles differ in memory (which
    recomputation and splits fit) and in how much traffic hides; the others are priced on each
    solution (`_price_dp_styles`)."""
    if not search.workload.train or mesh.dp_cp == 1:
        return [DataParallel.DDP]
    allowed = [s for s in search.constraints.dp_styles() if _style_runs(search, mesh, s, ep)]
    whole = [s for s in (DataParallel.ZERO1, DataParallel.ZERO2, DataParallel.DDP) if s in allowed]
    return whole[:1] + ([DataParallel.FSDP] if DataParallel.FSDP in allowed else [])


def _style_runs(search: _Search, mesh: MeshShape, style: DataParallel, ep: int = 1) -> bool:
    """Whether the runtime runs `style` on `mesh`: sharded gradients (zero2, fsdp) of a parameter tied
    across pipeline stages (an embedding shared with the LM head) cannot be summed between the stages,
    so those are left out of the plan space (the runtime refuses them). With expert parallelism
    (`ep` > 1) and a plan to run here (`Constraints.runs_here`, --run): ddp only, the one style the
    runtime runs EP with."""
    tied = search.structure.tied_lm_head and mesh.pp > 1
    train_dp = search.workload.train and mesh.dp_cp > 1
    if ep > 1 and search.constraints.runs_here and train_dp and style is not DataParallel.DDP:
        return False
    return not (tied and style.shards_gradients and train_dp)


# how much a data-parallel style asks of the runtime, for ties: ddp < zero1 < zero2 < fsdp < hsdp
_DP_LEVEL = {DataParallel.DDP: 0, DataParallel.ZERO1: 1, DataParallel.ZERO2: 2, DataParallel.FSDP: 2}


def _dp_level(config: MeshConfig) -> int:
    """`_DP_LEVEL`, one more for HSDP (a shard degree below dp)."""
    level = _DP_LEVEL[config.dp_style] if config.mesh.dp_cp > 1 else 0
    return level + int(config.dp_style is DataParallel.FSDP and config.shard_degree < config.mesh.dp)


def _price_dp_styles(search: _Search, cand: _Candidate) -> None:
    """A solved candidate priced with every data-parallel style (training) and communication-overlap
    choice its constraints allow on the same strategies, stages and recomputation (`dp_style_variants`
    x `overlap_variants`): keep the fastest that fits memory, a variant asking more of the runtime
    (`_dp_level`, one more per overlap) only when it saves `FEATURE_MIN_SAVING` per level."""
    config = cand.config
    train = search.workload.train
    assert cand.solution is not None and cand.solution.assignment is not None and cand.latency_s is not None

    def score(latency_s: float, c: MeshConfig) -> float:
        return latency_s * (1 + FEATURE_MIN_SAVING * (_dp_level(c) + _overlap_level(c)))

    styles = dp_style_variants(config, search.constraints) if train and config.mesh.dp_cp > 1 else [config]
    variants = [v for style in styles for v in overlap_variants(style, search.constraints, train)]
    if cand.solution.assignment.ladder_layers:  # ladder residual overlaps those blocks' all-reduces itself
        variants = [v for v in variants if not v.tp_comm_overlap]
    best = (score(cand.latency_s, config), cand.tables, cand.latency_s)
    if config not in variants:  # the solved config is not allowed as it stands (a pinned overlap)
        best = (math.inf, cand.tables, cand.latency_s)
    for variant in variants:
        if variant == config or not _style_runs(search, variant.mesh, variant.dp_style, variant.ep):
            continue
        tables = _price(search, variant).tables
        p = predict(tables, cand.solution.assignment).prediction
        if p.peak_memory_bytes <= search.cap_bytes and score(p.latency_s, variant) < best[0]:
            best = (score(p.latency_s, variant), tables, p.latency_s)
    cand.tables, cand.latency_s = best[1], best[2]


def _overlap_level(config: MeshConfig) -> int:
    """How many communication-overlap choices a candidate turns on (each asks more of the runtime)."""
    return sum(config.overlap_flags().values())


def _features(config: MeshConfig) -> int:
    """How many of sequence parallelism, interleaving, a sharded data-parallel style, context
    parallelism, expert parallelism and expert tensor parallelism a candidate uses."""
    return (
        int(config.sequence_parallel)
        + int(config.virtual_stages > 1)
        + int(config.distributed_optimizer)
        + int(config.mesh.cp > 1)
        + int(config.ep > 1)
        + int(config.expert_tp > 1)
    )


def _prunable(cand: _Candidate, best: _Candidate, mip_gap: float) -> bool:
    """Whether `cand` need not be solved: `_better`'s score of its lower bound (the bound, plus
    `FEATURE_MIN_SAVING` per feature it uses) is within the solver's gap of the best plan's score so far
    or above it, and could not tie that score on fewer devices either. A bound that could still win
    is solved: a TP mesh whose solution replicated every weight, on 8 devices, kept TP 1 on 2 out of
    the search at the same latency (Zamba), and a candidate with fewer features wins at up to 0.5% a
    feature slower."""
    assert best.latency_s is not None
    bound = cand.lower_bound_s * (1 + FEATURE_MIN_SAVING * _features(cand.config))
    best_score = best.latency_s * (1 + FEATURE_MIN_SAVING * _features(best.config))
    if bound <= best_score * (1 - mip_gap):
        return False
    fewer = cand.mesh.num_devices < best.mesh.num_devices
    return not (fewer and bound <= best_score * (1 + TIE_TOLERANCE))


def _better(cand: _Candidate, best: _Candidate) -> bool:
    """Faster (each feature of `_features` must save `FEATURE_MIN_SAVING` of the step), or as fast
    (within TIE_TOLERANCE) on fewer devices: idle TP ranks are waste."""
    assert cand.latency_s is not None and best.latency_s is not None
    score = cand.latency_s * (1 + FEATURE_MIN_SAVING * _features(cand.config))
    best_score = best.latency_s * (1 + FEATURE_MIN_SAVING * _features(best.config))
    if score < best_score * (1 - TIE_TOLERANCE):
        return True
    tie = score <= best_score * (1 + TIE_TOLERANCE)
    return tie and cand.mesh.num_devices < best.mesh.num_devices


# ---------------------------------------------------------------------------------------------
# Infeasibility


def _infeasible(search: _Search) -> InfeasibleError:
    """Name the binding constraint for the candidate closest to fitting, and what would fit: the
    candidate with the least memory lower bound, or with context parallelism priced, of the least per
    CP degree the one whose predicted need is least (the bounds leave out the LM head's logits, which a
    long sequence's make large)."""
    ordered = sorted(search.candidates, key=lambda c: (c.memory_lower_bound_bytes, -c.mesh.tp))
    per_cp: dict[int, _Candidate] = {}
    for cand in ordered:
        per_cp.setdefault(cand.mesh.cp, cand)
    unit = _unit_does_not_fit(search)
    if unit is not None:
        return unit
    # the least memory the user's pins allow: full recomputation unless --recompute is pinned
    pinned = search.constraints.recompute

    def stages_of(cand: _Candidate) -> list:
        _materialize(search, cand)
        recompute = pinned if pinned is not None else True
        return predict(cand.tables, megatron_assignment(cand.tables, recompute=recompute)).stages

    priced = [(cand, stages_of(cand)) for cand in per_cp.values()]
    closest, breakdown = min(priced, key=lambda pair: max(bd.memory_bytes for bd in pair[1]))
    mesh = closest.mesh
    worst = max(range(mesh.pp), key=lambda s: breakdown[s].memory_bytes)
    need = breakdown[worst].memory_bytes
    total = sum(bd.memory_bytes for bd in breakdown) * mesh.tp * mesh.cp * mesh.dp  # all ranks' bytes
    devices_needed = math.ceil(total / search.cap_bytes)
    cap_gib = search.cluster.device.memory_bytes / _GIB
    per_node = search.cluster.devices_per_node
    hints = []
    if search.workload.train and pinned is not None and pinned is not Recompute.FULL:
        hints.append(f"activation recomputation (--recompute full, or leave --recompute {pinned} out)")
    if devices_needed > search.cluster.num_devices:  # else the bytes fit the cluster: not the binding limit
        across = "pp or context parallelism (--cp)" if search.workload.seq_len >= MIN_CP_SEQ_LEN else "pp"
        # whole nodes, one count ("about 3 devices (2 nodes of 2" read as two)
        nodes = math.ceil(devices_needed / per_node)
        hints.append(
            f"about {nodes * per_node} devices ({nodes} nodes of {per_node}, e.g. {across} across them)"
        )
    ctx = closest.tables.ctx
    # one MoE layer's expert GEMMs as the model's own code runs them (none where the expert pass runs them)
    layers = [] if ctx.experts_rewritten else search.structure.layers
    experts = max((graph_expert_activation_bytes(layer, ctx) for layer in layers), default=0.0)
    if experts > 0.25 * search.cap_bytes:
        hints.insert(
            0,
            f"the expert pass (--ep, or --expert-tp with --tp): on {mesh.label()} the model's own expert code "
            f"runs (no expert parallelism, experts whole) and one MoE layer's expert GEMMs hold "
            f"{experts / _GIB:.1f} GiB per micro-batch (an expert matrix gathered per token and choice)",
        )
    if search.workload.kind is Workload.TRAIN:
        # weights, gradients and Adam state of one rank in the closest candidate's data-parallel style
        # (sharded over its shard group under ZeRO / FSDP), before any activation: the hint quoted the
        # unsharded figure and advised the distributed optimizer to a candidate already sharded
        state = search.structure.num_params * ctx.bytes_per_element * ctx.state_factor() / (mesh.tp * mesh.pp)
        sharded = ctx.dp_style is not DataParallel.DDP and ctx.state_shards > 1
        if state > 0.5 * search.cap_bytes:
            zero = ""
            if mesh.dp_cp > 1 and not sharded:
                zero = ", or a sharded data-parallel style (--dp-style zero1 / fsdp)"
            hints.append(
                f"{_model_parallel_text(search)}{zero}: weights, gradients and Adam state alone take "
                f"{state / _GIB:.0f} GiB per device on {mesh.label()} ({ctx.dp_style}; a smaller batch would "
                "not help)"
            )
        else:
            longest = search.workload.seq_len >= MIN_CP_SEQ_LEN
            hints.append(
                "less activation memory per device: more micro-batches or a smaller batch"
                + (", more context parallelism (--cp)" if longest else "")
                + (
                    f", {_model_parallel_text(search)}"
                    if mesh.tp * mesh.pp < search.cluster.num_devices
                    else ""
                )
                + f" (weights, gradients and Adam state take {state / _GIB:.0f} GiB per device of it, {ctx.dp_style})"
            )
    elif search.workload.kind is Workload.DECODE:
        hints.append("a smaller batch or context (less KV cache)")
    else:
        hints.append("a smaller batch")
    return InfeasibleError(
        f"no plan fits memory: with {mesh.label()} (the mesh closest to fitting) "
        f"stage {worst} needs {need / _GIB:.1f} GiB, devices have {cap_gib:.1f} GiB "
        f"({search.cap_bytes / _GIB:.1f} GiB usable: plans use {search.constraints.memory_fraction:.0%} of a device's "
        "memory, docs/cluster-yaml.md); "
        f"would fit: {', or '.join(hints)}"
        + (f"; excluded from the search: {'; '.join(search.excluded)}" if search.excluded else "")
    )


def _model_parallel_text(search: _Search) -> str:
    """ "more tensor / pipeline parallelism", less what the pins rule out: tensor parallelism where --tp
    is pinned, pipeline parallelism where --pp is or no candidate has stages (a pinned interleaved
    schedule the batch cannot feed: `_exclude_short_interleaving`)."""
    c = search.constraints
    ways = ["tensor"] if c.tp is None else []
    if c.pp is None and any(cand.mesh.pp > 1 for cand in search.candidates):
        ways.append("pipeline")
    if ways:
        return f"more {' / '.join(ways)} parallelism"
    return "more tensor / pipeline parallelism than the pins allow (see the exclusions below)"


def _unit_does_not_fit(search: _Search) -> InfeasibleError | None:
    """With FSDP pinned (--dp-style fsdp / --dp-shard): the error when no candidate can hold even a
    wrapping unit's gathered parameters (`costing.fsdp_transient_bytes`: two layers' parameters and
    one layer's gradients per rank), naming the flags and the TP degree that would hold them."""
    c = search.constraints
    sharded = [cand for cand in search.candidates if cand.mesh.dp > 1]
    if c.dp_styles() != [DataParallel.FSDP] or not sharded:
        return None
    least = min(sharded, key=lambda cand: fsdp_transient_bytes(cand.tables.ctx))
    need = fsdp_transient_bytes(least.tables.ctx)
    if need <= search.cap_bytes:
        return None
    tp = least.mesh.tp
    fits = next((t for t in (2 * tp, 4 * tp, 8 * tp) if need * tp / t <= search.cap_bytes), None)
    what = f"--tp {fits} (the unit split over more ranks)" if fits else "more tensor parallelism"
    return InfeasibleError(
        f"--dp-style fsdp: the wrapping units gathered at once (two layers and the embedding / LM head unit, "
        f"with their gradients) "
        f"need {need / _GIB:.1f} GiB per rank at tp={tp}, more than the {search.cap_bytes / _GIB:.1f} GiB usable; "
        f"would fit: {what}"
    )


# ---------------------------------------------------------------------------------------------
# The Plan


def _make_plan(search: _Search, best: _Candidate | None, model_name: str) -> Plan:
    w = search.workload
    baseline = _baseline(search)
    titan = _torchtitan_baseline(search)
    if best is None:
        raise _infeasible(search)
    sol = best.solution
    assert sol is not None and sol.assignment is not None and best.latency_s is not None
    chosen = predict(best.tables, sol.assignment)
    decisions: list[Decision] = []
    for name, expert in (("megatron", baseline), ("torchtitan", titan)):
        if (
            expert is not None
            and expert.prediction.peak_memory_bytes <= search.cap_bytes
            and expert.prediction.latency_s < chosen.prediction.latency_s * (1 - 1e-9)
            and _allowed(search, expert.tables.ctx.mesh, expert.tables.ctx.config)
        ):
            options = {"search": best.latency_s, name: expert.prediction.latency_s}
            why = f"the search's plan ({sol.status}, gap {sol.gap:.3g}) is slower than {name}'s hand-written one"
            chosen = expert
            decisions.append(Decision("fallback", name, options, why))
    config, tables = chosen.tables.ctx.config, chosen.tables
    candidates = []
    listed: set[tuple] = set()  # one line per (mesh, micro-batches, layout): the fastest (sorted first)
    for c in sorted(search.candidates, key=lambda c: (c.latency_s is None, c.latency_s or 0.0)):
        key = (c.config.mesh, c.config.micro_batches, c.config.layout_label())
        if key not in listed:
            listed.add(key)
            candidates.append(
                MeshCandidate(c.config.mesh, c.config.micro_batches, c.latency_s, c.note, key[2])
            )
    decisions = (
        mesh_decision(candidates, config)
        + _baseline_decision(search, baseline)
        + _torchtitan_decision(search, titan)
        + decisions
    )
    if search.constraints.layout == "megatron":
        decisions.append(
            Decision(
                "layout",
                "megatron",
                {"megatron": chosen.prediction.latency_s},
                "pinned by --layout megatron: the hand-written Megatron-LM splits at the mesh's TP degree "
                "(column-parallel q/k/v/up/gate, row-parallel o/down, vocab-parallel embedding and LM head), "
                "not the solver's; each op's row below has that one option",
            )
        )
    decisions += training_decisions(
        chosen,
        search.cap_bytes,
        _alternative_tables(search),
        search.constraints,
        runs=lambda config: _style_runs(search, config.mesh, config.dp_style, config.ep),
    )
    decisions += overlap_decisions(chosen, search.cap_bytes, _alternative_tables(search), search.constraints)
    decisions += cp_decisions(
        chosen, search.cap_bytes, _alternative_tables(search), candidates,
        _cp_variants(search, config.mesh), _cp_refusals(search, config.mesh), search.constraints,
    )  # fmt: skip
    solved_ep: dict[str, float] = {}
    for cand in search.candidates:  # inf: candidates with it, none solved (pruned, or too big)
        label = cand.config.ep_label()
        latency = cand.latency_s if cand.latency_s is not None else math.inf
        solved_ep[label] = min(solved_ep.get(label, math.inf), latency)
    decisions += ep_decisions(
        chosen, search.cap_bytes, _alternative_tables(search), search.constraints, solved_ep
    )
    decisions += strategy_decisions(chosen)
    decisions += ladder_decision(chosen, search.ladder, search.constraints.ladder_min_saving_fraction)
    plan = _plan_of(search, chosen, model_name, SolverInfo(sol.status, sol.objective, sol.gap, search.solver_time_s, sol.num_variables))  # fmt: skip
    plan.decisions = decisions
    plan.excluded = list(dict.fromkeys(search.excluded + op_exclusions(tables.graphs, tables.ends)))
    plan.baseline = baseline.prediction if baseline is not None else None
    plan.baseline_layout = _layout_text(baseline, w) if baseline is not None else {}
    plan.torchtitan_baseline = titan.prediction if titan is not None else None
    plan.torchtitan_layout = _layout_text(titan, w) if titan is not None else {}
    plan.mesh_candidates = candidates
    return plan


def _plan_of(search: _Search, priced: PricedAssignment, model_name: str, solver: SolverInfo) -> Plan:
    """The Plan of one priced assignment (its mesh, splits, stages, ladder, schedule, recompute and
    prediction), without decisions or a baseline."""
    s, w = search.structure, search.workload
    config, tables, assignment = priced.tables.ctx.config, priced.tables, priced.assignment
    return Plan(
        model=model_name,
        cluster=search.cluster.name,
        workload=w.kind,
        batch_size=w.batch_size,
        seq_len=w.seq_len,
        context=w.context,
        micro_batches=config.micro_batches,
        dtype=search.dtype,
        mesh=config.mesh,
        splits=_splits(tables, assignment),
        stages=_rank_stages(assignment.stages, config.mesh.pp) if s.layers else [[]],
        ladder_layers=assignment.ladder_layers,
        predicted=priced.prediction,
        solver=solver,
        schedule=config.schedule,
        virtual_stages=config.virtual_stages,
        sequence_parallel=tables.ctx.sequence_parallel,
        recompute=dict(assignment.recompute) if w.train else {},
        dp_style=tables.ctx.dp_style,
        dp_shard=tables.ctx.shard_degree,
        reshard_after_forward=tables.ctx.reshard_after_forward
        or tables.ctx.dp_style is not DataParallel.FSDP,
        tp_comm_overlap=tables.ctx.tp_comm_overlap,
        overlap_grad_reduce=tables.ctx.overlap_grad_reduce,
        overlap_param_gather=tables.ctx.overlap_param_gather,
        cp_comm_type=config.cp_comm_type if config.mesh.cp > 1 else "allgather",
        cp_load_balance=config.cp_load_balance if config.mesh.cp > 1 else True,
        ep=config.ep,
        ep_fold=config.ep_fold if config.ep > 1 else "dp",
        expert_tp=config.expert_tp,
        moe_imbalance=w.moe_imbalance,
        moe_capacity_factor=w.moe_capacity_factor,
        # fp32 gradients of fp32 parameters are the parameters' own: recorded as "param"
        grad_reduce_dtype=w.grad_reduce_dtype
        if w.train and tables.ctx.dtype in ("bf16", "fp16")
        else "param",
        loss_scale=w.plan_loss_scale(tables.ctx.dtype),
        num_experts=experts[0] if len(experts := expert_counts(s)) == 1 else 0,
        expert_params=sum(layer.moe.expert_params for layer in s.layers if layer.moe is not None),
        moe_top_k=agreed((layer.moe.top_k for layer in s.layers if layer.moe), 0),
        moe_score_function=agreed((layer.moe.score_function.function for layer in s.layers if layer.moe), ""),
        moe_topk_renormalised=agreed((layer.moe.renormalised for layer in s.layers if layer.moe), None),
        moe_expert_intermediate_size=agreed(
            (layer.moe.expert_intermediate_size for layer in s.layers if layer.moe), 0
        ),
        moe_shared_intermediate_size=agreed(
            (layer.moe.shared_intermediate_size for layer in s.layers if layer.moe), None
        ),
        moe_shared_expert_gate=agreed(
            (layer.moe.shared_expert_gate for layer in s.layers if layer.moe), None
        ),
        moe_probs_on_input=agreed(
            (layer.moe.input_scale is not None for layer in s.layers if layer.moe), None
        ),
        moe_layers=moe_layer_pattern(s),
        token_model=s.token_model,
        unpriced_ops=s.unknown_ops,
        model_params=int(s.num_params),
        roles=projection_roles(s),
        adapters=adapter_weights(s),
        frozen_params=int(s.num_frozen_params),
    )


def moe_layer_pattern(structure: ModelStructure) -> list[int]:
    """`Plan.moe_layers`: 1 for each mixture-of-experts layer, 0 for each other, when the model has both;
    [] otherwise."""
    pattern = [int(layer.moe is not None) for layer in structure.layers]
    return pattern if 0 < sum(pattern) < len(pattern) else []


def adapter_weights(structure: ModelStructure) -> dict[str, str]:
    """Each LoRA adapter weight's FQN -> the weight of the projection it adapts (`Plan.adapters`)."""
    projections = [p for layer in structure.layers for p in layer_projection_ops(layer).values()]
    projections += [*structure.mlp_chain, *([structure.lm_head] if structure.lm_head is not None else [])]
    return {
        q.weight: p.weight
        for p in projections
        if p.adapter is not None
        for q in (p.adapter.down, p.adapter.up)
    }


def projection_roles(structure: ModelStructure) -> dict[str, str]:
    """Weight FQN -> `Role` value of every projection of the model (`Plan.roles`), routers and
    mixture-of-experts expert weights included ("expert_gate_up", ...)."""
    projections = [p for layer in structure.layers for p in layer_projection_ops(layer).values()]
    projections += [p for layer in structure.layers for p in layer.kept_whole]
    projections += list(structure.mlp_chain)
    if structure.lm_head is not None:
        projections.append(structure.lm_head)
    roles = {p.weight: str(p.role) for p in projections}
    for layer in structure.layers:  # routed experts: every stacked tensor, or every expert's own weight
        for weight in layer.moe.experts if layer.moe is not None else []:
            roles.update(dict.fromkeys(weight.weights, str(weight.role)))
    return roles


def megatron_plan(
    structure: ModelStructure,
    cluster: ClusterSpec,
    workload: WorkloadSpec,
    constraints: Constraints,
    *,
    model_name: str = "model",
) -> Plan | None:
    """The hand-written Megatron-LM plan that `plan_model` compares its plan with (`Plan.baseline`), as
    a Plan of its own, so that it can be lowered like one (`passes.verify.verify_plan` prices the
    all-gathers the TP pass adds to it); None when no Megatron layout applies. Solver fields: status
    "megatron", no ILP. Raises InputError as `plan_model`."""
    search = _setup(structure, cluster, workload, constraints)
    baseline = _baseline(search)
    if baseline is None:
        return None
    return _plan_of(
        search, baseline, model_name, SolverInfo("megatron", baseline.prediction.latency_s, 0.0, 0.0, 0)
    )


def baseline_layouts(
    structure: ModelStructure, cluster: ClusterSpec, workload: WorkloadSpec, constraints: Constraints
) -> tuple[tuple[Plan, dict[str, str]] | None, tuple[Prediction, dict[str, str]] | None]:
    """The hand-written layouts `plan_model` sets beside its plan, priced for this job, from one search
    set-up: (Megatron-LM's plan as `megatron_plan` makes it, torchtitan's recipe's prediction), each
    with its layout as the plan records it (`Plan.baseline_layout` / `Plan.torchtitan_layout`), None
    where it does not apply (torchtitan: training only). What `planner run` prices again for a plan
    edited after planning. Raises InputError as `plan_model`."""
    search = _setup(structure, cluster, workload, constraints)
    w = search.workload
    megatron = _baseline(search)
    titan = _torchtitan_baseline(search) if w.train else None
    expert = None
    if megatron is not None:
        info = SolverInfo("megatron", megatron.prediction.latency_s, 0.0, 0.0, 0)
        expert = (_plan_of(search, megatron, "model", info), _layout_text(megatron, w))
    return expert, ((titan.prediction, _layout_text(titan, w)) if titan is not None else None)


def _rank_stages(chunks: list[list[int]], pp: int) -> list[list[int]]:
    """`Plan.stages` from the solver's stages: the same with one chunk per rank; with interleaving
    (pp * v model chunks, chunk c on rank c mod pp) each rank's layers, its v runs in order."""
    return [sorted(i for chunk in chunks[rank::pp] for i in chunk) for rank in range(pp)]


def _allowed(search: _Search, mesh: MeshShape, config: MeshConfig | None = None) -> bool:
    """Whether the user's constraints admit `mesh` (pinned degrees, device limit) and a plan without
    ladder, and `config`'s pipeline schedule, sequence parallelism, distributed optimizer and
    micro-batches."""
    c = search.constraints
    pinned_ok = all(getattr(mesh, k) == v for k, v in c.pinned.items())
    devices_ok = mesh.num_devices <= (c.max_devices or search.cluster.num_devices)
    if config is not None:
        pinned_ok = pinned_ok and c.sequence_parallel in (None, config.sequence_parallel)
        pinned_ok = pinned_ok and (not search.workload.train or mesh.dp_cp == 1 or _dp_pins_hold(c, config))
        pinned_ok = pinned_ok and _style_runs(search, mesh, config.dp_style, config.ep)
        pinned_ok = pinned_ok and c.ep in (None, config.ep) and c.ep_fold in (None, config.ep_fold)
        pinned_ok = pinned_ok and c.expert_tp in (None, config.expert_tp)
        pinned_ok = pinned_ok and c.virtual_stages in (None, config.virtual_stages)
        pinned_ok = pinned_ok and all(
            pin is None or pin == on
            for pin, on in (
                (c.tp_comm_overlap, config.tp_comm_overlap and mesh.tp > 1),
                (c.overlap_grad_reduce, config.overlap_grad_reduce),
                (c.overlap_param_gather, config.overlap_param_gather),
            )
        )
        pinned_ok = pinned_ok and c.recompute is None
        pinned_ok = pinned_ok and (
            mesh.cp == 1
            or c.cp_comm_type in (None, config.cp_comm_type)
            and c.cp_load_balance in (None, config.cp_load_balance)
        )
        # a pinned --micro-batches (the baseline picks its own: `megatron_micro_batches`)
        pinned_ok = pinned_ok and search.workload.micro_batches in (None, config.micro_batches)
    return pinned_ok and devices_ok and search.ladder.mode is not LadderMode.UPPER


def _dp_pins_hold(c: Constraints, config: MeshConfig) -> bool:
    """`config`'s data-parallel style is one the constraints allow, with the pinned shard degree and
    reshard policy (--dp-style, --dp-shard, --reshard-after-forward, --distributed-optimizer)."""
    fsdp = config.dp_style is DataParallel.FSDP
    return (
        config.dp_style in c.dp_styles()
        and (c.dp_shard is None or config.shard_degree == c.dp_shard)
        and (
            c.reshard_after_forward is None
            or not fsdp
            or config.reshard_after_forward == c.reshard_after_forward
        )
    )


def _alternative_tables(search: _Search):
    """Price `structure` on another `MeshConfig` (for the decisions' alternatives)."""

    def price_config(config: MeshConfig) -> CostTables:
        return _price(search, config).tables

    return price_config


def _baseline(search: _Search) -> PricedAssignment | None:
    """The plan a Megatron-LM user writes by hand (`megatron_configs`), priced: the first of its meshes
    that fits memory (at micro-batch size 2, then 1, if needed: `megatron_micro_batch_variants`) with
    selective recomputation, else the first with full recomputation; for a sequence longer than `MEGATRON_CP_TOKENS_PER_RANK` its
    meshes with context parallelism at the expert's degree first (`megatron_cp_degree`), and any other
    degree where no mesh fits (`megatron_cp_configs`); else the last cp = 1 one tried. It is the
    expert's layout whatever the user pinned (schedule, sequence parallelism, recompute): a pin that
    costs time shows as a plan slower than it. Only the device cap is shared with the search."""
    configs = megatron_configs(
        search.cluster, search.workload, search.structure, search.constraints.max_devices
    )
    chosen = None
    train, num_layers = search.workload.train, len(search.structure.layers)
    # context parallelism (ring, Megatron-LM's default) at the expert's degree for a long sequence first
    # (`megatron_cp_degree`), then cp = 1, then any other degree if nothing fits
    expert_cp = megatron_cp_degree(search.workload.seq_len)
    others = tuple(cp for cp in MEGATRON_CP_DEGREES if cp != expert_cp)
    devices = min(search.cluster.num_devices, search.constraints.max_devices or search.cluster.num_devices)
    order = megatron_cp_configs(configs, num_layers, search.workload, (expert_cp,), devices) + configs
    order += megatron_cp_configs(configs, num_layers, search.workload, others, devices)
    last_plain = None
    # every mesh (more stages, wider TP) and smaller micro-batches with selective recomputation before
    # any with full: full recomputation costs a third more compute, which an expert spends last (the
    # 405B was priced at TP8 PP4 with full recomputation where PP8 fits with selective)
    for recompute in (Recompute.SELECTIVE, Recompute.FULL) if train else (Recompute.NONE,):
        for config in _whole_batch_configs(search, order):
            variants = _whole_batch_configs(
                search, megatron_micro_batch_variants(config, num_layers, search.workload)
            )
            for variant in map(ep_within, variants):  # smaller micro-batches before another mesh
                chosen = baseline_plan(_price(search, variant).tables, recompute=recompute)
                if chosen.prediction.peak_memory_bytes <= search.cap_bytes:
                    return chosen
                if config.mesh.cp == 1:
                    last_plain = chosen
    return last_plain or chosen


def _whole_batch_configs(search: _Search, configs: list[MeshConfig]) -> list[MeshConfig]:
    """`configs` as a hand-written layout can run a model whose batch cannot be split (its outputs mix
    the samples, BatchNorm in training, a batched keyword tensor: `ModelStructure.batch_mixing`): one
    replica and one micro-batch (the search keeps the same; a baseline at DP 2 was priced for a model
    that cannot use it, "this plan is 0.28x its speed"); unchanged otherwise."""
    if not (search.structure.batch_mixing or _batch_statistics(search)):
        return configs
    out: list[MeshConfig] = []
    for c in configs:
        # one replica: no data-parallel ranks for expert parallelism to fold over either
        whole = ep_within(dataclasses.replace(c, mesh=dataclasses.replace(c.mesh, dp=1), micro_batches=1))
        if whole.mesh.dp == c.mesh.dp and c.micro_batches == 1:
            whole = c
        elif whole.mesh.pp > 1:  # one micro-batch through the stages: GPipe's order (1F1B needs m >= pp)
            whole = dataclasses.replace(whole, schedule=Schedule.GPIPE, virtual_stages=1)
        if whole not in out:
            out.append(whole)
    return out


def _torchtitan_baseline(search: _Search) -> PricedAssignment | None:
    """The training plan a torchtitan user writes by hand (`torchtitan_configs`: FSDP, TP 8 for large
    models, PP when needed), priced with Megatron's splits (torchtitan's TP plan is the same
    column-then-row pairing): the first that fits memory, else the last one tried; None without
    training."""
    chosen = None
    c = search.constraints
    context_parallel = not _cp_refusal(search)
    recipes = torchtitan_configs(
        search.cluster, search.workload, search.structure, c.max_devices, context_parallel
    )
    for config, recompute in ((_whole_batch_configs(search, [cfg])[0], r) for cfg, r in recipes):
        chosen = baseline_plan(_price(search, config).tables, recompute=recompute)
        if chosen.prediction.peak_memory_bytes <= search.cap_bytes:
            return chosen
    return chosen


def _layout_text(priced: PricedAssignment, w: WorkloadSpec) -> dict[str, str]:
    """A priced plan's layout as text, the keys of `Plan.layout_summary`."""
    config = priced.tables.ctx.config
    ctx = priced.tables.ctx
    mesh = config.mesh
    recompute = {key: str(r) for key, r in priced.assignment.recompute.items()} if w.train else {}
    return {
        "tp": str(mesh.tp), "cp": str(mesh.cp), "pp": str(mesh.pp), "dp": str(mesh.dp),
        "micro_batches": str(config.micro_batches),
        "micro_batch_size": f"{w.batch_size / (mesh.dp * config.micro_batches):g}",
        "schedule": str(config.schedule), "virtual_stages": str(config.virtual_stages),
        "sequence_parallel": str(ctx.sequence_parallel).lower(),
        "recompute": "/".join(sorted(set(recompute.values()))) or "none",
        "distributed_optimizer": str(ctx.distributed_optimizer).lower(),
        "dp_style": dp_style_text(ctx.dp_style, mesh.dp, ctx.shard_degree, ctx.reshard_after_forward),
        "overlap": overlap_text(ctx.tp_comm_overlap, ctx.overlap_grad_reduce, ctx.overlap_param_gather),
        "context_parallel": cp_text(mesh.cp, config.cp_comm_type, config.cp_load_balance),
        **({"expert_parallel": config.ep_label()} if expert_counts(ctx.structure) else {}),
    }  # fmt: skip


def _torchtitan_decision(search: _Search, titan: PricedAssignment | None) -> list[Decision]:
    """The torchtitan recipe's step beside the plan's (training only)."""
    if titan is None:
        return []
    t, ctx = titan.prediction, titan.tables.ctx
    recompute = "/".join(sorted({str(r) for r in titan.assignment.recompute.values()})) or "none"
    cp = f"context parallel {ctx.mesh.cp} (FSDP over its ranks), " if ctx.mesh.cp > 1 else ""
    reason = (
        f"torchtitan's Llama 3 recipe ({ctx.config.dp_label() if ctx.mesh.dp > 1 else 'no DP'}, {cp}"
        f"sequence parallel {'on' if ctx.sequence_parallel else 'off'}, activation checkpointing {recompute}, "
        f"{ctx.micro_batches} micro-batch(es)); "
        + memory_fit_text(t.peak_memory_bytes, search.cap_bytes, search.cluster.device.memory_bytes)
    )
    return [Decision("torchtitan-baseline", ctx.mesh.label(), {"latency": t.latency_s}, reason)]


def _baseline_decision(search: _Search, baseline: PricedAssignment | None) -> list[Decision]:
    if baseline is None:
        return []
    b, config = baseline.prediction, baseline.tables.ctx.config
    extras = ""
    if search.workload.train:
        recompute = sorted({str(r) for r in baseline.assignment.recompute.values()}) or ["none"]
        extras = (
            f", {config.schedule} schedule"
            + (f" v={config.virtual_stages}" if config.virtual_stages > 1 else "")
            + f", sequence parallel {'on' if config.sequence_parallel else 'off'}, recompute {'/'.join(recompute)}"
            + f", data parallel {baseline.tables.ctx.config.dp_label() if config.mesh.dp > 1 else 'none'}"
            + (f", context parallel {config.cp_label().removeprefix('cp ')}" if config.mesh.cp > 1 else "")
        )
    mbs = f"{config.micro_batches} micro-batch" + ("es" if config.micro_batches > 1 else "")
    device = search.cluster.device.memory_bytes
    reason = f"hand-written Megatron layout ({mbs}{extras}); " + memory_fit_text(
        b.peak_memory_bytes, search.cap_bytes, device
    )
    return [Decision("megatron-baseline", config.mesh.label(), {"latency": b.latency_s}, reason)]


def _mark_replicated_neighbours(
    splits: dict[str, WeightSplit],
    graph: LayerGraph,
    key: str,
    projections: dict[str, Projection],
    assignment: Assignment,
) -> None:
    """Mark the splits of `graph`'s projections whose neighbour op (not a projection) runs replicated
    under `assignment`: a column-parallel projection read by one (`WeightSplit.gather_output`: the
    rewrite all-gathers its output, as the plan prices) and a row-parallel one fed by one
    (`WeightSplit.replicated_input`: each rank slices it), e.g. a norm or an index over the full width
    between an MLP's two linears. Exports that pair Colwise / RowwiseParallel read them."""
    for op in graph.ops:
        if op.name in projections or assignment.option(key, op.name) != "replicate":
            continue
        for name in op.inputs:
            proj = projections.get(name)
            if proj is not None and splits[proj.weight].style is SplitStyle.COLWISE:
                splits[proj.weight].gather_output = True
        for consumer in graph.ops:
            proj = projections.get(consumer.name)
            if (
                proj is not None
                and op.name in consumer.inputs
                and splits[proj.weight].style is SplitStyle.ROWWISE
            ):
                splits[proj.weight].replicated_input = True


def _splits(tables: CostTables, assignment: Assignment) -> dict[str, WeightSplit]:
    """WeightSplit per weight FQN: colwise splits the output dim, rowwise the input dim."""
    structure = tables.ctx.structure
    splits: dict[str, WeightSplit] = {}

    def add(proj, option: str, pieces: int | None = None) -> None:
        style = SplitStyle(option)
        out_dim = proj.weight_out_dim
        if style in (SplitStyle.COLWISE, SplitStyle.VOCAB):
            dim = out_dim
        elif style is SplitStyle.ROWWISE:
            dim = 1 - out_dim
        else:
            dim = 0
        parts = list(proj.parts) if proj.parts and style is SplitStyle.COLWISE else None
        pieces = pieces if style is SplitStyle.COLWISE else None
        splits[proj.weight] = WeightSplit(proj.weight, style, dim, parts, pieces)
        if proj.adapter is not None:  # a LoRA adapter follows its projection (`Adapter.splits`)
            down, up = proj.adapter.splits(option)
            add(proj.adapter.down, down)
            add(dataclasses.replace(proj.adapter.up, parts=proj.parts), up, pieces)

    if structure.layers:
        for layer, key in zip(structure.layers, tables.layer_keys):
            projections = layer_projection_ops(layer)
            for name, proj in projections.items():
                attn = layer.cross_attention if name.startswith("cross.") else layer.attention
                grouped = (
                    attn is not None and not tables.ctx.train and gqa_kv_replicated(attn, tables.ctx.mesh.tp)
                )
                kv = grouped and proj.role in (Role.K, Role.V)
                add(proj, assignment.option(key, name), attn.num_kv_heads if kv else None)
            _mark_replicated_neighbours(splits, tables.graphs[key], key, projections, assignment)
    else:
        projections = mlp_op_names(structure.mlp_chain)
        for name, proj in projections.items():
            add(proj, assignment.option("chain", name))
        _mark_replicated_neighbours(splits, tables.graphs["chain"], "chain", projections, assignment)
    for i, emb in enumerate(structure.embeddings):
        vocab = assignment.option("ends", f"embedding{i}") == SplitStyle.VOCAB
        splits[emb.weight] = WeightSplit(
            emb.weight, SplitStyle.VOCAB if vocab else SplitStyle.REPLICATE, 0, None
        )
    if structure.lm_head is not None and structure.lm_head.weight not in splits:
        add(structure.lm_head, assignment.option("ends", "lm_head"))
    return splits

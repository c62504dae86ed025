"""Pricing a serving request with a plan: the prefill graph and the decode graph, node by node.

    price_request(plan, prefill_structure, cluster, prompt_len, new_tokens, cache_len) -> Serving

A plan of a model with a KV cache is solved on its decode step (`--workload decode|generate`: the
step a request repeats, captured as its own graph with the cache in it). The same weight splits then
serve the prefill; this module prices the prefill's own graph with the plan's choices (same mesh,
same option of every op, same ladder layers) and combines the two into what serving benchmarks
report: time to first token, time per output token and tokens/s over the whole request.
"""

from __future__ import annotations

from costmodels.cluster import ClusterSpec, cluster_for_ranks
from planner.errors import InputError
from planner.frontend.analysis import ModelStructure
from planner.plan import Layout, Plan, Prediction, Serving, Workload, check_new_tokens
from planner.solver.costing import (
    CostContext,
    CostTables,
    LayerGraph,
    Op,
    build_cost_tables,
    gqa_kv_replicated,
)
from planner.solver.prediction import predict
from planner.solver.problem import Assignment, MeshConfig, WorkloadSpec, plan_workload_options


def plan_assignment(plan: Plan, tables: CostTables) -> Assignment:
    """The plan's choice of every op (from `plan.predicted.per_layer`) on `tables`' op graphs.

    Raises InputError when the plan's layers or ops do not match the tables' (another model)."""
    per_layer = [c for c in plan.predicted.per_layer if c.layer >= 0]
    ends = next((c for c in plan.predicted.per_layer if c.layer < 0), None)
    if len(per_layer) != len(tables.layer_keys) or ends is None:
        raise InputError(
            f"the plan has {len(per_layer)} layers, the model's graph {len(tables.layer_keys)}: re-plan it"
        )
    choices: dict[tuple[str, str], str] = {}
    chosen_by: dict[tuple[str, str], int] = {}  # the first layer that set each choice
    for cost, key in zip(per_layer, tables.layer_keys):
        for op in tables.graphs[key].ops:
            if op.name not in cost.strategy:
                raise InputError(
                    f"the plan gives no option for op {op.name!r} of layer {cost.layer}: re-plan it"
                )
            own = _layer_weight(tables, key, op.weight, cost.layer)
            choice = _split_choice(plan, op, cost.strategy[op.name], cost.layer, own)
            first = chosen_by.setdefault((key, op.name), cost.layer)
            if op.weight is not None and first != cost.layer and choices[(key, op.name)] != choice:
                raise InputError(
                    f"field 'splits': the {op.name!r} projection is {choices[(key, op.name)]} in layer {first} "
                    f"and {choice} in layer {cost.layer}, two layers of one shape, which the cost model prices "
                    "with one choice: a split edited by hand must be the same in every layer of that shape "
                    "(edit it in all of them, or plan again)"
                )
            choices[(key, op.name)] = choice
        if any(choices[(key, n)] != c for n, c in cost.strategy.items() if (key, n) in choices):
            _follow_layouts(tables.graphs[key], key, choices)  # a split edited by hand
    for op in tables.ends.ops:
        choices[("ends", op.name)] = _split_choice(plan, op, ends.strategy[op.name], -1)
    stages = [list(s) for s in plan.stages]
    if not any(stages):  # a chain of linears (no transformer layers): its graph is layer 0, pp = 1
        stages = [list(range(len(tables.layer_keys)))]
    return Assignment(choices, stages, list(plan.ladder_layers))


# a weight's split style (`Plan.splits`) -> the op options that apply it
_STYLE_OPTION = {
    "colwise": ("colwise", "vocab"),
    "vocab": ("vocab", "colwise"),
    "rowwise": ("rowwise",),
    "replicate": ("replicate",),
}


def _layer_weight(tables: CostTables, key: str, weight: str | None, layer: int) -> str | None:
    """Layer ``layer``'s own parameter for the op whose class graph (``key``, priced on the class's
    first layer) holds ``weight``: the same name under the layer's module path."""
    if weight is None:
        return None
    layers = tables.ctx.structure.layers
    first = tables.layer_keys.index(key)
    if layer >= len(layers) or first >= len(layers):
        return weight
    prefix, mine = f"{layers[first].module_path}.", f"{layers[layer].module_path}."
    return mine + weight[len(prefix) :] if weight.startswith(prefix) else weight


def _split_choice(plan: Plan, op: Op, recorded: str, layer: int, weight: str | None = None) -> str:
    """The option of a weighted op (projection, embedding, LM head) that the plan's split of its weight
    (``weight``: this layer's own, else the op's) says (`Plan.splits`, what the passes apply; a hand
    edit changes it), else the ``recorded`` one. Raises InputError when the split is not one of the
    op's options (e.g. colwise on a weight whose rows do not divide by tp)."""
    weight = weight or op.weight
    split = plan.splits.get(weight) if weight else None
    if split is None:
        return recorded
    names = {o.name for o in op.options}
    applying = _STYLE_OPTION.get(str(split.style), ())
    if recorded in applying and recorded in names:
        return recorded
    for name in applying:
        if name in names:
            return name
    why = op.excluded.get(str(split.style)) or f"options {sorted(names)}"
    where = f"layer {layer}" if layer >= 0 else "the model's ends"
    raise InputError(
        f"field 'splits': the plan splits {weight} {split.style}, which op {op.name!r} of {where} cannot run "
        f"at tp={plan.tp}: {why}; edit field 'mesh' or 'splits' to agree, or plan again"
    )


def _follow_layouts(graph: LayerGraph, key: str, choices: dict[tuple[str, str], str]) -> None:
    """Give each weightless op (activation, attention core) the option whose input layout is its
    producer's output layout, as the passes run it after the projections' splits; the recorded choice
    where it matches, or where no option does."""
    produced: dict[str, Layout] = {"": Layout.REPLICATE}
    for op in graph.ops:
        chosen = op.option(choices[(key, op.name)])
        source = produced.get(op.inputs[0]) if op.inputs else None
        if op.weight is None and source is not None and chosen.in_layout != source:
            match = next((o for o in op.options if o.in_layout == source), None)
            if match is not None:
                chosen = match
                choices[(key, op.name)] = match.name
        produced[op.name] = chosen.out_layout


def kv_fallbacks(plan: Plan, structure: ModelStructure) -> list[str]:
    """What the rewrite of `plan` replicates in head-parallel attention, by layer range: K/V heads of
    GQA layers with fewer KV heads than tp, each on tp / kv ranks (priced so by
    `costing.gqa_kv_replicated`)."""
    layers = [
        c.layer
        for c in plan.predicted.per_layer
        if c.layer >= 0
        and c.strategy.get("core") == "head"
        and structure.layers[c.layer].attention is not None
        and gqa_kv_replicated(structure.layers[c.layer].attention, plan.tp)
    ]
    if not layers:
        return []
    kv = structure.layers[layers[0]].attention.num_kv_heads
    return [
        f"layers {layers[0]}-{layers[-1]}: {kv} KV heads < tp={plan.tp}: each rank holds one KV head (its K/V "
        f"projection rows and KV cache), each head replicated on {plan.tp // kv} ranks as vLLM does (priced)"
    ]


def predict_with_plan(
    plan: Plan, structure: ModelStructure, cluster: ClusterSpec, workload: WorkloadSpec, ladder: list[int]
) -> float:
    """Predicted step latency (seconds) of `structure` (a phase's graph) under `workload` with the plan's
    mesh, schedule, layout (virtual stages, sequence parallelism, distributed optimizer, recompute,
    context-parallel variant) and op choices, and `ladder` as the laddered layers: the plan re-priced,
    e.g. on another `cluster`."""
    return plan_prediction(plan, structure, cluster, workload, ladder).latency_s


def plan_prediction(
    plan: Plan, structure: ModelStructure, cluster: ClusterSpec, workload: WorkloadSpec, ladder: list[int]
) -> Prediction:
    """The whole `Prediction` (per layer, per stage, memory) of `predict_with_plan`."""
    config = MeshConfig(
        plan.mesh,
        plan.micro_batches,
        plan.schedule,
        plan.virtual_stages,
        plan.sequence_parallel,
        plan.dp_style,
        None if plan.dp_shard == plan.dp else plan.dp_shard,
        plan.reshard_after_forward,
        plan.tp_comm_overlap,
        plan.overlap_grad_reduce,
        plan.overlap_param_gather,
        plan.cp_comm_type,
        plan.cp_load_balance,
        plan.ep,
        plan.ep_fold,
        plan.expert_tp,
    )
    cluster = cluster_for_ranks(cluster, plan.mesh.num_devices)  # time-shared only by ranks that run
    tables = build_cost_tables(CostContext(structure, cluster, workload, config, plan.dtype))
    assignment = plan_assignment(plan, tables)
    assignment.ladder_layers = list(ladder)
    assignment.recompute = dict(plan.recompute) if workload.train else {}
    return predict(tables, assignment).prediction


def price_request(
    plan: Plan,
    prefill: ModelStructure,
    decode: ModelStructure,
    cluster: ClusterSpec,
    *,
    prompt_len: int,
    new_tokens: int,
    cache_len: int,
    fallbacks: list[str] | None = None,
    trained_positions: int | None = None,
) -> Serving:
    """The request `plan` serves: its decode step (`plan.predicted`, solved on `decode`'s graph) and
    the prefill of `prompt_len` tokens (`prefill`: that phase's analysed graph) priced with the plan's
    choices. With ladder layers, also the decode step of the same splits without ladder.

    tokens/s = batch x new_tokens / (TTFT + (new_tokens - 1) x TPOT): the prefill yields the first
    token, each decode step one more. Raises InputError when a graph does not match the plan."""
    check_new_tokens(new_tokens)
    prefill_wl = WorkloadSpec(
        Workload.FORWARD, plan.batch_size, prompt_len, dtype=plan.dtype, **plan_workload_options(plan)
    )
    prefill_prediction = plan_prediction(plan, prefill, cluster, prefill_wl, plan.ladder_layers)
    ttft_s = prefill_prediction.latency_s
    tpot_s = plan.predicted.latency_s
    standard_s = None
    if plan.ladder_layers:
        decode_wl = WorkloadSpec(
            Workload.DECODE,
            plan.batch_size,
            1,
            context=prompt_len,
            dtype=plan.dtype,
            **plan_workload_options(plan),
        )
        standard_s = predict_with_plan(plan, decode, cluster, decode_wl, [])
    request_s = ttft_s + (new_tokens - 1) * tpot_s
    return Serving(
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        cache_len=cache_len,
        ttft_s=ttft_s,
        tpot_s=tpot_s,
        tokens_per_s=plan.batch_size * new_tokens / request_s,
        fallbacks=list(fallbacks or []),
        standard_tpot_s=standard_s,
        prefill_peak_memory_bytes=prefill_prediction.peak_memory_bytes,
        trained_positions=trained_positions,
    )

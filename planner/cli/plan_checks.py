"""Checks of a saved plan that need neither its model nor torch: its fields (`check_plan_fields`) and
what a user should know before using it (`plan_warnings`). `planner show` and `planner export` read
plans with these alone, so they start without importing torch."""

from __future__ import annotations

from costmodels.cluster import ClusterSpec
from planner.errors import InputError
from planner.plan import Plan


def check_plan_fields(plan: Plan, num_layers: int | None = None, cluster: ClusterSpec | None = None) -> None:
    """The checks of a saved (possibly hand-edited) plan that need no model: `stages` list the layers
    0..num_layers-1 once each, in order (num_layers None: the plan's own per-layer rows), one stage per
    pipeline rank, the batch splits into dp replicas of the micro-batches, and the mesh fits `cluster`.
    Raises InputError naming the plan field."""
    if num_layers is None:  # a chain of linears (no transformer layers) has one row, layer 0, and stages [[]]
        chain = plan.pp == 1 and not any(plan.stages)
        num_layers = 0 if chain else len({c.layer for c in plan.predicted.per_layer if c.layer >= 0})
    layers = [i for stage in plan.virtual_stage_layers() for i in stage]  # = stages unless interleaved
    if num_layers and layers != list(range(num_layers)):
        order = " (chunk c of rank r taken as virtual stage c * pp + r)" if plan.virtual_stages > 1 else ""
        raise InputError(
            f"plan field stages: {plan.stages} must list the layers 0..{num_layers - 1} once each, "
            f"in order{order}"
        )
    if len(plan.stages) != plan.pp:
        raise InputError(f"plan field stages: {len(plan.stages)} stages but pp is {plan.pp}")
    if plan.batch_size % plan.dp or (plan.batch_size // plan.dp) % max(1, plan.micro_batches):
        raise InputError(
            f"plan fields batch_size/dp/micro_batches: batch {plan.batch_size} does not split into dp={plan.dp} "
            f"replicas of {plan.micro_batches} micro-batches"
        )
    if cluster is not None and plan.num_devices > cluster.num_devices:
        raise InputError(
            f"plan field mesh: tp={plan.tp} x pp={plan.pp} x dp={plan.dp} = {plan.num_devices} devices, but "
            f"{cluster.devices_text()}; re-plan, or pin degrees whose product fits"
        )


def plan_warnings(plan: Plan, quality_measured: bool = False) -> list[str]:
    """What a user should know about a plan before using it: ladder residual at TP=1, or on layers the
    plan keeps replicated (it changes the model's outputs and overlaps nothing), or, unless its cost in
    quality was measured for the plan (`quality_measured`: `--data` with a loss budget), that ladder
    residual changes the model's function at all."""
    warnings = []
    sv = plan.serving
    if sv is not None and sv.trained_positions and sv.cache_len > sv.trained_positions:
        warnings.append(
            f"the request holds {sv.cache_len} tokens (prompt {sv.prompt_len} + {sv.new_tokens} new tokens), past "
            f"the {sv.trained_positions} positions the model's config gives its context: the positions beyond are "
            "outside what it was trained on, and vLLM refuses a --max-model-len above it"
        )
    if plan.ladder_layers and plan.tp == 1:
        warnings.append(
            f"ladder residual on {len(plan.ladder_layers)} layer(s) at TP=1: it changes the model's outputs (each "
            "laddered layer reads the residual stream one block late) and gains nothing, since it only hides "
            "tensor-parallel all-reduces and a TP=1 plan has none. Use --ladder none, or plan with --tp 2 or more"
        )
    elif plan.ladder_layers:
        laddered = set(plan.ladder_layers)
        rows = [c for c in plan.predicted.per_layer if c.layer in laddered]
        if rows and all(c.exposed_comm_s == 0 and c.overlapped_comm_s == 0 for c in rows):
            warnings.append(
                f"ladder residual on {len(plan.ladder_layers)} layer(s), but the plan keeps those layers' weights "
                f"replicated at TP={plan.tp}: they issue no all-reduce for the ladder to hide, so it changes the "
                "model's outputs (each laddered layer reads the residual stream one block late) and gains nothing. "
                "Use --ladder none, or a model or batch large enough that splitting pays"
            )
        elif not quality_measured:
            warnings.append(
                f"ladder residual on {len(plan.ladder_layers)} layer(s) changes the model's function (each laddered "
                "layer reads the residual stream one block late): a checkpoint trained without it computes other "
                "outputs, and loses quality unless trained or adapted with it. Measure the loss it costs with "
                "planner ladder-eval MODEL.py --data TEXT --weights CKPT, or let the planner bound it with "
                "--ladder auto:max-loss-increase=1% --data TEXT --weights CKPT"
            )
    return warnings

"""Terminal rendering of plans and runs with rich: the mesh, per-stage/per-layer costs, baseline, runs."""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from planner.plan import (
    BASELINE_OTHER_SPLITS,
    BASELINE_WOULD_NOT_RUN,
    Decision,
    Fallback,
    LayerCost,
    Plan,
    Prediction,
    SplitStyle,
    Workload,
    fallback_memory_bytes,
    layer_ranges,
    loss_scale_text,
    overlap_text,
)

_GIB = 2.0**30


def fmt_s(seconds: float | None) -> str:
    """Seconds in a readable unit (s, ms, µs)."""
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} µs"


def fmt_rate(per_s: float) -> str:
    """A rate with its significant digits kept below 1 ("0.0312", not "0.0"), thousands separated above."""
    return f"{per_s:,.1f}" if per_s >= 10 else f"{per_s:.3g}"


def fmt_bytes(nbytes: float | None) -> str:
    """Bytes in GiB, MiB, or KiB under a tenth of a MiB (a small KV cache is not "0.0 MiB")."""
    if nbytes is None:
        return "-"
    if nbytes >= _GIB / 10:
        return f"{nbytes / _GIB:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 / 10 or nbytes == 0 else f"{nbytes / 2**10:.1f} KiB"


def _strategy_text(cost: LayerCost) -> str:
    """Ops grouped by chosen strategy: "colwise: q k v up gate; rowwise: o down", then a MoE layer's
    routed experts ("experts ep 2 over dp (2 of 4 per rank)") and the layer's activation
    recomputation ("recompute full") when training."""
    by_style: dict[str, list[str]] = {}
    for op, style in cost.strategy.items():
        if op not in ("recompute", "experts"):
            by_style.setdefault(style, []).append(op)
    parts = [f"{style}: {' '.join(ops)}" for style, ops in sorted(by_style.items())]
    if "experts" in cost.strategy:  # a MoE layer's routed experts (`prediction._experts_text`)
        parts.append(f"experts {cost.strategy['experts']}")
    if "recompute" in cost.strategy:
        parts.append(f"recompute {cost.strategy['recompute']}")
    return "; ".join(parts) or "-"


def _grouped(per_layer: list[LayerCost]) -> list[tuple[str, LayerCost, list[int]]]:
    """Layers of one stage with identical costs and strategy shown as one row: (label, the first
    layer's cost, the layers), label "4-79" or, for an interleaved stage's model chunks, "0, 16, 32"; the
    non-layer ops ("ends", layer -1) last, as they come."""

    def key(c: LayerCost) -> tuple:
        times = tuple(f"{t:.9g}" for t in (c.compute_s, c.exposed_comm_s, c.overlapped_comm_s))
        return (c.stage, tuple(sorted(c.strategy.items())), times)

    groups: dict[tuple, tuple[LayerCost, list[int]]] = {}
    for cost in per_layer:
        if cost.layer >= 0:
            groups.setdefault(key(cost), (cost, []))[1].append(cost.layer)
    rows = sorted(groups.values(), key=lambda g: (g[0].stage, g[1][0]))
    out = [(layer_ranges(layers), first, layers) for first, layers in rows]
    return out + [("ends", cost, []) for cost in per_layer if cost.layer < 0]


def _layer_table_title(plan: Plan) -> str:
    """What the plan table's numbers are: each row one layer's time per step (all micro-batches) on a
    rank of its stage; "×k" rows stand for k such layers."""
    mb = f"all {plan.micro_batches} micro-batches" if plan.micro_batches > 1 else "one micro-batch"
    return f"Per layer: one layer's time per step ({mb}) on a rank of its stage; ×k: k such layers"


def _ends_of(plan: Plan, stage: int) -> str:
    """The non-layer ops a stage holds: the embedding and the ops before the first layer (position ids,
    masks, RoPE tables) on the first, the ops after the last layer (final norm, LM head) on the last."""
    ends = (["embedding and the ops before layer 0"] if stage == 0 else []) + (
        ["final norm and head"] if stage == plan.pp - 1 else []
    )
    return f" + {' + '.join(ends)}" if ends else ""


def _stage_totals_caption(plan: Plan) -> str | None:
    """pp > 1: how the stage totals relate to the headline (the slowest stage's, not the rows' sum)."""
    stages = plan.predicted.per_stage
    if plan.pp == 1 or len(stages) != plan.pp:
        return None
    slowest = max(stages, key=lambda s: s.compute_s + s.exposed_comm_s).stage
    sync = "all-reduce" if plan.dp_style_text() == "ddp" else "reduce-scatter / all-gather"
    tail = f" plus the optimizer step and the DP gradient {sync}" if plan.workload is Workload.TRAIN else ""
    return (
        f"Stages run in parallel: the step's compute and exposed comm below are the slowest stage's "
        f"total (stage {slowest}){tail}, not the sum of the rows (that is work over all stages)"
    )


def _kib(nbytes: float) -> str:
    """A size under 1 MiB in KiB, else `fmt_bytes`."""
    return f"{nbytes / 1024:.1f} KiB" if nbytes < 2**20 else fmt_bytes(nbytes)


def render_plan(console: Console, plan: Plan) -> None:
    """Print the mesh, the per-stage/per-layer table, predicted totals and the Megatron comparison."""
    source = plan.cluster_source if plan.cluster_source and plan.cluster_source != plan.cluster else ""
    console.print(
        f"[bold]Plan[/bold] for {plan.model} on [bold]{plan.cluster}[/bold]"
        + (f" (spec {source})" if source else "")
        + f" ({plan.workload}, batch {plan.batch_size}"
        + (f", seq {plan.seq_len}" if plan.token_model else "")
        + (f", context {plan.context}" if plan.workload in (Workload.DECODE, Workload.GENERATE) else "")
        + f", {plan.dtype})"
    )
    console.print(
        f"Mesh: [bold]{mesh_text(plan.tp, plan.cp, plan.pp, plan.dp)}[/bold] = {plan.num_devices} devices, "
        f"{plan.micro_batches} micro-batch(es)"
        + (f" ({plan.schedule} schedule)" if plan.pp > 1 else "")
        + (f"; context parallelism {plan.cp_text()}" if plan.cp > 1 else "")
        + (f"; expert parallelism {plan.ep_text()}" if plan.ep > 1 or plan.expert_tp > 1 else "")
        + f"; ladder residual on layers {layer_ranges(plan.ladder_layers) or 'none'}"
    )
    m = plan.micro_batches
    captions = [_stage_totals_caption(plan)]
    if plan.fallbacks:  # the rows show the solver's choices; lowering found ops that cannot follow them
        captions.append(
            "Split choices as solved; the ops named in the unplanned all-gather lines below run replicated "
            "instead (the rows' times leave them out, the latency includes them)"
        )
    caption = "\n".join(c for c in captions if c) or None
    table = Table(title=_layer_table_title(plan), caption=caption, show_lines=False)
    for col in (
        "stage",
        "layers",
        "split choices",
        "compute",
        "exposed comm",
        "overlapped comm",
        "memory/rank",
    ):
        table.add_column(col, justify="right" if col not in ("split choices", "layers") else "left")
    for label, cost, layers in _grouped(plan.predicted.per_layer):
        mult = f" ×{len(layers)}" if len(layers) > 1 else ""
        stage = str(cost.stage)
        if not layers and plan.pp > 1:  # the embedding on the first stage, final norm and head on the last
            stage = f"0, {plan.pp - 1}"
        table.add_row(
            stage,
            label + mult,
            _strategy_text(cost),
            fmt_s(cost.compute_s),
            fmt_s(cost.exposed_comm_s),
            fmt_s(cost.overlapped_comm_s),
            fmt_bytes(cost.memory_bytes),
        )
    if plan.pp > 1 and len(plan.predicted.per_stage) == plan.pp:
        table.add_section()
        for st in plan.predicted.per_stage:
            table.add_row(
                str(st.stage),
                "stage total",
                f"its layers{_ends_of(plan, st.stage)} + point-to-point, x {m} micro-batches",
                fmt_s(m * st.compute_s),
                fmt_s(m * st.exposed_comm_s),
                fmt_s(m * st.overlapped_comm_s),
                fmt_bytes(st.memory_bytes),
            )
    console.print(table)
    p = plan.predicted
    what = {
        Workload.TRAIN: "step",
        Workload.DECODE: "decode step",
        Workload.GENERATE: "decode step",
        Workload.FORWARD: "forward",
    }[plan.workload]
    # training: the step's tail (optimizer step, DP gradient sync) is in compute and exposed comm, not in the rows
    opt = (
        f" incl. optimizer step {fmt_s(p.optimizer_s)}"
        if plan.workload is Workload.TRAIN and p.optimizer_s
        else ""
    )
    # the tail's communication: the data-parallel reduction, and the sum of a weight two stages share
    # (an embedding tied to the LM head), which alone is what a plan at dp = 1 syncs
    synced = "DP gradient sync" if plan.dp * plan.cp > 1 else "sync of weights the stages share"
    sync = f" incl. {synced} {fmt_s(p.grad_sync_s)}" if p.grad_sync_s else ""
    if p.serving_host_s:  # device.serving_host
        opt += f" incl. the serving engine's host work {fmt_s(p.serving_host_s)}"
    console.print(
        f"Predicted {what} latency: [bold]{fmt_s(p.latency_s)}[/bold] "
        f"(compute {fmt_s(p.compute_s)}{opt}, exposed comm {fmt_s(p.exposed_comm_s)}{sync}, overlapped {fmt_s(p.overlapped_comm_s)}, "
        f"bubble {fmt_s(p.bubble_s)}); {throughput_text(plan)}; peak memory {fmt_bytes(p.peak_memory_bytes)}/rank"
    )
    if plan.serving is not None:
        render_serving(console, plan)
    if plan.workload is Workload.TRAIN:
        render_training(console, plan)
    grouped: dict[tuple[str, str], list[Fallback]] = {}
    train = plan.workload is Workload.TRAIN
    for f in plan.fallbacks:  # one line per op and source line (a layer's op repeats per layer)
        grouped.setdefault((f.op, f.line), []).append(f)
    for (op, line), group in grouped.items():
        n = sum(f.places for f in group)
        nbytes = sum(f.bytes_gathered for f in group)
        comm = sum(f.comm_s + f.compute_s for f in group)
        memory = fallback_memory_bytes(group, plan.workload)
        times = f" ({n} places)" if n > 1 else ""
        held = ""
        if memory:
            held = f", +{_kib(memory)}/rank of memory" + ("" if train else " while it runs")
        cp = "(context parallelism" in op
        console.print(
            f"[yellow]unplanned all-gather: the {'CP' if cp else 'TP'} pass runs {escape(op)} replicated at "
            f"{escape(line)}{times}; "
            f"{_kib(nbytes)} gathered; in the prediction above: +{fmt_s(comm)} (the gather, and "
            f"{'what runs on the whole sequence' if cp else 'the op on the whole tensor'}){held}[/yellow]",
            highlight=False,
        )
    if plan.unpriced_ops:
        console.print(
            f"[yellow]priced as memory-bound by their tensor sizes (ops the cost model does not know): "
            f"{', '.join(plan.unpriced_ops)}[/yellow]"
        )
    for name, b, subject in (
        ("Hand-written Megatron plan", plan.baseline, "megatron-baseline"),
        ("torchtitan recipe", plan.torchtitan_baseline, "torchtitan-baseline"),
    ):
        if b is None:
            continue
        d = next((d for d in plan.decisions if d.subject == subject), None)
        layout = (
            d.chosen.replace("tp=", "TP=").replace("cp=", "CP=").replace("pp=", "PP=").replace("dp=", "DP=")
            if d
            else "TP in the node"
        )
        # the decision's memory part (`explain.memory_fit_text`), wherever notes follow it
        unfit = next(
            (
                part
                for part in (d.reason.split("; ") if d else [])
                if part.startswith(("does not fit", BASELINE_WOULD_NOT_RUN))
            ),
            "",
        )
        console.print(
            f"{name} ({escape(layout)}): {fmt_s(b.latency_s)}, {fmt_bytes(b.peak_memory_bytes)}/rank"
            + (
                f" -> this plan is [bold]{speed_ratio_text(b.latency_s / p.latency_s)}×[/bold] its speed"
                if not unfit
                else f" - [yellow]{escape(unfit)}[/yellow]"
            )
            + (
                " (the expert's own layout for this cluster and batch, not the mesh of this plan)"
                if d and f"tp={plan.tp} pp={plan.pp} dp={plan.dp}" not in d.chosen
                else _choices_differ_text(plan, b, d)
            )
        )
    # the TP ranks split the experts (between them, or each expert's width)
    experts_over_tp = plan.ep > 1 and plan.ep_fold == "tp" or plan.expert_tp > 1
    if plan.tp > 1 and all(s.style is SplitStyle.REPLICATE for s in plan.splits.values()):
        # a decision between replicating and splitting, with a split that was possible (finite)
        splittable = any(
            "replicate" in d.options
            and any(k != "replicate" and v != float("inf") for k, v in d.options.items())
            for d in plan.decisions
        )
        why = (
            "for this model the collectives would cost more than the split saves"
            if splittable
            else f"no weight of this model divides by tp={plan.tp} (its widths or heads)"
        )
        # the split layout at this TP: the baseline's lowering where it is at this TP, else the check of
        # the layout itself (`workflow._megatron_layout_note`)
        baseline = next((d for d in plan.decisions if d.subject == "megatron-baseline"), None)
        at_tp = plan.baseline_layout.get("tp") in (None, str(plan.tp))
        unrunnable = any(
            d.subject == "megatron-layout" and BASELINE_WOULD_NOT_RUN in d.reason for d in plan.decisions
        ) or (at_tp and baseline is not None and BASELINE_WOULD_NOT_RUN in baseline.reason)
        run_split = (
            f"; --layout megatron plans, prices and runs the hand-written Megatron-LM split layout at TP={plan.tp} "
            "anyway"
            if splittable and not unrunnable
            else f"; the hand-written Megatron-LM split layout at TP={plan.tp} would not run (see --why)"
            if unrunnable
            else ""
        )
        what = "every weight but the experts'" if experts_over_tp else "every weight"
        console.print(
            f"[yellow]note: TP={plan.tp}, but {what} stays replicated on {plan.cluster}: {why} "
            f"(see --why){run_split}[/yellow]"
        )
    if plan.workload is Workload.DECODE and plan.serving is None:
        console.print(
            f"[yellow]note: decode priced from a formula: one token through the forward graph plus the K/V of "
            f"{plan.context} cached tokens read once per layer; the model file defines no step_inputs, so its "
            "own cache writes and attention over its cache are not in the graph, and --run cannot serve it "
            "(docs/model-files.md: models with a KV cache)[/yellow]"
        )
    for note in plan.excluded[:8]:
        console.print(f"[dim]excluded: {escape(note)}[/dim]")  # a model's source line may hold [...]
    s = plan.solver
    console.print(
        f"[dim]solver: {s.status}, gap {s.gap:.3g}, {s.time_s:.2f} s, {s.num_variables} variables[/dim]"
    )


def throughput_text(plan: Plan) -> str:
    """Tokens/s for token models, samples/s for the others (images, feature vectors)."""
    p = plan.predicted
    if plan.token_model:
        return f"{p.throughput_tokens_per_s:,.0f} tokens/s"
    return f"{plan.batch_size / p.latency_s:,.0f} samples/s" if p.latency_s else "- samples/s"


SMALL_MEMORY_BYTES = 64 * 2**20  # below this a measured peak is mostly the runtime's own memory


RECALIBRATE = "recalibrate on a quiet machine (--recalibrate)"


def agreement_line(
    predicted_s: float, measured_s: float, layer_table: bool = True, advice: str = RECALIBRATE
) -> str:
    """The run's verdict: "measured / predicted = 1.07 (within 25%)" (or how far outside, pointing at
    the per-layer table when one was printed, then `advice`: what would make the comparison fair)."""
    ratio = measured_s / predicted_s if predicted_s else float("inf")
    shown = round(ratio, 2)  # the band of the ratio as printed: 1.1033 reads "1.10 (within 10%)"
    if 0.8 <= shown <= 1.25:
        verdict = "within 10%" if 0.91 <= shown <= 1.1 else "within 25%"
    else:
        look = "see the per-layer table, and " if layer_table else ""
        verdict = f"off by {max(ratio, 1 / ratio):.1f}x: {look}{advice}"
    return f"measured / predicted = {ratio:.2f} ({verdict})"


SPEED_NOTE_FACTOR = 1.1  # the speed line is printed when a probe read outside this factor of calibration


def _probe_text(at_run: dict[str, Any]) -> str:
    """'7.5 µs per node (calibrated 13.8), matmul 95.1 GFLOP/s (calibrated 110.2)'."""
    text = (
        f"{at_run['node_overhead_s'] * 1e6:.1f} µs per node "
        f"(calibrated {at_run['calibrated_node_overhead_s'] * 1e6:.1f})"
    )
    if at_run.get("backward_ratio"):
        text += (
            f", backward {at_run['backward_node_overhead_s'] * 1e6:.1f} µs "
            f"(calibrated {at_run['calibrated_backward_node_overhead_s'] * 1e6:.1f})"
        )
    if at_run.get("matmul_ratio"):
        text += (
            f", matmul {at_run['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s "
            f"(calibrated {at_run['calibrated_matmul_flops_per_s'] / 1e9:.1f})"
        )
    return text


def _listed(parts: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _off(ratio: float | None) -> bool:
    return bool(ratio) and not 1 / SPEED_NOTE_FACTOR <= ratio <= SPEED_NOTE_FACTOR


def speed_line(at_run: dict[str, Any] | None, measured_s: float, busy: str | None = None) -> str | None:
    """The verdict at the machine's speed during the run (`planner.solver.machine.at_run_speed`), when the speed
    probe's per-node overhead (forward, or backward when training) or matmul rate read outside
    `SPEED_NOTE_FACTOR` of calibration; else None. ``busy``: the advice when other processes shared
    the cores (`main.busy_during_run`), which then replaces blaming the cost model."""
    if not at_run:
        return None
    kinds = (
        ("dispatched ops", at_run["speed_ratio"]),
        ("ran backward ops", at_run.get("backward_ratio")),
        ("multiplied", at_run.get("matmul_ratio")),
    )
    if not any(_off(ratio) for _, ratio in kinds):
        return None
    parts = []
    for what, ratio in kinds:
        if ratio:  # None, or 0 from a probe that read nothing
            parts.append(f"{what} {ratio:.2f}x slower" if ratio >= 1 else f"{what} {1 / ratio:.2f}x faster")
    verdict = agreement_line(
        at_run["latency_s"],
        measured_s,
        layer_table=False,
        advice=busy or "the cost model, not the machine's speed, is off for this plan",
    )
    return (
        f"the machine {_listed(parts)} than when calibrated (probe between the timed steps: "
        f"{_probe_text(at_run)}); re-priced at that speed ({fmt_s(at_run['latency_s'])}): {verdict}"
    )


def options_text(d: Decision) -> str:
    """A decision's alternatives with their predicted seconds, "not solved" for those no mesh solved
    (`Decision.unsolved`), "not allowed" for the rest at inf (a pin, the model or memory rules them out)."""
    return ", ".join(
        f"{k}: {fmt_s(v) if v != float('inf') else 'not solved' if k in d.unsolved else 'not allowed'}"
        for k, v in d.options.items()
    )


def render_decisions(console: Console, plan: Plan) -> None:
    """The "why" table: each decision with the predicted cost of every alternative."""
    table = Table(
        title="Why: each decision beside its alternatives (predicted seconds; each reason says what its times cover)"
    )
    for col in ("decision", "chosen", "alternatives", "reason"):
        table.add_column(col)
    for d in plan.decisions:
        options = options_text(d)
        # plain text: labels such as "m=2 [interleaved_1f1b v=2]" are not rich markup
        table.add_row(*(escape(str(cell)) for cell in (d.subject, d.chosen, options, d.reason)))
    console.print(table)
    c = plan.op_placement
    if c:
        gathered = dict.fromkeys(escape(f"{f.op} at {f.line or f.node}") for f in plan.fallbacks)
        console.print(
            f"Op placement on one rank at TP={plan.tp}: {c.get('general', 0)} op(s) by general sharding rules "
            f"(PyTorch DTensor's), {c.get('own', 0)} by the planner's own (matmuls, attention, caches, fused parts, "
            f"RNG), {c.get('replicated', 0)} run replicated"
            + (f", of which gathered: {'; '.join(gathered)}" if gathered else " (none gathers a shard)"),
            highlight=False,
        )
    added = sum(f.comm_s + f.compute_s for f in plan.fallbacks)
    if added:
        console.print(
            f"The decisions' times are the solver's; the predicted latency above adds {fmt_s(added)} for the "
            "unplanned all-gathers found by lowering the plan (their gathers and the ops run on whole tensors)."
        )


def render_serving(console: Console, plan: Plan) -> None:
    """The request a serving plan was priced for: TTFT, time per output token, tokens/s."""
    sv = plan.serving
    assert sv is not None
    console.print(
        f"Request (prompt {sv.prompt_len}, {sv.new_tokens} new tokens, cache {sv.cache_len}, batch {plan.batch_size}): "
        f"time to first token [bold]{fmt_s(sv.ttft_s)}[/bold], [bold]{sv.tpot_s * 1e3:.3g} ms[/bold] per output token, "
        f"{fmt_rate(sv.tokens_per_s)} tokens/s over the request; decode graph and prefill graph priced node by node"
    )
    for note in sv.fallbacks:
        console.print(f"[yellow]fallback: {escape(note)}[/yellow]")


def _samples_text(measured: dict) -> str:
    """'10 iterations', or '97 samples of 7 back-to-back steps' when steps were timed in windows."""
    k = measured.get("steps_per_sample", 1)
    if k > 1:
        return f"{measured['iterations']} samples of {k} back-to-back steps"
    return f"{measured['iterations']} iterations"


def _small_memory_note(console: Console, above_startup_bytes: float, predicted_bytes: float) -> None:
    """Says so when the predicted or measured peak is too small for their ratio to test the memory model."""
    if above_startup_bytes > 0 and min(above_startup_bytes, predicted_bytes) < SMALL_MEMORY_BYTES:
        console.print(
            f"[dim]memory: under {fmt_bytes(SMALL_MEMORY_BYTES)} the allocator's and the runtime's own working "
            "memory (pools, gloo buffers, autograd) dominate the measured peak: its ratio does not test the "
            "memory model, which prices the model's tensors[/dim]"
        )


def _per_rank_memory(console: Console, m: dict[str, Any], predicted_bytes: float, stages: int = 1) -> None:
    """Each rank's measured peak above its start-up (and, training, the state it held) beside the
    predicted peak per rank (with pipeline `stages`, the fullest stage's), when more than one rank ran."""
    peaks, starts = m.get("per_rank_peak_memory_bytes") or [], m.get("per_rank_startup_memory_bytes") or []
    if len(peaks) < 2 or len(starts) != len(peaks):
        return
    above = ", ".join(
        f"rank {r} {fmt_bytes(max(0, peak - start))}" for r, (peak, start) in enumerate(zip(peaks, starts))
    )
    states = m.get("per_rank_state_bytes") or []
    held = (
        "; training state held: " + ", ".join(fmt_bytes(b) for b in states)
        if states and all(b is not None for b in states)
        else ""
    )
    console.print(
        f"memory per rank, above start-up (predicted {fmt_bytes(predicted_bytes)} "
        f"{'each' if stages == 1 else 'on the fullest stage'}): {above}{held}",
        highlight=False,
    )


def render_run(console: Console, report: dict[str, Any]) -> None:
    """Predicted beside measured, with the ratio, and the numerics check."""
    m, n, p = report["measured"], report["numerics"], report["predicted"]
    table = Table(title="Predicted vs measured")
    for col in ("quantity", "predicted", "measured", "measured / predicted"):
        # the labels stay whole (the probe's readings, which made the speed row's label wrap, follow the table)
        table.add_column(col, justify="right", no_wrap=col == "quantity")
    ratio = m["latency_s"] / p["latency_s"] if p["latency_s"] else None
    table.add_row("latency", fmt_s(p["latency_s"]), fmt_s(m["latency_s"]), f"{ratio:.2f}" if ratio else "-")
    if at_run := m.get("at_run_speed"):  # the same plan priced at the probe's per-node overhead
        table.add_row(
            "latency at the run's machine speed",
            fmt_s(at_run["latency_s"]),
            fmt_s(m["latency_s"]),
            f"{m['latency_s'] / at_run['latency_s']:.2f}",
        )
    # the prediction is the model's memory (weights, gradients, optimizer state, activations); the
    # process also holds what it held before the model (torch, the process group): compare above that
    above = m["peak_memory_bytes"] - (m.get("startup_memory_bytes") or 0)
    mem_ratio = above / p["peak_memory_bytes"] if above > 0 and p["peak_memory_bytes"] else None
    table.add_row(
        "peak memory / rank, above start-up",
        fmt_bytes(p["peak_memory_bytes"]),
        fmt_bytes(above),
        f"{mem_ratio:.2f}" if mem_ratio else "-",
    )
    table.add_row("process peak memory / rank", "-", fmt_bytes(m["peak_memory_bytes"]), "-")
    if heap := m.get("heap_peak_bytes"):  # CPU: the live heap, without what the allocator keeps freed
        table.add_row(
            "heap peak / rank, above start-up",
            fmt_bytes(p["peak_memory_bytes"]),
            fmt_bytes(heap),
            f"{heap / p['peak_memory_bytes']:.2f}" if p["peak_memory_bytes"] else "-",
        )
    if m.get("state_bytes") is not None and m.get("predicted_state_bytes"):
        # training: what the data-parallel style leaves on a rank, counted tensor by tensor
        table.add_row(
            "training state / rank (parameters, gradients, Adam)",
            fmt_bytes(m["predicted_state_bytes"]),
            fmt_bytes(m["state_bytes"]),
            f"{m['state_bytes'] / m['predicted_state_bytes']:.2f}",
        )
    console.print(table)
    _per_rank_memory(console, m, p["peak_memory_bytes"], report.get("plan", {}).get("pp", 1))
    if at_run:
        console.print(
            f"latency at the run's machine speed: the probe between the timed steps read {_probe_text(at_run)}"
        )
    _small_memory_note(console, above, p["peak_memory_bytes"])
    console.print(
        f"measured: median of {_samples_text(m)} on the slowest rank; p10 {fmt_s(m['latency_p10_s'])}, "
        f"p90 {fmt_s(m['latency_p90_s'])}; per-rank medians {', '.join(fmt_s(x) for x in m['per_rank_median_s'])}"
    )
    if m.get("startup_memory_bytes"):
        console.print(
            f"measured peak memory is the rank process's real peak; {fmt_bytes(m['startup_memory_bytes'])} of it "
            "was held before the model (torch, the process group)"
            + (
                "; the heap row is glibc's heap in use (mallinfo2) at its highest over one more step, sampled "
                "after every op: the resident set also keeps what the allocator freed"
                if m.get("heap_peak_bytes")
                else ""
            )
        )
    diff = n["max_abs_diff"]
    console.print(
        f"numerics: max |sharded - unsharded| = {diff:.3g} (output scale {n['output_scale']:.3g}"
        + (
            f", {len(n['outputs'])} output{'s' if len(n['outputs']) > 1 else ''} compared"
            if n.get("outputs")
            else ""
        )
        + (f", tolerance {n['tolerance_rel']:g} x scale for {n['dtype']}" if n.get("tolerance_rel") else "")
        + ")"
        + (
            f"; gradients max diff {n['grad_max_abs_diff']:.3g}"
            + (f" ({n['grad_worst']})" if n.get("grad_worst") else "")
            + (f" of scale {n['grad_scale']:.3g}" if n.get("grad_scale") else "")
            + (
                f", the loss's gradients times the loss scale {n['grad_loss_scale']:g} on both sides"
                if n.get("grad_loss_scale")
                else ""
            )
            if n.get("grad_max_abs_diff") is not None
            else ""
        )
        + (
            f"; first optimizer step's update max diff {n['update_max_abs_diff']:.3g} (tolerance {n['update_tolerance']:.3g})"
            if n.get("update_max_abs_diff") is not None
            else ""
        )
        + (
            f"; ladder residual moved the outputs by {n['ladder_deviation']:.3g} (relative L2) vs the original model"
            if n.get("ladder_deviation") is not None
            else ""
        )
    )
    if n.get("routing_calls"):
        console.print(
            "expert routing: the checked step's routers took the unsharded model's choices, token by token; "
            + routing_text(n)
            + (
                f"; {n['routing_unmatched']} token(s) matched none of the unsharded model's and kept their own"
                if n.get("routing_unmatched")
                else ""
            )
        )
    if m.get("dtype"):
        console.print(f"ran in {m['dtype']} (the plan's dtype)")
    for note in m.get("notes") or []:  # train mode and dropout, inputs given whole, where the reference ran
        console.print(f"note: {escape(note)}", highlight=False)


def routing_text(n: dict[str, Any]) -> str:
    """The replayed routing of a run's numerics (`runtime.routing`): the routers' logits against the
    unsharded model's, and the choices this run would have made otherwise."""
    text = f"router logits max |diff| {n['routing_logit_diff']:.3g} (tolerance {n['routing_tolerance']:.3g})"
    if n.get("routing_flipped"):
        text += (
            f", {n['routing_flipped']} token choice(s) would have gone to other experts here (near-ties that "
            "rounding in another summation order flips"
            + (f"; scores {n['routing_max_gap']:.3g} apart at most)" if n.get("routing_max_gap") else ")")
        )
    return text


def render_serving_run(console: Console, report: dict[str, Any]) -> None:
    """A served request: TTFT, ms per output token and tokens/s predicted beside measured, the greedy
    tokens against the unsharded model's, and with ladder layers its deviation and speed-up."""
    sv, n, m = report["serving"], report["numerics"], report["measured"]
    p, got = sv["predicted"], sv["measured"]
    table = Table(
        title=f"Request: prompt {p['prompt_len']}, {p['new_tokens']} new tokens, batch {p['batch_size']}"
    )
    for col in ("quantity", "predicted", "measured", "measured / predicted"):
        # the labels stay whole (the probe's readings follow the table, as in `render_run`)
        table.add_column(col, justify="right", no_wrap=col == "quantity")

    def row(label: str, want: float | None, have: float | None, text=fmt_s) -> None:
        ratio = f"{have / want:.2f}" if want and have else "-"
        table.add_row(
            label, text(want) if want is not None else "-", text(have) if have is not None else "-", ratio
        )

    row("time to first token", p["ttft_s"], got["ttft_s"])
    row("time per output token", p["tpot_s"], got["tpot_s"])
    if at_run := m.get("at_run_speed"):  # the decode step priced at the speed probe's readings
        row("  at the run's machine speed", at_run["latency_s"], got["tpot_s"])
    row("tokens/s over the request", p["tokens_per_s"], got["tokens_per_s"], fmt_rate)
    if got.get("standard_tpot_s"):
        row("  same splits without ladder", p["standard_tpot_s"], got["standard_tpot_s"])
        row("  ladder speed-up", p["ladder_speedup"], got["ladder_speedup"], lambda x: f"{x:.3f}x")
    pm = report["predicted"]["peak_memory_bytes"]
    # the prediction is the model's memory (weight shards, cache, activations); the process also holds
    # what it held before the model (torch, the process group): compare above that
    above = m["peak_memory_bytes"] - (m.get("startup_memory_bytes") or 0)
    row("peak memory / rank, above start-up", pm, above if above > 0 else None, fmt_bytes)  # cache included
    console.print(table)
    if at_run:
        console.print(
            f"time per output token at the run's machine speed: the probe between the timed steps read "
            f"{_probe_text(at_run)}"
        )
    _small_memory_note(console, above, pm)
    console.print(
        f"measured: per output token median of {m['iterations']} decode steps on the slowest rank (run back "
        f"to back as a serving loop runs them, warm-up excluded), p10 {fmt_s(m['latency_p10_s'])}, p90 {fmt_s(m['latency_p90_s'])}; KV cache "
        f"{fmt_bytes(m['cache_bytes_per_rank'])}/rank"
    )
    if n["tokens_identical"]:
        same = "identical to the unsharded model's"
    elif n["ok"]:  # choices flipped at near-ties, within the tolerance in the reference's own logits
        same = (
            f"{n['tokens_differ']} differ from the unsharded model's, each at a near-tie (its two tokens' "
            f"logits {n['max_choice_gap']:.3g} apart at most in the reference)"
        )
    else:
        same = f"[red]{n['tokens_differ']} differ from[/red] the unsharded model's"
    console.print(
        f"numerics (every step on the unsharded model's tokens): greedy tokens {same}; max |logit diff| "
        f"{n['max_abs_diff']:.3g} (tolerance {n['logit_tolerance']:.3g}, logit scale {n['output_scale']:.3g})"
    )
    if n.get("routing_calls"):
        console.print("expert routing: every router took the unsharded model's choices; " + routing_text(n))
    if n.get("ladder_deviation") is not None:
        console.print(
            f"ladder residual vs the original model: prefill logits moved {n['ladder_deviation']:.3g} (relative L2), "
            f"{n['ladder_tokens_differ']} of {len(n['tokens']) * len(n['tokens'][0])} greedy tokens differ"
        )
    if got.get("standard_tpot_s") and p.get("ladder_speedup") and abs(p["ladder_speedup"] - 1.0) < 1e-3:
        console.print(
            f"ladder speed-up: the plan hides next to none of the laddered layers' communication, so it predicts "
            f"the laddered and the standard rewrite alike: it prices no communication there (weights replicated, "
            f"or links that cost next to nothing), or the spec lets little of it run behind compute (its "
            f"overlap_efficiency: on gloo the all-reduce's threads share the cores with the matmuls); the "
            f"measured {got['ladder_speedup']:.3f}x is this run's noise, not a gain it priced",
            highlight=False,
        )
    for note in m.get("notes") or []:  # where the unsharded reference was built
        console.print(f"note: {escape(note)}", highlight=False)


def render_layer_comparison(console: Console, plan: Plan, measured_per_layer_s: dict[str, float]) -> bool:
    """Predicted (compute + exposed comm) beside measured time per layer, to locate a prediction error.
    Returns whether a table was printed: none when the run profiled no layer (a model without
    transformer layers, e.g. an MLP chain, profiles as one "ends" segment: the whole forward, which the
    latency row already compares).

    Measured per layer comes from one node-by-node profiling pass (runtime.profile), which adds a small
    per-node overhead; compare shares and ratios between layers, not only absolute values.
    """
    if not any(k.startswith("layer ") for k in measured_per_layer_s):
        return False
    table = Table(
        title="Per layer: predicted vs measured (profiled forwards, slowest rank; each row times its own "
        "nodes, including their dispatch overhead and collectives, as the whole forward runs them)"
    )
    for col in ("layers", "predicted", "measured", "measured / predicted"):
        table.add_column(col, justify="right")
    predicted = {c.layer: c.compute_s + c.exposed_comm_s for c in plan.predicted.per_layer}
    table.caption = (
        "profiled in a pass of its own after the timed steps, so at the machine's speed of that moment: "
        "the rows need not add up to the measured latency above"
    )
    for label, cost, layers in _grouped(plan.predicted.per_layer):
        keys = [f"layer {i}" for i in layers] if layers else ["ends"]
        got = [measured_per_layer_s[k] for k in keys if k in measured_per_layer_s]
        if not got:
            continue
        want = predicted[cost.layer]
        mean = sum(got) / len(got)
        table.add_row(
            label + (" (mean)" if len(layers) > 1 else ""),
            fmt_s(want),
            fmt_s(mean),
            f"{mean / want:.2f}" if want else "-",
        )
    console.print(table)
    return True


def mesh_text(tp: int | str, cp: int | str, pp: int | str, dp: int | str) -> str:
    """The mesh as the tables write it: "TP=8 × PP=16 × DP=128", with "× CP=16" after TP when cp > 1."""
    return f"TP={tp}" + (f" × CP={cp}" if str(cp) != "1" else "") + f" × PP={pp} × DP={dp}"


def training_rows(plan: Plan) -> list[tuple[str, str, str, str]]:
    """(what, this plan, the hand-written Megatron plan, the torchtitan recipe) for a training plan:
    layout, TFLOP/s per device, bubble and memory per rank ("-" where a baseline is unknown)."""
    rows = _training_rows(plan)
    titan = _training_rows(_as_baseline(plan, plan.torchtitan_baseline, plan.torchtitan_layout))
    # torchtitan trains in bf16 or fp32 only: it has no loss scaling (`planner export --to torchtitan` says so)
    return [
        (*row, "none in torchtitan" if row[0] == "loss scaling" and other[2] != "-" else other[2])
        for row, other in zip(rows, titan)
    ]


def _as_baseline(plan: Plan, prediction, layout: dict[str, str]) -> Plan:
    """`plan` with another hand-written plan in its baseline fields (for `_training_rows`' third column)."""
    return dataclasses.replace(plan, baseline=prediction, baseline_layout=layout)


def _training_rows(plan: Plan) -> list[tuple[str, str, str]]:
    """(what, this plan, the plan's `baseline`) rows of `training_rows`."""
    p, b, bl = plan.predicted, plan.baseline, plan.baseline_layout

    def tflops(pred) -> str:
        rate = pred.model_flops_per_s_per_device if pred is not None else 0.0
        if not rate:
            return "-"
        return f"{rate / 1e12:,.1f}" if rate >= 1e12 else f"{rate / 1e12:.3g}"  # CPUs: 0.026, not 0.0

    def bubble(pred) -> str:
        return f"{pred.bubble_s / pred.latency_s:.1%}" if pred is not None and pred.latency_s else "-"

    def schedule(sched: str, v: str | int, pp: str | int) -> str:
        if str(pp) == "1":
            return "- (pp=1)"
        return f"{sched} v={v}" if str(v) != "1" else str(sched)

    on = {"true": "on", "false": "off", True: "on", False: "off"}
    # a mixture-of-experts model's plans say where its experts live (a dense model's table is unchanged)
    experts = (
        [("expert parallelism", plan.ep_text(), bl.get("expert_parallel", "off") if bl else "-")]
        if plan.ep > 1 or "router" in plan.roles.values()
        else []
    )
    return [
        ("mesh", mesh_text(plan.tp, plan.cp, plan.pp, plan.dp),
         mesh_text(bl["tp"], bl.get("cp", 1), bl["pp"], bl["dp"]) if bl else "-"),
        ("context parallelism", plan.cp_text(), bl.get("context_parallel", "off") if bl else "-"),
        *experts,
        ("schedule", schedule(plan.schedule, plan.virtual_stages, plan.pp),
         schedule(bl["schedule"], bl["virtual_stages"], bl["pp"]) if bl else "-"),
        ("micro-batches × size", f"{plan.micro_batches} × {plan.micro_batch_size:g}",
         f"{bl['micro_batches']} × {bl['micro_batch_size']}" if bl else "-"),
        ("recompute", plan.recompute_text(), bl.get("recompute", "-") if bl else "-"),
        # the baseline is priced with the plan's loss scaling (Megatron-LM's --fp16 scales dynamically too)
        *([("loss scaling", loss_scale_text(plan.loss_scale), loss_scale_text(plan.loss_scale) if b else "-")]
          if plan.workload == "train" and plan.dtype == "fp16" else []),
        ("sequence parallel", on[plan.sequence_parallel], on.get(bl.get("sequence_parallel"), "-") if bl else "-"),
        ("data parallel", (plan.dp_style_text() + (f" over dp × cp = {plan.mesh.dp_cp}" if plan.cp > 1 else "")
         if plan.mesh.dp_cp > 1 else "one replica" if plan.grad_reduce_dtype == "fp32" else "-")
         + ("; fp32 gradients" if plan.grad_reduce_dtype == "fp32" else ""),
         (bl.get("dp_style") or on.get(bl.get("distributed_optimizer"), "-")) if bl and bl.get("dp") != "1" else "-"),
        ("communication overlap", overlap_text(plan.tp_comm_overlap, plan.overlap_grad_reduce, plan.overlap_param_gather)
         # FSDP's gathers and reduce-scatters overlap compute whatever the three options say (one unit ahead)
         + ("; fsdp prefetches and reduces one unit ahead" if plan.dp_style == "fsdp" and plan.mesh.dp_cp > 1 else ""),
         bl.get("overlap", "-") if bl else "-"),
        ("step time", fmt_s(p.latency_s), fmt_s(b.latency_s) if b is not None else "-"),
        ("model TFLOP/s per device", tflops(p), tflops(b)),
        ("pipeline bubble", bubble(p), bubble(b)),
        ("memory per rank (peak)", fmt_bytes(p.peak_memory_bytes), fmt_bytes(b.peak_memory_bytes) if b is not None else "-"),
    ]  # fmt: skip


_METRIC_ROWS = frozenset(
    {"mesh", "step time", "model TFLOP/s per device", "pipeline bubble", "memory per rank (peak)"}
)


def _choices_differ_text(plan: Plan, baseline: Prediction, d: Decision | None) -> str:
    """For a plan on the mesh of its hand-written Megatron baseline (`d`, its decision): " (same mesh;
    it differs in weight splits, recompute: see the training layout table)", the weight splits when
    the decision says they differ (`BASELINE_OTHER_SPLITS`) and, training, the rows of `training_rows`
    whose choices differ, so that a ratio other than 1.00 says where it comes from; "" otherwise."""
    if d is None or d.subject != "megatron-baseline":
        return ""
    differ = ["weight splits"] if BASELINE_OTHER_SPLITS in d.reason else []
    table = ""
    if plan.workload is Workload.TRAIN and plan.baseline_layout:
        rows = _training_rows(dataclasses.replace(plan, baseline=baseline))
        choices = [what for what, mine, theirs in rows if what not in _METRIC_ROWS and "-" != theirs != mine]
        differ += choices
        table = ": see the training layout table" if choices else ""
    return f" (same mesh; it differs in {', '.join(differ)}{table})" if differ else ""


def render_training(console: Console, plan: Plan) -> None:
    """Training: the plan's layout (schedule, v, micro-batch size, recompute, sequence parallelism,
    distributed optimizer) with TFLOP/s per device, bubble and memory, beside the Megatron baseline's."""
    table = Table(title="Training layout (model FLOP/s: forward + backward, recomputation not counted)")
    for col in ("", "this plan", "hand-written Megatron", "torchtitan recipe"):
        table.add_column(col, justify="left" if not col else "right")
    for row in training_rows(plan):
        table.add_row(*row)
    console.print(table)


def speed_ratio_text(ratio: float) -> str:
    """A speed ratio to 2 decimals, or 3 where 2 would round a small difference to "1.00" (a plan
    0.4% slower than a baseline reads 0.996, not as fast)."""
    text = f"{ratio:.2f}"
    return f"{ratio:.3f}" if text == "1.00" and abs(ratio - 1.0) >= 5e-4 else text

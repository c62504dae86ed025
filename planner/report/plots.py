"""PNG figures of a plan and its run, drawn with matplotlib (Agg, no display) from `figures`' data.

    write_figures(plan, out_dir, report=None, capacity_bytes=None) -> Figures

Files written into `out_dir` (a folder the planner owns: `planner.files.publish_folder`):

- ``timeline.png``: the pipeline schedule, stages x time (ms), a box per forward / backward pass of
  each micro-batch, labelled with its number, idle time left blank; the title quotes the plan's bubble
  (the plan table's number) and each stage's idle time in the drawn order;
- ``layer_times.png``: per layer, compute / exposed / overlapped communication (ms per step, all
  micro-batches), stacked, with the profiled time beside it when a run measured it; with pp > 1 the title
  gives each stage's time per step (the slowest is the step's) and calls the bars' sum work over stages;
- ``memory.png``: memory per rank of each stage (GiB), predicted and measured, against the device's
  capacity;
- ``ladder.png`` (plans with ladder residual layers): each layer's time with and without ladder.

A figure whose data the plan lacks (a plan written before per-stage costs were recorded) is skipped
and named in `Figures.notes`.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from planner.files import failed_write, new_output_folder, publish_folder
from planner.plan import Plan, layer_ranges
from planner.report.figures import (
    BACKWARD,
    FORWARD,
    GRAD_SYNC,
    OPTIMIZER,
    LayerTime,
    NoStageCosts,
    Timeline,
    ladder_times,
    layer_times,
    schedule_timeline,
    stage_memory,
    title,
)

_GIB = 2.0**30
_MS = 1e3
_COLORS = {
    FORWARD: "#4C72B0",
    BACKWARD: "#DD8452",
    GRAD_SYNC: "#8172B3",
    OPTIMIZER: "#937860",
    "compute": "#4C72B0",
    "exposed": "#C44E52",
    "overlapped": "#55A868",
    "measured": "#7F7F7F",
}


@dataclass
class Figures:
    """What `write_figures` wrote (paths inside the published folder) and what it skipped, and why."""

    folder: Path
    files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def write_figures(
    plan: Plan,
    out_dir: str | os.PathLike[str],
    report: dict[str, Any] | None = None,
    capacity_bytes: float | None = None,
    option: str = "--plot",
) -> Figures:
    """Draw the figures of `plan` (and of `report`'s measurements, the JSON report of a run) into
    `out_dir`. capacity_bytes: the device memory per rank drawn as a line (None: not drawn). Raises
    InputError when `out_dir` may not be written (`planner.files.check_output_path`)."""
    tmp = new_output_folder(out_dir, option)
    names: list[str] = []
    notes: list[str] = []
    drawers = [
        ("timeline.png", lambda: _timeline(plan)),
        ("layer_times.png", lambda: _layer_times(plan, report)),
        ("memory.png", lambda: _memory(plan, report, capacity_bytes)),
    ]
    if plan.ladder_layers:
        drawers.append(("ladder.png", lambda: _ladder(plan)))
    try:
        for name, draw in drawers:
            try:
                fig = draw()
            except (NoStageCosts, ValueError) as e:
                notes.append(f"{name} not drawn: {e}")
                continue
            fig.savefig(tmp / name, dpi=110, bbox_inches="tight")
            names.append(name)
    except BaseException as e:  # a full disk, Ctrl-C: no temporary folder left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise failed_write(option, out_dir, e) from None
    folder = publish_folder(tmp, out_dir, option)
    return Figures(folder, [folder / n for n in names], notes)


def _figure(width: float, height: float) -> tuple[Figure, Any]:
    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.add_subplot()


def _timeline(plan: Plan) -> Figure:
    t = schedule_timeline(plan)
    fig, ax = _figure(12, 1.2 + 0.65 * t.stages)
    total = max(b.end_s for b in t.boxes)
    for b in t.boxes:
        width = b.end_s - b.start_s
        if width <= 0:
            continue
        shade = 1.0 - 0.35 * b.chunk / max(1, t.chunks - 1) if t.chunks > 1 else 1.0
        ax.broken_barh(
            [(b.start_s * _MS, width * _MS)],
            (b.stage - 0.4, 0.8),
            facecolors=_COLORS[b.kind],
            alpha=shade,
            edgecolor="white",
            linewidth=0.6,
        )
        if b.micro_batch >= 0 and width / total > 0.012:
            label = str(b.micro_batch) + (f".{b.chunk}" if t.chunks > 1 else "")
            ax.text(
                (b.start_s + width / 2) * _MS,
                b.stage,
                label,
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_yticks(range(t.stages), [f"stage {s}" for s in range(t.stages)])
    ax.set_ylim(t.stages - 0.5, -0.5)  # stage 0 on top
    ax.set_xlim(0, total * _MS * 1.01)
    ax.set_xlabel("time in one step (ms)")
    kinds = [FORWARD, BACKWARD, GRAD_SYNC, OPTIMIZER]
    present = [k for k in kinds if any(b.kind == k for b in t.boxes)]
    handles = [Patch(color=_COLORS[k], label=k) for k in present] + [
        Patch(facecolor="white", edgecolor="#999999", label="idle (bubble)")
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    chunk_note = (
        f"; box label: micro-batch.chunk ({t.chunks} chunks per rank)"
        if t.chunks > 1
        else "; box label: micro-batch"
    )
    ax.set_title(
        f"Pipeline schedule: {title(plan)}{chunk_note}\n{timeline_caption(t)}", fontsize=9, loc="left"
    )
    return fig


def timeline_caption(t: Timeline) -> str:
    """The timeline's caption: the plan's bubble (the number the plan table prints), the drawn order's
    step and each stage's idle time in it, and how the drawn step relates to the prediction."""
    v = f"/{t.chunks}" if t.chunks > 1 else ""
    plan_bubble = (
        f"plan's bubble {t.bubble_s * _MS:.3g} ms = {t.bubble_s / t.predicted_s:.1%} of the step "
        f"(fill and drain: the other stages' time{v} beyond {t.micro_batches} x the slowest stage)"
    )
    idle = ", ".join(f"stage {s} {x * _MS:.3g}" for s, x in enumerate(t.stage_idle_s))
    drawn = (
        f"drawn: {t.schedule_s * _MS:.3g} ms per step (pipeline {t.pipeline_s * _MS:.3g} ms, idle ms: {idle}"
        + (f"; + {t.tail_s * _MS:.3g} ms after it" if t.tail_s else "")
        + (f"; + {t.fallback_s * _MS:.3g} ms unplanned all-gathers" if t.fallback_s else "")
        + ")"
    )
    if math.isclose(t.schedule_s, t.predicted_s, rel_tol=1e-3):
        relation = f"plan predicts {t.predicted_s * _MS:.3g} ms (same)"
    else:
        formula = "stages' sum/v + (m-1/v) x slowest" if t.chunks > 1 else "stages' sum + (m-1) x slowest"
        relation = (
            f"plan predicts {t.predicted_s * _MS:.3g} ms ({formula}); this order on unequal stages "
            f"{'saves' if t.schedule_s < t.predicted_s else 'adds'} {abs(t.predicted_s - t.schedule_s) * _MS:.3g} ms "
            f"(its bubble {t.schedule_bubble_s * _MS:.3g} ms)"
        )
    return f"{plan_bubble}\n{drawn}\n{relation}"


def _layer_times(plan: Plan, report: dict[str, Any] | None) -> Figure:
    rows = layer_times(plan, report)
    measured = any(r.measured_s is not None for r in rows)
    fig, ax = _figure(max(10.0, min(18.0, 2.5 + 0.35 * len(rows) * (2 if measured else 1))), 4.5)
    width = 0.4 if measured else 0.75
    xs = [i - width / 2 if measured else i for i in range(len(rows))]
    bottom = [0.0] * len(rows)
    for part, values in (
        ("compute", [r.compute_s for r in rows]),
        ("exposed", [r.exposed_comm_s for r in rows]),
        ("overlapped", [r.overlapped_comm_s for r in rows]),
    ):
        ms = [v * _MS for v in values]
        if part != "compute" and not any(ms):
            continue
        label = {"compute": "compute", "exposed": "exposed comm", "overlapped": "overlapped comm (hidden)"}[
            part
        ]
        ax.bar(xs, ms, width, bottom=bottom, color=_COLORS[part], label=f"predicted {label}",
               hatch="//" if part == "overlapped" else None, edgecolor="white", linewidth=0.3)  # fmt: skip
        bottom = [b + m for b, m in zip(bottom, ms)]
    if measured:
        got = [(i + width / 2, r.measured_s * _MS) for i, r in enumerate(rows) if r.measured_s is not None]
        ax.bar([x for x, _ in got], [y for _, y in got], width, color=_COLORS["measured"],
               label="measured (profiled forward, its nodes as run)")  # fmt: skip
    _layer_ticks(ax, [r.label for r in rows])
    ax.set_xlabel("layer" + (f" ({layer_stages_text(plan)})" if plan.pp > 1 else ""))
    mb = f"all {plan.micro_batches} micro-batches" if plan.micro_batches > 1 else "one micro-batch"
    ax.set_ylabel(f"one layer's time per step,\n{mb} (ms)")
    ax.margins(y=0.12)
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    note = (
        "measured beside predicted"
        if measured
        else "predicted (per-layer times are measured by --run of pp=1 forward plans)"
    )
    ax.set_title(
        f"Per-layer time: {title(plan)}\n{note}; {layer_totals_caption(plan, rows)}", fontsize=9, loc="left"
    )
    return fig


def layer_stages_text(plan: Plan) -> str:
    """Which layers each pipeline stage holds: "stage 0: 0-2, stage 1: 3-5"."""
    by_stage: dict[int, list[int]] = {}
    for c in plan.predicted.per_layer:
        if c.layer >= 0:
            by_stage.setdefault(c.stage, []).append(c.layer)
    return "; ".join(f"stage {s}: {layer_ranges(layers)}" for s, layers in sorted(by_stage.items()))


def layer_totals_caption(plan: Plan, rows: list[LayerTime]) -> str:
    """The layer figure's totals, saying what they are. pp = 1: the bars' sum beside the step's compute
    and comm. pp > 1: the bars' sum is work over all stages (stages run in parallel), so the caption
    gives each stage's own time per step too and names the slowest, whose time the step's is."""
    summed = ", ".join(
        f"{name} {sum(v) * _MS:.3g} ms"
        for name, v in (
            ("compute", [r.compute_s for r in rows]),
            ("exposed comm", [r.exposed_comm_s for r in rows]),
            ("overlapped", [r.overlapped_comm_s for r in rows]),
        )
    )
    p = plan.predicted
    step = f"the step's compute {p.compute_s * _MS:.3g} ms and exposed comm {p.exposed_comm_s * _MS:.3g} ms"
    has_tail = bool(p.optimizer_s or p.grad_sync_s)
    if plan.pp == 1 or len(p.per_stage) != plan.pp:
        tail = " (with the optimizer step and DP all-reduce)" if has_tail else ""
        return f"bars summed: {summed}; {step}{tail}"
    tail = " plus the optimizer step and DP all-reduce" if has_tail else ""
    m = plan.micro_batches
    stages = p.per_stage
    slowest = max(stages, key=lambda s: s.compute_s + s.exposed_comm_s)
    per_stage = ", ".join(
        f"stage {s.stage} {m * s.compute_s * _MS:.3g} + {m * s.exposed_comm_s * _MS:.3g} ms" for s in stages
    )
    return (
        f"bars of all {plan.pp} stages summed (work over ranks, not step time): {summed}\n"
        f"per stage per step (compute + exposed comm, point-to-point included): {per_stage}\n"
        f"{step} are stage {slowest.stage}'s (the slowest){tail}"
    )


def _memory(plan: Plan, report: dict[str, Any] | None, capacity_bytes: float | None) -> Figure:
    rows = stage_memory(plan, report)
    fig, ax = _figure(max(6.0, 2.0 + 1.2 * len(rows)), 4.2)
    measured = any(r.measured_bytes is not None for r in rows)
    width = 0.38 if measured else 0.6
    xs = [i - width / 2 if measured else i for i in range(len(rows))]
    pred = [r.predicted_bytes / _GIB for r in rows]
    got = [
        (i + width / 2, r.measured_bytes / _GIB) for i, r in enumerate(rows) if r.measured_bytes is not None
    ]
    values = pred + [y for _, y in got if y > 0]
    cap = capacity_bytes / _GIB if capacity_bytes else None
    top = max(values + ([cap] if cap else []))
    log = min(values) > 0 and top / min(values) > 20  # else the small bars lie flat
    if log:
        ax.set_yscale("log")
    bars = ax.bar(xs, pred, width, color=_COLORS["compute"], label="predicted")
    ax.bar_label(bars, [_gib_text(v, cap) for v in pred], fontsize=7)
    if measured:
        measured_label = (
            "measured peak above start-up\n(largest rank of the stage)"
            if all(r.above_startup for r in rows)
            else "measured process peak, torch and the\nrun's own buffers included (largest rank)"
        )
        mbars = ax.bar([x for x, _ in got], [y for _, y in got], width, color=_COLORS["measured"],
                       label=measured_label)  # fmt: skip
        ax.bar_label(mbars, [_gib_text(y, cap) for _, y in got], fontsize=7)
    if cap is not None:
        ax.axhline(cap, color="#C44E52", linestyle="--", label=f"device memory {_gib_text(cap)}")
    if log:
        ax.set_ylim(min(v for v in values if v > 0) / 10, top * 3)
    else:
        ax.set_ylim(0, top * 1.15)
    labels = [f"stage {r.stage}\nranks {_ranks_text(r.ranks)}" for r in rows]
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("memory per rank (GiB" + (", log scale)" if log else ")"))
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"Memory per rank: {title(plan)}", fontsize=9, loc="left")
    return fig


def _ladder(plan: Plan) -> Figure:
    rows = ladder_times(plan)
    fig, ax = _figure(max(7.0, min(18.0, 2.5 + 0.5 * len(rows))), 4.5)
    width = 0.4
    xs = range(len(rows))
    ax.bar([x - width / 2 for x in xs], [r.standard_s * _MS for r in rows], width, color=_COLORS["exposed"],
           label="standard residual (same splits)")  # fmt: skip
    ax.bar([x + width / 2 for x in xs], [r.ladder_s * _MS for r in rows], width, color=_COLORS["overlapped"],
           label="ladder residual")  # fmt: skip
    for i, r in enumerate(rows):
        if r.laddered:
            ax.axvspan(i - 0.5, i + 0.5, color="#55A868", alpha=0.1, linewidth=0)
    _layer_ticks(ax, [str(r.layer) for r in rows])
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.set_xlabel("layer (shaded: ladder residual)")
    ax.set_ylabel("time per step (ms)")
    ax.margins(y=0.12)
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    standard, ladder = sum(r.standard_s for r in rows), sum(r.ladder_s for r in rows)
    where = "layers together" if plan.pp == 1 else f"layers of all {plan.pp} stages together (not the step)"
    line = (
        f"{where}: standard {standard * _MS:.4g} ms, ladder {ladder * _MS:.4g} ms ({standard / ladder:.3f}x)"
    )
    if plan.serving is not None and plan.serving.standard_tpot_s:
        sv = plan.serving
        line += (
            f"; decode step: standard {sv.standard_tpot_s * _MS:.4g} ms, ladder {sv.tpot_s * _MS:.4g} ms "
            f"({sv.standard_tpot_s / sv.tpot_s:.3f}x)"
        )
    ax.set_title(f"Ladder residual per layer: {title(plan)}\n{line}", fontsize=9, loc="left")
    return fig


def _layer_ticks(ax: Any, labels: list[str]) -> None:
    """Every layer's label up to 40 layers, else every few (the ends' label always)."""
    step = 1 if len(labels) <= 40 else math.ceil(len(labels) / 40 / 5) * 5
    keep = [i for i, label in enumerate(labels) if i % step == 0 or not label.isdigit()]
    ax.set_xticks(keep, [labels[i] for i in keep], fontsize=8)


def _gib_text(gib: float, capacity_gib: float | None = None) -> str:
    text = f"{gib:.2f} GiB" if gib >= 0.1 else f"{gib * 1024:.1f} MiB"
    if capacity_gib:
        share = gib / capacity_gib
        text += f"\n{share:.0%}" if share >= 0.01 else f"\n{share:.2%}"
    return text


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) <= 4:
        return ",".join(map(str, ranks))
    return f"{ranks[0]},{ranks[1]},...,{ranks[-1]} ({len(ranks)})"

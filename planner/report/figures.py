"""The data behind `planner ... --plot DIR`'s figures, computed from a plan (and a run's report).

Each function returns plain values that `planner.report.plots` draws unchanged, so a test can check a
figure's numbers against the plan and report without looking at pixels.

    schedule_timeline(plan)             the pipeline schedule: (stage, kind, micro-batch, start, end) boxes
    layer_times(plan, report)           per layer: compute / exposed / overlapped comm, measured beside
    stage_memory(plan, report)          memory per rank of each stage, predicted and measured
    ladder_times(plan)                  ladder plans: each layer's time with and without ladder residual

The timeline is the schedule's own definition run on the plan's per-stage costs
(`Prediction.per_stage`): every rank executes its forward (F) and backward (B) passes in the order the
schedule prescribes, each starting when the rank is free and its input has arrived (F of micro-batch
i on stage s after F of i on stage s-1; B after B on stage s+1, or after the last stage's F). Orders:

- GPipe (Huang et al. 2019): all forwards, then all backwards;
- 1F1B (Narayanan et al. 2021, PipeDream-Flush): stage s runs min(p-s-1, m) forwards, then alternates
  one forward and one backward, then drains the remaining backwards;
- interleaved 1F1B (Narayanan et al. 2021, section 2.2.2): rank r holds v model chunks, chunk c being
  virtual stage c*p + r; forwards visit chunks in groups of p micro-batches (chunk (k // p) % v of the
  k-th forward), backwards in reverse chunk order; (p-r-1)*2 + (v-1)*p warm-up forwards, then 1F1B.
  Needs m to be a multiple of p, as in Megatron-LM.

A stage's time per micro-batch is split into forward and backward the way the cost model prices
training (`costing.TRAIN_COMPUTE_FACTOR`: backward computes twice what forward does; each collective
has a backward conjugate, `TRAIN_COMM_FACTOR`); a chunk of an interleaved rank takes 1/v of its
rank's time. After the pipeline drains, training adds the DP gradient all-reduce and the optimizer
step on every rank, and the unplanned all-gathers (`Plan.fallbacks`) are added to the step as the
prediction adds them. The predicted step time itself is `costing.step_time_s` (the stages' sum plus
(m-1) times the slowest; interleaved: the sum / v plus (m - 1/v) times the slowest);
`Timeline.schedule_s` and `Timeline.formula_s` hold both so the figure can say how they relate (equal
for equal stages and for GPipe/forward-only pipelines).

The bubble has one definition, the plan's (`Prediction.bubble_s`): the pipeline's length beyond m times
the slowest stage's time per micro-batch. `Timeline.bubble_s` is it on the cost model's pipeline, so the
figure quotes the same number as the plan table; `Timeline.schedule_bubble_s` is it on the drawn order
and `Timeline.stage_idle_s` each stage's idle time there. On unequal stages the drawn order can be
shorter than the formula (interleaved 1F1B whose first stage is the slowest never lets it wait), so the
two bubbles can differ; the figure names both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.plan import Plan, Schedule, Workload
from planner.solver.costing import TRAIN_COMM_FACTOR, TRAIN_COMPUTE_FACTOR, step_time_s

FORWARD, BACKWARD, GRAD_SYNC, OPTIMIZER = "forward", "backward", "DP grad all-reduce", "optimizer step"


class NoStageCosts(ValueError):
    """The plan records no per-stage costs (written before they were): re-plan it to draw them."""


@dataclass(frozen=True)
class Box:
    """One pass of one micro-batch (or the step's tail work) on one pipeline stage, in seconds."""

    stage: int  # pipeline rank
    kind: str  # FORWARD | BACKWARD | GRAD_SYNC | OPTIMIZER
    micro_batch: int  # -1 for the tail work
    chunk: int  # model chunk on this rank (interleaved 1F1B); 0 otherwise
    start_s: float
    end_s: float


@dataclass
class Timeline:
    """The pipeline schedule of one step and how its length relates to the prediction."""

    boxes: list[Box]
    stages: int
    micro_batches: int
    chunks: int  # model chunks per rank (virtual stages)
    schedule: str
    pipeline_s: float  # the micro-batches' makespan (first forward to last backward)
    tail_s: float  # DP gradient all-reduce + optimizer step, after the pipeline
    fallback_s: float  # unplanned all-gathers the prediction adds (Plan.fallbacks)
    schedule_s: float  # pipeline_s + tail_s + fallback_s: this schedule's step
    formula_s: float  # the cost model's step: step_time_s(sum, slowest, m, v) + tail + fallbacks
    predicted_s: float  # plan.predicted.latency_s
    bubble_s: float  # the plan's bubble: the cost model's pipeline beyond m x the slowest stage

    @property
    def stage_idle_s(self) -> list[float]:
        """Idle time of each stage during the drawn pipeline (seconds): its makespan less the stage's
        forward and backward passes."""
        busy = [0.0] * self.stages
        for b in self.boxes:
            if b.kind in (FORWARD, BACKWARD):
                busy[b.stage] += b.end_s - b.start_s
        return [self.pipeline_s - x for x in busy]

    @property
    def schedule_bubble_s(self) -> float:
        """The bubble of the drawn order (seconds): its pipeline beyond m x the slowest stage, i.e. the
        slowest stage's idle time. Equals `bubble_s` for equal stages."""
        return min(self.stage_idle_s)


def stage_pass_times_s(plan: Plan) -> list[tuple[float, float]]:
    """(forward, backward) seconds of one micro-batch on each stage; backward 0 unless training.
    Raises NoStageCosts for a plan without `predicted.per_stage`."""
    stages = plan.predicted.per_stage
    if len(stages) != plan.pp:
        raise NoStageCosts(
            f"the plan records no per-stage costs ({len(stages)} for pp={plan.pp}); re-plan it with planner optimize"
        )
    if plan.workload is not Workload.TRAIN:
        return [(s.compute_s + s.exposed_comm_s, 0.0) for s in stages]
    out = []
    for s in stages:
        forward = s.compute_s / TRAIN_COMPUTE_FACTOR + s.exposed_comm_s / TRAIN_COMM_FACTOR
        out.append((forward, s.compute_s + s.exposed_comm_s - forward))
    return out


def rank_order(
    schedule: str, stages: int, rank: int, micro_batches: int, chunks: int, train: bool
) -> list[tuple[str, int, int]]:
    """The (kind, micro-batch, chunk) passes rank `rank` runs, in order (see the module docstring).
    Raises ValueError for an interleaved schedule whose micro-batches are not a multiple of the stages."""
    p, m, v = stages, micro_batches, chunks
    if schedule == Schedule.INTERLEAVED_1F1B and v > 1:
        if m % p:
            raise ValueError(
                f"interleaved 1F1B needs micro-batches ({m}) to be a multiple of the stages ({p})"
            )
        total = m * v

        def mb(k: int) -> int:
            return (k // (p * v)) * p + k % p

        fwd = [(FORWARD, mb(k), (k // p) % v) for k in range(total)]
        bwd = [(BACKWARD, mb(k), v - 1 - (k // p) % v) for k in range(total)]
        warm = min((p - rank - 1) * 2 + (v - 1) * p, total)
    else:
        fwd = [(FORWARD, i, 0) for i in range(m)]
        bwd = [(BACKWARD, i, 0) for i in range(m)]
        warm = m if schedule == Schedule.GPIPE else min(p - rank - 1, m)
    if not train:
        return fwd
    order = fwd[:warm]
    for k in range(len(fwd) - warm):
        order += [fwd[warm + k], bwd[k]]
    return order + bwd[len(fwd) - warm :]


def pipeline_boxes(
    pass_times_s: list[tuple[float, float]], micro_batches: int, schedule: str, chunks: int, train: bool
) -> list[Box]:
    """Run the schedule: every pass as early as its rank and its input allow (module docstring).

    pass_times_s: (forward, backward) seconds of one micro-batch through each stage's whole share of
    the model (a chunk takes 1/chunks of it). Returns the boxes in the order they were placed."""
    p, v = len(pass_times_s), max(1, chunks)
    last = p * v - 1  # the last virtual stage
    orders = [rank_order(schedule, p, r, micro_batches, v, train) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, virtual stage) -> end
    free = [0.0] * p
    nxt = [0] * p
    boxes: list[Box] = []
    while any(nxt[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while nxt[r] < len(orders[r]):
                kind, i, c = orders[r][nxt[r]]
                j = c * p + r
                if kind == FORWARD:
                    dep = (FORWARD, i, j - 1) if j > 0 else None
                else:
                    dep = (BACKWARD, i, j + 1) if j < last else (FORWARD, i, last)
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done[dep] if dep is not None else 0.0)
                f, b = pass_times_s[r]
                end = start + (f if kind == FORWARD else b) / v
                done[(kind, i, j)] = end
                free[r] = end
                boxes.append(Box(r, kind, i, c, start, end))
                nxt[r] += 1
                progressed = True
        assert progressed, "the schedule's pass orders wait on each other"  # a bug in rank_order
    return boxes


def schedule_timeline(plan: Plan) -> Timeline:
    """The plan's pipeline schedule of one step, with its tail work. Raises NoStageCosts (old plan)
    or ValueError (interleaved with micro-batches not a multiple of the stages)."""
    times = stage_pass_times_s(plan)
    train = plan.workload is Workload.TRAIN
    v = plan.virtual_stages if plan.schedule == Schedule.INTERLEAVED_1F1B else 1
    boxes = pipeline_boxes(times, plan.micro_batches, str(plan.schedule), v, train)
    pipeline_s = max(b.end_s for b in boxes)
    p = plan.predicted
    for stage in range(plan.pp):
        start = pipeline_s
        for kind, seconds in ((GRAD_SYNC, p.grad_sync_s), (OPTIMIZER, p.optimizer_s)):
            if seconds > 0:
                boxes.append(Box(stage, kind, -1, 0, start, start + seconds))
                start += seconds
    tail_s = p.grad_sync_s + p.optimizer_s
    fallback_s = sum(f.comm_s for f in plan.fallbacks)
    per_stage = [f + b for f, b in times]
    formula_pipeline_s = step_time_s(sum(per_stage), max(per_stage), plan.micro_batches, v)
    formula_s = formula_pipeline_s + tail_s + fallback_s
    return Timeline(
        boxes=boxes,
        stages=plan.pp,
        micro_batches=plan.micro_batches,
        chunks=v,
        schedule=str(plan.schedule),
        pipeline_s=pipeline_s,
        tail_s=tail_s,
        fallback_s=fallback_s,
        schedule_s=pipeline_s + tail_s + fallback_s,
        formula_s=formula_s,
        predicted_s=p.latency_s,
        bubble_s=max(0.0, formula_pipeline_s - plan.micro_batches * max(per_stage)),
    )


@dataclass(frozen=True)
class LayerTime:
    """One layer's (or the ends', layer -1) time per step: predicted split, and measured when run."""

    layer: int
    label: str  # "0", "1", ..., "ends"
    compute_s: float
    exposed_comm_s: float
    overlapped_comm_s: float
    measured_s: float | None  # profiled forward time of its nodes (runtime.profile), or None


def layer_times(plan: Plan, report: dict[str, Any] | None = None) -> list[LayerTime]:
    """Per layer, in order, the ends last: `plan.predicted.per_layer` and the run's
    `measured.per_layer_s` ("layer i", "ends"; present for pp=1 forward runs)."""
    measured = ((report or {}).get("measured") or {}).get("per_layer_s") or {}
    rows = []
    for c in sorted(plan.predicted.per_layer, key=lambda c: (c.layer < 0, c.layer)):
        key = f"layer {c.layer}" if c.layer >= 0 else "ends"
        rows.append(
            LayerTime(
                c.layer,
                str(c.layer) if c.layer >= 0 else "ends",
                c.compute_s,
                c.exposed_comm_s,
                c.overlapped_comm_s,
                measured.get(key),
            )
        )
    return rows


@dataclass(frozen=True)
class StageMemory:
    """Memory per rank of one pipeline stage: predicted, and the run's peak above start-up."""

    stage: int
    ranks: list[int]  # global ranks holding the stage
    predicted_bytes: float
    measured_bytes: float | None  # the largest of its ranks' process peaks (minus start-up), or None
    above_startup: bool  # measured_bytes excludes what the process held before the model


def stage_memory(plan: Plan, report: dict[str, Any] | None = None) -> list[StageMemory]:
    """Per stage (`Prediction.per_stage`, every rank of a stage holds the same); measured from the
    report's `per_rank_peak_memory_bytes` less `startup_memory_bytes` (when the run recorded it:
    serving runs do not) when a run happened. Raises NoStageCosts for a plan without per-stage costs."""
    if len(plan.predicted.per_stage) != plan.pp:
        raise NoStageCosts("the plan records no per-stage costs; re-plan it with planner optimize")
    measured = (report or {}).get("measured") or {}
    peaks = measured.get("per_rank_peak_memory_bytes") or []
    startup = measured.get("startup_memory_bytes")
    mesh = plan.mesh
    rows = []
    for s in plan.predicted.per_stage:
        ranks = [r for r in range(mesh.num_devices) if mesh.coords(r)[1] == s.stage]
        got = [peaks[r] - (startup or 0) for r in ranks if r < len(peaks)]
        rows.append(
            StageMemory(s.stage, ranks, s.memory_bytes, max(got) if got else None, startup is not None)
        )
    return rows


@dataclass(frozen=True)
class LadderTime:
    """One layer's time per step with ladder residual and with the same splits without it."""

    layer: int
    laddered: bool
    ladder_s: float  # compute + exposed comm (the overlapped comm is hidden)
    standard_s: float  # compute + all its comm exposed: the block outputs' all-reduces wait


def ladder_times(plan: Plan) -> list[LadderTime]:
    """Per transformer layer: without ladder residual a layer's hidden communication
    (`LayerCost.overlapped_comm_s`) is exposed, nothing else changes (`prediction.layer_breakdown`)."""
    ladder = set(plan.ladder_layers)
    return [
        LadderTime(
            c.layer,
            c.layer in ladder,
            c.compute_s + c.exposed_comm_s,
            c.compute_s + c.exposed_comm_s + c.overlapped_comm_s,
        )
        for c in sorted(plan.predicted.per_layer, key=lambda c: c.layer)
        if c.layer >= 0
    ]


def title(plan: Plan) -> str:
    """ "model on cluster: tp=2 pp=2 dp=1, 1f1b, 4 micro-batches, train bf16"."""
    model = plan.model.rsplit("/", 1)[-1]
    sched = ""
    if plan.pp > 1:
        sched = f", {plan.schedule}" + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else "")
        sched += f", {plan.micro_batches} micro-batches"
    return f"{model} on {plan.cluster}: {plan.mesh.label()}{sched}, {plan.workload} {plan.dtype}"

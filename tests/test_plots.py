"""`--plot`: the figures' data (planner.report.figures) against the plan and report they come from,
the schedule simulation against the schedules' known step lengths, and the files written. No pixels."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from rich.console import Console

from costmodels.cluster import load_cluster
from planner.cli.main import main
from planner.cli.render import fmt_s, render_plan
from planner.plan import Schedule
from planner.report.figures import (
    BACKWARD,
    FORWARD,
    NoStageCosts,
    ladder_times,
    layer_times,
    pipeline_boxes,
    rank_order,
    schedule_timeline,
    stage_memory,
)
from planner.report.plots import layer_totals_caption, timeline_caption, write_figures
from planner.solver.costing import step_time_s
from planner.solver.problem import Constraints, LadderPolicy, WorkloadSpec
from planner.solver.search import plan_model
from planner.solver.serving import predict_with_plan
from tests.planner_fixtures import handmade_llama

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def train_plan():
    """TP=2 x PP=2 training of a small Llama on H100s, 8 micro-batches of 1F1B."""
    structure = handmade_llama(num_layers=6, hidden=2048, heads=16, kv_heads=8, ffn=8192)
    workload = WorkloadSpec("train", 8, 1024, micro_batches=8, dtype="bf16")
    return plan_model(
        structure,
        load_cluster("dgx-h100"),
        workload,
        Constraints(tp=2, pp=2, dp=1, schedule=Schedule.ONE_F_ONE_B),
        model_name="m.py",
    )


@pytest.fixture(scope="module")
def ladder_case():
    """Decode at TP=8 over PCIe with ladder residual on the upper 4 of 8 layers, and its inputs."""
    structure = handmade_llama(num_layers=8, hidden=8192, heads=64, kv_heads=8, ffn=28672)
    cluster = load_cluster("h100-pcie")
    workload = WorkloadSpec("decode", 1, 1, context=512)
    plan = plan_model(
        structure, cluster, workload, Constraints(tp=8, pp=1, dp=1, ladder=LadderPolicy.parse("upper:4"))
    )
    return plan, structure, cluster, workload


@pytest.fixture(scope="module")
def interleaved_plan():
    """TP=1 x PP=2 training of a small Llama on H100s, 4 micro-batches of interleaved 1F1B, v=2."""
    structure = handmade_llama(num_layers=8, hidden=1024, heads=8, kv_heads=8, ffn=4096)
    workload = WorkloadSpec("train", 4, 512, micro_batches=4, dtype="bf16")
    constraints = Constraints(tp=1, pp=2, dp=1, schedule=Schedule.INTERLEAVED_1F1B, virtual_stages=2)
    return plan_model(structure, load_cluster("dgx-h100"), workload, constraints, model_name="m.py")


def _check_schedule(boxes, stages: int, micro_batches: int, chunks: int, train: bool) -> None:
    """Every pass once, no two passes of a rank overlap, every pass after its input."""
    end = {(b.kind, b.micro_batch, b.chunk * stages + b.stage): b.end_s for b in boxes}
    kinds = (FORWARD, BACKWARD) if train else (FORWARD,)
    assert len(boxes) == len(end) == stages * micro_batches * chunks * len(kinds)
    last = stages * chunks - 1
    for b in boxes:
        j = b.chunk * stages + b.stage
        if b.kind == FORWARD and j > 0:
            assert b.start_s >= end[(FORWARD, b.micro_batch, j - 1)] - 1e-12
        if b.kind == BACKWARD:
            before = (BACKWARD, b.micro_batch, j + 1) if j < last else (FORWARD, b.micro_batch, last)
            assert b.start_s >= end[before] - 1e-12
    for r in range(stages):
        mine = sorted((b for b in boxes if b.stage == r), key=lambda b: b.start_s)
        assert all(x.end_s <= y.start_s + 1e-12 for x, y in itertools.pairwise(mine))


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v"),
    [
        ("gpipe", 4, 6, 1),
        ("1f1b", 4, 8, 1),
        ("1f1b", 3, 2, 1),
        ("interleaved_1f1b", 4, 8, 2),
        ("interleaved_1f1b", 2, 4, 4),
    ],
)
def test_equal_stages_give_the_schedules_known_step(schedule: str, p: int, m: int, v: int) -> None:
    f, b = 1.0, 2.0  # seconds of one micro-batch through a whole rank's share
    boxes = pipeline_boxes([(f, b)] * p, m, schedule, v, train=True)
    _check_schedule(boxes, p, m, v, train=True)
    # GPipe and 1F1B: (m + p - 1) stage times; interleaved: the fill and drain shrink by v (Narayanan et al.)
    want = (m + p - 1) * (f + b) if v == 1 else m * (f + b) + (p - 1) * (f + b) / v
    assert max(x.end_s for x in boxes) == pytest.approx(want)


def test_one_f_one_b_holds_at_most_p_minus_s_micro_batches() -> None:
    p, m = 4, 8
    for s in range(p):
        held = peak = 0
        for kind, _, _ in rank_order("1f1b", p, s, m, 1, train=True):
            held += 1 if kind == FORWARD else -1
            peak = max(peak, held)
        assert peak == p - s


def test_forward_pipeline_matches_the_cost_models_step() -> None:
    times = [(1.0, 0.0), (1.5, 0.0), (0.5, 0.0)]  # unequal stages, inference
    boxes = pipeline_boxes(times, 5, "1f1b", 1, train=False)
    _check_schedule(boxes, 3, 5, 1, train=False)
    assert max(x.end_s for x in boxes) == pytest.approx(sum(t for t, _ in times) + 4 * 1.5)


def test_interleaved_needs_whole_rounds_of_micro_batches() -> None:
    with pytest.raises(ValueError, match="multiple of the stages"):
        rank_order(Schedule.INTERLEAVED_1F1B, 4, 0, 6, 2, train=True)


def test_timeline_of_a_training_plan_adds_up_to_its_prediction(train_plan) -> None:
    t = schedule_timeline(train_plan)
    p = train_plan.predicted
    _check_schedule([b for b in t.boxes if b.micro_batch >= 0], 2, 8, 1, train=True)
    assert t.formula_s == pytest.approx(p.latency_s, rel=1e-9)  # per-stage costs are the prediction's
    assert t.tail_s == pytest.approx(p.grad_sync_s + p.optimizer_s) and p.optimizer_s > 0
    assert t.schedule_s == pytest.approx(p.latency_s, rel=0.05)  # 1F1B itself, on unequal stages
    assert 0 < t.bubble_s < t.pipeline_s / 2
    per_stage = [s.compute_s + s.exposed_comm_s for s in p.per_stage]
    busy = [
        sum(b.end_s - b.start_s for b in t.boxes if b.stage == s and b.micro_batch >= 0) for s in range(2)
    ]
    assert busy == pytest.approx([8 * x for x in per_stage])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def test_interleaved_timeline_quotes_the_plans_bubble(interleaved_plan) -> None:
    plan = interleaved_plan
    p = plan.predicted
    assert plan.schedule == Schedule.INTERLEAVED_1F1B and plan.virtual_stages == 2 and p.bubble_s > 0
    t = schedule_timeline(plan)
    assert t.chunks == 2
    assert t.formula_s == pytest.approx(p.latency_s, rel=1e-9)  # the interleaved formula, v included
    assert t.bubble_s == pytest.approx(p.bubble_s, rel=1e-9)
    caption = timeline_caption(t)
    assert f"plan's bubble {_ms(p.bubble_s)} = {p.bubble_s / p.latency_s:.1%} of the step" in caption

    # Unequal stages, the first the slowest: the drawn interleaved order never lets stage 0 wait (its
    # own bubble 0) while stage 1 idles; the figure still quotes the plan's bubble, and says both.
    stages = [dataclasses.replace(p.per_stage[0], compute_s=3 * p.per_stage[0].compute_s), p.per_stage[1]]
    times = [s.compute_s + s.exposed_comm_s for s in stages]
    pipeline = step_time_s(sum(times), max(times), 4, 2)
    latency = pipeline + p.grad_sync_s + p.optimizer_s
    bubble = pipeline - 4 * max(times)
    assert bubble == pytest.approx((sum(times) - max(times)) / 2)  # (p-1)/v of the other stage
    skewed = dataclasses.replace(
        plan,
        predicted=dataclasses.replace(
            p, per_stage=stages, latency_s=latency, bubble_s=bubble, compute_s=4 * stages[0].compute_s
        ),
    )
    t = schedule_timeline(skewed)
    idle = t.stage_idle_s
    assert t.schedule_bubble_s == pytest.approx(0, abs=1e-12) and idle[0] == pytest.approx(0, abs=1e-12)
    assert idle[1] > 0
    assert t.bubble_s == pytest.approx(bubble, rel=1e-9) and t.formula_s == pytest.approx(latency)
    caption = timeline_caption(t)
    assert f"plan's bubble {_ms(bubble)} = {bubble / latency:.1%} of the step" in caption
    assert "bubble 0 ms" in caption and "saves" in caption  # the drawn order's own, named as such
    assert f"stage 1 {idle[1] * 1e3:.3g}" in caption


def test_pp_plan_table_and_layer_figure_say_what_their_totals_are(train_plan) -> None:
    """pp > 1: per-layer numbers are one layer per step (all micro-batches); the table's stage totals
    and the layer figure's per-stage times are the plan's per-stage costs per step, the slowest of which
    (plus the tail) is the headline; the bars' sum is named work over all stages, not the step."""
    plan, p, m = train_plan, train_plan.predicted, train_plan.micro_batches
    assert plan.pp == 2 and m == 8
    stage_totals = [(m * s.compute_s, m * s.exposed_comm_s) for s in p.per_stage]
    slowest = max(range(2), key=lambda s: sum(stage_totals[s]))
    assert p.compute_s == pytest.approx(stage_totals[slowest][0] + p.optimizer_s)
    assert p.exposed_comm_s == pytest.approx(stage_totals[slowest][1] + p.grad_sync_s)
    bars = sum(c.compute_s for c in p.per_layer)
    assert bars == pytest.approx(sum(c for c, _ in stage_totals))  # work over both stages ...
    assert bars > p.compute_s  # ... which is not the step's compute

    console = Console(record=True, width=250)
    render_plan(console, plan)
    text = console.export_text()
    assert "Per layer: one layer's time per step (all 8 micro-batches) on a rank of its stage" in text
    assert "(per step, per rank)" not in text
    for s, (compute, exposed) in enumerate(stage_totals):
        row = next(line for line in text.splitlines() if f"│     {s} │ stage total" in line)
        assert fmt_s(compute) in row and fmt_s(exposed) in row
    assert f"slowest stage's total (stage {slowest})" in " ".join(text.split())
    assert "not the sum of the rows" in " ".join(text.split())

    caption = layer_totals_caption(plan, layer_times(plan))
    assert f"bars of all 2 stages summed (work over ranks, not step time): compute {_ms(bars)}" in caption
    for s, (compute, exposed) in enumerate(stage_totals):
        assert f"stage {s} {_ms(compute)[:-3]} + {_ms(exposed)}" in caption
    assert f"the step's compute {_ms(p.compute_s)} and exposed comm {_ms(p.exposed_comm_s)}" in caption
    assert f"are stage {slowest}'s (the slowest) plus the optimizer step" in caption
    assert "summed: compute" not in caption.replace("stages summed", "")  # no bare sum posing as the step


def test_layer_memory_and_ladder_data_are_the_plans(train_plan, ladder_case) -> None:
    report = {"measured": {"per_layer_s": {"layer 0": 0.002, "ends": 0.001}, "startup_memory_bytes": 100,
                           "per_rank_peak_memory_bytes": [1100, 1300, 2100, 2000]}}  # fmt: skip
    rows = layer_times(train_plan, report)
    by_layer = {c.layer: c for c in train_plan.predicted.per_layer}
    assert [r.layer for r in rows] == [0, 1, 2, 3, 4, 5, -1]
    for r in rows:
        c = by_layer[r.layer]
        assert (r.compute_s, r.exposed_comm_s, r.overlapped_comm_s) == (
            c.compute_s,
            c.exposed_comm_s,
            c.overlapped_comm_s,
        )
    assert [r.measured_s for r in rows] == [0.002, None, None, None, None, None, 0.001]
    mem = stage_memory(train_plan, report)
    assert [m.ranks for m in mem] == [[0, 1], [2, 3]]  # tp innermost
    assert [m.predicted_bytes for m in mem] == [s.memory_bytes for s in train_plan.predicted.per_stage]
    assert max(m.predicted_bytes for m in mem) == train_plan.predicted.peak_memory_bytes
    assert [m.measured_bytes for m in mem] == [1200, 2000] and all(m.above_startup for m in mem)

    plan, structure, cluster, workload = ladder_case
    assert plan.ladder_layers == [4, 5, 6, 7]
    rows = ladder_times(plan)
    assert all(r.ladder_s < r.standard_s for r in rows if r.laddered)
    assert all(r.ladder_s == r.standard_s for r in rows if not r.laddered)
    ends = next(c for c in plan.predicted.per_layer if c.layer < 0)
    ends_s = ends.compute_s + ends.exposed_comm_s
    assert sum(r.ladder_s for r in rows) + ends_s == pytest.approx(plan.predicted.latency_s)
    # the standard bars add up to the solver's own prediction of the same splits without ladder
    standard = predict_with_plan(plan, structure, cluster, workload, [])
    assert sum(r.standard_s for r in rows) + ends_s == pytest.approx(standard, rel=1e-9)


def test_write_figures_and_show_plot(tmp_path, train_plan, ladder_case) -> None:
    figures = write_figures(train_plan, tmp_path / "train", None, 80 * 2**30)
    assert [p.name for p in figures.files] == ["timeline.png", "layer_times.png", "memory.png"]
    assert not figures.notes
    assert all(p.read_bytes().startswith(PNG) for p in figures.files)
    old = dataclasses.replace(train_plan, predicted=dataclasses.replace(train_plan.predicted, per_stage=[]))
    with pytest.raises(NoStageCosts):
        schedule_timeline(old)
    plan = ladder_case[0]
    plan.to_yaml(tmp_path / "ladder.yaml")
    assert main(["show", str(tmp_path / "ladder.yaml"), "--plot", str(tmp_path / "fig")]) == 0
    written = sorted(p.name for p in (tmp_path / "fig").glob("*.png"))
    assert written == ["ladder.png", "layer_times.png", "memory.png", "timeline.png"]
    assert main(["show", str(tmp_path / "ladder.yaml"), "--plot", str(tmp_path / "ladder.yaml")]) == 2

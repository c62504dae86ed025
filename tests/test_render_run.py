"""The "Predicted vs measured" table (planner.cli.render.render_run) at a terminal's width."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from planner.cli.render import render_run

LABELS = (
    "latency",
    "latency at the run's machine speed",
    "peak memory / rank, above start-up",
    "process peak memory / rank",
    "heap peak / rank, above start-up",
)


def _report() -> dict:
    """A 2-rank run's report as workflow writes it, with the speed probe re-pricing (forward, backward
    and matmul readings: the longest probe text)."""
    return {
        "predicted": {"latency_s": 2.4e-3, "peak_memory_bytes": 3 * 2**20},
        "measured": {
            "latency_s": 2.8e-3,
            "latency_p10_s": 2.5e-3,
            "latency_p90_s": 3.5e-3,
            "per_rank_median_s": [2.5e-3, 2.8e-3],
            "iterations": 10,
            "peak_memory_bytes": 350 * 2**20,
            "startup_memory_bytes": 300 * 2**20,
            "heap_peak_bytes": 4 * 2**20,  # CPU: the live heap (runtime.measure.heap_peak_bytes)
            "at_run_speed": {
                "latency_s": 2.9e-3,
                "speed_ratio": 1.9,
                "node_overhead_s": 14.2e-6,
                "calibrated_node_overhead_s": 7.5e-6,
                "backward_ratio": 1.8,
                "backward_node_overhead_s": 30.1e-6,
                "calibrated_backward_node_overhead_s": 16.4e-6,
                "matmul_ratio": 1.2,
                "matmul_flops_per_s": 95.1e9,
                "calibrated_matmul_flops_per_s": 110.2e9,
            },
        },
        "numerics": {"max_abs_diff": 0.0, "output_scale": 0.9},
    }


@pytest.mark.parametrize("width", [80, 100, 120])
def test_predicted_vs_measured_keeps_each_quantity_on_one_line(width: int) -> None:
    """No quantity label is broken across lines (one was cut mid-parenthesis at 100 columns), and the
    speed probe's readings are still printed in full."""
    out = io.StringIO()
    render_run(Console(file=out, width=width, color_system=None, highlight=False), _report())
    text = out.getvalue()
    first_cells = [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│")]
    assert first_cells == list(LABELS), f"a label broken across lines at {width} columns:\n{text}"
    flat = " ".join(text.split())
    for reading in (
        "14.2 µs per node (calibrated 7.5)",
        "backward 30.1 µs",
        "matmul 95.1 GFLOP/s (calibrated 110.2)",
    ):
        assert reading in flat, text


@pytest.mark.parametrize("width", [80, 100, 120])
def test_a_served_requests_table_keeps_each_quantity_on_one_line(width: int) -> None:
    """The serving table's speed row carried the probe's readings in its label and wrapped as the
    training table's did; the readings follow the table now."""
    from planner.cli.render import render_serving_run  # noqa: PLC0415

    timing = {"ttft_s": 2e-3, "tpot_s": 1.5e-3, "tokens_per_s": 600.0}
    report = _report()
    report["serving"] = {
        "predicted": {**timing, "prompt_len": 64, "new_tokens": 16, "batch_size": 1},
        "measured": dict(timing),
    }
    report["numerics"] = {
        "tokens_identical": True,
        "max_abs_diff": 0.0,
        "logit_tolerance": 1e-3,
        "output_scale": 1.0,
    }
    report["measured"].update(cache_bytes_per_rank=1024)
    out = io.StringIO()
    render_serving_run(Console(file=out, width=width, color_system=None, highlight=False), report)
    text = out.getvalue()
    first_cells = [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│")]
    assert "at the run's machine speed" in first_cells, text
    assert all(cell for cell in first_cells), f"a label broken across lines at {width} columns:\n{text}"
    assert "the probe between the timed steps read" in " ".join(text.split())


def test_a_plan_a_little_slower_than_a_baseline_does_not_read_as_fast_as_it():
    """A free plan within the solver's gap of the torchtitan recipe printed "1.00× its speed" while its
    step was 0.4% slower (162.801 ms against 162.143 ms)."""
    from planner.cli.render import speed_ratio_text  # noqa: PLC0415

    assert speed_ratio_text(162.143 / 162.801) == "0.996"
    assert speed_ratio_text(1.0) == "1.00" and speed_ratio_text(1.0002) == "1.00"
    assert speed_ratio_text(1.16) == "1.16" and speed_ratio_text(0.5) == "0.50"


def test_the_megatron_line_says_which_choices_differ_on_the_same_mesh(monkeypatch) -> None:
    """A plan on the mesh of the hand-written Megatron plan says what makes its speed ratio: the
    weight splits when they differ, and, training, the layout rows that differ (`--layout megatron`
    once printed "1.02x its speed" with the same splits and no word of where the difference was).
    The hand-written plan trains this narrow model at TP 1 (the model table's degree): the table is
    set aside so that it takes the node's TP 2, the plan's mesh."""
    from pathlib import Path  # noqa: PLC0415

    from planner.cli import workflow  # noqa: PLC0415
    from planner.cli.render import render_plan  # noqa: PLC0415
    from planner.plan import Recompute  # noqa: PLC0415
    from planner.solver import baseline  # noqa: PLC0415

    monkeypatch.setattr(baseline, "MEGATRON_TP_BY_HIDDEN", ())

    model = str(Path(__file__).parent / "models" / "inout_weights.py")

    def line(**options) -> str:
        constraints = workflow.constraints_from(2, None, None, "none", **options)
        prepared = workflow.prepare(model, workload="train")
        plan = workflow.make_plan(prepared, workflow.resolve_cluster(None, 2), constraints, model)
        out = io.StringIO()
        render_plan(Console(file=out, width=400), plan)
        return next(t for t in out.getvalue().splitlines() if t.startswith("Hand-written Megatron plan"))

    megatron = line(layout="megatron", recompute=Recompute.FULL)
    assert "(same mesh; it differs in recompute" in megatron and "weight splits" not in megatron, megatron
    assert "see the training layout table" in megatron, megatron
    free = line()  # the free plan keeps these tiny weights whole: other splits than Megatron's
    assert "(same mesh; it differs in weight splits" in free, free


def test_a_models_source_line_is_printed_as_written_with_its_brackets() -> None:
    """Excluded options, fallbacks and notes quote the model's source lines; rich read `x_pad[idx]` as
    markup and printed `x_pad` (the error line, printed as plain text, had it right)."""
    import dataclasses  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from planner.cli import workflow  # noqa: PLC0415
    from planner.cli.render import render_plan  # noqa: PLC0415

    model = str(Path(__file__).parent / "models" / "inout_weights.py")
    prepared = workflow.prepare(model, workload="forward")
    constraints = workflow.constraints_from(2, None, None, "none")
    plan = workflow.make_plan(prepared, workflow.resolve_cluster(None, 2), constraints, model)
    quoted = "ep>1: at m.py:51 `out.index_add_(0, idx, ex(x_pad[idx]) * comb_pad[idx, e].unsqueeze(-1))`"
    out = io.StringIO()
    render_plan(Console(file=out, width=400), dataclasses.replace(plan, excluded=[quoted]))
    assert f"excluded: {quoted}" in out.getvalue()


def test_small_sizes_read_in_kib_and_a_pipelines_memory_is_the_fullest_stages(capsys) -> None:
    """A decode run's 48 KiB KV cache per rank printed as "0.0 MiB"; and with pipeline stages the
    predicted peak per rank is the fullest stage's, which the line called "each"."""
    from planner.cli.render import _per_rank_memory, fmt_bytes  # noqa: PLC0415

    assert (fmt_bytes(48 * 2**10), fmt_bytes(5 * 2**20), fmt_bytes(0)) == ("48.0 KiB", "5.0 MiB", "0.0 MiB")
    m = {"per_rank_peak_memory_bytes": [9 * 2**20, 6 * 2**20], "per_rank_startup_memory_bytes": [0, 0]}
    for stages, words in ((1, "(predicted 9.0 MiB each)"), (2, "(predicted 9.0 MiB on the fullest stage)")):
        _per_rank_memory(Console(width=200), m, 9 * 2**20, stages)
        assert words in capsys.readouterr().out


def test_the_tail_names_a_stages_shared_weight_sync_at_dp_one() -> None:
    """At dp = 1 the step's tail syncs only what two stages share (an embedding tied to the LM head
    over pipeline stages): it read "DP gradient sync" with no data parallelism."""
    import dataclasses  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from planner.cli.render import render_plan  # noqa: PLC0415
    from planner.plan import MeshShape  # noqa: PLC0415
    from tests.plans import fixed_plan, meta_structure  # noqa: PLC0415

    model = str(Path(__file__).parent / "models" / "tiny_lm.py")
    plan = fixed_plan(meta_structure(model, 4, 8), model, 1, pp=2, workload="train", micro_batches=2)
    plan.predicted = dataclasses.replace(plan.predicted, grad_sync_s=0.002)
    for dp, words in ((1, "incl. sync of weights the stages share 2.000 ms"), (2, "incl. DP gradient sync")):
        out = io.StringIO()
        render_plan(Console(file=out, width=400), dataclasses.replace(plan, mesh=MeshShape(1, 2, dp)))
        assert words in out.getvalue(), out.getvalue()

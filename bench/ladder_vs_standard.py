"""Ladder residual against the standard transformer at TP=2: measured speedup beside the predicted one.

    python bench/ladder_vs_standard.py [--nproc 2] [--iters 15] [--cluster local-cpu|SPEC.yaml]

For each model, the planner (`planner.solver.search.plan_model`, tp pinned to `nproc`) plans three variants
on the given cluster spec: ladder `none`, `upper:N/2` and `upper:N` (all layers). Each plan's
predicted latency gives the predicted speedup standard / ladder. Every rank then builds the same
weights, captures the model once and lowers it per variant exactly as `runtime.execute.run_rank`
does (`passes.lower.lower_for_rank`: TP pass with the plan's splits, then the ladder pass on its
laddered layers' residual adds), and the variants are timed in interleaved rounds. Step time = slowest rank; the
table shows medians (p10-p90), the measured speedup (median of per-round ratios standard / ladder)
and the predicted one, plus how far ladder residual moved the logits (it changes the function).
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.timing import (  # noqa: E402
    REPO_ROOT,
    Spread,
    interleaved,
    machine_line,
    paired_ratio,
    sign_test,
    step_times,
)
from runtime.launch import RankContext, launch  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    model_path: str  # a model file (build_model / example_inputs)
    batch_size: int
    seq_len: int


CASES = (
    Case("llama3 mid (dim 1024, 8 layers)", str(REPO_ROOT / "bench" / "llama3_mid.py"), 1, 128),
    Case("gpt2 124M", str(REPO_ROOT / "examples" / "gpt2.py"), 1, 64),
)


@dataclass
class Payload:
    cases: tuple[Case, ...]
    plans: list[dict[str, dict]]  # per case: variant -> Plan.to_dict()
    iters: int
    warmup: int


def plan_variants(case: Case, cluster_name: str, tp: int) -> dict[str, object]:
    """Plans for ladder none / upper half / all layers with tp pinned (meta-device capture: no weights)."""
    from planner.cli.workflow import constraints_from, make_plan, prepare  # noqa: PLC0415

    prepared = prepare(case.model_path, batch_size=case.batch_size, seq_len=case.seq_len)
    from costmodels.cluster import load_cluster  # noqa: PLC0415

    cluster = load_cluster(cluster_name, nproc=tp)
    n = len(prepared.structure.layers)
    variants = {
        "standard": "none",
        f"ladder upper:{n // 2}": f"upper:{n // 2}",
        f"ladder all {n}": f"upper:{n}",
    }
    return {
        name: make_plan(prepared, cluster, constraints_from(tp, None, None, ladder), case.model_path)
        for name, ladder in variants.items()
    }


def entry(ctx: RankContext, payload: Payload) -> list[dict]:
    """Per rank: each case's variants rewritten from one capture, checked, then timed interleaved."""
    from passes import collectives  # noqa: PLC0415
    from passes.ladder import ladder_deviation  # noqa: PLC0415
    from passes.lower import lower_for_rank  # noqa: PLC0415
    from planner.frontend.analysis import analyse  # noqa: PLC0415
    from planner.frontend.capture import capture, flat_inputs  # noqa: PLC0415
    from planner.frontend.modelfile import load_model_file  # noqa: PLC0415
    from planner.plan import Plan  # noqa: PLC0415
    from runtime.mesh import build_rank_groups  # noqa: PLC0415

    results = []
    for case, plan_dicts in zip(payload.cases, payload.plans):
        plans = {name: Plan.from_dict(d) for name, d in plan_dicts.items()}
        groups = build_rank_groups(next(iter(plans.values())).mesh, "cpu")
        collectives.register_group("tp", groups.group("tp"))
        model_file = load_model_file(case.model_path)
        torch.manual_seed(0)
        model = model_file.build("cpu")
        args, kwargs = model_file.inputs(case.batch_size, case.seq_len)
        inputs = flat_inputs(args, kwargs)
        full = capture(model, args, kwargs)
        structure = analyse(full)
        fns, outputs = {}, {}
        for name, plan in plans.items():
            gm = lower_for_rank(copy.deepcopy(full), structure, plan, ctx.rank).module
            with torch.no_grad():
                out = gm(*inputs)
            outputs[name] = out[0] if isinstance(out, tuple) else out
            fns[name] = lambda gm=gm, inputs=inputs: gm(*inputs)
        standard = outputs["standard"]
        deviation = {name: ladder_deviation(standard, out) for name, out in outputs.items()}
        with torch.no_grad():
            samples = interleaved(fns, iters=payload.iters, warmup=payload.warmup)
        results.append(dict(samples=samples, deviation=deviation))
        del full, model
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="gloo ranks = TP degree (default 2)")
    parser.add_argument("--iters", type=int, default=30, help="timed rounds per case (default 30)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument(
        "--cluster", default="local-cpu", help="preset or spec YAML for the prediction (default local-cpu)"
    )
    args = parser.parse_args(argv)
    console = Console(width=150)
    console.print(f"[bold]Ladder residual vs standard[/], tp={args.nproc} gloo ranks, {machine_line()}")
    plans = [plan_variants(case, args.cluster, args.nproc) for case in CASES]
    payload = Payload(CASES, [{k: p.to_dict() for k, p in v.items()} for v in plans], args.iters, args.warmup)
    results = launch(entry, payload, nproc=args.nproc, timeout_s=900)

    table = Table(
        title=f"Forward latency, TP={args.nproc}, cluster spec {args.cluster!r}, median (p10-p90) of "
        f"{args.iters} interleaved rounds"
    )
    for col in ("model", "variant", "predicted", "measured", "speedup predicted", "speedup measured",
                "ladder faster in", "logit deviation"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("model", "variant") else "right")
    summary = []
    for i, (case, case_plans) in enumerate(zip(CASES, plans)):
        steps = {name: step_times([r[i]["samples"][name] for r in results]) for name in case_plans}
        base_pred = case_plans["standard"].predicted.latency_s
        for name, plan in case_plans.items():
            pred = plan.predicted.latency_s
            measured = paired_ratio(steps["standard"], steps[name])
            wins = sign_test(steps[name], steps["standard"])
            table.add_row(
                case.name if name == "standard" else "",
                f"{name} (layers {_ranges(plan.ladder_layers)})" if plan.ladder_layers else name,
                f"{pred * 1e3:.1f} ms (comm {plan.predicted.exposed_comm_s * 1e3:.1f} exposed, "
                f"{plan.predicted.overlapped_comm_s * 1e3:.1f} hidden)",
                Spread.of(steps[name]).text(),
                f"{base_pred / pred:.3f}",
                f"{measured.median_s:.3f} ({measured.p10_s:.2f}-{measured.p90_s:.2f})",
                f"{wins[0]}/{wins[1]} (p={wins[2]:.1g})" if name != "standard" else "",
                f"{results[0][i]['deviation'][name]:.2e}",
            )
            if name != "standard":
                summary.append((case.name, name, base_pred / pred, measured, wins))
    console.print(table)
    console.print(_interpretation(summary))
    return 0


def _ranges(layers: list[int]) -> str:
    return f"{min(layers)}-{max(layers)}" if layers else "-"


def _interpretation(summary: list[tuple[str, str, float, Spread, tuple[int, int, float]]]) -> str:
    figures = "; ".join(
        f"{m}, {v}: predicted {p:.3f}x, measured {x.median_s:.3f}x (p10-p90 {x.p10_s:.2f}-{x.p90_s:.2f}, "
        f"ladder faster in {k}/{n} rounds: "
        + (("a real gain" if k > n / 2 else "a real loss") if pv < 0.01 else "not distinguishable from 1")
        + f", sign test p={pv:.1g})"
        for m, v, p, x, (k, n, pv) in summary
    )
    return (
        f"Interpretation: {figures}. The speedup is standard / ladder latency at the same TP degree and "
        "splits, per round (the variants run back to back). Ladder residual removes no work: it issues each "
        "block's all-reduce asynchronously and lets the next block compute while it runs, so the most it can "
        "save is the exposed all-reduce time (the 'comm exposed' of the standard plan), and the planner "
        "counts only the share overlap_efficiency of the overlapped time as hidden (local-cpu preset: 0.1; "
        "--cluster with a calibrated spec gives this machine's compute speed). On this 2-core machine with "
        "one compute thread per rank, gloo's all-reduce runs on its own threads that compete with the "
        "matmuls for the same two cores, so little of the transfer itself overlaps (~10%). What ladder can "
        "hide here is mostly waiting: a blocking all-reduce in the graph costs 3-10 ms on this loaded VM "
        "(a gloo thread waiting to be scheduled, and rank skew) against 0.5 ms for a lone one "
        "(bench/predict_vs_measure.py, collectives row), which no spec term models yet. On GPUs NCCL runs "
        "on its own SMs and the overlap is nearly free, which the GPU presets count with "
        "overlap_efficiency 0.8 (the paper's ~30% at TP=8 for 70B). The logit deviation (relative L2 "
        "against the standard model) shows that ladder changes the function of a standard-trained model."
    )


if __name__ == "__main__":
    sys.exit(main())

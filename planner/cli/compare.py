"""`planner compare REPORT.json [REPORT.json ...]`: plans side by side, to choose between them.

Reads the JSON reports of `planner optimize ... --json` / `planner run ... --json` (`workflow.report_dict`)
and prints one column per report: model, cluster, workload, batch, dtype, mesh, schedule, ladder, predicted and
measured step time, peak memory per rank and tokens/s; then which report is fastest.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from textwrap import shorten
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from planner.cli.render import fmt_bytes, fmt_s, mesh_text
from planner.errors import InputError
from planner.plan import ep_text, parse_layer_run, recompute_summary

_REPORT_KEYS = ("plan", "predicted")  # present in every report_dict


def load_report(path: str) -> dict[str, Any]:
    """One JSON report. Raises InputError when it cannot be read, is not JSON, or is not a report."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a text file (not UTF-8); reports are JSON") from None
    except OSError as e:
        raise InputError(f"cannot read report {path!r}: {e.strerror or e}") from None
    try:
        report = json.loads(text)
    except json.JSONDecodeError as e:
        hint = (
            ": compare reads the JSON reports planner optimize --json REPORT.json writes, not plans"
            if str(path).endswith((".yaml", ".yml"))
            else ""
        )
        raise InputError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}){hint}") from None
    missing = [k for k in _REPORT_KEYS if not isinstance(report, dict) or not isinstance(report.get(k), dict)]
    if missing:
        raise InputError(
            f"{path} is not a planner report (no {', '.join(missing)}); reports are the JSON that "
            "planner optimize MODEL.py --json REPORT.json writes"
        )
    for section in ("predicted", "measured"):
        values = report.get(section)
        if values is None:
            continue
        if not isinstance(values, dict):
            raise InputError(
                f"{path}: field '{section}' is {values!r}, not an object as planner --json writes it"
            )
        for key in ("latency_s", "peak_memory_bytes"):
            value = values.get(key)
            ok = value is None or (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
                and (value > 0 if key == "latency_s" else value >= 0)
            )
            if not ok:
                raise InputError(
                    f"{path}: field '{section}.{key}' is {value!r}; a report holds a finite "
                    f"{'positive number of seconds' if key == 'latency_s' else 'number of bytes'} there"
                )
    return report


def _measured_tokens_per_s(report: dict[str, Any]) -> float | None:
    """Measured tokens/s of the step: the predicted tokens per step over the measured step (a served
    request's step: one decode step)."""
    measured, predicted = report.get("measured") or {}, report["predicted"]
    if not measured.get("latency_s") or not predicted.get("latency_s"):
        return None
    tokens_per_step = predicted.get("throughput_tokens_per_s", 0.0) * predicted["latency_s"]
    return tokens_per_step / measured["latency_s"] if tokens_per_step else None


def _predicted_tokens_per_s(report: dict[str, Any]) -> float | None:
    """Predicted tokens/s of the step, like for like with `_measured_tokens_per_s`."""
    return report["predicted"].get("throughput_tokens_per_s") or None


def _request_tokens_per_s(report: dict[str, Any], key: str) -> float | None:
    """A served request's tokens/s over the whole request (prefill and decode steps), ``key`` "predicted"
    or "measured"; None for other reports."""
    value = ((report.get("serving") or {}).get(key) or {}).get("tokens_per_s")
    return float(value) if value else None


def _request_cell(report: dict[str, Any]) -> str:
    """A served request's tokens/s over the whole request, predicted / measured ("-" where none)."""
    pair = [_request_tokens_per_s(report, k) for k in ("predicted", "measured")]
    if pair[0] is None:
        return "-"
    return " / ".join(f"{v:,.0f}" if v else "-" for v in pair)


def _recompute_cell(recompute: dict[str, Any]) -> str:
    """The report's recomputation (`Plan.recompute_ranges`: layer run -> mode) as text, "" for none.
    Reports written before it was by layer range keyed it by layer class: only their modes are shown."""
    by_layer: dict[int, str] = {}
    for key, mode in recompute.items():
        layers = parse_layer_run(str(key))
        if layers is None:  # a layer class or "per layer class": no layer indices to show
            modes = sorted({str(v) for v in recompute.values()} - {"none"})
            return f"recompute {'/'.join(modes)} (per layer class)" if modes else ""
        by_layer.update(dict.fromkeys(layers, str(mode)))
    text = recompute_summary(by_layer)
    return "" if text == "none" else f"recompute {text}"


def _batch_text(plan: dict[str, Any]) -> str:
    """ "8 × 128" (sequences × tokens each), or the batch alone when the plan has no sequence length."""
    batch, seq = plan.get("batch_size"), plan.get("seq_len")
    if batch is None:
        return "-"
    return f"{batch} × {seq}" if seq and seq > 1 else str(batch)


def _dp_style_text(plan: dict[str, Any]) -> str:
    """A training plan's data-parallel style: "ddp", "zero1", "zero2", "fsdp", "fsdp (no reshard after
    forward)", "hsdp 4x2" (FSDP over 4 ranks, replicated twice)."""
    style = str(plan.get("dp_style") or ("zero1" if plan.get("distributed_optimizer") else "ddp"))
    dp, shard = int(plan.get("dp") or 1), int(plan.get("dp_shard") or plan.get("dp") or 1)
    if style == "fsdp" and 1 < shard < dp:
        style = f"hsdp {shard}x{dp // shard}"
    if style.startswith(("fsdp", "hsdp")) and plan.get("reshard_after_forward") is False:
        style += " (no reshard after forward)"
    return style


def comparison_rows(report: dict[str, Any]) -> dict[str, str]:
    """Row label -> cell text for one report (the column of the comparison table)."""
    plan, p = report["plan"], report["predicted"]
    # a run that failed (its check, a rank: `"failed"`, exit 4) measured nothing to compare
    m = {} if report.get("failed") else report.get("measured") or {}
    mesh = mesh_text(plan.get("tp", "?"), plan.get("cp", 1), plan.get("pp", "?"), plan.get("dp", "?"))
    ep, expert_tp = int(plan.get("ep") or 1), int(plan.get("expert_tp") or 1)
    if ep > 1 or expert_tp > 1:
        mesh += f"; experts: EP {ep_text(ep, str(plan.get('ep_fold') or 'dp'), expert_tp, int(plan.get('cp') or 1))}"
    pipeline = plan.get("schedule", "-") if (plan.get("pp") or 1) > 1 else "no pipeline"
    schedule = f"{pipeline}, {plan.get('micro_batches', '?')} micro-batch(es)"
    if (plan.get("virtual_stages") or 1) > 1:
        schedule += f", {plan['virtual_stages']} virtual stages"
    training = str(report.get("workload", "")) == "train"
    sharded = plan.get("distributed_optimizer")
    extras = [
        "sequence parallel" if plan.get("sequence_parallel") else "",
        # a training step's data parallelism is always named (ddp too), so that "-" means not training
        _dp_style_text(plan) if sharded or training and (plan.get("dp") or 1) > 1 else "",
        _recompute_cell(plan.get("recompute") or {}) or ("no recompute" if training else ""),
    ]
    above = (m.get("peak_memory_bytes") or 0) - (m.get("startup_memory_bytes") or 0)
    measured_tps = _measured_tokens_per_s({**report, "measured": m})
    predicted_tps = _predicted_tokens_per_s(report)
    ratio = m["latency_s"] / p["latency_s"] if m.get("latency_s") and p.get("latency_s") else None
    speedup = (report.get("baseline") or {}).get("speedup")
    return {
        "model": str(report.get("model", "-")),
        "cluster": str(report.get("cluster", "-")),
        "workload": str(report.get("workload", "-")),
        "batch": _batch_text(plan),
        "dtype": str(plan.get("dtype", "-")),
        "mesh": mesh,
        "schedule": schedule,
        "training layout": "; ".join(e for e in extras if e) or "-",
        "ladder layers": str(len(plan.get("ladder_layers") or [])),
        "predicted step": fmt_s(p.get("latency_s")),
        "measured step": "run failed" if report.get("failed") else fmt_s(m.get("latency_s")),
        "measured / predicted": f"{ratio:.2f}" if ratio else "-",
        "predicted memory / rank": fmt_bytes(p.get("peak_memory_bytes")),
        "measured memory / rank": fmt_bytes(above) if m.get("peak_memory_bytes") else "-",
        "predicted tokens/s": f"{predicted_tps:,.0f}" if predicted_tps else "-",
        "measured tokens/s": f"{measured_tps:,.0f}" if measured_tps else "-",
        "request tokens/s, predicted / measured": _request_cell({**report, "measured": m}),
        "vs Megatron baseline": f"{speedup:.2f}×" if speedup else "-",
    }


def column_names(paths: list[str]) -> list[str]:
    """Each report's shortest path tail (file name, then parent/file name, ...) that no other report's
    tail of the same length equals."""
    parts = [Path(p).resolve().parts for p in paths]
    names = []
    for i, mine in enumerate(parts):
        for depth in range(1, len(mine) + 1):
            tail = mine[-depth:]
            if all(other[-depth:] != tail for j, other in enumerate(parts) if j != i):
                break
        names.append(str(Path(*tail)))
    return names


def render_comparison(console: Console, paths: list[str]) -> None:
    """Print the reports side by side and which is fastest (predicted, and measured where run).
    Raises InputError for a file that is not a readable report."""
    # a run that failed (its check, a rank: `"failed"`, exit 4) measured nothing to compare
    reports = [load_report(path) for path in paths]
    failed = [r.get("failed") for r in reports]
    reports = [{**r, "measured": None} if why else r for r, why in zip(reports, failed)]
    table = Table(title="Plans side by side (per step; memory per rank)")
    table.add_column("")
    for name in column_names(paths):
        table.add_column(name, justify="right")
    columns = []
    for report, path in zip(reports, paths):
        try:
            columns.append(comparison_rows(report))
        except (TypeError, AttributeError, ValueError, KeyError) as e:  # a hand-edited field of another type
            raise InputError(
                f"{path}: a field has a value of another kind than planner --json writes ({type(e).__name__}: {e}); "
                "compare the reports as written, or fix the edited field"
            ) from None
    for label in columns[0]:
        table.add_row(label, *(c[label] for c in columns))
    console.print(table)
    for why, path in zip(failed, paths):
        if why:
            console.print(
                f"[yellow]note: {path}'s run failed ({escape(shorten(str(why), 160))}): its measurements "
                "are not compared[/yellow]"
            )
    clusters = [str(r.get("cluster", "-")) for r in reports]
    if len(set(clusters)) > 1:
        console.print(
            f"[yellow]note: the reports are priced on different clusters ({', '.join(dict.fromkeys(clusters))}): "
            "their predicted steps compare the clusters' prices as well as the plans[/yellow]"
        )
    if len({(r.get("model"), r.get("workload")) for r in reports}) > 1:
        console.print(
            "[yellow]note: the reports plan different models or workloads; their steps are not the same work[/yellow]"
        )
        return
    dtypes = [str(r["plan"].get("dtype", "-")) for r in reports]
    if len(set(dtypes)) > 1:
        console.print(
            f"[yellow]note: the reports' dtypes differ ({', '.join(dict.fromkeys(dtypes))}): the same model in "
            "another precision computes other numbers and holds other memory; the fastest below is the faster "
            "step, not the same computation[/yellow]"
        )
    if len({_batch_text(r["plan"]) for r in reports}) > 1:  # the same model, other work per step: by rate
        console.print("note: the reports' batches differ: the fastest is the one with the most tokens/s")
        rates = {
            "predicted": [(_predicted_tokens_per_s(r), p) for r, p in zip(reports, paths)],
            "measured": [(_measured_tokens_per_s(r), p) for r, p in zip(reports, paths)],
        }
        for key, pairs in rates.items():
            pairs = [(rate, p) for rate, p in pairs if rate]
            if len(pairs) > 1:
                rate, best = max(pairs)
                console.print(f"fastest {key}: [bold]{best}[/bold] ({rate:,.0f} tokens/s)")
        return
    for key in ("predicted", "measured"):
        timed = [
            (r[key]["latency_s"], p) for r, p in zip(reports, paths) if (r.get(key) or {}).get("latency_s")
        ]
        if len(timed) > 1:
            best_s, best = min(timed)
            console.print(f"fastest {key}: [bold]{best}[/bold] ({fmt_s(best_s)} per step)")

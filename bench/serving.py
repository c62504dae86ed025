"""Serving benchmarks: decode with a real KV cache, predicted beside measured.

    python bench/serving.py                 # (c) only: predictions vs gpt-fast's published decode figures
    python bench/serving.py --run           # also (a) ladder vs standard at TP=2 and (b) predicted vs
                                            # measured ms/token, on local gloo ranks

(a) Llama-3 tiny with a static cache (examples/llama3_kv.py), TP=2, ladder on the upper 2 layers: the run
    times the laddered and the standard rewrite of the same splits side by side (interleaved requests),
    so the measured speed-up is a ratio from one run; beside it the predicted speed-up.
(b) predicted vs measured time per output token for the tiny Llama (two cache lengths), the Hugging Face
    static-cache wrapper and the 2-KV-head model at TP=4.
(c) tokens/s predicted for Llama-3.1-8B / 70B at batch 1, TP 2/4/8, on the dgx-a100 preset (bf16, 5-token
    prompt, 200 new tokens) against pytorch-labs/gpt-fast's README (8xA100-80GB at 330 W, torch.compile,
    custom all-reduce; ../shared/reference/published.md). Published decode figures at batch > 1 for the
    same setup were not found (gpt-fast measures batch 1 only: meta-pytorch/gpt-fast issue #90), so
    batch 4/16/64 rows print predictions without a measurement.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from planner.cli import workflow  # noqa: E402

MIDLINK = str(ROOT / "tests" / "models" / "midlink-cpu.yaml")
GPT_FAST = {  # tokens/s, batch 1 (published.md)
    ("llama3_8b_kv", 2): 149.10,
    ("llama3_8b_kv", 4): 217.21,
    ("llama3_8b_kv", 8): 276.01,
    ("llama3_70b_kv", 2): 16.03,
    ("llama3_70b_kv", 4): 37.45,
    ("llama3_70b_kv", 8): 58.78,
}


def plan(model: str, cluster: str, tp: int, ladder: str = "none", **kw):
    prepared = workflow.prepare(str(ROOT / model), "decode", **kw)
    spec = workflow.resolve_cluster(cluster, tp)
    constraints = workflow.constraints_from(tp, 1, 1, ladder, max_devices=tp)
    return workflow.make_plan(prepared, spec, constraints, model)


def published(console: Console) -> None:
    table = Table(title="(c) decode tokens/s, batch 1 (gpt-fast, 8xA100) vs predicted (dgx-a100, bf16)")
    for col in ("model", "tp", "batch", "predicted tok/s", "published tok/s", "error"):
        table.add_column(col, justify="right")
    errors = []
    for name in ("llama3_8b_kv", "llama3_70b_kv"):
        for tp in (2, 4, 8):
            for batch in (1, 4, 16, 64):
                p = plan(
                    f"examples/{name}.py",
                    "dgx-a100",
                    tp,
                    context=5,
                    new_tokens=200,
                    batch_size=batch,
                    dtype="bf16",
                )
                per_seq = p.serving.tokens_per_s / batch  # tokens/s per sequence, as gpt-fast reports
                want = GPT_FAST.get((name, tp)) if batch == 1 else None
                err = per_seq / want - 1 if want else None
                if err is not None:
                    errors.append(abs(err))
                table.add_row(name, str(tp), str(batch), f"{per_seq:.1f}", f"{want:.2f}" if want else "-",
                              f"{err:+.0%}" if err is not None else "not published")  # fmt: skip
    console.print(table)
    console.print(
        f"median |error| at batch 1: {statistics.median(errors):.0%} over {len(errors)} configurations"
    )


def measured(console: Console, iters: int) -> None:
    table = Table(
        title="(a, b) time per output token: predicted vs measured (local gloo ranks, midlink-cpu spec)"
    )
    for col in (
        "config",
        "predicted",
        "measured (p10-p90)",
        "pred / meas",
        "tokens identical",
        "ladder speed-up pred / meas",
    ):
        table.add_column(col, justify="right")
    configs = [
        ("llama3_kv ctx 64 tp2", "examples/llama3_kv.py", 2, "none", dict(context=64, new_tokens=16)),
        ("llama3_kv ctx 256 tp2", "examples/llama3_kv.py", 2, "none", dict(context=256, new_tokens=16)),
        ("hf_llama_kv ctx 64 tp2", "examples/hf_llama_kv.py", 2, "none", dict(context=64, new_tokens=16)),
        ("llama_2kv ctx 64 tp4", "tests/models/llama_2kv.py", 4, "none", dict(context=64, new_tokens=8)),
        (
            "llama3_kv ctx 64 tp2 ladder upper:2",
            "examples/llama3_kv.py",
            2,
            "upper:2",
            dict(context=64, new_tokens=16),
        ),
    ]
    for label, model, tp, ladder, kw in configs:
        p = plan(model, MIDLINK, tp, ladder, **kw)
        run = workflow.run_serving(p, str(ROOT / model), tp, iters=iters, warmup=1, timeout_s=600)
        m, n, sv = run["measured"], run["numerics"], p.serving
        speed = "-"
        if m.get("standard_tpot_s"):
            speed = f"{sv.standard_tpot_s / sv.tpot_s:.3f} / {m['ladder_speedup']:.3f}"
        table.add_row(label, f"{sv.tpot_s * 1e3:.2f} ms",
                      f"{m['tpot_s'] * 1e3:.2f} ms ({m['latency_p10_s'] * 1e3:.1f}-{m['latency_p90_s'] * 1e3:.1f})",
                      f"{sv.tpot_s / m['tpot_s']:.2f}", str(n["tokens_identical"]), speed)  # fmt: skip
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", action="store_true", help="also run (a) and (b) on local gloo ranks")
    parser.add_argument("--iters", type=int, default=3, help="timed requests per configuration")
    args = parser.parse_args()
    console = Console(width=160)
    published(console)
    if args.run:
        measured(console, args.iters)


if __name__ == "__main__":
    main()

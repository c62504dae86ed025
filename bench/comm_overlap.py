"""Communication overlap on this machine: each option on vs off, measured side by side on 2 gloo ranks,
beside what the planner predicted for the same change.

    python bench/comm_overlap.py [--rounds N] [--model examples/llama3.py]

For each option (TP overlap without and with sequence parallelism at TP 2; the gradient-reduction
and parameter-gather overlap at DP 2 with ddp / zero1) it runs `planner optimize MODEL --nproc 2
--workload train --run --json` with the option pinned off and on, alternately, `--rounds` times each
(default 2), TP with Megatron-LM's splits (`--layout megatron`), on this machine's calibrated spec (no `--cluster`: `planner calibrate`'s cache), and
prints per option the predicted and measured step with it off and on and the ratios on / off. The
claim is the measured ratio beside the predicted one: CPU processes over gloo overlap less than GPUs
over NVLink (the gloo thread and the matmul threads share 2 cores), and the calibrated
`overlap_efficiency` is what the prices assume. The numerics check of every run must pass (exit 4
otherwise), so each row is also a parity check of the option.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

# option label: (the flag toggled, the other arguments of the run)
OPTIONS = {
    "TP overlap, TP 2 (all-reduce form)": (
        "--tp-comm-overlap",
        ["--tp", "2", "--layout", "megatron", "--sequence-parallel", "off"],
    ),
    "TP overlap, TP 2 + sequence parallel": (
        "--tp-comm-overlap",
        ["--tp", "2", "--layout", "megatron", "--sequence-parallel", "on"],
    ),
    "gradient reduction overlap, DP 2 ddp": ("--overlap-grad-reduce", ["--dp", "2", "--dp-style", "ddp"]),
    "grad + param-gather overlap, DP 2 zero1": (
        "--overlap-grad-reduce --overlap-param-gather",
        ["--dp", "2", "--dp-style", "zero1"],
    ),
}


def _run(model: str, flag: str, on: bool, extra: list[str], batch: int, seq: int) -> tuple[float, float]:
    """(predicted, measured) step seconds of one run with `flag` (one or more flags) pinned on / off."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pins = [x for f in flag.split() for x in (f, "on" if on else "off")]
        cmd = [
            str(Path(sys.executable).parent / "planner"), "optimize", model, "--nproc", "2", "--workload", "train",
            "--batch-size", str(batch), "--seq-len", str(seq), "--run", "--iters", "20",
            "--json", str(report), *extra, *pins,
        ]  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
        data = json.loads(report.read_text())
    return data["predicted"]["latency_s"], data["measured"]["latency_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="off / on pairs per option (default 2)")
    parser.add_argument("--model", default="examples/llama3.py")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--only", help="run the options whose label contains this text")
    args = parser.parse_args(argv)
    console = Console(width=150)
    table = Table(
        title=f"Communication overlap on 2 gloo ranks: {args.model}, train, batch {args.batch_size} x "
        f"{args.seq_len} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})"
    )
    for col in ("option", "predicted off", "predicted on", "predicted on/off", "measured off", "measured on",
                "measured on/off"):  # fmt: skip
        table.add_column(col, justify="left" if col == "option" else "right")
    for label, (flag, extra) in OPTIONS.items():
        if args.only and args.only not in label:
            continue
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for on in (False, True):
                runs[on].append(_run(args.model, flag, on, extra, args.batch_size, args.seq_len))
                console.print(f"{label} {'on' if on else 'off'}: predicted {runs[on][-1][0] * 1e3:.2f} ms, "
                              f"measured {runs[on][-1][1] * 1e3:.2f} ms")  # fmt: skip
        pred = {on: statistics.median(p for p, _ in runs[on]) for on in runs}
        meas = {on: statistics.median(m for _, m in runs[on]) for on in runs}
        table.add_row(
            label,
            f"{pred[False] * 1e3:.2f} ms", f"{pred[True] * 1e3:.2f} ms", f"{pred[True] / pred[False]:.3f}",
            f"{meas[False] * 1e3:.2f} ms", f"{meas[True] * 1e3:.2f} ms", f"{meas[True] / meas[False]:.3f}",
        )  # fmt: skip
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GEMM prices by shape against a published table of measured Hopper rates, none of which the preset
was fitted to.

    python bench/gemm_shapes.py [--cluster dgx-h100] [--rows]

The table: the "sm_90" section of OpenXLA's default matmul performance table,
`xla/service/gpu/model/matmul_interpolator_data.h` (read from its copy in tensorflow/tensorflow,
`third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h`; Apache-2.0), which XLA's GPU cost
model interpolates: for each batched product (b, m, n, k) — b products of (m, k) @ (k, n) — its measured
FLOP/s per input and output dtype. Its "bf16xbf16->bf16" values are copied unchanged into
`bench/data/xla_matmul_sm90_bf16.csv` (b, m, n, k from 256 to 4096; its 4096^3 rate, 783 TFLOP/s, is an
H100 SXM's). The measured time of a row is 2 b m n k over its rate.

Priced: `costmodels.compute.op_time_s` of the same product on the cluster's device (default the
`dgx-h100` preset: tile and wave quantization, split-K, `gemm_efficiency`), M = b x m rows (the b
products' output tiles together, as a batched kernel runs them), twice: the kernel's roofline alone,
and with the device's per-op launch overhead (`launch_overhead_s`, 4 us on the H100 presets), as the
planner prices every op of a graph. The table's times carry such a fixed cost: its smallest product,
256^3 (34 MFLOP, 0.1 us of tensor-core work at the peak), took 5.2 us. Error = priced / measured
time - 1 (negative: priced too fast). Printed: the median |error| and the worst row per size band of
the product's FLOP count (2 b m n k), over the rows whose m, n and k are all >= 1024 (the shapes of
transformer layers) and over all rows. `--rows` prints every row.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from costmodels.cluster import DeviceSpec, load_cluster  # noqa: E402
from costmodels.compute import matmul_bytes, matmul_flops, op_time_s  # noqa: E402

DATA = ROOT / "bench" / "data" / "xla_matmul_sm90_bf16.csv"
# size bands of a product's FLOP count (2 b m n k): (label, low inclusive, high exclusive)
BANDS = [
    ("< 1 GFLOP", 0.0, 1e9),
    ("1-10 GFLOP", 1e9, 1e10),
    ("10-100 GFLOP", 1e10, 1e11),
    (">= 100 GFLOP", 1e11, float("inf")),
]
LAYER_SIZED = 1024  # m, n, k all at least this: the products of transformer layers


def published_rows(path: Path = DATA) -> list[tuple[int, int, int, int, float]]:
    """(b, m, n, k, measured FLOP/s) of every row of the table's copy."""
    with open(path, newline="") as f:
        return [
            (int(r["b"]), int(r["m"]), int(r["n"]), int(r["k"]), float(r["bf16_flops_per_s"]))
            for r in csv.DictReader(f)
        ]


def priced_s(b: int, m: int, n: int, k: int, device: DeviceSpec, launch: bool = False) -> float:
    """Priced seconds of b products of (m, k) @ (k, n) in bf16 on `device`, without the launch."""
    rows = b * m
    return op_time_s(
        matmul_flops(rows, k, n), b * matmul_bytes(m, k, n, "bf16"), device, "bf16", "matmul",
        rows=rows, launch=launch, shape=(k, n),
    )  # fmt: skip


def errors(device: DeviceSpec, launch: bool) -> list[tuple[tuple[int, int, int, int], float, float, float]]:
    """Per row: ((b, m, n, k), FLOP, measured seconds, priced / measured - 1), priced with the launch
    overhead or without (`priced_s`)."""
    out = []
    for b, m, n, k, rate in published_rows():
        flops = 2.0 * b * m * n * k
        measured = flops / rate
        out.append(((b, m, n, k), flops, measured, priced_s(b, m, n, k, device, launch) / measured - 1))
    return out


def summary(rows: list[tuple[tuple[int, int, int, int], float, float, float]]) -> tuple[int, float, str]:
    """(rows, median |error|, the worst row as text) of `rows`."""
    if not rows:
        return 0, float("nan"), "-"
    worst = max(rows, key=lambda r: abs(r[3]))
    b, m, n, k = worst[0]
    return len(rows), statistics.median(abs(r[3]) for r in rows), f"{b}x({m}, {n}, {k}) {worst[3]:+.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cluster", default="dgx-h100", help="a GPU preset or cluster YAML (default dgx-h100)"
    )
    parser.add_argument("--rows", action="store_true", help="print every row")
    args = parser.parse_args()
    console = Console(width=160)
    device = load_cluster(args.cluster).device
    kernel, launched = errors(device, launch=False), errors(device, launch=True)
    if args.rows:
        table = Table(title=f"bf16 GEMMs, OpenXLA's sm_90 table vs {args.cluster}")
        for col in (
            "b",
            "m",
            "n",
            "k",
            "measured",
            "measured TFLOP/s",
            "priced + launch",
            "error",
            "kernel alone: error",
        ):
            table.add_column(col, justify="right")
        for ((b, m, n, k), flops, measured, error), (*_, bare) in sorted(
            zip(launched, kernel), key=lambda r: r[0][1]
        ):
            table.add_row(str(b), str(m), str(n), str(k), f"{measured * 1e6:.1f} us", f"{flops / measured / 1e12:.1f}",
                          f"{measured * (1 + error) * 1e6:.1f} us", f"{error:+.1%}", f"{bare:+.1%}")  # fmt: skip
        console.print(table)
    table = Table(
        title=f"bf16 GEMM prices ({args.cluster}) vs OpenXLA's measured sm_90 table: priced / measured time - 1"
    )
    for col in ("products", "rows", "with the launch: median |error|", "worst row: b x (m, n, k)",
                "kernel alone: median |error|", "worst row"):  # fmt: skip
        table.add_column(col, justify="right")
    selections = [(label, lambda r, lo=low, hi=high: lo <= r[1] < hi) for label, low, high in BANDS]
    selections += [
        (f"m, n, k >= {LAYER_SIZED}", lambda r: min(r[0][1:]) >= LAYER_SIZED),
        ("all", lambda r: True),
    ]
    for label, keep in selections:
        count, median, worst = summary([r for r in launched if keep(r)])
        _, bare_median, bare_worst = summary([r for r in kernel if keep(r)])
        table.add_row(label, str(count), f"{median:.1%}", worst, f"{bare_median:.1%}", bare_worst)
    console.print(table)


if __name__ == "__main__":
    main()

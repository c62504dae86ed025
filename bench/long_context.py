"""Long-context training with context parallelism: Llama-3-405B at 131k tokens, Llama-3-8B at 32k-1M.

    python bench/long_context.py [--only 405b|8b]

(a) Llama-3-405B (examples/llama3_405b.py) on 16,384 H100s (h100-ib-2048node), 128 sequences of
    131,072 tokens (16M tokens) per step: the free plan, the hand-written Megatron plan (CP at 8,192
    tokens per rank, ring: `baseline.megatron_cp_degree`) and Llama 3's published layout pinned
    (TP8 CP16 PP16 DP8, Dubey et al. 2024 Table 4: 380 TFLOP/s per GPU), with the all-gather of K/V
    Llama 3 ran (section 3.3.2) and with the search's variant: step, model TFLOP/s per GPU (forward +
    backward, causal attention: `Prediction.model_flops`), the published step that count implies
    (FLOP / (380 TFLOP/s x 16,384)), bubble, exposed and hidden communication, memory.
(b) Llama-3-8B (examples/llama3_8b.py) on one 8-GPU H100 node (dgx-h100) from 32k to 1M tokens per
    sequence, 256k tokens per step (one sequence from 256k on): the free plan's layout, CP degree and
    variant, step, TFLOP/s and memory, the fastest plan without context parallelism (`--why`'s
    context-parallel decision), and where nothing fits.
Planning only: prices are the cost model's (`costmodels/clusters/*.yaml`), no GPU is run.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from costmodels.cluster import load_cluster  # noqa: E402
from planner.errors import InfeasibleError  # noqa: E402
from planner.frontend.depth import capture_for_planning  # noqa: E402
from planner.frontend.modelfile import load_model_file  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.solver.problem import Constraints, WorkloadSpec  # noqa: E402
from planner.solver.search import plan_model  # noqa: E402

# Dubey et al. 2024, Table 4, last row: 16,384 H100s, TP8 CP16 PP16 DP8, 16M tokens per step of
# 131,072-token sequences, 380 TFLOP/s per GPU (BF16 MFU 38%)
LLAMA_405B_131K = {"cluster": "h100-ib-2048node", "batch": 128, "seq": 131072, "tp": 8, "cp": 16, "pp": 16,
                   "dp": 8, "published_tflops": 380.0}  # fmt: skip
LLAMA_8B_ROWS = [(32768, 8), (65536, 4), (131072, 2), (262144, 1), (524288, 1), (1048576, 1)]


def structure_of(example: str):
    """The example model file captured on meta for planning (a two-layer slice, extended)."""
    model_file = load_model_file(ROOT / "examples" / f"{example}.py")
    args, kwargs = model_file.inputs(batch_size=1, seq_len=128)
    return capture_for_planning(model_file.build("meta"), args, kwargs)[1]


def _layout(plan: Plan, with_cp: bool = True) -> str:
    """Mesh, CP (``with_cp``), micro-batches, v, recomputation and data-parallel style of a plan."""
    recompute = "/".join(sorted({str(r) for r in plan.recompute.values()})) or "none"
    parts = [plan.mesh.label()] + ([f"CP {plan.cp_text()}"] if with_cp else [])
    parts += [f"m={plan.micro_batches}" + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else "")]
    return ", ".join([*parts, f"recompute {recompute}", plan.dp_style_text()])


def llama_405b(console: Console) -> None:
    job = LLAMA_405B_131K
    start = time.perf_counter()
    structure = structure_of("llama3_405b")
    cluster = load_cluster(job["cluster"])
    work = WorkloadSpec("train", job["batch"], job["seq"], dtype="bf16")
    free = plan_model(structure, cluster, work, Constraints(), model_name="llama3-405b")
    console.print(f"Llama-3-405B at 131k tokens: trace + plan {time.perf_counter() - start:.1f} s")
    published = {k: job[k] for k in ("tp", "cp", "pp", "dp")}
    pinned = {
        variant: plan_model(structure, cluster, work, Constraints(**published, cp_comm_type=variant))
        for variant in ("allgather", "ring")
    }
    gpus = cluster.num_devices
    published_s = free.predicted.model_flops / (job["published_tflops"] * 1e12 * gpus)
    table = Table(title="Llama-3-405B, 16,384 H100s, 128 x 131,072 tokens per step")
    for col in (
        "plan",
        "layout",
        "step",
        "TFLOP/s per GPU",
        "vs published",
        "bubble",
        "exposed / hidden comm",
        "memory",
    ):
        table.add_column(col, justify="left" if col in ("plan", "layout") else "right")
    rows = [("free plan", free), ("published layout, allgather", pinned["allgather"]),
            ("published layout, ring", pinned["ring"])]  # fmt: skip
    for name, plan in rows:
        p = plan.predicted
        table.add_row(
            name, _layout(plan), f"{p.latency_s:.2f} s", f"{p.model_flops_per_s_per_device / 1e12:.0f}",
            f"{p.latency_s / published_s - 1:+.1%}", f"{p.bubble_s / p.latency_s:.1%}",
            f"{p.exposed_comm_s:.2f} / {p.overlapped_comm_s:.2f} s", f"{p.peak_memory_bytes / 2**30:.1f} GiB",
        )  # fmt: skip
    b, bl = free.baseline, free.baseline_layout
    table.add_row(
        "hand-written Megatron", f"tp={bl['tp']} cp={bl['cp']} pp={bl['pp']} dp={bl['dp']}, CP {bl['context_parallel']}, "
        f"recompute {bl['recompute']}", f"{b.latency_s:.2f} s", f"{b.model_flops_per_s_per_device / 1e12:.0f}",
        f"{b.latency_s / published_s - 1:+.1%}", f"{b.bubble_s / b.latency_s:.1%}",
        f"{b.exposed_comm_s:.2f} / {b.overlapped_comm_s:.2f} s", f"{b.peak_memory_bytes / 2**30:.1f} GiB",
    )  # fmt: skip
    table.add_row("published (Llama 3)", "tp=8 cp=16 pp=16 dp=8, CP allgather", f"{published_s:.2f} s",
                  f"{job['published_tflops']:.0f}", "", "", "", "")  # fmt: skip
    console.print(table)
    degrees = {d.subject: d for d in free.decisions}["context-parallel"].options
    console.print(
        "free plan, fastest solved mesh per CP degree: "
        + ", ".join(f"{k} {v:.2f} s" if math.isfinite(v) else f"{k} none fits" for k, v in degrees.items())
    )


def _plan_or_why(structure, cluster, work: WorkloadSpec, constraints: Constraints) -> tuple[Plan | None, str]:
    """(the plan, "") or (None, "no plan fits: X GiB per GPU at best") from the search's own message."""
    try:
        return plan_model(structure, cluster, work, constraints), ""
    except InfeasibleError as e:
        need = re.search(r"(tp=\d+.*?) \(the mesh closest to fitting\) stage \d+ needs ([\d.]+ GiB)", str(e))
        return None, (f"does not fit ({need.group(1)} needs {need.group(2)})" if need else "does not fit")


def llama_8b(console: Console) -> None:
    structure, cluster = structure_of("llama3_8b"), load_cluster("dgx-h100")
    table = Table(title="Llama-3-8B on 8 H100s (dgx-h100), 256k tokens per step")
    for col in ("tokens / sequence", "sequences", "free plan", "CP", "step", "TFLOP/s per GPU", "memory",
                "best without CP"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("free plan", "CP") else "right")
    for seq, batch in LLAMA_8B_ROWS:
        work = WorkloadSpec("train", batch, seq, dtype="bf16")
        plan, why = _plan_or_why(structure, cluster, work, Constraints())
        plain, plain_why = _plan_or_why(structure, cluster, work, Constraints(cp=1))
        without = f"{plain.predicted.latency_s:.2f} s" if plain is not None else plain_why
        if plan is None:
            table.add_row(f"{seq:,}", str(batch), why, "", "", "", "", without)
            continue
        p = plan.predicted
        table.add_row(
            f"{seq:,}", str(batch), _layout(plan, with_cp=False), plan.cp_text(), f"{p.latency_s:.2f} s",
            f"{p.model_flops_per_s_per_device / 1e12:.0f}", f"{p.peak_memory_bytes / 2**30:.1f} GiB", without,
        )  # fmt: skip
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["405b", "8b"])
    args = parser.parse_args()
    console = Console(width=200)
    if args.only in (None, "405b"):
        llama_405b(console)
    if args.only in (None, "8b"):
        llama_8b(console)


if __name__ == "__main__":
    main()

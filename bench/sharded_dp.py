"""Sharded data parallelism: three Llama 3 training jobs planned with and without FSDP / ZeRO-2 / HSDP.

    python bench/sharded_dp.py

For Llama-3-8B on 8 H100s (dgx-h100, 16 sequences of 8,192 tokens), Llama-3-70B on 256 H100s and
Llama-3-405B on 16,384 H100s (h100-ib-2048node, 256 and 2,048 sequences of 8,192 tokens) it prints
the free plan (every data-parallel style priced, `--dp-style auto`) beside the best plan of the space
without sharded parameters or gradients (the faster of `--dp-style ddp` and `--dp-style zero1`, what
the planner could choose before) and the torchtitan recipe under the same cost model: mesh,
micro-batches, recomputation, data-parallel style, step time, model TFLOP/s per GPU and memory per
rank. Prices are the cost model's (`costmodels/clusters/*.yaml`), no GPU is run.
"""

from __future__ import annotations

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
from planner.plan import DataParallel, Plan  # noqa: E402
from planner.solver.problem import Constraints, WorkloadSpec  # noqa: E402
from planner.solver.search import plan_model  # noqa: E402

JOBS = [  # (example, cluster, devices, global batch, sequence)
    ("llama3_8b", "dgx-h100", 8, 16, 8192),
    ("llama3_70b", "h100-ib-2048node", 256, 256, 8192),
    ("llama3_405b", "h100-ib-2048node", 16384, 2048, 8192),
]


def _row(name: str, plan: Plan | None, latency_s: float | None = None) -> list[str]:
    if plan is None:
        return [name, "does not fit", "", "", "", "", ""]
    p = plan.predicted
    recompute = "/".join(sorted({str(r) for r in plan.recompute.values()})) or "none"
    return [
        name,
        f"{plan.mesh.label()} m={plan.micro_batches}",
        recompute,
        plan.dp_style_text() if plan.dp > 1 else "-",
        f"{p.latency_s:.3f} s",
        f"{p.model_flops_per_s_per_device / 1e12:.1f}",
        f"{p.peak_memory_bytes / 2**30:.1f} GiB",
    ]


def _titan_row(plan: Plan) -> list[str]:
    t, lay = plan.torchtitan_baseline, plan.torchtitan_layout
    if t is None:
        return ["torchtitan recipe", "-", "", "", "", "", ""]
    return [
        "torchtitan recipe",
        f"tp={lay['tp']} pp={lay['pp']} dp={lay['dp']} m={lay['micro_batches']}",
        lay.get("recompute", "-"),
        lay.get("dp_style", "-"),
        f"{t.latency_s:.3f} s",
        f"{t.model_flops_per_s_per_device / 1e12:.1f}",
        f"{t.peak_memory_bytes / 2**30:.1f} GiB",
    ]


def _planned(
    structure, cluster, work, devices: int, style: DataParallel | None, cp: int | None = None
) -> Plan | None:
    try:
        return plan_model(structure, cluster, work, Constraints(max_devices=devices, dp_style=style, cp=cp))
    except InfeasibleError:
        return None


def _best_unsharded(structure, cluster, work, devices: int, cp: int | None = None) -> Plan | None:
    """The faster of --dp-style ddp and zero1 (the space without sharded parameters or gradients)."""
    old = [_planned(structure, cluster, work, devices, s, cp) for s in (DataParallel.DDP, DataParallel.ZERO1)]
    fitting = [p for p in old if p is not None]
    return min(fitting, key=lambda p: p.predicted.latency_s) if fitting else None


def main() -> None:
    console = Console(width=170)
    table = Table(title="Sharded data parallelism: free plan vs the space without it vs torchtitan's recipe")
    for col in ("job / plan", "mesh", "recompute", "data parallel", "step", "TFLOP/s/GPU", "memory/rank"):
        table.add_column(col, justify="left" if col in ("job / plan", "mesh") else "right")
    for example, cluster_name, devices, batch, seq in JOBS:
        start = time.perf_counter()
        model_file = load_model_file(ROOT / f"examples/{example}.py")
        args, kwargs = model_file.inputs(batch_size=1, seq_len=128)
        _, structure = capture_for_planning(model_file.build("meta"), args, kwargs)
        cluster = load_cluster(cluster_name)
        work = WorkloadSpec("train", batch, seq, dtype="bf16")
        free = _planned(structure, cluster, work, devices, None)
        before = _best_unsharded(structure, cluster, work, devices)
        # context parallelism (CP 2 from 8,192 tokens) halves the activations as sharding the training
        # state frees memory: at CP 1 the data-parallel styles compete alone
        free_cp1 = _planned(structure, cluster, work, devices, None, cp=1)
        before_cp1 = _best_unsharded(structure, cluster, work, devices, cp=1)
        elapsed = time.perf_counter() - start
        table.add_row(f"[bold]{example}, {devices} H100, {batch} x {seq} tokens[/bold] ({elapsed:.0f} s)")
        table.add_row(*_row("  free (all styles)", free))
        table.add_row(*_row("  without sharded params/grads", before))
        table.add_row(*_row("  free at CP 1", free_cp1))
        table.add_row(*_row("  without sharded params/grads, CP 1", before_cp1))
        if free is not None:
            table.add_row(*_titan_row(free))
    console.print(table)


if __name__ == "__main__":
    main()

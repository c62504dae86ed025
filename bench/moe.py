"""Mixtures of experts planned with expert parallelism: Mixtral-8x7B training on 64 H100s, a
DeepSeek-V3-sized model training on 1,024 H100s, Qwen3-30B-A3B served on one 8-GPU H100 node,
Llama-4-Scout (Hugging Face's Llama4ForCausalLM, the routing weights scaling the experts' inputs)
training on 64 H100s.

    python bench/moe.py [--only mixtral|deepseek|qwen3|llama4]

Each row is planned as `planner optimize` plans it (`workflow.prepare` + `make_plan`: the model file
traced on meta through a slice of its layers, the plan lowered on meta tensors), with the command in
each example's docstring: the layout (mesh, expert parallelism, data-parallel style, micro-batches,
recomputation), the step time (training) or time per output token and to the first one (serving),
model TFLOP/s per GPU counting the active parameters (each token's top-k experts, not all E:
`Prediction.model_flops`), peak memory per rank, and the `--why` decision's alternatives for expert
parallelism (off, each degree over the data-parallel ranks, at tp > 1 also with every expert split over
the TP ranks, "experts split over tp", over the TP ranks: the fastest solved mesh with each, or this
plan with only EP changed). Planning only: prices are the cost model's
(`costmodels/clusters/*.yaml`, `costmodels/expert_parallel.py`, routing balanced: --moe-imbalance 1),
no GPU is run. What the DeepSeek-V3-sized model approximates: examples/deepseek_v3.py.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from costmodels.cluster import load_cluster  # noqa: E402
from planner.cli import workflow  # noqa: E402
from planner.plan import Plan  # noqa: E402


@dataclass(frozen=True)
class Case:
    """One example and how it is planned (the command of its docstring)."""

    name: str
    model: str  # examples/<model>.py
    cluster: str
    workload: str  # "train" | "generate"
    batch: int
    seq: int
    devices: int | None = None  # --devices
    new_tokens: int | None = None  # generate

    def command(self) -> str:
        parts = [f"planner optimize examples/{self.model}.py --cluster {self.cluster}"]
        parts += [f"--devices {self.devices}"] if self.devices else []
        parts += [f"--workload {self.workload} --batch-size {self.batch} --seq-len {self.seq}"]
        parts += [f"--new-tokens {self.new_tokens}"] if self.new_tokens else []
        return " ".join(parts) + " --why"


CASES = [
    Case("mixtral", "mixtral_8x7b", "h100-ib-128node", "train", 256, 4096, devices=64),
    Case("deepseek", "deepseek_v3", "h100-ib-128node", "train", 3840, 4096),
    Case("qwen3", "qwen3_30b_a3b", "dgx-h100", "generate", 32, 2048, new_tokens=512),
    Case("llama4", "hf_llama4_scout", "h100-ib-128node", "train", 256, 4096, devices=64),
]


def plan_case(case: Case) -> tuple[Plan, float]:
    """The plan `planner optimize` makes for `case`, and the seconds it took (tracing included)."""
    start = time.perf_counter()
    prepared = workflow.prepare(
        str(ROOT / "examples" / f"{case.model}.py"), case.workload, case.batch, case.seq, None, None, None,
        case.new_tokens,
    )  # fmt: skip
    constraints = workflow.constraints_from(None, None, None, "none", max_devices=case.devices)
    plan = workflow.make_plan(prepared, load_cluster(case.cluster), constraints, f"examples/{case.model}.py")
    return plan, time.perf_counter() - start


def _seconds(t: float) -> str:
    return "-" if not math.isfinite(t) else f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms"


def layout(plan: Plan) -> str:
    """Mesh, expert parallelism, data-parallel style, micro-batches and recomputation of a plan."""
    recompute = "/".join(sorted({str(r) for r in plan.recompute.values()})) or "none"
    parts = [plan.mesh.label(), f"EP {plan.ep_text()}"]
    if plan.dp > 1 and plan.workload.value == "train":
        parts.append(plan.dp_style_text())
    parts.append(f"m={plan.micro_batches}")
    if plan.workload.value == "train":
        parts.append(f"recompute {recompute}")
    return ", ".join(parts)


def alternatives(plan: Plan) -> str:
    """The expert-parallelism decision's options, fastest first (`--why`), "-" where none could run."""
    decision = next(d for d in plan.decisions if d.subject == "expert parallelism")
    ranked = sorted(decision.options.items(), key=lambda item: item[1])
    shown = [f"{name}: {_seconds(t)}" for name, t in ranked if math.isfinite(t)]
    refused = [name for name, t in ranked if not math.isfinite(t) and "split" not in name]
    split = sum(1 for name, t in ranked if not math.isfinite(t) and "split" in name)
    refused += [f"{split} with the experts split over tp"] if split else []
    return "; ".join(shown) + (
        f"; not solved (pruned by its bound, over memory, or cannot run): {', '.join(refused)}"
        if refused
        else ""
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--only", choices=[c.name for c in CASES])
    args = parser.parse_args()
    console = Console(width=200)
    table = Table(
        title="Mixtures of experts: the planned layouts (model TFLOP/s per GPU with active parameters)"
    )
    for column in ("model", "cluster", "workload", "layout", "step / token", "TFLOP/s per GPU", "memory/rank",
                   "EP alternatives (--why)", "plan time"):  # fmt: skip
        table.add_column(column)
    for case in CASES:
        if args.only and case.name != args.only:
            continue
        plan, seconds = plan_case(case)
        p = plan.predicted
        if plan.serving is not None:
            step = f"TPOT {_seconds(plan.serving.tpot_s)}, TTFT {_seconds(plan.serving.ttft_s)}"
            memory = max(p.peak_memory_bytes, plan.serving.prefill_peak_memory_bytes or 0.0)
        else:
            step, memory = f"step {_seconds(p.latency_s)}", p.peak_memory_bytes
        devices = f"{case.cluster}, {plan.num_devices} GPUs"
        table.add_row(
            case.model, devices, case.workload, layout(plan), step, f"{p.model_flops_per_s_per_device / 1e12:.1f}",
            f"{memory / 2**30:.1f} GiB", alternatives(plan), f"{seconds:.1f} s",
        )  # fmt: skip
        console.print(f"[dim]{case.command()}[/dim]")
    console.print(table)


if __name__ == "__main__":
    main()

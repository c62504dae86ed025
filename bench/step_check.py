"""The Megatron-Core 1.7B row's training step on one GPU, sustained: does the planner's price of a
whole step hold once the GPU has run for a minute (clocks under its power limit), at the micro-batch
sizes the published run could have used?

    python bench/step_check.py                          # CUDA: the 1.7B row, mbs 1 and 4, 60 s each
    python bench/step_check.py --seconds 120 --json out/step_check.json
    python bench/step_check.py --device cpu --tiny      # the logic on a CPU (a check of the script)

The planner prices the 1.7B row of Megatron-Core's weak-scaling table (`training_published.py`: TP1,
DP48, 4 sequences of 4,096 tokens per GPU and step, 408.8 TFLOP/s per GPU published, 0.452 s) 26%
faster than published, with no tensor-parallel traffic and 7 ms of exposed data-parallel traffic: the
gap is one GPU's compute. `layer_check.py` timed one such layer at 1 x 4,096 tokens within 11% of its
price, in short windows. This script runs what one of the 48 GPUs runs, in eager PyTorch: the row's
GPT (examples/models.py, hidden 2,048, 24 layers, 16 heads, vocabulary 131,072, Megatron-LM's default
dropout 0.1) in bf16, the loss in fp32, 4 sequences per step as `--micro-batch-sizes` micro-batches
(gradients accumulated), AdamW's fused step, for `--seconds` per micro-batch size after a warm-up,
each step timed with CUDA events. It samples the SM clock, power and temperature (`nvidia-smi`)
while it runs and prints, per micro-batch size: the median step of the first and of the last ten
steps (what a minute of load does), the clocks, the planner's predicted step of the same plan on the
device's preset (`--cluster`, default dgx-h200 on an H200, else dgx-h100; one GPU, the micro-batches
pinned) and measured / predicted; and the published per-GPU step beside them (an H100's, under
Megatron-Core with Transformer Engine kernels, the data-parallel traffic included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples"))

from models import GPT, GPTConfig  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from training_at_scale import MEGATRON_DROPOUT, gpt_structure  # noqa: E402
from training_published import MEGATRON_ROWS, MEGATRON_TIED, SEQ, VOCAB, megatron_flops  # noqa: E402

from costmodels.cluster import load_cluster  # noqa: E402
from planner.solver.problem import Constraints, WorkloadSpec  # noqa: E402
from planner.solver.search import plan_model  # noqa: E402

SEQUENCES = 4  # per GPU and step in the 1.7B row: global batch 192 over DP 48
# the tiny model `--tiny` checks the script with: (vocab, positions, layers, heads, hidden), sequence
TINY = GPTConfig(vocab_size=256, n_positions=64, n_layer=2, n_head=2, n_embd=32, dropout=MEGATRON_DROPOUT)
TINY_SEQ = 32
EDGE_STEPS = 10  # steps in the first / last window


@dataclass
class Run:
    """One micro-batch size's sustained run: per-step seconds in order, and the device samples."""

    micro_batch_size: int
    steps_s: list[float] = field(default_factory=list)
    clocks_mhz: list[float] = field(default_factory=list)
    power_w: list[float] = field(default_factory=list)
    temperature_c: list[float] = field(default_factory=list)

    def median(self, which: slice = slice(None)) -> float:
        return statistics.median(self.steps_s[which])


def row_config() -> GPTConfig:
    """The 1.7B row's GPT (`training_published.MEGATRON_ROWS`), with the published runs' dropout."""
    size, heads, hidden, layers, *_ = MEGATRON_ROWS[0]
    assert size == "1.7B"
    return GPTConfig(vocab_size=VOCAB, n_positions=SEQ, n_layer=layers, n_head=heads, n_embd=hidden,
                     dropout=MEGATRON_DROPOUT, tie_embeddings=MEGATRON_TIED)  # fmt: skip


def sample_device() -> tuple[float, float, float] | None:
    """(SM clock MHz, power W, temperature C) of GPU 0 from nvidia-smi, or None where it cannot say."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
             "--id=0"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
        clock, power, temp = (float(v) for v in out.strip().splitlines()[0].split(","))
        return clock, power, temp
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def run_steps(model: GPT, seq: int, micro_batch_size: int, seconds: float, device: torch.device,
              warmup: int = 3) -> Run:  # fmt: skip
    """Train `model` for `seconds` after `warmup` steps: each step SEQUENCES random sequences of `seq`
    tokens as micro-batches of `micro_batch_size`, the loss (fp32 cross-entropy) averaged over them,
    then AdamW. Returns the per-step times (CUDA events on a GPU, else wall time) and device samples."""
    vocab = model.config.vocab_size
    micro = SEQUENCES // micro_batch_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    tokens = torch.randint(0, vocab, (SEQUENCES, seq + 1), device=device)
    run = Run(micro_batch_size)
    cuda = device.type == "cuda"

    def step() -> None:
        for i in range(micro):
            chunk = tokens[i * micro_batch_size : (i + 1) * micro_batch_size]
            logits = model(chunk[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten()) / micro
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    last_sample = -1e9
    while time.perf_counter() - start < seconds or len(run.steps_s) < 2 * EDGE_STEPS:
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            end.synchronize()
            run.steps_s.append(begin.elapsed_time(end) / 1e3)
            if time.perf_counter() - last_sample > 2.0:  # every couple of seconds, between steps
                sample = sample_device()
                if sample is not None:
                    run.clocks_mhz.append(sample[0])
                    run.power_w.append(sample[1])
                    run.temperature_c.append(sample[2])
                last_sample = time.perf_counter()
        else:
            t0 = time.perf_counter()
            step()
            run.steps_s.append(time.perf_counter() - t0)
    return run


def predict_step_s(config: GPTConfig, seq: int, micro_batch_size: int, cluster: str) -> float:
    """The planner's step of the same run: one device of `cluster`, SEQUENCES sequences of `seq` tokens
    in bf16 as SEQUENCES / micro_batch_size micro-batches (pinned), no recomputation, gradients in the
    parameters' dtype."""
    spec = load_cluster(cluster, nproc=1) if cluster == "local-cpu" else load_cluster(cluster)
    work = WorkloadSpec("train", SEQUENCES, seq, dtype="bf16", micro_batches=SEQUENCES // micro_batch_size)
    pin = Constraints(tp=1, pp=1, dp=1, max_devices=1, recompute="none")
    return plan_model(gpt_structure(config), spec, work, pin).predicted.latency_s


def main(argv: list[str] | None = None) -> None:
    """The command line above; ``argv`` (default: sys.argv's) its arguments. Exits 2 without a CUDA
    device (unless --device cpu) or with a micro-batch size that does not divide 4."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--cluster", default=None, help="preset or YAML the prediction is priced on "
                        "(default: dgx-h200 on an H200, dgx-h100 on other GPUs, local-cpu on a CPU)")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=60.0, help="timed seconds per micro-batch size")
    parser.add_argument("--micro-batch-sizes", default="1,4", help="comma-separated divisors of 4")
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT (checks the script on a CPU)")
    parser.add_argument("--json", type=Path, default=None, help="write the runs here")
    args = parser.parse_args(argv)
    console = Console()
    if args.device == "cuda" and not torch.cuda.is_available():
        console.print("no CUDA device: run with --device cpu --tiny to check the script")
        sys.exit(2)
    sizes = [int(v) for v in args.micro_batch_sizes.split(",")]
    if any(s < 1 or SEQUENCES % s for s in sizes):
        console.print(f"--micro-batch-sizes {args.micro_batch_sizes}: each must divide {SEQUENCES}")
        sys.exit(2)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    cluster = args.cluster or (
        "local-cpu" if device.type == "cpu" else "dgx-h200" if "H200" in name else "dgx-h100"
    )
    config, seq = (TINY, TINY_SEQ) if args.tiny else (row_config(), SEQ)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = GPT(config).to(device=device, dtype=dtype).train()
    published_s = megatron_flops(192, SEQ, 24, 2048, VOCAB) / (MEGATRON_ROWS[0][-1] * 1e12 * 48)
    table = Table(title=f"1.7B row's step on one {name} ({SEQUENCES} x {seq} tokens, {dtype}), "
                  f"{args.seconds:g} s per micro-batch size; predicted on {cluster}")  # fmt: skip
    for col in ("mbs x micro-batches", "steps", "first 10", "last 10", "median", "SM clock MHz (min / median)",
                "power W (max)", "predicted", "measured / predicted", "published (H100, Megatron-Core)"):  # fmt: skip
        table.add_column(col, justify="right")
    report = {"device": name, "cluster": cluster, "tiny": args.tiny, "published_s": published_s, "runs": []}
    for mbs in sizes:
        predicted = predict_step_s(config, seq, mbs, cluster)
        try:
            run = run_steps(model, seq, mbs, args.seconds, device)
        except torch.OutOfMemoryError:  # 4 sequences at once need about 70 GB: an 80 GB GPU may not hold them
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            table.add_row(
                f"{mbs} x {SEQUENCES // mbs}", "out of memory", *["-"] * 5, f"{predicted:.3f} s", "-", "-"
            )
            report["runs"].append(
                {"micro_batch_size": mbs, "error": "out of memory", "predicted_s": predicted}
            )
            continue
        first, last = run.median(slice(0, EDGE_STEPS)), run.median(slice(-EDGE_STEPS, None))
        clocks = (
            f"{min(run.clocks_mhz):.0f} / {statistics.median(run.clocks_mhz):.0f}" if run.clocks_mhz else "-"
        )
        table.add_row(
            f"{mbs} x {SEQUENCES // mbs}", str(len(run.steps_s)), f"{first:.3f} s", f"{last:.3f} s",
            f"{run.median():.3f} s", clocks, f"{max(run.power_w):.0f}" if run.power_w else "-",
            f"{predicted:.3f} s", f"{run.median() / predicted:.2f}", "-" if args.tiny else f"{published_s:.3f} s",
        )  # fmt: skip
        report["runs"].append({
            "micro_batch_size": mbs, "steps_s": run.steps_s, "first_s": first, "last_s": last,
            "median_s": run.median(), "predicted_s": predicted, "clocks_mhz": run.clocks_mhz,
            "power_w": run.power_w, "temperature_c": run.temperature_c,
        })  # fmt: skip
    console.print(table)
    console.print(
        "How to read it: measured / predicted over 1 is compute the preset prices too fast on this GPU; "
        "last 10 above first 10 is the GPU slowing under sustained load (see the clocks). The published "
        "step is an H100's under Megatron-Core; an H200 runs the same kernels with more memory bandwidth."
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

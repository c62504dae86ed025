"""Forward latency of our generated TP module against PyTorch's DTensor tensor parallelism, side by side.

    python bench/tp_vs_dtensor.py [--nproc 2] [--iters 20] [--warmup 3]

On the same `nproc` gloo ranks and the same Llama-3 weights (examples/models.py), two sharded versions
of each model run in interleaved rounds (A, B, B, A, ...):

(a) ours: `planner.frontend.capture.capture` -> `passes.tensor_parallel.apply_tensor_parallel` with the
    hand-written Megatron splits of `tests.plans.megatron_splits` (Q/K/V and w1/w3 column-parallel,
    wo and w2 row-parallel; embedding and LM head replicated) -> the rewritten GraphModule;
(b) DTensor: the eager model sharded with `torch.distributed.tensor.parallel.parallelize_module`,
    ColwiseParallel on wq/wk/wv/w1/w3 and RowwiseParallel on wo/w2 (the torchtitan / gpt-fast plan,
    embedding and LM head replicated as in (a)), with each attention module's n_heads / n_kv_heads
    divided by tp so its reshapes see the local heads.

Both outputs are first compared with the unsharded model (max abs diff). Latency of a step is the
slowest rank's; the table shows medians with p10-p90 and the ratio ours / DTensor (median of the
per-round ratios; < 1 means ours is faster).
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
    Spread,
    add_repo_to_path,
    interleaved,
    machine_line,
    paired_ratio,
    sign_test,
    step_times,
)
from runtime.launch import RankContext, launch  # noqa: E402

add_repo_to_path()


@dataclass(frozen=True)
class Case:
    """One model configuration to compare (examples.models.LlamaConfig fields) and its input size."""

    name: str
    config: dict  # LlamaConfig keyword arguments; missing fields keep the "tiny" values
    batch_size: int
    seq_len: int


CASES = (
    # examples/llama3.py's tiny config: per-op overhead dominates (a forward is a few ms).
    Case("llama3 tiny (dim 128, 4 layers)", {}, 2, 32),
    # Compute dominates: ~6 GFLOP per forward, 60-200 ms unsharded on one core of this VM.
    Case(
        "llama3 dim 512, 8 layers, seq 128",
        dict(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1408, max_seq_len=512),
        1,
        128,
    ),
)


@dataclass
class Payload:
    cases: tuple[Case, ...]
    iters: int
    warmup: int


def _build(case: Case):
    from models import LLAMA_CONFIGS, Llama, LlamaConfig, token_ids  # noqa: PLC0415 - examples/ on the path

    base = LLAMA_CONFIGS["tiny"].__dict__ | case.config
    config = LlamaConfig(**base)
    torch.manual_seed(0)
    model = Llama(config).eval()
    (tokens,) = token_ids(config.vocab_size, case.batch_size, case.seq_len)
    return model, tokens


def _ours(model, tokens, rank: int, tp: int):
    from passes.tensor_parallel import apply_tensor_parallel  # noqa: PLC0415
    from planner.frontend.analysis import analyse  # noqa: PLC0415
    from planner.frontend.capture import capture  # noqa: PLC0415
    from tests.plans import megatron_splits  # noqa: PLC0415

    gm = capture(model, (tokens,), {})
    splits = megatron_splits(analyse(gm), vocab=False)
    gm = copy.deepcopy(gm)
    apply_tensor_parallel(gm, splits, rank, tp)
    return gm


def _dtensor(model, tp_mesh, tp: int):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: PLC0415

    model = copy.deepcopy(model)
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, plan)
        layer.attention.n_heads //= tp  # local heads, as torchtitan / gpt-fast do
        layer.attention.n_kv_heads //= tp
    return model


def entry(ctx: RankContext, payload: Payload) -> list[dict]:
    """Per rank: for each case, check both sharded models against the unsharded one, then time them."""
    from passes import collectives  # noqa: PLC0415
    from planner.plan import MeshShape  # noqa: PLC0415
    from runtime.mesh import build_rank_groups  # noqa: PLC0415

    tp = ctx.world_size
    groups = build_rank_groups(MeshShape(tp=tp, pp=1, dp=1), "cpu")
    collectives.register_group("tp", groups.group("tp"))
    tp_mesh = groups.device_mesh["tp"]
    out = []
    for case in payload.cases:
        model, tokens = _build(case)
        with torch.no_grad():
            reference = model(tokens)
            ours = _ours(model, tokens, groups.tp_rank, tp)
            theirs = _dtensor(model, tp_mesh, tp)
            ours_out = ours(tokens)
            ours_out = ours_out[0] if isinstance(ours_out, tuple) else ours_out
            diff_ours = float((ours_out - reference).abs().max())
            diff_theirs = float((theirs(tokens) - reference).abs().max())
            samples = interleaved(
                {"ours": lambda f=ours, x=tokens: f(x), "dtensor": lambda f=theirs, x=tokens: f(x)},
                iters=payload.iters,
                warmup=payload.warmup,
            )
        out.append(
            dict(
                diff_ours=diff_ours,
                diff_dtensor=diff_theirs,
                scale=float(reference.abs().max()),
                samples=samples,
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="gloo ranks = TP degree (default 2)")
    parser.add_argument("--iters", type=int, default=40, help="timed rounds per case (default 40)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    args = parser.parse_args(argv)
    console = Console(width=150)
    console.print(f"[bold]TP: ours vs DTensor[/], tp={args.nproc} gloo ranks, {machine_line()}")
    payload = Payload(CASES, args.iters, args.warmup)
    results = launch(entry, payload, nproc=args.nproc, timeout_s=600)

    table = Table(
        title=f"Forward latency, TP={args.nproc}, median (p10-p90) of {args.iters} interleaved rounds"
    )
    for col in (
        "model (batch x seq)",
        "max|diff| ours",
        "max|diff| DTensor",
        "ours",
        "DTensor",
        "ours / DTensor",
        "ours faster in",
    ):
        table.add_column(col, justify="right" if col != "model (batch x seq)" else "left")
    ratios = []
    for i, case in enumerate(CASES):
        per_rank = [r[i] for r in results]
        ours = step_times([r["samples"]["ours"] for r in per_rank])
        theirs = step_times([r["samples"]["dtensor"] for r in per_rank])
        ratio = paired_ratio(ours, theirs)
        wins = sign_test(ours, theirs)
        ratios.append((case.name, ratio, Spread.of(ours).median_s / Spread.of(theirs).median_s, wins))
        table.add_row(
            f"{case.name} ({case.batch_size} x {case.seq_len})",
            f"{max(r['diff_ours'] for r in per_rank):.1e}",
            f"{max(r['diff_dtensor'] for r in per_rank):.1e}",
            Spread.of(ours).text(),
            Spread.of(theirs).text(),
            f"{ratio.median_s:.3f} ({ratio.p10_s:.2f}-{ratio.p90_s:.2f})",
            f"{wins[0]}/{wins[1]} rounds (p={wins[2]:.1g})",
        )
    console.print(table)
    console.print(_interpretation(ratios, results[0][0]["scale"]))
    return 0


def _interpretation(ratios: list[tuple[str, Spread, float, tuple[int, int, float]]], scale: float) -> str:
    parts = [
        f"{name}: ours/DTensor {r.median_s:.2f} (p10-p90 {r.p10_s:.2f}-{r.p90_s:.2f}; ratio of medians {m:.2f}); "
        f"ours faster in {k}/{n} rounds, "
        + (
            ("so ours is faster" if k > n / 2 else "so ours is slower")
            if p < 0.01
            else "not a significant difference"
        )
        + f" (sign test p={p:.1g})"
        for name, r, m, (k, n, p) in ratios
    ]
    return (
        "Interpretation: both sharded models reproduce the unsharded logits (diffs are float32 rounding "
        f"against an output scale of ~{scale:.2g}). "
        + "; ".join(parts)
        + ". Both do the same matmuls and the same two all-reduces per layer over the same gloo group, "
        "so the difference is framework overhead: ours runs a flat ATen-level GraphModule (one Python call "
        "per op, plain tensors, a c10d all-reduce after each row-parallel matmul), DTensor runs the eager "
        "modules with parallel-style hooks that wrap and unwrap DTensors, dispatches every sharded linear "
        "through DTensor's sharding propagation and all-reduces through functional collectives (this "
        "benchmark does not split the gap further). Overhead is a large share of the tiny model's few-ms "
        "forward and a smaller one of the compute-bound model. 'Faster' is claimed only when the sign test "
        "over the interleaved rounds gives p < 0.01; p10-p90 of the per-round ratios shows the spread of "
        "this shared machine."
    )


if __name__ == "__main__":
    sys.exit(main())

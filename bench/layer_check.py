"""One transformer layer of each Megatron-Core weak-scaling row (issue 32's table; the rows of
`bench/training_published.py`), timed forward + backward on this device beside the planner's price of
the same layer, op by op: which part of the small models' gap is it?

    python bench/layer_check.py                          # CUDA, cluster dgx-h200, every row
    python bench/layer_check.py --rows 1.7B,7.1B --cluster dgx-h100
    python bench/layer_check.py --device cpu --tiny      # the logic on a CPU: a tiny layer, local-cpu

The planner prices the 1.7B and 7.1B rows 26% and 21% faster than published while the large rows are
within 11%, and the per-layer gap does not grow as h^2 (`bench/README.md`). Its candidates are the
GEMM efficiency at a 2,048-wide model's shapes, the attention kernel, and the ops between the GEMMs
(norms, GELU, residual adds, copies: few bytes each, so their fixed cost counts). This script tells them
apart on a GPU: for each row it builds one layer as one TP rank holds it (Megatron's split at the row's
TP degree: QKV and the first MLP linear column-parallel, the output projections row-parallel, heads
split; no sequence parallelism, no collectives: compute only), one micro-batch of one sequence of
4,096 tokens in bf16, and times with CUDA events (`costmodels.gpu_calibrate.event_median_s`):

- each projection: its forward GEMM and the two backward GEMMs (input and weight gradient), and its
  forward alone ("<op>.fwd"; "<op>.bwd" is the difference: how the backward GEMMs compare with their
  price apart from the forward's, a median of each over the rows at the end);
- the attention core (`F.scaled_dot_product_attention`, causal) forward and backward;
- the whole layer forward and backward; "rest" is the whole minus the projections and the core;
- the last stage's head, apart from the layer: final norm, the LM head's vocabulary shard (V / tp
  columns, Megatron's vocab-parallel head) and the fp32 cross-entropy over those logits ("head").

Beside each, the planner's price of the same op (`planner.solver.costing.build_cost_tables` of the
row's GPT on a tp-rank mesh, Megatron's choices, `OpOption.compute_s`: forward + backward) and the
ratio measured / predicted. `--json PATH` writes the rows. On a CPU (`--device cpu --tiny`) it runs the
same code on a tiny layer against the local-cpu preset (a check of the script, not of the prices).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples"))

from models import GPTConfig  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from training_at_scale import gpt_structure  # noqa: E402
from training_published import MEGATRON_ROWS, SEQ, VOCAB  # noqa: E402

from costmodels.cluster import load_cluster  # noqa: E402
from costmodels.gpu_calibrate import CudaEventTimer, WallTimer, event_median_s  # noqa: E402
from planner.plan import MeshShape  # noqa: E402
from planner.solver.baseline import megatron_choices  # noqa: E402
from planner.solver.costing import CostContext, build_cost_tables  # noqa: E402
from planner.solver.problem import MeshConfig, WorkloadSpec  # noqa: E402

# (name, heads, hidden, layers, TP) of the tiny layer `--tiny` checks the script with on a CPU
TINY_ROW = ("tiny", 4, 64, 2, 2)
TINY_SEQ = 64
# the GPT layer's projections (`planner.frontend` op names) -> (in, out) widths on one TP rank of h
# hidden at TP degree t: column-parallel QKV and first MLP linear, row-parallel output projections


def rank_widths(hidden: int, tp: int) -> dict[str, tuple[int, int]]:
    """The (in_features, out_features) of each projection of a GPT layer (examples/models.py GPTBlock:
    fused QKV, 4h MLP) on one of `tp` ranks under Megatron's split."""
    return {
        "qkv": (hidden, 3 * hidden // tp),
        "o": (hidden // tp, hidden),
        "up": (hidden, 4 * hidden // tp),
        "down": (4 * hidden // tp, hidden),
    }


class RankBlock(nn.Module):
    """examples/models.py's GPTBlock as one of `tp` ranks computes it under Megatron's split, without
    its collectives: pre-norm attention (QKV column-parallel, heads / tp heads, output projection
    row-parallel) and pre-norm MLP (column then row), residual adds. Input and output (B, T, hidden)."""

    def __init__(self, hidden: int, heads: int, tp: int) -> None:
        super().__init__()
        widths = rank_widths(hidden, tp)
        self.heads, self.head_dim = heads // tp, hidden // heads
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.o = nn.Linear(*widths["qkv"]), nn.Linear(*widths["o"])
        self.up, self.down = nn.Linear(*widths["up"]), nn.Linear(*widths["down"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(B, T, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))
        return x + self.down(F.gelu(self.up(self.ln_2(x)), approximate="tanh"))


class RankHead(nn.Module):
    """The last stage's tail as one of `tp` ranks computes it: final LayerNorm, the LM head's shard of
    `vocab` / tp output columns, and the cross-entropy over those logits in fp32 (Megatron-LM's and
    torchtitan's loss; the vocab-parallel form reduces a max and a sum across ranks, not timed here).
    Input (B, T, hidden) -> a scalar loss."""

    def __init__(self, hidden: int, vocab: int, tp: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, -(-vocab // tp), bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(x)).float()
        target = torch.zeros(logits.shape[:-1], dtype=torch.long, device=x.device)
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _train_step_s(fn, inputs: list[torch.Tensor], timer) -> float:
    """Seconds of forward + backward of `fn(*inputs)` (a random output gradient flows back). Every
    gradient is dropped before each backward, so it writes fresh ones: no accumulation adds timed."""
    out = fn(*inputs)
    grad = torch.randn_like(out)
    params = [*inputs, *(fn.parameters() if isinstance(fn, nn.Module) else ())]

    def step() -> None:
        for t in params:
            t.grad = None
        fn(*inputs).backward(grad)

    return event_median_s(step, timer, warmup=3, reps=5)


def _forward_s(fn, inputs: list[torch.Tensor], timer) -> float:
    """Seconds of the forward of `fn(*inputs)` alone (no graph kept for a backward)."""

    def step() -> None:
        with torch.no_grad():
            fn(*inputs)

    return event_median_s(step, timer, warmup=3, reps=5)


def measure_layer(hidden: int, heads: int, tp: int, seq: int, device: torch.device, dtype: torch.dtype,
                  timer, vocab: int = 0) -> dict[str, float]:  # fmt: skip
    """Measured seconds of forward + backward, one sequence of `seq` tokens: each projection ("qkv",
    "o", "up", "down"), the attention core ("core"), the whole rank layer ("layer") and, when `vocab`
    is given, the last stage's head on its vocabulary shard with the fp32 loss ("head", `RankHead`)."""
    out: dict[str, float] = {}
    for name, (k, n) in rank_widths(hidden, tp).items():
        linear = nn.Linear(k, n, device=device, dtype=dtype)
        x = torch.randn(1, seq, k, device=device, dtype=dtype, requires_grad=True)
        out[name] = _train_step_s(linear, [x], timer)
        out[f"{name}.fwd"] = _forward_s(linear, [x], timer)
        del linear, x
    shape = (1, heads // tp, seq, hidden // heads)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    out["core"] = _train_step_s(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
                                [q, k, v], timer)  # fmt: skip
    del q, k, v
    block = RankBlock(hidden, heads, tp).to(device=device, dtype=dtype)
    x = torch.randn(1, seq, hidden, device=device, dtype=dtype, requires_grad=True)
    out["layer"] = _train_step_s(block, [x], timer)
    del block, x
    if vocab:
        out["head"] = _train_step_s(RankHead(hidden, vocab, tp).to(device=device, dtype=dtype),
                                    [torch.randn(1, seq, hidden, device=device, dtype=dtype, requires_grad=True)],
                                    timer)  # fmt: skip
    return out


def predict_layer(heads: int, hidden: int, layers: int, tp: int, seq: int, vocab: int, cluster: str,
                  dtype: str) -> dict[str, float]:  # fmt: skip
    """The planner's seconds of the same ops, forward + backward, one sequence of `seq` tokens on one of
    `tp` ranks with Megatron's choices (`OpOption.compute_s`), "layer" the layer's compute (the ops
    plus its norms and residual adds, `LayerGraph.fixed_compute_s`), "head" the LM head's option with
    its loss plus the last stage's fixed compute (final norm)."""
    config = GPTConfig(vocab_size=vocab, n_positions=seq, n_layer=layers, n_head=heads, n_embd=hidden)
    structure = gpt_structure(config)
    spec = load_cluster(cluster, nproc=tp) if cluster == "local-cpu" else load_cluster(cluster)
    work = WorkloadSpec("train", 1, seq, dtype=dtype)
    ctx = CostContext(structure, spec, work, MeshConfig(MeshShape(tp=tp, pp=1, dp=1), 1), dtype)
    tables = build_cost_tables(ctx)
    key = tables.layer_keys[0]
    graph = tables.graphs[key]
    choices = megatron_choices(tables.graphs, tables.ends)
    out = {op.name: op.option(choices[(key, op.name)]).compute_s for op in graph.ops}
    out["layer"] = graph.fixed_compute_s + sum(out.values())
    forward = build_cost_tables(ctx.forward_only()).graphs[key]  # each projection's forward GEMM alone
    for name in rank_widths(hidden, tp):
        out[f"{name}.fwd"] = forward.op(name).option(choices[(key, name)]).compute_s
    head = next((op for op in tables.ends.ops if op.name == "lm_head"), None)
    if head is not None:  # the LM head with its loss (`costing.loss_time_s`) and the final norm
        out["head"] = head.option(choices[("ends", "lm_head")]).compute_s + tables.ends.last_stage_compute_s
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--cluster", default=None, help="preset or YAML priced against (default: dgx-h200 on "
                        "CUDA, local-cpu on a CPU)")  # fmt: skip
    parser.add_argument("--rows", default=None, help="comma-separated sizes of the table (default: all)")
    parser.add_argument("--tiny", action="store_true", help="a tiny layer (checks the script on a CPU)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(
            f"error: --device cuda but torch {torch.__version__} sees no CUDA GPU; use --device cpu --tiny"
        )
    device = torch.device(args.device)
    cluster = args.cluster or ("dgx-h200" if args.device == "cuda" else "local-cpu")
    # bf16 on the GPU (the rows' dtype); fp32 on a CPU (its bf16 matmuls are not what the preset prices)
    dtype, dtype_name = (torch.bfloat16, "bf16") if args.device == "cuda" else (torch.float32, "fp32")
    timer = CudaEventTimer() if args.device == "cuda" else WallTimer()
    if args.tiny:
        rows, seq, vocab = [TINY_ROW], TINY_SEQ, 256
    else:
        wanted = None if args.rows is None else set(args.rows.split(","))
        rows = [(r[0], r[1], r[2], r[3], r[4]) for r in MEGATRON_ROWS if wanted is None or r[0] in wanted]
        if not rows:
            sys.exit(f"error: --rows {args.rows}: none of {[r[0] for r in MEGATRON_ROWS]}")
        seq, vocab = SEQ, VOCAB
    console = Console(width=160)
    table = Table(title=f"One layer per TP rank, forward + backward, 1 x {seq} tokens, {dtype_name}, on "
                  f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else 'CPU'}, priced with {cluster}")  # fmt: skip
    for col in ("row", "hidden / tp", "op", "predicted ms", "measured ms", "measured / predicted"):
        table.add_column(col, justify="right")
    results = []
    for name, heads, hidden, layers, tp in rows:
        predicted = predict_layer(heads, hidden, layers, tp, seq, vocab, cluster, dtype_name)
        measured = measure_layer(hidden, heads, tp, seq, device, dtype, timer, vocab)
        for side in (predicted, measured):
            side["rest"] = side["layer"] - sum(side.get(op, 0.0) for op in ("qkv", "o", "up", "down", "core"))
            for op in rank_widths(hidden, tp):  # the input- and weight-gradient GEMMs together
                side[f"{op}.bwd"] = side[op] - side[f"{op}.fwd"]
        ops = [f"{op}{part}" for op in ("qkv", "o", "up", "down") for part in ("", ".fwd", ".bwd")]
        for op in ops[:3] + ["core"] + ops[3:] + ["rest", "layer", "head"]:
            p, m = predicted.get(op), measured.get(op)
            ratio = f"{m / p:.2f}" if p and m is not None and p > 0 else "-"
            table.add_row(name, f"{hidden} / {tp}", op, "-" if p is None else f"{p * 1e3:.3f}",
                          "-" if m is None else f"{m * 1e3:.3f}", ratio)  # fmt: skip
        table.add_section()
        results.append({"row": name, "hidden": hidden, "heads": heads, "tp": tp, "seq": seq,
                        "predicted_s": predicted, "measured_s": measured})  # fmt: skip
    console.print(table)
    console.print(
        "rest = the layer minus its projections and attention core: norms, GELU, residual adds, copies; "
        "head = final norm, LM head shard and fp32 loss (not in the layer); <op>.fwd = its forward GEMM "
        "alone, <op>.bwd = forward + backward less it (the input- and weight-gradient GEMMs)"
    )
    bwd = [r["measured_s"][f"{op}.bwd"] / r["predicted_s"][f"{op}.bwd"] for r in results
           for op in ("qkv", "up", "down") if r["predicted_s"][f"{op}.bwd"] > 0]  # fmt: skip
    fwd = [r["measured_s"][f"{op}.fwd"] / r["predicted_s"][f"{op}.fwd"] for r in results
           for op in ("qkv", "up", "down") if r["predicted_s"][f"{op}.fwd"] > 0]  # fmt: skip
    if bwd and fwd:
        console.print(
            f"qkv, up, down GEMMs, measured / predicted: forward median {statistics.median(fwd):.2f}, "
            f"backward median {statistics.median(bwd):.2f}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"cluster": cluster, "dtype": dtype_name, "rows": results}, indent=1))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

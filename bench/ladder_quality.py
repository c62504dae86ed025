"""Ladder residual's cost in model quality, and its recovery, on a small Llama trained here on real text.

    python bench/ladder_quality.py [--steps 1600] [--adapt-fraction 0.2] [--part all|standard|scratch]

Corpus: the Python standard library's source and text files (offline on every machine), split into
train / held-out by file (`runtime.lm_data`). Tokenizer: byte-level BPE of 2048 tokens trained on the
training files (`tokenizers`), saved as `examples/llama_small_lm.tokenizer.json`. Model:
`examples/llama_small_lm.py` (Llama-style, 2.0 M parameters, 8 layers).

Rows of the table (held-out loss in nats per token, perplexity):

1. standard: pre-trained from scratch for `--steps` steps (AdamW, warm-up + cosine); the checkpoint is
   `examples/llama_small_lm.safetensors` (the weights the example uses);
2. ladder zero-shot: the same weights with ladder residual on the upper half (layers 4-7), through
   the planner's ladder pass on the captured graph;
3. adapted: 2. fine-tuned for `--adapt-fraction` of the pre-training steps (`runtime.lm_train.run_adapt`,
   what `planner adapt` runs);
4. standard trained on for the same steps the same way, without ladder: what 3. is compared with
   when the standard model has not finished learning (its loss still falls);
5. ladder from scratch: the upper-half ladder model pre-trained like 1. from the same initialisation.

Beside them: the planner's predicted speed-up of the same ladder at TP=8 on the dgx-h100 preset
(standard latency / ladder latency): decode (batch 1) with the planner's best plans and with
Megatron's all-split assignment, and a 64 x 128-token prefill (`make_plan`, `prediction.predict`).

Run time on 2 shared CPU cores (one thread per process): about 7.5 minutes per 1600-step pre-training on a quiet core. Each
checkpoint (and each evaluation, out/ladder_quality/eval-*.json) is reused when it exists (delete it to redo a part); `--part standard` and `--part scratch`
run one pre-training each, so the two can run at once in two processes, then a plain run makes the rest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from passes.checkpoint import load_whole, save_checkpoint  # noqa: E402
from planner.frontend.modelfile import load_model_file  # noqa: E402
from runtime.lm_data import (  # noqa: E402
    STDLIB,
    TokenBlocks,
    corpus_files,
    load_tokenizer,
    read_text,
    split_by_file,
    train_tokenizer,
)
from runtime.lm_train import (  # noqa: E402
    AdaptJob,
    EvalResult,
    TrainConfig,
    evaluate,
    lm_graph,
    relative_increase,
    run_adapt,
    save_weights,
    train,
    upper_layers,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = REPO_ROOT / "examples" / "llama_small_lm.py"
OUT = REPO_ROOT / "out" / "ladder_quality"
BATCH = 8
LR = 3e-3
ADAPT_LR = 1e-3
SEED = 0
console = Console(width=None if sys.stdout.isatty() else 130)


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def tokenized_corpus(model_file) -> tuple[torch.Tensor, torch.Tensor]:
    """(train ids, held-out ids) of the stdlib corpus with the example's tokenizer (trained and saved
    when missing); cached under out/ by the tokenizer's hash."""
    files = corpus_files(STDLIB)
    train_files, held_files = split_by_file(files)
    tok_path = Path(model_file.module.TOKENIZER)
    if not tok_path.exists():
        console.print(f"training the tokenizer on {len(train_files)} files ...")
        tok = train_tokenizer([read_text(f) for f in train_files], model_file.module.CONFIG.vocab_size)
        tmp = tok_path.with_suffix(f".tmp{os.getpid()}")
        tok.save(str(tmp))
        os.replace(tmp, tok_path)
    digest = hashlib.sha256(tok_path.read_bytes()).hexdigest()[:12]
    cache = OUT / f"stdlib-{digest}-{len(train_files)}-{len(held_files)}.pt"
    if cache.exists():
        return torch.load(cache)
    from runtime.lm_data import encode_texts  # noqa: PLC0415

    tok = load_tokenizer(tok_path)
    console.print(f"tokenizing {len(train_files)} train and {len(held_files)} held-out files ...")
    ids = (
        encode_texts(tok, [read_text(f) for f in train_files]),
        encode_texts(tok, [read_text(f) for f in held_files]),
    )
    _atomic_save(ids, cache)
    return ids


def fresh_model(model_file, weights: Path | None = None):
    torch.manual_seed(SEED)
    model = model_file.build("cpu")
    if weights is not None:
        load_whole(model, str(weights))
    return model


def pretrain(model_file, train_blocks, held_blocks, ladder: list[int], steps: int, out: Path) -> None:
    """Pre-train from the seeded initialisation (ladder on `ladder`), log loss, save to `out`."""
    model = fresh_model(model_file)
    gm = lm_graph(model, BATCH, model_file.module.SEQ_LEN, ladder)
    config = TrainConfig(steps=steps, batch_size=BATCH, lr=LR, seed=SEED)
    name = "ladder" if ladder else "standard"
    start = time.perf_counter()
    window: list[float] = []

    def on_step(step: int, loss: float, lr: float) -> None:
        window.append(loss)
        if (step + 1) % 50 == 0 or step + 1 == steps:
            held = ""
            if (step + 1) % 200 == 0 or step + 1 == steps:
                held = f", held-out (first 20 batches) {evaluate(gm, held_blocks, BATCH, max_batches=20).loss:.4f}"
                gm.train()
            console.print(
                f"[{name}] step {step + 1}/{steps}: train loss {sum(window) / len(window):.4f} "
                f"(last {len(window)}), lr {lr:.2e}{held}, {time.perf_counter() - start:.0f} s"
            )
            window.clear()

    train(gm, train_blocks, config, on_step=on_step)
    save_weights(gm, model, out)
    console.print(f"[{name}] saved {out}")


def fine_tune(
    weights: Path, train_ids: torch.Tensor, seq_len: int, ladder: list[int], steps: int, out: Path
) -> None:
    """`planner adapt`'s training (`run_adapt`, one process) from `weights` with ladder on `ladder`
    ([]: the standard model trained on the same way, the adapted model's reference); saves `out`."""
    job = AdaptJob(
        str(MODEL),
        [str(weights)],
        train_ids,
        seq_len,
        ladder,
        TrainConfig(steps=steps, batch_size=BATCH, lr=ADAPT_LR, seed=SEED + 1),
    )
    name = "adapt" if ladder else "continue"
    start = time.perf_counter()
    result = run_adapt(
        job,
        on_step=lambda s, loss, lr: (
            (s + 1) % 20 == 0
            and console.print(
                f"[{name}] step {s + 1}/{steps}: loss {loss:.4f}, {time.perf_counter() - start:.0f} s"
            )
        ),
    )
    save_checkpoint(result.state, out)


def predicted_speedups(ladder: list[int]) -> dict[str, tuple[float, float]]:
    """Predicted (standard s, ladder s) at TP=8 on the dgx-h100 preset: one decode step (batch 1, the
    planner's default context) with the planner's best plans (`make_plan`, ladder none vs upper) and
    with Megatron's all-split TP=8 assignment priced with and without the ladder (`predict`); and a
    prefill of 64 x 128 tokens with the planner's best plans."""
    from costmodels.cluster import load_cluster  # noqa: PLC0415
    from planner.cli.workflow import constraints_from, make_plan, prepare  # noqa: PLC0415
    from planner.plan import MeshShape  # noqa: PLC0415
    from planner.solver.baseline import megatron_assignment  # noqa: PLC0415
    from planner.solver.prediction import predict  # noqa: PLC0415
    from planner.solver.problem import MeshConfig  # noqa: PLC0415
    from planner.solver.search import price  # noqa: PLC0415

    prepared = prepare(str(MODEL), "decode", batch_size=1)
    cluster = load_cluster("dgx-h100")
    std = make_plan(prepared, cluster, constraints_from(8, 1, 1, "none"), str(MODEL))
    lad = make_plan(prepared, cluster, constraints_from(8, 1, 1, f"upper:{len(ladder)}"), str(MODEL))
    tables = price(prepared.structure, cluster, prepared.workload, MeshConfig(MeshShape(tp=8, pp=1, dp=1), 1))
    megatron = megatron_assignment(tables)
    meg_std = predict(tables, megatron).prediction.latency_s
    megatron.ladder_layers = list(ladder)
    meg_lad = predict(tables, megatron).prediction.latency_s
    prefill = prepare(str(MODEL), "forward", batch_size=64, seq_len=128)
    pre_std = make_plan(prefill, cluster, constraints_from(8, 1, 1, "none"), str(MODEL))
    pre_lad = make_plan(prefill, cluster, constraints_from(8, 1, 1, f"upper:{len(ladder)}"), str(MODEL))
    return {
        "decode step (batch 1), planner's best TP=8 plan": (std.predicted.latency_s, lad.predicted.latency_s),
        "decode step (batch 1), Megatron TP=8 split (every projection sharded)": (meg_std, meg_lad),
        "prefill (batch 64 x 128 tokens), planner's best TP=8 plan": (
            pre_std.predicted.latency_s,
            pre_lad.predicted.latency_s,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1600, help="pre-training steps (batch 8 x 128 tokens)")
    parser.add_argument("--adapt-fraction", type=float, default=0.2, help="adapt steps / pre-training steps")
    parser.add_argument(
        "--eval-batches",
        type=int,
        default=128,
        help="held-out batches of 8 blocks evaluated (the first ones)",
    )
    parser.add_argument("--part", choices=["all", "standard", "scratch"], default="all")
    args = parser.parse_args()
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    model_file = load_model_file(MODEL)
    seq_len, n_layers = model_file.module.SEQ_LEN, model_file.module.CONFIG.n_layers
    ladder = upper_layers(n_layers, n_layers // 2)
    train_ids, held_ids = tokenized_corpus(model_file)
    train_blocks, held_blocks = TokenBlocks(train_ids, seq_len), TokenBlocks(held_ids, seq_len)
    console.print(
        f"corpus: stdlib, {train_blocks.num_tokens / 1e6:.2f} M train tokens, {held_blocks.num_tokens / 1e6:.2f} M "
        f"held-out tokens, blocks of {seq_len}; {sum(p.numel() for p in fresh_model(model_file).parameters()) / 1e6:.2f} M parameters"
    )
    standard_ckpt = Path(model_file.module.WEIGHTS)
    scratch_ckpt = OUT / f"ladder_scratch-{args.steps}.safetensors"
    adapt_steps = max(1, round(args.adapt_fraction * args.steps))
    adapted_ckpt = OUT / f"adapted-{args.steps}-{adapt_steps}.safetensors"
    if args.part in ("all", "standard") and not standard_ckpt.exists():
        pretrain(model_file, train_blocks, held_blocks, [], args.steps, standard_ckpt)
    if args.part in ("all", "scratch") and not scratch_ckpt.exists():
        pretrain(model_file, train_blocks, held_blocks, ladder, args.steps, scratch_ckpt)
    if args.part != "all":
        return
    continued_ckpt = OUT / f"standard_continued-{args.steps}-{adapt_steps}.safetensors"
    for layers, out in ((ladder, adapted_ckpt), ([], continued_ckpt)):
        if not out.exists():
            fine_tune(standard_ckpt, train_ids, seq_len, layers, adapt_steps, out)

    rows = []
    cache_path = OUT / f"eval-{args.eval_batches}.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    for name, ckpt, layers in (
        ("standard", standard_ckpt, []),
        (f"ladder upper {len(ladder)}/{n_layers}, zero-shot", standard_ckpt, ladder),
        (f"adapted ({adapt_steps} steps = {args.adapt_fraction:.0%} of pre-training)", adapted_ckpt, ladder),
        (f"standard, trained {adapt_steps} more steps the same way (no ladder)", continued_ckpt, []),
        ("ladder from scratch", scratch_ckpt, ladder),
    ):
        key = f"{ckpt.name}:{ckpt.stat().st_mtime_ns}:{layers}"
        if key not in cache:
            gm = lm_graph(fresh_model(model_file, ckpt), BATCH, seq_len, layers)
            start = time.perf_counter()
            result = evaluate(gm, held_blocks, BATCH, max_batches=args.eval_batches)
            console.print(f"evaluated {name}: {result.loss:.4f} ({time.perf_counter() - start:.0f} s)")
            cache[key] = [result.loss, result.tokens]
            cache_path.write_text(json.dumps(cache, indent=1))
        rows.append((name, EvalResult(*cache[key])))
    speedups = predicted_speedups(ladder)
    reference = rows[0][1].loss
    table = Table(
        title=f"held-out loss on stdlib ({rows[0][1].tokens / 1e6:.2f} M tokens), {args.steps} pre-training steps"
    )
    for col in ("model", "loss (nats)", "perplexity", "vs standard"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, result in rows:
        table.add_row(
            name,
            f"{result.loss:.4f}",
            f"{result.perplexity:.2f}",
            f"{relative_increase(result.loss, reference):+.2%}",
        )
    console.print(table)
    for what, (std_s, lad_s) in speedups.items():
        console.print(
            f"predicted at TP=8 on dgx-h100, {what}: standard {std_s * 1e6:.1f} µs, "
            f"ladder upper {len(ladder)}/{n_layers} {lad_s * 1e6:.1f} µs: speed-up {std_s / lad_s:.3f}x"
        )
    goals = {
        "adapted within 1% of standard": relative_increase(rows[2][1].loss, reference) <= 0.01,
        "adapted within 1% of standard trained as many more steps": relative_increase(
            rows[2][1].loss, rows[3][1].loss
        )
        <= 0.01,
        "ladder from scratch within 1% of standard": relative_increase(rows[4][1].loss, reference) <= 0.01,
    }
    for goal, held in goals.items():
        console.print(f"{goal}: {'yes' if held else 'NO'}")
    assert all(math.isfinite(r.loss) for _, r in rows)


if __name__ == "__main__":
    main()

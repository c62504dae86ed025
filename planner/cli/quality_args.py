"""Options of the ladder quality subcommands (`ladder-eval`, `adapt`): argparse only, so that
`planner --help` stays fast; the work is in `planner.cli.quality`."""

from __future__ import annotations

import argparse

DEFAULT_BATCH = 16


def add_data_options(p: argparse.ArgumentParser, eval_batches: int | None) -> None:
    """--data, --tokenizer, --weights, --seq-len, --batch-size, --eval-batches."""
    p.add_argument(
        "--data",
        help="text: a file, a folder of .py/.txt/.rst/.md files, or 'stdlib' (needed by ladder-eval, adapt and "
        "--ladder auto:max-loss-increase)",
    )
    p.add_argument(
        "--tokenizer", help="tokenizers JSON file (default: the model file's TOKENIZER, else trained)"
    )
    p.add_argument(
        "--seq-len", type=int, help="tokens per block (default: the model file's SEQ_LEN, else 128)"
    )
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH, help="blocks per batch (default 16)")
    p.add_argument(
        "--eval-batches",
        type=int,
        default=eval_batches,
        help="held-out batches evaluated, the first ones (default: "
        + ("all of them" if eval_batches is None else "%(default)s")
        + ")",
    )


def add_ladder_eval_parser(sub) -> None:
    """The `ladder-eval` subcommand's options."""
    p = sub.add_parser(
        "ladder-eval", help="held-out loss of the standard and the laddered model on real text"
    )
    p.add_argument("model", help="model file (build_model() -> LM taking token ids, returning logits)")
    _ladder_choice(p)
    add_data_options(p, None)
    p.add_argument(
        "--weights", help="safetensors file or folder with the model's weights (default: seeded init)"
    )
    p.add_argument("--sensitivity", action="store_true", help="also ladder one layer at a time")
    p.add_argument("--json", help="write the results as JSON")


def add_adapt_parser(sub) -> None:
    """The `adapt` subcommand's options."""
    p = sub.add_parser("adapt", help="fine-tune the laddered model and save its weights (safetensors)")
    p.add_argument("model")
    _ladder_choice(p)
    add_data_options(p, 32)
    p.add_argument(
        "--weights", help="safetensors weights to start from (default: seeded init: ladder from scratch)"
    )
    p.add_argument("--steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW; default 1e-3)")
    p.add_argument("--warmup", type=int, help="warm-up steps (default 5%% of --steps)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--only-laddered", action="store_true", help="train only the laddered layers' parameters")
    p.add_argument("--nproc", type=int, default=1, help="data-parallel ranks (gloo, torch.distributed)")
    p.add_argument("--plot", help="folder to write the loss curve PNG into")
    p.add_argument("--out", required=True, help="the adapted weights, a .safetensors file")


def _ladder_choice(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--ladder", help="upper:N (default: the upper half of the layers)")
    g.add_argument("--layers", help="laddered layers, contiguous, 0-based: 'A-B', or 'A,B,C' listing a run")

"""Ladder residual's cost in model quality, on the command line: `ladder-eval`, `adapt`, and the
measured loss budget of `optimize --ladder auto:max-loss-increase=X%`.

    planner ladder-eval MODEL.py --data PATH [--ladder upper:N | --layers A-B] [--weights CKPT] [--sensitivity]
    planner adapt MODEL.py --ladder upper:N --data PATH --steps K --out CKPT.safetensors [--only-laddered] [--nproc N] [--plot DIR]

The model file builds a language model whose forward takes token ids (B, T) and returns logits
(B, T, vocab). Text: `--data` (a text file, a folder of them, or "stdlib"), split by file
(`runtime.lm_data`). Tokenizer: `--tokenizer JSON`, else the model file's `TOKENIZER` path, else a
byte-level BPE of the model's vocabulary trained on the training split. Everything is evaluated
and trained through the planner's captured graph and ladder pass (`runtime.lm_train`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from passes.checkpoint import checkpoint_files, save_checkpoint
from planner.cli.quality_args import DEFAULT_BATCH
from planner.errors import InputError, PlannerError
from planner.files import (
    WEIGHTS_KIND,
    check_output_path,
    new_output_folder,
    publish_folder,
    write_text_atomic,
)
from planner.frontend.analysis import ModelStructure
from planner.frontend.modelfile import ModelFile, load_model_file
from planner.plan import Plan, layer_ranges
from planner.solver.problem import LadderBudget, LadderMode, LadderPolicy
from runtime.lm_data import LmCorpus, corpus_files, load_corpus
from runtime.lm_train import (
    AdaptJob,
    EvalResult,
    TrainConfig,
    evaluate,
    laddered_copy,
    lm_graph,
    lm_structure,
    relative_increase,
    run_adapt,
    upper_layers,
)
from runtime.reference import build_unsharded

DEFAULT_SEQ_LEN = 128
SEED = 0


# ------------------------------------------------------------------------------------------ options


def ladder_layers(args: argparse.Namespace, num_layers: int) -> list[int]:
    """The layers `--ladder upper:N` / `--layers` name (default: the upper half). Raises InputError for
    another --ladder mode, a layer out of range or a non-contiguous set (the pass ladders one run)."""
    if getattr(args, "layers", None):
        text = args.layers.strip()
        m = re.fullmatch(r"(\d+)-(\d+)", text)
        try:
            layers = (
                list(range(int(m.group(1)), int(m.group(2)) + 1)) if m else [int(x) for x in text.split(",")]
            )
        except ValueError:
            raise InputError(f"--layers must be 'A-B' or 'A,B,C' (layer numbers), got {text!r}") from None
        layers = sorted(set(layers))
        if m and int(m.group(1)) > int(m.group(2)):
            raise InputError(
                f"--layers {text}: the range is reversed; write it low-high, e.g. --layers {m.group(2)}-{m.group(1)}"
            )
        bad = [i for i in layers if not 0 <= i < num_layers]
        if not layers or bad:
            raise InputError(f"--layers {text}: the model has layers 0-{num_layers - 1}")
        if layers != list(range(layers[0], layers[-1] + 1)):
            raise InputError(f"--layers {text}: laddered layers must be contiguous (one run of layers)")
        return layers
    if getattr(args, "ladder", None):
        policy = LadderPolicy.parse(args.ladder, option="--ladder")
        if policy.mode is not LadderMode.UPPER:
            raise InputError(f"--ladder here takes upper:N (or use --layers), got {args.ladder!r}")
        return policy.for_layers(num_layers).eligible(num_layers)
    return upper_layers(num_layers, num_layers // 2)


# -------------------------------------------------------------------------------------------- setup


@dataclass
class LmSetup:
    """A language model file with its weights, the corpus, and the standard graph at the eval shape."""

    model_file: ModelFile
    model: torch.nn.Module
    weights: list[str] | None
    corpus: LmCorpus
    batch_size: int
    seq_len: int
    standard: torch.fx.GraphModule  # captured at (batch_size, seq_len)
    structure: ModelStructure  # of `standard`
    eval_batches: int | None
    _measured: dict[tuple[int, ...], EvalResult] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.structure.layers)

    def measure(self, layers: list[int], progress: Callable[[int, int], None] | None = None) -> EvalResult:
        """Held-out result with `layers` laddered ([] = standard), cached by set."""
        key = tuple(sorted(layers))
        if key not in self._measured:
            gm = laddered_copy(self.standard, self.structure, list(key)) if key else self.standard
            self._measured[key] = evaluate(
                gm, self.corpus.held_out, self.batch_size, progress, self.eval_batches
            )
        return self._measured[key]

    def increase(self, layers: list[int]) -> float:
        """Relative held-out loss increase of laddering `layers`, against the standard model."""
        return relative_increase(self.measure(layers).loss, self.measure([]).loss)


def _check_sizes(args: argparse.Namespace) -> None:
    for name in ("seq_len", "batch_size", "eval_batches", "steps", "nproc"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise InputError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")


def load_setup(args: argparse.Namespace, batch_size: int | None = None) -> LmSetup:
    """Model file, weights, tokenizer and corpus of a quality command. Raises InputError (exit 2) for
    a missing --data, a bad data path, an empty or too-small corpus, a tokenizer larger than the
    model's vocabulary, or weights that do not fit."""
    _check_sizes(args)
    if not args.data:
        raise InputError("--data PATH is needed: held-out text (a file, a folder of text files, or 'stdlib')")
    corpus_files(args.data)  # a bad path fails before the model is built
    model_file = load_model_file(args.model)
    if model_file.has_cache:
        raise InputError(
            f"{args.model} has a KV cache (it defines step_inputs): its forward writes the cache at input_pos, "
            f"while {args.command} runs whole (batch, sequence) blocks of token ids through a plain forward; "
            "evaluate the same weights through a model file without the cache (e.g. examples/llama3.py for "
            "examples/llama3_kv.py)"
        )
    weights = checkpoint_files(args.weights) if args.weights else None
    model = build_unsharded(model_file, SEED, weights)
    first = next((x for x in model_file.inputs()[0] if isinstance(x, torch.Tensor)), None)
    if first is None or first.is_floating_point():
        what = "no tensor input" if first is None else f"{first.dtype} inputs of shape {tuple(first.shape)}"
        raise InputError(
            f"{args.model} takes {what}, not token ids: {args.command} measures a language model's loss on "
            "text, so the model must read (batch, sequence) token ids and return logits over its vocabulary"
        )
    seq_len = args.seq_len or getattr(model_file.module, "SEQ_LEN", DEFAULT_SEQ_LEN)
    batch = batch_size or args.batch_size
    standard = lm_graph(model, batch, seq_len)
    structure = lm_structure(standard)
    vocab = structure.vocab_size
    tokenizer = args.tokenizer or getattr(model_file.module, "TOKENIZER", None)
    if tokenizer is not None and not Path(tokenizer).exists():
        if args.tokenizer:
            raise InputError(f"--tokenizer {tokenizer}: no such file")
        tokenizer = None  # the model file names one that was not made yet: train one
    corpus = load_corpus(args.data, seq_len, tokenizer, vocab_size=vocab, min_blocks=batch)
    tokens = corpus.tokenizer.get_vocab_size()
    if tokens > vocab:
        which = (
            f"the tokenizer {tokenizer}"
            if tokenizer
            else "the tokenizer trained on --data (byte-level: 256 bytes and an end-of-text token at least)"
        )
        raise InputError(
            f"{which} has {tokens} tokens, more than the model's vocabulary of {vocab}: ids from {vocab} on "
            f"would index past its embedding; give the model a vocabulary of at least {tokens}, or pass "
            f"--tokenizer with one of at most {vocab} tokens"
        )
    return LmSetup(model_file, model, weights, corpus, batch, seq_len, standard, structure, args.eval_batches)


def _progress(console: Console) -> Progress:
    """A bar with count, elapsed and remaining time; silent when the console is not a terminal."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


@contextmanager
def _bar(progress: Progress, description: str) -> Iterator[Callable[[int, int], None]]:
    task = progress.add_task(description, total=None)

    def update(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    try:
        yield update
    finally:
        progress.remove_task(task)


def _layers_label(layers: list[int]) -> str:
    """Laddered layers as ranges ("1-2, 4-7"), "none" for none."""
    return layer_ranges(layers) if layers else "none"


# -------------------------------------------------------------------------------------- ladder-eval


def cmd_ladder_eval(args: argparse.Namespace, console: Console, err_console: Console) -> int:
    """`planner ladder-eval`: held-out loss and perplexity, standard vs laddered (and per layer)."""
    if args.json:
        check_output_path("--json", args.json, kind="report")
    with _progress(err_console) as progress:
        with _bar(progress, "loading the model and tokenizing the data"):
            setup = load_setup(args)
        layers = ladder_layers(args, setup.num_layers)
        with _bar(progress, "held-out loss, standard") as bar:
            std = setup.measure([], bar)
        with _bar(progress, f"held-out loss, ladder on layers {_layers_label(layers)}") as bar:
            lad = setup.measure(layers, bar)
        sens: dict[int, EvalResult] = {}
        if args.sensitivity:
            for i in range(setup.num_layers):
                with _bar(progress, f"sensitivity: ladder on layer {i} alone") as bar:
                    sens[i] = setup.measure([i], bar)
    _print_corpus(console, setup)
    table = Table(title=f"held-out loss ({std.tokens:,} tokens)")
    for col in ("model", "laddered layers", "loss (nats/token)", "perplexity", "loss vs standard"):
        table.add_column(col, justify="left" if col == "model" else "right")
    table.add_row("standard", "none", f"{std.loss:.4f}", f"{std.perplexity:.2f}", "")
    table.add_row(
        "ladder",
        _layers_label(layers),
        f"{lad.loss:.4f}",
        f"{lad.perplexity:.2f}",
        f"{relative_increase(lad.loss, std.loss):+.2%}",
    )
    console.print(table)
    if sens:
        t = Table(title="sensitivity: one layer laddered at a time")
        for col in ("layer", "loss", "perplexity", "loss vs standard"):
            t.add_column(col, justify="right")
        for i, r in sens.items():
            t.add_row(
                str(i), f"{r.loss:.4f}", f"{r.perplexity:.2f}", f"{relative_increase(r.loss, std.loss):+.2%}"
            )
        console.print(t)
    if not setup.weights:
        console.print("[yellow]note: no --weights: the model has its seeded random initialisation[/yellow]")
    if args.json:
        report = {
            "written_by": "planner ladder-eval --json",  # first: `planner.files.written_kind` reads it
            "data": setup.corpus.source,
            "tokens": std.tokens,
            "standard": {"loss": std.loss, "perplexity": std.perplexity},
            "ladder": {
                "layers": layers,
                "loss": lad.loss,
                "perplexity": lad.perplexity,
                "loss_increase": relative_increase(lad.loss, std.loss),
            },  # fmt: skip
            "sensitivity": {str(i): relative_increase(r.loss, std.loss) for i, r in sens.items()},
        }
        write_text_atomic(args.json, json.dumps(report, indent=2), option="--json")
    return 0


def _print_corpus(console: Console, setup: LmSetup) -> None:
    console.print(
        f"{setup.corpus.describe()}; tokenizer of {setup.corpus.tokenizer.get_vocab_size()} tokens; "
        f"{setup.num_layers} layers"
    )


# -------------------------------------------------------------------------------------------- adapt


def cmd_adapt(args: argparse.Namespace, console: Console, err_console: Console) -> int:
    """`planner adapt`: fine-tune the laddered model, print (and plot) the loss curve, save safetensors."""
    check_output_path("--out", args.out, kind=WEIGHTS_KIND)
    if not args.out.endswith(".safetensors"):
        raise InputError(
            f"--out {args.out}: the adapted weights are written as safetensors: name it *.safetensors"
        )
    if args.plot:
        if Path(args.plot).resolve() == Path(args.out).resolve():
            raise InputError(
                f"--out and --plot both name {args.out}: the weights go to a file, the plot to a folder; "
                "give them different paths"
            )
        # an existing folder only if the planner wrote it: a user's files in it are never replaced
        check_output_path("--plot", args.plot, folder=True)
    _check_sizes(args)
    if args.batch_size % args.nproc:
        raise InputError(f"--batch-size {args.batch_size} must divide by --nproc {args.nproc}")
    config = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        seed=SEED,
    )
    with _progress(err_console) as progress:
        with _bar(progress, "loading the model and tokenizing the data"):
            setup = load_setup(args)
        layers = ladder_layers(args, setup.num_layers)
        with _bar(progress, "held-out loss before: standard") as bar:
            std = setup.measure([], bar)
        with _bar(progress, f"held-out loss before: ladder on layers {_layers_label(layers)}") as bar:
            before = setup.measure(layers, bar)
        job = AdaptJob(
            os.path.abspath(args.model),
            setup.weights,
            setup.corpus.train.ids,
            setup.seq_len,
            layers,
            config,
            only_laddered=args.only_laddered,
            seed=SEED,
        )
        task = progress.add_task(
            f"adapting on {args.nproc} rank(s)" if args.nproc > 1 else "adapting", total=args.steps
        )

        def on_step(step: int, loss: float, lr: float) -> None:
            progress.update(task, completed=step + 1, description=f"adapting: loss {loss:.4f}")

        result = run_adapt(job, args.nproc, on_step)
        progress.remove_task(task)
        save_checkpoint(result.state, args.out, metadata={"written_by": "planner adapt --out"})
        adapted_model = build_unsharded(setup.model_file, SEED, [args.out])
        gm = lm_graph(adapted_model, setup.batch_size, setup.seq_len, layers)
        with _bar(progress, "held-out loss after") as bar:
            after = evaluate(gm, setup.corpus.held_out, setup.batch_size, bar, setup.eval_batches)
    _print_corpus(console, setup)
    losses = result.train.losses
    console.print(
        f"adapted ladder on layers {_layers_label(layers)} ({'laddered layers only' if args.only_laddered else 'all parameters'}): "
        f"{args.steps} steps of {args.batch_size} × {setup.seq_len} tokens on {args.nproc} rank(s), "
        f"{result.train.time_s:.1f} s"
    )
    console.print(loss_curve_table(losses, result.train.lrs))
    table = Table(title=f"held-out loss ({after.tokens:,} tokens)")
    for col in ("model", "loss (nats/token)", "perplexity", "loss vs standard"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, r in (("standard", std), ("ladder, before adapting", before), ("ladder, adapted", after)):
        table.add_row(
            name, f"{r.loss:.4f}", f"{r.perplexity:.2f}", f"{relative_increase(r.loss, std.loss):+.2%}"
        )
    console.print(table)
    if args.plot:
        path = plot_loss_curve(losses, args.plot, f"adapt: ladder on layers {_layers_label(layers)}")
        console.print(f"loss curve written to {path}")
    console.print(f"adapted weights written to {args.out} (use them with --weights {args.out})")
    return 0


def loss_curve_table(losses: list[float], lrs: list[float], rows: int = 10) -> Table:
    """The loss curve in about `rows` rows: mean training loss and learning rate per span of steps."""
    table = Table(title="training loss")
    for col in ("steps", "mean loss", "lr at start"):
        table.add_column(col, justify="right")
    span = max(1, -(-len(losses) // rows))
    for start in range(0, len(losses), span):
        chunk = losses[start : start + span]
        table.add_row(
            f"{start + 1}-{start + len(chunk)}", f"{sum(chunk) / len(chunk):.4f}", f"{lrs[start]:.2e}"
        )
    return table


def plot_loss_curve(losses: list[float], folder: str, title: str) -> str:
    """Write `folder`/adapt_loss.png (matplotlib, no display needed) as a folder of the planner's
    (`planner.files.new_output_folder` / `publish_folder`: a folder holding files it did not write
    is refused, never overwritten); returns the file's path."""
    import matplotlib  # noqa: PLC0415 - only with --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    tmp = new_output_folder(folder, "--plot")
    try:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(range(1, len(losses) + 1), losses, lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        fig.savefig(tmp / "adapt_loss.png", dpi=100, bbox_inches="tight")
        plt.close(fig)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(publish_folder(tmp, folder, "--plot") / "adapt_loss.png")


# ------------------------------------------------------------------ optimize with a loss budget


@dataclass
class BudgetRow:
    """One ladder set considered: its predicted step latency and measured loss increase."""

    layers: list[int]
    latency_s: float | None
    predicted_increase: float  # sum of the per-layer sensitivities (the ILP's linear estimate)
    measured_increase: float
    role: str  # "chosen" | "neighbour" | "rejected (measured over the budget)"


@dataclass
class BudgetReport:
    limit: float
    standard: EvalResult
    sensitivity: dict[int, float]
    rows: list[BudgetRow]
    rounds: int
    warnings: list[str] = field(default_factory=list)  # what the user should know about the measurement


# a held-out loss at or above this fraction of ln(vocabulary), what guessing every token uniformly scores,
# is an untrained model's (seeded random weights score about ln V; any trained language model far less)
UNTRAINED_LOSS_FRACTION = 0.9


def untrained_warning(loss: float, vocab: int, args: argparse.Namespace) -> list[str]:
    """A loss budget measured on an untrained model bounds nothing: every layer's increase is noise
    around 0 and the budget admits any ladder. A warning when the standard model's held-out `loss` is
    at least `UNTRAINED_LOSS_FRACTION` of ln(`vocab`) (what guessing uniformly scores), naming
    --weights; none otherwise."""
    uniform = math.log(vocab) if vocab > 1 else 0.0
    if not uniform or loss < UNTRAINED_LOSS_FRACTION * uniform:
        return []
    given = f"--weights {args.weights}" if args.weights else "no --weights given: seeded random weights"
    return [
        f"--ladder {args.ladder}: the standard model's held-out loss is {loss:.3f}, near that of guessing "
        f"uniformly over its {vocab:,}-token vocabulary (ln {vocab:,} = {uniform:.3f}): its weights are untrained "
        f"({given}), so each layer's measured loss increase is noise and the budget may admit any ladder. Give "
        "--weights CKPT with the model's trained weights"
    ]


def plan_with_loss_budget(
    args: argparse.Namespace,
    make_plan: Callable[[object], Plan],
    constraints,
    num_layers: int,
    progress: Progress,
) -> tuple[Plan, BudgetReport]:
    """`--ladder auto:max-loss-increase=X%`: measure each eligible layer's loss increase alone, let the
    ILP choose the latency-best ladder set whose summed increases stay within X (`LadderBudget`), then
    measure the chosen set together; when it is over X, exclude that set (a no-good cut) and solve
    again. `make_plan(constraints)` plans. Also prices and measures the chosen set's neighbours
    (`budget_neighbours`: one laddered layer fewer / more, same mesh). Raises InputError without --data."""
    policy = constraints.ladder
    limit = policy.max_loss_increase
    if not args.data:
        raise InputError(
            f"--ladder {args.ladder} measures the model's loss on held-out text: give --data PATH "
            "(and --weights CKPT with the trained weights)"
        )
    data_args = copy.copy(args)  # --batch-size / --seq-len of optimize describe the planned workload
    data_args.batch_size, data_args.seq_len = DEFAULT_BATCH, None
    with _bar(progress, "loss budget: loading the model and tokenizing the data"):
        setup = load_setup(data_args)
    if setup.num_layers != num_layers:
        raise InputError(f"the model has {setup.num_layers} layers when run, {num_layers} when planned")
    eligible = policy.for_layers(num_layers).eligible(num_layers)
    with _bar(progress, "loss budget: standard model") as bar:
        standard = setup.measure([], bar)
    sens = {}
    for i in eligible:
        with _bar(progress, f"loss budget: sensitivity of layer {i}") as bar:
            setup.measure([i], bar)
        sens[i] = setup.increase([i])
    budget = LadderBudget(sens, limit)
    rejected: list[BudgetRow] = []
    rounds = 0
    while True:
        rounds += 1
        plan = make_plan(dataclasses.replace(constraints, ladder_budget=budget))
        chosen = sorted(plan.ladder_layers)
        if not chosen:
            break
        with _bar(progress, f"loss budget: measuring ladder on layers {_layers_label(chosen)}") as bar:
            setup.measure(chosen, bar)
        measured = setup.increase(chosen)
        if measured <= limit:
            break
        rejected.append(
            BudgetRow(
                chosen,
                plan.predicted.latency_s,
                budget.predicted(chosen),
                measured,
                "rejected: measured over the budget",
            )
        )
        budget = budget.excluding(chosen)  # the sum underestimated this set: cut it off and solve again
    rows = rejected + [
        BudgetRow(
            chosen, plan.predicted.latency_s, budget.predicted(chosen), setup.increase(chosen), "chosen"
        )
    ]
    mesh = (plan.tp, plan.pp, plan.dp)
    for layers in budget_neighbours(chosen, eligible, sens):
        if any(sorted(r.layers) == layers for r in rows):
            continue
        with _bar(progress, f"loss budget: neighbour, ladder on layers {_layers_label(layers)}") as bar:
            setup.measure(layers, bar)
        pinned = dataclasses.replace(
            constraints,
            tp=mesh[0],
            pp=mesh[1],
            dp=mesh[2],
            ladder=LadderPolicy(LadderMode.AUTO, None) if layers else LadderPolicy(LadderMode.NONE, 0),
            # only `layers` fit this budget: the best plan with (at most) exactly them laddered
            ladder_budget=LadderBudget(
                {i: 0.0 if i in layers else 1.0 + limit for i in range(num_layers)}, limit
            )
            if layers
            else None,
        )
        try:
            latency = make_plan(pinned).predicted.latency_s
        except PlannerError:  # no plan with exactly this ladder on that mesh
            latency = None
        rows.append(BudgetRow(layers, latency, budget.predicted(layers), setup.increase(layers), "neighbour"))
    rows.sort(key=lambda r: len(r.layers))
    warnings = untrained_warning(standard.loss, setup.structure.vocab_size, args)
    return plan, BudgetReport(limit, standard, sens, rows, rounds, warnings)


def budget_neighbours(
    chosen: list[int], eligible: list[int], sensitivity: dict[int, float]
) -> list[list[int]]:
    """The chosen ladder set's neighbours: one layer fewer (without its most loss-sensitive layer) and
    one more (with the least sensitive eligible layer it lacks), each sorted; none past either end."""
    out = []
    if chosen:
        drop = max(chosen, key=lambda i: (sensitivity.get(i, 0.0), i))
        out.append(sorted(i for i in chosen if i != drop))
    rest = [i for i in eligible if i not in chosen]
    if rest:
        add = min(rest, key=lambda i: (sensitivity.get(i, 0.0), -i))
        out.append(sorted([*chosen, add]))
    return out


def render_budget(console: Console, report: BudgetReport) -> None:
    """The loss budget's table: each ladder set with its predicted latency and measured loss."""
    from planner.cli.render import fmt_s  # noqa: PLC0415 - sideways, keeps this module's imports short

    sens = ", ".join(f"{i}: {v:+.2%}" for i, v in report.sensitivity.items())
    console.print(
        f"Ladder loss budget {report.limit:.2%} of the standard held-out loss {report.standard.loss:.4f} "
        f"({report.standard.tokens:,} tokens); one layer laddered alone: {sens}"
    )
    table = Table(title=f"ladder sets considered ({report.rounds} solve(s))")
    for col in (
        "laddered layers",
        "predicted step latency",
        "sum of per-layer increases",
        "measured loss increase",
        "",
    ):
        table.add_column(col, justify="right" if col != "" else "left")
    for r in report.rows:
        within = "within" if r.measured_increase <= report.limit else "over"
        table.add_row(
            _layers_label(r.layers),
            fmt_s(r.latency_s),
            f"{r.predicted_increase:+.2%}",
            f"{r.measured_increase:+.2%} ({within})",
            r.role,
        )
    console.print(table)


def budget_dict(report: BudgetReport) -> dict:
    """The loss budget for the JSON report."""
    return {
        "max_loss_increase": report.limit,
        "standard_loss": report.standard.loss,
        "tokens": report.standard.tokens,
        "sensitivity": {str(i): v for i, v in report.sensitivity.items()},
        "sets": [dataclasses.asdict(r) for r in report.rows],
        "solves": report.rounds,
        "warnings": list(report.warnings),
    }

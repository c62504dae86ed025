"""`planner`: the command line.

    planner optimize MODEL.py [--cluster SPEC.yaml|PRESET] [--workload forward|decode|train] ...
    planner show PLAN.yaml
    planner run PLAN.yaml --model MODEL.py [--nproc N]
    planner calibrate --out SPEC.yaml [--nproc N]
    planner ladder-eval MODEL.py --data PATH [--ladder upper:N | --layers A-B] [--weights CKPT] [--sensitivity]
    planner adapt MODEL.py [--ladder upper:N | --layers A-B] --data PATH --steps K --out CKPT.safetensors
    planner export PLAN.yaml --to dtensor|torchtitan|megatron|vllm [--out FILE] [--model ID]
                   [--torchtitan-version 0.3|0.2]
    planner compare REPORT.json [REPORT.json ...]

Exit codes: 0 success; 2 bad input (file, YAML, options); 3 no feasible plan; 4 run failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.text import Text

from costmodels.expert_parallel import DEFAULT_MOE_IMBALANCE
from planner.cli.progress import Bars
from planner.errors import InputError, PlannerError, RunError
from planner.files import check_output_path, edited_since_written, with_digest, write_text_atomic
from planner.plan import (
    CP_COMM_TYPES,
    DP_STYLES,
    EP_FOLDS,
    FP32_MAX,
    GRAD_REDUCE_DTYPES,
    cp_unbalanced_note,
    is_static_loss_scale,
)

_WIDTH = None if sys.stdout.isatty() else 150  # rich assumes 80 columns when piped; tables need more


class _PipeConsole(Console):
    """rich's Console, but a closed stdout raises BrokenPipeError to `main` (rich exits with 1 itself)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError("stdout closed by its reader")


console = _PipeConsole(width=_WIDTH)
err_console = Console(stderr=True, width=_WIDTH)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: exit code 2 with our format, one line
        raise InputError(f"{message} (see `{self.prog} --help`)")


def _at_least(minimum: int, what: str):
    """An argparse type: an integer >= ``minimum``, named ``what`` in its error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive = _at_least(1, "a positive integer")
_non_negative = _at_least(0, "an integer >= 0")


def _cluster_name(text: str) -> str:
    """A --cluster value: a preset name or a YAML path, not empty (an empty one fell back to
    calibrating this machine, silently) (argparse type)."""
    if not text.strip():
        from costmodels.cluster import preset_names  # noqa: PLC0415

        raise argparse.ArgumentTypeError(
            f"empty; give a preset name ({', '.join(preset_names())}) or a cluster YAML path, or leave "
            "--cluster out to plan for this machine"
        )
    return text


def _positive_seconds(text: str) -> float:
    """A number of seconds > 0 (argparse type)."""
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


# run options' defaults (`_run_options`; `_unused_options` names those changed without --run)
DEFAULT_ITERS, DEFAULT_MIN_TIME_S, DEFAULT_WARMUP, DEFAULT_TIMEOUT_S = 10, 2.0, 3, 120.0
MIN_TIMEOUT_S = 10.0  # starting the ranks and their process group alone takes seconds (gloo, this VM: 2-6 s)


def _timeout_seconds(text: str) -> float:
    """--timeout (argparse type): seconds, at least MIN_TIMEOUT_S."""
    value = _positive_seconds(text)
    if value < MIN_TIMEOUT_S:
        raise argparse.ArgumentTypeError(
            f"expected at least {MIN_TIMEOUT_S:g} seconds (the ranks and their process group take seconds to "
            f"start), got {text!r}"
        )
    return value


def _seconds(text: str) -> float:
    """A number of seconds >= 0 (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


_PLOT_HELP = (
    "write PNG figures into this folder: pipeline schedule, per-layer time, memory per rank, ladder gains"
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of all subcommands."""
    parser = _Parser(prog="planner", description="Plan, rewrite and run tensor/pipeline/ladder parallelism.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    opt = sub.add_parser("optimize", help="plan a model for a cluster (and optionally run it)")
    opt.add_argument("model", help="model file defining build_model() and example_inputs()")
    opt.add_argument(
        "--cluster",
        type=_cluster_name,
        help="preset name (dgx-h100, local-cpu, ...) or YAML file; default: this machine",
    )
    opt.add_argument(
        "--workload",
        default="forward",
        choices=["forward", "decode", "train", "generate"],
        help="what one step is: a forward pass, a decode step, a training step, or a served request "
        "(default forward)",
    )
    opt.add_argument(
        "--batch-size", type=_positive, help="sequences per step (default: the model file's example_inputs())"
    )
    opt.add_argument(
        "--seq-len", type=_positive, help="tokens per sequence (default: the model file's example_inputs())"
    )
    opt.add_argument(
        "--context",
        type=_positive,
        help="decode of a model with a KV cache: tokens already cached when the step runs (default 2048); "
        "the caches hold context + --new-tokens positions",
    )
    opt.add_argument(
        "--new-tokens",
        type=int,  # checked by `check_new_tokens` (at least 2, saying why)
        help="decode / generate of a model with a KV cache: tokens generated per sequence, at least 2 (default 16)",
    )
    opt.add_argument(
        "--micro-batches",
        type=_positive,
        help="micro-batches per step and data-parallel replica (default: searched)",
    )
    opt.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        help="planned and run dtype (default: the model's parameters')",
    )
    opt.add_argument(
        "--ladder",
        default="none",
        help="none | upper:N | auto | auto:max=N | auto:max-loss-increase=X%% (needs --data, and --weights)",
    )
    opt.add_argument(
        "--schedule",
        default="auto",
        choices=["auto", "1f1b", "gpipe", "interleaved_1f1b"],  # planner.plan.Schedule's values (and auto)
        help="pipeline schedule the plan is priced with and run with (pp > 1); auto: 1f1b or, training, "
        "interleaved_1f1b with the search's v, whichever is faster",
    )
    opt.add_argument(
        "--virtual-stages",
        type=_positive,
        help="interleaved_1f1b: pin the model chunks per pipeline rank (v)",
    )
    opt.add_argument(
        "--recompute",
        default="auto",
        choices=["auto", "none", "selective", "full"],
        help="training: activation recomputation of every layer class (auto: the ILP chooses per class)",
    )
    for flag, what in (
        ("--sequence-parallel", "training: split the norm/dropout regions along the sequence over TP"),
        ("--distributed-optimizer", "training: shard Adam's state over the DP ranks (on: ZeRO-1, off: DDP)"),
        (
            "--reshard-after-forward",
            "training, fsdp: free each layer's gathered parameters after its forward",
        ),
        (
            "--tp-comm-overlap",
            "TP > 1: cut each block's TP collectives into chunks that overlap the GEMMs beside them",
        ),
        (
            "--overlap-grad-reduce",
            "training, DP > 1: reduce gradients per layer bucket during the backward",
        ),
        (
            "--overlap-param-gather",
            "training, zero1/zero2: wait for each layer's parameter all-gather at its first use",
        ),
    ):
        opt.add_argument(
            flag, default="auto", choices=["auto", "on", "off"], help=f"{what} (auto: priced both ways)"
        )
    opt.add_argument(
        "--grad-reduce-dtype",
        default="param",
        choices=list(GRAD_REDUCE_DTYPES),
        help="training: the dtype gradients are accumulated and reduced in: param (the parameters' dtype) or "
        "fp32 (Megatron-LM's default with --bf16, torchtitan's mixed_precision_reduce float32; --run runs it "
        "so: fp32 main gradients with ddp / zero1, fp32 reduce-scatters with zero2 / fsdp)",
    )
    opt.add_argument(
        "--loss-scale",
        default="auto",
        type=_loss_scale_arg,
        metavar="{auto,dynamic,off,N}",
        help="fp16 training: multiply the loss by a scale before the backward and divide the gradients by it "
        "before the optimizer step, skipping a step whose gradients overflow: dynamic (torch.amp.GradScaler's "
        "policy: from 2^16, halved at an overflow, doubled after 2000 steps without one), N (a static scale, "
        "Megatron-LM's --loss-scale) or off; auto: dynamic for fp16 training, none otherwise",
    )
    opt.add_argument(
        "--dp-style",
        default="auto",
        choices=["auto", *DP_STYLES],
        help="training: how the data-parallel ranks hold the state: ddp (replicas), zero1 (Adam state sharded, "
        "Megatron's distributed optimizer), zero2 (and gradients), fsdp (and parameters, gathered per layer; "
        "HSDP with --dp-shard); auto: each priced, the fastest that fits",
    )
    opt.add_argument(
        "--dp-shard",
        type=_positive,
        help="training: FSDP shard degree; with --dp N the mesh has N x this many data-parallel ranks (HSDP: "
        "sharded over --dp-shard, replicated over --dp)",
    )
    opt.add_argument(
        "--layout",
        default="auto",
        choices=["auto", "megatron"],
        help="split choices: auto, the solver's; megatron, the hand-written Megatron-LM layout (column-parallel "
        "q/k/v/up/gate, row-parallel o/down, vocab-parallel embedding and LM head) at the chosen or pinned "
        "degrees, priced, lowered and run like any plan",
    )
    opt.add_argument("--tp", type=_positive, help="pin the tensor-parallel degree")
    opt.add_argument(
        "--cp",
        type=_positive,
        help="train / forward: pin the context-parallel degree (each sequence's tokens split over this many ranks)",
    )
    opt.add_argument(
        "--cp-comm-type",
        default="auto",
        choices=["auto", *CP_COMM_TYPES],
        help="context parallelism's attention: ring (K/V passed peer to peer under each block's attention), "
        "allgather (K/V gathered per layer, Llama 3's), alltoall (Ulysses: heads must divide by cp); auto: "
        "each priced, the fastest that fits",
    )
    opt.add_argument(
        "--cp-load-balance",
        default="auto",
        choices=["auto", "on", "off"],
        help="context parallelism: each rank holds one early and one late chunk of a causal sequence, so "
        "ranks do equal attention work (the sequence must divide into 2 x cp chunks); auto: priced both ways",
    )
    opt.add_argument(
        "--ep",
        type=_positive,
        help="mixture-of-experts models: pin the expert-parallel degree (each layer's experts split over this "
        "many ranks, tokens sent to them and back by all-to-all; 1: off)",
    )
    opt.add_argument(
        "--ep-fold",
        default="auto",
        choices=["auto", *EP_FOLDS],
        help="the ranks expert parallelism folds over: dp (the dp x cp ranks, as Megatron-Core and torchtitan), "
        "tp (the TP ranks, ep = tp, as vLLM's --enable-expert-parallel); auto: each priced",
    )
    opt.add_argument(
        "--expert-tp",
        type=_positive,
        help="mixture-of-experts models with expert parallelism over dp: 1 keeps each routed expert whole on "
        "every TP rank (replicated work), the TP degree splits every expert over the TP ranks as a Megatron MLP "
        "(Megatron-Core's --expert-tensor-parallel-size); default: each priced",
    )
    opt.add_argument(
        "--moe-imbalance",
        type=float,
        default=DEFAULT_MOE_IMBALANCE,
        help="mixture-of-experts models: the busiest expert-parallel rank's routed rows over the mean "
        f"(default {DEFAULT_MOE_IMBALANCE}: balanced routing; a run reports the measured loads)",
    )
    opt.add_argument(
        "--moe-capacity-factor",
        type=float,
        help="mixture-of-experts models that drop tokens: an expert's capacity over the mean rows per expert "
        "(GShard / Switch); caps the busiest rank's load (default: dropless)",
    )
    opt.add_argument("--pp", type=_positive, help="pin the pipeline-parallel degree")
    opt.add_argument(
        "--dp",
        type=_positive,
        help="pin the data-parallel degree (with --dp-shard S: the replicas of each group of S shards, dp x S ranks)",
    )
    opt.add_argument("--devices", type=_positive, help="use at most this many of the cluster's devices")
    opt.add_argument(
        "--recalibrate",
        action="store_true",
        help="without --cluster: measure this machine again instead of using the cached spec",
    )
    opt.add_argument("--out", help="write the plan as YAML")
    opt.add_argument("--emit", help="write the generated sharded module of every rank into this folder")
    opt.add_argument("--json", help="write the JSON report to this file (-: to stdout, the text to stderr)")
    opt.add_argument("--why", action="store_true", help="show every decision beside its alternatives")
    opt.add_argument("--plot", metavar="DIR", help=_PLOT_HELP)
    _run_options(opt)
    opt.add_argument("--run", action="store_true", help="execute the plan on local ranks and measure it")
    opt.add_argument(
        "--data", help="--ladder auto:max-loss-increase: held-out text (file, folder or 'stdlib')"
    )
    opt.add_argument(
        "--tokenizer", help="--ladder auto:max-loss-increase: tokenizers JSON (default: the model file's)"
    )
    opt.add_argument(
        "--eval-batches",
        type=_positive,
        default=32,
        help="--ladder auto:max-loss-increase: held-out batches per measurement (default 32)",
    )
    opt.add_argument(
        "--scale-to-local", action="store_true", help="with --run: re-plan for this machine if needed"
    )

    show = sub.add_parser("show", help="print a saved plan")
    show.add_argument("plan")
    show.add_argument("--why", action="store_true", help="show every decision beside its alternatives")
    show.add_argument("--plot", metavar="DIR", help=_PLOT_HELP)

    run = sub.add_parser("run", help="execute a saved plan on local ranks and measure it")
    run.add_argument("plan")
    run.add_argument(
        "--model",
        help="the model file the plan was made for (default: the plan's field 'model', where it exists)",
    )
    run.add_argument("--json", help="write the JSON report to this file (-: to stdout, the text to stderr)")
    _run_options(run)

    cal = sub.add_parser("calibrate", help="measure this machine and write a cluster spec")
    cal.add_argument("--out", required=True, help="write the cluster spec YAML here (atomically)")
    cal.add_argument(
        "--nproc",
        type=_positive,
        default=os.cpu_count() or 1,
        help="processes measured at once, as many as the ranks it will price (default: the core count); "
        "under torchrun across nodes, the torchrun world instead",
    )
    cal.add_argument(
        "--model",
        help="on CUDA, also time this model file's own GEMM shapes (its forward at the example inputs; "
        "fitted into device.gemm with the standard sweep); ignored on CPU",
    )

    from planner.cli.quality_args import add_adapt_parser, add_ladder_eval_parser  # noqa: PLC0415

    add_ladder_eval_parser(sub)
    add_adapt_parser(sub)

    exp = sub.add_parser(
        "export", help="write a plan as the input of Megatron-LM, torchtitan, vLLM or DTensor"
    )
    exp.add_argument("plan")
    exp.add_argument(
        "--to",
        required=True,
        choices=["dtensor", "torchtitan", "megatron", "vllm"],  # planner.export.FORMATS
        help="dtensor: parallelize_module plan (.py); torchtitan: command-line overrides (bash; "
        "--torchtitan-version 0.2: job TOML sections); megatron: command-line arguments (bash); vllm: "
        "engine arguments and vllm serve line (.py)",
    )
    exp.add_argument("--out", help="write here (atomically) instead of printing")
    exp.add_argument("--model", help="vllm: the Hugging Face id or checkpoint folder to serve")
    exp.add_argument(
        "--torchtitan-version",
        choices=["0.3", "0.2"],  # planner.export.TORCHTITAN_VERSIONS
        default="0.3",
        help="torchtitan: the release to write for: 0.3 (default; overrides of a config_registry "
        "function) or 0.2 (TOML job file sections)",
    )

    cmp_ = sub.add_parser("compare", help="print the JSON reports of several plans side by side")
    cmp_.add_argument("reports", nargs="+", metavar="REPORT.json")
    return parser


def _run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nproc", type=_positive, help="local ranks (default: the plan's device count / core count)"
    )
    p.add_argument(
        "--iters",
        type=_positive,
        default=DEFAULT_ITERS,
        help=f"timed iterations, at least (default {DEFAULT_ITERS})",
    )
    p.add_argument(
        "--min-time",
        type=_seconds,
        default=DEFAULT_MIN_TIME_S,
        metavar="SECONDS",
        help="time at least this many seconds of iterations, more than --iters when a step is short, so that "
        "the median spans a shared machine's slow spells (default 2; 0: exactly --iters)",
    )
    p.add_argument(
        "--warmup",
        type=_non_negative,
        default=DEFAULT_WARMUP,
        help=f"warm-up iterations (default {DEFAULT_WARMUP})",
    )
    p.add_argument(
        "--timeout",
        type=_timeout_seconds,
        default=DEFAULT_TIMEOUT_S,
        help=f"process-group timeout per rank, seconds (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--weights",
        help="safetensors file or directory of them with the model's weights (state_dict names); "
        "each rank loads only its shards. Default: seeded random init (a meta-built model needs this)",
    )


def _bars(args: argparse.Namespace) -> Bars:
    """Progress bars on stderr: only on a terminal, and not with --json - (the report on stdout)."""
    return Bars(err_console, enabled=err_console.is_terminal and not _json_to_stdout(args))


def _json_to_stdout(args: argparse.Namespace) -> bool:
    return getattr(args, "json", None) == "-"


_report_stream: TextIO | None = None  # with --json -: where the report goes (stdout as it was)


@contextmanager
def _report_on_stdout(args: argparse.Namespace):
    """With --json -, stdout carries the JSON report alone: the console's text goes to stderr, and so
    does whatever else writes to stdout meanwhile (a model file's print at import, the ranks a run
    starts): Python's sys.stdout points at stderr, and where stdout is file descriptor 1, so does that
    descriptor (children inherit it); the report is written to the stdout that was (`_write_report`)."""
    global _report_stream
    if not _json_to_stdout(args):
        yield
        return
    stdout = sys.stdout
    try:
        fd = stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a StringIO (tests), a closed stream
        fd = None
    saved = None
    if fd == 1:
        stdout.flush()
        saved = os.dup(1)
        os.dup2(2, 1)
        _report_stream = open(saved, "w", encoding="utf-8", closefd=False)  # noqa: SIM115 - closed below
    else:
        _report_stream = stdout
    console.file = sys.stderr
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = stdout
        console.file = None  # rich's default again: sys.stdout at the time of each print
        if saved is not None:
            try:
                _report_stream.close()
            except OSError:  # its reader left; `main` has said so
                pass
            os.dup2(saved, 1)
            os.close(saved)
        _report_stream = None


def _unused_options(args: argparse.Namespace, plan) -> list[str]:
    """ "had no effect" lines for options the plan gave nothing to act on: run options without --run,
    expert-parallel ones on a model without experts, context-parallel ones on a plan without CP."""
    out = []
    run_only = [
        f"{flag} {value}"
        for flag, value, default in (
            ("--iters", args.iters, DEFAULT_ITERS),
            ("--min-time", args.min_time, DEFAULT_MIN_TIME_S),
            ("--warmup", args.warmup, DEFAULT_WARMUP),
            ("--timeout", args.timeout, DEFAULT_TIMEOUT_S),
        )
        if value != default
    ] + (["--scale-to-local"] if args.scale_to_local else [])
    if run_only and not args.run:
        out.append(f"{', '.join(run_only)} had no effect: run options apply to --run; add --run")
    moe = [
        f"{flag} {value}"
        for flag, value, default in (
            ("--ep-fold", args.ep_fold, "auto"),
            ("--moe-imbalance", args.moe_imbalance, DEFAULT_MOE_IMBALANCE),
            ("--moe-capacity-factor", args.moe_capacity_factor, None),
            ("--expert-tp", args.expert_tp, None),
        )
        if value != default
    ]
    if moe and not plan.num_experts:
        out.append(f"{', '.join(moe)} had no effect: the model has no mixture-of-experts layer")
    elif args.ep_fold != "auto" and plan.ep == 1:
        why = (
            "the plan has one TP rank (tp=1) to split the experts over"
            if args.ep_fold == "tp" and plan.tp == 1
            else "the plan has no expert parallelism (ep=1; --why says why)"
        )
        out.append(f"--ep-fold {args.ep_fold} had no effect: {why}")
    cp_opts = [
        f"{flag} {value}"
        for flag, value in (
            ("--cp-comm-type", args.cp_comm_type),
            ("--cp-load-balance", args.cp_load_balance),
        )
        if value != "auto"
    ]
    if cp_opts and plan.cp == 1:
        out.append(
            f"{', '.join(cp_opts)} had no effect: the plan has no context parallelism (cp=1); pin --cp to use it"
        )
    if getattr(args, "micro_batches", None) and args.micro_batches > 1 and plan.micro_batches == 1:
        out.append(
            f"--micro-batches {args.micro_batches} had no effect: the plan runs one micro-batch"
            + (" (micro-batches pipeline the stages: pin --pp 2 or more)" if plan.pp == 1 else "")
        )
    return out


def _write_report(args: argparse.Namespace, report: dict) -> None:
    """--json FILE (atomically), or --json - (stdout)."""
    text = json.dumps(report, indent=2, default=float)
    if _json_to_stdout(args):
        stream = _report_stream or sys.stdout
        stream.write(text + "\n")
        stream.flush()
        return
    write_text_atomic(args.json, text, option="--json")
    console.print(f"report written to {args.json}")


def _check_outputs(args: argparse.Namespace, out_kind: str | None = None) -> None:
    """Every output path may be written, and no two options write the same path (InputError, exit 2).
    An existing file is replaced only when it is the planner's own output of the same kind
    (`planner.files.written_kind`): ``out_kind`` for --out, a report for --json."""
    _check_not_nested(args)
    given: dict[Path, str] = {}
    kinds = {"out": out_kind, "json": "report"}
    for option, folder in (("out", False), ("json", False), ("emit", True), ("plot", True)):
        value = getattr(args, option, None)
        if (
            value is not None and not value.strip()
        ):  # "" was taken as not given: nothing written, nothing said
            raise InputError(f"--{option}: empty; give a {'folder' if folder else 'file'} name")
        if value == "-" and option != "json":  # "-" is stdout for --json only; not a file to create
            stdout = (
                "; without --out the export is printed on stdout"
                if out_kind == "export"
                else "; --json - prints the report on stdout"
                if hasattr(args, "json")
                else ""
            )
            raise InputError(
                f"--{option} -: --{option} takes a {'folder' if folder else 'file'} name{stdout}"
            )
        if value and not (option == "json" and value == "-"):
            check_output_path(f"--{option}", value, folder=folder, kind=kinds.get(option))
            where = Path(value).resolve()
            if where in given:
                raise InputError(
                    f"--{given[where]} and --{option} both name {value}: each writes its own file or folder; "
                    "give them different paths"
                )
            given[where] = option


def _check_not_nested(args: argparse.Namespace) -> None:
    """InputError (exit 2) when an output path lies inside an output folder (--emit, --plot): that
    folder holds only what its option wrote and is replaced whole, so the other output would make it
    the user's (refused on every later run) or be replaced with it."""
    paths = {}
    for option in ("out", "json", "emit", "plot"):
        if (value := getattr(args, option, None)) and value.strip() and value != "-":
            try:
                paths[option] = Path(value).resolve()
            except (OSError, RuntimeError):  # a link loop, a name too long: `check_output_path` refuses it
                continue
    for option, where in paths.items():
        for holder in ("emit", "plot"):
            folder = paths.get(holder)
            if holder != option and folder is not None and where != folder and where.is_relative_to(folder):
                raise InputError(
                    f"--{option} {getattr(args, option)} is inside --{holder} {getattr(args, holder)}: the planner "
                    f"writes --{holder}'s folder whole (it holds only what that option wrote), so nothing was "
                    "written; give paths outside each other"
                )


def cmd_optimize(args: argparse.Namespace) -> int:
    from planner.cli import workflow  # noqa: PLC0415 - keeps `planner --help` fast

    _check_outputs(args, out_kind="plan")
    _check_loss_budget_options(args)
    pinned = {"--pp": getattr(args, "pp", None), "--dp": getattr(args, "dp", None)}
    if args.run and args.workload in ("decode", "generate") and any((v or 1) > 1 for v in pinned.values()):
        degrees = ", ".join(f"{k} {v}" for k, v in pinned.items() if (v or 1) > 1)
        raise InputError(
            f"--run serves decode plans with tensor parallelism only, and {degrees} was asked: plan with "
            "--pp 1 --dp 1 to run it, or leave out --run to plan and price it"
        )
    _check_run_decode_ep(args)
    if args.weights and not (args.run or args.data or args.emit):  # read by a run, --emit, a loss budget
        _warn(
            [
                f"--weights {args.weights} had no effect: weights are read by a run (add --run, or `planner run`), "
                "by --emit, or by --ladder auto:max-loss-increase=X%"
            ]
        )
    if args.workload != "train":
        ignored = [
            f"{flag} {value}"
            for flag, value in (
                ("--recompute", args.recompute),
                ("--sequence-parallel", args.sequence_parallel),
                ("--distributed-optimizer", args.distributed_optimizer),
                ("--dp-style", args.dp_style),
                ("--reshard-after-forward", args.reshard_after_forward),
                ("--overlap-grad-reduce", args.overlap_grad_reduce),
                ("--overlap-param-gather", args.overlap_param_gather),
                ("--grad-reduce-dtype", "fp32" if args.grad_reduce_dtype == "fp32" else "auto"),
                ("--loss-scale", _loss_scale_word(args.loss_scale)),
            )
            if value != "auto"
        ]
        if ignored:
            _warn([f"{', '.join(ignored)} had no effect: training options apply to --workload train only"])
            args.recompute = args.sequence_parallel = args.distributed_optimizer = "auto"  # as said: ignored
            args.dp_style = args.reshard_after_forward = "auto"
            args.overlap_grad_reduce = args.overlap_param_gather = "auto"
            args.grad_reduce_dtype = "param"
            args.loss_scale = "auto"

    _check_cp_options(args)
    _check_ep_options(args)
    interleaving = [
        pin
        for pin, given in (
            ("--schedule interleaved_1f1b", args.schedule == "interleaved_1f1b"),
            (f"--virtual-stages {args.virtual_stages}", (args.virtual_stages or 1) > 1),
        )
        if given
    ]
    if args.emit and interleaving:  # before any work: `emit_plan` writes one module per rank
        raise InputError(
            f"{' '.join(interleaving)} with --emit: an emitted rank folder holds one module, and the interleaved "
            "schedule gives each pipeline rank several model chunks; leave the pin out (with --emit the search "
            "keeps one chunk per rank), or run the plan with --run instead of emitting it"
        )
    if args.workload != "train" and interleaving:
        raise InputError(
            f"{' '.join(interleaving)}: the interleaved schedule orders training's forward and backward passes of model "
            f"chunks; a --workload {args.workload} pipeline runs each micro-batch through its stages once "
            "(nothing to interleave): leave it out, or use --workload train"
        )
    if args.workload == "train":  # contradicting pins fail before any tracing or calibration
        workflow.constraints_from(
            args.tp, args.pp, args.dp, args.ladder, max_devices=args.devices, layout=args.layout,
            **_training_options(args), **_cp_options(args), **_ep_options(args),
        )  # fmt: skip
    with _bars(args) as bars:
        nproc = args.nproc
        if args.recalibrate and args.cluster:
            _warn(
                [
                    f"--recalibrate has no effect with --cluster {args.cluster}: it re-measures this machine's own spec, used when --cluster is omitted"
                ]
            )

        def cluster_spec():
            bars("loading the cluster spec", None)
            if args.cluster and args.run and args.scale_to_local and nproc:
                # --nproc counts the local ranks of the re-plan (`_run`), not a GPU cluster's devices
                whole = workflow.resolve_cluster(args.cluster, None)
                if whole.backend == "nccl":
                    return whole
            return workflow.resolve_cluster(
                args.cluster,
                nproc,
                progress=lambda step, frac: bars(f"calibrating: {step}", frac),
                recalibrate=args.recalibrate,
                notify=bars.note,
            )

        # a named spec is checked before tracing (a bad one fails at once); this machine's is measured
        # after it (a model that cannot be traced is reported before a calibration)
        cluster = cluster_spec() if args.cluster else None
        bars("tracing the model (meta device)", None)
        prepared = workflow.prepare(
            args.model,
            args.workload,
            args.batch_size,
            args.seq_len,
            args.context,
            args.micro_batches,
            args.dtype,
            args.new_tokens,
        )
        if cluster is None:
            cluster = cluster_spec()
        # this machine's spec: the model's own matmul shapes timed here, for every use of the spec below
        cluster = workflow.priced_cluster(prepared, cluster, bars)
        bars("solving the ILP", None)
        pp, dp = args.pp, args.dp
        if args.run and prepared.request is not None:  # --run serves a request with tensor parallelism only
            pp, dp = pp or 1, dp or 1
        constraints = workflow.constraints_from(
            args.tp,
            pp,
            dp,
            args.ladder,
            max_devices=args.devices,
            layout=args.layout,
            **_training_options(args),
            **_cp_options(args),
            **_ep_options(args),
        )
        prepared.workload = dataclasses.replace(prepared.workload, **_workload_options(args))
        workflow.check_constraints_fit(
            cluster,
            constraints,
            prepared.structure.batch_size,
            args.micro_batches,
            num_layers=len(prepared.structure.layers),
        )
        if args.run:
            _check_runs_here(args, cluster)
        source = workflow.cluster_source(args.cluster, nproc)
        budget = None
        if constraints.ladder.max_loss_increase is not None:
            from planner.cli.quality import plan_with_loss_budget  # noqa: PLC0415

            plan, budget = plan_with_loss_budget(
                args,
                lambda c: workflow.make_plan(prepared, cluster, c, args.model, source, progress=bars),
                constraints,
                len(prepared.structure.layers),
                bars.rich,
            )
        else:
            plan = workflow.make_plan(prepared, cluster, constraints, args.model, source, progress=bars)
    if args.schedule != "auto" and plan.pp == 1:
        _warn(
            [
                f"--schedule {args.schedule} had no effect: the plan has one pipeline stage (pp=1); pin --pp 2 or more"
            ]
        )
    if args.grad_reduce_dtype == "fp32" and plan.dtype == "fp32" and plan.workload == "train":
        _warn(
            [
                "--grad-reduce-dtype fp32 had no effect: the plan trains in fp32, whose gradients are fp32 already"
            ]
        )
    if (
        getattr(args, "loss_scale", "auto") not in ("auto", None)
        and plan.workload == "train"
        and plan.dtype != "fp16"
    ):
        _warn(
            [
                f"--loss-scale {_loss_scale_word(args.loss_scale)} had no effect: the plan trains in {plan.dtype}, whose gradients "
                "have fp32's exponent range; loss scaling is for fp16 (--dtype fp16)"
            ]
        )
    if getattr(args, "distributed_optimizer", "auto") == "on" and plan.dp == 1:
        _warn(
            [
                "--distributed-optimizer on had no effect: the plan has one data-parallel replica (dp=1), so there "
                "is nothing to shard Adam's state over; pin --dp 2 or more"
            ]
        )
    style = getattr(args, "dp_style", "auto")
    if style not in ("auto", "ddp") and plan.workload == "train" and plan.dp * plan.cp == 1:
        _warn(
            [
                f"--dp-style {style} had no effect: the plan has one data-parallel replica (dp=1), so there is "
                "nothing to shard over and it runs as ddp; pin --dp 2 or more"
            ]
        )
    n, chain = len(prepared.structure.layers), len(prepared.structure.mlp_chain)
    shape = (
        f"{n} layers"
        if n or not chain
        else f"a chain of {chain} linears (no transformer layers; row 0 below)"
    )
    console.print(
        f"Traced {args.model}: {shape}, {prepared.structure.num_params / 1e6:,.1f} M parameters, "
        f"batch {prepared.structure.batch_size}"
        + (f" × seq {prepared.structure.seq_len}" if prepared.structure.token_model else "")
    )
    from planner.cli.render import render_decisions, render_plan  # noqa: PLC0415

    render_plan(console, plan)
    offered = min(cluster.num_devices, args.devices or cluster.num_devices)
    pinned = any(getattr(args, a, None) for a in ("tp", "pp", "dp", "cp", "ep"))
    if plan.num_devices < offered and not pinned:
        console.print(
            f"[yellow]note: the plan uses {plan.num_devices} of the {offered} devices offered: every mesh on "
            "more of them was priced slower for this model and batch, or cannot split them; pin --tp / --pp / "
            "--dp to plan one anyway[/yellow]"
        )
    from costmodels.calibrate import unmeasured_links  # noqa: PLC0415
    from costmodels.cluster import time_shared  # noqa: PLC0415

    if rough := unmeasured_links(cluster, plan.num_devices):
        console.print(f"[yellow]warning: {rough}[/yellow]")
    if time_shared(cluster, plan.num_devices):
        cores = os.cpu_count() or 1
        console.print(
            f"[yellow]{plan.num_devices} ranks time-share this machine's {cores} cores: priced with each rank's "
            f"compute, per-node overhead and gloo link slowed by {cores}/{plan.num_devices}[/yellow]"
        )
    if budget is not None:
        from planner.cli.quality import render_budget  # noqa: PLC0415

        render_budget(console, budget)
        _warn(budget.warnings)
    _warn(workflow.plan_warnings(plan, quality_measured=budget is not None))
    if getattr(args, "virtual_stages", None) and args.virtual_stages > 1 and plan.pp == 1:
        _warn(
            [
                f"--virtual-stages {args.virtual_stages} had no effect: the search chose no pipeline (pp=1); pin --pp to use it"
            ]
        )
    _warn(_unused_options(args, plan))
    # an auto choice the mesh line shows only by leaving out "load-balanced": say why and what it costs
    if _cp_balance_dropped(args, plan):
        console.print(f"note: {cp_unbalanced_note(plan.seq_len, plan.cp)}", highlight=False)
    if args.why:
        render_decisions(console, plan)
    run, run_cluster = None, cluster
    if args.run:  # before anything is written: a run that fails its check leaves no plan or modules
        plan, run, run_cluster = _run(args, plan, prepared, cluster)
    if args.run and run is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    if args.out:
        plan.to_yaml(args.out)
        console.print(f"plan written to {args.out}")
    if args.emit:
        from planner.cli.emitting import emit_plan  # noqa: PLC0415

        backend = run_cluster.backend if run is not None else cluster.backend
        emit_plan(plan, args.model, args.emit, backend=backend, weights=args.weights)
        console.print(f"generated sharded modules written to {args.emit}/ (see its README.md)")
    report = workflow.report_dict(plan, run, args.model, run_cluster, prepared.structure)
    if budget is not None:
        from planner.cli.quality import budget_dict  # noqa: PLC0415

        report["ladder_loss_budget"] = budget_dict(budget)
    layer_table = _render_measured(plan, run, report) if run is not None else False
    if args.json:
        _write_report(args, report)
    if args.plot:
        spec = cluster
        if plan.cluster != cluster.name:  # re-planned for this machine (--scale-to-local)
            spec = workflow.plan_cluster(plan, plan.num_devices)[0]
        _plot(plan, args.plot, report, spec.device.memory_bytes)
    if run is not None:
        _print_verdict(
            plan,
            report,
            layer_table,
            _advice(args.cluster, plan.cluster, run_cluster),
            other_hardware=_other_hardware(run_cluster),
        )
    return 0


def _render_measured(plan, run: dict, report: dict) -> bool:
    """A run's tables: a served request (prefill, then greedy decode steps), else predicted beside
    measured and the per-layer comparison. Returns whether a per-layer table was printed."""
    from planner.cli.render import render_layer_comparison, render_run, render_serving_run  # noqa: PLC0415

    if "serving" in report:
        render_serving_run(console, report)
        return False
    render_run(console, report)
    return render_layer_comparison(console, plan, run["measured"].get("per_layer_s", {}))


def _print_verdict(plan, report: dict, layer_table: bool, advice: str, other_hardware: bool = False) -> None:
    """The run's last lines: measured / predicted and how far apart (`render.agreement_line`; a served
    request's is its time per output token); when the speed probe found the machine faster or slower
    than calibrated, also the ratio at the run's speed (`render.speed_line`), which the first line's
    advice then points to; when the probe read the calibrated speed, the advice blames the cost model.
    `other_hardware`: the plan was priced for another kind of machine (a GPU cluster run on this CPU):
    the advice is to re-plan for this machine, never a busy machine or the run's spread, which a ratio
    across hardware says nothing about."""
    from planner.cli.render import agreement_line, speed_line  # noqa: PLC0415

    measured_s = report["measured"]["latency_s"]
    at_run = report["measured"].get("at_run_speed")
    busy = None if other_hardware else busy_during_run(plan.num_devices)
    line = None if other_hardware else speed_line(at_run, measured_s, busy=busy)
    if not other_hardware:  # else `advice` as given: re-plan for this machine
        advice = _run_advice(plan, report["measured"], advice, busy, line)
    verdict = agreement_line(plan.predicted.latency_s, measured_s, layer_table=layer_table, advice=advice)
    what = "time per output token: " if "serving" in report else ""
    console.print(f"[bold]{what}{verdict}[/bold]")
    if line:
        console.print(f"[bold]{line}[/bold]")


def _run_advice(plan, measured: dict, advice: str, busy: str | None, line: str | None) -> str:
    """What the verdict of a run on this machine's own kind of hardware blames (`_print_verdict`): the
    run's speed against calibration, a busy machine or the steps' spread (for a run slower than
    predicted), else the cost model; `advice` (recalibrating, or pricing for this machine) otherwise."""
    from planner.cli.render import RECALIBRATE  # noqa: PLC0415

    measured_s, at_run = measured["latency_s"], measured.get("at_run_speed")
    slower = measured_s > plan.predicted.latency_s
    if line and 0.8 <= (at_run.get("measured_over_predicted") or 0.0) <= 1.25:
        return "the machine ran at another speed than when calibrated: see the next line"
    if busy and slower:
        # other processes shared the cores: neither the cost model nor calibration is to blame for a
        # slow run (they do not make a run faster than predicted)
        return busy
    if slower and (spread := _wide_spread(measured)):
        # slow spells raise the median; they do not explain a run faster than predicted
        return spread
    if line:  # off at the run's speed too: re-measuring the machine would not help
        return "off at the run's own speed too (next line)"
    if at_run and advice == RECALIBRATE:  # the probe read the calibrated speed: recalibrating won't help
        return (
            "the speed probe read this machine at its calibrated speed between the steps, so the cost model "
            "is off for this plan, unless other processes took the cores during the steps, which the probe "
            "can miss (run again on a quiet machine to tell)"
        )
    return advice


# p90 / p10 of a run's step times beyond which its median says more about the machine's spells than about
# the plan: on a quiet dev VM a run's steps spread 1.1-1.5x; a ladder run during a busy spell, 1.53-6.39 ms
WIDE_SPREAD = 2.0


def _wide_spread(measured: dict) -> str | None:
    """Advice when the timed steps spread wider than `WIDE_SPREAD` (p90 / p10), else None."""
    p10, p90 = measured.get("latency_p10_s"), measured.get("latency_p90_s")
    if not p10 or not p90 or p90 / p10 < WIDE_SPREAD:
        return None
    return (
        f"the steps spread {p90 / p10:.1f}x (p10 {p10 * 1e3:.3g} ms, p90 {p90 * 1e3:.3g} ms): the machine ran "
        "in slow and fast spells, which the median does not average out; run again on a quiet machine"
    )


def busy_during_run(ranks: int, load: float | None = None, cores: int | None = None) -> str | None:
    """Advice when other processes shared this machine's cores during a local run: the 1-minute load
    average (``load``, default `os.getloadavg`) less the run's own ``ranks`` at least half the
    ``cores`` (default `os.cpu_count`); else None. The speed probe, timed between the steps, can miss
    them; the load average lags (on the dev VM it read ~1 after a minute of one busy process), so a
    short run beside a new job may not be flagged."""
    try:
        load = os.getloadavg()[0] if load is None else load
    except OSError:
        return None
    cores = cores or os.cpu_count() or 1
    if load - ranks < 0.5 * cores:  # one busy process beside 2 ranks on 2 cores (3.0) counts
        return None
    return (
        f"the machine was busy (1-minute load average {load:.1f} on {cores} cores, of which this run's "
        f"{ranks} rank(s) account for at most {ranks}): other processes took time from the ranks; run "
        "again on a quiet machine"
    )


def _check_loss_budget_options(args: argparse.Namespace) -> None:
    """--ladder auto:max-loss-increase=X% measures held-out loss: without --data, exit 2 before any work."""
    from planner.solver.problem import LadderPolicy  # noqa: PLC0415

    policy = LadderPolicy.parse(args.ladder or "none", option="--ladder")
    if policy.max_loss_increase is not None and not args.data:
        raise InputError(
            f"--ladder {args.ladder} measures the model's loss on held-out text: give --data PATH "
            "(a text file, a folder of them, or 'stdlib') and --weights CKPT with the trained weights"
        )
    if policy.max_loss_increase is None and (args.data or args.tokenizer):
        raise InputError("--data / --tokenizer are read only with --ladder auto:max-loss-increase=X%")


def _warn(lines: list[str]) -> None:
    """Each of ``lines`` once, as a "warning: ..." line on stderr."""
    for line in dict.fromkeys(lines):
        err_console.print(Text.assemble(("warning: ", "bold yellow"), line), highlight=False)


_SHOWN_WARNINGS: set[str] = set()


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    """`warnings.showwarning` for the command line: one "warning: ..." line, no source location, each
    text once per process (a serving plan analyses its prefill and decode graphs alike: one warning)."""
    text = str(message)
    if text not in _SHOWN_WARNINGS:
        _SHOWN_WARNINGS.add(text)
        _warn([text])


def _check_runs_here(args: argparse.Namespace, cluster) -> None:
    """--run on a GPU cluster spec from a machine without enough GPUs: say that the cluster is not this
    machine and how to plan for it, before any planning work (InputError, exit 2)."""
    if cluster.backend != "nccl" or args.scale_to_local:
        return
    have = torch_devices()
    want = args.nproc or min(cluster.num_devices, args.devices or cluster.num_devices)
    if have >= want:
        return
    here = f"{have} CUDA device(s)" if have else "no CUDA device"
    raise InputError(
        f"--run executes the plan on this machine, but --cluster {args.cluster} describes another one "
        f"({cluster.name}: {cluster.device.name} GPUs over nccl; the run asks for {want}) and this machine has {here}. "
        f"To plan for this machine and run: --cluster local-cpu --nproc N; to re-plan for this machine (its "
        f"measured spec) automatically: add --scale-to-local; to run this plan on {cluster.name}: save it with --out and "
        "start planner run there under torchrun (docs/real-cluster.md)"
    )


def _run(args, plan, prepared, cluster):
    """Run `plan` (--run): on its own device count when it uses fewer local gloo ranks than --nproc,
    re-planned with this machine's measured spec under --scale-to-local when it does not fit here.
    Returns (the plan run, its run summary or None on a rank other than 0 under torchrun, the spec it
    was priced with). Raises InputError when the plan cannot run here and --scale-to-local is absent."""
    from planner.cli import workflow  # noqa: PLC0415

    nproc = args.nproc or plan.num_devices
    local_devices = torch_devices() if cluster.backend == "nccl" else None
    fits = nproc == plan.num_devices and (local_devices is None or local_devices >= nproc)
    if not fits and not args.scale_to_local and cluster.backend == "gloo" and plan.num_devices < nproc:
        nproc, fits = _on_its_own_ranks(plan, nproc), True
    if not fits:
        if not args.scale_to_local:
            raise InputError(
                f"the plan uses {plan.num_devices} devices (tp={plan.tp} x pp={plan.pp} x dp={plan.dp}) on {cluster.name}; "
                f"this machine runs {nproc} rank(s). Pass --scale-to-local to re-plan for this machine with --nproc ranks"
            )
        nproc = args.nproc or (os.cpu_count() or 1)
        cluster = workflow.resolve_cluster(None, nproc, notify=console.print)
        console.print(
            f"[yellow]re-planning for this machine (its measured spec, {nproc} ranks) to run it (--scale-to-local)[/yellow]"
        )
        pins = {"tp": args.tp, "pp": args.pp, "dp": args.dp}
        if math.prod(v for v in pins.values() if v) > nproc:  # the GPU plan's pins cannot hold on these ranks
            dropped = " ".join(f"--{k} {v}" for k, v in pins.items() if v)
            _warn([f"{dropped} left out of the re-plan for this machine: {nproc} rank(s) cannot hold them"])
            pins = dict.fromkeys(pins)
        constraints = workflow.constraints_from(
            pins["tp"],
            pins["pp"],
            pins["dp"],
            args.ladder,
            max_devices=nproc,
            layout=args.layout,
            **_training_options(args),
            **_ep_options(args),
        )
        source = workflow.cluster_source(None, nproc)
        plan = workflow.make_plan(prepared, cluster, constraints, args.model, source)
        from planner.cli.render import render_plan  # noqa: PLC0415

        render_plan(console, plan)
        nproc = plan.num_devices
    workflow.check_fits_this_machine(plan, prepared.structure, nproc)
    run = _run_plan(args, plan, nproc, speed_probe=workflow.probes_speed(cluster))
    return plan, run, cluster


def _on_its_own_ranks(plan, nproc: int) -> int:
    """Say that a plan using fewer local gloo ranks than ``nproc`` runs on its own; return its count."""
    console.print(
        f"[yellow]the plan uses {plan.num_devices} of the {nproc} ranks ({plan.mesh.label().replace(' ', ' x ')}): "
        f"running it on {plan.num_devices}[/yellow]"
    )
    return plan.num_devices


def _run_plan(args: argparse.Namespace, plan, nproc: int, speed_probe: bool = False):
    """`workflow.run_plan` of `plan` on `nproc` ranks with the command's iterations, warm-up, timeout
    and weights, showing progress bars on a terminal (`_bars`); `speed_probe`: time the calibration's
    probe beside the steps (`workflow.probes_speed`)."""
    from planner.cli import workflow  # noqa: PLC0415 - keeps `planner --help` fast

    try:
        with _bars(args) as bars:
            return workflow.run_plan(
                plan,
                args.model,
                nproc,
                args.iters,
                args.warmup,
                args.timeout,
                weights=args.weights,
                progress=bars,
                min_time_s=args.min_time,
                speed_probe=speed_probe,
            )
    except (RunError, InputError) as e:
        # the numerics check failed (`e.run`: the run's summary), a rank raised, timed out or was killed,
        # or a rank found the input at fault (InputError): --json still gets the report, the plan and
        # prediction with the failure (what CI reads to triage it), before the error exits 4 (2)
        if args.json:
            written_by = "planner run --json" if args.command == "run" else "planner optimize --json"
            report = workflow.report_dict(
                plan, getattr(e, "run", None), args.model, plan.saved_cluster(), written_by=written_by
            )
            _write_report(args, {**report, "failed": str(e)})
        raise


def torch_devices() -> int:
    """CUDA devices on this machine (0 without CUDA)."""
    import torch  # noqa: PLC0415

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _other_hardware(cluster) -> bool:
    """Whether `cluster` is not this machine's kind (a GPU preset here without CUDA, or the reverse)."""
    return cluster.backend != ("nccl" if torch_devices() else "gloo")


def _advice(cluster_option: str | None, planned_for: str, cluster, saved: bool = False) -> str:
    """What would make a far-off measured / predicted fair: recalibrating this machine's own spec, or
    pricing the plan for this machine when it was priced for another cluster. `saved`: the plan was
    loaded by `planner run` (which has no --cluster: the advice is to re-plan)."""
    from costmodels.cluster import CALIBRATED_SPEC_NAME  # noqa: PLC0415
    from planner.cli import workflow  # noqa: PLC0415
    from planner.cli.render import RECALIBRATE  # noqa: PLC0415

    if _other_hardware(cluster):
        return (
            f"the plan was priced for {planned_for}, not this machine: re-plan without --cluster to compare"
        )
    if cluster_option and planned_for != CALIBRATED_SPEC_NAME:
        how = "re-plan it with planner optimize without --cluster" if saved else "omit --cluster"
        return f"the plan was priced with {cluster_option}; {how} to use this machine's measured spec"
    if cluster_option and Path(cluster_option).parent != workflow.CACHE_DIR:
        # a spec file of the user's, written by `planner calibrate`: --recalibrate re-measures the cache only
        return f"re-measure {cluster_option} on a quiet machine (planner calibrate --out {cluster_option})"
    return RECALIBRATE


def _saved_plan(path: str):
    """A saved plan, checked as far as it can be without its model (`plan_checks.check_plan_fields`: its
    stages, batch split, and its mesh against its cluster when that loads here). Raises InputError."""
    from planner.cli.plan_checks import check_plan_fields  # noqa: PLC0415 - no torch: show / export start fast
    from planner.plan import Plan  # noqa: PLC0415

    plan = Plan.from_yaml(path)
    cluster = plan.saved_cluster()
    local = cluster is None or cluster.backend == "gloo"  # local CPU ranks: any count
    check_plan_fields(plan, cluster=None if local else cluster)
    return plan


def cmd_show(args: argparse.Namespace) -> int:
    from planner.cli.plan_checks import plan_warnings  # noqa: PLC0415
    from planner.cli.render import render_decisions, render_plan  # noqa: PLC0415

    _check_outputs(args)
    plan = _saved_plan(args.plan)
    _warn(_edited_warning(plan, "the times and memory below are those it was priced with"))
    render_plan(console, plan)
    _warn(plan_warnings(plan, quality_measured=True))  # show: the replicated / TP=1 ladder only
    if args.why:
        render_decisions(console, plan)
    if args.plot:
        from planner.cli import workflow  # noqa: PLC0415

        cluster, note = workflow.plan_cluster(plan, plan.num_devices)
        if note:
            _warn([f"{note}; the memory figure draws no device capacity"])
        _plot(plan, args.plot, None, None if note else cluster.device.memory_bytes)
    return 0


def _plot(plan, folder: str, report: dict | None, capacity_bytes: float | None) -> None:
    """--plot: the figures of `plan` (and of the run in `report`) into `folder`, named on the console."""
    from planner.report.plots import write_figures  # noqa: PLC0415 - matplotlib only for --plot

    figures = write_figures(plan, folder, report, capacity_bytes)
    _warn(figures.notes)
    console.print(f"figures written to {folder.rstrip('/')}/: {', '.join(p.name for p in figures.files)}")


def cmd_run(args: argparse.Namespace) -> int:
    from costmodels.cluster import resize_cluster  # noqa: PLC0415
    from planner.cli import workflow  # noqa: PLC0415
    from planner.cli.render import fmt_s, render_plan  # noqa: PLC0415
    from planner.plan import Plan  # noqa: PLC0415

    _check_outputs(args)
    plan = Plan.from_yaml(args.plan)
    if args.model is None:
        args.model = str(plan.model_file(args.plan))
    if not Path(args.model).exists():
        raise InputError(f"model file {args.model} does not exist")
    if Path(plan.model).name != Path(args.model).name:
        raise InputError(
            f"the plan {args.plan} was made for {plan.model} (its field 'model'), and --model is {args.model}: "
            f"run it with its own model file, or plan this one (planner optimize {args.model} ...)"
        )
    nproc = args.nproc or plan.num_devices
    with _bars(args) as bars:
        bars("checking the plan against the model", None)
        prepared = workflow.prepare_for_plan(plan, args.model)
        workflow.validate_plan_for_model(plan, prepared.structure, args.model, prepared.param_shapes)
        cluster, note = workflow.plan_cluster(plan, nproc)
        if cluster.backend == "gloo" and args.nproc != plan.num_devices:
            # a local spec as planned, with the process count it was measured with (optimize --run prices
            # it so): resized to the plan's fewer ranks, its per-process peaks would double with the
            # threads while the speed probe's small matmul does not
            cluster, note = workflow.plan_cluster(plan, None)
        if cluster.backend == "gloo" and plan.num_devices < nproc:  # as optimize --run does
            nproc = _on_its_own_ranks(plan, nproc)
        # --nproc below the plan's ranks (a GPU preset re-sized to it would say it has too few devices)
        if nproc < plan.num_devices:
            raise InputError(
                f"{args.plan}: the plan's field 'mesh' needs {plan.num_devices} devices ({plan.mesh.label()}), but --nproc is "
                f"{nproc}: give --nproc {plan.num_devices} (or leave it out), or plan for {nproc} ranks "
                f"(planner optimize {args.model} --nproc {nproc})"
            )
        if cluster.backend == "gloo" and cluster.num_devices < plan.num_devices:
            cluster = resize_cluster(cluster, plan.num_devices)  # more ranks than it was measured with
        if plan.num_devices > cluster.num_devices:
            raise InputError(
                f"{args.plan}: field 'mesh' asks for {plan.num_devices} devices ({plan.mesh.label()}), but "
                f"{cluster.devices_text()}: set mesh.tp / mesh.pp / mesh.dp to fit"
            )
        # a file edited anywhere (its digest line no longer matches) is priced again too: a prediction or
        # a cluster name edited by hand would otherwise be reported as what the planner predicted
        file_edited = edited_since_written(args.plan)
        decisions_edited = plan.decisions_edited()
        repriced = workflow.reprice_if_edited(plan, prepared, cluster, force=file_edited)
        bars("lowering the plan on meta tensors for every rank", None)
        # a hand-edited plan is checked whole, and priced again when its decisions changed
        checked = workflow.check_lowering(prepared, repriced or plan, cluster)
    if note:
        _warn([note])
    if file_edited and not note and plan.cluster != cluster.name:
        _warn(
            [
                f"{args.plan}: the field 'cluster' says {plan.cluster}, but the spec the plan was priced with (its field "
                f"'cluster_source', {plan.cluster_source}) is {cluster.name}: it is priced and run with that spec. To plan "
                f"for {plan.cluster}, re-plan (planner optimize {args.model} --cluster {plan.cluster})"
            ]
        )
        checked = dataclasses.replace(checked, cluster=cluster.name)
    if repriced is not None:
        what = (
            "the plan's decisions differ from those it was priced with (edited after planning)"
            if decisions_edited
            else "the plan file was edited after planning (its last line's digest no longer matches)"
        )
        _warn(
            [
                f"{what}: priced again on {cluster.name}: {fmt_s(plan.predicted.latency_s)} -> "
                f"{fmt_s(checked.predicted.latency_s)}"
            ]
        )
        render_plan(console, checked)
    elif len(checked.fallbacks) > len(plan.fallbacks):
        _warn(
            [
                "the plan does not price every op the tensor-parallel pass runs replicated (a hand-edited plan?); "
                "its prediction now includes them:"
            ]
        )
        render_plan(console, checked)
    plan = checked
    if nproc != plan.num_devices:
        workflow.run_plan(
            plan, args.model, nproc, args.iters, args.warmup, args.timeout
        )  # raises the message
    workflow.check_fits_this_machine(plan, prepared.structure, nproc)
    run = _run_plan(args, plan, nproc, speed_probe=workflow.probes_speed(cluster))
    if run is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    report = workflow.report_dict(
        plan, run, args.model, cluster, prepared.structure, written_by="planner run --json"
    )
    layer_table = _render_measured(plan, run, report)
    if _other_hardware(cluster):
        console.print(
            f"[yellow]note: the plan was predicted for {plan.cluster} ({cluster.backend}); it was measured on this machine, "
            "so measured / predicted compares different hardware. Re-plan with --cluster for this machine to compare.[/yellow]"
        )
    if args.json:
        _write_report(args, report)
    _print_verdict(
        plan,
        report,
        layer_table,
        _advice(plan.cluster_source or plan.cluster, plan.cluster, cluster, saved=True),
        other_hardware=_other_hardware(cluster),
    )
    return 0


def _cuda_available() -> bool:
    """Whether torch sees a CUDA device (`planner calibrate` times the GPU measurements there)."""
    import torch  # noqa: PLC0415

    return torch.cuda.is_available()


def cmd_calibrate(args: argparse.Namespace) -> int:
    from costmodels.calibrate import calibrate, write_cluster_yaml  # noqa: PLC0415
    from costmodels.cluster import load_cluster  # noqa: PLC0415
    from planner.cli import workflow  # noqa: PLC0415

    _check_outputs(args, out_kind="cluster spec")

    measured = workflow.calibration_nproc(args.nproc)
    if measured != args.nproc:
        console.print(
            f"[yellow]{args.nproc} processes on {os.cpu_count()} cores: measuring {measured} (one per core) and "
            f"writing the spec time-shared over {args.nproc} (each gets {measured}/{args.nproc} of a core); "
            f"{args.nproc} processes timed at once would measure the scheduler[/yellow]"
        )
    gemm_shapes: tuple[tuple[int, int, int], ...] = ()
    if args.model:  # a bad path is the user's mistake on a CPU machine too, where the model is not timed
        from planner.frontend.modelfile import load_model_file  # noqa: PLC0415

        load_model_file(args.model)
    if args.model and not _cuda_available():
        console.print(
            "[yellow]--model: a model's own GEMM shapes are timed on CUDA only; on this CPU machine the "
            "calibration times its standard probes (planning on it times the model's own matmul shapes when "
            "the plan is made)[/yellow]"
        )
    elif args.model:
        from planner.solver.machine import calibration_gemm_shapes  # noqa: PLC0415

        gemm_shapes = calibration_gemm_shapes(workflow.prepare(args.model), args.nproc)
    with _bars(args) as bars:
        spec = calibrate(
            measured, progress=bars, probe_roofline=workflow.probe_roofline, gemm_shapes=gemm_shapes
        )
    if os.environ.get("RANK", "0") != "0" and os.environ.get("WORLD_SIZE"):
        return 0  # under torchrun: rank 0 writes the spec
    if measured != args.nproc and spec.num_nodes == 1:
        from costmodels.cluster import resize_cluster  # noqa: PLC0415

        spec = resize_cluster(spec, args.nproc)
    write_cluster_yaml(spec, args.out)
    spec = load_cluster(args.out)
    d = spec.device
    console.print(f"wrote {args.out}: {spec.num_devices} × {d.name}")
    console.print(
        f"  matmul fp32 {d.peak_flops_per_s['fp32'] / 1e9:.1f} GFLOP/s per rank, memory {d.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
        f"launch {d.launch_overhead_s * 1e6:.1f} µs; all-reduce alpha {spec.intra_node.latency_s * 1e6:.1f} µs, "
        f"bandwidth {spec.intra_node.bandwidth_bytes_per_s / 1e9:.2f} GB/s; overlap efficiency {spec.overlap_efficiency:.2f}"
    )
    return 0


def cmd_ladder_eval(args: argparse.Namespace) -> int:
    from planner.cli.quality import cmd_ladder_eval as run  # noqa: PLC0415

    return run(args, console, err_console)


def cmd_adapt(args: argparse.Namespace) -> int:
    from planner.cli.quality import cmd_adapt as run  # noqa: PLC0415

    return run(args, console, err_console)


def _edited_warning(plan, consequence: str) -> list[str]:
    """A warning when a saved plan's decisions were edited after it was priced (`Plan.priced_digest`),
    which `planner run` prices again (and checks against the model); none otherwise."""
    if not plan.decisions_edited():
        return []
    return [
        f"the plan's decisions differ from those it was priced with (edited after planning): {consequence}; "
        "planner run PLAN --model MODEL.py checks it against the model and prices it again"
    ]


def _check_edited_against_model(plan, plan_path: str) -> None:
    """A plan edited after planning (its decisions or its file) is checked against its model file, where
    that file is here, as `planner run` checks it (`workflow.validate_plan_for_model`: weights, split
    dims and degrees that divide them, stages, batch; then priced, which checks each split against the
    options of its op at the plan's degrees): an export must not write a layout the model cannot take.
    InputError (exit 2) names the plan field."""
    from planner.files import edited_since_written  # noqa: PLC0415

    if not (plan.decisions_edited() or edited_since_written(plan_path)):
        return  # (without importing torch: show and export of a saved plan start fast)
    from planner.cli import workflow  # noqa: PLC0415

    model = plan.model_file(plan_path)
    if not model.exists():
        _warn(
            [
                f"{plan_path} was edited after planning and its model file {model} is not here: not checked against it"
            ]
        )
        return
    prepared = workflow.prepare_for_plan(plan, str(model))
    workflow.validate_plan_for_model(plan, prepared.structure, str(model), prepared.param_shapes)
    # each split against the options of the op it splits at the plan's degrees, as `planner run` prices
    # an edited plan again (`serving.plan_assignment`: colwise kept at tp 1, say, is refused)
    cluster, _ = workflow.plan_cluster(plan, None)
    if plan.num_devices > cluster.num_devices:
        raise InputError(
            f"plan field 'mesh': {plan.mesh.label()} uses {plan.num_devices} devices, and the plan's cluster "
            f"{cluster.name} has {cluster.num_devices}; give degrees whose product fits it, or plan again with "
            "planner optimize --cluster for the cluster you will run on"
        )
    workflow.plan_prediction(
        plan, prepared.structure, cluster, workflow.priced_workload(plan), plan.ladder_layers
    )


def cmd_export(args: argparse.Namespace) -> int:
    from planner.export import export_plan  # noqa: PLC0415

    _check_outputs(args, out_kind="export")
    plan = _saved_plan(args.plan)
    _check_edited_against_model(plan, args.plan)
    result = export_plan(plan, args.to, model=args.model, torchtitan_version=args.torchtitan_version)
    ignored = (
        [f"--model {args.model} had no effect: it names the Hugging Face model of --to vllm only"]
        if args.model and args.to != "vllm"
        else []
    )
    if args.torchtitan_version != "0.3" and args.to != "torchtitan":
        ignored.append(
            f"--torchtitan-version {args.torchtitan_version} had no effect: it applies to --to torchtitan only"
        )
    _warn(
        _edited_warning(plan, "the export writes its edited layout, which no prediction checked")
        + ignored
        + result.warnings
    )
    if args.out:
        write_text_atomic(args.out, with_digest(result.text), option="--out")
        err_console.print(f"{args.to} export written to {args.out}")
    else:
        sys.stdout.write(result.text)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from planner.cli.compare import render_comparison  # noqa: PLC0415

    render_comparison(console, args.reports)
    return 0


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE (13): stdout closed by its reader


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `planner` console script; returns the process exit code."""
    warnings.showwarning = _show_warning  # spec and calibration warnings as one line each
    _SHOWN_WARNINGS.clear()  # once per command (tests call main several times in one process)
    try:
        args = build_parser().parse_args(argv)
        handler = {
            "optimize": cmd_optimize,
            "show": cmd_show,
            "run": cmd_run,
            "calibrate": cmd_calibrate,
            "ladder-eval": cmd_ladder_eval,
            "adapt": cmd_adapt,
            "export": cmd_export,
            "compare": cmd_compare,
        }[args.command]
        with _report_on_stdout(args):
            return handler(args)
    except PlannerError as e:
        kind = {2: "bad input", 3: "no feasible plan", 4: "run failed"}.get(e.exit_code, "error")
        err_console.print(Text.assemble((f"error ({kind}): ", "bold red"), str(e)), highlight=False)
        return e.exit_code
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130
    except BrokenPipeError:
        # stdout's reader left (`planner ... | head`): stop quietly, as a pipe's writer does, exit
        # 128 + SIGPIPE as a shell reports it; stdout to /dev/null so the exit's flush does not fail again
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_BROKEN_PIPE


def _cp_options(args: argparse.Namespace) -> dict:
    """--cp, --cp-comm-type, --cp-load-balance as `workflow.constraints_from` keywords ("auto": None)."""
    balance = getattr(args, "cp_load_balance", "auto")
    comm = getattr(args, "cp_comm_type", "auto")
    return {
        "cp": getattr(args, "cp", None),
        "cp_comm_type": None if comm == "auto" else comm,
        "cp_load_balance": None if balance == "auto" else balance == "on",
    }


def _check_cp_options(args: argparse.Namespace) -> None:
    """Context parallelism splits the sequence of a training step or a prefill: a --cp above 1 with
    --workload decode / generate, or --cp-comm-type / --cp-load-balance with --cp 1, is refused in one
    line (exit 2), before any tracing."""
    from planner.solver.problem import Constraints  # noqa: PLC0415 - keeps `planner --help` fast

    Constraints(**_cp_options(args))  # contradicting pins (`Constraints.__post_init__`)
    cp = getattr(args, "cp", None)
    if cp is not None and cp > 1 and args.workload in ("decode", "generate"):
        raise InputError(
            f"--cp {cp} with --workload {args.workload}: a decode step has one new token per sequence to split; "
            "context parallelism is for --workload train and forward (prefill): use --cp 1 or leave it out"
        )


def _ep_options(args: argparse.Namespace) -> dict:
    """--ep, --ep-fold, --expert-tp as `workflow.constraints_from` keywords ("auto": None); with --run, EP
    plans keep dp_style ddp (`Constraints.runs_here`: the one style the runtime runs expert parallelism
    with)."""
    fold = getattr(args, "ep_fold", "auto")
    return {
        "ep": getattr(args, "ep", None),
        "ep_fold": None if fold == "auto" else fold,
        "runs_here": bool(getattr(args, "run", False)),
        "expert_tp": getattr(args, "expert_tp", None),
    }


def _cp_balance_dropped(args: argparse.Namespace, plan) -> bool:  # noqa: ANN001 - a Plan
    """--cp-load-balance auto left off because the sequence does not cut into 2 x cp chunks (the search
    then runs contiguous chunks, `search._cp_variants`), which the user should be told."""
    return (
        plan.cp > 1
        and not plan.cp_load_balance
        and getattr(args, "cp_load_balance", "auto") == "auto"
        and plan.seq_len % (2 * plan.cp) != 0
    )


def _check_run_decode_ep(args: argparse.Namespace) -> None:
    """--run serves a decode / generate plan with tensor parallelism only (one replica: --dp 1 is implied,
    not asked), so expert parallelism there must fold over the TP ranks (--ep-fold tp, --tp equal to --ep);
    --ep-fold dp, or a pinned --tp other than --ep, is refused in one line (exit 2) before any tracing."""
    ep = getattr(args, "ep", None) or 1
    if not (args.run and args.workload in ("decode", "generate") and ep > 1):
        return
    fold, tp = getattr(args, "ep_fold", "auto"), getattr(args, "tp", None)
    if fold == "dp":
        asked = f"--ep {ep} --ep-fold dp"
    elif fold == "auto" and tp is not None and tp != ep:
        asked = f"--ep {ep} --tp {tp}"
    else:
        return
    raise InputError(
        f"{asked} with --run: --run serves decode plans with tensor parallelism only (one data-parallel "
        "replica), so expert parallelism can only split the experts over the TP ranks; use --ep-fold tp "
        f"--tp {ep} to run it, or leave out --run to plan and price {asked}"
    )


def _loss_scale_arg(text: str) -> float | str | None:
    """--loss-scale's value: "auto", "dynamic", None for "off", or a static scale (a positive number).
    Raises argparse.ArgumentTypeError (exit 2, naming the flag) for anything else."""
    word = text.strip().lower()
    if word in ("auto", "dynamic"):
        return word
    if word == "off":
        return None
    try:
        value = float(word)
    except ValueError:
        value = float("nan")
    if not is_static_loss_scale(value):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not auto, dynamic, off or a positive number up to fp32's largest ({FP32_MAX:.3g}; a "
            "static scale such as 1024)"
        )
    return value


def _loss_scale_word(value: float | str | None) -> str:
    """--loss-scale's parsed value as the user would write it."""
    return "off" if value is None else value if isinstance(value, str) else f"{value:g}"


def _workload_options(args: argparse.Namespace) -> dict:
    """--moe-imbalance, --moe-capacity-factor, --grad-reduce-dtype, --loss-scale as `WorkloadSpec` keywords."""
    return {
        "moe_imbalance": getattr(args, "moe_imbalance", DEFAULT_MOE_IMBALANCE),
        "moe_capacity_factor": getattr(args, "moe_capacity_factor", None),
        "grad_reduce_dtype": getattr(args, "grad_reduce_dtype", "param"),
        "loss_scale": getattr(args, "loss_scale", "auto"),
    }


def _check_ep_options(args: argparse.Namespace) -> None:
    """--ep-fold with --ep 1, an --expert-tp other than 1 or --tp (or with --ep-fold tp, or --ep 1), and an
    --moe-imbalance or --moe-capacity-factor below 1, are refused in one line (exit 2), before any
    tracing (the model-dependent checks: `search._check_pinned_ep`)."""
    from planner.solver.problem import Constraints, WorkloadSpec  # noqa: PLC0415 - keeps `planner --help` fast

    Constraints(tp=getattr(args, "tp", None), **_ep_options(args))
    WorkloadSpec("forward", 1, 1, **_workload_options(args))


def _training_options(args: argparse.Namespace) -> dict:
    """--schedule, --virtual-stages, --recompute, --sequence-parallel, --distributed-optimizer as
    `workflow.constraints_from` keywords ("auto": None, the search chooses)."""

    def on_off(value: str) -> bool | None:
        return None if value == "auto" else value == "on"

    return {
        "schedule": None if args.schedule == "auto" else args.schedule,
        # --emit writes one module per rank: one model chunk each (`emitting.emit_plan`)
        "virtual_stages": 1
        if getattr(args, "emit", None) and args.virtual_stages is None
        else args.virtual_stages,
        "recompute": None if args.recompute == "auto" else args.recompute,
        "sequence_parallel": on_off(args.sequence_parallel),
        "distributed_optimizer": on_off(args.distributed_optimizer),
        "dp_style": None if args.dp_style == "auto" else args.dp_style,
        "dp_shard": args.dp_shard,
        "reshard_after_forward": on_off(args.reshard_after_forward),
        "tp_comm_overlap": on_off(args.tp_comm_overlap),
        "overlap_grad_reduce": on_off(args.overlap_grad_reduce),
        "overlap_param_gather": on_off(args.overlap_param_gather),
    }


if __name__ == "__main__":
    sys.exit(main())

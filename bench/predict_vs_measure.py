"""Predicted against measured step latency on this machine: every README local example and the user
models a planner is tried on first, one command, under 10 minutes on 2 cores.

    python bench/predict_vs_measure.py [--nproc 2] [--iters 5] [--min-time 2] [--cluster SPEC.yaml] [--recalibrate]
                                       [--only NAME] [--components]

1. The cluster spec: this machine as `planner optimize` sees it without --cluster (the spec measured by
   `planner calibrate` and cached in ~/.cache/parallel-planner/, re-measured when stale or with
   `--recalibrate`), unless `--cluster` names a preset or a spec YAML; for the one-rank configurations
   a spec measured by one process alone (`_single_rank_cluster`).
2. For each configuration of `CONFIGS` (the README's local examples, then tiny and mid Llama-3,
   GPT-2 124M, HF Llama and GPT-2, an MLP stack, a conv net; TP=1, TP=2, PP=2, DP=2 (DDP, and ZeRO-1
   and FSDP pinned); forward and train; then a tiny Llama's training step at CP=2 (ring and all-gather)
   and a tiny HF Mixtral at EP=2 over dp, forward and train) `planner.cli.workflow.make_plan` plans it with the mesh pinned, and the plan runs on as many
   gloo ranks as it uses, one compute thread each (`runtime.execute.run_rank`: numerics checked
   against the unsharded model, warm-up + `iters` timed steps, median of the slowest rank).
3. The table: predicted, measured, measured / predicted (1.00 = exact); then the median and the worst
   over every configuration (goal: median within 10%, every one within 25%; a plan with more ranks than
   cores is priced time-sharing them, `costmodels.cluster.resize_cluster`), and the machine's load
   average before and after (a busy machine slows the ranks unpredictably).
4. `--components`: every configuration's graph profiled node by node beside the cost model's terms
   (matmuls, LM head, attention, the other ops, collectives), to locate a misprediction.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.timing import REPO_ROOT, machine_line  # noqa: E402
from runtime.launch import RankContext, launch  # noqa: E402

THREADS_PER_RANK = 1  # the calibrated device is one core (calibrate runs max(1, cores // nproc) threads)


@dataclass(frozen=True)
class Config:
    """One configuration: a model file, its inputs, the pinned mesh and the workload."""

    name: str
    model_path: str
    batch_size: int | None
    seq_len: int | None
    tp: int
    pp: int = 1
    dp: int = 1
    workload: str = "forward"
    readme: bool = False  # one of the README's local examples
    dp_style: str | None = None  # pinned data-parallel style (ddp, zero1, zero2, fsdp); None: the search's
    cp: int = 1  # context-parallel degree
    cp_comm_type: str | None = None  # ring | allgather | alltoall (cp > 1)
    ep: int = 1  # expert-parallel degree (folded over dp)
    dtype: str | None = None  # the planned dtype (--dtype); None: the model's own

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def label(self) -> str:
        shape = f"{self.batch_size or 'default'}" + (f" x {self.seq_len}" if self.seq_len else "")
        style = f" {self.dp_style}" if self.dp_style else ""
        style += f" cp{self.cp} {self.cp_comm_type}" if self.cp > 1 else ""
        style += f" ep{self.ep}" if self.ep > 1 else ""
        style += f" {self.dtype}" if self.dtype else ""
        return f"{self.name} ({shape}) {self.workload}{style}" + (" [README]" if self.readme else "")


def _example(name: str) -> str:
    return str(REPO_ROOT / "examples" / name)


LLAMA, GPT2, HF_LLAMA, HF_GPT2 = (
    _example("llama3.py"),
    _example("gpt2.py"),
    _example("hf_llama.py"),
    _example("hf_gpt2.py"),
)
MLP, CONVNET = _example("mlp.py"), _example("convnet.py")
# a Hugging Face Mixtral of 4 experts, top-2, hidden 64 (transformers' MixtralForCausalLM from a config)
HF_MIXTRAL = str(REPO_ROOT / "tests" / "models" / "tiny_mixtral.py")
LLAMA_MID = str(REPO_ROOT / "bench" / "llama3_mid.py")
CONFIGS = (
    # the README's local examples, as written there (planner optimize ... --run)
    Config(
        "llama3 tiny", LLAMA, None, None, 1, dp=2, readme=True
    ),  # the demo: the planner's choice on 2 ranks
    Config("gpt2 124M", GPT2, None, None, 2, readme=True),
    Config("hf llama", HF_LLAMA, None, None, 2, readme=True),
    Config("llama3 tiny", LLAMA, None, None, 2, pp=2, readme=True),  # 4 ranks on this machine's cores
    Config("gpt2 124M", GPT2, 2, 32, 2, workload="train", readme=True),
    # user models: tiny and mid Llama, GPT-2, HF models, an MLP stack, a conv net
    Config("llama3 tiny", LLAMA, None, None, 1),
    Config("llama3 tiny", LLAMA, None, None, 2),
    Config("llama3 tiny", LLAMA, 4, 32, 1, pp=2),
    Config("llama3 tiny", LLAMA, None, None, 1, workload="train"),
    Config("llama3 tiny", LLAMA, None, None, 2, workload="train"),
    Config("llama3 mid", LLAMA_MID, 1, 128, 1),
    Config("llama3 mid", LLAMA_MID, 1, 128, 2),
    Config("llama3 mid", LLAMA_MID, 2, 64, 1, dp=2, workload="train", dp_style="fsdp"),
    Config("llama3 mid", LLAMA_MID, 2, 64, 1, dp=2, workload="train", dp_style="zero1"),
    Config("gpt2 124M", GPT2, 1, 64, 1),
    Config("gpt2 124M", GPT2, 2, 64, 1, dp=2),
    Config("hf gpt2", HF_GPT2, None, None, 1),
    Config("hf gpt2", HF_GPT2, None, None, 2),
    Config("hf llama", HF_LLAMA, None, None, 1, workload="train"),
    Config("mlp", MLP, 64, None, 1),
    Config("mlp", MLP, 64, None, 2),
    Config("mlp", MLP, 64, None, 1, dp=2, workload="train"),
    Config("convnet", CONVNET, 8, None, 1),
    Config("convnet", CONVNET, 8, None, 1, dp=2),
    Config("convnet", CONVNET, 8, None, 1, workload="train"),
    # long context and mixtures of experts: ring and all-gather context parallelism, expert parallelism
    Config("llama3 tiny", LLAMA, 8, 1024, 1, cp=2, cp_comm_type="ring", workload="train"),
    Config("llama3 tiny", LLAMA, 8, 1024, 1, cp=2, cp_comm_type="allgather", workload="train"),
    Config("hf mixtral", HF_MIXTRAL, 32, 256, 1, dp=2, ep=2),
    Config("hf mixtral", HF_MIXTRAL, 32, 256, 1, dp=2, ep=2, workload="train"),
    # 16-bit on CPU ranks: bf16 elementwise ops and attention cost as much as fp32's or more here
    Config("llama3 tiny", LLAMA, 4, 128, 1, dp=2, dtype="bf16"),
    Config("llama3 tiny", LLAMA, 4, 128, 1, dp=2, workload="train", dtype="bf16"),
    # fp16 training with dynamic loss scaling (the unscale pass and the found-inf all-reduce priced)
    Config("llama3 tiny", LLAMA, 4, 128, 1, dp=2, workload="train", dtype="fp16"),
)


@dataclass
class Payload:
    jobs: list  # runtime.job.RunJob
    threads: int


def run_jobs(ctx: RankContext, payload: Payload) -> list:
    """Rank entry: one compute thread per rank, then `run_rank` for each job on the same process group."""
    from runtime.execute import run_rank  # noqa: PLC0415

    torch.set_num_threads(payload.threads)
    return [run_rank(ctx, job) for job in payload.jobs]


def _cluster(args, console: Console):
    from costmodels.cluster import load_cluster  # noqa: PLC0415
    from planner.cli.workflow import resolve_cluster  # noqa: PLC0415

    if args.cluster:
        return load_cluster(args.cluster, nproc=args.nproc)
    return resolve_cluster(None, args.nproc, recalibrate=args.recalibrate, notify=console.print)


def _single_rank_cluster(args, console: Console):
    """The spec of one process computing alone with THREADS_PER_RANK threads, for the single-rank
    configurations (None with --cluster: a given spec prices every configuration). The nproc-rank spec
    is measured with all ranks busy at once, which on this VM runs each rank up to 2x slower than one
    process alone (bench/README.md): a single-rank run is priced with a spec measured the way it runs.
    Cached in out/bench/ (re-measured with --recalibrate)."""
    if args.cluster:
        return None
    from costmodels.calibrate import calibrate, write_cluster_yaml  # noqa: PLC0415
    from costmodels.cluster import load_cluster  # noqa: PLC0415
    from planner.cli.workflow import probe_roofline  # noqa: PLC0415

    path = REPO_ROOT / "out" / "bench" / f"local-1process-{THREADS_PER_RANK}thread.yaml"
    cached = None if args.recalibrate or not path.exists() else load_cluster(str(path), nproc=1)
    if cached is not None and cached.device.adam_tensor_overhead_s is not None:  # else an older format
        return cached
    console.print(f"measuring this machine with 1 process of {THREADS_PER_RANK} thread(s) too (~30 s)")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_cluster_yaml(
        calibrate(1, threads_per_process=THREADS_PER_RANK, probe_roofline=probe_roofline), path
    )
    return load_cluster(str(path), nproc=1)


def _plans(cluster, configs, prepared: dict | None = None, single=None):
    """A plan per configuration with its mesh pinned, priced on ``cluster`` resized to its ranks
    (on ``single`` for a one-rank configuration, when given). Returns (plans, prepared models by
    (path, batch, seq, workload, dtype), the spec each plan was priced with)."""
    from costmodels.cluster import resize_cluster  # noqa: PLC0415
    from planner.cli.workflow import constraints_from, make_plan, prepare  # noqa: PLC0415

    prepared = {} if prepared is None else prepared
    plans, specs = [], []
    for cfg in configs:
        key = (cfg.model_path, cfg.batch_size, cfg.seq_len, cfg.workload, cfg.dtype)
        if key not in prepared:
            prepared[key] = prepare(
                cfg.model_path, cfg.workload, batch_size=cfg.batch_size, seq_len=cfg.seq_len, dtype=cfg.dtype
            )
        spec = single if single is not None and cfg.ranks == 1 else cluster
        # more ranks than the spec was measured with: resized as `planner optimize --nproc` resizes it
        # (beyond one rank per core, time-shared: `costmodels.cluster.resize_cluster`)
        sized = resize_cluster(spec, cfg.ranks) if cfg.ranks > spec.devices_per_node else spec
        constraints = constraints_from(
            cfg.tp, cfg.pp, cfg.dp, "none", max_devices=cfg.ranks, dp_style=cfg.dp_style,
            cp=cfg.cp, cp_comm_type=cfg.cp_comm_type, ep=cfg.ep,
        )  # fmt: skip
        plans.append(make_plan(prepared[key], sized, constraints, cfg.model_path))
        specs.append(sized)
    return plans, prepared, specs


def _measure(configs, plans, iters: int, warmup: int, min_time_s: float = 0.0, specs=None) -> list[dict]:
    """Run every plan; plans on the same number of ranks share one launch. Returns summarise() dicts.
    With `specs` (each plan's), a plan priced on a calibrated spec times the speed probe beside its
    steps (`RunJob.speed_probe`)."""
    from planner.cli.workflow import probes_speed  # noqa: PLC0415
    from runtime.job import RunJob, summarise  # noqa: PLC0415

    by_size: dict[int, list[int]] = {}
    for i, plan in enumerate(plans):
        by_size.setdefault(plan.num_devices, []).append(i)
    out: list[dict] = [{}] * len(plans)
    for nproc, indices in sorted(by_size.items()):
        jobs = [
            RunJob(
                configs[i].model_path,
                plans[i].to_dict(),
                plans[i].batch_size,
                plans[i].seq_len,
                workload=configs[i].workload,
                warmup=warmup,
                iters=iters,
                min_time_s=min_time_s,
                speed_probe=specs is not None and probes_speed(specs[i]),
            )
            for i in indices
        ]
        per_rank = launch(run_jobs, Payload(jobs, THREADS_PER_RANK), nproc=nproc, timeout_s=900)
        for k, i in enumerate(indices):
            out[i] = summarise([reports[k] for reports in per_rank])
    return out


def _spread(ratios: list[float]) -> str:
    """'median 1.02, worst 1.31, 16 of 22 within 25%' of measured / predicted ratios."""
    worst = max(ratios, key=lambda r: max(r, 1 / r))
    within = sum(1 for r in ratios if 0.8 <= r <= 1.25)
    return f"median {statistics.median(ratios):.2f}, worst {worst:.2f}, {within} of {len(ratios)} within 25%"


def _slower(at_run: dict | None) -> str:
    """'1.93, 0.90': the run's per-node overhead over the calibrated one and the calibrated matmul
    rate over the run's (> 1: the machine was slower than when calibrated)."""
    if not at_run:
        return "-"
    matmul = at_run.get("matmul_ratio")
    return f"{at_run['speed_ratio']:.2f}, " + (f"{matmul:.2f}" if matmul else "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--nproc", type=int, default=2, help="ranks the cluster spec is measured with (default 2)"
    )
    parser.add_argument("--iters", type=int, default=5, help="timed steps per configuration (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument(
        "--min-time",
        type=float,
        default=2.0,
        help="time at least this many seconds per configuration (default 2)",
    )
    parser.add_argument(
        "--cluster", default=None, help="preset or spec YAML (default: this machine, calibrated)"
    )
    parser.add_argument("--recalibrate", action="store_true", help="measure this machine again first")
    parser.add_argument("--only", default=None, help="only configurations whose name contains this")
    parser.add_argument("--components", action="store_true", help="profile each graph term by term too")
    args = parser.parse_args(argv)
    console = Console(width=160)
    load_before = os.getloadavg()
    start = time.perf_counter()
    console.print(f"[bold]Predicted vs measured[/], {machine_line()}")
    cluster = _cluster(args, console)
    dev, link = cluster.device, cluster.intra_node
    console.print(
        f"spec {cluster.name!r}: fp32 {dev.peak_flops_per_s['fp32'] / 1e9:.1f} GFLOP/s, memory "
        f"{dev.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s, per node {(dev.node_overhead_s or 0) * 1e6:.1f} us "
        f"(backward {(dev.backward_node_overhead_s or 0) * 1e6:.1f} us), all-reduce alpha {link.latency_s * 1e6:.0f} us, "
        f"{link.bandwidth_bytes_per_s / 1e9:.2f} GB/s"
    )
    configs = [c for c in CONFIGS if not args.only or args.only in c.name]
    single = _single_rank_cluster(args, console)
    if single is not None:
        d1 = single.device
        console.print(
            f"single-rank spec: fp32 {d1.peak_flops_per_s['fp32'] / 1e9:.1f} GFLOP/s, per node "
            f"{(d1.node_overhead_s or 0) * 1e6:.1f} us (one process alone)"
        )
    plans, prepared, specs = _plans(cluster, configs, single=single)
    runs = _measure(configs, plans, args.iters, args.warmup, args.min_time, specs)
    cores = os.cpu_count() or 1
    table = Table(
        title=f"Step latency, predicted vs measured (median over >= {args.min_time:g} s and >= {args.iters} "
        "steps, slowest rank)"
    )
    for col in (
        "configuration",
        "mesh",
        "predicted",
        "measured (p10-p90)",
        "measured / predicted",
        "slower than calibrated: per node, matmul",
        "measured / predicted at the run's speed",
        "max|diff|",
    ):
        table.add_column(col, justify="left" if col in ("configuration", "mesh") else "right")
    from planner.cli.workflow import at_run_speed  # noqa: PLC0415

    ratios: list[float] = []
    at_speed: list[float] = []
    for cfg, plan, run, spec in zip(configs, plans, runs, specs):
        m = run["measured"]
        ratio = m["latency_s"] / plan.predicted.latency_s
        structure = prepared[(cfg.model_path, cfg.batch_size, cfg.seq_len, cfg.workload, cfg.dtype)].structure
        at_run = at_run_speed(plan, structure, spec, run)
        ratios.append(ratio)
        if at_run:
            at_speed.append(m["latency_s"] / at_run["latency_s"])
        table.add_row(
            cfg.label,
            plan.mesh.label()
            + (f" ep={plan.ep}" if plan.ep > 1 else "")
            + ("" if cfg.ranks <= cores else f" ({cfg.ranks} ranks time-share {cores} cores)"),
            f"{plan.predicted.latency_s * 1e3:.2f} ms",
            f"{m['latency_s'] * 1e3:.2f} ms ({m['latency_p10_s'] * 1e3:.1f}-{m['latency_p90_s'] * 1e3:.1f})",
            f"{ratio:.2f}",
            _slower(at_run),
            f"{m['latency_s'] / at_run['latency_s']:.2f}" if at_run else "-",
            f"{run['numerics']['max_abs_diff']:.1e}" if run["numerics"]["max_abs_diff"] is not None else "-",
        )
    console.print(table)
    load_after = os.getloadavg()
    if ratios:
        console.print(
            f"measured / predicted over {len(ratios)} configurations: {_spread(ratios)} "
            "(goal on a quiet machine: median within 10%, every one within 25%)"
        )
    if at_speed:
        console.print(
            "at the machine's speed during each run (the plan re-priced at the per-node overhead and matmul "
            f"rate the speed probe read beside its steps): {_spread(at_speed)}"
        )
    console.print(
        f"load average (1, 5, 15 min) before {tuple(round(x, 2) for x in load_before)}, after "
        f"{tuple(round(x, 2) for x in load_after)} on {cores} cores; wall {time.perf_counter() - start:.0f} s"
    )
    if args.components:
        _components(console, cluster, prepared, plans, configs)
    return 0


# ---------------------------------------------------------------------------------------------------
# Components: each term of the cost model measured alone


_MATMULS = {"linear", "mm", "addmm", "matmul", "bmm"}
_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_attention_math"}  # fmt: skip
TERMS = ("matmul", "lm_head", "attention", "other", "collectives")


def _category(node, lm_head_node: str | None) -> str | None:
    """Which cost-model term an fx node belongs to (None: not an op). The embedding lookup counts as
    "other" (the cost model prices it with the norms and adds); a vocab-parallel one as a collective."""
    if node.op != "call_function":
        return None
    if getattr(node.target, "__module__", "") == "passes.collectives":
        return "collectives"  # the time spent in them includes waiting for the slower rank
    op = getattr(getattr(node.target, "overloadpacket", None), "__name__", str(node.target))
    if op in _MATMULS:
        return "lm_head" if node.name == lm_head_node else "matmul"
    if op in _ATTENTION:
        return "attention"
    return "other"


def _profile_graph(
    gm, inputs, lm_head_node: str | None, repeats: int
) -> tuple[dict[str, float], dict[str, int]]:
    """Median over `repeats` runs of the wall seconds spent in each term's nodes, and node counts.
    Every run starts after a barrier when a process group exists (ranks time the same forward)."""
    import torch.distributed as dist  # noqa: PLC0415
    import torch.fx as fx  # noqa: PLC0415

    class Timed(fx.Interpreter):
        def run_node(self, n):
            start = time.perf_counter()
            result = super().run_node(n)
            cat = _category(n, lm_head_node)
            if cat is not None:
                self.acc[cat] = self.acc.get(cat, 0.0) + time.perf_counter() - start
            return result

    runs = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            if dist.is_initialized():
                dist.barrier()
            interp = Timed(gm)
            interp.acc = {}
            interp.run(*inputs)
            runs.append(interp.acc)
    runs = runs[1:]  # the first run warms caches and the allocator
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        cat = _category(n, lm_head_node)
        if cat is not None:
            counts[cat] = counts.get(cat, 0) + 1
    return {cat: statistics.median(r.get(cat, 0.0) for r in runs) for cat in counts}, counts


def _model_terms(structure, plan, cluster) -> dict[str, float]:
    """The plan's prediction split into the same terms: matmuls and attention by the roofline of
    `costmodels.compute` (divided by tp where the plan shards them), collectives = the predicted
    exposed communication, other = the rest of the predicted compute (norms, activations, adds,
    embedding)."""
    from costmodels.compute import attention_bytes, attention_flops, linear_bytes, linear_flops, op_time_s  # noqa: PLC0415

    dev, tp = cluster.device, plan.tp
    seqs = plan.batch_size / plan.dp
    tokens, seq = seqs * plan.seq_len, plan.seq_len

    def linear(p) -> float:
        split = plan.splits.get(p.weight)
        shard = tp if split is not None and split.style != "replicate" else 1
        n_in, n_out = p.in_features, p.out_features
        if shard > 1 and split.style == "rowwise":
            n_in /= shard
        elif shard > 1:
            n_out /= shard
        flops = linear_flops(tokens, n_in, n_out, p.bias is not None)
        moved = linear_bytes(tokens, n_in, n_out, "fp32", p.bias is not None)
        return op_time_s(flops, moved, dev, "fp32", "matmul", rows=tokens)  # as `costing` prices it

    terms = dict.fromkeys(TERMS, 0.0)
    for layer in structure.layers:
        for block in (layer.attention, layer.mlp):
            if block is not None:
                terms["matmul"] += sum(linear(p) for p in block.projections)
        a = layer.attention
        if a is not None:
            heads = a.num_heads / (tp if any(p.weight in plan.splits for p in a.projections) else 1)
            terms["attention"] += op_time_s(
                attention_flops(seqs, heads, seq, seq, a.head_dim, True),
                attention_bytes(seqs, heads, heads * a.num_kv_heads / a.num_heads, seq, seq, a.head_dim, "fp32"),
                dev, "fp32", "attention",
            )  # fmt: skip
    if structure.lm_head is not None:
        terms["lm_head"] = linear(structure.lm_head)
    terms["other"] = plan.predicted.compute_s - sum(terms.values())
    terms["collectives"] = plan.predicted.exposed_comm_s
    return terms


@dataclass
class ProfileJob:
    model_path: str
    batch_size: int
    seq_len: int
    plan: dict  # Plan.to_dict()


def _cpu_share(gm, inputs, repeats: int) -> tuple[float, float]:
    """Median (wall seconds, main-thread CPU seconds) of plain forwards. CPU time < wall time is time
    this rank was not computing: descheduled by other load, or blocked in a collective."""
    import torch.distributed as dist  # noqa: PLC0415

    walls, cpus = [], []
    with torch.no_grad():
        for _ in range(repeats):
            if dist.is_initialized():
                dist.barrier()
            wall, cpu = time.perf_counter(), time.thread_time()
            gm(*inputs)
            cpus.append(time.thread_time() - cpu)
            walls.append(time.perf_counter() - wall)
    return statistics.median(walls), statistics.median(cpus)


def _profile_entry(ctx: RankContext, payload: tuple[list[ProfileJob], int]) -> list[tuple[dict, dict, tuple]]:
    """Rank entry: each plan's graph rewritten as `run_rank` does (TP pass), profiled term by term."""
    from passes import collectives  # noqa: PLC0415
    from passes.tensor_parallel import apply_tensor_parallel  # noqa: PLC0415
    from planner.frontend.analysis import analyse  # noqa: PLC0415
    from planner.frontend.capture import capture, flat_inputs  # noqa: PLC0415
    from planner.frontend.modelfile import load_model_file  # noqa: PLC0415
    from planner.plan import Plan  # noqa: PLC0415
    from runtime.mesh import build_rank_groups  # noqa: PLC0415

    jobs, repeats = payload
    torch.set_num_threads(THREADS_PER_RANK)
    out = []
    for job in jobs:
        plan = Plan.from_dict(job.plan)
        groups = build_rank_groups(plan.mesh, "cpu")
        collectives.register_group("tp", groups.group("tp"))
        model_file = load_model_file(job.model_path)
        torch.manual_seed(0)
        model = model_file.build("cpu")
        args, kwargs = model_file.inputs(job.batch_size, job.seq_len)
        if plan.dp > 1:
            args = tuple(a.chunk(plan.dp)[groups.dp_rank] for a in args)  # this replica's sequences
        gm = capture(model, args, kwargs)
        structure = analyse(gm)
        apply_tensor_parallel(gm, plan.splits, groups.tp_rank, plan.tp)
        lm_head = structure.lm_head.node if structure.lm_head is not None else None
        inputs = flat_inputs(args, kwargs)
        terms, counts = _profile_graph(gm, inputs, lm_head, repeats)
        out.append((terms, counts, _cpu_share(gm, inputs, repeats)))
        del gm, model
    return out


def _allreduce_entry(ctx: RankContext, sizes: list[int]) -> list[float]:
    """Rank entry: median time of a lone all-reduce of each size (fp32 elements), after a barrier."""
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(THREADS_PER_RANK)
    out = []
    for numel in sizes:
        x = torch.ones(numel)
        dist.all_reduce(x)
        times = []
        for _ in range(20):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times))
    return out


def _components(
    console: Console, cluster, prepared: dict, all_plans, configs, repeats: int = 3
) -> dict[str, float]:
    """Every configuration's graph profiled node by node, on as many ranks as its plan uses (slowest
    rank per term), beside the cost model's figure for the same term. Returns, per term, the sum over
    configurations of |measured - model| in seconds."""
    from costmodels.comm import Group, all_reduce_time_s  # noqa: PLC0415

    keep = [i for i, c in enumerate(configs) if c.workload == "forward" and all_plans[i].pp == 1]
    CONFIGS = [configs[i] for i in keep]  # noqa: N806 - the forward, unpipelined configurations
    plans = [all_plans[i] for i in keep]
    by_size: dict[int, list[int]] = {}
    for i, plan in enumerate(plans):
        by_size.setdefault(plan.num_devices, []).append(i)
    profiles: list = [None] * len(plans)
    for nproc, indices in sorted(by_size.items()):
        jobs = [
            ProfileJob(CONFIGS[i].model_path, plans[i].batch_size, plans[i].seq_len, plans[i].to_dict())
            for i in indices
        ]
        per_rank = launch(_profile_entry, (jobs, repeats), nproc=nproc, timeout_s=900)
        for k, i in enumerate(indices):
            ranks = [r[k] for r in per_rank]
            slowest = {t: max(m.get(t, 0.0) for m, *_ in ranks) for t in TERMS}
            fastest = {t: min(m.get(t, 0.0) for m, *_ in ranks) for t in TERMS}
            profiles[i] = (slowest, fastest, ranks[0][1], [r[2] for r in ranks])
    table = Table(
        title=f"Components (median of {repeats} profiled forwards; slowest rank, fastest in brackets): "
        "measured vs cost model"
    )
    for col in ("configuration", "term", "ops", "measured", "cost model", "measured / model", "per op"):
        table.add_column(col, justify="left" if col in ("configuration", "term") else "right")
    errors = dict.fromkeys(TERMS, 0.0)
    for cfg, plan, (slowest, fastest, counts, _) in zip(CONFIGS, plans, profiles):
        s = prepared[(cfg.model_path, cfg.batch_size, cfg.seq_len, cfg.workload, cfg.dtype)].structure
        terms = _model_terms(s, plan, cluster)
        label = f"{cfg.name} ({cfg.batch_size} x {cfg.seq_len}) tp={plan.tp} dp={plan.dp}"
        for k, term in enumerate(TERMS):
            n = counts.get(term, 0)
            if n == 0:
                continue
            m, model_s = slowest[term], terms[term]
            errors[term] += abs(m - model_s)
            ranks_text = f" ({fastest[term] * 1e3:.1f})" if plan.num_devices > 1 else ""
            table.add_row(
                label if k == 0 else "", term, str(n), f"{m * 1e3:.1f} ms{ranks_text}", f"{model_s * 1e3:.1f} ms",
                f"{m / model_s:.2f}" if model_s > 0 else "-", f"{m / n * 1e6:.0f} us",
            )  # fmt: skip
    console.print(table)
    share = Table(title="Plain forward per rank: wall time vs main-thread CPU time (thread_time)")
    for col in ("configuration", "rank", "wall", "CPU", "CPU / wall"):
        share.add_column(col, justify="left" if col == "configuration" else "right")
    for cfg, plan, (*_, walls) in zip(CONFIGS, plans, profiles):
        for rank, (wall, cpu) in enumerate(walls):
            share.add_row(
                f"{cfg.name} ({cfg.batch_size} x {cfg.seq_len}) tp={plan.tp} dp={plan.dp}" if rank == 0 else "",
                str(rank), f"{wall * 1e3:.1f} ms", f"{cpu * 1e3:.1f} ms", f"{cpu / wall:.2f}",
            )  # fmt: skip
    console.print(share)
    ar_sizes = sorted({plan.batch_size * plan.seq_len * prepared[(cfg.model_path, cfg.batch_size, cfg.seq_len, cfg.workload, cfg.dtype)].structure.hidden_size
                       for cfg, plan in zip(CONFIGS, plans) if plan.tp > 1})  # fmt: skip
    if ar_sizes:
        tp = max(plan.tp for plan in plans)
        measured = launch(_allreduce_entry, ar_sizes, nproc=tp, timeout_s=120)
        ar = Table(
            title=f"A lone all-reduce of one block output (fp32, {tp} gloo ranks, after a barrier) vs alpha-beta"
        )
        for col in ("bytes", "measured", "cost model", "measured / model"):
            ar.add_column(col, justify="right")
        for k, numel in enumerate(ar_sizes):
            t = max(r[k] for r in measured)
            model_s = all_reduce_time_s(numel * 4, Group(tp, tp), cluster)
            ar.add_row(
                f"{numel * 4 / 2**10:.0f} KiB",
                f"{t * 1e3:.2f} ms",
                f"{model_s * 1e3:.2f} ms",
                f"{t / model_s:.2f}",
            )
        console.print(ar)
    return errors


if __name__ == "__main__":
    sys.exit(main())

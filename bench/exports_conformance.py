"""Exports against the consumers' own parsers: every export of a set of plans, fed to Megatron-Core,
torchtitan (0.2.2 and 0.3.0) and vLLM's argument parsing and validation.

    python bench/exports_conformance.py [--cache DIR] [--plans DIR] [--tools NAME,...] [--json FILE]

1. Plans: `planner optimize` makes each plan of PLANS (Llama-3 8B / 70B / 405B training with TP, PP,
   DP, SP, recomputation and the data-parallel styles: the search's own choice, and ZeRO-1, ZeRO-2
   and HSDP pinned; Llama-3-70B decode at TP=4, TP4 x PP4 and TP2 x PP3), seconds each, into
   CACHE/plans (or read from --plans DIR, files NAME.yaml). Then the context-parallel plans of
   CP_PLANS, derived from planned ones (`planner optimize` has no option for cp): Llama-3 405B at
   TP8 CP16 PP16 DP8 (all-gather, balanced, ZeRO-1), 8B at TP2 CP4 DP2 (ring, not balanced, DDP), 70B
   at TP8 CP2 PP3 DP4 (all-to-all, HSDP).
2. Exports: every format each plan has (megatron, torchtitan for 0.3 and 0.2 for training plans,
   vllm for serving plans), with the warnings the export prints, into CACHE/exports.
3. Tools: each in its own virtual environment under CACHE (default
   ~/.cache/parallel-planner/conformance/), CPU-only: torch 2.13.0's CPU build first, every later
   install constrained to it, and checked afterwards (no `nvidia-*` package, `torch.version.cuda`
   None). Megatron-Core 0.19.2 (Python >= 3.12 by its metadata; its pure-Python files are unpacked
   into a Python 3.11 environment with `typing.override` supplied, the one 3.12 name it imports;
   its compiled dataset helper is left out), torchtitan 0.2.2 and 0.3.0 (each with its own
   dependencies; 0.3.0 with torchao, which its llama3_405b config's float8 LM head imports), vLLM 0.34.0 without its dependencies plus the packages its argument parser
   imports. triton is installed without dependencies where the tool imports it at module load (it
   is a compiler, not a CUDA runtime). The first run downloads about 1 GB, takes about 20 minutes and
   leaves about 10 GB of environments; later runs reuse them (2 minutes).
4. Checks, in each tool's environment (this file run with --check): the export is given to the
   tool's own parser and validation, and what the tool parsed is compared with what the plan says:
   - Megatron-Core: `megatron.training.arguments` `parse_args` (every option known: the parser's
     own `parse_known_args` names the unknown ones) and `validate_args` with the world size of the
     plan, the environment the file exports and the GPU read as Hopper (compute capability 9, the
     plans' H100s); then tp, cp (its size, comm type and load balancing), pp, the data-parallel size
     Megatron derives, micro-batch arithmetic,
     virtual stages and the layers each (virtual) stage builds (its `PipelineParallelLayerLayout`
     or its even split), and the data-parallel style it runs (distributed optimizer, Megatron-FSDP's
     sharding strategy and optimizer instances) against the plan.
   - torchtitan 0.3.0: `ConfigManager().parse_args(["--module", "llama3", "--config", CONFIG,
     *overrides])` (tyro; `Trainer.Config` validation), `ParallelDims.from_config` at the plan's
     world size (cp, and with it its load balancer, K/V exchange and FSDP over the CP ranks), the
     stage list against the module names of the model the config builds (on the
     meta device), gradient-accumulation and pipeline micro-batch arithmetic, the checkpointing
     subcommand, the data-parallel style (shard and replicate degrees, the reshard policy resolved as
     torchtitan's `get_fsdp_reshard_after_forward_policy` does).
   - torchtitan 0.2.2: `ConfigManager().parse_args(["--job.config_file", TOML])` on the exported
     sections plus a `[model]` section, `ParallelDims`, its DDP-with-TP/PP refusal, the stage list
     against the 0.2.2 model's module names, the same arithmetic and data-parallel style, and its
     `maybe_enable_amp`: the precision a step would run in.
   - vLLM 0.34.0: the `vllm serve` parser (`make_arg_parser`), `validate_parsed_serve_args`,
     `EngineArgs.from_cli_args` and `EngineArgs(**ENGINE_ARGS)`, `ParallelConfig`, and the layers
     per pipeline rank from vLLM's `get_pp_indices` under the file's VLLM_PP_LAYER_PARTITION.
5. A table per tool: the fields accepted and rejected, validation, what differs from the plan, and
   the export's warnings (what that version cannot express). Results: bench/README.md.

Not part of the test suite (tests/test_export.py checks the names and values without installs).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = Path.home() / ".cache" / "parallel-planner" / "conformance"
TORCH = (
    "torch==2.13.0"  # the CPU build on this project's machines; every tool's installs are constrained to it
)

# (name, model file, size key of examples/models.py LLAMA_CONFIGS, planner optimize options)
PLANS: list[tuple[str, str, str, list[str]]] = [
    ("llama3_8b_train", "examples/llama3_8b.py", "8b",
     ["--cluster", "h100-ib-2node", "--workload", "train", "--dtype", "bf16", "--batch-size", "16", "--seq-len", "4096"]),
    ("llama3_8b_fp16_train", "examples/llama3_8b.py", "8b",
     ["--cluster", "h100-ib-2node", "--workload", "train", "--dtype", "fp16", "--batch-size", "16", "--seq-len", "4096"]),
    ("llama3_8b_zero1_tp2", "examples/llama3_8b.py", "8b",
     ["--cluster", "h100-ib-2node", "--workload", "train", "--dtype", "bf16", "--batch-size", "16", "--seq-len", "4096",
      "--tp", "2", "--dp-style", "zero1"]),
    ("llama3_8b_zero2", "examples/llama3_8b.py", "8b",
     ["--cluster", "h100-ib-2node", "--workload", "train", "--dtype", "bf16", "--batch-size", "16", "--seq-len", "4096",
      "--dp-style", "zero2"]),
    ("llama3_8b_hsdp_tp2", "examples/llama3_8b.py", "8b",
     ["--cluster", "h100-ib-2node", "--workload", "train", "--dtype", "bf16", "--batch-size", "16", "--seq-len", "4096",
      "--tp", "2", "--dp", "2", "--dp-shard", "4", "--dp-style", "fsdp", "--reshard-after-forward", "on"]),
    ("llama3_8b_tp8_selective", "examples/llama3_8b.py", "8b",
     ["--cluster", "dgx-h100", "--workload", "train", "--dtype", "bf16", "--batch-size", "16", "--seq-len", "4096",
      "--tp", "8", "--dp", "1", "--recompute", "selective"]),
    ("llama3_70b_tp8pp3_full", "examples/llama3_70b.py", "70b",
     ["--cluster", "h100-ib-128node", "--workload", "train", "--dtype", "bf16", "--batch-size", "256",
      "--seq-len", "4096", "--tp", "8", "--pp", "3", "--dp", "4", "--recompute", "full"]),
    ("llama3_405b_train", "examples/llama3_405b.py", "405b",
     ["--cluster", "h100-ib-2048node", "--workload", "train", "--dtype", "bf16", "--batch-size", "2048",
      "--seq-len", "8192"]),
    ("llama3_70b_decode_tp4", "examples/llama3_70b_kv.py", "70b",
     ["--cluster", "dgx-h100", "--workload", "decode", "--context", "4096", "--batch-size", "8", "--dtype", "bf16",
      "--devices", "4"]),
    ("llama3_70b_serve_tp4pp4", "examples/llama3_70b_kv.py", "70b",
     ["--cluster", "h100-ib-2node", "--workload", "decode", "--context", "4096", "--batch-size", "8", "--dtype",
      "bf16", "--tp", "4", "--pp", "4"]),
    ("llama3_70b_serve_tp2pp3", "examples/llama3_70b_kv.py", "70b",
     ["--cluster", "dgx-h100", "--workload", "decode", "--context", "4096", "--batch-size", "8", "--dtype", "bf16",
      "--tp", "2", "--pp", "3", "--devices", "6"]),
    # mixtures of experts (MOE_MODELS: the size key names the example's CONFIG): EP over the data-parallel
    # ranks at TP 1 and at TP 2 (no exact Megatron-Core form: a warning), served with EP over DP and over TP
    ("mixtral_8x7b_ep8_zero1", "examples/mixtral_8x7b.py", "mixtral_8x7b",
     ["--cluster", "h100-ib-128node", "--devices", "64", "--workload", "train", "--batch-size", "256", "--seq-len",
      "4096", "--tp", "1", "--ep", "8", "--dp-style", "zero1"]),
    ("mixtral_8x7b_tp2_ep4", "examples/mixtral_8x7b.py", "mixtral_8x7b",
     ["--cluster", "h100-ib-128node", "--devices", "64", "--workload", "train", "--batch-size", "256", "--seq-len",
      "4096", "--tp", "2", "--ep", "4", "--ep-fold", "dp", "--sequence-parallel", "on", "--dp-style", "zero1"]),
    ("qwen3_30b_a3b_serve_dp8_ep8", "examples/qwen3_30b_a3b.py", "qwen3_30b_a3b",
     ["--cluster", "dgx-h100", "--workload", "generate", "--batch-size", "32", "--seq-len", "2048", "--new-tokens",
      "512", "--ep", "8", "--ep-fold", "dp"]),
    ("qwen3_30b_a3b_serve_tp8_ep8", "examples/qwen3_30b_a3b.py", "qwen3_30b_a3b",
     ["--cluster", "dgx-h100", "--workload", "generate", "--batch-size", "32", "--seq-len", "2048", "--new-tokens",
      "512", "--tp", "8", "--ep", "8", "--ep-fold", "tp"]),
]  # fmt: skip
# the mixture-of-experts examples of PLANS (size key -> examples/<key>.py, its `CONFIG`: models_moe.MoEConfig),
# with the Hugging Face id vLLM would serve; torchtitan's checks build its Llama, so these go to Megatron-Core
# and vLLM only
MOE_MODELS = {"mixtral_8x7b": "mistralai/Mixtral-8x7B-v0.1", "qwen3_30b_a3b": "Qwen/Qwen3-30B-A3B"}

# vLLM 0.34.0 is installed without its dependencies (it pins torch 2.14.0 and CUDA packages); these
# are what its `vllm serve` parser, EngineArgs and ParallelConfig import, within its own pins
# Context-parallel plans derived from planned ones: (name, the PLANS entry it starts from, the fields
# replaced). "mesh" is (tp, cp, pp, dp), the tp of the base plan (its splits); a pp other than the
# base plan's gets the layers split over one stage per rank (the first ones one layer more, 1F1B). The
# base plan's decisions are dropped (their prices are for its own layout).
CP_PLANS: list[tuple[str, str, dict]] = [
    ("llama3_405b_tp8cp16pp16dp8", "llama3_405b_train",
     {"mesh": (8, 16, 16, 8), "seq_len": 131072, "batch_size": 128, "micro_batches": 16, "dp_style": "zero1",
      "dp_shard": 8, "cp_comm_type": "allgather"}),
    ("llama3_8b_tp2cp4_ring_unbalanced", "llama3_8b_zero1_tp2",
     {"mesh": (2, 4, 1, 2), "seq_len": 8192, "batch_size": 16, "micro_batches": 4, "dp_style": "ddp", "dp_shard": 1,
      "overlap_param_gather": False, "cp_comm_type": "ring", "cp_load_balance": False}),
    ("llama3_70b_tp8cp2pp3_hsdp_a2a", "llama3_70b_tp8pp3_full",
     {"mesh": (8, 2, 3, 4), "micro_batches": 16, "dp_style": "fsdp", "dp_shard": 2, "cp_comm_type": "alltoall"}),
]  # fmt: skip
# Plan.cp_comm_type as Megatron-LM's --cp-comm-type (planner.export.megatron.CP_COMM_TYPES)
MEGATRON_CP = {"ring": "p2p", "allgather": "all_gather", "alltoall": "a2a"}

VLLM_VERSION = "0.34.0"
VLLM_PARSER_DEPS = [
    "transformers>=5.16.1,<5.23.0", "huggingface_hub>=2.0.0", "tokenizers>=0.23.3", "safetensors", "pydantic>=2.12",
    "msgspec", "cloudpickle", "psutil", "regex", "cachetools", "pyyaml", "numpy", "requests", "tqdm", "pyzmq",
    "blake3", "py-cpuinfo", "sentencepiece", "protobuf>=5.29.6", "cbor2", "aiohttp>=3.14.4", "openai>=2.25.0",
    "oss-harmony>=0.0.11", "pillow", "pybase64", "uvloop", "fastapi<0.137.0,>=0.133.0", "prometheus_client",
    "partial-json-parser", "xgrammar==0.2.8", "llguidance<1.8.0,>=1.7.0",
]  # fmt: skip


@dataclasses.dataclass
class Tool:
    name: str  # as in the table
    kind: str  # the checker (--check KIND)
    venv: str  # folder under the cache
    export: tuple[str, str]  # (format, torchtitan version or "")
    workloads: tuple[str, ...]  # plans it takes: ("train",) or the serving ones


TOOLS = [
    Tool("Megatron-Core 0.19.2", "megatron", "megatron-core-0.19.2", ("megatron", ""), ("train",)),
    Tool("torchtitan 0.3.0", "torchtitan-0.3", "torchtitan-0.3.0", ("torchtitan", "0.3"), ("train",)),
    Tool("torchtitan 0.2.2", "torchtitan-0.2", "torchtitan-0.2.2", ("torchtitan", "0.2"), ("train",)),
    Tool(
        f"vLLM {VLLM_VERSION}",
        "vllm",
        f"vllm-{VLLM_VERSION}",
        ("vllm", ""),
        ("decode", "generate", "forward"),
    ),
]


# ---------------------------------------------------------------------------------------------
# Environments (run in the project's environment)


def _run(cmd: list[str], **kwargs) -> None:
    print("  $", shlex.join(str(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def _pip(venv: Path, *args: str) -> None:
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args])


def _site_packages(venv: Path) -> Path:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def _check_cpu_only(venv: Path) -> None:
    """Raise when the environment holds a CUDA build of torch or an nvidia-* package."""
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    listed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "freeze"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    nvidia = [line for line in listed.splitlines() if line.lower().startswith("nvidia")]
    if out[1] != "None" or nvidia:
        raise SystemExit(
            f"{venv}: not CPU-only (torch {out[0]}, CUDA {out[1]}, {nvidia}); give a CPU build with --torch "
            "(a wheel path or a requirement your index serves as a CPU build)"
        )


def ensure_venv(tool: Tool, cache: Path, torch_spec: str) -> Path:
    """The tool's environment under `cache`, made once (a `.installed` marker records it)."""
    venv = cache / tool.venv
    marker = venv / ".installed"
    if marker.exists():
        return venv
    print(f"installing {tool.name} into {venv}", flush=True)
    if venv.exists():
        shutil.rmtree(venv)
    _run([sys.executable, "-m", "venv", str(venv)])
    constraints = cache / "cpu-constraints.txt"
    constraints.write_text(f"torch=={_torch_version(torch_spec)}\n")
    _pip(venv, torch_spec, "numpy", "packaging")
    _check_cpu_only(venv)
    c = ["-c", str(constraints)]
    if tool.kind == "megatron":
        # megatron-core 0.19 requires Python >= 3.12 by its metadata; this project's CPU torch is
        # built for 3.11. Its wheel's Python files are unpacked as they are (they compile under 3.11)
        # with typing.override (3.12) supplied; its compiled dataset helper is left out.
        wheels = venv / "wheels"
        _run([str(venv / "bin" / "python"), "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
              "--python-version", "3.12", "-d", str(wheels), "megatron-core==0.19.2"])  # fmt: skip
        site = _site_packages(venv)
        wheel = next(wheels.glob("megatron_core-0.19.2-*.whl"))
        import zipfile  # noqa: PLC0415

        with zipfile.ZipFile(wheel) as z:
            z.extractall(site, [n for n in z.namelist() if not n.endswith(".so")])
        (site / "zz_megatron_py311.pth").write_text(
            'import typing; typing.override = getattr(typing, "override", lambda f: f)\n'
        )
        _pip(venv, "--no-deps", "triton")
    elif tool.kind.startswith("torchtitan"):
        version = tool.venv.split("-")[-1]
        _pip(venv, *c, f"torchtitan=={version}", *(["torchao"] if version == "0.3.0" else []))  # 405B: float8
        _pip(venv, "--no-deps", "triton")
    elif tool.kind == "vllm":
        _pip(venv, "--no-deps", f"vllm=={VLLM_VERSION}")
        _pip(venv, *c, *VLLM_PARSER_DEPS)
    _check_cpu_only(venv)
    marker.write_text(tool.name + "\n")
    return venv


def _torch_version(spec: str) -> str:
    """2.13.0 from 'torch==2.13.0' or a wheel path 'torch-2.13.0+cpu-...whl'."""
    m = re.search(r"(\d+\.\d+\.\d+(?:\+\w+)?)", spec)
    if not m:
        raise SystemExit(f"--torch {spec!r}: no version in it")
    return m.group(1).split("+")[0]


# ---------------------------------------------------------------------------------------------
# Plans and exports (run in the project's environment)


def make_plans(cache: Path, plans_dir: Path | None) -> dict[str, Path]:
    """name -> plan file of PLANS (planned, or read from `plans_dir`) and CP_PLANS (derived)."""
    out = {}
    target = cache / "plans"
    target.mkdir(parents=True, exist_ok=True)
    for name, model, _, options in PLANS:
        if plans_dir is not None and (plans_dir / f"{name}.yaml").exists():
            out[name] = plans_dir / f"{name}.yaml"
            continue
        path = target / f"{name}.yaml"
        cmd = [sys.executable, "-m", "planner.cli.main", "optimize", model, *options, "--out", str(path)]
        print("  $", shlex.join(["planner", *cmd[3:]]), flush=True)
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"planning {name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        out[name] = path
    for name, base, changes in CP_PLANS:
        if plans_dir is not None and (plans_dir / f"{name}.yaml").exists():
            out[name] = plans_dir / f"{name}.yaml"
            continue
        out[name] = target / f"{name}.yaml"
        derive_cp_plan(out[base], changes).to_yaml(out[name])
    return out


def derive_cp_plan(base: Path, changes: dict):
    """The plan in `base` with `changes` (a CP_PLANS entry's) made, validated."""
    from planner.plan import MeshShape, Plan, Schedule  # noqa: PLC0415

    plan = Plan.from_yaml(base)
    fields = dict(changes)
    tp, cp, pp, dp = fields.pop("mesh")
    assert tp == plan.tp, "a derived plan keeps its base plan's tp (its splits)"
    fields["mesh"] = MeshShape(tp, pp, dp, cp)
    if pp != plan.pp:
        layers = sorted(layer for stage in plan.stages for layer in stage)
        per, extra = divmod(len(layers), pp)
        sizes = [per + (r < extra) for r in range(pp)]
        starts = [sum(sizes[:r]) for r in range(pp)]
        fields.update(
            stages=[layers[s : s + n] for s, n in zip(starts, sizes)], virtual_stages=1,
            schedule=Schedule.ONE_F_ONE_B,
        )  # fmt: skip
    derived = dataclasses.replace(plan, decisions=[], **fields)
    derived.validate()
    return derived


def plan_facts(plan, size: str) -> dict:
    """What the checkers compare the tools' parse with: the plan's numbers and the model's shape."""
    sys.path.insert(0, str(ROOT / "examples"))
    from models import LLAMA_CONFIGS  # noqa: PLC0415

    from planner.export.common import dp_label, micro_batch_size, num_layers, virtual_stage_layers  # noqa: PLC0415

    if size in MOE_MODELS:
        import importlib  # noqa: PLC0415

        moe = importlib.import_module(size).CONFIG
        model = {"size": size, "hidden": moe.dim, "heads": moe.n_heads, "kv_heads": moe.n_kv_heads,
                 "head_dim": moe.head_dim, "ffn": moe.expert_dim, "vocab": moe.vocab_size, "layers": moe.n_layers,
                 "num_experts": moe.num_experts, "top_k": moe.top_k}  # fmt: skip
    else:
        config = LLAMA_CONFIGS[size]
        model = {"size": size, "hidden": config.dim, "heads": config.n_heads, "kv_heads": config.n_kv_heads,
                 "ffn": config.ffn_dim, "vocab": config.vocab_size, "layers": config.n_layers}  # fmt: skip
    facts = {
        "tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "devices": plan.num_devices, "workload": str(plan.workload),
        "cp": plan.cp, "cp_comm_type": plan.cp_comm_type, "cp_load_balance": plan.cp_load_balance,
        "batch_size": plan.batch_size, "micro_batches": plan.micro_batches, "virtual_stages": plan.virtual_stages,
        "seq_len": plan.seq_len, "layers": num_layers(plan), "dtype": plan.dtype,
        "loss_scale": plan.loss_scale, "experts_on_sequence_shard": plan.experts_on_sequence_shard,
        "sequence_parallel": bool(plan.sequence_parallel and plan.tp > 1),
        "dp_style": str(plan.dp_style), "dp_shard": plan.dp_shard, "dp_replicate": plan.dp_replicate,
        "reshard_after_forward": plan.reshard_after_forward, "dp_label": dp_label(plan),
        "recompute": sorted({str(v) for v in plan.recompute.values()}) if plan.recompute else [],
        "schedule": str(plan.schedule), "stages": [len(s) for s in plan.stages],
        "chunk_layers": [len(c) for c in virtual_stage_layers(plan)],
        "model": model, "ep": plan.ep, "ep_fold": plan.ep_fold, "num_experts": plan.num_experts,
    }  # fmt: skip
    if plan.workload.value == "train":
        facts["micro_batch_size"] = micro_batch_size(plan)
    return facts


def make_exports(cache: Path, plans: dict[str, Path]) -> dict[str, list[dict]]:
    """tool kind -> its job items (plan, export file, facts, warnings)."""
    from planner.export import export_plan  # noqa: PLC0415
    from planner.plan import Plan  # noqa: PLC0415

    sizes = {name: size for name, _, size, _ in PLANS}
    sizes.update({name: sizes[base] for name, base, _ in CP_PLANS})
    jobs: dict[str, list[dict]] = {t.kind: [] for t in TOOLS}
    for name, path in plans.items():
        plan = Plan.from_yaml(path)
        facts = plan_facts(plan, sizes[name])
        folder = cache / "exports" / name
        folder.mkdir(parents=True, exist_ok=True)
        for tool in TOOLS:
            if facts["workload"] not in tool.workloads:
                continue
            if sizes[name] in MOE_MODELS and tool.kind.startswith("torchtitan"):
                continue  # its checks build torchtitan's Llama (MOE_MODELS)
            fmt, version = tool.export
            model = (
                MOE_MODELS.get(sizes[name], "meta-llama/Llama-3.1-70B-Instruct") if fmt == "vllm" else None
            )
            result = export_plan(plan, fmt, model=model, torchtitan_version=version or "0.3")
            suffix = {"megatron": ".sh", "vllm": ".py"}.get(fmt) or (".toml" if version == "0.2" else ".sh")
            file = folder / f"{tool.venv}{suffix}"
            file.write_text(result.text)
            jobs[tool.kind].append(
                {"plan": name, "file": str(file), "facts": facts, "warnings": result.warnings}
            )
    return jobs


def run_checks(tool: Tool, venv: Path, items: list[dict], cache: Path) -> list[dict]:
    job = cache / f"job-{tool.kind}.json"
    out = cache / f"result-{tool.kind}.json"
    job.write_text(json.dumps(items))
    if out.exists():
        out.unlink()
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTHONPATH")}
    env.update({"CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false", "VLLM_TARGET_DEVICE": "cpu"})
    cmd = [str(venv / "bin" / "python"), str(Path(__file__).resolve()), "--check", tool.kind, "--job", str(job),
           "--result", str(out)]  # fmt: skip
    done = subprocess.run(
        cmd, cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True, timeout=1800
    )
    if not out.exists():
        raise SystemExit(
            f"{tool.name}: the checker wrote no result ({done.returncode}):\n{done.stderr[-4000:]}"
        )
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------
# Checkers (run in each tool's environment; only the standard library and the tool imported)


def _bash_array(file: str, name: str) -> tuple[list[str], dict[str, str]]:
    """The items of bash array `name` after sourcing `file`, and the variables the file exports."""
    script = f'set -e; env -0 > "$1"; source "$2"; printf "%s\\0" "${{{name}[@]}}" > "$3"; env -0 > "$4"'
    with tempfile.TemporaryDirectory() as d:
        paths = [os.path.join(d, n) for n in ("before", "items", "after")]
        subprocess.run(
            ["bash", "-c", script, "bash", paths[0], file, paths[1], paths[2]],
            check=True,
            env={"PATH": "/usr/bin:/bin"},
        )
        read = [Path(p).read_text().split("\0") for p in paths]
    before = dict(x.split("=", 1) for x in read[0] if "=" in x)
    after = dict(x.split("=", 1) for x in read[2] if "=" in x)
    exported = {
        k: v for k, v in after.items() if before.get(k) != v and k not in ("_", "SHLVL", "PWD", "OLDPWD")
    }
    return [x for x in read[1] if x != ""], exported


def _check(name: str, want, got, hint: str | None = None) -> dict:
    """One comparison of the tool's reading with the plan; `hint`: the words of the export warning
    that names this difference where the tool cannot express the plan's choice."""
    return {"what": name, "want": want, "got": got, "ok": want == got, "hint": hint}


def _result(item: dict) -> dict:
    return {"plan": item["plan"], "accepted": False, "fields": [], "checks": [], "error": None, "notes": []}


def _fields_from_argv(argv: list[str]) -> list[tuple[str, list[str]]]:
    """[(option, its values)] of an argv of --options (a flag has no values)."""
    out: list[tuple[str, list[str]]] = []
    for item in argv:
        if item.startswith("-") and not re.fullmatch(r"-\d+", item):
            out.append((item, []))
        elif out:
            out[-1][1].append(item)
    return out


# the words of every export warning about a data-parallel style other than the plan's
# (planner.export.common.NOT_PRICED; the checkers import only the standard library and the tool)
DP_HINT = "not what the plan priced"


def _dp_label(shard: int, replicate: int, reshard: bool) -> str:
    """A data-parallel layout in the planner's labels (planner.export.common.dp_label)."""
    if shard == 1:
        return "ddp"
    return ("fsdp" if replicate == 1 else f"hsdp {shard}x{replicate}") + ("" if reshard else "-noreshard")


def _megatron_dp_label(args) -> str:
    """The data-parallel style Megatron-LM runs for parsed `args`, in the planner's labels: its DDP or
    distributed optimizer, or Megatron-FSDP's --data-parallel-sharding-strategy (which reshards after
    forward) over dp x cp / --num-distributed-optimizer-instances ranks (its FSDP groups are the
    data-parallel ones with context parallelism: `mcore_fsdp_adapter`'s `get_data_parallel_group(
    with_context_parallel=True)`, as the plan's shards span the CP ranks)."""
    dp = args.data_parallel_size
    if dp == 1:
        return "ddp"
    if not getattr(args, "use_megatron_fsdp", False):
        return "zero1" if args.use_distributed_optimizer else "ddp"
    strategy = args.data_parallel_sharding_strategy
    instances = args.num_distributed_optimizer_instances
    if strategy in ("no_shard", "optim", "optim_grads"):
        return {"no_shard": "ddp", "optim": "zero1", "optim_grads": "zero2"}[strategy]
    return _dp_label(dp * args.context_parallel_size // instances, instances, True)


def _titan_mesh_checks(facts: dict, dims: object, par: object) -> list[dict]:
    """The checks of torchtitan's parallel dims against the plan's mesh and data-parallel style (both
    releases' ParallelDims)."""
    return [
        _check("tp", facts["tp"], dims.tp),
        _check("cp", facts["cp"], dims.cp),
        _check("pp", facts["pp"], dims.pp),
        _check("dp (replicate x shard)", facts["dp"], dims.dp_replicate * dims.dp_shard),
        _check(
            "data-parallel style",
            facts["dp_label"],
            _titan_dp_label(dims.dp_shard, dims.dp_replicate, par.fsdp_reshard_after_forward, dims.pp),
            DP_HINT,
        ),
    ]


def _titan_cp_checks(facts: dict, dims: object, par: object, training_exchange: str) -> list[dict]:
    """torchtitan's context parallelism against the plan's (cp > 1; both releases): its load
    balancer, the K/V exchange its training steps run (`training_exchange`: neither release's
    training reads a rotate method, both all-gather) and its FSDP over the CP ranks, which a DDP
    plan does not do; each difference a warning names by its hint."""
    if facts["cp"] == 1:
        return []
    return [
        _check(
            "cp load balance", facts["cp_load_balance"], par.context_parallel_load_balancer is not None,
            "cp_load_balance false",
        ),
        _check("cp K/V exchange (training)", facts["cp_comm_type"], training_exchange,
               f"cp_comm_type {facts['cp_comm_type']}"),
        _check("parameters sharded over the CP ranks", facts["dp_label"] != "ddp", dims.cp > 1,
               "torchtitan shards the parameters over the cp"),
    ]  # fmt: skip


def _titan_dp_label(shard: int, replicate: int, policy: str, pp: int) -> str:
    """torchtitan's data-parallel layout in the planner's labels; its reshard policy resolved as its
    get_fsdp_reshard_after_forward_policy does ("default": reshard unless pipeline parallel)."""
    return _dp_label(shard, replicate, {"always": True, "never": False}.get(policy, pp == 1))


def check_megatron(items: list[dict]) -> list[dict]:
    import megatron.training.arguments as margs  # noqa: PLC0415

    margs.get_device_arch_version = lambda: 9  # the plans' H100s (Hopper): validate as on them
    results = []
    for item in items:
        res = _result(item)
        facts = item["facts"]
        m = facts["model"]
        argv, env = _bash_array(item["file"], "PLANNER_MEGATRON_ARGS")
        # the user's own model-size, tokenizer, data and optimizer arguments (README: kept beside ours)
        user = ["--hidden-size", str(m["hidden"]), "--num-attention-heads", str(m["heads"]),
                "--group-query-attention", "--num-query-groups", str(m["kv_heads"]),
                "--ffn-hidden-size", str(m["ffn"]), "--max-position-embeddings", str(facts["seq_len"]),
                "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", str(m["vocab"]), "--mock-data",
                "--lr", "1e-4", "--train-iters", "10"]  # fmt: skip
        if "num_experts" in m:  # a mixture of experts: its router's top-k, expert width and head dim
            user += ["--moe-router-topk", str(m["top_k"]), "--moe-ffn-hidden-size", str(m["ffn"]),
                     "--kv-channels", str(m["head_dim"])]  # fmt: skip
        parser = argparse.ArgumentParser(allow_abbrev=False)
        margs.add_megatron_arguments(parser)
        known, unknown = parser.parse_known_args(user + argv)
        actions = parser._option_string_actions
        for option, values in _fields_from_argv(argv):
            if option in unknown or option not in actions:
                res["fields"].append(
                    {"name": option, "written": values, "ok": False, "note": "unknown option"}
                )
                continue
            parsed = getattr(known, actions[option].dest)
            want = True if not values else values[0]
            got = parsed if isinstance(parsed, bool) or not values else str(parsed)
            if isinstance(parsed, list):  # nargs="+" (--cp-comm-type): every value written
                want, got = values, [str(x) for x in parsed]
            elif (
                isinstance(parsed, float) and values
            ):  # type=float (--initial-loss-scale): "65536" is 65536.0
                with contextlib.suppress(ValueError):
                    want, got = float(values[0]), parsed
            res["fields"].append(
                {"name": option, "written": values, "parsed": str(parsed), "ok": want == got}
            )
        for key, value in env.items():
            res["fields"].append({"name": f"env {key}", "written": [value], "ok": True})
        saved = dict(os.environ)
        try:
            os.environ.update({"WORLD_SIZE": str(facts["devices"]), "RANK": "0", "LOCAL_RANK": "0", **env})
            sys.argv = ["pretrain_gpt.py", *user, *argv]
            args = margs.parse_args()
            margs.validate_args(args, {})
        except (AssertionError, SystemExit, Exception) as e:  # the tool's own refusal, named
            res["error"] = f"{type(e).__name__}: {e}"
            results.append(res)
            continue
        finally:
            os.environ.clear()
            os.environ.update(saved)
        res["accepted"] = all(f["ok"] for f in res["fields"])
        pp = args.pipeline_model_parallel_size
        vpp = args.virtual_pipeline_model_parallel_size or 1
        res["checks"] += [
            _check("tp", facts["tp"], args.tensor_model_parallel_size),
            _check("cp", facts["cp"], args.context_parallel_size),
            _check("pp", facts["pp"], pp),
            _check("dp (derived)", facts["dp"], args.data_parallel_size),
            _check("micro-batch size", facts["micro_batch_size"], args.micro_batch_size),
            _check(
                "micro-batches",
                facts["micro_batches"],
                args.global_batch_size // (args.micro_batch_size * args.data_parallel_size),
            ),  # fmt: skip
            _check("virtual stages", facts["virtual_stages"], vpp),
            _check("sequence parallel", facts["sequence_parallel"], bool(args.sequence_parallel)),
            _check("data-parallel style", facts["dp_label"], _megatron_dp_label(args), DP_HINT),
            _check("bf16", facts["dtype"] == "bf16", bool(args.bf16)),
            _check("fp16", facts["dtype"] == "fp16", bool(args.fp16)),
        ]
        if facts["dtype"] == "fp16" and facts.get("loss_scale") is not None:  # the plan's loss scaling
            dynamic = facts["loss_scale"] == "dynamic"
            res["checks"] += [
                _check("static loss scale", None if dynamic else float(facts["loss_scale"]), args.loss_scale),
                *(
                    [
                        _check("initial loss scale", 65536.0, float(args.initial_loss_scale)),
                        _check("loss-scale window", 2000.0, float(args.loss_scale_window)),
                        _check("hysteresis", 1, args.hysteresis),
                    ]
                    if dynamic
                    else []
                ),
            ]
        if facts["num_experts"]:  # the expert mesh: EP, expert TP 1, the all-to-all dispatcher
            res["checks"] += [
                _check("num experts", facts["num_experts"], args.num_experts),
                _check("expert parallel size", facts["ep"], args.expert_model_parallel_size),
                _check("expert tensor parallel size", 1, args.expert_tensor_parallel_size),
                _check(
                    "expert data-parallel size (folding)",
                    # experts on each TP rank's sequence shard: their gradients reduced over the TP ranks too
                    facts["devices"]
                    // (
                        facts["pp"] * facts["ep"] * (1 if facts["experts_on_sequence_shard"] else facts["tp"])
                    ),
                    facts["devices"]
                    // (
                        args.pipeline_model_parallel_size
                        * args.expert_model_parallel_size
                        * args.expert_tensor_parallel_size
                    ),
                    "experts replicated over the tp",
                ),  # fmt: skip
            ]
            if facts["ep"] > 1:
                res["checks"].append(_check("token dispatcher", "alltoall", args.moe_token_dispatcher_type))
        layout = args.pipeline_model_parallel_layout
        if layout is not None:
            from megatron.core.transformer.enums import LayerType  # noqa: PLC0415
            from megatron.core.transformer.pipeline_parallel_layer_layout import (  # noqa: PLC0415
                PipelineParallelLayerLayout,
            )

            if isinstance(layout, str):
                layout = PipelineParallelLayerLayout(layout, pp)
            chunks = [layout.layout[r][v].count(LayerType.decoder) for v in range(vpp) for r in range(pp)]
        else:
            chunks = [args.num_layers // (pp * vpp)] * (pp * vpp)
        res["checks"].append(_check("layers per (virtual) stage", facts["chunk_layers"], chunks))
        if facts["cp"] > 1:
            res["checks"] += [
                _check("cp comm type", [MEGATRON_CP[facts["cp_comm_type"]]], list(args.cp_comm_type)),
                # get_batch_on_this_cp_rank always cuts 2 x cp head-tail chunks
                _check("cp load balance", facts["cp_load_balance"], True, "cp_load_balance false"),
            ]
        recompute = [r for r in facts["recompute"] if r != "none"]
        want = ("full" if "full" in recompute else "selective") if recompute else None
        res["checks"].append(_check("recompute", want, args.recompute_granularity))
        note = f"validated with world size {facts['devices']}, compute capability 9.0"
        if env:  # what the file's environment is for: the same validation without it
            try:
                os.environ.update({"WORLD_SIZE": str(facts["devices"]), "RANK": "0"})
                os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
                margs.validate_args(margs.parse_args(), {})
            except AssertionError as e:
                note += f"; without the file's {', '.join(env)}: AssertionError: {e}"
            finally:
                os.environ.clear()
                os.environ.update(saved)
        res["notes"].append(note)
        results.append(res)
    return results


def _tyro_errors(text: str) -> list[str]:
    return re.findall(r"Unrecognized options?:\s*([^\n│]*)", text)


def _torchtitan_arith(res: dict, facts: dict, local: int, global_: int, mbs: int, dp: int) -> None:
    accumulation = global_ // (local * dp)
    if facts["pp"] > 1:
        res["checks"].append(_check("pipeline micro-batches", facts["micro_batches"], local // mbs))
        res["checks"].append(_check("gradient accumulation steps", 1, accumulation))
    else:
        res["checks"].append(_check("gradient accumulation steps", facts["micro_batches"], accumulation))


def _precision(dtype: str, mixed_param: str) -> str:
    """What a torchtitan step computes in: training.dtype throughout, else the mixed-precision
    parameter dtype over fp32 master weights."""
    if dtype != "float32":
        return f"{dtype} throughout"
    return f"{mixed_param} mixed precision" if mixed_param != "float32" else "float32"


def _want_precision(facts: dict) -> str:
    return {"bf16": "bfloat16 mixed precision", "fp16": "float16 mixed precision"}.get(
        facts["dtype"], "float32"
    )


def _parts_checks(res: dict, facts: dict, parts: list[list[str]] | None, names: set[str], pp: int) -> None:
    if facts["pp"] == 1:
        return
    if not parts:
        res["checks"].append(_check("stage list", "module_fqns_per_model_part", None))
        return
    unknown = [n for part in parts for n in part if n not in names]
    res["checks"].append(_check("stage modules known to the model", [], unknown))
    listed = {n for part in parts for n in part}
    top = sorted({n.split(".")[0] for n in names if n and "." not in n})
    dropped = [n for n in top if n not in listed and not any(x.startswith(n + ".") for x in listed)]
    res["checks"].append(_check("top-level modules on some stage", [], dropped))
    res["checks"].append(_check("stages", len(facts["chunk_layers"]), len(parts)))
    res["checks"].append(
        _check(
            "layers per (virtual) stage",
            facts["chunk_layers"],
            [sum(n.startswith("layers.") for n in p) for p in parts],
        )
    )
    res["checks"].append(_check("stages per rank", facts["virtual_stages"], len(parts) // pp))


def check_torchtitan_03(items: list[dict]) -> list[dict]:
    import torch  # noqa: PLC0415
    import torchtitan.components.quantization.float8 as float8  # noqa: PLC0415
    from torch.distributed.pipelining.schedules import get_schedule_class  # noqa: PLC0415
    from torchtitan.config.manager import ConfigManager  # noqa: PLC0415
    from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: PLC0415

    # the plans' H100s (compute capability 9.0): llama3_405b's registry config converts the LM head to
    # float8, which torchtitan allows from SM89
    float8.has_cuda_capability = lambda major, minor: (9, 0) >= (major, minor)
    results = []
    for item in items:
        res = _result(item)
        facts = item["facts"]
        argv, _ = _bash_array(item["file"], "PLANNER_TORCHTITAN_ARGS")
        base = ["--module", "llama3", "--config", f"llama3_{facts['model']['size']}"]

        def parse(extra: list[str], base: list[str] = base):
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    return ConfigManager().parse_args(base + extra), None
                except SystemExit:
                    return None, err.getvalue() or "SystemExit"
                except Exception as exc:  # noqa: BLE001  (the config's own validation)
                    return None, f"{type(exc).__name__}: {exc}"

        config, error = parse(argv)
        fields = _fields_from_argv([a for a in argv if not a.startswith("activation-checkpoint:")])
        subcommand = argv[-1] if argv and argv[-1].startswith("activation-checkpoint:") else None
        if config is None:
            res["error"] = error if len(error) < 400 else "; ".join(_tyro_errors(error)) or error[-400:]
            for option, values in fields:  # name the rejected fields one by one
                alone, e = parse([option, *values, "--training.disable_cuda_graphs"])
                res["fields"].append({"name": option, "written": values, "ok": alone is not None,
                                      "note": None if alone is not None else "; ".join(_tyro_errors(e or ""))[:200]})  # fmt: skip
            results.append(res)
            continue
        for option, values in fields:
            section, _, key = option[2:].partition(".")
            flag_off = key.startswith("no_")
            got = getattr(getattr(config, section), key.removeprefix("no_"))
            if flag_off:
                ok = got is False
            elif not values:
                ok = got is True
            elif key == "module_fqns_per_model_part":
                ok = got == [v.split(",") for v in values]
            else:
                ok = str(got) == values[0]
            res["fields"].append({"name": option, "written": values, "parsed": str(got)[:80], "ok": ok})
        ac = (
            type(config.activation_checkpoint).__qualname__
            if config.activation_checkpoint is not None
            else "None"
        )
        want_ac = {"none": "None", "full": "FullAC.Config", "selective": "SelectiveAC.Config"}
        res["fields"].append({"name": subcommand, "written": [], "parsed": ac,
                              "ok": want_ac.get((subcommand or ":").split(":")[1]) == ac})  # fmt: skip
        par = config.parallelism
        try:
            dims = ParallelDims.from_config(par, facts["devices"])
        except (AssertionError, ValueError) as e:
            res["error"] = f"ParallelDims: {e}"
            results.append(res)
            continue
        res["accepted"] = all(f["ok"] for f in res["fields"])
        res["checks"] += [
            *_titan_mesh_checks(facts, dims, par),
            _check(
                "sequence parallel",
                facts["sequence_parallel"],
                facts["tp"] > 1 and par.enable_sequence_parallel,
            ),
            # 0.3's parallelize always applies fully_shard (shard degree 1 too): its mixed-precision policy holds
            _check(
                "precision of a step",
                _want_precision(facts),
                _precision(config.training.dtype, config.training.mixed_precision_param),
            ),  # fmt: skip
        ]
        res["checks"] += _titan_cp_checks(facts, dims, par, "allgather")  # FlexAttention's flex_cp_allgather
        _torchtitan_arith(res, facts, config.training.local_batch_size, config.training.global_batch_size,
                          par.pipeline_parallel_microbatch_size, dims.dp_replicate * dims.dp_shard)  # fmt: skip
        if facts["pp"] > 1:
            cls = get_schedule_class(par.pipeline_parallel_schedule)
            looped = not issubclass(cls, torch.distributed.pipelining.schedules.PipelineScheduleSingle)
            res["checks"].append(_check("looped schedule", facts["virtual_stages"] > 1, looped))
            with torch.device("meta"):
                model = config.model_spec.model.build()
            names = {n for n, _ in model.named_modules()}
            _parts_checks(res, facts, par.module_fqns_per_model_part, names, facts["pp"])
        results.append(res)
    return results


def check_torchtitan_02(items: list[dict]) -> list[dict]:
    import tomllib  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class  # noqa: PLC0415
    from torchtitan.config import ConfigManager  # noqa: PLC0415
    from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: PLC0415
    from torchtitan.distributed.utils import maybe_enable_amp  # noqa: PLC0415
    from torchtitan.protocols.train_spec import get_train_spec  # noqa: PLC0415
    from torchtitan.tools.logging import logger  # noqa: PLC0415

    results = []
    for item in items:
        res = _result(item)
        facts = item["facts"]
        text = Path(item["file"]).read_text()
        sections = tomllib.loads(text)
        flavor = facts["model"]["size"].upper()
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
            f.write(f'[model]\nname = "llama3"\nflavor = "{flavor}"\n\n' + text)
            path = f.name
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                config = ConfigManager().parse_args(["--job.config_file", path])
        except (SystemExit, Exception) as e:  # noqa: BLE001
            res["error"] = f"{type(e).__name__}: {e} {err.getvalue()[-300:]}"
            results.append(res)
            continue
        for section, values in sections.items():
            for key, value in values.items():
                got = getattr(getattr(config, section), key, "<unknown>")
                res["fields"].append({"name": f"{section}.{key}", "written": [str(value)[:60]], "parsed": str(got)[:60],
                                      "ok": got == value})  # fmt: skip
        par = config.parallelism
        try:
            dims = ParallelDims(
                dp_shard=par.data_parallel_shard_degree, dp_replicate=par.data_parallel_replicate_degree,
                cp=par.context_parallel_degree, tp=par.tensor_parallel_degree, pp=par.pipeline_parallel_degree,
                ep=par.expert_parallel_degree, etp=par.expert_tensor_parallel_degree, world_size=facts["devices"],
            )  # fmt: skip
        except AssertionError as e:
            res["error"] = f"ParallelDims: {e}"
            results.append(res)
            continue
        if dims.dp_replicate_enabled and not dims.fsdp_enabled and dims.world_size != dims.dp_replicate:
            res["error"] = "RuntimeError: DDP has not supported > 1D parallelism (llama3 parallelize)"
            results.append(res)
            continue
        res["accepted"] = all(f["ok"] for f in res["fields"])
        # the precision a step runs in: torchtitan's own maybe_enable_amp, its warning captured
        logs: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record, logs=logs: logs.append(record.getMessage())  # type: ignore[method-assign]
        logger.addHandler(handler)
        logging.disable(logging.NOTSET)  # the checker mutes the tools' logs; this warning is the point
        try:
            amp = maybe_enable_amp(dims, config.training.mixed_precision_param, "cpu")
        finally:
            logger.removeHandler(handler)
            logging.disable(logging.WARNING)
        mixed = dims.fsdp_enabled or isinstance(amp, torch.autocast)
        step_dtype = _precision(
            config.training.dtype, config.training.mixed_precision_param if mixed else "float32"
        )
        if logs and not mixed:
            res["notes"].append(f"torchtitan logs: {logs[0]}; training.dtype = {config.training.dtype}")
        res["checks"] += [
            *_titan_mesh_checks(facts, dims, par),
            _check(
                "sequence parallel", facts["sequence_parallel"], dims.tp > 1, "always runs sequence parallel"
            ),
            _check("precision of a step", _want_precision(facts), step_dtype, "only through FSDP"),
            # its training steps run PyTorch's default rotate method; context_parallel_rotate_method is read
            # by its validation loop only
            *_titan_cp_checks(facts, dims, par, "allgather"),
        ]
        _torchtitan_arith(res, facts, config.training.local_batch_size, config.training.global_batch_size,
                          par.pipeline_parallel_microbatch_size, dims.dp_replicate * dims.dp_shard)  # fmt: skip
        if facts["pp"] > 1:
            cls = get_schedule_class(par.pipeline_parallel_schedule)
            res["checks"].append(_check("looped schedule", facts["virtual_stages"] > 1,
                                        not issubclass(cls, PipelineScheduleSingle)))  # fmt: skip
            spec = get_train_spec("llama3")
            with torch.device("meta"):
                model = spec.model_cls(spec.model_args[flavor])
            names = {n for n, _ in model.named_modules()}
            _parts_checks(res, facts, par.module_fqns_per_model_part, names, facts["pp"])
        results.append(res)
    return results


def check_vllm(items: list[dict]) -> list[dict]:
    import importlib.util  # noqa: PLC0415

    import vllm  # noqa: PLC0415
    from vllm.config import ParallelConfig  # noqa: PLC0415
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args  # noqa: PLC0415
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: PLC0415

    # vllm/distributed/utils.py (get_pp_indices) loaded by path: the package's __init__ imports the
    # KV-transfer connectors, which need GPU libraries
    spec = importlib.util.spec_from_file_location(
        "vllm_distributed_utils", Path(vllm.__file__).parent / "distributed" / "utils.py"
    )
    dist_utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dist_utils)
    results = []
    for item in items:
        res = _result(item)
        facts = item["facts"]
        exported: dict = {}
        exec(compile(Path(item["file"]).read_text(), item["file"], "exec"), exported)
        argv = shlex.split(exported["SERVE_COMMAND"])
        env = {}
        while argv and "=" in argv[0] and not argv[0].startswith("-"):
            key, value = argv.pop(0).split("=", 1)
            env[key] = value
        parser = FlexibleArgumentParser(prog="vllm")
        serve = parser.add_subparsers(dest="subparser").add_parser("serve")
        make_arg_parser(serve)
        saved = dict(os.environ)
        try:
            os.environ.update(env)
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                args = parser.parse_args(argv[1:])
            validate_parsed_serve_args(args)
            args.model = args.model_tag  # as `vllm serve` does
            engine = EngineArgs.from_cli_args(args)
            EngineArgs(**exported["ENGINE_ARGS"])
            parallel = ParallelConfig(
                tensor_parallel_size=engine.tensor_parallel_size, pipeline_parallel_size=engine.pipeline_parallel_size,
                data_parallel_size=engine.data_parallel_size,
            )  # fmt: skip
            layers = facts["layers"]
            per_rank = [end - start for start, end in
                        (dist_utils.get_pp_indices(layers, r, engine.pipeline_parallel_size) for r in range(facts["pp"]))]  # fmt: skip
        except (SystemExit, Exception) as e:  # noqa: BLE001
            res["error"] = f"{type(e).__name__}: {e} {err.getvalue()[-300:]}"
            results.append(res)
            continue
        finally:
            os.environ.clear()
            os.environ.update(saved)
        for key, value in exported["ENGINE_ARGS"].items():
            got = getattr(engine, key, "<unknown>")
            res["fields"].append({"name": "--" + key.replace("_", "-"), "written": [str(value)], "parsed": str(got),
                                  "ok": str(got) == str(value)})  # fmt: skip
        for key, value in env.items():
            res["fields"].append({"name": f"env {key}", "written": [value], "ok": True})
        res["accepted"] = all(f["ok"] for f in res["fields"])
        res["checks"] += [
            _check(
                "world size (ParallelConfig)",
                facts["devices"],
                parallel.world_size * parallel.data_parallel_size,
            ),
            _check("layers per pipeline rank (get_pp_indices)", facts["stages"], per_rank),
            _check(
                "expert parallel", facts["ep"] > 1, bool(getattr(engine, "enable_expert_parallel", False))
            ),
        ]
        results.append(res)
    return results


CHECKERS = {
    "megatron": check_megatron,
    "torchtitan-0.3": check_torchtitan_03,
    "torchtitan-0.2": check_torchtitan_02,
    "vllm": check_vllm,
}


# ---------------------------------------------------------------------------------------------
# The table


def _warned(check: dict, warnings: list[str]) -> bool:
    """Whether the export's warnings name a difference the tool cannot express."""
    return bool(check.get("hint")) and any(check["hint"] in w for w in warnings)


def _verdict(res: dict) -> str:
    if res["error"]:
        return "rejected"
    bad = [c for c in res["checks"] if not c["ok"]]
    if not res["accepted"]:
        return "rejected"
    return "accepted" if not bad else "accepted, differs from plan"


def render(tool: Tool, results: list[dict], items: list[dict]) -> list[str]:
    warnings = {i["plan"]: i["warnings"] for i in items}
    lines = [f"### {tool.name}", "", "| plan | result | fields accepted | rejected | differs from the plan | export warnings |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for res in results:
        ok = sum(f["ok"] for f in res["fields"])
        rejected = [
            f["name"] + (f" ({f['note']})" if f.get("note") else "") for f in res["fields"] if not f["ok"]
        ]
        if res["error"] and not rejected:
            rejected = [res["error"].replace("\n", " ")[:160]]
        differs = [
            f"{c['what']}: {c['got']} (plan {c['want']}){'' if _warned(c, warnings[res['plan']]) else ' UNWARNED'}"
            for c in res["checks"]
            if not c["ok"]
        ]
        lines.append(
            f"| {res['plan']} | {_verdict(res)} | {ok}/{len(res['fields'])} | {'; '.join(rejected) or '-'} | "
            f"{'; '.join(differs) or '-'} | {len(warnings[res['plan']])} |"
        )
    lines.append("")
    for res in results:
        for w in warnings[res["plan"]]:
            lines.append(f"- {res['plan']}: warning: {w}")
        for n in res["notes"]:
            lines.append(f"- {res['plan']}: {n}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cache", type=Path, default=DEFAULT_CACHE, help="virtual environments, plans, exports"
    )
    parser.add_argument(
        "--plans", type=Path, help="read NAME.yaml plans from this folder (the rest are planned)"
    )
    parser.add_argument("--tools", help="comma-separated kinds: " + ",".join(t.kind for t in TOOLS))
    parser.add_argument(
        "--torch", default=TORCH, help="torch CPU build to install first (requirement or wheel path)"
    )
    parser.add_argument("--json", type=Path, help="write every result as JSON here")
    parser.add_argument("--check", help=argparse.SUPPRESS)  # in a tool's environment: run its checker
    parser.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.check:
        logging.disable(logging.WARNING)
        items = json.loads(args.job.read_text())
        args.result.write_text(json.dumps(CHECKERS[args.check](items), default=str))
        return 0
    sys.path.insert(0, str(ROOT))
    cache = args.cache.expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    chosen = [t for t in TOOLS if not args.tools or t.kind in args.tools.split(",")]
    print("plans:", flush=True)
    plans = make_plans(cache, args.plans)
    jobs = make_exports(cache, plans)
    report: list[str] = []
    everything = {}
    for tool in chosen:
        venv = ensure_venv(tool, cache, args.torch)
        print(f"checking {len(jobs[tool.kind])} exports with {tool.name}", flush=True)
        results = run_checks(tool, venv, jobs[tool.kind], cache)
        everything[tool.name] = results
        report += render(tool, results, jobs[tool.kind])
    print("\n".join(report))
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1, default=str))
    # a refusal, or a difference from the plan that no export warning names, is a failure
    warned = {(i["plan"], k): i["warnings"] for k, items in jobs.items() for i in items}
    bad = [
        r
        for tool in chosen
        for r in everything[tool.name]
        if _verdict(r) == "rejected"
        or any(not c["ok"] and not _warned(c, warned[(r["plan"], tool.kind)]) for c in r["checks"])
    ]
    print(
        f"\n{len(bad)} export(s) rejected, or differing from the plan with no export warning naming it"
        if bad
        else "\nevery export accepted; each difference from the plan is named by an export warning"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

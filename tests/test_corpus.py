"""The corpus of model files users bring (tests/corpus/: Hugging Face families, nanoGPT, gpt-fast,
torchtitan), tiny and built from configs, each planned and run at tp=2 on tests/models/fastlink.yaml
(links so fast that the ILP splits every projection):

- the plan splits every layer's attention by heads (q/k/v or the fused qkv column-wise, o row-wise)
  and its MLP column- then row-wise, with no op of a layer falling back to a gather;
- on 2 gloo ranks the Megatron-split model (tests/plans.py, independent of the ILP) computes what the
  unsharded model computes; for the files with a static KV cache, a prefill and greedy decode steps
  give the unsharded model's tokens. Every model runs in ONE launch (spawning ranks costs seconds on
  a 2-core machine); each model's result is its own test case.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from planner.cli import workflow
from planner.frontend.analysis import Role, analyse
from planner.frontend.capture import capture
from planner.frontend.modelfile import load_model_file
from planner.frontend.phases import decode_phase, plan_structure
from tests.plans import fixed_plan

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "corpus"
FASTLINK = str(ROOT / "tests" / "models" / "fastlink.yaml")
TP = 2
REL_TOL = 1e-5  # forward outputs: max |sharded - unsharded| <= REL_TOL x output scale (as test_tp_parity)
# a served request: an 8-token prompt, 4 generated tokens (prefill + 3 decode steps), batch 1
PROMPT, NEW_TOKENS, BATCH = 8, 4, 1
COLWISE_ROLES = {Role.Q, Role.K, Role.V, Role.QKV, Role.UP, Role.GATE}
ROWWISE_ROLES = {Role.O, Role.DOWN}

FILES = sorted(p for p in CORPUS.glob("*.py") if not p.name.startswith("_"))
NAMES = [p.stem for p in FILES]


def _served(name: str) -> bool:
    """A model file with a static KV cache (docs/model-files.md, models with a KV cache): it defines step_inputs."""
    return "def step_inputs(" in (CORPUS / f"{name}.py").read_text()


SERVED = [n for n in NAMES if _served(n)]
FORWARD = [n for n in NAMES if not _served(n)]
# model files (tests/models/) run in the corpus launch at tp=2, with the ops the TP pass gathers their
# attention at (a fallback priced and named; none: the split carried through): either way the run
# computes what the unsharded model computes
GATHERED = {
    "fused_qkv_three_heads": {"aten.reshape"},
    "fused_qkv_permute_select": set(),
    "per_head_rmsnorm": set(),
}


def _path(name: str) -> str:
    return str((ROOT / "tests" / "models" if name in GATHERED else CORPUS) / f"{name}.py")


@functools.cache
def _planned(name: str):
    """(Prepared, Plan) of the planner at tp=2 on fastlink: a forward pass of the example batch, or
    for a served file a decode step after the PROMPT-token prompt."""
    path = str(CORPUS / f"{name}.py")
    if _served(name):
        prepared = workflow.prepare(path, "decode", context=PROMPT, new_tokens=NEW_TOKENS, batch_size=BATCH)
    else:
        prepared = workflow.prepare(path, "forward")
    cluster = workflow.resolve_cluster(FASTLINK, TP)
    return prepared, workflow.make_plan(prepared, cluster, workflow.constraints_from(TP, 1, 1, "none"), path)


def test_corpus_lists_every_family():
    assert len(NAMES) >= 11 and SERVED and FORWARD, NAMES


@pytest.mark.parametrize("name", NAMES)
def test_plan_splits_attention_by_heads_and_the_mlp(name):
    prepared, plan = _planned(name)
    structure = prepared.structure
    assert plan.tp == TP and len(structure.layers) == 2, (plan.mesh, len(structure.layers))
    want, got = {}, {}
    for layer in structure.layers:
        assert layer.attention is not None and layer.mlp is not None, f"layer {layer.index}: {layer}"
        for p in [*layer.attention.projections, *layer.mlp.projections]:
            assert p.role in COLWISE_ROLES | ROWWISE_ROLES, (p.weight, p.role)
            want[p.weight] = "colwise" if p.role in COLWISE_ROLES else "rowwise"
            split = plan.splits.get(p.weight)
            got[p.weight] = str(split.style) if split is not None else "replicated"
    wrong = {w: f"{got[w]}, want {want[w]}" for w in want if got[w] != want[w]}
    assert not wrong, f"projections split otherwise than by heads / Megatron's MLP: {wrong}"
    cores = {c.layer: c.strategy.get("core") for c in plan.predicted.per_layer if c.layer >= 0}
    assert set(cores.values()) == {"head"}, f"attention cores: {cores}"
    in_layers = [
        f"{f.op} at {f.line}"
        for f in plan.fallbacks
        if any(f.node in layer.node_blocks for layer in structure.layers)
    ]
    assert not in_layers, f"ops of a layer that gather their sharded inputs: {in_layers}"


# ------------------------------------------------------------------------------------------ runs


@dataclass
class _Failed:
    """A job that raised on a rank (each rank runs the same job: they fail alike, before a collective)."""

    error: str


def _run_corpus_jobs(ctx, jobs: list) -> list:
    """Rank entry: each job in turn on the same process group; a job that raises is reported, the next
    one runs (so that one model's failure does not hide the others')."""
    from runtime.decode import DecodeJob, run_decode_rank  # noqa: PLC0415
    from runtime.execute import run_rank  # noqa: PLC0415

    out = []
    for job in jobs:
        try:
            out.append(run_decode_rank(ctx, job) if isinstance(job, DecodeJob) else run_rank(ctx, job))
        except Exception as exc:  # noqa: BLE001 - reported per model
            out.append(_Failed(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-4)}"))
    return out


def _forward_job(name: str, directory: str):
    from runtime.job import RunJob  # noqa: PLC0415
    from runtime.reference import write_reference  # noqa: PLC0415

    path = _path(name)
    model_file = load_model_file(path)
    args, kwargs = model_file.inputs()
    structure = analyse(capture(model_file.build("meta"), args, kwargs))
    plan = fixed_plan(structure, path, TP)
    job = RunJob(path, plan.to_dict(), workload="forward", warmup=0, iters=1)
    return replace(job, reference=write_reference(job, directory))


def _decode_job(name: str, directory: str):
    from runtime.decode import DecodeJob, write_decode_reference  # noqa: PLC0415

    path = str(CORPUS / f"{name}.py")
    cache_len = PROMPT + NEW_TOKENS
    _, structure = plan_structure(load_model_file(path), decode_phase(BATCH, PROMPT, cache_len))
    plan = fixed_plan(structure, path, TP)
    job = DecodeJob(path, plan.to_dict(), BATCH, PROMPT, NEW_TOKENS, cache_len, warmup=0, iters=1)
    job.reference = write_decode_reference(job, directory)
    return job


@pytest.fixture(scope="module")
def corpus_runs():
    """{name: the ranks' reports, or the error (str) of making its job or of running it}: every model
    of the corpus in one launch on 2 gloo ranks."""
    from runtime.launch import launch  # noqa: PLC0415

    directory = tempfile.mkdtemp(prefix="corpus-references-")
    results: dict[str, Any] = {}
    jobs, names = [], []
    try:
        for name in [*NAMES, *GATHERED]:
            try:
                make = _decode_job if name in SERVED else _forward_job
                jobs.append(make(name, tempfile.mkdtemp(prefix=f"{name}-", dir=directory)))
                names.append(name)
            except Exception as exc:  # noqa: BLE001 - reported per model
                results[name] = f"making the job: {type(exc).__name__}: {exc}"
        if jobs:
            per_rank = launch(_run_corpus_jobs, jobs, nproc=TP, timeout_s=240)
            for name, reports in zip(names, zip(*per_rank)):
                failed = [r.error for r in reports if isinstance(r, _Failed)]
                results[name] = failed[0] if failed else list(reports)
        yield results
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _reports(corpus_runs: dict, name: str) -> list:
    got = corpus_runs[name]
    if isinstance(got, str):
        pytest.fail(f"{name}: {got}")
    return got


@pytest.mark.slow
@pytest.mark.parametrize("name", FORWARD)
def test_tp2_forward_matches_the_unsharded_model(name, corpus_runs):
    from runtime.job import summarise  # noqa: PLC0415

    s = summarise(_reports(corpus_runs, name))["numerics"]
    assert s["max_abs_diff"] is not None, f"{name}: no outputs compared: {s}"
    assert s["max_abs_diff"] <= REL_TOL * s["output_scale"], f"{name}: {s}"


@pytest.mark.slow
@pytest.mark.parametrize("name", SERVED)
def test_tp2_decode_gives_the_unsharded_models_greedy_tokens(name, corpus_runs):
    from runtime.decode import summarise_decode  # noqa: PLC0415

    reports = _reports(corpus_runs, name)
    n = summarise_decode(reports, "fp32", BATCH, NEW_TOKENS)["numerics"]
    assert n["tokens_identical"] and n["ok"], f"{name}: {n}"
    assert all(len(r.tokens[0]) == NEW_TOKENS for r in reports)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GATHERED))
def test_attention_the_pass_cannot_keep_split_is_gathered_and_matches(name, corpus_runs):
    """A reshape that cannot carry the split of q/k/v (a head cut in two) gathers its input (part by
    part for a fused projection's parts) and runs whole: the plan names and prices it, and the run
    equals the unsharded model. A fused projection's parts unfolded as (B, T, 3, C) permuted and
    indexed (`fused_qkv_permute_select`) are read as parts and stay split: no gather."""
    from passes.verify import verify_plan  # noqa: PLC0415
    from planner.frontend.depth import capture_for_planning  # noqa: PLC0415
    from runtime.job import summarise  # noqa: PLC0415

    model_file = load_model_file(_path(name))
    gm, structure = capture_for_planning(model_file.build("meta"), *model_file.inputs())
    plan = verify_plan(
        gm, structure, fixed_plan(structure, _path(name), TP), workflow.resolve_cluster(FASTLINK, TP)
    )
    lines = {f.line.split(":")[0] for f in plan.fallbacks}
    assert {f.op for f in plan.fallbacks} == GATHERED[name], plan.fallbacks
    assert lines == ({f"{name}.py"} if GATHERED[name] else set()), plan.fallbacks
    s = summarise(_reports(corpus_runs, name))["numerics"]
    assert s["max_abs_diff"] is not None and s["max_abs_diff"] <= REL_TOL * s["output_scale"], f"{name}: {s}"

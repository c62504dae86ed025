"""Sharded data parallelism run as the plan prices it: ZeRO-2, FSDP (ZeRO-3) and HSDP.

Every multi-rank layout runs in one of two launches (2 gloo ranks, 4 gloo ranks): the plan's own
run (`runtime.execute.run_rank`, with its loss, gradient and first-step checks against the unsharded
model), whose reports the tests read. Two jobs of the 2-rank launch run with the gradient mean
deliberately wrong (the sum over the dp ranks, not divided by dp): their checks must fail.
The models are the tiny Llamas of tests/models: tiny_lm.py (4 layers, examples/models' Llama) and
bf16_llama.py (2 layers).
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from rich.console import Console

from costmodels.memory import dp_state_bytes, zero2_unit_bytes
from passes.checkpoint import save_checkpoint
from passes.fsdp import FsdpRuntime, apply_fsdp, load_fsdp_weights
from planner.errors import InputError
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture
from planner.frontend.modelfile import load_model_file
from planner.plan import MeshShape, Schedule
from runtime.data_parallel import Zero2Adam
from runtime.execute import run_rank
from runtime.job import RunJob, summarise
from runtime.launch import RankContext, launch
from runtime.numerics import check_failures
from runtime.reference import compare_gradients
from runtime.run_mode import check_plan_runs
from tests.test_run_modes import _plan

MODELS = Path(__file__).resolve().parent / "models"
LLAMA4, LLAMA2 = "tiny_lm.py", "bf16_llama.py"  # tiny Llamas with 4 and 2 layers
SCALAR = "scalar_param_lm.py"  # 0-dim layer scales, odd widths, tied embedding


def _sharded(
    name: str, style: str, dp: int, shard: int, tp: int = 1, m: int = 1, batch: int = 4, pp: int = 1, **kw
):
    plan = _plan(name, tp=tp, pp=pp, dp=dp, batch_size=batch, workload="train", micro_batches=m)
    return dataclasses.replace(plan, dp_style=style, dp_shard=shard, **kw)


def _job(name: str, plan) -> RunJob:
    return RunJob(
        str(MODELS / name), plan.to_dict(), batch_size=plan.batch_size, seq_len=plan.seq_len,
        workload="train", warmup=0, iters=1,
    )  # fmt: skip


def _identity(self, total: torch.Tensor) -> torch.Tensor:
    return total  # a wrong reduce: the sum over the dp ranks, not their mean


def _run_emitted(ctx: RankContext, folder: str) -> dict:
    """This rank's emitted fsdp module (dp=2, shard 2: the world is the shard group), run as a user's
    program would: forward on its half of the batch, backward of its own loss (the gathers' backward
    takes the mean over the shard group, as DDP and FSDP do)."""
    import torch.distributed as dist  # noqa: PLC0415

    from passes import collectives  # noqa: PLC0415
    from passes.emit import load_rank_module  # noqa: PLC0415

    collectives.register_group("dp_shard", dist.group.WORLD)
    collectives.register_group("dp_replicate", None)
    module = load_rank_module(folder, ctx.rank, ctx.device)
    (tokens,) = load_model_file(MODELS / LLAMA2).inputs(4, 8)[0]
    out = module(tokens.chunk(2)[ctx.rank])
    out.square().mean().backward()
    return {"output": out.detach(), "grads": {n: p.grad for n, p in module.named_parameters()}}


def run_labelled(ctx: RankContext, payload: tuple[list[tuple[str, RunJob, bool]], str | None]) -> dict:
    """Rank entry: run_rank for each (label, job, wrong_mean) in turn; wrong_mean runs the job with
    the gradient reduction not divided by dp (FSDP's and ZeRO-2's); then, given a folder, its
    emitted fsdp modules (`_run_emitted`)."""
    jobs, emitted = payload
    out: dict = {"emitted": _run_emitted(ctx, emitted) if emitted else None}
    for label, job, wrong_mean in jobs:
        if wrong_mean:
            with (
                mock.patch.object(FsdpRuntime, "mean", _identity),
                mock.patch.object(Zero2Adam, "mean", _identity),
            ):
                out[label] = run_rank(ctx, job)
        else:
            out[label] = run_rank(ctx, job)
    return out


TWO_RANK = {  # label: (model, plan kwargs)
    "fsdp": (LLAMA4, dict(style="fsdp", dp=2, shard=2)),
    # 2 micro-batches: each runs its forward and backward before the next (the checked step too), so one
    # micro-batch's gathered units are alive at a time
    "fsdp_no_reshard": (LLAMA4, dict(style="fsdp", dp=2, shard=2, reshard_after_forward=False, m=2, batch=4)),
    "fsdp_m2": (LLAMA2, dict(style="fsdp", dp=2, shard=2, m=2)),
    "fsdp_bf16": (LLAMA2, dict(style="fsdp", dp=2, shard=2, dtype="bf16")),
    "zero2": (LLAMA2, dict(style="zero2", dp=2, shard=2)),
    "zero2_m2": (LLAMA2, dict(style="zero2", dp=2, shard=2, m=2)),
    # bf16 parameters, fp32 gradients reduce-scattered one unit in flight: the working memory's other end
    "zero2_bf16_fp32_overlap": (
        LLAMA2,
        dict(style="zero2", dp=2, shard=2, dtype="bf16", grad_reduce_dtype="fp32", overlap_grad_reduce=True),
    ),
    "fsdp_scalar_param": (SCALAR, dict(style="fsdp", dp=2, shard=2)),  # a 0-dim parameter in each unit
}
FOUR_RANK = {
    "hsdp": (LLAMA4, dict(style="fsdp", dp=4, shard=2)),
    "tp2_fsdp2": (LLAMA2, dict(style="fsdp", dp=2, shard=2, tp=2)),
    "hsdp_m2": (LLAMA2, dict(style="fsdp", dp=4, shard=2, m=2, batch=8)),
}
PIPELINED = {  # pp=2 x dp=2: each stage's (each chunk's) units its own
    "pp2_fsdp2_m2": (LLAMA4, dict(style="fsdp", dp=2, shard=2, pp=2, m=2)),
    "pp2_zero2_m2": (LLAMA4, dict(style="zero2", dp=2, shard=2, pp=2, m=2)),
    "pp2v2_fsdp2_no_reshard": (
        LLAMA4,
        dict(
            style="fsdp",
            dp=2,
            shard=2,
            pp=2,
            m=2,
            reshard_after_forward=False,
            schedule=Schedule.INTERLEAVED_1F1B,
            virtual_stages=2,
            stages=[[0, 2], [1, 3]],
        ),
    ),
}
WRONG = {"fsdp_wrong_mean": (LLAMA2, dict(style="fsdp", dp=2, shard=2)),
         "zero2_wrong_mean": (LLAMA2, dict(style="zero2", dp=2, shard=2))}  # fmt: skip


def _launch(layouts: dict, wrong: dict, nproc: int, emitted: str | None = None) -> dict:
    plans = {label: (name, _sharded(name, **kw)) for label, (name, kw) in {**layouts, **wrong}.items()}
    jobs = [(label, _job(name, plan), label in wrong) for label, (name, plan) in plans.items()]
    reports = launch(run_labelled, (jobs, emitted), nproc=nproc, timeout_s=600)
    out = {label: (plans[label][1], summarise([r[label] for r in reports])) for label, *_ in jobs}
    return {**out, "emitted": [r["emitted"] for r in reports]} if emitted else out


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory) -> dict:
    from planner.cli.emitting import emit_plan  # noqa: PLC0415

    folder = tmp_path_factory.mktemp("fsdp_emit") / "emitted"
    emit_plan(_sharded(LLAMA2, "fsdp", dp=2, shard=2), str(MODELS / LLAMA2), str(folder))
    return _launch(TWO_RANK, WRONG, 2, str(folder))


@pytest.fixture(scope="module")
def four_rank() -> dict:
    return _launch(FOUR_RANK, {}, 4)


@pytest.fixture(scope="module")
def pipelined() -> dict:
    return _launch(PIPELINED, {"pp2_zero2_wrong_mean": PIPELINED["pp2_zero2_m2"]}, 4)


def _assert_matches(label: str, plan, summary: dict) -> None:
    n = summary["numerics"]
    assert not check_failures(n), (label, check_failures(n))
    assert n["loss_diff"] <= n["tolerance_rel"] * n["loss_scale"], (label, n)
    assert n["grad_max_abs_diff"] <= n["tolerance_rel"] * n["grad_scale"], (label, n)
    # every rank compared gradients (each element on the rank that holds its mean) and the first step
    assert all(r["grads_compared"] > 0 for r in summary["ranks"]), (
        label,
        [r["grads_compared"] for r in summary["ranks"]],
    )
    assert n["update_max_abs_diff"] is not None and n["update_max_abs_diff"] <= n["update_tolerance"], (
        label,
        n,
    )
    # one note per distinct rank text: the gathered bytes alive at once are measured on each rank and
    # can differ with the timing of the prefetches
    notes = [x for x in summary["measured"]["notes"] if x.startswith("optimizer:")]
    assert 1 <= len(notes) <= len(summary["ranks"]), notes
    assert all(("ZeRO-2" if plan.dp_style == "zero2" else "fsdp") in note for note in notes), notes


@pytest.mark.slow
def test_zero2_and_fsdp_match_the_unsharded_model_on_two_ranks(two_rank: dict) -> None:
    for label in TWO_RANK:
        _assert_matches(label, *two_rank[label])
    note = next(x for x in two_rank["fsdp"][1]["measured"]["notes"] if x.startswith("optimizer:"))
    assert "sharded over 2 ranks" in note and "again before its backward" in note and "prefetched" in note, (
        note
    )
    note = next(x for x in two_rank["fsdp_bf16"][1]["measured"]["notes"] if x.startswith("optimizer:"))
    assert "fp32 master weights" in note, note


@pytest.mark.slow
def test_hsdp_and_tp_with_fsdp_match_the_unsharded_model_on_four_ranks(four_rank: dict) -> None:
    for label in FOUR_RANK:
        _assert_matches(label, *four_rank[label])
    note = next(x for x in four_rank["hsdp"][1]["measured"]["notes"] if x.startswith("optimizer:"))
    assert "HSDP: 2 replicas" in note, note
    # HSDP: each unit's gradient shard all-reduced over the replicate group, once per micro-batch
    for label in ("hsdp", "hsdp_m2"):
        plan, summary = four_rank[label]
        for r in summary["ranks"]:
            units = r["dp_collectives"]["reduce_scatter"] // plan.micro_batches
            assert r["dp_collectives"]["all_reduce"] == units * plan.micro_batches, (
                label,
                r["dp_collectives"],
            )


@pytest.mark.slow
def test_zero2_and_fsdp_with_pipeline_stages_match_the_unsharded_model(pipelined: dict) -> None:
    """PP2 x FSDP2 and PP2 x ZeRO-2 (2 micro-batches, 1F1B) and interleaved PP2 x v2 x FSDP2: loss, every
    gradient piece and the first step as the unsharded model's; per rank and micro-batch every unit of
    each of its chunks (its layers, and the parameters outside the layers it holds) reduce-scattered
    once and (fsdp) gathered once or twice; a gradient sum not divided by dp fails the check."""
    for label in PIPELINED:
        plan, summary = pipelined[label]
        _assert_matches(label, plan, summary)
        for r in summary["ranks"]:
            c = r["dp_collectives"]
            # 3 units a rank: stage 0 its 2 layers and the embedding, stage 1 its 2 layers and the norm
            # and LM head (interleaved: a layer per chunk, the outside parameters on chunks 0 and 3)
            n = 3
            assert c["reduce_scatter"] == n * plan.micro_batches, (label, c)
            if plan.dp_style == "zero2":
                assert c["all_gather"] == plan.virtual_stages, (label, c)
            else:
                passes = 2 if plan.reshard_after_forward else 1
                assert c["all_gather"] == passes * n * plan.micro_batches, (label, c)
        for held in summary["measured"]["per_rank_state_bytes"]:
            assert held == pytest.approx(summary["measured"]["predicted_state_bytes"], rel=2e-2), (
                label,
                held,
            )
    notes = [
        x for x in pipelined["pp2v2_fsdp2_no_reshard"][1]["measured"]["notes"] if x.startswith("optimizer:")
    ]
    assert all("2 model chunks on this rank" in note for note in notes), notes
    failures = check_failures(pipelined["pp2_zero2_wrong_mean"][1]["numerics"])
    assert any(line.startswith("gradients") for line in failures), failures


@pytest.mark.slow
def test_a_wrong_gradient_reduction_fails_the_check(two_rank: dict) -> None:
    for label in WRONG:
        failures = check_failures(two_rank[label][1]["numerics"])
        assert any(line.startswith("gradients") for line in failures), (label, failures)


def _units(name: str) -> int:
    mf = load_model_file(MODELS / name)
    return len(analyse(capture(mf.build("meta"), *mf.inputs(2, 8))).layers) + 1  # a layer each, the rest


@pytest.mark.slow
def test_collectives_are_issued_where_priced(two_rank: dict, four_rank: dict) -> None:
    """Per step and micro-batch, as `planner.solver.costing.dp_sync_parts` prices them: fsdp gathers
    every unit before its forward and, resharded after forward, again before its backward, and
    reduce-scatters it once; the gathers are prefetched one unit ahead and every prefetch is used;
    zero2 reduce-scatters every unit and all-gathers once (one dtype) after the step."""
    for label, (plan, summary) in {**two_rank, **four_rank}.items():
        if label in WRONG or label == "emitted":
            continue
        units, m = (
            _units(
                SCALAR
                if label == "fsdp_scalar_param"
                else LLAMA4
                if label in ("fsdp", "fsdp_no_reshard", "hsdp")
                else LLAMA2
            ),
            plan.micro_batches,
        )
        for r in summary["ranks"]:
            c = r["dp_collectives"]
            assert c["reduce_scatter"] == units * m, (label, c)
            if plan.dp_style == "zero2":
                assert c["all_gather"] == 1, (label, c)
                continue
            passes = 2 if plan.reshard_after_forward else 1
            assert c["all_gather"] == passes * units * m, (label, c)
            assert c["prefetched"] == passes * (units - 1) * m == c["prefetch_used"], (label, c)
    # resharding frees the gathered units: without it every unit stays gathered to its backward
    on, off = (two_rank[k][1]["ranks"][0]["gathered_peak_bytes"] for k in ("fsdp", "fsdp_no_reshard"))
    mf = load_model_file(MODELS / LLAMA4)
    gm = capture(mf.build("meta"), *mf.inputs(2, 8))
    layout = apply_fsdp(gm, [layer.module_path for layer in analyse(gm).layers], 2, 0)
    sizes = {b.unit: b.padded_numel * 4 for b in layout.buckets}  # fp32
    layer = max(v for k, v in sizes.items() if k)
    assert off == sum(sizes.values()), (off, sizes)
    # the outside unit (embedding to LM head) stays gathered through the forward, beside the layer
    # computing and the one prefetched. A unit's gathered buffer is freed when its last holder lets go
    # (probably the gloo work that filled it, released by gloo's worker thread): on a loaded machine
    # (CI, 2 cores, another pytest worker) one run measured one layer more (outside + 3 layers), as if
    # the backward's first gathers started while the forward's last layer was still held. The bound
    # stays below every unit gathered at once.
    assert sizes[""] + 2 * layer <= on <= sizes[""] + 3 * layer < off, (on, sizes)


@pytest.mark.slow
def test_zero2_holds_the_unsharded_gradients_the_memory_model_prices(two_rank: dict) -> None:
    """ZeRO-2's working memory (`costmodels.memory.zero2_unit_bytes`, in the plan's transient memory):
    the unsharded gradients autograd makes and the flat reduce-scatter buffers, measured on each rank
    as the most bytes of them alive at once (`Zero2Adam.peak_grad_bytes`), equal the price to the
    shards' padding: fp32 without overlap, and bf16 parameters with fp32 gradients and one
    reduce-scatter in flight (twice the bytes of the layer's bf16 gradients more)."""
    from planner.solver.costing import unit_params  # noqa: PLC0415

    mf = load_model_file(MODELS / LLAMA2)
    layer, outside, held = unit_params(analyse(capture(mf.build("meta"), *mf.inputs(2, 8))))
    for label in ("zero2", "zero2_m2", "zero2_bf16_fp32_overlap"):
        plan, summary = two_rank[label]
        priced = zero2_unit_bytes(
            layer, outside, held, plan.dtype, "fp32" if plan.grad_reduce_dtype == "fp32" else None,
            plan.overlap_grad_reduce, 2,
        )  # fmt: skip
        for r in summary["ranks"]:
            assert r["grad_peak_bytes"] == pytest.approx(priced, rel=0.02), (
                label,
                r["grad_peak_bytes"],
                priced,
            )
    fp32, bf16 = (two_rank[k][1]["ranks"][0]["grad_peak_bytes"] for k in ("zero2", "zero2_bf16_fp32_overlap"))
    assert bf16 > 0.75 * fp32  # the fp32 buffers and the one in flight: not half of the fp32 run's


@pytest.mark.slow
def test_each_rank_holds_the_state_the_memory_model_prices(two_rank: dict, four_rank: dict) -> None:
    """The state each rank holds after its first step (parameters, gradients, Adam moments, masters;
    counted tensor by tensor) is `costmodels.memory.dp_state_bytes` of its parameters, to the shards'
    padding and Adam's step counters; the run report shows it beside the prediction."""
    for label, (_, summary) in {**two_rank, **four_rank}.items():
        if label == "emitted":
            continue
        m = summary["measured"]
        for held in m["per_rank_state_bytes"]:
            assert held == pytest.approx(m["predicted_state_bytes"], rel=1e-3), (
                label,
                held,
                m["predicted_state_bytes"],
            )
    # FSDP over 2 ranks holds half of each state; ZeRO-2 the parameters whole
    plan, summary = two_rank["fsdp"]
    params = sum(p.numel() for p in load_model_file(MODELS / LLAMA4).build("meta").parameters())
    assert summary["measured"]["predicted_state_bytes"] == dp_state_bytes(params, "fp32", plan.dp_style, 2)
    assert summary["measured"]["predicted_state_bytes"] == pytest.approx(16 * params / 2)
    from planner.cli.render import render_run  # noqa: PLC0415

    console = Console(file=io.StringIO(), width=200)
    render_run(console, {**summary, "predicted": {"latency_s": 1.0, "peak_memory_bytes": 2**20}})
    text = console.file.getvalue()
    assert "training state / rank (parameters, gradients, Adam)" in text, text
    assert "memory per rank, above start-up (predicted 1.0 MiB each): rank 0" in text, text


@pytest.mark.slow
def test_emitted_fsdp_modules_hold_their_shards_and_train_like_the_unsharded_model(two_rank: dict) -> None:
    """--emit of an fsdp plan: each rank's files hold only its flat shard of each unit; loaded in a
    program of its own (synchronous gathers over the registered "dp_shard" group) the ranks' outputs
    are the unsharded model's, and their shard gradients the mean gradient's halves."""
    mf = load_model_file(MODELS / LLAMA2)
    torch.manual_seed(0)  # emit's seeded init (planner.cli.emitting.SEED)
    model = mf.build("cpu")
    (tokens,) = mf.inputs(4, 8)[0]
    out = model(tokens)
    out.square().mean().backward()
    ranks = two_rank["emitted"]
    assert torch.allclose(torch.cat([r["output"] for r in ranks]), out.detach(), atol=1e-6)
    gm = capture(model, (tokens,), {})
    layout = apply_fsdp(gm, [layer.module_path for layer in analyse(gm).layers], 2, 0)
    grads = dict(model.named_parameters())
    for b in layout.buckets:
        flat = torch.cat([grads[p.fqn].grad.reshape(-1) for p in b.params])
        got = torch.cat([r["grads"][f"fsdp_shard_{b.index}"] for r in ranks])[: b.numel]
        assert torch.allclose(got, flat, atol=1e-7), b.unit
        assert all(r["grads"][f"fsdp_shard_{b.index}"].numel() == b.shard_numel for r in ranks)
    assert all(set(r["grads"]) == {f"fsdp_shard_{b.index}" for b in layout.buckets} for r in ranks)


# ------------------------------------------------------------------ no ranks


def test_fsdp_rewrite_shards_each_layer_and_computes_the_same() -> None:
    """apply_fsdp: one flat shard per unit (a layer each, the rest one more), the ranks' shards
    together the unit's parameters in order; unbound (one rank) the rewritten graph gives the same
    outputs and, through the shards, the same gradients; load_fsdp_weights reads the same shards."""
    mf = load_model_file(MODELS / LLAMA2)
    torch.manual_seed(0)
    model = mf.build("cpu")
    args, kwargs = mf.inputs(2, 8)
    gm = capture(model, args, kwargs)
    units = [layer.module_path for layer in analyse(gm).layers]
    original = dict(gm.named_parameters())
    shards = []
    for rank in range(2):
        g = capture(model, args, kwargs)
        layout = apply_fsdp(g, units, 2, rank)
        assert [b.unit for b in layout.buckets] == ["", "layers.0", "layers.1"]  # forward order
        assert layout.backward_order == [0, 2, 1]  # the LM head first, then the layers from the top
        assert not any(n.op == "get_attr" and str(n.target) in original for n in g.graph.nodes)
        shards.append({n: p.detach() for n, p in g.named_parameters()})
    for b in layout.buckets:
        flat = torch.cat([original[p.fqn].detach().reshape(-1) for p in b.params])
        both = torch.cat([s[f"fsdp_shard_{b.index}"] for s in shards])
        assert torch.equal(both[: flat.numel()], flat) and not both[flat.numel() :].any()
    one = capture(model, args, kwargs)
    apply_fsdp(one, units, 1, 0)
    want, got = gm(*args), one(*args)
    assert torch.equal(got, want)
    want.square().mean().backward()
    got.square().mean().backward()
    for b in layout.buckets:
        grads = torch.cat([original[p.fqn].grad.reshape(-1) for p in b.params])
        assert torch.allclose(one.get_parameter(f"fsdp_shard_{b.index}").grad, grads, atol=1e-7)
    # from a checkpoint: this rank's shards only
    meta = capture(mf.build("meta"), args, kwargs)
    layout = apply_fsdp(meta, units, 2, 1)
    load_fsdp_weights(
        meta, layout, {n: p.detach() for n, p in model.state_dict(keep_vars=True).items()}, {}, 0, 1
    )
    for name, value in meta.named_parameters():
        assert torch.equal(value, shards[1][name]), name


def test_the_gradient_check_fails_a_sharded_gradient_missing_its_division_by_dp(tmp_path) -> None:
    """compare_gradients on sharded gradients (the pieces each rank holds): the mean passes, the sum
    over dp=2 ranks fails, and a check that compared nothing fails too."""
    torch.manual_seed(0)
    model = torch.fx.symbolic_trace(torch.nn.Linear(8, 4))
    model(torch.randn(3, 8)).square().mean().backward()
    save_checkpoint({n: p.grad for n, p in model.named_parameters()}, str(tmp_path / "grads.safetensors"))
    reference = SimpleNamespace(grads=str(tmp_path / "grads.safetensors"), loss_scale_factor=1.0)
    setup = SimpleNamespace(plan=SimpleNamespace(splits={}, tp=1), groups=SimpleNamespace(tp_rank=0))

    def checked(
        scale: float, names: tuple[str, ...] = ("weight", "bias"), wrong: str | None = None
    ) -> list[str]:
        pieces = {"weight": (4, 20), "bias": (0, 4)}  # a piece of each flat gradient, as a rank holds it
        segments = {
            n: [
                (
                    *pieces[n],
                    model.get_parameter(n).grad.reshape(-1)[slice(*pieces[n])]
                    * (scale if wrong in (None, n) else 1.0),
                )
            ]
            for n in names
        }
        report = SimpleNamespace()
        compare_gradients(model, reference, setup, report, segments=segments)
        summary = summarise([_rank_report(report)])
        return check_failures(summary["numerics"])

    assert checked(1.0) == []
    assert any(line.startswith("gradients: max") for line in checked(2.0))  # the dp ranks' sum
    assert any("none compared" in line for line in checked(1.0, names=()))
    # the failure names the parameter whose gradient is furthest off, and the rank holding it
    for wrong in ("weight", "bias"):
        (line,) = [x for x in checked(3.0, wrong=wrong) if x.startswith("gradients")]
        assert f"(worst: '{wrong}' on rank 0)" in line, line


def _rank_report(checked: SimpleNamespace):
    from runtime.job import RankReport  # noqa: PLC0415

    return RankReport(
        rank=0, tp_rank=0, pp_rank=0, latency_samples_s=[1.0], median_s=1.0, peak_memory_bytes=0,
        max_abs_diff=0.0, output_scale=1.0, output_diffs=[0.0], output_scales=[1.0], output_dtype="float32",
        grad_max_abs_diff=checked.grad_max_abs_diff, grad_scale=checked.grad_scale,
        grads_compared=checked.grads_compared, grad_worst=checked.grad_worst,
    )  # fmt: skip


def test_sharded_gradients_with_pipeline_stages_pass_the_run_check() -> None:
    for style in ("zero2", "fsdp"):
        plan = dataclasses.replace(_sharded(LLAMA2, style, dp=2, shard=2, m=2), mesh=MeshShape(1, 2, 2))
        check_plan_runs(plan, "train")  # runs now (tied parameters across stages are refused on the ranks)
        with pytest.raises(InputError, match=rf"plan field 'dp_style' is {style} but the run's workload"):
            check_plan_runs(plan, "forward")
    check_plan_runs(_sharded(LLAMA2, "fsdp", dp=2, shard=2), "train")  # pp == 1 runs


def test_a_gathered_unit_splits_into_its_parameters_with_a_one_pass_backward() -> None:
    """`passes.fsdp._split` hands the gathered flat buffer out as its parameters' views; their
    gradients come back as one flat gradient (the padding and a parameter no gradient reached as
    zeros), made by `_Split` in one pass. Autograd's own backward of the slice views made a zero-filled
    buffer-sized gradient per parameter and summed them: one pass per parameter, which made FSDP
    training steps ~3x slower than priced on CPU (bench/README.md, predict_vs_measure.py)."""
    from passes.fsdp import _split  # noqa: PLC0415

    shapes = [(3, 4), (), (5,), (2, 2)]
    flat = torch.randn(12 + 1 + 5 + 4 + 2, requires_grad=True)  # 2 elements of padding
    views = _split(flat, shapes)
    assert [tuple(v.shape) for v in views] == [tuple(s) for s in shapes]
    assert {type(v.grad_fn).__name__ for v in views} == {"_SplitBackward"}, [v.grad_fn for v in views]
    (views[0] * 2).sum().backward(retain_graph=True)
    expected = torch.zeros_like(flat)
    expected[:12] = 2
    torch.testing.assert_close(flat.grad, expected)
    flat.grad = None
    (views[1] * 3 + views[3].sum()).backward()
    expected = torch.zeros_like(flat)
    expected[12] = 3
    expected[18:22] = 1
    torch.testing.assert_close(flat.grad, expected)
    assert not _split(flat.detach(), shapes)[0].requires_grad  # no autograd without a gradient

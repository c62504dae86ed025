"""What runs is what was planned (issue 13): inputs without a batch dim (kind 2), train mode with
tensor-parallel-aware dropout RNG (kind 4), the planned dtype (kind 5); the distributed optimizer
(ZeRO-1) and the plan fields the runtime refuses (issue 14).

The models in tests/models are small rewrites of the cases in ../shared/cases (nonbatch_bias.py,
dropout_tp.py, bf16_llama.py). Multi-rank tests run 2 gloo ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from passes import rng
from passes.lower import lower_for_rank
from planner.errors import InputError
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture, flat_inputs, input_batch_dims
from planner.frontend.modelfile import load_model_file
from planner.frontend.phases import cast_inputs
from planner.plan import DataParallel, MeshShape, Plan, Prediction, Schedule, SolverInfo
from runtime.data_parallel import DistributedAdam, ReplicatedAdam, args_share, batch_share
from runtime.job import RunJob, set_up_rank, summarise
from runtime.launch import RankContext, launch
from runtime.loss import gathered_output, loss_layout
from runtime.numerics import tolerance_for
from runtime.run_mode import check_plan_runs, seed_dropout_rng, set_run_mode
from tests.parity_entry import run_jobs
from tests.plans import fixed_plan

MODELS = Path(__file__).resolve().parent / "models"
aten = torch.ops.aten


def _plan(name: str, tp: int = 1, pp: int = 1, dp: int = 1, batch_size: int = 4, seq_len: int = 8, **kw):
    """A Megatron-split plan for tests/models/`name` at the given sizes (`tests.plans.fixed_plan`)."""
    model_file = load_model_file(MODELS / name)
    args, kwargs = model_file.inputs(batch_size, seq_len)
    gm = capture(model_file.build("meta"), args, kwargs)
    plan = fixed_plan(analyse(gm), str(MODELS / name), tp, pp=pp, **kw)
    return dataclasses.replace(plan, mesh=MeshShape(tp, pp, dp))


def _job(name: str, plan, **kw) -> RunJob:
    return RunJob(
        str(MODELS / name), plan.to_dict(), batch_size=plan.batch_size, seq_len=plan.seq_len,
        workload=str(plan.workload), warmup=0, iters=1, **kw,
    )  # fmt: skip


def _unsharded(name: str, batch_size: int, seq_len: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The unsharded model on the whole batch, built with the runs' seed (0): what every run must give."""
    model_file = load_model_file(MODELS / name)
    torch.manual_seed(0)
    model = model_file.build("cpu").to(dtype)
    args, kwargs = model_file.inputs(batch_size, seq_len)
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    with torch.no_grad():
        return model(*args, **kwargs).float()


# ------------------------------------------------------------------ kind 2: inputs without a batch dim


def test_batch_dims_are_found_from_the_example_inputs() -> None:
    model_file = load_model_file(MODELS / "nonbatch_bias.py")
    assert input_batch_dims(lambda b: model_file.inputs(b, 8), 4) == (0, None)
    # the batch dim may be any dim, and a flattened (B * T,) input counts
    assert input_batch_dims(lambda b: ((torch.zeros(8, b), torch.zeros(b * 8), torch.zeros(())), {}), 3) == (
        1,
        0,
        None,
    )
    with pytest.raises(InputError, match=r"input 0 has shape \(3, 3\)"):
        input_batch_dims(lambda b: ((torch.zeros(b, b),), {}), 3)


def test_shares_split_batched_inputs_and_keep_the_others_whole() -> None:
    ids, bias = torch.arange(32).view(4, 8), torch.randn(8, 8)
    got_ids, got_bias = batch_share((ids, bias), 2, 1, (0, None))
    assert torch.equal(got_ids, ids[2:]) and got_bias is bias
    (args, kwargs) = args_share((ids,), {"bias": bias}, 4, 3, (0, None))
    assert torch.equal(args[0], ids[3:]) and kwargs["bias"] is bias
    with pytest.raises(ValueError, match="no input has a batch dim"):
        batch_share((bias,), 2, 0, (None,))


def _two_rank_checks(ctx: RankContext, jobs: list[RunJob]) -> dict:
    """The 2-rank checks of this module that share one launch (spawning ranks costs more than them)."""
    return {"runs": run_jobs(ctx, jobs), "zero1": _zero1_steps(ctx)}


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict]:
    """One launch: the runs of an unbatched-bias PP=2 and DP=2 plan (kind 2), a DP=2 training plan
    with the distributed optimizer (issue 14), and the ZeRO-1 optimizer beside plain DP's Adam."""
    # PP=2 with 2 micro-batches: splitting the (8, 8) bias on dim 0 made a (4, 8) mask (a traceback);
    # DP=2 at seq_len 2: a (1, 2) half of the bias broadcast silently (wrong outputs, exit 0)
    pp = _plan("nonbatch_bias.py", pp=2, micro_batches=2)
    dp = _plan("nonbatch_bias.py", dp=2, seq_len=2)
    zero1 = dataclasses.replace(
        _plan("dropout_tp.py", dp=2, batch_size=4, workload="train"), dp_style="zero1", dp_shard=2
    )
    jobs = [
        _job("nonbatch_bias.py", pp, return_output=True),
        _job("nonbatch_bias.py", dp, return_output=True),
        _job("dropout_tp.py", zero1),
    ]
    return launch(_two_rank_checks, jobs, nproc=2, timeout_s=120)


@pytest.mark.slow
def test_pipeline_and_data_parallel_give_an_unbatched_bias_whole(two_rank_results: list[dict]) -> None:
    pp_reports, dp_reports, _ = zip(*(r["runs"] for r in two_rank_results))
    want = _unsharded("nonbatch_bias.py", 4, 8)
    got = pp_reports[1].output  # the last stage holds the pipeline's output
    assert got is not None and torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    want = _unsharded("nonbatch_bias.py", 4, 2)
    got = torch.cat([r.output for r in dp_reports])  # DP replicas in rank order: batch shares 0, 1
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    assert "input 1 (2, 2): no batch dim" in summarise(list(dp_reports))["measured"]["notes"][0]


# ------------------------------------------------------------------ kind 4: train mode, dropout RNG


def test_tp_pass_draws_dropout_on_shards_from_the_sharded_stream() -> None:
    model_file = load_model_file(MODELS / "dropout_tp.py")
    model = set_run_mode(model_file.build("cpu"), "fp32", training=True)
    args, kwargs = model_file.inputs()
    gm = capture(model, args, kwargs)
    plan = _plan("dropout_tp.py", tp=2, batch_size=2, workload="train")
    lowered = lower_for_rank(gm, analyse(gm), plan, 0, training=True).module
    targets = [n.target for n in rng.dropout_nodes(lowered)]
    # per layer: head-parallel attention dropout and the column-parallel hidden dropout are shards
    assert targets.count(rng.tp_scaled_dot_product_attention) == 2
    assert targets.count(rng.tp_dropout) == 2
    # embedding, attention-output and residual dropouts act on replicated values: the default stream
    assert targets.count(aten.dropout.default) == 5
    with rng.dropout_disabled(lowered):
        assert rng.dropout_nodes(lowered) == []
    assert len(rng.dropout_nodes(lowered)) == 9


def _dropout_rng_checks(ctx: RankContext, path: str) -> dict:
    """Per rank: masks of the two streams, and the lowered train-mode model run with and without dropout."""
    plan = _plan("dropout_tp.py", tp=2, batch_size=2, workload="train")
    setup = set_up_rank(ctx, _job("dropout_tp.py", plan))
    torch.manual_seed(setup.seed)  # the weights every rank and the reference build
    model = set_run_mode(setup.model_file.build(str(ctx.device)), plan.dtype, training=True)
    inputs = flat_inputs(setup.args, setup.kwargs)
    with torch.no_grad():
        eval_out = model.eval()(*inputs)
    model.train()
    gm = capture(model, setup.args, setup.kwargs)
    lowered = lower_for_rank(gm, analyse(gm), plan, ctx.rank, training=True).module
    group = setup.groups.group("tp")

    def gathered(x: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(x) for _ in range(2)]
        dist.all_gather(out, x.contiguous(), group=group)
        return out

    seed_dropout_rng(0, setup.groups.pp_rank, setup.groups.tp_rank, ctx.device)
    ones = torch.ones(4096)
    sharded = gathered(rng.tp_dropout(ones, 0.5, True, "tp"))
    replicated = gathered(aten.dropout(ones, 0.5, True))
    layout = loss_layout([lowered], setup.groups.tp_rank, plan.cp)  # training: logits on vocabulary shards
    with torch.no_grad():
        first, second = (gathered_output(lowered(*inputs), layout) for _ in range(2))
        with rng.dropout_disabled(lowered):
            off = gathered_output(lowered(*inputs), layout)
    return {
        "sharded_masks_equal": torch.equal(*sharded),
        "replicated_masks_equal": torch.equal(*replicated),
        "output_sharded": layout.tp is not None,
        "outputs_equal_over_tp": torch.equal(*gathered(first)),
        "dropout_changes_output": not torch.equal(first, second),
        "off_diff": float((off - eval_out).abs().max()),
    }


@pytest.mark.slow
def test_training_runs_in_train_mode_with_tensor_parallel_dropout_rng() -> None:
    results = launch(_dropout_rng_checks, str(MODELS / "dropout_tp.py"), nproc=2, timeout_s=120)
    for r in results:
        assert not r["sharded_masks_equal"], r  # a shard's mask is its own (per-rank stream)
        assert r["replicated_masks_equal"], r  # a replicated value's mask is the same on every rank
        assert r["output_sharded"], r  # the loss runs on the logits' vocabulary shards (runtime.loss)
        assert r["outputs_equal_over_tp"], r  # the whole output the shards make is the same on every rank
        assert r["dropout_changes_output"], r  # the train-mode graph does drop
        assert r["off_diff"] < 1e-5, r  # with dropout off it is the unsharded eval-mode model
    # the run itself: train mode, its numerics checked with dropout off (like with like), and it says so
    plan = _plan("dropout_tp.py", tp=2, batch_size=2, workload="train")
    reports = launch(run_jobs, [_job("dropout_tp.py", plan)], nproc=2, timeout_s=120)
    summary = summarise([r[0] for r in reports])
    assert summary["numerics"]["max_abs_diff"] <= 1e-5 * summary["numerics"]["output_scale"], summary
    assert summary["numerics"]["grad_max_abs_diff"] <= 1e-6, summary
    (note,) = [n for n in summary["measured"]["notes"] if n.startswith("train mode")]
    assert "9 dropout op(s) active" in note and "4 on tensor-parallel shards" in note, note
    assert "numerics checked with dropout off" in note, note


# ------------------------------------------------------------------ kind 5: the planned dtype


def test_model_and_floating_inputs_take_the_plan_dtype() -> None:
    model = set_run_mode(torch.nn.Linear(4, 4), "bf16", training=False)
    assert model.weight.dtype is torch.bfloat16 and not model.training
    (ids, bias), kwargs = cast_inputs((torch.zeros(2, dtype=torch.long), torch.zeros(2)), {}, "bf16")
    assert ids.dtype is torch.long and bias.dtype is torch.bfloat16 and kwargs == {}
    assert tolerance_for("torch.bfloat16") > tolerance_for("float32") > 0


def test_the_plan_dtype_reaches_every_holder_of_a_buffer_and_leaves_complex_ones_alone() -> None:
    """The cast is in place: what else holds a buffer (transformers' StaticCache holds the K/V buffers
    its export wrapper registers) sees the plan's dtype too; `nn.Module.to` replaced them, and a bf16
    run of examples/hf_llama_kv.py failed capture with fp32 keys beside bf16 queries. A complex buffer
    (torchtitan's RoPE freqs_cis) keeps its dtype: `nn.Module.to(float32)` dropped its imaginary part,
    so the fp32 run computed another function than the user's model (checked here on the corpus file)."""
    module = torch.nn.Module()
    module.register_buffer("cache", torch.zeros(2, 3))
    module.register_buffer("freqs", torch.polar(torch.ones(3), torch.arange(3.0)))
    holder = {"keys": module.cache}  # another owner of the same tensor, as a cache object is
    set_run_mode(module, "bf16", training=False)
    assert holder["keys"] is module.cache and holder["keys"].dtype is torch.bfloat16
    assert module.freqs.dtype is torch.complex64 and module.freqs.imag.abs().max() > 0

    model_file = load_model_file(Path(__file__).parent / "corpus" / "torchtitan_llama.py")
    args, kwargs = model_file.inputs()
    torch.manual_seed(0)
    original = model_file.build("cpu").eval()
    with torch.no_grad():
        want = original(*args, **kwargs)
        got = set_run_mode(original, "fp32", training=False)(*args, **kwargs)
    assert torch.equal(got, want)


@pytest.mark.slow
def test_bf16_plan_runs_in_bf16() -> None:
    plan = dataclasses.replace(_plan("bf16_llama.py", tp=2, batch_size=2), dtype="bf16")
    results = launch(run_jobs, [_job("bf16_llama.py", plan, return_output=True)], nproc=2, timeout_s=120)
    report = results[0][0]
    assert report.output.dtype is torch.bfloat16 and report.dtype == "bf16"
    want = _unsharded("bf16_llama.py", 2, 8, torch.bfloat16)
    assert float((report.output.float() - want).abs().max()) <= tolerance_for("bfloat16") * float(
        want.abs().max()
    )


# ------------------------------------------------------------------ issue 14: ZeRO-1, refused plan fields


def _zero1_steps(ctx: RankContext) -> dict:
    """dp=2: three Adam steps with the distributed optimizer beside plain data parallelism, on a model
    with parameters of two dtypes (one flat buffer each, the fp64 one of 4 elements, the fp32 one of 18)."""
    group = dist.group.WORLD
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    model[2].double()
    twin, initial = copy.deepcopy(model), copy.deepcopy(model)
    plain, zero = (
        ReplicatedAdam(list(model.parameters()), group, 2),
        DistributedAdam(list(twin.parameters()), group, 2, ctx.rank),
    )
    data = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(ctx.rank))  # each replica its own
    for x in data:
        for net, opt in ((model, plain), (twin, zero)):
            opt.zero_grad()
            net[2](net[1](net[0](x)).double()).square().mean().backward()
            opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), twin.parameters()))
    moved = min((a - b).abs().max().item() for a, b in zip(model.parameters(), initial.parameters()))
    # bf16 (mixed precision: fp32 masters in both): ZeRO-1 equals plain data parallelism exactly
    half = torch.nn.Linear(5, 3).to(torch.bfloat16)
    half_twin = copy.deepcopy(half)
    pair = (
        ReplicatedAdam(list(half.parameters()), group, 2),
        DistributedAdam(list(half_twin.parameters()), group, 2, ctx.rank),
    )
    for x in data:
        for net, opt in zip((half, half_twin), pair):
            opt.zero_grad()
            net(x.to(torch.bfloat16)).float().square().mean().backward()
            opt.step()
    return {
        "bf16_equal": all(torch.equal(a, b) for a, b in zip(half.parameters(), half_twin.parameters())),
        "bf16_state_fp32": {s.dtype for st in pair[1].adam.state.values() for s in st.values() if s.dim()}
        == {torch.float32},
        "param_diff": diff,
        "moved": moved,
        "state": (plain.state_numel(), zero.state_numel()),
        "owned": sorted(zero.owned_ranges().values()),
    }


@pytest.mark.slow
def test_distributed_optimizer_equals_data_parallel_adam_with_a_dp_share_of_the_state(
    two_rank_results: list[dict],
) -> None:
    steps = [r["zero1"] for r in two_rank_results]
    fp32, fp64 = 5 * 3 + 3, 3 + 1  # elements per dtype: 18 and 4
    for r in steps:
        assert r["param_diff"] <= 1e-6 and r["moved"] > 1e-4, r  # every parameter moved, alike
        assert r["bf16_equal"] and r["bf16_state_fp32"], r
        assert r["state"] == (2 * (fp32 + fp64), 2 * (fp32 // 2 + fp64 // 2)), r  # Adam: 2 per element
    # rank 0 owns the first 9 fp32 elements (weight 0:9) and 2 fp64 (weight 0:2); rank 1 the rest
    assert steps[0]["owned"] == [(0, 2), (0, 9)]
    assert steps[1]["owned"] == [(0, 1), (0, 3), (2, 3), (9, 15)]
    # the plan run: gradients checked where each replica owns the mean (its slice), and it says so
    summary = summarise([r["runs"][2] for r in two_rank_results])
    assert summary["numerics"]["grad_max_abs_diff"] <= 1e-6, summary["numerics"]
    assert summary["numerics"]["loss_diff"] <= 1e-6, summary["numerics"]
    (note,) = [n for n in summary["measured"]["notes"] if n.startswith("optimizer:")]
    assert "distributed optimizer (ZeRO-1)" in note and "reduce-scattered" in note, note
    # the first optimizer step itself (sharded Adam and the parameters' all-gather) is checked too
    n = summary["numerics"]
    assert n["update_max_abs_diff"] is not None and n["update_max_abs_diff"] <= n["update_tolerance"], n


def test_the_first_optimizer_step_is_checked_against_adam_on_the_reference_gradient(tmp_path) -> None:
    """`compare_update`: a correct first Adam step (-lr g / (|g| + eps)) passes far inside the
    tolerance; an update lost on a slice of a parameter (a shard never gathered back) fails it."""
    from types import SimpleNamespace  # noqa: PLC0415

    from passes.checkpoint import save_checkpoint  # noqa: PLC0415
    from runtime.numerics import check_failures  # noqa: PLC0415
    from runtime.reference import compare_update, update_snapshot  # noqa: PLC0415

    torch.manual_seed(0)
    model = torch.fx.symbolic_trace(torch.nn.Linear(8, 4))  # a rank's graph module
    model(torch.randn(3, 8)).square().mean().backward()
    save_checkpoint({n: p.grad for n, p in model.named_parameters()}, str(tmp_path / "grads.safetensors"))
    reference = SimpleNamespace(grads=str(tmp_path / "grads.safetensors"), loss_scale_factor=1.0)
    setup = SimpleNamespace(plan=SimpleNamespace(splits={}, tp=1), groups=SimpleNamespace(tp_rank=0))
    optimizer = SimpleNamespace(  # the interface of runtime.data_parallel's optimizers
        lr=1e-3, fp32_values=lambda: {id(p): (0, p.numel(), p.detach().view(-1)) for p in model.parameters()}
    )
    before = update_snapshot(model, optimizer)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    adam.step()

    def checked() -> dict:
        report = SimpleNamespace(update_max_abs_diff=None, update_tolerance=None)
        compare_update(model, before, optimizer, reference, setup, report)
        return {"tolerance_rel": 1e-4, "update_max_abs_diff": report.update_max_abs_diff,
                "update_tolerance": report.update_tolerance}  # fmt: skip

    good = checked()
    assert good["update_max_abs_diff"] < 1e-6 and not check_failures(good)
    with torch.no_grad():
        model.weight[2:] = before[0]["weight"][2].view(4, 8)[2:]  # rows 2-3 never received their update
    bad = checked()
    assert bad["update_max_abs_diff"] > 5e-4 and "optimizer update" in check_failures(bad)[0]


def test_bf16_parameters_step_through_fp32_master_weights_as_priced() -> None:
    """Mixed precision (the memory model's 16 bytes per parameter): a bf16 model's Adam steps fp32
    master copies with fp32 moments, and the bf16 parameters are the masters rounded; plain fp32 Adam
    on fp32 copies given the same gradients lands on the same masters."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4).to(torch.bfloat16)
    reference = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    mixed, plain = ReplicatedAdam(list(model.parameters()), None, 1), torch.optim.Adam(reference, lr=1e-3)
    for step in range(3):
        mixed.zero_grad()
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        model(x).float().square().mean().backward()
        for ref, p in zip(reference, model.parameters()):
            ref.grad = p.grad.float()
        mixed.step()
        plain.step()
    for ref, p in zip(reference, model.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, ref.detach().to(torch.bfloat16))
    masters = [mixed._masters[id(p)] for p in model.parameters()]
    assert all(torch.equal(m, ref.detach()) for m, ref in zip(masters, reference))
    assert all(s.dtype == torch.float32 for st in mixed.adam.state.values() for s in st.values() if s.dim())
    assert "fp32 master weights" in mixed.note()


def test_plan_fields_the_runtime_cannot_run_are_refused_by_name() -> None:
    zero = Prediction(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    plan = Plan(
        model="m.py", cluster="local-cpu", workload="train", batch_size=4, seq_len=8, context=0, micro_batches=1,
        dtype="fp32", mesh=MeshShape(1, 2, 1), splits={}, stages=[[0], [1]], ladder_layers=[], predicted=zero,
        solver=SolverInfo("fixed", 0.0, 0.0, 0.0, 0),
    )  # fmt: skip
    with pytest.raises(InputError, match="plan field 'micro_batches': the 1f1b schedule needs at least pp=2"):
        check_plan_runs(plan, "forward")
    check_plan_runs(dataclasses.replace(plan, schedule=Schedule.GPIPE), "forward")
    interleaved = dataclasses.replace(plan, schedule=Schedule.INTERLEAVED_1F1B, micro_batches=5)
    with pytest.raises(InputError, match=r"plan field 'micro_batches': the interleaved_1f1b .* = 2"):
        check_plan_runs(interleaved, "train")
    with pytest.raises(InputError, match="plan field 'dp_style' is zero1 but .* forward"):
        check_plan_runs(dataclasses.replace(plan, micro_batches=2, dp_style=DataParallel.ZERO1), "forward")


@pytest.mark.slow
def test_training_micro_batches_without_a_pipeline_accumulate_gradients_as_priced() -> None:
    """pp=1 with m micro-batches: the plan prices m forward/backward passes and one optimizer step;
    the run did one pass over the whole replica batch. It now captures one micro-batch, accumulates
    the gradients of all m (checked: outputs joined, loss, gradients, the first optimizer step) and
    says so, on two DP replicas with the distributed optimizer too."""
    from planner.cli import workflow  # noqa: PLC0415

    model = "examples/llama3.py"
    spec = workflow.resolve_cluster("tests/models/fastlink.yaml", 2)
    for dp in (1, 2):
        prepared = workflow.prepare(model, "train", batch_size=8, seq_len=16, micro_batches=2)
        constraints = workflow.constraints_from(1, 1, dp, "none", distributed_optimizer=dp > 1)
        plan = workflow.make_plan(prepared, spec, constraints, model)
        assert (plan.micro_batches, plan.dp) == (2, dp)
        run = workflow.run_plan(plan, model, dp, iters=1, warmup=0, timeout_s=240)
        n = run["numerics"]
        assert n["outputs"] and n["max_abs_diff"] <= 1e-5 and n["grad_max_abs_diff"] <= 1e-6, n
        assert n["update_max_abs_diff"] <= n["update_tolerance"], n
        assert any(
            "2 micro-batches per step: gradients accumulated" in note for note in run["measured"]["notes"]
        )


def test_a_cp_run_whose_attention_all_ran_gathered_says_cp_split_no_attention() -> None:
    """HF Llama with eager attention (a hand-written softmax(q k^T) v) under --cp 2: every attention op
    ran on the whole sequence after a gather; the note said "context parallelism applied ... 0 attention
    op(s)"; it says first that no attention ran context-parallel and --cp bought nothing."""
    from types import SimpleNamespace  # noqa: PLC0415

    from passes.cp_lower import CpLowering  # noqa: PLC0415
    from runtime.run_mode import lowering_notes  # noqa: PLC0415

    plan = SimpleNamespace(sequence_parallel=False, seq_len=256, recompute={}, expert_tp=1, pp=1)
    gathered = CpLowering(
        cp=2, variant="allgather", load_balance=True, fallbacks=["aten.matmul (model.py:12)"]
    )
    lowered = SimpleNamespace(context_parallel=gathered, expert_parallel=None, recomputed=[])
    notes = lowering_notes(plan, lowered, training=True)
    assert any(
        n.startswith("context parallelism had no attention to split") and "aten.matmul" in n for n in notes
    )
    ran = dataclasses.replace(gathered, attention=["sdpa"], fallbacks=[])
    assert not any(
        "had no attention" in n
        for n in lowering_notes(
            plan, SimpleNamespace(context_parallel=ran, expert_parallel=None, recomputed=[]), training=True
        )
    )


def test_random_draws_beside_dropout_run_at_their_expectation_in_the_check() -> None:
    """tests/models/router_jitter.py draws router jitter (`uniform_(0.9, 1.1)`) and Gaussian noise
    (`randn_like`) in training. Data-parallel or expert-parallel ranks draw other numbers than the
    unsharded reference, so a checked run failed (exit 4, outputs off by 0.69) while the note said
    "no dropout in the graph". Under `dropout_disabled` (the numerics check) each draw now gives its
    expectation, 1 and 0, the same whatever the random state; the timed steps keep drawing (restored
    afterwards), and the run's note names the draws."""
    from runtime.run_mode import dropout_note  # noqa: PLC0415

    module = load_model_file(Path(__file__).parent / "models" / "router_jitter.py").module
    model = module.build_model().train()
    (tokens,) = module.example_inputs()
    gm = capture(model, (tokens,))
    assert {str(n.target) for n in rng.random_nodes(gm)} == {
        "aten.uniform_.default",
        "aten.randn_like.default",
    }
    with rng.dropout_disabled(gm):
        torch.manual_seed(1)
        one = gm(tokens)
        torch.manual_seed(2)
        two = gm(tokens)
    expected = model.eval()(tokens)  # no jitter, no noise: the draws at their expectation
    assert torch.equal(one, two) and torch.allclose(one, expected, atol=1e-6)
    torch.manual_seed(1)
    drawn = gm(tokens)
    assert (drawn - one).abs().max() > 1e-3  # restored: the timed steps draw
    note = dropout_note(gm)
    assert "2 other random draw(s) (aten.uniform_ at router_jitter.py:" in note and "expectation" in note, (
        note
    )


def test_a_run_whose_ranks_would_not_fit_this_machines_memory_is_refused() -> None:
    """`planner run` of a plan whose ranks run on this machine's CPUs counts each rank's predicted peak
    (data-parallel replicas each hold their weights, gradients and optimizer state), not the model's
    shards once: a GPT-2 XL training plan of 4 replicas at 16.6 GiB each started on a 23 GiB machine.
    On GPUs (ranks off the host) only the reference counts."""
    from planner.cli.workflow import check_fits_this_machine  # noqa: PLC0415

    plan = _plan("tiny_lm.py", dp=2, workload="train")
    model_file = load_model_file(MODELS / "tiny_lm.py")
    structure = analyse(capture(model_file.build("meta"), *model_file.inputs(4, 8)))
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    big = dataclasses.replace(
        plan, predicted=dataclasses.replace(plan.predicted, peak_memory_bytes=total / 2)
    )
    with pytest.raises(InputError, match=r"2 rank\(s\) x .* GiB predicted per rank"):
        check_fits_this_machine(big, structure, 2)
    check_fits_this_machine(big, structure, 2, ranks_on_host=False)
    check_fits_this_machine(plan, structure, 2)

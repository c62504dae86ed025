"""fp16 training's loss scaling (`runtime.loss_scaling`, `Plan.loss_scale`, --loss-scale): the plan's
field and flag, its price, the reference's scale, the scaler's skip and back-off on 2 gloo ranks, the
unscaled fp32 gradients Adam steps, runs of every training path in fp16, and the Megatron-LM export."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from costmodels.cluster import load_cluster
from planner.cli.render import training_rows
from planner.errors import InputError
from planner.frontend.modelfile import load_model_file
from planner.plan import DYNAMIC_INIT_SCALE, MeshShape, Plan
from planner.solver import costing
from planner.solver.costing import CostContext
from planner.solver.problem import MeshConfig, WorkloadSpec
from runtime import loss_scaling
from runtime.data_parallel import ReplicatedAdam
from runtime.job import RunJob
from runtime.launch import RankContext, launch
from runtime.loss import LossLayout, output_loss
from runtime.numerics import training_target
from runtime.session import run_job
from tests.cli_in_process import planner_in_process as planner
from tests.planner_fixtures import analysed_llama
from tests.test_run_modes import _plan

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(__file__).resolve().parent / "models"


# ------------------------------------------------------------------ why: fp16 gradients near fp32's


def _output_grad(dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The LM head's gradient of tests/models/fp16_wide_output.py (8 x 128 tokens, 8192 logits each)
    under the runs' loss in `dtype`, the loss times `scale` and the gradient divided by it in fp32."""
    wide = load_model_file(MODELS / "fp16_wide_output.py")
    torch.manual_seed(0)
    model = wide.build("cpu").to(dtype)
    args, _ = wide.inputs(8, 128)
    out = model(*args)
    loss = output_loss(out, training_target(out.detach()), LossLayout())
    assert loss.dtype == torch.float32  # the loss in fp32: times 2**16 it would overflow in fp16
    (loss * scale).backward()
    return model.out.weight.grad.float() / scale


def test_loss_scaling_keeps_fp16_gradients_near_fp32s() -> None:
    """Per-logit gradients of ~1e-7 are fp16 subnormals: unscaled, the head's fp16 gradient is 2.6% of
    its largest element off fp32's; at 2**16 (the dynamic scaler's start), 0.06%."""
    want = _output_grad(torch.float32, 1.0)

    def error(scale: float) -> float:
        return float((_output_grad(torch.float16, scale) - want).abs().max() / want.abs().max())

    assert error(1.0) > 0.01 > 0.002 > error(DYNAMIC_INIT_SCALE)


# ------------------------------------------------------------------ the reference's scale


def test_reference_scale_halves_until_the_gradients_are_finite() -> None:
    tries: list[float] = []
    grad: list[torch.Tensor] = []

    def backward(scale: float) -> None:  # gradients overflow fp16 above a scale of 2**10
        tries.append(scale)
        grad[:] = [(torch.ones(3) * scale * 64.0).half()]

    assert loss_scaling.reference_scale("dynamic", backward, lambda: grad) == 2.0**9
    assert tries == [2.0**k for k in range(16, 8, -1)]
    tries.clear()
    assert loss_scaling.reference_scale(512.0, backward, lambda: grad) == 512.0 and tries == [512.0]
    with pytest.raises(ValueError, match="static loss scale 4096"):
        loss_scaling.reference_scale(4096.0, backward, lambda: grad)
    tries.clear()
    assert loss_scaling.reference_scale(None, backward, lambda: grad) is None and tries == [1.0]
    # a rank holding half the batch (dp 2): checked at twice the scale, the gradients left at the scale
    tries.clear()
    assert loss_scaling.reference_scale("dynamic", backward, lambda: grad, headroom=2) == 2.0**8
    assert tries == [2.0 ** (k + 1) for k in range(16, 7, -1)] + [2.0**8]
    assert float(grad[0][0]) == 2.0**8 * 64.0
    with pytest.raises(ValueError, match="static loss scale 512 times 2"):
        loss_scaling.reference_scale(512.0, backward, lambda: grad, headroom=2)


# ------------------------------------------------------------------ the scaler on 2 gloo ranks


def _scaled_steps(ctx: RankContext, mode: float | str) -> dict:
    """Two ranks, each its own fp16 parameter stepped by `ReplicatedAdam` (dp 1: nothing reduced)
    through one scaler: step 1 rank 1's gradient overflows, step 2 both are finite."""
    torch.manual_seed(ctx.rank)
    p = torch.nn.Parameter(torch.randn(4).half())
    opt = ReplicatedAdam([p], None, 1)
    scaler = loss_scaling.LossScaler(mode, 1024.0, "cpu")
    loss_scaling.attach(opt, scaler)
    out = {"scales": [scaler.scale]}
    for overflow in (ctx.rank == 1, False):
        before = p.detach().clone()
        opt.zero_grad()
        g = torch.full((4,), 3e-5)  # the unscaled gradient
        p.grad = (g * scaler.scale).half()
        if overflow:
            p.grad[0] = float("inf")
        opt.step()
        out.setdefault("master_grad", opt._masters[id(p)].grad.clone())  # step 1's, after the unscale
        out.setdefault("moved", []).append(not torch.equal(before, p.detach()))
        scaler.update()
        out["scales"].append(scaler.scale)
    out["note"] = scaler.note()
    return out


@pytest.mark.parametrize("mode", ["dynamic", 1024.0])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(mode) -> None:
    """The found-inf flag is all-reduced: both ranks skip step 1 (rank 0's gradient was finite) and take
    step 2; dynamic, the scale halves at the overflow; static, it stays. Adam steps the gradient
    divided by the scale, in fp32."""
    results = launch(loss_scaling_entry, mode, nproc=2, timeout_s=60)
    for r in results:
        assert r["moved"] == [False, True]
        want = [1024.0, 512.0, 512.0] if mode == "dynamic" else [1024.0] * 3
        assert r["scales"] == want
        assert "1 of 2 step(s) skipped" in r["note"]
    # rank 0's step-1 gradient (finite) arrived at Adam unscaled, as fp32
    master = results[0]["master_grad"]
    assert master.dtype == torch.float32
    torch.testing.assert_close(master, torch.full((4,), 3e-5), rtol=1e-3, atol=0)


def loss_scaling_entry(ctx: RankContext, mode: float | str) -> dict:
    return _scaled_steps(ctx, mode)


# ------------------------------------------------------------------ plans, flags, prices, exports


def test_the_plan_field_is_checked_and_old_plans_load_without_it(tmp_path) -> None:
    plan = _plan("bf16_llama.py", batch_size=2)
    data = plan.to_dict()
    data.pop("loss_scale")
    assert Plan.from_dict(data).loss_scale is None  # a plan written before the field
    train16 = {**data, "workload": "train", "dtype": "fp16"}
    assert Plan.from_dict({**train16, "loss_scale": "dynamic"}).loss_scale == "dynamic"
    assert Plan.from_dict({**train16, "loss_scale": 1024}).loss_scale == 1024.0
    # the spellings a hand edit reaches for: YAML's off (false), "none", "Dynamic", a number as text
    for written, read in ((False, None), ("none", None), ("Off", None), ("Dynamic", "dynamic"), ("1e4", 1e4)):
        assert Plan.from_dict({**train16, "loss_scale": written}).loss_scale == read, written
    for bad, words in (
        ({**train16, "loss_scale": True}, "true says no scale"),
        ({**train16, "loss_scale": 1e39}, "up to fp32's largest"),
        ({**train16, "loss_scale": "sometimes"}, "is not 'dynamic', a positive number"),
        ({**train16, "loss_scale": 0}, "is not 'dynamic', a positive number"),
        ({**train16, "dtype": "bf16", "loss_scale": "dynamic"}, "loss scaling is for fp16 training"),
        ({**data, "dtype": "fp16", "loss_scale": 8}, "loss scaling is for fp16 training"),
    ):
        with pytest.raises(InputError, match="loss_scale") as raised:
            Plan.from_dict(bad)
        assert words in str(raised.value)
    # the digest of a plan without loss scaling is what it was before the field existed
    assert (
        Plan.from_dict(train16).decisions_digest()
        != Plan.from_dict({**train16, "loss_scale": "dynamic"}).decisions_digest()
    )


def _planned(tmp_path, *flags: str) -> tuple[Plan, str]:
    out = tmp_path / "plan.yaml"
    result = planner(
        "optimize", str(ROOT / "examples" / "llama3.py"), "--batch-size", "4", "--seq-len", "64",
        "--devices", "2", "--dp", "2", "--workload", "train", "--out", str(out), *flags,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return Plan.from_yaml(out), result.stdout + result.stderr


def test_fp16_training_plans_dynamic_loss_scaling_and_prices_it(tmp_path) -> None:
    """--dtype fp16 training plans dynamic loss scaling by default, priced in the optimizer step (the
    unscale pass and the found-inf all-reduce); off plans none and prices none; a number is static;
    bf16 plans none and says the flag had no effect."""
    plan, text = _planned(tmp_path, "--dtype", "fp16")
    assert plan.loss_scale == "dynamic" and "dynamic (from 2^16)" in text
    # the hand-written Megatron plan is priced with the same loss scaling (Megatron-LM's --fp16 scales
    # dynamically by default): its column said "-"; torchtitan has none
    rows = {what: cells for what, *cells in training_rows(plan)}
    assert rows["loss scaling"] == ["dynamic (from 2^16)", "dynamic (from 2^16)", "none in torchtitan"], rows
    # the exports: Megatron-LM's loss-scaling flags; torchtitan (no fp16, no loss scaling) says so
    megatron = planner(
        "export", str(tmp_path / "plan.yaml"), "--to", "megatron", "--out", str(tmp_path / "m.sh")
    )
    assert megatron.returncode == 0 and "--initial-loss-scale 65536" in (tmp_path / "m.sh").read_text()
    titan = planner(
        "export", str(tmp_path / "plan.yaml"), "--to", "torchtitan", "--out", str(tmp_path / "t.toml")
    )
    assert titan.returncode == 0 and "has no loss scaling" in titan.stderr and '"bfloat16"' in titan.stderr
    off, _ = _planned(tmp_path, "--dtype", "fp16", "--loss-scale", "off")
    assert off.loss_scale is None
    static, _ = _planned(tmp_path, "--dtype", "fp16", "--loss-scale", "1024")
    assert static.loss_scale == 1024.0
    bf16, text = _planned(tmp_path, "--dtype", "bf16", "--loss-scale", "1024")
    assert bf16.loss_scale is None and "--loss-scale 1024 had no effect" in text
    bad = planner("optimize", str(ROOT / "examples" / "llama3.py"), "--loss-scale", "often")
    assert bad.returncode == 2 and "--loss-scale" in bad.stderr and "'often'" in bad.stderr

    def ctx(loss_scale: str | None) -> CostContext:  # an 8B Llama, fp16 training at DP 8 on one DGX H100
        work = WorkloadSpec("train", 8, 4096, loss_scale=loss_scale)
        mesh = MeshConfig(MeshShape(1, 1, 8), 1)
        return CostContext(analysed_llama("8b"), load_cluster("dgx-h100"), work, mesh, "fp16")

    scaled, unscaled = ctx("dynamic"), ctx(None)
    grad_bytes = 16e9
    extra = costing.optimizer_step_time_s(grad_bytes, scaled) - costing.optimizer_step_time_s(
        grad_bytes, unscaled
    )
    params = grad_bytes / 2  # fp16 gradients: every parameter of the replica
    assert extra == pytest.approx(costing.loss_scaling_time_s(params, scaled))
    # one pass over the fp32 gradients (8 bytes each) at the H100's memory bandwidth, and a flag all-reduce
    assert 8 * params / 3.35e12 < extra < 8 * params / 1.5e12 + 1e-4
    assert costing.loss_scaling_time_s(params, unscaled) == 0.0


def test_megatron_export_writes_the_plans_loss_scaling(tmp_path) -> None:
    from planner.export.megatron import _loss_scale_args  # noqa: PLC0415

    assert _loss_scale_args("dynamic") == [
        "--initial-loss-scale", "65536", "--loss-scale-window", "2000", "--hysteresis", "1",
    ]  # fmt: skip
    assert _loss_scale_args(1024.0) == ["--loss-scale", "1024"]
    assert _loss_scale_args(None) == ["--loss-scale", "1"]


# ------------------------------------------------------------------ runs


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "style"), [((1, 1, 2), "ddp"), ((1, 1, 2), "fsdp"), ((1, 2, 1), "ddp"), ((2, 1, 1), "ddp")]
)
def test_fp16_training_runs_with_loss_scaling_match_the_unsharded_model(layout, style) -> None:
    """DP (replicated and FSDP), PP (the schedule's loss scaled on the last stage, the first stage's
    scaler never scales a loss) and TP runs of fp16 training: the scaled gradients match the
    reference's at the same scale, and the first Adam step (unscaled) matches Adam's on its gradients."""
    tp, pp, dp = layout
    plan = _plan("bf16_llama.py", tp=tp, pp=pp, dp=dp, batch_size=4, workload="train", micro_batches=pp)
    plan = dataclasses.replace(plan, dtype="fp16", loss_scale="dynamic", dp_style=style)
    job = RunJob(str(MODELS / "bf16_llama.py"), plan.to_dict(), batch_size=4, seq_len=8, workload="train",
                 warmup=0, iters=2)  # fmt: skip
    summary = run_job(job, nproc=2, timeout_s=120)
    numerics = summary["numerics"]
    assert numerics["grad_scale"] > 1.0  # the scaled gradients (the largest unscaled one is below 1)
    assert numerics["update_max_abs_diff"] <= numerics["update_tolerance"]
    notes = [n for r in summary["ranks"] for n in r["notes"] if n.startswith("loss scaling")]
    assert len(notes) == 2 and all("checked step ran at scale 65536" in n for n in notes)


@pytest.mark.slow
def test_a_data_parallel_run_starts_at_a_scale_its_shares_do_not_overflow() -> None:
    """tests/models/fp16_large_grads.py at DP 2: its whole batch's gradients are finite at 128, a
    replica's (twice as large) only at 64; the reference's scale leaves the replicas that room, so the
    checked step is taken on both and matches (it was skipped on both, and the check failed)."""
    plan = _plan("fp16_large_grads.py", dp=2, batch_size=4, seq_len=64, workload="train")
    plan = dataclasses.replace(plan, dtype="fp16", loss_scale="dynamic")
    job = RunJob(str(MODELS / "fp16_large_grads.py"), plan.to_dict(), batch_size=4, seq_len=64,
                 workload="train", warmup=0, iters=2)  # fmt: skip
    summary = run_job(job, nproc=2, timeout_s=120)
    assert summary["numerics"]["update_max_abs_diff"] <= summary["numerics"]["update_tolerance"]
    notes = [n for r in summary["ranks"] for n in r["notes"] if n.startswith("loss scaling")]
    assert notes and all("ran at scale 64" in n and "skipped" not in n for n in notes), notes


def test_a_skipped_checked_step_is_named_when_the_check_fails() -> None:
    from runtime.session import numerics_hints  # noqa: PLC0415

    note = "loss scaling: static 128; the checked step ran at scale 128; 1 of 1 step(s) skipped for inf / NaN gradients"
    (hint,) = numerics_hints("fp16", "train", 128.0, [note])
    assert "overflowed on a rank and the step was skipped" in hint and "--loss-scale" in hint
    assert numerics_hints("fp16", "train", "dynamic", []) == []


def test_a_static_scale_that_overflows_is_refused_before_the_ranks_start() -> None:
    plan = _plan("bf16_llama.py", dp=1, batch_size=2, workload="train")
    plan = dataclasses.replace(plan, dtype="fp16", loss_scale=1e30)
    job = RunJob(str(MODELS / "bf16_llama.py"), plan.to_dict(), batch_size=2, seq_len=8, workload="train",
                 warmup=0, iters=1)  # fmt: skip
    with pytest.raises(InputError, match="overflow at the static loss scale 1e"):
        run_job(job, nproc=1, timeout_s=60)

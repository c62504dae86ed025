"""A 16-bit plan on a CPU priced as a CPU computes it: bf16 memory-bound ops, attention cores and decode
graphs are timed in the plan's dtype against what fp32 (the dtype `planner calibrate` measures) costs,
not priced from bytes at half fp32's time. Tiny Llama DP 2, 4 x 128 tokens, bf16 training on the dev VM
(2026-12-07): measured / predicted 1.83 before, 1.18 after (fp32: 1.18)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from costmodels import calibrate as cal
from costmodels import compute
from costmodels.cluster import CALIBRATED_SPEC_NAME, load_cluster
from planner.cli import workflow
from planner.solver import machine

ROOT = Path(__file__).resolve().parents[1]


def _rates(seconds: list[float]):
    """A fake `interleaved_rates` whose calls take ``seconds`` (in the order given)."""

    def rates(fns, amounts, dev, budget_s):
        assert len(fns) == len(seconds)
        return [1.0 / s for s in seconds], 1.0

    return rates


def test_memory_ops_in_bf16_are_timed_against_fp32s(monkeypatch) -> None:
    """Each op of the model's mix is timed in bf16 and fp32 over the activation and over one element;
    net of that one-element call, bf16's time over fp32's, weighed by the op's bytes and scaled by 4 / 2
    bytes, is the price ratio: 2.0 when bf16 takes as long as fp32. An op whose fp32 time is mostly
    its call is left out; the ratio is at least 1 (never under the bytes' price)."""
    # (bf16, bf16 one element, fp32, fp32 one element) per op, in the mix's order: add, mul
    add = [12.0, 2.0, 7.0, 2.0]  # net 10 vs 5: 2x fp32's time -> 4.0
    mul = [7.0, 2.0, 7.0, 2.0]  # net 5 vs 5: as long as fp32 -> 2.0
    monkeypatch.setattr(cal, "interleaved_rates", _rates(add + mul))
    ratio = cal.memory_dtype_time_ratio({"aten.add": 1.0, "aten.mul": 3.0}, 32768, "bf16")
    assert ratio == pytest.approx(0.25 * 4.0 + 0.75 * 2.0)
    # an op the mix does not name is timed as an add (and weighs with it)
    monkeypatch.setattr(cal, "interleaved_rates", _rates(add))
    assert cal.memory_dtype_time_ratio({"aten.where": 1.0, "aten.add": 1.0}, 32768, "bf16") == pytest.approx(
        4.0
    )
    # bf16 twice as fast per element as fp32 (past the caches): priced by its bytes, not below
    monkeypatch.setattr(cal, "interleaved_rates", _rates([3.5, 1.0, 6.0, 1.0]))
    assert cal.memory_dtype_time_ratio({"aten.add": 1.0}, 1 << 22, "bf16") == 1.0
    # fp32's time all dispatch: nothing timed
    monkeypatch.setattr(cal, "interleaved_rates", _rates([3.0, 2.0, 2.5, 2.0]))
    assert cal.memory_dtype_time_ratio({"aten.add": 1.0}, 1024, "bf16") is None
    assert cal.memory_dtype_time_ratio({"aten.add": 1.0}, 32768, "fp32") is None
    assert cal.memory_dtype_time_ratio({}, 32768, "bf16") is None


def test_memory_ratio_scales_plain_memory_ops_of_its_dtype_only() -> None:
    """`DeviceSpec.memory_dtype_time_ratios` scales a memory-bound op or a pool in its dtype; not one in fp32,
    not a matmul, not an activation that has its own timed ratio."""
    device = load_cluster("local-cpu", 2).device
    timed = dataclasses.replace(
        device, memory_dtype_time_ratios={"bf16": 2.5}, activation_time_ratios={("aten.silu", (), ()): 3.0}
    )

    def t(dev, dtype, kind, call=None):
        return compute.op_time_s(1e3, 1e6, dev, dtype, kind, launch=False, call=call)

    assert t(timed, "bf16", "memory") == pytest.approx(2.5 * t(device, "bf16", "memory"))
    # a pool too (a ConvNet's bf16 training on the dev VM: 1.5 -> 0.92 measured / predicted)
    assert t(timed, "bf16", "pool") == pytest.approx(2.5 * t(device, "bf16", "pool"))
    assert t(timed, "fp32", "memory") == pytest.approx(t(device, "fp32", "memory"))
    assert t(timed, "bf16", "matmul") == pytest.approx(t(device, "bf16", "matmul"))
    silu = ("aten.silu", (), ())
    assert t(timed, "bf16", "memory", silu) == pytest.approx(3.0 * t(device, "bf16", "memory"))


def test_attention_cores_in_bf16_are_timed_against_the_fp32_reference(monkeypatch) -> None:
    """The calibration's own core, which divides every attention ratio, runs in fp32 (the dtype
    `calibrate` measured ``attention_efficiency`` in) whatever the plan's dtype: timed in bf16 it
    cancelled what bf16 itself costs (its backward 5.8x fp32's on the dev VM, priced 2x faster)."""
    device = load_cluster("local-cpu", 2).device
    dtypes = []

    def runner(b, h, q, k, hd, causal, dt, train):
        dtypes.append(dt)
        return lambda: None

    monkeypatch.setattr(cal, "_attention_runner", runner)
    monkeypatch.setattr(cal, "interleaved_rates", lambda fns, amounts, dev, budget_s: ([1e3] * len(fns), 1.0))
    call = (8, 128, 128, 16, True)
    assert set(cal.attention_time_ratios([call], 2, device, "bf16", train=True)) == {call}
    assert dtypes == [torch.float32, torch.bfloat16]


def test_a_bf16_plan_on_this_machine_times_its_memory_ops(monkeypatch) -> None:
    """Planning in bf16 on the calibrated spec times the model's plain memory-bound ops (its adds,
    products, norms' reductions: by ATen name and bytes, activations left out) at a rank's activation
    size, and the ratio reaches the plan; an fp32 plan does not time them."""
    prepared = workflow.prepare(
        str(ROOT / "examples" / "llama3.py"), "train", batch_size=4, seq_len=128, dtype="bf16"
    )
    local = load_cluster("local-cpu", 2)
    calibrated = dataclasses.replace(
        local, name=CALIBRATED_SPEC_NAME, device=dataclasses.replace(local.device, node_overhead_s=5e-6)
    )
    seen = []

    def fake(ops, elements, dtype, threads=1, budget_s=1.0):
        seen.append((sorted(ops), elements, dtype))
        return 2.0

    for name in (
        "matmul_shape_time_ratios",
        "conv_time_ratios",
        "activation_time_ratios",
        "attention_time_ratios",
    ):
        monkeypatch.setattr(cal, name, lambda *a, **k: {})
    monkeypatch.setattr(cal, "memory_dtype_time_ratio", fake)
    monkeypatch.setattr(machine, "_SHAPE_RATIOS", {})
    timed = machine.with_model_rates(prepared, calibrated)
    ((ops, elements, dtype),) = seen
    assert dtype == "bf16" and "aten.mul" in ops and "aten.add" in ops and "aten.silu" not in ops
    assert elements == 2 * 128 * 128  # a rank's 2 sequences x 128 tokens x hidden 128
    assert timed.device.memory_dtype_time_ratios == {"bf16": 2.0}
    constraints = workflow.constraints_from(1, 1, 2, "none")
    slower = workflow.make_plan(prepared, calibrated, constraints, "examples/llama3.py").predicted.latency_s
    monkeypatch.setattr(machine, "_SHAPE_RATIOS", {})
    monkeypatch.setattr(cal, "memory_dtype_time_ratio", lambda *a, **k: 1.0)
    plain = workflow.make_plan(prepared, calibrated, constraints, "examples/llama3.py").predicted.latency_s
    assert slower > plain
    fp32 = workflow.prepare(str(ROOT / "examples" / "llama3.py"), "train", batch_size=4, seq_len=128)
    seen.clear()
    monkeypatch.setattr(machine, "_SHAPE_RATIOS", {})
    monkeypatch.setattr(cal, "memory_dtype_time_ratio", fake)
    assert machine.with_model_rates(fp32, calibrated).device.memory_dtype_time_ratios == {}
    assert seen == []


def test_the_decode_graph_is_timed_in_the_plans_dtype(monkeypatch) -> None:
    """The decode graph timed when planning is built and fed in the plan's dtype, as the run computes
    it (a bf16 step took 1.5x an fp32 one on the dev VM, where bytes price it 2x faster): measured /
    predicted of a bf16 decode of the tiny Llama, 2.23 before, 1.03 after."""
    path = ROOT / "examples" / "llama3_kv.py"
    local = load_cluster("local-cpu", nproc=2)
    calibrated = dataclasses.replace(
        local,
        name=CALIBRATED_SPEC_NAME,
        device=dataclasses.replace(local.device, node_overhead_s=5e-6, probe_node_overhead_s=5e-6),
    )
    outputs = []

    def fake(run, nodes, roofline_s, priced_node_s, reference_node_s, threads=1, budget_s=1.0):
        outputs.append(run())
        return 1.0

    monkeypatch.setattr(cal, "graph_node_time_ratio", fake)
    for dtype, want in (("bf16", torch.bfloat16), (None, torch.float32)):
        machine._DECODE_NODE_RATIOS.clear()
        outputs.clear()
        prepared = workflow.prepare(str(path), "decode", batch_size=2, context=16, new_tokens=4, dtype=dtype)
        assert machine.with_decode_graph_time(prepared, calibrated).device.decode_node_time_ratio == 1.0
        (out,) = outputs
        logits = out if isinstance(out, torch.Tensor) else out[0]
        assert logits.dtype == want


def test_convolutions_of_a_16_bit_plan_are_timed_against_the_fp32_reference(monkeypatch) -> None:
    """The spec's own convolution, whose measured / priced time divides every convolution's ratio, runs
    in fp32 (as `calibrate` measured ``conv_efficiency``) whatever the plan's dtype; the model's run in
    the plan's."""
    device = load_cluster("local-cpu", 2).device
    dtypes = []

    def runner(call, dt, backward):
        dtypes.append((call[1][0][1], dt))
        return lambda: None

    monkeypatch.setattr(cal, "_conv_runner", runner)
    monkeypatch.setattr(
        cal, "interleaved_rates", lambda fns, amounts, dev, budget_s: ([1e6] + [1e3] * (len(fns) - 1), 1.0)
    )
    shape = (4, 32, 16, 16)
    call = (
        "aten.conv2d",
        (("tensor", shape, "bf16"), ("tensor", (32, 32, 3, 3), "bf16"), None, (1, 1), (1, 1)),
        True,
    )
    flops = 2.0 * 4 * 32 * 16 * 16 * 32 * 9
    assert set(cal.conv_time_ratios([(call, flops, 1e5)], device, "bf16")) == {call}
    assert dtypes == [(cal.CONV_SHAPE, torch.float32), (shape, torch.bfloat16)]


def test_context_parallel_kernels_take_the_ratio_timed_for_the_ranks_block(monkeypatch) -> None:
    """Under CP each rank's kernels are priced with the attention ratio timed for its diagonal block
    (T / cp queries over as many keys; the all-to-all: 1 / cp of the heads over the whole sequence),
    and planning on this machine's spec times those calls. Before, no ratio reached a CP core: a bf16
    CP 2 training step of the tiny Llama (4 x 512) read 1.97 at the run's speed, an fp16 one 0.25
    (priced at fp16's matmul peak)."""
    from costmodels.comm import Group  # noqa: PLC0415
    from costmodels.context_parallel import CpAttentionShape, cp_attention_cost  # noqa: PLC0415
    from planner.solver import costing  # noqa: PLC0415

    spec = load_cluster("local-cpu", 2)
    shape = CpAttentionShape(2, 8, 4, 16, 512, causal=True)
    for variant in ("ring", "allgather", "alltoall"):
        call = costing.cp_attention_call(8, 512, 16, 2, variant, True)
        assert call == ((4, 512, 512, 16, True) if variant == "alltoall" else (8, 256, 256, 16, True))
        timed = dataclasses.replace(
            spec, device=dataclasses.replace(spec.device, attention_time_ratios={call: 3.0})
        )
        plain, scaled = (
            cp_attention_cost(shape, 2, variant, True, c, Group(2, 2), "bf16", 2.0, call).compute_s
            for c in (spec, timed)
        )
        assert scaled == pytest.approx(3.0 * plain)
    prepared = workflow.prepare(str(ROOT / "examples" / "llama3.py"), "train", batch_size=4, seq_len=512)
    calls = costing.model_attention_calls(prepared.structure, prepared.workload, [1, 2], [1, 2])
    assert (8, 256, 256, 16, True) in calls and (4, 512, 512, 16, True) in calls


@pytest.mark.parametrize(
    ("dtype", "workload", "loss_scale", "hinted"),
    [
        ("fp16", "train", None, True),
        ("fp16", "train", "dynamic", False),
        ("bf16", "train", None, False),
        ("fp16", "forward", None, False),
    ],
)
def test_a_failed_fp16_training_check_names_loss_scaling(
    monkeypatch, dtype, workload, loss_scale, hinted
) -> None:
    """An fp16 training run without loss scaling whose numerics check fails says so and that gradients
    below fp16's smallest normal round differently when the batch is split (a tiny Mixtral at DP 2
    failed so every time, bf16 passed), and how to plan loss scaling; other failures say only what
    differed."""
    from planner.errors import RunError  # noqa: PLC0415
    from runtime import session  # noqa: PLC0415

    class _Plan:  # only the plan's dtype is read
        @staticmethod
        def from_dict(d):
            return dataclasses.make_dataclass("P", ["dtype", "loss_scale"])(d["dtype"], d["loss_scale"])

    job = session.RunJob(
        str(ROOT / "examples" / "llama3.py"),
        {"dtype": dtype, "loss_scale": loss_scale},
        2,
        16,
        workload=workload,
    )
    monkeypatch.setattr(session, "Plan", _Plan)
    monkeypatch.setattr(session, "under_torchrun", lambda: False)
    monkeypatch.setattr(session, "check_plan_runs", lambda plan, workload: None)
    monkeypatch.setattr(session, "write_reference", lambda job, directory: None)
    monkeypatch.setattr(session, "launch", lambda *a, **k: [{}])
    monkeypatch.setattr(session, "summarise", lambda reports: {"numerics": {}})
    monkeypatch.setattr(
        session, "check_failures", lambda numerics: ["gradients: max |sharded - unsharded| = 8.3e-05"]
    )
    with pytest.raises(RunError) as raised:
        session.run_job(job, 2, 60.0)
    assert ("without loss scaling" in str(raised.value)) is hinted
    assert ("--loss-scale dynamic" in str(raised.value)) is hinted
    assert "gradients: max" in str(raised.value)

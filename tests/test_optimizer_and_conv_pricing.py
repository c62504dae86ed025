"""Terms a training step and a conv net pay on an eager CPU that a roofline of the math misses:
torch.optim.Adam's step by tensor size (`costmodels.compute.adam_step_time_s`), the dense embedding
gradient written into fresh memory (`costing.embedding_gradient_time_s`), and a model's own
convolutions and activations timed on this machine (`costmodels.calibrate.conv_time_ratios`,
`costmodels.calibrate.activation_time_ratios`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from costmodels import calibrate as cal
from costmodels import compute
from costmodels.cluster import CALIBRATED_SPEC_NAME, load_cluster
from planner.cli import workflow
from planner.frontend.analysis import conv_call_at_batch
from planner.plan import DataParallel, MeshShape
from planner.solver import machine
from planner.solver.costing import (
    CostContext,
    embedding_gradient_time_s,
    optimizer_step_time_s,
    param_size_shares,
)
from planner.solver.problem import MeshConfig, WorkloadSpec
from tests.planner_fixtures import analysed_gpt

MIB = 2**20


@pytest.fixture
def cpu():
    """local-cpu with measured Adam rates and a fresh-memory bandwidth, as `planner calibrate` writes."""
    base = load_cluster("local-cpu", 2)
    device = dataclasses.replace(
        base.device,
        adam_s_per_param=4e-9,
        adam_large_tensor_s_per_param=7e-9,
        fresh_write_bandwidth_bytes_per_s=2.5e9,
    )
    return dataclasses.replace(base, device=device)


def _as_calibrated(base):
    """``base`` named as this machine's calibrated spec, with a speed-probe reference: planning on it
    times the model's own shapes (`workflow.priced_cluster`)."""
    return dataclasses.replace(
        base,
        name=CALIBRATED_SPEC_NAME,
        device=dataclasses.replace(base.device, probe_matmul_flops_per_s=100e9),
    )


def _ctx(structure, cluster, tp=1, dp=1, train=True, zero=False) -> CostContext:
    workload = WorkloadSpec("train" if train else "forward", 2, 32)
    mesh = MeshConfig(MeshShape(tp, 1, dp), 1, dp_style=DataParallel.ZERO1 if zero else DataParallel.DDP)
    return CostContext(structure, cluster, workload, mesh, "fp32")


def test_adam_time_by_measured_rates_and_tensor_size(cpu) -> None:
    dev = cpu.device
    assert compute.adam_step_time_s(10e6, 4e6, dev, "fp32") == pytest.approx(6e6 * 4e-9 + 4e6 * 7e-9)
    bandwidth = dev.memory_bandwidth_bytes_per_s * dev.memory_efficiency
    copies = 10e6 * 12 / bandwidth  # a 16-bit model steps fp32 masters and copies both ways
    assert compute.adam_step_time_s(10e6, 0, dev, "bf16") == pytest.approx(10e6 * 4e-9 + copies)
    plain = load_cluster("local-cpu", 2).device  # no measured rates: the fused kernel's bytes
    assert compute.adam_step_time_s(10e6, 4e6, plain, "fp32") == pytest.approx(
        10e6 * compute.ADAM_BYTES_PER_PARAM / (plain.memory_bandwidth_bytes_per_s * plain.memory_efficiency)
    )
    with pytest.raises(ValueError, match="large_params"):
        compute.adam_step_time_s(1e6, 2e6, dev, "fp32")


def test_large_tensors_are_the_embedding_until_tp_or_zero_splits_them(cpu) -> None:
    gpt2 = analysed_gpt("124m")
    wte = 50257 * 768
    assert max(gpt2.param_tensor_sizes) == (wte, True)
    total = sum(n for n, _ in gpt2.param_tensor_sizes)
    # 154 MB of fp32 is over the 32 MiB threshold, every layer matrix (<= 9.4 MB) under it
    assert param_size_shares(_ctx(gpt2, cpu), total)[0] == pytest.approx(wte / total)
    assert param_size_shares(_ctx(gpt2, cpu, tp=8), total)[0] == 0.0  # 19 MB shards
    zero = _ctx(gpt2, cpu, dp=2, zero=True)  # the distributed optimizer steps one flat shard
    assert param_size_shares(zero, 1e6) == (0.0, 0.0) and param_size_shares(zero, 20e6) == (1.0, 0.0)
    assert param_size_shares(zero, 1e5) == (0.0, 1.0)  # 400 KB: in cache
    # norms and biases (768 elements) are in cache, the 2.4-9.4 MB layer matrices are not
    small = sum(n for n, _ in gpt2.param_tensor_sizes if n * 4 <= compute.CACHED_TENSOR_BYTES)
    assert 0 < small < 0.01 * total
    assert param_size_shares(_ctx(gpt2, cpu), total)[1] == pytest.approx(small / total)


def test_optimizer_step_prices_the_measured_rates(cpu) -> None:
    gpt2 = analysed_gpt("124m")
    ctx = _ctx(gpt2, cpu)
    params = sum(n for n, _ in gpt2.param_tensor_sizes)
    share, _ = param_size_shares(ctx, params)
    dispatch = compute.node_overhead_s(cpu.device, gpt2.num_param_tensors * 9)
    want = dispatch + params * ((1 - share) * 4e-9 + share * 7e-9)
    assert optimizer_step_time_s(params * 4, ctx) == pytest.approx(want)
    assert optimizer_step_time_s(params * 4, _ctx(gpt2, cpu, train=False)) == 0.0


def test_optimizer_step_prices_a_measured_cost_per_tensor_and_the_in_cache_rate(cpu) -> None:
    """A small model's Adam step is mostly the loop's fixed cost per tensor and tensors that stay in
    cache: `planner calibrate` measures both (the tiny Llama's 39 tensors stepped in 2.2 ms, priced
    4.4 ms by per-node dispatch and the 4 MiB rate, on the dev VM)."""
    gpt2 = analysed_gpt("124m")
    dev = dataclasses.replace(cpu.device, adam_tensor_overhead_s=20e-6, adam_cached_s_per_param=2e-9)
    measured = dataclasses.replace(cpu, device=dev)
    ctx = _ctx(gpt2, measured)
    params = sum(n for n, _ in gpt2.param_tensor_sizes)
    large, cached = param_size_shares(ctx, params)
    want = gpt2.num_param_tensors * 20e-6 + params * (
        (1 - large - cached) * 4e-9 + large * 7e-9 + cached * 2e-9
    )
    assert optimizer_step_time_s(params * 4, ctx) == pytest.approx(want)
    assert optimizer_step_time_s(params * 4, ctx) < optimizer_step_time_s(params * 4, _ctx(gpt2, cpu))
    with pytest.raises(ValueError, match="cached_params"):
        compute.adam_step_time_s(1e6, 6e5, dev, "fp32", cached_params=6e5)


def test_embedding_gradient_is_dense_and_fresh_and_tied_sums_twice(cpu) -> None:
    gpt2 = analysed_gpt("124m")
    weight, rows = 50257 * 768 * 4.0, 64 * 768 * 4.0
    dev = cpu.device
    bandwidth = dev.memory_bandwidth_bytes_per_s * dev.memory_efficiency
    fill = weight / 2.5e9 + 3 * rows / bandwidth  # over 32 MiB: written at the fresh-memory rate
    assert embedding_gradient_time_s(weight, rows, False, _ctx(gpt2, cpu)) == pytest.approx(fill)
    tied = embedding_gradient_time_s(weight, rows, True, _ctx(gpt2, cpu))
    assert tied == pytest.approx(fill + 2 * weight / bandwidth + weight / 2.5e9)
    small = 1 * MIB  # under the threshold: at memory bandwidth
    assert embedding_gradient_time_s(small, 0.0, False, _ctx(gpt2, cpu)) == pytest.approx(small / bandwidth)
    assert embedding_gradient_time_s(weight, rows, True, _ctx(gpt2, cpu, train=False)) == 0.0


def test_training_prediction_includes_the_embedding_gradient(cpu) -> None:
    """The same plan priced with and without the fresh-memory rate: the difference is the dense
    gradient of the tied 154 MB embedding (written twice) at the two rates."""
    gpt2 = analysed_gpt("124m")
    from planner.solver.costing import build_ends_graph

    slow = build_ends_graph(_ctx(gpt2, cpu)).ops[0].options[0].compute_s
    plain = dataclasses.replace(
        cpu, device=dataclasses.replace(cpu.device, fresh_write_bandwidth_bytes_per_s=None)
    )
    fast = build_ends_graph(_ctx(gpt2, plain)).ops[0].options[0].compute_s
    weight = 50257 * 768 * 4.0
    bandwidth = cpu.device.memory_bandwidth_bytes_per_s * cpu.device.memory_efficiency
    assert slow - fast == pytest.approx(2 * (weight / 2.5e9 - weight / bandwidth))


def _convnet_convs():
    prepared = workflow.prepare("examples/convnet.py", "forward", batch_size=8)
    return prepared, [c for c in prepared.structure.node_costs.values() if c.kind == "conv"]


def test_conv_call_runs_the_same_convolution_forward_and_backward() -> None:
    _, convs = _convnet_convs()
    assert len(convs) == 3 and all(c.call is not None for c in convs)
    name, args, input_grad = convs[0].call
    assert name == "aten.conv2d" and args[0] == ("tensor", (8, 3, 32, 32), "fp32")
    assert not input_grad and convs[1].call[2]  # the image needs no gradient, a feature map does
    assert cal._conv_runner(convs[0].call, torch.float32, backward=False)().shape == (8, 32, 32, 32)
    grads = cal._conv_runner(convs[0].call, torch.float32, backward=True)()
    assert [tuple(g.shape) for g in grads] == [(32, 3, 3, 3), (32,)]  # weight and bias only
    grads = cal._conv_runner(convs[1].call, torch.float32, backward=True)()
    assert [tuple(g.shape) for g in grads] == [(8, 32, 16, 16), (64, 32, 3, 3), (64,)]
    half = conv_call_at_batch(convs[1].call, 4)
    assert half[1][0] == ("tensor", (4, 32, 16, 16), "fp32") and half[1][1:] == convs[1].call[1][1:]


def test_conv_ratios_are_relative_to_the_calibrated_convolution(monkeypatch) -> None:
    """Each convolution's measured / priced time over the spec's own CONV_SHAPE convolution's."""
    _, convs = _convnet_convs()
    device = load_cluster("local-cpu", 2).device
    calls = [(c.call, c.flops, c.bytes_read + c.bytes_written) for c in convs]

    def price(flops, moved):
        return compute.op_time_s(flops, moved, device, "fp32", "conv", launch=False)

    b, c, h, w = cal.CONV_SHAPE
    ref = price(2.0 * b * c * h * w * c * 9, 4.0 * (2 * b * c * h * w + c * c * 9))
    slow = {calls[0][0]: 3.0}  # the 3-channel convolution runs 3x its price, the others at it

    def fake(fns, amounts, dev, budget_s):
        seconds = [1e-9, 2 * ref] + [slow.get(call, 1.0) * 2 * price(f, m) for call, f, m in calls]
        return [1 / s for s in seconds], 1.0  # a 1 ns dispatch; the whole machine 2x slower now: cancels

    monkeypatch.setattr(cal, "interleaved_rates", fake)
    ratios = cal.conv_time_ratios(calls, device, "fp32")
    assert [ratios[call] for call, _, _ in calls] == pytest.approx([3.0, 1.0, 1.0])
    timed = dataclasses.replace(device, conv_time_ratios=ratios)
    call, flops, moved = calls[0]
    plain = compute.op_time_s(flops, moved, device, "fp32", "conv", launch=False)
    assert compute.op_time_s(flops, moved, timed, "fp32", "conv", launch=False, call=call) == pytest.approx(
        3 * plain
    )
    assert compute.op_time_s(flops, moved, timed, "fp32", "conv", launch=False) == plain  # no call given
    other_batch = conv_call_at_batch(call, 2)  # not timed at this batch: the same convolution's ratio
    assert compute.op_time_s(
        flops, moved, timed, "fp32", "conv", launch=False, call=other_batch
    ) == pytest.approx(3 * plain)


def test_planning_on_a_calibrated_spec_times_the_convolutions(monkeypatch) -> None:
    prepared, convs = _convnet_convs()
    base = load_cluster("local-cpu", 2)
    calibrated = _as_calibrated(base)
    seen = []

    def fake(calls, device, dtype, threads=1, budget_s=1.0, train=False):
        seen.append([c for c, _, _ in calls])
        return {c: 2.0 for c, _, _ in calls}

    monkeypatch.setattr(cal, "conv_time_ratios", fake)
    monkeypatch.setattr(cal, "matmul_shape_time_ratios", lambda *a, **k: {})
    monkeypatch.setattr(cal, "activation_time_ratios", lambda *a, **k: {})
    monkeypatch.setattr(machine, "_SHAPE_RATIOS", {})
    timed = workflow.priced_cluster(prepared, calibrated)
    # every convolution at the whole batch and at each DP share over the spec's 2 ranks
    want = {conv_call_at_batch(c.call, b) for c in convs for b in (4, 8)}
    assert len(seen) == 1 and set(seen[0]) == want and len(seen[0]) == 6
    assert timed.device.conv_time_ratios == dict.fromkeys(want, 2.0)
    constraints = workflow.constraints_from(1, 1, 1, "none")
    slower = workflow.make_plan(prepared, calibrated, constraints, "examples/convnet.py")
    plain = workflow.make_plan(prepared, base, constraints, "examples/convnet.py")
    assert slower.predicted.latency_s > plain.predicted.latency_s


def test_pooling_backward_is_a_memory_bound_scatter_not_twice_the_forward(cpu) -> None:
    """A 2x2 max pool's forward runs at the (slow) pooling bandwidth; its backward scatters the output
    gradient at memory bandwidth (on the dev VM 1.52 ms forward, 1.96 ms forward + backward)."""
    gpt2 = analysed_gpt("124m")
    device = dataclasses.replace(cpu.device, pooling_bandwidth_bytes_per_s=0.75e9)
    cluster = dataclasses.replace(cpu, device=device)
    moved = 4.0 * 8 * 32 * 32 * 32 * 1.25
    forward = _ctx(gpt2, cluster, train=False).op_time(0.0, moved, "pool")
    assert forward == pytest.approx(moved / 0.75e9)
    train = _ctx(gpt2, cluster).op_time(0.0, moved, "pool")
    bandwidth = device.memory_bandwidth_bytes_per_s * device.memory_efficiency
    assert train == pytest.approx(forward + 2 * moved / bandwidth)
    assert train < 3 * forward
    matmul = _ctx(gpt2, cluster).op_time(1e9, 1e6, "matmul")  # other ops keep 3x the forward
    assert matmul == pytest.approx(3 * _ctx(gpt2, cluster, train=False).op_time(1e9, 1e6, "matmul"))


def test_model_flops_count_the_convolutions() -> None:
    """A conv net's TFLOP/s counts its convolutions, not only its classifier (was ~1e4 too low)."""
    prepared = workflow.prepare("examples/convnet.py", "train", batch_size=8)
    plan = workflow.make_plan(
        prepared,
        load_cluster("local-cpu", 1),
        workflow.constraints_from(1, 1, 1, "none"),
        "examples/convnet.py",
    )
    convs = sum(c.flops for c in prepared.structure.node_costs.values() if c.kind == "conv")
    assert convs > 1e8  # three 3x3 convolutions over 8 CIFAR images
    classifier = 2 * 8 * 128 * 10
    assert plan.predicted.model_flops == pytest.approx(3 * (convs + classifier))


class _Activations(torch.nn.Module):
    """Exact and tanh GELU, SiLU and a leaky ReLU (a non-tensor argument) over (B, 256)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = torch.nn.functional.gelu(h) + torch.nn.functional.gelu(h, approximate="tanh")
        return torch.nn.functional.leaky_relu(torch.nn.functional.silu(h), 0.2)


def _activation_nodes() -> tuple[dict[tuple, list], object]:
    from planner.frontend.analysis import analyse  # noqa: PLC0415
    from planner.frontend.capture import capture  # noqa: PLC0415

    structure = analyse(capture(_Activations(), (torch.randn(16, 64),)))
    out: dict[tuple, list] = {}
    for c in structure.node_costs.values():
        if c.call is not None:
            out.setdefault(c.call, []).append(c)
    return out, structure


GELU = ("aten.gelu", (), ())
GELU_TANH = ("aten.gelu", (), (("approximate", "tanh"),))
SILU = ("aten.silu", (), ())
LEAKY = ("aten.leaky_relu", (0.2,), ())


def test_activation_nodes_carry_their_op_and_arguments_as_a_call() -> None:
    """Each activation is keyed by its op and non-tensor arguments, so exact and tanh GELU time apart;
    the key runs the same op (`_activation_runner`), forward and into its input's gradient."""
    nodes, structure = _activation_nodes()
    assert set(nodes) == {GELU, GELU_TANH, SILU, LEAKY}
    assert all(c.kind == "memory" for cs in nodes.values() for c in cs)
    assert machine.model_activation_calls(structure) == sorted(
        {GELU: 16 * 256, GELU_TANH: 16 * 256, SILU: 16 * 256, LEAKY: 16 * 256}.items(), key=repr
    )
    x = torch.linspace(-3, 3, 7)
    run = cal._activation_runner(GELU_TANH, 7, torch.float32, backward=False)
    assert run().shape == (7,)
    for call, fn in ((GELU_TANH, lambda t: torch.nn.functional.gelu(t, approximate="tanh")),
                     (LEAKY, lambda t: torch.nn.functional.leaky_relu(t, 0.2))):  # fmt: skip
        op = getattr(torch.ops.aten, call[0].removeprefix("aten."))
        assert torch.equal(op(x, *call[1], **dict(call[2])), fn(x))
    (grad,) = cal._activation_runner(SILU, 7, torch.float32, backward=True)()
    assert grad.shape == (7,)


def test_activation_ratios_are_net_of_dispatch_against_the_memory_price_and_never_below_it(
    monkeypatch,
) -> None:
    """measured (over N elements less over one) / memory-bound price of N elements, divided by the
    copy's measured / priced time (the machine's speed now); a ratio under 1 (a small op running from
    cache) is 1: an activation is priced up for its math, never below a plain op of its size."""
    device = load_cluster("local-cpu", 2).device
    n = 1 << 16

    def price(elements, kind="memory"):
        return compute.op_time_s(float(elements), 8.0 * elements, device, "fp32", kind, launch=False)

    copy_price = compute.op_time_s(
        0.0, 2.0 * cal._COPY_REFERENCE_BYTES, device, "fp32", "memory", launch=False
    )
    calls = [(GELU, n), (SILU, n)]

    def fake(fns, amounts, dev, budget_s):
        if len(fns) == 1:  # the copy, alone: the machine 2x slower than calibrated now
            return [1 / (2 * copy_price)], 1.0
        dispatch = 5e-6
        seconds = [dispatch + 2 * 3.0 * price(n), dispatch, dispatch + 2 * 0.4 * price(n), dispatch]
        return [1 / s for s in seconds], 1.0

    monkeypatch.setattr(cal, "interleaved_rates", fake)
    ratios = cal.activation_time_ratios(calls, device, "fp32")
    assert ratios == pytest.approx({GELU: 3.0, SILU: 1.0})
    trained = cal.activation_time_ratios(calls, device, "fp32", train=True)  # against 3 forward prices
    assert trained == pytest.approx({GELU: 1.0, SILU: 1.0})
    timed = dataclasses.replace(device, activation_time_ratios=ratios)
    plain = compute.op_time_s(1e5, 8e5, device, "fp32", "memory", launch=False)
    assert compute.op_time_s(1e5, 8e5, timed, "fp32", "memory", launch=False, call=GELU) == pytest.approx(
        3 * plain
    )
    assert (
        compute.op_time_s(1e5, 8e5, timed, "fp32", "memory", launch=False, call=GELU_TANH) == plain
    )  # not timed
    assert compute.op_time_s(1e5, 8e5, timed, "fp32", "memory", launch=False) == plain


def test_an_activation_timed_slower_prices_the_model_slower(monkeypatch) -> None:
    """Planning on the calibrated spec times the MLP example's GELU; its ratio reaches the plan."""
    prepared = workflow.prepare("examples/mlp.py", "forward", batch_size=64)
    base = load_cluster("local-cpu", 1)
    calibrated = _as_calibrated(base)
    seen = []

    def fake(calls, device, dtype, threads=1, budget_s=1.0, train=False):
        seen.append(calls)
        return {c: 4.0 for c, _ in calls}

    monkeypatch.setattr(cal, "activation_time_ratios", fake)
    monkeypatch.setattr(cal, "matmul_shape_time_ratios", lambda *a, **k: {})
    monkeypatch.setattr(machine, "_SHAPE_RATIOS", {})
    assert workflow.priced_cluster(prepared, calibrated).device.activation_time_ratios == {GELU: 4.0}
    assert seen == [[(GELU, 64 * 256)]]
    constraints = workflow.constraints_from(1, 1, 1, "none")
    slower = workflow.make_plan(prepared, calibrated, constraints, "examples/mlp.py")
    monkeypatch.setattr(machine, "_SHAPE_RATIOS", {})
    monkeypatch.setattr(cal, "activation_time_ratios", lambda calls, *a, **k: {c: 1.0 for c, _ in calls})
    plain = workflow.make_plan(prepared, calibrated, constraints, "examples/mlp.py")
    gelu = compute.op_time_s(64 * 256, 2 * 4 * 64 * 256, base.device, "fp32", "memory", launch=False)
    assert slower.predicted.latency_s - plain.predicted.latency_s == pytest.approx(3 * 3 * gelu, rel=1e-6)


def test_training_step_temporaries_are_priced_in_memory(cpu) -> None:
    """A training rank holds weight-sized temporaries beside its state: the tied head's two dense
    gradients summed into the kept one, and (eager CPU, torch.optim.Adam's per-tensor loop) two fp32
    temporaries of the largest parameter tensor. GPT-2 124M at TP=2: the vocabulary-split embedding
    (25,129 x 768) is both; measured 2 x 73.6 MiB above the stored state on the dev VM."""
    from planner.solver.costing import training_transient_bytes, transient_bytes  # noqa: PLC0415

    gpt2 = analysed_gpt("124m")
    shard = -(-50257 // 2) * 768 * 4
    assert training_transient_bytes(_ctx(gpt2, cpu, tp=2)) == pytest.approx(2 * shard)
    assert transient_bytes(_ctx(gpt2, cpu, tp=2)) == pytest.approx(2 * shard)
    gpu = load_cluster("dgx-h100", 8)  # priced per kernel: no CPU Adam loop, the tied sum stays
    assert training_transient_bytes(_ctx(gpt2, gpu, tp=2)) == pytest.approx(2 * shard)
    untied = dataclasses.replace(gpt2, tied_lm_head=False)
    largest = max(n / 2 if matrix else n for n, matrix in gpt2.param_tensor_sizes)
    assert training_transient_bytes(_ctx(untied, cpu, tp=2)) == pytest.approx(2 * largest * 4)
    assert training_transient_bytes(_ctx(untied, gpu, tp=2)) == 0.0
    assert transient_bytes(_ctx(gpt2, cpu, tp=2, train=False)) > 0  # inference keeps its working set


def test_an_embedding_tied_across_pipeline_stages_prices_its_gradient_exchange() -> None:
    """GPT-2's embedding is its LM head: at pp=2 the first and the last stage each hold a copy and
    swap their gradients after the backward (`runtime.pipeline.sum_tied_gradients`). With dp=1 there
    is no other gradient traffic, so the step's gradient sync is that exchange: one message of the
    whole embedding gradient (in the gradients' dtype) and the add; a model without tied weights (the
    Llama) has none."""
    from costmodels.comm import p2p_time_s
    from planner.solver.problem import Constraints
    from planner.solver.search import plan_model
    from tests.planner_fixtures import analysed_llama

    cluster = load_cluster("dgx-h100")
    pin = Constraints(tp=1, pp=2, dp=1, max_devices=2)
    gpt2 = analysed_gpt("124m")
    syncs = {}
    for grads in ("param", "fp32"):
        work = WorkloadSpec("train", 4, 256, dtype="bf16", grad_reduce_dtype=grads)
        syncs[grads] = plan_model(gpt2, cluster, work, pin).predicted.grad_sync_s
    message = 50257 * 768 * 2.0  # bf16 gradients of the tied (vocab x hidden) weight
    assert p2p_time_s(message, cluster, False) < syncs["param"] < 1.5 * p2p_time_s(message, cluster, False)
    assert syncs["fp32"] == pytest.approx(2 * syncs["param"], rel=0.2)  # twice the bytes
    untied = plan_model(analysed_llama("tiny"), cluster, WorkloadSpec("train", 4, 64), pin)
    assert untied.predicted.grad_sync_s == 0.0


def test_a_block_called_on_two_pipeline_ranks_prices_its_gradient_exchange() -> None:
    """tests/models/reused_block.py calls block b0 at depths 0 and 3: at pp=2 the two ranks each hold a
    copy and swap its gradients after the backward (`runtime.pipeline.sum_tied_gradients`), which the
    prediction left out. With dp=1 and no tied embedding, the step's gradient sync is that exchange:
    one message of the block's gradients and the add; at pp=1 there is none. A block called at every
    depth (ALBERT-style) is traced whole so that the sharing is seen at every layer."""
    from costmodels.comm import p2p_time_s
    from planner.cli.workflow import prepare
    from planner.solver.problem import Constraints
    from planner.solver.search import plan_model

    cluster = load_cluster("dgx-h100")
    models = Path(__file__).parent / "models"
    prepared = prepare(str(models / "reused_block.py"), "train")
    assert prepared.structure.shared_layers == ((0, 3),)
    block_bytes = 4.0 * sum(p.numel() for p in prepared.model_file.build().layers[0].parameters())
    syncs = {}
    for pp in (1, 2):
        pin = Constraints(tp=1, pp=pp, dp=1, max_devices=pp)
        syncs[pp] = plan_model(
            prepared.structure, cluster, WorkloadSpec("train", 4, 16), pin
        ).predicted.grad_sync_s
    message_s = p2p_time_s(block_bytes, cluster, False)
    assert syncs[1] == 0.0 and message_s < syncs[2] < 1.5 * message_s, (syncs, message_s)


def test_fp32_main_gradients_price_the_add_of_every_micro_batch() -> None:
    """With fp32 main gradients of bf16 parameters the run adds each micro-batch's gradients into them
    in the backward (`runtime.data_parallel._MainGrads`: read 4 + 2 bytes, write 4, per parameter): the
    step's compute grows by m such passes over the rank's parameters, here 4 micro-batches of the tiny
    Llama on one H100; fp32 parameters keep no main gradients and pay nothing."""
    from planner.solver.costing import MAIN_GRAD_ADD_BYTES_PER_PARAM
    from planner.solver.problem import Constraints
    from planner.solver.search import plan_model
    from tests.planner_fixtures import LLAMA_CONFIGS, Llama, analysed_llama

    cluster = load_cluster("dgx-h100")
    llama = analysed_llama("tiny")
    with torch.device("meta"):  # the whole model's parameters (the fixture captured 2 of its layers)
        params = sum(p.numel() for p in Llama(LLAMA_CONFIGS["tiny"]).parameters())
    pin = Constraints(tp=1, pp=1, dp=1, max_devices=1)

    def compute_s(dtype: str, grads: str) -> float:
        work = WorkloadSpec("train", 8, 64, dtype=dtype, grad_reduce_dtype=grads, micro_batches=4)
        return plan_model(llama, cluster, work, pin).predicted.compute_s

    dev = cluster.device
    one_pass = (
        params * MAIN_GRAD_ADD_BYTES_PER_PARAM / (dev.memory_bandwidth_bytes_per_s * dev.memory_efficiency)
    )
    added = compute_s("bf16", "fp32") - compute_s("bf16", "param")
    launches = llama.num_param_tensors * dev.launch_overhead_s
    assert added == pytest.approx(4 * (one_pass + launches), rel=0.01)
    assert compute_s("fp32", "fp32") == pytest.approx(compute_s("fp32", "param"))


def test_zero2_and_fsdp_price_their_gradient_copies_of_every_micro_batch_on_a_gpu() -> None:
    """ZeRO-2 and FSDP gather each unit's gradients into one flat reduce-scatter input every micro-batch
    and add the reduced mean into the rank's shard (`runtime.data_parallel.Zero2Adam._reduce`,
    `passes.fsdp.FsdpRuntime.reduce`): on a GPU, memory-bound passes on the compute stream beside the
    layers. Here the tiny Llama on 2 H100s, 4 micro-batches: ZeRO-2 with bf16 gradients moves (1 + 1) U
    + 5 U / 2 per micro-batch beyond ZeRO-1 (U: the rank's gradient bytes), FSDP with fp32 gradients
    2 U + 3 U + 5 x 2 U / 2, with three kernels per wrapping unit (four with FSDP's cast)."""
    from planner.solver.costing import sharded_grad_copy_s
    from planner.solver.problem import Constraints
    from planner.solver.search import plan_model
    from tests.planner_fixtures import LLAMA_CONFIGS, Llama, analysed_llama

    cluster = load_cluster("dgx-h100")
    llama = analysed_llama("tiny")
    with torch.device("meta"):
        params = sum(p.numel() for p in Llama(LLAMA_CONFIGS["tiny"]).parameters())
    dev = cluster.device
    bandwidth = dev.memory_bandwidth_bytes_per_s * dev.memory_efficiency
    units = len(llama.layers) + 1

    def compute_s(style: str, grads: str) -> float:
        work = WorkloadSpec("train", 8, 64, dtype="bf16", grad_reduce_dtype=grads, micro_batches=4)
        pin = Constraints(tp=1, pp=1, dp=2, max_devices=2, dp_style=style)
        return plan_model(llama, cluster, work, pin).predicted.compute_s

    grad_bytes = 2.0 * params  # bf16
    zero2 = compute_s("zero2", "param") - compute_s("zero1", "param")
    launch = dev.launch_overhead_s
    assert zero2 == pytest.approx(4 * (grad_bytes * (2 + 2.5) / bandwidth + 3 * units * launch), rel=0.01)
    # fp32 gradients: ZeRO-1 pays the main-gradient adds instead (its own test), FSDP the cast
    fsdp = compute_s("fsdp", "fp32") - compute_s("zero1", "param")
    assert fsdp == pytest.approx(4 * (grad_bytes * (2 + 3 + 5) / bandwidth + 4 * units * launch), rel=0.01)
    # a device that measured its writes into fresh memory (a calibrated CPU) prices FSDP's buffers in
    # the fresh-memory phase of `dp_sync_phases` instead
    measured = dataclasses.replace(
        cluster, device=dataclasses.replace(dev, fresh_write_bandwidth_bytes_per_s=3e9)
    )
    assert sharded_grad_copy_s(grad_bytes, price_context(llama, cluster, "fsdp")) > 0.0
    assert sharded_grad_copy_s(grad_bytes, price_context(llama, measured, "fsdp")) == 0.0


def price_context(structure, cluster, style: str):
    """A training CostContext of `structure` at dp 2 with `style` (fp32 gradients)."""
    from planner.plan import DataParallel, MeshShape
    from planner.solver.costing import CostContext
    from planner.solver.problem import MeshConfig

    config = MeshConfig(MeshShape(1, 1, 2), 4, dp_style=DataParallel(style))
    work = WorkloadSpec("train", 8, 64, dtype="bf16", grad_reduce_dtype="fp32", micro_batches=4)
    return CostContext(structure, cluster, work, config, "bf16")


@pytest.mark.parametrize(
    "style,grads,overlap",
    [("zero1", "fp32", False), ("zero1", "fp32", True), ("zero2", "param", False), ("zero2", "fp32", True),
     ("fsdp", "fp32", False), ("fsdp", "param", False)],
)  # fmt: skip
def test_the_ilp_prices_the_gradient_work_of_every_micro_batch_as_the_prediction_does(
    style: str, grads: str, overlap: bool
) -> None:
    """fp32 main-gradient adds and ZeRO-2's / FSDP's gradient copies run on the compute stream in every
    micro-batch (`costing.grad_accumulation_s`): the ILP charges them in each stage's time, as the
    prediction does, so nothing hides them behind compute (FSDP's window, the overlapped phases) and the
    objective is the predicted step (the tiny Llama on 2 H100s, 4 micro-batches)."""
    from planner.plan import DataParallel, MeshShape
    from planner.solver import ilp
    from planner.solver.ilp import IlpProblem
    from planner.solver.prediction import predict
    from planner.solver.problem import LadderPolicy, MeshConfig
    from planner.solver.search import price
    from tests.planner_fixtures import analysed_llama

    llama, cluster = analysed_llama("tiny"), load_cluster("dgx-h100")
    config = MeshConfig(MeshShape(1, 1, 2), 4, dp_style=DataParallel(style), overlap_grad_reduce=overlap)
    work = WorkloadSpec("train", 8, 64, dtype="bf16", grad_reduce_dtype=grads, micro_batches=4)
    tables = price(llama, cluster, work, config)
    policy = LadderPolicy.parse("none").for_layers(len(llama.layers))
    sol = ilp.solve(IlpProblem(tables, policy, 0.9 * cluster.device.memory_bytes))
    assert sol.objective == pytest.approx(predict(tables, sol.assignment).prediction.latency_s, rel=0.005)


def test_attention_cores_are_timed_against_the_calibrations_own(monkeypatch) -> None:
    """`costmodels.calibrate.attention_time_ratios`: a core's measured / priced time over the same for
    the calibration's own core (`SDPA_SHAPE`, forward) timed beside it, so the machine's speed of the
    moment cancels; training against three forward prices (a backward of 2.6 forwards reads 1.2)."""
    device = load_cluster("local-cpu", 2).device
    call = (4, 512, 512, 16, True)

    def price(b, h, q, k, hd, causal):
        flops, moved = (
            compute.attention_flops(b, h, q, k, hd, causal),
            compute.attention_bytes(b, h, h, q, k, hd, "fp32"),
        )
        return compute.op_time_s(flops, moved, device, "fp32", "attention", launch=False)  # fmt: skip

    reference = price(1, 16, 128, 128, 64, True)
    factor = {False: 3.0, True: 3.0 * 1.2}  # measured / priced of the call, in each mode

    def fake(train):
        def rates(fns, amounts, dev, budget_s):
            # the machine 2x slower than calibrated now: the reference and the call alike
            return [1 / (2 * reference), 1 / (2 * factor[train] * price(2, *call))], 1.0

        return rates

    for train, want in ((False, 3.0), (True, 1.2 * 3.0 / 3.0)):
        monkeypatch.setattr(cal, "interleaved_rates", fake(train))
        assert cal.attention_time_ratios([call], 2, device, "fp32", train=train) == pytest.approx(
            {call: want}
        )
    causal_cache = (4, 1, 512, 16, True)  # a causal core whose query and key lengths differ: left out
    assert cal.attention_time_ratios([causal_cache], 2, device, "fp32") == {}
    timed = dataclasses.replace(device, attention_time_ratios={call: 3.0})
    plain = compute.op_time_s(1e9, 1e6, device, "fp32", "attention", launch=False)
    assert compute.op_time_s(1e9, 1e6, timed, "fp32", "attention", launch=False, call=call) == pytest.approx(
        3 * plain
    )
    assert compute.op_time_s(1e9, 1e6, timed, "fp32", "attention", launch=False, call=(8, *call[1:])) == plain


def test_planning_on_a_calibrated_spec_times_the_models_attention_cores(monkeypatch) -> None:
    """The tiny Llama's attention core is timed at each TP degree's heads per rank (8 heads, 4 KV heads
    of 16: whole and split over 2) and each CP degree's block, at the workload's lengths, on a rank's
    share of the batch; its ratio reaches the plan's attention time."""
    prepared = workflow.prepare("examples/llama3.py", "train", batch_size=8, seq_len=64)
    calibrated = _as_calibrated(load_cluster("local-cpu", 2))
    seen = []

    def fake(calls, sequences, device, dtype, threads=1, budget_s=1.0, train=False):
        seen.append((sorted(calls), sequences, train))
        return dict.fromkeys(calls, 2.0)

    for name in ("matmul_shape_time_ratios", "conv_time_ratios", "activation_time_ratios"):
        monkeypatch.setattr(cal, name, lambda *a, **k: {})
    monkeypatch.setattr(cal, "attention_time_ratios", fake)
    monkeypatch.setattr(machine, "_SHAPE_RATIOS", {})
    constraints = workflow.constraints_from(1, 1, 1, "none")
    slower = workflow.make_plan(prepared, calibrated, constraints, "examples/llama3.py")
    # (8, 32, 32): a CP 2 rank's diagonal block (its all-to-all core is TP 2's, 4 heads over 64)
    assert seen == [([(4, 64, 64, 16, True), (8, 32, 32, 16, True), (8, 64, 64, 16, True)], 4, True)], seen
    monkeypatch.setattr(machine, "_SHAPE_RATIOS", {})
    monkeypatch.setattr(cal, "attention_time_ratios", lambda calls, *a, **k: dict.fromkeys(calls, 1.0))
    plain = workflow.make_plan(prepared, calibrated, constraints, "examples/llama3.py")
    assert slower.predicted.latency_s > plain.predicted.latency_s


def test_a_long_attention_core_is_timed_on_fewer_heads_or_left_out(monkeypatch) -> None:
    """A planning step times each attention core for a fraction of a second: a long one runs on fewer
    sequences, then fewer heads, and one too long even at one head of one sequence keeps its price."""
    device = load_cluster("local-cpu", 2).device
    shapes = []

    def runner(b, h, q, k, hd, causal, dt, train):
        shapes.append((b, h, q, k, hd))
        return lambda: None

    monkeypatch.setattr(cal, "_attention_runner", runner)
    monkeypatch.setattr(cal, "interleaved_rates", lambda fns, amounts, dev, budget_s: ([1e3] * len(fns), 1.0))
    medium, huge = (32, 1024, 1024, 128, True), (32, 65536, 65536, 128, True)
    ratios = cal.attention_time_ratios([medium, huge], 8, device, "fp32", train=True)
    assert set(ratios) == {medium}  # the 64k-token core is left out
    ((b, h, *_),) = [s for s in shapes if s[2] == 1024]
    assert b == 1 and 1 < h < 32

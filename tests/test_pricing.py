"""Every op of a captured graph is priced: convolutions by FLOPs from shapes, pooling, norms, unknown
ops as memory-bound (and listed); per-node overhead for every node; pipeline stages balanced by the
cost model's own figures. Fast: small models on CPU, no timing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from costmodels import compute
from costmodels.cluster import load_cluster
from planner.errors import InputError
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture
from planner.plan import MeshShape
from planner.solver import ilp
from planner.solver.costing import CostContext, graph_node_count, outside_nodes_time_s
from planner.solver.ilp import IlpProblem
from planner.solver.problem import Constraints, LadderPolicy, MeshConfig
from planner.solver.problem import WorkloadSpec as Workload
from planner.solver.search import plan_model, price
from planner.solver.stages import balanced_split, rebalance, solution_costs, stage_times_s
from tests.planner_fixtures import LLAMA_CONFIGS, Llama, analysed_llama, token_ids

REPO = Path(__file__).resolve().parents[1]


class _Conv(nn.Module):
    def __init__(self, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 32, 3, padding=1, groups=groups)
        self.norm = nn.BatchNorm2d(32)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(self.norm(self.conv(x)))).sum(dim=(2, 3))


@pytest.mark.parametrize("groups", [1, 4])
def test_convolution_flops_from_shapes(groups: int) -> None:
    x = torch.randn(2, 16, 8, 8)
    s = analyse(capture(_Conv(groups).eval(), (x,)))
    conv = next(c for c in s.node_costs.values() if c.op == "aten.conv2d")
    out = 2 * 32 * 8 * 8
    assert conv.kind == "conv"
    assert conv.flops == 2 * out * (16 // groups) * 9 + out  # + bias
    pool = next(c for c in s.node_costs.values() if c.op == "aten.max_pool2d")
    assert pool.kind == "pool" and pool.flops == out  # every window element read once
    norm = next(c for c in s.node_costs.values() if c.op == "aten.batch_norm")
    assert norm.kind == "memory" and norm.known and norm.flops > 0
    assert s.unknown_ops == [] and not s.token_model
    assert (s.batch_size, s.seq_len) == (2, 1)  # images have no sequence


def test_conv_time_scales_with_its_flops_and_uses_conv_efficiency() -> None:
    spec = load_cluster("local-cpu", nproc=1)
    dev = dataclasses.replace(spec.device, conv_efficiency=0.25, node_overhead_s=10e-6)
    cluster = dataclasses.replace(spec, device=dev)

    def predicted(size: int) -> float:
        s = analyse(capture(_Conv().eval(), (torch.randn(2, 16, size, size),)))
        ctx = CostContext(s, cluster, Workload("forward", 2, 1), MeshConfig(MeshShape(1, 1, 1), 1), "fp32")
        return outside_nodes_time_s(ctx)

    small, large = predicted(8), predicted(32)
    conv_flops = 2 * (2 * 32 * 32 * 32) * 16 * 9
    conv_s = conv_flops / (dev.peak_flops_per_s["fp32"] * 0.25)
    assert large - small > 0.9 * conv_s  # 16x the pixels: the conv dominates the difference
    assert small > 7 * 10e-6  # every node pays its overhead (conv, norm, relu, pool, sum, ...)
    assert compute.op_time_s(conv_flops, 0, dev, "fp32", "conv", launch=False) == pytest.approx(conv_s)


class _Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.special.bessel_j0(x))


def test_unknown_op_is_priced_as_memory_bound_and_listed() -> None:
    x = torch.randn(64, 256)
    s = analyse(capture(_Odd(), (x,)))
    assert s.unknown_ops == ["aten.special_bessel_j0"]
    cost = next(c for c in s.node_costs.values() if c.op == "aten.special_bessel_j0")
    assert cost.kind == "memory" and not cost.known
    assert cost.bytes_read == cost.bytes_written == x.numel() * 4
    plan = plan_model(s, load_cluster("local-cpu", nproc=1), Workload("forward", 64, 1), Constraints())
    assert plan.unpriced_ops == ["aten.special_bessel_j0"]
    assert plan.predicted.latency_s > 0


class _SortScan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cumsum(self.fc(x), dim=-1)
        return torch.sort(h, dim=-1).values + torch.topk(h, 4, dim=-1).values.sum()


def test_sorts_and_scans_are_listed_as_priced_from_their_sizes_only() -> None:
    """sort / topk (which return values and indices) and cumsum run far below memory bandwidth on a
    CPU: the cost model prices them from their sizes and says so, rather than calling them known."""
    s = analyse(capture(_SortScan(), (torch.randn(64, 256),)))
    assert s.unknown_ops == ["aten.cumsum", "aten.sort", "aten.topk"]


def test_node_overhead_is_charged_for_every_node_and_replaces_launch() -> None:
    with torch.device("meta"):
        model = Llama(LLAMA_CONFIGS["tiny"])
    s = analyse(capture(model, token_ids(LLAMA_CONFIGS["tiny"].vocab_size, 2, 32), {}))
    cpu = load_cluster("local-cpu", nproc=1)
    base = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, node_overhead_s=None))
    with_overhead = dataclasses.replace(base, device=dataclasses.replace(base.device, node_overhead_s=20e-6))
    wl = Workload("forward", s.batch_size, s.seq_len)
    plain = plan_model(s, base, wl, Constraints(tp=1, pp=1, dp=1)).predicted.latency_s
    loaded = plan_model(s, with_overhead, wl, Constraints(tp=1, pp=1, dp=1)).predicted.latency_s
    nodes = graph_node_count(list(s.node_costs), s)
    assert nodes == sum(graph_node_count(layer.nodes, s) for layer in s.layers) + graph_node_count(
        [n for n in s.node_costs if all(n not in layer.nodes for layer in s.layers)], s
    )
    # every node pays 20 us; the per-op launch (3 us, at most once per op) is no longer charged on top
    assert nodes * (20e-6 - base.device.launch_overhead_s) <= loaded - plain <= nodes * 20e-6


def _problem(structure, cluster, mesh: MeshConfig) -> IlpProblem:
    workload = Workload("forward", structure.batch_size, structure.seq_len)
    tables = price(structure, cluster, workload, mesh)
    policy = LadderPolicy.parse("none").for_layers(len(structure.layers))
    return IlpProblem(tables, policy, cluster.device.memory_bytes * Constraints().memory_fraction)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_stage_split_is_never_slower_than_the_balanced_one(micro_batches: int) -> None:
    """4 identical layers on pp=2: the chosen split's slowest stage is no slower (by the model's own
    per-layer costs) than the even [[0, 1], [2, 3]] and than balanced_split's."""
    s = analysed_llama("tiny")
    cluster = load_cluster("local-cpu", nproc=4)
    prob = _problem(s, cluster, MeshConfig(MeshShape(1, 2, 1), micro_batches))
    sol = ilp.solve(prob)
    assert sol.feasible
    costs = solution_costs(prob.tables, sol.assignment)
    chosen = max(stage_times_s(prob.tables, costs, [st[0] for st in sol.assignment.stages]))
    even = max(stage_times_s(prob.tables, costs, [0, 2]))
    best = balanced_split(prob.tables, costs, prob.memory_cap_bytes)
    assert chosen <= even * (1 + 1e-9)
    assert chosen <= max(stage_times_s(prob.tables, costs, best)) * (1 + 1e-9)


def test_nodes_before_the_first_layer_are_priced_on_the_first_stage() -> None:
    """An HF Llama computes its position ids and RoPE tables before the first layer (its causal mask too
    where it builds one: not here, SDPA's is_causal): on a pipeline they run on the first stage (the
    split sends them on), so the prediction charges them there, and the final norm after the last layer
    on the last stage."""
    from planner.cli.workflow import prepare  # noqa: PLC0415

    s = prepare(str(REPO / "examples" / "hf_llama.py"), "forward").structure
    cluster = load_cluster("local-cpu", nproc=2)
    dev = dataclasses.replace(cluster.device, node_overhead_s=10e-6)
    cluster = dataclasses.replace(cluster, device=dev)
    ctx = CostContext(
        s, cluster, Workload("forward", s.batch_size, s.seq_len), MeshConfig(MeshShape(1, 2, 1), 1), "fp32"
    )
    before, after = (
        outside_nodes_time_s(ctx, before_layers=True),
        outside_nodes_time_s(ctx, before_layers=False),
    )
    assert before > 8 * 10e-6  # ~12 nodes: position ids, RoPE tables
    assert after > 0  # the final norm
    assert before + after == pytest.approx(outside_nodes_time_s(ctx))
    tables = price(
        s, cluster, Workload("forward", s.batch_size, s.seq_len), MeshConfig(MeshShape(1, 2, 1), 1)
    )
    assert tables.ends.first_stage_compute_s == pytest.approx(before)
    sol = ilp.solve(_problem(s, cluster, MeshConfig(MeshShape(1, 2, 1), 1)))
    costs = solution_costs(tables, sol.assignment)
    assert costs.first_time_s >= before
    assert costs.last_time_s >= after


def test_rebalance_moves_an_unbalanced_split() -> None:
    s = analysed_llama("tiny")
    prob = _problem(s, load_cluster("local-cpu", nproc=4), MeshConfig(MeshShape(1, 2, 1), 1))
    assignment = ilp.solve(prob).assignment
    assignment.stages = [[0], [1, 2, 3]]  # what CBC returned before: the balance term is within its gap
    assert rebalance(prob.tables, assignment, prob.memory_cap_bytes)
    assert assignment.stages == [[0, 1], [2, 3]]
    assert not rebalance(prob.tables, assignment, prob.memory_cap_bytes)  # already balanced: unchanged


class _BatchMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = h - h.mean(dim=0, keepdim=True)  # each sample's output depends on the others
        return self.down(h.softmax(dim=-1)) + h.sum(dim=-1, keepdim=True).mean(dim=-1, keepdim=True)


def test_a_reduction_over_the_batch_keeps_the_batch_whole() -> None:
    """mean over dim 0 mixes samples: no data parallelism or micro-batches (pinned: a clear error);
    reductions over other dims (softmax, sum over the last) do not count."""
    s = analyse(capture(_BatchMean(), (torch.randn(4, 16, 64),)))
    assert len(s.batch_mixing) == 1 and s.batch_mixing[0].startswith("aten.mean (test_pricing.py:")
    cluster = load_cluster("local-cpu", nproc=2)
    plan = plan_model(s, cluster, Workload("forward", 4, 16), Constraints())
    assert plan.dp == 1 and any("reduces over the batch dimension" in e for e in plan.excluded)
    with pytest.raises(InputError, match="reduces over the batch dimension"):
        plan_model(s, cluster, Workload("forward", 4, 16), Constraints(dp=2))


def test_a_norm_computing_in_fp32_on_a_bf16_stream_keeps_its_fp32_copy() -> None:
    """Meta's and HF's RMSNorm copy a 16-bit stream to fp32 before its statistics (`x.float()`), and
    autograd keeps that copy for the norm's backward: 4 bytes an element, not the 16-bit input's 2. A
    Llama captured in bf16 shows both norms of each layer doing it (an fp32 capture cannot: the copy
    is a no-op there), and a bf16 training step prices 2 more bytes per element for each (the tiny
    Llama at 8 x 512 tokens on this CPU: heap peak / predicted 1.44 -> 1.31)."""
    config = dataclasses.replace(LLAMA_CONFIGS["tiny"], n_layers=2)
    with torch.device("meta"):
        model = Llama(config)
    fp32 = analyse(capture(model, token_ids(config.vocab_size, 1, 16), {}))
    bf16 = analyse(capture(model.to(torch.bfloat16), token_ids(config.vocab_size, 1, 16), {}))
    assert [layer.norm_upcasts for layer in fp32.layers] == [0, 0]
    assert [layer.norm_upcasts for layer in bf16.layers] == [2, 2]
    cluster = load_cluster("dgx-h100")
    work = Workload("train", 8, 512, dtype="bf16")
    mesh = MeshConfig(MeshShape(1, 1, 1), 1)
    without = dataclasses.replace(
        bf16, layers=[dataclasses.replace(layer, norm_upcasts=0) for layer in bf16.layers]
    )
    kept, plain = (
        next(iter(price(s, cluster, work, mesh).graphs.values())).fixed_activation_bytes
        for s in (bf16, without)
    )
    assert kept - plain == pytest.approx(2 * 2 * 8 * 512 * config.dim)


def test_an_fp32_model_trained_in_bf16_is_priced_with_the_norms_fp32_copies() -> None:
    """examples/llama3.py builds fp32 weights, where its norms' `x.float()` copies nothing; planned for
    bf16 training, the planner captures it once more in bf16 to see the copies the run keeps (its two
    norms in each layer), and leaves the model's weights in their dtype."""
    from planner.cli import workflow  # noqa: PLC0415

    path = str(Path(__file__).resolve().parents[1] / "examples" / "llama3.py")
    bf16 = workflow.prepare(path, "train", batch_size=2, seq_len=32, dtype="bf16")
    assert bf16.structure.dtype == "fp32"
    assert {layer.norm_upcasts for layer in bf16.structure.layers} == {2}
    for dtype in (None, "fp32"):
        plain = workflow.prepare(path, "train", batch_size=2, seq_len=32, dtype=dtype)
        assert {layer.norm_upcasts for layer in plain.structure.layers} == {0}
    served = workflow.prepare(path, "forward", batch_size=2, seq_len=32, dtype="bf16")
    assert {layer.norm_upcasts for layer in served.structure.layers} == {0}  # nothing kept for a backward

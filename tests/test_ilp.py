"""The inner ILP and the mesh search on hand-built structures: exactness against brute force, sizes,
named constraints, pipeline split, ladder, solver status. Fast: no tracing."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pulp
import pytest

from costmodels import compute
from costmodels.cluster import load_cluster
from costmodels.comm import all_gather_time_s, all_reduce_time_s, reduce_scatter_time_s
from planner.errors import InputError
from planner.frontend.analysis import NodeCost
from planner.plan import DataParallel, Layout, MeshShape, Plan, Recompute, Schedule
from planner.solver import ilp, prediction
from planner.solver.costing import (
    CostContext,
    attention_core_options,
    build_layer_graph,
    conversion_time_s,
    gradient_sync_time_s,
    head_split_queries,
    interleaved_chunks,
    layer_node_times_s,
    optimizer_step_time_s,
    p2p_message_bytes,
    p2p_stage_time_s,
    pipeline_buffer_bytes,
    recompute_input_bytes,
    sequence_regather_s,
    stage_p2p_time_s,
    step_time_s,
    stream_conversion_time_s,
)
from planner.solver.ilp import IlpProblem
from planner.solver.prediction import layer_breakdown, predict
from planner.solver.problem import Assignment, Constraints, LadderMode, LadderPolicy, MeshConfig, WorkloadSpec
from planner.solver.search import plan_model, price
from planner.solver.stages import SplitCosts, balanced_split
from tests.planner_fixtures import handmade_llama

R, S, P = Layout.REPLICATE, Layout.SHARD, Layout.PARTIAL


@pytest.fixture(scope="module")
def h100():
    return load_cluster("dgx-h100")


def config(tp: int, pp: int, dp: int, micro_batches: int) -> MeshConfig:
    return MeshConfig(MeshShape(tp, pp, dp), micro_batches)


def problem(structure, cluster, workload, mesh: MeshConfig, ladder="none", cap=None) -> IlpProblem:
    """The ILP plan_model solves for `mesh` (default memory cap: Constraints' share of a device)."""
    tables = price(structure, cluster, workload, mesh)
    policy = LadderPolicy.parse(ladder).for_layers(len(structure.layers))
    usable = cluster.device.memory_bytes * Constraints().memory_fraction
    return IlpProblem(tables, policy, cap if cap is not None else usable)


def evaluate(prob: IlpProblem, choices: dict, stages: list[list[int]], ladder_layers=()) -> float:
    """Predicted latency of an assignment on the problem's mesh."""
    return predict(prob.tables, Assignment(choices, stages, list(ladder_layers))).prediction.latency_s


def test_ladder_policy_parse() -> None:
    assert LadderPolicy.parse("none").eligible(8) == []
    assert LadderPolicy.parse("upper:3").eligible(8) == [5, 6, 7]
    assert LadderPolicy.parse("auto") == LadderPolicy(LadderMode.AUTO, None)
    assert LadderPolicy.parse("auto").for_layers(8) == LadderPolicy(LadderMode.AUTO, 8)
    assert LadderPolicy.parse("auto:max=2").eligible(8) == [6, 7]
    for text in ("none", "upper:3", "auto", "auto:max=2"):
        assert str(LadderPolicy.parse(text)) == text
    for bad in ("upper", "upper:x", "auto:max=", "all"):
        with pytest.raises(InputError, match="ladder"):
            LadderPolicy.parse(bad)
    with pytest.raises(InputError, match="--ladder must be"):
        LadderPolicy.parse("sideways", option="--ladder")
    with pytest.raises(InputError, match="only 8 layers"):
        LadderPolicy.parse("upper:9").for_layers(8)


def test_conversion_costs(h100) -> None:
    structure = handmade_llama()
    ctx = CostContext(structure, h100, WorkloadSpec("forward", 1, 128), config(8, 1, 1, 1), "bf16")
    group, n = ctx.tp_group(), 1e6
    assert conversion_time_s(P, R, n, ctx) == all_reduce_time_s(n, group, h100)
    assert conversion_time_s(S, R, n, ctx) == all_gather_time_s(n, group, h100)
    assert conversion_time_s(P, S, n, ctx) == reduce_scatter_time_s(n, group, h100)
    assert conversion_time_s(R, S, n, ctx) == 0.0  # a local slice
    assert math.isinf(conversion_time_s(R, P, n, ctx))  # nothing consumes a partial sum
    train = CostContext(structure, h100, WorkloadSpec("train", 8, 128), config(8, 1, 1, 1), "bf16")
    assert conversion_time_s(P, R, n, train) == 2 * all_reduce_time_s(n, group, h100)


def test_ilp_matches_brute_force(h100) -> None:
    """The linearised edge variables price every combination exactly: the ILP finds the true optimum."""
    structure = handmade_llama(num_layers=2, hidden=2048, heads=16, kv_heads=8, ffn=8192)
    prob = problem(structure, h100, WorkloadSpec("forward", 4, 512), config(4, 1, 1, 1))
    sol = ilp.solve(prob)
    assert sol.status == "Optimal Solution Found" and sol.assignment is not None
    (key,) = prob.graphs
    graph = prob.graphs[key]
    best = math.inf
    ends_choices = {
        ("ends", op.name): min(op.options, key=lambda o: o.compute_s + o.comm_s).name for op in prob.ends.ops
    }
    for combo in itertools.product(*[op.options for op in graph.ops]):
        choices = {(key, op.name): o.name for op, o in zip(graph.ops, combo)} | ends_choices
        best = min(best, evaluate(prob, choices, [[0, 1]]))
    chosen = evaluate(prob, sol.assignment.choices, sol.assignment.stages)
    assert chosen == pytest.approx(best, rel=1e-9)
    assert sol.objective == pytest.approx(best, rel=1e-6)


def test_a_head_parallel_core_takes_a_column_parallel_query(h100) -> None:
    """The TP pass splits an attention core by the heads its query projection's column split carries (a
    replicated query runs the core replicated: `passes.tp_rules.rule_sdpa`), so the ILP never pairs a
    head-parallel core with a query that is not column-parallel, though the conversion R -> S into the
    core is a free slice. Here the query's column split is priced above its replicated option (as a CPU's
    shape timings did for Llama-3-8B: 0.40 s against 0.30 s), which makes that pairing the cheapest of
    all; the ILP takes the cheapest pairing the pass runs, and `--why`'s block table prices a replicated
    query with a replicated core."""
    from planner.solver import explain  # noqa: PLC0415

    structure = handmade_llama(num_layers=2, hidden=2048, heads=16, kv_heads=8, ffn=8192)
    prob = problem(structure, h100, WorkloadSpec("forward", 1, 8192), config(2, 1, 1, 1))
    (key,) = prob.graphs
    graph = prob.graphs[key]
    assert head_split_queries(graph) == [("core", "q")]
    q = graph.op("q")
    q.option("colwise").compute_s = 10 * q.option("replicate").compute_s
    ends = {
        ("ends", op.name): min(op.options, key=lambda o: o.compute_s + o.comm_s).name for op in prob.ends.ops
    }
    priced = []
    for combo in itertools.product(*[op.options for op in graph.ops]):
        choices = {(key, op.name): o.name for op, o in zip(graph.ops, combo)} | ends
        runs = not (choices[(key, "core")] == "head" and choices[(key, "q")] != "colwise")
        priced.append((evaluate(prob, choices, [[0, 1]]), runs))
    assert not min(priced)[1]  # the cheapest pairing is one the pass would not run
    sol = ilp.solve(prob)
    chosen = sol.assignment.choices
    assert chosen[(key, "core")] != "head" or chosen[(key, "q")] == "colwise"
    assert evaluate(prob, chosen, sol.assignment.stages) == pytest.approx(
        min(t for t, runs in priced if runs)
    )
    table = explain.block_table(graph, key, "attention", prob.tables.ctx)
    assert table[("q", "replicate")] == table[("core", "replicate")]


def test_identical_layers_share_variables(h100) -> None:
    sizes = []
    for depth in (4, 64):
        prob = problem(
            handmade_llama(num_layers=depth), h100, WorkloadSpec("forward", 1, 256), config(8, 1, 1, 1)
        )
        sizes.append(ilp.solve(prob).num_variables)
    assert sizes[0] == sizes[1]


def test_named_constraints_and_infeasible_memory(h100) -> None:
    prob = problem(handmade_llama(), h100, WorkloadSpec("forward", 1, 256), config(2, 2, 1, 1), cap=1e6)
    model = ilp.lp_model(prob)
    for name in (
        "onehot_g0_q",
        "edge_src_g0_gate_act_colwise",
        "memory_0",
        "memory_1",
        "slowest_1",
        "start_1",
    ):
        assert model.get_constraint_by_name(name) is not None, name
    sol = ilp.solve(prob)
    assert not sol.feasible and sol.assignment is None and sol.status in pulp.LpSolution.values()


def test_pipeline_balances_non_identical_layers(h100) -> None:
    """Six light layers then two heavy ones: the balanced split is not the even one."""
    structure = handmade_llama(
        num_layers=8, hidden=2048, heads=16, kv_heads=8, ffn_per_layer=[2048] * 6 + [32768] * 2
    )
    prob = problem(structure, h100, WorkloadSpec("forward", 8, 1024), config(8, 2, 1, 8))
    sol = ilp.solve(prob).assignment
    assert sol is not None
    best = min(evaluate(prob, sol.choices, [list(range(cut)), list(range(cut, 8))]) for cut in range(1, 8))
    assert evaluate(prob, sol.choices, sol.stages) == pytest.approx(best, rel=1e-6)
    assert len(sol.stages[0]) > len(sol.stages[1])


def test_balanced_split_matches_brute_force(h100) -> None:
    rng = random.Random(0)
    structure = handmade_llama(num_layers=9)
    prob = problem(structure, h100, WorkloadSpec("forward", 8, 256), config(1, 3, 1, 4))
    times = [rng.uniform(1.0, 5.0) for _ in range(9)]
    zeros = [0.0] * 9
    starts = balanced_split(prob.tables, SplitCosts(times, zeros, zeros), prob.memory_cap_bytes)
    p2p = p2p_stage_time_s(prob.ctx)

    def slowest(cuts):
        bounds = [0, *cuts, 9]
        return max(sum(times[bounds[s] : bounds[s + 1]]) + (p2p if s < 2 else 0.0) for s in range(3))

    optimum = min(slowest(c) for c in itertools.combinations(range(1, 9), 2))
    assert slowest(starts[1:]) == pytest.approx(optimum, rel=1e-6)


def test_deep_pipeline_uses_split_search(h100) -> None:
    prob = problem(handmade_llama(num_layers=64), h100, WorkloadSpec("train", 64, 256), config(1, 32, 1, 64))
    prob.memory_cap_bytes = None
    sol = ilp.solve(prob).assignment
    assert sol is not None and len(sol.stages) == 32
    assert [i for stage in sol.stages for i in stage] == list(range(64))  # contiguous, every layer once
    # 64 identical layers over 32 stages: the last also holds the LM head and the loss over its 256 x
    # 32k logits (more than two layers' time here), so it sets the step: it holds one layer, the
    # others at most three (no stage slower than it)
    assert len(sol.stages[-1]) == 1 and max(map(len, sol.stages)) == 3


def test_ladder_auto_is_contiguous_with_top() -> None:
    pcie = load_cluster("h100-pcie")
    structure = handmade_llama(num_layers=12, hidden=8192, heads=64, kv_heads=8, ffn=28672)
    plan = plan_model(
        structure,
        pcie,
        WorkloadSpec("decode", 1, 1, context=512),
        Constraints(tp=8, ladder=LadderPolicy.parse("auto:max=5")),
    )
    assert plan.ladder_layers == [7, 8, 9, 10, 11]
    laddered = [c for c in plan.predicted.per_layer if c.layer in plan.ladder_layers]
    assert all(c.overlapped_comm_s > 0 for c in laddered)


def test_conv1d_splits_transpose_dims(h100) -> None:
    structure = handmade_llama(num_layers=2, hidden=4096, heads=32, kv_heads=32, ffn=16384)
    for layer in structure.layers:
        for p in layer.attention.projections + layer.mlp.projections:
            p.weight_out_dim = 1  # HF Conv1D: weight is (in, out)
    plan = plan_model(structure, h100, WorkloadSpec("forward", 8, 2048), Constraints(tp=8, pp=1, dp=1))
    assert plan.splits["layers.0.w1.weight"].style == "colwise" and plan.splits["layers.0.w1.weight"].dim == 1
    assert plan.splits["layers.0.w2.weight"].style == "rowwise" and plan.splits["layers.0.w2.weight"].dim == 0


def test_plan_yaml_round_trip_and_explanations(tmp_path, h100) -> None:
    plan = plan_model(
        handmade_llama(), h100, WorkloadSpec("forward", 2, 512), Constraints(), model_name="hand"
    )
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    assert Plan.from_yaml(path) == plan
    assert plan.solver.status in pulp.LpSolution.values() and plan.solver.num_variables > 0
    assert plan.baseline is not None and plan.mesh_candidates
    assert {d.subject for d in plan.decisions} >= {"mesh", "lm_head", "embedding0"}
    assert plan.predicted.latency_s == pytest.approx(
        plan.predicted.compute_s + plan.predicted.exposed_comm_s + plan.predicted.bubble_s
    )


def test_pinned_tp_with_indivisible_heads_is_reported(h100) -> None:
    structure = handmade_llama(num_layers=2, hidden=1536, heads=12, kv_heads=4, ffn=6144)
    plan = plan_model(structure, h100, WorkloadSpec("forward", 1, 256), Constraints(tp=8, pp=1, dp=1))
    assert plan.tp == 8
    assert any("12 heads not divisible by 8" in e for e in plan.excluded)
    assert plan.predicted.per_layer[0].strategy["core"] == "replicate"


def test_bad_constraints_are_input_errors(h100) -> None:
    with pytest.raises(InputError, match="dp=3 does not divide the batch size 4"):
        plan_model(handmade_llama(), h100, WorkloadSpec("forward", 4, 256), Constraints(dp=3))
    with pytest.raises(InputError, match="pp=9 exceeds"):
        plan_model(handmade_llama(), h100, WorkloadSpec("forward", 4, 256), Constraints(pp=9))
    with pytest.raises(InputError, match="only 4 layers"):
        plan_model(
            handmade_llama(),
            h100,
            WorkloadSpec("forward", 4, 256),
            Constraints(ladder=LadderPolicy.parse("upper:5")),
        )
    with pytest.raises(InputError, match="micro_batches"):
        WorkloadSpec("train", 4, 256, micro_batches=0)
    with pytest.raises(InputError, match="workload 'serve'"):
        WorkloadSpec("serve", 4, 256)
    with pytest.raises(InputError, match="memory_fraction"):
        Constraints(memory_fraction=1.5)
    with pytest.raises(InputError, match="schedule"):
        Constraints(schedule="zero-bubble")


def test_time_limit_reports_status_and_gap(h100) -> None:
    structure = handmade_llama(num_layers=40, ffn_per_layer=[4096 + 512 * (i % 5) for i in range(40)])
    prob = problem(structure, h100, WorkloadSpec("train", 64, 512), config(2, 4, 1, 16))
    prob = dataclasses.replace(prob, time_limit_s=1.0)
    sol = ilp.solve(prob)
    assert sol.status in ("Optimal Solution Found", "Solution Found")
    assert sol.gap == 0.0 if sol.status == "Optimal Solution Found" else sol.gap >= 0.0


def test_attention_dropout_prices_the_fused_kernel_slower_in_training_only(h100) -> None:
    """An SDPA core with dropout on its probabilities (drawn inside the fused kernel) costs the device's
    dropout_time_factor (NVIDIA/TransformerEngine#3312 on Hopper: 1.03) times the same core without it,
    forward + backward and the forward that selective recomputation reruns; eval runs no dropout."""
    attn = handmade_llama(num_layers=1).layers[0].attention
    dropped = dataclasses.replace(attn, dropout_p=0.1)
    assert h100.device.attention.dropout_time_factor == pytest.approx(1.03)

    def priced(core, kind: str) -> dict[str, tuple[float, float]]:
        ctx = CostContext(
            handmade_llama(num_layers=1), h100, WorkloadSpec(kind, 2, 4096), config(2, 1, 1, 1), "bf16"
        )
        return {o.name: (o.compute_s, o.selective_s) for o in attention_core_options(core, ctx)[0]}

    plain, with_dropout = priced(attn, "train"), priced(dropped, "train")
    assert set(plain) == {"replicate", "head"}
    for name, (compute_s, forward_s) in plain.items():
        assert with_dropout[name] == pytest.approx((1.03 * compute_s, 1.03 * forward_s))
    assert priced(dropped, "forward") == priced(attn, "forward")


def test_attention_core_of_few_heads_prices_its_blocks_waves(h100) -> None:
    """A training core's thread blocks (`compute.attention_blocks`: 128 queries of a head each) run in
    waves over the H100's 132 SMs: 14 heads of one 4,096-token sequence are 448 blocks, four waves of
    which the last is 40% full (0.848 of the SMs' time busy), four sequences 1,792 blocks (0.970)."""
    s = handmade_llama(num_layers=1, hidden=1792, heads=14, kv_heads=14, ffn=2048)  # head dim 128
    launches = h100.device.launch_overhead_s * (1.0 + h100.device.attention.backward_time_factor)

    def core_s(batch: int) -> float:
        ctx = CostContext(s, h100, WorkloadSpec("train", batch, 4096), config(1, 1, 1, 1), "bf16")
        options = attention_core_options(s.layers[0].attention, ctx)[0]
        return next(o.compute_s for o in options if o.name == "replicate") - launches

    assert core_s(4) / (4 * core_s(1)) == pytest.approx((448 / 528) / (1792 / 1848), rel=1e-3)


def test_a_prefill_core_runs_at_the_fused_kernels_fitted_rate(h100) -> None:
    """Forward passes (a prefill, a forward-only step) price the attention core as training does: at the
    fused kernel's rate for its key length and mask and its blocks' waves (`DeviceSpec.attention`),
    not at the GEMMs' flat efficiency (0.8 of peak, faster than any published Hopper attention)."""
    s = handmade_llama(num_layers=1)  # 16 heads of 64
    attn = s.layers[0].attention
    ctx = CostContext(s, h100, WorkloadSpec("forward", 2, 4096), config(1, 1, 1, 1), "bf16")
    core_s = next(o.compute_s for o in attention_core_options(attn, ctx)[0] if o.name == "replicate")
    flops = compute.attention_flops(2, 16, 4096, 4096, 64, True)
    moved = compute.attention_bytes(2, 16, 16 * attn.num_kv_heads / attn.num_heads, 4096, 4096, 64, "bf16")
    blocks = compute.attention_blocks(2, 16, 4096, 64)
    fitted = compute.op_time_s(flops, moved, h100.device, "bf16", "attention", seq=(4096, 4096, True, blocks))
    assert core_s == pytest.approx(fitted, rel=1e-9)
    rate = compute.attention_kernel_efficiency(
        4096, True, h100.device.attention, blocks, h100.device.gemm.sms
    )
    assert rate < 0.65 < h100.device.matmul_efficiency


def test_layer_ops_priced_node_by_node() -> None:
    """Non-projection ops: bytes / bandwidth per node (scaled from the captured 16 tokens to 32), one
    launch per block; attention ops join the core (/tp with heads), MLP ops the activation (/tp)."""
    s = handmade_llama(num_layers=1, dtype="fp32")  # captured batch 1 x seq 16
    layer = s.layers[0]

    def cost(read: float, written: float) -> NodeCost:
        return NodeCost(1000.0, read, written, (), "fp32", "")

    s.node_costs = {
        "rope": cost(1e6, 1e6), "rope2": cost(5e5, 5e5), "view": cost(0.0, 0.0),
        "act": cost(2e6, 1e6), "norm": cost(1e6, 1e6), "sdpa_0": cost(9e9, 9e9),
    }  # fmt: skip
    layer.nodes = list(s.node_costs)
    layer.node_blocks = {"rope": "attention", "rope2": "attention", "view": "attention",
                         "act": "mlp", "norm": "stream", "sdpa_0": "core"}  # fmt: skip
    cluster = load_cluster("local-cpu", nproc=2)  # 20 GB/s, launch 3 us, fp32 0.1 TFLOP/s
    # the per-launch model (GPUs): no per-node overhead (tests/test_pricing.py covers that one)
    cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, node_overhead_s=None))
    ctx = CostContext(s, cluster, WorkloadSpec("forward", 2, 16), config(2, 1, 1, 1), "fp32")
    times = layer_node_times_s(layer, ctx)
    # x2 tokens: rope 4e6 B -> 200 us, rope2 2e6 B -> 100 us; act 6e6 B -> 300 us; norm 4e6 B -> 200 us
    assert times["attention"] == pytest.approx(300e-6 + 3e-6)
    assert times["mlp"] == pytest.approx(300e-6 + 3e-6)
    assert times["stream"] == pytest.approx(200e-6 + 3e-6)
    graph = build_layer_graph(layer, ctx)
    assert graph.fixed_compute_s == pytest.approx(203e-6)
    bare = {o.name: o.compute_s for o in attention_core_options(layer.attention, ctx)[0]}
    core = graph.op("core")
    assert core.option("replicate").compute_s == pytest.approx(bare["replicate"] + 303e-6)
    assert core.option("head").compute_s == pytest.approx(bare["head"] + 303e-6 / 2)
    assert graph.op("act").option("replicate").compute_s == pytest.approx(303e-6)
    assert graph.op("act").option("shard").compute_s == pytest.approx(303e-6 / 2)


def test_plan_prices_and_records_its_pipeline_schedule(h100) -> None:
    """The plan records the schedule it was priced with. GPipe holds every micro-batch's activations on
    every stage, 1F1B at most pp - s: the same assignment needs more memory under GPipe, in as much time
    (the bubble is the same)."""
    structure = handmade_llama(num_layers=8)
    work = WorkloadSpec("train", 16, 512, micro_batches=8)
    plans = {
        schedule: plan_model(structure, h100, work, Constraints(tp=1, pp=4, dp=1, schedule=schedule))
        for schedule in Schedule
    }
    for schedule, plan in plans.items():
        assert plan.schedule is schedule and (plan.pp, plan.micro_batches) == (4, 8)
        assert Plan.from_dict(plan.to_dict()).schedule is schedule
    assert plans[Schedule.ONE_F_ONE_B].predicted.bubble_s > 0
    solved = ilp.solve(problem(structure, h100, work, config(1, 4, 1, 8))).assignment
    assert solved is not None and set(solved.recompute.values()) <= {Recompute.NONE}
    priced = {
        schedule: predict(price(structure, h100, work, MeshConfig(MeshShape(1, 4, 1), 8, schedule)), solved)
        for schedule in Schedule
    }
    gpipe, one_f_one_b = priced[Schedule.GPIPE], priced[Schedule.ONE_F_ONE_B]
    assert gpipe.prediction.latency_s == pytest.approx(one_f_one_b.prediction.latency_s, rel=1e-12)
    # stage 0 holds min(pp, m) = 4 micro-batches under 1F1B, the last stage 1; GPipe holds all 8 on each
    assert gpipe.stages[0].memory_bytes > one_f_one_b.stages[0].memory_bytes
    assert gpipe.stages[3].memory_bytes > one_f_one_b.stages[3].memory_bytes
    assert gpipe.prediction.peak_memory_bytes > one_f_one_b.prediction.peak_memory_bytes


def test_one_f_one_b_with_fewer_micro_batches_than_stages_is_gpipe(h100) -> None:
    """1F1B with m < pp never reaches its steady state (and torch's Schedule1F1B refuses it): the plan
    records and prices GPipe, which is what runs."""
    structure = handmade_llama(num_layers=8)
    work = WorkloadSpec("train", 2, 512, micro_batches=2)
    plan = plan_model(structure, h100, work, Constraints(tp=1, pp=4, dp=1))
    assert (plan.pp, plan.micro_batches, plan.schedule) == (4, 2, Schedule.GPIPE)


def test_training_at_scale_terms(h100) -> None:
    """Sequence parallelism turns a block's all-reduce into a reduce-scatter + all-gather and splits
    the norms and their activations over TP; ZeRO-1 divides Adam's state by dp and syncs gradients
    with a reduce-scatter + all-gather; interleaving divides the bubble by v at v times the sends."""
    structure = handmade_llama(num_layers=8)
    work = WorkloadSpec("train", 16, 512, micro_batches=8)
    plain = MeshConfig(MeshShape(2, 2, 2), 8)
    sp = dataclasses.replace(plain, sequence_parallel=True)
    ctx = price(structure, h100, work, plain).ctx
    sp_tables = price(structure, h100, work, sp)
    n = 4e6
    group = sp_tables.ctx.tp_group()
    rs_ag = reduce_scatter_time_s(n, group, h100) + all_gather_time_s(n, group, h100)
    assert stream_conversion_time_s(Layout.PARTIAL, n, sp_tables.ctx) == pytest.approx(2 * rs_ag)
    # and the next block's input gathered again in backward for its weight gradients (the
    # column-parallel projections keep the sequence shard), under their input-gradient GEMMs
    assert sequence_regather_s(n, sp_tables.ctx) == pytest.approx(all_gather_time_s(n, group, h100))
    assert sequence_regather_s(n, ctx) == 0.0
    assert stream_conversion_time_s(Layout.PARTIAL, n, ctx) == conversion_time_s(
        Layout.PARTIAL, Layout.REPLICATE, n, ctx
    )
    key = next(iter(sp_tables.graphs))
    plain_graph = price(structure, h100, work, plain).graphs[key]
    assert sp_tables.graphs[key].fixed_activation_bytes == pytest.approx(
        plain_graph.fixed_activation_bytes / 2
    )
    zero = price(structure, h100, work, dataclasses.replace(plain, dp_style=DataParallel.ZERO1)).ctx
    assert zero.state_factor() == pytest.approx((2 + 2 + 12 / 2) / 2)  # bf16 params + grads + Adam / dp
    assert gradient_sync_time_s(1e9, zero) == pytest.approx(
        reduce_scatter_time_s(1e9, zero.dp_group(), h100) + all_gather_time_s(1e9, zero.dp_group(), h100)
    )
    assert optimizer_step_time_s(1e9, zero) < optimizer_step_time_s(1e9, ctx)
    inter = price(
        structure,
        h100,
        work,
        dataclasses.replace(plain, schedule=Schedule.INTERLEAVED_1F1B, virtual_stages=2),
    )
    assert stage_p2p_time_s(inter.ctx, 0) == 2 * stage_p2p_time_s(ctx, 0)
    assert step_time_s(4.0, 1.0, 8, 2) == pytest.approx(8 + 3 / 2)  # m T + (p - 1) T / v
    assert interleaved_chunks(126, 16, 4)[0] == [0] and len(interleaved_chunks(126, 16, 4)) == 64


def test_full_recompute_reruns_the_forward_collectives_not_the_backward_gather(h100) -> None:
    """Full recomputation runs each layer's forward again in backward, its collectives with it (half
    of the forward + backward traffic); the backward's gather of a sequence-parallel block's input
    again is backward only and is not counted twice."""
    structure = handmade_llama(num_layers=4)
    work = WorkloadSpec("train", 8, 2048, micro_batches=1)
    mesh = dataclasses.replace(config(8, 1, 1, 1), sequence_parallel=True)
    prob = problem(structure, h100, work, mesh)
    free = ilp.solve(prob).assignment
    key = prob.tables.layer_keys[0]
    graph = prob.tables.graphs[key]
    chosen = {op.name: graph.op(op.name).option(free.option(key, op.name)).name for op in graph.ops}
    assert chosen["q"] == "colwise" and chosen["down"] == "rowwise", chosen  # Megatron's pairing

    def breakdown(kind: Recompute):
        return layer_breakdown(
            graph, key, dataclasses.replace(free, recompute={key: kind}), False, prob.tables.ctx
        )

    none, full = breakdown(Recompute.NONE), breakdown(Recompute.FULL)
    regather = sum(
        sequence_regather_s(graph.op(out).out_bytes, prob.tables.ctx) for out in graph.block_outputs.values()
    )
    assert regather > 0
    rerun = (none.comm_s + none.overlapped_comm_s - regather) / 2  # TRAIN_COMM_FACTOR
    assert full.comm_s - none.comm_s == pytest.approx(rerun)


def test_pipeline_stage_bound_covers_a_recomputed_layer(h100) -> None:
    """The big-M of a layer's time on a stage includes its recomputation: with full recomputation on
    two stages a layer off a stage charged its rerun there (objective +7% over the prediction)."""
    structure = handmade_llama(num_layers=4, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=256)
    mesh = config(1, 2, 1, 4)
    tables = price(structure, h100, WorkloadSpec("train", 8, 32, dtype="bf16"), mesh)
    usable = h100.device.memory_bytes * Constraints().memory_fraction
    policy = LadderPolicy.parse("none").for_layers(4)
    sol = ilp.solve(IlpProblem(tables, policy, usable, recompute=Recompute.FULL))
    priced = predict(tables, sol.assignment)
    slowest = max(stage.time_s for stage in priced.stages)
    assert sol.objective - ilp.BALANCE_TIE_BREAK * slowest == pytest.approx(
        priced.prediction.latency_s, rel=1e-6
    )


def test_selective_recompute_frees_the_scores_of_a_materialized_kernel(h100) -> None:
    """With an attention kernel that writes its scores to memory, the ILP keeps them (none), frees
    them for the core's forward again (selective) or keeps only the layer input (full, whose backward
    holds one layer's activations again, scores included: eight layers, so that it saves the most),
    whichever fits: under a cap between the three, selective; and the plan records it per class."""
    cluster = dataclasses.replace(h100, attention_kernel="materialized")
    structure = handmade_llama(num_layers=8)
    work = WorkloadSpec("train", 8, 2048, micro_batches=8)
    tables = price(structure, cluster, work, MeshConfig(MeshShape(1, 1, 1), 8))
    key = tables.layer_keys[0]
    core = tables.graphs[key].op("core").option("replicate")
    heads = structure.layers[0].attention.num_heads
    assert core.selective_bytes == pytest.approx(5 * heads * 2048**2)  # 5 a s^2 b, one sequence, 16-bit
    free = ilp.solve(problem(structure, cluster, work, MeshConfig(MeshShape(1, 1, 1), 8))).assignment
    memory_of = {
        r: predict(tables, dataclasses.replace(free, recompute={key: r})).prediction.peak_memory_bytes
        for r in Recompute
    }
    assert memory_of[Recompute.FULL] < memory_of[Recompute.SELECTIVE] < memory_of[Recompute.NONE]
    cap = (memory_of[Recompute.SELECTIVE] + memory_of[Recompute.NONE]) / 2
    solved = ilp.solve(
        problem(structure, cluster, work, MeshConfig(MeshShape(1, 1, 1), 8), cap=cap)
    ).assignment
    assert solved.recompute == {key: Recompute.SELECTIVE}


def test_full_recompute_holds_one_layers_activations_again_in_its_backward(h100) -> None:
    """Full recomputation keeps each layer's input, and a layer's backward runs its forward again and
    holds what that stores until it is used: one layer's activations at a time on top (a tiny Llama,
    4 x 1,024 tokens on a CPU: 38.5 MiB predicted without it, 0.36 GiB measured). The prediction adds
    the largest, and the ILP refuses full recomputation under a cap that only the inputs fit."""
    structure = handmade_llama(num_layers=4)
    work = WorkloadSpec("train", 8, 2048, micro_batches=8, dtype="bf16")
    mesh = MeshConfig(MeshShape(1, 1, 1), 8)
    tables = price(structure, h100, work, mesh)
    key = tables.layer_keys[0]
    free = ilp.solve(problem(structure, h100, work, mesh)).assignment
    none, full = (dataclasses.replace(free, recompute={key: r}) for r in (Recompute.NONE, Recompute.FULL))
    graph = tables.graphs[key]
    act = layer_breakdown(graph, key, none, False, tables.ctx).activation_bytes
    kept = recompute_input_bytes(tables.ctx)
    assert act > 4 * kept
    peak = {r: predict(tables, a).prediction.peak_memory_bytes for r, a in ((0, none), (1, full))}
    # each of the 4 layers keeps its input instead of its activations, and one holds them again
    assert peak[0] - peak[1] == pytest.approx(3 * (act - kept), rel=1e-9)
    policy = LadderPolicy.parse("none").for_layers(4)
    below = IlpProblem(tables, policy, peak[1] - 0.5 * (act - kept), recompute=Recompute.FULL)
    assert not ilp.solve(below).feasible
    above = IlpProblem(tables, policy, peak[1] * 1.001, recompute=Recompute.FULL)
    sol = ilp.solve(above)
    assert sol.feasible
    assert predict(tables, sol.assignment).prediction.peak_memory_bytes == pytest.approx(peak[1], rel=1e-6)


def test_training_prices_the_logits_gradient_and_the_final_norms_input(h100) -> None:
    """The backward starts with the logits' gradient beside every stored activation, and the final norm
    keeps its input: the LM head's activations are the fp32 logits kept for the loss (4 bytes each), that
    gradient (the planned dtype's bytes each) and the norm's input (tokens x hidden); on a CPU run of a
    tiny Llama the heap at its peak was 1.31x the prediction without them, 1.18x with."""
    structure = handmade_llama(num_layers=2, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=1024)
    tables = price(structure, h100, WorkloadSpec("train", 4, 128, dtype="bf16"), config(1, 1, 1, 1))
    head = tables.ends.op("lm_head").option("replicate")
    tokens = 4 * 128
    kept_input = tokens * 256 * 2  # what the projection keeps for its weight gradient
    assert head.activation_bytes == pytest.approx(tokens * 1024 * (4 + 2) + tokens * 256 * 2 + kept_input)


def test_materialized_kernel_multiplies_the_masked_scores_too(h100) -> None:
    """A causal fused kernel skips the masked half of the scores; a materialized one (Megatron-LM's
    baddbmm over all (s, s) scores, masked afterwards) pays the full Q K^T and P V product. With memory
    traffic made free, the two cores differ by exactly the masked half's FLOP time."""
    # one attention rate for both kinds (without the preset's fused-kernel fit, device.attention), so
    # that only the masked half tells them apart
    fast_memory = dataclasses.replace(h100.device, memory_bandwidth_bytes_per_s=1e18, attention=None)
    fused_cluster = dataclasses.replace(h100, device=fast_memory)
    structure = handmade_llama(num_layers=2)
    work = WorkloadSpec("train", 8, 2048, micro_batches=8)
    mesh = MeshConfig(MeshShape(1, 1, 1), 8)
    fused = price(structure, fused_cluster, work, mesh)
    materialized = price(
        structure, dataclasses.replace(fused_cluster, attention_kernel="materialized"), work, mesh
    )
    key = fused.layer_keys[0]
    t_fused = fused.graphs[key].op("core").option("replicate").compute_s
    t_mat = materialized.graphs[key].op("core").option("replicate").compute_s
    attn = structure.layers[0].attention
    full = compute.attention_flops(1, attn.num_heads, 2048, 2048, attn.head_dim, causal=False)
    op_time = materialized.ctx.op_time  # forward and backward, one launch each
    masked_half_s = op_time(full, 0.0, "attention") - op_time(full / 2, 0.0, "attention")
    assert t_mat - t_fused == pytest.approx(masked_half_s, rel=0.01)


def test_pipeline_stages_hold_the_boundary_gradients_in_flight(h100) -> None:
    """A training stage holds, beyond its activations, the output gradient it receives for its next
    backward and the input gradient it sends back: one message each (the runtime's receive buffers
    live only while their micro-batch needs them, `runtime.pipeline._JustInTimeStage`), whatever the
    number of micro-batches."""
    structure = handmade_llama(num_layers=4)
    mesh = MeshConfig(MeshShape(1, 2, 1), 8)
    ctx = price(structure, h100, WorkloadSpec("train", 16, 512, micro_batches=8), mesh).ctx
    msg = p2p_message_bytes(ctx)
    assert msg == 2 * 512 * structure.hidden_size * ctx.bytes_per_element  # one micro-batch's residual stream
    assert [pipeline_buffer_bytes(ctx, s) for s in (0, 1)] == [msg, msg]
    more = price(
        structure, h100, WorkloadSpec("train", 32, 512), dataclasses.replace(mesh, micro_batches=16)
    ).ctx
    assert [pipeline_buffer_bytes(more, s) for s in (0, 1)] == [msg, msg]
    deep = price(structure, h100, WorkloadSpec("train", 16, 512, micro_batches=8), config(1, 4, 1, 8)).ctx
    assert [pipeline_buffer_bytes(deep, s) for s in range(4)] == [msg, 2 * msg, 2 * msg, msg]
    interleaved = dataclasses.replace(mesh, schedule=Schedule.INTERLEAVED_1F1B, virtual_stages=2)
    ictx = price(structure, h100, WorkloadSpec("train", 16, 512, micro_batches=8), interleaved).ctx
    assert [pipeline_buffer_bytes(ictx, s) for s in (0, 1)] == [2 * msg, 2 * msg]
    forward = price(structure, h100, WorkloadSpec("forward", 16, 512, micro_batches=8), mesh).ctx
    assert [pipeline_buffer_bytes(forward, s) for s in (0, 1)] == [0, 0]


def test_the_ilp_memory_rows_count_the_pipeline_boundary_gradients(h100, monkeypatch) -> None:
    """Each stage's memory row carries its `pipeline_buffer_bytes` (GiB), as each predicted stage does."""
    structure = handmade_llama(num_layers=4)
    work = WorkloadSpec("train", 16, 512, micro_batches=8)
    prob = problem(structure, h100, work, MeshConfig(MeshShape(1, 2, 1), 8))
    assignment = ilp.solve(prob).assignment
    counted = {s: ilp.lp_model(prob).get_constraint_by_name(f"memory_{s}").constant for s in (0, 1)}
    predicted = [bd.memory_bytes for bd in predict(prob.tables, assignment).stages]
    monkeypatch.setattr(ilp, "pipeline_buffer_bytes", lambda ctx, stage: 0.0)
    monkeypatch.setattr(prediction, "pipeline_buffer_bytes", lambda ctx, stage: 0.0)
    uncounted = {s: ilp.lp_model(prob).get_constraint_by_name(f"memory_{s}").constant for s in (0, 1)}
    without = [bd.memory_bytes for bd in predict(prob.tables, assignment).stages]
    for s in (0, 1):
        buffers = pipeline_buffer_bytes(prob.ctx, s)
        assert buffers > 0
        assert (counted[s] - uncounted[s]) * 2**30 == pytest.approx(buffers)
        assert predicted[s] - without[s] == pytest.approx(buffers)


def test_ladder_auto_leaves_out_the_layers_it_cannot_rewrite_and_upper_names_them() -> None:
    """A mixture of experts (tests/models/tiny_mixtral.py: every layer's MLP is routed experts): --ladder
    auto, "the solver's choice among the layers", plans without ladder and says why (it refused the
    model, exit 2, with a message about missing attention or MLP blocks); a pinned upper:N is refused
    naming the experts."""
    from pathlib import Path  # noqa: PLC0415

    from tests.plans import meta_structure  # noqa: PLC0415

    models = Path(__file__).parent / "models"
    structure = meta_structure(str(models / "tiny_mixtral.py"), 2, 16)
    cluster = load_cluster(str(models / "fastlink.yaml"), nproc=2)
    work = WorkloadSpec("forward", 2, 16)
    plan = plan_model(structure, cluster, work, Constraints(tp=2, ladder=LadderPolicy.parse("auto")))
    assert plan.ladder_layers == []
    assert any("ladder residual: layers [0, 1] have a mixture-of-experts block" in e for e in plan.excluded)
    with pytest.raises(InputError, match=r"upper:1'.*layers \[1\] have a mixture-of-experts block"):
        plan_model(structure, cluster, work, Constraints(tp=2, ladder=LadderPolicy.parse("upper:1")))


@pytest.mark.parametrize("workload", ["forward", "decode"])
def test_k_and_v_take_one_split(workload, tmp_path) -> None:
    """tests/models/llama_mqa.py has one KV head behind separate k / v projections: at TP 2 their
    options cost exactly the same, and the solver broke the tie apart ("colwise: q v; replicate: k"),
    a layout no target writes (the DTensor export refused it). K and
    V take one split now (`kv_*` constraints)."""
    from pathlib import Path  # noqa: PLC0415

    from planner.cli.main import main  # noqa: PLC0415
    from planner.plan import Plan  # noqa: PLC0415

    models = Path(__file__).parent / "models"
    out = tmp_path / "plan.yaml"
    args = ["optimize", str(models / "llama_mqa.py"), "--cluster", str(models / "fastlink.yaml"), "--tp", "2"]
    assert main([*args, "--workload", workload, "--out", str(out)]) == 0
    layers = [c for c in Plan.from_yaml(out).predicted.per_layer if c.layer >= 0]
    assert layers and all(c.strategy["k"] == c.strategy["v"] for c in layers), [c.strategy for c in layers]


def test_a_pinned_interleaved_schedule_the_batch_cannot_feed_is_named_in_the_refusal() -> None:
    """Llama-3-8B training at batch 1 on one H100 node, TP pinned to 1: only a pipeline would hold its
    weights and Adam state, and --schedule interleaved_1f1b needs pp micro-batches per replica, which
    one sequence cannot give. The refusal advised "more tensor / pipeline parallelism" without saying
    that the pin had ruled every pipeline out."""
    from planner.errors import InfeasibleError  # noqa: PLC0415
    from tests.planner_fixtures import analysed_llama  # noqa: PLC0415

    pins = Constraints(tp=1, schedule=Schedule.INTERLEAVED_1F1B)
    work = WorkloadSpec("train", 1, 4096, dtype="bf16")
    with pytest.raises(InfeasibleError) as refused:
        plan_model(analysed_llama("8b"), load_cluster("dgx-h100"), work, pins)
    message = str(refused.value)
    assert "excluded from the search: " in message
    assert "pp=2, 4, 8: --schedule interleaved_1f1b runs the micro-batches in rounds of pp" in message
    assert "batch 1 allows 1 micro-batch(es) per replica, none a multiple of it" in message
    assert "or --schedule 1f1b" in message
    # TP pinned and every pipeline ruled out: the hint says so instead of advising them
    assert "more tensor / pipeline parallelism than the pins allow" in message
    # a batch of 6 has 3 or 6 micro-batches per replica: more than pp=4, none a multiple of it; and
    # --virtual-stages pins the interleaved schedule too; a pinned --micro-batches is named as the cause
    cases = [
        (Constraints(pp=4, schedule=Schedule.INTERLEAVED_1F1B), WorkloadSpec("train", 6, 4096, dtype="bf16"),
         "pp=4: --schedule interleaved_1f1b runs the micro-batches in rounds of pp, and batch 6 allows 3, 6"),
        (Constraints(pp=4, virtual_stages=2), WorkloadSpec("train", 6, 4096, dtype="bf16"),
         "pp=4: --virtual-stages 2 runs the micro-batches in rounds of pp"),
        (Constraints(pp=4, schedule=Schedule.INTERLEAVED_1F1B), WorkloadSpec("train", 24, 4096, dtype="bf16", micro_batches=3),
         "and --micro-batches 3, none a multiple of it; use --micro-batches a multiple of pp"),
    ]  # fmt: skip
    for pins, work, expected in cases:
        with pytest.raises((InfeasibleError, InputError)) as refused:
            plan_model(analysed_llama("8b"), load_cluster("dgx-h100"), work, pins)
        assert expected in str(refused.value), str(refused.value)


def test_a_mesh_on_fewer_devices_that_could_tie_the_best_is_solved_not_pruned() -> None:
    """Zamba on dgx-h100: TP 4 x DP 2 (8 devices) was solved first (the lowest bound) and replicated
    every weight, at the same latency as TP 1 x DP 2 on 2 devices, whose bound (that latency) was
    within the solver gap, so it was pruned and the 8-device mesh chosen. A bound that could still win
    `_better` is solved: a tie on fewer devices, or a candidate with fewer features (each must save
    `FEATURE_MIN_SAVING`) up to that much slower; others are pruned as before."""
    from types import SimpleNamespace  # noqa: PLC0415

    from planner.solver.problem import FEATURE_MIN_SAVING  # noqa: PLC0415
    from planner.solver.search import _prunable  # noqa: PLC0415

    def cand(bound: float, tp: int, dp: int, sp: bool = False) -> SimpleNamespace:
        mesh = MeshShape(tp, 1, dp)
        return SimpleNamespace(
            lower_bound_s=bound, mesh=mesh, config=MeshConfig(mesh, 1, sequence_parallel=sp)
        )

    best = cand(0.0, 4, 2)
    best.latency_s = 1.0
    assert not _prunable(cand(1.0, 1, 2), best, 0.01)
    assert _prunable(cand(1.0, 2, 4), best, 0.01)  # as many devices
    assert _prunable(cand(1.001, 1, 2), best, 0.01)  # cannot tie
    assert not _prunable(cand(0.9, 2, 4), best, 0.01)  # may be faster
    # the best uses sequence parallelism: the gap is taken from its score, which counts the feature, so
    # a candidate without it whose bound is under that (less the gap) is solved; the raw latency alone
    # pruned it
    best_sp = cand(0.0, 4, 2, sp=True)
    best_sp.latency_s = 1.0
    assert not _prunable(cand(1.0 * (1 - 0.01) + FEATURE_MIN_SAVING / 2, 2, 4), best_sp, 0.01)
    assert _prunable(cand(1.0 * (1 - 0.01) + FEATURE_MIN_SAVING / 2, 2, 4, sp=True), best_sp, 0.01)

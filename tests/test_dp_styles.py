"""Sharded data parallelism in the plan space: ZeRO-1/2, FSDP and HSDP priced in memory and time,
chosen by the search or pinned, and refused in one line when a pin cannot work."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from costmodels import memory
from costmodels.cluster import load_cluster
from costmodels.comm import all_gather_time_s, all_reduce_time_s
from planner.errors import InfeasibleError, InputError
from planner.plan import DataParallel, MeshShape, Plan
from planner.solver.costing import CostContext, dp_sync_exposed_s, dp_sync_parts, fsdp_transient_bytes
from planner.solver.problem import Constraints, MeshConfig, WorkloadSpec, dp_style_variants
from planner.solver.search import plan_model
from tests.planner_fixtures import analysed_llama

GB = 1e9


@pytest.mark.parametrize(
    ("style", "published_gb"),
    [
        (DataParallel.DDP, 120.0),
        (DataParallel.ZERO1, 31.4),
        (DataParallel.ZERO2, 16.6),
        (DataParallel.FSDP, 1.9),
    ],
)
def test_state_per_rank_is_zero_figure_1(style: DataParallel, published_gb: float) -> None:
    """Rajbhandari et al. 2020, Figure 1: a 7.5B-parameter model on 64 data-parallel GPUs with
    mixed-precision Adam (K = 12) holds 120 GB per GPU replicated, 31.4 GB with P_os, 16.6 GB with
    P_os+g and 1.9 GB with P_os+g+p."""
    got = memory.dp_state_bytes(7.5e9, "bf16", style, 64 if style is not DataParallel.DDP else 1) / GB
    assert got == pytest.approx(published_gb, abs=0.05)  # the figure rounds to 0.1 GB


def test_fsdp_without_reshard_keeps_the_parameters_whole() -> None:
    """No reshard after forward: the gathered units stay from forward to backward (parameters count
    whole); the units in flight are then only the gradients of one."""
    n = 1e9
    resharded = memory.dp_state_bytes(n, "bf16", DataParallel.FSDP, 8)
    kept = memory.dp_state_bytes(n, "bf16", DataParallel.FSDP, 8, reshard_after_forward=False)
    assert kept - resharded == pytest.approx(2 * n * (1 - 1 / 8))
    # two layers gathered, the unit outside the layers gathered all step, both units' gradients
    assert memory.fsdp_unit_bytes(n, 3 * n, "bf16") == pytest.approx(2 * (2 * n + 3 * n) + 2 * (n + 3 * n))
    assert memory.fsdp_unit_bytes(n, 3 * n, "bf16", reshard_after_forward=False) == pytest.approx(2 * 4 * n)


def _ctx(dp: int, style: DataParallel, shard: int | None = None, reshard: bool = True, cluster="dgx-h100"):
    structure = analysed_llama("8b")
    spec = load_cluster(cluster)
    config = MeshConfig(MeshShape(1, 1, dp), 1, dp_style=style, dp_shard=shard, reshard_after_forward=reshard)
    return CostContext(structure, spec, WorkloadSpec("train", dp, 4096), config, "bf16")


def test_fsdp_moves_one_and_a_half_times_the_bytes_of_an_all_reduce() -> None:
    """Per step, FSDP gathers the parameters twice (forward, and backward after resharding) and
    reduce-scatters the gradients: 3 (n-1)/n of the bytes on the ring where an all-reduce moves
    2 (n-1)/n; without reshard one gather fewer: as much as the all-reduce. On the ring alike
    (dgx-a100); on an H100 node NCCL's NVLink SHARP all-reduce runs at 480 GB/s of bus bandwidth
    where the ring's all-gather and reduce-scatter reach 370 (NVIDIA/nccl#1455), so there the times
    are 480 / 370 further apart."""
    nbytes = 256e9  # bandwidth-bound: the latency terms (one collective per layer) vanish
    for cluster, nvls in (("dgx-a100", 1.0), ("dgx-h100", 480 / 370)):
        ddp = dp_sync_parts(nbytes, _ctx(8, DataParallel.DDP, cluster=cluster))[0]
        fsdp = dp_sync_parts(nbytes, _ctx(8, DataParallel.FSDP, cluster=cluster))[0]
        kept = dp_sync_parts(nbytes, _ctx(8, DataParallel.FSDP, reshard=False, cluster=cluster))[0]
        assert fsdp / ddp == pytest.approx(1.5 * nvls, rel=0.02), cluster
        assert kept / ddp == pytest.approx(1.0 * nvls, rel=0.02), cluster


def test_hsdp_keeps_gathers_in_the_node_and_sends_a_shard_across() -> None:
    """HSDP 8 x 2 on two DGX nodes: the gathers and reduce-scatters run over the 8 GPUs of a node
    (NVLink), and only 1/8 of the gradients crosses the network in the replicate all-reduce; FSDP over
    all 16 runs every collective across the nodes. With a NIC per GPU, NCCL's rings across two nodes
    reach about the node's own bus bandwidth (8 x 400 Gb/s: ~380 GB/s, NVIDIA/nccl-tests#309), so
    there the two cost about the same; on a thin network (one NIC per node) HSDP is far cheaper."""
    nbytes = 16e9
    hsdp = _ctx(16, DataParallel.FSDP, shard=8, cluster="h100-ib-2node")
    full = _ctx(16, DataParallel.FSDP, cluster="h100-ib-2node")
    assert hsdp.dp_shard_group().num_nodes == 1 and hsdp.dp_replicate_group().num_nodes == 2
    assert full.dp_shard_group().num_nodes == 2
    cluster = hsdp.cluster
    units = 32 + 1  # a collective per layer, and per the unit outside the layers
    across = units * all_reduce_time_s(nbytes / units / 8, hsdp.dp_replicate_group(), cluster)
    inside = 2 * units * all_gather_time_s(nbytes / units, hsdp.dp_shard_group(), cluster)
    assert dp_sync_parts(nbytes, hsdp)[0] > inside + across * 0.99
    assert dp_sync_parts(nbytes, hsdp)[0] == pytest.approx(dp_sync_parts(nbytes, full)[0], rel=0.35)
    assert cluster.inter_node is not None
    thin = dataclasses.replace(cluster, inter_node=dataclasses.replace(cluster.inter_node, nics_per_node=1))
    thin_hsdp, thin_full = (dataclasses.replace(c, cluster=thin) for c in (hsdp, full))
    assert dp_sync_parts(nbytes, thin_hsdp)[0] < 0.5 * dp_sync_parts(nbytes, thin_full)[0]


def test_fsdp_hides_behind_compute_down_to_one_unit() -> None:
    """The prefetched gathers and asynchronous reduce-scatters hide behind overlap_efficiency of the
    stage's compute, each hidden second costing overlap_slowdown of compute; one unit's share (the
    first gather, the last reduce-scatter) never hides. DDP's
    all-reduce runs after the backward: all of it exposed."""
    nbytes = 16e9
    fsdp, ddp = _ctx(8, DataParallel.FSDP), _ctx(8, DataParallel.DDP)
    total, floor = dp_sync_parts(nbytes, fsdp)
    assert 0 < floor < total
    assert dp_sync_exposed_s(nbytes, 0.0, fsdp) == pytest.approx(total)
    # what hides slows the compute beside it by overlap_slowdown of itself (`costing.contention_s`)
    sigma = fsdp.cluster.overlap_slowdown
    assert sigma > 0
    assert dp_sync_exposed_s(nbytes, 1e3, fsdp) == pytest.approx(floor + sigma * (total - floor))
    eta = fsdp.cluster.overlap_efficiency
    shown = max(floor, total - eta * 0.1)
    assert dp_sync_exposed_s(nbytes, 0.1, fsdp) == pytest.approx(shown + sigma * (total - shown))
    assert dp_sync_exposed_s(nbytes, 1e3, ddp) == pytest.approx(dp_sync_parts(nbytes, ddp)[0])


def test_fsdp_units_in_flight_are_two_layers_and_the_unit_outside_them() -> None:
    """Two layers' gathered parameters and the embedding / LM head unit (gathered from the first op
    to the last), with both units' gradients, per TP rank (bf16)."""
    ctx = _ctx(8, DataParallel.FSDP)
    layer = max(layer.num_params for layer in ctx.structure.layers)
    assert layer == pytest.approx(218e6, rel=0.01)  # Llama-3-8B: 4 x 4096^2 / 4 (GQA) + 3 x 4096 x 14336
    ends = 2 * 128256 * 4096 + 4096  # embedding, untied LM head and final norm: the unit outside the layers
    want = 2 * (2 * layer + ends) + 2 * (layer + ends)
    assert fsdp_transient_bytes(ctx) == pytest.approx(want, rel=1e-4)
    kept = fsdp_transient_bytes(_ctx(8, DataParallel.FSDP, reshard=False))
    assert kept == pytest.approx(2 * (layer + ends), rel=1e-4)
    assert fsdp_transient_bytes(_ctx(8, DataParallel.ZERO1)) == 0.0


def test_variants_cover_every_style_and_hsdp_degree() -> None:
    config = MeshConfig(MeshShape(1, 1, 8), 1, dp_style=DataParallel.ZERO1)
    labels = [v.dp_label() for v in dp_style_variants(config, Constraints())]
    assert labels[:3] == ["ddp", "zero1", "zero2"]
    assert {"fsdp", "fsdp-noreshard", "hsdp 4x2", "hsdp 2x4", "hsdp 2x4-noreshard"} <= set(labels)
    pinned = dp_style_variants(config, Constraints(dp_shard=4, reshard_after_forward=False))
    assert [v.dp_label() for v in pinned] == ["hsdp 4x2-noreshard"]


def _plan(**pins) -> Plan:
    work = WorkloadSpec("train", 16, 8192, dtype="bf16")
    return plan_model(analysed_llama("8b"), load_cluster("dgx-h100"), work, Constraints(**pins))


def test_llama3_8b_at_8k_tokens_on_one_node_shards_and_says_why() -> None:
    """Replicas of an 8B model do not fit 80 GB with Adam (16 B/param = 128 GB): the search shards,
    the --why decision lists every style with its time and memory, and the plan is never slower
    than either hand-written one (Megatron-LM's or torchtitan's recipe, FSDP over the node)."""
    plan = _plan()
    assert plan.dp > 1 and plan.dp_style is not DataParallel.DDP
    why = next(d for d in plan.decisions if d.subject == "data-parallel")
    assert why.chosen == "fsdp" if plan.dp_style is DataParallel.FSDP else True
    assert why.options["ddp"] == float("inf")  # does not fit
    assert "peak memory per rank" in why.reason and "ddp 1" in why.reason
    assert plan.torchtitan_baseline is not None and plan.torchtitan_layout["dp_style"].startswith("fsdp")
    assert plan.predicted.latency_s <= plan.torchtitan_baseline.latency_s * (1 + 1e-9)
    assert plan.predicted.latency_s <= plan.baseline.latency_s * (1 + 1e-9)
    assert "fsdp" in plan.torchtitan_layout["dp_style"]


def test_pins_hold_and_bad_pins_are_refused_in_one_line() -> None:
    hsdp = _plan(dp=8, dp_shard=4, reshard_after_forward=False)
    assert (hsdp.dp_style, hsdp.dp_shard, hsdp.dp_replicate, hsdp.reshard_after_forward) == (
        DataParallel.FSDP, 4, 2, False,
    )  # fmt: skip
    assert _plan(dp_style="zero2").dp_style is DataParallel.ZERO2
    with pytest.raises(InputError, match=r"--dp-shard 3 divides none of the data-parallel degrees"):
        _plan(dp_shard=3)
    with pytest.raises(InputError, match=r"--dp-shard 2 shards parameters .* but --dp-style is zero1"):
        Constraints(dp_shard=2, dp_style="zero1")
    with pytest.raises(InputError, match=r"--distributed-optimizer off contradicts --dp-style fsdp"):
        Constraints(dp_style="fsdp", distributed_optimizer=False)


def test_a_layer_that_cannot_be_gathered_is_refused_naming_the_flag() -> None:
    """A device too small for the units FSDP gathers at once (Llama-3-8B: two layers and the
    embedding / LM head unit with their gradients, 5.1 GiB in bf16): refused naming --dp-style fsdp
    and the TP degree that would hold them."""
    spec = load_cluster("dgx-h100")
    tiny = dataclasses.replace(spec, device=dataclasses.replace(spec.device, memory_bytes=1.5 * 2**30))
    work = WorkloadSpec("train", 16, 8192, dtype="bf16")
    with pytest.raises(
        InfeasibleError,
        match=r"--dp-style fsdp: the wrapping units gathered at once .* 5.1 GiB per rank at tp=1.* --tp 4",
    ):
        plan_model(analysed_llama("8b"), tiny, work, Constraints(tp=1, dp_style="fsdp"))


def test_plans_round_trip_and_old_zero1_plans_load(tmp_path) -> None:
    plan = _plan(dp=8, dp_shard=4)
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    again = Plan.from_yaml(path)
    assert (again.dp_style, again.dp_shard, again.reshard_after_forward) == (
        plan.dp_style, plan.dp_shard, plan.reshard_after_forward,
    )  # fmt: skip
    data = plan.to_dict()
    for key in ("dp_style", "dp_shard", "reshard_after_forward"):
        data.pop(key)
    data["distributed_optimizer"] = True  # a plan written before dp_style
    old = Plan.from_dict(data)
    assert old.dp_style is DataParallel.ZERO1 and old.dp_shard == old.dp
    data["dp_shard"] = 3
    data["dp_style"] = "fsdp"
    with pytest.raises(InputError, match=r"field 'dp_shard': is 3, which does not divide mesh.dp=8"):
        Plan.from_dict(data)


def test_a_stream_of_per_layer_collectives_pays_the_burst_latency_after_the_first() -> None:
    """ZeRO-2 and FSDP issue one collective per layer, back to back: with a measured burst latency
    (`planner calibrate` on gloo: 8 small all-reduces in 5.0 ms where one took 2.0 ms) every one after
    the first costs that alpha instead of the link's; without one (the GPU presets) the link's."""
    from costmodels.calibrate import burst_latency_s  # noqa: PLC0415

    alpha = burst_latency_s(5.0e-3, 2.0e-3, 1.0e-3, 2)
    assert alpha == pytest.approx(1.0e-3 * (3.0e-3 / 7) / 2.0e-3)
    assert burst_latency_s(1.0, 1e-3, 1e-3, 2) == 1e-3  # never dearer than the first call
    nbytes = 1e6
    plain = _ctx(8, DataParallel.FSDP)
    link = plain.cluster.intra_node
    bursting = dataclasses.replace(
        plain,
        cluster=dataclasses.replace(plain.cluster, intra_node=dataclasses.replace(link, burst_latency_s=0.0)),
    )
    full, cheap = dp_sync_parts(nbytes, plain)[0], dp_sync_parts(nbytes, bursting)[0]
    assert cheap < full
    # the first unit's collectives (two gathers and a reduce-scatter) keep the link's latency
    group = plain.dp_shard_group()
    first = 3 * all_gather_time_s(nbytes / 33, group, plain.cluster)
    free = dataclasses.replace(plain.cluster, intra_node=dataclasses.replace(link, latency_s=0.0))
    assert cheap == pytest.approx(33 * 3 * all_gather_time_s(nbytes / 33, group, free) + first
                                  - 3 * all_gather_time_s(nbytes / 33, group, free), rel=1e-6)  # fmt: skip


def test_burst_latency_round_trips_through_the_cluster_yaml() -> None:
    from costmodels.cluster import cluster_to_dict, parse_cluster  # noqa: PLC0415

    spec = load_cluster("local-cpu")
    with_burst = dataclasses.replace(
        spec, intra_node=dataclasses.replace(spec.intra_node, burst_latency_s=500e-6)
    )
    data = cluster_to_dict(with_burst)
    assert data["links"]["intra_node"]["burst_latency_us"] == 500
    assert parse_cluster(data, "test").intra_node.burst_latency_s == pytest.approx(500e-6)
    data["links"]["intra_node"]["burst_latency_us"] = -1
    with pytest.raises(InputError, match=r"links.intra_node.burst_latency_us"):
        parse_cluster(data, "test")


def test_an_embedding_tied_across_stages_keeps_its_gradients_whole() -> None:
    """GPT-2 ties its embedding to its LM head: with pipeline stages the two live on the first and
    last stage, and sharded gradients (zero2, fsdp) of the one weight cannot be summed between them,
    so the runtime refuses them: the search leaves them out there, and a pin says so in one line."""
    from tests.planner_fixtures import analysed_gpt  # noqa: PLC0415

    structure = analysed_gpt("124m")
    assert structure.tied_lm_head
    work = WorkloadSpec("train", 64, 1024, dtype="bf16")
    plan = plan_model(structure, load_cluster("dgx-h100"), work, Constraints(pp=2, dp=4, dp_style=None))
    assert plan.pp == 2 and not plan.dp_style.shards_gradients
    why = next(d for d in plan.decisions if d.subject == "data-parallel")
    assert why.options["fsdp"] == why.options["zero2"] == float("inf") and "tied to the LM head" in why.reason
    with pytest.raises(InputError, match=r"--dp-style fsdp with --pp 2: the model ties its embedding"):
        plan_model(structure, load_cluster("dgx-h100"), work, Constraints(pp=2, dp=4, dp_style="fsdp"))
    alone = plan_model(structure, load_cluster("dgx-h100"), work, Constraints(pp=1, dp=8, dp_style="fsdp"))
    assert alone.dp_style is DataParallel.FSDP


def test_fsdp_on_a_device_with_measured_fresh_writes_prices_each_units_new_buffers() -> None:
    """A device that measured its writes into fresh memory (a CPU spec: `fresh_write_bandwidth_GBps`)
    pays for the buffers FSDP allocates per unit and micro-batch (the gathered parameters, the flat
    gradient and the gradient shard: `passes.fsdp`), exposed; GPU presets (no such figure: the caching
    allocator reuses memory) and the other styles (persistent buffers) price none."""
    import dataclasses  # noqa: PLC0415

    from costmodels.compute import fresh_write_time_s  # noqa: PLC0415
    from planner.solver.costing import dp_sync_phases  # noqa: PLC0415

    nbytes = 16e9  # 8B in bf16: units of ~480 MB, over the large-tensor threshold
    gpu = _ctx(8, DataParallel.FSDP, reshard=False)
    assert len(dp_sync_phases(nbytes, gpu)) == 1
    fresh_device = dataclasses.replace(gpu.cluster.device, fresh_write_bandwidth_bytes_per_s=1.3e9)
    cpu = dataclasses.replace(gpu, cluster=dataclasses.replace(gpu.cluster, device=fresh_device))
    gather, fresh = dp_sync_phases(nbytes, cpu)
    assert gather == dp_sync_phases(nbytes, gpu)[0]
    units = len(cpu.structure.layers) + 1
    unit = nbytes / units
    one = 2 * fresh_write_time_s(unit, fresh_device) + fresh_write_time_s(unit / 8, fresh_device)
    assert fresh.total_s == fresh.unhidden_s == pytest.approx(units * one) and fresh.window == 0
    zero1 = dataclasses.replace(cpu, config=dataclasses.replace(cpu.config, dp_style=DataParallel.ZERO1))
    assert len(dp_sync_phases(nbytes, zero1)) == len(
        dp_sync_phases(nbytes, dataclasses.replace(zero1, cluster=gpu.cluster))
    )


def _grads_in(ctx: CostContext, grad_reduce_dtype: str) -> CostContext:
    """`ctx` with its workload's gradients accumulated and reduced in `grad_reduce_dtype`."""
    return dataclasses.replace(
        ctx, workload=dataclasses.replace(ctx.workload, grad_reduce_dtype=grad_reduce_dtype)
    )


@pytest.mark.parametrize(
    "style", [DataParallel.DDP, DataParallel.ZERO1, DataParallel.ZERO2, DataParallel.FSDP]
)
def test_fp32_gradients_of_bf16_parameters_reduce_twice_the_bytes_and_hold_two_more_per_parameter(
    style: DataParallel,
) -> None:
    """`grad_reduce_dtype` fp32 (Megatron-LM's fp32 main_grad with --bf16): every gradient collective
    (DDP's all-reduce, ZeRO's and FSDP's reduce-scatters) moves the fp32 bytes, each priced as the
    same collective of twice the bf16 gradient bytes; the parameters' gathers stay bf16; the gradient
    buffer holds 4 bytes per parameter (sharded where the style shards gradients)."""
    from planner.solver.costing import dp_sync_phases  # noqa: PLC0415

    nbytes = 16e9
    param = _ctx(8, style)
    fp32 = _grads_in(param, "fp32")
    assert (param.grad_dtype, fp32.grad_dtype, fp32.grad_reduce_scale) == ("bf16", "fp32", 2.0)
    grads, gathers = dp_sync_phases(nbytes, fp32), dp_sync_phases(nbytes, param)
    doubled = dp_sync_phases(2 * nbytes, param)  # every collective at twice the bytes
    if style is DataParallel.DDP:
        assert grads == doubled  # the all-reduce is all of it
    elif style is DataParallel.FSDP:  # gathers of bf16 parameters and the fp32 reduce-scatter, per unit
        assert gathers[0].total_s < grads[0].total_s < doubled[0].total_s
    else:  # the reduce-scatter doubles, the parameters' all-gather after the step does not
        assert (grads[0], grads[1]) == (doubled[0], gathers[1])
    shard = 1 if style is DataParallel.DDP else 8
    extra = 2.0 / shard if style.shards_gradients else 2.0  # bytes per parameter
    bf16_bytes = memory.param_bytes(1, "bf16")
    assert (fp32.state_factor() - param.state_factor()) * bf16_bytes == pytest.approx(extra)
    # fp32 parameters' gradients are fp32 already: nothing changes
    fp32_params = dataclasses.replace(param, dtype="fp32")
    assert _grads_in(fp32_params, "fp32").grad_reduce_scale == 1.0


def test_fp32_gradients_are_a_plan_field_that_round_trips_prices_and_is_refused_by_the_runtime(
    tmp_path,
) -> None:
    """A train plan priced with fp32 gradients says so (`Plan.grad_reduce_dtype`), round-trips through
    YAML, changes its digest (a param plan's digest is as before the field), is refused on a forward
    plan and with an unknown dtype, and `planner run`'s check lets it run."""
    from runtime.run_mode import check_plan_runs  # noqa: PLC0415

    structure = analysed_llama("8b")
    cluster = load_cluster("dgx-h100")
    pin = Constraints(tp=1, pp=1, dp=8, dp_style="zero1", recompute="full")
    plans = {
        g: plan_model(
            structure,
            cluster,
            WorkloadSpec("train", 8, 4096, micro_batches=1, dtype="bf16", grad_reduce_dtype=g),
            pin,
        )
        for g in ("param", "fp32")
    }
    param, fp32 = plans["param"], plans["fp32"]
    assert (param.grad_reduce_dtype, fp32.grad_reduce_dtype) == ("param", "fp32")
    assert fp32.predicted.grad_sync_s > param.predicted.grad_sync_s
    # Llama-3-8B's 8.03B parameters' gradients: 2 more bytes each, unsharded under zero1
    more = fp32.predicted.peak_memory_bytes - param.predicted.peak_memory_bytes
    assert more == pytest.approx(2 * 8.03e9, rel=0.01)
    path = tmp_path / "p.yaml"
    fp32.to_yaml(path)
    assert Plan.from_yaml(path).grad_reduce_dtype == "fp32"
    assert fp32.decisions_digest() != param.decisions_digest()
    assert (
        param.decisions_digest() == dataclasses.replace(param, grad_reduce_dtype="param").decisions_digest()
    )
    with pytest.raises(InputError, match="grad_reduce_dtype.*not one of"):
        Plan.from_dict({**param.to_dict(), "grad_reduce_dtype": "fp8"})
    forward = {**param.to_dict(), "workload": "forward", "grad_reduce_dtype": "fp32"}
    forward.update(dp_style="ddp", dp_shard=1, overlap_grad_reduce=False, overlap_param_gather=False)
    with pytest.raises(InputError, match="grad_reduce_dtype.*has no gradients"):
        Plan.from_dict(forward)
    check_plan_runs(fp32, "train")  # runs here (`runtime.data_parallel._MainGrads`, fp32 reduce-scatters)
    check_plan_runs(param, "train")
    with pytest.raises(InputError, match="grad-reduce-dtype"):
        WorkloadSpec("train", 8, 4096, grad_reduce_dtype="bf16")


def test_why_says_when_a_faster_style_was_kept_off_by_the_threshold() -> None:
    """Llama-3-8B at 160k tokens on a node: a sharded style a little faster than the one chosen (under
    the 0.5% per level each asks more of the runtime) is named with its saving and the threshold, as
    the overlap rows say theirs (the table showed zero1 chosen beside a faster fsdp without a word)."""
    from planner.solver.problem import FEATURE_MIN_SAVING  # noqa: PLC0415

    work = WorkloadSpec("train", 1, 163840, dtype="bf16")
    plan = plan_model(analysed_llama("8b"), load_cluster("dgx-h100"), work, Constraints())
    why = next(d for d in plan.decisions if d.subject == "data-parallel")
    faster = [n for n, t in why.options.items() if t < why.options[why.chosen]]
    assert faster, why.options  # the case this test is about
    best = min(faster, key=why.options.get)
    assert why.options[why.chosen] / why.options[best] - 1 < 2 * FEATURE_MIN_SAVING
    assert f"{best} saves" in why.reason and f"kept {why.chosen}, the simpler style" in why.reason


def test_why_says_an_embedding_tied_to_the_lm_head_takes_its_split() -> None:
    """GPT-2's token embedding is its LM head's weight: --why says the embedding's split is the head's
    (it showed vocab chosen beside a faster replicate and blamed memory, 0.2 GiB of 80)."""
    from planner.frontend.depth import capture_for_planning  # noqa: PLC0415
    from planner.frontend.modelfile import load_model_file  # noqa: PLC0415

    model_file = load_model_file(Path(__file__).resolve().parent.parent / "examples" / "gpt2.py")
    _, structure = capture_for_planning(model_file.build("meta"), *model_file.inputs())
    plan = plan_model(structure, load_cluster("dgx-a100"), WorkloadSpec("forward", 2, 128), Constraints(tp=2))
    why = next(d for d in plan.decisions if d.subject == "embedding0")
    assert "its weight is the LM head's (tied): one split for both" in why.reason
    assert "gradient sync" not in why.reason  # a forward plan has none
    position = next(d for d in plan.decisions if d.subject == "embedding1")  # its own weight
    assert "tied" not in position.reason


def test_the_memory_hint_quotes_the_closest_plans_own_sharded_state() -> None:
    """Llama-3-8B at 131,072 tokens, CP 2, FSDP pinned, on 8 H100s: nothing fits. The hint quoted the
    unsharded 60 GiB of weights, gradients and Adam state and advised the distributed optimizer, which
    the closest plan already had (FSDP: 15 GiB); its activations are what does not fit."""
    from costmodels.cluster import load_cluster  # noqa: PLC0415
    from planner.errors import InfeasibleError  # noqa: PLC0415
    from planner.solver.problem import Constraints, WorkloadSpec  # noqa: PLC0415
    from planner.solver.search import plan_model  # noqa: PLC0415
    from tests.planner_fixtures import analysed_llama  # noqa: PLC0415

    pins = Constraints(tp=1, cp=2, dp_style="fsdp", max_devices=8)
    with pytest.raises(InfeasibleError) as refused:
        plan_model(
            analysed_llama("8b"),
            load_cluster("dgx-h100"),
            WorkloadSpec("train", 2, 131072, dtype="bf16"),
            pins,
        )
    message = str(refused.value)
    assert "--distributed-optimizer" not in message and "alone take" not in message, message
    assert "less activation memory per device" in message and "GiB per device of it, fsdp" in message, message

"""Process groups as the mesh places them on nodes: a group spans as few nodes as filling them in order
takes, and never more than the cluster has (a dp of 6 on nodes of 8 is on one node; its gcd, 2 per
node, read 3 nodes and crashed planning on a 2-node cluster)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from costmodels.cluster import load_cluster, parse_cluster
from costmodels.comm import Group
from planner.frontend.depth import capture_for_planning
from planner.frontend.modelfile import load_model_file
from planner.plan import DataParallel, MeshShape
from planner.solver.costing import CostContext, ranks_per_node
from planner.solver.problem import Constraints, MeshConfig, WorkloadSpec
from planner.solver.search import plan_model
from tests.plans import meta_structure

THREE_PER_NODE = {
    "name": "two-nodes-of-3", "nodes": 2, "devices_per_node": 3, "backend": "nccl", "overlap_efficiency": 0.8,
    "device": {"name": "H100", "memory_GiB": 79.6, "peak_TFLOPS": {"bf16": 989, "fp16": 989, "fp32": 67},
               "memory_bandwidth_GBps": 3350, "matmul_efficiency": 0.8, "memory_efficiency": 0.85,
               "launch_overhead_us": 4},
    "links": {"intra_node": {"kind": "nvlink", "bandwidth_GBps": 370, "latency_us": 5.1},
              "inter_node": {"kind": "infiniband", "bandwidth_GBps": 45, "latency_us": 6, "nics_per_node": 3}},
}  # fmt: skip


def test_uneven_group_spans_the_nodes_it_fills():
    assert Group(12, 8).num_nodes == 2 and Group(6, 6).num_nodes == 1 and Group(3, 2).num_nodes == 2
    assert [ranks_per_node(n, 8) for n in (1, 6, 8, 12, 48)] == [1, 6, 8, 8, 8]
    with pytest.raises(ValueError, match="more ranks per node"):
        Group(2, 4)


def _structure():
    model_file = load_model_file("examples/llama3.py")
    args, kwargs = model_file.inputs(batch_size=1, seq_len=64)
    return capture_for_planning(model_file.build("meta"), args, kwargs)[1]


@pytest.mark.parametrize("cluster, batch", [("h100-ib-2node", 6), ("h100-ib-2node", 12), ("three", 6),
                                            ("three", 12)])  # fmt: skip
def test_training_plans_at_data_parallel_degrees_that_do_not_divide_a_node(cluster, batch):
    spec = parse_cluster(THREE_PER_NODE, "test") if cluster == "three" else load_cluster(cluster)
    plan = plan_model(_structure(), spec, WorkloadSpec("train", batch, 64), Constraints())
    assert plan.mesh.num_devices <= spec.num_devices


def test_groups_of_a_straddling_mesh_fit_the_cluster():
    """tp 2 on nodes of 3 (pinned): the dp groups of 3 reach both nodes, not 3 nodes of 1; HSDP's
    replicate group too."""
    spec = parse_cluster(THREE_PER_NODE, "test")
    for mesh, style, shard in ((MeshShape(tp=2, pp=1, dp=3), DataParallel.ZERO1, None),
                               (MeshShape(tp=1, pp=1, dp=6), DataParallel.FSDP, 2)):  # fmt: skip
        config = MeshConfig(mesh, 1, dp_style=style, dp_shard=shard)
        ctx = CostContext(_structure(), spec, WorkloadSpec("train", 6, 64), config, "fp32")
        for group in (ctx.dp_group(), ctx.tp_group(), ctx.dp_shard_group(), ctx.dp_replicate_group()):
            assert group.num_nodes <= spec.num_nodes and group.ranks_per_node <= spec.devices_per_node


def test_a_tp_degree_that_does_not_divide_a_node_is_priced_across_nodes():
    """tp 2 on nodes of 3 over both nodes: a TP group straddles them, so its collectives cross the
    inter-node link (priced inside a node before: the same exposed time as on nodes of 6); unpinned,
    the search leaves such a degree out and says why."""
    spec = parse_cluster(THREE_PER_NODE, "test")
    config = MeshConfig(MeshShape(tp=2, pp=1, dp=3), 1)
    ctx = CostContext(_structure(), spec, WorkloadSpec("train", 6, 64), config, "fp32")
    assert ctx.tp_group().num_nodes == 2
    one_node = CostContext(
        _structure(), spec, WorkloadSpec("train", 2, 64), MeshConfig(MeshShape(2, 1, 1), 1), "fp32"
    )
    assert one_node.tp_group().num_nodes == 1  # a mesh inside one node does not straddle
    plan = plan_model(_structure(), spec, WorkloadSpec("train", 6, 64), Constraints())
    assert plan.tp != 2 and any(e.startswith("tp=2: does not divide a node of 3") for e in plan.excluded)


def test_the_megatron_baseline_trains_on_every_device_of_an_odd_node():
    """Nodes of 3 devices, 2 nodes, heads that keep TP at 1: the hand-written layout puts the node's
    other devices in DP (it was one replica per node, 2 of 6 devices, and the plan read 3.9x its speed)."""
    from planner.solver.baseline import megatron_configs  # noqa: PLC0415

    spec = parse_cluster(THREE_PER_NODE, "test")
    configs = megatron_configs(spec, WorkloadSpec("train", 6, 64), _structure())
    assert configs and all(c.mesh.num_devices == 6 for c in configs)
    assert configs[0].mesh.pp == 1 and configs[0].mesh.dp == 6 // configs[0].mesh.tp


def test_the_megatron_baseline_keeps_the_replicas_a_batch_divides():
    """A training batch that the replicas the TP groups leave do not divide (batch 1, 5 or 4 over 6): the
    hand-written layout keeps as many replicas as divide it, the other devices idle, as Megatron-LM's
    --data-parallel-size must divide the global batch (the baseline was dropped without a word)."""
    from planner.solver.baseline import megatron_configs  # noqa: PLC0415

    spec = parse_cluster(THREE_PER_NODE, "test")
    for batch in (1, 5, 4):
        configs = megatron_configs(spec, WorkloadSpec("train", batch, 64), _structure())
        assert configs, batch
        first = configs[0].mesh
        replicas = 6 // first.tp
        assert first.pp == 1 and first.dp == max(d for d in range(1, replicas + 1) if batch % d == 0), first


def test_the_megatron_baselines_context_parallel_ranks_come_from_every_tp_group():
    """Llama-3-405B at 131,072 tokens, 128 sequences on 16,384 GPUs: TP 8 PP 4 trains 128 replicas (the
    batch divides no more), and CP 16 taken from those left 12,288 GPUs idle (TP8 CP16 PP4 DP8), so the
    plan read "5x its speed" against a quarter of the cluster. The CP ranks come from the 512 TP groups
    of a stage: CP 16 x DP 32, every GPU."""
    from planner.solver.baseline import megatron_cp_configs  # noqa: PLC0415

    work = WorkloadSpec("train", 128, 131072)
    config = MeshConfig(MeshShape(8, 4, 128), 128)
    (cp,) = megatron_cp_configs([config], 126, work, (16,), devices=16384)
    assert (cp.mesh.tp, cp.mesh.cp, cp.mesh.pp, cp.mesh.dp) == (8, 16, 4, 32) and cp.mesh.num_devices == 16384
    (old,) = megatron_cp_configs([config], 126, work, (16,))
    assert old.mesh.dp == 8  # without the device count: the replicas a batch left


@pytest.mark.parametrize(
    "model, tp",
    [("llama3_8b.py", 2), ("llama3_70b.py", 8)],
)
def test_the_megatron_baseline_trains_at_the_model_tables_tp(model, tp):
    """Megatron-LM's published model table trains a 4,096-wide model (7.1B) at TP 2 and 7,168-wide and
    wider at TP 8: Llama-3-8B's hand-written layout on two H100 nodes was TP 8 (the node) x DP 2, 4.8 s
    a step against 1.7 s at TP 2 x DP 8, and the plan read "3.16x its speed". Without stages TP starts
    at the table's degree; wider degrees follow for memory, then stages at the node's TP."""
    from planner.solver.baseline import megatron_configs, megatron_table_tps  # noqa: PLC0415

    path = str(Path(__file__).resolve().parents[1] / "examples" / model)
    structure = meta_structure(path, 64, 4096)
    configs = megatron_configs(load_cluster("h100-ib-2node"), WorkloadSpec("train", 64, 4096), structure)
    first = configs[0].mesh
    assert (first.tp, first.pp, first.dp) == (tp, 1, 16 // tp), first
    assert megatron_table_tps(8, structure) == [d for d in (1, 2, 4, 8) if d >= tp]
    assert all(c.mesh.tp == 8 for c in configs if c.mesh.pp > 1)


def test_the_megatron_baseline_of_a_forward_in_one_node_splits_the_batch():
    """A batch's forward in one node: TP from the model table for the model's width, the other devices
    as replicas of a share of the batch (the tiny Llama's forward on 2 ranks was priced at TP 2 against a
    plan free to split the batch: "17.90x its speed" in the demo). Serving decode keeps TP = the node."""
    from planner.solver.baseline import megatron_configs  # noqa: PLC0415

    path = str(Path(__file__).resolve().parents[1] / "examples" / "llama3.py")
    structure = meta_structure(path, 4, 64)
    node = parse_cluster(THREE_PER_NODE, "test")
    one_node = dataclasses.replace(node, num_nodes=1)
    forward = megatron_configs(one_node, WorkloadSpec("forward", 4, 64), structure)
    assert [(c.mesh.tp, c.mesh.dp) for c in forward][0] == (1, 2), forward  # 3 devices, a batch of 4
    decode = megatron_configs(one_node, WorkloadSpec("decode", 4, 64, context=64), structure)
    assert decode[0].mesh.dp == 1


def test_the_megatron_baseline_uses_every_device_of_a_cap_and_tries_micro_batches_of_two():
    """--devices 12 on nodes of 8: the hand-written layout trains 12 // TP replicas (it was cut to one
    node's 8 while the plan used 12: "1.68x its speed"); and a replica's batch is tried at micro-batch
    size 2 before 1 (Llama-3-70B on 1,024 H100s went from 4 sequences per micro-batch to 1 where 2 fits
    and is 5% faster)."""
    from planner.solver.baseline import megatron_configs, megatron_micro_batch_variants  # noqa: PLC0415

    path = str(Path(__file__).resolve().parents[1] / "examples" / "llama3_8b.py")
    structure = meta_structure(path, 48, 4096)
    work = WorkloadSpec("train", 48, 4096)
    configs = megatron_configs(load_cluster("h100-ib-2node"), work, structure, max_devices=12)
    assert configs[0].mesh.num_devices == 12 and (configs[0].mesh.tp, configs[0].mesh.dp) == (2, 6)
    first = MeshConfig(MeshShape(2, 1, 6), 1)  # 8 sequences per replica, one micro-batch
    sizes = [48 // 6 // c.micro_batches for c in megatron_micro_batch_variants(first, 32, work)]
    assert sizes == [8, 2, 1], sizes


def test_the_megatron_baseline_trains_a_mixture_of_experts_with_expert_parallelism():
    """Mixtral 8x7B on 64 H100s: the hand-written training layout runs EP 8 over the data-parallel ranks,
    each expert also over TP (Megatron-LM's Mixtral example trains TP2 PP4 EP8; it split every expert over
    TP without EP: "1.48x its speed"); serving keeps vLLM's default, the experts over TP without EP."""
    from planner.solver.baseline import megatron_configs  # noqa: PLC0415

    path = str(Path(__file__).resolve().parents[1] / "examples" / "mixtral_8x7b.py")
    structure = meta_structure(path, 256, 4096)
    cluster = load_cluster("h100-ib-128node")
    (first, *_) = megatron_configs(cluster, WorkloadSpec("train", 256, 4096), structure, max_devices=64)
    assert (first.mesh.tp, first.mesh.dp, first.ep, first.ep_fold, first.expert_tp) == (2, 32, 8, "dp", 2)
    (served, *_) = megatron_configs(
        cluster, WorkloadSpec("decode", 8, 1, context=512), structure, max_devices=8
    )
    assert served.ep == 1 and served.expert_tp == served.mesh.tp


def test_the_megatron_baseline_adds_stages_or_cp_before_full_recomputation():
    """Llama-3-405B, 2,048 x 8,192 tokens on 16,384 H100s: the hand-written plan tries every mesh with
    selective recomputation before any with full (it took TP8 PP4 with full recomputation, 8.09 s, where
    TP8 CP2 PP16 fits with selective, 5.82 s)."""
    from planner.solver.search import baseline_layouts  # noqa: PLC0415

    path = str(Path(__file__).resolve().parents[1] / "examples" / "llama3_405b.py")
    structure = meta_structure(path, 2048, 8192)
    work = WorkloadSpec("train", 2048, 8192, dtype="bf16")
    (plan, layout), _ = baseline_layouts(structure, load_cluster("h100-ib-2048node"), work, Constraints())
    assert layout["recompute"] == "selective", layout
    assert (plan.tp, plan.cp, plan.pp) == (8, 2, 16), layout


def test_the_torchtitan_recipe_turns_context_parallelism_on_for_a_long_sequence():
    """Llama-3-8B at 131,072 tokens, 4 sequences on two H100 nodes: the torchtitan recipe tried FSDP,
    then pipeline stages, never its context_parallel_degree, and every layout it tried needed 428 GiB
    per rank ("torchtitan recipe ... does not fit"). A torchtitan user turns CP on for long sequences:
    each pipeline depth is tried at cp 1, 2, 4, ... (all-gather K/V, head-tail load balancing, FSDP
    over dp_shard x cp), and the first that fits is TP 1 CP 4 DP 4. Short sequences, and models whose
    attention does not run context-parallel, keep cp 1."""
    from planner.solver.baseline import torchtitan_configs  # noqa: PLC0415

    structure = meta_structure(
        str(Path(__file__).resolve().parents[1] / "examples" / "llama3_8b.py"), 64, 4096
    )
    cluster = load_cluster("h100-ib-2node")
    configs = [
        c for c, _ in torchtitan_configs(cluster, WorkloadSpec("train", 4, 131072), structure, None, True)
    ]
    meshes = list(dict.fromkeys((c.mesh.cp, c.mesh.pp) for c in configs))
    # CP 2 would leave half the GPUs idle (4 replicas x 2): the degrees that use all 16 are tried
    assert meshes[:5] == [(1, 1), (4, 1), (8, 1), (16, 1), (1, 2)], meshes
    assert all(c.cp_comm_type == "allgather" and c.cp_load_balance for c in configs if c.mesh.cp > 1)
    assert all(c.dp_style is DataParallel.FSDP for c in configs if c.mesh.dp_cp > 1)
    assert all(c.mesh.num_devices <= 16 for c in configs)
    # one sequence: no replicas to fill the cluster, so CP takes all 16 GPUs (torchtitan sizes dp_shard x
    # cp x tp x pp to the world), not CP 8 on half of them
    one = [c for c, _ in torchtitan_configs(cluster, WorkloadSpec("train", 1, 131072), structure, None, True)]
    assert next(c.mesh for c in one if c.mesh.cp > 1) == MeshShape(1, 1, 1, 16)
    for work, context_parallel in (
        (WorkloadSpec("train", 4, 8192), True),
        (WorkloadSpec("train", 4, 131072), False),
    ):
        assert {
            c.mesh.cp for c, _ in torchtitan_configs(cluster, work, structure, None, context_parallel)
        } == {1}
    plan = plan_model(structure, cluster, WorkloadSpec("train", 4, 131072, dtype="bf16"), Constraints())
    (titan,) = [d for d in plan.decisions if d.subject == "torchtitan-baseline"]
    assert (
        titan.chosen == "tp=1 cp=4 pp=1 dp=4"
        and "fits" in titan.reason
        and "does not fit" not in titan.reason
    )
    assert "context parallel 4 (FSDP over its ranks)" in titan.reason

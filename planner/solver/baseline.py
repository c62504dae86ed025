"""The hand-written Megatron-LM plan, costed with the same model as the planner's plans.

Megatron's recipe (Shoeybi et al. 2019; Narayanan et al. 2021): TP = the devices of one node (the
largest degree that divides the heads and the node), PP = the number of nodes, DP = 1 (training: TP
from Megatron-LM's published model table by the model's width, up to the node's while it does not
fit, then the fewest stages that fit memory, DP over the other devices, `megatron_configs`); attention
head-parallel (Q/K/V column-wise, output row-wise), MLP column-then-row, embedding and LM head
vocab-parallel, layers split evenly over stages, no ladder residual; a mixture of experts' routed
experts, in training, over the data-parallel ranks by expert parallelism and split over the TP ranks
(`megatron_experts`), for serving split over the TP ranks without it (`split_experts`: vLLM's default). Where a split is not
possible (e.g. KV heads not divisible), that op stays replicated, as a careful hand-written plan would.

Training, as an expert writes it today (Korthikanti et al. 2022; Megatron-LM's recommended flags
``--sequence-parallel --recompute-activations --use-distributed-optimizer
--num-layers-per-virtual-pipeline-stage``): sequence parallelism with TP > 1, selective recomputation
(full only if memory demands it: the caller tries both), the interleaved 1F1B schedule when PP > 1
(`megatron_virtual_stages`), and the distributed optimizer with DP > 1.
"""

from __future__ import annotations

import dataclasses
import math

from costmodels.cluster import ClusterSpec
from planner.frontend.analysis import ModelStructure
from planner.plan import DataParallel, Layout, MeshShape, Recompute, Schedule, Workload
from planner.solver.costing import (
    CostTables,
    LayerGraph,
    expert_counts,
    experts_lowerable,
    interleaved_chunks,
)
from planner.solver.prediction import PricedAssignment, predict
from planner.solver.problem import Assignment, MeshConfig, WorkloadSpec

_PREFERENCE: dict[str, tuple[str, ...]] = {
    # op name -> Megatron's strategy, then fall-backs
    "q": ("colwise", "replicate"),
    "k": ("colwise", "replicate"),
    "v": ("colwise", "replicate"),
    "qkv": ("colwise", "replicate"),
    "core": ("head", "replicate"),
    "o": ("rowwise", "replicate"),
    "gate": ("colwise", "replicate"),
    "up": ("colwise", "replicate"),
    "act": ("shard", "replicate"),
    "down": ("rowwise", "replicate"),
    "embedding0": ("vocab", "replicate"),
    "lm_head": ("vocab", "replicate"),
}


def megatron_tp(cluster: ClusterSpec, num_heads: int | None, structure: ModelStructure | None = None) -> int:
    """Largest TP degree that divides the devices per node and the number of attention heads, and
    splits ``structure``'s KV heads into whole heads or replicates them evenly
    (`ModelStructure.kv_heads_unsplit_by`): Megatron-LM and vLLM refuse other degrees."""
    for tp in range(cluster.devices_per_node, 0, -1):
        if cluster.devices_per_node % tp or (num_heads is not None and num_heads % tp):
            continue
        if structure is None or not structure.kv_heads_unsplit_by(tp):
            return tp
    return 1


# Megatron-LM's published layouts by model width (Megatron-Core r0.8 README, weak-scaling model table,
# H100, sequence 4,096: hidden 2,048 (1.7B) TP 1, 4,096 (7.1B) TP 2, 6,144 (16B) TP 4, 7,168 (32B) and
# wider TP 8, pipeline stages only from 70B on, TP staying 8): (widest hidden size, TP) in order
MEGATRON_TP_BY_HIDDEN = ((2048, 1), (4096, 2), (6144, 4))


def megatron_table_tps(node_tp: int, structure: ModelStructure) -> list[int]:
    """The TP degrees a Megatron-LM user tries without pipeline stages (training, and a batch's forward in
    one node), in order: the model
    table's degree for `structure`'s hidden size (`MEGATRON_TP_BY_HIDDEN`; `node_tp`, the largest the
    node and the heads allow (`megatron_tp`), past the table's widths), then each larger degree dividing
    `node_tp` up to it. A degree that leaves a KV head cut (`ModelStructure.kv_heads_unsplit_by`) is
    skipped. Training a 2,048-wide model at TP 8 (the node) was the baseline before: its TP
    all-reduces cost more than the 1.7B row's published layout spends, so plans read faster than the
    expert's by that much."""
    table = next((tp for hidden, tp in MEGATRON_TP_BY_HIDDEN if structure.hidden_size <= hidden), node_tp)
    return [
        d
        for d in range(1, node_tp + 1)
        if node_tp % d == 0 and d >= min(table, node_tp) and not structure.kv_heads_unsplit_by(d)
    ]


def _replicas(most: int, batch_size: int) -> int:
    """The data-parallel degree a hand-written layout takes with `most` replicas' devices: the largest
    at most `most` that divides the global batch (Megatron-LM's --data-parallel-size must; the other
    devices idle), 1 at least."""
    dp = max(1, most)
    while dp > 1 and batch_size % dp:
        dp -= 1
    return dp


def megatron_choices(graphs: dict[str, LayerGraph], ends: LayerGraph) -> dict[tuple[str, str], str]:
    """Megatron's strategy per op: attention by heads (a decoder's cross-attention, "cross.q" ...
    "cross.o", too), MLP column-then-row, chain MLP alternating."""
    choices: dict[tuple[str, str], str] = {}
    for key, graph in [*graphs.items(), ("ends", ends)]:
        head_ok = {
            op.name.removesuffix("core"): any(o.name == "head" for o in op.options)
            for op in graph.ops
            if op.name in ("core", "cross.core")
        }
        linear_index = 0
        for op in graph.ops:
            names = {o.name for o in op.options}
            prefix, _, base = op.name.rpartition(".")
            prefix = f"{prefix}." if prefix in ("cross",) else ""
            base = base if prefix else op.name
            if base in ("q", "k", "v", "qkv", "o") and not head_ok.get(prefix, False):
                prefs: tuple[str, ...] = ("replicate",)
            elif base in _PREFERENCE:
                prefs = _PREFERENCE[base]
            elif op.block == "embedding":  # a later lookup (positions, T5's relative bias) stays whole,
                prefs = ("replicate", "vocab")  # as Megatron-LM's; a table looked up before splits as there
            elif op.name.startswith("act"):
                prefs = ("shard", "replicate")
            else:  # a chain of linears: column, row, column, row, ...
                prefs = ("colwise", "replicate") if linear_index % 2 == 0 else ("rowwise", "replicate")
                linear_index += 1
            # the preferred strategy the op offers, else its first (an op pinned to one strategy)
            choices[(key, op.name)] = next((p for p in prefs if p in names), op.options[0].name)
        _fix_layouts(key, graph, choices)
    first_of: dict[str, str] = {}  # an embedding of the weight an earlier one looks up splits as that one
    for op in ends.ops:
        if op.block == "embedding" and op.weight is not None:
            first = first_of.setdefault(op.weight, op.name)
            if choices[("ends", first)] in {o.name for o in op.options}:
                choices[("ends", op.name)] = choices[("ends", first)]
    return choices


def _fix_layouts(key: str, graph: LayerGraph, choices: dict[tuple[str, str], str]) -> None:
    """Make the elementwise ops follow their producers' layout (S after colwise, else R)."""
    for op in graph.ops:
        if not op.name.startswith("act"):
            continue
        producers = [graph.op(src).option(choices[(key, src)]) for src in op.inputs]
        want = "shard" if all(p.out_layout == Layout.SHARD for p in producers) else "replicate"
        if want in {o.name for o in op.options}:
            choices[(key, op.name)] = want
        consumer = next((c for c in graph.ops if op.name in c.inputs), None)
        if consumer is not None and want == "replicate" and choices[(key, consumer.name)] == "rowwise":
            choices[(key, consumer.name)] = "replicate"


def even_stages(num_layers: int, pp: int) -> list[list[int]]:
    """Layers split as evenly as possible, earlier stages taking the remainder."""
    base, extra = divmod(num_layers, pp)
    stages, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        stages.append(list(range(start, start + n)))
        start += n
    return stages


def megatron_stages(tables: CostTables) -> list[list[int]]:
    """Even stages, or with the interleaved schedule the model chunks (`interleaved_chunks`)."""
    ctx = tables.ctx
    if ctx.virtual_stages > 1:
        return interleaved_chunks(tables.num_layers, ctx.mesh.pp, ctx.virtual_stages)
    return even_stages(tables.num_layers, ctx.mesh.pp)


def megatron_assignment(tables: CostTables, recompute: Recompute | bool = Recompute.NONE) -> Assignment:
    """Megatron's strategy (`megatron_choices`: the most sharded one) on even stages (or chunks), no
    ladder; `recompute` for every layer class, training only (True: full, Megatron's
    --recompute-granularity full; with it, it is also the least memory per rank any plan of this mesh
    needs; selective: --recompute-granularity selective)."""
    if isinstance(recompute, bool):
        recompute = Recompute.FULL if recompute else Recompute.NONE
    return Assignment(
        choices=megatron_choices(tables.graphs, tables.ends),
        stages=megatron_stages(tables),
        recompute={
            key: recompute if graph.backward else Recompute.NONE for key, graph in tables.graphs.items()
        }
        if tables.ctx.train
        else {},
    )


def baseline_plan(tables: CostTables, recompute: Recompute | bool = Recompute.NONE) -> PricedAssignment:
    """Megatron's plan (`megatron_assignment`) priced on the mesh of `tables` (a `megatron_configs` one)."""
    return predict(tables, megatron_assignment(tables, recompute))


MEGATRON_MAX_VIRTUAL_STAGES = 4  # model chunks per rank a Megatron-LM user typically picks


def megatron_virtual_stages(num_layers: int, pp: int, micro_batches: int) -> int:
    """v of the interleaved schedule a Megatron-LM user picks: the largest v <= 4 with a whole number
    of layers in every one of the pp * v chunks (``--num-layers-per-virtual-pipeline-stage``); when
    no v divides, the largest v <= 4 with at least one layer per chunk, the end chunks one layer
    shorter (as Llama 3 did with 126 layers on 16 stages, `interleaved_chunks`). 1 for pp = 1 or
    micro-batches not a multiple of pp (Megatron's interleaved schedule needs it)."""
    if pp == 1 or micro_batches % pp:
        return 1
    fits = [v for v in range(2, MEGATRON_MAX_VIRTUAL_STAGES + 1) if pp * v <= num_layers]
    even = [v for v in fits if num_layers % (pp * v) == 0]
    return max(even or fits or [1])


def megatron_micro_batches(per_replica_batch: int, pp: int, workload: WorkloadSpec) -> int:
    """The largest divisor of the replica's batch that is at most 4 x pp (a common Megatron-LM setting:
    enough to shrink the bubble), 1 without a pipeline; the expert's choice, not the user's
    `--micro-batches` (a pin for the search, which the baseline does not share). `workload` is unused
    but kept for callers."""
    limit = 4 * pp if pp > 1 else 1
    return max(d for d in range(1, min(per_replica_batch, limit) + 1) if per_replica_batch % d == 0)


def megatron_micro_batch_variants(
    config: MeshConfig, num_layers: int, workload: WorkloadSpec
) -> list[MeshConfig]:
    """`config`, then for training the same mesh at micro-batch size 2 and then 1 (gradient accumulation
    over the replica's batch: Megatron-LM's `--micro-batch-size 2` / `1`, what its large-model recipes
    use), the order in which an expert shrinks activation memory before another mesh or full
    recomputation. Size 2 was skipped: Llama-3-70B on 1,024 H100s went from the whole replica batch
    to size 1 where size 2 fits and is 5% faster."""
    replica = workload.batch_size // config.mesh.dp
    out = [config]
    if not workload.train or not num_layers:
        return out
    for size in (2, 1):
        m = replica // size
        if replica % size or m <= config.micro_batches or any(c.micro_batches == m for c in out):
            continue
        smaller = _expert_training(dataclasses.replace(config, micro_batches=m), num_layers, workload)
        out.append(dataclasses.replace(smaller, sequence_parallel=config.sequence_parallel))
    return out


def megatron_configs(
    cluster: ClusterSpec,
    workload: WorkloadSpec,
    structure: ModelStructure,
    max_devices: int | None = None,
) -> list[MeshConfig]:
    """The meshes a Megatron-LM user would try, in order: TP = devices per node (dividing the heads),
    PP = nodes (at most the layers), DP = 1; for training, every divisor of the nodes as PP with DP
    over the rest of the TP groups (a node's devices beyond TP too), fewest stages first (the caller
    keeps the first that fits memory), and without stages TP from the model table's degree for the
    model's width up (`megatron_table_tps`).
    Training: sequence parallel (TP > 1, where every layer's sequence divides by TP, as Megatron-LM
    requires: not a ViT's 17 patch and class tokens at TP 2), interleaved 1F1B (`megatron_virtual_stages`), distributed
    optimizer (DP > 1), and the communication overlap Megatron-LM's published runs use (TP overlap
    with sequence parallelism, gradient reduction and parameter gather overlap with DP > 1). The expert's layout, whatever the user pins for the search.
    `max_devices`: the hand-written plan gets the same device cap as the search, every one of them
    (12 of nodes of 8: data parallelism over 12 // TP replicas; it was cut to one node's 8)."""
    devices = min(cluster.num_devices, max_devices or cluster.num_devices)
    if max_devices is not None and max_devices < cluster.num_devices:
        per_node = min(cluster.devices_per_node, max_devices)
        cluster = dataclasses.replace(
            cluster, num_nodes=max(1, max_devices // per_node), devices_per_node=per_node
        )
    heads = structure.query_head_counts()
    tp = megatron_tp(cluster, math.gcd(*heads) if heads else None, structure)
    num_layers = len(structure.layers)
    if not num_layers:  # a plain MLP: TP only
        return [MeshConfig(MeshShape(tp, 1, 1), 1)]
    if workload.kind is Workload.FORWARD and cluster.num_nodes == 1:
        # a batch's forward in one node: TP from the model table for its width (a 2,048-wide model at
        # TP 8 was priced against a plan free to split the batch: "17.9x its speed" for the tiny Llama on
        # 2 CPU ranks), the node's other devices as replicas of a share of the batch, wider TP for memory
        configs = []
        for degree in megatron_table_tps(tp, structure):
            dp = _replicas(devices // degree, workload.batch_size)
            configs.append(MeshConfig(MeshShape(degree, 1, dp), 1))
    elif not workload.train:
        pp = max(1, min(cluster.num_nodes, num_layers))
        configs = [
            MeshConfig(MeshShape(tp, pp, 1), megatron_micro_batches(workload.batch_size, pp, workload))
        ]
    else:
        # every TP group of the cluster trains: the devices a node holds beyond TP go to DP, as
        # Megatron-LM's --data-parallel-size is what is left. Without pipeline stages TP starts at the
        # model table's degree for the model's width and doubles up to the node's while it does not fit;
        # stages come after TP fills the node, as in the table
        nodes, configs = cluster.num_nodes, []
        for pp in (d for d in range(1, nodes + 1) if nodes % d == 0 and d <= num_layers):
            for degree in megatron_table_tps(tp, structure) if pp == 1 else (tp,):
                dp = _replicas(devices // degree // pp, workload.batch_size)
                m = megatron_micro_batches(workload.batch_size // dp, pp, workload)
                configs.append(MeshConfig(MeshShape(degree, pp, dp), m))
    configs = [c for c in configs if workload.batch_size % (c.mesh.dp * c.micro_batches) == 0]
    tokens = structure.stream_tokens(workload.seq_len)
    return [
        _expert_training(
            megatron_experts(c, structure, workload),
            num_layers,
            workload,
            all(t % c.mesh.tp == 0 for t in tokens),
        )
        for c in configs
    ]


def megatron_experts(config: MeshConfig, structure: ModelStructure, workload: WorkloadSpec) -> MeshConfig:
    """A mixture of experts as a Megatron-LM user lays it out: for training, expert parallelism over the
    data-parallel ranks, the largest degree dividing both the experts and dp (Megatron-LM's Mixtral 8x7B
    example trains a TP2 PP4 EP8 checkpoint, examples/mixtral/train_mixtral_8x7b_distributed.sh), each
    expert also split over the TP ranks (--expert-tensor-parallel-size defaults to the TP size); else, and
    for serving, the experts split over TP without EP (`split_experts`). The baseline split every expert
    over TP and never used EP: Mixtral on 64 H100s read "1.48x its speed" where an EP layout is within
    1.07x of the plan."""
    experts = expert_counts(structure)
    if not workload.train or not experts or not experts_lowerable(structure) or config.mesh.dp <= 1:
        return split_experts(config, structure)
    common = math.gcd(*experts)
    ep = max(d for d in range(1, common + 1) if common % d == 0 and config.mesh.dp % d == 0)
    if ep == 1:
        return split_experts(config, structure)
    return dataclasses.replace(config, ep=ep, ep_fold="dp", expert_tp=config.mesh.tp)


def ep_within(config: MeshConfig) -> MeshConfig:
    """`config` without expert parallelism where its EP degree no longer divides the dp x cp ranks it
    folds over (a layout cut to one replica for a model whose batch cannot be split, or CP taken from
    the replicas): the experts stay split over TP as `megatron_experts` set them. A Llama 4 on 2 ranks
    kept EP 2 at one replica and its pricing raised on an expert group of 0 ranks."""
    if config.ep > 1 and config.ep_fold == "dp" and config.mesh.dp_cp % config.ep:
        return dataclasses.replace(config, ep=1)
    return config


def split_experts(config: MeshConfig, structure: ModelStructure) -> MeshConfig:
    """`config` with a mixture-of-experts model's routed experts split over its TP ranks (`MeshConfig.expert_tp`
    = tp), as the hand-written layouts run them without expert parallelism: Megatron-LM's
    --expert-tensor-parallel-size defaults to --tensor-model-parallel-size (megatron/training/arguments.py
    validate_args; megatron/core/parallel_state.py builds the expert groups so), torchtitan puts the experts
    on its TP mesh with its `TensorParallel` style where there is no EP mesh (torchtitan's MoE
    `apply_moe_ep_tp`), and vLLM's fused MoE splits each expert over the TP ranks unless
    --enable-expert-parallel. Unchanged at tp 1, for a dense model, and where the expert pass cannot split
    the experts (`experts_lowerable`: then they stay whole on every TP rank, as the search keeps them)."""
    if config.mesh.tp > 1 and config.ep == 1 and experts_lowerable(structure):
        return dataclasses.replace(config, expert_tp=config.mesh.tp)
    return config


# Megatron-LM's context parallelism as its users turn it on for long sequences: `--context-parallel-size`
# with the default `--cp-comm-type p2p` (ring attention; load-balanced, as Megatron-Core always cuts a
# causal sequence into 2 x cp chunks), the CP ranks taken from the data-parallel ones, enough of them that
# each rank keeps at most MEGATRON_CP_TOKENS_PER_RANK tokens of a sequence: Llama 3's long-context stage
# kept its 8k-token layout TP8 PP16 and went from DP128 to CP16 x DP8 at 131k tokens, 8,192 tokens per
# rank in both stages (Dubey et al. 2024, Table 4)
MEGATRON_CP_DEGREES = (2, 4, 8, 16, 32)
MEGATRON_CP_TOKENS_PER_RANK = 8192


def megatron_cp_degree(seq_len: int) -> int:
    """The context-parallel degree an expert picks for sequences of `seq_len` tokens: the smallest of
    `MEGATRON_CP_DEGREES` that leaves each rank at most `MEGATRON_CP_TOKENS_PER_RANK` tokens (the
    largest if none does); 1 for sequences up to that many tokens."""
    if seq_len <= MEGATRON_CP_TOKENS_PER_RANK:
        return 1
    fits = [cp for cp in MEGATRON_CP_DEGREES if seq_len / cp <= MEGATRON_CP_TOKENS_PER_RANK]
    return fits[0] if fits else MEGATRON_CP_DEGREES[-1]


def megatron_cp_configs(
    configs: list[MeshConfig],
    num_layers: int,
    workload: WorkloadSpec,
    degrees: tuple[int, ...],
    devices: int | None = None,
) -> list[MeshConfig]:
    """`configs` (`megatron_configs`) again with each context-parallel degree of `degrees` that divides
    their DP degree and cuts the sequence into 2 x cp chunks, the CP ranks taken from the DP ones, ring
    attention with load balancing, in the order of `degrees` (the caller keeps the first that fits
    memory). With `devices`, the CP ranks come from every TP group of a stage the devices hold, not
    from the replicas a batch-divisible DP left (those are fewer: at 128 sequences on 16,384 GPUs, TP 8
    PP 4 trains 128 replicas, and CP 16 taken from them left 12,288 GPUs idle); DP is then what is
    left, again dividing the batch. Empty for decode and models without layers."""
    if workload.kind is Workload.DECODE or not num_layers:
        return []
    out = []
    for cp in degrees:
        for config in configs:
            mesh = config.mesh
            full = devices // (mesh.tp * mesh.pp) if devices else mesh.dp
            if cp < 2 or full % cp or workload.seq_len % (2 * cp):
                continue
            dp = _replicas(full // cp, workload.batch_size)
            if workload.batch_size % dp:
                continue
            m = megatron_micro_batches(workload.batch_size // dp, mesh.pp, workload)
            cp_mesh = MeshShape(mesh.tp, mesh.pp, dp, cp)
            expert = _expert_training(
                dataclasses.replace(config, mesh=cp_mesh, micro_batches=m), num_layers, workload,
                config.sequence_parallel or not workload.train,
            )  # fmt: skip
            out.append(dataclasses.replace(expert, cp_comm_type="ring", cp_load_balance=True))
    return out


def _expert_training(
    config: MeshConfig, num_layers: int, workload: WorkloadSpec, sequence_divides: bool = True
) -> MeshConfig:
    """`config` with what a Megatron-LM user turns on for training (module docstring); sequence
    parallelism only where `sequence_divides` (every layer's sequence by TP)."""
    mesh, m = config.mesh, config.micro_batches
    if not workload.train:
        return dataclasses.replace(config, schedule=Schedule.ONE_F_ONE_B)
    v = megatron_virtual_stages(num_layers, mesh.pp, m)
    if v > 1:
        chosen = Schedule.INTERLEAVED_1F1B
    else:
        chosen = Schedule.ONE_F_ONE_B if m >= mesh.pp else Schedule.GPIPE
    sp = mesh.tp > 1 and sequence_divides
    # --use-distributed-optimizer, over the dp x cp ranks that hold the same weights (Megatron-Core's dp-cp group)
    style = DataParallel.ZERO1 if mesh.dp_cp > 1 else DataParallel.DDP
    # what Megatron-Core's published H100 runs turn on (its README's weak-scaling table:
    # --tp-comm-overlap, which needs sequence parallelism, --overlap-grad-reduce, --overlap-param-gather)
    return MeshConfig(
        mesh, m, chosen, v, sequence_parallel=sp, dp_style=style, tp_comm_overlap=sp,
        overlap_grad_reduce=mesh.dp_cp > 1, overlap_param_gather=mesh.dp_cp > 1,
        cp_comm_type=config.cp_comm_type, cp_load_balance=config.cp_load_balance, ep=config.ep,
        ep_fold=config.ep_fold, expert_tp=config.expert_tp,
    )  # fmt: skip


# torchtitan's published Llama 3 recipes (pytorch/torchtitan, torchtitan/models/llama3/train_configs/:
# llama3_8b.toml FSDP over every GPU, TP 1, selective activation checkpointing; llama3_70b.toml and
# llama3_405b.toml TP 8 with FSDP over the rest, full checkpointing; the torchtitan paper, Liang et al.
# 2024, arXiv:2410.06511, Table 6, adds PP for 405B at 512 GPUs): TP from this many parameters on
TORCHTITAN_TP_FROM_PARAMS = 30e9
# and async TP (`compile.enable_async_tensor_parallel`) from this many: llama3_405b turns it on, llama3_70b not
TORCHTITAN_ASYNC_TP_FROM_PARAMS = 300e9
# context parallelism as torchtitan's users turn it on for long sequences (`context_parallel_degree`; the
# README's "Context Parallel" post, "Breaking Barriers: Training Long Context LLMs with 1M Sequence Length
# in PyTorch Using Context Parallel", discuss.pytorch.org/t/215082): from this many tokens, at the
# smallest of these degrees that fits memory, before pipeline stages (a stage holds its layers'
# activations at the whole sequence length; CP cuts them); PyTorch's default K/V rotation (all-gather)
# and torchtitan's default head-tail load balancer, FSDP over dp_shard x cp (its `build_mesh`)
TORCHTITAN_CP_FROM_TOKENS = 16384
TORCHTITAN_CP_DEGREES = (2, 4, 8, 16, 32)


def _torchtitan_cps(cps: list[int], tp: int, pp: int, devices: int, batch: int) -> list[int]:
    """The context-parallel degrees of `cps` a torchtitan user tries at (tp, pp): 1, then those above 1
    that put the most devices to work (torchtitan sizes dp_shard x cp x tp x pp to the world: where the
    batch leaves too few replicas, the CP ranks take the devices left). At 131k tokens, one sequence,
    16 GPUs: CP 16, not CP 8 on half of them."""
    above = [cp for cp in cps if cp > 1 and tp * cp * pp <= devices]
    used = {cp: tp * cp * pp * _replicas(devices // (tp * cp * pp), batch) for cp in above}
    most = max(used.values(), default=0)
    return [cp for cp in cps if cp == 1 or used.get(cp) == most]


def torchtitan_configs(
    cluster: ClusterSpec,
    workload: WorkloadSpec,
    structure: ModelStructure,
    max_devices: int | None = None,
    context_parallel: bool = False,
) -> list[tuple[MeshConfig, Recompute]]:
    """The layouts a torchtitan user writes for training, in the order they would try them (the caller
    keeps the first that fits memory): FSDP (``data_parallel_shard_degree = -1``, resharded after
    forward) over the devices TP and PP leave; TP 1 below `TORCHTITAN_TP_FROM_PARAMS` with selective
    activation checkpointing, above it TP = the node (dividing the heads, `megatron_tp`) with full
    checkpointing and sequence parallelism (torchtitan's TP plan always shards the norms'
    sequence); then PP 2, 4, ... stages (1F1B, one sequence per micro-batch) while it does not fit.
    With `context_parallel` (the model's attention runs context-parallel) and a sequence of
    `TORCHTITAN_CP_FROM_TOKENS` or more, each pipeline depth is tried at cp 1, then at the degrees of
    `TORCHTITAN_CP_DEGREES` that put the most devices to work (`_torchtitan_cps`), the CP ranks taken
    from the data-parallel ones (the sequence a multiple of 2 x cp x tp, as torchtitan asserts). Empty
    for workloads other than training and models without layers. The devices used are the cluster's
    (or `max_devices`), less any that would not divide the batch."""
    if not workload.train or not structure.layers:  # a recipe for transformer layers
        return []
    devices = min(cluster.num_devices, max_devices or cluster.num_devices)
    heads = structure.query_head_counts()
    big = structure.num_params >= TORCHTITAN_TP_FROM_PARAMS
    tp = megatron_tp(cluster, math.gcd(*heads) if heads else None, structure) if big else 1
    recompute = Recompute.FULL if big else Recompute.SELECTIVE
    num_layers = max(1, len(structure.layers))
    tokens = structure.stream_tokens(workload.seq_len)
    async_tp = tp > 1 and structure.num_params >= TORCHTITAN_ASYNC_TP_FROM_PARAMS
    cps = [1]
    if context_parallel and workload.seq_len >= TORCHTITAN_CP_FROM_TOKENS:
        cps += [cp for cp in TORCHTITAN_CP_DEGREES if workload.seq_len % (2 * cp * tp) == 0]
    out = []
    pp = 1
    while pp <= num_layers and tp * pp <= devices:
        for cp in _torchtitan_cps(cps, tp, pp, devices, workload.batch_size):
            sp = tp > 1 and all((t // cp) % tp == 0 for t in tokens)
            dp = _replicas(devices // (tp * cp * pp), workload.batch_size)
            per_replica = workload.batch_size // dp
            style = DataParallel.FSDP if dp * cp > 1 else DataParallel.DDP
            # without PP: the whole local batch, then gradient accumulation over one sequence at a time,
            # then full checkpointing; with PP: micro-batches of one sequence (pipeline_parallel_microbatch_size)
            tries = (
                [(1, recompute), (per_replica, recompute), (per_replica, Recompute.FULL)] if pp == 1 else []
            )
            tries += [(per_replica, recompute), (per_replica, Recompute.FULL)] if pp > 1 else []
            for m, r in dict.fromkeys(tries):
                schedule = Schedule.ONE_F_ONE_B if m >= pp else Schedule.GPIPE
                # torchtitan's "default" reshard policy: reshard after forward unless pipelined (one gather
                # per micro-batch would be too many)
                config = MeshConfig(
                    MeshShape(tp, pp, dp, cp), m, schedule, 1, sp, style, None, pp == 1, async_tp,
                    cp_comm_type="allgather", cp_load_balance=True,
                )  # fmt: skip
                out.append((split_experts(config, structure), r))
        pp *= 2
    return out

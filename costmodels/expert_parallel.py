"""Expert parallelism: the routed experts' work, traffic and memory on one rank of an EP group.

A mixture-of-experts layer of E experts, each token choosing top_k of them, over an EP group of `ep`
ranks (rank e holds experts e E/ep .. (e+1) E/ep - 1; `passes.expert_parallel`). Per micro-batch on
one rank, with N the tokens the rank routes, H the hidden size, b bytes per element, f the load of the
busiest rank over the mean (`DEFAULT_MOE_IMBALANCE`, capped by a capacity factor where the model drops
tokens):

| fold | rows the busiest rank's experts compute | communication per layer                        |
|------|-----------------------------------------|------------------------------------------------|
| dp   | f k N (the EP ranks exchange their      | forward: all-to-all of the E counts, dispatch  |
|      | tokens: each computes its share of the  | and combine all-to-alls of f k N H b each,     |
|      | group's k N ep rows)                    | (ep-1)/ep of them off the rank; backward: the  |
|      |                                         | two again (`all_to_all_exchange_s`), exposed   |
| tp   | f k N / ep (the TP ranks hold the same  | forward: one all-reduce of N H b over TP (the  |
|      | N tokens; each runs its experts on the  | experts' partial outputs); backward: one more  |
|      | rows routed to them; no token moves)    | (the input gradient), exposed                  |

Weights read: each rank reads the experts it holds that some row reached. At large N every local
expert is reached; at decode (a few tokens a step) only E (1 - (1 - k/E)^n) of the experts are
(`touched_experts`, n the tokens routed in the group), so a decode step reads their weights only and
is bound by memory bandwidth, not FLOP.

Memory per rank: the E / ep local experts' weights, and in training their gradients and Adam state
(the expert-data-parallel group of the dp x cp / ep ranks holding the same experts shards them where
the data-parallel style shards; the runtime runs EP with ddp), and the rows kept for the backward.

Fold "dp" replicates the experts over the TP ranks (each TP rank runs the same experts on the same
tokens: expert TP 1 with replicated compute), or with expert TP = tp splits each over them as a
Megatron MLP (`planner.solver.costing.expert_split`: 1/tp of every GEMM and of the experts' memory,
one all-reduce of N H b over TP each way: `expert_tp_reduce_s`). The sources: GShard (Lepikhin et
al. 2020, section 2.2: dispatch and combine by all-to-all), Megatron-Core's `alltoall` token dispatcher
(NVIDIA/Megatron-LM `megatron/core/transformer/moe/token_dispatcher.py`: the counts exchange, then the
tokens), vLLM's expert parallelism at data-parallel size 1 (`vllm/model_executor/layers/fused_moe/
layer.py`: the TP ranks' experts' outputs all-reduced).
"""

from __future__ import annotations

import math

from costmodels.cluster import ClusterSpec
from costmodels.comm import Group, all_to_all_time_s, burst_cluster

# The busiest EP rank's rows over the mean (1.0 = balanced). Dropless routing trained to balance
# (Switch's auxiliary loss, Fedus et al. 2021 section 2.2; DeepSeek-V3's per-expert bias, Liu et al.
# 2024 section 2.1.2) keeps the mean load even over a global batch, but the busiest rank of one
# micro-batch is above it by a workload-dependent amount for which no published per-rank measurement
# was found to adopt; so the default prices balanced routing and says so (`--moe-imbalance F` sets
# it; a run reports each rank's measured rows per expert, `passes.expert_parallel.last_loads`).
DEFAULT_MOE_IMBALANCE = 1.0
COUNT_BYTES = 8  # one int64 per expert in the counts all-to-all before the dispatch (torch.bincount)


def busiest_load_factor(imbalance: float, capacity_factor: float | None, ep: int) -> float:
    """The busiest rank's rows over the mean: `imbalance`, capped at `capacity_factor` where the model
    drops the tokens beyond an expert's capacity (GShard / Switch: capacity = factor x the mean rows
    per expert), and at `ep` (every row on one rank: no routing makes a rank busier); 1 with one EP
    rank (it computes every row whatever the routing)."""
    if ep == 1:
        return 1.0
    load = min(imbalance, float(ep))
    return min(load, capacity_factor) if capacity_factor is not None else load


def touched_experts(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected experts some of `tokens` tokens choose, each choosing top_k of E uniformly:
    E (1 - (1 - k/E)^tokens) (every expert is missed by a token with probability 1 - k/E)."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def local_touched_experts(num_experts: int, top_k: int, group_tokens: float, ep: int) -> float:
    """Experts the busiest of `ep` ranks holds that the group's `group_tokens` tokens reach: the
    touched experts (`touched_experts`) spread over the ranks, rounded up (a rank holding one reached
    expert reads all of its weights), at most its E / ep."""
    touched = touched_experts(num_experts, top_k, group_tokens)
    return min(num_experts / ep, float(math.ceil(touched / ep - 1e-9)))


def dispatch_bytes(
    top_k: int, tokens: float, hidden: int, bytes_per_element: int, load: float = 1.0
) -> float:
    """Bytes one rank sends in the dispatch all-to-all (and receives back in the combine): top_k x
    tokens x H elements, times the busiest rank's `load` factor."""
    return top_k * tokens * hidden * bytes_per_element * load


def all_to_all_exchange_s(
    data_bytes: float, num_experts: int, group: Group, cluster: ClusterSpec, train: bool
) -> float:
    """Seconds one MoE layer's token exchange takes on a rank of an EP `group` (fold dp), exposed:
    forward, the all-to-all of the E counts (`COUNT_BYTES` each), then dispatch and combine of
    `data_bytes` each (`dispatch_bytes`); training adds the backward's two all-to-alls of the same
    bytes (the gradients go back the way the tokens came). 0 for a group of one."""
    if group.size == 1:
        return 0.0
    data = all_to_all_time_s(data_bytes, group, cluster)
    # the dispatch follows the counts' all-to-all at once: priced at the link's burst latency
    # (`comm.burst_cluster`, measured where calibrated); the combine and the backward's two come after
    # compute, each at the link's latency
    dispatch = all_to_all_time_s(data_bytes, group, burst_cluster(cluster))
    forward = all_to_all_time_s(num_experts * COUNT_BYTES, group, cluster) + dispatch + data
    return forward + (2 * data if train else 0.0)

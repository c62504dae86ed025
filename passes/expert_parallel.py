"""Expert parallelism (EP): a mixture-of-experts layer whose experts are split over the ranks of a mesh axis.

Each of the `ep` ranks of the axis holds E / ep of the E experts (rank r: experts r * E/ep ..
(r + 1) * E/ep - 1, contiguous as Megatron-Core and torchtitan place them) and its own tokens (EP is
folded over the data-parallel ranks: each rank routes the tokens of its own micro-batch). A layer
runs in five steps (GShard, Lepikhin et al. 2020, section 2.2; Megatron-Core's `alltoall` token
dispatcher):

1. route: the router's top-k gives every token k (expert, weight) pairs; the N x k assignments are
   sorted by expert, so the rows bound for one rank are contiguous, and for one expert inside them;
2. dispatch: the rows' counts per expert are exchanged (an all-to-all of E integers), then the rows
   themselves (an all-to-all of N k C elements in all, `torch.distributed._functional_collectives.
   all_to_all_single_autograd`, differentiable: its backward is the reverse all-to-all);
3. the rank's experts run on the rows they received (each expert on its own rows, grouped);
4. combine: the outputs go back to the ranks their tokens came from (the reverse all-to-all);
5. each token's k outputs are weighted by the router's weights and summed (a scatter-add by token, `_combine`).

Nothing is dropped (dropless, as Megatron-Core's `--moe-token-dispatcher-type alltoall` without a
capacity factor): the all-to-all split sizes follow the routing. With one rank (or no process group)
the same function runs every expert locally: the reference the parity tests compare with.

`ep_moe` returns the layer output and the rows each of the rank's experts computed (its load: the
planner prices the busiest rank by an imbalance factor; the run reports the measured one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from passes.collectives import _group

__all__ = ["ep_moe", "ep_moe_replicated", "expert_shard", "last_loads", "local_experts", "reset_loads"]

_LOADS: dict[str, list[int]] = {}  # block label -> rows each local expert computed in its last call


def reset_loads() -> None:
    """Forget the loads of earlier calls (a new lowering)."""
    _LOADS.clear()


def last_loads() -> dict[str, list[int]]:
    """The rows (token, choice pairs) each of this rank's experts computed in the last call of every
    labelled block (`ep_moe`'s `label`), for the run report; a copy."""
    return {k: list(v) for k, v in _LOADS.items()}


def local_experts(num_experts: int, size: int, rank: int) -> range:
    """The experts rank `rank` of `size` EP ranks holds; ValueError naming both numbers when `size` does
    not divide `num_experts`."""
    if num_experts % size:
        raise ValueError(f"expert parallelism over {size} ranks cannot split {num_experts} experts evenly")
    per = num_experts // size
    return range(rank * per, (rank + 1) * per)


def expert_shard(value: torch.Tensor, spec: tuple) -> torch.Tensor:
    """This rank's slice of an expert weight from the unsharded one (`passes.ep_lower` records `spec`
    per parameter FQN): spec = (ep_rank, ep, tp_dim, tp_rank, tp, parts): dim 0 cut into ep pieces
    (stacked experts; ep 1: not cut), then `tp_dim` (the expert width; -1: not cut) into tp pieces, a
    fused gate-and-up weight's `parts` each cut and joined. Returns `value` when nothing is cut."""
    ep_rank, ep, tp_dim, tp_rank, tp, parts = spec
    if ep > 1:
        value = value.chunk(ep, dim=0)[ep_rank]
    if tp > 1 and tp_dim >= 0:
        pieces = value.split(list(parts), dim=tp_dim) if parts else [value]
        value = torch.cat([p.chunk(tp, dim=tp_dim)[tp_rank] for p in pieces], dim=tp_dim)
    return value


def _local(axis: str, num_experts: int, w_gate: torch.Tensor) -> tuple[dist.ProcessGroup | None, int, range]:
    """The EP group of `axis`, its size and this rank's experts; ValueError when the local weights are
    not E / ep experts."""
    group = _group(axis)
    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    experts = local_experts(num_experts, size, rank)
    if w_gate.shape[0] != len(experts):
        raise ValueError(
            f"rank {rank} of {size} EP ranks holds {len(experts)} of {num_experts} experts but got weights "
            f"for {w_gate.shape[0]}"
        )
    return group, size, experts


def _exchange(
    rows: torch.Tensor, recv_splits: list[int], send_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """An all-to-all of `rows` (send_splits[r] rows to rank r, recv_splits[r] rows from it), waited for;
    differentiable (its backward is the reverse all-to-all): PyTorch's functional collective."""
    return wait_tensor(all_to_all_single_autograd(rows.contiguous(), recv_splits, send_splits, group))


def _combine(weighted: torch.Tensor, token: torch.Tensor, n: int) -> torch.Tensor:
    """The (n, C) sum of the (rows, C) `weighted` expert rows into their tokens (`token`: (rows,) int64),
    in the rows' order. A scatter-add, whose backward gathers the output's gradient by `token` and keeps
    no rows (an index_add keeps its (rows, C) source for backward: k rows per token of the layer's width,
    memory Megatron-LM's unpermute does not hold either)."""
    index = token.unsqueeze(1).expand(-1, weighted.shape[1])
    return weighted.new_zeros((n, weighted.shape[1])).scatter_add(0, index, weighted)


def _swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def _experts(
    rows: torch.Tensor,
    expert_of_row: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every local expert e on the rows with expert_of_row == e (SwiGLU: w_gate, w_up (E_l, I, C), w_down
    (E_l, C, I)); the outputs in the rows' order and the rows per expert (E_l,)."""
    local = w_gate.shape[0]
    order = torch.argsort(expert_of_row, stable=True)
    counts = torch.bincount(expert_of_row, minlength=local)
    pieces = []
    for e, part in enumerate(rows[order].split(counts.tolist())):
        pieces.append(_swiglu(part, w_gate[e], w_up[e], w_down[e]))
    out = torch.cat(pieces) if pieces else rows.new_zeros((0, w_down.shape[1]))
    return out[torch.argsort(order)], counts


_SCALES_CHECKED: set[str] = set()  # blocks whose unchosen experts' input scales were checked to be 0


def input_scale_weights(
    scale: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, where: str = ""
) -> torch.Tensor:
    """The (N, k) weights of each token's chosen experts read from a scale of the experts' input rows
    (`MoE.input_scale`: E x N elements, expert-major, Llama 4's sigmoid of the scattered top-k logits),
    scale[e, n] for the k experts e token n chose. The expert pass runs only those: RuntimeError when a
    token's input to an expert it did not choose is scaled by anything but 0 (that expert's output would
    then count in the model's sum), checked on the first call for each block (``where``). Differentiable in
    ``scale``."""
    n, _ = topk_ids.shape
    table = scale.reshape(num_experts, n).t()  # (N, E)
    chosen = table.gather(1, topk_ids)  # (N, k)
    if where in _SCALES_CHECKED:  # the zeros are the model's structure: checked on a block's first call
        return chosen  # only, not synchronising a GPU's stream at every layer of every step
    rest = table.detach().scatter(1, topk_ids, 0.0)
    if bool(rest.ne(0).any()):
        raise RuntimeError(
            f"expert parallelism: {where or 'a MoE block'} scales the tokens of experts they did not choose by "
            "values other than 0, so every expert contributes and the expert pass, which runs the chosen ones "
            "only, would compute other outputs; plan it with --ep 1 --expert-tp 1"
        )
    _SCALES_CHECKED.add(where)
    return chosen


def ep_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    num_experts: int,
    axis: str,
    label: str = "",
    tp_axis: str | None = None,
    scale_input: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A dropless MoE layer with the experts split over the EP ranks of `axis` (module docstring).
    tp_axis: expert tensor parallelism: the weights are this TP rank's 1/tp of every expert's width
    (gate / up column-parallel, down row-parallel), the TP ranks holding the same tokens; x and the
    router's weights enter through `tp_copy` and the output is all-reduced over `tp_axis` (Megatron's
    f and g around an MLP).

    x: (N, C) this rank's tokens; topk_ids: (N, k) int64 expert ids in 0 .. num_experts - 1;
    topk_weights: (N, k) the router's weights; w_gate, w_up: (E_l, I, C), w_down: (E_l, C, I) this
    rank's E_l = num_experts / ep experts (SwiGLU). Returns ((N, C) output, (E_l,) rows each local
    expert computed; also kept under `label` for `last_loads`). Differentiable in x, topk_weights and the
    weights. scale_input: the weights scale each chosen expert's input rows and the outputs are summed
    unweighted (`MoE.input_scale`, Llama 4), instead of weighing the outputs. ValueError when the EP size
    does not divide num_experts or the local weights are not E / ep experts."""
    group, size, experts = _local(axis, num_experts, w_gate)
    if tp_axis is not None:
        from passes.collectives import tp_copy_pair  # noqa: PLC0415 - same package, no cycle

        x, topk_weights = tp_copy_pair(x, topk_weights, tp_axis)
    n, k = topk_ids.shape
    ids = topk_ids.reshape(-1)
    order = torch.argsort(ids, stable=True)  # assignments sorted by expert: contiguous per rank
    token = torch.arange(n, device=x.device).repeat_interleave(k)[order]
    rows = x[token]  # (N k, C)
    row_weights = topk_weights.reshape(-1)[order].unsqueeze(-1)  # (N k, 1)
    if scale_input:
        rows = rows * row_weights.to(rows.dtype)
    per_expert = torch.bincount(ids, minlength=num_experts)  # rows this rank sends to each expert
    if size == 1:
        out_rows, counts = _experts(rows, ids[order], w_gate, w_up, w_down)
    else:
        # how many rows every rank sends to each of this rank's experts: (size, E_l)
        recv_per_expert = torch.empty_like(per_expert)
        dist.all_to_all_single(recv_per_expert, per_expert, group=group)
        recv_per_expert = recv_per_expert.view(size, len(experts))
        send_splits = per_expert.view(size, len(experts)).sum(1).tolist()
        recv_splits = recv_per_expert.sum(1).tolist()
        received = _exchange(rows, recv_splits, send_splits, group)
        local_ids = torch.arange(len(experts), device=x.device).repeat(size)
        expert_of_row = local_ids.repeat_interleave(recv_per_expert.reshape(-1))
        computed, counts = _experts(received, expert_of_row, w_gate, w_up, w_down)
        out_rows = _exchange(computed, send_splits, recv_splits, group)
    if label:
        _LOADS[label] = counts.tolist()
    weighted = out_rows if scale_input else out_rows * row_weights.to(out_rows.dtype)
    out = _combine(weighted, token, n)
    if tp_axis is not None:
        from passes.collectives import tp_all_reduce  # noqa: PLC0415

        out = tp_all_reduce(out, tp_axis)
    return out, counts


def ep_moe_replicated(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    num_experts: int,
    axis: str,
    label: str = "",
    scale_input: bool = False,
) -> torch.Tensor:
    """A MoE layer with the experts split over ranks that hold the same tokens (the TP ranks, whose
    stream is replicated: vLLM's `--enable-expert-parallel` at data-parallel size 1): each rank runs its
    experts on every token routed to them, weighs and sums their outputs into an (N, C) partial result,
    and one all-reduce over `axis` adds the ranks' parts. No token moves. Shapes as `ep_moe`; returns
    the (N, C) output (scale_input as `ep_moe`'s). Under autograd x and topk_weights enter through
    `tp_copy_pair` (their gradients are partial on each rank and summed over the axis in one
    all-reduce, as priced), and the all-reduce's backward is the identity (Megatron's f and g,
    `passes.collectives`)."""
    from passes.collectives import tp_all_reduce, tp_copy_pair  # noqa: PLC0415 - same package, no cycle

    group, size, experts = _local(axis, num_experts, w_gate)
    x, topk_weights = tp_copy_pair(x, topk_weights, axis)
    n, k = topk_ids.shape
    ids = topk_ids.reshape(-1)
    mine = (ids >= experts.start) & (ids < experts.stop)
    picked = torch.arange(n * k, device=x.device)[mine]  # static-free indexing: runs eagerly only
    token = picked // k
    rows = x[token]
    row_weights = topk_weights.reshape(-1)[picked].unsqueeze(-1)  # (rows, 1)
    if scale_input:
        rows = rows * row_weights.to(rows.dtype)
    out_rows, counts = _experts(rows, ids[picked] - experts.start, w_gate, w_up, w_down)
    if label:
        _LOADS[label] = counts.tolist()
    weighted = out_rows if scale_input else out_rows * row_weights.to(out_rows.dtype)
    partial = _combine(weighted, token, n)
    return tp_all_reduce(partial, axis)

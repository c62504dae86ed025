"""Tensor-parallel communication overlap: GraphModule -> GraphModule with each block's TP collectives
cut into chunks that run while the GEMMs beside them compute (`Plan.tp_comm_overlap`).

The TP pass (`passes.tensor_parallel`) leaves every TP block as a collective beside its matmuls:

    column-parallel entry    tp_copy(x) or tp_sequence_gather(x, seq)   -> linear(., w_i) for each i
    row-parallel exit        linear(x, w) -> tp_all_reduce(.)  or  tp_reduce_scatter(., seq)

`apply_tp_overlap` replaces each such group by one call of a function of this module, an autograd
Function that issues its collectives asynchronously chunk by chunk (the tokens cut into `chunks`
pieces) and waits for a chunk's transfer only after the next chunk's GEMM has been issued, as
Megatron-LM's `--tp-comm-overlap` (Transformer Engine's userbuffers) and PyTorch's async TP
(`torch.ops.symm_mem.fused_all_gather_matmul` / `fused_matmul_reduce_scatter`) decompose them
(Wang et al. 2022, "Overlap communication with dependent computation via decomposition"):

| function                | forward                                            | backward                                         |
|-------------------------|----------------------------------------------------|--------------------------------------------------|
| `tp_column_matmuls`     | no SP: y_i = x w_i (no communication)              | dx = sum_i g_i w_i, all-reduced async while the  |
|                         |                                                    | weight-gradient GEMMs run (Megatron-LM's async   |
|                         |                                                    | grad all-reduce)                                 |
|                         | SP: each chunk of the sequence shard all-gathered  | each chunk's dx reduce-scattered async while the |
|                         | async, chunk k's GEMMs while chunk k+1 arrives;    | next chunk's GEMMs run; the shard all-gathered   |
|                         | only the shard is kept for backward                | again, whole, under those input-gradient GEMMs,  |
|                         |                                                    | then one weight-gradient GEMM per weight         |
| `tp_row_matmul`         | no SP: each chunk's partial product all-reduced    | dx = g w, dw = g^T x (the all-reduce's conjugate |
|                         | async while the next chunk's GEMM runs             | is the identity: nothing to overlap)             |
|                         | SP: each chunk reduce-scattered async while the    | each chunk of the output gradient all-gathered   |
|                         | next chunk's GEMM runs                             | async, chunk k's dx GEMM while chunk k+1 arrives;|
|                         |                                                    | then one weight-gradient GEMM over all chunks    |

Only the GEMMs whose transfers they hide are cut into chunks: each weight gradient is one GEMM that
reduces over the whole sequence, as Megatron-LM / Transformer Engine run it (cut into C GEMMs it would
reduce over 1/C of the rows each, a short K loop: `planner.solver.costing.tp_overlap_chunk_compute_s`).
The last chunk's transfer has nothing after it to hide behind: what the planner prices as exposed
(`planner.solver.costing.tp_block_comm_s`). The same bytes cross the links as without overlap.
Each chunk's GEMM, issue and wait is a `torch.profiler.record_function` range
("tp_overlap.<function>.<gemm|issue|wait>.<chunk>"), so a profile shows the order.

On gloo and NCCL alike the chunks are torch.distributed's asynchronous collectives (`async_op=True`);
a single-rank axis makes every function the plain matmul. Weights come as they sit in the graph:
`linear` layout (out, in) for aten.linear, (in, out) for aten.mm / addmm.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx
from torch.profiler import record_function

from passes import collectives
from passes.collectives import _group, all_gather_single, reduce_scatter_single
from passes.tp_rules import is_weight_product
from planner.plan import tp_overlap_chunk_count

aten = torch.ops.aten

__all__ = ["apply_sequence_regather", "apply_tp_overlap", "tp_column_matmuls", "tp_row_matmul"]


def _mm(x: torch.Tensor, w: torch.Tensor, linear: bool) -> torch.Tensor:
    """x @ w for a weight in `linear` (out, in) or mm (in, out) layout."""
    return F.linear(x, w) if linear else x @ w


def _input_grad(g: torch.Tensor, w: torch.Tensor, linear: bool) -> torch.Tensor:
    return g @ w if linear else g @ w.t()


def _weight_grad(g: torch.Tensor, x: torch.Tensor, linear: bool) -> torch.Tensor:
    """dW of y = x w in the weight's layout; g, x flattened to rows."""
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    return g2.t() @ x2 if linear else x2.t() @ g2


def _bounds(length: int, chunks: int) -> list[tuple[int, int]]:
    """(start, stop) of each of `chunks` near-equal runs of `length` rows (torch.tensor_split's)."""
    base, extra = divmod(length, chunks)
    out, start = [], 0
    for c in range(chunks):
        stop = start + base + (1 if c < extra else 0)
        out.append((start, stop))
        start = stop
    return [b for b in out if b[1] > b[0]]


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, object]:
    """Async all-gather of `x` along dim 0 (rank order): (output buffer, work)."""
    x = x.contiguous()
    out = torch.empty((_size(group) * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, all_gather_single(out, x, group=group, async_op=True)


def _scatter_rows(x: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, object]:
    """Async sum reduce-scatter of `x` along dim 0: (this rank's rows, work)."""
    x = x.contiguous()
    out = torch.empty((x.shape[0] // _size(group), *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, reduce_scatter_single(out, x, group=group, async_op=True)


def _ranks_rows(t: torch.Tensor, size: int, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of every rank's block of a dim-0-first tensor of size * L rows, stacked in
    rank order: (size * (stop - start), ...)."""
    blocks = t.reshape(size, t.shape[0] // size, *t.shape[1:])
    return blocks[:, start:stop].reshape(size * (stop - start), *t.shape[1:])


def _place_rows(dest: torch.Tensor, rows: torch.Tensor, size: int, start: int, stop: int) -> None:
    """Write `rows` (as `_ranks_rows` returns them) into rows [start, stop) of each rank's block of `dest`."""
    blocks = dest.view(size, dest.shape[0] // size, *dest.shape[1:])
    blocks[:, start:stop] = rows.view(size, stop - start, *rows.shape[1:])


class _RowMatmul(torch.autograd.Function):
    """y = reduce(x w) over the TP axis, chunked (module docstring). seq None: all-reduce of the rows
    of x (any shape, rows = every dim but the last); else reduce-scatter along dim `seq`."""

    @staticmethod
    def forward(ctx, x, w, linear: bool, axis: str, seq: int | None, chunks: int):
        group = _group(axis)
        ctx.save_for_backward(x, w)
        ctx.linear, ctx.axis, ctx.seq, ctx.chunks = linear, axis, seq, chunks
        size = _size(group)
        if seq is None:
            rows = x.reshape(-1, x.shape[-1])
            outs, works = [], []
            for c, (a, b) in enumerate(_bounds(rows.shape[0], chunks)):
                with record_function(f"tp_overlap.row.gemm.{c}"):
                    y = _mm(rows[a:b], w, linear).contiguous()
                with record_function(f"tp_overlap.row.issue.{c}"):
                    work = dist.all_reduce(y, group=group, async_op=True) if size > 1 else None
                outs.append(y)
                works.append(work)
            for c, work in enumerate(works):
                with record_function(f"tp_overlap.row.wait.{c}"):
                    if work is not None:
                        work.wait()
            return torch.cat(outs).reshape(*x.shape[:-1], outs[0].shape[-1])
        front = x.movedim(seq, 0)  # (T, ..., K_local): rank r's output rows are its block of T / size
        local = front.shape[0] // size
        pieces, works = [], []
        for c, (a, b) in enumerate(_bounds(local, chunks)):
            with record_function(f"tp_overlap.row.gemm.{c}"):
                y = _mm(_ranks_rows(front, size, a, b), w, linear)
            with record_function(f"tp_overlap.row.issue.{c}"):
                piece, work = _scatter_rows(y, group) if size > 1 else (y, None)
            pieces.append(piece)
            works.append(work)
        for c, work in enumerate(works):
            with record_function(f"tp_overlap.row.wait.{c}"):
                if work is not None:
                    work.wait()
        return torch.cat(pieces).movedim(0, seq).contiguous()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        linear, seq = ctx.linear, ctx.seq
        need_dw = ctx.needs_input_grad[1]  # a frozen weight (LoRA's base) takes no gradient
        if seq is None:  # the all-reduce's conjugate is the identity
            dw = _weight_grad(g, x, linear) if need_dw else None
            return _input_grad(g, w, linear), dw, None, None, None, None
        group = _group(ctx.axis)
        size = _size(group)
        front_g = g.movedim(seq, 0).contiguous()  # (L, ..., N): this rank's rows of the output gradient
        front_x = x.movedim(seq, 0)
        dx = torch.empty_like(front_x)
        # every rank's output gradient in sequence order, for one weight-gradient GEMM over all of it
        whole_g = (
            torch.empty((size * front_g.shape[0], *front_g.shape[1:]), dtype=g.dtype, device=g.device)
            if need_dw
            else None
        )
        bounds = _bounds(front_g.shape[0], ctx.chunks)
        issued = []
        for c, (a, b) in enumerate(bounds):
            with record_function(f"tp_overlap.row.issue.{c}"):
                issued.append(_gather_rows(front_g[a:b], group) if size > 1 else (front_g[a:b], None))
        for c, ((a, b), (gathered, work)) in enumerate(zip(bounds, issued)):
            with record_function(f"tp_overlap.row.wait.{c}"):
                if work is not None:
                    work.wait()
            with record_function(f"tp_overlap.row.gemm.{c}"):
                _place_rows(dx, _input_grad(gathered, w, linear), size, a, b)
                if need_dw:
                    _place_rows(whole_g, gathered, size, a, b)
        dw = None
        if need_dw:  # once, reducing over the whole sequence: a GEMM per chunk would reduce over 1/C of it
            with record_function("tp_overlap.row.gemm.weights"):
                dw = _weight_grad(whole_g, front_x, linear)
        return dx.movedim(0, seq), dw, None, None, None, None


class _ColumnMatmuls(torch.autograd.Function):
    """y_i = x w_i (+ b_i) for column-parallel weights sharing the input x, chunked (module docstring).
    seq None: x replicated, its gradient all-reduced; else x is this rank's sequence shard along dim
    `seq`, all-gathered in chunks, its gradient reduce-scattered."""

    @staticmethod
    def forward(
        ctx, x, linear: bool, axis: str, seq: int | None, chunks: int, overlap: bool, num: int, *params
    ):
        weights, biases = params[:num], params[num:]
        group = _group(axis)
        size = _size(group)
        ctx.linear, ctx.axis, ctx.seq, ctx.chunks, ctx.num = linear, axis, seq, chunks, num
        ctx.overlap = overlap
        ctx.has_bias = [b is not None for b in biases]
        if seq is None:
            ctx.save_for_backward(x, *weights)
            with record_function("tp_overlap.column.gemm.0"):
                outs = [_mm(x, w, linear) for w in weights]
            return tuple(y if b is None else y + b for y, b in zip(outs, biases))
        front = x.movedim(seq, 0).contiguous()  # (L, ..., K): this rank's sequence shard
        local = ctx.local = front.shape[0]
        bounds = _bounds(local, chunks)
        issued = []
        for c, (a, b) in enumerate(bounds):
            with record_function(f"tp_overlap.column.issue.{c}"):
                issued.append(_gather_rows(front[a:b], group) if size > 1 else (front[a:b], None))
        outs = [
            torch.empty((size * local, *front.shape[1:-1], _out_features(w, linear)), dtype=x.dtype, device=x.device)
            for w in weights
        ]  # fmt: skip
        for c, ((a, b), (rows, work)) in enumerate(zip(bounds, issued)):
            with record_function(f"tp_overlap.column.wait.{c}"):
                if work is not None:
                    work.wait()
            with record_function(f"tp_overlap.column.gemm.{c}"):
                for out, w in zip(outs, weights):
                    _place_rows(out, _mm(rows, w, linear), size, a, b)
        # the sequence shard, not the gathered input, is kept for the weight gradients: backward
        # all-gathers it again (Korthikanti et al. 2022, section 4.2.2; Megatron-LM's sequence parallelism)
        trains = any(w.requires_grad for w in weights)  # else no weight gradient needs the input
        ctx.save_for_backward(front if trains else None, *weights)
        return tuple(
            (y if bias is None else y + bias).movedim(0, seq).contiguous() for y, bias in zip(outs, biases)
        )  # fmt: skip

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        linear, seq, group = ctx.linear, ctx.seq, _group(ctx.axis)
        size = _size(group)
        # weight gradients only for the weights that train (a LoRA base weight is frozen)
        needs = ctx.needs_input_grad[7 : 7 + ctx.num]
        dbias = [
            g.reshape(-1, g.shape[-1]).sum(0) if has else None for g, has in zip(grads, ctx.has_bias)
        ]  # fmt: skip
        if seq is None:
            with record_function("tp_overlap.column.gemm.0"):
                dx = sum(_input_grad(g, w, linear) for g, w in zip(grads, weights))
            with record_function("tp_overlap.column.issue.0"):
                work = dist.all_reduce(dx, group=group, async_op=True) if size > 1 else None
            with record_function("tp_overlap.column.gemm.1"):
                dws = [_weight_grad(g, x, linear) if need else None for g, need in zip(grads, needs)]
            with record_function("tp_overlap.column.wait.0"):
                if work is not None:
                    work.wait()
            return dx, None, None, None, None, None, None, *dws, *dbias
        fronts = [g.movedim(seq, 0) for g in grads]  # (T, ..., N_i): every rank's rows
        bounds = _bounds(ctx.local, ctx.chunks)  # x: this rank's sequence shard (L, ..., K), if kept
        # the shard gathered again, whole, for the weight gradients: issued first, it transfers while
        # the chunks' input-gradient GEMMs run (Megatron-LM's sequence-parallel backward does the same)
        regather = None
        if any(needs):
            with record_function("tp_overlap.column.regather.issue"):
                regather = _gather_rows(x, group) if size > 1 else (x, None)
        pieces, works = [], []
        for c, (a, b) in enumerate(bounds):
            with record_function(f"tp_overlap.column.gemm.{c}"):
                rows = [_ranks_rows(f, size, a, b) for f in fronts]
                dx = sum(_input_grad(r, w, linear) for r, w in zip(rows, weights))
            with record_function(f"tp_overlap.column.issue.{c}"):
                piece, work = _scatter_rows(dx, group) if size > 1 else (dx, None)
            if work is not None and not ctx.overlap:
                work.wait()
                work = None
            pieces.append(piece)
            works.append(work)
        dws: list[torch.Tensor | None] = [None] * len(weights)
        if regather is not None:
            whole_x, pending = regather
            with record_function("tp_overlap.column.regather.wait"):
                if pending is not None:
                    pending.wait()
            # once per weight, reducing over the whole sequence (the last chunks' reduce-scatters
            # transfer meanwhile); a GEMM per chunk would reduce over 1/C of it
            with record_function("tp_overlap.column.gemm.weights"):
                dws = [_weight_grad(f, whole_x, linear) if need else None for f, need in zip(fronts, needs)]
        for c, work in enumerate(works):
            with record_function(f"tp_overlap.column.wait.{c}"):
                if work is not None:
                    work.wait()
        dx = torch.cat(pieces).movedim(0, seq)
        return dx, None, None, None, None, None, None, *dws, *dbias


def _out_features(w: torch.Tensor, linear: bool) -> int:
    return w.shape[0] if linear else w.shape[1]


def tp_row_matmul(
    x: torch.Tensor, w: torch.Tensor, linear: bool, axis: str, seq: int | None, chunks: int
) -> torch.Tensor:
    """A row-parallel matmul and its reduction over `axis`, chunked: x (..., K / tp) times w (the
    rank's rows: (N, K / tp) `linear`, else (K / tp, N)). seq None: all-reduced, (..., N); else
    reduce-scattered along dim `seq` (that dim / tp). Raises RuntimeError for an unregistered axis."""
    return _RowMatmul.apply(x, w, linear, axis, seq, chunks)


def tp_column_matmuls(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    linear: bool,
    axis: str,
    seq: int | None,
    chunks: int,
    overlap: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Column-parallel matmuls sharing the input x, chunked: one output (..., N_i / tp) per weight
    (each the rank's columns), bias added where given. seq None: x replicated (..., K); else x is the
    rank's sequence shard along dim `seq`, all-gathered (the outputs have the whole sequence), and only
    the shard is kept for backward, which all-gathers it again for the weight gradients. overlap
    False (sequence parallelism without `Plan.tp_comm_overlap`, one chunk): every collective but the
    backward's gather of the shard is waited for as soon as it is issued."""
    return _ColumnMatmuls.apply(x, linear, axis, seq, chunks, overlap, len(weights), *weights, *biases)


# ---------------------------------------------------------------------------------------------
# The pass

_LINEAR = (aten.linear.default,)
_MM = (aten.mm.default,)


def _matmul_input_weight(node: fx.Node) -> tuple[fx.Node, fx.Node, object, bool] | None:
    """(input, weight, bias, linear layout) of an aten.linear / aten.mm node or a projection
    `aten.matmul(x, W)` (`passes.tp_rules.is_weight_product`), else None."""
    if node.op != "call_function":
        return None
    if node.target in _LINEAR:
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return node.args[0], node.args[1], bias, True
    if node.target in _MM or (node.target is aten.matmul.default and is_weight_product(node)):
        return node.args[0], node.args[1], None, False
    return None


# node meta that says which module (so which layer) a node belongs to
_OWNER_KEYS = ("module_path", "nn_module_stack")


def _is_call(node: object, fn: object) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is fn


def _fuse_row(gm: fx.GraphModule, red: fx.Node, chunks: int, inside: Collection[str]) -> bool:
    """Replace `linear/mm -> tp_all_reduce | tp_reduce_scatter` by one `tp_row_matmul`."""
    mm = red.args[0]
    parts = _matmul_input_weight(mm) if isinstance(mm, fx.Node) else None
    if parts is None or len(mm.users) != 1 or parts[2] is not None or mm.name not in inside:
        return False
    x, w, _, linear = parts
    seq = None if red.target is collectives.tp_all_reduce else red.args[1]
    axis = red.args[1] if seq is None else red.args[2]
    with gm.graph.inserting_before(red):
        fused = gm.graph.call_function(tp_row_matmul, (x, w, linear, axis, seq, chunks))
    fused.meta = {**{k: v for k, v in mm.meta.items() if k in _OWNER_KEYS}, **red.meta}
    red.replace_all_uses_with(fused)
    gm.graph.erase_node(red)
    gm.graph.erase_node(mm)
    return True


def _fuse_column(
    gm: fx.GraphModule, entry: fx.Node, chunks: int, inside: Collection[str], overlap: bool = True
) -> bool:
    """Replace `tp_copy | tp_sequence_gather -> linear/mm (each user)` by one `tp_column_matmuls`."""
    users = list(entry.users)
    parts = [_matmul_input_weight(u) for u in users]
    if not users or any(p is None or p[0] is not entry for p in parts):
        return False
    if any(u.name not in inside for u in users):
        return False
    layouts = {p[3] for p in parts}  # type: ignore[index]
    if len(layouts) != 1:
        return False
    x = entry.args[0]
    seq = None if entry.target is collectives.tp_copy else entry.args[1]
    axis = entry.args[1] if seq is None else entry.args[2]
    weights = [p[1] for p in parts]  # type: ignore[index]
    biases = [p[2] for p in parts]  # type: ignore[index]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = min(users, key=order.__getitem__)
    needed = [a for a in (x, *weights, *biases) if isinstance(a, fx.Node)]
    if any(order[a] > order[first] for a in needed):  # a weight made after the first matmul: leave it
        return False
    with gm.graph.inserting_before(first):
        fused = gm.graph.call_function(
            tp_column_matmuls, (x, weights, biases, layouts.pop(), axis, seq, chunks, overlap)
        )
        # the layer that owns it (`passes.layers.layer_of_nodes`: recompute regions, pipeline stages)
        fused.meta.update({k: v for k, v in first.meta.items() if k in _OWNER_KEYS})
        fused.meta["val"] = tuple(u.meta.get("val") for u in users)
        for i, user in enumerate(users):
            item = gm.graph.call_function(operator.getitem, (fused, i))
            item.meta = dict(user.meta)
            user.replace_all_uses_with(item)
    for user in users:
        gm.graph.erase_node(user)
    gm.graph.erase_node(entry)
    return True


def apply_tp_overlap(gm: fx.GraphModule, tp: int, layer_nodes: Collection[str]) -> fx.GraphModule:
    """Fuse each TP block's collectives with the matmuls beside them into the chunked functions of
    this module (in place; returns `gm`), `planner.plan.tp_overlap_chunk_count(tp)` chunks each
    (fewer where a tensor has fewer rows). Only matmuls of the transformer layers (`layer_nodes`: their fx node
    names, `planner.frontend.analysis.Layer.nodes`) are fused, as the planner prices it; collectives
    in other shapes (a laddered block's `tp_all_reduce_start`, the embedding's, the LM head's) are
    left as they are. Records ``gm.meta["tp_overlap"]`` = {"row":
    fused exits, "column": fused entries}."""
    chunks = tp_overlap_chunk_count(tp)
    counts = {"row": 0, "column": 0}
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in (collectives.tp_all_reduce, collectives.tp_reduce_scatter):
            counts["row"] += _fuse_row(gm, node, chunks, layer_nodes)
        elif node.target in (collectives.tp_copy, collectives.tp_sequence_gather):
            counts["column"] += _fuse_column(gm, node, chunks, layer_nodes)
    gm.graph.lint()
    gm.recompile()
    gm.meta["tp_overlap"] = counts
    return gm


def apply_sequence_regather(gm: fx.GraphModule, layer_nodes: Collection[str]) -> fx.GraphModule:
    """Training under sequence parallelism without `Plan.tp_comm_overlap`: replace each
    `tp_sequence_gather -> linear/mm (each user)` of the transformer layers (`layer_nodes`) by one
    `tp_column_matmuls` of one chunk whose collectives are waited for at once (in place; returns
    `gm`). The result is the same computation with the same collectives in forward; what changes is
    what autograd keeps: the rank's sequence shard instead of the gathered input, all-gathered again
    in backward for the weight gradients, as Megatron-LM does and as the planner prices it
    (`planner.solver.costing.projection_options`, `sequence_regather_s` in `tp_block_comm_s`). A
    gather with a user that is not a matmul is left as it is (its gathered input is kept whole).
    Records ``gm.meta["sp_regather"]`` = the number of entries replaced."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is collectives.tp_sequence_gather:
            count += _fuse_column(gm, node, 1, layer_nodes, overlap=False)
    gm.graph.lint()
    gm.recompile()
    gm.meta["sp_regather"] = count
    return gm

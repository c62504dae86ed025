"""Tensor-parallel communication overlap (`Plan.tp_comm_overlap`): rewritten, run, ordered and priced.

One 2-rank launch runs the plan's own run (`runtime.execute.run_rank`: outputs, loss, gradients and
the first optimizer step against the unsharded model) for TP2 with and without sequence parallelism,
training and forward, plus one job whose chunks are put back in the wrong order (its check must
fail), and, on an emitted module, a profile of one training step whose `record_function` ranges show
each chunk's collective issued before the next chunk's GEMM and waited for after it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import pytest
import torch

from costmodels.cluster import load_cluster
from passes import tp_overlap
from passes.lower import lower_for_rank
from planner.errors import InputError
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture
from planner.frontend.modelfile import load_model_file
from planner.plan import MeshShape
from planner.solver.costing import (
    CostContext,
    contention_s,
    sequence_regather_s,
    stream_conversion_time_s,
    tp_block_comm_s,
    tp_overlap_chunks,
)
from planner.solver.problem import Constraints, LadderPolicy, MeshConfig, WorkloadSpec
from planner.solver.search import plan_model
from runtime.execute import run_rank
from runtime.job import summarise
from runtime.launch import RankContext, launch
from runtime.numerics import check_failures
from tests.test_run_modes import _job, _plan

MODELS = Path(__file__).resolve().parent / "models"
LLAMA4 = "tiny_lm_tokens.py"  # 4 layers, examples/models' Llama, random tokens

LAYOUTS = {  # label: (plan kwargs)
    "train": dict(workload="train"),
    "train_sp": dict(workload="train", sequence_parallel=True),
    "train_sp_m2": dict(workload="train", sequence_parallel=True, micro_batches=2),
    "forward": dict(workload="forward"),
    "forward_sp": dict(workload="forward", sequence_parallel=True),
}
WRONG = {"train_sp_wrong": dict(workload="train", sequence_parallel=True)}
# GPT-2's fused qkv projection with a bias, sharded by its q / k / v parts: the check once read its
# reference gradient as one contiguous chunk once the pass had fused the linear away (a false failure)
GPT2 = "gpt2_odd_vocab.py"
BIASED = {"train_gpt2_qkv_bias": dict(workload="train", model=GPT2)}
# projections written `x @ W` / `einsum("btd,df->btf", x, W)` with W (in, out): `aten.matmul` nodes the
# TP pass once left unsharded ("not read by a matmul ... the pass understands") and the fusion skipped
INOUT_MODEL = "inout_weights.py"
INOUT = {"train_sp_inout": dict(workload="train", sequence_parallel=True, model=INOUT_MODEL)}


def _overlap_plan(**kw):
    m = kw.pop("micro_batches", 1)
    plan = _plan(kw.pop("model", LLAMA4), tp=2, batch_size=4, workload=kw.pop("workload"))
    return dataclasses.replace(plan, tp_comm_overlap=True, micro_batches=m, **kw)


def _reversed_rows(t: torch.Tensor, size: int, start: int, stop: int) -> torch.Tensor:
    """A wrong `_ranks_rows`: every rank's rows in reverse rank order."""
    blocks = t.reshape(size, t.shape[0] // size, *t.shape[1:]).flip(0)
    return blocks[:, start:stop].reshape(size * (stop - start), *t.shape[1:])


def _profiled_step(ctx: RankContext, folder: str) -> list[tuple[str, int, int]]:
    """This rank's emitted TP2 module (tp_comm_overlap, sequence parallel), one forward and backward
    under torch.profiler: the `tp_overlap.*` ranges as (name, start us, end us), in start order."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    from passes import collectives  # noqa: PLC0415
    from passes.emit import load_rank_module  # noqa: PLC0415

    collectives.register_group("tp", dist.group.WORLD)
    module = load_rank_module(folder, ctx.rank, ctx.device)
    (tokens,) = load_model_file(MODELS / LLAMA4).inputs(4, 8)[0]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        module(tokens).square().mean().backward()
    events = [
        (e.name, int(e.time_range.start), int(e.time_range.end))
        for e in prof.events()
        if e.name.startswith("tp_overlap.")
    ]
    return sorted(events, key=lambda e: e[1])


def run_labelled(ctx: RankContext, payload: tuple[list, str]) -> dict:
    """Rank entry: run_rank for each (label, job, wrong) in turn (wrong: chunks reassembled in the
    wrong rank order), then the profiled step of the emitted module in `folder`."""
    jobs, folder = payload
    out: dict = {}
    for label, job, wrong in jobs:
        if wrong:
            with mock.patch.object(tp_overlap, "_ranks_rows", _reversed_rows):
                out[label] = run_rank(ctx, job)
        else:
            out[label] = run_rank(ctx, job)
    out["profile"] = _profiled_step(ctx, folder)
    return out


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory) -> dict:
    from planner.cli.emitting import emit_plan  # noqa: PLC0415

    folder = tmp_path_factory.mktemp("tp_overlap_emit") / "emitted"
    emit_plan(_overlap_plan(workload="train", sequence_parallel=True), str(MODELS / LLAMA4), str(folder))
    kinds = {**LAYOUTS, **WRONG, **BIASED, **INOUT}
    plans = {label: _overlap_plan(**dict(kw)) for label, kw in kinds.items()}
    jobs = [
        (label, _job(kinds[label].get("model", LLAMA4), plan), label in WRONG)
        for label, plan in plans.items()
    ]
    reports = launch(run_labelled, (jobs, str(folder)), nproc=2, timeout_s=600)
    out = {label: (plans[label], summarise([r[label] for r in reports])) for label in plans}
    out["profile"] = [r["profile"] for r in reports]
    return out


@pytest.mark.slow
def test_overlapped_tp_matches_the_unsharded_model(two_rank: dict) -> None:
    """Outputs, loss, gradients and the first optimizer step as the unsharded model's with TP overlap
    on, with and without sequence parallelism; chunks put back in the wrong order fail the check."""
    for label in [*LAYOUTS, *BIASED, *INOUT]:
        plan, summary = two_rank[label]
        n = summary["numerics"]
        assert not check_failures(n), (label, check_failures(n))
        assert n["max_abs_diff"] <= n["tolerance_rel"] * n["output_scale"], (label, n)
        if plan.workload == "train":
            assert n["grad_max_abs_diff"] <= n["tolerance_rel"] * n["grad_scale"], (label, n)
            assert n["update_max_abs_diff"] is not None and n["update_max_abs_diff"] <= n["update_tolerance"]
    _, wrong = two_rank["train_sp_wrong"]
    assert check_failures(wrong["numerics"]), wrong["numerics"]


@pytest.mark.slow
def test_the_run_report_counts_the_fused_reduce_scatters(two_rank: dict) -> None:
    """With sequence parallelism and TP overlap the row-parallel exits are reduce-scatters fused with
    their matmuls (`tp_row_matmul`): the report says sequence parallelism applied and counts them, not
    that "no row-parallel output ... so its all-reduces stayed" (it looked for plain reduce-scatters)."""
    for label in ("train_sp", "train_sp_inout"):
        notes = two_rank[label][1]["measured"]["notes"]
        assert not any("sequence_parallel is set but" in t for t in notes), (label, notes)
        applied = [t for t in notes if t.startswith("sequence parallelism applied")]
        assert applied, (label, notes)
        fused = 8 if label == "train_sp" else 4  # two blocks per layer, each layer's exits fused
        assert (
            f"{fused} reduce-scatter(s), {fused} of them fused with the row-parallel matmuls" in applied[0]
        ), applied


@pytest.mark.slow
def test_each_chunk_is_issued_before_the_next_chunks_gemm_and_waited_after_it(two_rank: dict) -> None:
    """In a profiled training step of the emitted module (sequence parallel, 2 chunks): in every fused
    call, chunk 0's collective is issued before chunk 1's GEMM starts and waited for after it ends
    (forward: row-parallel reduce-scatter; backward: the column-parallel input gradient's
    reduce-scatter); and the column-parallel all-gathers of both chunks are issued before the first
    GEMM."""
    for events in two_rank["profile"]:
        names = [name for name, *_ in events]
        assert names.count("tp_overlap.row.issue.0") >= 8, names[:20]  # 8 blocks, forward and backward
        checked = 0
        for kind in ("row", "column"):
            for i, (name, _start, end) in enumerate(events):
                if name != f"tp_overlap.{kind}.issue.0":
                    continue
                rest = events[i + 1 :]
                gemm = next((e for e in rest if e[0] == f"tp_overlap.{kind}.gemm.1"), None)
                wait = next((e for e in rest if e[0] == f"tp_overlap.{kind}.wait.0"), None)
                assert gemm is not None and wait is not None, (kind, names[i : i + 8])
                if wait[1] < gemm[1]:  # an all-gather issued for every chunk first: its wait comes first
                    issue_1 = next(e for e in rest if e[0] == f"tp_overlap.{kind}.issue.1")
                    assert issue_1[1] < wait[1] and wait[2] <= gemm[1], (kind, names[i : i + 8])
                else:
                    assert end <= gemm[1] and gemm[2] <= wait[1], (kind, names[i : i + 8])
                checked += 1
        assert checked >= 32, checked  # 8 blocks x (entry, exit) x (forward, backward)


@pytest.mark.slow
def test_the_backward_gathers_the_shard_again_under_the_input_gradient_gemms(two_rank: dict) -> None:
    """Sequence parallel training keeps each column-parallel block's sequence shard, not its gathered
    input: in backward every fused column call issues the shard's all-gather again before its first
    chunk's input-gradient GEMM and waits for it after its last chunk's (hidden under them), then runs
    the weight-gradient GEMMs once, over the whole sequence, not per chunk."""
    for events in two_rank["profile"]:
        names = [name for name, *_ in events]
        assert names.count("tp_overlap.column.regather.issue") == 8, names.count(
            "tp_overlap.column.regather.issue"
        )  # 4 layers x 2 blocks
        assert names.count("tp_overlap.column.gemm.weights") == 8
        assert not {"tp_overlap.column.gemm.0.weights", "tp_overlap.column.gemm.1.weights"} & set(names)
        for i, (name, _start, end) in enumerate(events):
            if name != "tp_overlap.column.regather.issue":
                continue
            rest = events[i + 1 :]
            first = next(e for e in rest if e[0] == "tp_overlap.column.gemm.0")
            last = next(e for e in rest if e[0] == "tp_overlap.column.gemm.1")
            wait = next(e for e in rest if e[0] == "tp_overlap.column.regather.wait")
            weights = next(e for e in rest if e[0] == "tp_overlap.column.gemm.weights")
            assert end <= first[1] and last[2] <= wait[1] and wait[2] <= weights[1], names[i : i + 8]


@pytest.mark.slow
def test_the_row_backward_takes_its_weight_gradient_once_after_every_chunk(two_rank: dict) -> None:
    """The row-parallel backward (sequence parallel) cuts only its input-gradient GEMM into chunks, each
    under the next chunk's all-gather: its weight gradient is one GEMM after the last chunk's."""
    for events in two_rank["profile"]:
        names = [name for name, *_ in events]
        assert names.count("tp_overlap.row.gemm.weights") == 8, names.count("tp_overlap.row.gemm.weights")
        for i, (name, start, _end) in enumerate(events):
            if name != "tp_overlap.row.gemm.weights":
                continue
            before = [e for e in events[:i] if e[0].startswith("tp_overlap.row.gemm.")]
            assert before and before[-1][0] == "tp_overlap.row.gemm.1" and before[-1][2] <= start


def _lowered(plan, model: str = LLAMA4):
    model_file = load_model_file(MODELS / model)
    args, kwargs = model_file.inputs(4, 8)
    gm = capture(model_file.build("meta"), args, kwargs)
    return lower_for_rank(gm, analyse(gm), plan, 0, training=plan.workload == "train").module


def test_the_pass_fuses_every_layer_block_and_leaves_the_ends() -> None:
    """Each of the 4 layers' 2 blocks: one fused column-parallel entry and one row-parallel exit; the
    embedding's and LM head's collectives stay as the TP pass wrote them."""
    for sp in (False, True):
        gm = _lowered(_overlap_plan(workload="train", sequence_parallel=sp))
        assert gm.meta["tp_overlap"] == {"row": 8, "column": 8}, (sp, gm.meta["tp_overlap"])
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert targets.count(tp_overlap.tp_row_matmul) == 8
        assert targets.count(tp_overlap.tp_column_matmuls) == 8
        # each fused call belongs to the layer of the matmuls it replaced (`layer_of_nodes` reads the
        # module path: recompute regions and pipeline stages follow it), not to the node before it
        for node in gm.graph.nodes:
            if node.target in (tp_overlap.tp_row_matmul, tp_overlap.tp_column_matmuls):
                users = (
                    {u.meta.get("module_path") for u in node.users}
                    if node.target is not tp_overlap.tp_row_matmul
                    else set()
                )
                assert node.meta.get("module_path", "").startswith("layers."), (node.name, node.meta.keys())
                assert not users or node.meta["module_path"] in users, (node.name, users)


def test_projections_with_in_by_out_weights_are_split_and_fused() -> None:
    """`x @ W` / `torch.matmul(x, W)` / `einsum("btd,df->btf", x, W)` with W (in, out): each of the 2
    layers' 2 blocks gets one fused entry and one fused exit, its weights cut on the planned dims."""
    for sp in (False, True):
        gm = _lowered(_overlap_plan(workload="train", sequence_parallel=sp, model=INOUT_MODEL), INOUT_MODEL)
        assert gm.meta["tp_overlap"] == {"row": 4, "column": 4}, (sp, gm.meta["tp_overlap"])
        for layer in (0, 1):
            assert gm.get_parameter(f"blocks.{layer}.wqkv").shape == (32, 48)
            assert gm.get_parameter(f"blocks.{layer}.w_down").shape == (32, 32)


def test_a_block_without_a_column_parallel_entry_gathers_nothing_again() -> None:
    """The backward's gather of the sequence shard is priced only for a block with column-parallel
    projections (a replicated block runs on the rank's tokens and gathers nothing), with and without
    TP overlap."""
    from planner.plan import Layout  # noqa: PLC0415

    for overlap in (False, True):
        ctx = _ctx("dgx-h100", overlap, True)
        nbytes, gemm_s = 8 * 4096 * 4096 * 2, 3e-3
        with_entry = tp_block_comm_s(Layout.PARTIAL, nbytes, gemm_s, gemm_s, ctx)
        without = tp_block_comm_s(Layout.PARTIAL, nbytes, 0.0, gemm_s, ctx)
        regather = sequence_regather_s(nbytes, ctx)
        assert regather > 0
        assert sum(with_entry) > sum(without)  # exposed + hidden: the entry's gather again counted
        if not overlap:
            assert without == (stream_conversion_time_s(Layout.PARTIAL, nbytes, ctx), 0.0)


def test_tp_overlap_with_ladder_residual_is_refused() -> None:
    with pytest.raises(InputError, match="--tp-comm-overlap on and --ladder"):
        Constraints(tp_comm_overlap=True, ladder=LadderPolicy.parse("upper:2"))
    plan = dataclasses.replace(_overlap_plan(workload="forward"), ladder_layers=[3])
    with pytest.raises(InputError, match="tp_comm_overlap"):
        _lowered(plan)


def _ctx(cluster: str, overlap: bool, sp: bool, tp: int = 8) -> CostContext:
    model_file = load_model_file(MODELS / LLAMA4)
    args, kwargs = model_file.inputs(8, 64)
    structure = analyse(capture(model_file.build("meta"), args, kwargs))
    config = MeshConfig(MeshShape(tp, 1, 1), 1, sequence_parallel=sp, tp_comm_overlap=overlap)
    return CostContext(structure, load_cluster(cluster), WorkloadSpec("train", 8, 64), config, "bf16")


@pytest.mark.parametrize("sp", [False, True])
def test_overlap_hides_what_the_next_chunks_gemm_covers_and_never_the_last_chunk(sp: bool) -> None:
    """With overlap a block's exposed TP traffic falls, but never below the last chunk's transfer of
    each collective; without it (or with nothing to hide behind) it is `stream_conversion_time_s`."""
    from planner.plan import Layout  # noqa: PLC0415

    on, off = _ctx("dgx-h100", True, sp), _ctx("dgx-h100", False, sp)
    nbytes, gemm_s = 8 * 4096 * 4096 * 2, 3e-3
    whole = stream_conversion_time_s(Layout.PARTIAL, nbytes, off)
    # without overlap all exposed but, under sequence parallelism, the backward's gather of the
    # entry's input again, under the column-parallel input-gradient GEMM (one of its three)
    regather = sequence_regather_s(nbytes, off)
    assert (regather > 0) == sp
    hid = min(regather, off.cluster.overlap_efficiency * gemm_s / off.compute_factor)
    off_exposed, off_hidden = tp_block_comm_s(Layout.PARTIAL, nbytes, gemm_s, gemm_s, off)
    assert off_hidden == pytest.approx(hid)
    assert off_exposed == pytest.approx(whole + regather - hid + contention_s(hid, off.cluster))
    exposed, hidden = tp_block_comm_s(Layout.PARTIAL, nbytes, gemm_s, gemm_s, on)
    assert exposed < whole and hidden > 0
    chunks = tp_overlap_chunks(on)
    assert chunks == 8
    # nothing to hide behind: all exposed, plus the chunking's extra latencies
    bare, none_hidden = tp_block_comm_s(Layout.PARTIAL, nbytes, 0.0, 0.0, on)
    assert none_hidden == 0.0 and bare >= whole
    # everything hideable hidden: what is left is at least the last chunk's share of each chunked
    # collective (sequence parallel: all four; without: the forward all-reduce, while the backward's
    # input-gradient all-reduce, whole, can hide entirely under the weight-gradient GEMMs)
    floor, _ = tp_block_comm_s(Layout.PARTIAL, nbytes, 1e3, 1e3, on)
    chunked_share = 1.0 if sp else 0.5
    assert floor >= chunked_share * whole / chunks * 0.99 and floor < exposed


def test_the_search_chooses_overlap_where_it_pays_and_honours_pins() -> None:
    """Llama-3-8B training at TP 2 with sequence parallelism on 8 H100 PCIe (slow links: much to
    hide): the search turns TP overlap on and prices the step faster than with it pinned off. On a
    DGX H100 at TP 8 the chunked GEMMs and the compute the hidden traffic slows
    (`ClusterSpec.overlap_slowdown`) cost more than the NVLink traffic hidden: the search leaves it off."""
    import sys  # noqa: PLC0415

    examples = Path(__file__).resolve().parent.parent / "examples"
    sys.path.insert(0, str(examples))
    model_file = load_model_file(examples / "llama3_8b.py")
    args, kwargs = model_file.inputs(8, 4096)
    structure = analyse(capture(model_file.build("meta"), args, kwargs))
    work = WorkloadSpec("train", 8, 4096, dtype="bf16")

    def plan(cluster: str, tp: int, pin: bool | None):
        return plan_model(
            structure,
            load_cluster(cluster),
            work,
            Constraints(tp=tp, sequence_parallel=True, tp_comm_overlap=pin),
        )

    plans = {pin: plan("h100-pcie", 2, pin) for pin in (None, False, True)}
    assert plans[None].tp_comm_overlap and plans[True].tp_comm_overlap and not plans[False].tp_comm_overlap
    assert plans[None].predicted.latency_s < plans[False].predicted.latency_s
    # off, only the backward's gathers of the sequence shards again run under GEMMs
    assert plans[True].predicted.overlapped_comm_s > plans[False].predicted.overlapped_comm_s > 0
    nvlink = {pin: plan("dgx-h100", 8, pin) for pin in (None, True)}
    assert not nvlink[None].tp_comm_overlap
    assert nvlink[None].predicted.latency_s < nvlink[True].predicted.latency_s


@pytest.mark.parametrize("seq", [None, 0])
def test_a_frozen_weight_takes_no_weight_gradient_gemm(seq: int | None) -> None:
    """LoRA freezes the base weights: the fused column- and row-parallel functions compute no weight
    gradient for a weight that does not require one (one rank; sequence parallel or not), and the
    trained weight's gradient is the plain matmul's."""
    torch.manual_seed(0)
    x = torch.randn(8, 2, 6, requires_grad=True)
    frozen, trained, row = torch.randn(4, 6), torch.randn(5, 6, requires_grad=True), torch.randn(3, 5)
    plain = tp_overlap._weight_grad
    calls = []

    def counted(g: torch.Tensor, inp: torch.Tensor, linear: bool) -> torch.Tensor:
        calls.append(tuple(g.shape))
        return plain(g, inp, linear)

    with mock.patch.object(tp_overlap, "_weight_grad", counted):
        ya, yb = tp_overlap.tp_column_matmuls(x, [frozen, trained], [None, None], True, "tp-test", seq, 2)
        out = tp_overlap.tp_row_matmul(yb, row, True, "tp-test", seq, 2)
        (ya.sum() + out.square().sum()).backward()
    # the trained column weight's, once over the whole sequence (not per chunk, sequence parallel or
    # not); none for the frozen column weight or the frozen row weight
    assert calls == [(8, 2, 5)], calls
    reference = torch.autograd.grad(((x @ trained.t()) @ row.t()).square().sum(), trained)[0]
    torch.testing.assert_close(trained.grad, reference)


@pytest.mark.parametrize("name", ["colwise", "rowwise"])
def test_only_the_gemms_that_hide_transfers_are_priced_in_chunks(name: str) -> None:
    """Under TP overlap a split projection's forward and input-gradient GEMMs run as C GEMMs of 1/C of
    the rows; its weight gradient stays one GEMM over every row (`passes.tp_overlap`), so the chunking's
    extra compute is theirs alone at their shapes (H100 GEMM efficiency by shape), plus, for the
    row-parallel backward under sequence parallelism, the copy of the gathered output gradient. Cut
    into chunks too, the weight gradient (K = 512 rows) would cost more than that."""
    from costmodels import compute  # noqa: PLC0415
    from planner.frontend.roles import Projection  # noqa: PLC0415
    from planner.solver.costing import Op, projection_options, tp_overlap_chunk_compute_s  # noqa: PLC0415

    structure = _ctx("dgx-h100", True, True).structure
    config = MeshConfig(MeshShape(8, 1, 1), 1, sequence_parallel=True, tp_comm_overlap=True)
    ctx = CostContext(structure, load_cluster("dgx-h100"), WorkloadSpec("train", 1, 4096), config, "bf16")
    proj = Projection("up", "mlp.up.weight", None, None, 8192, 28672, 0, None, 0.0)
    option = next(o for o in projection_options(proj, ctx.tokens, ctx)[0] if o.name == name)
    op = Op("up", "mlp", [option], [""], ctx.tokens * 28672 * 2, weight=proj.weight, projection=proj)
    chunks, dev, rows = tp_overlap_chunks(ctx), ctx.cluster.device, ctx.tokens
    assert chunks == 8
    k, n = (8192, 28672 / 8) if name == "colwise" else (8192 / 8, 28672)

    def gemm_s(m: float, kk: float, nn: float) -> float:
        return compute.op_time_s(2 * m * kk * nn, 0.0, dev, "bf16", "matmul", rows=m, shape=(kk, nn))

    def cut_s(m: float) -> float:  # forward and input gradient
        return gemm_s(m, k, n) + gemm_s(m, n, k)

    expected = chunks * cut_s(rows / chunks) - cut_s(rows)
    if name == "rowwise":
        expected += compute.op_time_s(0.0, 2 * rows * 28672 * 2, dev, "bf16", "memory")
    extra = tp_overlap_chunk_compute_s(op, option, ctx)
    assert extra == pytest.approx(expected, rel=1e-6)
    weight_grad_cut = chunks * gemm_s(k, rows / chunks, n) - gemm_s(k, rows, n)
    assert weight_grad_cut > 0.1 * extra  # what the pass no longer pays

"""Context-parallel attention (`passes.context_parallel`) against SDPA on the whole sequence.

Two launches (2 gloo ranks, 4 gloo ranks) each run every case in turn on every rank: the three
variants (ring, allgather, alltoall), causal and not, with and without load balancing, MHA and GQA,
fp32 and bf16. Every rank builds the same seeded q, k, v and output gradient for the whole sequence,
computes `scaled_dot_product_attention` and its gradients as the reference, cuts them with
`cp_shard`, and compares its own output and q/k/v gradients. One case runs the ring with its
online-softmax merge deliberately wrong (the running output not rescaled): its comparison must fail.
The same launches check the errors (Ulysses with indivisible heads, an indivisible sequence) and
`cp_shard` / `cp_unshard` (positions, autograd). Pure tests count the causal work per rank.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from passes import collectives
from passes import context_parallel as cp
from passes.context_parallel import (
    _rectangles,
    cp_attention,
    cp_attention_alltoall,
    cp_attention_ring,
    cp_positions,
    cp_shard,
    cp_unshard,
)
from runtime.launch import RankContext, launch

B, D = 2, 8
FP32_TOL, BF16_TOL = 1e-5, 2e-2  # max |cp - reference| / max |reference|, per tensor


def _merge_unscaled(out, lse, block_out, block_lse):
    """A wrong online-softmax merge: the block is weighted right, but the running output is not
    rescaled by exp(l - l') when the block raises the log-sum-exp."""
    new_lse = torch.logaddexp(lse, block_lse)
    return out + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1), new_lse


def _cases(size: int) -> dict[str, dict]:
    """label -> case: every variant x causal x load balance x (MHA, GQA) in fp32, plus bf16 and a
    wrong merge. GQA heads are chosen so that Ulysses can split them over `size` ranks."""
    heads = {"mha": (4, 4), "gqa": (4, 2) if size == 2 else (8, 4)}
    seq = 16 if size == 2 else 32
    out: dict[str, dict] = {}
    for variant in cp.CP_VARIANTS:
        for causal in (True, False):
            for lb in (True, False):
                for kind, (h, hkv) in heads.items():
                    label = f"{variant}-{'causal' if causal else 'full'}-{'lb' if lb else 'contig'}-{kind}"
                    out[label] = dict(variant=variant, causal=causal, lb=lb, h=h, hkv=hkv, t=seq)
        h, hkv = heads["gqa"]
        out[f"{variant}-causal-lb-gqa-bf16"] = dict(
            variant=variant, causal=True, lb=True, h=h, hkv=hkv, t=seq, dtype=torch.bfloat16
        )
    out["ring-causal-lb-gqa-wrong-merge"] = dict(
        variant="ring", causal=True, lb=True, h=4, hkv=2, t=seq, wrong_merge=True
    )
    out["ring-full-contig-mha-wrong-merge"] = dict(
        variant="ring", causal=False, lb=False, h=4, hkv=4, t=seq, wrong_merge=True
    )
    out["ring-causal-lb-mha-scale"] = dict(variant="ring", causal=True, lb=True, h=4, hkv=4, t=seq, scale=0.5)
    # the PyTorch-op tiles the blocks run in where no fused kernel does (`FUSED_CPU_KERNEL` off)
    for variant in ("ring", "allgather"):
        for lb in (True, False):
            out[f"{variant}-causal-{'lb' if lb else 'contig'}-gqa-unfused"] = dict(
                variant=variant,
                causal=True,
                lb=lb,
                h=heads["gqa"][0],
                hkv=heads["gqa"][1],
                t=seq,
                unfused=True,
            )
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _run_case(case: dict) -> dict[str, float]:
    """Relative errors of this rank's output and q, k, v gradients against whole-sequence SDPA."""
    dtype = case.get("dtype", torch.float32)
    h, hkv, t, lb, causal = case["h"], case["hkv"], case["t"], case["lb"], case["causal"]
    scale = case.get("scale")
    gen = torch.Generator().manual_seed(1234 + h + 7 * hkv + t)
    q, k, v = (torch.randn(B, n, t, D, generator=gen).to(dtype) for n in (h, hkv, hkv))
    dout = torch.randn(B, h, t, D, generator=gen).to(dtype)
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*ref, is_causal=causal, scale=scale, enable_gqa=h != hkv)
    ref_out.backward(dout)
    local = [cp_shard(x, 2, "cp", lb).requires_grad_() for x in (q, k, v)]
    out = cp_attention(*local, "cp", variant=case["variant"], causal=causal, load_balance=lb, scale=scale)
    out.backward(cp_shard(dout, 2, "cp", lb))
    errors = {"out": _rel(out.detach(), cp_shard(ref_out.detach(), 2, "cp", lb))}
    for name, mine, theirs in zip(("dq", "dk", "dv"), local, ref):
        errors[name] = _rel(mine.grad, cp_shard(theirs.grad, 2, "cp", lb))
    assert out.dtype == dtype and all(x.grad.dtype == dtype for x in local)
    return errors


def _error_message(fn) -> str | None:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def _layout_checks(ctx: RankContext, size: int) -> dict:
    """cp_shard against cp_positions, cp_unshard's round trip, both backwards, and the errors."""
    out: dict = {}
    for lb in (True, False):
        seq = 4 * size
        out[f"positions_{lb}"] = torch.equal(
            cp_shard(torch.arange(seq), 0, "cp", lb), cp_positions(seq, ctx.rank, size, lb)
        )
        x = torch.randn(3, seq, generator=torch.Generator().manual_seed(5)).requires_grad_()
        w = torch.randn(3, seq, generator=torch.Generator().manual_seed(6))
        mine = cp_shard(x, -1, "cp", lb)
        (mine * cp_shard(w, 1, "cp", lb)).sum().backward()  # each rank's loss: its tokens' part
        out[f"shard_grad_{lb}"] = torch.equal(x.grad, w)  # all-gathered: the whole weight
        y = mine.detach().clone().requires_grad_()
        whole = cp_unshard(y, 1, "cp", lb)
        (whole * w).sum().backward()
        out[f"unshard_{lb}"] = torch.equal(whole, x.detach())
        out[f"unshard_grad_{lb}"] = torch.equal(y.grad, cp_shard(w, 1, "cp", lb))
    out["indivisible_lb"] = _error_message(lambda: cp_shard(torch.zeros(2, 6 * size + 2), 1, "cp", True))
    out["indivisible"] = _error_message(lambda: cp_shard(torch.zeros(2 * size + 1, 3), 0, "cp", False))
    q = torch.zeros(1, 6, 4, D)
    kv = torch.zeros(1, 3 if size == 2 else 2, 4, D)
    out["ulysses"] = _error_message(
        lambda: cp_attention_alltoall(q, kv, kv, "cp", causal=True, load_balance=False)
    )
    out["odd_lb"] = _error_message(
        lambda: cp_attention_ring(q[:, :, :3], q[:, :, :3], q[:, :, :3], "cp", causal=True, load_balance=True)
    )
    return out


def _ring_profile() -> list[str]:
    """The `cp.ring.*` record_function ranges of one causal ring forward and backward, in start order."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    gen = torch.Generator().manual_seed(3)
    q, k, v = (
        cp_shard(torch.randn(1, 2, 16, D, generator=gen), 2, "cp", True).requires_grad_() for _ in "qkv"
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        cp_attention_ring(q, k, v, "cp", causal=True, load_balance=True).sum().backward()
    events = [e for e in prof.events() if e.name.startswith("cp.ring.")]
    return [e.name for e in sorted(events, key=lambda e: e.time_range.start)]


def run_cases(ctx: RankContext, payload: dict[str, dict]) -> dict:
    """Rank entry: every case of `payload` in turn (its errors), then the layout checks and (2 ranks)
    a profile of the ring."""
    import torch.distributed as dist  # noqa: PLC0415

    collectives.register_group("cp", dist.group.WORLD)
    results: dict = {}
    for label, case in payload.items():
        if case.get("wrong_merge"):
            with mock.patch.object(cp, "_merge", _merge_unscaled):
                results[label] = _run_case(case)
        elif case.get("unfused"):
            with mock.patch.object(cp, "FUSED_CPU_KERNEL", False):
                results[label] = _run_case(case)
        else:
            results[label] = _run_case(case)
    results["layout"] = _layout_checks(ctx, ctx.world_size)
    results["profile"] = _ring_profile() if ctx.world_size == 2 else None
    return results


def _launch(size: int) -> tuple[dict[str, dict], list[dict]]:
    cases = _cases(size)
    return cases, launch(run_cases, cases, nproc=size, timeout_s=300)


@pytest.fixture(scope="module")
def two_rank() -> tuple[dict[str, dict], list[dict]]:
    return _launch(2)


@pytest.fixture(scope="module")
def four_rank() -> tuple[dict[str, dict], list[dict]]:
    return _launch(4)


def _check_launch(cases: dict[str, dict], reports: list[dict]) -> None:
    failures = []
    for label, case in cases.items():
        tol = BF16_TOL if case.get("dtype") == torch.bfloat16 else FP32_TOL
        worst = {name: max(r[label][name] for r in reports) for name in ("out", "dq", "dk", "dv")}
        if case.get("wrong_merge"):
            # the merge only matters for the output and dq; dk / dv too, as the log-sum-exp is wrong
            if worst["out"] <= 1e-2:
                failures.append((label, "a wrong merge passed", worst))
        elif max(worst.values()) > tol:
            failures.append((label, worst))
    assert not failures, failures


def _check_layout(reports: list[dict], size: int) -> None:
    for rank, report in enumerate(reports):
        layout = report["layout"]
        assert all(v for key, v in layout.items() if isinstance(v, bool)), (rank, layout)
        msg = layout["indivisible_lb"]
        assert msg is not None and str(6 * size + 2) in msg and str(2 * size) in msg, msg
        msg = layout["indivisible"]
        assert msg is not None and str(2 * size + 1) in msg and f"{size} chunks" in msg, msg
        msg = layout["ulysses"]
        kv = 3 if size == 2 else 2
        assert msg is not None and "6 query heads" in msg and f"{kv} KV heads" in msg, msg
        assert f"{size} CP ranks" in msg and "cp_attention_ring" in msg, msg
        assert layout["odd_lb"] is not None and "3 tokens" in layout["odd_lb"], layout["odd_lb"]


def _check_overlap(reports: list[dict], size: int) -> None:
    """Each ring step's transfer is issued before the step's block attention and waited for after it
    (forward and backward); the backward's dK/dV accumulator is issued once per step and comes home."""
    for rank, report in enumerate(reports):
        names = report["profile"]
        for phase in ("forward", "backward"):
            for i in range(size - 1):
                order = [names.index(f"cp.ring.{phase}.{what}.{i}") for what in ("issue", "compute", "wait")]
                assert order == sorted(order), (rank, phase, i, names)
        assert sum(n.startswith("cp.ring.backward.issue_grad.") for n in names) == size, names
        assert names[-1] == "cp.ring.backward.wait_grad.home", names


@pytest.mark.slow
def test_cp_attention_matches_sdpa_on_two_ranks(two_rank) -> None:
    _check_launch(*two_rank)
    _check_layout(two_rank[1], 2)
    _check_overlap(two_rank[1], 2)


@pytest.mark.slow
def test_cp_attention_matches_sdpa_on_four_ranks(four_rank) -> None:
    _check_launch(*four_rank)
    _check_layout(four_rank[1], 4)


# ---------------------------------------------------------------------------------------------
# Pure tests (no ranks)


def _covered(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool) -> torch.Tensor:
    """How many times `_rectangles` covers each (query, key) pair of a block (int (Tq, Tk))."""
    count = torch.zeros(qpos.numel(), kpos.numel(), dtype=torch.int64)
    for rows, keys, diagonal in _rectangles(qpos, kpos, causal):
        n, m = rows.stop - rows.start, keys.stop - keys.start
        if diagonal:
            assert n == m and torch.equal(qpos[rows], kpos[keys]), (rows, keys)
        count[rows, keys] += torch.ones(n, m, dtype=torch.int64).tril() if diagonal else 1
    return count


@pytest.mark.parametrize("size", [2, 4, 8])
def test_load_balancing_equalises_causal_work(size: int) -> None:
    """With head-tail chunks every rank has the same number of visible (query, key) pairs, T(T+1)/2C,
    and the ring's rectangles compute exactly those, once each; with contiguous chunks the last rank
    does far more."""
    seq = 2 * size * 3

    def work(lb: bool) -> tuple[list[int], list[int]]:
        visible, computed = [], []
        for rank in range(size):
            qpos = cp_positions(seq, rank, size, lb)
            visible.append(int((torch.arange(seq)[None, :] <= qpos[:, None]).sum()))
            area = 0
            for src in range(size):
                kpos = cp_positions(seq, src, size, lb)
                covered = _covered(qpos, kpos, causal=True)
                assert torch.equal(covered, (kpos[None, :] <= qpos[:, None]).long()), (rank, src)
                area += int(covered.sum())
            computed.append(area)
        return visible, computed

    visible, computed = work(True)
    assert visible == [seq * (seq + 1) // (2 * size)] * size
    assert computed == visible
    visible, computed = work(False)
    assert visible[-1] > visible[0] and computed == visible


@pytest.mark.parametrize("lb", [True, False])
def test_positions_cover_the_sequence_once(lb: bool) -> None:
    seq, size = 24, 3
    every = torch.cat([cp_positions(seq, r, size, lb) for r in range(size)])
    assert torch.equal(every.sort().values, torch.arange(seq))
    for r in range(size):
        p = cp_positions(seq, r, size, lb)
        assert torch.equal(p, p.sort().values)
    assert cp_positions(8, 1, 2, True).tolist() == [2, 3, 4, 5]
    assert cp_positions(8, 0, 2, True).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 1, 2, False).tolist() == [4, 5, 6, 7]


def test_positions_refuse_an_indivisible_sequence() -> None:
    with pytest.raises(ValueError, match=r"18 tokens.*4 chunks"):
        cp_positions(18, 0, 2, True)
    with pytest.raises(ValueError, match=r"10 tokens.*4 chunks"):
        cp_positions(10, 0, 4, False)


def test_rectangles_are_whole_or_the_diagonal() -> None:
    """A block's visible pairs as rectangles a kernel call each: wholly visible ones and causal squares
    on the diagonal, over any runs of positions (the all-gather's key shares cut a rank's chunks)."""
    q = torch.tensor([2, 3, 4, 5])
    assert _rectangles(q, torch.tensor([6, 7]), causal=True) == []  # wholly in the future
    assert _rectangles(q, torch.tensor([0, 1]), causal=True) == [(slice(0, 4), slice(0, 2), False)]
    # only the late chunk sees it
    assert _rectangles(torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5]), causal=True) == [
        (slice(2, 4), slice(0, 4), False)
    ]
    assert _rectangles(q, q, causal=True) == [(slice(0, 4), slice(0, 4), True)]
    assert _rectangles(q, q, causal=False) == [(slice(0, 4), slice(0, 4), False)]
    # keys 3..6 for queries 2..5: the square 3..5, the rows after none, query 2 sees none of them
    assert _rectangles(q, torch.arange(3, 7), causal=True) == [(slice(1, 4), slice(0, 3), True)]
    # keys 1..3: key 1 seen by all, the square 2..3, then rows 4, 5 over keys 2..3
    assert _rectangles(q, torch.arange(1, 4), causal=True) == [
        (slice(0, 4), slice(0, 1), False), (slice(0, 2), slice(1, 3), True), (slice(2, 4), slice(1, 3), False)
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):  # any ascending positions: every visible pair once, no hidden one
        qpos = torch.randperm(24, generator=gen)[:9].sort().values
        kpos = torch.randperm(24, generator=gen)[:11].sort().values
        want = (kpos[None, :] <= qpos[:, None]).long()
        assert torch.equal(_covered(qpos, kpos, causal=True), want), (qpos, kpos)


@pytest.mark.parametrize("fused", [True, False])
def test_attend_is_masked_attention_over_positions(monkeypatch, fused: bool) -> None:
    """`_attend` and `_attend_backward` over queries and keys at any positions (here two key blocks
    merged, GQA-expanded heads, a scale) give masked SDPA's output and gradients, in the fused CPU
    kernel and in the PyTorch-op tiles (with tiles of 8, so blocks span several)."""
    monkeypatch.setattr(cp, "FUSED_CPU_KERNEL", fused)
    monkeypatch.setattr(cp, "SCORE_TILE", 8)
    gen = torch.Generator().manual_seed(1)
    qpos, kpos = torch.tensor([*range(4, 12), *range(28, 36)]), torch.arange(40)
    q, dout = torch.randn(2, 4, 16, D, generator=gen), torch.randn(2, 4, 16, D, generator=gen)
    k, v = torch.randn(2, 4, 40, D, generator=gen), torch.randn(2, 4, 40, D, generator=gen)
    out, lse = torch.zeros(2, 4, 16, D), torch.full((2, 4, 16), float("-inf"))
    blocks = [(0, 20), (20, 40)]
    for s, e in blocks:
        cp._attend(q, k[:, :, s:e], v[:, :, s:e], qpos, kpos[s:e], True, 0.3, out, lse)
    mask = kpos[None, :] <= qpos[:, None]
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, attn_mask=mask, scale=0.3)
    want.backward(dout)
    assert torch.allclose(out, want.detach(), atol=1e-5)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for s, e in blocks:
        dk[:, :, s:e], dv[:, :, s:e] = cp._attend_backward(
            q, k[:, :, s:e], v[:, :, s:e], dout, out, lse, qpos, kpos[s:e], True, 0.3, dq
        )
    for got, ref_x in zip((dq, dk, dv), ref):
        assert torch.allclose(got, ref_x.grad, atol=1e-4)


def test_a_cpu_block_holds_no_score_block() -> None:
    """On a CPU a block runs in torch's fused flash kernel for CPU (`FUSED_CPU_KERNEL`), which works on
    small per-thread tiles: the heap grows by well under one (B, H, Tq, Tk) fp32 score block, forward
    and backward, where the PyTorch-op tiles hold one and two (`score_block_bytes` prices it so)."""
    from runtime.measure import heap_in_use_bytes, heap_peak_bytes  # noqa: PLC0415

    if heap_in_use_bytes() is None:
        pytest.skip("needs glibc's mallinfo2")
    torch.manual_seed(0)
    b, h, t, d = 1, 8, 512, 16
    q, k, v, dout = (torch.randn(b, h, t, d) for _ in range(4))
    pos = torch.arange(t)
    block = b * h * t * t * 4
    out, lse, dq = torch.zeros(b, h, t, d), torch.full((b, h, t), float("-inf")), torch.zeros_like(q)

    def forward() -> None:
        cp._attend(q, k, v, pos, pos, True, 0.25, out, lse)

    def backward() -> None:
        cp._attend_backward(q, k, v, dout, out, lse, pos, pos, True, 0.25, dq)

    # the dispatch mode's and the kernel's first uses allocate their own (kept for the next calls)
    heap_peak_bytes(forward, torch.device("cpu"))
    heap_peak_bytes(backward, torch.device("cpu"))
    out.zero_(), lse.fill_(float("-inf")), dq.zero_()
    for step in (forward, backward):  # measured 0.14 and 0.16 blocks; the PyTorch-op tiles 1.07 and 2.13
        start = heap_in_use_bytes()
        assert heap_peak_bytes(step, torch.device("cpu")) - start < 0.5 * block, step.__name__
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    assert torch.allclose(out, want, atol=1e-5)


@pytest.mark.parametrize("variant", cp.CP_VARIANTS)
def test_one_rank_is_plain_sdpa(variant: str) -> None:
    collectives.register_group("cp_single", None)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 8, D, generator=gen) for n in (4, 2, 2))
    out = cp_attention(q, k, v, "cp_single", variant=variant, causal=True, load_balance=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(out, ref)
    assert cp_shard(q, 2, "cp_single", True) is q and cp_unshard(q, 2, "cp_single", True) is q


def test_unknown_variant_is_named() -> None:
    q = torch.zeros(1, 2, 4, D)
    with pytest.raises(ValueError, match="'ulysses'.*ring, allgather, alltoall"):
        cp_attention(q, q, q, "cp_single", variant="ulysses", causal=True, load_balance=False)


def test_a_blocks_attention_holds_one_score_block_forward_and_two_backward() -> None:
    """`_block_forward` turns the scores into the probabilities in place and `_block_backward` holds
    only the probabilities and their gradient: the heap grows by about one (B, H, Tq, Tk) fp32 block in a
    forward and two in a backward (it held four: the scores, the masked scores, their difference from
    the log-sum-exp and its exponential), and the results are softmax attention's."""
    from runtime.measure import heap_in_use_bytes, heap_peak_bytes  # noqa: PLC0415

    if heap_in_use_bytes() is None:
        pytest.skip("needs glibc's mallinfo2")
    torch.manual_seed(0)
    b, h, t, d = 1, 8, 512, 16
    q, k, v, dout = (torch.randn(b, h, t, d) for _ in range(4))
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    block = b * h * t * t * 4
    results = {}

    def forward() -> None:
        results["fwd"] = cp._block_forward(q, k, v, True, 0.25)

    heap_peak_bytes(forward, torch.device("cpu"))  # the dispatch mode's first use allocates its own
    start = heap_in_use_bytes()
    peak = heap_peak_bytes(forward, torch.device("cpu"))
    assert peak - start < 1.5 * block
    out, lse = results["fwd"]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    assert torch.allclose(out, want, atol=1e-5)
    delta = (dout * out).sum(-1)

    def backward() -> None:
        results["bwd"] = cp._block_backward(q, k, v, dout, lse, delta, True, 0.25)

    start = heap_in_use_bytes()
    peak = heap_peak_bytes(backward, torch.device("cpu"))
    assert peak - start < 2.5 * block
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=0.25).backward(dout)
    for got, ref in zip(results["bwd"], (qg.grad, kg.grad, vg.grad)):
        assert torch.allclose(got, ref, atol=1e-4)


@pytest.mark.parametrize("diagonal", [False, True])
def test_a_long_block_is_computed_tile_by_tile_with_the_same_results(monkeypatch, diagonal: bool) -> None:
    """A rectangle longer than `SCORE_TILE` queries or keys is computed tile by tile in the PyTorch-op
    path, merged online, the tiles wholly in the future skipped: the same output, log-sum-exp and
    gradients as one tile (a (Tq, Tk) block of fp32 scores at 64k tokens would not fit), here with
    tiles of 64 over 300 x 300 (200 x 300 whole)."""
    torch.manual_seed(0)
    tq = 300 if diagonal else 200
    q, dout = torch.randn(1, 2, tq, 8), torch.randn(1, 2, tq, 8)
    k, v = torch.randn(1, 2, 300, 8), torch.randn(1, 2, 300, 8)
    whole_out, whole_lse = cp._block_forward(q, k, v, diagonal, 0.3)
    delta = (dout * whole_out).sum(-1)
    whole_grads = cp._block_backward(q, k, v, dout, whole_lse, delta, diagonal, 0.3)
    monkeypatch.setattr(cp, "SCORE_TILE", 64)
    out, lse = cp._block_forward(q, k, v, diagonal, 0.3)
    assert torch.allclose(out, whole_out, atol=1e-5) and torch.allclose(lse, whole_lse, atol=1e-5)
    for got, want in zip(cp._block_backward(q, k, v, dout, lse, delta, diagonal, 0.3), whole_grads):
        assert torch.allclose(got, want, atol=1e-5)

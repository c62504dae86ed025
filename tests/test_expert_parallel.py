"""Expert-parallel MoE (`passes.expert_parallel.ep_moe`) against every expert run on one rank.

One launch of 2 gloo ranks and one of 4: every rank builds the same seeded experts (8 SwiGLU experts)
and every rank's tokens, routes them top-2, and computes the unsharded layer on all ranks' tokens as
the reference, with the gradients of a seeded loss summed over the ranks. Then it runs `ep_moe` on its
own tokens with its own experts and compares its output, its tokens' and router weights' gradients
and its experts' weight gradients. A run with the combine's weights dropped must fail.
"""

from __future__ import annotations

import pytest
import torch

from passes import collectives
from passes import expert_parallel as ep
from runtime.launch import RankContext, launch

E, K, C, WIDTH, N = 8, 2, 16, 32, 12  # experts, top-k, hidden, expert width, tokens per rank


def _weights(gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(E, WIDTH, C, generator=gen) / C**0.5, torch.randn(E, WIDTH, C, generator=gen) / C**0.5,
            torch.randn(E, C, WIDTH, generator=gen) / WIDTH**0.5]  # fmt: skip


def _route(x: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.softmax(x @ router.T, dim=-1)
    weights, ids = scores.topk(K, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _rank(ctx: RankContext, wrong: bool) -> dict:
    import torch.distributed as dist  # noqa: PLC0415

    size, rank = ctx.world_size, ctx.rank
    gen = torch.Generator().manual_seed(7)
    weights = _weights(gen)
    router = torch.randn(E, C, generator=gen)
    xs = [torch.randn(N, C, generator=gen) for _ in range(size)]
    grads_out = [torch.randn(N, C, generator=gen) for _ in range(size)]
    # reference: every rank's tokens through every expert in one place
    collectives.register_group("ep", None)
    ref_w = [w.clone().requires_grad_() for w in weights]
    ref_x = torch.cat(xs).requires_grad_()
    ids, topw = _route(ref_x.detach(), router)
    ref_topw = topw.clone().requires_grad_()
    ref_out, _ = ep.ep_moe(ref_x, ids, ref_topw, *ref_w, E, "ep")
    (ref_out * torch.cat(grads_out)).sum().backward()
    # this rank's share of the expert-parallel layer
    collectives.register_group("ep", dist.group.WORLD)
    mine = ep.local_experts(E, size, rank)
    local_w = [w[mine.start : mine.stop].clone().requires_grad_() for w in weights]
    x = xs[rank].clone().requires_grad_()
    my_ids, my_topw = _route(x.detach(), router)
    my_topw = my_topw.clone().requires_grad_()
    # wrong: the combine sums the k outputs without the router's weights
    combine = torch.ones_like(my_topw) if wrong else my_topw
    out, counts = ep.ep_moe(x, my_ids, combine, *local_w, E, "ep")
    (out * grads_out[rank]).sum().backward()
    rows = slice(rank * N, (rank + 1) * N)
    errors = {"out": _rel(out.detach(), ref_out.detach()[rows])}
    if not wrong:
        errors["x.grad"] = _rel(x.grad, ref_x.grad[rows])
        errors["topk_weights.grad"] = _rel(my_topw.grad, ref_topw.grad[rows])
        for name, w, ref in zip(("w_gate", "w_up", "w_down"), local_w, ref_w):
            errors[f"{name}.grad"] = _rel(w.grad, ref.grad[mine.start : mine.stop])
    # rows each local expert computed: what every rank sent it
    total = torch.bincount(torch.cat([_route(xx, router)[0] for xx in xs]).reshape(-1), minlength=E)
    return {
        "errors": errors,
        "counts": counts.tolist(),
        "want_counts": total[mine.start : mine.stop].tolist(),
    }


def _entry(ctx: RankContext, wrong: bool) -> dict:
    return _rank(ctx, wrong)


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 4])
def test_ep_matches_every_expert_on_one_rank(size: int) -> None:
    for report in launch(_entry, False, nproc=size, timeout_s=300):
        assert max(report["errors"].values()) < 1e-5, report["errors"]
        assert report["counts"] == report["want_counts"] and sum(report["counts"]) > 0


@pytest.mark.slow
def test_a_combine_without_router_weights_fails_the_comparison() -> None:
    reports = launch(_entry, True, nproc=2, timeout_s=300)
    assert max(r["errors"]["out"] for r in reports) > 1e-2


def test_experts_split_evenly_or_refused() -> None:
    assert ep.local_experts(8, 4, 3) == range(6, 8)
    with pytest.raises(ValueError, match="over 3 ranks cannot split 8 experts"):
        ep.local_experts(8, 3, 0)


def test_the_combine_keeps_no_rows_for_backward() -> None:
    """Each token's k weighted expert rows are summed by a scatter-add by token, whose backward gathers
    the output's gradient by token: autograd keeps only the (int64) token index, not the (rows, C)
    weighted rows an index_add would keep (k rows per token of the layer's width)."""
    rows, width, n = 64, 32, 16
    weighted = torch.randn(rows, width, requires_grad=True)
    token = torch.arange(n).repeat_interleave(rows // n)
    kept: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ep._combine(weighted * 1, token, n)
    assert sum(kept) <= token.numel() * token.element_size()
    want = torch.zeros(n, width).index_add(0, token, weighted.detach())
    assert torch.equal(out, want)
    out.backward(torch.ones_like(out))
    assert torch.equal(weighted.grad, torch.ones(rows, width))


def _pair_rank(ctx: RankContext, _: None) -> dict:
    """Gradients of `tp_copy_pair` on this rank and the all-reduces its backward ran."""
    from unittest import mock  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    collectives.register_group("tp", dist.group.WORLD)
    gen = torch.Generator().manual_seed(3)
    g_a = [torch.randn(5, 16, generator=gen) for _ in range(ctx.world_size)]
    g_b = [torch.randn(5, 2, generator=gen, dtype=torch.float64) for _ in range(ctx.world_size)]
    a = torch.randn(5, 16, generator=gen, requires_grad=True)
    b = torch.randn(5, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    calls = []
    real = collectives._all_reduce

    def counted(x, axis):
        calls.append(tuple(x.shape))
        return real(x, axis)

    with mock.patch.object(collectives, "_all_reduce", counted):
        a2, b2 = collectives.tp_copy_pair(a, b, "tp")
        ((a2 * g_a[ctx.rank]).sum() + (b2 * g_b[ctx.rank]).sum()).backward()
        only = torch.randn(5, 16, generator=gen, requires_grad=True)
        a3, _ = collectives.tp_copy_pair(only, b.detach(), "tp")  # no gradient reaches b
        (a3 * g_a[ctx.rank]).sum().backward()
    return {
        "a": float((a.grad - sum(g_a)).abs().max()),
        "b": float((b.grad - sum(g_b)).abs().max()),
        "b_dtype": str(b.grad.dtype),
        "only": float((only.grad - sum(g_a)).abs().max()),
        "calls": calls,
    }


@pytest.mark.slow
def test_tp_copy_pair_sums_both_gradients_in_one_all_reduce() -> None:
    """The tokens and routing weights entering experts split over TP (`ep_moe` with tp_axis,
    `ep_moe_replicated`) get their gradients summed over the ranks in one all-reduce of both (the
    planner prices one), each gradient the sum of the ranks' and in its own dtype; with one gradient,
    one all-reduce of it."""
    for report in launch(_pair_rank, None, nproc=2, timeout_s=300):
        assert report["a"] < 1e-5 and report["b"] < 1e-5 and report["only"] < 1e-5, report
        assert report["b_dtype"] == "torch.float64"
        assert report["calls"] == [(5, 18), (5, 16)], report["calls"]

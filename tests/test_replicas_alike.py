"""Data-parallel ranks must register their parameters alike: the optimizers flatten gradients into
buckets in registration order, so a rank with another order would sum other parameters' gradients
into each slot. `runtime.data_parallel.check_same_parameters` turns that into an error at set-up (a
graph rebuilt from the capture cache once registered its parameters by depth, not in graph order:
the gradients came out 0.02 off, caught only by the numerics check)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from planner.errors import RunError
from runtime.data_parallel import check_same_parameters
from runtime.launch import RankContext, launch


def _named(order: str) -> list[tuple[str, torch.Tensor]]:
    tensors = {
        "embed.weight": torch.zeros(8, 4),
        "head.weight": torch.zeros(8, 4),
        "norm.weight": torch.zeros(4),
    }
    names = list(tensors) if order == "graph" else sorted(tensors, key=lambda n: (n != "head.weight", n))
    return [(n, torch.nn.Parameter(tensors[n])) for n in names]


def _check(ctx: RankContext, orders: list[str]) -> str:
    """Rank entry: check this rank's parameters, registered in `orders[rank]`, over the world."""
    try:
        check_same_parameters(_named(orders[ctx.rank]), dist.group.WORLD)
    except RunError as exc:
        return str(exc)
    return "alike"


@pytest.mark.slow
def test_ranks_that_register_parameters_alike_pass_and_others_are_named() -> None:
    same, other = (
        launch(_check, orders, nproc=2, timeout_s=60) for orders in (["graph", "graph"], ["graph", "depth"])
    )
    assert same == ["alike", "alike"]
    # every rank raises (none is left waiting in a later collective), naming the first difference
    assert other[0] == other[1]
    assert "parameter #0 is embed.weight [8, 4] float32 on rank 0" in other[0]
    assert "head.weight [8, 4] float32 on rank 1" in other[0]


def test_one_rank_or_no_group_checks_nothing() -> None:
    check_same_parameters(_named("graph"), None)

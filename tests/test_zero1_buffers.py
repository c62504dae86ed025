"""ZeRO-1 (`runtime.data_parallel.DistributedAdam`) holds its state as Megatron-LM's distributed
optimizer does, and as `costmodels.memory.dp_state_bytes` prices it: per dtype one flat parameter
buffer and one flat gradient buffer, every parameter and `.grad` a view of them, Adam stepping this
rank's slices of the parameter buffer in place (no copy of the slices, no separate mean gradient).

One launch of 2 gloo ranks (dp=2, fp32): the distributed optimizer beside plain data parallelism's
Adam on a twin of the same model, without overlap and with both overlaps (a bucket per layer,
2 micro-batches), then the held state against the memory model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from costmodels.memory import DataParallel, dp_state_bytes
from passes import dp_overlap
from runtime.data_parallel import DistributedAdam, ReplicatedAdam, state_bytes
from runtime.launch import RankContext, launch

DP = 2
UNITS = [f"layers.{i}" for i in range(3)]
VARIANTS = {  # label: (DistributedAdam keyword arguments, micro-batches)
    "plain": ({}, 1),
    "overlap": (dict(overlap_grad_reduce=True, overlap_param_gather=True), 2),
}


class _Net(torch.nn.Module):
    """A few linear layers of odd sizes (715 parameters: each bucket padded to a multiple of dp)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(7, 13)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(13, 13) for _ in UNITS])
        self.head = torch.nn.Linear(13, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.embed(x))
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _backward(net: torch.nn.Module, batch: torch.Tensor) -> None:
    """Gradients of the mean square output accumulated over the micro-batches of `batch` (m, B, 7)."""
    for x in batch:
        (net(x).square().mean() / len(batch)).backward()


def _max_abs(t: torch.Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _zero1_buffers(ctx: RankContext, labels: list[str]) -> dict[str, dict]:
    """Rank entry: `_variant` for each label."""
    return {label: _variant(ctx, label) for label in labels}


def _variant(ctx: RankContext, label: str) -> dict:
    """Three steps of `DistributedAdam` and of `ReplicatedAdam` on twins of `_Net`, each
    replica its own data; what the tests check, as plain data."""
    group = dist.group.WORLD
    kwargs, m = VARIANTS[label]
    torch.manual_seed(0)
    model = _Net()
    twin, local = copy.deepcopy(model), copy.deepcopy(model)
    extra = (
        dict(named=list(twin.named_parameters()), units=UNITS, micro_batches=m, **kwargs) if kwargs else {}
    )
    plain = ReplicatedAdam(list(model.parameters()), group, DP)
    zero = DistributedAdam(list(twin.parameters()), group, DP, ctx.rank, **extra)
    data = torch.randn(3, m, 4, 7, generator=torch.Generator().manual_seed(ctx.rank))
    out: dict = {"grad_diff": 0.0, "own_diff": 0.0}
    for step, batch in enumerate(data):
        dp_overlap.wait_all_gathers()  # (no forward of `_Net` waits for its buckets' gathers itself)
        plain.zero_grad()
        zero.zero_grad()
        _backward(model, batch)
        _backward(twin, batch)
        plain.reduce_gradients()
        zero.reduce_gradients()
        if step == 0:  # this replica's own gradient, unreduced, from the same (equal) weights
            _backward(local, batch)
            owned = zero.owned_ranges()
            for p, q, own in zip(model.parameters(), twin.parameters(), local.parameters()):
                lo, hi = owned.get(id(q), (0, 0))
                mean, mine = q.grad.reshape(-1), own.grad.reshape(-1)
                inside = mean[lo:hi] - p.grad.reshape(-1)[lo:hi]
                outside = torch.cat([mean[:lo] - mine[:lo], mean[hi:] - mine[hi:]])
                out["grad_diff"] = max(out["grad_diff"], _max_abs(inside))
                out["own_diff"] = max(out["own_diff"], _max_abs(outside))
            out["owned"] = sorted(owned.values())
        plain.step()
        zero.step()
    zero.wait_gathers()
    params = list(twin.parameters())
    out.update(
        param_diff=max((a - b).abs().max().item() for a, b in zip(model.parameters(), params)),
        moved=min((a - b).abs().max().item() for a, b in zip(params, local.parameters())),
        param_storages=len({_storage(p) for p in params}),
        grad_storages=len({_storage(p.grad) for p in params}),
        grads_in_own_buffer=len({_storage(p) for p in params} & {_storage(p.grad) for p in params}) == 0,
        bucket_grads_are_views=all(
            _storage(zero._bucket_grad(b.index)) == _storage(params[0].grad) for b in zero.buckets
        ),
        adam_steps_views=all(
            _storage(t) == _storage(params[0]) for g in zero.adam.param_groups for t in g["params"]
        ),
        numel=sum(p.numel() for p in params),
        padded=sum(b.padded_numel for b in zero.buckets),
        step_counters=sum(st["step"].untyped_storage().nbytes() for st in zero.adam.state.values()),
        state_bytes=state_bytes(zero.held_tensors()),
        state_numel=zero.state_numel(),
        buckets=len(zero.buckets),
        counts=dict(zero.counts),
        note=zero.note(),
    )
    return out


@pytest.fixture(scope="module")
def ranks() -> dict[str, list[dict]]:
    results = launch(_zero1_buffers, list(VARIANTS), nproc=DP, timeout_s=120)
    return {label: [r[label] for r in results] for label in VARIANTS}


@pytest.mark.slow
def test_zero1_state_is_what_the_memory_model_prices(ranks: dict[str, list[dict]]) -> None:
    """fp32 at dp 2: the parameters (4 B), their gradients (4 B) and Adam's moments of this rank's
    slices (8 B / dp), to the buckets' padding and Adam's step counters: `dp_state_bytes`, not the
    1.33x of a separate store of the slices and of their mean gradient."""
    for label, results in ranks.items():
        for r in results:
            predicted = dp_state_bytes(r["numel"], "fp32", DataParallel.ZERO1, DP)
            held = 4 * r["padded"] + 4 * r["padded"] + 8 * r["padded"] // DP + r["step_counters"]
            assert r["state_bytes"] == held, (label, r["state_bytes"], held)
            assert r["padded"] - r["numel"] < DP * r["buckets"], (label, r)
            assert predicted <= r["state_bytes"] <= predicted * 1.01, (label, r["state_bytes"], predicted)
            assert r["state_numel"] == 2 * r["padded"] // DP, (label, r)
            assert "besides the parameters" not in r["note"] and "exceeds" not in r["note"], r["note"]


@pytest.mark.slow
def test_parameters_and_gradients_are_views_of_one_buffer_each(ranks: dict[str, list[dict]]) -> None:
    for label, results in ranks.items():
        for r in results:
            assert r["param_storages"] == 1 and r["grad_storages"] == 1 and r["grads_in_own_buffer"], (
                label,
                r,
            )
            assert r["bucket_grads_are_views"] and r["adam_steps_views"], (label, r)
    assert [r["buckets"] for r in ranks["overlap"]] == [len(UNITS) + 1] * DP  # a layer each, the rest


@pytest.mark.slow
def test_zero1_in_buffers_equals_data_parallel_adam(ranks: dict[str, list[dict]]) -> None:
    """The owned elements of `.grad` hold the replicas' mean (plain DP's all-reduced gradient), the
    others this replica's own gradient; after three steps the weights are plain DP's, every one moved;
    one reduce-scatter and one all-gather per step (per bucket with both overlaps)."""
    for label, results in ranks.items():
        per_step = 1 if label == "plain" else len(UNITS) + 1
        for r in results:
            assert r["grad_diff"] <= 1e-7 and r["own_diff"] == 0.0, (label, r)
            assert r["param_diff"] <= 1e-6 and r["moved"] > 1e-4, (label, r)
            assert r["counts"] == {"reduce_scatter": 3 * per_step, "all_gather": 3 * per_step}, (label, r)
        # the two ranks own complementary halves
        assert sum(hi - lo for r in results for lo, hi in r["owned"]) == results[0]["numel"], label

"""fp32 main gradients (`Plan.grad_reduce_dtype` fp32, `runtime.data_parallel._MainGrads`): the bf16
parameters' gradients are accumulated over the micro-batches and reduced over the replicas in fp32, as
Megatron-LM does with --bf16, by `ReplicatedAdam` (plain DP) and `DistributedAdam` (ZeRO-1), with and
without overlap_grad_reduce; `Zero2Adam` reduce-scatters each micro-batch's gradients in fp32 into fp32
slices (torchtitan's FSDP reduces in float32 alike; `FsdpAdam` runs in tests/test_cli.py).

One launch of 2 gloo ranks (dp=2). Each layer's bf16 weight gets the gradient x of its input: on rank r
micro-batch 0 gives 1 + 2r and micro-batch 1 gives 2^-9, whose sum rounds back to 1 + 2r in bf16 (its
spacing at 1 is 2^-7) but not in fp32. So the replicas' mean is 2 + 2^-9 with fp32 main gradients and
2 with bf16 gradients (checked too: the test tells them apart).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from costmodels.memory import DataParallel, dp_state_bytes
from passes import dp_overlap
from runtime.data_parallel import DistributedAdam, ReplicatedAdam, Zero2Adam, state_bytes
from runtime.launch import RankContext, launch

DP = 2
UNITS = ["layers.0", "layers.1"]
SMALL = 2.0**-9  # below half of bf16's spacing at 1 (2^-7)
VARIANTS = {  # label: (optimizer class, keyword arguments)
    "ddp": (ReplicatedAdam, {}),
    "ddp overlap": (ReplicatedAdam, {"overlap_grad_reduce": True}),
    "zero1": (DistributedAdam, {}),
    "zero1 overlap": (DistributedAdam, {"overlap_grad_reduce": True, "overlap_param_gather": True}),
    "zero2": (Zero2Adam, {"overlap_grad_reduce": False}),
    "zero2 overlap": (Zero2Adam, {"overlap_grad_reduce": True, "overlap_param_gather": True}),
}


class _Scale(torch.nn.Module):
    """out = sum(w * x): the gradient of w is x."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(width, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Scale(6), _Scale(5)])  # 11 elements: padded for dp 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x[:6]) + self.layers[1](x[6:])


def _variant(ctx: RankContext, label: str, main: bool) -> dict:
    cls, kwargs = VARIANTS[label]
    net = _Net()
    params = list(net.parameters())
    if cls is Zero2Adam:  # sharded gradients: each micro-batch's reduce-scatter accumulates into the slice
        opt = cls(net, UNITS, dist.group.WORLD, DP, ctx.rank, main_grads=main, **kwargs)
    else:
        extra = (
            dict(named=list(net.named_parameters()), units=UNITS, micro_batches=2, **kwargs) if kwargs else {}
        )
        args = (ctx.rank,) if cls is DistributedAdam else ()
        opt = cls(params, dist.group.WORLD, DP, *args, main_grads=main, **extra)
    out: dict = {}
    for step in range(2):
        dp_overlap.wait_all_gathers()
        opt.zero_grad()
        for x in (torch.full((11,), 1.0 + 2 * ctx.rank), torch.full((11,), SMALL)):
            net(x.to(torch.bfloat16)).backward()
        opt.reduce_gradients()
        if step == 0 and cls is Zero2Adam:
            segments = [g for pieces in opt.gradient_segments().values() for _, _, g in pieces]
            out["grads"] = [x for g in segments for x in g.float().tolist()]
            out["grad_dtypes"] = sorted({str(g.dtype) for g in segments})
            out["dot_grad_dropped"] = all(p.grad is None for p in params)
        elif step == 0:
            owned = opt.owned_ranges()  # ZeRO-1: the elements holding the mean (None: all)
            grads = []
            for p in params:
                if owned is not None and id(p) not in owned:
                    continue
                lo, hi = (0, p.numel()) if owned is None else owned[id(p)]
                grads += opt.grad_of(p).reshape(-1)[lo:hi].float().tolist()
            out["grads"] = grads
            out["grad_dtypes"] = sorted({str(opt.grad_of(p).dtype) for p in params})
            out["dot_grad_dropped"] = all(p.grad is None for p in params)
        opt.step()
    opt_state = state_bytes(opt.held_tensors())
    out.update(state_bytes=opt_state, note=opt.note(), counts=dict(opt.counts))
    if hasattr(opt, "wait_gathers"):
        opt.wait_gathers()
    return out


def _main_grads(ctx: RankContext, labels: list[str]) -> dict:
    return {(label, main): _variant(ctx, label, main) for label in labels for main in (True, False)}


@pytest.fixture(scope="module")
def ranks() -> dict:
    results = launch(_main_grads, list(VARIANTS), nproc=DP, timeout_s=120)
    return {key: [r[key] for r in results] for key in results[0]}


@pytest.mark.slow
def test_fp32_main_gradients_accumulate_and_reduce_in_fp32(ranks: dict) -> None:
    """With main gradients every reduced gradient is the fp32 mean 2 + 2^-9 (bf16 accumulation would
    lose the 2^-9), held in fp32, with the bf16 `.grad` dropped; the same steps without them give 2."""
    for label in VARIANTS:
        for rank in ranks[(label, True)]:
            assert rank["grads"] and all(g == 2.0 + SMALL for g in rank["grads"]), (label, rank["grads"])
            assert rank["grad_dtypes"] == ["torch.float32"], label
            assert rank["dot_grad_dropped"], label
            assert (
                "accumulated and reduced in fp32" in rank["note"] or "accumulated in fp32" in rank["note"]
            ), label
        for rank in ranks[(label, False)]:
            assert rank["grads"] and all(g == 2.0 for g in rank["grads"]), (label, rank["grads"])
            assert "in fp32" not in rank["note"], label


@pytest.mark.slow
def test_main_gradients_hold_what_the_memory_model_prices(ranks: dict) -> None:
    """The held state (bf16 parameters, fp32 main gradients, Adam's fp32 moments and masters) is
    `dp_state_bytes` with grad_dtype fp32: 2 bytes a parameter more than with bf16 gradients (to the
    buckets' padding and Adam's step counters)."""
    numel = 11
    styles = {
        DistributedAdam: DataParallel.ZERO1,
        ReplicatedAdam: DataParallel.DDP,
        Zero2Adam: DataParallel.ZERO2,
    }
    for label, (cls, _) in VARIANTS.items():
        style = styles[cls]
        want = dp_state_bytes(numel, "bf16", style, DP, grad_dtype="fp32")
        want_bf16 = dp_state_bytes(numel, "bf16", style, DP)
        for main, expected in ((True, want), (False, want_bf16)):
            for rank in ranks[(label, main)]:
                assert expected <= rank["state_bytes"] <= expected + 128, (
                    label,
                    main,
                    rank["state_bytes"],
                    expected,
                )

"""Imported by the fork server that ranks are forked from (`runtime.launch._PRELOAD`): one
`torch.export` of a tiny module on the meta device, so that every rank finds torch.export's lazy
imports and first-call set-up already done.

Measured on the 2-vCPU dev VM (torch 2.13 CPU, 2026-12-04): a fresh process's first capture of
examples/llama3.py took 2.3 s and the next 0.7 s; after this warm-up (0.3 s, once per fork server)
the first took 0.7 s. Each rank process of a launch captures the model at least once, so this saves
~1.5 s of CPU per rank. Meta tensors run no kernels: no OpenMP thread pool exists before the fork.
"""

from __future__ import annotations

import torch

from planner.frontend.capture import capture


def _warm() -> None:
    with torch.device("meta"):
        tiny = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.LayerNorm(4))
        capture(tiny, (torch.empty(2, 4),), {})


_warm()

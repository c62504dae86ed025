"""Materialising weight shards from a checkpoint for a meta-built, TP-rewritten graph."""

from __future__ import annotations

from pathlib import Path

import torch

from passes.tensor_parallel import apply_tensor_parallel, load_sharded_weights
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture
from planner.frontend.modelfile import load_model_file
from tests.plans import fixed_plan

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_meta_built_rank_loads_only_its_shards_from_a_checkpoint(tmp_path):
    for name in ("llama3.py", "gpt2_tiny.py"):
        model_file = load_model_file(EXAMPLES / name)
        torch.manual_seed(0)
        model = model_file.build("cpu")
        args, kwargs = model_file.inputs()
        checkpoint = tmp_path / f"{name}.pt"
        torch.save({**model.state_dict(), **dict(model.named_buffers())}, checkpoint)
        for rank in (0, 1):
            real = capture(model, args, kwargs)
            plan = fixed_plan(analyse(real), name, 2)
            apply_tensor_parallel(real, plan.splits, rank, 2)
            meta = capture(model_file.build("meta"), args, kwargs)
            apply_tensor_parallel(meta, plan.splits, rank, 2)
            assert all(p.is_meta for p in meta.parameters())
            load_sharded_weights(meta, str(checkpoint), plan.splits, rank, 2)
            got = dict(meta.named_parameters())
            for fqn, want in real.named_parameters():
                assert torch.equal(got[fqn], want), (name, rank, fqn)

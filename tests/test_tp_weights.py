"""Materialising weight shards from a checkpoint for a meta-built, TP-rewritten graph."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from passes.checkpoint import save_checkpoint
from passes.tensor_parallel import apply_tensor_parallel, load_sharded_weights
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture
from planner.frontend.modelfile import load_model_file
from tests.plans import fixed_plan

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _built_with_nonzero_biases(model_file) -> torch.nn.Module:
    """The model file's model, seeded, with its biases drawn from N(0, 1): GPT-2 initialises them to
    zero, and any slice of a zero bias matches the right one."""
    torch.manual_seed(0)
    model = model_file.build("cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    return model


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_meta_built_rank_loads_only_its_shards_from_a_checkpoint(tmp_path, fmt):
    for name in ("llama3.py", "gpt2_tiny.py", "gpt2_odd_vocab.py"):
        path = EXAMPLES / name if (EXAMPLES / name).exists() else Path(__file__).parent / "models" / name
        model_file = load_model_file(path)
        model = _built_with_nonzero_biases(model_file)
        args, kwargs = model_file.inputs()
        tensors = {**model.state_dict(), **dict(model.named_buffers())}
        if fmt == "torch":
            checkpoint = tmp_path / f"{name}.pt"
            torch.save(tensors, checkpoint)
        else:  # a directory of safetensors files, read slice by slice
            checkpoint = tmp_path / name
            checkpoint.mkdir()
            save_checkpoint(tensors, checkpoint / "model.safetensors")
        for rank in (0, 1):
            real = capture(model, args, kwargs)
            plan = fixed_plan(analyse(real), name, 2)
            if name == "gpt2_odd_vocab.py":
                assert any(sp.style == "vocab" for sp in plan.splits.values())
            apply_tensor_parallel(real, plan.splits, rank, 2)
            meta = capture(model_file.build("meta"), args, kwargs)
            apply_tensor_parallel(meta, plan.splits, rank, 2)
            assert all(p.is_meta for p in meta.parameters())
            load_sharded_weights(meta, str(checkpoint), plan.splits, rank, 2)
            got = dict(meta.named_parameters())
            for fqn, want in real.named_parameters():
                assert torch.equal(got[fqn], want), (name, rank, fqn)


def test_biases_of_fused_projections_inside_recomputed_regions_load_their_parts(tmp_path):
    """Full recomputation fuses each layer's nodes into a region (`passes.recompute`); its linears then
    read the weights and biases as placeholders, their get_attr nodes outside. GPT-2's fused c_attn
    bias (parts q, k, v) must still be sliced part by part like its weight: found by the linear inside
    the region, it had been sliced as one contiguous block (q whole and half of k on rank 0), and every
    TP run with --recompute full computed other outputs and gradients."""
    from passes.recompute import apply_recompute  # noqa: PLC0415
    from planner.plan import Recompute  # noqa: PLC0415

    model_file = load_model_file(EXAMPLES / "gpt2_tiny.py")
    model = _built_with_nonzero_biases(model_file)
    args, kwargs = model_file.inputs()
    checkpoint = tmp_path / "gpt2_tiny.pt"
    torch.save({**model.state_dict(), **dict(model.named_buffers())}, checkpoint)
    for rank in (0, 1):
        real = capture(model, args, kwargs)
        structure = analyse(real)
        plan = fixed_plan(structure, "gpt2_tiny.py", 2, workload="train")
        apply_tensor_parallel(real, plan.splits, rank, 2, training=True)
        meta = capture(model_file.build("meta"), args, kwargs)
        apply_tensor_parallel(meta, plan.splits, rank, 2, training=True)
        assert apply_recompute(meta, structure, {"*": Recompute.FULL})  # every layer in a region
        load_sharded_weights(meta, str(checkpoint), plan.splits, rank, 2)
        got = dict(meta.named_parameters())
        for fqn, want in real.named_parameters():
            assert torch.equal(got[fqn], want), (rank, fqn)

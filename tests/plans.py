"""Hand-written Megatron-style plans for the parity tests (independent of the ILP, on purpose)."""

from __future__ import annotations

import functools

from planner.frontend.analysis import ModelStructure, Role, analyse
from planner.frontend.capture import capture
from planner.frontend.modelfile import load_model_file
from planner.plan import MeshShape, Plan, Prediction, SolverInfo, WeightSplit
from planner.solver.search import projection_roles


@functools.cache
def meta_structure(path: str, batch: int, seq: int) -> ModelStructure:
    """The structure of the model file at `path` built on the meta device and captured at its example
    inputs of (`batch`, `seq`), once per test process (a capture costs about a second here; the
    fixtures plan the same model at the same shapes for several layouts). Read it, do not change it."""
    model_file = load_model_file(path)
    args, kwargs = model_file.inputs(batch, seq)
    return analyse(capture(model_file.build("meta"), args, kwargs))


def megatron_splits(structure: ModelStructure, vocab: bool = True) -> dict[str, WeightSplit]:
    """Column-parallel Q/K/V (whole heads) and up/gate, row-parallel output and down projections;
    vocab-parallel embedding and LM head when `vocab`."""
    splits: dict[str, WeightSplit] = {}
    for layer in structure.layers:
        blocks = [b for b in (layer.attention, layer.mlp) if b is not None]
        for block in blocks:
            for p in block.projections:
                col = p.role in (Role.Q, Role.K, Role.V, Role.QKV, Role.UP, Role.GATE)
                dim = p.weight_out_dim if col else 1 - p.weight_out_dim
                parts = list(p.parts) if p.parts else None
                splits[p.weight] = WeightSplit(p.weight, "colwise" if col else "rowwise", dim, parts)
    if vocab:
        for emb in structure.embeddings:
            if emb.vocab_size == structure.vocab_size:
                splits[emb.weight] = WeightSplit(emb.weight, "vocab", 0)
        if structure.lm_head is not None:
            head = structure.lm_head
            splits[head.weight] = WeightSplit(head.weight, "vocab", head.weight_out_dim)
    return splits


def fixed_plan(
    structure: ModelStructure,
    model: str,
    tp: int,
    pp: int = 1,
    ladder_layers: list[int] | None = None,
    workload: str = "forward",
    micro_batches: int = 1,
    vocab: bool = True,
) -> Plan:
    """A Plan with Megatron splits at degree `tp`, layers split evenly over `pp` stages."""
    n = len(structure.layers)
    per = -(-n // pp)
    stages = [list(range(s * per, min(n, (s + 1) * per))) for s in range(pp)]
    zero = Prediction(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    return Plan(
        model=model, cluster="local-cpu", workload=workload, batch_size=structure.batch_size,
        seq_len=structure.seq_len, context=0, micro_batches=micro_batches, dtype="fp32", mesh=MeshShape(tp, pp, 1),
        splits=megatron_splits(structure, vocab) if tp > 1 else {}, stages=stages,
        ladder_layers=list(ladder_layers or []), predicted=zero, solver=SolverInfo("fixed", 0.0, 0.0, 0.0, 0),
        roles=projection_roles(structure),
    )  # fmt: skip


def assert_run_matches(label: str, plan: Plan, summary: dict) -> None:
    """A checked run's summary (`runtime.job.summarise`) matches the unsharded model: no check beyond
    tolerance, every output compared (a training pipeline compares its loss instead), and for training
    the loss, every rank's gradients and the first optimizer step."""
    from runtime.numerics import check_failures  # noqa: PLC0415

    n = summary["numerics"]
    assert not check_failures(n), (label, check_failures(n))
    if plan.pp == 1 or str(plan.workload) != "train":
        assert n["outputs"] and all(o["max_abs_diff"] is not None for o in n["outputs"]), (label, n)
    if str(plan.workload) == "train":
        assert n["loss_diff"] <= n["tolerance_rel"] * n["loss_scale"], (label, n)
        assert all(r["grads_compared"] > 0 for r in summary["ranks"]), label
        update, tol = n["update_max_abs_diff"], n["update_tolerance"]
        assert update is not None and update <= tol, (label, update, tol)

"""`planner export PLAN.yaml --to FORMAT`: a plan as the input of the tool that runs it.

    Plan ─► dtensor     a parallelize_module plan + apply(model, mesh)   (dtensor.py)
         ─► torchtitan  0.3 command-line overrides / 0.2 job TOML       (torchtitan.py)
         ─► megatron    Megatron-LM command-line arguments             (megatron.py)
         ─► vllm        vLLM engine arguments and `vllm serve` line     (vllm.py)

Each export returns an `Export`: the text, which the tool reads as it is, and warnings naming what
the plan chose that the tool cannot express (common.py). Exports only read the plan.
"""

from __future__ import annotations

from planner.errors import InputError
from planner.export.common import Export
from planner.export.dtensor import export_dtensor
from planner.export.megatron import export_megatron
from planner.export.torchtitan import DEFAULT_VERSION as TORCHTITAN_DEFAULT
from planner.export.torchtitan import VERSIONS as TORCHTITAN_VERSIONS
from planner.export.torchtitan import export_torchtitan
from planner.export.vllm import export_vllm
from planner.plan import Plan

FORMATS: tuple[str, ...] = ("dtensor", "torchtitan", "megatron", "vllm")


def export_plan(
    plan: Plan, fmt: str, model: str | None = None, torchtitan_version: str = TORCHTITAN_DEFAULT
) -> Export:
    """Export `plan` for the tool `fmt` (one of FORMATS). model: vLLM's Hugging Face id or checkpoint
    folder (ignored by the other formats); torchtitan_version: the torchtitan release to write for
    (one of TORCHTITAN_VERSIONS: "0.3" overrides, "0.2" TOML). Raises InputError for an unknown format
    or version, or a plan the format cannot take (a training plan for vLLM, a batch that does not
    split into micro-batches)."""
    if fmt == "dtensor":
        return export_dtensor(plan)
    if fmt == "torchtitan":
        return export_torchtitan(plan, torchtitan_version)
    if fmt == "megatron":
        return export_megatron(plan)
    if fmt == "vllm":
        return export_vllm(plan, model)
    raise InputError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")


__all__ = ["FORMATS", "TORCHTITAN_DEFAULT", "TORCHTITAN_VERSIONS", "Export", "export_plan"]

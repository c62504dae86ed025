"""Dtype names used at every interface ("bf16", "fp16", "fp32") and their sizes in bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a torch dtype is asked for: `planner show` and `planner
    import torch  # export` read plans without it (two seconds of start-up)

DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
# a plan's dtype name -> torch's
TORCH_NAMES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name. Raises ValueError naming the accepted names."""
    import torch  # noqa: PLC0415

    try:
        return getattr(torch, TORCH_NAMES[name])
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(TORCH_NAMES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype name of a torch floating dtype ("fp32" for anything not bf16/fp16)."""
    import torch  # noqa: PLC0415

    for name, attr in TORCH_NAMES.items():
        if getattr(torch, attr) == dtype:
            return name
    return "fp32"


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name. Raises ValueError naming the accepted names."""
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPE_BYTES)}") from None

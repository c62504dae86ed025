"""Dtype names used at every interface ("bf16", "fp16", "fp32") and their sizes in bytes."""

from __future__ import annotations

import torch

DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
_TORCH: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name. Raises ValueError naming the accepted names."""
    try:
        return _TORCH[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_TORCH)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype name of a torch floating dtype ("fp32" for anything not bf16/fp16)."""
    for name, value in _TORCH.items():
        if value == dtype:
            return name
    return "fp32"


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name. Raises ValueError naming the accepted names."""
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPE_BYTES)}") from None

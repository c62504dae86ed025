"""Shared fixtures: the example model files, loaded and captured once per test session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx, nn

from planner.frontend.capture import capture
from planner.frontend.modelfile import ModelFile, load_model_file
from tests.planner_fixtures import EXAMPLES


@dataclass
class Captured:
    """An example model built on the CPU (meta for the published large configs) and its graph."""

    model_file: ModelFile
    model: nn.Module
    args: tuple
    kwargs: dict
    gm: fx.GraphModule


@pytest.fixture(scope="session")
def example_path():
    """example_path("llama3") -> the absolute path of examples/llama3.py."""

    def path(name: str) -> Path:
        return EXAMPLES / f"{name}.py"

    return path


@pytest.fixture(scope="session")
def captured():
    """captured("gpt2_tiny") -> Captured, cached for the session (seeded, so deterministic)."""
    cache: dict[str, Captured] = {}

    def get(name: str) -> Captured:
        if name not in cache:
            torch.manual_seed(0)
            mf = load_model_file(EXAMPLES / f"{name}.py")
            model = mf.build("cpu")
            args, kwargs = mf.inputs()
            cache[name] = Captured(mf, model, args, kwargs, capture(model, args, kwargs))
        return cache[name]

    return get


def run_in_sequence(stages: list[nn.Module], *inputs: torch.Tensor) -> Any:
    """Run pipeline stages one after the other in this process: stage 0 on `inputs`, each next stage
    on the previous stage's returned tuple; returns the last stage's output."""
    values: Any = inputs
    for stage in stages:
        values = stage(*values)
    return values

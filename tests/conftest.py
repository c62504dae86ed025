"""Shared fixtures: the example model files, loaded and captured once per test session."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx, nn

# The suite's calibration of this machine (planner optimize without --cluster) is cached in the
# checkout, not in the user's ~/.cache: a calibration measured while the suite loads every core would
# otherwise be what the user's next plans are priced on for a week. Both pytest workers and the
# planners the tests start share it (one measurement at a time: `workflow.resolve_cluster`). Set
# before anything imports planner.cli.workflow, which reads it once.
os.environ.setdefault("PARALLEL_PLANNER_CACHE", str(Path(__file__).resolve().parent.parent / ".test-cache"))

from planner.frontend.capture import capture  # noqa: E402
from planner.frontend.modelfile import ModelFile, load_model_file  # noqa: E402
from tests.planner_fixtures import EXAMPLES  # noqa: E402


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The suite's one real calibration of this machine first (tests/test_calibrate.py, through the
    suite's cache): the plans the other tests make for this machine then load its spec instead of
    measuring again, whichever worker they run on."""
    first = [
        i
        for i in items
        if i.nodeid.endswith("test_calibrate.py::test_calibrate_two_processes_writes_a_loadable_spec")
    ]
    items[:] = first + [i for i in items if i not in first]

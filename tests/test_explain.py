"""`--why` wording: the on/off features say the search's rule (pinned, needed to fit, or the saving
against `FEATURE_MIN_SAVING`), cheaply, without planning a model."""

from __future__ import annotations

import math

from planner.solver.explain import _feature_reason
from planner.solver.problem import FEATURE_MIN_SAVING

WHAT = "ZeRO-1"


def test_a_feature_kept_off_says_its_saving_is_under_the_threshold() -> None:
    # the 405B plan's distributed optimizer: on is faster, but by less than the threshold
    reason = _feature_reason(WHAT, {"off": 7.338, "on": 7.306}, "off", None, "--distributed-optimizer")
    assert FEATURE_MIN_SAVING == 0.005
    assert reason == "ZeRO-1; on saves 0.44% (< 0.5% threshold: kept off, the simpler layout)"


def test_a_feature_chosen_pinned_or_needed_says_which() -> None:
    flag = "--sequence-parallel"
    assert (
        _feature_reason(WHAT, {"off": math.inf, "on": 7.0}, "on", None, flag)
        == "ZeRO-1; on: needed to fit memory"
    )
    assert _feature_reason(WHAT, {"off": 7.7, "on": 7.0}, "on", None, flag) == (
        "ZeRO-1; on saves 10.0% of the step (a feature must save at least 0.5% of the step)"
    )
    assert (
        _feature_reason(WHAT, {"off": 7.0, "on": 7.3}, "off", None, flag) == "ZeRO-1; off: on is not faster"
    )
    assert _feature_reason(WHAT, {"off": 7.0, "on": 6.0}, "off", False, flag).endswith(
        "pinned by --sequence-parallel off"
    )
    assert "on saves under 0.01% of the step" in _feature_reason(
        WHAT, {"off": 7.0, "on": 7.0 - 1e-7}, "on", None, flag
    )

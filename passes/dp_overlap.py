"""Data-parallel parameter gathers waited for where the forward first needs them (overlap_param_gather).

With `Plan.overlap_param_gather` (zero1 / zero2) the optimizer step issues one asynchronous all-gather
of the updated parameters per wrapping unit (a layer; the parameters outside the layers one more) and
returns; the next forward waits for each unit's gather just before the first node that reads one of
its parameters (Megatron-LM's --overlap-param-gather). Rank modules are flat fx graphs reading their
parameters through `get_attr` nodes, so no module hook marks where a layer starts:
`insert_param_waits` puts a `dp_param_wait(unit)` call node right before the first node using each
unit's parameters. The optimizer registers what is pending in this process (`gather_pending`);
`dp_param_wait` of a unit with nothing pending is a no-op, so the rewritten module runs anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch.fx as fx
from torch.fx.node import has_side_effect

# unit -> what finishes its pending gathers (wait, then copy into the parameters where needed)
_PENDING: dict[str, list[Callable[[], None]]] = {}
# (event, unit) of the waits, in order, when a recorder is set (`record_events`); None: not recorded
_EVENTS: list[tuple[str, str]] | None = None


def gather_pending(unit: str, finish: Callable[[], None]) -> None:
    """Register a gather of `unit`'s parameters in flight; `finish` waits for it (called once)."""
    _PENDING.setdefault(unit, []).append(finish)


def record_events(events: list[tuple[str, str]] | None) -> None:
    """Append ("param_wait", unit) to `events` each time a pending gather is waited for (None: stop)."""
    global _EVENTS
    _EVENTS = events


@has_side_effect
def dp_param_wait(unit: str) -> None:
    """Wait for the pending parameter gathers of `unit` (none pending: nothing)."""
    finishers = _PENDING.pop(unit, None)
    if not finishers:
        return
    if _EVENTS is not None:
        _EVENTS.append(("param_wait", unit))
    for finish in finishers:
        finish()


def wait_all_gathers() -> None:
    """Wait for every pending gather (before reading the parameters outside a forward)."""
    for unit in list(_PENDING):
        dp_param_wait(unit)


def insert_param_waits(gm: fx.GraphModule, unit_of: Mapping[str, str]) -> list[str]:
    """Insert `dp_param_wait(unit)` before the first node of `gm` using a parameter of each unit
    (`unit_of`: parameter FQN -> its unit; parameters not listed are left alone). Idempotent: a graph
    already carrying the waits is not changed again. Returns the units in the order their waits run."""
    graph = gm.graph
    if any(n.op == "call_function" and n.target is dp_param_wait for n in graph.nodes):
        return [n.args[0] for n in graph.nodes if n.op == "call_function" and n.target is dp_param_wait]
    attr_unit = {n: unit_of[n.target] for n in graph.nodes if n.op == "get_attr" and n.target in unit_of}
    seen: list[str] = []
    for node in list(graph.nodes):
        if node.op == "get_attr":
            continue
        for unit in dict.fromkeys(attr_unit[i] for i in node.all_input_nodes if i in attr_unit):
            if unit in seen:
                continue
            seen.append(unit)
            with graph.inserting_before(node):
                graph.call_function(dp_param_wait, (unit,))
    gm.recompile()
    return seen

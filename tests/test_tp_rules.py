"""The tensor-parallel rule table (passes.tp_rules): the example graphs lowered, one rule per op."""

from __future__ import annotations

import copy
import operator

import pytest
import torch

from passes.placement import Placement
from passes.tensor_parallel import RULE_META, apply_tensor_parallel, rule_coverage
from passes.tp_rules import (
    RULES,
    RuleTable,
    register_rule,
    rule_for,
    rule_matmul,
    rule_pointwise,
    rule_view,
)
from passes.tp_rules_context import FALLBACK_META, RuleContext
from planner.frontend.analysis import analyse
from planner.plan import Layout
from tests.plans import megatron_splits

aten = torch.ops.aten


@pytest.mark.parametrize("name", ["llama3", "gpt2", "hf_llama", "hf_gpt2"])
def test_megatron_layout_of_the_examples_lowers_every_op_without_a_gather(captured, name: str) -> None:
    """Every call of the example graphs gets a placement (by DTensor's general rules, ours, or run
    replicated) and the hand-written Megatron layout at TP=2 gathers no shard anywhere."""
    gm = copy.deepcopy(captured(name).gm)
    structure = analyse(gm)
    apply_tensor_parallel(gm, megatron_splits(structure), 0, 2)
    originals = [n for n in gm.graph.nodes if n.op == "call_function" and RULE_META in n.meta]
    assert originals, name
    gathered = [f"{n.name}: {n.meta[FALLBACK_META].op}" for n in gm.graph.nodes if FALLBACK_META in n.meta]
    assert not gathered, f"{name}: {gathered}"
    coverage = rule_coverage(gm)
    assert coverage["general"] > 0 and coverage["own"] > 0, coverage


def test_lookup_prefers_the_overload_then_its_packet() -> None:
    assert RULES.lookup(aten.mm.default).rule is rule_matmul  # registered as the packet aten.mm
    assert RULES.lookup(aten.view.default).rule is rule_view
    assert RULES.lookup(aten.add.Tensor).rule is rule_pointwise  # registered as pointwise overloads
    assert RULES.lookup(aten.sort.default) is None
    assert RULES.lookup(operator.getitem) is not None


def test_duplicate_rule_is_an_error() -> None:
    table = RuleTable()

    def first(ctx, node):
        """First."""

    def second(ctx, node):
        """Second."""

    table.register(aten.mm.default)(first)
    with pytest.raises(ValueError, match=r"mm.default already has .*first.*second"):
        table.register(aten.mm.default)(second)
    with pytest.raises(ValueError, match="already has"):  # the packet overlaps its registered overload
        table.register(aten.mm)(second)
    table.register(aten.bmm)(first)
    with pytest.raises(ValueError, match="already has"):
        table.register(aten.bmm.default)(second)
    with pytest.raises(ValueError, match="already has"):  # a clash anywhere registers none of the ops
        table.register(aten.addmm, aten.bmm)(second)
    assert table.lookup(aten.addmm.default) is None
    assert table.lookup(aten.mm.default).rule is first


def test_duplicate_in_the_global_table_is_refused_and_leaves_it_unchanged() -> None:
    with pytest.raises(ValueError, match="rule_matmul"):

        @register_rule(aten.linear.default)
        def another_linear(ctx, node):
            """Never registered."""

    assert RULES.lookup(aten.linear.default).rule is rule_matmul


def test_ops_without_a_rule_fall_back_as_before() -> None:
    assert aten.abs.default not in RULES
    assert rule_for(aten.abs.default).rule is rule_pointwise  # ATen tags abs pointwise
    assert rule_for(aten.sort.default).rule is RuleContext.run_replicated
    assert not rule_for(aten.sort.default).padded_inputs
    assert rule_for(aten.embedding.default).padded_inputs and rule_for(aten.linear.default).padded_inputs


def test_every_rule_has_a_one_line_docstring() -> None:
    rules = {RULES.lookup(op).rule for op in RULES.ops()}
    for rule in rules:
        doc = (rule.__doc__ or "").strip()
        assert doc and "\n" not in doc, f"{rule.__name__}: {doc!r}"


def test_placement_kinds_are_the_plan_layouts() -> None:
    assert Placement.replicate().kind is Layout.REPLICATE
    assert Placement.shard(2).kind is Layout.SHARD and Placement.shard(2).is_shard
    assert Placement.partial().kind is Layout.PARTIAL and Placement.partial().is_partial
    assert Placement("S", 1) == Placement.shard(1) and Placement("S", 1).kind is Layout.SHARD
    assert str(Placement.shard(1, (4, 4))) == "Shard(1)[parts=[4, 4]]"
    with pytest.raises(ValueError):
        Placement("X")

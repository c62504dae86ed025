"""Expert routing replayed in a run's numerics check (`runtime.routing`): by token (training and
forward runs) and in call order (serving)."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from runtime.numerics import check_failures
from runtime.routing import RoutingTape, TokenRoutingTape, routing_by_token, routing_tape


class _Block(torch.nn.Module):
    """A router (linear to 4 logits, the token's 3 features and a 0) and a top-2 over its logits."""

    def __init__(self, rows: list[int] | None = None) -> None:
        super().__init__()
        self.router = torch.nn.Linear(3, 4, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.eye(4, 3)[rows or [0, 1, 2, 3]])

    def forward(self, x):
        values, ids = torch.ops.aten.topk.default(self.router(x), 2)
        return values * 1.0, ids


def _graph(rows: list[int] | None = None) -> tuple[fx.GraphModule, dict[str, str]]:
    """The block traced, and {its top-k node: its router node}. ``rows``: the router's rows permuted (a
    router a rewrite got wrong)."""
    gm = fx.symbolic_trace(_Block(rows))
    topk = next(n.name for n in gm.graph.nodes if n.target is torch.ops.aten.topk.default)
    router = next(n.name for n in gm.graph.nodes if n.op == "call_module")
    return gm, {topk: router}


TOKENS = torch.tensor([[0.9, 0.5, 0.4999], [0.1, 0.2, 0.8], [0.7, 0.1, 0.3]])


def _recorded(gm, routers) -> TokenRoutingTape:
    tape = TokenRoutingTape()
    with routing_by_token([gm], routers, tape):
        gm(TOKENS)
    return tape


def test_a_rank_takes_the_expert_choices_of_its_own_tokens_from_the_reference() -> None:
    """The reference routes 3 tokens; a rank routes two of them in another order (a data-parallel share,
    a micro-batch), one with a near-tie its rounding flips (experts 1 and 2 at 0.5 +- 1e-4), and a token
    the reference never saw. The rank gets each known token's reference choice, its own scores at those
    experts, the flip counted, its router's logits compared with the reference's on the matched tokens;
    the unknown token keeps its own choice; the graph is restored after."""
    gm, routers = _graph()
    tape = _recorded(gm, routers)
    (name,) = routers
    assert tape.choices[name][1].tolist() == [[0, 1], [2, 1], [0, 2]]
    rank = torch.tensor([[0.1, 0.2, 0.8], [0.9, 0.4999, 0.5001], [5.0, 0.0, 1.0]])  # token 1, 0 rounded, new
    own = gm(rank)[1]
    assert own.tolist() == [[2, 1], [0, 2], [0, 2]]  # plain top-k again: token 0 flipped here
    replay = TokenRoutingTape(choices=tape.choices, replay=True)
    with routing_by_token([gm], routers, replay):
        values, ids = gm(rank)
    assert ids.tolist() == [[2, 1], [0, 1], [0, 2]]
    assert values[1].tolist() == pytest.approx([0.9, 0.4999])  # this run's scores at the reference's choice
    assert (replay.calls, replay.flipped, replay.unmatched) == (1, 1, 1)
    assert replay.max_gap == pytest.approx(0.0002, abs=1e-6)
    assert replay.logit_diff == pytest.approx(0.0002, abs=1e-6) and replay.logit_scale == pytest.approx(0.9)
    assert gm(rank)[1].tolist() == own.tolist()


def test_a_wrong_router_is_not_hidden_by_the_replayed_choices() -> None:
    """A rank whose router rows are permuted (experts 1 and 2 swapped) is handed the reference's expert
    choices, and its outputs could then pass; its logits do not: the check names the routers."""
    gm, routers = _graph()
    tape = _recorded(gm, routers)
    wrong, wrong_routers = _graph([0, 2, 1, 3])
    (name,) = routers
    replay = TokenRoutingTape(choices={next(iter(wrong_routers)): tape.choices[name]}, replay=True)
    with routing_by_token([wrong], wrong_routers, replay):
        wrong(TOKENS)
    assert replay.calls == 1 and replay.logit_diff == pytest.approx(0.6)
    numerics = {
        "tolerance_rel": 0.05, "dtype": "bf16", "routing_calls": 1, "routing_flipped": replay.flipped,
        "routing_logit_diff": replay.logit_diff, "routing_tolerance": 0.05 * replay.logit_scale,
    }  # fmt: skip
    assert any(
        line.startswith("expert routing: the routers' logits differ") for line in check_failures(numerics)
    )


def test_a_router_over_batch_and_sequence_dims_is_replayed_by_token_too() -> None:
    """Scores (B, T, E) from router inputs (B, T, H): the tokens are the leading dims."""
    gm, routers = _graph()
    tokens = torch.tensor([[[0.9, 0.5, 0.4999], [0.1, 0.2, 0.8]], [[0.7, 0.1, 0.3], [0.2, 0.9, 0.1]]])
    tape = TokenRoutingTape()
    with routing_by_token([gm], routers, tape):
        gm(tokens)
    (name,) = routers
    assert tape.choices[name][0].shape == (4, 3) and tape.choices[name][1].shape == (4, 2)
    rank = tokens[1:].clone()  # the second sequence, a data-parallel share
    rank[0, 0] = torch.tensor([0.7, 0.1001, 0.3])
    replay = TokenRoutingTape(choices=tape.choices, replay=True)
    with routing_by_token([gm], routers, replay):
        _, ids = gm(rank)
    assert ids.tolist() == [[[0, 2], [1, 0]]] and (replay.calls, replay.unmatched) == (1, 0)


def test_a_served_request_replays_its_routing_in_call_order() -> None:
    """Serving: each top-k call takes the recorded call's ids, whatever the rows (every rank routes the
    whole batch); the router's logits are compared with the recorded call's; a call the reference did
    not make is an error."""
    gm, routers = _graph()
    tape = RoutingTape()
    with routing_tape([(gm, routers)], tape):
        gm(TOKENS)
    assert [ids.tolist() for ids, _ in tape.choices] == [[[0, 1], [2, 1], [0, 2]]]
    rounded = TOKENS.clone()
    rounded[0, 1], rounded[0, 2] = 0.4999, 0.5001
    replay = RoutingTape(choices=tape.choices, replay=True)
    with routing_tape([(gm, routers)], replay):
        _, ids = gm(rounded)
    assert ids.tolist() == [[0, 1], [2, 1], [0, 2]]
    assert replay.flipped == 1 and replay.logit_diff == pytest.approx(0.0002, abs=1e-6)
    with pytest.raises(RuntimeError, match="no recorded choice"), routing_tape([(gm, routers)], replay):
        gm(rounded)


def test_recording_the_replay_lets_go_of_the_references_choices() -> None:
    """Once the checked step's replayed routing is in the report, the tape holds nothing: its choices
    are every router's inputs for the whole batch, which the timed steps (routing by themselves) must
    not keep alive beside their activations."""
    from runtime.job import RankReport  # noqa: PLC0415
    from runtime.reference import record_routing  # noqa: PLC0415

    gm, routers = _graph()
    tape = _recorded(gm, routers)
    replay = TokenRoutingTape(choices=dict(tape.choices), replay=True)
    with routing_by_token([gm], routers, replay):
        gm(TOKENS)
    report = RankReport(0, 0, 0, [], 0.0, 0, None, None)
    record_routing(report, replay)
    assert report.routing_calls == 1 and replay.choices == {}

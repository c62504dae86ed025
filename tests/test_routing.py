"""Expert routing replayed by token in a training run's numerics check (`runtime.routing`)."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from runtime.routing import TokenRoutingTape, routing_by_token


class _Block(torch.nn.Module):
    """A router (linear to 4 scores) and a top-2 over its scores: the nodes `routing_by_token` swaps."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(3, 4, bias=False)

    def forward(self, x):
        values, ids = torch.ops.aten.topk.default(self.router(x), 2)
        return values * 1.0, ids


def _graph() -> tuple[fx.GraphModule, dict[str, str]]:
    block = _Block()
    with torch.no_grad():
        block.router.weight.copy_(torch.eye(4, 3))  # scores: the token's 3 features and a 0
    gm = fx.symbolic_trace(block)
    topk = next(n.name for n in gm.graph.nodes if n.target is torch.ops.aten.topk.default)
    router = next(n.name for n in gm.graph.nodes if n.op == "call_module")
    return gm, {topk: router}


def test_a_rank_takes_the_expert_choices_of_its_own_tokens_from_the_reference() -> None:
    """The reference routes 3 tokens; a rank routes two of them in another order (a data-parallel share,
    a micro-batch), one with a near-tie its rounding flips (experts 1 and 2 at 0.5 +- 1e-4), and a token
    the reference never saw. The rank gets each known token's reference choice, its own scores at those
    experts, the flip counted with its gap; the unknown token keeps its own choice; the graph is
    restored after."""
    gm, routers = _graph()
    tokens = torch.tensor([[0.9, 0.5, 0.4999], [0.1, 0.2, 0.8], [0.7, 0.1, 0.3]])
    tape = TokenRoutingTape()
    with routing_by_token([gm], routers, tape):
        gm(tokens)
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
    assert replay.max_gap == pytest.approx(0.0002, abs=1e-6) and replay.scale == pytest.approx(5.0)
    assert gm(rank)[1].tolist() == own.tolist()


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

"""Context parallelism in the cost model, the search and the CLI: each attention variant priced as
`costmodels.context_parallel` says (ring overlap per block, all-gather and all-to-all exposed, load
balancing), activations and token-wise work per rank / cp, the gradient reduction over dp x cp, the
search's choice at long and short sequences, `--why`, and bad pins refused in one line."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from costmodels import memory
from costmodels.cluster import load_cluster
from costmodels.comm import Group, p2p_time_s
from costmodels.context_parallel import (
    SCORE_TILE,
    CpAttentionShape,
    cp_attention_cost,
    load_balanced_work_fraction,
    ulysses_refusal,
)
from planner.cli import workflow
from planner.cli.main import main
from planner.cli.render import training_rows
from planner.errors import InputError
from planner.plan import DataParallel, MeshShape, Plan
from planner.solver import search as search_module
from planner.solver.costing import (
    CostContext,
    build_layer_graph,
    cp_buffer_bytes,
    p2p_stage_time_s,
    transient_bytes,
)
from planner.solver.problem import Constraints, MeshConfig, WorkloadSpec, dp_style_variants
from planner.solver.search import plan_model
from tests.planner_fixtures import EXAMPLES, analysed_llama

MODELS = EXAMPLES.parent / "tests" / "models"

# Llama-3-8B's attention on one rank of TP 8: 4 query heads, 1 KV head, head dim 128
ONE_TP_RANK = dict(heads=4, kv_heads=1, head_dim=128)


def _cost(seq_len: int, cp: int, kind: str, cluster="dgx-h100", balance=True, backward=0.0, nodes=1):
    shape = CpAttentionShape(1, **ONE_TP_RANK, seq_len=seq_len, causal=True)
    spec = load_cluster(cluster)
    return cp_attention_cost(shape, cp, kind, balance, spec, Group(cp, cp // nodes), "bf16", backward)


def test_ring_hides_a_block_whose_attention_outlasts_its_transfer_and_shows_the_rest() -> None:
    """Forward ring attention: each of the cp-1 K/V transfers runs under its step's block attention;
    exposed = sum of max(0, transfer - eta x block), and exposed + hidden = every transfer."""
    long = _cost(131072, 8, "ring")  # 16k tokens per rank: a block's attention takes far longer
    assert long.exposed_s == 0.0 and long.hidden_s > 0
    spec = load_cluster("h100-ib-2node")
    short = _cost(4096, 16, "ring", cluster="h100-ib-2node", nodes=2)  # 256 tokens, across nodes
    assert short.exposed_s > 0
    transfer = p2p_time_s(short.kv_block_bytes, spec, inter_node=True)
    assert short.exposed_s + short.hidden_s == pytest.approx(15 * transfer)
    # the same bytes as an all-gather of K/V, which hides nothing
    gather = _cost(4096, 16, "allgather", cluster="h100-ib-2node", nodes=2)
    assert gather.hidden_s == 0.0 and gather.exposed_s > 0


def test_training_ring_waits_for_the_last_gradient_accumulator() -> None:
    """Backward: K/V again and the fp32 dK/dV accumulator one step behind; the last accumulator's
    transfer after the last block is exposed however long the blocks are."""
    cost = _cost(131072, 8, "ring", backward=2.5)
    spec = load_cluster("dgx-h100")
    last = p2p_time_s(cost.kv_block_bytes * 4 / 2, spec, inter_node=False)  # fp32 of bf16 K/V
    assert cost.exposed_s == pytest.approx(last)
    assert cost.compute_s == pytest.approx(3.5 * cost.forward_s)


def test_load_balancing_gives_every_rank_the_same_causal_work() -> None:
    """Contiguous shards: rank cp-1 does (2cp-1)/cp of the average; balanced, every rank 1/cp."""
    assert load_balanced_work_fraction(8, True, True) == pytest.approx(1 / 8)
    assert load_balanced_work_fraction(8, True, False) == pytest.approx(15 / 64)
    assert load_balanced_work_fraction(8, False, False) == pytest.approx(1 / 8)
    balanced, contiguous = _cost(131072, 8, "allgather"), _cost(131072, 8, "allgather", balance=False)
    assert contiguous.forward_s / balanced.forward_s == pytest.approx(15 / 8, rel=1e-3)
    ring, ring_contiguous = _cost(131072, 8, "ring"), _cost(131072, 8, "ring", balance=False)
    assert 1.7 < ring_contiguous.forward_s / ring.forward_s < 15 / 8 + 1e-9  # the own block is causal
    # Ulysses attends over the whole sequence after its all-to-all: the layout does not matter
    shape, spec = CpAttentionShape(1, 32, 8, 128, 131072, True), load_cluster("dgx-h100")
    a2a = [
        cp_attention_cost(shape, 4, "alltoall", lb, spec, Group(4, 4), "bf16", 0.0) for lb in (True, False)
    ]
    assert a2a[0].forward_s == a2a[1].forward_s


def test_ulysses_needs_heads_that_divide_by_cp_and_says_which() -> None:
    """Llama-3-8B's 32 query / 8 KV heads at cp 16: the KV heads do not divide; named with both numbers."""
    why = ulysses_refusal(32, 8, 16)
    assert why is not None and "8 KV heads" in why and "cp=16" in why and "ring or allgather" in why
    assert ulysses_refusal(32, 8, 8) is None
    with pytest.raises(ValueError, match="cp=2"):
        _cost(131072, 2, "alltoall")  # one KV head per TP rank
    # bytes per rank fall as 1 / cp for a fixed sequence (ring and all-gather stay at one sequence's K/V)
    shape = CpAttentionShape(1, 32, 8, 128, 131072, True)
    spec = load_cluster("dgx-h100")

    def exposed(cp: int, kind: str) -> float:
        return cp_attention_cost(shape, cp, kind, True, spec, Group(cp, cp), "bf16", 0.0).exposed_s

    assert exposed(8, "alltoall") < 0.7 * exposed(4, "alltoall")
    assert exposed(8, "allgather") > 0.9 * exposed(4, "allgather")


def _ctx(
    cp: int, dp: int = 1, tp: int = 1, seq: int = 65536, kind: str = "allgather", style=DataParallel.DDP
):
    config = MeshConfig(MeshShape(tp, 1, dp, cp), 1, dp_style=style, cp_comm_type=kind)
    work = WorkloadSpec("train", dp, seq, dtype="bf16")
    return CostContext(analysed_llama("8b"), load_cluster("dgx-h100"), work, config, "bf16")


def test_activations_and_token_wise_work_per_rank_fall_as_one_over_cp() -> None:
    layer = analysed_llama("8b").layers[0]
    whole, split = build_layer_graph(layer, _ctx(1)), build_layer_graph(layer, _ctx(4))
    assert split.fixed_activation_bytes == pytest.approx(whole.fixed_activation_bytes / 4)
    assert split.least_activation_bytes() == pytest.approx(whole.least_activation_bytes() / 4, rel=1e-6)
    up = [op.option("replicate").compute_s for g in (whole, split) for op in g.ops if op.name == "up"]
    assert up[1] < 0.3 * up[0]  # a quarter of the rows (GEMM efficiency changes a little)
    assert _ctx(4, tp=2).tokens == 65536 / 4
    two_stages = [_ctx(cp) for cp in (1, 4)]
    for ctx in two_stages:  # each CP rank sends its own tokens to the next stage
        ctx.config = dataclasses.replace(ctx.config, mesh=dataclasses.replace(ctx.mesh, pp=2))
    assert p2p_stage_time_s(two_stages[1]) < 0.3 * p2p_stage_time_s(two_stages[0])


def test_kv_buffers_in_flight_ring_two_blocks_allgather_the_whole_sequence() -> None:
    ring, gather = _ctx(8, kind="ring"), _ctx(8, kind="allgather")
    kv = 2 * 1 * 8 * (65536 / 8) * 128 * 2  # one rank's K and V, bf16, 8 KV heads
    tiles = 2 * 4 * 32 * 1024 * 1024  # two fp32 score tiles of the 32 query heads (a backward)
    assert cp_buffer_bytes(ring) == pytest.approx(2 * kv * 3 + tiles)  # + fp32 dK/dV accumulators
    assert cp_buffer_bytes(gather) == pytest.approx(8 * kv * 3 + tiles)
    assert transient_bytes(gather) - transient_bytes(ring) == pytest.approx(6 * kv * 3)
    assert cp_buffer_bytes(_ctx(1)) == 0.0


def test_gradients_and_sharded_state_span_dp_times_cp() -> None:
    """The CP ranks hold the same weights: zero1 at dp 1 x cp 4 shards Adam's state over 4 ranks as
    zero1 at dp 4 does, and reduces over a group of 4."""
    ctx = _ctx(4, style=DataParallel.ZERO1)
    plain = _ctx(1, dp=4, style=DataParallel.ZERO1)
    assert ctx.dp_group().size == 4 and ctx.state_shards == 4 and ctx.shard_degree == 1
    assert ctx.state_factor() == pytest.approx(plain.state_factor())
    expected = memory.dp_state_bytes(1, "bf16", DataParallel.ZERO1, 4) / memory.param_bytes(1, "bf16")
    assert ctx.state_factor() == pytest.approx(expected)
    styles = {v.dp_label() for v in dp_style_variants(ctx.config, Constraints())}
    assert {"ddp", "zero1", "zero2", "fsdp"} <= styles  # fsdp over the 4 cp ranks at dp 1


def test_llama3_8b_at_131k_tokens_on_8_h100s_splits_the_sequence_and_at_8k_does_not(monkeypatch) -> None:
    """At 131k tokens the fastest plan that fits uses context parallelism; at 8k tokens (CP priced there
    too) data parallelism over the batch is faster; --why lists the degrees and the variants."""
    cluster, structure = load_cluster("dgx-h100"), analysed_llama("8b")
    long = plan_model(structure, cluster, WorkloadSpec("train", 2, 131072, dtype="bf16"), Constraints())
    assert long.cp > 1 and long.cp_comm_type in ("ring", "allgather", "alltoall")
    whys = {d.subject: d for d in long.decisions}
    degrees = whys["context-parallel"].options
    assert degrees[f"cp={long.cp}"] == min(degrees.values()) and "cp=1" in degrees
    variants = whys["context-parallel attention"]
    assert variants.options[variants.chosen] == pytest.approx(long.predicted.latency_s)
    assert variants.options["allgather unbalanced"] > variants.options["allgather"]
    assert long.predicted.overlapped_comm_s > 0 or long.cp_comm_type != "ring"
    rows = dict((r[0], r[1]) for r in training_rows(long))
    assert rows["context parallelism"] == long.cp_text() and f"CP={long.cp}" in rows["mesh"]
    again = Plan.from_dict(long.to_dict())
    assert (again.cp, again.cp_comm_type, again.cp_load_balance) == (
        long.cp,
        long.cp_comm_type,
        long.cp_load_balance,
    )
    monkeypatch.setattr(search_module, "MIN_CP_SEQ_LEN", 0)
    short = plan_model(structure, cluster, WorkloadSpec("train", 8, 8192, dtype="bf16"), Constraints())
    assert short.cp == 1 and "cp=2" in {d.subject: d for d in short.decisions}["context-parallel"].options


def test_alltoall_refused_in_why_with_the_head_counts() -> None:
    """A model whose SDPA groups its one KV head itself (`enable_gqa`): at TP 2 x CP 2 all-to-all cannot
    split that head over the cp ranks, and --why says so with the counts. (A model that repeats its KV
    heads to the query heads before the op has those to split: examples/models.py's Llama at TP 8 x CP 2.)"""
    mqa = workflow.prepare(str(Path(__file__).parent / "models" / "mqa_train.py"), "train").structure
    plan = plan_model(
        mqa, load_cluster("local-cpu", nproc=4), WorkloadSpec("train", 2, 16), Constraints(tp=2, cp=2),
    )  # fmt: skip
    variants = {d.subject: d for d in plan.decisions}["context-parallel attention"]
    assert variants.options["alltoall"] == math.inf
    assert (
        "alltoall not allowed" in variants.reason
        and "1 KV heads" in variants.reason
        and "cp=2" in variants.reason
    )


def test_bad_cp_pins_are_refused_in_one_line_naming_both_numbers() -> None:
    structure, cluster = analysed_llama("8b"), load_cluster("h100-ib-2node")

    def refused(seq: int, **pins) -> str:
        with pytest.raises(InputError) as e:
            plan_model(structure, cluster, WorkloadSpec("train", 1, seq, dtype="bf16"), Constraints(**pins))
        assert "\n" not in str(e.value)
        return str(e.value)

    why = refused(131076, cp=8)  # neither 8 contiguous chunks nor 2 x 8 = 16 balanced ones; 4 divides it
    assert "131076" in why and "8 chunks, nor 2 x cp = 16" in why and "use cp 4" in why
    why = refused(131076, cp=4, cp_load_balance=True)
    assert "8 chunks" in why and "turn load balancing off" in why
    # examples/models.py's Llama repeats its 8 KV heads to the 32 query heads before SDPA: all-to-all
    # splits the 32 the op reads (it was refused on the 8), and prices moving them
    plan_model(
        structure,
        cluster,
        WorkloadSpec("train", 1, 131072, dtype="bf16"),
        Constraints(cp=16, cp_comm_type="alltoall"),
    )
    mqa = workflow.prepare(
        str(Path(__file__).parent / "models" / "mqa_train.py"), "train"
    ).structure  # SDPA groups 1 KV head
    with pytest.raises(InputError) as e:
        plan_model(
            mqa,
            load_cluster("local-cpu", nproc=4),
            WorkloadSpec("train", 2, 16),
            Constraints(cp=2, cp_comm_type="alltoall"),
        )
    why = str(e.value)
    assert "1 KV heads" in why and "cp=2" in why and "ring or allgather" in why
    with pytest.raises(InputError, match="--cp 1 turns it off"):
        Constraints(cp=1, cp_comm_type="ring")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--workload", "decode", "--cp", "8"], ["--cp 8", "decode"]),
        (["--workload", "train", "--cp", "1", "--cp-load-balance", "on"], ["--cp-load-balance on", "--cp 1"]),
        (
            ["--workload", "train", "--seq-len", "131076", "--cp", "8", "--batch-size", "1"],
            ["131076", "nor 2 x cp = 16"],
        ),
    ],
)
def test_cli_refuses_bad_cp_options_with_exit_code_2(args, words, capsys) -> None:
    rc = main(["optimize", str(EXAMPLES / "llama3_8b.py"), "--cluster", "dgx-h100", *args])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and all(w in err for w in words), err


def test_attention_dropout_in_training_keeps_context_parallelism_off_and_says_where(capsys) -> None:
    """The context-parallel kernels run no attention dropout (`passes.cp_lower` refuses it on the
    ranks): a training plan of a model whose SDPA drops out in train mode (`dropout_p=P if
    self.training else 0.0`, read from a train-mode capture, the mode planning's eval capture hides) is
    refused at --cp 2 with the model line, and the search lists cp as excluded instead of choosing it;
    the forward pass (eval mode, no dropout) still plans --cp 2."""
    model = str(MODELS / "dropout_tp.py")
    rc = main(
        ["optimize", model, "--cluster", "dgx-h100", "--workload", "train", "--cp", "2", "--seq-len", "64"]
    )
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2, err
    assert "dropout_p 0.3" in err and "dropout_tp.py:" in err and "--cp 1" in err, err
    rc = main(
        ["optimize", model, "--cluster", "dgx-h100", "--workload", "forward", "--cp", "2", "--seq-len", "64"]
    )
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()
    rc = main(
        ["optimize", model, "--cluster", "dgx-h100", "--workload", "train", "--seq-len", "32768", "--why"]
    )
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0 and "excluded: cp>1: its attention applies dropout in training" in out, out


def test_cp_on_cross_attention_says_it_is_cross_attention_and_the_fix(capsys) -> None:
    """Cross-attention's keys / values come from another input than the sharded sequence (a memory), so
    they are not split over the cp ranks: a pinned --cp is refused naming it cross-attention, the model
    line and --cp 1 (it said only "k is not split along its sequence dim ... but Replicate()")."""
    model = str(MODELS / "cross_attention_memory.py")
    rc = main(
        ["optimize", model, "--cluster", "dgx-h100", "--workload", "train", "--seq-len", "32", "--cp", "2"]
    )
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "cross_attention_memory.py:" in err and "Traceback" not in err, err
    assert "is cross-attention: its queries are split along the sequence but its keys / values (k: " in err, (
        err
    )
    assert (
        "(an encoder output or a memory), which context parallelism does not split; plan with --cp 1" in err
    )


def test_load_balancing_left_off_by_the_sequence_length_is_said_with_its_cost(tmp_path, capsys) -> None:
    """--cp 2 with load balancing on auto at --seq-len 30 (not a multiple of 2 x cp = 4) ran contiguous
    chunks in silence; a note line and the decision's reason say why and what it costs. A sequence that
    cuts into 4 chunks is balanced and says nothing."""
    common = [
        "optimize",
        str(EXAMPLES / "llama3.py"),
        "--cluster",
        "dgx-h100",
        "--workload",
        "train",
        "--cp",
        "2",
    ]
    out_path = tmp_path / "plan.yaml"
    assert main([*common, "--batch-size", "2", "--seq-len", "30", "--out", str(out_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    note = (
        "context parallelism runs without load balancing: a sequence of 30 tokens does not cut into 2 x cp = 4 "
        "equal chunks (30 is not a multiple of 4), so each of the 2 ranks keeps one contiguous chunk and the "
        "causal attention's work is unbalanced (rank 1, the last, does about 2cp-1 = 3 times rank 0's work); a "
        "sequence length that is a multiple of 4 (e.g. 28 or 32) would balance it"
    )
    assert f"note: {note}" in out, out
    plan = Plan.from_yaml(out_path)  # the decision's reason, as --why and the plan file give it
    (decision,) = [d for d in plan.decisions if d.subject == "context-parallel attention"]
    assert decision.chosen == "allgather unbalanced" and decision.reason.startswith(f"{note}; "), decision
    assert main([*common, "--batch-size", "2", "--seq-len", "32"]) == 0
    assert "without load balancing" not in capsys.readouterr().out


def test_cp_on_attention_outside_numbered_layers_names_the_blocks_and_the_fix(capsys) -> None:
    rc = main(["optimize", str(MODELS / "named_blocks.py"), "--workload", "train", "--cp", "2"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "(b0, b1) is not in a stack of numbered layers" in err and "nn.ModuleList" in err, err


def test_a_hand_written_attention_core_keeps_the_search_off_cp_and_a_pin_still_plans(capsys) -> None:
    """The CP pass runs SDPA as context-parallel attention; a hand-written softmax(q k^T) v is gathered
    whole on every rank (a priced fallback). The search does not choose CP for it and says why in
    --why; a pinned --cp plans (and runs, gathered)."""
    model = str(MODELS / "manual_attention.py")
    common = ["optimize", model, "--cluster", "dgx-h100", "--workload", "train"]
    rc = main([*common, "--seq-len", "32768", "--why"])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0 and "excluded: cp>1: the attention at manual_attention.py:" in out, out
    assert "written by hand" in out
    assert main([*common, "--seq-len", "64", "--cp", "2"]) == 0, capsys.readouterr().err


def test_a_sequence_first_model_is_told_why_context_parallelism_cannot_split_it(tmp_path) -> None:
    """nn.TransformerEncoder with batch_first=False takes its tokens as (T, B): --cp said "its layers see
    another sequence than the input's tokens", which they do not; the refusal names the layout and the fix
    (a helper's context-parallel probe)."""
    from planner.cli import workflow  # noqa: PLC0415

    path = tmp_path / "seqfirst.py"
    path.write_text(
        "import torch\n"
        "from torch import nn\n\n"
        "class Encoder(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = nn.Embedding(64, 32)\n"
        "        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=False)\n"
        "        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)\n"
        "        self.head = nn.Linear(32, 64)\n\n"
        "    def forward(self, tokens):\n"
        "        return self.head(self.enc(self.emb(tokens)))\n\n"
        "def build_model():\n"
        "    return Encoder()\n\n"
        "def example_inputs(batch_size=2, seq_len=64):\n"
        "    return (torch.randint(0, 64, (seq_len, batch_size)),)\n"
    )
    prepared = workflow.prepare(str(path), "train", batch_size=2, seq_len=64)
    with pytest.raises(InputError, match="sequence-first") as e:
        plan_model(prepared.structure, load_cluster("dgx-h100"), prepared.workload, Constraints(cp=2))
    assert "batch_first=True" in str(e.value) and "another sequence" not in str(e.value)


def test_ring_and_allgather_hold_the_runtimes_fp32_score_tiles() -> None:
    """On GPUs the runtime's ring and all-gather attention materialize the scores in fp32 a tile of
    `SCORE_TILE` x `SCORE_TILE` at a time (made the probabilities in place): one tile in a forward,
    two in a backward (the probabilities and their gradient), whatever the sequence. Llama-3-8B's heads
    on one TP-8 rank (4 query heads) at 32k tokens over CP 4: 4 x 1024 x 1024 x 4 bytes = 16 MiB a
    tile; the all-to-all (Ulysses) runs the fused kernel on whole heads and holds no scores."""
    tile = 4 * 4 * SCORE_TILE * SCORE_TILE
    forward, train = _cost(32768, 4, "ring"), _cost(32768, 4, "ring", backward=2.0)
    kv = forward.kv_block_bytes
    assert forward.buffer_bytes == pytest.approx(2 * kv + tile)
    assert train.buffer_bytes == pytest.approx(2 * kv * (1 + 4 / 2) + 2 * tile)  # fp32 dK/dV too
    assert _cost(32768, 4, "allgather").buffer_bytes == pytest.approx(4 * kv + tile)
    short = _cost(2048, 4, "ring")  # 512 tokens a rank: one (512, 512) block
    assert short.buffer_bytes == pytest.approx(2 * short.kv_block_bytes + 4 * 4 * 512 * 512)
    # CPU ranks run each block in torch's fused flash kernel for CPU, which holds no score block
    for kind, blocks in (("ring", 2), ("allgather", 2)):
        cpu = _cost(32768, 2, kind, cluster="local-cpu")
        assert cpu.buffer_bytes == pytest.approx(blocks * cpu.kv_block_bytes)
    shape = CpAttentionShape(1, 32, 8, 128, seq_len=32768, causal=True)  # whole heads for Ulysses
    ulysses = cp_attention_cost(
        shape, 4, "alltoall", True, load_cluster("dgx-h100"), Group(4, 4), "bf16", 0.0
    )
    q = 32 * (32768 / 4) * 128 * 2  # a rank's queries, bf16: q, out and K/V in flight, no scores
    assert ulysses.buffer_bytes == pytest.approx(2 * q + ulysses.kv_block_bytes)


def test_the_search_prices_cp_2_from_8k_tokens_and_more_degrees_from_16k() -> None:
    """CP 2 is a mesh axis of the search from 8,192 tokens (NeMo's Llama-3-8B recipe trains its 8k
    sequences at CP 2; the 405B at 8k on 16,384 H100s plans 5.40 s with it, 7.15 s without, where CP 2
    came only from the hand-written plan's fallback); more degrees from 16,384 tokens; none below 8k."""
    cluster, structure = load_cluster("dgx-h100"), analysed_llama("8b")

    def options(seq: int) -> list[int]:
        search = search_module._setup(
            structure, cluster, WorkloadSpec("train", 8, seq, dtype="bf16"), Constraints()
        )
        return search_module._cp_options(search, 8)

    assert options(4096) == [1]
    assert options(8192) == [1, 2]
    assert options(16384) == [1, 2, 4, 8]


def test_a_cp_plan_whose_pass_gathers_the_whole_sequence_is_planned_again_without_cp(monkeypatch) -> None:
    """Mixtral 8x7B at 8 x 32,768 tokens on h100-ib-2node: the search chose CP 2 at 4.3 s, and lowering
    added the CP pass's whole-sequence gather at the MoE block's `x.view(-1, C)` (+8.0 s): 12.3 s, 0.55x
    the torchtitan recipe. Such a plan is made again at cp 1 (TP 2 x DP 8, 4.6 s) and the faster kept,
    the other named in `excluded`; a CP plan without the gather, a pinned --cp, or a slower cp 1 plan
    leave the plan as it is."""
    from types import SimpleNamespace  # noqa: PLC0415

    from planner.cli import workflow  # noqa: PLC0415
    from planner.plan import Fallback, MeshShape  # noqa: PLC0415

    gather = Fallback(
        "aten.view (context parallelism: whole sequence gathered)",
        "moe.py:137 `x.view(-1, C)`",
        "view",
        1.0,
        8.0,
    )

    def plan(cp: int, latency_s: float, fallbacks=()) -> SimpleNamespace:
        mesh = MeshShape(2 if cp == 1 else 1, 1, 8, cp)
        return SimpleNamespace(cp=cp, mesh=mesh, fallbacks=list(fallbacks), excluded=[],
                               predicted=SimpleNamespace(latency_s=latency_s))  # fmt: skip

    asked = []

    def replan(latency_s: float):
        def plan_model(structure, cluster, workload, constraints, **kwargs):
            asked.append(constraints.cp)
            return plan(1, latency_s)

        monkeypatch.setattr(workflow, "plan_model", plan_model)
        monkeypatch.setattr(workflow, "_lower_keeping_whole", lambda prepared, p, *a, **k: (p, prepared))

    prepared = SimpleNamespace(structure=None, workload=None)
    replan(4.6)
    cp_plan = plan(2, 12.3, [gather])
    kept = workflow._replan_without_cp_gathers(prepared, cp_plan, None, Constraints(), "m.py")
    assert kept.cp == 1 and asked == [1]
    assert "cp=2: the CP pass gathers the whole sequence at aten.view at moe.py:137" in kept.excluded[0]
    assert "takes 12.300 s a step, this one 4.600 s" in kept.excluded[0]
    replan(13.0)
    assert workflow._replan_without_cp_gathers(prepared, cp_plan, None, Constraints(), "m.py") is cp_plan
    asked.clear()
    for unchanged, pins in ((plan(2, 4.3), Constraints()), (cp_plan, Constraints(cp=2))):
        assert workflow._replan_without_cp_gathers(prepared, unchanged, None, pins, "m.py") is unchanged
    assert asked == []

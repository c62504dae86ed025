"""Context parallelism run as the plan says it: the lowering (`passes.cp_lower`) on gloo ranks against
the unsharded model.

Two launches (2 gloo ranks, 4 gloo ranks) run the plan's own checked run (`runtime.execute.run_rank`:
outputs, MSE loss, every gradient after the dp x cp reduction, the first Adam step) for each layout in
turn. The model is tests/models/tiny_lm_tokens.py, the tiny Llama (4 layers, GQA, RoPE) fed random
tokens, so a rank that computed its tokens at the wrong positions would give other outputs (a few
jobs run other model files: Hugging Face Llama, DeepSeek-V3). One job of
the 2-rank launch runs with the loss's gradient on the rank's tokens left unscaled (the CP ranks'
partial gradients averaged, not summed: `runtime.loss.cp_grad_scaled`): its check must fail.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from unittest import mock

import pytest

from passes import context_parallel
from passes.cp_lower import CP_OUTPUT_SHARD, CpOutputShard, apply_context_parallel
from planner.errors import InputError
from planner.frontend.analysis import analyse
from planner.frontend.capture import capture
from planner.frontend.modelfile import load_model_file
from planner.plan import MeshShape
from runtime.execute import run_rank
from runtime.job import RunJob, summarise
from runtime.launch import RankContext, launch
from runtime.numerics import check_failures
from tests.cli_in_process import planner_in_process
from tests.plans import assert_run_matches, fixed_plan, meta_structure

MODELS = Path(__file__).resolve().parent / "models"
TOKENS = "tiny_lm_tokens.py"
SEQ = 64


def _plan(
    tp: int,
    cp: int,
    dp: int = 1,
    pp: int = 1,
    m: int = 1,
    workload: str = "train",
    seq: int = SEQ,
    batch: int = 2,
    **kw,
):
    model = str(MODELS / kw.pop("model", TOKENS))
    structure = meta_structure(model, batch, seq)
    plan = fixed_plan(structure, model, tp, pp=pp, workload=workload, micro_batches=m)
    return dataclasses.replace(plan, mesh=MeshShape(tp, pp, dp, cp), **kw)


def _job(plan, model: str = TOKENS) -> RunJob:
    return RunJob(
        str(MODELS / model), plan.to_dict(), batch_size=plan.batch_size, seq_len=plan.seq_len,
        workload=str(plan.workload), warmup=0, iters=1,
    )  # fmt: skip


def _unscaled(x, cp):
    return x  # wrong: the CP ranks' gradients averaged, not summed


def run_labelled(ctx: RankContext, jobs: list[tuple[str, RunJob, bool]]) -> dict:
    """Rank entry: run_rank for each (label, job, wrong) in turn; wrong runs the job with the loss's
    gradient on the rank's tokens unscaled."""
    out = {}
    for label, job, wrong in jobs:
        if wrong:
            with mock.patch("runtime.loss.cp_grad_scaled", _unscaled):
                out[label] = run_rank(ctx, job)
        else:
            out[label] = run_rank(ctx, job)
    return out


TWO_RANK = {  # label: plan kwargs (model: another model file than tiny_lm_tokens.py)
    "cp2_allgather": dict(tp=1, cp=2),
    "cp2_ring": dict(tp=1, cp=2, cp_comm_type="ring"),
    "cp2_alltoall": dict(tp=1, cp=2, cp_comm_type="alltoall"),
    "cp2_contiguous": dict(tp=1, cp=2, cp_comm_type="ring", cp_load_balance=False),
    "cp2_prefill": dict(tp=1, cp=2, workload="forward"),
    "cp2_pooled_fallback": dict(tp=1, cp=2, model="cp_pooled.py"),
    "cp2_hf_llama": dict(tp=1, cp=2, model="../../examples/hf_llama.py", seq=32),
    # DeepSeek-V3's latent attention: the latent (B, 1, T, r) into kv_b_proj keeps its token shard, and
    # values of another head dim than the keys' (16 against 24) go through the ring padded
    "cp2_ring_hf_deepseek_v3": dict(tp=1, cp=2, cp_comm_type="ring", model="hf_deepseek_v3.py", seq=16),
    # BERT: bidirectional, its traced mask lets every query see every key: run as no mask (it was refused
    # as "not the causal mask", with advice to make the encoder causal)
    "cp2_ring_hf_bert": dict(tp=1, cp=2, cp_comm_type="ring", model="hf_bert.py", seq=32),
}
FOUR_RANK = {
    "tp2_cp2": dict(tp=2, cp=2),
    "tp2_cp2_sp_ring": dict(tp=2, cp=2, cp_comm_type="ring", sequence_parallel=True),
    # the MLP behind `x.view(-1, C)` runs on the whole sequence; its output re-enters the sequence-
    # parallel stream as a piece of the rank's CP tokens (it was split first, then cut: output off by 0.48)
    "tp2_cp2_sp_flatten": dict(tp=2, cp=2, sequence_parallel=True, model="cp_flatten_mlp.py", seq=32),
    "tp2_cp2_prefill": dict(tp=2, cp=2, workload="forward"),
    "cp2_dp2_zero1": dict(tp=1, cp=2, dp=2, batch=4, dp_style="zero1", dp_shard=2),
    "pp2_cp2": dict(tp=1, cp=2, pp=2, m=2),
    "cp2_dp2_fsdp": dict(tp=1, cp=2, dp=2, batch=4, dp_style="fsdp", dp_shard=2),
}
WRONG = {"cp2_unscaled": dict(tp=1, cp=2)}


def _launch(layouts: dict, wrong: dict, nproc: int) -> dict:
    plans = {label: _plan(**kw) for label, kw in {**layouts, **wrong}.items()}
    models = {label: kw.get("model", TOKENS) for label, kw in {**layouts, **wrong}.items()}
    jobs = [(label, _job(plan, models[label]), label in wrong) for label, plan in plans.items()]
    reports = launch(run_labelled, jobs, nproc=nproc, timeout_s=600)
    return {label: (plans[label], summarise([r[label] for r in reports])) for label, *_ in jobs}


@pytest.fixture(scope="module")
def two_rank() -> dict:
    return _launch(TWO_RANK, WRONG, 2)


@pytest.fixture(scope="module")
def four_rank() -> dict:
    return _launch(FOUR_RANK, {}, 4)


@pytest.mark.slow
def test_cp2_matches_the_unsharded_model_for_every_variant(two_rank: dict) -> None:
    for label in TWO_RANK:
        assert_run_matches(label, *two_rank[label])


@pytest.mark.slow
def test_tp2_cp2_on_four_ranks_matches_the_unsharded_model(four_rank: dict) -> None:
    for label in FOUR_RANK:
        assert_run_matches(label, *four_rank[label])


@pytest.mark.slow
def test_an_op_over_the_whole_sequence_is_gathered_and_named(two_rank: dict) -> None:
    plan, summary = two_rank["cp2_pooled_fallback"]
    notes = " ".join(summary["measured"]["notes"])
    assert "gathered for ops without a rule: aten.mean" in notes, notes


@pytest.mark.slow
def test_unscaled_cp_gradients_fail_the_check(two_rank: dict) -> None:
    plan, summary = two_rank["cp2_unscaled"]
    failures = check_failures(summary["numerics"])
    assert any(line.startswith("gradients") for line in failures), failures


def test_the_pass_cuts_tokens_and_rope_and_replaces_attention() -> None:
    """Without process groups: what the rewrite did to the graph, by node (no fallback on the tiny
    Llama), and its local shapes."""
    model_file = load_model_file(MODELS / TOKENS)
    args, kwargs = model_file.inputs(2, SEQ)
    gm = capture(model_file.build("meta"), args, kwargs)
    done = apply_context_parallel(gm, 2, SEQ, "ring", True, training=True)
    assert done.inputs == ["tokens"] and len(done.attention) == 4 and not done.fallbacks
    assert done.gathered_outputs == 1 and len(done.sliced) == 3  # tokens, RoPE cos, RoPE sin
    # training's loss runs on the rank's tokens (`runtime.loss`): the logits stay cut, nothing gathered
    gm = capture(model_file.build("meta"), args, kwargs)
    kept = apply_context_parallel(gm, 2, SEQ, "ring", True, training=True, shard_output=True)
    assert kept.gathered_outputs == 0 and gm.meta[CP_OUTPUT_SHARD] == CpOutputShard(1, True)
    sdpa = [n for n in gm.graph.nodes if n.target is context_parallel.cp_sdpa]
    assert [tuple(n.meta["val"].shape) for n in sdpa] == [(2, 4, SEQ // 2, 8)] * 4
    assert sdpa[0].args[3:7] == ("cp", "ring", True, True)


def test_a_view_of_the_tokens_by_their_global_sizes_keeps_them_cut() -> None:
    """Hugging Face OPT views its token ids by their own sizes first (`input_ids.view(-1,
    input_ids.shape[-1])`): the cut ids were read at their local size and that view had no answer, so
    the CP pass gathered the whole sequence there and context parallelism split nothing ("had no
    attention to split") while its ring was priced."""

    import torch  # noqa: PLC0415

    class Viewed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = load_model_file(MODELS / TOKENS).build("meta")

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.inner(tokens.view(-1, tokens.shape[-1]))

    model_file = load_model_file(MODELS / TOKENS)
    args, kwargs = model_file.inputs(2, SEQ)
    gm = capture(Viewed(), args, kwargs)
    done = apply_context_parallel(gm, 2, SEQ, "ring", True)
    assert not done.fallbacks and len(done.attention) == 4, done.fallbacks


@pytest.mark.parametrize(
    ("seq", "cp", "balance", "needle"),
    [(12, 4, True, "12 is not a multiple of 8"), (18, 4, False, "18 is not a multiple of 4")],
)
def test_a_sequence_that_does_not_cut_evenly_is_refused(seq, cp, balance, needle) -> None:
    model_file = load_model_file(MODELS / TOKENS)
    gm = capture(model_file.build("meta"), *model_file.inputs(2, seq))
    with pytest.raises(InputError, match=needle):
        apply_context_parallel(gm, cp, seq, "allgather", balance)


def test_ulysses_with_heads_that_do_not_divide_is_refused() -> None:
    model_file = load_model_file(MODELS / TOKENS)
    gm = capture(model_file.build("meta"), *model_file.inputs(2, 32))
    with pytest.raises(
        InputError, match=r"4 query heads and 4 KV heads do not both divide by 8.*ring or allgather"
    ):
        apply_context_parallel(gm, 8, 32, "alltoall", False)


def test_verify_prices_a_cp_fallback_and_lowers_every_stage() -> None:
    """`passes.verify.verify_plan` lowers the ranks of every stage of replica 0 (cp sits between tp and
    pp in the rank order) and prices the pooled model's gather over the CP ranks."""
    from costmodels.cluster import load_cluster  # noqa: PLC0415
    from passes.verify import verify_plan  # noqa: PLC0415

    model_file = load_model_file(MODELS / "cp_pooled.py")
    gm = capture(model_file.build("meta"), *model_file.inputs(2, SEQ))
    structure = analyse(gm)
    plan = _plan(tp=1, cp=2, model="cp_pooled.py")
    checked = verify_plan(gm, structure, plan, load_cluster(str(MODELS / "fastlink.yaml"), nproc=2))
    (fallback,) = checked.fallbacks
    assert "aten.mean" in fallback.op and "context parallelism" in fallback.op, fallback
    assert fallback.bytes_gathered == 2 * SEQ * 320 * 4 and fallback.comm_s > 0  # (B, T, V) fp32 logits
    assert checked.predicted.latency_s > plan.predicted.latency_s
    staged = _plan(tp=1, cp=2, pp=2, m=2, model="cp_pooled.py")
    assert (
        len(
            verify_plan(gm, structure, staged, load_cluster(str(MODELS / "fastlink.yaml"), nproc=4)).fallbacks
        )
        == 1
    )


def test_a_moe_behind_a_token_flatten_is_priced_as_run_on_the_whole_sequence() -> None:
    """`x.view(-1, C)` before a mixture of experts (Mixtral, gpt-fast, HF) merges batch and sequence,
    which no CP rule keeps sharded: the pass gathers the sequence there and the whole MoE block (router,
    top-k, experts, shared expert, the view back) runs on every token on every CP rank until the
    residual add meets the stream's shard. The fallback names those ops (`Fallback.region`) and verify
    prices them: cp times the experts' work and, with EP, cp times the tokens exchanged. Before, it
    was priced as the gather alone, so CP looked cheaper than DP for such a model. A reduction over the
    tokens (the pooled model's mean) carries no sequence on: nothing more priced."""
    from costmodels.cluster import load_cluster  # noqa: PLC0415
    from passes.cp_lower import FALLBACK_META  # noqa: PLC0415
    from passes.verify import verify_plan  # noqa: PLC0415

    path = MODELS / "tiny_moe_gptfast.py"
    model_file = load_model_file(path)
    gm = capture(model_file.build("meta"), *model_file.inputs(2, 32))
    structure = analyse(gm)
    lowered = copy.deepcopy(gm)
    apply_context_parallel(lowered, 2, 32, "allgather", True)
    fallbacks = [n.meta[FALLBACK_META] for n in lowered.graph.nodes if FALLBACK_META in n.meta]
    assert fallbacks and all(f.op in ("aten.view", "aten.reshape") for f in fallbacks), fallbacks
    layer = structure.layers[0]
    first = next(f for f in fallbacks if f.node in layer.nodes)
    assert set(layer.moe.expert_nodes) <= set(first.region), set(layer.moe.expert_nodes) - set(first.region)
    assert any("topk" in name for name in first.region), first.region
    cluster = load_cluster(str(MODELS / "fastlink.yaml"), nproc=2)
    plan = fixed_plan(structure, str(path), 1, workload="train")
    for ep in (1, 2):
        cp_plan = dataclasses.replace(plan, mesh=MeshShape(1, 1, 1, 2), ep=ep, ep_fold="dp")
        checked = verify_plan(gm, structure, cp_plan, cluster)
        priced = [f for f in checked.fallbacks if "whole sequence on every CP rank" in f.op]
        assert priced, checked.fallbacks
        assert all(f.compute_s > 0 for f in priced), priced
        if ep == 2:
            assert all("token exchange carries cp x the tokens" in f.op for f in priced), priced
    pooled_file = load_model_file(MODELS / "cp_pooled.py")
    pooled = capture(pooled_file.build("meta"), *pooled_file.inputs(2, SEQ))
    (mean,) = verify_plan(pooled, analyse(pooled), _plan(tp=1, cp=2, model="cp_pooled.py"), cluster).fallbacks
    assert mean.compute_s == 0 and "whole sequence on every CP rank" not in mean.op, mean


def _run_emitted_cp(ctx: RankContext, folder: str) -> dict:
    """This rank's emitted CP module (cp=2: the world is the CP group), run as a user's program would."""
    import torch.distributed as dist  # noqa: PLC0415

    from passes import collectives  # noqa: PLC0415
    from passes.emit import load_rank_module  # noqa: PLC0415

    collectives.register_group("tp", None)
    collectives.register_group("cp", dist.group.WORLD)
    module = load_rank_module(folder, ctx.rank, ctx.device)
    (tokens,) = load_model_file(MODELS / TOKENS).inputs(2, SEQ)[0]
    return {"output": module(tokens).detach()}


@pytest.mark.slow
def test_emitted_cp_modules_compute_the_unsharded_output(tmp_path) -> None:
    import json  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from planner.cli.emitting import emit_plan  # noqa: PLC0415

    plan = _plan(tp=1, cp=2, workload="forward")
    folder = emit_plan(plan, str(MODELS / TOKENS), str(tmp_path / "emitted"))
    assert [json.loads((folder / f"rank{r}" / "meta.json").read_text())["cp_rank"] for r in (0, 1)] == [0, 1]
    assert "## Context parallelism" in (folder / "README.md").read_text()
    outs = launch(_run_emitted_cp, str(folder), nproc=2, timeout_s=300)
    model_file = load_model_file(MODELS / TOKENS)
    torch.manual_seed(0)
    model = model_file.build("cpu")
    with torch.no_grad():
        want = model(*model_file.inputs(2, SEQ)[0])
    for out in outs:
        assert torch.allclose(out["output"], want, atol=1e-5), float((out["output"] - want).abs().max())


MASKED = """
import torch
import torch.nn.functional as F


class Masked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, tokens):
        b, t = tokens.shape
        q, k, v = self.qkv(self.emb(tokens)).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
        i = torch.arange(t, device=tokens.device)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - WINDOW)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, 32)


def build_model():
    return Masked()


def example_inputs(batch_size=2, seq_len=16):
    return (torch.randint(0, 64, (batch_size, seq_len), generator=torch.Generator().manual_seed(0)),)
"""


@pytest.mark.parametrize(("window", "refused"), [(10**6, False), (4, True)])
def test_an_explicit_mask_runs_as_causal_only_when_it_is_the_causal_one(tmp_path, window, refused) -> None:
    """Hugging Face builds the causal mask explicitly when traced: a constant mask equal to the causal
    one runs as is_causal; a sliding window (another constant mask) is refused by name, its window
    given (it said "not the causal mask" alone: Mistral's and Gemma's users could not tell why)."""
    path = tmp_path / "masked.py"
    path.write_text(MASKED.replace("WINDOW", str(window)))
    model_file = load_model_file(path)
    gm = capture(model_file.build("meta"), *model_file.inputs(2, 16))
    if refused:
        with pytest.raises(
            InputError, match=r"a sliding-window causal mask \(each query sees its last 4 keys"
        ):
            apply_context_parallel(gm, 2, 16, "allgather", True)
    else:
        done = apply_context_parallel(gm, 2, 16, "allgather", True)
        (sdpa,) = [n for n in gm.graph.nodes if n.target is context_parallel.cp_sdpa]
        assert sdpa.args[5] is True and len(done.attention) == 1


@pytest.mark.parametrize(
    ("mask", "said"),
    [
        ("mask_in", "depends on the model input 'mask_in', so its pattern is known only when the model runs"),
        (
            "alibi",
            "depends on the tensor 'lifted_tensor_0' (a buffer, or a torch.tensor(...) made in forward",
        ),
    ],
)
def test_a_mask_whose_values_planning_cannot_see_is_refused_saying_why(tmp_path, mask, said) -> None:
    """A causal mask passed in as an input was refused as "(a padding mask)"; an ALiBi bias from slopes
    made with torch.tensor in forward as "could not be evaluated (RuntimeError)" (a meta tensor, as
    planning builds the model). Each refusal now says what the mask depends on and why it is unknown."""
    source = MASKED.replace("WINDOW", "4")
    if mask == "mask_in":
        source = source.replace("def forward(self, tokens):", "def forward(self, tokens, mask_in):")
        source = source.replace("attn_mask=mask)", "attn_mask=mask_in)")
        source = source.replace(
            "return (torch.randint(0, 64, (batch_size, seq_len), generator=torch.Generator().manual_seed(0)),)",
            "return (torch.randint(0, 64, (batch_size, seq_len), generator=torch.Generator().manual_seed(0)), "
            "torch.ones(seq_len, seq_len, dtype=torch.bool).tril())",
        )
    else:
        source = source.replace(
            "        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 4)",
            "        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=tokens.device)\n"
            "        mask = slopes[:, None, None] * (i[None, :] - i[:, None]).clamp(max=0)",
        )
    path = tmp_path / "masked.py"
    path.write_text(source)
    model_file = load_model_file(path)
    gm = capture(model_file.build("meta"), *model_file.inputs(2, 16))
    with pytest.raises(InputError) as refused:
        apply_context_parallel(gm, 2, 16, "allgather", True)
    assert said in " ".join(str(refused.value).split()), refused.value


@pytest.mark.parametrize("sp", [False, True])
def test_tp_and_cp_together_gather_nothing(sp: bool) -> None:
    """After the TP pass, RoPE's chunk over the head dim (a tuple-valued op) keeps the sequence shard:
    no CP fallback at TP2 x CP2, with or without sequence parallelism."""
    from passes.lower import lower_for_rank  # noqa: PLC0415

    plan = _plan(tp=2, cp=2, sequence_parallel=sp)
    model_file = load_model_file(MODELS / TOKENS)
    gm = capture(model_file.build("meta"), *model_file.inputs(2, SEQ))
    lowered = lower_for_rank(gm, analyse(gm), plan, 0, training=True)
    assert lowered.context_parallel.fallbacks == [] and len(lowered.context_parallel.attention) == 4


def test_sequence_parallelism_after_a_whole_sequence_region_splits_the_ranks_cp_tokens() -> None:
    """tests/models/cp_flatten_mlp.py's MLP flattens the tokens, so under CP it runs on the whole
    sequence (a gathered fallback). Under sequence parallelism the TP pass then splits its output
    along the tokens (`tp_shard`, or `tp_reduce_scatter`), and the CP pass cut that split to the rank's
    positions: the tp-th of the whole sequence, then cut, is not a piece of the rank's tokens (the
    output was off by 0.48, a plan the search picks itself). The whole sequence is cut to the rank's
    tokens first now, then split."""
    from passes import collectives  # noqa: PLC0415
    from passes.lower import lower_for_rank  # noqa: PLC0415

    plan = _plan(tp=2, cp=2, sequence_parallel=True, model="cp_flatten_mlp.py", seq=32)
    model_file = load_model_file(MODELS / "cp_flatten_mlp.py")
    gm = capture(model_file.build("meta"), *model_file.inputs(2, 32))
    lowered = lower_for_rank(gm, analyse(gm), plan, 0, training=True).module
    splits = [
        n for n in lowered.graph.nodes if n.target in (collectives.tp_shard, collectives.tp_reduce_scatter)
    ]
    after_whole = [n for n in splits if n.args[0].target is context_parallel.cp_slice]
    assert len(after_whole) == 2, [(n.name, n.args[0].name) for n in splits]  # one per layer's MLP
    assert not [
        n for n in lowered.graph.nodes if n.target is context_parallel.cp_slice and n.args[0] in splits
    ]


@pytest.mark.slow
def test_planner_run_reads_the_model_path_from_the_plan(tmp_path) -> None:
    """`planner run PLAN.yaml` without --model runs the plan's own model file (a CP plan here)."""

    plan = _plan(tp=1, cp=2, workload="forward", seq=16)
    plan.to_yaml(tmp_path / "p.yaml")
    done = planner_in_process("run", str(tmp_path / "p.yaml"), "--nproc", "2", "--iters", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "context parallelism applied" in done.stdout


def test_cps_whole_sequence_gathers_are_not_taken_for_tp_head_split_failures() -> None:
    """A hand-written attention core (tests/models/manual_attention.py: q @ k^T, masked softmax, p @ v)
    at TP 2 x CP 2 with --layout megatron: the CP pass gathers the whole sequence at the core (no CP
    kernel for it), and the planner read those gathers as the TP pass failing to split the core by
    heads, refusing the layout (exit 3, "have no head-parallel rule"), though TP alone splits it. Only
    the TP pass's own gathers decide that now: the plan keeps the core split by heads."""
    from costmodels.cluster import load_cluster  # noqa: PLC0415
    from planner.cli.workflow import constraints_from, make_plan, prepare  # noqa: PLC0415

    path = str(MODELS / "manual_attention.py")
    prepared = prepare(path, "train")
    constraints = dataclasses.replace(
        constraints_from(2, None, None, "none", max_devices=4, layout="megatron"), cp=2
    )
    plan = make_plan(prepared, load_cluster("local-cpu", nproc=4), constraints, path)
    cores = {c.strategy.get("core") for c in plan.predicted.per_layer if c.layer >= 0}
    assert plan.cp == 2 and cores == {"head"}, cores
    assert any(f.context_parallel for f in plan.fallbacks)  # the CP gathers are there, priced

"""planner.frontend.moe: mixture-of-experts blocks recognised with their roles (router, routed experts,
shared experts, combine) in the three ways experts are written - Hugging Face Mixtral's stacked 3-D
parameters (batched_mm), a ModuleList of expert MLPs with a shared expert, gpt-fast's stacked weights
indexed by the expert ids - and what the planner does with them: the router and the experts stay
replicated under tensor parallelism, a block whose experts cannot be found warns and is planned dense,
and a model the planner cannot capture or run is refused in one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM

from costmodels.cluster import load_cluster
from passes import expert_parallel
from planner.cli.workflow import constraints_from, make_plan, prepare
from planner.errors import InputError
from planner.frontend.analysis import ModelStructure, Role, analyse
from planner.frontend.capture import capture
from planner.frontend.depth import capture_for_planning
from planner.frontend.moe import ScoreFunction
from planner.solver.problem import Constraints, Workload, WorkloadSpec
from planner.solver.search import plan_model
from tests.cli_in_process import planner_in_process
from tests.models import tiny_mixtral, tiny_moe_gptfast, tiny_moe_modulelist

MODELS = Path(__file__).parent / "models"
FASTLINK = str(MODELS / "fastlink.yaml")


@pytest.fixture(scope="module")
def prepared():
    """prepared("tiny_mixtral") -> the planner's `Prepared` of tests/models/<name>.py, cached."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = prepare(str(MODELS / f"{name}.py"), "forward")
        return cache[name]

    return get


def _tp2_plan(prepared, name: str):
    return make_plan(
        prepared(name),
        load_cluster(FASTLINK, nproc=2),
        constraints_from(2, None, None, "none"),
        str(MODELS / f"{name}.py"),
    )


def _expected_active(s: ModelStructure) -> int:
    return s.num_params - sum(
        (layer.moe.num_experts - layer.moe.top_k) * layer.moe.params_per_expert for layer in s.layers
    )


def test_hf_mixtral_router_and_stacked_experts(prepared):
    """Mixtral's `mlp.gate` is the router (softmax, top-2 of 4) and its stacked `experts.gate_up_proj`
    (4, 256, 64) / `experts.down_proj` (4, 64, 128) are the experts, gate and up fused, not an MLP."""
    s = prepared("tiny_mixtral").structure
    for layer in s.layers:
        moe, prefix = layer.moe, f"model.layers.{layer.index}.mlp"
        assert layer.mlp is None and moe is not None
        assert (moe.module_path, moe.router.weight, moe.router.role) == (
            prefix,
            f"{prefix}.gate.weight",
            Role.ROUTER,
        )
        assert (moe.num_experts, moe.top_k, moe.score_function) == (4, 2, ScoreFunction.SOFTMAX)
        assert [(w.role, w.weights, w.stacked) for w in moe.experts] == [
            (Role.EXPERT_GATE_UP, [f"{prefix}.experts.gate_up_proj"], True),
            (Role.EXPERT_DOWN, [f"{prefix}.experts.down_proj"], True),
        ]
        gate_up, down = moe.experts
        assert (gate_up.in_features, gate_up.out_features, gate_up.weight_out_dim, gate_up.parts) == (
            64,
            256,
            0,
            (128, 128),
        )
        assert (down.in_features, down.out_features, down.weight_out_dim) == (128, 64, 0)
        assert (moe.hidden_size, moe.expert_intermediate_size, moe.shared, moe.shared_intermediate_size) == (
            64,
            128,
            [],
            0,
        )
        assert moe.combine_node in moe.expert_nodes and moe.dispatch_nodes and moe.weight_gather_nodes
        assert all(layer.node_blocks[n] == "experts" for n in moe.expert_nodes)
        assert layer.node_blocks[moe.router.node] == "stream"
        # all 4 experts held, 2 run per token: 98,304 expert elements per layer, 49,152 active
        assert moe.expert_params == 4 * (256 * 64 + 64 * 128) and moe.active_expert_params == 2 * (
            256 * 64 + 64 * 128
        )
        assert layer.num_params - layer.active_params == 2 * (256 * 64 + 64 * 128)
    assert s.active_params == _expected_active(s) < s.num_params
    assert "transformers.grouped_mm_fallback" not in s.unknown_ops


def test_hf_mixtral_tp2_plan_names_router_and_experts_and_splits_neither(prepared):
    """The plan's roles read router / expert_gate_up / expert_down; no split names them (each rank
    routes its own tokens with the whole router and runs every expert); attention is still head-split."""
    plan = _tp2_plan(prepared, "tiny_mixtral")
    assert plan.tp == 2
    assert plan.roles["model.layers.0.mlp.gate.weight"] == "router"
    assert plan.roles["model.layers.0.mlp.experts.gate_up_proj"] == "expert_gate_up"
    assert plan.roles["model.layers.1.mlp.experts.down_proj"] == "expert_down"
    assert not [w for w in plan.splits if ".mlp." in w]
    assert plan.splits["model.layers.0.self_attn.q_proj.weight"].style.value == "colwise"
    # model FLOPs count the active experts: 2 x tokens x top_k x (256 x 64 + 64 x 128) per layer, not E
    tokens = plan.batch_size * plan.seq_len
    assert plan.predicted.model_flops >= 2 * 2.0 * tokens * 2 * (256 * 64 + 64 * 128)


def test_modulelist_experts_and_shared_expert(prepared):
    """8 expert MLPs in a ModuleList (`mlp.experts.<i>.gate_proj` ...) are the routed experts, each
    projection's role expert_gate / expert_up / expert_down; the shared expert is the layer's dense MLP
    (gate / up / down), listed in `MoE.shared`."""
    s = prepared("tiny_moe_modulelist").structure
    for layer in s.layers:
        moe, prefix = layer.moe, f"layers.{layer.index}.mlp"
        assert moe is not None and (moe.num_experts, moe.top_k, moe.score_function) == (
            8,
            2,
            ScoreFunction.SOFTMAX,
        )
        assert moe.router.weight == f"{prefix}.gate.weight"
        assert [w.role for w in moe.experts] == [Role.EXPERT_GATE, Role.EXPERT_UP, Role.EXPERT_DOWN]
        assert moe.experts[0].weights == [f"{prefix}.experts.{i}.gate_proj.weight" for i in range(8)]
        assert all(not w.stacked and len(w.nodes) == 8 for w in moe.experts)
        assert [(p.weight, p.role) for p in moe.shared] == [
            (f"{prefix}.shared_expert.{name}_proj.weight", role)
            for name, role in (("gate", Role.GATE), ("up", Role.UP), ("down", Role.DOWN))
        ]
        assert layer.mlp.projections == moe.shared and layer.mlp.residual_add
        assert (moe.expert_intermediate_size, moe.shared_intermediate_size) == (24, 48)
        assert layer.node_blocks[moe.combine_node] == "experts"
    assert s.active_params == _expected_active(s) == s.num_params - 2 * 6 * 3 * 32 * 24


def test_modulelist_tp2_plan_splits_the_shared_expert_not_the_routed_ones(prepared):
    plan = _tp2_plan(prepared, "tiny_moe_modulelist")
    assert plan.roles["layers.0.mlp.gate.weight"] == "router"
    assert plan.roles["layers.0.mlp.experts.5.down_proj.weight"] == "expert_down"
    assert plan.roles["layers.1.mlp.shared_expert.gate_proj.weight"] == "gate"
    assert not [w for w in plan.splits if ".mlp.gate." in w or ".experts." in w]


def test_a_shared_expert_gate_of_one_output_per_token_is_kept_whole(prepared):
    """Qwen2-MoE's `shared_expert_gate` (H -> 1, a sigmoid of it scaling the shared expert's output) is a
    per-token scalar gate (`Role.TOKEN_GATE`), not a second SwiGLU gate: the shared expert stays a
    three-projection MLP, split as Megatron-Core splits it (gate and up column-wise, down row-wise),
    and the scalar gate is kept whole and priced with the stream, as Megatron-Core keeps its
    shared-expert gate weight. It was read as a second gate: the MLP a four-link chain, the scalar
    gate split row-wise (an all-reduce of a (tokens, 1) partial per layer)."""
    s = prepared("tiny_moe_shared_gate").structure
    for layer in s.layers:
        prefix = f"layers.{layer.index}.mlp"
        assert [(p.weight, p.role) for p in layer.token_gates] == [
            (f"{prefix}.shared_expert_gate.weight", Role.TOKEN_GATE)
        ]
        assert [p.role for p in layer.mlp.projections] == [Role.GATE, Role.UP, Role.DOWN]
        assert layer.moe.shared_expert_gate and layer.moe.shared_intermediate_size == 48
        assert layer.node_blocks[layer.token_gates[0].node] == "stream"
    plan = _tp2_plan(prepared, "tiny_moe_shared_gate")
    assert plan.roles["layers.1.mlp.shared_expert_gate.weight"] == "token_gate"
    styles = {w: str(split.style) for w, split in plan.splits.items()}
    assert "layers.1.mlp.shared_expert_gate.weight" not in styles
    assert [styles[f"layers.1.mlp.shared_expert.{n}_proj.weight"] for n in ("gate", "up", "down")] == [
        "colwise",
        "colwise",
        "rowwise",
    ]


def test_gptfast_stacked_einsum_experts(prepared):
    """gpt-fast's w1 / w3 / w2 (E, I, C), (E, I, C), (E, C, I), indexed by the top-k ids and applied by
    einsum: gate / up / down, (out, in) per expert; the einsums are priced as matmuls."""
    s = prepared("tiny_moe_gptfast").structure
    moe = s.layers[1].moe
    prefix = "layers.1.block_sparse_moe"
    assert (moe.num_experts, moe.top_k, moe.router.weight) == (4, 2, f"{prefix}.gate.weight")
    assert [(w.role, w.weights[0], w.in_features, w.out_features, w.weight_out_dim) for w in moe.experts] == [
        (Role.EXPERT_GATE, f"{prefix}.cond_ffn.w1", 32, 48, 0),
        (Role.EXPERT_UP, f"{prefix}.cond_ffn.w3", 32, 48, 0),
        (Role.EXPERT_DOWN, f"{prefix}.cond_ffn.w2", 48, 32, 0),
    ]
    assert all(s.node_costs[n].kind == "matmul" and s.node_costs[n].known for n in moe.gemm_nodes)


def test_deepseek_style_sigmoid_bias_and_group_limited_routing():
    """Sigmoid scores, a selection bias of E elements and a top-k over 4 groups of 2 experts before
    the top-2: the router, its score function, its bias and its group limit are found."""
    options = tiny_moe_gptfast.MoEOptions(
        num_experts=8, score_func="sigmoid", expert_bias=True, groups=4, topk_groups=2
    )
    with torch.device("meta"):
        model = tiny_moe_gptfast.build_model(options)
    moe = analyse(capture(model, tiny_moe_gptfast.example_inputs())).layers[0].moe
    assert (moe.num_experts, moe.top_k, moe.score_function) == (8, 2, ScoreFunction.SIGMOID)
    assert moe.selection_bias == "layers.0.block_sparse_moe.expert_bias"
    assert (moe.num_groups, moe.topk_groups) == (4, 2)


def test_a_deep_moe_model_is_extended_with_each_layers_own_expert_names():
    """Planning traces 2 of 8 layers (`capture_for_planning`): the copies' routers and experts carry their
    own layer's names, and the experts' ModuleList is not taken for the model's depth."""
    config = tiny_moe_gptfast.CONFIG
    with torch.device("meta"):
        model = tiny_moe_gptfast.MoETransformer(
            type(config)(**{**config.__dict__, "n_layers": 8}), tiny_moe_gptfast.MoEOptions()
        )
    _, s = capture_for_planning(model, tiny_moe_gptfast.example_inputs(), {})
    moe = s.layers[7].moe
    assert len(s.layers) == 8 and moe.router.weight == "layers.7.block_sparse_moe.gate.weight"
    assert moe.experts[0].weights == ["layers.7.block_sparse_moe.cond_ffn.w1"] and s.layers[7].routers == [
        moe.router
    ]
    with torch.device("meta"):
        listed = tiny_moe_modulelist.build_model()
    _, s = capture_for_planning(listed, tiny_moe_modulelist.example_inputs(), {})
    assert all(layer.moe is not None and len(layer.moe.experts[0].weights) == 8 for layer in s.layers)


class _UnnamedExperts(nn.Module):
    """A top-2 router over 2 experts that are plain attributes (`first`, `second`), not a numbered
    ModuleList, combined by a scattered weight matrix: the experts cannot be recognised."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 2, bias=False)
        self.first = nn.Linear(16, 16, bias=False)
        self.second = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(-1)  # (B, T, 2)
        weights, chosen = torch.topk(probs, 1, dim=-1)  # (B, T, 1)
        combine = torch.zeros_like(probs).scatter(-1, chosen, weights)  # (B, T, 2)
        return x + self.first(x) * combine[..., :1] + self.second(x) * combine[..., 1:]


def test_unrecognised_experts_warn_naming_the_block_and_plan_dense():
    model = nn.Sequential(_UnnamedExperts(), _UnnamedExperts())
    gm = capture(model, (torch.randn(2, 4, 16),))
    with pytest.warns(
        UserWarning, match=r"^\d: a top-1 router \(\d\.router\.weight\) picks among 2 experts"
    ) as caught:
        s = analyse(gm)
    said = [str(w.message) for w in caught]
    assert [m.split(":")[0] for m in said] == ["0", "1"]  # each block named by its module path
    assert (
        "experts were not recognised (the routed projection 0.first.weight is under no numbered module)"
        in said[0]
    )
    assert "planned as a dense model" in said[0]
    assert [layer.moe for layer in s.layers] == [None, None]
    assert [p.role for p in s.layers[0].routers] == [Role.ROUTER]


def _one_line_refusal(model: nn.Module, args: tuple, kwargs: dict | None = None) -> str:
    with pytest.raises(InputError) as info:
        capture(model, args, kwargs)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_hf_grouped_mm_experts_histc_is_refused_in_one_line():
    """transformers' default (grouped_mm) experts, built on meta, count tokens per expert with
    torch.histc on int32, which no CPU kernel runs: the rank died with a 20-line traceback."""
    with torch.device("meta"):
        model = MixtralForCausalLM(MixtralConfig(**tiny_mixtral.CONFIG, attn_implementation="sdpa")).eval()
    message = _one_line_refusal(model, tiny_mixtral.example_inputs(), tiny_mixtral.example_kwargs())
    assert "aten.histc on an integer (int32) tensor at model.layers.0.mlp.experts" in message
    assert 'experts_implementation="batched_mm"' in message


def test_hf_eager_experts_loop_is_refused_in_one_line():
    with torch.device("meta"):
        config = MixtralConfig(
            **tiny_mixtral.CONFIG, attn_implementation="sdpa", experts_implementation="eager"
        )
        model = MixtralForCausalLM(config).eval()
    message = _one_line_refusal(model, tiny_mixtral.example_inputs(), tiny_mixtral.example_kwargs())
    assert (
        "transformers' eager loop (modeling_mixtral.py:" in message
        and 'experts_implementation="batched_mm"' in message
    )


def test_a_data_dependent_dispatch_is_refused_in_one_line_naming_the_construct():
    """`torch.nonzero` per expert captures with unbacked sizes, which analysis cannot price: refused,
    naming the op, the model line and the static-shape ways to write it."""
    with torch.device("meta"):
        model = tiny_moe_modulelist.build_model("nonzero")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        message = _one_line_refusal(model, tiny_moe_modulelist.example_inputs())
    assert "aten.nonzero" in message and "tiny_moe_modulelist.py:" in message
    assert "known only at run time" in message and "fixed capacity" in message


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["tiny_mixtral", "tiny_moe_modulelist", "tiny_moe_gptfast", "tiny_moe_shared_gate"]
)
def test_moe_models_run_at_tp2_and_match(tmp_path, name):
    """`planner optimize --tp 2 --run` on 2 gloo ranks: attention (and a shared expert) split, router
    and routed experts replicated; the outputs match the unsharded model's."""
    report = tmp_path / "report.json"
    r = planner_in_process(
        "optimize", str(MODELS / f"{name}.py"), "--cluster", str(MODELS / "midlink-cpu.yaml"), "--tp", "2",
        "--nproc", "2", "--run", "--iters", "1", "--min-time", "0", "--json", str(report), cwd=MODELS.parent.parent,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(report.read_text())
    assert data["plan"]["tp"] == 2
    assert data["numerics"]["max_abs_diff"] <= data["numerics"]["outputs"][0]["tolerance"]


def test_a_capacity_counted_over_the_batch_keeps_the_tokens_whole(monkeypatch) -> None:
    """GShard-style capacity (TINY_MOE_CAPACITY_FACTOR=2: 16 slots per expert for the batch's 32 tokens):
    which tokens are dropped depends on every token counted, so the halves of the batch compute other
    outputs than the whole (the fault is real). The analysis finds the running count and its cap,
    naming the model line; the search then keeps one replica and one micro-batch and no expert or
    context parallelism (the EP dispatch is dropless), and refuses --dp 2, --ep 2 and --cp 2 in one
    line each. With one sample the count runs along the sequence: the batch is not mixed, CP still
    refused. At the dropless default (C = N) the same cumsum is not a capacity and nothing is kept whole."""
    monkeypatch.setenv("TINY_MOE_CAPACITY_FACTOR", "2")
    model = tiny_moe_modulelist.build_model()
    (tokens,) = tiny_moe_modulelist.example_inputs()
    with torch.no_grad():
        halves = torch.cat([model(tokens[:1]), model(tokens[1:])])
        assert (model(tokens) - halves).abs().max() > 1e-3
    with torch.device("meta"):
        meta = tiny_moe_modulelist.build_model()
    _, s = capture_for_planning(meta, tiny_moe_modulelist.example_inputs(), {})
    assert len(s.token_capacity) == 1 and s.batch_mixing == s.token_capacity
    why = s.token_capacity[0]
    assert "aten.cumsum" in why and "tiny_moe_modulelist.py:" in why and "the batch's 32 tokens" in why
    assert "capacity of 16" in why
    cluster = load_cluster(FASTLINK, nproc=4)
    work = WorkloadSpec(Workload.FORWARD, 2, 16)
    plan = plan_model(s, cluster, work, Constraints(max_devices=4))
    assert plan.mesh.dp == 1 and plan.micro_batches == 1 and plan.ep == 1
    assert any(e.startswith("ep>1: aten.cumsum") for e in plan.excluded), plan.excluded
    for pin in (dict(dp=2), dict(ep=2, tp=2)):
        with pytest.raises(InputError, match="capacity of 16"):
            plan_model(s, cluster, work, Constraints(max_devices=4, **pin))
    _, one = capture_for_planning(meta, tiny_moe_modulelist.example_inputs(1, 16), {})
    assert (
        one.token_capacity and not one.batch_mixing and "each sequence's 16 tokens" in one.token_capacity[0]
    )
    with pytest.raises(InputError, match="--cp 2: .*capacity of 8.*context-parallel rank"):
        plan_model(one, cluster, WorkloadSpec(Workload.TRAIN, 1, 16), Constraints(max_devices=4, cp=2))
    monkeypatch.delenv("TINY_MOE_CAPACITY_FACTOR")
    with torch.device("meta"):
        dropless = tiny_moe_modulelist.build_model()
    _, s = capture_for_planning(dropless, tiny_moe_modulelist.example_inputs(), {})
    assert not s.token_capacity and not s.batch_mixing


@pytest.mark.slow
def test_a_capacity_model_runs_the_plan_it_gets(tmp_path) -> None:
    """The capped model (TINY_MOE_CAPACITY_FACTOR=2) planned and run on 2 gloo ranks from the command
    line: the plan keeps the batch whole and its run matches the unsharded model (it was planned DP 2
    and failed its own numerics check, 0.0047 over a tolerance of 3.9e-5); --dp 2 is refused with exit 2
    naming the capacity."""
    env = {**os.environ, "TINY_MOE_CAPACITY_FACTOR": "2"}
    model = str(MODELS / "tiny_moe_modulelist.py")
    report = tmp_path / "report.json"

    def run(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "planner.cli", "optimize", model, "--cluster", "local-cpu", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)

    r = run("--devices", "2", "--run", "--iters", "1", "--min-time", "0", "--json", str(report))
    assert r.returncode == 0, r.stderr
    data = json.loads(report.read_text())
    assert data["plan"]["dp"] == 1 and data["plan"]["ep"] == 1
    assert all(o["max_abs_diff"] <= o["tolerance"] for o in data["numerics"]["outputs"])
    r = run("--devices", "2", "--dp", "2")
    assert r.returncode == 2 and "capacity of 16" in r.stderr and "use --dp 1" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("variant", "reason"),
    [
        (dict(bias=True), r"the experts' projections have biases"),
        (dict(scale=0.5), r"the experts' outputs go through aten.mul \(tiny_moe_modulelist.py:\d+"),
    ],
)
def test_experts_ep_would_not_compute_are_kept_whole(variant, reason) -> None:
    """Expert parallelism lowers each block to bias-free SwiGLU experts weighed by the routing weights;
    experts with biases or an extra op (here a constant scale) would lose them (the run's numerics
    failed, the search chose EP on its own and the exports wrote it). The analysis says why
    (`MoE.not_lowerable`), the search keeps EP off and says so, a pinned --ep is refused, and the pass
    itself refuses. Plain SwiGLU experts (top-1 or top-2) stay lowerable."""
    from passes.ep_lower import apply_expert_parallel  # noqa: PLC0415

    inputs = tiny_moe_modulelist.example_inputs()
    with torch.device("meta"):
        plain, odd = tiny_moe_modulelist.build_model(top_k=1), tiny_moe_modulelist.build_model(**variant)
    assert all(layer.moe.not_lowerable == "" for layer in capture_for_planning(plain, inputs, {})[1].layers)
    _, s = capture_for_planning(odd, inputs, {})
    assert all(re.match(reason, layer.moe.not_lowerable) for layer in s.layers), s.layers[0].moe.not_lowerable
    work = WorkloadSpec("train", 64, 16, dtype="bf16")
    plan = plan_model(s, load_cluster("dgx-h100"), work, Constraints())
    assert plan.ep == 1 and any(e.startswith("ep>1: the experts") for e in plan.excluded), plan.excluded
    with pytest.raises(InputError, match=rf"--ep 2: {reason}.*use --ep 1"):
        plan_model(s, load_cluster("dgx-h100"), work, Constraints(ep=2))
    gm = capture(odd, inputs, {})
    with pytest.raises(InputError, match=rf"expert parallelism: {reason}.*plan it with --ep 1"):
        apply_expert_parallel(gm, analyse(gm), 2, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_router_computed_in_fp32_is_found_in_bf16(dtype):
    """DeepSeek-V3's router reads `F.linear(x.type(torch.float32), self.weight.type(torch.float32))`: an
    fp32 capture drops the casts as no-ops, a bf16 one keeps `_to_copy` on the weight, and the router was
    not a projection there: every MoE layer of the model planned in bf16 (as it trains) was dense."""
    from tests.models import hf_deepseek_v3  # noqa: PLC0415

    model = hf_deepseek_v3.build_model().to("meta").to(dtype)
    structure = analyse(capture(model, hf_deepseek_v3.example_inputs(), hf_deepseek_v3.example_kwargs()))
    routers = [layer.moe.router.weight if layer.moe else None for layer in structure.layers]
    assert routers == [f"model.layers.{i}.mlp.gate.weight" for i in range(2)], routers
    assert all(layer.moe.not_lowerable == "" and layer.moe.top_k == 2 for layer in structure.layers)


def test_experts_reading_tokens_scaled_by_the_routing_weights_are_lowered_with_the_scale_on_their_inputs():
    """Llama 4 scales each token by its routing score before the experts (every expert on every token,
    the score 0 for those it did not choose) and sums their outputs unweighted: the block is lowerable
    with that scale (`MoE.input_scale`, E x N elements), which the expert pass applies to the chosen
    experts' input rows (weighing their outputs instead computed other outputs: 0.058 off at TP 2; the
    runs are in tests/test_ep_run.py). A scale that is not 0 for an expert a token did not choose is
    refused when the pass reads it: every expert would count."""
    from tests.models import hf_llama4  # noqa: PLC0415

    model = hf_llama4.build_model().to("meta")
    structure = analyse(capture(model, hf_llama4.example_inputs(), hf_llama4.example_kwargs()))
    blocks = [layer.moe for layer in structure.layers if layer.moe is not None]
    assert len(blocks) == 2 and all(m.not_lowerable == "" and m.input_scale for m in blocks)
    tokens = 2 * 16
    scale = torch.zeros(4, tokens)  # (E, N), expert-major as Llama 4 lays it out
    ids = torch.tensor([[t % 4] for t in range(tokens)])
    scale[ids[:, 0], torch.arange(tokens)] = torch.rand(tokens)
    chosen = expert_parallel.input_scale_weights(scale.reshape(-1, 1), ids, 4)
    assert torch.equal(chosen[:, 0], scale[ids[:, 0], torch.arange(tokens)])
    scale[(ids[:, 0] + 1) % 4, torch.arange(tokens)] = 0.5  # a softmax over all experts, say
    with pytest.raises(RuntimeError, match="did not choose"):
        expert_parallel.input_scale_weights(scale.reshape(-1, 1), ids, 4, "layers.0")


def test_a_router_that_picks_experts_without_a_top_k_is_named_and_kept_a_router():
    """PhiMoE's sparsemixer chooses two experts by max and masking: the block is not recognised as a
    mixture of experts. The planner said nothing, split the router column-wise as an MLP's `up`, and
    refused `--ep 2` with "the model has no mixture-of-experts layer". Now a warning names the block,
    the router stays a replicated router, and the refusal gives the reason."""
    from tests.models import hf_phimoe  # noqa: PLC0415

    model = hf_phimoe.build_model().to("meta")
    with pytest.warns(UserWarning, match="without a top-k") as caught:
        structure = analyse(capture(model, hf_phimoe.example_inputs(), hf_phimoe.example_kwargs()))
    assert any("mlp.experts.gate_up_proj" in str(w.message) for w in caught)
    for layer in structure.layers:
        assert layer.moe is None and layer.mlp is None and "without a top-k" in layer.experts_unrecognised
        assert [(p.weight.rsplit(".", 2)[-2], p.role) for p in layer.routers] == [("router", Role.ROUTER)]
    path = str(Path(hf_phimoe.__file__))
    out = planner_in_process("optimize", path, "--cluster", "dgx-h100", "--tp", "2", "--ep", "2")
    assert (
        out.returncode == 2 and "without a top-k" in out.stderr and "no mixture-of-experts" not in out.stderr
    )


def test_a_router_reading_batch_and_sequence_dims_is_not_lowered_by_the_expert_pass() -> None:
    """A router over (B, T, H) picks top-k on (B, T, E) scores; the expert pass exchanges (tokens, H) rows
    with their (tokens, k) choices, and crashed on the shape with a traceback (`too many values to
    unpack`). The block is found and named not lowerable, so EP and expert TP are refused in one line."""
    from tests.models import tiny_moe_modulelist as base  # noqa: PLC0415

    class Router3d(base.SparseMoE):
        def forward(self, x):
            b, t, c = x.shape
            probs = torch.softmax(self.gate(x), dim=-1)  # (B, T, E)
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            x = x.view(-1, c)
            routed = self._capacity(x, weights.view(-1, self.top_k), chosen.view(-1, self.top_k))
            return (routed + self.shared(x)).view(b, t, c)

    original = base.SparseMoE
    base.SparseMoE = Router3d
    try:
        model = base.build_model()
    finally:
        base.SparseMoE = original
    structure = analyse(capture(model, base.example_inputs(2, 16), {}))
    reasons = [layer.moe.not_lowerable for layer in structure.layers if layer.moe is not None]
    assert reasons and all("not as (tokens, hidden) rows" in r for r in reasons), reasons
    spec = load_cluster("dgx-h100")
    with pytest.raises(InputError, match="not as \\(tokens, hidden\\) rows"):
        plan_model(structure, spec, WorkloadSpec("train", 2, 16), Constraints(ep=2, max_devices=2))


@pytest.mark.parametrize(
    "routing, line", [("aux", "probs.mean(0)"), ("expert_choice", "torch.topk(probs.t()")]
)
def test_a_reduction_over_the_batchs_flattened_tokens_keeps_the_batch_whole(
    routing, line, monkeypatch
) -> None:
    """tests/models/moe_token_reductions.py reduces over the tokens of the whole batch flattened into
    one dim: a load-balancing loss `probs.mean(0)` over (B * T, E) added to the output, or expert-choice
    routing's top-k over each expert's (B * T) scores. Only a reduction over a dim of the batch's size
    counted as mixing the samples, so the search split the batch (DP, micro-batches) and the run
    failed its numerics (exit 4). The batch is kept whole now, naming the line; --dp 2 is refused."""
    from planner.frontend.modelfile import load_model_file  # noqa: PLC0415

    monkeypatch.setenv("ROUTING", routing)
    module = load_model_file(Path(__file__).parent / "models" / "moe_token_reductions.py").module
    model = module.build_model()
    (tokens,) = module.example_inputs()
    with torch.no_grad():
        assert (model(tokens) - torch.cat([model(tokens[:1]), model(tokens[1:])])).abs().max() > 1e-4
    s = analyse(capture(model, (tokens,)))
    assert any(line in why and "reduces over the batch's tokens (B x T)" in why for why in s.batch_mixing), (
        s.batch_mixing
    )
    with pytest.raises(InputError, match="cannot be split"):
        plan_model(s, load_cluster(FASTLINK, nproc=2), WorkloadSpec(Workload.TRAIN, 2, 8), Constraints(dp=2))


def test_a_dim_that_merely_measures_b_x_t_does_not_keep_the_batch_whole() -> None:
    """The flattened-tokens rule reads sizes, so a size that happens to be B x T is no batch mixing: a
    softmax over rows of a (C, C) parameter with C = B x T (no input reaches it), and a per-token softmax
    over the experts of (E, N) logits with E = N = B x T (no telling which dim holds the tokens). Both
    had forbidden data parallelism."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.mix = nn.Embedding(32, 16), nn.Parameter(torch.randn(16, 16))
            self.router = nn.Linear(16, 16, bias=False)  # E = 16 experts = B x T
            self.experts = nn.Parameter(torch.randn(16, 16))  # one (C,) output per expert

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids).reshape(-1, 16)  # (B x T, C), B x T = 16 = C
            x = x @ torch.softmax(self.mix, dim=0)
            probs = torch.softmax(self.router.weight @ x.t(), dim=0)  # (E, N): over the experts, per token
            return (x + probs.t() @ self.experts).view(ids.shape[0], ids.shape[1], 16)

    tokens = torch.randint(0, 32, (2, 8))
    model = Model()
    with torch.no_grad():  # per-token only: halves of the batch compute what the whole does
        assert torch.allclose(model(tokens), torch.cat([model(tokens[:1]), model(tokens[1:])]), atol=1e-5)
    assert analyse(capture(model, (tokens,))).batch_mixing == []

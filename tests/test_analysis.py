"""planner.frontend.analysis: roles by dataflow, costs, layers and cut points for every example."""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from planner.frontend.analysis import Role, analyse
from planner.frontend.capture import capture, flat_inputs
from planner.frontend.depth import capture_for_planning
from planner.frontend.modelfile import load_model_file

# example -> (num layers, attention roles, mlp roles, heads, kv heads, head dim, tied, weight_out_dim)
EXPECTED = {
    "gpt2_tiny": (2, ["qkv", "o"], ["up", "down"], 4, 4, 16, True, 0),
    "llama3": (4, ["q", "k", "v", "o"], ["gate", "up", "down"], 8, 4, 16, False, 0),
    "hf_llama": (2, ["q", "k", "v", "o"], ["gate", "up", "down"], 8, 4, 16, False, 0),
    "hf_gpt2": (2, ["qkv", "o"], ["up", "down"], 4, 4, 32, True, 1),
}


@pytest.fixture(scope="module")
def structures(captured):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = analyse(captured(name).gm)
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_roles(structures, name):
    num_layers, attn_roles, mlp_roles, heads, kv_heads, head_dim, tied, out_dim = EXPECTED[name]
    s = structures(name)
    assert len(s.layers) == num_layers
    for layer in s.layers:
        assert [p.role for p in layer.attention.projections] == attn_roles
        assert [p.role for p in layer.mlp.projections] == mlp_roles
        assert all(isinstance(p.role, Role) for p in layer.attention.projections + layer.mlp.projections)
        assert (layer.attention.num_heads, layer.attention.num_kv_heads, layer.attention.head_dim) == (
            heads,
            kv_heads,
            head_dim,
        )
        assert all(p.weight_out_dim == out_dim for p in layer.attention.projections + layer.mlp.projections)
        assert layer.attention.residual_add and layer.mlp.residual_add
        assert all(p.weight.startswith(layer.module_path + ".") for p in layer.mlp.projections)
    assert s.lm_head is not None and s.lm_head.role is Role.LM_HEAD and s.lm_head.out_features == s.vocab_size
    assert s.tied_lm_head is tied
    assert s.mlp_chain == []


def test_fused_qkv_parts(structures):
    qkv = structures("gpt2_tiny").layers[0].attention.projections[0]
    assert (qkv.in_features, qkv.out_features, qkv.parts) == (64, 192, (64, 64, 64))
    assert (
        qkv.weight == "transformer.h.0.attn.c_attn.weight" and qkv.bias == "transformer.h.0.attn.c_attn.bias"
    )
    conv = structures("hf_gpt2").layers[1].attention.projections[0]  # HF Conv1D: weight (in, out)
    assert (conv.weight_out_dim, conv.in_features, conv.out_features, conv.parts) == (1, 128, 384, (128,) * 3)


def test_plain_mlp_chain(structures):
    s = structures("mlp")
    assert s.layers == [] and s.lm_head is None and s.embeddings == []
    assert [p.weight for p in s.mlp_chain] == ["net.0.weight", "net.2.weight", "net.4.weight", "net.6.weight"]
    assert all(p.role is Role.FC for p in s.mlp_chain)
    assert (s.batch_size, s.hidden_size) == (8, 64)


def test_llama_flops_closed_form(structures, captured):
    s = structures("llama3")
    model = captured("llama3").model
    b, t = s.batch_size, s.seq_len
    assert (b, t) == (2, 32)
    for layer in s.layers:
        params = sum(p.numel() for p in model.get_submodule(layer.module_path).parameters())
        matmul_flops = sum(p.flops for p in layer.attention.projections + layer.mlp.projections)
        assert matmul_flops == pytest.approx(2 * params * b * t, rel=0.01)
        a = layer.attention
        # the attention core counts the full T x T score matrix (causal masking is not halved)
        assert a.flops == 4 * b * a.num_heads * t * t * a.head_dim
        assert s.node_costs[a.sdpa_node].flops == a.flops
        assert layer.flops == pytest.approx(matmul_flops + a.flops, rel=0.05)  # + elementwise ops
    assert s.num_params == sum(p.numel() for p in model.parameters())
    assert s.param_bytes == 4 * s.num_params and s.dtype == "fp32"


def test_node_costs(structures):
    s = structures("llama3")
    wq = s.layers[0].attention.projections[0]
    cost = s.node_costs[wq.node]
    assert cost.shape == (2, 32, 128) and cost.dtype == "fp32" and cost.module_path == "layers.0.attention.wq"
    assert cost.bytes_written == 2 * 32 * 128 * 4
    assert cost.bytes_read == (2 * 32 * 128 + 128 * 128) * 4  # activation + weight
    embedding = s.node_costs[s.embeddings[0].node]
    assert embedding.bytes_read < 256 * 128 * 4  # gathered rows, not the whole table
    views = [c for c in s.node_costs.values() if c.flops == 0 and c.bytes_written == 0]
    assert views  # views / getitem / get_attr move nothing


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_layer_cut_points(structures, captured, name):
    s = structures(name)
    gm = captured(name).gm
    g = nx.DiGraph()
    for node in gm.graph.nodes:
        g.add_edges_from((a.name, node.name) for a in node.all_input_nodes)
    inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    for prev, layer in zip(s.layers, s.layers[1:]):
        assert prev.output_node == layer.input_node
    for layer in s.layers:
        assert layer.output_node in layer.nodes and layer.input_node not in layer.nodes
        assert layer.cross_inputs == []
        # every path from the model inputs to the layer's output passes through input_node (or a
        # side input computed before the layers): removing them disconnects the output
        cut = g.copy()
        cut.remove_nodes_from([layer.input_node, *layer.side_inputs])
        assert not any(nx.has_path(cut, i, layer.output_node) for i in inputs if i in cut)
        assert all(not nx.has_path(g, s.layers[0].input_node, side) for side in layer.side_inputs)


def test_side_inputs(structures):
    assert len(structures("llama3").layers[0].side_inputs) == 2  # RoPE cos, sin
    assert structures("gpt2_tiny").layers[0].side_inputs == []
    # cos, sin: no attention mask (SDPA is_causal, as transformers runs it eager: capture._hf_mask_skip)
    assert len(structures("hf_llama").layers[0].side_inputs) == 2


def test_manual_softmax_attention():
    config = GPT2Config(
        vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, attn_implementation="eager"
    )
    model = GPT2LMHeadModel(config).eval()
    s = analyse(capture(model, (torch.randint(0, 128, (2, 8)),), {"use_cache": False}))
    a = s.layers[0].attention
    assert [p.role for p in a.projections] == ["qkv", "o"]
    assert (a.num_heads, a.head_dim) == (4, 16)
    assert a.flops == 4 * 2 * 4 * 8 * 8 * 16


def test_llama3_70b_structure_on_meta(example_path):
    """The published 70B config as the planner sees it (built on meta; its capture + analysis time is a
    figure of bench/plan_speed.py, not a test)."""
    mf = load_model_file(example_path("llama3_70b"))
    model = mf.build()
    args, kwargs = mf.inputs(batch_size=1, seq_len=128)
    _, s = capture_for_planning(model, args, kwargs)
    assert len(s.layers) == 80 and s.hidden_size == 8192 and s.vocab_size == 128256
    a = s.layers[-1].attention
    assert (a.num_heads, a.num_kv_heads, a.head_dim) == (64, 8, 128)
    assert [p.out_features for p in s.layers[0].mlp.projections] == [28672, 28672, 8192]
    assert s.num_params == pytest.approx(70.55e9, rel=0.001) and s.dtype == "bf16"
    assert (s.query_head_counts(), s.kv_head_counts()) == ([64], [8])


def _hf(model_cls, config_cls, **config):
    torch.manual_seed(0)
    return model_cls(config_cls(**config, attn_implementation="sdpa")).eval()


HF_SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize(
    "arch, check",
    [
        # fused qkv_proj / gate_up_proj split by slices, GQA: parts from the slices
        ("phi3", lambda s: s.layers[0].attention.projections[0].parts == (64, 32, 32)
         and s.layers[0].attention.num_kv_heads == 2 and s.layers[0].mlp.projections[0].parts == (128, 128)),
        # parallel residual x + attn(x) + mlp(x): both blocks report the add onto the stream
        ("gptj", lambda s: s.layers[0].attention.residual_add == s.layers[0].mlp.residual_add
         and s.layers[0].input_node == "embedding"),
        # learned position embedding with more rows than the vocabulary: vocab from the token embedding
        ("opt", lambda s: s.vocab_size == 256 and s.lm_head is not None and s.tied_lm_head),
        # FalconLinear: x @ W.T is captured as aten.linear, a projection in nn.Linear layout
        ("falcon", lambda s: [p.role for p in s.layers[0].attention.projections] == ["qkv", "o"]
         and s.layers[0].attention.projections[0].weight_out_dim == 0),
        # ALiBi scores by baddbmm on batch and heads merged (B*H, T, hd): the heads before the merge
        # multi-head latent attention whose kv_b_proj width (4 heads x (8 + 16) = 96) divides into "halves" of
        # 3 query-width heads: read as 3 KV heads ("--tp 2 does not divide ... 3 KV heads"); its heads are 4
        ("deepseek_v2", lambda s: (s.layers[0].attention.num_heads, s.layers[0].attention.num_kv_heads) == (4, 4)),
        ("bloom", lambda s: [p.role for p in s.layers[0].attention.projections] == ["qkv", "o"]
         and (s.layers[0].attention.num_heads, s.layers[0].attention.head_dim) == (4, 16)
         and s.layers[0].attention.flops == 4 * 2 * 4 * 8 * 8 * 16
         and [p.role for p in s.layers[0].mlp.projections] == ["up", "down"]),
    ],
)  # fmt: skip
def test_other_hf_architectures(arch, check):
    import transformers as hf

    build = {
        "phi3": lambda: _hf(hf.Phi3ForCausalLM, hf.Phi3Config, **HF_SMALL, intermediate_size=128,
                            num_key_value_heads=2, pad_token_id=0),
        "gptj": lambda: _hf(hf.GPTJForCausalLM, hf.GPTJConfig, vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                            rotary_dim=8),
        "opt": lambda: _hf(hf.OPTForCausalLM, hf.OPTConfig, **HF_SMALL, ffn_dim=128, word_embed_proj_dim=64),
        "falcon": lambda: _hf(hf.FalconForCausalLM, hf.FalconConfig, **HF_SMALL),
        "deepseek_v2": lambda: _hf(hf.DeepseekV2ForCausalLM, hf.DeepseekV2Config, **HF_SMALL, intermediate_size=128,
                                   moe_intermediate_size=32, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                                   num_experts_per_tok=2, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None,
                                   qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, topk_method="greedy",
                                   n_group=1, topk_group=1),
        "bloom": lambda: hf.BloomForCausalLM(hf.BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4,
                                                            attn_implementation="eager")).eval(),
    }[arch]  # fmt: skip
    model = build()
    args, kwargs = (torch.randint(0, 256, (2, 8)),), {"use_cache": False}
    gm = capture(model, args, kwargs)
    with torch.no_grad():
        torch.testing.assert_close(gm(*flat_inputs(args, kwargs)), model(*args, **kwargs).logits)
    assert check(analyse(gm))


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_heads_merged_after_the_batch_are_the_heads_at_every_batch_size(batch):
    """tests/models/head_major_heads.py merges (H, B, T, hd) to (H * B, T, hd). The heads were read
    as the merge's second factor, the batch: a plan made at batch 4 named layers "attn4" and a DP rank
    at batch 2 found "attn2", and the run stopped on a layer class not in the model."""
    model_file = load_model_file(Path(__file__).parent / "models" / "head_major_heads.py")
    args, kwargs = model_file.inputs(batch, 16)
    attention = analyse(capture(model_file.build("meta"), args, kwargs)).layers[0].attention
    assert (attention.num_heads, attention.num_kv_heads, attention.head_dim) == (8, 8, 8)


@pytest.mark.parametrize("name", ["llama3", "gpt2_tiny"])
def test_node_blocks(structures, name):
    """Every layer node has a block: projections, the core, RoPE / GQA copies with attention (split
    by heads), the activation with the MLP (split by width), norms and residual adds on the stream."""
    s = structures(name)
    for layer in s.layers:
        blocks = layer.node_blocks
        assert set(blocks) == set(layer.nodes)
        projections = [*layer.attention.projections, *layer.mlp.projections]
        assert {blocks[p.node] for p in projections} == {"projection"}
        assert blocks[layer.attention.sdpa_node] == "core"
        assert blocks[layer.attention.residual_add] == blocks[layer.mlp.residual_add] == "stream"
        by_op = {}
        for n in layer.nodes:
            by_op.setdefault(n.rstrip("_0123456789"), set()).add(blocks[n])
        if name == "llama3":
            assert by_op["silu"] == {"mlp"} and by_op["neg"] == {"attention"} and by_op["rsqrt"] == {"stream"}
        else:
            assert by_op["gelu"] == {"mlp"} and by_op["layer_norm"] == {"stream"}


def test_layer_classes_do_not_depend_on_the_dtype(example_path):
    """A plan made in fp32 names its layer classes (recompute per class) as ranks that build the model
    in bf16 do: the class key counts parameter elements, not bytes."""
    from planner.solver.costing import layer_key

    mf = load_model_file(example_path("llama3"))
    keys = []
    for dtype in (torch.float32, torch.bfloat16):
        model = mf.build().to(dtype)
        keys.append([layer_key(layer) for layer in analyse(capture(model, *mf.inputs())).layers])
    assert keys[0] == keys[1] and all(";n" in k for k in keys[0])


def test_an_encoder_decoder_has_both_stacks_and_cross_attention_roles():
    """T5 (tests/models/tiny_t5.py: 2 encoder and 2 decoder blocks) was traced as "2 layers": the
    decoder's stack only (the encoder's projections fell to the ends), its cross-attention's q/k/v/o
    labelled fc and the o split column-wise. Both stacks are layers now, in graph order; each has a
    self-attention with q/k/v/o, each decoder block a cross-attention whose k / v read the encoder's
    output (the encoder's last value, a side input of the decoder blocks); a TP=2 plan splits every
    o row-wise."""
    from pathlib import Path

    from costmodels.cluster import load_cluster
    from planner.cli.workflow import constraints_from, make_plan, prepare
    from planner.plan import SplitStyle

    path = Path(__file__).parent / "models" / "tiny_t5.py"
    prepared = prepare(str(path), "forward")
    s = prepared.structure
    assert [layer.module_path for layer in s.layers] == [
        "encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1",
    ]  # fmt: skip
    qkvo = [Role.Q, Role.K, Role.V, Role.O]
    for layer in s.layers:
        assert [p.role for p in layer.attention.projections] == qkvo
        assert [p.role for p in layer.mlp.projections] == [Role.UP, Role.DOWN]
        assert layer.attention.residual_add and layer.mlp.residual_add
        cross = layer.cross_attention
        assert (cross is not None) is layer.module_path.startswith("decoder")
        if cross is not None:
            assert [p.role for p in cross.projections] == qkvo
            assert all(".EncDecAttention." in p.weight for p in cross.projections)
            assert (cross.num_heads, cross.head_dim) == (4, 16) and cross.residual_add
            assert layer.node_blocks[cross.sdpa_node] == "cross_core"
            # k and v read the encoder's output: a value from outside the layer that depends on the stream
            nodes = {n.name: n for n in prepared.graph.graph.nodes}
            for p in cross.projections[1:3]:
                source = nodes[p.node].args[0]
                assert source.name not in layer.nodes and source.name in layer.cross_inputs
    plan = make_plan(
        prepared,
        load_cluster(str(path.parent / "fastlink.yaml")),
        constraints_from(2, 1, 1, "none"),
        str(path),
    )
    outputs = [p.weight for layer in s.layers for b in (layer.attention, layer.cross_attention) if b
               for p in b.projections if p.role is Role.O]  # fmt: skip
    assert len(outputs) == 6
    assert all(plan.splits[w].style is SplitStyle.ROWWISE for w in outputs)
    assert plan.roles[outputs[-1]] == "o"
    embeddings = {plan.splits[e.weight].style for e in s.embeddings if e.weight == s.lm_head.weight}
    assert len(embeddings) == 1  # the encoder's and the decoder's lookups of the shared table split alike


def test_a_mixture_of_experts_router_is_a_router_and_stays_replicated():
    """Hugging Face Mixtral's router (`mlp.gate`: a linear to the 4 expert logits, softmax, top-2) was
    labelled an MLP `up` projection and split column-wise; it is `router` now, in the plan's roles, and
    no split of the plan names it (each rank routes its own tokens with the whole router)."""
    from pathlib import Path

    from costmodels.cluster import load_cluster
    from planner.cli.workflow import constraints_from, make_plan, prepare

    path = Path(__file__).parent / "models" / "tiny_mixtral.py"
    prepared = prepare(str(path), "forward")
    for layer in prepared.structure.layers:
        assert [(p.weight, p.role) for p in layer.routers] == [
            (f"model.layers.{layer.index}.mlp.gate.weight", Role.ROUTER)
        ]
        assert layer.mlp is None or all(p.role is not Role.ROUTER for p in layer.mlp.projections)
        assert layer.node_blocks[layer.routers[0].node] == "stream"
    fastlink = str(Path(__file__).parent / "models" / "fastlink.yaml")
    plan = make_plan(
        prepared, load_cluster(fastlink, nproc=2), constraints_from(2, None, None, "none"), str(path)
    )
    assert plan.roles["model.layers.0.mlp.gate.weight"] == "router"
    assert not [w for w in plan.splits if ".mlp.gate." in w]
    assert plan.predicted.per_layer[0].strategy["core"] == "head"


def test_attention_whose_probabilities_are_also_returned_is_still_attention():
    """HF eager attention with output_attentions=True returns its softmax as an output besides
    multiplying it with V: the core is found through both users (it once fell to fc0, fc1, ...)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **HF_SMALL, intermediate_size=128, num_key_value_heads=2, attn_implementation="eager"
    )
    model = LlamaForCausalLM(config).eval()
    kwargs = {"use_cache": False, "output_attentions": True}
    s = analyse(capture(model, (torch.randint(0, 256, (2, 8)),), kwargs))
    a = s.layers[0].attention
    assert [p.role for p in a.projections] == ["q", "k", "v", "o"]
    assert (a.num_heads, a.num_kv_heads, a.head_dim) == (4, 2, 16)
    assert [p.role for p in s.layers[0].mlp.projections] == ["gate", "up", "down"]


@pytest.mark.parametrize("name", ["fused_kv_gqa", "fused_kv_cache_gqa"])
def test_a_fused_key_value_projection_is_one_projection_of_the_kv_heads(name):
    """K and V from one projection (chunked in two, or viewed as (..., 2, KVH, hd)) with grouped-query
    heads repeated before the core: the projection is listed once (it was twice, its GEMM priced twice)
    and the KV heads are its own 2, not the 4 the core sees (a served cache then read as 2x too short:
    "allocated ... for 8 positions" for 16)."""
    model_file = load_model_file(Path(__file__).resolve().parent / "models" / f"{name}.py")
    if model_file.has_cache:
        model = model_file.module.build_model(1, 16).to("meta")
        args = (torch.randint(0, 80, (1, 1)), torch.tensor([12]))
    else:
        model, args = model_file.build("meta"), model_file.inputs()[0]
    a = capture_for_planning(model, args, {})[1].layers[0].attention
    assert (a.num_heads, a.num_kv_heads, a.head_dim) == (4, 2, 8)
    nodes = [p.node for p in a.projections]
    assert len(nodes) == len(set(nodes)) and [str(p.role) for p in a.projections][-1] == "o"


def test_a_served_fused_kv_gqa_cache_is_long_enough(capsys):
    """`planner optimize --workload decode` of a cache of max_seq_len positions: planned, no false
    "allocated ... for 8 positions" refusal."""
    from planner.cli.main import main  # noqa: PLC0415

    model = str(Path(__file__).resolve().parent / "models" / "fused_kv_cache_gqa.py")
    rc = main(["optimize", model, "--workload", "decode", "--context", "12", "--new-tokens", "4", "--cluster",
               "local-cpu", "--nproc", "2", "--tp", "2"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 0 and "allocated" not in err, err


def _parts_of_qkv(heads: int, take_apart: bool) -> tuple[int, ...] | None:
    """Parts read from a fused (B, T, 3C) projection viewed as (B, T, 3, C), taken apart along the 3
    (q, k, v) or, with 3 heads of C / 3, not: the view is (B, T, H, hd) going to attention whole."""

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(48, 144 if take_apart else 48)

        def forward(self, x):
            B, T, C = x.shape
            if take_apart:
                q, k, v = self.qkv(x).reshape(B, T, 3, C).unbind(2)
            else:
                q = k = v = self.qkv(x).view(B, T, heads, C // heads)
            q, k, v = (t.reshape(B, T, heads, -1).transpose(1, 2) for t in (q, k, v))
            return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, C)

    gm = capture(Attn(), (torch.randn(2, 5, 48),))
    linear = next(n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target))
    from planner.frontend.analysis import _parts  # noqa: PLC0415

    return _parts(linear)


def test_a_qkv_taken_apart_from_a_view_of_3_parts_and_not_3_heads():
    assert _parts_of_qkv(4, take_apart=True) == (48, 48, 48)
    assert _parts_of_qkv(3, take_apart=False) is None


def test_attention_written_with_einsum_is_a_core_priced_by_its_flops():
    """`torch.einsum("bhqd,bhkd->bhqk", q, k)` ... `einsum("bhqk,bhkd->bhqd", p, v)`: the layer has an
    attention block (q/k/v/o, 4 heads) and each einsum is priced as a product (it was a memory op of no
    FLOPs, and its projections were read as an MLP chain)."""
    from tests.plans import meta_structure  # noqa: PLC0415

    s = meta_structure(str(Path(__file__).parent / "corpus" / "einsum_attention.py"), 2, 16)
    attention = s.layers[0].attention
    assert attention is not None and [p.role for p in attention.projections] == [
        Role.Q,
        Role.K,
        Role.V,
        Role.O,
    ]
    assert (attention.num_heads, attention.head_dim) == (4, 16)
    einsums = [c for name, c in s.node_costs.items() if c.op == "aten.einsum"]
    assert einsums and all(c.kind == "matmul" and c.flops == 2 * 2 * 4 * 16 * 16 * 16 for c in einsums), (
        einsums
    )


def test_projections_with_in_by_out_weights_are_read_as_projections():
    """`x @ W`, `torch.matmul(x, W)` and `einsum("btd,df->btf", x, W)` with W (in, out) on 3-D
    activations (tests/models/inout_weights.py): capture writes the einsum as `aten.matmul(x, W)`, and
    each layer has an attention block (qkv / o) and an MLP (up / down) whose weights split on dim 1
    (the einsum stayed an einsum, run replicated without a word)."""
    from tests.plans import meta_structure  # noqa: PLC0415

    s = meta_structure(str(Path(__file__).parent / "models" / "inout_weights.py"), 2, 8)
    assert not [c for c in s.node_costs.values() if c.op == "aten.einsum"]
    for layer in s.layers:
        assert layer.attention is not None and layer.mlp is not None, layer
        projections = [*layer.attention.projections, *layer.mlp.projections]
        assert [p.weight_out_dim for p in projections] == [1, 1, 1, 1], projections
        assert (layer.attention.num_heads, layer.attention.head_dim) == (4, 8)


def test_a_jax_ports_per_head_einsums_leave_the_mlp_its_own_projections():
    """tests/models/flax_heads.py: q / k / v / o are einsums of 3-D per-head weights (no projection
    the planner splits), the MLP two (in, out) matmuls. The MLP's first projection, after the residual
    add, was taken for the attention's output projection (and the second for an MLP up), so plans
    split the MLP row- then column-wise; heads and FLOPs were read from (B, T, H, hd) as if (B, H, T,
    hd) (8 "heads" of the 8 tokens)."""
    from tests.plans import meta_structure  # noqa: PLC0415

    s = meta_structure(str(Path(__file__).parent / "models" / "flax_heads.py"), 2, 8)
    for i, layer in enumerate(s.layers):
        assert layer.attention is not None and layer.attention.projections == [], layer.attention
        assert (layer.attention.num_heads, layer.attention.head_dim) == (4, 8)
        assert layer.attention.flops == 4 * 2 * 4 * 8 * 8 * 8  # 4 B H T S hd
        assert [(p.role, p.weight) for p in layer.mlp.projections] == [
            (Role.UP, f"blocks.{i}.w_in"),
            (Role.DOWN, f"blocks.{i}.w_out"),
        ]


@pytest.mark.parametrize("shared", [False, True], ids=["b0_b1_b2_b0", "one_block_x12"])
def test_a_block_object_called_at_several_depths_is_a_layer_at_each(shared: bool) -> None:
    """tests/models/reused_block.py holds one block object twice in its ModuleList (`[b0, b1, b2, b0]`),
    or once at all 12 depths. `named_modules()` names a module once, so the last call's ops had no
    known module path: they fell outside every layer, and the model was analysed as 3 layers (or 1)
    while it runs 4 (or 12), so stages and their prices did not match the calls that run. Every call
    is a layer now, each with its attention and MLP, and the layers together hold every call's ops;
    the layers sharing the block are named (`ModelStructure.shared_layers`)."""
    mf = load_model_file(Path(__file__).parent / "models" / "reused_block.py")
    model = mf.module.build_model(shared=shared)
    gm = capture(model, mf.module.example_inputs())
    s = analyse(gm)
    depth = 12 if shared else 4
    assert [layer.module_path for layer in s.layers] == [f"layers.{i}" for i in range(depth)]
    for layer in s.layers:
        assert [p.role for p in layer.attention.projections] == [Role.QKV, Role.O]
        assert [p.role for p in layer.mlp.projections] == [Role.UP, Role.DOWN]
    sdpa = [n.name for n in gm.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert [layer.attention.sdpa_node for layer in s.layers] == sdpa
    shared_layers = (tuple(range(12)),) if shared else ((0, 3),)
    assert s.shared_layers == shared_layers
    # planning traces a deep stack through two blocks and copies the rest, which would miss the sharing
    planned = capture_for_planning(model, mf.module.example_inputs(), {})[1]
    assert len(planned.layers) == depth and planned.shared_layers == shared_layers

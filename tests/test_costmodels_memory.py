"""Memory formulas against hand-derived values (ZeRO; Korthikanti et al. 2022; KV cache)."""

from __future__ import annotations

import pytest

from costmodels import memory


def test_training_state_is_16_bytes_per_parameter() -> None:
    # ZeRO section 3.1: 2 (bf16 params) + 2 (bf16 grads) + 12 (fp32 master, m, v) = 16 bytes / param
    assert memory.param_bytes(1e9, "bf16") == 2e9
    assert memory.grad_bytes(1e9, "bf16") == 2e9
    assert memory.adam_state_bytes(1e9, "bf16") == 12e9
    assert memory.training_state_bytes(1e9, "bf16") == 16e9
    # fp32 training: no separate master copy: 4 + 4 + 8
    assert memory.adam_state_bytes(1e9, "fp32") == 8e9
    assert memory.training_state_bytes(1e9, "fp32") == 16e9


def test_params_per_rank() -> None:
    assert memory.params_per_rank(8e9, 1e6, tp=8) == 1e9 + 1e6
    with pytest.raises(ValueError):
        memory.params_per_rank(1, 1, tp=0)


# GPT-3 175B layer, Korthikanti et al. section 4: s=2048, b=1, h=12288, a=96 -> 5as/h = 80
S, B, H, A = 2048, 1, 12288, 96
SBH = S * B * H


def test_activations_without_parallelism() -> None:
    assert memory.activation_bytes_per_layer(S, B, H, A) == SBH * (34 + 80)


def test_activations_with_tensor_parallelism() -> None:
    # 10 + 24/t + 5as/(ht) with t = 8: 10 + 3 + 10
    assert memory.activation_bytes_per_layer(S, B, H, A, tp=8) == SBH * 23


def test_activations_with_sequence_parallelism() -> None:
    # sbh/t * (34 + 5as/h)
    assert memory.activation_bytes_per_layer(S, B, H, A, tp=8, sequence_parallel=True) == pytest.approx(
        SBH * 114 / 8
    )


def test_activations_with_flash_attention_and_dtype() -> None:
    assert memory.activation_bytes_per_layer(S, B, H, A, tp=8, stores_attention_scores=False) == SBH * 13
    assert memory.activation_bytes_per_layer(S, B, H, A, dtype="fp32") == 2 * SBH * 114


def test_kv_cache_llama3_8b() -> None:
    # 2 * 32 layers * 1 * 8192 tokens * 8 kv heads * 128 * 2 bytes = 1 GiB
    assert memory.kv_cache_bytes(32, 1, 8192, 8, 128, "bf16") == 2**30
    assert memory.kv_cache_bytes(32, 1, 8192, 8, 128, "bf16", tp=8) == 2**30 / 8
    # more ranks than KV heads: each rank keeps one (replicated) head
    assert memory.kv_cache_bytes(32, 1, 8192, 8, 128, "bf16", tp=16) == 2**30 / 8


def test_inflight_micro_batches() -> None:
    one_f_one_b, gpipe = memory.Schedule.ONE_F_ONE_B, memory.Schedule.GPIPE
    assert memory.inflight_micro_batches(4, 0, 8, one_f_one_b) == 4  # 1F1B: first stage holds pp
    assert memory.inflight_micro_batches(4, 3, 8, one_f_one_b) == 1
    assert memory.inflight_micro_batches(4, 0, 2, one_f_one_b) == 2
    assert memory.inflight_micro_batches(4, 1, 8, gpipe) == 8  # GPipe: every micro-batch
    assert memory.inflight_micro_batches(4, 1, 8, "gpipe") == 8  # the YAML spelling
    with pytest.raises(ValueError, match="stage"):
        memory.inflight_micro_batches(4, 4, 8, one_f_one_b)
    with pytest.raises(ValueError, match="schedule"):
        memory.inflight_micro_batches(4, 0, 8, "zb")


def test_interleaved_inflight_and_bubble() -> None:
    """Interleaved 1F1B, v chunks per rank: rank r holds (2 (p - r - 1) + (v - 1) p + 1) / v
    micro-batches (Megatron's warm-up count, in units of one micro-batch through the rank's layers);
    the first rank p (1 + (p - 1) / (p v)) (Korthikanti et al. 2022, section 4.2.3); v = 1 is 1F1B."""
    inter = memory.Schedule.INTERLEAVED_1F1B
    p, v = 16, 4
    assert memory.inflight_micro_batches(p, 0, 64, inter, v) == pytest.approx(p * (1 + (p - 1) / (p * v)))
    assert memory.inflight_micro_batches(p, p - 1, 64, inter, v) == pytest.approx(((v - 1) * p + 1) / v)
    assert memory.inflight_micro_batches(p, 3, 64, inter, 1) == p - 3
    assert memory.inflight_micro_batches(4, 0, 2, inter, 2) == 2  # never more than all micro-batches
    with pytest.raises(ValueError, match="virtual_stages"):
        memory.inflight_micro_batches(4, 0, 8, memory.Schedule.ONE_F_ONE_B, 2)
    assert memory.pipeline_bubble_fraction(8, 32) == 7 / 32
    assert memory.pipeline_bubble_fraction(8, 32, 4) == 7 / 128  # divided by v


def test_attention_scores_and_sharded_optimizer_state() -> None:
    # Korthikanti et al. eq. (2): 5 a s^2 b bytes of scores per layer (16-bit), / t with TP
    assert memory.attention_scores_bytes(2048, 1, 96, tp=8) == 5 * 96 * 2048**2 / 8
    assert memory.attention_scores_bytes(2048, 1, 96, dtype="fp32") == 2 * 5 * 96 * 2048**2
    # ZeRO-1: 12 bytes of Adam state (with fp32 master weights) per bf16 parameter, over dp ranks
    assert memory.sharded_optimizer_state_bytes(1e9, "bf16", 8) == 12e9 / 8


def test_unknown_dtype_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        memory.kv_cache_bytes(1, 1, 1, 1, 1, "int4")


def _stored_inputs(model: str, decoder: bool = False) -> tuple[dict[str, float], int]:
    """tests/models/`model` (2 x 16 tokens, fp32 training, one rank): each projection's stored input
    bytes (`OpOption.input_bytes`, replicated) in its first layer (with `decoder`, its first layer with
    a cross-attention), and the model's hidden size."""
    from pathlib import Path  # noqa: PLC0415

    from costmodels.cluster import load_cluster  # noqa: PLC0415
    from planner.frontend.analysis import analyse  # noqa: PLC0415
    from planner.frontend.capture import capture  # noqa: PLC0415
    from planner.frontend.modelfile import load_model_file  # noqa: PLC0415
    from planner.plan import MeshShape  # noqa: PLC0415
    from planner.solver.costing import CostContext, build_layer_graph  # noqa: PLC0415
    from planner.solver.problem import MeshConfig, WorkloadSpec  # noqa: PLC0415

    model_file = load_model_file(Path(__file__).resolve().parent / "models" / model)
    args, kwargs = model_file.inputs(2, 16)
    structure = analyse(capture(model_file.build("meta"), args, kwargs))
    work = WorkloadSpec("train", 2, 16)
    ctx = CostContext(structure, load_cluster("local-cpu"), work, MeshConfig(MeshShape(1, 1, 1), 1), "fp32")
    layer = next(layer for layer in structure.layers if layer.cross_attention is not None or not decoder)
    graph = build_layer_graph(layer, ctx)
    stored = {op.name: op.option("replicate").input_bytes for op in graph.ops if op.projection is not None}
    return stored, structure.hidden_size


def test_projections_that_read_one_tensor_store_it_once() -> None:
    """A layer's stored activations count the input that projections read once per tensor read (the
    fx node, `Projection.input`): a self-attention's q / k / v one normed stream, a cross-attention's
    k / v the encoder's output while its q reads the decoder stream (tests/models/tiny_t5.py)."""
    stored, hidden = _stored_inputs("tiny_t5.py", decoder=True)
    stream = 2 * 16 * hidden * 4  # one (tokens, hidden) fp32 tensor
    assert stored["q"] == stream and stored["k"] == stored["v"] == 0.0
    assert stored["cross.q"] == stream  # the decoder stream, not the encoder output
    assert {stored["cross.k"], stored["cross.v"]} == {stream, 0.0}
    assert stored["o"] > 0 and stored["up"] > 0 and stored["down"] > 0  # each reads its own


def test_keys_and_values_from_a_latent_store_the_latent_once() -> None:
    """tests/models/latent_kv.py: q reads the normed stream, k and v one compressed latent (16 wide):
    k carries the latent, v nothing, q the stream (a count by role would drop the latent)."""
    stored, _ = _stored_inputs("latent_kv.py")
    assert stored["q"] == 2 * 16 * 32 * 4 and stored["k"] == 2 * 16 * 16 * 4 and stored["v"] == 0.0


def test_a_forward_holds_the_logits_it_returns() -> None:
    """Llama-3-8B's forward at 32 x 8,192 tokens in bf16 returns 62.6 GiB of logits (vocabulary
    128,256); the peak left them out (42.96 GiB on one H100, "fits"). The last stage now holds every
    output it returns: at TP 2 they need about 115 GiB per rank and the plan is refused; at 4
    sequences the peak holds their 7.8 GiB."""
    from costmodels.cluster import load_cluster  # noqa: PLC0415
    from planner.errors import InfeasibleError  # noqa: PLC0415
    from planner.solver.problem import Constraints, WorkloadSpec  # noqa: PLC0415
    from planner.solver.search import plan_model  # noqa: PLC0415
    from tests.planner_fixtures import analysed_llama  # noqa: PLC0415

    structure = analysed_llama("8b")
    cluster = load_cluster("dgx-h100")
    pins = Constraints(tp=2, pp=1, dp=1, max_devices=2)
    with pytest.raises(InfeasibleError, match=r"stage 0 needs 1\d\d\.\d GiB"):
        plan_model(structure, cluster, WorkloadSpec("forward", 32, 8192, dtype="bf16"), pins)
    four = plan_model(structure, cluster, WorkloadSpec("forward", 4, 8192, dtype="bf16"), pins)
    weights = 8.03e9 * 2 / 2  # bf16, split over two ranks
    assert four.predicted.peak_memory_bytes > weights + 4 * 8192 * 128256 * 2

"""`planner export`: each target's output is read by that target's own rules, with the plan's choices
under the target's names (the data-parallel style included: each tool's form, or the nearest by the
plan's prices with a warning), and the DTensor file runs on 2 and 4 gloo ranks equal to the
unsharded model, with its fully_shard data parallelism too.

Target names checked against the released packages' source (read, not imported: none is a
dependency; bench/exports_conformance.py feeds the exports to the real parsers): torchtitan 0.3.0
`torchtitan/config/configs.py` and `torchtitan/distributed/activation_checkpoint.py` (command-line
overrides), torchtitan 0.2.2 `torchtitan/config/job_config.py` (the last release with TOML job
files), Megatron-Core 0.19.2 `megatron/training/arguments.py` with the dataclass fields it turns into
options (`ModelParallelConfig`, `TransformerConfig`, `TrainingConfig`), vLLM 0.34.0
`vllm/engine/arg_utils.py`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import shlex
import tempfile
import types

import pytest
import torch
from torch.distributed.pipelining.schedules import get_schedule_class

from costmodels.cluster import load_cluster
from planner.cli.main import build_parser, main
from planner.cli.workflow import report_dict
from planner.errors import InputError
from planner.export import FORMATS, export_plan
from planner.export.common import NOT_PRICED, dp_label, dp_price_text, nearest_dp_form, virtual_stage_layers
from planner.export.megatron import megatron_args
from planner.export.vllm import vllm_engine_args
from planner.frontend.analysis import analyse
from planner.frontend.depth import capture_for_planning
from planner.plan import (
    DataParallel,
    Decision,
    LayerCost,
    MeshShape,
    Plan,
    Recompute,
    Schedule,
    Serving,
    SplitStyle,
    WeightSplit,
    Workload,
)
from planner.solver.problem import Constraints, WorkloadSpec
from planner.solver.search import plan_model
from runtime.launch import launch
from tests.dtensor_entry import apply_exported
from tests.models import tiny_moe_gptfast, tiny_moe_modulelist
from tests.planner_fixtures import EXAMPLES
from tests.plans import fixed_plan, meta_structure

MODELS = EXAMPLES.parent / "tests" / "models"
CORPUS = EXAMPLES.parent / "tests" / "corpus"

# torchtitan v0.2.2 job_config.py: the fields of the sections the export writes
TORCHTITAN_FIELDS = {
    "parallelism": {
        "data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
        "tensor_parallel_degree", "disable_loss_parallel", "enable_async_tensor_parallel",
        "pipeline_parallel_degree", "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
        "pipeline_parallel_expert_parallel_overlap", "context_parallel_degree", "context_parallel_load_balancer",
        "context_parallel_rotate_method", "expert_parallel_degree", "expert_tensor_parallel_degree",
        "expert_parallel_comm_backend",
    },
    "activation_checkpoint": {
        "mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns", "early_stop",
        "memory_budget", "visualize_memory_budget_pareto", "preserve_rng_state", "determinism_check", "debug",
    },
    "training": {
        "dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps",
        "enable_cpu_offload", "dtype", "mixed_precision_param", "mixed_precision_reduce", "gc_freq", "gc_debug",
        "dataloader",
    },
}  # fmt: skip
# torchtitan 0.3.0 config/configs.py: the fields of the dataclasses the overrides set
TORCHTITAN_03_FIELDS = {
    "parallelism": {
        "data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
        "enable_fsdp_symm_mem", "tensor_parallel_degree", "enable_sequence_parallel", "spmd_backend",
        "pipeline_parallel_degree", "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
        "context_parallel_degree", "context_parallel_load_balancer", "context_parallel_ptrr_mask_key",
        "expert_parallel_degree",
    },
    "training": {
        "local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps", "enable_cpu_offload",
        "disable_cuda_graphs", "dtype", "mixed_precision_param", "mixed_precision_reduce", "gc_freq", "gc_debug",
    },
    "compile": {"enable", "enable_async_tensor_parallel", "components", "backend"},
}  # fmt: skip
TORCHTITAN_03_FLAGS = {
    "training.disable_cuda_graphs",
    "parallelism.enable_sequence_parallel",
    "compile.enable",
    "compile.enable_async_tensor_parallel",
}  # tyro booleans
# torchtitan 0.3.0 ActivationCheckpointingConfig's tyro subcommands
TORCHTITAN_03_AC = {"activation-checkpoint:" + m for m in ("selective", "full", "memory-budget", "none")}
# Megatron-LM options the export may write (arguments.py and the config dataclasses' fields)
MEGATRON_FLAGS = {
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--num-layers", "--seq-length",
    "--micro-batch-size", "--global-batch-size", "--pipeline-model-parallel-layout",
    "--num-layers-per-virtual-pipeline-stage", "--sequence-parallel", "--recompute-granularity",
    "--recompute-method", "--recompute-num-layers", "--use-distributed-optimizer", "--bf16", "--fp16",
    "--overlap-grad-reduce", "--overlap-param-gather", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
    "--ckpt-format", "--num-distributed-optimizer-instances", "--tp-comm-overlap", "--context-parallel-size",
    "--cp-comm-type",
}  # fmt: skip
# Megatron-Core 0.19.2 `_add_moe_args`: the expert mesh, and the router options the routing is written with
MEGATRON_ROUTER_FLAGS = (
    "--moe-router-topk", "--moe-router-score-function", "--moe-ffn-hidden-size",
    "--moe-shared-expert-intermediate-size",
)  # fmt: skip
MEGATRON_PRE_SOFTMAX = (
    "--moe-router-pre-softmax"  # the top-k of the softmax over all experts, not renormalised
)
MEGATRON_MOE_FLAGS = {
    "--num-experts", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
    "--moe-token-dispatcher-type", "--moe-expert-capacity-factor", *MEGATRON_ROUTER_FLAGS, MEGATRON_PRE_SOFTMAX,
}  # fmt: skip
# Megatron-Core 0.19.2 --data-parallel-sharding-strategy choices and --ckpt-format choices
MEGATRON_SHARDING = {"no_shard", "optim", "optim_grads", "optim_grads_params"}
MEGATRON_CKPT_FORMATS = {"torch", "torch_dist", "torch_dcp", "fsdp_dtensor"}
TORCHTITAN_RESHARD = {"default", "always", "never"}  # fsdp_reshard_after_forward, 0.2.2 and 0.3.0
VLLM_ENGINE_ARGS = {
    "model", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "dtype", "max_model_len",
    "max_num_seqs",
}  # fmt: skip
VLLM_DTYPES = {"auto", "half", "float16", "bfloat16", "float", "float32"}


@pytest.fixture(scope="module")
def llama_plan(captured) -> Plan:
    """Tiny Llama-3 (4 layers) with Megatron splits at tp=2, as a training plan."""
    plan = fixed_plan(analyse(captured("llama3").gm), str(EXAMPLES / "llama3.py"), 2, workload="train")
    plan.dtype = "bf16"
    return plan


def _with(plan: Plan, **changes) -> Plan:
    return dataclasses.replace(plan, **changes)


# ---------------------------------------------------------------------------------------------
# DTensor: the exported file, run on 2 gloo ranks against the unsharded model


def _served(plan: Plan) -> Plan:
    """`plan` as a decode plan of a served request (KV caches of 80 positions)."""
    return _with(
        plan, workload=Workload.DECODE, context=64, seq_len=1, serving=Serving(64, 16, 80, 0.01, 0.001, 100.0)
    )


def _dtensor_jobs(captured, tp: int) -> dict[str, tuple]:
    """Every layout the DTensor export claims, at `tp`: the example Llama-3, a Hugging Face Llama, with
    and without sequence parallel; GPT-2 (fused c_attn, tied head, position embedding added to the
    token embedding's output); a decode step of the cached Llama-3 and of transformers' static-cache
    Llama."""

    def plan(name: str, **changes) -> Plan:
        return _with(
            fixed_plan(analyse(captured(name).gm), str(EXAMPLES / f"{name}.py"), tp), dtype="bf16", **changes
        )

    def job(name: str, exported: Plan, *mode: str) -> tuple:
        return (str(EXAMPLES / f"{name}.py"), export_plan(exported, "dtensor").text, *mode)

    llama = plan("llama3", workload=Workload.TRAIN)
    hf = plan("hf_llama", workload=Workload.TRAIN)
    jobs = {
        "llama3": job("llama3", llama),
        "llama3_sp": job("llama3", _with(llama, sequence_parallel=True)),
        "hf_llama": job("hf_llama", hf),
        # a Hugging Face attention sizes its views from its input's shape and builds its positions from the
        # embedding's output: given the rank's part of the sequence it failed in apply_rotary_pos_emb
        "hf_llama_sp": job("hf_llama", _with(hf, sequence_parallel=True)),
        "llama3_kv_decode": job("llama3_kv", _served(plan("llama3_kv")), "decode"),
        "hf_llama_kv_decode": job("hf_llama_kv", _served(plan("hf_llama_kv")), "decode"),
    }
    if tp == 2 and importlib.util.find_spec("peft") is not None:
        # PEFT's LoRA adapters split with their projections (down whole and up column-parallel beside a
        # column-parallel one; down row-parallel, up whole beside a row-parallel one), base weights frozen
        lora = plan_model(
            analyse(captured("hf_llama_lora").gm), load_cluster("local-cpu", nproc=2), WorkloadSpec("train", 2, 16),
            Constraints(tp=2, layout="megatron"),
        )  # fmt: skip
        jobs["hf_llama_lora"] = job("hf_llama_lora", lora)
    if tp == 2:
        # Qwen3's per-head q_norm / k_norm run on the rank's heads: their gradients summed over the ranks
        # (each rank's were its own heads' part, 0.46-0.88 off, before they took SequenceParallel)
        qwen3 = str(CORPUS / "hf_qwen3.py")
        jobs["hf_qwen3"] = (
            qwen3,
            export_plan(_with(fixed_plan(meta_structure(qwen3, 2, 16), qwen3, tp, workload="train"),
                              dtype="bf16"), "dtensor").text,
        )  # fmt: skip
        gpt = plan("gpt2_tiny", workload=Workload.TRAIN)
        jobs["gpt2_tiny"] = job("gpt2_tiny", gpt)
        jobs["gpt2_tiny_sp"] = job("gpt2_tiny", _with(gpt, sequence_parallel=True))
        # sequence parallel with the token embedding kept whole (the norm after it once took the whole
        # sequence as its rank's part: a RoPE shape error)
        whole = {
            **llama.splits,
            "tok_embeddings.weight": WeightSplit("tok_embeddings.weight", SplitStyle.REPLICATE, 0),
        }
        jobs["llama3_sp_whole_embedding"] = job("llama3", _with(llama, sequence_parallel=True, splits=whole))
        # ops over the full width between an MLP's linears: run replicated in the plan, so the column-parallel
        # output is gathered and the row-parallel input replicated (a plain pair normalised each shard alone)
        # (planned as `planner optimize` plans: lowering finds the gathers and plans those ops replicated)
        width = str(MODELS / "width_ops_mlp.py")
        with tempfile.TemporaryDirectory() as tmp:
            out = f"{tmp}/plan.yaml"
            assert main(["optimize", width, "--cluster", "local-cpu", "--nproc", "2", "--tp", "2", "--layout",
                         "megatron", "--workload", "train", "--batch-size", "2", "--seq-len", "8", "--out", out]) == 0  # fmt: skip
            wide = Plan.from_yaml(out)
        assert all(s.gather_output for w, s in wide.splits.items() if w.endswith("up1.weight"))
        jobs["width_ops_mlp"] = (width, export_plan(wide, "dtensor").text)
    return jobs


def _check_dtensor_ranks(ranks: list[dict], tp: int) -> None:
    for rank in ranks:
        for name, got in rank.items():
            assert got["max_abs_diff"] <= 1e-5 * got["scale"], (name, got)
            if "grad_max_abs_diff" in got:
                assert got["grad_max_abs_diff"] <= 1e-6, (name, got)  # a training step too
        # the weights really are sharded: Q's rows, wo's columns, the vocabulary
        llama = rank["llama3"]["local_shapes"]
        assert llama["layers.0.attention.wq.weight"] == (128 // tp, 128)
        assert llama["layers.0.attention.wo.weight"] == (128, 128 // tp)
        assert llama["tok_embeddings.weight"] == (256 // tp, 128) and llama["output.weight"] == (
            256 // tp,
            128,
        )
        assert "norm.weight" in rank["llama3_sp"]["local_shapes"]  # sequence parallel norms are DTensors
        assert rank["hf_llama_sp"]["local_shapes"]["model.layers.0.self_attn.q_proj.weight"] == (
            128 // tp,
            128,
        )
        # each rank's KV caches hold its own 4 / tp KV heads (dim 1 of (B, heads, positions, head dim))
        for name in ("llama3_kv_decode", "hf_llama_kv_decode"):
            cut, whole = rank[name]["cache_shapes"], rank[name]["reference_cache_shapes"]
            assert cut and set(cut) == set(whole), name
            for key, shape in whole.items():
                assert cut[key] == (shape[0], shape[1] // tp, *shape[2:]), (name, key, cut[key])
        if tp == 2:
            gpt_shapes = rank["gpt2_tiny"]["local_shapes"]
            assert gpt_shapes["transformer.h.0.attn.c_attn.weight"] == (96, 64)  # fused q, k, v: half of each
            assert rank["gpt2_tiny"]["tied"]  # token embedding split with the tied LM head, tied again
            assert rank["width_ops_mlp"]["local_shapes"]["blocks.0.up1.weight"] == (32, 32)  # really split


@pytest.mark.slow
def test_dtensor_export_runs_equal_to_the_unsharded_model_on_two_gloo_ranks(captured):
    """Every layout the export claims, in one launch: forward and backward (decode: a prefill and a
    decode step with the per-rank caches apply() cuts) equal to the unsharded model's."""
    jobs = _dtensor_jobs(captured, 2)
    assert "FIRST_LAYER = None" in jobs["llama3"][1] and "FIRST_LAYER = 'layers.0'" in jobs["llama3_sp"][1]
    assert "FIRST_LAYER = 'model.layers.0'" in jobs["hf_llama_sp"][1]
    assert "KV_CACHES = True" in jobs["llama3_kv_decode"][1] and "KV_CACHES = False" in jobs["llama3"][1]
    # a block gathers its input once: its projections take it whole; the LM head gathers its own
    assert "'layers.0.attention.wq': ColwiseParallel()," in jobs["llama3_sp"][1]
    assert "'layers.0.attention.wo': RowwiseParallel(output_layouts=Shard(1))," in jobs["llama3_sp"][1]
    _check_dtensor_ranks(launch(apply_exported, jobs, 2, timeout_s=300), 2)


@pytest.mark.slow
def test_dtensor_export_runs_equal_to_the_unsharded_model_on_four_gloo_ranks(captured):
    _check_dtensor_ranks(launch(apply_exported, _dtensor_jobs(captured, 4), 4, timeout_s=300), 4)


@pytest.mark.slow
def test_dtensor_data_parallel_export_runs_equal_to_the_unsharded_model_on_four_gloo_ranks(captured):
    """The file's own mesh (init_mesh) and fully_shard composed with its tensor parallelism, in one
    launch of 4 gloo ranks (fully_shard runs on CPU with gloo in torch 2.13, its reduce-scatter
    included): FSDP x TP2, HSDP 2x2 without reshard after forward at TP1, DDP (a replicate dim over a
    shard dim of 1) x TP2 under sequence parallel, and GPT-2's ZeRO-1 (exported as FSDP, tied head)
    x TP2. Every rank feeds the same batch, so outputs and averaged gradients equal the unsharded
    model's; the local shapes show the shards. A bf16 plan's fully_shard computes in bf16 (its
    MixedPrecisionPolicy: it was left out, and the file ran a bf16 plan in fp32), within bf16's
    tolerance of the fp32 model."""

    def plan(
        name: str, tp: int, dp: int, style: DataParallel, shard: int = 1, dtype: str = "fp32", **changes
    ) -> Plan:
        base = fixed_plan(analyse(captured(name).gm), str(EXAMPLES / f"{name}.py"), tp, workload="train")
        return _with(base, dtype=dtype, mesh=MeshShape(tp, 1, dp), dp_style=style, dp_shard=shard, **changes)

    def job(name: str, exported: Plan) -> tuple:
        return (str(EXAMPLES / f"{name}.py"), export_plan(exported, "dtensor").text, "whole")

    jobs = {
        "llama3_fsdp": job("llama3", plan("llama3", 2, 2, DataParallel.FSDP, 2)),
        "llama3_hsdp_noreshard": job(
            "llama3", plan("llama3", 1, 4, DataParallel.FSDP, 2, reshard_after_forward=False)
        ),
        "hf_llama_sp_ddp": job("hf_llama", plan("hf_llama", 2, 2, DataParallel.DDP, sequence_parallel=True)),
        "gpt2_tiny_zero1": job("gpt2_tiny", plan("gpt2_tiny", 2, 2, DataParallel.ZERO1, 2)),
        "llama3_fsdp_bf16": job("llama3", plan("llama3", 2, 2, DataParallel.FSDP, 2, dtype="bf16")),
    }
    assert "DP_STYLE = 'hsdp 2x2-noreshard'" in jobs["llama3_hsdp_noreshard"][1]
    assert "DP_STYLE = 'fsdp-noreshard'" in jobs["gpt2_tiny_zero1"][1]
    ranks = launch(apply_exported, jobs, 4, timeout_s=300)
    for rank in ranks:
        bf16 = rank.pop("llama3_fsdp_bf16")
        assert bf16["dtype"] == "torch.bfloat16", bf16["dtype"]
        assert 0 < bf16["max_abs_diff"] <= 3e-2 * bf16["scale"], bf16
        assert bf16["grad_max_abs_diff"] <= 5e-2 * bf16["grad_scale"], bf16
        for name, got in rank.items():
            assert got["dtype"] == "torch.float32", (name, got["dtype"])
            assert got["max_abs_diff"] <= 1e-5 * got["scale"], (name, got["max_abs_diff"])
            assert got["grad_max_abs_diff"] <= 1e-6, (name, got["grad_max_abs_diff"])
        shapes = {name: got["local_shapes"] for name, got in rank.items()}
        # wq (128, 128): rows split over tp=2, then over dp_shard=2; wo (128, 128): columns over tp, rows over dp
        assert shapes["llama3_fsdp"]["layers.0.attention.wq.weight"] == (32, 128)
        assert shapes["llama3_fsdp"]["layers.0.attention.wo.weight"] == (64, 64)
        assert shapes["llama3_fsdp"]["tok_embeddings.weight"] == (64, 128)  # vocab 256 / tp 2 / dp 2
        assert shapes["llama3_hsdp_noreshard"]["layers.0.attention.wq.weight"] == (
            64,
            128,
        )  # 2 shards, 2 replicas
        assert "Replicate()" in rank["llama3_hsdp_noreshard"]["placements"]["layers.0.attention.wq.weight"]
        assert shapes["hf_llama_sp_ddp"]["model.layers.0.self_attn.q_proj.weight"] == (64, 128)  # tp only
        assert shapes["gpt2_tiny_zero1"]["transformer.h.0.attn.c_attn.weight"] == (
            48,
            64,
        )  # 192 / tp 2 / dp 2
        assert rank["gpt2_tiny_zero1"]["tied"]


def test_dtensor_plan_maps_splits_to_styles(llama_plan):
    text = export_plan(llama_plan, "dtensor").text
    assert 'init_device_mesh("cpu", (2,))' in text  # the plan's cluster is gloo (local-cpu)
    assert (
        'init_device_mesh("cuda", (2,))' in export_plan(_with(llama_plan, cluster="dgx-h100"), "dtensor").text
    )
    exported = types.ModuleType("exported")
    exec(compile(text, "<export>", "exec"), exported.__dict__)
    plan = exported.PLAN
    assert type(plan["layers.0.attention.wq"]).__name__ == "ColwiseParallel"
    assert type(plan["layers.3.feed_forward.w2"]).__name__ == "RowwiseParallel"
    assert exported.VOCAB == ["output", "tok_embeddings"] and exported.TP_BLOCKS[:2] == [
        "layers.0.attention",
        "layers.0.feed_forward",
    ]
    # a colwise projection without a rowwise sibling gathers its output; a lone rowwise takes it whole
    lone = dict(llama_plan.splits)
    for i in range(4):
        lone[f"layers.{i}.attention.wo.weight"] = dataclasses.replace(
            lone[f"layers.{i}.attention.wo.weight"], style=SplitStyle.REPLICATE
        )
    text = export_plan(_with(llama_plan, splits=lone), "dtensor").text
    assert "'layers.0.attention.wq': ColwiseParallel(output_layouts=Replicate())" in text
    assert (
        "'layers.0.attention.wo'" not in text and "'layers.0.attention'" not in text.split("TP_BLOCKS =")[1]
    )


def test_dtensor_refuses_a_row_parallel_projection_of_the_block_input(llama_plan):
    """A plan the solver chose on nearly free links, "colwise q, rowwise k v o": a RowwiseParallel k
    took the replicated block input as its shard (a crash, or wrong outputs with sequence parallel).
    The export names the split and apply() refuses it; Megatron's pairing exports as before."""
    odd = dict(llama_plan.splits)
    for name in ("wk", "wv"):
        weight = f"layers.1.attention.{name}.weight"
        odd[weight] = dataclasses.replace(odd[weight], style=SplitStyle.ROWWISE, dim=1)
    exported = export_plan(_with(llama_plan, splits=odd), "dtensor")
    assert any(
        w.startswith("layers.1.attention.wk: the plan splits this 'k' projection row-wise")
        for w in exported.warnings
    )
    module = types.ModuleType("exported")
    exec(compile(exported.text, "<export>", "exec"), module.__dict__)
    assert set(module.UNSUPPORTED) == {"layers.1.attention.wk", "layers.1.attention.wv"}
    with pytest.raises(
        ValueError, match="layers.1.attention.wk: the plan splits this 'k' projection row-wise"
    ):
        module.apply(torch.nn.Linear(2, 2), None)
    megatron = export_plan(_with(llama_plan, splits=odd), "megatron")
    assert any("against Megatron's pairing" in w and "layers.1.attention.wk" in w for w in megatron.warnings)
    assert not any("against Megatron's pairing" in w for w in export_plan(llama_plan, "megatron").warnings)
    # K/V heads replicated over ranks (fewer KV heads than tp) have no 1-D DTensor style either
    shared = dict(llama_plan.splits)
    weight = "layers.0.attention.wk.weight"
    shared[weight] = dataclasses.replace(shared[weight], pieces=1)
    heads = types.ModuleType("heads")
    exec(
        compile(export_plan(_with(llama_plan, splits=shared), "dtensor").text, "<export>", "exec"),
        heads.__dict__,
    )
    assert "KV heads over tp=2" in heads.UNSUPPORTED["layers.0.attention.wk"]
    plain = types.ModuleType("plain")
    exec(compile(export_plan(llama_plan, "dtensor").text, "<export>", "exec"), plain.__dict__)
    assert plain.UNSUPPORTED == {}


def test_dtensor_refuses_sequence_parallel_blocks_that_hold_attention_and_mlp(llama_plan):
    """A layer whose q/k/v/o and gate/up/down (and norms) are modules of the layer itself, with no
    attention or MLP submodule: under sequence parallelism apply() gathered the layer's input once and
    its norm met a DTensor ("aten.mul.Tensor got mixed torch.Tensor and DTensor", from inside torch).
    The export names the block and apply() refuses it; without sequence parallelism it exports as before."""
    flat = {
        w.replace(".attention.", ".")
        .replace(".feed_forward.", ".")
        .replace(".mlp.", "."): dataclasses.replace(
            s, weight=w.replace(".attention.", ".").replace(".feed_forward.", ".").replace(".mlp.", ".")
        )
        for w, s in llama_plan.splits.items()
    }
    exported = export_plan(_with(llama_plan, splits=flat, sequence_parallel=True), "dtensor")
    module = types.ModuleType("flat")
    exec(compile(exported.text, "<export>", "exec"), module.__dict__)
    assert (
        "layers.0" in module.TP_BLOCKS
        and "holds 2 row-parallel projections" in module.UNSUPPORTED["layers.0"]
    )
    assert any(w.startswith("layers.0: under sequence parallelism") for w in exported.warnings)
    with pytest.raises(ValueError, match="layers.0: under sequence parallelism"):
        module.apply(torch.nn.Linear(2, 2), None)
    plain = types.ModuleType("flat_no_sp")
    exec(
        compile(export_plan(_with(llama_plan, splits=flat), "dtensor").text, "<export>", "exec"),
        plain.__dict__,
    )
    assert plain.UNSUPPORTED == {}


def test_dtensor_cuts_the_kv_caches_only_when_attention_heads_are_split(llama_plan):
    """A served plan with attention split by heads: apply() cuts the KV caches to the rank's heads
    itself (once only a warning told the user to). One whose weights all stay replicated exports an
    empty PLAN and leaves the caches whole (the replicated attention reads every head)."""
    served = _served(llama_plan)
    text = export_plan(served, "dtensor").text
    assert "KV_CACHES = True" in text and "KV caches: after sharding" in text
    assert not any("cache" in w for w in export_plan(served, "dtensor").warnings)
    replicated = {
        w: dataclasses.replace(sp, style=SplitStyle.REPLICATE, dim=0) for w, sp in served.splits.items()
    }
    assert "KV_CACHES = False" in export_plan(_with(served, splits=replicated), "dtensor").text
    assert "KV_CACHES = False" in export_plan(llama_plan, "dtensor").text  # training: no caches to cut


def test_dtensor_warns_for_what_a_tp_plan_cannot_hold(llama_plan):
    plan = _with(llama_plan, ladder_layers=[2, 3], recompute={"layer": Recompute.FULL})
    plan = _with(plan, mesh=dataclasses.replace(plan.mesh, dp=2))
    warnings = "\n".join(export_plan(plan, "dtensor").warnings)
    assert "ladder residual (layers [2, 3])" in warnings and "torch.utils.checkpoint" in warnings
    assert "dp=2" not in warnings  # the file applies the data parallelism itself (fully_shard)
    staged = _with(plan, mesh=dataclasses.replace(plan.mesh, pp=2), stages=[[0, 1], [2, 3]])
    warnings = "\n".join(export_plan(staged, "dtensor").warnings)
    assert (
        "torch.distributed.pipelining yourself" in warnings
        and "apply_data_parallel(stage_module, mesh)" in warnings
    )


# ---------------------------------------------------------------------------------------------
# torchtitan


def _titan(plan: Plan) -> tuple[dict, list[str]]:
    """torchtitan 0.2's TOML sections, read as TOML."""
    tomllib = pytest.importorskip("tomllib", reason="reading TOML needs Python 3.11")
    result = export_plan(plan, "torchtitan", torchtitan_version="0.2")
    return tomllib.loads(result.text), result.warnings


def test_torchtitan_toml_parses_with_torchtitans_field_names(llama_plan):
    plan = _with(
        llama_plan,
        mesh=dataclasses.replace(llama_plan.mesh, pp=2, dp=2),
        stages=[[0, 1, 2], [3]],
        batch_size=8,
        micro_batches=2,
        recompute={"layer": Recompute.FULL},
    )
    toml, warnings = _titan(plan)
    for section, fields in toml.items():
        assert set(fields) <= TORCHTITAN_FIELDS[section], (section, set(fields) - TORCHTITAN_FIELDS[section])
    par = toml["parallelism"]
    assert (par["tensor_parallel_degree"], par["pipeline_parallel_degree"]) == (2, 2)
    # torchtitan's DDP runs alone (its parallelize raises with TP or PP): the replicas go out as FSDP shards
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (1, 2)
    assert (
        par["fsdp_reshard_after_forward"] == "never"
    )  # DDP's traffic: the parameters whole through the step
    assert any("torchtitan 0.2 has no DDP with TP or PP" in w and NOT_PRICED in w for w in warnings)
    alone, _ = _titan(
        _with(
            llama_plan, mesh=dataclasses.replace(llama_plan.mesh, tp=1, dp=2), batch_size=8, micro_batches=2
        )
    )
    assert (
        alone["parallelism"]["data_parallel_replicate_degree"],
        alone["parallelism"]["data_parallel_shard_degree"],
    ) == (2, 1)
    # without pipeline stages each micro-batch is one of torchtitan's gradient-accumulation steps:
    # global 8 / (local 2 x dp 2) = 2 steps of 2 sequences, the plan's micro-batches (not one step of 4)
    assert (alone["training"]["global_batch_size"], alone["training"]["local_batch_size"]) == (8, 2)
    assert par["pipeline_parallel_microbatch_size"] == 2  # 8 sequences / dp 2 / 2 micro-batches
    assert par["module_fqns_per_model_part"] == [
        ["tok_embeddings", "layers.0", "layers.1", "layers.2"],
        ["layers.3", "norm", "output"],
    ]  # the uneven stages, exactly
    assert par["disable_loss_parallel"] is False  # the LM head is vocabulary-split: loss parallel
    get_schedule_class(par["pipeline_parallel_schedule"])  # a schedule torch.distributed.pipelining knows
    assert toml["activation_checkpoint"] == {"mode": "full"}
    assert toml["training"] == {
        "global_batch_size": 8, "local_batch_size": 4, "seq_len": plan.seq_len, "mixed_precision_param": "bfloat16",
        "mixed_precision_reduce": "bfloat16",  # the plan's 16-bit gradients (torchtitan's default: float32)
    }  # fmt: skip
    fp32_grads, _ = _titan(_with(plan, grad_reduce_dtype="fp32"))
    assert fp32_grads["training"]["mixed_precision_reduce"] == "float32"
    assert any("sequence parallel" in w for w in warnings)  # torchtitan's TP always is; the plan is not


def test_torchtitan_interleaved_zero1_and_selective(llama_plan):
    plan = _with(
        llama_plan,
        mesh=dataclasses.replace(llama_plan.mesh, pp=2, dp=2),
        stages=[[0, 2], [1, 3]],
        schedule=Schedule.INTERLEAVED_1F1B,
        virtual_stages=2,
        micro_batches=1,
        batch_size=4,
        dp_style=DataParallel.ZERO1,
        dp_shard=2,
        sequence_parallel=True,
        recompute={"layer": Recompute.SELECTIVE},
    )
    toml, warnings = _titan(plan)
    par = toml["parallelism"]
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B"
    get_schedule_class(par["pipeline_parallel_schedule"])
    # virtual stage c * pp + r is run c of rank r: layer 0, 1, 2, 3 in pipeline order
    assert [p[-1] if p[-1].startswith("layers") else p[-3] for p in par["module_fqns_per_model_part"]] == [
        "layers.0", "layers.1", "layers.2", "layers.3",
    ]  # fmt: skip
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (1, 2)
    assert toml["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    assert par["fsdp_reshard_after_forward"] == "never"  # the plan priced no other style: ZeRO-2's traffic
    assert any("torchtitan has no ZeRO-1" in w and NOT_PRICED in w for w in warnings) and not any(
        "always runs sequence parallel" in w for w in warnings
    )
    assert not any("pytorch/pytorch#136380" in w for w in warnings)  # one micro-batch: one buffer each
    _, more = _titan(_with(plan, micro_batches=4, batch_size=16))
    assert any("pytorch/pytorch#136380" in w and "4 micro-batches" in w for w in more)


def _titan03(plan: Plan) -> tuple[list[str], list[str]]:
    """torchtitan 0.3's override array, read as bash would (shlex), and the warnings."""
    result = export_plan(plan, "torchtitan")
    body = re.search(r"PLANNER_TORCHTITAN_ARGS=\(\n(.*?)\n\)", result.text, re.S)
    assert body, result.text
    return shlex.split(body.group(1)), result.warnings


def _titan03_options(argv: list[str]) -> dict[str, list[str]]:
    """--section.field -> its values (none for a flag), checked against 0.3.0's names on the way;
    the activation-checkpoint subcommand under "subcommand" (it must come last)."""
    options: dict[str, list[str]] = {}
    current = None
    for item in argv:
        if item.startswith("--"):
            name = item[2:]
            section, _, key = name.partition(".")
            flag = name.replace(".no_", ".")
            assert key.removeprefix("no_") in TORCHTITAN_03_FIELDS[section], name
            if key.startswith("no_"):
                assert flag in TORCHTITAN_03_FLAGS, name
            current = options.setdefault(item, [])
        elif item.startswith("activation-checkpoint:"):
            assert item in TORCHTITAN_03_AC and item == argv[-1], item
            options["subcommand"] = [item]
        else:
            assert current is not None, item
            current.append(item)
    for flag in TORCHTITAN_03_FLAGS:
        assert not options.get("--" + flag), flag  # a tyro flag takes no value
    return options


def test_torchtitan_03_overrides_use_03_names_and_module_names(llama_plan):
    """torchtitan 0.3 reads no TOML: command-line overrides in 0.3.0's names, async TP, loss parallel and
    the selective option not written (moved under compile / removed), PP with disable_cuda_graphs,
    the stage list ending in 0.3's `lm_head` (a list naming `output` made every stage drop the head)."""
    plan = _with(
        llama_plan,
        mesh=dataclasses.replace(llama_plan.mesh, pp=2, dp=2),
        stages=[[0, 2], [1, 3]],
        schedule=Schedule.INTERLEAVED_1F1B,
        virtual_stages=2,
        micro_batches=2,
        batch_size=8,
        sequence_parallel=False,
        recompute={"layer": Recompute.SELECTIVE},
    )
    argv, warnings = _titan03(plan)
    options = _titan03_options(argv)
    assert options["--parallelism.tensor_parallel_degree"] == ["2"]
    assert options["--parallelism.pipeline_parallel_degree"] == ["2"]
    # 0.3 replicates with TP and PP (fully_shard's replicate dimension): the plan's DDP, not FSDP
    assert options["--parallelism.data_parallel_replicate_degree"] == ["2"]
    assert options["--parallelism.data_parallel_shard_degree"] == ["1"]
    assert options["--parallelism.pipeline_parallel_schedule"] == ["Interleaved1F1B"]
    assert options["--parallelism.pipeline_parallel_microbatch_size"] == ["2"]  # 8 / dp 2 / 2
    parts = [p.split(",") for p in options["--parallelism.module_fqns_per_model_part"]]
    assert parts == [
        ["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm", "lm_head"],
    ]  # fmt: skip
    assert "--training.disable_cuda_graphs" in options  # 0.3's Trainer.Config refuses CUDA graphs with PP
    assert "--parallelism.no_enable_sequence_parallel" in options  # the plan's plain TP, expressible in 0.3
    assert options["subcommand"] == ["activation-checkpoint:selective"]
    assert options["--training.local_batch_size"] == ["4"] and options["--training.global_batch_size"] == [
        "8"
    ]
    assert options["--training.mixed_precision_param"] == ["bfloat16"]
    assert not any(
        "enable_async_tensor_parallel" in a or "loss_parallel" in a or "selective_ac" in a for a in argv
    )
    assert not any("always runs sequence parallel" in w or "has no DDP" in w for w in warnings)
    assert "--parallelism.fsdp_reshard_after_forward" not in options  # nothing sharded: no policy
    # no recomputation: the base config's own checkpointing (llama3_8b: selective) is switched off
    none, _ = _titan03(_with(llama_plan, recompute={}))
    assert none[-1] == "activation-checkpoint:none" and "--training.disable_cuda_graphs" not in none
    # ZeRO-1 has no torchtitan form: FSDP shards, said so
    zero, zero_warnings = _titan03(_with(plan, dp_style=DataParallel.ZERO1, dp_shard=2))
    assert _titan03_options(zero)["--parallelism.data_parallel_shard_degree"] == ["2"]
    assert any("torchtitan has no ZeRO-1" in w and NOT_PRICED in w for w in zero_warnings)


def test_torchtitan_async_tp_as_planned(llama_plan):
    """TP overlap is torchtitan's async TP, which runs only compiled: 0.3 --compile.enable and
    --compile.enable_async_tensor_parallel; 0.2 parallelism.enable_async_tensor_parallel with a
    [compile] section; both say so. Without it neither is written (0.2: false)."""
    plan = _with(llama_plan, tp_comm_overlap=True, sequence_parallel=True)
    argv, warnings = _titan03(plan)
    options = _titan03_options(argv)
    assert "--compile.enable" in options and "--compile.enable_async_tensor_parallel" in options
    assert any("async TP" in w and "torch.compile" in w for w in warnings)
    off = _titan03_options(_titan03(_with(plan, tp_comm_overlap=False))[0])
    assert not any(k.startswith("--compile.") for k in off)
    sections, warnings = _titan(plan)
    assert sections["parallelism"]["enable_async_tensor_parallel"] is True
    assert sections["compile"] == {"enable": True, "components": ["model", "loss"]}
    assert any("async TP" in w for w in warnings)
    sections, _ = _titan(_with(plan, tp_comm_overlap=False))
    assert sections["parallelism"]["enable_async_tensor_parallel"] is False and "compile" not in sections


def test_torchtitan_02_bf16_without_fsdp_writes_the_dtype_and_says_why(llama_plan):
    """torchtitan 0.2 applies mixed precision only through FSDP (or autocast without TP and PP): a
    bf16 TP plan without data-parallel shards trained in fp32, silently. The TOML sets training.dtype
    and the warning names the trap; with FSDP shards, and in 0.3, nothing changes."""
    toml, warnings = _titan(llama_plan)  # tp=2, dp=1, bf16
    assert toml["training"]["dtype"] == "bfloat16"
    assert any("Mixed precision training with TP or PP is only supported" in w for w in warnings)
    sharded, sharded_warnings = _titan(
        _with(
            llama_plan,
            mesh=dataclasses.replace(llama_plan.mesh, dp=2),
            batch_size=4,
            dp_style=DataParallel.FSDP,
            dp_shard=2,
        )
    )
    assert "dtype" not in sharded["training"] and not any("only through FSDP" in w for w in sharded_warnings)
    fp32, _ = _titan(_with(llama_plan, dtype="fp32"))
    assert "dtype" not in fp32["training"] and fp32["training"]["mixed_precision_param"] == "float32"
    argv, warnings03 = _titan03(llama_plan)
    assert not any(a.startswith("--training.dtype") for a in argv) and not any(
        "FSDP" in w for w in warnings03
    )


def test_torchtitan_version_option(tmp_path, llama_plan, capsys):
    path = tmp_path / "plan.yaml"
    llama_plan.to_yaml(path)
    assert main(["export", str(path), "--to", "torchtitan"]) == 0
    assert "PLANNER_TORCHTITAN_ARGS=(" in capsys.readouterr().out
    assert main(["export", str(path), "--to", "torchtitan", "--torchtitan-version", "0.2"]) == 0
    assert "[parallelism]" in capsys.readouterr().out
    assert main(["export", str(path), "--to", "megatron", "--torchtitan-version", "0.2"]) == 0
    assert "--torchtitan-version 0.2 had no effect" in capsys.readouterr().err
    with pytest.raises(InputError, match="torchtitan 0.3 or 0.2"):
        export_plan(llama_plan, "torchtitan", torchtitan_version="0.1")
    assert export_plan(llama_plan, "torchtitan", torchtitan_version="0.2.2").text.startswith(
        "# torchtitan 0.2"
    )


def test_virtual_stage_layers_needs_one_run_per_chunk(llama_plan):
    plan = _with(llama_plan, mesh=dataclasses.replace(llama_plan.mesh, pp=2), stages=[[0, 1], [2, 3]])
    assert virtual_stage_layers(plan) == [[0, 1], [2, 3]]
    with pytest.raises(InputError, match="virtual_stages is 2"):
        virtual_stage_layers(_with(plan, virtual_stages=2, schedule=Schedule.INTERLEAVED_1F1B))


# ---------------------------------------------------------------------------------------------
# Megatron-LM


def _megatron_argv(plan: Plan) -> tuple[list[str], list[str]]:
    """The exported bash file's array, read as bash would (shlex), and the warnings."""
    result = export_plan(plan, "megatron")
    body = re.search(r"PLANNER_MEGATRON_ARGS=\(\n(.*?)\n\)", result.text, re.S)
    assert body, result.text
    return shlex.split(body.group(1)), result.warnings


def _expand_layout(layout: str) -> list[str]:
    """Megatron-LM's layout string unrolled (its parse_str_to_list rules: "t*3" -> "ttt", "|" splits)."""
    layout = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout.replace(",", ""))
    layout = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout)
    return layout.split("|")


def test_megatron_arguments_are_megatrons_names_and_values(llama_plan):
    plan = _with(
        llama_plan,
        mesh=dataclasses.replace(llama_plan.mesh, pp=2, dp=2),
        stages=[[0, 1, 2], [3]],
        batch_size=16,
        micro_batches=4,
        sequence_parallel=True,
        dp_style=DataParallel.ZERO1,
        dp_shard=2,
        recompute={"layer": Recompute.FULL},
    )
    argv, warnings = _megatron_argv(plan)
    assert {a for a in argv if a.startswith("--")} <= MEGATRON_FLAGS
    assert argv == megatron_args(plan)[0]
    args = dict(zip(argv, [*argv[1:], ""]))
    assert args["--tensor-model-parallel-size"] == "2" and args["--pipeline-model-parallel-size"] == "2"
    assert args["--micro-batch-size"] == "2" and args["--global-batch-size"] == "16"  # 16 / dp 2 / 4
    assert args["--num-layers"] == "4" and args["--seq-length"] == str(plan.seq_len)
    assert _expand_layout(args["--pipeline-model-parallel-layout"]) == ["Ettt", "tL"]
    assert args["--recompute-granularity"] == "full" and args["--recompute-method"] == "uniform"
    assert args["--recompute-num-layers"] == "1"
    assert {"--sequence-parallel", "--use-distributed-optimizer", "--bf16"} <= set(argv)
    assert any("uneven pipeline stages (3 + 1 layers)" in w for w in warnings)
    # the data-parallel overlap as planned: off here, so not passed; on, both flags
    assert not {"--overlap-grad-reduce", "--overlap-param-gather"} & set(argv)
    overlapped, _ = _megatron_argv(_with(plan, overlap_grad_reduce=True, overlap_param_gather=True))
    assert {"--overlap-grad-reduce", "--overlap-param-gather"} <= set(overlapped)
    # TP overlap with sequence parallelism: --tp-comm-overlap; without it, not exported and warned
    tp_on, _ = _megatron_argv(_with(plan, tp_comm_overlap=True))
    assert "--tp-comm-overlap" in tp_on and "--tp-comm-overlap" not in argv
    no_sp, no_sp_warnings = _megatron_argv(_with(plan, tp_comm_overlap=True, sequence_parallel=False))
    assert "--tp-comm-overlap" not in no_sp
    assert any("needs --sequence-parallel" in w for w in no_sp_warnings)
    # Megatron's fp32 main gradients: 2 bytes per parameter the plan (16-bit gradients) does not hold
    main_grads = [w for w in warnings if "main_grad" in w]
    assert main_grads and "GiB more per rank" in main_grads[0] and "--grad-reduce-dtype fp32" in main_grads[0]
    # a plan priced with fp32 gradients is what Megatron-LM runs by default: nothing to warn about
    _, fp32_warnings = _megatron_argv(_with(plan, grad_reduce_dtype="fp32"))
    assert not any("main_grad" in w for w in fp32_warnings)
    no_dp, _ = _megatron_argv(_with(plan, mesh=dataclasses.replace(plan.mesh, dp=1), batch_size=8))
    assert "--overlap-grad-reduce" not in no_dp


def test_megatron_file_exports_cuda_device_max_connections_with_tp(llama_plan):
    """Megatron-Core 0.19's validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with TP > 1 on Hopper:
    the sourced file sets it (before the array), only when TP > 1."""
    text = export_plan(llama_plan, "megatron").text
    assert "\nexport CUDA_DEVICE_MAX_CONNECTIONS=1\nPLANNER_MEGATRON_ARGS=(" in text
    tp1 = _with(llama_plan, mesh=dataclasses.replace(llama_plan.mesh, tp=1), splits={})
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in export_plan(tp1, "megatron").text


def test_megatron_interleaved_even_stages_and_warnings(llama_plan):
    plan = _with(
        llama_plan,
        mesh=dataclasses.replace(llama_plan.mesh, pp=2),
        stages=[[0, 2], [1, 3]],
        schedule=Schedule.INTERLEAVED_1F1B,
        virtual_stages=2,
        micro_batches=2,
        ladder_layers=[3],
        recompute={"layer": Recompute.SELECTIVE, "head": Recompute.NONE},
    )
    argv, warnings = _megatron_argv(plan)
    args = dict(zip(argv, [*argv[1:], ""]))
    assert (
        args["--num-layers-per-virtual-pipeline-stage"] == "1"
        and "--pipeline-model-parallel-layout" not in args
    )
    assert args["--recompute-granularity"] == "selective" and "--recompute-method" not in args
    assert "--sequence-parallel" not in argv and "--fp16" not in argv
    text = "\n".join(warnings)
    assert "Megatron-LM has no ladder residual" in text and "recomputes layers differently" in text


def _moe_plan(model: torch.nn.Module, inputs: tuple, **pins) -> Plan:
    """A training plan of a tiny MoE model (built on meta) on 2 ranks of tests/models/fastlink.yaml."""
    _, structure = capture_for_planning(model, inputs, {})
    cluster = load_cluster(str(MODELS / "fastlink.yaml"), nproc=2)
    return plan_model(structure, cluster, WorkloadSpec("train", 4, 16), Constraints(tp=1, pp=1, **pins))


@pytest.fixture(scope="module")
def top1_sigmoid_plan() -> Plan:
    """tests/models/tiny_moe_gptfast.py routed top-1 by sigmoid scores (no shared expert), EP over 2."""
    options = tiny_moe_gptfast.MoEOptions(top_k=1, score_func="sigmoid")
    with torch.device("meta"):
        model = tiny_moe_gptfast.build_model(options)
    return _moe_plan(model, tiny_moe_gptfast.example_inputs(4, 16), ep=2, ep_fold="dp")


def test_megatron_routes_a_top1_sigmoid_moe_as_planned(top1_sigmoid_plan):
    """Megatron-Core's router defaults (top-2, softmax) would run other experts than the plan priced:
    the export sets --moe-router-topk 1 and --moe-router-score-function sigmoid, the experts' width, and
    no shared expert (the model has none)."""
    plan = top1_sigmoid_plan
    assert (plan.num_experts, plan.moe_top_k, plan.moe_score_function) == (4, 1, "sigmoid")
    assert (plan.moe_expert_intermediate_size, plan.moe_shared_intermediate_size) == (48, 0)
    argv, warnings = _megatron_argv(plan)
    assert {a for a in argv if a.startswith("--")} <= MEGATRON_FLAGS | MEGATRON_MOE_FLAGS
    args = dict(zip(argv, [*argv[1:], ""]))
    assert args["--num-experts"] == "4" and args["--expert-model-parallel-size"] == "2"
    assert args["--moe-router-topk"] == "1" and args["--moe-router-score-function"] == "sigmoid"
    assert args["--moe-ffn-hidden-size"] == "48"
    assert "--moe-shared-expert-intermediate-size" not in args
    assert not any("does not record how the model's experts route" in w for w in warnings)
    again = Plan.from_dict(plan.to_dict())  # the routing round-trips through the plan file's data
    assert (again.moe_top_k, again.moe_score_function, again.moe_shared_intermediate_size) == (
        1,
        "sigmoid",
        0,
    )
    assert _megatron_argv(again)[0] == argv


def test_megatron_routes_a_top2_softmax_moe_with_its_shared_expert():
    """tests/models/tiny_moe_modulelist.py: top-2 softmax over 8 ModuleList experts 24 wide, and a
    shared expert 48 wide every token runs: --moe-shared-expert-intermediate-size 48."""
    with torch.device("meta"):
        model = tiny_moe_modulelist.build_model()
    plan = _moe_plan(model, tiny_moe_modulelist.example_inputs(4, 16))
    assert (plan.moe_top_k, plan.moe_score_function, plan.moe_shared_intermediate_size) == (2, "softmax", 48)
    argv, warnings = _megatron_argv(plan)
    args = dict(zip(argv, [*argv[1:], ""]))
    assert args["--num-experts"] == "8" and args["--moe-router-topk"] == "2"
    assert args["--moe-router-score-function"] == "softmax" and args["--moe-ffn-hidden-size"] == "24"
    assert args["--moe-shared-expert-intermediate-size"] == "48"
    assert not any("does not record how the model's experts route" in w for w in warnings)
    assert plan.moe_shared_expert_gate is False and not any("shared_expert_gate" in w for w in warnings)
    # Qwen2-MoE's sigmoid gate on the shared expert: the export said nothing, and Megatron-LM would train it
    # ungated
    with torch.device("meta"):
        gated = tiny_moe_modulelist.build_model(shared_gate=True)
    plan = _moe_plan(gated, tiny_moe_modulelist.example_inputs(4, 16))
    assert plan.moe_shared_expert_gate and plan.moe_shared_intermediate_size == 48
    assert any("moe_shared_expert_gate" in w for w in _megatron_argv(plan)[1])


def test_megatron_gets_the_dense_layers_before_the_moe_ones():
    """DeepSeek-V3's first layers are dense (first_k_dense_replace): the export gave --num-experts and no
    --moe-layer-freq, so Megatron-LM would build every layer a MoE. The plan records which layers are
    (`Plan.moe_layers`) and the export writes Megatron's list expression of them; the routing it does
    not read (the weights' scale, group-limited routing, the expert bias) is named in a warning."""
    import sys  # noqa: PLC0415

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: PLC0415

    from planner.export.megatron import moe_layer_freq  # noqa: PLC0415

    assert (
        moe_layer_freq([0, 0, 0, 1, 1]) == "([0]*3+[1]*2)"
        and moe_layer_freq([1, 0, 1]) == "([1]*1+[0]*1+[1]*1)"
    )
    sys.path.insert(0, str(MODELS))
    import hf_deepseek_v3  # noqa: PLC0415

    config = {**hf_deepseek_v3.CONFIG, "num_hidden_layers": 3, "first_k_dense_replace": 1, "use_cache": False}
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(
            DeepseekV3Config(**config, attn_implementation="sdpa", experts_implementation="batched_mm")
        )
    plan = _moe_plan(model, (torch.randint(0, 320, (4, 16)),))
    assert plan.moe_layers == [0, 1, 1]
    argv, warnings = _megatron_argv(plan)
    args = dict(zip(argv, [*argv[1:], ""]))
    assert args["--moe-layer-freq"] == "([0]*1+[1]*2)" and args["--num-layers"] == "3"
    assert any(
        "--moe-router-topk-scaling-factor" in w and "--moe-router-enable-expert-bias" in w for w in warnings
    )
    assert Plan.from_dict(plan.to_dict()).moe_layers == [0, 1, 1]


def test_megatron_applies_llama4s_routing_weights_to_the_experts_inputs():
    """Llama 4 scales each token by its routing weight before the experts (`MoE.input_scale`):
    --moe-apply-probs-on-input, which Megatron-Core runs at top-1 (Llama 4's); the plan records it."""
    from tests.models import hf_llama4  # noqa: PLC0415

    model = hf_llama4.build_model().to("meta")
    _, structure = capture_for_planning(model, hf_llama4.example_inputs(4, 16), hf_llama4.example_kwargs())
    cluster = load_cluster(str(MODELS / "fastlink.yaml"), nproc=2)
    plan = plan_model(structure, cluster, WorkloadSpec("train", 4, 16), Constraints(tp=1, pp=1))
    assert plan.moe_probs_on_input and plan.moe_top_k == 1
    argv, warnings = _megatron_argv(plan)
    assert "--moe-apply-probs-on-input" in argv and not any("probs-on-input" in w for w in warnings)
    assert Plan.from_dict(plan.to_dict()).moe_probs_on_input
    with torch.device("meta"):
        plain = tiny_moe_modulelist.build_model()
    assert (
        "--moe-apply-probs-on-input"
        not in _megatron_argv(_moe_plan(plain, tiny_moe_modulelist.example_inputs(4, 16)))[0]
    )


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_megatron_weighs_the_chosen_experts_as_the_model_does(score):
    """A router that weighs each of its k chosen experts by its score over all experts as it is (not
    renormalised to sum to 1: Qwen-MoE's norm_topk_prob=False) gets --moe-router-pre-softmax under
    softmax (Megatron-Core's default renormalises: it was exported the same as a renormalising model);
    under sigmoid, which Megatron always renormalises, a warning says the weights differ. The
    renormalising model gets neither."""
    plans = {}
    for renormalise in (True, False):
        options = tiny_moe_gptfast.MoEOptions(score_func=score, renormalise=renormalise)
        with torch.device("meta"):
            model = tiny_moe_gptfast.build_model(options)
        plans[renormalise] = _moe_plan(model, tiny_moe_gptfast.example_inputs(4, 16))
    assert (plans[True].moe_topk_renormalised, plans[False].moe_topk_renormalised) == (True, False)
    (argv, warnings), (plain_argv, plain_warnings) = _megatron_argv(plans[False]), _megatron_argv(plans[True])
    assert MEGATRON_PRE_SOFTMAX not in plain_argv and not any("renormalises" in w for w in plain_warnings)
    assert {a for a in argv if a.startswith("--")} <= MEGATRON_FLAGS | MEGATRON_MOE_FLAGS
    if score == "softmax":
        assert MEGATRON_PRE_SOFTMAX in argv and not any("renormalises" in w for w in warnings)
    else:
        assert MEGATRON_PRE_SOFTMAX not in argv
        assert any("sigmoid router renormalises the chosen scores" in w for w in warnings), warnings
    assert Plan.from_dict(plans[False].to_dict()).moe_topk_renormalised is False
    if score == "softmax":  # top-1: Megatron refuses softmax routing without the flag, and weighs by the prob
        with torch.device("meta"):
            model = tiny_moe_gptfast.build_model(tiny_moe_gptfast.MoEOptions(top_k=1))
        argv, warnings = _megatron_argv(_moe_plan(model, tiny_moe_gptfast.example_inputs(4, 16)))
        assert MEGATRON_PRE_SOFTMAX in argv
        assert any("requires --moe-router-pre-softmax at top-1" in w for w in warnings), warnings


def test_an_old_moe_plan_without_its_routing_loads_and_warns_for_each_router_option(top1_sigmoid_plan):
    """A plan written before the routing fields loads (unknown routing), and the export leaves the
    router options out with one warning naming each to set, rather than writing a guess."""
    data = top1_sigmoid_plan.to_dict()
    fields = (
        "moe_top_k",
        "moe_score_function",
        "moe_expert_intermediate_size",
        "moe_shared_intermediate_size",
    )
    for name in fields:
        del data[name]
    old = Plan.from_dict(data)
    assert [getattr(old, name) for name in fields] == [0, "", 0, None]
    argv, warnings = _megatron_argv(old)
    assert "--num-experts" in argv and "--expert-model-parallel-size" in argv
    assert not [a for a in argv if a.startswith(("--moe-router-", "--moe-ffn-", "--moe-shared-"))]
    (warning,) = [w for w in warnings if "how the model's experts route" in w]
    for option in MEGATRON_ROUTER_FLAGS:
        assert option in warning
    with pytest.raises(InputError, match="moe_score_function"):
        Plan.from_dict({**data, "moe_score_function": "sparsemax"})


# ---------------------------------------------------------------------------------------------
# vLLM


def test_vllm_engine_args_and_serve_command(llama_plan):
    plan = _with(
        llama_plan,
        workload=Workload.DECODE,
        mesh=dataclasses.replace(llama_plan.mesh, pp=2),
        stages=[[0, 1, 2], [3]],
        context=64,
        seq_len=1,
        ladder_layers=[3],
        serving=Serving(64, 16, 80, 0.01, 0.001, 100.0),
    )
    result = export_plan(plan, "vllm", model="meta-llama/Llama-3.2-1B")
    exported = types.ModuleType("exported")
    exec(compile(result.text, "<export>", "exec"), exported.__dict__)
    args = exported.ENGINE_ARGS
    assert set(args) <= VLLM_ENGINE_ARGS and args["dtype"] in VLLM_DTYPES
    assert args == {
        "model": "meta-llama/Llama-3.2-1B", "tensor_parallel_size": 2, "pipeline_parallel_size": 2,
        "dtype": "bfloat16", "max_model_len": 80, "max_num_seqs": plan.batch_size,
    }  # fmt: skip
    assert exported.ENVIRONMENT == {"VLLM_PP_LAYER_PARTITION": "3,1"}
    argv = shlex.split(exported.SERVE_COMMAND)
    assert argv[:4] == ["VLLM_PP_LAYER_PARTITION=3,1", "vllm", "serve", "meta-llama/Llama-3.2-1B"]
    flags = dict(zip(argv[4::2], argv[5::2]))
    assert flags == {k: str(v) for k, v in _dashed(args).items()}
    assert exported.SERVE_COMMAND in result.text.split('"""')[1]  # the docstring shows it to copy
    assert any("vLLM has no ladder residual" in w for w in result.warnings)


def _dashed(args: dict) -> dict:
    return {"--" + k.replace("_", "-"): v for k, v in args.items() if k != "model"}


def test_vllm_refuses_a_training_plan_and_names_the_placeholder(llama_plan):
    with pytest.raises(InputError, match="training plan; vLLM serves"):
        vllm_engine_args(llama_plan)
    with pytest.raises(InputError, match="does not read token ids"):
        vllm_engine_args(_with(llama_plan, workload=Workload.FORWARD, token_model=False))
    args, env, warnings = vllm_engine_args(_with(llama_plan, workload=Workload.FORWARD))
    assert args["max_model_len"] == llama_plan.seq_len and not env
    assert any("replace HF_MODEL_ID_OR_CHECKPOINT_DIR" in w for w in warnings)
    # a forward plan priced no decode and leaves no room to generate: said (it was exported silently)
    assert any("this is a forward plan" in w and "leaves no room to generate" in w for w in warnings), (
        warnings
    )


# ---------------------------------------------------------------------------------------------
# Data-parallel styles: each tool's form of ddp, zero1, zero2, fsdp, HSDP and reshard after forward


def _dp(
    plan: Plan, style: DataParallel, dp: int, shard: int | None = None, reshard: bool = True, **changes
) -> Plan:
    """`plan` (tp=2, 4 layers) over `dp` data-parallel ranks with data-parallel `style` (shard: fsdp's
    dp_shard, default every rank)."""
    shard = 1 if style is DataParallel.DDP else (dp if shard is None else shard)
    changes.setdefault("mesh", dataclasses.replace(plan.mesh, dp=dp))
    return _with(
        plan, batch_size=4 * dp, dp_style=style, dp_shard=shard, reshard_after_forward=reshard, **changes
    )


def _priced(plan: Plan, **times_ms: float) -> Plan:
    """`plan` with a "data-parallel" decision as the search writes it: label -> step time (ms; inf:
    does not fit), and each label's peak memory (10, 11, ... GiB) in its `memory_bytes`."""
    labels = {k.replace("_", "-").replace("hsdp-", "hsdp "): v for k, v in times_ms.items()}
    options = {k: v / 1e3 for k, v in labels.items()}
    memory = {k: (10.0 + i) * 2**30 for i, k in enumerate(labels)}
    reason = f"over dp={plan.dp}: ddp all-reduces gradients; ..."
    return _with(plan, decisions=[Decision("data-parallel", dp_label(plan), options, reason, memory)])


def test_dp_labels_prices_and_the_nearest_form(llama_plan):
    """The plan's style in the search's labels, the prices of its "data-parallel" decision read back,
    and the nearest of a tool's forms by those prices (a tie within 1% of the step: the default)."""
    assert dp_label(llama_plan) == "ddp"  # dp=1
    assert dp_label(_dp(llama_plan, DataParallel.ZERO1, 4)) == "zero1"
    assert dp_label(_dp(llama_plan, DataParallel.FSDP, 4)) == "fsdp"
    assert dp_label(_dp(llama_plan, DataParallel.FSDP, 4, shard=2, reshard=False)) == "hsdp 2x2-noreshard"
    # sharded over one rank: replicas
    assert dp_label(_dp(llama_plan, DataParallel.FSDP, 4, shard=1)) == "ddp"
    zero2 = _priced(
        _dp(llama_plan, DataParallel.ZERO2, 4), zero2=100.0, fsdp=101.2, fsdp_noreshard=100.5, ddp=math.inf
    )
    assert nearest_dp_form(zero2, ["fsdp-noreshard", "fsdp"], "fsdp") == "fsdp"  # 0.7 ms nearer: within 1%
    assert nearest_dp_form(zero2, ["fsdp-noreshard", "fsdp"], "fsdp-noreshard") == "fsdp-noreshard"
    far = _priced(_dp(llama_plan, DataParallel.ZERO2, 4), zero2=100.0, fsdp=101.0, fsdp_noreshard=120.0)
    assert nearest_dp_form(far, ["fsdp-noreshard", "fsdp"], "fsdp-noreshard") == "fsdp"
    assert (
        nearest_dp_form(_dp(llama_plan, DataParallel.ZERO2, 4), ["fsdp"], "fsdp-noreshard")
        == "fsdp-noreshard"
    )
    text = dp_price_text(far, "fsdp")
    assert text == (
        "the plan priced zero2 at 100 ms a step and 10.0 GiB per rank, fsdp at 101 ms a step and 11.0 GiB per rank "
        "(+1.0% step time)"
    )
    assert "did not price fsdp-noreshard" in dp_price_text(
        _dp(llama_plan, DataParallel.ZERO2, 4), "fsdp-noreshard"
    )
    assert "ddp as not fitting" in dp_price_text(zero2, "ddp")


def _titan_dp(plan: Plan) -> tuple[dict[str, object], dict[str, object], list[str], list[str]]:
    """The data-parallel fields of both torchtitan exports: (0.3 overrides, 0.2 TOML keys, 0.3
    warnings, 0.2 warnings), checked against the releases' names and choices."""
    argv, warnings03 = _titan03(plan)
    options = _titan03_options(argv)
    keys = ("data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward")
    v03 = {k: options["--parallelism." + k][0] for k in keys if "--parallelism." + k in options}
    toml, warnings02 = _titan(plan)
    v02 = {k: toml["parallelism"][k] for k in keys if k in toml["parallelism"]}
    for policy in (v03.get(keys[2]), v02.get(keys[2])):
        assert policy is None or policy in TORCHTITAN_RESHARD
    return v03, v02, warnings03, warnings02


def test_torchtitan_data_parallel_styles(llama_plan):
    """fsdp: shard degree dp_shard, replicate dp / dp_shard (HSDP when both > 1), the reshard policy
    written out; ddp: replicas (0.3; 0.2 alone); zero1 / zero2: FSDP over dp, reshard as the plan
    priced nearer, with a warning giving both prices."""
    fsdp = _dp(llama_plan, DataParallel.FSDP, 4)
    v03, v02, w03, w02 = _titan_dp(fsdp)
    want = {
        "data_parallel_replicate_degree": 1,
        "data_parallel_shard_degree": 4,
        "fsdp_reshard_after_forward": "always",
    }
    assert v02 == want and v03 == {k: str(v) for k, v in want.items()}
    assert not any(NOT_PRICED in w for w in w03 + w02)
    hsdp = _dp(llama_plan, DataParallel.FSDP, 4, shard=2, reshard=False)
    v03, v02, w03, w02 = _titan_dp(hsdp)
    want = {
        "data_parallel_replicate_degree": 2,
        "data_parallel_shard_degree": 2,
        "fsdp_reshard_after_forward": "never",
    }
    assert v02 == want and v03 == {k: str(v) for k, v in want.items()}
    assert not any(NOT_PRICED in w for w in w03 + w02)
    ddp03, ddp02, w03, w02 = _titan_dp(_dp(llama_plan, DataParallel.DDP, 4))
    assert ddp03 == {
        "data_parallel_replicate_degree": "4",
        "data_parallel_shard_degree": "1",
    }
    assert not any(NOT_PRICED in w for w in w03)
    assert ddp02["data_parallel_shard_degree"] == 4 and any(
        "torchtitan 0.2 has no DDP with TP or PP" in w for w in w02
    )
    alone = _dp(llama_plan, DataParallel.DDP, 4, mesh=MeshShape(1, 1, 4), splits={})
    assert _titan_dp(alone)[1] == {"data_parallel_replicate_degree": 4, "data_parallel_shard_degree": 1}
    # ZeRO-2: FSDP over dp 4, resharded: the plan priced fsdp nearer its zero2 than fsdp-noreshard
    zero2 = _priced(_dp(llama_plan, DataParallel.ZERO2, 4), zero2=100.0, fsdp=101.0, fsdp_noreshard=120.0)
    v03, v02, w03, w02 = _titan_dp(zero2)
    assert v02 == {
        "data_parallel_replicate_degree": 1,
        "data_parallel_shard_degree": 4,
        "fsdp_reshard_after_forward": "always",
    }
    (warning,) = [w for w in w03 if NOT_PRICED in w]
    assert warning.startswith("torchtitan has no ZeRO-2") and 'fsdp_reshard_after_forward "always"' in warning
    assert "the plan priced zero2 at 100 ms a step and 10.0 GiB per rank, fsdp at 101 ms" in warning
    assert "exported as FSDP" in warning and [w for w in w02 if NOT_PRICED in w] == [warning]  # said alike
    # without prices: the parameters whole from forward to backward (ZeRO-2's traffic per micro-batch)
    assert _titan_dp(_dp(llama_plan, DataParallel.ZERO1, 4))[0]["fsdp_reshard_after_forward"] == "never"


def _megatron_dp(plan: Plan) -> tuple[list[str], str, list[str]]:
    """(the data-parallel arguments of the Megatron-LM export, its file, its warnings)."""
    argv, warnings = _megatron_argv(plan)
    assert {a for a in argv if a.startswith("--")} <= MEGATRON_FLAGS
    dp_flags = {"--use-distributed-optimizer", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                "--ckpt-format", "--num-distributed-optimizer-instances"}  # fmt: skip
    out, keep = [], False
    for item in argv:
        keep = item in dp_flags if item.startswith("--") else keep
        if keep:
            out.append(item)
    args = dict(zip(argv, [*argv[1:], ""]))
    assert args.get("--data-parallel-sharding-strategy", "optim") in MEGATRON_SHARDING
    assert args.get("--ckpt-format", "torch") in MEGATRON_CKPT_FORMATS
    return out, export_plan(plan, "megatron").text, warnings


def test_megatron_data_parallel_styles(llama_plan):
    """zero1: the distributed optimizer; zero2 / fsdp: Megatron-FSDP with optim_grads /
    optim_grads_params (and the checkpoint format and environment its validate_args asserts); HSDP:
    --num-distributed-optimizer-instances = replicas; no reshard after forward (which Megatron-FSDP
    lacks): the nearer of fsdp and zero2 by the plan's prices, warned."""
    fsdp_args = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                 "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]  # fmt: skip
    args, text, warnings = _megatron_dp(_dp(llama_plan, DataParallel.DDP, 4))
    assert args == [] and "export CUDA_DEVICE_MAX_CONNECTIONS=1" in text
    args, text, warnings = _megatron_dp(_dp(llama_plan, DataParallel.ZERO1, 4))
    assert args == ["--use-distributed-optimizer"] and "export CUDA_DEVICE_MAX_CONNECTIONS=1" in text
    assert any("main_grad" in w for w in warnings)
    args, text, warnings = _megatron_dp(_dp(llama_plan, DataParallel.ZERO2, 4))
    assert args == [*fsdp_args[:2], "optim_grads", *fsdp_args[3:]]
    # Megatron-FSDP's validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS != 1: unset, never exported
    assert (
        "\nunset CUDA_DEVICE_MAX_CONNECTIONS\nPLANNER_MEGATRON_ARGS=(" in text and "export CUDA" not in text
    )
    assert not any("main_grad" in w for w in warnings)  # Megatron-FSDP keeps gradients in bf16, as planned
    _, _, fp32_warnings = _megatron_dp(
        dataclasses.replace(_dp(llama_plan, DataParallel.ZERO2, 4), grad_reduce_dtype="fp32")
    )
    assert any("Megatron-FSDP keeps the gradients in the parameters' dtype" in w for w in fp32_warnings)
    assert any("CUDA_DEVICE_MAX_CONNECTIONS unset" in w for w in warnings)  # with TP > 1: said
    args, text, warnings = _megatron_dp(_dp(llama_plan, DataParallel.FSDP, 4))
    assert args == fsdp_args and not any(NOT_PRICED in w or "prices as exposed" in w for w in warnings)
    full = _megatron_argv(_dp(llama_plan, DataParallel.FSDP, 4))[0]
    assert (
        full[full.index("--overlap-grad-reduce") + 1] == "--overlap-param-gather"
    )  # the overlap the plan priced
    args, _, warnings = _megatron_dp(_dp(llama_plan, DataParallel.FSDP, 8, shard=4))
    assert args == [*fsdp_args, "--num-distributed-optimizer-instances", "2"]  # 2 replicas of 4-rank shards
    assert not any(NOT_PRICED in w for w in warnings)
    # no reshard after forward: resharded by default; ZeRO-2 (optim_grads) where the plan priced it nearer
    args, _, warnings = _megatron_dp(_dp(llama_plan, DataParallel.FSDP, 4, reshard=False))
    assert args == fsdp_args
    (warning,) = [w for w in warnings if NOT_PRICED in w]
    assert (
        warning.startswith("Megatron-LM has no FSDP without reshard after forward")
        and "did not price fsdp" in warning
    )
    nearer = _priced(
        _dp(llama_plan, DataParallel.FSDP, 4, reshard=False), fsdp_noreshard=100.0, fsdp=110.0, zero2=103.0
    )
    args, _, warnings = _megatron_dp(nearer)
    assert args[2] == "optim_grads" and any("that is zero2" in w and "zero2 at 103 ms" in w for w in warnings)
    args, _, _ = _megatron_dp(_dp(llama_plan, DataParallel.FSDP, 8, shard=4, reshard=False))
    assert args == [*fsdp_args, "--num-distributed-optimizer-instances", "2"]  # HSDP: no zero2 over all 8


def _dtensor_module(plan: Plan) -> types.ModuleType:
    module = types.ModuleType("exported")
    exec(compile(export_plan(plan, "dtensor").text, "<export>", "exec"), module.__dict__)
    return module


def test_dtensor_data_parallel_styles(llama_plan):
    """The DTensor file's mesh and fully_shard settings per style: fsdp over dp_shard, HSDP with
    replicas, reshard as planned, DDP as a replicate dim over a shard dim of 1, ZeRO-1 / ZeRO-2 as
    FSDP with a warning; the layers are the FSDP units."""
    fsdp = _dtensor_module(_dp(llama_plan, DataParallel.FSDP, 4))
    assert fsdp.MESH_DIMS == {"dp_replicate": 1, "dp_shard": 4, "pp": 1, "tp": 2}
    assert (fsdp.DP_STYLE, fsdp.RESHARD_AFTER_FORWARD) == ("fsdp", True)
    assert fsdp.DP_UNITS == ["layers.0", "layers.1", "layers.2", "layers.3"] and fsdp.NUM_LAYERS == 4
    hsdp = _dtensor_module(_dp(llama_plan, DataParallel.FSDP, 4, shard=2, reshard=False))
    assert hsdp.MESH_DIMS == {"dp_replicate": 2, "dp_shard": 2, "pp": 1, "tp": 2}
    assert (hsdp.DP_STYLE, hsdp.RESHARD_AFTER_FORWARD) == ("hsdp 2x2-noreshard", False)
    text = export_plan(_dp(llama_plan, DataParallel.FSDP, 4, shard=2, reshard=False), "dtensor").text
    assert 'fully_shard(module, mesh=mesh["dp_replicate", "dp_shard"], reshard_after_forward=False)' in text
    ddp = _dtensor_module(_dp(llama_plan, DataParallel.DDP, 4))
    assert ddp.MESH_DIMS == {"dp_replicate": 4, "dp_shard": 1, "pp": 1, "tp": 2} and ddp.DP_STYLE == "ddp"
    zero1 = _dp(llama_plan, DataParallel.ZERO1, 4)
    module = _dtensor_module(zero1)
    assert module.MESH_DIMS["dp_shard"] == 4 and (module.DP_STYLE, module.RESHARD_AFTER_FORWARD) == (
        "fsdp-noreshard",
        False,
    )
    assert any(
        w.startswith("fully_shard (FSDP2) has no ZeRO-1") and NOT_PRICED in w
        for w in export_plan(zero1, "dtensor").warnings
    )
    plain = _dtensor_module(llama_plan)  # dp=1: nothing to do
    assert plain.MESH_DIMS == {"dp_replicate": 1, "dp_shard": 1, "pp": 1, "tp": 2}
    assert plain.apply_data_parallel(torch.nn.Linear(2, 2), None) is not None  # returns at once
    # a plan whose weights say nothing of its layers: apply() finds their ModuleList itself
    unnamed = _dtensor_module(_with(_dp(llama_plan, DataParallel.FSDP, 4), roles={}, splits={}))
    assert unnamed.DP_UNITS is None
    model = torch.nn.Sequential(
        torch.nn.Linear(2, 2), torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(4)])
    )
    assert unnamed._layer_names(model) == ["1.0", "1.1", "1.2", "1.3"]
    with pytest.raises(ValueError, match="dims"):  # data parallelism needs init_mesh()'s mesh
        fsdp.apply_data_parallel(model, types.SimpleNamespace(mesh_dim_names=("tp",)))


def test_dtensor_writes_the_plans_mixed_precision(llama_plan):
    """fully_shard's MixedPrecisionPolicy from the plan's dtype and gradient reduction (an fp32 plan casts
    nothing); without fully_shard the docstring says to build the model in the plan's dtype; fp16
    training's loss scaling, which the file does not do, is a warning."""
    train = _with(llama_plan, workload=Workload.TRAIN)
    bf16 = _dtensor_module(_dp(_with(train, dtype="bf16", grad_reduce_dtype="fp32"), DataParallel.FSDP, 4))
    assert (bf16.PARAM_DTYPE, bf16.REDUCE_DTYPE) == (torch.bfloat16, torch.float32)
    assert "reduces the gradients in REDUCE_DTYPE" in bf16.__doc__
    plain = _dtensor_module(_with(train, dtype="bf16"))
    assert (plain.PARAM_DTYPE, plain.REDUCE_DTYPE) == (torch.bfloat16, torch.bfloat16)
    assert "build it in bf16" in " ".join(plain.__doc__.split())
    fp32 = _dtensor_module(_with(train, dtype="fp32"))
    assert (fp32.PARAM_DTYPE, fp32.REDUCE_DTYPE) == (None, None)
    scaled = export_plan(_with(train, dtype="fp16", loss_scale="dynamic"), "dtensor")
    assert any("GradScaler" in w for w in scaled.warnings), scaled.warnings


def test_vllm_reads_no_data_parallel_style(llama_plan):
    """Serving plans replicate (dp_style ddp); the vLLM export carries dp as data_parallel_size only."""
    served = _served(_with(llama_plan, mesh=dataclasses.replace(llama_plan.mesh, dp=2), batch_size=8))
    args, _, _ = vllm_engine_args(served)
    assert args["data_parallel_size"] == 2 and not {k for k in args if "shard" in k or "fsdp" in k}
    # offline, one LLM(...) is one replica: the file does not offer LLM(**ENGINE_ARGS) for dp 2
    text = export_plan(served, "vllm").text
    assert "LLM(**ENGINE_ARGS)" not in text and "start 2 processes" in text
    assert "LLM(**ENGINE_ARGS)" in export_plan(_served(llama_plan), "vllm").text


# ---------------------------------------------------------------------------------------------
# The command line


def test_export_command_writes_atomically_prints_without_out_and_warns_on_stderr(
    tmp_path, llama_plan, capsys
):
    path = tmp_path / "plan.yaml"
    _with(llama_plan, ladder_layers=[3]).to_yaml(path)
    assert main(["export", str(path), "--to", "megatron"]) == 0
    printed = capsys.readouterr()
    assert (
        printed.out.startswith("# Megatron-LM")
        and "warning: Megatron-LM has no ladder residual" in printed.err
    )
    out = tmp_path / "args.sh"
    assert main(["export", str(path), "--to", "megatron", "--out", str(out)]) == 0
    # the file is what was printed, with the digest line that tells a later --out about edits (and a
    # note on its first line that says it has one)
    from planner.files import DIGEST_NOTE  # noqa: PLC0415

    text, digest = out.read_text().rsplit("# planner-digest: ", 1)
    first, rest = printed.out.split("\n", 1)
    assert text == f"{first}{DIGEST_NOTE}\n{rest}" and len(digest.strip()) == 16
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left
    assert main(["export", str(path), "--to", "megatron", "--out", str(out)]) == 0  # ours, unedited: replaced
    capsys.readouterr()
    out.write_text(out.read_text() + "export NCCL_DEBUG=INFO\n")  # the user's line
    edited = out.read_text()
    assert main(["export", str(path), "--to", "megatron", "--out", str(out)]) == 2
    assert (
        "changed since (your edits?)" in " ".join(capsys.readouterr().err.split())
        and out.read_text() == edited
    )


def test_export_command_bad_input_exits_2(tmp_path, llama_plan, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("name: x\ndevice: {name: cpu}\nlinks: []\n")
    assert main(["export", str(cluster), "--to", "vllm"]) == 2
    assert "is not a plan file" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "missing.yaml"), "--to", "vllm"]) == 2
    assert "cannot read plan file" in capsys.readouterr().err
    plan = tmp_path / "plan.yaml"
    llama_plan.to_yaml(plan)
    assert main(["export", str(plan), "--to", "deepspeed"]) == 2
    assert "invalid choice: 'deepspeed'" in capsys.readouterr().err
    assert main(["export", str(plan), "--to", "vllm"]) == 2  # a training plan
    assert "vLLM serves models" in capsys.readouterr().err
    assert main(["export", str(plan), "--to", "megatron", "--out", str(tmp_path / "no" / "args.sh")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# planner compare


def _report(plan: Plan, latency_s: float, measured_s: float | None = None) -> dict:
    predicted = dataclasses.replace(
        plan.predicted,
        latency_s=latency_s,
        throughput_tokens_per_s=1000 / latency_s,
        peak_memory_bytes=2.0**30,
    )
    run = None
    if measured_s is not None:
        run = {
            "measured": {
                "latency_s": measured_s,
                "peak_memory_bytes": 3 * 2.0**30,
                "startup_memory_bytes": 2.0**30,
            },
            "numerics": {"max_abs_diff": 0.0},
        }
    return report_dict(_with(plan, predicted=predicted), run, plan.model, load_cluster("local-cpu"))


def test_compare_columns_are_named_by_the_shortest_distinct_path_tail():
    from planner.cli.compare import column_names

    assert column_names(["x/out/r.json", "y/out/r.json", "a.json"]) == [
        "x/out/r.json",
        "y/out/r.json",
        "a.json",
    ]


def _compare_rows(out: str) -> dict[str, list[str]]:
    """`planner compare`'s table of two reports: row name -> its two cells."""
    return {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in out.splitlines()
        if line.count("│") == 4
    }


def test_compare_prints_reports_side_by_side(tmp_path, llama_plan, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_report(llama_plan, 0.004, measured_s=0.005)))
    pp = _with(
        llama_plan, mesh=dataclasses.replace(llama_plan.mesh, pp=2), stages=[[0, 1], [2, 3]], micro_batches=2
    )
    b.write_text(json.dumps(_report(pp, 0.002)))
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    rows = _compare_rows(out)
    assert rows["mesh"] == ["TP=2 × PP=1 × DP=1", "TP=2 × PP=2 × DP=1"]
    assert rows["predicted step"] == ["4.000 ms", "2.000 ms"] and rows["measured step"] == ["5.000 ms", "-"]
    assert rows["measured / predicted"] == ["1.25", "-"]
    assert rows["measured memory / rank"] == ["2.00 GiB", "-"]  # above start-up, as the run table shows
    assert rows["predicted tokens/s"] == ["250,000", "500,000"] and rows["measured tokens/s"] == [
        "200,000",
        "-",
    ]
    assert f"fastest predicted: {b} (2.000 ms per step)" in out
    # another batch is other work per step: the most tokens/s wins, not the shortest step
    c = tmp_path / "c.json"
    doubled = _report(_with(llama_plan, batch_size=2 * llama_plan.batch_size), 0.006)
    doubled["predicted"]["throughput_tokens_per_s"] = 2000 / 0.006  # twice the tokens of a's step
    c.write_text(json.dumps(doubled))
    assert main(["compare", str(a), str(c)]) == 0
    out = capsys.readouterr().out
    assert "batches differ" in out and f"fastest predicted: {c}" in out


def test_compare_bad_files_exit_2(tmp_path, capsys):
    assert main(["compare", str(tmp_path / "missing.json")]) == 2
    assert "cannot read report" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["compare", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model": "x"}))
    assert main(["compare", str(other)]) == 2
    assert "is not a planner report" in capsys.readouterr().err


def test_compare_refuses_hand_edited_fields_of_another_kind(tmp_path, llama_plan, capsys):
    """Reports edited by hand: a latency of "fast", a measured section that is a string, a recompute
    that is a number crashed compare (TypeError / AttributeError, exit 1), and a NaN or negative
    latency was named the fastest. Each is refused now (exit 2), naming the file and the field."""
    good = _report(llama_plan, 0.004, measured_s=0.005)
    (tmp_path / "good.json").write_text(json.dumps(good))
    edits = {
        "latency_str": (("predicted", "latency_s"), "fast", "field 'predicted.latency_s' is 'fast'"),
        "latency_nan": (("predicted", "latency_s"), float("nan"), "field 'predicted.latency_s' is nan"),
        "latency_neg": (("predicted", "latency_s"), -1, "field 'predicted.latency_s' is -1"),
        "measured_str": (("measured",), "fast", "field 'measured' is 'fast'"),
        "memory_str": (("predicted", "peak_memory_bytes"), "lots", "'predicted.peak_memory_bytes' is 'lots'"),
        "recompute_int": (("plan", "recompute"), 5, "a field has a value of another kind"),
    }
    for name, (keys, value, words) in edits.items():
        report = json.loads(json.dumps(good))
        holder = report
        for key in keys[:-1]:
            holder = holder[key]
        holder[keys[-1]] = value
        (tmp_path / f"{name}.json").write_text(json.dumps(report))
        assert main(["compare", str(tmp_path / "good.json"), str(tmp_path / f"{name}.json")]) == 2, name
        said = " ".join(capsys.readouterr().err.split())
        assert f"{name}.json" in said and words in said, said


def test_kv_heads_replicated_over_ranks_warn_except_in_vllm(llama_plan):
    splits = dict(llama_plan.splits)
    for i in range(4):
        for w in ("wk", "wv"):
            key = f"layers.{i}.attention.{w}.weight"
            splits[key] = dataclasses.replace(splits[key], pieces=1)
    plan = _with(llama_plan, splits=splits)
    for fmt in ("megatron", "torchtitan", "dtensor"):
        assert any(
            "fewer pieces than TP=2" in w or "into 1 pieces" in w for w in export_plan(plan, fmt).warnings
        ), fmt
    serving = _with(plan, workload=Workload.DECODE)
    assert not any(
        "pieces" in w for w in export_plan(serving, "vllm").warnings
    )  # vLLM replicates KV heads too


def test_export_command_offers_every_format():
    parser = build_parser()
    export = next(
        a for a in parser._subparsers._group_actions[0].choices["export"]._actions if a.dest == "to"
    )
    assert tuple(export.choices) == FORMATS


# ---------------------------------------------------------------------------------------------
# Recomputation as users read it: layer ranges, never the layer-class keys of the cost model

CLASS_A = "attn32/8/128;q:4096x4096:False:None;o:4096x4096:False:None;mlp;n100"  # layer_key's form
CLASS_B = "attn32/8/128;q:4096x4096:False:None;o:4096x4096:False:None;mlp;n200"


def _per_class_plan(plan: Plan) -> Plan:
    """Layers 0-1 of one class recompute selectively, layers 2-3 of another nothing, as the search
    records it: `recompute` by class key, the prediction's per-layer strategies by layer."""
    modes = ["selective", "selective", "none", "none"]
    per_layer = [
        LayerCost(i, 0, 0.0, 0.0, 0.0, 0.0, {"q": "colwise", "recompute": m}) for i, m in enumerate(modes)
    ]
    predicted = dataclasses.replace(plan.predicted, per_layer=per_layer)
    return _with(plan, predicted=predicted, recompute={CLASS_A: Recompute.SELECTIVE, CLASS_B: Recompute.NONE})


def test_recompute_reads_as_layer_ranges_everywhere(tmp_path, llama_plan, capsys):
    from planner.cli.render import training_rows

    plan = _per_class_plan(llama_plan)
    text = "layers 0-1: selective, layers 2-3: none"
    assert plan.recompute_text() == text
    assert dict((r[0], r[1]) for r in training_rows(plan))["recompute"] == text
    report = _report(plan, 0.004)
    assert report["plan"]["recompute"] == {"0-1": "selective", "2-3": "none"}  # machine-readable, by layers
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert main(["compare", str(path), str(path)]) == 0
    out = capsys.readouterr().out
    assert "recompute layers 0-1: selective" in out and "2-3: none" in out
    dtensor = export_plan(plan, "dtensor")
    assert "RECOMPUTE = {'0-1': 'selective', '2-3': 'none'}" in dtensor.text
    assert any(text in w for w in dtensor.warnings)
    for target in ("megatron", "torchtitan"):
        warnings = "\n".join(export_plan(plan, target).warnings)
        assert f"recomputes layers differently ({text})" in warnings, target
    for shown in (out, dtensor.text, *dtensor.warnings, json.dumps(report)):
        assert "attn32" not in shown and "n100" not in shown


def test_recompute_text_uniform_unrecorded_and_old_reports(llama_plan, capsys):
    from planner.cli.compare import comparison_rows

    assert _with(llama_plan, recompute={"*": Recompute.FULL}).recompute_text() == "all 4 layers: full"
    assert _with(llama_plan, recompute={"layer": Recompute.NONE}).recompute_text() == "none"
    # a hand-edited plan whose per-layer record does not match: the modes, never the class keys
    edited = _with(_per_class_plan(llama_plan), recompute={CLASS_A: Recompute.FULL, CLASS_B: Recompute.NONE})
    assert edited.recompute_text() == "full/none (per layer class; the plan does not record which layers)"
    assert edited.recompute_ranges() == {"per layer class": "full/none"}
    # a report written before recomputation was by layer range
    old = _report(llama_plan, 0.004)
    old["plan"]["recompute"] = {CLASS_A: "full", CLASS_B: "none"}
    assert comparison_rows(old)["training layout"] == "recompute full (per layer class)"
    # a training step with nothing sharded or recomputed says so ("-" is for reports that do not train)
    plain = _report(_with(llama_plan, recompute={"*": Recompute.NONE}), 0.004)
    assert comparison_rows(plain)["training layout"] == "no recompute"
    plain["plan"]["dp"] = 2
    assert comparison_rows(plain)["training layout"] == "ddp; no recompute"
    plain["workload"] = "forward"
    assert comparison_rows(plain)["training layout"] == "-"


def test_compare_names_context_and_expert_parallelism_and_the_sharded_dp_style(llama_plan):
    """`planner compare` wrote "TP=1 × PP=1 × DP=2" for a plan at CP 4 (and "DP=1" for CP 8, as if one
    GPU) and left out expert parallelism and HSDP / FSDP without resharding."""
    from planner.cli.compare import comparison_rows  # noqa: PLC0415

    report = _report(llama_plan, 0.004)
    report["plan"].update(tp=1, cp=4, pp=1, dp=8, ep=4, ep_fold="dp", expert_tp=1)
    report["plan"].update(
        dp_style="fsdp", dp_shard=4, reshard_after_forward=False, distributed_optimizer=True
    )
    rows = comparison_rows(report)
    assert rows["mesh"] == "TP=1 × CP=4 × PP=1 × DP=8; experts: EP 4 over dp x cp", rows["mesh"]
    assert rows["training layout"].startswith("hsdp 4x2 (no reshard after forward)"), rows["training layout"]


def test_position_embeddings_kept_replicated_raise_no_layout_warning() -> None:
    """Megatron-LM and torchtitan keep learned position embeddings whole too: no "will shard" warning."""
    from planner.export.common import _position_embedding  # noqa: PLC0415

    assert _position_embedding("transformer.wpe.weight") and _position_embedding(
        "embeddings.position_embeddings.weight"
    )
    assert not _position_embedding("transformer.wte.weight") and not _position_embedding("lm_head.weight")


def test_compare_sets_step_tokens_per_s_beside_step_tokens_per_s_and_a_requests_beside_a_requests(
    tmp_path, llama_plan, capsys
):
    """Every report's step tokens/s, predicted beside measured (a served request's: its decode step), so
    a cached model's plan and one without a cache compare alike; a served request's tokens/s over the
    whole request (prefill and decode steps) on a row of its own, predicted beside measured."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    served = _report(llama_plan, 0.004, measured_s=0.005)
    served["predicted"]["throughput_tokens_per_s"] = 671.0  # the decode step's
    served["serving"] = {"predicted": {"tokens_per_s": 638.5}, "measured": {"tokens_per_s": 564.0}}
    a.write_text(json.dumps(served))
    plain = _report(llama_plan, 0.004)
    plain["predicted"]["throughput_tokens_per_s"] = 671.0
    b.write_text(json.dumps(plain))
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    rows = _compare_rows(out)
    assert rows["predicted tokens/s"] == ["671", "671"]
    assert rows["measured tokens/s"] == ["537", "-"]  # 671 x 4 ms / 5 ms
    assert rows["request tokens/s, predicted / measured"] == ["638 / 564", "-"]


def test_compare_shows_each_reports_dtype_and_says_when_they_differ(tmp_path, llama_plan, capsys):
    """Two reports of the same model and batch in fp32 and bf16: a dtype row, and a note that the
    faster step is not the same computation (they had compared as identical but for the step time)."""
    a, b = tmp_path / "fp32.json", tmp_path / "bf16.json"
    a.write_text(json.dumps(_report(_with(llama_plan, dtype="fp32"), 0.004)))
    b.write_text(json.dumps(_report(_with(llama_plan, dtype="bf16"), 0.003)))
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert _compare_rows(out)["dtype"] == ["fp32", "bf16"]
    assert "the reports' dtypes differ (fp32, bf16)" in " ".join(out.split())


def test_compare_marks_a_failed_run_and_reports_priced_on_other_clusters(tmp_path, llama_plan, capsys):
    """A report of a run that failed its check (`"failed"`, exit 4) showed its measured step like any
    other and could be the fastest measured; two reports priced on different clusters compared their
    predicted steps without a word. The failed run's measurements are left out and named; the clusters
    are said to differ."""
    a, b = tmp_path / "failed.json", tmp_path / "ok.json"
    failed = _report(llama_plan, 0.004, measured_s=0.001)
    failed["failed"] = "the sharded run does not compute what the unsharded model computes on the same batch"
    a.write_text(json.dumps(failed))
    b.write_text(json.dumps({**_report(llama_plan, 0.004, measured_s=0.005), "cluster": "dgx-h100"}))
    assert main(["compare", str(a), str(b)]) == 0
    printed = capsys.readouterr().out
    assert _compare_rows(printed)["measured step"] == ["run failed", "5.000 ms"]
    out = " ".join(printed.split())
    assert f"note: {a}'s run failed (the sharded run does not compute" in out, out
    assert "fastest measured" not in out, out  # one run measured: the failed one was "fastest"
    assert "priced on different clusters" in out, out


def test_vllm_export_of_a_plan_priced_with_a_per_head_decode_kernel_says_vllm_splits_the_cache(llama_plan):
    """A serving plan made on dgx-a100 (decode attention of one block per sequence and head) exported to
    vLLM says vLLM's backends split the cache, so its steps are shorter than priced; a dgx-h100 plan
    (bandwidth-priced decode attention) does not."""
    served = dict(workload=Workload.DECODE, context=64, seq_len=1, ladder_layers=[],
                  serving=Serving(64, 16, 80, 0.01, 0.001, 100.0))  # fmt: skip
    a100 = export_plan(_with(llama_plan, cluster="dgx-a100", cluster_source="dgx-a100", **served), "vllm")
    assert any("vLLM's attention backends split the cache" in w for w in a100.warnings), a100.warnings
    h100 = export_plan(_with(llama_plan, cluster="dgx-h100", cluster_source="dgx-h100", **served), "vllm")
    assert not any("split the cache" in w for w in h100.warnings)


def test_an_mlp_op_the_pass_gathers_marks_its_projections_for_dtensor(captured):
    """A plan whose MLP keeps column- then row-parallel while the TP pass gathers an op between them (a
    priced fallback: a softmax over the width): the splits say so and the DTensor file gathers the
    first projection's output and takes the second's input whole, as the run does (it paired them
    plainly, so each rank computed the softmax on its shard)."""
    from planner.cli.workflow import _mark_fallback_gathers  # noqa: PLC0415
    from planner.plan import Fallback  # noqa: PLC0415

    structure = analyse(captured("gpt2_tiny").gm)
    plan = fixed_plan(structure, str(EXAMPLES / "gpt2_tiny.py"), 2)
    layer = structure.layers[0]
    act = next(n for n, block in layer.node_blocks.items() if block == "mlp")
    plan.fallbacks = [Fallback("aten.softmax", "model.py:1", act, 1024.0, 1e-5, len(structure.layers))]
    _mark_fallback_gathers(plan, structure)
    up, down = (f"transformer.h.{i}.mlp.{name}.weight" for i in (0,) for name in ("c_fc", "c_proj"))
    assert plan.splits[up].gather_output and plan.splits[down].replicated_input
    assert not plan.splits["transformer.h.0.attn.c_attn.weight"].gather_output
    text = export_plan(plan, "dtensor").text
    assert "'transformer.h.1.mlp.c_fc': ColwiseParallel(output_layouts=Replicate())," in text
    assert "'transformer.h.1.mlp.c_proj': RowwiseParallel(input_layouts=Replicate())," in text


def test_language_model_exports_say_when_the_model_is_no_decoder_only_language_model(llama_plan):
    """Megatron-LM's pretrain_gpt.py and torchtitan's model modules build decoder-only language models:
    the export of an encoder-decoder (layers with cross-attention, as planned) or of a model that
    reads no token ids (images) says so in a warning; both were written without one. A decoder-only
    language model gets neither."""
    structure = meta_structure(str(MODELS / "cross_attention_memory.py"), 2, 16)
    cluster = load_cluster(str(MODELS / "fastlink.yaml"), nproc=2)
    decoder = plan_model(structure, cluster, WorkloadSpec("train", 2, 16), Constraints(tp=2, pp=1))
    for warnings in (_megatron_argv(decoder)[1], _titan03(decoder)[1]):
        said = [w for w in warnings if "has cross-attention: 2 of its 2 layers" in w]
        assert len(said) == 1 and "decoder-only language models" in said[0], warnings
    images = _with(llama_plan, token_model=False)
    for warnings in (_megatron_argv(images)[1], _titan03(images)[1]):
        assert any("reads no token ids" in w for w in warnings), warnings
    for warnings in (_megatron_argv(llama_plan)[1], _titan03(llama_plan)[1]):
        assert not any("cross-attention" in w or "reads no token ids" in w for w in warnings), warnings


def test_an_edited_mesh_larger_than_the_plans_cluster_is_refused_naming_it(tmp_path, capsys) -> None:
    """A plan for local-cpu (2 devices) edited to tp 3: `planner export` priced it and crashed with a
    traceback from the collective model (`Group(size=3, ...) does not fit cluster`, exit 1). It is
    refused now (exit 2), naming the field and both device counts."""
    from planner.cli.main import main  # noqa: PLC0415

    plan = tmp_path / "plan.yaml"
    mlp = str(EXAMPLES / "mlp.py")
    assert (
        main(["optimize", mlp, "--cluster", "local-cpu", "--tp", "2", "--nproc", "2", "--out", str(plan)])
        == 0
    )
    edited = tmp_path / "tp3.yaml"
    edited.write_text(plan.read_text().replace("mesh: {tp: 2,", "mesh: {tp: 3,"))
    capsys.readouterr()
    assert main(["export", str(edited), "--to", "megatron"]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert re.search("plan field 'mesh': tp=3 pp=1 dp=1 uses 3 devices.*local-cpu has 2", said), said


def test_torchtitan_says_when_the_model_is_not_its_llama(captured, llama_plan):
    """GPT-2 (fused c_attn, a GELU MLP) went out as `--module llama3` with no word that the module
    does not build it; the Llama does not get the warning."""
    gm = captured("gpt2_tiny").gm
    gpt2 = fixed_plan(analyse(gm), str(EXAMPLES / "gpt2_tiny.py"), 2, workload="train")
    (said,) = [w for w in export_plan(gpt2, "torchtitan").warnings if "is not torchtitan's llama3" in w]
    assert "fused q/k/v" in said and "without a gate" in said, said
    assert not [
        w for w in export_plan(llama_plan, "torchtitan").warnings if "is not torchtitan's llama3" in w
    ]

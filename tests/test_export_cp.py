"""Context parallelism in `planner export`: each tool's flags and config keys for a plan with cp > 1,
the warnings for what a tool runs otherwise, the device arithmetic with cp in it, and cp=1 exports
without a trace of it.

Names checked against the releases' source (read, not imported; bench/exports_conformance.py feeds
the exports to the real parsers): Megatron-Core `megatron/training/arguments.py`
(`--context-parallel-size`, `--cp-comm-type`, `validate_args`' world size / (tp * pp * cp)) and
`megatron/core/transformer/transformer_config.py` (`cp_comm_type` "p2p" | "all_gather" | "a2a");
torchtitan 0.3.0 `torchtitan/config/configs.py` and 0.2.2 `torchtitan/config/job_config.py`
(`context_parallel_degree`, `context_parallel_load_balancer`, 0.2.2's
`context_parallel_rotate_method`) and `torchtitan/distributed/parallel_dims.py` (world size =
dp_replicate * dp_shard * cp * tp * pp); PyTorch `torch/distributed/tensor/experimental/_attention.py`
(`context_parallel`, `set_rotate_method`); vLLM 0.34.0 `vllm/config/parallel.py`.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types

import pytest
import torch

from planner.errors import InputError
from planner.export import export_plan
from planner.export.vllm import vllm_engine_args
from planner.frontend.analysis import analyse
from planner.plan import DataParallel, MeshShape, Plan, Workload
from runtime.launch import launch
from runtime.mesh import _axis_ranks, hsdp_ranks
from tests.dtensor_entry import apply_exported
from tests.planner_fixtures import EXAMPLES, analysed_llama
from tests.plans import fixed_plan
from tests.test_export import (
    MEGATRON_FLAGS,
    TORCHTITAN_FIELDS,
    _dtensor_module,
    _megatron_argv,
    _titan,
    _titan03,
    _titan03_options,
    _with,
)


@pytest.fixture(scope="module")
def llama_plan(captured) -> Plan:
    """Tiny Llama-3 (4 layers, 32 tokens) with Megatron splits at tp=2, a bf16 training plan."""
    plan = fixed_plan(analyse(captured("llama3").gm), str(EXAMPLES / "llama3.py"), 2, workload="train")
    return _with(plan, dtype="bf16")


def _cp(plan: Plan, cp: int, dp: int = 1, comm: str = "allgather", balance: bool = True, **changes) -> Plan:
    """`plan` with context parallelism over `cp` ranks, dp replicas (a batch of 2 per replica)."""
    mesh = MeshShape(plan.tp, plan.pp, dp, cp)
    cp_plan = _with(plan, mesh=mesh, batch_size=2 * dp, cp_comm_type=comm, cp_load_balance=balance, **changes)
    cp_plan.validate()
    return cp_plan


@pytest.fixture(scope="module")
def plan_405b() -> Plan:
    """Llama-3 405B (126 layers) at TP8 CP16 PP16 DP8, ZeRO-1, 128K tokens, 16 micro-batches of one
    sequence per replica: Llama 3's long-context layout."""
    structure = analysed_llama("405b")
    base = fixed_plan(structure, str(EXAMPLES / "llama3_405b.py"), 8, pp=16, workload="train")
    plan = _with(
        base, dtype="bf16", mesh=MeshShape(8, 16, 8, 16), seq_len=131072, batch_size=128, micro_batches=16,
        dp_style=DataParallel.ZERO1, dp_shard=8, sequence_parallel=True,
    )  # fmt: skip
    plan.validate()
    return plan


# ---------------------------------------------------------------------------------------------
# Megatron-LM


def _args(argv: list[str]) -> dict[str, str]:
    return dict(zip(argv, [*argv[1:], ""]))


def test_megatron_tp8_cp16_pp16_dp8(plan_405b):
    """--context-parallel-size and --cp-comm-type, the world size with cp in it (Megatron derives dp
    = world / (tp * pp * cp)), CUDA_DEVICE_MAX_CONNECTIONS as validate_args asserts with CP."""
    result = export_plan(plan_405b, "megatron")
    argv, warnings = _megatron_argv(plan_405b)
    assert {a for a in argv if a.startswith("--")} <= MEGATRON_FLAGS
    args = _args(argv)
    assert args["--tensor-model-parallel-size"] == "8" and args["--pipeline-model-parallel-size"] == "16"
    assert args["--context-parallel-size"] == "16" and args["--cp-comm-type"] == "all_gather"
    world = plan_405b.num_devices
    assert world == 8 * 16 * 16 * 8 == 16384
    assert "# Launch 16384 processes (tp * cp * pp * dp)" in result.text
    assert "(train, tp=8 cp=16 pp=16 dp=8)" in result.text
    dp = world // (8 * 16 * 16)  # validate_args' data-parallel size
    assert dp == 8
    mbs, gbs = int(args["--micro-batch-size"]), int(args["--global-batch-size"])
    assert (mbs, gbs) == (1, 128) and gbs // (mbs * dp) == plan_405b.micro_batches
    assert "\nexport CUDA_DEVICE_MAX_CONNECTIONS=1\n" in result.text
    assert not any("context" in w or "cp=" in w for w in warnings)  # balanced, 131072 % 32 == 0


def test_megatron_cp_comm_types_balance_and_sequence(llama_plan):
    """Each comm type under Transformer Engine's name; CP alone (tp=1) still needs
    CUDA_DEVICE_MAX_CONNECTIONS=1; a plan without load balancing is warned by name (Megatron always
    balances), and so is a sequence Megatron cannot cut into 2 x cp chunks."""
    for comm, name in (("ring", "p2p"), ("allgather", "all_gather"), ("alltoall", "a2a")):
        argv, _ = _megatron_argv(_cp(llama_plan, 2, comm=comm))
        assert _args(argv)["--cp-comm-type"] == name
    tp1 = _cp(_with(llama_plan, mesh=dataclasses.replace(llama_plan.mesh, tp=1), splits={}), 2)
    assert "\nexport CUDA_DEVICE_MAX_CONNECTIONS=1\n" in export_plan(tp1, "megatron").text
    assert "with TP or CP > 1" in export_plan(tp1, "megatron").text
    _, warnings = _megatron_argv(_cp(llama_plan, 4, balance=False))
    assert any("Megatron-LM always balances causal context parallelism" in w for w in warnings)
    # 36 tokens: 4 contiguous chunks for the plan, not the 2 x 4 Megatron's validate_args asserts
    _, warnings = _megatron_argv(_cp(llama_plan, 4, balance=False, seq_len=36))
    assert any("Megatron-LM needs the sequence length a multiple of 8" in w for w in warnings)


# ---------------------------------------------------------------------------------------------
# torchtitan


def test_torchtitan_tp8_cp16_pp16_dp8(plan_405b):
    """context_parallel_degree in both releases, and torchtitan's world size: replicate x shard x cp
    x tp x pp (parallel_dims.py) is the plan's device count."""
    argv, warnings03 = _titan03(plan_405b)
    options = _titan03_options(argv)
    par = {k.removeprefix("--parallelism."): v[0] for k, v in options.items() if v and "parallelism" in k}
    assert par["context_parallel_degree"] == "16" and par["tensor_parallel_degree"] == "8"
    world = 1
    for key in ("data_parallel_replicate_degree", "data_parallel_shard_degree", "context_parallel_degree",
                "tensor_parallel_degree", "pipeline_parallel_degree"):  # fmt: skip
        world *= int(par[key])
    assert world == plan_405b.num_devices == 16384
    assert "context_parallel_load_balancer" not in par  # "headtail", the default: the plan's balance
    # the batch spans replicate x shard (the CP ranks share sequences): global 128 = local 16 x dp 8
    assert (options["--training.global_batch_size"], options["--training.local_batch_size"]) == (
        ["128"],
        ["16"],
    )
    toml, warnings02 = _titan(plan_405b)
    assert toml["parallelism"]["context_parallel_degree"] == 16
    assert toml["parallelism"]["context_parallel_rotate_method"] == "allgather"
    assert set(toml["parallelism"]) <= TORCHTITAN_FIELDS["parallelism"]
    assert "NGPU=16384" in export_plan(plan_405b, "torchtitan", torchtitan_version="0.2").text
    for warnings in (warnings03, warnings02):
        assert not any("cp_comm_type" in w or "contiguous chunks" in w for w in warnings)


def test_torchtitan_cp_comm_types_and_balance(llama_plan):
    """0.2's rotate method per comm type (ring: "alltoall", PyTorch's ring rotation, which 0.2.2's
    training does not apply), 0.3 without one; Ulysses warned in both; load balancing off: None in
    0.3, a warning with the override in 0.2 (TOML has no null)."""
    ring = _cp(llama_plan, 2, comm="ring")
    toml, warnings02 = _titan(ring)
    assert toml["parallelism"]["context_parallel_rotate_method"] == "alltoall"
    assert any("applies only in its validation loop" in w for w in warnings02)
    argv, warnings03 = _titan03(ring)
    assert "--parallelism.context_parallel_rotate_method" not in argv
    assert any("torchtitan 0.3 has no setting for it" in w for w in warnings03)
    ulysses = _cp(llama_plan, 2, comm="alltoall")
    toml, warnings02 = _titan(ulysses)
    assert toml["parallelism"]["context_parallel_rotate_method"] == "allgather"
    for warnings in (warnings02, _titan03(ulysses)[1]):
        assert any(w.startswith("torchtitan has no all-to-all context parallelism") for w in warnings)
    unbalanced = _cp(llama_plan, 2, balance=False)
    options = _titan03_options(_titan03(unbalanced)[0])
    assert options["--parallelism.context_parallel_load_balancer"] == ["None"]
    toml, warnings02 = _titan(unbalanced)
    assert "context_parallel_load_balancer" not in toml["parallelism"]
    assert any("--parallelism.context_parallel_load_balancer None" in w for w in warnings02)
    # torchtitan 0.2 asserts seq_len % (tp * 2 * cp): 32 tokens at tp=2, cp=16 unbalanced
    _, warnings02 = _titan(_cp(llama_plan, 16, balance=False))
    assert any("torchtitan 0.2 needs the sequence length a multiple of 64" in w for w in warnings02)


def test_torchtitan_ddp_with_cp_and_mixed_precision(llama_plan):
    """torchtitan shards over the CP ranks whenever cp > 1: the plan's DDP goes out as HSDP (replicas
    dp, shard degree 1, reshard "never") with a warning, in both releases (0.2's DDP-with-TP refusal
    does not apply: its fully_shard runs with CP); 0.2 then applies mixed precision itself."""
    plan = _cp(
        _with(llama_plan, mesh=dataclasses.replace(llama_plan.mesh, pp=2), stages=[[0, 1], [2, 3]]), 2, dp=2
    )
    options = _titan03_options(_titan03(plan)[0])
    assert options["--parallelism.data_parallel_replicate_degree"] == ["2"]
    assert options["--parallelism.data_parallel_shard_degree"] == ["1"]
    assert options["--parallelism.fsdp_reshard_after_forward"] == ["never"]
    toml, warnings02 = _titan(plan)
    par = toml["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (2, 1)
    assert any(
        "torchtitan shards the parameters over the cp=2 context-parallel ranks" in w for w in warnings02
    )
    assert not any("DDP with TP or PP" in w for w in warnings02)
    assert "dtype" not in toml["training"]  # no float32 trap: fully_shard's mixed precision runs with CP


# ---------------------------------------------------------------------------------------------
# DTensor


def test_dtensor_cp_mesh_follows_the_plans_rank_order(plan_405b):
    """MESH_DIMS orders pp, the dp dims, cp, tp (torchtitan's order), so that init_mesh's coordinates of
    every rank are the plan's (MeshShape.rank_of); the file compiles and names what
    context_parallel_step runs."""
    module = _dtensor_module(plan_405b)
    assert list(module.MESH_DIMS) == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    assert module.MESH_DIMS == {"dp_replicate": 1, "dp_shard": 8, "pp": 16, "cp": 16, "tp": 8}
    assert module.MESH == {"dp": 8, "pp": 16, "cp": 16, "tp": 8}
    assert (module.CP_DEGREE, module.CP_ROTATE_METHOD, module.CP_LOAD_BALANCE) == (16, "allgather", True)
    ranks = torch.arange(plan_405b.num_devices).reshape(tuple(module.MESH_DIMS.values()))
    mesh = plan_405b.mesh
    for dp, pp, cp, tp in ((0, 0, 0, 0), (3, 7, 5, 2), (7, 15, 15, 7)):
        assert ranks[pp, 0, dp, cp, tp].item() == mesh.rank_of(dp, pp, tp, cp)
    text = export_plan(plan_405b, "dtensor").text
    assert "from torch.distributed.tensor.experimental import context_parallel\n" in text
    assert text.startswith('"""Tensor-, context- and data-parallel plan for')


def test_dtensor_cp_rotate_methods_warnings_and_dp1(llama_plan):
    """ring -> "alltoall" (PyTorch's ring rotation), allgather as it is, Ulysses: "allgather" and a
    warning; a CPU cluster is warned (CPU attention has no CP sharding strategy); at dp=1 the
    gradients are still averaged over the CP ranks (DDP over cp)."""
    assert _dtensor_module(_cp(llama_plan, 2, comm="ring")).CP_ROTATE_METHOD == "alltoall"
    ulysses = export_plan(_cp(llama_plan, 2, comm="alltoall"), "dtensor")
    assert "CP_ROTATE_METHOD = 'allgather'" in ulysses.text
    assert any(w.startswith("PyTorch's context_parallel has no all-to-all") for w in ulysses.warnings)
    assert any("raises NotImplementedError" in w for w in ulysses.warnings)  # llama_plan: local-cpu (gloo)
    cuda = export_plan(_with(_cp(llama_plan, 2), cluster="dgx-h100"), "dtensor")
    assert not any("NotImplementedError" in w for w in cuda.warnings)
    assert not any("plan: call the model inside" in w for w in cuda.warnings)
    # a forward plan: the file's steps are a training step's; the warning says what to leave out
    forward = export_plan(_with(_cp(llama_plan, 2), cluster="dgx-h100", workload=Workload.FORWARD), "dtensor")
    assert any(w.startswith("this is a forward plan: call the model inside") for w in forward.warnings)
    module = _dtensor_module(_cp(llama_plan, 2, balance=False))
    assert module.CP_LOAD_BALANCE is False
    assert (module.DP_STYLE, module.MESH_DIMS["dp_replicate"], module.RESHARD_AFTER_FORWARD) == (
        "ddp",
        1,
        False,
    )
    assert (
        "fully_shard(module, mesh=data_parallel_mesh(mesh)" in export_plan(_cp(llama_plan, 2), "dtensor").text
    )


_MESH_CHECK = """
import json, sys, types
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
out = {}
for name, (source, ranks) in json.loads(sys.argv[1]).items():
    module = types.ModuleType(name)
    exec(compile(source, name, "exec"), module.__dict__)
    world = 1
    for size in module.MESH_DIMS.values():
        world *= size
    for rank in ranks:
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        dp_mesh = module.data_parallel_mesh(module.init_mesh("cpu"))
        out[f"{name}/{rank}"] = dp_mesh.mesh.tolist()
        dist.destroy_process_group()
print(json.dumps(out))
"""


def test_dtensor_cp_data_parallel_mesh_is_the_plans_dp_cp_groups(llama_plan):
    """The file's data_parallel_mesh, built on a fake process group of 16 ranks (in a subprocess),
    holds the planner runtime's own groups (runtime.mesh): HSDP's shard groups (dp_shard x cp ranks)
    as rows and replicate groups as columns; DDP the dp x cp group, replicated; FSDP its shard
    group, flat."""
    mesh_of = {
        "hsdp": (_cp(llama_plan, 2, dp=4, dp_style=DataParallel.FSDP, dp_shard=2), 2),
        "ddp": (_cp(llama_plan, 2, dp=4), 1),
        "fsdp": (_cp(llama_plan, 4, dp=2, dp_style=DataParallel.FSDP, dp_shard=2), 2),
    }
    ranks = [0, 5, 10, 15]
    jobs = {name: (export_plan(plan, "dtensor").text, ranks) for name, (plan, _) in mesh_of.items()}
    done = subprocess.run(
        [sys.executable, "-c", _MESH_CHECK, json.dumps(jobs)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for name, (plan, dp_shard) in mesh_of.items():
        for rank in ranks:
            mesh = got[f"{name}/{rank}"]
            if name == "hsdp":
                shard, replicate = hsdp_ranks(plan.mesh, dp_shard, rank)
                row = next(r for r in mesh if rank in r)
                column = [r[row.index(rank)] for r in mesh]
                assert (row, column) == (shard, replicate), (rank, mesh)
            elif name == "ddp":
                assert [r[0] for r in mesh] == _axis_ranks(plan.mesh, rank, "dp_cp") and all(
                    len(r) == 1 for r in mesh
                )
            else:
                assert mesh == hsdp_ranks(plan.mesh, dp_shard, rank)[0]


@pytest.mark.slow
def test_dtensor_cp_file_runs_its_mesh_and_dp_x_cp_data_parallelism_on_four_gloo_ranks(captured, llama_plan):
    """The exported files of cp=2 plans on 4 gloo ranks, each on its own init_mesh (with the "cp"
    dim) and fully_shard over data_parallel_mesh: DDP over dp x cp at TP1, FSDP over dp_shard x cp,
    DDP over the CP ranks alone (dp=1) x TP2. Every rank feeds the same whole batch (the attention is
    not split: PyTorch's CP runs CUDA attention only), so outputs and the gradients averaged over the
    dp x cp ranks equal the unsharded model's; the local shapes show the shards over dp_shard x cp."""
    fp32 = _with(llama_plan, dtype="fp32")  # fully_shard casts nothing: equal to the fp32 model
    tp1 = _with(fp32, mesh=dataclasses.replace(llama_plan.mesh, tp=1), splits={})
    jobs = {
        "ddp_dp2_cp2": _cp(tp1, 2, dp=2),
        "fsdp_dp2_cp2": _cp(tp1, 2, dp=2, dp_style=DataParallel.FSDP, dp_shard=2),
        "ddp_cp2_tp2": _cp(fp32, 2),
    }
    files = {
        name: (str(EXAMPLES / "llama3.py"), export_plan(plan, "dtensor").text, "whole")
        for name, plan in jobs.items()
    }
    ranks = launch(apply_exported, files, 4, timeout_s=300)
    for rank in ranks:
        for name, got in rank.items():
            assert got["max_abs_diff"] <= 1e-5 * got["scale"], (name, got["max_abs_diff"])
            assert got["grad_max_abs_diff"] <= 1e-6, (name, got["grad_max_abs_diff"])
        # wq (128, 128): whole under DDP; rows over dp_shard 2 x cp 2 under FSDP; rows over tp 2
        assert rank["fsdp_dp2_cp2"]["local_shapes"]["layers.0.attention.wq.weight"] == (32, 128)
        assert rank["ddp_cp2_tp2"]["local_shapes"]["layers.0.attention.wq.weight"] == (64, 128)


# ---------------------------------------------------------------------------------------------
# vLLM, and cp=1


def test_vllm_refuses_context_parallelism(llama_plan):
    """A prefill plan with cp > 1 is refused by name: vLLM's prefill context parallelism runs with
    MLA attention only (decode plans never have cp > 1: the plan refuses them)."""
    prefill = _cp(_with(llama_plan, workload=Workload.FORWARD), 2)
    with pytest.raises(InputError, match=r"cp=2 context-parallel ranks .*--prefill-context-parallel-size"):
        vllm_engine_args(prefill)
    with pytest.raises(InputError, match="training plan"):  # a training plan is refused first, as before
        export_plan(_cp(llama_plan, 2), "vllm")


def test_cp1_exports_carry_no_context_parallelism(llama_plan):
    """cp=1 exports are as they were: Megatron without the CP flags, torchtitan's degree 1 and no
    other CP key, the DTensor file without a cp dim, CP imports or context_parallel_step."""
    argv, _ = _megatron_argv(llama_plan)
    assert "--context-parallel-size" not in argv and "--cp-comm-type" not in argv
    assert "(tp * pp * dp)" in export_plan(llama_plan, "megatron").text
    options = _titan03_options(_titan03(llama_plan)[0])
    assert options["--parallelism.context_parallel_degree"] == ["1"]
    assert not [k for k in options if "context_parallel" in k and not k.endswith("_degree")]
    toml, _ = _titan(llama_plan)
    assert [k for k in toml["parallelism"] if k.startswith("context")] == ["context_parallel_degree"]
    text = export_plan(llama_plan, "dtensor").text
    module = types.ModuleType("exported")
    exec(compile(text, "<export>", "exec"), module.__dict__)
    assert "cp" not in module.MESH_DIMS and "cp" not in module.MESH
    assert "context_parallel" not in text and "CP_" not in text and "data_parallel_mesh" not in text
    assert text.startswith('"""Tensor- and data-parallel plan for')


@pytest.mark.parametrize("style", [DataParallel.ZERO1, DataParallel.FSDP])
def test_sharded_dp_at_dp1_with_cp_is_exported_sharded(llama_plan, style):
    """ZeRO-1 / FSDP at dp=1 with cp=2 shards the training state over the 2 CP ranks, which hold the same
    weights (`planner show`: "over dp x cp = 2"): no tool's export may fall back to DDP. Megatron-LM gets
    its distributed optimizer (Megatron-FSDP for fsdp), torchtitan FSDP over shard 1 x cp 2, the DTensor
    file fully_shard; before, every export read dp=1 as "nothing to shard"."""
    plan = _cp(llama_plan, 2, dp=1, dp_style=style, dp_shard=1)
    argv, _ = _megatron_argv(plan)
    assert "--use-distributed-optimizer" in argv
    assert ("--use-megatron-fsdp" in argv) == (style is DataParallel.FSDP)
    options = _titan03_options(_titan03(plan)[0])
    assert options["--parallelism.data_parallel_shard_degree"] == ["1"]
    assert options["--parallelism.context_parallel_degree"] == ["2"]
    _, warnings = _titan03(plan)
    assert not any("the plan's ddp" in w for w in warnings), warnings
    assert _dtensor_module(plan).DP_STYLE.startswith("fsdp")
    if style is DataParallel.ZERO1:
        assert any("the plan's zero1 over dp x cp = 2" in w for w in warnings), warnings

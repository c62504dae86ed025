"""The `planner` command end to end: a run on 2 gloo ranks, and every bad input's exit code and message."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from planner.cli.workflow import constraints_from
from planner.errors import InputError
from planner.plan import Schedule
from planner.solver.problem import LadderMode, LadderPolicy
from tests.cli_in_process import planner_in_process

ROOT = Path(__file__).resolve().parent.parent


def planner_subprocess(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m planner.cli ARGS` in a fresh process (the other tests run it in this one)."""
    return subprocess.run(
        [sys.executable, "-m", "planner.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


planner = planner_in_process


@pytest.mark.slow
def test_optimize_run_tiny_llama_on_two_gloo_ranks(tmp_path, example_path):
    """The whole path on a spec named as `planner calibrate` names its own (local-cpu's figures), so
    the run also times the speed probe and re-prices the plan at the machine's speed during the run."""
    report_path, plan_path = tmp_path / "report.json", tmp_path / "plan.yaml"
    preset = (ROOT / "costmodels" / "clusters" / "local-cpu.yaml").read_text()
    spec = _write(tmp_path, "calibrated.yaml", preset.replace("name: local-cpu", "name: local-calibrated"))
    r = planner_subprocess(  # the whole path through a fresh process, as a user runs it
        "optimize", str(example_path("llama3")), "--cluster", spec, "--nproc", "2", "--tp", "2",
        "--ladder", "upper:2", "--run", "--min-time", "0", "--iters", "3", "--warmup", "1",
        "--json", str(report_path), "--out", str(plan_path), "--emit", str(tmp_path / "emit"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Predicted vs measured" in r.stdout
    report = json.loads(report_path.read_text())
    assert report["plan"]["tp"] == 2 and report["plan"]["ladder_layers"] == [2, 3]
    assert report["predicted"]["latency_s"] > 0 and report["measured"]["latency_s"] > 0
    assert report["measured"]["peak_memory_bytes"] >= 0 and report["baseline"]["latency_s"] > 0
    assert report["solver"]["status"] and report["solver"]["time_s"] >= 0
    assert report["numerics"]["max_abs_diff"] <= 1e-5 * report["numerics"]["output_scale"]
    assert report["numerics"]["ladder_deviation"] > 0  # ladder changed the function; reported
    probe = report["measured"]["speed_probe"]
    # a per-node slope, positive and finite (how large depends on the machine's load: no bound on it)
    assert probe["samples"] >= 1 and 0 < probe["node_overhead_s"] < float("inf")
    at_run = report["measured"]["at_run_speed"]
    assert at_run["latency_s"] > 0 and at_run["speed_ratio"] == pytest.approx(probe["node_overhead_s"] / 9e-6)
    assert "latency at the run's machine speed" in r.stdout
    assert (tmp_path / "emit" / "rank1" / "module.py").exists() and (tmp_path / "emit" / "README.md").exists()
    shown = planner("show", str(plan_path))
    assert shown.returncode == 0 and "TP=2" in shown.stdout


@pytest.mark.slow
def test_layout_megatron_plans_and_runs_the_split_layout(tmp_path, example_path):
    """`--layout megatron` at a pinned --tp 2 on local-cpu, where the solver keeps every weight
    replicated: the hand-written Megatron-LM splits are lowered and run on 2 gloo ranks, their outputs
    equal to the unsharded model's."""
    report_path, plan_path = tmp_path / "report.json", tmp_path / "plan.yaml"
    r = planner(
        "optimize", str(example_path("llama3")), "--cluster", "local-cpu", "--nproc", "2", "--tp", "2",
        "--layout", "megatron", "--run", "--min-time", "0", "--iters", "2", "--warmup", "1",
        "--json", str(report_path), "--out", str(plan_path),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    plan = yaml.safe_load(plan_path.read_text())
    styles = {plan["roles"][w]: s["style"] for w, s in plan["splits"].items() if w in plan["roles"]}
    assert styles == {"q": "colwise", "k": "colwise", "v": "colwise", "gate": "colwise", "up": "colwise",
                      "o": "rowwise", "down": "rowwise", "lm_head": "vocab"}  # fmt: skip
    report = json.loads(report_path.read_text())
    assert report["plan"]["tp"] == 2 and report["measured"]["latency_s"] > 0
    assert report["numerics"]["max_abs_diff"] <= 1e-4 * report["numerics"]["output_scale"]


def test_layout_megatron_plans_an_encoder_decoder_with_a_shared_embedding(tmp_path):
    """T5 looks its shared embedding up twice (encoder, decoder) beside relative-position tables: the
    Megatron layout splits the shared table (and the LM head tied to it) by vocabulary in both lookups
    and keeps the small bias tables whole, as Megatron-LM does (it raised StopIteration, forward and
    training alike: the decoder's lookup had no preference for the split it is pinned to)."""
    for workload in ("train",):
        plan_path = tmp_path / f"t5_{workload}.yaml"
        r = planner(
            "optimize", str(ROOT / "tests" / "models" / "tiny_t5.py"), "--cluster", "local-cpu", "--nproc", "2", "--tp", "2",
            "--layout", "megatron", "--workload", workload, "--out", str(plan_path),
        )  # fmt: skip
        assert r.returncode == 0, (workload, r.stderr)
        splits = yaml.safe_load(plan_path.read_text())["splits"]
        assert splits["lm_head.weight"]["style"] == "vocab", splits
        bias = {s["style"] for w, s in splits.items() if "relative_attention_bias" in w}
        assert bias == {"replicate"}, splits


def _assert_trained_alike(report: dict) -> None:
    """A training run's JSON report: outputs and gradients within 1e-4 of their scale (fp32)."""
    n = report["numerics"]
    assert (
        n["max_abs_diff"] <= 1e-4 * n["output_scale"] and n["grad_max_abs_diff"] <= 1e-4 * n["grad_scale"]
    ), n


@pytest.mark.slow
def test_t5_trains_with_full_recompute_over_interleaved_pipeline_stages(tmp_path):
    """T5 at PP 2 with interleaved 1F1B (one layer per virtual stage) and full recomputation, as the
    planner lays it out: every rank failed. The regions kept their factory ops on the capture's meta
    device (`retarget_device`); a mask a region makes from no parameter was taken for a value needing
    a gradient, so the stages disagreed on the gradients they exchange (gloo: "Received data size
    doesn't match expected size", `requires_grad_nodes`); and the shared embedding, held by three
    virtual stages, was summed pair by pair (`sum_tied_gradients`). Outputs and gradients now match."""
    report = tmp_path / "r.json"
    r = planner(
        "optimize", str(ROOT / "tests" / "models" / "tiny_t5.py"), "--cluster", str(ROOT / "tests" / "models" / "fastlink.yaml"),
        "--nproc", "2", "--pp", "2", "--schedule", "interleaved_1f1b", "--workload", "train", "--recompute", "full",
        "--run", "--iters", "1", "--warmup", "0", "--min-time", "0", "--json", str(report),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_trained_alike(json.loads(report.read_text()))


@pytest.mark.slow
def test_a_block_called_at_two_depths_is_staged_and_priced_per_call(tmp_path):
    """tests/models/reused_block.py calls one block object at depths 0 and 3 (`[b0, b1, b2, b0]`). It
    was planned as 3 layers, so the stages and their prices did not match the 4 calls that run. Now
    the plan stages 4 layers, the predicted training state per rank is what the ranks hold (each stage
    holding the shared block keeps a copy, whose gradients are summed), and outputs and gradients
    match the unsharded model."""
    plan, report = tmp_path / "p.yaml", tmp_path / "r.json"
    r = planner(
        "optimize", str(ROOT / "tests" / "models" / "reused_block.py"), "--cluster", str(ROOT / "tests" / "models" / "fastlink.yaml"),
        "--nproc", "2", "--pp", "2", "--workload", "train", "--out", str(plan), "--json", str(report),
        "--run", "--iters", "1", "--warmup", "0", "--min-time", "0",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(layer for stage in yaml.safe_load(plan.read_text())["stages"] for layer in stage) == [
        0,
        1,
        2,
        3,
    ]
    data = json.loads(report.read_text())
    _assert_trained_alike(data)
    assert "4 layers" in r.stdout
    measured = data["measured"]
    assert (
        abs(measured["state_bytes"] - measured["predicted_state_bytes"]) <= 0.01 * measured["state_bytes"]
    ), measured


@pytest.mark.slow
def test_multi_query_attention_behind_a_fused_qkv_trains_at_tp2(tmp_path):
    """Phi-3 with one KV head (tests/models/hf_phi3_mqa.py) at TP 2 in training: the attention runs
    replicated, but the SDPA rule had first cut K to the rank's piece of its one head and then gathered
    it again with `tp_gather_pieces`, which has no backward: every rank raised (exit 4). K / V are cut
    only when the attention goes head-parallel now; outputs and gradients match."""
    report = tmp_path / "r.json"
    r = planner(
        "optimize", str(ROOT / "tests" / "models" / "hf_phi3_mqa.py"), "--cluster", str(ROOT / "tests" / "models" / "fastlink.yaml"),
        "--nproc", "2", "--tp", "2", "--workload", "train", "--run", "--iters", "1", "--warmup", "0", "--min-time", "0",
        "--json", str(report),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_trained_alike(json.loads(report.read_text()))
    # the reason is the fused projection's one KV head (the rotary embedding's ops were blamed)
    out = " ".join(r.stdout.split())
    assert "qkv colwise: its K and V parts hold 1 KV head(s) of 16, fewer than tp=2" in out, out
    assert "core head: its fused q/k/v projection is not split" in out and "apply_rotary" not in out, out


@pytest.mark.parametrize(
    "name, parts", [("hf_falcon_mqa.py", (64, 16, 16)), ("hf_gptbigcode_mqa.py", (64, 16, 16))]
)
def test_multi_query_behind_a_fused_projection_names_its_one_kv_head(name, parts):
    """Falcon-7B's (B, T, H + 2, hd) split along its heads and GPT-BigCode's split after an unsqueeze:
    the analysis read no parts, the TP pass refused the split ("not a fused projection's parts ...
    Re-plan with a different --tp", exit 3 under --layout megatron), while the reason is one KV head."""
    from planner.frontend.depth import capture_for_planning  # noqa: PLC0415
    from planner.frontend.modelfile import load_model_file  # noqa: PLC0415

    model_file = load_model_file(ROOT / "tests" / "models" / name)
    _, structure = capture_for_planning(model_file.build("meta"), *model_file.inputs(2, 16))
    attention = structure.layers[0].attention
    assert attention.projections[0].parts == parts and attention.num_kv_heads == 1
    r = planner(
        "optimize", str(ROOT / "tests" / "models" / name), "--cluster", str(ROOT / "tests" / "models" / "fastlink.yaml"),
        "--nproc", "2", "--tp", "2", "--layout", "megatron",
    )  # fmt: skip
    message = " ".join(r.stderr.split())
    assert r.returncode == 3 and "its fused q/k/v projection is not split (1 KV head(s) < tp=2" in message, (
        message
    )


@pytest.mark.slow
def test_multi_query_key_value_projection_under_sequence_parallelism_splits_the_heads(tmp_path):
    """tests/models/mqa_fused_kv.py at TP 2 in training with sequence parallelism: its fused K/V
    projection (one KV head) runs row-parallel, its output reduce-scattered along the sequence, and the
    SDPA rule took no sequence shard: the attention ran replicated. Now the core splits by heads and
    outputs and gradients match."""
    report = tmp_path / "r.json"
    r = planner(
        "optimize", str(ROOT / "tests" / "models" / "mqa_fused_kv.py"), "--cluster", str(ROOT / "tests" / "models" / "fastlink.yaml"),
        "--nproc", "2", "--tp", "2", "--workload", "train", "--sequence-parallel", "on", "--run", "--iters", "1",
        "--warmup", "0", "--min-time", "0", "--json", str(report),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(report.read_text())
    _assert_trained_alike(data)
    out = " ".join(r.stdout.split())
    assert "head: core" in out and "head-parallel rule" not in out, out


@pytest.mark.slow
def test_scale_to_local_leaves_out_pins_this_machine_cannot_hold(tmp_path):
    """`--cluster dgx-h100 --tp 8 --run --scale-to-local` on 2 CPU ranks: the re-plan for this machine
    kept --tp 8 and failed (exit 3, "no mesh shape fits 2 devices with tp=8"), though the option exists
    to run a GPU plan here. The pins are left out of the local re-plan, with a warning saying so. With
    --nproc 2 (the local ranks, as docs/optimize-and-run.md gives it) the GPU cluster was cut to 2
    devices before planning and --tp 8 refused (exit 2): the GPU plan is made on its 8 devices."""
    report = tmp_path / "r.json"
    r = planner(
        "optimize", str(ROOT / "examples" / "llama3.py"), "--cluster", "dgx-h100", "--tp", "8", "--run",
        "--scale-to-local", "--nproc", "2", "--iters", "1", "--warmup", "0", "--min-time", "0",
        "--json", str(report),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Mesh: TP=8" in r.stdout, r.stdout
    assert "--tp 8 left out of the re-plan for this machine" in " ".join(r.stderr.split())
    assert json.loads(report.read_text())["plan"]["tp"] <= 2


@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2])
def test_a_forward_that_draws_noise_is_checked_at_the_draws_expectation(tmp_path, pp):
    """tests/models/forward_noise.py adds `torch.randn_like(x)` in its forward: the reference ran the draw
    at its expectation, the ranks drew it, and a forward run failed its check ("the sharded run does not
    compute what the unsharded model computes", exit 4), blaming the rewrite for the model's own noise.
    The ranks' checked forward runs it at its expectation too, and the report names the draw."""
    report = tmp_path / "r.json"
    pins = ["--tp", "2", "--layout", "megatron"] if pp == 1 else ["--pp", "2"]
    r = planner(
        "optimize", str(ROOT / "tests" / "models" / "forward_noise.py"), "--cluster", "local-cpu",
        "--nproc", "2", *pins, "--run", "--iters", "1", "--warmup", "0", "--min-time", "0",
        "--json", str(report),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    notes = " ".join(json.loads(report.read_text())["measured"]["notes"])
    assert "aten.randn_like at forward_noise.py:15" in notes, notes


def test_a_layout_the_pass_cannot_split_says_so_and_what_runs_instead():
    """tests/models/per_head_linear.py takes its heads apart one by one (`torch.split(x, 1, dim=1)`),
    each through a linear of its own: the TP pass cannot carry a head split through it. `--layout
    megatron` was refused with "split the weight along its parts (a fused projection)" and "Re-plan
    with a different --tp" (neither applies: every TP cuts a one-head piece); the default plan's note
    pointed to --layout megatron as running anyway, and its baseline line gave the layout a speed
    (StableLM-2's per-head LayerNorm showed it; it now splits, tests/corpus/hf_stablelm2.py). Now the
    refusal says what would run, and the note says the hand-written layout at TP 2 would not run (checked
    at the plan's TP: the baseline itself forwards at the model table's TP 1 and runs)."""
    model = str(ROOT / "tests" / "models" / "per_head_linear.py")
    r = planner("optimize", model, "--cluster", str(ROOT / "tests" / "models" / "fastlink.yaml"),
                "--nproc", "2", "--tp", "2", "--layout", "megatron")  # fmt: skip
    said = " ".join(r.stderr.split())
    assert r.returncode == 3, said
    assert "aten.split at per_head_rmsnorm.py" in said and "each rank holds 2 of its 4" in said, said
    assert "without it the planner keeps the weights the pass cannot split whole" in said, said
    r = planner("optimize", model, "--cluster", "local-cpu", "--nproc", "2", "--tp", "2")
    out = " ".join(r.stdout.split())
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Megatron-LM split layout at TP=2 would not run" in out, out
    assert "runs the hand-written Megatron-LM split layout at TP=2 anyway" not in out, out
    assert "Hand-written Megatron plan (TP=1 PP=1 DP=2)" in out, out


def test_per_head_norms_written_head_by_head_train_split_by_heads(tmp_path):
    """tests/models/per_head_rmsnorm.py gives each head of q and k an `nn.RMSNorm` of its own, taken
    apart by `torch.split(x, 1, dim=1)` (StableLM-2's pattern, with LayerNorm): merged into one norm over
    the heads with the heads' stacked weights, the attention splits by heads, and its training step at
    TP 2 with sequence parallelism matches the unsharded model's outputs and gradients (every head's
    own norm weight included)."""
    report = tmp_path / "r.json"
    r = planner(
        "optimize", str(ROOT / "tests" / "models" / "per_head_rmsnorm.py"), "--cluster",
        str(ROOT / "tests" / "models" / "fastlink.yaml"), "--nproc", "2", "--tp", "2", "--workload", "train",
        "--sequence-parallel", "on", "--run", "--iters", "1", "--warmup", "0", "--min-time", "0",
        "--json", str(report),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = " ".join(r.stdout.split())
    assert "head: core" in out and "unplanned all-gather" not in out, out
    _assert_trained_alike(json.loads(report.read_text()))


def test_a_tp_plan_that_splits_only_the_experts_says_the_rest_stays_replicated():
    """Llama 4 at a pinned --tp 2 on local-cpu: the experts go over the TP ranks (EP over tp) and every
    other weight stays replicated. The note saying so and why was printed only when no weight at all
    was split, so a user who pinned TP saw the attention replicated with no word of it."""
    r = planner("optimize", str(ROOT / "tests" / "models" / "hf_llama4.py"), "--cluster", "local-cpu",
                "--nproc", "2", "--tp", "2")  # fmt: skip
    out = " ".join(r.stdout.split())
    assert r.returncode == 0, r.stderr[-3000:]
    assert "experts ep 2 over tp" in out and "replicate: q k v core o" in out, out
    assert "note: TP=2, but every weight but the experts' stays replicated on local-cpu" in out, out


def test_sequence_parallel_pinned_on_a_replicated_plan_points_to_the_megatron_layout():
    """`--tp 2 --sequence-parallel on` on local-cpu: the best TP=2 plan keeps every weight whole, so the
    pin is refused; the refusal named auto and off only, not --layout megatron, which runs it."""
    r = planner("optimize", str(ROOT / "examples" / "llama3.py"), "--cluster", "local-cpu", "--workload",
                "train", "--nproc", "2", "--tp", "2", "--sequence-parallel", "on")  # fmt: skip
    said = " ".join(r.stderr.split())
    assert r.returncode == 2 and "splits no projection row-wise" in said, said
    assert "or --layout megatron to split every layer as Megatron-LM does at TP=2" in said, said


NAN_GRADIENT = """
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.w = torch.nn.Parameter(torch.zeros(8))  # sqrt at 0: a finite output, a NaN gradient
    def forward(self, x):
        return self.lin(x) + 0.0 * torch.sqrt(self.w)
def build_model():
    return M()
def example_inputs(batch_size=2, seq_len=4):
    return (torch.randn(batch_size, seq_len, 8),)
"""


def test_a_model_whose_own_gradients_are_not_finite_is_told_so(tmp_path):
    """A model whose eager gradients are NaN (here sqrt at 0; in practice parameters left as torch.empty
    garbage) was told its captured graph "gives other gradients than the model" and to rewrite a
    custom autograd.Function it does not have. The check says the model's own gradients are not finite."""
    path = _write(tmp_path, "nan_grad.py", NAN_GRADIENT)
    r = planner("optimize", path, "--cluster", "local-cpu", "--nproc", "1", "--workload", "train", "--run")
    said = " ".join(r.stderr.split())
    assert r.returncode == 2, said
    assert "own gradients are not finite (NaN or inf)" in said and "'w'" in said, said
    assert "autograd.Function" not in said, said


def test_micro_batches_a_decode_plan_drops_are_said_to_have_no_effect():
    """--micro-batches 2 on a TP-only decode plan: the plan runs one micro-batch, and said nothing of the
    option (as --sequence-parallel on in decode says it had no effect)."""
    r = planner("optimize", str(ROOT / "examples" / "llama3_kv.py"), "--workload", "decode", "--context", "32",
                "--cluster", "local-cpu", "--nproc", "2", "--tp", "2", "--batch-size", "4", "--micro-batches", "2")  # fmt: skip
    said = " ".join(r.stderr.split())
    assert r.returncode == 0, said
    assert "--micro-batches 2 had no effect: the plan runs one micro-batch" in said, said


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


UNTRACEABLE = """
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return x
def build_model():
    return M()
def example_inputs():
    return (torch.randn(2, 8),)
"""


@pytest.mark.parametrize(
    "case, expected_code, pattern",
    [
        ("missing_file", 2, "does not exist|not found|No such"),
        ("no_build_model", 2, "build_model"),
        ("untraceable", 2, "line"),
        ("malformed_yaml", 2, "links.intra_node.bandwidth_GBps"),
        ("unknown_preset", 2, "unknown cluster preset"),
        ("infeasible_memory", 3, "GiB"),
        # 8 query heads, 4 KV heads: 8 splits the queries and replicates the KV heads evenly (it was left out)
        ("tp_not_dividing_heads", 2, r"does not divide the attention heads.*use\s+--tp in \[1, 2, 4, 8\]"),
        ("bad_ladder", 2, "--ladder"),
        ("empty_cluster", 2, r"--cluster: empty; give a preset name \(a100"),  # it calibrated, silently
    ],
)
@pytest.mark.slow
def test_bad_inputs_exit_with_documented_code(tmp_path, example_path, case, expected_code, pattern):
    llama = str(example_path("llama3"))
    args = {
        "missing_file": ["optimize", str(tmp_path / "nope.py"), "--cluster", "local-cpu"],
        "no_build_model": ["optimize", _write(tmp_path, "m.py", "x = 1\n"), "--cluster", "local-cpu"],
        "untraceable": ["optimize", _write(tmp_path, "u.py", UNTRACEABLE), "--cluster", "local-cpu"],
        "malformed_yaml": ["optimize", llama, "--cluster", _write(tmp_path, "c.yaml", _bad_spec())],
        "unknown_preset": ["optimize", llama, "--cluster", "dgx-h900"],
        "infeasible_memory": [
            "optimize",
            str(example_path("llama3_70b")),
            "--cluster",
            "local-cpu",
            "--nproc",
            "2",
        ],
        "tp_not_dividing_heads": ["optimize", llama, "--cluster", "local-cpu", "--nproc", "8", "--tp", "3"],
        "bad_ladder": ["optimize", llama, "--cluster", "local-cpu", "--ladder", "sideways"],
        "empty_cluster": ["optimize", llama, "--cluster", ""],
    }[case]
    r = planner(*args)
    assert r.returncode == expected_code, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr

    assert re.search(pattern, r.stderr, re.S), r.stderr


def _bad_spec() -> str:
    import yaml

    from costmodels.cluster import cluster_to_dict, load_cluster

    data = cluster_to_dict(load_cluster("dgx-h100"))
    data["links"]["intra_node"]["bandwidth_GBps"] = "450GB/s"
    return yaml.safe_dump(data)


@pytest.mark.slow
def test_planner_run_under_torchrun_two_ranks(tmp_path, example_path):
    plan_path, report_path = tmp_path / "plan.yaml", tmp_path / "report.json"
    made = planner(
        "optimize",
        str(example_path("llama3")),
        "--cluster",
        "local-cpu",
        "--nproc",
        "2",
        "--out",
        str(plan_path),
    )
    assert made.returncode == 0, made.stderr
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
         "-m", "planner.cli", "run", str(plan_path), "--model", str(example_path("llama3")),
         "--iters", "2", "--min-time", "0", "--json", str(report_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PLANNER_UNDER_TORCHRUN": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["measured"]["latency_s"] > 0 and report["numerics"]["max_abs_diff"] == 0.0


def test_constraints_from_options() -> None:
    """--ladder is read by the solver's one parser; --schedule reaches the constraints as a Schedule."""
    c = constraints_from(2, None, None, "auto:max=3", max_devices=4, schedule="gpipe")
    assert (c.tp, c.max_devices, c.ladder, c.schedule) == (
        2,
        4,
        LadderPolicy(LadderMode.AUTO, 3),
        Schedule.GPIPE,
    )
    assert constraints_from(None, None, None, "").ladder.mode is LadderMode.NONE
    with pytest.raises(InputError, match="--ladder must be"):
        constraints_from(None, None, None, "upper:")


# ---------------------------------------------------------------------------------------------------
# Messages that say what is wrong and what to do (issue 13, kind 10)


def _said(r: subprocess.CompletedProcess) -> str:
    return " ".join((r.stdout + r.stderr).split())  # rich wraps long lines


@pytest.mark.slow
def test_show_on_a_cluster_spec_says_not_a_plan_file() -> None:
    spec = ROOT / "costmodels" / "clusters" / "local-cpu.yaml"
    r = planner("show", str(spec))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    said = _said(r)
    assert f"{spec} is not a plan file" in said and "unknown key" not in said
    assert f"--cluster {spec}" in said and "--out PLAN.yaml" in said


@pytest.mark.skipif(
    __import__("torch").cuda.device_count() >= 8, reason="this machine could run a dgx-h100 plan"
)
@pytest.mark.slow
def test_run_with_a_gpu_preset_on_this_machine_says_how_to_plan_for_it(example_path) -> None:
    r = planner("optimize", str(example_path("llama3")), "--cluster", "dgx-h100", "--run", "--min-time", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    said = _said(r)
    assert "--cluster dgx-h100 describes another one" in said and "this machine has" in said
    assert "--cluster local-cpu" in said and "--scale-to-local" in said


@pytest.mark.slow
def test_ladder_at_tp1_warns(example_path) -> None:
    r = planner(
        "optimize", str(example_path("llama3")), "--cluster", "local-cpu", "--nproc", "1", "--tp", "1",
        "--ladder", "upper:2",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    said = _said(r)
    assert "warning: ladder residual on 2 layer(s) at TP=1" in said and "changes the model's outputs" in said
    quiet = planner(
        "optimize", str(example_path("llama3")), "--cluster", "local-cpu", "--nproc", "2", "--tp", "2",
        "--recompute", "full",
    )  # fmt: skip
    assert "warning: ladder" not in _said(quiet)
    # a training option on a forward plan is said to do nothing
    assert "--recompute full had no effect: training options apply to --workload train only" in _said(quiet)
    # so is a ZeRO-1 optimizer pinned on a plan with one data-parallel replica (it was dropped silently)
    zero = planner(
        "optimize", str(example_path("llama3")), "--cluster", "dgx-h100", "--workload", "train", "--dp", "1",
        "--distributed-optimizer", "on",
    )  # fmt: skip
    assert zero.returncode == 0, zero.stderr
    assert "--distributed-optimizer on had no effect" in _said(zero) and "pin --dp 2" in _said(zero)


@pytest.mark.slow
def test_run_with_more_ranks_than_the_plan_uses_runs_it_on_its_own(tmp_path, example_path) -> None:
    """`planner run --nproc 2` of a one-device plan runs it on one rank, as `optimize --run` does (it
    used to refuse and suggest the very command that had made the plan)."""
    plan_path = tmp_path / "plan.yaml"
    mlp = str(ROOT / "examples" / "mlp.py")
    made = planner("optimize", mlp, "--cluster", "local-cpu", "--nproc", "2", "--tp", "1", "--dp", "1", "--out", str(plan_path))  # fmt: skip
    assert made.returncode == 0, made.stderr
    # its prediction and cluster name edited by hand (not decisions): the file's digest says so, and the
    # run prices it again and names the spec it runs with, instead of reporting the edit as predicted
    text = plan_path.read_text()
    predicted = text.index("\npredicted:\n")
    latency = text.index("  latency_s: ", predicted)
    end = text.index("\n", latency)
    text = text[:latency] + "  latency_s: 1.0e-09" + text[end:]
    plan_path.write_text(text.replace("\ncluster: local-cpu\n", "\ncluster: dgx-h100\n", 1))
    r = planner("run", str(plan_path), "--model", mlp, "--nproc", "2", "--iters", "2", "--min-time", "0")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "running it on 1" in r.stdout and "measured / predicted" in r.stdout
    said = _said(r)
    assert "the plan file was edited after planning" in said and "priced again on local-cpu" in said, said
    assert "the field 'cluster' says dgx-h100, but the spec the plan was priced with" in said, said


@pytest.mark.slow
def test_decode_run_with_pipeline_or_data_parallelism_is_refused_before_anything_is_written(tmp_path):
    """`--run` serves decode plans with tensor parallelism only: a pinned --pp / --dp above 1 is
    refused up front (exit 2, naming the option), before planning writes --out or --emit."""
    out, emit = tmp_path / "plan.yaml", tmp_path / "emitted"
    r = planner(
        "optimize", "examples/llama3_kv.py", "--workload", "decode", "--pp", "2", "--run",
        "--cluster", "local-cpu", "--out", str(out), "--emit", str(emit),
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "--pp 2" in _said(r) and "tensor parallelism only" in _said(r)
    assert not out.exists() and not emit.exists()


@pytest.mark.slow
def test_decode_of_a_model_file_without_step_inputs_says_it_is_priced_from_a_formula():
    """A model file without step_inputs has no cache in its graph: its decode plan is priced from a
    formula, and the report says so (and that --run cannot serve it) instead of passing it off as
    the model's own decode step."""
    r = planner(
        "optimize", "examples/llama3.py", "--workload", "decode", "--context", "32", "--cluster", "local-cpu"
    )
    assert r.returncode == 0, r.stderr
    assert "decode priced from a formula" in _said(r) and "step_inputs" in _said(r)


@pytest.mark.slow
def test_run_of_a_plan_edited_to_more_devices_than_the_cluster_names_the_mesh(tmp_path):
    """A saved plan whose mesh was edited beyond the cluster it runs on: exit 2 naming field 'mesh',
    not a traceback from the cost model."""
    out = tmp_path / "plan.yaml"
    r = planner(
        "optimize", "examples/llama3.py", "--cluster", "local-cpu", "--nproc", "2", "--tp", "2", "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = yaml.safe_load(out.read_text())
    data["mesh"]["tp"] = 4
    out.write_text(yaml.safe_dump(data))
    r = planner("run", str(out), "--model", "examples/llama3.py", "--nproc", "2")
    assert r.returncode == 2, r.stderr
    assert "field 'mesh'" in _said(r) and "4 devices" in _said(r) and "Traceback" not in r.stderr
    # a GPU preset's plan run with too few ranks: it said "dgx-h100 has 2" (the preset re-sized to --nproc)
    gpu = tmp_path / "gpu.yaml"
    r = planner("optimize", "examples/llama3.py", "--cluster", "dgx-h100", "--tp", "4", "--out", str(gpu))
    assert r.returncode == 0, r.stderr
    r = planner("run", str(gpu), "--model", "examples/llama3.py", "--nproc", "2")
    assert r.returncode == 2 and "dgx-h100 has" not in _said(r), _said(r)
    needs = yaml.safe_load(gpu.read_text())["mesh"]
    devices = needs["tp"] * needs["pp"] * needs["dp"]
    assert f"needs {devices} devices" in _said(r) and f"give --nproc {devices}" in _said(r)


@pytest.mark.slow
def test_show_and_export_of_an_edited_plan_say_it_was_edited_after_pricing(tmp_path):
    """`planner show` and `planner export` read a saved plan without the model: when its decisions
    were edited after it was priced they say so (the prices shown are from before the edit) and point
    to `planner run`, which checks and prices it again; an unedited plan gets no such warning. An
    edited plan's export is checked against its model file (here) and refused where it cannot run."""
    out = tmp_path / "plan.yaml"
    r = planner("optimize", "examples/llama3.py", "--cluster", "local-cpu", "--nproc", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    for cmd in (("show", str(out)), ("export", str(out), "--to", "dtensor")):
        assert "edited after planning" not in _said(planner(*cmd))
    data = yaml.safe_load(out.read_text())
    data["batch_size"] = 2 * data["batch_size"]
    out.write_text(yaml.safe_dump(data))
    for cmd in (("show", str(out)), ("export", str(out), "--to", "dtensor")):
        r = planner(*cmd)
        assert r.returncode == 0, r.stderr
        assert "edited after planning" in _said(r) and "planner run" in _said(r)
    # an edit the model cannot take: export checks the plan against its model file as run does (it wrote
    # --tensor-model-parallel-size 3 for a model of 128-wide projections, exit 0)
    split = tmp_path / "split.yaml"
    r = planner("optimize", "examples/llama3.py", "--cluster", "local-cpu", "--nproc", "2", "--tp", "2",
                "--layout", "megatron", "--out", str(split))  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = yaml.safe_load(split.read_text())
    data["mesh"]["tp"] = 3
    split.write_text(yaml.safe_dump(data))
    r = planner("export", str(split), "--to", "megatron")
    assert r.returncode == 2 and "does not divide by tp=3" in _said(r) and "Traceback" not in r.stderr, _said(
        r
    )
    # tp 1 with the splits still colwise / rowwise: every degree divides, but no op runs colwise at tp 1
    # (`planner run` refused it, export wrote tp=1 arguments with exit 0)
    data["mesh"]["tp"] = 1
    split.write_text(yaml.safe_dump(data))
    r = planner("export", str(split), "--to", "megatron")
    assert r.returncode == 2 and "field 'splits'" in _said(r) and "cannot run at tp=1" in _said(r), _said(r)


def test_show_and_export_read_a_plan_without_importing_torch(tmp_path):
    """`planner show` and `planner export` need the saved plan alone: they start without torch (two
    seconds of a three-second start-up before), with every export's text unchanged."""
    out = tmp_path / "plan.yaml"
    r = planner("optimize", "examples/llama3.py", "--cluster", "dgx-h100", "--tp", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    code = (
        "import contextlib, io, sys\n"
        "from planner.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        f"    codes = [main(['show', {str(out)!r}, '--why']), main(['export', {str(out)!r}, '--to', 'megatron'])]\n"
        "print(codes, 'torch' in sys.modules)\n"
    )
    checked = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert checked.stdout.strip() == "[0, 0] False", checked.stdout + checked.stderr


@pytest.mark.slow
def test_a_kv_cache_the_tp_pass_shards_by_heads_runs_its_rank_shard(tmp_path):
    """../shared/cases/kv_cache_index_put.py run at TP=2 (forward, not served): the TP pass shards the
    cache buffers with their heads, and each rank loads its piece of them from the unsharded state
    (it raised "checkpoint shape (2, 4, 32, 32) != rank shape (2, 2, 32, 32)"); outputs match."""
    report = tmp_path / "r.json"
    r = planner(
        "optimize", "tests/models/kv_cache_index_put.py", "--cluster", "tests/models/midlink-cpu.yaml",
        "--tp", "2", "--nproc", "2", "--run", "--iters", "1", "--min-time", "0", "--json", str(report),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(report.read_text())
    n = data["numerics"]
    assert n["max_abs_diff"] <= n["outputs"][0]["tolerance"]  # the run fails (exit 4) beyond it, too
    assert data["plan"]["splits"]["blocks.0.attn.k.weight"] == "colwise"  # the cache's heads split with k


@pytest.mark.slow
def test_a_closed_stdout_stops_quietly_with_exit_141(example_path) -> None:
    """`planner optimize ... | head -1`: the reader leaves after the first line (printed before the
    plan is searched); the command stops without a traceback or message, exit 128 + SIGPIPE (rich's
    own handler exited 1, a code the docs do not list)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "planner.cli", "optimize", str(example_path("llama3")), "--cluster", "local-cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().startswith("Traced")
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err
    assert "Traceback" not in err and "error" not in err


@pytest.mark.slow
def test_pins_that_cannot_apply_say_so(example_path) -> None:
    """A pinned --dp-style on a plan with one data-parallel replica warns it had no effect (it was
    dropped silently); --ep with --run and a style other than ddp names the style rule (it blamed the
    mesh); --dp with --dp-shard counts replicas and the refusal says so (it read dp(16))."""
    llama = str(example_path("llama3"))
    common = ["--cluster", "local-cpu", "--workload", "train", "--batch-size", "2", "--seq-len", "16"]
    r = planner("optimize", llama, *common, "--nproc", "2", "--dp", "1", "--dp-style", "zero2")
    assert r.returncode == 0 and "--dp-style zero2 had no effect" in _said(r), _said(r)
    moe = str(ROOT / "tests" / "models" / "tiny_moe_modulelist.py")
    r = planner(
        "optimize", moe, *common, "--nproc", "2", "--dp", "2", "--ep", "2", "--dp-style", "zero2", "--run"
    )
    assert r.returncode == 2 and "--dp-style ddp only" in _said(r), _said(r)
    r = planner(
        "optimize", llama, *common[:4], "--batch-size", "4", "--seq-len", "16", "--nproc", "4",
        "--dp", "4", "--dp-shard", "4", "--dp-style", "fsdp",
    )  # fmt: skip
    assert r.returncode == 2 and "dp(4 replicas x 4 shards) = 16 devices" in _said(r), _said(r)
    # FSDP overlaps its collectives whatever the three overlap options say: the plan table says so (the
    # Megatron-FSDP export carries --overlap-grad-reduce --overlap-param-gather for the same reason)
    r = planner("optimize", llama, *common, "--nproc", "2", "--dp", "2", "--dp-style", "fsdp")
    said = " ".join(r.stdout.split())
    assert r.returncode == 0 and "none; fsdp prefetches and reduces one unit ahead" in said, said


def test_fp32_gradients_are_priced_said_and_no_effect_without_16_bit_training(example_path, tmp_path) -> None:
    """--grad-reduce-dtype fp32 (Megatron-LM's bf16 default) plans a bf16 training step whose gradients
    are reduced in fp32 and shows it; on a forward workload, or with fp32 training, it is said to have
    no effect."""
    llama = str(example_path("llama3"))
    common = ["--cluster", "local-cpu", "--nproc", "2", "--dp", "2", "--batch-size", "2", "--seq-len", "16"]
    out = tmp_path / "p.yaml"
    r = planner("optimize", llama, *common, "--workload", "train", "--dtype", "bf16", "--grad-reduce-dtype",
                "fp32", "--out", str(out))  # fmt: skip
    assert r.returncode == 0 and "fp32 gradients" in r.stdout, _said(r)
    assert "grad_reduce_dtype: fp32" in out.read_text()
    r = planner("optimize", llama, *common, "--grad-reduce-dtype", "fp32")
    assert r.returncode == 0 and "--grad-reduce-dtype fp32 had no effect" in _said(r), _said(r)
    fp32 = tmp_path / "fp32.yaml"
    r = planner("optimize", llama, *common, "--workload", "train", "--dtype", "fp32", "--grad-reduce-dtype", "fp32",
                "--out", str(fp32))  # fmt: skip
    assert r.returncode == 0 and "fp32 had no effect: the plan trains in fp32" in _said(r), _said(r)
    assert "fp32 gradients" not in r.stdout and "grad_reduce_dtype: fp32" not in fp32.read_text(), _said(r)
    # one replica: the micro-batches' gradients still accumulate in fp32, and the table says so
    one = [
        "--cluster",
        "local-cpu",
        "--nproc",
        "2",
        "--pp",
        "2",
        "--dp",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
    ]
    r = planner(
        "optimize", llama, *one, "--workload", "train", "--dtype", "bf16", "--grad-reduce-dtype", "fp32"
    )
    assert r.returncode == 0 and "one replica; fp32 gradients" in _said(r), _said(r)


@pytest.mark.slow
def test_fp32_gradients_run_with_fsdp(example_path) -> None:
    """A bf16 training plan with fp32 gradients and FSDP runs: each unit's gradient is reduce-scattered
    in fp32 into fp32 gradient shards (torchtitan's mixed_precision_reduce float32), and the run passes
    the numerics check with the fp32 gradient state the memory model prices."""
    llama = str(example_path("llama3"))
    r = planner("optimize", llama, "--cluster", "local-cpu", "--nproc", "2", "--dp", "2", "--batch-size", "2",
                "--seq-len", "16", "--workload", "train", "--dtype", "bf16", "--grad-reduce-dtype", "fp32",
                "--dp-style", "fsdp", "--run")  # fmt: skip
    said = _said(r)
    assert r.returncode == 0, said
    assert "reduce-scattered and accumulated in fp32" in said, said
    assert re.search(r"training state / rank \(parameters, gradients, Adam\) │ ([0-9.]+ \w+) │ \1 │", said), (
        said
    )


@pytest.mark.slow
def test_fp32_main_gradients_run_through_a_pipeline_with_tied_weights(example_path) -> None:
    """A bf16 GPT-2 (LM head tied to the embedding, a copy on each of 2 stages) with fp32 main
    gradients, ZeRO-1 over dp 2 and 2 micro-batches runs and passes the numerics check: the tied copies'
    gradients, summed between the stages after the schedule scaled them by 1 / micro-batches, join the
    unscaled main gradients at the reduction (`runtime.data_parallel._MainGrads._adopt_main`; without
    that rescaling this run fails the check)."""
    gpt2 = str(example_path("gpt2_tiny"))
    r = planner("optimize", gpt2, "--cluster", "local-cpu", "--nproc", "4", "--pp", "2", "--dp", "2",
                "--batch-size", "8", "--seq-len", "16", "--micro-batches", "2", "--workload", "train", "--dtype",
                "bf16", "--grad-reduce-dtype", "fp32", "--dp-style", "zero1", "--run")  # fmt: skip
    said = _said(r)
    assert r.returncode == 0, said
    assert "accumulated and reduced in fp32 (main gradients" in said, said
    assert re.search(r"gradients max diff [0-9.e-]+", said), said


def test_decode_run_with_expert_parallelism_over_dp_says_run_serves_tp_only(tmp_path, capsys) -> None:
    """--ep 2 --ep-fold dp with --run on a decode plan used to say --ep "does not divide the 1 dp x cp ranks
    (--dp 1)", a --dp the user never pinned (--run implies it): the message now says --run serves decode
    with tensor parallelism only and names the fix (--ep-fold tp --tp 2), before any tracing."""
    from planner.cli.main import main  # noqa: PLC0415

    moe = str(ROOT / "tests" / "models" / "tiny_mixtral_kv.py")
    common = ["optimize", moe, "--workload", "decode", "--context", "32", "--nproc", "2", "--ep", "2",
              "--run"]  # fmt: skip
    for pins, asked in ((["--ep-fold", "dp"], "--ep 2 --ep-fold dp"), (["--tp", "1"], "--ep 2 --tp 1")):
        assert main([*common, *pins, "--out", str(tmp_path / "p.yaml")]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"{asked} with --run: --run serves decode plans with tensor parallelism only" in err, err
        assert "use --ep-fold tp --tp 2 to run it, or leave out --run" in err and "--dp 1" not in err, err
        assert not (tmp_path / "p.yaml").exists()


def test_interleaving_pinned_for_a_forward_pipeline_is_refused(example_path, capsys) -> None:
    """The interleaved schedule orders training's passes: a forward plan pinned to it was planned with
    v=1 and labelled interleaved_1f1b, the pin silently dropped."""
    from planner.cli.main import main  # noqa: PLC0415

    llama = str(example_path("llama3"))
    for pins in (["--schedule", "interleaved_1f1b"], ["--virtual-stages", "2"]):
        rc = main(["optimize", llama, "--cluster", "local-cpu", "--pp", "2", *pins])
        err = " ".join(capsys.readouterr().err.split())
        assert rc == 2 and "a --workload forward pipeline runs each micro-batch" in err and pins[0] in err, (
            err
        )


def test_a_plan_on_fewer_devices_than_offered_says_so(example_path, capsys) -> None:
    """A free search that keeps fewer devices than --devices offers says so and how to pin a larger
    mesh (a helper's sweep: HF Llama training on --devices 2 ran on one rank with no word why); a mesh
    the user pinned, or one on every device, adds nothing."""
    from planner.cli.main import main  # noqa: PLC0415

    llama = str(example_path("llama3"))
    common = ["optimize", llama, "--cluster", "local-cpu", "--devices", "2", "--seq-len", "8"]
    note = "the plan uses 1 of the 2 devices offered"
    assert main([*common, "--batch-size", "1"]) == 0  # one sequence: nothing for DP to split
    captured = capsys.readouterr()
    assert note in " ".join((captured.out + captured.err).split())
    assert main([*common, "--batch-size", "1", "--tp", "1"]) == 0
    captured = capsys.readouterr()
    assert note not in " ".join((captured.out + captured.err).split())
    assert main([*common, "--batch-size", "2", "--dp", "2"]) == 0
    captured = capsys.readouterr()
    assert "devices offered" not in " ".join((captured.out + captured.err).split())


def test_options_the_plan_gives_nothing_to_act_on_say_so(example_path, capsys) -> None:
    """Run options without --run, expert options on a dense model and CP options on a plan without CP
    were accepted in silence; a --timeout too short for the ranks to start is refused (exit 2)."""
    from planner.cli.main import main  # noqa: PLC0415

    llama = str(example_path("llama3"))
    common = ["optimize", llama, "--cluster", "local-cpu", "--nproc", "2"]
    assert (
        main([*common, "--iters", "3", "--ep-fold", "dp", "--moe-imbalance", "2", "--cp-comm-type", "ring"])
        == 0
    )
    err = " ".join(capsys.readouterr().err.split())
    assert "--iters 3 had no effect: run options apply to --run" in err, err
    assert (
        "--ep-fold dp, --moe-imbalance 2.0 had no effect: the model has no mixture-of-experts layer" in err
    ), err
    assert "--cp-comm-type ring had no effect: the plan has no context parallelism" in err, err
    assert main([*common, "--run", "--timeout", "0.01"]) == 2
    assert "expected at least 10 seconds" in capsys.readouterr().err
    moe = str(ROOT / "tests" / "models" / "tiny_moe_gptfast.py")
    assert (
        main(
            ["optimize", moe, "--cluster", "dgx-h100", "--workload", "train", "--ep-fold", "tp", "--tp", "1"]
        )
        == 0
    )
    err = " ".join(capsys.readouterr().err.split())
    assert "--ep-fold tp had no effect: the plan has one TP rank (tp=1)" in err, err


def test_a_failed_numerics_check_still_writes_the_json_report(
    example_path, tmp_path, monkeypatch, capsys
) -> None:
    """When the ranks finish but the sharded model does not match the unsharded one (exit 4), --json
    still gets the run's report with the failure, what CI reads to triage it (no report was written)."""
    import json  # noqa: PLC0415

    from planner.cli import workflow  # noqa: PLC0415
    from planner.cli.main import main  # noqa: PLC0415
    from planner.errors import RunError  # noqa: PLC0415

    run = {"measured": {"latency_s": 0.01, "notes": []}, "numerics": {"ok": False, "max_abs_diff": 3.85}}

    def failing(*args, **kwargs):
        raise RunError("the sharded run does not compute what the unsharded model computes", run=run)

    monkeypatch.setattr(workflow, "run_plan", failing)
    report = tmp_path / "r.json"
    args = ["optimize", str(example_path("llama3")), "--cluster", "local-cpu", "--nproc", "2", "--run"]
    assert main([*args, "--json", str(report), "--out", str(tmp_path / "p.yaml")]) == 4
    written = json.loads(report.read_text())
    assert written["failed"].startswith("the sharded run does not compute") and not written["numerics"]["ok"]
    assert written["written_by"] == "planner optimize --json"
    assert not (tmp_path / "p.yaml").exists()  # the plan of a failed run is not written


def test_a_batched_keyword_tensor_keeps_the_batch_whole(tmp_path, capsys) -> None:
    """example_kwargs() with a (batch, seq) mask: keyword tensors reach every replica and micro-batch
    whole, so --dp 2 is refused naming the keyword (the ranks crashed in their capture after planning
    DP 2), and the free plan keeps one replica, as do the hand-written layouts it is compared with
    (the torchtitan recipe was priced at DP 2)."""
    from planner.cli.main import main  # noqa: PLC0415

    model = str(Path(__file__).resolve().parent / "models" / "batched_kwarg_mask.py")
    rc = main(["optimize", model, "--cluster", "local-cpu", "--nproc", "2", "--dp", "2"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "keyword input 'keep' (4, 8)" in err and "example_inputs()" in err, err
    assert "make it a positional argument of forward" in err and "would each see part of it" not in err, err
    out_plan = tmp_path / "plan.yaml"
    rc = main(["optimize", model, "--cluster", "local-cpu", "--nproc", "2", "--workload", "train", "--out",
               str(out_plan)])  # fmt: skip
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0 and "DP=1" in out, out[-2000:]
    plan = yaml.safe_load(out_plan.read_text())
    assert plan["mesh"]["dp"] == 1 and plan["baseline_layout"]["dp"] == "1", plan["baseline_layout"]
    assert plan["torchtitan_layout"].get("dp", "1") == "1", plan["torchtitan_layout"]


def test_a_run_whose_rank_raises_still_writes_the_json_report(tmp_path, capsys) -> None:
    """--json gets the report with `failed` when a rank raises (it was written only for a failed
    numerics check, so CI had nothing to read for a crash). Here the model raises while the rank
    captures it: the model file's fault, exit 2 (`runtime.launch`: an InputError of the ranks), with
    the report written all the same."""
    from planner.cli.main import main  # noqa: PLC0415

    model = tmp_path / "crash.py"
    model.write_text(
        "import torch\nfrom torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.lin = nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        if torch.distributed.is_initialized():\n            raise RuntimeError('only on a rank')\n"
        "        return self.lin(x)\n"
        "def build_model():\n    return M()\n"
        "def example_inputs(batch_size=2, seq_len=4):\n    return (torch.randn(batch_size, seq_len, 8),)\n"
    )
    report = tmp_path / "report.json"
    rc = main(["optimize", str(model), "--cluster", "local-cpu", "--nproc", "1", "--run", "--iters", "1",
               "--warmup", "0", "--min-time", "0", "--json", str(report)])  # fmt: skip
    capsys.readouterr()
    data = json.loads(report.read_text())
    assert rc == 2 and "only on a rank" in data["failed"] and data["predicted"]["latency_s"] > 0


def test_example_kwargs_takes_the_batch_and_sequence_it_asks_for(tmp_path) -> None:
    """example_kwargs(batch_size, seq_len) is given the sizes example_inputs gets (a padding mask of the
    asked length; it was called with none, so --seq-len 32 met a mask of the default 8)."""
    from planner.frontend.modelfile import load_model_file  # noqa: PLC0415

    path = tmp_path / "masked.py"
    path.write_text(
        "import torch\nfrom torch import nn\n"
        "def build_model():\n    return nn.Linear(4, 4)\n"
        "def example_inputs(batch_size=2, seq_len=8):\n    return (torch.randn(batch_size, seq_len, 4),)\n"
        "def example_kwargs(batch_size=2, seq_len=8):\n    return {'mask': torch.ones(batch_size, seq_len)}\n"
    )
    _, kwargs = load_model_file(path).inputs(batch_size=3, seq_len=32)
    assert tuple(kwargs["mask"].shape) == (3, 32)

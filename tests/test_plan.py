"""Plan dataclass: YAML round trip, atomic write, malformed plans rejected naming the field."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import yaml

from planner.errors import InputError
from planner.plan import (
    Decision,
    LayerCost,
    MeshCandidate,
    MeshShape,
    Plan,
    Prediction,
    Recompute,
    Schedule,
    SolverInfo,
    WeightSplit,
    Workload,
)


def _prediction(latency_s: float = 0.01) -> Prediction:
    return Prediction(
        latency_s=latency_s,
        throughput_tokens_per_s=1000.0,
        peak_memory_bytes=2.0e9,
        compute_s=0.008,
        exposed_comm_s=0.002,
        overlapped_comm_s=0.0,
        bubble_s=0.0,
        per_layer=[LayerCost(0, 0, 0.004, 0.001, 0.0, 1e9, {"mlp": "megatron"})],
    )


def make_plan() -> Plan:
    """A small, valid two-layer plan."""
    splits = {
        "layers.0.mlp.up.weight": WeightSplit("layers.0.mlp.up.weight", "colwise", 0),
        "layers.0.mlp.down.weight": WeightSplit("layers.0.mlp.down.weight", "rowwise", 1),
        "h.0.attn.c_attn.weight": WeightSplit("h.0.attn.c_attn.weight", "colwise", 1, [768, 768, 768]),
        "wte.weight": WeightSplit("wte.weight", "vocab", 0),
    }
    return Plan(
        model="toy",
        cluster="dgx-h100",
        workload="forward",
        batch_size=4,
        seq_len=128,
        context=0,
        micro_batches=1,
        dtype="bf16",
        mesh=MeshShape(2, 1, 1),
        splits=splits,
        stages=[[0, 1]],
        ladder_layers=[1],
        predicted=_prediction(),
        solver=SolverInfo("Optimal Solution Found", 0.01, 0.0, 0.05, 42),
        decisions=[
            Decision("layers.mlp", "megatron", {"megatron": 0.001, "replicate": math.inf}, "cheapest")
        ],
        excluded=["tp=3: 32 heads not divisible by 3"],
        baseline=_prediction(0.02),
        mesh_candidates=[
            MeshCandidate(MeshShape(2, 1, 1), 1, 0.01),
            MeshCandidate(MeshShape(4, 1, 1), 1, None, "does not fit"),
        ],
    )


def test_yaml_round_trip(tmp_path: Path) -> None:
    plan = make_plan()
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    loaded = Plan.from_yaml(path)
    assert loaded == plan
    assert loaded.splits["h.0.attn.c_attn.weight"].parts == [768, 768, 768]
    assert math.isinf(loaded.decisions[0].options["replicate"])
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]  # no temp file left behind
    assert loaded.workload is Workload.FORWARD and loaded.schedule is Schedule.ONE_F_ONE_B
    assert (loaded.tp, loaded.pp, loaded.dp, loaded.num_devices) == (2, 1, 1, 2)


def test_the_model_path_is_saved_beside_the_plan_and_found_from_any_folder(tmp_path, monkeypatch) -> None:
    """A plan saved in another folder than the working directory records its model relative to the
    plan file, so `planner run` finds it from anywhere; a plan written before (relative to the folder
    it was made in) still runs, but a same-named file in both places is refused, not guessed (a
    different mylm.py in the working directory was loaded and stopped only by its parameter count)."""
    (tmp_path / "models").mkdir()
    (tmp_path / "plans").mkdir()
    (tmp_path / "models" / "m.py").write_text("# the model\n")
    monkeypatch.chdir(tmp_path)
    plan = dataclasses.replace(make_plan(), model="models/m.py")
    plan.to_yaml("plans/p.yaml")
    loaded = Plan.from_yaml("plans/p.yaml")
    assert loaded.model == "../models/m.py"
    for folder in (tmp_path, tmp_path / "plans", tmp_path / "models"):
        monkeypatch.chdir(folder)
        assert loaded.model_file(tmp_path / "plans" / "p.yaml").resolve() == tmp_path / "models" / "m.py"
    monkeypatch.chdir(tmp_path)
    old = dataclasses.replace(make_plan(), model="models/m.py")  # as an older planner wrote it
    assert old.model_file("plans/p.yaml") == Path("models/m.py")
    (tmp_path / "plans" / "models").mkdir()
    (tmp_path / "plans" / "models" / "m.py").write_text("# another model of the same name\n")
    with pytest.raises(
        InputError, match=r"both plans/models/m.py \(beside the plan\) and models/m.py .* differ"
    ):
        old.model_file("plans/p.yaml")
    with pytest.raises(InputError, match=r"made for gone.py .* not a file there"):
        dataclasses.replace(old, model="gone.py").model_file("plans/p.yaml")


def test_reads_plans_with_a_flat_mesh(tmp_path: Path) -> None:
    """Plans written before the mesh was one field: top-level tp/pp/dp, candidates' m in the note."""
    data = make_plan().to_dict()
    mesh = data.pop("mesh")
    mesh.pop("cp")  # written before context parallelism too
    data.update(mesh)
    data.pop("schedule")
    data["mesh_candidates"] = [
        {"tp": 2, "pp": 1, "dp": 1, "latency_s": 0.01, "note": "m=1: Optimal Solution Found"},
        {"tp": 4, "pp": 2, "dp": 1, "latency_s": None, "note": "m=8: does not fit"},
    ]
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    plan = Plan.from_yaml(path)
    assert plan.mesh == MeshShape(2, 1, 1) and plan.schedule is Schedule.ONE_F_ONE_B
    assert plan.mesh_candidates == [
        MeshCandidate(MeshShape(2, 1, 1), 1, 0.01, "Optimal Solution Found"),
        MeshCandidate(MeshShape(4, 2, 1), 8, None, "does not fit"),
    ]


def test_safe_load_only(tmp_path: Path) -> None:
    path = tmp_path / "evil.yaml"
    path.write_text("!!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(InputError, match="not valid YAML"):
        Plan.from_yaml(path)


@pytest.mark.parametrize(
    ("edit", "field_name"),
    [
        (lambda d: d["mesh"].pop("tp"), "mesh.tp"),
        (lambda d: d["mesh"].__setitem__("tp", "eight"), "mesh.tp"),
        (lambda d: d["mesh"].__setitem__("dp", 0), "mesh.dp"),
        (lambda d: d.__setitem__("schedule", "zb"), "schedule"),
        (lambda d: d["mesh_candidates"][0].pop("micro_batches"), "mesh_candidates[0].micro_batches"),
        (lambda d: d["splits"]["wte.weight"].__setitem__("style", "diagonal"), "splits.wte.weight.style"),
        (lambda d: d["splits"]["wte.weight"].__setitem__("dim", 2), "splits.wte.weight.dim"),
        (lambda d: d["predicted"].__setitem__("latency_s", "fast"), "predicted.latency_s"),
        (lambda d: d["predicted"]["per_layer"][0].pop("stage"), "predicted.per_layer[0].stage"),
        (lambda d: d.__setitem__("stages", [[0], [1]]), "stages"),
        (lambda d: d.__setitem__("workload", "serve"), "workload"),
        (lambda d: d.__setitem__("workload", "decode"), "context"),  # a train plan edited to decode
        (lambda d: d.__setitem__("ladder_layers", [7]), "ladder_layers"),
        (lambda d: d.__setitem__("extra_key", 1), "plan"),
    ],
)
def test_malformed_plan_names_field(tmp_path: Path, edit, field_name: str) -> None:
    data = make_plan().to_dict()
    edit(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError) as info:
        Plan.from_yaml(path)
    assert field_name in str(info.value)


def test_a_renamed_key_names_the_level_the_close_field_and_the_missing_one(tmp_path: Path) -> None:
    """A top-level `stages:` renamed `stages_x:` said "field '': unknown keys ['stages_x']": the message
    names the plan file's top level, suggests the field meant and says the required one is now missing;
    a nested typo names its field."""
    data = make_plan().to_dict()
    data["stages_x"] = data.pop("stages")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError) as info:
        Plan.from_yaml(path)
    assert str(info.value) == (
        f"{path}: plan file top level: unknown key 'stages_x' (did you mean 'stages'?), and the required "
        "field 'stages' is missing; rename or remove the unknown key"
    )
    data = make_plan().to_dict()
    data["mesh"]["tpx"] = data["mesh"].pop("tp")
    with pytest.raises(InputError, match=r"field 'mesh': unknown key 'tpx' \(did you mean 'tp'\?\)"):
        Plan.from_dict(data)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read"):
        Plan.from_yaml(tmp_path / "nope.yaml")


def test_interleaved_chunks_are_runs_of_each_ranks_layers() -> None:
    """Chunk c of pipeline rank r (its c-th run of consecutive layers) is virtual stage c * pp + r."""
    plan = make_plan()
    plan.mesh, plan.ladder_layers = MeshShape(1, 2, 1), []
    plan.schedule, plan.virtual_stages = Schedule.INTERLEAVED_1F1B, 2
    plan.stages = [[0, 1, 4, 5], [2, 3, 6, 7]]
    plan.validate()
    assert plan.virtual_stage_layers() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert Plan.from_dict(plan.to_dict()).virtual_stage_layers() == plan.virtual_stage_layers()
    plan.stages = [[0, 1, 2, 3], [4, 5, 6, 7]]  # one run per rank: not two chunks
    with pytest.raises(InputError, match=r"'stages': rank 0 holds layers \[0, 1, 2, 3\], 1 runs"):
        plan.validate()
    plan.stages = [[0, 3], [1, 2]]  # rank 1's one run cannot be two chunks
    with pytest.raises(InputError, match="rank 1 holds layers"):
        plan.validate()
    plan.stages = [[2, 4], [0, 3]]  # virtual stage order 2, 0, 4, 3
    with pytest.raises(InputError, match=r"'stages'.*virtual stage c \* pp \+ r"):
        plan.validate()


def test_a_replicated_split_edited_to_a_null_dim_loads() -> None:
    """A hand edit writing `style: replicate, dim: null` (the dim is unused there) loads; another style
    still needs its dim."""
    data = make_plan().to_dict()
    weight, split = next(iter(data["splits"].items()))
    data["splits"][weight] = {**split, "style": "replicate", "dim": None}
    assert Plan.from_dict(data).splits[weight].dim == 0
    data["splits"][weight] = {**split, "style": "colwise", "dim": None}
    with pytest.raises(InputError, match="dim': expected an integer, got None"):
        Plan.from_dict(data)


def test_a_json_report_given_as_a_plan_says_it_is_a_report() -> None:
    report = {"plan": make_plan().to_dict(), "predicted": {}, "measured": {}, "cluster": "local-cpu"}
    with pytest.raises(InputError, match=r"r\.json is a report \(what --json writes\), not a plan"):
        Plan.from_dict(report, origin="r.json")


def test_a_model_that_changed_since_planning_is_refused() -> None:
    """`planner run` checks the model's parameter count against the plan's `model_params`."""
    from planner.cli import workflow  # noqa: PLC0415

    prepared = workflow.prepare(str(Path(__file__).parents[1] / "examples" / "llama3.py"))
    cluster = workflow.resolve_cluster("local-cpu", 2)
    plan = workflow.make_plan(prepared, cluster, workflow.constraints_from(2, 1, 1, "none"), "llama3.py")
    assert plan.model_params == prepared.structure.num_params > 0
    workflow.validate_plan_for_model(plan, prepared.structure, "llama3.py", prepared.param_shapes)
    plan.model_params += 64
    with pytest.raises(InputError, match="plan field model_params: .* the model changed since planning"):
        workflow.validate_plan_for_model(plan, prepared.structure, "llama3.py", prepared.param_shapes)


def test_a_hand_edited_sharded_dp_style_across_tied_stages_is_refused_before_the_ranks() -> None:
    """GPT-2's LM head is tied to its embedding: at pp 2 they sit on different stages, whose sharded
    gradients (zero2, fsdp) cannot be summed; `optimize` never plans it, and a plan edited to it is
    refused naming the field before any rank starts (it was refused on the ranks, exit 4)."""
    import dataclasses  # noqa: PLC0415

    from planner.cli import workflow  # noqa: PLC0415
    from planner.plan import DataParallel  # noqa: PLC0415

    prepared = workflow.prepare(str(Path(__file__).parents[1] / "examples" / "gpt2_tiny.py"), "train", 4)
    cluster = workflow.resolve_cluster("local-cpu", 4)
    constraints = workflow.constraints_from(1, 2, 2, "none", dp_style="zero1")
    plan = workflow.make_plan(prepared, cluster, constraints, "gpt2_tiny.py")
    assert prepared.structure.tied_lm_head and (plan.pp, plan.dp) == (2, 2)
    workflow.validate_plan_for_model(plan, prepared.structure, "gpt2_tiny.py", prepared.param_shapes)
    for style in (DataParallel.ZERO2, DataParallel.FSDP):
        edited = dataclasses.replace(plan, dp_style=style)
        with pytest.raises(InputError, match=f"plan field dp_style: {style} with pp=2 and the LM head tied"):
            workflow.validate_plan_for_model(
                edited, prepared.structure, "gpt2_tiny.py", prepared.param_shapes
            )


def test_plan_table_groups_a_stages_identical_layers_and_places_the_ends() -> None:
    """An interleaved stage's model chunks (layers 0, 4 and 1, 5 on two ranks) are one row per stage;
    layers with another strategy start their own row; the non-layer ops come last."""
    from planner.cli.render import _grouped  # noqa: PLC0415
    from planner.plan import LayerCost  # noqa: PLC0415

    split, other = {"attention": "head"}, {"attention": "replicate"}
    costs = [LayerCost(i, i % 2, 1.0, 0.5, 0.0, 10.0, split) for i in (0, 1, 4, 5)]
    costs += [LayerCost(2, 0, 1.0, 0.0, 0.0, 10.0, other), LayerCost(-1, 0, 2.0, 0.0, 0.0, 5.0, {})]
    rows = [(label, cost.stage, layers) for label, cost, layers in _grouped(costs)]
    assert rows == [("0, 4", 0, [0, 4]), ("2", 0, [2]), ("1, 5", 1, [1, 5]), ("ends", 0, [])]


def test_ladder_layer_sets_are_labelled_by_their_ranges() -> None:
    from planner.cli.quality import _layers_label  # noqa: PLC0415

    assert _layers_label([1, 2, 4, 5, 6, 7]) == "1-2, 4-7" and _layers_label([]) == "none"


def test_pinned_interleaving_a_shallow_model_cannot_have_says_why() -> None:
    from planner.cli import workflow  # noqa: PLC0415
    from planner.errors import InfeasibleError  # noqa: PLC0415

    prepared = workflow.prepare(str(Path(__file__).parents[1] / "examples" / "gpt2_tiny.py"), "train", 8)
    constraints = workflow.constraints_from(None, 2, None, "none", max_devices=2, schedule="interleaved_1f1b")
    with pytest.raises(
        InfeasibleError, match=r"with pp=2 and batch 8; excluded: pp=2: the interleaved schedule"
    ):
        workflow.make_plan(prepared, workflow.resolve_cluster("local-cpu", 2), constraints, "gpt2_tiny.py")


def test_batchnorm_training_keeps_the_whole_batch_and_counts_the_conv_parameters() -> None:
    """A conv net with BatchNorm trains on one data-parallel replica with one micro-batch (its batch
    statistics), pinned --dp 2 is refused saying why; its conv and norm parameters (outside any
    transformer layer) are in the memory prediction with their gradient and Adam state."""
    from planner.cli import workflow  # noqa: PLC0415

    prepared = workflow.prepare(str(Path(__file__).parents[1] / "examples" / "convnet.py"), "train")
    cluster = workflow.resolve_cluster("local-cpu", 2)
    plan = workflow.make_plan(
        prepared, cluster, workflow.constraints_from(None, None, None, "none"), "convnet.py"
    )
    assert plan.dp == 1 and plan.micro_batches == 1
    assert any("BatchNorm" in e for e in plan.excluded)
    # fp32 parameters, gradients and two Adam moments: at least 16 bytes per parameter
    assert plan.predicted.peak_memory_bytes >= 16 * prepared.structure.num_params
    with pytest.raises(InputError, match="trains with BatchNorm"):
        workflow.make_plan(prepared, cluster, workflow.constraints_from(None, None, 2, "none"), "convnet.py")


def test_why_table_prints_labels_with_brackets_as_text() -> None:
    """A mesh label such as "m=2 [interleaved_1f1b v=2]" is text, not rich markup (it lost its bracket)."""
    import io  # noqa: PLC0415

    from rich.console import Console  # noqa: PLC0415

    from planner.cli.render import render_decisions  # noqa: PLC0415
    from planner.plan import Decision  # noqa: PLC0415

    plan = make_plan()
    label = "tp=1 pp=2 dp=1 m=2 [interleaved_1f1b v=2]"
    plan.decisions = [Decision("mesh", label, {label: 0.0156, "tp=1 pp=2 dp=1 m=2": 0.0169}, "fastest")]
    out = io.StringIO()
    render_decisions(Console(file=out, width=300), plan)
    assert out.getvalue().count("[interleaved_1f1b v=2]") == 2


def test_a_plan_edited_after_planning_is_priced_again_as_its_splits_say() -> None:
    """`planner run` of a hand-edited plan: its decisions no longer match the digest it was priced
    with, so it is priced again, with the op choices its edited splits (what the passes apply) imply;
    an unedited plan is left as priced."""
    import dataclasses

    from costmodels.cluster import load_cluster
    from planner.cli import workflow
    from planner.plan import SplitStyle

    cluster = load_cluster("local-cpu", 2)
    prepared = workflow.prepare("examples/mlp.py", "forward")
    plan = workflow.make_plan(
        prepared, cluster, workflow.constraints_from(2, 1, 1, "none"), "examples/mlp.py"
    )
    assert {str(s.style) for s in plan.splits.values()} == {"replicate"}
    assert plan.priced_digest == plan.decisions_digest()
    assert workflow.reprice_if_edited(plan, prepared, cluster) is None
    splits = dict(plan.splits)
    splits["net.2.weight"] = dataclasses.replace(splits["net.2.weight"], style=SplitStyle.COLWISE, dim=0)
    splits["net.4.weight"] = dataclasses.replace(splits["net.4.weight"], style=SplitStyle.ROWWISE, dim=1)
    edited = dataclasses.replace(plan, splits=splits)
    again = workflow.reprice_if_edited(edited, prepared, cluster)
    assert again is not None and again.priced_digest == again.decisions_digest()
    strategy = again.predicted.per_layer[0].strategy
    assert (strategy["fc1"], strategy["act2"], strategy["fc2"]) == ("colwise", "shard", "rowwise")
    assert again.predicted.exposed_comm_s > 0 == plan.predicted.exposed_comm_s  # the row-parallel all-reduce


@pytest.mark.slow
def test_show_and_export_read_a_chain_models_plan(tmp_path) -> None:
    """A plan the planner wrote for a model without transformer layers (stages [[]]) is shown and
    exported like any other (was: 'stages must list the layers 0..0')."""
    from tests.cli_in_process import planner_in_process  # noqa: PLC0415

    plan = tmp_path / "mlp.yaml"
    made = planner_in_process("optimize", "examples/mlp.py", "--cluster", "dgx-h100", "--out", str(plan))
    assert made.returncode == 0, made.stderr
    for args in (["show", str(plan)], ["export", str(plan), "--to", "dtensor"]):
        done = planner_in_process(*args)
        assert done.returncode == 0, done.stderr


def test_binary_or_folder_inputs_are_one_clear_error(tmp_path) -> None:
    from costmodels.cluster import load_cluster
    from planner.errors import InputError
    from planner.frontend.modelfile import load_model_file
    from planner.plan import Plan

    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(InputError, match="not UTF-8"):
        load_cluster(str(binary))
    with pytest.raises(InputError, match="not UTF-8"):
        Plan.from_yaml(binary)
    with pytest.raises(InputError, match="is a folder"):
        load_cluster(str(tmp_path))
    with pytest.raises(InputError, match="is a folder"):
        load_model_file(str(tmp_path))


def test_messages_name_what_the_user_gave(tmp_path) -> None:
    """upper:0 / auto:max=0 are refused with the way to say none; a model without transformer layers
    says so instead of "only 0 layers; N from 1 to 0"; a plan or a report given as a cluster spec, and
    a report given as a plan, say what they are."""
    import json

    from costmodels.cluster import load_cluster
    from planner.errors import InputError
    from planner.plan import Plan
    from planner.solver.problem import LadderMode, LadderPolicy

    for text in ("upper:0", "auto:max=0"):
        with pytest.raises(InputError, match="--ladder none"):
            LadderPolicy.parse(text, option="--ladder")
    with pytest.raises(InputError, match="no transformer layers"):
        LadderPolicy.parse("upper:1").for_layers(0)
    assert LadderPolicy.parse("auto").for_layers(0).mode is LadderMode.NONE
    with pytest.raises(InputError, match=r"auto:max=N with N from 1 to 4"):
        LadderPolicy.parse("auto:max=9").for_layers(4)
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text("model: m.py\nsplits: {}\nstages: [[0]]\n")
    with pytest.raises(InputError, match="is a plan"):
        load_cluster(str(plan_file))
    report = tmp_path / "report.json"
    report.write_text(
        json.dumps({"written_by": "planner optimize --json", "model": "m.py", "plan": {}, "predicted": {}})
    )
    with pytest.raises(InputError, match="is a report"):
        load_cluster(str(report))
    with pytest.raises(InputError, match="is a report"):
        Plan.from_yaml(report)


def test_a_sequence_first_input_is_read_as_batch_and_sequence(tmp_path) -> None:
    """nn.Transformer's default (seq, batch, dim) input: the batch and sequence the user asked for are
    the plan's (was: swapped, samples/s 4x too high), and the batch is not split (dim 0 is the sequence)."""
    from planner.cli import workflow

    model = tmp_path / "seqfirst.py"
    model.write_text(
        "import torch\nfrom torch import nn\n"
        "def build_model():\n"
        "    return nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0), num_layers=2,"
        " enable_nested_tensor=False)\n"
        "def example_inputs(batch_size=4, seq_len=16):\n    return (torch.randn(seq_len, batch_size, 64),)\n"
    )
    prepared = workflow.prepare(str(model), "forward", batch_size=8, seq_len=32)
    assert (prepared.structure.batch_size, prepared.structure.seq_len) == (8, 32)
    assert (prepared.workload.batch_size, prepared.workload.seq_len) == (8, 32)
    assert "sequence-first" in prepared.structure.batch_mixing[0]


@pytest.mark.parametrize(
    "model, why",
    [
        ("tests/models/odd_widths_convnet.py", "no weight of this model divides by tp=2"),
        ("examples/mlp.py", "the collectives would cost more than the split saves"),
    ],
)
def test_an_all_replicated_tp_plan_says_why(model: str, why: str) -> None:
    """TP=2 with every weight replicated: the note gives the reason, widths that do not divide by tp
    (the classifier's 7 outputs, 33 inputs) or collectives dearer than the split (the MLP at batch 8
    on local-cpu's slow links)."""
    import io  # noqa: PLC0415

    from rich.console import Console  # noqa: PLC0415

    from costmodels.cluster import load_cluster  # noqa: PLC0415
    from planner.cli import workflow  # noqa: PLC0415
    from planner.cli.render import render_plan  # noqa: PLC0415

    prepared = workflow.prepare(model)
    spec = load_cluster("tests/models/fastlink.yaml" if "odd" in model else "local-cpu", 2)
    plan = workflow.make_plan(prepared, spec, workflow.constraints_from(2, None, None, "none"), model)
    assert plan.tp == 2 and all(str(s.style) == "replicate" for s in plan.splits.values())
    out = io.StringIO()
    render_plan(Console(file=out, width=400), plan)
    note = next(line for line in out.getvalue().splitlines() if line.startswith("note: TP=2"))
    assert why in note


def test_the_baseline_line_says_when_the_experts_layout_does_not_fit_memory() -> None:
    """The default output's baseline line says when the hand-written Megatron layout exceeds the
    device's memory, with the bytes, also when notes follow the memory part of its decision (the
    line quoted the reason's last part, a note on the baseline's gathers, and said so only in --why).
    gpt2_tiny (4 heads) on 8 devices of 168 KiB: the expert's TP=4 (the node's widest for 4 heads; every
    narrower one is tried first and needs more) with 2 replicas needs about 184 KiB per rank (its logits
    included); the plan fits."""
    import dataclasses  # noqa: PLC0415
    import io  # noqa: PLC0415
    import re  # noqa: PLC0415

    from rich.console import Console  # noqa: PLC0415

    from costmodels.cluster import SpecWarning, parse_cluster  # noqa: PLC0415
    from planner.cli import workflow  # noqa: PLC0415
    from planner.cli.render import render_plan  # noqa: PLC0415

    spec = yaml.safe_load(Path("tests/models/fastlink.yaml").read_text())
    spec["devices_per_node"] = 8
    spec["device"]["memory_GiB"] = 0.00016
    with pytest.warns(SpecWarning, match="memory_GiB"):  # tiny, as wanted
        cluster = parse_cluster(spec, "tiny-memory")
    model = "examples/gpt2_tiny.py"
    plan = workflow.make_plan(
        workflow.prepare(model), cluster, workflow.constraints_from(None, None, None, "none"), model
    )
    assert (
        plan.baseline.peak_memory_bytes
        > 0.9 * cluster.device.memory_bytes
        >= plan.predicted.peak_memory_bytes
    )

    def baseline_line(p: Plan) -> str:
        out = io.StringIO()
        render_plan(Console(file=out, width=400), p)
        return next(line for line in out.getvalue().splitlines() if line.startswith("Hand-written Megatron"))

    said = r"does not fit: needs 1\d\d KiB per rank, over the 151 KiB usable of the device's 168 KiB"
    assert re.search(said, baseline_line(plan)) and "its speed" not in baseline_line(plan)
    noted = [
        dataclasses.replace(d, reason=f"{d.reason}; priced with the 2 all-gather(s) the TP pass adds to it")
        if d.subject == "megatron-baseline"
        else d
        for d in plan.decisions
    ]
    assert re.search(said, baseline_line(dataclasses.replace(plan, decisions=noted)))


def test_layout_megatron_runs_the_split_layout_where_auto_keeps_every_weight_replicated(monkeypatch) -> None:
    """--tp 2 on local-cpu: the solver keeps every weight of the tiny Llama replicated (its collectives
    cost more than the split saves) and the note names --layout megatron; with it, the splits are the
    hand-written Megatron-LM layout at TP=2 (column-parallel q/k/v/gate/up, row-parallel o/down,
    vocab-parallel embedding and LM head), priced as the baseline prices that layout (the model table,
    which forwards this narrow model at TP 1, set aside so that the baseline takes the node's TP 2)."""
    import io  # noqa: PLC0415

    from rich.console import Console  # noqa: PLC0415

    from costmodels.cluster import load_cluster  # noqa: PLC0415
    from planner.cli import workflow  # noqa: PLC0415
    from planner.cli.render import render_plan  # noqa: PLC0415
    from planner.solver import baseline  # noqa: PLC0415

    monkeypatch.setattr(baseline, "MEGATRON_TP_BY_HIDDEN", ())

    model = "examples/llama3.py"
    prepared = workflow.prepare(model)
    spec = load_cluster("local-cpu", 2)
    auto = workflow.make_plan(prepared, spec, workflow.constraints_from(2, None, None, "none"), model)
    assert auto.tp == 2 and all(str(s.style) == "replicate" for s in auto.splits.values())
    out = io.StringIO()
    render_plan(Console(file=out, width=400), auto)
    note = next(line for line in out.getvalue().splitlines() if line.startswith("note: TP=2"))
    assert "every weight stays replicated" in note and "--layout megatron" in note

    constraints = workflow.constraints_from(2, None, None, "none", layout="megatron")
    plan = workflow.make_plan(prepared, spec, constraints, model)
    want = {"q": "colwise", "k": "colwise", "v": "colwise", "gate": "colwise", "up": "colwise",
            "o": "rowwise", "down": "rowwise", "lm_head": "vocab"}  # fmt: skip
    assert plan.tp == 2 and {w: want[r] for w, r in plan.roles.items()} == {
        w: str(plan.splits[w].style) for w in plan.roles
    }
    assert all(str(plan.splits[e.weight].style) == "vocab" for e in prepared.structure.embeddings)
    assert plan.predicted.latency_s == pytest.approx(plan.baseline.latency_s)
    assert plan.predicted.latency_s > auto.predicted.latency_s  # what the solver avoided, as priced
    assert any(d.subject == "layout" and d.chosen == "megatron" for d in plan.decisions)
    with pytest.raises(InputError, match="layout must be one of auto, megatron"):
        workflow.constraints_from(2, None, None, "none", layout="sideways")


def test_layout_megatron_refuses_an_attention_it_cannot_split_by_heads() -> None:
    """OLMo-2 normalises q and k over all heads at once: `--layout megatron` planned its attention
    replicated without a word (and its report set that beside the hand-written Megatron plan as 4x
    faster); it is refused (exit 3) naming the op and line, while the search keeps the attention whole."""
    from costmodels.cluster import load_cluster  # noqa: PLC0415
    from planner.cli import workflow  # noqa: PLC0415
    from planner.errors import InfeasibleError  # noqa: PLC0415

    model = str(Path(__file__).parent / "models" / "hf_olmo2.py")
    prepared = workflow.prepare(model, "train")
    spec = load_cluster("local-cpu", 2)
    megatron = workflow.constraints_from(2, None, None, "none", layout="megatron")
    with pytest.raises(
        InfeasibleError, match=r"--layout megatron .* layers 0-1 .*aten\.mean at modeling_olmo2\.py"
    ):
        workflow.make_plan(prepared, spec, megatron, model)
    auto = workflow.make_plan(prepared, spec, workflow.constraints_from(2, None, None, "none"), model)
    assert auto.tp == 2


def test_expert_parallelism_on_a_dense_model_is_refused_naming_the_field(captured) -> None:
    """A dense model's plan edited to ep 2 (or expert_tp 2) is refused by the plan's own check (every
    export and run reads it) and, for a plan that does not record the model's experts, by the lowering
    against the model itself; `planner run` had crashed in the runtime (IndexError) and the exports
    had written expert-parallel flags for a dense Llama."""
    from passes.lower import check_runnable  # noqa: PLC0415
    from planner.frontend.analysis import analyse  # noqa: PLC0415
    from tests.plans import fixed_plan  # noqa: PLC0415

    structure = analyse(captured("llama3").gm)
    plan = fixed_plan(structure, "llama3.py", 1, workload="train")
    plan.mesh, plan.batch_size = MeshShape(1, 1, 2), 2
    plan.model_params = structure.num_params
    plan.validate()
    plan.ep = 2
    with pytest.raises(
        InputError, match=r"'ep': is 2, but the model has no mixture-of-experts layer.*set ep: 1"
    ):
        plan.validate()
    plan.model_params = 0  # a plan that does not record the model: the lowering checks the model
    with pytest.raises(InputError, match=r"'ep' is 2, but the model has no mixture-of-experts layer"):
        check_runnable(plan, structure, True)


def test_recompute_keyed_by_layer_ranges_is_refused_by_every_reader() -> None:
    """The JSON report writes plan.recompute as layer ranges ("0-1": full); a plan keys it by layer class
    or '*'. A plan edited with ranges is refused by the plan's own check, so `planner export` (which
    wrote Megatron-LM flags for it) and `planner run` (which refused it) agree."""
    plan = make_plan()
    plan.recompute = {"0-1": Recompute.FULL, "2 - 3": Recompute.NONE}
    with pytest.raises(
        InputError, match=r"'recompute': names layer ranges \['0-1', '2 - 3'\].*Set '\*': full"
    ):
        plan.validate()
    plan.recompute = {"*": Recompute.FULL}
    plan.validate()


def test_an_edited_training_plan_prices_both_baselines_again_in_the_search_s_words() -> None:
    """A training plan edited to another batch is priced again with both hand-written layouts for the
    new job: Megatron's layout in the words the search writes (recompute "selective", not a dict of
    layer ranges; sequence parallelism and overlap filled in) and torchtitan's recipe priced again
    (it had kept the old batch's layout and step)."""
    from planner.cli import workflow  # noqa: PLC0415
    from planner.cli.render import training_rows  # noqa: PLC0415

    path = "examples/llama3.py"
    prepared = workflow.prepare(path, "train", batch_size=2, seq_len=16)
    cluster = workflow.resolve_cluster("local-cpu", 2)
    plan = workflow.make_plan(prepared, cluster, workflow.constraints_from(2, 1, 1, "none"), path)
    data = plan.to_dict()
    data["batch_size"] = 4
    edited = Plan.from_dict(data)
    again = workflow.reprice_if_edited(edited, workflow.prepare_for_plan(edited, path), cluster)
    assert again is not None
    fresh = workflow.make_plan(
        workflow.prepare(path, "train", batch_size=4, seq_len=16), cluster,
        workflow.constraints_from(2, 1, 1, "none"), path,
    )  # fmt: skip
    assert again.baseline_layout == fresh.baseline_layout
    assert again.torchtitan_layout == fresh.torchtitan_layout
    assert again.torchtitan_baseline.latency_s == pytest.approx(fresh.torchtitan_baseline.latency_s)
    rows = {row[0]: row for row in training_rows(again)}
    assert "{" not in rows["recompute"][2] and rows["sequence parallel"][2] in ("on", "off")
    assert [d.subject for d in again.decisions].count("torchtitan-baseline") == 1


@pytest.mark.parametrize(
    ("text", "says"),
    [('"just a string"\n', "holds a string"), ("- 1\n- 2\n", "holds a list"), ("", "is empty")],
)
def test_yaml_that_is_not_a_mapping_is_not_a_plan_file(tmp_path, text: str, says: str) -> None:
    """A file whose YAML is a string, a list or nothing said "field 'plan': expected a mapping": it is
    named as not a plan file, with what its YAML holds and what a plan is."""
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match=rf"mine.yaml is not a plan file: its YAML {says}.*planner optimize"):
        Plan.from_yaml(path)


def test_hand_edited_split_sizes_are_refused_naming_the_field() -> None:
    """A split's `parts` must sum to the weight's size along its dim and each divide by tp, and a split
    without parts must divide by tp: a plan edited otherwise is refused before any rank starts (it was a
    torch traceback from the tensor-parallel pass: split_with_sizes)."""
    import dataclasses  # noqa: PLC0415

    from planner.cli import workflow  # noqa: PLC0415

    prepared = workflow.prepare(str(Path(__file__).parents[1] / "examples" / "llama3.py"))
    cluster = workflow.resolve_cluster("local-cpu", 2)
    plan = workflow.make_plan(
        prepared, cluster, workflow.constraints_from(2, 1, 1, "none", layout="megatron"), "llama3.py"
    )
    name = "layers.0.attention.wq.weight"
    split = plan.splits[name]
    rows = prepared.param_shapes[name][split.dim]
    workflow.validate_plan_for_model(plan, prepared.structure, "llama3.py", prepared.param_shapes)
    for edit, match in (
        (dict(parts=[3, 5]), rf"splits\.{name}\.parts: \[3, 5\] sum to 8, but dim 0 .* has {rows}"),
        (
            dict(parts=[rows - 1, 1]),
            rf"splits\.{name}\.parts: each part is split over tp=2, and \[{rows - 1}, 1\]",
        ),
        (dict(pieces=3), rf"splits\.{name}\.pieces"),
    ):
        edited = dataclasses.replace(plan, splits={**plan.splits, name: dataclasses.replace(split, **edit)})
        with pytest.raises(InputError, match=match):
            workflow.validate_plan_for_model(edited, prepared.structure, "llama3.py", prepared.param_shapes)
    odd = dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, tp=3))
    with pytest.raises(
        InputError, match=rf"splits\.{name}: style colwise splits dim 0 .* does not divide by tp=3"
    ):
        workflow.check_split_sizes(name, split, prepared.param_shapes[name], odd.tp)


@pytest.mark.parametrize(("workload", "dtype"), [("train", "bf16"), ("train", "fp16"), ("forward", "bf16")])
def test_a_plan_priced_again_unedited_keeps_its_prediction(workload: str, dtype: str) -> None:
    """`planner run` of a plan file edited only where no decision lives (a comment) prices the plan
    again from the model as `planner optimize` prepared it: a training plan's graph (its norms' fp32
    upcasts in the plan's dtype), in the plan's dtype. It was prepared as a forward graph in fp32: an
    fp16 training plan of the tiny Llama went from 111 ms to 336 ms, and ran at 0.35 of that."""
    from planner.cli import workflow  # noqa: PLC0415

    path = "examples/llama3.py"
    prepared = workflow.prepare(path, workload, batch_size=4, seq_len=64, dtype=dtype)
    cluster = workflow.resolve_cluster("local-cpu", 2)
    plan = workflow.make_plan(prepared, cluster, workflow.constraints_from(1, 1, 2, "none"), path)
    again = workflow.reprice_if_edited(plan, workflow.prepare_for_plan(plan, path), cluster, force=True)
    assert again is not None
    assert again.predicted.latency_s == pytest.approx(plan.predicted.latency_s, rel=1e-6)
    assert again.predicted.peak_memory_bytes == pytest.approx(plan.predicted.peak_memory_bytes, rel=1e-6)

"""Ladder quality on a tiny model and corpus: data split and errors, training through the ladder graph,
checkpoint round trip, the ILP's loss budget, and the ladder-eval / adapt / optimize command paths."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from costmodels.cluster import load_cluster
from planner.cli.main import main
from planner.cli.quality import budget_neighbours
from planner.errors import InputError
from planner.frontend.modelfile import load_model_file
from planner.plan import MeshShape
from planner.solver import ilp
from planner.solver.costing import CostContext, build_cost_tables
from planner.solver.problem import Constraints, LadderBudget, LadderPolicy, MeshConfig, WorkloadSpec
from planner.solver.search import plan_model
from runtime.lm_data import TokenBlocks, corpus_files, load_corpus, split_by_file
from runtime.lm_train import TrainConfig, evaluate, lm_graph, save_weights, train
from runtime.reference import build_unsharded
from tests.planner_fixtures import handmade_llama

ROOT = Path(__file__).resolve().parent.parent
TINY_LM = str(ROOT / "tests" / "models" / "tiny_lm.py")
STDLIB_FILES = ("json/decoder.py", "json/encoder.py", "json/scanner.py", "json/__init__.py", "textwrap.py", "colorsys.py", "bisect.py", "keyword.py")  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A folder of eight standard-library source files (about 50 k tokens of real text)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    folder = tmp_path_factory.mktemp("corpus")
    for name in STDLIB_FILES:
        shutil.copy(root / name, folder / name.replace("/", "_"))
    return str(folder)


def test_split_by_file_is_deterministic_and_disjoint(corpus) -> None:
    files = corpus_files(corpus)
    train, held = split_by_file(files)
    again = split_by_file(list(reversed(files)))
    assert {f.key for f in train} == {f.key for f in again[0]} and {f.key for f in held} == {
        f.key for f in again[1]
    }
    assert held and train and not {f.key for f in train} & {f.key for f in held}
    assert len(train) + len(held) == len(files) == len(STDLIB_FILES)
    blocks = TokenBlocks(torch.arange(50), seq_len=8)
    x, y = blocks[5]
    assert len(blocks) == 6 and x.tolist() == list(range(40, 48)) and y.tolist() == list(range(41, 49))


def test_bad_data_is_a_clear_input_error(tmp_path, capsys) -> None:
    with pytest.raises(InputError, match="no such file"):
        corpus_files(tmp_path / "missing")
    with pytest.raises(InputError, match="no text files"):
        corpus_files(tmp_path)
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_text("  \n")
    with pytest.raises(InputError, match="empty"):
        load_corpus(tmp_path, 16, vocab_size=300)
    (tmp_path / "a.txt").write_text("def f(x):\n    return x + 1\n" * 3)
    with pytest.raises(InputError, match="too little text"):
        load_corpus(tmp_path, 16, vocab_size=300, min_blocks=4)
    code = main(["ladder-eval", TINY_LM, "--data", str(tmp_path / "missing")])
    assert code == 2 and "no such file" in capsys.readouterr().err


def test_a_vocabulary_smaller_than_the_byte_tokenizer_says_both_fixes(corpus, tmp_path, capsys) -> None:
    """A model of 128 token ids cannot read a byte-level tokenizer's 257: the refusal says which
    tokenizer, both numbers and the two ways out."""
    model = tmp_path / "lm128.py"
    source = Path(TINY_LM).read_text().replace("vocab_size=320", "vocab_size=128")
    here = 'str(Path(__file__).resolve().parents[2] / "examples")'
    assert here in source and "vocab_size=128" in source
    model.write_text(source.replace(here, repr(str(ROOT / "examples"))))
    code = main(["ladder-eval", str(model), "--data", corpus])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "byte-level" in err and "vocabulary of 128" in err and "at least 257" in err, err
    assert "--tokenizer with one of at most 128 tokens" in err


def test_lr_schedule_warms_up_then_decays() -> None:
    config = TrainConfig(steps=100, warmup_steps=10, min_lr_fraction=0.1)
    factors = [config.lr_factor(s) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:])) and factors[-1] == pytest.approx(
        0.1, abs=1e-3
    )


def test_ladder_training_lowers_loss_and_checkpoint_round_trips(corpus, tmp_path) -> None:
    torch.manual_seed(0)
    model_file = load_model_file(TINY_LM)
    model = build_unsharded(model_file, 0, None)
    data = load_corpus(corpus, 16, vocab_size=320, min_blocks=4)
    gm = lm_graph(model, 4, 16, [2, 3])
    assert any("tp" not in str(n.target) and n.op == "call_function" for n in gm.graph.nodes)
    before = evaluate(gm, data.held_out, 4, max_batches=4)
    result = train(gm, data.train, TrainConfig(steps=12, batch_size=4, lr=1e-2, warmup_steps=2))
    after = evaluate(gm, data.held_out, 4, max_batches=4)
    assert sum(result.losses[-3:]) < sum(result.losses[:3]) and after.loss < before.loss
    path = tmp_path / "w.safetensors"
    save_weights(gm, model, path)
    loaded = build_unsharded(model_file, 1, [str(path)])  # another seed: every weight comes from the file
    again = lm_graph(loaded, 4, 16, [2, 3])
    x, _ = data.held_out[0]
    assert torch.equal(gm(x.expand(4, -1)), again(x.expand(4, -1)))


def test_loss_budget_constrains_the_ilp_and_cuts_measured_sets() -> None:
    pcie = load_cluster("h100-pcie")
    structure = handmade_llama(num_layers=6, hidden=8192, heads=64, kv_heads=8, ffn=28672)
    workload = WorkloadSpec("decode", 1, 1, context=512)
    auto = LadderPolicy.parse("auto:max-loss-increase=1%")
    assert auto.max_loss_increase == pytest.approx(0.01) and str(auto) == "auto:max-loss-increase=1%"
    free = plan_model(structure, pcie, workload, Constraints(tp=8, ladder=auto))
    assert free.ladder_layers == [0, 1, 2, 3, 4, 5]  # without a budget every layer pays off here
    # the top layer is the sensitive one: the budget ladders lower layers instead (any subset may be chosen)
    spread = LadderBudget({0: 0.004, 1: 0.004, 2: 0.004, 3: 0.004, 4: 0.004, 5: 0.03}, 0.01)
    below_top = plan_model(structure, pcie, workload, Constraints(tp=8, ladder=auto, ladder_budget=spread))
    assert len(below_top.ladder_layers) == 2 and 5 not in below_top.ladder_layers  # 3 x 0.4% > 1%
    budget = LadderBudget({0: 0.02, 1: 0.02, 2: 0.02, 3: 0.02, 4: 0.004, 5: 0.005}, 0.01)
    two = plan_model(structure, pcie, workload, Constraints(tp=8, ladder=auto, ladder_budget=budget))
    assert two.ladder_layers == [4, 5]
    cut = plan_model(
        structure, pcie, workload, Constraints(tp=8, ladder=auto, ladder_budget=budget.excluding([4, 5]))
    )
    assert len(cut.ladder_layers) == 1 and set(cut.ladder_layers) <= {4, 5}
    assert cut.predicted.latency_s > two.predicted.latency_s > free.predicted.latency_s


@pytest.mark.slow
def test_cli_ladder_eval_adapt_and_loss_budget(corpus, tmp_path, capsys) -> None:
    report = tmp_path / "eval.json"
    common = ["--data", corpus, "--batch-size", "4", "--eval-batches", "3"]
    assert (
        main(["ladder-eval", TINY_LM, *common, "--layers", "2-3", "--sensitivity", "--json", str(report)])
        == 0
    )
    got = json.loads(report.read_text())
    assert got["ladder"]["layers"] == [2, 3] and set(got["sensitivity"]) == {"0", "1", "2", "3"}
    assert got["standard"]["perplexity"] == pytest.approx(2.718281828 ** got["standard"]["loss"])
    assert "held-out loss" in capsys.readouterr().out

    ckpt, plots = tmp_path / "adapted.safetensors", tmp_path / "plots"
    args = ["adapt", TINY_LM, *common, "--ladder", "upper:2", "--steps", "6", "--lr", "1e-2", "--nproc", "2"]
    assert main([*args, "--plot", str(plots), "--out", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert (
        "training loss" in out and "ladder, adapted" in out and (plots / "adapt_loss.png").stat().st_size > 0
    )
    model = build_unsharded(load_model_file(TINY_LM), 0, [str(ckpt)])
    with safe_open(str(ckpt), "pt") as f:
        assert set(f.keys()) == set(model.state_dict())
    # --plot never overwrites a user's file, and --out / --plot naming one path is refused before training
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "adapt_loss.png").write_text("mine")
    assert main([*args, "--plot", str(mine), "--out", str(tmp_path / "b.safetensors")]) == 2
    assert (mine / "adapt_loss.png").read_text() == "mine" and not (tmp_path / "b.safetensors").exists()
    assert main([*args, "--plot", str(ckpt), "--out", str(ckpt)]) == 2
    assert "both name" in " ".join(capsys.readouterr().err.split())

    budget = [
        "--ladder",
        "auto:max=2,max-loss-increase=1%",
        "--cluster",
        "local-cpu",
        "--nproc",
        "2",
        "--tp",
        "2",
    ]
    assert main(["optimize", TINY_LM, *budget]) == 2
    assert "--data" in capsys.readouterr().err
    # without --weights: the seeded random model's loss is ln(vocabulary), a budget on it bounds nothing
    assert main(["optimize", TINY_LM, *budget, "--data", corpus, "--eval-batches", "2"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "guessing uniformly" in err and "no --weights given" in err, err
    emit, report = tmp_path / "emit", tmp_path / "plan.json"
    argv = ["optimize", TINY_LM, *budget, "--data", corpus, "--eval-batches", "2", "--weights", str(ckpt)]
    assert main([*argv, "--emit", str(emit), "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "Ladder loss budget 1.00%" in out and "chosen" in out
    sets = json.loads(report.read_text())["ladder_loss_budget"]["sets"]
    chosen = [s for s in sets if s["role"] == "chosen"]
    assert len(chosen) == 1 and chosen[0]["measured_increase"] <= 0.01
    shards = torch.load(emit / "rank0" / "weights.pt", weights_only=True)
    with safe_open(str(ckpt), "pt") as f:  # the emitted modules name their tensors as the checkpoint does
        params = {k for k in shards if not k.startswith("rope")}
        assert params and params <= set(f.keys())


def test_budget_neighbours_drop_the_most_and_add_the_least_sensitive_layer() -> None:
    sens = {0: 0.19, 1: 0.0001, 2: -0.0001, 3: 0.001, 4: 0.0005, 5: 0.0012, 6: 0.0016, 7: 0.029}
    assert budget_neighbours([1, 2, 3, 4, 5, 6], list(range(8)), sens) == [
        [1, 2, 3, 4, 5],
        [1, 2, 3, 4, 5, 6, 7],
    ]
    assert budget_neighbours([], list(range(8)), sens) == [[2]]
    assert budget_neighbours(list(range(8)), list(range(8)), sens) == [list(range(1, 8))]


def test_lp_model_names_the_budget_constraints() -> None:
    structure = handmade_llama(num_layers=4)
    workload = WorkloadSpec("decode", 1, 1, context=64)
    ctx = CostContext(
        structure, load_cluster("h100-pcie"), workload, MeshConfig(MeshShape(4, 1, 1), 1), "bf16"
    )
    prob = ilp.IlpProblem(
        build_cost_tables(ctx),
        LadderPolicy.parse("auto:max-loss-increase=1%").for_layers(4),
        None,
        ladder_budget=LadderBudget({0: 0.002, 3: 0.005}, 0.01, ((2, 3),)),
    )
    model = ilp.lp_model(prob)
    for name in ("ladder_loss", "ladder_nogood_0"):
        assert model.get_constraint_by_name(name) is not None, name


def test_quality_commands_refuse_a_kv_cache_model_and_a_reversed_layer_range(capsys) -> None:
    """`ladder-eval` of a KV-cache model failed inside torch.export ("missing a required argument:
    'input_pos'"); `--layers 5-2` said "the model has layers 0-7"."""
    import argparse  # noqa: PLC0415

    from planner.cli.quality import ladder_layers  # noqa: PLC0415

    examples = Path(__file__).resolve().parents[1] / "examples"
    rc = main(["ladder-eval", str(examples / "llama3_kv.py"), "--data", "stdlib"])
    assert rc == 2 and "has a KV cache" in " ".join(capsys.readouterr().err.split())
    with pytest.raises(InputError, match="the range is reversed; write it low-high, e.g. --layers 2-5"):
        ladder_layers(argparse.Namespace(layers="5-2", ladder=None), 8)

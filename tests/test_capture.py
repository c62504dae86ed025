"""planner.frontend.capture: one normalised ATen graph for hand-written and Hugging Face models."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from planner.errors import InputError
from planner.frontend.capture import capture, flat_inputs, flatten_output, retarget_device
from planner.frontend.modelfile import load_model_file

RUNNABLE = ["gpt2_tiny", "llama3", "mlp", "hf_llama", "hf_gpt2"]


@pytest.mark.parametrize("name", RUNNABLE)
def test_captured_graph_equals_eager(captured, name):
    c = captured(name)
    with torch.no_grad():
        expected = flatten_output(c.model(*c.args, **c.kwargs))
        got = c.gm(*flat_inputs(c.args, c.kwargs))
    assert isinstance(got, torch.Tensor)  # one output tensor -> returned bare (HF: the logits)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", RUNNABLE)
def test_graph_guarantees(captured, name):
    c = captured(name)
    params = dict(c.model.named_parameters(remove_duplicate=False)) | dict(c.model.named_buffers())
    modules = {n for n, _ in c.model.named_modules()}
    for node in c.gm.graph.nodes:
        assert node.meta["module_path"] in modules, node.format_node()
        if node.op == "get_attr":
            assert node.target in params, node.target
        if node.op == "call_function":
            assert "_assert" not in str(node.target), node.format_node()
            assert "val" in node.meta, node.format_node()
        assert node.op != "call_module", node.format_node()


def test_module_paths_are_innermost(captured):
    gm = captured("llama3").gm
    paths = {n.name: n.meta["module_path"] for n in gm.graph.nodes}
    linears = [n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert paths[linears[0].name] == "layers.0.attention.wq"
    assert gm.graph.find_nodes(op="call_function", target=torch.ops.aten.embedding.default)[0].meta[
        "module_path"
    ] == ("tok_embeddings")


def test_tied_weight_appears_once(captured):
    gm = captured("gpt2_tiny").gm
    embedding = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.embedding.default)[0]
    last_linear = [n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default][-1]
    assert embedding.args[0].target == last_linear.args[1].target == "lm_head.weight"


@pytest.mark.slow
def test_meta_model_captures_without_weights(example_path):
    mf = load_model_file(example_path("llama3_8b"))
    model = mf.build()  # meta device, bf16: no weight memory
    gm = capture(model, *mf.inputs(batch_size=1, seq_len=128))  # CPU inputs are moved to meta
    linears = [n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert len(linears) == 32 * 7 + 1
    logits = linears[-1].meta["val"]
    assert logits.shape == (1, 128, 128256) and logits.dtype == torch.bfloat16
    assert all(n.meta["val"].device.type == "meta" for n in gm.graph.nodes if n.op == "get_attr")


def test_untraceable_model_names_the_line(tmp_path):
    path = tmp_path / "bad_model.py"
    path.write_text(
        textwrap.dedent(
            """\
            import torch

            class Net(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.fc = torch.nn.Linear(4, 4)

                def forward(self, x):
                    if x.sum() > 0:
                        return self.fc(x)
                    return x

            def build_model():
                return Net()

            def example_inputs():
                return (torch.ones(2, 4),)
            """
        )
    )
    mf = load_model_file(path)
    with pytest.raises(InputError) as info:
        capture(mf.build(), *mf.inputs())
    message = str(info.value)
    assert f"{path}:9" in message and "if x.sum() > 0:" in message
    assert "aten.item: data-dependent" in message and "use_cache=False" in message


def test_inputs_that_do_not_fit_name_the_op_without_torch_logs(capfd):
    """A library model (nn.Sequential) fed inputs of the wrong width: the message names the matmul and
    says the inputs do not fit, and torch's own fake-tensor traceback is not printed."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.GELU())
    with pytest.raises(InputError) as err:
        capture(model, (torch.randn(2, 8, 32),), {})
    text = str(err.value)
    assert "aten.mm" in text and "example inputs do not fit" in text and "container.py" not in text
    assert "Traceback" not in capfd.readouterr().err


class _Float32Table(torch.nn.Module):
    """Activations in bf16 times a float32 table the model's code does not cast (RoPE's cos / sin)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, dtype=torch.bfloat16)
        self.register_buffer("table", torch.randn(1, 8, 8))  # float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, 8) bf16
        return torch.bmm(self.table.expand(x.shape[0], 8, 8), self.proj(x).transpose(1, 2))


def test_dtypes_the_models_code_mixes_are_named_as_the_models_not_the_captures():
    """A model whose own code mixes bf16 activations with a float32 table fails so eagerly too: the
    message says two dtypes meet at its line and how to cast, not the control-flow fixes of a capture
    problem; a model that fails eagerly the same way is checked here."""
    model, x = _Float32Table(), torch.randn(2, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        model(x)  # the model itself fails in bf16
    with pytest.raises(InputError) as err:
        capture(model, (x,), {})
    text = str(err.value)
    assert "Tensors of two dtypes meet" in text and ".to(x.dtype)" in text and "Usual fixes" not in text, text
    assert "test_capture.py" in text  # the model's line


class _OnDefaultDevice(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x + torch.ones(x.shape[1], 8))  # made on the default device, not x's


def test_a_tensor_made_on_another_device_in_forward_names_the_fix():
    """A tensor made in forward on the default device meets the meta model: the message says to make it
    on the inputs' device (it listed the control-flow fixes, which do not apply)."""
    with torch.device("meta"):
        model = _OnDefaultDevice()
    with pytest.raises(InputError, match=r"device=x.device") as err:
        capture(model, (torch.randn(2, 4, 8),), {})
    assert "control flow" not in str(err.value)


def test_model_output_flattened_logits_first(captured):
    c = captured("hf_llama")
    kwargs = dict(c.kwargs, labels=c.args[0])  # CausalLMOutputWithPast(loss, logits)
    gm = capture(c.model, c.args, kwargs)
    logits, loss = gm(*flat_inputs(c.args, kwargs))
    expected = c.model(*c.args, **kwargs)
    torch.testing.assert_close(logits, expected.logits)
    torch.testing.assert_close(loss, expected.loss)


def test_hf_cache_output_is_an_input_error(captured):
    c = captured("hf_llama")
    with pytest.raises(InputError, match="DynamicCache") as info:
        capture(c.model, c.args, {"use_cache": True})
    assert "use_cache=False" in str(info.value)


def test_an_output_type_export_cannot_flatten_names_the_models_forward(tmp_path):
    """A forward returning a dataclass: torch.export's error leaves no frame of the model's code, so the
    message said "line: unknown line" and cut torch's text mid-word; it names the model's forward and
    cuts at a word."""
    import dataclasses  # noqa: PLC0415

    @dataclasses.dataclass
    class Out:
        y: torch.Tensor

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> Out:
            return Out(self.lin(x))

    with pytest.raises(InputError) as info:
        capture(Model(), (torch.randn(2, 4),))
    message = str(info.value)
    assert f"forward at {__file__}:" in message, message
    error_line = next(line for line in message.splitlines() if line.strip().startswith("error:"))
    assert len(error_line) < 330 and (error_line.endswith(" ...") or "..." not in error_line), error_line


def test_retarget_device(captured):
    gm = captured("gpt2_tiny").gm
    aranges = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.arange.start)
    assert aranges and aranges[0].kwargs["device"] == torch.device("cpu")
    moved = retarget_device(torch.fx.GraphModule(gm, gm.graph.__deepcopy__()), "meta")
    arange = moved.graph.find_nodes(op="call_function", target=torch.ops.aten.arange.start)[0]
    assert arange.kwargs["device"] == torch.device("meta")
    assert aranges[0].kwargs["device"] == torch.device("cpu")  # the original is untouched


@pytest.mark.slow
def test_gpt2_124m_runs_on_cpu(example_path):
    mf = load_model_file(example_path("gpt2"))
    model = mf.build()
    args, kwargs = mf.inputs()  # batch 1, 64 tokens
    gm = capture(model, args, kwargs)
    with torch.no_grad():
        torch.testing.assert_close(gm(*flat_inputs(args, kwargs)), model(*args), rtol=1e-4, atol=1e-4)


def test_products_with_a_transposed_weight_are_captured_as_linear() -> None:
    """`x @ W.T` (Falcon's FalconLinear), `matmul(x, W.t())` and `addmm(b, x, W.t())` are what
    nn.Linear computes: the capture writes them as aten.linear (so the tensor-parallel pass splits
    them; tests/test_tp_parity.py runs the model at tp 2) and the graph still computes the model."""
    from pathlib import Path

    from planner.frontend.capture import op_name

    model_file = load_model_file(Path(__file__).parent / "models" / "transposed_weights.py")
    args, kwargs = model_file.inputs()
    model = model_file.build("cpu")
    gm = capture(model, args, kwargs)
    names = [op_name(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert names.count("aten.linear") == 9  # qkv, o, up, down per layer, and the head
    assert not {"aten.matmul", "aten.mm", "aten.addmm", "aten.numpy_T", "aten.t"} & set(names)
    torch.testing.assert_close(gm(*flat_inputs(args, kwargs)), flatten_output(model(*args, **kwargs)))


def test_a_failure_inside_a_library_the_model_calls_names_its_line_too(tmp_path):
    """The model's own line is the call into a library (a Hugging Face modeling file); the message
    names the library's line as well ("within:"), and the op the error names (aten.item), not the
    op captured before it."""
    (tmp_path / "helper_lib.py").write_text(
        textwrap.dedent(
            """\
            import torch

            def positions(x):
                start = int(x[0, 0].long())
                return torch.arange(start, start + x.shape[1])
            """
        )
    )
    path = tmp_path / "calls_lib.py"
    path.write_text(
        textwrap.dedent(
            """\
            import torch
            from helper_lib import positions

            class Net(torch.nn.Module):
                def forward(self, x):
                    return x.float().cumsum(-1) + positions(x)

            def build_model():
                return Net()

            def example_inputs():
                return (torch.ones(2, 4, dtype=torch.long),)
            """
        )
    )
    mf = load_model_file(path)
    with pytest.raises(InputError) as info:
        capture(mf.build(), *mf.inputs())
    message = str(info.value)
    assert f"{path}:6" in message and "within: helper_lib.py:4: start = int(x[0, 0].long())" in message
    assert "aten.item: data-dependent" in message, message


def test_attributes_kept_without_gradient_are_said_for_training_only(tmp_path, monkeypatch):
    """torch.export keeps a tensor attribute that requires grad (not a parameter) as a constant: said when
    planning a training step (it will not train), not for a workload that trains nothing (every static-cache
    model of transformers has such attributes in its export wrapper: the advice did not apply)."""
    import warnings  # noqa: PLC0415

    from planner.cli import workflow  # noqa: PLC0415
    from planner.frontend import capture as capture_module  # noqa: PLC0415

    path = tmp_path / "lifted.py"
    path.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(8, 8)\n"
        "        self.scale = torch.ones(8, requires_grad=True)\n"
        "    def forward(self, x):\n"
        "        return self.lin(x) * self.scale\n"
        "def build_model():\n"
        "    return M()\n"
        "def example_inputs(batch_size=2, seq_len=4):\n"
        "    return (torch.randn(batch_size, seq_len, 8),)\n"
    )
    monkeypatch.delenv("RANK", raising=False)
    for workload, said in (("forward", False), ("train", True)):
        monkeypatch.setattr(capture_module, "_lifted_said", False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            workflow.prepare(str(path), workload)
        assert any("torch.export keeps" in str(w.message) for w in caught) == said, workload


def test_hf_models_are_captured_with_sdpas_causal_flag_not_a_traced_mask(example_path):
    """Under torch.export transformers builds an explicit (T, T) mask it skips in eager mode (O(T^2)
    memory in every run, no flash kernel, and context parallelism checked the mask only up to 8k
    tokens): the capture lets it take its eager path, SDPA with is_causal. A wrapper that may hand the
    model position ids of its own (packed documents) keeps transformers' traced mask."""
    from torch import nn  # noqa: PLC0415

    mf = load_model_file(example_path("hf_llama"))
    args, kwargs = mf.inputs(2, 32)

    def sdpa_args(gm):
        return [n.args[3:] for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]

    direct = sdpa_args(capture(mf.build("meta"), args, kwargs))
    assert direct and all(a[0] is None and a[2] is True for a in direct), direct

    class Wrapper(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(ids, use_cache=False).logits

    wrapped = sdpa_args(capture(Wrapper(mf.build("meta")), args, {}))
    assert wrapped and all(isinstance(a[0], torch.fx.Node) for a in wrapped), wrapped


class _CachesOnFirstCall(torch.nn.Module):
    """A forward that caches a tensor as a plain attribute the first time it runs (as Hugging Face's
    LongRoPE caches `long_inv_freq`) and uses the cache from then on."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.kept = torch.ones(4)  # a plain tensor attribute the model had before

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cached = getattr(self, "cached", None)
        if cached is None:
            cached = torch.arange(4.0, device=x.device)
            self.cached = cached
        self.kept = self.kept * 1.0  # replaced in every forward
        return self.proj(x) * cached + self.kept


def test_capture_leaves_no_traced_tensor_on_the_model() -> None:
    """torch.export traces the forward on fake tensors: an attribute the forward caches would stay on the
    user's model as a FakeTensor (LongRoPE's `long_inv_freq`: the eager Phi-3 then computed other
    values than its graph). After capture the model holds the attributes it held before, real ones."""
    import warnings  # noqa: PLC0415

    model = _CachesOnFirstCall()
    kept = model.kept
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        gm = capture(model, (x,), {})
    assert "cached" not in vars(model) and model.kept is kept
    # torch's advice to register them as buffers is not the user's to follow: the capture set them back
    assert not [w for w in said if "assigned during export" in str(w.message)]
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


def test_a_longrope_phi3_captures_what_it_computes() -> None:
    """Phi-3 with LongRoPE (the 128k models' `rope_scaling`), past its original context: the captured
    graph and the eager model agree (`runtime.reference.check_capture`), before and after a capture."""
    transformers = pytest.importorskip("transformers")
    from runtime.reference import check_capture  # noqa: PLC0415

    config = transformers.Phi3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=16,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).eval()
    tokens = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(0))
    gm = capture(model, (tokens,), {"use_cache": False})
    check_capture(model, gm, (tokens,), {"use_cache": False}, "fp32")


def test_retarget_device_reaches_the_recomputed_regions():
    """Full recomputation fuses each layer's nodes into a region (`passes.recompute`), its mask's
    factory ops among them (tests/models/manual_attention.py: torch.ones(..., device=x.device) in every
    layer). A graph captured on the meta device and run on the CPU had those left on meta (a T5 with
    --recompute full: "Tensor on device cpu is not on the expected device meta!")."""
    from passes.recompute import apply_recompute  # noqa: PLC0415
    from planner.frontend.analysis import analyse  # noqa: PLC0415
    from planner.plan import Recompute  # noqa: PLC0415

    mf = load_model_file(Path(__file__).parent / "models" / "manual_attention.py")
    args, kwargs = mf.inputs()
    gm = capture(mf.build("meta"), args, kwargs)
    assert apply_recompute(gm, analyse(gm), {"*": Recompute.FULL})
    retarget_device(gm, "cpu")
    devices = [
        value
        for module in gm.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        for value in (*node.args, *node.kwargs.values())
        if isinstance(value, torch.device)
    ]
    assert devices and all(d == torch.device("cpu") for d in devices)
    inner = [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule) and m is not gm]
    assert inner and "device(type='cpu')" in inner[0].code and "meta" not in inner[0].code

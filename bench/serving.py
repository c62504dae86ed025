"""Serving benchmarks: decode with a real KV cache, predicted beside measured.

    python bench/serving.py                 # (c) and (d): predictions vs published serving measurements
    python bench/serving.py --only llm-inference-bench   # (d) only (--only published: (c) only)
    python bench/serving.py --run           # also (a) ladder vs standard at TP=2 and (b) predicted vs
                                            # measured ms/token, on local gloo ranks

(a) Llama-3 tiny with a static cache (examples/llama3_kv.py), TP=2, ladder on the upper 2 layers: the run
    times the laddered and the standard rewrite of the same splits side by side (interleaved requests),
    so the measured speed-up is a ratio from one run; beside it the predicted speed-up.
(b) predicted vs measured time per output token for the tiny Llama (two cache lengths) and the Hugging
    Face static-cache wrapper, priced with this machine's calibrated spec (as `planner optimize --run`
    without --cluster), and for the tiny Llama and the 2-KV-head model at TP=4 with the midlink spec,
    which splits them.
(c) decode predictions against published serving measurements (bf16/fp16 only: the planner has no fp8),
    priced with the planner's own API (`workflow.prepare` / `make_plan`, generate workload) and compared
    like for like: a source's tokens/s over whole requests with batch x N / (TTFT + (N-1) x TPOT), its
    end-to-end latency with TTFT + (N-1) x TPOT, gpt-fast's tokens/s per sequence with the same over one
    sequence. Sources (figures and configurations in bench/README.md, "Published serving figures"):
      - gpt-fast README (batch 1, Llama-3.1 8B/70B, 8xA100-80GB at 330 W, bf16, 5-token prompt, 200 new
        tokens; static cache, GQA heads repeated as gpt-fast does: examples/llama3_*_kv.py);
      - LMDeploy v0.1.0a1 docs/en/benchmark/a100_fp16.md (static inference, A100-80G, fp16, Llama-2 7B TP1
        and 70B TP4, batch 1/16/32/64, 1-token prompt, 128 new tokens);
      - TensorRT-LLM release/0.5.0 docs/source/performance.md (A100 FP16 table, static batching,
        Llama-2 7B TP1 and 70B TP4, batch 16/32/64, 128 or 2048 in and out);
      - vLLM's performance-benchmark build 9515 (latency tests: H200, batch 8, 32-token prompt, 128 new
        tokens, mean end-to-end latency; Llama-3.1-8B TP1, Llama-3-70B TP4, checkpoint dtype bf16);
      - the NeMo framework's Llama-2 inference table (TensorRT-LLM underneath; A100 80GB, Llama-2-7B at
        TP 1/2/4/8 and batch 1/2/4/8, 128-token prompt, 20 new tokens, average latency of a batch).
    The engines' attention reads only the filled part of the cache, once per KV head (paged / fused GQA
    kernels); the static-cache model attends over all it allocates, so engine rows plan Llama-2 examples
    with fused GQA (examples/llama2_*_kv.py) and a cache of P + N/2 tokens, the mean filled length
    (a step's attention time is linear in it, so this prices the mean step). Batch 4 figures: the NeMo
    rows.
    Every published row is also held against a floor no engine can beat: each of its N tokens reads
    every weight once at the GPU's datasheet HBM bandwidth. A source with a row below it did not run
    the request it states (NeMo's Llama-2-13B rows, checked but not priced), and the medians are
    printed a second time without it.
(d) LLM-Inference-Bench (argonne-lcf, Plots/All_results.csv at commit 4211f5d, rows in
    bench/data/llm_inference_bench_h100.csv): vLLM and TensorRT-LLM on H100, fp16, Llama-2-7B/70B and
    Llama-3-8B/70B at TP 1/2/4, batch 1/16/32/64, prompt = new tokens = L (128-2048); its throughput is
    batch x 2L / latency (prompt tokens counted), its latency one whole batch. Each row is planned as a
    user would (dgx-h100, generate workload, --tp and --devices the row's TP, fp16) and priced like the
    engine rows of (c): a cache of L + L/2 tokens, request time TTFT + (L-1) x TPOT. A row whose whole
    request (cache 2L) does not fit the planner's memory is shown refused with the planner's reason.
    The Llama-3-8B rows are priced a second time with fused GQA (bench/llama3_8b_kv_fused.py), as the
    engines attend; examples/llama3_8b_kv.py repeats the KV heads as gpt-fast does. Each engine is
    priced with what its version runs, given as a user gives it in the cluster YAML: TensorRT-LLM 0.11's
    decode attention kernel and host work per step (`trt_llm_profile`, two rows), vLLM 0.5's host work
    per step, per sequence and per TP worker (`vllm_serving_host`, three rows); every other row is held
    out, and each row's error is printed a second time without the host work. As in (c), a last set of
    medians adds each configuration's batch-1 residual (the engine's own cost per request) to its
    batch 16 / 32 / 64 predictions (`engine_step_cost`).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from costmodels.cluster import DecodeAttentionSpec, ServingHostSpec  # noqa: E402
from planner.cli import workflow  # noqa: E402
from planner.errors import InfeasibleError  # noqa: E402
from planner.solver.problem import Constraints  # noqa: E402

MIDLINK = str(ROOT / "tests" / "models" / "midlink-cpu.yaml")
GPT_FAST = "https://github.com/meta-pytorch/gpt-fast#benchmarks"
LMDEPLOY = (
    "https://github.com/InternLM/lmdeploy/blob/3e391df4673326f79363eebe030876861a9b7090/"
    "docs/en/benchmark/a100_fp16.md"
)
TRT_LLM = "https://github.com/NVIDIA/TensorRT-LLM/blob/release/0.5.0/docs/source/performance.md"
VLLM = "https://buildkite.com/vllm/performance-benchmark/builds/9515"
NEMO = "https://docs.nvidia.com/nemo-framework/user-guide/latest/performance/llama.html"


@dataclass(frozen=True)
class Published:
    """One published measurement: `value` in `metric` ("tok/s": output tokens/s of the batch over whole
    requests; "tok/s/seq": per sequence; "ms": mean end-to-end latency of the batch) for `batch`
    sequences of a `prompt`-token prompt and `new` generated tokens on `cluster` at tensor parallel `tp`.
    `paged`: the engine attends over the filled cache only (priced with a cache of prompt + new / 2)."""

    source: str
    url: str
    model: str  # examples/<model>.py
    label: str
    cluster: str
    tp: int
    batch: int
    prompt: int
    new: int
    dtype: str
    metric: str
    value: float
    paged: bool = True
    # the engine's decode attention kernel (`ClusterSpec.attention_kernel`): "per_query_head" for the
    # 2023 masked multi-head attention kernels that load a KV head once per query head using it
    attention_kernel: str = "fused"


def _lmdeploy(model: str, label: str, tp: int, batch: int, tok_s: float) -> Published:
    return Published("LMDeploy v0.1.0a1", LMDEPLOY, model, label, "dgx-a100", tp, batch, 1, 128, "fp16",
                     "tok/s", tok_s)  # fmt: skip


def _trt(model: str, label: str, tp: int, batch: int, prompt: int, new: int, tok_s: float) -> Published:
    # 0.5.0 predates the XQA grouped-query decode kernel (added in 0.7): its masked MHA kernel reads
    # each KV head once per query head
    return Published("TensorRT-LLM 0.5.0", TRT_LLM, model, label, "dgx-a100", tp, batch, prompt, new, "fp16",
                     "tok/s", tok_s, attention_kernel="per_query_head")  # fmt: skip


def _nemo(
    tp: int, batch: int, ms: float, model: str = "llama2_7b_kv", label: str = "Llama-2-7B"
) -> Published:
    return Published("NeMo (TensorRT-LLM)", NEMO, model, label, "dgx-a100", tp, batch, 128, 20, "fp16", "ms",
                     ms)  # fmt: skip


def _gpt_fast(model: str, label: str, tp: int, tok_s: float) -> Published:
    return Published("gpt-fast", GPT_FAST, model, label, "dgx-a100", tp, 1, 5, 200, "bf16", "tok/s/seq",
                     tok_s, paged=False)  # fmt: skip


PUBLISHED = [
    # gpt-fast README, 8xA100-80GB at 330 W, torch.compile, custom all-reduce (published.md)
    _gpt_fast("llama3_8b_kv", "Llama-3.1-8B", 2, 149.10),
    _gpt_fast("llama3_8b_kv", "Llama-3.1-8B", 4, 217.21),
    _gpt_fast("llama3_8b_kv", "Llama-3.1-8B", 8, 276.01),
    _gpt_fast("llama3_70b_kv", "Llama-3.1-70B", 2, 16.03),
    _gpt_fast("llama3_70b_kv", "Llama-3.1-70B", 4, 37.45),
    _gpt_fast("llama3_70b_kv", "Llama-3.1-70B", 8, 58.78),
    # LMDeploy static inference benchmark, A100-80G x8, fp16, prompt 1, 128 new tokens, out tok/s
    _lmdeploy("llama2_7b_kv", "Llama-2-7B", 1, 1, 100.02),
    _lmdeploy("llama2_7b_kv", "Llama-2-7B", 1, 16, 1504.72),
    _lmdeploy("llama2_7b_kv", "Llama-2-7B", 1, 32, 2136.73),
    _lmdeploy("llama2_7b_kv", "Llama-2-7B", 1, 64, 4154.81),
    _lmdeploy("llama2_70b_kv", "Llama-2-70B", 4, 1, 33.94),
    _lmdeploy("llama2_70b_kv", "Llama-2-70B", 4, 16, 468.52),
    _lmdeploy("llama2_70b_kv", "Llama-2-70B", 4, 32, 906.03),
    _lmdeploy("llama2_70b_kv", "Llama-2-70B", 4, 64, 1425.79),
    # TensorRT-LLM v0.5.0 "A100 GPUs (FP16)" high-throughput table (static batching), out tok/s
    _trt("llama2_7b_kv", "Llama-2-7B", 1, 64, 128, 128, 3486),
    _trt("llama2_7b_kv", "Llama-2-7B", 1, 32, 128, 2048, 1459),
    _trt("llama2_7b_kv", "Llama-2-7B", 1, 32, 2048, 128, 529),
    _trt("llama2_7b_kv", "Llama-2-7B", 1, 16, 2048, 2048, 592),
    _trt("llama2_70b_kv", "Llama-2-70B", 4, 64, 128, 128, 1237),
    _trt("llama2_70b_kv", "Llama-2-70B", 4, 64, 128, 2048, 1181),
    _trt("llama2_70b_kv", "Llama-2-70B", 4, 64, 2048, 128, 272),
    _trt("llama2_70b_kv", "Llama-2-70B", 4, 64, 2048, 2048, 738),
    # NeMo framework docs, "Llama-2 Results", inference, chatbot use case (128 in, 20 out), A100 80GB
    # SXM4 (16-bit: the A100 has no fp8), average latency of a batch in ms, TP 1/2/4/8, batch 1-8
    *(
        _nemo(tp, batch, ms)
        for tp, row in (
            (1, (234.0, 249.6, 272.6, 329.5)),
            (2, (171.7, 180.3, 202.9, 237.6)),
            (4, (143.7, 149.9, 165.2, 196.4)),
            (8, (136.5, 143.3, 158.6, 181.9)),
        )
        for batch, ms in zip((1, 2, 4, 8), row)
    ),
    # vLLM nightly latency tests (benchmark_latency, load_format dummy), mean end-to-end latency
    Published(
        "vLLM (build 9515)",
        VLLM,
        "llama3_8b_kv",
        "Llama-3.1-8B",
        "dgx-h200",
        1,
        8,
        32,
        128,
        "bf16",
        "ms",
        833.421,
    ),  # fmt: skip
    Published(
        "vLLM (build 9515)",
        VLLM,
        "llama3_70b_kv",
        "Llama-3-70B",
        "dgx-h200",
        4,
        8,
        32,
        128,
        "bf16",
        "ms",
        2077.53,
    ),  # fmt: skip
]


# NeMo's same table, Llama-2-13B (A100 80GB SXM4 column, 128 in / 20 out, average latency of a batch in
# ms): not priced here (no 13B example is compared), only held against the bandwidth floor below, which
# five of these rows break
NEMO_13B_CHECKS = [
    _nemo(tp, batch, ms, "llama2-13b", "Llama-2-13B")
    for tp, row in ((1, (142.5, 163.3, 198.5, 282.6)), (2, (100.4, 112.2, 320.0, 188.6)))
    for batch, ms in zip((1, 2, 4, 8), row)
]

# examples/<model>.py -> its shapes in `models.LLAMA_CONFIGS`
_CONFIG_OF = {"llama2_7b_kv": "llama2-7b", "llama2_70b_kv": "llama2-70b", "llama3_8b_kv": "8b",
              "llama3_70b_kv": "70b"}  # fmt: skip


@functools.cache
def _llama_configs() -> dict:
    """`LLAMA_CONFIGS` of examples/models.py, loaded by path once (examples/ is not a package, and a
    `models` already imported may be another one)."""
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location("_bench_example_models", ROOT / "examples" / "models.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.LLAMA_CONFIGS


def weight_bytes_read_per_token(config_name: str, dtype: str, tp: int) -> float:
    """Bytes of weights one device must read from HBM to produce one token of a batch, in bytes: every
    layer's projection weights and the output head, split over ``tp`` devices; the input embedding is
    left out (a lookup reads only its rows), norms are negligible. `models.LLAMA_CONFIGS` shapes."""
    c = _llama_configs()[config_name]
    head_dim = c.dim // c.n_heads
    attention = c.dim * (c.dim + 2 * c.n_kv_heads * head_dim) + c.dim * c.dim
    mlp = 3 * c.dim * c.ffn_dim
    params = c.n_layers * (attention + mlp) + c.vocab_size * c.dim
    return params * {"fp16": 2, "bf16": 2, "fp32": 4}[dtype] / tp


def floor_s(row: Published) -> float:
    """The least time a request of `row` can take, in seconds: each of its N tokens (the prefill's and
    N - 1 decode steps) reads every weight once at the GPU's datasheet memory bandwidth (the preset's
    `memory_bandwidth_GBps`, no efficiency factor). A published time below it did not run the request
    the source states (fewer tokens generated, or other weights than the stated dtype's)."""
    config = _CONFIG_OF.get(row.model, row.model)
    bandwidth = workflow.resolve_cluster(row.cluster, row.tp).device.memory_bandwidth_bytes_per_s
    return row.new * weight_bytes_read_per_token(config, row.dtype, row.tp) / bandwidth


def plan(model: str, cluster: str | None, tp: int, ladder: str = "none", workload: str = "decode",
         attention_kernel: str = "fused", decode_kernel: DecodeAttentionSpec | None = None,
         serving_host: ServingHostSpec | None = None, **kw):  # fmt: skip
    """The plan of `model` on `cluster` (None: this machine's calibrated spec) at TP=`tp`."""
    return planned(model, cluster, tp, ladder, workload, attention_kernel, decode_kernel, serving_host, **kw)[
        0
    ]


def planned(model: str, cluster: str | None, tp: int, ladder: str = "none", workload: str = "decode",
            attention_kernel: str = "fused", decode_kernel: DecodeAttentionSpec | None = None,
            serving_host: ServingHostSpec | None = None, **kw):  # fmt: skip
    """(plan, the prepared model, the spec it was priced with). `decode_kernel`: the engine's decode
    attention kernel of one block per (sequence, query head) in place of the preset's
    (`DeviceSpec.decode_attention`; None: the preset's); `serving_host`: the engine's host work per
    step (`DeviceSpec.serving_host`; None: the preset's, none)."""
    prepared = workflow.prepare(str(ROOT / model), workload, **kw)
    spec = workflow.resolve_cluster(cluster, tp)
    if attention_kernel != spec.attention_kernel:
        spec = dataclasses.replace(spec, attention_kernel=attention_kernel)
    if decode_kernel is not None:
        spec = dataclasses.replace(
            spec, device=dataclasses.replace(spec.device, decode_attention=decode_kernel)
        )
    if serving_host is not None:
        spec = dataclasses.replace(spec, device=dataclasses.replace(spec.device, serving_host=serving_host))
    constraints = workflow.constraints_from(tp, 1, 1, ladder, max_devices=tp)
    return workflow.make_plan(prepared, spec, constraints, model), prepared, spec


def request_s(row: Published) -> float:
    """The planner's time for one request (batch) of `row`, in seconds: TTFT + (N - 1) x TPOT from a
    generate plan of the row's prompt; a paged engine's row plans a cache of P + N/2 tokens (generate
    with N/2 new tokens), the mean filled length, and counts all N tokens."""
    planned_new = max(1, row.new // 2) if row.paged else row.new
    p = plan(f"examples/{row.model}.py", row.cluster, row.tp, workload="generate", seq_len=row.prompt,
             new_tokens=planned_new, batch_size=row.batch, dtype=row.dtype,
             attention_kernel=row.attention_kernel)  # fmt: skip
    return p.serving.ttft_s + (row.new - 1) * p.serving.tpot_s


def in_metric(row: Published, seconds: float) -> float:
    """A request time of `row` in the row's metric."""
    if row.metric == "ms":
        return seconds * 1e3
    if row.metric == "tok/s/seq":
        return row.new / seconds
    return row.batch * row.new / seconds


def published_request_s(row: Published) -> float:
    """The published figure of `row` as the time of one request (batch), in seconds."""
    if row.metric == "ms":
        return row.value / 1e3
    if row.metric == "tok/s/seq":
        return row.new / row.value
    return row.batch * row.new / row.value


def speed_error(row: Published, predicted: float) -> float:
    """+ when the prediction (in the row's metric) is faster than published."""
    return row.value / predicted - 1 if row.metric == "ms" else predicted / row.value - 1


def _config(row: Published) -> tuple:
    return (row.source, row.model, row.cluster, row.tp, row.prompt, row.new, row.dtype)


def published(console: Console) -> list[tuple[Published, float]]:
    """Part (c): every published row beside its prediction; the median |error| per batch size.

    Second column of errors, "engine step cost from batch 1": where the same source publishes the
    same configuration at batch 1, the batch-1 residual (published minus predicted request time: the
    engine's per-step host and framework cost, which the device model does not see) is added to the
    larger batches' predictions. The batch-1 rows then match by construction, so the per-batch medians
    of that column are taken over batch > 1 only: they test how the cost model scales with the batch."""
    table = Table(title="(c) decode: published serving measurements vs predicted (planner presets)")
    for col in ("source", "model", "GPU", "TP", "batch", "prompt/out", "dtype", "metric", "published",
                "predicted", "speed error", "+ batch-1 step cost", "error"):  # fmt: skip
        table.add_column(col, justify="right")
    predicted = {row: request_s(row) for row in PUBLISHED}
    residual = {
        _config(row): published_request_s(row) - predicted[row] for row in PUBLISHED if row.batch == 1
    }
    results, by_batch, calibrated_by_batch = [], {}, {}
    for row in PUBLISHED:
        pred = in_metric(row, predicted[row])
        err = speed_error(row, pred)
        results.append((row, pred))
        by_batch.setdefault(row.batch, []).append(abs(err))
        cal_text = err_text = "-"
        if row.batch > 1 and _config(row) in residual:
            cal = in_metric(row, predicted[row] + residual[_config(row)])
            cal_err = speed_error(row, cal)
            calibrated_by_batch.setdefault(row.batch, []).append(abs(cal_err))
            cal_text, err_text = f"{cal:.2f}", f"{cal_err:+.0%}"
        kernel = "" if row.attention_kernel == "fused" else f" ({row.attention_kernel})"
        table.add_row(row.source, row.label + kernel, row.cluster, str(row.tp), str(row.batch),
                      f"{row.prompt}/{row.new}", row.dtype, row.metric, f"{row.value:.2f}", f"{pred:.2f}",
                      f"{err:+.0%}", cal_text, err_text)  # fmt: skip
    console.print(table)
    for batch in sorted(by_batch):
        errors = by_batch[batch]
        line = f"batch {batch:>2}: median |error| {statistics.median(errors):.0%} over {len(errors)} rows"
        if batch in calibrated_by_batch:
            cal = calibrated_by_batch[batch]
            line += (
                f"; with the batch-1 step cost {statistics.median(cal):.0%} over the {len(cal)} rows "
                "that have a batch-1 sibling"
            )
        console.print(line)
    below = below_floor(console)
    console.print(
        "Without the sources that publish a row below the bandwidth floor ("
        + (", ".join(sorted(below)) or "none")
        + "):"
    )
    kept: dict[int, list[float]] = {}
    for row, pred in results:
        if row.source not in below:
            kept.setdefault(row.batch, []).append(abs(speed_error(row, pred)))
    for batch in sorted(by_batch):
        errors = kept.get(batch)
        text = f"{statistics.median(errors):.0%} over {len(errors)} rows" if errors else "no row"
        console.print(f"batch {batch:>2}: median |error| {text}")
    return results


def below_floor(console: Console) -> set[str]:
    """Every published row (compared or check-only) against `floor_s`; prints those below it and
    returns their sources: a source whose table holds a request faster than the weights can be read
    did not measure the requests it states, for those rows at least, so its rows cannot test a cost
    model's prediction of those requests."""
    table = Table(title="published requests faster than their weights can be read (HBM datasheet bandwidth)")
    for col in ("source", "model", "TP", "batch", "prompt/out", "published", "floor", "published / floor"):
        table.add_column(col, justify="right")
    sources = set()
    for row in [*PUBLISHED, *NEMO_13B_CHECKS]:
        floor = floor_s(row)
        seconds = published_request_s(row)
        if seconds < floor:
            sources.add(row.source)
            table.add_row(row.source, row.label, str(row.tp), str(row.batch), f"{row.prompt}/{row.new}",
                          f"{row.value:.1f} {row.metric}", f"{in_metric(row, floor):.1f} {row.metric}",
                          f"{seconds / floor:.2f}")  # fmt: skip
    console.print(table)
    return sources


# (d) LLM-Inference-Bench: the rows, unchanged, with their source in the file's header comment
LLM_INFERENCE_BENCH = ROOT / "bench" / "data" / "llm_inference_bench_h100.csv"
LLM_INFERENCE_BENCH_URL = (
    "https://github.com/argonne-lcf/LLM-Inference-Bench/blob/4211f5d4e9bc0145ed541b6d372d5d8223b44235/"
    "Plots/All_results.csv"
)
# the CSV's Model -> (examples/<file>.py, label, `models.LLAMA_CONFIGS` name)
_LIB_MODELS = {
    "meta-llama/Llama-2-7b-hf": ("llama2_7b_kv", "Llama-2-7B", "llama2-7b"),
    "meta-llama/Llama-2-70b-hf": ("llama2_70b_kv", "Llama-2-70B", "llama2-70b"),
    "meta-llama/Meta-Llama-3-8B": ("llama3_8b_kv", "Llama-3-8B", "8b"),
    "meta-llama/Meta-Llama-3-70B": ("llama3_70b_kv", "Llama-3-70B", "70b"),
}
_LIB_HARDWARE = {"Nvidia H100 GPU": ("H100", "dgx-h100"), "Nvidia A100 GPU": ("A100", "dgx-a100")}
# the engines' attention (fused GQA) for the one example that repeats KV heads (gpt-fast's form)
_FUSED_VARIANT = {"llama3_8b_kv": "bench/llama3_8b_kv_fused.py"}


@dataclass(frozen=True)
class EngineRow:
    """One row of LLM-Inference-Bench's All_results.csv: `batch` sequences of an `length`-token prompt
    and `length` generated tokens, served by `framework` on `gpu` at tensor parallel `tp`, fp16;
    `latency_s` the time of the whole batch, `throughput` = batch x 2 x length / latency_s (tok/s,
    prompt tokens included)."""

    framework: str
    model: str  # examples/<model>.py
    label: str
    config: str  # models.LLAMA_CONFIGS name
    gpu: str
    cluster: str
    tp: int
    batch: int
    length: int
    latency_s: float
    throughput: float


def engine_rows(path: Path = LLM_INFERENCE_BENCH) -> list[EngineRow]:
    """The rows of `path` (a header comment, then All_results.csv's own header and rows)."""
    with path.open() as f:
        lines = [line for line in f if not line.startswith("#")]
    rows = []
    for r in csv.DictReader(lines):
        model, label, config = _LIB_MODELS[r["Model"]]
        gpu, cluster = _LIB_HARDWARE[r["Hardware"]]
        rows.append(EngineRow(r["Framework"], model, label, config, gpu, cluster, int(r["Num of Hardware"]),
                              int(r["Batch Size"]), int(r["Input Output Length"]), float(r["Latency"]),
                              float(r["Throughput"])))  # fmt: skip
    return rows


def _kv_cache_bytes_per_device(config_name: str, tp: int, batch: int, positions: int) -> float:
    """K and V caches of `positions` tokens for `batch` sequences on one of `tp` devices, fp16: each
    device holds its KV heads (one when there are fewer KV heads than devices)."""
    c = _llama_configs()[config_name]
    kv_heads = max(1, c.n_kv_heads // tp)
    return 2 * c.n_layers * kv_heads * (c.dim // c.n_heads) * 2 * batch * positions


@functools.cache
def engine_request(
    model: str, config: str, cluster: str, tp: int, batch: int, length: int,
    decode_kernel: DecodeAttentionSpec | None = None, serving_host: ServingHostSpec | None = None,
) -> float | str:  # fmt: skip
    """The planner's time for one batch of an engine row, in seconds, or why it refuses the request.

    Priced as the engine rows of (c) are (`request_s`, paged): planned with `length` / 2 new tokens (a
    cache of the mean filled length), TTFT + (length - 1) x TPOT. The memory of the whole request is
    that plan's peak plus the cache of the other length / 2 positions; when it is over the usable
    memory, the request itself is planned (generate, `length` new tokens) for the planner's own reason.
    `decode_kernel`, `serving_host`: the engine's decode attention kernel and host work per step
    (`planned`; None: the preset's)."""
    kw = dict(workload="generate", seq_len=length, batch_size=batch, dtype="fp16", decode_kernel=decode_kernel,
              serving_host=serving_host)  # fmt: skip
    try:
        p = plan(model if model.startswith("bench/") else f"examples/{model}.py", cluster, tp,
                 new_tokens=max(1, length // 2), **kw)  # fmt: skip
    except InfeasibleError as e:
        return str(e)
    spec = workflow.resolve_cluster(cluster, tp)
    usable = spec.device.memory_bytes * Constraints.memory_fraction
    rest = _kv_cache_bytes_per_device(config, tp, batch, length - max(1, length // 2))
    if p.predicted.peak_memory_bytes + rest > usable:
        try:
            plan(model if model.startswith("bench/") else f"examples/{model}.py", cluster, tp,
                 new_tokens=length, **kw)  # fmt: skip
        except InfeasibleError as e:
            return str(e)
    return p.serving.ttft_s + (length - 1) * p.serving.tpot_s


# TensorRT-LLM 0.11 (LLM-Inference-Bench's TensorRT-LLM/H100/requirements.txt) as its scripts run it:
# trtllm-build without --multi_block_mode and a runner without multi_block_mode, so the decode step's
# masked multi-head attention runs one thread block per (sequence, query head) and never splits the
# cache; at batch 1 a TP rank's 32 / TP blocks use a few of the H100's 132 SMs (NVIDIA H100 datasheet)
TRT_LLM_SMS = 132
# the rows its two free numbers, the block's share of the per-SM bandwidth and the engine's host work
# per step, are fitted to: Llama-2-7B at TP1 and batch 1, the shortest and longest requests (every other
# row is held out)
TRT_LLM_FIT_LENGTHS = (128, 2048)


def _fit_rows(framework: str, model: str, tp: int, batch: int, length: int) -> EngineRow:
    (row,) = [r for r in engine_rows() if (r.framework, r.model, r.tp, r.batch, r.length)
              == (framework, model, tp, batch, length)]  # fmt: skip
    return row


def _predicted_s(row: EngineRow, kernel: DecodeAttentionSpec | None) -> float:
    """A fit row's predicted request time without host work, in seconds (every fit row fits memory)."""
    predicted = engine_request(row.model, row.config, row.cluster, row.tp, row.batch, row.length, kernel)
    assert not isinstance(predicted, str), predicted
    return predicted


def _host_per_step_s(row: EngineRow, kernel: DecodeAttentionSpec | None) -> float:
    """(published - predicted request time without host work) / the request's steps (its prefill and
    L - 1 decode steps), in seconds: the host work per step that would close the row."""
    return (row.latency_s - _predicted_s(row, kernel)) / row.length


@functools.cache
def trt_llm_profile() -> tuple[DecodeAttentionSpec, ServingHostSpec]:
    """TensorRT-LLM 0.11's decode attention (`DeviceSpec.decode_attention`, 132 SMs) and its host work
    per step (`DeviceSpec.serving_host`, a fixed part only), fitted together to Llama-2-7B, TP1, batch 1,
    128/128 and 2048/2048: for a block_share, the step cost that closes the short row; the share at
    which that step cost also closes the long row (a slower block lengthens the long request more), by
    bisection on a log scale."""
    short, long_ = (_fit_rows("TensorRT-LLM", "llama2_7b_kv", 1, 1, n) for n in TRT_LLM_FIT_LENGTHS)

    def long_gap(share: float) -> float:  # predicted / published long request - 1, at the short row's step
        kernel = DecodeAttentionSpec(TRT_LLM_SMS, share)
        step_s = _host_per_step_s(short, kernel)
        return (_predicted_s(long_, kernel) + step_s * long_.length) / long_.latency_s - 1

    lo, hi = 0.25, 16.0  # a smaller share: slower blocks, a slower long request
    for _ in range(16):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if long_gap(mid) > 0 else (lo, mid)
    kernel = DecodeAttentionSpec(TRT_LLM_SMS, round((lo * hi) ** 0.5, 3))
    return kernel, ServingHostSpec(round(_host_per_step_s(short, kernel), 6))


# vLLM 0.5 (LLM-Inference-Bench's vLLM/H100 scripts import vllm.inputs.PromptInputs and
# FlexibleArgumentParser, both of the 0.5 line): its host work per step, fitted to three Llama-2-7B
# 128/128 rows (TP1 batch 1, TP1 batch 64: the fixed and per-sequence parts; TP2 batch 1: the part per
# further worker); every other row is held out. vLLM's v0.6.0 performance post (blog.vllm.ai,
# 2024-09-05) measured 0.5.3's scheduling and input preparation at 29% of its time on Llama-3-8B / H100.
VLLM_FIT = (("llama2_7b_kv", 1, 1, 128), ("llama2_7b_kv", 1, 64, 128), ("llama2_7b_kv", 2, 1, 128))


@functools.cache
def vllm_serving_host() -> ServingHostSpec:
    """vLLM 0.5's host work per step (`DeviceSpec.serving_host`) from `VLLM_FIT`, solved exactly: the
    request time is linear in the three numbers (each of a request's L steps pays them)."""
    one, wide, tp2 = (_host_per_step_s(_fit_rows("vLLM", *key), None) for key in VLLM_FIT)
    batch = VLLM_FIT[1][2]
    per_sequence_s = (wide - one) / (batch - 1)
    step_s = one - per_sequence_s
    return ServingHostSpec(round(step_s, 6), round(per_sequence_s, 7), round(tp2 - one, 6))


def _engine_profile(row: EngineRow) -> tuple[DecodeAttentionSpec | None, ServingHostSpec]:
    """The decode attention kernel and host work per step of a row's engine: TensorRT-LLM's
    (`trt_llm_profile`); for vLLM, the preset's kernel (dgx-h100 has none: a cache-splitting kernel, as
    PagedAttention V2 splits the cache into 512-token partitions for the contexts where it matters) and
    `vllm_serving_host`."""
    if row.framework == "TensorRT-LLM":
        return trt_llm_profile()
    return None, vllm_serving_host()


def host_s(row: EngineRow, host: ServingHostSpec) -> float:
    """What `host` adds to a row's request, in seconds: L steps (the prefill and L - 1 decode steps)."""
    return row.length * host.time_s(row.batch, row.tp)


def _refusal(reason: str) -> str:
    """The planner's refusal, short: the memory it needs and has when that is the reason, else its first
    clause."""
    need = re.search(r"needs ([0-9.]+ GiB)", reason)
    usable = re.search(r"([0-9.]+ GiB) usable", reason)
    if need and usable:
        return f"refused: needs {need.group(1)}, {usable.group(1)} usable"
    return "refused: " + reason.split(". ")[0].split("; ")[0][:60]


def engine_floor_s(row: EngineRow) -> float:
    """`floor_s` of an engine row: its `length` tokens each read every weight once at datasheet bandwidth."""
    bandwidth = workflow.resolve_cluster(row.cluster, row.tp).device.memory_bandwidth_bytes_per_s
    return row.length * weight_bytes_read_per_token(row.config, "fp16", row.tp) / bandwidth


def llm_inference_bench(console: Console) -> None:
    """Part (d): LLM-Inference-Bench's vLLM and TensorRT-LLM rows beside the planner's prediction."""
    rows = engine_rows()
    table = Table(
        title="(d) LLM-Inference-Bench (argonne-lcf, Plots/All_results.csv @ 4211f5d): whole requests, fp16, "
        "throughput = batch x (in + out) / latency"
    )
    for col in ("model", "framework", "GPU", "TP", "batch", "in/out", "published tok/s", "predicted tok/s",
                "error", "without host work", "8B fused GQA: tok/s (error)"):  # fmt: skip
        table.add_column(col, justify="right")
    errors: list[tuple[float, EngineRow]] = []
    hostless: list[tuple[float, EngineRow]] = []  # the same rows without the engine's host work
    fused_errors: dict[int, list[float]] = {}
    refused = []
    for row in rows:
        kernel, host = _engine_profile(row)
        seconds = engine_request(
            row.model, row.config, row.cluster, row.tp, row.batch, row.length, kernel, host
        )
        tokens = row.batch * 2 * row.length
        fused_text, hostless_text = "-", "-"
        if row.model in _FUSED_VARIANT:
            fused = engine_request(_FUSED_VARIANT[row.model], row.config, row.cluster, row.tp, row.batch,
                                   row.length, kernel, host)  # fmt: skip
            if isinstance(fused, str):
                fused_text = "refused"
            else:
                err = row.latency_s / fused - 1
                fused_errors.setdefault(row.batch, []).append(err)
                fused_text = f"{tokens / fused:.0f} ({err:+.0%})"
        if isinstance(seconds, str):
            refused.append((row, seconds))
            pred_text, err_text = "-", _refusal(seconds)
        else:
            err = row.latency_s / seconds - 1  # predicted throughput / published - 1
            errors.append((err, row))
            pred_text, err_text = f"{tokens / seconds:.0f}", f"{err:+.0%}"
            hostless.append((row.latency_s / (seconds - host_s(row, host)) - 1, row))
            hostless_text = f"{hostless[-1][0]:+.0%}"
        table.add_row(row.label, row.framework, row.gpu, str(row.tp), str(row.batch), f"{row.length}/{row.length}",
                      f"{row.throughput:.0f}", pred_text, err_text, hostless_text, fused_text)  # fmt: skip
    console.print(table)
    console.print(
        f"Source: {LLM_INFERENCE_BENCH_URL}; error = predicted / published throughput - 1 (+: faster)"
    )
    trt, trt_host = trt_llm_profile()
    vllm_host = vllm_serving_host()
    console.print(
        f"TensorRT-LLM 0.11 rows: decode attention of one block per (sequence, query head), {trt.sms} SMs, "
        f"block_share {trt.block_share:g} (a block streams {trt.block_share:g}x the per-SM share of the "
        f"bandwidth), and host work of {trt_host.step_s * 1e6:.0f} us per step, both fitted to Llama-2-7B TP1 "
        f"batch 1 {TRT_LLM_FIT_LENGTHS[0]}/{TRT_LLM_FIT_LENGTHS[0]} and {TRT_LLM_FIT_LENGTHS[1]}/"
        f"{TRT_LLM_FIT_LENGTHS[1]}. vLLM 0.5 rows: a cache-splitting kernel (the preset's) and host work per "
        f"step of {vllm_host.step_s * 1e6:.0f} us + {vllm_host.per_sequence_s * 1e6:.1f} us per sequence + "
        f"{vllm_host.per_worker_s * 1e6:.0f} us per further TP worker, fitted to Llama-2-7B 128/128 at TP1 "
        "batch 1, TP1 batch 64 and TP2 batch 1. Every other row is held out."
    )
    _medians(console, errors, refused, "")
    _medians(console, hostless, [], "without the engines' host work: ")
    # the same medians with the Llama-3-8B rows priced with fused GQA, as the engines attend
    fused_by_batch = {
        batch: [abs(e) for e, row in errors if row.batch == batch and row.model not in _FUSED_VARIANT]
        + [abs(e) for e in fused_errors.get(batch, [])]
        for batch in sorted({row.batch for _, row in errors})
    }
    console.print(
        "with the Llama-3-8B rows priced with fused GQA: "
        + "; ".join(f"batch {b} {statistics.median(v):.0%}" for b, v in sorted(fused_by_batch.items()) if v)
        + f"; all {statistics.median([x for v in fused_by_batch.values() for x in v]):.0%}"
    )
    engine_step_cost(console, errors)
    worst_err, worst = max(errors, key=lambda e: abs(e[0]))
    console.print(f"worst row: {worst.label} {worst.framework} {worst.gpu} TP{worst.tp} batch {worst.batch} "
                  f"{worst.length}/{worst.length}: published {worst.throughput:.0f} tok/s, predicted "
                  f"{worst.throughput * (1 + worst_err):.0f} ({worst_err:+.0%})")  # fmt: skip
    for row, reason in refused:
        console.print(f"refused: {row.label} {row.framework} TP{row.tp} batch {row.batch} "
                      f"{row.length}/{row.length}: {reason}")  # fmt: skip
    below = [row for row in rows if row.latency_s < engine_floor_s(row)]
    console.print(
        f"published rows faster than their weights can be read (HBM datasheet bandwidth): {len(below)}"
        + "".join(
            f"\n  {r.label} {r.framework} TP{r.tp} batch {r.batch} {r.length}/{r.length}" for r in below
        )
    )


def _medians(console: Console, errors: list[tuple[float, EngineRow]], refused: list, lead: str) -> None:
    """Median |error| per batch size, over all rows and per engine."""
    by_batch: dict[int, list[float]] = {}
    by_batch_kind: dict[tuple[int, str], list[float]] = {}
    for err, row in errors:
        by_batch.setdefault(row.batch, []).append(abs(err))
        by_batch_kind.setdefault((row.batch, row.framework), []).append(abs(err))
    frameworks = sorted({row.framework for _, row in errors})
    for batch in sorted(by_batch):
        parts = [f"{lead}batch {batch:>2}: median |error| {statistics.median(by_batch[batch]):.0%} over "
                 f"{len(by_batch[batch])} rows"]  # fmt: skip
        parts += [
            f"{fw} {statistics.median(by_batch_kind[batch, fw]):.0%}"
            for fw in frameworks
            if (batch, fw) in by_batch_kind
        ]
        n_refused = sum(1 for row, _ in refused if row.batch == batch)
        if n_refused:
            parts.append(f"{n_refused} refused")
        console.print("; ".join(parts))
    all_errors = [abs(err) for err, _ in errors]
    console.print(f"{lead}all batches: median |error| {statistics.median(all_errors):.0%} over {len(all_errors)} "
                  f"rows ({len(refused)} refused)")  # fmt: skip


def engine_step_cost(console: Console, errors: list[tuple[float, EngineRow]]) -> None:
    """The batch-1 residual as an engine's cost per request (as part (c)'s second column): where the
    same engine, model, TP and length are published at batch 1, published minus predicted request time
    there (host and framework work per step, which the device model does not see; the same number of
    steps at every batch) is added to the prediction at batch 16 / 32 / 64. The medians over those
    rows test how the cost model scales with the batch once the engine's fixed cost is known."""
    predicted = {(r.framework, r.model, r.tp, r.length, r.batch): r.latency_s / (1 + e) for e, r in errors}
    residual = {
        (r.framework, r.model, r.tp, r.length): r.latency_s
        - predicted[(r.framework, r.model, r.tp, r.length, 1)]
        for e, r in errors
        if r.batch == 1
    }
    calibrated: dict[tuple[int, str], list[float]] = {}
    for _, r in errors:
        key = (r.framework, r.model, r.tp, r.length)
        if r.batch == 1 or key not in residual:
            continue
        seconds = predicted[(*key, r.batch)] + residual[key]
        calibrated.setdefault((r.batch, r.framework), []).append(abs(r.latency_s / seconds - 1))
    for batch in sorted({b for b, _ in calibrated}):
        parts = [
            f"{fw} {statistics.median(v):.0%} ({len(v)})"
            for (b, fw), v in sorted(calibrated.items())
            if b == batch
        ]
        console.print(
            f"with the batch-1 engine cost per request, batch {batch:>2}: median |error| " + ", ".join(parts)
        )


def measured(console: Console, iters: int) -> None:
    table = Table(title="(a, b) time per output token: predicted vs measured (local gloo ranks)")
    for col in (
        "config",
        "predicted",
        "measured (p10-p90)",
        "measured / predicted",
        "at the run's speed (probe: per node, matmul slower by)",
        "tokens identical",
        "ladder speed-up pred / meas",
    ):
        table.add_column(col, justify="right")
    # (b) on this machine's calibrated spec (what `planner optimize --run` uses without --cluster): the
    # cost model keeps the tiny models replicated here (gloo's per-call cost exceeds what a split saves),
    # so these rows test the prediction of the plan that runs; (a) and the TP=4 row on the midlink spec,
    # which splits them (the ladder needs split layers)
    local = None
    configs = [
        ("llama3_kv ctx 64 tp2 (this machine's spec)", "examples/llama3_kv.py", 2, "none", local,
         dict(context=64, new_tokens=16)),
        ("llama3_kv ctx 256 tp2 (this machine's spec)", "examples/llama3_kv.py", 2, "none", local,
         dict(context=256, new_tokens=16)),
        ("hf_llama_kv ctx 64 tp2 (this machine's spec)", "examples/hf_llama_kv.py", 2, "none", local,
         dict(context=64, new_tokens=16)),
        ("llama3_kv ctx 64 tp2 (midlink)", "examples/llama3_kv.py", 2, "none", MIDLINK,
         dict(context=64, new_tokens=16)),
        ("llama_2kv ctx 64 tp4 (midlink)", "tests/models/llama_2kv.py", 4, "none", MIDLINK,
         dict(context=64, new_tokens=8)),
        ("llama3_kv ctx 64 tp2 ladder upper:2 (midlink)", "examples/llama3_kv.py", 2, "upper:2", MIDLINK,
         dict(context=64, new_tokens=16)),
    ]  # fmt: skip
    for label, model, tp, ladder, cluster, kw in configs:
        p, prepared, spec = planned(model, cluster, tp, ladder, **kw)
        run = workflow.run_serving(
            p,
            str(ROOT / model),
            tp,
            iters=iters,
            warmup=1,
            timeout_s=600,
            speed_probe=workflow.probes_speed(spec),
        )
        m, n, sv = run["measured"], run["numerics"], p.serving
        at_run = workflow.at_run_speed(p, prepared.structure, spec, run)
        at_speed = "-"
        if at_run:
            matmul = f"{at_run['matmul_ratio']:.2f}" if at_run.get("matmul_ratio") else "-"
            at_speed = f"{m['tpot_s'] / at_run['latency_s']:.2f} ({at_run['speed_ratio']:.2f}, {matmul})"
        speed = "-"
        if m.get("standard_tpot_s"):
            speed = f"{sv.standard_tpot_s / sv.tpot_s:.3f} / {m['ladder_speedup']:.3f}"
        table.add_row(label, f"{sv.tpot_s * 1e3:.2f} ms",
                      f"{m['tpot_s'] * 1e3:.2f} ms ({m['latency_p10_s'] * 1e3:.1f}-{m['latency_p90_s'] * 1e3:.1f})",
                      f"{m['tpot_s'] / sv.tpot_s:.2f}", at_speed, str(n["tokens_identical"]), speed)  # fmt: skip
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", action="store_true", help="also run (a) and (b) on local gloo ranks")
    parser.add_argument("--iters", type=int, default=3, help="timed requests per configuration")
    parser.add_argument(
        "--only", choices=["published", "llm-inference-bench"], help="one of parts (c) and (d)"
    )
    args = parser.parse_args()
    console = Console(width=200)
    if args.only in (None, "published"):
        published(console)
    if args.only in (None, "llm-inference-bench"):
        llm_inference_bench(console)
    if args.run:
        measured(console, args.iters)


if __name__ == "__main__":
    main()

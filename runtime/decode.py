"""Run a serving plan on real process groups: prefill, then greedy decode steps, timed per token.

`write_decode_reference(job, directory)` runs the unsharded model once, in the launching process
(`planner.cli.workflow.run_serving`): it builds the model (seeded) with caches for the request
(`batch_size` sequences of `cache_len` tokens), captures its two phases - the prefill of the prompt
and one decode step (two graphs: captured shapes are literals) - writes every tensor the graphs read
(weights, the empty caches, lifted constants) to a safetensors file, then generates greedily: the
reference tokens and logits (with the plan's ladder layers applied, so the comparison measures the
rewrite alone; with ladder layers the original model generates too, for the ladder's deviation).

`run_decode_rank(ctx, job)` is the per-rank entry `runtime.launch.launch` starts for decode / generate
plans of a model with a static KV cache (`planner.frontend.phases`). Without a reference in the job
(torchrun, tests calling it directly) local rank 0 of each node makes one first. Each rank, without
ever holding the whole model:

1. builds the model on the meta device and captures its two phases there;
2. lowers both graphs for its rank with `passes.lower.lower_for_rank` (the one lowering: TP pass with
   the KV-cache rules of `passes.tp_rules`, ladder pass), reads its shards of the weights and of the
   caches from the reference's file (`load_rank_state`) and makes the decode graph use the prefill
   graph's weight and cache shards (`share_state`): one copy of each per rank;
3. generates with them and compares tokens and logits with the reference;
4. times `warmup` untimed requests, then `iters` timed ones (more until `min_time_s` has passed on
   every rank): the prefill (time to first token) and
   every decode step (time per output token) each start after a barrier on the TP group.

Decode steps with a static cache all cost the same (attention runs over the whole allocated cache
under a mask), so the per-token samples of all timed requests are pooled.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from costmodels.calibrate import SpeedProbe
from passes import collectives
from passes.checkpoint import SafetensorsCheckpoint, load_whole, save_checkpoint
from passes.expert_parallel import expert_shard
from passes.ladder import apply_ladder, ladder_deviation, ladder_residual_adds
from passes.lower import lower_for_rank
from passes.tensor_parallel import read_local_shards, self_sharded_piece
from planner.errors import InputError
from planner.frontend.analysis import CACHE_UPDATE_OPS, ModelStructure, analyse, cache_buffers
from planner.frontend.capture import capture, flat_inputs, lifted_constants_quiet, retarget_device
from planner.frontend.modelfile import ModelFile, load_model_file
from planner.frontend.phases import Phase, build_for, cast_inputs, decode_phase, phase_inputs, prefill_phase
from planner.plan import Plan
from runtime.job import record_probe, speed_probe_summary
from runtime.launch import RankContext, report_progress
from runtime.measure import PROBE_SHARE, Timing, current_memory_bytes, process_peak_memory_bytes
from runtime.mesh import build_rank_groups
from runtime.numerics import all_outputs
from runtime.reference import WEIGHTS_HELP, shared_reference
from runtime.routing import RoutingTape, routers_of, routing_tape
from runtime.run_mode import check_dtype_runs, expert_load_notes_of, set_run_mode

# max |sharded - unsharded| logits, relative to the logits' scale, that still counts as equal: a few
# ulps of the dtype accumulated over the layers (summation order differs under TP)
LOGIT_TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 5e-3}


@dataclass
class DecodeJob:
    """One serving request, what every rank runs (pickled to the ranks)."""

    model_path: str
    plan: dict[str, Any]  # Plan.to_dict()
    batch_size: int
    prompt_len: int
    new_tokens: int  # tokens generated per sequence (the prefill yields the first)
    cache_len: int  # allocated cache, tokens (>= prompt_len + new_tokens)
    warmup: int = 1  # untimed requests
    iters: int = 3  # timed requests
    seed: int = 0
    reference: DecodeReference | None = None  # made once by the launching process (None: by the ranks)
    speed_probe: bool = False  # CPU: time the speed probe between the timed steps (`runtime.job.RunJob`)
    weights: list[str] | None = None  # safetensors of the model's parameters (--weights); None: seeded init
    min_time_s: float = 0.0  # time requests until at least `iters` and this many seconds (--min-time)


@dataclass
class DecodeReference:
    """The unsharded model's request, generated once (`write_decode_reference`): the tensors every
    rank reads its shards from, and what its tokens and logits must match."""

    directory: str  # folder holding the files (removed by whoever made it)
    weights: str  # safetensors: every tensor the two captured graphs read, by get_attr name
    results: str  # safetensors: prompt (B, P), tokens (B, N), logits (N, B, vocab)
    ladder_logit_deviation: float | None  # relative L2, prefill logits, laddered vs original
    ladder_tokens_differ: int | None  # greedy tokens that ladder residual changed
    made_on: str  # "launching process" | "rank N"


@dataclass
class DecodeRankReport:
    """One rank's request: tokens, numerics against the unsharded model, timings (seconds), memory."""

    rank: int
    tp_rank: int
    tokens: list[list[int]]  # (batch, new_tokens) greedy tokens of the rewritten model
    reference_tokens: list[list[int]]  # the unsharded model's (ladder applied when the plan has one)
    max_abs_logit_diff: float  # over every generated position, each step on the reference's tokens
    logit_scale: float  # max |reference logits|
    ttft_samples_s: list[float]
    tpot_samples_s: list[float]  # every timed decode step, all timed requests
    peak_memory_bytes: int  # weights, cache and everything allocated while generating
    cache_bytes: int  # this rank's KV-cache buffers
    # where this rank chose another token than the reference: the largest gap, in the reference's
    # logits, between the two (`choice_gap`; 0 when every choice agreed)
    max_choice_gap: float = 0.0
    # expert routing replayed from the reference (`runtime.routing.RoutingTape`): calls, the (token) rows
    # whose own top-k differed and the largest finite score gap of those, the routers' logits against
    # the reference's and the reference logits' largest magnitude
    routing_calls: int = 0  # top-k calls replayed (every MoE layer's, prefill and each decode step)
    routing_flipped: int = 0
    routing_max_gap: float = 0.0
    routing_logit_diff: float = 0.0  # the routers' logits against the reference's
    routing_logit_scale: float = 0.0
    ladder_logit_deviation: float | None = None  # relative L2, prefill logits, laddered vs original
    ladder_tokens_differ: int | None = None  # greedy tokens that ladder residual changed
    standard_tpot_samples_s: list[float] = field(default_factory=list)  # ladder plans: without ladder
    notes: list[str] = field(default_factory=list)
    startup_memory_bytes: int = 0  # of peak_memory_bytes: held before the model (torch, process group)
    # DecodeJob.speed_probe: as `runtime.job.RankReport`'s fields of the same names
    probe_node_overhead_s: float | None = None
    probe_backward_node_overhead_s: float | None = None
    probe_matmul_flops_per_s: float | None = None
    probe_samples: int = 0
    # torch dtypes of the floating tensors the rank's decode graph read (weights, caches): what ran
    graph_dtypes: list[str] = field(default_factory=list)


@dataclass
class Generation:
    """Greedy tokens (batch, new_tokens) and the logits each was chosen from, [(batch, vocab)] per token."""

    tokens: torch.Tensor
    logits: list[torch.Tensor]


class Request:
    """A request's two phases and how to call a (prefill, decode) pair of graphs for them."""

    def __init__(
        self,
        model_file: ModelFile,
        batch: int,
        prompt_len: int,
        new_tokens: int,
        cache_len: int,
        dtype: str | None = None,
    ):
        self.model_file = model_file
        self.prefill = prefill_phase(batch, prompt_len, cache_len)
        self.decode = decode_phase(batch, prompt_len, cache_len)
        self.new_tokens = new_tokens
        self.dtype = dtype  # the plan's: floating inputs cast to it (token ids stay integers); None: as made

    def inputs(
        self, phase: Phase, tokens: torch.Tensor | None = None, device: str = "cpu"
    ) -> tuple[tuple, dict]:
        """`phase`'s (args, kwargs) from the model file, floating ones in the request's dtype."""
        args, kwargs = phase_inputs(self.model_file, phase, tokens, device=device)
        return cast_inputs(args, kwargs, self.dtype) if self.dtype else (args, kwargs)

    def step(self, gm: nn.Module, tokens: torch.Tensor, pos: int, device: str) -> torch.Tensor:
        """Logits (batch, vocab) of the last of `tokens` (batch, T) placed at positions pos.. : the model's
        first output is (batch, T', vocab), of which the last position is taken, or already (batch,
        vocab), the last position's alone. InputError for another shape."""
        phase = Phase("step", tokens.shape[0], pos, tokens.shape[1], self.prefill.cache_len)
        args, kwargs = self.inputs(phase, tokens, device)
        return last_position_logits(all_outputs(gm(*flat_inputs(args, kwargs)))[0], tokens.shape[0])

    def generate(
        self,
        prefill: nn.Module,
        decode: nn.Module,
        prompt: torch.Tensor,
        device: str,
        timer: _Timer | None = None,
        forced: torch.Tensor | None = None,
    ) -> Generation:
        """Greedy generation: prefill the prompt, then new_tokens - 1 decode steps. ``forced`` (B,
        new_tokens) int64: each decode step reads these tokens instead of the previous step's own
        choice (teacher forcing: the numerics check compares every step's logits on the reference's
        sequence, which a choice flipped at a near-tie would otherwise leave); the tokens returned are
        still each step's own argmax."""
        timer = timer or _Timer(None, device)
        with torch.no_grad():
            logits = timer.time("ttft", lambda: self.step(prefill, prompt, 0, device))
            out_logits, tokens = [logits], [logits.argmax(-1)]
            for i in range(1, self.new_tokens):
                pos = self.prefill.num_tokens + i - 1
                last = tokens[-1][:, None] if forced is None else forced[:, i - 1 : i].to(tokens[-1].device)
                logits = timer.time("tpot", lambda last=last, pos=pos: self.step(decode, last, pos, device))
                out_logits.append(logits)
                tokens.append(logits.argmax(-1))
        return Generation(torch.stack(tokens, dim=1), out_logits)


def last_position_logits(logits: torch.Tensor, batch: int) -> torch.Tensor:
    """(batch, vocab) logits of a step's last position from a cached model's first output: (batch, T,
    vocab) (every position's, or the last one's as (batch, 1, vocab)) or (batch, vocab) (the last
    position's). Raises InputError naming the shape for anything else."""
    if logits.dim() == 3 and logits.shape[0] == batch:
        return logits[:, -1]
    if logits.dim() == 2 and logits.shape[0] == batch:
        return logits
    raise InputError(
        f"the model's first output has shape {tuple(logits.shape)} at batch {batch}; serving reads the logits "
        "as (batch, positions, vocab) or, for the last position only, (batch, vocab): return one of them "
        "first from forward"
    )


def host_step_time_s(
    model_file: ModelFile, batch: int, prompt_len: int, new_tokens: int, vocab: int, budget_s: float = 0.2
) -> float:
    """Seconds of host work in one timed decode step outside its graph, on this process: what
    `Request.step` runs around the graph call (the model file's `step_inputs`, flattening them, taking
    the last position's logits), timed through `Request.step` itself with a stand-in graph that
    returns (batch, 1, vocab) logits. Median of calls for about ``budget_s``, in thread CPU time
    (`costmodels.calibrate.clock`, as the spec's per-node overhead is timed). On the 2-vCPU dev VM:
    30-35 us per step for the examples' Llama models (2026-12-01), about 3% of their 1-1.5 ms decode
    step. The greedy argmax after the step (about 14 us) is outside the timed step and not counted.
    Raises what the model file's `step_inputs` raises."""
    request = Request(model_file, batch, prompt_len, new_tokens, prompt_len + new_tokens)
    logits = torch.zeros(batch, 1, vocab)
    tokens = torch.zeros(batch, 1, dtype=torch.long)

    def graph(*_: object) -> tuple[torch.Tensor]:
        return (logits,)

    request.step(graph, tokens, prompt_len, "cpu")  # warm-up
    samples: list[float] = []
    end = time.perf_counter() + budget_s
    while len(samples) < 5 or (time.perf_counter() < end and len(samples) < 2000):
        start = time.thread_time()
        request.step(graph, tokens, prompt_len, "cpu")
        samples.append(time.thread_time() - start)
    return statistics.median(samples)


class _Timer:
    """Times calls (none: untimed); samples in seconds by name. A request's first step ("ttft") starts
    after a barrier on `group`, so every rank times it from the same moment; its decode steps
    ("tpot") run back to back, as a serving loop runs them: a sharded plan's ranks keep in step
    through the graph's own collectives, and a barrier before each step would time a step that
    starts cold after an idle wait, which no serving loop pays (on the 2-vCPU dev VM the tiny
    Llama's decode graph took 1.55 ms after a gloo barrier, also with a 0.5 ms sleep after it,
    against 1.35-1.48 ms back to back, 2026-12-01). `probe`: called after a timed call, outside it,
    while its calls have taken under `PROBE_SHARE` of the timed time (as
    `runtime.measure.time_iterations` does between samples)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: str,
        enabled: bool = False,
        probe: Callable[[], float] | None = None,
    ):
        self.group, self.device, self.enabled = group, torch.device(device), enabled
        self.samples: dict[str, list[float]] = {"ttft": [], "tpot": []}
        self.probe, self._probe_s, self._timed_s = probe, 0.0, 0.0

    def time(self, name: str, fn):
        if not self.enabled:
            return fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if name == "ttft" and dist.is_initialized():
            dist.barrier(group=self.group)
        start = time.perf_counter()
        out = fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.samples[name].append(time.perf_counter() - start)
        self._timed_s += self.samples[name][-1]
        if self.probe is not None and self._probe_s < PROBE_SHARE * self._timed_s:
            self._probe_s += self.probe()
        return out


def _owner(module: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    owner_path, _, leaf = fqn.rpartition(".")
    return (module.get_submodule(owner_path) if owner_path else module), leaf


def share_state(source: fx.GraphModule, target: fx.GraphModule) -> None:
    """Make `target` read `source`'s tensors (parameters, buffers, lifted tensor constants) for every
    `get_attr` the two graphs share with the same shape: the decode graph takes the prefill graph's
    weight shards and KV caches, one copy per rank. Raises ValueError naming a tensor the two hold
    with different shapes."""
    for node in target.graph.nodes:
        if node.op != "get_attr":
            continue
        fqn = str(node.target)
        try:
            src_owner, leaf = _owner(source, fqn)
        except AttributeError:  # a submodule the source graph does not have
            continue
        other = getattr(src_owner, leaf, None)
        owner, leaf = _owner(target, fqn)
        mine = getattr(owner, leaf)
        if not isinstance(other, torch.Tensor) or not isinstance(mine, torch.Tensor):
            continue
        if tuple(other.shape) != tuple(mine.shape):
            raise ValueError(f"`{fqn}`: prefill holds {tuple(other.shape)}, decode {tuple(mine.shape)}")
        if leaf in owner._parameters:
            owner._parameters[leaf] = other
        elif leaf in owner._buffers:
            owner._buffers[leaf] = other
        else:
            setattr(owner, leaf, other)


def cache_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the tensors `gm` updates in place (its KV caches), each once."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    total, seen = 0, set()
    for node in cache_buffers(nodes):
        owner, leaf = _owner(gm, str(node.target))
        t = getattr(owner, leaf)
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _captured(model: nn.Module, request: Request, device: str) -> tuple[fx.GraphModule, fx.GraphModule]:
    with lifted_constants_quiet():  # serving trains nothing: attributes kept without gradient do not matter
        prefill = capture(model, *request.inputs(request.prefill, device=device))
        decode = capture(model, *request.inputs(request.decode, device=device))
    return prefill, decode


def _laddered(gm: fx.GraphModule, structure: ModelStructure, layers: list[int]) -> fx.GraphModule:
    out = copy.deepcopy(gm)
    apply_ladder(out, ladder_residual_adds(structure, layers))
    return out


def _graph_tensors(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Every tensor a `get_attr` of `gm` reads (parameters, buffers, lifted constants), by name."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            owner, leaf = _owner(gm, str(node.target))
            value = getattr(owner, leaf, None)
            if isinstance(value, torch.Tensor):
                out[str(node.target)] = value
    return out


def write_decode_reference(
    job: DecodeJob, directory: str, made_on: str = "launching process"
) -> DecodeReference:
    """Build the whole model once (seeded, or its parameters read from `job.weights`), write the
    tensors its prefill and decode graphs read (the caches still empty) and its greedy generation
    into `directory` (module docstring)."""
    plan = Plan.from_dict(job.plan)
    model_file = load_model_file(job.model_path)
    request = Request(model_file, job.batch_size, job.prompt_len, job.new_tokens, job.cache_len, plan.dtype)
    torch.manual_seed(job.seed)
    model = build_for(model_file, request.prefill, "cpu")
    if job.weights:  # the parameters only: the caches are sized for this request, not the checkpoint
        load_whole(model, job.weights, WEIGHTS_HELP, parameters_only=True)
    # the plan's dtype (weights and caches), as the ranks run it
    set_run_mode(model, plan.dtype, training=False)
    prefill, decode = _captured(model, request, "cpu")
    tensors = {**_graph_tensors(decode), **_graph_tensors(prefill)}
    weights = os.path.join(directory, "weights.safetensors")
    save_checkpoint(tensors, weights)  # before generating: the caches are saved empty
    structure_p, structure_d = analyse(prefill), analyse(decode)
    g = torch.Generator().manual_seed(job.seed + 1)
    prompt = torch.randint(0, structure_p.vocab_size or 2, (job.batch_size, job.prompt_len), generator=g)
    share_state(prefill, decode)
    ladder = list(plan.ladder_layers)
    deviation = differ = None
    # the experts each router chose, in call order, for the ranks to replay (`runtime.routing`)
    tape = RoutingTape()
    routers = [(prefill, routers_of(structure_p)), (decode, routers_of(structure_d))]
    if ladder:
        lad_p, lad_d = _laddered(prefill, structure_p, ladder), _laddered(decode, structure_d, ladder)
        share_state(lad_p, lad_d)
        original = request.generate(prefill, decode, prompt, "cpu")
        with routing_tape([(lad_p, routers[0][1]), (lad_d, routers[1][1])], tape):
            reference = request.generate(lad_p, lad_d, prompt, "cpu")
        deviation = ladder_deviation(original.logits[0], reference.logits[0])
        differ = int((original.tokens != reference.tokens).sum())
    else:
        with routing_tape(routers, tape):
            reference = request.generate(prefill, decode, prompt, "cpu")
    results = os.path.join(directory, "results.safetensors")
    routing = {f"routing.{i}.ids": ids for i, (ids, _) in enumerate(tape.choices)}
    routing |= {f"routing.{i}.logits": lg for i, (_, lg) in enumerate(tape.choices) if lg is not None}
    save_checkpoint(
        {"prompt": prompt, "tokens": reference.tokens, "logits": torch.stack(reference.logits), **routing},
        results,
    )
    return DecodeReference(directory, weights, results, deviation, differ, made_on)


def load_rank_state(gm: fx.GraphModule, weights: str, plan: Plan, tp_rank: int, device: str) -> None:
    """Fill a lowered graph built on meta with this rank's tensors from the unsharded `weights`:
    split weights through `read_local_shards` (the plan's splits), the rest whole, except tensors the
    TP pass sharded on its own (KV caches along heads): their one dim that differs from the whole
    tensor's is cut into whole / local pieces and this rank takes piece tp_rank * pieces // tp (an
    even 1/tp shard, or a KV head replicated on tp / pieces ranks). Raises ValueError for a tensor
    whose shape fits neither."""
    local = _graph_tensors(gm)
    with SafetensorsCheckpoint([weights]) as source:
        split_names = [
            n for n in local if n in plan.splits or n.removesuffix(".bias") + ".weight" in plan.splits
        ]
        values = (
            read_local_shards(gm, source, plan.splits, tp_rank, plan.tp, split_names) if split_names else {}
        )
        for name, tensor in local.items():
            if name in values:
                continue
            whole = source.read(name)
            ep_shard = gm.meta.get("ep_shards", {}).get(name)  # this rank's experts (`passes.ep_lower`)
            if ep_shard is not None and tuple(whole.shape) != tuple(tensor.shape):
                whole = expert_shard(whole, ep_shard).clone()  # not a view keeping every expert
            if tuple(whole.shape) != tuple(tensor.shape):
                whole = self_sharded_piece(whole, tuple(tensor.shape), tp_rank, plan.tp, name)
            values[name] = whole.to(dtype=tensor.dtype).contiguous()
    for name, value in values.items():
        owner, leaf = _owner(gm, name)
        value = value.to(device)
        if leaf in owner._parameters:
            owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        elif leaf in owner._buffers:
            owner._buffers[leaf] = value
        else:
            setattr(owner, leaf, value)
    retarget_device(gm, device)


def _rank_graphs(
    prefill: fx.GraphModule,
    decode: fx.GraphModule,
    structures: tuple[ModelStructure, ModelStructure],
    plan: Plan,
    ctx: RankContext,
    tp_rank: int,
    weights: str,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """This rank's prefill and decode graphs of `plan`, lowered from copies of the meta-captured
    graphs, filled from `weights`, the decode graph reading the prefill graph's tensors."""
    device = str(ctx.device)
    gp = lower_for_rank(copy.deepcopy(prefill), structures[0], plan, ctx.rank).module
    gd = lower_for_rank(copy.deepcopy(decode), structures[1], plan, ctx.rank).module
    load_rank_state(gp, weights, plan, tp_rank, device)
    load_rank_state(gd, weights, plan, tp_rank, device)
    share_state(gp, gd)
    return gp, gd


MAX_TIMED_REQUESTS = 1000  # --min-time stops adding requests here whatever the clock says


def _more_time(start: float, min_time_s: float, device: torch.device) -> bool:
    """Whether to time another request after the `iters` asked for: until every rank has timed for
    `min_time_s` (the ranks agree through one all-reduce, so that all run the same requests)."""
    if min_time_s <= 0:
        return False
    more = torch.tensor([float(time.perf_counter() - start < min_time_s)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(more, op=dist.ReduceOp.MAX)
    return bool(more.item())


def run_decode_rank(ctx: RankContext, job: DecodeJob) -> DecodeRankReport:
    """Per-rank entry: compare the rewritten request with the reference's, then time it (module
    docstring). Raises ValueError for a plan with pp > 1 or dp > 1 (the runner refuses those first)."""
    plan = Plan.from_dict(job.plan)
    if plan.ep > 1 and plan.ep_fold != "tp":
        raise ValueError(
            f"decode runs expert parallelism over the TP ranks only (ep_fold tp); the plan folds ep={plan.ep} "
            "over the data-parallel ranks"
        )
    if plan.pp > 1 or plan.dp > 1:
        raise ValueError(
            f"decode runs tensor parallelism only (pp=1, dp=1); the plan has {plan.mesh.label()}"
        )
    groups = build_rank_groups(plan.mesh, ctx.device.type)
    collectives.register_group("tp", groups.group("tp"))
    # experts split over the TP ranks without EP (`Plan.expert_tp`) dispatch over a one-rank "ep" axis
    collectives.register_group("ep", groups.group("ep"))
    startup = current_memory_bytes(ctx.device)
    with shared_reference(ctx, job, make=write_decode_reference) as ref:
        report = _serve_rank(ctx, job, plan, groups, ref)
    report.startup_memory_bytes = startup
    return report


def _serve_rank(
    ctx: RankContext, job: DecodeJob, plan: Plan, groups, ref: DecodeReference
) -> DecodeRankReport:
    device = str(ctx.device)
    check_dtype_runs(plan.dtype, ctx.device)
    model_file = load_model_file(job.model_path)
    request = Request(model_file, job.batch_size, job.prompt_len, job.new_tokens, job.cache_len, plan.dtype)
    model = set_run_mode(build_for(model_file, request.prefill, "meta"), plan.dtype, training=False)
    prefill_meta, decode_meta = _captured(model, request, "meta")
    structures = (analyse(prefill_meta), analyse(decode_meta))
    tape = RoutingTape(replay=True)
    with SafetensorsCheckpoint([ref.results]) as results:
        prompt = results.read("prompt").to(device)
        want_tokens = results.read("tokens")
        want_logits = list(results.read("logits").unbind(0))
        while f"routing.{(i := len(tape.choices))}.ids" in results:
            logits = results.read(f"routing.{i}.logits") if f"routing.{i}.logits" in results else None
            tape.choices.append((results.read(f"routing.{i}.ids"), logits))

    # this rank's graphs: the one lowering, weights and caches shared between the two phases
    gp, gd = _rank_graphs(prefill_meta, decode_meta, structures, plan, ctx, groups.tp_rank, ref.weights)
    # every step on the reference's tokens, every router choosing the experts the reference chose
    # (`runtime.routing`): a greedy token or a top-k flipped at a near-tie (bf16 rounding of another
    # summation order) would otherwise make the sequences, and every later logit, differ
    with routing_tape([(gp, routers_of(structures[0])), (gd, routers_of(structures[1]))], tape):
        got = request.generate(gp, gd, prompt, device, forced=want_tokens)
    # the process's real peak: this rank's shards, its caches, activations (the whole model is never built here
    # unless this rank made the reference itself: `ref.made_on`)
    peak = process_peak_memory_bytes(ctx.device)
    diff = max(float((a.cpu() - b).abs().max()) for a, b in zip(got.logits, want_logits))
    scale = max(float(b.abs().max()) for b in want_logits)
    gap = choice_gap(got.tokens.cpu(), want_tokens, want_logits)
    variants = {"plan": (gp, gd)}
    if plan.ladder_layers:  # the same splits without ladder, timed side by side: the measured speed-up
        standard = dataclasses.replace(plan, ladder_layers=[])
        variants["standard"] = _rank_graphs(
            prefill_meta, decode_meta, structures, standard, ctx, groups.tp_rank, ref.weights
        )
    del prefill_meta, decode_meta, model

    probe = SpeedProbe(ctx.device) if job.speed_probe and ctx.device.type == "cpu" else None
    timers = {
        name: _Timer(groups.group("tp"), device, probe=probe.sample if probe and name == "plan" else None)
        for name in variants
    }
    for i in range(job.warmup):
        report_progress(f"warm-up request {i + 1}/{job.warmup}", i / job.warmup)
        for name, (p, d) in variants.items():
            request.generate(p, d, prompt, device, timers[name])
    for timer in timers.values():
        timer.enabled = True
    start, i = time.perf_counter(), 0
    while i < job.iters or (i < MAX_TIMED_REQUESTS and _more_time(start, job.min_time_s, device)):
        report_progress(f"timed request {i + 1}/{job.iters}", min(1.0, i / job.iters))
        for name, (p, d) in variants.items():
            request.generate(p, d, prompt, device, timers[name])
        i += 1
    standard_timer = timers.get("standard")
    report = DecodeRankReport(
        rank=ctx.rank,
        tp_rank=groups.tp_rank,
        tokens=got.tokens.tolist(),
        reference_tokens=want_tokens.tolist(),
        max_abs_logit_diff=diff,
        logit_scale=scale,
        max_choice_gap=gap,
        routing_calls=tape.calls,
        routing_flipped=tape.flipped,
        routing_max_gap=tape.max_gap,
        routing_logit_diff=tape.logit_diff,
        routing_logit_scale=tape.logit_scale,
        ttft_samples_s=timers["plan"].samples["ttft"],
        tpot_samples_s=timers["plan"].samples["tpot"],
        peak_memory_bytes=peak,
        cache_bytes=cache_bytes(gd),
        ladder_logit_deviation=ref.ladder_logit_deviation,
        ladder_tokens_differ=ref.ladder_tokens_differ,
        standard_tpot_samples_s=standard_timer.samples["tpot"] if standard_timer else [],
        graph_dtypes=sorted({str(t.dtype) for t in _graph_tensors(gd).values() if t.is_floating_point()}),
        notes=[
            f"the unsharded reference was built and run once, in the {ref.made_on}"
            if ref.made_on.startswith("launching")
            else f"the unsharded reference was built on {ref.made_on}: its peak memory includes the whole model"
        ],
    )
    if plan.ep > 1 or plan.expert_tp > 1:
        held = (
            f"1/{plan.ep} of its experts (split over the {plan.ep_fold} ranks)"
            if plan.ep > 1
            else f"1/{plan.expert_tp} of every expert (each split over the TP ranks, its outputs all-reduced)"
        )
        what = (
            "expert parallelism applied" if plan.ep > 1 else "experts split over TP (no expert parallelism)"
        )
        report.notes.append(
            f"{what}: each MoE block's {len(gp.meta.get('ep_params', []))} expert weight(s) on "
            f"this rank hold {held}; "
            + (expert_load_notes_of(gd, ctx.rank) or ["no routed tokens recorded"])[0]
        )
    if job.weights:
        report.notes.append(
            f"parameters read from {', '.join(job.weights)} (cast to the model's dtype where stored otherwise)"
        )
    if probe is not None:
        record_probe(report, probe)
    return report


def choice_gap(tokens: torch.Tensor, reference: torch.Tensor, reference_logits: list[torch.Tensor]) -> float:
    """The largest gap, in the reference's logits of a step, between the token the reference chose and
    the one a sharded run chose instead, over the (B, steps) choices ``tokens`` / ``reference`` that
    differ; 0 when none does. ``reference_logits``: one (B, V) tensor per step. A gap within the logit
    tolerance is a near-tie that rounding may flip; a larger one is a real difference."""
    gap = 0.0
    for b, step in (tokens != reference).nonzero().tolist():
        row = reference_logits[step][b].float()
        gap = max(gap, float(row[reference[b, step]] - row[tokens[b, step]]))
    return gap


def summarise_decode(reports: list[DecodeRankReport], dtype: str, batch_size: int, new_tokens: int) -> dict:
    """The report's `measured` and `numerics` sections of a serving run.

    TTFT and time per output token: medians of the slowest rank's samples (a TP step ends when its
    last rank ends), p10 / p90 of the same; tokens/s over a request = batch x new_tokens / (TTFT +
    (new_tokens - 1) x TPOT). Numerics, every step run on the reference's tokens (teacher forcing): the
    logits agree with the unsharded model's within LOGIT_TOLERANCE[dtype] x scale, every rank chose the
    same tokens, and a choice other than the reference's is a near-tie: the reference's own logits of
    the two within that tolerance (`ok`; bf16 rounding of another summation order flips such ties).
    Routers replay the reference's expert choices (`runtime.routing`), and their logits must agree with
    the reference's within the same relative tolerance of their scale (a router the rewrite got wrong
    would otherwise hide behind the replayed choices)."""

    def median(xs: list[float]) -> float:
        return statistics.median(xs) if xs else 0.0

    slowest = max(reports, key=lambda r: median(r.tpot_samples_s))
    tpot = sorted(slowest.tpot_samples_s)
    ttft = median(max(reports, key=lambda r: median(r.ttft_samples_s)).ttft_samples_s)
    tpot_timing = Timing.from_samples(tpot) if tpot else None
    tpot_s = tpot_timing.median_s if tpot_timing else 0.0
    request_s = ttft + (new_tokens - 1) * tpot_s
    scale = max(r.logit_scale for r in reports)
    diff = max(r.max_abs_logit_diff for r in reports)
    same = all(r.tokens == r.reference_tokens for r in reports)
    agree = all(r.tokens == reports[0].tokens for r in reports)
    tolerance = LOGIT_TOLERANCE.get(dtype, 1e-4) * max(scale, 1.0)
    gap = max(r.max_choice_gap for r in reports)
    first = reports[0]
    # the routers' own logits: the replayed expert choices would otherwise hide a wrong router
    routing_diff = max(r.routing_logit_diff for r in reports)
    routing_tolerance = LOGIT_TOLERANCE.get(dtype, 1e-4) * max(r.routing_logit_scale for r in reports)
    return {
        "measured": {
            "latency_s": tpot_s,
            "latency_p10_s": tpot_timing.p10_s if tpot_timing else None,
            "latency_p90_s": tpot_timing.p90_s if tpot_timing else None,
            "ttft_s": ttft,
            "tpot_s": tpot_s,
            "request_s": request_s,
            "tokens_per_s": batch_size * new_tokens / request_s if request_s else None,
            "per_rank_median_s": [median(r.tpot_samples_s) for r in reports],
            "peak_memory_bytes": max(r.peak_memory_bytes for r in reports),
            "per_rank_peak_memory_bytes": [r.peak_memory_bytes for r in reports],
            "startup_memory_bytes": max(r.startup_memory_bytes for r in reports),
            "notes": list(dict.fromkeys(note for r in reports for note in r.notes)),
            "cache_bytes_per_rank": max(r.cache_bytes for r in reports),
            "iterations": len(tpot),
            "per_layer_s": {},
            "speed_probe": speed_probe_summary(reports),
            "dtype": dtype,  # the plan's dtype, which the ranks ran
            **_standard(reports, tpot_s),
        },
        "numerics": {
            "max_abs_diff": diff,
            "relative_max_abs_diff": diff / scale if scale else None,
            "output_scale": scale,
            "logit_tolerance": tolerance,
            "tolerance_rel": LOGIT_TOLERANCE.get(dtype, 1e-4),  # of the logit scale (at least 1)
            "dtype": dtype,
            "tokens_identical": same and agree,
            "ranks_agree": agree,  # every rank chose the same tokens
            "tokens_differ": sum(
                sum(a != b for a, b in zip(x, y)) for x, y in zip(first.tokens, first.reference_tokens)
            ),
            "tokens": first.tokens,
            "reference_tokens": first.reference_tokens,
            "ladder_deviation": first.ladder_logit_deviation,
            "ladder_tokens_differ": first.ladder_tokens_differ,
            "max_choice_gap": gap,
            "routing_calls": max(r.routing_calls for r in reports),
            "routing_flipped": max(r.routing_flipped for r in reports),
            "routing_max_gap": max(r.routing_max_gap for r in reports),
            "routing_logit_diff": routing_diff,
            "routing_tolerance": routing_tolerance,
            "ok": agree
            and diff <= tolerance
            and (same or gap <= tolerance)
            and routing_diff <= routing_tolerance,
        },
        # every rank's own report, its samples and tokens left out (in `measured` and `numerics` above)
        "ranks": [
            {
                k: v
                for k, v in dataclasses.asdict(r).items()
                if not k.endswith("samples_s") and "tokens" not in k
            }
            for r in reports
        ],
    }


def _standard(reports: list[DecodeRankReport], tpot_s: float) -> dict[str, float]:
    """Ladder plans: the same splits without ladder, timed in the same run, and the speed-up."""
    if not any(r.standard_tpot_samples_s for r in reports):
        return {}
    standard_s = max(
        statistics.median(r.standard_tpot_samples_s) for r in reports if r.standard_tpot_samples_s
    )
    return {"standard_tpot_s": standard_s, "ladder_speedup": standard_s / tpot_s if tpot_s else 0.0}


__all__ = [
    "CACHE_UPDATE_OPS",
    "DecodeJob",
    "DecodeReference",
    "load_rank_state",
    "write_decode_reference",
    "DecodeRankReport",
    "run_decode_rank",
    "share_state",
    "summarise_decode",
]

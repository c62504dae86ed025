"""Held-out loss, ladder sensitivity and training of a language model, through the planner's own graph.

The model is captured (`planner.frontend.capture.capture`) at a fixed (batch, seq_len) and, for a
ladder model, rewritten by the planner's ladder pass (`passes.ladder.apply_ladder`) on the upper
layers: what is evaluated and trained is the graph the planner runs (at TP=1 the pass inserts no
collective, so the graph is the unsharded ladder model). The graph's parameters keep the model's
FQNs (`layers.3.attention.wq.weight`), so a trained graph saves a checkpoint that `--weights` runs
and the emitted sharded modules read by name.

    lm_graph(model, batch, seq_len, ladder_layers)   -> GraphModule (logits (batch, seq_len, vocab))
    evaluate(gm, blocks, batch)                       -> EvalResult: mean token loss (nats), perplexity
    laddered_copy(gm, structure, layers)              -> the same graph laddered (its own weights)
    train(gm, blocks, TrainConfig, ...)               -> loss per step (AdamW, warm-up + cosine, clipping)
    run_adapt(AdaptJob, nproc)                        -> the same on `nproc` data-parallel gloo ranks
    save_weights(gm, model, path)                     -> safetensors with the model's state_dict names

Loss: mean cross-entropy per target token in nats; perplexity = exp(loss).
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from passes.checkpoint import save_checkpoint
from passes.ladder import apply_ladder, ladder_residual_adds
from planner.errors import InputError
from planner.frontend.analysis import ModelStructure, analyse
from planner.frontend.capture import capture
from planner.frontend.modelfile import load_model_file
from runtime.data_parallel import average_gradients
from runtime.launch import RankContext, launch
from runtime.lm_data import TokenBlocks
from runtime.reference import build_unsharded

ProgressFn = Callable[[int, int], None]  # (done, total)


# ---------------------------------------------------------------------------------------------- graph


def lm_structure(gm: fx.GraphModule) -> ModelStructure:
    """The analysed structure of a captured LM graph. Raises InputError when it has no layers or
    no token embedding (not a language model the ladder applies to)."""
    s = analyse(gm)
    if not s.layers or s.vocab_size is None:
        raise InputError(
            "the model is not a transformer language model the planner recognises (token embedding and "
            "attention/MLP layers): ladder quality needs one"
        )
    return s


def lm_graph(
    model: nn.Module, batch_size: int, seq_len: int, ladder_layers: Sequence[int] = ()
) -> fx.GraphModule:
    """`model` captured for token ids (batch_size, seq_len) and, when `ladder_layers` is not empty,
    rewritten into ladder residual form on those layers by the planner's ladder pass.

    The graph owns copies of the model's parameters (same FQNs). Raises InputError when the model
    does not capture or has no layers the ladder applies to.
    """
    tokens = torch.zeros(batch_size, seq_len, dtype=torch.long)
    gm = capture(model, (tokens,))
    if ladder_layers:
        apply_ladder(gm, ladder_residual_adds(lm_structure(gm), sorted(ladder_layers)))
    return gm


def laddered_copy(
    gm: fx.GraphModule, structure: ModelStructure, ladder_layers: Sequence[int]
) -> fx.GraphModule:
    """A deep copy of a standard captured graph with `ladder_layers` laddered (the copy's own weights)."""
    out = copy.deepcopy(gm)
    if ladder_layers:
        apply_ladder(out, ladder_residual_adds(structure, sorted(ladder_layers)))
    return out


def upper_layers(num_layers: int, count: int) -> list[int]:
    """The top `count` layers of `num_layers` (the hybrid ladder of the ladder-residual paper)."""
    return list(range(num_layers - count, num_layers))


def _logits(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def token_losses(gm: fx.GraphModule, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per sequence, summed over its tokens: (batch,) float, nats."""
    logits = _logits(gm(inputs))  # (B, T, V)
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    return losses.view(targets.shape).sum(dim=1)


# ----------------------------------------------------------------------------------------- evaluate


@dataclass(frozen=True)
class EvalResult:
    """Held-out quality: mean loss per token (nats), its perplexity, and how many tokens."""

    loss: float
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


@torch.no_grad()
def evaluate(
    gm: fx.GraphModule,
    blocks: TokenBlocks,
    batch_size: int,
    progress: ProgressFn | None = None,
    max_batches: int | None = None,
) -> EvalResult:
    """Mean token loss of `gm` (captured at `batch_size`) over every block of `blocks` (or the first
    `max_batches` batches). The last, short batch is padded with copies of its first block whose
    losses are not counted. Deterministic."""
    loader = DataLoader(blocks, batch_size=batch_size, shuffle=False)
    total_batches = len(loader) if max_batches is None else min(max_batches, len(loader))
    loss_sum, count = 0.0, 0
    gm.eval()
    for i, (x, y) in enumerate(loader):
        if i >= total_batches:
            break
        real = x.shape[0]
        if real < batch_size:
            pad = batch_size - real
            x = torch.cat([x, x[:1].expand(pad, -1)])
            y = torch.cat([y, y[:1].expand(pad, -1)])
        loss_sum += float(token_losses(gm, x, y)[:real].sum())
        count += real * y.shape[1]
        if progress is not None:
            progress(i + 1, total_batches)
    return EvalResult(loss_sum / max(count, 1), count)


def relative_increase(loss: float, reference: float) -> float:
    """(loss - reference) / reference: the ladder's loss increase as a fraction of the standard loss."""
    return (loss - reference) / reference


# -------------------------------------------------------------------------------------------- train


@dataclass(frozen=True)
class TrainConfig:
    """AdamW with linear warm-up then cosine decay to `min_lr_fraction` of `lr`, global-norm clipping.

    batch_size is global: with `world` data-parallel ranks each takes batch_size / world blocks.
    """

    steps: int
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_fraction: float = 0.1
    warmup_steps: int | None = None  # None: 5% of the steps, at least 1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # max global gradient norm
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise InputError(f"--steps must be >= 1, got {self.steps}")
        if self.batch_size < 1:
            raise InputError(f"--batch-size must be >= 1, got {self.batch_size}")
        if not self.lr > 0:
            raise InputError(f"--lr must be > 0, got {self.lr}")

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 20)

    def lr_factor(self, step: int) -> float:
        """Multiplier of `lr` at 0-based `step`: linear warm-up, then cosine to `min_lr_fraction`."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        span = max(1, self.steps - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_lr_fraction + (1 - self.min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class TrainResult:
    """Loss per step (global mean over ranks, nats), learning rate per step, wall time."""

    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    time_s: float = 0.0


def _batches(
    blocks: TokenBlocks, batch_size: int, seed: int, rank: int, world: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless shuffled batches: each epoch a new permutation, each rank its own share of it."""
    epoch = 0
    while True:
        if world > 1:
            sampler = DistributedSampler(
                blocks, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True
            )
            sampler.set_epoch(epoch)
        else:
            sampler = RandomSampler(blocks, generator=torch.Generator().manual_seed(seed + epoch))
        yield from DataLoader(blocks, batch_size=batch_size, sampler=sampler, drop_last=True)
        epoch += 1


def layer_parameters(gm: fx.GraphModule, structure: ModelStructure, layers: Sequence[int]) -> set[str]:
    """Names of the graph's parameters that belong to `layers` (by the layer's module path)."""
    prefixes = tuple(structure.layers[i].module_path + "." for i in layers)
    return {name for name, _ in gm.named_parameters() if name.startswith(prefixes)}


def train(
    gm: fx.GraphModule,
    blocks: TokenBlocks,
    config: TrainConfig,
    trainable: set[str] | None = None,
    on_step: Callable[[int, float, float], None] | None = None,
    group: dist.ProcessGroup | None = None,
) -> TrainResult:
    """Train `gm` (captured at batch_size / world) in place on shuffled `blocks` for `config.steps` steps.

    trainable: parameter names to update (None: all); the others are frozen. group: the
    data-parallel process group when several ranks train (gradients averaged with one all-reduce per
    step, `runtime.data_parallel.average_gradients`); None: this process alone. on_step(step, loss,
    lr) is called after every step with the global mean loss. Raises InputError when there are
    fewer training blocks than one global batch.
    """
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    if config.batch_size % world:
        raise InputError(f"--batch-size {config.batch_size} must divide by the {world} data-parallel ranks")
    local = config.batch_size // world
    if len(blocks) < config.batch_size:
        raise InputError(
            f"too little training text: {len(blocks)} blocks of {blocks.seq_len} tokens, one batch needs {config.batch_size}"
        )
    torch.manual_seed(config.seed)
    names = dict(gm.named_parameters())
    for name, p in names.items():
        p.requires_grad_(trainable is None or name in trainable)
    params = [p for p in names.values() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=config.betas,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, config.lr_factor)
    result = TrainResult()
    start = time.perf_counter()
    gm.train()
    batches = _batches(blocks, local, config.seed, rank, world)
    for step in range(config.steps):
        x, y = next(batches)
        loss = token_losses(gm, x, y).sum() / y.numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        loss = loss.detach()
        if world > 1:
            average_gradients(gm, group, world)
            loss = loss.clone()
            dist.all_reduce(loss, group=group)
            loss /= world
        torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        value = loss.item()
        result.losses.append(value)
        result.lrs.append(lr)
        if on_step is not None:
            on_step(step, value, lr)
    gm.eval()
    for p in names.values():
        p.requires_grad_(True)
    result.time_s = time.perf_counter() - start
    return result


def state_dict_of(gm: fx.GraphModule, model: nn.Module) -> dict[str, torch.Tensor]:
    """The graph's tensors under the names of `model.state_dict()` (persistent tensors only)."""
    mine = gm.state_dict()
    missing = [k for k in model.state_dict() if k not in mine]
    assert not missing, f"captured graph lacks {missing[:3]}"  # capture keeps every FQN
    return {k: mine[k].detach().clone() for k in model.state_dict()}


def save_weights(gm: fx.GraphModule, model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write the graph's weights as one safetensors file with `model.state_dict()` names."""
    save_checkpoint(state_dict_of(gm, model), path)


# ------------------------------------------------------------------------------------ adapt on ranks


@dataclass
class AdaptJob:
    """Fine-tune a model file's model with ladder on `ladder_layers` (picklable, for `launch`)."""

    model_path: str
    weights: list[str] | None  # safetensors files; None: seeded random init (ladder from scratch)
    train_ids: torch.Tensor  # 1-D token ids of the training split
    seq_len: int
    ladder_layers: list[int]
    config: TrainConfig
    only_laddered: bool = False
    seed: int = 0


@dataclass
class AdaptResult:
    """Rank 0's outcome: the loss curve and the adapted weights (model state_dict names)."""

    train: TrainResult
    state: dict[str, torch.Tensor]


def _adapt(job: AdaptJob, group: dist.ProcessGroup | None, on_step=None) -> AdaptResult:
    world = dist.get_world_size(group) if group is not None else 1
    model = build_unsharded(load_model_file(job.model_path), job.seed, job.weights)
    gm = lm_graph(model, job.config.batch_size // world, job.seq_len, job.ladder_layers)
    trainable = None
    if job.only_laddered:
        trainable = layer_parameters(gm, lm_structure(gm), job.ladder_layers)
    result = train(gm, TokenBlocks(job.train_ids, job.seq_len), job.config, trainable, on_step, group)
    return AdaptResult(result, state_dict_of(gm, model))


def adapt_rank(ctx: RankContext, job: AdaptJob) -> AdaptResult | None:
    """Per-rank entry of `run_adapt`: rank 0 returns the result, the others None."""
    torch.set_num_threads(1)
    out = _adapt(job, dist.group.WORLD)
    return out if ctx.rank == 0 else None


def run_adapt(
    job: AdaptJob,
    nproc: int = 1,
    on_step: Callable[[int, float, float], None] | None = None,
    timeout_s: float = 3600.0,
) -> AdaptResult:
    """Train `job` here (nproc 1, `on_step` called per step) or on `nproc` data-parallel gloo ranks
    (`runtime.launch.launch`; the curve arrives at the end). Raises InputError for a bad job,
    RunError when a rank fails."""
    if job.config.batch_size % nproc:
        raise InputError(f"--batch-size {job.config.batch_size} must divide by --nproc {nproc}")
    if nproc == 1:
        return _adapt(job, None, on_step)
    results = launch(adapt_rank, job, nproc, timeout_s=timeout_s, backend="gloo")
    return results[0]

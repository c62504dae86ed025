"""The solver's typed inputs and outputs, shared by its modules (this module imports no other solver one).

    WorkloadSpec + Constraints (user input) ─► MeshConfig per candidate ─► ILP ─► Assignment ─► Plan

- `WorkloadSpec`: what one step is (kind, batch, sequence, KV cache, micro-batches, dtype).
- `MeshConfig`: one candidate of the mesh search: the `MeshShape`, micro-batches per step and the
  pipeline `Schedule` it is priced with.
- `LadderMode`, `LadderPolicy`: which layers may use ladder residual; `LadderPolicy.parse` is the one
  parser of the `--ladder none|upper:N|auto|auto:max=N|auto:max-loss-increase=X%` option.
- `LadderBudget`: measured quality cost of laddering each layer, the allowed total and the sets
  already measured over it (the ILP's `ladder_loss` constraint and `ladder_nogood_*` cuts).
- `Constraints`: what the user pins or allows.
- `Assignment`: one solution: an option per op, the pipeline stages, the ladder and recomputed layers.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass, field

from costmodels.dtypes import DTYPE_BYTES
from costmodels.expert_parallel import DEFAULT_MOE_IMBALANCE
from planner.errors import InputError
from planner.plan import (
    CP_COMM_TYPES,
    DYNAMIC_LOSS_SCALE,
    EP_FOLDS,
    FP32_MAX,
    GRAD_REDUCE_DTYPES,
    WORKLOADS,
    DataParallel,
    MeshShape,
    Plan,
    Recompute,
    Schedule,
    Workload,
    dp_label,
    ep_text,
    is_static_loss_scale,
)

LADDER_MIN_SAVING_FRACTION = 0.05  # a laddered layer must save >= 5% of its time (it changes the model)
FEATURE_MIN_SAVING = 0.005  # relative saving each of SP / interleaving / ZeRO-1 must buy to be chosen


@dataclass(frozen=True)
class WorkloadSpec:
    """What one step is. Raises InputError naming the field for a value out of range."""

    kind: Workload  # forward (prefill), decode (one new token per sequence) or train
    batch_size: int  # global batch, sequences
    seq_len: int  # tokens per sequence (forward / train); ignored for decode (1 new token)
    context: int = 0  # decode: tokens already in the KV cache
    micro_batches: int | None = None  # None: the search chooses
    dtype: str | None = None  # None: the model's dtype
    # mixture-of-experts routing (--moe-imbalance, --moe-capacity-factor): the busiest expert-parallel
    # rank's rows over the mean (`costmodels.expert_parallel.DEFAULT_MOE_IMBALANCE`), and the capacity
    # factor of a model that drops the tokens beyond it (None: dropless); unused by dense models
    moe_imbalance: float = DEFAULT_MOE_IMBALANCE
    moe_capacity_factor: float | None = None
    # training: the dtype gradients are accumulated and reduced in (`planner.plan.Plan.grad_reduce_dtype`,
    # --grad-reduce-dtype): "param" (the parameters' dtype) or "fp32" (Megatron-LM's bf16 default)
    grad_reduce_dtype: str = "param"
    # fp16 training's loss scaling (`planner.plan.Plan.loss_scale`, --loss-scale): "auto" (dynamic when the
    # plan trains in fp16, else none), "dynamic", a static scale (a positive number), or None (none)
    loss_scale: float | str | None = "auto"

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise InputError(f"workload {self.kind!r} is not one of {list(WORKLOADS)}")
        object.__setattr__(self, "kind", Workload(self.kind))  # frozen: the one normalisation
        for name in ("batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise InputError(f"workload {name} must be >= 1, got {getattr(self, name)}")
        if self.context < 0 or (self.kind is Workload.DECODE and self.context < 1):
            raise InputError(
                f"workload context must be >= 1 for decode (KV-cache tokens), got {self.context}"
            )
        if self.micro_batches is not None and self.micro_batches < 1:
            raise InputError(f"workload micro_batches must be >= 1, got {self.micro_batches}")
        if self.dtype is not None and self.dtype not in DTYPE_BYTES:
            raise InputError(f"workload dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise InputError(
                f"--grad-reduce-dtype {self.grad_reduce_dtype!r} is not one of {list(GRAD_REDUCE_DTYPES)}"
            )
        if self.loss_scale not in (None, "auto", DYNAMIC_LOSS_SCALE) and not is_static_loss_scale(
            self.loss_scale
        ):
            raise InputError(
                f"--loss-scale {self.loss_scale!r} is not auto, dynamic, off or a positive number up to fp32's "
                f"largest ({FP32_MAX:.3g}; a static scale)"
            )
        if not self.moe_imbalance >= 1.0:
            raise InputError(
                f"--moe-imbalance must be >= 1 (the busiest expert-parallel rank's rows over the mean), got "
                f"{self.moe_imbalance}"
            )
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor >= 1.0:
            raise InputError(
                f"--moe-capacity-factor must be >= 1 (an expert's capacity over the mean rows per expert), got "
                f"{self.moe_capacity_factor}"
            )

    @property
    def train(self) -> bool:
        return self.kind is Workload.TRAIN

    def plan_loss_scale(self, dtype: str) -> float | str | None:
        """`Plan.loss_scale` for a plan in `dtype`: None unless it trains in fp16; there "auto" is dynamic."""
        if not self.train or dtype != "fp16" or self.loss_scale is None:
            return None
        return DYNAMIC_LOSS_SCALE if self.loss_scale == "auto" else self.loss_scale

    @property
    def tokens_per_sequence(self) -> int:
        """New tokens processed per sequence in one step."""
        return 1 if self.kind is Workload.DECODE else self.seq_len

    @property
    def kv_len(self) -> int:
        """Keys/values each query attends to."""
        return self.context + 1 if self.kind is Workload.DECODE else self.seq_len


def plan_workload_options(plan: Plan) -> dict[str, float | str | None]:
    """The routing, the loss scaling and the gradient reduction's dtype a plan was priced with, as `WorkloadSpec` keywords
    (re-pricing it uses them again)."""
    return {
        "moe_imbalance": plan.moe_imbalance,
        "moe_capacity_factor": plan.moe_capacity_factor,
        "grad_reduce_dtype": plan.grad_reduce_dtype if plan.workload == "train" else "param",
        "loss_scale": plan.loss_scale,
    }


@dataclass(frozen=True)
class MeshConfig:
    """One candidate of the mesh search: where the step runs and how it is pipelined."""

    mesh: MeshShape
    micro_batches: int  # per step and DP replica (1 without pipelining, except for training)
    schedule: Schedule = Schedule.ONE_F_ONE_B  # decides the activations a stage holds (training)
    virtual_stages: int = 1  # interleaved 1F1B: model chunks per pipeline rank (v)
    sequence_parallel: bool = False  # norm/dropout regions split along the sequence over the TP ranks
    # training: how the DP ranks hold parameters, gradients and Adam state (`DataParallel`)
    dp_style: DataParallel = DataParallel.DDP
    dp_shard: int | None = None  # ranks each sharded state is split over; None: every DP rank
    reshard_after_forward: bool = True  # fsdp: gather each unit again for its backward
    # communication overlap (`planner.plan.Plan`'s fields of the same names): TP collectives in chunks
    # under the GEMMs beside them; DP gradient reduction per bucket during backward; zero1 / zero2
    # parameter all-gather per bucket, waited for at its first use in the next forward
    tp_comm_overlap: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # context parallelism (mesh.cp > 1; `planner.plan.Plan`'s fields of the same names): how attention
    # reaches the other CP ranks' keys and values (`CP_COMM_TYPES`) and whether a causal sequence is cut
    # into 2 x cp chunks, rank r holding chunks r and 2cp-1-r (`passes.context_parallel`); unused at cp 1
    cp_comm_type: str = "allgather"
    cp_load_balance: bool = True
    # expert parallelism (`planner.plan.Plan`'s fields of the same names): the ranks each MoE layer's
    # experts are split over, folded over the dp x cp ranks ("dp") or the TP ranks ("tp"); 1: off
    ep: int = 1
    ep_fold: str = "dp"
    # expert tensor parallelism (`planner.plan.Plan.expert_tp`; ep_fold "dp" or ep 1): 1 keeps every routed
    # expert whole on each TP rank (replicated work), mesh.tp splits each over the TP ranks as a Megatron MLP
    expert_tp: int = 1

    @property
    def num_devices(self) -> int:
        return self.mesh.num_devices

    @property
    def distributed_optimizer(self) -> bool:
        """Adam's state is sharded over the DP ranks (ZeRO-1 or more)."""
        return self.dp_style.shards_optimizer

    @property
    def shard_degree(self) -> int:
        """DP ranks each sharded state is split over: 1 for ddp, `dp_shard` (default every DP rank); with
        context parallelism each shard group also holds the cp ranks of its DP ranks (`CostContext.state_shards`)."""
        if self.dp_style is DataParallel.DDP:
            return 1
        return self.mesh.dp if self.dp_shard is None else self.dp_shard

    def dp_label(self) -> str:
        """The DP style as the layout label writes it: "zero1", "fsdp", "fsdp-noreshard", "hsdp 4x2"
        (`planner.plan.dp_label`; a sharded style keeps its name at dp=1)."""
        if self.dp_style is not DataParallel.FSDP or self.mesh.dp * self.mesh.cp == 1:
            return str(self.dp_style)
        cp = self.mesh.cp  # sharded states span the CP ranks too (`planner.plan.MeshShape`)
        return dp_label(self.dp_style, self.mesh.dp * cp, self.shard_degree * cp, self.reshard_after_forward)

    def layout_label(self) -> str:
        """What runs beside the mesh: "interleaved_1f1b v=2, sp, zero1" ("" for none of them)."""
        parts = [f"{self.schedule} v={self.virtual_stages}"] if self.virtual_stages > 1 else []
        parts += [self.cp_label()] if self.mesh.cp > 1 else []
        parts += [f"ep {self.ep_label()}"] if self.ep > 1 else []
        parts += [f"experts split over tp {self.expert_tp}"] if self.ep == 1 and self.expert_tp > 1 else []
        parts += ["sp"] if self.sequence_parallel else []
        parts += [self.dp_label()] if self.dp_style is not DataParallel.DDP else []
        parts += [name for name, on in self.overlap_flags().items() if on]
        return ", ".join(parts)

    def cp_label(self) -> str:
        """The context-parallel attention as the layout label writes it: "cp allgather", "cp ring
        unbalanced" ("" at cp 1)."""
        if self.mesh.cp == 1:
            return ""
        return f"cp {self.cp_comm_type}" + ("" if self.cp_load_balance else " unbalanced")

    def ep_label(self) -> str:
        """Expert parallelism as the layout table writes it: "off", "8 over dp", "2 over tp", "8 over dp,
        experts split over tp 4", "off, experts split over tp 4" (`planner.plan.ep_text`)."""
        return ep_text(self.ep, self.ep_fold, self.expert_tp, self.mesh.cp)

    def overlap_flags(self) -> dict[str, bool]:
        """The communication-overlap choices by their Megatron-LM flag names (without dashes)."""
        return {
            "tp-comm-overlap": self.tp_comm_overlap,
            "overlap-grad-reduce": self.overlap_grad_reduce,
            "overlap-param-gather": self.overlap_param_gather,
        }

    def label(self) -> str:
        """'tp=8 pp=2 dp=1 m=4', with the layout in brackets when there is one (as `MeshCandidate.label`)."""
        layout = self.layout_label()
        return f"{self.mesh.label()} m={self.micro_batches}" + (f" [{layout}]" if layout else "")


class LadderMode(str, enum.Enum):
    """Which layers may use ladder residual connections."""

    NONE = "none"  # no layer
    UPPER = "upper"  # exactly the upper `count` layers
    AUTO = "auto"  # the solver's choice among the upper `count` layers (contiguous with the top,
    # or any subset of them under a measured loss budget, `LadderBudget`)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class LadderPolicy:
    """Which layers may use ladder residual: none, exactly the upper N, or the solver's choice of the upper N."""

    mode: LadderMode = LadderMode.NONE
    count: int | None = None  # upper: exactly this many; auto: at most this many (None: every layer)
    # auto only: the largest measured held-out loss increase allowed, a fraction of the standard
    # model's loss (0.01 = 1%); None: no quality budget. The CLI measures it (`--data`).
    max_loss_increase: float | None = None

    @classmethod
    def parse(cls, text: str, option: str = "ladder") -> LadderPolicy:
        """'none' | 'upper:N' | 'auto' | 'auto:max=N' | 'auto:max-loss-increase=X%' (also
        'auto:max=N,max-loss-increase=X%'; X a percentage). Raises InputError naming `option` (e.g. "--ladder")."""
        text = text.strip()
        if text == "none":
            return cls(LadderMode.NONE, 0)
        if text == "auto":
            return cls(LadderMode.AUTO, None)
        m = re.fullmatch(
            r"upper:(\d+)|auto:(?:max=(\d+)|max-loss-increase=(\d*\.?\d+)%|max=(\d+),max-loss-increase=(\d*\.?\d+)%)",
            text,
        )
        if m is None:
            raise InputError(
                f"{option} must be none, upper:N, auto, auto:max=N (N layers) or auto:max-loss-increase=X% "
                f"(X: percent of the standard model's held-out loss), got {text!r}"
            )
        if m.group(1):
            if int(m.group(1)) == 0:
                raise InputError(
                    f"{option} upper:0 ladders no layer: use {option} none (or upper:N with N >= 1)"
                )
            return cls(LadderMode.UPPER, int(m.group(1)))
        count = m.group(2) or m.group(4)
        if count is not None and int(count) == 0:
            raise InputError(
                f"{option} auto:max=0 allows no layer: use {option} none (or auto:max=N with N >= 1)"
            )
        budget = m.group(3) or m.group(5)
        return cls(
            LadderMode.AUTO,
            int(count) if count is not None else None,
            float(budget) / 100 if budget is not None else None,
        )

    def __str__(self) -> str:
        if self.mode is LadderMode.NONE:
            return "none"
        if self.mode is LadderMode.UPPER:
            return f"upper:{self.count}"
        parts = ([f"max={self.count}"] if self.count is not None else []) + (
            [f"max-loss-increase={self.max_loss_increase * 100:g}%"]
            if self.max_loss_increase is not None
            else []
        )
        return "auto" + (":" + ",".join(parts) if parts else "")

    def for_layers(self, num_layers: int) -> LadderPolicy:
        """This policy on a model of `num_layers` layers (count resolved). Raises InputError if it
        asks for more layers than the model has."""
        if self.mode is LadderMode.NONE:
            return LadderPolicy(LadderMode.NONE, 0)
        if num_layers == 0 and self.mode is LadderMode.AUTO and self.count is None:
            return LadderPolicy(LadderMode.NONE, 0)  # auto: nothing to ladder
        if num_layers == 0:
            raise InputError(
                f"ladder {str(self)!r}: the model has no transformer layers (attention and MLP blocks) whose "
                "all-reduces ladder residual could overlap; use --ladder none"
            )
        if self.count is not None and self.count > num_layers:
            form = "upper:N" if self.mode is LadderMode.UPPER else "auto:max=N"
            raise InputError(
                f"ladder {str(self)!r}: the model has only {num_layers} layers; use {form} with N from 1 to {num_layers}"
            )
        return LadderPolicy(
            self.mode, num_layers if self.count is None else self.count, self.max_loss_increase
        )

    def eligible(self, num_layers: int) -> list[int]:
        """Layers that may (auto) or must (upper) be laddered: the top `count` (all for auto without max)."""
        if self.mode is LadderMode.NONE:
            return []
        count = num_layers if self.count is None else min(self.count, num_layers)
        return list(range(num_layers - count, num_layers))


@dataclass(frozen=True)
class LadderBudget:
    """A quality budget for the ladder (auto mode): the ILP keeps sum_l per_layer[l] * lad[l] <= limit
    (`ladder_loss`) and excludes each set of `excluded` exactly (`ladder_nogood_*`: a set whose
    combined loss increase was measured over the limit although its per-layer sum was not).

    per_layer: measured loss increase of laddering layer l alone, a fraction of the standard loss
    (negative values count as 0). Raises InputError for a negative limit.
    """

    per_layer: dict[int, float]
    limit: float
    excluded: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.limit >= 0:
            raise InputError(f"the ladder loss budget must be >= 0, got {self.limit}")

    def cost(self, layer: int) -> float:
        """Layer `layer`'s share of the budget (0 for an unmeasured layer or a negative increase)."""
        return max(0.0, self.per_layer.get(layer, 0.0))

    def predicted(self, layers: list[int]) -> float:
        """The linear estimate of laddering `layers` together: the sum of their shares."""
        return sum(self.cost(i) for i in layers)

    def excluding(self, layers: list[int]) -> LadderBudget:
        """This budget with the set `layers` excluded too."""
        return LadderBudget(self.per_layer, self.limit, (*self.excluded, tuple(sorted(layers))))


LAYOUTS = ("auto", "megatron")  # `Constraints.layout` (--layout)


@dataclass(frozen=True)
class Constraints:
    """What the user pins or allows. None = the search chooses. Raises InputError naming the field."""

    tp: int | None = None  # pinned tensor-parallel degree
    pp: int | None = None  # pinned pipeline-parallel degree
    dp: int | None = None  # pinned data-parallel degree
    cp: int | None = None  # pinned context-parallel degree (--cp); None: the search chooses
    # --cp-comm-type (`CP_COMM_TYPES`) and --cp-load-balance on|off; None: the search prices each
    cp_comm_type: str | None = None
    cp_load_balance: bool | None = None
    # expert parallelism (--ep, --ep-fold dp|tp; None: the search chooses, 1 turns it off)
    ep: int | None = None
    ep_fold: str | None = None
    # the plan is to run here (--run): the search leaves out what this runtime does not run and Megatron-Core
    # would (EP candidates keep dp_style ddp, the one style it runs EP with); otherwise it prices those
    # too, as an export runs them
    runs_here: bool = False
    # expert tensor parallelism (--expert-tp): 1 keeps the routed experts whole on every TP rank, the TP
    # degree splits them over the TP ranks (without EP, or with EP over dp); None: the search prices both
    expert_tp: int | None = None
    # the routed experts run through the expert pass (ep > 1 or split over TP), never as the model's own
    # expert code: set by `workflow.make_plan` where that code's working memory (an expert matrix gathered
    # per token and choice) does not fit a served request's prefill
    experts_rewritten: bool = False
    max_devices: int | None = None  # use at most this many devices (default: the whole cluster)
    ladder: LadderPolicy = LadderPolicy()  # `LadderPolicy.parse` reads the --ladder option
    schedule: Schedule | None = (
        None  # pipeline schedule (pp > 1); None: the search chooses 1F1B or interleaved
    )
    virtual_stages: int | None = None  # interleaved 1F1B chunks per rank; None: the search chooses
    sequence_parallel: bool | None = None  # None: the search chooses (priced both ways)
    recompute: Recompute | None = None  # every layer class; None: the ILP chooses per class
    distributed_optimizer: bool | None = None  # ZeRO-1; None: the search chooses (priced both ways)
    # data-parallel style (--dp-style); None: the search chooses among the styles `dp_styles` allows
    dp_style: DataParallel | None = None
    dp_shard: int | None = None  # --dp-shard: FSDP / HSDP shard degree; None: the search chooses
    reshard_after_forward: bool | None = None  # --reshard-after-forward on|off; None: the search chooses
    # communication overlap (--tp-comm-overlap, --overlap-grad-reduce, --overlap-param-gather on|off);
    # None: the search chooses (priced both ways)
    tp_comm_overlap: bool | None = None
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    tp_across_nodes: bool = False  # consider TP groups larger than a node (off: TP stays in a node)
    memory_fraction: float = 0.9  # share of device memory plans may use (rest: runtime, fragmentation)
    time_limit_s: float = 10.0  # CBC time limit per ILP
    search_time_limit_s: float = 60.0  # all ILPs together; candidates left unsolved are reported
    mip_gap: float = 0.01  # relative optimality gap at which CBC stops (1%; reported in SolverInfo.gap)
    ladder_min_saving_fraction: float = LADDER_MIN_SAVING_FRACTION
    # a split against Megatron-LM's pairing (row-parallel q/k/v/gate/up, column-parallel o/down) is kept
    # only when it saves this share of the step over the plan solved without such splits; None: the
    # ILP's choice stands (`planner.solver.search._prefer_megatron_pairing`)
    pairing_min_saving_fraction: float | None = 0.005
    ladder_budget: LadderBudget | None = None  # auto ladder: measured quality budget (`LadderBudget`)
    # split choices: "auto" the ILP's; "megatron" the hand-written Megatron-LM layout at the mesh's TP
    # degree (`baseline.megatron_choices`: column-parallel q/k/v/up/gate, row-parallel o/down,
    # vocab-parallel embedding and LM head), the rest (mesh, stages, recompute, ...) searched as usual
    layout: str = "auto"

    def _check_expert_tp(self) -> None:
        """--expert-tp N > 1 splits every routed expert over all N TP ranks (with or without EP over dp):
        refused in one line naming the numbers with --tp other than N or --ep-fold tp."""
        n = self.expert_tp
        if n is None or n == 1:
            return
        if self.tp is not None and n != self.tp:
            use = f"--expert-tp {self.tp} or 1" if self.tp > 1 else f"--expert-tp 1, or --tp {n}"
            raise InputError(
                f"--expert-tp {n} must be 1 (experts whole on every TP rank) or the TP degree --tp {self.tp} "
                f"(each expert split over all TP ranks); use {use}"
            )
        if self.ep_fold == "tp":
            raise InputError(
                f"--expert-tp {n} with --ep-fold tp: EP over the TP ranks already splits the experts between "
                "them (each TP rank holds E / tp whole experts); use --ep-fold dp, or --expert-tp 1"
            )

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep", "expert_tp", "max_devices"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InputError(f"constraint {name} must be >= 1, got {value}")
        if self.cp_comm_type is not None and self.cp_comm_type not in CP_COMM_TYPES:
            raise InputError(
                f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)} or auto, got {self.cp_comm_type!r}"
            )
        if self.cp == 1 and (self.cp_comm_type is not None or self.cp_load_balance is not None):
            flag = (
                f"--cp-comm-type {self.cp_comm_type}"
                if self.cp_comm_type is not None
                else f"--cp-load-balance {'on' if self.cp_load_balance else 'off'}"
            )
            raise InputError(
                f"{flag} sets how context parallelism runs, but --cp 1 turns it off: use --cp 2 or more, or leave "
                f"{flag.split()[0]} out"
            )
        if self.ep_fold is not None and self.ep_fold not in EP_FOLDS:
            raise InputError(f"--ep-fold must be one of {', '.join(EP_FOLDS)} or auto, got {self.ep_fold!r}")
        if self.ep == 1 and self.ep_fold is not None:
            raise InputError(
                f"--ep-fold {self.ep_fold} sets which ranks expert parallelism folds over, but --ep 1 turns it off: "
                "use --ep 2 or more, or leave --ep-fold out"
            )
        self._check_expert_tp()
        if not 0 < self.memory_fraction <= 1:
            raise InputError(f"constraint memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.time_limit_s <= 0:
            raise InputError(f"constraint time_limit_s must be > 0, got {self.time_limit_s}")
        if self.layout not in LAYOUTS:
            raise InputError(f"constraint layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if not isinstance(self.ladder, LadderPolicy):
            raise InputError(
                f"constraint ladder must be a LadderPolicy (LadderPolicy.parse), got {self.ladder!r}"
            )
        if self.dp_style is not None:
            if self.dp_style not in {s.value for s in DataParallel}:
                raise InputError(
                    f"constraint dp_style {self.dp_style!r} is not one of {[s.value for s in DataParallel]}"
                )
            object.__setattr__(self, "dp_style", DataParallel(self.dp_style))
            want = self.dp_style.shards_optimizer
            if self.distributed_optimizer is not None and self.distributed_optimizer != want:
                raise InputError(
                    f"--distributed-optimizer {'on' if self.distributed_optimizer else 'off'} contradicts "
                    f"--dp-style {self.dp_style} (which shards Adam's state: {'yes' if want else 'no'}); "
                    "give only --dp-style"
                )
        if self.tp_comm_overlap and self.ladder.mode is not LadderMode.NONE:
            raise InputError(
                f"--tp-comm-overlap on and --ladder {self.ladder} cannot be used together: ladder residual "
                "overlaps its blocks' all-reduces itself; pass --tp-comm-overlap off (or auto), or --ladder none"
            )
        if self.overlap_param_gather and self.overlap_grad_reduce is False:
            raise InputError(
                "--overlap-param-gather on needs --overlap-grad-reduce on (as Megatron-LM's: the parameter "
                "all-gather is issued per bucket of the overlapped gradient reduction); turn both on, or leave "
                "--overlap-grad-reduce auto"
            )
        self._check_overlap_pins()
        if self.dp_shard is not None and self.dp_shard < 1:
            raise InputError(f"constraint dp_shard (--dp-shard) must be >= 1, got {self.dp_shard}")
        if self.dp_shard is not None and self.dp_style not in (None, DataParallel.FSDP):
            raise InputError(
                f"--dp-shard {self.dp_shard} shards parameters (FSDP / HSDP) but --dp-style is {self.dp_style}; "
                "use --dp-style fsdp or leave it out"
            )
        if self.schedule is not None:
            if self.schedule not in {s.value for s in Schedule}:
                raise InputError(
                    f"constraint schedule {self.schedule!r} is not one of {[s.value for s in Schedule]}"
                )
            object.__setattr__(self, "schedule", Schedule(self.schedule))
        if self.recompute is not None:
            if self.recompute not in {r.value for r in Recompute}:
                raise InputError(
                    f"constraint recompute {self.recompute!r} is not one of {[r.value for r in Recompute]}"
                )
            object.__setattr__(self, "recompute", Recompute(self.recompute))
        if self.virtual_stages is not None:
            if self.virtual_stages < 1:
                raise InputError(f"constraint virtual_stages must be >= 1, got {self.virtual_stages}")
            if self.virtual_stages > 1 and self.schedule not in (None, Schedule.INTERLEAVED_1F1B):
                raise InputError(
                    f"constraint virtual_stages={self.virtual_stages} needs the interleaved_1f1b schedule, "
                    f"not {self.schedule}"
                )

    def _check_overlap_pins(self) -> None:
        """--overlap-param-gather on needs a style that all-gathers the parameters after the step
        (zero1 / zero2), --overlap-grad-reduce on one whose reduction it moves into the backward (ddp,
        zero1, zero2): a contradicting pin is an InputError naming both flags."""
        fsdp_pins = self.dp_shard is not None or self.reshard_after_forward is not None
        if self.overlap_param_gather:
            if self.dp_style in (DataParallel.DDP, DataParallel.FSDP):
                raise InputError(
                    f"--overlap-param-gather on contradicts --dp-style {self.dp_style}: only zero1 / zero2 "
                    "all-gather the parameters after the step; use --dp-style zero1 or zero2, or leave one out"
                )
            if self.distributed_optimizer is False:
                raise InputError(
                    "--overlap-param-gather on contradicts --distributed-optimizer off: only zero1 / zero2 "
                    "all-gather the parameters after the step; leave one out"
                )
            if fsdp_pins and self.dp_style is None:
                raise InputError(
                    "--overlap-param-gather on contradicts --dp-shard / --reshard-after-forward (fsdp): only "
                    "zero1 / zero2 all-gather the parameters after the step; leave one out"
                )
        if self.overlap_grad_reduce and (
            self.dp_style is DataParallel.FSDP or (fsdp_pins and self.dp_style is None)
        ):
            raise InputError(
                "--overlap-grad-reduce on contradicts --dp-style fsdp (--dp-shard / --reshard-after-forward), "
                "whose reduce-scatters always run from the backward; leave one out"
            )

    def dp_styles(self) -> list[DataParallel]:
        """The data-parallel styles the search may choose: the pinned one, else those that agree with
        --distributed-optimizer and --dp-shard, and with --overlap-param-gather on (zero1 / zero2) or
        --overlap-grad-reduce on (not fsdp)."""
        if self.dp_style is not None:
            return [self.dp_style]
        if self.dp_shard is not None or self.reshard_after_forward is not None:
            return [DataParallel.FSDP]
        if self.distributed_optimizer is False:
            return [DataParallel.DDP]
        if self.distributed_optimizer is True:
            return [DataParallel.ZERO1]
        if self.overlap_param_gather:
            return [DataParallel.ZERO1, DataParallel.ZERO2]
        if self.overlap_grad_reduce:
            return [DataParallel.DDP, DataParallel.ZERO1, DataParallel.ZERO2]
        return list(DataParallel)

    @property
    def pinned(self) -> dict[str, int]:
        """The pinned degrees by axis name ("tp", "cp", "pp", "dp"), in mesh order (innermost first)."""
        return {k: getattr(self, k) for k in ("tp", "cp", "pp", "dp") if getattr(self, k) is not None}


@dataclass
class Assignment:
    """One solution on one mesh: what the ILP returns, the baseline fixes, and the predictor prices."""

    choices: dict[tuple[str, str], str]  # (graph key, op name) -> option name, every op of every graph
    stages: list[list[int]]  # layers of each pipeline stage, contiguous and in order
    ladder_layers: list[int] = field(default_factory=list)
    recompute: dict[str, Recompute] = field(default_factory=dict)  # training: graph key -> recomputation
    # (a key not listed recomputes nothing)

    def recompute_of(self, key: str) -> Recompute:
        """The activation recomputation of layer class `key` (NONE when not listed)."""
        return self.recompute.get(key, Recompute.NONE)

    def option(self, key: str, op: str) -> str:
        """The option chosen for op `op` of graph `key`."""
        return self.choices[(key, op)]


def dp_style_variants(config: MeshConfig, constraints: Constraints) -> list[MeshConfig]:
    """`config` with every data-parallel style the constraints allow on its mesh: ddp, zero1, zero2,
    fsdp over every power-of-two shard degree dividing dp (below dp: HSDP), with and without reshard
    after forward (each as pinned); `config` itself when dp x cp == 1. With context parallelism every
    style spans the dp x cp ranks that hold the same weights (`MeshShape.dp_cp`): a shard degree is in
    DP ranks, each shard group holding its cp ranks too (so fsdp at dp 1 shards over the cp ranks)."""
    dp, cp = config.mesh.dp, config.mesh.cp
    if dp * cp == 1:
        return [config]
    out = []
    for style in constraints.dp_styles():
        if style is not DataParallel.FSDP:
            out.append(dataclasses.replace(config, dp_style=style, dp_shard=None, reshard_after_forward=True))
            continue
        shards = [constraints.dp_shard] if constraints.dp_shard is not None else _power_divisors(dp)
        pinned = constraints.reshard_after_forward
        reshards = [pinned] if pinned is not None else [True, False]
        for shard in shards:
            if shard * cp < 2 or dp % shard:
                continue
            for reshard in reshards:
                out.append(
                    dataclasses.replace(
                        config,
                        dp_style=style,
                        dp_shard=None if shard == dp else shard,
                        reshard_after_forward=reshard,
                    )  # fmt: skip
                )
    return out or [config]


def ep_refusal(experts: list[int], ep: int, fold: str, mesh: MeshShape, sequence_parallel: bool) -> str:
    """Why expert parallelism of degree `ep` folded over `fold` cannot run on `mesh` ("" when it can):
    ep must divide every layer's experts, and the dp x cp ranks it folds over (fold dp) or equal the
    TP degree, whose ranks then need the same tokens (fold tp: no sequence parallelism). One line
    naming both numbers, as `--why` and the pinned --ep's refusal say it."""
    bad = [e for e in experts if e % ep]
    if bad:
        return f"ep={ep} does not divide {bad[0]} experts"
    if fold == "tp":
        if mesh.tp != ep:
            return f"ep={ep} over tp needs tp={ep} (the EP group is the TP group), the mesh has tp={mesh.tp}"
        if sequence_parallel:
            return f"ep={ep} over tp: sequence parallelism splits the tokens the TP ranks must share"
        return ""
    if ep > mesh.dp_cp:
        return f"ep={ep} exceeds dp x cp = {mesh.dp_cp}"
    if mesh.dp_cp % ep:
        return f"ep={ep} does not divide dp x cp = {mesh.dp_cp}"
    return ""


def overlap_variants(config: MeshConfig, constraints: Constraints, train: bool) -> list[MeshConfig]:
    """`config` with every combination of the communication-overlap choices that means something on
    its mesh and the constraints allow: TP overlap with tp > 1; gradient reduction overlap when
    training with dp > 1 and ddp, zero1 or zero2 (fsdp's reduce-scatters always run from the backward,
    unit by unit); parameter-gather overlap with zero1 / zero2 (dp counts the cp ranks: dp x cp > 1).
    Pinned ones as pinned."""

    def choices(pinned: bool | None, meaningful: bool) -> list[bool]:
        if not meaningful:
            return [False]
        return [pinned] if pinned is not None else [False, True]

    dp_train = train and config.mesh.dp_cp > 1  # the CP ranks reduce their gradients as DP ranks do
    tp = choices(constraints.tp_comm_overlap, config.mesh.tp > 1)
    grad = choices(
        constraints.overlap_grad_reduce,
        dp_train and config.dp_style in (DataParallel.DDP, DataParallel.ZERO1, DataParallel.ZERO2),
    )
    gather = choices(
        constraints.overlap_param_gather,
        dp_train and config.dp_style in (DataParallel.ZERO1, DataParallel.ZERO2),
    )
    return [
        dataclasses.replace(config, tp_comm_overlap=t, overlap_grad_reduce=g, overlap_param_gather=a)
        for t in tp
        for g in grad
        for a in gather
        if g or not a  # as Megatron-LM: the parameter gather overlaps only with the gradient reduction
    ]


def _power_divisors(n: int) -> list[int]:
    """Divisors of n that are powers of two, and n itself, descending (HSDP shard degrees)."""
    out = {n} | {d for d in (2**k for k in range(1, n.bit_length())) if n % d == 0}
    return sorted(out, reverse=True)

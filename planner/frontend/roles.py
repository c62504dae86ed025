"""What a weight computes in its model: `Role`, and `Projection` (one matmul with a parameter weight).

Shared by the dense analysis (`planner.frontend.analysis`) and the mixture-of-experts recogniser
(`planner.frontend.moe`); `planner.frontend.analysis` re-exports both names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# Ops that count as an activation: the one between a SwiGLU gate and its product with up (its
# presence tells gate from up), priced by their measured rate (`analysis.activation_call`)
ACTIVATION_OPS = {
    "aten.silu", "aten.gelu", "aten.relu", "aten.sigmoid", "aten.tanh", "aten.erf", "aten.elu",
    "aten.leaky_relu", "aten.hardswish", "aten.mish", "aten.softplus",
}  # fmt: skip


class Role(str, enum.Enum):
    """What a projection computes in its model (found by dataflow, rules in `planner.frontend.analysis`
    and, for mixtures of experts, `planner.frontend.moe`)."""

    Q = "q"  # attention query
    K = "k"  # attention key
    V = "v"  # attention value
    QKV = "qkv"  # fused query, key and value (`Projection.parts` gives the sizes)
    O = "o"  # noqa: E741 - attention output, the projection's conventional name
    UP = "up"  # MLP up projection (the only first projection of a 2-matmul MLP)
    GATE = "gate"  # SwiGLU gate: goes through the activation before the product with up
    DOWN = "down"  # MLP down projection, back to the stream width
    FC = "fc"  # a linear of a plain MLP chain, or an MLP projection that fits none of the above
    LM_HEAD = "lm_head"  # the output projection onto the vocabulary
    ROUTER = "router"  # a mixture-of-experts router: a linear to the expert logits, then top-k
    # a linear to one output per token that scales a branch (Qwen2-MoE's `shared_expert_gate`, a sigmoid
    # of it times the shared expert's output; Megatron-Core's `moe_shared_expert_gate`): kept whole
    TOKEN_GATE = "token_gate"
    # a low-rank down projection whose output feeds only the attention's query / key / value
    # projections and core (multi-head latent attention's `q_a_proj`, `kv_a_proj_with_mqa`: DeepSeek-V2
    # and V3): kept whole under TP, as Megatron-Core's MLA (`linear_q_down_proj`, `linear_kv_down_proj`
    # not split) and DeepSeek's reference model (`wq_a`, `wkv_a`, plain `Linear`) keep it
    LATENT = "latent"
    # the routed experts' weights (`planner.frontend.moe.ExpertWeight`), each expert a SwiGLU or
    # 2-matmul MLP: the same three roles as a dense MLP's, for every one of the E experts
    EXPERT_GATE = "expert_gate"
    EXPERT_UP = "expert_up"
    EXPERT_GATE_UP = "expert_gate_up"  # gate and up fused in one matrix (HF `gate_up_proj`: parts)
    EXPERT_DOWN = "expert_down"

    def __str__(self) -> str:
        return self.value


EXPERT_ROLES = frozenset({Role.EXPERT_GATE, Role.EXPERT_UP, Role.EXPERT_GATE_UP, Role.EXPERT_DOWN})


@dataclass
class Projection:
    """One matmul with a parameter weight."""

    node: str  # fx node name of the matmul (aten.linear / aten.addmm / aten.mm / aten.matmul)
    weight: str  # parameter FQN
    bias: str | None
    role: Role | None  # None: a projection outside the layers that is not the LM head
    in_features: int
    out_features: int
    weight_out_dim: int  # 0 for nn.Linear (out, in), 1 for HF Conv1D (in, out)
    parts: tuple[int, ...] | None  # fused projection: out sizes of its parts, e.g. (768, 768, 768)
    flops: float  # per forward pass, global
    # a LoRA adapter beside this projection (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large
    # Language Models"; PEFT's LoraLayer): `Adapter.down` (in -> r) and `Adapter.up` (r -> out) on the
    # same input, their product added to this projection's output. Planned with it: split as its
    # shard needs (`Adapter.splits`), priced in its options (`planner.solver.costing`).
    adapter: Adapter | None = None
    # fx node name of the tensor the matmul reads, followed back through views (`analysis._projection`):
    # projections that read one tensor store it once for backward; None when not analysed from a graph
    input: str | None = None

    def __post_init__(self) -> None:
        if self.role is not None:
            self.role = Role(self.role)  # ValueError for a string that names no role


@dataclass
class Adapter:
    """A low-rank adapter of a projection (`Projection.adapter`): ``down`` (in_features -> rank, no
    bias) on the projection's input, then ``up`` (rank -> out_features, no bias), added (scaled) to the
    projection's output. Under tensor parallelism it follows its projection's split: beside a
    column-parallel projection ``down`` is replicated and ``up`` column-parallel (its output sharded as
    the projection's); beside a row-parallel one ``down`` is row-parallel (its (tokens, rank) partial
    sums all-reduced) and ``up`` replicated (NeMo's LoRA adapters on Megatron's parallel linears)."""

    down: Projection
    up: Projection
    # the fx nodes between them and the projection's output: the input's dropout, the update's
    # scaling and casts, and the add that joins it (priced with the adapter, not as the layer's ops)
    path: tuple[str, ...] = ()

    @property
    def rank(self) -> int:
        return self.down.out_features

    @property
    def nodes(self) -> tuple[str, ...]:
        """The adapter's fx nodes: its two GEMMs and `path`."""
        return (self.down.node, self.up.node, *self.path)

    def param_elements(self) -> int:
        return self.down.in_features * self.rank + self.rank * self.up.out_features

    def splits(self, style: str) -> tuple[str, str]:
        """(down's, up's) split style beside a projection split ``style`` ("replicate", "colwise",
        "rowwise", "vocab")."""
        if style in ("colwise", "vocab"):
            return "replicate", "colwise"
        if style == "rowwise":
            return "rowwise", "replicate"
        return "replicate", "replicate"

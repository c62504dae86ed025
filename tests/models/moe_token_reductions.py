"""Test model: reductions over every token of the batch flattened into one dim, as MoE blocks write
them: a load-balancing loss `probs.mean(0)` over (B * T, E) added to the output (`ROUTING=aux`), or
expert-choice routing (Zhou et al. 2022), each expert taking its top-C tokens by `topk(probs.t(), C)`
over (E, B * T) (`ROUTING=expert_choice`). Both make a sample's outputs depend on the other samples:
halves of the batch compute other values than the whole."""

import os

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, E = 64, 32, 4


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.routing = os.environ.get("ROUTING", "aux")
        self.emb = nn.Embedding(VOCAB, DIM)
        self.router = nn.Linear(DIM, E, bias=False)
        self.experts = nn.Parameter(torch.randn(E, DIM, DIM) * DIM**-0.5)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        B, T, C = x.shape
        flat = x.view(-1, C)  # (B * T, C)
        probs = F.softmax(self.router(flat), dim=-1)
        if self.routing == "expert_choice":
            weight, idx = torch.topk(probs.t(), flat.shape[0] // 2, dim=-1)  # each expert's tokens
            out = torch.zeros_like(flat)
            for e in range(E):
                out = out.index_add(0, idx[e], weight[e, :, None] * (flat[idx[e]] @ self.experts[e]))
        else:
            top = probs.argmax(-1)
            out = torch.einsum("nc,ncd->nd", flat, self.experts[top]) * probs.max(-1).values[:, None]
            aux = (probs.mean(0) * E).pow(2).sum()  # a load-balancing penalty over the batch's tokens
            out = out + aux
        return self.head((flat + out).view(B, T, C))


def build_model() -> Model:
    torch.manual_seed(0)
    return Model()


def example_inputs(batch_size: int = 2, seq_len: int = 8) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch_size, seq_len), generator=torch.Generator().manual_seed(0)),)

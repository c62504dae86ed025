"""Test model: router jitter as Hugging Face Mixtral writes it in training (`router_jitter_noise`): the
router's input multiplied by `torch.empty_like(x).uniform_(1 - eps, 1 + eps)`, plus Gaussian noise
(`torch.randn_like`) on an activation. Data-parallel ranks draw other numbers than the unsharded
reference, so the numerics check runs each draw at its expectation (1 and 0), as dropout off."""

import torch
from torch import nn

VOCAB, DIM = 64, 32


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.router, self.up, self.down = nn.Linear(DIM, 4), nn.Linear(DIM, 64), nn.Linear(64, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        if self.training:
            x = x * torch.empty_like(x).uniform_(0.9, 1.1)
        gate = torch.softmax(self.router(x), dim=-1)[..., :1]
        h = torch.relu(self.up(x))
        if self.training:
            h = h + 0.01 * torch.randn_like(h)
        return self.head(x + gate * self.down(h))


def build_model() -> Model:
    torch.manual_seed(0)
    return Model()


def example_inputs(batch_size: int = 2, seq_len: int = 8) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch_size, seq_len), generator=torch.Generator().manual_seed(0)),)

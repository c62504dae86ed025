"""Test model: an auxiliary loss added in backward by a `torch.autograd.Function` (DeepSeek-V2's
Hugging Face `AddAuxiliaryLoss`: forward returns x unchanged, backward gives the auxiliary loss a
gradient of 1). torch.export traces the Function's forward and differentiates that, so the captured
graph has no gradient for the auxiliary loss: `build_model(differentiable=True)` writes the same
trick with differentiable ops, `x + (aux - aux.detach())`, which the capture keeps."""

import torch
from torch import nn


class AddAuxiliaryLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones((), dtype=grad.dtype)


class Model(nn.Module):
    def __init__(self, differentiable: bool = False) -> None:
        super().__init__()
        self.differentiable = differentiable
        self.gate = nn.Linear(16, 4, bias=False)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        aux = 10.0 * self.gate(x).softmax(-1).pow(2).mean()  # a load-balancing-like penalty on the router
        h = self.up(x)
        h = h + (aux - aux.detach()) if self.differentiable else AddAuxiliaryLoss.apply(h, aux)
        return self.down(torch.relu(h))


def build_model(differentiable: bool = False) -> Model:
    torch.manual_seed(0)
    return Model(differentiable)


def example_inputs(batch_size: int = 2, seq_len: int = 8) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, seq_len, 16, generator=torch.Generator().manual_seed(0)),)

"""Test model: a learned position table looked up at positions counted from the attention mask
(cumsum) and offset by 2, as Hugging Face OPT's `OPTLearnedPositionalEmbedding` does, 32 rows. At
--seq-len 31 or more the lookup runs past the table: planning on meta tensors cannot tell, and a run
stopped on an IndexError traceback from inside torch."""

import torch
from torch import nn

VOCAB, DIM, POSITIONS, OFFSET = 64, 32, 32, 2


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Embedding(POSITIONS, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: (B, T) -> logits (B, T, VOCAB)
        mask = torch.ones_like(ids)
        positions = torch.cumsum(mask, dim=1) - 1 + OFFSET
        x = self.tokens(ids) + self.positions(positions)
        return self.head(x + self.down(torch.relu(self.up(x))))


def build_model() -> nn.Module:
    return Model()


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    return (torch.randint(0, VOCAB, (batch_size, seq_len)),)

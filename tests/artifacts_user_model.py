"""A user torch module for tests/test_artifacts.py (`model.kind: torch`,
`model.path: artifacts_user_model:TinyNet`, found through PYTHONPATH)."""

import torch
from torch import nn


class TinyNet(nn.Module):
    def __init__(self, hidden: int = 8, classes: int = 10):
        super().__init__()
        self.body = nn.Linear(64, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


class TokenBag(nn.Module):
    """Averaged token embeddings -> classes: int64 ids straight from the shards, no cast."""

    def __init__(self, vocab: int = 100, width: int = 8, classes: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(dim=1))

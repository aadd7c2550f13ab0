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


class SmallCNN(nn.Module):
    """A user's CNN on the 8x8 digits: two convolutions, max pooling, a linear head."""

    def __init__(self, channels: int = 8, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
        )
        self.head = nn.Linear(2 * channels * 16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.reshape(-1, 1, 8, 8)).flatten(1))


class TokenLM(nn.Module):
    """Next-token logits from each token's embedding alone (a bigram model), as
    [batch, vocab, time]: pretrained on text, its embedding is what TokenBag
    fine-tunes on labels (tests/test_pretrained.py)."""

    def __init__(self, vocab: int = 256, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lm_head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.embed(x)).transpose(1, 2)

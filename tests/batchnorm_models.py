"""User torch modules with BatchNorm and Dropout for tests/test_batchnorm.py
(`model.kind: torch`, `model.path: batchnorm_models:Class`, found through PYTHONPATH)."""

import torch
from torch import nn


class BatchNormCNN(nn.Module):
    """A ResNet-style CNN on the 8x8 digits: convolutions without bias, each
    followed by BatchNorm2d, a residual block, Dropout before the linear head."""

    def __init__(self, channels: int = 4, classes: int = 10, dropout: float = 0.0):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
        )
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(channels * 16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x.reshape(-1, 1, 8, 8))
        h = nn.functional.max_pool2d(torch.relu(h + self.block(h)), 2)
        return self.head(self.drop(h.flatten(1)))


class BatchNormMLP(nn.Module):
    """Linear (no bias: BatchNorm cancels it), BatchNorm1d, ReLU, Dropout, Linear."""

    def __init__(self, hidden: int = 16, classes: int = 10, dropout: float = 0.0):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(dropout))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class RefusedBatchNorm(nn.Module):
    """BatchNorm1d with momentum=None (a cumulative average) or track_running_stats=False, which ortflow refuses."""

    def __init__(self, **norm):
        super().__init__()
        self.body = nn.Linear(64, 8)
        self.norm = nn.BatchNorm1d(8, **norm)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))


class TwinBatchNorms(nn.Module):
    """Two branches of equal fresh parameters: Linear layers with zero biases, each
    into its own BatchNorm1d (weights of ones, biases of zeros), summed. With
    `eval_only`, train() keeps the module in eval mode (as modules that freeze
    their BatchNorms do), so that torch.onnx exports it in eval mode."""

    def __init__(self, hidden: int = 8, classes: int = 10, eval_only: bool = False):
        super().__init__()
        self.eval_only = eval_only
        self.left, self.right = nn.Linear(64, hidden), nn.Linear(64, hidden)
        for layer in (self.left, self.right):
            nn.init.zeros_(layer.bias)
        self.left_norm, self.right_norm = nn.BatchNorm1d(hidden), nn.BatchNorm1d(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.left_norm(self.left(x))) + torch.relu(self.right_norm(self.right(x))))

    def train(self, mode: bool = True) -> "TwinBatchNorms":
        return super().train(mode and not self.eval_only)

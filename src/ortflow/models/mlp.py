"""`model.kind: mlp`: a multilayer perceptron for tabular data and digits."""

from __future__ import annotations

import math

import torch
from torch import nn


class MLP(nn.Module):
    """Flattens its one input, then Linear+ReLU per hidden size, then a Linear
    head whose outputs are reshaped to `out_shape` per sample."""

    def __init__(self, in_shape: list[int], hidden: list[int], out_shape: list[int]):
        super().__init__()
        sizes = [math.prod(in_shape), *hidden]
        layers: list[nn.Module] = []
        for fan_in, fan_out in zip(sizes, sizes[1:]):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        layers.append(nn.Linear(sizes[-1], math.prod(out_shape)))
        self.layers = nn.Sequential(*layers)
        self.out_shape = list(out_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x.flatten(1).float()).reshape(-1, *self.out_shape)

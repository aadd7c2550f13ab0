"""`model.kind: cnn`: a small SqueezeNet-style network for images.

Like SqueezeNet (Iandola et al. 2016, the model of ONNX Runtime's training
examples): a stem convolution, Fire modules (a 1x1 "squeeze" convolution feeding
parallel 1x1 and 3x3 "expand" convolutions whose outputs are concatenated),
max pooling, and a 1x1 convolution to the classes averaged over the image
instead of a dense head. No batch norm or dropout, so that training and
evaluation compute the same function.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import ModelError


def image_shape(feature_shape: list[int]) -> tuple[int, int, int]:
    """Channels, height, width of a sample: [C, H, W] as is, [H, W] as one
    channel, and a flat [N] with N a square (digits: 64 = 8x8) as one square channel."""
    if len(feature_shape) == 3:
        return tuple(feature_shape)
    if len(feature_shape) == 2:
        return (1, *feature_shape)
    side = math.isqrt(math.prod(feature_shape))
    if len(feature_shape) == 1 and side * side == feature_shape[0]:
        return (1, side, side)
    raise ModelError(
        f"model.kind 'cnn' needs image features: shape [C, H, W], [H, W] or a flat square [N]; "
        f"the data's feature has shape {feature_shape}"
    )


class Fire(nn.Module):
    def __init__(self, in_channels: int, squeeze: int, expand: int):
        super().__init__()
        self.squeeze = nn.Conv2d(in_channels, squeeze, 1)
        self.expand1x1 = nn.Conv2d(squeeze, expand, 1)
        self.expand3x3 = nn.Conv2d(squeeze, expand, 3, padding=1)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.squeeze(x))
        return torch.cat([self.relu(self.expand1x1(x)), self.relu(self.expand3x3(x))], dim=1)


class SqueezeNet(nn.Module):
    """base = model.width // 8 channels in the stem; the Fire modules widen to 2x and 4x base."""

    def __init__(self, feature_shape: list[int], out_shape: list[int], base: int):
        super().__init__()
        self.image = image_shape(feature_shape)
        self.out_shape = list(out_shape)
        channels = self.image[0]
        self.features = nn.Sequential(
            nn.Conv2d(channels, base, 3, padding=1),
            nn.ReLU(),
            Fire(base, base // 2 or 1, base),
            nn.MaxPool2d(2, ceil_mode=True),
            Fire(2 * base, base // 2 or 1, 2 * base),
        )
        # SqueezeNet puts a ReLU here; without it the logits can be negative, which trains faster.
        self.classifier = nn.Conv2d(4 * base, math.prod(out_shape), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().reshape(-1, *self.image)
        return self.classifier(self.features(x)).mean(dim=(2, 3)).reshape(-1, *self.out_shape)

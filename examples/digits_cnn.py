"""A model of your own that is not transformers': a small CNN over the default
run's 8x8 handwritten digits, trained as `model.kind: torch` (config/digits_cnn.yaml).

ortflow imports the class named by `model.path` ("examples.digits_cnn:DigitsCNN",
from the folder Snakemake runs in), builds it with `model.kwargs`, and exports it
to ONNX; nothing else of yours runs. `forward` takes the data's features in
`data.features` order (the digits have one, `x`: 64 floats a row) and returns
the logits. Its convolutions make `export.quantize: auto` quantize it statically.

    snakemake --cores all --configfile config/digits_cnn.yaml
"""

from __future__ import annotations

from torch import nn


class DigitsCNN(nn.Module):
    def __init__(self, channels: int = 16, classes: int = 10, dropout: float = 0.1):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * channels * 16, classes))

    def forward(self, x):
        return self.head(self.features(x.view(-1, 1, 8, 8)))

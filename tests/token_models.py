"""A user torch module for token classification (`model.kind: torch`,
`model.path: token_models:TokenTagger`, found through PYTHONPATH), used by
tests/test_token_classification.py: one score per class for every token."""

from __future__ import annotations

import torch
from torch import nn


class TokenTagger(nn.Module):
    """Token (and token-type) embeddings, zeroed where the attention mask is 0, a
    convolution over each token's neighbours (a tag depends on the words around
    it: I- follows B-), then a linear layer to the classes. The logits are
    [batch, classes, time], the layout of cross-entropy over a [batch, time] label."""

    def __init__(self, vocab_size: int, classes: int, width: int = 32):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width)
        self.types = nn.Embedding(2, width)
        self.context = nn.Conv1d(width, width, kernel_size=3, padding=1)
        self.head = nn.Linear(width, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None):
        embedded = self.tokens(input_ids)
        if token_type_ids is not None:
            embedded = embedded + self.types(token_type_ids)
        if attention_mask is not None:
            embedded = embedded * attention_mask.unsqueeze(-1).float()
        mixed = torch.relu(self.context(embedded.transpose(1, 2))).transpose(1, 2)
        return self.head(mixed + embedded).transpose(1, 2)

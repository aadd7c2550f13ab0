"""`model.kind: gpt`: a GPT-2-style decoder for byte-level language modelling.

Token and position embeddings, `layers` pre-LayerNorm blocks (causal
self-attention, then a GELU MLP, each around a residual), a final LayerNorm and
a head to the vocabulary that shares the token embedding when `tied`.

The logits come out as [batch, vocab, time], not the usual [batch, time, vocab]:
ONNX's SoftmaxCrossEntropyLoss takes the classes in dimension 1 ([N, C, d1])
with labels [N, d1], so next-token cross-entropy needs no reshape of either.
No dropout, so that training and evaluation compute the same function.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, context: int):
        super().__init__()
        self.heads, self.width, self.context = heads, width, context
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Sizes from the config, not from x.shape, and -1 for the batch: the
        # exported Reshapes then have constant shapes, which shape inference
        # (and so the FLOP count) can follow.
        time, width = self.context, self.width
        head_width = width // self.heads
        q, k, v = (
            t.reshape(-1, time, self.heads, head_width).transpose(1, 2) for t in self.qkv(x).split(width, dim=2)
        )
        scores = q @ k.transpose(2, 3) / math.sqrt(head_width)
        future = torch.ones(time, time, dtype=torch.bool).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(-1, time, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, context: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, context)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, heads: int, layers: int, tied: bool):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.context = context
        self.blocks = nn.Sequential(*(Block(width, heads, context) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.tokens.weight
        # GPT-2's initialisation: small normal weights keep the first losses near log(vocab).
        for name, parameter in self.named_parameters():
            if name.endswith("weight") and parameter.dim() == 2:
                nn.init.normal_(parameter, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(self.context))
        return self.head(self.ln_f(self.blocks(x))).transpose(1, 2)

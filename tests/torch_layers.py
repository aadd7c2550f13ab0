"""User torch modules for tests/test_torch_layers.py (`model.kind: torch`,
`model.path: torch_layers:LayerNet`, found through PYTHONPATH): int64 token ids
-> nn.Embedding -> one layer under test -> mean over the tokens -> a linear head."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

HEADS = 2


class Attention(nn.Module):
    """Self-attention written with F.scaled_dot_product_attention: causal, or
    with a boolean mask that hides the padding tokens (id 0) from every query."""

    def __init__(self, width: int, mask: str):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.mask = mask

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = (t.reshape(batch, time, HEADS, width // HEADS).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if self.mask == "causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=(ids != 0)[:, None, None, :])
        return y.transpose(1, 2).reshape(batch, time, width)


class MultiheadAttention(nn.Module):
    """nn.MultiheadAttention (batch_first) as self-attention, padding (id 0) masked."""

    def __init__(self, width: int):
        super().__init__()
        self.attention = nn.MultiheadAttention(width, HEADS, batch_first=True)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, key_padding_mask=ids == 0)[0]


class EncoderLayer(nn.Module):
    """nn.TransformerEncoderLayer (batch_first, GELU, pre-norm), padding (id 0) masked: all of the above in one."""

    def __init__(self, width: int):
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(width, HEADS, 2 * width, dropout=0.0, activation="gelu",
                                                  batch_first=True, norm_first=True)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(x, src_key_padding_mask=ids == 0)


class Pointwise(nn.Module):
    """A layer of one input (LayerNorm, GELU) after a Linear, so that it sees varied values."""

    def __init__(self, width: int, layer: nn.Module):
        super().__init__()
        self.linear, self.layer = nn.Linear(width, width), layer

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.layer(self.linear(x))


def make_layer(layer: str, width: int) -> nn.Module | None:
    return {
        "embedding": lambda: None,
        "embedding_padding_idx": lambda: None,
        "layer_norm": lambda: Pointwise(width, nn.LayerNorm(width)),
        "gelu": lambda: Pointwise(width, nn.GELU()),
        "gelu_tanh": lambda: Pointwise(width, nn.GELU(approximate="tanh")),
        "sdpa_causal": lambda: Attention(width, "causal"),
        "sdpa_mask": lambda: Attention(width, "padding"),
        "multihead_attention": lambda: MultiheadAttention(width),
        "transformer_encoder_layer": lambda: EncoderLayer(width),
    }[layer]()


class LayerNet(nn.Module):
    def __init__(self, layer: str, vocab: int = 16, width: int = 16, classes: int = 3):
        super().__init__()
        # Token 0 is padding: "embedding_padding_idx" tells the embedding (its row of 0 gets no gradient
        # from the lookup) and draws that row like the others (ModernBERT does; a tied output layer
        # trains it): the padding tokens' vectors count in the mean, unchanged by training.
        self.embed = nn.Embedding(vocab, width, padding_idx=0 if layer == "embedding_padding_idx" else None)
        if layer == "embedding_padding_idx":
            with torch.no_grad():
                self.embed.weight[0] = torch.randn(width)
        self.layer = make_layer(layer, width)
        self.head = nn.Linear(width, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if self.layer is not None:
            x = self.layer(x, ids)
        return self.head(x.mean(dim=1))

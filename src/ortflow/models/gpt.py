"""`model.kind: gpt`: a GPT-2-style decoder for byte-level language modelling.

Token and position embeddings, `layers` pre-LayerNorm blocks (causal
self-attention, then a GELU MLP, each around a residual), a final LayerNorm and
a head to the vocabulary that shares the token embedding when `tied`.

The logits come out as [batch, vocab, time], not the usual [batch, time, vocab]:
ONNX's SoftmaxCrossEntropyLoss takes the classes in dimension 1 ([N, C, d1])
with labels [N, d1], so next-token cross-entropy needs no reshape of either (the
training graph's loss reads the tensor before the Transpose, flattened: graphs/loss.py).
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


def as_gpt2(gpt: GPT, eos_token_id: int | None = None):
    """The built-in `gpt` as transformers' GPT2LMHeadModel computing the same function, so that it
    exports and generates as any transformers causal LM does (generation/). The architectures match
    block for block: pre-LayerNorm at GPT-2's epsilon (1e-5, torch's default), fused q/k/v split in
    that order, 1/sqrt(head_dim) scaling, a 4x MLP. GPT-2's activation is named "gelu" here, the
    exact erf GELU that nn.GELU() computes (GPT-2's own "gelu_new" is tanh's approximation), and its
    Conv1D layers hold a weight [in, out], nn.Linear's transposed. `eos_token_id`: the data's
    end-of-text id (data.tokenizer's); None for bytes, which have none, so generation runs to its
    max_new_tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab, width = gpt.tokens.weight.shape
    first = gpt.blocks[0]
    tied = gpt.head.weight is gpt.tokens.weight
    config = GPT2Config(vocab_size=vocab, n_positions=gpt.context, n_embd=width, n_layer=len(gpt.blocks),
                        n_head=first.attn.heads, n_inner=first.mlp[0].out_features, activation_function="gelu",
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=first.ln1.eps,
                        bos_token_id=eos_token_id, eos_token_id=eos_token_id, tie_word_embeddings=tied)
    # Built on the meta device and given gpt's own tensors (assign): the GPT-2 shares gpt's memory
    # rather than holding the weights twice more (its random initialisation, then a copy).
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    weights = {"transformer.wte.weight": gpt.tokens.weight, "transformer.wpe.weight": gpt.positions.weight,
               "transformer.ln_f.weight": gpt.ln_f.weight, "transformer.ln_f.bias": gpt.ln_f.bias,
               "lm_head.weight": gpt.head.weight}
    for i, block in enumerate(gpt.blocks):
        ours = {"ln_1": block.ln1, "ln_2": block.ln2, "attn.c_attn": block.attn.qkv, "attn.c_proj": block.attn.proj,
                "mlp.c_fc": block.mlp[0], "mlp.c_proj": block.mlp[2]}
        for name, layer in ours.items():
            linear = isinstance(layer, nn.Linear)
            weights[f"transformer.h.{i}.{name}.weight"] = layer.weight.t() if linear else layer.weight
            weights[f"transformer.h.{i}.{name}.bias"] = layer.bias
    model.load_state_dict({name: tensor.detach() for name, tensor in weights.items()}, strict=True, assign=True)
    if tied:  # assign replaced the head's Parameter: the two names are one tensor again, as in gpt
        model.tie_weights()
    model.generation_config.eos_token_id = model.generation_config.bos_token_id = eos_token_id
    return model.eval()

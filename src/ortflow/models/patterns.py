"""The lists that pick a model's parameters by name: `model.trainable`, `model.frozen`,
`model.weights_skip` and `train.optimizer.no_decay` all take the same entries, each a
name pattern or one of the rules below (the schema refuses other `<...>`)."""

from __future__ import annotations

from fnmatch import fnmatchcase

ONE_D = "<1d>"  # fewer than two dimensions: biases, LayerNorm/BatchNorm/RMSNorm scales and shifts (nanoGPT's rule)
EMBEDDING = "<embedding>"  # the table an embedding lookup reads (an ONNX Gather's data input), whatever its name


def matches(name: str, ndim: int, embeddings: set[str], entries: list[str]) -> bool:
    """Does an entry of `entries` pick parameter `name` (of `ndim` dimensions)?
    A name pattern matches a name that contains it, ignoring case, with fnmatch's wildcards
    (`*`, `?`, `[...]`): `bias` and `LayerNorm.weight` mean what they mean to transformers' Trainer."""
    def picks(entry: str) -> bool:
        if entry == ONE_D:
            return ndim < 2
        if entry == EMBEDDING:
            return name in embeddings
        return fnmatchcase(name.lower(), f"*{entry.lower()}*")

    return any(picks(entry) for entry in entries)

"""Which of the forward model's float initializers train and which stay frozen."""

from __future__ import annotations

import math

from ..errors import ModelError
from ..models import batchnorm, is_float, patterns


def float_initializers(base) -> dict[str, int]:
    """Name -> element count of the float initializers (the candidate parameters)."""
    return {t.name: math.prod(t.dims) for t in base.graph.initializer if is_float(t)}


def split_parameters(base, model, torch_trainable: list[str] | None) -> tuple[list[str], list[str]]:
    """(trainable, frozen) parameter names: those `model.trainable` picks if given, else
    the torch module's parameters or the ONNX file's float initializers, minus those
    `model.frozen` picks. Both take train.optimizer.no_decay's patterns and rules
    (models/patterns.py); each entry must pick a parameter. BatchNorm's running
    statistics are float initializers but never train (batchnorm.check_trainable)."""
    parameters = float_initializers(base)
    ndim = {t.name: len(t.dims) for t in base.graph.initializer}
    tables = set(embedding_tables(base, list(parameters)))
    statistics = batchnorm.running_statistics(base)

    def picked(key: str) -> list[str]:
        for entry in getattr(model, key) or ():
            matches = [n for n in parameters if patterns.matches(n, ndim[n], tables, [entry])]
            if not matches:
                raise ModelError(f"model.{key}: {entry!r} matches none of the model's parameters: "
                                 f"{', '.join(sorted(parameters)[:8])}{', ...' if len(parameters) > 8 else ''} "
                                 f"({len(parameters)} in all; patterns as train.optimizer.no_decay's)")
            if key == "trainable" and all(n in statistics for n in matches):
                batchnorm.check_trainable(base, matches)
        return [n for n in parameters if patterns.matches(n, ndim[n], tables, getattr(model, key) or ())]

    frozen = set(picked("frozen"))
    if model.trainable is not None:
        candidates = [n for n in picked("trainable") if n not in statistics]
    else:
        candidates = torch_trainable if torch_trainable is not None else [n for n in parameters if n not in statistics]
    trainable = [n for n in candidates if n in parameters and n not in frozen]
    if not trainable:
        raise ModelError("model: no parameter is left to train (check model.trainable and model.frozen)")
    return trainable, [n for n in parameters if n not in trainable]


def embedding_tables(base, trainable: list[str]) -> list[str]:
    """The trainable parameters that an embedding lookup reads: the data input of
    a Gather node, which is what nn.Embedding exports to (for the `<embedding>`
    rule of train.optimizer.no_decay, which then holds whatever the names are)."""
    tables = {node.input[0] for node in base.graph.node if node.op_type == "Gather"}
    return [name for name in trainable if name in tables]

"""The artifacts' `model.json` (describe.py makes it, build_artifacts adds what it built) as a
record: read here only, every field checked (records.py), and written back as the JSON ortflow
has always written (its keys in this order, the optional ones left out when absent)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from .. import records
from ..errors import MissingInputError, ModelError

REMEDY = "run the build_artifacts rule again"


@dataclasses.dataclass(frozen=True)
class Tensor:
    """An input or the label: its name, numpy dtype and shape, ["batch", *one record's shape]."""

    name: str
    dtype: str
    shape: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Outputs:
    loss: str  # the graphs' loss output
    logits: str  # the graphs' logits (models/logits.py)
    inference: str | None = None  # the inference model's output; artifacts built before it had the logits'


@dataclasses.dataclass(frozen=True)
class Flops:
    forward: int
    backward: int


@dataclasses.dataclass(frozen=True)
class ModelDescription:
    kind: str  # model.kind
    task: str  # the data's
    loss: str
    num_classes: int | None
    inputs: tuple[Tensor, ...]
    label: Tensor
    outputs: Outputs
    parameters: int
    trainable_parameters: int
    trainable: tuple[str, ...]
    frozen: tuple[str, ...]
    # The trainable tables an embedding lookup reads (None: built before they were named); keyword-only,
    # to keep model.json's order with a default here.
    embeddings: tuple[str, ...] | None = dataclasses.field(default=None, kw_only=True)
    flops_per_sample: Flops
    activation_bytes_per_sample: int  # what training keeps for the backward pass (preflight.memory_estimate)
    # Without train.recompute, what recomputing the blocks would make it (absent: recompute on, or no blocks).
    activation_bytes_per_sample_recompute_blocks: int | None = None
    eval_bytes_per_sample: int = 0  # absent from artifacts built before it was measured
    running_stats: dict = dataclasses.field(default_factory=dict)  # BatchNorm's statistics (models/batchnorm.py)
    bf16_matmuls: dict = dataclasses.field(default_factory=dict)  # graphs/precision.py's rewrites a graph
    transformers: dict | None = None  # a transformers model's origin (models/hugging_face.py)
    lora: dict | None = None  # model.lora's r, alpha, dropout and targets

    @property
    def inference_output(self) -> str:
        """The inference model's output: the model's own, after a final Softmax where it has one."""
        return self.outputs.inference or self.outputs.logits


def read_description(path: Path) -> ModelDescription:
    """An artifacts folder's model.json (Artifacts.model_json); MissingInputError when there is none,
    ModelError naming the file and the key when a field is missing or mistyped."""
    return records.read(ModelDescription, path, ModelError, REMEDY,
                        MissingInputError(f"{path}: no model description ({REMEDY})"))


def write_description(path: Path, description: ModelDescription) -> None:
    """model.json as it has always been written: unsorted, the optional entries left out when None."""
    optional = {f.name for f in dataclasses.fields(ModelDescription) if f.default is None}
    data = {key: value for key, value in dataclasses.asdict(description).items()
            if not (key in optional and value is None)}
    records.write_data(path, data)

"""The validated run configuration, one frozen dataclass a section of config.schema.yaml, with
the schema's types: a misspelled key fails in a type checker, and at run time when read.

Written by `python -m ortflow.config.generate` from the schema: edit the schema, then run it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class Run:
    """config section 'run' (config.schema.yaml)."""

    name: str
    seed: int


@dataclass(frozen=True, slots=True)
class Data:
    """config section 'data' (config.schema.yaml)."""

    source: str
    features: tuple[str, ...]
    label: str
    split_seed: int | None
    task: Literal["auto", "classification", "regression", "seq2seq"]
    standardize: bool
    eval_fraction: float
    shards: int
    context: int
    text_path: str | None
    tokenizer: str | None
    text: str | tuple[str, ...] | None
    format: Literal["auto", "table", "messages", "prompt-completion", "documents"]
    messages: str
    prompt: str
    completion: str
    chat_template: str | None
    loss_on: Literal["assistant", "all"]
    too_long: Literal["truncate", "drop"]
    packing: Literal["none", "separate", "cross"]


@dataclass(frozen=True, slots=True)
class Lora:
    """config section 'model.lora' (config.schema.yaml)."""

    r: int
    alpha: float
    dropout: float
    targets: tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class Model:
    """config section 'model' (config.schema.yaml)."""

    kind: Literal["mlp", "cnn", "gpt", "onnx", "torch", "transformers"]
    task: Literal["auto", "causal-lm", "sequence-classification", "regression", "token-classification", "image-classification", "seq2seq"]
    hidden: tuple[int, ...]
    layers: int
    heads: int
    width: int
    tied: bool
    path: str | None
    kwargs: Mapping[str, Any]
    loss: Literal["auto", "cross_entropy", "mse", "bce_with_logits", "l1"]
    weights: str | None
    weights_skip: tuple[str, ...]
    weights_prefix: str | None
    weights_config: str | None
    frozen: tuple[str, ...]
    trainable: tuple[str, ...] | None
    lora: Lora | None


@dataclass(frozen=True, slots=True)
class Optimizer:
    """config section 'train.optimizer' (config.schema.yaml)."""

    name: Literal["adamw", "sgd", "lamb"]
    lr: float
    betas: tuple[float, float]
    eps: float | None
    weight_decay: float
    no_decay: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LrSchedule:
    """config section 'train.lr_schedule' (config.schema.yaml)."""

    name: Literal["constant", "linear", "cosine", "polynomial"]
    warmup_steps: int
    min_lr_ratio: float
    power: float


@dataclass(frozen=True, slots=True)
class EarlyStopping:
    """config section 'train.early_stopping' (config.schema.yaml)."""

    metric: Literal["loss", "accuracy", "perplexity"]
    mode: Literal["auto", "min", "max"]
    patience: int | None
    min_delta: float


@dataclass(frozen=True, slots=True)
class Train:
    """config section 'train' (config.schema.yaml)."""

    world_size: int
    pipeline_stages: int
    zero: Literal[0, 1]
    recompute: str | tuple[str, ...]
    precision: Literal["fp32", "bf16"]
    nodes: int
    device: Literal["cpu", "cuda"]
    backend: Literal["auto", "mpi", "nccl"]
    micro_batch_size: int
    grad_accum_steps: int
    steps: int
    optimizer: Optimizer
    lr_schedule: LrSchedule
    clip_grad_norm: float | None
    log_every: int
    eval_every: int
    eval_batch_size: int
    eval_batches: int | None
    checkpoint_every: int
    keep_checkpoints: int
    early_stopping: EarlyStopping
    histogram_every: int
    resume_from: str | None
    collective_timeout_s: float
    profile_steps: tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class Int4:
    """config section 'export.int4' (config.schema.yaml)."""

    block_size: Literal[16, 32, 64, 128]
    symmetric: bool
    accuracy_level: Literal[0, 1, 2, 3, 4]
    output_layer: bool


@dataclass(frozen=True, slots=True)
class Export:
    """config section 'export' (config.schema.yaml)."""

    checkpoint: Literal["auto", "best", "last"]
    quantize: Literal["auto", "dynamic", "static", "none"]
    per_channel: bool
    calibration_batches: int
    max_accuracy_drop: float
    gate_fails_run: bool
    samples: int
    int4: Int4 | None


@dataclass(frozen=True, slots=True)
class Generate:
    """config section 'generate' (config.schema.yaml)."""

    prompt: str | None
    prompts: str | None
    max_new_tokens: int | None


@dataclass(frozen=True, slots=True)
class Random:
    """config section 'sweep.random' (config.schema.yaml)."""

    points: int
    seed: int
    ranges: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Halving:
    """config section 'sweep.halving' (config.schema.yaml)."""

    steps: int
    keep: float


@dataclass(frozen=True, slots=True)
class Sweep:
    """config section 'sweep' (config.schema.yaml)."""

    name: str
    grid: Mapping[str, Any]
    random: Random
    repeats: int
    metric: Literal["eval_loss", "accuracy", "perplexity", "mse"]
    goal: Literal["auto", "min", "max"]
    point: str
    halving: Halving


@dataclass(frozen=True, slots=True)
class Config:
    """The whole config (config.schema.yaml)."""

    run: Run
    data: Data
    model: Model
    train: Train
    export: Export
    generate: Generate
    sweep: Sweep


# Each section's class by its dotted path ("" for the whole config), for `typed`.
SECTIONS: dict[str, type] = {
    "run": Run,
    "data": Data,
    "model.lora": Lora,
    "model": Model,
    "train.optimizer": Optimizer,
    "train.lr_schedule": LrSchedule,
    "train.early_stopping": EarlyStopping,
    "train": Train,
    "export.int4": Int4,
    "export": Export,
    "generate": Generate,
    "sweep.random": Random,
    "sweep.halving": Halving,
    "sweep": Sweep,
    "": Config,
}

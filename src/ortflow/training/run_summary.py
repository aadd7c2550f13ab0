"""A run's train/metrics.json (rank 0 writes it as training ends): its summary and the metrics it
logged, read by the report, the lines printed at the end of a run and a sweep's comparison. Read
here only, every field checked (records.py); written as ortflow has always written it: its keys in
this order, a NaN or infinity (a measure an attempt that ran no step does not have) as null, the
pipeline's entries only in a pipelined run's."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from .. import records
from ..errors import MissingInputError, TrainingError

REMEDY = "run the train rule again"
PIPELINE = ("pipeline_waited_share", "pipeline_bubble")  # a pipelined run's alone


@dataclasses.dataclass(frozen=True)
class BestEval:
    """train.early_stopping's best evaluation so far (training/best.py)."""

    step: int | None  # None: no evaluation yet
    metric: str
    mode: str  # min or max
    value: float | None


@dataclasses.dataclass(frozen=True)
class RunSummary:
    steps: int  # optimizer steps done: train.steps, or fewer after early stopping
    # Steps this attempt trained (absent from runs before resumed attempts were told apart: all of them);
    # keyword-only, to keep metrics.json's order with a default here.
    steps_this_attempt: int | None = dataclasses.field(default=None, kw_only=True)
    train_loss: float | None  # the last logged
    eval: dict  # the last evaluation of the whole eval split: loss, accuracy..., per_class
    samples_per_s: float | None  # steady state (after the warm-up steps)
    step_time_p50_s: float | None
    step_time_p95_s: float | None
    flops_per_s: float | None
    peak_rss_mb: tuple[float, ...]  # each rank's
    global_batch_size: int
    wall_time_s: float
    history: dict  # {"train": [...], "eval": [...]}: the metrics logged, of every attempt
    best: BestEval | None = None  # absent before train.early_stopping
    stopped_early: bool = False
    baseline: dict | None = None  # data/baseline.py's measures of predicting without the model
    parameters: int | None = None  # of the model (absent from runs before they were counted)
    trainable_parameters: int | None = None
    pipeline_waited_share: tuple[float | None, ...] | None = None  # each rank's share of its steps spent waiting
    pipeline_bubble: float | None = None  # 1F1B's, for comparison
    # The train preflight's warnings, "<check>: <what> (fix: <fix>)" (absent before they were kept).
    warnings: tuple[str, ...] = ()


def read_run_summary(path: Path) -> RunSummary:
    """train/metrics.json; MissingInputError when there is none, TrainingError naming the file and
    the key when a field is missing or mistyped."""
    return records.read(RunSummary, path, TrainingError, REMEDY,
                        MissingInputError(f"{path}: no training metrics (run the train stage first)"))


def write_run_summary(path: Path, summary: RunSummary) -> None:
    data = {key: value for key, value in dataclasses.asdict(summary).items()
            if not (key in PIPELINE and value is None)}
    records.write_data(path, strict(data), allow_nan=False)


def strict(value):
    """`value` with every NaN or infinity replaced by None (null): strict JSON, which
    every JSON reader accepts (an attempt that ran no step has no throughput)."""
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):  # a record's tuples (dataclasses.asdict keeps them) written as lists
        return [strict(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value

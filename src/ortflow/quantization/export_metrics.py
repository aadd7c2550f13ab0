"""export/metrics.json (quantize_model writes it): fp32 against int8 (quality, latency, size), the
quality gate's verdict, and with export.int4 the int4 generation folder's entry. Read here only,
every field checked (records.py), by the run's summary, the report and a sweep's comparison;
written as ortflow has always written it: its keys in this order, the entries a run does not have
(int8 with export.quantize none, int4 without export.int4, static's calibration) left out. A
model's entry keeps the keys its task's evaluation gives (loss, accuracy or perplexity, per class)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .. import records
from ..errors import MissingInputError, ModelError

REMEDY = "run the quantize_model rule again"
OPTIONAL = ("calibration_batches", "int8", "gate", "int4")  # left out when a run has none


@dataclasses.dataclass(frozen=True)
class Gate:
    """The quality gate's verdict on the int8 (or int4) model against fp32 (gate.py)."""

    metric: str  # accuracy, perplexity or loss
    drop: float  # in `unit`: accuracy points, or a relative increase in %
    unit: str
    max_accuracy_drop: float  # export.max_accuracy_drop
    outcome: str | None = None  # passed or refused; absent before a refusal was kept (it failed the stage)


@dataclasses.dataclass(frozen=True)
class Int4:
    """The int4 generation folder against fp32's (int4_measure.py)."""

    settings: dict  # export.int4 as applied
    weights_quantized: int
    records: int  # eval windows scored
    fp32: dict  # weight_bytes, perplexity, tokens_scored, tokens_per_s
    int4: dict
    weight_ratio: float  # int4's weight bytes over fp32's
    gate: Gate


@dataclasses.dataclass(frozen=True)
class ExportMetrics:
    quantize: str  # export.quantize as chosen: dynamic, static or none
    per_channel: bool
    threads: int  # the latencies' intra-op threads
    warnings: tuple[str, ...] = dataclasses.field(default=(), kw_only=True)  # what the summary repeats
    calibration_batches: int | None = dataclasses.field(default=None, kw_only=True)  # static's
    fp32: dict  # the task's eval measures, latency_ms ({"b1_p50": ms, ...}), size_bytes
    int8: dict | None = None
    gate: Gate | None = None
    int4: Int4 | None = None


def read_export_metrics(path: Path) -> ExportMetrics:
    """export/metrics.json; MissingInputError when there is none, ModelError naming the file and the
    key when a field is missing or mistyped."""
    return records.read(ExportMetrics, path, ModelError, REMEDY,
                        MissingInputError(f"{path}: no export metrics (run the quantize_model rule first)"))


def write_export_metrics(path: Path, metrics: ExportMetrics) -> None:
    data = {key: value for key, value in dataclasses.asdict(metrics).items()
            if not (key in OPTIONAL and value is None)}
    records.write_data(path, data)

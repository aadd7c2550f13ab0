"""A run's results as a person reads them: its metrics files read back, and every number
shown by the one function `fmt` (tests read the report back through it)."""

from __future__ import annotations

import json
from pathlib import Path

from ..data import baseline
from ..generation.samples_file import Samples, read_samples
from ..quantization.export_metrics import ExportMetrics, Int4, read_export_metrics
from ..training.run_summary import RunSummary, read_run_summary


def fmt(value: float, kind: str) -> str:
    """The one way a number is shown (tests read the report back through it); None
    (in metrics.json: a measure an attempt that ran no step does not have) is n/a."""
    if value is None:
        return "n/a"
    return {
        "percent": lambda v: f"{100 * v:.2f}%",
        "seconds": lambda v: f"{v:.2f} s",
        "ms": lambda v: f"{v:.3f} ms",
        "rate": lambda v: f"{v:,.0f}",
        "ratio": lambda v: f"{v:.2f}x",
        "float": lambda v: f"{v:.4f}",
        "mb": lambda v: f"{v:,.1f} MB",
    }[kind](value)


def count(number: int) -> str:
    """A count of parameters: 1,123; 0.29M; 4.40M; 1.24B."""
    if number >= 1e9:
        return f"{number / 1e9:.2f}B"
    return f"{number / 1e6:.2f}M" if number >= 1e5 else f"{number:,}"


def lora_trained(description) -> str:
    """What a LoRA run trains, from build_artifacts' model.json: "LoRA r=8 on c_attn: 0.29M of
    4.40M parameters trained (6.59%)" (of all: the base's and the adapters')."""
    lora, trained, total = description.lora, description.trainable_parameters, description.parameters
    return (f"LoRA r={lora['r']} on {','.join(lora['targets'])}: {count(trained)} of {count(total)} parameters "
            f"trained ({fmt(trained / total, 'percent')})")


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def read_train(path: Path) -> RunSummary | None:
    """train/metrics.json (training/run_summary.py), None before the run trained."""
    return read_run_summary(path) if Path(path).is_file() else None


def read_generated(path: Path) -> Samples | None:
    """export/samples.json (generation/samples_file.py), None where the run has no generation folder."""
    return read_samples(path) if Path(path).is_file() else None


def read_export(path: Path) -> ExportMetrics | None:
    """export/metrics.json (quantization/export_metrics.py), None before quantize_model ran."""
    return read_export_metrics(path) if Path(path).is_file() else None


def quality(results: dict) -> tuple[str, str]:
    """(name, shown value) of the quality measure of an eval: accuracy, perplexity or loss."""
    if "perplexity" in results:
        return "perplexity", fmt(results["perplexity"], "float")
    if "accuracy" in results:
        return "accuracy", fmt(results["accuracy"], "percent")
    return "loss", fmt(results["loss"], "float")


def baseline_shown(train: RunSummary | None) -> str | None:
    """The shown baseline of a run (train/metrics.json's `baseline`, data/baseline.py), beside its
    measures: `mse 7042.1008, R^2 -0.0024 (predicting the train split's mean)`."""
    measures = train.baseline if train else None
    if not measures:
        return None
    shown = {"accuracy": ("accuracy", "percent"), "loss": ("mse", "float"), "r2": ("R^2", "float"),
             "perplexity": ("perplexity", "float")}
    parts = [f"{label} {fmt(measures[key], kind)}" for key, (label, kind) in shown.items() if key in measures]
    return f"{', '.join(parts)} (predicting {measures['of']})"


def not_beaten(train: RunSummary | None) -> str | None:
    """What a run's summary warns of when its last evaluation does not beat the baseline."""
    return baseline.not_beaten(train.eval, train.baseline) if train else None


def refusal(export: ExportMetrics | Int4 | None) -> str | None:
    """`refused by the gate, -3.6 points (export.max_accuracy_drop: 1)` when the quality gate
    refused the int8 model (export/metrics.json), or given its int4 entry the int4 folder, else None."""
    gate = export.gate if export else None
    if not gate or gate.outcome != "refused":  # before the outcome was kept, a refusal failed the stage
        return None
    change = f"{-gate.drop:+.3g} points" if gate.unit == "points" else f"{gate.drop:+.3g}% {gate.metric}"
    return f"refused by the gate, {change} (export.max_accuracy_drop: {gate.max_accuracy_drop:g})"


def speedup(export: ExportMetrics) -> float | None:
    """How many times faster int8 runs than fp32 at the larger batch timed (median latency):
    64 records, or fewer where they would not fit (quantization/measure.py's latency_batches)."""
    if export.int8 is None:
        return None
    key = f"b{large_batch(export)}_p50"
    return export.fp32["latency_ms"][key] / export.int8["latency_ms"][key]


def large_batch(export: ExportMetrics) -> int:
    """The larger batch the latencies were timed at (their keys: b1_p50, b64_p50, ...)."""
    return max(int(key[1:].split("_")[0]) for key in export.fp32["latency_ms"])

"""The quality gate: the int8 model may lose at most `export.max_accuracy_drop` accuracy
points (perplexity, or the loss of a regression model: that many percent relative
increase). Beyond it the int8 model is refused: the fp32 model is the run's product, so
the stage warns with both numbers, and metrics.json records the gate's outcome `refused`,
which the end-of-run summary, the report and a sweep's comparison show (none of them
offers the int8 file, which is still written: Snakemake expects it). With
`export.gate_fails_run` the stage fails instead (QualityGateError), and no int8 model and
no metrics.json are written. The message suggests only settings not set already, and
`data.standardize` where the inputs are unscaled floats (standardize.unscaled).

An int8 model no smaller than the fp32 model (a tiny model) is flagged too (size_warning).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..data import standardize
from ..errors import ModelError

log = logging.getLogger("ortflow.quantize")


class QualityGateError(ModelError):
    """The int8 model lost more than `export.max_accuracy_drop` allows."""


def quality_drop(fp32: dict, int8: dict) -> tuple[str, float, str]:
    """(what is compared, how much int8 loses, its unit): accuracy points, or the
    relative increase in percent of the perplexity or (regression) the loss."""
    if "perplexity" in fp32:
        return "perplexity", (int8["perplexity"] / fp32["perplexity"] - 1) * 100, "%"
    if "accuracy" in fp32:
        return "accuracy", (fp32["accuracy"] - int8["accuracy"]) * 100, "points"
    return "loss", (int8["loss"] / fp32["loss"] - 1) * 100 if fp32["loss"] else 0.0, "%"


def gate(report: dict, export_cfg, model: Path, records: int, remedies: list[str], quantized: str = "int8") -> dict:
    """The quality gate's entry of the report, its `outcome` `passed` or `refused` (the `quantized`
    model, int8 or int4, loses too much, said in a warning that names the `remedies`);
    QualityGateError instead of `refused` with export.gate_fails_run. For accuracy it says what one
    record is worth: on a tiny eval split one wrong answer is already several points."""
    compared, drop, unit = quality_drop(report["fp32"], report[quantized])
    allowed = export_cfg.max_accuracy_drop
    granularity = f" (one of the {records} eval records is {100 / records:.3g} points)" if compared == "accuracy" else ""
    entry = {"metric": compared, "drop": drop, "unit": unit, "max_accuracy_drop": allowed}
    if drop <= allowed:
        log.info("quality gate passed: %s loses %.4g %s of %s (allowed: %g)%s", quantized, drop, unit, compared,
                 allowed, granularity)
        return {**entry, "outcome": "passed"}
    scale = 100 if compared == "accuracy" else 1
    refusal = (f"quality gate: {quantized} {compared} {report[quantized][compared] * scale:.4g} against fp32 "
               f"{report['fp32'][compared] * scale:.4g} is a loss of {drop:.4g} {unit}, more than "
               f"export.max_accuracy_drop={allowed}{granularity}")
    remedy = f"(try {'; '.join(remedies)})"
    if export_cfg.gate_fails_run:
        raise QualityGateError(f"{refusal}; no {quantized} model is written and the fp32 model {model} stays "
                               f"(export.gate_fails_run) {remedy}")
    log.warning("%s; the %s model is refused (metrics.json: gate outcome refused): deploy the fp32 model %s %s",
                refusal, quantized, model, remedy)
    return {**entry, "outcome": "refused"}


def remedies(export_cfg, how: str, reader) -> list[str]:
    """What may bring the int8 model within the gate, of the settings not set
    already: standardized inputs where they are unscaled floats (with the data
    as the model takes it), static quantization, per-channel weights."""
    found = []
    if not reader.standardized:
        columns = reader.manifest.source["data"]["features"]
        batches = ({name: batch[name] for name in reader.feature_names} for batch in reader.eval_batches(0, 1, 256))
        problem = standardize.unscaled(batches, columns)
        if problem:
            found.append(f"data.standardize: true ({problem})")
    if how != "static":
        found.append("export.quantize: static")
    if not export_cfg.per_channel:
        found.append("export.per_channel: true")
    return [*found, "a larger export.max_accuracy_drop", "or export.quantize: none"]


def size_warning(report: dict, model: Path) -> str | None:
    """The line that says the int8 model is no smaller than the fp32 model (a
    tiny model: the scales, zero points and quantization nodes outweigh what its
    few weights save), or None."""
    fp32, int8 = report["fp32"]["size_bytes"], report["int8"]["size_bytes"]
    if int8 < fp32:
        return None
    return (f"the int8 model ({int8 / 1024:.3g} KiB) is {int8 / fp32:.3g}x the size of the fp32 model "
            f"({fp32 / 1024:.3g} KiB): on a model this small the quantization's scales, zero points and nodes "
            f"outweigh what int8 saves on the weights; deploy the fp32 model {model}, and set export.quantize: "
            "none to skip int8")

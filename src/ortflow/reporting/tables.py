"""The HTML tables of a run's report: the run at a glance, a causal LM's generated samples before
and after fine-tuning, fp32 versus int8, each stage's runtime and memory, the operators that took the most time in the profiled steps, and
the config used."""

from __future__ import annotations

import csv
import html
import json
from collections import defaultdict
from pathlib import Path

from .. import atomic
from ..config import Config, as_dict
from ..graphs.description import ModelDescription, read_description
from ..quantization.export_metrics import ExportMetrics
from ..training.run_summary import RunSummary
from .results import (baseline_shown, count, fmt, large_batch, not_beaten, quality, read_export, read_generated,
                      read_train, refusal, speedup)

TABLES = ("summary", "samples", "quantization", "stages", "profile", "config")
# The stages in pipeline order, as the rules and their benchmark files are named.
STAGES = ("prepare_data", "build_artifacts", "train", "merge_checkpoint", "export_model", "quantize_model")
TOP_OPERATORS = 15


def page(title: str, body: str) -> str:
    style = ("body{font-family:sans-serif;margin:1.5em} table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:4px 10px;text-align:left} td.n{text-align:right}"
             "pre{background:#f6f6f6;padding:1em}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body><h2>{html.escape(title)}</h2>{body}</body></html>")


def table(header: list[str], rows: list[tuple]) -> str:
    """rows: (key, cells...); `key` becomes the row's data-key, for readers that check the numbers."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        f"<tr data-key='{html.escape(key)}'>"
        + "".join(f"<td{' class=n' if i else ''}>{html.escape(str(cell))}</td>" for i, cell in enumerate(cells))
        + "</tr>"
        for key, *cells in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def summary_rows(train: RunSummary | None, export: ExportMetrics | None, description: ModelDescription | None = None) -> list[tuple]:
    """The run at a glance: quality, baseline, training; from build_artifacts' model.json
    (`description`), the parameters trained of all, and with LoRA its adapters."""
    rows = []
    if export:
        name, shown = quality(export.fp32)
        rows.append(("fp32", f"{name} (fp32, eval split)", shown))
        if export.int8 is not None:
            rows.append(("int8", f"{name} (int8, {export.quantize})", quality(export.int8)[1]))
            rows.append(("speedup", f"int8 speed-up (batch {large_batch(export)}, 1 thread)",
                         fmt(speedup(export), "ratio")))
        if refusal(export):
            rows.append(("gate", "int8", refusal(export)))
    elif train:
        name, shown = quality(train.eval)
        rows.append(("eval", f"{name} (eval at the last step)", shown))
    if baseline_shown(train):
        rows.append(("baseline", "baseline (eval split)", baseline_shown(train)))
        rows.append(("beats_baseline", "beats the baseline", "no" if not_beaten(train) else "yes"))
    if train:
        rows += [
            ("steps", "optimizer steps", str(train.steps)),
            ("wall_time_s", "training time", fmt(train.wall_time_s, "seconds")),
            ("samples_per_s", "samples/s (steady state)", fmt(train.samples_per_s, "rate")),
            ("ranks", "ranks", str(len(train.peak_rss_mb))),
        ]
        if train.warnings:
            rows.append(("setup_warnings", "warnings before training", "; ".join(train.warnings)))
    if description:
        trained, total = description.trainable_parameters, description.parameters
        rows.append(("trainable_parameters", "parameters trained",
                     f"{count(trained)} of {count(total)} ({fmt(trained / total, 'percent')})"))
    if description and description.lora:
        lora = description.lora
        rows.append(("lora", "LoRA adapters", f"r={lora['r']}, alpha={lora['alpha']:g}, dropout={lora['dropout']:g} "
                                              f"on {', '.join(lora['targets'])}"))
    return rows


SCORES = ("precision", "recall", "f1")


def class_rows(train: RunSummary | None) -> list[tuple]:
    """Each class of a classifier (by its name: a label of strings' own, else its id)
    with its eval records, accuracy, precision, recall and F1 (n/a in metrics of runs
    from before they were recorded), from the last evaluation of train/metrics.json;
    then, for BIO tags, the entities' scores (seqeval's), as a row `entities`."""
    evaluation = train.eval if train else {}
    rows = [(name, name, str(entry["count"]), fmt(entry["accuracy"], "percent"),
             *(fmt(entry.get(score), "float") for score in SCORES))
            for name, entry in evaluation.get("per_class", {}).items()]
    if "entities" in evaluation:
        entities = evaluation["entities"]
        rows.append(("entities", "entities (BIO spans)", str(entities["count"]), "",
                     *(fmt(entities[score], "float") for score in SCORES)))
    return rows


def quantization_rows(export: ExportMetrics) -> list[tuple]:
    models = [entry for entry in (export.fp32, export.int8) if entry is not None]
    measures = [("loss", "loss", "float")]
    measures += [(k, k, "percent" if k == "accuracy" else "float")
                 for k in ("accuracy", "perplexity") if k in export.fp32]
    rows = [(k, label, *(fmt(m[k], kind) for m in models)) for k, label, kind in measures]
    rows.append(("size_bytes", "size", *(fmt(m["size_bytes"] / 1e6, "mb") for m in models)))
    rows += [(f"latency_ms.{k}", f"latency {k.replace('_', ' ')}", *(fmt(m["latency_ms"][k], "ms") for m in models))
             for k in export.fp32["latency_ms"]]
    return rows


def samples_page(samples_path: Path | None) -> str:
    """export/samples.json (generation/samples.py) as a table of prompt, the eval data's next tokens,
    and the greedy continuations before and after training; without it, why there are none."""
    samples = read_generated(samples_path) if samples_path else None
    if samples is None:
        return page("Generated samples", "<p>No generated samples: this run has no <code>export/generation/</code> "
                    "folder, which the export writes for a causal LM or a sequence-to-sequence model fine-tuned by task "
                    "(<code>model.kind: transformers</code>, <code>model.task: causal-lm</code> or <code>seq2seq</code>"
                    "), once export_model has run.</p>")
    if not samples.samples:
        return page("Generated samples", "<p>No generated samples: <code>export.samples</code> is 0.</p>")
    rows = [(str(i), entry.prompt, entry.expected, entry.before, entry.after)
            for i, entry in enumerate(samples.samples)]
    return page("Generated samples, before and after training",
                f"<p>Eval prompts and the greedy continuations (at most {samples.max_new_tokens} new tokens) of "
                "the starting weights (transformers' <code>generate</code>) and of <code>export/generation/</code> "
                "(ONNX Runtime), as <code>ortflow generate</code> gives them.</p>"
                + table(["prompt", "the eval data's next tokens", "before fine-tuning", "after fine-tuning"], rows))


def stage_rows(benchmarks: Path) -> list[tuple]:
    """One row per stage that has a Snakemake benchmark file `<benchmarks>/<stage>.tsv`."""
    rows = []
    for stage in STAGES:
        if not (benchmarks / f"{stage}.tsv").is_file():
            continue
        with open(benchmarks / f"{stage}.tsv") as file:
            record = next(csv.DictReader(file, delimiter="\t"))
        rows.append((stage, stage, fmt(float(record["s"]), "seconds"), fmt(float(record["max_rss"]), "mb"),
                     fmt(float(record["cpu_time"]), "seconds")))
    return rows


def top_operators(profile_dir: Path, limit: int = TOP_OPERATORS) -> tuple[list[tuple], int]:
    """Kernel time per operator type over every trace in `profile_dir` (all
    ranks, training and optimizer graphs), most first; and the number of trace files."""
    total_us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    traces = sorted(profile_dir.glob("rank*.json")) if profile_dir.is_dir() else []
    for trace in traces:
        for event in json.loads(trace.read_text()):
            if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                total_us[event["args"]["op_name"]] += event["dur"]
                calls[event["args"]["op_name"]] += 1
    everything = sum(total_us.values()) or 1.0
    ranked = sorted(total_us, key=total_us.get, reverse=True)[:limit]
    return [(op, op, calls[op], fmt(total_us[op] / 1000, "ms"), fmt(total_us[op] / everything, "percent"))
            for op in ranked], len(traces)


def write_tables(config: Config, train_metrics: Path, export_metrics: Path, benchmarks: Path,
                 profile_dir: Path, out_dir: Path, model_json: Path | None = None,
                 samples: Path | None = None) -> None:
    import yaml

    train, export = read_train(train_metrics), read_export(export_metrics)
    description = read_description(model_json) if model_json and Path(model_json).is_file() else None
    classes = class_rows(train)
    per_class = ("<h3>Per class (eval split, last evaluation)</h3>"
                 + table(["class", "eval records", "accuracy", "precision", "recall", "F1"], classes)) if classes else ""
    pages = {
        "summary": page(f"Run {config.run.name}", table(["", "value"], summary_rows(train, export, description)) + per_class),
        "samples": samples_page(samples),
        "quantization": page("fp32 versus int8", table(["", "fp32", "int8"], quantization_rows(export))),
        "stages": page("Stages: runtime and memory (Snakemake benchmarks)",
                       table(["stage", "wall time", "peak RSS", "CPU time"], stage_rows(benchmarks))),
        "config": page("Config used", f"<pre>{html.escape(yaml.safe_dump(as_dict(config), sort_keys=False))}</pre>"),
    }
    steps = config.train.profile_steps
    if steps:
        rows, traces = top_operators(profile_dir)
        pages["profile"] = page(
            f"Operators by kernel time, steps {steps[0]} to {steps[1]}",
            f"<p>{traces} traces in <code>{html.escape(str(profile_dir))}</code> (open them in "
            "https://ui.perfetto.dev or chrome://tracing)</p>"
            + table(["operator", "calls", "kernel time", "share"], rows))
    else:
        pages["profile"] = page("Operators by kernel time",
                                "<p>Profiling was off: set <code>train.profile_steps: [first, last]</code>.</p>")
    for name, text in pages.items():
        atomic.write_text(out_dir / f"{name}.html", text)

"""A sweep's comparison, in results/sweeps/<name>/: comparison.tsv and .html (every point,
ranked by the metric), curves.png, by_key.png, and best/ (the best point's model); and
the lines `snakemake` prints at the end of a sweep."""

from __future__ import annotations

import csv
import html
import json
import math
import shlex
import shutil
import statistics
from pathlib import Path

from .. import atomic
from ..config import Config
from ..config.sections import Sweep
from ..training.run_folder import TrainFolder
from .points import SWEEP_LOGS, Point, folder, format_value, goal, point_name, points, results, rule_prefix

# The eval result each sweep.metric reads: a regression's eval loss is its MSE.
EVAL_KEYS = {"eval_loss": "loss", "accuracy": "accuracy", "perplexity": "perplexity", "mse": "loss"}
# Where a point's stages leave them (workflow/rules/export.smk).
EXPORTED_MODEL = Path("export", "model.onnx")
EXPORT_METRICS = Path("export", "metrics.json")
COLUMNS = ("rank", "point", "status", "best", "best_step", "last", "steps", "wall_time_s", "samples_per_s",
           "trained", "fp32_mb", "int8_mb", "int8_metric", "baseline", "beats_baseline")


def point_row(point: Point, sweep: Sweep, failed_stage: str | None = None) -> dict:
    """A point's line of the comparison, from its train/metrics.json and export/metrics.json.
    Its status: `finished` (exported), `trained` (its export not run yet), `failed: <stage>`
    (`failed_stage`: ranked by its training metric when training finished), `not run`."""
    from ..reporting.results import count, read_export, read_train, refusal  # numpy, ONNX: not for every Snakefile

    run = results(point.config)
    train = read_train(TrainFolder(run / "train").metrics)
    # `repeat_of`: the point that a repeat over run.seed is of (`lr-0.01` of `lr-0.01_seed-1235`).
    row = {"point": point.name, "repeat_of": point_name({k: v for k, v in point.values.items() if k != "run.seed"}),
           **point.values}
    failed = f"failed: {failed_stage}" if failed_stage else None
    if train is None:
        return {**row, "status": failed or "not run"}
    key = EVAL_KEYS[sweep.metric]
    evals = [e for e in train.history["eval"] if e.get(key) is not None]
    pick = max if goal(sweep) == "max" else min
    best = pick(evals, key=lambda e: e[key]) if evals else None
    export = read_export(run / EXPORT_METRICS)
    fp32, int8 = (export.fp32, export.int8 or {}) if export else ({}, {})
    # Only a `finished` point, exported without a failed stage, can be the sweep's model.
    status = failed or ("finished" if (run / EXPORTED_MODEL).is_file() else "trained")
    return {**row, "status": status, "best": best[key] if best else None, "best_step": best["step"] if best else None,
            "last": train.eval.get(key), "steps": train.steps, "wall_time_s": train.wall_time_s,
            "samples_per_s": train.samples_per_s, "steps_this_attempt": train.steps_this_attempt,
            # Parameters trained of all: a LoRA point trains its adapters alone (runs before this had no counts).
            "trained": f"{count(train.trainable_parameters)} of {count(train.parameters)}"
            if train.parameters is not None else None,
            "fp32_mb": megabytes(fp32.get("size_bytes")), "int8_mb": megabytes(int8.get("size_bytes")),
            "int8_metric": refusal(export) or int8.get(key), "int8_refused": refusal(export) is not None,
            **beside_baseline(best, key, train.baseline), "history": train.history}


def beside_baseline(best: dict | None, key: str, measures: dict | None) -> dict:
    """The point's baseline for the sweep's metric (data/baseline.py), and whether its best evaluation beats it."""
    from ..data import baseline  # numpy behind it: not for every Snakefile that imports this

    if best is None or measures is None or measures.get(key) is None:
        return {}
    return {"baseline": measures[key], "beats_baseline": "no" if baseline.not_beaten(best, measures) else "yes"}


def stopped(row: dict) -> dict:
    """The row of a point that successive halving stopped at the first budget."""
    return {**row, "status": "stopped" if row["status"] == "trained" else row["status"]}


def failed_stages(every: list[Point], failed_rules: list[str]) -> dict[str, str]:
    """{point: its stage that failed}, from the rules of the failed jobs (`point_<point>_train`;
    `point_<point>_first_train`, a halving point's run to the first budget). A prefix may begin
    another's (point_hidden_16, point_hidden_16_32): the longest that matches is the point's."""
    prefixes = sorted(((rule_prefix(p) + "_", p.name) for p in every), key=lambda item: -len(item[0]))
    stages = {}
    for rule in failed_rules:
        prefix, name = next(((prefix, name) for prefix, name in prefixes if rule.startswith(prefix)), (None, None))
        if prefix is None:  # not a point's rule (sweep_compare, sweep_halving)
            continue
        stage = rule.removeprefix(prefix)
        stages[name] = f"{stage.removeprefix('first_')} (to the first budget)" if stage.startswith("first_") else stage
    return stages


def megabytes(size: int | None) -> float | None:
    return None if size is None else size / 1e6


def ranked(rows: list[dict], sweep: Sweep) -> list[dict]:
    """Trained points by their best metric (best first; those that halving stopped after them),
    then failed ones; each gets its rank. With sweep.repeats, the points are ranked by the
    `mean` of their repeats' best metric (a point's repeats together), which each row gets
    with its `std`."""
    if sweep.repeats > 1:
        bests = {}
        for row in rows:
            if row.get("best") is not None:
                bests.setdefault(row["repeat_of"], []).append(row["best"])
        rows = [{**row, **spread(bests.get(row["repeat_of"], []))} for row in rows]
    sign = -1 if goal(sweep) == "max" else 1
    scored = sorted((r for r in rows if r.get("best") is not None),
                    key=lambda r: (r["status"] == "stopped", sign * r.get("mean", r["best"]), sign * r["best"]))
    rest = [r for r in rows if r.get("best") is None]
    return [{**row, "rank": i + 1 if row.get("best") is not None else ""} for i, row in enumerate(scored + rest)]


def spread(values: list[float]) -> dict:
    """The mean and the (sample) standard deviation of a point's best metric over its repeats."""
    return {"mean": statistics.fmean(values) if values else None,
            "std": statistics.stdev(values) if len(values) > 1 else None}


def survivors(config: Config) -> list[str]:
    """With sweep.halving: the points that go on after the first budget, by the metric at
    their best evaluation so far (halving.keep of them, at least one); a failed one never."""
    sweep = config.sweep
    every = points(config)
    first = [point_row(Point(p.name, p.values, p.first), sweep) for p in every]
    ranked_first = [row["point"] for row in ranked(first, sweep) if row.get("best") is not None]
    return ranked_first[:max(1, math.ceil(len(every) * sweep.halving.keep))]


def compare(config: Config, failed_rules: list[str] = ()) -> dict | None:
    """Write results/sweeps/<name>/: the table, the plots and best/; return the best
    point's record (None when no point finished). `failed_rules`: the rules of the jobs
    that failed in this `snakemake` (its onerror), which name each failed point's stage."""
    sweep, out = config.sweep, folder(config)
    every = points(config)
    swept = list(every[0].values)
    failed = failed_stages(every, failed_rules)
    kept = survivors(config) if sweep.halving.steps else [p.name for p in every]
    rows = ranked([point_row(p, sweep, failed.get(p.name)) if p.name in kept
                   else stopped(point_row(Point(p.name, p.values, p.first), sweep, failed.get(p.name)))
                   for p in every], sweep)
    write_table(rows, swept, sweep, out)
    plot_comparison(rows, swept, sweep, out)
    best = next((row for row in rows if row["status"] == "finished"), None)
    if best is None:
        return None
    record = {"point": best["point"], "metric": sweep.metric, "goal": goal(sweep), "value": best["best"],
              "step": best["best_step"], "mean": best.get("mean"), "std": best.get("std"),
              "baseline": best.get("baseline"), "beats_baseline": best.get("beats_baseline"),
              "model": str(out / "best" / "model.onnx"),
              "failed": {row["point"]: failed[row["point"]] for row in rows if row["point"] in failed},
              "not_run": [row["point"] for row in rows if row["status"] == "not run"],
              "int8_refused": [row["point"] for row in rows if row.get("int8_refused")]}
    with atomic.file(out / "best" / "model.onnx") as temporary:
        shutil.copyfile(out / best["point"] / EXPORTED_MODEL, temporary)
    with atomic.file(out / "best" / "best.json") as temporary:
        temporary.write_text(json.dumps(record, indent=2))
    return record


def cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value)


def steps_shown(row: dict):
    """A point's steps, with those of its last attempt when it resumed (`600 (60 in the last attempt)`)."""
    steps, this_attempt = row.get("steps"), row.get("steps_this_attempt")
    return steps if this_attempt is None or this_attempt == steps else f"{steps} ({this_attempt} in the last attempt)"


def write_table(rows: list[dict], swept: list[str], sweep: Sweep, out: Path) -> None:
    """comparison.tsv (to read or load) and comparison.html (for Snakemake's report): the same cells."""
    metric = f"{sweep.metric} ({goal(sweep)})"
    # With repeats, each point's mean and std over them, which rank it, before each repeat's own figures.
    # A resumed point's metrics.json times its last attempt only: the headers and its steps say so.
    spread_keys = ["mean", "std"] if sweep.repeats > 1 else []
    header = ["rank", "point", *swept, "status", *(f"{k} {metric} over repeats" for k in spread_keys),
              f"best {metric}", "best step", f"last {metric}", "steps",
              "wall time (s, last attempt)", "samples/s (last attempt)", "parameters trained", "fp32 MB", "int8 MB",
              f"int8 {sweep.metric}", f"baseline {sweep.metric}", "beats baseline"]
    keys = ["rank", "point", *swept, "status", *spread_keys, *COLUMNS[3:]]
    lines = [[cell({**row, "steps": steps_shown(row)}.get(key)) for key in keys] for row in rows]
    with atomic.file(out / "comparison.tsv") as temporary:
        with open(temporary, "w", newline="") as f:
            writer = csv.writer(f, delimiter="\t", lineterminator="\n")
            writer.writerows([header, *lines])
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(f"<tr data-key='{html.escape(row['point'])}' class='{row['status'].split(':')[0].replace(' ', '-')}'>"
                   + "".join(f"<td>{html.escape(c)}</td>" for c in line) + "</tr>" for row, line in zip(rows, lines))
    style = ("body{font-family:sans-serif;margin:1.5em} table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:4px 10px} tr.failed{color:#a00} tr.not-run{color:#888}")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>Sweep {html.escape(sweep.name)}</title>"
            f"<style>{style}</style></head><body><h2>Sweep {html.escape(sweep.name)}: every point, best first"
            f"</h2><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></body></html>")
    with atomic.file(out / "comparison.html") as temporary:
        temporary.write_text(page)


def plot_comparison(rows: list[dict], swept: list[str], sweep: Sweep, out: Path) -> None:
    """curves.png: train loss and the eval metric of every point over the steps;
    by_key.png: each point's best metric against each swept key."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..reporting.plots import save

    key = EVAL_KEYS[sweep.metric]
    finished = [row for row in rows if "history" in row]  # those that trained
    figure, (loss_axes, metric_axes) = plt.subplots(1, 2, figsize=(11, 4))
    for row in finished:
        train, evals = row["history"]["train"], [e for e in row["history"]["eval"] if e.get(key) is not None]
        loss_axes.plot([r["step"] for r in train], [r["loss"] for r in train], label=row["point"])
        metric_axes.plot([e["step"] for e in evals], [e[key] for e in evals], marker="o", label=row["point"])
    loss_axes.set(xlabel="optimizer step", ylabel="train loss", title="Train loss")
    metric_axes.set(xlabel="optimizer step", ylabel=sweep.metric, title=f"{sweep.metric} on the eval split")
    if finished:
        metric_axes.legend(fontsize="small")
    save(figure, out / "curves.png")

    figure, axes = plt.subplots(1, len(swept), figsize=(4.5 * len(swept), 4), squeeze=False)
    for axis, name in zip(axes[0], swept):
        values = [row[name] for row in finished]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        # Categories (lists, strings) in the order of their values ([8] before [16]), not the ranking's.
        try:
            order = sorted(range(len(values)), key=lambda i: values[i])
        except TypeError:  # values of different types: by their names
            order = sorted(range(len(values)), key=lambda i: format_value(values[i]))
        axis.plot([values[i] if numeric else format_value(values[i]) for i in order],
                  [finished[i]["best"] for i in order], "o")
        if numeric and values and min(values) > 0 and max(values) >= 10 * min(values):
            axis.set_xscale("log")
        axis.set(xlabel=name, ylabel=f"best {sweep.metric}", title=f"{sweep.metric} by {name}")
    save(figure, out / "by_key.png")


def summary(config: Config, best: dict | None, arguments: list[str]) -> str:
    """The lines `snakemake` prints at the end of a sweep: the best point, where everything is,
    and the command that writes the HTML report (`arguments`: those that chose this sweep)."""
    out, name = folder(config), config.sweep.name
    if best is None:
        return f"sweep {name!r}: no point finished training; the table: {out / 'comparison.tsv'}"
    lines = [f"sweep {name!r}: best point {best['point']} ({best['metric']} {best['value']:.6g}, {best['goal']}, "
             f"at step {best['step']}{over_repeats(config, best)}{beside(best)})",
             f"  its model: {best['model']}",
             f"  every point: {out / 'comparison.tsv'} (plots: {out / 'curves.png'}, {out / 'by_key.png'})"]
    if best.get("beats_baseline") == "no":
        lines.append("  warning: it does not beat the baseline: no point learned more than the labels alone tell")
    if best["failed"]:
        failed = ", ".join(f"{point} ({stage})" for point, stage in best["failed"].items())
        lines.append(f"  failed: {failed} (their logs: {SWEEP_LOGS / name}/<point>/)")
    # .get: a best.json of an earlier ortflow has neither.
    if best.get("not_run"):
        lines.append(f"  not run: {', '.join(best['not_run'])} (snakemake stopped first; --keep-going runs them)")
    if best.get("int8_refused"):
        lines.append(f"  int8 refused by the gate: {', '.join(best['int8_refused'])} (their fp32 models stand; "
                     "the comparison's int8 column says by how much)")
    lines.append(f"  report: {shlex.join(['snakemake', '--report', str(out / 'report.html'), *arguments])}")
    return "\n".join(lines)


def over_repeats(config: Config, best: dict) -> str:
    """`; mean 0.41 (std 0.02) over its repeats`: what ranked the best point, with sweep.repeats."""
    if config.sweep.repeats == 1:
        return ""
    std = "n/a" if best["std"] is None else f"{best['std']:.3g}"
    return f"; mean {best['mean']:.6g} (std {std}) over its repeats"


def beside(best: dict) -> str:
    """`; baseline 0.1`: what the metric of predicting from the labels alone is (data/baseline.py)."""
    return "" if best.get("baseline") is None else f"; baseline {best['baseline']:.6g}"

"""Sweeps: many runs from one config, one per point of its `sweep` section (a
grid, random draws, repeats over run.seed), and their comparison.

The workflow (workflow/rules/sweep.smk) makes each point a run of its own, with
every stage, from `points(config)`; this module names the points, checks their
configs before any job runs, and `ortflow sweep compare` writes the comparison
in results/sweeps/<name>/: comparison.tsv and .html (every point, sorted by the
metric), curves.png, by_key.png, and best/ (the best point's model).
"""

from __future__ import annotations

import copy
import csv
import html
import json
import math
import random
import re
import shlex
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

from . import atomic
from .config import ConfigError, _merge, expand_dotted, pick, read_value, validate
from .digests import digest
from .training.run_folder import TrainFolder

HELP = "compare the points of a sweep (the table, the plots and the best point's model)"

SWEEPS = Path("results", "sweeps")
SWEEP_LOGS = Path("logs", "sweeps")
# The eval result each sweep.metric reads: a regression's eval loss is its MSE.
EVAL_KEYS = {"eval_loss": "loss", "accuracy": "accuracy", "perplexity": "perplexity", "mse": "loss"}
# Where a point's stages leave them (workflow/rules/export.smk).
EXPORTED_MODEL = Path("export", "model.onnx")
EXPORT_METRICS = Path("export", "metrics.json")
# With sweep.halving: which points go on after the first budget (`ortflow sweep halve`).
HALVING = "halving.json"
COLUMNS = ("rank", "point", "status", "best", "best_step", "last", "steps", "wall_time_s", "samples_per_s",
           "fp32_mb", "int8_mb", "int8_metric", "baseline", "beats_baseline")


@dataclass(frozen=True)
class Point:
    name: str  # readable and stable: from the point's values alone (micro_batch_size-16_lr-0.001)
    values: dict  # dotted config key -> this point's value
    config: dict  # the validated config of the point's run
    first: dict | None = None  # with sweep.halving: the config of its run to the first budget


def is_sweep(config: dict) -> bool:
    """Whether `config` asks for a sweep (a grid or random points), rather than being one run."""
    sweep = config["sweep"]
    return not sweep["point"] and bool(sweep["grid"] or sweep["random"]["points"])


def folder(config: dict) -> Path:
    """results/sweeps/<name>: the comparison, and a folder per point."""
    return SWEEPS / config["sweep"]["name"]


def results(config: dict) -> Path:
    """A run's folder: results/<run.name>, or results/sweeps/<sweep>/<point> for a sweep's point."""
    point = config["sweep"]["point"]
    return folder(config) / point if point else Path("results", config["run"]["name"])


def logs(config: dict) -> Path:
    point = config["sweep"]["point"]
    return SWEEP_LOGS / config["sweep"]["name"] / point if point else Path("logs", config["run"]["name"])


def shared(config: dict, stage: str, keys) -> Path:
    """The folder of a stage that a sweep's points share: named by the config keys it
    depends on (`data-<digest>`), so that the points whose keys are equal find it made."""
    return folder(config) / "shared" / f"{stage}-{digest(pick(config, keys))[:12]}"


def rule_prefix(point: Point) -> str:
    """The prefix of a point's rules (`point_lr_0_001_train`): a Python name."""
    return "point_" + re.sub(r"\W", "_", point.name)


def goal(sweep: dict) -> str:
    if sweep["goal"] != "auto":
        return sweep["goal"]
    return "max" if sweep["metric"] == "accuracy" else "min"


def points(config: dict) -> list[Point]:
    """Every point of the sweep, each config validated: a bad key or value
    names the point and the key, before any job runs."""
    sweep = config["sweep"]
    for key in [*sweep["grid"], *sweep["random"]["ranges"]]:
        if key == "run.name" or key.split(".")[0] == "sweep":
            raise ConfigError(f"config key 'sweep': '{key}' cannot be swept (the sweep names each point's run)")
    combinations = [{}]
    # Keys in sorted order, here and in the draws: the names and the draws do not depend on the
    # order the keys are written in (the rules pass the config as JSON with sorted keys).
    for key, values in sorted(sweep["grid"].items()):
        combinations = [{**c, key: value} for c in combinations for value in values]
    draws = random_draws(sweep["random"])
    # Each value as the point's config will read it, so that its name and its column say the
    # same (YAML gives `1e-3` as text, the config reads it as 0.001).
    chosen = [{key: read_value(key, value) for key, value in sorted({**c, **d}.items())}
              for c in combinations for d in draws]
    if sweep["repeats"] > 1:
        seed = config["run"]["seed"]
        chosen = [{**c, "run.seed": seed + r} for c in chosen for r in range(sweep["repeats"])]
    named = {point_name(values): values for values in chosen}
    if len(named) < len(chosen):
        raise ConfigError("config key 'sweep': two points have the same values; list each value once")
    chosen = [Point(name, values, point_config(config, name, values)) for name, values in named.items()]
    return [halved(point, sweep["halving"]) for point in chosen] if sweep["halving"]["steps"] else chosen


def halved(point: Point, halving: dict) -> Point:
    """`point` with the run to the first budget of steps (its name `<point>.steps-<budget>`), from
    whose last checkpoint the point's own run goes on when the point is kept (train.resume_from)."""
    budget, train = halving["steps"], point.config["train"]
    if train["lr_schedule"]["name"] != "constant":
        raise ConfigError(f"sweep point {point.name!r}: config key 'sweep.halving.steps' needs "
                          f"train.lr_schedule.name: constant, not {train['lr_schedule']['name']!r} (a decaying "
                          "schedule spreads over train.steps: the first budget would train differently)")
    if budget >= train["steps"]:
        raise ConfigError(f"sweep point {point.name!r}: config key 'sweep.halving.steps': {budget} is not below "
                          f"train.steps={train['steps']}")
    from .checkpoints.layout import step_dir  # numpy and ONNX: not for every Snakefile that imports this

    first = copy.deepcopy(point.config)
    first["sweep"]["point"] = f"{point.name}.steps-{budget}"
    first["run"]["name"] += f".steps-{budget}"
    first["train"]["steps"] = budget
    final = copy.deepcopy(point.config)
    final["train"]["resume_from"] = str(step_dir(TrainFolder(results(first) / "train").checkpoints, budget))
    return Point(point.name, point.values, final, first)


def survivors(config: dict) -> list[str]:
    """With sweep.halving: the points that go on after the first budget, by the metric at
    their best evaluation so far (halving.keep of them, at least one); a failed one never."""
    sweep = config["sweep"]
    every = points(config)
    first = [point_row(Point(p.name, p.values, p.first), sweep) for p in every]
    ranked_first = [row["point"] for row in ranked(first, sweep) if row.get("best") is not None]
    return ranked_first[:max(1, math.ceil(len(every) * sweep["halving"]["keep"]))]


def random_draws(random_search: dict) -> list[dict]:
    """random.points draws from random.ranges with random.seed, one value per range (by key):
    adding draws keeps the earlier ones. Floats keep 4 significant digits,
    so that the name shows the value trained."""
    if not random_search["points"]:
        return [{}]
    generator = random.Random(random_search["seed"])
    draws = []
    for _ in range(random_search["points"]):
        draw = {}
        for key, ((kind, bounds),) in ((k, tuple(r.items())) for k, r in sorted(random_search["ranges"].items())):
            if kind == "choice":
                draw[key] = generator.choice(bounds)
                continue
            low, high = (math.log(b) for b in bounds) if kind == "log_uniform" else bounds
            value = generator.uniform(low, high)
            draw[key] = float(f"{math.exp(value) if kind == 'log_uniform' else value:.4g}")
        draws.append(draw)
    return draws


def point_name(values: dict) -> str:
    """`micro_batch_size-16_lr-0.001`: each key (in sorted order) by its last part (the whole dotted key when
    two keys share it), then the value; characters a folder name should not have become '_'."""
    last = [key.split(".")[-1] for key in values]
    parts = []
    for key, value in values.items():
        label = key.split(".")[-1] if last.count(key.split(".")[-1]) == 1 else key
        parts.append(f"{label}-{format_value(value)}")
    return re.sub(r"[^A-Za-z0-9._-]", "_", "_".join(parts)) or "base"


def format_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):  # 0.001, 3e-05 as 3e-5, 1e+09 as 1e9
        return re.sub(r"e([+-])0*(\d)", lambda m: "e" + m[1].strip("+") + m[2], f"{value:g}")
    if isinstance(value, (list, tuple)):
        return "-".join(format_value(v) for v in value)
    return str(value)


def point_config(config: dict, name: str, values: dict) -> dict:
    """The base config with the point's values, as the run of point `name` of the sweep."""
    base = copy.deepcopy(config)
    base["sweep"] = {"name": config["sweep"]["name"], "point": name}
    merged = _merge(base, expand_dotted(values))
    merged["run"]["name"] = f"{config['sweep']['name']}.{name}"
    try:
        return validate(merged)
    except ConfigError as error:
        raise ConfigError(f"sweep point {name!r}: {error}") from None


# --- the comparison -----------------------------------------------------------------------------------


def point_row(point: Point, sweep: dict, failed_stage: str | None = None) -> dict:
    """A point's line of the comparison, from its train/metrics.json and export/metrics.json.
    Its status: `finished` (exported), `trained` (its export not run yet), `failed: <stage>`
    (`failed_stage`: ranked by its training metric when training finished), `not run`."""
    from .report import read_json, refusal  # numpy and ONNX behind them: not for every Snakefile that imports this

    run = results(point.config)
    train = read_json(TrainFolder(run / "train").metrics)
    # `repeat_of`: the point that a repeat over run.seed is of (`lr-0.01` of `lr-0.01_seed-1235`).
    row = {"point": point.name, "repeat_of": point_name({k: v for k, v in point.values.items() if k != "run.seed"}),
           **point.values}
    failed = f"failed: {failed_stage}" if failed_stage else None
    if train is None:
        return {**row, "status": failed or "not run"}
    key = EVAL_KEYS[sweep["metric"]]
    evals = [e for e in train["history"]["eval"] if e.get(key) is not None]
    pick = max if goal(sweep) == "max" else min
    best = pick(evals, key=lambda e: e[key]) if evals else None
    export = read_json(run / EXPORT_METRICS) or {}
    int8 = export.get("int8") or {}
    # Only a `finished` point, exported without a failed stage, can be the sweep's model.
    status = failed or ("finished" if (run / EXPORTED_MODEL).is_file() else "trained")
    return {**row, "status": status, "best": best[key] if best else None, "best_step": best["step"] if best else None,
            "last": train["eval"].get(key), "steps": train["steps"], "wall_time_s": train["wall_time_s"],
            "samples_per_s": train["samples_per_s"], "steps_this_attempt": train.get("steps_this_attempt"),
            "fp32_mb": megabytes(export.get("fp32", {}).get("size_bytes")), "int8_mb": megabytes(int8.get("size_bytes")),
            "int8_metric": refusal(export) or int8.get(key), "int8_refused": refusal(export) is not None,
            **beside_baseline(best, key, train.get("baseline")), "history": train["history"]}


def beside_baseline(best: dict | None, key: str, measures: dict | None) -> dict:
    """The point's baseline for the sweep's metric (data/baseline.py), and whether its best evaluation beats it."""
    from .data import baseline  # numpy behind it: not for every Snakefile that imports this

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


def ranked(rows: list[dict], sweep: dict) -> list[dict]:
    """Trained points by their best metric (best first; those that halving stopped after them),
    then failed ones; each gets its rank. With sweep.repeats, the points are ranked by the
    `mean` of their repeats' best metric (a point's repeats together), which each row gets
    with its `std`."""
    if sweep["repeats"] > 1:
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


def compare(config: dict, failed_rules: list[str] = ()) -> dict | None:
    """Write results/sweeps/<name>/: the table, the plots and best/; return the best
    point's record (None when no point finished). `failed_rules`: the rules of the jobs
    that failed in this `snakemake` (its onerror), which name each failed point's stage."""
    sweep, out = config["sweep"], folder(config)
    every = points(config)
    swept = list(every[0].values)
    failed = failed_stages(every, failed_rules)
    kept = survivors(config) if sweep["halving"]["steps"] else [p.name for p in every]
    rows = ranked([point_row(p, sweep, failed.get(p.name)) if p.name in kept
                   else stopped(point_row(Point(p.name, p.values, p.first), sweep, failed.get(p.name)))
                   for p in every], sweep)
    write_table(rows, swept, sweep, out)
    plot_comparison(rows, swept, sweep, out)
    best = next((row for row in rows if row["status"] == "finished"), None)
    if best is None:
        return None
    record = {"point": best["point"], "metric": sweep["metric"], "goal": goal(sweep), "value": best["best"],
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


def write_table(rows: list[dict], swept: list[str], sweep: dict, out: Path) -> None:
    """comparison.tsv (to read or load) and comparison.html (for Snakemake's report): the same cells."""
    metric = f"{sweep['metric']} ({goal(sweep)})"
    # With repeats, each point's mean and std over them, which rank it, before each repeat's own figures.
    # A resumed point's metrics.json times its last attempt only: the headers and its steps say so.
    spread_keys = ["mean", "std"] if sweep["repeats"] > 1 else []
    header = ["rank", "point", *swept, "status", *(f"{k} {metric} over repeats" for k in spread_keys),
              f"best {metric}", "best step", f"last {metric}", "steps",
              "wall time (s, last attempt)", "samples/s (last attempt)", "fp32 MB", "int8 MB",
              f"int8 {sweep['metric']}", f"baseline {sweep['metric']}", "beats baseline"]
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
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>Sweep {html.escape(sweep['name'])}</title>"
            f"<style>{style}</style></head><body><h2>Sweep {html.escape(sweep['name'])}: every point, best first"
            f"</h2><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></body></html>")
    with atomic.file(out / "comparison.html") as temporary:
        temporary.write_text(page)


def plot_comparison(rows: list[dict], swept: list[str], sweep: dict, out: Path) -> None:
    """curves.png: train loss and the eval metric of every point over the steps;
    by_key.png: each point's best metric against each swept key."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import save

    key = EVAL_KEYS[sweep["metric"]]
    finished = [row for row in rows if "history" in row]  # those that trained
    figure, (loss_axes, metric_axes) = plt.subplots(1, 2, figsize=(11, 4))
    for row in finished:
        train, evals = row["history"]["train"], [e for e in row["history"]["eval"] if e.get(key) is not None]
        loss_axes.plot([r["step"] for r in train], [r["loss"] for r in train], label=row["point"])
        metric_axes.plot([e["step"] for e in evals], [e[key] for e in evals], marker="o", label=row["point"])
    loss_axes.set(xlabel="optimizer step", ylabel="train loss", title="Train loss")
    metric_axes.set(xlabel="optimizer step", ylabel=sweep["metric"], title=f"{sweep['metric']} on the eval split")
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
        axis.set(xlabel=name, ylabel=f"best {sweep['metric']}", title=f"{sweep['metric']} by {name}")
    save(figure, out / "by_key.png")


def summary(config: dict, best: dict | None, arguments: list[str]) -> str:
    """The lines `snakemake` prints at the end of a sweep: the best point, where everything is,
    and the command that writes the HTML report (`arguments`: those that chose this sweep)."""
    out, name = folder(config), config["sweep"]["name"]
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


def over_repeats(config: dict, best: dict) -> str:
    """`; mean 0.41 (std 0.02) over its repeats`: what ranked the best point, with sweep.repeats."""
    if config["sweep"]["repeats"] == 1:
        return ""
    std = "n/a" if best["std"] is None else f"{best['std']:.3g}"
    return f"; mean {best['mean']:.6g} (std {std}) over its repeats"


def beside(best: dict) -> str:
    """`; baseline 0.1`: what the metric of predicting from the labels alone is (data/baseline.py)."""
    return "" if best.get("baseline") is None else f"; baseline {best['baseline']:.6g}"


def add_arguments(parser) -> None:
    from .config import add_config_arguments

    sub = parser.add_subparsers(dest="action", required=True)
    comparison = sub.add_parser("compare", help="results/sweeps/<name>/: the table, the plots and best/")
    add_config_arguments(comparison)
    halving = sub.add_parser("halve", help="results/sweeps/<name>/halving.json: the points that go on")
    add_config_arguments(halving)


def run(args) -> int:
    from .config import as_dict, load_config

    config = as_dict(load_config(args))  # the points' configs are made from it as data (`points`)
    if args.action == "halve":
        kept = survivors(config)
        record = {"steps": config["sweep"]["halving"]["steps"], "survivors": kept,
                  "stopped": [p.name for p in points(config) if p.name not in kept]}
        with atomic.file(folder(config) / HALVING) as temporary:
            temporary.write_text(json.dumps(record, indent=2))
        print(f"sweep {config['sweep']['name']!r}: {', '.join(kept)} go on; {', '.join(record['stopped'])} stop")
        return 0
    print(summary(config, compare(config), []))
    return 0

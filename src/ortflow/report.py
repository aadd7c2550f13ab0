"""What a person sees of a run: the plots and tables of `snakemake --report`,
and the few lines printed when `snakemake` finishes.

`ortflow report plots` draws the training curves from train/metrics.json;
`ortflow report tables` writes the HTML tables (the run at a glance, fp32
versus int8, each stage's runtime and memory, the operators that took the most
time in the profiled steps, the config used). Every number comes from the
metrics files the stages wrote, formatted by the one function `fmt`.
"""

from __future__ import annotations

import csv
import html
import json
import re
import shlex
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from . import atomic
from .data import baseline
from .config import Config, as_dict
from .errors import MissingInputError
from .checkpoints.best import chosen
from .wording import plural

HELP = "plots and tables of a run for `snakemake --report`"

PLOTS = ("loss", "learning_rate", "throughput")
TABLES = ("summary", "quantization", "stages", "profile", "config")
# The stages in pipeline order, as the rules and their benchmark files are named.
STAGES = ("prepare_data", "build_artifacts", "train", "merge_checkpoint", "export_model", "quantize_model")
TOP_OPERATORS = 15


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


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def quality(results: dict) -> tuple[str, str]:
    """(name, shown value) of the quality measure of an eval: accuracy, perplexity or loss."""
    if "perplexity" in results:
        return "perplexity", fmt(results["perplexity"], "float")
    if "accuracy" in results:
        return "accuracy", fmt(results["accuracy"], "percent")
    return "loss", fmt(results["loss"], "float")


def baseline_shown(train: dict | None) -> str | None:
    """The shown baseline of a run (train/metrics.json's `baseline`, data/baseline.py), beside its
    measures: `mse 7042.1008, R^2 -0.0024 (predicting the train split's mean)`."""
    measures = (train or {}).get("baseline")
    if not measures:
        return None
    shown = {"accuracy": ("accuracy", "percent"), "loss": ("mse", "float"), "r2": ("R^2", "float"),
             "perplexity": ("perplexity", "float")}
    parts = [f"{label} {fmt(measures[key], kind)}" for key, (label, kind) in shown.items() if key in measures]
    return f"{', '.join(parts)} (predicting {measures['of']})"


def not_beaten(train: dict | None) -> str | None:
    """What a run's summary warns of when its last evaluation does not beat the baseline."""
    return baseline.not_beaten(train["eval"], train.get("baseline")) if train else None


def refusal(export: dict | None) -> str | None:
    """`refused by the gate, -3.6 points (export.max_accuracy_drop: 1)` when the quality gate
    refused the int8 model (export/metrics.json), else None."""
    gate = (export or {}).get("gate")
    if not gate or gate.get("outcome") != "refused":  # before the outcome was kept, a refusal failed the stage
        return None
    change = f"{-gate['drop']:+.3g} points" if gate["unit"] == "points" else f"{gate['drop']:+.3g}% {gate['metric']}"
    return f"refused by the gate, {change} (export.max_accuracy_drop: {gate['max_accuracy_drop']:g})"


def speedup(export: dict) -> float | None:
    """How many times faster int8 runs than fp32 at batch 64 (median latency)."""
    if "int8" not in export:
        return None
    return export["fp32"]["latency_ms"]["b64_p50"] / export["int8"]["latency_ms"]["b64_p50"]


# --- plots -------------------------------------------------------------------------------------------


def plot_training(metrics: dict, config: Config, out_dir: Path) -> None:
    """loss.png (train and eval loss, eval quality), learning_rate.png (the
    whole schedule and the logged rates), throughput.png (samples/s and step time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .training.schedule import learning_rate

    train, evals = metrics["history"]["train"], metrics["history"]["eval"]
    steps = [row["step"] for row in train]

    figure, (loss_axes, quality_axes) = plt.subplots(1, 2, figsize=(10, 4))
    loss_axes.plot(steps, [row["loss"] for row in train], marker=".", label="train (global batch)")
    loss_axes.plot([row["step"] for row in evals], [row["loss"] for row in evals], marker="o", label="eval (whole split)")
    loss_axes.set(xlabel="optimizer step", ylabel="loss", title="Loss")
    loss_axes.legend()
    name = next((key for key in ("perplexity", "accuracy") if evals and key in evals[0]), None)
    if name:
        quality_axes.plot([row["step"] for row in evals], [row[name] for row in evals], marker="o", color="C1")
    quality_axes.set(xlabel="optimizer step", ylabel=name or "-", title=f"Eval {name or '(no quality measure)'}")
    save(figure, out_dir / "loss.png")

    train_cfg = config.train
    all_steps = range(train_cfg.steps)
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot([s + 1 for s in all_steps],
              [learning_rate(s, train_cfg.steps, train_cfg.optimizer.lr, train_cfg.lr_schedule)
               for s in all_steps], label=f"{train_cfg.lr_schedule.name} schedule")
    axes.plot(steps, [row["lr"] for row in train], "o", label="logged")
    axes.set(xlabel="optimizer step", ylabel="learning rate", title="Learning rate")
    axes.legend()
    save(figure, out_dir / "learning_rate.png")

    figure, (rate_axes, time_axes) = plt.subplots(1, 2, figsize=(10, 4))
    rates = [row["samples_per_s"] for row in train]
    rate_axes.plot(steps, rates, marker=".", label="logged step")
    if metrics["samples_per_s"] is not None:  # None: the last attempt ran no step
        rate_axes.axhline(metrics["samples_per_s"], color="C2", linestyle="--", label="steady state (run)")
    rate_axes.set(xlabel="optimizer step", ylabel="samples/s", title="Throughput")
    rate_axes.legend()
    time_axes.plot(steps, [1000 * metrics["global_batch_size"] / rate for rate in rates], marker=".",
                   label="logged step")
    for key, style in (("step_time_p50_s", "--"), ("step_time_p95_s", ":")):
        if metrics[key] is not None:
            time_axes.axhline(1000 * metrics[key], color="C3", linestyle=style, label=key[10:13] + " (run)")
    time_axes.set(xlabel="optimizer step", ylabel="ms", title="Step time")
    time_axes.legend()
    save(figure, out_dir / "throughput.png")


def save(figure, path: Path) -> None:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    with atomic.file(path) as temporary:
        figure.savefig(temporary, dpi=100, format="png")
    plt.close(figure)


# --- tables ------------------------------------------------------------------------------------------


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


def summary_rows(train: dict | None, export: dict | None) -> list[tuple]:
    rows = []
    if export:
        name, shown = quality(export["fp32"])
        rows.append(("fp32", f"{name} (fp32, eval split)", shown))
        if "int8" in export:
            rows.append(("int8", f"{name} (int8, {export['quantize']})", quality(export["int8"])[1]))
            rows.append(("speedup", "int8 speed-up (batch 64, 1 thread)", fmt(speedup(export), "ratio")))
        if refusal(export):
            rows.append(("gate", "int8", refusal(export)))
    elif train:
        name, shown = quality(train["eval"])
        rows.append(("eval", f"{name} (eval at the last step)", shown))
    if baseline_shown(train):
        rows.append(("baseline", "baseline (eval split)", baseline_shown(train)))
        rows.append(("beats_baseline", "beats the baseline", "no" if not_beaten(train) else "yes"))
    if train:
        rows += [
            ("steps", "optimizer steps", str(train["steps"])),
            ("wall_time_s", "training time", fmt(train["wall_time_s"], "seconds")),
            ("samples_per_s", "samples/s (steady state)", fmt(train["samples_per_s"], "rate")),
            ("ranks", "ranks", str(len(train["peak_rss_mb"]))),
        ]
    return rows


def class_rows(train: dict | None) -> list[tuple]:
    """Each class of a classifier (by its name: a label of strings' own, else its id)
    with its eval records and accuracy, from the last evaluation of train/metrics.json."""
    per_class = (train or {}).get("eval", {}).get("per_class", {})
    return [(name, name, str(entry["count"]), fmt(entry["accuracy"], "percent")) for name, entry in per_class.items()]


def quantization_rows(export: dict) -> list[tuple]:
    models = [m for m in ("fp32", "int8") if m in export]
    measures = [("loss", "loss", "float")]
    measures += [(k, k, "percent" if k == "accuracy" else "float")
                 for k in ("accuracy", "perplexity") if k in export["fp32"]]
    rows = [(k, label, *(fmt(export[m][k], kind) for m in models)) for k, label, kind in measures]
    rows.append(("size_bytes", "size", *(fmt(export[m]["size_bytes"] / 1e6, "mb") for m in models)))
    rows += [(f"latency_ms.{k}", f"latency {k.replace('_', ' ')}", *(fmt(export[m]["latency_ms"][k], "ms")
                                                                    for m in models))
             for k in export["fp32"]["latency_ms"]]
    return rows


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
                 profile_dir: Path, out_dir: Path) -> None:
    import yaml

    train, export = read_json(train_metrics), read_json(export_metrics)
    classes = class_rows(train)
    per_class = ("<h3>Per class (eval split, last evaluation)</h3>"
                 + table(["class", "eval records", "accuracy"], classes)) if classes else ""
    pages = {
        "summary": page(f"Run {config.run.name}", table(["", "value"], summary_rows(train, export)) + per_class),
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


# --- the end-of-run summary --------------------------------------------------------------------------


def run_summary(results: str | Path, *, train_metrics: str | Path, export_metrics: str | Path, model: str | Path,
                int8: str | Path, checkpoint: str | Path, report: str | Path, reported: Iterable[str | Path] = (),
                targets: Iterable[str] = (), run_arguments: Sequence[str] = (),
                artifacts: str | Path | None = None) -> str:
    """A few lines on what exists of the run in the folder `results`: printed when
    `snakemake` finishes, whichever stages ran. The files are where the rules
    write them (the Snakefile passes their outputs); `report` is the report
    command's page. `run_arguments` are those that chose the run (--configfile,
    --config): the report command needs them too. `artifacts` (build_artifacts'
    folder) tells whether the model's output follows its logits (a final Softmax)."""
    results, model, int8 = Path(results), Path(model), Path(int8)
    train, export = read_json(Path(train_metrics)), read_json(Path(export_metrics))
    description = read_json(Path(artifacts) / "model.json") if artifacts else None
    lines = [f"ortflow: run {results.name} in {results}"]
    outputs = description["outputs"] if description else {}
    if "inference" in outputs and outputs["inference"] != outputs["logits"]:
        lines.append(f"  output    {outputs['inference']!r} follows the logits {outputs['logits']!r} (a final Softmax "
                     "or LogSoftmax, kept in the exported model); the loss is computed on the logits")
    # An int8 model the gate refused, or no smaller than the fp32 one, is not offered (the lines below say why).
    offered = (bool(export) and "int8" in export and not refusal(export)
               and export["int8"]["size_bytes"] < export["fp32"]["size_bytes"])
    if model.is_file():
        lines.append(f"  model     {model}" + (f" (int8: {int8})" if int8.is_file() and offered else ""))
    if export:
        name, shown = quality(export["fp32"])
        line = f"  {name:<9} {shown}"
        if "int8" in export:
            line += f", int8 {quality(export['int8'])[1]}, int8 speed-up {fmt(speedup(export), 'ratio')} at batch 64"
        lines.append(line)
        if refusal(export):
            lines.append(f"  int8      {refusal(export)}: deploy the fp32 model")
    elif train:
        name, shown = quality(train["eval"])
        lines.append(f"  {name:<9} {shown} (eval at step {train['steps']})")
    if baseline_shown(train):
        lines.append(f"  baseline  {baseline_shown(train)}")
    if train:
        this_attempt = train.get("steps_this_attempt", train["steps"])
        lines.append(f"  training  {train['steps']} steps ({this_attempt} in this attempt) in "
                     f"{fmt(train['wall_time_s'], 'seconds')}, {fmt(train['samples_per_s'], 'rate')} samples/s "
                     f"on {plural(len(train['peak_rss_mb']), 'rank')}")
        if train.get("stopped_early"):
            best = train["best"]
            lines.append(f"  stopped   early after step {train['steps']}: eval {best['metric']} had not improved "
                         f"since step {best['step']}")
    merged = read_json(Path(checkpoint) / "meta.json")
    if merged:
        lines.append(f"  exported  the checkpoint of step {merged['step']}, the {chosen(merged)}")
    lines += [f"  warning   {warning}" for warning in [not_beaten(train), *(export or {}).get("warnings", [])]
              if warning]
    if len(lines) == 1:
        lines.append("  nothing trained yet")
    lines.append(f"  report    {shlex.join(report_command(report, reported, targets, run_arguments))}")
    return "\n".join(lines)


def report_command(report: str | Path, reported: Iterable[str | Path], targets: Iterable[str],
                   run_arguments: Sequence[str]) -> list[str]:
    """The `snakemake --report` command of this run. It refuses to start while a file
    marked for the report (`reported`) does not exist, as after a run of some stages
    (`snakemake merge_checkpoint`): then it reports on this run's `targets` only
    (what they made, with Snakemake's own pages), the workflow's plots and tables
    once `snakemake` has made them. The targets go before `run_arguments`, whose
    --configfile would take them for more files."""
    missing = [path for path in reported if not Path(path).exists()]
    return ["snakemake", "--report", str(report), *(sorted(targets) if missing else ()), *run_arguments]


# --- a failed run ------------------------------------------------------------------------------------

# How ortflow marks an error in a stage's log: the command's message
# (`ortflow <command>: error: ...`, its further lines indented: cli.py) and a
# log record of level ERROR (a rank's `[rank R] ERROR ...`). A log without them
# (a traceback) shows its last lines.
ERROR_MARKERS = (": error: ", " ERROR ")
TAIL_LINES = 10
# A rank killed by a signal writes nothing itself; mpirun's notice, wrapped over
# lines in a box of dashes, is the only word of it: "prterun noticed that process
# rank 1 with PID 4242 on node n1 exited on signal 9 (Killed)."
MPIRUN_NOTICE = "noticed that process rank"
KILLED_RANK = re.compile(rf"{MPIRUN_NOTICE} \d+ .*exited on signal \d+")
MPIRUN_RULE = re.compile(r"-{20,}")


def stage_failures(failed: Iterable[tuple[str, Sequence[str]]]) -> str:
    """For each failed stage, (rule, its log files), what its log says went wrong
    (`error_lines`): printed last when `snakemake` fails, so that nobody needs to open the log."""
    lines = []
    for rule, logs in failed:
        for log in logs:
            path = Path(log)
            # NUL bytes: a log that several processes wrote at their own offsets.
            text = path.read_text(errors="replace").replace("\0", "").splitlines() if path.is_file() else []
            lines.append(f"ortflow: stage {rule} failed; from {log}:")
            lines += [f"  {line}" for line in error_lines(text)] or ["  (nothing in the log)"]
    return "\n".join(lines)


def error_lines(text: list[str]) -> list[str]:
    """The lines of a log that say what went wrong: each marked line with the
    indented lines that go on with its message (a reason, a fix), and mpirun's
    notice of a rank killed by a signal, joined into one line; else the log's
    last TAIL_LINES."""
    shown, continued = [], False
    for index, line in enumerate(text):
        if any(marker in line for marker in ERROR_MARKERS):
            shown.append(line.strip())
            continued = True
        elif continued and line[:1].isspace() and line.strip():
            shown.append(line.rstrip())
        else:
            continued = False
            notice = " ".join(wrapped(text[index:])) if MPIRUN_NOTICE in line else ""
            if KILLED_RANK.search(notice):
                shown.append(notice)
    return shown or [line.strip() for line in text[-TAIL_LINES:]]


def wrapped(lines: list[str]) -> list[str]:
    """The first of `lines` and those that go on with it, up to a blank line or mpirun's rule of dashes."""
    out = [lines[0].strip()]
    for line in lines[1:]:
        if not line.strip() or MPIRUN_RULE.fullmatch(line.strip()):
            break
        out.append(line.strip())
    return out


# --- command line ------------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    from .config import add_config_arguments

    sub = parser.add_subparsers(dest="action", required=True)
    plots = sub.add_parser("plots", help="loss, learning-rate and throughput plots (PNG) from train/metrics.json")
    add_config_arguments(plots)
    plots.add_argument("--metrics", type=Path, required=True, help="train/metrics.json")
    plots.add_argument("--out", type=Path, required=True, help="folder for the PNG files")
    tables = sub.add_parser("tables", help="summary, fp32-vs-int8, stages, profile and config tables (HTML)")
    add_config_arguments(tables)
    tables.add_argument("--train-metrics", type=Path, required=True)
    tables.add_argument("--export-metrics", type=Path, required=True)
    tables.add_argument("--benchmarks", type=Path, required=True, help="folder of the stages' <rule>.tsv")
    tables.add_argument("--profile", type=Path, required=True, help="train/profile/ (the traces)")
    tables.add_argument("--out", type=Path, required=True, help="folder for the HTML files")


def run(args) -> int:
    from .config import load_config

    config = load_config(args)
    if args.action == "plots":
        metrics = read_json(args.metrics)
        if metrics is None:
            raise MissingInputError(f"{args.metrics}: no training metrics (run the train stage first)")
        plot_training(metrics, config, args.out)
    else:
        write_tables(config, args.train_metrics, args.export_metrics, args.benchmarks, args.profile, args.out)
    return 0

"""`ortflow report plots|tables`: the plots and the HTML tables of a run for
`snakemake --report` (reporting/plots.py, reporting/tables.py)."""

from __future__ import annotations

from pathlib import Path

from ..reporting.plots import plot_training
from ..reporting.tables import write_tables
from ..training.run_summary import read_run_summary

# The config keys each subcommand reads, which its rule passes (stages/__init__.py): what it plots
# or shows.
PLOT_KEYS = ("train.steps", "train.optimizer.lr", "train.lr_schedule")
TABLES_KEYS = ("run", "data", "model", "train", "export")
HELP = "plots and tables of a run for `snakemake --report`"


def add_arguments(parser) -> None:
    from ..config import add_config_arguments

    sub = parser.add_subparsers(dest="action", required=True)
    plots = sub.add_parser("plots", help="loss, learning-rate and throughput plots (PNG) from train/metrics.json")
    add_config_arguments(plots)
    plots.add_argument("--metrics", type=Path, required=True, help="train/metrics.json")
    plots.add_argument("--out", type=Path, required=True, help="folder for the PNG files")
    tables = sub.add_parser("tables", help="summary, samples, fp32-vs-int8, stages, profile and config tables (HTML)")
    add_config_arguments(tables)
    tables.add_argument("--train-metrics", type=Path, required=True)
    tables.add_argument("--export-metrics", type=Path, required=True)
    tables.add_argument("--benchmarks", type=Path, required=True, help="folder of the stages' <rule>.tsv")
    tables.add_argument("--profile", type=Path, required=True, help="train/profile/ (the traces)")
    tables.add_argument("--model-json", type=Path, help="build_artifacts' model.json (the parameters trained)")
    tables.add_argument("--samples", type=Path, help="export/samples.json (none where the run has no generation folder)")
    tables.add_argument("--out", type=Path, required=True, help="folder for the HTML files")


def run(args) -> int:
    from ..config import load_config

    config = load_config(args)
    if args.action == "plots":
        plot_training(read_run_summary(args.metrics), config, args.out)
    else:
        write_tables(config, args.train_metrics, args.export_metrics, args.benchmarks, args.profile, args.out,
                     args.model_json, args.samples)
    return 0

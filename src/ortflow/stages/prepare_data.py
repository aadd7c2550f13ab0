"""The prepare_data stage: read `data.source`, split it by `data.split_seed`, standardize
float inputs if `data.standardize` (standardize.py), write shards, and score the baseline
a model must beat on the eval split (baseline.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .. import config as config_mod
from ..data import baseline, sources, standardize
from ..data.shards import write_split
from ..models import IGNORE_INDEX

log = logging.getLogger("ortflow.prepare_data")
SHOWN_CLASSES = 10  # classes named in a message, at most


def split_rows(n: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded split; each side sorted so that shards keep the source order."""
    order = np.random.default_rng(seed).permutation(n)
    n_eval = int(round(n * eval_fraction))
    if n_eval == 0 or n_eval == n:
        raise sources.DataError(
            f"data.eval_fraction={eval_fraction} of {n} samples leaves an empty "
            f"{'eval' if n_eval == 0 else 'train'} split"
        )
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


def check_eval_classes(dataset: sources.Dataset, train_rows: np.ndarray, eval_rows: np.ndarray, where: str) -> None:
    """Every class of the eval split occurs in the train split: the model cannot learn one it never sees."""
    if dataset.task != "classification":
        return
    unseen = np.setdiff1d(dataset.label[eval_rows], dataset.label[train_rows])
    unseen = unseen[unseen != IGNORE_INDEX]  # no class: a position without a label
    if len(unseen):
        names = ", ".join(repr(dataset.classes[i] if dataset.classes else int(i)) for i in unseen[:SHOWN_CLASSES])
        if len(unseen) > SHOWN_CLASSES:
            names += f" and {len(unseen) - SHOWN_CLASSES} more"
        raise sources.DataError(
            f"{where}: label {dataset.label_name!r} value(s) {names} occur in the eval split "
            "but not in the train split, so the model cannot learn them; add train rows of them, drop those rows, "
            "or split differently (data.split_seed, data.eval_fraction)"
        )


def prepare(config: config_mod.Config, train_dir: Path, eval_dir: Path) -> dict:
    data = config.data
    # A tokenized text's token stream is mapped from a scratch file near the splits (on their
    # disk, in a folder that exists: bad data leaves nothing behind), not held in memory.
    scratch = next(folder for folder in Path(train_dir).absolute().parents if folder.is_dir())
    dataset = sources.load(data, scratch)
    if dataset.split:
        train_rows, eval_rows = dataset.split
        if len(train_rows) == 0 or len(eval_rows) == 0:
            raise sources.DataError(f"data.source {data.source!r}: its {'eval' if len(train_rows) else 'train'} "
                                    "split has no records")
        log.info("data.source %s: its own train and eval splits, %d and %d records", data.source, len(train_rows),
                 len(eval_rows))
    else:
        train_rows, eval_rows = split_rows(len(dataset), data.eval_fraction, data.split_seed)
    source = {"data": config_mod.as_dict(data)} | ({"examples": dataset.counts} if dataset.counts else {})
    check_eval_classes(dataset, train_rows, eval_rows, f"data.source {data.source!r}")
    stats = {}
    if data.standardize:
        stats = standardize.statistics(dataset.features, train_rows)
        dataset.features = standardize.apply(dataset.features, stats)
        log.info("data.standardize: %s by the train split's mean and std",
                 ", ".join(f"input {name!r}" for name in stats) or "no float input to standardize")
    manifests = {}
    for split, rows, out in (("train", train_rows, train_dir), ("eval", eval_rows, eval_dir)):
        manifests[split] = write_split(dataset, rows, Path(out), split, data.shards,
                                       source, stats)
        log.info(
            "%s: %d records in %d shards of %d-byte records -> %s",
            split,
            len(rows),
            len(manifests[split].shards),
            manifests[split].record_bytes,
            out,
        )
    log.info("task %s, classes/vocabulary %s%s", dataset.task, dataset.num_classes,
             f" ({', '.join(dataset.classes)})" if dataset.classes else "")
    # Beside the eval shards, where training reads it (after write_split: it makes the folder).
    scored = baseline.of_split(dataset.label, dataset.task, dataset.num_classes, train_rows, eval_rows)
    baseline.write(eval_dir, scored)
    log.info("baseline (predicting %s) on the eval split: %s", scored.of,
             ", ".join(f"{key} {value:.6g}" for key, value in scored.measures().items()
                       if key != "of" and value is not None))
    return manifests


# The config keys this stage reads, which its rule passes (stages/__init__.py): its split's seed is
# data.split_seed, so that a sweep's repeats over run.seed share the data.
KEYS = ("data",)
HELP = "read data.source, split it by data.split_seed, write checksummed shards"


def add_arguments(parser) -> None:
    from ..config import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--train", required=True, help="output folder of the train split")
    parser.add_argument("--eval", required=True, help="output folder of the eval split")


def run(args) -> None:
    from ..config import load_config

    prepare(load_config(args), Path(args.train), Path(args.eval))

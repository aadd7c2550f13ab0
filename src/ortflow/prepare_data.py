"""The prepare_data stage: read `data.source`, split it by `run.seed`, standardize
float inputs if `data.standardize` (standardize.py), write shards."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .data import sources, standardize
from .data.shards import write_split

log = logging.getLogger("ortflow.prepare_data")


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


def prepare(config: dict, train_dir: Path, eval_dir: Path) -> dict:
    data, seed = config["data"], config["run"]["seed"]
    dataset = sources.load(data)
    train_rows, eval_rows = split_rows(len(dataset), data["eval_fraction"], seed)
    stats = {}
    if data["standardize"]:
        stats = standardize.statistics(dataset.features, train_rows)
        dataset.features = standardize.apply(dataset.features, stats)
        log.info("data.standardize: %s by the train split's mean and std",
                 ", ".join(f"input {name!r}" for name in stats) or "no float input to standardize")
    manifests = {}
    for split, rows, out in (("train", train_rows, train_dir), ("eval", eval_rows, eval_dir)):
        manifests[split] = write_split(dataset, rows, Path(out), split, data["shards"], {"data": data, "seed": seed},
                                       stats)
        log.info(
            "%s: %d records in %d shards of %d-byte records -> %s",
            split,
            len(rows),
            len(manifests[split]["shards"]),
            manifests[split]["record_bytes"],
            out,
        )
    log.info("task %s, classes/vocabulary %s", dataset.task, dataset.num_classes)
    return manifests


HELP = "read data.source, split it by run.seed, write checksummed shards"


def add_arguments(parser) -> None:
    from .config import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--train", required=True, help="output folder of the train split")
    parser.add_argument("--eval", required=True, help="output folder of the eval split")


def run(args) -> None:
    from .config import load_config

    prepare(load_config(args), Path(args.train), Path(args.eval))

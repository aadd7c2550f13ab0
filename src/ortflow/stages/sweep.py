"""`ortflow sweep compare|halve`: a sweep's comparison (sweeps/comparison.py), and with
sweep.halving the points that go on after the first budget (sweeps/points.py)."""

from __future__ import annotations

import json

from .. import atomic
from ..sweeps.comparison import compare, summary, survivors
from ..sweeps.points import HALVING, folder, points

# The config keys this stage reads, which its rules pass (stages/__init__.py): the comparison and
# halving read every section of the config.
KEYS = ("run", "data", "model", "train", "export", "sweep")
HELP = "compare the points of a sweep (the table, the plots and the best point's model)"


def add_arguments(parser) -> None:
    from ..config import add_config_arguments

    sub = parser.add_subparsers(dest="action", required=True)
    comparison = sub.add_parser("compare", help="results/sweeps/<name>/: the table, the plots and best/")
    add_config_arguments(comparison)
    halving = sub.add_parser("halve", help="results/sweeps/<name>/halving.json: the points that go on")
    add_config_arguments(halving)


def run(args) -> int:
    from ..config import load_config

    config = load_config(args)
    if args.action == "halve":
        kept = survivors(config)
        record = {"steps": config.sweep.halving.steps, "survivors": kept,
                  "stopped": [p.name for p in points(config) if p.name not in kept]}
        with atomic.file(folder(config) / HALVING) as temporary:
            temporary.write_text(json.dumps(record, indent=2))
        print(f"sweep {config.sweep.name!r}: {', '.join(kept)} go on; {', '.join(record['stopped'])} stop")
        return 0
    print(summary(config, compare(config), []))
    return 0

"""`ortflow <command>`: the entry points that the workflow's rules call, usable on their own too.

Each stage command takes the part of the configuration it depends on as JSON
(`--config-json`, which the rules fill from the validated config) or a config
file (`--config`), so that a stage can be run by hand outside Snakemake.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from . import config as config_mod


def _load_config(args) -> dict:
    if args.config_json:
        return config_mod.validate(json.loads(args.config_json))
    return config_mod.load(args.config)


def _prepare_data(args) -> None:
    from .data.prepare import prepare

    prepare(_load_config(args), Path(args.train), Path(args.eval))


COMMANDS = {
    "prepare-data": (
        _prepare_data,
        "read data.source, split it, write checksummed shards",
        [("--train", {"required": True, "help": "output folder of the train split"}),
         ("--eval", {"required": True, "help": "output folder of the eval split"})],
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ortflow", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text, arguments) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        source = p.add_mutually_exclusive_group()
        source.add_argument("--config", default=str(config_mod.DEFAULT_CONFIG), help="config file (YAML)")
        source.add_argument("--config-json", help="the config as JSON (what the workflow passes)")
        for flag, options in arguments:
            p.add_argument(flag, **options)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    function = COMMANDS[args.command][0]
    try:
        function(args)
    except (config_mod.ConfigError, ValueError, FileNotFoundError) as error:
        # Known bad input: one clear line, no traceback to dig through.
        print(f"ortflow {args.command}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

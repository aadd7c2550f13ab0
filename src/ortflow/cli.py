"""`ortflow <command>`: the entry points that the workflow's rules call, usable on their own too.

Each command lives in the module named in COMMANDS, which defines `HELP`,
`add_arguments(parser)` and `run(args)`. Modules import their heavy
dependencies (onnxruntime, torch) inside `run`, so that `ortflow --help` is quick.
Stage commands take the part of the configuration they depend on as JSON
(`--config-json`, filled by the rules from the validated config) or a config
file (`--config`), so that a stage can also be run by hand.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from . import hugepages, ort_private, storage
from .errors import OrtflowError

COMMANDS = {
    "prepare-data": "ortflow.stages.prepare_data",
    "shards-to-pb": "ortflow.stages.shards_to_pb",
    "build-artifacts": "ortflow.stages.build_artifacts",
    "doctor": "ortflow.stages.doctor",
    "train": "ortflow.stages.train",
    "export-model": "ortflow.stages.export_model",
    "quantize-model": "ortflow.stages.quantize_model",
    "generate": "ortflow.stages.generate",
    "checkpoint": "ortflow.stages.merge_checkpoint",
    "report": "ortflow.stages.report",
    "sweep": "ortflow.stages.sweep",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ortflow", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["generate"]:
        # Generating streams every weight for each token: on huge pages where the kernel gives
        # them on request (hugepages.py). Only the console script's own process is replaced.
        hugepages.restart_with_hugepages(sys.argv[1:])
    ort_private.skip_ortmodule()
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr
    )
    try:
        return importlib.import_module(COMMANDS[args.command]).run(args) or 0
    except OrtflowError as error:
        # Known bad input or setup: one clear line that names the problem, no traceback to dig
        # through. Any other exception is a bug and keeps its traceback. The further lines of
        # a message that has them (a list of problems and their fixes) are indented, which
        # tells where the message ends (reporting/failures.py shows all of it).
        message = str(error).replace("\n", "\n  ")
        print(f"ortflow {args.command}: error: {message}", file=sys.stderr)
        return 1
    except OSError as error:
        # A full disk, a folder without write permission, a read-only file system.
        problem = storage.explain(error)
        if problem is None:
            raise
        print(f"ortflow {args.command}: error: {problem}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

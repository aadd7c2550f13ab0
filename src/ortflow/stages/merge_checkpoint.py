"""`ortflow checkpoint inspect|merge|reshard`: the tools of merge_checkpoint
(the rule) and of anyone holding a run's checkpoints. The format they read and
write is checkpoints/layout.py's; the tools are checkpoints/summary.py (inspect),
checkpoints/merge.py and checkpoints/reshard.py.

    ortflow checkpoint merge results/<run>/train/checkpoints out/ --artifacts results/<run>/artifacts
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..checkpoints.layout import MAX_SHARDS
from ..checkpoints.merge import merge
from ..checkpoints.ort_format import CheckpointError
from ..checkpoints.reshard import reshard
from ..checkpoints.summary import inspect
from ..digests import digest

HELP = "inspect, merge or reshard the sharded checkpoints of a run"


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    source_help = "a checkpoint folder (step-XXXXXXXX), or a checkpoints root (its newest complete checkpoint)"
    inspect_parser = sub.add_parser("inspect", help="check every shard and list what the checkpoint holds")
    inspect_parser.add_argument("source", type=Path, help=source_help)
    model_help = ("the run's artifacts folder (or its initial `checkpoint` file): check the checkpoint's parameter "
                  "names, shapes and dtypes against the model's; default: results/<run>/artifacts of the run the "
                  "checkpoint belongs to, if there")
    inspect_parser.add_argument("--artifacts", type=Path, help=model_help)
    merge_parser = sub.add_parser("merge", help="one ONNX Runtime checkpoint + one HDF5 file from the shards")
    merge_parser.add_argument("source", type=Path, help=source_help)
    merge_parser.add_argument("out", type=Path, help="output folder")
    merge_parser.add_argument("--artifacts", type=Path, help=model_help)
    merge_parser.add_argument("--checkpoint", choices=("last", "best"), default="last",
                              help="of a checkpoints root: the newest checkpoint, or the one that evaluated best")
    merge_parser.add_argument("--config-json", help="the run's config: take the newest checkpoint of its training "
                              "identity (a checkpoints root can hold checkpoints of several)")
    reshard_parser = sub.add_parser("reshard", help="rewrite a checkpoint as N shards")
    reshard_parser.add_argument("source", type=Path, help=source_help)
    reshard_parser.add_argument("out", type=Path, help="output checkpoint folder")
    reshard_parser.add_argument("-n", "--world-size", type=int, required=True, help="number of shards")
    reshard_parser.add_argument("--artifacts", type=Path, help=model_help)


def run(args) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.action == "inspect":
        print(inspect(args.source, args.artifacts))
    elif args.action == "merge":
        merge(args.source, args.out, _identity_digest(args.config_json), args.artifacts, args.checkpoint)
    else:
        if not 1 <= args.world_size <= MAX_SHARDS:
            raise CheckpointError(f"reshard: --world-size must be 1..{MAX_SHARDS}, got {args.world_size}")
        reshard(args.source, args.out, args.world_size, args.artifacts)


def _identity_digest(config_json: str | None) -> str | None:
    if not config_json:
        return None
    from .. import config as config_mod

    return digest(config_mod.training_identity(config_mod.typed(config_mod.validate(json.loads(config_json)))))

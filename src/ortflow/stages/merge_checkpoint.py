"""`ortflow checkpoint inspect|merge|reshard`: the tools of merge_checkpoint
(the rule) and of anyone holding a run's checkpoints. The format they read and
write is checkpoints/layout.py's.

    ortflow checkpoint merge results/<run>/train/checkpoints out/ --artifacts results/<run>/artifacts
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .. import atomic
from ..digests import digest
from ..checkpoints.ort_format import CheckpointError, write_ort_checkpoint
from ..checkpoints.resume import checkpoint_folder
from ..checkpoints.best import best_of
from ..checkpoints.layout import (
    BEST, COMPLETE, HISTORY, MANIFEST, MAX_SHARDS, new_manifest, partition, shard_attrs, write_json,
)
from ..checkpoints.reader import read_checkpoint
from ..checkpoints.writer import write_hdf5, write_history, write_shard

log = logging.getLogger("ortflow.checkpoint")

HELP = "inspect, merge or reshard the sharded checkpoints of a run"
META = "meta.json"  # of a merged checkpoint; export reads its step and identity_digest


def merge(source: Path, out_dir: Path, identity_digest: str | None = None, model: Path | None = None,
          which: str = "last") -> Path:
    """Merge a checkpoint (a folder, or under a checkpoints root the newest complete one
    (`which` last) or the one that evaluated best (`which` best), of the training identity
    `identity_digest` if given) into `out_dir`: `checkpoint` (ONNX Runtime's format, with
    optimizer state; its tensors in `checkpoint.data` over external_data.threshold()),
    `checkpoint.h5` (every shard in one) and `meta.json`, which says which one it is."""
    best = best_of(source, identity_digest) if which == "best" else None
    if which == "best":
        if best is None:
            raise CheckpointError(
                f"{source}: no best checkpoint of this run (no {BEST}): training keeps one when export.checkpoint "
                "is best (or auto with train.early_stopping.patience set); retrain with that, or export the last "
                "step's with export.checkpoint: last")
        folder = Path(source) / best["checkpoint"]
    else:
        folder = checkpoint_folder(source, identity_digest)
    checkpoint = read_checkpoint(folder, model)
    manifest = checkpoint.manifest
    attrs = shard_attrs(manifest["checkpoint_id"], manifest["step"], 0, 1, manifest["identity"],
                         manifest["identity_digest"], checkpoint.state.version)
    state = checkpoint.state
    meta = {key: manifest[key] for key in ("checkpoint_id", "step", "world_size", "identity", "identity_digest",
                                           "properties")}
    meta["chosen"] = {"checkpoint": which, **({key: best[key] for key in ("metric", "mode", "value")} if best else {})}
    out_dir = Path(out_dir)
    with atomic.folder(out_dir) as tmp:
        # ONNX Runtime's checkpoint (with `checkpoint.data` for a model over external_data.threshold())
        # streamed from the arrays, then the HDF5 file: one serialized copy of the weights at a time.
        write_ort_checkpoint(tmp / "checkpoint", checkpoint.state)
        write_hdf5(tmp / "checkpoint.h5", state.part(partition(state, 1)[0]), attrs)
        (tmp / META).write_text(json.dumps({**meta, "merged_from": str(checkpoint.path)}, indent=2,
                                           sort_keys=True) + "\n")
    log.info("merged %s (%d shards, step %d) -> %s", checkpoint.path, manifest["world_size"], manifest["step"], out_dir)
    return out_dir




def reshard(source: Path, out_dir: Path, world_size: int, model: Path | None = None) -> Path:
    """Write a checkpoint as a checkpoint folder of `world_size` shards (training can
    resume from any world size anyway; this is for tools that want the other layout)."""
    folder = checkpoint_folder(source)
    checkpoint = read_checkpoint(folder, model)
    manifest, state = checkpoint.manifest, checkpoint.state
    out_dir = Path(out_dir)
    with atomic.folder(out_dir) as tmp:
        entries = []
        for rank, ranges in enumerate(partition(state, world_size)):
            attrs = shard_attrs(manifest["checkpoint_id"], manifest["step"], rank, world_size,
                                 manifest["identity"], manifest["identity_digest"], state.version)
            entries.append(write_shard(tmp, state.part(ranges), attrs))
        resharded = new_manifest(manifest["checkpoint_id"], manifest["step"], world_size, manifest["identity"],
                                 manifest["identity_digest"], manifest["properties"], entries)
        # The metrics logged up to this step: a run resumed from the copy still reports all of them.
        if checkpoint.history is not None:
            resharded["history"] = write_history(tmp, checkpoint.history)
        write_json(tmp / MANIFEST, resharded)
        atomic.write_bytes(tmp / COMPLETE, b"")
    log.info("resharded %s (%d shards) -> %s (%d shards)", checkpoint.path, manifest["world_size"], out_dir,
             world_size)
    return out_dir


def inspect(source: Path, model: Path | None = None) -> str:
    """A readable summary of a checkpoint, after checking every shard."""
    from tabulate import tabulate

    folder = checkpoint_folder(source)
    checkpoint = read_checkpoint(folder, model)
    manifest, state = checkpoint.manifest, checkpoint.state
    where: dict[str, list[str]] = {}
    for entry in manifest["shards"]:
        for name in entry["parameters"]:
            where.setdefault(name, []).append(entry["file"])
    rows = [(name, "x".join(map(str, state.parameters[name].shape)) or "scalar", str(state.parameters[name].dtype),
             "yes" if state.requires_grad[name] else "frozen", ", ".join(sorted(state.optimizer_states.get(name, {}))),
             ", ".join(where[name])) for name in sorted(state.parameters)]
    shards = [(e["file"], e["bytes"], e["sha256"][:16], len(e["parameters"])) for e in manifest["shards"]]
    return "\n".join([
        f"checkpoint {checkpoint.path}: step {manifest['step']}, {manifest['world_size']} shards (checksums verified)",
        "checked: shards named in manifest.json as plain files of the folder, regular files (no links) of the "
        "listed sizes; their sha256; every dataset a flat float array stored in its shard, of the listed length; "
        "each parameter's shape covered exactly by its shards",
        f"checked against the model {model}: parameter names, shapes, dtypes, trainable flags, optimizer state"
        if model else "not checked against a model (no artifacts beside the checkpoints; give --artifacts)",
        f"history {HISTORY}: {len(checkpoint.history['train'])} train and {len(checkpoint.history['eval'])} eval "
        "entries, checked like the shards" if checkpoint.history else "no history (the metrics logged up to this step)",
        f"training identity {manifest['identity_digest']}",
        f"optimizer {json.dumps(state.optimizer, sort_keys=True)}",
        f"properties {json.dumps(state.properties, sort_keys=True)}",
        "",
        tabulate(shards, headers=["shard", "bytes", "sha256", "parameters"]),
        "",
        tabulate(rows, headers=["parameter", "shape", "dtype", "trained", "optimizer state", "shard"]),
    ])


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

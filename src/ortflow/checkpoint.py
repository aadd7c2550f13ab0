"""Checkpoints of a training run, and resume.

A checkpoint is a folder `step-XXXXXXXX` under the run's checkpoint root. It
counts as complete only once the marker file COMPLETE exists, which is written
last, after every rank has finished writing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("ortflow.checkpoint")

COMPLETE = "COMPLETE"
META = "meta.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the reason."""


@dataclass
class Resume:
    path: Path  # the checkpoint folder
    ort_checkpoint: Path  # a file CheckpointState.load_checkpoint reads
    step: int
    meta: dict


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def save(root: Path, step: int, state, comm, identity: dict, identity_digest: str, properties: dict, keep: int) -> Path:
    """Write the checkpoint of optimizer step `step` (steps done so far)."""
    from onnxruntime.training.api import CheckpointState

    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        tmp.mkdir(parents=True)
        for key, value in properties.items():
            state.properties[key] = value
        CheckpointState.save_checkpoint(state, str(tmp / "checkpoint"), include_optimizer_state=True)
        meta = {"step": step, "identity": identity, "identity_digest": identity_digest,
                "world_size": comm.world_size, "properties": properties}
        (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, final)
        (final / COMPLETE).write_text("")
        _prune(root, keep)
    comm.barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    complete = sorted(p for p in Path(root).glob("step-*") if (p / COMPLETE).exists())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _load(path: Path) -> Resume:
    meta_path = path / META
    if not (path / COMPLETE).exists() or not meta_path.exists():
        raise CheckpointError(f"checkpoint {path} is incomplete (no {COMPLETE} marker)")
    meta = json.loads(meta_path.read_text())
    return Resume(path, path / "checkpoint", meta["step"], meta)


def find_resume(root: Path, identity: dict, identity_digest: str, resume_from: str | None) -> Resume | None:
    """The checkpoint to resume from: `resume_from` if given (refused if it belongs
    to another training identity), else the newest complete one of this identity."""
    if resume_from:
        resume = _load(Path(resume_from))
        if resume.meta["identity_digest"] != identity_digest:
            raise CheckpointError(
                f"train.resume_from: checkpoint {resume_from} belongs to another training identity; differs: "
                + ", ".join(_differences(resume.meta["identity"], identity))
            )
        return resume
    for path in sorted(Path(root).glob("step-*"), reverse=True):
        if path.name.endswith(".tmp"):
            continue
        try:
            resume = _load(path)
        except CheckpointError as error:
            log.warning("skipping %s", error)
            continue
        if resume.meta["identity_digest"] != identity_digest:
            log.info("skipping checkpoint %s: another training identity (%s)", path,
                     ", ".join(_differences(resume.meta["identity"], identity)))
            continue
        return resume
    return None


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} in the checkpoint, {b!r} now")
    return out


def latest(root: Path) -> Resume:
    """The newest complete checkpoint under `root`."""
    for path in sorted(Path(root).glob("step-*"), reverse=True):
        if (path / COMPLETE).exists():
            return _load(path)
    raise CheckpointError(f"no complete checkpoint under {root}")


def load_parameters(path: Path) -> dict:
    """{name: array} of every parameter of the checkpoint folder `path`."""
    return load_parameters_file(_load(Path(path)).ort_checkpoint)


def load_parameters_file(path: Path) -> dict:
    """{name: array} of every parameter of an ONNX Runtime checkpoint file."""
    from onnxruntime.training.api import CheckpointState

    state = CheckpointState.load_checkpoint(str(path))
    return {name: state._state.get_parameter(name).data.numpy().copy() for name, _ in state.parameters}


def merge(root: Path, out_dir: Path) -> Path:
    """Merge the newest complete checkpoint under `root` into `out_dir`:
    `checkpoint` (ONNX Runtime's format, with optimizer state) and `meta.json`."""
    source = latest(root)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copyfile(source.ort_checkpoint, tmp / "checkpoint")
    (tmp / META).write_text(json.dumps({**source.meta, "merged_from": str(source.path)}, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    log.info("merged %s -> %s", source.path, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m ortflow.checkpoint", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    merge_parser = sub.add_parser("merge", help="merge the newest complete checkpoint into one")
    merge_parser.add_argument("root", type=Path, help="the run's train/checkpoints folder")
    merge_parser.add_argument("out", type=Path, help="output folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        merge(args.root, args.out)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

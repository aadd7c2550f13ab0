"""Which checkpoint a run goes on from: the newest intact one of its training
identity (damaged ones skipped with a warning), or the one train.resume_from names."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from .ort_format import CheckpointError, TrainingState
from .layout import COMPLETE, MANIFEST, Checkpoint, Manifest
from .reader import digest_of, manifest_of, read_checkpoint

log = logging.getLogger("ortflow.checkpoint")


@dataclass
class Resume:
    path: Path  # the checkpoint folder
    step: int
    meta: Manifest
    checkpoint: Checkpoint | None = field(default=None, repr=False)  # its shards, once read and checked


def load_state(resume: Resume, model: Path | None = None) -> TrainingState:
    """The whole state to train on from the checkpoint `resume` (any world size), checked
    against the parameters of `model` (the artifacts) before ONNX Runtime sees any of it."""
    return (resume.checkpoint or read_checkpoint(resume.path, model)).state


def read_history(resume: Resume) -> dict | None:
    """The metrics logged up to the checkpoint `resume`, verified against its manifest like its shards
    (reader.read_checkpoint; None if it has none)."""
    return (resume.checkpoint or read_checkpoint(resume.path)).history


def find_resume(root: Path, identity: dict, identity_digest: str, resume_from: str | None,
                steps: int, model: Path | None = None) -> Resume | None:
    """The checkpoint to resume from: `resume_from` if given (refused if it belongs to
    another training identity, is damaged or lies beyond `steps`), else the newest
    intact one of this identity at or before `steps`; damaged ones are skipped with a warning."""
    if resume_from:
        manifest = manifest_of(Path(resume_from))
        if manifest.identity_digest != identity_digest:
            raise CheckpointError(
                f"train.resume_from: checkpoint {resume_from} belongs to another training identity; differs: "
                + ", ".join(_differences(manifest.identity, identity))
            )
        resume = _resume_at(Path(resume_from), identity, identity_digest, steps, model)
        if isinstance(resume, str):
            raise CheckpointError(f"train.resume_from: checkpoint {resume_from}: {resume}")
        return resume
    for path in sorted(Path(root).glob("step-*"), reverse=True):
        try:
            resume = _resume_at(path, identity, identity_digest, steps, model)
        except CheckpointError as error:
            log.warning("skipping %s", error)
            continue
        if isinstance(resume, str):
            log.info("skipping checkpoint %s: %s", path, resume)
            continue
        return resume
    return None


def _resume_at(path: Path, identity: dict, identity_digest: str, steps: int, model: Path | None) -> Resume | str:
    """The checkpoint `path`, every file checked, or why it does not belong to this training.
    Raises CheckpointError if it is incomplete or damaged."""
    manifest = manifest_of(path)
    if manifest.identity_digest != identity_digest:
        return f"another training identity ({', '.join(_differences(manifest.identity, identity))})"
    if manifest.step > steps:
        return f"step {manifest.step} is beyond train.steps {steps}"
    return Resume(path, manifest.step, manifest, read_checkpoint(path, model))


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} in the checkpoint, {b!r} now")
    return out


def latest(root: Path, identity_digest: str | None = None) -> Resume:
    """The newest complete checkpoint under `root` (of this training identity, if given)."""
    for path in sorted(Path(root).glob("step-*"), reverse=True):
        if (path / COMPLETE).exists() and identity_digest in (None, digest_of(path)):
            manifest = manifest_of(path)
            return Resume(path, manifest.step, manifest)
    of = f" of training identity {identity_digest}" if identity_digest else ""
    raise CheckpointError(f"no complete checkpoint{of} under {root}")


def checkpoint_folder(path: Path, identity_digest: str | None = None) -> Path:
    """A checkpoint folder as given, or the newest complete one of a checkpoints root."""
    path = Path(path)
    if (path / MANIFEST).exists() or path.name.startswith("step-"):
        return path
    return latest(path, identity_digest).path


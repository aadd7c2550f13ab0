"""What the inference model says of itself and carries beside it, so that it is usable
without the run's folder.

Its metadata properties record where it came from: `ortflow.run`, `ortflow.step`,
`ortflow.checkpoint`, `ortflow.identity_digest` (the training identity's sha256: seed,
data, model, optimizer, schedule, global batch) and `ortflow.version`; and what its
outputs and inputs mean: `ortflow.classes` (the names of classes 0..K-1 of a label of
strings, as JSON) and, with `data.tokenizer`, `ortflow.tokenizer` and
`ortflow.tokenizer_sha256`: the tokenizer that made its token ids, copied beside it
(`tokenizer.json`, with the data's truncation and padding).
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import atomic
from ..checkpoints.meta import Merged
from ..data.manifest import Manifest
from ..data.shards import TOKENIZER
from ..errors import DataError


def properties(run: str, meta: Merged, manifest: Manifest) -> dict:
    """The model's metadata properties: where it came from (run `run`, the merged checkpoint's
    `meta`) and what its outputs and inputs mean (the eval split's `manifest`)."""
    from .. import __version__

    props = {
        "ortflow.run": run,
        "ortflow.step": meta.step,
        "ortflow.checkpoint": meta.chosen.shown(),
        "ortflow.identity_digest": meta.identity_digest,
        "ortflow.version": __version__,
    }
    return props | data_properties(manifest)


def data_properties(manifest: Manifest) -> dict:
    """The metadata properties that say what the model's outputs and inputs mean: class names, the tokenizer."""
    props = {}
    if manifest.classes:
        props["ortflow.classes"] = json.dumps(manifest.classes)
    if manifest.tokenizer:
        props["ortflow.tokenizer"] = TOKENIZER
        props["ortflow.tokenizer_sha256"] = manifest.tokenizer["sha256"]
    return props


def copy_tokenizer(eval_dir: Path, manifest: Manifest, folder: Path) -> None:
    """The tokenizer of the data (the eval split's TOKENIZER, checked against its
    manifest) into `folder`, beside the model; an earlier run's removed when there is none."""
    import hashlib

    target = folder / TOKENIZER
    if not manifest.tokenizer:
        target.unlink(missing_ok=True)
        return
    source = eval_dir / TOKENIZER
    content = source.read_bytes() if source.is_file() else b""
    if hashlib.sha256(content).hexdigest() != manifest.tokenizer["sha256"]:
        raise DataError(f"{source}: missing, or changed since prepare_data wrote it (its sha256 is not the one in "
                        f"{eval_dir / 'manifest.json'}); rerun prepare_data")
    atomic.write_bytes(target, content)

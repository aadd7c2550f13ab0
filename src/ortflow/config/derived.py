"""What follows from a validated config: the global batch, the checkpoint export picks, and the
training identity, hashed to decide what a checkpoint or an artifact belongs to (the user's
files by their content)."""

from __future__ import annotations

import errno
from pathlib import Path

from .convert import as_dict
from .sections import Config, Train


def global_batch_size(config: Config) -> int:
    train = config.train
    return train.micro_batch_size * train.grad_accum_steps * data_parallel_size(train)


def data_parallel_size(train: Train) -> int:
    """D: the copies of the model (of each of its train.pipeline_stages stages) that split the global batch."""
    return train.world_size // train.pipeline_stages


def training_identity(config: Config) -> dict:
    """What a checkpoint belongs to: resuming is only meaningful if all of this is
    unchanged. World size and the periods may change; the step count too unless the
    learning-rate schedule spreads its decay over it. The user's model and data
    files count by their content, not their path."""
    train = config.train
    identity = {
        "seed": config.run.seed,
        "data": by_content(as_dict(config.data)),
        "model": by_content(as_dict(config.model)),
        "optimizer": as_dict(train.optimizer),
        "lr_schedule": as_dict(train.lr_schedule),
        "clip_grad_norm": train.clip_grad_norm,
        "global_batch_size": global_batch_size(config),
    }
    if train.lr_schedule.name != "constant":
        identity["steps"] = train.steps
    return identity


def export_checkpoint(config: Config) -> str:
    """`best` or `last`: the checkpoint export.checkpoint picks, `auto` resolved."""
    chosen = config.export.checkpoint
    if chosen == "auto":
        return "best" if config.train.early_stopping.patience else "last"
    return chosen


# Keys whose files are listed, checked and hashed by user_files (section key -> config key;
# model.path for kind transformers): only these may name a folder, hashed by the files its loader reads, so that a value such
# as `text` or `auto` never reads a folder that happens to have its name.
CHECKED_KEYS = {"tokenizer": "data.tokenizer", "weights": "model.weights", "path": "model.path"}


def by_content(section: dict) -> dict:
    """`section` with each value that names a file replaced by `sha256:<digest>` of the file,
    and a folder of CHECKED_KEYS (a save_pretrained tokenizer, model.weights' merged
    checkpoint of an earlier run) by the digest of the digests of the files read from it."""
    from .. import user_files
    from ..digests import sha256_file

    checked = dict(CHECKED_KEYS)
    if section.get("kind") != "transformers":  # model.path is a folder for kind transformers only
        del checked["path"]

    def content(key: str, value):
        path = Path(value) if isinstance(value, str) else None
        try:
            if path is not None and key in checked and (path.exists() or path.is_symlink()):
                return user_files.content(checked[key], value)
            if path is not None and path.is_file():
                return f"sha256:{sha256_file(path)}"
        except OSError as error:
            if error.errno != errno.ENAMETOOLONG:
                raise
            # Not a path: a value longer than a file name can be (data.chat_template's template itself).
        return value

    return {key: content(key, value) for key, value in section.items()}

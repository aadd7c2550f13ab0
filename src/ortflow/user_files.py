"""The Hugging Face inputs a config names, checked before anything reads them:
`data.tokenizer` (a tokenizer.json, or a folder saved with transformers'
save_pretrained) and `model.weights` (a .safetensors file, or an ortflow run's
merged checkpoint folder).

They keep the rule that ONNX external data (external_data.check) and checkpoint
shards (checkpoints/checks.py) keep: what is read is a regular file where the
config names it, not a symbolic link (a tokenizer folder linked to /etc would
otherwise be walked, a weights file linked to /etc/passwd hashed and parsed), not
a FIFO or a device (read forever). Each refusal is one line that names the key
and the file, and for a link where it points. A tokenizer file is also capped in
size (TOKENIZER_MAX_BYTES): the tokenizers library holds a tokenizer.json in
memory many times over (a 188 MB one took 4.2 GB).

Only the files the loader reads are listed, checked and hashed (the training
identity, config.by_content; the rule's inputs, workflow/rules/common.smk): for
a tokenizer folder its tokenizer files (TOKENIZER_FILES), not every file under it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from .digests import digest, sha256_handle
from .errors import DataError, ModelError

TOKENIZER_KEY, WEIGHTS_KEY, MODEL_KEY = "data.tokenizer", "model.weights", "model.path"
TOKENIZER_MAX_BYTES = 64 << 20
# What transformers' AutoTokenizer reads from a local folder: its settings, special and added
# tokens, the fast tokenizer's JSON, and the vocabulary files of the classes it converts from
# when there is no tokenizer.json (BPE, WordPiece, SentencePiece), with the model's config.json
# (which names the tokenizer's class when tokenizer_config.json does not) and the chat template.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "config.json",
    "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "sentencepiece.bpe.model", "tokenizer.model",
    "chat_template.jinja", "chat_template.json",
)
CHECKPOINT = "checkpoint"  # the ONNX Runtime file of a merged checkpoint folder (checkpoints/merge.py)
# What a `kind: transformers` model is built from (models/hugging_face.py): the folder's config and its
# weights in safetensors, whole or sharded by an index; never pytorch_model.bin, a pickle that runs code.
MODEL_CONFIG, MODEL_WEIGHTS, MODEL_INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
ERRORS = {TOKENIZER_KEY: DataError, WEIGHTS_KEY: ModelError, MODEL_KEY: ModelError}


class NotRegular(OSError):
    """A file that may not be read: `reason` says why ("is a symbolic link to /etc/passwd")."""

    def __init__(self, file: Path, reason: str):
        super().__init__(f"{file} {reason}")
        self.file, self.reason = Path(file), reason


def link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "an unreadable target"


def _reason(file: Path, mode: int) -> str | None:
    """Why a file of `mode` (its own, from lstat or fstat) may not be read, or None."""
    if stat.S_ISLNK(mode):
        return f"is a symbolic link to {link_target(file)}"
    if not stat.S_ISREG(mode):
        return "is not a regular file"
    return None


def open_regular(file: Path) -> BinaryIO:
    """`file` opened for reading without following a link, once it is known to be a
    regular file (a link to /dev/zero, or a FIFO, would be read forever). Raises
    FileNotFoundError when it is not there, NotRegular otherwise."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as error:
        reason = f"is a symbolic link to {link_target(file)}" if error.errno == errno.ELOOP else \
            f"cannot be opened ({error.strerror})"
        raise NotRegular(file, reason) from None
    handle = os.fdopen(fd, "rb")
    reason = _reason(file, os.fstat(fd).st_mode)
    if reason:
        handle.close()
        raise NotRegular(file, reason)
    return handle


def sha256(file: Path) -> str:
    """The sha256 of `file`, opened by open_regular."""
    with open_regular(file) as handle:
        return sha256_handle(handle)


def _refuse(key: str, file: Path, reason: str, advice: str):
    return ERRORS[key](f"{key}: {file} {reason}; {advice}")


IN_PLACE = "what it reads must be a regular file where the config names it (copy a link's target in its place)"


def _check(key: str, file: Path, cap: int | None = None) -> None:
    """`file` itself (not followed if a link) is a regular file of at most `cap` bytes."""
    try:
        info = os.lstat(file)
    except OSError as error:
        raise _refuse(key, file, f"cannot be read ({error.strerror})", "check its permissions") from None
    reason = _reason(file, info.st_mode)
    if reason:
        raise _refuse(key, file, reason, IN_PLACE)
    if cap is not None and info.st_size > cap:
        raise _refuse(key, file, f"is {info.st_size:,} bytes, more than the cap of {cap:,} bytes for a tokenizer "
                                 "file", "a tokenizer this large would take many times its size in memory")


def _not_a_link(key: str, path: Path) -> None:
    if path.is_symlink():
        raise _refuse(key, path, f"is a symbolic link to {link_target(path)}", IN_PLACE)


def tokenizer_files(path: str) -> list[Path]:
    """The files of `data.tokenizer` that the tokenizer is loaded from, checked: the
    tokenizer.json itself, or a save_pretrained folder's TOKENIZER_FILES. The folder
    is not a link and holds no link (transformers would follow one). A path that is
    not there is returned as it is, for the loader (or Snakemake) to name."""
    where = Path(path)
    _not_a_link(TOKENIZER_KEY, where)
    if not where.is_dir():
        if where.exists():
            _check(TOKENIZER_KEY, where, TOKENIZER_MAX_BYTES)
        return [where]
    try:
        links = sorted(entry.name for entry in os.scandir(where) if entry.is_symlink())
    except OSError as error:
        raise DataError(f"{TOKENIZER_KEY}: cannot list the folder {where} ({error.strerror})") from None
    if links:
        _not_a_link(TOKENIZER_KEY, where / links[0])
    files = [where / name for name in TOKENIZER_FILES if os.path.lexists(where / name)]
    for file in files:
        _check(TOKENIZER_KEY, file, TOKENIZER_MAX_BYTES)
    return files


def weights_files(path: str) -> list[Path]:
    """The files of `model.weights` that weights.read reads, checked: the file itself,
    or a merged checkpoint folder's CHECKPOINT file with its external data file, if
    any. Neither the path nor those files may be links. A path that is not there
    (an earlier run's checkpoint, made first) is returned as it is."""
    from .external_data import data_file

    where = Path(path)
    _not_a_link(WEIGHTS_KEY, where)
    if not where.exists():
        return [where]
    files = [where]
    if where.is_dir():
        files = [file for file in (where / CHECKPOINT, data_file(where / CHECKPOINT)) if os.path.lexists(file)]
    for file in files:
        _check(WEIGHTS_KEY, file)
    return files


def model_files(path: str) -> list[Path]:
    """The files of `model.path` that a model is built from, checked: an ONNX file itself, or
    for a save_pretrained folder its config.json and safetensors weights (those an index
    lists, for sharded weights). Neither the folder nor those files may be links; a folder
    without config.json, or whose weights are pickled only, is refused. A path that is not
    there (an import path `package.module:Class`) is returned as it is."""
    import json

    where = Path(path)
    _not_a_link(MODEL_KEY, where)
    if not where.is_dir():
        if where.exists():
            _check(MODEL_KEY, where)
        return [where]
    if not os.path.lexists(where / MODEL_CONFIG):
        raise ModelError(f"{MODEL_KEY}: {where} has no {MODEL_CONFIG}; give a folder written by transformers' "
                         "save_pretrained (or one holding only its config.json, for a model drawn from run.seed)")
    files = [where / MODEL_CONFIG]
    if os.path.lexists(where / MODEL_INDEX):
        _check(MODEL_KEY, where / MODEL_INDEX, TOKENIZER_MAX_BYTES)
        try:
            shards = set(json.loads((where / MODEL_INDEX).read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ModelError(f"{MODEL_KEY}: {where / MODEL_INDEX} is not a safetensors index (a JSON object "
                             "with a weight_map of tensor names to file names)") from None
        outside = sorted(shard for shard in shards if not isinstance(shard, str) or Path(shard).name != shard)
        if outside:
            raise ModelError(f"{MODEL_KEY}: {where / MODEL_INDEX} names weight files outside its folder: "
                             f"{outside[:3]}; the index may only name files beside it")
        files += [where / MODEL_INDEX, *(where / shard for shard in sorted(shards))]
    elif os.path.lexists(where / MODEL_WEIGHTS):
        files.append(where / MODEL_WEIGHTS)
    elif any(os.path.lexists(where / name) for name in PICKLED_WEIGHTS):
        raise ModelError(f"{MODEL_KEY}: {where} holds its weights as pytorch_model.bin only, a pickle, which can run "
                         "code when loaded; ortflow reads safetensors: save the model again with "
                         "save_pretrained(..., safe_serialization=True)")
    for file in files:
        _check(MODEL_KEY, file)
    return files


FILES = {TOKENIZER_KEY: tokenizer_files, WEIGHTS_KEY: weights_files, MODEL_KEY: model_files}


def content(key: str, path: str) -> str:
    """The digest of the files of `key` (data.tokenizer, model.weights, model.path) that its loader
    reads: `sha256:<digest>` of a file, `sha256-folder:<digest>` of a folder's."""
    where = Path(path)
    files = FILES[key](path)
    try:
        if where.is_dir():
            return f"sha256-folder:{digest({file.name: sha256(file) for file in files})}"
        return f"sha256:{sha256(where)}"
    except NotRegular as error:  # replaced since it was checked, or unreadable
        raise _refuse(key, error.file, error.reason, IN_PLACE) from None

"""Nothing half-written looks complete. Every file or folder that ortflow hands on
is written under a temporary name beside its final one (`<name>.tmp`, in the same
folder, so that the rename stays on one file system), flushed to disk, and
renamed into place only when it is whole. A write that fails removes its
temporary and says which file it was (see storage.py for the line the user sees)."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from . import storage


def temporary(path: Path) -> Path:
    """The temporary name of `path` while it is being written."""
    path = Path(path)
    return path.with_name(path.name + ".tmp")


def synced_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` and flush it to disk, without a rename: for files
    inside a folder that is itself still under its temporary name."""
    synced_chunks(path, [data])


def synced_chunks(path: Path, chunks: Iterable[bytes]) -> None:
    """`synced_bytes` of the concatenated `chunks`, each written as it comes: a file larger than memory."""
    try:
        with open(path, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        raise storage.named(error, path)


def replace(source: Path, path: Path) -> None:
    """Flush the finished file `source` to disk, then rename it to `path`."""
    with open(source, "rb") as f:
        os.fsync(f.fileno())
    os.replace(source, path)


@contextmanager
def file(path: Path) -> Iterator[Path]:
    """The temporary name to write `path` under (by any writer: ONNX, matplotlib, ...);
    renamed to `path` when the block ends, removed if it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary(path)
    try:
        yield tmp
        replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes(path: Path, data: bytes, sync: bool = True) -> None:
    """`path` holds `data` whole or is untouched. `sync=False` skips the flush to disk,
    for files that matter only while the writer lives (heartbeats)."""
    path = Path(path)
    tmp = temporary(path)
    try:
        if sync:
            synced_bytes(tmp, data)
        else:
            tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str, sync: bool = True) -> None:
    write_bytes(path, text.encode(), sync)


@contextmanager
def folder(path: Path) -> Iterator[Path]:
    """An empty folder to build `path` in, under its temporary name (what an earlier
    crash left there is removed first); it replaces `path` when the block ends, and
    is removed if the block raises."""
    path = Path(path)
    tmp = temporary(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)

"""sha256 digests: of a file, read in blocks (shards' checksums, the content identity of
the files a config names), and of a JSON-able value (a training identity)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, BinaryIO


def sha256_file(path: Path) -> str:
    with open(path, "rb") as handle:
        return sha256_handle(handle)


def sha256_handle(handle: BinaryIO) -> str:
    """The sha256 of an open file, read in blocks from where it stands."""
    return hashlib.file_digest(handle, "sha256").hexdigest()


def digest(obj: Any) -> str:
    """A stable sha256 of a JSON-able value (key order does not matter)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()

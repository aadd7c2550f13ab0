"""sha256 digests: of a file, read in blocks (shards' checksums, the content identity of
the files a config names), and of a JSON-able value (a training identity)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def digest(obj: Any) -> str:
    """A stable sha256 of a JSON-able value (key order does not matter)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()

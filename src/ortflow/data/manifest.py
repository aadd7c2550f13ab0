"""A split's shard manifest (`manifest.json` beside its shards, shards.py writes it): the records'
schema, the task, the shards with their checksums, and where the data came from. Read here only,
every field checked (records.py); the JSON on disk is the one ortflow has always written."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .. import records
from .sources import DataError

FORMAT = "ortflow-shards/1"
MANIFEST = "manifest.json"
REMEDY = "run the prepare_data rule again"


@dataclasses.dataclass(frozen=True)
class Column:
    """A feature or the label: its name, numpy dtype and the shape of one record's value."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Shard:
    file: str  # beside the manifest
    records: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    format: str
    split: str  # train or eval
    records: int
    record_bytes: int
    features: tuple[Column, ...]
    label: Column
    task: str  # classification, regression or language_model
    num_classes: int | None  # or the vocabulary's size; None for regression
    shards: tuple[Shard, ...]
    source: dict  # {"data": the data section} and, from examples, their counts
    classes: tuple[str, ...] | None = None  # the class names of string labels
    tokenizer: dict | None = None  # data.tokenizer as it encoded the split, with its file and sha256
    standardize: dict = dataclasses.field(default_factory=dict)  # standardize.statistics of the features


def read_manifest(split_dir: str | Path) -> Manifest:
    """The manifest of the split in `split_dir`; DataError naming the file and the key if it is
    missing, of another format, or lacks or mistypes a field."""
    path = Path(split_dir) / MANIFEST

    def check(data: dict) -> None:
        if data.get("format") != FORMAT:
            raise DataError(f"{path}: format {data.get('format')!r}, expected {FORMAT!r}")

    return records.read(Manifest, path, DataError, REMEDY,
                        DataError(f"{path}: no shard manifest (run the prepare_data rule first)"), check)


def write_manifest(split_dir: Path, manifest: Manifest) -> None:
    records.write(Path(split_dir) / MANIFEST, manifest, sort_keys=True)

"""Binary shards of fixed-size records, a JSON manifest per split, and the reader.

A shard is the raw bytes of a numpy structured array: record i starts at byte
i * record_bytes, so the reader memory-maps it and copies a batch's records
straight out of the mapping, without parsing (docs/benchmarks.md has its speed). The manifest holds the schema, the record count
and a sha256 per shard, which the reader checks on open.

Batch order depends only on (seed, epoch, global batch size): global batch g of
an epoch is a slice of a seeded permutation, cut into micro-batches, and rank r
takes micro-batches r*A .. r*A+A-1 (A = accumulation steps). So two ranks with
one micro-batch each see exactly the samples one rank sees in two accumulated
micro-batches, and every rank gets the same number of batches. Eval parts are
contiguous and may differ by one record, so their batch counts may differ by
one: reduce eval totals after the loop, not per batch.
"""

from __future__ import annotations

import hashlib
import mmap
from pathlib import Path

import numpy as np

from .. import atomic
from ..digests import sha256_file
from . import standardize
from .manifest import FORMAT, MANIFEST, Column, Manifest, Shard, read_manifest, write_manifest
from .sources import DataError, Dataset

TOKENIZER = "tokenizer.json"  # data.tokenizer as it encoded the split (data/tokenizer.py)
# Records gathered per write: bounds write_split's memory whatever the split's size.
WRITE_BYTES = 1 << 24


def record_dtype(dataset: Dataset) -> np.dtype:
    fields = [(name, array.dtype, array.shape[1:]) for name, array in dataset.features.items()]
    fields.append((dataset.label_name, dataset.label.dtype, dataset.label.shape[1:]))
    return np.dtype(fields)


def write_split(dataset: Dataset, rows: np.ndarray, out_dir: Path, split: str, num_shards: int, source: dict,
                standardized: dict | None = None) -> Manifest:
    """Write `rows` of `dataset` as `num_shards` shards plus a manifest into
    `out_dir`, atomically: everything goes to a temporary folder that is
    renamed into place only when complete. Records are gathered and written
    WRITE_BYTES at a time, so a split larger than memory (the windows of a
    tokenized text, mapped from a file) is written in bounded memory.
    `standardized`: the statistics the features were standardized with
    (standardize.statistics), kept in the manifest. The tokenizer that made
    the token ids (data.tokenizer) is written beside the shards as TOKENIZER."""
    with atomic.folder(out_dir) as tmp:
        dtype = record_dtype(dataset)
        block = max(1, WRITE_BYTES // dtype.itemsize)
        shards = []
        for i, part in enumerate(np.array_split(rows, min(num_shards, max(len(rows), 1)))):
            path = tmp / f"shard-{i:05d}.bin"
            digest = hashlib.sha256()
            atomic.synced_chunks(path, _record_bytes(dataset, dtype, part, block, digest))
            shards.append(Shard(path.name, len(part), digest.hexdigest()))
        tokenizer = None
        if dataset.tokenizer is not None:
            text = dataset.tokenizer.to_json().encode()
            atomic.synced_bytes(tmp / TOKENIZER, text)
            tokenizer = dataset.tokenizer.describe() | {"file": TOKENIZER, "sha256": hashlib.sha256(text).hexdigest()}
        manifest = Manifest(
            format=FORMAT,
            split=split,
            records=len(rows),
            record_bytes=dtype.itemsize,
            features=tuple(Column(n, a.dtype.name, a.shape[1:]) for n, a in dataset.features.items()),
            label=Column(dataset.label_name, dataset.label.dtype.name, dataset.label.shape[1:]),
            task=dataset.task,
            num_classes=dataset.num_classes,
            classes=None if dataset.classes is None else tuple(dataset.classes),
            tokenizer=tokenizer,
            source=source,
            standardize=standardized or {},
            shards=tuple(shards),
        )
        write_manifest(tmp, manifest)
    return manifest


def _record_bytes(dataset: Dataset, dtype: np.dtype, rows: np.ndarray, block: int, digest):
    """The records of `rows`, `block` at a time, as bytes (added to `digest` on the way)."""
    for start in range(0, len(rows), block):
        chosen = rows[start:start + block]
        records = np.empty(len(chosen), dtype=dtype)
        for name, array in dataset.features.items():
            records[name] = array[chosen]
        records[dataset.label_name] = dataset.label[chosen]
        data = records.view(np.uint8)  # the bytes, not a copy of them
        digest.update(data)
        drop_mapped_pages(*dataset.features.values(), dataset.label)
        yield data


def drop_mapped_pages(*arrays) -> None:
    """Let go of the pages read so far from a file mapped under `arrays` (a tokenized text's token stream,
    tokenizer.py): the split is read once, a block at a time, and pages kept mapped count in the process's
    resident memory, which then grew with the text (docs/benchmarks.md). The kernel reads them again if
    they are read again."""
    for array in arrays:
        base = array
        while base is not None and not isinstance(base, mmap.mmap):
            base = getattr(base, "base", None)  # a view's array, as_strided's holder, a memmap's mapping
        if base is not None:
            base.madvise(mmap.MADV_DONTNEED)


class ShardReader:
    """Memory-maps the shards of one split after checking their checksums. With
    `raw`, batches hold the raw features of standardized inputs (data.standardize):
    what the exported model, which standardizes them itself, is fed."""

    def __init__(self, split_dir: str | Path, verify: bool = True, raw: bool = False):
        self.dir, self.raw = Path(split_dir), raw
        self.manifest = read_manifest(self.dir)
        columns = (*self.manifest.features, self.manifest.label)
        self.dtype = np.dtype([(c.name, c.dtype, c.shape) for c in columns])
        self._item = np.dtype((np.void, self.dtype.itemsize))
        self.feature_names = [f.name for f in self.manifest.features]
        self.label_name = self.manifest.label.name
        self.standardized = self.manifest.standardize
        self.shards = []
        for shard in self.manifest.shards:
            path = self.dir / shard.file
            if not path.is_file():
                raise DataError(f"shard {path} is missing (listed in {self.dir / MANIFEST})")
            expected = shard.records * self.dtype.itemsize
            if path.stat().st_size != expected:
                raise DataError(
                    f"shard {path}: {path.stat().st_size} bytes, the manifest says {expected}; the data changed after it was written"
                )
            if verify and (actual := sha256_file(path)) != shard.sha256:
                raise DataError(
                    f"shard {path}: checksum mismatch (sha256 {actual}, manifest {shard.sha256}); "
                    "the data changed after it was written: rerun prepare_data"
                )
            if shard.records:
                with open(path, "rb") as f:
                    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                # Batches visit the whole split in random order: let the kernel read
                # it in ahead instead of faulting in one page at a time.
                mapped.madvise(mmap.MADV_WILLNEED)
                # Each record as one opaque item: np.take copies contiguous items
                # (a strided field view would first be copied whole).
                self.shards.append(np.frombuffer(mapped, dtype=self._item))
        self.offsets = np.cumsum([0] + [shard.records for shard in self.manifest.shards if shard.records])
        self.num_records = int(self.offsets[-1])
        self._epoch_order = (None, None)

    def __len__(self) -> int:
        return self.num_records

    def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Records at global `indices`, in that order, as {name: contiguous array}.
        Sorted indices are the fast path: one copy per shard, no reordering."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= self.num_records):
            raise IndexError(f"{self.dir}: record index out of range 0..{self.num_records - 1}")
        order = None
        if np.any(indices[1:] < indices[:-1]):
            order = np.argsort(indices, kind="stable")
            indices = indices[order]
        records = np.empty(len(indices), self.dtype)
        items = records.view(self._item)
        # Where each shard's records begin in the sorted indices.
        bounds = np.searchsorted(indices, self.offsets)
        for shard, offset, begin, end in zip(self.shards, self.offsets, bounds, bounds[1:]):
            if begin < end:
                # mode="clip" lets np.take write into `items` unbuffered; the range is checked above.
                np.take(shard, indices[begin:end] - offset, axis=0, out=items[begin:end], mode="clip")
        if order is not None:
            records[order] = records.copy()
        batch = {name: np.ascontiguousarray(records[name]) for name in self.dtype.names}
        return standardize.invert(batch, self.standardized) if self.raw else batch

    def steps_per_epoch(self, global_batch_size: int) -> int:
        return self.num_records // global_batch_size

    def check_batch(self, global_batch_size: int) -> None:
        if self.num_records < global_batch_size:
            raise DataError(
                f"{self.dir}: {self.num_records} records, fewer than one global batch of {global_batch_size} "
                "(train.micro_batch_size x train.grad_accum_steps x train.world_size); "
                "use more data or a smaller batch"
            )

    def global_batch(self, step: int, seed: int, global_batch_size: int) -> np.ndarray:
        """The record indices of optimizer step `step` (0-based), for every rank together."""
        self.check_batch(global_batch_size)
        epoch, position = divmod(step, self.steps_per_epoch(global_batch_size))
        # Every rank asks for every step: keep the epoch's permutation instead of redrawing it.
        if self._epoch_order[0] != (seed, epoch):
            self._epoch_order = ((seed, epoch), np.random.default_rng([seed, epoch]).permutation(self.num_records))
        return self._epoch_order[1][position * global_batch_size : (position + 1) * global_batch_size].copy()

    def micro_batches(
        self, step: int, seed: int, rank: int, world_size: int, micro_batch_size: int, grad_accum_steps: int
    ) -> list[dict[str, np.ndarray]]:
        """This rank's `grad_accum_steps` micro-batches of optimizer step `step`.
        Which records form a micro-batch depends only on the seed, the step and the
        global batch size; within it they come in index order (the fast gather)."""
        global_batch_size = micro_batch_size * grad_accum_steps * world_size
        indices = self.global_batch(step, seed, global_batch_size)
        first = rank * grad_accum_steps
        return [
            self.gather(np.sort(indices[m * micro_batch_size : (m + 1) * micro_batch_size]))
            for m in range(first, first + grad_accum_steps)
        ]

    def eval_batches(self, rank: int, world_size: int, batch_size: int, records: int | None = None):
        """This rank's contiguous part of the split, in batches; parts differ by at most one record.
        With `records`, of that many records spread evenly over the split (the split keeps the
        source's order, so its first records alone could all be of one kind)."""
        chosen = np.arange(self.num_records)
        if records is not None and records < self.num_records:
            chosen = np.linspace(0, self.num_records, records, endpoint=False).astype(np.int64)
        part = np.array_split(chosen, world_size)[rank]
        for start in range(0, len(part), batch_size):
            yield self.gather(part[start : start + batch_size])

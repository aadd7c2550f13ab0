"""Records of tokens held unpadded while they are made, and read back padded to `data.context`.

A chat's or a packed window's record is its first `used` tokens and then padding (an example of 100
tokens at data.context 512 is four fifths padding). `Ragged` keeps each record's used tokens only, one
int32 scratch file a field, appended as the rows are encoded, and its lengths. `Padded` is one field
as the [records, context] int64 array that write_split (shards.py) and the baseline index with
`column[rows]`: the rows' tokens are read from the scratch file, READ_RECORDS at a time with pread,
and padded there. Nothing is mapped, so the process holds only a block, whatever the size of the data
(docs/benchmarks.md, "Tokenizing chats": int64 records padded, written and mapped back were 1.2 GB for
100,000 chats).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from ..errors import DataError

TOKEN = np.dtype(np.int32)  # a token id, a label (or IGNORE_INDEX), a position: all well inside int32
READ_RECORDS = 1024  # records padded at a time: bounds the temporary arrays of a read


class Ragged:
    """The records' used tokens, `fields` values a token (input ids, labels, ...), in scratch files in
    `scratch` (unlinked: they go when this is dropped)."""

    def __init__(self, scratch: Path | None, fields: int, context: int):
        self.context, self.fields = context, fields
        self.files = [tempfile.TemporaryFile(dir=scratch, prefix="ortflow-examples-") for _ in range(fields)]
        self._lengths: list[int] = []
        self.lengths = self.starts = np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self._lengths)

    def append(self, *fields: np.ndarray) -> None:
        """A record: its fields' values on its used tokens, in order, each of one length."""
        for file, values in zip(self.files, fields, strict=True):
            file.write(values.astype(TOKEN, copy=False).tobytes())
        self._lengths.append(len(fields[0]))

    def extend(self, lengths: np.ndarray, *fields: np.ndarray) -> None:
        """Records one after another, of `lengths`: their fields' values, each field's of all of them at once."""
        for file, values in zip(self.files, fields, strict=True):
            file.write(values.astype(TOKEN, copy=False).tobytes())
        self._lengths.extend(lengths.tolist())

    def end(self) -> None:
        """Every record is appended: make them readable."""
        for file in self.files:
            file.flush()
        self.lengths = np.asarray(self._lengths, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)

    def padded(self, field: int | None, rows: np.ndarray, fill: int | None) -> np.ndarray:
        """[len(rows), context] int64: the rows' values of `field` then `fill`; with field None, 1 on the used
        tokens and 0 on the padding (the attention mask); with fill None, the padding's positions from 0."""
        lengths, starts = self.lengths[rows], self.starts[rows]
        positions = np.arange(self.context)
        used = positions < lengths[:, None]
        if field is None:
            return used.astype(np.int64)
        first = int(starts.min()) if len(rows) else 0
        end = int((starts + lengths).max()) if len(rows) else 0
        span = self._read(self.files[field], first, end - first)
        out = np.empty((len(rows), self.context), np.int64)
        out[...] = positions - lengths[:, None] if fill is None else fill
        # The rows' used tokens, row after row: where `used` is true in reading order. Indexing the span
        # with them alone, not a [rows, context] index, is a fifth of the work at 100 tokens a record.
        before = np.cumsum(lengths) - lengths
        out[used] = span[np.repeat(starts - first - before, lengths) + np.arange(int(lengths.sum()))]
        return out

    @staticmethod
    def _read(file, first: int, count: int) -> np.ndarray:
        data, offset, size = bytearray(), first * TOKEN.itemsize, count * TOKEN.itemsize
        while len(data) < size:
            chunk = os.pread(file.fileno(), size - len(data), offset + len(data))
            if not chunk:
                raise DataError(f"the scratch file {file.name} of the examples ends early: was its disk full?")
            data += chunk
        return np.frombuffer(data, dtype=TOKEN)


class Padded:
    """Field `field` of `records` as a read-only [records, context] int64 array (see Ragged.padded for
    `field` and `fill`): indexed with an array of record numbers, it gives those records, padded."""

    dtype = np.dtype(np.int64)

    def __init__(self, records: Ragged, field: int | None, fill: int | None):
        self.records, self.field, self.fill = records, field, fill

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.records), self.records.context

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, rows) -> np.ndarray:
        rows = np.asarray(rows)
        if rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer):
            raise TypeError(f"records are read by an array of record numbers, not {rows.dtype} of shape {rows.shape}")
        out = np.empty((len(rows), self.records.context), self.dtype)
        for start in range(0, len(rows), READ_RECORDS):
            out[start:start + READ_RECORDS] = self.records.padded(self.field, rows[start:start + READ_RECORDS],
                                                                  self.fill)
        return out

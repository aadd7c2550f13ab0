"""How fast the training reader delivers a split, against reading the same bytes sequentially.

Writes a synthetic split of MNIST-sized records (784 float32 features and an
int64 label: 3144 bytes) with the real shard writer, then in the same run:

- raw: every shard read front to back into one reused buffer (`readinto`, 16 MiB blocks);
- reader: one epoch of optimizer steps through `ShardReader.micro_batches` for
  every rank, in the seeded random global-batch order training uses.

Both are measured twice: with the shards in the page cache ("warm"), and after
`posix_fadvise(DONTNEED)` dropped their pages ("cold": the reads then reach the
disk, or whatever cache the host keeps below this machine). Opening the reader
(sha256 of every shard) is timed on its own.

    python bench/bench_reader.py --megabytes 400
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from ortflow.data.shards import ShardReader, write_split
from ortflow.data.sources import Dataset

FEATURES = 784


def make_split(out: Path, megabytes: int, shards: int) -> Path:
    record_bytes = FEATURES * 4 + 8
    n = megabytes * 2**20 // record_bytes
    rng = np.random.default_rng(0)
    dataset = Dataset(
        {"x": rng.random((n, FEATURES), dtype=np.float32)},
        rng.integers(0, 10, n),
        "y",
        "classification",
        10,
    )
    write_split(dataset, np.arange(n), out, "train", shards, {"bench": True})
    return out


def drop_page_cache(split: Path) -> None:
    for path in split.glob("shard-*.bin"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(split: Path) -> int:
    buffer = bytearray(16 * 2**20)
    view = memoryview(buffer)
    total = 0
    for path in sorted(split.glob("shard-*.bin")):
        with open(path, "rb", buffering=0) as f:
            while count := f.readinto(view):
                total += count
    return total


def reader_epoch(reader: ShardReader, seed: int, world_size: int, micro_batch_size: int) -> tuple[int, int]:
    samples = nbytes = 0
    for step in range(reader.steps_per_epoch(micro_batch_size * world_size)):
        for rank in range(world_size):
            for batch in reader.micro_batches(step, seed, rank, world_size, micro_batch_size, 1):
                samples += len(batch["y"])
                nbytes += sum(a.nbytes for a in batch.values())
    return samples, nbytes


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=400, help="size of the split")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="the best of this many runs counts (the machine is shared)")
    parser.add_argument("--dir", default=None, help="where to write the split (default: a temporary folder)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        split = make_split(Path(tmp) / "train", args.megabytes, args.shards)
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
        reader, open_s = timed(ShardReader, split)
        record_bytes = reader.dtype.itemsize
        print(
            f"split: {len(reader)} records of {record_bytes} bytes = {len(reader) * record_bytes / 2**20:.0f} MiB "
            f"in {args.shards} shards; global batch {args.world_size} ranks x {args.micro_batch_size}"
        )
        print(f"open (sha256 of every shard): {open_s:.2f} s")
        print(f"{'':6} {'raw MB/s':>9} {'reader MB/s':>12} {'reader samples/s':>17} {'ratio':>6}")
        for cache in ("warm", "cold"):
            raw_s = reader_s = float("inf")
            for _ in range(args.repeats):
                # A fresh reader each time: pages the old one still maps would survive the drop.
                del reader
                if cache == "cold":
                    drop_page_cache(split)
                raw_bytes, seconds = timed(raw_read, split)
                raw_s = min(raw_s, seconds)
                if cache == "cold":
                    drop_page_cache(split)
                reader, seconds = timed(ShardReader, split, False)
                (samples, nbytes), epoch_s = timed(
                    reader_epoch, reader, 1234, args.world_size, args.micro_batch_size
                )
                reader_s = min(reader_s, seconds + epoch_s)
            raw_rate, reader_rate = raw_bytes / raw_s / 1e6, nbytes / reader_s / 1e6
            print(
                f"{cache:6} {raw_rate:9.0f} {reader_rate:12.0f} {samples / reader_s:17.0f} "
                f"{reader_rate / raw_rate:6.2f}"
            )


if __name__ == "__main__":
    main()

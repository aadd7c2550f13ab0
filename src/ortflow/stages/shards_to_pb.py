"""ONNX Runtime's TrainingRunner shard format (`*.pb`), for interchange with it.

A file is a sequence of samples; a sample is a little-endian uint32 byte count
followed by, for each input, a uint32 byte count and a serialized
`onnx.TensorProto` named after the input. The C++ runner gives file i to rank
i % world size. Parsing protobuf per sample is slow, which is why ortflow's own
shards are fixed-size records instead; this module converts between the two.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from .. import atomic
from ..data.shards import ShardReader
from ..data.sources import DataError

U32 = struct.Struct("<I")
HELP = "convert a split's shards to ONNX Runtime TrainingRunner .pb files (one per shard)"


def encode_sample(sample: dict[str, np.ndarray]) -> bytes:
    from onnx import numpy_helper

    parts = []
    for name, value in sample.items():
        tensor = numpy_helper.from_array(np.asarray(value), name).SerializeToString()
        parts.append(U32.pack(len(tensor)) + tensor)
    sample = b"".join(parts)
    return U32.pack(len(sample)) + sample


def read_pb(path: Path):
    """Yield each sample of a .pb file as {input name: array}."""
    from onnx import TensorProto, numpy_helper

    data = Path(path).read_bytes()
    position = 0
    while position < len(data):
        if position + 4 > len(data):
            raise DataError(f"{path}: truncated at byte {position} (a sample size needs 4 bytes)")
        (size,) = U32.unpack_from(data, position)
        end = position + 4 + size
        if end > len(data):
            raise DataError(f"{path}: sample at byte {position} claims {size} bytes, the file ends first")
        position += 4
        sample = {}
        while position < end:
            (tensor_size,) = U32.unpack_from(data, position)
            tensor = TensorProto()
            tensor.ParseFromString(data[position + 4:position + 4 + tensor_size])
            sample[tensor.name] = numpy_helper.to_array(tensor)
            position += 4 + tensor_size
        yield sample


def write_pb(split_dir: Path, out_dir: Path) -> list[Path]:
    """One .pb file per shard of `split_dir`, written to a temporary folder first."""
    reader = ShardReader(split_dir)
    out_dir = Path(out_dir)
    with atomic.folder(out_dir) as tmp:
        for index in range(len(reader.offsets) - 1):
            records = reader.gather(np.arange(reader.offsets[index], reader.offsets[index + 1]))
            with open(tmp / f"{split_dir.name}-{index:05d}.pb", "wb") as f:
                for row in range(len(records[reader.label_name])):
                    f.write(encode_sample({name: values[row] for name, values in records.items()}))
    return sorted(out_dir.glob("*.pb"))


def add_arguments(parser) -> None:
    parser.add_argument("split", type=Path, help="a prepared split, e.g. results/digits/data/train")
    parser.add_argument("out", type=Path, help="folder for the .pb files")


def run(args) -> None:
    files = write_pb(args.split, args.out)
    print(f"wrote {len(files)} .pb files to {args.out}")

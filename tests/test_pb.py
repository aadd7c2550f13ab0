"""Interchange with ONNX Runtime's TrainingRunner: shards to .pb files and back."""

import struct

import numpy as np
import pytest
from onnx import TensorProto

from ortflow import cli, config
from ortflow.stages.prepare_data import prepare
from ortflow.stages.shards_to_pb import read_pb
from ortflow.data.shards import ShardReader
from ortflow.data.sources import DataError


@pytest.fixture(scope="module")
def train_split(tmp_path_factory):
    """The default config's train split, prepared in this process."""
    root = tmp_path_factory.mktemp("digits")
    prepare(config.load(), root / "train", root / "eval")
    return root / "train"


def test_round_trip_keeps_every_record(train_split, tmp_path):
    assert cli.main(["shards-to-pb", str(train_split), str(tmp_path / "pb")]) == 0
    files = sorted((tmp_path / "pb").glob("*.pb"))
    reader = ShardReader(train_split)
    assert len(files) == len(reader.manifest.shards)
    samples = [s for f in files for s in read_pb(f)]
    expected = reader.gather(np.arange(len(reader)))
    assert len(samples) == len(reader)
    np.testing.assert_array_equal(np.stack([s["x"] for s in samples]), expected["x"])
    np.testing.assert_array_equal(np.array([s["y"] for s in samples]), expected["y"])


def test_framing_is_the_training_runners(train_split, tmp_path):
    """Read the first sample with struct alone: uint32 sample size, then per input
    a uint32 size and a TensorProto named after the input."""
    cli.main(["shards-to-pb", str(train_split), str(tmp_path / "pb")])
    data = sorted((tmp_path / "pb").glob("*.pb"))[0].read_bytes()
    (sample_size,) = struct.unpack_from("<I", data, 0)
    position, names = 4, []
    while position < 4 + sample_size:
        (size,) = struct.unpack_from("<I", data, position)
        tensor = TensorProto()
        tensor.ParseFromString(data[position + 4:position + 4 + size])
        names.append((tensor.name, list(tensor.dims)))
        position += 4 + size
    assert names == [("x", [64]), ("y", [])]


def test_truncated_file_is_named(train_split, tmp_path):
    cli.main(["shards-to-pb", str(train_split), str(tmp_path / "pb")])
    path = sorted((tmp_path / "pb").glob("*.pb"))[0]
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match=rf"{path.name}: sample at byte \d+ claims \d+ bytes, the file ends first"):
        list(read_pb(path))

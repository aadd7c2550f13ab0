"""The data stage: sources to checksummed shards (through the real rule), bad input, and the reader's batch order."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest

from conftest import run_snakemake
from ortflow import config as config_mod
from ortflow.stages.prepare_data import prepare
from ortflow.data.manifest import Column, read_manifest
from ortflow.data.shards import MANIFEST, ShardReader
from ortflow.data.sources import DataError


def make_config(seed: int = 1234, **data) -> config_mod.Config:
    return config_mod.load(overrides={"run": {"seed": seed}, "data": data})


def split_bytes(split: Path) -> dict[str, bytes]:
    """What a split is made of (Snakemake adds a timestamp file to directory outputs)."""
    return {p.name: p.read_bytes() for p in sorted(split.iterdir()) if p.name == MANIFEST or p.suffix == ".bin"}


def prepare_into(tmp_path: Path, config: dict) -> tuple[Path, Path]:
    train, eval_ = tmp_path / "data" / "train", tmp_path / "data" / "eval"
    prepare(config, train, eval_)
    return train, eval_


def id_npz(path: Path, n: int) -> Path:
    """A data set whose one feature is the sample's id, so batches show which samples they hold."""
    np.savez(path, x=np.arange(n, dtype=np.float32)[:, None], y=np.arange(n) % 3)
    return path


@pytest.mark.e2e
def test_default_config_through_snakemake(workdir, tmp_path):
    run_snakemake(workdir, {}, "prepare_data")
    data = workdir / "results" / "digits" / "data"
    manifests = {split: read_manifest(data / split) for split in ("train", "eval")}
    assert manifests["eval"].records == round(1797 * 0.2) == 359
    assert manifests["train"].records == 1797 - 359
    for split, manifest in manifests.items():
        assert manifest.features == (Column("x", "float32", (64,)),)
        assert manifest.label == Column("y", "int64", ())
        assert (manifest.task, manifest.num_classes, manifest.record_bytes) == ("classification", 10, 264)
        assert len(manifest.shards) == 2
        assert sum(s.records for s in manifest.shards) == manifest.records
        for shard in manifest.shards:
            content = (data / split / shard.file).read_bytes()
            assert len(content) == shard.records * 264
            assert hashlib.sha256(content).hexdigest() == shard.sha256
    assert "train: 1438 records in 2 shards" in (workdir / "logs" / "digits" / "prepare_data.log").read_text()

    # Together the splits hold every digit once: the split loses and invents nothing.
    from sklearn.datasets import load_digits

    digits = load_digits()
    readers = [ShardReader(data / split) for split in ("train", "eval")]
    rows = np.concatenate(
        [np.column_stack([b["x"], b["y"]]) for r in readers for b in r.eval_batches(0, 1, 500)]
    )
    expected = np.column_stack([(digits.data / 16).astype(np.float32), digits.target])
    assert np.array_equal(np.unique(rows, axis=0), np.unique(expected, axis=0))
    assert len(rows) == len(expected)

    # The split is a function of the seed: same seed, same bytes; another seed, other shards.
    same = prepare_into(tmp_path / "same", make_config(1234))
    other = prepare_into(tmp_path / "other", make_config(99))
    for split, again, changed in zip(("train", "eval"), same, other):
        assert split_bytes(again) == split_bytes(data / split)
        assert split_bytes(changed).keys() == split_bytes(again).keys()
        assert split_bytes(changed)["shard-00000.bin"] != split_bytes(again)["shard-00000.bin"]


@pytest.mark.e2e
def test_user_csv_through_snakemake(workdir):
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(rng.normal(size=(200, 3)), columns=["a", "b", "c"])
    frame["target"] = rng.integers(0, 4, 200)
    frame["note"] = "not a feature"  # unused text columns are fine
    workdir.mkdir(parents=True)
    frame.to_csv(workdir / "my.csv", index=False)
    # A relative path resolves against the folder Snakemake runs in.
    run_snakemake(workdir, {"run": {"name": "csv"}, "data": {"source": "my.csv", "features": ["a", "b", "c"], "label": "target", "shards": 3}}, "prepare_data")
    data = workdir / "results" / "csv" / "data"
    train, eval_ = ShardReader(data / "train"), ShardReader(data / "eval")
    assert (len(train), len(eval_), len(train.shards)) == (160, 40, 3)
    assert train.manifest.features == (Column("x", "float32", (3,)),)
    assert (train.label_name, train.manifest.task, train.manifest.num_classes) == ("target", "classification", 4)
    batch = train.gather(np.arange(len(train)))
    assert_rows_of(np.column_stack([batch["x"], batch["target"]]), frame[["a", "b", "c", "target"]])


def assert_rows_of(records: np.ndarray, frame: pd.DataFrame) -> None:
    """Each record is a distinct row of the source table (as float32)."""
    rows = [tuple(r) for r in records.astype(np.float32)]
    assert len(set(rows)) == len(rows)
    assert set(rows) <= {tuple(r) for r in frame.to_numpy(np.float32)}


@pytest.mark.e2e
def test_user_npz_through_snakemake(workdir):
    rng = np.random.default_rng(1)
    workdir.mkdir(parents=True)
    image, extra = rng.normal(size=(120, 4, 4)), rng.integers(0, 9, size=(120, 2))
    target = image.sum(axis=(1, 2))
    np.savez(workdir / "arrays.npz", image=image, extra=extra, target=target)
    config = {"run": {"name": "npz"}, "data": {"source": "arrays.npz", "features": ["image", "extra"], "label": "target"}}
    run_snakemake(workdir, config, "prepare_data")
    reader = ShardReader(workdir / "results" / "npz" / "data" / "train")
    assert reader.manifest.features == (Column("image", "float32", (4, 4)), Column("extra", "int64", (2,)))
    assert reader.manifest.label == Column("target", "float32", ())
    assert (len(reader), reader.manifest.task) == (96, "regression")
    batch = reader.gather(np.arange(len(reader)))
    # Each record keeps its arrays together: the label is still the sum of its image.
    assert np.allclose(batch["image"].sum(axis=(1, 2)), batch["target"], atol=1e-5)
    # Editing the data file makes the rule rerun.
    np.savez(workdir / "arrays.npz", image=image[:100], extra=extra[:100], target=target[:100])
    run_snakemake(workdir, config, "prepare_data")
    assert len(ShardReader(workdir / "results" / "npz" / "data" / "train")) == 80


@pytest.mark.e2e
def test_npz_with_string_labels_through_snakemake(workdir):
    """An .npz whose label array is strings, through every stage to the report's tables: the manifest,
    metrics.json, the report and the exported model name the sorted classes."""
    import onnx

    rng = np.random.default_rng(3)
    workdir.mkdir(parents=True)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    names = np.array(["odd", "even", "évén"])
    np.savez(workdir / "parity.npz", x=x, parity=names[np.argmax(x[:, :3], axis=1)])
    config = {"run": {"name": "parity"}, "data": {"source": "parity.npz", "label": "parity", "shards": 1},
              "model": {"hidden": [16]},
              "train": {"world_size": 1, "steps": 20, "log_every": 10, "eval_every": 20, "checkpoint_every": 20}}
    run_snakemake(workdir, config, "report_tables")
    results = workdir / "results" / "parity"
    classes = ["even", "odd", "évén"]
    for split in ("train", "eval"):
        manifest = ShardReader(results / "data" / split).manifest
        assert (manifest.task, list(manifest.classes), manifest.num_classes) == ("classification", classes, 3)
    per_class = json.loads((results / "train/metrics.json").read_text())["eval"]["per_class"]
    assert list(per_class) == classes and sum(c["count"] for c in per_class.values()) == 40
    summary = (results / "report/summary.html").read_text()
    for name in classes:
        assert f"<tr data-key='{name}'><td>{name}</td><td class=n>{per_class[name]['count']}</td>" in summary
    metadata = {p.key: p.value for p in onnx.load(str(results / "export/model.onnx")).metadata_props}
    assert json.loads(metadata["ortflow.classes"]) == classes


def test_hdf5_and_parquet(tmp_path):
    rng = np.random.default_rng(2)
    with h5py.File(tmp_path / "data.h5", "w") as h5:
        h5["x"] = rng.normal(size=(50, 3, 2))
        h5["group/labels"] = rng.integers(0, 2, 50)
    train, _ = prepare_into(tmp_path / "h5", make_config(source=str(tmp_path / "data.h5"), label="group/labels"))
    reader = ShardReader(train)
    assert (len(reader), reader.feature_names, reader.manifest.features[0].shape) == (40, ["x"], (3, 2))
    assert reader.manifest.num_classes == 2

    frame = pd.DataFrame({"u": rng.normal(size=30), "v": rng.normal(size=30), "w": rng.normal(size=30)})
    frame.to_parquet(tmp_path / "data.parquet")
    config = make_config(source=str(tmp_path / "data.parquet"), features=["u", "v"], label="w", eval_fraction=0.5)
    train, eval_ = prepare_into(tmp_path / "pq", config)
    reader = ShardReader(eval_)
    assert (len(reader), reader.manifest.task, reader.manifest.features[0].shape) == (15, "regression", (2,))
    batch = reader.gather(np.arange(15))
    assert_rows_of(np.column_stack([batch["x"], batch["w"]]), frame)


def string_labels(n: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """One float feature and string labels, one of them not ASCII."""
    return np.arange(n, dtype=np.float32)[:, None], np.array(["odd", "even", "évén"] * n)[:n]


def test_string_labels_in_npz_and_hdf5_are_classes_as_in_csv(tmp_path):
    """The same rows as a CSV, as .npz strings (numpy unicode and UTF-8 bytes) and as
    HDF5 string datasets (variable length, which h5py reads as bytes objects, and
    fixed length): the same sorted class names, and manifests and shards equal to
    the CSV's but for the source's path."""
    x, parity = string_labels()
    pd.DataFrame({"x": x[:, 0], "parity": parity}).to_csv(tmp_path / "parity.csv", index=False)
    encoded = np.array([label.encode("utf-8") for label in parity])  # numpy bytes, |S6
    np.savez(tmp_path / "unicode.npz", x=x, parity=parity)
    np.savez(tmp_path / "bytes.npz", x=x, parity=encoded)
    with h5py.File(tmp_path / "variable.h5", "w") as h5:
        h5["x"] = x
        h5.create_dataset("parity", data=parity.tolist(), dtype=h5py.string_dtype())
    with h5py.File(tmp_path / "fixed.h5", "w") as h5:
        h5["x"], h5["parity"] = x, encoded
    with h5py.File(tmp_path / "variable.h5") as h5:
        assert h5["parity"][()].dtype == object and isinstance(h5["parity"][()][0], bytes)

    def prepared(name: str) -> tuple[dict, dict]:
        train, eval_ = prepare_into(tmp_path / "out" / name, make_config(source=str(tmp_path / name), label="parity"))
        manifest = json.loads((train / MANIFEST).read_text())  # as written, byte for byte the same but the source
        assert manifest["source"]["data"].pop("source") == str(tmp_path / name)
        return manifest, {f"{split.name}/{shard.name}": shard.read_bytes() for split in (train, eval_)
                          for shard in sorted(split.glob("*.bin"))}

    csv_manifest, csv_shards = prepared("parity.csv")
    assert (csv_manifest["task"], csv_manifest["classes"], csv_manifest["num_classes"]) == (
        "classification", ["even", "odd", "évén"], 3)
    for name in ("unicode.npz", "bytes.npz", "variable.h5", "fixed.h5"):
        manifest, shards = prepared(name)
        assert manifest == csv_manifest, name
        assert shards == csv_shards, name


def test_string_arrays_that_are_not_class_names_are_refused(tmp_path):
    x, parity = string_labels()
    cases = {
        "feature.npz": ({"x": parity[:, None], "y": np.arange(40) % 2},
                        "array 'x' has dtype <U4; expected numbers"),
        "wide.npz": ({"x": x, "y": parity.reshape(20, 2)},
                     "label 'y' is strings of shape [20, 2]; a label of strings is one class name per sample, "
                     "of shape [samples]"),
        "latin1.npz": ({"x": x, "y": np.array(["é".encode("latin-1"), b"a"] * 20)},
                       "label 'y' holds bytes that are not UTF-8 text ('utf-8' codec can't decode byte 0xe9 in "
                       "position 0: unexpected end of data)"),
        "dates.npz": ({"x": x, "y": np.arange(40).astype("datetime64[D]")},
                      "array 'y' has dtype datetime64[D]; expected numbers, bools or strings (class names)"),
    }
    for name, (arrays, expected) in cases.items():
        np.savez(tmp_path / name, **arrays)
        with pytest.raises(DataError) as error:
            prepare_into(tmp_path / "out", make_config(source=str(tmp_path / name)))
        assert str(error.value) == f"{tmp_path / name}: {expected}", name
    assert not (tmp_path / "out").exists()


def test_integer_features_stay_integer(tmp_path):
    """Token ids reach the shards as int64 from .npz, HDF5 and Parquet (int32 and
    uint8 widened); floats, bools and CSV columns become float32."""
    rng = np.random.default_rng(3)
    ids, labels = rng.integers(0, 1000, size=(40, 6)), rng.integers(0, 2, 40)
    np.savez(tmp_path / "ids.npz", ids=ids, small=ids.astype(np.uint8), flag=ids > 500, y=labels)
    with h5py.File(tmp_path / "ids.h5", "w") as h5:
        h5["ids"], h5["y"] = ids.astype(np.int32), labels
    frame = pd.DataFrame({"a": ids[:, 0], "b": ids[:, 1], "c": ids[:, 2] / 7, "y": labels})
    frame.to_parquet(tmp_path / "ids.parquet")
    frame.to_csv(tmp_path / "ids.csv", index=False)
    cases = [("ids.npz", ["ids", "small", "flag"], ["int64", "int64", "float32"]), ("ids.h5", ["ids"], ["int64"]),
             ("ids.parquet", ["a", "b"], ["int64"]), ("ids.parquet", ["a", "c"], ["float32"]),
             ("ids.csv", ["a", "b"], ["float32"])]
    for i, (source, features, dtypes) in enumerate(cases):
        train, _ = prepare_into(tmp_path / str(i), make_config(source=str(tmp_path / source), features=features))
        reader = ShardReader(train)
        assert [f.dtype for f in reader.manifest.features] == dtypes, source
        first = reader.feature_names[0]
        batch = reader.gather(np.arange(len(reader)))
        assert batch[first].dtype == np.dtype(dtypes[0])
        if dtypes[0] == "int64":  # the ids themselves, not rounded floats
            assert set(batch[first].reshape(-1).tolist()) <= set(ids.reshape(-1).tolist())


def test_text_sources(tmp_path):
    (tmp_path / "corpus.txt").write_text("hello, shards! " * 40)
    train, eval_ = prepare_into(tmp_path / "txt", make_config(source=str(tmp_path / "corpus.txt"), context=16))
    reader = ShardReader(train)
    assert reader.manifest.task == "language_model" and reader.manifest.num_classes == 256
    assert len(reader) + len(ShardReader(eval_)) == (600 - 1) // 16
    batch = reader.gather(np.arange(len(reader)))
    assert batch["x"].shape == batch["y"].shape == (len(reader), 16)
    assert np.array_equal(batch["x"][:, 1:], batch["y"][:, :-1])  # the label is the input shifted by one byte
    assert bytes(batch["x"][0].astype(np.uint8)) in ("hello, shards! " * 3).encode()

    # `source: text` without a path: Python's own documentation, present in every CPython.
    train, _ = prepare_into(tmp_path / "pydoc", make_config(source="text", eval_fraction=0.05))
    assert len(ShardReader(train)) > 5000


def write_csv(rows: dict):
    return lambda path: pd.DataFrame(rows).to_csv(path, index=False)


BAD_INPUTS = {
    "missing file": (None, {}, "data.source: file {path} does not exist"),
    "missing column": (write_csv({"a": [1.0] * 9, "b": [2.0] * 9, "y": [0, 1, 2] * 3}), {"features": ["a", "c"]}, "column(s) c not found; the file has columns a, b, y"),
    "non-numeric column": (write_csv({"a": [1.0] * 9, "b": ["1", "x2", "3"] * 3, "y": [0, 1, 2] * 3}), {"features": ["a", "b"]}, "column 'b' is not numeric (e.g. 'x2', dtype"),
    "NaN labels": (write_csv({"a": np.arange(9.0), "y": [0, 1, None, 1, 0, None, 1, 0, 1]}), {"features": ["a"]}, "label 'y' has 2 NaN or infinite value(s) (first at row 2)"),
    "empty CSV": (write_csv({"a": [], "y": []}), {"features": ["a"]}, "no rows (an empty data set)"),
    "empty npz": (lambda path: np.savez(path, x=np.zeros((0, 3)), y=np.zeros(0, dtype=int)), {}, "the data set has no samples"),
    # Data that would train a meaningless model.
    "single class": (write_csv({"a": np.arange(9.0), "y": [1] * 9}), {"features": ["a"]},
                     "{path}: label 'y' has a single class (1) in all 9 rows; classification needs two or more"),
    "label among the features": (write_csv({"a": np.arange(9.0), "y": [0, 1, 2] * 3}), {"features": ["a", "y"]},
                                 "{path}: column 'y' is both data.label and one of data.features (a, y); the model "
                                 "would see the answer"),
    "label among the npz features": (lambda path: np.savez(path, x=np.zeros((9, 2)), y=np.arange(9) % 2),
                                     {"features": ["x", "y"]}, "{path}: column 'y' is both data.label"),
    "1e39 feature": (write_csv({"a": [1.0, 1e39, -3e39] * 3, "y": [0, 1, 2] * 3}), {"features": ["a"]},
                     "{path}: column 'a' has a value of 3e+39, beyond float32's range (largest 3.403e+38)"),
    "1e38 label": (write_csv({"a": np.arange(9.0), "y": [0.5, 1e38, 2.0] * 3}), {"features": ["a"]},
                   "{path}: column 'y' has a value of 1e+38, so large that its square overflows float32 "
                   "(largest usable 1.84e+19)"),
    "1e39 npz array": (lambda path: np.savez(path, x=np.full((9, 2), 1e39), y=np.arange(9) % 2), {},
                       "{path}: array 'x' has a value of 1e+39, beyond float32's range"),
    "directory": (lambda path: path.mkdir(), {}, "data.source: {path} is a directory, not a file"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_refused_and_leaves_no_output(tmp_path, case):
    write, data, message = BAD_INPUTS[case]
    path = tmp_path / ("data.npz" if "npz" in case else "data.csv")
    if write:
        write(path)
    with pytest.raises(DataError) as error:
        prepare_into(tmp_path, make_config(source=str(path), **data))
    assert message.format(path=path) in str(error.value)
    assert str(path) in str(error.value)
    assert not (tmp_path / "data").exists() and not list(tmp_path.rglob(MANIFEST))


@pytest.mark.e2e
def test_bad_input_through_snakemake(workdir):
    workdir.mkdir(parents=True)
    run = {"run": {"name": "bad"}, "data": {"source": "absent.csv"}}
    result = run_snakemake(workdir, run, "prepare_data", check=False)
    assert result.returncode != 0 and "absent.csv" in result.stderr and "Missing input files" in result.stderr
    assert not (workdir / "results").exists()

    pd.DataFrame({"a": ["cat", "dog"] * 5, "label": [0, 1] * 5}).to_csv(workdir / "pets.csv", index=False)
    run["data"] = {"source": "pets.csv", "features": ["a"], "label": "label"}
    assert run_snakemake(workdir, run, "prepare_data", check=False).returncode != 0
    log = (workdir / "logs" / "bad" / "prepare_data.log").read_text()
    assert "ortflow prepare-data: error: pets.csv: column 'a' is not numeric" in log
    assert not list((workdir / "results").rglob(MANIFEST))


def test_fewer_samples_than_one_global_batch(tmp_path):
    train, _ = prepare_into(tmp_path, make_config(source=str(id_npz(tmp_path / "ids.npz", 50))))
    reader = ShardReader(train)
    reader.check_batch(40)
    for call in (lambda: reader.check_batch(64), lambda: reader.micro_batches(0, 1, 0, 2, 32, 1)):
        with pytest.raises(DataError, match=r"40 records, fewer than one global batch of 64 \(train.micro_batch_size"):
            call()


def test_changed_shard_is_named(tmp_path):
    train, _ = prepare_into(tmp_path, make_config())
    shard = train / "shard-00001.bin"
    content = bytearray(shard.read_bytes())
    content[1000] ^= 0x40  # one bit of one pixel: same size, other bytes
    shard.write_bytes(bytes(content))
    with pytest.raises(DataError, match=rf"shard {shard}: checksum mismatch \(sha256 [0-9a-f]{{64}}, manifest [0-9a-f]{{64}}\)"):
        ShardReader(train)
    shard.write_bytes(bytes(content[:-264]))
    with pytest.raises(DataError, match=rf"shard {shard}: 189552 bytes, the manifest says 189816"):
        ShardReader(train)


@pytest.fixture(scope="module")
def id_split(tmp_path_factory) -> tuple[ShardReader, ShardReader]:
    tmp = tmp_path_factory.mktemp("ids")
    train, eval_ = prepare_into(tmp, make_config(source=str(id_npz(tmp / "ids.npz", 1000)), shards=3))
    return ShardReader(train), ShardReader(eval_)


def ids(batches) -> list[np.ndarray]:
    return [b["x"][:, 0].astype(np.int64) for b in batches]


def test_batches_do_not_depend_on_world_size(id_split):
    reader, seed = id_split[0], 7
    assert reader.steps_per_epoch(64) == 800 // 64 == 12
    seen_in_epoch = []
    for step in range(16):  # across the end of the first epoch
        two_ranks = [ids(reader.micro_batches(step, seed, rank, 2, 32, 1)) for rank in range(2)]
        one_rank = ids(reader.micro_batches(step, seed, 0, 1, 32, 2))
        assert [len(r) for r in two_ranks] == [1, 1] and len(one_rank) == 2
        assert np.array_equal(np.concatenate([b for r in two_ranks for b in r]), np.concatenate(one_rank))
        four_ranks = [ids(reader.micro_batches(step, seed, rank, 4, 16, 1)) for rank in range(4)]
        assert np.array_equal(np.sort(np.concatenate([b for r in four_ranks for b in r])), np.sort(np.concatenate(one_rank)))
        if step < 12:
            seen_in_epoch.extend(np.concatenate(one_rank))
    assert len(set(seen_in_epoch)) == 12 * 64  # no sample twice within an epoch
    assert not np.array_equal(reader.global_batch(0, seed, 64), reader.global_batch(12, seed, 64))
    assert not np.array_equal(reader.global_batch(0, seed, 64), reader.global_batch(0, seed + 1, 64))


def test_gather_keeps_the_order_asked_for(id_split):
    reader = id_split[0]
    everything = reader.gather(np.arange(len(reader)))["x"][:, 0]
    indices = np.array([799, 0, 412, 5, 266, 267, 3])
    assert np.array_equal(reader.gather(indices)["x"][:, 0], everything[indices])
    with pytest.raises(IndexError, match="out of range 0..799"):
        reader.gather(np.array([800]))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_eval_parts_cover_the_split_once(id_split, world_size):
    reader = id_split[1]
    parts = [np.concatenate(ids(reader.eval_batches(rank, world_size, 32))) for rank in range(world_size)]
    assert all(len(b["y"]) <= 32 for rank in range(world_size) for b in reader.eval_batches(rank, world_size, 32))
    assert np.array_equal(np.sort(np.concatenate(parts)), np.sort(reader.gather(np.arange(len(reader)))["x"][:, 0].astype(np.int64)))
    assert len(np.concatenate(parts)) == len(reader) == 200


def test_a_bounded_evaluation_reads_records_spread_over_the_split_and_the_ranks(tmp_path):
    """train.eval_batches: `records` of the split, evenly spaced (the split keeps the
    source's order), each rank a contiguous part of them; without a bound, every record."""
    _, eval_ = prepare_into(tmp_path, make_config(source=str(id_npz(tmp_path / "ids.npz", 1796)), eval_fraction=0.5))
    reader = ShardReader(eval_)
    assert len(reader) == 898

    def read(rank: int, world_size: int, records: int | None) -> list[int]:
        return [int(i) for batch in reader.eval_batches(rank, world_size, 16, records) for i in batch["x"][:, 0]]

    everything = read(0, 1, None)
    assert everything == sorted(everything) and len(everything) == 898
    chosen = read(0, 2, 100) + read(1, 2, 100)
    assert len(chosen) == 100 and len(read(0, 2, 100)) == 50
    expected = np.linspace(0, 898, 100, endpoint=False).astype(int)
    assert chosen == [everything[i] for i in expected]  # from the first records to the last ones
    assert read(0, 1, 10_000) == everything


def mapped_rss_kb(array: np.ndarray) -> int:
    """The resident kB of the mapping that holds `array`'s first byte, from /proc/self/smaps."""
    address, inside = array.__array_interface__["data"][0], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and ":" not in line.split(" ", 1)[0]:
            start, end = (int(part, 16) for part in line.split(" ", 1)[0].split("-"))
            inside = start <= address < end
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError("no mapping holds the array")


def test_write_split_lets_go_of_a_mapped_token_streams_pages(tmp_path):
    """The windows of a tokenized text are views of a mapped scratch file (tokenizer.py): written, their
    pages no longer count in the process's memory, which would otherwise grow with the text."""
    from ortflow.data.shards import drop_mapped_pages, write_split
    from ortflow.data.sources import Dataset, windows

    stream = tmp_path / "tokens"
    np.arange(1 << 20, dtype=np.int64).tofile(stream)  # 8 MB
    tokens = np.memmap(stream, dtype=np.int64, mode="r")
    inputs, labels = windows(tokens, 64)
    dataset = Dataset({"input_ids": inputs}, labels, "y", "language_model", 1 << 20)
    write_split(dataset, np.arange(len(labels)), tmp_path / "train", "train", 2, {})
    assert mapped_rss_kb(tokens) < 1024  # the last block's pages at most were it not dropped
    batch = ShardReader(tmp_path / "train").gather(np.array([0, len(labels) - 1]))
    last = (len(labels) - 1) * 64
    np.testing.assert_array_equal(batch["input_ids"][1], tokens[last:last + 64])  # read again from the file
    assert mapped_rss_kb(tokens) > 0
    drop_mapped_pages(labels)
    assert mapped_rss_kb(tokens) == 0

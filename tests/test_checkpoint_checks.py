"""A checkpoint folder from someone else: checked before anything large is read or
handed to ONNX Runtime (ortflow.checkpoints.checks). Fast: synthetic checkpoints
written with ortflow's own shard writer, no training."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import opened_paths, outside
from ortflow.checkpoints import checks, layout, reader, resume, summary, writer
from ortflow.checkpoints.layout import Manifest
from ortflow.checkpoints.manifest import write_manifest
from ortflow.checkpoints.ort_format import CheckpointError, TrainingState, ort_checkpoint_bytes

SHAPES = {"w": (4, 3), "b": (3,)}
IDENTITY = {"optimizer": {"name": "adamw"}}


def training_state() -> TrainingState:
    rng = np.random.default_rng(0)
    parameters = {n: rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}
    moments = {n: {m: rng.normal(size=s).astype(np.float32) for m in ("momentum0", "momentum1")}
               for n, s in SHAPES.items()}
    return TrainingState(parameters, {n: True for n in SHAPES}, moments,
                         {"group_name": "group0", "step": 40, "initial_learning_rate": 0.003},
                         {"step": 40, "lr": 0.001, "samples_seen": 1920})


def write_checkpoint(folder: Path, world_size: int = 2) -> Path:
    """A complete checkpoint folder of `training_state()`, as training writes it."""
    state = training_state()
    folder.mkdir(parents=True)
    entries = []
    for rank, ranges in enumerate(layout.partition(state, world_size)):
        attrs = layout.shard_attrs("40-abc", 40, rank, world_size, IDENTITY, "d" * 64, state.version)
        entries.append(writer.write_shard(folder, state.part(ranges), attrs))
    write_manifest(folder / layout.MANIFEST, Manifest(
        "40-abc", 40, world_size, IDENTITY, "d" * 64, state.properties, tuple(entries)))
    (folder / layout.COMPLETE).write_bytes(b"")
    return folder


@pytest.fixture
def folder(tmp_path) -> Path:
    return write_checkpoint(tmp_path / "run" / "train" / "checkpoints" / "step-00000040")


@pytest.fixture
def model(tmp_path) -> Path:
    """The model's initial checkpoint (what build_artifacts writes): names, shapes, dtypes, no optimizer state."""
    state = training_state()
    artifacts = tmp_path / "run" / "artifacts"
    artifacts.mkdir(parents=True)
    (artifacts / "checkpoint").write_bytes(ort_checkpoint_bytes(
        TrainingState(state.parameters, state.requires_grad, {}, {}, {})))
    return artifacts


def edit_manifest(folder: Path, edit) -> None:
    manifest = json.loads((folder / layout.MANIFEST).read_text())
    edit(manifest)
    (folder / layout.MANIFEST).write_text(json.dumps(manifest))


def rewrite_shards(folder: Path, edit) -> None:
    """Change every shard with `edit(h5py.File)`, then recompute the manifest's sizes and
    checksums, as someone who rewrites a checkpoint would."""
    for file in sorted(folder.glob("shard-*.h5")):
        with h5py.File(file, "r+") as f:
            edit(f)

    def recompute(manifest):
        for entry in manifest["shards"]:
            data = (folder / entry["file"]).read_bytes()
            entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()

    edit_manifest(folder, recompute)


def replace_dataset(group, key: str, make) -> None:
    old = group[key]
    attrs = dict(old.attrs)
    data = old[()]
    del group[key]
    new = make(data)
    for name, value in attrs.items():
        new.attrs[name] = value


def refused(folder: Path, model: Path | None = None) -> str:
    with pytest.raises(CheckpointError) as error:
        reader.read_checkpoint(folder, model)
    assert len(str(error.value).splitlines()) == 1
    return str(error.value)


def test_an_intact_checkpoint_passes_every_check(folder, model):
    read = reader.read_checkpoint(folder, model)
    expected = training_state()
    for name in SHAPES:
        assert np.array_equal(read.state.parameters[name], expected.parameters[name])
        assert np.array_equal(read.state.optimizer_states[name]["momentum1"], expected.optimizer_states[name]["momentum1"])
    # The model is what --artifacts names: nothing guesses it from the checkpoint's path.
    assert "not checked against a model" in summary.inspect(folder)
    report = summary.inspect(folder, model)
    assert f"checked against the model {model}: parameter names, shapes, dtypes, trainable flags" in report


@pytest.mark.parametrize("name", ["../../../../../../../../etc/passwd", "/dev/zero", "sub/shard-00000-of-00002.h5",
                                  "shard-00001-of-00002.h5"])
def test_manifest_names_only_plain_shard_files_of_its_folder(folder, name):
    edit_manifest(folder, lambda m: m["shards"][0].update(file=name))
    with opened_paths() as paths:
        message = refused(folder)
    assert f"{folder / 'manifest.json'}: shard file {name!r} is not allowed; a shard is named by its plain file " \
           "name in the checkpoint folder ('shard-00000-of-00002.h5' here)" in message
    assert outside(paths, folder) == [] and "/etc/passwd" not in paths and "/dev/zero" not in paths


@pytest.mark.parametrize("kind", ["link to /dev/zero", "link inside", "fifo"])
def test_a_shard_must_be_a_regular_file(folder, kind):
    shard = folder / "shard-00000-of-00002.h5"
    data = shard.read_bytes()
    shard.unlink()
    if kind == "link to /dev/zero":
        shard.symlink_to("/dev/zero")
    elif kind == "link inside":
        (folder / "real.bin").write_bytes(data)
        shard.symlink_to(folder / "real.bin")
    else:
        os.mkfifo(shard)  # reading it would wait forever
    with opened_paths() as paths:
        message = refused(folder)
    reason = {"fifo": "is not a regular file", "link to /dev/zero": "is a symbolic link to /dev/zero",
              "link inside": f"is a symbolic link to {folder / 'real.bin'}"}[kind]
    assert f"shard {shard} {reason}; a shard must be a regular file in its checkpoint folder" in message
    assert outside(paths, folder) == []  # the link was opened without following it


def test_sizes_are_checked_before_hashing(folder, monkeypatch):
    edit_manifest(folder, lambda m: m["shards"][0].update(bytes=1 << 40))
    monkeypatch.setattr(checks, "sha256_of", lambda *a: pytest.fail("hashed before the size was checked"))
    message = refused(folder)
    shard = folder / "shard-00000-of-00002.h5"
    assert f"shard {shard}: {shard.stat().st_size} bytes, manifest.json says {1 << 40}: the file is damaged" in message


def test_a_huge_shape_is_refused_before_allocating(folder):
    """4 TiB of float32 claimed by a shard that holds 12 of its elements."""
    rewrite_shards(folder, lambda f: f["parameters/w"].attrs.__setitem__("shape", np.array([1 << 20, 1 << 20])))
    message = refused(folder)
    assert f"checkpoint {folder}: parameter 'w' has shape [1048576, 1048576] (1099511627776 elements) but its " \
           "shards hold elements [(0, " in message


@pytest.mark.parametrize("change", ["transposed", "float64", "frozen", "missing moment", "renamed"])
def test_datasets_must_match_the_model(folder, model, change, monkeypatch):
    """Rewritten shards with recomputed checksums pass the sha256 but not the model's
    parameters: refused naming the dataset, before ONNX Runtime sees anything."""
    def edit(f):
        params = f["parameters"]
        if change == "transposed" and "w" in params:
            params["w"].attrs["shape"] = np.array([3, 4])
        elif change == "float64":
            for group in (params, f["optimizer/momentum0"], f["optimizer/momentum1"]):
                if "w" in group:
                    replace_dataset(group, "w", lambda data: group.create_dataset("w", data=data.astype(np.float64)))
        elif change == "frozen" and "b" in params:
            params["b"].attrs["requires_grad"] = False
        elif change == "missing moment" and "b" in f["optimizer/momentum1"]:
            del f["optimizer/momentum1/b"]
        elif change == "renamed" and "b" in params:
            params.move("b", "bias")
            f["optimizer/momentum0"].move("b", "bias")
            f["optimizer/momentum1"].move("b", "bias")

    rewrite_shards(folder, edit)
    if change == "renamed":
        edit_manifest(folder, lambda m: [e["parameters"].__setitem__("bias", e["parameters"].pop("b"))
                                         for e in m["shards"] if "b" in e["parameters"]])
    reader.read_checkpoint(folder)  # consistent in itself: only the model tells
    with pytest.raises(CheckpointError) as error:
        resume.load_state(resume.Resume(folder, 40, {}), model)
    expected = {
        "transposed": f"checkpoint {folder}: parameter 'w' is float32 of shape [3, 4]; the model "
                      f"{model / 'checkpoint'} has float32 of shape [4, 3]",
        "float64": f"checkpoint {folder}: parameter 'w' is float64 of shape [4, 3]; the model "
                   f"{model / 'checkpoint'} has float32 of shape [4, 3]",
        "frozen": f"checkpoint {folder}: parameter 'b' is float32 of shape [3] (frozen); the model",
        "missing moment": f"checkpoint {folder}: parameter 'b' has optimizer state ['momentum0'] in a shard; "
                          "expected ['momentum0', 'momentum1']",
        "renamed": f"checkpoint {folder} does not hold the parameters of the model {model / 'checkpoint'}: "
                   "missing ['b'], not in the model ['bias']",
    }[change]
    assert expected in str(error.value)


def test_one_float64_shard_among_float32_ones(folder):
    """w spans both shards (12 + 3 parameters of 2 x 4 bytes each, cut in half)."""
    def edit(f):
        if f.attrs["rank"] == 1:
            params = f["parameters"]
            replace_dataset(params, "w", lambda d: params.create_dataset("w", data=d.astype(np.float64)))

    rewrite_shards(folder, edit)
    message = refused(folder)
    assert f"shard {folder / 'shard-00001-of-00002.h5'}: parameter 'w' is float64 of shape [4, 3] here but float32 " \
           "of shape [4, 3] in another shard" in message

    other = write_checkpoint(folder.parent / "other")
    moments = lambda f: f["optimizer/momentum1"]  # noqa: E731
    rewrite_shards(other, lambda f: "b" in moments(f) and replace_dataset(
        moments(f), "b", lambda d: moments(f).create_dataset("b", data=d.astype(np.float64))))
    assert f"shard {other / 'shard-00000-of-00002.h5'}: optimizer/momentum1/b is float64; the parameter is float32" \
        in refused(other)


def test_links_and_external_storage_are_refused(folder, tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(12, dtype=np.float32).tobytes())

    def edit(f):
        if "w" in f["parameters"]:
            replace_dataset(f["parameters"], "w", lambda d: f["parameters"].create_dataset(
                "w", shape=d.shape, dtype=d.dtype, external=[(str(secret), 0, d.nbytes)]))

    rewrite_shards(folder, edit)
    message = refused(folder)
    assert "/parameters/w is not an array stored in the shard itself (a link, external storage or a group)" in message

    # An HDF5 link to a dataset of another file, in the place of a parameter.
    with h5py.File(tmp_path / "secret.h5", "w") as f:
        f["x"] = np.arange(12, dtype=np.float32)
    other = write_checkpoint(tmp_path / "other")

    def link(f):
        del f["parameters/b"]
        f["parameters/b"] = h5py.ExternalLink(str(tmp_path / "secret.h5"), "/x")

    rewrite_shards(other, lambda f: "b" in f["parameters"] and link(f))
    with opened_paths() as paths:
        message = refused(other)
    assert f"shard {other / 'shard-00000-of-00002.h5'}: /parameters/b is not an array stored in the shard itself" \
           in message
    assert outside(paths, other) == []


HISTORY = {"train": [{"step": 40, "loss": 0.5}], "eval": [{"step": 40, "loss": 0.6}]}


def with_history(folder: Path) -> Path:
    """The checkpoint with the metrics logged up to its step, as training writes them."""
    edit_manifest(folder, lambda m: m.update(history=asdict(writer.write_history(folder, HISTORY))))
    return folder


def inspect(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ortflow.cli", "checkpoint", "inspect", str(folder)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["/dev/zero", "../x", "../../../../../../../../etc/passwd", "sub/history.json"])
def test_the_history_must_be_the_plain_file_of_its_folder(folder, tmp_path, name):
    """Named in manifest.json like a shard: `ortflow checkpoint inspect` and training refuse
    any other file, without opening it."""
    with_history(folder)
    (folder.parent / "x").write_text(json.dumps(HISTORY))
    edit_manifest(folder, lambda m: m["history"].update(file=name))
    result = inspect(folder)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"ortflow checkpoint: error: {folder / 'manifest.json'}: history file {name!r} is not allowed; the history "
        "is named by its plain file name in the checkpoint folder ('history.json' here)")
    with opened_paths() as paths:
        with pytest.raises(CheckpointError, match="history file .* is not allowed"):
            resume.read_history(resume.Resume(folder, 40, {}))
    assert outside(paths, folder) == [] and "/dev/zero" not in paths


@pytest.mark.parametrize("damage", ["link to /dev/zero", "fifo", "size", "checksum", "not metrics"])
def test_the_history_is_verified_like_the_shards(folder, monkeypatch, damage):
    history = with_history(folder) / "history.json"
    if damage == "link to /dev/zero":
        history.unlink()
        history.symlink_to("/dev/zero")
        reason = f"history file {history} is a symbolic link to /dev/zero; a history file must be a regular file in its checkpoint folder"
    elif damage == "fifo":
        history.unlink()
        os.mkfifo(history)  # reading it would wait forever
        reason = f"history file {history} is not a regular file; a history file must be a regular file in its checkpoint folder"
    elif damage == "size":
        edit_manifest(folder, lambda m: m["history"].update(bytes=1 << 40))
        hash_shard = checks.sha256_of

        def hash_shards_only(handle, limit):
            if os.fstat(handle.fileno()).st_ino == history.stat().st_ino:
                pytest.fail("hashed before the size was checked")
            return hash_shard(handle, limit)

        monkeypatch.setattr(checks, "sha256_of", hash_shards_only)
        reason = f"history file {history}: {history.stat().st_size} bytes, manifest.json says {1 << 40}: the file is damaged"
    elif damage == "checksum":
        history.write_text(json.dumps(HISTORY).replace("0.5", "0.4") + "\n")
        reason = f"history file {history}: checksum mismatch (sha256 "
    else:  # rewritten with its checksum: intact, but not what training reads
        edit_manifest(folder, lambda m: m.update(history=asdict(writer.write_history(folder, {"train": 5}))))
        reason = f"history file {history}: not the metrics of a run (a JSON object of 'train' and 'eval' lists)"
    with opened_paths() as paths:
        assert reason in refused(folder)
    assert outside(paths, folder) == []
    with pytest.raises(CheckpointError, match="history file"):
        resume.read_history(resume.Resume(folder, 40, {}))


def test_the_manifest_must_be_a_regular_file(folder):
    manifest = folder / "manifest.json"
    data = manifest.read_bytes()
    manifest.unlink()
    manifest.symlink_to("/dev/zero")  # read_text would read forever
    assert f"manifest {manifest} is a symbolic link to /dev/zero; a manifest must be a regular file" in refused(folder)
    assert reader.digest_of(folder) is None
    manifest.unlink()
    manifest.write_bytes(data)
    assert reader.digest_of(folder) == "d" * 64


def test_inspect_reports_the_checks(folder, model, tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "ortflow.cli", "checkpoint", *map(str, args)], capture_output=True,
                              text=True, timeout=120)

    report = cli("inspect", folder, "--artifacts", model)
    assert report.returncode == 0, report.stderr
    assert "step 40, 2 shards (checksums verified)" in report.stdout
    assert "checked: shards named in manifest.json as plain files of the folder, regular files (no links)" in report.stdout
    assert f"checked against the model {model}" in report.stdout
    rewrite_shards(folder, lambda f: "w" in f["parameters"] and f["parameters/w"].attrs.__setitem__("shape", [3, 4]))
    refusal = cli("inspect", folder, "--artifacts", model / "checkpoint")
    assert refusal.returncode == 1
    assert f"error: checkpoint {folder}: parameter 'w' is float32 of shape [3, 4]; the model" in refusal.stderr
    elsewhere = write_checkpoint(tmp_path / "elsewhere")
    report = cli("inspect", elsewhere)
    assert "not checked against a model (no artifacts beside the checkpoints; give --artifacts)" in report.stdout

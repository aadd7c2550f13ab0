"""The files one stage writes and others read, as records (records.py): a split's shard manifest
(data/manifest.py) and the model description (graphs/description.py), each read in one place, a
missing or mistyped field refused in one line naming the file and the key, and written back as the
same JSON."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from conftest import model_description
from ortflow import config as config_mod
from ortflow.data.manifest import MANIFEST, Column, read_manifest, write_manifest
from ortflow.data.sources import DataError
from ortflow.errors import MissingInputError, ModelError
from ortflow.graphs.description import read_description, write_description
from ortflow.stages.prepare_data import prepare


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """The train split of a small classification data set, as prepare_data wrote it."""
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    np.savez(root / "toy.npz", x=rng.normal(size=(40, 3)).astype(np.float32), y=np.arange(40) % 4)
    prepare(config_mod.load(overrides={"data": {"source": str(root / "toy.npz")}}), root / "train", root / "eval")
    return root / "train"


def edited(split, tmp_path, change) -> object:
    """The manifest of `split` after `change(data)`, read from a copy in `tmp_path`."""
    data = json.loads((split / MANIFEST).read_text())
    change(data)
    (tmp_path / MANIFEST).write_text(json.dumps(data))
    return read_manifest(tmp_path)


def test_the_manifest_is_read_as_written(split, tmp_path):
    manifest = read_manifest(split)
    assert (manifest.features, manifest.label) == ((Column("x", "float32", (3,)),), Column("y", "int64", ()))
    assert (manifest.task, manifest.num_classes, manifest.records, manifest.classes) == ("classification", 4, 32, None)
    assert sum(shard.records for shard in manifest.shards) == 32
    write_manifest(tmp_path, manifest)
    assert (tmp_path / MANIFEST).read_text() == (split / MANIFEST).read_text()


def test_a_manifest_missing_or_mistyping_a_field_names_the_file_and_the_key(split, tmp_path):
    path = tmp_path / MANIFEST
    with pytest.raises(DataError, match=rf"^{path}: no 'label.shape'; run the prepare_data rule again$"):
        edited(split, tmp_path, lambda data: data["label"].pop("shape"))
    with pytest.raises(DataError, match=rf"^{path}: no 'task'; run the prepare_data rule again$"):
        edited(split, tmp_path, lambda data: data.pop("task"))
    with pytest.raises(DataError, match=rf"^{path}: 'shards\[0\].records' is \"8\", expected an integer; run the "):
        edited(split, tmp_path, lambda data: data["shards"][0].update(records="8"))
    with pytest.raises(DataError, match=rf"^{path}: 'features' is {{}}, expected a list; "):
        edited(split, tmp_path, lambda data: data.update(features={}))
    with pytest.raises(DataError, match=rf"^{path}: not JSON \("):
        path.write_text("{")
        read_manifest(tmp_path)
    with pytest.raises(DataError, match=rf"^{path}: format 'other/2', expected 'ortflow-shards/1'$"):
        edited(split, tmp_path, lambda data: data.update(format="other/2"))


def test_a_manifest_of_an_earlier_ortflow_without_the_later_fields_is_read(split, tmp_path):
    """Runs prepared before data.standardize, string classes and data.tokenizer have none of their keys."""
    manifest = edited(split, tmp_path, lambda data: [data.pop(key) for key in ("standardize", "classes", "tokenizer")])
    assert (manifest.standardize, manifest.classes, manifest.tokenizer) == ({}, None, None)


def test_the_model_description_is_written_as_before_and_a_missing_key_is_named(tmp_path):
    """model.json: its keys in build_artifacts' order, the optional ones left out when absent; a
    description missing or mistyping a field is refused naming the file and the key."""
    path = tmp_path / "model.json"
    write_description(path, model_description(lora={"r": 8}))
    data = json.loads(path.read_text())
    assert list(data)[:12] == ["kind", "task", "loss", "num_classes", "inputs", "label", "outputs", "parameters",
                               "trainable_parameters", "trainable", "frozen", "embeddings"]
    assert list(data)[12:] == ["flops_per_sample", "activation_bytes_per_sample", "eval_bytes_per_sample",
                               "running_stats", "bf16_matmuls", "lora"]  # no recompute_blocks, no transformers
    assert read_description(path) == model_description(lora={"r": 8})
    for change, message in ((lambda d: d["outputs"].pop("logits"), "no 'outputs.logits'"),
                            (lambda d: d.update(parameters=1.5), "'parameters' is 1.5, expected an integer"),
                            (lambda d: d["inputs"][0].update(name=None), "'inputs\\[0\\].name' is null, expected a string")):
        edited_data = json.loads(json.dumps(data))
        change(edited_data)
        path.write_text(json.dumps(edited_data))
        with pytest.raises(ModelError, match=rf"^{path}: {message}; run the build_artifacts rule again$"):
            read_description(path)
    with pytest.raises(MissingInputError, match=rf"^{tmp_path / 'none.json'}: no model description"):
        read_description(tmp_path / "none.json")


def test_a_model_description_of_an_earlier_ortflow_reads_with_the_later_fields_absent(tmp_path):
    data = json.loads(json.dumps(dataclasses.asdict(model_description())))
    for key in ("embeddings", "eval_bytes_per_sample", "running_stats", "bf16_matmuls"):
        del data[key]
    del data["outputs"]["inference"]
    (tmp_path / "model.json").write_text(json.dumps(data))
    description = read_description(tmp_path / "model.json")
    assert (description.embeddings, description.eval_bytes_per_sample, description.running_stats) == (None, 0, {})
    assert description.inference_output == "logits"  # the logits', before the inference output was told apart

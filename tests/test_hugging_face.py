"""`model.kind: transformers` (src/ortflow/models/hugging_face.py) short of the
workflow: which task the data make, the head it gets, a folder with only its
config, multi-label and image classification, and what is refused. The tasks
through every stage are in tests/test_fine_tuning.py and
tests/test_token_classification.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import BertConfig, BertForSequenceClassification, ViTConfig

from conftest import shard_manifest
from ortflow import config as config_mod
from ortflow.artifacts import Artifacts
from ortflow.checkpoints.ort_format import read_ort_checkpoint
from ortflow.errors import ConfigError, ModelError
from ortflow.graphs.description import Tensor
from ortflow.models.hugging_face import task_of
from ortflow.reporting.summary import run_summary
from ortflow.stages.build_artifacts import build
from ortflow.stages.prepare_data import prepare
from ortflow.user_files import model_files
from test_pretrained import bits
from test_tokenizers import animal_texts
from text_models import train_wordpiece
from transformers_models import save_bert


def manifest(task: str, label_shape: list[int], features: list[tuple[str, str, list[int]]],
             label_dtype: str = "int64", classes: int = 3):
    return shard_manifest(features, ("y", label_dtype, label_shape), task, classes)


TEXT = [("input_ids", "int64", [16]), ("attention_mask", "int64", [16])]


@pytest.mark.parametrize("data, task", [
    (manifest("language_model", [16], [("x", "int64", [16])], classes=300), "causal-lm"),
    (manifest("classification", [], TEXT), "sequence-classification"),
    (manifest("classification", [16], TEXT), "token-classification"),
    (manifest("regression", [], TEXT, "float32"), "regression"),
    (manifest("classification", [], [("pixels", "float32", [3, 8, 8])]), "image-classification"),
])
def test_auto_finds_the_task_the_data_make(data, task):
    assert task_of("auto", data) == task
    assert task_of(task, data) == task


def test_a_task_the_data_do_not_make_is_refused_naming_both():
    with pytest.raises(ModelError) as error:
        task_of("token-classification", manifest("classification", [], TEXT))
    assert str(error.value) == (
        "model.task: 'token-classification' does not fit the data, which is 3 classes, label 'y' of shape []: "
        "that is 'sequence-classification' (set model.task: sequence-classification, or auto)")
    # Float targets, one per class: multi-label sequence classification.
    assert task_of("sequence-classification", manifest("regression", [4], TEXT, "float32")) == \
        "sequence-classification"


def test_model_task_belongs_to_kind_transformers():
    with pytest.raises(ConfigError, match="'model.task': 'regression' picks the head of a `kind: transformers` "
                                          "model; model.kind is 'mlp'"):
        config_mod.load(overrides={"model": {"task": "regression"}})
    with pytest.raises(ConfigError, match="'model.path': required when model.kind is 'transformers'"):
        config_mod.load(overrides={"model": {"kind": "transformers"}})


def texts_jsonl(folder: Path, rows: int = 64) -> Path:
    frame = animal_texts(rows)
    frame.to_json(folder / "animals.jsonl", orient="records", lines=True)
    train_wordpiece(folder / "tokenizer.json", 120, list(frame["review"]))
    return folder / "animals.jsonl"


def build_in(folder: Path, overrides: dict) -> tuple[dict, Path]:
    config = config_mod.load(overrides={"run": {"seed": 7}} | overrides)
    prepare(config, folder / "data/train", folder / "data/eval")
    out = folder / "artifacts"
    return build(config, folder / "data/train", out), out


def test_the_folders_tokenizer_is_data_tokenizer_by_default(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    monkeypatch.chdir(tmp_path)
    texts_jsonl(tmp_path)
    save_bert(tmp_path / "bert", 120)
    data = {"source": "animals.jsonl", "text": "review", "label": "animal"}
    with pytest.raises(ConfigError, match="'data.text': needs data.tokenizer"):  # the folder has none
        config_mod.load(overrides={"data": data, "model": {"kind": "transformers", "path": "bert"}})
    PreTrainedTokenizerFast(tokenizer_file="tokenizer.json", pad_token="[PAD]").save_pretrained("bert")
    config = config_mod.load(overrides={"data": data, "model": {"kind": "transformers", "path": "bert"}})
    assert config.data.tokenizer == "bert"
    # A tokenizer the config names wins.
    config = config_mod.load(overrides={"data": data | {"tokenizer": "tokenizer.json"},
                                        "model": {"kind": "transformers", "path": "bert"}})
    assert config.data.tokenizer == "tokenizer.json"


def test_a_new_head_of_the_datas_classes_is_drawn_from_the_seed(tmp_path, monkeypatch, caplog):
    """A BERT encoder folder under a 3-class head: the encoder is the folder's bit for bit,
    the head drawn from run.seed (the same on a second build) and named in the log, the
    classes' names in the model's config."""
    monkeypatch.chdir(tmp_path)
    texts_jsonl(tmp_path)
    folder = save_bert(tmp_path / "bert", 120)
    overrides = {"data": {"source": "animals.jsonl", "text": "review", "label": "animal",
                          "tokenizer": "tokenizer.json", "context": 16},
                 "model": {"kind": "transformers", "path": "bert"}}
    with caplog.at_level(logging.INFO, "ortflow.build_artifacts"):
        description, out = build_in(tmp_path / "a", overrides)
    assert description.loss == "cross_entropy" and description.num_classes == 3
    assert "model.path: bert has no sequence-classification head of 3 outputs, the data's: 2 tensor(s) drawn from " \
           "run.seed: classifier.bias, classifier.weight" in caplog.text
    assert description.transformers == {"class": "BertForSequenceClassification",
                                           "task": "sequence-classification", "weights": "folder",
                                           "new_head": ["classifier.bias", "classifier.weight"]}
    summary = run_summary(tmp_path, train_metrics=tmp_path / "none", export_metrics=tmp_path / "none",
                          model=tmp_path / "none", int8=tmp_path / "none", checkpoint=tmp_path / "none",
                          report=tmp_path / "report.html", artifacts=out)
    assert ("  fine-tune BertForSequenceClassification (sequence-classification) from the folder's weights, a new "
            "head drawn from run.seed (classifier.bias, classifier.weight)") in summary.splitlines()
    initial = read_ort_checkpoint(Artifacts(out).checkpoint).parameters
    from safetensors.numpy import load_file

    for name, array in load_file(str(folder / "model.safetensors")).items():
        assert bits(initial[f"model.bert.{name}"]) == bits(array), name
    _, again = build_in(tmp_path / "b", overrides)
    head = read_ort_checkpoint(Artifacts(again).checkpoint).parameters["model.classifier.weight"]
    assert head.shape == (3, 32) and bits(head) == bits(initial["model.classifier.weight"])


def test_multi_label_classification_trains_with_bce(tmp_path, monkeypatch):
    """Float targets in [0, 1], one per class (token ids and targets in an .npz), under
    model.task sequence-classification: transformers' multi-label problem, trained with
    bce_with_logits on 3 logits."""
    monkeypatch.chdir(tmp_path)
    save_bert(tmp_path / "bert", 120)
    rng = np.random.default_rng(0)
    np.savez("tags.npz", input_ids=rng.integers(0, 120, (40, 16)), attention_mask=np.ones((40, 16), np.int64),
             tags=rng.integers(0, 2, (40, 3)).astype(np.float32))
    description, _ = build_in(tmp_path, {
        "data": {"source": "tags.npz", "features": ["input_ids", "attention_mask"], "label": "tags"},
        "model": {"kind": "transformers", "path": "bert", "task": "sequence-classification"}})
    assert description.loss == "bce_with_logits"
    assert description.label == Tensor("tags", "float32", ("batch", 3))


def test_a_folder_with_only_its_config_is_drawn_from_the_seed(tmp_path, monkeypatch):
    """A ViT of only a config.json, for image classification on an .npz of images: built
    from run.seed, the same bits on a second build."""
    monkeypatch.chdir(tmp_path)
    ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
              num_attention_heads=2, intermediate_size=32).save_pretrained("vit")
    rng = np.random.default_rng(0)
    np.savez("images.npz", pixels=rng.random((40, 3, 8, 8), dtype=np.float32), y=np.arange(40) % 4)
    overrides = {"data": {"source": "images.npz", "features": ["pixels"]},
                 "model": {"kind": "transformers", "path": "vit"}}
    description, out = build_in(tmp_path / "a", overrides)
    assert description.num_classes == 4 and description.inputs[0].name == "pixels"
    assert description.transformers == {"class": "ViTForImageClassification", "task": "image-classification",
                                           "weights": "run.seed", "new_head": []}
    _, again = build_in(tmp_path / "b", overrides)
    first, second = (read_ort_checkpoint(Artifacts(o).checkpoint).parameters for o in (out, again))
    assert sorted(first) == sorted(second) and all(bits(first[n]) == bits(second[n]) for n in first)


def test_a_config_only_model_too_large_for_memory_is_refused_before_allocating(tmp_path):
    """vocab_size: 2000000000 in a folder of only a config.json (512 GB of embedding): refused from the
    config on the meta device, naming the key, not by torch's allocator once build_artifacts allocates."""
    import transformers

    from ortflow.models.hugging_face import pretrained

    transformers.LlamaConfig(vocab_size=2_000_000_000, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=96).save_pretrained(tmp_path / "llama")
    with pytest.raises(ModelError) as refusal:
        pretrained(tmp_path / "llama", "causal-lm", {})
    assert str(refusal.value).startswith(
        f"model.path: {tmp_path / 'llama' / 'config.json'} describes a model of 256,000,")
    assert "GiB in float32, more than the " in str(refusal.value)
    assert str(refusal.value).endswith("its largest tensor, model.embed_tokens.weight [2000000000, 64], is from "
                                       "vocab_size: 2000000000, hidden_size: 64")


def test_folders_that_would_run_code_or_read_elsewhere_are_refused(tmp_path):
    folder = tmp_path / "bert"
    BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=8)).config.save_pretrained(folder)
    (folder / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelError, match=f"model.path: {folder} holds its weights as pytorch_model.bin only, a "
                                         "pickle, which can run code when loaded; ortflow reads safetensors"):
        model_files(str(folder))
    (folder / "pytorch_model.bin").unlink()
    save_file({"w": torch.zeros(2)}, folder / "model-1.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "model-1.safetensors", "v": "../../etc/model.safetensors"}}))
    with pytest.raises(ModelError, match=r"names weight files outside its folder: \['../../etc/model.safetensors'\]"):
        model_files(str(folder))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-1.safetensors"}}))
    assert [p.name for p in model_files(str(folder))] == ["config.json", "model.safetensors.index.json",
                                                         "model-1.safetensors"]
    (folder / "config.json").unlink()
    with pytest.raises(ModelError, match=f"model.path: {folder} has no config.json"):
        model_files(str(folder))
    (tmp_path / "elsewhere").symlink_to(folder)
    with pytest.raises(ModelError, match="is a symbolic link to"):
        model_files(str(tmp_path / "elsewhere"))

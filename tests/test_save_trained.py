"""The trained model back in its own framework (models/save_trained.py, written by export_model):
`export/transformers/`, a save_pretrained folder that `from_pretrained` loads with every weight and
whose logits are the ONNX model's; `export/model.safetensors` of a torch module's state_dict names;
and a text model exported with a dynamic sequence dimension, run at lengths it was not trained at.

The stages run as functions, on tiny models (a GPT-2 on bytes, a BERT classifier with a WordPiece
tokenizer), with a merged checkpoint made from the initial one with every parameter moved, so that
the files written must hold the checkpoint's weights, not the folder's."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

from conftest import merged_meta
from ortflow import config as config_mod
from ortflow.checkpoints.ort_format import read_ort_checkpoint, write_ort_checkpoint
from ortflow.data.shards import ShardReader
from ortflow.stages import build_artifacts, export_model, prepare_data
from text_models import pydoc_text, train_wordpiece
from transformers_models import GPT2, save_bert, save_gpt2

CONTEXT = 16
# export/generation/ of a model trained on bytes: the decoder, its configs and a byte-level tokenizer.
GENERATION_FILES = ["config.json", "genai_config.json", "generation_config.json", "model.onnx", "tokenizer.json",
                    "tokenizer_config.json"]


def exported(work: Path, data: dict, model: dict) -> Path:
    """prepare_data, build_artifacts and export_model of `data` and `model` in `work`, from a
    merged checkpoint whose parameters are the initial ones plus noise; returns work/export."""
    config = config_mod.load(overrides={"run": {"name": "x"}, "data": {"shards": 1, **data}, "model": model})
    prepare_data.prepare(config, work / "data/train", work / "data/eval")
    build_artifacts.build(config, work / "data/train", work / "artifacts")
    state = read_ort_checkpoint(work / "artifacts/checkpoint")
    rng = np.random.default_rng(0)
    for name, array in state.parameters.items():
        state.parameters[name] = (array + 0.05 * rng.standard_normal(array.shape)).astype(array.dtype)
    (work / "checkpoint").mkdir()
    write_ort_checkpoint(work / "checkpoint/checkpoint", state)
    merged_meta(work / "checkpoint", 7, "0")
    export_model.export(config, work / "artifacts", work / "checkpoint", work / "data/eval", work / "export/model.onnx")
    return work / "export"


def eval_records(work: Path, n: int = 8) -> dict[str, np.ndarray]:
    return ShardReader(work / "data/eval").gather(np.arange(n))


def onnx_logits(export: Path, feeds: dict) -> np.ndarray:
    session = onnxruntime.InferenceSession(str(export / "model.onnx"))
    return session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})[0]


def sequence_dims(export: Path) -> dict[str, list]:
    model = onnx.load(str(export / "model.onnx"))
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*model.graph.input, *model.graph.output]}


def test_gpt2_folder_loads_with_its_trained_weights_and_scores_other_lengths(tmp_path, caplog):
    """A GPT-2 folder (32 positions) fine-tuned by task on bytes at data.context 16: export/transformers/
    loads through AutoModelForCausalLM with no missing or unexpected weight, holds the checkpoint's
    weights (not the folder's), and its logits are the ONNX model's at the training length; the ONNX
    model takes 1 to 32 tokens, and at 5 and 29 gives the logits transformers gives; export/generation/
    is written and its check logged."""
    from transformers import AutoModelForCausalLM

    (tmp_path / "corpus.txt").write_text(pydoc_text()[:20_000])
    folder = save_gpt2(tmp_path / "gpt2", context=2 * CONTEXT)
    with caplog.at_level(logging.INFO, logger="ortflow"):
        export = exported(tmp_path, {"source": "text", "text_path": str(tmp_path / "corpus.txt"), "context": CONTEXT},
                          {"kind": "transformers", "path": str(folder), "task": "causal-lm"})
    saved = export / "transformers"
    assert sorted(p.name for p in saved.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert "no data.tokenizer, so the transformers folder has no tokenizer files" in caplog.text
    assert json.loads((saved / "config.json").read_text())["use_cache"] is True  # off only for training
    model, info = AutoModelForCausalLM.from_pretrained(saved, output_loading_info=True)
    assert info["missing_keys"] == info["unexpected_keys"] == set() and not info["mismatched_keys"], info
    original = AutoModelForCausalLM.from_pretrained(folder)
    moved = (model.transformer.wte.weight - original.transformer.wte.weight).abs().max().item()
    assert moved > 0.01  # the checkpoint's noise: the folder holds the trained weights
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # tied, as in the folder

    assert sequence_dims(export) == {"x": ["batch", "sequence"], "logits": ["batch", 256, "sequence"]}
    tokens = eval_records(tmp_path)["x"]
    with torch.no_grad():
        for length in (CONTEXT, 5, 2 * CONTEXT - 3):
            ids = np.concatenate([tokens, tokens], axis=1)[:, :length]
            expected = model(input_ids=torch.from_numpy(ids)).logits.transpose(1, 2).numpy()
            assert np.abs(onnx_logits(export, {"x": ids}) - expected).max() < 1e-4, length
    assert ("dynamic sequence length: 8 eval records at 1 and 32 token(s) (data.context 16, positions up to 32) give "
            "outputs of that length, and the first positions' logits those of data.context") in caplog.text
    # A causal LM's generation folder too (generation/run_export.py), checked on eval prompts within its 32 positions.
    assert sorted(p.name for p in (export / "generation").iterdir()) == GENERATION_FILES
    assert (f"{export / 'generation'}: greedy generation in ONNX Runtime (16 steps of at most 16 new tokens, not 64: "
            "the model has 32 positions) from 4 eval prompts of 16 and 8 tokens, left-padded, equals transformers' "
            "generate token for token") in caplog.text


def animal_classifier(work: Path) -> tuple[Path, object]:
    """A BERT folder under a new head of 3 string classes (cat, cow, dog), fine-tuned by task on 120
    short texts tokenized by a WordPiece tokenizer.json (BERT's template: token_type_ids too) at
    data.context 16, exported (`exported`); returns work/export and the texts with their classes."""
    import pandas as pd

    animals = {"cat": "meow", "dog": "woof", "cow": "moo"}
    rng = np.random.default_rng(0)
    names = [sorted(animals)[i] for i in rng.integers(0, 3, 120)]
    texts = [f"the {animals[name]} said {' '.join(rng.choice(['it', 'was', 'loud', 'here'], 4))}" for name in names]
    frame = pd.DataFrame({"review": texts, "animal": names})
    frame.to_json(work / "animals.jsonl", orient="records", lines=True)
    vocab = train_wordpiece(work / "tokenizer.json", 80, texts).get_vocab_size()
    folder = save_bert(work / "bert", vocab)
    export = exported(work, {"source": str(work / "animals.jsonl"), "text": "review", "label": "animal",
                             "tokenizer": str(work / "tokenizer.json"), "context": CONTEXT},
                      {"kind": "transformers", "path": str(folder), "task": "sequence-classification"})
    return export, frame


def test_bert_classifier_folder_has_its_labels_and_tokenizer(tmp_path, caplog):
    """A BERT folder under a new head of 3 string classes, on texts tokenized by a WordPiece tokenizer.json:
    export/transformers/ has the classes as id2label/label2id, the tokenizer as a PreTrainedTokenizerFast
    that encodes the texts to the shards' ids, and logits equal to the ONNX model's, which takes the
    sequence at any length (shapes checked at 1 and 32 tokens)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    with caplog.at_level(logging.INFO, logger="ortflow"):
        export, frame = animal_classifier(tmp_path)
    saved = export / "transformers"
    config = json.loads((saved / "config.json").read_text())
    assert (config["id2label"], config["label2id"]) == ({"0": "cat", "1": "cow", "2": "dog"},
                                                        {"cat": 0, "cow": 1, "dog": 2})
    model, info = AutoModelForSequenceClassification.from_pretrained(saved, output_loading_info=True)
    assert info["missing_keys"] == info["unexpected_keys"] == set() and not info["mismatched_keys"], info

    records = eval_records(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(saved)
    assert tokenizer.pad_token == "[PAD]"  # the data's padding token, which transformers' padding uses
    eval_texts = frame["review"].to_numpy()[prepare_data.split_rows(len(frame), 0.2, 1234)[1][:8]]
    encoded = tokenizer(list(eval_texts), padding="max_length", max_length=CONTEXT)
    assert np.array_equal(np.array(encoded["input_ids"]), records["input_ids"])

    features = ["input_ids", "attention_mask", "token_type_ids"]
    assert all(sequence_dims(export)[name] == ["batch", "sequence"] for name in features)
    assert sequence_dims(export)["logits"] == ["batch", 3]
    with torch.no_grad():
        expected = model(**{name: torch.from_numpy(records[name]) for name in features}).logits.numpy()
    assert np.abs(onnx_logits(export, records) - expected).max() < 1e-4
    assert "dynamic sequence length: 8 eval records at 1 and 32 token(s) (data.context 16, positions up to 64)" \
        in caplog.text


def test_the_folders_own_tokenizer_is_saved_again(tmp_path):
    """A GPT-2 folder with its own BPE tokenizer (data.tokenizer defaults to the folder): export/transformers/
    holds that tokenizer, saved again through AutoTokenizer, which encodes text as the folder's does."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from text_models import train_bpe

    (tmp_path / "corpus.txt").write_text(pydoc_text()[:20_000])
    vocab = train_bpe(tmp_path / "bpe.json", 300).get_vocab_size()
    folder = save_gpt2(tmp_path / "gpt2", vocab_size=vocab, context=2 * CONTEXT)
    PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "bpe.json"), eos_token="<|endoftext|>").save_pretrained(
        folder)
    export = exported(tmp_path, {"source": "text", "text_path": str(tmp_path / "corpus.txt"), "context": CONTEXT},
                      {"kind": "transformers", "path": str(folder), "task": "causal-lm"})
    saved = AutoTokenizer.from_pretrained(export / "transformers")
    text = pydoc_text()[20_000:21_000]
    assert saved(text)["input_ids"] == AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    assert saved.eos_token == "<|endoftext|>"


def test_torch_module_state_dict_loads_strictly_with_tied_names(tmp_path):
    """kind torch (a GPT-2 wrapper with its embedding tied to its head): export/model.safetensors holds
    every state_dict name, the tied tensor under both, the checkpoint's values; load_state_dict(strict=True)
    takes it and the module then gives the ONNX model's logits. An earlier run's transformers/ and generation/
    are removed."""
    from safetensors.torch import load_file

    (tmp_path / "corpus.txt").write_text(pydoc_text()[:20_000])
    for earlier in ("transformers", "generation"):
        (tmp_path / "export" / earlier).mkdir(parents=True)
        (tmp_path / "export" / earlier / "config.json").write_text("{}")
    export = exported(tmp_path, {"source": "text", "text_path": str(tmp_path / "corpus.txt"), "context": CONTEXT},
                      {"kind": "torch", "path": "transformers_models:GPT2", "kwargs": {"context": CONTEXT}})
    assert not (export / "transformers").exists() and not (export / "generation").exists()
    tensors = load_file(str(export / "model.safetensors"))
    torch.manual_seed(1)
    module = GPT2(context=CONTEXT).eval()
    assert sorted(tensors) == sorted(module.state_dict())
    assert torch.equal(tensors["model.lm_head.weight"], tensors["model.transformer.wte.weight"])
    assert not torch.equal(tensors["model.lm_head.weight"], module.state_dict()["model.lm_head.weight"])
    module.load_state_dict(tensors, strict=True)
    tokens = eval_records(tmp_path)["x"]
    with torch.no_grad():
        expected = module(torch.from_numpy(tokens)).numpy()
    assert np.abs(onnx_logits(export, {"x": tokens}) - expected).max() < 1e-4
    # n_positions is data.context here: the sequence is dynamic, checked at 1 and 16 tokens.
    assert sequence_dims(export)["x"] == ["batch", "sequence"]


class WithUnused(torch.nn.Module):
    """A digits classifier with a layer its forward never reads, which torch.onnx leaves out."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(64, 10)
        self.unused = torch.nn.Linear(64, 3)

    def forward(self, x):
        return self.used(x)


def test_a_tensor_forward_never_reads_keeps_its_value_as_built(tmp_path, caplog):
    """Not in the ONNX model, so not in the merged checkpoint: export/model.safetensors has it as the
    module was built from run.seed (load_state_dict(strict=True) wants every name), and the log says so."""
    from safetensors.torch import load_file

    with caplog.at_level(logging.INFO, logger="ortflow"):
        export = exported(tmp_path, {}, {"kind": "torch", "path": "test_save_trained:WithUnused"})
    tensors = load_file(str(export / "model.safetensors"))
    torch.manual_seed(config_mod.load().run.seed)
    built = WithUnused()
    assert torch.equal(tensors["unused.weight"], built.unused.weight.detach())
    assert not torch.equal(tensors["used.weight"], built.used.weight.detach())  # the checkpoint's
    built.load_state_dict(tensors, strict=True)
    assert "2 that forward never reads (not in the ONNX model) keep their values as built: unused.weight, " \
           "unused.bias" in caplog.text


def test_built_in_gpt_keeps_its_sequence_fixed(tmp_path, caplog):
    """The built-in gpt adds its whole position table (data.context rows) to every window: its ONNX
    model takes data.context tokens only, and build_artifacts says why."""
    (tmp_path / "corpus.txt").write_text(pydoc_text()[:20_000])
    config = config_mod.load(overrides={"data": {"source": "text", "text_path": str(tmp_path / "corpus.txt"),
                                                 "context": CONTEXT, "shards": 1},
                                        "model": {"kind": "gpt", "layers": 1, "width": 32, "heads": 2}})
    prepare_data.prepare(config, tmp_path / "train", tmp_path / "eval")
    with caplog.at_level(logging.INFO, logger="ortflow"):
        build_artifacts.build(config, tmp_path / "train", tmp_path / "artifacts")
    shutil.copy(tmp_path / "artifacts/inference_base.onnx", tmp_path / "model.onnx")
    assert sequence_dims(tmp_path)["x"] == ["batch", CONTEXT]
    assert "GPT takes token sequences of data.context=16 only (RuntimeError: The size of tensor a (15) must match " \
           "the size of tensor b (16)" in caplog.text


@pytest.mark.e2e
def test_transformers_run_exports_its_folder_and_a_rerun_replaces_it(tmp_path):
    """Through snakemake: a GPT-2 folder fine-tuned by task on bytes for 4 steps on one rank. export_model
    declares and writes export/transformers/ (the trained weights: from_pretrained gives the ONNX model's
    logits), quantize_model quantizes the model with its dynamic sequence, and `-R export_model` replaces
    the folder whole."""
    from transformers import AutoModelForCausalLM

    from conftest import run_snakemake

    (tmp_path / "corpus.txt").write_text(pydoc_text()[:20_000])
    folder = save_gpt2(tmp_path / "gpt2", context=2 * CONTEXT)
    config = {"run": {"name": "lm"},
              "data": {"source": "text", "text_path": "corpus.txt", "context": CONTEXT, "shards": 1},
              "model": {"kind": "transformers", "path": str(folder), "task": "causal-lm"},
              "train": {"world_size": 1, "steps": 4, "micro_batch_size": 8, "eval_every": 4}}
    run_snakemake(tmp_path, config)
    export = tmp_path / "results/lm/export"
    assert sequence_dims(export)["x"] == ["batch", "sequence"]
    assert "int8" in json.loads((export / "metrics.json").read_text())
    first = (export / "transformers/model.safetensors").stat().st_ino
    tokens = eval_records(tmp_path / "results/lm")["x"]
    model = AutoModelForCausalLM.from_pretrained(export / "transformers")
    with torch.no_grad():
        expected = model(input_ids=torch.from_numpy(tokens)).logits.transpose(1, 2).numpy()
    assert np.abs(onnx_logits(export, {"x": tokens}) - expected).max() < 1e-4

    run_snakemake(tmp_path, config, "-R", "export_model", "--until", "export_model")
    assert (export / "transformers/model.safetensors").stat().st_ino != first
    assert sorted(p.name for p in export.iterdir() if p.name.startswith("transformers")) == ["transformers"]

"""Fine-tuning what users already have, through every stage (snakemake, on the
CPU): a GPT-2 saved with save_pretrained on a `.txt` text with a byte-level BPE
tokenizer, and a BERT encoder under a new head of 3 labels on a `.jsonl` of texts
with string labels and a WordPiece tokenizer. The folders and tokenizers are made
here (tests/transformers_models.py, tests/text_models.py): nothing is downloaded;
both are fine-tuned by task with no code (`model.kind: transformers`).
And README's Fine-tuning example (examples/fine_tuning.py, config/fine_tuning.yaml)
up to the stages."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import yaml
from safetensors.numpy import load_file
from transformers import PreTrainedTokenizerFast

from conftest import gate_judged, run_snakemake
from ortflow import config as config_mod
from ortflow.artifacts import Artifacts
from ortflow.checkpoints.ort_format import read_ort_checkpoint
from ortflow.data.shards import ShardReader
from ortflow.graphs.description import read_description
from ortflow.quantization.export_metrics import read_export_metrics
from ortflow.reporting.summary import int4_line
from ortflow.stages.prepare_data import split_rows
from test_pretrained import bits
from test_tokenizers import ANIMALS, SEED, animal_texts, whole
from text_models import pydoc_text, train_bpe, train_wordpiece
from transformers_models import save_bert, save_gpt2

TESTS = Path(__file__).resolve().parent


def assert_initial_is_the_folders(artifacts: Path, folder: Path, prefix: str, new: list[str]) -> None:
    """The initial checkpoint holds the folder's tensors bit for bit under the
    wrapper's `prefix`, and nothing else than the `new` ones (a new head)."""
    pretrained = {prefix + name: array for name, array in load_file(str(folder / "model.safetensors")).items()}
    initial = read_ort_checkpoint(Artifacts(artifacts).checkpoint).parameters
    assert sorted(initial) == sorted([*pretrained, *new])
    for name, array in pretrained.items():
        assert bits(initial[name]) == bits(array), name


def assert_tokenizer_travels(export: Path) -> dict[str, str]:
    """export/ holds the tokenizer the data were encoded with, named with its
    sha256 in the exported model's metadata; returns that metadata."""
    metadata = {p.key: p.value for p in onnx.load(str(export / "model.onnx")).metadata_props}
    assert metadata["ortflow.tokenizer"] == "tokenizer.json"
    assert metadata["ortflow.tokenizer_sha256"] == hashlib.sha256((export / "tokenizer.json").read_bytes()).hexdigest()
    return metadata


def animals_and_bert(tmp_path: Path) -> tuple[Path, object, int, Path]:
    """A work folder with `animals.jsonl` (400 sentences labelled with the animal they mention) and
    a WordPiece `tokenizer.json` trained on them, and a tiny BERT encoder's folder of that
    vocabulary: (work folder, the sentences' frame, vocabulary size, BERT folder)."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    frame = animal_texts(400)
    frame.to_json(workdir / "animals.jsonl", orient="records", lines=True)
    vocab = train_wordpiece(workdir / "tokenizer.json", 120, list(frame["review"])).get_vocab_size()
    return workdir, frame, vocab, save_bert(tmp_path / "bert", vocab)


@pytest.mark.e2e
def test_gpt2_from_save_pretrained_on_text_with_a_bpe_tokenizer(tmp_path, capsys):
    """GPT-2 from its folder by task (`model.kind: transformers`, causal-lm) on Python's
    documentation as a .txt file, tokenized by a BPE tokenizer trained here: the vocabulary check passes, step 0 is the
    folder's weights, the loss falls from about ln(vocabulary), and the exported
    model with its tokenizer gives the eval loss that training measured; export/generation/ generates
    from a prompt in ONNX Runtime, and with export.int4 quantize_model writes it in int4 too, measured
    against fp32 under the quality gate."""
    from tokenizers import Tokenizer

    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "docs.txt").write_text(pydoc_text()[:300_000])
    tokenizer = train_bpe(workdir / "tokenizer.json", 400)
    vocab, eos = tokenizer.get_vocab_size(), tokenizer.token_to_id("<|endoftext|>")
    folder = save_gpt2(tmp_path / "gpt2", vocab, context=32, eos_token_id=eos)
    config = {
        "run": {"name": "gpt2"},
        "data": {"source": "text", "text_path": "docs.txt", "tokenizer": "tokenizer.json", "context": 32,
                 "shards": 1},
        "model": {"kind": "transformers", "path": str(folder), "task": "causal-lm"},
        "train": {"world_size": 2, "steps": 300, "micro_batch_size": 8, "log_every": 1, "eval_every": 300,
                  "optimizer": {"lr": 0.003}, "lr_schedule": {"warmup_steps": 10}},
        "export": {"int4": {}},
    }
    result = run_snakemake(workdir, config, "quantize_model", "report_tables")  # what it reads
    results = workdir / "results/gpt2"

    assert_initial_is_the_folders(results / "artifacts", folder, "model.", [])
    manifest = ShardReader(results / "data/train").manifest
    assert (manifest.num_classes, manifest.tokenizer["eos_token"]) == (vocab, "<|endoftext|>")
    assert (f"data.tokenizer tokenizer.json has a vocabulary of {vocab} token ids, the model's embedding "
            f"'model.transformer.wte.weight' (which looks up 'x') {vocab} rows: they match") in \
        (workdir / "logs/gpt2/build_artifacts.log").read_text()

    metrics = json.loads((results / "train/metrics.json").read_text())
    losses = [entry["loss"] for entry in metrics["history"]["train"]]
    assert abs(losses[0] - np.log(vocab)) < 0.05, losses[0]  # the folder's GPT-2: nearly uniform at first
    assert np.mean(losses[-20:]) < losses[0] - 1.0, losses[-20:]
    # Better than the tokens' frequencies alone: it learned from the context.
    assert metrics["eval"]["perplexity"] < metrics["baseline"]["perplexity"], metrics["eval"]

    export = results / "export"
    assert_tokenizer_travels(export)
    eval_ = whole(ShardReader(results / "data/eval"))
    session = onnxruntime.InferenceSession(str(export / "model.onnx"))
    logits = session.run(None, {"x": eval_["x"]})[0]  # [windows, vocab, time]
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = -np.take_along_axis(log_probs, eval_["y"][:, None, :], axis=1).mean()
    assert loss == pytest.approx(metrics["eval"]["loss"], rel=1e-4)
    text = "The for statement is used to iterate over the elements of a sequence"
    ids = Tokenizer.from_file(str(export / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert ids == tokenizer.encode(text, add_special_tokens=False).ids
    assert_generation_folder(workdir, export / "generation", result.stdout + result.stderr, capsys)
    assert_int4_folder(workdir, export, result.stdout + result.stderr)
    assert_samples_and_the_generate_target(workdir, config, export, capsys)


def assert_samples_and_the_generate_target(workdir: Path, config: dict, export: Path, capsys) -> None:
    """export/samples.json's 3 eval prompts (a text window's first 16 tokens) with their continuations
    in the report's page, the fine-tuned ones not the starting weights'; `snakemake generate` with the
    config's prompt runs that rule alone, printing and writing what `ortflow generate` prints."""
    import html
    import re

    from ortflow import cli

    samples = json.loads((export / "samples.json").read_text())
    assert samples["max_new_tokens"] == 16  # the model's 32 positions less a 16-token prompt
    assert len(samples["samples"]) == 3 and all(sample["prompt"] and sample["expected"] for sample in
                                                samples["samples"]), samples
    assert any(sample["before"] != sample["after"] for sample in samples["samples"]), samples
    page = (workdir / "results/gpt2/report/samples.html").read_text()
    assert all(html.escape(sample[key]) in page for sample in samples["samples"] for key in ("prompt", "after"))

    prompt = "The for statement"
    result = run_snakemake(workdir, {**config, "generate": {"prompt": prompt, "max_new_tokens": 8}}, "generate")
    assert re.findall(r"^(?:local)?rule (\w+):", result.stdout + result.stderr, re.M) == ["generate"]
    capsys.readouterr()  # what the assertions above printed
    assert cli.main(["generate", str(export / "generation"), "--prompt", prompt, "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    lines = [json.loads(line) for line in (workdir / "results/gpt2/generated.jsonl").read_text().splitlines()]
    assert lines == [{"prompt": prompt, "text": printed[:-1]}] and printed.strip()
    assert printed in result.stdout  # streamed to the console as it comes


def assert_int4_folder(workdir: Path, export: Path, said: str) -> None:
    """export.int4's generation-int4/: generation/'s files, the decoder's weights in MatMulNBits, and
    metrics.json's int4 entry, its gate outcome the one its numbers give, as the summary says."""
    int4_folder = export / "generation-int4"
    files = sorted(p.name for p in int4_folder.iterdir() if p.name != ".snakemake_timestamp")
    assert files == sorted(p.name for p in (export / "generation").iterdir() if p.name != ".snakemake_timestamp")
    assert "MatMulNBits" in {node.op_type for node in onnx.load(str(int4_folder / "model.onnx")).graph.node}
    entry = json.loads((export / "metrics.json").read_text())["int4"]
    print("int4:", entry)
    # 5 of fp32's 32 bits a weight at block 32: 4 bits and a float scale each 32 weights.
    assert entry["weight_ratio"] == entry["int4"]["weight_bytes"] / entry["fp32"]["weight_bytes"] <= 0.35
    for side in ("fp32", "int4"):
        assert np.isfinite(entry[side]["perplexity"]) and entry[side]["perplexity"] > 1, entry
        assert entry[side]["tokens_scored"] > 0 and entry[side]["tokens_per_s"] > 0, entry
    log = (workdir / "logs/gpt2/quantize_model.log").read_text()
    assert gate_judged(entry["gate"], log, "int4"), log
    assert int4_line(read_export_metrics(export / "metrics.json").int4, int4_folder.relative_to(workdir)) in said


def assert_generation_folder(workdir: Path, generation: Path, said: str, capsys) -> None:
    """export/generation/ (a causal LM's decoder with a KV cache) holds its files and the folder's
    tokenizer, its check is logged, the summary gives the command, and that command prints text."""
    from ortflow import cli

    files = sorted(p.name for p in generation.iterdir() if p.name != ".snakemake_timestamp")  # Snakemake's own
    assert files == ["config.json", "genai_config.json", "generation_config.json", "model.onnx", "tokenizer.json",
                     "tokenizer_config.json"]
    log = (workdir / "logs/gpt2/export_model.log").read_text()
    assert ("of at most 16 new tokens, not 64: the model has 32 positions) from 4 eval prompts of 16 and 8 tokens, "
            "left-padded, equals transformers' generate token for token") in log
    command = f"ortflow generate {generation.relative_to(workdir)} --prompt 'your text'"
    assert f"  generate  {command} (a decoder with a KV cache in ONNX Runtime)" in said
    assert cli.main(["generate", str(generation), "--prompt", "The for statement", "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert printed.endswith("\n") and printed.strip(), printed


@pytest.mark.e2e
def test_bert_under_a_new_head_on_jsonl_texts_with_string_labels(tmp_path):
    """A BERT encoder from its folder (with its WordPiece tokenizer, trained here) under a
    new head of 3 labels, by task with no code (`model.kind: transformers`), on a
    .jsonl of sentences labelled with the animal they mention: step 0 is the folder's encoder, the class names are
    in the manifest, metrics.json and the exported model's metadata, and the
    exported model with its tokenizer classifies raw text well above chance."""
    from tokenizers import Tokenizer

    workdir, frame, vocab, folder = animals_and_bert(tmp_path)
    # The folder holds its tokenizer, as save_pretrained folders do: data.tokenizer is then not needed.
    PreTrainedTokenizerFast(tokenizer_file=str(workdir / "tokenizer.json"), pad_token="[PAD]", unk_token="[UNK]",
                            model_input_names=["input_ids", "token_type_ids", "attention_mask"]).save_pretrained(folder)
    config = {
        "run": {"name": "bert"},
        "data": {"source": "animals.jsonl", "text": "review", "label": "animal", "context": 16, "shards": 1},
        "model": {"kind": "transformers", "path": str(folder)},
        "train": {"world_size": 2, "steps": 200, "micro_batch_size": 16, "log_every": 10, "eval_every": 100,
                  "optimizer": {"lr": 0.002}, "lr_schedule": {"warmup_steps": 10}},
    }
    run_snakemake(workdir, config, "quantize_model")  # what it reads
    results = workdir / "results/bert"
    classes = sorted(ANIMALS)
    _, eval_rows = split_rows(len(frame), 0.2, SEED)

    assert_initial_is_the_folders(results / "artifacts", folder, "model.bert.",
                                  ["model.classifier.weight", "model.classifier.bias"])
    manifest = ShardReader(results / "data/train").manifest
    assert (list(manifest.classes), manifest.num_classes) == (classes, 3)
    assert [f.name for f in manifest.features] == ["input_ids", "attention_mask", "token_type_ids"]
    log = (workdir / "logs/bert/build_artifacts.log").read_text()
    assert (f"data.tokenizer {folder} has a vocabulary of {vocab} token ids, the model's embedding "
            f"'model.bert.embeddings.word_embeddings.weight' (which looks up 'input_ids') {vocab} rows: they match") \
        in log
    assert "BertForSequenceClassification (" in log
    trained = json.loads((results / "train/metrics.json").read_text())["eval"]
    assert list(trained["per_class"]) == classes
    assert sum(c["count"] for c in trained["per_class"].values()) == len(eval_rows)
    assert trained["accuracy"] > 0.9, trained  # chance: 1/3 (measured: 1.0)

    export = results / "export"
    metadata = assert_tokenizer_travels(export)
    assert json.loads(metadata["ortflow.classes"]) == classes
    tokenizer = Tokenizer.from_file(str(export / "tokenizer.json"))
    encodings = tokenizer.encode_batch(list(frame["review"][eval_rows]))
    feeds = {"input_ids": [e.ids for e in encodings], "attention_mask": [e.attention_mask for e in encodings],
             "token_type_ids": [e.type_ids for e in encodings]}
    session = onnxruntime.InferenceSession(str(export / "model.onnx"))
    logits = session.run(None, {name: np.array(value, dtype=np.int64) for name, value in feeds.items()})[0]
    predicted = np.array(classes)[logits.argmax(axis=1)]
    accuracy = np.mean(predicted == frame["animal"].to_numpy()[eval_rows])
    assert accuracy == pytest.approx(json.loads((export / "metrics.json").read_text())["fp32"]["accuracy"])
    assert accuracy > 0.9


@pytest.mark.e2e
def test_bert_with_lora_through_every_stage(tmp_path):
    """`model.lora` through every stage on 2 ranks with ZeRO-1 (the moments sharded over the
    ranks, the base weights frozen parameters of each shard): BERT's default adapters (query,
    value) and its new head train, nothing else moves; the merged checkpoint holds moments for
    them alone; export writes one plain ONNX model, quantized as any other, and the adapter
    folder; the build log and the end-of-run summary say what trained."""
    from ortflow.reporting.results import lora_trained

    workdir, _, _, folder = animals_and_bert(tmp_path)
    config = {
        "run": {"name": "lora"},
        "data": {"source": "animals.jsonl", "text": "review", "label": "animal", "tokenizer": "tokenizer.json",
                 "context": 16, "shards": 1},
        "model": {"kind": "transformers", "path": str(folder), "lora": {"r": 4, "alpha": 8}},
        "train": {"world_size": 2, "zero": 1, "steps": 200, "micro_batch_size": 16, "log_every": 10,
                  "eval_every": 100, "optimizer": {"lr": 0.01}, "lr_schedule": {"warmup_steps": 10}},
    }
    result = run_snakemake(workdir, config)
    results = workdir / "results/lora"
    info = read_description(Artifacts(results / "artifacts").model_json)
    assert info.lora["targets"] == ["query", "value"]
    assert lora_trained(info) in (workdir / "logs/lora/build_artifacts.log").read_text()
    assert f"  trained   {lora_trained(info)}" in result.stdout + result.stderr
    metrics = json.loads((results / "train/metrics.json").read_text())  # what a sweep's comparison shows
    assert (metrics["trainable_parameters"], metrics["parameters"]) == (info.trainable_parameters, info.parameters)
    assert metrics["trainable_parameters"] < metrics["parameters"] / 10

    initial = read_ort_checkpoint(Artifacts(results / "artifacts").checkpoint)
    merged = read_ort_checkpoint(results / "checkpoint/checkpoint")
    assert sorted(merged.optimizer_states) == sorted(info.trainable)
    assert all(bits(merged.parameters[name]) == bits(initial.parameters[name]) for name in info.frozen)
    assert all(bits(merged.parameters[name]) != bits(initial.parameters[name]) for name in info.trainable)

    export = results / "export"
    names = [t.name for t in onnx.load(str(export / "model.onnx")).graph.initializer]
    assert names and not [name for name in names if ".lora_" in name], names
    assert (export / "model.int8.onnx").is_file()
    assert sorted(p.name for p in (export / "adapter").iterdir()) == ["adapter_config.json",
                                                                     "adapter_model.safetensors"]
    # It learned: below a uniform guess's loss, ln 3, and above the most frequent class's accuracy
    # (measured: loss 0.65, accuracy 0.66 against 0.36).
    train = json.loads((results / "train/metrics.json").read_text())
    assert train["eval"]["loss"] < 0.8 * np.log(3) and train["eval"]["accuracy"] > train["baseline"]["accuracy"]


def test_the_readme_examples_folder_fits_its_config(tmp_path, monkeypatch):
    """README's Fine-tuning, short of running the stages (which the GPT-2 test above
    does at a smaller size): examples/fine_tuning.py writes one folder that
    AutoTokenizer and AutoModelForCausalLM both load, of one vocabulary, with the
    end-of-text token that text needs; config/fine_tuning.yaml is valid, names it as
    model.path, and its data.tokenizer defaults to the folder's own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(TESTS.parent))
    from examples import fine_tuning

    fine_tuning.main()
    config = config_mod.validate(yaml.safe_load((TESTS.parent / "config/fine_tuning.yaml").read_text()))
    assert (config["model"]["kind"], config["model"]["task"]) == ("transformers", "causal-lm")
    assert Path(config["model"]["path"]) == Path(config["data"]["tokenizer"]) == fine_tuning.FOLDER
    tokenizer = AutoTokenizer.from_pretrained(fine_tuning.FOLDER, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(fine_tuning.FOLDER, local_files_only=True)
    assert (len(tokenizer), tokenizer.eos_token) == (model.config.vocab_size, "<|endoftext|>")
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.n_positions >= config["data"]["context"]


@pytest.mark.e2e
def test_bert_regression_by_task_on_jsonl_texts(tmp_path):
    """`model.task: regression` on a .jsonl of sentences and a float target (the size of
    the animal each mentions): a BERT folder under a one-output head (transformers'
    problem_type regression), trained with mse, ends far below the train split's
    mean as a predictor, and the exported model's predictions give the eval mse;
    export/optimum/ (declared to Snakemake for the task) predicts the same."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    frame = animal_texts(400)
    size = {"bird": -1.0, "cat": 0.0, "dog": 1.0}  # a float target that the animal named decides
    frame["size"] = frame["animal"].map(size).astype(np.float32)
    frame.to_json(workdir / "animals.jsonl", orient="records", lines=True)
    vocab = train_wordpiece(workdir / "tokenizer.json", 120, list(frame["review"])).get_vocab_size()
    config = {
        "run": {"name": "weights"},
        "data": {"source": "animals.jsonl", "text": "review", "label": "size", "tokenizer": "tokenizer.json",
                 "context": 16, "shards": 1},
        "model": {"kind": "transformers", "path": str(save_bert(tmp_path / "bert", vocab)), "task": "regression"},
        "train": {"world_size": 1, "steps": 150, "micro_batch_size": 16, "log_every": 10, "eval_every": 150,
                  "optimizer": {"lr": 0.005}, "lr_schedule": {"warmup_steps": 10}},
    }
    run_snakemake(workdir, config, "export_model")  # what it reads
    results = workdir / "results/weights"
    log = (workdir / "logs/weights/build_artifacts.log").read_text()
    assert "BertForSequenceClassification (" in log and "model transformers, loss mse" in log
    metrics = json.loads((results / "train/metrics.json").read_text())
    # The eval loss is the mse; the baseline's is the train split's mean as the prediction.
    assert metrics["eval"]["loss"] < 0.2 * metrics["baseline"]["loss"], (metrics["eval"], metrics["baseline"])

    _, eval_rows = split_rows(len(frame), 0.2, config_mod.load(overrides=config).data.split_seed)
    eval_ = whole(ShardReader(results / "data/eval"))
    session = onnxruntime.InferenceSession(str(results / "export/model.onnx"))
    predicted = session.run(None, {i.name: eval_[i.name] for i in session.get_inputs()})[0]
    assert predicted.shape == (len(eval_rows), 1)
    mse = float(((predicted[:, 0] - frame["size"].to_numpy()[eval_rows]) ** 2).mean())
    assert mse == pytest.approx(metrics["eval"]["loss"], rel=1e-3)
    # Snakemake declared export/optimum/ (the task is regression): the same predictions from the tokenizer's names.
    served = onnxruntime.InferenceSession(str(results / "export/optimum/model.onnx"))
    assert sorted(i.name for i in served.get_inputs()) == ["attention_mask", "input_ids", "token_type_ids"]
    same = served.run(None, {i.name: eval_[i.name] for i in served.get_inputs()})[0]
    assert np.abs(same - predicted).max() <= 1e-4 * np.abs(predicted).max() + 1e-6


@pytest.mark.e2e
def test_t5_seq2seq_by_task_on_jsonl_text_pairs(tmp_path):
    """`model.task: seq2seq` on a .jsonl of sentences (data.text) and target texts
    (data.label: the animal each mentions, twice): a T5 folder learns the targets, far
    below the unigram baseline's perplexity, and the exported model scores the eval
    targets with the eval loss training measured (decoder_input_ids: the target
    shifted right, as the data stage made them; the padding ignored)."""
    from ortflow.models import IGNORE_INDEX
    from transformers_models import save_t5

    workdir = tmp_path / "work"
    workdir.mkdir()
    frame = animal_texts(300)
    frame["answer"] = frame["animal"] + " " + frame["animal"]
    frame.to_json(workdir / "pairs.jsonl", orient="records", lines=True)
    tokenizer = train_wordpiece(workdir / "tokenizer.json", 120, list(frame["review"]))
    folder = save_t5(tmp_path / "t5", tokenizer.get_vocab_size(), tokenizer.token_to_id("[PAD]"),
                     tokenizer.token_to_id("[SEP]"))
    config = {
        "run": {"name": "t5"},
        "data": {"source": "pairs.jsonl", "text": "review", "label": "answer", "tokenizer": "tokenizer.json",
                 "context": 16, "shards": 1},
        "model": {"kind": "transformers", "path": str(folder), "task": "seq2seq"},
        "train": {"world_size": 1, "steps": 150, "micro_batch_size": 16, "log_every": 10, "eval_every": 150,
                  "optimizer": {"lr": 0.005}, "lr_schedule": {"warmup_steps": 10}},
    }
    run_snakemake(workdir, config, "export_model")  # what it reads
    results = workdir / "results/t5"
    assert "T5ForConditionalGeneration (" in (workdir / "logs/t5/build_artifacts.log").read_text()
    metrics = json.loads((results / "train/metrics.json").read_text())
    assert metrics["eval"]["perplexity"] < 0.25 * metrics["baseline"]["perplexity"], metrics

    eval_ = whole(ShardReader(results / "data/eval"))
    labels = eval_["answer"]
    kept = labels != IGNORE_INDEX
    assert (eval_["decoder_input_ids"][:, 1:][kept[:, :-1]] == labels[:, :-1][kept[:, :-1]]).all()
    session = onnxruntime.InferenceSession(str(results / "export/model.onnx"))
    logits = session.run(None, {i.name: eval_[i.name] for i in session.get_inputs()})[0]  # [rows, vocab, time]
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    picked = np.take_along_axis(log_probs, np.where(kept, labels, 0)[:, None, :], axis=1)[:, 0]
    assert -picked[kept].mean() == pytest.approx(metrics["eval"]["loss"], rel=1e-4)
    # export/generation/: optimum's encoder and decoders, checked against transformers' generate,
    # and samples.json from it: the eval sources' targets as the trained model generates them.
    said = (workdir / "logs/t5/export_model.log").read_text()
    assert "export/generation: greedy generation in ONNX Runtime (" in said and "right-padded, equals " in said
    assert {"encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx", "tokenizer.json"} <= \
        {path.name for path in (results / "export/generation").iterdir()}
    # The trained model generates the targets ("dog dog" for a review of a dog; measured: all 3).
    written = json.loads((results / "export/samples.json").read_text())["samples"]
    assert len(written) == 3 and sum(sample["after"] == sample["expected"] for sample in written) >= 2, written

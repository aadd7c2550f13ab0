"""Token classification: labels per token, with -100 (IGNORE_INDEX, as in
transformers) where a position is no word's first token (padding, sub-tokens,
special tokens), which the loss and the metrics leave out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from onnxruntime.training.api import CheckpointState, Module

from conftest import model_description
from ortflow import cli
from ortflow import config as config_mod
from ortflow.artifacts import Artifacts
from ortflow.data.shards import ShardReader
from ortflow.evaluation import batch_totals, eval_results, feeds, outputs_of
from ortflow.inference import loss_of
from ortflow.models import IGNORE_INDEX
from ortflow.training import gradients
from token_models import TokenTagger
from torch_reference import load_initial

VOCAB, TIME, CLASSES = 20, 10, 4
CONFIG = {
    "run": {"name": "tags", "seed": 3},
    "data": {"features": ["input_ids", "attention_mask", "token_type_ids"], "label": "tags", "eval_fraction": 0.25, "shards": 1},
    "model": {"kind": "torch", "path": "token_models:TokenTagger", "kwargs": {"vocab_size": VOCAB, "classes": CLASSES}},
    "train": {"world_size": 1, "micro_batch_size": 16},
}
# float32 in both, summed in other orders: measured 0 (loss) and 1.0e-7 (gradients, head.weight)
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def tagged(tmp_path_factory) -> Path:
    """Token ids padded with 0 after a random length, tags -100 on the padding and
    on every third token (as a sub-token would be); prepared and built as the
    workflow's rules do (in this process: neither runs snakemake nor mpirun)."""
    root = tmp_path_factory.mktemp("tagged")
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, (64, TIME))
    tags = ids % CLASSES
    lengths = rng.integers(3, TIME + 1, len(ids))
    padding = np.arange(TIME)[None, :] >= lengths[:, None]
    ids[padding] = 0
    tags[padding | (np.arange(TIME)[None, :] % 3 == 2)] = IGNORE_INDEX
    np.savez(root / "tagged.npz", input_ids=ids, attention_mask=(~padding).astype(np.int64),
             token_type_ids=np.zeros_like(ids), tags=tags)
    config = json.dumps({**CONFIG, "data": {**CONFIG["data"], "source": str(root / "tagged.npz")}})
    data = ["--train", str(root / "data/train"), "--eval", str(root / "data/eval")]
    assert cli.main(["prepare-data", "--config-json", config, *data]) == 0
    assert cli.main(["build-artifacts", "--config-json", config, "--train", str(root / "data/train"),
                     "--out", str(root / "artifacts")]) == 0
    return root


def test_loss_gradients_and_accuracy_leave_ignored_positions_out_as_torch_does(tagged):
    reader = ShardReader(tagged / "data/train")
    assert reader.manifest.num_classes == CLASSES
    batch = reader.gather(np.arange(16))
    labels = batch["tags"]
    assert (labels == IGNORE_INDEX).any() and (labels != IGNORE_INDEX).any()

    artifacts = Artifacts(tagged / "artifacts")
    state = CheckpointState.load_checkpoint(str(artifacts.checkpoint))
    module = Module(str(artifacts.training_model), state, str(artifacts.eval_model))
    module.train()
    loss, logits = outputs_of(module(*feeds(batch, module.input_names(), "tags", "tags")))
    reference = load_initial(TokenTagger(VOCAB, CLASSES), tagged / "artifacts")
    torch_logits = reference(*(torch.from_numpy(batch[name]) for name in CONFIG["data"]["features"]))
    torch_loss = torch.nn.functional.cross_entropy(torch_logits, torch.from_numpy(labels), ignore_index=-100)
    torch_loss.backward()
    assert abs(loss - torch_loss.item()) <= TOLERANCE, (loss, torch_loss.item())
    # Ignoring changes the figure: the mean over every position would be another loss.
    everything = torch.nn.functional.cross_entropy(torch_logits, torch.from_numpy(np.maximum(labels, 0)))
    assert abs(loss - everything.item()) > 100 * TOLERANCE
    names = [name for name, _ in reference.named_parameters()]
    for name, ours in zip(names, gradients.gradients(state, names, np)):
        theirs = dict(reference.named_parameters())[name].grad.numpy()
        assert np.abs(np.asarray(ours) - theirs).max() <= TOLERANCE, name

    # Evaluation: accuracy and per-class counts over the labelled positions only.
    module.eval()
    loss, logits = outputs_of(module(*feeds(batch, module.input_names(), "tags", "tags")))
    kept = labels != IGNORE_INDEX
    predicted = logits.argmax(axis=1)
    info = model_description(task="classification", loss="cross_entropy")
    results = eval_results(batch_totals(loss, logits, labels, info, CLASSES), "classification",
                           [str(c) for c in range(CLASSES)])
    assert results["accuracy"] == pytest.approx((predicted[kept] == labels[kept]).mean())
    assert results["loss"] == pytest.approx(loss)
    assert loss_of(logits, labels, "cross_entropy") == pytest.approx(loss, rel=1e-6)  # export's and quantize's
    assert sum(c["count"] for c in results["per_class"].values()) == kept.sum()


def test_a_negative_class_other_than_the_ignored_index_is_refused(tmp_path):
    from ortflow.data import sources
    from ortflow.errors import DataError

    np.savez(tmp_path / "tagged.npz", input_ids=np.ones((4, 3), np.int64),
             tags=np.array([[0, 1, -100], [1, 0, -1], [0, 1, 1], [1, 0, 0]]))
    config = config_mod.load(overrides={"data": {"source": str(tmp_path / "tagged.npz"), "features": ["input_ids"],
                                                 "label": "tags"}})
    with pytest.raises(DataError, match=r"label 'tags' has negative class -1; classes are 0..K-1 \(-100 marks a "
                                        r"position the loss ignores\)"):
        sources.load(config.data)


# --- token classification data: words and word-level tags -------------------------------------------

ENTITIES = {"PER": [["alice"], ["bob", "marley"], ["chandrasekhar"]], "LOC": [["paris"], ["new", "york"], ["kathmandu"]]}
FILLER = ["the", "went", "to", "and", "saw", "yesterday", "with", "friends", "quickly", "from"]


def tagged_sentences(rows: int, seed: int = 1) -> list[dict]:
    """The CoNLL shape: {"tokens": words, "tags": BIO tags}, filler words around one or two entities."""
    rng = np.random.default_rng(seed)
    sentences = []
    for _ in range(rows):
        tokens, tags = [], []
        for _ in range(rng.integers(1, 3)):
            kind = ["PER", "LOC"][rng.integers(0, 2)]
            filler = list(rng.choice(FILLER, rng.integers(1, 4)))
            entity = ENTITIES[kind][rng.integers(0, 3)]
            tokens += filler + entity
            tags += ["O"] * len(filler) + [f"B-{kind}"] + [f"I-{kind}"] * (len(entity) - 1)
        sentences.append({"tokens": tokens, "tags": tags})
    return sentences


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_word_tags_are_aligned_to_the_first_sub_token_as_transformers_does(suffix, tmp_path):
    import pandas as pd
    from tokenizers import Tokenizer

    from ortflow.data import sources
    from text_models import train_wordpiece

    rows = tagged_sentences(40)
    words = [" ".join(row["tokens"]) for row in rows]
    # 45 tokens: the characters and 9 of the 18 words; the other words are split (at most 35 tokens a row).
    train_wordpiece(tmp_path / "tokenizer.json", 45, words)
    context = 48
    source = tmp_path / f"tags{suffix}"
    if suffix == ".jsonl":
        write_jsonl(source, rows)
    else:  # Parquet's lists come back as numpy arrays
        pd.DataFrame(rows).to_parquet(source)
    config = config_mod.load(overrides={"data": {
        "source": str(source), "text": "tokens", "label": "tags",
        "tokenizer": str(tmp_path / "tokenizer.json"), "context": context}})
    dataset = sources.load(config.data)
    assert dataset.classes == ["B-LOC", "B-PER", "I-LOC", "I-PER", "O"] and dataset.num_classes == 5
    assert dataset.label.shape == dataset.features["input_ids"].shape == (40, context)

    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    split_words = 0
    for row, labels, ids in zip(rows, dataset.label, dataset.features["input_ids"]):
        encoding = tokenizer.encode(row["tokens"], is_pretokenized=True)
        assert list(ids[:len(encoding.ids)]) == encoding.ids
        word_ids = encoding.word_ids + [None] * (context - len(encoding.ids))  # the padding
        expected = []
        for position, word in enumerate(word_ids):
            first = word is not None and (position == 0 or word_ids[position - 1] != word)
            expected.append(dataset.classes.index(row["tags"][word]) if first else IGNORE_INDEX)
        split_words += sum(word_ids.count(w) > 1 for w in set(word_ids) - {None})
        assert list(labels) == expected
        # One labelled position per word (none is cut off at this context), specials and padding ignored.
        assert (labels != IGNORE_INDEX).sum() == len(row["tokens"])
        assert labels[0] == IGNORE_INDEX and labels[len(encoding.ids) - 1] == IGNORE_INDEX
    assert split_words > 0  # sub-tokens were ignored, not just specials


@pytest.mark.parametrize("rows, message", [
    ([{"tokens": ["a", "b"], "tags": ["O"]}],
     "row 0 has 2 words in 'tokens' but 1 tags in 'tags'; give one tag per word"),
    ([{"tokens": "a b", "tags": ["O", "O"]}],
     "row 0: token classification needs a list of words in 'tokens' and a list of tags in 'tags', one per word; "
     "got str and list"),
    ([{"tokens": ["a", "b"], "tags": ["O", 1]}],
     "column 'tags' has tags of type int, str; tags are all strings (class names) or all integers (class ids)"),
])
def test_word_tags_that_do_not_fit_are_refused_in_one_line(rows, message, tmp_path):
    from ortflow.data import sources
    from ortflow.errors import DataError
    from text_models import train_wordpiece

    train_wordpiece(tmp_path / "tokenizer.json", 60, ["a b c"])
    path = write_jsonl(tmp_path / "tags.jsonl", rows)
    config = config_mod.load(overrides={"data": {"source": str(path), "text": "tokens", "label": "tags",
                                                 "tokenizer": str(tmp_path / "tokenizer.json"), "context": 8}})
    with pytest.raises(DataError) as error:
        sources.load(config.data)
    assert str(error.value) == f"{path}: {message}"


def test_a_label_of_lists_without_data_text_is_refused_in_one_line(tmp_path):
    from ortflow.data import sources
    from ortflow.errors import DataError

    path = write_jsonl(tmp_path / "tags.jsonl", [{"n": 1, "tags": ["O", "B-X"]}, {"n": 2, "tags": ["O"]}])
    config = config_mod.load(overrides={"data": {"source": str(path), "features": ["n"], "label": "tags"}})
    with pytest.raises(DataError) as error:
        sources.load(config.data)
    assert str(error.value) == (f"{path}: column 'tags' holds lists (a tag per word?); token classification reads "
                                "the words from the column that data.text names, encoded with data.tokenizer")


def test_entity_scores_equal_seqeval_and_per_class_scores_scikit_learn():
    """batch_totals' entity counts, summed over batches, give seqeval's f1_score of the
    labelled positions' tags; per-class precision/recall/F1 scikit-learn's."""
    from seqeval.metrics import f1_score, precision_score, recall_score
    from sklearn.metrics import precision_recall_fscore_support

    from ortflow.evaluation import bio_tags

    tags = ["B-LOC", "B-PER", "I-LOC", "I-PER", "O"]
    rng = np.random.default_rng(5)
    labels = rng.integers(0, len(tags), (12, 9))
    labels[rng.random(labels.shape) < 0.3] = IGNORE_INDEX
    logits = rng.normal(size=(12, len(tags), 9)).astype(np.float32)
    logits[:, :, :4] += 3 * np.eye(len(tags))[np.maximum(labels[:, :4], 0)].transpose(0, 2, 1)  # partly right
    assert bio_tags(tags, [9]) == tags and bio_tags(tags, []) is None and bio_tags(["a", "b"], [9]) is None
    info = model_description(task="classification", loss="cross_entropy")
    totals = sum(batch_totals(1.0, logits[rows], labels[rows], info, len(tags), tags)
                 for rows in np.array_split(np.arange(12), 3))
    results = eval_results(totals, "classification", tags, entities=True)

    kept = labels != IGNORE_INDEX
    predicted = logits.argmax(axis=1)
    truth = [[tags[i] for i in row[keep]] for row, keep in zip(labels, kept)]
    guess = [[tags[i] for i in row[keep]] for row, keep in zip(predicted, kept)]
    entities = results["entities"]
    assert entities["f1"] == pytest.approx(f1_score(truth, guess))
    assert entities["precision"] == pytest.approx(precision_score(truth, guess))
    assert entities["recall"] == pytest.approx(recall_score(truth, guess))
    assert 0 < entities["f1"] < 1
    precision, recall, f1, support = precision_recall_fscore_support(labels[kept], predicted[kept],
                                                                     labels=range(len(tags)), zero_division=0)
    for i, name in enumerate(tags):
        entry = results["per_class"][name]
        assert (entry["precision"], entry["recall"], entry["f1"], entry["count"]) == pytest.approx(
            (precision[i], recall[i], f1[i], support[i]))


@pytest.mark.e2e
def test_token_classification_through_the_workflow(tmp_path):
    """A .jsonl of words and BIO tags, a WordPiece tokenizer and a BERT folder fine-tuned
    by task (`model.kind: transformers`, the task found from the data) through every
    stage to the report's tables: metrics.json holds each tag's precision/recall/F1 and seqeval's
    entity-level scores, which the eval split's predictions reproduce."""
    from seqeval.metrics import f1_score

    from conftest import run_snakemake
    from ortflow.stages.prepare_data import split_rows
    from ortflow.sessions import inference_session
    from text_models import train_wordpiece
    from transformers_models import save_bert

    workdir = tmp_path / "work"
    workdir.mkdir()
    rows = tagged_sentences(300)
    write_jsonl(workdir / "ner.jsonl", rows)
    vocab = train_wordpiece(workdir / "tokenizer.json", 80, [" ".join(r["tokens"]) for r in rows]).get_vocab_size()
    config = {
        "run": {"name": "ner"},
        "data": {"source": "ner.jsonl", "text": "tokens", "label": "tags", "tokenizer": "tokenizer.json",
                 "context": 32, "shards": 1},
        "model": {"kind": "transformers", "path": str(save_bert(tmp_path / "bert", vocab))},
        "train": {"world_size": 1, "steps": 120, "micro_batch_size": 16, "eval_every": 120, "log_every": 20,
                  "optimizer": {"lr": 0.01}, "lr_schedule": {"warmup_steps": 5}},
    }
    run_snakemake(workdir, config, "report_tables")
    results = workdir / "results" / "ner"
    assert "BertForTokenClassification (" in (workdir / "logs/ner/build_artifacts.log").read_text()

    trained = json.loads((results / "train/metrics.json").read_text())["eval"]
    tags = ["B-LOC", "B-PER", "I-LOC", "I-PER", "O"]
    assert list(trained["per_class"]) == tags
    data = config_mod.load(overrides=config).data
    _, eval_rows = split_rows(len(rows), data.eval_fraction, data.split_seed)
    words = sum(len(rows[i]["tokens"]) for i in eval_rows)
    assert sum(c["count"] for c in trained["per_class"].values()) == words  # one label per word, nothing else
    for entry in trained["per_class"].values():
        assert set(entry) == {"accuracy", "count", "precision", "recall", "f1"}
    assert trained["entities"]["count"] == sum(r["tags"].count("B-PER") + r["tags"].count("B-LOC")
                                               for r in (rows[i] for i in eval_rows))
    assert trained["entities"]["f1"] > 0.8, trained
    summary = (results / "report/summary.html").read_text()
    entities = trained["entities"]
    assert (f"<tr data-key='entities'><td>entities (BIO spans)</td><td class=n>{entities['count']}</td><td class=n>"
            f"</td><td class=n>{entities['precision']:.4f}</td><td class=n>{entities['recall']:.4f}</td>"
            f"<td class=n>{entities['f1']:.4f}</td></tr>") in summary

    # The exported model's predictions on the eval split, scored by seqeval itself.
    reader = ShardReader(results / "data/eval")
    batch = reader.gather(np.arange(len(reader)))
    session = inference_session(results / "export/model.onnx")
    inputs = {i.name: batch[i.name] for i in session.get_inputs()}
    predicted = session.run(None, inputs)[0].argmax(axis=1)
    kept = batch["tags"] != IGNORE_INDEX
    truth = [[tags[i] for i in row[keep]] for row, keep in zip(batch["tags"], kept)]
    guess = [[tags[i] for i in row[keep]] for row, keep in zip(predicted, kept)]
    assert f1_score(truth, guess) == pytest.approx(trained["entities"]["f1"], abs=1e-6)

"""`data.tokenizer`, `data.text` and string labels: the shards hold exactly what the
user's tokenizer gives (windows of a language model's documents, or a table's
text columns truncated and padded), labels of strings are named classes, and a
small text classifier goes through the whole workflow with its tokenizer and
class names travelling with the exported model. Every tokenizer is trained here
on local text (tests/text_models.py): nothing is downloaded."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import run_snakemake, shard_manifest
from ortflow.models import torch_export
from ortflow import config as config_mod
from ortflow.data import tokenizer as tokenizers
from ortflow.data.manifest import Column
from ortflow.data.shards import TOKENIZER, ShardReader
from ortflow.errors import ConfigError, DataError, ModelError
from ortflow.models import user, vocabulary
from ortflow.stages.prepare_data import prepare, split_rows
from text_models import TextBag, pydoc_text, train_bpe, train_wordpiece

TESTS = Path(__file__).resolve().parent
SEED = 1234


def make_config(**data) -> config_mod.Config:
    return config_mod.load(overrides={"run": {"seed": SEED}, "data": data})


def prepare_into(folder: Path, config: config_mod.Config) -> tuple[ShardReader, ShardReader]:
    train, eval_ = folder / "data" / "train", folder / "data" / "eval"
    prepare(config, train, eval_)
    return ShardReader(train), ShardReader(eval_)


def whole(reader: ShardReader) -> dict[str, np.ndarray]:
    return reader.gather(np.arange(len(reader)))


def in_split_order(expected: np.ndarray, eval_fraction: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    """The rows of `expected` that the seeded split puts in train and in eval, in shard order."""
    train_rows, eval_rows = split_rows(len(expected), eval_fraction, SEED)
    return expected[train_rows], expected[eval_rows]


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    train_bpe(path)
    return path


@pytest.fixture(scope="module")
def wordpiece_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("wordpiece") / "tokenizer.json"
    train_wordpiece(path)
    return path


# --- language models ---------------------------------------------------------------------------------


def test_documents_split_at_blank_lines_whatever_the_chunks():
    text = "first\nline\n\nsecond\n\n\nthird  \n\n\n\nlast\n"
    expected = [d for d in text.split("\n\n") if d]
    assert expected == ["first\nline", "second", "\nthird  ", "last\n"]
    for size in range(1, len(text) + 1):
        chunks = [text[i:i + size] for i in range(0, len(text), size)]
        assert list(tokenizers.documents(chunks)) == expected, size


def test_text_becomes_windows_of_the_tokenizers_ids(tmp_path, bpe_file, monkeypatch, caplog):
    """A .txt file's documents (split at blank lines; CRLF read as LF) encoded by the
    BPE tokenizer, each followed by <|endoftext|>, in windows of 16 + 1 tokens:
    read and encoded in many small pieces, the shards equal the whole text's encoding."""
    from tokenizers import Tokenizer

    text = pydoc_text()[:40_000] + "\n\n\nafter three newlines  \n\n\n\n" + "windows line\r\nends\r\n\r\nlast"
    (tmp_path / "corpus.txt").write_bytes(text.encode())
    monkeypatch.setattr(tokenizers, "READ_CHARS", 997)
    monkeypatch.setattr(tokenizers, "BATCH_CHARS", 3001)
    caplog.set_level(logging.INFO, "ortflow")
    train, eval_ = prepare_into(tmp_path, make_config(source=str(tmp_path / "corpus.txt"), tokenizer=str(bpe_file),
                                                      context=16))

    reference = Tokenizer.from_file(str(bpe_file))
    eos = reference.token_to_id("<|endoftext|>")
    documents = [d for d in text.replace("\r\n", "\n").split("\n\n") if d]
    assert len(documents) > 100
    tokens = np.array([i for d in documents for i in reference.encode(d, add_special_tokens=False).ids + [eos]])
    count = (len(tokens) - 1) // 16
    expected = tokens[np.arange(count)[:, None] * 16 + np.arange(17)[None, :]]
    for reader, part in zip((train, eval_), in_split_order(expected)):
        batch = whole(reader)
        assert np.array_equal(batch["x"], part[:, :-1]) and np.array_equal(batch["y"], part[:, 1:])
        assert batch["x"].dtype == np.int64
        manifest = reader.manifest
        assert (manifest.task, manifest.num_classes) == ("language_model", reference.get_vocab_size())
        entry = manifest.tokenizer
        assert (entry["vocab_size"], entry["eos_token"], entry["input"], entry["file"]) == (
            reference.get_vocab_size(), "<|endoftext|>", "x", TOKENIZER)
        copy = (reader.dir / TOKENIZER).read_bytes()
        assert hashlib.sha256(copy).hexdigest() == entry["sha256"]
        assert Tokenizer.from_str(copy.decode()).encode(documents[3]).ids == reference.encode(documents[3]).ids
    assert "each followed by '<|endoftext|>'" in caplog.text
    assert "tokens, " in caplog.text and "tokenized " in caplog.text and "(100%)" in caplog.text


def test_text_without_an_end_of_text_token_is_refused(tmp_path, wordpiece_file):
    (tmp_path / "corpus.txt").write_text("one document\n\nanother one\n" * 50)
    with pytest.raises(DataError) as error:
        prepare_into(tmp_path, make_config(source=str(tmp_path / "corpus.txt"), tokenizer=str(wordpiece_file)))
    assert str(error.value).startswith(f"data.tokenizer: {wordpiece_file} has no end-of-text token to put between "
                                       "documents (none of <|endoftext|>, </s>, <eos>, <|end_of_text|>)")
    assert not (tmp_path / "data").exists()


def test_a_tokenizer_that_is_missing_or_not_one_is_named(tmp_path):
    (tmp_path / "corpus.txt").write_text("text\n\n" * 100)
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    for path, message in ((tmp_path / "absent.json", "does not exist; give a tokenizer.json file"),
                          (tmp_path / "bad.json", "is not a tokenizer.json of the tokenizers library"),
                          (tmp_path, "transformers cannot load a tokenizer from the folder")):
        with pytest.raises(DataError) as error:
            prepare_into(tmp_path / "out", make_config(source=str(tmp_path / "corpus.txt"), tokenizer=str(path)))
        assert str(error.value).startswith("data.tokenizer: ") and message in str(error.value)
        assert str(path) in str(error.value) and "\n" not in str(error.value)


# --- text columns ------------------------------------------------------------------------------------


def pairs_frame(rows: int = 60) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    words = pydoc_text().split()
    def text(low, high):
        return " ".join(rng.choice(words, rng.integers(low, high)))
    return pd.DataFrame({
        "premise": [text(1, 12) for _ in range(rows)],
        "hypothesis": [text(1, 4) for _ in range(rows)],
        "label": [["neutral", "entailment", "contradiction"][i % 3] for i in range(rows)],
    })


def test_text_pairs_from_jsonl_with_wordpiece(tmp_path, wordpiece_file):
    """Two text columns of a .jsonl file become input_ids, attention_mask and
    token_type_ids (the WordPiece template gives types), truncated and padded to
    data.context as the tokenizer itself does it; the string labels are sorted classes."""
    from tokenizers import Tokenizer

    frame = pairs_frame()
    frame.to_json(tmp_path / "pairs.jsonl", orient="records", lines=True)
    config = make_config(source=str(tmp_path / "pairs.jsonl"), tokenizer=str(wordpiece_file),
                         text=["premise", "hypothesis"], label="label", context=24)
    train, eval_ = prepare_into(tmp_path, config)

    reference = Tokenizer.from_file(str(wordpiece_file))
    pad = reference.token_to_id("[PAD]")
    reference.enable_truncation(max_length=24)
    reference.enable_padding(length=24, pad_id=pad, pad_token="[PAD]")
    encodings = reference.encode_batch(list(zip(frame["premise"], frame["hypothesis"])))
    expected = {"input_ids": np.array([e.ids for e in encodings]),
                "attention_mask": np.array([e.attention_mask for e in encodings]),
                "token_type_ids": np.array([e.type_ids for e in encodings])}
    classes = ["contradiction", "entailment", "neutral"]
    labels = np.array([classes.index(v) for v in frame["label"]])
    for reader, rows in zip((train, eval_), split_rows(len(frame), 0.2, SEED)):
        batch = whole(reader)
        for name, array in expected.items():
            assert np.array_equal(batch[name], array[rows]), name
        assert np.array_equal(batch["label"], labels[rows])
        assert reader.manifest.features == tuple(Column(n, "int64", (24,)) for n in expected)
        assert (list(reader.manifest.classes), reader.manifest.num_classes) == (classes, 3)
        assert reader.manifest.tokenizer["text"] == ["premise", "hypothesis"]
        assert reader.manifest.tokenizer["pad_token"] == "[PAD]"

    # What the arrays mean, beyond equality with the library: padding after the
    # text (mask 0, [PAD]), [CLS] first, [SEP] closing each text, type 1 for the second.
    ids, mask, types = (expected[n] for n in ("input_ids", "attention_mask", "token_type_ids"))
    cls, sep = reference.token_to_id("[CLS]"), reference.token_to_id("[SEP]")
    lengths = mask.sum(axis=1)
    assert np.array_equal(mask, (np.arange(24)[None, :] < lengths[:, None]).astype(int))
    assert (ids[mask == 0] == pad).all() and (types[mask == 0] == 0).all()
    assert (ids[:, 0] == cls).all() and (ids[np.arange(len(ids)), lengths - 1] == sep).all()
    assert (lengths == 24).sum() > 10 and (lengths < 24).sum() > 10  # truncated rows and padded rows
    for row in range(len(ids)):
        first_sep = int(np.argmax(ids[row] == sep))
        assert (types[row, :first_sep + 1] == 0).all() and (types[row, first_sep + 1:lengths[row]] == 1).all()


def test_save_pretrained_folder_encodes_as_autotokenizer(tmp_path, wordpiece_file):
    """A folder saved by transformers' PreTrainedTokenizerFast, read by AutoTokenizer:
    a CSV's text column gives what `tokenizer(texts, padding="max_length",
    truncation=True)` gives, under the names of its model_input_names (no
    token_type_ids for this generic tokenizer); bool labels are classes False, True."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = tmp_path / "pretrained"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(wordpiece_file)), pad_token="[PAD]",
                            unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]").save_pretrained(folder)
    frame = pairs_frame()[["premise"]].assign(long=lambda f: f["premise"].str.len() > 80)
    frame.to_csv(tmp_path / "texts.csv", index=False)
    train, eval_ = prepare_into(tmp_path, make_config(source=str(tmp_path / "texts.csv"), tokenizer=str(folder),
                                                      text="premise", label="long", context=20))

    auto = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    expected = auto(list(frame["premise"]), padding="max_length", truncation=True, max_length=20)
    assert sorted(expected) == ["attention_mask", "input_ids"]
    for reader, rows in zip((train, eval_), split_rows(len(frame), 0.2, SEED)):
        batch = whole(reader)
        assert reader.feature_names == ["input_ids", "attention_mask"]
        for name in reader.feature_names:
            assert np.array_equal(batch[name], np.array(expected[name])[rows]), name
        assert np.array_equal(batch["long"], frame["long"].to_numpy().astype(int)[rows])
        assert reader.manifest.classes == ("False", "True")


def test_a_generic_folder_is_the_tokenizer_autotokenizer_loads_without_importing_torch(tmp_path, bpe_file,
                                                                                       monkeypatch):
    """A folder whose tokenizer_config.json names the generic fast tokenizer, without a config.json, is loaded
    by that class (importing AutoTokenizer imports torch, seconds of prepare_data): the same tokenizer as
    AutoTokenizer's, its ids, special tokens, chat template and inputs. A config.json (its model type may
    choose the class), code of its own (auto_map) or another class goes through AutoTokenizer."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = tmp_path / "tokenizer"
    saved = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(bpe_file)), eos_token="<|endoftext|>")
    saved.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    saved.save_pretrained(folder)
    code = ("import json, sys; from ortflow.data import tokenizer as t; found = t.load(sys.argv[1]); "
            "print(json.dumps([type(found.loaded).__name__, found.eos_token, found.pad_token, found.type_ids, "
            "found.loaded.chat_template, found.loaded.special_tokens_map, found.to_json(), 'torch' in sys.modules]))")
    result = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    auto = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert tokenizers._generic(folder)
    monkeypatch.setattr(tokenizers, "_generic", lambda _: False)
    expected = tokenizers.load(str(folder))  # through AutoTokenizer, as before
    monkeypatch.undo()
    assert json.loads(result.stdout) == [type(auto).__name__, expected.eos_token, expected.pad_token,
                                         expected.type_ids, auto.chat_template, auto.special_tokens_map,
                                         expected.to_json(), False]
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    for changed in ({"auto_map": {"AutoTokenizer": ["x.Tok", None]}}, {"tokenizer_class": "GPT2Tokenizer"}):
        (folder / "tokenizer_config.json").write_text(json.dumps(settings | changed))
        assert not tokenizers._generic(folder), changed
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert not tokenizers._generic(folder)


def test_text_column_problems_are_named(tmp_path, wordpiece_file):
    frame = pairs_frame(20)
    frame.loc[7, "premise"] = None
    frame.to_csv(tmp_path / "texts.csv", index=False)
    data = {"source": str(tmp_path / "texts.csv"), "tokenizer": str(wordpiece_file), "label": "label"}
    with pytest.raises(DataError, match=r"texts.csv: column\(s\) body not found; the file has columns premise, "
                                        r"hypothesis, label \(set data.text and data.label\)"):
        prepare_into(tmp_path, make_config(**data, text="body"))
    with pytest.raises(DataError, match=r"texts.csv: text column 'premise' has 1 missing value\(s\) \(first at row 7\)"):
        prepare_into(tmp_path, make_config(**data, text="premise"))
    with pytest.raises(DataError, match=r"texts.csv: row 0 is \d+ tokens even truncated, more than data.context=2 "
                                        r"\(the tokenizer's special tokens count too\); raise data.context"):
        prepare_into(tmp_path, make_config(**data | {"text": ["hypothesis", "label"], "label": "premise", "context": 2}))


# --- string labels -----------------------------------------------------------------------------------


def test_string_labels_are_sorted_named_classes(tmp_path):
    rows = 40
    x = np.arange(rows, dtype=float)
    species = np.array(["setosa", "virginica", "versicolor", "setosa"] * 10)
    pd.DataFrame({"x": x, "species": species}).to_csv(tmp_path / "iris.csv", index=False)
    train, eval_ = prepare_into(tmp_path, make_config(source=str(tmp_path / "iris.csv"), label="species"))
    classes = ["setosa", "versicolor", "virginica"]
    for reader, rows_ in zip((train, eval_), split_rows(rows, 0.2, SEED)):
        assert (reader.manifest.task, list(reader.manifest.classes), reader.manifest.num_classes) == (
            "classification", classes, 3)
        batch = whole(reader)
        assert [classes[i] for i in batch["species"]] == species[rows_].tolist()
        assert np.array_equal(batch["x"][:, 0], x[rows_])


def test_label_values_only_in_the_eval_split_are_named(tmp_path):
    rows = 30
    _, eval_rows = split_rows(rows, 0.2, SEED)
    labels = np.array(["cat", "dog"] * (rows // 2), dtype=object)
    labels[eval_rows[0]], labels[eval_rows[1]] = "zebra", "yak"
    pd.DataFrame({"x": np.arange(rows, dtype=float), "y": labels}).to_csv(tmp_path / "pets.csv", index=False)
    path = tmp_path / "pets.csv"
    with pytest.raises(DataError) as error:
        prepare_into(tmp_path, make_config(source=str(path)))
    assert str(error.value) == (
        f"data.source {str(path)!r}: label 'y' value(s) 'yak', 'zebra' occur in the eval split but not in the train "
        "split, so the model cannot learn them; add train rows of them, drop those rows, or split differently "
        "(data.split_seed, data.eval_fraction)")
    assert not (tmp_path / "data").exists()


def test_string_label_problems_are_named(tmp_path):
    path = tmp_path / "pets.csv"
    pd.DataFrame({"x": np.arange(10.0), "y": ["cat", "dog"] * 5}).to_csv(path, index=False)
    with pytest.raises(DataError, match=r"pets.csv: data.task is regression but label 'y' is not numeric "
                                        r"\(e.g. 'cat'\); a label of strings is classes"):
        prepare_into(tmp_path, make_config(source=str(path), task="regression"))
    pd.DataFrame({"x": np.arange(10.0), "y": ["cat", None] * 5}).to_csv(path, index=False)
    pd.read_csv(path)  # pandas reads the empty cells as NaN among strings
    with pytest.raises(DataError, match=r"pets.csv: label 'y' has 5 missing value\(s\) \(first at row 1\)"):
        prepare_into(tmp_path, make_config(source=str(path)))
    pd.DataFrame({"x": np.arange(10.0), "y": ["cat"] * 10}).to_csv(path, index=False)
    with pytest.raises(DataError, match=r"label 'y' has a single class \('cat'\) in all 10 rows"):
        prepare_into(tmp_path, make_config(source=str(path)))


def test_jsonl_keeps_json_types(tmp_path):
    """JSON Lines as a table: integer columns stay int64 (as Parquet's), floats become float32."""
    path = tmp_path / "table.jsonl"
    rows = [{"a": i, "b": i * 2, "c": i / 4, "y": i % 2 == 0} for i in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, _ = prepare_into(tmp_path / "ints", make_config(source=str(path), features=["a", "b"]))
    assert train.manifest.features == (Column("x", "int64", (2,)),)
    assert train.manifest.classes == ("False", "True")
    train, _ = prepare_into(tmp_path / "floats", make_config(source=str(path), features=["a", "c"]))
    assert train.manifest.features[0].dtype == "float32"
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(DataError, match=r"table.jsonl: not JSON Lines, one JSON object per line"):
        prepare_into(tmp_path / "bad", make_config(source=str(path), features=["a"]))


def test_config_keys_that_go_together(tmp_path):
    cases = [
        ({"source": "t.csv", "text": "body"}, "config key 'data.text': needs data.tokenizer"),
        ({"source": "t.npz", "text": "body", "tokenizer": "tok.json"},
         "config key 'data.text': text columns are read from a .csv, .parquet or .jsonl file"),
        ({"source": "t.csv", "text": ["a", "y"], "tokenizer": "tok.json"}, "config key 'data.text': 'y' is data.label"),
        ({"source": "t.csv", "tokenizer": "tok.json"}, "config key 'data.tokenizer': tokenizes text"),
        ({"source": "digits", "tokenizer": "tok.json"}, "config key 'data.tokenizer': tokenizes text"),
        ({"source": "t.csv", "text": ["a", "b", "c"], "tokenizer": "tok.json"}, "config key 'data.text'"),
    ]
    for data, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
            make_config(**data)
    make_config(source="text", tokenizer="tok.json")
    make_config(source="t.jsonl", text=["a", "b"], tokenizer="tok")


def test_a_tokenizer_folder_counts_by_its_files(tmp_path):
    """Resuming needs the same data: a save_pretrained folder changes the training
    identity when a file in it changes, not only when its path does."""
    folder = tmp_path / "pretrained"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")
    config = make_config(source="text", tokenizer=str(folder))
    before = config_mod.training_identity(config)["data"]["tokenizer"]
    assert before.startswith("sha256-folder:")
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    assert config_mod.training_identity(config)["data"]["tokenizer"] != before
    assert config_mod.training_identity(config)["data"]["source"] == "text"  # a name, not a folder's content


# --- the model side ----------------------------------------------------------------------------------


TOKENIZED = shard_manifest([(n, "int64", [8]) for n in ("input_ids", "attention_mask", "token_type_ids")],
                           tokenizer={"source": "tok.json", "vocab_size": 50, "input": "input_ids", "text": ["body"]})


def test_the_tokenizers_inputs_reach_forward_by_name():
    order = [f.name for f in user.forward_features(TextBag(50, 2), TOKENIZED)]
    assert order == ["attention_mask", "token_type_ids", "input_ids"]  # TextBag.forward's order

    class NoTypes(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            return input_ids

    with pytest.raises(ModelError, match=r"model.path: NoTypes.forward\(input_ids, attention_mask\) takes no "
                                         r"token_type_ids, which data.tokenizer gives for data.text"):
        user.forward_features(NoTypes(), TOKENIZED)
    untokenized = shard_manifest([("a", "int64", [8]), ("b", "int64", [8])])  # named otherwise, no tokenizer
    assert user.forward_features(NoTypes(), untokenized) == list(untokenized.features)  # the data's order


class Flattened(torch.nn.Module):
    """Looks its ids up after a reshape and a cast, as transformers' GPT-2 does."""

    def __init__(self, rows: int):
        super().__init__()
        self.embed = torch.nn.Embedding(rows, 4)
        self.positions = torch.nn.Embedding(8, 4)

    def forward(self, x):
        return self.embed(x.reshape(-1, 8).long()).sum(1) + self.positions(torch.arange(8)).sum(0)


@pytest.mark.parametrize("rows", [40, 50, 64])
def test_vocabulary_against_the_embedding(tmp_path, rows, caplog):
    manifest = shard_manifest([("x", "int64", [8])], tokenizer={"source": "tok.json", "vocab_size": 50, "input": "x"})
    torch_export.export_torch(Flattened(rows), manifest, tmp_path / "model.onnx")
    import onnx

    base = onnx.load(str(tmp_path / "model.onnx"))
    assert vocabulary.token_embedding(base, "x") == ("embed.weight", rows)
    caplog.set_level(logging.INFO, "ortflow")
    described = f"data.tokenizer tok.json has a vocabulary of 50 token ids, the model's embedding 'embed.weight' " \
                f"(which looks up 'x') {rows} rows"
    if rows < 50:
        with pytest.raises(ModelError) as error:
            vocabulary.check(base, manifest)
        assert str(error.value) == f"{described}: ids 40 and up would index past it; build the model with a " \
                                   "vocabulary of 50 (e.g. vocab_size in model.kwargs)"
    else:
        vocabulary.check(base, manifest)
        assert (f"{described}: rows 50 and up are never looked up" if rows > 50 else f"{described}: they match") \
            in caplog.text


# --- through the workflow ----------------------------------------------------------------------------


ANIMALS = {"bird": ["bird", "sparrow", "feathers"], "cat": ["cat", "kitten", "whiskers"],
           "dog": ["dog", "puppy", "barks"]}
FILLER = "the a on in under over sat ran slept near garden house tree yesterday quietly happily".split()


def animal_texts(rows: int) -> pd.DataFrame:
    """Short sentences whose label is the animal they mention, among filler words."""
    rng = np.random.default_rng(1)
    names = sorted(ANIMALS)
    labels = [names[i] for i in rng.integers(0, 3, rows)]
    texts = []
    for label in labels:
        words = list(rng.choice(FILLER, rng.integers(3, 12))) + [rng.choice(ANIMALS[label])]
        rng.shuffle(words)
        texts.append(" ".join(words))
    return pd.DataFrame({"review": texts, "animal": labels})


@pytest.mark.e2e
def test_text_classification_through_the_workflow(tmp_path, monkeypatch):
    """A .jsonl of texts with string labels, a WordPiece tokenizer.json and a torch
    TextBag through every stage: metrics.json and the report name the classes, and
    export/ holds a model and a tokenizer that classify raw text without the run's folder."""
    import onnx
    import onnxruntime
    from tokenizers import Tokenizer

    workdir = tmp_path / "work"
    workdir.mkdir()
    frame = animal_texts(400)
    frame.to_json(workdir / "animals.jsonl", orient="records", lines=True)
    vocab = train_wordpiece(workdir / "tokenizer.json", 120, list(frame["review"])).get_vocab_size()
    config = {
        "run": {"name": "animals"},
        "data": {"source": "animals.jsonl", "text": "review", "label": "animal", "tokenizer": "tokenizer.json",
                 "context": 16, "shards": 1},
        "model": {"kind": "torch", "path": "text_models:TextBag", "kwargs": {"vocab_size": vocab, "classes": 3}},
        "train": {"world_size": 2, "steps": 150, "micro_batch_size": 16, "eval_every": 150, "log_every": 10,
                  "optimizer": {"lr": 0.03}, "lr_schedule": {"warmup_steps": 5}},
    }
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    run_snakemake(workdir, config)
    results = workdir / "results" / "animals"
    classes = sorted(ANIMALS)

    trained = json.loads((results / "train/metrics.json").read_text())["eval"]
    per_class = trained["per_class"]
    assert list(per_class) == classes and sum(c["count"] for c in per_class.values()) == 80
    correct = sum(c["accuracy"] * c["count"] for c in per_class.values())
    assert correct / 80 == pytest.approx(trained["accuracy"]) and trained["accuracy"] > 0.8, trained
    summary = (results / "report/summary.html").read_text()
    for name in classes:
        assert f"<tr data-key='{name}'><td>{name}</td><td class=n>{per_class[name]['count']}</td>" in summary
    assert f"the model's embedding 'tokens.weight' (which looks up 'input_ids') {vocab} rows: they match" in \
        (workdir / "logs/animals/build_artifacts.log").read_text()

    # The exported model with its tokenizer alone: raw text in, class names out.
    export = results / "export"
    metadata = {p.key: p.value for p in onnx.load(str(export / "model.onnx")).metadata_props}
    assert json.loads(metadata["ortflow.classes"]) == classes
    assert metadata["ortflow.tokenizer"] == "tokenizer.json"
    assert metadata["ortflow.tokenizer_sha256"] == hashlib.sha256((export / "tokenizer.json").read_bytes()).hexdigest()
    tokenizer = Tokenizer.from_file(str(export / "tokenizer.json"))
    _, eval_rows = split_rows(len(frame), 0.2, SEED)
    encodings = tokenizer.encode_batch(list(frame["review"][eval_rows]))
    feeds = {"input_ids": [e.ids for e in encodings], "attention_mask": [e.attention_mask for e in encodings],
             "token_type_ids": [e.type_ids for e in encodings]}
    eval_shards = whole(ShardReader(results / "data/eval"))
    for name, value in feeds.items():
        assert np.array_equal(np.array(value), eval_shards[name]), name
    session = onnxruntime.InferenceSession(str(export / "model.onnx"))
    logits = session.run(None, {name: np.array(value, dtype=np.int64) for name, value in feeds.items()})[0]
    predicted = [json.loads(metadata["ortflow.classes"])[i] for i in logits.argmax(axis=1)]
    accuracy = np.mean(np.array(predicted) == frame["animal"].to_numpy()[eval_rows])
    assert accuracy == pytest.approx(json.loads((export / "metrics.json").read_text())["fp32"]["accuracy"])


def last_line(result) -> str:
    """The error Snakemake prints for a config refused at parse time (the line after its WorkflowError line)."""
    lines = result.stderr.splitlines()
    return next(lines[i + 1] for i, line in enumerate(lines) if line.startswith("WorkflowError"))


@pytest.mark.e2e
@pytest.mark.parametrize("target", ["a folder outside", "/proc"])
def test_workflow_refuses_a_linked_tokenizer_folder_without_reading_it(tmp_path, target):
    """A data.tokenizer folder linked elsewhere stops Snakemake in one line before any
    job, saying where it points; nothing under the target is read (its files' access
    times stay as they were: a read would set them, as the control file's shows)."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    if target == "/proc":  # entries even root may not read (issue 33: a PermissionError traceback)
        pointed = Path("/proc")
    else:
        pointed = tmp_path / "secrets"
        pointed.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "id_rsa"):
            (pointed / name).write_text("{}")
            os.utime(pointed / name, (1000, 2000))  # accessed before modified: a read updates it
        control = tmp_path / "control"
        control.write_text("x")
        os.utime(control, (1000, 2000))
        control.read_text()
        if control.stat().st_atime == 1000:
            pytest.skip("this file system does not record reads (noatime)")
    (workdir / "tokdir").symlink_to(pointed)
    result = run_snakemake(workdir, {"data": {"source": "text", "tokenizer": "tokdir"}}, "prepare_data",
                           check=False)
    assert result.returncode == 1
    assert last_line(result) == (f"data.tokenizer: tokdir is a symbolic link to {pointed}; what it reads must be a "
                                 "regular file where the config names it (copy a link's target in its place)")
    assert "Traceback" not in result.stderr and "PermissionError" not in result.stderr
    if target != "/proc":
        assert {p.name: p.stat().st_atime for p in pointed.iterdir()} == dict.fromkeys(
            ["tokenizer.json", "tokenizer_config.json", "id_rsa"], 1000)
    assert not (workdir / "results").exists()

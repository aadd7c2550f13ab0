"""A causal LM's examples from rows (data/examples.py): chats rendered as transformers' apply_chat_template
renders them with the loss on the assistant's tokens, prompt-completion pairs with the loss on the
completion, documents in a column as a .txt file's, `datasets` folders with their splits, lengths, and
each bad input's one line. The tokenizer is a word-level one of a few words (tests/text_models.py):
one id a word, so the expected ids are read off the words."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers

from ortflow import config as config_mod
from ortflow.artifacts import Artifacts
from ortflow.checkpoints.ort_format import read_ort_checkpoint
from ortflow.data import examples, tokenizer as tokenizers
from ortflow.data.manifest import Manifest, read_manifest
from ortflow.data.shards import ShardReader
from ortflow.errors import DataError
from ortflow.generation.samples import SAMPLES
from ortflow.graphs.description import read_description
from ortflow.models import IGNORE_INDEX, save_trained
from ortflow.stages import build_artifacts, export_model
from ortflow.stages.prepare_data import prepare
from test_hf_families import differences, torch_twin, train_in_ort
from test_torch_layers import LOSS_TOLERANCE, PARAMETER_TOLERANCE, largest
from text_models import CHAT_TEMPLATE, CHAT_WORDS, MARKED_TEMPLATE, chat_tokenizer, train_bpe
from torch_reference import train_like_ortflow

CONTEXT = 24
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "fine thanks"}, {"role": "user", "content": "what is two plus two"},
        {"role": "assistant", "content": "four"}]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def prepared(tmp_path: Path, **data) -> tuple[dict, dict, Manifest]:
    """(the train split's records, the eval split's, the train manifest) of the data config `data`."""
    config = config_mod.load(overrides={"data": {"context": CONTEXT, "shards": 1, **data}})
    prepare(config, tmp_path / "data/train", tmp_path / "data/eval")
    readers = [ShardReader(tmp_path / "data" / split) for split in ("train", "eval")]
    manifest = read_manifest(tmp_path / "data/train")
    return *(reader.gather(np.arange(len(reader))) for reader in readers), manifest


def expected(ids: list[int], in_loss: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The padded input ids and the labels: the next token where it is in the loss, else IGNORE_INDEX."""
    padded = np.full(CONTEXT, CHAT_WORDS.index("<pad>"))
    labels = np.full(CONTEXT, IGNORE_INDEX)
    padded[:len(ids)] = ids
    labels[:len(ids) - 1] = np.where(np.array(in_loss[1:], bool), ids[1:], IGNORE_INDEX)
    return padded, labels


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, MARKED_TEMPLATE], ids=["prefixes", "generation-marks"])
def test_chat_is_apply_chat_template_with_the_loss_on_the_assistant_turns(template, tmp_path):
    folder = chat_tokenizer(tmp_path / "tokenizer", template)
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}] * 5)
    train, _, manifest = prepared(tmp_path, source=str(source), tokenizer=str(folder))
    # transformers' own ids, and its mask of the assistant's tokens from the template that marks them
    reference = chat_tokenizer(tmp_path / "marked", MARKED_TEMPLATE)
    marked = transformers.AutoTokenizer.from_pretrained(str(reference)).apply_chat_template(
        CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    own = transformers.AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(CHAT, tokenize=True)
    assert own["input_ids"] == marked["input_ids"]
    ids, labels = expected(marked["input_ids"], marked["assistant_masks"])
    assert (train["input_ids"] == ids).all() and (train["y"] == labels).all()
    assert (train["attention_mask"].sum(axis=1) == len(ids[ids != CHAT_WORDS.index("<pad>")])).all()
    in_loss = [CHAT_WORDS[i] for i in labels if i != IGNORE_INDEX]
    assert in_loss == ["fine", "thanks", "</s>", "four", "</s>"]
    assert manifest.source["examples"] == {"examples": 5, "truncated": 0, "dropped": 0, "loss_tokens": 25,
                                              "splits": {"all": 5}}


# ChatML with its tags as plain text: a byte-level BPE then has tokens that cross a turn's first or last character.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
          "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n"
          "{% endfor %}")
MARKED_CHATS = [CHAT, CHAT[1:3], [{"role": "user", "content": "a b", "name": None},
                                  {"role": "assistant", "content": "c", "name": None}], CHAT[:3] + CHAT[1:3]]


def marked_folder(tmp_path: Path, kind: str) -> Path:
    """A tokenizer folder of `kind`: words (MARKED_TEMPLATE, or a variant whose generation spans end or start
    on a space, a character of no token) or byte-level BPE (CHATML)."""
    if kind != "bpe":
        template = {"words": MARKED_TEMPLATE,
                    "span-ends-on-a-space": MARKED_TEMPLATE.replace("}}{% endgeneration %}", "}} {% endgeneration %}"),
                    "span-starts-on-a-space": MARKED_TEMPLATE.replace("{% generation %}{{", "{% generation %} {{")}[kind]
        assert template != MARKED_TEMPLATE or kind == "words"
        return chat_tokenizer(tmp_path / "tokenizer", template)
    tmp_path.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=train_bpe(tmp_path / "tokenizer.json", 300),
                                                     eos_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(str(tmp_path / "tokenizer"))
    return tmp_path / "tokenizer"


@pytest.mark.parametrize("kind", ["words", "span-ends-on-a-space", "span-starts-on-a-space", "bpe"])
def test_marked_chats_are_apply_chat_templates_ids_and_assistant_mask(kind, tmp_path):
    """The batch of chats rendered and encoded at once, the mask made of the spans' characters
    (Renderer._chats), gives what apply_chat_template gives each chat, a row at a time."""
    folder = marked_folder(tmp_path, kind)
    data = config_mod.load(overrides={"data": {"source": "chats.jsonl", "tokenizer": str(folder)}}).data
    renderer = examples.Renderer(data, tokenizers.load(str(folder)), "messages")
    found = renderer.examples("chats.jsonl", 0, [{"messages": chat} for chat in MARKED_CHATS])
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    for chat, start, length in zip(MARKED_CHATS, found.starts, found.lengths):
        own = reference.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert found.ids[start:start + length].tolist() == own["input_ids"]
        assert found.loss[start:start + length].astype(int).tolist() == own["assistant_masks"]
    # A span whose first character is of no token: transformers marks none of the chat's spans from there on.
    assert found.loss.any() == (kind != "span-starts-on-a-space")


def test_loss_on_all_and_a_template_of_the_config(tmp_path):
    folder = chat_tokenizer(tmp_path / "tokenizer", None)
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}] * 5)
    (tmp_path / "template.jinja").write_text(CHAT_TEMPLATE)
    train, _, _ = prepared(tmp_path, source=str(source), tokenizer=str(folder), loss_on="all",
                           chat_template=str(tmp_path / "template.jinja"))
    assert examples.template_file(str(tmp_path / "template.jinja")) == tmp_path / "template.jinja"  # an input
    assert examples.template_file(CHAT_TEMPLATE) is None
    length = int(train["attention_mask"][0].sum())
    assert (train["y"][0, :length - 1] == train["input_ids"][0, 1:length]).all()
    assert (train["y"][0, length - 1:] == IGNORE_INDEX).all()


def test_prompt_completion_masks_the_prompt_and_ends_with_eos(tmp_path):
    folder = chat_tokenizer(tmp_path / "tokenizer")
    rows = [{"question": "what is two plus two", "answer": "four"}] * 5
    source = write_jsonl(tmp_path / "pairs.jsonl", rows)
    train, _, _ = prepared(tmp_path, source=str(source), tokenizer=str(folder), prompt="question",
                           completion="answer")
    ids = [CHAT_WORDS.index(word) for word in "what is two plus two four </s>".split()]
    padded, labels = expected(ids, [0] * 5 + [1, 1])
    assert (train["input_ids"] == padded).all() and (train["y"] == labels).all()


def test_conversational_prompt_completion_renders_the_completion_after_the_prompt(tmp_path):
    folder = chat_tokenizer(tmp_path / "tokenizer")
    rows = [{"prompt": CHAT[:4], "completion": CHAT[4:]}] * 5
    train, _, _ = prepared(tmp_path, source=str(write_jsonl(tmp_path / "pairs.jsonl", rows)),
                           tokenizer=str(folder))
    rendered = transformers.AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(CHAT, tokenize=True)
    in_loss = [CHAT_WORDS[i] for i in train["y"][0] if i != IGNORE_INDEX]
    assert train["input_ids"][0, :len(rendered["input_ids"])].tolist() == rendered["input_ids"]
    assert in_loss == ["four", "</s>"]  # the template's own end of turn: no second one


def test_documents_of_a_column_train_as_a_text_files(tmp_path):
    folder = chat_tokenizer(tmp_path / "tokenizer")
    documents = ["hi there how are you", "fine thanks", "what is two plus two", "four yes no a b c"] * 6
    (tmp_path / "docs.txt").write_text("\n\n".join(documents))
    parquet = tmp_path / "docs.parquet"
    import pandas as pd

    pd.DataFrame({"body": documents}).to_parquet(parquet)
    text, _, _ = prepared(tmp_path / "txt", source=str(tmp_path / "docs.txt"), tokenizer=str(folder), context=8)
    column, _, _ = prepared(tmp_path / "column", source=str(parquet), tokenizer=str(folder), context=8,
                            format="documents", text="body")
    assert all((text[name] == column[name]).all() for name in text)


def test_a_datasets_folder_keeps_its_splits(tmp_path):
    import datasets

    folder = chat_tokenizer(tmp_path / "tokenizer")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"messages": CHAT}] * 6),
                                   "validation": datasets.Dataset.from_list([{"messages": CHAT[:3]}] * 2)})
    splits.save_to_disk(str(tmp_path / "hub"))
    train, evaluation, manifest = prepared(tmp_path, source=str(tmp_path / "hub"), tokenizer=str(folder))
    assert len(train["y"]) == 6 and len(evaluation["y"]) == 2
    assert [CHAT_WORDS[i] for i in evaluation["y"][0] if i != IGNORE_INDEX] == ["fine", "thanks", "</s>"]
    assert manifest.source["examples"]["splits"] == {"train": 6, "eval": 2}
    # Snakemake's inputs of prepare_data (workflow/rules/common.smk): editing a split reruns it
    assert {Path(file).parent.name for file in examples.source_files(str(tmp_path / "hub"))
            if file.endswith(".arrow")} == {"train", "validation"}


def test_chats_of_parquet_and_of_a_datasets_folder_are_those_of_jsonl(tmp_path):
    import datasets
    import pandas as pd

    folder = chat_tokenizer(tmp_path / "tokenizer")
    rows = [{"messages": CHAT}, {"messages": CHAT[1:3]}] * 3
    pd.DataFrame(rows).to_parquet(tmp_path / "chats.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hub"))
    jsonl, _, _ = prepared(tmp_path / "jsonl", source=str(write_jsonl(tmp_path / "chats.jsonl", rows)),
                           tokenizer=str(folder))
    for source in ("chats.parquet", "hub"):
        other, _, _ = prepared(tmp_path / f"out-{source}", source=str(tmp_path / source), tokenizer=str(folder))
        assert all((jsonl[name] == other[name]).all() for name in jsonl), source


def test_documents_of_a_datasets_folder_keep_its_splits(tmp_path):
    import datasets

    folder = chat_tokenizer(tmp_path / "tokenizer")
    train, evaluation = ["hi there how are you fine thanks"] * 6, ["what is two plus two four"] * 3
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": train}),
                          "test": datasets.Dataset.from_dict({"text": evaluation})}).save_to_disk(str(tmp_path / "hub"))
    windows, held_out, _ = prepared(tmp_path, source=str(tmp_path / "hub"), tokenizer=str(folder), context=8,
                                    format="documents")
    # 6 x 8 train tokens (7 words and </s>) and 3 x 6 eval tokens: windows of 8 tokens and the next one
    assert len(windows["y"]) == (6 * 8 - 1) // 8 and len(held_out["y"]) == (3 * 6 - 1) // 8
    words = {CHAT_WORDS.index(word) for word in "what is two plus four".split()}
    assert not words & set(windows["x"].ravel()) and set(held_out["x"][:, 1:].ravel()) <= words | {1}


def test_auto_finds_the_format_by_the_columns_but_text_columns_stay_a_table():
    def found(columns: list[str], **data) -> str:
        rows = {"source": "rows.jsonl", "tokenizer": "tokenizer.json"}
        return examples.format_of(config_mod.load(overrides={"data": rows | data}).data, columns)

    assert found(["messages", "id"]) == "messages" and found(["prompt", "completion"]) == "prompt-completion"
    assert found(["prompt", "completion", "y"], text="prompt") == "table" and found(["text", "y"]) == "table"
    assert found(["text"], format="documents") == "documents"


def test_too_long_examples_are_truncated_or_dropped_and_counted(tmp_path):
    folder = chat_tokenizer(tmp_path / "tokenizer")
    rows = [{"messages": CHAT}] * 4 + [{"messages": CHAT[1:3]}] * 4  # 18 and 8 tokens
    source = write_jsonl(tmp_path / "chats.jsonl", rows)
    train, evaluation, manifest = prepared(tmp_path / "cut", source=str(source), tokenizer=str(folder), context=12)
    assert manifest.source["examples"]["truncated"] == 4 and len(train["y"]) + len(evaluation["y"]) == 8
    _, _, manifest = prepared(tmp_path / "drop", source=str(source), tokenizer=str(folder), context=12,
                              too_long="drop", eval_fraction=0.5)
    assert manifest.source["examples"] | {"splits": None} == {"examples": 4, "truncated": 0, "dropped": 4,
                                                                "loss_tokens": 12, "splits": None}


TEMPLATE_WITH_TOOLS = CHAT_TEMPLATE.replace("{% if m['role'] == 'assistant' %}", "{% if m['role'] != 'tool' and "
                                            "m['role'] == 'assistant' %}")
BAD = {
    "no-column": ([{"text": "hi"}], {}, r"chats.jsonl: column\(s\) messages not found; the rows have columns text"),
    "a-row-without-it": ([{"messages": CHAT}, {"text": "hi"}], {}, r"chats.jsonl: row 1 has no column 'messages'"),
    "not-messages": ([{"messages": "hi there"}], {}, r"chats.jsonl: row 0: column 'messages' is not a list of "),
    "no-content": ([{"messages": [{"role": "user"}]}], {}, r"row 0: column 'messages' is not a list of messages"),
    "unknown-role": ([{"messages": [{"role": "tool", "content": "a"}]}], {},
                     r"row 0: role 'tool' is none of system, user, assistant and the chat template does not name it"),
    "template-fails": ([{"messages": CHAT}], {"chat_template": "{{ raise_exception('no tools here') }}"},
                       r"chats.jsonl: row 0: the chat template fails to render it \(.*no tools here\)"),
    "empty-after-truncation": ([{"messages": CHAT[:3]}], {"context": 6},
                               r"row 0: its assistant turns \(or completion\) are empty after truncation to "
                               r"data.context=6 tokens"),
    "no-assistant": ([{"messages": CHAT[:2]}], {}, r"row 0: nothing to learn"),
    "renders-nothing": ([{"messages": CHAT}], {"chat_template": "{% if false %}x{% endif %}"},
                        r"row 0: nothing to learn"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_rows_are_one_line_naming_the_file_and_row(case, tmp_path):
    rows, data, message = BAD[case]
    source = write_jsonl(tmp_path / "chats.jsonl", rows)
    config = config_mod.load(overrides={"data": {"source": str(source), "tokenizer": str(chat_tokenizer(
        tmp_path / "tokenizer")), "context": CONTEXT, "format": "messages", **data}})
    with pytest.raises(DataError, match=message) as error:
        prepare(config, tmp_path / "data/train", tmp_path / "data/eval")
    assert "\n" not in str(error.value) and not (tmp_path / "data").exists()


def test_the_first_bad_row_is_named_though_the_next_batch_is_rendered_while_it_is_encoded(tmp_path, monkeypatch):
    """Batches of rows are rendered while the one before is encoded (Renderer.tokenized): a row that fails
    after encoding (row 1, its assistant turn cut off) is named before a later batch's row that fails to
    render (row 2), and the examples before them are those of the rows a batch at a time."""
    monkeypatch.setattr(examples, "READ_ROWS", 2)
    folder = chat_tokenizer(tmp_path / "tokenizer")
    rows = [{"messages": CHAT[1:3]}, {"messages": [CHAT[0], CHAT[0], CHAT[0], *CHAT[1:3]]},
            {"messages": "hi there"}]
    source = write_jsonl(tmp_path / "chats.jsonl", rows)
    config = config_mod.load(overrides={"data": {"source": str(source), "tokenizer": str(folder), "context": 8}})
    with pytest.raises(DataError, match=r"row 1: its assistant turns \(or completion\) are empty after truncation"):
        prepare(config, tmp_path / "data/train", tmp_path / "data/eval")
    renderer = examples.Renderer(config.data, tokenizers.load(str(folder)), "messages")
    good = examples.Rows("chats.jsonl", ["messages"], lambda: iter([[rows[0]] * 2, [rows[0]]]))
    whole = renderer.examples("chats.jsonl", 0, [rows[0]] * 3)
    found = list(renderer.tokenized(good))
    assert [(start, size) for start, size, _ in found] == [(0, 2), (2, 1)]
    assert np.array_equal(np.concatenate([tokens.ids for *_, tokens in found]), whole.ids)
    assert np.array_equal(np.concatenate([tokens.loss for *_, tokens in found]), whole.loss)


def test_a_role_the_template_names_is_taken(tmp_path):
    folder = chat_tokenizer(tmp_path / "tokenizer", TEMPLATE_WITH_TOOLS)
    rows = [{"messages": [*CHAT[:2], {"role": "tool", "content": "four"}, *CHAT[2:3]]}] * 5
    train, _, _ = prepared(tmp_path, source=str(write_jsonl(tmp_path / "chats.jsonl", rows)), tokenizer=str(folder))
    assert CHAT_WORDS.index("<|tool|>") in train["input_ids"][0]


def test_no_template_is_refused_naming_both_ways_out(tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}])
    config = config_mod.load(overrides={"data": {"source": str(source), "tokenizer": str(chat_tokenizer(
        tmp_path / "tokenizer", None))}})
    with pytest.raises(DataError, match="no chat template .*data.chat_template.*tokenizer_config.json"):
        prepare(config, tmp_path / "data/train", tmp_path / "data/eval")


def test_an_arrow_folder_that_is_not_a_datasets_folder_is_refused(tmp_path):
    (tmp_path / "arrows").mkdir()
    (tmp_path / "arrows/data-00000-of-00001.arrow").write_bytes(b"")
    config = config_mod.load(overrides={"data": {"source": str(tmp_path / "arrows"), "tokenizer": str(
        chat_tokenizer(tmp_path / "tokenizer"))}})
    with pytest.raises(DataError, match=r"arrows is a directory, not a file \(it holds Arrow files\), nor a "
                                        r"folder written by datasets' save_to_disk: it has neither dataset_dict.json"):
        prepare(config, tmp_path / "data/train", tmp_path / "data/eval")


@pytest.mark.e2e  # 18 s: with test_hf_families' slower families, out of the fast loop
@pytest.mark.parametrize("packing", ["none", "separate"])
def test_a_tiny_chat_model_trains_on_the_assistant_turns_as_torch_does_and_exports(packing, tmp_path):
    """A Llama-shaped folder with a chat template, fine-tuned on a messages jsonl: ONNX Runtime's steps
    and torch's on the same batches give the same assistant-only loss and weights (the layer tests'
    tolerance), as tests/test_hf_families.py compares every family; the exported transformers folder
    renders chats with the template of the config, which the training rendered them with. Packed
    (data.packing: separate), the training graph builds the examples' mask from the position ids."""
    rng = np.random.default_rng(0)
    words = CHAT_WORDS[8:]
    rows = [{"messages": [{"role": "user", "content": " ".join(rng.choice(words, rng.integers(2, 6)))},
                          {"role": "assistant", "content": " ".join(rng.choice(words, rng.integers(1, 5)))}]}
            for _ in range(40)]
    folder = chat_tokenizer(tmp_path / "model")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=len(CHAT_WORDS), max_position_embeddings=64, attention_dropout=0.0)).save_pretrained(folder)
    config = config_mod.load(overrides={
        "run": {"name": "chat", "seed": 3},
        "data": {"source": str(write_jsonl(tmp_path / "chats.jsonl", rows)), "tokenizer": str(folder),
                 "context": 16, "shards": 1, "eval_fraction": 0.25, "chat_template": MARKED_TEMPLATE,
                 "packing": packing},
        "model": {"kind": "transformers", "path": str(folder), "task": "causal-lm"},
        "train": {"world_size": 1, "micro_batch_size": 8, "steps": 4, "clip_grad_norm": None,
                  "optimizer": {"name": "sgd", "lr": 0.1, "weight_decay": 0.0},
                  "lr_schedule": {"name": "cosine", "warmup_steps": 2}}})
    train_dir = tmp_path / "data/train"
    prepare(config, train_dir, tmp_path / "data/eval")
    artifacts = Artifacts(tmp_path / "artifacts")
    build_artifacts.build(config, train_dir, artifacts.folder)
    initial = dict(read_ort_checkpoint(artifacts.checkpoint).parameters)
    losses = train_in_ort(artifacts, config, train_dir, tmp_path / "checkpoint")
    trained = dict(read_ort_checkpoint(tmp_path / "checkpoint/checkpoint").parameters)
    manifest = read_manifest(train_dir)
    torch_losses, torch_trained = train_like_ortflow(torch_twin(config, manifest, initial), config, train_dir)
    worst = differences(trained, torch_trained)
    assert largest(losses, torch_losses) <= LOSS_TOLERANCE * max(1.0, *torch_losses), (losses, torch_losses)
    assert max(worst.values()) <= PARAMETER_TOLERANCE, worst
    assert max(largest(trained[name], initial[name]) for name in trained) > 100 * PARAMETER_TOLERANCE

    export_model.export(config, artifacts.folder, tmp_path / "checkpoint", tmp_path / "data/eval",
                        tmp_path / "model.onnx")
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / save_trained.TRANSFORMERS))
    assert exported.chat_template == MARKED_TEMPLATE
    assert_eval_is_over_the_assistants_tokens(artifacts, tmp_path)
    # export/samples.json: each prompt the chat up to the assistant's turn, then the assistant's words
    samples = json.loads((tmp_path / SAMPLES).read_text())["samples"]
    chats = {(f"<s> <|user|> {row['messages'][0]['content']} <|assistant|>", row["messages"][1]["content"])
             for row in rows}
    assert len(samples) == 3 and {(sample["prompt"], sample["expected"]) for sample in samples} <= chats, samples


def assert_eval_is_over_the_assistants_tokens(artifacts: Artifacts, tmp_path: Path) -> None:
    """Issue 42: training's evaluation (evaluation.evaluate, the eval graph over batches of 3) of the
    trained chat model gives torch's cross-entropy over the assistant's tokens alone on
    export/transformers/, not the one over every token of the chats, which differs by far more."""
    from onnxruntime.training.api import CheckpointState, Module

    from ortflow.evaluation import evaluate

    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint/checkpoint"))
    module = Module(str(artifacts.training_model), state, str(artifacts.eval_model))
    reader = ShardReader(tmp_path / "data/eval")
    one_rank = SimpleNamespace(rank=0, world_size=1, allreduce_sum=lambda totals: totals)
    results = evaluate(module, reader, one_rank, read_description(artifacts.model_json), 3, reader.label_name)
    records = reader.gather(np.arange(len(reader)))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / save_trained.TRANSFORMERS)).eval()
    ids, mask = torch.from_numpy(records["input_ids"]), torch.from_numpy(records["attention_mask"])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.transpose(1, 2)
    in_loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(records["y"]), ignore_index=IGNORE_INDEX)
    every = torch.where(mask[:, 1:] == 1, ids[:, 1:], IGNORE_INDEX)  # the next token wherever there is one
    everywhere = torch.nn.functional.cross_entropy(logits[:, :, :-1], every, ignore_index=IGNORE_INDEX)
    assert (records["y"] == IGNORE_INDEX).sum() > (records["attention_mask"] == 0).sum()  # prompts are ignored
    assert results["loss"] == pytest.approx(float(in_loss), rel=1e-4), (results, float(everywhere))
    assert results["perplexity"] == pytest.approx(np.exp(float(in_loss)), rel=1e-4)
    assert abs(float(everywhere) - float(in_loss)) > 0.1, (float(everywhere), float(in_loss))

"""export/samples.json (generation/samples.py): the eval prompts of chats, prompt-completion pairs
and text windows, and the greedy continuations before and after fine-tuning, on the tiny byte-level
GPT-2 of tests/test_generation.py; and the report's page of them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from tokenizers import Tokenizer

from ortflow.generation import folder as generation_folder
from ortflow.generation.generate import Decoder, generate
from ortflow.generation.samples import NEW_TOKENS, SAMPLES, eval_prompts, write_samples
from ortflow.models import IGNORE_INDEX
from ortflow.reporting.summary import exported_lines
from ortflow.reporting.tables import samples_page
from test_generation import tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: why one thread

X = IGNORE_INDEX


def examples(rows: list[tuple[list[int], list[int]]], context: int = 10) -> dict:
    """Padded examples as data/examples.py writes them: (ids, which tokens are in the loss) a row;
    the label of position i is token i + 1 where that token is in the loss."""
    ids = np.zeros((len(rows), context), np.int64)
    mask = np.zeros((len(rows), context), np.int64)
    labels = np.full((len(rows), context), X, np.int64)
    for row, (tokens, in_loss) in enumerate(rows):
        ids[row, :len(tokens)], mask[row, :len(tokens)] = tokens, 1
        labels[row, :len(tokens) - 1] = np.where(np.array(in_loss[1:], bool), tokens[1:], X)
    return {"input_ids": ids, "attention_mask": mask, "y": labels}


def test_prompts_end_where_the_loss_starts_or_are_a_windows_start():
    chat = ([11, 12, 13, 14, 15, 16, 17], [0, 0, 0, 1, 1, 1, 0])  # 14 15 16 the assistant's, then a user's turn
    pair = ([21, 22, 23, 24], [0, 0, 1, 1])
    every = ([31, 32, 33, 34, 35, 36], [1] * 6)  # a chat with its loss on all tokens: its first half
    assert eval_prompts(examples([chat, pair, every]), "y", 5) == [
        ([11, 12, 13], [14, 15, 16]), ([21, 22], [23, 24]), ([31, 32, 33], [34, 35, 36])]
    assert eval_prompts(examples([chat, pair, every]), "y", 1) == [([11, 12, 13], [14, 15, 16])]
    windows = np.arange(40).reshape(1, 40)
    assert eval_prompts({"x": windows, "y": windows + 1}, "y", 3) == [(list(range(16)), list(range(16, 41)))]


class Records:
    """The eval split as write_samples reads it (a ShardReader's gather, label_name and length)."""

    def __init__(self, batch: dict):
        self.batch, self.label_name = batch, "y"

    def __len__(self) -> int:
        return len(self.batch["y"])

    def gather(self, indices: np.ndarray) -> dict:
        return {name: array[indices] for name, array in self.batch.items()}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """export/ with gpt2's tiny generation folder (bytes), and the model it came from."""
    root = tmp_path_factory.mktemp("export")
    source, model = tiny("gpt2", root)
    generation_folder.export_folder(source, root / "generation")
    return root, model


def test_samples_before_and_after_are_each_models_greedy_text(export, tmp_path):
    """Before and after from the same weights are the same text, the exported decoder's greedy tokens
    decoded; from other weights, `before` is theirs (transformers' generate), `after` the folder's."""
    root, model = export
    chats = examples([(list(b"user: hi\nbot: hello"), [0] * 14 + [1] * 5), (list(b"q: 2+2? a: 4"), [0] * 11 + [1])],
                     context=24)
    write_samples(2, root, Records(chats), 128, lambda: SimpleNamespace(model=model))
    written = json.loads((root / SAMPLES).read_text())
    decoder = Decoder(root / "generation", threads=1)
    tokenizer = Tokenizer.from_file(str(root / "generation/tokenizer.json"))
    greedy = generate(decoder, [list(b"user: hi\nbot: "), list(b"q: 2+2? a: ")], NEW_TOKENS)
    texts = [tokenizer.decode([t for t in tokens if t not in decoder.eos]) for tokens in greedy]
    assert written == {"max_new_tokens": NEW_TOKENS, "greedy": True, "samples": [
        {"prompt": "user: hi\nbot: ", "expected": "hello", "before": texts[0], "after": texts[0]},
        {"prompt": "q: 2+2? a: ", "expected": "4", "before": texts[1], "after": texts[1]}]}
    assert all(len(text) > 0 for text in texts)

    _, other = tiny("llama", tmp_path)  # other weights, the same bytes: before is no longer after
    write_samples(1, root, Records(chats), 20, lambda: SimpleNamespace(model=other))
    again = json.loads((root / SAMPLES).read_text())
    assert again["max_new_tokens"] == 20 - 14  # the model's positions left after the longer prompt
    assert again["samples"][0]["after"] == texts[0][:len(again["samples"][0]["after"])]
    assert again["samples"][0]["before"] != again["samples"][0]["after"]


def test_the_start_model_is_let_go_before_the_decoders_session_opens(export, monkeypatch):
    """The starting weights' model generates first and is dropped before the folder's decoder opens:
    the two never hold the weights together (tests/test_external_data.py)."""
    import weakref

    import transformers

    from ortflow.generation import samples as samples_module

    root, _ = export
    built, alive_at_session = [], []

    def start():
        model = transformers.AutoModelForCausalLM.from_pretrained(root / "transformers").eval()
        built.append(weakref.ref(model))
        return SimpleNamespace(model=model)

    def decoder(*args, **kwargs):
        alive_at_session.append(built[0]() is not None)
        return Decoder(*args, **kwargs)

    monkeypatch.setattr(samples_module, "Decoder", decoder)
    write_samples(1, root, Records(examples([(list(b"q: 2+2? a: 4"), [0] * 11 + [1])], context=24)), 128, start)
    assert alive_at_session == [False] and len(json.loads((root / SAMPLES).read_text())["samples"]) == 1


def test_no_samples_without_a_generation_folder_or_with_a_count_of_0(export, tmp_path):
    root, model = export
    write_samples(0, root, Records(examples([([1, 2], [0, 1])])), 128, lambda: pytest.fail("built for no prompt"))
    assert json.loads((root / SAMPLES).read_text()) == {"max_new_tokens": 0, "greedy": True, "samples": []}
    (tmp_path / SAMPLES).write_text("{}")  # an earlier run's, whose model was a causal LM
    write_samples(3, tmp_path, Records(examples([([1, 2], [0, 1])])), 128, lambda: pytest.fail("no folder"))
    assert not (tmp_path / SAMPLES).exists()


def test_the_report_shows_the_samples_or_says_why_there_are_none(tmp_path):
    samples = {"max_new_tokens": 8, "greedy": True, "samples": [
        {"prompt": "<|user|>hi<|assistant|>", "expected": "fine", "before": "hi hi", "after": "fine thanks"}]}
    (tmp_path / SAMPLES).write_text(json.dumps(samples))
    page = samples_page(tmp_path / SAMPLES)
    assert ("<tr data-key='0'><td>&lt;|user|&gt;hi&lt;|assistant|&gt;</td><td class=n>fine</td><td class=n>hi hi</td>"
            "<td class=n>fine thanks</td></tr>") in page
    assert "at most 8 new tokens" in page
    for missing in (tmp_path / "none.json", None):
        assert "No generated samples: this run has no <code>export/generation/</code> folder" in samples_page(missing)
    (tmp_path / SAMPLES).write_text(json.dumps({**samples, "samples": []}))
    assert "No generated samples: <code>export.samples</code> is 0." in samples_page(tmp_path / SAMPLES)


def test_the_end_of_run_summary_names_the_samples(tmp_path):
    (tmp_path / "generation").mkdir()
    (tmp_path / "generation/genai_config.json").write_text("{}")
    (tmp_path / "model.onnx").write_bytes(b"")
    assert len(exported_lines(tmp_path / "model.onnx", None)) == 2  # no samples.json: no line
    sample = {"prompt": "a", "expected": "b", "before": "c", "after": "d"}
    (tmp_path / SAMPLES).write_text(json.dumps({"max_new_tokens": 4, "greedy": True, "samples": [sample, sample]}))
    assert exported_lines(tmp_path / "model.onnx", None)[2] == (
        f"  samples   {tmp_path / SAMPLES}: 2 eval prompts generated before and after training (the report's "
        "Generated samples)")
    (tmp_path / SAMPLES).write_text(json.dumps({"max_new_tokens": 0, "greedy": True, "samples": []}))
    assert len(exported_lines(tmp_path / "model.onnx", None)) == 2  # export.samples: 0

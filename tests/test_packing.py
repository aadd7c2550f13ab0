"""data.packing (data/examples.py's Windows, models/hugging_face.py's packed_mask): chats packed several to a
window hold the tokens and labels they had alone, and a causal LM given a `separate` window (position ids
restarting at each example, a mask keeping the examples apart) gives each example the loss it has alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from ortflow import config as config_mod
from ortflow.data.manifest import Manifest
from ortflow.errors import ModelError
from ortflow.models import IGNORE_INDEX, hugging_face
from test_chats import prepared, write_jsonl
from test_hf_families import FAMILIES
from test_torch_layers import largest
from text_models import CHAT_WORDS, chat_tokenizer

LABEL = "y"  # data.label's default: the labels' name in the records


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> tuple[Path, Path]:
    """(a jsonl of 40 chats of 5 to 17 tokens, a tokenizer folder of CHAT_WORDS)."""
    root = tmp_path_factory.mktemp("chats")
    rng = np.random.default_rng(0)
    words = CHAT_WORDS[8:]
    rows = [{"messages": [{"role": "user", "content": " ".join(rng.choice(words, rng.integers(1, 6)))},
                          {"role": "assistant", "content": " ".join(rng.choice(words, rng.integers(1, 6)))}]}
            for _ in range(40)]
    return write_jsonl(root / "chats.jsonl", rows), chat_tokenizer(root / "tokenizer")


def records(folder: Path, chats: tuple[Path, Path], packing: str) -> tuple[dict, Manifest]:
    """Both splits' records together, and the train manifest."""
    train, evaluation, manifest = prepared(folder, source=str(chats[0]), tokenizer=str(chats[1]), packing=packing)
    return {name: np.concatenate([train[name], evaluation[name]]) for name in train}, manifest


def examples_of(batch: dict, values: np.ndarray | None = None) -> list[tuple]:
    """(input ids, labels, and `values` summed over the labelled positions) of each example of the records
    `batch`, sorted: a record is an example, or (with position_ids) holds one from each position id 0."""
    found = []
    for row, (ids, mask, labels) in enumerate(zip(batch["input_ids"], batch["attention_mask"], batch[LABEL])):
        starts = np.flatnonzero(batch["position_ids"][row] == 0) if "position_ids" in batch else np.array([0])
        for start, end in zip(starts, [*starts[1:], len(ids)]):
            if mask[start:end].any():  # not a window's padding
                kept = labels[start:end] != IGNORE_INDEX
                value = 0.0 if values is None else float(values[row, start:end][kept].sum())
                found.append((tuple(ids[start:end][mask[start:end] == 1]), tuple(labels[start:end][kept]), value))
    return sorted(found)


@pytest.mark.parametrize("packing", ["separate", "cross"])
def test_packed_windows_hold_the_examples_and_labels_they_had_alone(packing, chats, tmp_path):
    alone, manifest = records(tmp_path / "none", chats, "none")
    packed, packed_manifest = records(tmp_path / packing, chats, packing)
    counts, packed_counts = manifest.source["examples"], packed_manifest.source["examples"]
    assert packed_counts["loss_tokens"] == counts["loss_tokens"] == (alone[LABEL] != IGNORE_INDEX).sum()
    assert (packed[LABEL] != IGNORE_INDEX).sum() == counts["loss_tokens"]
    assert packed_counts["windows"] == len(packed[LABEL]) < len(alone[LABEL]) == counts["examples"] == 40
    assert packed_counts["padding"] == (packed["attention_mask"] == 0).sum()
    if packing == "separate":  # whole examples, each its own positions: the same examples and labels
        assert [f.name for f in packed_manifest.features] == ["input_ids", "attention_mask", "position_ids"]
        assert examples_of(packed) == examples_of(alone)
    else:  # the examples' stream cut into windows: the same tokens and labels, only the last window padded
        assert (packed["attention_mask"][:-1] == 1).all() and packed_counts["padding"] < 24
        for name in ("input_ids", LABEL):
            assert (np.sort(packed[name][packed["attention_mask"] == 1]) ==
                    np.sort(alone[name][alone["attention_mask"] == 1])).all()


def tiny_model(folder: Path, kind: str) -> None:
    """A tiny causal LM of `kind` beside the tokenizer, its weights drawn from seed 0."""
    sizes = {"vocab_size": len(CHAT_WORDS), "max_position_embeddings": 64}
    config = {
        "llama": lambda: transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=2, intermediate_size=64, **sizes),
        # a sliding window shorter than most chats: the mask must keep it
        "mistral": lambda: transformers.MistralConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, intermediate_size=64, sliding_window=4,
                                                      **sizes),
        "gpt2": lambda: transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=len(CHAT_WORDS),
                                                n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    }[kind]()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def example_losses(batch: dict, manifest: dict, folder: Path) -> list[tuple]:
    model = hugging_face.build(config_mod.load(overrides={"model": {
        "kind": "transformers", "path": str(folder), "task": "causal-lm"}}).model, manifest)
    with torch.no_grad():
        logits = model(*(torch.from_numpy(batch[name]) for name in model.input_names))
        losses = torch.nn.functional.cross_entropy(logits, torch.from_numpy(batch[LABEL]), reduction="none")
    return examples_of(batch, losses.numpy())


@pytest.mark.parametrize("kind", ["llama", "mistral", "gpt2"])
def test_a_separate_window_gives_each_example_its_loss_alone(kind, chats, tmp_path):
    """The loss of each example's tokens, summed, from windows of several examples equals its loss in a
    record of its own, to float32's rounding; without the mask (the same window as one example) it does not."""
    folder = chat_tokenizer(tmp_path / "model")
    tiny_model(folder, kind)
    alone, manifest = records(tmp_path / "none", chats, "none")
    packed, packed_manifest = records(tmp_path / "separate", chats, "separate")
    expected, found = example_losses(alone, manifest, folder), example_losses(packed, packed_manifest, folder)
    assert [example[:2] for example in found] == [example[:2] for example in expected]
    worst = max(abs(a[2] - b[2]) for a, b in zip(found, expected))
    assert worst < 1e-4, worst  # sums of ~6 losses of ~3.1 each: float32 rounding is ~1e-6
    seen = {**packed, "position_ids": np.arange(24)[None].repeat(len(packed[LABEL]), 0)}
    cross = example_losses(seen, packed_manifest, folder)
    assert sum(loss for *_, loss in cross) != pytest.approx(sum(loss for *_, loss in expected), abs=1e-3)


def test_families_where_packing_is_not_measured_are_refused_in_one_line(chats, tmp_path):
    packed, manifest = records(tmp_path / "separate", chats, "separate")
    folder = tmp_path / "model"
    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
             "vocab_size": len(CHAT_WORDS)}
    transformers.Qwen2Config(**sizes, use_sliding_window=True, sliding_window=4, max_window_layers=1).save_pretrained(folder)
    model = config_mod.load(overrides={"model": {"kind": "transformers", "path": str(folder)}}).model
    with pytest.raises(ModelError, match=r"^model.path: \S+model is a qwen2 model and data.packing is separate: its "
                                         r"layers attend over windows of different sizes \(layer_types\), which one "
                                         r"mask cannot give; set data.packing: cross"):
        hugging_face.build(model, manifest)
    transformers.GPTJConfig(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, vocab_size=len(CHAT_WORDS)).save_pretrained(folder)
    with pytest.raises(ModelError, match=r"is a gptj model and data.packing is separate: examples packed into one "
                                         r"window are kept apart only in gpt2, gpt_neo, opt, llama"):
        hugging_face.build(model, manifest)


CAUSAL = [family for family, (task, _) in FAMILIES.items() if task == "causal-lm" and family != "falcon-alibi"]


@pytest.mark.parametrize("family", CAUSAL)
def test_each_causal_family_gives_packed_examples_their_logits_alone(family):
    """docs/models.md's causal LM families (tests/test_hf_families.py's tiny configs, Mistral with a sliding
    window of 8), two examples longer than that window packed with padding after them: each example's
    logits are those it has alone, with the attention build_artifacts gives the family."""
    config = FAMILIES[family][1]()
    config.use_cache = False
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=hugging_face.attention(config.model_type)).eval()
    window = hugging_face.packing_window(hf, Path(family))
    first, second = torch.randint(3, 200, (12,)), torch.randint(3, 200, (14,))
    ids = torch.cat([first, second, torch.zeros(4, dtype=torch.int64)])[None]
    positions = torch.cat([torch.arange(12), torch.arange(14), torch.arange(4)])[None]
    with torch.no_grad():
        packed = hf(input_ids=ids, position_ids=positions,
                    attention_mask=hugging_face.packed_mask(positions, window)).logits[0]
        alone = [hf(input_ids=example[None]).logits[0] for example in (first, second)]
    assert largest(packed[:12].numpy(), alone[0].numpy()) < 1e-6
    assert largest(packed[12:26].numpy(), alone[1].numpy()) < 1e-6

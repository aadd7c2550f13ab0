"""The decoder written from a Llama-structured model's or a GPT-2's weights (generation/written.py): its
graph is the model builder's kind (GroupQueryAttention, fused Q/K/V, no mask or shape arithmetic per
layer), it gives the same logits whether a batch is padded on the left (ortflow's generate,
transformers', optimum's) or on the right, a sliding window (mistral's) is transformers', and the
families of another structure keep the traced export. Greedy generation against transformers':
tests/test_generation.py (gpt2, llama and the built-in gpt in the fast loop, mistral and qwen2 as e2e)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import transformers

from ortflow.generation import folder as generation_folder
from ortflow.generation import written
from ortflow.generation.check import GenerationCheck
from ortflow.generation.generate import Decoder
from test_generation import prompts, tiny
from test_hf_families import DECODER, FAMILIES

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: why one thread


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def folder(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    source, _ = tiny(request.param, root)
    generation_folder.export_folder(source, root / "generation")
    return request.param, root / "generation"


def test_graph_is_the_builders_kind(folder):
    family, folder = folder
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    kinds = [node.op_type for node in graph.node]
    layers = 2
    assert kinds.count("GroupQueryAttention") == layers
    assert kinds.count("RotaryEmbedding") == (2 * layers if family == "llama" else 0)
    # Q/K/V in one MatMul, the output projection and the MLP's (gate, up and down; GPT-2's two) a
    # layer; the output layer
    assert kinds.count("MatMul") == (5 if family == "llama" else 4) * layers + 1
    skip = "SkipSimplifiedLayerNormalization" if family == "llama" else "SkipLayerNormalization"
    assert kinds.count(skip) == 2 * layers
    assert "Where" not in kinds and "Expand" not in kinds  # no per-layer mask
    assert len(kinds) < 60
    assert [value.name for value in graph.input][:3] == ["input_ids", "attention_mask", "position_ids"]
    assert [value.name for value in graph.output] == ["logits", *(f"present.{layer}.{part}" for layer in range(layers)
                                                                  for part in ("key", "value"))]


def run_padded(decoder: Decoder, batch: list[list[int]], left: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each row's logits [batch, vocab] at its last prompt token and after one more token (id 7), the
    batch padded on the left or on the right."""
    longest = max(map(len, batch))
    ids = np.full((len(batch), longest), decoder.pad, np.int64)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(batch):
        where = slice(longest - len(prompt), None) if left else slice(0, len(prompt))
        ids[row, where], mask[row, where] = prompt, 1
    positions = np.where(mask == 1, mask.cumsum(-1) - 1, 1)
    logits, cache = decoder.run(ids, mask, positions, decoder.empty_cache(len(batch)))
    last = np.array([longest - 1 if left else len(prompt) - 1 for prompt in batch])
    first = logits[np.arange(len(batch)), last]
    mask = np.concatenate([mask, np.ones((len(batch), 1), np.int64)], -1)
    step, _ = decoder.run(np.full((len(batch), 1), 7, np.int64), mask,
                          np.array([[len(prompt)] for prompt in batch]), cache)
    return first, step[:, 0]


def test_left_and_right_padding_give_each_rows_logits_alone(folder):
    decoder = Decoder(folder[1], threads=1)
    batch = prompts([24, 9, 16])
    alone = [run_padded(decoder, [prompt], left=True) for prompt in batch]
    for left in (True, False):
        first, step = run_padded(decoder, batch, left)
        for row, (first_alone, step_alone) in enumerate(alone):
            np.testing.assert_allclose(first[row], first_alone[0], rtol=0, atol=1e-5)
            np.testing.assert_allclose(step[row], step_alone[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_is_transformers(family, tmp_path, monkeypatch):
    # mistral's window of 8 (test_hf_families.py) under a prompt of 24: with the operator's window one
    # wider, the tokens part from transformers' at the 7th step. qwen2's on its second layer alone.
    if family == "qwen2":
        monkeypatch.setitem(FAMILIES, family, (FAMILIES[family][0], lambda: transformers.Qwen2Config(
            **DECODER, use_sliding_window=True, sliding_window=8, max_window_layers=1)))
    source, _ = tiny(family, tmp_path)
    _, agreement = generation_folder.export_folder(source, tmp_path / "generation", GenerationCheck(
        prompts([24, 9]), 16, relative=1e-4, absolute=0.0))
    assert agreement.steps == 16


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt2", "opt"])
def test_only_llama_structured_families_are_written(family):
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family][1]())
    assert written.writable(model) == (family in {"llama", "mistral", "qwen2", "gpt2"})

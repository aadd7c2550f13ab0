"""Generation from the sequence-to-sequence export (issue 41; generation/seq2seq.py, seq2seq_export.py):
optimum's encoder_model.onnx, decoder_model.onnx and decoder_with_past_model.onnx, whose greedy tokens
in ONNX Runtime equal transformers' `generate(do_sample=False)` token for token, each step's logits
within 1e-4 relative, for two source lengths and a right-padded batch, on the tiny random-weight T5
and BART of tests/test_hf_families.py (2 layers, width 32), saved with save_pretrained as the export
stage saves export/transformers/."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from ortflow.errors import DataError, ModelError
from ortflow.generation.check import GenerationCheck
from ortflow.generation.generate import generate
from ortflow.generation.seq2seq import Seq2SeqDecoder, check_seq2seq
from ortflow.generation.seq2seq_export import export_seq2seq_folder, seq2seq_layout
from ortflow.models.hugging_face import attention
from test_hf_families import FAMILIES

NEW_TOKENS = 24
LOGITS_TOLERANCE = 1e-4  # relative to the step's largest logit
SOURCE_LENGTHS = (5, 17)
BATCH = (17, 6, 11)  # right-padded to 17


@pytest.fixture(autouse=True)
def one_thread():
    """torch on one thread, as tests/test_generation.py (its reason: shared cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sources(lengths, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 100, length).tolist() for length in lengths]


def strict(batch: list[list[int]]) -> GenerationCheck:
    return GenerationCheck(batch, NEW_TOKENS, relative=LOGITS_TOLERANCE, absolute=0.0)


@pytest.fixture(scope="module", params=["t5", "bart"])
def exported(request, tmp_path_factory):
    """The family's tiny model saved as export/transformers/, its generation folder (checked on the
    first source length), the model read back as its users read it, and that first agreement."""
    root = tmp_path_factory.mktemp(request.param)
    config = FAMILIES[request.param][1]()
    torch.manual_seed(0)
    transformers.AutoModelForSeq2SeqLM.from_config(config).save_pretrained(root / "transformers")
    agreement = export_seq2seq_folder(root / "transformers", root / "generation", strict(sources(SOURCE_LENGTHS[:1])))
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(
        root / "transformers", attn_implementation=attention(config.model_type)).eval()
    return root / "generation", model, agreement


def test_greedy_equals_transformers(exported):
    folder, model, first = exported
    agreements = [first, *(check_seq2seq(model, folder, strict(batch))
                           for batch in (sources(SOURCE_LENGTHS[1:]), sources(BATCH)))]
    assert [agreement.steps for agreement in agreements] == [NEW_TOKENS] * 3
    assert max(agreement.largest_error for agreement in agreements) <= LOGITS_TOLERANCE
    # An eos that the first row gives at its 6th step: that row stops there and is fed the padding, the
    # others go on, as in transformers' generate with that eos.
    decoder = Seq2SeqDecoder(folder, threads=1)
    decoder.eos = {generate(decoder, sources(BATCH), 6)[0][-1]}
    assert len(generate(decoder, sources(BATCH), NEW_TOKENS)[0]) <= 6
    (folder / "generation_config.json").write_text(json.dumps(
        json.loads((folder / "generation_config.json").read_text()) | {"eos_token_id": sorted(decoder.eos)}))
    model.generation_config.eos_token_id = sorted(decoder.eos)
    assert check_seq2seq(model, folder, strict(sources(BATCH))).steps <= NEW_TOKENS


def test_first_decoder_scores_a_whole_target(exported):
    """decoder_model.onnx fed a target of several tokens (as optimum may feed it) gives transformers'
    logits at every position: its self-attention is causal however it was traced."""
    import onnxruntime as ort

    folder, model, _ = exported
    source, target = torch.tensor(sources([7, 7])), torch.tensor(sources([4, 4], seed=2))
    mask = torch.ones_like(source)
    with torch.no_grad():
        states = model.get_encoder()(input_ids=source, attention_mask=mask).last_hidden_state
        expected = model(encoder_outputs=(states,), attention_mask=mask, decoder_input_ids=target).logits.numpy()
    session = ort.InferenceSession(str(folder / "decoder_model.onnx"))
    logits = session.run(["logits"], {"encoder_attention_mask": mask.numpy(), "input_ids": target.numpy(),
                                      "encoder_hidden_states": states.numpy()})[0]
    assert np.abs(logits - expected).max() <= LOGITS_TOLERANCE * np.abs(expected).max()

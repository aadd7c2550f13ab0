"""Generation from the sequence-to-sequence export (issue 41; generation/seq2seq.py, seq2seq_export.py):
optimum's encoder_model.onnx, decoder_model.onnx and decoder_with_past_model.onnx, whose greedy tokens
in ONNX Runtime equal transformers' `generate(do_sample=False)` token for token, each step's logits
within 1e-4 relative, for two source lengths and a right-padded batch, on the tiny random-weight T5
and BART of tests/test_hf_families.py (2 layers, width 32), saved with save_pretrained as the export
stage saves export/transformers/."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch
import transformers

from tokenizers import Tokenizer

from ortflow import cli
from ortflow.errors import ModelError
from ortflow.generation.check import GenerationCheck
from ortflow.generation.generate import Sampling, generate
from ortflow.generation.samples import samples
from ortflow.generation.seq2seq import Seq2SeqDecoder, check_seq2seq
from ortflow.generation.seq2seq_export import export_seq2seq_folder
from ortflow.models.hugging_face import attention
from test_hf_families import FAMILIES
from text_models import train_wordpiece

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: why one thread

NEW_TOKENS = 24
LOGITS_TOLERANCE = 1e-4  # relative to the step's largest logit
SOURCE_LENGTHS = (5, 17)
BATCH = (17, 6, 11)  # right-padded to 17
WORDS = ["red green blue cat dog bird runs sleeps eats big small old new fast slow"] * 4


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
    train_wordpiece(root / "transformers" / "tokenizer.json", config.vocab_size, WORDS)
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


def with_settings(exported, root, **settings):
    """A copy of the fixture's folder and model whose generation config has `settings` besides."""
    folder, model, _ = exported
    copied = shutil.copytree(folder, root / "generation")
    config = json.loads((copied / "generation_config.json").read_text())
    (copied / "generation_config.json").write_text(json.dumps(config | settings))
    model = copy.deepcopy(model)
    for key, value in settings.items():
        setattr(model.generation_config, key, value)
    return copied, model


def test_a_row_that_ends_is_padded_as_transformers_pads_it(exported, tmp_path):
    """An eos that the first row gives at its 6th step: that row stops there and is fed the padding,
    the others go on, as in transformers' generate with that eos."""
    eos = generate(Seq2SeqDecoder(exported[0], threads=1), sources(BATCH), 6)[0][-1]
    folder, model = with_settings(exported, tmp_path, eos_token_id=[eos])
    generated = generate(Seq2SeqDecoder(folder, threads=1), sources(BATCH), NEW_TOKENS)
    assert len(generated[0]) <= 6 and generated[0][-1] == eos
    assert check_seq2seq(model, folder, strict(sources(BATCH))).steps <= NEW_TOKENS


def test_forced_tokens_and_sampling_as_transformers(exported, tmp_path):
    """forced_bos_token_id and forced_eos_token_id (BART's config has one) are the first and the last
    of max_new_tokens, as transformers' processors make them; sampling from the top 1 is greedy."""
    folder, model = with_settings(exported, tmp_path, forced_bos_token_id=7, forced_eos_token_id=[9],
                                  eos_token_id=None)
    decoder = Seq2SeqDecoder(folder, threads=1)
    generated = generate(decoder, sources(BATCH), NEW_TOKENS)
    assert [(row[0], row[-1], len(row)) for row in generated] == [(7, 9, NEW_TOKENS)] * len(BATCH)
    assert check_seq2seq(model, folder, strict(sources(BATCH))).steps == NEW_TOKENS
    assert generate(decoder, sources(BATCH), NEW_TOKENS, Sampling(do_sample=True, top_k=1, seed=3)) == generated


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


def test_folder_is_what_optimum_loads(exported):
    """optimum's file names, inputs and outputs (ORTModelForSeq2SeqLM: modeling_seq2seq.py) at an opset
    and IR that ONNX Runtime 1.19.2 loads, config.json with its cache on, and the tokenizer."""
    import onnx

    folder, model, _ = exported
    layers = model.config.num_layers if model.config.model_type == "t5" else model.config.decoder_layers
    past = [f"past_key_values.{i}.{part}.{tensor}" for i in range(layers) for part in ("decoder", "encoder")
            for tensor in ("key", "value")]
    names = {}
    for name in ("encoder_model", "decoder_model", "decoder_with_past_model"):
        graph = onnx.load(str(folder / f"{name}.onnx"), load_external_data=False)
        assert graph.ir_version <= 10 and graph.opset_import[0].version <= 21
        names[name] = ([value.name for value in graph.graph.input], [value.name for value in graph.graph.output])
    assert names["encoder_model"] == (["input_ids", "attention_mask"], ["last_hidden_state"])
    steps = ["encoder_attention_mask", "input_ids", "encoder_hidden_states"]
    assert names["decoder_model"] == (steps, ["logits", *(name.replace("past_key_values", "present") for name in past)])
    assert names["decoder_with_past_model"] == (
        [*steps, *past], ["logits", *(name.replace("past_key_values", "present") for name in past if ".decoder." in name)])
    assert json.loads((folder / "config.json").read_text())["use_cache"] is True
    assert json.loads((folder / "generation_config.json").read_text())["decoder_start_token_id"] == \
        model.config.decoder_start_token_id
    assert Tokenizer.from_file(str(folder / "tokenizer.json")).encode("red cat").tokens == ["[CLS]", "red", "cat",
                                                                                          "[SEP]"]


def test_cli_and_samples_generate_what_generate_gives(exported, capsys):
    """`ortflow generate` takes the prompt as the source; samples.json's "before" (transformers on the
    same weights here) and "after" (the folder) are the same text."""
    folder, model, _ = exported
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    decoder = Seq2SeqDecoder(folder, threads=1)
    source = tokenizer.encode("big red dog runs").ids
    expected = [token for token in generate(decoder, [source], 12)[0] if token not in decoder.eos]
    assert cli.main(["generate", str(folder), "--prompt", "big red dog runs", "--max-new-tokens", "12",
                     "--threads", "1"]) == 0
    assert capsys.readouterr().out == tokenizer.decode(expected) + "\n"
    if model.config.model_type == "bart":  # 64 positions; T5's relative positions have no limit
        assert cli.main(["generate", str(folder), "--prompt", "red", "--max-new-tokens", "64"]) == 1
        assert capsys.readouterr().err == ("ortflow generate: error: generate: max_new_tokens=64 and the target's "
                                           "start token need 65 positions; the decoder has 64: ask for at most 63\n")
    written = samples(lambda: model, folder, [(source, [5, 6]), (source[:3], [7])], positions=64)
    assert [(sample.before, sample.expected) for sample in written.samples] == \
        [(sample.after, text) for sample, text in zip(written.samples, [tokenizer.decode([5, 6]),
                                                                         tokenizer.decode([7])])]
    assert written.samples[0].after == tokenizer.decode(generate(decoder, [source], 32)[0])


def test_a_family_it_cannot_export_is_refused_in_one_line(tmp_path):
    """ProphetNet's n-gram decoder keeps an EncoderDecoderCache too, but its traced decoders do not
    generate as it does: the check refuses it in one line, and no folder is left."""
    config = transformers.ProphetNetConfig(
        vocab_size=100, hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64, num_encoder_layers=2,
        num_decoder_layers=2, num_encoder_attention_heads=2, num_decoder_attention_heads=2, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, eos_token_id=3, decoder_start_token_id=0,
        max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.AutoModelForSeq2SeqLM.from_config(config).save_pretrained(tmp_path / "transformers")
    with pytest.raises(ModelError, match=r"^generation check: prompt 0's greedy tokens part from transformers' "
                                         r"generate at step \d+ \(\[[\d, ]+\]\.\.\. against"):
        export_seq2seq_folder(tmp_path / "transformers", tmp_path / "generation", strict(sources((9, 4))))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["transformers"]


def test_the_end_of_run_summary_gives_the_generate_command(tmp_path):
    from ortflow.reporting.summary import exported_lines

    (tmp_path / "generation").mkdir()
    (tmp_path / "generation/encoder_model.onnx").write_bytes(b"")
    (tmp_path / "model.onnx").write_bytes(b"")
    assert exported_lines(tmp_path / "model.onnx", None)[1] == (
        f"  generate  ortflow generate {tmp_path / 'generation'} --prompt 'your text' (an encoder and decoders "
        "with a KV cache in ONNX Runtime)")


def test_external_data_folder_checks_and_loads(tmp_path, monkeypatch):
    """Files whose weights go to external data (a model over external_data's threshold, here 0 bytes):
    each of the three has its own .data beside it, and the folder passes the check from there."""
    monkeypatch.setenv("ORTFLOW_EXTERNAL_DATA_BYTES", "0")
    torch.manual_seed(0)
    transformers.AutoModelForSeq2SeqLM.from_config(FAMILIES["bart"][1]()).save_pretrained(tmp_path / "transformers")
    agreement = export_seq2seq_folder(tmp_path / "transformers", tmp_path / "generation", strict(sources(BATCH)))
    assert agreement.steps == NEW_TOKENS
    embedding = 100 * 32 * 4  # the vocabulary's float32 rows, in every file
    for name in ("encoder_model", "decoder_model", "decoder_with_past_model"):
        assert (tmp_path / "generation" / f"{name}.onnx.data").stat().st_size >= embedding

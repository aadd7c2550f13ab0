"""Generation from the exported decoder with a KV cache (issue 41; ortflow.generation): greedy
tokens equal to transformers' `generate(do_sample=False)` token for token and each step's logits
within 1e-4 relative, for two prompt lengths and a left-padded batch, on the tiny random-weight
models of tests/test_hf_families.py (2 layers, width 32, bytes), saved with save_pretrained as the
export stage saves export/transformers/. gpt2 and llama run in the fast loop, the other causal
families as e2e; a family whose cache has no key/value layout is refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer

from ortflow import cli, hugepages

from ortflow.data.shards import ShardReader
from ortflow.errors import DataError, ModelError
from ortflow.generation import folder as generation_folder
from ortflow.generation.check import GenerationCheck, check_generation
from ortflow.generation.generate import Decoder, Sampling, generate, left_padded, steps, warp
from ortflow.models.hugging_face import attention
from ortflow.models.save_trained import POSITIONS
from test_hf_families import FAMILIES

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: why one thread

NEW_TOKENS = 64
POSITIONS_TRIED = 128  # the families' tiny configs have 64 positions: a prompt and 64 new tokens need more
LOGITS_TOLERANCE = 1e-4  # relative to the step's largest logit
EOS = 0  # in the byte vocabulary (GPT-2's 50256 is not); the prompts never contain it
PROMPT_LENGTHS = (5, 24)
BATCH = (24, 9, 16)  # left-padded to 24


def tiny(family: str, root):
    """The family's tiny causal LM, weights drawn from seed 0, saved as export/transformers/ is;
    returns the folder and the model read back from it as transformers users read it."""
    config = FAMILIES[family][1]()
    for key in POSITIONS:
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, POSITIONS_TRIED)
    config.bos_token_id = config.eos_token_id = EOS
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention(config.model_type))
    model.generation_config.eos_token_id = model.generation_config.bos_token_id = EOS
    source = root / "transformers"
    model.save_pretrained(source)
    return source, transformers.AutoModelForCausalLM.from_pretrained(source).eval()


def prompts(lengths, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, length).tolist() for length in lengths]


def strict(batch: list[list[int]], new_tokens: int = NEW_TOKENS) -> GenerationCheck:
    return GenerationCheck(batch, new_tokens, relative=LOGITS_TOLERANCE, absolute=0.0)


def check_family(family: str, tmp_path) -> None:
    source, model = tiny(family, tmp_path)
    batches = [prompts([PROMPT_LENGTHS[0]]), prompts([PROMPT_LENGTHS[1]]), prompts(BATCH)]
    layout, agreement = generation_folder.export_folder(source, tmp_path / "generation", strict(batches[0]))
    decoder = Decoder(tmp_path / "generation", threads=1)
    assert (decoder.layers, decoder.kv_heads, decoder.head_dim) == (layout.layers, layout.kv_heads, layout.head_dim)
    agreements = [agreement, *(check_generation(model, decoder, strict(batch)) for batch in batches[1:])]
    assert [agreement.steps for agreement in agreements] == [NEW_TOKENS] * len(batches)
    assert max(agreement.largest_error for agreement in agreements) <= LOGITS_TOLERANCE
    # An eos that the first row gives at its 10th step: that row stops there, the others go on.
    decoder.eos = {generate(decoder, prompts(BATCH), 10)[0][-1]}
    assert generate(decoder, prompts(BATCH), NEW_TOKENS)[0][-1] in decoder.eos
    check_generation(model, decoder, strict(prompts(BATCH)))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_greedy_equals_transformers(family, tmp_path):
    check_family(family, tmp_path)


@pytest.mark.e2e
@pytest.mark.parametrize("family", ["gpt-neo", "opt", "mistral", "qwen2", "qwen3", "phi3", "gemma", "falcon"])
def test_greedy_equals_transformers_in_every_family(family, tmp_path):
    check_family(family, tmp_path)


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    """gpt2's tiny model as export/transformers/ without a tokenizer (it reads bytes), and its
    generation folder."""
    root = tmp_path_factory.mktemp("gpt2")
    source, _ = tiny("gpt2", root)
    generation_folder.export_folder(source, root / "generation")
    return root / "generation"


def test_folder_has_what_optimum_and_genai_read(gpt2_folder):
    import onnx

    model = onnx.load(str(gpt2_folder / "model.onnx"), load_external_data=False)
    assert model.ir_version <= 10 and model.opset_import[0].version <= 21  # what ONNX Runtime 1.19.2 loads
    assert [value.name for value in model.graph.input][:3] == ["input_ids", "attention_mask", "position_ids"]
    logits = model.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in logits] == ["batch", "sequence", 256]
    assert json.loads((gpt2_folder / "config.json").read_text())["use_cache"] is True
    assert json.loads((gpt2_folder / "generation_config.json").read_text())["eos_token_id"] == EOS
    text = "héllo wörld ☃\n\tend"
    tokenizer = Tokenizer.from_file(str(gpt2_folder / "tokenizer.json"))
    assert tokenizer.encode(text).ids == list(text.encode()) and tokenizer.decode(list(text.encode())) == text
    genai = json.loads((gpt2_folder / "genai_config.json").read_text())
    decoder = genai["model"]["decoder"]
    assert (decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]) == (2, 2, 16)
    assert decoder["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert decoder["outputs"]["present_value_names"] == "present.%d.value"
    assert (genai["model"]["context_length"], genai["model"]["eos_token_id"], genai["model"]["type"]) == \
        (POSITIONS_TRIED, EOS, "decoder")  # not "gpt2": folder.GENAI_TYPES
    assert genai["search"]["past_present_share_buffer"] is False


def test_prompt_longer_than_positions_refused(gpt2_folder):
    decoder = Decoder(gpt2_folder, threads=1)
    with pytest.raises(DataError) as refused:
        generate(decoder, prompts([100]), 64)
    assert str(refused.value) == ("generate: a prompt of 100 tokens and max_new_tokens=64 need 164 positions; the "
                                  "model has 128: shorten the prompt or ask for at most 28 new tokens")
    with pytest.raises(DataError, match="at least one token"):
        generate(decoder, [[]], 4)


def test_family_without_key_value_cache_refused(tmp_path):
    config = transformers.MambaConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, state_size=4)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ModelError) as refused:
        generation_folder.write_folder(lambda: (model, None), tmp_path / "generation")
    assert "\n" not in str(refused.value)
    assert str(refused.value).startswith("MambaForCausalLM (mamba) keeps its generation cache as DynamicCache of ")
    assert str(refused.value).endswith("ortflow cannot export it as a decoder with a KV cache")
    assert list(tmp_path.iterdir()) == []  # nothing written half


def test_warping_equals_transformers_processors():
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    logits = np.random.default_rng(0).normal(size=(3, 256)).astype(np.float32) * 3
    for temperature, top_k, top_p in [(0.7, 50, 1.0), (1.0, 0, 0.9), (1.3, 20, 0.5), (0.5, 256, 0.3)]:
        ours = warp(logits, Sampling(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p))
        theirs = torch.from_numpy(logits)
        for processor in [TemperatureLogitsWarper(temperature), *([TopKLogitsWarper(top_k)] if top_k else []),
                          *([TopPLogitsWarper(top_p)] if top_p < 1 else [])]:
            theirs = processor(None, theirs)
        theirs = theirs.double().numpy()
        assert np.array_equal(np.isinf(ours), np.isinf(theirs))
        assert np.allclose(ours[~np.isinf(ours)], theirs[~np.isinf(theirs)], rtol=1e-6)
        assert 0 < (~np.isinf(ours)).sum(-1).min()


def test_sampling_follows_seed_and_warping(gpt2_folder):
    decoder = Decoder(gpt2_folder, threads=1)
    batch = prompts(BATCH)
    greedy = generate(decoder, batch, 16)
    assert generate(decoder, batch, 16, Sampling(do_sample=True, top_k=1, seed=3)) == greedy
    sampled = [generate(decoder, batch, 16, Sampling(do_sample=True, temperature=2.0, seed=seed)) for seed in (1, 1, 2)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2] and sampled[0] != greedy
    # streaming: each step's tokens come as they are chosen, one per row
    streamed = [step.tokens for step in steps(decoder, batch, 16)]
    assert np.stack(streamed, 1).tolist() == greedy


def test_tokenizer_files_copied(tmp_path):
    source, folder = tmp_path / "transformers", tmp_path / "generation"
    source.mkdir(), folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json", "model.safetensors"):
        (source / name).write_text(name)
    generation_folder.copy_tokenizer(source, folder)
    assert sorted(path.name for path in folder.iterdir()) == ["chat_template.jinja", "tokenizer.json",
                                                              "tokenizer_config.json"]


def test_the_console_script_generates_on_huge_pages(gpt2_folder, tmp_path):
    """`ortflow generate` as its own process re-executes itself with glibc's hugetlb tunable where
    the kernel gives huge pages on request (hugepages.py), and says how much memory is on them.
    The process it becomes does not import an `ortflow.py` from where it runs."""
    (tmp_path / "ortflow.py").write_text("raise SystemExit('a planted ortflow.py was imported')\n")
    command = [str(Path(sys.executable).parent / "ortflow"), "generate", str(gpt2_folder), "--prompt", "hello",
               "--max-new-tokens", "4", "--threads", "1"]
    plain = {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"}
    done = subprocess.run(command, env=plain, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(line for line in done.stderr.splitlines() if "resident on huge pages" in line)
    on_huge_pages = float(line.split("decoder loaded: ")[1].split()[0])
    if hugepages.wanted(plain):  # THP "madvise" and glibc >= 2.35 (this project's machines)
        assert "GLIBC_TUNABLES='glibc.malloc.hugetlb=1'" in line and on_huge_pages > 0
    turned_off = subprocess.run(command, env=dict(plain, GLIBC_TUNABLES="glibc.malloc.hugetlb=0"), cwd=tmp_path,
                                capture_output=True, text=True, check=True)
    assert "GLIBC_TUNABLES='glibc.malloc.hugetlb=0'" in turned_off.stderr and turned_off.stdout == done.stdout


def test_hugepages_wanted_only_where_the_kernel_asks_and_glibc_can(tmp_path, monkeypatch):
    mode = tmp_path / "enabled"
    monkeypatch.setattr(hugepages, "THP_MODE", mode)
    monkeypatch.setattr(hugepages, "glibc_version", lambda: (2, 36))
    for text, wanted in [("always [madvise] never", True), ("[always] madvise never", False),
                         ("always madvise [never]", False)]:
        mode.write_text(text + "\n")
        assert hugepages.wanted({}) is wanted, text
    mode.write_text("always [madvise] never\n")
    assert not hugepages.wanted({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    monkeypatch.setattr(hugepages, "glibc_version", lambda: (2, 31))  # before the tunable
    assert not hugepages.wanted({})
    environ = hugepages.with_hugepages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "HOME": "/root"})
    assert environ == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "HOME": "/root"}


def test_cli_streams_what_generate_gives(gpt2_folder, capsys):
    decoder = Decoder(gpt2_folder, threads=1)
    expected = [token for token in generate(decoder, [list("hello".encode())], 12)[0] if token not in decoder.eos]
    command = ["generate", str(gpt2_folder), "--prompt", "hello", "--max-new-tokens", "12", "--threads", "1"]
    assert cli.main(command) == 0
    text = Tokenizer.from_file(str(gpt2_folder / "tokenizer.json")).decode(expected)
    assert capsys.readouterr().out == text + "\n"
    assert cli.main(["generate", str(gpt2_folder), "--prompt", "x" * 200]) == 1
    error = capsys.readouterr().err
    assert error == ("ortflow generate: error: generate: a prompt of 200 tokens leaves no room for a new token in "
                     "the model's 128 positions; shorten it to at most 127\n")


def test_external_data_folder_generates_the_same(gpt2_folder, tmp_path, monkeypatch):
    """A decoder whose weights go to model.onnx.data (a model over external_data's threshold, here 0
    bytes) loads from its folder and gives the same tokens."""
    monkeypatch.setenv("ORTFLOW_EXTERNAL_DATA_BYTES", "0")
    source, _ = tiny("gpt2", tmp_path)
    generation_folder.export_folder(source, tmp_path / "generation")
    assert (tmp_path / "generation" / "model.onnx.data").stat().st_size > (tmp_path / "generation" /
                                                                            "model.onnx").stat().st_size
    batch = prompts(BATCH)
    assert generate(Decoder(tmp_path / "generation", threads=1), batch, 16) == \
        generate(Decoder(gpt2_folder, threads=1), batch, 16)


def test_gpt2_with_its_config_defaults_exports_and_checks(tmp_path):
    """GPT-2's config defaults, which tiny() overrides: dropout 0.1, and end-of-text 50256 beyond a byte
    vocabulary. torch.onnx.export gives the module it traces its own mode back when it ends: the model
    stays in eval mode for the check's generate after the export (in training mode transformers' tokens
    changed from run to run); the padding id is one of the vocabulary (50256 fails the embedding's lookup)."""
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=256, n_positions=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    generation_folder.write_folder(lambda: (model, None), tmp_path / "generation", strict(prompts([6, 3]), 8))
    assert not [name for name, module in model.named_modules() if module.training]
    assert json.loads((tmp_path / "generation/genai_config.json").read_text())["model"]["pad_token_id"] == 0


def test_the_model_is_let_go_before_the_decoders_session_opens(tmp_path, monkeypatch):
    """write_folder runs transformers' generate for the check first and drops the model before it opens
    the decoder's session: the two never hold the weights together (tests/test_external_data.py)."""
    import weakref

    source, _ = tiny("gpt2", tmp_path)
    built, alive_at_session = [], []

    def load():
        model = transformers.AutoModelForCausalLM.from_pretrained(source)
        built.append(weakref.ref(model))
        return model, None

    def decoder(*args, **kwargs):
        alive_at_session.append(built[0]() is not None)
        return Decoder(*args, **kwargs)

    monkeypatch.setattr(generation_folder, "Decoder", decoder)
    _, agreement = generation_folder.write_folder(load, tmp_path / "generation", strict(prompts([6, 3]), 8))
    assert alive_at_session == [False] and agreement.steps == 8


def test_check_refuses_another_model(gpt2_folder, tmp_path):
    """The check fails on a decoder that is not the model's: a token apart, or logits beyond the tolerance."""
    _, model = tiny("gpt2", tmp_path)
    decoder = Decoder(gpt2_folder, threads=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.001)  # the tied embedding too: every logit moves a little
    with pytest.raises(ModelError, match=r"^generation check: step 0's logits differ from transformers' by "):
        check_generation(model, decoder, strict(prompts(BATCH), 8))
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.normal_()
    with pytest.raises(ModelError, match=r"^generation check: prompt \d's greedy tokens part from transformers' "):
        check_generation(model, decoder, strict(prompts(BATCH), 8))
    # refused by the export itself, the folder is not written
    with pytest.raises(ModelError, match=r"^generation check: step 0's logits differ"):
        impossible = GenerationCheck(prompts([4]), 2, relative=-1.0, absolute=0.0)
        generation_folder.write_folder(lambda: (model, None), tmp_path / "generation", impossible)
    assert not (tmp_path / "generation").exists()


def test_check_is_greedy_whatever_the_generation_config_asks(gpt2_folder, tmp_path):
    """A generation_config.json asking for beams, a repetition penalty, an n-gram ban and a minimum
    length (bart-large-cnn's and many chat models' do): transformers' generate(do_sample=False)
    follows it and parts from greedy steps, and the check still compares the greedy steps the
    folder's decoder runs."""
    _, model = tiny("gpt2", tmp_path)
    decoder = Decoder(gpt2_folder, threads=1)
    batch = prompts(BATCH)
    ids, mask = (torch.from_numpy(array) for array in left_padded(batch, decoder.pad))

    def tokens():
        return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8,
                              pad_token_id=decoder.pad).tolist()

    plain, greedy = check_generation(model, decoder, strict(batch, 8)), tokens()
    model.generation_config.update(num_beams=3, repetition_penalty=3.0, no_repeat_ngram_size=2, min_new_tokens=8)
    assert tokens() != greedy  # what the config asks changes transformers' own generate
    assert check_generation(model, decoder, strict(batch, 8)) == plain


def test_cli_samples_with_the_models_defaults(gpt2_folder, capsys):
    """--do-sample without --top-k takes the folder's (genai_config's search, from generation_config):
    top_k 1 there makes sampling greedy."""
    decoder = Decoder(gpt2_folder, threads=1)
    greedy = Tokenizer.from_file(str(gpt2_folder / "tokenizer.json")).decode(
        [token for token in generate(decoder, [list(b"hello")], 12)[0] if token not in decoder.eos])
    command = ["generate", str(gpt2_folder), "--prompt", "hello", "--max-new-tokens", "12", "--do-sample",
               "--temperature", "5", "--seed", "0"]
    assert cli.main(command) == 0
    assert capsys.readouterr().out != greedy + "\n"
    genai = json.loads((gpt2_folder / "genai_config.json").read_text())
    (gpt2_folder / "genai_config.json").write_text(json.dumps({**genai, "search": {**genai["search"], "top_k": 1}}))
    try:
        assert cli.main(command) == 0
    finally:
        (gpt2_folder / "genai_config.json").write_text(json.dumps(genai))
    assert capsys.readouterr().out == greedy + "\n"


def test_cli_writes_out_and_takes_the_prompts_of_the_configs_generate_section(gpt2_folder, tmp_path, capsys):
    """What the workflow's generate rule runs: the prompts from --config-json's generate section, each
    continuation printed and written with its prompt to --out (JSON Lines); without a prompt, one line."""
    assert cli.main(["generate", str(gpt2_folder), "--prompt", "hello", "--max-new-tokens", "12",
                     "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "prompts.txt").write_text("hello\n\nwhat\n")
    for section, prompts in (({"prompt": "hello"}, ["hello"]), ({"prompts": str(tmp_path / "prompts.txt")},
                                                                ["hello", "what"])):
        command = ["generate", str(gpt2_folder), "--config-json",
                   json.dumps({"generate": {**section, "max_new_tokens": 12}}),
                   "--out", str(tmp_path / "generated.jsonl"), "--threads", "1"]
        assert cli.main(command) == 0
        lines = [json.loads(line) for line in (tmp_path / "generated.jsonl").read_text().splitlines()]
        assert lines[0] == {"prompt": "hello", "text": printed[:-1]} and len(printed) > 1
        assert [line["prompt"] for line in lines] == prompts
        assert capsys.readouterr().out.startswith(printed)
    assert cli.main(["generate", str(gpt2_folder), "--config-json", '{"generate": {}}']) == 1
    assert capsys.readouterr().err == (
        "ortflow generate: error: generate: no prompt: give --prompt or --prompts (in the workflow: snakemake "
        "generate --config generate='{prompt: your text}', or generate='{prompts: a file, one a line}')\n")


@pytest.mark.parametrize("tied", [True, False])
def test_built_in_gpt_is_the_gpt2_it_maps_to(tied):
    """models/gpt.as_gpt2: transformers' GPT-2 with the built-in gpt's weights computes its logits
    (every weight drawn, biases and LayerNorms too, so that a transposed or misplaced one shows),
    the head tied to the embedding where the gpt's is."""
    from ortflow.models.gpt import GPT, as_gpt2

    torch.manual_seed(0)
    gpt = GPT(256, 16, 32, 2, 2, tied).eval()
    for parameter in gpt.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    model = as_gpt2(gpt)
    ids = torch.randint(0, 256, (3, 16))
    with torch.no_grad():
        ours, theirs = gpt(ids).transpose(1, 2), model(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() < 1e-5 * ours.abs().max().item()
    assert (model.lm_head.weight is model.transformer.wte.weight) is tied
    assert (model.config.n_positions, model.config.n_layer, model.config.n_head, model.config.eos_token_id) == \
        (16, 2, 2, None)


GPT_CONTEXT = 96  # a prompt of 16 bytes and 64 new ones fit


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    """A tiny built-in gpt (2 layers, width 32) on bytes of Python's documentation, through
    prepare_data, build_artifacts and export_model (test_save_trained.exported: the merged checkpoint
    is the initial one plus noise); returns the export folder and the trained gpt in torch."""
    import logging

    from test_save_trained import exported
    from text_models import pydoc_text

    from ortflow import config as config_mod
    from ortflow.graphs.forward_model import torch_module
    from ortflow.models.save_trained import load_trained

    work = tmp_path_factory.mktemp("gpt")
    (work / "corpus.txt").write_text(pydoc_text()[:20_000])
    data = {"source": "text", "text_path": str(work / "corpus.txt"), "context": GPT_CONTEXT}
    model = {"kind": "gpt", "layers": 2, "heads": 2, "width": 32}
    records, logger = [], logging.getLogger("ortflow")
    handler, level = logging.Handler(logging.INFO), logger.level
    handler.emit = lambda record: records.append(record.getMessage())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        export = exported(work, data, model)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    config = config_mod.load(overrides={"run": {"name": "x"}, "data": {"shards": 1, **data}, "model": model})
    gpt = torch_module(config.model, ShardReader(work / "data/eval").manifest, "cross_entropy", config.run.seed)
    load_trained(gpt, work / "checkpoint")
    return export, gpt.eval(), "\n".join(records), ShardReader(work / "data/eval", raw=True)


def rerun_greedy(gpt, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], np.ndarray]:
    """Greedy generation by the built-in gpt's full-sequence forward, re-run for every token: each
    row right-padded to the context (causal: the padding after a position does not change it), the
    next token the argmax at the row's last one; returns the tokens and each step's logits
    [steps, batch, vocab]."""
    rows, logits = [list(prompt) for prompt in prompts], []
    for _ in range(new_tokens):
        ids = torch.tensor([row + [0] * (gpt.context - len(row)) for row in rows])
        with torch.no_grad():
            out = gpt(ids).transpose(1, 2).numpy()
        step = np.stack([out[i, len(row) - 1] for i, row in enumerate(rows)])
        logits.append(step)
        for row, token in zip(rows, step.argmax(axis=1).tolist()):
            row.append(token)
    return [row[len(prompt):] for row, prompt in zip(rows, prompts)], np.stack(logits)


def test_built_in_gpt_generation_equals_its_full_sequence_rerun(gpt_run):
    """export/generation/ of a built-in gpt run: GPT-2's folder with a byte-level tokenizer; its
    decoder's greedy 64 tokens from eval prompts of 16 and 8 bytes (one batch, left-padded) are the
    built-in model's argmax re-run on the whole sequence, each step's logits within the export's
    tolerance; the export logged its own check against transformers' generate."""
    from ortflow.export.checks import TOLERANCE

    export, gpt, log, reader = gpt_run
    folder = export / "generation"
    assert sorted(path.name for path in folder.iterdir()) == ["config.json", "genai_config.json",
                                                              "generation_config.json", "model.onnx", "tokenizer.json",
                                                              "tokenizer_config.json"]
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["n_positions"], config["activation_function"], config["use_cache"]) == \
        ("gpt2", GPT_CONTEXT, "gelu", True)
    assert (f"{folder}: greedy generation in ONNX Runtime (64 steps of at most 64 new tokens) from 4 eval prompts "
            "of 16 and 8 tokens, left-padded, equals transformers' generate token for token") in log
    windows = reader.gather(np.arange(4))["x"]
    batch = [windows[row, :16 if row % 2 == 0 else 8].tolist() for row in range(4)]
    decoder = Decoder(folder, threads=1)
    assert decoder.eos == set()  # bytes have no end-of-text: every row runs to max_new_tokens
    steps_logits = []
    tokens = generate(decoder, batch, NEW_TOKENS, on_step=lambda step: steps_logits.append(step.logits))
    expected, expected_logits = rerun_greedy(gpt, batch, NEW_TOKENS)
    assert tokens == expected and len(tokens[0]) == NEW_TOKENS
    scale = np.abs(expected_logits).max(axis=(1, 2), keepdims=True)
    assert (np.abs(np.stack(steps_logits) - expected_logits) <= TOLERANCE["relative"] * scale
            + TOLERANCE["absolute"]).all()


def test_built_in_gpt_samples_and_cli(gpt_run, capsys):
    """export/samples.json of the gpt run: each eval prompt's "after" is the trained gpt's own greedy
    text (its full-sequence re-run), "before" the starting weights'; `ortflow generate` streams the
    trained gpt's greedy bytes from the folder."""
    export, gpt, _, _ = gpt_run
    samples = json.loads((export / "samples.json").read_text())
    assert samples["max_new_tokens"] == 32 and len(samples["samples"]) == 3
    for sample in samples["samples"]:
        prompt = list(sample["prompt"].encode())
        assert len(prompt) == 16 and len(sample["expected"].encode()) == 32
        tokens, _ = rerun_greedy(gpt, [prompt], 32)
        assert sample["after"] == bytes(tokens[0]).decode(errors="replace")
    assert any(sample["before"] != sample["after"] for sample in samples["samples"])
    tokens, _ = rerun_greedy(gpt, [list(b"The for statement")], 20)
    command = ["generate", str(export / "generation"), "--prompt", "The for statement", "--max-new-tokens", "20",
               "--threads", "1"]
    assert cli.main(command) == 0
    assert capsys.readouterr().out == bytes(tokens[0]).decode(errors="replace") + "\n"


def test_built_in_gpt_int4_scores_what_the_gpt_scores(gpt_run, tmp_path, monkeypatch):
    """export.int4 on the gpt run's folder (quantize_model's step): its 8 block MatMuls and the tied
    head quantized, weights under 0.2x fp32's bytes, and the fp32 side's perplexity the built-in
    gpt's own on the same eval windows (its cross-entropy at every position but the last)."""
    from test_int4 import export_settings

    from ortflow.quantization import int4_measure

    monkeypatch.setattr(int4_measure, "SPEED_ROUNDS", 1)
    export, gpt, _, reader = gpt_run
    entry = int4_measure.write_int4(export_settings(), export / "generation", tmp_path / "generation-int4", reader,
                                    tmp_path / "scratch")
    assert entry["weights_quantized"] == 9 and entry["weight_ratio"] < 0.2
    batch = reader.gather(np.arange(entry["records"]))
    with torch.no_grad():
        logits = gpt(torch.from_numpy(batch["x"]))[:, :, :-1]
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(batch["y"][:, :-1]))
    assert entry["fp32"]["perplexity"] == pytest.approx(float(loss.exp()), rel=1e-4)
    assert np.isfinite(entry["int4"]["perplexity"])


def test_built_in_gpt_with_data_tokenizer_generates_its_tokens(tmp_path):
    """A gpt on data.tokenizer's ids (a byte-level BPE with <|endoftext|> after each document): its
    generation folder holds that tokenizer, whose end-of-text id ends a generation; `ortflow
    generate`'s prompt is encoded as the data were, and the decoder's greedy tokens are the built-in
    model's full-sequence re-run up to that id."""
    from test_save_trained import exported
    from text_models import pydoc_text, train_bpe

    from ortflow import config as config_mod
    from ortflow.graphs.forward_model import torch_module
    from ortflow.models.save_trained import load_trained

    trained = train_bpe(tmp_path / "tokenizer.json")
    (tmp_path / "corpus.txt").write_text(pydoc_text()[:20_000])
    data = {"source": "text", "text_path": str(tmp_path / "corpus.txt"), "context": 32,
            "tokenizer": str(tmp_path / "tokenizer.json")}
    model = {"kind": "gpt", "layers": 1, "heads": 2, "width": 16}
    folder = exported(tmp_path, data, model) / "generation"
    eos = trained.token_to_id("<|endoftext|>")
    assert json.loads((folder / "genai_config.json").read_text())["model"]["eos_token_id"] == eos
    assert json.loads((folder / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    prompt = Tokenizer.from_file(str(folder / "tokenizer.json")).encode("The for statement").ids
    assert prompt == trained.encode("The for statement").ids
    config = config_mod.load(overrides={"run": {"name": "x"}, "data": {"shards": 1, **data}, "model": model})
    gpt = torch_module(config.model, ShardReader(tmp_path / "data/eval").manifest, "cross_entropy", config.run.seed)
    load_trained(gpt, tmp_path / "checkpoint")
    expected, _ = rerun_greedy(gpt.eval(), [prompt], 16)
    ended = expected[0][:expected[0].index(eos) + 1] if eos in expected[0] else expected[0]
    assert generate(Decoder(folder, threads=1), [prompt], 16) == [ended]

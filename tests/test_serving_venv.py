"""The generation folder where it is served: virtual environments of their own with onnxruntime >= 1.31
(which cannot share one with onnxruntime-training 1.19.2), installed for real.

The tiny gpt2 and llama of tests/test_generation.py, fp32 and int4, are loaded there by a plain
onnxruntime session (ortflow's generate, which needs numpy and onnxruntime only), by
onnxruntime-genai (og.Model on the folder, og.Generator, greedy) and by optimum's
ORTModelForCausalLM (`generate(do_sample=False)`). Their tokens must be transformers'
`generate(do_sample=False)` for fp32, and ortflow's generate in ONNX Runtime 1.19.2 for int4
(transformers has no int4 of the model). The export/optimum/ folders of a BERT classifier and tagger
(tests/test_ecosystem.py) are loaded by optimum's ORTModelFor<task>, their logits transformers'.
The sequence-to-sequence folders of a tiny T5 and BART (tests/test_seq2seq_generation.py) are loaded
by optimum's ORTModelForSeq2SeqLM, their greedy tokens and logits transformers'.
optimum-onnx pins transformers < 4.58 (ortflow's is 5): its environment is another one. Marked slow:
fresh, the installs took 83 s (genai, 216 MB on disk) and 213 s (optimum, 1.3 GB with the CPU build
of torch 2.13.0) on the development machine; the environments are kept in the cache folder
(ORTFLOW_TEST_CACHE, else ~/.cache/ortflow-tests) and reused by the next run, pip only checking them.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import REPO, environment
from ortflow.generation import folder as generation_folder
from ortflow.generation.check import transformers_greedy
from ortflow.generation.generate import Decoder, generate
from ortflow.quantization.int4 import Int4, quantize_folder
from test_generation import EOS, PROMPT_LENGTHS, prompts, tiny

GENAI = ["onnxruntime>=1.31", "onnxruntime-genai", "numpy"]
# torch 2.13.0: the CPU build on the machines' disk (pyproject.toml); optimum wants a torch, and any
# other version pulls a CUDA build of gigabytes.
OPTIMUM = ["onnxruntime>=1.31", "optimum-onnx", "torch==2.13.0", "numpy"]
NEW_TOKENS = 32

# Run in the serving environment: {folder: {"onnxruntime": tokens, "genai": tokens, "versions": ...}}.
GENERATE = """
import json, sys
import onnxruntime, onnxruntime_genai as og
from ortflow.generation.generate import Decoder, generate

folders, prompts, new_tokens = json.loads(sys.argv[1])
found = {}
for folder in folders:
    decoder = Decoder(folder, threads=1)
    found[folder] = {"onnxruntime": [generate(decoder, [prompt], new_tokens)[0] for prompt in prompts], "genai": [],
                     "versions": [onnxruntime.__version__, og.__version__]}
    model = og.Model(folder)
    for prompt in prompts:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(prompt) + new_tokens)
        generator = og.Generator(model, params)
        generator.append_tokens(prompt)
        while not generator.is_done():
            generator.generate_next_token()
        found[folder]["genai"].append([int(token) for token in generator.get_sequence(0)][len(prompt):])
print(json.dumps(found))
"""

# Run in optimum's environment: {folder: {"optimum": tokens, "versions": ...}}; the end-of-sequence
# and padding tokens are the folder's generation_config's, as a user's generate takes them.
OPTIMUM_GENERATE = """
import json, sys
import onnxruntime, optimum.version, torch, transformers
from optimum.onnxruntime import ORTModelForCausalLM

folders, prompts, new_tokens = json.loads(sys.argv[1])
found = {}
for folder in folders:
    model = ORTModelForCausalLM.from_pretrained(folder, provider="CPUExecutionProvider")
    rows = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, pad_token_id=model.generation_config.eos_token_id)
        rows.append(out[0, len(prompt):].tolist())
    found[folder] = {"optimum": rows, "versions": f"onnxruntime {onnxruntime.__version__}, optimum "
                     f"{optimum.version.__version__}, transformers {transformers.__version__}"}
print(json.dumps(found))
"""

# Run in optimum's environment: each export/optimum/ folder loaded by its ORTModelFor<task>, fed by the
# folder's own tokenizer (texts) or the given ids (an .npz): {folder: {"logits": ..., "feeds": ..., "versions"}}.
OPTIMUM_CLASSIFY = """
import json, sys
import numpy as np, onnxruntime, optimum.version, torch, transformers
from optimum import onnxruntime as ort_models
from transformers import AutoTokenizer

found = {}
for folder, loader, texts, ids in json.loads(sys.argv[1]):
    model = getattr(ort_models, loader).from_pretrained(folder, provider="CPUExecutionProvider")
    if texts:
        feeds = dict(AutoTokenizer.from_pretrained(folder)(texts, padding=True, return_tensors="pt"))
    else:
        feeds = {name: torch.from_numpy(array) for name, array in np.load(ids).items()}
    found[folder] = {"logits": model(**feeds).logits.tolist(),
                     "feeds": {name: tensor.tolist() for name, tensor in feeds.items()},
                     "versions": f"onnxruntime {onnxruntime.__version__}, optimum {optimum.version.__version__}, "
                                 f"transformers {transformers.__version__}"}
print(json.dumps(found))
"""
TEXTS = ["the woof said it", "the moo said loud here was it it loud", "the meow"]

# Run in optimum's environment: each sequence-to-sequence generation folder loaded by ORTModelForSeq2SeqLM,
# greedy from a right-padded batch of sources: {folder: {"tokens", "logits" [steps, batch, vocab], "versions"}}.
OPTIMUM_SEQ2SEQ = """
import json, sys
import onnxruntime, optimum.version, torch, transformers
from optimum.onnxruntime import ORTModelForSeq2SeqLM

folders, sources, mask, new_tokens = json.loads(sys.argv[1])
found = {}
for folder in folders:
    model = ORTModelForSeq2SeqLM.from_pretrained(folder, provider="CPUExecutionProvider")
    out = model.generate(input_ids=torch.tensor(sources), attention_mask=torch.tensor(mask), do_sample=False,
                         max_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True)
    found[folder] = {"tokens": out.sequences[:, 1:].tolist(), "logits": torch.stack(out.logits).tolist(),
                     "cache": model.decoder_with_past is not None,
                     "versions": f"onnxruntime {onnxruntime.__version__}, optimum {optimum.version.__version__}, "
                                 f"transformers {transformers.__version__}"}
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def genai_python() -> Path:
    return environment("genai-venv", GENAI)


@pytest.fixture(scope="module")
def optimum_python() -> Path:
    return environment("optimum-venv", OPTIMUM)


def before_eos(tokens: list[int], eos: int) -> list[int]:
    """The tokens before the first end-of-sequence: onnxruntime-genai 0.18 stops at it without
    putting it in the sequence, where transformers and ortflow keep it as the last token."""
    return tokens[:tokens.index(eos)] if eos in tokens else tokens


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def expected(request, tmp_path_factory) -> tuple[str, dict[str, list[list[int]]]]:
    """The family's fp32 and int4 generation folders, each with the greedy tokens it must give for
    each prompt: transformers' (fp32) and ortflow's generate in ONNX Runtime 1.19.2 (int4)."""
    torch.set_num_threads(1)  # test_generation's reason: on 2 shared cores, one thread is the fastest
    root = tmp_path_factory.mktemp(request.param)
    source, model = tiny(request.param, root)
    generation_folder.export_folder(source, root / "fp32")
    quantize_folder(root / "fp32", root / "int4", Int4())
    fp32, int4 = Decoder(root / "fp32", threads=1), Decoder(root / "int4", threads=1)
    batch = prompts(PROMPT_LENGTHS)
    return request.param, {
        str(root / "fp32"): [transformers_greedy(model, fp32.pad, fp32.eos, [prompt], NEW_TOKENS)[0][0]
                             for prompt in batch],
        str(root / "int4"): [generate(int4, [prompt], NEW_TOKENS)[0] for prompt in batch]}


def run_in(python: Path, script: str, folders: list[str]) -> dict:
    """`script`'s JSON, run by the environment's `python` on the folders, the prompts and NEW_TOKENS."""
    environment = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    result = subprocess.run([str(python), "-c", script, json.dumps([folders, prompts(PROMPT_LENGTHS), NEW_TOKENS])],
                            capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.slow
def test_onnxruntime_and_genai_generate_the_expected_tokens(expected, genai_python):
    family, tokens = expected
    found = run_in(genai_python, GENERATE, list(tokens))
    for folder, rows in tokens.items():
        print(f"{family} {Path(folder).name}: onnxruntime {found[folder]['versions'][0]}, onnxruntime-genai "
              f"{found[folder]['versions'][1]}: {sum(map(len, rows))} tokens equal")
        assert tuple(map(int, found[folder]["versions"][0].split(".")[:2])) >= (1, 31)
        assert found[folder]["onnxruntime"] == rows
        assert [before_eos(row, EOS) for row in found[folder]["genai"]] == [before_eos(row, EOS) for row in rows]


@pytest.mark.slow
def test_optimum_generates_the_expected_tokens(expected, optimum_python):
    family, tokens = expected
    found = run_in(optimum_python, OPTIMUM_GENERATE, list(tokens))
    for folder, rows in tokens.items():
        print(f"{family} {Path(folder).name}: {found[folder]['versions']}: {sum(map(len, rows))} tokens equal")
        assert found[folder]["optimum"] == rows


@pytest.mark.slow
def test_optimum_loads_the_classifier_and_tagger_folders(optimum_python, tmp_path):
    """export/optimum/ (export/ecosystem.py) of test_ecosystem's BERT classifier (texts through the folder's
    WordPiece tokenizer, loaded by optimum's transformers 4) and tagger (eval ids): ORTModelForSequenceClassification
    and ORTModelForTokenClassification load them as they are, and their logits are transformers' (5, this
    environment's) of export/transformers/ on the same inputs."""
    import numpy as np
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    from test_ecosystem import tagger
    from test_save_trained import animal_classifier, eval_records

    for name in ("classifier", "tagger"):
        (tmp_path / name).mkdir()
    classifier = animal_classifier(tmp_path / "classifier")[0]
    tags = tagger(tmp_path / "tagger")
    records = eval_records(tmp_path / "tagger")
    np.savez(tmp_path / "ids.npz", **{name: records[name] for name in ("input_ids", "attention_mask")})
    cases = [[str(classifier / "optimum"), "ORTModelForSequenceClassification", TEXTS, None],
             [str(tags / "optimum"), "ORTModelForTokenClassification", [], str(tmp_path / "ids.npz")]]
    result = subprocess.run([str(optimum_python), "-c", OPTIMUM_CLASSIFY, json.dumps(cases)], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    for (folder, loader, _, _), hf_class in zip(cases, [AutoModelForSequenceClassification,
                                                         AutoModelForTokenClassification]):
        feeds = {name: torch.tensor(value) for name, value in found[folder]["feeds"].items()}
        with torch.no_grad():
            expected = hf_class.from_pretrained(Path(folder).parent / "transformers")(**feeds).logits.numpy()
        logits = np.array(found[folder]["logits"], dtype=np.float32)
        worst = np.abs(logits - expected).max()
        print(f"{Path(folder).parent.parent.name}: {loader}, {found[folder]['versions']}: logits "
              f"{list(logits.shape)} within {worst:.3g} of transformers' (largest |logit| "
              f"{np.abs(expected).max():.3g})")
        assert logits.shape == expected.shape and worst < 1e-4 * np.abs(expected).max() + 1e-6
    # The classifier's texts went through the tokenizer as the model was trained: BERT's template, padded.
    assert set(found[cases[0][0]]["feeds"]) == {"input_ids", "token_type_ids", "attention_mask"}
    assert min(map(min, found[cases[0][0]]["feeds"]["attention_mask"])) == 0


@pytest.mark.slow
def test_optimum_generates_from_the_seq2seq_folders(optimum_python, tmp_path):
    """The generation folders of the tiny T5 and BART (generation/seq2seq_export.py): optimum's
    ORTModelForSeq2SeqLM loads them with the decoder with past (its cache on), and its greedy tokens and
    each step's logits from a right-padded batch of two sources are transformers' (5, this
    environment's) of export/transformers/. The tiny random models repeat a token, so the logits are
    what shows that the cache is read as it was written."""
    import numpy as np
    import transformers

    from ortflow.generation.seq2seq import Seq2SeqDecoder, right_padded, transformers_greedy
    from ortflow.generation.seq2seq_export import export_seq2seq_folder
    from test_hf_families import FAMILIES
    from test_seq2seq_generation import sources

    torch.set_num_threads(1)  # test_generation's reason
    batch, expected = sources((17, 6)), {}
    for family in ("t5", "bart"):
        torch.manual_seed(0)
        transformers.AutoModelForSeq2SeqLM.from_config(FAMILIES[family][1]()).save_pretrained(tmp_path / family)
        export_seq2seq_folder(tmp_path / family, tmp_path / family / "generation")
        model = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / family).eval()
        decoder = Seq2SeqDecoder(tmp_path / family / "generation")
        expected[str(tmp_path / family / "generation")] = transformers_greedy(model, decoder, batch, NEW_TOKENS)
    ids, mask = right_padded(batch, 0)
    result = subprocess.run([str(optimum_python), "-c", OPTIMUM_SEQ2SEQ,
                             json.dumps([list(expected), ids.tolist(), mask.tolist(), NEW_TOKENS])],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    for folder, (tokens, logits) in expected.items():
        got = np.array(found[folder]["logits"], dtype=np.float32)
        worst = np.abs(got - logits).max()
        print(f"{Path(folder).parent.name}: ORTModelForSeq2SeqLM, {found[folder]['versions']}: "
              f"{sum(map(len, tokens))} tokens equal, logits within {worst:.3g} of transformers' (largest "
              f"|logit| {np.abs(logits).max():.3g})")
        assert found[folder]["cache"] is True
        assert [row[:len(ours)] for row, ours in zip(found[folder]["tokens"], tokens)] == tokens
        assert got.shape == logits.shape and worst <= 1e-4 * np.abs(logits).max()

import dataclasses
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import REPO, run_snakemake
from ortflow import config
from ortflow.digests import digest
from ortflow.checkpoints import resume


def test_defaults_fill_every_section():
    cfg = config.load()
    assert cfg.train.optimizer.betas == (0.9, 0.999)
    assert cfg.export.calibration_batches == 8
    assert config.global_batch_size(cfg) == 64


@pytest.mark.parametrize(
    "override, message",
    [
        ({"train": {"world_size": 0}}, "config key 'train.world_size': 0 is less than the minimum of 1"),
        ({"train": {"world_size": 3, "pipeline_stages": 2}}, "config key 'train.world_size': 3 ranks do not divide "
                                                            "into train.pipeline_stages=2 stages; make it a multiple of it"),
        ({"train": {"pipeline_stages": 2, "device": "cuda"}}, "config key 'train.device': 'cuda' is not applied to "
                                                             "pipeline stages yet (train.pipeline_stages=2); set "
                                                             "train.device: cpu"),
        ({"train": {"wrld_size": 2}}, "config section 'train': unknown key(s) wrld_size; allowed keys:"),
        ({"model": {"kind": "rnn"}}, "config key 'model.kind': 'rnn' is not one of 'mlp', 'cnn'"),
        ({"train": {"optimizer": {"lr": "fast"}}}, "config key 'train.optimizer.lr': 'fast' is not of type 'number'"),
        # A wrong type stops the run, text that looks like a number included (YAML `steps: "20"`).
        ({"train": {"steps": "20"}}, "config key 'train.steps': '20' is not of type 'integer'"),
        ({"train": {"steps": 1.5}}, "config key 'train.steps': 1.5 is not of type 'integer'"),
        ({"train": {"optimizer": {"lr": "0.1"}}}, "config key 'train.optimizer.lr': '0.1' is not of type 'number'"),
        ({"train": {"optimizer": {"betas": ["0.9", 0.999]}}}, "config key 'train.optimizer.betas.0': '0.9' is not of"),
        ({"data": {"shards": "true"}}, "config key 'data.shards': 'true' is not of type 'integer'"),
        ({"model": {"kind": "onnx"}}, "config key 'model.path': required when model.kind is 'onnx'"),
        ({"model": {"kind": "gpt"}}, "config key 'model.kind': 'gpt' needs text data"),
        # Only a transformers model builds the mask that keeps separately packed examples apart.
        ({"model": {"kind": "torch", "path": "nets:Net"}, "data": {"packing": "separate"}},
         "config key 'data.packing': 'separate' keeps the examples of a window apart with a mask that only "
         "model.kind: transformers builds; model.kind is 'torch': set data.packing: cross (examples attend to each "
         "other) or none"),
        # Python's `$` matches before a trailing newline: patterns must match the whole string.
        ({"run": {"name": "x\n"}}, "config key 'run.name': 'x\\n' is not allowed; expected letters, digits"),
        ({"data": {"source": "my.csv\nrm -rf ~"}}, "config key 'data.source': 'my.csv\\nrm -rf ~' is not allowed; "
                                                  "expected a path without control characters"),
        ({"data": {"source": "-x.csv"}}, "that does not start with '-'"),
        ({"data": {"label": "y\n"}}, "config key 'data.label': 'y\\n' is not allowed; expected a name"),
        ({"data": {"features": ["x", "\tz"]}}, "config key 'data.features.1': '\\tz' is not allowed"),
        ({"model": {"kind": "onnx", "path": "m.onnx\n"}}, "config key 'model.path': 'm.onnx\\n' is not allowed"),
        ({"model": {"frozen": ["w\n"]}}, "config key 'model.frozen.0': 'w\\n' is not allowed"),
        ({"train": {"resume_from": "a\n"}}, "config key 'train.resume_from': 'a\\n' is not allowed"),
        ({"train": {"optimizer": {"lr": float("nan")}}}, "config key 'train.optimizer.lr': nan is not a finite number"),
        ({"train": {"optimizer": {"lr": float("inf")}}}, "config key 'train.optimizer.lr': inf is not a finite number"),
        ({"train": {"optimizer": {"betas": [0.9, float("nan")]}}}, "config key 'train.optimizer.betas.1': nan is "
                                                                   "not a finite number"),
        ({"train": {"clip_grad_norm": float("inf")}}, "config key 'train.clip_grad_norm': inf is not a finite number"),
        ({"export": {"max_accuracy_drop": float("-inf")}}, "'export.max_accuracy_drop': -inf is not a finite number"),
        # int4 quantizes export/generation/, which only a gpt or a transformers causal-lm run declares.
        ({"export": {"int4": {}}}, "config key 'export.int4': int4 quantizes a causal LM's export/generation/ "
                                   "decoder, which needs model.kind: gpt, or transformers with model.task: "
                                   "causal-lm; got model.kind 'mlp', model.task 'auto'"),
        ({"export": {"int4": {"block_size": 48}}}, "config key 'export.int4.block_size': 48 is not one of"),
        # the generate target's prompts: one way of giving them, for a model that has export/generation/
        ({"generate": {"prompt": "hi"}}, "config key 'generate.prompt': generates from export/generation/, which the "
                                         "export writes for a causal LM or a sequence-to-sequence model (model.kind: "
                                         "gpt, or transformers with model.task: causal-lm or seq2seq); got model.kind "
                                         "'mlp', model.task 'auto'"),
        ({"generate": {"prompt": "hi", "prompts": "p.txt"}}, "config key 'generate.prompts': set with "
                                                              "generate.prompt; give one of them"),
        ({"generate": {"max_new_tokens": 0}}, "config key 'generate.max_new_tokens': 0 is less than the minimum of 1"),
        ({"export": {"samples": -1}}, "config key 'export.samples': -1 is less than the minimum of 0"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(config.ConfigError) as error:
        config.load(overrides=override)
    assert message in str(error.value)


def test_dotted_and_command_line_overrides():
    overrides = {"train.world_size": "3", "train": {"optimizer": {"lr": "0.5"}}}
    cfg = config.validate(overrides, command_line=overrides)
    assert cfg["train"]["world_size"] == 3 and cfg["train"]["optimizer"]["lr"] == 0.5


def test_identity_ignores_world_size_but_not_global_batch():
    a = config.load(overrides={"train": {"world_size": 2, "grad_accum_steps": 1}})
    b = config.load(overrides={"train": {"world_size": 1, "grad_accum_steps": 2, "log_every": 3}})
    c = config.load(overrides={"train": {"world_size": 1, "grad_accum_steps": 1}})
    assert digest(config.training_identity(a)) == digest(config.training_identity(b))
    assert digest(config.training_identity(a)) != digest(config.training_identity(c))


def test_the_global_batch_is_split_across_the_copies_of_the_stages_not_the_stages():
    """4 ranks in 2 stages are 2 data-parallel copies: the global batch of 2 ranks."""
    pipelined = config.load(overrides={"train": {"world_size": 4, "pipeline_stages": 2}})
    assert config.data_parallel_size(pipelined.train) == 2
    assert config.global_batch_size(pipelined) == config.global_batch_size(config.load()) == 64


def test_identity_has_the_steps_where_the_schedule_spreads_over_them():
    def identity(**train):
        return digest(config.training_identity(config.load(overrides={"train": train})))

    assert identity(steps=300) != identity(steps=200)  # cosine by default
    constant = {"name": "constant", "warmup_steps": 20}
    assert identity(steps=300, lr_schedule=constant) == identity(steps=200, lr_schedule=constant)


def test_identity_knows_user_files_by_content_not_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.onnx").write_bytes(b"model one")
    (tmp_path / "b.onnx").write_bytes(b"model one")
    (tmp_path / "data.csv").write_text("x,y\n1,2\n")

    def identity(model_path: str) -> dict:
        cfg = config.load(overrides={"model": {"kind": "onnx", "path": model_path},
                                     "data": {"source": "data.csv"}})
        return config.training_identity(cfg)

    first = identity("a.onnx")
    assert first == identity("b.onnx")  # moved or copied: the same model
    assert first["data"]["source"].startswith("sha256:")
    (tmp_path / "a.onnx").write_bytes(b"model two")  # replaced in place
    assert resume._differences(first, identity("a.onnx")) == [
        f"model.path: {first['model']['path']!r} in the checkpoint, {identity('a.onnx')['model']['path']!r} now"]


def test_identity_keeps_a_template_longer_than_a_file_name_as_it_is():
    """data.chat_template may be the Jinja template itself: longer than a file name may be (255 bytes),
    it is no path (asking the filesystem raised ENAMETOOLONG in every rank of a chat run)."""
    from ortflow.config.derived import by_content

    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}" * 6
    assert len(template) > 255
    assert by_content({"chat_template": template, "source": "chats.jsonl"}) == {
        "chat_template": template, "source": "chats.jsonl"}


@pytest.mark.e2e
def test_workflow_refuses_bad_config_before_any_job(workdir):
    result = run_snakemake(workdir, {"train": {"world_size": -1}}, check=False)
    assert result.returncode != 0
    assert "config key 'train.world_size': -1 is less than the minimum of 1" in result.stderr
    assert not (workdir / "results").exists()


@pytest.mark.e2e
def test_workflow_refuses_a_run_name_with_a_newline(workdir):
    result = run_snakemake(workdir, {"run": {"name": "x\n"}}, "prepare_data", check=False)
    assert result.returncode != 0
    assert "config key 'run.name': 'x\\n' is not allowed; expected letters, digits" in result.stderr
    assert sorted(p.name for p in workdir.iterdir() if p.name != ".snakemake") == ["test-config.yaml"]


def test_default_config_file_equals_schema_defaults():
    """`--configfile my.yaml` replaces config/config.yaml, so a user's file that
    changes one key must mean "the default run but this key"."""
    assert config.as_dict(config.load()) == config.validate({})


@pytest.mark.parametrize("text, message", [
    ("train:\n  optimizer: {lr: .nan}\n", "config key 'train.optimizer.lr': nan is not a finite number"),
    ("run:\n  name: x\n train: {steps: 3\n", "my.yaml, line 3, column 2: not valid YAML (while parsing a block "
                                              "mapping expected <block end>, but found '<block mapping start>')"),
    ("run: {name: [x}\n", "my.yaml, line 1, column 15: not valid YAML (while parsing a flow sequence expected"),
])
def test_config_file_errors_name_the_file_line_and_column(tmp_path, text, message):
    path = tmp_path / "my.yaml"
    path.write_text(text)
    with pytest.raises(config.ConfigError) as error:
        config.load(path)
    assert message in str(error.value)
    assert len(str(error.value).splitlines()) == 1


def test_config_file_that_is_a_directory(tmp_path):
    with pytest.raises(config.ConfigError, match=f"config file {tmp_path} is a directory, not a YAML file"):
        config.load(tmp_path)


def test_the_schema_is_package_data_of_an_installed_ortflow(tmp_path):
    """The schema ships inside the package (pyproject.toml's package-data): ortflow's wheel
    holds it, and an ortflow imported from that wheel, not from this checkout, finds it
    through importlib.resources and validates with it."""
    source = tmp_path / "source"
    shutil.copytree(REPO / "src" / "ortflow", source / "src" / "ortflow", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"),
                    str(source)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("ortflow-*.whl")
    installed = tmp_path / "installed"  # what pip puts in site-packages
    zipfile.ZipFile(wheel).extractall(installed)
    probe = "from ortflow import config; print(config.schema_file()); print(config.validate({})['train']['steps'])"
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(installed)}, check=True)
    schema, steps = result.stdout.split()
    assert Path(schema) == installed / "ortflow" / "config.schema.yaml"
    assert int(steps) == config.validate({})["train"]["steps"]
    assert config.schema_file() == REPO / "src" / "ortflow" / "config.schema.yaml"  # this checkout's: the same file


def test_rules_quote_every_path_they_pass_to_the_shell():
    """A placeholder of a path in a rule's shell command is quoted (`{output:q}`), so
    that a space or a shell character in it stays one argument."""
    import re

    rules = sorted((REPO / "workflow" / "rules").glob("*.smk"))
    placeholders = [(rule.name, match) for rule in rules
                    for match in re.findall(r"\{(?:input|output|log|params|resources)[^}]*\}", rule.read_text())]
    assert len(placeholders) > 30
    assert [p for p in placeholders if not p[1].endswith(":q}") and p[1] != "{resources.tasks}"] == []


def test_an_exponent_without_a_dot_is_a_number():
    """YAML 1.1 (PyYAML's, Snakemake's) reads 1e-3 as text; users, Python and JSON read a number."""
    raw = yaml.safe_load("train: {optimizer: {lr: 1e-3}, clip_grad_norm: 5e0}")
    assert raw["train"]["optimizer"]["lr"] == "1e-3"
    cfg = config.validate(raw)
    assert cfg["train"]["optimizer"]["lr"] == 0.001 and cfg["train"]["clip_grad_norm"] == 5.0
    with pytest.raises(config.ConfigError, match="config key 'train.optimizer.lr': 'fast' is not of type 'number'"):
        config.validate({"train": {"optimizer": {"lr": "fast"}}})


def test_command_line_values_are_read_as_typed():
    """Snakemake's --config gives nested values as text (`train={steps: 20, optimizer: {betas: [0.9, 0.99]}}`):
    they are read as YAML scalars, a sweep's values by the key they set; the same text from a file is refused."""
    typed = {"train": {"steps": "20", "optimizer": {"lr": "1e-3", "betas": ["0.9", "0.99"]}},
             "sweep": {"grid": {"train.micro_batch_size": ["8", "16"]},
                       "random": {"ranges": {"train.world_size": {"choice": ["1", "2"]}}}}}
    cfg = config.validate(typed, command_line=typed)
    assert cfg["train"]["steps"] == 20 and cfg["train"]["optimizer"]["lr"] == 0.001
    assert cfg["train"]["optimizer"]["betas"] == [0.9, 0.99]
    assert cfg["sweep"]["grid"] == {"train.micro_batch_size": [8, 16]}
    assert cfg["sweep"]["random"]["ranges"]["train.world_size"] == {"choice": [1, 2]}
    with pytest.raises(config.ConfigError, match="config key 'train.steps': '20' is not of type 'integer'"):
        config.validate(typed)
    with pytest.raises(config.ConfigError, match="config key 'train.steps': 'twenty' is not of type 'integer'"):
        config.validate({"train": {"steps": "twenty"}}, command_line={"train": {"steps": "twenty"}})


@pytest.mark.e2e
def test_workflow_refuses_quoted_numbers_but_reads_the_command_line(workdir):
    """`steps: "20"` in a config file stops Snakemake naming the key; --config 'train={steps: 20}' is 20."""
    result = run_snakemake(workdir, {"train": {"steps": "20"}}, check=False)
    assert result.returncode == 1
    assert "config key 'train.steps': '20' is not of type 'integer'" in result.stderr
    result = run_snakemake(workdir, {}, "-n", "-p", "train", "--config", "train={steps: 20, optimizer: {lr: 1e-3}}")
    assert '"steps": 20,' in result.stdout and '"lr": 0.001,' in result.stdout  # train's --config-json


@pytest.mark.parametrize("name", sorted(path.name for path in (REPO / "config").glob("*.yaml")))
def test_every_config_file_the_readme_runs_is_valid(name):
    cfg = config.load(REPO / "config" / name)
    assert cfg.run.name == ("digits" if name == "config.yaml" else name.removesuffix(".yaml"))


def test_the_torch_module_example_gives_the_digits_logits(monkeypatch):
    """config/digits_cnn.yaml's model, imported as the build imports it (from the folder Snakemake runs in)."""
    import torch

    from ortflow.models import user

    monkeypatch.chdir(REPO)
    cfg = config.load(REPO / "config" / "digits_cnn.yaml")
    module = user.import_torch(cfg.model.path, cfg.model.kwargs)
    assert module(torch.zeros(3, 64)).shape == (3, 10)


@pytest.mark.parametrize("train, refusal", [
    ({"world_size": 3, "pipeline_stages": 2},
     "config key 'train.world_size': 3 ranks do not divide into train.pipeline_stages=2 stages; make it a multiple of it"),
    ({"world_size": 2, "pipeline_stages": 2, "device": "cuda"},
     "config key 'train.device': 'cuda' is not applied to pipeline stages yet (train.pipeline_stages=2); "
     "set train.device: cpu"),
    ({"world_size": 2, "pipeline_stages": 2, "profile_steps": [1, 2]},
     "config key 'train.profile_steps': [1, 2] is not applied to pipeline stages yet (train.pipeline_stages=2); "
     "set train.profile_steps: null"),
])
def test_what_pipeline_stages_do_not_take_is_refused_in_one_line(train, refusal):
    with pytest.raises(config.ConfigError) as error:
        config.load(overrides={"train": train})
    assert str(error.value) == refusal


@pytest.mark.parametrize("model, missing, refusal", [
    ({"kind": "transformers", "path": "folder"}, "transformers",
     "config key 'model.kind': model.kind: transformers needs the transformers library, which is not installed: "
     "pip install 'ortflow[transformers]'"),
    ({"kind": "torch", "path": "pkg.mod:Net", "lora": {}}, "peft",
     "config key 'model.lora': model.lora needs the peft library, which is not installed: "
     "pip install 'ortflow[transformers]'"),
])
def test_a_model_whose_library_is_missing_is_refused_naming_the_extra(model, missing, refusal, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    with pytest.raises(config.ConfigError) as error:
        config.load(overrides={"model": model})
    assert str(error.value) == refusal
    monkeypatch.undo()
    assert config.load(overrides={"model": model}).model.kind == model["kind"]  # installed: no refusal


def test_the_typed_sections_are_what_the_schema_gives():
    """sections.py is generated from the schema: a key added, renamed or retyped there without
    running the generator fails here, naming the command."""
    from ortflow.config import generate

    assert generate.SECTIONS_FILE.read_text() == generate.source(), \
        f"src/ortflow/config/sections.py is not what config.schema.yaml gives: run `{generate.COMMAND}`"


def test_a_misspelled_attribute_fails_when_read_set_or_replaced():
    cfg = config.load()
    with pytest.raises(AttributeError, match="'Train' object has no attribute 'optimzer'"):
        cfg.train.optimzer
    # Frozen, with no __dict__ to hold a new attribute (slots); Python 3.11's frozen __setattr__ of a
    # slots class raises TypeError for a name that is no field (its super() names the class before slots).
    with pytest.raises((AttributeError, TypeError)):
        cfg.train.optimzer = cfg.train.optimizer
    with pytest.raises(TypeError, match="world_sise"):
        dataclasses.replace(cfg.train, world_sise=1)
    assert not hasattr(cfg.train, "__dict__")


def test_a_type_checker_finds_a_misspelled_key(tmp_path):
    """With the schema's types, mypy finds `config.train.optimzer` before anything runs,
    and the whole chain of a correct key is typed to the end (`lr` a float)."""
    pytest.importorskip("mypy")
    (tmp_path / "uses.py").write_text(
        "from ortflow.config import Config\n\n\n"
        "def good(config: Config) -> str:\n    return config.train.optimizer.lr\n\n\n"
        "def bad(config: Config) -> float:\n    return config.train.optimzer.lr\n")
    result = subprocess.run([sys.executable, "-m", "mypy", "--ignore-missing-imports", "--follow-imports=silent",
                             "--cache-dir", str(tmp_path / "cache"), "--no-error-summary", "uses.py"],
                            cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "MYPYPATH": str(REPO / "src")})
    assert result.stdout.splitlines() == [
        'uses.py:5: error: Incompatible return value type (got "float", expected "str")  [return-value]',
        'uses.py:9: error: "Train" has no attribute "optimzer"; maybe "optimizer"?  [attr-defined]'], result.stderr


def test_replace_sets_dotted_keys_and_validates_them_together():
    base = config.load(overrides={"model": {"lora": {"r": 4}}, "train": {"world_size": 2}})
    changed = config.replace(base, {"train.optimizer.lr": "1e-2", "train.world_size": 4, "train.pipeline_stages": 2,
                                    "model.lora": {"alpha": 2}})
    assert changed.train.optimizer.lr == 0.01  # read as a config file's value is
    assert (changed.train.world_size, changed.train.pipeline_stages) == (4, 2)  # one change needs the other
    assert (changed.model.lora.alpha, changed.model.lora.r) == (2, 8)  # a section given whole replaces the section
    assert base.train.optimizer.lr == 0.003 and isinstance(changed, config.Config)
    with pytest.raises(config.ConfigError, match="^config section 'train': unknown key[(]s[)] optimzer; allowed"):
        config.replace(base, {"train.optimzer.lr": 0.1})
    with pytest.raises(config.ConfigError, match="^config key 'train.optimizer.lr': -1 is less than or equal"):
        config.replace(base, {"train.optimizer.lr": -1})
    with pytest.raises(config.ConfigError, match="^config key 'train.steps.x': 'steps' is not a section$"):
        config.replace(base, {"train.steps.x": 1})
    with pytest.raises(config.ConfigError, match="^config key 'train.world_size': 3 ranks do not divide"):
        config.replace(base, {"train.world_size": 3, "train.pipeline_stages": 2})


@pytest.mark.parametrize("data, refusal", [
    ({"source": "chats.jsonl", "format": "messages"},
     "config key 'data.format': needs data.tokenizer (a tokenizer.json file or a save_pretrained folder) to turn "
     "the text into token ids"),
    ({"source": "rows.csv", "format": "prompt-completion", "tokenizer": "tokenizer.json"},
     "config key 'data.format': prompt-completion rows are read from a .jsonl or .parquet file or a datasets "
     "folder (save_to_disk), not data.source='rows.csv'"),
    ({"source": "docs.jsonl", "format": "documents", "text": ["a", "b"], "tokenizer": "tokenizer.json"},
     "config key 'data.text': data.format documents reads one column of documents, got ['a', 'b']"),
    ({"source": "digits", "tokenizer": "tokenizer.json"},
     "config key 'data.tokenizer': tokenizes text, data.source 'text' or a .txt file, the columns named by "
     "data.text, or the rows of a .jsonl, .parquet or datasets folder; data.source='digits' has none of them "
     "(set data.text)"),
])
def test_rows_of_examples_take_a_tokenizer_and_a_file_of_rows(data, refusal):
    with pytest.raises(config.ConfigError) as error:
        config.load(overrides={"data": data})
    assert str(error.value) == refusal
    assert config.load(overrides={"data": {"source": "chats.jsonl", "tokenizer": "tokenizer.json"}}).data.format \
        == "auto"  # rows of a .jsonl and a tokenizer: chats, pairs or documents, found from the columns

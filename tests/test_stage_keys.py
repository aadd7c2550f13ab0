"""Each rule passes its stage the config keys the stage declares it reads (`KEYS` in its module under
src/ortflow/stages/, through `--config-json`; workflow/rules/common.smk reads the declarations); a key
it leaves out would silently take the schema's default in the stage. Here a stage reads a config that
holds only its rule's keys, where reading any other key fails, naming the key and the declaration to
add it to."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from conftest import REPO, train_summary
from ortflow import config as config_mod
from ortflow.errors import ConfigError
from ortflow.stages import declared_keys
from ortflow.stages import build_artifacts, prepare_data

RULES = REPO / "workflow" / "rules"


def rule_keys() -> dict[str, tuple[str, tuple[str, ...]]]:
    """{rule: where its stage declares its keys and the dotted keys the rule passes}, from the rules
    files and their lists read from the stages' declarations (`NAME = declared_keys("stage"[, "LIST"])`)."""
    text = "".join(path.read_text() for path in sorted(RULES.glob("*.smk")))
    lists = {name: (stage, declared or "KEYS") for name, stage, declared in
             re.findall(r'^(\w+_KEYS) = declared_keys\("(\w+)"(?:, "(\w+)")?\)$', text, re.M)}
    passed = {}
    for path in sorted(RULES.glob("*.smk")):
        for rule, body in re.findall(r"^rule (\w+):\n(.*?)(?=^\S|\Z)", path.read_text(), re.M | re.S):
            for name in re.findall(r"config_json\(\*(\w+)\)", body):
                stage, declared = lists[name]
                passed[rule] = (f"{declared} in src/ortflow/stages/{stage}.py", declared_keys(stage, declared))
    return passed


def test_every_rule_passes_a_list_its_stage_declares():
    """Every rule that passes config keys passes a stage's declaration (a list of its own would be
    read by nothing), and every declared key is a key of the config."""
    rules = rule_keys()
    assert set(rules) >= {"prepare_data", "build_artifacts", "train", "merge_checkpoint", "export_model",
                          "quantize_model", "plot_training", "report_tables", "doctor", "sweep_compare"}
    assert rules["merge_checkpoint"] == rules["train"]
    smk = "".join(path.read_text() for path in RULES.glob("*.smk"))
    assert re.findall(r"^\w+_KEYS = \(", smk, re.M) == []
    default = config_mod.as_dict(config_mod.load())
    for where, keys in rules.values():
        config_mod.pick(default, keys)  # a key that is no key of the config raises KeyError


def test_a_stage_without_a_literal_declaration_is_refused(tmp_path, monkeypatch):
    import ortflow.stages

    monkeypatch.setattr(ortflow.stages, "FOLDER", tmp_path)
    (tmp_path / "computed.py").write_text("BASE = ('run',)\nKEYS = BASE + ('data',)\n")
    (tmp_path / "silent.py").write_text("HELP = 'no keys'\n")
    with pytest.raises(ConfigError, match=r"computed.py:2: KEYS must be a tuple of dotted config keys, written as a literal$"):
        declared_keys("computed")
    with pytest.raises(ConfigError, match=r"silent.py: declares no KEYS \(the config keys the stage reads"):
        declared_keys("silent")


def only(config: config_mod.Config, rule: str) -> config_mod.Config:
    """`config` holding only the keys that `rule` passes its stage: reading any other key raises
    AttributeError naming it and the list to add it to."""
    where, keys = rule_keys()[rule]
    return _holding(config, config_mod.pick(config_mod.as_dict(config), keys), "", where)


def _holding(section, picked: dict, path: str, where: str):
    """A copy of the typed `section` with only the keys of `picked` set: an unset slot raises
    AttributeError when read, and then `__getattr__` says which key it is."""
    def not_passed(self, name):
        raise AttributeError(f"config key '{f'{path}.{name}'.lstrip('.')}' is read but not passed to the stage: "
                             f"add it to {where}")

    cls = type(section)
    partial = object.__new__(type(cls.__name__, (cls,), {"__slots__": (), "__getattr__": not_passed}))
    for name, value in picked.items():
        held = getattr(section, name)
        if dataclasses.is_dataclass(held):
            held = _holding(held, value, f"{path}.{name}".lstrip("."), where)
        object.__setattr__(partial, name, held)  # past the frozen dataclass's __setattr__
    return partial


def test_a_config_of_a_rules_keys_refuses_every_other_key():
    assert rule_keys()["plot_training"] == ("PLOT_KEYS in src/ortflow/stages/report.py",
                                            ("train.steps", "train.optimizer.lr", "train.lr_schedule"))
    plots = only(config_mod.load(), "plot_training")
    assert (plots.train.steps, plots.train.optimizer.lr, plots.train.lr_schedule.name) == (300, 0.003, "cosine")
    with pytest.raises(AttributeError, match="^config key 'train.optimizer.betas' is read but not passed to the "
                                             "stage: add it to PLOT_KEYS in src/ortflow/stages/report.py$"):
        plots.train.optimizer.betas
    with pytest.raises(AttributeError, match="^config key 'run' is read but not passed"):
        plots.run
    with pytest.raises(AttributeError, match="^config key 'train.optimzer' is read but not passed"):
        plots.train.optimzer  # a misspelled key is not passed either


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    corpus = tmp_path_factory.mktemp("text") / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    return corpus


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_data_artifacts_and_the_doctor_read_only_their_rules_keys(kind, text, tmp_path):
    """prepare_data, build_artifacts (a GPT cut into pipeline stages, its blocks recomputed) and
    the doctor's checks of the built model, each on a config of its rule's keys."""
    from ortflow.diagnosis.config_checks import model_checks

    model = {"kind": "mlp", "hidden": [8]} if kind == "mlp" else {"kind": "gpt", "layers": 2, "heads": 2, "width": 16}
    data = {} if kind == "mlp" else {"source": str(text), "context": 8}
    train = {} if kind == "mlp" else {"pipeline_stages": 2, "recompute": "blocks"}
    config = config_mod.load(overrides={"model": model, "data": data, "train": train})
    prepare_data.prepare(only(config, "prepare_data"), tmp_path / "train", tmp_path / "eval")
    build_artifacts.build(only(config, "build_artifacts"), tmp_path / "train", tmp_path / "artifacts")
    arguments = argparse.Namespace(artifacts=tmp_path / "artifacts")
    assert [check.name for check in model_checks(arguments, only(config, "doctor"), 2)] == ["memory", "checkpoint disk"]


def test_the_training_plots_read_only_their_rules_keys(tmp_path):
    from ortflow.reporting.plots import plot_training

    train = [{"step": step, "loss": 1 / step, "lr": 0.001, "samples_per_s": 100.0} for step in (10, 20)]
    metrics = train_summary(history={"train": train, "eval": [{"step": 20, "loss": 0.4, "accuracy": 0.9}]},
                            samples_per_s=100.0, global_batch_size=64, step_time_p50_s=0.6, step_time_p95_s=0.7)
    plot_training(metrics, only(config_mod.load(), "plot_training"), tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["learning_rate.png", "loss.png", "throughput.png"]

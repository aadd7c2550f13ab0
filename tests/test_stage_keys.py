"""Each rule passes its stage the config keys the stage reads (`*_KEYS` in workflow/rules/common.smk,
through `--config-json`); a key it leaves out would silently take the schema's default in the stage.
Here a stage reads a config that holds only its rule's keys, where reading any other key fails,
naming the key and the list to add it to."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

import pytest

from conftest import REPO
from ortflow import config as config_mod
from ortflow.stages import build_artifacts, prepare_data

RULES = REPO / "workflow" / "rules"


def rule_keys() -> dict[str, tuple[str, tuple[str, ...]]]:
    """{rule: the name of its list of keys and the dotted keys it passes its stage}, from the rules
    files and common.smk's lists."""
    lists = {name: ast.literal_eval(value) for name, value in
             re.findall(r"^(\w+_KEYS) = (\(.*?\))\n", (RULES / "common.smk").read_text(), re.M | re.S)}
    passed = {}
    for path in sorted(RULES.glob("*.smk")):
        for rule, body in re.findall(r"^rule (\w+):\n(.*?)(?=^\S|\Z)", path.read_text(), re.M | re.S):
            names = re.findall(r"config_json\(\*(\w+)\)", body)
            if names and names[0] in lists:
                passed[rule] = (f"{names[0]} in workflow/rules/common.smk", lists[names[0]])
    return passed


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
    assert rule_keys()["plot_training"] == ("PLOT_KEYS in workflow/rules/common.smk",
                                            ("train.steps", "train.optimizer.lr", "train.lr_schedule"))
    plots = only(config_mod.load(), "plot_training")
    assert (plots.train.steps, plots.train.optimizer.lr, plots.train.lr_schedule.name) == (300, 0.003, "cosine")
    with pytest.raises(AttributeError, match="^config key 'train.optimizer.betas' is read but not passed to the "
                                             "stage: add it to PLOT_KEYS in workflow/rules/common.smk$"):
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
    metrics = {"history": {"train": train, "eval": [{"step": 20, "loss": 0.4, "accuracy": 0.9}]},
               "samples_per_s": 100.0, "global_batch_size": 64, "step_time_p50_s": 0.6, "step_time_p95_s": 0.7}
    plot_training(metrics, only(config_mod.load(), "plot_training"), tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["learning_rate.png", "loss.png", "throughput.png"]

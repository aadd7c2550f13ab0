import pytest

from ortflow import config
from conftest import run_snakemake


def test_defaults_fill_every_section():
    cfg = config.load()
    assert cfg["train"]["optimizer"]["betas"] == [0.9, 0.999]
    assert cfg["export"]["calibration_batches"] == 8
    assert config.global_batch_size(cfg) == 64


@pytest.mark.parametrize(
    "override, message",
    [
        ({"train": {"world_size": 0}}, "config key 'train.world_size': 0 is less than the minimum of 1"),
        ({"train": {"wrld_size": 2}}, "config section 'train': unknown key(s) wrld_size; allowed keys:"),
        ({"model": {"kind": "rnn"}}, "config key 'model.kind': 'rnn' is not one of 'mlp', 'cnn'"),
        ({"train": {"optimizer": {"lr": "fast"}}}, "config key 'train.optimizer.lr': 'fast' is not of type 'number'"),
        ({"model": {"kind": "onnx"}}, "config key 'model.path': required when model.kind is 'onnx'"),
        ({"model": {"kind": "gpt"}}, "config key 'model.kind': 'gpt' needs text data"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(config.ConfigError) as error:
        config.load(overrides=override)
    assert message in str(error.value)


def test_dotted_and_string_overrides():
    cfg = config.validate({"train.world_size": "3", "train": {"optimizer": {"lr": "0.5"}}})
    assert cfg["train"]["world_size"] == 3 and cfg["train"]["optimizer"]["lr"] == 0.5


def test_identity_ignores_world_size_but_not_global_batch():
    a = config.load(overrides={"train": {"world_size": 2, "grad_accum_steps": 1}})
    b = config.load(overrides={"train": {"world_size": 1, "grad_accum_steps": 2, "log_every": 3}})
    c = config.load(overrides={"train": {"world_size": 1, "grad_accum_steps": 1}})
    assert config.digest(config.training_identity(a)) == config.digest(config.training_identity(b))
    assert config.digest(config.training_identity(a)) != config.digest(config.training_identity(c))


def test_workflow_refuses_bad_config_before_any_job(workdir):
    result = run_snakemake(workdir, {"train": {"world_size": -1}}, check=False)
    assert result.returncode != 0
    assert "config key 'train.world_size': -1 is less than the minimum of 1" in result.stderr
    assert not (workdir / "results").exists()


def test_default_config_file_equals_schema_defaults():
    """`--configfile my.yaml` replaces config/config.yaml, so a user's file that
    changes one key must mean "the default run but this key"."""
    assert config.load() == config.validate({})

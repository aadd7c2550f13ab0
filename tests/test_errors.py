"""Expected failures (ortflow.errors.OrtflowError) end a command with one line;
anything else is a bug and keeps its traceback."""

from __future__ import annotations

import pytest

from ortflow import cli, errors
from ortflow.stages import report


def test_an_expected_failure_is_one_line_without_a_traceback(capsys):
    assert cli.main(["train", "--config-json", "{train: 1", "--train", "t", "--eval", "e", "--artifacts", "a", "--out", "o"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ortflow train: error: --config-json: not valid JSON (Expecting property name")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_any_other_exception_keeps_its_traceback(monkeypatch, tmp_path):
    def bug(args):
        raise ValueError("a bug, not bad input")

    monkeypatch.setattr(report, "run", bug)
    with pytest.raises(ValueError, match="a bug, not bad input"):
        cli.main(["report", "plots", "--metrics", str(tmp_path / "m.json"), "--out", str(tmp_path)])


def test_the_expected_failures_share_one_base_and_keep_their_names():
    from ortflow.config import ConfigError
    from ortflow.data.sources import DataError
    from ortflow.export.checks import ExportError
    from ortflow.checkpoints.ort_format import CheckpointError
    from ortflow.quantization.gate import QualityGateError
    from ortflow.training.comm import DeviceError
    from ortflow.training.trainer import TrainingError

    for error in (ConfigError, DataError, ExportError, CheckpointError, QualityGateError, DeviceError, TrainingError,
                  errors.PreflightError, errors.MissingInputError, errors.ModelError):
        assert issubclass(error, errors.OrtflowError), error

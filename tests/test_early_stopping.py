"""The best checkpoint and early stopping (train.early_stopping, export.checkpoint):
which evaluation is the best, when a run stops, that the one exported is the one
that evaluated best, and what a stop signal does to a run that stops early; units
here, then through the real workflow."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import assert_identical, copy_inputs, fault, run_snakemake
from ortflow import config as config_mod
from ortflow.checkpoints import best, layout, reader
from ortflow.checkpoints.ort_format import CheckpointError
from ortflow.errors import ConfigError
from ortflow.training.best import Best
from ortflow.training.run_folder import TrainFolder


def settings(**changes):
    return config_mod.load(overrides={"train": {"early_stopping": changes}}).train.early_stopping


def test_the_best_by_loss_and_by_accuracy_and_patience():
    best = Best(settings(patience=2), "classification", [])
    assert [best.update(step, {"loss": loss}) for step, loss in ((10, 1.0), (20, 0.5), (30, 0.6), (40, 0.55))] == \
        [True, True, False, False]
    assert (best.step, best.value, best.since, best.exhausted) == (20, 0.5, 2, True)
    accuracy = Best(settings(metric="accuracy"), "classification", [])
    assert [accuracy.update(s, {"accuracy": a}) for s, a in ((10, 0.5), (20, 0.7), (30, 0.6))] == [True, True, False]
    assert accuracy.mode == "max" and not accuracy.exhausted  # no patience: never stops


def test_min_delta_and_replay_of_the_history():
    history = [{"step": 10, "loss": 1.0}, {"step": 20, "loss": 0.95}, {"step": 30, "loss": 0.5}]
    best = Best(settings(min_delta=0.1, patience=3), "regression", history)  # 0.95 is not 0.1 better than 1.0
    assert (best.step, best.value, best.since) == (30, 0.5, 0)


def test_a_metric_the_task_has_not_is_refused_in_one_line():
    with pytest.raises(ConfigError) as error:
        Best(settings(metric="accuracy"), "regression", [])
    assert str(error.value) == ("config key 'train.early_stopping.metric': 'accuracy' is not an eval metric of a "
                                "regression model; use one of loss")


def test_export_checkpoint_auto_is_best_with_early_stopping():
    assert config_mod.export_checkpoint(config_mod.load()) == "last"
    assert config_mod.export_checkpoint(config_mod.load(overrides={"train": {"early_stopping": {"patience": 3}}})) == "best"
    assert config_mod.export_checkpoint(config_mod.load(overrides={"export": {"checkpoint": "best"}})) == "best"


def test_best_json_is_written_back_as_read_and_names_a_step_folder_beside_it_only(tmp_path):
    record = {"step": 20, "metric": "loss", "mode": "min", "value": 0.25}
    best.mark_best(tmp_path, tmp_path / "step-00000020", "d", record)
    written = (tmp_path / layout.BEST).read_text()
    assert json.loads(written) == {**record, "checkpoint": "step-00000020", "identity_digest": "d"}
    assert best.best_of(tmp_path, "d").checkpoint == "step-00000020"
    best.write_best(tmp_path, best.read_best(tmp_path))
    assert (tmp_path / layout.BEST).read_text() == written
    (tmp_path / layout.BEST).write_text(written.replace("step-00000020", "../../etc"))
    with pytest.raises(CheckpointError, match="'checkpoint' must name a step-XXXXXXXX folder beside it"):
        best.best_of(tmp_path, "d")
    (tmp_path / layout.BEST).write_text(written.replace('"mode"', '"modus"'))
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / layout.BEST}: no 'mode'; the file is damaged$"):
        best.best_of(tmp_path, "d")
    (tmp_path / layout.BEST).write_text(written)
    assert best.best_of(tmp_path, "another identity") is None


# --- through the workflow ----------------------------------------------------------------------------

# Evaluations every 10 steps on 2 ranks; nothing improves on the first one by more than min_delta, so
# patience 2 stops the run after the third evaluation, at step 30 of 300, and the best is step 10's.
EARLY = {"train": {"steps": 300, "eval_every": 10, "checkpoint_every": 100, "keep_checkpoints": 1, "log_every": 10,
                   "early_stopping": {"patience": 2, "min_delta": 10.0}}}


def _train(workdir: Path) -> TrainFolder:
    return TrainFolder(workdir / "results/digits/train")


def _metrics(workdir: Path) -> dict:
    return json.loads(_train(workdir).metrics.read_text())


def _log(workdir: Path) -> str:
    return (workdir / "logs/digits/train.log").read_text()


@pytest.fixture(scope="module")
def early_run(digits_inputs, tmp_path_factory):
    """EARLY through export_model, uninterrupted: (its workdir, Snakemake's CompletedProcess)."""
    workdir = copy_inputs(digits_inputs, tmp_path_factory.mktemp("early") / "work")
    return workdir, run_snakemake(workdir, EARLY, "export_model")


@pytest.mark.e2e
def test_early_stopping_stops_every_rank_and_the_best_checkpoint_is_exported(early_run):
    digits_workdir, result = early_run
    metrics = _metrics(digits_workdir)
    assert metrics["stopped_early"] is True and metrics["steps"] == 30
    assert metrics["best"]["step"] == 10 and metrics["best"]["metric"] == "loss"
    assert [e["step"] for e in metrics["history"]["eval"]][:3] == [10, 20, 30]
    log = (digits_workdir / "logs/digits/train.log").read_text()
    assert "early stopping after step 30 of 300: eval loss has not improved by more than 10 for 2 evaluations" in log
    # keep_checkpoints 1 keeps the newest and the best.
    root = digits_workdir / "results/digits/train/checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000010", "step-00000030"]
    meta = json.loads((digits_workdir / "results/digits/checkpoint/meta.json").read_text())
    assert meta["step"] == 10 and meta["chosen"]["checkpoint"] == "best"
    assert meta["chosen"]["value"] == pytest.approx(metrics["history"]["eval"][0]["loss"])
    props = {p.key: p.value for p in onnx.load(str(digits_workdir / "results/digits/export/model.onnx")).metadata_props}
    assert props["ortflow.step"] == "10" and props["ortflow.checkpoint"].startswith("best (eval loss ")
    assert "exported  the checkpoint of step 10, the best (eval loss" in result.stdout + result.stderr
    assert "stopped   early after step 30: eval loss had not improved since step 10" in result.stdout + result.stderr


def _assert_ends_as_uninterrupted(workdir: Path, reference: Path) -> None:
    """The run in `workdir` stopped early at step 30 as the uninterrupted one did: the same
    evaluations, best and checkpoint of step 30, bit for bit."""
    metrics, uninterrupted = _metrics(workdir), _metrics(reference)
    assert (metrics["steps"], metrics["stopped_early"], metrics["best"]) == (30, True, uninterrupted["best"])
    assert metrics["history"]["eval"] == uninterrupted["history"]["eval"]
    assert "early stopping after step 30 of 300" in _log(workdir)
    assert_identical(reader.read_checkpoint(_train(workdir).checkpoints / "step-00000030").state,
                     reader.read_checkpoint(_train(reference).checkpoints / "step-00000030").state)


def _stopped_by_sigterm(workdir: Path, step: int, resumed_at: int | None) -> None:
    """Rank 1 sends SIGTERM to `ortflow train` before step `step` (0-based) and waits until the
    SIGUSR1 it forwards reaches it: the ranks stop after step `step` + 1 with a checkpoint."""
    stopped = run_snakemake(workdir, EARLY, "train", check=False, env=fault(step, 1, "sigterm"))
    assert stopped.returncode != 0
    log = _log(workdir)
    if resumed_at is not None:
        assert f"resuming at step {resumed_at} from results/digits/train/checkpoints/step-{resumed_at:08d}" in log
    assert f"stopping after step {step + 1} of 300: SIGUSR1 on" in log
    assert f"ortflow train: stopped by SIGTERM after step {step + 1}, with a checkpoint; rerun to resume from it" in log
    assert not _train(workdir).metrics.exists()


@pytest.mark.e2e
def test_sigterm_stops_an_early_stopping_run_with_a_checkpoint_and_the_rerun_ends_it_the_same(
        early_run, digits_workdir):
    """Stopped twice: in the middle of the run (before step 14), then, resumed from there, in step 30,
    whose evaluation runs out of patience (the stop is decided in it); the run resumed from that ends
    as the uninterrupted one, with its evaluations and the checkpoint of step 30 (which the run
    resumed mid-run wrote) bit for bit. One chain of three runs rather than two of two, each stop
    resumed once."""
    reference, _ = early_run
    _stopped_by_sigterm(digits_workdir, 14, None)
    _stopped_by_sigterm(digits_workdir, 29, 15)
    run_snakemake(digits_workdir, EARLY, "train")
    assert "resuming at step 30 from results/digits/train/checkpoints/step-00000030" in _log(digits_workdir)
    _assert_ends_as_uninterrupted(digits_workdir, reference)


@pytest.mark.e2e
def test_sigterm_after_the_ranks_agreed_to_stop_early_leaves_a_finished_run(early_run, digits_workdir):
    """Rank 0 sends SIGTERM to `ortflow train` after the ranks' last collective and waits
    until the SIGUSR1 it forwards reaches it, while rank 1 already exits (in MPI_Finalize)."""
    reference, _ = early_run
    run_snakemake(digits_workdir, EARLY, "train", env=fault(30, 0, "sigterm"))
    log = _log(digits_workdir)
    assert "rank 0 sends SIGTERM to ortflow train at step 30 (ORTFLOW_FAULT)" in log
    assert "ortflow train: SIGTERM came after the ranks had agreed on their last step; training finished" in log
    assert _train(digits_workdir).finished.exists()
    _assert_ends_as_uninterrupted(digits_workdir, reference)


@pytest.mark.e2e
def test_export_checkpoint_best_without_early_stopping_picks_the_lowest_eval_loss(digits_workdir):
    config = {"train": {"steps": 60, "eval_every": 10, "checkpoint_every": 60, "keep_checkpoints": 1,
                        "optimizer": {"name": "adamw", "lr": 0.05}},  # a high rate: the loss jumps about
              "export": {"checkpoint": "best"}}
    run_snakemake(digits_workdir, config, "merge_checkpoint")
    evaluations = _metrics(digits_workdir)["history"]["eval"]
    losses = [e["loss"] for e in evaluations]
    best_step = evaluations[int(np.argmin(losses))]["step"]
    meta = json.loads((digits_workdir / "results/digits/checkpoint/meta.json").read_text())
    assert meta["step"] == best_step and meta["chosen"]["value"] == pytest.approx(min(losses))
    # Asked for by hand without a best one recorded: one line saying what to do.
    from ortflow.checkpoints.merge import merge

    empty = digits_workdir / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no best checkpoint of this run"):
        merge(empty, digits_workdir / "out", which="best")

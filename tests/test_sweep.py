"""Sweeps (src/ortflow/sweeps/, workflow/rules/sweep.smk): the points, their names
and checks, and a sweep run through Snakemake, compared in results/sweeps/<name>/."""

import csv
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from chromium import Chromium
from conftest import copy_inputs, export_metrics, run_snakemake, train_summary
from ortflow import config as ortflow_config
from ortflow.sweeps import comparison as sweep_comparison, points as sweep
from ortflow.errors import ConfigError
from ortflow.quantization.export_metrics import write_export_metrics
from ortflow.training.run_folder import TrainFolder
from ortflow.training.run_summary import write_run_summary


def validated(config: dict) -> ortflow_config.Config:
    return ortflow_config.typed(ortflow_config.validate(config))


def sweep_config(**section) -> ortflow_config.Config:
    return validated({"sweep": {"name": "s", **section}})


def test_a_grid_makes_every_combination_named_by_its_values():
    config = sweep_config(grid={"train.optimizer.lr": [0.01, 0.001], "train.micro_batch_size": [16, 32]})
    points = sweep.points(config)
    assert [p.name for p in points] == ["micro_batch_size-16_lr-0.01", "micro_batch_size-16_lr-0.001",
                                        "micro_batch_size-32_lr-0.01", "micro_batch_size-32_lr-0.001"]
    assert points[3].config.train.optimizer.lr == 0.001
    assert points[3].config.train.micro_batch_size == 32
    assert points[3].config.sweep.point == "micro_batch_size-32_lr-0.001"
    assert sweep.results(points[3].config) == Path("results/sweeps/s/micro_batch_size-32_lr-0.001")


def test_values_yaml_reads_as_text_are_read_as_the_config_reads_them():
    """README's grid, as YAML gives it: 1e-3 is text to YAML 1.1, a number to the config and the point's name."""
    grid = yaml.safe_load("{train.optimizer.lr: [1e-3, 3e-4], model.hidden: [[256], [512]]}")
    points = sweep.points(sweep_config(grid=grid, metric="accuracy"))
    assert [p.name for p in points] == ["hidden-256_lr-0.001", "hidden-256_lr-0.0003", "hidden-512_lr-0.001",
                                        "hidden-512_lr-0.0003"]
    assert [p.values["train.optimizer.lr"] for p in points] == [0.001, 0.0003, 0.001, 0.0003]


def test_the_names_do_not_depend_on_the_order_the_keys_are_written_in():
    one = sweep.points(sweep_config(grid={"train.optimizer.lr": [0.1], "model.hidden": [[8]]}))
    other = sweep.points(sweep_config(grid={"model.hidden": [[8]], "train.optimizer.lr": [0.1]}))
    assert [p.name for p in one] == [p.name for p in other] == ["hidden-8_lr-0.1"]


def test_values_read_as_folder_names():
    assert [sweep.format_value(v) for v in (0.001, 3e-05, 1e9, 16, True, [256, 128], "cosine")] == [
        "0.001", "3e-5", "1e9", "16", "true", "256-128", "cosine"]


def test_adding_a_value_keeps_the_other_points_names():
    before = sweep.points(sweep_config(grid={"train.optimizer.lr": [0.01, 0.001]}))
    after = sweep.points(sweep_config(grid={"train.optimizer.lr": [0.01, 0.0003, 0.001]}))
    assert {p.name for p in before} < {p.name for p in after}


def test_random_draws_are_seeded_and_adding_draws_keeps_the_earlier_ones():
    ranges = {"train.optimizer.lr": {"log_uniform": [1e-4, 1e-2]}, "train.micro_batch_size": {"choice": [16, 32]}}
    three = sweep.points(sweep_config(random={"points": 3, "seed": 7, "ranges": ranges}))
    five = sweep.points(sweep_config(random={"points": 5, "seed": 7, "ranges": ranges}))
    assert [p.values for p in five[:3]] == [p.values for p in three]
    for point in five:
        lr = point.values["train.optimizer.lr"]
        assert 1e-4 <= lr <= 1e-2 and point.name.endswith(f"_lr-{sweep.format_value(lr)}")


def test_repeats_train_each_point_with_the_next_seeds_on_one_split():
    config = validated({"run": {"seed": 5}, "sweep": {"grid": {"train.optimizer.lr": [0.01]}, "repeats": 2}})
    points = sweep.points(config)
    assert [(p.name, p.config.run.seed, p.config.data.split_seed) for p in points] == [
        ("lr-0.01_seed-5", 5, 5), ("lr-0.01_seed-6", 6, 5)]
    # Their data stage is one: the split is drawn once, and both repeats are scored on its eval records.
    assert len({sweep.shared(p.config, "data", ("data",)) for p in points}) == 1


@pytest.mark.parametrize("grid, message", [
    ({"train.optimizer.lrr": [0.1]}, "sweep point 'lrr-0.1': config section 'train.optimizer': unknown key(s) lrr"),
    ({"train.optimizer.lr": [0.1, -1]}, "sweep point 'lr--1': config key 'train.optimizer.lr'"),
    ({"run.name": ["a"]}, "config key 'sweep': 'run.name' cannot be swept"),
])
def test_a_bad_key_or_value_names_the_point_and_the_key(grid, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        sweep.points(sweep_config(grid=grid))


def test_only_a_config_with_points_is_a_sweep():
    assert not sweep.is_sweep(validated({}))
    assert sweep.is_sweep(sweep_config(grid={"train.optimizer.lr": [0.1]}))
    point = sweep.points(sweep_config(grid={"train.optimizer.lr": [0.1]}))[0]
    assert not sweep.is_sweep(point.config)


def test_stages_are_shared_by_the_keys_they_depend_on():
    points = sweep.points(sweep_config(grid={"train.optimizer.lr": [0.1, 0.01], "model.hidden": [[8], [16]]}))
    data_keys, graph_keys = ("data",), ("data", "run.seed", "model", "train.optimizer.name")
    assert len({sweep.shared(p.config, "data", data_keys) for p in points}) == 1
    assert len({sweep.shared(p.config, "artifacts", graph_keys) for p in points}) == 2


def fake_point(folder: Path, losses: list[float], exported: bool, baseline: dict | None = None,
               trained: int = 4_400_000) -> None:
    """What a point's stages leave: train/metrics.json with these eval losses (and `baseline`, and
    `trained` of its 4.40M parameters trained), and the exported model."""
    history = {"train": [{"step": 10 * (i + 1), "loss": loss} for i, loss in enumerate(losses)],
               "eval": [{"step": 10 * (i + 1), "loss": loss} for i, loss in enumerate(losses)]}
    metrics = train_summary(steps=10 * len(losses), eval={"loss": losses[-1]}, wall_time_s=1.5, samples_per_s=100.0,
                            history=history, baseline=baseline, parameters=4_400_000, trainable_parameters=trained)
    TrainFolder(folder / "train").folder.mkdir(parents=True)
    write_run_summary(TrainFolder(folder / "train").metrics, metrics)
    if exported:
        (folder / "export").mkdir()
        (folder / "export" / "model.onnx").write_bytes(folder.name.encode())


def test_the_comparison_ranks_the_points_and_marks_the_failed_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = sweep_config(grid={"train.optimizer.lr": [0.1, 0.01, 0.001, 0.0001, 0.00001]})
    folder = Path("results/sweeps/s")
    fake_point(folder / "lr-0.1", [0.9, 0.5, 0.7], exported=True)  # best at step 20, last 0.7
    fake_point(folder / "lr-0.01", [0.8, 0.6], exported=True)
    fake_point(folder / "lr-0.001", [0.4], exported=False)  # trained best, but its export failed
    # The jobs that failed (the Snakefile's onerror passes their rules); lr-1e-5 never started.
    best = sweep_comparison.compare(config, ["point_lr_0_001_export_model", "point_lr_0_0001_train", "sweep_compare"])
    rows = comparison(folder)
    assert [(r["rank"], r["point"], r["status"], r["best eval_loss (min)"], r["best step"], r["last eval_loss (min)"])
            for r in rows] == [("1", "lr-0.001", "failed: export_model", "0.4", "10", "0.4"),
                               ("2", "lr-0.1", "finished", "0.5", "20", "0.7"),
                               ("3", "lr-0.01", "finished", "0.6", "20", "0.6"),
                               ("", "lr-0.0001", "failed: train", "", "", ""),
                               ("", "lr-1e-5", "not run", "", "", "")]
    assert (best["point"], best["value"]) == ("lr-0.1", 0.5)
    assert (best["failed"], best["not_run"]) == ({"lr-0.001": "export_model", "lr-0.0001": "train"}, ["lr-1e-5"])
    assert (folder / "best" / "model.onnx").read_bytes() == b"lr-0.1"
    assert {"curves.png", "by_key.png", "comparison.html"} <= {f.name for f in folder.iterdir()}
    printed = sweep_comparison.summary(config, best, [])
    assert "best point lr-0.1 (eval_loss 0.5, min, at step 20)" in printed
    assert "  failed: lr-0.001 (export_model), lr-0.0001 (train) (their logs: logs/sweeps/s/<point>/)" in printed
    assert "  not run: lr-1e-5 (snakemake stopped first; --keep-going runs them)" in printed
    assert "class='failed'" in (folder / "comparison.html").read_text()


def test_the_comparison_says_which_attempt_a_resumed_point_timed_and_which_int8_the_gate_refused(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = sweep_config(grid={"train.optimizer.lr": [0.1, 0.01]})
    folder = Path("results/sweeps/s")
    for name, trained in (("lr-0.1", 290_000), ("lr-0.01", 4_400_000)):  # as LoRA and as full fine-tuning
        fake_point(folder / name, [0.9, 0.5], exported=True, trained=trained)
    resumed = TrainFolder(folder / "lr-0.1" / "train").metrics
    resumed.write_text(json.dumps({**json.loads(resumed.read_text()), "steps_this_attempt": 5}))
    gate = {"metric": "loss", "drop": 36.0, "unit": "%", "max_accuracy_drop": 1.0, "outcome": "refused"}
    write_export_metrics(folder / "lr-0.01" / "export" / "metrics.json", export_metrics(
        {"loss": 0.5, "size_bytes": 4000}, {"loss": 0.68, "size_bytes": 1000}, gate))
    best = sweep_comparison.compare(config)
    rows = {row["point"]: row for row in comparison(folder)}
    assert (rows["lr-0.1"]["steps"], rows["lr-0.01"]["steps"]) == ("20 (5 in the last attempt)", "20")
    assert rows["lr-0.1"]["wall time (s, last attempt)"] == "1.5" and rows["lr-0.1"]["samples/s (last attempt)"] == "100"
    assert (rows["lr-0.1"]["parameters trained"], rows["lr-0.01"]["parameters trained"]) == ("0.29M of 4.40M",
                                                                                            "4.40M of 4.40M")
    assert rows["lr-0.01"]["int8 eval_loss"] == "refused by the gate, +36% loss (export.max_accuracy_drop: 1)"
    assert rows["lr-0.01"]["status"] == "finished" and best["int8_refused"] == ["lr-0.01"]
    assert "  int8 refused by the gate: lr-0.01 (their fp32 models stand" in sweep_comparison.summary(config, best, [])


def test_repeats_are_ranked_by_their_points_mean(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = validated({"run": {"seed": 1}, "sweep": {
        "name": "s", "grid": {"train.optimizer.lr": [0.1, 0.01]}, "repeats": 3}})
    folder = Path("results/sweeps/s")
    # lr-0.1 has the single best repeat (0.2), lr-0.01 the better mean (0.4 against 0.5); predicting the
    # train split's mean scores 0.55, which two repeats do not beat.
    mean = {"of": "the train split's mean", "loss": 0.55, "r2": 0.0}
    for seed, loss in ((1, 0.2), (2, 0.6), (3, 0.7)):
        fake_point(folder / f"lr-0.1_seed-{seed}", [loss], exported=True, baseline=mean)
    for seed, loss in ((1, 0.3), (2, 0.5)):  # its third repeat failed: the mean is of the two that trained
        fake_point(folder / f"lr-0.01_seed-{seed}", [loss], exported=True, baseline=mean)
    best = sweep_comparison.compare(config)
    rows = comparison(folder)
    assert [(r["rank"], r["point"], r["mean eval_loss (min) over repeats"], r["std eval_loss (min) over repeats"],
             r["best eval_loss (min)"], r["baseline eval_loss"], r["beats baseline"]) for r in rows] == [
        ("1", "lr-0.01_seed-1", "0.4", "0.141421", "0.3", "0.55", "yes"),
        ("2", "lr-0.01_seed-2", "0.4", "0.141421", "0.5", "0.55", "yes"),
        ("3", "lr-0.1_seed-1", "0.5", "0.264575", "0.2", "0.55", "yes"),
        ("4", "lr-0.1_seed-2", "0.5", "0.264575", "0.6", "0.55", "no"),
        ("5", "lr-0.1_seed-3", "0.5", "0.264575", "0.7", "0.55", "no"),
        ("", "lr-0.01_seed-3", "0.4", "0.141421", "", "", "")]
    assert (best["point"], best["mean"]) == ("lr-0.01_seed-1", pytest.approx(0.4))
    said = sweep_comparison.summary(config, best, [])
    assert "(eval_loss 0.3, min, at step 10; mean 0.4 (std 0.141) over its repeats; baseline 0.55)" in said
    assert "does not beat the baseline" not in said
    record = {**best, "beats_baseline": "no"}
    assert "  warning: it does not beat the baseline" in sweep_comparison.summary(config, record, [])


# A grid of 4 points on the default data, few steps of a tiny MLP on one rank each, at a constant
# learning rate (so that its hidden-16 points are also what a halving survivor must equal, below).
# Two sizes: 2 graphs; two quality gates, one refusing every int8 model, one passing every one
# (certain on any CPU): the points that differ by their gate alone share their graph.
# grid_run goes through the whole workflow, for the report; most other sweeps stop at sweep_compare,
# which needs every point trained, exported and quantized, not their plots and report tables. The
# failing point's sweep goes to the default target: after its failed run (whose comparison onerror
# wrote), `snakemake sweep_compare` with a point added says "Nothing to be done".
GRID = {
    "train": {"steps": 20, "world_size": 1, "eval_every": 10, "log_every": 5, "optimizer": {"lr": 0.01},
              "lr_schedule": {"name": "constant"}},
    "model": {"hidden": [16]},
    "sweep": {"name": "grid", "grid": {"model.hidden": [[16], [32]], "export.max_accuracy_drop": [-1000.0, 100.0]}},
}


def jobs(output: str) -> list[str]:
    """The rules of the jobs Snakemake ran (its `rule <name>:` and `localrule <name>:` lines)."""
    return [line.split()[1].rstrip(":") for line in output.splitlines() if line.startswith(("rule ", "localrule "))]


def comparison(folder: Path) -> list[dict]:
    with open(folder / "comparison.tsv") as f:
        return list(csv.DictReader(f, delimiter="\t"))


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory):
    """The grid of 4 points, run to the end once; and Snakemake's output."""
    workdir = tmp_path_factory.mktemp("sweep") / "work"
    result = run_snakemake(workdir, GRID)
    return workdir, result.stdout + result.stderr


@pytest.mark.e2e
def test_a_grid_sweep_shares_its_stages_and_compares_its_points(grid_run):
    workdir, output = grid_run
    ran = jobs(output)
    assert sum(job.endswith("_prepare_data") for job in ran) == 1
    assert sum(job.endswith("_build_artifacts") for job in ran) == 2
    assert sum(job.endswith("_train") for job in ran) == 4
    folder = workdir / "results" / "sweeps" / "grid"
    rows = comparison(folder)
    assert len(rows) == 4 and [r["rank"] for r in rows] == ["1", "2", "3", "4"]
    for row in rows:
        metrics = json.loads(TrainFolder(folder / row["point"] / "train").metrics.read_text())
        losses = [e["loss"] for e in metrics["history"]["eval"]]
        assert float(row["best eval_loss (min)"]) == pytest.approx(min(losses), rel=1e-5)
        assert float(row["last eval_loss (min)"]) == pytest.approx(metrics["eval"]["loss"], rel=1e-5)
        assert int(row["steps"]) == metrics["steps"] == 20
    best = json.loads((folder / "best" / "best.json").read_text())
    assert best["point"] == rows[0]["point"]
    assert (folder / "best" / "model.onnx").read_bytes() == (folder / best["point"] / "export" / "model.onnx").read_bytes()
    assert f"best point {best['point']}" in output


@pytest.mark.e2e
def test_the_sweeps_report_in_chromium_shows_the_comparison(grid_run, tmp_path):
    workdir, output = grid_run
    (command,) = [line.split(None, 1)[1] for line in output.splitlines() if line.startswith("  report: ")]
    report = subprocess.run(shlex.split(command), cwd=workdir, capture_output=True, text=True, timeout=600)
    assert report.returncode == 0, report.stderr[-4000:]
    folder = workdir / "results" / "sweeps" / "grid"
    browser = Chromium(tmp_path / "chromium-profile")
    try:
        browser.open((folder / "report.html").as_uri())
        paths = browser.wait_for("typeof app !== 'undefined' && app.state && Object.keys(results)", "its results")
        files = {Path(p).name: p for p in paths if "/sweeps/grid/" in p and "/report/" not in p}
        assert set(files) == {"comparison.html", "curves.png", "by_key.png"}
        path = json.dumps(files["comparison.html"])
        browser.evaluate(f"app.setView({{content: 'html', contentPath: results[{path}].data_uri, "
                         f"resultPath: {path}}})")
        shown = browser.frame_rows()
    finally:
        browser.close()
    # The table as the browser shows it: the cells of comparison.tsv, point by point.
    assert {row["point"]: list(row.values()) for row in comparison(folder)} == shown


@pytest.mark.e2e
def test_a_failing_point_leaves_the_others_and_an_added_point_runs_alone(workdir):
    # A learning rate of 1e9 makes the loss non-finite: that point's training fails.
    failing = {**GRID, "sweep": {"name": "lr", "grid": {"train.optimizer.lr": [0.01, 1e9]}}}
    result = run_snakemake(workdir, failing, "--keep-going", check=False)
    assert result.returncode != 0
    folder = workdir / "results" / "sweeps" / "lr"
    rows = {row["point"]: row for row in comparison(folder)}
    assert rows["lr-1e9"]["status"] == "failed: train" and rows["lr-1e9"]["rank"] == ""
    assert rows["lr-0.01"]["status"] == "finished" and rows["lr-0.01"]["rank"] == "1"
    assert "best point lr-0.01" in result.stderr and "failed: lr-1e9 (train)" in result.stderr
    finished = TrainFolder(folder / "lr-0.01" / "train").metrics.stat().st_mtime_ns

    # The failing point removed, another added: only the new one trains, and the comparison is redone.
    adding = {**GRID, "sweep": {"name": "lr", "grid": {"train.optimizer.lr": [0.01, 0.001]}}}
    result = run_snakemake(workdir, adding)
    ran = jobs(result.stdout + result.stderr)
    assert sorted(job for job in ran if job.endswith("_train")) == ["point_lr_0_001_train"]
    assert "sweep_compare" in ran and not any(job.endswith("_prepare_data") for job in ran)
    assert TrainFolder(folder / "lr-0.01" / "train").metrics.stat().st_mtime_ns == finished
    assert [row["point"] for row in comparison(folder)] in (["lr-0.01", "lr-0.001"], ["lr-0.001", "lr-0.01"])


@pytest.mark.e2e
def test_repeats_share_one_split_and_are_compared_by_their_mean_and_std(workdir):
    """Two repeats over run.seed of a point: new weights and batch order, the same eval records. How
    points are ranked by their repeats' mean: test_repeats_are_ranked_by_their_points_mean."""
    import statistics

    repeats = {**GRID, "sweep": {"name": "rep", "grid": {"train.optimizer.lr": [0.01]}, "repeats": 2}}
    result = run_snakemake(workdir, repeats, "sweep_compare")
    ran = jobs(result.stdout + result.stderr)
    assert sum(job.endswith("_prepare_data") for job in ran) == 1
    assert sum(job.endswith("_build_artifacts") for job in ran) == 2  # one per seed
    folder = workdir / "results" / "sweeps" / "rep"
    assert len(list((folder / "shared").glob("data-*"))) == 1
    rows = comparison(folder)
    metrics = {row["point"]: json.loads(TrainFolder(folder / row["point"] / "train").metrics.read_text())
               for row in rows}
    assert metrics["lr-0.01_seed-1234"]["history"]["train"] != metrics["lr-0.01_seed-1235"]["history"]["train"]
    assert sorted(metrics) == ["lr-0.01_seed-1234", "lr-0.01_seed-1235"]
    bests = [min(e["loss"] for e in metrics[f"lr-0.01_seed-{seed}"]["history"]["eval"]) for seed in (1234, 1235)]
    for row in rows:
        assert float(row["mean eval_loss (min) over repeats"]) == pytest.approx(statistics.fmean(bests), rel=1e-5)
        assert float(row["std eval_loss (min) over repeats"]) == pytest.approx(statistics.stdev(bests), rel=1e-4)
    # Within the point, its repeats are ranked by their own best.
    assert [float(row["best eval_loss (min)"]) for row in rows] == pytest.approx(sorted(bests), rel=1e-5)


@pytest.mark.e2e
def test_a_refused_int8_keeps_the_sweep_green_and_a_failed_stage_is_named_and_ranked_by_training(
        grid_run, tmp_path):
    # grid_run's gates: -1000 refuses every int8 model, 100 passes every one.
    workdir, output = grid_run
    points = sweep.points(validated(GRID))
    refused = [p.name for p in points if p.values["export.max_accuracy_drop"] < 0]
    passed = [p.name for p in points if p.values["export.max_accuracy_drop"] > 0]
    rows = {row["point"]: row for row in comparison(workdir / "results" / "sweeps" / "grid")}
    assert {rows[name]["status"] for name in refused + passed} == {"finished"}
    for name in refused:
        assert rows[name]["int8 eval_loss"].startswith("refused by the gate, "), rows[name]
    for name in passed:
        float(rows[name]["int8 eval_loss"])  # the int8 model's eval loss
    said = re.search(r"int8 refused by the gate: (.*) \(their fp32 models stand", output)
    assert said and sorted(said.group(1).split(", ")) == sorted(refused), output[-3000:]

    # Asked to fail the run, the refused points' quantize_model fails (on a copy of the grid's run:
    # only quantize_model and the comparison run again): they are ranked by their training.
    copy = copy_inputs(workdir, tmp_path / "work")
    failing = run_snakemake(copy, {**GRID, "export": {"gate_fails_run": True}}, "sweep_compare", "--keep-going",
                            check=False)
    assert failing.returncode != 0
    ran = jobs(failing.stdout + failing.stderr)
    assert not any(job.endswith(("_train", "_export_model")) for job in ran), ran
    folder = copy / "results" / "sweeps" / "grid"
    rows = {row["point"]: row for row in comparison(folder)}
    for name in refused:
        assert rows[name]["status"] == "failed: quantize_model" and rows[name]["rank"] in ("1", "2", "3", "4"), rows[name]
        assert f"{name} (quantize_model)" in failing.stderr
    assert {rows[name]["status"] for name in passed} == {"finished"}
    best = json.loads((folder / "best" / "best.json").read_text())["point"]
    assert best in passed and f"best point {best}" in failing.stderr


HALVING = {
    "train": GRID["train"],
    "model": {"hidden": [16]},
    "sweep": {"name": "halve", "grid": {"train.optimizer.lr": [0.01, 0.0001]},
              "halving": {"steps": 10, "keep": 0.5}},
}


def initializers(model: Path) -> dict:
    import onnx
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(model)).graph.initializer}


def test_halving_needs_a_constant_schedule_and_a_budget_below_the_steps():
    with pytest.raises(ConfigError, match="^sweep point 'lr-0.1': config key 'sweep.halving.steps' needs "
                                          "train.lr_schedule.name: constant, not 'cosine'"):
        sweep.points(sweep_config(grid={"train.optimizer.lr": [0.1]}, halving={"steps": 10}))
    config = validated({**HALVING, "sweep": {**HALVING["sweep"], "halving": {"steps": 20}}})
    with pytest.raises(ConfigError, match=r"'sweep.halving.steps': 20 is not below train.steps=20"):
        sweep.points(config)


def test_halving_keeps_the_best_part_rounded_up_by_their_first_budget_and_never_a_failed_point(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = validated({**HALVING, "sweep": {**HALVING["sweep"], "grid": {
        "train.optimizer.lr": [0.01, 0.003, 0.0001]}}})
    first = {p.name: sweep.results(p.first) for p in sweep.points(config)}
    # Their runs to the first budget: lr-0.003 evaluated best (0.3, then 0.4), lr-0.0001 worst.
    for name, losses in (("lr-0.01", [0.9, 0.5]), ("lr-0.003", [0.3, 0.4]), ("lr-0.0001", [0.6])):
        fake_point(first[name], losses, exported=False)
    assert sweep_comparison.survivors(config) == ["lr-0.003", "lr-0.01"]  # 0.5 of 3 points: 2
    # lr-0.003's first run failed (no metrics): it does not go on, the next best does.
    TrainFolder(first["lr-0.003"] / "train").metrics.unlink()
    assert sweep_comparison.survivors(config) == ["lr-0.01", "lr-0.0001"]


@pytest.mark.e2e
def test_halving_stops_the_weak_points_and_its_survivors_go_on_bit_for_bit(grid_run, workdir):
    result = run_snakemake(workdir, HALVING, "sweep_compare")
    ran = jobs(result.stdout + result.stderr)
    assert sum(job.endswith("_first_train") for job in ran) == 2
    folder = workdir / "results" / "sweeps" / "halve"
    halving = json.loads((folder / "halving.json").read_text())
    # Which ones, from their losses: the test above. Ten steps at lr 1e-4 hardly move the weights.
    assert (halving["survivors"], halving["stopped"]) == (["lr-0.01"], ["lr-0.0001"])
    assert sorted(job for job in ran if job.endswith("_train") and "_first" not in job) == ["point_lr_0_01_train"]
    rows = {row["point"]: row for row in comparison(folder)}
    assert rows["lr-0.0001"]["status"] == "stopped" and rows["lr-0.0001"]["steps"] == "10"
    # A survivor's run resumed from the first budget: its time and speed are of its last attempt, and it says so.
    assert rows["lr-0.01"]["steps"] == "20 (10 in the last attempt)"
    resumed = json.loads(TrainFolder(folder / "lr-0.01" / "train").metrics.read_text())
    assert float(rows["lr-0.01"]["wall time (s, last attempt)"]) == pytest.approx(resumed["wall_time_s"], rel=1e-5)

    # The survivor against the same config trained to the end without the stop: grid_run's points
    # of its size (they differ from it by their quality gate alone, which training does not read).
    (point,) = [p for p in sweep.points(validated(GRID)) if p.values == {
        "model.hidden": HALVING["model"]["hidden"], "export.max_accuracy_drop": 100.0}]
    reference = grid_run[0] / "results" / "sweeps" / "grid" / point.name
    uninterrupted = json.loads(TrainFolder(reference / "train").metrics.read_text())
    # The losses, not the whole history: it holds each step's throughput too.
    for kind in ("train", "eval"):
        assert [(r["step"], r["loss"]) for r in resumed["history"][kind]] == [
            (r["step"], r["loss"]) for r in uninterrupted["history"][kind]]
    ours = initializers(folder / "lr-0.01" / "export" / "model.onnx")
    theirs = initializers(reference / "export" / "model.onnx")
    assert ours.keys() == theirs.keys()
    for name, array in ours.items():
        assert array.tobytes() == theirs[name].tobytes(), name

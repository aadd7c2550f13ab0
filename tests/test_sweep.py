"""Sweeps (src/ortflow/sweep.py, workflow/rules/sweep.smk): the points, their names
and checks, and a sweep run through Snakemake, compared in results/sweeps/<name>/."""

import csv
import json
import re
from pathlib import Path

import pytest

from conftest import run_snakemake
from ortflow import config as ortflow_config
from ortflow import sweep
from ortflow.errors import ConfigError
from ortflow.training.run_folder import TrainFolder


def sweep_config(**section) -> dict:
    return ortflow_config.validate({"sweep": {"name": "s", **section}})


def test_a_grid_makes_every_combination_named_by_its_values():
    config = sweep_config(grid={"train.optimizer.lr": [0.01, 0.001], "train.micro_batch_size": [16, 32]})
    points = sweep.points(config)
    assert [p.name for p in points] == ["lr-0.01_micro_batch_size-16", "lr-0.01_micro_batch_size-32",
                                        "lr-0.001_micro_batch_size-16", "lr-0.001_micro_batch_size-32"]
    assert points[3].config["train"]["optimizer"]["lr"] == 0.001
    assert points[3].config["train"]["micro_batch_size"] == 32
    assert points[3].config["sweep"]["point"] == "lr-0.001_micro_batch_size-32"
    assert sweep.results(points[3].config) == Path("results/sweeps/s/lr-0.001_micro_batch_size-32")


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
        assert 1e-4 <= lr <= 1e-2 and point.name.startswith(f"lr-{lr:g}_")


def test_repeats_train_each_point_with_the_next_seeds():
    config = ortflow_config.validate({"run": {"seed": 5}, "sweep": {"grid": {"train.optimizer.lr": [0.01]},
                                                                     "repeats": 2}})
    assert [(p.name, p.config["run"]["seed"]) for p in sweep.points(config)] == [("lr-0.01_seed-5", 5),
                                                                                ("lr-0.01_seed-6", 6)]


@pytest.mark.parametrize("grid, message", [
    ({"train.optimizer.lrr": [0.1]}, "sweep point 'lrr-0.1': config section 'train.optimizer': unknown key(s) lrr"),
    ({"train.optimizer.lr": [0.1, -1]}, "sweep point 'lr--1': config key 'train.optimizer.lr'"),
    ({"run.name": ["a"]}, "config key 'sweep': 'run.name' cannot be swept"),
])
def test_a_bad_key_or_value_names_the_point_and_the_key(grid, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        sweep.points(sweep_config(grid=grid))


def test_only_a_config_with_points_is_a_sweep():
    assert not sweep.is_sweep(ortflow_config.validate({}))
    assert sweep.is_sweep(sweep_config(grid={"train.optimizer.lr": [0.1]}))
    point = sweep.points(sweep_config(grid={"train.optimizer.lr": [0.1]}))[0]
    assert not sweep.is_sweep(point.config)


def test_stages_are_shared_by_the_keys_they_depend_on():
    points = sweep.points(sweep_config(grid={"train.optimizer.lr": [0.1, 0.01], "model.hidden": [[8], [16]]}))
    data_keys, graph_keys = ("run.seed", "data"), ("run.seed", "data", "model", "train.optimizer.name")
    assert len({sweep.shared(p.config, "data", data_keys) for p in points}) == 1
    assert len({sweep.shared(p.config, "artifacts", graph_keys) for p in points}) == 2


# A grid of 4 points on the default data, few steps of a tiny MLP on one rank each.
GRID = {
    "train": {"steps": 20, "world_size": 1, "eval_every": 10, "log_every": 5},
    "model": {"hidden": [16]},
    "sweep": {"name": "grid", "grid": {"train.optimizer.lr": [0.01, 0.001], "model.hidden": [[16], [32]]}},
}


def jobs(result) -> list[str]:
    """The rules of the jobs Snakemake ran (its `rule <name>:` lines)."""
    return [line[len("rule "):-1] for line in (result.stdout + result.stderr).splitlines()
            if line.startswith(("rule ", "localrule "))] + [
        line[len("localrule "):-1] for line in (result.stdout + result.stderr).splitlines()
        if line.startswith("localrule ")]


@pytest.mark.e2e
def test_a_grid_sweep_shares_its_stages_and_compares_its_points(workdir):
    result = run_snakemake(workdir, GRID)
    ran = jobs(result)
    assert sum(job.endswith("_prepare_data") for job in ran) == 1
    assert sum(job.endswith("_build_artifacts") for job in ran) == 2
    assert sum(job.endswith("_train") for job in ran) == 4
    folder = workdir / "results" / "sweeps" / "grid"
    with open(folder / "comparison.tsv") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
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
    assert f"best point {best['point']}" in result.stdout + result.stderr

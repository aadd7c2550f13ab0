"""The workflow on a real single-node Slurm cluster (tests/slurm/setup.sh brings
it up on localhost), through the repository's Slurm profile.

Needs root and Debian's packages; when the cluster cannot be started the tests
fail with the setup script's output, they do not skip."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BIN, REPO, run_snakemake

pytestmark = pytest.mark.cluster

PROFILE = REPO / "profiles" / "slurm"
# Small runs of a small MLP (what is tested is where the jobs run, not the model); the
# default world size (2) stays: training must be one 2-task job.
CONFIG = {"model": {"hidden": [32]},
          "train": {"steps": 30, "log_every": 10, "eval_every": 30, "checkpoint_every": 30}}
SWEEP = {**CONFIG, "sweep": {"name": "slurm", "grid": {"train.optimizer.lr": [0.01, 0.001]}}}
POINTS = ["lr-0.01", "lr-0.001"]
# The first status check after 2 s instead of the profile's 20 s, and every 2 s
# after it rather than 10 s later each time, keeps the runs short.
SLURM_ARGS = ("--workflow-profile", str(PROFILE), "--slurm-init-seconds-before-status-checks", "2")
SNAKEMAKE = (str(BIN / "python"), str(REPO / "tests" / "slurm" / "snakemake_fixed_polling.py"))
# Tests find their jobs in Slurm's accounting by working folder, and a folder's path can come
# again in a later run (pytest numbers its base folders anew once they are deleted): only the
# jobs since this module was imported, when this run began, are this run's.
RUN_STARTED = time.strftime("%Y-%m-%dT%H:%M:%S")


@pytest.fixture(scope="session")
def slurm_cluster():
    setup = subprocess.run(
        ["bash", str(REPO / "tests" / "slurm" / "setup.sh")],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900,
    )
    if setup.returncode != 0:
        pytest.fail(f"could not start the Slurm test cluster:\n{setup.stdout}\n{setup.stderr}")


@pytest.fixture(scope="module")
def slurm_run(slurm_cluster, tmp_path_factory):
    """A sweep of two points (docs/sweeps.md), run once through the Slurm profile:
    each point is the default workflow (`all`'s stages, its rules named
    point_<point>_<rule>) and the sweep adds its comparison, so one run puts
    every rule through Slurm, and a point's training beside another's."""
    workdir = tmp_path_factory.mktemp("slurm") / "work"
    result = run_snakemake(workdir, SWEEP, *SLURM_ARGS, snakemake=SNAKEMAKE)
    return workdir, result


def slurm_jobs(workdir: Path) -> dict[str, list[dict]]:
    """Slurm's accounting records of this run's jobs in `workdir`: job id -> the
    job's row followed by its steps' rows."""
    fields = "JobID,Comment,State,NTasks,NNodes,NodeList,AllocCPUS,WorkDir"
    out = subprocess.run(
        ["sacct", "--allusers", "--noheader", "--parsable2", "--starttime", RUN_STARTED,
         f"--format={fields}"],
        capture_output=True, text=True, check=True,
    ).stdout
    jobs: dict[str, list[dict]] = {}
    for row in csv.DictReader(out.splitlines(), fieldnames=fields.split(","), delimiter="|"):
        job_id = row["JobID"].split(".")[0]
        if "." not in row["JobID"] and row["WorkDir"] == str(workdir.resolve()):
            jobs[job_id] = [row]
        elif job_id in jobs:
            jobs[job_id].append(row)
    return jobs


def snakemake_job_counts(stderr: str) -> dict[str, int]:
    """The `Job stats` table Snakemake prints before running: rule -> jobs."""
    table = stderr.split("Job stats:", 1)[1].split("total", 1)[0]
    return {rule: int(count) for rule, count in re.findall(r"^(\w+)\s+(\d+)$", table, re.M)}


def test_the_workflow_runs_on_slurm_each_job_its_rules(slurm_run):
    workdir, result = slurm_run
    # Every target is there and newer than its inputs: a dry run finds nothing
    # to do (by modification times: the code may change during a test).
    dry = run_snakemake(workdir, SWEEP, "--dry-run", "--rerun-triggers", "mtime")
    assert "Nothing to be done" in dry.stdout + dry.stderr, dry.stdout + dry.stderr

    # Each job of the run was a Slurm job of its rule, and it completed.
    jobs = slurm_jobs(workdir)
    by_rule = {}
    for job_id, (job, *_steps) in jobs.items():
        assert job["State"] == "COMPLETED", (job_id, job)
        by_rule.setdefault(job["Comment"], []).append(job_id)
    expected = {f"rule_{rule}": count for rule, count in snakemake_job_counts(result.stderr).items()
                if rule != "sweep"}  # the default target has no command: Snakemake runs it locally
    assert {rule: len(ids) for rule, ids in by_rule.items()} == expected
    # Each point ran every stage of the default workflow's `all`.
    stages = ["prepare_data", "build_artifacts", "train", "merge_checkpoint", "export_model",
              "quantize_model", "plot_training", "report_tables"]
    shared = {"prepare_data", "build_artifacts"}  # made once, by the first point: their keys are equal
    assert set(expected) == {"rule_sweep_compare"} | {
        f"rule_point_{point}_{stage}" for point in ("lr_0_01", "lr_0_001") for stage in stages
        if stage not in shared or point == "lr_0_01"}, expected

    for point in POINTS:
        metrics = json.loads((workdir / "results/sweeps/slurm" / point / "train/metrics.json").read_text())
        assert metrics["steps"] == 30


def test_each_training_is_one_slurm_job_of_two_tasks(slurm_run):
    """Each point's training is one Slurm job of train.world_size tasks: the
    profile's settings for the rule `train` reach the points' training rules."""
    workdir, _ = slurm_run
    train_jobs = {rows[0]["Comment"]: rows for rows in slurm_jobs(workdir).values()
                  if rows[0]["Comment"].endswith("_train")}
    assert sorted(train_jobs) == ["rule_point_lr_0_001_train", "rule_point_lr_0_01_train"], train_jobs
    for job, *steps in train_jobs.values():
        assert (job["State"], job["AllocCPUS"]) == ("COMPLETED", "2"), job  # 2 tasks x cpus_per_task 1
        # The launcher's `srun` is the job's one parallel step: both ranks in it.
        srun_steps = [step for step in steps if re.fullmatch(r"\d+\.\d+", step["JobID"])]
        assert [(step["NTasks"], step["State"]) for step in srun_steps] == [("2", "COMPLETED")], steps
    for point in POINTS:
        log = (workdir / "logs/sweeps/slurm" / point / "train.log").read_text()
        assert re.search(r"srun --mpi=pmix -n 2 ", log), log
        assert "2 ranks" in log, log


def test_the_sweep_compares_its_points_trained_on_slurm(slurm_run):
    workdir, _ = slurm_run
    with open(workdir / "results" / "sweeps" / "slurm" / "comparison.tsv") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert sorted((row["point"], row["status"]) for row in rows) == [("lr-0.001", "finished"),
                                                                       ("lr-0.01", "finished")]


def test_cuda_training_asks_for_one_gpu_per_task(slurm_cluster, tmp_path):
    """Without a GPU Slurm refuses the job, but Snakemake's error shows the
    sbatch call it generated: one GPU per task for 4 tasks."""
    workdir = tmp_path / "work"
    run_snakemake(workdir, CONFIG, "build_artifacts")  # locally: only `train` goes to Slurm below
    config = {**CONFIG, "train": {**CONFIG["train"], "device": "cuda", "world_size": 4}}
    result = run_snakemake(workdir, config, "train", *SLURM_ARGS, check=False, snakemake=SNAKEMAKE)
    assert result.returncode != 0, result.stderr
    calls = re.findall(r"^\s*(sbatch .*--comment rule_train .*)$", result.stderr, re.M)
    assert len(calls) == 2, result.stderr[-4000:]  # the profile retries a training job once
    for call in calls:
        arguments = call.split(" --wrap=")[0].split()
        assert {"--gpus=4", "--ntasks=4", "--ntasks-per-gpu=1"} <= set(arguments), arguments
    # The cluster has no GPU: Slurm itself refused the GPU request.
    assert "Invalid generic resource (gres) specification" in result.stderr


def test_only_training_is_retried(slurm_cluster, tmp_path):
    """The profile submits a failed training job once more (it resumes from its
    checkpoint), but no other stage's: prepare_data on a file without the
    configured column fails once, as one Slurm job."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "bad.csv").write_text("a,b,y\n" + "".join(f"{i},{i},{i % 2}\n" for i in range(40)))
    config = {**CONFIG, "data": {"source": "bad.csv", "features": ["c"], "label": "y"}}
    result = run_snakemake(workdir, config, "prepare_data", *SLURM_ARGS, check=False, snakemake=SNAKEMAKE)
    assert result.returncode != 0, result.stderr
    assert "column(s) c not found" in result.stderr, result.stderr[-4000:]
    jobs = [rows[0] for rows in slurm_jobs(workdir).values()]
    assert [(job["Comment"], job["State"]) for job in jobs] == [("rule_prepare_data", "FAILED")], jobs

"""Training across two Slurm nodes, through the repository's Slurm profile, on
the test cluster of tests/slurm/setup.sh: its partition `twonodes` holds node1
and node2, each a slurmd in its own network and UTS namespace on this machine,
so that ranks on different nodes reach each other only over TCP.

Needs root and Debian's packages; when the cluster cannot be started the tests
fail with the setup script's output, they do not skip."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import BIN, REPO, fault, run_snakemake
from test_slurm import PROFILE, SLURM_ARGS, SNAKEMAKE, slurm_cluster, slurm_jobs  # noqa: F401 - the fixture

from ortflow.checkpoints import reader, resume

pytestmark = pytest.mark.cluster

PARTITION = "twonodes"
# 4 ranks on 2 nodes of 2 CPUs: 2 ranks per node. A small MLP and few steps;
# global batch 32 (8 x 4 ranks).
CONFIG = {
    "model": {"hidden": [64]},
    "train": {"world_size": 4, "nodes": 2, "micro_batch_size": 8, "steps": 30,
              "log_every": 10, "eval_every": 30, "checkpoint_every": 10},
}
TRAIN_DIR = Path("results/digits/train")
# Largest difference of a final weight between the same global batch summed by
# 4 ranks on 2 nodes and accumulated by 1 rank: measured 3.0e-8 (weights up to
# 0.18) after 30 steps; the reduction order differs, nothing else.
REDUCTION_ORDER_TOLERANCE = 1e-6


def with_train(**changes) -> dict:
    return {**CONFIG, "train": {**CONFIG["train"], **changes}}


@pytest.fixture(scope="module")
def two_node_profile(tmp_path_factory) -> Path:
    """The repository's profile with the partition of the two namespace nodes:
    the line a user edits for their cluster."""
    profile = yaml.safe_load((PROFILE / "config.yaml").read_text())
    profile["default-resources"]["slurm_partition"] = PARTITION
    folder = tmp_path_factory.mktemp("profile")
    (folder / "config.yaml").write_text(yaml.safe_dump(profile))
    return folder


def slurm_args(profile: Path) -> tuple[str, ...]:
    return ("--workflow-profile", str(profile), *SLURM_ARGS[2:])


def inputs_of(config: dict, tmp_path_factory) -> Path:
    """Shards and training artifacts of `config`, made once, locally: only training runs on Slurm."""
    workdir = tmp_path_factory.mktemp("two-node-inputs")
    run_snakemake(workdir, config, "build_artifacts")
    return workdir


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    return inputs_of(CONFIG, tmp_path_factory)


def workdir_with_inputs(inputs: Path, workdir: Path) -> Path:
    """A scratch workdir holding the shards and artifacts (with Snakemake's
    metadata, so they count as up to date), on the filesystem every node sees."""
    shutil.copytree(inputs / "results", workdir / "results")
    shutil.copytree(inputs / ".snakemake" / "metadata", workdir / ".snakemake" / "metadata")
    return workdir


def run_on_two_nodes(config: dict, inputs: Path, profile: Path, tmp_path_factory):
    """`train` of `config`, run through `profile`: one job on node1 and node2. Its workdir and Snakemake's result."""
    workdir = workdir_with_inputs(inputs, tmp_path_factory.mktemp("two-nodes") / "work")
    result = run_snakemake(workdir, config, "train", *slurm_args(profile), snakemake=SNAKEMAKE)
    return workdir, result


@pytest.fixture(scope="module")
def two_node_run(slurm_cluster, two_node_profile, inputs, tmp_path_factory):  # noqa: F811
    """`train` of CONFIG, run once through the profile."""
    return run_on_two_nodes(CONFIG, inputs, two_node_profile, tmp_path_factory)


def train_job(workdir: Path) -> tuple[dict, list[dict]]:
    """The accounting row of the (last) training job run in `workdir`, and its steps' rows."""
    jobs = [rows for rows in slurm_jobs(workdir).values() if rows[0]["Comment"] == "rule_train"]
    assert jobs, f"no training job in sacct for {workdir}"
    job, *steps = jobs[-1]
    return job, steps


def final_weights(train_dir: Path) -> dict[str, np.ndarray]:
    return reader.load_parameters(resume.latest(train_dir / "checkpoints").path)


def largest_difference(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> float:
    """Of any weight between two runs' final weights."""
    assert got.keys() == expected.keys()
    return max(float(np.max(np.abs(got[name] - expected[name]))) for name in got)


def full_config(overrides: dict) -> dict:
    from ortflow import config as config_mod

    return config_mod.as_dict(config_mod.load(overrides=overrides))


def log_of_one_job_on_both_nodes(workdir: Path, tasks: int) -> str:
    """The train log of the training job run in `workdir`, once sacct shows that the
    job completed and that the launcher's `srun` was its one parallel step, of
    `tasks` ranks on both nodes."""
    job, steps = train_job(workdir)
    assert job["State"] == "COMPLETED", job
    srun_steps = [step for step in steps if re.fullmatch(r"\d+\.\d+", step["JobID"])]
    assert [(s["NTasks"], s["NNodes"], s["NodeList"], s["State"]) for s in srun_steps] == [
        (str(tasks), "2", "node[1-2]", "COMPLETED")], steps
    log = (workdir / "logs/digits/train.log").read_text()
    assert f"srun --mpi=pmix -n {tasks} " in log, log
    return log


def test_training_runs_as_one_job_on_two_nodes(two_node_run):
    workdir, _ = two_node_run
    log = log_of_one_job_on_both_nodes(workdir, 4)
    # Each node runs 2 of the ranks, with node-local ranks 0 and 1 (what picks a GPU).
    placement = re.search(r"ranks per node: (.*)", log).group(1)
    assert placement == ("node1: rank 0 (local 0), rank 1 (local 1); "
                         "node2: rank 2 (local 0), rank 3 (local 1)"), placement


def test_shards_written_on_two_nodes_form_one_checkpoint(two_node_run):
    workdir, _ = two_node_run
    folder = workdir / TRAIN_DIR / "checkpoints" / "step-00000030"
    # read_checkpoint checks every shard against the manifest (sizes, digests, step).
    read = reader.read_checkpoint(folder)
    assert read.manifest.world_size == 4
    assert sorted(p.name for p in folder.glob("shard-*")) == [f"shard-0000{r}-of-00004.h5" for r in range(4)]
    assert json.loads((workdir / TRAIN_DIR / "metrics.json").read_text())["steps"] == 30


@pytest.fixture(scope="module")
def one_rank_run(inputs, tmp_path_factory) -> Path:
    """The global batch of CONFIG (32) as 1 rank accumulating 4 micro-batches of
    8, on this machine with mpirun: its train folder."""
    reference = tmp_path_factory.mktemp("one-rank") / "train"
    config = with_train(world_size=1, nodes=1, grad_accum_steps=4)
    subprocess.run(
        [str(BIN / "ortflow"), "train", "--config-json", json.dumps(full_config(config)),
         "--train", str(inputs / "results/digits/data/train"), "--eval", str(inputs / "results/digits/data/eval"),
         "--artifacts", str(inputs / "results/digits/artifacts"),
         "--out", str(reference)],
        check=True, capture_output=True, text=True,
    )
    return reference


def test_two_nodes_match_one_rank_with_the_same_global_batch(two_node_run, one_rank_run):
    """The same weights as 1 rank with the same global batch but for the reduction order."""
    workdir, _ = two_node_run
    difference = largest_difference(final_weights(workdir / TRAIN_DIR), final_weights(one_rank_run))
    assert difference <= REDUCTION_ORDER_TOLERANCE, difference


# ---- pipeline stages, one per node (issue 32)

# 2 stages of 1 copy, one rank on each node: the activations and their
# gradients cross the network between the stages. The global batch of CONFIG
# (32) in 4 micro-batches of 8 through the 1F1B schedule, as one_rank_run
# accumulates them.
PIPELINED = with_train(world_size=2, pipeline_stages=2, grad_accum_steps=4)


@pytest.fixture(scope="module")
def pipelined_inputs(inputs, tmp_path_factory) -> Path:
    """The artifacts cut into 2 stages (the whole model's beside them), from
    the shards of `inputs`: their data keys are the same, only build_artifacts runs."""
    workdir = workdir_with_inputs(inputs, tmp_path_factory.mktemp("two-node-inputs") / "work")
    run_snakemake(workdir, PIPELINED, "build_artifacts")
    return workdir


@pytest.fixture(scope="module")
def pipelined_run(slurm_cluster, two_node_profile, pipelined_inputs, tmp_path_factory):  # noqa: F811
    """`train` of PIPELINED, run once through the profile."""
    return run_on_two_nodes(PIPELINED, pipelined_inputs, two_node_profile, tmp_path_factory)


def test_two_stages_train_one_on_each_node_as_one_rank_does(pipelined_run, one_rank_run):
    """One job of 2 tasks on node1 and node2; the train log's placement and stages
    together say that stage 0 ran on node1 and stage 1 on node2. The losses,
    evaluation and final weights are those of 1 rank accumulating the same 4
    micro-batches without stages (the pipeline's own tests: bit for bit)."""
    workdir, _ = pipelined_run
    log = log_of_one_job_on_both_nodes(workdir, 2)
    assert "global batch 32 (8 x 4 accumulated x 1 copy of 2 stages)" in log, log
    assert re.search(r"ranks per node: (.*)", log).group(1) == "node1: rank 0 (local 0); node2: rank 1 (local 0)"
    stages = re.search(r"pipeline stages: (.*)", log).group(1)
    assert re.fullmatch(r"rank 0: stage 0 \(\d+ parameter tensors?\); rank 1: stage 1 \(\d+ parameter tensors?\)",
                        stages), stages

    # Every rank wrote its part of its stage; read together, the whole model's weights.
    difference = largest_difference(final_weights(workdir / TRAIN_DIR), final_weights(one_rank_run))
    print(f"2 stages on 2 nodes against 1 rank, after 30 steps: largest weight difference {difference:.3g}")
    assert difference <= REDUCTION_ORDER_TOLERANCE, difference
    metrics = [json.loads((folder / "metrics.json").read_text()) for folder in (workdir / TRAIN_DIR, one_rank_run)]
    losses = [[entry["loss"] for entry in run["history"]["train"]] for run in metrics]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], abs=REDUCTION_ORDER_TOLERANCE), losses
    evaluations = [(run["eval"]["loss"], run["eval"]["accuracy"]) for run in metrics]
    assert evaluations[0] == pytest.approx(evaluations[1], abs=REDUCTION_ORDER_TOLERANCE), evaluations


# ---- a node fails mid-run


def node_netns(node: str) -> str:
    return f"ortflow-{node}"


def fail_node(node: str) -> None:
    """What a node's crash looks like to the others: its network goes silent
    (no connection is closed cleanly), and its slurmd and job processes die."""
    netns = node_netns(node)
    subprocess.run(["ip", "-n", netns, "link", "set", "eth0", "down"], check=True)
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, check=True).stdout.split()
    subprocess.run(["kill", "-9", *pids], check=False)


def restore_node(node: str) -> None:
    """Network up and slurmd started again (setup.sh); the node rejoins (ReturnToService=2)."""
    subprocess.run(["ip", "-n", node_netns(node), "link", "set", "eth0", "up"], check=True)
    setup = subprocess.run(["bash", str(REPO / "tests" / "slurm" / "setup.sh")],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert setup.returncode == 0, setup.stdout + setup.stderr


def wait_for(what: str, condition, timeout: float = 300) -> None:
    """Wait until `condition()` holds; the timeout bounds the wait, it is not what is checked."""
    deadline = time.monotonic() + timeout
    while not (held := condition()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert held, f"waited {timeout:.0f} s for {what}"


def heartbeat(train_dir: Path, rank: int) -> dict:
    try:
        return json.loads((train_dir / "heartbeat" / f"rank-{rank}.json").read_text())
    except (OSError, ValueError):
        return {}


def test_a_failed_node_ends_the_job_and_the_rerun_on_the_other_resumes(
    slurm_cluster, two_node_profile, inputs, two_node_run, tmp_path  # noqa: F811
):
    """Rank 2 (node2's first) stops at step 15, after the checkpoint of step 10,
    and node2 dies. The ranks on node1 give up after the collective timeout,
    naming rank 2, and the job fails; a rerun with both ranks on node1 (the same
    global batch, 16 x 2) resumes from step 10 and ends with the weights of the
    uninterrupted run."""
    workdir = workdir_with_inputs(inputs, tmp_path / "work")
    train_dir = workdir / TRAIN_DIR
    config = with_train(collective_timeout_s=10)
    # The profile's retry would ask for 2 nodes again (excluding the failed
    # ones): this partition has no others, and the job would wait forever.
    run = start_snakemake(workdir, config, two_node_profile, "--preemptible-retries", "0",
                          env=fault(15, 2, "stall"))
    try:
        wait_for("rank 2 at step 15", lambda: heartbeat(train_dir, 2).get("step") == 15)
        assert (train_dir / "checkpoints" / "step-00000010" / "COMPLETE").exists()
        fail_node("node2")
        output, _ = run.communicate(timeout=300)  # fails rather than hangs
    finally:
        if run.poll() is None:
            run.kill()
        restore_node("node2")
    assert run.returncode != 0, output[-4000:]
    log = (workdir / "logs/digits/train.log").read_text()
    assert re.search(r"did not finish within train.collective_timeout_s=10s; rank 2 is behind: "
                     r"last seen at step 15", log), log
    job, _ = train_job(workdir)
    assert job["State"] in ("FAILED", "NODE_FAIL"), job

    # The rerun: the remaining node, the same global batch, the default timeout.
    rerun = with_train(world_size=2, nodes=1, micro_batch_size=16)
    run_snakemake(workdir, rerun, "train", *slurm_args(two_node_profile), snakemake=SNAKEMAKE)
    log = (workdir / "logs/digits/train.log").read_text()
    assert re.search(r"resuming at step 10 from \S*/checkpoints/step-00000010", log), log
    assert re.search(r"ranks per node: node1: rank 0 \(local 0\), rank 1 \(local 1\)$", log, re.M), log
    difference = largest_difference(final_weights(train_dir), final_weights(two_node_run[0] / TRAIN_DIR))
    assert difference <= REDUCTION_ORDER_TOLERANCE, difference


def start_snakemake(workdir: Path, config: dict, profile: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """`train` through `profile`, in the background, with `env` added to the
    environment (sbatch passes it on to the job): the test acts while it runs."""
    configfile = workdir / "test-config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    return subprocess.Popen(
        [*SNAKEMAKE, "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
         "--configfile", str(configfile), "--cores", "2", "train", *slurm_args(profile), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
    )


# ---- stopped mid-run, as before a time limit or on preemption


@pytest.mark.parametrize("config, inputs_fixture, uninterrupted_fixture", [
    pytest.param(CONFIG, "inputs", "two_node_run", id="P1"),
    pytest.param(PIPELINED, "pipelined_inputs", "pipelined_run", id="P2"),
])
def test_a_job_stopped_by_a_signal_comes_back_and_resumes(
    config, inputs_fixture, uninterrupted_fixture, two_node_profile, request, tmp_path
):
    """`scancel --signal=USR1` reaches the ranks as the profile's warning before
    the time limit does (`--signal=USR1@300`: to every task of the job's steps).
    node2's first rank (rank 2 of 4; with 2 pipeline stages rank 1, the second
    stage) stalls at step 15 and the signal comes then: the ranks stop after
    that step with a checkpoint, the job fails, Snakemake submits it again (the
    profile's `preemptible-retries`) and the second job resumes and finishes, with the
    weights of the uninterrupted run bit for bit. (A real time limit of 1 minute,
    Slurm's smallest, was tried: its warning comes anywhere in that minute, and
    stopped the resumed jobs too.)"""
    shipped = yaml.safe_load((PROFILE / "config.yaml").read_text())
    assert shipped["preemptible-rules"] == ["train"] and shipped["preemptible-retries"] >= 1
    assert "--signal=USR1@" in shipped["set-resources"]["train"]["slurm_extra"]
    workdir = workdir_with_inputs(request.getfixturevalue(inputs_fixture), tmp_path / "work")
    train_dir = workdir / TRAIN_DIR
    stalled = config["train"]["world_size"] // 2  # ranks are placed in blocks: node2's first
    run = start_snakemake(workdir, config, two_node_profile, env=fault(15, stalled, "stall"))
    try:
        wait_for(f"rank {stalled} at step 15", lambda: heartbeat(train_dir, stalled).get("step") == 15)
        job_id = subprocess.run(["squeue", "-h", "-p", PARTITION, "-t", "RUNNING", "-o", "%i"],
                                capture_output=True, text=True, check=True).stdout.split()
        assert len(job_id) == 1, job_id
        subprocess.run(["scancel", "--signal=USR1", job_id[0]], check=True)
        output, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, output[-4000:]
    states = [rows[0]["State"] for rows in slurm_jobs(workdir).values() if rows[0]["Comment"] == "rule_train"]
    assert states == ["FAILED", "COMPLETED"], (states, output[-3000:])
    log = (workdir / "logs/digits/train.log").read_text()
    assert re.search(r"resuming at step 16 from \S*/checkpoints/step-00000016", log), log
    uninterrupted = final_weights(request.getfixturevalue(uninterrupted_fixture)[0] / TRAIN_DIR)
    resumed = final_weights(train_dir)
    assert all(np.array_equal(uninterrupted[name], resumed[name]) for name in uninterrupted)

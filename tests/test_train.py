"""The training stage: through the real workflow (mpirun ranks, all-reduce, metrics,
failures), and the launcher's (ortflow.stages.train, ortflow.launcher) commands and what it does before the ranks start
(ortflow.training.attempt)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import fault, run_snakemake
from ortflow import config as config_mod, launcher
from ortflow.checkpoints import reader, resume
from ortflow.training import attempt
from ortflow.training.run_folder import AttemptFinished, TrainFolder, write_finished

SHORT = {"train": {"steps": 30, "log_every": 5, "eval_every": 15, "checkpoint_every": 10}}


def _metrics(workdir: Path, run: str = "digits") -> dict:
    return json.loads((workdir / f"results/{run}/train/metrics.json").read_text())


def _log(workdir: Path, run: str = "digits") -> str:
    return (workdir / f"logs/{run}/train.log").read_text()


@pytest.mark.e2e
def test_default_config_reaches_95_percent(default_run):
    metrics = _metrics(default_run)
    assert metrics["steps"] == 300
    assert metrics["eval"]["accuracy"] >= 0.95, metrics["eval"]
    for key in ("train_loss", "samples_per_s", "step_time_p50_s", "step_time_p95_s", "flops_per_s"):
        assert metrics[key] > 0, key
    assert metrics["step_time_p95_s"] >= metrics["step_time_p50_s"]
    assert len(metrics["peak_rss_mb"]) == 2 and min(metrics["peak_rss_mb"]) > 10
    log = _log(default_run)
    assert "2 ranks, global batch 64 (32 x 1 accumulated x 2 ranks)" in log
    assert "step 300/300 loss" in log and " eta " in log


@pytest.mark.e2e
def test_tensorboard_scalars_read_back(default_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(default_run / "results/digits/train/tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/samples_per_s", "eval/loss", "eval/accuracy"):
        assert tag in tags, tags
    assert [e.step for e in events.Scalars("train/loss")] == list(range(10, 301, 10))
    assert [e.step for e in events.Scalars("eval/accuracy")] == [100, 200, 300]
    final = events.Scalars("eval/accuracy")[-1].value
    assert final == pytest.approx(_metrics(default_run)["eval"]["accuracy"], abs=1e-6)
    # The cosine schedule: warmup to the peak at step 20, then down to ~0 at the end.
    lrs = {e.step: e.value for e in events.Scalars("train/lr")}
    assert lrs[20] == pytest.approx(0.003, rel=1e-3) and lrs[300] < 1e-5
    assert events.Tags()["histograms"], "no parameter histograms"


@pytest.mark.e2e
def test_keeps_the_last_checkpoints(default_run):
    root = default_run / "results/digits/train/checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000200", "step-00000300"]


def _final_parameters(workdir: Path) -> dict:
    return reader.load_parameters(resume.latest(workdir / "results/digits/train/checkpoints").path)


# SGD steps, whose weights keep the size of the gradients' rounding: AdamW moves each element by
# about the learning rate however small its gradient, so a bound on its weights would let the CPU's
# summation order decide (tests/torch_reference.py).
SGD = {"train": {**SHORT["train"], "optimizer": {"name": "sgd", "lr": 0.1, "weight_decay": 0.0}}}


@pytest.mark.e2e
def test_world_size_and_accumulation_are_equivalent(digits_workdir, tmp_path):
    """Data parallelism's core property: 2 ranks x 1 micro-batch == 1 rank x 2 accumulated micro-batches,
    and both train as single-process PyTorch does."""
    two_ranks = digits_workdir
    one_rank = tmp_path / "w1"
    shutil.copytree(two_ranks, one_rank)
    run_snakemake(two_ranks, {"train": {**SGD["train"], "world_size": 2, "grad_accum_steps": 1}}, "train")
    run_snakemake(one_rank, {"train": {**SGD["train"], "world_size": 1, "grad_accum_steps": 2}}, "train")
    a, b = _final_parameters(two_ranks), _final_parameters(one_rank)
    assert a.keys() == b.keys()
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert worst <= 1e-6, worst
    reference = _pytorch_reference(one_rank)
    worst_torch = max(float(np.abs(a[k] - reference[k]).max()) for k in a)
    assert worst_torch <= 1e-6, worst_torch


@pytest.mark.e2e
def test_failing_rank_ends_the_job(digits_workdir):
    workdir = digits_workdir
    result = run_snakemake(workdir, SHORT, "train", check=False, timeout=180, env=fault(5, 1, "raise"))
    assert result.returncode != 0
    log = _log(workdir)
    assert "injected failure on rank 1 at step 5" in log
    assert "the ranks exited with code" in log
    assert not (workdir / "results/digits/train/metrics.json").exists()


@pytest.mark.e2e
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(digits_workdir):
    workdir = digits_workdir
    result = run_snakemake(workdir, SHORT, "train", check=False, env=fault(12, 0, "nan"))
    assert result.returncode != 0
    assert "non-finite loss nan" in _log(workdir) and "at step 13" in _log(workdir)
    assert "the last good checkpoint, " in _log(workdir) and "step-00000010, is kept" in _log(workdir)
    assert resume.latest(workdir / "results/digits/train/checkpoints").step == 10


@pytest.mark.e2e
def test_corrupt_shard_stops_before_the_first_step(digits_workdir):
    workdir = digits_workdir
    shard = workdir / "results/digits/data/train/shard-00001.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = run_snakemake(workdir, SHORT, "train", check=False)
    assert result.returncode != 0
    log = _log(workdir)
    assert f"shard {shard.relative_to(workdir)}: checksum mismatch" in log
    assert "step 1/" not in log and "step 5/" not in log


@pytest.mark.e2e
def test_watchdog_names_the_stalled_rank(digits_workdir):
    workdir = digits_workdir
    config = {"train": {**SHORT["train"], "collective_timeout_s": 4}}
    result = run_snakemake(workdir, config, "train", check=False, timeout=180, env=fault(3, 1, "stall"))
    assert result.returncode != 0
    log = _log(workdir)
    assert "did not finish within train.collective_timeout_s=4s" in log
    assert "rank 1 is behind: last seen at step 3 (forward)" in log


def _pytorch_reference(workdir: Path) -> dict:
    """The same training in plain single-process PyTorch (tests/torch_reference.py)."""
    from ortflow import config as config_mod
    from ortflow.models.mlp import MLP
    from torch_reference import load_initial, train_like_ortflow

    cfg = config_mod.load(overrides={"train": {**SGD["train"], "world_size": 1, "grad_accum_steps": 2}})
    results = workdir / "results/digits"
    model = load_initial(MLP([64], cfg.model.hidden, [10]), results / "artifacts")
    return train_like_ortflow(model, cfg, results / "data/train")[1]


@pytest.mark.e2e
def test_gpt_learns_text_well_below_the_unigram_baseline(workdir):
    """A GPT-style decoder on Python's own documentation, byte level, 2 ranks."""
    config = {
        "run": {"name": "text"},
        "data": {"source": "text", "context": 64, "eval_fraction": 0.05},
        "model": {"kind": "gpt", "layers": 2, "heads": 4, "width": 64},
        "train": {"world_size": 2, "micro_batch_size": 16, "steps": 250, "eval_every": 250,
                  "checkpoint_every": 250, "eval_batch_size": 64, "optimizer": {"lr": 0.006}},
    }
    run_snakemake(workdir, config, "train")
    metrics = _metrics(workdir, "text")
    evaluation, unigram = metrics["eval"], metrics["baseline"]["perplexity"]
    print("gpt eval:", evaluation, "unigram:", unigram)
    assert unigram > 15  # bytes of English prose: ~4 bits each
    assert evaluation["perplexity"] < 0.7 * unigram, evaluation
    assert evaluation["perplexity"] == pytest.approx(math.exp(evaluation["loss"]), rel=1e-9)


def test_launcher_commands():
    assert launcher.launcher_command("/x/mpirun", 2, 2) == ["/x/mpirun", "-n", "2", "--bind-to", "none"]
    assert launcher.launcher_command("mpirun", 3, 2)[-1] == "--oversubscribe"
    assert launcher.launcher_command("srun", 4, 2) == ["srun", "--mpi=pmix", "-n", "4"]
    with pytest.raises(ValueError, match="unknown MPI launcher 'torchrun'"):
        launcher.launcher_command("torchrun", 2, 2)


def test_rerun_after_a_finished_run_moves_its_checkpoints_aside(tmp_path, capsys):
    folder = TrainFolder(tmp_path / "train")
    (folder.checkpoints / "step-00000300").mkdir(parents=True)
    folder.tensorboard.mkdir()
    folder.heartbeat.mkdir()
    write_finished(folder, AttemptFinished(300))
    attempt.start_attempt(folder, resume_from=None)
    previous = TrainFolder(folder.previous)
    assert (previous.checkpoints / "step-00000300").is_dir() and previous.tensorboard.is_dir()
    assert not folder.checkpoints.exists() and not folder.finished.exists()
    assert not folder.heartbeat.exists()
    assert f"its checkpoints and TensorBoard events are moved to {folder.previous}" in capsys.readouterr().err
    # After an interrupted run, or with train.resume_from, nothing moves.
    folder.checkpoints.mkdir()
    attempt.start_attempt(folder, resume_from=None)
    write_finished(folder, AttemptFinished(300))
    attempt.start_attempt(folder, resume_from=str(folder.checkpoints))
    assert folder.checkpoints.is_dir() and not folder.finished.exists()


def test_a_second_live_attempt_is_refused_in_one_line(tmp_path, capsys):
    out = TrainFolder(tmp_path / "train")
    first = attempt.lock_attempt(out)
    assert first is not None
    assert attempt.lock_attempt(out) is None
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert f"ortflow train: error: another attempt of this run is still training in {out} (ortflow train pid" in error
    first.close()
    assert attempt.lock_attempt(out) is not None


# A fresh process, so that the rise of VmHWM (reset by clear_refs 5) over the resident memory is
# what the evaluation took; argv: artifacts, train split, whether the sessions share an arena.
EVAL_AFTER_A_STEP = """
import sys
from pathlib import Path

import numpy as np

from ortflow import config
from ortflow.artifacts import Artifacts
from ortflow.data.shards import ShardReader
from ortflow.training import engine

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

if sys.argv[3] == "an arena a session":
    engine.share_cpu_arena = lambda options: None
artifacts = Artifacts(Path(sys.argv[1]))
module, step = engine.open_sessions(artifacts, engine.initial_state(artifacts), "cpu", 1,
                                    config.load().train.optimizer, np)
reader = ShardReader(Path(sys.argv[2]))
batch = reader.gather(np.arange(4096) % reader.manifest.records)
module.train()
module(*[batch[name] for name in module.input_names()])
module.eval()
feeds = [batch[name] for name in module.input_names()]
open("/proc/self/clear_refs", "w").write("5")
start = status("VmRSS")
module(*feeds)
print(status("VmHWM") - start)
"""


def test_a_ranks_evaluation_takes_its_memory_from_the_training_steps_arena(tmp_path):
    """A rank's training, eval and optimizer sessions share one CPU arena (sessions.share_cpu_arena):
    an evaluation after a training step runs in the memory the step freed. With an arena a session,
    the eval graph's own arena grew the rank by its whole working set (GPT-2 124M: +814 MiB over
    the step's peak). An MLP of width 1024 at 4096 records: its activations are 16 MiB each."""
    from ortflow.stages import build_artifacts
    from ortflow.stages.prepare_data import prepare

    cfg = config_mod.load(overrides={"model": {"kind": "mlp", "hidden": [1024, 1024]}})
    prepare(cfg, tmp_path / "train", tmp_path / "eval")
    build_artifacts.build(cfg, tmp_path / "train", tmp_path / "artifacts")

    def eval_rise(arena: str) -> int:
        done = subprocess.run([sys.executable, "-c", EVAL_AFTER_A_STEP, str(tmp_path / "artifacts"),
                               str(tmp_path / "train"), arena], capture_output=True, text=True, check=True)
        return int(done.stdout.split()[-1])

    separate, shared = eval_rise("an arena a session"), eval_rise("shared")
    assert separate > 16 * 2**20, f"the eval's own arena took {separate / 2**20:.1f} MiB"
    assert shared < separate / 4, f"shared arena: the eval took {shared / 2**20:.1f} MiB, {separate / 2**20:.1f} on its own"


# Imported by every Python process that has it on its PYTHONPATH (site's
# sitecustomize); slows down only the ranks that mpirun starts.
SLOW_RANKS = """
import atexit, os, time

if "OMPI_COMM_WORLD_RANK" in os.environ:
    time.sleep(float(os.environ["SLOW_RANKS_START_S"]))
    atexit.register(time.sleep, float(os.environ["SLOW_RANKS_END_S"]))
"""


def launch(workdir: Path, out: Path, start_s: float = 0, end_s: float = 0) -> subprocess.Popen:
    """`ortflow train` of 40 steps on the default run's data and artifacts in `workdir`,
    into `out`, its ranks `start_s` seconds late to start Python and `end_s` to exit."""
    site = out.parent / "site"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(SLOW_RANKS)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
                        "SLOW_RANKS_START_S": str(start_s), "SLOW_RANKS_END_S": str(end_s)}
    config = config_mod.load(overrides={"train": {"steps": 40, "eval_every": 40}})
    results = workdir / "results/digits"
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "ortflow"), "train", "--config-json", json.dumps(config_mod.as_dict(config)),
         "--train", str(results / "data/train"), "--eval", str(results / "data/eval"),
         "--artifacts", str(results / "artifacts"), "--out", str(out)],
        env=env, stderr=subprocess.PIPE, text=True)


def wait_for(condition, what: str, timeout: float = 120) -> None:
    """Wait until `condition()` holds, for `timeout` seconds at most; fail naming `what` if it never did."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition(), f"never {what}"


@pytest.mark.e2e
def test_a_stop_before_the_ranks_listen_is_held_until_they_do(digits_inputs, tmp_path):
    """A SIGUSR1 kills a rank that is still starting Python: the launcher forwards the
    stop once every rank has its handler, and the ranks stop after their first step."""
    import psutil

    out = TrainFolder(tmp_path / "train")
    launcher = launch(digits_inputs, out.folder, start_s=3)
    wait_for(lambda: psutil.Process(launcher.pid).children(), "started mpirun")
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 128 + signal.SIGTERM, stderr
    assert "ortflow train: SIGTERM: the ranks finish their step, write a checkpoint and stop (they are killed after " \
           "20 s); held until every rank listens for it (0 of 2 do)" in stderr
    assert "stopping after step 1 of 40: SIGUSR1 on 2 ranks" in stderr
    assert "ortflow train: stopped by SIGTERM after step 1, with a checkpoint; rerun to resume from it" in stderr
    assert resume.latest(out.checkpoints).step == 1


@pytest.mark.e2e
def test_a_stop_after_the_last_step_leaves_a_finished_run(digits_inputs, tmp_path):
    out = TrainFolder(tmp_path / "train")
    launcher = launch(digits_inputs, out.folder, end_s=3)
    wait_for(lambda: out.metrics.exists(), "wrote metrics.json")  # after the last step
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, stderr
    assert "ortflow train: SIGTERM came after the ranks had agreed on their last step; training finished" in stderr
    assert json.loads(out.finished.read_text()) == {"steps": 40}

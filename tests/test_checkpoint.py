"""Sharded checkpoints through the real workflow: per-rank shards, resume after kill -9,
resume with another world size, merge, reshard, and refusals of bad checkpoints."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_identical, copy_inputs, fault, run_snakemake
from ortflow import cli, config as config_mod
from ortflow.checkpoints import ort_format, reader, resume
from ortflow.errors import TrainingError
from ortflow.training.comm import read_beat
from ortflow.training.preflight import host_cores
from ortflow.training.schedule import learning_rate

pytestmark = pytest.mark.e2e

# A global batch of 48 splits over 1, 2 and 3 ranks: 16 x 3 accumulated, 24 x 1 x 2, 16 x 1 x 3.
TRAIN = {"steps": 40, "micro_batch_size": 24, "grad_accum_steps": 1, "world_size": 2, "checkpoint_every": 10,
         "keep_checkpoints": 3, "log_every": 10, "eval_every": 40}
RUN = "results/digits"


def _config(**train) -> dict:
    return {"train": {**TRAIN, **train}}


def _root(workdir: Path) -> Path:
    return workdir / RUN / "train/checkpoints"


def _log(workdir: Path) -> str:
    return (workdir / "logs/digits/train.log").read_text()


def _state(folder: Path) -> ort_format.TrainingState:
    return reader.read_checkpoint(folder).state


def _max_difference(a: ort_format.TrainingState, b: ort_format.TrainingState) -> float:
    """Largest absolute difference over every parameter and every optimizer state."""
    assert a.parameters.keys() == b.parameters.keys()
    worst = max(float(np.abs(a.parameters[k] - b.parameters[k]).max()) for k in a.parameters)
    for name, moments in a.optimizer_states.items():
        for moment, array in moments.items():
            worst = max(worst, float(np.abs(array - b.optimizer_states[name][moment]).max()))
    return worst


def _copy_run(reference: Path, workdir: Path, keep_training: bool = True) -> Path:
    """A copy of the reference run's folder (Snakemake's records too), so that later runs
    reuse its data and artifacts; without `keep_training`, as if training never ran."""
    shutil.copytree(reference, workdir, symlinks=True)
    if not keep_training:
        shutil.rmtree(workdir / RUN / "train")
        shutil.rmtree(workdir / RUN / "checkpoint")
    return workdir


@pytest.fixture(scope="module")
def reference(digits_inputs, tmp_path_factory) -> Path:
    """40 uninterrupted steps on 2 ranks, a checkpoint every 10, merged (the default
    config's shards and artifacts: TRAIN changes neither)."""
    workdir = copy_inputs(digits_inputs, tmp_path_factory.mktemp("reference") / "work")
    run_snakemake(workdir, _config(), "train", "merge_checkpoint")
    return workdir


def test_each_rank_writes_its_shard(reference):
    root = _root(reference)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000020", "step-00000030", "step-00000040"]
    folder = root / "step-00000040"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (folder / "COMPLETE").exists() and manifest["step"] == 40 and manifest["world_size"] == 2
    files = [folder / e["file"] for e in manifest["shards"]]
    assert [f.name for f in files] == ["shard-00000-of-00002.h5", "shard-00001-of-00002.h5"]
    for entry, file in zip(manifest["shards"], files):
        assert hashlib.sha256(file.read_bytes()).hexdigest() == entry["sha256"]
    # Half of the bytes each, and every element of every parameter in exactly one shard.
    sizes = [f.stat().st_size for f in files]
    assert max(sizes) < 0.52 * sum(sizes), sizes
    owned = [e["parameters"] for e in manifest["shards"]]
    initial = reader.load_parameters_file(reference / RUN / "artifacts/checkpoint")
    assert set(owned[0]) | set(owned[1]) == set(initial)
    for name, array in initial.items():
        ranges = sorted(tuple(part[name]) for part in owned if name in part)
        assert ranges[0][0] == 0 and ranges[-1][1] == array.size, (name, ranges)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (name, ranges)
    attrs, part = reader.read_shard(files[1])
    assert (attrs["rank"], attrs["world_size"], attrs["step"]) == (1, 2, 40)
    assert attrs["identity_digest"] == manifest["identity_digest"]
    assert attrs["checkpoint_id"] == manifest["checkpoint_id"]
    assert {n: [start, start + part.parameters[n].size] for n, (_, start) in part.slices.items()} == owned[1]
    assert all(set(part.optimizer_states[n]) == {"momentum0", "momentum1"} for n in part.parameters)
    assert part.optimizer["step"] == 40
    assert part.properties["step"] == 40 and part.properties["samples_seen"] == 40 * 48
    train = config_mod.load(overrides=_config()).train
    last_lr = learning_rate(39, 40, train.optimizer.lr, train.lr_schedule)
    assert part.properties["lr"] == pytest.approx(last_lr, rel=1e-6)  # stored as float32


def test_merged_checkpoint_loads_and_trains_in_a_new_module(reference):
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    merged = reference / RUN / "checkpoint"
    meta = json.loads((merged / "meta.json").read_text())
    shards = _state(_root(reference) / "step-00000040")
    assert meta["step"] == 40 and meta["identity_digest"] == json.loads(
        (_root(reference) / "step-00000040/manifest.json").read_text())["identity_digest"]
    assert_identical(ort_format.read_ort_checkpoint(merged / "checkpoint"), shards)
    assert_identical(reader.assemble([reader.read_shard(merged / "checkpoint.h5")[1]], merged), shards)

    artifacts = reference / RUN / "artifacts"
    state = CheckpointState.load_checkpoint(str(merged / "checkpoint"))
    assert state.properties["step"] == 40
    module = Module(str(artifacts / "training_model.onnx"), state, str(artifacts / "eval_model.onnx"))
    optimizer = Optimizer(str(artifacts / "optimizer_model.onnx"), module)
    rng = np.random.default_rng(0)
    module(rng.random((8, 64), dtype=np.float32), rng.integers(0, 10, 8))
    optimizer.step()
    after = ort_format.training_state(state)
    assert after.optimizer["step"] == 41  # the optimizer went on from the merged step count
    assert _max_difference(after, shards) > 0


def test_rebuilt_ort_checkpoint_resumes_bit_exactly(reference):
    """The flatbuffer built from arrays resumes exactly like ONNX Runtime's own file,
    and both like training that never stopped."""
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    artifacts = reference / RUN / "artifacts"
    rng = np.random.default_rng(1)
    batches = [(rng.random((8, 64), dtype=np.float32), rng.integers(0, 10, 8)) for _ in range(6)]

    def train(state, batches):
        module = Module(str(artifacts / "training_model.onnx"), state, str(artifacts / "eval_model.onnx"))
        optimizer = Optimizer(str(artifacts / "optimizer_model.onnx"), module)
        for x, y in batches:
            optimizer.set_learning_rate(0.01)
            module(x, y)
            optimizer.step()
            module.lazy_reset_grad()
        return ort_format.training_state(state)

    uninterrupted = train(CheckpointState.load_checkpoint(str(artifacts / "checkpoint")), batches)
    halfway = CheckpointState.load_checkpoint(str(artifacts / "checkpoint"))
    train(halfway, batches[:3])
    rebuilt = ort_format.ort_state(ort_format.training_state(halfway))
    assert_identical(train(rebuilt, batches[3:]), uninterrupted)


def _process(workdir: Path, command: str, rank: int | None = None):
    """The process whose command line holds `command`, running in `workdir` (of MPI rank
    `rank`, if given): other tests may be training at the same time."""
    import psutil

    for process in psutil.process_iter(["cmdline", "cwd"]):
        try:
            if command in " ".join(process.info["cmdline"] or []) and process.info["cwd"] == str(workdir) and \
                    (rank is None or process.environ().get("OMPI_COMM_WORLD_RANK") == str(rank)):
                return process
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def _rank_process(workdir: Path, rank: int):
    return _process(workdir, "ortflow.training.trainer", rank)


def _stalled_at_step_25(workdir: Path) -> tuple[threading.Thread, dict]:
    """Start `snakemake train` in `workdir`; return once rank 1 waits at step 25 (after
    the checkpoint of step 20) until it is killed or asked to stop."""
    stall = _config(collective_timeout_s=600)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(
        run=run_snakemake(workdir, stall, "train", check=False, env=fault(25, 1, "stall"))))
    runner.start()
    heartbeat = workdir / RUN / "train/heartbeat/rank-1.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            if read_beat(heartbeat).step == 25:
                return runner, result
        except (OSError, TrainingError):  # not there yet
            pass
        time.sleep(0.2)
    pytest.fail("rank 1 never reached step 25")


def test_kill_9_one_rank_then_rerun_is_bit_identical(reference, tmp_path):
    workdir = _copy_run(reference, tmp_path / "work", keep_training=False)
    runner, result = _stalled_at_step_25(workdir)
    process = _rank_process(workdir, 1)
    assert process is not None, "rank 1 is not running"
    process.kill()  # SIGKILL
    runner.join(timeout=240)
    assert result["run"].returncode != 0
    root = _root(workdir)
    assert resume.latest(root).step == 20
    # A checkpoint the crash left half-written must be skipped.
    shutil.copytree(root / "step-00000020", root / "step-00000030")
    (root / "step-00000030/COMPLETE").unlink()

    run_snakemake(workdir, _config(), "train")
    log = _log(workdir)
    assert f"resuming at step 20 from {RUN}/train/checkpoints/step-00000020" in log
    assert "skipping checkpoint results/digits/train/checkpoints/step-00000030 is incomplete" in log
    assert_identical(_state(root / "step-00000040"), _state(_root(reference) / "step-00000040"))


def _assert_resumes_at_26_bit_identically(workdir: Path, reference: Path) -> None:
    """The rerun goes on from the checkpoint of the stop, to the reference's weights, with the whole history."""
    run_snakemake(workdir, _config(), "train")
    assert f"resuming at step 26 from {RUN}/train/checkpoints/step-00000026" in _log(workdir)
    assert_identical(_state(_root(workdir) / "step-00000040"), _state(_root(reference) / "step-00000040"))
    metrics = json.loads((workdir / RUN / "train/metrics.json").read_text())
    assert [entry["step"] for entry in metrics["history"]["train"]] == [10, 20, 30, 40]
    assert (metrics["steps"], metrics["steps_this_attempt"]) == (40, 14)


@pytest.mark.parametrize("target", ["launcher", "rank 1"])
def test_sigterm_stops_with_a_checkpoint_at_the_step_reached(reference, tmp_path, target):
    workdir = _copy_run(reference, tmp_path / "work", keep_training=False)
    runner, result = _stalled_at_step_25(workdir)
    process = _process(workdir, "bin/ortflow train") if target == "launcher" else _rank_process(workdir, 1)
    process.send_signal(signal.SIGTERM)
    runner.join(timeout=120)
    assert result["run"].returncode != 0
    log = _log(workdir)
    # The ranks finish step 26 (rank 1 was in it), then write its checkpoint, not that of step 20.
    seen = "SIGUSR1 on" if target == "launcher" else "SIGTERM on 1 rank"
    assert f"stopping after step 26 of 40: {seen}" in log
    assert f"checkpoint {RUN}/train/checkpoints/step-00000026 written; rerun to resume from it" in log
    assert "ortflow train: stopped by SIGTERM after step 26, with a checkpoint" in log
    assert resume.latest(_root(workdir)).step == 26
    _assert_resumes_at_26_bit_identically(workdir, reference)


def test_kill_9_of_snakemake_leaves_no_rank_behind(reference, tmp_path):
    workdir = _copy_run(reference, tmp_path / "work", keep_training=False)
    runner, _ = _stalled_at_step_25(workdir)
    _process(workdir, "--snakefile").kill()  # SIGKILL
    runner.join(timeout=60)
    # They stop after a checkpoint; the deadline bounds the wait, what is checked is that none is left.
    # Snakemake stays a zombie until the test reaps it, after the rule's shell ends: still seen as gone.
    deadline = time.monotonic() + 60
    while (left := [c for c in ("-m ortflow.training.trainer", "bin/ortflow train", "bin/prterun")
                    if _process(workdir, c)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], f"outlived Snakemake by 60 s: {left}"
    log = _log(workdir)
    assert ", which started this launcher, exited" in log and "stopping after step 26 of 40" in log
    run_snakemake(workdir, _config(), "--unlock")  # Snakemake's own lock outlives a SIGKILL
    _assert_resumes_at_26_bit_identically(workdir, reference)


def test_damaged_newest_checkpoints_are_skipped(reference, tmp_path):
    workdir = _copy_run(reference, tmp_path / "work")
    root = _root(workdir)
    # As if the run had crashed before it finished: the rerun resumes.
    (workdir / RUN / "train/metrics.json").unlink()
    (workdir / RUN / "train/FINISHED").unlink()
    shard = root / "step-00000040/shard-00001-of-00002.h5"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    manifest = root / "step-00000030/manifest.json"
    manifest.write_text(manifest.read_text()[:200])

    run_snakemake(workdir, _config(), "train")
    log = _log(workdir)
    assert f"skipping shard {RUN}/train/checkpoints/step-00000040/shard-00001-of-00002.h5: checksum mismatch" in log
    assert f"skipping {RUN}/train/checkpoints/step-00000030/manifest.json: not readable as JSON" in log
    assert f"resuming at step 20 from {RUN}/train/checkpoints/step-00000020" in log
    assert_identical(_state(root / "step-00000040"), _state(_root(reference) / "step-00000040"))


def test_rerun_after_a_finished_run_trains_from_step_0(reference, tmp_path):
    workdir = _copy_run(reference, tmp_path / "work")
    root = _root(workdir)
    run_snakemake(workdir, _config(), "train", "-R", "train")
    log = _log(workdir)
    assert f"its checkpoints and TensorBoard events are moved to {RUN}/train/previous" in log
    assert "starting at step 0" in log
    assert (workdir / RUN / "train/previous/checkpoints/step-00000040/COMPLETE").exists()
    # The same training from scratch: the same weights.
    assert_identical(_state(root / "step-00000040"), _state(_root(reference) / "step-00000040"))
    for steps in (30, 50):  # fewer, more: retrained, never a checkpoint of another step count
        run_snakemake(workdir, _config(steps=steps), "train")
        assert "starting at step 0" in _log(workdir)
        metrics = json.loads((workdir / RUN / "train/metrics.json").read_text())
        assert metrics["steps"] == metrics["steps_this_attempt"] == steps
        assert metrics["history"]["train"][-1]["step"] == steps
        assert resume.latest(root).step == steps


def test_user_onnx_file_replaced_in_place_retrains(digits_workdir, tmp_path):
    import onnx
    from onnx import numpy_helper
    from test_artifacts import onnx_model

    workdir = digits_workdir
    path = onnx_model(tmp_path / "user.onnx")
    settings = {"model": {"kind": "onnx", "path": str(path)},
                "train": {"steps": 20, "checkpoint_every": 10, "log_every": 10, "eval_every": 20}}
    run_snakemake(workdir, settings, "train")
    # As if the run had crashed after its last checkpoint: a plain rerun would resume.
    (workdir / RUN / "train/metrics.json").unlink()
    (workdir / RUN / "train/FINISHED").unlink()
    model = onnx.load(str(path))
    weight = model.graph.initializer[0]
    weight.CopyFrom(numpy_helper.from_array(2 * numpy_helper.to_array(weight), weight.name))
    onnx.save(model, str(path))  # same path, same shapes, other weights

    run_snakemake(workdir, settings, "train", "-R", "build_artifacts")
    log = _log(workdir)
    assert f"skipping checkpoint {RUN}/train/checkpoints/step-00000020: another training identity (model.path: " \
           "'sha256:" in log
    assert "starting at step 0" in log


def test_resume_with_another_world_size(reference, tmp_path):
    """W=2 -> W=1 from step 20, then W=1 -> W=3 from step 30; the global batch stays 48."""
    workdir = _copy_run(reference, tmp_path / "work")
    root = _root(workdir)
    expected = _state(_root(reference) / "step-00000040")
    run_snakemake(workdir, _config(world_size=1, micro_batch_size=16, grad_accum_steps=3,
                                   resume_from=str(root / "step-00000020")), "train")
    assert "1 rank, global batch 48 (16 x 3 accumulated x 1 rank), resuming at step 20" in _log(workdir)
    assert json.loads((root / "step-00000030/manifest.json").read_text())["world_size"] == 1
    one_rank = _state(root / "step-00000040")
    result = run_snakemake(workdir, _config(world_size=3, micro_batch_size=16,
                                            resume_from=str(root / "step-00000030")), "train")
    assert "3 ranks, global batch 48 (16 x 1 accumulated x 3 ranks), resuming at step 30" in _log(workdir)
    cores = host_cores()
    if cores < 3:  # oversubscribed: the preflight's warning is kept, and said again as snakemake ends
        warning = (f"world size: train.world_size=3 ranks on {cores} cores: oversubscribed, ranks share cores and "
                   f"run slowly (fix: set train.world_size to at most {cores} for speed)")
        assert json.loads((workdir / RUN / "train/metrics.json").read_text())["warnings"] == [warning]
        assert f"  warning   {warning}" in result.stdout
    assert len(list((root / "step-00000040").glob("shard-*-of-00003.h5"))) == 3
    three_ranks = _state(root / "step-00000040")
    # Only the order of the floating-point sums differs: measured 2.0e-7 for both
    # (parameters and AdamW moments, default MLP); allowed 1e-6.
    assert three_ranks.optimizer["step"] == 40
    differences = [_max_difference(result, expected) for result in (one_rank, three_ranks)]
    assert max(differences) < 1e-6, differences


def test_another_identity_is_skipped_and_refused(reference, tmp_path):
    workdir = _copy_run(reference, tmp_path / "work")
    (workdir / RUN / "train/FINISHED").unlink()  # as if interrupted: its checkpoints stay where they are
    root = _root(workdir)
    other_lr = {"name": "adamw", "lr": 0.002, "weight_decay": 0.01}
    run_snakemake(workdir, _config(optimizer=other_lr, steps=10), "train", "merge_checkpoint")
    log = _log(workdir)
    assert "skipping checkpoint results/digits/train/checkpoints/step-00000040: another training identity " \
           "(optimizer.lr: 0.003 in the checkpoint, 0.002 now, steps: 40 in the checkpoint, 10 now)" in log
    assert "starting at step 0" in log
    # The other identity's checkpoints are kept; this run's newest is the one merged.
    assert sorted(p.name for p in root.iterdir()) == ["step-00000010", "step-00000020", "step-00000030",
                                                      "step-00000040"]
    assert json.loads((workdir / RUN / "checkpoint/meta.json").read_text())["step"] == 10

    before = {p: p.read_bytes() for p in (root / "step-00000040").iterdir()}
    refused = run_snakemake(workdir, _config(optimizer=other_lr, resume_from=str(root / "step-00000040")), "train",
                            check=False)
    assert refused.returncode != 0
    assert f"train.resume_from: checkpoint {root / 'step-00000040'} belongs to another training identity; " \
           "differs: optimizer.lr: 0.003 in the checkpoint, 0.002 now" in _log(workdir)
    assert {p: p.read_bytes() for p in (root / "step-00000040").iterdir()} == before


def _cli(capsys, *args) -> subprocess.CompletedProcess:
    """`ortflow checkpoint *args` in this process (cli.main, what the console script calls): its exit
    code and what it printed, without starting Python and importing ONNX Runtime again for each."""
    capsys.readouterr()
    code = cli.main(["checkpoint", *map(str, args)])
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, printed.out, printed.err)


@pytest.mark.parametrize("damage", ["missing", "checksum", "mixed"])
def test_bad_checkpoints_are_refused_and_nothing_is_overwritten(reference, tmp_path, capsys, damage):
    folder = shutil.copytree(_root(reference) / "step-00000040", tmp_path / "step-00000040")
    shard = folder / "shard-00001-of-00002.h5"
    if damage == "missing":
        shard.unlink()
        reason = f"shard {shard} is missing (manifest.json lists 2 shards)"
    elif damage == "checksum":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        reason = f"shard {shard}: checksum mismatch"
    else:
        shutil.copyfile(_root(reference) / "step-00000030" / shard.name, shard)
        reason = f"shard {shard} belongs to another checkpoint (step 30"
    out = shutil.copytree(reference / RUN / "checkpoint", tmp_path / "merged")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for args in (("merge", folder, out), ("reshard", folder, out, "-n", "3"), ("inspect", folder)):
        result = _cli(capsys, *args)
        assert result.returncode == 1, result.stderr
        assert reason in result.stderr, result.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # Training refuses it the same way (the ranks call this before the first step).
    with pytest.raises(ort_format.CheckpointError, match="shard .*shard-00001-of-00002.h5"):
        resume.load_state(resume.Resume(folder, 40, {}))


def test_reshard_and_inspect(reference, tmp_path, capsys):
    source = _root(reference) / "step-00000040"
    result = _cli(capsys, "reshard", source, tmp_path / "three", "-n", "3")
    assert result.returncode == 0, result.stderr
    assert_identical(_state(tmp_path / "three"), _state(source))
    report = _cli(capsys, "inspect", tmp_path / "three")
    assert report.returncode == 0, report.stderr
    assert "step 40, 3 shards (checksums verified)" in report.stdout
    assert "shard-00002-of-00003.h5" in report.stdout and "momentum0, momentum1" in report.stdout

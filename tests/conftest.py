"""Shared test helpers: run the real workflow with Snakemake in a scratch folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# The tests run as if the environment were activated (`.venv/bin/python -m pytest`
# works too): rules call `ortflow`, the launcher calls `mpirun`, both from BIN.
os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ['PATH']}"
# The README's test command runs two tests at a time (pytest-xdist), so two runs' ranks
# share the cores: a rank waiting in an all-reduce yields its core instead of spinning,
# which made two concurrent 2-rank all-reduce loops 1.6x faster on 2 cores.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")

# The test being set up or run. The fast loop (-m "not e2e and not cluster and not slow")
# leaves out what starts Snakemake or mpirun: a test that does, itself or through a
# fixture, must be marked e2e (or cluster), or run_snakemake and run_on_ranks fail it.
running: pytest.Item | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    global running
    running = item
    if ungrouped:
        pytest.fail("--dist loadgroup: pytest-xdist did not tag the tests with their group; install the "
                    "pytest that pyproject.toml's dev extra pins", pytrace=False)


def pytest_configure(config: pytest.Config) -> None:
    """pytest-xdist hands out the groups biggest first by their count of tests (a module of
    many quick unit tests before the Slurm cluster's 12 slow ones); in collection order
    instead, which pytest_collection_modifyitems below makes longest first."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist, a module's tests run on one worker, so that its module-scoped
    fixtures (a training run that its tests read) run once; the Slurm test cluster's
    tests all run on one worker, one at a time, and first: they are the longest group
    (about a third of the suite), and started last they would leave the other worker idle."""
    for item in items:
        group = "slurm" if item.get_closest_marker("cluster") else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: not item.get_closest_marker("cluster"))  # stable: the rest keep their order


def pytest_collection_finish(session: pytest.Session) -> None:
    """pytest-xdist tags each test's node id with its group (`...@group`); where it cannot
    (pytest 9.2 moved node ids where pytest-xdist 3.8 does not write: pyproject.toml pins
    pytest), every worker would run a module's fixtures again. Each test then fails saying
    so, rather than the suite taking twice as long unseen."""
    global ungrouped
    ungrouped = (getattr(session.config.option, "loadgroup", False) and bool(session.items)
                 and "@" not in session.items[0].nodeid)


ungrouped = False


def once_per_run(tmp_path_factory, name: str, make) -> Path:
    """The folder `name` filled by `make(folder)` once for the whole test run: pytest-xdist's
    workers share it (the first to come makes it, the others wait on its lock)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' base folders sit side by side in it
    folder, done = root / name, root / f"{name}.done"
    with FileLock(root / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


def cache_folder() -> Path:
    return Path(os.environ.get("ORTFLOW_TEST_CACHE") or Path.home() / ".cache" / "ortflow-tests")


def environment(name: str, packages: list[str], borrow: bool = False, pip: tuple[str, ...] = ()) -> Path:
    """The python of the cache folder's environment `name`: created once, `packages` installed (or
    checked) each run with pip's options `pip`. `borrow` puts the test environment's site-packages
    after its own (a .pth file), so that only what it lacks is installed."""
    import sysconfig

    from filelock import FileLock

    venv = cache_folder() / name
    venv.parent.mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    with FileLock(str(venv) + ".lock"):  # two test runs share the folder
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        if borrow:  # written each run: the test environment may be another one (a fresh clone's)
            site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip()
            Path(site, "test-environment.pth").write_text(
                f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
        install = subprocess.run([str(python), "-m", "pip", "install", "-q", *pip, *packages],
                                 capture_output=True, text=True, timeout=1800)
    assert install.returncode == 0, install.stderr[-3000:]
    return python


def require_e2e(what: str) -> None:
    if running is not None and not any(running.get_closest_marker(mark) for mark in ("e2e", "cluster")):
        test = running.nodeid.partition("@")[0]  # without the group pytest-xdist appends
        pytest.fail(f"{test} {what}: mark it @pytest.mark.e2e (see pyproject.toml's markers)")


def fault(step: int, rank: int, mode: str) -> dict:
    """The environment that breaks rank `rank` at step `step` (ortflow.training.faults)."""
    return {"ORTFLOW_FAULT": json.dumps({"step": step, "rank": rank, "mode": mode})}


@contextmanager
def opened_paths():
    """Every path Python opens while in the block (audit event "open": open(), os.open, h5py on a file object)."""
    seen, active = [], [True]

    def hook(event, args):
        if active[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            seen.append(os.path.abspath(os.fsdecode(args[0])))  # as asked for: links are not followed

    sys.addaudithook(hook)
    try:
        yield seen
    finally:
        active[0] = False


def outside(paths: list[str], folder: Path) -> list[str]:
    """The paths not in `folder` and not Python's own files (lazily imported modules)."""
    return [p for p in paths if not p.startswith(str(folder.resolve())) and not p.startswith(sys.prefix)
            and not p.startswith(sys.base_prefix) and not p.endswith((".py", ".pyc", ".so"))]


def run_snakemake(workdir: Path, config: dict, *args: str, check: bool = True, timeout: int = 900,
                  env: dict | None = None, snakemake: tuple[str, ...] = (str(BIN / "snakemake"),)):
    """Run the repository's Snakefile in `workdir` with `config` layered over
    config/config.yaml, and `env` added to the environment, with the command
    `snakemake`. Returns the CompletedProcess; its output is kept for assertions
    and shown when `check` fails."""
    require_e2e("runs Snakemake")
    workdir.mkdir(parents=True, exist_ok=True)
    configfile = workdir / "test-config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    command = [
        *snakemake,
        "--snakefile", str(REPO / "Snakefile"),
        "--directory", str(workdir),
        "--configfile", str(configfile),
        "--cores", "2",
        *args,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    if check and result.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-4000:]}" for p in sorted(workdir.glob("logs/**/*.log")))
        pytest.fail(f"snakemake failed ({result.returncode}):\n{result.stderr[-6000:]}\n{logs}")
    return result


def gate_judged(gate: dict, log: str, quantized: str = "int8") -> bool:
    """Whether quantize_model's gate entry (export/metrics.json) and its log agree with its numbers,
    whichever side of export.max_accuracy_drop the `quantized` model (int8, int4) landed: that differs
    by CPU (int8 kernels round differently with and without AVX-512 VNNI), so no test may expect one side."""
    passed = gate["drop"] <= gate["max_accuracy_drop"]
    said = f"quality gate passed: {quantized} loses" if passed else f"the {quantized} model is refused"
    return gate["outcome"] == ("passed" if passed else "refused") and said in log


def run_on_ranks(folder: Path, code: str, ranks: int) -> subprocess.CompletedProcess:
    """Run the Python `code` on `ranks` real MPI ranks (mpirun, as training starts
    them); fails the test unless every rank exits 0. Returns the CompletedProcess."""
    from ortflow import launcher

    require_e2e("starts MPI ranks")
    script = folder / "ranks.py"
    script.write_text(code)
    result = subprocess.run(
        launcher.launcher_command("mpirun", ranks, 2) + [sys.executable, str(script)],
        env=launcher.launcher_env(os.environ), capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def shard_manifest(features: list[tuple[str, str, list[int]]], label: tuple[str, str, list[int]] = ("y", "int64", []),
                   task: str = "classification", num_classes: int | None = 3, **fields):
    """A split's manifest (data/manifest.py) with these columns, no shards and the other `fields`
    given: what the model builders read of the data, without preparing any."""
    from ortflow.data.manifest import FORMAT, Column, Manifest

    return Manifest(format=FORMAT, split="train", records=0, record_bytes=0,
                    features=tuple(Column(n, d, tuple(s)) for n, d, s in features), label=Column(*label[:2], tuple(label[2])),
                    task=task, num_classes=num_classes, shards=(), source={}, **fields)


def model_description(**fields):
    """A model.json record (graphs/description.py) of a small classifier, with `fields` changed:
    for the checks that read the description alone, without building artifacts."""
    from ortflow.graphs.description import Flops, ModelDescription, Outputs, Tensor

    return ModelDescription(**{
        "kind": "mlp", "task": "classification", "loss": "cross_entropy", "num_classes": 3,
        "inputs": (Tensor("x", "float32", ("batch", 4)),), "label": Tensor("y", "int64", ("batch",)),
        "outputs": Outputs("loss", "logits", "logits"), "parameters": 15, "trainable_parameters": 15,
        "trainable": ("weight", "bias"), "frozen": (), "embeddings": (), "flops_per_sample": Flops(24, 48),
        "activation_bytes_per_sample": 64} | fields)


def train_summary(**fields):
    """A train/metrics.json record (training/run_summary.py) of a short run on one rank, with `fields`
    changed: for the report, the summary and a sweep's comparison, without training."""
    from ortflow.training.run_summary import RunSummary

    return RunSummary(**{
        "steps": 60, "train_loss": 0.3, "eval": {"loss": 0.25}, "samples_per_s": 1536.0, "step_time_p50_s": 0.04,
        "step_time_p95_s": 0.05, "flops_per_s": 1e9, "peak_rss_mb": (300.0,), "global_batch_size": 64,
        "wall_time_s": 12.5, "history": {"train": [], "eval": []}} | fields)


def export_metrics(fp32: dict, int8: dict | None = None, gate: dict | None = None):
    """An export/metrics.json record (quantization/export_metrics.py) of dynamic int8 with these
    entries: for the summary, the report and a sweep's comparison, without quantizing."""
    from ortflow.quantization.export_metrics import ExportMetrics, Gate

    return ExportMetrics("dynamic", False, 1, fp32=fp32, int8=int8, gate=Gate(**gate) if gate else None)


def merged_meta(folder: Path, step: int, identity_digest: str = "0" * 64) -> None:
    """A merged checkpoint's meta.json (checkpoints/meta.py) of the last checkpoint at `step`, beside
    a checkpoint a test wrote itself (without training and merging)."""
    from ortflow.checkpoints.meta import Merged, write_merged

    write_merged(folder, Merged(f"{step}-test", step, 1, {}, identity_digest, {}, str(folder)))


def assert_identical(a, b) -> None:
    """Training states `a` and `b` (ort_format.TrainingState) are bit-identical: parameters,
    optimizer states, the optimizer's and the checkpoint's properties."""
    import numpy as np

    for name in a.parameters:
        assert np.array_equal(a.parameters[name], b.parameters[name]), name
        for moment, array in a.optimizer_states[name].items():
            assert np.array_equal(array, b.optimizer_states[name][moment]), (name, moment)
    assert a.optimizer == b.optimizer and a.properties == b.properties


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`
    in the generation tests): on 2 shared cores, torch's generate with two threads took from 0.7 to
    15 s for the same 64 tokens, with one 0.2 s."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path / "work"


def copy_inputs(source: Path, workdir: Path) -> Path:
    """`workdir` with the results of the run in `source` and Snakemake's records of
    them, so that they count as up to date there."""
    shutil.copytree(source / "results", workdir / "results")
    shutil.copytree(source / ".snakemake" / "metadata", workdir / ".snakemake" / "metadata")
    return workdir


@pytest.fixture(scope="session")
def digits_inputs(tmp_path_factory) -> Path:
    """prepare_data and build_artifacts of the default config, run once per test run (once_per_run)."""
    def make(workdir: Path) -> None:
        run_snakemake(workdir, {}, "build_artifacts")

    return once_per_run(tmp_path_factory, "digits-inputs", make)


@pytest.fixture
def digits_workdir(digits_inputs: Path, tmp_path: Path) -> Path:
    """A scratch workdir that already holds the default run's shards and
    artifacts (with Snakemake's metadata, so they count as up to date)."""
    return copy_inputs(digits_inputs, tmp_path / "work")


@pytest.fixture(scope="session")
def default_run(digits_inputs: Path, tmp_path_factory) -> Path:
    """The default config (digits, MLP [512, 512], 2 ranks, 300 steps, dynamic int8)
    built to the end (`all`) once per test run, from digits_inputs' shards and artifacts.
    Tests only read it; one that runs a stage again works on a copy."""
    def make(folder: Path) -> None:
        run_snakemake(copy_inputs(digits_inputs, folder / "work"), {})

    return once_per_run(tmp_path_factory, "default", make) / "work"

"""`ortflow doctor`: what is installed, whether MPI starts the ranks and they can
all-reduce, and whether a config fits this machine, as one table.

The cheap checks, which the training launcher also runs before it starts any
rank, live in training/preflight.py; the ones that take longer or only inform
(versions, MPI library, the rank check) in diagnosis/. This module runs them
in the table's order, skipping what an earlier row rules out, and prints the table.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .. import atomic, config as config_mod
from ..diagnosis.config_checks import check_config, model_checks
from ..diagnosis.installation import check_mpi_library, check_providers, check_root, check_version
from ..diagnosis.ranks import check_ranks
from ..training.preflight import (
    FAIL, OK, SKIP, Check, check_disk, check_launcher, check_onnxruntime_distributions, check_training_import,
    check_precision, check_world_size, cpu_flags, cuda_checks, installed_distributions, measured_speedup,
)
from ..wording import plural


def diagnose(args) -> list[Check]:
    """The table's rows in order; a row that an earlier one rules out is skipped, saying why."""
    checks = [Check("python", OK, f"{sys.version.split()[0]} ({sys.executable})")]
    config_check, config = check_config(args)
    world_size = args.world_size or config.train.world_size
    device = config.train.device
    checks.append(config_check)
    for distribution in ("ortflow", "onnxruntime-training", "onnx", "torch", "snakemake", "mpi4py"):
        checks.append(check_version(distribution))
    checks += [
        check_mpi_library(),
        check_onnxruntime_distributions(installed_distributions()),
        check_training_import(),
    ]
    training_imports = checks[-1].status == OK
    checks.append(check_providers(device) if training_imports else Check("execution providers", SKIP, "skipped: onnxruntime does not import"))
    launcher, fits = check_launcher("mpirun"), check_world_size(world_size, device)
    flags = cpu_flags()
    precision = check_precision(config.train.precision, device, flags, measured_speedup(flags, device))
    checks += [launcher, check_root(), fits, precision]

    cuda = device == "cuda"
    if cuda:
        cuda_rows = cuda_checks()
        cupy, gpus = cuda_rows[0], cuda_rows[-1]
        checks += cuda_rows
    else:
        checks += [Check(name, SKIP, "skipped: train.device is cpu") for name in ("CuPy", "CUDA libraries", "GPUs")]
    report = None
    if launcher.status == FAIL or fits.status == FAIL:
        why = "mpirun not found" if launcher.status == FAIL else "the world size does not fit this host"
        checks.append(Check(f"mpirun -n {world_size}", SKIP, f"skipped: {why}"))
    else:
        ranks, report = check_ranks(world_size, args.timeout, nccl=cuda and gpus.status == OK)
        checks.append(ranks)
    if not cuda:
        checks.append(Check("NCCL all-reduce", SKIP, "skipped: train.device is cpu"))
    elif gpus.status != OK:
        why = "needs CuPy" if cupy.status != OK else "no GPU"
        checks.append(Check("NCCL all-reduce", SKIP, f"skipped: {why}"))
    elif report is None:
        checks.append(Check("NCCL all-reduce", SKIP, "skipped: the ranks did not start"))
    elif report["nccl"]:
        checks.append(Check("NCCL all-reduce", FAIL, f"failed: {report['nccl']}", "NCCL_DEBUG=INFO ortflow doctor shows why"))
    else:
        checks.append(Check("NCCL all-reduce", OK, f"{plural(world_size, 'rank')}, correct"))
    checks.append(check_disk(Path("results")))
    return checks + model_checks(args, config, world_size)


def render(checks: list[Check]) -> str:
    from tabulate import tabulate

    rows = [(c.name, c.status, c.detail + (f"\nfix: {c.fix}" if c.fix else "")) for c in checks]
    return tabulate(rows, headers=("check", "status", "detail"), maxcolwidths=[None, None, 100])


# The config keys this stage reads, which its rule passes (stages/__init__.py).
KEYS = ("train",)
HELP = "check the installation, MPI and a config against this machine; exit non-zero when something required fails"


def add_arguments(parser) -> None:
    config_mod.add_config_arguments(parser)

    def positive(text: str) -> int:
        value = int(text)
        if value < 1:
            raise ValueError(text)
        return value

    parser.add_argument("--world-size", type=positive, help="ranks to check (default: train.world_size of the config)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds the mpirun rank check may take (default: 60)")
    parser.add_argument("--output", help="also write the table to this file")
    parser.add_argument("--artifacts", type=Path,
                        help="the built model whose memory and checkpoints are checked against this host "
                             "(default: results/<run.name>/artifacts)")


def run(args) -> int:
    checks = diagnose(args)
    table = render(checks)
    failed = [c.name for c in checks if c.status == FAIL]
    summary = f"\n{len(failed)} required check(s) failed: {', '.join(failed)}" if failed else "\nall required checks passed"
    print(table + summary)
    if args.output:
        atomic.write_text(Path(args.output), table + summary + "\n")
    return 1 if failed else 0

"""What a stage process pays for ONNX Runtime's imports before it does any work, with ortflow's
way into it against the plain one, each in a fresh process, the two alternated round by round:

- onnxruntime: `import onnxruntime`, plain (onnxruntime-training's check imports ORTModule, and
  torch and sympy with it) against after `ort_private.skip_ortmodule()`, as cli.py and the ranks do;
- checkpoint schema: ORT's checkpoint flatbuffer classes, as the merge and export read a checkpoint:
  through `onnxruntime.tools` (whose __init__ imports torch) against `ort_private.checkpoint_schema`;
- training api: `import onnxruntime.training.api`, as the ranks do, plain against after skip_ortmodule.

Figures: CPU seconds (user + system) of the process, median of the rounds, and their ratio.

    python bench/bench_stage_imports.py --rounds 5
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import subprocess
import sys

from bench_quantize import cpu_model  # the CPU's name from /proc/cpuinfo (this script's folder is on sys.path)

SKIP = "from ortflow import ort_private; ort_private.skip_ortmodule(); "
CASES = {
    "onnxruntime": ("import onnxruntime", SKIP + "import onnxruntime"),
    "checkpoint schema": ("import onnxruntime.tools.ort_format_model.ort_flatbuffers_py.fbs.Checkpoint",
                          SKIP + "ort_private.checkpoint_schema('Checkpoint')"),
    "training api": ("import onnxruntime.training.api", SKIP + "import onnxruntime.training.api"),
}


def cpu_seconds(code: str) -> float:
    """The CPU time of a fresh Python running `code`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"{cpu_model()}, Python {platform.python_version()}, {args.rounds} rounds, median CPU s")
    print(f"{'import':<20}{'plain':>8}{'ortflow':>9}{'ratio':>8}")
    for name, (plain, ours) in CASES.items():
        times: dict[str, list[float]] = {"plain": [], "ortflow": []}
        for _ in range(args.rounds):
            times["plain"].append(cpu_seconds(plain))
            times["ortflow"].append(cpu_seconds(ours))
        a, b = statistics.median(times["plain"]), statistics.median(times["ortflow"])
        print(f"{name:<20}{a:>8.2f}{b:>9.2f}{a / b:>7.1f}x")


if __name__ == "__main__":
    main()

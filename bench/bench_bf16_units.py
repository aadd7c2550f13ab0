"""Why bfloat16 pays on one CPU and not on another: the peak multiply-accumulate rate of one
core's AVX-512 float32 FMA against AVX512_BF16's dot product (bench/bf16_units.c, compiled here
with gcc), as GMAC/s and their ratio. Where the dot product peaks at twice float32's rate, a
bfloat16 product can be up to twice as fast; where it peaks at half (an Intel core without AMX),
no kernel built on it can beat float32 (docs/benchmarks.md). Needs a CPU with AVX512_BF16.

    python bench/bench_bf16_units.py [--iterations 10000000]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench_precision import cpu_name

SOURCE = Path(__file__).with_name("bf16_units.c")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10_000_000, help="loop iterations of each round")
    args = parser.parse_args()
    if "avx512_bf16" not in Path("/proc/cpuinfo").read_text():
        raise SystemExit("this CPU has no AVX512_BF16: nothing to measure")
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise SystemExit("no C compiler (gcc or cc) on PATH: install gcc")
    with tempfile.TemporaryDirectory() as folder:
        binary = Path(folder) / "bf16_units"
        subprocess.run([compiler, "-O2", "-mavx512f", "-mavx512bf16", str(SOURCE), "-o", str(binary)], check=True)
        fp32, bf16 = map(float, subprocess.run([str(binary), str(args.iterations)], check=True,
                                               capture_output=True, text=True).stdout.split())
    print(f"{cpu_name()}, one core: float32 FMA {fp32:.1f} GMAC/s, bfloat16 dot product {bf16:.1f} GMAC/s, "
          f"bf16 / fp32 {bf16 / fp32:.2f}x")


if __name__ == "__main__":
    main()

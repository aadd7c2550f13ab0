"""Huge pages for ONNX Runtime's weights in the process that generates (`ortflow generate`).

Each new token at batch 1 reads every weight of the decoder once (500 MB for GPT-2 124M in
float32), so generation is bound by how fast one core streams memory. ONNX Runtime allocates
its weights (their packed copies) with malloc, and where the kernel hands out transparent huge
pages only to memory that asks for them (THP `madvise`, as on this project's machines) they
sit on 4 KiB pages, and the stream misses the TLB every 4 KiB. glibc's tunable
`glibc.malloc.hugetlb=1` (glibc 2.35 and later) makes malloc ask: on an AMD EPYC (Zen 4),
GPT-2 124M's fp32 decoder generated 1.08x the tokens/s at batch 1 on one thread, the peak RSS
unchanged (docs/benchmarks.md, "Huge pages for the decoder's weights"). glibc reads its
tunables when a process starts, so the command re-executes itself with the tunable set
(`restart_with_hugepages`); a GLIBC_TUNABLES that names it already (`glibc.malloc.hugetlb=0`
to turn this off) is left as it is.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library this Python runs on, None where it is not glibc."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    except (AttributeError, ValueError, OSError):  # no confstr, or a C library that does not answer
        return None
    major, minor = version.split(".")[:2]
    return (int(major), int(minor)) if name == "glibc" else None


def wanted(environ: dict[str, str]) -> bool:
    """Whether a process started with `environ` would gain the tunable: the kernel gives huge
    pages on request only ("[madvise]"; "always" gives them already, "never" not at all), the
    C library is glibc >= 2.35, and GLIBC_TUNABLES does not set it already."""
    try:
        mode = THP_MODE.read_text()
    except OSError:  # not Linux, or a kernel without transparent huge pages
        return False
    version = glibc_version()
    return ("[madvise]" in mode and version is not None and version >= (2, 35)
            and TUNABLE not in environ.get("GLIBC_TUNABLES", ""))


def with_hugepages(environ: dict[str, str]) -> dict[str, str]:
    """`environ` with the tunable added to GLIBC_TUNABLES (colon-separated, glibc's syntax)."""
    tunables = [part for part in environ.get("GLIBC_TUNABLES", "").split(":") if part]
    return dict(environ, GLIBC_TUNABLES=":".join([*tunables, f"{TUNABLE}=1"]))


def restart_with_hugepages(arguments: list[str]) -> None:
    """Replace this process by `python -P -m ortflow.cli <arguments>` with the tunable, where it
    is wanted; else return. Only for a process of its own (the console script), never one
    that called cli.main from Python. -P: the working directory stays off sys.path, as it is
    for the console script, so an `ortflow.py` where the command runs is never imported."""
    if wanted(dict(os.environ)):
        os.execve(sys.executable, [sys.executable, "-P", "-m", "ortflow.cli", *arguments],
                  with_hugepages(dict(os.environ)))


def on_hugepages() -> str:
    """How much of this process's resident memory is on huge pages, a line for the log."""
    try:
        lines = Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]  # the first names the range
    except OSError:
        return "huge pages: not known here (no /proc/self/smaps_rollup)"
    kib = {key: int(value.split()[0]) for key, value in (line.split(":", 1) for line in lines)}
    return (f"{kib['AnonHugePages'] / 1024:.0f} MiB of {kib['Rss'] / 1024:.0f} MiB resident on huge pages "
            f"(GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}; see ortflow/hugepages.py)")

"""This machine's memory as ortflow's checks count it: what the training ranks, the build of a
model and the quantization's timing batches may use."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import PreflightError

# The memory a rank may use, in bytes, instead of what the host reports (MemAvailable,
# or the cgroup's limit): for a host whose memory other jobs share, and for tests.
MEMORY_ENV = "ORTFLOW_MEMORY_AVAILABLE"


def gib(size: float) -> str:
    return f"{size / 2**30:.1f} GiB"


def available_memory() -> tuple[int, str]:
    """(bytes the ranks may use, where that figure comes from): MEMORY_ENV if set,
    else the smaller of MemAvailable and what the cgroup's limit leaves."""
    if os.environ.get(MEMORY_ENV):
        value = os.environ[MEMORY_ENV]
        if not value.isdecimal():  # isdigit() would pass '²', which int() refuses
            raise PreflightError(f"{MEMORY_ENV}={value!r} is not a number of bytes; set it to bytes "
                                 f"({12 * 2**30} for 12 GiB) or unset it to use this host's available memory")
        return int(value), MEMORY_ENV
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available, where = int(meminfo["MemAvailable"].split()[0]) * 1024, "MemAvailable"
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        left = int(limit) - int((cgroup / "memory.current").read_text()) if limit != "max" else available
        if left < available:
            available, where = left, "the cgroup's memory.max"
    except (OSError, ValueError):  # no cgroup v2 memory controller: MemAvailable is all there is
        pass
    return available, where


def release_freed_memory() -> None:
    """Give the system back the memory that this process has freed: Python's unreachable cycles
    collected, then glibc's free heap returned (malloc_trim). Arrays of a few MB, such as a model's
    weights, come from the heap once glibc has raised its mmap threshold (after the first such free),
    and the heap keeps what they leave (measured: 1 W of a 101M gpt after the export's checks,
    tests/test_external_data.py). Elsewhere than glibc, the collection alone."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # no C library to load, or one without malloc_trim (musl, macOS)
        pass

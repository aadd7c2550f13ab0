"""One line for a write that the machine refuses: a full disk, a folder the user
may not write to, a read-only file system. The line names the path and says
what to free or change, instead of `[Errno 28] No space left on device` under
a traceback."""

from __future__ import annotations

import errno
import getpass
import shutil
from pathlib import Path

FULL = (errno.ENOSPC, errno.EDQUOT)
DENIED = (errno.EACCES, errno.EPERM)


def explain(error: OSError) -> str | None:
    """The line for `error`, or None if it is not about space or permissions."""
    if error.errno not in (*FULL, *DENIED, errno.EROFS):
        return None
    path = Path(error.filename) if error.filename else None
    folder = _existing_folder(path) if path else None
    where = f"cannot write {path}" if path else "cannot write"
    if error.errno in FULL:
        free = f"{shutil.disk_usage(folder).free / 1e6:.1f} MB free in {folder}" if folder else "no space"
        kind = "disk quota exceeded" if error.errno == errno.EDQUOT else "no space left on device"
        return f"{where}: {kind} ({free}); free space on that file system, or run where there is more"
    if error.errno in DENIED:
        return (f"{where}: permission denied; make {folder or 'its folder'} writable for user {getpass.getuser()}, "
                "or run the workflow in a folder of your own (snakemake --directory DIR)")
    return (f"{where}: the file system is read-only; run the workflow in a writable folder "
            "(snakemake --directory DIR), or remount it read-write")


def _existing_folder(path: Path) -> Path | None:
    """The nearest folder of `path` that exists (where the space or permission is)."""
    for folder in (path, *path.parents):
        if folder.is_dir():
            return folder
    return None


def named(error: OSError, path: Path) -> OSError:
    """`error` with `path` as its file name: a failed write() or fsync() carries none."""
    if error.filename is None:
        error.filename = str(path)
    return error

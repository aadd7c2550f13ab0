"""What `snakemake` prints last when stages failed: each failed stage's own error, from
its log, so that nobody needs to open the log."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

# How ortflow marks an error in a stage's log: the command's message
# (`ortflow <command>: error: ...`, its further lines indented: cli.py) and a
# log record of level ERROR (a rank's `[rank R] ERROR ...`). A log without them
# (a traceback) shows its last lines.
ERROR_MARKERS = (": error: ", " ERROR ")
TAIL_LINES = 10
# A rank killed by a signal writes nothing itself; mpirun's notice, wrapped over
# lines in a box of dashes, is the only word of it: "prterun noticed that process
# rank 1 with PID 4242 on node n1 exited on signal 9 (Killed)."
MPIRUN_NOTICE = "noticed that process rank"
KILLED_RANK = re.compile(rf"{MPIRUN_NOTICE} \d+ .*exited on signal \d+")
MPIRUN_RULE = re.compile(r"-{20,}")


def stage_failures(failed: Iterable[tuple[str, Sequence[str]]]) -> str:
    """For each failed stage, (rule, its log files), what its log says went wrong
    (`error_lines`): printed last when `snakemake` fails, so that nobody needs to open the log."""
    lines = []
    for rule, logs in failed:
        for log in logs:
            path = Path(log)
            # NUL bytes: a log that several processes wrote at their own offsets.
            text = path.read_text(errors="replace").replace("\0", "").splitlines() if path.is_file() else []
            lines.append(f"ortflow: stage {rule} failed; from {log}:")
            lines += [f"  {line}" for line in error_lines(text)] or ["  (nothing in the log)"]
    return "\n".join(lines)


def error_lines(text: list[str]) -> list[str]:
    """The lines of a log that say what went wrong: each marked line with the
    indented lines that go on with its message (a reason, a fix), and mpirun's
    notice of a rank killed by a signal, joined into one line; else the log's
    last TAIL_LINES."""
    shown, continued = [], False
    for index, line in enumerate(text):
        if any(marker in line for marker in ERROR_MARKERS):
            shown.append(line.strip())
            continued = True
        elif continued and line[:1].isspace() and line.strip():
            shown.append(line.rstrip())
        else:
            continued = False
            notice = " ".join(wrapped(text[index:])) if MPIRUN_NOTICE in line else ""
            if KILLED_RANK.search(notice):
                shown.append(notice)
    return shown or [line.strip() for line in text[-TAIL_LINES:]]


def wrapped(lines: list[str]) -> list[str]:
    """The first of `lines` and those that go on with it, up to a blank line or mpirun's rule of dashes."""
    out = [lines[0].strip()]
    for line in lines[1:]:
        if not line.strip() or MPIRUN_RULE.fullmatch(line.strip()):
            break
        out.append(line.strip())
    return out

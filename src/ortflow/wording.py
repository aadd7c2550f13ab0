"""How a count reads in a message: `1 rank`, `2 ranks`."""

from __future__ import annotations


def plural(count: int, noun: str) -> str:
    """`count` and `noun`, with an s (es after ch, sh, s, x) unless the count is one."""
    ending = "es" if noun.endswith(("ch", "sh", "s", "x")) else "s"
    return f"{count} {noun}{'' if count == 1 else ending}"

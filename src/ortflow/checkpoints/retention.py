"""Which checkpoints a run keeps (train.keep_checkpoints, and the best one)."""

from __future__ import annotations

import shutil
from pathlib import Path

from .best import best_of
from .layout import COMPLETE
from .reader import digest_of


def prune(root: Path, identity_digest: str, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints of this training identity (those of
    another are left alone), and its best one; incomplete ones older than those are
    leftovers of crashes."""
    folders = sorted(p for p in Path(root).glob("step-*") if p.is_dir())
    ours = [p for p in folders if (p / COMPLETE).exists() and digest_of(p) == identity_digest]
    kept = ours[-keep:]
    best_record = best_of(root, identity_digest)
    best = Path(root) / best_record.checkpoint if best_record else None
    for folder in folders:
        incomplete = not (folder / COMPLETE).exists()
        if (folder in ours and folder not in kept and folder != best) or (incomplete and kept and folder < kept[0]):
            shutil.rmtree(folder, ignore_errors=True)

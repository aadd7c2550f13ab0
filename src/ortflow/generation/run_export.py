"""A run's export/generation/: the export stage's call of folder.export_folder (issue 41).

Every causal LM that ortflow fine-tunes (`model.kind: transformers`, causal-lm, LoRA merged)
gets the folder, from export/transformers/ as its users load it, checked before it is renamed
into place: greedy generation from the first tokens of a few eval records against
transformers' `generate`, within the export's TOLERANCE. The check's prompts come in two
lengths, so that its batch is left-padded as a served batch is. Any other model has no such
folder: an earlier run's is removed, as export/transformers/ is.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np

from ..data.tokenizer import ATTENTION_MASK, INPUT_IDS
from ..export.checks import TOLERANCE
from ..models import TEXT_WINDOWS
from ..models.save_trained import TRANSFORMERS
from . import GENERATION
from .check import GenerationCheck
from .folder import export_folder

log = logging.getLogger("ortflow.export")

PROMPTS = 4  # eval records whose first tokens are the check's prompts
PROMPT_TOKENS = 16  # the longer prompts' tokens; the others have half as many
NEW_TOKENS = 64  # issue 41's check; fewer where the model's positions leave less room


def eval_check(windows: np.ndarray, positions: int, valid: np.ndarray | None = None) -> GenerationCheck:
    """The check on the first tokens of the eval `windows` [records, context]: at most PROMPT_TOKENS
    and half the model's `positions`, the new tokens in what the positions leave. `valid`: each
    record's tokens before its padding (examples padded to data.context: data/examples.py)."""
    longest = max(1, min(PROMPT_TOKENS, windows.shape[1], positions // 2))
    valid = np.full(len(windows), windows.shape[1]) if valid is None else valid
    lengths = [max(1, min(longest if row % 2 == 0 else longest // 2, int(valid[row])))
               for row in range(min(PROMPTS, len(windows)))]
    prompts = [windows[row, :length].tolist() for row, length in enumerate(lengths)]
    return GenerationCheck(prompts, min(NEW_TOKENS, positions - longest), relative=TOLERANCE["relative"],
                           absolute=TOLERANCE["absolute"])


def write_generation(task: str | None, batch: dict, export: Path, positions: int | None) -> None:
    """export/generation/ from export/transformers/ where `task` (the transformers model's, None for
    another kind) is causal-lm, checked on the eval `batch` (raw features) within the model's
    `positions`; for any other model an earlier run's folder is removed."""
    folder = Path(export) / GENERATION
    if task != "causal-lm":
        shutil.rmtree(folder, ignore_errors=True)
        return
    # Text windows (x), or examples of chats and pairs (input_ids, padded: attention_mask 0).
    ids = batch[TEXT_WINDOWS] if TEXT_WINDOWS in batch else batch[INPUT_IDS]
    valid = batch[ATTENTION_MASK].sum(axis=1) if ATTENTION_MASK in batch else None
    # No positions in its config: the training windows' length, until cache_layout refuses it in one line.
    check = eval_check(ids, positions or ids.shape[1], valid)
    _, agreement = export_folder(Path(export) / TRANSFORMERS, folder, check)
    fewer = f", not {NEW_TOKENS}: the model has {positions} positions" if check.max_new_tokens < NEW_TOKENS else ""
    lengths = sorted({len(prompt) for prompt in check.prompts}, reverse=True)
    log.info("%s: greedy generation in ONNX Runtime (%d steps of at most %d new tokens%s) from %d eval prompts of %s "
             "tokens, left-padded, equals transformers' generate token for token, each step's logits within %.3g "
             "of the largest", folder, agreement.steps, check.max_new_tokens, fewer, len(check.prompts),
             " and ".join(map(str, lengths)), agreement.largest_error)

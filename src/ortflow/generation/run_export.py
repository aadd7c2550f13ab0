"""A run's export/generation/: the export stage's call of folder.export_folder (issue 41).

Every causal LM that ortflow trains gets the folder, checked before it is renamed into place: a
fine-tuned one (`model.kind: transformers`, causal-lm, LoRA merged) from export/transformers/ as
its users load it; the built-in `gpt` as the transformers GPT-2 it equals (models/gpt.as_gpt2),
with data.tokenizer's tokenizer or one of bytes. The check: greedy generation from the first
tokens of a few eval records against transformers' `generate`, within the export's TOLERANCE.
The check's prompts come in two lengths, so that its batch is left-padded as a served batch is. A
fine-tuned sequence-to-sequence model (seq2seq) gets optimum's encoder and decoders with a cache
(seq2seq_export.py), checked on eval sources of two lengths, right-padded. Any other model has no such
folder: an earlier run's is removed, as export/transformers/ is.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from ..data.shards import TOKENIZER as DATA_TOKENIZER
from ..data.tokenizer import ATTENTION_MASK, INPUT_IDS
from ..errors import ModelError
from ..export.checks import TOLERANCE
from ..models import TEXT_WINDOWS
from ..models.save_trained import TRANSFORMERS
from . import GENERATION, built_in_generation
from .check import GenerationCheck
from .folder import export_folder, write_folder

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


def write_generation(task: str | None, batch: dict, export: Path, positions: int | None,
                     gpt: Callable[[], object] | None = None, tokenizer: dict | None = None) -> None:
    """export/generation/ from export/transformers/ where `task` (the transformers model's, None for
    another kind) is causal-lm or seq2seq, or from the module that `gpt()` builds (the trained built-in
    gpt, model.kind gpt) as the GPT-2 it equals with the data's `tokenizer` (the manifest's description; None: bytes),
    checked on the eval `batch` (raw features) within the model's `positions` (None: the records'
    length); for any other model an earlier run's folder is removed. The model is built here, not
    handed in, so that it is let go before the folder's check opens the decoder's session (folder.write_folder)."""
    folder = Path(export) / GENERATION
    if task == "seq2seq":
        write_seq2seq(batch, Path(export), positions)
        return
    if gpt is not None and not built_in_generation("gpt"):
        log.info("%s: not written: the built-in gpt is exported as transformers' GPT-2, and transformers is not "
                 "installed (pip install 'ortflow[transformers]')", folder)
    if task != "causal-lm" and (gpt is None or not built_in_generation("gpt")):
        shutil.rmtree(folder, ignore_errors=True)
        return
    # Text windows (x), or examples of chats and pairs (input_ids, padded: attention_mask 0).
    ids = batch[TEXT_WINDOWS] if TEXT_WINDOWS in batch else batch[INPUT_IDS]
    valid = batch[ATTENTION_MASK].sum(axis=1) if ATTENTION_MASK in batch else None
    # No positions in its config: the training windows' length (the built-in gpt's positions, one a token of
    # its windows; another model's until cache_layout refuses it in one line).
    positions = positions or ids.shape[1]
    check = eval_check(ids, positions, valid)
    if gpt is None:
        _, agreement = export_folder(Path(export) / TRANSFORMERS, folder, check)
    else:
        _, agreement = write_folder(lambda: built_in_gpt2(gpt(), ids, Path(export), tokenizer), folder, check)
    fewer = f", not {NEW_TOKENS}: the model has {positions} positions" if check.max_new_tokens < NEW_TOKENS else ""
    lengths = sorted({len(prompt) for prompt in check.prompts}, reverse=True)
    log.info("%s: greedy generation in ONNX Runtime (%d steps of at most %d new tokens%s) from %d eval prompts of %s "
             "tokens, left-padded, equals transformers' generate token for token, each step's logits within %.3g "
             "of the largest", folder, agreement.steps, check.max_new_tokens, fewer, len(check.prompts),
             " and ".join(map(str, lengths)), agreement.largest_error)


def write_seq2seq(batch: dict, export: Path, positions: int | None) -> None:
    """export/generation/ of a sequence-to-sequence model from export/transformers/ (seq2seq_export.py),
    checked on the eval `batch`'s sources."""
    from .seq2seq_export import eval_check as seq2seq_check, export_seq2seq_folder

    check = seq2seq_check(batch[INPUT_IDS], batch[ATTENTION_MASK].sum(axis=1), positions, PROMPTS, NEW_TOKENS)
    agreement = export_seq2seq_folder(export / TRANSFORMERS, export / GENERATION, check)
    lengths = sorted({len(prompt) for prompt in check.prompts}, reverse=True)
    log.info("%s: greedy generation in ONNX Runtime (%d steps of at most %d new tokens) from %d eval sources of %s "
             "tokens, right-padded, equals transformers' generate token for token, each step's logits within %.3g "
             "of the largest", export / GENERATION, agreement.steps, check.max_new_tokens, len(check.prompts),
             ", ".join(map(str, lengths)), agreement.largest_error)


def built_in_gpt2(gpt, windows: np.ndarray, export: Path, tokenizer: dict | None):
    """The built-in gpt as transformers' GPT-2 (models/gpt.as_gpt2) and the tokenizer its folder gets:
    data.tokenizer's (export/tokenizer.json, its end-of-text token the end of a generation) or, for
    bytes, None (folder.copy_tokenizer writes the byte-level one). The two models' logits on the eval
    `windows` must agree within the export's TOLERANCE first: the mapping is what the check of the
    folder against transformers' generate stands on."""
    import torch

    from ..models.gpt import as_gpt2

    eos, source = None, None
    if tokenizer:
        from transformers import PreTrainedTokenizerFast

        source = PreTrainedTokenizerFast(tokenizer_file=str(export / DATA_TOKENIZER), eos_token=tokenizer["eos_token"])
        eos = source.eos_token_id
    model = as_gpt2(gpt, eos)
    with torch.no_grad():
        windows = torch.from_numpy(windows)
        ours, theirs = gpt(windows).transpose(1, 2).numpy(), model(input_ids=windows).logits.numpy()
    scale, difference = float(np.abs(ours).max()), float(np.abs(ours - theirs).max())
    if not difference <= TOLERANCE["relative"] * scale + TOLERANCE["absolute"]:  # NaN fails too
        raise ModelError(f"model.kind gpt as transformers' GPT-2 (for {GENERATION}/): its logits on the eval records "
                         f"differ from the built-in model's by {difference:.3g} (largest |logit| {scale:.3g}); the "
                         "installed transformers' GPT-2 no longer computes the built-in gpt's function")
    log.info("model.kind gpt as transformers' GPT2LMHeadModel: its logits on %d eval records within %.3g of the "
             "built-in model's largest", len(windows), difference / scale if scale else difference)
    return model, source

"""export/samples.json: a few eval prompts with what the model generates before fine-tuning and
after (issues 41 and 42), which the report shows.

The prompt of an example (a chat, a prompt-completion pair: data/examples.py) is its tokens up to
the first one in the loss: the conversation rendered up to the assistant's turn, or the prompt. An
example whose every token is in the loss, and a window of plain text, give their first tokens (at
most PROMPT_TOKENS, half the record). Beside it, what the eval data has next (its tokens in the
loss from there on, as many as are generated), then the two greedy continuations of at most NEW_TOKENS: before, transformers'
`generate` on the starting weights (build_artifacts' initial checkpoint: model.path's, or
model.weights'); after, the exported decoder of export/generation/ in ONNX Runtime, as
`ortflow generate` runs it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import numpy as np

from .. import atomic
from ..machine import release_freed_memory
from ..data.tokenizer import ATTENTION_MASK, INPUT_IDS
from ..models import IGNORE_INDEX
from ..models import TEXT_WINDOWS
from . import GENERATION, SAMPLES, TOKENIZER
from .check import transformers_greedy
from .generate import Decoder, generate, read_genai_config, special_tokens

log = logging.getLogger("ortflow.export")

PROMPT_TOKENS = 16  # a text window's prompt, at most
NEW_TOKENS = 32  # generated at most, before and after; fewer where the model's positions leave less


def eval_prompts(batch: dict, label_name: str, count: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, expected) token ids of the first `count` records of the eval `batch` (raw features):
    the prompt as the module's docstring says, and the record's next tokens in the loss after it."""
    ids = batch[TEXT_WINDOWS] if TEXT_WINDOWS in batch else batch[INPUT_IDS]
    valid = batch[ATTENTION_MASK].sum(axis=1) if ATTENTION_MASK in batch else np.full(len(ids), ids.shape[1])
    labels = batch[label_name]
    found = []
    for row in range(min(count, len(ids))):
        length = int(valid[row])
        in_loss = np.flatnonzero(labels[row, :length] != IGNORE_INDEX)
        # labels[i] is the token after position i: the first token in the loss follows position in_loss[0].
        cut = int(in_loss[0]) + 1 if in_loss.size and in_loss[0] > 0 else max(1, min(PROMPT_TOKENS, length // 2))
        following = labels[row, cut - 1:length]
        ignored = np.flatnonzero(following == IGNORE_INDEX)
        found.append((ids[row, :cut].tolist(), following[:ignored[0] if ignored.size else None].tolist()))
    return found


def samples(start_model: Callable[[], object], folder: Path, prompts: list[tuple[list[int], list[int]]],
            positions: int) -> dict:
    """The samples of `prompts` (eval_prompts') as text: greedy generation of the torch causal LM of the
    starting weights that `start_model()` builds, then of the generation `folder`'s decoder, whose session
    opens once that model is let go (the two would hold the weights together)."""
    from tokenizers import Tokenizer

    pad, eos = special_tokens(read_genai_config(folder)["model"])
    tokenizer = Tokenizer.from_file(str(folder / TOKENIZER))
    new_tokens = max(1, min(NEW_TOKENS, positions - max(len(prompt) for prompt, _ in prompts)))
    before, _ = transformers_greedy(start_model(), pad, eos, [prompt for prompt, _ in prompts], new_tokens)
    release_freed_memory()
    after = generate(Decoder(folder, prepacked=False), [prompt for prompt, _ in prompts], new_tokens)

    def text(tokens: list[int]) -> str:  # the end-of-sequence token is the stop, not text
        return tokenizer.decode([token for token in tokens if token not in eos], skip_special_tokens=True)

    return {"max_new_tokens": new_tokens, "greedy": True, "samples": [
        {"prompt": tokenizer.decode(prompt, skip_special_tokens=False), "expected": text(expected[:new_tokens]),
         "before": text(first), "after": text(last)}
        for (prompt, expected), first, last in zip(prompts, before, after)]}


def write_samples(count: int, export: Path, reader, positions: int | None,
                  start_module: Callable[[], object]) -> None:
    """export/samples.json of the first `count` records of the eval split (`reader`, raw features)
    where export/generation/ exists (else an earlier run's file is removed); `positions`: the model's
    (None: the records' length, as run_export takes it); `start_module()` builds the ortflow module
    of the starting weights (its transformers model: `.model`; the built-in gpt: the GPT-2 it
    equals), only when there are prompts."""
    path, folder = Path(export) / SAMPLES, Path(export) / GENERATION
    if not folder.is_dir():
        path.unlink(missing_ok=True)
        return
    written = {"max_new_tokens": 0, "greedy": True, "samples": []}  # export.samples: 0
    if count:
        from ..models.gpt import GPT, as_gpt2  # torch: imported when samples are written (cli.py)

        def start_model():
            start = start_module()
            return as_gpt2(start) if isinstance(start, GPT) else start.model

        batch = reader.gather(np.arange(min(count, len(reader))))
        written = samples(start_model, folder, eval_prompts(batch, reader.label_name, count),
                          positions or batch[reader.label_name].shape[1])
    atomic.write_text(path, json.dumps(written, indent=1, ensure_ascii=False) + "\n")
    log.info("%s: %d eval prompts with greedy generation (at most %d new tokens) of the starting weights "
             "and of %s", path, len(written["samples"]), written["max_new_tokens"], folder)

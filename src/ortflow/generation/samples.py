"""export/samples.json: a few eval prompts with what the model generates before fine-tuning and
after (issues 41 and 42), which the report shows.

The prompt of an example (a chat, a prompt-completion pair: data/examples.py) is its tokens up to
the first one in the loss: the conversation rendered up to the assistant's turn, or the prompt. An
example whose every token is in the loss, and a window of plain text, give their first tokens (at
most PROMPT_TOKENS, half the record). Beside it, what the eval data has next (its tokens in the
loss from there on, as many as are generated), then the two greedy continuations of at most NEW_TOKENS: before, transformers'
`generate` on the starting weights (build_artifacts' initial checkpoint: model.path's, or
model.weights'); after, the exported decoder of export/generation/ in ONNX Runtime, as
`ortflow generate` runs it. A sequence-to-sequence model's prompt is a record's source, and what the
eval data has is its target.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import numpy as np

from ..data.tokenizer import ATTENTION_MASK, INPUT_IDS
from ..machine import release_freed_memory
from ..models import IGNORE_INDEX
from ..models import TEXT_WINDOWS
from . import GENERATION, SAMPLES, TOKENIZER, is_seq2seq
from .check import transformers_greedy
from .generate import Decoder, generate, read_genai_config, special_tokens
from .samples_file import Sample, Samples, write_samples_file
from .seq2seq import Seq2SeqDecoder, transformers_greedy as seq2seq_greedy

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


def seq2seq_prompts(batch: dict, label_name: str, count: int) -> list[tuple[list[int], list[int]]]:
    """(source, target) token ids of the first `count` records of a sequence-to-sequence eval `batch`:
    the source before its padding, and the target's tokens in the loss (its labels before the padding)."""
    ids, valid, labels = batch[INPUT_IDS], batch[ATTENTION_MASK].sum(axis=1), batch[label_name]
    found = []
    for row in range(min(count, len(ids))):
        ignored = np.flatnonzero(labels[row] == IGNORE_INDEX)
        found.append((ids[row, :int(valid[row])].tolist(), labels[row, :ignored[0] if ignored.size else None].tolist()))
    return found


def samples(start_model: Callable[[], object], folder: Path, prompts: list[tuple[list[int], list[int]]],
            positions: int) -> Samples:
    """The samples of `prompts` (eval_prompts', or seq2seq_prompts' for a sequence-to-sequence folder)
    as text: greedy generation of the torch model of the starting weights that `start_model()` builds,
    then of the generation `folder`'s decoder. A causal LM's decoder session opens once that model is
    let go (the two would hold the weights together); a sequence-to-sequence decoder, whose room for
    new tokens decides the model's run, opens first."""
    from tokenizers import Tokenizer

    sources = [prompt for prompt, _ in prompts]
    tokenizer = Tokenizer.from_file(str(folder / TOKENIZER))
    if is_seq2seq(folder):
        decoder = Seq2SeqDecoder(folder, prepacked=False)
        room, eos = decoder.room(max(map(len, sources))), decoder.eos
        new_tokens = max(1, min(NEW_TOKENS, NEW_TOKENS if room is None else room))
        before, _ = seq2seq_greedy(start_model(), decoder, sources, new_tokens)
    else:
        pad, eos = special_tokens(read_genai_config(folder)["model"])
        new_tokens = max(1, min(NEW_TOKENS, positions - max(map(len, sources))))
        before, _ = transformers_greedy(start_model(), pad, eos, sources, new_tokens)
        release_freed_memory()
        decoder = Decoder(folder, prepacked=False)
    after = generate(decoder, sources, new_tokens)

    def text(tokens: list[int]) -> str:  # the end-of-sequence token is the stop, not text
        return tokenizer.decode([token for token in tokens if token not in eos], skip_special_tokens=True)

    return Samples(new_tokens, True, tuple(
        Sample(tokenizer.decode(prompt, skip_special_tokens=False), text(expected[:new_tokens]), text(first),
               text(last))
        for (prompt, expected), first, last in zip(prompts, before, after)))


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
    written = Samples(0, True, ())  # export.samples: 0
    if count:
        from ..models.gpt import GPT, as_gpt2  # torch: imported when samples are written (cli.py)

        def start_model():
            start = start_module()
            return as_gpt2(start) if isinstance(start, GPT) else start.model

        batch = reader.gather(np.arange(min(count, len(reader))))
        prompts = (seq2seq_prompts if is_seq2seq(folder) else eval_prompts)(batch, reader.label_name, count)
        written = samples(start_model, folder, prompts, positions or batch[reader.label_name].shape[1])
    write_samples_file(path, written)
    log.info("%s: %d eval prompts with greedy generation (at most %d new tokens) of the starting weights "
             "and of %s", path, len(written.samples), written.max_new_tokens, folder)

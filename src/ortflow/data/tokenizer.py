"""`data.tokenizer`: text to token ids with the user's own tokenizer.

The tokenizer is a `tokenizer.json` of the `tokenizers` library, or a folder
written by transformers' `save_pretrained`, read with `AutoTokenizer` from local
files only (no download, no remote code) and used through its fast backend, the
same `tokenizers.Tokenizer`. Either way, what encodes the data is one
`tokenizers.Tokenizer`, batch-encoded on the library's own threads, and its JSON
travels with the shards (`tokenizer.json` in each split's folder) and then with
the exported model: it reproduces the model's inputs without the run's folder.

Two uses:
- language models (`data.source: text` or a `.txt` file, `language_model`): the
  text is split into documents at blank lines (`"\\n\\n"`, as `datasets`' text
  loader reads `sample_by="paragraph"`), read and encoded in batches, each
  document followed by the end-of-text token; the stream goes to a scratch file,
  not memory, and sources.py cuts it into windows as it cuts bytes (the
  documents of a column, examples.py, go the same way: `document_tokens`);
- text columns (`data.text`, `encode_columns`): one text or a pair per row
  becomes `input_ids`, `attention_mask` (and `token_type_ids` where the
  tokenizer gives them), truncated and padded to `data.context`; the JSON then
  carries that truncation and padding, so that encoding with it gives the model's
  inputs exactly. For token classification (`encode_words`) the column holds
  lists of words, encoded as split (is_pretokenized), and the words' tags are
  aligned to the tokens. For sequence-to-sequence (`encode_targets`) the label
  column's target texts become the labels and the decoder's inputs.
"""

from __future__ import annotations

import io
import json
import logging
import tempfile
import time
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ..errors import DataError
from ..models import IGNORE_INDEX
from ..user_files import tokenizer_files

log = logging.getLogger("ortflow.prepare_data")

# Tried in this order where the tokenizer does not name its own (a tokenizer.json has no such setting).
EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
PAD_TOKENS = ("[PAD]", "<pad>", "<|pad|>", "<|padding|>")
INPUT_IDS, ATTENTION_MASK, TOKEN_TYPE_IDS = "input_ids", "attention_mask", "token_type_ids"
DOCUMENT_SEPARATOR = "\n\n"
READ_CHARS = 1 << 22  # text read per step of a .txt file
BATCH_CHARS = 1 << 20  # text per encode_batch call: enough for the library's threads, little memory
BATCH_ROWS = 4096  # rows per encode_batch call for text columns
PROGRESS_SECONDS = 10.0
# A save_pretrained folder's files that tell which transformers class loads its tokenizer (_generic).
TOKENIZER_CONFIG, TOKENIZER_JSON, MODEL_CONFIG = "tokenizer_config.json", "tokenizer.json", "config.json"
GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


@dataclass
class Tokenizer:
    backend: object  # tokenizers.Tokenizer
    source: str  # data.tokenizer
    vocab_size: int  # the largest token id + 1: the rows an embedding of these ids needs
    eos_token: str | None
    pad_token: str | None
    type_ids: bool  # whether it gives token_type_ids (a BERT-style pair template)
    input: str | None = None  # the data's input that holds its ids, once it has encoded them
    loaded: object | None = None  # a folder's transformers tokenizer: its chat template and special tokens
    chat_template: str | None = None  # the template that rendered chats (examples.py), to render the model's prompts
    text: list[str] | None = None  # the text columns it encoded (data.text), if any

    def token_id(self, token: str) -> int:
        return self.backend.token_to_id(token)

    def describe(self) -> dict:
        """What the shards' manifest records of it, beside the file's name and sha256."""
        return {"source": self.source, "vocab_size": self.vocab_size, "eos_token": self.eos_token,
                "pad_token": self.pad_token, "input": self.input, "text": self.text} | (
                    {"chat_template": self.chat_template} if self.chat_template else {})

    def to_json(self) -> str:
        return self.backend.to_str()


def load(path: str) -> Tokenizer:
    """The tokenizer of `data.tokenizer`: a tokenizer.json file or a save_pretrained folder."""
    where = Path(path)
    tokenizer_files(path)  # no links, no special files, none over the size cap
    if not where.exists():
        raise DataError(f"data.tokenizer: {where} does not exist; give a tokenizer.json file (the tokenizers "
                        "library) or a folder saved with transformers' save_pretrained")
    if where.is_dir():
        return _from_folder(where, path)
    if not where.is_file():
        raise DataError(f"data.tokenizer: {where} is neither a regular file nor a folder")
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_file(str(where))
    except Exception as error:  # the library raises a bare Exception with serde's message
        raise DataError(f"data.tokenizer: {where} is not a tokenizer.json of the tokenizers library "
                        f"({str(error).strip()[:200]})") from None
    eos = _first_known(backend, EOS_TOKENS)
    padding = backend.padding
    pad = padding["pad_token"] if padding else _first_known(backend, PAD_TOKENS)
    return _finish(backend, path, eos, pad, _template_gives_type_ids(backend))


def _from_folder(where: Path, path: str) -> Tokenizer:
    try:
        import transformers
    except ImportError:
        raise DataError(f"data.tokenizer: {where} is a folder, which ortflow reads with transformers' "
                        "AutoTokenizer: pip install transformers, or give the folder's tokenizer.json") from None
    # Importing AutoTokenizer's module imports torch (loading a folder took 1.5 CPU s and 180 MB that way,
    # 0.6 CPU s without, docs/benchmarks.md "Tokenizing chats"): a folder that AutoTokenizer loads as the
    # generic fast tokenizer is loaded by that class itself, the same tokenizer; any other by AutoTokenizer.
    loader = transformers.PreTrainedTokenizerFast if _generic(where) else transformers.AutoTokenizer
    try:
        loaded = loader.from_pretrained(str(where), local_files_only=True, trust_remote_code=False)
    except Exception as error:  # transformers raises OSError, ValueError, ... with the reason
        raise DataError(f"data.tokenizer: transformers cannot load a tokenizer from the folder {where} "
                        f"({str(error).strip().splitlines()[0][:200]})") from None
    backend = getattr(loaded, "backend_tokenizer", None)
    if backend is None:
        raise DataError(f"data.tokenizer: {where} holds a slow (Python) tokenizer, {type(loaded).__name__}; ortflow "
                        "needs a fast one, with a tokenizer.json (save it from AutoTokenizer.from_pretrained(..., "
                        "use_fast=True))")
    from tokenizers import Tokenizer as Backend

    def own(token) -> str | None:
        return token if token and backend.token_to_id(token) is not None else None

    eos = own(loaded.eos_token) or _first_known(backend, EOS_TOKENS)
    pad = own(loaded.pad_token) or _first_known(backend, PAD_TOKENS)
    # A copy: the settings below are ortflow's, not the loaded tokenizer's.
    tokenizer = _finish(Backend.from_str(backend.to_str()), path, eos, pad, TOKEN_TYPE_IDS in loaded.model_input_names)
    tokenizer.loaded = loaded
    return tokenizer


def _generic(where: Path) -> bool:
    """Whether AutoTokenizer loads the folder as transformers' generic fast tokenizer (PreTrainedTokenizerFast,
    TokenizersBackend in transformers 5): its tokenizer_config.json names that class and no code of its own,
    and the folder has no config.json, whose model type could choose another class."""
    try:
        settings = json.loads((where / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # AutoTokenizer says what is wrong with it
    return (isinstance(settings, dict) and settings.get("tokenizer_class") in GENERIC_CLASSES
            and "auto_map" not in settings and (where / TOKENIZER_JSON).is_file()
            and not (where / MODEL_CONFIG).exists())


def _finish(backend, path: str, eos: str | None, pad: str | None, type_ids: bool) -> Tokenizer:
    backend.no_truncation()
    backend.no_padding()
    vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
    return Tokenizer(backend, path, vocab_size, eos, pad, type_ids)


def _first_known(backend, tokens: tuple[str, ...]) -> str | None:
    return next((token for token in tokens if backend.token_to_id(token) is not None), None)


def _template_gives_type_ids(backend) -> bool:
    """Whether the post-processor marks a pair's second text with type id 1 (BERT's
    template): then the model tells the texts apart by token_type_ids."""
    def gives(processor: dict | None) -> bool:
        if not processor:
            return False
        kind = processor.get("type")
        if kind == "Sequence":
            return any(gives(p) for p in processor.get("processors", []))
        if kind == "BertProcessing":
            return True
        if kind == "TemplateProcessing":
            pieces = processor.get("single", []) + processor.get("pair", [])
            return any(next(iter(piece.values())).get("type_id", 0) for piece in pieces)
        return False

    return gives(json.loads(backend.to_str()).get("post_processor"))


# --- language models ---------------------------------------------------------------------------------


def documents(chunks: Iterable[str]) -> Iterator[str]:
    """The documents of a text that arrives in `chunks`: the text split at
    DOCUMENT_SEPARATOR (a blank line), empty ones left out, as if it were split
    whole. A document is held whole, so memory is bounded by the longest one."""
    carry = ""
    for chunk in chunks:
        *complete, carry = (carry + chunk).split(DOCUMENT_SEPARATOR)
        yield from filter(None, complete)
    if carry:
        yield carry


def text_chunks(path: Path, progress: "Progress") -> Iterator[str]:
    """The file's text, decoded as prepare_data decodes text (UTF-8, undecodable
    bytes replaced, universal newlines), READ_CHARS at a time."""
    with open(path, "rb") as raw, io.TextIOWrapper(raw, encoding="utf-8", errors="replace") as text:
        while chunk := text.read(READ_CHARS):
            progress.done = raw.tell()
            yield chunk


class Progress:
    """The progress line, every PROGRESS_SECONDS and at the end: how much of the
    input is done (`done` of `total`, in `unit`s of `scale`), the tokens so far and their rate."""

    def __init__(self, what: str, total: int, unit: str = "MB", scale: float = 1e6):
        self.what, self.total, self.unit, self.scale = what, total, unit, scale
        self.done = self.tokens = 0
        self.started = self.shown = time.perf_counter()

    def update(self, tokens: int, final: bool = False) -> None:
        self.tokens += tokens
        now = time.perf_counter()
        if final or now - self.shown >= PROGRESS_SECONDS:
            self.shown = now
            shown = ",.1f" if self.scale > 1 else ",.0f"
            # A total of 0 is unknown (rows of a JSON Lines file are not counted ahead).
            of = f" of {format(self.total / self.scale, shown)} {self.unit} ({100 * self.done / self.total:.0f}%)" \
                if self.total else f" {self.unit}"
            log.info("tokenized %s: %s%s, %s tokens, %s tokens/s", self.what, format(self.done / self.scale, shown),
                     of, f"{self.tokens:,}", f"{self.tokens / max(now - self.started, 1e-9):,.0f}")


def token_stream(tokenizer: Tokenizer, texts: Iterable[str], out, progress: Progress) -> int:
    """Encode the documents `texts`, each followed by the end-of-text token,
    and append their ids (int64) to the binary file `out`; the number of tokens."""
    if tokenizer.eos_token is None:
        raise DataError(f"data.tokenizer: {tokenizer.source} has no end-of-text token to put between documents "
                        f"(none of {', '.join(EOS_TOKENS)}); add one as a special token (e.g. "
                        "special_tokens=['<|endoftext|>'] when training it)")
    eos = tokenizer.token_id(tokenizer.eos_token)
    log.info("data.tokenizer %s: vocabulary %d, documents each followed by %r (id %d)",
             tokenizer.source, tokenizer.vocab_size, tokenizer.eos_token, eos)
    batch: list[str] = []
    size = total = 0

    def flush() -> int:
        encodings = tokenizer.backend.encode_batch_fast(batch, add_special_tokens=False)
        ids = np.fromiter(chain.from_iterable(chain(e.ids, (eos,)) for e in encodings), dtype=np.int64)
        ids.tofile(out)
        progress.update(len(ids))
        batch.clear()
        return len(ids)

    for document in texts:
        batch.append(document)
        size += len(document)
        if size >= BATCH_CHARS:
            total += flush()
            size = 0
    if batch:
        total += flush()
    progress.update(0, final=True)
    return total


def language_model_tokens(tokenizer: Tokenizer, text: str | None, path: Path | None, scratch: Path | None):
    """The token ids of the documents of `text` (in memory) or of the file at
    `path`, as a read-only int64 array mapped from a scratch file in `scratch`
    (removed when the array is gone)."""
    if path is not None:
        progress = Progress(str(path), path.stat().st_size)
        chunks = text_chunks(path, progress)
    else:
        progress = Progress("the text", len(text.encode("utf-8")))
        progress.done = progress.total
        chunks = [text]
    return document_tokens(tokenizer, [documents(chunks)], progress, scratch)[0]


def document_tokens(tokenizer: Tokenizer, streams: list[Iterable[str]], progress: Progress,
                    scratch: Path | None) -> tuple[np.ndarray, list[int]]:
    """The token ids of the documents of `streams` (each followed by the end-of-text
    token), one stream after the other, as a read-only int64 array mapped from a
    scratch file in `scratch` (removed when the array is gone); and how many tokens
    each stream gave (a datasets folder's train and eval splits, examples.py)."""
    with tempfile.TemporaryFile(dir=scratch, prefix="ortflow-tokens-") as out:
        counts = [token_stream(tokenizer, texts, out, progress) for texts in streams]
        out.flush()
        if sum(counts) == 0:
            return np.zeros(0, dtype=np.int64), counts
        # The mapping keeps the (already unlinked) file alive after it is closed.
        return np.memmap(out, dtype=np.int64, mode="r", shape=(sum(counts),)), counts


# --- text columns ------------------------------------------------------------------------------------


def encode_columns(tokenizer: Tokenizer, texts: list[list[str]], context: int, where: str) -> dict[str, np.ndarray]:
    """One text (or a pair: two lists) per row -> input_ids, attention_mask (and
    token_type_ids where the tokenizer gives them), [rows, context] int64,
    truncated (the longest text of a pair first) and padded to `context`. The
    tokenizer keeps that truncation and padding: its JSON then encodes as here."""
    inputs = texts[0] if len(texts) == 1 else list(zip(*texts))
    return _encode(tokenizer, inputs, context, where)


def encode_words(tokenizer: Tokenizer, words: list[list[str]], tags: list[list[int]], context: int,
                 where: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Token classification: one list of words per row, with one tag (a class id)
    per word -> the inputs of `encode_columns` from the words as they are split
    (is_pretokenized), and the tags aligned to the tokens as transformers'
    examples align them (word_ids): a word's first token carries its tag, its
    other tokens, the special tokens and the padding IGNORE_INDEX. [rows, context] int64."""
    labels = np.full((len(words), context), IGNORE_INDEX, dtype=np.int64)

    def align(start: int, encodings) -> None:
        for row, encoding in enumerate(encodings, start):
            previous = None
            for position, word in enumerate(encoding.word_ids):
                if word is not None and word != previous:
                    labels[row, position] = tags[row][word]
                previous = word

    return _encode(tokenizer, words, context, where, pretokenized=True, each_batch=align), labels


def encode_targets(tokenizer: Tokenizer, texts: list[str], context: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Sequence-to-sequence: target texts -> the decoder's inputs and the labels,
    [rows, context] int64, as transformers makes them from its labels: the labels
    are the target's token ids with IGNORE_INDEX on the padding; the decoder's
    inputs are the target shifted right by one (shift_tokens_right), the padding
    id first, which the model replaces by its own decoder_start_token_id
    (models/hugging_face.py)."""
    encoded = _encode(tokenizer, texts, context, where)
    ids = encoded[INPUT_IDS]
    labels = np.where(encoded[ATTENTION_MASK] == 1, ids, IGNORE_INDEX)
    decoder_inputs = np.full_like(ids, tokenizer.token_id(tokenizer.pad_token))
    decoder_inputs[:, 1:] = ids[:, :-1]
    return decoder_inputs, labels


def _encode(tokenizer: Tokenizer, inputs: list, context: int, where: str, pretokenized: bool = False,
            each_batch=None) -> dict[str, np.ndarray]:
    """`inputs` (texts, pairs, or with `pretokenized` lists of words) encoded into
    [rows, context] arrays; `each_batch(start, encodings)` sees every batch's encodings."""
    if tokenizer.pad_token is None and tokenizer.eos_token is None:
        raise DataError(f"data.tokenizer: {tokenizer.source} has no padding token (none of {', '.join(PAD_TOKENS)}) "
                        "and no end-of-text token to pad with; add a [PAD] special token")
    pad = tokenizer.pad_token or tokenizer.eos_token
    if tokenizer.pad_token is None:
        log.info("data.tokenizer %s has no padding token: pads with the end-of-text token %r (attention_mask 0 "
                 "there)", tokenizer.source, pad)
    tokenizer.pad_token, tokenizer.input = pad, INPUT_IDS  # what the manifest records
    backend = tokenizer.backend
    backend.enable_truncation(max_length=context)
    backend.enable_padding(length=context, pad_id=tokenizer.token_id(pad), pad_token=pad)
    rows = len(inputs)
    names = [INPUT_IDS, ATTENTION_MASK] + ([TOKEN_TYPE_IDS] if tokenizer.type_ids else [])
    arrays = {name: np.empty((rows, context), dtype=np.int64) for name in names}
    progress = Progress(where, rows, "rows", 1)
    # encode_batch_fast leaves out the offsets, and with them the word ids that word tags are aligned by.
    encode = backend.encode_batch if pretokenized else backend.encode_batch_fast
    truncated = 0
    for start in range(0, rows, BATCH_ROWS):
        try:
            encodings = encode(inputs[start:start + BATCH_ROWS], is_pretokenized=pretokenized)
        except Exception as error:  # the library's own, e.g. a pair that truncation cannot shorten enough
            raise DataError(f"{where}: data.tokenizer cannot encode rows {start}..{start + BATCH_ROWS - 1} into "
                            f"data.context={context} tokens ({str(error).strip()[:200]}); raise data.context") from None
        longer = next((i for i, e in enumerate(encodings) if len(e.ids) != context), None)
        if longer is not None:  # the special tokens alone (e.g. [CLS] a [SEP] b [SEP]) exceed the context
            raise DataError(f"{where}: row {start + longer} is {len(encodings[longer].ids)} tokens even truncated, "
                            f"more than data.context={context} (the tokenizer's special tokens count too); "
                            "raise data.context")
        end = start + len(encodings)
        arrays[INPUT_IDS][start:end] = [e.ids for e in encodings]
        arrays[ATTENTION_MASK][start:end] = [e.attention_mask for e in encodings]
        if tokenizer.type_ids:
            arrays[TOKEN_TYPE_IDS][start:end] = [e.type_ids for e in encodings]
        if each_batch is not None:
            each_batch(start, encodings)
        truncated += sum(bool(e.overflowing) for e in encodings)
        progress.done = end
        progress.update(int(arrays[ATTENTION_MASK][start:end].sum()), final=end == rows)
    log.info("data.text: %d of %d rows (%.1f%%) were longer than data.context=%d tokens and were truncated",
             truncated, rows, 100 * truncated / max(rows, 1), context)
    return arrays

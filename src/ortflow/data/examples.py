"""A causal language model's examples from rows: chats, prompt-completion pairs, documents in a column.

The rows come from a .jsonl or .parquet file or from a folder written by `datasets`' `save_to_disk`
(`open_rows`), read a batch at a time: a folder's train and validation (or test) splits are kept as
the train and eval splits. `data.format` says what a row holds (`auto`: a `data.messages` column is a
chat, `data.prompt` and `data.completion` columns a prompt-completion pair):
- `messages`: a list of {role, content}, rendered with the chat template (`data.chat_template`, else
  the tokenizer folder's own) as transformers' `apply_chat_template` renders it, and tokenized as it
  tokenizes the rendering (no special tokens added: the template writes them);
- `prompt-completion`: two texts, tokenized each and followed by the end-of-text token, or two lists
  of messages (conversational), the completion's turns rendered after the prompt's;
- `documents`: a text column (`data.text`, default `text`) whose rows are documents, encoded as a
  .txt file's are (tokenizer.document_tokens) and cut into windows by sources.py.

A chat or a pair is one example of at most `data.context` tokens: the input ids, an attention mask
(0 on the padding) and the labels, the ids shifted by one as the windows of text are, IGNORE_INDEX
where the next token is not in the loss: by default (`data.loss_on: assistant`) only the assistant
turns (TRL's `assistant_only_loss`) or the completion are, with `all` every token. Which tokens are
the assistant's: the template's own `{% generation %}` marks (transformers' assistant mask), else the
text that each assistant turn adds to the rendering of the turns before it with the generation
prompt (as TRL finds them). A longer example is truncated or dropped (`data.too_long`), and both
are counted. Examples go to scratch files, unpadded (ragged.py), not memory, as a tokenized text's stream does.

`data.packing` puts several examples into a record of `data.context` tokens (Windows) with the labels
each had alone, so that the loss is on the same tokens: `separate` places whole examples first-fit into
a few open windows and gives each its own position ids, from 0, from which the model builds a mask that
keeps examples apart (models/hugging_face.py); `cross` cuts the examples' stream into windows, as a
text's, an example attending to those before it in its window.
"""

from __future__ import annotations

import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..errors import DataError
from ..models import IGNORE_INDEX
from . import ragged, tokenizer as tokenizers

log = logging.getLogger("ortflow.prepare_data")

ROLES = ("system", "user", "assistant")
READ_ROWS = 1024  # rows read (and rendered) per batch
DATASET_DICT = "dataset_dict.json"  # save_to_disk of a DatasetDict
DATASET_FILES = ("dataset_info.json", "state.json")  # save_to_disk of a Dataset
EVAL_SPLITS = ("validation", "test")  # a datasets folder's eval split, the first present
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' mark of the assistant's tokens
IDS, LABELS, POSITIONS = 0, 1, 2  # a record's fields in its scratch files (ragged.py); positions: separate's
FIELDS = 2  # input ids and labels: the attention mask is 1 on every token a record holds
POSITION_IDS = "position_ids"  # data.packing separate: each example's positions, from 0, a field before the labels
OPEN_WINDOWS = 64  # windows that data.packing separate fills at once: first fit among them, in bounded memory


@dataclass
class Rows:
    where: str  # the file, or the folder and split, that row numbers refer to
    columns: list[str]
    batches: Callable[[], Iterator[list[dict]]]  # the rows in order, READ_ROWS at a time


@dataclass
class Counts:
    """What the log and the manifest say of the examples."""
    examples: int = 0
    truncated: int = 0
    dropped: int = 0
    loss_tokens: int = 0
    splits: dict = field(default_factory=dict)  # split -> examples, of a source with its own splits
    packing: str = "none"
    windows: int = 0  # records written: the examples, or the windows they were packed into
    padding: int = 0  # tokens of padding in those records

    def describe(self) -> dict:
        packed = {"packing": self.packing, "windows": self.windows, "padding": self.padding}
        return {"examples": self.examples, "truncated": self.truncated, "dropped": self.dropped,
                "loss_tokens": self.loss_tokens, "splits": self.splits} | (packed if self.packing != "none" else {})


def is_rows(path: Path) -> bool:
    """Whether `data.source` may hold examples of this module: a .jsonl or .parquet file, or a folder."""
    return path.is_dir() or path.suffix.lower() in (".jsonl", ".parquet")


def open_rows(path: Path) -> dict[str, Rows]:
    """The rows of `path`: {"all": rows} of a file or a single datasets split, else {"train", "eval"}."""
    if path.is_dir():
        return _datasets_folder(path)
    if path.suffix.lower() == ".jsonl":
        return {"all": _jsonl_rows(path)}
    return {"all": _parquet_rows(path)}


def _jsonl_rows(path: Path) -> Rows:
    def first() -> list[str]:
        """The first row's columns; none if it is no JSON object, for pandas to say why (sources.py)."""
        with open(path, encoding="utf-8", errors="replace") as lines:
            try:
                value = json.loads(next(filter(str.strip, lines), "{}"))
            except json.JSONDecodeError:
                return []
        return list(value) if isinstance(value, dict) else []

    def batches() -> Iterator[list[dict]]:
        batch = []
        with open(path, encoding="utf-8") as lines:
            for row, line in enumerate(filter(str.strip, lines)):
                batch.append(_json_row(path, row, line))
                if len(batch) == READ_ROWS:
                    yield batch
                    batch = []
        if batch:
            yield batch

    return Rows(str(path), first(), batches)


def _json_row(path: Path, row: int, line: str) -> dict:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{path}: row {row} is not JSON ({error})") from None
    if not isinstance(value, dict):
        raise DataError(f"{path}: row {row} is a JSON {type(value).__name__}, not an object of named columns")
    return value


def _parquet_rows(path: Path) -> Rows:
    import pyarrow.parquet as pq

    try:
        names = pq.ParquetFile(path).schema_arrow.names
    except Exception as error:  # pyarrow's ArrowInvalid, OSError, ... with the reason
        raise DataError(f"{path}: not a Parquet file ({str(error).strip()[:200]})") from None

    def batches() -> Iterator[list[dict]]:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=READ_ROWS):
            yield batch.to_pylist()

    return Rows(str(path), names, batches)


def _datasets_folder(path: Path) -> dict[str, Rows]:
    if not (path / DATASET_DICT).is_file() and not all((path / name).is_file() for name in DATASET_FILES):
        arrow = " (it holds Arrow files)" if any(path.glob("*.arrow")) else ""
        raise DataError(f"data.source: {path} is a directory, not a file{arrow}, nor a folder written by datasets' "
                        f"save_to_disk: it has neither {DATASET_DICT} nor {' and '.join(DATASET_FILES)}")
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as error:  # datasets raises FileNotFoundError, ValueError, ... with the reason
        raise DataError(f"data.source: datasets cannot load the folder {path} "
                        f"({str(error).strip().splitlines()[0][:200]})") from None
    if not isinstance(loaded, datasets.DatasetDict):
        return {"all": _arrow_rows(str(path), loaded)}
    evaluation = next((name for name in EVAL_SPLITS if name in loaded), None)
    if "train" in loaded and evaluation:
        return {"train": _arrow_rows(f"{path} (split train)", loaded["train"]),
                "eval": _arrow_rows(f"{path} (split {evaluation})", loaded[evaluation])}
    name = "train" if "train" in loaded else next(iter(loaded))
    log.info("data.source %s: no train and validation/test splits (%s): split %r is split by data.eval_fraction",
             path, ", ".join(loaded), name)
    return {"all": _arrow_rows(f"{path} (split {name})", loaded[name])}


def _arrow_rows(where: str, dataset) -> Rows:
    def batches() -> Iterator[list[dict]]:
        for columns in dataset.iter(batch_size=READ_ROWS):  # Arrow memory-mapped, a batch at a time
            yield [dict(zip(columns, values)) for values in zip(*columns.values())]

    return Rows(where, list(dataset.column_names), batches)


def format_of(data, columns: list[str]) -> str:
    """`data.format`, `auto` resolved from the columns: `table` for today's tables, and for text columns
    (data.text) of a classifier or a sequence-to-sequence model, whatever other columns the rows have."""
    if data.format != "auto":
        return data.format
    if data.text:
        return "table"
    if data.messages in columns:
        return "messages"
    if data.prompt in columns and data.completion in columns:
        return "prompt-completion"
    return "table"


def documents(rows: Rows, column: str) -> Iterator[str]:
    """The documents of the text column `column`, one a row."""
    _require(rows, [column], "data.text")
    for start, row, values in _numbered(rows):
        text = values.get(column)
        if not isinstance(text, str):
            raise DataError(f"{rows.where}: row {start + row}: column {column!r} holds "
                            f"{type(text).__name__}, not a document's text")
        yield text


def _numbered(rows: Rows) -> Iterator[tuple[int, int, dict]]:
    """(the batch's first row number, the row's place in it, the row) of each row."""
    start = 0
    for batch in rows.batches():
        for row, values in enumerate(batch):
            yield start, row, values
        start += len(batch)


def _require(rows: Rows, columns: list[str], keys: str) -> None:
    missing = [column for column in columns if column not in rows.columns]
    if missing:
        raise DataError(f"{rows.where}: column(s) {', '.join(missing)} not found; the rows have columns "
                        f"{', '.join(rows.columns) or 'none'} (set {keys}, or data.format)")


# --- chats and prompt-completion pairs ------------------------------------------------------------------


@dataclass
class Tokens:
    """The tokens of a batch of rows: their ids one after another, whether each is in the loss, and where
    each row starts (`starts`; a row ends where the next starts, the last at `len(ids)`)."""
    ids: np.ndarray  # int32
    loss: np.ndarray  # bool
    starts: np.ndarray  # int64, a row's first token

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.starts, append=len(self.ids))

    @classmethod
    def of(cls, rows: list[tuple[list[int], np.ndarray]]) -> "Tokens":
        """Of (ids, loss) a row."""
        lengths = np.fromiter((len(ids) for ids, _ in rows), np.int64, len(rows))
        total = int(lengths.sum())
        ids = np.fromiter(chain.from_iterable(ids for ids, _ in rows), ragged.TOKEN, total)
        loss = np.concatenate([loss for _, loss in rows]) if rows else np.zeros(0, bool)
        return cls(ids, loss.astype(bool, copy=False), np.cumsum(lengths) - lengths)

    @classmethod
    def encoded(cls, encodings: list) -> "Tokens":
        """Of the tokenizers library's encodings, none in the loss yet."""
        lengths = np.fromiter(map(len, encodings), np.int64, len(encodings))
        total = int(lengths.sum())
        ids = np.fromiter(chain.from_iterable(encoding.ids for encoding in encodings), ragged.TOKEN, total)
        return cls(ids, np.zeros(total, bool), np.cumsum(lengths) - lengths)


class Renderer:
    """Rows of a chat or prompt-completion format -> (token ids, whether each is in the loss)."""

    def __init__(self, data, tokenizer: tokenizers.Tokenizer, fmt: str):
        self.data, self.tokenizer, self.format = data, tokenizer, fmt
        self.eos = tokenizer.token_id(tokenizer.eos_token) if tokenizer.eos_token else None
        self.chat = None
        if fmt == "messages":
            self._open_chat()
        if fmt == "prompt-completion" and self.eos is None:
            raise DataError(f"data.tokenizer: {tokenizer.source} has no end-of-text token to end a completion "
                            f"with (none of {', '.join(tokenizers.EOS_TOKENS)})")

    def _open_chat(self) -> None:
        """The chat template, at the first chat: prompt-completion pairs of texts need none."""
        self.chat = _chat_tokenizer(self.tokenizer, self.data.chat_template)
        self.template = self.tokenizer.chat_template = self.chat.chat_template
        self.marked = bool(GENERATION.search(self.template))

    def columns(self) -> list[str]:
        return [self.data.messages] if self.format == "messages" else [self.data.prompt, self.data.completion]

    def examples(self, where: str, start: int, batch: list[dict]) -> "Tokens":
        """The tokens of the rows of `batch`, the first numbered `start`, and which are in the loss. Chats
        are tokenized a batch at a time, on the tokenizers library's threads: a call a row cost more than
        its encoding (100,000 chats: 420 s a row at a time, docs/benchmarks.md)."""
        texts, finish = self._rendered(where, start, batch)
        return finish(self._encode(texts))

    def tokenized(self, rows: Rows) -> Iterator[tuple[int, int, "Tokens"]]:
        """(the first row's number, the rows, `examples` of them) of each batch of `rows`, in order. A batch
        is encoded on a thread of its own while the next is read and rendered: encode_batch releases the
        GIL (its work is on the library's own threads), rendering is Python; one after the other, they kept
        1.3 cores of 2 busy on average (docs/benchmarks.md, "Tokenizing chats"). A row that
        fails to render is named after the rows before it have been given: the first bad row is the one
        named."""
        batches, start, pending = rows.batches(), 0, None  # pending: the batch being encoded

        def given():
            first, size, encoding, finish = pending
            return first, size, finish(encoding.result())

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ortflow-encode") as pool:
            while True:
                try:
                    batch = next(batches, None)
                    if batch is None:
                        break
                    texts, finish = self._rendered(rows.where, start, batch)
                except DataError:
                    if pending is not None:
                        yield given()
                    raise
                encoding = pool.submit(self._encode, texts)
                if pending is not None:
                    yield given()
                pending, start = (start, len(batch), encoding, finish), start + len(batch)
            if pending is not None:
                yield given()

    def _encode(self, texts: list[str] | None) -> list | None:
        return None if texts is None else self.tokenizer.backend.encode_batch(texts, add_special_tokens=False)

    def _rendered(self, where: str, start: int, batch: list[dict]) -> tuple[list[str] | None, Callable]:
        """The texts of a batch of rows to encode (None: there is nothing to encode a batch at a time), and
        what makes the batch's Tokens of their encodings."""
        if self.format == "messages":
            texts, finish = self._chats(where, start, [self._messages(where, start + row, values, self.data.messages)
                                                       for row, values in enumerate(batch)])
        else:
            pairs = Tokens.of([self._pair(where, start + row, values) for row, values in enumerate(batch)])
            texts, finish = None, lambda _: pairs

        def tokens(encodings: list | None) -> Tokens:
            found = finish(encodings)
            if self.data.loss_on == "all":
                found.loss[:] = True
            return found

        return texts, tokens

    def _messages(self, where: str, row: int, values: dict, column: str) -> list[dict]:
        """The row's messages, checked: a list of {role, content} of roles the template takes."""
        if column not in values:
            raise DataError(f"{where}: row {row} has no column {column!r} (it has {', '.join(values) or 'none'})")
        messages = values[column]
        shape = isinstance(messages, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)
        if not shape or not messages:
            raise DataError(f"{where}: row {row}: column {column!r} is not a list of messages "
                            f"{{\"role\": ..., \"content\": ...}} with text contents (got {str(messages)[:100]})")
        for message in messages:
            # A template that names a role (a tool's, say) renders it; any other it would drop or garble.
            if message["role"] not in ROLES and message["role"] not in self.template:
                raise DataError(f"{where}: row {row}: role {message['role']!r} is none of {', '.join(ROLES)} and "
                                "the chat template does not name it")
        return messages

    def _render(self, where: str, row: int, messages: list[dict], prompt: bool = False) -> str:
        return self._apply(where, row, messages, tokenize=False, add_generation_prompt=prompt)

    def _apply(self, where: str, row: int, messages: list[dict], **options):
        try:
            return self.chat.apply_chat_template(messages, **options)
        except Exception as error:  # jinja2's TemplateError, or what the template raises itself
            raise DataError(f"{where}: row {row}: the chat template fails to render it "
                            f"({type(error).__name__}: {str(error).strip()[:200]})") from None

    def _chats(self, where: str, start: int, chats: list[list[dict]]) -> tuple[list[str], Callable]:
        """The chats' renderings, and what makes their Tokens of the renderings' encodings."""
        if not self.marked:  # the assistant's tokens found by rendering the turns before each
            texts, spans = [], []
            for row, messages in enumerate(chats):
                texts.append(self._render(where, start + row, messages))
                spans.append([self._turn(where, start + row, messages[:i], messages[:i + 1], texts[-1])
                              for i, message in enumerate(messages) if message["role"] == "assistant"])
            return texts, lambda encodings: Tokens.of([self._tokens(encoding, turns)
                                                       for encoding, turns in zip(encodings, spans)])
        # The template marks the assistant's tokens itself. What apply_chat_template(tokenize=True,
        # return_assistant_tokens_mask=True) does, the same tokens and mask, but with the ids and the mask
        # made as arrays, not lists a token, it went through (docs/benchmarks.md): its rendering (it drops the
        # messages' keys of value None first), the rendering encoded without special tokens, and the
        # characters of each {% generation %} span to the tokens from the one of its first to the one of its
        # last character (to the end if that has none; the chat's later spans left out if its first has none).
        from transformers.utils.chat_template_utils import render_jinja_template

        plain = [[{key: value for key, value in message.items() if value is not None} for message in messages]
                 for messages in chats]
        try:
            texts, generations = render_jinja_template(
                conversations=plain, chat_template=self.chat.get_chat_template(),
                return_assistant_tokens_mask=True, **self.chat.special_tokens_map)
        except Exception as error:  # rendered alone, the row that fails is named with its error
            for row, messages in enumerate(chats):
                self._render(where, start + row, messages)
            raise DataError(f"{where}: rows {start} to {start + len(chats) - 1}: the chat template fails to "
                            f"render them ({type(error).__name__}: {str(error).strip()[:200]})") from None
        return texts, partial(_marked, generations=generations)

    def _turn(self, where: str, row: int, before: list[dict], upto: list[dict], text: str) -> tuple[int, int]:
        """The characters of `text` that the last turn of `upto` adds to `before` with its generation prompt."""
        prefix, turn = self._render(where, row, before, prompt=True), self._render(where, row, upto)
        if not (turn.startswith(prefix) and text.startswith(turn)):
            raise DataError(f"{where}: row {row}: the chat template renders the turns before an assistant turn "
                            "otherwise than as the start of the chat, so its tokens cannot be told apart; mark "
                            "them with {% generation %} ... {% endgeneration %} in data.chat_template, or "
                            "set data.loss_on: all")
        return len(prefix), len(turn)

    @staticmethod
    def _tokens(encoding, spans: list[tuple[int, int]]) -> tuple[list[int], np.ndarray]:
        """The ids of a text's `encoding` (as apply_chat_template tokenizes it: no special tokens added), each
        in the loss if it starts in a span of characters."""
        starts = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
        loss = np.zeros(len(starts), dtype=bool)
        for begin, end in spans:
            loss |= (begin <= starts) & (starts < end)
        return encoding.ids, loss

    def _pair(self, where: str, row: int, values: dict) -> tuple[list[int], np.ndarray]:
        prompt_key, completion_key = self.data.prompt, self.data.completion
        missing = [key for key in (prompt_key, completion_key) if key not in values]
        if missing:
            raise DataError(f"{where}: row {row} has no column {', '.join(map(repr, missing))} (it has "
                            f"{', '.join(values) or 'none'})")
        if isinstance(values[prompt_key], list):  # conversational: the completion's turns after the prompt's
            if self.chat is None:
                self._open_chat()
            prompt = self._messages(where, row, values, prompt_key)
            completion = self._messages(where, row, values, completion_key)
            text = self._render(where, row, prompt + completion)
            ids, loss = self._tokens(self.tokenizer.backend.encode(text, add_special_tokens=False),
                                     [self._turn(where, row, prompt, prompt + completion, text)])
        else:
            texts = [values[prompt_key], values[completion_key]]
            if not all(isinstance(text, str) for text in texts):
                raise DataError(f"{where}: row {row}: {prompt_key!r} and {completion_key!r} are "
                                f"{type(texts[0]).__name__} and {type(texts[1]).__name__}; give two texts or two "
                                "lists of messages")
            first, second = self.tokenizer.backend.encode_batch_fast(texts, add_special_tokens=False)
            ids, loss = first.ids + second.ids, np.repeat([False, True], [len(first.ids), len(second.ids)])
        if not ids or ids[-1] != self.eos:  # the model learns to stop after a completion
            ids, loss = ids + [self.eos], np.append(loss, True)
        return ids, loss


def _marked(encodings: list, generations: list[list[tuple[int, int]]]) -> Tokens:
    """The Tokens of encoded renderings, in the loss the tokens of their {% generation %} spans of characters
    (Renderer._chats)."""
    found = Tokens.encoded(encodings)
    for encoding, first, spans in zip(encodings, found.starts, generations):
        for begin, end in spans:
            token, last = encoding.char_to_token(begin), encoding.char_to_token(end - 1)
            if token is None:
                break
            # `not last`, as transformers tests it: a span ending in token 0 also runs to the end
            found.loss[first + token:first + (last + 1 if last else len(encoding))] = True
    return found


def _chat_tokenizer(tokenizer: tokenizers.Tokenizer, template: str | None):
    """The transformers tokenizer that renders chats: the folder's (its special tokens, which templates
    name), or one around a tokenizer.json; `template` (data.chat_template) replaces its own."""
    chat = tokenizer.loaded
    if chat is None:
        from transformers import PreTrainedTokenizerFast

        chat = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, eos_token=tokenizer.eos_token,
                                       pad_token=tokenizer.pad_token)
    if template:
        file = template_file(template)
        chat.chat_template = file.read_text(encoding="utf-8") if file else template
        if "{" not in chat.chat_template:
            raise DataError(f"data.chat_template: {template!r} is neither a file nor a Jinja template")
    if not getattr(chat, "chat_template", None):
        raise DataError(f"data.tokenizer: {tokenizer.source} has no chat template to render the messages with: "
                        "give one in data.chat_template (a file or the template itself), or use a tokenizer "
                        "folder whose tokenizer_config.json has a chat_template")
    return chat


def encode(data, tokenizer: tokenizers.Tokenizer, splits: dict[str, Rows], fmt: str, scratch: Path | None):
    """The examples of the rows of `splits` in format `fmt`: ({input_ids, attention_mask}, labels), each
    [examples, data.context] int64 read padded from unpadded scratch files in `scratch` (ragged.py); the
    Counts; and (train rows, eval rows) of a source with its own splits, else None."""
    renderer = Renderer(data, tokenizer, fmt)
    pad = tokenizer.pad_token or tokenizer.eos_token
    if pad is None:
        raise DataError(f"data.tokenizer: {tokenizer.source} has neither a padding nor an end-of-text token to pad "
                        f"short examples with (none of {', '.join(tokenizers.PAD_TOKENS + tokenizers.EOS_TOKENS)})")
    tokenizer.pad_token, tokenizer.input = pad, tokenizers.INPUT_IDS  # what the manifest records
    counts = Counts(packing=data.packing)
    written = {}  # split -> records
    windows = Windows(scratch, data.packing, data.context)
    for name, rows in splits.items():
        _require(rows, renderer.columns(), "data.messages, or data.prompt and data.completion")
        before, records = counts.examples, len(windows.records)
        progress = tokenizers.Progress(rows.where, 0, "rows", 1)
        for start, size, found in renderer.tokenized(rows):
            windows.extend(*_examples(found, rows.where, start, data, counts))
            progress.done = start + size
            progress.update(len(found.ids))
        progress.update(0, final=True)
        windows.end()  # the examples of two splits share no window
        counts.splits[name] = counts.examples - before
        written[name] = len(windows.records) - records
    if counts.examples == 0:
        raise DataError(f"data.source {data.source!r}: no example left (data.too_long: drop dropped all "
                        f"{counts.dropped}, longer than data.context={data.context} tokens)")
    records = windows.records
    records.end()
    counts.windows, counts.padding = len(records), windows.padding
    log.info("%s: %d examples, %d truncated and %d dropped (longer than data.context=%d tokens, data.too_long: "
             "%s); %d tokens in the loss (data.loss_on: %s)", fmt, counts.examples, counts.truncated, counts.dropped,
             data.context, data.too_long, counts.loss_tokens, data.loss_on)
    if data.packing != "none":
        log.info("data.packing %s: %d examples in %d windows of %d tokens, %.1f%% of them padding", data.packing,
                 counts.examples, counts.windows, data.context, 100 * counts.padding / (counts.windows * data.context))
    split = None
    if "train" in written:
        train = written["train"]
        split = (np.arange(train), np.arange(train, len(records)))
    features = {tokenizers.INPUT_IDS: ragged.Padded(records, IDS, tokenizer.token_id(pad)),
                tokenizers.ATTENTION_MASK: ragged.Padded(records, None, 0)}
    if data.packing == "separate":
        features[POSITION_IDS] = ragged.Padded(records, POSITIONS, None)
    return features, ragged.Padded(records, LABELS, IGNORE_INDEX), counts, split


class Windows:
    """Where the examples go: `records` (ragged.Ragged, in `scratch`), one a record (data.packing: none), or
    packed into windows of `context` tokens (separate, cross), each example's labels as they were alone. A
    `separate` window has a field more, the position ids; its padding is a last "example" of positions from
    0 too, in the loss nowhere, which only attends to itself (ragged.Padded pads them so)."""

    def __init__(self, scratch: Path | None, packing: str, context: int):
        self.packing, self.context = packing, context
        self.records = ragged.Ragged(scratch, FIELDS + (packing == "separate"), context)
        self.padding = 0
        self.open: list[list] = []  # [window: [fields, context] int32, tokens used] being filled, oldest first

    def add(self, ids: np.ndarray, labels: np.ndarray) -> None:
        if self.packing == "none":
            self.records.append(ids, labels)
            self.padding += self.context - len(ids)
        elif self.packing == "cross":
            self._stream(ids, labels)
        else:
            self._first_fit(ids, labels)

    def extend(self, ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray) -> None:
        """Examples one after another: their ids and labels, and their lengths."""
        if self.packing == "none":  # a record each, written together
            self.records.extend(lengths, ids, labels)
            self.padding += int((self.context - lengths).sum())
            return
        for begin, end in zip((np.cumsum(lengths) - lengths).tolist(), np.cumsum(lengths).tolist()):
            self.add(ids[begin:end], labels[begin:end])

    def end(self) -> None:
        for window, used in self.open:
            self._write(window, used)
        self.open = []

    def _write(self, window: np.ndarray, used: int) -> None:
        self.records.append(*window[:, :used])
        self.padding += self.context - used

    def _new(self) -> list:
        self.open.append([np.empty((self.records.fields, self.context), ragged.TOKEN), 0])
        return self.open[-1]

    def _first_fit(self, ids: np.ndarray, labels: np.ndarray) -> None:
        length = len(ids)
        place = next((i for i, (_, used) in enumerate(self.open) if used + length <= self.context), None)
        if place is None:
            if len(self.open) == OPEN_WINDOWS:  # the fullest window has the least room left for another
                self._write(*self.open.pop(max(range(len(self.open)), key=lambda i: self.open[i][1])))
            self._new()
            place = len(self.open) - 1
        window, used = self.open[place]
        window[IDS, used:used + length], window[LABELS, used:used + length] = ids, labels
        window[POSITIONS, used:used + length] = np.arange(length)
        self.open[place][1] = used + length
        if used + length == self.context:
            self._write(*self.open.pop(place))

    def _stream(self, ids: np.ndarray, labels: np.ndarray) -> None:
        taken = 0
        while taken < len(ids):
            window, used = self.open[0] if self.open else self._new()
            n = min(len(ids) - taken, self.context - used)
            window[IDS, used:used + n], window[LABELS, used:used + n] = ids[taken:taken + n], labels[taken:taken + n]
            self.open[0][1], taken = used + n, taken + n
            if used + n == self.context:
                self._write(*self.open.pop())


def _examples(found: Tokens, where: str, start: int, data, counts: Counts) -> tuple[np.ndarray, ...]:
    """The examples of a batch of rows (`found`, the first row numbered `start`) as (ids, labels, lengths),
    unpadded, one after another: each truncated to data.context or left out (data.too_long: drop); the
    labels the ids shifted by one (the next token, as the windows of a text are), IGNORE_INDEX where that
    token is not in the loss."""
    context, lengths = data.context, found.lengths
    long = lengths > context
    kept = ~long if data.too_long == "drop" else np.ones(len(lengths), bool)
    example = np.repeat(np.arange(len(lengths)), lengths)  # each token's row in the batch
    position = np.arange(len(found.ids)) - found.starts[example]
    taken = kept[example] & (position < context)
    following = np.zeros(len(taken), bool)  # the next token is of the same example, in it, and in the loss
    following[:-1] = taken[1:] & (position[1:] > 0) & found.loss[1:]
    labels = np.full(len(found.ids), IGNORE_INDEX, ragged.TOKEN)
    labels[:-1] = np.where(following[:-1], found.ids[1:], IGNORE_INDEX)
    learned = np.bincount(example[following], minlength=len(lengths))
    empty = np.flatnonzero(kept & (learned == 0))  # a template may render nothing
    if len(empty):
        row, what = empty[0], "its assistant turns (or completion)"
        raise DataError(f"{where}: row {start + row}: {what} are empty after truncation to data.context={context} "
                        "tokens; raise data.context, or set data.too_long: drop" if long[row] else
                        f"{where}: row {start + row}: nothing to learn: {what} have no token (data.loss_on: all "
                        "trains on every token)")
    counts.dropped += int((~kept).sum())
    counts.truncated += int((long & kept).sum())
    counts.examples += int(kept.sum())
    counts.loss_tokens += int(learned.sum())
    return found.ids[taken], labels[taken], np.minimum(lengths, context)[kept]


def template_file(template: str | None) -> Path | None:
    """The file that `data.chat_template` names, if it names one: a Jinja template has a '{', a path none."""
    return Path(template) if template and "{" not in template and Path(template).is_file() else None


def source_files(source: str) -> list[str]:
    """The files of `data.source`: a datasets folder's (its Arrow files and descriptions), else the file."""
    path = Path(source)
    return sorted(str(file) for file in path.rglob("*") if file.is_file()) if path.is_dir() else [source]

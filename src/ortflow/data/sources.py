"""Raw data sources, each turned into named numeric arrays with one row per sample.

Built in: `digits` (scikit-learn's 8x8 handwritten digits, shipped inside its
package) and `text` (a language-model corpus; by default Python's own
documentation from `pydoc_data`). Bring your own: .csv, .parquet, .jsonl, .npz,
.h5/.hdf5, .txt, or a folder written by `datasets`' save_to_disk. Rows of chats,
prompt-completion pairs or documents (data.format) become a causal LM's
examples (examples.py).

Text is bytes (vocabulary 256), or with `data.tokenizer` token ids
(tokenizer.py); either way cut into windows of `data.context` whose label is the
same window shifted by one (`windows`).

Table columns (CSV, Parquet, JSON Lines) `data.features` become one input named
`x` (TABLE_INPUT) (shape [len(features)]); or, with `data.text`, the text
column(s) become the tokenizer's `input_ids`, `attention_mask` (and
`token_type_ids`). .npz and HDF5 arrays keep their names and shapes, one input
each. Integer features stay integer, as int64 (`feature_dtype`), so that token
ids reach an embedding without a cast; other features become float32. CSV
columns always become float32: their types are pandas' guesses from text.

The label keeps its name (`data.label`). A label of strings or bools is
classification: its sorted values are the classes 0..K-1, their names kept in
`Dataset.classes` (and the manifest). An integer class label of -100
(IGNORE_INDEX) is no class: the loss and the metrics leave such positions out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..models import DECODER_INPUT_IDS, IGNORE_INDEX
from . import examples, tokenizer as tokenizers

FRAME_SUFFIXES = (".csv", ".parquet", ".jsonl")  # read by pandas; the only ones with text columns (data.text)
TABULAR_SUFFIXES = FRAME_SUFFIXES + (".npz", ".h5", ".hdf5")
TEXT_SUFFIXES = (".txt",)
BYTE_VOCAB = 256
TABLE_INPUT = "x"  # the one input that CSV/Parquet feature columns are stacked into
FLOAT32_MAX = float(np.finfo(np.float32).max)
# The largest value whose square is a float32: beyond it a squared error or a
# gradient overflows at the first step, and training stops with a non-finite loss.
FLOAT32_SQUARE_MAX = FLOAT32_MAX**0.5


@dataclass
class Dataset:
    features: dict[str, np.ndarray]  # name -> [N, ...]
    label: np.ndarray  # [N, ...]
    label_name: str
    task: str  # classification | regression | language_model
    num_classes: int | None = None  # classification: classes; language_model: vocabulary size
    classes: list[str] | None = None  # the names of classes 0..K-1 of a label of strings or bools
    tokenizer: tokenizers.Tokenizer | None = None  # data.tokenizer, which made the token ids
    split: tuple[np.ndarray, np.ndarray] | None = None  # (train rows, eval rows) of a source with its own splits
    counts: dict | None = None  # examples.Counts of chats and prompt-completion pairs: for the manifest

    def __len__(self) -> int:
        return len(self.label)


def load(data, scratch: Path | None = None) -> Dataset:
    """Read `data.source` into a Dataset, checking it on the way. `scratch`: a
    folder for the token stream of a tokenized text (tokenizer.py), which is
    mapped from a file there rather than held in memory."""
    source = data.source
    if source == "digits":
        dataset = _digits(data)
    elif source == "text":
        path = Path(data.text_path) if data.text_path else None
        dataset = _text(data, "data.text_path", path, scratch)
    elif (dataset := _examples(data, Path(source), scratch)) is not None:
        pass
    else:
        path = Path(source)
        suffix = path.suffix.lower()
        if suffix not in TABULAR_SUFFIXES + TEXT_SUFFIXES:
            raise DataError(
                f"data.source: {source!r} is neither 'digits', 'text' nor a file ending in "
                f"{', '.join(TABULAR_SUFFIXES + TEXT_SUFFIXES)}"
            )
        _check_is_file("data.source", path)
        if suffix in TEXT_SUFFIXES:
            dataset = _text(data, "data.source", path, scratch)
        elif suffix in FRAME_SUFFIXES:
            frame, typed = {".csv": _csv, ".parquet": _parquet, ".jsonl": _jsonl}[suffix](path)
            classes = None
            if data.text:
                tokenizer = tokenizers.load(data.tokenizer)
                features, label, classes = _frame_text(frame, str(path), data, tokenizer)
            else:
                _check_label_not_a_feature(data, path)
                tokenizer, (features, label) = None, _frame_columns(frame, str(path), data.features,
                                                                    data.label, typed)
            if data.task == "seq2seq":  # the target's tokens, as a language model's
                dataset = Dataset(features, label, data.label, "language_model", tokenizer.vocab_size)
            else:
                dataset = _tabular(features, label, data, str(path), classes)
            dataset.tokenizer = tokenizer
        else:
            _check_label_not_a_feature(data, path)
            features, label = (_npz if suffix == ".npz" else _hdf5)(path, data.features, data.label)
            dataset = _tabular(features, label, data, str(path))
    if len(dataset) == 0:
        raise DataError(f"data.source {source!r}: the data set has no samples")
    if dataset.label_name in dataset.features:
        raise DataError(
            f"data.label {dataset.label_name!r} is also the name of an input "
            f"({', '.join(dataset.features)}); give the label another name"
        )
    return dataset


def _examples(data, path: Path, scratch: Path | None) -> Dataset | None:
    """A language model's examples (examples.py) of a .jsonl, .parquet or datasets folder whose rows are
    chats, prompt-completion pairs or documents (data.format); None for a table (or no such source)."""
    if not (examples.is_rows(path) and path.exists()):
        return None
    splits = examples.open_rows(path)
    fmt = examples.format_of(data, next(iter(splits.values())).columns)
    if fmt == "table":
        if path.is_dir():
            raise DataError(f"data.source: the datasets folder {path} has columns "
                            f"{', '.join(next(iter(splits.values())).columns)}: no {data.messages!r} (data.messages), "
                            f"nor {data.prompt!r} and {data.completion!r} (data.prompt, data.completion); a column "
                            "of documents is data.format: documents with data.text")
        return None
    if not data.tokenizer:
        raise DataError(f"data.source {path}: {fmt} rows are tokenized: set data.tokenizer")
    if isinstance(data.text, list):
        raise DataError(f"data.text: {fmt} rows read one column of text, not {len(data.text)}")
    tokenizer = tokenizers.load(data.tokenizer)
    if fmt == "documents":
        return _column_documents(data, splits, tokenizer, scratch)
    features, labels, counts, split = examples.encode(data, tokenizer, splits, fmt, scratch)
    return Dataset(features, labels, data.label, "language_model", tokenizer.vocab_size, tokenizer=tokenizer,
                   split=split, counts=counts.describe())


def _column_documents(data, splits: dict, tokenizer: tokenizers.Tokenizer, scratch: Path | None) -> Dataset:
    """The documents of the data.text column (`text` by default), encoded as a .txt file's are and cut into
    windows; a source's own train and eval splits each give their own windows (the one across both is left out)."""
    column = data.text or "text"
    progress = tokenizers.Progress(", ".join(rows.where for rows in splits.values()), 0, "documents", 1)

    def counted(rows):
        for document in examples.documents(rows, column):
            progress.done += 1
            yield document

    tokens, counts = tokenizers.document_tokens(tokenizer, [counted(rows) for rows in splits.values()], progress,
                                                scratch)
    dataset = _language_model(tokens, data, tokenizer.vocab_size, "tokens", tokenizer)
    if "train" in splits:
        # Window i holds tokens [i * context, i * context + context]: those of the train split end before
        # its last token, those of the eval split start at or after it (an end-of-text token).
        context, train = data.context, counts[0]
        dataset.split = (np.arange((train - 1) // context), np.arange(-(-(train - 1) // context), len(dataset)))
    return dataset


def _digits(data) -> Dataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    # Pixel values are 0..16; scaling to 0..1 keeps the first steps well conditioned.
    x = (digits.data / 16.0).astype(np.float32)
    name = data.features[0]
    if data.task == "regression":
        raise DataError("data.task: the digits data set is classification (labels 0..9)")
    return Dataset({name: x}, digits.target.astype(np.int64), data.label, "classification", 10)


def _pydoc_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[key] for key in sorted(topics))


def _check_is_file(key: str, path: Path) -> None:
    if path.is_dir():
        raise DataError(f"{key}: {path} is a directory, not a file")
    if not path.exists():
        raise DataError(f"{key}: file {path} does not exist")
    if not path.is_file():
        raise DataError(f"{key}: {path} is not a regular file")


def _check_label_not_a_feature(data, path: Path) -> None:
    """A label among the inputs is target leakage: the model would read the answer."""
    if data.label in data.features:
        raise DataError(
            f"{path}: column {data.label!r} is both data.label and one of data.features "
            f"({', '.join(data.features)}); the model would see the answer: remove it from data.features"
        )


def _check_float32_range(path: str, what: str, array: np.ndarray) -> None:
    """Training computes in float32: a value beyond its range would become infinite,
    one beyond the square root of it overflows the first squared error or gradient."""
    if not np.issubdtype(array.dtype, np.floating) or array.size == 0:
        return
    finite = array[np.isfinite(array)]
    largest = float(np.abs(finite).max()) if finite.size else 0.0
    if largest > FLOAT32_MAX:
        problem = f"beyond float32's range (largest {FLOAT32_MAX:.4g})"
    elif largest > FLOAT32_SQUARE_MAX:
        problem = f"so large that its square overflows float32 (largest usable {FLOAT32_SQUARE_MAX:.3g})"
    else:
        return
    raise DataError(f"{path}: {what} has a value of {largest:.4g}, {problem}; rescale it in the file "
                    "(data.standardize scales values only after they are read)")


def _check_classes(path: str, name: str, label: np.ndarray, classes: list[str] | None, rows: int) -> None:
    """`label`: the class ids of `rows` rows that are not IGNORE_INDEX."""
    present = np.unique(label)
    if len(label) and len(present) < 2:
        only = repr(classes[present[0]]) if classes else present[0]
        raise DataError(
            f"{path}: label {name!r} has a single class ({only}) in all {rows} rows; "
            "classification needs two or more (data.task: regression for a numeric target)"
        )


def _text(data, key: str, path: Path | None, scratch: Path | None) -> Dataset:
    """A language model's windows of the text file at `path` (config key `key`),
    or of Python's documentation: bytes, or token ids with data.tokenizer."""
    if path is not None:
        _check_is_file(key, path)
    if not data.tokenizer:
        text = _pydoc_text() if path is None else path.read_text(encoding="utf-8", errors="replace")
        tokens = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        return _language_model(tokens, data, BYTE_VOCAB, "bytes")
    tokenizer = tokenizers.load(data.tokenizer)
    tokens = tokenizers.language_model_tokens(tokenizer, _pydoc_text() if path is None else None, path, scratch)
    return _language_model(tokens, data, tokenizer.vocab_size, "tokens", tokenizer)


def windows(tokens: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) of next-token prediction: window i is tokens
    [i * context, i * context + context] (context + 1 tokens, so consecutive
    windows share one), the input its first `context`, the label the same shifted
    by one. Views of `tokens`, not copies: a split copies only its own rows."""
    count = max(len(tokens) - 1, 0) // context
    step = tokens.strides[0]
    view = np.lib.stride_tricks.as_strided(tokens, shape=(count, context + 1), strides=(context * step, step),
                                           writeable=False)
    return view[:, :-1], view[:, 1:]


def _language_model(tokens: np.ndarray, data, vocab_size: int, unit: str,
                    tokenizer: tokenizers.Tokenizer | None = None) -> Dataset:
    context = data.context
    inputs, labels = windows(tokens, context)
    if len(labels) < 2:
        raise DataError(
            f"data.source: the text has {len(tokens)} {unit}, fewer than two windows of data.context={context} + 1"
        )
    if tokenizer is not None:
        tokenizer.input = data.features[0]
    return Dataset({data.features[0]: inputs}, labels, data.label, "language_model", vocab_size,
                   tokenizer=tokenizer)


def feature_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a feature array is stored and fed as: integers as int64 (the
    index type of ONNX's Gather and torch's nn.Embedding), anything else float32."""
    return np.dtype(np.int64) if np.issubdtype(dtype, np.integer) else np.dtype(np.float32)


def table_dtype(columns, typed: bool) -> np.dtype:
    """The dtype of the input that a table's feature columns are stacked into:
    int64 when the file has typed columns (Parquet) that are all integer without
    missing values, else float32."""
    from pandas.api.types import is_integer_dtype

    integral = typed and all(is_integer_dtype(columns[c]) for c in columns) and not columns.isna().any().any()
    return np.dtype(np.int64) if integral else np.dtype(np.float32)


def _require_columns(frame, path: str, columns: list[str], keys: str) -> None:
    if len(frame) == 0:
        raise DataError(f"{path}: no rows (an empty data set)")
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise DataError(
            f"{path}: column(s) {', '.join(missing)} not found; the file has columns "
            f"{', '.join(map(str, frame.columns))} (set {keys})"
        )


def _check_numeric(frame, path: str, column: str, what: str = "") -> None:
    from pandas.api.types import is_bool_dtype, is_numeric_dtype

    if not (is_numeric_dtype(frame[column]) or is_bool_dtype(frame[column])):
        bad = frame[column][~frame[column].astype(str).str.match(r"^-?[0-9.eE+-]+$")]
        example = bad.iloc[0] if len(bad) else frame[column].iloc[0]
        raise DataError(
            f"{path}: column {column!r} is not numeric (e.g. {example!r}, dtype "
            f"{frame[column].dtype}); ortflow trains on numbers only{what}"
        )
    _check_float32_range(path, f"column {column!r}", frame[column].to_numpy())


def _label_column(frame, path: str, label: str) -> np.ndarray:
    """The label column: numbers or bools as they are, anything else (strings) as
    an object array of its values, which `_tabular` turns into named classes."""
    from pandas.api.types import is_bool_dtype, is_numeric_dtype

    column = frame[label]
    if _is_lists(column):
        raise DataError(f"{path}: column {label!r} holds lists (a tag per word?); token classification reads the "
                        "words from the column that data.text names, encoded with data.tokenizer")
    if is_numeric_dtype(column) or is_bool_dtype(column):
        _check_float32_range(path, f"column {label!r}", column.to_numpy())
        return column.to_numpy()
    return column.to_numpy(dtype=object)


def _frame_columns(frame, path: str, features: list[str], label: str, typed: bool = False):
    """The feature columns stacked into one input named `x` (`table_dtype`), and the label column."""
    _require_columns(frame, path, [*features, label], "data.features and data.label")
    for column in features:
        _check_numeric(frame, path, column, " (a text column is data.text, with data.tokenizer)")
    x = frame[list(features)].to_numpy(dtype=table_dtype(frame[list(features)], typed))
    return {TABLE_INPUT: x}, _label_column(frame, path, label)


def _frame_text(frame, path: str, data, tokenizer: tokenizers.Tokenizer):
    """The `data.text` column(s), one text or a pair per row, tokenized (tokenizer.py), and the label column
    and its class names (None: `_tabular` names the classes of a label of strings). A label column of lists
    is token classification (`_word_tags`); with data.task seq2seq the label column holds target texts,
    tokenized into the labels and the decoder's inputs (tokenizer.encode_targets)."""
    columns = text_columns(data)
    _require_columns(frame, path, columns + [data.label], "data.text and data.label")
    targets = [data.label] if data.task == "seq2seq" else []
    for column in columns + targets:
        missing = frame[column].isna().to_numpy()
        if missing.any():
            raise DataError(f"{path}: text column {column!r} has {int(missing.sum())} missing value(s) (first at "
                            f"row {int(np.argmax(missing))}); drop or fill those rows")
    tokenizer.text = columns
    if _is_lists(frame[data.label]) and not targets:
        return _word_tags(frame, path, data, tokenizer)
    texts = [frame[column].astype(str).tolist() for column in columns]
    features = tokenizers.encode_columns(tokenizer, texts, data.context, path)
    if targets:
        decoder_inputs, labels = tokenizers.encode_targets(tokenizer, frame[data.label].astype(str).tolist(),
                                                           data.context, path)
        return features | {DECODER_INPUT_IDS: decoder_inputs}, labels, None
    return features, _label_column(frame, path, data.label), None


def _is_lists(column) -> bool:
    """Whether a column holds lists (JSON's; Parquet's come as numpy arrays)."""
    return any(isinstance(value, (list, np.ndarray)) for value in column)


def _word_tags(frame, path: str, data, tokenizer: tokenizers.Tokenizer):
    """Token classification (the CoNLL shape, `{"tokens": [...], "tags": [...]}`): the
    `data.text` column's lists of words tokenized as split, and the `data.label`
    column's tags, one per word, aligned to the tokens (tokenizer.encode_words):
    IGNORE_INDEX where a token is no word's first. String tags are classes, their
    sorted names kept; integer tags are class ids."""
    if len(text_columns(data)) != 1:
        raise DataError(f"{path}: label {data.label!r} holds lists (a tag per word), which go with one data.text "
                        f"column of word lists, not {len(text_columns(data))}")
    words, tags = [], []
    for row, (row_words, row_tags) in enumerate(zip(frame[data.text], frame[data.label])):
        if not isinstance(row_words, (list, np.ndarray)) or not isinstance(row_tags, (list, np.ndarray)):
            raise DataError(f"{path}: row {row}: token classification needs a list of words in {data.text!r} and "
                            f"a list of tags in {data.label!r}, one per word; got {type(row_words).__name__} and "
                            f"{type(row_tags).__name__}")
        if len(row_words) != len(row_tags):
            raise DataError(f"{path}: row {row} has {len(row_words)} words in {data.text!r} but {len(row_tags)} "
                            f"tags in {data.label!r}; give one tag per word")
        words.append([str(word) for word in row_words])
        tags.append(list(row_tags))
    flat = [tag for row_tags in tags for tag in row_tags]
    classes = None
    if all(isinstance(tag, str) for tag in flat):
        classes = sorted(set(flat))
        ids = {name: i for i, name in enumerate(classes)}
        tags = [[ids[tag] for tag in row_tags] for row_tags in tags]
    elif not all(isinstance(tag, (int, np.integer)) and not isinstance(tag, bool) for tag in flat):
        kinds = sorted({type(tag).__name__ for tag in flat})
        raise DataError(f"{path}: column {data.label!r} has tags of type {', '.join(kinds)}; tags are all strings "
                        "(class names) or all integers (class ids)")
    features, labels = tokenizers.encode_words(tokenizer, words, tags, data.context, path)
    return features, labels, classes


def text_columns(data) -> list[str]:
    """`data.text` as a list: one column, or the two of a pair."""
    return [data.text] if isinstance(data.text, str) else list(data.text or [])


def _csv(path: Path):
    """(the table, whether its columns are typed): a CSV's types are pandas' guesses from text."""
    import pandas as pd

    try:
        return pd.read_csv(path), False
    except pd.errors.EmptyDataError:
        raise DataError(f"{path}: the file is empty") from None


def _parquet(path: Path):
    import pandas as pd

    return pd.read_parquet(path), True


def _jsonl(path: Path):
    """JSON Lines, one object per line (how most text data sets come): JSON's own
    types are kept (dtype=False: pandas guesses no dates or numbers from strings)."""
    import pandas as pd

    try:
        return pd.read_json(path, lines=True, dtype=False), True
    except (ValueError, TypeError) as error:
        raise DataError(f"{path}: not JSON Lines, one JSON object per line ({str(error).strip()[:200]})") from None


def _arrays(path: Path, features: list[str], label: str, available: list[str], get):
    """The feature arrays (numbers or bools) and the label array: numbers, bools, or
    strings, which `_tabular` turns into named classes as it does a CSV's."""
    names = [*features, label]
    missing = [n for n in names if n not in available]
    if missing:
        raise DataError(
            f"{path}: array(s) {', '.join(missing)} not found; the file has "
            f"{', '.join(available) or 'no arrays'} (set data.features and data.label)"
        )
    arrays = {n: np.asarray(get(n)) for n in names}
    for name, array in arrays.items():
        if name == label and _is_strings(array):
            arrays[name] = _label_strings(path, name, array)
            continue
        if not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
            expected = "numbers, bools or strings (class names)" if name == label else "numbers"
            raise DataError(f"{path}: array {name!r} has dtype {array.dtype}; expected {expected}")
        _check_float32_range(str(path), f"array {name!r}", array)
    return {n: arrays[n] for n in features}, arrays[label]


def _is_strings(array: np.ndarray) -> bool:
    """numpy's unicode or bytes strings, or h5py's variable-length strings (objects)."""
    return array.dtype.kind in "US" or (array.dtype == object and all(isinstance(v, (str, bytes)) for v in array.flat))


def _label_strings(path: Path, name: str, array: np.ndarray) -> np.ndarray:
    """A label of strings as the CSV path holds one: an object array of str, bytes
    (numpy's, h5py's) decoded as UTF-8."""
    if array.ndim != 1:
        raise DataError(f"{path}: label {name!r} is strings of shape {list(array.shape)}; a label of strings is one "
                        "class name per sample, of shape [samples]")
    try:
        return np.array([v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array], dtype=object)
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: label {name!r} holds bytes that are not UTF-8 text ({error})") from None


def _npz(path: Path, features: list[str], label: str):
    with np.load(path, allow_pickle=False) as npz:
        return _arrays(path, features, label, list(npz.files), npz.__getitem__)


def _hdf5(path: Path, features: list[str], label: str):
    import h5py

    with h5py.File(path, "r") as h5:
        available = []
        h5.visititems(lambda name, obj: available.append(name) if isinstance(obj, h5py.Dataset) else None)
        return _arrays(path, features, label, available, lambda n: h5[n][()])


def _class_names(label: np.ndarray, path: str, name: str) -> tuple[np.ndarray, list[str]]:
    """A label of strings (or bools) as class ids 0..K-1 of its sorted distinct values, and their names."""
    import pandas as pd

    missing = pd.isna(label)
    if missing.any():
        raise DataError(f"{path}: label {name!r} has {int(missing.sum())} missing value(s) (first at row "
                        f"{int(np.argmax(missing))}); drop or fill those rows")
    names, ids = np.unique(label.astype(str), return_inverse=True)
    return ids.astype(np.int64), names.tolist()


def _tabular(features: dict[str, np.ndarray], label: np.ndarray, data, path: str,
             classes: list[str] | None = None) -> Dataset:
    """`classes`: the names of a label already made class ids (word tags, `_word_tags`)."""
    n = len(label)
    for name, array in features.items():
        if len(array) != n:
            raise DataError(f"{path}: feature {name!r} has {len(array)} rows but label {data.label!r} has {n}")
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            row = int(np.argwhere(~np.isfinite(array.reshape(n, -1)).all(axis=1))[0][0])
            raise DataError(f"{path}: feature {name!r} has NaN or infinite values (first at row {row})")
    if np.issubdtype(label.dtype, np.floating) and not np.isfinite(label).all():
        bad = ~np.isfinite(label.reshape(n, -1)).all(axis=1)
        raise DataError(
            f"{path}: label {data.label!r} has {int(bad.sum())} NaN or infinite value(s) "
            f"(first at row {int(np.argmax(bad))}); drop or fill those rows"
        )
    task = data.task
    named = not (np.issubdtype(label.dtype, np.number) or label.dtype == bool)  # strings
    integral = np.issubdtype(label.dtype, np.integer) or label.dtype == bool
    if task == "auto":
        task = "classification" if integral or named else "regression"
    features = {k: v.astype(feature_dtype(v.dtype)) for k, v in features.items()}
    if task == "regression":
        if named:
            raise DataError(f"{path}: data.task is regression but label {data.label!r} is not numeric (e.g. "
                            f"{label[0]!r}); a label of strings is classes (data.task: classification or auto)")
        return Dataset(features, label.astype(np.float32), data.label, "regression")
    if classes is None and (named or label.dtype == bool):
        label, classes = _class_names(label, path, data.label)
    elif not integral and not np.array_equal(label, np.round(label)):
        raise DataError(f"{path}: data.task is classification but label {data.label!r} has fractional values")
    label = label.astype(np.int64)
    kept = label[label != IGNORE_INDEX]
    if kept.size and kept.min() < 0:
        raise DataError(f"{path}: label {data.label!r} has negative class {int(kept.min())}; classes are 0..K-1 "
                        f"({IGNORE_INDEX} marks a position the loss ignores)")
    _check_classes(path, data.label, kept, classes, n)
    num_classes = len(classes) if classes else int(kept.max()) + 1 if kept.size else 0
    return Dataset(features, label, data.label, "classification", num_classes, classes)

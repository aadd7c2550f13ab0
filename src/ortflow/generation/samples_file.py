"""export/samples.json (samples.py writes it, the report shows it) as a record: read here only,
every field checked (records.py); written as ortflow has always written it (indented by one, the
text as it is, not \\u escapes)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .. import records
from ..errors import MissingInputError, ModelError

REMEDY = "run the export_model rule again"


@dataclasses.dataclass(frozen=True)
class Sample:
    """An eval prompt, the eval data's next tokens, and the greedy continuations, as text."""

    prompt: str
    expected: str
    before: str  # of the starting weights (transformers' generate)
    after: str  # of export/generation/ in ONNX Runtime


@dataclasses.dataclass(frozen=True)
class Samples:
    max_new_tokens: int  # 0 where export.samples is 0
    greedy: bool
    samples: tuple[Sample, ...]


def read_samples(path: Path) -> Samples:
    """export/samples.json; MissingInputError when there is none, ModelError naming the file and the
    key when a field is missing or mistyped."""
    return records.read(Samples, path, ModelError, REMEDY,
                        MissingInputError(f"{path}: no generated samples (run the export_model rule first)"))


def write_samples_file(path: Path, samples: Samples) -> None:
    records.write(path, samples, indent=1, ensure_ascii=False)

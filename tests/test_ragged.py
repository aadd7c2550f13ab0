"""data/ragged.py: records kept unpadded in scratch files and read back padded, as write_split indexes them."""

from __future__ import annotations

import numpy as np
import pytest

from ortflow.data import ragged

CONTEXT = 6
TOKENS = [[5, 6, 7], [], [8, 9, 10, 11, 12, 13], [14]]  # a record of no token, and one filling the context


@pytest.fixture
def records(tmp_path):
    stored = ragged.Ragged(tmp_path, 2, CONTEXT)
    for tokens in TOKENS:
        stored.append(np.array(tokens), -np.array(tokens))
    stored.end()
    return stored


def padded(fill, field):
    return np.array([tokens + [fill(i) for i in range(CONTEXT - len(tokens))] for tokens in
                     ([[v * field for v in t] for t in TOKENS])], dtype=np.int64)


def test_fields_come_back_padded_in_the_order_asked(records):
    rows = np.array([3, 0, 2, 1, 0])  # unsorted, with a repeat
    ids, labels = ragged.Padded(records, 0, 99), ragged.Padded(records, 1, -100)
    assert ids.shape == (4, CONTEXT) and ids.dtype == np.int64 and len(ids) == 4
    np.testing.assert_array_equal(ids[rows], padded(lambda i: 99, 1)[rows])
    np.testing.assert_array_equal(labels[rows], padded(lambda i: -100, -1)[rows])


def test_mask_and_positions_of_the_padding(records):
    mask = ragged.Padded(records, None, 0)[np.arange(4)]
    np.testing.assert_array_equal(mask.sum(axis=1), [len(t) for t in TOKENS])
    positions = ragged.Padded(records, 0, None)[np.array([0, 1])]  # the padding's positions count from 0
    np.testing.assert_array_equal(positions, [[5, 6, 7, 0, 1, 2], [0, 1, 2, 3, 4, 5]])


def test_reads_in_blocks_whatever_the_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(ragged, "READ_RECORDS", 3)
    rng = np.random.default_rng(0)
    stored, rows = ragged.Ragged(tmp_path, 1, CONTEXT), []
    for _ in range(20):
        tokens = rng.integers(0, 1000, rng.integers(0, CONTEXT + 1))
        stored.append(tokens)
        rows.append(np.pad(tokens, (0, CONTEXT - len(tokens)), constant_values=-1))
    stored.end()
    chosen = rng.permutation(20)[:13]
    np.testing.assert_array_equal(ragged.Padded(stored, 0, -1)[chosen], np.array(rows)[chosen])
    assert ragged.Padded(stored, 0, -1)[np.zeros(0, np.int64)].shape == (0, CONTEXT)


def test_indexing_other_than_by_record_numbers_is_refused(records):
    with pytest.raises(TypeError, match="an array of record numbers"):
        ragged.Padded(records, 0, 0)[np.array([[0]])]

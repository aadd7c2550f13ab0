"""Atomic writes: a file or folder is replaced only when its writer finishes; a failed
writer leaves the old one and no temporary."""

from __future__ import annotations

import pytest

from ortflow import atomic


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    atomic.write_text(path, "old\n")
    with pytest.raises(RuntimeError):
        with atomic.file(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("the writer fails")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    with atomic.file(path) as tmp:
        assert tmp == tmp_path / "out.json.tmp"
        tmp.write_text("new\n")
    assert path.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_an_atomic_folder_replaces_the_old_one_only_when_complete(tmp_path):
    out = tmp_path / "split"
    with atomic.folder(out) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic.folder(out) as tmp:
            assert tmp == tmp_path / "split.tmp" and list(tmp.iterdir()) == []
            (tmp / "b").write_text("2")
            raise RuntimeError("the writer fails")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["split"]
    assert sorted(p.name for p in out.iterdir()) == ["a"]
    (tmp_path / "split.tmp").mkdir()  # left by a crash
    (tmp_path / "split.tmp" / "stale").write_text("x")
    with atomic.folder(out) as tmp:
        (tmp / "c").write_text("3")
    assert sorted(p.name for p in out.iterdir()) == ["c"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["split"]

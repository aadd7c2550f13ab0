"""The tokenizer's and the weights' files (user_files.py): no links, no special
files, tokenizer files within their cap, and only the files the loader reads hashed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import opened_paths, outside
from ortflow import config as config_mod
from ortflow import user_files
from ortflow.data import tokenizer
from ortflow.errors import DataError, ModelError
from ortflow.models import weights


@pytest.fixture
def folder(tmp_path) -> Path:
    """A save_pretrained-like tokenizer folder beside a model's files."""
    folder = tmp_path / "pretrained"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def one_line(error) -> str:
    message = str(error.value)
    assert len(message.splitlines()) == 1
    return message


def test_a_tokenizer_folder_lists_only_its_tokenizer_files(folder):
    assert user_files.tokenizer_files(str(folder)) == [folder / "tokenizer.json", folder / "tokenizer_config.json"]
    before = user_files.content("data.tokenizer", str(folder))
    (folder / "model.safetensors").write_bytes(b"other weights")  # not read by the tokenizer's loader
    assert user_files.content("data.tokenizer", str(folder)) == before
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    assert user_files.content("data.tokenizer", str(folder)) != before


def test_a_linked_tokenizer_folder_is_refused_without_reading_it(tmp_path):
    outside_folder = tmp_path / "outside"
    outside_folder.mkdir()
    (outside_folder / "tokenizer.json").write_text("{}")
    link = tmp_path / "tokdir"
    link.symlink_to(outside_folder)
    expected = f"data.tokenizer: {link} is a symbolic link to {outside_folder}; what it reads must be a regular file"
    with opened_paths() as paths:
        for check in (lambda: user_files.tokenizer_files(str(link)), lambda: tokenizer.load(str(link)),
                      lambda: config_mod.by_content({"tokenizer": str(link)})):
            with pytest.raises(DataError) as error:
                check()
            assert one_line(error).startswith(expected)
    assert [p for p in paths if p.startswith(str(outside_folder))] == []


@pytest.mark.parametrize("kind", ["link to /etc/passwd", "fifo"])
def test_a_tokenizer_folder_holds_no_link_or_special_file(folder, kind):
    file = folder / "tokenizer.json"
    file.unlink()
    if kind == "fifo":
        os.mkfifo(file)  # reading it would wait forever
        reason = "is not a regular file"
    else:
        file.symlink_to("/etc/passwd")
        reason = "is a symbolic link to /etc/passwd"
    with opened_paths() as paths:
        with pytest.raises(DataError) as error:
            tokenizer.load(str(folder))
    assert one_line(error).startswith(f"data.tokenizer: {file} {reason}; ")
    assert outside(paths, folder) == []


def test_a_link_anywhere_in_a_tokenizer_folder_is_refused(folder):
    (folder / "notes.txt").symlink_to("/etc/shadow")  # a name transformers might yet read
    with pytest.raises(DataError) as error:
        user_files.tokenizer_files(str(folder))
    assert one_line(error).startswith(f"data.tokenizer: {folder / 'notes.txt'} is a symbolic link to /etc/shadow; ")


def test_a_tokenizer_file_over_the_cap_is_refused_before_it_is_read(tmp_path, monkeypatch):
    file = tmp_path / "tokenizer.json"
    file.write_text("{" + " " * 2000 + "}")
    monkeypatch.setattr(user_files, "TOKENIZER_MAX_BYTES", 1000)
    with opened_paths() as paths:
        with pytest.raises(DataError) as error:
            tokenizer.load(str(file))
    assert one_line(error) == (f"data.tokenizer: {file} is 2,002 bytes, more than the cap of 1,000 bytes for a "
                               "tokenizer file; a tokenizer this large would take many times its size in memory")
    assert str(file) not in paths


def test_an_unlistable_tokenizer_folder_is_one_line(folder, monkeypatch):
    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(user_files.os, "scandir", denied)  # as for a user without read permission
    with pytest.raises(DataError) as error:
        user_files.tokenizer_files(str(folder))
    assert one_line(error) == f"data.tokenizer: cannot list the folder {folder} (Permission denied)"


@pytest.mark.parametrize("where", ["file", "checkpoint folder"])
def test_linked_weights_are_refused_saying_where_they_point(tmp_path, where):
    if where == "file":
        link = tmp_path / "model.safetensors"
        link.symlink_to("/etc/passwd")
    else:
        (tmp_path / "checkpoint").mkdir()
        link = tmp_path / "checkpoint" / "checkpoint"
        link.symlink_to("/etc/passwd")
    path = str(tmp_path / ("model.safetensors" if where == "file" else "checkpoint"))
    with opened_paths() as paths:
        for check in (lambda: weights.read(path), lambda: config_mod.by_content({"weights": path})):
            with pytest.raises(ModelError) as error:
                check()
            assert one_line(error).startswith(f"model.weights: {link} is a symbolic link to /etc/passwd; ")
    assert "/etc/passwd" not in paths


def test_a_weights_folder_counts_by_the_files_read_from_it(tmp_path):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "checkpoint").write_bytes(b"state")
    (folder / "meta.json").write_text("{}")
    assert user_files.weights_files(str(folder)) == [folder / "checkpoint"]
    before = config_mod.by_content({"weights": str(folder)})["weights"]
    (folder / "meta.json").write_text('{"step": 2}')
    assert config_mod.by_content({"weights": str(folder)})["weights"] == before
    (folder / "checkpoint.data").write_bytes(b"tensors")  # read with the checkpoint: counts
    assert config_mod.by_content({"weights": str(folder)})["weights"] != before


def test_a_file_replaced_by_a_link_after_its_check_is_not_read(tmp_path, monkeypatch):
    """Hashing opens without following links, whatever was checked before."""
    file = tmp_path / "model.safetensors"
    file.symlink_to("/etc/passwd")
    monkeypatch.setattr(user_files, "weights_files", lambda path: [Path(path)])
    monkeypatch.setitem(user_files.FILES, "model.weights", user_files.weights_files)
    with opened_paths() as paths:
        with pytest.raises(ModelError) as error:
            user_files.content("model.weights", str(file))
    assert one_line(error).startswith(f"model.weights: {file} is a symbolic link to /etc/passwd; ")
    assert "/etc/passwd" not in paths

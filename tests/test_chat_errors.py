"""Issue 42's bad inputs of chats, through `snakemake prepare_data` as a user meets them: the job fails with
one line of ortflow's in its log (the file, the row, what to do; no traceback) and leaves no shard, manifest
or scratch file behind. tests/test_chats.py checks each message's wording on prepare() itself; this checks
that the line reaches the user through Snakemake and that the failed job writes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_snakemake
from test_chats import CHAT, write_jsonl
from text_models import CHAT_TEMPLATE, chat_tokenizer

ERROR = "ortflow prepare-data: error: "


def chats(rows: list):
    return lambda workdir: write_jsonl(workdir / "chats.jsonl", rows).name


def arrow_folder(workdir: Path) -> str:
    (workdir / "arrows").mkdir()
    (workdir / "arrows/data-00000-of-00001.arrow").write_bytes(b"")
    return "arrows"


# case -> (writes the source into the workdir and returns data.source, more data keys, the line's text)
BAD = {
    "row-without-the-columns": (chats([{"messages": CHAT}, {"text": "hi"}]), {},
                                "chats.jsonl: row 1 has no column 'messages' (it has text)"),
    "messages-not-role-content": (chats([{"messages": CHAT}, {"messages": [{"role": "user"}]}]), {},
                                  "chats.jsonl: row 1: column 'messages' is not a list of messages "
                                  "{\"role\": ..., \"content\": ...} with text contents (got [{'role': 'user'}])"),
    "assistant-empty-after-truncation": (chats([{"messages": CHAT[:3]}]), {"context": 6},
                                         "chats.jsonl: row 0: its assistant turns (or completion) are empty after "
                                         "truncation to data.context=6 tokens; raise data.context, or set "
                                         "data.too_long: drop"),
    "arrow-folder-not-datasets": (arrow_folder, {},
                                  "data.source: arrows is a directory, not a file (it holds Arrow files), nor a "
                                  "folder written by datasets' save_to_disk: it has neither dataset_dict.json nor "
                                  "dataset_info.json and state.json"),
    "template-fails-to-render": (chats([{"messages": CHAT}] * 3 + [{"messages": CHAT[1:]}]),
                                 {"chat_template": "{% if messages[0]['role'] != 'system' %}{{ raise_exception("
                                                   "'a system turn first') }}{% endif %}" + CHAT_TEMPLATE},
                                 "chats.jsonl: row 3: the chat template fails to render it "
                                 "(TemplateError: a system turn first)"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", BAD)
def test_a_bad_chat_source_fails_prepare_data_in_one_line_writing_nothing(case, workdir):
    write, data, line = BAD[case]
    workdir.mkdir(parents=True)
    chat_tokenizer(workdir / "tokenizer")
    config = {"run": {"name": "chats"}, "data": {"source": write(workdir), "tokenizer": "tokenizer", "context": 24,
                                                 "format": "messages", **data}}
    result = run_snakemake(workdir, config, "prepare_data", check=False)
    assert (workdir / "logs/chats/prepare_data.log").is_file(), result.stderr[-3000:]
    log = (workdir / "logs/chats/prepare_data.log").read_text()
    assert result.returncode != 0 and "Traceback" not in log
    assert [text for text in log.splitlines() if "error" in text.lower()] == [ERROR + line]
    assert not [path for path in (workdir / "results").rglob("*") if path.is_file()]

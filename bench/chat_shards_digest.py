"""The sha256 of every file prepare_data writes for chats and prompt-completion rows, in several configs.

A change to how chats are encoded or written must leave the shards as they were: run this before and
after it and compare the outputs (`diff`). On `--rows` of bench_chats.py's chats (and prompt-completion
rows made of their first exchange: texts, and lists of messages), with its ChatML tokenizer:

    python bench/chat_shards_digest.py --rows 3000 > before.txt   # ... change ..., then > after.txt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import tempfile
from pathlib import Path

from bench_chats import TEMPLATE, write_chats, write_tokenizer  # this script's folder is on sys.path

UNMARKED = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# name -> (rows, data keys): packing, truncation, dropping, the loss on all tokens, a template without
# {% generation %} (the assistant's tokens found by rendering the turns before them), prompt-completion.
CONFIGS = {
    "none": ("chats", {}),
    "separate": ("chats", {"packing": "separate"}),
    "cross": ("chats", {"packing": "cross"}),
    "truncated": ("chats", {"context": 128}),
    "dropped": ("chats", {"context": 128, "too_long": "drop"}),
    "loss-all": ("chats", {"loss_on": "all"}),
    "unmarked": ("chats", {"chat_template": UNMARKED}),
    "pairs": ("pairs", {}),
    "conversational-pairs": ("conversational", {}),
}


def write_pairs(chats: Path, texts: Path, conversational: Path) -> None:
    with open(chats, encoding="utf-8") as rows, open(texts, "w") as plain, open(conversational, "w") as turns:
        for line in rows:
            messages = [m for m in json.loads(line)["messages"] if m["role"] != "system"]
            plain.write(json.dumps({"prompt": messages[0]["content"], "completion": messages[1]["content"]}) + "\n")
            turns.write(json.dumps({"prompt": messages[:1], "completion": messages[1:2]}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=3000, help="chat rows")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    from ortflow import config as config_mod
    from ortflow.stages.prepare_data import prepare

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        files = {"chats": tmp / "chats.jsonl", "pairs": tmp / "pairs.jsonl", "conversational": tmp / "turns.jsonl"}
        write_chats(files["chats"], args.rows)
        write_pairs(files["chats"], files["pairs"], files["conversational"])
        write_tokenizer(files["chats"], tmp / "tokenizer", 4000)
        for name, (rows, keys) in CONFIGS.items():
            data = {"source": str(files[rows]), "tokenizer": str(tmp / "tokenizer"), "context": 512} | keys
            out = tmp / name
            prepare(config_mod.load(overrides={"data": data}), out / "train", out / "eval")
            for file in sorted(out.rglob("*")):
                if file.is_file():
                    text = file.read_bytes()
                    if file.name == "manifest.json":  # the source's path is a temporary folder's
                        text = text.replace(str(tmp).encode(), b"TMP")
                    print(name, file.relative_to(out), hashlib.sha256(text).hexdigest(), flush=True)


if __name__ == "__main__":
    main()

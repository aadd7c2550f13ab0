"""prepare_data on chat rows against `datasets.map` with `apply_chat_template` and the same tokenizer.

Writes `--rows` chats as a .jsonl (a system turn in half of them, one to three user/assistant exchanges,
words drawn with the frequencies they have in Python's own documentation: about 500 bytes a row), a
byte-level BPE tokenizer trained on their first 4 MB, saved as a transformers folder with a ChatML
template whose assistant turns are marked with {% generation %} (so both ways get the assistant mask
from the same call), then runs, each in a process of its own (its peak RSS is its own):

- ortflow: `prepare()` of the prepare_data stage, shards written (data.context `--context`);
- packed: the same with data.packing: separate (fewer records: less padding written);
- datasets: `load_dataset("json")` and `Dataset.map(batched=True)` calling the folder's tokenizer's
  `apply_chat_template(tokenize=True, return_assistant_tokens_mask=True)`, its cache in a temporary
  folder: the rows tokenized as Arrow columns, nothing padded, no shard written.

Both must find the same tokens and the same tokens in the loss. Rounds alternate the ways (the machine
may be shared). Seconds, CPU seconds (the process's, all its threads: less noisy than seconds on a shared
machine) and peak RSS (the process's maximum resident memory, ru_maxrss, imports included) are the way's
until its output is written; the tokens are counted after that.

    python bench/bench_chats.py --rows 100000 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_quantize import cpu_model  # the CPU's name from /proc/cpuinfo (this script's folder is on sys.path)
from bench_tokenize import child_result

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
            "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>"
            "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_chats(path: Path, rows: int, seed: int = 0) -> None:
    import pydoc_data.topics

    words, counts = np.unique(" ".join(pydoc_data.topics.topics.values()).split(), return_counts=True)
    rng = np.random.default_rng(seed)

    def text(low: int, high: int) -> str:
        return " ".join(rng.choice(words, rng.integers(low, high), p=counts / counts.sum()))

    with open(path, "w", encoding="utf-8") as f:
        for _ in range(rows):
            messages = [{"role": "system", "content": text(3, 8)}] if rng.random() < 0.5 else []
            for _ in range(rng.integers(1, 4)):
                messages += [{"role": "user", "content": text(4, 20)}, {"role": "assistant", "content": text(5, 24)}]
            f.write(json.dumps({"messages": messages}) + "\n")


def write_tokenizer(chats: Path, folder: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with open(chats, encoding="utf-8") as f:
        backend.train_from_iterator(f.read(4 * 10**6).splitlines(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(folder))


def with_ortflow(chats: Path, folder: Path, scratch: Path, context: int, finished, packing: str = "none") -> dict:
    from ortflow import config as config_mod
    from ortflow.data.shards import ShardReader
    from ortflow.stages.prepare_data import prepare

    config = config_mod.load(overrides={"data": {"source": str(chats), "tokenizer": str(folder), "context": context,
                                                 "too_long": "drop", "packing": packing}})
    prepare(config, scratch / "data/train", scratch / "data/eval")
    finished()
    tokens = 0
    for split in ("train", "eval"):
        reader = ShardReader(scratch / "data" / split)
        examples = reader.manifest.source["examples"]  # of both splits
        for start in range(0, len(reader), 4096):
            batch = reader.gather(np.arange(start, min(start + 4096, len(reader))))
            tokens += int(batch["attention_mask"].sum())
    return {"examples": examples["examples"], "dropped": examples["dropped"], "tokens": tokens,
            "loss_tokens": examples["loss_tokens"]}


def with_datasets(chats: Path, folder: Path, scratch: Path, context: int, finished) -> dict:
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    rows = datasets.load_dataset("json", data_files=str(chats), split="train", cache_dir=str(scratch))

    def encode(batch):
        out = tokenizer.apply_chat_template(batch["messages"], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}

    encoded = rows.map(encode, batched=True, remove_columns=["messages"])
    finished()
    tokens = loss = examples = dropped = 0
    for batch in encoded.iter(batch_size=4096):  # counted as prepare_data counts (data.too_long: drop)
        for ids, mask in zip(batch["input_ids"], batch["assistant_masks"]):
            if len(ids) > context:
                dropped += 1
                continue
            examples, tokens, loss = examples + 1, tokens + len(ids), loss + sum(mask[1:])
    return {"examples": examples, "dropped": dropped, "tokens": tokens, "loss_tokens": loss}


WAYS = {"ortflow": with_ortflow, "datasets": with_datasets,
        "packed": lambda *args: with_ortflow(*args, packing="separate")}


def measure(way: str, chats: Path, folder: Path, scratch: Path, context: int) -> dict:
    """Run in a child process: time one way up to the end of its work (`finished`: the shards or the Arrow
    cache written), its peak RSS until then, and what it found (counted after: the ways read their output
    back differently, ortflow mapping its shards)."""
    started, stage = time.perf_counter(), {}

    def finished() -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        stage.update(seconds=time.perf_counter() - started, cpu_seconds=usage.ru_utime + usage.ru_stime,
                     peak_rss_mb=usage.ru_maxrss / 1024)

    return WAYS[way](chats, folder, scratch, context, finished) | stage


def run_child(way: str, chats: Path, folder: Path, scratch: Path, context: int) -> dict:
    command = [sys.executable, __file__, "--child", way, "--chats", str(chats), "--tokenizer", str(folder),
               "--scratch", str(scratch), "--context", str(context)]
    return child_result(command)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="chat rows")
    parser.add_argument("--vocab", type=int, default=16000, help="BPE vocabulary")
    parser.add_argument("--context", type=int, default=512, help="data.context")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each running every way, in alternating order")
    parser.add_argument("--ways", default="ortflow,datasets,packed", help="comma-separated: " + ", ".join(WAYS))
    parser.add_argument("--dir", default=None, help="where to write the rows (default: a temporary folder)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--chats", help="rows written before (with the tokenizer folder --tokenizer): not written again")
    parser.add_argument("--tokenizer", help="the tokenizer folder of --chats")
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, Path(args.chats), Path(args.tokenizer), Path(args.scratch),
                                 args.context)))
        return

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        chats, folder = Path(tmp) / "chats.jsonl", Path(tmp) / "tokenizer"
        if args.chats:
            chats, folder = Path(args.chats), Path(args.tokenizer)
            with open(chats, "rb") as rows:
                args.rows = sum(1 for _ in rows)
        else:
            write_chats(chats, args.rows)
            write_tokenizer(chats, folder, args.vocab)
        print(f"machine: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
              f"RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS', 'unset')}")
        print(f"chats: {args.rows:,} rows, {chats.stat().st_size / 1e6:.1f} MB of jsonl, data.context {args.context}")
        print(f"{'round':5} {'way':9} {'seconds':>8} {'CPU s':>8} {'rows/s':>8} {'examples':>9} {'tokens':>11} {'loss tokens':>11} "
              f"{'peak RSS MB':>12}")
        ways = args.ways.split(",")
        for round_ in range(args.rounds):
            for way in ways if round_ % 2 == 0 else ways[::-1]:
                scratch = Path(tmp) / f"scratch-{way}-{round_}"
                scratch.mkdir()
                result = run_child(way, chats, folder, scratch, args.context)
                if "error" in result:
                    print(f"{round_:5} {way:9} failed: {result['error']}")
                    continue
                print(f"{round_:5} {way:9} {result['seconds']:8.1f} {result['cpu_seconds']:8.1f} "
                      f"{args.rows / result['seconds']:8,.0f} "
                      f"{result['examples']:9,} {result['tokens']:11,} {result['loss_tokens']:11,} "
                      f"{result['peak_rss_mb']:12,.0f}", flush=True)


if __name__ == "__main__":
    main()

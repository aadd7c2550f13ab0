"""How fast prepare_data tokenizes a language model's text, against the same tokenizer run by hand.

Writes a text of `--megabytes` (words drawn with the frequencies they have in
Python's own documentation, in paragraphs of 20 to 200 words separated by blank
lines: documents of varied length from a natural vocabulary), trains a byte-level
BPE tokenizer of `--vocab` tokens with <|endoftext|> on its first 4 MB, then
encodes the whole text, documents split at blank lines and each followed by
<|endoftext|>, in three ways, each in a process of its own (its peak RSS is its own):

- ortflow: what prepare_data runs (`ortflow.data.tokenizer.language_model_tokens`):
  the file read in pieces, documents batch-encoded by `encode_batch_fast` on the
  library's threads, ids written to a scratch file and mapped back;
- loop: a plain Python loop, `tokenizer.encode(document).ids` per document of the
  text read whole, the ids gathered in a list, then one int64 array;
- datasets: `datasets.load_dataset("text", sample_by="paragraph")` (which splits
  documents the same way) and `Dataset.map(batched=True)` calling the same
  tokenizer's `encode_batch`, its cache in a temporary folder.

Every way must give the same number of tokens (and the same first million ids).
Peak RSS is the process's maximum resident memory (ru_maxrss), imports included.

    python bench/bench_tokenize.py --megabytes 100
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_quantize import cpu_model  # the CPU's name from /proc/cpuinfo (this script's folder is on sys.path)

EOS = "<|endoftext|>"
CHECKED_IDS = 1_000_000


def write_text(path: Path, megabytes: int, seed: int = 0) -> None:
    """Paragraphs of words sampled with pydoc's word frequencies, until `megabytes` are written."""
    import pydoc_data.topics

    words, counts = np.unique(" ".join(pydoc_data.topics.topics.values()).split(), return_counts=True)
    rng = np.random.default_rng(seed)
    target, written = megabytes * 10**6, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            lengths = rng.integers(20, 201, 1000)
            drawn = iter(rng.choice(words, lengths.sum(), p=counts / counts.sum()))
            block = "\n\n".join(" ".join(next(drawn) for _ in range(n)) for n in lengths) + "\n\n"
            written += f.write(block)


def train_tokenizer(text: Path, out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with open(text, encoding="utf-8") as f:
        tokenizer.train_from_iterator(f.read(4 * 10**6).split("\n\n"), trainer)
    tokenizer.save(str(out))


def with_ortflow(text: Path, tokenizer_file: Path, scratch: Path) -> np.ndarray:
    from ortflow.data import tokenizer as tokenizers

    return tokenizers.language_model_tokens(tokenizers.load(str(tokenizer_file)), None, text, scratch)


def with_loop(text: Path, tokenizer_file: Path, scratch: Path) -> np.ndarray:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for document in text.read_text(encoding="utf-8").split("\n\n"):
        if document:
            ids.extend(tokenizer.encode(document, add_special_tokens=False).ids)
            ids.append(eos)
    return np.array(ids, dtype=np.int64)


def with_datasets(text: Path, tokenizer_file: Path, scratch: Path) -> np.ndarray:
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eos = tokenizer.token_to_id(EOS)
    documents = datasets.load_dataset("text", data_files=str(text), sample_by="paragraph", split="train",
                                      cache_dir=str(scratch))

    def encode(batch):
        return {"ids": [e.ids + [eos] for e in tokenizer.encode_batch(batch["text"], add_special_tokens=False)]}

    encoded = documents.map(encode, batched=True, remove_columns=["text"])
    # The ids as one int64 array, read from the Arrow column without a Python list.
    column = encoded.data.column("ids").combine_chunks()
    return column.values.to_numpy().astype(np.int64)


WAYS = {"ortflow": with_ortflow, "loop": with_loop, "datasets": with_datasets}


def measure(way: str, text: Path, tokenizer_file: Path, scratch: Path) -> dict:
    """Run in a child process: time one way, and report its tokens and peak RSS."""
    started = time.perf_counter()
    ids = WAYS[way](text, tokenizer_file, scratch)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "tokens": int(len(ids)), "head": ids[:CHECKED_IDS].tolist(),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_child(way: str, text: Path, tokenizer_file: Path, scratch: Path) -> dict:
    command = [sys.executable, __file__, "--child", way, "--text", str(text), "--tokenizer", str(tokenizer_file),
               "--scratch", str(scratch)]
    return child_result(command)


def child_result(command: list[str]) -> dict:
    """Run one way in a process of its own: the JSON of its last output line, or its error's last line."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=100, help="size of the text")
    parser.add_argument("--vocab", type=int, default=16000, help="BPE vocabulary")
    parser.add_argument("--ways", default="ortflow,loop,datasets", help="comma-separated: " + ", ".join(WAYS))
    parser.add_argument("--dir", default=None, help="where to write the text (default: a temporary folder)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--text", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, Path(args.text), Path(args.tokenizer), Path(args.scratch))))
        return

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        text, tokenizer_file = Path(tmp) / "text.txt", Path(tmp) / "tokenizer.json"
        write_text(text, args.megabytes)
        train_tokenizer(text, tokenizer_file, args.vocab)
        size = text.stat().st_size
        print(f"machine: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
              f"RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS', 'unset')}")
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(tokenizer_file)).get_vocab_size()
        print(f"text: {size / 1e6:.1f} MB, BPE vocabulary {vocab} (--vocab {args.vocab}: as many merges as the "
              "first 4 MB allow)")
        print(f"{'way':9} {'seconds':>8} {'tokens':>12} {'tokens/s':>11} {'MB/s':>6} {'peak RSS MB':>12}")
        reference = None
        for way in args.ways.split(","):
            scratch = Path(tmp) / f"scratch-{way}"
            scratch.mkdir()
            result = run_child(way, text, tokenizer_file, scratch)
            if "error" in result:
                print(f"{way:9} failed: {result['error']}")
                continue
            reference = reference or result
            same = result["tokens"] == reference["tokens"] and result["head"] == reference["head"]
            print(f"{way:9} {result['seconds']:8.1f} {result['tokens']:12,} {result['tokens'] / result['seconds']:11,.0f} "
                  f"{size / 1e6 / result['seconds']:6.1f} {result['peak_rss_mb']:12,.0f}"
                  + ("" if same else "  (tokens differ from the first way's!)"))


if __name__ == "__main__":
    main()

"""int4's MatMulNBits accuracy level 0 (fp32 activations) against 4 (int8 activations,
onnxruntime-genai's model builder's CPU default): what each costs in perplexity on trained models,
and what each gains in greedy tokens/s at batch 1 and 8 (export.int4.accuracy_level's default).

For each `--run` (a finished run's folder, results/<run>: its export/generation/ and its eval
shards), the generation folder is quantized with the export's other int4 defaults at both levels
(quantization.int4.quantize_folder) and the three decoders (fp32, int4 level 0, int4 level 4) are
measured as the quantize stage measures them (quantization.int4_measure.perplexity) on the first
`--records` eval windows. With `--gpt2`, GPT-2 124M with random weights (bench_generate.py's) is
added for speed alone (its perplexity means nothing). Tokens/s: greedy generation of `--new-tokens`
from a prompt of `--prompt` tokens a row (the first eval window's, or random ids), prompt step
included, on one ONNX Runtime thread, every decoder in one process, the rounds alternating the
decoders after a warm-up; medians of `--rounds`.

    python bench/bench_int4_level.py --run results/text --run results/fine_tuning [--gpt2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
LEVELS = (0, 4)


def quantized(fp32: Path, root: Path) -> dict[str, Path]:
    from ortflow.quantization.int4 import Int4, quantize_folder

    folders = {"fp32": fp32}
    for level in LEVELS:
        folders[f"int4 level {level}"] = root / f"int4-{level}"
        quantize_folder(fp32, folders[f"int4 level {level}"], Int4(accuracy_level=level))
    return folders


def gpt2_folder(root: Path) -> Path:
    """GPT-2 124M, random weights, as bench_generate.py builds it: a save_pretrained folder, then its
    generation folder."""
    import torch
    import transformers
    from bench_generate import CONFIGS

    from ortflow.generation.folder import byte_tokenizer, export_folder

    torch.manual_seed(0)
    source = root / "transformers"
    transformers.AutoModelForCausalLM.from_config(CONFIGS["gpt2"](), attn_implementation="sdpa").save_pretrained(source)
    byte_tokenizer().save_pretrained(source)
    export_folder(source, root / "fp32")
    return root / "fp32"


def speeds(folders: dict[str, Path], prompt: list[int], batches: list[int], new_tokens: int,
           rounds: int) -> dict[tuple[str, int], list[float]]:
    """{(decoder, batch): tokens/s of each round}, the decoders alternated within each round."""
    from ortflow.generation.generate import Decoder, generate

    decoders = {name: Decoder(folder, threads=1) for name, folder in folders.items()}
    found: dict[tuple[str, int], list[float]] = {}
    for batch in batches:
        rows = [prompt] * batch
        for decoder in decoders.values():
            generate(decoder, rows, 2)  # warm-up
        for _ in range(rounds):
            for name, decoder in decoders.items():
                started = time.perf_counter()
                tokens = sum(len(row) for row in generate(decoder, rows, new_tokens))
                found.setdefault((name, batch), []).append(tokens / (time.perf_counter() - started))
    return found


def perplexities(folders: dict[str, Path], eval_dir: Path, records: int) -> dict[str, float]:
    from ortflow.data.shards import ShardReader
    from ortflow.generation.generate import Decoder
    from ortflow.models.hugging_face import TEXT_WINDOWS
    from ortflow.quantization.int4_measure import perplexity

    reader = ShardReader(eval_dir, raw=True)
    batch = reader.gather(np.arange(min(records, len(reader))))
    return {name: perplexity(Decoder(folder, threads=1), batch[TEXT_WINDOWS], batch[reader.label_name])[0]
            for name, folder in folders.items()}


def table(title: str, measured: dict, perplexity: dict[str, float] | None) -> None:
    print(f"\n{title}\n")
    print("| decoder | batch | tokens/s | x int4 level 0 | rounds | perplexity |")
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    for (name, batch), values in measured.items():
        peer = statistics.median(measured[("int4 level 0", batch)])
        shown = f"{perplexity[name]:.4f}" if perplexity else "-"
        print(f"| {name} | {batch} | {statistics.median(values):.1f} | {statistics.median(values) / peer:.2f} | "
              f"{', '.join(f'{value:.1f}' for value in values)} | {shown} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, action="append", default=[], help="a finished run's folder")
    parser.add_argument("--gpt2", action="store_true", help="GPT-2 124M, random weights, for speed")
    parser.add_argument("--records", type=int, default=64, help="eval windows scored")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from ortflow.data.shards import ShardReader
    from ortflow.generation.generate import Decoder
    from ortflow.models.hugging_face import TEXT_WINDOWS

    with tempfile.TemporaryDirectory() as scratch:
        for number, run in enumerate(args.run):
            folders = quantized(run / "export/generation", Path(scratch) / str(number))
            prompt = ShardReader(run / "data/eval", raw=True).gather(np.arange(1))[TEXT_WINDOWS][0][:args.prompt]
            new_tokens = min(args.new_tokens, Decoder(folders["fp32"]).context_length - args.prompt)
            table(f"{run} ({args.records} eval windows scored, {new_tokens} new tokens)",
                  speeds(folders, prompt.tolist(), args.batches, new_tokens, args.rounds),
                  perplexities(folders, run / "data/eval", args.records))
        if args.gpt2:
            folders = quantized(gpt2_folder(Path(scratch) / "gpt2"), Path(scratch) / "gpt2")
            prompt = np.random.default_rng(0).integers(1, 50257, args.prompt).tolist()
            table(f"GPT-2 124M, random weights ({args.new_tokens} new tokens)",
                  speeds(folders, prompt, args.batches, args.new_tokens, args.rounds), None)


if __name__ == "__main__":
    main()

"""Greedy generation's tokens/s and peak memory: ortflow's decoder against torch, a full re-run per
token and onnxruntime-genai's model builder (issue 41's "Performance").

Two models with random weights (tokens/s does not depend on their values): a Llama of SmolLM-135M's
shape and GPT-2 124M (GPT2Config's defaults), saved as export/transformers/ is. Each is generated
from greedily, `--new-tokens` after a prompt of `--prompt` random ids per row (no padding), at each
batch of `--batches` and thread count of `--threads`, by:

- `torch`: transformers' `generate(do_sample=False)` on the save_pretrained folder (sdpa), the peer
  every ratio is against;
- `rerun`: the whole prefix through the fp32 decoder with an empty past for each token (what
  export/model.onnx, which has no cache, costs), ONNX Runtime 1.19.2;
- `ortflow fp32|int4 <version>`: ortflow's generation folder (generation.folder.export_folder) and its
  int4 (quantization.int4.quantize_folder: block 32, symmetric, accuracy level 0; `int4 acc4`:
  accuracy level 4, the model builder's CPU default and the export's since bench_int4_level.py), run by
  generation.generate in ONNX Runtime 1.19.2 (this environment) and in onnxruntime >= 1.31;
- `ortflow traced fp32|int4 acc4 <version>` (Llama only): the same, the decoder traced from
  transformers' forward as the export did before generation/written.py (which a Llama-structured
  family now gets), ONNX Runtime 1.19.2: the before of that change;
- `builder fp32|int4` (Llama only): `python -m onnxruntime_genai.models.builder` on the same
  save_pretrained folder, run by onnxruntime-genai's Generator.

ortflow's contenders run as `ortflow generate` does, with glibc's hugetlb tunable
(src/ortflow/hugepages.py: weights on transparent huge pages where the kernel gives them on
request); `ortflow fp32 small pages <version>` without it; `torch huge pages` and `builder ...
huge pages` are the peers with it, which their users would have to set themselves.

The newer runtimes live in a virtual environment of tests/test_serving_venv.py's cache folder
(`genai-builder-venv`: its genai packages plus torch and transformers, which the builder imports),
created once. Every measurement is a process of its own, so its peak RSS (the process's, imports
and model included) is its own; it generates a few tokens first (warm-up), then the timed run.
Tokens/s counts every generated token of every row over the whole call, prompt included. Rounds
alternate the contenders; the table gives medians and the ratio to torch's median.

    python bench/bench_generate.py [--rounds 3] [--models llama gpt2] [--batches 1 8] [--threads 1 2]
        [--only 'torch' 'ortflow (traced )?fp32 .*' ...]  (the contenders' names to run, regular expressions)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import re
import tempfile
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the serving test's environments, shared with it

WARM_UP_TOKENS = 4
# Re-running the whole prefix for each token costs O(new_tokens^2): at these batches, in one round.
RERUN_BATCHES = (1,)


def smollm_config():
    """SmolLM-135M's config.json (HuggingFaceTB/SmolLM-135M) as a LlamaConfig."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=0,
                       eos_token_id=0, hidden_act="silu")


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config()


CONFIGS = {"llama": smollm_config, "gpt2": gpt2_config}


def build(model: str, root: Path, needed: set[str], builder_python: Path | None) -> dict[str, Path]:
    """The model's folders that `needed` names (contenders' "folder"): save_pretrained ("transformers",
    always), ortflow's generation folders ("fp32", "int4", "int4 acc4", "traced ...") and the model
    builder's ("builder fp32", "builder int4")."""
    import torch
    import transformers

    from ortflow.generation import written
    from ortflow.generation.folder import byte_tokenizer, export_folder
    from ortflow.quantization.int4 import Int4, quantize_folder, weight_bytes

    torch.manual_seed(0)
    source = root / "transformers"
    transformers.AutoModelForCausalLM.from_config(CONFIGS[model](), attn_implementation="sdpa").save_pretrained(source)
    byte_tokenizer().save_pretrained(source)  # the model builder saves the model's tokenizer beside it
    folders = {"transformers": source}
    for prefix in ("", "traced "):
        if not needed & {f"{prefix}fp32", f"{prefix}int4", f"{prefix}int4 acc4"}:
            continue
        fp32 = folders[f"{prefix}fp32"] = root / f"{prefix}fp32".replace(" ", "-")
        with mock.patch.object(written, "writable", return_value=False) if prefix else contextlib.nullcontext():
            export_folder(source, fp32)  # traced: the export before written.py
        for name, level in (("int4", 0), ("int4 acc4", 4)):
            if f"{prefix}{name}" in needed:
                folders[f"{prefix}{name}"] = root / f"{prefix}{name}".replace(" ", "-")
                quantize_folder(fp32, folders[f"{prefix}{name}"], Int4(accuracy_level=level))
    for name in ("fp32", "int4"):
        if name in folders:
            print(f"{model} ortflow {name}: MatMul weights {weight_bytes(folders[name] / 'model.onnx') / 2**20:.1f} "
                  "MiB", flush=True)
    for precision in ("fp32", "int4"):
        if f"builder {precision}" in needed:
            folders[f"builder {precision}"] = root / f"builder-{precision}"
            subprocess.run([str(builder_python), "-m", "onnxruntime_genai.models.builder", "-i", str(source),
                            "-o", str(root / f"builder-{precision}"), "-p", precision, "-e", "cpu",
                            "-c", str(root / "builder-cache")], check=True, capture_output=True)
    return folders


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    import numpy as np

    return np.random.default_rng(0).integers(1, vocab, (batch, length)).tolist()


def timed(run) -> float:
    """Seconds of one call of `run`, after a warm-up call."""
    import time

    run(WARM_UP_TOKENS)
    start = time.perf_counter()
    run(None)
    return time.perf_counter() - start


def loaded(job: dict):
    """The contender `job` names, loaded: a function of (prompts, new tokens) that generates."""
    import numpy as np

    kind, folder, threads = job["kind"], job["folder"], job["threads"]
    if kind == "torch":
        import torch
        import transformers

        torch.set_num_threads(threads)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()

        def run(ids, new_tokens):
            tensor = torch.tensor(ids)
            with torch.no_grad():
                model.generate(input_ids=tensor, attention_mask=torch.ones_like(tensor), do_sample=False,
                               max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        return run
    if kind in ("ortflow", "rerun"):
        from ortflow.generation.generate import Decoder, generate

        # prepacked False: ONNX Runtime multiplies by the weights as stored, not by its packed copy
        decoder = Decoder(folder, threads=threads, prepacked=job.get("prepacked", True))
        decoder.eos = set()  # random weights may choose an end-of-sequence token: every run is new_tokens long

        def rerun(ids, new_tokens):  # the whole prefix, no past, for each token
            sequence = np.array(ids, np.int64)
            for _ in range(new_tokens):
                positions = np.arange(sequence.shape[1])[None].repeat(len(sequence), 0)
                logits, _ = decoder.run(sequence, np.ones_like(sequence), positions, decoder.empty_cache(len(ids)))
                sequence = np.concatenate([sequence, logits[:, -1].argmax(-1)[:, None]], 1)
        return rerun if kind == "rerun" else lambda ids, new_tokens: generate(decoder, ids, new_tokens)
    import onnxruntime_genai as og

    config = og.Config(folder)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)

    def run(ids, new_tokens):
        length = len(ids[0]) + new_tokens
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=length, min_length=length, batch_size=len(ids))
        generator = og.Generator(model, params)
        generator.append_tokens(np.array(ids, np.int32))  # [batch, prompt]
        while not generator.is_done():
            generator.generate_next_token()
    return run


def peak_rss_mib() -> float:
    """This process's peak RSS: VmHWM, its memory's own high-water mark. Not getrusage's ru_maxrss,
    which keeps the forking parent's (measured: every worker gave the parent's 2540 MiB)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def worker(job: dict) -> None:
    """Loads the contender, then for each request line on stdin ({"prompts", "new_tokens"}) prints
    {"seconds", "rss_mib"}: the timed generation and the process's peak RSS so far."""
    run = loaded(job)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        seconds = timed(lambda tokens: run(request["prompts"], tokens or request["new_tokens"]))
        print(json.dumps({"seconds": seconds, "rss_mib": peak_rss_mib()}), flush=True)


def environment(job: dict) -> dict[str, str]:
    """The contender's process environment: ortflow's source, and the hugetlb tunable where the job asks."""
    from ortflow import hugepages

    environ = {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"}
    return dict(hugepages.with_hugepages(environ) if job.get("hugepages") else environ, PYTHONPATH=str(REPO / "src"))


class Worker:
    """A contender's process (`python` running this file's worker), which keeps its model loaded
    between requests."""

    def __init__(self, python: Path, job: dict):
        self.name = job["contender"]
        self.process = subprocess.Popen([str(python), __file__, "--worker", json.dumps(job)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True,
                                        env=environment(job))
        self.answer()

    def answer(self) -> str:
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name} failed (its error is above)")
        return line

    def measure(self, prompts: list[list[int]], new_tokens: int) -> dict:
        self.process.stdin.write(json.dumps({"prompts": prompts, "new_tokens": new_tokens}) + "\n")
        self.process.stdin.flush()
        return json.loads(self.answer())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def contenders(model: str, serving: Path, serving_version: str) -> dict[str, tuple[Path, dict]]:
    """{name: (python, job)} of every contender of the model; a job's "folder" names build()'s folder and
    "hugepages" says whether its process starts with glibc's hugetlb tunable (hugepages.py): ortflow's
    as `ortflow generate` runs, the peers without it as users run them, and again with it."""
    import onnxruntime
    import transformers

    from ortflow.generation import written

    here, version = Path(sys.executable), onnxruntime.__version__
    found = {"torch": (here, {"kind": "torch", "folder": "transformers"}),
             "torch huge pages": (here, {"kind": "torch", "folder": "transformers", "hugepages": True}),
             f"rerun {version}": (here, {"kind": "rerun", "folder": "fp32"})}
    for python, runtime in ((here, version), (serving, serving_version)):
        for precision in ("fp32", "int4", "int4 acc4"):
            found[f"ortflow {precision} {runtime}"] = (python, {"kind": "ortflow", "folder": precision,
                                                                "hugepages": True})
        found[f"ortflow fp32 unpacked {runtime}"] = (python, {"kind": "ortflow", "folder": "fp32", "prepacked": False,
                                                              "hugepages": True})
        found[f"ortflow fp32 small pages {runtime}"] = (python, {"kind": "ortflow", "folder": "fp32"})
    if written.writable(transformers.AutoModelForCausalLM.from_config(CONFIGS[model]())):
        for precision in ("traced fp32", "traced int4 acc4"):
            found[f"ortflow {precision} {version}"] = (here, {"kind": "ortflow", "folder": precision,
                                                              "hugepages": True})
    if model == "llama":  # the model builder's own export, of the Llama shape
        for precision in ("fp32", "int4"):
            found[f"builder {precision}"] = (serving, {"kind": "genai", "folder": f"builder {precision}"})
            found[f"builder {precision} huge pages"] = (serving, {"kind": "genai", "folder": f"builder {precision}",
                                                                  "hugepages": True})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="+", choices=sorted(CONFIGS), default=["llama", "gpt2"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, os.cpu_count()])
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--only", nargs="+", default=[".*"],
                        help="the contenders to run, regular expressions of their names (torch always runs)")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return

    from conftest import environment
    from test_serving_venv import GENAI

    serving = environment("genai-builder-venv", [*GENAI, "torch==2.13.0", "transformers", "onnx", "onnx-ir"])
    version = subprocess.run([str(serving), "-c", "import onnxruntime as o, onnxruntime_genai as g; "
                              "print(o.__version__, g.__version__)"], capture_output=True, text=True, check=True)
    serving_version, genai_version = version.stdout.split()
    print(f"serving environment: onnxruntime {serving_version}, onnxruntime-genai {genai_version}", flush=True)
    from ortflow import hugepages

    print(f"transparent huge pages: {hugepages.THP_MODE.read_text().strip()}; the hugetlb tunable changes "
          f"anything here: {hugepages.wanted({})}", flush=True)
    print("model | batch | threads | contender | tokens/s | x torch | peak RSS MiB | rounds' tokens/s")
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as scratch:
        for model in args.models:
            chosen = {name: (python, job) for name, (python, job) in contenders(model, serving, serving_version).items()
                      if name == "torch" or any(re.fullmatch(pattern, name) for pattern in args.only)}
            folders = build(model, Path(scratch) / model, {job["folder"] for _, job in chosen.values()}, serving)
            vocab = CONFIGS[model]().vocab_size
            for threads in args.threads:
                # one process per contender for every batch: its model is loaded once; batches rise,
                # so each batch's peak RSS is the process's peak when it ends
                workers = {name: Worker(python, dict(job, contender=name, threads=threads,
                                                     folder=str(folders[job["folder"]])))
                           for name, (python, job) in chosen.items()}
                for batch in args.batches:
                    rates: dict[str, list[float]] = {name: [] for name in workers}
                    memory: dict[str, float] = {}
                    for round in range(args.rounds):
                        for name, worker_process in workers.items():
                            if name.startswith("rerun") and (round or batch not in RERUN_BATCHES):
                                continue
                            found = worker_process.measure(prompts(batch, args.prompt, vocab), args.new_tokens)
                            rates[name].append(batch * args.new_tokens / found["seconds"])
                            memory[name] = found["rss_mib"]
                    torch_rate = statistics.median(rates["torch"])
                    for name in workers:
                        if rates[name]:
                            rate = statistics.median(rates[name])
                            print(f"{model} | {batch} | {threads} | {name} | {rate:.1f} | {rate / torch_rate:.2f} | "
                                  f"{memory[name]:.0f} | {', '.join(f'{r:.1f}' for r in rates[name])}", flush=True)
                for worker_process in workers.values():
                    worker_process.close()


if __name__ == "__main__":
    main()

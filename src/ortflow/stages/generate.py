"""`ortflow generate`: text from an exported generation folder (generation/folder.py), streamed.
A sequence-to-sequence model's folder (generation/seq2seq_export.py) takes the prompt as its source.

The folder's tokenizer.json (the tokenizers library's file; a byte-level one for a model trained
on bytes) turns each prompt into ids and the generated ids back into text; the decoder runs in
ONNX Runtime (generation/generate.py). Each prompt's continuation is printed as its tokens come,
then a newline; with a file of prompts (one a line), the prompts run one after another. With
`--out`, each prompt and its continuation are also a line of a JSON Lines file, written when all
are done. The workflow's `generate` rule gives the prompts as the config's `generate` section.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from .. import atomic, hugepages
from ..errors import DataError, ModelError

# The config keys this stage reads, which the workflow's generate rule passes (stages/__init__.py):
# its prompts and how many tokens to add; the model is the folder it is given.
KEYS = ("generate",)
HELP = "generate text from an exported decoder folder (export/generation), streaming the tokens"
MAX_NEW_TOKENS = 64
log = logging.getLogger("ortflow.generate")
REPLACEMENT = "\ufffd"  # what decoding gives for the first bytes of a character whose last bytes are to come


def add_arguments(parser) -> None:
    from ..config import add_config_arguments

    parser.add_argument("folder", type=Path, help="the generation folder, e.g. results/<run>/export/generation")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="the text to continue")
    prompt.add_argument("--prompts", type=Path, help="a text file of prompts, one a line (empty lines skipped)")
    # Without --prompt and --prompts, the config's generate section (what the workflow's rule passes).
    add_config_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, help=f"tokens to generate at most (default {MAX_NEW_TOKENS}, or "
                        "as many as the model's positions leave after the prompt)")
    parser.add_argument("--out", type=Path, help="also write each prompt and its continuation as a line of this "
                                                 "JSON Lines file")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of the most likely token (greedy)")
    # Without them, the model's generation_config's values (genai_config.json's search), as generate takes them.
    parser.add_argument("--temperature", type=float, help="with --do-sample (default: the model's)")
    parser.add_argument("--top-k", type=int, help="with --do-sample: the k most likely tokens (default: the model's)")
    parser.add_argument("--top-p", type=float, help="with --do-sample: nucleus mass (default: the model's)")
    parser.add_argument("--seed", type=int, help="with --do-sample: the random generator's seed")
    parser.add_argument("--threads", type=int, help="ONNX Runtime's intra-op threads (default: one a core)")


def from_config(args) -> None:
    """Without --prompt and --prompts, the config's generate section fills them and --max-new-tokens."""
    from ..config import load_config

    if args.prompt is not None or args.prompts is not None:
        return
    section = load_config(args).generate
    if section.prompt is None and section.prompts is None:
        raise DataError("generate: no prompt: give --prompt or --prompts (in the workflow: snakemake generate "
                        "--config generate='{prompt: your text}', or generate='{prompts: a file, one a line}')")
    args.prompt, args.prompts = section.prompt, section.prompts and Path(section.prompts)
    if args.max_new_tokens is None:
        args.max_new_tokens = section.max_new_tokens


def read_prompts(args) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    try:
        lines = args.prompts.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"--prompts {args.prompts}: cannot be read as UTF-8 text ({error})") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise DataError(f"--prompts {args.prompts}: no prompt in it (one a line)")
    return prompts


def load_tokenizer(folder: Path):
    from tokenizers import Tokenizer

    from ..generation import TOKENIZER

    if not (folder / TOKENIZER).is_file():
        raise ModelError(f"{folder}: no {TOKENIZER}, so prompts cannot be turned into token ids "
                         "(ortflow's export writes one beside the decoder)")
    return Tokenizer.from_file(str(folder / TOKENIZER))


def stream(tokenizer, write, ids: list[int], shown: str, last: bool = False) -> str:
    """Write the text of `ids` beyond what is `shown` (a byte-level tokenizer's text only grows at its
    end), except, until the `last` call, a character still missing bytes; returns what is shown now."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if text.endswith(REPLACEMENT) and not last:
        return shown
    write(text[len(shown):])
    return text


def run(args) -> int:
    from ..generation.generate import Decoder, Sampling, generate
    from ..generation import is_seq2seq
    from ..generation.seq2seq import Seq2SeqDecoder

    from_config(args)
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise DataError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    prompts = read_prompts(args)
    tokenizer = load_tokenizer(args.folder)
    decoder = (Seq2SeqDecoder if is_seq2seq(args.folder) else Decoder)(args.folder, args.threads)
    log.info("decoder loaded: %s", hugepages.on_hugepages())
    given = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    sampling = Sampling(args.do_sample, seed=args.seed,
                        **{key: decoder.search[key] if value is None else value for key, value in given.items()})
    out = sys.stdout

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    generated = []
    for prompt in prompts:
        ids, shown = [], ""

        def on_step(step) -> None:
            nonlocal shown
            token = int(step.tokens[0])
            if token not in decoder.eos:
                ids.append(token)
                shown = stream(tokenizer, write, ids, shown)

        encoded = tokenizer.encode(prompt).ids
        # A model of few positions (the README's has 64) still continues a short prompt by default;
        # a prompt that leaves none is refused by generate in one line. T5's positions have no limit.
        room = decoder.room(len(encoded))
        new_tokens = args.max_new_tokens or max(1, MAX_NEW_TOKENS if room is None else min(MAX_NEW_TOKENS, room))
        generate(decoder, [encoded], new_tokens, sampling, on_step)
        generated.append({"prompt": prompt, "text": stream(tokenizer, write, ids, shown, last=True)})
        write("\n")
    if args.out:
        atomic.write_text(args.out, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in generated))
    return 0

"""Generation on a generation folder (folder.py) in ONNX Runtime, as transformers' `generate` does it.

Numpy and an InferenceSession only, so that it runs where the model is served (ONNX Runtime 1.19.2
here). The prompts of a batch are padded on the left, as transformers pads a decoder's, with an
attention mask of 0 there; position ids are the mask's cumulative sum less one (1 under the padding:
transformers' `prepare_inputs_for_generation`), so each row's tokens sit at the positions they have
alone. The prompt is one step with an empty past; each further step feeds the last token and the
cache the previous step returned. A row that gave an end-of-sequence token is finished: it is fed
the padding token after, as transformers does, until every row is finished or max_new_tokens are
generated. Sampling warps the logits as transformers' default processors do, in their order:
temperature, top-k, top-p.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..errors import DataError, ModelError
from ..sessions import inference_session
from . import GENAI_CONFIG


@dataclass(frozen=True)
class Sampling:
    """transformers' generate arguments for the choice of each token; do_sample=False is greedy."""
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    seed: int | None = None


@dataclass(frozen=True)
class Step:
    """One generated token per row, with the logits it was chosen from (before any warping)."""
    tokens: np.ndarray  # [batch] int64; the padding token for a finished row
    logits: np.ndarray  # [batch, vocab]


def read_genai_config(folder: Path) -> dict:
    """The generation `folder`'s genai_config.json, refused in one line where it has none."""
    folder = Path(folder)
    if not (folder / GENAI_CONFIG).is_file():
        raise ModelError(f"{folder}: no {GENAI_CONFIG}; not a generation folder (ortflow's export writes one)")
    return json.loads((folder / GENAI_CONFIG).read_text())


def special_tokens(config: dict) -> tuple[int, set[int]]:
    """(the padding token, the end-of-sequence tokens) of genai_config.json's `model` section."""
    eos = config["eos_token_id"]
    return (config["pad_token_id"] if config["pad_token_id"] is not None else 0,
            set(eos if isinstance(eos, list) else [] if eos is None else [eos]))


class Decoder:
    """A generation folder's decoder in an ONNX Runtime session, with what genai_config.json says of it."""

    def __init__(self, folder: Path, threads: int | None = None, prepacked: bool = True):
        """`prepacked=False`: the weights held once (sessions.inference_session), for the export's checks
        and samples; serving keeps ONNX Runtime's packing."""
        whole = read_genai_config(folder)
        config = whole["model"]
        self.search = whole["search"]  # the model's generation_config's sampling defaults
        decoder = config["decoder"]
        self.layers, self.kv_heads, self.head_dim = (decoder["num_hidden_layers"], decoder["num_key_value_heads"],
                                                     decoder["head_size"])
        self.context_length = config["context_length"]
        self.pad, self.eos = special_tokens(config)
        self.session = inference_session(Path(folder) / decoder["filename"], threads, prepacked=prepacked)
        self.inputs = {value.name for value in self.session.get_inputs()}
        self.outputs = [value.name for value in self.session.get_outputs()]

    def empty_cache(self, batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, self.kv_heads, 0, self.head_dim), np.float32)] * (2 * self.layers)

    def run(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray,
            cache: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """One step: the logits [batch, sequence, vocab] and the cache that includes `ids`."""
        feed = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        feed |= {f"past_key_values.{i // 2}.{'value' if i % 2 else 'key'}": tensor for i, tensor in enumerate(cache)}
        logits, *presents = self.session.run(self.outputs, {name: feed[name] for name in self.inputs})
        return logits, presents

    def room(self, prompt_length: int) -> int:
        """The most new tokens the model's positions leave after a prompt of `prompt_length` tokens."""
        return self.context_length - prompt_length

    def steps(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling()) -> Iterator[Step]:
        return steps(self, prompts, max_new_tokens, sampling)


def left_padded(prompts: list[list[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompts as ids and an attention mask [batch, longest], padded on the left."""
    longest = max(len(prompt) for prompt in prompts)
    ids = np.full((len(prompts), longest), pad, np.int64)
    mask = np.zeros((len(prompts), longest), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = prompt
        mask[row, longest - len(prompt):] = 1
    return ids, mask


def check_lengths(decoder: Decoder, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Refuse, in one line, what the decoder cannot take: an empty prompt, more positions than it has."""
    if not prompts or any(len(prompt) == 0 for prompt in prompts):
        raise DataError("generate: every prompt must have at least one token")
    longest = max(len(prompt) for prompt in prompts)
    if longest >= decoder.context_length:
        raise DataError(f"generate: a prompt of {longest} tokens leaves no room for a new token in the model's "
                        f"{decoder.context_length} positions; shorten it to at most {decoder.context_length - 1}")
    if longest + max_new_tokens > decoder.context_length:
        raise DataError(f"generate: a prompt of {longest} tokens and max_new_tokens={max_new_tokens} need "
                        f"{longest + max_new_tokens} positions; the model has {decoder.context_length}: shorten the "
                        f"prompt or ask for at most {decoder.context_length - longest} new tokens")


def warp(logits: np.ndarray, sampling: Sampling) -> np.ndarray:
    """The logits [batch, vocab] as transformers' default sampling processors leave them, in their
    order: divided by the temperature, then -inf outside the top k and outside the top p."""
    scores = logits.astype(np.float64) / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:  # the k largest stay, and whatever ties the k-th
        kth = np.sort(scores, -1)[:, -sampling.top_k][:, None]
        scores = np.where(scores < kth, -np.inf, scores)
    if sampling.top_p < 1.0:  # the least likely tokens whose total probability is at most 1 - top_p go
        order = np.argsort(scores, -1, kind="stable")
        ascending = np.take_along_axis(scores, order, -1)
        probabilities = np.exp(ascending - ascending.max(-1, keepdims=True))
        cumulative = np.cumsum(probabilities / probabilities.sum(-1, keepdims=True), -1)
        removed = cumulative <= 1 - sampling.top_p
        removed[:, -1] = False  # the most likely token always stays
        np.put_along_axis(scores, order, np.where(removed, -np.inf, ascending), -1)
    return scores


def choose(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> np.ndarray:
    """The next token of each row from its logits [batch, vocab]: the most likely (greedy), or drawn
    from the softmax of the warped logits."""
    if not sampling.do_sample:
        return logits.argmax(-1)
    scores = warp(logits, sampling)
    probabilities = np.exp(scores - scores.max(-1, keepdims=True))
    probabilities /= probabilities.sum(-1, keepdims=True)
    return np.array([rng.choice(len(row), p=row) for row in probabilities], np.int64)


def steps(decoder: Decoder, prompts: list[list[int]], max_new_tokens: int,
          sampling: Sampling = Sampling()) -> Iterator[Step]:
    """Each step's tokens for the batch of `prompts` (token ids), as they are generated: at most
    max_new_tokens steps, fewer when every row has given an end-of-sequence token."""
    check_lengths(decoder, prompts, max_new_tokens)
    rng = np.random.default_rng(sampling.seed)
    ids, mask = left_padded(prompts, decoder.pad)
    positions = np.where(mask == 1, mask.cumsum(-1) - 1, 1)
    cache = decoder.empty_cache(len(prompts))
    finished = np.zeros(len(prompts), bool)
    for _ in range(max_new_tokens):
        logits, cache = decoder.run(ids, mask, positions, cache)
        last = logits[:, -1, :]
        tokens = np.where(finished, decoder.pad, choose(last, sampling, rng))
        yield Step(tokens, last)
        finished |= np.isin(tokens, list(decoder.eos))
        if finished.all():
            return
        ids, positions = tokens[:, None], positions[:, -1:] + 1
        mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], -1)


def generate(decoder, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(),
             on_step: Callable[[Step], None] | None = None) -> list[list[int]]:
    """The tokens generated for each prompt, up to and including its end-of-sequence token, by `decoder`
    (a Decoder, or seq2seq.Seq2SeqDecoder: anything with `steps` and `eos`); `on_step` is given each
    step as it comes (streaming)."""
    generated: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for step in decoder.steps(prompts, max_new_tokens, sampling):
        if on_step:
            on_step(step)
        for row, token in enumerate(step.tokens.tolist()):
            if not done[row]:
                generated[row].append(token)
                done[row] = token in decoder.eos
    return generated

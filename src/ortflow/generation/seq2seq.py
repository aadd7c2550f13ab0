"""Generation on a sequence-to-sequence generation folder (seq2seq_export.py) in ONNX Runtime, as
transformers' `generate` does it for an encoder-decoder model, and its check against that `generate`.

Numpy and InferenceSessions only, as generate.py. The sources of a batch are padded on the right,
as ortflow's data and the families' tokenizers pad them, with an attention mask of 0 there; the
encoder runs once. The target starts with the model's `decoder_start_token_id`; the first step runs
decoder_model.onnx on it, which returns the cross-attention's keys and values too, and each further
step feeds the last token to decoder_with_past_model.onnx with the self-attention's cache of the
step before and those cross-attention keys, as optimum's ORTModelForSeq2SeqLM does. A finished row
(one that gave an end-of-sequence token) is fed the padding token, as transformers does. The
generation config's `forced_bos_token_id` (the first token) and `forced_eos_token_id` (the last of
max_new_tokens: BART's config has one) are applied as transformers' processors apply them; sampling
warps the logits as generate.py does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import DataError, ModelError
from ..sessions import inference_session
from . import DECODER, DECODER_WITH_PAST, ENCODER
from .check import Agreement, GenerationCheck, compare_generation, greedy_generate
from .generate import Sampling, Step, choose

# transformers' sampling defaults, for a generation_config.json that leaves one out (genai_config's search: folder.py)
SEARCH = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


def token_set(value) -> set[int]:
    return set(value if isinstance(value, list) else [] if value is None else [value])


class Seq2SeqDecoder:
    """A sequence-to-sequence generation folder's three sessions, with what its config.json and
    generation_config.json say of the tokens."""

    def __init__(self, folder: Path, threads: int | None = None, prepacked: bool = True):
        """`prepacked`: as generate.Decoder's."""
        folder = Path(folder)
        missing = [name for name in (ENCODER, DECODER, DECODER_WITH_PAST, "config.json", "generation_config.json")
                   if not (folder / name).is_file()]
        if missing:
            raise ModelError(f"{folder}: no {', '.join(missing)}; not a sequence-to-sequence generation folder "
                             "(ortflow's export writes one)")
        config = json.loads((folder / "config.json").read_text())
        generation = json.loads((folder / "generation_config.json").read_text())

        def setting(key: str):
            return generation[key] if generation.get(key) is not None else config.get(key)

        self.start = setting("decoder_start_token_id")
        if self.start is None:
            raise ModelError(f"{folder}: neither config.json nor generation_config.json gives decoder_start_token_id, "
                             "the target's first token")
        self.eos = token_set(setting("eos_token_id"))
        self.pad = setting("pad_token_id") if setting("pad_token_id") is not None else 0
        self.forced_bos, self.forced_eos = setting("forced_bos_token_id"), token_set(setting("forced_eos_token_id"))
        # BART's positions (max_position_embeddings); T5's relative positions have no limit.
        self.context_length = config.get("max_position_embeddings")
        self.search = {key: generation.get(key) if generation.get(key) is not None else default
                       for key, default in SEARCH.items()}
        self.encoder, self.decoder, self.decoder_with_past = (
            inference_session(folder / name, threads, prepacked=prepacked)
            for name in (ENCODER, DECODER, DECODER_WITH_PAST))

    def room(self, source_length: int) -> int | None:
        """The most new tokens the decoder's positions leave (the target's, after its start token)."""
        return None if self.context_length is None else self.context_length - 1

    def check_lengths(self, sources: list[list[int]], max_new_tokens: int) -> None:
        if not sources or any(len(source) == 0 for source in sources):
            raise DataError("generate: every prompt must have at least one token")
        longest = max(len(source) for source in sources)
        if self.context_length is not None and longest > self.context_length:
            raise DataError(f"generate: a prompt of {longest} tokens is longer than the encoder's "
                            f"{self.context_length} positions; shorten it")
        if self.context_length is not None and max_new_tokens > self.room(longest):
            raise DataError(f"generate: max_new_tokens={max_new_tokens} and the target's start token need "
                            f"{max_new_tokens + 1} positions; the decoder has {self.context_length}: ask for at most "
                            f"{self.room(longest)}")

    def steps(self, sources: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling()) -> Iterator[Step]:
        """Each step's tokens for the batch of `sources` (token ids): at most max_new_tokens steps, fewer
        when every row has given an end-of-sequence token."""
        self.check_lengths(sources, max_new_tokens)
        rng = np.random.default_rng(sampling.seed)
        source, mask = right_padded(sources, self.pad)
        (states,) = self.encoder.run(["last_hidden_state"], {"input_ids": source, "attention_mask": mask})
        feed = {"encoder_attention_mask": mask, "encoder_hidden_states": states,
                "input_ids": np.full((len(sources), 1), self.start, np.int64)}
        logits, past = self.run(self.decoder, feed)
        finished = np.zeros(len(sources), bool)
        for step in range(max_new_tokens):
            last = logits[:, -1, :]
            tokens = np.where(finished, self.pad, choose(last + self.forced(step, max_new_tokens, last), sampling, rng))
            yield Step(tokens, last)
            finished |= np.isin(tokens, list(self.eos))
            if finished.all() or step == max_new_tokens - 1:
                return
            # The cross-attention's keys and values of the first step stay; the self-attention's grow.
            logits, grown = self.run(self.decoder_with_past, feed | past | {"input_ids": tokens[:, None]})
            past |= grown

    @staticmethod
    def run(session, feed: dict) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The step's logits and its presents under the names of the past they become."""
        names = [value.name for value in session.get_outputs()]
        feed = {value.name: feed[value.name] for value in session.get_inputs()}
        logits, *presents = session.run(names, feed)
        return logits, {name.replace("present.", "past_key_values.", 1): tensor
                        for name, tensor in zip(names[1:], presents)}

    def forced(self, step: int, max_new_tokens: int, logits: np.ndarray) -> np.ndarray | float:
        """transformers' forced-token processors: every score but the forced tokens' -inf, for the first
        token (forced_bos_token_id) and the last of max_new_tokens (forced_eos_token_id); else 0."""
        forced = {self.forced_bos} - {None} if step == 0 else self.forced_eos if step == max_new_tokens - 1 else set()
        if not forced:
            return 0.0
        scores = np.full(logits.shape[-1], -np.inf, logits.dtype)
        scores[sorted(forced)] = 0
        return scores


def right_padded(sources: list[list[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    """The sources as ids and an attention mask [batch, longest], padded on the right."""
    longest = max(len(source) for source in sources)
    ids = np.full((len(sources), longest), pad, np.int64)
    mask = np.zeros((len(sources), longest), np.int64)
    for row, source in enumerate(sources):
        ids[row, :len(source)] = source
        mask[row, :len(source)] = 1
    return ids, mask


def transformers_greedy(model, decoder: Seq2SeqDecoder, sources: list[list[int]],
                        max_new_tokens: int) -> tuple[list[list[int]], np.ndarray]:
    """transformers' greedy tokens for the batch of sources, padded as the decoder pads them, without
    the start token and cut after each row's end-of-sequence token, and each step's logits."""
    source, mask = right_padded(sources, decoder.pad)
    return greedy_generate(model, source, mask, 1, decoder.pad, decoder.eos, max_new_tokens)


def check_seq2seq(model, folder: Path, check: GenerationCheck) -> Agreement:
    """Greedy generation on the sequence-to-sequence `folder` against transformers' on `model` (the torch
    model it was exported from) for `check`'s sources: refused in one line where a token differs or a
    step's logits differ by more than the tolerance (check.compare_generation)."""
    decoder = Seq2SeqDecoder(folder, prepacked=False)
    return compare_generation(decoder, check, transformers_greedy(model, decoder, check.prompts,
                                                                  check.max_new_tokens))

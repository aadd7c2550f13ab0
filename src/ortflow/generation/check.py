"""The generation folder's decoder checked against transformers' `generate` on the same model.

What the export promises (issue 41): greedy tokens from the ONNX decoder in ONNX Runtime equal to
`generate(do_sample=False)` on export/transformers/ token for token, and each step's logits within
the export check's tolerance. The export stage runs it on eval prompts before it renames the folder
into place, as it reads export/transformers/ back before it renames that (models/save_trained.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ModelError
from .generate import Decoder, generate, left_padded


@dataclass(frozen=True)
class GenerationCheck:
    """What to compare: greedy generation of max_new_tokens for the batch of `prompts` (token ids), each
    step's logits within `relative` x transformers' largest |logit| + `absolute` (the export's tolerance)."""
    prompts: list[list[int]]
    max_new_tokens: int
    relative: float
    absolute: float


# generate(do_sample=False) still applies what a model's generation_config.json asks beyond greedy
# search: beams (bart-large-cnn's 4), repetition penalties (many chat models' 1.05 or more), n-gram
# bans and minimum lengths. ortflow's generator runs the graph's greedy steps, as genai_config.json's
# search section says (folder.py), so the check turns those off and compares like with like.
PLAIN_GREEDY = {"do_sample": False, "num_beams": 1, "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0,
                "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "min_length": 0,
                "min_new_tokens": None, "bad_words_ids": None, "sequence_bias": None, "suppress_tokens": None,
                "begin_suppress_tokens": None, "exponential_decay_length_penalty": None}


@dataclass(frozen=True)
class Agreement:
    steps: int  # the greedy steps compared
    largest_error: float  # the largest |difference| of a step's logits over the largest |logit| of transformers'


def transformers_greedy(model, pad: int, eos: set[int], prompts: list[list[int]],
                        max_new_tokens: int) -> tuple[list[list[int]], np.ndarray]:
    """transformers' greedy tokens for the batch, padded on the left with `pad` as the decoder pads it
    and cut after each row's end-of-sequence token (one of `eos`, the decoder's: generate.special_tokens),
    and each step's logits [steps, batch, vocab]."""
    ids, mask = left_padded(prompts, pad)
    return greedy_generate(model, ids, mask, ids.shape[1], pad, eos, max_new_tokens)


def greedy_generate(model, ids: np.ndarray, mask: np.ndarray, first: int, pad: int, eos: set[int],
                    max_new_tokens: int) -> tuple[list[list[int]], np.ndarray]:
    """transformers' plain greedy generation from the padded batch `ids` and its `mask`: each row's
    tokens from position `first` of the output sequences (after the prompt; after a seq2seq
    decoder's start token), cut after its end-of-sequence token, and each step's logits."""
    import torch

    with torch.no_grad():
        out = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), **PLAIN_GREEDY,
                             max_new_tokens=max_new_tokens, eos_token_id=sorted(eos) or None,
                             pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
    tokens = []
    for row in out.sequences[:, first:].tolist():
        end = next((at for at, token in enumerate(row) if token in eos), len(row) - 1)
        tokens.append(row[:end + 1])
    return tokens, torch.stack(out.logits).numpy()


def check_generation(model, decoder: Decoder, check: GenerationCheck) -> Agreement:
    """Greedy generation on `decoder` against transformers' on `model` (the torch causal LM the decoder
    was exported from), as `check` asks (compare_generation)."""
    return compare_generation(decoder, check, transformers_greedy(model, decoder.pad, decoder.eos, check.prompts,
                                                                  check.max_new_tokens))


def compare_generation(decoder: Decoder, check: GenerationCheck,
                       expected: tuple[list[list[int]], np.ndarray]) -> Agreement:
    """Greedy generation on `decoder` against transformers' `expected` tokens and logits (transformers_greedy's,
    for `check`; computed first, so that the torch model can be let go before the decoder's session
    opens): refused in one line where a token differs or a step's logits differ by more than the tolerance."""
    expected, expected_logits = expected
    logits = []
    got = generate(decoder, check.prompts, check.max_new_tokens, on_step=lambda step: logits.append(step.logits))
    return compare(got, logits, expected, expected_logits, check)


def compare(got: list[list[int]], logits: list[np.ndarray], expected: list[list[int]], expected_logits: np.ndarray,
            check: GenerationCheck) -> Agreement:
    """Generated tokens and each step's logits [batch, vocab] against transformers' (its greedy tokens
    and logits [steps, batch, vocab]): refused in one line where a token differs or a step's logits
    differ by more than the check's tolerance."""
    for row, (ours, theirs) in enumerate(zip(got, expected)):
        if ours != theirs:
            step = next((at for at, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise ModelError(f"generation check: prompt {row}'s greedy tokens part from transformers' generate at "
                             f"step {step} ({ours[step:step + 3]}... against {theirs[step:step + 3]}...)")
    errors = []
    for step, (ours, theirs) in enumerate(zip(logits, expected_logits)):
        scale = float(np.abs(theirs).max())
        difference = float(np.abs(ours - theirs).max())
        if not difference <= check.relative * scale + check.absolute:  # NaN fails too
            raise ModelError(f"generation check: step {step}'s logits differ from transformers' by {difference:.3g} "
                             f"(allowed: {check.relative:g} x the largest |logit| {scale:.3g} + {check.absolute:g})")
        errors.append(difference / scale if scale else difference)
    return Agreement(steps=len(logits), largest_error=max(errors, default=0.0))

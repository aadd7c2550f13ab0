"""README's "Fine-tuning" example: GPT-2 fine-tuned on Python's documentation
with its own tokenizer (config/fine_tuning.yaml).

`python examples/fine_tuning.py` writes `pretrained/gpt2/` as transformers'
save_pretrained writes a model and its tokenizer: a small GPT-2 (random weights)
and a byte-level BPE tokenizer trained on Python's documentation, a stand-in for
a model you already have; nothing is downloaded. The config names the folder
(`model: {kind: transformers, path: pretrained/gpt2, task: causal-lm}`), and
ortflow reads both from it: the model's weights and its tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import GPT2LMHeadModel

FOLDER = Path("pretrained/gpt2")
EOS = "<|endoftext|>"


def documentation() -> list[str]:
    """Python's own documentation (pydoc_data, in every CPython), one text per topic."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return [topics[key] for key in sorted(topics)]


def save_tokenizer(folder: Path, vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2's kind) with the end-of-text token that
    ortflow puts between documents, saved as transformers saves a tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documentation(), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS).save_pretrained(folder)
    return tokenizer


def save_model(folder: Path, vocab_size: int, eos_token_id: int, context: int) -> None:
    from transformers import GPT2Config

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=128, n_positions=context, vocab_size=vocab_size,
                        bos_token_id=eos_token_id, eos_token_id=eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(folder)


def main(folder: Path = FOLDER, vocab_size: int = 2000, context: int = 64) -> None:
    tokenizer = save_tokenizer(folder, vocab_size)
    save_model(folder, tokenizer.get_vocab_size(), tokenizer.token_to_id(EOS), context)
    files = ", ".join(sorted(path.name for path in folder.iterdir()))
    print(f"{folder}/: GPT-2 and its tokenizer ({tokenizer.get_vocab_size()} tokens): {files}")


if __name__ == "__main__":
    main(*(Path(arg) for arg in sys.argv[1:2]))

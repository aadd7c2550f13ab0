"""Tokenizers and a torch text classifier for tests/test_tokenizers.py, made here
from local text (nothing downloaded): a byte-level BPE tokenizer with an
end-of-text token (GPT-2's kind), a WordPiece one with BERT's [CLS]/[SEP]
template and its pair types (BERT's kind), and `TextBag` (`model.kind: torch`,
`model.path: text_models:TextBag`, found through PYTHONPATH)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def pydoc_text() -> str:
    """Python's own documentation, present in every CPython: text to train tokenizers on."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[key] for key in sorted(topics))


def train_bpe(path: Path, vocab_size: int = 400):
    """A byte-level BPE tokenizer with the special token <|endoftext|>, saved as tokenizer.json at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(pydoc_text().split("\n\n"), trainer)
    tokenizer.save(str(path))
    return tokenizer


def train_wordpiece(path: Path, vocab_size: int = 300, texts: list[str] | None = None):
    """A lower-casing WordPiece tokenizer with BERT's template ([CLS] a [SEP] b [SEP],
    type ids 1 for b) and a [PAD] token, saved as tokenizer.json at `path`.

    Its vocabulary is counted here, not learnt by tokenizers' WordPieceTrainer, whose ids
    change from process to process (ties broken in hash-map order), and with them the tests'
    shards and how their training goes: the special tokens, every character as a word's
    first (c) and as a later one (##c), then the commonest words (ties alphabetical) up to
    `vocab_size`; a word not among them is split into characters."""
    from collections import Counter

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    normalizer, pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    counts = Counter(word for text in (texts or pydoc_text().split("\n\n"))
                     for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += sorted({word[0] for word in counts} | {"##" + c for word in counts for c in word[1:]})
    vocab += sorted((w for w in counts if len(w) > 1), key=lambda w: (-counts[w], w))[:max(0, vocab_size - len(vocab))]
    tokenizer = Tokenizer(models.WordPiece({token: i for i, token in enumerate(vocab)}, unk_token="[UNK]"))
    tokenizer.normalizer, tokenizer.pre_tokenizer = normalizer, pre_tokenizer
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[(token, vocab.index(token)) for token in ("[CLS]", "[SEP]")])
    tokenizer.save(str(path))
    return tokenizer


class TextBag(nn.Module):
    """Token and token-type embeddings, averaged over the tokens the attention mask
    keeps, then a linear layer to the classes. Its forward lists the tokenizer's
    inputs in another order than the data does: they reach it by name."""

    def __init__(self, vocab_size: int, classes: int, width: int = 32):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width)
        self.types = nn.Embedding(2, width)
        self.head = nn.Linear(width, classes)

    def forward(self, attention_mask: torch.Tensor, token_type_ids: torch.Tensor, input_ids: torch.Tensor):
        weights = attention_mask.unsqueeze(-1).float()
        embedded = (self.tokens(input_ids) + self.types(token_type_ids)) * weights
        return self.head(embedded.sum(dim=1) / weights.sum(dim=1).clamp(min=1.0))


CHAT_WORDS = ["<s>", "</s>", "<pad>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"] + [
    "hi", "there", "how", "are", "you", "fine", "ok", "thanks", "be", "brief", "what", "is", "two", "plus", "four",
    "yes", "no", "a", "b", "c"]
# Each turn: its role's token, its words, and </s> after an assistant's; the generation prompt opens one.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                 "{% if m['role'] == 'assistant' %}{{ eos_token }} {% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")
# The same rendering with the assistant's tokens marked, as transformers' return_assistant_tokens_mask reads them.
MARKED_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {% if m['role'] == 'assistant' %}"
                   "{% generation %}{{ m['content'] }} {{ eos_token }}{% endgeneration %} {% else %}"
                   "{{ m['content'] }} {% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")


def chat_tokenizer(folder: Path, template: str | None = CHAT_TEMPLATE) -> Path:
    """A word-level tokenizer of CHAT_WORDS (one id a word, split at spaces) saved with save_pretrained
    into `folder`, its chat template `template` (None: none): small enough to read ids by eye."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(CHAT_WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>")
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(folder))
    return folder

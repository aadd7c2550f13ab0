"""Hugging Face transformers models as ortflow trains them (`model.kind: torch`),
randomly initialised from a config or loaded from a local folder with
from_pretrained (nothing downloaded): the wrappers that docs/models.md's "Hugging
Face transformers" example shows, and the small pretrained folders they load
(written here with save_pretrained), for tests/test_transformers.py,
tests/test_pretrained.py, tests/test_fine_tuning.py and bench/bench_train.py."""

from pathlib import Path

import torch
from torch import nn
from transformers import (AutoConfig, AutoModel, BertConfig, BertForSequenceClassification, BertModel, GPT2Config,
                          GPT2LMHeadModel)


class GPT2(nn.Module):
    """GPT-2 as a byte-level language model on `data.source: text`: one input
    (the token ids, named like data.features), the logits as [batch, vocab,
    time], the layout ortflow's cross-entropy takes (transformers gives [batch,
    time, vocab])."""

    def __init__(self, n_layer: int = 2, n_head: int = 2, n_embd: int = 64, context: int = 64, vocab_size: int = 256,
                 **config):
        super().__init__()
        self.model = GPT2LMHeadModel(
            GPT2Config(
                n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size, n_positions=context,
                bos_token_id=0, eos_token_id=0, **config,
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # No cache: training never reuses keys and values.
        return self.model(input_ids=x, use_cache=False).logits.transpose(1, 2)


class BertClassifier(nn.Module):
    """BertForSequenceClassification on token ids and their attention mask (two
    inputs, in the order of data.features); the logits are [batch, classes]."""

    def __init__(self, vocab_size: int = 32, classes: int = 2, hidden_size: int = 32, layers: int = 2, heads: int = 2,
                 intermediate_size: int | None = None, max_position_embeddings: int = 64, **config):
        super().__init__()
        self.model = BertForSequenceClassification(
            BertConfig(
                vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers, num_attention_heads=heads,
                intermediate_size=intermediate_size or 2 * hidden_size, max_position_embeddings=max_position_embeddings,
                num_labels=classes, **config,
            )
        )

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # .long(): a no-op for int64 ids, a cast where the data arrive as float32.
        return self.model(input_ids=input_ids.long(), attention_mask=attention_mask.long()).logits


class PretrainedGPT2(nn.Module):
    """GPT-2 loaded with from_pretrained from a local folder (save_pretrained's):
    the wrapper a user writes to fine-tune a model they already have."""

    def __init__(self, folder: str):
        super().__init__()
        self.model = GPT2LMHeadModel.from_pretrained(folder)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x, use_cache=False).logits.transpose(1, 2)


class PretrainedBert(nn.Module):
    """A pretrained BERT encoder (a BertModel's folder) under a new classification
    head of `classes` labels, which from_pretrained initialises (from torch's seed).
    token_type_ids is optional, as in transformers: a WordPiece tokenizer with
    BERT's template gives them, an .npz of ids and masks does not."""

    def __init__(self, folder: str, classes: int = 2):
        super().__init__()
        self.model = BertForSequenceClassification.from_pretrained(folder, num_labels=classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        types = None if token_type_ids is None else token_type_ids.long()
        return self.model(input_ids=input_ids.long(), attention_mask=attention_mask.long(),
                          token_type_ids=types).logits


class EncoderWithHead(nn.Module):
    """The encoder of a save_pretrained folder built from its config alone (its
    weights then come from model.weights: the folder's own model.safetensors) under
    a new classification head on the pooled output: its state_dict names are the
    folder's behind the wrapper's `model.`."""

    def __init__(self, folder: str, classes: int = 2):
        super().__init__()
        self.model = AutoModel.from_config(AutoConfig.from_pretrained(folder))
        self.head = nn.Linear(self.model.config.hidden_size, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.model(input_ids=input_ids.long(), attention_mask=attention_mask.long()).pooler_output)


def save_gpt2(folder: Path, vocab_size: int = 256, context: int = 16, eos_token_id: int = 0) -> Path:
    """A tiny GPT-2 language model (weights from torch's seed 0), saved as transformers saves it."""
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=vocab_size, n_positions=context,
                               bos_token_id=eos_token_id, eos_token_id=eos_token_id)).save_pretrained(folder)
    return folder


def save_bert(folder: Path, vocab_size: int = 32, **config) -> Path:
    """A tiny pretrained BERT encoder (BertModel, no classification head; weights
    from torch's seed 0), saved as transformers saves it."""
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64, **config)).save_pretrained(folder)
    return folder


def save_t5(folder: Path, vocab_size: int, pad_token_id: int, eos_token_id: int) -> Path:
    """A tiny T5 (encoder-decoder; weights from torch's seed 0), saved as transformers saves it;
    its decoder starts from the padding token, as T5's does."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    T5ForConditionalGeneration(T5Config(vocab_size=vocab_size, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                        num_heads=2, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                                        decoder_start_token_id=pad_token_id)).save_pretrained(folder)
    return folder

"""A transformers sequence-to-sequence model (T5, BART) as optimum's three ONNX files for generation.

What optimum's ORTModelForSeq2SeqLM loads from a folder (its modeling_seq2seq.py and the exporter's
OnnxSeq2SeqConfigWithPast, read in 2026), by its file, input and output names:
- `encoder_model.onnx`: `input_ids`, `attention_mask [batch, encoder_sequence_length]` ->
  `last_hidden_state [batch, encoder_sequence_length, hidden]`;
- `decoder_model.onnx`, the first step: `encoder_attention_mask`, `input_ids [batch,
  decoder_sequence_length]`, `encoder_hidden_states` -> `logits [batch, decoder_sequence_length,
  vocab]` and per layer i `present.{i}.decoder.key/.value [batch, heads, decoder_sequence, head_dim]`
  (the self-attention's) and `present.{i}.encoder.key/.value [batch, heads, encoder_sequence_length,
  head_dim]` (the cross-attention's, computed once from the encoder's states);
- `decoder_with_past_model.onnx`, every further step: the same inputs and
  `past_key_values.{i}.decoder/.encoder.key/.value` -> `logits` and `present.{i}.decoder.key/.value`
  only (optimum takes the cross-attention's from the past it gave: an encoder present there is its
  deprecated layout).

transformers 5 keeps the cache in an EncoderDecoderCache of two DynamicCaches, which torch.onnx
cannot take as an input: the wrappers build it from the flat tensors and flatten the presents, as
decoder.CachedDecoder does for a causal LM. A cache with its cross-attention filled is marked
updated, so the decoder reads the keys it is given instead of projecting the encoder's states again.
"""

from __future__ import annotations

import copy
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import atomic
from ..errors import ModelError
from ..export.checks import TOLERANCE
from ..export.ecosystem import copy_tokenizer_files
from ..graphs import inference_model
from .check import Agreement, GenerationCheck
from . import DECODER, DECODER_WITH_PAST, ENCODER
from .decoder import OPSET
from .seq2seq import check_seq2seq

log = logging.getLogger("ortflow.export")

# The traced example: a past longer than 0 for the with-past decoder, since a DynamicCache takes another
# branch for an empty one (decoder.py), and source and target lengths that differ, so that no axis is
# taken for another.
EXAMPLE_BATCH, EXAMPLE_SOURCE, EXAMPLE_PAST = 2, 5, 3


@dataclass(frozen=True)
class Seq2SeqLayout:
    """The decoder's cache: per layer a self-attention and a cross-attention key and value
    [batch, heads, sequence, head_dim], all of `heads` and `head_dim`."""
    layers: int
    heads: int
    head_dim: int
    hidden: int  # the encoder's states' width

    def cache_names(self, prefix: str, parts: tuple[str, ...] = ("decoder", "encoder")) -> list[str]:
        """optimum's order: per layer the self-attention's key and value, then the cross-attention's."""
        return [f"{prefix}.{i}.{part}.{tensor}" for i in range(self.layers) for part in parts
                for tensor in ("key", "value")]


def seq2seq_layout(model) -> Seq2SeqLayout:
    """The cache of the transformers sequence-to-sequence model `model`, read from one forward step:
    refused in one line where it is not an EncoderDecoderCache of one key and one value tensor
    [batch, heads, sequence, head_dim] per layer, in both attentions, of one heads and head_dim
    (what optimum's layout carries)."""
    from transformers import DynamicCache, EncoderDecoderCache

    name = f"{type(model).__name__} ({model.config.model_type})"
    with torch.no_grad():
        out = model(input_ids=torch.ones(1, 3, dtype=torch.int64), decoder_input_ids=torch.ones(1, 2, dtype=torch.int64),
                    use_cache=True)
    cache = getattr(out, "past_key_values", None)
    shapes = set()
    if isinstance(cache, EncoderDecoderCache):
        for part, length in ((cache.self_attention_cache, 2), (cache.cross_attention_cache, 3)):
            layers = getattr(part, "layers", None) if isinstance(part, DynamicCache) else None
            for layer in layers or [None]:
                keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
                for tensor in (keys, values):
                    shapes.add((tensor.shape[0], tensor.shape[1], tensor.shape[3], tensor.shape[2] == length)
                               if isinstance(tensor, torch.Tensor) and tensor.dim() == 4 else None)
    if len(shapes) != 1 or None in shapes or not next(iter(shapes))[3]:
        raise ModelError(f"{name} keeps its generation cache as {type(cache).__name__}, not a self-attention and a "
                         "cross-attention key and value tensor [batch, heads, sequence, head_dim] per layer of one "
                         "shape: ortflow cannot export it as optimum's encoder and decoders with a cache")
    _, heads, head_dim, _ = next(iter(shapes))
    return Seq2SeqLayout(layers=len(cache.self_attention_cache.layers), heads=heads, head_dim=head_dim,
                         hidden=out.encoder_last_hidden_state.shape[-1])


class Encoder(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class CachedSeq2SeqDecoder(torch.nn.Module):
    """The model's decoder between flat tensors and transformers' EncoderDecoderCache: without a past
    (the first step) it returns every present; with one, the self-attention's only."""

    def __init__(self, model, layout: Seq2SeqLayout, with_past: bool):
        super().__init__()
        self.model = model
        self.layout = layout
        self.with_past = with_past

    def forward(self, encoder_attention_mask, input_ids, encoder_hidden_states, *past):
        from transformers import DynamicCache, EncoderDecoderCache
        from transformers.modeling_outputs import BaseModelOutput

        own, cross = DynamicCache(), DynamicCache()
        for layer in range(self.layout.layers if self.with_past else 0):
            own.update(past[4 * layer], past[4 * layer + 1], layer)
            cross.update(past[4 * layer + 2], past[4 * layer + 3], layer)
        cache = EncoderDecoderCache(own, cross)  # a filled cross-attention cache is marked updated
        out = self.model(encoder_outputs=BaseModelOutput(last_hidden_state=encoder_hidden_states),
                         attention_mask=encoder_attention_mask, decoder_input_ids=input_ids, past_key_values=cache,
                         use_cache=True)
        presents = []
        for own_layer, cross_layer in zip(out.past_key_values.self_attention_cache.layers,
                                          out.past_key_values.cross_attention_cache.layers):
            presents += [own_layer.keys, own_layer.values]
            if not self.with_past:
                presents += [cross_layer.keys, cross_layer.values]
        return out.logits, *presents


def export_graph(wrapper: torch.nn.Module, example: tuple, inputs: list[str], outputs: list[str],
                 axes: dict[str, dict[int, str]], path: Path, opset: int) -> None:
    """`wrapper` traced at `opset` as the ONNX file `path`, its weights stored after the trace one tensor
    at a time (decoder.export_decoder's reason: memory), in external data beside it when large."""
    import onnx

    with tempfile.TemporaryDirectory(prefix="ortflow-seq2seq-", dir=path.parent) as scratch, torch.no_grad():
        traced = Path(scratch) / path.name
        torch.onnx.export(wrapper, example, str(traced), input_names=inputs, output_names=outputs,
                          dynamic_axes={name: axes[name] for name in [*inputs, *outputs] if name in axes},
                          opset_version=opset, dynamo=False, export_params=False, do_constant_folding=False)
        exported = onnx.load(str(traced))
    state = dict(wrapper.named_parameters(remove_duplicate=False)) | dict(wrapper.named_buffers(remove_duplicate=False))
    inference_model.store_weights(exported, {name: value.detach().numpy() for name, value in state.items()}, path, path)
    onnx.save(exported, str(path))


def export_seq2seq(model, folder: Path, opset: int = OPSET) -> Seq2SeqLayout:
    """The transformers sequence-to-sequence model `model` (put in eval mode) as optimum's encoder_model.onnx,
    decoder_model.onnx and decoder_with_past_model.onnx in `folder`, with their names and dynamic axes."""
    model.eval()
    layout = seq2seq_layout(model)
    folder = Path(folder)
    source = torch.ones(EXAMPLE_BATCH, EXAMPLE_SOURCE, dtype=torch.int64)
    mask = torch.ones(EXAMPLE_BATCH, EXAMPLE_SOURCE, dtype=torch.int64)
    states = torch.zeros(EXAMPLE_BATCH, EXAMPLE_SOURCE, layout.hidden)
    axes = {"input_ids": {0: "batch_size", 1: "encoder_sequence_length"},
            "attention_mask": {0: "batch_size", 1: "encoder_sequence_length"},
            "last_hidden_state": {0: "batch_size", 1: "encoder_sequence_length"}}
    # In eval mode themselves: torch.onnx.export gives a wrapper back its own mode (decoder.export_decoder).
    export_graph(Encoder(model).eval(), (source, mask), ["input_ids", "attention_mask"], ["last_hidden_state"], axes,
                 folder / ENCODER, opset)
    steps = {"encoder_attention_mask": {0: "batch_size", 1: "encoder_sequence_length"},
             "input_ids": {0: "batch_size", 1: "decoder_sequence_length"},
             "encoder_hidden_states": {0: "batch_size", 1: "encoder_sequence_length"},
             "logits": {0: "batch_size", 1: "decoder_sequence_length"}}
    steps |= {name: {0: "batch_size", 2: "past_decoder_sequence_length"}
              for name in layout.cache_names("past_key_values", ("decoder",))}
    steps |= {name: {0: "batch_size", 2: "encoder_sequence_length"}
              for name in layout.cache_names("past_key_values", ("encoder",)) + layout.cache_names("present", ("encoder",))}
    steps |= {name: {0: "batch_size", 2: "past_decoder_sequence_length + 1"}
              for name in layout.cache_names("present", ("decoder",))}
    inputs = ["encoder_attention_mask", "input_ids", "encoder_hidden_states"]
    first = torch.ones(EXAMPLE_BATCH, 1, dtype=torch.int64)
    export_graph(CachedSeq2SeqDecoder(model, layout, with_past=False).eval(), (mask, first, states), inputs,
                 ["logits", *layout.cache_names("present")], steps, folder / DECODER, opset)
    own = torch.zeros(EXAMPLE_BATCH, layout.heads, EXAMPLE_PAST, layout.head_dim)
    cross = torch.zeros(EXAMPLE_BATCH, layout.heads, EXAMPLE_SOURCE, layout.head_dim)
    past = [own, own, cross, cross] * layout.layers
    export_graph(CachedSeq2SeqDecoder(model, layout, with_past=True).eval(), (mask, first, states, *past),
                 [*inputs, *layout.cache_names("past_key_values")], ["logits", *layout.cache_names("present", ("decoder",))],
                 steps, folder / DECODER_WITH_PAST, opset)
    log.info("%s exported as optimum's encoder and decoders with a cache of %d layers x %d heads x %d: %s",
             type(model).__name__, layout.layers, layout.heads, layout.head_dim, folder)
    return layout


def export_seq2seq_folder(source: Path, folder: Path, check: GenerationCheck | None = None) -> Agreement | None:
    """The save_pretrained sequence-to-sequence folder `source` (export/transformers/) as the generation
    folder `folder`: optimum's three ONNX files, config.json (`use_cache: true`), generation_config.json
    and the tokenizer files, written under a temporary name and renamed into place once `check`
    (seq2seq.check_seq2seq) passes; returns its agreement."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    from ..models.hugging_face import attention
    from ..models.save_trained import quietly

    with quietly():
        kind = AutoConfig.from_pretrained(source, local_files_only=True).model_type
        model = AutoModelForSeq2SeqLM.from_pretrained(source, local_files_only=True, attn_implementation=attention(kind),
                                                      dtype="float32")
    with atomic.folder(folder) as building:
        export_seq2seq(model, building)
        config = copy.deepcopy(model.config)  # the model's own stays as saved, for the check's generate
        config.use_cache = True  # as the causal folder's (folder.py); optimum takes the decoder with past by its file
        config.save_pretrained(building)
        model.generation_config.save_pretrained(building)
        copy_tokenizer_files(source, building)
        return check_seq2seq(model, building, check) if check else None


def eval_check(sources: np.ndarray, valid: np.ndarray, positions: int | None, prompts: int,
               new_tokens: int) -> GenerationCheck:
    """The export's check on the first `prompts` eval sources (`sources` [records, context], `valid`
    each one's tokens before its padding): every other one cut to half its tokens, so that the batch
    has two lengths and is padded; `new_tokens`, or as many as the decoder's `positions` leave after
    its start token."""
    lengths = [max(1, int(valid[row]) // (1 if row % 2 == 0 else 2)) for row in range(min(prompts, len(sources)))]
    return GenerationCheck([sources[row, :length].tolist() for row, length in enumerate(lengths)],
                           new_tokens if positions is None else min(new_tokens, positions - 1),
                           relative=TOLERANCE["relative"], absolute=TOLERANCE["absolute"])

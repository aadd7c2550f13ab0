"""A transformers causal LM as one ONNX decoder with a KV cache, for prompt and decode steps alike.

The layout is optimum's and onnxruntime-genai's, so that their loaders read the graph as it is:
inputs `input_ids [batch, sequence]`, `attention_mask [batch, total_sequence]`, `position_ids
[batch, sequence]` (where the model's forward takes them), `past_key_values.{i}.key/.value
[batch, kv_heads, past_sequence, head_dim]`; outputs `logits [batch, sequence, vocab]` and
`present.{i}.key/.value [batch, kv_heads, total_sequence, head_dim]`. The prompt is a step with a
past of length 0.

transformers 5 keeps the cache in a Cache object (DynamicCache), which torch.onnx cannot take as
an input: `CachedDecoder` builds it from the flat past tensors and flattens the presents. A
Llama-structured family (llama, mistral, qwen2) and GPT-2 (the built-in `gpt` too) are written
from their weights instead, with ONNX Runtime's GroupQueryAttention, as onnxruntime-genai's model
builder writes them (written.py: 53 nodes for a 2-layer model). For the others, the TorchScript
exporter at OPSET traces it; measured on the 2-layer models of every causal family of
tests/test_hf_families.py (gpt2, gpt-neo, opt, llama, mistral, qwen2, qwen3, phi3, gemma, falcon),
the graph's logits and presents are within 1e-6 of torch's at past lengths 0, 5 and 12 with a
left-padded row. None of export_fixes' symbolics is needed here: the mask code that calls
torch.diff and a bool cumsum runs only without a cache and an attention mask (training).
"""

from __future__ import annotations

import inspect
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelError
from ..graphs import inference_model
from ..models.save_trained import position_limit

log = logging.getLogger("ortflow.export")

# LayerNormalization is one operator from opset 17; ONNX Runtime 1.19.2 loads opsets up to 21 and
# onnx 1.17 writes IR 10 at opsets up to 21, which it loads too (as onnxruntime >= 1.31 does).
OPSET = 17
# The example the exporter traces: a past longer than 0, since transformers' cache takes another
# branch for an empty one (its first update stores the keys instead of concatenating them), and
# a trace keeps only the branch it took.
EXAMPLE_BATCH, EXAMPLE_SEQUENCE, EXAMPLE_PAST = 2, 3, 4


@dataclass(frozen=True)
class CacheLayout:
    """What a generator needs to know of the decoder's cache and positions."""
    layers: int
    kv_heads: int
    head_dim: int
    position_ids: bool  # whether the decoder takes position_ids
    context_length: int  # the most positions the model has (embeddings or the rotary's trained length)

    def input_names(self) -> list[str]:
        return ["input_ids", "attention_mask", *(["position_ids"] if self.position_ids else []),
                *(f"past_key_values.{i}.{part}" for i in range(self.layers) for part in ("key", "value"))]

    def output_names(self) -> list[str]:
        return ["logits", *(f"present.{i}.{part}" for i in range(self.layers) for part in ("key", "value"))]


def cache_layout(model) -> CacheLayout:
    """The cache of the transformers causal LM `model`, read from one forward step: refused in one
    line where it is not one key and one value tensor [batch, kv_heads, sequence, head_dim] per
    layer, all of one shape (what optimum's and onnxruntime-genai's layout can carry)."""
    from transformers import DynamicCache

    name = f"{type(model).__name__} ({model.config.model_type})"
    with torch.no_grad():
        out = model(input_ids=torch.zeros(1, 2, dtype=torch.int64), use_cache=True)
    # a state-space model (Mamba) returns its state as cache_params, not past_key_values
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache_params", None)
    layers = getattr(cache, "layers", None) if isinstance(cache, DynamicCache) else None
    shapes = {tuple(layer.keys.shape) for layer in layers or ()
              if isinstance(getattr(layer, "keys", None), torch.Tensor)} | \
             {tuple(layer.values.shape) for layer in layers or ()
              if isinstance(getattr(layer, "values", None), torch.Tensor)}
    if not layers or len(shapes) != 1 or len(next(iter(shapes))) != 4 or next(iter(shapes))[2] != 2:
        kinds = ", ".join(sorted({type(layer).__name__ for layer in getattr(cache, "layers", None) or ()}))
        raise ModelError(f"{name} keeps its generation cache as {type(cache).__name__}"
                         f"{f' of {kinds}' if kinds else ''}, not one key and one value "
                         "tensor [batch, heads, sequence, head_dim] per layer: ortflow cannot export it as a decoder "
                         "with a KV cache")
    limit = position_limit(model)
    if limit is None:
        raise ModelError(f"{name}: its config has no n_positions or max_position_embeddings, so the decoder's "
                         "context length is unknown; set one in config.json")
    _, kv_heads, _, head_dim = next(iter(shapes))
    return CacheLayout(layers=len(layers), kv_heads=kv_heads, head_dim=head_dim,
                       position_ids="position_ids" in inspect.signature(model.forward).parameters,
                       context_length=limit)


class CachedDecoder(torch.nn.Module):
    """The causal LM between flat tensors (what torch.onnx exports) and transformers' Cache.

    The cache is a DynamicCache without the model's config: with it, a sliding-window family
    (Mistral) gets layers that drop the keys beyond the window, so a present would not span the
    total sequence that optimum and onnxruntime-genai expect; over the full cache, transformers'
    sliding-window mask gives the same attention (measured: tests/test_generation.py)."""

    def __init__(self, model, layout: CacheLayout):
        super().__init__()
        self.model = model
        self.layout = layout

    def forward(self, input_ids, attention_mask, *rest):
        from transformers import DynamicCache

        given = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.layout.position_ids:
            given["position_ids"], rest = rest[0], rest[1:]
        cache = DynamicCache()
        for layer in range(self.layout.layers):
            cache.update(rest[2 * layer], rest[2 * layer + 1], layer)
        out = self.model(**given, past_key_values=cache, use_cache=True)
        return out.logits, *(tensor for layer in out.past_key_values.layers for tensor in (layer.keys, layer.values))


def example(layout: CacheLayout) -> tuple:
    total = EXAMPLE_PAST + EXAMPLE_SEQUENCE
    ids = torch.zeros(EXAMPLE_BATCH, EXAMPLE_SEQUENCE, dtype=torch.int64)
    mask = torch.ones(EXAMPLE_BATCH, total, dtype=torch.int64)
    positions = torch.arange(EXAMPLE_PAST, total).expand(EXAMPLE_BATCH, -1)
    past = [torch.zeros(EXAMPLE_BATCH, layout.kv_heads, EXAMPLE_PAST, layout.head_dim)] * (2 * layout.layers)
    return ids, mask, *([positions] if layout.position_ids else []), *past


def dynamic_axes(layout: CacheLayout) -> dict[str, dict[int, str]]:
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "total_sequence"},
            "position_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}}
    axes |= {name: {0: "batch", 2: "past_sequence"} for name in layout.input_names() if name.startswith("past_")}
    axes |= {name: {0: "batch", 2: "total_sequence"} for name in layout.output_names() if name.startswith("present")}
    return {name: axes[name] for name in [*layout.input_names(), *layout.output_names()]}


def export_decoder(model, path: Path, opset: int = OPSET) -> CacheLayout:
    """The transformers causal LM `model` (put in eval mode) as the ONNX decoder `path`, its weights in
    external data beside it when they are large (external_data.threshold()); returns its cache layout.
    Exported without the weights, added one tensor at a time after (torch_export's reason: memory)."""
    import onnx

    from . import written

    model.eval()
    layout = cache_layout(model)
    path = Path(path)
    if written.writable(model):  # a Llama-structured family or GPT-2: written from the weights
        with torch.no_grad():
            graph, weights = written.write_decoder(model, layout, opset)
        inference_model.store_weights(graph, weights, path, path)
        onnx.save(graph, str(path))
        log.info("%s written as a decoder with GroupQueryAttention and a KV cache of %d layers x %d heads x %d: %s",
                 type(model).__name__, layout.layers, layout.kv_heads, layout.head_dim, path)
        return layout
    # In eval mode itself: torch.onnx.export gives the wrapper back its own mode when it ends, and a
    # new module's is training, which would turn `model`'s dropout on for the caller's generate
    # (measured: the export check's transformers tokens then changed from run to run).
    wrapper = CachedDecoder(model, layout).eval()
    with tempfile.TemporaryDirectory(prefix="ortflow-decoder-", dir=path.parent) as scratch, torch.no_grad():
        traced = Path(scratch) / "decoder.onnx"
        torch.onnx.export(wrapper, example(layout), str(traced), input_names=layout.input_names(),
                          output_names=layout.output_names(), dynamic_axes=dynamic_axes(layout),
                          opset_version=opset, dynamo=False, export_params=False,
                          # folding would make new tensors of the weights, which are not in the graph yet:
                          # ONNX Runtime folds the weights' Transposes when it loads the model
                          do_constant_folding=False)
        exported = onnx.load(str(traced))
    # Each weight written to the external data file before the next is read: the graph never holds
    # them all beside the module (the 101M gpt of tests/test_external_data.py: its export held 0.5 W less).
    state = dict(wrapper.named_parameters(remove_duplicate=False)) | dict(wrapper.named_buffers(remove_duplicate=False))
    inference_model.store_weights(exported, {name: value.detach().numpy() for name, value in state.items()}, path, path)
    onnx.save(exported, str(path))
    log.info("%s exported as a decoder with a KV cache of %d layers x %d heads x %d: %s", type(model).__name__,
             layout.layers, layout.kv_heads, layout.head_dim, path)
    return layout

"""The decoder of a Llama-structured causal LM or a GPT-2 written from its weights, as onnxruntime-genai's model builder writes one.

The traced decoder (decoder.py) is transformers' forward as the TorchScript exporter records it:
measured on a Llama of SmolLM-135M's shape, 3324 kernels a step, all but 241 of them shape
arithmetic, per-layer masks, the rotary and the unfused attention (docs/benchmarks.md, "Where the
decoder loses to the builder"). This writes the same computation with ONNX Runtime's contrib
operators, a few kernels a layer: Q, K and V in one MatMul, GroupQueryAttention (the cache's
concatenation, the causal mask and the key/value heads' sharing inside; a sliding window as its
local_window_size), the norms with the residual's add in one operator. The families' parts:

- llama, mistral, qwen2 (tests/test_hf_families.py's with this structure: RMSNorm, Q/K/V/O
  projections, a SiLU-gated MLP, a rotary whose frequencies do not change with the sequence
  length): SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization, RotaryEmbedding on the
  given position_ids, SiLU as Sigmoid and Mul;
- gpt2 (the built-in `gpt` too, as the GPT-2 it equals): a learned position embedding,
  LayerNormalization and SkipLayerNormalization, GELU as Gelu (erf) or FastGelu (tanh).

Others (qwen3's per-head norms, gemma's scaled embedding, phi3's fused projections...) are traced.

The folder's contract is decoder.py's, inputs and outputs alike. GroupQueryAttention knows a row's
valid length (seqlens_k, the attention mask's sum) but not where its padding is: it takes a row's
valid keys as its first ones (right padding), and writes the new keys after them. So the graph
rolls each row's new tokens left by the count of padding before its first one (0 in a decode step
and for right padding) before the layers, and rolls the logits back after: the layers' other
operators are position-wise, and the presents keep each row's keys first, its padding after,
which the next step's GroupQueryAttention reads by the same seqlens_k. A present thus differs from
transformers' cache for a left-padded row (its keys sit first, not last); the loaders pass it back
as the past unread, and the logits are the model's (measured: tests/test_written_decoder.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper

LLAMAS = {"llama", "mistral", "qwen2"}
# The rotaries whose cos and sin depend on the position alone (a table written once); "dynamic" and
# "longrope" change theirs with the sequence length.
STATIC_ROTARY = {"default", "linear", "llama3", "yarn"}
# GPT-2's activations: transformers' "gelu" is erf's, "gelu_new" and "gelu_pytorch_tanh" tanh's
GELU = {"gelu": "Gelu", "gelu_new": "FastGelu", "gelu_pytorch_tanh": "FastGelu"}
MICROSOFT = "com.microsoft"


def writable(model) -> bool:
    """Whether `model` (a transformers causal LM) has a structure this module writes."""
    config = model.config
    if config.model_type == "gpt2":
        return (config.activation_function in GELU and not config.reorder_and_upcast_attn
                and not config.add_cross_attention)
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    return (config.model_type in LLAMAS and getattr(config, "hidden_act", None) == "silu"
            and getattr(rotary, "rope_type", None) in STATIC_ROTARY
            and not getattr(config, "mlp_bias", False))


class Weights(Mapping):
    """The graph's weights by name, each an array or a function that makes one (called at each read)."""

    def __init__(self):
        self.values: dict = {}

    def __getitem__(self, name: str) -> np.ndarray:
        value = self.values[name]
        return value() if callable(value) else value

    def __iter__(self):
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)


class Graph:
    """Nodes, graph inputs and weights, named as they are added."""

    def __init__(self):
        self.nodes: list = []
        self.weights = Weights()
        self.shapes: dict[str, tuple] = {}
        self.constants: list = []

    def op(self, kind: str, inputs: list[str], name: str, outputs: int = 1, domain: str = "",
           names: list[str] | None = None, **attributes):
        names = names or [f"{name}" if outputs == 1 else f"{name}.{at}" for at in range(outputs)]
        self.nodes.append(helper.make_node(kind, inputs, names, name=name, domain=domain, **attributes))
        return names[0] if outputs == 1 else names

    def weight(self, name: str, value, shape: tuple[int, ...] | None = None) -> str:
        """`value` an array or tensor the graph holds as it is (the model's own memory), or a function
        that makes a copy (a transpose, a concatenation) of the given `shape`: called when the weight is
        written, and only then, so that the copies exist one at a time, not all beside the model
        (tests/test_external_data.py)."""
        if not callable(value):
            value = np.ascontiguousarray(value.detach().numpy() if hasattr(value, "detach") else value, np.float32)
            shape = value.shape
        self.weights.values[name] = value
        self.shapes[name] = tuple(shape)
        return name

    def constant(self, name: str, value, dtype) -> str:
        self.constants.append(helper.make_tensor(name, dtype, np.shape(value), np.ravel(value).tolist()))
        return name


def matrix(module) -> np.ndarray:
    """The [in, out] weight of a torch Linear ([out, in]) or of transformers' Conv1D (GPT-2's, [in, out])."""
    import torch

    weight = module.weight.detach().numpy()
    return weight.T if isinstance(module, torch.nn.Linear) else weight


def linear(graph: Graph, x: str, name: str, modules: list) -> str:
    """x times the `modules`' weights side by side (one MatMul), plus their biases where any has one."""
    matrices = [matrix(module) for module in modules]  # views of the modules' weights, no copies
    shape = (matrices[0].shape[0], sum(part.shape[1] for part in matrices))
    out = graph.op("MatMul", [x, graph.weight(f"{name}.weight", lambda: np.concatenate(matrices, 1).astype(
        np.float32, copy=False), shape)], f"{name}/MatMul")
    if all(module.bias is None for module in modules):
        return out
    bias = np.concatenate([module.bias.detach().numpy() if module.bias is not None else
                           np.zeros(part.shape[1], np.float32) for module, part in zip(modules, matrices)])
    return graph.op("Add", [out, graph.weight(f"{name}.bias", bias)], f"{name}/Add")


def normalize(graph: Graph, name: str, x: str, residual: str | None, module, epsilon: float) -> tuple[str, str]:
    """The norm `module` (an RMSNorm: a weight alone; a LayerNorm: with its bias) of x + residual (x
    alone where `residual` is None), and that sum: the residual stream after it."""
    simplified = getattr(module, "bias", None) is None
    weights = [graph.weight(f"{name}.weight", module.weight)] + \
        ([] if simplified else [graph.weight(f"{name}.bias", module.bias)])
    if residual is None:
        return graph.op("SimplifiedLayerNormalization" if simplified else "LayerNormalization", [x, *weights], name,
                        axis=-1, epsilon=epsilon, stash_type=1), x
    normed, _, _, residual = graph.op("SkipSimplifiedLayerNormalization" if simplified else "SkipLayerNormalization",
                                      [x, residual, *weights], name, outputs=4, domain=MICROSOFT, epsilon=epsilon)
    return normed, residual


def attention(graph: Graph, name: str, at: int, qkv: str, heads: int, kv_heads: int, head_dim: int,
              inputs: tuple[str, str, str], rotary: bool, scale: float, window: int | None) -> str:
    """GroupQueryAttention of layer `at` on the fused projections `qkv`, rotated first where `rotary`;
    its presents are the layer's outputs."""
    seqlens, total, positions = inputs
    graph.constant(f"{name}.split", [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], TensorProto.INT64)
    q, k, v = graph.op("Split", [qkv, f"{name}.split"], f"{name}/split", outputs=3, axis=-1)
    if rotary:
        q, k = (graph.op("RotaryEmbedding", [tensor, positions, "cos_cache", "sin_cache"], f"{name}/rotary_{part}",
                         domain=MICROSOFT, interleaved=0, num_heads=count)
                for tensor, part, count in ((q, "q", heads), (k, "k", kv_heads)))
    return graph.op(
        "GroupQueryAttention", [q, k, v, f"past_key_values.{at}.key", f"past_key_values.{at}.value", seqlens, total],
        f"{name}/attention", outputs=3, domain=MICROSOFT,
        names=[f"{name}/attended", f"present.{at}.key", f"present.{at}.value"],
        num_heads=heads, kv_num_heads=kv_heads, scale=scale,
        # transformers' window holds the query and the window - 1 keys before it; the operator's the
        # query and local_window_size keys before it
        local_window_size=window - 1 if window else -1)[0]


def llama_layer(graph: Graph, model, layout, at: int, x: str, residual: str | None,
                inputs: tuple[str, str, str]) -> tuple[str, str]:
    """Llama's layer `at` on the hidden states `x` (the previous layer's MLP output, or the embedding
    when `residual` is None) and the residual stream: its MLP output and the stream after its attention."""
    config, layer = model.config, model.model.layers[at]
    name, mlp, epsilon = f"layers.{at}", layer.mlp, config.rms_norm_eps
    # mistral's window is every layer's; qwen2's, where on, its layer_types' "sliding_attention" layers'
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None) if types is None or types[at] == "sliding_attention" else None
    normed, residual = normalize(graph, f"{name}.input_layernorm", x, residual, layer.input_layernorm, epsilon)
    projections = layer.self_attn
    qkv = linear(graph, normed, f"{name}.qkv_proj", [projections.q_proj, projections.k_proj, projections.v_proj])
    attended = attention(graph, name, at, qkv, config.num_attention_heads, layout.kv_heads, layout.head_dim, inputs,
                         rotary=True, scale=float(projections.scaling), window=window)
    x = linear(graph, attended, f"{name}.o_proj", [projections.o_proj])
    normed, residual = normalize(graph, f"{name}.post_attention_layernorm", x, residual,
                                 layer.post_attention_layernorm, epsilon)
    gate = linear(graph, normed, f"{name}.gate_proj", [mlp.gate_proj])
    silu = graph.op("Mul", [gate, graph.op("Sigmoid", [gate], f"{name}/sigmoid")], f"{name}/silu")
    up = linear(graph, normed, f"{name}.up_proj", [mlp.up_proj])
    return linear(graph, graph.op("Mul", [silu, up], f"{name}/gated"), f"{name}.down_proj", [mlp.down_proj]), residual


def gpt2_layer(graph: Graph, model, layout, at: int, x: str, residual: str | None,
               inputs: tuple[str, str, str]) -> tuple[str, str]:
    """GPT-2's block `at`, as llama_layer."""
    config, block = model.config, model.transformer.h[at]
    name, epsilon = f"h.{at}", config.layer_norm_epsilon
    normed, residual = normalize(graph, f"{name}.ln_1", x, residual, block.ln_1, epsilon)
    qkv = linear(graph, normed, f"{name}.attn.c_attn", [block.attn.c_attn])
    scale = (layout.head_dim ** -0.5 if config.scale_attn_weights else 1.0) / \
        (at + 1 if config.scale_attn_by_inverse_layer_idx else 1)
    attended = attention(graph, name, at, qkv, config.n_head, layout.kv_heads, layout.head_dim, inputs,
                         rotary=False, scale=scale, window=None)
    x = linear(graph, attended, f"{name}.attn.c_proj", [block.attn.c_proj])
    normed, residual = normalize(graph, f"{name}.ln_2", x, residual, block.ln_2, epsilon)
    hidden = graph.op(GELU[config.activation_function], [linear(graph, normed, f"{name}.mlp.c_fc", [block.mlp.c_fc])],
                      f"{name}/gelu", domain=MICROSOFT)
    return linear(graph, hidden, f"{name}.mlp.c_proj", [block.mlp.c_proj]), residual


def rotary_tables(model, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, head_dim / 2] of the model's rotary, its attention scaling included."""
    import torch

    rotary = model.model.rotary_emb
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half].numpy(), sin[0, :, :half].numpy()


def embedded(graph: Graph, model, layout, ids: str, positions: str) -> str:
    """The hidden states the first layer takes: the token embedding, plus GPT-2's position embedding
    (a Llama's positions are its rotary's, whose tables this writes)."""
    if model.config.model_type == "gpt2":
        tokens = graph.op("Gather", [graph.weight("wte.weight", model.transformer.wte.weight), ids], "tokens")
        places = graph.op("Gather", [graph.weight("wpe.weight", model.transformer.wpe.weight), positions], "places")
        return graph.op("Add", [tokens, places], "embedded")
    cos, sin = rotary_tables(model, layout.context_length)
    graph.weight("cos_cache", cos), graph.weight("sin_cache", sin)
    return graph.op("Gather", [graph.weight("embed_tokens.weight", model.model.embed_tokens.weight), ids], "embedded")


def write_decoder(model, layout, opset: int) -> tuple[onnx.ModelProto, Weights]:
    """The ONNX decoder (at `opset`) of the causal LM `model` (writable) with the inputs and outputs
    of `layout` (decoder.CacheLayout), and its weights by name: graph inputs until
    inference_model.store_weights makes them initializers."""
    gpt2 = model.config.model_type == "gpt2"
    body = model.transformer if gpt2 else model.model
    graph = Graph()
    seqlens, total, ids, positions, back = rolled_inputs(graph)
    x, residual = embedded(graph, model, layout, ids, positions), None
    for at in range(layout.layers):
        x, residual = (gpt2_layer if gpt2 else llama_layer)(graph, model, layout, at, x, residual,
                                                            (seqlens, total, positions))
    final = body.ln_f if gpt2 else body.norm
    normed, _ = normalize(graph, "final_norm", x, residual, final,
                          model.config.layer_norm_epsilon if gpt2 else model.config.rms_norm_eps)
    head = model.get_output_embeddings()
    logits = linear(graph, normed, "lm_head", [head])
    graph.op("GatherND", [logits, graph.op("Unsqueeze", [back, "last"], "back_index")], "logits", batch_dims=1)
    return model_of(graph, layout, head.out_features, opset), graph.weights


def rolled_inputs(graph: Graph) -> tuple[str, ...]:
    """GroupQueryAttention's seqlens_k (a row's valid length less one) and total_sequence_length; the
    input ids and position ids with each row's new tokens rolled left by the padding before its first
    one; the indices that roll the logits back (module docstring)."""
    i64, i32 = TensorProto.INT64, TensorProto.INT32
    zero, one = graph.constant("zero", 0, i64), graph.constant("one", 1, i64)
    graph.constant("axis1", [1], i64)
    graph.constant("last", [-1], i64)
    graph.constant("end", [np.iinfo(np.int64).max], i64)
    sequence = graph.op("Shape", ["input_ids"], "sequence", start=1, end=2)
    total = graph.op("Shape", ["attention_mask"], "total", start=1, end=2)
    mask = graph.op("Cast", ["attention_mask"], "mask32", to=i32)
    valid = graph.op("ReduceSum", [mask, "axis1"], "valid", keepdims=0)
    seqlens = graph.op("Sub", [valid, graph.constant("one32", 1, i32)], "seqlens_k")
    total32 = graph.op("Cast", [graph.op("Squeeze", [total], "total_scalar")], "total32", to=i32)
    new = graph.op("Slice", [mask, graph.op("Neg", [sequence], "minus_sequence"), "end", "axis1"], "new_mask")
    first = graph.op("Cast", [graph.op("ArgMax", [new], "first32", axis=1, keepdims=1)], "first", to=i64)
    steps = graph.op("Range", [zero, graph.op("Squeeze", [sequence], "sequence_scalar"), one], "steps")
    rolled = graph.op("Mod", [graph.op("Add", [steps, first], "shifted"), sequence], "rolled")
    back = graph.op("Mod", [graph.op("Add", [graph.op("Sub", [steps, first], "unshifted"), sequence], "unwrapped"),
                            sequence], "back")
    ids = graph.op("GatherElements", ["input_ids", rolled], "ids", axis=1)
    positions = graph.op("GatherElements", ["position_ids", rolled], "positions", axis=1)
    return seqlens, total32, ids, positions, back


def model_of(graph: Graph, layout, vocab: int, opset: int) -> onnx.ModelProto:
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    kv = [layout.kv_heads, layout.head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", i64, ["batch", "sequence"]),
              helper.make_tensor_value_info("attention_mask", i64, ["batch", "total_sequence"]),
              helper.make_tensor_value_info("position_ids", i64, ["batch", "sequence"]),
              *(helper.make_tensor_value_info(name, f32, ["batch", kv[0], "past_sequence", kv[1]])
                for name in layout.input_names() if name.startswith("past_"))]
    outputs = [helper.make_tensor_value_info("logits", f32, ["batch", "sequence", vocab]),
               *(helper.make_tensor_value_info(name, f32, ["batch", kv[0], "total_sequence", kv[1]])
                 for name in layout.output_names() if name.startswith("present"))]
    weights = [helper.make_tensor_value_info(name, f32, shape) for name, shape in graph.shapes.items()]
    onnx_graph = helper.make_graph(graph.nodes, "decoder", inputs + weights, outputs, initializer=graph.constants)
    # IR 8, the traced decoder's (torch.onnx's at opset 17): what ONNX Runtime 1.19.2 and >= 1.31 load
    return helper.make_model(onnx_graph, ir_version=8, opset_imports=[helper.make_opsetid("", opset),
                                                                      helper.make_opsetid(MICROSOFT, 1)])

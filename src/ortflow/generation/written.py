"""The decoder of a Llama-structured causal LM written from its weights, as onnxruntime-genai's model builder writes it.

The traced decoder (decoder.py) is transformers' forward as the TorchScript exporter records it:
measured on a Llama of SmolLM-135M's shape, 3324 kernels a step, all but 241 of them shape
arithmetic, per-layer masks, the rotary and the unfused attention (docs/benchmarks.md, "Where the
decoder loses to the builder"). This writes the same computation with ONNX Runtime's contrib
operators, a few kernels a layer: SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization
(RMSNorm with the residual's add), Q, K and V in one MatMul, RotaryEmbedding on the given
position_ids, GroupQueryAttention (the cache's concatenation, the causal mask and the key/value
heads' sharing inside; a sliding window as its local_window_size), SiLU as Sigmoid and Mul.

The folder's contract is decoder.py's, inputs and outputs alike. GroupQueryAttention knows a row's
valid length (seqlens_k, the attention mask's sum) but not where its padding is: it takes a row's
valid keys as its first ones (right padding), and writes the new keys after them. So the graph
rolls each row's new tokens left by the count of padding before its first one (0 in a decode step
and for right padding) before the layers, and rolls the logits back after: the layers' other
operators are position-wise, and the presents keep each row's keys first, its padding after,
which the next step's GroupQueryAttention reads by the same seqlens_k. A present thus differs from
transformers' cache for a left-padded row (its keys sit first, not last); the loaders pass it back
as the past unread, and the logits are the model's (measured: tests/test_written_decoder.py).

Families: llama, mistral and qwen2 (tests/test_hf_families.py's with this structure: RMSNorm, Q/K/V/O
projections, a SiLU-gated MLP, a rotary whose frequencies do not change with the sequence length).
Others (qwen3's per-head norms, gemma's scaled embedding, phi3's fused projections...) are traced.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

FAMILIES = {"llama", "mistral", "qwen2"}
# The rotaries whose cos and sin depend on the position alone (a table written once); "dynamic" and
# "longrope" change theirs with the sequence length.
STATIC_ROTARY = {"default", "linear", "llama3", "yarn"}
MICROSOFT = "com.microsoft"


def writable(model) -> bool:
    """Whether `model` (a transformers causal LM) has the structure this module writes."""
    config = model.config
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    return (config.model_type in FAMILIES and getattr(config, "hidden_act", None) == "silu"
            and getattr(rotary, "rope_type", None) in STATIC_ROTARY
            and not getattr(config, "mlp_bias", False))


class Graph:
    """Nodes, graph inputs and weights, named as they are added."""

    def __init__(self):
        self.nodes: list = []
        self.weights: dict[str, np.ndarray] = {}
        self.constants: list = []

    def op(self, kind: str, inputs: list[str], name: str, outputs: int = 1, domain: str = "",
           names: list[str] | None = None, **attributes):
        names = names or [f"{name}" if outputs == 1 else f"{name}.{at}" for at in range(outputs)]
        self.nodes.append(helper.make_node(kind, inputs, names, name=name, domain=domain, **attributes))
        return names[0] if outputs == 1 else names

    def weight(self, name: str, value) -> str:
        self.weights[name] = np.ascontiguousarray(value, np.float32)
        return name

    def constant(self, name: str, value, dtype) -> str:
        self.constants.append(helper.make_tensor(name, dtype, np.shape(value), np.ravel(value).tolist()))
        return name


def linear(graph: Graph, x: str, name: str, modules: list) -> str:
    """x times the torch Linear `modules`' weights side by side (one MatMul), plus their biases where any has one."""
    out = graph.op("MatMul", [x, graph.weight(f"{name}.weight",
                                              np.concatenate([m.weight.detach().numpy().T for m in modules], 1))],
                   f"{name}/MatMul")
    if all(m.bias is None for m in modules):
        return out
    bias = np.concatenate([m.bias.detach().numpy() if m.bias is not None else np.zeros(m.out_features, np.float32)
                           for m in modules])
    return graph.op("Add", [out, graph.weight(f"{name}.bias", bias)], f"{name}/Add")


def rotary_tables(model, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, head_dim / 2] of the model's rotary, its attention scaling included."""
    import torch

    rotary = model.model.rotary_emb
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half].numpy(), sin[0, :, :half].numpy()


def write_decoder(model, layout, opset: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The ONNX decoder (at `opset`) of the Llama-structured causal LM `model` (writable) with the inputs
    and outputs of `layout` (decoder.CacheLayout), and its weights by name: graph inputs until
    inference_model.store_weights makes them initializers."""
    config, body = model.config, model.model
    graph = Graph()
    seqlens, total, ids, positions, back = rolled_inputs(graph)
    cos, sin = rotary_tables(model, layout.context_length)
    graph.weight("cos_cache", cos), graph.weight("sin_cache", sin)
    x = graph.op("Gather", [graph.weight("embed_tokens.weight", body.embed_tokens.weight.detach().numpy()), ids],
                 "embedded")
    residual = None
    for at, layer in enumerate(body.layers):
        x, residual = decoder_layer(graph, config, layout, at, layer, x, residual, (seqlens, total, positions))
    normed = graph.op("SkipSimplifiedLayerNormalization", [x, residual, graph.weight(
        "norm.weight", body.norm.weight.detach().numpy())], "final_norm", domain=MICROSOFT,
        epsilon=config.rms_norm_eps)
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


def decoder_layer(graph: Graph, config, layout, at: int, layer, x: str, residual: str | None,
                  attention_inputs: tuple[str, str, str]) -> tuple[str, str]:
    """Layer `at` on the hidden states `x` (the previous layer's MLP output, or the embedding when
    `residual` is None) and the residual stream: its MLP output and the stream after its attention."""
    name, attention, mlp, epsilon = f"layers.{at}", layer.self_attn, layer.mlp, config.rms_norm_eps
    heads, kv_heads, head_dim = config.num_attention_heads, layout.kv_heads, layout.head_dim
    seqlens, total, positions = attention_inputs
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    norm_in = graph.weight(f"{name}.input_layernorm.weight", layer.input_layernorm.weight.detach().numpy())
    if residual is None:
        normed = graph.op("SimplifiedLayerNormalization", [x, norm_in], f"{name}/input_norm",
                          axis=-1, epsilon=epsilon, stash_type=1)
        residual = x
    else:
        normed, _, _, residual = graph.op("SkipSimplifiedLayerNormalization", [x, residual, norm_in],
                                          f"{name}/input_norm", outputs=4, domain=MICROSOFT, epsilon=epsilon)
    qkv = linear(graph, normed, f"{name}.qkv_proj", [attention.q_proj, attention.k_proj, attention.v_proj])
    graph.constant(f"{name}.split", [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], TensorProto.INT64)
    q, k, v = graph.op("Split", [qkv, f"{name}.split"], f"{name}/split", outputs=3, axis=-1)
    q, k = (graph.op("RotaryEmbedding", [tensor, positions, "cos_cache", "sin_cache"], f"{name}/rotary_{part}",
                     domain=MICROSOFT, interleaved=0, num_heads=count)
            for tensor, part, count in ((q, "q", heads), (k, "k", kv_heads)))
    attended = graph.op(
        "GroupQueryAttention", [q, k, v, f"past_key_values.{at}.key", f"past_key_values.{at}.value", seqlens, total],
        f"{name}/attention", outputs=3, domain=MICROSOFT,
        names=[f"{name}/attended", f"present.{at}.key", f"present.{at}.value"],
        num_heads=heads, kv_num_heads=kv_heads, scale=float(attention.scaling),
        # transformers' window holds the query and the window - 1 keys before it; the operator's the
        # query and local_window_size keys before it
        local_window_size=window - 1 if window else -1)
    x = linear(graph, attended[0], f"{name}.o_proj", [attention.o_proj])
    norm_post = graph.weight(f"{name}.post_attention_layernorm.weight",
                             layer.post_attention_layernorm.weight.detach().numpy())
    normed, _, _, residual = graph.op("SkipSimplifiedLayerNormalization", [x, residual, norm_post],
                                      f"{name}/post_norm", outputs=4, domain=MICROSOFT, epsilon=epsilon)
    gate = linear(graph, normed, f"{name}.gate_proj", [mlp.gate_proj])
    silu = graph.op("Mul", [gate, graph.op("Sigmoid", [gate], f"{name}/sigmoid")], f"{name}/silu")
    up = linear(graph, normed, f"{name}.up_proj", [mlp.up_proj])
    return linear(graph, graph.op("Mul", [silu, up], f"{name}/gated"), f"{name}.down_proj", [mlp.down_proj]), residual


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
    weights = [helper.make_tensor_value_info(name, f32, value.shape) for name, value in graph.weights.items()]
    onnx_graph = helper.make_graph(graph.nodes, "decoder", inputs + weights, outputs, initializer=graph.constants)
    return helper.make_model(onnx_graph, opset_imports=[helper.make_opsetid("", opset),
                                                        helper.make_opsetid(MICROSOFT, 1)])

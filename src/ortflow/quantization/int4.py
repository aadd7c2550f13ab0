"""int4 weight-only quantization of a decoder: each MatMul (or Gemm) of a float weight becomes ONNX
Runtime's contrib op MatMulNBits (com.microsoft, 4 bits), whose CPU kernel onnxruntime-training
1.19.2 runs; activations stay float.

ONNX Runtime's own `MatMul4BitsQuantizer` cannot be imported from onnxruntime-training 1.19.2 (its
pybind lacks quantize_matmul_4bits), so the quantization is here in numpy, as its C++ does it
(mlas q4_dq.cpp, BlockwiseQuantizer::quantizeAndTranspose, called by the Python quantizer's
int4_block_quant):

- K is padded with zero rows to a whole number of blocks (the Python quantizer's np.pad), and each
  column of B [K, N] is cut into blocks of `block_size` along K;
- symmetric: the block's value of largest magnitude maps to -8: scale = -peak / 8, zero point 8
  (the op's default, so no zero_points input);
- asymmetric: the range [min(lo, 0), max(hi, 0)] maps to [0, 15]: scale = range / 15, zero point
  round(-min / scale) in [0, 15];
- q = clamp(roundf(w / scale + zero point), 0, 15), roundf rounding halves away from zero;
- B [N, blocks, block_size / 2] uint8, element k of a block in byte k / 2, its low nibble for even
  k; scales [N * blocks] float; zero points [N * ceil(blocks / 2)] uint8, block b of column n in
  byte n * ceil(blocks / 2) + b / 2, its low nibble for even b.

The embedding and the output layer as onnxruntime-genai's model builder (0.18) handles them by
default: op types ("MatMul",) quantized, so lm_head is int4 unless `nodes_to_exclude` names it and
the embedding's Gather stays float; block 32, symmetric, accuracy level 4 on the CPU. (Olive's
OnnxBlockWiseRtnQuantization quantizes every MatMul and Gather of an initializer, the embedding
too, at block 128.) Here the output layer is quantized unless `Int4.output_layer` is False; an
embedding tied to it stays float for its Gather either way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import external_data
from ..errors import ConfigError, DataError, ModelError
from ..onnx_nodes import attributes

log = logging.getLogger("ortflow.quantize")

MS_DOMAIN = "com.microsoft"
BLOCK_SIZES = (16, 32, 64, 128)
# MatMulNBits' accuracy levels (its schema): 0 and 1 compute in fp32, 4 quantizes A to int8.
ACCURACY_LEVELS = (0, 1, 2, 3, 4)


@dataclass(frozen=True)
class Int4:
    """The int4 quantization's settings. accuracy_level 4 (the model builder's CPU default) quantizes
    the activations to int8: on GPT-2 124M 1.8x level 0's greedy tokens/s at batch 1 and 8, for
    +0.01% perplexity on two trained models, where int4's weights cost +0.5% and +1.3%
    (bench/bench_int4_level.py, docs/benchmarks.md); 0 keeps the activations fp32, so that the int4
    model differs from fp32 by its weights alone."""
    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 4
    # quantize the output layer (lm_head): the last weight's MatMul, which gives the logits (as the
    # model builder's `last_matmul`)
    output_layer: bool = True

    def check(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError(f"int4 block_size {self.block_size}: must be one of {', '.join(map(str, BLOCK_SIZES))}")
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise ConfigError(f"int4 accuracy_level {self.accuracy_level}: must be one of 0 to 4 (MatMulNBits')")


def round_half_away(x: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero (numpy's round takes them to even)."""
    whole = np.trunc(x)
    return whole + np.where(np.abs(x - whole) >= 0.5, np.sign(x), 0).astype(x.dtype)


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """Pairs of 4-bit values along the last axis (even length) as bytes, the first in the low nibble."""
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def quantize_weight(weight: np.ndarray, block_size: int,
                    symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """MatMulNBits' B, scales and zero points (None when symmetric) of the float weight [K, N]."""
    k, n = weight.shape
    blocks = -(-k // block_size)
    padded = np.zeros((blocks * block_size, n), np.float32)
    padded[:k] = weight
    columns = padded.T.reshape(n, blocks, block_size)
    low, high = columns.min(-1), columns.max(-1)
    if symmetric:
        scale = -np.where(np.abs(high) > np.abs(low), high, low) / np.float32(8)
        zero = np.full(scale.shape, 8, np.float32)
    else:
        low, high = np.minimum(low, 0), np.maximum(high, 0)
        scale = (high - low) / np.float32(15)
        with np.errstate(divide="ignore", invalid="ignore"):
            zero = np.clip(round_half_away(np.where(scale != 0, -low / scale, low)), 0, 15).astype(np.float32)
    with np.errstate(divide="ignore"):
        reciprocal = np.where(scale != 0, np.float32(1) / scale, 0).astype(np.float32)
    q = np.clip(round_half_away(columns * reciprocal[..., None] + zero[..., None]), 0, 15).astype(np.uint8)
    zero_points = None
    if not symmetric:
        zeros = np.zeros((n, blocks + blocks % 2), np.uint8)
        zeros[:, :blocks] = zero
        zero_points = pack_nibbles(zeros).reshape(-1)
    return pack_nibbles(q), scale.astype(np.float32).reshape(-1), zero_points


def weight_source(node, initializers: dict, producers: dict) -> tuple[str, bool] | None:
    """The float32 2-D initializer that `node` multiplies its input by, and whether it is transposed
    ([N, K]) there, where the node is a MatMul or a plain Gemm (alpha = beta = 1, A not transposed)
    whose B is the initializer or the Transpose of one (torch.onnx exports a Linear as
    MatMul(x, Transpose(W)))."""
    found = attributes(node)
    if node.op_type == "Gemm":
        if found.get("alpha", 1.0) != 1.0 or found.get("beta", 1.0) != 1.0 or found.get("transA", 0):
            return None
    elif node.op_type != "MatMul":
        return None
    name, transposed = node.input[1], bool(found.get("transB", 0))
    transpose = producers.get(name)
    if name not in initializers and transpose is not None and transpose.op_type == "Transpose":
        # A 2-D Transpose without a perm reverses the axes: [1, 0].
        if attributes(transpose).get("perm", [1, 0]) == [1, 0]:
            name, transposed = transpose.input[0], not transposed
    tensor = initializers.get(name)
    if tensor is None or tensor.data_type != tensor.FLOAT or len(tensor.dims) != 2:
        return None
    return name, transposed


def read_weight(initializers: dict, source: tuple[str, bool]) -> np.ndarray:
    """The weight [K, N] of `weight_source`'s answer."""
    from onnx import numpy_helper

    name, transposed = source
    weight = numpy_helper.to_array(initializers[name])
    return weight.T if transposed else weight


def quantized_inputs(graph, weight: np.ndarray, name: str, settings: Int4) -> list[str]:
    """MatMulNBits' B, scales and (asymmetric) zero points of `weight` added to `graph` as
    initializers; returns their names."""
    from onnx import numpy_helper

    packed, scales, zero_points = quantize_weight(weight, settings.block_size, settings.symmetric)
    tensors = {f"{name}_Q4": packed, f"{name}_scales": scales}
    if zero_points is not None:
        tensors[f"{name}_zero_points"] = zero_points
    graph.initializer.extend(numpy_helper.from_array(array, key) for key, array in tensors.items())
    return list(tensors)


def matmul_nbits(node, inputs: list[str], shape: tuple[int, int], settings: Int4) -> list:
    """The MatMulNBits node that replaces `node`, and for a Gemm with a bias, the Add of it."""
    from onnx import helper

    output = node.output[0]
    bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else None
    product = f"{output}_Q4" if bias else output
    nodes = [helper.make_node("MatMulNBits", [node.input[0], *inputs], [product], name=f"{node.name}_Q4",
                              domain=MS_DOMAIN, K=shape[0], N=shape[1], bits=4, block_size=settings.block_size,
                              accuracy_level=settings.accuracy_level)]
    if bias:
        nodes.append(helper.make_node("Add", [product, bias], [output], name=f"{node.name}_bias"))
    return nodes


def drop_unused(graph) -> None:
    """The Transposes of the weights that MatMulNBits now reads packed, and the initializers that no
    node reads any more (an embedding tied to the output layer stays: its Gather reads it)."""
    used = {name for node in graph.node for name in node.input} | {value.name for value in graph.output}
    kept = [node for node in graph.node if node.op_type != "Transpose" or node.output[0] in used]
    del graph.node[:]
    graph.node.extend(kept)
    used = {name for node in graph.node for name in node.input} | {value.name for value in graph.output}
    kept = [tensor for tensor in graph.initializer if tensor.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def quantize_model(model, settings: Int4, where: str) -> int:
    """Replace, in `model`, each MatMul or Gemm of a float weight by MatMulNBits (the last one, the
    output layer, only with `settings.output_layer`); returns how many weights it quantized.
    A model without such a weight is refused in one line (`where` names it)."""
    from onnx import helper

    settings.check()
    graph = model.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    producers = {output: node for node in graph.node for output in node.output}
    found = [(index, weight_source(node, initializers, producers)) for index, node in enumerate(graph.node)]
    found = [(index, source) for index, source in found if source is not None]
    if not found:
        raise ModelError(f"{where}: int4 quantizes the weights of MatMul and Gemm nodes, and this model has none")
    if not settings.output_layer:
        found = found[:-1]
        if not found:
            raise ModelError(f"{where}: its one MatMul or Gemm weight is the output layer, which int4 keeps float "
                             "with output_layer false: nothing to quantize")
    made: dict[tuple[str, bool], tuple[list[str], tuple[int, int]]] = {}  # a shared weight is stored once
    replaced = {}
    for index, source in found:  # one weight in memory at a time, beside the model's own
        if source not in made:
            weight = read_weight(initializers, source)
            name = f"{source[0]}{'_T' if source[1] else ''}"
            made[source] = quantized_inputs(graph, weight, name, settings), weight.shape
        replaced[index] = matmul_nbits(graph.node[index], *made[source], settings)
    nodes = [new for index, node in enumerate(graph.node) for new in replaced.get(index, [node])]
    del graph.node[:]
    graph.node.extend(nodes)
    drop_unused(graph)
    if all(opset.domain != MS_DOMAIN for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return len(made)


def quantize_file(source: Path, target: Path, settings: Int4) -> int:
    """The ONNX model `source` int4-quantized as `target` (external data beside it when large)."""
    model = external_data.load_model(source)
    count = quantize_model(model, settings, str(source))
    external_data.save_model(model, target)
    log.info("int4: %d weights of %s quantized (block %d, %s): %s", count, source, settings.block_size,
             "symmetric" if settings.symmetric else "asymmetric", target)
    return count


def quantize_folder(source: Path, folder: Path, settings: Int4) -> int:
    """The generation folder `source` (generation.folder) as `folder` with its decoder int4-quantized
    and every other file as it is; written whole or not at all (atomic.folder)."""
    import shutil

    from .. import atomic
    from ..generation import MODEL

    source = Path(source)
    with atomic.folder(folder) as building:
        for path in source.iterdir():
            if path.name not in (MODEL, external_data.data_file(source / MODEL).name):
                shutil.copy2(path, building / path.name)
        return quantize_file(source / MODEL, building / MODEL, settings)


def weight_bytes(path: Path) -> int:
    """The bytes of the model's multiplied weights: a MatMul's or Gemm's float weight, a
    MatMulNBits' packed B, scales and zero points (what int4 shrinks; the embedding is not counted),
    from their shapes, without reading the weights."""
    from onnx import helper

    model = external_data.load_model(path, load_data=False)
    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    producers = {output: node for node in model.graph.node for output in node.output}

    def size(name: str) -> int:
        tensor = initializers[name]
        return int(np.prod(tensor.dims)) * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize

    total = 0
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            total += sum(size(name) for name in node.input[1:4] if name in initializers)
        elif source := weight_source(node, initializers, producers):
            total += size(source[0])
    return total


def token_losses(folder: Path, ids: list[int]) -> np.ndarray:
    """Each next token's cross-entropy (nats) under the generation folder's decoder, the sequence
    `ids` fed in one step from an empty cache: the exp of their mean is the perplexity, which
    compares an int4 decoder with its fp32 one on the same text."""
    from ..generation.generate import Decoder

    return decoder_losses(Decoder(folder, threads=1), ids)


def decoder_losses(decoder, ids: list[int]) -> np.ndarray:
    """token_losses on an open generation.generate.Decoder: many texts, one session."""
    if not 2 <= len(ids) <= decoder.context_length:
        raise DataError(f"int4 perplexity: a text of {len(ids)} tokens; it needs 2 to the model's "
                        f"{decoder.context_length}")
    tokens = np.array([ids], np.int64)
    logits, _ = decoder.run(tokens, np.ones_like(tokens), np.arange(len(ids))[None], decoder.empty_cache(1))
    shifted = logits[0, :-1].astype(np.float64)
    shifted -= shifted.max(-1, keepdims=True)
    log_probabilities = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -log_probabilities[np.arange(len(ids) - 1), ids[1:]]

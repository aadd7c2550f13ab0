"""int4 weight-only quantization (ortflow.quantization.int4): the packing read back by ONNX Runtime
1.19.2's MatMulNBits gives what a float MatMul of the dequantized weights gives, and the tiny
decoders of tests/test_generation.py, quantized, load, generate and keep a sane loss; and the
quantize_model stage's export.int4 step (quantization/int4_measure.py): its measures, its gate and
its summary line."""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import asdict
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers
from onnx import TensorProto, helper, numpy_helper

from ortflow.errors import ConfigError, MissingInputError, ModelError
from ortflow.generation import folder as generation_folder
from ortflow.generation.generate import Decoder, generate
from ortflow.models import IGNORE_INDEX
from ortflow.quantization import int4_measure
from ortflow.quantization.export_metrics import Gate
from ortflow.quantization.export_metrics import Int4 as Int4Entry
from ortflow.quantization.gate import QualityGateError
from ortflow.quantization.int4 import Int4, quantize_folder, quantize_model, quantize_weight, token_losses, weight_bytes
from ortflow.reporting.summary import int4_line
from test_generation import EOS, POSITIONS_TRIED, prompts, tiny
from test_hf_families import DECODER

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: why one thread

TRAINING_STEPS = 20
TEXT = "A language model fine-tuned with ortflow, quantized to four bits a weight, served by ONNX Runtime.".encode()


def dequantized(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int) -> np.ndarray:
    """The weight [K, N] that MatMulNBits multiplies by, read from its inputs as its schema
    describes them (unpacked here independently of the packing)."""
    n, blocks, half = packed.shape
    values = np.stack([packed & 0x0F, packed >> 4], -1).reshape(n, blocks, 2 * half).astype(np.float32)
    if zero_points is None:
        zero = np.full((n, blocks), 8, np.float32)
    else:
        nibbles = np.stack([zero_points & 0x0F, zero_points >> 4], -1).reshape(n, -1)
        zero = nibbles[:, :blocks].astype(np.float32)
    weight = (values - zero[..., None]) * scales.reshape(n, blocks)[..., None]
    return weight.reshape(n, -1)[:, :k].T


def run(node, initializers: list, a: np.ndarray, n: int) -> np.ndarray:
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, list(a.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [a.shape[0], n])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"a": a})[0]


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_matmulnbits_equals_matmul_of_dequantized_weights(block_size, symmetric):
    """K = 200 is no whole number of blocks of any size: the last block is padded. A column of
    zeros and one of a single value are the edge cases of the scale (0) and of the range."""
    rng = np.random.default_rng(0)
    k, n = 200, 24
    weight = rng.normal(size=(k, n)).astype(np.float32)
    weight[:, 3] = 0.0
    weight[:, 5] = 0.7
    weight[:, 7] = np.abs(weight[:, 7])  # all positive: the asymmetric range starts at 0
    packed, scales, zero_points = quantize_weight(weight, block_size, symmetric)
    blocks = -(-k // block_size)
    assert packed.shape == (n, blocks, block_size // 2) and packed.dtype == np.uint8
    assert scales.shape == (n * blocks,) and scales.dtype == np.float32
    assert (zero_points is None) == symmetric
    if not symmetric:
        assert zero_points.shape == (n * ((blocks + 1) // 2),)
    expected_weight = dequantized(packed, scales, zero_points, k)
    # rounded to the nearest step of the block's scale; symmetric maps the peak to -8, so a value
    # of the other sign as large clamps at +7, a whole step away
    steps = np.repeat(np.abs(scales.reshape(n, blocks)), block_size, 1)[:, :k].T
    assert np.all(np.abs(expected_weight - weight) <= steps * (1.0 if symmetric else 0.5) + 1e-6)
    a = rng.normal(size=(5, k)).astype(np.float32)
    tensors = {"b": packed, "scales": scales, **({} if symmetric else {"zero_points": zero_points})}
    node = helper.make_node("MatMulNBits", ["a", *tensors], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block_size, accuracy_level=0)
    got = run(node, [numpy_helper.from_array(array, name) for name, array in tensors.items()], a, n)
    reference = run(helper.make_node("MatMul", ["a", "w"], ["y"]), [numpy_helper.from_array(expected_weight, "w")],
                    a, n)
    assert np.allclose(got, reference, rtol=1e-5, atol=1e-5), np.abs(got - reference).max()


def wide_llama(root):
    """A Llama whose weights have K of 256 and 512, so that a block's scale is a small part of its
    bytes, trained on TEXT until it predicts it well: random weights give every model a perplexity
    near the vocabulary's 256, which says nothing of what int4 loses."""
    config = transformers.LlamaConfig(**{**DECODER, "hidden_size": 256, "intermediate_size": 512,
                                         "max_position_embeddings": POSITIONS_TRIED})
    config.bos_token_id = config.eos_token_id = EOS
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.generation_config.eos_token_id = EOS
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids = torch.tensor([list(TEXT)])
    for _ in range(TRAINING_STEPS):
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    model.eval()
    generation_folder.write_folder(lambda: (model, None), root / "generation")
    return root / "generation"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_int4_decoder_loads_and_generates(family, tmp_path):
    """Every weight's MatMul becomes MatMulNBits (the written decoders': generation/written.py); the
    embedding stays a float Gather, the output layer (tied to it) is quantized: the last MatMul, before
    the Gather that rolls the logits back."""
    source, _ = tiny(family, tmp_path)
    generation_folder.export_folder(source, tmp_path / "fp32")
    assert quantize_folder(tmp_path / "fp32", tmp_path / "int4", Int4()) > 0
    model = onnx.load(str(tmp_path / "int4" / "model.onnx"))
    kinds = [node.op_type for node in model.graph.node]
    assert "Gemm" not in kinds and [kind for kind in kinds if kind.startswith("MatMul")][-1] == "MatMulNBits"
    assert "Gather" in kinds
    weights = [node for node in model.graph.node if node.op_type == "MatMul"
               and any(name in {t.name for t in model.graph.initializer} for name in node.input)]
    assert weights == []
    assert sorted(p.name for p in (tmp_path / "int4").iterdir()) == sorted(p.name for p in (tmp_path / "fp32").iterdir())
    batch = prompts([5, 9])
    tokens = generate(Decoder(tmp_path / "int4", threads=1), batch, 16)
    assert [len(row) for row in tokens] == [16, 16] or any(EOS in row for row in tokens)
    fp32, int4 = (float(np.exp(token_losses(tmp_path / kind, list(TEXT)).mean())) for kind in ("fp32", "int4"))
    print(f"{family}: perplexity fp32 {fp32:.4f}, int4 {int4:.4f}")
    assert np.isfinite(int4) and 0.5 * fp32 < int4 < 2 * fp32  # random weights: both near the vocabulary's 256


def test_int4_weights_and_perplexity(tmp_path):
    """The multiplied weights' bytes at block 32: symmetric 4 bits and a float scale each 32 weights
    (5/32 of fp32's), asymmetric half a byte more a block; the output layer kept float on request."""
    fp32 = wide_llama(tmp_path)
    sizes, perplexities = {}, {"fp32": float(np.exp(token_losses(fp32, list(TEXT)).mean()))}
    for name, settings in {"symmetric": Int4(), "asymmetric": Int4(symmetric=False),
                           "float output layer": Int4(output_layer=False),
                           "block 128, level 4": Int4(block_size=128, accuracy_level=4)}.items():
        quantize_folder(fp32, tmp_path / name, settings)
        sizes[name] = weight_bytes(tmp_path / name / "model.onnx") / weight_bytes(fp32 / "model.onnx")
        perplexities[name] = float(np.exp(token_losses(tmp_path / name, list(TEXT)).mean()))
    print("weight bytes / fp32's:", {k: round(v, 4) for k, v in sizes.items()})
    print("perplexity:", {k: round(v, 4) for k, v in perplexities.items()})
    assert sizes["symmetric"] <= 0.2 and sizes["asymmetric"] <= 0.2 and sizes["block 128, level 4"] <= 0.2
    assert sizes["float output layer"] > sizes["symmetric"]
    assert all(np.isfinite(value) and value > 1 for value in perplexities.values())


def test_gemm_and_transposed_weights_become_matmulnbits_with_their_bias():
    """The other weight forms exporters write (the written and traced decoders have neither now): a
    Gemm with transB and a bias (torch's addmm, as GPT-2's Conv1D traces), and a MatMul of
    Transpose(W) (torch's Linear); each gives the same output as its dequantized weight, the bias
    added after, the Transpose gone."""
    rng = np.random.default_rng(0)
    k, hidden, n = 64, 48, 40
    arrays = {"w1": rng.normal(size=(hidden, k)).astype(np.float32), "b1": rng.normal(size=hidden).astype(np.float32),
              "w2": rng.normal(size=(n, hidden)).astype(np.float32)}
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="gemm", transB=1),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Transpose", ["w2"], ["w2_t"], perm=[1, 0]),
             helper.make_node("MatMul", ["r", "w2_t"], ["y"], name="linear")]
    graph = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])],
                              [numpy_helper.from_array(value, name) for name, value in arrays.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    assert quantize_model(model, Int4(accuracy_level=0), "two.onnx") == 2  # level 4 rounds x to int8
    assert [node.op_type for node in model.graph.node] == ["MatMulNBits", "Add", "Relu", "MatMulNBits"]
    stored = {tensor.name: numpy_helper.to_array(tensor) for tensor in model.graph.initializer}
    assert sorted(stored) == ["b1", "w1_T_Q4", "w1_T_scales", "w2_T_Q4", "w2_T_scales"]
    w1, w2 = (dequantized(stored[f"{name}_T_Q4"].reshape(rows, -1, 16), stored[f"{name}_T_scales"], None, cols)
              for name, rows, cols in (("w1", hidden, k), ("w2", n, hidden)))
    x = rng.normal(size=(3, k)).astype(np.float32)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    got = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    expected = np.maximum(x @ w1 + arrays["b1"], 0) @ w2
    assert np.allclose(got, expected, rtol=1e-4, atol=1e-4), np.abs(got - expected).max()


def test_model_without_matmul_weight_refused(tmp_path):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    with pytest.raises(ModelError) as refused:
        quantize_model(helper.make_model(graph), Int4(), "relu.onnx")
    assert str(refused.value) == ("relu.onnx: int4 quantizes the weights of MatMul and Gemm nodes, and this model "
                                  "has none")
    with pytest.raises(ConfigError, match=r"^int4 block_size 48: must be one of 16, 32, 64, 128$"):
        quantize_model(helper.make_model(graph), Int4(block_size=48), "relu.onnx")
    weight = numpy_helper.from_array(np.ones((32, 4), np.float32), "w")
    matmul = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "one",
                               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [weight])
    with pytest.raises(ModelError, match=r"^one.onnx: its one MatMul or Gemm weight is the output layer"):
        quantize_model(helper.make_model(matmul), Int4(output_layer=False), "one.onnx")
    (tmp_path / "fp32").mkdir()
    onnx.save(helper.make_model(graph), str(tmp_path / "fp32" / "model.onnx"))
    with pytest.raises(ModelError, match="has none$"):
        quantize_folder(tmp_path / "fp32", tmp_path / "int4", Int4())
    assert sorted(path.name for path in tmp_path.iterdir()) == ["fp32"]  # nothing written half


class Reader:
    """The eval reader that int4_measure reads: the windows `x` and their next tokens `y`."""
    label_name = "y"

    def __init__(self, windows: np.ndarray, labels: np.ndarray):
        self.windows, self.labels = windows, labels

    def __len__(self) -> int:
        return len(self.windows)

    def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {"x": self.windows[indices], "y": self.labels[indices]}


def text_reader(records: int, ignored: int = 0) -> Reader:
    """`records` windows of TEXT (its first bytes, shifted by a byte a record), labelled as the data stage
    labels text, the first `ignored` labels of each IGNORE_INDEX (a prompt's)."""
    ids = np.array(list(TEXT), np.int64)
    windows = np.stack([ids[start:start + 40] for start in range(records)])
    labels = np.stack([ids[start + 1:start + 41] for start in range(records)])
    labels[:, :ignored] = IGNORE_INDEX
    return Reader(windows, labels)


def export_settings(**int4) -> SimpleNamespace:
    """export's config section as int4_measure reads it."""
    return SimpleNamespace(int4=SimpleNamespace(**{**asdict(Int4()), **int4}), max_accuracy_drop=1.0,
                           gate_fails_run=False)


def test_int4_entry_measures_and_gates_both_ways(tmp_path, monkeypatch, caplog):
    """The stage's int4 step on a trained Llama: its entry has both sides' bytes, perplexity and speed,
    the folder is renamed into place; the gate passes or refuses as its numbers say, and with
    export.gate_fails_run refuses by failing, writing no folder."""
    monkeypatch.setattr(int4_measure, "SPEED_ROUNDS", 1)
    fp32 = wide_llama(tmp_path)
    target = tmp_path / "generation-int4"
    reader = text_reader(3)
    entry = int4_measure.write_int4(export_settings(), fp32, target, reader, tmp_path / "scratch")
    print({key: entry[key] for key in ("fp32", "int4", "weight_ratio", "gate")})
    assert sorted(p.name for p in target.iterdir()) == sorted(p.name for p in fp32.iterdir())
    assert entry["weight_ratio"] <= 0.2 and entry["records"] == 3 and entry["weights_quantized"] > 0
    for side in ("fp32", "int4"):
        assert entry[side]["tokens_scored"] == 3 * 39 and entry[side]["tokens_per_s"] > 0
        assert np.isfinite(entry[side]["perplexity"]) and entry[side]["perplexity"] > 1
    drop = (entry["int4"]["perplexity"] / entry["fp32"]["perplexity"] - 1) * 100
    assert entry["gate"]["drop"] == pytest.approx(drop)
    assert entry["gate"]["outcome"] == ("passed" if drop <= 1.0 else "refused")

    strict = export_settings(symmetric=False)
    strict.max_accuracy_drop = -100.0  # int4 would need a perplexity of 0
    refused = int4_measure.write_int4(strict, fp32, target, reader, tmp_path / "scratch")
    assert refused["gate"]["outcome"] == "refused" and refused["settings"]["symmetric"] is False
    assert ("the int4 model is refused (metrics.json: gate outcome refused): deploy the fp32 model "
            f"{fp32} (try export.int4.block_size: 16; export.int4.output_layer: false; a larger "
            "export.max_accuracy_drop; or export.int4: null)") in caplog.text
    strict.gate_fails_run = True
    shutil.rmtree(target)
    with pytest.raises(QualityGateError, match="; no int4 model is written and the fp32 model"):
        int4_measure.write_int4(strict, fp32, target, reader, tmp_path / "scratch")
    assert not target.exists()


def test_int4_perplexity_scores_only_the_labelled_tokens(tmp_path):
    """IGNORE_INDEX labels (a prompt, padding) are left out of the perplexity, and a window longer than
    the model's positions is cut to them; the entry of a folder is the mean over what is scored."""
    source, _ = tiny("llama", tmp_path)
    generation_folder.export_folder(source, tmp_path / "fp32")
    decoder = Decoder(tmp_path / "fp32", threads=1)
    reader = text_reader(2, ignored=10)
    value, scored = int4_measure.perplexity(decoder, reader.windows, reader.labels)
    assert scored == 2 * 29
    expected = np.concatenate([token_losses(tmp_path / "fp32", row.tolist())[10:] for row in reader.windows])
    assert value == pytest.approx(float(np.exp(expected.mean())), rel=1e-9)
    windows = np.concatenate([reader.windows] * 4, 1)  # 160 tokens, the model has 128 positions
    labels = np.concatenate([reader.labels] * 4, 1)
    # the first 127 labels of each row, less the 10 + 10 + 10 + 7 IGNORE_INDEX of its four copies
    assert int4_measure.perplexity(decoder, windows, labels)[1] == 2 * (127 - 37)


def test_int4_without_a_generation_folder_is_one_line(tmp_path):
    with pytest.raises(MissingInputError) as refused:
        int4_measure.write_int4(export_settings(), tmp_path / "generation", tmp_path / "generation-int4",
                                text_reader(1), tmp_path)
    assert str(refused.value) == (f"export.int4: {tmp_path / 'generation'} is no generation folder (export_model "
                                  "writes it for a model.kind gpt or transformers causal-lm); set export.int4: "
                                  "null for this model")


def test_int4_remedies_name_only_settings_not_set():
    assert int4_measure.remedies(Int4(block_size=16, symmetric=False, output_layer=False)) == [
        "a larger export.max_accuracy_drop", "or export.int4: null"]
    assert int4_measure.remedies(Int4())[:3] == ["export.int4.block_size: 16", "export.int4.symmetric: false",
                                                 "export.int4.output_layer: false"]


def test_summary_line_of_int4(tmp_path):
    entry = Int4Entry({}, 24, 8, {"perplexity": 12.3456}, {"perplexity": 12.5}, 0.1563,
                      Gate("perplexity", 1.251, "%", 1.0, "refused"))
    folder = tmp_path / "generation-int4"
    assert int4_line(entry, folder) == (f"  int4      {folder}: weights 0.16x fp32's, perplexity 12.5000 (fp32 "
                                        "12.3456), refused by the gate, +1.25% perplexity "
                                        "(export.max_accuracy_drop: 1): deploy the fp32 folder")
    entry = dataclasses.replace(entry, gate=dataclasses.replace(entry.gate, outcome="passed"))
    assert int4_line(entry, folder).endswith("(fp32 12.3456), passed the gate")

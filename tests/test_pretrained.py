"""Pretrained weights, kept bit for bit: a torch wrapper that calls from_pretrained
on a local folder (GPT-2, BERT under a new head), `model.weights` from a
safetensors file (the built-in mlp, an ONNX file) or from an earlier run's merged
checkpoint (chained in one snakemake call), `model.frozen` and `model.trainable`
as patterns, and each refusal by its message. The pretrained folders are made
here with save_pretrained: nothing is downloaded."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import load_file, save_file

from conftest import run_snakemake
from ortflow.stages import build_artifacts
from ortflow import cli, config as config_mod
from ortflow.artifacts import Artifacts
from ortflow.checkpoints.ort_format import read_ort_checkpoint
from ortflow.errors import ConfigError, ModelError
from ortflow.stages.prepare_data import prepare
from transformers_models import save_bert, save_gpt2

TESTS = Path(__file__).resolve().parent
HIDDEN = 16
MLP_SHAPES = {"layers.0.weight": (HIDDEN, 64), "layers.0.bias": (HIDDEN,), "layers.2.weight": (10, HIDDEN),
              "layers.2.bias": (10,)}
CLASSES = 3


def validated(model: dict, data: dict | None = None, seed: int = 7) -> config_mod.Config:
    return config_mod.load(overrides={"run": {"seed": seed}, "data": data or {}, "model": model})


def bits(array: np.ndarray) -> tuple:
    """What "bit for bit" compares: dtype, shape and bytes."""
    return array.dtype, array.shape, np.ascontiguousarray(array).tobytes()


def checkpoint_of(folder: Path):
    return read_ort_checkpoint(Artifacts(folder).checkpoint)


def token_classes(path: Path, n: int = 200, length: int = 12) -> None:
    """Token ids, padded (id 0, attention mask 0) after a random length, and
    CLASSES labels (what the classes are does not matter here)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(2, 32, size=(n, length))
    lengths = rng.integers(length // 2, length + 1, n)
    mask = np.arange(length)[None, :] < lengths[:, None]
    np.savez(path, input_ids=np.where(mask, ids, 0).astype(np.int64), attention_mask=mask.astype(np.int64),
             y=rng.integers(0, CLASSES, n).astype(np.int64))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """Train splits: the digits, and a small text in windows of 16 bytes."""
    root = tmp_path_factory.mktemp("data")
    (root / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    sources = {"digits": {}, "text": {"source": str(root / "corpus.txt"), "context": 16}}
    for name, source in sources.items():
        prepare(validated({}, source), root / name / "train", root / name / "eval")
    return {name: root / name / "train" for name in sources}


def random_mlp_weights(path: Path, names=MLP_SHAPES, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    weights = {name: rng.normal(size=names[name]).astype(np.float32) for name in names}
    save_file(weights, str(path))
    return weights


def build_mlp(data, out: Path, **model) -> dict:
    return build_artifacts.build(validated({"kind": "mlp", "hidden": [HIDDEN], **model}), data["digits"], out)


def test_safetensors_into_the_builtin_mlp_bit_for_bit(data, tmp_path):
    weights = random_mlp_weights(tmp_path / "mlp.safetensors")
    build_mlp(data, tmp_path / "out", weights=str(tmp_path / "mlp.safetensors"))
    parameters = checkpoint_of(tmp_path / "out").parameters
    assert sorted(parameters) == sorted(weights)
    for name, array in weights.items():
        assert bits(parameters[name]) == bits(array), name


def test_a_new_head_keeps_its_initial_values_from_the_seed(data, tmp_path):
    """Weights without the head (layers.2), skipped by pattern: the body is the
    file's, the head is what the same seed gives without weights; another seed, another head."""
    body = {name: shape for name, shape in MLP_SHAPES.items() if name.startswith("layers.0")}
    weights = random_mlp_weights(tmp_path / "body.safetensors", body)
    build_mlp(data, tmp_path / "loaded", weights=str(tmp_path / "body.safetensors"), weights_skip=["layers.2"])
    build_mlp(data, tmp_path / "seeded")
    build_artifacts.build(validated({"kind": "mlp", "hidden": [HIDDEN]}, seed=8), data["digits"], tmp_path / "other")
    loaded, seeded, other = (checkpoint_of(tmp_path / name).parameters for name in ("loaded", "seeded", "other"))
    for name in body:
        assert bits(loaded[name]) == bits(weights[name]), name
    for name in ("layers.2.weight", "layers.2.bias"):
        assert bits(loaded[name]) == bits(seeded[name]), name
        assert not np.array_equal(loaded[name], other[name]), name


def test_names_and_shapes_are_matched_strictly_in_one_message(data, tmp_path):
    """Missing, unexpected and mis-shaped names, each with its count and the
    first few, in one line, with model.weights_skip named as the way out."""
    rng = np.random.default_rng(0)
    weights = {"layers.0.weight": rng.normal(size=(HIDDEN, 63)).astype(np.float32),  # 63: mis-shaped
               "layers.0.bias": rng.normal(size=HIDDEN).astype(np.float32)}
    weights |= {f"encoder.{i}.weight": np.zeros(2, np.float32) for i in range(7)}  # unexpected
    save_file(weights, str(tmp_path / "w.safetensors"))
    with pytest.raises(ModelError) as error:
        build_mlp(data, tmp_path / "out", weights=str(tmp_path / "w.safetensors"))
    message = str(error.value)
    assert "\n" not in message
    assert message == (
        f"model.weights: {tmp_path}/w.safetensors does not fit the model: "
        "2 missing: layers.2.weight, layers.2.bias; "
        "7 unexpected: encoder.0.weight, encoder.1.weight, encoder.2.weight, encoder.3.weight, encoder.4.weight, "
        "... (2 more); "
        "1 mismatched: layers.0.weight (weights float32 [16, 63], model float32 [16, 64]); "
        "leave names out with model.weights_skip (name patterns, e.g. ['head']): the model's then keep their "
        "initial values from run.seed"
    )
    assert not (tmp_path / "out").exists()
    # Skipping the unexpected and mis-shaped names leaves the missing ones, and suggests their module.
    with pytest.raises(ModelError, match=r"^model.weights: .* 2 missing: layers.2.weight, layers.2.bias; leave names "
                                         r"out with model.weights_skip \(name patterns, e.g. \['layers.2'\]\)"):
        build_mlp(data, tmp_path / "out", weights=str(tmp_path / "w.safetensors"),
                  weights_skip=["encoder.*", "layers.0.weight"])


def test_a_skip_pattern_must_match_a_name(data, tmp_path):
    random_mlp_weights(tmp_path / "mlp.safetensors")
    with pytest.raises(ModelError, match=rf"^model.weights_skip: 'classifier' matches no name of the model or of "
                                         rf"{tmp_path}/mlp.safetensors$"):
        build_mlp(data, tmp_path / "out", weights=str(tmp_path / "mlp.safetensors"),
                  weights_skip=["layers.2", "classifier"])


def test_half_precision_weights_widen_exactly_and_float64_is_refused(data, tmp_path):
    """float16 and bfloat16 (which numpy lacks: read through torch) become the
    model's float32 without rounding; float64 would round, and is refused."""
    import safetensors.torch

    weights = random_mlp_weights(tmp_path / "w.safetensors")
    save_file({k: v.astype(np.float16) for k, v in weights.items()}, str(tmp_path / "half.safetensors"))
    brain = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in weights.items()}
    safetensors.torch.save_file(brain, str(tmp_path / "brain.safetensors"))
    build_mlp(data, tmp_path / "half", weights=str(tmp_path / "half.safetensors"))
    build_mlp(data, tmp_path / "brain", weights=str(tmp_path / "brain.safetensors"))
    half, brain_loaded = checkpoint_of(tmp_path / "half").parameters, checkpoint_of(tmp_path / "brain").parameters
    for name, array in weights.items():
        assert bits(half[name]) == bits(array.astype(np.float16).astype(np.float32)), name
        assert bits(brain_loaded[name]) == bits(brain[name].float().numpy()), name
        assert not np.array_equal(brain_loaded[name], array), name  # bfloat16 did round the file's values
    save_file({k: v.astype(np.float64) for k, v in weights.items()}, str(tmp_path / "double.safetensors"))
    with pytest.raises(ModelError, match=r"4 mismatched: layers.0.bias \(weights float64 \[16\], model float32 \[16\]\), "
                                         r"layers.0.weight \(weights float64 \[16, 64\], model float32 \[16, 64\]\)"):
        build_mlp(data, tmp_path / "double", weights=str(tmp_path / "double.safetensors"))


def linear_onnx(path: Path) -> dict[str, np.ndarray]:
    """x [n, 64] -> MatMul(weight) + bias -> [n, 10], as an ONNX file; returns its initializers."""
    rng = np.random.default_rng(1)
    initial = {"weight": rng.normal(0, 0.1, (64, 10)).astype(np.float32), "bias": np.zeros(10, np.float32)}
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "weight"], ["scores"]), helper.make_node("Add", ["scores", "bias"], ["out"])],
        "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", 10])],
        [numpy_helper.from_array(array, name) for name, array in initial.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return initial


def test_safetensors_into_an_onnx_model_bit_for_bit(data, tmp_path):
    linear_onnx(tmp_path / "linear.onnx")
    rng = np.random.default_rng(2)
    weights = {"weight": rng.normal(size=(64, 10)).astype(np.float32), "bias": rng.normal(size=10).astype(np.float32)}
    save_file(weights, str(tmp_path / "linear.safetensors"))
    model = {"kind": "onnx", "path": str(tmp_path / "linear.onnx"), "weights": str(tmp_path / "linear.safetensors")}
    build_artifacts.build(validated(model), data["digits"], tmp_path / "out")
    parameters = checkpoint_of(tmp_path / "out").parameters
    for name, array in weights.items():
        assert bits(parameters[name]) == bits(array), name
    base = onnx.load(str(Artifacts(tmp_path / "out").base_model))
    assert {t.name: bits(numpy_helper.to_array(t)) for t in base.graph.initializer} == {
        name: bits(array) for name, array in weights.items()}


def test_pickle_files_are_refused_with_the_conversion(data, tmp_path):
    """The file is never opened (its content would run as it unpickles); the
    message's command converts it (run here on a state_dict that torch.save wrote,
    once: the commands of the 4 suffixes differ by the file's name alone)."""
    commands = {}
    for suffix in (".bin", ".pt", ".pth", ".ckpt"):
        pickled = tmp_path / f"model{suffix}"
        torch.save({name: torch.from_numpy(np.full(shape, 0.5, np.float32)) for name, shape in MLP_SHAPES.items()},
                   pickled)
        with pytest.raises(ModelError) as error:
            build_mlp(data, tmp_path / "out", weights=str(pickled))
        message = str(error.value)
        assert message.startswith(f"model.weights: {pickled} is a pickle file (torch.save), and loading one could run "
                                  "code; convert it once, where you trust it, to safetensors: python -c ")
        commands[suffix] = message.split("to safetensors: ", 1)[1]
        assert pickled.name in commands[suffix]
    assert {command.replace(f"model{suffix}", "model.bin") for suffix, command in commands.items()} == \
        {commands[".bin"]}
    subprocess.run(commands[".ckpt"], shell=True, check=True, cwd=tmp_path)
    converted = load_file(str(tmp_path / "model.safetensors"))
    assert {name: array.shape for name, array in converted.items()} == MLP_SHAPES


def crafted_safetensors(path: Path, header: bytes, length: int | None = None, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


def test_a_hostile_safetensors_header_is_refused_before_any_allocation(tmp_path):
    """Read under a 1.5 GB address-space limit (an allocation of what the header
    claims would fail with MemoryError): a header that claims a 40 GB tensor in a
    16-byte file is refused by the file's size, a header length of 2**62 and a text
    file (whose first 8 bytes make a huge length) as too large."""
    claims = json.dumps({"w": {"dtype": "F32", "shape": [100000, 100000], "data_offsets": [0, 40_000_000_000]}})
    cases = {
        "huge": crafted_safetensors(tmp_path / "huge.safetensors", claims.encode(), data=b"\0" * 16),
        "length": crafted_safetensors(tmp_path / "length.safetensors", b"{}", length=2**62),
        "text": tmp_path / "text.safetensors",
    }
    cases["text"].write_text("not a safetensors file")
    code = (
        "import resource, sys\n"
        "from ortflow.models import weights\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20))\n"
        "try:\n"
        "    weights.read(sys.argv[1])\n"
        "except weights.ModelError as error:\n"
        "    print(error)\n"
    )
    for name, path in cases.items():
        result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert result.returncode == 0, result.stderr[-2000:]
        expected = {"huge": "incomplete metadata, file not fully covered", "length": "header too large",
                    "text": "header too large"}[name]
        assert result.stdout.strip() == (f"model.weights: {path} is not a readable safetensors file (Error while "
                                         f"deserializing header: {expected})"), result.stdout


def test_other_sources_are_refused_by_their_message(data, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.npz").write_bytes(b"")
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "checkpoint").write_bytes(b"\0" * 64)
    cases = {
        str(tmp_path / "absent.safetensors"): "does not exist (a .safetensors file, or a run's "
                                              "results/<run>/checkpoint folder)",
        str(tmp_path / "empty"): "is a folder without a merged checkpoint file 'checkpoint'; name an ortflow run's "
                                 "results/<run>/checkpoint, or a .safetensors file (in a transformers folder: "
                                 "model.safetensors)",
        str(tmp_path / "weights.npz"): "is neither a .safetensors file nor a merged checkpoint folder "
                                       "(results/<run>/checkpoint)",
        str(tmp_path / "checkpoint"): "/checkpoint: not an ONNX Runtime checkpoint (no ODTC identifier)",
    }
    for path, expected in cases.items():
        with pytest.raises(ModelError) as error:
            build_mlp(data, tmp_path / "out", weights=path)
        assert str(error.value).startswith(f"model.weights: {path}") and str(error.value).endswith(expected), error.value


def test_the_command_prints_one_line(data, tmp_path, monkeypatch, capsys):
    """`ortflow build-artifacts` (cli.main, which the console script calls, here in this process) in the
    folder the config names the file from: exit code 1 and one line, no traceback."""
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"model": {"kind": "mlp", "weights": "pretrained.pth"}}))
    monkeypatch.chdir(tmp_path)
    code = cli.main(["build-artifacts", "--config", str(config), "--train", str(data["digits"]),
                     "--out", str(tmp_path / "out")])
    stderr = capsys.readouterr().err
    assert code == 1 and "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith(
        "ortflow build-artifacts: error: model.weights: pretrained.pth is a pickle file"), stderr


def test_frozen_and_trainable_take_patterns(data, tmp_path):
    def split(**model) -> tuple[list[str], list[str]]:
        description = build_mlp(data, tmp_path / "out", **model)
        return list(description.trainable), list(description.frozen)

    assert split(frozen=["<1d>"]) == (["layers.0.weight", "layers.2.weight"], ["layers.0.bias", "layers.2.bias"])
    assert split(frozen=["LAYERS.0"]) == (["layers.2.weight", "layers.2.bias"], ["layers.0.weight", "layers.0.bias"])
    assert split(trainable=["layers.[2]"], frozen=["bias"]) == (
        ["layers.2.weight"], ["layers.0.weight", "layers.0.bias", "layers.2.bias"])
    with pytest.raises(ModelError, match=r"^model.frozen: 'head\.\*' matches none of the model's parameters: "
                                         r"layers.0.bias, layers.0.weight, layers.2.bias, layers.2.weight \(4 in all"):
        split(frozen=["<1d>", "head.*"])
    with pytest.raises(ModelError, match=r"^model: no parameter is left to train"):
        split(frozen=["layers"])


def test_a_pattern_leaves_batchnorm_statistics_out_of_the_trainable(data, tmp_path, monkeypatch):
    """`body.1` picks the BatchNorm's scale and shift, not its running statistics (no gradient)."""
    monkeypatch.syspath_prepend(str(TESTS))
    model = {"kind": "torch", "path": "batchnorm_models:BatchNormMLP", "trainable": ["body.1"], "frozen": ["bias"]}
    description = build_artifacts.build(validated(model), data["digits"], tmp_path / "out")
    assert list(description.trainable) == ["body.1.weight"]
    assert sorted(description.running_stats.values()) == ["body.1.running_mean", "body.1.running_var"]


def test_a_weights_folder_counts_by_content_in_the_training_identity(tmp_path, monkeypatch):
    """Resuming is refused when the earlier run's checkpoint changed under the same path."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "results/pre/checkpoint"
    folder.mkdir(parents=True)
    (folder / "checkpoint").write_bytes(b"first")
    config = config_mod.load(overrides={"run": {"name": "fine"}, "model": {"weights": "results/pre/checkpoint"}})
    first = config_mod.training_identity(config)
    assert first["model"]["weights"].startswith("sha256-folder:")
    (folder / "checkpoint").write_bytes(b"second")
    assert config_mod.training_identity(config)["model"]["weights"] != first["model"]["weights"]


def test_config_refusals_of_the_weights_keys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^config key 'model.weights_skip': set without model.weights"):
        validated({"weights_skip": ["head"]})
    (tmp_path / "pre.yaml").write_text("run: {name: pre}\n")

    def earlier(**model):
        return config_mod.earlier_run(config_mod.load(overrides={"run": {"name": "fine"}, "model": model}))

    assert earlier(weights="results/pre/checkpoint", weights_config="pre.yaml")["run"]["name"] == "pre"
    with pytest.raises(ConfigError, match=r"^config key 'model.weights_config': pre.yaml is run 'pre', whose merged "
                                          r"checkpoint is results/pre/checkpoint, but model.weights is "
                                          r"results/other/checkpoint; set model.weights: results/pre/checkpoint$"):
        earlier(weights="results/other/checkpoint", weights_config="pre.yaml")
    with pytest.raises(ConfigError, match=r"^config key 'model.weights': results/fine/checkpoint is an output of this "
                                          r"run \('fine'\)"):
        earlier(weights="results/fine/checkpoint")
    with pytest.raises(ConfigError, match=r"^config key 'model.weights': results/pre/checkpoint does not exist yet; "
                                          r"make it first with run 'pre''s config"):
        earlier(weights="results/pre/checkpoint")
    (tmp_path / "results/pre/checkpoint").mkdir(parents=True)
    assert earlier(weights="results/pre/checkpoint") is None


def test_gpt2_from_pretrained_folder_bit_for_bit(data, tmp_path, monkeypatch):
    """The wrapper's from_pretrained folder is the initial checkpoint, name for
    name under the wrapper's `model.` (the tied lm_head is the embedding)."""
    folder = save_gpt2(tmp_path / "gpt2")
    monkeypatch.syspath_prepend(str(TESTS))
    model = {"kind": "torch", "path": "transformers_models:PretrainedGPT2", "kwargs": {"folder": str(folder)}}
    build_artifacts.build(validated(model, {"source": "text", "context": 16}), data["text"], tmp_path / "out")
    pretrained = load_file(str(folder / "model.safetensors"))
    parameters = checkpoint_of(tmp_path / "out").parameters
    assert sorted(parameters) == sorted(f"model.{name}" for name in pretrained)
    for name, array in pretrained.items():
        assert bits(parameters[f"model.{name}"]) == bits(array), name


def test_safetensors_into_a_torch_module_with_a_tied_head(data, tmp_path, monkeypatch):
    """model.weights into a user torch module (the randomly initialised GPT-2
    wrapper) by its state_dict names: the tied lm_head is given by the embedding's
    name alone, as save_pretrained writes it; two different values for the one
    tensor are refused."""
    folder = save_gpt2(tmp_path / "gpt2")
    pretrained = {f"model.{name}": array for name, array in load_file(str(folder / "model.safetensors")).items()}
    save_file(pretrained, str(tmp_path / "gpt2.safetensors"))
    monkeypatch.syspath_prepend(str(TESTS))
    model = {"kind": "torch", "path": "transformers_models:GPT2",
             "kwargs": {"n_embd": 32, "context": 16}, "weights": str(tmp_path / "gpt2.safetensors")}
    text = {"source": "text", "context": 16}
    build_artifacts.build(validated(model, text), data["text"], tmp_path / "out")
    parameters = checkpoint_of(tmp_path / "out").parameters
    assert "model.lm_head.weight" not in pretrained and sorted(parameters) == sorted(pretrained)
    for name, array in pretrained.items():
        assert bits(parameters[name]) == bits(array), name

    head = pretrained["model.transformer.wte.weight"] + 1
    save_file({**pretrained, "model.lm_head.weight": head}, str(tmp_path / "untied.safetensors"))
    with pytest.raises(ModelError, match=r"^model.weights: .*untied.safetensors gives model.transformer.wte.weight, "
                                         r"model.lm_head.weight different values, but they are one tensor of the "
                                         r"model \(tied\)"):
        build_artifacts.build(validated({**model, "weights": str(tmp_path / "untied.safetensors")}, text),
                              data["text"], tmp_path / "untied")


def test_a_folders_own_weights_under_a_wrappers_prefix(tmp_path, monkeypatch, caplog):
    """A BERT folder's own model.safetensors (names `embeddings.*`, ...) into a
    wrapper that builds the encoder from the folder's config as `self.model` under a
    new head (names `model.embeddings.*`, `head.*`): the refusal names the prefix and
    lists only the head, not every name; with the head skipped the prefix is found by
    suffix (the log says which), or set as model.weights_prefix: bit for bit either way."""
    folder = save_bert(tmp_path / "bert")
    token_classes(tmp_path / "tokens.npz")
    data = {"source": str(tmp_path / "tokens.npz"), "features": ["input_ids", "attention_mask"]}
    prepare(validated({}, data), tmp_path / "data/train", tmp_path / "data/eval")
    monkeypatch.syspath_prepend(str(TESTS))
    weights = str(folder / "model.safetensors")
    wrapper = {"kind": "torch", "path": "transformers_models:EncoderWithHead",
               "kwargs": {"folder": str(folder), "classes": CLASSES}, "weights": weights}

    def build(out: str, **model):
        return build_artifacts.build(validated({**wrapper, **model}, data), tmp_path / "data/train", tmp_path / out)

    with pytest.raises(ModelError) as error:
        build("refused")
    assert str(error.value) == (
        f"model.weights: {weights} does not fit the model: its names lack the model's prefix 'model.' (set "
        "model.weights_prefix: 'model.', or leave the prefix to matching by suffix once the rest fits); with it "
        "added, 2 missing: head.weight, head.bias; leave names out with model.weights_skip (name patterns, e.g. "
        "['head']): the model's then keep their initial values from run.seed")

    pretrained = load_file(weights)
    caplog.set_level("INFO", logger="ortflow.build_artifacts")
    for out, model in {"suffix": {"weights_skip": ["head"]},
                       "prefix": {"weights_skip": ["head"], "weights_prefix": "model."}}.items():
        caplog.clear()
        build(out, **model)
        parameters = checkpoint_of(tmp_path / out).parameters
        assert sorted(parameters) == sorted([*(f"model.{name}" for name in pretrained), "head.weight", "head.bias"])
        for name, array in pretrained.items():
            assert bits(parameters[f"model.{name}"]) == bits(array), (out, name)
        how = "as model.weights_prefix says" if "weights_prefix" in model else (
            "the one prefix that makes them the model's (matched by suffix; model.weights_prefix sets it)")
        assert f"model.weights: the prefix 'model.' added to the names of {weights}, {how}" in caplog.messages
    with pytest.raises(ModelError, match=rf"^model.weights_prefix: 'bert.', added to or removed from the names of "
                                         rf"{weights}, makes none of them a name of the model$"):
        build("wrong", weights_skip=["head"], weights_prefix="bert.")


def test_a_prefix_the_model_lacks_is_removed(data, tmp_path, caplog):
    """The built-in mlp (names `layers.*`) from weights saved under a wrapper's
    `transformer.`: removed by suffix matching, or by model.weights_prefix; a prefix
    without the final dot is refused by the schema."""
    weights = random_mlp_weights(tmp_path / "mlp.safetensors")
    save_file({f"transformer.{name}": array for name, array in weights.items()}, str(tmp_path / "wrapped.safetensors"))
    caplog.set_level("INFO", logger="ortflow.build_artifacts")
    for out, prefix in (("suffix", None), ("prefix", "transformer.")):
        build_mlp(data, tmp_path / out, weights=str(tmp_path / "wrapped.safetensors"), weights_prefix=prefix)
        parameters = checkpoint_of(tmp_path / out).parameters
        assert {name: bits(array) for name, array in parameters.items()} == {
            name: bits(array) for name, array in weights.items()}
    assert any(message.startswith("model.weights: the prefix 'transformer.' removed from the names of")
               for message in caplog.messages), caplog.messages
    with pytest.raises(ConfigError, match=r"model.weights_prefix.*a prefix of names ending with '.', such as 'model.'"):
        validated({"weights": "w.safetensors", "weights_prefix": "transformer"})


BERT_HEAD = ["model.classifier.weight", "model.classifier.bias"]


@pytest.mark.e2e
def test_bert_with_a_new_head_frozen_encoder_through_the_workflow(tmp_path, monkeypatch):
    """BERT's encoder from a folder under a new 3-class head, the encoder frozen by
    pattern (model.frozen: [model.bert]), 4 steps through snakemake: at step 0 the
    encoder is the folder's bit for bit and frozen; after training it is still the
    folder's, the head moved, and the optimizer holds moments for the head alone.
    The head comes from run.seed: a build with the same seed gives the same head,
    another seed another head."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    folder = save_bert(tmp_path / "bert")
    token_classes(workdir / "tokens.npz")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    model = {"kind": "torch", "path": "transformers_models:PretrainedBert",
             "kwargs": {"folder": str(folder), "classes": CLASSES}, "frozen": ["model.bert"]}
    config = {
        "run": {"name": "bert", "seed": 5},
        "data": {"source": "tokens.npz", "features": ["input_ids", "attention_mask"], "shards": 1},
        "model": model,
        "train": {"world_size": 1, "steps": 4, "micro_batch_size": 16, "log_every": 1, "eval_every": 4,
                  "optimizer": {"lr": 0.01}},
    }
    run_snakemake(workdir, config, "merge_checkpoint")
    results = workdir / "results/bert"
    pretrained = {f"model.bert.{name}": array for name, array in load_file(str(folder / "model.safetensors")).items()}
    initial = checkpoint_of(results / "artifacts")
    assert sorted(initial.parameters) == sorted([*pretrained, *BERT_HEAD])
    for name, array in pretrained.items():
        assert bits(initial.parameters[name]) == bits(array), name
        assert not initial.requires_grad[name], name
    assert initial.parameters["model.classifier.weight"].shape == (CLASSES, 32)
    assert initial.optimizer_states == {}  # ORT creates the moments at the first step, for the trainable ones
    assert json.loads((results / "artifacts/model.json").read_text())["trainable"] == BERT_HEAD

    trained = read_ort_checkpoint(results / "checkpoint/checkpoint")
    assert json.loads((results / "checkpoint/meta.json").read_text())["step"] == 4
    for name, array in pretrained.items():
        assert bits(trained.parameters[name]) == bits(array), name
    assert sorted(trained.optimizer_states) == sorted(BERT_HEAD)
    assert sorted(trained.optimizer_states["model.classifier.weight"]) == ["momentum0", "momentum1"]
    assert not any(trained.requires_grad[name] for name in pretrained)
    for name in BERT_HEAD:
        assert not np.array_equal(trained.parameters[name], initial.parameters[name]), name

    monkeypatch.syspath_prepend(str(TESTS))
    for seed, same in ((5, True), (6, False)):
        out = tmp_path / f"seed{seed}"
        build_artifacts.build(config_mod.load(overrides={**config, "run": {"seed": seed}}), results / "data/train", out)
        head = checkpoint_of(out).parameters
        assert (bits(head["model.classifier.weight"]) == bits(initial.parameters["model.classifier.weight"])) == same
        assert bits(head["model.classifier.bias"]) == bits(initial.parameters["model.classifier.bias"])  # zeros


@pytest.mark.e2e
def test_pretrain_on_text_then_fine_tune_on_labels_in_one_snakemake_call(tmp_path, monkeypatch):
    """Run `pre` trains a bigram language model on text; run `fine` names pre's
    merged checkpoint and its config, and fine-tunes the embedding under a
    2-class head (TokenBag) on token ids, the heads left out by one pattern
    (`head`: pre's lm_head, fine's head). One snakemake call for fine runs pre's
    stages up to merge_checkpoint first; fine starts from pre's trained embedding
    bit for bit, and its head is the one run.seed gives without weights."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    (workdir / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (200, 12))
    np.savez(workdir / "tokens.npz", ids=ids, y=(ids < 128).sum(1) % 2)
    train = {"world_size": 1, "steps": 3, "log_every": 1, "eval_every": 3, "checkpoint_every": 3}
    (workdir / "pre.yaml").write_text(json.dumps({
        "run": {"name": "pre"}, "data": {"source": "text", "text_path": "corpus.txt", "context": 12, "shards": 1},
        "model": {"kind": "torch", "path": "artifacts_user_model:TokenLM"}, "train": train}))
    bag = {"kind": "torch", "path": "artifacts_user_model:TokenBag", "kwargs": {"vocab": 256}}
    fine = {"run": {"name": "fine"}, "data": {"source": "tokens.npz", "features": ["ids"], "shards": 1}, "train": train,
            "model": {**bag, "weights": "results/pre/checkpoint", "weights_config": "pre.yaml",
                      "weights_skip": ["head"]}}
    result = run_snakemake(workdir, fine, "merge_checkpoint")
    for job in ("earlier_prepare_data", "earlier_build_artifacts", "earlier_train", "earlier_merge_checkpoint",
                "build_artifacts", "train", "merge_checkpoint"):
        assert f"rule {job}:" in result.stdout + result.stderr, job
    assert json.loads((workdir / "results/pre/checkpoint/meta.json").read_text())["step"] == 3
    pretrained = read_ort_checkpoint(workdir / "results/pre/checkpoint/checkpoint").parameters
    assert sorted(pretrained) == ["embed.weight", "lm_head.bias", "lm_head.weight"]
    initial = checkpoint_of(workdir / "results/fine/artifacts").parameters
    assert bits(initial["embed.weight"]) == bits(pretrained["embed.weight"])
    monkeypatch.syspath_prepend(str(TESTS))
    seeded = build_artifacts.build(config_mod.load(overrides={**fine, "model": bag}), workdir / "results/fine/data/train",
                                   tmp_path / "seeded")
    assert seeded.trainable == ("embed.weight", "head.weight", "head.bias")
    for name in ("head.weight", "head.bias"):
        assert bits(initial[name]) == bits(checkpoint_of(tmp_path / "seeded").parameters[name]), name
    log = (workdir / "logs/fine/build_artifacts.log").read_text()
    assert "model.weights: 1 tensor(s) (2048 values) loaded from results/pre/checkpoint; 2 keep their initial " \
           "values (model.weights_skip): head.weight, head.bias" in log, log
    assert json.loads((workdir / "results/fine/checkpoint/meta.json").read_text())["step"] == 3
    dry = run_snakemake(workdir, fine, "merge_checkpoint", "-n")
    assert "Nothing to be done" in dry.stdout + dry.stderr


@pytest.mark.e2e
def test_fine_tuning_equals_torch_step_for_step(tmp_path):
    """BERT's encoder from a folder under a new head, all of it fine-tuned for 8
    SGD steps through ortflow's stage commands and in PyTorch from the same
    loaded model (tests/torch_reference.py), dropout off: the losses and the final
    weights agree within the layer tests' tolerances (tests/test_torch_layers.py;
    measured 2.4e-7 and 7.5e-9, the encoder's weights moved by up to 3.2e-3).
    SGD (lr 0.1), as those tests: AdamW would move the attention's key biases,
    whose gradient is zero but for rounding, in directions the CPU's summation
    order decides."""
    from test_torch_layers import LOSS_TOLERANCE, PARAMETER_TOLERANCE, largest, run_ortflow
    from torch_reference import load_initial, train_like_ortflow
    from transformers_models import PretrainedBert

    folder = save_bert(tmp_path / "bert", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    token_classes(tmp_path / "tokens.npz")
    config = config_mod.load(overrides={
        "run": {"name": "fine", "seed": 3},
        "data": {"source": str(tmp_path / "tokens.npz"), "features": ["input_ids", "attention_mask"], "shards": 1},
        "model": {"kind": "torch", "path": "transformers_models:PretrainedBert",
                  "kwargs": {"folder": str(folder), "classes": CLASSES}},
        "train": {"world_size": 1, "micro_batch_size": 16, "steps": 8, "log_every": 1, "eval_every": 8,
                  "checkpoint_every": 8, "optimizer": {"name": "sgd", "lr": 0.1, "weight_decay": 0.0},
                  "lr_schedule": {"name": "cosine", "warmup_steps": 2}},
    })
    prepare(config, tmp_path / "data/train", tmp_path / "data/eval")
    run_ortflow(config, tmp_path / "data", tmp_path)
    losses = [entry["loss"] for entry in json.loads((tmp_path / "train/metrics.json").read_text())["history"]["train"]]
    trained = dict(read_ort_checkpoint(tmp_path / "checkpoint/checkpoint").parameters)

    initial = load_initial(PretrainedBert(str(folder), CLASSES), tmp_path / "artifacts")
    torch_losses, torch_trained = train_like_ortflow(initial, config, tmp_path / "data/train")
    assert len(losses) == len(torch_losses) == 8
    worst = {name: largest(trained[name], torch_trained[name]) for name in trained}
    print(f"pretrained BERT: loss {largest(losses, torch_losses):.2g}, parameters {max(worst.values()):.2g} "
          f"({max(worst, key=worst.get)})")
    assert largest(losses, torch_losses) <= LOSS_TOLERANCE, (losses, torch_losses)
    assert max(worst.values()) <= PARAMETER_TOLERANCE, worst
    assert max(largest(trained[name], load_file(str(folder / "model.safetensors"))[name[len("model.bert."):]])
               for name in worst if name.startswith("model.bert.")) > 100 * PARAMETER_TOLERANCE  # the encoder trained


@pytest.mark.e2e
def test_workflow_refuses_linked_weights(tmp_path):
    """model.weights linked to /etc/passwd stops Snakemake before any job, in one line
    that says it is a link and where it points (it was hashed and parsed as safetensors)."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "model.safetensors").symlink_to("/etc/passwd")
    result = run_snakemake(workdir, {"model": {"weights": "model.safetensors"}}, check=False)
    assert result.returncode == 1
    assert ("model.weights: model.safetensors is a symbolic link to /etc/passwd; what it reads must be a regular "
            "file where the config names it") in result.stderr
    assert "Traceback" not in result.stderr and "header too large" not in result.stderr
    assert not (workdir / "results").exists()


def test_a_module_built_on_the_meta_device_takes_the_arrays_themselves(tmp_path):
    """export_model's gpt (export/formats.trained_torch_module): built on the meta device, each
    parameter takes the loaded array's memory (not copied into allocated ones), a tied head stays
    one Parameter with the embedding, the module computes as the source does; one left unset is
    refused."""
    from ortflow.models.gpt import GPT
    from ortflow.models.weights import Request, load_into_module

    torch.manual_seed(0)
    source = GPT(vocab=11, context=6, width=8, heads=2, layers=1, tied=True)
    save_file({name: tensor.detach().numpy() for name, tensor in source.state_dict().items()
               if name != "head.weight"}, str(tmp_path / "gpt.safetensors"))
    with torch.device("meta"):
        module = GPT(vocab=11, context=6, width=8, heads=2, layers=1, tied=True)
    load_into_module(module, Request(str(tmp_path / "gpt.safetensors"), (), None))
    assert not any(tensor.is_meta for tensor in module.state_dict().values())
    assert module.head.weight is module.tokens.weight and module.head.weight.requires_grad
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(module(tokens), source(tokens))

    save_file({"tokens.weight": source.tokens.weight.detach().numpy()}, str(tmp_path / "part.safetensors"))
    with torch.device("meta"):
        module = GPT(vocab=11, context=6, width=8, heads=2, layers=1, tied=True)
    with pytest.raises(ModelError, match=r"^model.weights: .*part.safetensors leaves positions.weight, .* of a model "
                                         r"built without values \(on the meta device\) unset"):
        load_into_module(module, Request(str(tmp_path / "part.safetensors"), (), None), keep_absent=True)


def test_a_checkpoints_arrays_are_loaded_without_a_copy_and_written_only_in_memory(tmp_path, monkeypatch):
    """models/weights.plan hands on the arrays whose dtype is the model's (a float16 one is widened), and a
    merged checkpoint's are its data file mapped copy-on-write: a module's tensors on them may be written,
    and the file keeps its values."""
    from ortflow import external_data
    from ortflow.checkpoints import ort_format
    from ortflow.models.weights import Request, plan, read

    given = {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float16)}
    loaded = plan(Request("w.safetensors", (), None), given, {"w": ((2, 3), np.float32), "b": ((3,), np.float32)},
                  [["w"], ["b"]])
    assert loaded["w"] is given["w"] and loaded["b"].dtype == np.float32

    monkeypatch.setenv(external_data.VARIABLE, "0")
    w = np.arange(600, dtype=np.float32).reshape(20, 30)
    ort_format.write_ort_checkpoint(tmp_path / "checkpoint", ort_format.TrainingState(
        {"w": w}, {"w": True}, {}, {}, {}))
    arrays = read(str(tmp_path))
    assert not arrays["w"].flags.owndata and arrays["w"].flags.writeable
    torch.from_numpy(arrays["w"]).mul_(2)  # as an optimizer would write a module's tensor
    assert arrays["w"][1, 0] == 60
    np.testing.assert_array_equal(read_ort_checkpoint(tmp_path / "checkpoint").parameters["w"], w)

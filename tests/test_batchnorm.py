"""User torch modules with BatchNorm and Dropout: running statistics update in
training as torch's do, live in the checkpoints, are used by evaluation and
baked into the export; dropout drops in training only."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import batchnorm_models
from conftest import gate_judged, run_on_ranks, run_snakemake
from ortflow import config as config_mod
from ortflow.checkpoints import layout, reader
from ortflow.checkpoints.merge import merge
from ortflow.stages.prepare_data import prepare
from ortflow.data.shards import ShardReader
from ortflow.errors import ModelError
from ortflow.stages import build_artifacts
from ortflow.sessions import inference_session

TESTS = Path(__file__).resolve().parent
STEPS = 8
GLOBAL_BATCH = 32
# Measured against torch, 8 SGD steps of the CNN and of the MLP (2 micro-batches
# a step, lr 0.1): losses within 1.1e-7 relative, weights and running statistics
# within 2.4e-7 absolute (float32 sums in another order; with ONNX Runtime and torch
# on one thread, 1.0e-7 and 2.1e-7), every weight tensor moved by 1.3e-3 or more; the
# tolerances leave a factor of about 20. SGD, not AdamW: the test is of the
# BatchNorms' forward, backward and statistics, and SGD moves a weight by lr x its
# gradient, so the trainings part by the gradients' rounding alone; AdamW moves an
# element by about lr whatever its gradient's size, which makes the CPU's summation
# order decide a bound on the weights (tests/torch_reference.py).
LOSS_RTOL = 5e-6
STATE_ATOL = 5e-6
SGD = {"name": "sgd", "lr": 0.1}
# The other tests' training: AdamW moves every parameter by about lr, equal ones apart alike.
ADAMW = {"lr": 0.01}


def config(model: str, accumulate: int = 1, optimizer: dict = ADAMW, **model_kwargs) -> config_mod.Config:
    return config_mod.load(overrides={
        "run": {"seed": 3},
        "model": {"kind": "torch", "path": f"batchnorm_models:{model}", "kwargs": model_kwargs},
        "train": {"world_size": 1, "steps": STEPS, "micro_batch_size": GLOBAL_BATCH // accumulate,
                  "grad_accum_steps": accumulate, "log_every": 1,
                  "eval_every": STEPS, "checkpoint_every": STEPS,
                  # Without weight decay: which parameters decay is train.optimizer.no_decay's
                  # business, compared with torch's parameter groups elsewhere.
                  "optimizer": {**optimizer, "weight_decay": 0.0},
                  "lr_schedule": {"name": "constant", "warmup_steps": 0}},
    })


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    """The default digits split into data/train and data/eval."""
    root = tmp_path_factory.mktemp("digits")
    prepare(config("BatchNormMLP"), root / "data" / "train", root / "data" / "eval")
    return root / "data"


def torch_training(cfg: config_mod.Config, initial: dict, reader: ShardReader):
    """The same training in PyTorch: the module in train mode, the artifacts'
    initial weights and statistics, the same micro-batches (a forward each, so
    the statistics update on each), torch.optim.SGD, the same global-norm
    clipping. Returns the module and its losses."""
    module = getattr(batchnorm_models, cfg.model.path.split(":")[1])(**cfg.model.kwargs)
    missing = module.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()}, strict=False).missing_keys
    assert all(k.endswith("num_batches_tracked") for k in missing), missing
    opt = cfg.train.optimizer
    optimizer = torch.optim.SGD(module.parameters(), lr=opt.lr, weight_decay=opt.weight_decay)
    module.train()
    losses = []
    accumulate, micro_batch = cfg.train.grad_accum_steps, cfg.train.micro_batch_size
    for step in range(STEPS):
        optimizer.zero_grad()
        losses.append(0.0)
        for batch in reader.micro_batches(step, cfg.run.seed, 0, 1, micro_batch, accumulate):
            logits = module(torch.from_numpy(batch["x"]))
            loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(batch["y"])) / accumulate
            loss.backward()
            losses[-1] += loss.item()
        torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.train.clip_grad_norm)
        optimizer.step()
    return module.eval(), losses


def eval_mode_onnx_file(path: Path) -> dict:
    """BatchNormCNN as a model zoo ships a model: exported by torch in eval mode
    (BatchNormalization in inference mode) at opset 13 (before BatchNormalization
    had a training mode), with running statistics of its own. Returns them.
    The BatchNorms' scales and shifts are drawn too: torch's eval-mode export
    would merge equal initializers (all ones, all zeros) into one."""
    module = batchnorm_models.BatchNormCNN()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, torch.nn.BatchNorm2d):
                for tensor in (layer.weight, layer.bias, layer.running_mean, layer.running_var):
                    tensor.copy_(torch.rand(tensor.shape, generator=generator) + 0.5)
    torch.onnx.export(module.eval(), torch.zeros(2, 64), str(path), input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}}, opset_version=13,
                      do_constant_folding=False, training=torch.onnx.TrainingMode.PRESERVE, dynamo=False)
    return {name: buffer.numpy() for name, buffer in module.named_buffers() if not name.endswith("num_batches_tracked")}


@pytest.mark.parametrize("model, accumulate, kind", [("BatchNormCNN", 1, "torch"), ("BatchNormMLP", 2, "torch"),
                                                      ("BatchNormCNN", 1, "onnx")])
def test_short_training_equals_pytorch(model, accumulate, kind, digits, tmp_path, monkeypatch):
    """ortflow's training loop on one rank (in this process) against torch: the
    losses, the weights and the running statistics after 8 steps (of 2
    micro-batches each for the MLP); then the export of that checkpoint against
    torch's module in eval mode. `onnx`: the module as an ONNX file exported in
    eval mode, whose BatchNorms ortflow switches to training mode."""
    from ortflow.stages import export_model
    from ortflow.artifacts import Artifacts
    from ortflow.training.run_folder import TrainFolder
    from ortflow.training.stop import StopRequest
    from ortflow.training.trainer import Trainer

    monkeypatch.syspath_prepend(str(TESTS))
    cfg = config(model, accumulate, SGD)
    statistics = None  # torch modules: their own init, 0 and 1
    if kind == "onnx":
        statistics = eval_mode_onnx_file(tmp_path / "user.onnx")
        cfg = replace(cfg, model=replace(cfg.model, kind="onnx", path=str(tmp_path / "user.onnx"), kwargs={}))
    artifacts, out = tmp_path / "artifacts", tmp_path / "train"
    description = build_artifacts.build(cfg, digits / "train", artifacts)
    assert len(description.running_stats) == {"BatchNormCNN": 6, "BatchNormMLP": 2}[model]
    Trainer(cfg, digits / "train", digits / "eval", Artifacts(artifacts), TrainFolder(out), StopRequest()).run()

    initial = reader.load_parameters_file(artifacts / "checkpoint")
    for name in description.running_stats.values():  # not moved by the export
        expected = statistics[name] if statistics else (1.0 if name.endswith("running_var") else 0.0)
        assert (initial[name] == expected).all(), (name, initial[name])
    reference, torch_losses = torch_training(config(model, accumulate, SGD), initial, ShardReader(digits / "train"))
    losses = [entry["loss"] for entry in json.loads((out / "metrics.json").read_text())["history"]["train"]]
    np.testing.assert_allclose(losses, torch_losses, rtol=LOSS_RTOL)
    final = reader.read_checkpoint(layout.step_dir(out / "checkpoints", STEPS)).state.parameters
    expected = {k: v.numpy() for k, v in reference.state_dict().items() if not k.endswith("num_batches_tracked")}
    assert sorted(final) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(final[name].reshape(value.shape), value, rtol=0, atol=STATE_ATOL, err_msg=name)
    for name in description.trainable:  # every weight moved, far beyond the tolerance
        assert np.abs(final[name] - initial[name]).max() > 100 * STATE_ATOL, name
    for name in description.running_stats.values():  # the statistics moved from their init (0 and 1)
        assert np.abs(final[name] - initial[name]).max() > 0.05, name

    # The export (written from the eval graph, checked against it by export_model.export) is
    # torch's module in eval mode: normalized with the running statistics, no dropout.
    merged = merge(layout.step_dir(out / "checkpoints", STEPS), tmp_path / "merged")
    export_model.export(cfg, artifacts, merged, digits / "eval", tmp_path / "model.onnx")
    batch = ShardReader(digits / "eval").gather(np.arange(64))
    logits = inference_session(tmp_path / "model.onnx").run(None, {"x": batch["x"]})[0]
    with torch.no_grad():
        np.testing.assert_allclose(logits, reference(torch.from_numpy(batch["x"])).numpy(), rtol=0, atol=1e-4)


def test_dropout_drops_in_training_only(digits, tmp_path, monkeypatch):
    """With Dropout(0.5): two training forwards of one batch differ, the eval
    graph's logits are the same twice and equal torch's module in eval mode."""
    from onnxruntime.training import api

    monkeypatch.syspath_prepend(str(TESTS))
    cfg = config("BatchNormMLP", dropout=0.5)
    build_artifacts.build(cfg, digits / "train", tmp_path)
    state = api.CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = api.Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    batch = ShardReader(digits / "train").gather(np.arange(GLOBAL_BATCH))
    first, second = (module(batch["x"], batch["y"])[1] for _ in range(2))
    assert np.abs(first - second).max() > 0.1
    module.eval()
    first, second = (module(batch["x"], batch["y"])[1] for _ in range(2))
    np.testing.assert_array_equal(first, second)
    reference = batchnorm_models.BatchNormMLP(dropout=0.5).eval()
    reference.load_state_dict({k: torch.from_numpy(v.data) for k, v in state.parameters}, strict=False)
    with torch.no_grad():
        np.testing.assert_allclose(first, reference(torch.from_numpy(batch["x"])).numpy(), rtol=0, atol=1e-5)


def test_dropout_repeats_and_resumes_bit_for_bit(digits, tmp_path, monkeypatch):
    """Dropout's masks depend on the seed, step, rank and micro-batch only: a
    second run repeats the first exactly, and a run resumed from its step-2
    checkpoint ends with the same bytes; another seed drops differently."""
    from ortflow.artifacts import Artifacts
    from ortflow.training.run_folder import TrainFolder
    from ortflow.training.stop import StopRequest
    from ortflow.training.trainer import Trainer

    monkeypatch.syspath_prepend(str(TESTS))
    cfg = config("BatchNormMLP", dropout=0.5)
    cfg = replace(cfg, train=replace(cfg.train, steps=4, checkpoint_every=2, eval_every=4))
    build_artifacts.build(cfg, digits / "train", tmp_path / "artifacts")

    def final(out: Path, config: config_mod.Config) -> dict:
        Trainer(config, digits / "train", digits / "eval", Artifacts(tmp_path / "artifacts"), TrainFolder(out),
                StopRequest()).run()
        return reader.read_checkpoint(layout.step_dir(out / "checkpoints", 4)).state.parameters

    first = final(tmp_path / "first", cfg)
    shutil.rmtree(layout.step_dir(tmp_path / "first" / "checkpoints", 4))
    resumed = final(tmp_path / "first", cfg)
    again = final(tmp_path / "again", cfg)
    other = final(tmp_path / "other", replace(cfg, run=replace(cfg.run, seed=4)))
    for name in first:
        np.testing.assert_array_equal(resumed[name], first[name], err_msg=name)
        np.testing.assert_array_equal(again[name], first[name], err_msg=name)
    assert np.abs(other["head.weight"] - first["head.weight"]).max() > 1e-3


@pytest.mark.parametrize("eval_only", [False, True])
def test_equal_fresh_parameters_train_apart(eval_only, digits, tmp_path, monkeypatch, caplog):
    """Two BatchNorms (weights of ones, biases of zeros) and two zero Linear biases:
    each is its own parameter in the artifacts and trains on its own gradients,
    also when the module stays in eval mode while exported (torch.onnx then
    merges initializers of equal value, and they would train as one)."""
    from onnxruntime.training import api

    monkeypatch.syspath_prepend(str(TESTS))
    with caplog.at_level("WARNING", logger="ortflow.build_artifacts"):
        description = build_artifacts.build(config("TwinBatchNorms", eval_only=eval_only), digits / "train", tmp_path)
    module = batchnorm_models.TwinBatchNorms()
    assert list(description.trainable) == [name for name, _ in module.named_parameters()]
    assert sorted(description.running_stats.values()) == [f"{side}_norm.running_{s}" for side in ("left", "right")
                                                             for s in ("mean", "var")]
    base = onnx.load(str(tmp_path / "inference_base.onnx"))
    assert sorted(t.name for t in base.graph.initializer) == sorted(
        name for name in module.state_dict() if not name.endswith("num_batches_tracked"))
    assert ("stayed in eval mode while exported, so torch.onnx merged its parameters and buffers of equal value; "
            "each has its own initializer again: ['left_norm.bias', 'left_norm.running_mean'" in caplog.text) == eval_only

    state = api.CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    session = api.Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    optimizer = api.Optimizer(str(tmp_path / "optimizer_model.onnx"), session)
    reader = ShardReader(digits / "train")
    for step in range(3):
        batch = reader.gather(np.arange(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH))
        session(batch["x"], batch["y"])
        optimizer.step()
        session.lazy_reset_grad()
    trained = {name: parameter.data for name, parameter in state.parameters}
    for left, right in (("left_norm.weight", "right_norm.weight"), ("left_norm.bias", "right_norm.bias"),
                        ("left.bias", "right.bias")):
        assert np.abs(trained[left] - trained[right]).max() > 1e-3, (left, right)


@pytest.mark.parametrize("norm, refusal", [
    ({"momentum": None}, "has momentum=None, a cumulative average that ortflow's graphs cannot update; give it a "
                         "momentum (torch's default is 0.1)"),
    ({"track_running_stats": False}, "has track_running_stats=False, which torch.onnx cannot export with a dynamic "
                                     "batch dimension; keep running statistics (track_running_stats=True)"),
])
def test_batchnorm_that_cannot_train_is_refused(norm, refusal, digits, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    with pytest.raises(ModelError) as refused:
        build_artifacts.build(config("RefusedBatchNorm", **norm), digits / "train", tmp_path / "out")
    assert str(refused.value) == f"model.path: RefusedBatchNorm.norm (BatchNorm1d) {refusal}"
    assert not (tmp_path / "out").exists()


def test_running_statistic_named_trainable_is_refused(digits, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    cfg = config("BatchNormMLP")
    cfg = replace(cfg, model=replace(cfg.model, trainable=("body.0.weight", "body.1.running_mean", "head.weight")))
    with pytest.raises(ModelError) as refused:
        build_artifacts.build(cfg, digits / "train", tmp_path / "out")
    assert str(refused.value) == (
        "model.trainable: 'body.1.running_mean' is the running mean of BatchNormalization node "
        "'/body/body.1/BatchNormalization', which training updates from the batches, not by gradients; "
        "leave it out of model.trainable"
    )


@pytest.mark.e2e
def test_cnn_with_batchnorm_and_dropout_through_the_workflow(digits_workdir, monkeypatch):
    """2 ranks, through export and static int8 quantization. Each rank evaluates
    its half of the eval split with its own running statistics, and the merged
    checkpoint takes each statistic from the one rank that wrote it: the export's
    fp32 loss on the whole split equals training's only if the ranks agree."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS), prepend=os.pathsep)
    steps = 40
    settings = {
        "model": {"kind": "torch", "path": "batchnorm_models:BatchNormCNN", "kwargs": {"dropout": 0.2}},
        "train": {"world_size": 2, "steps": steps, "micro_batch_size": 16, "log_every": 1, "eval_every": steps,
                  "checkpoint_every": steps, "optimizer": {"lr": 0.01},
                  "lr_schedule": {"name": "constant", "warmup_steps": 0}},
    }
    run_snakemake(digits_workdir, settings, "quantize_model")
    results = digits_workdir / "results" / "digits"
    trained = json.loads((results / "train" / "metrics.json").read_text())
    losses = [entry["loss"] for entry in trained["history"]["train"]]
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses
    assert trained["eval"]["accuracy"] > 0.5  # chance is 0.1

    stats = json.loads((results / "artifacts" / "model.json").read_text())["running_stats"]
    initial = reader.load_parameters_file(results / "artifacts" / "checkpoint")
    merged = reader.load_parameters_file(results / "checkpoint" / "checkpoint")
    for name in stats.values():
        assert np.abs(merged[name] - initial[name]).max() > 0.05, name
    shards = sorted((results / "train" / "checkpoints" / f"step-{steps:08d}").glob("shard-*.h5"))
    assert len(shards) == 2

    quantized = json.loads((results / "export" / "metrics.json").read_text())
    print("batchnorm workflow: losses", losses[:3], losses[-3:], "eval", trained["eval"], "export", quantized)
    assert quantized["fp32"]["loss"] == pytest.approx(trained["eval"]["loss"], rel=1e-5)
    assert quantized["fp32"]["accuracy"] == trained["eval"]["accuracy"]
    assert quantized["quantize"] == "static" and gate_judged(quantized["gate"], (
        digits_workdir / "logs" / "digits" / "quantize_model.log").read_text()), quantized


@pytest.mark.e2e
def test_ranks_end_each_step_with_the_mean_of_their_statistics(tmp_path):
    """Two real MPI ranks keep different updated statistics from their forwards;
    after the step's all-reduce both hold the same ones, their mean."""
    result = run_on_ranks(
        tmp_path,
        "import numpy as np\n"
        "from types import SimpleNamespace as NS\n"
        "from ortflow.training import comm\n"
        "from ortflow.training.running_stats import RunningStats\n"
        f"c = comm.MPIComm({str(tmp_path / 'hb')!r}, 30)\n"
        "arrays = {'bn.running_mean': np.zeros(3, np.float32), 'bn.running_var': np.ones(3, np.float32)}\n"
        "state = NS(_state=NS(get_parameter=lambda n: NS(data=NS(numpy=lambda: arrays[n]))))\n"
        "stats = RunningStats(state, ['loss', 'logits', 'm', 'v'], {'m': 'bn.running_mean', 'v': 'bn.running_var'}, c)\n"
        "stats.keep([0.5, None, np.arange(3, dtype=np.float32) * (c.rank + 1), np.full(3, c.rank, np.float32)])\n"
        "stats.set_mean(c.allreduce_sum(stats.local()))\n"
        "print(c.rank, arrays['bn.running_mean'].tolist(), arrays['bn.running_var'].tolist())\n",
        2,
    )
    assert sorted(result.stdout.splitlines()) == ["0 [0.0, 1.5, 3.0] [0.5, 0.5, 0.5]", "1 [0.0, 1.5, 3.0] [0.5, 0.5, 0.5]"]

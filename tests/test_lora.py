"""`model.lora` (issue 31): peft's LoRA adapters on a tiny GPT-2 (causal-lm) and BERT
(sequence-classification, whose new head trains in full) of `model.kind: transformers`, and on
a torch module of the user's (`kind: torch`, tests/transformers_models.py's GPT2).

Each case builds the artifacts, takes STEPS AdamW steps with ONNX Runtime's training API and
the same steps in torch + peft from the same initial weights (test_hf_families' helpers),
compares the losses within the layer tests' tolerance and the trained parameters each element
against its own AdamW update (torch_reference.update_ratios: where a step's size does not follow
its gradient's, a fixed bound would let the CPU's summation order decide), checks that only
the adapters (and the new head) are trainable, hold optimizer moments and move, then exports:
one plain ONNX model (no adapter left in it) whose logits are the unmerged torch model's, the
adapter folder that PeftModel.from_pretrained loads on the base, and the merged model in the
kind's own format (export_model checks both against the ONNX model's output; this test does
it again from the files)."""

from __future__ import annotations

import json
import logging
import shutil
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers
from peft import PeftModel
from safetensors.torch import load_file

from ortflow import config as config_mod
from ortflow.artifacts import Artifacts
from ortflow.checkpoints.ort_format import read_ort_checkpoint
from ortflow.data.manifest import read_manifest
from ortflow.data.shards import ShardReader
from ortflow.errors import ModelError
from ortflow.generation import GENERATION
from ortflow.generation.samples import SAMPLES, eval_prompts, samples
from ortflow.generation.samples_file import read_samples
from ortflow.graphs.forward_model import torch_module
from ortflow.models import hugging_face, lora, save_trained
from ortflow.reporting.results import lora_trained
from ortflow.stages import build_artifacts, export_model
from ortflow.stages.prepare_data import prepare
from test_hf_families import STEPS, differences, family_config, train_in_ort
from test_torch_layers import LOSS_TOLERANCE, PARAMETER_TOLERANCE, largest
from torch_reference import train_like_ortflow, update_ratios
from transformers_models import GPT2

# case -> (model section, the family of test_hf_families whose data and tiny model it takes,
#          the names of the trainable parameters' layers)
CASES = {
    "gpt2": ({"kind": "transformers", "task": "causal-lm", "lora": {"r": 4, "alpha": 8}}, "gpt2", ("c_attn",)),
    "bert": ({"kind": "transformers", "task": "sequence-classification", "lora": {"r": 2, "alpha": 4}}, "bert",
             ("query", "value", "classifier")),
    # Llama-shaped, as the decoders users fine-tune with LoRA (q_proj, v_proj; grouped-query attention).
    "llama": ({"kind": "transformers", "task": "causal-lm", "lora": {"r": 4, "alpha": 8}}, "llama",
              ("q_proj", "v_proj")),
    "torch-gpt2": ({"kind": "torch", "path": "transformers_models:GPT2",
                    "kwargs": {"n_embd": 32, "context": 12, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
                    "lora": {"r": 4, "alpha": 16, "targets": ["c_attn", "mlp.c_fc"]}}, "gpt2", ("c_attn", "c_fc")),
    # The default targets of the transformers model inside a torch module: GPT-2's c_attn.
    "torch-gpt2-default": ({"kind": "torch", "path": "transformers_models:GPT2",
                            "kwargs": {"n_embd": 32, "context": 12, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                       "attn_pdrop": 0.0}, "lora": {}}, "gpt2", ("c_attn",)),
}


def make_config(case: str, tmp_path, **lora_keys) -> config_mod.Config:
    model, family, _ = CASES[case]
    return family_config(case, {**model, "lora": {**model["lora"], **lora_keys}}, family, tmp_path,
                         {"optimizer": {"lr": 0.01, "weight_decay": 0.0},
                          "lr_schedule": {"name": "cosine", "warmup_steps": 2}})


def torch_twin(config, manifest: dict, initial: dict):
    """The module build exported (with peft's adapters) with the initial checkpoint's weights; what
    the checkpoint lacks is a tied weight or peft's untrained copy of a new head (modules_to_save's
    original_module), which forward does not read."""
    model = lora.apply(torch_module(config.model, manifest, "cross_entropy", config.run.seed), config.model.lora)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()}, strict=False)
    ties = {p.data_ptr() for n, p in model.state_dict().items() if n in initial}
    assert not unexpected and all(model.state_dict()[n].data_ptr() in ties or ".original_module." in n
                                  for n in missing), (missing, unexpected)
    return model


# The GPT-2 and BERT by task and the torch module in the fast loop; Llama with the end-to-end tests.
@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.e2e) if case == "llama" else case
                                  for case in CASES])
def test_lora_trains_the_adapters_like_peft_and_exports_them_merged(case, tmp_path, caplog):
    config = make_config(case, tmp_path)
    train_dir, eval_dir = tmp_path / "data/train", tmp_path / "data/eval"
    prepare(config, train_dir, eval_dir)
    artifacts = Artifacts(tmp_path / "artifacts")
    with caplog.at_level(logging.INFO, logger="ortflow.build_artifacts"):
        info = build_artifacts.build(config, train_dir, artifacts.folder)
    layers = CASES[case][2]
    # Only the adapters and a new head train; the base weights are frozen parameters of the graphs.
    assert info.trainable and all(".lora_" in n or ".modules_to_save." in n for n in info.trainable)
    assert {n.split(".lora_")[0].split(".modules_to_save.")[0].rsplit(".", 1)[-1] for n in info.trainable} \
        == set(layers)
    assert any(n.endswith(".base_layer.weight") for n in info.frozen)
    assert info.trainable_parameters < info.parameters / 5, info
    line = lora_trained(info)
    assert line in caplog.text and line.startswith(f"LoRA r={config.model.lora.r} on "), line

    initial = read_ort_checkpoint(artifacts.checkpoint)
    assert sorted(n for n, grad in initial.requires_grad.items() if grad) == sorted(info.trainable)
    losses = train_in_ort(artifacts, config, train_dir, tmp_path / "checkpoint")
    state = read_ort_checkpoint(tmp_path / "checkpoint/checkpoint")
    # AdamW's moments for the adapters alone.
    assert sorted(state.optimizer_states) == sorted(info.trainable)
    assert all(set(moments) == {"momentum0", "momentum1"} for moments in state.optimizer_states.values())
    trained = dict(state.parameters)
    frozen_moved = [n for n in info.frozen if not np.array_equal(trained[n], initial.parameters[n])]
    assert not frozen_moved, frozen_moved

    manifest = read_manifest(train_dir)
    twin = torch_twin(config, manifest, dict(initial.parameters))
    torch_losses, torch_trained = train_like_ortflow(twin, config, train_dir)
    trainable = {n: trained[n] for n in info.trainable}
    worst = update_ratios(trainable, torch_trained, initial.parameters)
    print(f"{case}: loss {largest(losses, torch_losses):.2g}, parameters "
          f"{max(differences(trainable, torch_trained).values()):.2g}, worst ratio to the bound "
          f"{max(worst.values()):.2g} ({max(worst, key=worst.get)})")
    assert largest(losses, torch_losses) <= LOSS_TOLERANCE * max(1.0, *torch_losses), (losses, torch_losses)
    assert max(worst.values()) <= 1, worst
    assert min(largest(trained[n], initial.parameters[n]) for n in info.trainable
               if ".lora_B." in n) > 100 * PARAMETER_TOLERANCE  # every adapter trained

    export_model.export(config, artifacts.folder, tmp_path / "checkpoint", eval_dir, tmp_path / "model.onnx")
    exported = onnx.load(str(tmp_path / "model.onnx"))
    names = [t.name for t in exported.graph.initializer]
    assert not [n for n in names if ".lora_" in n], names
    assert not [node.op_type for node in exported.graph.node if any(".lora_" in i for i in node.input)]

    # The merged ONNX model's logits are those of the unmerged torch model with the trained weights.
    reader = ShardReader(eval_dir)
    batch = reader.gather(np.arange(8))
    features = [f.name for f in manifest.features]
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    onnx_logits = session.run(None, {n: batch[n] for n in features})[0]
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in trained.items()}, strict=False)
    twin.eval()
    with torch.no_grad():
        unmerged = twin(*(torch.from_numpy(batch[n]) for n in features)).numpy()
    assert largest(onnx_logits, unmerged) <= 1e-4 * np.abs(unmerged).max(), largest(onnx_logits, unmerged)

    check_adapter_and_merged_model(case, config, tmp_path, {n: batch[n] for n in features}, onnx_logits)
    if config.model.task == "causal-lm":
        check_samples_start_from_the_base(tmp_path, eval_dir)


def check_samples_start_from_the_base(folder, eval_dir) -> None:
    """export/samples.json's "before" is the base folder's own greedy text: the initial checkpoint's
    adapters (lora_B zero) change nothing, and the start module is built with them."""
    written = read_samples(folder / SAMPLES)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder / "folder", attn_implementation="eager").eval()
    reader = ShardReader(eval_dir, raw=True)
    prompts = eval_prompts(reader.gather(np.arange(len(written.samples))), reader.label_name, 3)
    expected = samples(lambda: base, folder / GENERATION, prompts, save_trained.position_limit(base))
    assert written.max_new_tokens == expected.max_new_tokens > 0
    assert [sample.before for sample in written.samples] == [sample.before for sample in expected.samples]


def check_adapter_and_merged_model(case: str, config, folder, batch: dict, onnx_logits: np.ndarray) -> None:
    """export/adapter/ on the base model, as peft's users load it (no key missing or unexpected),
    and the merged model in the kind's own format give the exported ONNX model's logits on `batch`."""
    adapter = folder / lora.ADAPTER
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == config.model.lora.r
    if config.model.kind == "transformers":
        cls = getattr(transformers, hugging_face.CLASSES[config.model.task])
        new_head = {"num_labels": 3, "ignore_mismatched_sizes": True} if case == "bert" else {}
        base = cls.from_pretrained(folder / "folder", **new_head, attn_implementation="eager")
        merged = cls.from_pretrained(folder / "transformers", attn_implementation="eager")
        if config.model.task == "causal-lm":
            def call(model):
                return model(input_ids=torch.from_numpy(batch["x"])).logits.transpose(1, 2)
        else:
            def call(model):
                return model(**{name: torch.from_numpy(array) for name, array in batch.items()}).logits
    else:
        torch.manual_seed(config.run.seed)
        base, merged = GPT2(**config.model.kwargs), GPT2(**config.model.kwargs)
        merged.load_state_dict(load_file(folder / "model.safetensors"), strict=True)

        def call(model):
            return model(torch.from_numpy(batch["x"]))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        peft_model = PeftModel.from_pretrained(base, str(adapter))
    assert not [str(w.message) for w in said if "keys" in str(w.message)]
    for model in (peft_model, merged):
        model.eval()
        with torch.no_grad():
            logits = call(model).numpy()
        assert largest(logits, onnx_logits) <= 1e-4 * np.abs(onnx_logits).max(), largest(logits, onnx_logits)


@pytest.mark.parametrize("targets, refusal", [
    (["c_attn", "q_proj"], r"^model.lora.targets: 'q_proj' matches no module of GPT2LMHeadModel \(its layers are "),
    (["ln_f"], r"^model.lora.targets ln_f: peft cannot adapt a layer they name \(Target module LayerNorm\(.*\); "
               r"name Linear"),
])
def test_lora_refuses_a_target_it_cannot_adapt(targets, refusal, tmp_path):
    config = make_config("gpt2", tmp_path, targets=targets)
    prepare(config, tmp_path / "train", tmp_path / "eval")
    with pytest.raises(ModelError, match=refusal) as error:
        build_artifacts.build(config, tmp_path / "train", tmp_path / "artifacts")
    assert "\n" not in str(error.value) and not (tmp_path / "artifacts").exists()


def test_lora_refuses_a_model_that_is_no_torch_module_of_the_users(tmp_path):
    config = config_mod.load(overrides={"data": {"shards": 1}, "model": {"kind": "mlp", "lora": {}}})
    prepare(config, tmp_path / "train", tmp_path / "eval")
    with pytest.raises(ModelError, match=r"^model.lora: LoRA adapts the layers of a torch module of yours or a "
                                         r"Hugging Face model; model.kind is mlp \(use model.kind torch or "
                                         r"transformers, or model.lora: null\)$"):
        build_artifacts.build(config, tmp_path / "train", tmp_path / "artifacts")


def test_lora_checkpoints_hold_the_adapters_moments_and_resume_bit_for_bit(tmp_path):
    """ortflow's own trainer (one rank, in this process) on the LoRA GPT-2: its checkpoints keep the
    frozen base weights as non-trainable parameters with no moments, the adapters with theirs; a run
    resumed from step 2 ends with the bytes of the one that never stopped, and merge_checkpoint
    gives the same weights and moments."""
    from dataclasses import replace

    from ortflow.checkpoints import layout, reader
    from ortflow.checkpoints.merge import merge
    from ortflow.training.run_folder import TrainFolder
    from ortflow.training.stop import StopRequest
    from ortflow.training.trainer import Trainer

    config = make_config("gpt2", tmp_path)
    config = replace(config, train=replace(config.train, checkpoint_every=2, eval_every=4))
    prepare(config, tmp_path / "train", tmp_path / "eval")
    artifacts = Artifacts(tmp_path / "artifacts")
    info = build_artifacts.build(config, tmp_path / "train", artifacts.folder)

    def final(out):
        Trainer(config, tmp_path / "train", tmp_path / "eval", artifacts, TrainFolder(out), StopRequest()).run()
        return reader.read_checkpoint(layout.step_dir(out / "checkpoints", STEPS)).state

    first = final(tmp_path / "run")
    assert sorted(first.optimizer_states) == sorted(info.trainable)
    assert sorted(n for n, grad in first.requires_grad.items() if not grad) == sorted(info.frozen)
    shutil.rmtree(layout.step_dir(tmp_path / "run" / "checkpoints", STEPS))
    resumed = final(tmp_path / "run")
    for name, array in first.parameters.items():
        np.testing.assert_array_equal(resumed.parameters[name], array, err_msg=name)
    merged = read_ort_checkpoint(merge(tmp_path / "run" / "checkpoints", tmp_path / "merged",
                                                        model=artifacts.folder) / "checkpoint")
    assert sorted(merged.optimizer_states) == sorted(info.trainable)
    for name, array in first.parameters.items():
        np.testing.assert_array_equal(merged.parameters[name], array, err_msg=name)

"""The trained model in its own framework's format (models/save_trained.py), beside the
ONNX model, for `model.kind: transformers` and `torch`: built from the torch module as
build_artifacts built it (graphs/forward_model.torch_module) with the merged checkpoint's
weights. `transformers/` is a save_pretrained folder with the tokenizer's files,
`model.safetensors` the module's state_dict. Each is read back as its users read it
(from_pretrained with no missing or unexpected weight, load_state_dict(strict=True)), and
that module's output on eval records must be the exported model's within TOLERANCE before
it is renamed into place; an earlier run's of another kind is removed.

With `model.lora` (models/lora.py), `adapter/` gets the adapters alone
(adapter_model.safetensors, adapter_config.json), read back by PeftModel.from_pretrained
on the base model and checked the same way; the other formats hold the merged model.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .. import atomic
from ..config import Config
from ..data.manifest import Manifest
from ..graphs.description import ModelDescription
from ..graphs.forward_model import base_torch_module, torch_module
from ..models import lora, save_trained
from ..models.user import forward_features
from .checks import compare

log = logging.getLogger("ortflow.export")


def trained_torch_module(config: Config, info: ModelDescription, manifest: Manifest, checkpoint_dir: Path):
    """The torch module of a `kind: torch`, `transformers` or `gpt` model (the one built in whose
    generation folder comes from torch: generation/run_export.py), built as build_artifacts built
    it (with model.lora's adapters), with the merged checkpoint's weights; None for other kinds."""
    if config.model.kind not in ("torch", "transformers", "gpt"):
        return None
    import torch

    # The built-in gpt on the meta device, given the checkpoint's arrays themselves (models/weights.py):
    # the weights held once, not also as the module's random initialisation (tests/test_external_data.py).
    device = torch.device("meta" if config.model.kind == "gpt" and not info.lora else "cpu")
    with save_trained.quietly():
        with device:
            module = torch_module(config.model, manifest, info.loss, config.run.seed)
        if info.lora:
            module = lora.apply(module, config.model.lora)
        save_trained.load_trained(module, checkpoint_dir)
    return module.eval()


def write_torch_formats(config: Config, module, info: ModelDescription, manifest: Manifest, batch: dict, output: np.ndarray,
                        folder: Path) -> None:
    """Into `folder`, the trained model in its own framework's format (models/save_trained.py):
    `transformers/` for kind transformers, `model.safetensors` for kind torch, each read back as
    its users read it and its output on `batch` (standardized features) checked against the exported
    model's (`output`; kind gpt's module itself, which its generation folder comes from); an earlier
    run's of another kind removed."""
    import shutil

    kind = config.model.kind
    if info.lora:
        module = write_adapter(config, module, info, manifest, batch, output, folder)
    else:
        shutil.rmtree(folder / lora.ADAPTER, ignore_errors=True)
    if kind != "transformers":
        shutil.rmtree(folder / save_trained.TRANSFORMERS, ignore_errors=True)
    if kind != "torch":
        (folder / save_trained.STATE_DICT).unlink(missing_ok=True)
    if kind == "transformers":
        target = folder / save_trained.TRANSFORMERS
        with atomic.folder(target) as tmp, save_trained.quietly():
            save_trained.save_pretrained(module, config.model.path, config.data.tokenizer, manifest.tokenizer,
                                         tmp)
            loaded = save_trained.from_pretrained(module, tmp)
            check_torch_outputs(f"{target} through {type(loaded.model).__name__}.from_pretrained", loaded, manifest,
                                batch, output)
    elif kind == "gpt":
        # No file of its own: its generation folder is made from this module (generation/run_export.py),
        # so that the module holds the checkpoint's weights is checked here, against the exported model.
        check_torch_outputs("the built-in gpt with the merged checkpoint's weights", module, manifest, batch, output)
    elif kind == "torch":
        target = folder / save_trained.STATE_DICT
        with atomic.file(target) as tmp:
            save_trained.save_state_dict(module, tmp)
            with save_trained.quietly():
                fresh = torch_module(config.model, manifest, info.loss, config.run.seed)
            save_trained.read_state_dict(fresh, tmp)
            check_torch_outputs(f"{target} through load_state_dict", fresh, manifest, batch, output)


def write_adapter(config: Config, module, info: ModelDescription, manifest: Manifest, batch: dict, output: np.ndarray,
                  folder: Path):
    """The LoRA `module`'s adapters alone into `folder`/adapter/ (models/lora.py), read back with
    PeftModel.from_pretrained on the base model as build_artifacts built it (model.path's,
    model.weights loaded) and its output on `batch` checked against the exported model's; returns
    `module` with its adapters merged into its weights, the plain model the other formats hold."""
    target = folder / lora.ADAPTER
    with atomic.folder(target) as tmp:
        lora.save_adapter(module, tmp)
        with save_trained.quietly():
            base = base_torch_module(config.model, manifest, info.loss, config.run.seed)
            loaded = lora.load_adapter(base, tmp)
        check_torch_outputs(f"{target} through PeftModel.from_pretrained", loaded, manifest, batch, output)
    return lora.merge(module)


def check_torch_outputs(name: str, module, manifest: Manifest, batch: dict, output: np.ndarray) -> None:
    worst = compare(f"{name}: its output vs the exported model's",
                    save_trained.outputs(module, forward_features(module, manifest), batch), output)
    log.info("%s: output on %d eval records within %.3g of the exported model's", name, len(output), worst)

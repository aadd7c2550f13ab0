"""`model.lora`: LoRA adapters (the peft library's) on a torch module before its ONNX export.

`apply` wraps the module's layers that `model.lora.targets` names (peft's table of each
transformers family's usual layers where it names none) with peft's LoRA layers: the base
weights stop requiring grad, so build_artifacts hands them to generate_artifacts as frozen
parameters (graphs/parameters.py): the training graph computes no gradient for them and the
optimizer holds moments for the adapters alone. A `kind: transformers` model's new head (the
tensors its folder lacks, drawn from run.seed) trains in full, as peft's `modules_to_save`.

At export (export/formats.py and export/writer.py), `merge` folds the trained adapters into the weights
(peft's merge_and_unload) and `fold` does the same to the ONNX model ONNX Runtime exports:
the merged weights in place of the base ones, the adapters' branches cut out, so the
inference model is the plain model's graph; `save_adapter` writes the adapters alone
(export/adapter/) for `PeftModel.from_pretrained` on the base model.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

from ..errors import ModelError

log = logging.getLogger("ortflow.build_artifacts")

ADAPTER = "adapter"  # export/adapter/: adapter_model.safetensors and adapter_config.json
# The nodes between an adapter's B matrix and the Add that puts its product on the base layer's
# output, as torch.onnx writes peft's Linear (Transpose, MatMul, Mul by the scale): a longer
# chain is not one fold knows.
BRANCH_NODES = 4


def _inner(module):
    """The module that peft wraps: a TaskModel's Hugging Face model, else the module itself."""
    from .hugging_face import TaskModel

    return module.model if isinstance(module, TaskModel) else module


def in_place_of(module, wrapped):
    """`module` with peft's `wrapped` (a PeftModel of `_inner(module)`) in place of what it wraps: a
    TaskModel's Hugging Face model, or the whole module, whose forward's argument names it keeps
    (user.forward_features reads them, and PeftModel.forward takes *args)."""
    from .hugging_face import TaskModel

    if isinstance(module, TaskModel):
        module.model = wrapped
        return module
    wrapped.input_names = getattr(module, "input_names", None) or list(inspect.signature(module.forward).parameters)
    return wrapped


def default_targets(module) -> list[str]:
    """The family's usual LoRA layers: peft's table by the transformers model_type of the module
    (or of the first transformers model in it: a kind torch wrapper's)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as TABLE

    model_type = next((getattr(m.config, "model_type", None) for m in _inner(module).modules()
                       if hasattr(m, "config")), None)
    if model_type not in TABLE:
        what = f"a {model_type} model" if model_type else f"{type(_inner(module)).__name__}, no transformers model"
        raise ModelError(f"model.lora.targets: not given, and peft has no default LoRA layers for {what}; name the "
                         "layers (module names, or the ends of them after a '.', such as q_proj)")
    return list(TABLE[model_type])


def check_targets(module, targets: list[str]) -> None:
    """Each target names a module (all of its name, or its end after a '.', as peft matches them)."""
    names = [name for name, _ in _inner(module).named_modules()]
    for target in targets:
        if not any(name == target or name.endswith("." + target) for name in names):
            layers = sorted({name.rsplit(".", 1)[-1] for name in names} - {""}, key=lambda n: (n.isdigit(), n))
            raise ModelError(f"model.lora.targets: {target!r} matches no module of {type(_inner(module)).__name__} "
                             f"(its layers are named {', '.join(layers[:12])}{', ...' if len(layers) > 12 else ''})")


def apply(module, lora):
    """`module` with LoRA adapters of config `lora` (model.lora) on its target layers, the rest
    frozen: a TaskModel with its Hugging Face model wrapped, any other module wrapped whole
    (a peft PeftModel, which keeps the names of the module's forward arguments)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ModelError("model.lora: the peft library is not installed; pip install 'ortflow[transformers]', "
                         "or set model.lora: null") from None

    targets = list(lora.targets) if lora.targets else default_targets(module)
    check_targets(module, targets)
    inner = _inner(module)
    head = sorted({name.rsplit(".", 1)[0] for name in getattr(inner, "new_tensors", None) or ()})
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                        modules_to_save=head or None)
    try:
        module = in_place_of(module, get_peft_model(inner, config))
    except ValueError as error:  # peft's "Target module <the layer> is not supported. Currently, only ..."
        said = str(error).strip().splitlines()[0].split(". Currently")[0][:200]
        raise ModelError(f"model.lora.targets {', '.join(targets)}: peft cannot adapt a layer they name ({said}); "
                         "name Linear, Conv1D, Embedding or convolution layers") from None
    module.lora_targets = targets
    log.info("model.lora: adapters of r=%d, alpha=%g, dropout=%g on %s%s; every other parameter frozen", lora.r,
             lora.alpha, lora.dropout, ", ".join(targets), f" ({', '.join(head)}: trained in full)" if head else "")
    return module


def adapted_layers(module) -> dict[str, object]:
    """Module name -> peft's LoRA layer, for each layer that has adapters."""
    from peft.tuners.lora import LoraLayer

    return {name: layer for name, layer in module.named_modules() if isinstance(layer, LoraLayer)}


def fold(model, module) -> dict:
    """Cut the adapters of the trained LoRA `module` out of the ONNX `model` (the inference graph,
    its parameters still inputs: graphs/inference_model.py) and return what the base weights
    become: each adapted layer's base + its adapters' product (peft's get_delta_weight, what
    merge_and_unload adds), name -> array. The adapters' branch (their matrices and the nodes from
    its input's Dropout to the Add that puts it on the base layer's output) is left unread, for
    inference_model.prune to remove."""
    import torch

    inputs = {value.name for value in model.graph.input}
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {value.name for value in model.graph.output}
    merged = {}
    for name, layer in adapted_layers(module).items():
        base = f"{name}.base_layer.weight"
        if base not in inputs:
            raise ModelError(f"{name}: the exported ONNX model has no parameter {base} to merge "
                             "its LoRA adapters into; export with model.lora: null")
        with torch.no_grad():
            merged[base] = (layer.get_base_layer().weight + layer.get_delta_weight(layer.active_adapters[0])).numpy()
        # From the B matrix along its one consumer each to the Add: there, the base layer's output replaces the sum.
        tensor, chain = f"{name}.lora_B.{layer.active_adapters[0]}.weight", []
        while not chain or chain[-1].op_type != "Add":
            following = consumers.get(tensor, [])
            if len(following) != 1 or len(chain) == BRANCH_NODES or tensor in outputs:
                raise ModelError(f"{name}: its LoRA adapters' branch in the exported ONNX model is not the Transpose, "
                                 "MatMul, Mul and Add that the merge knows; export with model.lora: null")
            chain.append(following[0])
            tensor = following[0].output[0]
        add = chain[-1]
        base_output = next(value for value in add.input if value not in {node.output[0] for node in chain})
        for node in consumers.get(add.output[0], []):
            node.input[:] = [base_output if value == add.output[0] else value for value in node.input]
        if add.output[0] in outputs:
            raise ModelError(f"{name}: its LoRA adapters' sum is the model's output; export with model.lora: null")
    return merged


def save_adapter(module, folder) -> None:
    """The trained adapters alone (and a new head, trained in full) of the LoRA `module` into
    `folder`, as peft saves them: adapter_model.safetensors and adapter_config.json."""
    _inner(module).save_pretrained(str(folder), safe_serialization=True)
    # peft adds a model card for the Hugging Face Hub, a template of empty sections.
    (Path(folder) / "README.md").unlink(missing_ok=True)


def load_adapter(base, folder):
    """`base` (the module as build_artifacts built it, before its adapters) with the adapters of
    `folder` added as peft's users add them, `PeftModel.from_pretrained(base, folder)`; refused
    where peft finds a weight missing or unexpected."""
    import warnings

    from peft import PeftModel

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        wrapped = PeftModel.from_pretrained(_inner(base), str(folder))
    wrong = [str(warning.message) for warning in said if "keys" in str(warning.message)]
    if wrong:
        raise ModelError(f"{folder}: PeftModel.from_pretrained does not take the adapters as they are "
                         f"({wrong[0][:300]})")
    return in_place_of(base, wrapped)


def merge(module):
    """The LoRA `module` with its adapters merged into the weights and removed (peft's
    merge_and_unload): the plain module, whose state_dict names are the base model's."""
    from .hugging_face import TaskModel

    if isinstance(module, TaskModel):
        module.model = module.model.merge_and_unload()
        return module
    return module.merge_and_unload()

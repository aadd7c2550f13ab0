"""The forward model the graphs are built on (`inference_base.onnx`): the user's ONNX
file or a torch module exported to ONNX, with `model.weights` loaded into it, and
the check that its inputs and output fit the data."""

from __future__ import annotations

from pathlib import Path

from .. import external_data
from ..data.manifest import Manifest
from ..errors import ModelError
from ..models.torch_export import export_torch


def base_model(model, manifest: Manifest, loss: str, seed: int, path: Path):
    """Write the forward ONNX model to `path`, with `model.weights` loaded if given and
    `model.lora`'s adapters added after them; return it, the names of the torch parameters
    that train (None for an ONNX file: every float initializer) and what model.json records
    of the torch module: for `kind: transformers` where the model came from (`transformers`:
    hugging_face.origin), with LoRA its adapters (`lora`: r, alpha, dropout, targets). Over
    external_data.threshold() its initializers go to `inference_base.onnx.data`, and the model
    returned holds their shapes, not their values (what the checks and model.json read;
    generate_artifacts reads the file)."""
    from ..models import hugging_face, lora, user, weights

    if model.lora is not None and model.kind not in ("torch", "transformers"):
        raise ModelError(f"model.lora: LoRA adapts the layers of a torch module of yours or a Hugging Face model; "
                         f"model.kind is {model.kind} (use model.kind torch or transformers, or model.lora: null)")
    if model.kind == "onnx":
        base = user.load_onnx(model.path)
        pretrained = weights.requested(model)
        if pretrained:
            weights.load_into_onnx(base, pretrained)
        return external_data.save_and_reload(base, path), None, {}
    module = base_torch_module(model, manifest, loss, seed)
    described = {"transformers": hugging_face.origin(module)} if model.kind == "transformers" else {}
    if model.lora is not None:
        module = lora.apply(module, model.lora)
        described["lora"] = {"r": model.lora.r, "alpha": model.lora.alpha, "dropout": model.lora.dropout,
                             "targets": module.lora_targets}
    # As constructed, in training mode: torch.onnx deprecates its `training` argument for the module's own mode.
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    return export_torch(module, manifest, path), trainable, described


def base_torch_module(model, manifest: Manifest, loss: str, seed: int):
    """The torch module of `model` with `model.weights` loaded: what build_artifacts exports,
    or with model.lora the base that the adapters go on."""
    from ..models import weights

    module = torch_module(model, manifest, loss, seed)
    pretrained = weights.requested(model)
    if pretrained:
        weights.load_into_module(module, pretrained)
    return module


def torch_module(model, manifest: Manifest, loss: str, seed: int):
    """The torch module of a `model.kind` other than onnx, as constructed (before `model.weights`):
    what build_artifacts exports, and what export_model loads the trained weights into."""
    import torch

    from ..models import built_in, hugging_face, user

    # Every weight drawn in the constructor comes from the seed, including a new
    # head that a wrapper adds to a model it loads with from_pretrained.
    torch.manual_seed(seed)
    if model.kind == "torch":
        return user.import_torch(model.path, model.kwargs)
    if model.kind == "transformers":
        return hugging_face.build(model, manifest)
    return built_in(model, manifest, loss)


def check_interface(base, manifest: Manifest) -> None:
    """The model's inputs are the data's features (names and element types),
    and it has one output, the logits."""
    import onnx

    initializers = {t.name for t in base.graph.initializer}
    inputs = [i for i in base.graph.input if i.name not in initializers]
    model_names = [i.name for i in inputs]
    data_names = [f.name for f in manifest.features]
    if sorted(model_names) != sorted(data_names):
        raise ModelError(
            f"model inputs {model_names} do not match the data's feature names {data_names}; "
            "name the model's inputs like data.features (or set data.features to the model's input names)"
        )
    dtypes = {f.name: f.dtype for f in manifest.features}
    for i in inputs:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type).name
        if dtype != dtypes[i.name]:
            raise ModelError(f"model input {i.name!r} is {dtype} but the data's feature {i.name!r} is {dtypes[i.name]}")
    if len(base.graph.output) != 1:
        raise ModelError(
            f"the model has outputs {[o.name for o in base.graph.output]}; ortflow trains a model with one output (the logits)"
        )
    if manifest.label.name in {n for node in base.graph.node for n in [*node.input, *node.output]} | set(
        model_names
    ):
        raise ModelError(
            f"the data's label name {manifest.label.name!r} is already a tensor name in the model; "
            "rename data.label"
        )

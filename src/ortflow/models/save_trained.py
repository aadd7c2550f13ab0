"""The trained model in torch's and transformers' own formats, beside its ONNX model (export_model):
the torch module that build_artifacts exported (graphs/forward_model.torch_module), with the merged
checkpoint's weights loaded by their state_dict names (models/weights.py), saved as

- `kind: transformers`: a `save_pretrained` folder of the AutoModelFor<task> (`TRANSFORMERS`): its
  config with the data's `id2label`/`label2id`, `model.safetensors` in the model's own names (the
  TaskModel's without its `model.` prefix), and data.tokenizer's files;
- `kind: torch`: `model.safetensors` (`STATE_DICT`) of the module's state_dict names, every tensor
  under each of its names (tied ones too), which `load_state_dict(strict=True)` takes.

Each is read back as its users read it (`from_pretrained`, `load_state_dict`) and the module it gives
is what export_model compares with the ONNX model.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import numpy as np

from ..errors import ModelError
from .weights import Request, load_into_module

log = logging.getLogger("ortflow.export")

TRANSFORMERS = "transformers"  # export/transformers/
STATE_DICT = "model.safetensors"  # export/model.safetensors
# The config keys that give how many positions a transformers model has embeddings for.
POSITIONS = ("n_positions", "max_position_embeddings")
# What transformers' tokenizers give a text model, by name (its model_input_names).
TOKENIZER_OUTPUTS = ("input_ids", "token_type_ids", "attention_mask")


@contextlib.contextmanager
def quietly():
    """The module built again, saved and read back without build_artifacts' log, transformers' loading
    report and its progress bars: what they say of the build (a new head drawn from run.seed, weights
    loaded from the folder) is undone by the checkpoint's weights, and the export log says what it did."""
    build_log = logging.getLogger("ortflow.build_artifacts")
    level = build_log.level
    build_log.setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # kind torch without transformers installed
        hf_logging = None
    if hf_logging:
        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        build_log.setLevel(level)
        if hf_logging:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()


def load_trained(module, checkpoint_dir: Path) -> None:
    """The merged checkpoint's parameters (results/<run>/checkpoint) into `module`, by state_dict names.
    A tensor that forward never reads is not in it (torch.onnx leaves it out of the ONNX model) and
    keeps its value as built."""
    kept = load_into_module(module, Request(str(checkpoint_dir), (), None), keep_absent=True)
    log.info("%s: the weights of %s loaded by their state_dict names%s", type(module).__name__, checkpoint_dir,
             f"; {len(kept)} that forward never reads (not in the ONNX model) keep their values as built: "
             f"{', '.join(kept[:5])}" if kept else "")


def position_limit(module) -> int | None:
    """The most positions the module has embeddings for: the smallest n_positions or
    max_position_embeddings of the transformers configs in it; None without one."""
    limits = [getattr(m.config, key) for m in module.modules() if hasattr(m, "config")
              for key in POSITIONS if isinstance(getattr(m.config, key, None), int)]
    return min(limits, default=None)


def save_state_dict(module, path: Path) -> None:
    """The module's state_dict into the safetensors file `path`: a tensor shared by several
    names (tied weights) is written under each, as load_state_dict(strict=True) wants them."""
    from safetensors.torch import save_file

    save_file({name: tensor.detach().clone().contiguous() for name, tensor in module.state_dict().items()},
              str(path))


def read_state_dict(module, path: Path) -> None:
    """`path` (save_state_dict's) into `module` as torch users load it: strictly, every name."""
    from safetensors.torch import load_file

    try:
        module.load_state_dict(load_file(str(path)), strict=True)
    except RuntimeError as error:  # torch lists the missing and unexpected keys
        raise ModelError(f"{path}: load_state_dict(strict=True) refuses it: {str(error).strip()[:300]}") from None


def save_pretrained(task_model, model_path: str, tokenizer: str | None, described: dict | None, folder: Path) -> None:
    """The TaskModel's AutoModelFor<task> into `folder` (save_pretrained, safetensors), its cache
    turned back on as the model's folder `model_path` has it, with data.tokenizer (`tokenizer`; its
    manifest entry `described`) beside it: a save_pretrained folder re-saved through AutoTokenizer,
    a tokenizer.json file as a PreTrainedTokenizerFast with the data's eos and padding tokens; either
    with the chat template that rendered the data's chats, if any."""
    from .hugging_face import load_config

    hf = task_model.model
    if hasattr(hf.config, "use_cache"):  # off for training (hugging_face.head_config); on for generate()
        hf.config.use_cache = getattr(load_config(Path(model_path)), "use_cache", True)
    hf.save_pretrained(str(folder), safe_serialization=True)
    if not tokenizer:
        log.info("no data.tokenizer, so the transformers folder has no tokenizer files: the model's token ids are "
                 "the text's bytes")
        return
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    described = described or {}
    if Path(tokenizer).is_dir():
        saved = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True, trust_remote_code=False)
    else:
        special = {key: described.get(key) for key in ("eos_token", "pad_token")}
        # What the data's tokenization fed the model (token_type_ids where its template gives them), which
        # transformers' default for a tokenizer.json leaves out: pairs would then lose their type ids.
        fed = [name for name, argument in zip(task_model.input_names, task_model.arguments)
               if argument and name in TOKENIZER_OUTPUTS]
        saved = PreTrainedTokenizerFast(tokenizer_file=tokenizer, **{k: v for k, v in special.items() if v},
                                        **({"model_input_names": fed} if "input_ids" in fed else {}))
    # The template that rendered the training chats (data.chat_template wins over the folder's): the
    # model answers prompts rendered as it learned them.
    saved.chat_template = described.get("chat_template") or saved.chat_template
    saved.save_pretrained(str(folder))
    portable_tokenizer_class(folder)


def portable_tokenizer_class(folder: Path) -> None:
    """tokenizer_config.json's class named as transformers 4 knows it too: transformers 5 saves a fast
    tokenizer of no model's class as "TokenizersBackend", which transformers 4's AutoTokenizer refuses
    ("does not exist"; optimum-onnx pins transformers < 4.58), and loads "PreTrainedTokenizerFast" as
    that same class (the same encodings in both, measured on a WordPiece pair)."""
    path = Path(folder) / "tokenizer_config.json"
    settings = json.loads(path.read_text()) if path.is_file() else {}
    if settings.get("tokenizer_class") == "TokenizersBackend":
        settings["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


def from_pretrained(task_model, folder: Path):
    """The TaskModel's twin with its AutoModelFor<task> read from `folder` by from_pretrained,
    refused when any weight is missing, unexpected or of another shape."""
    import transformers

    from .hugging_face import CLASSES, TaskModel, attention

    cls = getattr(transformers, CLASSES[task_model.task])
    hf, info = cls.from_pretrained(str(folder), local_files_only=True, use_safetensors=True, output_loading_info=True,
                                   attn_implementation=attention(task_model.model.config.model_type))
    wrong = {kind: sorted(str(key) for key in info.get(kind, ())) for kind in
             ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(wrong.values()):
        said = "; ".join(f"{len(keys)} {kind.replace('_', ' ')}: {', '.join(keys[:5])}"
                         for kind, keys in wrong.items() if keys)
        raise ModelError(f"{folder}: {cls.__name__}.from_pretrained does not take the saved weights as they are "
                         f"({said})")
    return TaskModel(hf, task_model.task, task_model.input_names, task_model.arguments, task_model.window)


def outputs(module, features, batch: dict) -> np.ndarray:
    """The module's output in eval mode on `batch` (the arrays of the features it takes, in its order)."""
    import torch

    module.eval()
    with torch.no_grad():
        return module(*(torch.from_numpy(np.ascontiguousarray(batch[f.name])) for f in features)).numpy()

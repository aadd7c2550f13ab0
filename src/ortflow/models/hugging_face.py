"""`model.kind: transformers`: a Hugging Face model fine-tuned by task, with no code of the user's.

`model.path` is a local folder written by `save_pretrained` (its weights are then the
initial checkpoint's, bit for bit), or one that holds only its `config.json` (the
weights are drawn from `run.seed`). `model.task` picks the AutoModelFor<task> class
(`auto`: from the data, `task_of`), and the data set its head: `num_labels`, and
`id2label`/`label2id` from the classes' names. A head of another size than the
folder's is replaced by a new one drawn from `run.seed`, and the log says so.

`TaskModel` is the torch module that build_artifacts exports like any other. It
takes the data's features by name: a tokenizer's `input_ids`, `attention_mask`,
`token_type_ids` (one that the model's forward does not take is not fed, and stays
an input of the ONNX model that nothing reads), the token windows of text (`x`) as
`input_ids`, an image feature as `pixel_values`, a sequence-to-sequence model's
`decoder_input_ids` (the target shifted right, data/tokenizer.py) with its first
position set to the config's `decoder_start_token_id`. It turns caches off and returns the
logits in ortflow's layout: classes first, so a language model's and a tagger's
`[batch, time, classes]` become `[batch, classes, time]`. ortflow adds the loss.

Attention runs as transformers' default `sdpa` in the families where it trains as
in torch, else as `eager` (ATTENTION, docs/models.md's "Families tried").
A model that cannot train as torch does is refused before the export (REFUSED);
docs/models.md's "Families tried" lists what was measured.

Examples packed several to a window without seeing each other (data.packing: separate) come with
`position_ids` restarting at each example: TaskModel passes them, and in place of the 2D attention mask
a 4D one that keeps each example to itself (packed_mask), which transformers takes as given. The causal
LM families where that gives each example the logits it has alone are PACKED; others are refused.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import torch

from ..errors import ModelError
from ..machine import available_memory, gib
from . import DECODER_INPUT_IDS, TEXT_WINDOWS
from ..user_files import MODEL_CONFIG, MODEL_KEY, model_files

log = logging.getLogger("ortflow.build_artifacts")

# model.task -> the transformers class that builds it
CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "regression": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "image-classification": "AutoModelForImageClassification",
    "seq2seq": "AutoModelForSeq2SeqLM",
}
# Tasks whose logits have a score per position: [batch, time, classes] -> [batch, classes, time].
PER_TOKEN = ("causal-lm", "token-classification", "seq2seq")
# model_type -> its attention implementation: `sdpa` (transformers' default, whose export trains
# faster: GPT-2's step was 13% slower with eager, docs/benchmarks.md) where the family matrix
# (tests/test_hf_families.py) trains it as torch does, `eager` (the attention written out in
# operators) where it does not, and for any model_type not tried.
ATTENTION = {
    **dict.fromkeys(("bert", "roberta", "distilbert", "albert", "electra", "gpt2", "opt", "llama", "mistral",
                     "qwen2", "qwen3", "phi3", "gemma", "falcon", "bart", "vit"), "sdpa"),
    "modernbert": "eager",  # sdpa: the fully masked rows of its local attention give NaN gradients
    "t5": "eager",  # sdpa: ONNX Runtime's backward fails on a shape mismatch in its position bias' gradient
    "deberta-v2": "eager",  # transformers has no sdpa for it
    "gpt_neo": "eager",  # transformers has no sdpa for it
}

# model_type of the causal LMs whose logits of examples packed with packed_mask are those of the examples
# alone (to 2e-7, transformers 5.23, sdpa and eager; Mistral with its sliding window in the mask):
# docs/models.md's causal LM families, tests/test_packing.py.
PACKED = ("gpt2", "gpt_neo", "opt", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "falcon")
SEPARATE = "separate"  # data.packing: examples packed without attending to each other

# (model_type, config flag) -> why a model with the flag on cannot train as torch does (docs/models.md,
# "Families tried"): refused before the export, in one line.
REFUSED = {
    ("falcon", "alibi"): "its ALiBi bias is computed in bfloat16, which torch.onnx writes as a Cast to ONNX type 15 "
                         "(complex128, not bfloat16) that ONNX Runtime cannot run; use a Falcon with alibi: false",
}


def attention(model_type: str) -> str:
    return ATTENTION.get(model_type, "eager")


def is_image(feature: dict) -> bool:
    return feature.dtype.startswith("float") and len(feature.shape) == 3


def task_of(task: str, manifest) -> str:
    """`model.task` with `auto` resolved from the data, checked against it."""
    data_task, label, features = manifest.task, manifest.label, manifest.features
    per_token = data_task == "classification" and len(label.shape) == 1 and any(
        f.shape == label.shape and not f.dtype.startswith("float") for f in features)
    image = any(is_image(f) for f in features)
    if data_task == "language_model":
        found = "seq2seq" if any(f.name == DECODER_INPUT_IDS for f in features) else "causal-lm"
    elif data_task == "regression":
        found = "regression"
    elif image:
        found = "image-classification"
    elif per_token:
        found = "token-classification"
    else:
        found = "sequence-classification"
    if task == "auto":
        return found
    # A float target vector in [0, 1] is what multi-label sequence classification trains on.
    fits = task == found or (task == "sequence-classification" and data_task == "regression")
    if not fits:
        raise ModelError(
            f"model.task: {task!r} does not fit the data, which is {describe(manifest)}: that is {found!r} "
            f"(set model.task: {found}, or auto)"
        )
    return task


def describe(manifest) -> str:
    label = manifest.label
    what = {"language_model": "target texts" if any(f.name == DECODER_INPUT_IDS for f in manifest.features)
            else "text windows (next-token prediction)", "regression": "float targets",
            "classification": f"{manifest.num_classes} classes"}[manifest.task]
    return f"{what}, label {label.name!r} of shape {list(label.shape)}"


def default_loss(task: str, manifest) -> str:
    """`model.loss: auto` for a task: multi-label classification trains with bce_with_logits, as
    transformers' `problem_type: multi_label_classification` does; the rest as for any model."""
    return "bce_with_logits" if task == "sequence-classification" and manifest.task == "regression" else "auto"


def load_config(folder: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as error:  # transformers raises ValueError, OSError, ... with the reason first
        reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        raise ModelError(f"{MODEL_KEY}: transformers cannot read the model config of {folder} ({reason})") from None


def head_config(config, task: str, manifest) -> None:
    """The data's head on the model's config: how many outputs, the classes' names, the problem type."""
    if task in ("causal-lm", "seq2seq"):
        config.use_cache = False
        return
    label = manifest.label
    if task == "regression" or manifest.task == "regression":
        size = 1
        for dim in label.shape:
            size *= dim
        config.num_labels = size
        config.problem_type = "multi_label_classification" if task == "sequence-classification" else "regression"
        return
    names = list(manifest.classes or [str(i) for i in range(manifest.num_classes)])
    config.num_labels = len(names)
    config.id2label = dict(enumerate(names))
    config.label2id = {name: i for i, name in enumerate(names)}
    config.problem_type = "single_label_classification" if task == "sequence-classification" else None


def pretrained(folder: Path, task: str, manifest):
    """The AutoModelFor<task> of `folder`, its head fitted to the data, in training mode, float32."""
    import transformers

    # A save_pretrained folder, no links, safetensors only: its config.json and weight files.
    weights = [file for file in model_files(str(folder)) if file.name != MODEL_CONFIG]
    config = load_config(folder)
    for (model_type, flag), why in REFUSED.items():
        if config.model_type == model_type and getattr(config, flag, False):
            raise ModelError(f"{MODEL_KEY}: {folder} is a {model_type} model with {flag}=True, which ortflow "
                             f"cannot train: {why}")
    head_config(config, task, manifest)
    cls = getattr(transformers, CLASSES[task])
    try:
        if not weights:
            log.info("%s: %s has no weights; %s drawn from run.seed", MODEL_KEY, folder, type(config).__name__)
            check_fits(cls, config, folder)
            module = cls.from_config(config, attn_implementation=attention(config.model_type), dtype=torch.float32)
        else:
            module, info = cls.from_pretrained(
                str(folder), config=config, local_files_only=True, use_safetensors=True, trust_remote_code=False,
                ignore_mismatched_sizes=True, attn_implementation=attention(config.model_type), dtype=torch.float32,
                output_loading_info=True)
            new = sorted({*info.get("missing_keys", ()), *(key for key, *_ in info.get("mismatched_keys", ()))})
            module.new_tensors = new
            if new:
                log.warning("%s: %s has no %s head of %d outputs, the data's: %d tensor(s) drawn from run.seed: %s",
                            MODEL_KEY, folder, task, config.num_labels, len(new), ", ".join(new[:6]))
    except ModelError:  # check_fits' refusal, a ValueError too
        raise
    except ValueError as error:  # a config of no class for this task ("Unrecognized configuration class ...")
        reason = str(error).strip().splitlines()[0][:300]
        raise ModelError(f"{MODEL_KEY}: {folder} ({config.model_type}) has no {CLASSES[task]} model for model.task "
                         f"{task!r} ({reason})") from None
    return module.train()


def check_fits(cls, config, folder: Path) -> None:
    """A model drawn from its config alone (no weight files bound its size) refused before its weights are
    allocated when they alone, in float32, exceed the memory available (machine.available_memory): counted on
    the meta device, which allocates nothing, and said with the config keys that give its largest tensor."""
    with torch.device("meta"):
        meta = cls.from_config(config)
    parameters = sum(p.numel() for p in meta.parameters())
    available, where = available_memory()
    if 4 * parameters <= available:
        return
    name, largest = max(meta.named_parameters(), key=lambda item: item[1].numel())
    keys = [f"{key}: {value}" for key, value in config.to_dict().items()
            if type(value) is int and value > 1 and value in largest.shape]
    raise ModelError(f"{MODEL_KEY}: {folder / MODEL_CONFIG} describes a model of {parameters:,} parameters, "
                     f"{gib(4 * parameters)} in float32, more than the {gib(available)} available ({where}); "
                     f"its largest tensor, {name} {list(largest.shape)}, is from {', '.join(keys) or 'its config'}")


def packed_mask(position_ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """The additive attention mask, [batch, 1, time, time], of windows of packed examples: a position
    attends to itself and the positions before it of its example, which starts where its position id is 0
    (a window's padding is one more such example), and to none `window` or more before it (a sliding window)."""
    example = torch.cumsum((position_ids == 0).to(torch.int64), 1)
    time = torch.arange(position_ids.shape[1], device=position_ids.device)
    allowed = (example[:, :, None] == example[:, None, :]) & (time[:, None] >= time[None, :])
    if window:
        allowed = allowed & (time[:, None] - time[None, :] < window)
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None]


def packing_window(hf, folder: Path) -> int | None:
    """The sliding window packed_mask must keep of `hf`, a PACKED family (None: none); other models refused."""
    config = hf.config
    kinds = set(getattr(config, "layer_types", None) or ())
    if config.model_type not in PACKED or len(kinds) > 1:
        why = ("its layers attend over windows of different sizes (layer_types), which one mask cannot give"
               if config.model_type in PACKED else f"examples packed into one window are kept apart only in {', '.join(PACKED)} models")
        raise ModelError(f"{MODEL_KEY}: {folder} is a {config.model_type} model and data.packing is separate: {why}; "
                         "set data.packing: cross (examples attend to each other) or none")
    return getattr(config, "sliding_window", None)


class TaskModel(torch.nn.Module):
    """The Hugging Face model `hf` between the data's features and ortflow's logits: `arguments`
    are the forward arguments the features go to, in order (None: not fed). `window`: the data are
    packed (data.packing: separate), the sliding window of the mask (0: none)."""

    def __init__(self, hf, task: str, input_names: list[str], arguments: list[str | None], window: int | None = None):
        super().__init__()
        self.window = window
        self.model = hf
        self.task = task
        self.input_names = input_names  # what forward takes, in this order (user.forward_features)
        self.arguments = arguments
        # packed, the mask is made of the position ids, and the data's attention_mask is not read
        self.ignored_inputs = [name for name, argument in zip(input_names, arguments)
                               if argument is None or (window is not None and argument == "attention_mask")]
        self.no_cache = "use_cache" in inspect.signature(hf.forward).parameters
        self.decoder_start = getattr(hf.config, "decoder_start_token_id", None)

    def forward(self, *features):
        given = {argument: value for argument, value in zip(self.arguments, features) if argument}
        if self.task == "seq2seq":  # the target shifted right starts with the model's own start token
            shifted = given[DECODER_INPUT_IDS]
            given[DECODER_INPUT_IDS] = torch.cat([torch.full_like(shifted[:, :1], self.decoder_start), shifted[:, 1:]], 1)
        if self.window is not None:
            given["attention_mask"] = packed_mask(given["position_ids"], self.window)
        if self.no_cache:
            given["use_cache"] = False
        logits = self.model(**given).logits
        return logits.transpose(1, 2) if self.task in PER_TOKEN else logits


def origin(module: TaskModel) -> dict:
    """What model.json records of the model and the end-of-run summary shows: its class and
    task, whether its weights are the folder's or drawn from run.seed, and the new head's
    tensors (drawn from run.seed) under the folder's."""
    hf = module.model
    new = getattr(hf, "new_tensors", None)
    return {"class": type(hf).__name__, "task": module.task, "weights": "run.seed" if new is None else "folder",
            "new_head": new or []}


def build(model, manifest) -> TaskModel:
    """The TaskModel of config `model` (model.path, model.task) for the data of `manifest`."""
    task = task_of(model.task, manifest)
    folder = Path(model.path)
    hf = pretrained(folder, task, manifest)
    if task == "seq2seq" and getattr(hf.config, "decoder_start_token_id", None) is None:
        raise ModelError(f"{MODEL_KEY}: {folder}/config.json has no decoder_start_token_id, the token that "
                         "starts the decoder's inputs; set it (T5 uses its pad_token_id, BART its eos_token_id)")
    accepted = list(inspect.signature(hf.forward).parameters)
    arguments = []
    for feature in manifest.features:
        name = feature.name
        if name in accepted:
            arguments.append(name)
        elif name == TEXT_WINDOWS and task == "causal-lm":
            arguments.append("input_ids")
        elif is_image(feature) and task == "image-classification":
            arguments.append("pixel_values")
        elif name == "token_type_ids":
            log.info("%s: %s.forward takes no token_type_ids, which data.tokenizer gives: not fed",
                     MODEL_KEY, type(hf).__name__)
            arguments.append(None)
        else:
            raise ModelError(
                f"{MODEL_KEY}: the data's feature {name!r} is none of {type(hf).__name__}.forward's inputs "
                f"({', '.join(a for a in accepted if a not in ('kwargs', 'labels'))}); name the features like them")

    window = None
    if manifest.source.get("examples", {}).get("packing") == SEPARATE:
        window = packing_window(hf, folder) or 0
    log.info("%s: %s (%s) for model.task %s", MODEL_KEY, type(hf).__name__, folder, task)
    return TaskModel(hf, task, [f.name for f in manifest.features], arguments, window)

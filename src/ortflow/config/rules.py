"""What the schema cannot say: the values that depend on other keys (an optimizer's epsilon,
the split's seed, a transformers model's own tokenizer), and the rules between keys of different
sections, each refused in one line naming the key. `validate` is the schema's check and these."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from .convert import typed
from .schema import filled
from .sections import Config, Data, Train


def validate(config: dict, partial: bool = False, command_line: dict | None = None) -> dict:
    """Return a validated copy of `config` with every default filled in.
    Raises ConfigError naming the key and what is allowed. `partial`: the
    config holds only the sections one stage needs (what the rules pass), so
    the rules that relate keys of different sections were checked before.
    `command_line`: the part of `config` that Snakemake's --config gave, as it
    parsed it (nested values as text)."""
    config = filled(config, command_line)
    _resolve_eps(config["train"]["optimizer"])
    # Resolved here, once: a sweep's repeats change run.seed on a config validated before,
    # and keep its split (sweep.points).
    if config["data"]["split_seed"] is None:
        config["data"]["split_seed"] = config["run"]["seed"]
    if not partial:
        _default_tokenizer(config)
        _check_cross_keys(typed(config))
    return config


def _default_tokenizer(config: dict) -> None:
    """A `kind: transformers` model's data.tokenizer, for text, is its folder's own tokenizer when
    the config names none and the folder has one; without one, text is read as bytes.
    Its model.task seq2seq makes data.task seq2seq."""
    from ..user_files import TOKENIZER_FILES

    model, data = config["model"], config["data"]
    if model["kind"] == "transformers" and model["task"] == "seq2seq" and data["task"] == "auto":
        data["task"] = "seq2seq"  # the data stage tokenizes data.label's target texts
    if model["kind"] != "transformers" or not model["path"] or data["tokenizer"] is not None:
        return
    is_text = data["source"] == "text" or Path(data["source"]).suffix.lower() == ".txt" or data["text"]
    folder = Path(model["path"])
    if is_text and any((folder / name).is_file() for name in TOKENIZER_FILES if name != "config.json"):
        data["tokenizer"] = model["path"]


# Each optimizer's own epsilon, train.optimizer.eps's null: torch.optim.AdamW's, and
# the TrainingRunner's LAMB's (its LambOptimizer's default). SGD has none; it keeps
# AdamW's, so that its runs' training identity is unchanged.
OPTIMIZER_EPS = {"adamw": 1e-8, "sgd": 1e-8, "lamb": 1e-6}


def _resolve_eps(optimizer: dict) -> None:
    if optimizer["eps"] is None:
        optimizer["eps"] = OPTIMIZER_EPS[optimizer["name"]]



def _check_cross_keys(config: Config) -> None:
    model, train, data = config.model, config.train, config.data
    if model.kind in ("onnx", "torch", "transformers") and not model.path:
        raise ConfigError(
            f"config key 'model.path': required when model.kind is '{model.kind}' "
            "(an .onnx file, `package.module:Class` for torch, a save_pretrained folder for transformers)"
        )
    if model.task != "auto" and model.kind != "transformers":
        raise ConfigError(
            f"config key 'model.task': {model.task!r} picks the head of a `kind: transformers` model; model.kind is "
            f"{model.kind!r} (leave model.task out, or set model.kind: transformers)"
        )
    if model.kind == "gpt" and data.source != "text" and not data.source.endswith(".txt"):
        raise ConfigError(
            f"config key 'model.kind': 'gpt' needs text data (data.source: text or a .txt file), "
            f"got data.source={data.source!r}"
        )
    if data.packing == "separate" and model.kind in ("onnx", "torch"):
        # Only models/hugging_face.py builds the mask that keeps packed examples apart from their position ids:
        # a model of one's own would take them as positions only, every example attending to those before it.
        raise ConfigError(
            f"config key 'data.packing': 'separate' keeps the examples of a window apart with a mask that only "
            f"model.kind: transformers builds; model.kind is {model.kind!r}: set data.packing: cross (examples "
            "attend to each other) or none"
        )
    if model.kind == "gpt" and model.width % model.heads:
        raise ConfigError(
            f"config key 'model.heads': {model.heads} does not divide model.width={model.width}"
        )
    _check_text_keys(data)
    _check_int4(config)
    _check_generate(config)
    _check_libraries(config)
    check_lamb_sharding(train)
    if train.backend == "nccl" and train.device != "cuda":
        raise ConfigError("config key 'train.backend': 'nccl' needs train.device: cuda")
    if train.world_size % train.pipeline_stages:
        raise ConfigError(f"config key 'train.world_size': {train.world_size} ranks do not divide into "
                          f"train.pipeline_stages={train.pipeline_stages} stages; make it a multiple of it")
    # What the pipeline stages (training/pipeline_schedule.py) do not do yet, each with the value that works.
    for key, value, works in (("device", train.device, "cpu"), ("profile_steps", train.profile_steps, None)):
        if train.pipeline_stages > 1 and value != works:
            value = list(value) if isinstance(value, tuple) else value  # as the user wrote it, not as typed
            raise ConfigError(f"config key 'train.{key}': {value!r} is not applied to pipeline stages yet "
                              f"(train.pipeline_stages={train.pipeline_stages}); set train.{key}: "
                              f"{'null' if works is None else works}")
    if train.nodes > train.world_size:
        raise ConfigError(
            f"config key 'train.nodes': {train.nodes} nodes for train.world_size={train.world_size} ranks; "
            "every node needs at least one rank"
        )
    profile = train.profile_steps
    if profile and profile[0] > profile[1]:
        raise ConfigError(f"config key 'train.profile_steps': first {profile[0]} is after last {profile[1]}")
    for key in ("weights_skip", "weights_prefix", "weights_config"):
        if getattr(model, key) and not model.weights:
            raise ConfigError(f"config key 'model.{key}': set without model.weights, which it is about")


def _check_int4(config: Config) -> None:
    """export.int4 quantizes export/generation/, which the workflow declares for a `kind: transformers`
    causal-lm and the built-in gpt only: refused here rather than after training (model.task auto is
    known once the data are)."""
    model = config.model
    if config.export.int4 is not None and model.kind != "gpt" and (model.kind, model.task) != ("transformers",
                                                                                                "causal-lm"):
        raise ConfigError(
            "config key 'export.int4': int4 quantizes a causal LM's export/generation/ decoder, which needs "
            f"model.kind: gpt, or transformers with model.task: causal-lm; got model.kind {model.kind!r}, model.task "
            f"{model.task!r} (set export.int4: null, or model.task: causal-lm for a causal LM)")


def _check_generate(config: Config) -> None:
    """The generate target's prompts: one way of giving them, for a model that has export/generation/
    (the built-in gpt, or a causal LM or sequence-to-sequence model of kind transformers; model.task
    auto may be one, known once the data are)."""
    section, model = config.generate, config.model
    if section.prompt is not None and section.prompts is not None:
        raise ConfigError("config key 'generate.prompts': set with generate.prompt; give one of them")
    given = "prompt" if section.prompt is not None else "prompts" if section.prompts is not None else None
    if given and model.kind != "gpt" and (model.kind != "transformers"
                                          or model.task not in ("causal-lm", "seq2seq", "auto")):
        raise ConfigError(
            f"config key 'generate.{given}': generates from export/generation/, which the export writes for a "
            f"causal LM or a sequence-to-sequence model (model.kind: gpt, or transformers with model.task: "
            f"causal-lm or seq2seq); got model.kind "
            f"{model.kind!r}, model.task {model.task!r}")


def _check_libraries(config: Config) -> None:
    """The libraries that `model.kind: transformers` and `model.lora` need, which the package's
    `transformers` extra installs: said before any stage starts, rather than as an ImportError in one.
    The built-in gpt's export/generation/ is its transformers GPT-2 (models/gpt.as_gpt2): without
    transformers it is not written, so int4 and the generate target, which read it, need it too."""
    from importlib.util import find_spec

    model, generation = config.model, config.generate
    reads_generation = config.export.int4 is not None or generation.prompt is not None or generation.prompts is not None
    needs = {"model.kind: transformers": ["transformers"] if model.kind == "transformers" else [],
             "model.lora": ["peft"] if model.lora is not None else [],
             "model.kind: gpt with export.int4 or generate's prompts": ["transformers"]
             if model.kind == "gpt" and reads_generation else []}
    for key, libraries in needs.items():
        missing = [name for name in libraries if find_spec(name) is None]
        if missing:
            raise ConfigError(f"config key '{key.split(':')[0]}': {key} needs the {missing[0]} library, which is "
                              "not installed: pip install 'ortflow[transformers]'")


def check_lamb_sharding(train: Train) -> None:
    """Refuse `train.zero: 1` with LAMB: the trust ratio is the norm of a whole tensor."""
    if train.optimizer.name == "lamb" and train.zero:
        raise ConfigError(
            f"config key 'train.zero': {train.zero} gives each rank slices of the optimizer's tensors, but "
            "LAMB's trust ratio needs the norm of each whole tensor; set train.zero: 0 with lamb, "
            "or use train.optimizer.name: adamw with ZeRO")


def _check_text_keys(data: Data) -> None:
    """data.text needs a table and data.tokenizer; data.tokenizer needs text to tokenize: a .txt file, the
    data.text columns, or the examples of a .jsonl, .parquet or datasets folder (data/examples.py)."""
    source = data.source
    suffix = Path(source).suffix.lower()
    is_text = source == "text" or suffix == ".txt"
    # Rows that data.format may read as chats, prompt-completion pairs or documents.
    has_examples = suffix in (".jsonl", ".parquet") or Path(source).is_dir()
    text = [data.text] if isinstance(data.text, str) else data.text or []
    examples = data.format in ("messages", "prompt-completion", "documents")
    if text and suffix not in (".csv", ".parquet", ".jsonl") and not (examples and has_examples):
        raise ConfigError(f"config key 'data.text': text columns are read from a .csv, .parquet or .jsonl file, "
                          f"not data.source={source!r}")
    if (text or examples) and not data.tokenizer:
        key = "data.text" if text else "data.format"
        raise ConfigError(f"config key '{key}': needs data.tokenizer (a tokenizer.json file or a "
                          "save_pretrained folder) to turn the text into token ids")
    if examples and not has_examples:
        raise ConfigError(f"config key 'data.format': {data.format} rows are read from a .jsonl or .parquet file "
                          f"or a datasets folder (save_to_disk), not data.source={source!r}")
    if data.task == "seq2seq" and (examples or not text):
        raise ConfigError("config key 'data.task': seq2seq reads source texts from data.text and target texts "
                          "from data.label, columns of a .csv, .parquet or .jsonl file; set data.text"
                          + (f" and data.format: auto, not {data.format}" if examples else ""))
    if data.label in text:
        raise ConfigError(f"config key 'data.text': {data.label!r} is data.label too; the model would read "
                          "the answer")
    if data.format == "documents" and len(text) > 1:
        raise ConfigError(f"config key 'data.text': data.format documents reads one column of documents, "
                          f"got {list(text)}")
    if data.tokenizer and not text and not is_text and not has_examples:
        raise ConfigError(f"config key 'data.tokenizer': tokenizes text, data.source 'text' or a .txt file, the "
                          f"columns named by data.text, or the rows of a .jsonl, .parquet or datasets folder; "
                          f"data.source={source!r} has none of them (set data.text)")


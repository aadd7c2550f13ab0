"""The generation folder: the decoder with a KV cache and the files its loaders read beside it.

One folder that optimum's ORTModelForCausalLM (`model.onnx`, `config.json` with `use_cache: true`,
`generation_config.json`, the tokenizer) and onnxruntime-genai (`genai_config.json`, the model
builder's format) load as they are, and that `generate.Decoder` runs. It is written under a
temporary name and renamed when complete (atomic.folder), so a failed export leaves nothing half.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .. import atomic
from ..machine import release_freed_memory
from ..export.ecosystem import copy_tokenizer_files
from . import GENAI_CONFIG, MODEL
from .check import Agreement, GenerationCheck, compare_generation, transformers_greedy
from .generate import Decoder, special_tokens

if TYPE_CHECKING:  # the decoder's export needs torch, imported when a folder is written (cli.py)
    from .decoder import CacheLayout

# The language-model types onnxruntime-genai knows by name (its src/models/model_type.h, ModelType::IsLLM,
# read in 2026); any other decoder of the standard inputs and outputs it runs as its generic "decoder".
# Not "gpt2": onnxruntime-genai 0.18 runs that type with another cache layout, and its Generator refuses
# this decoder ("Model input was not found: "), which it runs as "decoder" with transformers' tokens.
GENAI_TYPES = {"chatglm", "ernie4_5", "gemma", "gemma2", "gemma3_text", "gptoss", "granite", "internlm2",
               "llama", "mistral", "nemotron", "olmo", "phi", "phimoe", "phi3", "phi3small", "qwen2", "qwen3",
               "smollm3"}

def export_folder(source: Path, folder: Path,
                  check: GenerationCheck | None = None) -> tuple[CacheLayout, Agreement | None]:
    """The save_pretrained causal-LM folder `source` (export/transformers/) as the generation folder
    `folder`, checked (`check`) before it is in place: the export stage's one call."""

    def load():
        from transformers import AutoConfig, AutoModelForCausalLM

        from ..models.hugging_face import attention
        from ..models.save_trained import quietly

        with quietly():
            kind = AutoConfig.from_pretrained(source, local_files_only=True).model_type
            model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True,
                                                         attn_implementation=attention(kind), dtype="float32")
        return model, Path(source)

    return write_folder(load, folder, check)


def write_folder(load: Callable[[], tuple], folder: Path,
                 check: GenerationCheck | None = None) -> tuple[CacheLayout, Agreement | None]:
    """The transformers causal LM that `load()` gives, with the source of its tokenizer files
    (copy_tokenizer's; None: a model without a tokenizer), as the generation folder `folder`. With
    `check`, the folder's greedy generation must be the model's (check.compare_generation) before the
    folder is renamed into place; its agreement is returned. The model's own generation comes first:
    the model is let go before the decoder's session opens, so that the two never hold the weights
    together (tests/test_external_data.py)."""
    with atomic.folder(folder) as building:
        from .decoder import export_decoder

        model, tokenizer_source = load()
        layout = export_decoder(model, building / MODEL)
        config = copy.deepcopy(model.config)  # the caller's model keeps its own
        config.use_cache = True  # optimum feeds the cache only to a model whose config says it has one
        config.save_pretrained(building)
        model.generation_config.save_pretrained(building)
        copy_tokenizer(tokenizer_source, building)
        genai = genai_config(model, layout)
        atomic.write_text(building / GENAI_CONFIG, json.dumps(genai, indent=4) + "\n")
        expected = check and transformers_greedy(model, *special_tokens(genai["model"]), check.prompts,
                                                 check.max_new_tokens)
        del model, tokenizer_source
        release_freed_memory()
        agreement = compare_generation(Decoder(building, prepacked=False), check, expected) if check else None
    return layout, agreement


def copy_tokenizer(source, folder: Path) -> None:
    """The tokenizer files of `source` into `folder`: a transformers tokenizer's (the built-in gpt's,
    run_export.built_in_gpt2) or a save_pretrained folder's; where it has none (ortflow trained the
    model on text as bytes), a tokenizer.json that encodes text as its UTF-8 bytes, byte b as id b,
    as ortflow's data does (data/sources.py)."""
    if hasattr(source, "save_pretrained"):
        source.save_pretrained(str(folder))
    elif not copy_tokenizer_files(source, folder):
        byte_tokenizer().save_pretrained(str(folder))


def byte_tokenizer():
    """A fast tokenizer of UTF-8 bytes: GPT-2's byte-level pre-tokenizer maps each byte to a printable
    character, and the vocabulary maps that character to the byte's value; no merges, no special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocabulary = {character: byte for byte, character in bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocabulary, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def genai_config(model, layout: CacheLayout) -> dict:
    """onnxruntime-genai's genai_config.json for the decoder (the model builder's fields). The search
    defaults are the model's generation_config's; past and present stay separate buffers
    (past_present_share_buffer false): the graph concatenates the past with the new keys, it does not
    write them into a buffer of the context's length."""
    config, generation = model.config, model.generation_config
    eos = generation.eos_token_id if generation.eos_token_id is not None else config.eos_token_id
    # The padding goes through the embedding under an attention mask of 0, so any id of the vocabulary
    # pads; one beyond it fails the lookup (GPT-2's end-of-text 50256 in a model fine-tuned on bytes).
    pad = next((value for value in (generation.pad_token_id, config.pad_token_id,
                                    *(eos if isinstance(eos, list) else [eos]))
                if isinstance(value, int) and 0 <= value < config.vocab_size), 0)
    names = layout.input_names()
    return {
        "model": {
            "bos_token_id": generation.bos_token_id if generation.bos_token_id is not None else config.bos_token_id,
            "context_length": layout.context_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": MODEL,
                "head_size": layout.head_dim,
                "hidden_size": config.hidden_size,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           **({"position_ids": "position_ids"} if "position_ids" in names else {}),
                           "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": config.num_attention_heads,
                "num_hidden_layers": layout.layers,
                "num_key_value_heads": layout.kv_heads,
            },
            "eos_token_id": eos,
            "pad_token_id": pad,
            "type": config.model_type if config.model_type in GENAI_TYPES else "decoder",
            "vocab_size": config.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": bool(generation.do_sample), "early_stopping": True,
            "length_penalty": 1.0, "max_length": layout.context_length, "min_length": 0, "no_repeat_ngram_size": 0,
            "num_beams": 1, "num_return_sequences": 1, "past_present_share_buffer": False,
            "repetition_penalty": 1.0,
            "temperature": generation.temperature if generation.temperature is not None else 1.0,
            "top_k": generation.top_k if generation.top_k is not None else 50,
            "top_p": generation.top_p if generation.top_p is not None else 1.0,
        },
    }

"""Generation from a fine-tuned causal LM in ONNX Runtime, with a KV cache (issue 41).

ortflow's scoring export (`export/model.onnx`) takes a whole window and has no cache, so
generating n tokens with it re-runs the prefix n times, and no serving tool loads it. This
package gives the decoder and folder that ONNX Runtime's serving tools read, and generation
on it in ONNX Runtime 1.19.2 (this project's runtime) equal to transformers' `generate`:

- `decoder`: the torch causal LM as an ONNX decoder with a KV cache, in optimum's and
  onnxruntime-genai's layout (input and output names, one graph for prompt and decode steps);
- `folder`: the folder around it: `model.onnx`, `config.json`, `generation_config.json`, the
  tokenizer files and onnxruntime-genai's `genai_config.json`;
- `generate`: greedy and sampled generation on such a folder in numpy and ONNX Runtime;
- `check`: that generation against transformers' `generate` on the model it came from;
- `seq2seq_export` and `seq2seq`: the same for a sequence-to-sequence model (T5, BART): optimum's
  encoder and decoders with a cache, generation on them, its check.
"""

GENERATION = "generation"  # the export stage's folder: results/<run>/export/generation/ (run_export.py)
SAMPLES = "samples.json"  # beside it, export/samples.json: eval prompts generated before and after (samples.py)
# The generation folder's files that its readers find by name (folder.py writes them).
MODEL = "model.onnx"
GENAI_CONFIG = "genai_config.json"
TOKENIZER = "tokenizer.json"  # what `ortflow generate` reads (the tokenizers library's file)
# A sequence-to-sequence model's folder instead of MODEL and GENAI_CONFIG: optimum's three files (seq2seq_export.py).
ENCODER, DECODER, DECODER_WITH_PAST = "encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx"


def is_seq2seq(folder) -> bool:
    """Whether the generation folder `folder` is a sequence-to-sequence model's."""
    from pathlib import Path

    return (Path(folder) / ENCODER).is_file()


def built_in_generation(kind: str) -> bool:
    """Whether the export writes export/generation/ for the built-in model `kind`: the gpt, as the
    transformers GPT-2 it equals (models/gpt.as_gpt2), where transformers (the package's transformers
    extra) is installed. The workflow declares the folder by the same test (workflow/rules/export.smk)."""
    from importlib.util import find_spec

    return kind == "gpt" and find_spec("transformers") is not None

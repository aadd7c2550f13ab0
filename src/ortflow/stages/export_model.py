"""The export_model stage: the merged checkpoint in, the inference model that a user deploys out.

1. The inference graph with the merged checkpoint's weights, the data's
   standardization in front and its metadata properties (export/writer.py): the
   forward model with the loss stripped, taking the data's features by name and
   returning the model's output, with the batch dimension dynamic (and a text
   model's sequence dimension where build_artifacts exported it so). With
   `model.lora` the trained adapters are merged into its weights.
2. The metadata properties record where the model came from (the run, the step,
   the training identity's digest, ortflow's version) and what its outputs and
   inputs mean (class names, the tokenizer, copied beside it) (export/metadata.py).
3. Before it is renamed into place, the model must pass (export/checks.py)
   `onnx.checker.check_model(full_check=True)`; on a batch of eval records, its
   logits and loss against the eval graph's on the same weights (within
   TOLERANCE); ONNX's reference evaluator, a second opinion that warns rather
   than fails; and with a dynamic sequence dimension, other lengths.
4. For `model.kind: transformers` and `torch`, the trained model in its own
   framework's format, and with `model.lora` its adapters alone, each read back
   as its users read it and checked against the exported model (export/formats.py).
5. For a causal LM (`kind: transformers`, causal-lm, or the built-in `gpt`), `generation/`:
   `transformers/` (the gpt: as the GPT-2 it equals) as a decoder with a KV cache that ONNX Runtime
   generates from, its greedy generation on a few
   eval prompts checked against transformers' `generate` (generation/run_export.py); and
   `samples.json`: export.samples eval prompts with the greedy generation of the starting weights
   and of that folder (generation/samples.py). For a sequence-to-sequence model (seq2seq), the
   same from optimum's encoder and decoders with a cache (generation/seq2seq_export.py).
6. For a text classifier, tagger or regressor (`kind: transformers`), `optimum/`: `transformers/` in
   optimum's layout (the tokenizer's input names, transformers' logits), its logits checked in ONNX
   Runtime against transformers' on the eval records (export/ecosystem.py).
   model.onnx is renamed into place last, once every check has passed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .. import atomic, external_data
from ..artifacts import Artifacts
from ..checkpoints.meta import read_merged
from ..config import Config
from ..data import standardize
from ..export import checks, formats, metadata
from ..export.ecosystem import write_optimum
from ..export.writer import write_inference_model
from ..generation.run_export import write_generation
from ..generation.samples import write_samples
from ..graphs.description import read_description
from ..inference import inference_output
from ..models import save_trained
from ..sessions import quiet_logging

log = logging.getLogger("ortflow.export")


def export(config: Config, artifacts: Path, checkpoint_dir: Path, eval_dir: Path, out: Path) -> dict:
    """Write and check `out` (the inference model); return its metadata properties."""
    import onnx

    from ..data.shards import ShardReader

    quiet_logging()
    files = Artifacts(artifacts)
    info = read_description(files.model_json)
    meta = read_merged(checkpoint_dir)

    reader = ShardReader(eval_dir, raw=True)
    props = metadata.properties(config.run.name, meta, reader.manifest)
    batch = reader.gather(np.arange(min(checks.CHECK_RECORDS, len(reader))))
    # With LoRA, the torch module's adapters are merged into the inference model's weights; without,
    # the torch module is built once the ONNX checks' sessions are gone, so that the weights are held fewer times.
    adapted = formats.trained_torch_module(config, info, reader.manifest, checkpoint_dir) if info.lora else None
    with atomic.file(out) as tmp:
        write_inference_model(files, checkpoint_dir / "checkpoint", info, tmp, out, reader, props, adapted)
        # Standardized from the raw features as the exported model does it: both graphs see the same values.
        expected = checks.eval_graph_outputs(files, checkpoint_dir / "checkpoint", info,
                                             standardize.apply(batch, reader.standardized), reader.label_name)
        onnx.checker.check_model(str(tmp), full_check=True)
        output = checks.check_outputs(tmp, info, batch, expected, reader.label_name)[:checks.REFERENCE_RECORDS]
        few = {name: array[:checks.REFERENCE_RECORDS] for name, array in batch.items()}
        trained = adapted if adapted is not None else formats.trained_torch_module(config, info, reader.manifest,
                                                                                   checkpoint_dir)
        positions = trained and save_trained.position_limit(trained)
        checks.check_sequence_lengths(tmp, info, few, output, positions)
        formats.write_torch_formats(config, trained, info, reader.manifest,
                                    standardize.apply(few, reader.standardized), output, out.parent)
        metadata.copy_tokenizer(eval_dir, reader.manifest, out.parent)
        task = (info.transformers or {}).get("task")
        # What follows builds its own modules (the gpt's again, from the same checkpoint) and lets each go
        # before it opens a session: this one would hold the weights beside them.
        del trained, adapted
        gpt = (lambda: formats.trained_torch_module(config, info, reader.manifest, checkpoint_dir)) \
            if config.model.kind == "gpt" else None
        write_generation(task, batch, out.parent, positions, gpt, reader.manifest.tokenizer)
        write_optimum(task, batch, out.parent)
        write_samples(config.export.samples, out.parent, reader, positions,
                      lambda: formats.trained_torch_module(config, info, reader.manifest, files.folder))
    log.info("step %d of run %s -> %s (%d bytes, inputs %s, output %s)", meta.step, config.run.name, out,
             external_data.model_bytes(out), [i.name for i in info.inputs], inference_output(info))
    return props


# The config keys this stage reads, which its rule passes (stages/__init__.py): the run's name (the
# model's metadata) and, for the torch module it builds again (kind torch, transformers), the
# model, its seed and the tokenizer it saves beside a transformers model.
KEYS = ("run.name", "run.seed", "model", "data.tokenizer", "export.samples")
HELP = "write the inference ONNX model of the merged checkpoint, checked against the eval graph"


def add_arguments(parser) -> None:
    from ..config import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--artifacts", required=True, type=Path, help="the build_artifacts folder")
    parser.add_argument("--checkpoint", required=True, type=Path, help="the merged checkpoint folder")
    parser.add_argument("--eval", required=True, type=Path, help="the eval shards")
    parser.add_argument("--out", required=True, type=Path, help="the inference model to write")


def run(args) -> None:
    from ..config import load_config

    export(load_config(args), args.artifacts, args.checkpoint, args.eval, args.out)

INT8 = f"{RESULTS}/export/model.int8.onnx"
# export.quantize: none writes no int8 model (and removes one from an earlier
# run); metrics.json then reports fp32 alone.
QUANTIZED = {} if CONFIG.export.quantize == "none" else {"int8": INT8}
# With data.tokenizer, the tokenizer travels beside the model (export_model
# removes an earlier run's when there is none).
TOKENIZER = (
    {"tokenizer": f"{RESULTS}/export/tokenizer.json"} if CONFIG.data.tokenizer else {}
)

# The trained model in its own framework's format too (src/ortflow/models/save_trained.py):
# a save_pretrained folder for kind transformers, the module's state_dict for kind torch
# (export_model removes an earlier run's of another kind).
TORCH_FORMATS = {
    "transformers": {"transformers": directory(f"{RESULTS}/export/transformers")},
    "torch": {"state_dict": f"{RESULTS}/export/model.safetensors"},
}.get(CONFIG.model.kind, {})
# A causal LM also as a decoder with a KV cache that ONNX Runtime generates from
# (src/ortflow/generation/): `ortflow generate results/<run>/export/generation
# --prompt ...`; a seq2seq model as optimum's encoder and decoders with a cache
# (src/ortflow/generation/seq2seq_export.py). Declared for model.task causal-lm and
# seq2seq, and for the built-in gpt where transformers is installed (it is exported
# as the GPT-2 it equals); with task auto
# the stage writes it too where the data make the model a causal LM, undeclared
# (export_model removes an earlier run's for any other model).
GENERATION_FOLDER = f"{RESULTS}/export/generation"
# Beside it, export.samples eval prompts with the greedy continuations of the starting
# weights and of that folder (src/ortflow/generation/samples.py), which the report shows.
SAMPLES = f"{RESULTS}/export/samples.json"
GENERATION = (
    {"generation": directory(GENERATION_FOLDER), "samples": SAMPLES}
    if (
        CONFIG.model.kind == "transformers"
        and CONFIG.model.task in ("causal-lm", "seq2seq")
    )
    or ortflow_generation.built_in_generation(CONFIG.model.kind)
    else {}
)
# A text classifier, tagger or regressor also in optimum's layout, which its
# ORTModelFor<task> loads (src/ortflow/export/ecosystem.py). Declared for those
# model.task values; with task auto the stage writes it too, undeclared (export_model
# removes an earlier run's for any other model).
OPTIMUM = (
    {"optimum": directory(f"{RESULTS}/export/optimum")}
    if CONFIG.model.kind == "transformers"
    and CONFIG.model.task
    in ("sequence-classification", "token-classification", "regression")
    else {}
)
# export.int4 (refused at config load for a model without GENERATION): the
# generation folder as int4, written and measured by quantize_model beside int8.
GENERATION_INT4 = f"{RESULTS}/export/generation-int4"
INT4 = {} if CONFIG.export.int4 is None else {"int4": directory(GENERATION_INT4)}


rule export_model:
    input:
        artifacts=ARTIFACTS,
        checkpoint=rules.merge_checkpoint.output[0],
        eval=DATA_EVAL,
    output:
        **TOKENIZER,
        **TORCH_FORMATS,
        **GENERATION,
        **OPTIMUM,
        model=f"{RESULTS}/export/model.onnx",
    log:
        f"{LOGS}/export_model.log",
    benchmark:
        f"{RESULTS}/benchmarks/export_model.tsv"
    conda:
        "../../envs/ortflow.yaml"
    params:
        config=config_json(*EXPORT_KEYS),
    shell:
        "ortflow export-model --config-json {params.config:q} --artifacts {input.artifacts:q}"
        " --checkpoint {input.checkpoint:q} --eval {input.eval:q} --out {output.model:q} > {log:q} 2>&1"


rule quantize_model:
    input:
        **({"generation": rules.export_model.output.generation} if INT4 else {}),
        model=rules.export_model.output.model,
        artifacts=ARTIFACTS,
        eval=DATA_EVAL,
    output:
        **QUANTIZED,
        **INT4,
        metrics=f"{RESULTS}/export/metrics.json",
    log:
        f"{LOGS}/quantize_model.log",
    benchmark:
        f"{RESULTS}/benchmarks/quantize_model.tsv"
    conda:
        "../../envs/ortflow.yaml"
    params:
        config=config_json(*QUANTIZE_KEYS),
        # Given even when it is no output, so that the command removes an earlier run's.
        # A function: Snakemake's lint refuses a string param that names an output.
        int8=lambda wildcards: INT8,
        generation=lambda wildcards: GENERATION_FOLDER,
        int4=lambda wildcards: GENERATION_INT4,
    shell:
        "ortflow quantize-model --config-json {params.config:q} --model {input.model:q}"
        " --artifacts {input.artifacts:q} --eval {input.eval:q} --int8 {params.int8:q}"
        " --generation {params.generation:q} --int4 {params.int4:q}"
        " --metrics {output.metrics:q} > {log:q} 2>&1"


# Not part of `all`: `snakemake generate --config generate='{prompt: "The for statement"}'`
# (or generate='{prompts: prompts.txt}', one a line) prints each prompt's greedy continuation
# from export/generation/ as it comes, and writes them to generated.jsonl; a new prompt runs
# it again. `ortflow generate` refuses a run without prompts, in one line.
rule generate:
    input:
        **({"generation": rules.export_model.output.generation} if GENERATION else {}),
        **({"prompts": CONFIG.generate.prompts} if CONFIG.generate.prompts else {}),
    output:
        f"{RESULTS}/generated.jsonl",
    log:
        f"{LOGS}/generate.log",
    conda:
        "../../envs/ortflow.yaml"
    params:
        config=config_json(*GENERATE_KEYS),
        # model.task auto writes the folder undeclared, where the data make the model a causal LM.
        folder=lambda wildcards: GENERATION_FOLDER,
    shell:
        "ortflow generate {params.folder:q} --config-json {params.config:q} --out {output:q} 2> {log:q}"

rule merge_checkpoint:
    input:
        metrics=rules.train.output.metrics,
        artifacts=ARTIFACTS,
    output:
        # `checkpoint` (ONNX Runtime's format, with optimizer state), `checkpoint.h5`, `meta.json`
        directory(f"{RESULTS}/checkpoint"),
    log:
        f"{LOGS}/merge_checkpoint.log",
    benchmark:
        f"{RESULTS}/benchmarks/merge_checkpoint.tsv"
    conda:
        "../../envs/ortflow.yaml"
    params:
        # The training identity picks this run's newest checkpoint among those of earlier configs.
        config=config_json(*TRAIN_KEYS),
        checkpoints=str(TRAIN.checkpoints),
        # export.checkpoint: the step that evaluated best, or the last one.
        which=ortflow_config.export_checkpoint(CONFIG),
    shell:
        "ortflow checkpoint merge {params.checkpoints:q} {output:q} --artifacts {input.artifacts:q}"
        " --checkpoint {params.which:q} --config-json {params.config:q} > {log:q} 2>&1"

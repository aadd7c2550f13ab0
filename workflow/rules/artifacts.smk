# ARTIFACTS_KEYS (common.smk, from build_artifacts.KEYS): the train.* keys the graphs depend on.
rule build_artifacts:
    input:
        train=DATA_TRAIN,
        model=model_files,
    output:
        directory(ARTIFACTS),
    log:
        f"{LOGS}/build_artifacts.log",
    benchmark:
        f"{RESULTS}/benchmarks/build_artifacts.tsv"
    conda:
        "../../envs/ortflow.yaml"
    params:
        config=config_json(*ARTIFACTS_KEYS),
    shell:
        "ortflow build-artifacts --config-json {params.config:q}"
        " --train {input.train:q} --out {output:q} > {log:q} 2>&1"

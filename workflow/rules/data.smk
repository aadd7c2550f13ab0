rule prepare_data:
    input:
        data_files,
    output:
        train=directory(DATA_TRAIN),
        eval=directory(DATA_EVAL),
    log:
        f"{LOGS}/prepare_data.log",
    benchmark:
        f"{RESULTS}/benchmarks/prepare_data.tsv"
    conda:
        "../../envs/ortflow.yaml"
    params:
        config=config_json(*DATA_KEYS),
    shell:
        "ortflow prepare-data --config-json {params.config:q}"
        " --train {output.train:q} --eval {output.eval:q} > {log:q} 2>&1"

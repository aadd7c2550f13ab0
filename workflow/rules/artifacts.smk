# The optimizer graph bakes in the optimizer's name, betas and eps; the learning
# rate is set by training at run time and the weight decay (with its groups,
# train.optimizer.no_decay) is applied by training, so they and the other
# train.* keys are left out of params and do not rebuild the artifacts.
rule build_artifacts:
    input:
        train=rules.prepare_data.output.train,
        model=model_files,
    output:
        directory(f"{RESULTS}/artifacts"),
    log:
        f"{LOGS}/build_artifacts.log",
    benchmark:
        f"{RESULTS}/benchmarks/build_artifacts.tsv"
    conda:
        "../../envs/ortflow.yaml"
    params:
        config=config_json(
            "run.seed",
            "model",
            "train.optimizer.name",
            "train.optimizer.betas",
            "train.optimizer.eps",
        ),
    shell:
        "ortflow build-artifacts --config-json {params.config:q}"
        " --train {input.train:q} --out {output:q} > {log:q} 2>&1"

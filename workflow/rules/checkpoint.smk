rule merge_checkpoint:
    input:
        metrics=rules.train.output.metrics,
    output:
        directory(f"{RESULTS}/checkpoint"),
    log:
        f"{LOGS}/merge_checkpoint.log",
    params:
        root=f"{RESULTS}/train/checkpoints",
    shell:
        "python -m ortflow.checkpoint merge {params.root} {output} > {log} 2>&1"

rule prepare_data:
    output:
        train=directory(f"{RESULTS}/data/train"),
        eval=directory(f"{RESULTS}/data/eval"),
    log:
        f"{LOGS}/prepare_data.log",
    params:
        config=config_json("run.seed", "data"),
    shell:
        "ortflow prepare-data --config-json {params.config:q}"
        " --train {output.train} --eval {output.eval} > {log} 2>&1"

def data_files(wildcards):
    """The user's data file, if any: editing it reruns prepare_data, and a
    missing one stops the run before any job, naming the file."""
    data = config["data"]
    if data["source"] == "text":
        return [data["text_path"]] if data["text_path"] else []
    return [] if data["source"] == "digits" else [data["source"]]


rule prepare_data:
    input:
        data_files,
    output:
        train=directory(f"{RESULTS}/data/train"),
        eval=directory(f"{RESULTS}/data/eval"),
    log:
        f"{LOGS}/prepare_data.log",
    benchmark:
        f"{RESULTS}/benchmarks/prepare_data.tsv"
    conda:
        "../../envs/ortflow.yaml"
    params:
        config=config_json("run.seed", "data"),
    shell:
        "ortflow prepare-data --config-json {params.config:q}"
        " --train {output.train} --eval {output.eval} > {log} 2>&1"

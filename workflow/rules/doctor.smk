# Not part of `all`: `snakemake doctor` checks the installation, MPI and this
# config against the machine, and fails naming what to fix.
rule doctor:
    output:
        f"{RESULTS}/doctor.txt",
    log:
        f"{LOGS}/doctor.log",
    benchmark:
        f"{RESULTS}/benchmarks/doctor.tsv"
    conda:
        "../../envs/ortflow.yaml"
    params:
        config=config_json(*DOCTOR_KEYS),
        # Not an input: the doctor runs before the artifacts exist, and then skips the model's checks.
        artifacts=ARTIFACTS,
    shell:
        "ortflow doctor --config-json {params.config:q} --artifacts {params.artifacts:q} --output {output:q} > {log:q} 2>&1"

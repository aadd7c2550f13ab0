rule train:
    input:
        train=DATA_TRAIN,
        eval=DATA_EVAL,
        artifacts=ARTIFACTS,
    output:
        # Checkpoints and TensorBoard events live beside metrics.json but are not
        # outputs: Snakemake deletes a failed job's outputs, and a rerun resumes from them.
        metrics=str(TRAIN.metrics),
    log:
        f"{LOGS}/train.log",
    benchmark:
        f"{RESULTS}/benchmarks/train.tsv"
    conda:
        "../../envs/ortflow.yaml"
    threads: min(CONFIG.train.world_size, workflow.cores)
    resources:
        tasks=CONFIG.train.world_size,
        # Slurm spreads the tasks over this many nodes (`sbatch --nodes`); locally unused.
        nodes=CONFIG.train.nodes,
        mpi="mpirun",
        # One GPU per rank on CUDA; the Slurm profile sets tasks_per_gpu=1.
        gpu=CONFIG.train.world_size if CONFIG.train.device == "cuda" else 0,
    params:
        config=config_json(*TRAIN_KEYS),
        # A function: Snakemake's lint refuses a string param that is a prefix of an output.
        folder=lambda wildcards: str(TRAIN),
    shell:
        "ortflow train --mpi {resources.mpi:q} -n {resources.tasks} --config-json {params.config:q}"
        " --train {input.train:q} --eval {input.eval:q} --artifacts {input.artifacts:q}"
        " --out {params.folder:q} > {log:q} 2>&1"

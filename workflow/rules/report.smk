# What `snakemake --report results/<run>/report.html` shows besides Snakemake's
# own pages: plots of training, and tables of the run. Each stage writes its
# runtime and memory to {RESULTS}/benchmarks/<rule>.tsv (its `benchmark:`).
BENCHMARKS = f"{RESULTS}/benchmarks"
# The page `snakemake --report` writes; the end-of-run summary prints that command.
REPORT = f"{RESULTS}/report.html"


rule plot_training:
    input:
        metrics=rules.train.output.metrics,
    output:
        loss=captioned("loss.png", "Training"),
        learning_rate=captioned("learning_rate.png", "Training"),
        throughput=captioned("throughput.png", "Training"),
    log:
        f"{LOGS}/plot_training.log",
    benchmark:
        f"{BENCHMARKS}/plot_training.tsv"
    conda:
        "../../envs/ortflow.yaml"
    params:
        config=config_json(*PLOT_KEYS),
        out=lambda wildcards, output: os.path.dirname(output.loss),
    shell:
        "ortflow report plots --config-json {params.config:q} --metrics {input.metrics:q}"
        " --out {params.out:q} > {log:q} 2>&1"


# Benchmarks and traces are read, not inputs: a stage that reruns also reruns
# quantize_model, whose metrics are an input here.
rule report_tables:
    input:
        **({"samples": rules.export_model.output.samples} if GENERATION else {}),
        train=rules.train.output.metrics,
        export=rules.quantize_model.output.metrics,
        artifacts=ARTIFACTS,
    output:
        summary=captioned("summary.html", "Run"),
        samples=captioned("samples.html", "Run"),
        quantization=captioned("quantization.html", "Run"),
        config=captioned("config.html", "Run"),
        stages=captioned("stages.html", "Stages"),
        profile=captioned("profile.html", "Stages"),
    log:
        f"{LOGS}/report_tables.log",
    benchmark:
        f"{BENCHMARKS}/report_tables.tsv"
    conda:
        "../../envs/ortflow.yaml"
    params:
        config=config_json(*TABLES_KEYS),
        benchmarks=BENCHMARKS,
        profile=str(TRAIN.profile),
        out=lambda wildcards, output: os.path.dirname(output.summary),
        # Given where there is none, so that the page says why (a function: see quantize_model's int8).
        samples=lambda wildcards: SAMPLES,
    shell:
        "ortflow report tables --config-json {params.config:q} --train-metrics {input.train:q}"
        " --samples {params.samples:q}"
        " --export-metrics {input.export:q} --benchmarks {params.benchmarks:q} --profile {params.profile:q}"
        " --model-json {input.artifacts:q}/model.json --out {params.out:q} > {log:q} 2>&1"

# ortflow: train ONNX models with ONNX Runtime, data-parallel over MPI ranks.
# The stages live in workflow/rules/; their logic lives in src/ortflow/.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/doctor.smk"
include: "workflow/rules/artifacts.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/checkpoint.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        rules.prepare_data.output,
        rules.build_artifacts.output,
        rules.train.output,
        rules.merge_checkpoint.output,
        rules.export_model.output,
        rules.quantize_model.output,
        rules.plot_training.output,
        rules.report_tables.output,


# A sweep's points and their comparison; the default target is then `sweep`
# (here, after `all`: the last default target wins, but not one from an include).
if ortflow_sweep.is_sweep(CONFIG):

    include: "workflow/rules/sweep_common.smk"
    include: "workflow/rules/sweep.smk"

    rule sweep:
        default_target: True
        input:
            rules.sweep_compare.output,
            point_outputs("plot_training"),
            point_outputs("report_tables"),


# Where the model is and how good it is, from whatever stages have run.
onsuccess:
    from ortflow.reporting.results import read_json
    from ortflow.reporting.summary import run_summary
    from ortflow.sweeps import comparison

    if ortflow_sweep.is_sweep(CONFIG):
        best = read_json(Path(rules.sweep_compare.output.best))
        if best:  # not when the targets stopped before the comparison
            print(comparison.summary(CONFIG, best, run_arguments()))
        return
    summary = run_summary(
        RESULTS,
        train_metrics=rules.train.output.metrics,
        export_metrics=rules.quantize_model.output.metrics,
        model=rules.export_model.output.model,
        int8=INT8,
        checkpoint=rules.merge_checkpoint.output[0],
        report=REPORT,
        reported=reported_files(),
        targets=workflow.dag_settings.targets,
        run_arguments=run_arguments(),
        artifacts=ARTIFACTS,
    )
    print(summary)


# Each failed stage's own error message, last on the console: nobody needs to open its log.
onerror:
    import sys
    from ortflow.reporting.failures import stage_failures
    from ortflow.sweeps import comparison

    failed = [(job.rule.name, list(job.log)) for job in workflow.scheduler.failed]
    print(stage_failures(failed), file=sys.stderr)
    # With --keep-going the points that finished are compared, the failed ones marked.
    if ortflow_sweep.is_sweep(CONFIG):
        best = comparison.compare(CONFIG, [rule for rule, _ in failed])
        print(comparison.summary(CONFIG, best, run_arguments()), file=sys.stderr)


# A run that starts from an earlier run's merged checkpoint (model.weights:
# results/<run>/checkpoint, model.weights_config: that run's config): the
# earlier run's rules are rules of this workflow too, named earlier_*, so that
# one `snakemake` call runs its stages up to merge_checkpoint first when needed
# (one `use rule` for them all: with a statement per rule, Snakemake 9.27 no
# longer finds the producer of earlier_train's metrics.json for earlier_merge_checkpoint).
if EARLIER_RUN:

    module earlier:
        snakefile:
            "Snakefile"
        config:
            EARLIER_RUN

    use rule * from earlier exclude all as earlier_*

# A sweep (the config's `sweep` section, docs/sweeps.md): each point is a run of
# this Snakefile with the point's config (src/ortflow/sweep.py names and checks
# the points), its rules named point_<point>_<rule>, its files in
# results/sweeps/<sweep>/<point>/. The data and the graphs live in the sweep's
# shared/ folder, named by the keys they depend on: the first point with those
# keys makes them, the others use its rules' outputs.
try:
    SWEEP_POINTS = ortflow_sweep.points(config)
except ortflow_config.ConfigError as error:
    raise WorkflowError(f"invalid configuration:\n{error}")
SWEEP = ortflow_sweep.folder(config)
SWEEP_LOGS = ortflow_sweep.SWEEP_LOGS / config["sweep"]["name"]


def inherit_train_settings(rule):
    """Give rule `rule`, a point's training, the settings that the profile and the command
    line give the rule `train` (set-resources, set-threads, preemptible-rules), which name
    it alone: through the Slurm profile each point's training is then one MPI job of
    train.world_size tasks started with srun, submitted again after a stop. Snakemake
    applies them by rule name when it makes the rule, from these (private) tables."""
    settings = workflow.resource_settings
    for table in (
        settings._parsed_overwrite_resources,
        settings._parsed_overwrite_threads,
    ):
        if "train" in table:
            table[rule] = table["train"]
    remote = workflow.remote_execution_settings  # None in a dry run
    if remote is not None and remote.preemptible_rules.is_preemptible("train"):
        remote.preemptible_rules.rules = frozenset(remote.preemptible_rules.rules) | {
            rule
        }


_made = set()
for _point in SWEEP_POINTS:
    # Variables, not literals: Snakemake resolves a module's name and the rules' prefix from them.
    point_module = ortflow_sweep.rule_prefix(_point)
    point_rules = f"{point_module}_*"
    inherit_train_settings(f"{point_module}_train")

    module:
        name: point_module
        snakefile:
            "../../Snakefile"
        config:
            _point.config

    _data = ortflow_sweep.shared(_point.config, "data", DATA_KEYS)
    _artifacts = ortflow_sweep.shared(
        _point.config, "artifacts", DATA_KEYS + ARTIFACTS_KEYS
    )
    if _data not in _made:

        use rule * from point_module exclude all as point_rules

    elif _artifacts not in _made:

        use rule * from point_module exclude all, prepare_data as point_rules

    else:

        use rule * from point_module exclude all, prepare_data, build_artifacts as point_rules

    _made |= {_data, _artifacts}


def point_outputs(rule):
    """The outputs of rule `rule` of every point."""
    return [
        getattr(rules, f"{ortflow_sweep.rule_prefix(p)}_{rule}").output
        for p in SWEEP_POINTS
    ]


# The comparison of every point (a failed point, with --keep-going, is marked
# failed in it: the Snakefile's onerror writes it from the points that finished).
rule sweep_compare:
    input:
        train=point_outputs("train"),
        export=point_outputs("quantize_model"),
        model=point_outputs("export_model"),
    output:
        table=report(
            f"{SWEEP}/comparison.html",
            caption="../report/sweep_comparison.rst",
            category="Sweep",
        ),
        tsv=f"{SWEEP}/comparison.tsv",
        curves=report(
            f"{SWEEP}/curves.png",
            caption="../report/sweep_curves.rst",
            category="Sweep",
        ),
        by_key=report(
            f"{SWEEP}/by_key.png",
            caption="../report/sweep_by_key.rst",
            category="Sweep",
        ),
        model=f"{SWEEP}/best/model.onnx",
        best=f"{SWEEP}/best/best.json",
    log:
        f"{SWEEP_LOGS}/sweep_compare.log",
    conda:
        "../../envs/ortflow.yaml"
    params:
        config=config_json("run", "data", "model", "train", "export", "sweep"),
    shell:
        "ortflow sweep compare --config-json {params.config:q} > {log:q} 2>&1"

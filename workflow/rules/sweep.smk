# A sweep (the config's `sweep` section, docs/sweeps.md): each point is a run of
# this Snakefile with the point's config (src/ortflow/sweeps/points.py names and checks
# the points), its rules named point_<point>_<rule>, its files in
# results/sweeps/<sweep>/<point>/. The data and the graphs live in the sweep's
# shared/ folder, named by the keys they depend on: the first point with those
# keys makes them, the others use its rules' outputs.
try:
    SWEEP_POINTS = ortflow_sweep.points(CONFIG)
except ortflow_config.ConfigError as error:
    raise WorkflowError(f"invalid configuration:\n{error}")
SWEEP = ortflow_sweep.folder(CONFIG)
SWEEP_LOGS = ortflow_sweep.SWEEP_LOGS / CONFIG.sweep.name
SWEEP_KEYS = declared_keys("sweep")


# With sweep.halving, a point is two runs: to the first budget, and on from it.
SWEEP_RUNS = {ortflow_sweep.rule_prefix(p): p.config for p in SWEEP_POINTS}
for _point in SWEEP_POINTS:
    if _point.first:
        SWEEP_RUNS[f"{ortflow_sweep.rule_prefix(_point)}_first"] = _point.first

_made = set()
for point_module, _config in SWEEP_RUNS.items():
    # Variables, not literals: Snakemake resolves a module's name and the rules' prefix from them.
    point_rules = f"{point_module}_*"
    inherit_train_settings(f"{point_module}_train")

    module:
        name: point_module
        snakefile:
            "../../Snakefile"
        config:
            ortflow_config.as_dict(_config)

    _data = ortflow_sweep.shared(_config, "data", DATA_KEYS)
    _artifacts = ortflow_sweep.shared(
        _config, "artifacts", DATA_KEYS + ARTIFACTS_KEYS
    )
    if _data not in _made:

        use rule * from point_module exclude all as point_rules

    elif _artifacts not in _made:

        use rule * from point_module exclude all, prepare_data as point_rules

    else:

        use rule * from point_module exclude all, prepare_data, build_artifacts as point_rules

    _made |= {_data, _artifacts}


# With sweep.halving, the points whose runs go on, decided when every run to the
# first budget is done (a Snakemake checkpoint: the jobs after it depend on it).
if CONFIG.sweep.halving.steps:

    checkpoint sweep_halving:
        input:
            [point_rule(p, "train", first=True).output for p in SWEEP_POINTS],
        output:
            f"{SWEEP}/{ortflow_sweep.HALVING}",
        log:
            f"{SWEEP_LOGS}/sweep_halving.log",
        conda:
            "../../envs/ortflow.yaml"
        params:
            config=config_json(*SWEEP_KEYS),
        shell:
            "ortflow sweep halve --config-json {params.config:q} > {log:q} 2>&1"


# The comparison of every point (a failed point, with --keep-going, is marked
# failed in it: the Snakefile's onerror writes it from the points that finished).
rule sweep_compare:
    input:
        train=point_outputs("train"),
        export=point_outputs("quantize_model"),
        model=point_outputs("export_model"),
        # With sweep.halving, the runs to the first budget: those of the stopped points are in the table.
        first=[
            point_rule(p, "train", first=True).output
            for p in SWEEP_POINTS
            if CONFIG.sweep.halving.steps
        ],
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
        config=config_json(*SWEEP_KEYS),
    shell:
        "ortflow sweep compare --config-json {params.config:q} > {log:q} 2>&1"

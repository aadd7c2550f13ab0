# The functions of a sweep's rules (workflow/rules/sweep.smk): the points' rules,
# the outputs of those that go on, and the settings a point's training takes from `train`.


def inherit_train_settings(name):
    """Give rule `name`, a point's training, the settings that the profile and the command
    line give the rule `train` (set-resources, set-threads, preemptible-rules), which name
    it alone: through the Slurm profile each point's training is then one MPI job of
    train.world_size tasks started with srun, submitted again after a stop. Snakemake
    applies them by name when it makes a rule, from these private tables; its public
    settings (ResourceSettings.overwrite_resources, an immutable map) can only be read, and
    a `use` statement's `with` cannot rename the profile's entry (Snakemake 9.27)."""
    settings = workflow.resource_settings
    for table in (
        settings._parsed_overwrite_resources,
        settings._parsed_overwrite_threads,
    ):
        if "train" in table:
            table[name] = table["train"]
    remote = workflow.remote_execution_settings  # None in a dry run
    if remote is not None and remote.preemptible_rules.is_preemptible("train"):
        remote.preemptible_rules.rules = frozenset(remote.preemptible_rules.rules) | {
            name
        }


def point_rule(point, name, first=False):
    """Rule `name` of a point's run (`first`: of its run to the first budget)."""
    return getattr(
        rules, f"{ortflow_sweep.rule_prefix(point)}{'_first' if first else ''}_{name}"
    )


def going_on():
    """The points whose own runs are made: all of them, or halving's survivors."""
    if not CONFIG.sweep.halving.steps:
        return SWEEP_POINTS
    halving = json.loads(Path(checkpoints.sweep_halving.get().output[0]).read_text())
    return [p for p in SWEEP_POINTS if p.name in halving["survivors"]]


def point_outputs(name):
    """The outputs of rule `name` of every point that goes on (an input function)."""
    return lambda wildcards: [
        str(f) for p in going_on() for f in point_rule(p, name).output
    ]

import json
import os
from pathlib import Path

from ortflow import config as ortflow_config
from ortflow import generation as ortflow_generation
from ortflow.sweeps import points as ortflow_sweep
from ortflow import user_files
from ortflow.data import examples as ortflow_examples
from ortflow.errors import OrtflowError
from ortflow.stages import declared_keys
from ortflow.training.run_folder import TrainFolder

# Validate before any job runs: a typo or a bad value fails here, naming the key.
try:
    # --config's nested values arrive as text (`train={steps: 20}`), read as the user typed them;
    # a config file's are typed by YAML, and a wrong type there stops the run.
    _validated = ortflow_config.validate(
        config, command_line=workflow.config_settings.config
    )
    # The rules read the config typed (`CONFIG.train.world_size`); Snakemake's own `config`
    # stays the dict it passes on, of which each rule takes the keys it depends on.
    CONFIG = ortflow_config.typed(_validated)
    # The run whose merged checkpoint model.weights names, if model.weights_config
    # gives its config: the Snakefile makes its stages rules of this workflow.
    EARLIER_RUN = ortflow_config.earlier_run(CONFIG)
except ortflow_config.ConfigError as error:
    raise WorkflowError(f"invalid configuration:\n{error}")
config.clear()
config.update(_validated)

# The tokenizer's, the weights' and a transformers model's files, checked before anything reads them (no links,
# no special files, tokenizer files within their size cap; src/ortflow/user_files.py):
# a folder's are only those its loader reads.
try:
    TOKENIZER_FILES = (
        user_files.tokenizer_files(CONFIG.data.tokenizer)
        if CONFIG.data.tokenizer
        else []
    )
    if CONFIG.model.weights:
        user_files.weights_files(CONFIG.model.weights)
    MODEL_FILES = (
        user_files.model_files(CONFIG.model.path)
        if CONFIG.model.kind == "transformers"
        else []
    )
except OrtflowError as error:
    raise WorkflowError(str(error))

RUN = CONFIG.run.name
# A sweep's point (sweep.point, set by workflow/rules/sweep.smk) lives in its sweep's folder.
RESULTS = str(ortflow_sweep.results(CONFIG))
LOGS = str(ortflow_sweep.logs(CONFIG))
# The training folder's layout is ortflow's (src/ortflow/training/run_folder.py).
TRAIN = TrainFolder(f"{RESULTS}/train")


def config_json(*keys):
    """The parts of the config a rule depends on (dotted keys, any depth), as JSON for `--config-json`.
    A rule reruns when these change, and only these. A function of the job's wildcards, as Snakemake
    leaves its value alone: a string would have its {name} parts taken for wildcards, as a Jinja chat
    template in data.chat_template has ({{ bos_token }})."""
    text = json.dumps(ortflow_config.pick(config, keys), sort_keys=True)
    return lambda wildcards: text


# The config keys each stage reads, as its module declares them (KEYS in src/ortflow/stages/<stage>.py,
# which says why each is there): its rule passes it exactly those, and reruns when they change.
DATA_KEYS = declared_keys("prepare_data")
ARTIFACTS_KEYS = declared_keys("build_artifacts")
# The merge picks the newest checkpoint of the training identity, from training's keys.
TRAIN_KEYS = declared_keys("train")
EXPORT_KEYS = declared_keys("export_model")
QUANTIZE_KEYS = declared_keys("quantize_model")
PLOT_KEYS = declared_keys("report", "PLOT_KEYS")
TABLES_KEYS = declared_keys("report", "TABLES_KEYS")
DOCTOR_KEYS = declared_keys("doctor")
GENERATE_KEYS = declared_keys("generate")
# A sweep's points share these stages: each lives in the sweep's shared/ folder,
# named by the digest of the keys it depends on, and runs once for the points
# whose keys are equal (workflow/rules/sweep.smk).
if CONFIG.sweep.point:
    DATA = str(ortflow_sweep.shared(CONFIG, "data", DATA_KEYS))
    ARTIFACTS = str(
        ortflow_sweep.shared(CONFIG, "artifacts", DATA_KEYS + ARTIFACTS_KEYS)
    )
else:
    DATA = f"{RESULTS}/data"
    ARTIFACTS = f"{RESULTS}/artifacts"
DATA_TRAIN = f"{DATA}/train"
DATA_EVAL = f"{DATA}/eval"


def data_files(wildcards):
    """The user's data file and tokenizer, if any: editing them reruns
    prepare_data, and a missing one stops the run before any job, naming it.
    A save_pretrained tokenizer folder counts by the tokenizer files read from it,
    a datasets folder by its files, data.chat_template by its file if it names one."""
    data = CONFIG.data
    if data.source == "text":
        files = [data.text_path] if data.text_path else []
    else:
        files = (
            []
            if data.source == "digits"
            else ortflow_examples.source_files(data.source)
        )
    template = ortflow_examples.template_file(data.chat_template)
    return (
        files
        + [str(file) for file in TOKENIZER_FILES]
        + ([str(template)] if template else [])
    )


def model_files(wildcards):
    """The user's model files, if any: replacing one reruns build_artifacts. For
    `kind: onnx` model.path; for `kind: torch` the file of the module in
    model.path (`package.module:Class`) when it is in the working directory or
    on PYTHONPATH, where build_artifacts imports it from; for `kind: transformers`
    the folder's config and weights files; and model.weights (an
    earlier run's results/<run>/checkpoint is that run's merge_checkpoint output)."""
    model = CONFIG.model
    weights = [model.weights] if model.weights else []
    if model.kind == "onnx":
        return [model.path, *weights]
    if model.kind == "torch":
        return module_file(model.path.partition(":")[0]) + weights
    return [str(file) for file in MODEL_FILES] + weights


def module_file(name):
    """The file of module `name` (`package.module`), found by path alone:
    importlib's find_spec would import the parent packages, running user code
    in Snakemake. [] for a module found elsewhere (installed) or not at all."""
    roots = [".", *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    for root in roots:
        base = Path(root, *name.split("."))
        for candidate in (base.with_name(f"{base.name}.py"), base / "__init__.py"):
            if candidate.is_file():
                return [str(candidate)]
    return []


def captioned(name, category):
    """An output shown in the report, with its caption workflow/report/<name>.rst."""
    return report(
        f"{RESULTS}/report/{name}",
        caption=f"../report/{name.split('.')[0]}.rst",
        category=category,
    )


def reported_files():
    """The files of every rule marked for the report (those of `captioned`)."""
    from snakemake.io import is_flagged

    return [
        f for rule in workflow.rules for f in rule.output if is_flagged(f, "report")
    ]


def run_arguments():
    """The command-line arguments that chose this run, for the commands the
    summary prints: the Snakefile when `snakemake` would not find it here by
    itself, the --configfile files (which Snakemake keeps in
    workflow.config_settings; workflow.configfiles also lists config/config.yaml)
    and the --config entries."""
    arguments = []
    snakefile = Path(workflow.main_snakefile).resolve()
    if snakefile != Path("Snakefile").resolve():
        arguments += ["--snakefile", str(snakefile)]
    here = Path.cwd()
    files = workflow.config_settings.configfiles
    if files:
        arguments += ["--configfile"]
        arguments += [
            str(f.relative_to(here) if f.is_relative_to(here) else f) for f in files
        ]
    if workflow.config_settings.config_args:
        arguments += ["--config", *workflow.config_settings.config_args]
    return arguments

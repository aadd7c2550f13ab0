import json
import os
import sys

from ortflow import config as ortflow_config

# Validate before any job runs: a typo or a bad value fails here, naming the key.
try:
    _validated = ortflow_config.validate(config)
except ortflow_config.ConfigError as error:
    raise WorkflowError(f"invalid configuration:\n{error}")
config.clear()
config.update(_validated)

# Rules call the `ortflow` command of the environment that runs Snakemake,
# activated or not.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]

RUN = config["run"]["name"]
RESULTS = f"results/{RUN}"
LOGS = f"logs/{RUN}"


def config_json(*keys):
    """The parts of the config a rule depends on (dotted keys, any depth), as JSON for `--config-json`.
    A rule reruns when these change, and only these."""
    picked = {}
    for key in keys:
        *sections, name = key.split(".")
        source, target = config, picked
        for section in sections:
            source, target = source[section], target.setdefault(section, {})
        target[name] = source[name]
    return json.dumps(picked, sort_keys=True)

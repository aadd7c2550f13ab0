"""Snakemake, with the Slurm executor asking for job states every
--slurm-init-seconds-before-status-checks seconds, as the Slurm tests run it.

The executor (snakemake-executor-plugin-slurm 2.8.0) adds 10 s to its interval
at each check that finds no job finished, up to 180 s, and has no setting for
that: with checks 2, 14, 36, 68, 110 s after a job starts, a 70 s training job
is seen finished 40 s late, and every job of a test waits so. Here the interval
stays at its first value; what the executor does at each check is unchanged.
(Not for users: on a real cluster the growing interval spares slurmdbd.)"""

import sys

from snakemake.cli import main
from snakemake_executor_plugin_slurm import Executor
from snakemake_interface_executor_plugins.executors.remote import RemoteExecutor

interval = RemoteExecutor.__dict__["next_seconds_between_status_checks"]


def first_interval(executor: Executor, _grown: float) -> None:
    interval.fset(executor, executor.workflow.executor_settings.init_seconds_before_status_checks)


Executor.next_seconds_between_status_checks = interval.setter(first_interval)

if __name__ == "__main__":
    sys.exit(main())

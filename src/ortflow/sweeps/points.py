"""A sweep's points: many runs from one config, one per point of its `sweep` section (a
grid, random draws, repeats over run.seed), named from their values and checked before
any job runs. The workflow (workflow/rules/sweep.smk) makes each point a run of its own,
with every stage, from `points(config)`, in results/sweeps/<name>/<point>/.

The Snakefile imports this module: it imports nothing heavy at its top."""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, ConfigError, as_dict, pick, read_value, replace
from ..config.sections import Halving, Random, Sweep
from ..digests import digest
from ..training.run_folder import TrainFolder

SWEEPS = Path("results", "sweeps")
SWEEP_LOGS = Path("logs", "sweeps")
# With sweep.halving: which points go on after the first budget (`ortflow sweep halve`).
HALVING = "halving.json"


@dataclass(frozen=True)
class Point:
    name: str  # readable and stable: from the point's values alone (micro_batch_size-16_lr-0.001)
    values: dict  # dotted config key -> this point's value
    config: Config  # the validated config of the point's run
    first: Config | None = None  # with sweep.halving: the config of its run to the first budget


def is_sweep(config: Config) -> bool:
    """Whether `config` asks for a sweep (a grid or random points), rather than being one run."""
    sweep = config.sweep
    return not sweep.point and bool(sweep.grid or sweep.random.points)


def folder(config: Config) -> Path:
    """results/sweeps/<name>: the comparison, and a folder per point."""
    return SWEEPS / config.sweep.name


def results(config: Config) -> Path:
    """A run's folder: results/<run.name>, or results/sweeps/<sweep>/<point> for a sweep's point."""
    point = config.sweep.point
    return folder(config) / point if point else Path("results", config.run.name)


def logs(config: Config) -> Path:
    point = config.sweep.point
    return SWEEP_LOGS / config.sweep.name / point if point else Path("logs", config.run.name)


def shared(config: Config, stage: str, keys) -> Path:
    """The folder of a stage that a sweep's points share: named by the config keys it
    depends on (`data-<digest>`), so that the points whose keys are equal find it made."""
    return folder(config) / "shared" / f"{stage}-{digest(pick(as_dict(config), keys))[:12]}"


def rule_prefix(point: Point) -> str:
    """The prefix of a point's rules (`point_lr_0_001_train`): a Python name."""
    return "point_" + re.sub(r"\W", "_", point.name)


def goal(sweep: Sweep) -> str:
    if sweep.goal != "auto":
        return sweep.goal
    return "max" if sweep.metric == "accuracy" else "min"


def points(config: Config) -> list[Point]:
    """Every point of the sweep, each config validated: a bad key or value
    names the point and the key, before any job runs."""
    sweep = config.sweep
    for key in [*sweep.grid, *sweep.random.ranges]:
        if key == "run.name" or key.split(".")[0] == "sweep":
            raise ConfigError(f"config key 'sweep': '{key}' cannot be swept (the sweep names each point's run)")
    combinations = [{}]
    # Keys in sorted order, here and in the draws: the names and the draws do not depend on the
    # order the keys are written in (the rules pass the config as JSON with sorted keys).
    # The values as written (a list a list, as the comparison's columns show them), not as typed.
    for key, values in sorted(as_dict(sweep.grid).items()):
        combinations = [{**c, key: value} for c in combinations for value in values]
    draws = random_draws(sweep.random)
    # Each value as the point's config will read it, so that its name and its column say the
    # same (YAML gives `1e-3` as text, the config reads it as 0.001).
    chosen = [{key: read_value(key, value) for key, value in sorted({**c, **d}.items())}
              for c in combinations for d in draws]
    if sweep.repeats > 1:
        seed = config.run.seed
        chosen = [{**c, "run.seed": seed + r} for c in chosen for r in range(sweep.repeats)]
    named = {point_name(values): values for values in chosen}
    if len(named) < len(chosen):
        raise ConfigError("config key 'sweep': two points have the same values; list each value once")
    chosen = [Point(name, values, point_config(config, name, values)) for name, values in named.items()]
    return [halved(point, sweep.halving) for point in chosen] if sweep.halving.steps else chosen


def halved(point: Point, halving: Halving) -> Point:
    """`point` with the run to the first budget of steps (its name `<point>.steps-<budget>`), from
    whose last checkpoint the point's own run goes on when the point is kept (train.resume_from)."""
    budget, train, run = halving.steps, point.config.train, point.config.run
    if train.lr_schedule.name != "constant":
        raise ConfigError(f"sweep point {point.name!r}: config key 'sweep.halving.steps' needs "
                          f"train.lr_schedule.name: constant, not {train.lr_schedule.name!r} (a decaying "
                          "schedule spreads over train.steps: the first budget would train differently)")
    if budget >= train.steps:
        raise ConfigError(f"sweep point {point.name!r}: config key 'sweep.halving.steps': {budget} is not below "
                          f"train.steps={train.steps}")
    from ..checkpoints.layout import step_dir  # numpy and ONNX: not for every Snakefile that imports this

    first = replace(point.config, {"sweep.point": f"{point.name}.steps-{budget}",
                                   "run.name": f"{run.name}.steps-{budget}", "train.steps": budget})
    resume = step_dir(TrainFolder(results(first) / "train").checkpoints, budget)
    return Point(point.name, point.values, replace(point.config, {"train.resume_from": str(resume)}), first)


def random_draws(random_search: Random) -> list[dict]:
    """random.points draws from random.ranges with random.seed, one value per range (by key):
    adding draws keeps the earlier ones. Floats keep 4 significant digits,
    so that the name shows the value trained."""
    if not random_search.points:
        return [{}]
    generator = random.Random(random_search.seed)
    ranges = as_dict(random_search.ranges)  # a choice's values as written, as the grid's
    draws = []
    for _ in range(random_search.points):
        draw = {}
        for key, ((kind, bounds),) in ((k, tuple(r.items())) for k, r in sorted(ranges.items())):
            if kind == "choice":
                draw[key] = generator.choice(bounds)
                continue
            low, high = (math.log(b) for b in bounds) if kind == "log_uniform" else bounds
            value = generator.uniform(low, high)
            draw[key] = float(f"{math.exp(value) if kind == 'log_uniform' else value:.4g}")
        draws.append(draw)
    return draws


def point_name(values: dict) -> str:
    """`micro_batch_size-16_lr-0.001`: each key (in sorted order) by its last part (the whole dotted key when
    two keys share it), then the value; characters a folder name should not have become '_'."""
    last = [key.split(".")[-1] for key in values]
    parts = []
    for key, value in values.items():
        label = key.split(".")[-1] if last.count(key.split(".")[-1]) == 1 else key
        parts.append(f"{label}-{format_value(value)}")
    return re.sub(r"[^A-Za-z0-9._-]", "_", "_".join(parts)) or "base"


def format_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):  # 0.001, 3e-05 as 3e-5, 1e+09 as 1e9
        return re.sub(r"e([+-])0*(\d)", lambda m: "e" + m[1].strip("+") + m[2], f"{value:g}")
    if isinstance(value, (list, tuple)):
        return "-".join(format_value(v) for v in value)
    return str(value)


def point_config(config: Config, name: str, values: dict) -> Config:
    """The base config with the point's values, as the run of point `name` of the sweep: its own
    sweep section says only which point it is."""
    sweep = config.sweep.name
    try:
        return replace(config, {"sweep": {"name": sweep, "point": name}, **values, "run.name": f"{sweep}.{name}"})
    except ConfigError as error:
        raise ConfigError(f"sweep point {name!r}: {error}") from None

"""Which evaluation was the best so far, and whether a run has stopped improving
(train.early_stopping: metric, mode, patience, min_delta), as Hugging Face's
Trainer does with metric_for_best_model and EarlyStoppingCallback.

The state is a function of the evaluations logged so far, which a checkpoint
keeps in its history: a resumed run replays them and stops at the same step as
one that never stopped."""

from __future__ import annotations

from ..errors import ConfigError

# The eval metrics of each task (evaluation.eval_results).
METRICS = {"classification": ("loss", "accuracy"), "language_model": ("loss", "accuracy", "perplexity"),
           "regression": ("loss",)}


class Best:
    """The best evaluation (step, value) of the metric, and the evaluations since it."""

    def __init__(self, settings, task: str, evaluations: list[dict]):
        """`settings`: train.early_stopping."""
        self.metric, self.patience, self.min_delta = settings.metric, settings.patience, settings.min_delta
        if self.metric not in METRICS[task]:
            raise ConfigError(f"config key 'train.early_stopping.metric': {self.metric!r} is not an eval metric of a "
                              f"{task.replace('_', ' ')} model; use one of {', '.join(METRICS[task])}")
        mode = settings.mode if settings.mode != "auto" else ("max" if self.metric == "accuracy" else "min")
        self.mode, self.sign = mode, (1.0 if mode == "min" else -1.0)
        self.step: int | None = None
        self.value: float | None = None
        self.since = 0  # evaluations since the best
        for entry in evaluations:  # those before the checkpoint resumed from
            self.update(entry["step"], entry)

    def update(self, step: int, results: dict) -> bool:
        """Take the evaluation after step `step`; whether it is the new best."""
        value = results[self.metric]
        if self.value is None or self.sign * (self.value - value) > self.min_delta:
            self.step, self.value, self.since = step, value, 0
            return True
        self.since += 1
        return False

    @property
    def exhausted(self) -> bool:
        """Has the run gone `patience` evaluations without improving?"""
        return self.patience is not None and self.since >= self.patience

    def describe(self) -> dict:
        return {"step": self.step, "metric": self.metric, "mode": self.mode, "value": self.value}

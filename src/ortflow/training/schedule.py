"""Learning-rate schedules with linear warmup, as functions of the optimizer step.

ORT's only built-in scheduler (LinearLRScheduler) follows the optimizer's own
step count; computing the rate here and calling `Optimizer.set_learning_rate`
each step keeps resume and every schedule the same simple code.
"""

from __future__ import annotations

import math


def learning_rate(step: int, total_steps: int, base_lr: float, schedule) -> float:
    """The rate for optimizer step `step` (0-based) of `total_steps`."""
    warmup = schedule.warmup_steps
    if step < warmup:
        return base_lr * (step + 1) / warmup
    min_lr = base_lr * schedule.min_lr_ratio
    name = schedule.name
    if name == "constant":
        return base_lr
    decay_steps = max(total_steps - warmup, 1)
    progress = min((step - warmup) / decay_steps, 1.0)
    if name == "linear":
        factor = 1.0 - progress
    elif name == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif name == "polynomial":
        factor = (1.0 - progress) ** schedule.power
    else:
        raise ValueError(f"train.lr_schedule.name: unknown schedule {name!r}")
    return min_lr + (base_lr - min_lr) * factor


def is_time(done: int, period: int, steps: int) -> bool:
    """Is it time for something done every `period` steps (logging, evaluating,
    checkpointing) after `done` of `steps` steps? Also after the last step."""
    return done % period == 0 or done == steps

"""The training stage: launcher, the per-rank loop, communication, schedules, metrics."""

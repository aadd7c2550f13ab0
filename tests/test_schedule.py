"""The learning-rate schedules (ortflow.training.schedule): warmup, then each decay to its floor."""

from __future__ import annotations

import pytest

from ortflow import config
from ortflow.training import schedule


@pytest.mark.parametrize("name", ["constant", "linear", "cosine", "polynomial"])
def test_schedules_warm_up_then_decay_to_the_floor(name):
    cfg = config.load(overrides={"train": {"lr_schedule": {"name": name, "warmup_steps": 10, "min_lr_ratio": 0.1,
                                                            "power": 2.0}}}).train.lr_schedule
    rates = [schedule.learning_rate(s, 100, 1.0, cfg) for s in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(rates[:10], rates[1:10]))
    if name == "constant":
        assert rates[-1] == 1.0
    else:
        assert all(a >= b for a, b in zip(rates[10:], rates[11:]))
        assert 0.1 <= rates[-1] < 0.15
    if name == "cosine":
        assert rates[55] == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-9)  # half way down


def test_is_time_every_period_and_at_the_end():
    assert [d for d in range(1, 26) if schedule.is_time(d, 10, 25)] == [10, 20, 25]

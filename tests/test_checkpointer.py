"""When the ranks write a checkpoint together: the checkpointer decides (training/checkpointer.py)."""

from __future__ import annotations

import signal

from ortflow.training.checkpointer import Checkpointer


def checkpointer(every: int, steps: int) -> Checkpointer:
    saver = Checkpointer.__new__(Checkpointer)  # its decision needs the periods alone, not a run folder
    saver.every, saver.steps = every, steps
    return saver


def test_a_checkpoint_is_saved_every_period_and_after_the_last_step_only_then_by_default():
    saver = checkpointer(every=10, steps=25)
    saved = [done for done in range(1, 26) if saver.should_save(done, None, False, False)]
    assert saved == [10, 20, 25]


def test_a_stop_a_new_best_and_an_ended_patience_each_save_between_periods():
    saver = checkpointer(every=10, steps=25)
    assert saver.should_save(7, signal.SIGTERM, False, False)
    assert saver.should_save(7, None, True, False)
    assert saver.should_save(7, None, False, True)
    assert not saver.should_save(7, None, False, False)

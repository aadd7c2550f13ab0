"""Stopping a run (ortflow.training.stop): each rank's vote rides with the loss, and the
ranks agree on one reason. Signals to real ranks: test_checkpoint.py."""

from __future__ import annotations

import signal

import numpy as np

from ortflow.training import stop


def test_stop_votes_ride_with_the_loss_and_agree_on_one_reason():
    assert stop.agreed([0.0, 0.0, 0.0, 0.0]) is None
    request = stop.StopRequest()
    assert request.votes() == [0.0, 0.0, 0.0, 0.0]
    request._note(signal.SIGUSR1, None)
    request._note(signal.SIGTERM, None)  # the first signal is the reason
    other = [0.0, 0.0, 0.0, 1.0]  # another rank lost its parent
    summed = np.add(request.votes(), other)
    assert stop.agreed(summed) == signal.SIGUSR1
    assert stop.describe(summed) == "SIGUSR1 on 1 rank, parent process exited (SIGHUP) on 1 rank"
    assert stop.agreed(np.add(summed, [2.0, 0.0, 0.0, 0.0])) == signal.SIGTERM

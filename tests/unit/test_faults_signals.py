"""Ctrl-C / SIGTERM as a graceful stop (colo.run.signals): raised where the driver is, held over a step's
train..save, at once on the second signal, counted only during the cleanup."""
from __future__ import annotations

import os
import signal

import pytest

from colo.run.signals import StopSignals


def send(sig: int) -> None:
    os.kill(os.getpid(), sig)  # the handler runs before os.kill returns (main thread)


def test_first_signal_stops_unless_held_second_at_once() -> None:
    before = signal.getsignal(signal.SIGTERM)  # SIG_DFL, or a pytest-xdist worker's own handler
    stop = StopSignals()
    stop.install()
    try:
        with pytest.raises(KeyboardInterrupt):
            send(signal.SIGTERM)
        assert (stop.name, stop.exit_status, stop.hurry) == ("SIGTERM", 143, False)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is before

    stop = StopSignals()
    stop.install()
    try:
        stop.hold()  # the train phase: the stop waits until the step is saved
        send(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            stop.release()
        assert (stop.exit_status, stop.hurry) == (130, False)
        stop.hold()
        with pytest.raises(KeyboardInterrupt):  # a second signal does not wait for the step
            send(signal.SIGINT)
        assert stop.hurry
        stop.closing = True
        send(signal.SIGINT)  # the cleanup is not interrupted, only counted
        assert stop.count == 3
    finally:
        stop.restore()

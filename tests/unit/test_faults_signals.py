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


HUNG_UP = """import os, subprocess, sys, time
from colo.run.signals import StopSignals, hangup_blocked
stop = StopSignals()
stop.install()
with hangup_blocked():  # as colo.cluster.placement.init_ray starts Ray's head: in this process group
    kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
try:
    print("ready", kid.pid, flush=True)  # the test hangs up once it reads this: the stop may come inside print
    while True:
        print("a progress bar", flush=True)  # on a hung-up terminal: EIO, unless the output was detached
        time.sleep(0.05)
except KeyboardInterrupt:
    print("colo: stopped by", stop.name, flush=True)
    with open(sys.argv[1], "w") as f:
        f.write(f"{stop.name} {kid.poll()} {stop.hurry}")
    kid.kill()
    sys.exit(stop.exit_status)
"""


def test_a_closed_terminal_stops_like_sigterm_and_spares_the_children(tmp_path) -> None:
    """The terminal closes: its pty hangs up (writes to it fail with EIO, its session leader gets SIGHUP) and the
    shell sends SIGHUP to the job's process group. The driver stops as on SIGTERM (status 129, even when the second
    hangup comes as Python exits); a child started
    under hangup_blocked() (Ray's head) lives on until the driver stops it; writing on never fails."""
    import pty
    import sys
    import time

    from conftest import clean_env

    out = tmp_path / "out"
    pid, master = pty.fork()  # the child: a session leader with the pty as its terminal
    if pid == 0:  # a shell's job: SIGHUP as a terminal leaves it (not as `nohup pytest` would pass it on: ignored)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        os.execve(sys.executable, [sys.executable, "-c", HUNG_UP, str(out)], clean_env())
    seen = b""
    deadline = time.monotonic() + 120
    while b"ready" not in seen:
        assert time.monotonic() < deadline, seen
        seen += os.read(master, 1024)
    os.close(master)  # the terminal window closes
    os.killpg(pid, signal.SIGHUP)  # and its shell hangs up the job's process group
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 129, (status, out.read_text() if out.exists() else "")
    assert out.read_text() == "SIGHUP None False"  # the child still ran; the second hangup did not hurry the stop


def test_nohup_keeps_sighup_ignored() -> None:
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as `nohup` starts a run
    stop = StopSignals()
    stop.install()
    try:
        send(signal.SIGHUP)  # ignored: nothing raised
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and stop.count == 0
    finally:
        stop.restore()
        signal.signal(signal.SIGHUP, before)

"""Ctrl-C, SIGTERM (a batch scheduler's preemption) and SIGHUP (the terminal closed) as a graceful stop of the
driver.

    stop = StopSignals()
    stop.install()          # SIGINT, SIGTERM, SIGHUP: the first raises StopRequested (a KeyboardInterrupt) where
    ...                     # the driver is, unless held; a second one raises it at once, held or not (stop.hurry)
    stop.hold()             # from the train phase until the step is logged and saved: the trainers'
    ...                     # weights and the data position must not part (a stop would save them apart)
    stop.release()          # raises the KeyboardInterrupt that came while held, if one did
    stop.closing = True     # the run's cleanup: signals are counted only, a second one shortens its waits
    stop.restore()          # the handlers that were there before

A KeyboardInterrupt and not an exception of colo's own: Ray's blocking calls (ray.get, ray.wait) poll for
signals and turn a KeyboardInterrupt raised there into their own, while any other exception raised from a
handler inside them comes back as a SystemError once the call returns. `signum` says which signal it was,
`hurry` whether a second one came (then nothing more is saved: the run exits at once, cleaning up only).
stop_signalled() tells a stop apart from a KeyboardInterrupt that user code raised itself (a reward function's:
colo.algo.rewards reports that one as the function's error).

SIGHUP: a closed terminal sends it to its whole foreground process group, which holds Ray's head processes
(gcs_server, raylet, its agents): they block SIGINT but not SIGHUP, so they died at once and the driver could
save nothing. Processes started inside `hangup_blocked()` (colo.cluster.placement.init_ray) inherit SIGHUP
blocked, and the driver, once hung up, sends its output to /dev/null where it went to the terminal or a pipe
(writes there fail with EIO or EPIPE, which would turn the stop into an error). A run started under `nohup`
(SIGHUP ignored) keeps ignoring it.
"""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}  # 128 + signal number, as shells say


class StopRequested(KeyboardInterrupt):
    """A stop signal came (raised by StopSignals' handler; inside Ray's blocking calls Ray re-raises it as a plain
    KeyboardInterrupt)."""


class StopSignals:
    def __init__(self) -> None:
        self.signum: int | None = None  # the first stop signal, once one came
        self.count = 0
        self.held = False
        self._pending = False
        self.closing = False  # shutting down: signals are only counted (a second one shortens the waits)
        self.hung_up = False  # SIGHUP came: it stays ignored from then on, restore() included
        self._previous: dict[int, object] = {}
        self._streams: list[tuple[str, object]] = []  # (sys attribute, the stream it held before install)

    @property
    def hurry(self) -> bool:
        """A second stop signal came: exit at once, save nothing more."""
        return self.count > 1

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS.get(self.signum, 128 + (self.signum or 0))

    def install(self) -> None:
        """Take SIGINT, SIGTERM and SIGHUP; again after ray.init, which sets a SIGTERM handler of its own
        (sys.exit). SIGHUP stays ignored where it was (`nohup`: the run is meant to outlive its terminal)."""
        for sig in STOP_SIGNALS:
            if sig == signal.SIGHUP and self._previous.get(sig, signal.getsignal(sig)) == signal.SIG_IGN:
                self._previous.setdefault(sig, signal.SIG_IGN)
                continue
            previous = signal.signal(sig, self._on_signal)
            self._previous.setdefault(sig, previous)
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if not isinstance(stream, HangupSafe):
                self._streams.append((name, stream))
                setattr(sys, name, HangupSafe(stream))

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if sig == signal.SIGHUP and self.hung_up else handler)
        self._previous.clear()
        for name, stream in reversed(self._streams):
            if isinstance(getattr(sys, name), HangupSafe) and getattr(sys, name).stream is stream:
                setattr(sys, name, stream)
        self._streams.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            # a closed terminal hangs up twice (the pty's own SIGHUP and the shell's to the job): the second says
            # nothing new, so it neither hurries the stop nor, once Python's exit has put SIG_DFL back, kills it
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            self.hung_up = True
            detach_terminal()
        self.count += 1
        if self.signum is None:
            self.signum = signum
        if self.closing:
            return
        if self.held and not self.hurry:
            self._pending = True
            return
        raise StopRequested

    def hold(self) -> None:
        self.held = True

    def release(self) -> None:
        self.held = False
        if self._pending:
            self._pending = False
            raise StopRequested


def stop_signalled() -> bool:
    """Whether a KeyboardInterrupt raised now is a stop: no StopSignals holds SIGINT (Python's own handler: it came
    from Ctrl-C), or the one that does has received a signal. False means user code raised it itself."""
    handler = signal.getsignal(signal.SIGINT)
    owner = getattr(handler, "__self__", None)
    return not isinstance(owner, StopSignals) or owner.count > 0


@contextlib.contextmanager
def hangup_blocked() -> Iterator[None]:
    """Processes started inside inherit SIGHUP blocked (a blocked mask survives fork and exec; a handler does not),
    so a terminal's hangup of the process group leaves them to the driver's orderly stop. This thread's SIGHUP is
    blocked meanwhile: one that comes is delivered when the block ends, or to another thread at once."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class HangupSafe:
    """sys.stdout / sys.stderr while StopSignals is installed: a write that fails because the terminal hung up
    (EIO) or the pipe's reader is gone (EPIPE) detaches the output (detach_terminal) and is dropped. The hangup
    comes before its SIGHUP is handled, so a write in between fails: the stop must not become an error."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as e:
            if e.errno not in GONE:
                raise
            detach_terminal()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as e:
            if e.errno not in GONE:
                raise
            detach_terminal()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


GONE = (errno.EIO, errno.EPIPE)  # a hung-up terminal, a pipe whose reader died


def detach_terminal() -> None:
    """Send stdout and stderr to /dev/null where they go to a terminal or a pipe: after a hangup the terminal is
    gone (writes fail with EIO) and a pipe's reader died with it (EPIPE). A file keeps them."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        for fd in (1, 2):
            try:
                mode = os.fstat(fd).st_mode
            except OSError:
                continue
            # a hung-up terminal is no tty any more (isatty's tcgetattr fails): a character device it still is
            if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
                os.dup2(null, fd)
    finally:
        os.close(null)

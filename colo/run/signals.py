"""Ctrl-C and SIGTERM (a batch scheduler's preemption) as a graceful stop of the driver.

    stop = StopSignals()
    stop.install()          # SIGINT and SIGTERM: the first raises KeyboardInterrupt where the driver is,
    ...                     # unless held; a second one raises it at once, held or not (stop.hurry)
    stop.hold()             # from the train phase until the step is logged and saved: the trainers'
    ...                     # weights and the data position must not part (a stop would save them apart)
    stop.release()          # raises the KeyboardInterrupt that came while held, if one did
    stop.closing = True     # the run's cleanup: signals are counted only, a second one shortens its waits
    stop.restore()          # the handlers that were there before

KeyboardInterrupt and not an exception of colo's own: Ray's blocking calls (ray.get, ray.wait) poll for
signals and turn a KeyboardInterrupt raised there into their own, while any other exception raised from a
handler inside them comes back as a SystemError once the call returns. `signum` says which signal it was,
`hurry` whether a second one came (then nothing more is saved: the run exits at once, cleaning up only).
"""
from __future__ import annotations

import signal
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + signal number, as shells report them


class StopSignals:
    def __init__(self) -> None:
        self.signum: int | None = None  # the first stop signal, once one came
        self.count = 0
        self.held = False
        self._pending = False
        self.closing = False  # shutting down: signals are only counted (a second one shortens the waits)
        self._previous: dict[int, object] = {}

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
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum
        if self.closing:
            return
        if self.held and not self.hurry:
            self._pending = True
            return
        raise KeyboardInterrupt

    def hold(self) -> None:
        self.held = True

    def release(self) -> None:
        self.held = False
        if self._pending:
            self._pending = False
            raise KeyboardInterrupt

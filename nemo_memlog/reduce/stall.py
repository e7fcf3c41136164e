"""A wait that outlasts ``memory_reduce_stall_warn_s`` is said while it goes on: ``StallWatch``, one
thread per process, calls the waiting run's alert once the wait passes its threshold; the wait
itself goes on to its timeout. Arming and disarming cost one lock and one notify (a logging step's
collective); nothing here is a collective."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable


class StallWatch:
    """Calls ``alert(waited_s)`` when the wait armed last is still armed ``after_s`` later."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._armed: tuple[float, float, Callable[[float], None]] | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0

    def arm(self, after_s: float, alert: Callable[[float], None]) -> None:
        now = time.monotonic()
        with self._cond:
            self._armed = (now + after_s, now, alert)
            if self._pid != os.getpid() or self._thread is None or not self._thread.is_alive():
                self._pid = os.getpid()  # a forked child has the object, not the thread
                self._thread = threading.Thread(target=self._run, name="nemo_memlog-stall", daemon=True)
                self._thread.start()
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._armed = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._armed is None:
                    self._cond.wait()
                deadline, started, alert = self._armed
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._armed = None
            try:
                alert(time.monotonic() - started)
            except Exception:  # noqa: S110 -- a warning that cannot be said must not end the watch
                pass

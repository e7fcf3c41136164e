"""Flush every backend on SIGTERM (preemption, SLURM time limit), then chain.

The handler drains and closes the writers within ``writer_close_timeout_s`` and then
hands the signal on: to the handler that was installed before (the training
framework's own), or, if there was none, to the default action, so the process still
ends as a SIGTERM'd process would. It issues no collective: other ranks may already
be gone.
"""

from __future__ import annotations

import os
import signal
import threading

_installed = False


def install(close_all) -> None:
    """Install the SIGTERM handler once, from the main thread (Python allows no other)."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        close_all()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    _installed = True

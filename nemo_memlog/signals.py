"""On SIGTERM (preemption, SLURM time limit): mark the flight records ended, flush every
backend, then chain.

The handler runs every registered callback (the recorders' end markers first: they take
microseconds, draining the writers can take ``writer_close_timeout_s``), and then hands
the signal on: to the handler that was installed before (the training framework's own),
or, if there was none, to the default action, so the process still ends as a SIGTERM'd
process would. It issues no collective: other ranks may already be gone.
"""

from __future__ import annotations

import os
import signal
import threading

_installed = False
_callbacks: list = []


def install(callback, *, first: bool = False) -> None:
    """Run ``callback()`` on SIGTERM (``first``: before those registered earlier). The handler
    is installed once, from the main thread (Python allows no other)."""
    global _installed
    if callback not in _callbacks:
        _callbacks.insert(0, callback) if first else _callbacks.append(callback)
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        for run in list(_callbacks):
            try:
                run()
            except Exception:  # the signal must still be handed on
                pass
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    _installed = True

"""What every way in shares: an ``Adapter``'s events, ``guarded`` so that nothing of ours fails the
user's job.

An integration is one thin adapter: it translates its framework's events, steps, groups and open
loggers into the run's one door (``MemoryMonitor.open``, ``before_iteration``, ``log``,
``phase_start``/``phase_end``, ``close``: monitor/__init__.py) and adds nothing of its own between them.
Whatever goes wrong in an event of ours (a setting, a framework argument such as an interval of
0, an exception in a hook) is one notice on the "nemo_memlog" logger, naming the framework, the
event and the error; the run is closed and the adapter does nothing more in this process: the job
trains on, uninstrumented. A framework's own code is never inside the guard: its exceptions are
its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ..monitor import MemoryMonitor
from ..warn import notice

Event = TypeVar("Event", bound=Callable[..., Any])


class Adapter:
    """A framework's way in: its run (``monitor``, None while none is open) and whether an event of
    ours failed (``stopped``: every later event does nothing). ``FRAMEWORK`` names it in notices.
    An adapter made while ``NEMO_MEMLOG_DISABLED`` is true (config/switches.py) starts stopped: its
    events do nothing, as without it (every rank reads the same environment: all alike)."""

    FRAMEWORK = "the framework"
    monitor: MemoryMonitor | None = None
    stopped: bool = False

    def _release(self) -> None:
        """What the adapter holds beside the run, given back when it stops (the default: nothing)."""

    def stop_logging(self, event: str, error: BaseException) -> None:
        """An event of ours failed: say so once, close the run without raising, and stop. Never raises."""
        self.stopped = True
        monitor, self.monitor = self.monitor, None
        try:
            self._release()
            if monitor is not None:
                monitor.close()
        except Exception:  # noqa: BLE001, S110 -- the failure is said below; closing is best effort
            pass
        notice(
            f"nemo_memlog: memory logging stopped in {self.FRAMEWORK} ({event}): {error!r}; "
            f"training goes on without it",
            stacklevel=3,
        )


def is_last_rank() -> bool:
    """Whether this process is the job's last rank, where Megatron-LM and Bridge open their loggers
    (True without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank() == dist.get_world_size() - 1


def guarded(event: Event) -> Event:
    """``event`` of an ``Adapter``, contained: an exception it raises is ``Adapter.stop_logging`` (one notice,
    the run closed), and after that the event does nothing. Returns None where it stopped."""

    @functools.wraps(event)
    def contained(self: Adapter, *args: Any, **kwargs: Any) -> Any:
        if self.stopped:
            return None
        try:
            return event(self, *args, **kwargs)
        except Exception as error:  # noqa: BLE001 -- nothing of ours fails the user's job
            self.stop_logging(event.__name__, error)
            return None

    return contained  # type: ignore[return-value]

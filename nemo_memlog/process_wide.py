"""What belongs to the process, not to a monitor: each hook installed once, dispatching to the live monitors.

A monitor (``MemoryMonitor``), its flight recorder and its writers register what they need here
and unregister it when they close; this module holds no monitor state of its own.

- ``on_sigterm``: SIGTERM (preemption, a scheduler's time limit, a launcher's teardown). The
  callbacks registered with ``first=True`` (the recorders' end markers: microseconds, they wait on
  no other thread) run in the handler; the others (draining writers: up to
  ``writer_close_timeout_s``) run in a thread of their own, the handler waiting for them: the job
  runs no further, as it would have ended there. Then the signal is handed on: to the handler
  installed before ours (the framework's own), or to the default action, so the process still ends
  as a SIGTERM'd process would; an ignored signal stays ignored. They say what they say on the
  process's own stderr, even where the signal landed while an in-memory buffer stood in for it
  (``_own_stderr``). One case differs: a Python handler runs on the main thread wherever the signal
  interrupted it, and where that was inside a lock the backends' threads need too (logging's module
  lock, taken by any ``getLogger`` or first ``isEnabledFor``: comet_ml's exit hook does one as a
  process exits; a logging handler's; an import's), a handler waiting there would wait for itself
  until the close's deadline, and W&B's run and Comet's archive would end unfinished. There the
  handler calls the previous one at once and returns; the main thread runs on to its next call of
  ours (``hold_if_ending``: a training step, a writer's ``log``, its exit) and waits there, and the
  close's thread ends the process by the signal once done. A process with nothing to drain (a rank
  without writers) hands the signal on at once. Installed from the main thread only.
- ``on_exit``: at interpreter exit (atexit), before the hooks of the libraries a backend opened
  (``exit_first``).
- ``on_exception``: an unhandled exception in the main thread, before the hook that was
  there (``sys.excepthook``), called as ``callback(kind, value, traceback)``.
- ``on_fork_child``: in a forked child (a data-loader worker), so it lets go of what
  belongs to its parent (the writer process's socket).
- ``on_cuda_oom``: the CUDA allocator's OOM observer, attached once CUDA is initialised,
  called as ``callback(device, bytes_requested, device_limit, device_free)``.
- ``read_proc``: a /proc file re-read through a descriptor kept open.
- ``known`` / ``remember``: facts that, once true, stay true for the process's life (CUDA
  initialised, a device's context made), so a hot path checks them once.

Bound methods are held weakly (a monitor that is garbage-collected drops out by itself); plain
functions strongly. ``forget(callback)`` unregisters from every hook. Every dispatch
swallows the callbacks' exceptions: exit and signal paths must not fail, and a CUDA OOM
must surface as torch's own error. Nothing here issues a collective.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator

_sigterm: list = []  # run in a thread of their own
_sigterm_first: list = []  # run in the handler
_exit: list = []
_exception: list = []
_fork_child: list = []
_cuda_oom: list = []
_installed: set = set()
_attach_errors: dict[str, str] = {}  # hook -> why it could not be installed
_lock = threading.RLock()  # re-entrant: a SIGTERM may land while this thread holds it (forget at a close)


def _ref(callback):
    if hasattr(callback, "__self__") and hasattr(callback, "__func__"):
        return weakref.WeakMethod(callback)
    return lambda: callback


def _add(registry: list, callback) -> None:
    with _lock:
        if any(ref() == callback for ref in registry):
            return
        registry.append(_ref(callback))


def _dispatch(registry: list, *args) -> None:
    for ref in list(registry):
        callback = ref()
        if callback is None:
            with _lock:
                if ref in registry:
                    registry.remove(ref)
            continue
        try:
            callback(*args)
        except Exception:  # an exit or signal path must not fail, an OOM must stay torch's error
            pass


def forget(callback: Callable[..., object]) -> None:
    """Unregister ``callback`` from every hook (a monitor that closed)."""
    with _lock:
        for registry in (_sigterm, _sigterm_first, _exit, _exception, _fork_child, _cuda_oom):
            registry[:] = [ref for ref in registry if ref() not in (None, callback)]


def on_sigterm(callback: Callable[[], object], *, first: bool = False) -> None:
    """Run ``callback()`` on SIGTERM, then hand the signal on (see the module's docstring)."""
    _add(_sigterm_first if first else _sigterm, callback)
    if "sigterm" in _installed or threading.current_thread() is not threading.main_thread():
        return  # Python lets only the main thread install a handler: a later registration there will
    previous = signal.getsignal(signal.SIGTERM)

    def handle(signum, frame):
        global holding
        _dispatch(_sigterm_first)
        ends_process = not callable(previous) and previous != signal.SIG_IGN
        with _lock:
            begin = not _ending.started.is_set() and any(ref() is not None for ref in _sigterm)
            if begin:
                _ending.started.set()
        if not _ending.started.is_set():  # nothing to drain here (a rank without writers): handed on at once
            if callable(previous):
                previous(signum, frame)
            elif ends_process:
                _die(signum)
            return
        if begin:
            _ending.ends_process = ends_process
            if _lock_the_main_thread_holds() is None:
                with _own_stderr():  # the main thread waits here, where the job would have ended
                    _ending.main_waits.set()
                    _start_closer(signum)
                    _ending.closed.wait()
                if ends_process:
                    _die(signum)
            else:  # it runs on, to release that lock, and waits at its next call of ours or its exit
                holding = ends_process
                _install_exit()
                _start_closer(signum)
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, handle)
    _installed.add("sigterm")


@contextlib.contextmanager
def _own_stderr() -> Iterator[None]:
    """The process's own stderr as ``sys.stderr`` while the handler waits for the SIGTERM callbacks, where the signal
    interrupted code that had put an in-memory buffer there: torch.distributed's excepthook does while
    the hook before it formats a traceback (a rank's unhandled error, then the launcher's SIGTERM
    0.1 s later). What the callbacks say (a backend's lost steps) would go into that buffer, which the
    signal's default action then discards with the process. A stream of the user's stays theirs."""
    captured = sys.stderr
    if not isinstance(captured, io.StringIO) or sys.__stderr__ is None:
        yield
        return
    sys.stderr = sys.__stderr__
    try:
        yield
    finally:
        if sys.stderr is sys.__stderr__:
            sys.stderr = captured


class _Ending:
    """A SIGTERM's close: begun, done, and whether the main thread waits at a call of ours."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.closed = threading.Event()
        self.main_waits = threading.Event()
        self.ends_process = False  # the signal's default action is ours to carry out


_ending = _Ending()
#: True from the moment a SIGTERM's close that ends the process leaves the main thread to run on: the
#: one check the hot paths make (``if process_wide.holding: process_wide.hold_if_ending()``).
holding = False
#: After a SIGTERM's close, how long its thread waits for the main thread to reach a call of ours
#: (its exit) before it ends the process itself: a traceback the main thread is printing gets out.
HAND_ON_GRACE_S = 1.0


def _lock_the_main_thread_holds() -> str | None:
    """What lock the main thread (interrupted by the signal, running this) holds that the backends'
    threads may need, or None: logging's module lock (any ``getLogger``, a first ``isEnabledFor``),
    a logging handler's, an import's. Where it cannot tell, it says so (not None)."""
    try:
        import logging
        from importlib import _bootstrap

        if logging._lock._is_owned():  # type: ignore[attr-defined]
            return "logging's module lock"
        for ref in list(logging._handlerList):  # type: ignore[attr-defined]
            owned = getattr(getattr(ref(), "lock", None), "_is_owned", None)  # an RLock's, as Handler makes
            if owned is not None and owned():
                return "a logging handler's lock"
        me = threading.get_ident()
        for ref in list(_bootstrap._module_locks.values()):  # type: ignore[attr-defined]
            lock = ref()
            if lock is not None and getattr(lock, "owner", None) == me:
                return "an import's lock"
    except Exception:  # a Python whose internals differ: the close must not wait on the main thread
        return "a lock it cannot tell"
    return None


def _start_closer(signum: int) -> None:
    closer = threading.Thread(target=_close_then_hand_on, args=(signum,), name="nemo_memlog-sigterm")
    closer.daemon = True
    closer.start()


def _close_then_hand_on(signum: int) -> None:
    """The close; then, where the process ends by the signal and the main thread is not waiting to end it
    itself (in the handler, or at a call of ours) within HAND_ON_GRACE_S, the end."""
    _dispatch(_sigterm)
    _ending.closed.set()
    if _ending.ends_process and not _ending.main_waits.wait(HAND_ON_GRACE_S):
        _die(signum)


def ending_by_signal() -> bool:
    """A SIGTERM's close is under way, and the process ends by the signal once it is done."""
    return _ending.started.is_set() and _ending.ends_process


def hold_if_ending() -> None:
    """Where the main thread calls us (a training step, a writer's ``log``, its exit) while a
    SIGTERM's close is under way that ends the process: wait here until it does. A step handed
    over then would land after the close began; the job's own code would run on past its signal.
    (Only where the handler let the main thread run on: ``holding``; elsewhere it waits in the handler.)"""
    if not holding or threading.current_thread() is not threading.main_thread():
        return
    _ending.main_waits.set()
    _ending.closed.wait()
    _die(signal.SIGTERM)


def _die(signum: int) -> None:
    """End the process by ``signum``'s default action, from any thread. Python re-arms a signal from
    the main thread only; another thread re-arms it through the C library."""
    try:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signum, signal.SIG_DFL)
        else:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
            libc.signal.restype = ctypes.c_void_p
            libc.signal(signum, None)  # SIG_DFL
        os.kill(os.getpid(), signum)
    finally:
        os._exit(128 + signum)  # the default action ends the process before this; a failure to re-arm does here


def on_exit(callback: Callable[[], object]) -> None:
    """Run ``callback()`` at interpreter exit."""
    _add(_exit, callback)
    _install_exit()


def _install_exit() -> None:
    with _lock:
        if "exit" not in _installed:
            _installed.add("exit")
            atexit.register(_at_exit)


def _at_exit() -> None:
    _dispatch(_exit)
    hold_if_ending()  # a SIGTERM's close under way: the process ends by the signal once it is done


def exit_first() -> None:
    """Make the exit callbacks run before every ``atexit`` hook registered so far (atexit runs the
    last registered first). A library a backend opens after our hook was installed registers its
    own teardown then (W&B's ends its service process at exit), and would otherwise end it before a
    close that still has steps to write into it. Called once a backend has opened. Never raises."""
    with _lock:
        if "exit" in _installed:
            atexit.unregister(_at_exit)
            atexit.register(_at_exit)


def on_exception(callback: Callable[..., object]) -> None:
    """Run ``callback(kind, value, traceback)`` on an unhandled exception in the main thread."""
    _add(_exception, callback)
    if "exception" in _installed:
        return
    _installed.add("exception")
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        _dispatch(_exception, kind, value, traceback)
        previous(kind, value, traceback)

    sys.excepthook = excepthook


def on_fork_child(callback: Callable[[], object]) -> None:
    """Run ``callback()`` in the child after a fork of this process."""
    _add(_fork_child, callback)
    if "fork" not in _installed:
        _installed.add("fork")
        os.register_at_fork(after_in_child=lambda: _dispatch(_fork_child))


def on_cuda_oom(callback: Callable[[int, int, int, int], object]) -> bool:
    """Run ``callback(device, bytes_requested, device_limit, device_free)`` when the CUDA
    allocator runs out of memory. True once the observer is attached; False while CUDA is not
    initialised in this process (call ``attach_cuda_oom_observer`` again later)."""
    _add(_cuda_oom, callback)
    return attach_cuda_oom_observer()


def attach_cuda_oom_observer() -> bool:
    """Attach the one dispatching observer if CUDA is initialised here; True once attached.
    An attach that fails (a torch without it, another allocator) counts as attached: there is
    nothing to retry, and the caller's records go on without OOM records."""
    if "cuda_oom" in _installed:
        return True
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    _installed.add("cuda_oom")
    try:
        torch._C._cuda_attach_out_of_memory_observer(lambda *args: _dispatch(_cuda_oom, *args))
    except Exception as error:
        _attach_errors["cuda_oom"] = f"{type(error).__name__}: {error}"
    return True


def cuda_oom_attach_error() -> str | None:
    """Why the OOM observer could not be attached, or None."""
    return _attach_errors.get("cuda_oom")


# --------------------------------------------------------------------------------------------
# /proc, through descriptors kept open

_quiet: weakref.WeakSet = weakref.WeakSet()  # threads whose uncaught errors a backend reports itself


def quiet_thread(thread: threading.Thread) -> None:
    """Do not print ``thread``'s uncaught exception: a library's own writer thread (TensorBoard's)
    whose error reaches its backend at the next call, where the fan-out says it once, in plain
    words (a full disk). Every other thread's goes to the previous ``threading.excepthook``."""
    _quiet.add(thread)
    with _lock:
        if "quiet" in _installed:
            return
        previous = threading.excepthook

        def hook(args):
            if args.thread is not None and args.thread in _quiet:
                return
            previous(args)

        threading.excepthook = hook
        _installed.add("quiet")


_proc_fds: dict[str, tuple[int, int]] = {}


def read_proc(path: str) -> bytes:
    """Re-read a /proc (or cgroup) file through a descriptor kept open: a few microseconds
    instead of an open(). Keyed by pid: after a fork, /proc/self opened by the parent still
    means the parent. Raises OSError where the file cannot be opened."""
    pid = os.getpid()
    cached = _proc_fds.get(path)
    if cached is None or cached[0] != pid:
        cached = _proc_fds[path] = (pid, os.open(path, os.O_RDONLY | os.O_CLOEXEC))
    return os.pread(cached[1], 16384, 0)


def proc_field(path: str | None, key: bytes, scale: int = 1) -> int | None:
    """The number after ``key`` at the start of a line of ``path`` (/proc/meminfo's ``MemAvailable:``,
    a cgroup file's ``oom_kill ``), times ``scale`` (1024 for kB); None where the file or the line
    is missing. Never raises."""
    return proc_fields(path, (key,), scale)[0]


def proc_fields(path: str | None, keys: tuple[bytes, ...], scale: int = 1) -> list[int | None]:
    """``proc_field`` for several keys of one file, read once through ``read_proc``: the one reader of
    those files' fields (rank/memory.py, failure/evidence.py). Never raises."""
    try:
        text = b"\n" + read_proc(path) if path is not None else b""
    except OSError:
        text = b""
    values: list[int | None] = []
    for key in keys:
        at = text.find(b"\n" + key)
        try:
            values.append(int(text[at + 1 + len(key) :].split(None, 1)[0]) * scale if at >= 0 else None)
        except (ValueError, IndexError):
            values.append(None)
    return values


# --------------------------------------------------------------------------------------------
# Facts that stay true for the life of the process

_facts: set = set()


def known(fact: Hashable) -> bool:
    """Whether ``fact`` (any hashable name) was remembered in this process. No I/O."""
    return (os.getpid(), fact) in _facts


def remember(fact: Hashable) -> None:
    """Remember that ``fact`` holds in this process from now on. Keyed by pid: a forked child
    (a data-loader worker) knows nothing of its parent's facts and finds out for itself."""
    _facts.add((os.getpid(), fact))

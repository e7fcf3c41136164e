"""Writers: one module per backend, discovered here, fanned out by fanout.FanOut.

A backend module exposes ``enabled(logger)``, ``open_backend(logger, params, secrets)``
and a backend object with ``log(metrics, step)``, ``flush()`` and ``close()``; and
``adopt(obj)``, which wraps a logger object of its kind that someone else opened (or
returns None for any other object) without importing its library. Modules are found by
listing this package, and imported only when their config asks for them, so this file
names no backend and an uninstalled backend costs nothing.

``writer_mode`` picks where the backends run: in a writer process of their own
(``process.ProcessFanOut``, whose process runs a ``FanOut``), or in threads of this
process (``FanOut`` here). Both take the same ``log``, ``flush``, ``close`` and ``stats``.
"""

from __future__ import annotations

import importlib
import pkgutil
import warnings
import weakref

from .. import process_wide
from ..config import logger_section, recorded_params, secrets_of, setting
from .fanout import FanOut, Sink
from .inline import InlineFanOut

_INFRASTRUCTURE = {"fanout", "inline", "process"}
_open_fanouts: "weakref.WeakSet" = weakref.WeakSet()


def backend_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _INFRASTRUCTURE)


def build_writers(config, *, run_config=None):
    """The fan-out for every backend ``config`` enables (possibly none): a ``FanOut``, or
    with ``writer_mode="process"`` a ``ProcessFanOut`` (same methods).

    ``config`` is a LoggerConfig, any object with its field names, or a container with
    ``.logger``. ``run_config`` (default: ``config``) is recorded once per backend as
    hyperparameters, with secrets redacted and the resolved ``memory_peak_window`` added.
    Backends open lazily, in their own threads (of the writer process, in process mode).
    Closed at interpreter exit and on SIGTERM (see process_wide.py). No backend configured: an
    empty FanOut, and no process.
    """
    logger = logger_section(config)
    run_config = config if run_config is None else run_config
    secrets = secrets_of(run_config) + secrets_of(logger)
    params = recorded_params(run_config, logger)
    names = [name for name in backend_modules() if _module(name).enabled(logger)]
    fanout = None
    if names and setting(logger, "writer_mode") == "process":
        fanout = _process_fanout(logger, names, params, secrets)
    if fanout is None:
        fanout = thread_fanout(logger, names, params, secrets)
    _open_fanouts.add(fanout)
    if names:
        process_wide.on_sigterm(close_all)
    return fanout


def adopt_writers(open_loggers, spellings: dict | None = None) -> InlineFanOut:
    """Writers over logger objects a framework already opened in this process (None
    entries are skipped; objects no backend recognises are ignored). They are written on
    the calling thread and flushed, never closed, by us: see inline.py.

    ``spellings``: ``{backend: key -> name}`` for a backend whose metric names the
    framework rewrites before writing into it (Megatron-Bridge's MLflow names); that
    backend's ``adopt`` spells ours the same way, so they sit with the framework's own."""
    spellings = spellings or {}
    modules = {name: _module(name) for name in backend_modules()}
    backends = []
    for obj in open_loggers:
        if obj is None:
            continue
        for name, module in modules.items():
            backend = module.adopt(obj, spellings[name]) if name in spellings else module.adopt(obj)
            if backend is not None:
                backends.append((name, backend))
                break
    return InlineFanOut(backends)


def thread_fanout(logger, names: list[str], params: dict, secrets: list[str]) -> FanOut:
    """The backends ``names``, each in a thread of this process behind its own buffer."""
    sinks = [Sink(name, _opener(_module(name), logger, params, secrets), setting(logger, "writer_buffer_steps"),
                  secrets) for name in names]
    return FanOut(sinks, setting(logger, "writer_close_timeout_s"))


def _process_fanout(logger, names, params, secrets):
    try:
        from .process import ProcessFanOut

        return ProcessFanOut(logger, names, params, secrets)
    except Exception as error:  # no process can be started here (limits, a sandbox, no AF_UNIX): threads work
        warnings.warn(f"nemo_memlog: could not start the writer process ({type(error).__name__}: {error}); "
                      f"the backends write from threads of this process instead (logger.writer_mode='thread')",
                      RuntimeWarning, stacklevel=3)
        return None


def _module(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def _opener(module, logger, params, secrets):
    return lambda: module.open_backend(logger, params, secrets)


def close_all(timeout_s: float | None = None) -> None:
    """Drain and close every open fan-out (at exit, on SIGTERM). Never raises."""
    for fanout in list(_open_fanouts):
        try:
            fanout.close(timeout_s)
        except Exception:  # exit paths must not fail
            pass


process_wide.on_exit(close_all)

__all__ = ["FanOut", "InlineFanOut", "adopt_writers", "build_writers", "close_all", "backend_modules",
           "thread_fanout"]

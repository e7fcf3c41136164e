"""Writers: where a run's logged steps go.

The words, one idea each, throughout this package:

- a **backend** is one store's adapter (TensorBoard, W&B, MLflow, Comet, OpenTelemetry metrics, a
  Lightning logger):
  ``log(metrics, step)``, ``flush()``, ``close()`` (base.Backend). One module per backend;
  base.py holds the interface, the module contract and the registry (``CONFIGURED``,
  ``ADOPTABLE``). A backend library's name appears only inside its own module.
- the **writers** of a run are the fan-out a run hands each step to (base.Writers):
  ``log(metrics, step)``, ``flush()``, ``close()``, ``stats()``, and ``backend_names``, the
  backends it writes (empty: none). Three kinds, one interface:
  ``ProcessFanOut`` (parent.py; ``writer_mode="process"``): the backends run in a writer
  process of their own (child.py), fed through a socket (wire.py);
  ``ThreadFanOut`` (fanout.py; ``writer_mode="thread"``, and inside the writer process):
  each backend in a thread of this process, as a ``BufferedBackend``;
  ``InlineFanOut`` (inline.py): backends over open loggers, written on the caller's thread.
- an **open logger** is an object a framework already opened (Megatron-Bridge's
  TensorBoard writer, a Lightning ``Logger``): a backend **adopts** it, and never closes it.

``build_writers`` opens the writers a config asks for; ``adopt_writers`` adopts open loggers.

The modules:

- ``base``: the ``Backend`` and ``Writers`` interfaces, the module contract, the registry;
- ``tensorboard``, ``wandb``, ``mlflow``, ``comet``, ``otel``: one backend each (``otel``:
  OpenTelemetry metrics over OTLP, Prometheus or the console);
- ``lightning``: a Lightning ``Logger``, adopted;
- ``fanout``: ``ThreadFanOut`` and ``BufferedBackend`` (a thread and a retrying buffer per backend);
- ``inline``: ``InlineFanOut``, open loggers written on the training thread;
- ``parent``: ``ProcessFanOut``, the training process's side of the writer process;
- ``child``: the writer process's side;
- ``wire``: the versioned wire format between the two;
- ``stages``: each stage's own run (TensorBoard's ``pp_stage_<i>``) and ``StageHistory``;
- ``charts``: the per-stage charts drawn at close (W&B, MLflow, Comet), within the close budget.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from ..config import logger_section, recorded, resolve, secrets_of
from ..warn import notice
from .base import ADOPTABLE, CONFIGURED, Backend, Writers, backend_module, enabled_backends, environment_secrets
from .fanout import BufferedBackend, ThreadFanOut, open_thread_fanout
from .inline import InlineFanOut


def build_writers(config: Any, *, run_config: Any = None) -> Writers:
    """Open the writers for every backend ``config`` enables (possibly none).

    Backends open lazily, each in a thread of its own (of the writer process, with
    ``writer_mode="process"``). The writers are closed at interpreter exit and on SIGTERM.

    Args:
        config: a LoggerConfig, an object with its field names, a container whose
            ``.logger`` is one, or a resolved Settings.
        run_config: recorded once per backend as hyperparameters, secrets redacted, with the
            resolved ``memory_peak_window`` added (default: ``config``).

    Returns:
        Writers (``log(metrics, step)``, ``flush()``, ``close()``): a ThreadFanOut, or a
        ProcessFanOut with ``writer_mode="process"``. No backend enabled: an empty
        ThreadFanOut, and no process.

    Raises:
        TypeError: ``config`` is no config.
        ValueError: a setting that cannot work, naming the field.

        A writer process that cannot start is said (a notice on the "nemo_memlog" logger)
        and the backends write from threads instead; a backend that fails later is said
        and never raises.
    """
    settings = resolve(config)  # a Settings is used as it is: checked once, where it was resolved
    params, secrets = _recorded(config, run_config)
    names = enabled_backends(settings)
    secrets += environment_secrets(names, dict(os.environ))  # OTLP headers: kept off the writer process's environment
    writers = None
    if names and settings.writer_mode == "process":
        writers = _process_fanout(settings, names, params, secrets)
    if writers is None:
        writers = open_thread_fanout(settings, names, params, secrets)
    return writers


def adopt_writers(
    open_loggers: Iterable[Any], spellings: dict | None = None, *, config: Any = None, run_config: Any = None
) -> InlineFanOut:
    """Writers over open loggers a framework already opened in this process (None entries
    are skipped; objects no backend recognises are ignored). They are written on the
    calling thread and flushed, never closed, by us: see inline.py.

    ``spellings``: ``{backend: key -> name}`` for a backend whose metric names the
    framework rewrites before writing into it (Megatron-Bridge's MLflow names); that
    backend's ``adopt`` spells ours the same way, so they sit with the framework's own.

    ``config`` (the run's settings, or any config): given, each adopted backend that records a
    run's configuration (TensorBoard's "config" text) records ``run_config`` (default ``config``)
    now, once, as ``build_writers``' backends do: secrets redacted and scrubbed, the resolved
    ``memory_peak_window`` added (``nemo-memlog report`` reads it from the framework's own events)."""
    spellings = spellings or {}
    modules = {name: backend_module(name) for name in ADOPTABLE}
    backends = []
    for obj in open_loggers:
        if obj is None:
            continue
        for name, module in modules.items():
            backend = module.adopt(obj, spellings[name]) if name in spellings else module.adopt(obj)
            if backend is not None:
                backends.append((name, backend))
                break
    writers = InlineFanOut(backends)
    if config is not None and backends:
        writers.record_config(*_recorded(config, run_config))
    return writers


def _recorded(config: Any, run_config: Any) -> tuple[dict, list[str]]:
    """(the params the backends record of ``run_config`` (default ``config``), the secrets to scrub),
    from one walk of the run config (config.recorded), with the logger section's secrets where the
    run config does not hold it."""
    run_config = config if run_config is None else run_config
    logger, apart = _logger_of(run_config, config)
    params, secrets = recorded(run_config, logger)  # one walk of the run config: the params and its secrets
    if apart:  # the logger section is not in the run config (a dict of hyperparameters): its secrets too
        secrets += secrets_of(logger)
    return params, secrets


def _logger_of(run_config, config):
    """(the logger section as the run config holds it (so a run config that IS the logger config
    records ``memory_peak_window`` unprefixed, even when ``config`` is its Settings), False), else
    (``config``'s, True): ``run_config`` is not a config (a dict of hyperparameters, say), so the
    section is apart from it."""
    try:
        return logger_section(run_config), False
    except TypeError:
        return logger_section(config), True


def _process_fanout(settings, names, params, secrets):
    try:
        from .parent import ProcessFanOut

        return ProcessFanOut(settings, names, params, secrets)
    except Exception as error:  # no process can be started here (limits, a sandbox, no AF_UNIX): threads work
        notice(
            f"nemo_memlog: could not start the writer process ({type(error).__name__}: {error}); "
            f"the backends write from threads of this process instead (logger.writer_mode='thread')"
        )
        return None


__all__ = [
    "ADOPTABLE",
    "CONFIGURED",
    "Backend",
    "BufferedBackend",
    "InlineFanOut",
    "ThreadFanOut",
    "Writers",
    "adopt_writers",
    "backend_module",
    "build_writers",
    "enabled_backends",
    "open_thread_fanout",
]

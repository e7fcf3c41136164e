"""The backend interface, the module contract, and the registry of backend modules.

A **backend** writes one store (``Backend``). Each backend module in this package has:

- ``adopt(obj) -> Backend | None``: wrap an *open logger* of its kind (one a framework
  opened: Bridge's TensorBoard writer, a Lightning ``Logger``), recognised without importing
  its library; None for any other object;

and, for the stores a Settings can open (``CONFIGURED``):

- ``enabled(settings) -> bool``: whether ``settings`` asks for this backend;
- ``open_backend(settings, params, secrets) -> Backend``: open it, recording ``params``
  once, with ``secrets`` scrubbed from anything it echoes;
- optionally ``environment_secrets(environ) -> list[str]``: credentials the backend's library reads
  from the environment under names that do not look secret (OTLP headers), added to the run's secrets.

The registry is these two tuples: a module is imported only when asked for, so an
uninstalled backend costs nothing, and no backend library is named outside its module.
"""

from __future__ import annotations

import errno
import importlib
import os
import tempfile
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..config import Settings

#: Backend modules a Settings can open, in the order they are fanned out to.
CONFIGURED = ("tensorboard", "wandb", "mlflow", "comet", "otel")
#: Backend modules that can adopt an open logger, in the order they are tried.
ADOPTABLE = CONFIGURED + ("lightning",)


@runtime_checkable
class Backend(Protocol):
    """One store. ``log`` reads ``metrics`` and never mutates it; any call may raise (the
    fan-out isolates it)."""

    def log(self, metrics: dict, step: int) -> None: ...

    def flush(self) -> None: ...

    # Optional: ``end_reserve_s``, the seconds a store that is complete only once ended (a W&B run,
    # a Comet offline archive) keeps at the end of the close budget for ending it: no write starts then.

    def close(self, deadline: float | None = None) -> None:
        """End the store; ``deadline`` (time.monotonic()) is when the close budget runs out: work
        that can be skipped (charts drawn at close) is, to end the store by then. None: no limit
        but the backend's own (its settings' close budget)."""


class Writers(Protocol):
    """What a run hands its steps to: every fan-out (thread, process, inline) has this."""

    backend_names: list[str]
    """The backends written, one name each (empty: no backend, nothing is written)."""

    def log(self, metrics: dict, step: int) -> None: ...

    def flush(self, timeout_s: float | None = None) -> bool: ...

    def close(self, timeout_s: float | None = None) -> None: ...

    def stats(self) -> dict: ...


class FolderNotWritable(PermissionError):
    """A backend's folder that cannot be written: a permanent failure, never retried."""


#: OS errors a retry cannot cure: the backend stops (fanout.py) instead of retrying until the run ends.
#: EEXIST: a file (or a dangling link) where the backend's folder should be.
PERMANENT_ERRNOS = frozenset(
    {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ELOOP}
)
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def writable_folder(path: str | os.PathLike[str], setting: str) -> Path:
    """``path`` (made if missing), after writing and removing a file in it; FolderNotWritable
    naming ``setting`` and the folder otherwise. A backend module calls it as it opens."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".nemo_memlog-probe-"):
            pass
    except OSError as error:
        raise FolderNotWritable(
            error.errno,
            f"{setting}={os.fspath(path)!r} cannot be written ({error.strerror or error}); "
            f"point {setting} at a writable folder",
        ) from error
    return folder


def os_errno(error: BaseException) -> int | None:
    """The errno of ``error`` or of what caused it (a library may wrap the OSError), else None."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, OSError) and error.errno is not None:
            return error.errno
        if "No space left on device" in str(error):
            return errno.ENOSPC
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def backend_module(name: str) -> ModuleType:
    """The module of backend ``name`` (one of ADOPTABLE), imported now."""
    if name not in ADOPTABLE:
        raise ValueError(f"no writer backend {name!r}; known: {', '.join(ADOPTABLE)}")
    return importlib.import_module(f"{__package__}.{name}")


def environment_secrets(names: list[str], environ: dict[str, str]) -> list[str]:
    """The secrets backends ``names`` read from ``environ`` (their ``environment_secrets``)."""
    found: list[str] = []
    for name in names:
        found += getattr(backend_module(name), "environment_secrets", lambda environ: [])(environ)
    return found


def enabled_backends(settings: Settings) -> list[str]:
    """The names of the CONFIGURED backends ``settings`` enables."""
    return [name for name in CONFIGURED if backend_module(name).enabled(settings)]

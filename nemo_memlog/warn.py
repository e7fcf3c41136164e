"""The package's notices: ``WarnOnce``, ``notice`` and ``misuse``.

Operational notices (a backend in trouble, low headroom, a stalled rank, a tensor the meter
cannot read) go through ``logging.getLogger("nemo_memlog")`` at WARNING, as torchtitan,
accelerate and Megatron-Bridge do: no warning filter (``python -W error``, pytest's
``filterwarnings = error``) can turn them into exceptions on the training thread. With no
logging configured, Python prints them on stderr as they are. ``warnings`` is kept for misuse,
said at the caller's line (``misuse``); even then nothing is raised: a filter that makes the
warning an error sends it to the log instead.

A monitor (MemoryMonitor), a writer and the process each hold one ``WarnOnce``, so a failing disk or a flapping
backend is said once per kind, not once per step. Every message starts with ``nemo_memlog:``
(the writer process forwards those lines) and has configured secrets scrubbed.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Hashable

from .redaction import scrubbed

PREFIX = "nemo_memlog: "
#: The package's logger: every operational notice is a WARNING record of it.
LOGGER = logging.getLogger("nemo_memlog")


def notice(text: str, *, stacklevel: int = 2) -> None:
    """``text`` as a WARNING record of the "nemo_memlog" logger. Never raises (a handler or
    filter of the user's that raises is their logging's to report)."""
    try:
        LOGGER.warning(text, stacklevel=stacklevel + 1)
    except Exception:  # noqa: S110 -- a notice never fails training
        pass


def misuse(text: str, category: type[Warning] = UserWarning, *, stacklevel: int = 2) -> None:
    """``text`` as a warning at the caller's line (``stacklevel`` as for ``warnings.warn``): the
    user's own mistake, which their filters may show, hide or collect. Never raises: a filter
    that turns it into an error sends it to the log instead."""
    try:
        warnings.warn(text, category, stacklevel=stacklevel + 1)
    except Exception:  # an "error" filter: said, not raised into training
        notice(text, stacklevel=stacklevel + 1)


class WarnOnce:
    """``warn(key, text)`` says ``text`` the first time ``key`` is seen: a notice on the
    "nemo_memlog" logger, or, with ``category`` (a Warning class, for misuse), a warning at
    the caller's line (``misuse``).

    ``context`` goes between the prefix and the text (``"wandb backend: "``); ``secrets``
    are replaced by ``***redacted***`` in every message. Thread-safe; never raises."""

    def __init__(self, context: str = "", secrets: list[str] | tuple[str, ...] = ()):
        self.context = context
        self.secrets = tuple(secret for secret in secrets if secret)
        self._seen: set = set()
        self._lock = threading.Lock()

    def __call__(self, key, text: str, *, stacklevel: int = 2, category: type[Warning] | None = None) -> bool:
        """Say ``text`` unless ``key`` was said before; True when this call said it."""
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
        if category is None:
            notice(self.message(text), stacklevel=stacklevel + 1)
        else:
            misuse(self.message(text), category, stacklevel=stacklevel + 1)
        return True

    def message(self, text: str) -> str:
        """``text`` as it would be said: prefixed, secrets scrubbed."""
        return scrubbed(PREFIX + self.context + text, self.secrets)

    def seen(self, key: Hashable) -> bool:
        return key in self._seen


def logging_off_message(off_settings: list[str], **given: object) -> str | None:
    """What a call ignores while log_memory_to_tensorboard is off (the backend settings set, the
    arguments it brought), as the one warning says it; None when it ignores nothing."""
    ignored = [f"logger.{name}" for name in off_settings]
    ignored += [
        f"{name}=" for name, value in given.items() if value is not None and (value or name in ("model", "optimizer"))
    ]
    if not ignored:
        return None
    return (
        f"log_memory_to_tensorboard is off, so training_log logs and writes nothing: {', '.join(ignored)} "
        f"ignored. Set log_memory_to_tensorboard=True (logger.log_memory_to_tensorboard=true) to log memory."
    )

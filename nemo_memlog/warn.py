"""``WarnOnce``: the package's one warn-once helper.

A run, a writer and the process each hold one, so a failing disk or a flapping backend
warns once per kind, not once per step. Every message starts with ``nemo_memlog:``, which
the writer process's warning filter keys on, and has configured secrets scrubbed.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Hashable

from .redaction import scrubbed

PREFIX = "nemo_memlog: "


class WarnOnce:
    """``warn(key, text)`` issues ``text`` as a RuntimeWarning the first time ``key`` is seen.

    ``context`` goes between the prefix and the text (``"wandb backend: "``); ``secrets``
    are replaced by ``***redacted***`` in every message. Thread-safe; never raises."""

    def __init__(self, context: str = "", secrets: list[str] | tuple[str, ...] = ()):
        self.context = context
        self.secrets = tuple(secret for secret in secrets if secret)
        self._seen: set = set()
        self._lock = threading.Lock()

    def __call__(self, key, text: str, *, stacklevel: int = 2, category: type[Warning] = RuntimeWarning) -> bool:
        """Warn unless ``key`` was warned about before; True when this call warned."""
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
        warnings.warn(self.message(text), category, stacklevel=stacklevel + 1)
        return True

    def message(self, text: str) -> str:
        """``text`` as it would be issued: prefixed, secrets scrubbed."""
        return scrubbed(PREFIX + self.context + text, self.secrets)

    def seen(self, key: Hashable) -> bool:
        return key in self._seen


#: The settings that open a backend: with memory logging off, each is named in the one warning that says so.
BACKEND_SETTINGS = ("tensorboard_dir", "wandb_project", "mlflow_experiment", "comet_project")


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

"""``nemo-memlog run``'s side inside each Python process: the way in added as the framework is imported.

``nemo-memlog run -- COMMAND`` puts ``autorun/`` on ``PYTHONPATH``; its ``sitecustomize`` runs the
user's own ``sitecustomize`` (found further along the path), then ``activate()``, which installs an
import hook and imports nothing else. When a watched module finishes loading (``WATCHED``), the
matching way in is added, with the settings of ``NEMO_MEMLOG_<FIELD>`` environment variables
(``settings_from_env``; ``nemo-memlog run --set key=value`` sets them):

- ``megatron.training.training`` (Megatron-LM's loop): ``megatron_lm.install()``; it then follows
  Megatron-LM's ``--log-memory-to-tensorboard``.
- ``megatron.bridge.training.pretrain`` / ``.finetune``: their function adds the Bridge
  ``MemoryLogCallback`` to the callbacks it is given, unless one is there; it then follows the
  recipe's ``logger.log_memory_to_tensorboard``.
- ``lightning.pytorch`` / ``pytorch_lightning``'s ``Trainer``: the Lightning ``MemoryLogCallback``
  added to each trainer unless one is there; on unless ``NEMO_MEMLOG_LOG_MEMORY_TO_TENSORBOARD``
  says false (Lightning has no flag of its own).

Nothing here raises into the user's program: a way in that cannot be added is said once (the
``nemo_memlog`` logger) and the program runs as it would without.
"""

from __future__ import annotations

import functools
import importlib.abc
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from ..config import FIELDS

#: Settings from the environment: NEMO_MEMLOG_<FIELD in upper case>=value (JSON, else a string).
ENV_PREFIX = "NEMO_MEMLOG_"
#: Set by ``nemo-memlog run`` for the processes it starts (what the bootstrap looks for).
RUN_ENV = "NEMO_MEMLOG_RUN"
log = logging.getLogger("nemo_memlog")


def settings_from_env(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """LoggerConfig fields from ``NEMO_MEMLOG_<FIELD>`` variables: each value read as JSON (``30``,
    ``true``, ``{"a": "b"}``), else as the string it is (a path, ``off``)."""
    environ = os.environ if environ is None else environ
    settings = {}
    for name in FIELDS:
        text = environ.get(ENV_PREFIX + name.upper())
        if text is None:
            continue
        try:
            settings[name] = json.loads(text)
        except ValueError:
            settings[name] = text
    return settings


def _taken(settings: dict, names: tuple) -> dict:
    return {name: value for name, value in settings.items() if name in names}


def _megatron_lm(module: Any) -> None:
    from . import megatron_lm

    megatron_lm.install(**_taken(settings_from_env(), megatron_lm.OWN_SETTINGS))


def _bridge(function_name: str) -> Callable[[Any], None]:
    def added(module: Any) -> None:
        original = getattr(module, function_name)

        @functools.wraps(original)
        def with_callback(config: Any, forward_step_func: Any, callbacks: Any = None, *args: Any, **kwargs: Any):
            if getattr(getattr(config, "logger", None), "log_memory_to_tensorboard", False):
                callbacks = with_bridge_callback(callbacks)
            return original(config, forward_step_func, callbacks, *args, **kwargs)

        setattr(module, function_name, with_callback)

    return added


def with_bridge_callback(callbacks: Any) -> Any:
    """``callbacks`` with the Bridge MemoryLogCallback in it, unless one is there (a list, None, or
    Bridge's CallbackManager)."""
    from . import bridge

    if callbacks is None or isinstance(callbacks, (list, tuple)):
        present = [c for c in callbacks or () if isinstance(c, bridge.MemoryLogCallback)]
        return list(callbacks or ()) if present else [*(callbacks or ()), _new_bridge_callback()]
    registered = [getattr(f, "__self__", None) for f in callbacks.list_callbacks("on_train_start")]
    if not any(isinstance(c, bridge.MemoryLogCallback) for c in registered):
        callbacks.add(_new_bridge_callback())
    return callbacks


def _new_bridge_callback():
    from . import bridge

    return bridge.MemoryLogCallback(**_taken(settings_from_env(), bridge.OWN_SETTINGS))


def _lightning(module: Any) -> None:
    trainer_class = module.Trainer
    original = trainer_class.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        from . import lightning

        if not any(isinstance(c, lightning.MemoryLogCallback) for c in self.callbacks):
            settings = {"log_memory_to_tensorboard": True, **_taken(settings_from_env(), lightning.SETTINGS)}
            self.callbacks.append(lightning.MemoryLogCallback(**settings))

    trainer_class.__init__ = init


#: Module name -> what to do once it has loaded.
WATCHED: dict[str, Callable[[Any], None]] = {
    "megatron.training.training": _megatron_lm,
    "megatron.bridge.training.pretrain": _bridge("pretrain"),
    "megatron.bridge.training.finetune": _bridge("finetune"),
    "lightning.pytorch.trainer.trainer": _lightning,
    "pytorch_lightning.trainer.trainer": _lightning,
}


def _instrument(module: Any, then: Callable[[Any], None]) -> None:
    try:
        then(module)
    except Exception as error:  # noqa: BLE001 -- the user's program runs as it would without us
        log.warning("nemo_memlog: could not instrument %s (%r); it runs without memory logging", module.__name__, error)


class _Then(importlib.abc.Loader):
    """A module's own loader, then ``then(module)`` (never raising into the import)."""

    def __init__(self, loader: Any, then: Callable[[Any], None]):
        self.loader, self.then = loader, then

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _instrument(module, self.then)

    def __getattr__(self, name):  # get_source, get_filename, is_package...: the module's own loader's
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a WATCHED name, the spec the other finders give, with a _Then loader."""

    def find_spec(self, name, path, target=None):
        then = WATCHED.get(name)
        if then is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Then(spec.loader, then)
                return spec
        return None


def activate() -> None:
    """Watch for the frameworks' imports in this process (once). A watched module already loaded is
    instrumented now."""
    if any(isinstance(finder, _Finder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
    for name, then in WATCHED.items():
        module = sys.modules.get(name)
        if module is not None:
            _instrument(module, then)

"""``nemo-memlog run``'s side inside each Python process: the way in added once its framework is imported.

``nemo-memlog run -- COMMAND`` puts ``autorun/`` on ``PYTHONPATH``; its ``sitecustomize`` (the
bootstrap) runs the user's own ``sitecustomize``, then installs an import hook that imports nothing of
ours. When a watched module (the bootstrap's ``WATCHED``, which names the way in) has loaded,
``add_way_in`` adds its way in, with the settings of the ``NEMO_MEMLOG_<FIELD>`` variables
(``settings_from_env``; ``--set key=value`` sets them), each typed by its field's declared type
(config/text.py):

- ``megatron_lm`` (``megatron.training.training``, Megatron-LM's loop): ``megatron_lm.install()``; it
  then follows Megatron-LM's ``--log-memory-to-tensorboard``.
- ``bridge`` (``megatron.bridge.training.pretrain`` / ``.finetune``): their function adds the Bridge
  ``MemoryLogCallback`` to the callbacks it is given, unless one is there; it then follows the
  recipe's ``logger.log_memory_to_tensorboard``.
- ``lightning`` (``lightning.pytorch`` / ``pytorch_lightning``'s ``Trainer``): the Lightning
  ``MemoryLogCallback`` added to each trainer unless one is there; on unless
  ``NEMO_MEMLOG_LOG_MEMORY_TO_TENSORBOARD`` says false (Lightning has no flag of its own).

With ``NEMO_MEMLOG_CPU_STAND_INS`` on, Megatron-LM's loop first gets the CPU stand-ins of
``nemo_memlog.testing.megatron.lm_stand_ins`` (the documented switch, docs/megatron_lm.md).

Nothing here raises into the user's program: a way in that cannot be added (a bad ``NEMO_MEMLOG_*``
value, an error of ours) is one notice of the ``nemo_memlog`` logger, and the program runs as it
would without.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from ..config import FIELDS, TextError, fields_from_text
from ..config.switches import env_name

log = logging.getLogger("nemo_memlog")


def settings_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """LoggerConfig fields from ``NEMO_MEMLOG_<FIELD>`` variables, each typed by its field's declared
    type (a path stays a string), checked together. Raises ValueError naming the variable, the field
    and what to write."""
    environ = os.environ if environ is None else environ
    texts = {name: environ[env_name(name)] for name in FIELDS if env_name(name) in environ}
    try:
        return fields_from_text(texts)
    except TextError as error:
        raise ValueError(f"{env_name(error.field) if error.field else 'NEMO_MEMLOG_*'}: {error}") from None


def add_way_in(module: Any, way_in: str | None, *, cpu_stand_ins: bool = False, said: set | None = None) -> None:
    """Add ``way_in`` (a name of WAYS_IN; None: none) to the watched ``module`` that has just loaded,
    after the CPU stand-ins of Megatron-LM's loop (``cpu_stand_ins``: the bootstrap says when). Never
    raises: what fails is one notice (once per process, ``said`` holding what was said), and the
    program runs without."""
    said = set() if said is None else said
    try:
        if cpu_stand_ins:
            _cpu_stand_ins()
        if way_in is None:
            return
        try:
            settings = settings_from_env()
        except ValueError as error:  # set by hand, not through nemo-memlog run (which refuses it at launch)
            _say_once(said, f"nemo_memlog: {error}; this process runs without memory logging")
            return
        WAYS_IN[way_in](module, settings, said)
    except Exception as error:  # noqa: BLE001 -- the user's program runs as it would without us
        _say_once(
            said, f"nemo_memlog: could not instrument {module.__name__} ({error}); it runs without memory logging"
        )


def _say_once(said: set, text: str) -> None:
    if text not in said:
        said.add(text)
        try:
            log.warning("%s", text)
        except Exception:  # noqa: BLE001, S110 -- a notice never fails the program
            pass


def _taken(settings: dict, names: tuple) -> dict:
    return {name: value for name, value in settings.items() if name in names}


def _cpu_stand_ins() -> None:
    from ..testing.megatron import lm_stand_ins as megatron_lm_stand_ins

    megatron_lm_stand_ins.install()


def _megatron_lm(module: Any, settings: dict, said: set) -> None:
    from . import megatron_lm

    megatron_lm.install(**_taken(settings, megatron_lm.OWN_SETTINGS))


def _bridge(module: Any, settings: dict, said: set) -> None:
    function_name = module.__name__.rsplit(".", 1)[-1]  # pretrain, finetune
    original = getattr(module, function_name)

    @functools.wraps(original)
    def with_callback(config: Any, forward_step_func: Any, callbacks: Any = None, *args: Any, **kwargs: Any):
        if getattr(getattr(config, "logger", None), "log_memory_to_tensorboard", False):
            try:
                callbacks = with_bridge_callback(callbacks, settings)
            except Exception as error:  # noqa: BLE001 -- Bridge trains on, without ours
                _say_once(said, f"nemo_memlog: no memory logging added to {function_name}() ({error})")
        return original(config, forward_step_func, callbacks, *args, **kwargs)

    setattr(module, function_name, with_callback)


def with_bridge_callback(callbacks: Any, settings: dict | None = None) -> Any:
    """``callbacks`` with the Bridge MemoryLogCallback in it (made with ``settings``' fields it takes),
    unless one is there (a list, None, or Bridge's CallbackManager)."""
    from . import bridge

    settings = settings or {}

    if callbacks is None or isinstance(callbacks, (list, tuple)):
        present = [c for c in callbacks or () if isinstance(c, bridge.MemoryLogCallback)]
        return list(callbacks or ()) if present else [*(callbacks or ()), _new_bridge_callback(settings)]
    registered = [getattr(f, "__self__", None) for f in callbacks.list_callbacks("on_train_start")]
    if not any(isinstance(c, bridge.MemoryLogCallback) for c in registered):
        callbacks.add(_new_bridge_callback(settings))
    return callbacks


def _new_bridge_callback(settings: dict) -> Any:
    from . import bridge

    return bridge.MemoryLogCallback(**_taken(settings, bridge.OWN_SETTINGS))


def _lightning(module: Any, settings: dict, said: set) -> None:
    trainer_class = module.Trainer
    original = trainer_class.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            _add_lightning_callback(self, settings)
        except Exception as error:  # noqa: BLE001 -- the Trainer trains on, without ours
            _say_once(said, f"nemo_memlog: no memory logging added to this Trainer ({error})")

    trainer_class.__init__ = init


def _add_lightning_callback(trainer: Any, settings: dict) -> None:
    from . import lightning

    if not any(isinstance(c, lightning.MemoryLogCallback) for c in trainer.callbacks):
        taken = {"log_memory_to_tensorboard": True, **_taken(settings, lightning.SETTINGS)}
        trainer.callbacks.append(lightning.MemoryLogCallback(**taken))


#: Way in -> what to add to its watched module once loaded (the bootstrap's WATCHED names them).
WAYS_IN: dict[str, Callable[[Any, dict, set], None]] = {
    "megatron_lm": _megatron_lm,
    "bridge": _bridge,
    "lightning": _lightning,
}

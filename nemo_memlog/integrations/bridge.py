"""Megatron-Bridge integration: ``MemoryLogCallback``, for recipes run with ``pretrain()``.

    from nemo_memlog.bridge import MemoryLogCallback
    pretrain(cfg, forward_step, callbacks=[MemoryLogCallback()])

Thin by design: it translates Bridge's events, step numbers, groups and already-open
loggers into a MemoryMonitor, and nothing in the core imports this module.

- Settings: ``log_memory_to_tensorboard``, ``tensorboard_log_interval`` and
  ``memory_keys`` come from the recipe's own ``cfg.logger`` (so the dotted overrides users
  already pass work); nemo_memlog's own settings are keyword arguments.
- Steps: ``on_train_step_end`` fires before Bridge increments ``train_state.step``, and
  Bridge's ``training_log`` then logs that iteration at ``step + 1``. Memory is gated and
  logged at ``step + 1`` too, so memory and loss share an x-axis.
- Loggers: on the last rank, the monitor writes into the TensorBoard writer, W&B run,
  MLflow run and Comet experiment Bridge opened (``state.*_logger``), on the training
  thread, before Bridge logs the same step; it opens none of its own.
- Once per series: Bridge's own ``training_log`` also writes ``memory/*`` when the flag is
  set (before 0.5, the last stage's values only). The callback takes that over and leaves the
  recipe's config as the user wrote it: while a callback's run is open in the process, the
  report Bridge's ``training_log`` writes to its dashboards (its ``report_memory(memory_keys=...)``
  call, in 0.3 and 0.6 alike) is empty, so Bridge writes no memory series, and the callback
  writes every series itself, pipeline-wide. Bridge's console line (its ``report_memory(keys)``
  call after the first iterations) is untouched.
- Flight records: every rank records its memory for ``nemo-memlog postmortem``, by default in
  ``memory_records`` beside the recipe's ``logger.tensorboard_dir`` (else its
  ``wandb_save_dir``, else the working directory); ``memory_record_dir=`` picks another
  folder, ``memory_record_dir="off"`` none. ``on_train_end`` marks the record ended.
- The end of training: ``on_train_end``; on Bridge's ``should_exit`` path (a signal,
  ``exit_duration_in_mins``, ``exit_interval``: ``train()`` calls ``sys.exit`` before
  ``on_train_end``), the next ``on_train_start`` over the same ``cfg.logger`` in this
  process (a caught ``SystemExit``, a driver that trains again). A process that exits
  leaves no one to read the flag.
- MLflow names: as the installed Bridge spells its report dicts there (``bridge_mlflow_spelling``).
- What the memory is made of (measure/composition.py): ``context.model`` and ``context.optimizer`` at
  each logging step; on Bridge 0.6+ its own ``estimate_training_memory`` once, at
  ``on_train_start``, logged beside the measurement (measure/estimate.py; 0.3.1 has no estimator: none
  is logged). Activations are measured on each logging step, between ``on_train_step_start`` and
  ``on_train_step_end`` (measure/activations.py).
- Memory phases (measure/phase.py), on every rank: ``eval`` from ``on_eval_start`` to ``on_eval_end``;
  ``checkpoint_save`` from the ``on_train_step_end`` of an iteration Bridge saves at (the step it
  is about to count is a multiple of ``cfg.checkpoint.save_interval``, with ``cfg.checkpoint.save``
  set) to ``on_checkpoint_save`` where Bridge fires it at once (0.4+, synchronous saves), else to
  the next ``on_train_step_start`` or ``on_train_end``: with ``async_save`` Bridge fires
  ``on_checkpoint_save`` at finalisation, steps later, so the phase covers the synchronous part
  (staging the state) and not the background write; Bridge 0.3.1 has no such event. The phase
  spans what Bridge does between the step and the save: its logging, and an evaluation due at
  the same iteration (then measured as both: phases nest).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from megatron.bridge.training.callbacks import Callback

from ..config import LoggerConfig, checked_settings, memory_record_dir, resolve_fields, switched_off
from ..measure import estimate
from ..monitor import MemoryMonitor
from ..warn import notice
from .door import Adapter, guarded, is_last_rank

#: Our settings that Bridge's LoggerConfig lacks: the callback's keyword arguments.
BRIDGE_FIELDS = ("log_memory_to_tensorboard", "tensorboard_log_interval", "memory_keys")
OWN_SETTINGS = tuple(
    f.name for f in dataclasses.fields(LoggerConfig) if f.name.startswith("memory_") and f.name not in BRIDGE_FIELDS
)
#: Per process, by nature: the callbacks whose run has not ended; while any is, Bridge's own
#: dashboard memory report is empty (_silence_bridge_memory_report). On Bridge's should_exit path
#: ``sys.exit`` comes between a callback's on_train_start and its on_train_end, so the one left to
#: end that run is the next on_train_start over the same ``cfg.logger`` in this process, from this
#: callback or another (see _end_training). Strong references: after a caught SystemExit nothing
#: else may keep the callback alive.
_holding: set[MemoryLogCallback] = set()


class MemoryLogCallback(Adapter, Callback):
    """Pipeline-wide memory in a Megatron-Bridge recipe's own dashboards. Register it on every rank.

    ``log_memory_to_tensorboard``, ``tensorboard_log_interval`` and ``memory_keys`` come from
    the recipe's ``cfg.logger``; with its flag off the callback does nothing (the last rank says
    which flag to set, once). It writes into the loggers Bridge opened, at Bridge's step, and opens
    none of its own. Whatever goes wrong in one of its events (a setting that cannot work, a
    reduction that failed) is one notice on the "nemo_memlog" logger, and the recipe trains on
    without memory logging (door.py).

    Args:
        **settings: nemo_memlog's own LoggerConfig fields whose names start with ``memory_``
            (``memory_reduce_timeout_s``, ``memory_record_dir``...), other than ``memory_keys``.

    Raises:
        ValueError: an unknown setting name, or a value that cannot work, naming the field (here).
    """

    FRAMEWORK = "Megatron-Bridge's loop"

    def __init__(self, **settings: Any):
        self.stopped = switched_off()  # NEMO_MEMLOG_DISABLED: every event does nothing; no setting is read
        self.settings = settings
        if not self.stopped:
            checked_settings(
                "MemoryLogCallback",
                settings,
                OWN_SETTINGS,
                " (log_memory_to_tensorboard, tensorboard_log_interval and memory_keys come from the recipe's "
                "cfg.logger)",
            )
        self.monitor: MemoryMonitor | None = None
        self._bridge_logger = None
        self._save_interval = None  # cfg.checkpoint.save_interval, where Bridge saves (on_train_start)
        self._flag_off_said = False

    @guarded
    def on_train_start(self, context: Any) -> None:
        bridge_logger = context.state.cfg.logger
        for callback in [callback for callback in _holding if callback._bridge_logger is bridge_logger]:
            callback._end_training(flush=False)  # it exited by sys.exit (a caught SystemExit): hand the flag back
        if not bridge_logger.log_memory_to_tensorboard:
            if not self._flag_off_said and is_last_rank():
                notice(FLAG_OFF)
            self._flag_off_said = True
            return
        # The flight records' default folder is beside the recipe's own logs (its tensorboard_dir).
        settings = {
            **self.settings,
            "memory_record_dir": self.settings.get("memory_record_dir") or memory_record_dir(bridge_logger),
        }
        run_settings = resolve_fields(  # checked once, here; the monitor and the writers take it as it is
            log_memory_to_tensorboard=True,
            tensorboard_log_interval=bridge_logger.tensorboard_log_interval,
            memory_keys=bridge_memory_keys(getattr(bridge_logger, "memory_keys", None)),
            **settings,
        )
        microbatches = _microbatches()
        monitor = MemoryMonitor.open(
            run_settings,
            pg_collection=_pg_collection(context.model),
            writers=lambda: _adopt_open_loggers(context.state, run_settings),
            facts=_facts(context.state.cfg, microbatches),
        )
        _silence_bridge_memory_report()
        checkpoint = getattr(context.state.cfg, "checkpoint", None)  # read once: Bridge saves where it says
        self._save_interval = getattr(checkpoint, "save_interval", None) if getattr(checkpoint, "save", None) else None
        monitor.estimate = estimate.bridge_estimate(context.state.cfg, microbatches)  # None before 0.6
        self.monitor, self._bridge_logger = monitor, bridge_logger
        _holding.add(self)

    @guarded
    def on_train_step_end(self, context: Any) -> None:
        monitor = self.monitor
        if monitor is None:
            return
        step = context.state.train_state.step + 1
        monitor.log(step, model=context.model, optimizer=getattr(context, "optimizer", None))
        if self._save_interval and step % self._save_interval == 0:
            monitor.phase_start("checkpoint_save", step)

    @guarded
    def on_train_step_start(self, context: Any) -> None:
        if self.monitor is not None:  # the step on_train_step_end will log: measure its activations
            self.monitor.phase_end("checkpoint_save")  # an async save's staging, or a Bridge without on_checkpoint_save
            self.monitor.before_iteration(context.state.train_state.step + 1, context.model)

    @guarded
    def on_checkpoint_save(self, context: Any) -> None:
        if self.monitor is not None:
            self.monitor.phase_end("checkpoint_save")

    @guarded
    def on_eval_start(self, context: Any) -> None:
        if self.monitor is not None:
            self.monitor.phase_start("eval", context.state.train_state.step)

    @guarded
    def on_eval_end(self, context: Any) -> None:
        if self.monitor is not None:
            self.monitor.phase_end("eval")

    @guarded
    def on_train_end(self, context: Any) -> None:
        self._end_training(flush=True)

    def _end_training(self, flush: bool) -> None:
        """Once per run: hand Bridge its memory report back (when no other run is open), end the
        phases and the flight record, release the run's gloo group and, at ``on_train_end``, flush.
        Off that event (Bridge's should_exit path) there is nothing to flush: every step was
        written into Bridge's loggers when it was logged, and Bridge flushes and ends them itself
        before ``sys.exit``."""
        if self.monitor is None:
            return
        self._release()
        monitor, self.monitor = self.monitor, None
        # Bridge's own loggers are flushed, never closed; after sys.exit Bridge has ended them: not even flushed.
        monitor.close(writers=flush)

    def _release(self) -> None:
        _holding.discard(self)
        self._bridge_logger = None


#: What the last rank says, once, when the recipe's memory flag is off.
FLAG_OFF = (
    "nemo_memlog: the recipe's logger.log_memory_to_tensorboard is off, so no memory is logged; set "
    "logger.log_memory_to_tensorboard=true (cfg.logger.log_memory_to_tensorboard = True) to log every "
    "pipeline stage's memory"
)


def _silence_bridge_memory_report() -> None:
    """Wrap Bridge's ``train_utils.report_memory`` (once per process): the call its ``training_log``
    makes for the dashboards (by keyword, ``memory_keys=``) returns {} while a callback's run is
    open, so Bridge writes no ``memory/*`` series beside ours; every other call (its console line,
    positional) and every call with no run open gets Bridge's own report. The user's
    ``cfg.logger`` is never written."""
    from megatron.bridge.training.utils import train_utils

    original = train_utils.report_memory
    if getattr(original, "__wrapped__", None) is not None:
        return

    def report_memory(*args: Any, **kwargs: Any) -> dict:
        if _holding and not args and "memory_keys" in kwargs:
            return {}
        return original(*args, **kwargs)

    report_memory.__wrapped__ = original  # type: ignore[attr-defined]
    train_utils.report_memory = report_memory


def bridge_memory_keys(memory_keys: dict | None) -> dict | None:
    """The recipe's ``memory_keys``, named as Bridge names them: ``bytes`` -> ``gigabytes``
    in the logged names of byte statistics, as Bridge's ``report_memory`` renames them
    (values are GB in both), so a recipe's own series keep their names. None (the recipe
    sets none): our DEFAULT_MEMORY_KEYS names (``peak_reserved_gb``...), which headroom and
    the per-stage defaults key on; docs/bridge.md maps Bridge's default names to them."""
    if not memory_keys:
        return None
    return {stat: name.replace("bytes", "gigabytes") if "bytes" in stat else name for stat, name in memory_keys.items()}


def _microbatches() -> int | None:
    """Microbatches per iteration, as Bridge's calculator has them (None where it is not set up)."""
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        return get_num_microbatches()
    except Exception:  # not initialised (a harness without it): no per-microbatch figure
        return None


def _facts(cfg, microbatches: int | None) -> dict:
    """The run's facts the per-layer record carries (measure/layer_record.py), as the recipe states them."""
    train = getattr(cfg, "train", None)
    optimizer = getattr(cfg, "optimizer", None)
    facts = {
        "microbatches": microbatches,
        "micro_batch_size": getattr(train, "micro_batch_size", None),
        "global_batch_size": getattr(train, "global_batch_size", None),
        "optimizer": getattr(optimizer, "optimizer", None),
        "distributed_optimizer": getattr(getattr(cfg, "ddp", None), "use_distributed_optimizer", None),
        "recompute": getattr(getattr(cfg, "model", None), "recompute_granularity", None),
        "framework": "megatron-bridge",
    }
    facts["selective_recompute_ratio"] = estimate.selective_share(cfg)
    return {name: value for name, value in facts.items() if isinstance(value, (bool, int, float, str))}


def _pg_collection(model):
    """Bridge's process groups for ``model`` (megatron-core's parallel_state without one)."""
    try:
        from megatron.bridge.training.utils.pg_utils import get_pg_collection
    except ImportError:
        return None
    return get_pg_collection(model) if model else None


def _adopt_open_loggers(state, settings):
    """Writers over every logger Bridge opened: each ``*_logger`` property of its state
    (opened on first access, on the last rank only), whatever backends this Bridge has; the run's
    ``settings`` recorded in its TensorBoard run (the peak window ``nemo-memlog report`` reads)."""
    from ..writers import adopt_writers

    names = sorted(
        name
        for name in dir(type(state))
        if name.endswith("_logger") and isinstance(getattr(type(state), name), property)
    )
    loggers = (getattr(state, name) for name in names)
    return adopt_writers(loggers, spellings={"mlflow": bridge_mlflow_spelling()}, config=settings)


def bridge_mlflow_spelling() -> Callable[[str], str]:
    """``key -> name`` as the installed Bridge spells its report dicts (memory, throughput,
    runtime) in MLflow, so our series sort with its own: its own ``_sanitize_mlflow_metrics``
    where it can be imported, else its version's rule (``bridge_mlflow_rule``)."""
    try:
        from megatron.bridge.training.utils.mlflow_utils import _sanitize_mlflow_metrics
    except ImportError:
        from importlib.metadata import version

        return bridge_mlflow_rule(version("megatron-bridge"))
    return lambda key: next(iter(_sanitize_mlflow_metrics({key: None})))


def bridge_mlflow_rule(bridge_version: str) -> Callable[[str], str]:
    """Bridge's MLflow spelling by release. Before 0.4 every ``/`` -> ``_``
    (``memory_mem-max-allocated-gigabytes``). From 0.4 the first ``/`` stays and later ones
    become ``_``, runs of ``/`` count as one, ``@`` -> ``_at_``, and anything but letters,
    digits, ``_ - . / :`` and space -> ``_`` (``memory/mem-max-allocated-gigabytes``)."""
    if tuple(int(part) for part in re.findall(r"\d+", bridge_version)[:2]) < (0, 4):
        return lambda key: key.replace("/", "_")
    return _spelling_from_0_4


def _spelling_from_0_4(key: str) -> str:
    name = re.sub(r"/+", "/", key.replace("@", "_at_"))
    if "/" in name:
        first, rest = name.split("/", 1)
        name = first + "/" + rest.replace("/", "_")
    return re.sub(r"[^/\w.\- :]", "_", name)

"""Megatron-LM's own training loop (``megatron.training``: ``pretrain`` -> ``train`` -> ``train_step``
-> ``training_log``, shipped in the megatron-core wheel from 0.17): ``install()``.

    from nemo_memlog import megatron_lm
    megatron_lm.install()                    # every rank, before pretrain(...)
    pretrain(config, datasets_provider, model_type, forward_step, ...)

or, with no edit of the script, ``nemo-memlog run -- torchrun ... pretrain_gpt.py ...``.

Thin by design: it translates the loop's calls, steps, groups and open writers into a
MemoryMonitor, and nothing in the core imports this module.

- Switched by Megatron-LM's own flags: ``--log-memory-to-tensorboard`` on, every
  ``--tensorboard-log-interval``. Without the flag nothing happens: no collective, no record, no
  series, no thread (each wrapped call reads one attribute and calls through); the last rank says
  once which flag to add.
- Never fails the job: whatever goes wrong in an event of ours (``--tensorboard-log-interval 0``, a
  setting, a failed reduction) is one notice, and Megatron-LM trains on without it (door.py).
- The way in: Megatron-LM 0.19 has no callback API, so ``install()`` rebinds five functions of
  ``megatron.training.training`` that ``pretrain()`` and ``train()`` look up at call time
  (``WRAPPED``), each a call through to the original around one event of ``LoopMemoryLog``.
  A loop that lacks one fails at ``install()`` (``MegatronLMError``, naming it and the version).
- Steps: ``training_log(..., iteration)`` runs on every rank at every iteration, after
  ``train_step``, and writes ``lm loss`` at ``iteration`` when it is a multiple of
  ``--tensorboard-log-interval``. Memory is gated by the same rule and logged at the same step.
  ``train_step(..., iteration=i)`` runs iteration ``i + 1``: its activations are measured when
  ``i + 1`` logs.
- Writers: on the last rank, the monitor writes into Megatron-LM's own SummaryWriter and W&B run
  (``get_tensorboard_writer()``, ``get_wandb_writer()``), on the training thread, right after
  Megatron-LM logs the same step; it opens none of its own (the stage runs are folders under
  Megatron-LM's, as for every adopted SummaryWriter).
- Megatron-LM's ``mem-*`` scalars are taken over: its ``training_log`` writes four from
  ``torch.cuda.memory_stats()`` on the last rank alone. While it runs, its flag reads off (its
  only reader is that block); the same four names are then written by the monitor with the
  pipeline's max (``MEM_SERIES``), and not at all where no rank has device statistics (on CPU).
  Its console memory lines (``report_memory``) are untouched.
- Facts from Megatron-LM's args: micro-batch size, microbatches, global batch, distributed
  optimizer, recompute, schedule (interleaved with virtual pipeline stages).
- Memory phases: ``checkpoint_save`` around ``save_checkpoint_and_time`` and ``eval`` around
  ``evaluate_and_print_results``, on every rank. The run stays open after ``train()`` returns, for
  what ``pretrain`` runs next: a final save and the evaluations on the valid and test sets are
  phases as well; as no logging step follows them, the phases of the last iterations are written
  when ``train()`` returns and each final evaluation's when it ends, at the last iteration
  (``MemoryMonitor.log_phases``: one gather), and the last of them ends the run.
- Run config: recorded in Megatron-LM's TensorBoard run as a run of ours records it (its
  ``memory_peak_window`` included, which ``nemo-memlog report`` reads), secrets redacted.
- ``NEMO_MEMLOG_DISABLED=true``: ``install()`` rebinds nothing (config/switches.py).
- Flight records: beside ``--tensorboard-dir`` (``memory_records``), else ``--wandb-save-dir``,
  else the working directory; ``memory_record_dir=`` in ``install()`` picks another folder.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from ..config import LoggerConfig, checked_settings, memory_record_dir, resolve_fields, switched_off
from ..monitor import MemoryMonitor
from ..rank.memory import DEFAULT_MEMORY_KEYS, GB
from ..warn import notice
from ..writers import adopt_writers
from .door import Adapter, guarded, is_last_rank

#: The functions of megatron.training.training that install() rebinds, each looked up at call time.
WRAPPED = ("train", "train_step", "training_log", "save_checkpoint_and_time", "evaluate_and_print_results")
#: The keyword arguments: nemo_memlog's own settings (Megatron-LM's flags give the rest).
OWN_SETTINGS = tuple(
    f.name for f in dataclasses.fields(LoggerConfig) if f.name.startswith("memory_") and f.name != "memory_keys"
)
#: Megatron-LM's memory scalars -> (our key, whether a byte count): the pipeline's max under its names.
MEM_SERIES = {
    "mem-reserved-bytes": ("current_reserved_gb", True),
    "mem-allocated-bytes": ("current_allocated_gb", True),
    "mem-max-allocated-bytes": ("peak_allocated_gb", True),
    "mem-allocated-count": ("current_allocation_count", False),
}
#: What a logging step reads from torch.cuda.memory_stats(): ours, and the one mem-* count we lack.
MEMORY_KEYS = {**DEFAULT_MEMORY_KEYS, "allocation.all.current": "current_allocation_count"}


class MegatronLMError(RuntimeError):
    """This megatron-core's Megatron-LM loop lacks what install() wraps: the message names it and the version."""


class LoopMemoryLog(Adapter):
    """Pipeline-wide memory in Megatron-LM's own dashboards, one object per process: its methods are
    the loop's events, fired by the functions ``install()`` rebinds (on every rank). Whatever goes
    wrong in one of them (an interval of 0, a setting that cannot work) is one notice on the
    "nemo_memlog" logger, and Megatron-LM trains on without memory logging (door.py).

    Args:
        **settings: nemo_memlog's own LoggerConfig fields whose names start with ``memory_``
            (``memory_record_dir``, ``memory_reduce_timeout_s``...), other than ``memory_keys``.

    Raises:
        ValueError: an unknown setting, or a value that cannot work, naming the field.
    """

    FRAMEWORK = "Megatron-LM's loop"

    def __init__(self, **settings: Any):
        self.stopped = switched_off()  # NEMO_MEMLOG_DISABLED: every event does nothing; no setting is read
        self.settings = settings
        if not self.stopped:
            checked_settings(
                "megatron_lm.install",
                settings,
                OWN_SETTINGS,
                " (--log-memory-to-tensorboard and --tensorboard-log-interval come from Megatron-LM's flags)",
            )
        self.monitor: MemoryMonitor | None = None
        self._model: Any = None
        self._optimizer: Any = None
        self._flag_off_said = False
        self._iteration: int | None = None  # the iteration training_log last ran at
        self._evaluations_left = 0  # pretrain's evaluations after train() returned, still to come

    @guarded
    def on_train_start(self, model: Any, optimizer: Any) -> None:
        """``train()`` starts: with Megatron-LM's memory flag on, the run opens (every rank); off, the
        last rank says which flag to add, once."""
        from megatron.training.global_vars import get_args, get_tensorboard_writer, get_wandb_writer

        args = get_args()
        if self._evaluations_left:  # a train() after one whose final evaluations never came: that run ends
            self.on_train_end()
        self._model, self._optimizer = model, optimizer
        if self.monitor is not None:
            return
        if not args.log_memory_to_tensorboard:
            if not self._flag_off_said and is_last_rank():
                notice(FLAG_OFF)
            self._flag_off_said = True
            return
        folder = self.settings.get("memory_record_dir") or memory_record_dir(
            SimpleNamespace(
                log_memory_to_tensorboard=True,
                memory_record_dir=None,
                tensorboard_dir=args.tensorboard_dir,
                wandb_save_dir=getattr(args, "wandb_save_dir", None),
            )
        )
        settings = resolve_fields(  # a setting that cannot work raises here, at the start, naming it
            log_memory_to_tensorboard=True,
            tensorboard_log_interval=args.tensorboard_log_interval,
            memory_keys=MEMORY_KEYS,
            **{**self.settings, "memory_record_dir": folder},
        )
        run_config = _run_config(args)
        monitor = MemoryMonitor.open(
            settings,
            run_config=run_config,
            # Megatron-LM's own writers, with the run config recorded in its TensorBoard run (the peak
            # window ``nemo-memlog report`` reads: its events hold no config of ours otherwise).
            writers=lambda: adopt_writers(
                [get_tensorboard_writer(), get_wandb_writer()], config=settings, run_config=run_config
            ),
            facts=facts(args),
        )
        monitor.derived = megatron_lm_series
        self.monitor = monitor

    @guarded
    def on_train_step_start(self, iteration: int) -> None:
        """Iteration ``iteration`` starts: measure its activations when it logs."""
        if self.monitor is not None and self._model is not None:
            self.monitor.before_iteration(iteration, self._model)

    @guarded
    def on_log(self, iteration: int) -> None:
        """``training_log`` of ``iteration`` has run (every rank): memory at the same step."""
        if self.monitor is not None:
            self._iteration = iteration
            self.monitor.log(iteration, model=self._model, optimizer=self._optimizer)

    @guarded
    def on_save_checkpoint_start(self, iteration: int | None) -> None:
        if self.monitor is not None:
            self.monitor.phase_start("checkpoint_save", iteration)

    @guarded
    def on_save_checkpoint_end(self, iteration: int | None) -> None:
        if self.monitor is not None:
            self.monitor.phase_end("checkpoint_save")

    @guarded
    def on_eval_start(self, iteration: int | None) -> None:
        if self.monitor is not None:
            self.monitor.phase_start("eval", iteration)

    @guarded
    def on_eval_end(self, iteration: int | None) -> None:
        """An evaluation ended. One of ``pretrain``'s after ``train()`` returned (on the valid, then the
        test set): no logging step follows it, so its phase is written now, at ``iteration`` (the last
        one, where Megatron-LM writes its validation loss), and the last of them ends the run."""
        monitor = self.monitor
        if monitor is None:
            return
        monitor.phase_end("eval")
        if self._evaluations_left:
            self._evaluations_left -= 1
            monitor.log_phases(iteration if isinstance(iteration, int) else self._iteration or 0)
            if not self._evaluations_left:
                self.on_train_end()

    @guarded
    def on_train_returned(self, iteration: Any) -> None:
        """``train()`` returned (every rank, at the same point): the phases of its last iterations (an
        evaluation at the last one) are written at its last step, which no logging step follows; the
        run stays open for the evaluations ``pretrain`` runs next (``final_evaluations``: they are
        phases too, and a final checkpoint save before them), and ends after the last, or now."""
        monitor = self.monitor
        if monitor is None:
            return
        from megatron.training.global_vars import get_args

        last = iteration if isinstance(iteration, int) else self._iteration
        if last is not None:
            monitor.log_phases(last)
        self._evaluations_left = final_evaluations(get_args())
        if not self._evaluations_left:
            self.on_train_end()

    @guarded
    def on_train_end(self) -> None:
        """The run ends: after ``pretrain``'s last evaluation, when ``train()`` returned with none to
        come, or when ``train()`` exits (``sys.exit`` on its should_exit path, an error). End the
        phases and the flight record, release the run's gloo group and flush Megatron-LM's writers
        (never closed: they are its own). A run whose evaluations never come (the process ends
        first) is ended by interpreter exit, its flight record marked "exit". Never raises."""
        monitor, self.monitor = self.monitor, None
        self._model = self._optimizer = None
        self._evaluations_left = 0
        if monitor is not None:
            monitor.close()

    def _release(self) -> None:
        self._model = self._optimizer = None


#: What the last rank says, once, when Megatron-LM's memory flag is off.
FLAG_OFF = (
    "nemo_memlog: Megatron-LM's --log-memory-to-tensorboard is off, so no memory is logged; "
    "add --log-memory-to-tensorboard to log every pipeline stage's memory"
)


#: The earlier name of ``LoopMemoryLog``, kept working: Bridge's and Lightning's ``MemoryLogCallback`` are
#: callbacks of their frameworks' APIs; Megatron-LM's loop has none, and this is what install() drives.
MemoryLogCallback = LoopMemoryLog


def megatron_lm_series(logged: dict) -> dict:
    """Megatron-LM's four ``mem-*`` scalars from a logged step: each the pipeline's max (bytes as
    ints), and absent where no rank had the statistic (a CPU-only job)."""
    out: dict[str, int] = {}
    for name, (key, in_bytes) in MEM_SERIES.items():
        value = logged.get("memory/" + key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = round(value * GB) if in_bytes else int(value)
    return out


def final_evaluations(args: Any) -> int:
    """How many ``evaluate_and_print_results`` calls ``pretrain`` makes after ``train()`` returns: on
    the valid set (``do_valid``; not on the RL path, whose evaluation is another function) and on
    the test set (``do_test``)."""
    valid = bool(getattr(args, "do_valid", False)) and not getattr(args, "perform_rl_step", False)
    return int(valid) + int(bool(getattr(args, "do_test", False)))


def facts(args: Any) -> dict:
    """The run's facts as Megatron-LM's args state them (None where the loop does not know one)."""
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        microbatches = get_num_microbatches()
    except Exception:  # noqa: BLE001 -- a calculator not set up: no per-microbatch figure
        microbatches = None
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    return {
        "micro_batch_size": args.micro_batch_size,
        "microbatches": microbatches,
        "global_batch_size": args.global_batch_size,
        "distributed_optimizer": bool(getattr(args, "use_distributed_optimizer", False)),
        "recompute": getattr(args, "recompute_granularity", None) or "none",
        "schedule": "interleaved" if vpp else "1f1b",
        "framework": "megatron-lm",
    }


def _run_config(args: Any) -> dict:
    """What the writers record as the run's configuration: Megatron-LM's args that are plain values
    (secrets redacted by the writers)."""
    return {name: value for name, value in vars(args).items() if isinstance(value, (bool, int, float, str))}


# ---- the way in: rebinding -------------------------------------------------------------------


def install(**settings: Any) -> LoopMemoryLog:
    """Log pipeline-wide memory from Megatron-LM's own loop: call on every rank before ``pretrain``.

    Installing again returns the callback installed first (its settings stand; different ones
    are said to be ignored). Where the loop's functions are no longer the ones it rebound (the
    module was reloaded, ``importlib.reload``), it says so and rebinds them again. Called while
    ``train()`` runs, it says that this ``train()`` is not instrumented (a later one is). Each is
    one notice of this process on the "nemo_memlog" logger. With ``NEMO_MEMLOG_DISABLED=true`` it
    rebinds nothing and checks no setting: it returns a callback whose events do nothing.

    Args:
        **settings: nemo_memlog's own settings (``memory_record_dir``, ``memory_reduce_timeout_s``...).

    Returns:
        The LoopMemoryLog the rebound functions drive.

    Raises:
        MegatronLMError: no ``megatron.training.training``, or it lacks a function install() wraps.
        ValueError: an unknown setting, or one that cannot work.
    """
    if switched_off():  # NEMO_MEMLOG_DISABLED: Megatron-LM's loop as without us, its mem-* included
        return LoopMemoryLog(**settings)  # stopped: its events do nothing, and none is fired
    loop = sys.modules.get(LOOP)
    callback: LoopMemoryLog | None = getattr(loop, MARK, None)  # what install() put into this loop
    if callback is not None:
        if settings and settings != callback.settings:
            notice("nemo_memlog: megatron_lm.install() again with other settings: the first install's stand")
        wrapped_by: LoopMemoryLog | None = getattr(loop.train, MARK, None) if loop is not None else None
        if wrapped_by is callback:
            return callback
        notice(RELOADED)
    training = _loop()
    if callback is None:
        callback = LoopMemoryLog(**settings)
    if _train_running(training):
        notice(TOO_LATE)
    for name, wrap in _WRAPPERS.items():
        original = getattr(training, name)
        wrapped = functools.wraps(original)(wrap(original, inspect.signature(original), callback))
        setattr(wrapped, MARK, callback)
        setattr(training, name, wrapped)
    setattr(training, MARK, callback)  # the install state lives on the module it patched; a reload keeps it
    return callback


#: The module install() rebinds, and the attribute that marks its wrappers (kept by functools.wraps
#: in a wrapper of a wrapper) and the module itself: the callback install() put there. On the module,
#: it outlives ``importlib.reload`` (which keeps the module's namespace), so a second install() finds
#: it and rebinds the reloaded functions with it.
LOOP = "megatron.training.training"
MARK = "__nemo_memlog_callback__"
RELOADED = (
    f"nemo_memlog: {LOOP}'s functions are no longer the ones megatron_lm.install() rebound (the module was "
    f"reloaded, importlib.reload, or they were reassigned): install() rebinds them again"
)
TOO_LATE = (
    "nemo_memlog: megatron_lm.install() was called while Megatron-LM's train() runs: this train() is not "
    "instrumented (its start has passed); call install() before pretrain(...)"
)


def _train_running(training: Any) -> bool:
    """Whether a ``train`` of ``training`` is on this thread's stack (install() called from inside it)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "train" and frame.f_globals.get("__name__") == training.__name__:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _loop():
    """megatron.training.training, with every function install() wraps, else MegatronLMError."""
    try:
        from importlib.metadata import version

        found = version("megatron-core")
    except Exception:  # noqa: BLE001 -- megatron from a source tree
        found = "unknown"
    try:
        import megatron.training.training as training
    except ImportError as error:
        raise MegatronLMError(
            f"megatron_lm.install(): megatron-core {found} has no Megatron-LM training loop "
            f"(megatron.training.training: {error}); it ships in megatron-core 0.17 and later"
        ) from None
    for name in WRAPPED:
        if not callable(getattr(training, name, None)):
            raise MegatronLMError(
                f"megatron_lm.install(): megatron.training.training.{name} is missing in megatron-core {found}; "
                f"nemo_memlog wraps {', '.join(WRAPPED)}"
            )
    return training


def _argument(signature: inspect.Signature, name: str) -> Callable[[tuple, dict], Any]:
    """A reader of argument ``name`` of a call of the function with ``signature``, resolved once: by
    keyword, else by its position (None where the call has neither). No binding per call: the reader
    runs on every rank at every iteration."""
    names = list(signature.parameters)
    position = names.index(name) if name in names else None
    default = signature.parameters[name].default if name in names else None
    default = None if default is inspect.Parameter.empty else default

    def read(args: tuple, kwargs: dict) -> Any:
        if name in kwargs:
            return kwargs[name]
        return args[position] if position is not None and position < len(args) else default

    return read


def _train(original: Callable, signature: inspect.Signature, callback: LoopMemoryLog) -> Callable:
    model_of, optimizer_of = _argument(signature, "model"), _argument(signature, "optimizer")

    def train(*args: Any, **kwargs: Any) -> Any:
        callback.on_train_start(model_of(args, kwargs), optimizer_of(args, kwargs))
        try:
            result = original(*args, **kwargs)
        except BaseException:  # sys.exit on the should_exit path, an error: no evaluation follows
            callback.on_train_end()
            raise
        callback.on_train_returned(result[0] if isinstance(result, tuple) and result else None)
        return result

    return train


def _train_step(original: Callable, signature: inspect.Signature, callback: LoopMemoryLog) -> Callable:
    iteration_of = _argument(signature, "iteration")

    def train_step(*args: Any, **kwargs: Any) -> Any:
        if callback.monitor is not None:
            iteration = iteration_of(args, kwargs)
            if isinstance(iteration, int):
                callback.on_train_step_start(iteration + 1)  # train() counts the iteration after it ran
        return original(*args, **kwargs)

    return train_step


def _training_log(original: Callable, signature: inspect.Signature, callback: LoopMemoryLog) -> Callable:
    from megatron.training.global_vars import get_args

    iteration_of = _argument(signature, "iteration")

    def training_log(*args: Any, **kwargs: Any) -> Any:
        monitor = callback.monitor
        iteration = iteration_of(args, kwargs)
        if monitor is None or not isinstance(iteration, int) or not monitor.logs_at(iteration):
            result = original(*args, **kwargs)  # Megatron-LM writes its mem-* on logging iterations only
        else:
            megatron_args = get_args()
            flag = megatron_args.log_memory_to_tensorboard
            megatron_args.log_memory_to_tensorboard = False  # its mem-* from the last rank alone: ours replace them
            try:
                result = original(*args, **kwargs)
            finally:
                megatron_args.log_memory_to_tensorboard = flag
        if monitor is not None:
            callback.on_log(iteration)
        return result

    return training_log


def _phase(start: str, end: str) -> Callable:
    def wrap(original: Callable, signature: inspect.Signature, callback: LoopMemoryLog) -> Callable:
        iteration_of = _argument(signature, "iteration")

        def phased(*args: Any, **kwargs: Any) -> Any:
            if callback.monitor is None:
                return original(*args, **kwargs)
            iteration = iteration_of(args, kwargs)
            getattr(callback, start)(iteration)
            try:
                return original(*args, **kwargs)
            finally:
                getattr(callback, end)(iteration)

        return phased

    return wrap


_WRAPPERS = {
    "train": _train,
    "train_step": _train_step,
    "training_log": _training_log,
    "save_checkpoint_and_time": _phase("on_save_checkpoint_start", "on_save_checkpoint_end"),
    "evaluate_and_print_results": _phase("on_eval_start", "on_eval_end"),
}

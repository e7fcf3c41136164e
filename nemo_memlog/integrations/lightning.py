"""Lightning integration: ``MemoryLogCallback``, for ``lightning.pytorch`` (NeMo 2) and ``pytorch_lightning``.

    from nemo_memlog.lightning import MemoryLogCallback
    trainer = Trainer(..., callbacks=[MemoryLogCallback()])
    recipe.trainer.callbacks.append(MemoryLogCallback())        # a NeMo 2 recipe

Thin by design: it translates Lightning's events, step numbers, groups and loggers into a
MemoryMonitor, and nothing in the core imports this module.

- Group: megatron-core's pipeline group when its ``parallel_state`` is initialised (NeMo 2's
  ``MegatronStrategy``), else the whole world, with the exact global rank of each max
  (``memory_reduce_scope="world"``). One gather per logging step, none otherwise.
- Steps: ``on_train_batch_end`` on every rank. Lightning logs its own metrics of that batch
  right after it, at ``fit_loop.epoch_loop._batches_that_stepped`` (``global_step - 1``
  there), when ``(that + 1) % log_every_n_steps == 0``. Memory is gated by the same rule
  and logged at the same step, so memory and loss share an x-axis; on the batch that
  steps the optimizer only (with gradient accumulation, the last of the window). Unlike
  Lightning's own rule it never logs off-interval because ``trainer.should_stop`` is set:
  one rank could see that alone, and the others would wait in the gather.
- Loggers: every logger the trainer has (``trainer.loggers``), written through its own
  ``log_metrics`` on global rank 0, where Lightning's loggers write (their ``log_metrics``
  is rank-zero-only). It opens no run or writer of its own, and never reads
  ``trainer.log_dir`` (a broadcast: a collective that only some ranks entered would hang).
  Lightning's own metrics are not touched: memory goes in a ``log_metrics`` call of its own.
- Activations (measure/activations.py): measured over the batches of each logging step (every batch of a
  gradient-accumulation window), armed at the first one's ``on_train_batch_start``, read at the
  logging ``on_train_batch_end``. ``training_step`` is no module's forward, so each batch is one
  microbatch, from ``on_train_batch_start`` to ``on_before_backward``. (Under NeMo 2's
  MegatronStrategy, whose training_step runs a whole pipeline schedule, a step therefore counts
  as one microbatch: use the Megatron-Bridge callback or training_log for per-microbatch figures.)
- Settings: keyword arguments, named and validated as LoggerConfig's fields.
- Memory phases (measure/phase.py), on every rank: ``eval`` from ``on_validation_start`` to
  ``on_validation_end``; ``checkpoint_save`` from ``on_save_checkpoint`` to the next hook this
  callback sees (the next batch, a validation, the end of training). Lightning calls
  ``on_save_checkpoint`` at the end of building the checkpoint dict, before the strategy writes
  it: the write is measured, the collection of the model and optimizer state before it is not
  (Lightning has no hook before it), nor is an asynchronous write (``AsyncCheckpointIO``) after
  the call returns.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

from ..config import LoggerConfig, checked_settings, resolve_fields, switched_off
from ..monitor import MemoryMonitor
from ..rank import megatron
from ..warn import misuse
from ..writers import adopt_writers
from .door import Adapter, guarded

if TYPE_CHECKING:
    import torch

#: The keyword arguments: LoggerConfig's fields that concern what is measured and when.
#: Not the writer fields (tensorboard_dir, wandb_project, ...): the trainer's loggers are the writers.
SETTINGS = ("log_memory_to_tensorboard", "tensorboard_log_interval", "memory_keys") + tuple(
    f.name for f in dataclasses.fields(LoggerConfig) if f.name.startswith("memory_")
)
#: Lightning's loggers write on global rank 0 only.
WRITER_RANK = 0


def _callback_bases() -> tuple:
    """Lightning's ``Callback`` from each package that is installed: the callback is an
    instance of both, so either package's Trainer accepts it wherever it checks."""
    bases = []
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            bases.append(importlib.import_module(package).Callback)
        except ImportError:
            continue
    if not bases:
        raise ImportError(
            "nemo_memlog.lightning needs Lightning: pip install 'nemo_memlog[lightning]' "
            "(the lightning package), or pytorch_lightning"
        )
    return tuple(bases)


if TYPE_CHECKING:  # what a type checker reads: Lightning's Callback (the class below is both packages')
    from lightning.pytorch import Callback as LightningCallback
else:
    LightningCallback = type("LightningCallback", _callback_bases(), {})


class MemoryLogCallback(Adapter, LightningCallback):
    """Job-wide memory peak, and where it lives, in the trainer's own loggers. Register it
    on every rank (as ``Trainer(callbacks=[...])`` does).

    Writes through every logger of ``trainer.loggers`` on global rank 0, at the step Lightning
    logs its own metrics of the batch; opens no logger of its own (none: it warns and logs nothing).

    Args:
        **settings: LoggerConfig's fields of the same names (``SETTINGS``: the ``memory_*``
            fields, ``log_memory_to_tensorboard``, ``tensorboard_log_interval``, ``memory_keys``);
            None means the default. Defaults of its own: ``log_memory_to_tensorboard=True``
            (False: no collective, nothing logged); ``tensorboard_log_interval``: Lightning's
            ``log_every_n_steps`` (an int counts optimizer steps the same way);
            ``memory_reduce_scope``: "pp" when megatron-core's parallel_state is initialised at
            ``on_train_start``, else "world".

    Whatever goes wrong in one of its events (a setting that cannot work, a reduction that
    failed) is one notice on the "nemo_memlog" logger, and the Trainer trains on without memory
    logging (door.py).

    Raises:
        ValueError: an unknown setting name, such as a writer setting, or a value that cannot
            work, naming the field (here).
    """

    FRAMEWORK = "Lightning's Trainer"

    def __init__(self, **settings: Any):
        # None means "the default" for our settings; an unknown name raises whatever its value.
        given = {name: value for name, value in settings.items() if value is not None or name not in SETTINGS}
        self.stopped = switched_off()  # NEMO_MEMLOG_DISABLED: every event does nothing; no setting is read
        self.settings = {"log_memory_to_tensorboard": True, **given}
        if not self.stopped:
            checked_settings(
                "MemoryLogCallback",
                self.settings,
                SETTINGS,
                ". It writes into the Trainer's own loggers: add one there (Trainer(logger=...)), not a writer setting",
            )
        self.monitor: MemoryMonitor | None = None

    @guarded
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        settings = dict(self.settings)
        interval = settings.pop("tensorboard_log_interval", trainer.log_every_n_steps)
        if not settings["log_memory_to_tensorboard"] or not interval:
            return  # off, or log_every_n_steps=0 (Lightning logs nothing while training): no collective
        if not trainer.loggers:  # the same on every rank, so all skip the gather alike
            misuse(  # from Lightning's hook: said at its line, never raised into training
                "nemo_memlog: MemoryLogCallback has no logger to write to (Trainer(logger=False)); "
                "memory is not logged",
                RuntimeWarning,
            )
            return
        scope = settings.pop("memory_reduce_scope", None) or _scope()
        if scope == "pp" and megatron.pipeline_group() is None:
            misuse(
                "nemo_memlog: memory_reduce_scope='pp' but megatron-core's parallel_state is not "
                "initialised, so there is no pipeline group: rank 0 logs its own memory only. Leave "
                "memory_reduce_scope unset for every rank's",
                RuntimeWarning,
            )
        run_settings = resolve_fields(tensorboard_log_interval=interval, memory_reduce_scope=scope, **settings)
        self.monitor = MemoryMonitor.open(
            run_settings,
            writer_rank=WRITER_RANK,
            writers=lambda: adopt_writers(trainer.loggers),
            facts=_facts(trainer),
        )

    @guarded
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        monitor = self.monitor
        if monitor is None:
            return
        monitor.phase_end("checkpoint_save")
        monitor.meter.close_microbatch()  # a batch without a backward (manual optimization skipped it)
        epoch_loop = trainer.fit_loop.epoch_loop
        if epoch_loop._should_accumulate():  # no optimizer step on this batch: no step ends
            return
        # Lightning logs this step's metrics at the steps taken before it, when the count after it logs.
        step = epoch_loop._batches_that_stepped
        monitor.log(step + 1, model=pl_module, optimizer=list(trainer.optimizers), step=step)

    @guarded
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.monitor is not None:  # a logging step's batches: measure their activations (measure/activations.py)
            self.monitor.phase_end("checkpoint_save")
            self.monitor.before_iteration(trainer.fit_loop.epoch_loop._batches_that_stepped + 1, pl_module)
            self.monitor.meter.open_microbatch()  # training_step is no module's forward: the batch is one

    @guarded
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self.monitor is not None:
            self.monitor.meter.close_microbatch()

    @guarded
    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self.monitor is not None:
            self.monitor.phase_start("checkpoint_save", trainer.global_step)

    @guarded
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None:
            self.monitor.phase_end("checkpoint_save")
            self.monitor.phase_start("eval", trainer.global_step)

    @guarded
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None:
            self.monitor.phase_end("eval")

    @guarded
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """The end of training: the run's close (its phases, meter, flight record and gloo group ended;
        the loggers flushed, and finalized by the Trainer)."""
        monitor, self.monitor = self.monitor, None
        if monitor is not None:
            monitor.close()


def _facts(trainer) -> dict:
    """What the per-layer record says of the run (nemo-memlog advise): the train dataloader's batch
    size as the micro-batch size, gradient accumulation's batches as the microbatches per step."""
    loader = getattr(trainer, "train_dataloader", None)
    size = getattr(loader, "batch_size", None)
    accumulate = getattr(trainer, "accumulate_grad_batches", None)
    return {
        "framework": "lightning",
        "micro_batch_size": size if isinstance(size, int) else None,
        "microbatches": accumulate if isinstance(accumulate, int) else None,
    }


def _scope() -> str:
    """The pipeline group when megatron-core has one (NeMo 2), else every rank of the job."""
    return "pp" if megatron.pipeline_group() is not None else "world"

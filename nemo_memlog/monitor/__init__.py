"""MemoryMonitor: one run's memory logging, its life and its step.

Beside it in this package: ``placement`` (this rank's group and place in the job) and ``training_log``
(the free function ``training_log``, which finds its run by config).

A run keeps its settings, reduction state, placement (monitor/placement.py), flight recorder, writers
(writer rank only) and once-only warnings; ``close()`` releases them.

Every way in (``training_log``, Megatron-LM, Megatron-Bridge, Lightning) drives the same protocol, the
run's one door (docs/architecture.md): ``open`` (or the constructor), ``before_iteration``, ``log``,
``phase_start``/``phase_end`` (``log_phases`` after the last step), ``close``. Whether an iteration
logs is ``logs_at``'s alone, from the settings and the iteration, so every rank decides alike; off the
logging iterations that is the whole call: no collective, no measurement, no allocation, no backend
call. In a framework's run a step is logged once. The facts, however given, are checked and redacted
(``state_facts``). A logging step (``log_step``) measures (measure/step.py), records, gathers,
attributes, advises, merges and writes, in that order.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from .. import advice, attribution, process_wide
from ..config import BACKEND_SETTINGS, checked_facts, resolve, secrets_of
from ..failure import peers
from ..measure import composition, estimate, layer_record, layer_rows, phase
from ..measure.activations import ActivationMeter
from ..measure.step import StepMeasurement, measure_step
from ..metrics import merged
from ..rank import memory
from ..reduce import Reduction, takes_part
from ..warn import WarnOnce, logging_off_message
from .placement import Placement, place

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from ..writers.base import Writers


class MemoryMonitor:
    """One run's memory logging, on every rank of the job.

    Args:
        config: anything ``config.resolve`` reads: a LoggerConfig, Megatron-Bridge's config or its
            ``.logger``, a Settings.
        pg_collection: megatron-core's process-group collection, where the job has one.
        pp_group: the pipeline-parallel group to reduce over (default: found from ``pg_collection``
            or megatron-core's parallel_state; without one, the whole world).
        writers: anything with ``log(metrics, step)``; default: the fan-out built from the
            settings on the writer rank, at the first logging step.
        writer_rank: the global rank that writes; None: the last, where Megatron logs (a framework
            whose loggers live elsewhere, such as Lightning's on rank 0, names its own).
        run_config: what the writers record as the run's configuration (default: ``config``).

    Raises:
        ValueError, TypeError: a setting that cannot work, naming the field and what to change.
    """

    def __init__(
        self,
        config: Any,
        *,
        pg_collection: Any = None,
        pp_group: ProcessGroup | None = None,
        writers: Writers | None = None,
        writer_rank: int | None = None,
        run_config: Any = None,
    ) -> None:
        self.settings = resolve(config)  # raises, naming the field and what to change
        if self.settings.interval_peaks:  # the process's CUDA peak counters are ours to reset
            memory.peak_counters.device_resets = True
        self.config = config if run_config is None else run_config  # recorded by the writers as the run config
        # The gate's inputs (logs_at), read on every rank at every iteration.
        self.enabled = bool(self.settings.log_memory_to_tensorboard)
        self.interval = self.settings.tensorboard_log_interval
        self.record_dir = self.settings.record_dir  # absolute now, as the working directory is now; None: off
        # The run's secrets: scrubbed from its warnings, redacted from its facts.
        from ..writers.base import CONFIGURED, environment_secrets  # each backend names its own

        self.secrets = [*secrets_of(self.settings), *environment_secrets(list(CONFIGURED), dict(os.environ))]
        self.warnings = WarnOnce(secrets=self.secrets)
        self.reduction = self._new_reduction()
        self.placement: Placement | None = None  # resolved at the first logging step (``place``)
        self.recorder: Any = None  # opened at placement, when the coordinates are known
        self.writers = writers
        self._owns_writers = writers is None
        self._groups = (pp_group, pg_collection)
        self.writer_rank = writer_rank
        self.model_state = composition.ModelState()
        self.estimate: dict | None = None  # the framework's estimate (measure/estimate.py), set by an integration
        self.derived: Callable[[dict], dict] | None = None  # a framework's own names for figures (mem-*)
        self.facts: dict = {}  # the run's facts for the per-layer record (measure/layer_record.py): as known
        self.meter = ActivationMeter(self.warnings)  # armed on logging iterations only
        # The last logging step that counted a model, with the last activations measured: the OOM
        # record's breakdown and the optimizer's facts (``run_facts``).
        self._kept: StepMeasurement | None = None
        self._measured_steps = 0  # the logging steps whose activations were measured (per-layer record)
        self._facts_given: Any = None  # a copy of the facts= last taken: checked again only when they change
        # Memory logging off: the backend settings it ignores, until said once (rank 0) to a call that
        # brings something it ignores; None once said, and for a run that logs.
        self._off_unsaid: list[str] | None = (
            None if self.enabled else [name for name in BACKEND_SETTINGS if getattr(self.settings, name)]
        )
        self._last_step: int | None = None  # the step last logged: a second log of it is ignored
        self.once_per_step = False  # a framework's run (open): a step that comes twice is a second way in
        self._phases = phase.Slots()  # the memory phases an integration opened through this run

    @classmethod
    def open(
        cls,
        config: Any,
        *,
        facts: Mapping[str, Any] | None = None,
        pg_collection: Any = None,
        pp_group: ProcessGroup | None = None,
        writers: Callable[[], Writers] | None = None,
        writer_rank: int | None = None,
        run_config: Any = None,
    ) -> MemoryMonitor:
        """A run opened now, at a framework's start (every rank, the groups in place): placed, writing
        into ``writers()`` (a framework's open loggers: called on the writer rank only; flushed, never
        closed), ``facts`` checked and redacted. Raises ValueError, TypeError for a setting, a
        ``writer_rank`` or a fact that cannot work, naming it."""
        monitor = cls(
            config, pg_collection=pg_collection, pp_group=pp_group, writer_rank=writer_rank, run_config=run_config
        )
        monitor.place()
        if writers is not None and monitor.is_writer_rank:
            monitor.use_writers(writers())
        if facts:
            monitor.state_facts(**facts)
        monitor.once_per_step = True
        return monitor

    def logs_at(self, iteration: int) -> bool:
        """The gate, the only one: whether ``iteration`` is a logging iteration. Every way in reads
        it, on every rank at every iteration, from the settings and the iteration only, so every
        rank decides alike. Two attribute reads and a modulo; no call, no allocation."""
        return self.enabled and not iteration % self.interval

    def log(
        self,
        iteration: int,
        metrics: dict | None = None,
        *,
        model: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
        optimizer: Any = None,
        facts: dict | None = None,
        step: int | None = None,
    ) -> dict | None:
        """A step (every rank, every iteration): on logging iterations (``logs_at(iteration)``, the
        only gate) ``log_step``, which returns the unified dict with ``metrics`` merged; off them
        None, and nothing else. ``step``: where it is recorded, where the framework logs elsewhere
        than at the iteration (Lightning: one less); default ``iteration``. In a framework's run
        (``open``) a second ``log`` of the step last logged returns None (said once); training_log's
        take the caller's iterations as given. ``model``, ``optimizer``: what the memory is made of
        (every rank of the group passes them, or none). ``facts``: ``state_facts``, at the first call
        that carries them and when they change. A run with logging off reads nothing a call brings,
        and says so once, on rank 0, when a call brings something it ignores. During a SIGTERM's close
        that ends the process, the main thread waits here for its end (process_wide.hold_if_ending)."""
        if process_wide.holding:
            process_wide.hold_if_ending()
        if not self.enabled:  # the run is off: no iteration logs, and nothing the call brings is read
            if self._off_unsaid is not None:
                self._say_off(metrics, model, optimizer, facts)
            return None
        if facts is not None and facts != self._facts_given:  # checked where they are given, once
            self.facts.update(checked_facts(facts, self.secrets))
            self._facts_given = dict(facts)  # a mapping: checked_facts raised otherwise
        if not self.logs_at(iteration):  # the fast path
            return None
        if metrics is not None and not isinstance(metrics, Mapping):  # before any collective: every rank alike
            raise TypeError(f"metrics= must be a dict of names to numbers, or None; got {type(metrics).__name__}")
        at = iteration if step is None else step
        if at == self._last_step and self.once_per_step:  # every rank sees the same calls: all skip alike
            self.warn_once(("twice",), f"step {at} was logged already; a second log of it is ignored")
            return None
        logged = self.log_step(at, metrics, model=model, optimizer=optimizer)
        self._last_step = at
        return logged

    def before_iteration(self, iteration: int, model: torch.nn.Module | Sequence[torch.nn.Module] | None) -> None:
        """Arm the activation meter on ``model`` if ``iteration`` logs (every rank alike: the gate's inputs
        only); off them a modulo, nothing installed. TypeError for a ``model`` that is no module."""
        if model is not None and self.logs_at(iteration):
            self._arm(model)

    def phase_start(self, name: str, iteration: int | None) -> None:
        """Phase ``name`` starts on this rank, until ``phase_end(name)`` (measure/phase.py)."""
        self._phases.enter(name, iteration)

    def phase_end(self, name: str) -> None:
        """End phase ``name`` (nothing where it is not open)."""
        self._phases.leave(name)

    def log_phases(self, iteration: int) -> dict | None:
        """The phases ended since the last logging step, gathered (one collective: every rank of the group
        calls it at the same point) and written alone at ``iteration``: a framework's phases after its last
        step (Megatron-LM's final evaluations). The unified dict; None for a run not placed or off."""
        placement = self.placement
        if not self.enabled or placement is None:
            return None
        report = phase.take_pending()
        if takes_part({"": 0}, placement.group):  # the group alone decides, not this rank's phases: all alike
            timeout_s = self.settings.memory_reduce_timeout_s
            gathered = self.reduction.gather(report, placement.group, iteration=iteration, timeout_s=timeout_s)
        else:
            gathered = self.reduction.single_rank(report)
        logged = self._attributed(gathered, placement)
        if placement.is_writer_rank and logged:
            self._writers().log(logged, iteration)
            self._writers().flush()  # no later step flushes it
        return logged

    def _arm(self, model: torch.nn.Module | Sequence[torch.nn.Module]) -> None:
        composition.check_model_and_optimizer(model, None)
        self.meter.arm(model)
        if self.meter.error is not None:
            self.warn_once(("activations",), f"activations cannot be measured on this model ({self.meter.error})")

    def state_facts(self, **facts: Any) -> None:
        """What the run knows of itself, for the per-layer record and ``nemo-memlog advise``:
        ``micro_batch_size``, ``microbatches`` (per iteration), ``global_batch_size``,
        ``distributed_optimizer``, ``recompute``... (None values are ignored). Checked here
        (config/facts.py): raises ValueError naming a fact that breaks its rule, and records a
        secret-named fact, or one holding a configured secret, redacted."""
        self.facts.update(checked_facts(facts, self.secrets))

    def _say_off(self, metrics, model, optimizer, facts) -> None:
        """Memory logging is off, and this call brings what it ignores: say so, once, on rank 0."""
        text = logging_off_message(
            self._off_unsaid or [], model=model, optimizer=optimizer, facts=facts, metrics=metrics
        )
        if text is None:
            return  # nothing ignored yet: a later call that brings something is told
        self._off_unsaid = None
        distributed = dist.is_available() and dist.is_initialized()
        if (dist.get_rank() if distributed else int(os.environ.get("RANK", "0") or 0)) == 0:
            self.warn_once(("off",), text, misuse=True)

    @property
    def run_facts(self) -> dict:
        """The run's facts as known: the optimizer's (read at the last logging step), then the stated ones."""
        optimizer = self._kept.optimizer_facts if self._kept is not None else None
        return {**(optimizer or {}), **self.facts}

    def log_step(
        self,
        iteration: int,
        metrics: dict | None = None,
        *,
        model: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
        optimizer: Any = None,
    ) -> dict:
        """The logging step itself, past ``log``'s gate and its once-only check (``log`` calls it;
        a benchmark may call it alone; a way in never does): measure, record, gather, attribute,
        advise, merge and write, in that order; returns the unified dict. Raises TypeError, naming
        the argument, for a ``model`` or ``optimizer`` it cannot count, before any collective (every
        rank alike)."""
        if model is not None or optimizer is not None:
            composition.check_model_and_optimizer(model, optimizer)  # before any collective: every rank alike
        placement = self.placement or self.place()
        settings = self.settings
        # Measure: this rank's numbers, and what they are made of.
        step = measure_step(self._report(), self.meter, self.model_state, model, optimizer)
        self._keep(step)
        # Record, before the collective: a rank that dies in it has this step.
        if step.state is not None and step.measured is not None and self.record_dir is not None:
            self._write_layers(iteration, step, model, optimizer)
        if settings.interval_peaks:
            memory.reset_peaks()  # the next report's peak_* cover the next interval only
        if self.recorder is not None:
            self.recorder.record(iteration, step.report)
        # Gather: the one collective over the group (or this rank alone).
        if takes_part(step.report, placement.group):
            gathered = self.reduction.gather(
                step.report,
                placement.group,
                iteration=iteration,
                interval=self.interval,
                timeout_s=settings.memory_reduce_timeout_s,
            )
        else:
            gathered = self.reduction.single_rank(step.report)
        logged = self._attributed(gathered, placement)
        profile = self._profile(gathered, placement) if model is not None else None  # advise
        logged.update(advice.step_metrics(profile))  # the same arithmetic on every rank: one dict
        if self.derived is not None:
            logged.update(self.derived(logged))
        unified = merged(metrics, logged, self.warn_misuse)
        if placement.is_writer_rank:  # write
            self._writers().log(unified, iteration)
            # Once per kind (device, host): a node's ranks share its RAM, so the stage with the
            # least can flip from step to step, and a warning per flip would be noise.
            for kind, sentence in advice.headroom_warnings(unified, settings.memory_headroom_warn_fraction, profile):
                self.warn_once(("headroom", kind), sentence)
        return unified

    def _keep(self, step: StepMeasurement) -> None:
        """Keep ``step`` where it counted a model (OOM record, ``run_facts``), with the last activations measured."""
        if step.state is None:
            return
        if step.measured is None and self._kept is not None:
            step = dataclasses.replace(step, measured=self._kept.measured)
        self._kept = step

    def _attributed(self, gathered: Any, placement: Placement) -> dict:
        """The gathered values as the logged metrics (attribution.py), with the framework's estimate where given."""
        settings = self.settings
        if placement.world:
            logged = attribution.world_metrics(gathered, settings.memory_per_stage_keys, placement.coordinates)
        else:
            logged = attribution.memory_metrics(gathered, settings.memory_per_stage_keys)
        if self.estimate:
            stage0 = attribution.stage_figures(
                gathered, estimate.ESTIMATED_STAGE, estimate.PARTS, stage_of=placement.stage_of
            )
            logged.update(estimate.derived(self.estimate, stage0))
        return logged

    @property
    def group(self) -> Any:  # the group the run reduces over (its gloo twin where it has one); None until placed
        return None if self.placement is None else self.placement.group

    @property
    def is_writer_rank(self) -> bool:  # hands the steps to the writers; False until placed
        return self.placement is not None and self.placement.is_writer_rank

    def place(self) -> Placement:
        """Resolve this rank's group and place in the job now, instead of at the first logging step, and
        open its flight record. Every rank calls it at the same time, with the process groups in place
        (``placement.place``). Raises ValueError: ``writer_rank`` is not a rank of this job."""
        self.placement = place(self.settings, self.reduction, self._groups, self.writer_rank, self.warn_misuse)
        if self.record_dir is not None and self.recorder is None:
            from ..failure.recorder import open_recorder

            pp_group, pg_collection = self._groups
            self.recorder = open_recorder(
                self.record_dir,
                pp_group=pp_group,
                pg_collection=pg_collection,
                report=self._oom_report,
                record_history=self.settings.memory_record_history,
                warn=self.warnings,  # the run's one set of once-only warnings
            )
        return self.placement

    def _report(self) -> dict:
        """This rank's report now, as a logging step has it (for the recorder's OOM record)."""
        return {**memory.report_memory(self.settings.memory_keys), **memory.capacity_report()}

    def _oom_report(self) -> dict:
        """The report the flight recorder writes at a CUDA OOM: with the breakdown, once a model was seen."""
        report, kept = self._report(), self._kept
        if kept is None or kept.state is None:
            return report
        return composition.breakdown(report, kept.state, kept.measured)

    def _write_layers(self, iteration: int, step: StepMeasurement, model, optimizer) -> None:
        """This rank's per-layer record (measure/layer_record.py) of a step whose activations were
        measured, beside its flight record. Never raises."""
        try:
            self._measured_steps += 1  # nemo-memlog fit ends a probe once every rank has two (launch/fit/__init__.py)
            assert self.record_dir is not None and self.placement is not None  # a placed run with a folder
            assert step.measured is not None and step.state is not None  # a measured step with a model
            rows = layer_rows.stage_and_rows(step.report, step.measured, model, optimizer, step.state)
            record = layer_record.step_record(
                self.placement.layout,
                iteration=iteration,
                time=time.time(),
                facts=self.run_facts,
                stage_and_rows=rows,
                measured_steps=self._measured_steps,
            )
            cgroup = memory.host_cgroup_peak()
            if cgroup is not None:  # under a memory limit: what advise needs to judge the node as the kernel charges it
                record["host_cgroup"] = cgroup[0]
                record["stage"].update(layer_record.cgroup_figures(step.report, cgroup[1]))
            layer_record.write(self.record_dir, record)
        except Exception as error:  # a full disk, a read-only folder: logging goes on without the file
            self.warn_once(("layers",), f"could not write the per-layer record in {self.record_dir}: {error!r}")

    def use_writers(self, writers: Writers) -> None:
        """Write to ``writers`` (opened by someone else: flushed at close, never closed)."""
        self.writers, self._owns_writers = writers, False

    def _writers(self):
        if self.writers is None:
            from ..writers import build_writers

            self.writers = build_writers(self.settings, run_config=self.config)
            if not self.writers.backend_names:
                *most, last = BACKEND_SETTINGS
                no_writer = f"log_memory_to_tensorboard is on but no writer is configured (set {', '.join(most)} "
                no_writer += f"or {last}); training_log returns the metrics"
                self.warn_once(("no-writer",), no_writer, misuse=True)
        return self.writers

    def _profile(self, gathered: Any, placement: Placement) -> advice.Profile | None:
        """advice.Profile of this step (per-stage parts, the run's facts), or None where they were not measured."""
        try:
            return advice.run_from_gathered(gathered, self.run_facts, placement.layout, stage_of=placement.stage_of)
        except (TypeError, ValueError):  # a value that is not a number where a part should be
            return None

    def _new_reduction(self) -> Reduction:  # with the run's stall watch
        reduction = Reduction(self.warnings, exchange=self.settings.memory_reduce_exchange)
        reduction.stall = (self.settings.memory_reduce_stall_warn_s, self._stalled)
        return reduction

    def _stalled(self, group: Any, iteration: int | None, waited_s: float) -> None:
        """A memory reduction has waited ``waited_s`` (the stall watch's thread): say so, once per logging
        step, naming the ranks whose flight records show they have not reached it. Never raises."""
        try:
            ranks = dist.get_process_group_ranks(group) if group is not None else []
        except Exception:  # a group object torch cannot list
            ranks = []
        behind = peers.not_arrived(self.record_dir, [r for r in ranks if r != dist.get_rank()], iteration)
        timeout_s = self.settings.memory_reduce_timeout_s
        self.warnings(("stall", iteration), peers.stall_message(iteration, waited_s, len(ranks), behind, timeout_s))

    def warn_once(self, key: Hashable, text: str, *, misuse: bool = False) -> None:
        """Say ``nemo_memlog: <text>`` the first time this run sees ``key``: a notice on the "nemo_memlog"
        logger, or for ``misuse`` a RuntimeWarning at the caller's line. Never raises (warn.py)."""
        self.warnings(key, text, stacklevel=4, category=RuntimeWarning if misuse else None)

    def warn_misuse(self, key: Hashable, text: str) -> None:  # warn_once for the caller's own mistake
        self.warnings(key, text, stacklevel=4, category=RuntimeWarning)

    def end_record(self) -> None:
        """Mark this rank's flight record ended ("close") and stop recording. Never raises."""
        recorder, self.recorder = self.recorder, None
        if recorder is not None:
            recorder.close()

    def close(self, *, writers: bool = True) -> None:
        """End the run on this rank: end its phases and the flight record ("close"); release the reduction
        state (channels, and the gloo twin, destroyed: no collective, see Reduction.close); drain and close
        the writers this monitor built, only flush those it was given (``writers=False``: leave them alone,
        a framework ended them). Logging again afterwards places the run anew, a new run."""
        self._phases.leave_all()
        self.meter.finish()  # armed for a logging iteration that never came: its hooks come off
        self.end_record()
        self.reduction.close()
        self.reduction, self.placement, self._last_step = self._new_reduction(), None, None
        if not writers or self.writers is None:
            return
        if self._owns_writers:
            self.writers.close()
            self.writers = None
        else:
            self.writers.flush()

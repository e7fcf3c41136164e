"""LoggerConfig: Megatron-Bridge's logger field names, plus nemo_memlog's own settings; and
Settings, the frozen form of them that a run reads.

A recipe's ``cfg.logger`` (or the whole ``ConfigContainer``) works wherever a LoggerConfig
does: ``setting`` reads either, with our defaults for the fields Megatron-Bridge lacks. A
LoggerConfig checks its fields when it is built (validation.py's rules); a Settings is built
only from fields already checked (resolution.py), so it checks nothing again.
"""

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from ..keys import DEVICE_OTHER, DEVICE_USED
from ..parts import PER_STAGE_KEYS
from ..redaction import redact_uri
from .validation import RECORD_OFF, FieldRules


@dataclass
class LoggerConfig:
    # --- fields shared with Megatron-Bridge's LoggerConfig (same names, same meaning) ---
    log_memory_to_tensorboard: bool = False
    """Turn memory logging on: report, reduce across the pipeline, write."""
    tensorboard_log_interval: int = 1
    """Log memory every this many iterations (iteration % interval == 0)."""
    memory_keys: dict[str, str] | None = None
    """torch.cuda.memory_stats() name -> logged name; None: DEFAULT_MEMORY_KEYS."""
    tensorboard_dir: str | None = None
    """TensorBoard event directory; None: no TensorBoard writer."""
    tensorboard_queue_size: int = 1000
    """The TensorBoard event writer's own queue length (as SummaryWriter's max_queue)."""
    wandb_project: str | None = None
    """W&B project; None: no W&B writer. WANDB_MODE=offline is honoured."""
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    wandb_entity: str | None = None
    mlflow_experiment: str | None = None
    """MLflow experiment name; None: no MLflow writer. Needs mlflow_run_name."""
    mlflow_run_name: str | None = None
    mlflow_tracking_uri: str | None = None
    """e.g. sqlite:///runs/x/mlflow.db or http://host:5000; None: MLflow's default."""
    mlflow_tags: dict[str, str] | None = None
    comet_project: str | None = None
    """Comet project; None: no Comet writer."""
    comet_experiment_name: str | None = None
    comet_workspace: str | None = None
    comet_api_key: str | None = field(default=None, repr=False)
    """Secret: never recorded, printed or written. Falls back to COMET_API_KEY."""
    comet_tags: list[str] | None = None

    # --- nemo_memlog's own ---
    otel_metrics: bool = False
    """Export every memory series, every stage, as OpenTelemetry metrics (the ``otel`` extra),
    configured by OpenTelemetry's own variables: OTEL_METRICS_EXPORTER (otlp, prometheus, console),
    OTEL_EXPORTER_OTLP_ENDPOINT / _HEADERS / _PROTOCOL, OTEL_EXPORTER_PROMETHEUS_HOST / _PORT,
    OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES (docs/writers.md). Off: no OpenTelemetry writer."""
    comet_offline_directory: str | None = None
    """Write a Comet offline archive here; also used when no API key is available."""
    memory_per_stage_keys: list[str] = field(
        default_factory=lambda: ["peak_*", DEVICE_USED.key, DEVICE_OTHER.key, *PER_STAGE_KEYS]
    )
    """Logged names (fnmatch patterns) that also get memory/pp_stage_{i}/<name>."""
    memory_peak_window: str = "run"
    """What each ``peak_*`` value (CUDA allocator peaks and the host's VmHWM) covers.
    "run": the peak since the process started (Megatron-Bridge's behaviour). "interval":
    the peak since the previous logging step; per-stage values, peak stage and headroom
    follow. "interval" resets process-wide state at every logging step
    (torch.cuda.reset_peak_memory_stats, and /proc/self/clear_refs for the host, Linux
    only: elsewhere the host peak stays the run's, with one warning), so anything else
    reading those peaks, such as Megatron's own text memory report, sees them reset too."""
    memory_reduce_scope: str = "pp"
    """"pp": max over the pipeline group; "world": max over every rank, with its location."""
    memory_headroom_warn_fraction: float = 0.10
    """Warn (writer rank) when a stage's free memory falls below this fraction of capacity."""
    memory_reduce_timeout_s: float = 300.0
    """Ranks that joined a memory reduction raise after this long waiting for the others."""
    memory_reduce_stall_warn_s: float = 30.0
    """A memory reduction still waiting after this long warns, on the ranks that arrived, naming
    the ranks whose flight records show they have not (then keeps waiting to the timeout)."""
    memory_reduce_backend: str = "auto"
    """Which process group carries the memory gather. The gathered numbers are host-side
    values, so they need no GPU: "auto" gathers the ``pp`` scope over a gloo group of the
    same ranks (created once, at the first logging step, by every rank together) when the
    job's default group runs on NCCL, and over the group itself otherwise (CPU jobs, and the
    ``world`` scope: docs/configuration.md says why). "gloo": always a gloo group of its own, both scopes.
    "group": the group itself; on NCCL that copies the words to the GPU, runs an NCCL
    kernel on the pipeline's communicator and waits for all queued GPU work."""
    memory_reduce_exchange: str = "all_gather"
    """The steady-state collective of the memory gather. Every rank of a group must use the same:
    ranks that differ all raise MemoryReduceError at their first logging step, naming it.
    "all_gather" (the default): all_gather_single of each rank's words. "all_to_all":
    all_to_all_single of each rank's words repeated once per rank, which delivers the same
    gathered words. gloo runs the all-gather as a ring of N-1 dependent steps and the
    all-to-all as direct sends: on a 2-core CPU box the reduction alone took a third to a half
    less time at PP 4-8 (docs/performance.md). Not the default until it is measured on NCCL."""
    writer_buffer_steps: int = 10000
    """Per backend: logged steps kept for retry while that backend is failing or slow."""
    writer_close_timeout_s: float = 25.0
    """flush()/close() at exit or SIGTERM wait at most this long for the backends; a writer
    process whose training process died drains, closes and exits within it."""
    writer_mode: str = "process"
    """"process": the backends run in a writer process of their own, fed through a socket
    (off the training process's GIL and host RSS; survives a SIGKILL of the trainer).
    "thread": they run in threads of the training process (where no process can be
    started). Loggers another framework opened in this process (Megatron-Bridge's, through
    nemo_memlog.bridge) are written on its training thread, in neither mode."""
    memory_record_dir: str | None = None
    """The memory flight recorder's folder: every rank keeps its last logging steps (and a
    CUDA OOM, and how it ended) in ``rank-<rank>.memrec`` there, for ``nemo-memlog
    postmortem`` after a failure. On whenever log_memory_to_tensorboard is on. None: beside
    the run's logs, ``<parent of tensorboard_dir>/memory_records``, else
    ``<wandb_save_dir>/memory_records``, else ``./memory_records``. A path: that folder.
    ``"off"``: no recording (a folder named off: write ``./off``). Rank 0 prints the folder once."""
    memory_record_history: bool = False
    """Record the CUDA allocator's alloc/free history (torch.cuda.memory._record_memory_history)
    so the snapshot a CUDA OOM writes shows which code allocated what. Costs time on every
    allocation and host memory for the traces (docs/postmortem.md); off: the snapshot still shows every
    segment and block, without stack traces."""

    def __new__(cls, *args, **kwargs):
        """An unknown keyword raises a TypeError that names the closest field, instead of
        Python's bare "unexpected keyword argument"."""
        for name in kwargs:
            if name not in FIELDS:
                raise TypeError(RULES.unknown_field("LoggerConfig", name))
        return super().__new__(cls)

    def __post_init__(self):
        check_logger_fields(self)


#: LoggerConfig's fields by name, and their rules (validation.py): defaults, types, values.
FIELDS = {f.name: f for f in dataclasses.fields(LoggerConfig)}
#: The settings that open a backend by naming where it writes: the one warning with memory logging
#: off names those set, and the one without a writer names them all.
BACKEND_SETTINGS = ("tensorboard_dir", "wandb_project", "mlflow_experiment", "comet_project")
RULES = FieldRules(FIELDS.values())


def check_logger_fields(logger: Any) -> None:
    """Raise ValueError naming the field, what to write and the value given, for a setting that
    cannot work: first each field's type (from LoggerConfig's annotations), then its value. Reads
    only nemo_memlog's fields of ``logger`` (any object with those names: Megatron-Bridge's
    LoggerConfig has fields of its own, of its own types, which are not ours to check)."""
    RULES.check(logger)


def default_of(name: str) -> Any:
    return RULES.default(name)


def setting(logger: Any, name: str) -> Any:
    """A field of any logger config object, with our default when it lacks the field."""
    return RULES.read(logger, name)


def logger_section(config: Any) -> Any:
    """The logger part of a config: ``config.logger`` for a ConfigContainer, else ``config``.

    Raises TypeError for anything that has ``log_memory_to_tensorboard`` neither itself nor
    on ``.logger`` (None, a plain dict, a misplaced argument): read with every default, such
    a config would log nothing, without a word."""
    if hasattr(config, "log_memory_to_tensorboard"):
        return config
    if hasattr(getattr(config, "logger", None), "log_memory_to_tensorboard"):
        return config.logger
    hint = " A plain dict is not read: pass nemo_memlog.LoggerConfig(**your_dict)." if isinstance(config, dict) else ""
    raise TypeError(
        f"expected a config with log_memory_to_tensorboard: a nemo_memlog.LoggerConfig (e.g. "
        f"from_overrides(...)), Megatron-Bridge's LoggerConfig, or a container whose .logger is one "
        f"(Megatron-Bridge's ConfigContainer); got {type(config).__name__}.{hint}"
    )


#: Set by ``nemo-memlog fit`` in each probe's environment: the folder its records go to, whatever
#: memory_record_dir says, so that every way in (training_log, the callbacks) works unchanged.
PROBE_DIR_ENV = "NEMO_MEMLOG_PROBE_DIR"


def memory_record_dir(logger: Any) -> str | None:
    """The flight recorder's folder for these settings (absolute), or None when it is off:
    memory logging off, or ``memory_record_dir="off"``. See LoggerConfig.memory_record_dir.
    In a probe of ``nemo-memlog fit`` (PROBE_DIR_ENV set), that folder while memory logging is on."""
    chosen = setting(logger, "memory_record_dir")
    if not setting(logger, "log_memory_to_tensorboard"):
        return None
    if os.environ.get(PROBE_DIR_ENV):  # a probe of nemo-memlog fit: its records go where fit reads them
        return os.path.abspath(os.environ[PROBE_DIR_ENV])
    if chosen == RECORD_OFF:
        return None
    if chosen is not None:
        return os.path.abspath(os.fspath(chosen))
    tensorboard_dir = setting(logger, "tensorboard_dir")
    if tensorboard_dir:
        return os.path.join(os.path.dirname(os.path.abspath(os.fspath(tensorboard_dir))), "memory_records")
    wandb_dir = setting(logger, "wandb_save_dir")
    return os.path.abspath(os.path.join(wandb_dir or ".", "memory_records"))


# --------------------------------------------------------------------------------------------
# Settings: what the rest of the package reads, resolved once per run.


@dataclass(eq=True, repr=False)
class Settings(LoggerConfig):
    """Every LoggerConfig field, resolved once from a config (``resolve``), then frozen.

    The one object the run, the reduction, the recorder and the writers read their settings
    from, as attributes named as LoggerConfig's fields (documented there), plus ``record_dir``,
    ``world_scope`` and ``interval_peaks``. Equal settings compare equal (and hash alike),
    whatever object they came from. Mappings and lists are copies: changing the config
    afterwards changes nothing here. Assigning or deleting a field raises
    ``dataclasses.FrozenInstanceError``. ``comet_api_key`` is left out of its repr.

    Built only by ``resolve`` and ``from_plain`` (resolution.py), from fields already checked:
    building one checks nothing again."""

    def __post_init__(self):  # not LoggerConfig's: the fields were checked where they were read
        object.__setattr__(self, "_built", True)

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_built"):
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}: Settings are read-only")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}: Settings are read-only")

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, name) for name in FIELDS))

    def __repr__(self) -> str:
        # A URI's user:password is not shown (secrets.redact_uri).
        shown = ", ".join(f"{name}={redact_uri(getattr(self, name))!r}" for name, spec in FIELDS.items() if spec.repr)
        return f"Settings({shown})"

    @property
    def record_dir(self) -> str | None:
        """The flight recorder's folder (absolute), or None when it is off: see
        LoggerConfig.memory_record_dir."""
        return memory_record_dir(self)

    @property
    def world_scope(self) -> bool:
        return self.memory_reduce_scope == "world"

    @property
    def interval_peaks(self) -> bool:
        return self.memory_peak_window == "interval"

    def to_plain(self) -> dict[str, Any]:
        """Every field as plain dicts, lists and scalars (for the writer process's wire
        format). Secrets are kept: this never goes into a record."""
        return {name: plain(getattr(self, name)) for name in FIELDS}


class FrozenMap(dict):
    """A read-only, hashable dict: a Settings' mappings (``memory_keys``, ``mlflow_tags``). Reads as
    a dict (``json.dumps``, ``isinstance(x, dict)``, ``**x``); every mutator raises TypeError;
    hashes over its sorted items; pickles and copies as itself."""

    __slots__ = ()

    def _refuse(self, *args, **kwargs):
        raise TypeError("a Settings mapping is read-only: build a new config to change it")

    __setitem__ = __delitem__ = __ior__ = _refuse  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def __reduce__(self):
        return (type(self), (dict(self),))

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return f"FrozenMap({dict.__repr__(self)})"


def plain(value: Any) -> Any:
    """``value`` as plain dicts, lists and scalars (picklable where the config's classes are not)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "items"):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or hasattr(value, "__iter__"):
        return [plain(v) for v in value]
    return str(value)

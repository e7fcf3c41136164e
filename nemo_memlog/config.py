"""LoggerConfig: Megatron-Bridge's logger field names, plus nemo_memlog's own settings.

A recipe's ``cfg.logger`` (or the whole ``ConfigContainer``) works wherever a
LoggerConfig does: ``logger_fields`` reads either, with our defaults for the fields
Megatron-Bridge lacks.
"""

import collections.abc
import dataclasses
import difflib
import functools
import os
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .measure.composition import DERIVED, NAMES

SECRET_NAME = re.compile(r"api[_-]?key|token|password|passwd|secret|credential|auth", re.IGNORECASE)
REDACTED = "***redacted***"
#: memory_peak_window's values: the peaks of the whole run, or of each logging interval.
PEAK_WINDOWS = ("run", "interval")
WRITER_MODES = ("process", "thread")
#: memory_reduce_backend's values.
REDUCE_BACKENDS = ("auto", "gloo", "group")
#: memory_record_dir's value that turns the flight recorder off.
RECORD_OFF = "off"


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
    """SummaryWriter's own event queue length."""
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
    comet_offline_directory: str | None = None
    """Write a Comet offline archive here; also used when no API key is available."""
    memory_per_stage_keys: list[str] = field(
        default_factory=lambda: ["peak_*", "device_used_gb", "device_other_gb", *NAMES, *DERIVED]
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
    memory_reduce_backend: str = "auto"
    """Which process group carries the memory gather. The gathered numbers are host-side
    values, so they need no GPU: "auto" gathers the ``pp`` scope over a gloo group of the
    same ranks (created once, at the first logging step, by every rank together) when the
    job's default group runs on NCCL, and over the group itself otherwise (CPU jobs, and the
    ``world`` scope: docs/configuration.md says why). "gloo": always a gloo group of its own, both scopes.
    "group": the group itself; on NCCL that copies the words to the GPU, runs an NCCL
    kernel on the pipeline's communicator and waits for all queued GPU work."""
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

    def __post_init__(self):
        check_logger_fields(self)


_OURS = {f.name: f for f in dataclasses.fields(LoggerConfig)}


def did_you_mean(name: str, known) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``known`` to a misspelt ``name``, else ''."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _refuse_unknown_fields(init):
    """Wrap the dataclass __init__: an unknown keyword raises a TypeError that names the
    closest field, instead of Python's bare "unexpected keyword argument"."""

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        unknown = [name for name in kwargs if name not in _OURS]
        if unknown:
            name = unknown[0]
            raise TypeError(
                f"LoggerConfig has no field {name!r}{did_you_mean(name, _OURS)}; fields: {', '.join(_OURS)}"
            )
        init(self, *args, **kwargs)

    return checked_init


LoggerConfig.__init__ = _refuse_unknown_fields(LoggerConfig.__init__)  # type: ignore[method-assign]


def default_of(name: str):
    spec = _OURS[name]
    return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default  # type: ignore[operator, misc]


def logger_section(config):
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


def setting(logger, name: str):
    """A field of any logger config object, with our default when it lacks the field."""
    value = getattr(logger, name, _ABSENT)
    return default_of(name) if value is _ABSENT else value


_ABSENT = object()


def _type_rule(annotation) -> tuple[Callable[[Any], bool], str]:
    """(accepts(value), what to write) for a LoggerConfig field's annotation: bool takes only a
    bool; int an int (not a bool); float an int or float; str a string (``str | None``: also an
    ``os.PathLike``); dict a mapping; list[str] a list or tuple of strings; ``X | None`` also None."""
    args = typing.get_args(annotation)
    optional = type(None) in args
    if optional:
        (annotation,) = [arg for arg in args if arg is not type(None)]
    kind = typing.get_origin(annotation) or annotation
    if kind is bool:
        accepts, text = (lambda v: isinstance(v, bool)), "true or false (a bool: True or False)"
    elif kind is int:
        accepts, text = (lambda v: isinstance(v, int) and not isinstance(v, bool)), "an int"
    elif kind is float:
        accepts, text = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)), "a number"
    elif kind is str and optional:
        accepts, text = (lambda v: isinstance(v, (str, os.PathLike))), "a string"
    elif kind is str:
        accepts, text = (lambda v: isinstance(v, str)), "a string"
    elif kind is dict:
        accepts, text = (lambda v: hasattr(v, "items") and not isinstance(v, str)), "a dict"
    elif kind is list:
        accepts, text = _is_list_of_str, "a list of strings"
    else:
        raise TypeError(f"LoggerConfig: no type rule for {annotation!r}")  # a new field's type: add its rule
    if optional:
        return (lambda v: v is None or accepts(v)), f"{text} or None"
    return accepts, text


def _is_list_of_str(value) -> bool:
    """A list or tuple of strings (or any sequence of them, such as OmegaConf's ListConfig; not a string)."""
    sequence = isinstance(value, collections.abc.Sequence) and not isinstance(value, (str, bytes))
    return sequence and all(isinstance(item, str) for item in value)


#: Per field: (accepts its type, what to write), from LoggerConfig's annotations: one place, one rule per type.
_TYPES = {name: _type_rule(spec.type) for name, spec in _OURS.items()}

#: Fields whose values are further limited (given a value of the right type).
_VALUES: dict[str, Callable[[Any], bool]] = {
    "tensorboard_log_interval": lambda v: v >= 1,
    "writer_buffer_steps": lambda v: v >= 1,
    "memory_reduce_scope": lambda v: v in ("pp", "world"),
    "memory_reduce_backend": lambda v: v in REDUCE_BACKENDS,
    "memory_peak_window": lambda v: v in PEAK_WINDOWS,
    "writer_mode": lambda v: v in WRITER_MODES,
    "memory_headroom_warn_fraction": lambda v: 0 <= v < 1,
    "memory_reduce_timeout_s": lambda v: v > 0,
    "writer_close_timeout_s": lambda v: v > 0,
    "memory_record_dir": lambda v: v is None or bool(os.fspath(v)),
}

_PATH = "a path string or None"
_SECONDS = "a positive number of seconds"
#: What to write, where the field's type alone does not say it.
_TAKES = {
    "tensorboard_log_interval": "an int >= 1 (memory is logged when iteration % interval == 0)",
    "writer_buffer_steps": "an int >= 1",
    "memory_reduce_scope": "'pp' or 'world'",
    "memory_reduce_backend": f"one of {', '.join(map(repr, REDUCE_BACKENDS))} (auto: gloo for the pp scope on "
    f"NCCL jobs; gloo; group: the group's own backend)",
    "memory_peak_window": f"one of {', '.join(map(repr, PEAK_WINDOWS))} (peak since the process started, or "
    f"since the previous logging step)",
    "writer_mode": f"one of {', '.join(map(repr, WRITER_MODES))}",
    "memory_headroom_warn_fraction": "a number in [0, 1)",
    "memory_reduce_timeout_s": _SECONDS,
    "writer_close_timeout_s": _SECONDS,
    "memory_record_dir": f"a folder path, {RECORD_OFF!r} (no recording) or None (beside the run's logs)",
    "memory_keys": "a dict of torch.cuda.memory_stats() names to logged names, or None",
    "memory_per_stage_keys": "a list of name patterns (strings)",
    "tensorboard_dir": _PATH,
    "wandb_save_dir": _PATH,
    "comet_offline_directory": _PATH,
}


def _refused(name: str, value) -> ValueError:
    """The one message for a setting that cannot work: the field, what to write, and what was given
    (a secret's value is not shown)."""
    takes = _TAKES.get(name) or _TYPES[name][1]
    kind = type(value).__name__
    given = f"a value of type {kind}" if SECRET_NAME.search(name) else f"{value!r} ({kind})"
    return ValueError(f"logger.{name} must be {takes}; got {given}")


def check_logger_fields(logger) -> None:
    """Raise ValueError naming the field, what to write and the value given, for a setting that
    cannot work: first each field's type (from LoggerConfig's annotations), then its value. Reads
    only nemo_memlog's fields of ``logger`` (any object with those names: Megatron-Bridge's
    LoggerConfig has fields of its own, of its own types, which are not ours to check)."""
    for name, (accepts, _) in _TYPES.items():
        value = setting(logger, name)
        if not accepts(value):
            raise _refused(name, value)
    for name, valid in _VALUES.items():
        value = setting(logger, name)
        if not valid(value):
            raise _refused(name, value)
    if setting(logger, "mlflow_experiment") and not setting(logger, "mlflow_run_name"):
        raise ValueError("logger.mlflow_experiment is set but logger.mlflow_run_name is not: set both")


EXPECTED_FORM = "expected logger.key=value, e.g. logger.log_memory_to_tensorboard=true"


# --------------------------------------------------------------------------------------------
# Settings: what the rest of the package reads, resolved once per run.


def _settings_methods():
    def record_dir(self) -> str | None:
        """The flight recorder's folder (absolute), or None when it is off: see
        LoggerConfig.memory_record_dir."""
        return memory_record_dir(self)

    def world_scope(self) -> bool:
        return self.memory_reduce_scope == "world"

    def interval_peaks(self) -> bool:
        return self.memory_peak_window == "interval"

    def to_plain(self) -> dict[str, Any]:
        """Every field as plain dicts, lists and scalars (for the writer process's wire
        format). Secrets are kept: this never goes into a record."""
        return {name: _plain(getattr(self, name)) for name in _OURS}

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in _OURS if _OURS[name].repr)
        return f"Settings({shown})"

    return {
        "record_dir": property(record_dir),
        "world_scope": property(world_scope),
        "interval_peaks": property(interval_peaks),
        "to_plain": to_plain,
        "__repr__": __repr__,
        "__doc__": """Every LoggerConfig field, resolved once from a config (``resolve``), then frozen.

    The one object the run, the reduction, the recorder and the writers read their settings
    from, as attributes named as LoggerConfig's fields (documented there), plus ``record_dir``,
    ``world_scope`` and ``interval_peaks``. Equal settings compare equal, whatever object
    they came from. Mappings and lists are copies: changing the config afterwards changes
    nothing here. ``comet_api_key`` is left out of its repr.""",
    }


if TYPE_CHECKING:  # type checkers see LoggerConfig's typed fields, read-only at run time

    class Settings(LoggerConfig):
        record_dir: str | None
        world_scope: bool
        interval_peaks: bool

        def to_plain(self) -> dict[str, Any]: ...
else:
    Settings = dataclasses.make_dataclass(
        "Settings",
        [(f.name, f.type, field(default=None, repr=f.repr)) for f in dataclasses.fields(LoggerConfig)],
        namespace=_settings_methods(),
        frozen=True,
        repr=False,
    )
    Settings.__module__ = __name__


def resolve(config) -> "Settings":
    """The Settings of ``config``: a LoggerConfig, any object with its field names (Megatron-Bridge's
    LoggerConfig: our defaults for the fields it lacks), a container whose ``.logger`` is one
    (Megatron-Bridge's ConfigContainer), a plain-dict form from ``Settings.to_plain()``, or a
    Settings (returned as is). Raises TypeError for anything else and ValueError for a setting
    that cannot work, naming the field and what to change."""
    if isinstance(config, Settings):
        return config
    logger = logger_section(config)
    check_logger_fields(logger)
    return Settings(**{name: _copied(setting(logger, name)) for name in _OURS})


def from_plain(fields: dict[str, Any]) -> "Settings":
    """The inverse of ``Settings.to_plain()`` (in the writer process)."""
    return Settings(**{name: _copied(fields.get(name, default_of(name))) for name in _OURS})


def _copied(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "items"):
        return {str(k): _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(_copied(v) for v in value)
    return value


def memory_record_dir(logger) -> str | None:
    """The flight recorder's folder for these settings (absolute), or None when it is off:
    memory logging off, or ``memory_record_dir="off"``. See LoggerConfig.memory_record_dir."""
    chosen = setting(logger, "memory_record_dir")
    if not setting(logger, "log_memory_to_tensorboard") or chosen == RECORD_OFF:
        return None
    if chosen is not None:
        return os.path.abspath(os.fspath(chosen))
    tensorboard_dir = setting(logger, "tensorboard_dir")
    if tensorboard_dir:
        return os.path.join(os.path.dirname(os.path.abspath(os.fspath(tensorboard_dir))), "memory_records")
    wandb_dir = setting(logger, "wandb_save_dir")
    return os.path.abspath(os.path.join(wandb_dir or ".", "memory_records"))


def checked_settings(owner: str, settings: dict, valid, hint: str = "") -> dict:
    """``settings`` (keyword arguments named as LoggerConfig's fields), unchanged, when every
    name is in ``valid`` and LoggerConfig accepts the values. Else ValueError: the unknown
    names with the valid ones listed (and ``hint``), or the bad field and what to change."""
    unknown = sorted(set(settings) - set(valid))
    if unknown:
        raise ValueError(f"{owner}: unknown setting(s) {unknown}; it takes {list(valid)}{hint}")
    LoggerConfig(**settings)
    return settings


def from_overrides(overrides: list[str], base: LoggerConfig | None = None) -> LoggerConfig:
    """Build a LoggerConfig from dotted overrides, as recipes take them on the command line:
    ``["logger.log_memory_to_tensorboard=true", "logger.tensorboard_log_interval=10"]``.
    The ``logger.`` prefix is optional; overrides for other sections (``train.iters=5``)
    are ignored. Raises ValueError for anything else (a flag, a path, ``key=value`` with an
    unknown key), showing the expected form, and for an unknown logger field, naming the
    closest one: a script's own arguments are not overrides, pass only those that are.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    ours = []
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" not in item or not key or key.startswith("-"):
            raise ValueError(
                f"from_overrides: {item!r} is not an override: {EXPECTED_FORM} "
                f"(pass only the overrides, not the script's own arguments)"
            )
        if key.startswith("logger."):
            key = key.removeprefix("logger.")
        elif "." in key:
            continue  # another section's override
        name = key.split(".", 1)[0]
        if name not in _OURS:
            raise ValueError(
                f"from_overrides: {item!r}: LoggerConfig has no field {name!r}"
                f"{did_you_mean(name, _OURS)}; {EXPECTED_FORM}.\nKnown logger fields: {', '.join(_OURS)}"
            )
        ours.append(item.removeprefix("logger."))
    schema = OmegaConf.structured(base or LoggerConfig())
    try:
        merged = OmegaConf.merge(schema, OmegaConf.from_dotlist(ours))
        return OmegaConf.to_object(merged)  # type: ignore[return-value]  # a LoggerConfig: the schema's class
    except OmegaConfBaseException as error:
        known = ", ".join(_OURS)
        raise ValueError(f"bad logger override in {overrides!r}: {error.msg}\nKnown logger fields: {known}") from None


def redacted(value: Any, name: str = "") -> Any:
    """A copy of a config value safe to record: secret-looking fields become REDACTED."""
    if name and SECRET_NAME.search(name) and value not in (None, ""):
        return REDACTED
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: redacted(getattr(value, f.name), f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): redacted(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redacted(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "__dict__"):
        return {k: redacted(v, k) for k, v in vars(value).items() if not k.startswith("_")}
    return str(value)


def _plain(value):
    """``value`` as plain dicts, lists and scalars (picklable where the config's classes are not)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or hasattr(value, "__iter__"):
        return [_plain(v) for v in value]
    return str(value)


def flat_params(config) -> dict[str, Any]:
    """The redacted config flattened to ``{"a.b": value}``, as hyperparameter stores want it."""
    out: dict[str, Any] = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = value

    walk("", redacted(config))
    return out


def recorded_params(run_config, logger) -> dict[str, Any]:
    """What the writers record for a run: ``flat_params(run_config)``, with the peak window
    this run uses (``logger``: run_config's logger section or its Settings) always present, also
    when the logger object lacks the field (Megatron-Bridge's LoggerConfig): the report command
    labels the ``peak_*`` values with it."""
    params = flat_params(run_config)
    # Named where run_config keeps its logger fields: itself (a logger config), else its .logger.
    # ``logger`` may be run_config's Settings rather than the same object.
    name = "memory_peak_window" if hasattr(run_config, "log_memory_to_tensorboard") else "logger.memory_peak_window"
    params[name] = setting(logger, "memory_peak_window")
    return params


def secrets_of(config) -> list[str]:
    """The secret values in a config (to scrub from anything a backend echoes)."""
    found: list[str] = []

    def walk(value, name=""):
        if name and SECRET_NAME.search(name) and isinstance(value, str) and value:
            found.append(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), f.name)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, str(k))

    walk(config)
    return found


def scrubbed(value, secrets: list[str]):
    """``value`` with every secret string in it replaced by REDACTED (non-strings unchanged)."""
    if isinstance(value, str):
        for secret in filter(None, secrets):
            value = value.replace(secret, REDACTED)
    return value

"""training_log: the per-iteration hook. The gate, the reduction, the merge, the hand-off.

Called on every rank at every iteration. The gate (``log_memory_to_tensorboard`` and
``iteration % tensorboard_log_interval``) depends only on the config and the iteration,
so every stage decides alike and enters the one collective together. Off the logging
iterations it does a few attribute reads and returns None: no collective, no
allocation, no backend call. The caller's ``metrics`` are logged only on logging
iterations, in the same dict, at the same step.
"""

from __future__ import annotations

import warnings

import torch.distributed as dist

from . import attribution, megatron, memory
from .config import LoggerConfig, check_logger_fields, logger_section, setting
from .payload import scalar
from .reduce import gather_memory, single_rank, takes_part

# Keyed by id(), holding the object too, so an id is never reused while cached.
_checked: dict[int, object] = {}
_fanouts: dict[int, tuple] = {}
_warned: set = set()


def training_log(iteration: int, config, *, pg_collection=None, pp_group=None, writers=None,
                 metrics: dict | None = None) -> dict | None:
    """Log pipeline-wide memory (and ``metrics``) every ``tensorboard_log_interval`` iterations.

    Returns the unified dict on every rank on logging iterations, None otherwise. Only
    the writer rank (global rank world_size - 1) hands it to ``writers`` (default: the
    fan-out built once from ``config``). See README for the keys.
    """
    logger = config if type(config) is LoggerConfig else logger_section(config)
    if not logger.log_memory_to_tensorboard:
        return None
    try:
        if iteration % logger.tensorboard_log_interval:
            return None
    except (ZeroDivisionError, TypeError):
        check_logger_fields(logger)  # raises the clear message
        raise
    return _log_step(iteration, config, logger, pg_collection, pp_group, writers, metrics)


def _log_step(iteration, config, logger, pg_collection, pp_group, writers, metrics) -> dict:
    if id(logger) not in _checked:
        check_logger_fields(logger)
        _checked[id(logger)] = logger
    report = memory.report_memory(setting(logger, "memory_keys"))
    if setting(logger, "memory_peak_window") == "interval":
        memory.reset_peaks()  # the next report's peak_* cover the next interval only
    report.update(memory.capacity_report())
    world = setting(logger, "memory_reduce_scope") == "world"
    group = _world_group() if world else megatron.pipeline_group(pp_group, pg_collection)
    stage_names = None
    if world:
        report.update(_coordinate_keys(pp_group, pg_collection))
    if takes_part(report, group):
        gathered = gather_memory(report, group, iteration=iteration,
                                 timeout_s=setting(logger, "memory_reduce_timeout_s"))
    else:
        gathered = single_rank(report)
    patterns = setting(logger, "memory_per_stage_keys")
    if world:
        logged = attribution.world_metrics(gathered, patterns)
    else:
        logged = attribution.memory_metrics(gathered, patterns, stage_names)
    unified = _merge(metrics, logged)
    if _is_writer_rank():
        fanout = writers if writers is not None else _fanout_for(config, logger)
        fanout.log(unified, iteration)
        _warn_low_headroom(unified, setting(logger, "memory_headroom_warn_fraction"))
    return unified


def _merge(metrics: dict | None, logged: dict) -> dict:
    """The caller's metrics (cleaned to plain numbers) plus ours, in one new dict."""
    if not metrics:
        return logged
    unified = {}
    for key, value in metrics.items():
        clean, kind, problem = scalar(value)
        if problem is not None:
            _warn_once(("metric", key, problem), f"metrics[{key!r}]: {problem}" + ("" if kind else "; it is not logged"))
        if kind is None and clean is None:
            continue  # not a number: warned above, nothing a scalar store could hold
        unified[key] = value if kind is None else clean  # NaN stays NaN: a NaN loss is news
    for key in logged.keys() & unified.keys():
        _warn_once(("clash", key), f"metrics[{key!r}] clashes with a memory metric; the memory value is logged")
    unified.update(logged)
    return unified


def _fanout_for(config, logger):
    cached = _fanouts.get(id(logger))
    if cached is not None:
        return cached[1]
    from .writers import build_writers

    fanout = build_writers(config)
    _fanouts[id(logger)] = (logger, fanout)
    if not fanout.sinks:
        _warn_once(("no-writer",), "log_memory_to_tensorboard is on but no writer is configured "
                   "(set tensorboard_dir, wandb_project, mlflow_experiment or comet_project); "
                   "training_log still returns the metrics")
    return fanout


def _is_writer_rank() -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank() == dist.get_world_size() - 1


def _world_group():
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _coordinate_keys(pp_group, pg_collection) -> dict:
    coords = megatron.coordinates(pp_group, pg_collection)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return {"rank": rank, "pp_rank": coords["pp"], "tp_rank": coords["tp"], "dp_rank": coords["dp"]}


def _warn_low_headroom(unified: dict, fraction: float) -> None:
    # Once per kind (device, host): a node's ranks share its RAM, so the stage with the
    # least can flip from step to step, and a warning per flip would be noise.
    for kind, stage, sentence in attribution.low_headroom(unified, fraction):
        _warn_once(("headroom", kind), sentence)


def _warn_once(key, text: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"nemo_memlog: {text}", RuntimeWarning, stacklevel=3)


def close_writers() -> None:
    """Drain and close the fan-outs training_log built (also done at exit and on SIGTERM)."""
    for _, fanout in list(_fanouts.values()):
        fanout.close()
    _fanouts.clear()

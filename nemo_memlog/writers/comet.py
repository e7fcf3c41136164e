"""Comet backend: one ``log_metrics(metrics, step=step)`` per logged step.

Enabled by ``comet_project``. Online (``comet_ml.Experiment``) when an API key is
available (``comet_api_key``, else ``COMET_API_KEY``) and ``comet_offline_directory`` is
unset; otherwise an ``OfflineExperiment`` whose ``end()`` writes a zip archive into
``comet_offline_directory`` (default: ``COMET_OFFLINE_DIRECTORY``, else ``./comet_offline``),
to upload later with ``comet upload``.

Ints stay ints and floats stay floats in Comet's messages (``7``, ``4.0``). comet_ml
itself turns NaN, +inf and -inf into the strings ``"NaN"``, ``"Infinity"`` and
``"-Infinity"`` (``comet_ml.convert_utils.fix_special_floats``), which is what is stored.

Nothing is captured beyond ``params`` and the metrics: Comet's argv parsing, environment,
git, code, console and framework auto-logging are all off, and importing comet_ml here
does not install its import hooks: they patch torch, TensorBoard and MLflow process-wide,
and a training script's own ``mlflow.start_run()`` would then open a second Comet
experiment with full environment capture, ``sys.argv`` included (seen with comet_ml 3.58).

Every stage of a metric in one chart: the per-stage metrics keep names that sort together
(``memory/pp_stage_{i}/<name>`` beside ``memory/<name>``), which a Comet line-chart panel
takes several of; and when an experiment this backend opened ends, it gets per metric logged
per stage a figure (Graphics tab; matplotlib, the ``report`` extra) with the max and every
stage (beyond 10 stages: the max, the median, the range and the 5 highest; charts.py), within
the close budget (the rest skipped and said), and the asset ``memory_per_stage.json`` with every
line as data (thinned to at most 2000 steps; see stages.py). An adopted experiment gets none:
its opener ends it, not us.
"""

from __future__ import annotations

import os
import sys
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..redaction import scrubbed
from .base import writable_folder
from .charts import log_figures
from .stages import StageHistory, artifact_name

#: The asset holding the per-stage charts as data, logged when the experiment ends.
CHARTS_ASSET = "memory_per_stage.json"
#: Seconds of the close budget kept to end the experiment after the charts (an offline one writes its archive).
FINISH_RESERVE_S = 5.0

if TYPE_CHECKING:
    from ..config import Settings

DEFAULT_OFFLINE_DIRECTORY = "./comet_offline"
_NO_HOOKS = "COMET_DISABLE_AUTO_LOGGING"
NO_CAPTURE = dict(
    parse_args=False,  # sys.argv may hold a secret override
    log_env_details=False,  # its message holds the command line (sys.argv), host and user
    log_env_host=False,
    log_env_gpu=False,
    log_env_cpu=False,
    log_env_network=False,
    log_env_disk=False,
    log_git_metadata=False,
    log_git_patch=False,
    log_code=False,
    log_graph=False,
    auto_output_logging=False,  # stdout: Megatron prints its arguments
    auto_param_logging=False,
    auto_metric_logging=False,
    auto_log_co2=False,
    display_summary_level=0,
)


def enabled(settings: Settings) -> bool:
    return bool(settings.comet_project)


def environment_secrets(environ: dict[str, str]) -> list[str]:
    """``COMET_API_KEY``, the key comet_ml reads where ``comet_api_key`` is not set: scrubbed from every
    notice of the run, whether or not Comet is enabled."""
    key = environ.get("COMET_API_KEY")
    return [key] if key else []


def open_backend(settings: Settings, params: dict, secrets: list[str]) -> CometBackend:
    """A Comet experiment named ``comet_experiment_name`` with ``comet_tags``, and
    ``params`` logged once (string values with ``secrets`` scrubbed)."""
    comet_ml = import_comet_ml()
    api_key = settings.comet_api_key or os.environ.get("COMET_API_KEY")
    where = dict(project_name=settings.comet_project, workspace=settings.comet_workspace)
    offline_directory = settings.comet_offline_directory
    if api_key and not offline_directory:
        experiment = comet_ml.Experiment(api_key=api_key, **where, **NO_CAPTURE)
    else:
        directory = offline_directory or os.environ.get("COMET_OFFLINE_DIRECTORY") or DEFAULT_OFFLINE_DIRECTORY
        writable_folder(directory, "comet_offline_directory")  # comet_ml creates the last level only
        experiment = comet_ml.OfflineExperiment(offline_directory=directory, **where, **NO_CAPTURE)
    if not experiment.alive:  # comet_ml reports a failed start in its log, without raising
        raise RuntimeError("the Comet experiment did not start (see the COMET messages above)")
    if settings.comet_experiment_name:
        experiment.set_name(settings.comet_experiment_name)
    if settings.comet_tags:
        experiment.add_tags(list(settings.comet_tags))
    experiment.log_parameters({key: scrubbed(value, secrets) for key, value in params.items()})
    return CometBackend(experiment, close_budget_s=settings.writer_close_timeout_s)


def import_comet_ml() -> ModuleType:
    """comet_ml, imported without its import hooks unless the program imported it itself."""
    if "comet_ml" in sys.modules:
        return sys.modules["comet_ml"]
    previous = os.environ.get(_NO_HOOKS)
    os.environ[_NO_HOOKS] = "1"  # comet_ml reads it at import; the program's environment is restored after
    try:
        import comet_ml
    finally:
        if previous is None:
            del os.environ[_NO_HOOKS]
        else:
            os.environ[_NO_HOOKS] = previous
    return comet_ml


def adopt(obj: object) -> CometBackend | None:
    """A comet_ml Experiment (online or offline) that someone else opened, else None."""
    if type(obj).__module__.startswith("comet_ml") and hasattr(obj, "log_metrics"):
        return CometBackend(obj, adopted=True)
    return None


class CometBackend:
    #: At close, no step is written within this long of the close budget's end: the run is only
    #: complete once ended, and ending it is what the time is kept for (fanout.BufferedBackend).
    end_reserve_s = FINISH_RESERVE_S

    def __init__(self, experiment: Any, adopted: bool = False, close_budget_s: float = 25.0):
        self.experiment = experiment
        self.close_budget_s = close_budget_s
        self.history = None if adopted else StageHistory()  # an adopted experiment gets no charts at its end

    def log(self, metrics: dict, step: int) -> None:
        """Every metric at ``step`` (Comet gets its own copy: ``metrics`` is never mutated)."""
        self.experiment.log_metrics(dict(metrics), step=step)
        if self.history is not None:
            self.history.add(metrics, step)

    def flush(self) -> None:
        self.experiment.flush()

    def log_charts(self, deadline: float) -> None:
        """The per-stage charts: their lines as the asset ``memory_per_stage.json``, then one
        figure per metric while the budget lasts (charts.py)."""
        if self.history is None or not self.history.charts:
            return
        self.experiment.log_asset_data(self.history.as_dict(), name=CHARTS_ASSET)

        def log_figure(tag: str, figure: Any) -> None:
            self.experiment.log_figure(figure_name=f"memory per stage: {artifact_name(tag)}", figure=figure)

        where = f"the asset {CHARTS_ASSET}"
        log_figures(self.history, log_figure, deadline - FINISH_RESERVE_S, who="comet backend", where=where)

    def close(self, deadline: float | None = None) -> None:
        """Charts while ``deadline`` (default: the close budget from now) allows, then the experiment's end."""
        try:
            self.log_charts(time.monotonic() + self.close_budget_s if deadline is None else deadline)
        finally:
            self.experiment.end()

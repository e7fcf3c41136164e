r"""Weights & Biases backend: one ``run.log(metrics, step=step)`` per logged step.

Enabled by ``wandb_project``. ``WANDB_MODE=offline`` (and W&B's other environment
variables) are honoured by wandb itself. History is JSON: ints are written as ints
(``7``), but so are integral floats (``4.0`` is written ``4``). NaN, +inf and -inf are
stored as they are (``NaN``, ``Infinity``, ``-Infinity``).

Each call commits its row at once (``commit=True``), so the latest step is on disk
without waiting for the next one. W&B steps must increase: a second call at the same
or an earlier step is dropped by W&B with a warning (the fan-out logs one dict per step).

Every stage of a metric in one chart: the per-stage keys already share a section
(``memory/``) and a regular expression (a line plot's Y axis, ``memory/(pp_stage_\d+/)?peak_reserved_gb$``,
overlays every stage and the max while the run is live); and when a run this backend opened
closes, one W&B custom chart per metric logged per stage (``wandb.plot.line_series``, its own
section ``memory per stage/<name>``) draws the max and every stage over the whole run (beyond
10 stages: the max, the median, the min and the 5 highest stages, the same lines as the other
backends' figures: charts.py), within the close budget (the rest skipped and said). A run
adopted from a framework gets no chart: it ends the run, not us.

The run records only ``params`` (redacted) and the metrics: W&B's capture of the
environment is switched off, because it would record ``sys.argv`` (where a secret
override such as ``logger.comet_api_key=...`` may sit), stdout (Megatron prints its
arguments), the code, git state and installed packages.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..redaction import scrubbed
from ..warn import notice
from .base import writable_folder
from .charts import FIRST_CHART_S, as_series, chart_lines, title
from .stages import PREFIX, StageHistory

#: The section of the custom charts drawn at close, one per metric logged per stage.
CHART_SECTION = "memory per stage/"
#: Seconds of the close budget kept for logging the charts and ending the run.
FINISH_RESERVE_S = 5.0

if TYPE_CHECKING:
    from ..config import Settings

RUN_SETTINGS = dict(
    # The metadata record holds sys.argv (verified: the secret reached the .wandb file
    # without these). Either one alone stops it; both, in case one changes meaning.
    x_disable_meta=True,
    x_disable_machine_info=True,
    x_disable_stats=True,  # system-metrics sampling: our own memory metrics are the point
    disable_git=True,
    disable_code=True,
    save_code=False,
    x_save_requirements=False,  # requirements.txt
    console="off",  # output.log: stdout may hold secrets
    disable_job_creation=True,
    reinit="create_new",  # several runs in one process (tests, a second run) stay independent
)


def enabled(settings: Settings) -> bool:
    return bool(settings.wandb_project)


def open_backend(settings: Settings, params: dict, secrets: list[str]) -> WandbBackend:
    """A W&B run in ``wandb_project`` with ``params`` as its config (``secrets`` scrubbed
    from its values again, in case one hid in a field not named like a secret)."""
    import wandb

    if settings.wandb_save_dir:
        writable_folder(settings.wandb_save_dir, "wandb_save_dir")
    run = wandb.init(
        project=settings.wandb_project,
        name=settings.wandb_exp_name,
        entity=settings.wandb_entity,
        dir=settings.wandb_save_dir,  # None: wandb's default (./wandb); created if missing
        config={key: scrubbed(value, secrets) for key, value in params.items()},
        settings=wandb.Settings(**RUN_SETTINGS),
    )
    return WandbBackend(run, close_budget_s=settings.writer_close_timeout_s)


def adopt(obj: object) -> WandbBackend | None:
    """The ``wandb`` module after ``wandb.init()``, or a W&B Run, that someone else opened;
    else None. Rows are merged into the opener's row for the step, not committed: a
    commit would make W&B drop every later metric the opener logs at that step."""
    if (getattr(obj, "__name__", None) == "wandb" or type(obj).__module__.startswith("wandb")) and hasattr(obj, "log"):
        return WandbBackend(obj, commit=False)
    return None


class WandbBackend:
    #: At close, no step is written within this long of the close budget's end: the run is only
    #: complete once ended, and ending it is what the time is kept for (fanout.BufferedBackend).
    end_reserve_s = FINISH_RESERVE_S

    def __init__(self, run: Any, commit: bool = True, close_budget_s: float = 25.0):
        self.run = run
        self.close_budget_s = close_budget_s
        self.commit = commit
        self.history = StageHistory() if commit else None  # an adopted run gets no chart at close

    def log(self, metrics: dict, step: int) -> None:
        """Log ``metrics`` as the row of ``step`` (W&B gets its own copy: ``metrics`` is never mutated)."""
        self.run.log(dict(metrics), step=step, commit=self.commit)
        if self.history is not None:
            self.history.add(metrics, step)

    def flush(self) -> None:
        pass  # wandb streams each log call to its service process; there is nothing to push

    def charts(self, deadline: float | None = None) -> dict:
        """``{"memory per stage/<name>": custom chart}``: per metric logged per stage, the lines
        charts.chart_lines picks (the max and every stage; at many stages the max, the median, the
        min and the highest stages), while the next can be built before ``deadline``; the rest
        skipped and said."""
        import wandb

        charts: dict = {}
        tags = sorted(self.history.charts if self.history is not None else ())
        for done, tag in enumerate(tags):
            if deadline is not None and time.monotonic() + FIRST_CHART_S > deadline:
                notice(
                    f"nemo_memlog: wandb backend: {len(tags) - done} of the {len(tags)} per-stage charts were not "
                    f"drawn: the close budget (logger.writer_close_timeout_s) would have run out"
                )
                break
            picked = chart_lines(self.history, tag)
            lines = as_series(picked)
            if lines:
                charts[CHART_SECTION + tag.removeprefix(PREFIX)] = wandb.plot.line_series(
                    xs=[steps for steps, _ in lines.values()],
                    ys=[values for _, values in lines.values()],
                    keys=list(lines),
                    title=title(tag, picked),
                    xname="step",
                )
        return charts

    def close(self, deadline: float | None = None) -> None:
        """Charts while ``deadline`` (default: the close budget from now) allows, then the run's finish."""
        if deadline is None:
            deadline = time.monotonic() + self.close_budget_s
        try:
            charts = self.charts(deadline - FINISH_RESERVE_S)
            if charts:
                self.run.log(charts)  # after the last step: a row of its own
        finally:
            self.run.finish()

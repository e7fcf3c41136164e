"""MemoryLogCallback in a real Lightning Trainer: strategy="ddp" on CPU (gloo), 2 and 4 ranks.

One job per world size (tests/lightning_job.py, started as a user starts a training
script; Lightning's launcher starts the other ranks), running several fits in the same
processes. Every rank holds a ballast of a known size, the largest on PEAK_RANK (neither
rank 0, where Lightning's loggers write, nor the last rank, where the core writes by
default). 8 optimizer steps, log_every_n_steps=2: Lightning logs train_loss at steps 1, 3,
5, 7 (``_batches_that_stepped``), and memory must land at exactly those steps.

- world 2: "main" (TensorBoard, CSV, MLflow on SQLite, W&B offline, Comet offline),
  "off" (the same loggers, log_memory_to_tensorboard=False: the baseline for Lightning's
  own series, and zero collectives), "pl" (the pytorch_lightning package's Trainer, its
  own interval of 3).
- world 4: "main" as above, then "pp": megatron-core's parallel_state with PP 2 built in
  the same processes (standing in for NeMo 2's MegatronStrategy), groups {0,2} and {1,3}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.collectives import GATHER
from tests.lightning_readback import BACKENDS, runs, series

LOGGING_STEPS = [1, 3, 5, 7]
PEAK_RANK = {2: 1, 4: 2}
BALLAST_MB = {2: [40, 700], 4: [40, 80, 700, 120]}
ALL_LOGGERS = list(BACKENDS)
FITS = {
    2: [{"name": "main", "loggers": ALL_LOGGERS},
        {"name": "off", "loggers": ALL_LOGGERS, "callback": {"log_memory_to_tensorboard": False}},
        {"name": "pl", "package": "pytorch_lightning", "loggers": ["csv"], "callback": {"tensorboard_log_interval": 3}}],
    4: [{"name": "main", "loggers": ALL_LOGGERS},
        {"name": "pp", "loggers": ["tensorboard", "csv"], "pp": 2}],
}
JOB_TIMEOUT_S = 900  # a loaded 2-core machine: 4 processes importing torch, Lightning and 3 backends' clients
REPO = Path(__file__).resolve().parent.parent


class Fit:
    """One fit's output directory and every rank's probe events."""

    def __init__(self, root: Path, world: int):
        self.root, self.world = root, world
        self.ranks = [json.loads((root / "records" / f"rank{r}.json").read_text())["events"] for r in range(world)]

    def batch_ends(self, rank: int) -> list[dict]:
        return [e for e in self.ranks[rank] if e["hook"] == "on_train_batch_end"]

    def at(self, rank: int, step: int) -> dict:
        """The batch end logged at ``step`` (the optimizer-stepping batch: one per step here)."""
        (event,) = [e for e in self.batch_ends(rank) if e["step"] == step]
        return event

    def within_peak(self, rank: int, step: int, value: float, slack: float = 0.0) -> bool:
        """``value`` is the host peak ``rank`` had while MemoryLogCallback ran at ``step``."""
        event = self.at(rank, step)
        return event["peak_before"] - slack <= value <= event["peak_after"] + slack


def _run_job(world: int, out: Path) -> dict[str, Fit]:
    spec = {"world": world, "out": str(out), "ballast_mb": BALLAST_MB[world], "fits": FITS[world]}
    spec_path = out / "spec.json"
    out.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "WANDB_MODE": "offline", "COMET_START_ONLINE": "false", "OMP_NUM_THREADS": "1",
           "WANDB_DIR": str(out), "WANDB_CACHE_DIR": str(out / "wandb_cache"),
           "WANDB_CONFIG_DIR": str(out / "wandb_config"), "MLFLOW_TRACKING_URI": f"sqlite:///{out}/unused.db"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tests.lightning_job", str(spec_path)], cwd=out, env=env,
                          capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, f"world {world} job failed:\n{done.stdout[-5000:]}\n{done.stderr[-10000:]}"
    print(f"\nLightning ddp job, world {world}, {len(FITS[world])} fits: {time.monotonic() - start:.1f} s")
    return {fit["name"]: Fit(out / fit["name"], world) for fit in FITS[world]}


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def job(request, tmp_path_factory):
    return _run_job(request.param, tmp_path_factory.mktemp(f"lightning_world{request.param}"))


def memory_names(stored) -> list[str]:
    return sorted(name for name in stored if name.startswith("memory/"))


def own_series(stored) -> dict:
    return {name: values for name, values in stored.items() if not name.startswith("memory/")}


def as_stored(backend: str, value: float) -> float:
    """``value`` as ``backend`` stores it: TensorBoard keeps float32."""
    return float(np.float32(value)) if backend == "tensorboard" else value


# --- every backend: steps, attribution, one run, Lightning's series -------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_at_lightnings_own_steps_in_one_run(job, backend):
    fit = job["main"]
    stored = series(backend, fit.root)
    assert runs(backend, fit.root) == 1, f"{backend}: one run, the Trainer's; the callback opens none"
    names = memory_names(stored)
    assert "memory/peak_host_rss_gb" in names and "memory/peak_rank/peak_host_rss_gb" in names, names
    assert [s for s, _ in stored["train_loss"]] == LOGGING_STEPS, "Lightning's own logging steps"
    for name in names:
        assert [s for s, _ in stored[name]] == LOGGING_STEPS, f"{backend} {name}: once at each of Lightning's steps"


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_max_is_the_ballast_ranks_own_peak_and_its_rank_is_logged_beside_it(job, backend):
    fit = job["main"]
    peak_rank = PEAK_RANK[fit.world]
    stored = series(backend, fit.root)
    for step, value in stored["memory/peak_host_rss_gb"]:
        event = fit.at(peak_rank, step)
        low, high = as_stored(backend, event["peak_before"]), as_stored(backend, event["peak_after"])
        assert low <= value <= high, (backend, step, value, event)
        others = [fit.at(r, step)["peak_after"] for r in range(fit.world) if r != peak_rank]
        assert value > max(others) + 0.3, "the ballast rank stands clear of every other rank"
    assert [v for _, v in stored["memory/peak_rank/peak_host_rss_gb"]] == [peak_rank] * len(LOGGING_STEPS)
    assert [v for _, v in stored["memory/peak_stage/peak_host_rss_gb"]] == [0] * len(LOGGING_STEPS), \
        "no pipeline: every rank is stage 0"


@pytest.mark.parametrize("backend", BACKENDS)
def test_lightnings_own_series_unchanged(job, backend):
    fit = job["main"]
    stored = own_series(series(backend, fit.root))
    losses = [as_stored(backend, fit.at(0, step)["loss"]) for step in LOGGING_STEPS]
    assert [s for s, _ in stored["train_loss"]] == LOGGING_STEPS
    assert [v for _, v in stored["train_loss"]] == pytest.approx(losses, rel=1e-12), "rank 0's loss"
    if "off" in job:  # the same job with memory logging off: every series of Lightning's, equal
        baseline = own_series(series(backend, job["off"].root))
        if backend == "comet":  # a run's wall-clock duration, logged by Comet at the end
            stored.pop("process duration", None), baseline.pop("process duration", None)
        assert stored == baseline


# --- the contract with the loop: collectives ------------------------------------------------------


def test_one_gather_per_logging_step_on_every_rank_and_none_elsewhere(job):
    fit = job["main"]
    for rank in range(fit.world):
        events = fit.ranks[rank]
        assert [e["hook"] for e in events] == ["on_train_start"] + ["on_train_batch_end"] * 8 + ["on_train_end"]
        assert events[0]["collectives"] == [] and events[-1]["collectives"] == []
        for event in fit.batch_ends(rank):
            expected = [GATHER] if event["step"] in LOGGING_STEPS else []
            if event["step"] == LOGGING_STEPS[0]:  # + the key-set handshake, once per group and process
                assert event["collectives"] in ([GATHER, GATHER], [GATHER]), (rank, event)
            else:
                assert event["collectives"] == expected, (rank, event)
            assert event["step"] == event["global_step"] - 1, "_batches_that_stepped is global_step - 1 here"


def test_flag_off_zero_collectives_and_no_memory_anywhere(job):
    if "off" not in job:
        pytest.skip("the flag-off fit runs in the world-2 job")
    fit = job["off"]
    for rank in range(fit.world):
        assert len(fit.ranks[rank]) == 10, "every hook the callback handles fired (and was counted)"
        assert all(e["collectives"] == [] for e in fit.ranks[rank]), (rank, fit.ranks[rank])
    for backend in BACKENDS:
        assert memory_names(series(backend, fit.root)) == [], backend


# --- pytorch_lightning, and the pipeline path ------------------------------------------------------


def test_pytorch_lightning_trainer_with_its_own_interval(job):
    if "pl" not in job:
        pytest.skip("the pytorch_lightning fit runs in the world-2 job")
    fit = job["pl"]
    stored = series("csv", fit.root)
    own_steps = [2, 5]  # tensorboard_log_interval=3: (step + 1) % 3 == 0, as log_every_n_steps counts
    assert [s for s, _ in stored["train_loss"]] == LOGGING_STEPS, "Lightning's own interval is untouched"
    for name in memory_names(stored):
        assert [s for s, _ in stored[name]] == own_steps, name
    for step, value in stored["memory/peak_host_rss_gb"]:
        assert fit.within_peak(PEAK_RANK[2], step, value)
    for rank in range(2):
        gathers = [e["step"] for e in fit.batch_ends(rank) if e["collectives"]]
        assert gathers == own_steps, rank


def test_pipeline_group_when_megatron_parallel_state_is_initialised(job):
    if "pp" not in job:
        pytest.skip("the PP fit runs in the world-4 job")
    fit = job["pp"]  # PP 2 over 4 ranks: rank 0's pipeline is ranks 0 (stage 0) and 2 (stage 1)
    for backend in ("tensorboard", "csv"):
        stored = series(backend, fit.root)
        assert runs(backend, fit.root) == 1
        assert "memory/pp_stage_2/peak_host_rss_gb" not in stored, "two stages"
        assert not any(name.startswith("memory/peak_rank/") for name in stored), "the pp scope, not world"
        for step, value in stored["memory/peak_host_rss_gb"]:
            assert step in LOGGING_STEPS
            stage0 = dict(stored["memory/pp_stage_0/peak_host_rss_gb"])[step]
            stage1 = dict(stored["memory/pp_stage_1/peak_host_rss_gb"])[step]
            assert as_stored(backend, fit.at(0, step)["peak_before"]) <= stage0 <= \
                as_stored(backend, fit.at(0, step)["peak_after"])
            assert as_stored(backend, fit.at(2, step)["peak_before"]) <= stage1 <= \
                as_stored(backend, fit.at(2, step)["peak_after"])
            assert value == stage1 and stage1 > stage0 + 0.3, "the max is stage 1's (rank 2's ballast)"
            assert dict(stored["memory/peak_stage/peak_host_rss_gb"])[step] == 1
        assert [s for s, _ in stored["memory/peak_host_rss_gb"]] == LOGGING_STEPS
    for rank in range(4):  # every rank gathers over its own pipeline, at the same steps
        gathers = [e["step"] for e in fit.batch_ends(rank) if e["collectives"]]
        assert gathers == LOGGING_STEPS, rank

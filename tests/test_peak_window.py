"""memory_peak_window on real gloo pipeline stages: one stage holds a ballast during one
logging interval only. With "interval" its logged host peak falls back in the next one;
with "run" it stays. Written by the real TensorBoard writer and read back by the report.

(Host memory only: this machine has no GPU, so the CUDA reset is not exercised here.)
"""

import warnings

import pytest

from nemo_memlog import LoggerConfig, close_writers, training_log
from nemo_memlog.offline.report import format_report, load_run

pytestmark = pytest.mark.processes

BALLAST_MB = 200
BALLAST_STAGE = 1
PEAK = "peak_host_rss_gb"
ITERATIONS = (1, 2, 3)  # 1: the baseline; the ballast comes and goes in the interval ending at 2; 3: after it


def log_with_ballast_in_one_interval(window, tensorboard_dir):
    """Every rank: three logging steps; the ballast stage touches and frees BALLAST_MB between 1 and 2."""
    import numpy
    from megatron.core import parallel_state as ps

    from nemo_memlog.rank import memory

    memory.reset_host_peak()  # start from this rank's current RSS, whatever earlier tests left in VmHWM
    cfg = LoggerConfig(log_memory_to_tensorboard=True, memory_peak_window=window, tensorboard_dir=tensorboard_dir)
    logged = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for iteration in ITERATIONS:
            if iteration == 2 and ps.get_pipeline_model_parallel_rank() == BALLAST_STAGE:
                ballast = numpy.full(BALLAST_MB * 2**20, 1, dtype=numpy.uint8)  # every page written: resident
                del ballast
            logged.append(training_log(iteration, cfg))
        close_writers()  # the writer rank's events are complete before the test reads them
    return logged


@pytest.mark.parametrize("window", ["run", "interval"])
def test_the_host_peak_of_the_next_interval_falls_back_only_with_interval(pp4, tmp_path, window):
    results = pp4.run_ok(log_with_ballast_in_one_interval, window, str(tmp_path / "tb"))
    assert all(steps == results[0] for steps in results), "every rank returns the same dicts"
    before, during, after = results[0]
    stage = {
        name: [d[f"memory/pp_stage_{s}/{PEAK}"] for s in range(4)]
        for name, d in (("before", before), ("during", during), ("after", after))
    }
    print(window, {name: [round(v, 3) for v in values] for name, values in stage.items()})
    ballast_gb = BALLAST_MB * 2**20 / 1e9
    assert stage["during"][BALLAST_STAGE] - stage["before"][BALLAST_STAGE] > 0.8 * ballast_gb
    assert during[f"memory/peak_stage/{PEAK}"] == BALLAST_STAGE
    for logged, values in ((during, stage["during"]), (after, stage["after"])):
        assert logged[f"memory/{PEAK}"] == max(values)
        assert logged[f"memory/peak_stage/{PEAK}"] == values.index(max(values))
    if window == "interval":
        assert stage["during"][BALLAST_STAGE] - stage["after"][BALLAST_STAGE] > 0.8 * ballast_gb
        assert after["memory/peak_host_rss_pct"] < during["memory/peak_host_rss_pct"], "the % follows the peak"
    else:
        assert stage["after"][BALLAST_STAGE] >= stage["during"][BALLAST_STAGE], "a run's peak never falls"
    assert not any(key.startswith("memory/device_") for key in after), "no CUDA in use: no device keys"

    run = load_run(tmp_path / "tb")  # what the dashboards got, and what the report says about it
    assert run.peak_window == window and f"peak window: {window}" in format_report(run)
    written = run.per_stage(PEAK)[BALLAST_STAGE]
    assert written.values == pytest.approx([v[BALLAST_STAGE] for v in stage.values()], rel=1e-6)
    assert written.steps == ITERATIONS

"""``nemo-memlog advise``: each prediction held against a rerun with the change, per stage and per
part, on real gloo ranks (PP 2 x DP 2, megatron-core's parallel_state): micro-batch size, microbatches,
layers per stage, and the distributed optimizer against torch's ZeroRedundancyOptimizer. Then the
refusals, the JSON contract and the picture."""

import dataclasses
import json
import warnings

import pytest
import torch

from nemo_memlog import advice
from nemo_memlog.cli import main
from nemo_memlog.offline.advise import load
from nemo_memlog.testing.notices import said
from tests.models import WIDTH, blocks

#: The base run: 8 samples a microbatch, 4 microbatches, 2 blocks a stage, Adam.
BASE = {"mbs": 8, "microbatches": 4, "layers": (2, 2), "zero": False}
TOLERANCE = 0.10  # the bar for CPU, per stage and per part


def advise_job(folder: str, mbs: int, microbatches: int, layers: tuple, zero: bool) -> int:
    """Stage s: ``layers[s]`` blocks, holding min(PP - s, microbatches) microbatches of ``mbs`` samples
    at once (1F1B); logs at iteration 2, stating its micro-batch size and microbatches."""
    from megatron.core import parallel_state as ps

    from nemo_memlog import LoggerConfig, close_writers, training_log

    stage, stages = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    model = blocks(layers[stage], seed=stage)
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.Adam, process_group=ps.get_data_parallel_group()
        )
    else:
        optimizer = torch.optim.Adam(model.parameters())
    cfg = LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=2, memory_record_dir=folder)
    held = min(stages - stage, microbatches)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no writer configured: the records are what is read
        for iteration in (1, 2):
            pending = []
            for index in range(microbatches):
                x = torch.randn(mbs, WIDTH, generator=torch.Generator().manual_seed(index))
                pending.append(model(x).square().mean())
                if len(pending) == held:
                    pending.pop(0).backward()
            for loss in pending:
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            facts = {"micro_batch_size": mbs, "microbatches": microbatches}
            training_log(iteration, cfg, model=model, optimizer=optimizer, facts=facts)
        close_writers()
    return stage


@pytest.fixture(scope="module")
def runs(pp2dp2, tmp_path_factory):
    """The base run and one rerun per change, each into its own record folder."""
    reruns = {
        "base": BASE,
        "micro_batch_size=16": {**BASE, "mbs": 16, "microbatches": 2},  # the global batch fixed
        "microbatches=1": {**BASE, "microbatches": 1},
        "layers_per_stage=3,1": {**BASE, "layers": (3, 1)},
        "distributed_optimizer=true": {**BASE, "zero": True},
    }
    folders = {}
    for name, spec in reruns.items():
        folder = tmp_path_factory.mktemp("advise") / name.replace("=", "-").replace(",", "_")
        pp2dp2.run_ok(advise_job, str(folder), spec["mbs"], spec["microbatches"], spec["layers"], spec["zero"])
        folders[name] = folder
    return folders


def advise_json(folder, *changes, capacity=None) -> tuple[int, dict | None]:
    import contextlib
    import io

    argv = ["advise", str(folder), "--json", "--no-png", *[a for c in changes for a in ("--what-if", c)]]
    if capacity is not None:
        argv += ["--capacity-gb", str(capacity)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, json.loads(out.getvalue()) if code == 0 else None


@pytest.mark.processes
@pytest.mark.parametrize(
    "change", ["micro_batch_size=16", "microbatches=1", "layers_per_stage=3,1", "distributed_optimizer=true"]
)
def test_the_prediction_against_a_rerun_with_the_change(runs, change):
    code, predicted = advise_json(runs["base"], change)
    assert code == 0
    rerun = {stage.stage: stage for stage in load(runs[change]).stages}
    errors = []
    for row in predicted["stages"]:
        measured = advice.with_model_state(rerun[row["stage"]].parts)
        for part in ("activations_gb", "model_state_gb", "params_gb", "grads_gb", "optimizer_state_gb"):
            want, got = measured[part], row["predicted"][part]
            errors.append((row["stage"], part, got, want))
            assert got == pytest.approx(want, rel=TOLERANCE), (change, row["stage"], part, got, want)
        assert row["in_flight"] == rerun[row["stage"]].in_flight
    print(change, [(s, p, f"{(g - w) / w:+.1%}") for s, p, g, w in errors if w])


@pytest.mark.processes
def test_the_json_contract_and_the_largest_micro_batch_size_that_fits(runs):
    code, today = advise_json(runs["base"], capacity=10.0)
    assert code == 0 and [row["stage"] for row in today["stages"]] == [0, 1]
    for row in today["stages"]:
        assert set(row) >= {"stage", "now", "predicted", "peak_gb", "capacity_gb", "fits"}
        assert set(row["now"]) >= {"model_state_gb", "params_gb", "grads_gb", "optimizer_state_gb", "activations_gb"}
        assert row["now"] == row["predicted"] and row["fits"] is True and row["capacity_gb"] == 10.0
    assert today["max_micro_batch_size"] == 32  # every size dividing the 32 samples fits in 10 GB
    # a capacity every stage fits today, with half its activations to spare at the most: double the
    # micro-batch (or quadruple it, on one microbatch) and the stage with the least to spare fails
    tight = max(row["peak_now_gb"] + 0.5 * row["now"]["activations_gb"] for row in today["stages"])
    _, squeezed = advise_json(runs["base"], capacity=tight)
    assert squeezed["max_micro_batch_size"] == 8  # every divisor of 32 below 16 fits; 8 is today's
    _, doubled = advise_json(runs["base"], "micro_batch_size=x2", capacity=tight)
    assert doubled["fits"] is False and [row["fits"] for row in doubled["stages"]].count(False) >= 1


@pytest.mark.processes
def test_refusals_say_what_is_missing(runs, pp4, tmp_path, capsys):
    assert main(["advise", str(runs["base"]), "--what-if", "recompute=selective"]) == 2
    assert "Megatron-Bridge 0.6+" in capsys.readouterr().err
    assert main(["advise", str(runs["distributed_optimizer=true"]), "--what-if", "distributed_optimizer=true"]) == 2
    assert "already sharded" in capsys.readouterr().err
    assert main(["advise", str(runs["base"]), "--what-if", "layers_per_stage=3,2"]) == 2
    assert "add up to 5, the run has 4" in capsys.readouterr().err
    assert main(["advise", str(runs["base"]), "--what-if", "micro_batch_size=3"]) == 2
    assert "not a whole number" in capsys.readouterr().err
    assert main(["advise", str(runs["base"]), "--what-if", "expandable_segments=true"]) == 2
    assert "CPU" in capsys.readouterr().err
    assert main(["advise", str(runs["base"]), "--what-if", "batch=2"]) == 2
    assert "micro_batch_size=N" in capsys.readouterr().err
    assert main(["advise", str(tmp_path)]) == 2
    assert "no per-layer records" in capsys.readouterr().err
    pp4.run_ok(flat_job, str(tmp_path / "flat"))  # DP 1, and a model with no repeated layers
    assert main(["advise", str(tmp_path / "flat"), "--what-if", "distributed_optimizer=true"]) == 2
    assert "data-parallel size is 1" in capsys.readouterr().err
    assert main(["advise", str(tmp_path / "flat"), "--what-if", "recompute=full"]) == 2
    assert "no per-layer figures" in capsys.readouterr().err


def flat_job(folder: str) -> None:
    from nemo_memlog import LoggerConfig, close_writers, training_log

    model = torch.nn.Linear(WIDTH, WIDTH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=2, memory_record_dir=folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for iteration in (1, 2):
            model(torch.randn(4, WIDTH)).sum().backward()
            optimizer.step()
            training_log(iteration, cfg, model=model, optimizer=optimizer)
        close_writers()


@pytest.mark.processes
def test_full_recompute_keeps_each_layers_input(runs):
    code, predicted = advise_json(runs["base"], "recompute=full")
    assert code == 0
    for row in predicted["stages"]:
        held = row["in_flight_now"]
        assert row["predicted"]["activations_gb"] * 1e9 == pytest.approx(held * 2 * 8 * WIDTH * 4, rel=0.01)


@pytest.mark.processes
def test_the_picture_and_the_text(runs, capsys):
    assert main(["advise", str(runs["base"]), "--what-if", "micro_batch_size=x2", "--capacity-gb", "10"]) == 0
    text = capsys.readouterr().out
    assert "largest micro-batch size that fits on every stage: 32" in text
    assert "microbatches in flight" in text and "2 -> 2" in text and "activations scale" in text
    png = runs["base"] / "memory_advise.png"
    assert png.stat().st_size > 10_000


@pytest.mark.processes
def test_the_oom_post_mortem_names_the_changes_that_would_have_fit(runs, tmp_path):
    """A CUDA OOM on rank 0 (simulated records, written by the real recorder) beside a real run's
    per-layer record (DP 2, micro-batch 8, 4 microbatches): the post-mortem names what would have fit."""
    import shutil

    from nemo_memlog.testing.flight_sim import T0, closed_after, layout, write_run
    from tests.readback import postmortem

    ranks = closed_after(layout(pp=2, tp=1, dp=2), 30.0)
    ranks[0].stopped, ranks[0].end = T0, "exception"
    ranks[0].oom = {
        "device": 0,
        "bytes_requested": int(2e9),
        "device_limit": int(80e9),
        "device_free": int(0.4e9),
        "largest_free_block": int(0.4e9),
        "reserved_free": int(0.1e9),
    }
    parts = {"params_gb": 6.0, "grads_gb": 6.0, "optimizer_state_gb": 24.0, "activations_gb": 40.0}
    ranks[0].composition = {**parts, "model_state_gb": 36.0, "temporaries_gb": 1.0, "allocator_slack_gb": 1.5}
    ranks[0].composition["microbatches_in_flight"] = 2  # 1F1B, PP 2: stage 0 holds min(2, microbatches)
    write_run(tmp_path, ranks)
    shutil.copy(runs["base"] / "rank-00000.layers.json", tmp_path / "rank-00000.layers.json")
    code, result = postmortem(tmp_path)
    assert code == 1 and result["first_failure"]["rank"] == 0
    # today: 36 + 40 + 1 + 2.0 asked + 1.5 slack + 1.1 outside = 81.6 GB > 80
    # distributed optimizer over DP 2: 24 -> 12, peak 69.6; half the micro-batch: 2 in flight still
    # (PP 2, 8 microbatches: stage 0 holds min(2, 8)), 40 -> 20, and the temporaries with the request
    # it could not serve, 1 + 2 -> 1.5: 60.1
    assert "predicted to fit (nemo-memlog advise): " in result["sentence"], result["sentence"]
    assert "distributed_optimizer=true (peak 70 GB)" in result["sentence"], result["sentence"]
    assert "micro_batch_size=x0.5 (peak 60 GB)" in result["sentence"], result["sentence"]
    assert "expandable_segments=true" not in result["sentence"]  # 81.6 - 1.5 = 80.1: still over


@pytest.mark.processes
def test_the_low_headroom_sentence_names_the_smallest_change_that_restores_it(runs):
    """On a real run's records: a capacity whose free share is just under the warning's, and which
    the distributed optimizer alone restores (the first on the list that does, checked by predicting)."""
    run = load(runs["base"])
    saved = min(stage.parts["optimizer_state_gb"] / run.dp_size for stage in run.stages)
    worst = max(advice.peak(stage.parts) for stage in run.stages)
    capacity = worst + 0.5 * saved
    fraction = 0.9 * saved / capacity  # today 0.5 * saved free < fraction * capacity; after: 1.5 * saved
    tight = advice.Profile(**{**run.__dict__, "capacity_gb": capacity})
    sentence = advice.fix_sentence(tight, fraction)
    assert "The smallest listed change that restores it: distributed_optimizer=true" in sentence, sentence
    outcomes = advice.predict(tight, advice.parse(["distributed_optimizer=true"]))
    assert all(outcome.headroom_gb >= fraction * capacity for outcome in outcomes)
    assert "No change" in advice.fix_sentence(advice.Profile(**{**run.__dict__, "capacity_gb": 0.5 * worst}), 0.1)


def warn_job(folder: str, per_stage_keys: list[str] | None = None) -> list[str]:
    """A real run whose warning fraction makes the host warning fire: its advice sentence follows.
    ``per_stage_keys``: the run's memory_per_stage_keys (default: the settings' default)."""
    from nemo_memlog import LoggerConfig, close_writers, training_log

    model = blocks(2)
    optimizer = torch.optim.Adam(model.parameters())
    cfg = LoggerConfig(
        log_memory_to_tensorboard=True,
        tensorboard_log_interval=2,
        tensorboard_dir=f"{folder}/tb",
        memory_record_dir=folder,
        memory_headroom_warn_fraction=0.999,
    )
    if per_stage_keys is not None:
        cfg.memory_per_stage_keys = per_stage_keys
    with said(warned=False) as caught:
        for iteration in (1, 2):
            model(torch.randn(8, WIDTH)).square().mean().backward()
            optimizer.step()
            training_log(iteration, cfg, model=model, optimizer=optimizer, facts={"micro_batch_size": 8})
        close_writers()
    return [w for w in caught]


@pytest.mark.processes
def test_a_real_runs_warning_carries_the_advice_and_the_dashboard_its_largest_micro_batch(pp2dp2, tmp_path):
    from nemo_memlog.offline.events import load_run

    seen = pp2dp2.run_ok(warn_job, str(tmp_path))
    writer = seen[-1]
    headroom = [w for w in writer if "headroom" in w or "free" in w]
    assert any("No change nemo-memlog advise predicts alone" in w for w in headroom), writer
    stored = load_run(tmp_path / "tb").get("advice/max_micro_batch_size")
    code, offline = advise_json(tmp_path)
    assert code == 0 and stored is not None and stored.latest == offline["max_micro_batch_size"] >= 8


@pytest.mark.processes
def test_the_live_advice_reads_the_gathered_values_whatever_is_logged_per_stage(pp2dp2, tmp_path):
    """A run that logs only the peaks per stage still gets the advice scalar and the warning's advice:
    the advice reads each stage's parts from the gathered values, not from the logged key names."""
    from nemo_memlog.offline.events import load_run

    seen = pp2dp2.run_ok(warn_job, str(tmp_path), ["peak_*"])
    run = load_run(tmp_path / "tb")
    assert run.get("pp_stage_0/peak_host_rss_gb") is not None  # what it logs per stage
    assert run.get("pp_stage_0/activations_gb") is None and run.get("pp_stage_0/params_gb") is None
    assert any("No change nemo-memlog advise predicts alone" in w for w in seen[-1]), seen[-1]
    stored = run.get("advice/max_micro_batch_size")
    code, offline = advise_json(tmp_path)  # the per-layer records: every stage's parts, apart
    assert code == 0 and stored is not None and stored.latest == offline["max_micro_batch_size"] >= 8


# ---- the arithmetic of what grows with the micro-batch, and of what fits (no process) ----------


def _layer(activations: float, params: float = 0.01) -> dict:
    return {
        "kind": "layer",
        "params_gb": params,
        "grads_gb": params,
        "optimizer_state_gb": 2 * params,
        "activations_per_microbatch_gb": activations,
        "input_per_microbatch_gb": activations / 20,
    }


def _run(
    capacity: float, layers=((0.1, 0.1), (0.1, 0.1)), in_flight=(2, 1), temporaries=0.05, **facts
) -> advice.Profile:
    """PP 2, 1F1B, 4 microbatches of 4 samples: each stage's parts from its layers' rows."""
    stages = []
    for stage, (rows, held) in enumerate(zip(layers, in_flight)):
        rows = [_layer(a) for a in rows]
        parts = {part: sum(row[part] for row in rows) for part in advice.MODEL_STATE}
        per_microbatch = sum(row["activations_per_microbatch_gb"] for row in rows)
        parts.update(activations_gb=per_microbatch * held, temporaries_gb=temporaries, outside_gb=0.5)
        stages.append(advice.Stage(stage, parts, held, layers=tuple(rows)))
    return advice.Profile.of(
        stages, {"pp_size": 2, "dp_size": 2}, {"micro_batch_size": 4, "microbatches": 4, **facts},
        gpu=False, capacity_gb=capacity,
    )  # fmt: skip


def test_on_cpu_the_rest_of_the_process_splits_at_its_measured_idle_size():
    figures = {"params_gb": 0.1, "grads_gb": 0.1, "optimizer_state_gb": 0.2, "activations_gb": 0.3}
    split = advice.stage_parts({**figures, "peak_host_rss_gb": 1.5, "host_idle_rss_gb": 0.9}.get, gpu=False)
    assert split["outside_gb"] == pytest.approx(0.9 - 0.4) and split["temporaries_gb"] == pytest.approx(0.3)
    assert advice.peak(split) == pytest.approx(1.5)  # the parts still add up to the measured peak
    whole = advice.stage_parts({**figures, "peak_host_rss_gb": 1.5}.get, gpu=False)  # an older record
    assert whole["outside_gb"] == pytest.approx(0.8) and "temporaries_gb" not in whole


def test_temporaries_grow_with_the_micro_batch_or_follow_two_runs_line():
    run = _run(10.0)
    doubled = advice.predict(run, advice.parse(["micro_batch_size=x2"]))
    assert [o.predicted["temporaries_gb"] for o in doubled] == pytest.approx([0.1, 0.1])
    assert [o.predicted["outside_gb"] for o in doubled] == [0.5, 0.5]
    at_16 = dataclasses.replace(run, micro_batch_size=16, microbatches=1)
    measured_at_16 = zip(at_16.stages, (0.1, 0.05))
    stages = tuple(
        dataclasses.replace(stage, parts={**stage.parts, "temporaries_gb": t}) for stage, t in measured_at_16
    )
    grown = dataclasses.replace(at_16, stages=stages)
    growth = advice.growth_between(run, grown)  # x4 in size: x2 (p = 0.5) and x1 (p = 0)
    assert growth == pytest.approx((0.5, 0.0))
    calibrated = advice.predict(
        dataclasses.replace(run, temporaries_growth=growth), advice.parse(["micro_batch_size=8"])
    )
    assert [o.predicted["temporaries_gb"] for o in calibrated] == pytest.approx([0.05 * 2**0.5, 0.05])
    with pytest.raises(ValueError, match="two micro-batch sizes"):
        advice.growth_between(run, run)


def test_the_largest_size_is_searched_under_the_what_ifs_other_changes():
    run = _run(1.2)
    alone, _ = advice.max_micro_batch_size(run)
    recomputed, _ = advice.max_micro_batch_size(run, advice.parse(["recompute=full", "micro_batch_size=x4"]))
    assert alone is not None and recomputed is not None and recomputed > alone
    outcomes = advice.predict(run, advice.parse(["recompute=full", f"micro_batch_size={recomputed}"]))
    assert all(o.peak_gb <= 1.2 for o in outcomes)
    assert advice.max_micro_batch_size(run, margin=0.2)[0] == 2 < alone  # a fifth of the capacity kept free


def test_the_changes_that_fit_come_cheapest_first_and_each_fits():
    heavy = _run(1.0, layers=((0.2, 0.2), (0.05, 0.05)), temporaries=0.0)  # stage 0 holds 2 x 0.4 GB
    fixes = advice.changes_that_fit(heavy, margin=0.1)
    names = [fix.changes[0].name for fix in fixes]
    assert names == sorted(names, key=list(advice.COSTS).index) and "recompute" in names
    for fix in fixes:
        assert all(o.peak_gb <= 0.9 for o in fix.outcomes), fix.text
    split = advice.balanced_split(heavy, 0.9)
    assert split is not None and split[0] < 2  # layers leave the stage that holds the peak
    before = max(o.peak_gb for o in advice.predict(heavy, []))
    after = max(o.peak_gb for o in advice.predict(heavy, advice.parse([f"layers_per_stage={split[0]},{split[1]}"])))
    assert after < before
    assert advice.changes_that_fit(_run(0.1), margin=0.1) == []  # below the idle size: nothing fits


def one_process_run(folder, mbs: int, microbatches: int, layers: int) -> None:
    """A real run in this process (PP 1, DP 1): ``layers`` blocks, ``microbatches`` of ``mbs`` samples
    an iteration, logged at iteration 2 with its facts: the per-layer record the recorder writes."""
    from nemo_memlog import LoggerConfig, close_writers, training_log

    model = blocks(layers)
    optimizer = torch.optim.Adam(model.parameters())
    cfg = LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=2, memory_record_dir=str(folder))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no writer configured: the records are what is read
        for iteration in (1, 2):
            for index in range(microbatches):
                x = torch.randn(mbs, WIDTH, generator=torch.Generator().manual_seed(index))
                model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            facts = {"micro_batch_size": mbs, "microbatches": microbatches}
            training_log(iteration, cfg, model=model, optimizer=optimizer, facts=facts)
        close_writers()


def advise_calibrated(base, other, capsys) -> tuple[int, str]:
    capsys.readouterr()  # what the runs printed
    code = main(["advise", str(base), "--calibrate-with", str(other), "--no-png", "--json"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("other", "named"),
    [
        ({"mbs": 16, "microbatches": 16, "layers": 40}, "global batch size 32 vs 256"),  # 20x the parameters too
        ({"mbs": 16, "microbatches": 2, "layers": 40}, "parameters on stage 0"),  # the global batch kept
    ],
    ids=["20x parameters, 8x global batch", "20x parameters"],
)
def test_calibrating_with_a_run_of_another_model_is_refused_naming_the_difference(tmp_path, capsys, other, named):
    one_process_run(tmp_path / "base", mbs=8, microbatches=4, layers=2)
    one_process_run(tmp_path / "other", **other)
    code, err = advise_calibrated(tmp_path / "base", tmp_path / "other", capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and named in err, err
    assert err.startswith("nemo-memlog advise: error: --calibrate-with") and "another micro-batch size" in err


def test_calibrating_with_the_same_job_at_another_micro_batch_size_is_taken(tmp_path, capsys):
    one_process_run(tmp_path / "base", mbs=8, microbatches=4, layers=2)
    one_process_run(tmp_path / "other", mbs=16, microbatches=2, layers=2)
    code, err = advise_calibrated(tmp_path / "base", tmp_path / "other", capsys)
    assert code == 0, err


def test_the_job_difference_names_the_pipeline_and_data_parallel_sizes():
    run = _run(10.0)
    assert advice.job_difference(run, dataclasses.replace(run, micro_batch_size=8, microbatches=2)) is None
    assert "pipeline size 2 vs 4" in advice.job_difference(run, dataclasses.replace(run, pp_size=4))
    assert "data-parallel size 2 vs 1" in advice.job_difference(run, dataclasses.replace(run, dp_size=1))

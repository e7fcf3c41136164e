"""On a real GPU: report_memory against torch and nvidia-smi, reset_peaks, a real OOM, the NCCL
path of a world of one read back from TensorBoard, four stages sharing one GPU over gloo with
real CUDA activations, and no wait for queued GPU work. Skipped without CUDA."""

from __future__ import annotations

import math
import shutil
import subprocess
import time
import warnings

import pytest

from nemo_memlog import DEFAULT_MEMORY_KEYS
from nemo_memlog.testing.cluster import Cluster
from nemo_memlog.testing.collectives import GATHER, count_collectives
from tests.gpu import needs_cuda
from tests.gpu.fresh import run_alone

pytestmark = [needs_cuda, pytest.mark.gpu, pytest.mark.processes]

GB = 1e9
QUEUED_S = 0.5  # GPU work queued before a logging step: far more than a logging step takes


def nvidia_smi_used_gb(uuid: str) -> float | None:
    """nvidia-smi's used memory of the GPU with this UUID (GB), or None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    rows = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid,memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    for row in rows.strip().splitlines():
        gpu, used_mib = (cell.strip() for cell in row.split(","))
        if uuid.lower() in gpu.lower():
            return float(used_mib) * 2**20 / GB
    raise AssertionError(f"no nvidia-smi row for GPU {uuid}:\n{rows}")


def one_process_facts():
    """Everything the single-process tests check, in one fresh CUDA process."""
    import torch

    from nemo_memlog.rank import memory

    facts = {}
    keep = torch.empty(int(1.5 * GB), dtype=torch.uint8, device="cuda")
    spike = torch.empty(int(1 * GB), dtype=torch.uint8, device="cuda")
    del spike
    report = memory.report_memory()
    flat = torch.cuda.memory_stats()  # nothing allocates in between: the same state
    facts["smi_used_gb"] = nvidia_smi_used_gb(str(torch.cuda.get_device_properties(0).uuid))
    facts["report"], facts["torch"] = report, {name: flat.get(name) for name in DEFAULT_MEMORY_KEYS}

    torch.cuda.empty_cache()  # the spike's cached block goes back: reserved can fall too
    before = memory.report_memory()
    memory.reset_peaks()
    facts["peaks_before_reset"], facts["after_reset"] = before, memory.report_memory()

    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        facts["oom_raised"] = False
    except torch.cuda.OutOfMemoryError:
        facts["oom_raised"] = True
    facts["after_oom"] = memory.report_memory()
    del keep
    return facts


@pytest.fixture(scope="module")
def facts():
    return run_alone(one_process_facts)


def test_report_memory_equals_torch_statistics_and_nvidia_smi(facts):
    report, flat = facts["report"], facts["torch"]
    for name, logged in DEFAULT_MEMORY_KEYS.items():
        expected = flat[name] / GB if "bytes" in name else flat[name]
        assert report[logged] == expected and type(report[logged]) is type(expected), name
    assert report["peak_allocated_gb"] >= 2.5 - 1e-9, "the 1.5 GB kept plus the 1 GB spike"
    assert report["current_allocated_gb"] >= 1.5 - 1e-9
    assert 0 < report["device_other_gb"] < 2.0, "the CUDA context, a few hundred MB"
    if facts["smi_used_gb"] is None:
        pytest.skip("nvidia-smi is not on PATH: torch's statistics were checked, nvidia-smi's were not")
    print(f"device_used_gb {report['device_used_gb']:.4f}, nvidia-smi {facts['smi_used_gb']:.4f}")
    assert abs(report["device_used_gb"] - facts["smi_used_gb"]) < 0.05


def test_reset_peaks_drops_the_allocated_and_reserved_peaks(facts):
    before, after = facts["peaks_before_reset"], facts["after_reset"]
    assert before["peak_allocated_gb"] >= 2.5 - 1e-9
    assert after["peak_allocated_gb"] == pytest.approx(after["current_allocated_gb"])
    assert after["peak_reserved_gb"] == pytest.approx(after["current_reserved_gb"])
    assert after["peak_reserved_gb"] < before["peak_reserved_gb"] - 0.9, "the spike's segment was released"


def test_a_real_oom_is_counted(facts):
    assert facts["oom_raised"]
    assert facts["after_oom"]["num_ooms"] == facts["after_reset"]["num_ooms"] + 1
    assert type(facts["after_oom"]["num_ooms"]) is int


def nccl_world_of_one(run_dir):
    """NCCL, world size 1: the gather over the NCCL group itself (the "group" path), and what
    training_log wrote to TensorBoard; then queued GPU work against each path."""
    import torch
    import torch.distributed as dist

    from nemo_memlog import LoggerConfig, close_writers, reduce, training_log
    from nemo_memlog.rank import memory
    from nemo_memlog.testing.gpu_work import QueuedWork, still_busy

    world = dist.group.WORLD
    activations = torch.ones(int(0.5 * GB) // 4, device="cuda")  # noqa: F841  (held: real memory to log)
    report = memory.report_memory()
    report.update(memory.capacity_report())
    reduction = reduce.Reduction()  # what gather_memory (and a run) gathers through
    gathered = reduction.gather(report, world, iteration=1, timeout_s=60)
    out = {
        "report": report,
        "gathered": gathered.per_rank[0],
        "keys": gathered.keys,
        "channel_device": reduction.channel(world).device.type,
    }
    reduction.close()

    cfg = LoggerConfig(log_memory_to_tensorboard=True, tensorboard_dir=f"{run_dir}/tensorboard")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["logged"] = training_log(1, cfg)
    close_writers()

    # Queued work: the gloo twin returns at once, the NCCL group waits behind the queue.
    twin = reduce.reduction_group(world, backend="gloo", world_scope=True, timeout_s=60)
    out["twin_backend"] = str(dist.get_backend(twin))
    work = QueuedWork()
    timings = {}
    for name, group in (("twin", twin), ("nccl", world)):
        queued = work.queue(QUEUED_S)
        start = time.perf_counter()
        reduce.gather_memory(report, group, iteration=2, timeout_s=60)
        took = time.perf_counter() - start
        busy = still_busy()
        torch.cuda.synchronize()
        timings[name] = {
            "queued_s": queued,
            "gather_s": took,
            "busy_after": busy,
            "drained_s": time.perf_counter() - start,
        }
    out["timings"] = timings
    return out


@pytest.fixture(scope="module")
def nccl_alone(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("nccl_alone")
    return run_dir, run_alone(nccl_world_of_one, str(run_dir), backend="nccl")


def test_nccl_world_of_one_gathers_on_the_gpu_and_tensorboard_holds_the_values(nccl_alone):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, out = nccl_alone
    assert out["channel_device"] == "cuda"
    for key, sent, got in zip(out["keys"], (out["report"][k] for k in out["keys"]), out["gathered"]):
        if isinstance(sent, float) and math.isnan(sent):
            assert got is None, key
        else:
            assert got == sent and type(got) is type(sent), key  # ints stay ints
    assert type(dict(zip(out["keys"], out["gathered"]))["num_ooms"]) is int

    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    logged = out["logged"]
    assert logged["memory/current_allocated_gb"] >= 0.5 - 1e-9
    for tag in (
        "memory/peak_allocated_gb",
        "memory/current_allocated_gb",
        "memory/device_used_gb",
        "memory/headroom_gb",
        "memory/num_ooms",
    ):
        (event,) = accumulator.Scalars(tag)
        assert event.step == 1 and event.value == pytest.approx(logged[tag], rel=1e-6), tag


def test_the_gather_over_the_gloo_twin_does_not_wait_for_queued_gpu_work(nccl_alone):
    timings = nccl_alone[1]["timings"]
    print(timings)
    twin, nccl = timings["twin"], timings["nccl"]
    assert twin["busy_after"], "the queued work was still running when the gather returned"
    assert twin["gather_s"] < 0.05 and twin["drained_s"] > 0.5 * twin["queued_s"]
    # The same call over NCCL, for contrast: stream-ordered behind the queue.
    assert nccl["gather_s"] > 0.5 * nccl["queued_s"]


# --------------------------------------------------------------------------------------------
# Four stages sharing the GPU over gloo (NCCL refuses two ranks on one GPU).

_held = []


def stage_step(run_dir, mb_per_stage_step):
    """Stage s holds (4 - s) x ``mb_per_stage_step`` MB of CUDA activations, as a 1F1B warm-up
    does, then logs one step; then logs another with GPU work queued."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nemo_memlog import LoggerConfig, close_writers, training_log
    from nemo_memlog.testing.gpu_work import QueuedWork, still_busy

    torch.cuda.set_device(0)
    stage = ps.get_pipeline_model_parallel_rank()
    _held.append(torch.ones((4 - stage) * mb_per_stage_step * 2**20 // 4, device="cuda"))
    cfg = LoggerConfig(
        log_memory_to_tensorboard=True, tensorboard_dir=f"{run_dir}/tensorboard", memory_reduce_timeout_s=120
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = training_log(1, cfg)
        work = QueuedWork()
        dist.barrier()  # gloo: every stage queues at the same time, and none waits for another's set-up
        work.queue(QUEUED_S)
        start = time.perf_counter()
        with count_collectives() as calls:
            second = training_log(2, cfg)
        took = time.perf_counter() - start
        busy = still_busy()
    torch.cuda.synchronize()
    if ps.get_pipeline_model_parallel_rank() == 3:
        close_writers()
    _held.clear()
    return {"stage": stage, "first": first, "second": second, "took_s": took, "busy": busy, "calls": calls}


@pytest.fixture(scope="module")
def four_stages(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("four_stages")
    with Cluster(world=4, pp=4, start_timeout=300) as cluster:
        results = cluster.run_ok(stage_step, str(run_dir), 256, timeout=300)
    return run_dir, results


def test_four_stages_on_one_gpu_log_the_first_stages_real_cuda_peak(four_stages):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, results = four_stages
    logged = results[0]["first"]
    peaks = sorted(k for k in logged if "peak_allocated_gb" in k)
    assert all([r["first"][k] for k in peaks] == [logged[k] for k in peaks] for r in results), "alike on every rank"
    for result in results:
        stage = result["stage"]
        per_stage = logged[f"memory/pp_stage_{stage}/peak_allocated_gb"]
        assert per_stage >= (4 - stage) * 256 * 2**20 / GB - 1e-9, "each stage's own activations"
    assert logged["memory/peak_stage/peak_allocated_gb"] == 0
    assert logged["memory/peak_allocated_gb"] == logged["memory/pp_stage_0/peak_allocated_gb"]
    assert (
        logged["memory/pp_stage_0/peak_allocated_gb"] - logged["memory/pp_stage_3/peak_allocated_gb"]
        >= 3 * 256 * 2**20 / GB - 0.01
    )
    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    stored = {event.step: event.value for event in accumulator.Scalars("memory/peak_allocated_gb")}
    assert stored[1] == pytest.approx(logged["memory/peak_allocated_gb"], rel=1e-6)
    assert sorted(stored) == [1, 2]


def test_four_stages_log_without_waiting_for_their_queued_gpu_work(four_stages):
    _, results = four_stages
    print("training_log with queued work, s per stage:", [round(r["took_s"], 4) for r in results])
    for result in results:
        assert result["calls"] == [GATHER], "one collective, over gloo"
        assert result["busy"], f"stage {result['stage']}: the queued work was still running"
        assert result["took_s"] < 0.25, f"stage {result['stage']}: training_log took {result['took_s']:.3f}s"

"""attribution: per-stage values, peak stage and headroom from lined-up stage reports (pure)."""

from nemo_memlog.attribution import GatheredMemory, low_headroom, memory_metrics

KEYS = (
    "peak_reserved_gb",
    "alloc_retries",
    "device_total_gb",
    "host_total_gb",
    "host_available_gb",
    "peak_host_rss_gb",
)
# Stage 0 holds the most reserved memory (GPU-like numbers: this machine has no GPU).
PER_STAGE = [
    [70.0, 1, 80.0, 500.0, 40.0, 20.0],
    [50.0, 3, 80.0, 500.0, 45.0, 25.0],
    [30.0, None, 80.0, 500.0, 60.0, 10.0],
]


def _gathered():
    maximum, peak = {}, {}
    for slot, key in enumerate(KEYS):
        present = [(v[slot], r) for r, v in enumerate(PER_STAGE) if v[slot] is not None]
        best = max(present, key=lambda pair: (pair[0], -pair[1]))
        maximum[key], peak[key] = best
    return GatheredMemory(KEYS, PER_STAGE, maximum, peak)


def test_device_and_host_headroom_name_the_worst_stage():
    logged = memory_metrics(_gathered())
    assert logged["memory/peak_reserved_gb"] == 70.0 and logged["memory/peak_stage/peak_reserved_gb"] == 0
    assert logged["memory/alloc_retries"] == 3 and logged["memory/peak_stage/alloc_retries"] == 1
    assert [logged[f"memory/pp_stage_{i}/peak_reserved_gb"] for i in range(3)] == [70.0, 50.0, 30.0]
    assert "memory/pp_stage_0/alloc_retries" not in logged  # per-stage values: peak_* only by default
    assert logged["memory/headroom_gb"] == 10.0 and logged["memory/headroom_stage"] == 0
    assert logged["memory/peak_reserved_pct"] == 87.5
    assert logged["memory/host_headroom_gb"] == 40.0 and logged["memory/host_headroom_stage"] == 0
    assert logged["memory/peak_host_rss_pct"] == 5.0
    assert "memory/host_available_gb" not in logged and "memory/peak_stage/device_total_gb" not in logged
    warned = low_headroom(logged, 0.15)
    assert [(kind, stage) for kind, stage, _ in warned] == [("device", 0), ("host", 0)]  # 12.5% and 8%
    assert low_headroom(logged, 0.05) == []
    assert "pipeline stage 0 has 10.00 GB of device memory left (12.5% of 80.0 GB)" in warned[0][2]


def test_memory_outside_the_allocator_counts_against_device_headroom():
    keys = ("peak_reserved_gb", "device_total_gb", "device_used_gb", "device_other_gb")
    # Stage 1 reserves less but holds 15 GB outside the allocator (NCCL, context): it has the least left.
    per_stage = [[70.0, 80.0, 72.0, 2.0], [60.0, 80.0, 70.0, 15.0]]
    maximum = {key: max(v[i] for v in per_stage) for i, key in enumerate(keys)}
    peak = {key: max(range(2), key=lambda r: (per_stage[r][i], -r)) for i, key in enumerate(keys)}
    logged = memory_metrics(
        GatheredMemory(keys, per_stage, maximum, peak), ("peak_*", "device_used_gb", "device_other_gb")
    )
    assert logged["memory/headroom_gb"] == 5.0 and logged["memory/headroom_stage"] == 1  # 80 - 15 - 60
    assert logged["memory/peak_reserved_pct"] == 75.0  # 60 / 80: the allocator's share, as before
    assert logged["memory/device_other_gb"] == 15.0 and logged["memory/peak_stage/device_other_gb"] == 1
    assert [logged[f"memory/pp_stage_{i}/device_other_gb"] for i in range(2)] == [2.0, 15.0]
    assert [logged[f"memory/pp_stage_{i}/device_used_gb"] for i in range(2)] == [72.0, 70.0]

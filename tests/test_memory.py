"""report_memory: real numbers from this process, stable keys, missing values marked."""

import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from nemo_memlog import DEFAULT_MEMORY_KEYS, report_memory
from nemo_memlog.rank import memory
from nemo_memlog.rank.memory import DEVICE_KEYS, capacity_report, host_rss_bytes, reset_host_peak, reset_peaks
from nemo_memlog.testing.notices import said
from nemo_memlog.warn import WarnOnce

CUDA_IN_USE = torch.cuda.is_available() and torch.cuda.is_initialized()


def test_default_keys_in_order_with_real_host_memory():
    report = report_memory()
    assert list(report) == list(DEFAULT_MEMORY_KEYS.values()) + ["host_rss_gb", "peak_host_rss_gb", *DEVICE_KEYS]
    assert 0.01 < report["host_rss_gb"] <= report["peak_host_rss_gb"] < 1000
    if not CUDA_IN_USE:
        assert all(math.isnan(report[k]) for k in DEFAULT_MEMORY_KEYS.values())  # missing, same keys
        assert all(math.isnan(report[k]) for k in DEVICE_KEYS)


def touched_ballast(mb):
    """``mb`` MiB of host memory, every page written: resident, not just reserved."""
    import numpy

    return numpy.full(mb * 2**20, 1, dtype=numpy.uint8)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_reset_brings_the_host_peak_back_to_the_current_rss():
    ballast = touched_ballast(200)
    del ballast
    rss, peak_before = host_rss_bytes()
    assert peak_before - rss > 150 * 2**20, "the freed ballast is in VmHWM"
    assert reset_host_peak() is None
    rss, peak_after = host_rss_bytes()
    assert peak_after - rss < 20 * 2**20, "VmHWM is back near VmRSS"
    print(f"VmHWM {peak_before / 2**20:.0f} MiB -> {peak_after / 2**20:.0f} MiB (VmRSS {rss / 2**20:.0f} MiB)")


def test_without_cuda_in_use_nothing_touches_cuda(monkeypatch):
    if CUDA_IN_USE:
        pytest.skip("this process has initialised CUDA")

    def forbidden(*args, **kwargs):
        raise AssertionError("CUDA was touched although this process never initialised it")

    for name in (
        "reset_peak_memory_stats",
        "mem_get_info",
        "memory_stats",
        "memory_stats_as_nested_dict",
        "cudart",
        "init",
        "current_device",
    ):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    reset_peaks()
    report = report_memory()
    assert all(math.isnan(report[k]) for k in DEVICE_KEYS)
    assert not torch.cuda.is_initialized()


def nested(flat: dict) -> dict:
    """torch's nested statistics for flat names (as memory_stats_as_nested_dict returns them)."""
    out: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def test_device_keys_and_reset_with_cuda_in_use_simulated(monkeypatch):
    """The arithmetic and the calls of the CUDA path, with torch.cuda stubbed (no GPU here)."""
    calls = []
    monkeypatch.setattr(memory, "_cuda_in_use", lambda: True)
    monkeypatch.setattr(memory, "_has_context", lambda device, stats: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        memory,
        "_read_allocator",
        lambda device: nested({"reserved_bytes.all.current": 30 * 10**9, "reserved_bytes.all.peak": 50 * 10**9}),
    )
    monkeypatch.setattr(memory, "_mem_get_info", lambda device: (45 * 10**9, 80 * 10**9))  # (free, total)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: calls.append("reset"))
    report = report_memory()
    assert report["device_used_gb"] == 35.0 and report["device_other_gb"] == 5.0
    assert report["peak_reserved_gb"] == 50.0
    reset_peaks()
    assert calls == ["reset"]


def test_cuda_initialised_without_a_context_on_this_device_gets_no_device_keys(monkeypatch):
    """torch.cuda.current_device() initialises CUDA without a context: mem_get_info would create one."""
    monkeypatch.setattr(memory, "_cuda_in_use", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delattr(torch._C, "_cuda_hasPrimaryContext", raising=False)  # as on CPU builds: the fallback
    monkeypatch.setattr(memory, "_read_allocator", lambda device: nested({"reserved_bytes.all.current": 0}))
    monkeypatch.setattr(memory, "_mem_get_info", lambda device: pytest.fail("would create a CUDA context"))
    report = report_memory()
    assert all(math.isnan(report[k]) for k in DEVICE_KEYS)


def h100_statistics(name):
    return json.loads((Path(__file__).parent / "data" / f"h100_memory_stats_{name}.json").read_text())


def test_h100_statistics_by_path_equal_torch_flattened_ones(monkeypatch):
    """Real statistics of an H100 (tests/data): every one of the 122 names torch.cuda.memory_stats()
    gave there, read by path from the nested dict, is the same value; absent names stay missing."""
    flat, tree = h100_statistics("flat"), h100_statistics("nested")
    monkeypatch.setattr(memory, "allocator_stats", lambda: (None, tree))
    every_name = {name: name.replace(".", "/") for name in flat}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one name no torch produces, below, warns
        report = report_memory({**every_name, "no_such.stat": "absent", "allocated_bytes.all": "a_subtree"})
    for name, logged in every_name.items():
        expected = flat[name] / 1e9 if "bytes" in name else flat[name]
        assert report[logged] == expected and type(report[logged]) is type(expected), name
    assert math.isnan(report["absent"]) and math.isnan(report["a_subtree"])


def test_a_host_peak_that_cannot_be_reset_warns_once(monkeypatch):
    monkeypatch.setattr(memory, "reset_host_peak", lambda: "no /proc here")
    monkeypatch.setattr(memory.peak_counters, "warnings", WarnOnce())  # this process has not warned yet
    with said(warned=False) as caught:
        reset_peaks()
        reset_peaks()
    messages = [w for w in caught]
    assert len(messages) == 1 and "no /proc here" in messages[0] and "lifetime peak" in messages[0]


def test_peak_rss_follows_a_real_allocation():
    before = report_memory()["peak_host_rss_gb"]
    ballast = torch.ones(200 * 2**20 // 8, dtype=torch.float64)  # 200 MiB, touched
    after = report_memory()["peak_host_rss_gb"]
    del ballast
    assert after - before > 0.15


def test_recipe_memory_keys_and_unknown_names():
    with said(notices=False) as caught:
        keys = {"reserved_bytes.all.peak": "mem-max-reserved", "not_a_stat": "mystery"}
        report = report_memory(keys)
        report_memory(keys)
    assert list(report)[:2] == ["mem-max-reserved", "mystery"] and math.isnan(report["mystery"])
    unknown = [w for w in caught if "not_a_stat" in w]
    assert len(unknown) == 1 and "reported as missing" in unknown[0]


def test_memory_keys_must_be_names():
    with pytest.raises(ValueError, match="reserved for host and device memory"):
        report_memory({"reserved_bytes.all.peak": "host_rss_gb"})


def test_capacity_is_real():
    capacity = capacity_report()
    assert 0 < capacity["host_available_gb"] <= capacity["host_total_gb"]


def test_the_default_keys_cannot_be_changed_in_place_and_extend_into_a_mapping_of_ones_own():
    """A change to DEFAULT_MEMORY_KEYS would be silently ignored (it is resolved once): it refuses."""
    with pytest.raises(TypeError):
        DEFAULT_MEMORY_KEYS["num_device_alloc"] = "device_allocs"  # type: ignore[index]
    extended = {**DEFAULT_MEMORY_KEYS, "num_device_alloc": "device_allocs"}
    report = report_memory(extended)
    assert "device_allocs" in report and list(DEFAULT_MEMORY_KEYS.values())[0] in report

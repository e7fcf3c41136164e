"""report_memory: real numbers from this process, stable keys, missing values marked."""

import math
import warnings

import pytest
import torch

from nemo_memlog import DEFAULT_MEMORY_KEYS, report_memory
from nemo_memlog.memory import capacity_report


def test_default_keys_in_order_with_real_host_memory():
    report = report_memory()
    assert list(report) == list(DEFAULT_MEMORY_KEYS.values()) + ["host_rss_gb", "peak_host_rss_gb"]
    assert 0.01 < report["host_rss_gb"] <= report["peak_host_rss_gb"] < 1000
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        assert all(math.isnan(report[k]) for k in DEFAULT_MEMORY_KEYS.values())  # missing, same keys


def test_peak_rss_follows_a_real_allocation():
    before = report_memory()["peak_host_rss_gb"]
    ballast = torch.ones(200 * 2**20 // 8, dtype=torch.float64)  # 200 MiB, touched
    after = report_memory()["peak_host_rss_gb"]
    del ballast
    assert after - before > 0.15


def test_recipe_memory_keys_and_unknown_names():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keys = {"reserved_bytes.all.peak": "mem-max-reserved", "not_a_stat": "mystery"}
        report = report_memory(keys)
        report_memory(keys)
    assert list(report)[:2] == ["mem-max-reserved", "mystery"] and math.isnan(report["mystery"])
    unknown = [str(w.message) for w in caught if "not_a_stat" in str(w.message)]
    assert len(unknown) == 1 and "reported as missing" in unknown[0]


def test_memory_keys_must_be_names():
    with pytest.raises(ValueError, match="reserved for host memory"):
        report_memory({"reserved_bytes.all.peak": "host_rss_gb"})


def test_capacity_is_real():
    capacity = capacity_report()
    assert 0 < capacity["host_available_gb"] <= capacity["host_total_gb"]

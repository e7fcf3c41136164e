"""The host memory limit as clusters enforce it (host_limit.py): a memory cgroup's limit.

- File layouts, v1 and v2, from fixture trees (the reader takes its /proc files as arguments).
- For real (root, cgroup v1 here): two ranks (gloo, PP 2, megatron-core's parallel_state) run
  under torchrun inside a fresh memory cgroup with a 3 GB limit and call training_log: the
  headroom is measured against the limit, not the node's MemAvailable, and the low-headroom
  warning speaks of the limit.

This file is also the rank script: ``torchrun tests/test_host_limit.py OUT_DIR``.
"""

import json
import os
import sys
import warnings
from pathlib import Path

import pytest

from nemo_memlog.host_limit import find_limit
from nemo_memlog.testing import cgroups

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 3_000_000_000
HOST = 64_000_000_000


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_the_smallest_memory_max_up_the_tree_binds_with_its_own_usage(tmp_path):
    mount = tmp_path / "cg2"
    write(mount / "job" / "memory.max", f"{LIMIT}\n")
    write(mount / "job" / "memory.current", "1000000000\n")
    write(mount / "job" / "step" / "memory.max", "max\n")
    write(mount / "job" / "step" / "memory.current", "900000000\n")
    write(mount / "job" / "step" / "task" / "memory.max", f"{HOST * 2}\n")  # above the RAM: no limit
    write(mount / "job" / "step" / "task" / "memory.current", "800000000\n")
    write(tmp_path / "cgroup", "0::/job/step/task\n")
    write(tmp_path / "mountinfo", f"29 23 0:26 / {mount} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    limit = find_limit(HOST, str(tmp_path / "cgroup"), str(tmp_path / "mountinfo"))
    assert limit is not None and limit.version == 2
    assert limit.limit_path == str(mount / "job" / "memory.max")
    assert limit.read() == (LIMIT, 1_000_000_000)


def test_v2_in_a_container_whose_cgroup_is_the_mount_root(tmp_path):
    mount = tmp_path / "cg2"
    write(mount / "memory.max", "2147483648\n")
    write(mount / "memory.current", "123\n")
    write(tmp_path / "cgroup", "0::/\n")
    write(tmp_path / "mountinfo", f"40 30 0:26 /kubepods/pod1/c1 {mount} ro - cgroup2 cgroup2 rw\n")
    limit = find_limit(HOST, str(tmp_path / "cgroup"), str(tmp_path / "mountinfo"))
    assert limit is not None and limit.read() == (2147483648, 123)


def test_v1_hierarchical_limit_in_memory_stat_binds_when_it_is_the_smaller(tmp_path):
    mount = tmp_path / "memory"
    own = mount / "slurm" / "job_7"
    write(own / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "unlimited"
    write(own / "memory.usage_in_bytes", "500000000\n")
    write(own / "memory.stat", f"cache 1\nrss 2\nhierarchical_memory_limit {LIMIT}\nhierarchical_memsw_limit 9\n")
    write(tmp_path / "cgroup", "12:memory:/slurm/job_7\n11:cpu:/\n0::/\n")
    write(tmp_path / "mountinfo", f"35 31 0:32 / {mount} rw,relatime - cgroup cgroup rw,memory\n")
    limit = find_limit(HOST, str(tmp_path / "cgroup"), str(tmp_path / "mountinfo"))
    assert limit is not None and limit.version == 1 and limit.read() == (LIMIT, 500_000_000)


def test_no_limit_unreadable_files_and_no_cgroups_mean_none_without_a_warning(tmp_path):
    mount = tmp_path / "memory"
    write(mount / "a" / "memory.limit_in_bytes", "9223372036854771712\n")
    write(mount / "a" / "memory.usage_in_bytes", "1\n")
    write(tmp_path / "cgroup", "4:memory:/a\n")
    write(tmp_path / "mountinfo", f"35 31 0:32 / {mount} rw - cgroup cgroup rw,memory\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert find_limit(HOST, str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")) is None  # unlimited
        write(mount / "a" / "memory.limit_in_bytes", "garbage\n")
        assert find_limit(HOST, str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")) is None  # unparsable
        assert find_limit(HOST, str(tmp_path / "nope"), str(tmp_path / "mountinfo")) is None  # no /proc file
        write(tmp_path / "mountinfo", "1 0 0:1 / / rw - ext4 /dev/sda rw\n")
        assert find_limit(HOST, str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")) is None  # no cgroup fs


# ---- for real: ranks inside a memory cgroup ----------------------------------------------------


def rank_main(out: str) -> int:
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex")
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from nemo_memlog import LoggerConfig, close_writers, training_log

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    cfg = LoggerConfig(
        log_memory_to_tensorboard=True,
        memory_record_dir="off",
        memory_headroom_warn_fraction=0.999,  # whatever is left: the warning fires, naming the limit
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logged = training_log(1, cfg)
    close_writers()
    rank = dist.get_rank()
    seen = {"logged": logged, "warnings": [str(w.message) for w in caught]}
    Path(out, f"rank-{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()
    return 0


@pytest.fixture(scope="module")
def under_a_limit(tmp_path_factory):
    ok, why = cgroups.available()
    if not ok:
        pytest.skip(f"cannot create a memory cgroup here: {why}")
    out = tmp_path_factory.mktemp("limit")
    from nemo_memlog.testing.cluster import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), __file__, str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with cgroups.memory_cgroup(LIMIT) as group:
        done = group.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}


def test_the_headroom_is_the_distance_to_the_cgroup_limit_not_the_nodes_ram(under_a_limit):
    logged = under_a_limit[1]["logged"]
    assert logged == under_a_limit[0]["logged"]  # every rank returns the same unified dict
    limit_gb = LIMIT / 1e9
    assert logged["memory/host_limit_gb"] == pytest.approx(limit_gb, abs=0.001)  # the kernel rounds to pages
    used = logged["memory/host_limit_used_gb"]  # both ranks' shared cgroup: torchrun and 2 ranks
    assert 0.2 < used < limit_gb
    headroom = logged["memory/host_headroom_gb"]
    assert headroom == pytest.approx(limit_gb - used, abs=0.15)  # the ranks read it a moment apart
    assert headroom < 0.5 * logged["memory/host_total_gb"]  # not the node's MemAvailable (~24 GB here)
    assert logged["memory/host_headroom_stage"] in (0, 1)
    share = 100 * logged["memory/peak_host_rss_gb"] / logged["memory/host_limit_gb"]
    assert logged["memory/peak_host_rss_pct"] == pytest.approx(share)


def test_the_low_headroom_warning_speaks_of_the_limit(under_a_limit):
    writer = under_a_limit[1]["warnings"]
    assert any("before its memory cgroup's limit" in w and f"of {LIMIT / 1e9:.1f} GB" in w for w in writer), writer


if __name__ == "__main__":
    sys.exit(rank_main(*sys.argv[1:]))

"""The host memory limit as clusters enforce it (rank/host_limit.py): a memory cgroup's limit.

- File layouts, v1 and v2, from fixture trees (the reader takes its /proc files as arguments),
  and a limit set, changed or lifted between two reads, or a move to another cgroup (issue 33).
- For real, a limit set and changed after a process started (issue 33): a process started in a
  memory cgroup without a limit reads, at each step, the limit written after it started, as
  ``capacity_report`` and the liveness beat do; and this test process, moved into a cgroup and
  out, sees ``capacity_report``'s limit follow.
- For real (root, cgroup v1 here): two ranks (gloo, PP 2, megatron-core's parallel_state) run
  under torchrun inside a fresh memory cgroup with a 3 GB limit and call training_log: the
  headroom is measured against the limit, not the node's MemAvailable, and the low-headroom
  warning speaks of the limit.

This file is also the rank script: ``torchrun tests/test_host_limit.py OUT_DIR``, and the
stepping process: ``python tests/test_host_limit.py steps``.
"""

import contextlib
import json
import math
import os
import select
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from nemo_memlog.rank.host_limit import ProcessLimit, find_chain, find_limit
from nemo_memlog.testing import cgroups
from nemo_memlog.testing.notices import said

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 3_000_000_000
HOST = 64_000_000_000
NO_LIMIT = 1 << 62  # far above any machine's RAM: no limit (v2 takes no "-1")


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


def v2_tree(tmp_path: Path, own: str = "job/step/task") -> tuple[Path, ProcessLimit]:
    """A v2 tree job/step/task without a limit, each cgroup using 1, 2, 3 x 100 MB, the process
    in ``own``; and the reader following it, as ``limit_of_process`` makes it."""
    mount = tmp_path / "cg2"
    for depth, name in enumerate(("job", "job/step", "job/step/task", "job/other"), start=1):
        write(mount / name / "memory.max", "max\n")
        write(mount / name / "memory.current", f"{depth * 100_000_000}\n")
    write(tmp_path / "cgroup", f"0::/{own}\n")
    write(tmp_path / "mountinfo", f"29 23 0:26 / {mount} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    return mount, ProcessLimit(HOST, str(tmp_path / "cgroup"), str(tmp_path / "mountinfo"))


def test_v2_a_memory_max_set_changed_and_lifted_between_two_reads_is_followed(tmp_path):
    mount, limit = v2_tree(tmp_path)
    assert limit.read() is None  # no limit at start
    write(mount / "job" / "step" / "task" / "memory.max", "2000000000\n")  # set after start
    assert limit.read() == (2_000_000_000, 300_000_000)
    write(mount / "job" / "step" / "task" / "memory.max", "2500000000\n")  # resized in place
    assert limit.read() == (2_500_000_000, 300_000_000)
    write(mount / "job" / "memory.max", "1000000000\n")  # an ancestor's, tighter: it binds, with its usage
    assert limit.read() == (1_000_000_000, 100_000_000)
    write(mount / "job" / "memory.max", "max\n")
    write(mount / "job" / "step" / "task" / "memory.max", f"{HOST}\n")  # at the RAM: no limit
    assert limit.read() is None


def test_v2_a_process_moved_to_another_cgroup_follows_the_new_chain(tmp_path):
    mount, limit = v2_tree(tmp_path)
    write(mount / "job" / "step" / "task" / "memory.max", "2000000000\n")
    write(mount / "job" / "other" / "memory.max", "1500000000\n")
    assert limit.read() == (2_000_000_000, 300_000_000)
    write(tmp_path / "cgroup", "0::/job/other\n")  # moved: the chain is found again
    assert limit.read() == (1_500_000_000, 400_000_000)


def test_v1_a_limit_set_after_start_binds_in_its_cgroup_or_out_of_sight_through_memory_stat(tmp_path):
    mount = tmp_path / "memory"
    unlimited = "9223372036854771712\n"  # v1's "unlimited"
    for depth, name in enumerate(("", "slurm", "slurm/job_7")):
        write(mount / name / "memory.limit_in_bytes", unlimited)
        write(mount / name / "memory.usage_in_bytes", f"{(3 - depth) * 100_000_000}\n")
    stat = mount / "slurm" / "job_7" / "memory.stat"
    write(stat, f"cache 1\nhierarchical_memory_limit {unlimited}")
    write(tmp_path / "cgroup", "12:memory:/slurm/job_7\n0::/\n")
    write(tmp_path / "mountinfo", f"35 31 0:32 / {mount} rw,relatime - cgroup cgroup rw,memory\n")
    limit = ProcessLimit(HOST, str(tmp_path / "cgroup"), str(tmp_path / "mountinfo"))
    assert limit.read() is None
    write(mount / "slurm" / "memory.limit_in_bytes", f"{LIMIT}\n")  # the job's, set after start ...
    write(stat, f"cache 1\nhierarchical_memory_limit {LIMIT}\n")  # ... as the kernel then sums it up
    assert limit.read() == (LIMIT, 200_000_000)  # with the job cgroup's usage, not the step's
    write(stat, "cache 1\nhierarchical_memory_limit 2000000000\n")  # an ancestor out of sight (a namespace)
    assert limit.read() == (2_000_000_000, 100_000_000)  # none in sight holds it: the own usage
    chain = find_chain(HOST, str(tmp_path / "cgroup"), str(tmp_path / "mountinfo"))
    assert chain.summary.limit_path == str(stat)  # without a limit, the one file a step reads


# ---- for real: a limit set and changed after a process started ---------------------------------


def steps_main() -> int:
    """Each line on stdin is a logging step: print this process's limit as a JSON line, as
    ``capacity_report`` reads it (``memory.host_limit_bytes``: ``limit_of_process(pid, RAM).read()``;
    torch is not imported, to start in a second) and as the liveness beat records it."""
    from nemo_memlog.failure.evidence import HostEvidence
    from nemo_memlog.rank.host_limit import limit_of_process

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    beat = HostEvidence()  # made at start, as the liveness thread's is
    for _ in sys.stdin:
        limit = limit_of_process(os.getpid(), ram)
        read = None if limit is None else limit.read()
        print(json.dumps({"limit": None if read is None else read[0], "beat_gb": beat.read()["host_limit_gb"]}))
        sys.stdout.flush()
    return 0


def set_limit(group: cgroups.MemoryCgroup, limit_bytes: int) -> int:
    """Set ``group``'s limit as a harness or Kubernetes does, mid-run; the limit the kernel keeps
    (rounded to pages), read back. v1's memsw limit (where there is one) must stay >= the limit."""
    if group.version == 2:
        (group.path / "memory.max").write_text(str(limit_bytes))
        return int((group.path / "memory.max").read_text())
    names = ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
    if limit_bytes > int((group.path / names[0]).read_text()):
        names.reverse()
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            (group.path / name).write_text(str(limit_bytes))
    return int((group.path / "memory.limit_in_bytes").read_text())


@pytest.fixture
def cgroups_here():
    ok, why = cgroups.available()
    if not ok:
        pytest.skip(f"cannot create a memory cgroup here: {why}")


@pytest.mark.processes
def test_a_limit_set_and_changed_after_start_is_read_at_the_next_step(cgroups_here):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, __file__, "steps"]
    with cgroups.memory_cgroup(NO_LIMIT) as group, cgroups.memory_cgroup(NO_LIMIT) as other:
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
        child = group.popen(command, cwd=ROOT, env=env, **pipes)
        try:

            def step() -> dict:
                child.stdin.write("\n")
                child.stdin.flush()
                ready, _, _ = select.select([child.stdout], [], [], 30)  # a line printed, or fail
                assert ready, "the stepping process printed nothing in 30 s"
                return json.loads(child.stdout.readline())

            assert step() == {"limit": None, "beat_gb": None}  # started without a limit
            for wanted in (2_500_000_000, 1_800_000_000):  # set after start, then changed
                kept = set_limit(group, wanted)
                assert abs(kept - wanted) < 4096
                assert step() == {"limit": kept, "beat_gb": kept / 1e9}
            set_limit(group, NO_LIMIT)  # lifted
            assert step() == {"limit": None, "beat_gb": None}
            kept = set_limit(other, 1_200_000_000)
            other.add(child.pid)  # moved to another cgroup, under a limit
            assert step() == {"limit": kept, "beat_gb": kept / 1e9}
        finally:
            child.stdin.close()
            assert child.wait(timeout=30) == 0


def test_capacity_report_follows_this_process_into_a_cgroup_and_its_limit_set_after(cgroups_here):
    from nemo_memlog.rank import memory

    if not math.isnan(memory.capacity_report()["host_limit_gb"]):
        pytest.skip("this test process is already under a memory cgroup limit")
    with cgroups.memory_cgroup(NO_LIMIT) as group:
        group.add(os.getpid())
        try:
            assert math.isnan(memory.capacity_report()["host_limit_gb"])
            kept = set_limit(group, 2_500_000_000)
            report = memory.capacity_report()
            assert report["host_limit_gb"] == kept / 1e9
            assert 0 <= report["host_limit_used_gb"] < report["host_limit_gb"]  # charged here since the move
        finally:
            (group.parent / "cgroup.procs").write_text(str(os.getpid()))
    assert math.isnan(memory.capacity_report()["host_limit_gb"])  # back where it was: no limit


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
    with said(warned=False) as caught:
        logged = training_log(1, cfg)
    close_writers()
    rank = dist.get_rank()
    seen = {"logged": logged, "warnings": [w for w in caught]}
    Path(out, f"rank-{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()
    return 0


@pytest.fixture(scope="module")
def under_a_limit(tmp_path_factory):
    ok, why = cgroups.available()
    if not ok:
        pytest.skip(f"cannot create a memory cgroup here: {why}")
    out = tmp_path_factory.mktemp("limit")
    from nemo_memlog.testing.torchrun import run_ranks

    with cgroups.memory_cgroup(LIMIT) as group:
        return run_ranks(__file__, [out], out, ranks=(0, 1), check=True, cgroup=group)


@pytest.mark.processes
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


@pytest.mark.processes
def test_the_low_headroom_warning_speaks_of_the_limit(under_a_limit):
    writer = under_a_limit[1]["warnings"]
    assert any("before its memory cgroup's limit" in w and f"of {LIMIT / 1e9:.1f} GB" in w for w in writer), writer


if __name__ == "__main__":
    sys.exit(steps_main() if sys.argv[1:] == ["steps"] else rank_main(*sys.argv[1:]))

"""The ranks of a node under one memory cgroup, judged as the kernel charges them
(offline/node_charge.py): shared pages once, the node's charge plus each rank's predicted change
against the limit, not each rank's peak RSS against an even share of it.

- The arithmetic, from records the real record writer wrote (measure/layer_record.py): advise's
  capacity, its largest micro-batch size, fit's verdict on a measured probe, report's headroom; a
  cgroup peak kept from an earlier, larger occupant; records without a cgroup unchanged.
- The cgroup's own peak charge read from v1's and v2's files (rank/host_limit.py), from fixture trees.
- For real: tests/test_fit.py (its Megatron job under torchrun in a memory cgroup, the cgroup's
  peak charge from its sweep, then a limit between two sizes': ``fit`` with no --capacity-gb answers
  the larger size that runs, and ``report`` of what it measured there shows no negative headroom).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from nemo_memlog import advice
from nemo_memlog.launch.fit import measured_fits
from nemo_memlog.measure import layer_record
from nemo_memlog.offline import node_charge, report
from nemo_memlog.offline.advise import load
from nemo_memlog.rank.host_limit import ProcessLimit, find_limit

HOST = 64_000_000_000
CGROUP = "node-a:/sys/fs/cgroup/memory/job"


def write_rank(folder: Path, stage: int, figures: dict, cgroup: str | None = CGROUP) -> None:
    """One rank's record (PP 2 on one node, 4 microbatches of 4), as the record writer writes it."""
    layout = {"rank": stage, "world_size": 2, "pp_rank": stage, "pp_size": 2, "tp_rank": 0, "tp_size": 1}
    layout.update(dp_rank=0, dp_size=1, local_world_size=2)
    held = 2 - stage  # 1F1B: stage 0 holds 2, stage 1 one
    row = {"name": f"layer{stage}", "kind": "layer", "chunk": 0, "number": stage, "params_gb": 0.1}
    row.update(grads_gb=0.1, optimizer_state_gb=0.2, activations_per_microbatch_gb=0.1, input_per_microbatch_gb=0.01)
    stage_figures = {"params_gb": 0.1, "grads_gb": 0.1, "optimizer_state_gb": 0.2, "activations_gb": 0.1 * held}
    stage_figures.update(microbatches_in_flight=held, microbatches=4, chunks=1, host_total_gb=64.0, **figures)
    record = layer_record.step_record(
        layout, iteration=2, time=0.0, facts={"micro_batch_size": 4, "microbatches": 4},
        stage_and_rows={"stage": stage_figures, "layers": [row]}, measured_steps=2,
    )  # fmt: skip
    if cgroup is not None:
        record["host_cgroup"] = cgroup
    layer_record.write(folder, record)


def under_a_limit(folder: Path, cgroup_peak: float | None = 1.35, used: float = 1.19) -> Path:
    """Peak RSS 0.75 + 0.65 = 1.40 GB, the cgroup's own peak 1.35 (shared pages once), limit 1.45:
    an even share (0.725) is below stage 0's peak, the node's charge within the limit. At the step
    the cgroup holds ``used``, each rank 0.15 and 0.10 below its peak RSS."""
    for stage, (peak, now) in enumerate(((0.75, 0.60), (0.65, 0.55))):
        figures = {"peak_host_rss_gb": peak, "host_rss_gb": now, "host_limit_gb": 1.45, "host_limit_used_gb": used}
        if cgroup_peak is not None:
            figures["host_limit_peak_gb"] = cgroup_peak
        write_rank(folder, stage, figures)
    return folder


def test_the_node_is_judged_by_its_cgroups_charge_and_its_ranks_predicted_changes(tmp_path):
    run = load(under_a_limit(tmp_path))
    assert run.nodes == (advice.Node(CGROUP, 1.45, 1.35, (0, 1)),)
    assert run.capacity_gb == pytest.approx(0.725)  # the limit shared by 2 ranks, as before
    assert "peak charge 1.35 GB counts shared pages once" in run.capacity_source
    today = advice.predict(run, [])
    assert [o.headroom_gb for o in today] == pytest.approx([0.10, 0.10])  # 1.45 - 1.35: the node's room
    assert all(o.fits for o in today) and measured_fits(run, margin=0.0)
    assert not measured_fits(run, margin=0.1)  # 0.10 left is below 10% of 1.45
    # size 8: stage 0 adds 0.2 GB of activations (2 held), stage 1 0.1: 1.35 + 0.3 > 1.45
    doubled = advice.predict(run, advice.parse(["micro_batch_size=8"]))
    assert [o.headroom_gb for o in doubled] == pytest.approx([-0.2, -0.2]) and not any(o.fits for o in doubled)
    assert advice.max_micro_batch_size(run)[0] == 4
    per_rank = dataclasses.replace(run, nodes=())  # what the RSS against an even share said: one size too small
    assert not all(o.fits for o in advice.predict(per_rank, [])) and advice.max_micro_batch_size(per_rank)[0] == 2


def test_a_cgroup_peak_left_by_an_earlier_larger_occupant_gives_way_to_this_runs_rise(tmp_path):
    """fit's probes share the job's cgroup: after a larger probe its peak file keeps that probe's
    peak; the charge at the step plus each rank's rise to its peak RSS is this run's alone."""
    run = load(under_a_limit(tmp_path, cgroup_peak=1.60))
    assert run.nodes[0].charge_gb == pytest.approx(1.19 + 0.15 + 0.10)
    assert measured_fits(run, margin=0.0)
    kept = load(under_a_limit(tmp_path / "no-peak-file", cgroup_peak=None))  # v2 before 5.19: no memory.peak
    assert kept.nodes[0].charge_gb == pytest.approx(1.44)


def test_without_a_shared_cgroup_nothing_changes(tmp_path):
    for stage, peak in enumerate((0.75, 0.65)):
        write_rank(tmp_path / "none", stage, {"peak_host_rss_gb": peak}, cgroup=None)
        write_rank(tmp_path / "alone", stage, {"peak_host_rss_gb": peak, "host_limit_gb": 1.45}, cgroup=f"n{stage}:/x")
    for folder in ("none", "alone"):
        run = load(tmp_path / folder)
        assert run.nodes == () and "judged per node" not in run.capacity_source
    assert load(tmp_path / "alone").capacity_gb == pytest.approx(0.725)
    given = load(under_a_limit(tmp_path / "given"), capacity_gb=0.8)  # --capacity-gb: per rank, as told
    assert given.nodes == () and all(o.headroom_gb == pytest.approx(0.8 - o.peak_gb) for o in advice.predict(given, []))


class _Events:
    """The part of report's MemoryRun that capacity_lines reads: stage peaks as logged."""

    def __init__(self, peaks: dict[int, float]):
        self.peaks = peaks

    def get(self, name):
        return None

    def per_stage(self, name):
        series = type("Series", (), {})
        found = {}
        for stage, peak in self.peaks.items():
            found[stage] = series()
            found[stage].latest = peak
        return found if name == "peak_host_rss_gb" else {}


def test_report_shows_the_nodes_headroom_never_below_zero_for_a_run_that_finished(tmp_path):
    records = load(under_a_limit(tmp_path))
    lines = report.capacity_lines(_Events({0: 0.75, 1: 0.65}), records)
    assert lines[1] == (
        "least headroom: 100 MB under the memory cgroup limit 1.45 GB of 2 ranks (its peak charge 1.35 GB, "
        "shared pages once)"
    )
    per_rank = report.capacity_lines(_Events({0: 0.75, 1: 0.65}), dataclasses.replace(records, nodes=()))
    assert per_rank[1].startswith("least headroom per rank: -25 MB")  # what it said before


def test_the_cgroups_own_peak_charge_is_read_beside_its_usage_v1_and_v2(tmp_path):
    v1 = tmp_path / "v1" / "job"
    v1.mkdir(parents=True)
    for name, value in (("memory.limit_in_bytes", 3_000_000_000), ("memory.usage_in_bytes", 1_000_000_000)):
        (v1 / name).write_text(f"{value}\n")
    (v1 / "memory.max_usage_in_bytes").write_text("1500000000\n")
    (v1 / "memory.stat").write_text("hierarchical_memory_limit 3000000000\n")
    (tmp_path / "cgroup1").write_text("5:memory:/job\n")
    (tmp_path / "mountinfo1").write_text(f"30 23 0:27 / {v1.parent} rw - cgroup cgroup rw,memory\n")
    v2 = tmp_path / "v2" / "job"
    v2.mkdir(parents=True)
    for name, value in (
        ("memory.max", 3_000_000_000),
        ("memory.current", 1_000_000_000),
        ("memory.peak", 1_700_000_000),
    ):
        (v2 / name).write_text(f"{value}\n")
    (tmp_path / "cgroup2").write_text("0::/job\n")
    (tmp_path / "mountinfo2").write_text(f"29 23 0:26 / {v2.parent} rw - cgroup2 cgroup2 rw\n")
    for version, peak in ((1, 1_500_000_000), (2, 1_700_000_000)):
        files = str(tmp_path / f"cgroup{version}"), str(tmp_path / f"mountinfo{version}")
        limit = find_limit(HOST, *files)
        assert limit is not None and limit.version == version and limit.peak_bytes() == peak
        followed = ProcessLimit(HOST, *files)
        assert followed.read() == (3_000_000_000, 1_000_000_000)
        binding = followed.binding()
        assert binding is not None and binding.folder == str(v1 if version == 1 else v2)
    old = tmp_path / "v2-before-5.19" / "job"  # no memory.peak (a fresh tree: read descriptors stay open)
    old.mkdir(parents=True)
    for name in ("memory.max", "memory.current"):
        (old / name).write_text((v2 / name).read_text())
    (tmp_path / "mountinfo3").write_text(f"29 23 0:26 / {old.parent} rw - cgroup2 cgroup2 rw\n")
    limit = find_limit(HOST, str(tmp_path / "cgroup2"), str(tmp_path / "mountinfo3"))
    assert limit is not None and limit.peak_bytes() is None


def test_the_capacity_sentence_names_the_fullest_node():
    nodes = (advice.Node("a:/j", 2.0, 1.0, (0, 1)), advice.Node("b:/j", 2.0, 1.8, (2, 3)))
    assert node_charge.capacity_text(nodes).startswith("judged per node: the node's 2 ranks (of 2 nodes, the fullest)")
    assert "peak charge 1.80 GB" in node_charge.capacity_text(nodes)

"""Parts 1 and 2 of the overhead benchmark: one PP group of forked gloo processes.

Part 1, per PP size: that many processes join a gloo group and megatron-core's parallel_state
builds the PP group (world == PP group). Every rank runs the same sequence: per repetition
each variant once, each after a barrier, the first variant rotating (``timing.interleaved``).
Then the pieces of ``ours`` one by one, cold (each after a barrier) and, on the writer rank,
hot (tight loops). Part 2 (the first PP size's writer rank): training_log off the logging
iterations, time per call and collectives issued.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback

import torch
import torch.distributed as dist

from bench.anchors import bridge_reduce_max, composer_reduce
from bench.stand_ins import exchange, fed_statistics, h100_cuda_stats, null_fanout
from bench.timing import interleaved, per_call_ns, summarise, summary
from nemo_memlog.testing.cluster import free_port
from nemo_memlog.testing.collectives import count_collectives

VARIANTS = ("ours", "reduce", "bridge", "composer", "floor", "ours_a2a", "reduce_a2a")
PIECES = (
    "report_memory",
    "capacity_report",
    "pack",
    "all_gather",
    "all_to_all",
    "unpack",
    "line_up",
    "attribution",
    "hand_off",
)
DEFAULT_ITERS = {2: 400, 4: 300, 8: 200}
NON_LOGGING_INTERVAL = 100


def run_cluster(world: int, plan: dict, timeout_s: float) -> list[dict]:
    """``run_rank`` on ``world`` forked processes; each rank's result, in rank order."""
    # fork: the children inherit the parent's imported torch and megatron-core, where spawn
    # would import them again in every process (about 10 s of CPU each).
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, plan, results), daemon=True) for r in range(world)]
    for proc in procs:
        proc.start()
    out: list = [None] * world
    try:
        for _ in range(world):
            rank, value = results.get(timeout=timeout_s)
            if "error" in value:
                raise RuntimeError(f"PP {world}, rank {rank} failed:\n{value['error']}")
            out[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return out


def _worker(rank: int, world: int, port: int, plan: dict, results) -> None:
    try:
        results.put((rank, run_rank(rank, world, port, plan)))
    except BaseException as error:  # report it instead of leaving the parent waiting
        results.put((rank, {"error": f"{type(error).__name__}: {error}\n{traceback.format_exc()}"}))


def run_rank(rank: int, world: int, port: int, plan: dict) -> dict:
    """One rank's part 1 (and, on the writer rank of a plan with ``non_logging``, part 2)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world)
    group = parallel_state.get_pipeline_model_parallel_group()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    # an H100's statistics, through the real code, on a CPU machine
    with fed_statistics(h100_cuda_stats(stage)):
        out = {"rank": rank, "stage": stage, **_timed(group, plan)}
    return out


def _timed(group, plan: dict) -> dict:
    from nemo_memlog.config import LoggerConfig
    from nemo_memlog.monitor.training_log import monitor_of, training_log
    from nemo_memlog.rank import memory
    from nemo_memlog.reduce import Reduction, gather_memory

    # The flight recorder is on, as by default (its folder a temp dir rather than ./memory_records).
    cfg = LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=1, memory_record_dir=plan["records"])
    timeout_s = cfg.memory_reduce_timeout_s
    fanout = null_fanout()
    report = memory.report_memory()
    report.update(memory.capacity_report())
    one = torch.zeros(1)
    last = {}
    # The all_to_all exchange, passed to Reductions of their own: one for reduce_a2a (as gather_memory
    # uses the free functions'), one swapped into the monitor (made by its first call: ours, the first
    # variant of the first repetition).
    a2a = {"reduce": Reduction(exchange="all_to_all")}

    def ours(iteration):
        last["unified"] = training_log(iteration, cfg, pp_group=group, writers=fanout)

    def ours_a2a(iteration):
        if "monitor" not in a2a:
            a2a["monitor"] = monitor_of(cfg, writers=fanout)
            a2a["ours"] = Reduction(a2a["monitor"].warnings, exchange="all_to_all")
        with exchange(a2a["monitor"], a2a["ours"]):
            ours(iteration)

    def reduce_a2a(iteration):
        a2a["reduce"].gather(report, group, iteration=iteration, timeout_s=timeout_s)

    variants = {
        "ours": ours,
        "reduce": lambda it: gather_memory(report, group, iteration=it, timeout_s=timeout_s),
        "bridge": lambda it: bridge_reduce_max(report, group),
        "composer": lambda it: composer_reduce(report, group),
        "floor": lambda it: dist.all_reduce(one, group=group),
        "ours_a2a": ours_a2a,
        "reduce_a2a": reduce_a2a,
    }
    out = {}

    def barrier():  # before each call, untimed
        dist.barrier(group=group)

    out["samples"], out["cpu"] = interleaved(variants, plan["iters"], plan["warmup"], barrier)
    out.update(
        _collectives_and_exchange(ours, ours_a2a, a2a["reduce"], report, group, plan["warmup"] + plan["iters"] + 1)
    )
    for reduction in (a2a["reduce"], a2a["ours"]):
        reduction.close()
    out["unified"] = last["unified"]
    monitor = monitor_of(cfg, writers=fanout)  # the monitor training_log used: its channel and warnings
    out.update(_pieces_timed(monitor, report, last["unified"], plan, barrier))
    if plan["non_logging"]:
        dist.barrier(group=group)
        if dist.get_rank() == dist.get_world_size() - 1:
            out["non_logging"] = non_logging(group, plan["non_logging"])
        dist.barrier(group=group)  # the other ranks wait, blocked in gloo, meanwhile
    fanout.close(5)
    return out


def _collectives_and_exchange(ours, ours_a2a, reduce_a2a, report: dict, group, iteration: int) -> dict:
    """The collectives one logging call issues, with either exchange, and whether the
    all_to_all exchange (``reduce_a2a``, a Reduction) gathers exactly what the all_gather one does."""
    from nemo_memlog.reduce import gather_memory

    out = {}
    with count_collectives() as calls:
        ours(iteration)
    out["collectives_per_logging_call"] = calls
    with count_collectives() as calls:
        ours_a2a(iteration + 1)
    out["collectives_per_logging_call_a2a"] = calls
    by_a2a = reduce_a2a.gather(report, group, iteration=iteration + 2)
    out["a2a_identical"] = repr(by_a2a) == repr(gather_memory(report, group, iteration=iteration + 2))
    return out


def _pieces_timed(monitor, report: dict, unified: dict, plan: dict, barrier) -> dict:
    """The pieces cold on every rank; hot on the writer rank, the other ranks blocked meanwhile."""
    group = monitor.group
    steps = pieces(monitor, report, unified)
    out = {"pieces": summarise(interleaved(steps, plan["piece_iters"], 3, barrier)[0])}
    dist.barrier(group=group)
    if dist.get_rank() == dist.get_world_size() - 1:
        out["pieces_hot_us"] = {
            name: per_call_ns(step, plan["hot_calls"]) / 1e3
            for name, step in steps.items()
            if name not in ("all_gather", "all_to_all")
        }
    dist.barrier(group=group)
    return out


def pieces(monitor, report, unified) -> dict:
    """The steps of ``ours`` one by one, on the monitor's buffers and the data of its last logging call."""
    from nemo_memlog import attribution, payload, reduce
    from nemo_memlog.rank import memory

    group = monitor.group
    channel = monitor.reduction.channel(group)
    layout = channel.layout
    reports = payload.unpack(layout, channel.recv_words, channel.ranks)
    gathered = attribution.line_up(layout.keys, reports)
    channel.send_rows[1:] = channel.send_words  # every row is this rank's words, as all_to_all sends them
    fanout = null_fanout()
    return {
        "report_memory": lambda it: memory.report_memory(),
        "capacity_report": lambda it: memory.capacity_report(),
        "pack": lambda it: payload.pack_into(channel.send_words, layout, report, it, monitor.reduction.warn_value),
        "all_gather": lambda it: reduce.all_gather_single(channel.recv, channel.send_row, group).wait(),
        "all_to_all": lambda it: reduce.all_to_all_single(channel.recv, channel.send, group).wait(),
        "unpack": lambda it: payload.unpack(layout, channel.recv_words, channel.ranks),
        "line_up": lambda it: attribution.line_up(layout.keys, reports),
        "attribution": lambda it: attribution.memory_metrics(gathered, ("peak_*",)),
        "hand_off": lambda it: fanout.log(unified, it),
    }


def non_logging(group, calls: int) -> dict:
    """Part 2: training_log off the logging iterations: time per call and collectives issued."""
    from nemo_memlog.config import LoggerConfig
    from nemo_memlog.monitor.training_log import training_log

    cfg = LoggerConfig(log_memory_to_tensorboard=True, tensorboard_log_interval=NON_LOGGING_INTERVAL)
    iterations = [i for i in range(1, 2 * calls) if i % NON_LOGGING_INTERVAL][:calls]
    with count_collectives() as issued:
        returned = [training_log(iteration, cfg, pp_group=group) for iteration in iterations]
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter_ns()
        for iteration in iterations:
            training_log(iteration, cfg, pp_group=group)
        best = min(best, (time.perf_counter_ns() - start) / len(iterations))
    start = time.perf_counter_ns()
    for _iteration in iterations:  # the loop's own cost, shown beside
        pass
    loop_ns = (time.perf_counter_ns() - start) / len(iterations)
    return {
        "calls": len(iterations),
        "ns_per_call": best,
        "loop_ns": loop_ns,
        "collectives": len(issued),
        "all_none": all(r is None for r in returned),
    }


def cluster_row(world: int, ranks: list[dict]) -> dict:
    """Per variant: the largest median and p90 over the ranks (and the writer rank's own)."""
    row = {"pp": world, "variants": {}, "writer": {}, "per_rank_median_us": {}, "cpu_us": {}}
    for name in VARIANTS:
        per_rank = [summary(r["samples"][name]) for r in ranks]
        row["variants"][name] = {
            "median_us": max(s["median_us"] for s in per_rank),
            "p90_us": max(s["p90_us"] for s in per_rank),
            "n": per_rank[0]["n"],
        }
        row["writer"][name] = per_rank[-1]
        row["per_rank_median_us"][name] = [s["median_us"] for s in per_rank]
        row["cpu_us"][name] = max(summary(r["cpu"][name])["median_us"] for r in ranks)
    writer = ranks[-1]
    for key in ("collectives_per_logging_call", "collectives_per_logging_call_a2a", "pieces", "pieces_hot_us"):
        row[key] = writer[key]
    row["keys_logged"] = len(writer["unified"])
    row["a2a_identical"] = all(r["a2a_identical"] for r in ranks)
    return row


def pp_markdown(rows: list[dict]) -> list[str]:
    """Part 1's tables: per PP size and exchange, the variants and their ratios; CPU time;
    the collectives; the pieces of ``ours``."""
    if not rows:
        return []
    lines = [
        "",
        "Per call, microseconds: the largest median (p90) over the ranks, ratios of those medians; "
        + ", ".join(f"PP {r['pp']}: {r['variants']['ours']['n']}" for r in rows)
        + " interleaved repetitions per variant.",
        "",
        "| PP | exchange | a: training_log | reduce: gather_memory | b: bridge | c: composer | d: floor "
        "| a/b | a/c | a/d | reduce/b | reduce/d |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        v = row["variants"]
        cell = {name: f"{v[name]['median_us']:.0f} ({v[name]['p90_us']:.0f})" for name in VARIANTS}
        med = {name: v[name]["median_us"] for name in VARIANTS}
        for mode, ours, reduce in (("all_gather", "ours", "reduce"), ("all_to_all", "ours_a2a", "reduce_a2a")):
            lines.append(
                f"| {row['pp']} | {mode} | {cell[ours]} | {cell[reduce]} | {cell['bridge']} | {cell['composer']} "
                f"| {cell['floor']} | {med[ours] / med['bridge']:.2f} | {med[ours] / med['composer']:.3f} "
                f"| {med[ours] / med['floor']:.2f} | {med[reduce] / med['bridge']:.2f} "
                f"| {med[reduce] / med['floor']:.2f} |"
            )
    lines += [
        "",
        "CPU time per call, this process (all threads), largest median over the ranks, us:",
        "",
        "| PP | " + " | ".join(VARIANTS) + " |",
        "|---:|" + "---:|" * len(VARIANTS),
    ]
    lines += [f"| {r['pp']} | " + " | ".join(f"{r['cpu_us'][name]:.0f}" for name in VARIANTS) + " |" for r in rows]
    lines += [""] + [
        f"PP {r['pp']}: collectives per logging call: {'+'.join(r['collectives_per_logging_call'])} "
        f"(all_to_all: {'+'.join(r['collectives_per_logging_call_a2a'])}); {r['keys_logged']} keys logged; "
        f"all_to_all result identical: {'yes' if r['a2a_identical'] else 'NO'}"
        for r in rows
    ]
    return lines + _pieces_markdown(rows)


def _pieces_markdown(rows: list[dict]) -> list[str]:
    lines = [
        "",
        "The pieces of a, one by one, writer rank, us per call: cold = each after a barrier "
        "(median), as in a logging step; hot = in a tight loop:",
        "",
        "| PP | | " + " | ".join(PIECES) + " | sum without all_to_all |",
        "|---:|---|" + "---:|" * (len(PIECES) + 1),
    ]
    for row in rows:
        for label, p in (
            ("cold", {name: row["pieces"][name]["median_us"] for name in PIECES}),
            ("hot", row["pieces_hot_us"]),
        ):
            total = sum(p.get(name, 0) for name in PIECES if name != "all_to_all")
            lines.append(
                f"| {row['pp']} | {label} | "
                + " | ".join(f"{p[name]:.1f}" if name in p else "-" for name in PIECES)
                + f" | {total:.0f} |"
            )
    return lines


def non_logging_markdown(non_log: dict | None) -> list[str]:
    """Part 2's line."""
    if not non_log:
        return []
    return [
        "",
        f"Non-logging iteration: training_log off the interval, {non_log['calls']} calls: "
        f"non_logging_ns_per_call={non_log['ns_per_call']:.0f} "
        f"({non_log['ns_per_call'] / 1e3:.3f} us, of which the loop {non_log['loop_ns']:.0f} ns), "
        f"non_logging_collectives={non_log['collectives']}, returned None: {non_log['all_none']}",
    ]

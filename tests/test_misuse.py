"""Misuse that used to be silent or misexplained, run for real under torchrun (2 processes):

- ``no_group``: torchrun started the processes but none called ``init_process_group``: each
  would have logged itself as a one-stage job into the same dashboards. ``training_log`` raises,
  naming the fix.
- ``one_rank``: a gloo job whose rank 0 leaves (its process ends) while rank 1 calls
  ``training_log``: the error says a peer left, in gloo's words, within a second or two, not
  "not every rank joined within memory_reduce_timeout_s".
- ``intervals``: a gloo job whose ranks were given different ``tensorboard_log_interval``: the
  error says so, not that a stage skipped a call.

And in this process: a ``model=`` or ``optimizer=`` of the wrong kind is refused with a TypeError
naming the argument, and ``model=`` without ``optimizer=`` logs no optimizer state (it was 0.0).

This file is also the rank script: ``torchrun tests/test_misuse.py SCENARIO OUT_DIR``; each rank
writes what it saw to OUT_DIR/rank-N.json.
"""

import json
import os
import sys
import time
import warnings
from pathlib import Path

import pytest

TIMEOUT_S = 60.0


def rank_main(scenario: str, out: str) -> int:
    import warnings

    warnings.filterwarnings("ignore", message="Transformer Engine and Apex")
    import torch.distributed as dist

    from nemo_memlog import LoggerConfig, training_log

    rank = int(os.environ["RANK"])
    cfg = LoggerConfig(log_memory_to_tensorboard=True, memory_record_dir="off", memory_reduce_timeout_s=TIMEOUT_S)
    seen = {"rank": rank}
    if scenario == "intervals":
        seen["errors"] = different_intervals(rank)
        Path(out, f"rank-{rank}.json").write_text(json.dumps(seen))
        os._exit(0)
    group = None
    if scenario == "one_rank":
        from nemo_memlog.testing.wait import alive, wait_for

        dist.init_process_group("gloo")
        dist.barrier()  # both ranks connected: rank 0 leaves a group that had formed, not one still forming
        left = Path(out, "rank-0.pid")
        if rank == 0:
            left.write_text(str(os.getpid()))
            os._exit(0)  # leaves without a word: its sockets close
        pid = int(wait_for(lambda: left.exists() and left.read_text(), 120, "rank 0's pid"))
        wait_for(lambda: not alive(pid), 120, "rank 0's exit")  # it has left: the call below finds it gone
        group = dist.group.WORLD  # a plain torch.distributed job: the pipeline is the world
    started = time.monotonic()
    try:
        training_log(1, cfg, pp_group=group)
        seen["error"] = None
    except Exception as error:  # what the user sees
        seen["error"] = f"{type(error).__name__}: {error}"
    seen["seconds"] = time.monotonic() - started
    Path(out, f"rank-{rank}.json").write_text(json.dumps(seen))
    os._exit(0)


#: Each rank's tensorboard_log_interval, per phase: (2, 3) rank 0 logs at 2, rank 1 at 3, and each
#: sees the other's iteration is no multiple of its own; (2, 4) only rank 1 can tell (2 is no
#: multiple of 4), rank 0 (4 is a multiple of 2) names both causes.
INTERVALS = ((2, 3), (2, 4))


def different_intervals(rank: int) -> list:
    """Log iterations 1-12 with this rank's interval of each phase; what each phase raised."""
    import torch.distributed as dist

    from nemo_memlog import LoggerConfig, close_writers, training_log

    dist.init_process_group("gloo")
    errors = []
    for intervals in INTERVALS:
        cfg = LoggerConfig(
            log_memory_to_tensorboard=True,
            memory_record_dir="off",
            memory_reduce_timeout_s=TIMEOUT_S,
            tensorboard_log_interval=intervals[rank],
        )
        try:
            for iteration in range(1, 13):
                training_log(iteration, cfg, pp_group=dist.group.WORLD)
            errors.append(None)
        except Exception as error:
            errors.append(f"{type(error).__name__}: {error}")
        close_writers()  # the next phase's runs start afresh on both ranks
    return errors


def launch(scenario: str, out: Path) -> dict[int, dict]:
    from nemo_memlog.testing.torchrun import run_ranks

    return run_ranks(__file__, [scenario, out], out)


@pytest.mark.processes
def test_torchrun_without_a_process_group_is_refused_with_the_fix(tmp_path):
    seen = launch("no_group", tmp_path)
    assert sorted(seen) == [0, 1]
    for rank, entry in seen.items():
        error = entry["error"] or ""
        assert error.startswith("RuntimeError: nemo_memlog: WORLD_SIZE=2 and RANK=") and f"RANK={rank}" in error
        assert "torch.distributed is not initialised" in error
        assert "Call torch.distributed.init_process_group()" in error and "before the first training_log" in error


@pytest.mark.processes
def test_a_peer_that_left_is_named_as_such_not_as_a_timeout(tmp_path):
    seen = launch("one_rank", tmp_path)
    assert sorted(seen) == [1]
    error, seconds = seen[1]["error"] or "", seen[1]["seconds"]
    assert error.startswith("MemoryReduceError: memory reduction over ") and "a peer left after " in error, error
    assert "Connection closed by peer" in error or "Connection reset by peer" in error, error
    # Told at once, not after the timeout: half of it is a margin no loaded machine needs.
    assert "not every rank joined" not in error and seconds < TIMEOUT_S / 2, (seconds, error)
    assert "nemo-memlog postmortem" in error


@pytest.mark.processes
def test_ranks_with_different_logging_intervals_are_told_so_not_that_a_call_was_skipped(tmp_path):
    seen = launch("intervals", tmp_path)
    assert sorted(seen) == [0, 1]
    definite = "The ranks log at different tensorboard_log_interval"
    same = "Every rank must use the same tensorboard_log_interval"
    for rank in (0, 1):
        error = seen[rank]["errors"][0] or ""  # (2, 3): each rank sees the other's iteration is no multiple
        assert error.startswith("MemoryReduceError: memory reduction over ") and definite in error, error
        assert f"this rank logs every {INTERVALS[0][rank]} iterations" in error and same in error, error
        assert "rank 0: 2, rank 1: 3" in error and "skipped" not in error, error
    error = seen[1]["errors"][1] or ""  # (2, 4): 2 is no multiple of 4
    assert definite in error and "rank 0's iteration 2: no multiple of 4" in error and "skipped" not in error, error
    error = seen[0]["errors"][1] or ""  # 4 is a multiple of 2: rank 0 cannot tell, and names both causes
    assert "rank 0: 2, rank 1: 4" in error and "tensorboard_log_interval differs from this rank's (2)" in error, error
    assert "every rank must use the same tensorboard_log_interval" in error, error


def quiet_config(**settings):
    from nemo_memlog import LoggerConfig

    return LoggerConfig(log_memory_to_tensorboard=True, memory_record_dir="off", **settings)


def test_a_model_or_optimizer_of_the_wrong_kind_is_refused_naming_the_argument():
    import warnings

    import pytest
    import torch

    from nemo_memlog import close_writers, training_log
    from nemo_memlog.monitor import MemoryMonitor

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = quiet_config()
    takes_model = r"^model= must be a torch\.nn\.Module, or a list \(or tuple\) of them, as Megatron passes"
    takes_optimizer = r"^optimizer= must be a torch optimizer, Megatron's MegatronOptimizer or ChainedOptimizer"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no writer configured
            for bad in (model.state_dict(), "model", [model, "chunk"]):
                with pytest.raises(TypeError, match=takes_model):
                    training_log(1, cfg, model=bad, optimizer=optimizer)
            with pytest.raises(TypeError, match=r"got OrderedDict .*\(a state_dict\? pass the object itself\)"):
                training_log(1, cfg, model=model.state_dict())
            for bad in (optimizer.state_dict(), "adam", [optimizer, {}]):
                with pytest.raises(TypeError, match=takes_optimizer + r".*anything with param_groups, \.optimizer"):
                    training_log(1, cfg, model=model, optimizer=bad)
            monitor = MemoryMonitor(cfg)
            with pytest.raises(TypeError, match=takes_model):
                monitor.log(1, model="model")
            with pytest.raises(TypeError, match=takes_optimizer):
                monitor.log(1, model=model, optimizer=optimizer.state_dict())
            # What Megatron, Bridge and Lightning pass is taken: chunks, a wrapper, a list of optimizers.
            wrapper = type("MegatronLike", (), {"optimizer": optimizer})()
            for good_model, good_optimizer in ((model, optimizer), ([model], wrapper), ((model,), [optimizer])):
                assert training_log(1, cfg, model=good_model, optimizer=good_optimizer) is not None
            # Off the logging iterations nothing is read: the gate stays a modulo.
            every_fourth = quiet_config(tensorboard_log_interval=4)
            assert training_log(1, every_fourth, model="model") is None
            with pytest.raises(TypeError, match=takes_model):  # the call before a logging iteration arms on it
                training_log(3, every_fourth, model="model")
            monitor.close()
    finally:
        close_writers()


def test_a_model_without_an_optimizer_logs_no_optimizer_state():
    import math
    import warnings

    import torch

    from nemo_memlog import close_writers, report_model_state, training_log

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    model(torch.ones(2, 64)).sum().backward()
    params = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    state = report_model_state(model)
    assert math.isnan(state["optimizer_state_gb"])  # missing, not 0
    assert state["model_state_gb"] == state["params_gb"] + state["grads_gb"] == 2 * params
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no writer configured
            logged = training_log(1, quiet_config(), model=model)
            assert logged["memory/params_gb"] == params and "memory/grads_gb" in logged
            assert not [key for key in logged if key.endswith("optimizer_state_gb")], sorted(logged)
            assert logged["memory/model_state_gb"] == logged["memory/params_gb"] + logged["memory/grads_gb"]
            optimizer = torch.optim.Adam(model.parameters())
            optimizer.step()
            logged = training_log(2, quiet_config(), model=model, optimizer=optimizer)
            assert logged["memory/optimizer_state_gb"] > 2 * params  # two moments (and the steps)
            assert logged["memory/pp_stage_0/optimizer_state_gb"] == logged["memory/optimizer_state_gb"]
    finally:
        close_writers()


if __name__ == "__main__":
    sys.exit(rank_main(*sys.argv[1:]))


def close_on_rank_zero_only():
    """Every rank calls close_writers() and logs again (fine); then rank 0 alone does (named)."""
    import torch.distributed as dist

    from nemo_memlog import LoggerConfig, close_writers, training_log

    cfg = LoggerConfig(
        log_memory_to_tensorboard=True, tensorboard_log_interval=2, memory_record_dir="off", memory_reduce_timeout_s=5
    )
    outcome = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        training_log(2, cfg)
        close_writers()  # every rank, at the same point: the next runs start together
        outcome["together"] = "memory/peak_host_rss_gb" in training_log(4, cfg)
        if dist.get_rank() == 0:
            close_writers()
        try:
            training_log(6, cfg)
            outcome["alone"] = "logged"
        except Exception as error:  # noqa: BLE001 -- what each rank was told is the result
            outcome["alone"] = f"{type(error).__name__}: {error}"
    return dist.get_rank(), outcome


@pytest.mark.processes
def test_close_writers_on_one_rank_is_named_not_a_crash():
    """gloo aborted the process (C++ terminate) when one rank restarted alone; now that rank is
    told what to do and its peer's wait is bounded. (A cluster of its own: a collective one rank
    abandoned leaves its group unusable, as after any MemoryReduceError.)"""
    from nemo_memlog.testing.cluster import Cluster

    with Cluster(world=2, pp=2) as cluster:
        seen = dict(cluster.run_ok(close_on_rank_zero_only))
    assert seen[0]["together"] is True and seen[1]["together"] is True
    alone = seen[0]["alone"]
    assert alone.startswith("MemoryReduceError: close_writers() has ended this rank's runs 2 time(s)"), alone
    assert "global rank(s) [1]" in alone and "call it on every rank at the same point" in alone
    assert seen[1]["alone"].startswith("MemoryReduceError:") and "not every rank joined" in seen[1]["alone"]

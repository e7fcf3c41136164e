"""torchrun for the tests, for real: ``python -m torch.distributed.run`` on this machine, its
ranks over gloo, started from the repository root.

    found = run_ranks(__file__, [str(out)], out, ranks=(0, 1))   # {rank: what rank-<r>.json holds}
    done = run(__file__, str(root), nproc=2, cgroup=group)        # a CompletedProcess, any exit status
    proc = start(demo, "train.iters=100000", nproc=4, env={...})   # running: signal it, then
    kill_group(proc)                                               # in a finally: nothing left behind

Every launch gets a free master port, ``torchrun_env()`` (this process's environment, the
repository root on PYTHONPATH, OMP_NUM_THREADS=1: two cores shared by every rank) and a session
of its own, so torchrun and all its ranks can be signalled at once (``os.killpg``), as SLURM
does, and none outlives a test that timed out. ``cgroup=`` (a ``cgroups.MemoryCgroup``) starts
torchrun inside that memory cgroup, its ranks with it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from nemo_memlog.testing.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]  # the repository: tests/ and scripts/ are below it
DEFAULT_TIMEOUT_S = 240.0
#: A line of a rank's error as torch.distributed's excepthook prints it.
RANK_ERROR = re.compile(r"^\[rank(\d+)\]:")


def torchrun_command(
    script, *args, nproc: int = 2, monitor_interval: float | None = None, prefix: Iterable[str] = ()
) -> list[str]:
    """torchrun's command line: ``nproc`` ranks of ``script args...``, on a free master port, after
    ``prefix`` (a launcher of launchers: ``nemo-memlog run --``). ``script`` may be ``-m`` and a
    module name its first argument."""
    command = [*prefix, sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    command += ["--master-port", str(free_port())]
    if monitor_interval is not None:  # how often torchrun polls its ranks, in seconds
        command += ["--monitor-interval", f"{monitor_interval:g}"]
    return [*command, str(script), *map(str, args)]


def torchrun_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository root first on PYTHONPATH (rank scripts import
    ``tests.*``; what was there stays after it: a GPU machine's megatron-core installed with
    ``--target``), OMP_NUM_THREADS=1, and ``extra``."""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def start(
    script,
    *args,
    nproc: int = 2,
    monitor_interval: float | None = None,
    env: dict[str, str] | None = None,
    cgroup=None,
    prefix: Iterable[str] = (),
    **popen,
) -> subprocess.Popen:
    """torchrun started and left running, in a session of its own (``os.killpg(proc.pid, ...)``
    reaches every rank), from the repository root; ``env`` adds to ``torchrun_env()``; ``popen``
    goes to Popen (stdout=, stderr=, text=). Pair it with ``kill_group`` in a ``finally``."""
    command = torchrun_command(script, *args, nproc=nproc, monitor_interval=monitor_interval, prefix=prefix)
    kwargs = {"cwd": ROOT, "env": torchrun_env(**(env or {})), "start_new_session": True, **popen}
    return cgroup.popen(command, **kwargs) if cgroup is not None else subprocess.Popen(command, **kwargs)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every rank of its session if it still runs, and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def run(
    script,
    *args,
    nproc: int = 2,
    monitor_interval: float | None = None,
    env: dict[str, str] | None = None,
    cgroup=None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    prefix: Iterable[str] = (),
) -> subprocess.CompletedProcess:
    """torchrun run to its end, its stdout and stderr captured (text); any exit status is returned.
    Past ``timeout_s`` the whole session is SIGKILLed and the test fails with the output's tail."""
    proc = start(
        script,
        *args,
        nproc=nproc,
        monitor_interval=monitor_interval,
        env=env,
        cgroup=cgroup,
        prefix=prefix,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process outside its session holds the pipes
            stdout, stderr = "", ""
        done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        raise AssertionError(f"torchrun did not end within {timeout_s:g} s:\n{tail(done)}") from None
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def tail(done: subprocess.CompletedProcess, chars: int = 3000) -> str:
    """What a failing test shows: the last ``chars`` of a run's stdout, then of its stderr, after
    the end of each rank's own error where the tail left it out (the lines torch.distributed's
    excepthook prefixes with ``[rank<r>]:``; a rank that failed first is often not the last to
    print)."""
    stdout, stderr = done.stdout or "", done.stderr or ""
    shown = stdout[-chars:] + stderr[-chars:]
    errors: dict[str, list[str]] = {}
    for line in (stdout + "\n" + stderr).splitlines():
        if (rank := RANK_ERROR.match(line)) and line not in shown:
            errors.setdefault(rank[1], []).append(line)
    before = "".join(
        f"[rank{rank}]'s error, its last lines:\n" + "\n".join(lines[-25:]) + "\n" for rank, lines in errors.items()
    )
    return before + shown


def read_ranks(out_dir) -> dict[int, dict]:
    """{rank: the JSON of ``out_dir/rank-<rank>.json``} for every such file there."""
    return {int(path.stem.split("-")[1]): json.loads(path.read_text()) for path in Path(out_dir).glob("rank-*.json")}


def run_ranks(
    script,
    args: Iterable,
    out_dir,
    *,
    nproc: int = 2,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    ranks: Iterable[int] | None = None,
    check: bool = False,
    cgroup=None,
) -> dict[int, dict]:
    """Run ``script args...`` under torchrun (``run``) and read what each rank wrote to
    ``out_dir/rank-<rank>.json``. Fails with the tail of torchrun's output when no rank wrote
    one, when the ranks that did are not ``ranks`` (if given), or (``check``) on an exit status
    other than 0."""
    done = run(script, *args, nproc=nproc, cgroup=cgroup, timeout_s=timeout_s)
    found = read_ranks(out_dir)
    if check:
        assert done.returncode == 0, f"torchrun exited with {done.returncode}:\n{tail(done)}"
    if ranks is None:
        assert found, f"no rank wrote {Path(out_dir) / 'rank-<rank>.json'}:\n{tail(done)}"
    else:
        assert sorted(found) == sorted(ranks), f"ranks {sorted(found)} wrote, not {sorted(ranks)}:\n{tail(done)}"
    return found

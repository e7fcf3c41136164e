"""What ``nemo-memlog run``'s bootstrap costs a Python process that imports no framework (pip, a
DataLoader or tokenizer worker, a spawn pool): its start against ``python -c pass`` without it.

    python scripts/bench_startup.py              # 200 interleaved rounds
    python scripts/bench_startup.py --reps 50 --json out.json

Per repetition, in a rotating order, one process each: ``python -c pass`` as the user's environment
has it (``base``); the same with the bootstrap folder first on ``PYTHONPATH`` as ``nemo-memlog run``
puts it (``bootstrap``: compiled at each start where no ``.pyc`` is cached, as under
``PYTHONDONTWRITEBYTECODE``); and with a copy of the folder whose ``.pyc`` is cached, as a pip install
writes it (``compiled``). Each child's CPU time (user + system) and peak RSS come
from ``os.wait4``'s rusage of that child alone; the medians, their difference and ratio are printed,
with the modules each process has loaded (none of nemo_memlog's may be). Run from an empty folder,
so no ``sitecustomize`` in the working folder is found by either.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import py_compile
import shutil
import statistics
import sys
import tempfile

from nemo_memlog.launch.run import BOOTSTRAP


def child(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, int]:
    """(CPU seconds, peak RSS in KiB) of one run of ``argv``, from its own rusage."""
    pid = os.fork()
    if pid == 0:  # the child: straight to exec, nothing of this process's Python run again
        try:
            os.chdir(cwd)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.execve(argv[0], argv, env)
        finally:
            os._exit(127)
    _, status, usage = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{argv} failed: {status}")
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss


def modules(env: dict[str, str], cwd: str) -> list[str]:
    """The modules a process with ``env`` has loaded when its code starts."""
    import subprocess

    probe = "import sys; print(' '.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=cwd, capture_output=True, text=True, check=True)
    return done.stdout.split()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    base = dict(os.environ)
    user_path = base.get("PYTHONPATH", "")
    ours = {**base, "PYTHONPATH": os.pathsep.join(filter(None, [str(BOOTSTRAP), user_path]))}
    with tempfile.TemporaryDirectory() as cwd, tempfile.TemporaryDirectory() as copies:
        compiled_dir = shutil.copytree(BOOTSTRAP, os.path.join(copies, "autorun"))
        source = os.path.join(compiled_dir, "sitecustomize.py")
        py_compile.compile(source, cfile=importlib.util.cache_from_source(source), doraise=True)
        compiled = {**base, "PYTHONPATH": os.pathsep.join(filter(None, [compiled_dir, user_path]))}
        variants = {"base": base, "bootstrap": ours, "compiled": compiled}
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        rss: dict[str, list[int]] = {name: [] for name in variants}
        for env in variants.values():  # warm the page cache and the path caches alike
            child([sys.executable, "-c", "pass"], env, cwd)
        for rep in range(args.reps):
            names = list(variants)
            for name in names[rep % 3 :] + names[: rep % 3]:
                seconds, kib = child([sys.executable, "-c", "pass"], variants[name], cwd)
                cpu[name].append(seconds)
                rss[name].append(kib)
        loaded = {name: modules(env, cwd) for name, env in variants.items()}
    median = {name: statistics.median(values) * 1000 for name, values in cpu.items()}
    added = sorted(set(loaded["bootstrap"]) - set(loaded["base"]))
    result = {
        "python": sys.version.split()[0],
        "reps": args.reps,
        "cpu_ms_median": median,
        "cpu_ms_added": {name: median[name] - median["base"] for name in ("bootstrap", "compiled")},
        "ratio": {name: median[name] / median["base"] for name in ("bootstrap", "compiled")},
        "rss_kib_median": {name: statistics.median(values) for name, values in rss.items()},
        "modules": {name: len(names) for name, names in loaded.items()},
        "modules_added": added,
        "nemo_memlog_loaded": [name for name in loaded["bootstrap"] if name.startswith("nemo_memlog")],
    }
    added_ms, ratio = result["cpu_ms_added"], result["ratio"]
    rss_mib = {name: kib / 1024 for name, kib in result["rss_kib_median"].items()}
    print(
        f"python -c pass, {args.reps} interleaved rounds: {median['base']:.1f} ms CPU without; with the bootstrap "
        f"{median['bootstrap']:.1f} ms (+{added_ms['bootstrap']:.1f} ms, x{ratio['bootstrap']:.3f}), its .pyc cached "
        f"{median['compiled']:.1f} ms (+{added_ms['compiled']:.1f} ms, x{ratio['compiled']:.3f}); "
        f"peak RSS {rss_mib['base']:.1f} -> {rss_mib['bootstrap']:.1f} MiB; "
        f"modules {result['modules']['base']} -> {result['modules']['bootstrap']} (added: {', '.join(added) or 'none'})"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

import contextlib
import ctypes.util
import functools
import multiprocessing.util
import os
import platform
import resource
import sys
import sysconfig
import time

import pytest

from nemo_memlog.testing.cluster import Cluster
from nemo_memlog.testing.tmp import private_tmpdir

_session_tmp = contextlib.ExitStack()
_roots: list = []  # pytest's temporary root of this session (pytest-of-<user>)


@pytest.hookimpl(trylast=True)  # after pytest's own tmp path plugin has set up
def pytest_configure(config):
    """One TMPDIR for the whole session, this process and every process it starts, under
    pytest's own temporary root: what they leave there (W&B's tmp*wandb-media folders, from
    processes that end without atexit) goes with it at the end, or with pytest's rotation of
    old roots if the session dies. Set before collection, so imports at collection land there."""
    factory = getattr(config, "_tmp_path_factory", None)  # the object tmp_path_factory returns
    base = factory.getbasetemp() if factory is not None else None
    _roots.append(base.parent if base is not None else None)
    # Multiprocessing's own folder (the forkserver's socket, for testing.cluster) made first, in the
    # system's: multiprocessing removes it at exit, after this session's private one is gone.
    multiprocessing.util.get_temp_dir()
    folder = _session_tmp.enter_context(private_tmpdir(base))
    # W&B's data folder (~/.local/share/wandb) there too: a file added to an artifact is copied to its
    # artifacts/staging, and an offline run, never uploaded, never removes the copy (Megatron-LM adds
    # its checkpoint tracker file at every save). A test's own setting replaces this one.
    os.environ["WANDB_DATA_DIR"] = str(folder / "wandb-data")


def pytest_unconfigure(config):
    _session_tmp.close()
    # A green session leaves pytest's own root (pytest-of-<user>) empty: take it away too, so the
    # system's temporary folder is as it was. A root still holding a run (a failed one) stays.
    for root in _roots:
        with contextlib.suppress(OSError):
            if root is not None:
                root.rmdir()


#: The files that take longest (tests/conftest.py's summary measures them), longest first; the rest
#: follow in pytest's own order. `make test` hands whole files to its two pytest-xdist workers in
#: this order (--dist loadfile --no-loadscope-reorder): the long files start at once, the short ones
#: fill the gaps, and neither worker sits idle at the end while the other runs a long one.
LONGEST_FIRST = (
    *("test_fit.py", "test_megatron_lm.py", "test_demo.py", "test_readme.py", "test_lightning.py", "test_versions.py"),
    *("test_teardown.py", "test_megatron.py", "writers/test_process.py", "test_bridge.py"),
    *("test_postmortem_e2e.py", "test_sigterm.py", "writers/test_isolation.py", "test_inputs.py", "test_misuse.py"),
)


def pytest_collection_modifyitems(items):
    first = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(first)))


@pytest.fixture(scope="session")
def pp2dp2():
    """World 4 = PP 2 x DP 2: PP groups {0,2} and {1,3} are proper subgroups."""
    with Cluster(world=4, pp=2) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def pp4():
    """World 4 = PP 4: one PP group of every rank."""
    with Cluster(world=4, pp=4) as cluster:
        yield cluster


#: The audit events (PEP 578) that starting a process raises: ``subprocess`` (and so torchrun and
#: every ``subprocess.run``), ``os.fork`` (multiprocessing's fork context), ``os.system`` and the
#: rest. Multiprocessing's spawn and forkserver contexts start theirs through
#: ``_posixsubprocess.fork_exec``, which raises none: ``_watch_multiprocessing`` wraps those paths.
PROCESS_EVENTS = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system"}
)
_MARK_HINT = "without @pytest.mark.processes: mark it (make test-fast runs unmarked tests)"


class _Lanes:
    """The test in a phase now (setup, call or teardown), whether it may start processes, and the
    first process it started without leave."""

    item: pytest.Item | None = None
    allowed = True  # outside a test phase (collection, session start and end) nothing is checked
    event: str | None = None
    unmarked: dict[str, str] = {}  # this session's failures: nodeid -> the event, for the summary


#: Where a library runs a short helper command of its own, for whichever test is the first to need
#: it (the answer is kept for the rest of the process): ctypes.util.find_library runs ldconfig
#: (torch's and the backends' libraries look theirs up), platform runs ``uname -p`` (MLflow's telemetry
#: asks), W&B runs git to name the program's repository, and megatron-core runs ``git rev-parse``
#: on its first import (its version's suffix). Not the processes the lanes are about.
HELPER_COMMANDS = (
    ctypes.util.__file__,
    platform.__file__,
    os.path.join("wandb", "sdk", "lib", "gitlib.py"),
    os.path.join("megatron", "core", "package_info.py"),
)


def _started(event: str) -> None:
    # Called from inside the operation that starts the process, in whatever thread starts it:
    # only note it here (an exception would break the start); the phase's wrapper fails the test.
    if not _Lanes.allowed and _Lanes.event is None:
        where = _caller()
        if where is not None:
            _Lanes.event = f"{event} from {where}"


def _caller() -> str | None:
    """Where the process was asked for (the innermost frame outside the standard library and this
    file), or None where it is a library's helper command (``HELPER_COMMANDS``)."""
    stdlib, found = sysconfig.get_paths()["stdlib"], None
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.endswith(HELPER_COMMANDS):
            return None
        if found is None and not name.startswith(stdlib) and name != __file__ and not name.startswith("<"):
            found = f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return found or "?"


def _audit(event: str, args: tuple) -> None:
    if event in PROCESS_EVENTS:
        _started(event)


def _watch_multiprocessing() -> None:
    """Multiprocessing's own process starts, which raise no audit event under spawn or forkserver:
    every ``Process.start`` (and so ``torch.multiprocessing.spawn``), and the helper processes it
    starts through ``util.spawnv_passfds`` (a spawned child, the forkserver, the resource tracker)."""
    import multiprocessing.process
    import multiprocessing.util

    start = multiprocessing.process.BaseProcess.start
    spawnv_passfds = multiprocessing.util.spawnv_passfds

    @functools.wraps(start)
    def watched_start(self):
        _started("multiprocessing.Process.start")
        return start(self)

    @functools.wraps(spawnv_passfds)
    def watched_spawnv_passfds(*args, **kwargs):
        _started("multiprocessing.util.spawnv_passfds")
        return spawnv_passfds(*args, **kwargs)

    multiprocessing.process.BaseProcess.start = watched_start
    multiprocessing.util.spawnv_passfds = watched_spawnv_passfds


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    # An audit hook cannot be taken away again: one per process, even if pytest runs again in it.
    if not getattr(sys, "_nemo_memlog_lanes_watched", False):
        sys.addaudithook(_audit)
        _watch_multiprocessing()
        sys._nemo_memlog_lanes_watched = True  # type: ignore[attr-defined]
    _Lanes.unmarked = {}


def _watched(item: pytest.Item):
    """One phase of one test, watched: a test without the ``processes`` marker that starts a process
    in it fails there, naming the first way it did. A marked test is never touched."""
    _Lanes.item, _Lanes.allowed, _Lanes.event = item, item.get_closest_marker("processes") is not None, None
    try:
        result = yield
    except (KeyboardInterrupt, SystemExit, pytest.exit.Exception):
        _Lanes.item, _Lanes.allowed, _Lanes.event = None, True, None
        raise
    except BaseException:  # the phase failed or skipped: still told, in place of its own outcome
        _fail_if_started(item)
        raise
    _fail_if_started(item)
    return result


def _fail_if_started(item: pytest.Item) -> None:
    event = _Lanes.event
    _Lanes.item, _Lanes.allowed, _Lanes.event = None, True, None
    if event is not None:
        _Lanes.unmarked.setdefault(item.nodeid, event)
        pytest.fail(f"{item.nodeid} started a process ({event}) {_MARK_HINT}", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _watched(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _watched(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _watched(item))


class _Costs:
    """Where the suite's time goes: per test (setup, call and teardown), its wall seconds, this
    process's CPU and its reaped child processes' CPU (RUSAGE_CHILDREN: torchrun, clusters, subprocesses).
    Measured where the test runs, carried on its teardown report (``user_properties``), so that the
    process printing the summary (pytest's own, or pytest-xdist's controller) has every worker's."""

    started: dict[str, tuple[float, float, float]] = {}
    tests: dict[str, tuple[float, float, float]] = {}


COSTS = "nemo_memlog_costs"


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _now() -> tuple[float, float, float]:
    return time.monotonic(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid, location):
    _Costs.started[nodeid] = _now()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    began = _Costs.started.get(item.nodeid)
    if report.when == "teardown" and began is not None:
        report.user_properties.append((COSTS, tuple(now - then for now, then in zip(_now(), began))))
    return report


def pytest_runtest_logreport(report):
    for name, costs in report.user_properties:
        if name == COSTS:
            _Costs.tests[report.nodeid] = costs


def _cost_lines() -> list[str]:
    """Per file, then the 15 tests whose child processes cost most CPU."""
    files: dict[str, list[float]] = {}
    for nodeid, costs in _Costs.tests.items():
        total = files.setdefault(nodeid.split("::")[0], [0.0, 0.0, 0.0])
        for index, value in enumerate(costs):
            total[index] += value
    lines = [f"{'wall s':>8}{'own CPU s':>11}{'child CPU s':>13}  file"]
    for name, (wall, own, children) in sorted(files.items(), key=lambda entry: -entry[1][0]):
        lines.append(f"{wall:8.1f}{own:11.1f}{children:13.1f}  {name}")
    wall, own, children = (sum(costs[index] for costs in files.values()) for index in range(3))
    lines.append(f"{wall:8.1f}{own:11.1f}{children:13.1f}  all files (wall: summed over pytest-xdist's workers)")
    lines.append("(children: the processes this one and its descendants reaped; not testing.Cluster's ranks, which")
    lines.append("its forkserver reaps at the session's end, nor any process its parent never waited for)")
    lines += ["", "the 15 tests whose child processes cost most CPU:"]
    for nodeid, (wall, own, children) in sorted(_Costs.tests.items(), key=lambda entry: -entry[1][2])[:15]:
        lines.append(f"{wall:8.1f}{own:11.1f}{children:13.1f}  {nodeid}")
    return lines


def pytest_terminal_summary(terminalreporter):
    if _Costs.tests and len(_Costs.tests) > 20:  # a whole file or more: where the time went
        terminalreporter.section("where the time goes (tests/conftest.py: wall, this process's CPU, children's CPU)")
        for line in _cost_lines():
            terminalreporter.line(line)
    if _Lanes.unmarked:
        terminalreporter.section("tests that started a process without @pytest.mark.processes")
        for nodeid, event in _Lanes.unmarked.items():
            terminalreporter.line(f"{nodeid}: {event}")

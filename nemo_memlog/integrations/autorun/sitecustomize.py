"""nemo-memlog bootstrap: ``nemo-memlog run``'s ``sitecustomize``, which Python's ``site`` runs at the
start of every process of the command (this folder is first on ``PYTHONPATH``).

1. The user's own ``sitecustomize`` (module or package), the next one on ``sys.path`` that is not a
   copy of this one, runs once, as ``sitecustomize`` in ``sys.modules`` (ddtrace's way); an error in
   it shows as Python shows it, and the rest goes on.
2. Then, unless ``NEMO_MEMLOG_DISABLED`` says so, an import hook that waits for the frameworks'
   modules (``WATCHED``). Until one is imported nothing of nemo_memlog is: a process that imports
   no framework (pip, a DataLoader worker, a tokenizer) pays a dict look-up per import. When one has
   loaded, integrations/instrument.py adds its way in.

Whatever goes wrong here (a bad ``NEMO_MEMLOG_*`` value, a Python without nemo_memlog, an error in
the hook) is one notice on the ``nemo_memlog`` logger, and the program runs as without us. Any
number of copies of this folder on the path (a symlink, a second install) activate once. Only
``sys``, ``os`` and the import system's own modules are used here (all loaded before ``site``).
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing is not imported at start-up; mypy reads the names below
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

#: What tells a copy of this file from a user's sitecustomize: in its first line.
MARK = b"nemo-memlog bootstrap"
#: Module -> the way in added once it has loaded (instrument.py's WAYS_IN names them).
WATCHED = {
    "megatron.training.training": "megatron_lm",
    "megatron.bridge.training.pretrain": "bridge",
    "megatron.bridge.training.finetune": "bridge",
    "lightning.pytorch.trainer.trainer": "lightning",
    "pytorch_lightning.trainer.trainer": "lightning",
}
#: The switches, read in every process (docs/megatron_lm.md, "Switches").
DISABLED_ENV = "NEMO_MEMLOG_DISABLED"
DISABLED_WAYS_ENV = "NEMO_MEMLOG_DISABLED_INTEGRATIONS"
CPU_STAND_INS_ENV = "NEMO_MEMLOG_CPU_STAND_INS"
TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off", "")
#: The first package of a framework the CPU stand-ins patch before it loads (typing.override on 3.11),
#: and the module after which they are installed (whether or not its way in is).
CPU_FIRST = "megatron"
CPU_LOOP = "megatron.training.training"
#: sys.modules' key for this process's bootstrap, once one has started: its ``chained`` holds the
#: user's sitecustomize files already run, so another copy (or a chaining tool's import) skips them.
ACTIVE = "_nemo_memlog_bootstrap"


def _notice(message, *args):
    """One line on the nemo_memlog logger (the logging module is loaded only here, on trouble)."""
    try:
        import logging

        logging.getLogger("nemo_memlog").warning(message, *args)
    except Exception:  # noqa: BLE001, S110 -- nothing raises into the user's program
        pass


def _ours(origin):
    """Whether the file ``origin`` is a copy of this bootstrap (its first line holds MARK)."""
    try:
        with open(origin, "rb") as file:
            return MARK in file.readline(256)
    except OSError:
        return False


def _users_spec(skip):
    """The spec of the sitecustomize Python would run without this folder: the first on sys.path that
    is no copy of this one and not in ``skip`` (origins already run). None if there is none."""
    from _frozen_importlib_external import PathFinder

    for entry in list(sys.path):
        spec = PathFinder.find_spec("sitecustomize", [entry])
        if spec is None or spec.loader is None or not spec.origin or spec.origin in skip:
            continue
        if spec.origin.endswith(".py") and _ours(spec.origin):
            continue
        return spec
    return None


def run_users_sitecustomize(chained: set) -> None:
    """Run the user's sitecustomize as ``import sitecustomize`` would, once (``chained``: the origins
    run so far, added to): it is ``sys.modules["sitecustomize"]`` afterwards; an Exception in it is
    printed as ``site`` prints one, a failed module is not kept. Never raises an Exception."""
    from _frozen_importlib import module_from_spec

    spec = _users_spec(chained)
    if spec is None:
        return
    chained.add(spec.origin)
    ours = sys.modules.get("sitecustomize")
    module = module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 -- shown as site shows it; the rest of the start goes on
        if sys.modules.get("sitecustomize") is module:
            if ours is None:
                del sys.modules["sitecustomize"]
            else:
                sys.modules["sitecustomize"] = ours
        _as_site_shows(error)


def _as_site_shows(error):
    if sys.flags.verbose:
        sys.excepthook(type(error), error, error.__traceback__)
    elif sys.stderr is not None:
        try:
            sys.stderr.write(
                f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(error).__name__}: {error}\n"
            )
        except Exception:  # noqa: BLE001, S110 -- a closed or full stderr
            pass


def switches(environ: Mapping[str, str]) -> tuple[dict[str, str], bool]:
    """(the watched modules this process instruments, whether the CPU stand-ins are on), from the
    switches in ``environ``; ({}, False) when NEMO_MEMLOG_DISABLED says so. A value it cannot read is
    one notice: a bad NEMO_MEMLOG_DISABLED turns everything off, an unknown way in is ignored."""
    disabled = environ.get(DISABLED_ENV, "").strip().lower()
    if disabled not in FALSE_WORDS:
        if disabled not in TRUE_WORDS:
            _notice("nemo_memlog: %s=%r is not true or false: memory logging is off", DISABLED_ENV, disabled)
        return {}, False
    excluded = {name.strip().lower() for name in environ.get(DISABLED_WAYS_ENV, "").split(",") if name.strip()}
    unknown = excluded - set(WATCHED.values())
    if unknown:
        _notice(
            "nemo_memlog: %s names %s, which is no way in (they are %s): ignored",
            DISABLED_WAYS_ENV,
            ", ".join(sorted(unknown)),
            ", ".join(sorted(set(WATCHED.values()))),
        )
    cpu = environ.get(CPU_STAND_INS_ENV, "").strip().lower()
    if cpu not in TRUE_WORDS + FALSE_WORDS:
        _notice("nemo_memlog: %s=%r is not true or false: no CPU stand-ins", CPU_STAND_INS_ENV, cpu)
    watched = {name: way for name, way in WATCHED.items() if way not in excluded}
    return watched, cpu in TRUE_WORDS


class _Added:
    """A watched module's own loader, then its way in (never raising into the import)."""

    def __init__(self, loader, way_in, watch):
        self.loader, self.way_in, self.watch = loader, way_in, watch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            from nemo_memlog.integrations import instrument
        except Exception as error:  # noqa: BLE001 -- another Python, without nemo_memlog
            _notice("nemo_memlog: %s runs without memory logging: %s cannot import nemo_memlog (%r)",
                    module.__name__, sys.executable, error)  # fmt: skip
            return
        cpu = self.watch.cpu and module.__name__ == CPU_LOOP
        instrument.add_way_in(module, self.way_in, cpu_stand_ins=cpu, said=self.watch.said)

    def __getattr__(self, name):  # get_source, get_filename, is_package...: the module's own loader's
        return getattr(self.loader, name)


class Watch:
    """A meta path finder that finds nothing itself: for a watched module, the spec the other finders
    give, its loader followed by the way in. One dict look-up for any other import."""

    def __init__(self, watched: dict[str, str], cpu: bool):
        self.watched, self.cpu = watched, cpu
        self.said: set[str] = set()  # the notices said in this process (instrument.py's), once each

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name not in self.watched and not (self.cpu and name in (CPU_FIRST, CPU_LOOP)):
            return None
        try:
            return self._spec(name, path, target)
        except Exception as error:  # noqa: BLE001 -- the import goes on as without us
            _notice("nemo_memlog: the import hook failed on %s (%r); it runs without memory logging", name, error)
            return None

    def _spec(self, name, path, target):
        if name == CPU_FIRST:
            _typing_override()
            return None
        for finder in sys.meta_path:
            if isinstance(finder, Watch) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Added(spec.loader, self.watched.get(name), self)
                return spec
        return None


def _typing_override():
    """Python 3.11 has no typing.override, which megatron-core 0.17+ imports (3.12's): the CPU
    stand-ins' first one, before megatron loads."""
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def main() -> None:
    """The bootstrap's start, once per process: a second copy (or a chaining tool importing
    ``sitecustomize`` again) only runs a user's sitecustomize not run yet."""
    active = sys.modules.get(ACTIVE)
    if active is not None:
        run_users_sitecustomize(vars(active)["chained"])
        return
    here = sys.modules.get(__name__)
    if here is None:  # run in an odd way (exec of the file): no state to share
        return
    chained: set[str] = set()
    vars(here)["chained"] = chained
    sys.modules[ACTIVE] = here
    try:
        run_users_sitecustomize(chained)
    finally:
        watched, cpu = switches(os.environ)
        if watched or cpu:
            sys.meta_path.insert(0, Watch(watched, cpu))


if __name__ == "sitecustomize":  # as the bootstrap; imported by its package name (tests), only the tables
    try:
        main()
    except Exception as error:  # noqa: BLE001 -- nothing raises into the user's program
        _notice("nemo_memlog: the bootstrap failed (%r); this process runs without memory logging", error)

"""The commands the package prints (in-run notes, report footers, the demo's closing lines),
in the form that runs when pasted into a shell, and the exit statuses of the ``nemo-memlog``
commands, named once. No torch: the offline reader uses it too.

A virtual environment's console scripts are usually not on PATH: ``nemo-memlog`` printed bare
gives "command not found" unless the environment is active. So a console script of this
Python's environment is printed bare only when PATH finds that same file, and as its path
otherwise (relative to the working directory when below it, as ``.venv/bin/nemo-memlog``).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

# The exit statuses of the ``nemo-memlog`` commands: one name per meaning (docs/fit.md, docs/postmortem.md).
#: The command did what was asked: a report, an answer, no failure found.
DONE = 0
#: ``postmortem``: a rank failed (the first failure is named); ``fit``: it cannot tell (a probe could not
#: measure, the command's batch is not as fit needs).
FOUND_FAILURE = CANNOT_TELL = 1
#: The input cannot be used: an unknown option, no COMMAND, unreadable records; the message says what to change.
USAGE_ERROR = 2
#: ``fit``: even the smallest size does not fit (what would instead is listed).
NOTHING_FITS = 2
#: Ended by a signal: the shell's 128 + the signal's number, without a traceback.
INTERRUPTED = {"SIGINT": 130, "SIGTERM": 143}
#: The reader went away (``nemo-memlog postmortem RUN | head``): the shell's status for SIGPIPE, 128 + 13.
CLOSED_PIPE = 141


def console_command(name: str) -> str:
    """``name`` (a console script: nemo-memlog, tensorboard, torchrun, ...) as it runs when printed."""
    here = Path(sys.executable).parent / name
    if not here.exists():
        return name  # not installed in this environment: whatever PATH finds, or the user installs
    found = shutil.which(name)
    if found and os.path.realpath(found) == os.path.realpath(here):
        return name
    relative = os.path.relpath(here)
    return relative if not relative.startswith("..") else str(here)


def postmortem_command(folder: str | os.PathLike[str]) -> str:
    """The post-mortem of the flight records under ``folder``, as it runs when printed."""
    return f"{console_command('nemo-memlog')} postmortem {folder}"


def report_command(folder: str | os.PathLike[str]) -> str:
    """The per-stage report of the run under ``folder``, as it runs when printed."""
    return f"{console_command('nemo-memlog')} report {folder}"

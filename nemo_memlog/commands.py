"""The commands the package prints (in-run notes, report footers, the demo's closing lines),
in the form that runs when pasted into a shell. No torch: the offline reader uses it too.

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

"""A private temporary folder for a test session or a benchmark run, removed with all it holds.

Libraries make folders in ``tempfile.gettempdir()`` and count on an atexit hook to remove
them: W&B makes ``tmp*wandb-media`` and ``tmp*wandb-artifacts`` when its modules are imported.
A process that ends without running atexit (a multiprocessing child, ``os._exit``, a signal)
leaves them in /tmp. ``private_tmpdir`` points ``TMPDIR`` (which child processes inherit) and
tempfile's default at one new folder, and removes that folder at the end, whoever made what
is in it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def private_tmpdir(parent: str | os.PathLike | None = None, prefix: str = "nemo_memlog-tmp-") -> Iterator[Path]:
    """A new folder under ``parent`` (default: the temporary folder in force) as ``TMPDIR`` and
    ``tempfile.tempdir`` inside the block; both restored, and the folder removed, on the way out."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    saved_env, saved_default = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(folder)
    try:
        yield folder
    finally:
        tempfile.tempdir = saved_default
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        shutil.rmtree(folder, ignore_errors=True)

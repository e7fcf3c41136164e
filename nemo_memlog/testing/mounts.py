"""Folders mounted for a test (as root; the test is skipped where mounting is not allowed): a tmpfs
of a given size (a full disk), a folder bind-mounted read-only onto itself."""

import contextlib
import subprocess

import pytest


@contextlib.contextmanager
def mounted(target, *options):
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", *options, str(target)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


@contextlib.contextmanager
def read_only(folder):
    """``folder`` bind-mounted read-only onto itself."""
    with mounted(folder, "--bind", str(folder)):
        done = subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot remount read-only: {done.stderr.strip()}")
        yield folder

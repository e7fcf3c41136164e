"""The guard between ``nemo-memlog fit`` and one probe: a small stdlib-only process that outlives fit,
however fit ends, and ends everything the probe started.

Why a process of its own: the kernel's parent-death signal (PR_SET_PDEATHSIG) reaches one process,
the direct child, and a wrapper script or a launcher killed outright passes nothing on; a setsid
daemon or a worker that ignores SIGTERM is beyond any signal fit sends before it dies. The guard is
the child subreaper (PR_SET_CHILD_SUBREAPER) of the probe, so every orphan of the tree (a
launcher's workers, a daemon that double-forked) is re-parented to it and stays findable from its
/proc parent links. It watches a pipe from fit, whose end closes when fit exits, even by SIGKILL:

    control (fit -> guard)  b"T": end the tree (SIGTERM, SIGKILL after the grace);
                            b"K": SIGKILL what is left now (a second Ctrl-C);
                            end of file: fit is gone: end the tree, then remove the scratch folder
    status (guard -> fit)   "exit N\\n" once the command's first process ended (N as Popen's
                            returncode: -signal for a signal)

The guard exits, once nothing of the tree is left; fit waits for that exit. Run without a command,
it only removes the scratch folder should fit end without saying so. Its own parent-death signal
(SIGTERM) is a second way to learn that fit is gone. One file, both sides: fit's (``Guarded``) and
the guard's (``main``), run as ``python -I guard.py`` (stdlib only; no package import, no torch).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

#: prctl(2) options (linux/prctl.h).
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
END, KILL = b"T", b"K"
#: How often the guard looks at its pipe, its children and the tree while it ends the tree; while
#: the probe runs (a word from fit wakes it at once), as often as fit looks at the probe's records.
TICK_S = 0.05
WAIT_S = 0.2
#: After SIGKILL, how long the guard waits for a process in the kernel's hands (uninterruptible
#: sleep) before sending it again.
KILL_AGAIN_S = 1.0


def prctl(option: int, value: int) -> bool:
    """prctl(2) on this process (Linux); whether it took."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Make this process the subreaper of its descendants (Linux); whether it could."""
    return prctl(PR_SET_CHILD_SUBREAPER, 1)


# ---- the process tree, from /proc ---------------------------------------------------------------


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...); None: gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, ended but not yet reaped, does not)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def descendants(root: int = 0) -> list[int]:
    """The processes below ``root`` (0: this process), from /proc's parent links; zombies too."""
    root = root or os.getpid()
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        fields = stat_fields(int(entry)) if entry.isdigit() else None
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_all(signum: int, pids: list[int]) -> None:
    """``signum`` to each of ``pids`` and to each one's process group (never this process's own)."""
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            continue
    groups.discard(os.getpgrp())
    for group in groups:
        try:
            os.killpg(group, signum)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:  # one that left its group
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


# ---- fit's side ---------------------------------------------------------------------------------


class Guarded:
    """``command`` started under a guard, in ``env``; with ``command`` empty, a guard of ``scratch``
    alone. ``stdout``: the pipe of the command's output (stdout and stderr together), where
    ``output``. ``scratch``, where given, is removed by the guard should fit end without ``end()``.
    Raises OSError where the guard cannot start."""

    def __init__(self, command: list[str], env: dict, grace_s: float, scratch: Path | None = None, output: bool = True):
        control_read, self.control = os.pipe()
        self.status, status_write = os.pipe()
        guard = [sys.executable, "-I", __file__, "--control", str(control_read), "--status", str(status_write)]
        guard += ["--parent", str(os.getpid()), "--grace-s", repr(float(grace_s))]
        guard += ["--scratch", str(scratch)] if scratch is not None else []
        try:
            self.proc = subprocess.Popen(
                [*guard, "--", *command],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if output else subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                pass_fds=(control_read, status_write),
                start_new_session=True,  # a Ctrl-C at the terminal is fit's to handle
            )
        except OSError:
            os.close(self.control)
            os.close(self.status)
            raise
        finally:
            os.close(control_read)
            os.close(status_write)
        os.set_blocking(self.status, False)
        self.stdout = self.proc.stdout
        self.exit_code: int | None = None
        self.received = b""

    def poll(self) -> int | None:
        """The command's exit status once its first process ended (its other processes may run on:
        ``end()`` ends them); the guard's own where it died first; else None. Never blocks."""
        if self.exit_code is None:
            try:
                self.received += os.read(self.status, 4096)
            except (BlockingIOError, OSError):
                pass
            for line in self.received.decode(errors="replace").splitlines():
                if line.startswith("exit "):
                    self.exit_code = int(line.split()[1])
        if self.exit_code is None and self.proc.poll() is not None:
            self.exit_code = self.proc.returncode
        return self.exit_code

    def end(self) -> KeyboardInterrupt | None:
        """Ask the guard to end the command's every process (the grace, then SIGKILL) and wait until
        it has. A KeyboardInterrupt during the wait (a second Ctrl-C or SIGTERM) makes it SIGKILL
        now and the wait goes on: the tree is never abandoned. Returns the first such interrupt,
        for the caller to raise where none was on its way already; never raises it."""
        interrupt, word = None, END
        while True:
            try:
                self._say(word)
                self.proc.wait()
                break
            except KeyboardInterrupt as caught:
                interrupt, word = interrupt or caught, KILL
        for descriptor in (self.control, self.status):
            try:
                os.close(descriptor)
            except OSError:
                pass
        return interrupt

    def _say(self, word: bytes) -> None:
        try:
            os.write(self.control, word)
        except OSError:  # the guard has gone already
            pass


# ---- the guard's side ---------------------------------------------------------------------------


class _Guard:
    def __init__(self, options: argparse.Namespace):
        self.options = options
        self.control: int | None = options.control  # None once fit's end closed
        self.fit_gone = False
        self.kill_now = False
        self.asked = False  # an end was asked for: a word, or a signal
        self.child: subprocess.Popen | None = None

    def asked_to_end(self, signum, frame) -> None:
        self.asked = True

    def listen(self, wait_s: float = TICK_S) -> None:
        """One look at the pipe from fit (a ``wait_s`` wait at most): its words and its end."""
        if self.control is None:
            time.sleep(wait_s)
            return
        ready, _, _ = select.select([self.control], [], [], wait_s)
        if not ready:
            return
        try:
            words = os.read(self.control, 64)
        except OSError:
            words = b""
        if not words:
            os.close(self.control)
            self.control, self.fit_gone, self.asked = None, True, True
            return
        self.asked = True
        self.kill_now = self.kill_now or KILL in words

    def start(self, command: list[str]) -> None:
        try:
            self.child = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM),  # should the guard die
            )
        except OSError as error:
            print(f"nemo-memlog fit: cannot run {command[0]!r}: {error.strerror or error}", file=sys.stderr, flush=True)
            self.report(127)

    def report(self, code: int) -> None:
        try:
            os.write(self.options.status, f"exit {code}\n".encode())
        except OSError:  # fit has gone
            pass

    def reap(self) -> None:
        """Collect every ended child (orphans re-parented here too), reporting the command's end."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.child is not None and pid == self.child.pid:
                self.child.returncode = os.waitstatus_to_exitcode(status)
                self.report(self.child.returncode)

    def end_tree(self) -> None:
        """SIGTERM to every process of the tree (one that appears later too), SIGKILL to what is left
        after the grace or once fit says so; returns when none is left, every one reaped."""
        signaled: set[int] = set()
        deadline = time.monotonic() + self.options.grace_s
        killed_at = None
        while True:
            self.reap()
            left = [pid for pid in descendants() if alive(pid)]
            if not left:
                return
            now = time.monotonic()
            if self.kill_now or now > deadline:
                if killed_at is None or now - killed_at > KILL_AGAIN_S or set(left) - signaled:
                    signal_all(signal.SIGKILL, left)
                    signaled.update(left)
                    killed_at = now
            elif set(left) - signaled:
                signal_all(signal.SIGTERM, left)
                signaled.update(left)
            self.listen()

    def scratch_goes(self) -> bool:
        return self.options.scratch is not None and (self.fit_gone or os.getppid() != self.options.parent)


def _options(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nemo-memlog-fit-guard")
    parser.add_argument("--control", type=int, required=True)
    parser.add_argument("--status", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--grace-s", type=float, default=30.0)
    parser.add_argument("--scratch", type=Path, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    options.command = options.command[1:] if options.command[:1] == ["--"] else options.command
    return options


def main(argv: list[str]) -> int:
    options = _options(argv)
    guard = _Guard(options)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, guard.asked_to_end)
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    become_subreaper()
    if os.getppid() != options.parent:  # fit died before the line above
        guard.fit_gone = guard.asked = True
    if options.command and not guard.asked:
        guard.start(options.command)
    while not guard.asked:
        guard.reap()
        guard.listen(WAIT_S)
    if options.command:
        guard.end_tree()
    if guard.scratch_goes():
        shutil.rmtree(options.scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

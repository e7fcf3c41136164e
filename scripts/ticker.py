"""A line at least every TICK_S seconds of a long step of set-up and of the demo's start: what is
being installed or started, and how far (issue 57: pip's install phase was silent for 157 s).

    with ticking("demo.py: importing megatron-core"):     # a line now, then one every TICK_S s
        ...
    pip install ... 2>&1 | python ticker.py pip VENV --hide RE --show RE   # make setup: pip's lines
    python ticker.py check VENV CONSTRAINTS              # make setup's import check, a line per step
    python ticker.py run "LABEL" -- COMMAND ...          # COMMAND's exit status, a line every TICK_S s

The standard library only (it runs in an environment being built), and never the reason set-up
fails: the pip filter reads its input to the end and exits 0 whatever goes wrong in it, and a ticker
that cannot print stops printing, not the step.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import TextIO

#: The longest a step goes without a line (the promise is 10 s; this leaves room for a loaded machine).
TICK_S = 8.0
#: pip's lines are cut to this width (its resolver notes run to hundreds of characters).
WIDTH = 150


def say(text: str, stream: TextIO | None = None) -> None:
    """Print one line and flush it; a closed or broken stream is not our step's failure."""
    with contextlib.suppress(Exception):
        print(text, file=stream or sys.stderr, flush=True)


def _seconds(start: float) -> str:
    return f"{time.monotonic() - start:.0f} s"


@contextlib.contextmanager
def ticking(
    what: str, stream: TextIO | None = None, every: float = TICK_S, until: Callable[[], bool] | None = None
) -> Iterator[None]:
    """Say ``what ...`` now, then ``what: N s so far`` every ``every`` seconds until the block ends, or
    until ``until()`` is true (someone else talks from there). The block's errors pass through
    untouched; the ticker's own never reach it."""
    say(f"{what} ...", stream)
    done, start = threading.Event(), time.monotonic()

    def tick() -> None:
        last = start
        while not done.wait(0.5):
            if until is not None and until():
                return
            if time.monotonic() - last >= every:
                say(f"{what}: {_seconds(start)} so far", stream)
                last = time.monotonic()

    with contextlib.suppress(Exception):
        threading.Thread(target=tick, name="ticker", daemon=True).start()
    try:
        yield
    finally:
        done.set()


# ---- make setup: pip's output ------------------------------------------------------------------


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


class PipProgress:
    """pip's output, filtered (``hide`` dropped, ``show`` kept, cut to WIDTH), and a line of our own
    when TICK_S seconds pass without one: while pip fetches, how many packages it has collected; while
    it installs, how many of the packages it listed ("Installing collected packages: ...") have their
    ``*.dist-info/INSTALLER`` in site-packages (pip writes it once a package's files are in place, in
    the order it listed them), and the next one."""

    def __init__(self, venv: str, hide: str, show: str) -> None:
        self.venv, self.hide, self.show = venv, re.compile(hide), re.compile(show)
        self.start = self.last = time.monotonic()
        self.collected: int = 0
        self.installing: list[str] = []
        self.lock = threading.Lock()
        found = sorted(Path(venv).glob("lib/python*/site-packages"))
        self.site = found[0] if found else None

    def line(self, text: str) -> None:
        text = text.rstrip()
        if text.startswith(("Collecting ", "Processing ")):  # a package from the index, or a local wheel
            self.collected += 1
        if text.startswith("Installing collected packages:"):
            self.installing = [name.strip() for name in text.split(":", 1)[1].split(",") if name.strip()]
        if not text or self.hide.search(text) or not self.show.search(text):
            return
        if text.startswith("Installing collected packages:") and len(self.installing) > 3:
            text = f"Installing collected packages: {len(self.installing)} ({', '.join(self.installing[:3])}, ...)"
        self.emit(text[:WIDTH])

    def emit(self, text: str) -> None:
        with self.lock:
            say(text, sys.stdout)
            self.last = time.monotonic()

    def installed(self) -> set[str]:
        if self.site is None:
            return set()
        return {
            _normalized(entry.name.split("-", 1)[0])
            for entry in self.site.glob("*.dist-info")
            if (entry / "INSTALLER").exists()
        }

    def status(self) -> str:
        if not self.installing:
            how_far = f"packages collected {self.collected}"
            return f"{self.venv}: pip is resolving and fetching: {how_far}, {_seconds(self.start)}"
        installed = self.installed()
        left = [name for name in self.installing if _normalized(name) not in installed]
        done = len(self.installing) - len(left)
        now = f" (now {left[0]})" if left else ""
        how_far = f"{done} of {len(self.installing)} packages in place{now}"
        return f"{self.venv}: pip is installing: {how_far}, {_seconds(self.start)}"

    def tick(self, finished: threading.Event) -> None:
        while not finished.wait(1.0):
            with contextlib.suppress(Exception):
                if time.monotonic() - self.last >= TICK_S:
                    self.emit(self.status())


def pip_filter(venv: str, hide: str, show: str) -> int:
    """Read pip's output from stdin to its end (pip must never block on us, nor die of a broken
    pipe); print what PipProgress keeps, with a status line every TICK_S s of silence. Exits 0."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops pip; we stop at the end of its output
    finished = threading.Event()
    progress = None
    with contextlib.suppress(Exception):
        progress = PipProgress(venv, hide, show)
        threading.Thread(target=progress.tick, args=(finished,), name="ticker", daemon=True).start()
    for raw in sys.stdin.buffer:
        text = raw.decode(errors="replace")
        try:
            if progress is None:
                raise RuntimeError("no filter")
            progress.line(text)
        except Exception:  # noqa: BLE001 -- a filter that broke passes pip's lines through as they are
            say(text.rstrip()[:WIDTH], sys.stdout)
    finished.set()
    return 0


# ---- make setup: the import check --------------------------------------------------------------

#: What set-up checks imports, in steps of a few seconds each.
IMPORT_STEPS = (
    ("nemo_memlog and torch", ("nemo_memlog", "torch")),
    ("megatron-core", ("megatron.core",)),
    ("the backends (tensorboard, wandb, mlflow, comet_ml)", ("tensorboard", "wandb", "mlflow", "comet_ml")),
    ("omegaconf, transformers and triton", ("omegaconf", "transformers", "triton")),
    ("Lightning", ("lightning.pytorch", "pytorch_lightning")),
)


def check(venv: str, constraints: str) -> int:
    """Import what set-up installs, a line per step, then hold megatron-core's and Megatron-Bridge's
    versions to their pins in ``constraints``. 0 when all holds, else 1 (the error on stderr). In a
    temporary folder of its own, removed at the end: W&B's import makes two folders in the temporary
    folder, which its exit hook would remove, and main() ends the check without exit hooks."""
    try:
        from nemo_memlog.testing.tmp import private_tmpdir

        with private_tmpdir():
            _imports_and_pins(venv, constraints)
    except Exception as error:  # noqa: BLE001 -- any of them is a failed set-up, said by the Makefile
        say(f"{venv}: import check failed: {error!r}", sys.stdout)
        return 1
    return 0


def _imports_and_pins(venv: str, constraints: str) -> None:
    for number, (what, modules) in enumerate(IMPORT_STEPS, 1):
        with ticking(f"{venv}: import check {number}/{len(IMPORT_STEPS) + 1}: {what}", sys.stdout):
            for module in modules:
                importlib.import_module(module)
    say(f"{venv}: import check {len(IMPORT_STEPS) + 1}/{len(IMPORT_STEPS) + 1}: the pins of {constraints}", sys.stdout)
    pins = re.findall(r"^(megatron-(?:core|bridge))==(\S+)", Path(constraints).read_text(), re.M)
    wrong = {name: version(name) for name, pinned in pins if version(name) != pinned}
    if not pins or wrong:
        raise AssertionError(f"pins {pins}, installed {wrong}")


def run(label: str, command: list[str]) -> int:
    """``command``'s exit status, with ``label ...`` now and a line every TICK_S s while it runs."""
    with ticking(label, sys.stdout):
        return subprocess.call(command)


def main(argv: list[str]) -> int:
    if argv[:1] == ["pip"] and len(argv) >= 2:
        options = dict(zip(argv[2::2], argv[3::2], strict=False))
        return pip_filter(argv[1], options.get("--hide", "(?!)"), options.get("--show", ""))
    if argv[:1] == ["check"] and len(argv) == 3:
        code = check(argv[1], argv[2])
        # The exit hooks the imports registered (W&B, MLflow, torch) have nothing of a check's to end, and
        # took 6-7 s of silence after its last line: skipped.
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    if argv[:1] == ["run"] and len(argv) >= 4 and argv[2] == "--":
        return run(argv[1], argv[3:])
    say(__doc__.split("\n\n")[1])
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

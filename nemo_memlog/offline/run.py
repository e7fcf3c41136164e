"""``nemo-memlog run [--set key=value ...] -- COMMAND ...``: COMMAND with every Python process it
starts instrumented, whatever the launcher (torchrun, python, srun, a shell script), with no edit of
the user's script: the convention of ``opentelemetry-instrument`` and ``ddtrace-run``.

It puts the bootstrap folder (integrations/autorun/, whose ``sitecustomize`` chains to the user's
own) first on ``PYTHONPATH``, turns each ``--set key=value`` into ``NEMO_MEMLOG_<KEY>=value``, and
replaces itself with COMMAND (``exec``): its exit status and signals are COMMAND's own, and nothing
of ours stays behind as a parent. No torch here.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from ..config import FIELDS
from ..config.validation import did_you_mean

USAGE = "usage: nemo-memlog run [--set key=value ...] -- COMMAND [ARGS ...]"
#: The bootstrap folder (a path, not an import: the launcher imports no integration).
BOOTSTRAP = Path(__file__).resolve().parents[1] / "integrations" / "autorun"
ENV_PREFIX = "NEMO_MEMLOG_"
RUN_ENV = "NEMO_MEMLOG_RUN"


class UsageError(ValueError):
    """A command line ``run`` cannot take: the message says what to write."""


def parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """(``{field: text}`` from ``--set``, COMMAND) from ``run``'s arguments, else UsageError."""
    settings: dict[str, str] = {}
    rest = list(argv)
    while rest and rest[0] != "--":
        option = rest.pop(0)
        if option == "--set" and rest:
            option = "--set=" + rest.pop(0)
        if not option.startswith("--set="):
            if option.startswith("-"):
                raise UsageError(f"nemo-memlog run: unknown option {option!r}\n{USAGE}")
            rest.insert(0, option)  # COMMAND without the "--"
            break
        key, sep, value = option.removeprefix("--set=").partition("=")
        key = key.removeprefix("logger.")
        if not sep or key not in FIELDS:
            hint = did_you_mean(key, FIELDS) if key else ""
            raise UsageError(
                f"nemo-memlog run: --set {option.removeprefix('--set=')!r}: expected key=value with a LoggerConfig "
                f"field as key{hint} (e.g. --set memory_record_dir=/scratch/records)\n{USAGE}"
            )
        settings[key] = value
    if rest and rest[0] == "--":
        rest.pop(0)
    if not rest:
        raise UsageError(f"nemo-memlog run: no COMMAND given\n{USAGE}")
    return settings, rest


def environment(settings: dict[str, str], environ: dict[str, str]) -> dict[str, str]:
    """COMMAND's environment: the bootstrap first on PYTHONPATH (the user's entries kept after it),
    the settings as NEMO_MEMLOG_<FIELD>, and NEMO_MEMLOG_RUN=1."""
    env = dict(environ)
    entries = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry and entry != str(BOOTSTRAP)]
    env["PYTHONPATH"] = os.pathsep.join([str(BOOTSTRAP), *entries])
    env.update({ENV_PREFIX + key.upper(): value for key, value in settings.items()})
    env[RUN_ENV] = "1"
    return env


def main(argv: list[str]) -> int:
    """Replace this process with COMMAND; return only where it cannot start (2: usage, 126, 127)."""
    try:
        settings, command = parse(argv)
    except UsageError as error:
        print(error, file=sys.stderr)
        return 2
    env = environment(settings, dict(os.environ))
    if os.sep not in command[0] and shutil.which(command[0], path=env.get("PATH")) is None:
        print(f"nemo-memlog run: {command[0]}: command not found", file=sys.stderr)
        return 127
    print(
        f"nemo-memlog run: memory logging added to every Python process of: {' '.join(command[:3])}"
        f"{' ...' if len(command) > 3 else ''}",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        print(f"nemo-memlog run: {command[0]}: command not found", file=sys.stderr)
        return 127
    except PermissionError as error:
        print(f"nemo-memlog run: {command[0]}: cannot run it ({error.strerror})", file=sys.stderr)
        return 126
    return 0  # not reached: exec replaced this process

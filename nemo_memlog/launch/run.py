"""``nemo-memlog run [--set key=value ...] [--cpu] -- COMMAND ...``: COMMAND with every Python process it
starts instrumented, whatever the launcher (torchrun, python, srun, a shell script), with no edit of
the user's script: the convention of ``opentelemetry-instrument`` and ``ddtrace-run``.

It checks the settings (each ``--set key=value`` and each ``NEMO_MEMLOG_<FIELD>`` already in the
environment, typed by the field's declared type) and the switches, refusing a bad one with exit 2
before COMMAND starts; puts the bootstrap folder (integrations/autorun/, whose ``sitecustomize`` chains
to the user's own) before the user's ``PYTHONPATH``, kept as it is; and replaces itself with COMMAND
(``exec``): its exit status and signals are COMMAND's own, and nothing of ours stays behind as a
parent. COMMAND's environment is the one this launcher was given (``/proc/self/environ``), not what
a ``sitecustomize`` run in the launcher itself may have changed. No torch here.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
from pathlib import Path

from ..commands import USAGE_ERROR
from ..config import FIELDS, TextError, did_you_mean, fields_from_text
from ..config.switches import (
    CPU_STAND_INS_ENV,
    DISABLED_ENV,
    DISABLED_WAYS_ENV,
    FALSE_WORDS,
    TRUE_WORDS,
    env_name,
    switch_word,
    switched_off,
)
from ..redaction import launch_secrets, scrubbed_text

USAGE_LINE = "usage: nemo-memlog run [--set key=value ...] [--cpu] [-h] -- COMMAND [ARGS ...]"
#: The bootstrap folder (a path, not an import: the launcher imports no integration).
BOOTSTRAP = Path(__file__).resolve().parents[1] / "integrations" / "autorun"
#: The words a switch may be (config/switches.py, which the bootstrap's copy is held to).
SWITCH_WORDS = TRUE_WORDS + FALSE_WORDS
#: The longest banner (characters): COMMAND's first words, scrubbed.
BANNER_CHARS = 160

_MEMORY = tuple(name for name in FIELDS if name.startswith("memory_"))
#: Way in -> the LoggerConfig fields it takes from ``--set`` / ``NEMO_MEMLOG_<FIELD>`` (the others come
#: from the framework: Megatron-LM's flags, the recipe's cfg.logger). The integrations' own tables
#: (megatron_lm.OWN_SETTINGS, bridge.OWN_SETTINGS, lightning.SETTINGS), which tests/test_run.py holds
#: these to: the launcher imports no integration.
TAKEN_BY = {
    "megatron_lm": tuple(name for name in _MEMORY if name != "memory_keys"),
    "bridge": tuple(name for name in _MEMORY if name != "memory_keys"),
    "lightning": ("log_memory_to_tensorboard", "tensorboard_log_interval", "memory_keys", *_MEMORY),
}
WAYS_IN = tuple(TAKEN_BY)
TAKEN = {name for names in TAKEN_BY.values() for name in names}
HELP = f"""{USAGE_LINE}

Run COMMAND (torchrun, python, srun, a script) with memory logging added to every Python process it
starts, without changing its code: Megatron-LM's loop (with --log-memory-to-tensorboard), the
Megatron-Bridge recipes (with logger.log_memory_to_tensorboard) and Lightning Trainers. Exit status
and signals are COMMAND's; 2 for a usage error or a bad setting (before COMMAND starts), 126/127 when
it cannot start.

options:
  -h, --help       this help
  --set KEY=VALUE  a LoggerConfig field (`logger.` optional), typed by the field's type; the same as
                   NEMO_MEMLOG_<KEY>=VALUE. Taken: {", ".join(sorted(TAKEN))}
  --cpu            Megatron-LM's loop on a CPU-only machine: the CPU stand-ins in every process
                   (the same as {CPU_STAND_INS_ENV}=1)

environment:
  {DISABLED_ENV}=true                   everything off, in every process
  {DISABLED_WAYS_ENV}=a,b   ways in left out: {", ".join(WAYS_IN)}

docs/megatron_lm.md says which settings each way in takes from --set and which from the framework."""


class UsageError(ValueError):
    """A command line or setting ``run`` cannot take: the message says what to write."""


def parse(argv: list[str]) -> tuple[dict[str, str], bool, list[str]]:
    """(``{field: text}`` from ``--set``, ``--cpu``, COMMAND) from ``run``'s arguments, else UsageError;
    None for COMMAND when help was asked for."""
    settings: dict[str, str] = {}
    cpu = False
    rest = list(argv)
    while rest and rest[0] != "--":
        option = rest.pop(0)
        if option in ("-h", "--help"):
            return settings, cpu, []
        if option == "--cpu":
            cpu = True
            continue
        if option == "--set" and rest:
            option = "--set=" + rest.pop(0)
        if not option.startswith("--set="):
            if option.startswith("-"):
                raise UsageError(f"nemo-memlog run: unknown option {option!r}\n{USAGE_LINE}")
            rest.insert(0, option)  # COMMAND without the "--"
            break
        key, sep, value = option.removeprefix("--set=").partition("=")
        key = key.removeprefix("logger.")
        if not sep or key not in FIELDS:
            hint = did_you_mean(key, FIELDS) if key else ""
            raise UsageError(
                f"nemo-memlog run: --set {key or option!r}{'=...' if sep else ''}: expected key=value with a "
                f"LoggerConfig field as key{hint} (e.g. --set memory_record_dir=/scratch/records)\n{USAGE_LINE}"
            )
        settings[key] = value
    if rest and rest[0] == "--":
        rest.pop(0)
    if not rest:
        raise UsageError(f"nemo-memlog run: no COMMAND given\n{USAGE_LINE}")
    return settings, cpu, rest


def given_environment() -> dict[str, str]:
    """The environment this process was started with (``/proc/self/environ``): what a ``sitecustomize``
    run in the launcher changed in ``os.environ`` is not passed on. ``os.environ`` where it cannot be read."""
    try:
        with open("/proc/self/environ", "rb") as file:
            entries = file.read().split(b"\0")
    except OSError:
        return dict(os.environ)
    pairs = (entry.partition(b"=") for entry in entries if b"=" in entry)
    return {os.fsdecode(key): os.fsdecode(value) for key, _, value in pairs}


def checked(settings: dict[str, str], environ: dict[str, str]) -> dict[str, str]:
    """The settings COMMAND's processes read, ``{field: text}``: the environment's ``NEMO_MEMLOG_<FIELD>``
    with ``--set`` over them, each checked as its processes will read it, and the switches. Raises
    UsageError naming the setting and what to write."""
    given = {name: environ[env_name(name)] for name in FIELDS if env_name(name) in environ}
    texts = {**given, **settings}
    for name in texts:
        if name not in TAKEN:
            where = "--set " + name if name in settings else env_name(name)
            raise UsageError(
                f"nemo-memlog run: {where}: no way in takes it from run: Megatron-LM and Megatron-Bridge write to "
                f"the framework's own loggers (Megatron-LM's flags such as --tensorboard-dir and --wandb-project; "
                f"the recipe's cfg.logger), Lightning to the Trainer's. run takes: {', '.join(sorted(TAKEN))}"
            )
    try:
        fields_from_text(texts)
    except TextError as error:
        name = error.field or ""
        where = "--set " + name if name in settings else env_name(name)
        raise UsageError(f"nemo-memlog run: {where}: {error}") from None
    for switch in (DISABLED_ENV, CPU_STAND_INS_ENV):
        if switch_word(environ, switch) not in SWITCH_WORDS:
            raise UsageError(f"nemo-memlog run: {switch} must be true or false; got {environ[switch]!r}")
    excluded = {name.strip().lower() for name in environ.get(DISABLED_WAYS_ENV, "").split(",") if name.strip()}
    for name in sorted(excluded - set(WAYS_IN)):
        raise UsageError(
            f"nemo-memlog run: {DISABLED_WAYS_ENV}: {name!r} is no way in{did_you_mean(name, WAYS_IN)}; "
            f"write a comma-separated list of {', '.join(WAYS_IN)}"
        )
    return texts


def environment(settings: dict[str, str], environ: dict[str, str], cpu: bool = False) -> dict[str, str]:
    """COMMAND's environment: ``environ`` with the bootstrap before PYTHONPATH's entries, which are kept
    exactly (empty ones too: Python reads them as the working folder; an unset or empty PYTHONPATH
    adds none), the settings as NEMO_MEMLOG_<FIELD> and, with ``cpu``, the stand-ins'
    switch."""
    env = dict(environ)
    user_path = env.get("PYTHONPATH", "")
    if user_path != str(BOOTSTRAP) and not user_path.startswith(str(BOOTSTRAP) + os.pathsep):  # not nested
        env["PYTHONPATH"] = os.pathsep.join([str(BOOTSTRAP), user_path]) if user_path else str(BOOTSTRAP)
    env.update({env_name(key): value for key, value in settings.items()})
    if cpu:
        env[CPU_STAND_INS_ENV] = "1"
    return env


def say(text: str) -> None:
    """``text`` on stderr, unbuffered, never raising: a closed or full stderr does not stop COMMAND."""
    try:
        os.write(2, (text + "\n").encode(errors="replace"))
    except OSError:
        pass


def banner(command: list[str], environ: dict[str, str], secrets: list[str]) -> str:
    """The one line ``run`` prints before COMMAND: what it does and COMMAND's first words, scrubbed of
    secrets (redaction.py's rules, as fit's) and at most BANNER_CHARS long."""
    words = " ".join(command[:3]) + (" ..." if len(command) > 3 else "")
    if switched_off(environ):
        what = f"{DISABLED_ENV} is set: no memory logging in"
    else:
        what = "memory logging added to every Python process of"
        what += " (CPU stand-ins on)" if switch_word(environ, CPU_STAND_INS_ENV) in TRUE_WORDS else ""
    text = scrubbed_text(f"nemo-memlog run: {what}: {words}", secrets)
    return text if len(text) <= BANNER_CHARS else text[: BANNER_CHARS - 4] + " ..."


def main(argv: list[str], as_command: bool = False) -> int:
    """Replace this process with COMMAND; return only where it cannot start (0: help; 2: usage or a bad
    setting; 126, 127). ``as_command`` (the ``nemo-memlog`` process itself): COMMAND gets the environment
    this process was started with; else (called from a program) ``os.environ`` as it is now."""
    environ = given_environment() if as_command else dict(os.environ)
    secrets = launch_secrets(argv, environ)
    try:
        settings, cpu, command = parse(argv)
        if not command:
            try:
                os.write(1, (HELP + "\n").encode())
            except OSError:
                pass
            return 0
        settings = checked(settings, environ)
    except UsageError as error:
        say(scrubbed_text(str(error), secrets))
        return USAGE_ERROR
    env = environment(settings, environ, cpu)
    name = scrubbed_text(command[0], secrets)[:80]
    if os.sep not in command[0] and shutil.which(command[0], path=env.get("PATH")) is None:
        say(f"nemo-memlog run: {name}: command not found")
        return 127
    say(banner(command, env, secrets))
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    try:
        os.execvpe(command[0], command, env)
    except OSError as error:
        return _cannot_start(name, error)
    return 0  # not reached: exec replaced this process


def _cannot_start(name: str, error: OSError) -> int:
    """Say in one line why COMMAND could not start; the shell's status: 127 not found, else 126."""
    if error.errno == errno.ENOENT:
        say(
            f"nemo-memlog run: {name}: command not found"
            if os.sep not in name
            else f"nemo-memlog run: {name}: no such file"
        )
        return 127
    if error.errno == errno.ENOEXEC:
        say(
            f"nemo-memlog run: {name}: cannot run it: not a program, and no '#!' line names its interpreter; "
            f"run it with its interpreter (nemo-memlog run -- bash {name}, or python {name}) or add a '#!' line"
        )
        return 126
    if error.errno == errno.E2BIG:
        say(f"nemo-memlog run: {name}: cannot run it: its arguments and environment are too long for the system")
        return 126
    say(f"nemo-memlog run: {name}: cannot run it ({error.strerror})")
    return 126

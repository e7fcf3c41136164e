"""What ``nemo-memlog fit`` says in words, as it goes and where it stops: why a probe measured nothing,
its last output, what an interruption leaves, the command line as printed (secrets scrubbed). No torch."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..redaction import command_secrets, scrubbed_text
from .probe import LOG_NAME
from .tables import size_text

if TYPE_CHECKING:
    from .probe import Probe


def why(probe: Probe, options: Any) -> str:
    """Why a probe measured nothing, in words."""
    memory = " (out of memory)" if probe.out_of_memory else ""
    return {
        "died": f"the command exited with {probe.exit_code}{memory} before every rank recorded two measured "
        "logging steps",
        "ended": "the command ended (exit 0) before every rank recorded two measured logging steps",
        "timeout": f"no two measured logging steps on every rank within {options.probe_timeout_s:g} s",
        "measured": "its records cannot be used",
    }.get(probe.status, probe.status)


def output(probe: Probe, options: Any, lines: int) -> str:
    """The probe's notes and its command's last output, for a message; its log named only where the
    path lasts (--work-dir's, not a temporary folder's)."""
    log = probe.folder / LOG_NAME
    named = f" ({log})" if options.work_dir is not None and log.is_file() else ""
    tail = probe.read_tail(lines)
    return "".join(f"\n  {note}" for note in probe.notes) + (
        f"\nthe command's last output{named}:\n{tail}" if tail else ""
    )


def no_measurement(probe: Probe, options: Any) -> str:
    return (
        f"the first probe (micro-batch size {probe.micro_batch_size}) measured nothing: {why(probe, options)} "
        f"({probe.ranks_recorded} of {probe.world_size or '?'} ranks recorded)"
        + (f"; its error: {probe.error_line}" if probe.error_line else "")
        + ". A probe needs memory logging on "
        "(log_memory_to_tensorboard), the model passed to training_log or a callback, and two logging "
        "intervals of training; a size that runs (--start N)." + output(probe, options, 15)
    )


def could_not_measure(number: int, launch: Any, best: Any, options: Any) -> str:
    probe = launch.probe
    error = probe.error_line
    so_far = f"; the largest size measured to fit so far is {best.probe.micro_batch_size}" if best else ""
    return (
        f"probe {number} (micro-batch size {probe.micro_batch_size}) could not measure: {why(probe, options)}"
        + (f"; its error: {error}" if error else "")
        + f". fit cannot tell whether {probe.micro_batch_size} fits{so_far}."
        + output(probe, options, 12)
    )


def shown(command: list[str], secrets: Sequence[str] = ()) -> str:
    """The command line as fit prints it: its secrets and URI passwords scrubbed."""
    return scrubbed_text(shlex.join(command), list(secrets or command_secrets(command)))


def interrupted(signal_name: str, state: Any) -> str:
    """What an interrupted search says: how many probes ran, the largest size measured to fit (if any)."""
    best = state.best.probe.micro_batch_size if state.best is not None else None
    so_far = f"the largest size measured to fit so far is {best}" if best else "no size was measured to fit"
    probes = len(state.launches)
    return f"interrupted by {signal_name} after {probes} probe(s); every probe's processes ended; {so_far}"


def sizes(values: Sequence[float] | None) -> str:
    return ", ".join(size_text(value) for value in values or ())

"""What ``nemo-memlog fit`` says in words, as it goes and where it stops: the placeholder and where it goes
in the command's framework, probes sharing a TensorBoard folder, why a probe measured nothing, its last
output, what an interruption leaves, the command line as printed (secrets scrubbed). No torch."""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...offline.tables import size_text
from ...redaction import command_secrets, scrubbed_text
from .probe import LOG_NAME

if TYPE_CHECKING:
    from .probe import Probe


PLACEHOLDER = "{micro_batch_size}"
#: PLACEHOLDER, or with the size the command would use: ``{micro_batch_size:8}`` (the first probe's).
SLOT = re.compile(r"\{micro_batch_size(?::(\d+))?\}")
#: Where a command states its micro-batch size, by framework: Megatron-LM's option (``--micro-batch-size 4``,
#: ``--micro-batch-size=4``), Megatron-Bridge's override (``train.micro_batch_size=4``).
_MEGATRON_LM_SIZE = re.compile(r"(?:^|(?<=\s))--micro-batch-size(?:=|\s+)(\d+)")
_BRIDGE_SIZE = re.compile(r"(?:^|(?<=\s))train\.micro_batch_size=(\d+)")
#: A TensorBoard folder the command names: Megatron-LM's ``--tensorboard-dir X``, Bridge's ``logger.tensorboard_dir=X``.
_TENSORBOARD_DIR = re.compile(r"(?:^|(?<=\s))(--tensorboard-dir(?:=|\s+)|logger\.tensorboard_dir=)([^\s'\"]+)")


def placeholder_hint(command: list[str]) -> str:
    """Where the placeholder goes, in the words of the command's framework: Megatron-LM's
    ``--micro-batch-size {micro_batch_size:4}`` where the command carries ``--micro-batch-size 4``,
    Megatron-Bridge's ``train.micro_batch_size={micro_batch_size:4}`` otherwise."""
    text = " ".join(command)
    megatron_lm, bridge = _MEGATRON_LM_SIZE.search(text), _BRIDGE_SIZE.search(text)
    if megatron_lm:
        size = megatron_lm.group(1)
        return (
            f"write --micro-batch-size {{micro_batch_size:{size}}} for --micro-batch-size {size} "
            f"(Megatron-LM's option; fit starts from {size}, the size the command would use)"
        )
    if bridge:
        size = bridge.group(1)
        return (
            f"write 'train.micro_batch_size={{micro_batch_size:{size}}}' for train.micro_batch_size={size} "
            f"(quoted, so the shell leaves the braces; fit starts from {size}, the size the command would use)"
        )
    return (
        f"put it where the size goes, e.g. train.micro_batch_size={PLACEHOLDER} (quoted, so the shell leaves the "
        "braces), or {micro_batch_size:8} to start from 8, the size the command would use"
    )


def shared_tensorboard(command: list[str]) -> str | None:
    """A note where every probe would write into one TensorBoard folder (``--tensorboard-dir`` or
    ``logger.tensorboard_dir`` without the placeholder): their points land in one TensorBoard run,
    with repeated steps. None where there is no such folder, or its name has the placeholder."""
    found = _TENSORBOARD_DIR.search(" ".join(command))
    if found is None or SLOT.search(found.group(2)):
        return None
    option, folder = found.group(1).strip(" ="), found.group(2)
    given = f"{option} {folder}" if option.startswith("--") else f"{option}={folder}"
    spelled = (
        f"{option} {folder}/mbs-{PLACEHOLDER}" if option.startswith("--") else f"'{option}={folder}/mbs-{PLACEHOLDER}'"
    )
    return (
        f"every probe writes into one TensorBoard folder ({given}): their points land in one "
        f"TensorBoard run, with repeated steps; to keep them apart, put {PLACEHOLDER} in its name: {spelled}"
    )


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
    probes = state.launched
    return f"interrupted by {signal_name} after {probes} probe(s); every probe's processes ended; {so_far}"


def sizes(values: Sequence[float] | None) -> str:
    return ", ".join(size_text(value) for value in values or ())

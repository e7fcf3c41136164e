"""What ``nemo-memlog fit`` prints: the answer and its override, per stage the predicted and the
confirmed peak and their error, the launches and the time, or what would fit instead; as text or
as one JSON object (the contract: ``micro_batch_size``, ``launches``, ``stages``, ``error``: null, or
why fit cannot tell). Every text from the command (its line, its output) is shown with its secrets
scrubbed (the Result's ``secrets``). No torch."""

from __future__ import annotations

import json

from ...offline.advise import fix_dict
from ...offline.tables import printable, size_text
from ...redaction import scrubbed_text
from . import CANDIDATES_SHOWN, Launch, Options, Result, command_for, launched, peaks
from .words import shown


def _stages(result: Result) -> list[dict]:
    answer = result.answer
    if answer is None or answer.run is None:
        return []
    rows = []
    for index, (stage, measured) in enumerate(zip(answer.run.stages, peaks(answer.run))):
        predicted = answer.predicted[index] if answer.predicted else None
        rows.append(
            {
                "stage": stage.stage,
                "predicted_peak_gb": predicted,
                "measured_peak_gb": measured,
                "error": (predicted - measured) / measured if predicted is not None and measured else None,
                "capacity_gb": result.capacity_gb,
                "limit_gb": result.limit_gb,
            }
        )
    return rows


def _launch(launch: Launch, secrets: list[str]) -> dict:
    probe = launch.probe
    return {
        "micro_batch_size": probe.micro_batch_size,
        "folder": None if probe.launched else str(probe.folder),  # --from-records
        "status": probe.status,
        "outcome": launch.outcome,
        "exit_code": probe.exit_code,
        "seconds": round(probe.seconds, 1),
        "measured_steps": probe.steps,  # the most any rank recorded before its peak was steady
        "fits": launch.fits,
        "predicted_peaks_gb": launch.predicted,
        "measured_peaks_gb": peaks(launch.run) if launch.run else None,
        "error_line": scrubbed_text(probe.error_line, secrets) or None if not launch.fits else None,
        "notes": [scrubbed_text(note, secrets) for note in probe.notes],
        "output_tail": scrubbed_text(probe.output_tail, secrets) or None,
    }


def error_json(message: str) -> str:
    """The one JSON object printed where fit stopped before any probe (a usage error)."""
    return json.dumps({"micro_batch_size": None, "command": None, "error": message, "launches": 0, "probes": []})


def as_json(result: Result, options: Options) -> str:
    size = result.micro_batch_size
    return json.dumps(
        {
            "micro_batch_size": size,
            "command": shown(command_for(options.command, size), result.secrets) if size is not None else None,
            "error": result.error,
            "interrupted": result.interrupted,
            "launches": launched(result.launches),
            "seconds": round(result.seconds, 1),
            "margin": options.margin,
            "capacity_gb": result.capacity_gb,
            "capacity_source": result.capacity_source,
            "candidates": list(result.candidates[:CANDIDATES_SHOWN]),
            "candidates_count": len(result.candidates),
            "stages": _stages(result),
            "probes": [_launch(launch, result.secrets) for launch in result.launches],
            "alternatives": [fix_dict(fix) for fix in result.alternatives],
            "notes": result.notes,
        },
        indent=1,
    )


def as_text(result: Result, options: Options) -> str:
    lines, number = [], 0
    for launch in result.launches:
        probe = launch.probe
        verdict = {"over the limit": "does not fit"}.get(launch.outcome, launch.outcome)
        verdict += f" ({probe.status})" if not probe.measured else ""
        measured = ", ".join(size_text(peak) for peak in peaks(launch.run)) if launch.run else "-"
        if probe.launched:
            number += 1
            name, spent = f"probe {number}", f"{probe.seconds:.0f} s"
        else:
            name, spent = "records", f"read from {probe.folder}"
        size = probe.micro_batch_size
        lines.append(f"{name}: micro-batch size {size}: {verdict} (peaks per stage {measured}; {spent})")
        if probe.output_tail:  # why it died: an OOM kill, or something else to fix first
            exit_text = f"exit {probe.exit_code}" if probe.exit_code is not None else probe.status
            tail = scrubbed_text(probe.output_tail, result.secrets)
            lines += [f"  its last output ({exit_text}):", *(f"    {line}" for line in tail.splitlines())]
    limit = f"{size_text(result.limit_gb)} per rank ({size_text(result.capacity_gb)} {result.capacity_source}, "
    lines += [f"limit: {limit}less {options.margin:.0%} margin)", ""]
    if result.micro_batch_size is None:
        lines.append("nothing fits: even the smallest micro-batch size's measured peak is over the limit.")
        if result.alternatives:
            lines.append("what advise predicts would fit instead (cheapest first):")
            for fix in result.alternatives:
                predicted = ", ".join(size_text(o.peak_gb) for o in fix.outcomes)
                lines.append(f"  {fix.text}  (peaks per stage {predicted})")
        else:
            lines.append("advise predicts no change alone or together that fits: more ranks, or a larger device.")
    else:
        lines.append(f"largest micro-batch size that fits every stage: {result.micro_batch_size}")
        lines.append(f"  {shown(command_for(options.command, result.micro_batch_size), result.secrets)}")
        lines.append("")
        lines.append(f"{'stage':<7}{'predicted':>12}{'confirmed':>12}{'error':>9}")
        for row in _stages(result):
            predicted, error = row["predicted_peak_gb"], row["error"]
            lines.append(
                f"{row['stage']:<7}{size_text(predicted):>12}{size_text(row['measured_peak_gb']):>12}"
                f"{format(error, '+.1%') if error is not None else '-':>9}"
            )
    lines.append("")
    lines += [f"note: {note}" for note in result.notes]
    lines.append(f"{launched(result.launches)} launches, {result.seconds:.0f} s")
    return scrubbed_text("\n".join(map(printable, lines)), result.secrets)  # the output's escapes shown, not run

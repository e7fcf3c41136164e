"""What ``nemo-memlog fit`` prints: the answer and its override, per stage the predicted and the
confirmed peak and their error, the launches and the time, or what would fit instead; as text or
as one JSON object (the contract: ``micro_batch_size``, ``launches``, ``stages``). No torch."""

from __future__ import annotations

import json

from .advise import fix_dict
from .fit import Launch, Options, Result, command_for, peaks, shown
from .tables import size_text


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


def _launch(launch: Launch) -> dict:
    probe = launch.probe
    return {
        "micro_batch_size": probe.micro_batch_size,
        "status": probe.status,
        "exit_code": probe.exit_code,
        "seconds": round(probe.seconds, 1),
        "fits": launch.fits,
        "predicted_peaks_gb": launch.predicted,
        "measured_peaks_gb": peaks(launch.run) if launch.run else None,
        "output_tail": probe.output_tail or None,
    }


def as_json(result: Result, options: Options) -> str:
    size = result.micro_batch_size
    return json.dumps(
        {
            "micro_batch_size": size,
            "command": shown(command_for(options.command, size)) if size is not None else None,
            "launches": len(result.launches),
            "seconds": round(result.seconds, 1),
            "margin": options.margin,
            "capacity_gb": result.capacity_gb,
            "capacity_source": result.capacity_source,
            "candidates": result.candidates,
            "stages": _stages(result),
            "probes": [_launch(launch) for launch in result.launches],
            "alternatives": [fix_dict(fix) for fix in result.alternatives],
        },
        indent=1,
    )


def as_text(result: Result, options: Options) -> str:
    lines = []
    for number, launch in enumerate(result.launches, 1):
        probe = launch.probe
        verdict = "fits" if launch.fits else ("does not fit" if probe.measured else probe.status)
        measured = ", ".join(size_text(peak) for peak in peaks(launch.run)) if launch.run else "-"
        lines.append(
            f"probe {number}: micro-batch size {probe.micro_batch_size}: {verdict} "
            f"(peaks per stage {measured}; {probe.seconds:.0f} s)"
        )
        if probe.output_tail:  # why it died: an OOM kill, or something else to fix first
            exit_text = f"exit {probe.exit_code}" if probe.exit_code is not None else probe.status
            lines += [f"  its last output ({exit_text}):", *(f"    {line}" for line in probe.output_tail.splitlines())]
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
        lines.append(f"  {shown(command_for(options.command, result.micro_batch_size))}")
        lines.append("")
        lines.append(f"{'stage':<7}{'predicted':>12}{'confirmed':>12}{'error':>9}")
        for row in _stages(result):
            predicted, error = row["predicted_peak_gb"], row["error"]
            lines.append(
                f"{row['stage']:<7}{size_text(predicted):>12}{size_text(row['measured_peak_gb']):>12}"
                f"{format(error, '+.1%') if error is not None else '-':>9}"
            )
    lines.append("")
    lines.append(f"{len(result.launches)} launches, {result.seconds:.0f} s")
    return "\n".join(lines)

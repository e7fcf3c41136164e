"""The advise PNG: per stage, today's stacked bar beside the predicted one, against the capacity.

Reads advice/'s outcomes; draws through plotting.py (matplotlib, lazily). No torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ...advice import PARTS
from ...parts import label_of
from ..plotting import PART_COLOURS, integer_ticks, new_figure, save
from ..tables import size_scale, size_text

if TYPE_CHECKING:
    from ...advice import Change, Outcome, Profile

COLOURS = PART_COLOURS  # bottom to top, as the composition PNG colours them


def write_png(profile: Profile, changes: list[Change], outcomes: list[Outcome], path: str | Path) -> Path:
    """Two bars per stage (today, predicted) into the PNG at ``path``, the stage holding the peak
    today and predicted named over its bar and in the title; returns the path."""
    from . import capacity_line, peak_line, replica_line

    tallest = max([o.peak_now_gb for o in outcomes] + [o.peak_gb for o in outcomes] + [profile.capacity_gb or 0.0])
    unit, scale = size_scale(tallest)
    peak_now = max(outcomes, key=lambda o: o.peak_now_gb).stage if outcomes else None
    peak_then = max(outcomes, key=lambda o: o.peak_gb).stage if outcomes else None
    figure = new_figure(10, 5.5)
    axes = figure.add_subplot()
    stages = [o.stage for o in outcomes]
    for offset, which in ((-0.2, "now"), (0.2, "predicted")):
        bottoms = [0.0] * len(outcomes)
        for name in PARTS:
            label, colour = label_of(name, profile.gpu), COLOURS[name]
            heights = [scale * (getattr(o, which).get(name) or 0.0) for o in outcomes]
            if not any(heights):
                continue
            axes.bar(
                [s + offset for s in stages],
                heights,
                bottom=bottoms,
                width=0.38,
                color=colour,
                alpha=1.0 if which == "predicted" else 0.55,
                label=label if which == "predicted" else None,
                edgecolor="black" if which == "predicted" else "none",
                linewidth=0.5,
            )
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        for stage, top, outcome in zip(stages, bottoms, outcomes):
            text = (
                "today"
                if which == "now"
                else ("fits" if outcome.fits else "does NOT fit" if outcome.fits is False else "")
            )
            holds = stage == (peak_now if which == "now" else peak_then)
            axes.annotate(
                ("PEAK\n" if holds else "") + f"{text}\n{size_text(top / scale)}",
                (stage + offset, top),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                fontsize="small",
                color="tab:red" if holds else "black",
            )
    if profile.capacity_gb:
        axes.axhline(
            scale * profile.capacity_gb,
            color="red",
            linestyle=":",
            label=capacity_line(profile).replace(" (", "\n(", 1),
        )
    axes.set_xlabel("pipeline stage (left bar: today, faded; right bar: predicted)")
    integer_ticks(axes.xaxis)
    axes.set_ylabel(unit)
    what = " + ".join(change.text for change in changes) or "today"
    title = f"what-if {what}: each stage today and predicted"
    figure.suptitle(f"{title}\n{peak_line(outcomes)}\n{replica_line(profile)}", fontsize="medium")
    axes.grid(alpha=0.3, axis="y")
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return save(figure, path, f"{title}; {peak_line(outcomes)}; {replica_line(profile)}")

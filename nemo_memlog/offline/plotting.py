"""What the two PNGs share: a matplotlib figure, the legend beside the axes, and the save.

Reads nothing; ``save`` writes one PNG whose own Title text says what it shows. matplotlib
is imported on the first figure, with the Agg backend: no display is needed, and a command
that draws nothing never imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .. import parts

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.axis import Axis
    from matplotlib.figure import Figure


#: Each part of a stage's peak -> its colour, the same in every picture (names: parts.label_of).
PART_COLOURS = {
    parts.PARAMS.key: "tab:blue",
    parts.GRADS.key: "tab:cyan",
    parts.OPTIMIZER_STATE.key: "tab:purple",
    parts.ACTIVATIONS.key: "tab:orange",
    parts.TEMPORARIES.key: "tab:pink",
    parts.ALLOCATOR_SLACK.key: "tab:gray",
    parts.OUTSIDE.key: "tab:olive",
}


def new_figure(width: float, height: float) -> Figure:
    """An empty ``matplotlib.figure.Figure`` of ``width`` x ``height`` inches at 100 dpi, laid out to fit."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def finish_axes(axes: Axes) -> None:
    """A light grid, and the legend outside the axes on the right: never over the lines."""
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")


def integer_ticks(axis: Axis) -> None:
    """Ticks on whole numbers only, for an axis that counts (ranks, iterations): never a 0.5."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def save(figure: Figure, path: str | Path, title: str) -> Path:
    """The PNG at ``path`` (its folder made), with ``title`` as its Title text; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, metadata={"Title": title})
    return path

"""The changes that fit, cheapest first (``advise --fit``, and ``fit`` when nothing fits): the largest
micro-batch size, then the distributed optimizer, then recompute, then another layer split, each
alone, else all of them together. Pure arithmetic over ``predict``; never raises Refused."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .model import Change, Outcome, Profile, Refused, parse
from .predict import max_micro_batch_size, predict

#: The order of the search, cheapest first: what each costs the run.
COSTS = {
    "micro_batch_size": "no extra compute; the global batch stays (the microbatches per step change with the size)",
    "distributed_optimizer": "one all-gather of the parameters per step over data parallelism",
    "recompute": "a second forward of each layer in backward (about a third more compute)",
    "layers_per_stage": "an uneven pipeline: the longest stage sets the pace",
}


@dataclass(frozen=True)
class Fix:
    """Changes that, applied together, leave every stage's predicted peak within the limit."""

    changes: tuple[Change, ...]
    outcomes: tuple[Outcome, ...]

    @property
    def text(self) -> str:
        return " + ".join(change.text for change in self.changes)


def changes_that_fit(profile: Profile, margin: float) -> list[Fix]:
    """Each change of COSTS's order that alone leaves ``margin`` of the capacity free on every
    stage (the largest micro-batch size that does, for the first); where none alone does, the
    distributed optimizer, recompute and a layer split together, with the largest micro-batch size
    under them. [] without a capacity or where nothing can be predicted to fit."""
    if profile.capacity_gb is None:
        return []
    limit = profile.capacity_gb * (1.0 - margin)
    fixes = []
    size, _ = max_micro_batch_size(profile, margin=margin)
    if size is not None:
        fixes.append(_fix(profile, parse([f"micro_batch_size={size}"]), margin))
    fixes.append(_fix(profile, parse(["distributed_optimizer=true"]), margin))
    fixes.append(_fix(profile, parse(["recompute=full"]), margin))
    split = balanced_split(profile, limit)
    if split is not None:
        fixes.append(_fix(profile, parse([f"layers_per_stage={','.join(map(str, split))}"]), margin))
    found = [fix for fix in fixes if fix is not None]
    if found:
        return found
    together = [text for text in ("distributed_optimizer=true", "recompute=full") if _peaks(profile, text) is not None]
    if split is not None:
        together.append(f"layers_per_stage={','.join(map(str, split))}")
    size, _ = max_micro_batch_size(profile, parse(together), margin=margin)
    if size is None:
        return []
    fix = _fix(profile, parse([*together, f"micro_batch_size={size}"]), margin)
    return [fix] if fix is not None else []


def _fix(profile: Profile, changes: Sequence[Change], margin: float) -> Fix | None:
    """A Fix of ``changes`` where the prediction leaves ``margin`` of every stage's capacity free, else None."""
    try:
        outcomes = predict(profile, list(changes))
    except Refused:
        return None
    if all(outcome.fits_with(margin) for outcome in outcomes):
        return Fix(tuple(changes), tuple(outcomes))
    return None


def balanced_split(profile: Profile, limit: float) -> tuple[int, ...] | None:
    """Transformer layers per stage that lower the highest predicted peak the most, moving one layer
    at a time off the stage that holds it (at most layers x stages moves); None where the run's
    record cannot predict a layer move or no move lowers the peak."""
    counts = [sum(1 for row in stage.layers if row.get("kind") == "layer") for stage in profile.stages]
    if len(counts) < 2 or not sum(counts):
        return None

    def split_peaks(split: list[int]) -> list[float] | None:
        return _peaks(profile, f"layers_per_stage={','.join(map(str, split))}")

    best, peaks = list(counts), split_peaks(counts)
    if peaks is None:
        return None
    for _ in range(sum(counts) * len(counts)):
        if max(peaks) <= limit:
            break
        worst = peaks.index(max(peaks))
        moves = []
        for other in range(len(best)):
            if other != worst and best[worst] > 0:
                moved = list(best)
                moved[worst] -= 1
                moved[other] += 1
                moved_peaks = split_peaks(moved)
                if moved_peaks is not None:
                    moves.append((max(moved_peaks), moved, moved_peaks))
        if not moves or min(moves)[0] >= max(peaks):
            break
        _, best, peaks = min(moves)
    return tuple(best) if best != counts else None


def _peaks(profile: Profile, text: str) -> list[float] | None:
    """Each stage's predicted peak under the change ``text``, or None where it cannot be predicted."""
    try:
        return [outcome.peak_gb for outcome in predict(profile, parse([text]))]
    except (Refused, ValueError):
        return None

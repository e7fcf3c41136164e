"""One logging step's measurement on this rank, assembled: the iteration's activations, the model
state (with the iteration's gradients), the breakdown, and the memory phases ended since the last
logging step, added to this rank's report. Called by the run (monitor/__init__.py) on logging steps only,
past its gate; no collective.

``measure_step`` returns one ``StepMeasurement``, which the run then records (the flight record,
the per-layer record), gathers, attributes, advises, merges and writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import composition, phase

if TYPE_CHECKING:
    from torch import nn

    from .activations import ActivationMeter, Measurement


@dataclass(frozen=True)
class StepMeasurement:
    """What one logging step measured on this rank.

    Attributes:
        report: this rank's report (rank/memory.py's), with, where a model was given, its state and
            the derived parts (composition.breakdown), and the phases ended since the last
            logging step (``phase/<name>/<key>``): what the step records and gathers.
        state: the model state counted (composition.ModelState), its gradients at least the
            iteration's where the activations were measured; None without a model.
        measured: the iteration's activations (activations.Measurement), where the meter was
            armed for it; None otherwise.
        optimizer_facts: the optimizer's class and whether it is sharded
            (composition.optimizer_facts); None without a model.
    """

    report: dict
    state: dict | None = None
    measured: Measurement | None = None
    optimizer_facts: dict | None = None


def measure_step(
    report: dict,
    meter: ActivationMeter,
    model_state: composition.ModelState,
    model: nn.Module | Sequence[nn.Module] | None,
    optimizer: Any,
) -> StepMeasurement:
    """The logging step's measurement, from ``report`` (this rank's numbers now, rank/memory.py's).

    Ends the activation meter's measurement where it is armed (its hooks come off), counts the
    model state through ``model_state`` (counted again only when it can change) where ``model``
    is given, and takes the memory phases ended since the last logging step. ``report`` may be
    updated in place (without a model it is the returned report). No collective; checks no
    argument (the run has, before it: composition.check_model_and_optimizer)."""
    measured = meter.finish() if meter.armed else None
    state = optimizer_facts = None
    if model is not None:
        state = model_state.report(model, optimizer)
        optimizer_facts = composition.optimizer_facts(optimizer)
        if measured is not None:  # gradients freed before this call still count: the iteration's most
            state = composition.with_iteration_grads(state, measured.grads)
        report = composition.breakdown(report, state, measured)
    report.update(phase.take_pending())  # the memory phases ended since the last logging step
    return StepMeasurement(report, state, measured, optimizer_facts)

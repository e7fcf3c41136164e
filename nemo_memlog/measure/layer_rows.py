"""What the per-layer record says of one rank's stage (measure/layer_record.py holds the format):
the stage's figures and one row per layer, from a logging iteration's activation measurement and
the model state. No collective; mutates nothing."""

from __future__ import annotations

from typing import Any

from torch import nn

from .. import parts
from ..keys import (
    DEVICE_OTHER,
    DEVICE_TOTAL,
    HOST_LIMIT,
    HOST_LIMIT_USED,
    HOST_TOTAL,
    PEAK_ALLOCATED,
    PEAK_HOST_RSS,
    PEAK_RESERVED,
)
from . import composition
from .activations import Measurement
from .layers import chunks_of

#: A stage's figures the per-layer record carries, where this rank has them.
RECORDED_STAGE_KEYS = (
    *parts.MODEL_STATE_KEYS,
    *parts.STEP_KEYS,
    PEAK_ALLOCATED.key,
    PEAK_RESERVED.key,
    DEVICE_OTHER.key,
    DEVICE_TOTAL.key,
    PEAK_HOST_RSS.key,
    HOST_TOTAL.key,
    HOST_LIMIT.key,
    HOST_LIMIT_USED.key,
)


def stage_and_rows(report: dict, measured: Measurement, model: Any, optimizer: Any, state: dict | None) -> dict:
    """``{"stage": {...}, "layers": [...]}`` for the record: ``report``'s recorded figures (the
    numbers, NaN left out), and per layer its model state (composition.layer_state, the rest of
    the stage last) and its measured activations and input per microbatch."""
    layers = measured.layers
    owned = [list(nn.Module.parameters(layer.module)) for layer in layers if layer.module is not None]
    in_layers = {id(p) for params in owned for p in params}
    rest = [p for chunk in chunks_of(model) for p in nn.Module.parameters(chunk) if id(p) not in in_layers]
    states = composition.layer_state([*owned, rest], optimizer, measured.grads, state)
    stage = {key: report[key] for key in RECORDED_STAGE_KEYS if key in report and report[key] == report[key]}
    stage.update(microbatches=measured.microbatches, chunks=len(chunks_of(model)))
    if measured.host_idle_rss_gb is not None:
        stage["host_idle_rss_gb"] = measured.host_idle_rss_gb
    rows = [
        {
            "name": layer.name,
            "kind": layer.kind,
            "chunk": layer.chunk,
            "number": layer.number,
            **layer_state,
            "activations_per_microbatch_gb": activations,
            "input_per_microbatch_gb": inputs,
        }
        for layer, layer_state, activations, inputs in zip(
            layers, states, measured.layer_activations_gb, measured.layer_inputs_gb
        )
    ]
    return {"stage": stage, "layers": rows}
